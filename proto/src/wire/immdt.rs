//! Immediate Data (ImmDt, 4 bytes; spec 01 Figure 17-5): the 32 bits an RDMA Write or Send
//! "with Immediate" hands to the responder's completion, kept exactly as on the wire.

use super::{Result, read_u32};

mod field {
    use crate::wire::Field;

    pub(super) const IMM: Field = 0..4;
}

/// The length of an ImmDt in bytes.
pub const HEADER_LEN: usize = 4;

super::header_view!("an ImmDt");

impl<T: AsRef<[u8]>> Packet<T> {
    /// Immediate Data (bytes 0-3), as a big-endian number: the first wire byte is the most
    /// significant.
    pub fn imm(&self) -> u32 {
        read_u32(&self.buffer.as_ref()[field::IMM])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets Immediate Data (big-endian).
    pub fn set_imm(&mut self, imm: u32) {
        self.buffer.as_mut()[field::IMM].copy_from_slice(&imm.to_be_bytes());
    }
}

/// Decoded Immediate Data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ImmDtRepr {
    /// The 32 bits, read big-endian from the wire.
    pub imm: u32,
}

impl ImmDtRepr {
    /// Parses an ImmDt.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`](super::Error::Truncated) if the buffer is shorter than [`HEADER_LEN`].
    #[inline]
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<ImmDtRepr> {
        packet.check_len()?;
        Ok(ImmDtRepr { imm: packet.imm() })
    }

    /// The length of the emitted header: [`HEADER_LEN`].
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the ImmDt into a buffer of at least [`HEADER_LEN`] bytes.
    #[inline]
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Packet<T>) {
        packet.set_imm(self.imm);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Error;

    static BYTES: [u8; 4] = [0xCA, 0xFE, 0x00, 0x01];

    #[test]
    fn deconstruct() {
        assert_eq!(Packet::new_checked(&BYTES[..]).unwrap().imm(), 0xCAFE_0001);
    }

    #[test]
    fn construct() {
        let mut buf = [0u8; 4];
        Packet::new_unchecked(&mut buf[..]).set_imm(0xCAFE_0001);
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn parse_and_emit() {
        let repr = ImmDtRepr { imm: 0xCAFE_0001 };
        assert_eq!(
            ImmDtRepr::parse(&Packet::new_unchecked(&BYTES[..])),
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
