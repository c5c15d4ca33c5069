//! The RDMA Extended Transport Header (RETH, 16 bytes; spec 01 Figures 17-7 and 17-8).
//!
//! Carried by RDMA Write First/Only (with or without Immediate) and the RDMA Read Request.
//!
//! ```text
//! +---------------------------------------------------------------+
//! |                   Virtual Address (64)                        |
//! +-------------------------------+-------------------------------+
//! |           R_Key (32)          |        DMA Length (32)        |
//! +-------------------------------+-------------------------------+
//! ```

use super::{Result, read_u32, read_u64};

mod field {
    use crate::wire::Field;

    pub(super) const VA: Field = 0..8;
    pub(super) const RKEY: Field = 8..12;
    pub(super) const DMA_LEN: Field = 12..16;
}

/// The length of a RETH in bytes.
pub const HEADER_LEN: usize = 16;

super::header_view!("a RETH");

impl<T: AsRef<[u8]>> Packet<T> {
    /// Virtual Address (bytes 0-7): where in the responder's memory region the transfer starts.
    pub fn va(&self) -> u64 {
        read_u64(&self.buffer.as_ref()[field::VA])
    }

    /// R_Key (bytes 8-11): the remote key authorising access to that region.
    pub fn rkey(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::RKEY])
    }

    /// DMA Length (bytes 12-15): the length of the whole RDMA operation in bytes.
    pub fn dma_len(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::DMA_LEN])
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

    /// Sets DMA Length.
    pub fn set_dma_len(&mut self, len: u32) {
        self.buffer.as_mut()[field::DMA_LEN].copy_from_slice(&len.to_be_bytes());
    }
}

/// A decoded RETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RethRepr {
    /// Virtual Address.
    pub va: u64,
    /// R_Key.
    pub rkey: u32,
    /// DMA Length.
    pub dma_len: u32,
}

impl RethRepr {
    /// Parses a RETH.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated) if the buffer is shorter than [`HEADER_LEN`].
    #[inline]
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<RethRepr> {
        packet.check_len()?;
        Ok(RethRepr {
            va: packet.va(),
            rkey: packet.rkey(),
            dma_len: packet.dma_len(),
        })
    }

    /// The length of the emitted header: [`HEADER_LEN`].
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the RETH into a buffer of at least [`HEADER_LEN`] bytes.
    #[inline]
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Packet<T>) {
        packet.set_va(self.va);
        packet.set_rkey(self.rkey);
        packet.set_dma_len(self.dma_len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    static BYTES: [u8; 16] = [
        0x00, 0x00, 0x7F, 0x12, 0x34, 0x56, 0x78, 0x9A, // VA
        0xDE, 0xAD, 0xBE, 0xEF, // R_Key
        0x00, 0x00, 0x18, 0x00, // DMA length 6144
    ];

    fn repr() -> RethRepr {
        RethRepr {
            va: 0x0000_7F12_3456_789A,
            rkey: 0xDEAD_BEEF,
            dma_len: 6144,
        }
    }

    #[test]
    fn deconstruct() {
        let p = Packet::new_checked(&BYTES[..]).unwrap();
        assert_eq!(p.va(), 0x0000_7F12_3456_789A);
        assert_eq!(p.rkey(), 0xDEAD_BEEF);
        assert_eq!(p.dma_len(), 6144);
    }

    #[test]
    fn construct() {
        let mut buf = [0xA5u8; 16];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_va(0x0000_7F12_3456_789A);
        p.set_rkey(0xDEAD_BEEF);
        p.set_dma_len(6144);
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn parse_and_emit() {
        assert_eq!(
            RethRepr::parse(&Packet::new_unchecked(&BYTES[..])),
            Ok(repr())
        );
        let mut buf = [0u8; 16];
        repr().emit(&mut Packet::new_unchecked(&mut buf[..]));
        assert_eq!(buf, BYTES);
        assert_eq!(repr().buffer_len(), 16);
    }

    #[test]
    fn extreme_values() {
        let max = RethRepr {
            va: u64::MAX,
            rkey: u32::MAX,
            dma_len: u32::MAX,
        };
        let mut buf = [0u8; 16];
        max.emit(&mut Packet::new_unchecked(&mut buf[..]));
        assert_eq!(buf, [0xFF; 16]);
        assert_eq!(RethRepr::parse(&Packet::new_unchecked(&buf[..])), Ok(max));
    }

    #[test]
    fn truncated() {
        for len in 0..HEADER_LEN {
            assert_eq!(Packet::new_checked(&BYTES[..len]), Err(Error::Truncated));
            assert_eq!(
                RethRepr::parse(&Packet::new_unchecked(&BYTES[..len])),
                Err(Error::Truncated)
            );
        }
    }
}
