//! The Atomic Extended Transport Header (AtomicETH, 28 bytes; spec 01 Figure 17-10).
//!
//! Carried by the Compare & Swap and Fetch & Add requests.
//!
//! ```text
//! +---------------------------------------------------------------+
//! |                   Virtual Address (64)                        |
//! +-------------------------------+-------------------------------+
//! |           R_Key (32)          |
//! +-------------------------------+-------------------------------+
//! |                 Swap (or Add) Data (64)                       |
//! +---------------------------------------------------------------+
//! |                     Compare Data (64)                         |
//! +---------------------------------------------------------------+
//! ```

use super::{Result, read_u32, read_u64};

mod field {
    use crate::wire::Field;

    pub(super) const VA: Field = 0..8;
    pub(super) const RKEY: Field = 8..12;
    pub(super) const SWAP_ADD: Field = 12..20;
    pub(super) const COMPARE: Field = 20..28;
}

/// The length of an AtomicETH in bytes.
pub const HEADER_LEN: usize = 28;

super::header_view!("an AtomicETH");

impl<T: AsRef<[u8]>> Packet<T> {
    /// Virtual Address (bytes 0-7): the quadword-aligned address of the 64-bit target.
    pub fn va(&self) -> u64 {
        read_u64(&self.buffer.as_ref()[field::VA])
    }

    /// R_Key (bytes 8-11): the remote key authorising access.
    pub fn rkey(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::RKEY])
    }

    /// Swap (or Add) Data (bytes 12-19): the value swapped in (Compare & Swap) or added
    /// (Fetch & Add).
    pub fn swap_add(&self) -> u64 {
        read_u64(&self.buffer.as_ref()[field::SWAP_ADD])
    }

    /// Compare Data (bytes 20-27): compared with the target (Compare & Swap only).
    pub fn compare(&self) -> u64 {
        read_u64(&self.buffer.as_ref()[field::COMPARE])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets Virtual Address.
    pub fn set_va(&mut self, va: u64) {
        self.buffer.as_mut()[field::VA].copy_from_slice(&va.to_be_bytes());
    }

    /// Sets R_Key.
    pub fn set_rkey(&mut self, rkey: u32) {
        self.buffer.as_mut()[field::RKEY].copy_from_slice(&rkey.to_be_bytes());
    }

    /// Sets Swap (or Add) Data.
    pub fn set_swap_add(&mut self, v: u64) {
        self.buffer.as_mut()[field::SWAP_ADD].copy_from_slice(&v.to_be_bytes());
    }

    /// Sets Compare Data.
    pub fn set_compare(&mut self, v: u64) {
        self.buffer.as_mut()[field::COMPARE].copy_from_slice(&v.to_be_bytes());
    }
}

/// A decoded AtomicETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AtomicEthRepr {
    /// Virtual Address.
    pub va: u64,
    /// R_Key.
    pub rkey: u32,
    /// Swap (or Add) Data.
    pub swap_add: u64,
    /// Compare Data.
    pub compare: u64,
}

impl AtomicEthRepr {
    /// Parses an AtomicETH.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated) if the buffer is shorter than [`HEADER_LEN`].
    #[inline]
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<AtomicEthRepr> {
        packet.check_len()?;
        Ok(AtomicEthRepr {
            va: packet.va(),
            rkey: packet.rkey(),
            swap_add: packet.swap_add(),
            compare: packet.compare(),
        })
    }

    /// The length of the emitted header: [`HEADER_LEN`].
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the AtomicETH into a buffer of at least [`HEADER_LEN`] bytes.
    #[inline]
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Packet<T>) {
        packet.set_va(self.va);
        packet.set_rkey(self.rkey);
        packet.set_swap_add(self.swap_add);
        packet.set_compare(self.compare);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    static BYTES: [u8; 28] = [
        0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x10, 0x08, // VA
        0x01, 0x02, 0x03, 0x04, // R_Key
        0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFE, // swap
        0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, // compare
    ];

    fn repr() -> AtomicEthRepr {
        AtomicEthRepr {
            va: 0x0000_0001_0000_1008,
            rkey: 0x0102_0304,
            swap_add: 0xFFFF_FFFF_FFFF_FFFE,
            compare: 0x8000_0000_0000_0001,
        }
    }

    #[test]
    fn deconstruct() {
        let p = Packet::new_checked(&BYTES[..]).unwrap();
        assert_eq!(p.va(), 0x0000_0001_0000_1008);
        assert_eq!(p.rkey(), 0x0102_0304);
        assert_eq!(p.swap_add(), 0xFFFF_FFFF_FFFF_FFFE);
        assert_eq!(p.compare(), 0x8000_0000_0000_0001);
    }

    #[test]
    fn construct() {
        let mut buf = [0x33u8; 28];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_va(0x0000_0001_0000_1008);
        p.set_rkey(0x0102_0304);
        p.set_swap_add(0xFFFF_FFFF_FFFF_FFFE);
        p.set_compare(0x8000_0000_0000_0001);
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn parse_and_emit() {
        assert_eq!(
            AtomicEthRepr::parse(&Packet::new_unchecked(&BYTES[..])),
            Ok(repr())
        );
        let mut buf = [0u8; 28];
        repr().emit(&mut Packet::new_unchecked(&mut buf[..]));
        assert_eq!(buf, BYTES);
        assert_eq!(repr().buffer_len(), 28);
    }

    #[test]
    fn truncated() {
        for len in 0..HEADER_LEN {
            assert_eq!(Packet::new_checked(&BYTES[..len]), Err(Error::Truncated));
            assert_eq!(
                AtomicEthRepr::parse(&Packet::new_unchecked(&BYTES[..len])),
                Err(Error::Truncated)
            );
        }
    }
}
