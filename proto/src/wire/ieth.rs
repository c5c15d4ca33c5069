//! The Invalidate Extended Transport Header (IETH, 4 bytes): the R_Key a Send with
//! Invalidate asks the responder to invalidate.

use super::{Result, read_u32};

mod field {
    use crate::wire::Field;

    pub(super) const RKEY: Field = 0..4;
}

/// The length of an IETH in bytes.
pub const HEADER_LEN: usize = 4;

super::header_view!("an IETH");

impl<T: AsRef<[u8]>> Packet<T> {
    /// R_Key (bytes 0-3): the remote key to invalidate.
    pub fn rkey(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::RKEY])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets R_Key.
    pub fn set_rkey(&mut self, rkey: u32) {
        self.buffer.as_mut()[field::RKEY].copy_from_slice(&rkey.to_be_bytes());
    }
}

/// A decoded IETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct IethRepr {
    /// R_Key to invalidate.
    pub rkey: u32,
}

impl IethRepr {
    /// Parses an IETH.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated) if the buffer is shorter than [`HEADER_LEN`].
    #[inline]
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<IethRepr> {
        packet.check_len()?;
        Ok(IethRepr {
            rkey: packet.rkey(),
        })
    }

    /// The length of the emitted header: [`HEADER_LEN`].
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the IETH into a buffer of at least [`HEADER_LEN`] bytes.
    #[inline]
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Packet<T>) {
        packet.set_rkey(self.rkey);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    static BYTES: [u8; 4] = [0x00, 0x12, 0x34, 0x80];

    #[test]
    fn deconstruct() {
        assert_eq!(Packet::new_checked(&BYTES[..]).unwrap().rkey(), 0x0012_3480);
    }

    #[test]
    fn construct() {
        let mut buf = [0xFFu8; 4];
        Packet::new_unchecked(&mut buf[..]).set_rkey(0x0012_3480);
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn parse_and_emit() {
        let repr = IethRepr { rkey: 0x0012_3480 };
        assert_eq!(
            IethRepr::parse(&Packet::new_unchecked(&BYTES[..])),
            Ok(repr)
        );
        let mut buf = [0u8; 4];
        repr.emit(&mut Packet::new_unchecked(&mut buf[..]));
        assert_eq!(buf, BYTES);
        assert_eq!(repr.buffer_len(), 4);
    }

    #[test]
    fn truncated() {
        for len in 0..HEADER_LEN {
            assert_eq!(Packet::new_checked(&BYTES[..len]), Err(Error::Truncated));
        }
    }
}
