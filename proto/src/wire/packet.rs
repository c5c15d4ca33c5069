//! A whole RC transport header stack: the BTH and the extended headers its opcode calls for.
//!
//! The payload is not part of the repr: [`PacketRepr::parse`] returns where it starts, and
//! [`PacketRepr::data_len`] checks its length against the pad count and the opcode.

use super::opcode::{Headers, Opcode, OpcodeInfo};
use super::{
    AethRepr, AtomicAckEthRepr, AtomicEthRepr, BthRepr, Error, IethRepr, ImmDtRepr, Result,
    RethRepr, aeth, atomic_ack_eth, atomic_eth, bth, ieth, immdt, reth,
};

/// The largest BTH + extended-header length of any RC opcode (BTH 12 + AtomicETH 28).
pub const MAX_HEADER_LEN: usize = super::opcode::max_header_len();

/// The transport headers of one RC packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PacketRepr {
    /// The Base Transport Header.
    pub bth: BthRepr,
    /// RETH (RDMA Write First/Only, RDMA Read Request).
    pub reth: Option<RethRepr>,
    /// AETH (Acknowledge, Atomic Acknowledge, RDMA Read Response First/Last/Only).
    pub aeth: Option<AethRepr>,
    /// AtomicETH (Compare & Swap, Fetch & Add).
    pub atomic_eth: Option<AtomicEthRepr>,
    /// AtomicAckETH (Atomic Acknowledge).
    pub atomic_ack_eth: Option<AtomicAckEthRepr>,
    /// Immediate Data (the "with Immediate" opcodes).
    pub immdt: Option<ImmDtRepr>,
    /// IETH (the "with Invalidate" opcodes).
    pub ieth: Option<IethRepr>,
}

impl PacketRepr {
    /// A packet with the given BTH and no extended header (fill in the ones its opcode needs).
    pub const fn new(bth: BthRepr) -> PacketRepr {
        PacketRepr {
            bth,
            reth: None,
            aeth: None,
            atomic_eth: None,
            atomic_ack_eth: None,
            immdt: None,
            ieth: None,
        }
    }

    /// Parses the BTH and the extended headers the opcode table says follow it.
    ///
    /// Returns the repr and the header length (the offset where the payload starts).
    /// Bytes after the headers are not looked at: `bytes` may hold the headers alone.
    ///
    /// # Errors
    ///
    /// * [`Error::Truncated`] if `bytes` ends before the BTH or an extended header does;
    /// * [`Error::UnsupportedVersion`] if TVer is not 0;
    /// * [`Error::UnknownOpcode`] for an opcode that is not an implemented RC opcode;
    /// * [`Error::PadWithoutPayload`] for a non-zero pad count on an opcode without payload.
    #[inline]
    pub fn parse(bytes: &[u8]) -> Result<(PacketRepr, usize)> {
        let bth = BthRepr::parse(&bth::Packet::new_checked(bytes)?)?;
        let info = opcode_info(bth.opcode)?;
        check_pad(&bth, info)?;
        // One length check for the whole header stack; each extended header then sits at
        // a fixed offset, in wire order.
        let len = info.header_len();
        if bytes.len() < len {
            return Err(Error::Truncated);
        }
        let h = info.headers;
        let mut repr = PacketRepr::new(bth);
        let mut off = bth::HEADER_LEN;
        let mut take = |n: usize| {
            let at = off;
            off += n;
            &bytes[at..at + n]
        };
        if h.contains(Headers::RETH) {
            let b = take(reth::HEADER_LEN);
            repr.reth = Some(RethRepr::parse(&reth::Packet::new_unchecked(b))?);
        }
        if h.contains(Headers::ATOMIC_ETH) {
            let b = take(atomic_eth::HEADER_LEN);
            repr.atomic_eth = Some(AtomicEthRepr::parse(&atomic_eth::Packet::new_unchecked(b))?);
        }
        if h.contains(Headers::AETH) {
            let b = take(aeth::HEADER_LEN);
            repr.aeth = Some(AethRepr::parse(&aeth::Packet::new_unchecked(b))?);
        }
        if h.contains(Headers::ATOMIC_ACK_ETH) {
            let b = take(atomic_ack_eth::HEADER_LEN);
            repr.atomic_ack_eth = Some(AtomicAckEthRepr::parse(
                &atomic_ack_eth::Packet::new_unchecked(b),
            )?);
        }
        if h.contains(Headers::IMMDT) {
            let b = take(immdt::HEADER_LEN);
            repr.immdt = Some(ImmDtRepr::parse(&immdt::Packet::new_unchecked(b))?);
        }
        if h.contains(Headers::IETH) {
            let b = take(ieth::HEADER_LEN);
            repr.ieth = Some(IethRepr::parse(&ieth::Packet::new_unchecked(b))?);
        }
        debug_assert_eq!(off, len, "the opcode table's header length");
        Ok((repr, len))
    }

    /// The extended headers present in this repr.
    pub fn headers(&self) -> Headers {
        let mut h = Headers::NONE;
        if self.reth.is_some() {
            h = h | Headers::RETH;
        }
        if self.atomic_eth.is_some() {
            h = h | Headers::ATOMIC_ETH;
        }
        if self.aeth.is_some() {
            h = h | Headers::AETH;
        }
        if self.atomic_ack_eth.is_some() {
            h = h | Headers::ATOMIC_ACK_ETH;
        }
        if self.immdt.is_some() {
            h = h | Headers::IMMDT;
        }
        if self.ieth.is_some() {
            h = h | Headers::IETH;
        }
        h
    }

    /// The length of the BTH plus the extended headers present: the bytes
    /// [`emit`](PacketRepr::emit) writes and the offset of the payload.
    pub fn header_len(&self) -> usize {
        bth::HEADER_LEN + self.headers().len()
    }

    /// The opcode table's row for this packet's opcode.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownOpcode`] if the opcode is not an implemented RC opcode.
    pub fn info(&self) -> Result<&'static OpcodeInfo> {
        opcode_info(self.bth.opcode)
    }

    /// Writes the BTH and the extended headers in wire order into the front of `buf`;
    /// returns the number of bytes written ([`header_len`](PacketRepr::header_len)).
    ///
    /// Never panics; `buf` may be longer than the headers (the rest is left untouched).
    ///
    /// # Errors
    ///
    /// * [`Error::UnknownOpcode`] if the opcode is not an implemented RC opcode;
    /// * [`Error::HeadersMismatch`] if the extended headers present are not exactly those
    ///   the opcode's table row lists;
    /// * [`Error::UnsupportedVersion`] if `bth.tver` is not 0;
    /// * [`Error::PadWithoutPayload`] for a non-zero pad count on an opcode without payload;
    /// * [`Error::Malformed`] if `bth.pad_count` is more than 3;
    /// * [`Error::Truncated`] if `buf` is shorter than `header_len()`.
    ///
    /// Nothing is written when an error is returned.
    #[inline]
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let info = self.info()?;
        let found = self.headers();
        if found != info.headers {
            return Err(Error::HeadersMismatch {
                opcode: self.bth.opcode,
                expected: info.headers,
                found,
            });
        }
        if self.bth.tver != 0 {
            return Err(Error::UnsupportedVersion(self.bth.tver));
        }
        if self.bth.pad_count > 3 {
            return Err(Error::Malformed("BTH pad count is more than 3"));
        }
        check_pad(&self.bth, info)?;
        let len = self.header_len();
        let buf = buf.get_mut(..len).ok_or(Error::Truncated)?;

        let (head, mut rest) = buf.split_at_mut(bth::HEADER_LEN);
        self.bth.emit(&mut bth::Packet::new_unchecked(head));
        if let Some(r) = &self.reth {
            let (h, t) = rest.split_at_mut(reth::HEADER_LEN);
            r.emit(&mut reth::Packet::new_unchecked(h));
            rest = t;
        }
        if let Some(r) = &self.atomic_eth {
            let (h, t) = rest.split_at_mut(atomic_eth::HEADER_LEN);
            r.emit(&mut atomic_eth::Packet::new_unchecked(h));
            rest = t;
        }
        if let Some(r) = &self.aeth {
            let (h, t) = rest.split_at_mut(aeth::HEADER_LEN);
            r.emit(&mut aeth::Packet::new_unchecked(h));
            rest = t;
        }
        if let Some(r) = &self.atomic_ack_eth {
            let (h, t) = rest.split_at_mut(atomic_ack_eth::HEADER_LEN);
            r.emit(&mut atomic_ack_eth::Packet::new_unchecked(h));
            rest = t;
        }
        if let Some(r) = &self.immdt {
            let (h, t) = rest.split_at_mut(immdt::HEADER_LEN);
            r.emit(&mut immdt::Packet::new_unchecked(h));
            rest = t;
        }
        if let Some(r) = &self.ieth {
            let (h, t) = rest.split_at_mut(ieth::HEADER_LEN);
            r.emit(&mut ieth::Packet::new_unchecked(h));
            rest = t;
        }
        debug_assert!(rest.is_empty());
        Ok(len)
    }

    /// Checks a received payload of `payload_len` bytes (everything after the headers, pad
    /// bytes included, ICRC excluded) against the opcode and the pad count, and returns
    /// the length of the message data in it (`payload_len - pad_count`).
    ///
    /// # Errors
    ///
    /// * [`Error::UnknownOpcode`] if the opcode is not an implemented RC opcode;
    /// * [`Error::Malformed`] if an opcode without payload has payload bytes, or the pad
    ///   count is larger than the payload.
    pub fn data_len(&self, payload_len: usize) -> Result<usize> {
        let info = self.info()?;
        if !info.payload && payload_len != 0 {
            return Err(Error::Malformed("payload on an opcode that carries none"));
        }
        payload_len
            .checked_sub(usize::from(self.bth.pad_count))
            .ok_or(Error::Malformed("BTH pad count is larger than the payload"))
    }
}

fn opcode_info(opcode: Opcode) -> Result<&'static OpcodeInfo> {
    opcode.info().ok_or(Error::UnknownOpcode(opcode.code()))
}

fn check_pad(bth: &BthRepr, info: &OpcodeInfo) -> Result<()> {
    if bth.pad_count != 0 && !info.payload {
        Err(Error::PadWithoutPayload {
            opcode: bth.opcode,
            pad_count: bth.pad_count,
        })
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::psn::Psn;
    use crate::wire::{CreditCode, Msn, Qpn, Syndrome};

    /// An Atomic Acknowledge: BTH, AETH (Ack, no credit count, MSN 7), AtomicAckETH.
    static ATOMIC_ACK: [u8; 24] = [
        0x12, 0x00, 0xFF, 0xFF, 0x00, 0x00, 0x00, 0x2A, 0x00, 0x00, 0x01, 0x12, // BTH
        0x1F, 0x00, 0x00, 0x07, // AETH
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x05, // AtomicAckETH
    ];

    fn atomic_ack() -> PacketRepr {
        PacketRepr {
            aeth: Some(AethRepr {
                syndrome: Syndrome::Ack {
                    credits: CreditCode::NONE,
                },
                msn: Msn::new(7),
            }),
            atomic_ack_eth: Some(AtomicAckEthRepr { orig: 5 }),
            ..PacketRepr::new(BthRepr::new(
                Opcode::AtomicAcknowledge,
                Qpn::new(0x2A),
                Psn::new(274),
            ))
        }
    }

    #[test]
    fn parse_atomic_ack() {
        assert_eq!(PacketRepr::parse(&ATOMIC_ACK), Ok((atomic_ack(), 24)));
    }

    #[test]
    fn emit_atomic_ack() {
        let mut buf = [0xEEu8; 30];
        assert_eq!(atomic_ack().emit(&mut buf), Ok(24));
        assert_eq!(buf[..24], ATOMIC_ACK);
        assert_eq!(buf[24..], [0xEE; 6]);
    }

    #[test]
    fn emit_rejects_and_writes_nothing() {
        let mut buf = [0xEEu8; 40];
        let mut missing = atomic_ack();
        missing.atomic_ack_eth = None;
        assert_eq!(
            missing.emit(&mut buf),
            Err(Error::HeadersMismatch {
                opcode: Opcode::AtomicAcknowledge,
                expected: Headers::AETH | Headers::ATOMIC_ACK_ETH,
                found: Headers::AETH
            })
        );
        assert_eq!(atomic_ack().emit(&mut buf[..23]), Err(Error::Truncated));
        let mut unknown = atomic_ack();
        unknown.bth.opcode = Opcode::Unknown(0x64);
        assert_eq!(unknown.emit(&mut buf), Err(Error::UnknownOpcode(0x64)));
        let mut padded = atomic_ack();
        padded.bth.pad_count = 1;
        assert!(matches!(
            padded.emit(&mut buf),
            Err(Error::PadWithoutPayload { .. })
        ));
        assert_eq!(buf, [0xEE; 40]);
    }

    #[test]
    fn data_len_checks_pad_and_payload() {
        let mut send = PacketRepr::new(BthRepr::new(Opcode::SendOnly, Qpn::new(1), Psn::new(0)));
        send.bth.pad_count = 3;
        assert_eq!(send.data_len(8), Ok(5));
        assert_eq!(send.data_len(3), Ok(0));
        assert!(matches!(send.data_len(2), Err(Error::Malformed(_))));
        assert_eq!(atomic_ack().data_len(0), Ok(0));
        assert!(matches!(atomic_ack().data_len(4), Err(Error::Malformed(_))));
    }

    #[test]
    fn max_header_len_is_bth_plus_atomic_eth() {
        assert_eq!(MAX_HEADER_LEN, 40);
    }
}
