//! The Base Transport Header (BTH, 12 bytes; spec 01 Figure 17-4, DESIGN.md "Wire constants").
//!
//! ```text
//!  byte 0      byte 1                 bytes 2-3
//! +-----------+--+--+------+------+------------------+
//! | OpCode    |SE|M |PadCnt| TVer |      P_Key       |
//! +-----------+--+--+------+------+------------------+
//! | reserved8 |            DestQP (24)               |
//! +--+--------+--------------------------------------+
//! |A | resv7  |            PSN (24)                  |
//! +--+--------+--------------------------------------+
//! ```

use super::opcode::Opcode;
use super::{Error, Qpn, Result, read_u24, write_u24};
use crate::psn::Psn;

mod field {
    use crate::wire::Field;

    pub(super) const OPCODE: usize = 0;
    /// SE (bit 7), M (bit 6), PadCnt (bits 5:4), TVer (bits 3:0).
    pub(super) const FLAGS: usize = 1;
    pub(super) const PKEY: Field = 2..4;
    /// Reserved (resv8a); masked to ones in the ICRC.
    pub(super) const RESV8A: usize = 4;
    pub(super) const DEST_QP: Field = 5..8;
    /// AckReq (bit 7), reserved (bits 6:0).
    pub(super) const ACK_REQ: usize = 8;
    pub(super) const PSN: Field = 9..12;
}

/// The length of a BTH in bytes.
pub const HEADER_LEN: usize = 12;

/// The byte offset of the reserved byte (resv8a) in the BTH, which the ICRC covers as all
/// ones (it carries the FECN/BECN bits on RoCE fabrics).
pub const RESV8A_OFFSET: usize = field::RESV8A;

const SE_BIT: u8 = 0x80;
const MIG_REQ_BIT: u8 = 0x40;
const PAD_SHIFT: u8 = 4;
const PAD_MASK: u8 = 0x03;
const TVER_MASK: u8 = 0x0F;
const ACK_REQ_BIT: u8 = 0x80;

super::header_view!("a BTH");

impl<T: AsRef<[u8]>> Packet<T> {
    /// OpCode (byte 0): the operation, and so which headers follow.
    pub fn opcode(&self) -> Opcode {
        Opcode::from(self.buffer.as_ref()[field::OPCODE])
    }

    /// SE, Solicited Event (byte 1 bit 7): the responder should raise a solicited event.
    pub fn solicited(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & SE_BIT != 0
    }

    /// M, MigReq (byte 1 bit 6): path migration state.
    pub fn mig_req(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & MIG_REQ_BIT != 0
    }

    /// PadCnt (byte 1 bits 5:4): bytes of padding at the end of the payload (0..=3).
    pub fn pad_count(&self) -> u8 {
        (self.buffer.as_ref()[field::FLAGS] >> PAD_SHIFT) & PAD_MASK
    }

    /// TVer, Transport Header Version (byte 1 bits 3:0); 0 is the only defined version.
    pub fn tver(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS] & TVER_MASK
    }

    /// P_Key, Partition Key (bytes 2-3).
    pub fn pkey(&self) -> u16 {
        let b = &self.buffer.as_ref()[field::PKEY];
        u16::from_be_bytes([b[0], b[1]])
    }

    /// The reserved byte 4 (resv8a), ignored on receive.
    pub fn resv8a(&self) -> u8 {
        self.buffer.as_ref()[field::RESV8A]
    }

    /// DestQP, Destination QP number (bytes 5-7).
    pub fn dest_qp(&self) -> Qpn {
        Qpn::new(read_u24(&self.buffer.as_ref()[field::DEST_QP]))
    }

    /// A, AckReq (byte 8 bit 7): the requester asks for an acknowledgement of this packet.
    pub fn ack_req(&self) -> bool {
        self.buffer.as_ref()[field::ACK_REQ] & ACK_REQ_BIT != 0
    }

    /// PSN, Packet Sequence Number (bytes 9-11).
    pub fn psn(&self) -> Psn {
        Psn::new(read_u24(&self.buffer.as_ref()[field::PSN]))
    }

    /// The bytes after the BTH.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets OpCode.
    pub fn set_opcode(&mut self, opcode: Opcode) {
        self.buffer.as_mut()[field::OPCODE] = opcode.code();
    }

    fn set_flag(&mut self, byte: usize, bit: u8, on: bool) {
        let b = &mut self.buffer.as_mut()[byte];
        if on {
            *b |= bit;
        } else {
            *b &= !bit;
        }
    }

    /// Sets SE.
    pub fn set_solicited(&mut self, on: bool) {
        self.set_flag(field::FLAGS, SE_BIT, on);
    }

    /// Sets M (MigReq).
    pub fn set_mig_req(&mut self, on: bool) {
        self.set_flag(field::FLAGS, MIG_REQ_BIT, on);
    }

    /// Sets PadCnt from the low 2 bits of `pad`.
    pub fn set_pad_count(&mut self, pad: u8) {
        let b = &mut self.buffer.as_mut()[field::FLAGS];
        *b = (*b & !(PAD_MASK << PAD_SHIFT)) | ((pad & PAD_MASK) << PAD_SHIFT);
    }

    /// Sets TVer from the low 4 bits of `tver`.
    pub fn set_tver(&mut self, tver: u8) {
        let b = &mut self.buffer.as_mut()[field::FLAGS];
        *b = (*b & !TVER_MASK) | (tver & TVER_MASK);
    }

    /// Sets P_Key.
    pub fn set_pkey(&mut self, pkey: u16) {
        self.buffer.as_mut()[field::PKEY].copy_from_slice(&pkey.to_be_bytes());
    }

    /// Sets the reserved byte 4 (transmitted as 0).
    pub fn set_resv8a(&mut self, v: u8) {
        self.buffer.as_mut()[field::RESV8A] = v;
    }

    /// Sets DestQP.
    pub fn set_dest_qp(&mut self, qpn: Qpn) {
        write_u24(&mut self.buffer.as_mut()[field::DEST_QP], qpn.get());
    }

    /// Sets AckReq and clears the 7 reserved bits beside it.
    pub fn set_ack_req(&mut self, on: bool) {
        self.buffer.as_mut()[field::ACK_REQ] = if on { ACK_REQ_BIT } else { 0 };
    }

    /// Sets PSN.
    pub fn set_psn(&mut self, psn: Psn) {
        write_u24(&mut self.buffer.as_mut()[field::PSN], psn.get());
    }

    /// The bytes after the BTH, writable.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[HEADER_LEN..]
    }
}

/// A decoded BTH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BthRepr {
    /// OpCode.
    pub opcode: Opcode,
    /// SE, Solicited Event.
    pub solicited: bool,
    /// M, MigReq.
    pub mig_req: bool,
    /// PadCnt, 0..=3 (emit keeps the low 2 bits).
    pub pad_count: u8,
    /// TVer, 0 (emit keeps the low 4 bits).
    pub tver: u8,
    /// P_Key.
    pub pkey: u16,
    /// DestQP.
    pub dest_qp: Qpn,
    /// AckReq.
    pub ack_req: bool,
    /// PSN.
    pub psn: Psn,
}

impl BthRepr {
    /// The default partition key (full membership of the default partition).
    pub const DEFAULT_PKEY: u16 = 0xFFFF;

    /// A BTH with the given opcode, destination QP and PSN, no flags, pad count 0, TVer 0
    /// and the default P_Key.
    pub const fn new(opcode: Opcode, dest_qp: Qpn, psn: Psn) -> BthRepr {
        BthRepr {
            opcode,
            solicited: false,
            mig_req: false,
            pad_count: 0,
            tver: 0,
            pkey: Self::DEFAULT_PKEY,
            dest_qp,
            ack_req: false,
            psn,
        }
    }

    /// Parses a BTH. Any opcode is accepted here (the opcode table is applied by
    /// [`PacketRepr::parse`](super::packet::PacketRepr::parse)); reserved bits are ignored.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`] if the buffer is shorter than [`HEADER_LEN`];
    /// [`Error::UnsupportedVersion`] if TVer is not 0.
    #[inline]
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<BthRepr> {
        packet.check_len()?;
        if packet.tver() != 0 {
            return Err(Error::UnsupportedVersion(packet.tver()));
        }
        Ok(BthRepr {
            opcode: packet.opcode(),
            solicited: packet.solicited(),
            mig_req: packet.mig_req(),
            pad_count: packet.pad_count(),
            tver: packet.tver(),
            pkey: packet.pkey(),
            dest_qp: packet.dest_qp(),
            ack_req: packet.ack_req(),
            psn: packet.psn(),
        })
    }

    /// The length of the emitted header: [`HEADER_LEN`].
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the BTH (reserved fields as zero) into a buffer of at least [`HEADER_LEN`]
    /// bytes; panics on a shorter buffer (use `Packet::new_checked`).
    #[inline]
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut Packet<T>) {
        packet.set_opcode(self.opcode);
        packet.buffer.as_mut()[field::FLAGS] = 0;
        packet.set_solicited(self.solicited);
        packet.set_mig_req(self.mig_req);
        packet.set_pad_count(self.pad_count);
        packet.set_tver(self.tver);
        packet.set_pkey(self.pkey);
        packet.set_resv8a(0);
        packet.set_dest_qp(self.dest_qp);
        packet.set_ack_req(self.ack_req);
        packet.set_psn(self.psn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Send Only, SE, PadCnt 2, TVer 0, P_Key 0xFFFF, DestQP 0xFFFFFF, AckReq, PSN 0xFFFFFF.
    static BYTES_EDGE: [u8; 12] = [
        0x04, 0xA0, 0xFF, 0xFF, 0x00, 0xFF, 0xFF, 0xFF, 0x80, 0xFF, 0xFF, 0xFF,
    ];
    // RDMA Read Request, M, P_Key 0x8001, DestQP 0x000012, PSN 201 (0xC9).
    static BYTES_READ: [u8; 12] = [
        0x0C, 0x40, 0x80, 0x01, 0x00, 0x00, 0x00, 0x12, 0x00, 0x00, 0x00, 0xC9,
    ];

    fn edge_repr() -> BthRepr {
        BthRepr {
            opcode: Opcode::SendOnly,
            solicited: true,
            mig_req: false,
            pad_count: 2,
            tver: 0,
            pkey: 0xFFFF,
            dest_qp: Qpn::new(0xFF_FFFF),
            ack_req: true,
            psn: Psn::new(0xFF_FFFF),
        }
    }

    #[test]
    fn deconstruct() {
        let p = Packet::new_checked(&BYTES_EDGE[..]).unwrap();
        assert_eq!(p.opcode(), Opcode::SendOnly);
        assert!(p.solicited());
        assert!(!p.mig_req());
        assert_eq!(p.pad_count(), 2);
        assert_eq!(p.tver(), 0);
        assert_eq!(p.pkey(), 0xFFFF);
        assert_eq!(p.resv8a(), 0);
        assert_eq!(p.dest_qp(), Qpn::new(0xFF_FFFF));
        assert!(p.ack_req());
        assert_eq!(p.psn(), Psn::new(0xFF_FFFF));
        assert!(p.payload().is_empty());

        let p = Packet::new_checked(&BYTES_READ[..]).unwrap();
        assert_eq!(p.opcode(), Opcode::RdmaReadRequest);
        assert!(!p.solicited());
        assert!(p.mig_req());
        assert_eq!(p.pad_count(), 0);
        assert_eq!(p.pkey(), 0x8001);
        assert_eq!(p.dest_qp().get(), 0x12);
        assert!(!p.ack_req());
        assert_eq!(p.psn().get(), 201);
    }

    #[test]
    fn construct() {
        let mut buf = [0x5Au8; 12];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_opcode(Opcode::SendOnly);
        p.set_tver(0);
        p.set_solicited(true);
        p.set_mig_req(false);
        p.set_pad_count(2);
        p.set_pkey(0xFFFF);
        p.set_resv8a(0);
        p.set_dest_qp(Qpn::new(0xFF_FFFF));
        p.set_ack_req(true);
        p.set_psn(Psn::new(0xFF_FFFF));
        // Byte 1 started as 0x5A: setting each field must clear the bits it owns.
        assert_eq!(buf, BYTES_EDGE);
    }

    #[test]
    fn parse_and_emit() {
        let repr = BthRepr::parse(&Packet::new_checked(&BYTES_EDGE[..]).unwrap()).unwrap();
        assert_eq!(repr, edge_repr());
        let mut buf = [0xEEu8; 12];
        repr.emit(&mut Packet::new_unchecked(&mut buf[..]));
        assert_eq!(buf, BYTES_EDGE);

        let read = BthRepr {
            mig_req: true,
            pkey: 0x8001,
            ..BthRepr::new(Opcode::RdmaReadRequest, Qpn::new(0x12), Psn::new(201))
        };
        assert_eq!(read.buffer_len(), HEADER_LEN);
        let mut buf = [0xEEu8; 12];
        read.emit(&mut Packet::new_unchecked(&mut buf[..]));
        assert_eq!(buf, BYTES_READ);
    }

    #[test]
    fn reserved_bits_are_ignored_on_parse() {
        let mut bytes = BYTES_READ;
        bytes[4] = 0xFF; // resv8a (FECN/BECN on RoCE)
        bytes[8] = 0x7F; // the 7 reserved bits beside AckReq
        let repr = BthRepr::parse(&Packet::new_unchecked(&bytes[..])).unwrap();
        assert_eq!(repr.psn.get(), 201);
        assert!(!repr.ack_req);
        assert_eq!(repr.dest_qp.get(), 0x12);
    }

    #[test]
    fn rejects_truncated_and_unknown_versions() {
        for len in 0..HEADER_LEN {
            assert_eq!(
                Packet::new_checked(&BYTES_EDGE[..len]).unwrap_err(),
                Error::Truncated
            );
        }
        let mut bytes = BYTES_READ;
        bytes[1] |= 0x01;
        assert_eq!(
            BthRepr::parse(&Packet::new_unchecked(&bytes[..])),
            Err(Error::UnsupportedVersion(1))
        );
    }
}
