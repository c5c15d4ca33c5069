//! The Atomic Acknowledge Extended Transport Header (AtomicAckETH, 8 bytes; spec 01
//! Figure 17-11): the original remote data an atomic operation read, returned in the
//! Atomic Acknowledge after the AETH.

use super::{Result, read_u64};

mod field {
    use crate::wire::Field;

    pub(super) const ORIG: Field = 0..8;
}

/// The length of an AtomicAckETH in bytes.
pub const HEADER_LEN: usize = 8;

super::header_view!("an AtomicAckETH");

impl<T: AsRef<[u8]>> Packet<T> {
    /// Original Remote Data (bytes 0-7): the 64-bit value at the target before the atomic
    /// operation.
    pub fn orig(&self) -> u64 {
        read_u64(&self.buffer.as_ref()[field::ORIG])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets Original Remote Data.
    pub fn set_orig(&mut self, v: u64) {
        self.buffer.as_mut()[field::ORIG].copy_from_slice(&v.to_be_bytes());
    }
}

/// A decoded AtomicAckETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AtomicAckEthRepr {
    /// Original Remote Data.
    pub orig: u64,
}

impl AtomicAckEthRepr {
    /// Parses an AtomicAckETH.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated) if the buffer is shorter than [`HEADER_LEN`].
    #[inline]
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<AtomicAckEthRepr> {
        packet.check_len()?;
        Ok(AtomicAckEthRepr {
            orig: packet.orig(),
        })
    }

    /// The length of the emitted header: [`HEADER_LEN`].
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the AtomicAckETH into a buffer of at least [`HEADER_LEN`] bytes.
    #[inline]
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Packet<T>) {
        packet.set_orig(self.orig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    static BYTES: [u8; 8] = [0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF];

    #[test]
    fn deconstruct() {
        assert_eq!(
            Packet::new_checked(&BYTES[..]).unwrap().orig(),
            0x0123_4567_89AB_CDEF
        );
    }

    #[test]
    fn construct() {
        let mut buf = [0u8; 8];
        Packet::new_unchecked(&mut buf[..]).set_orig(0x0123_4567_89AB_CDEF);
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn parse_and_emit() {
        let repr = AtomicAckEthRepr {
            orig: 0x0123_4567_89AB_CDEF,
        };
        assert_eq!(
            AtomicAckEthRepr::parse(&Packet::new_unchecked(&BYTES[..])),
            Ok(repr)
        );
        let mut buf = [0xFFu8; 8];
        repr.emit(&mut Packet::new_unchecked(&mut buf[..]));
        assert_eq!(buf, BYTES);
        assert_eq!(repr.buffer_len(), 8);
    }

    #[test]
    fn truncated() {
        for len in 0..HEADER_LEN {
            assert_eq!(Packet::new_checked(&BYTES[..len]), Err(Error::Truncated));
        }
    }
}
