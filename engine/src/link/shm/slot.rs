//! The packet slot: the one format of a packet on a link, written and parsed here.
//!
//! A slot is one 64-byte line, and its bytes are, as they are, the first line of a frame of
//! the link's line ring ([`shmhca_rings::lines`]): no codec sits between the two. The
//! layout:
//!
//! ```text
//! bytes  0..5   the ring's (stamp, line count): never read or written here; zero in a
//!               private slot
//! byte   5      hdr_len       bytes of transport headers at the start of `data`
//! byte   6      kind          how the payload travels (KIND_*)
//! byte   7      reserved      flags: ICRC_FLAG, ACK_FLAG; other bits zero
//! bytes  8..12  payload_len   (u32 LE)
//! byte  12      sge_count     gather entries (KIND_GATHER)
//! bytes 13..16  zero          (bytes 12..16: the ICRC of a packet with its payload
//!                             inline or absent, when the fault stage stamps one)
//! bytes 16..24  payload_off   (u64 LE) arena offset of a payload sent by reference; in a
//!                             request with ACK_FLAG, the riding Ack
//! bytes 24..64  data          40 bytes: the IBA transport headers exactly as on the wire
//!                             (BTH and extended headers, big-endian), then an inline
//!                             payload or a gather list's skip
//! ```
//!
//! The biggest header stacks fit (BTH+AtomicETH 40 bytes, BTH+RETH+ImmDt 32), and so do the
//! common small packets whole: an 8-byte Send, an 8-byte RDMA Write with its RETH, an
//! Atomic, an Ack and an Atomic Acknowledge each take one line. A payload that does not fit
//! inline stays in the sender's arena and the slot names it (zero-copy): one contiguous
//! range, or — for a payload that spans several scatter/gather elements — a gather list of
//! up to [`MAX_GATHER`] ranges, carried in up to [`MAX_CONTINUATION`] *continuation lines*
//! that follow the slot in the same frame ([`GATHER_PER_SLOT`] entries each, at bytes
//! 16..64; bytes 0..16 are left to the ring). A gather list is part of the packet: no
//! table of the sender's lives in shared memory. A packet is thus a frame of
//! `1 + continuation_slots(slot)` lines ([`frame_lines`]), at most 7.
//!
//! # A riding Ack
//!
//! A request whose payload is inline or absent leaves `payload_off` unused, and a positive
//! Ack its sender owes the same peer QP may ride there instead of taking a line of its own
//! ([`ACK_FLAG`]; issue 10's piggybacked Ack). Of the Ack's 16 header bytes only the last 8
//! travel — BTH bytes 8..12 (AckReq and reserved: zero; the PSN) and the AETH (syndrome,
//! MSN) — as the u64 they read big-endian: `psn << 32 | syndrome << 24 | msn`. The first
//! 8 are implied: opcode Acknowledge, no flags, and the carrier's P_Key and destination
//! QP. The receiver handles the carrier first, then the Ack as if it had followed in its
//! own line ([`riding_ack`] rebuilds that line). A flag on a packet that cannot carry an
//! Ack (a response, a payload by reference or in a gather list), or a riding word that is
//! not a positive Ack, makes the frame malformed (`SlotError::RidingAck`).
//!
//! Written by `HeaderWriter` (headers in place, from the opcode table) and the gather
//! helpers; read by `RxPacket::parse`, which copies nothing but checks every length and
//! kind against the slot's bounds, the opcode table and the frame's actual line count.
//! Offsets into the peer's arena are not this module's business: the engine bounds-checks
//! them at copy time against the length of the mapping (a private copy, taken when it was
//! mapped).
//!
//! Like the rest of `wire`, this module imports nothing of the protocol.
#![forbid(unsafe_code)]

use bytemuck::{Pod, Zeroable};

use shmhca_proto::wire::Qpn;
use shmhca_proto::wire::opcode::{self, Headers, OpcodeInfo};
use shmhca_proto::wire::{
    AethRepr, AtomicAckEthRepr, AtomicEthRepr, BthRepr, Error as WireError, ImmDtRepr, RethRepr,
    aeth, atomic_ack_eth, atomic_eth, bth, immdt, reth,
};

/// [`PacketSlot::reserved`] flag: the packet carries an ICRC (set by a sender injecting
/// faults, see the engine's `fault` module).
pub const ICRC_FLAG: u8 = 0x01;

/// [`PacketSlot::reserved`] flag: a positive Ack rides in `payload_off` (see "A riding
/// Ack" in the module docs).
pub const ACK_FLAG: u8 = 0x02;

/// Bytes of a slot (one cache line, one line of the link's ring).
pub const SLOT_BYTES: usize = 64;

/// Bytes of a slot's data area (headers + inline payload).
pub const SLOT_DATA: usize = 40;

/// The slot carries no payload.
pub const KIND_NONE: u8 = 0;
/// The payload follows the headers in the slot.
pub const KIND_INLINE: u8 = 1;
/// The payload is one range of the sender's arena: `payload_off`, `payload_len`.
pub const KIND_DIRECT: u8 = 2;
/// The payload is `sge_count` ranges of the sender's arena, skipping the first `skip`
/// bytes (a little-endian u32 stored right after the headers); the ranges are in the
/// [`continuation_slots`] that follow the slot.
pub const KIND_GATHER: u8 = 3;

/// Most ranges of one gather list (a work request's scatter/gather elements).
pub const MAX_GATHER: usize = 16;
/// Bytes of one gather entry in a continuation line: offset (u64 LE), length (u32 LE),
/// reserved (u32, zero).
pub const GATHER_ENTRY_LEN: usize = 16;
/// Where a continuation line's gather entries start (bytes before it are the ring's, or
/// unused).
pub const GATHER_START: usize = 16;
/// Gather entries per continuation line.
pub const GATHER_PER_SLOT: usize = (SLOT_BYTES - GATHER_START) / GATHER_ENTRY_LEN;
/// Most continuation lines behind one packet.
pub const MAX_CONTINUATION: usize = MAX_GATHER.div_ceil(GATHER_PER_SLOT);
/// Most lines of one packet's frame (the slot and its continuation lines).
pub const MAX_PACKET_LINES: usize = 1 + MAX_CONTINUATION;

/// How many continuation lines follow `slot` (0 unless it is a gather packet; a count the
/// peer made up above [`MAX_GATHER`] yields 0, and the receiver rejects the slot).
#[inline]
pub fn continuation_slots(slot: &PacketSlot) -> usize {
    let n = slot.sge_count as usize;
    if slot.kind == KIND_GATHER && n <= MAX_GATHER {
        n.div_ceil(GATHER_PER_SLOT)
    } else {
        0
    }
}

/// Lines of the frame that carries `slot`: 1, plus its [`continuation_slots`].
#[inline(always)]
pub fn frame_lines(slot: &PacketSlot) -> usize {
    if slot.kind != KIND_GATHER {
        return 1; // most packets: no division
    }
    1 + continuation_slots(slot)
}

/// A gather list, for tests that build gather packets by hand (the engine writes its lists
/// straight into continuation slots: [`set_gather_entry`]).
#[cfg(test)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct GatherList {
    len: usize,
    entries: [(u64, u32); MAX_GATHER],
}

#[cfg(test)]
impl Default for GatherList {
    fn default() -> GatherList {
        GatherList {
            len: 0,
            entries: [(0, 0); MAX_GATHER],
        }
    }
}

#[cfg(test)]
impl GatherList {
    /// Appends a range; false if the list is full.
    pub(crate) fn push(&mut self, off: u64, len: u32) -> bool {
        let Some(e) = self.entries.get_mut(self.len) else {
            return false;
        };
        *e = (off, len);
        self.len += 1;
        true
    }

    /// The ranges.
    pub(crate) fn entries(&self) -> &[(u64, u32)] {
        &self.entries[..self.len]
    }
}

/// One packet on a link: one 64-byte, 64-aligned line (see the module for its layout),
/// any bit pattern valid. A `&[PacketSlot]` is a `&[Line]` of the line ring
/// (`bytemuck::cast_slice`: same size and alignment).
#[repr(C, align(64))]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct PacketSlot {
    /// Bytes 0..5: the line ring's (stamp and line count). The slot codec never reads or
    /// writes them; they are zero in a slot the engine fills.
    pub ring: [u8; 5],
    /// Bytes of transport headers at the start of `data`.
    pub hdr_len: u8,
    /// How the payload is carried: one of the `KIND_*` constants.
    pub kind: u8,
    /// Flags: [`ICRC_FLAG`] (the packet carries an ICRC, set by a
    /// sender injecting faults), [`ACK_FLAG`] (a positive Ack rides in `payload_off`);
    /// other bits zero.
    pub reserved: u8,
    /// Payload bytes.
    pub payload_len: u32,
    /// Gather entries (kind [`KIND_GATHER`]).
    pub sge_count: u8,
    /// Zero.
    pub zero: [u8; 3],
    /// Arena offset of the payload (kind [`KIND_DIRECT`]), or the riding Ack of a request
    /// with [`ACK_FLAG`].
    pub payload_off: u64,
    /// Transport headers, then inline payload or the gather skip.
    pub data: [u8; SLOT_DATA],
}

const _: () = assert!(size_of::<PacketSlot>() == SLOT_BYTES);
const _: () = assert!(align_of::<PacketSlot>() == SLOT_BYTES);
const _: () = assert!(std::mem::offset_of!(PacketSlot, hdr_len) == 5);
const _: () = assert!(std::mem::offset_of!(PacketSlot, payload_len) == 8);
const _: () = assert!(std::mem::offset_of!(PacketSlot, sge_count) == 12);
const _: () = assert!(std::mem::offset_of!(PacketSlot, payload_off) == 16);
const _: () = assert!(std::mem::offset_of!(PacketSlot, data) == 24);

impl Default for PacketSlot {
    fn default() -> PacketSlot {
        PacketSlot::zeroed()
    }
}

impl std::fmt::Debug for PacketSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PacketSlot")
            .field("hdr_len", &self.hdr_len)
            .field("kind", &self.kind)
            .field("payload_len", &self.payload_len)
            .field("payload_off", &self.payload_off)
            .finish_non_exhaustive()
    }
}

impl PacketSlot {
    /// The transport headers.
    pub fn headers(&self) -> &[u8] {
        &self.data[..(self.hdr_len as usize).min(SLOT_DATA)]
    }

    /// Bytes of payload that fit inline behind `hdr_len` bytes of headers.
    pub fn inline_room(hdr_len: usize) -> usize {
        SLOT_DATA.saturating_sub(hdr_len)
    }
}

/// Where a received packet's payload is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Payload {
    None,
    /// `data[start..start + len]` of the slot.
    Inline {
        start: usize,
        len: usize,
    },
    /// A range of the peer's arena.
    Direct {
        off: u64,
        len: u32,
    },
    /// `count` ranges of the peer's arena, in the packet's continuation slots; the first
    /// `skip` bytes are not part of the payload.
    Gather {
        count: u8,
        skip: u32,
        len: u32,
    },
}

impl Payload {
    /// Payload length in bytes.
    pub(crate) fn len(&self) -> u32 {
        match *self {
            Payload::None => 0,
            Payload::Inline { len, .. } => len as u32,
            Payload::Direct { len, .. } | Payload::Gather { len, .. } => len,
        }
    }
}

/// Why a slot was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SlotError {
    /// Header length outside the data area.
    HeaderLength(u8),
    /// The headers do not parse.
    Headers(shmhca_proto::wire::Error),
    /// The parsed headers are not `hdr_len` bytes.
    HeaderMismatch { parsed: usize, claimed: u8 },
    /// A payload on an opcode without one, or the reverse, or an unknown kind.
    PayloadKind(u8),
    /// The inline payload overruns the slot.
    InlineOverrun,
    /// Gather with no entries, or more than [`MAX_GATHER`].
    GatherCount(u8),
    /// The frame has another number of lines than the packet calls for (1, plus the
    /// continuation lines of a gather list).
    FrameLines {
        /// Lines of the frame received.
        lines: usize,
        /// Lines the packet calls for.
        expected: usize,
    },
    /// [`ACK_FLAG`] on a packet that cannot carry an Ack (a response, or a payload by
    /// reference or in a gather list), or a riding word that is not a positive Ack.
    RidingAck,
}

/// Whether `slot`, a request being built, can carry a riding Ack: its payload is inline or
/// absent (so `payload_off` is free) and it carries none yet.
#[inline(always)]
pub(crate) fn can_carry_ack(slot: &PacketSlot) -> bool {
    matches!(slot.kind, KIND_NONE | KIND_INLINE) && slot.reserved & ACK_FLAG == 0
}

/// The riding word of a positive Ack: BTH bytes 8..12 and the AETH as a big-endian u64
/// (AckReq and reserved zero; `psn` and `msn` are 24-bit; `syndrome` a positive Ack's).
#[inline(always)]
pub(crate) fn riding_word(psn: u32, syndrome: u8, msn: u32) -> u64 {
    (u64::from(psn & 0x00ff_ffff) << 32)
        | (u64::from(syndrome) << 24)
        | u64::from(msn & 0x00ff_ffff)
}

/// Puts the riding Ack `word` ([`riding_word`]) in request `slot` and sets [`ACK_FLAG`];
/// false, changing nothing, if the slot cannot carry it ([`can_carry_ack`]).
#[inline(always)]
pub(crate) fn set_riding_ack(slot: &mut PacketSlot, word: u64) -> bool {
    if !can_carry_ack(slot) {
        return false;
    }
    slot.payload_off = word;
    slot.reserved |= ACK_FLAG;
    true
}

/// Takes the riding Ack out of `slot` (clears [`ACK_FLAG`] and the word), leaving its
/// carrier as it would be had the Ack not ridden.
pub(crate) fn clear_riding_ack(slot: &mut PacketSlot) {
    if slot.reserved & ACK_FLAG != 0 {
        slot.reserved &= !ACK_FLAG;
        slot.payload_off = 0;
    }
}

impl<'a> RxPacket<'a> {
    /// The riding Ack `line` rebuilt by [`riding_ack_line`] from a carrier that
    /// [`RxPacket::parse`] accepted, as a packet — without parsing it again: the line is
    /// an Acknowledge with exactly its headers and no payload by construction, and the
    /// carrier's check made its syndrome a positive Ack's.
    #[inline]
    pub(crate) fn riding(line: &'a PacketSlot) -> RxPacket<'a> {
        debug_assert!(RxPacket::parse(line, &[]).is_ok());
        RxPacket {
            slot: line,
            cont: &[],
            info: opcode::ACKNOWLEDGE,
            payload: Payload::None,
        }
    }
}

/// The riding Ack of `slot`, if it has [`ACK_FLAG`], rebuilt as the line of a standalone
/// Acknowledge (its implied first 8 header bytes from the carrier): what a capture records.
/// Whether the word is a positive Ack is `RxPacket::parse`'s check of the carrier.
#[inline]
pub fn riding_ack(slot: &PacketSlot) -> Option<PacketSlot> {
    if slot.reserved & ACK_FLAG == 0 {
        return None;
    }
    Some(riding_ack_line(riding_ack_of(slot)))
}

/// A riding Ack kept until it is handled: what [`riding_ack_of`] takes of its carrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeptAck {
    /// The carrier's first 8 BTH bytes, big-endian (its P_Key and destination QP).
    pub(crate) carrier_head: u64,
    /// The riding word: BTH bytes 8..12 (AckReq and reserved, then the PSN) and the AETH.
    pub(crate) word: u64,
}

/// What a carrier with [`ACK_FLAG`] holds of its riding Ack, to keep until it is handled.
#[inline(always)]
pub(crate) fn riding_ack_of(slot: &PacketSlot) -> KeptAck {
    let mut head = [0u8; 8];
    head.copy_from_slice(&slot.data[..8]);
    KeptAck {
        carrier_head: u64::from_be_bytes(head),
        word: slot.payload_off,
    }
}

/// The line of the standalone Acknowledge a riding Ack stands for ([`riding_ack_of`]):
/// opcode Acknowledge, no flags, the carrier's P_Key and destination QP, then the word.
pub(crate) fn riding_ack_line(KeptAck { carrier_head, word }: KeptAck) -> PacketSlot {
    // BTH bytes 0..8: opcode, flags (0), P_Key, reserved (0), destination QP.
    let head = (u64::from(opcode::Opcode::Acknowledge.code()) << 56)
        | (carrier_head & 0x0000_ffff_00ff_ffff);
    let mut ack = PacketSlot::zeroed();
    ack.data[..8].copy_from_slice(&head.to_be_bytes());
    ack.data[8..16].copy_from_slice(&word.to_be_bytes());
    ack.hdr_len = (bth::HEADER_LEN + aeth::HEADER_LEN) as u8;
    ack.kind = KIND_NONE;
    ack
}

/// The check [`RxPacket::parse`] makes of a packet with [`ACK_FLAG`] (`info` its opcode's
/// row): a request whose payload is inline or absent, and a riding word with AckReq and
/// reserved bits zero and a positive Ack's syndrome.
#[cold]
#[inline(never)]
fn check_riding_ack(slot: &PacketSlot, info: &OpcodeInfo) -> std::result::Result<(), SlotError> {
    // Syndrome bits 7..5 are 000 for a positive Ack (spec 01 Table 17-3).
    let syndrome = (slot.payload_off >> 24) as u8;
    if !info.request
        || !matches!(slot.kind, KIND_NONE | KIND_INLINE)
        || slot.payload_off >> 56 != 0
        || syndrome >> 5 != 0
    {
        return Err(SlotError::RidingAck);
    }
    Ok(())
}

/// A received packet: a checked view of a frame copied out of a ring.
///
/// [`RxPacket::parse`] makes one pass over the slot's first bytes: it checks the BTH's
/// transport header version, looks the opcode byte up in the opcode table
/// ([`opcode::info_of_code`]), checks the pad count, that the slot holds exactly the headers
/// the opcode calls for, and the payload's kind and bounds. Nothing else is decoded then:
/// the BTH fields and the extended headers are read from the slot when asked for (each
/// accessor reads its fixed offset, and cannot fail: every bit pattern of those fields is a
/// value). The slot is the engine's private copy, so what the accessors read is what was
/// checked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RxPacket<'a> {
    slot: &'a PacketSlot,
    /// The continuation lines (gather entries) of its frame.
    cont: &'a [PacketSlot],
    /// The opcode's row of the opcode table.
    pub(crate) info: &'static OpcodeInfo,
    pub(crate) payload: Payload,
}

impl<'a> RxPacket<'a> {
    /// Parses and checks a frame copied out of a ring: its first line `slot` and the rest
    /// of its lines `cont` (exactly the frame's, nothing beyond: a frame must have as many
    /// continuation lines as its gather list calls for, and none otherwise).
    #[inline]
    pub(crate) fn parse(
        slot: &'a PacketSlot,
        cont: &'a [PacketSlot],
    ) -> std::result::Result<RxPacket<'a>, SlotError> {
        if let Some(pkt) = RxPacket::parse_send_only(slot, cont) {
            return Ok(pkt);
        }
        RxPacket::parse_any(slot, cont)
    }

    /// [`RxPacket::parse`] of the most common small packet (issue 27): a Send Only of one
    /// line, its payload inline, with or without a riding Ack. One pattern over the slot's
    /// bytes 5..8 (header length, kind, flags) and the BTH's first two (opcode, transport
    /// version), then the two checks of [`RxPacket::parse_any`] that can still fail (the
    /// payload's bounds, the riding word), give the packet `parse_any` gives; anything
    /// else, valid or not, is `None` and left to `parse_any`.
    #[inline(always)]
    pub(crate) fn parse_send_only(
        slot: &'a PacketSlot,
        cont: &'a [PacketSlot],
    ) -> Option<RxPacket<'a>> {
        const HDR: usize = bth::HEADER_LEN;
        #[cfg(test)]
        if !crate::probe::enabled() {
            return None;
        }
        // Bytes 5..8 and data[0..2] in one compare each: hdr_len, kind, the flags but
        // ACK_FLAG; the opcode, and the BTH flags byte's TVer nibble.
        let flags = u32::from_le_bytes([slot.hdr_len, slot.kind, slot.reserved & !ACK_FLAG, 0]);
        let bth = u16::from_le_bytes([slot.data[0], slot.data[1] & 0x0f]);
        const CODE: u8 = opcode::Opcode::SendOnly.code();
        if flags != u32::from_le_bytes([HDR as u8, KIND_INLINE, 0, 0])
            || bth != u16::from_le_bytes([CODE, 0])
            || !cont.is_empty()
            || slot.payload_len as usize > SLOT_DATA - HDR
        {
            return None;
        }
        // `check_riding_ack`'s word check: AckReq and reserved bits and the syndrome's
        // three top bits zero.
        if slot.reserved & ACK_FLAG != 0 && slot.payload_off & 0xff00_0000_e000_0000 != 0 {
            return None;
        }
        // (A constant row: the lookup folds away.)
        let info = opcode::info_of_code(CODE)?;
        #[cfg(test)]
        crate::probe::count(crate::probe::Path::SendOnlyParse);
        Some(RxPacket {
            slot,
            cont,
            info,
            payload: Payload::Inline {
                start: HDR,
                len: slot.payload_len as usize,
            },
        })
    }

    /// [`RxPacket::parse_send_only`] of a one-line frame whose bytes 5..8 the caller
    /// checked already (header length a BTH's, payload inline, no flag but [`ACK_FLAG`]:
    /// the engine's straight receive step reads them in the word it validated the
    /// line's stamp with): the checks left, in the same order, and the same packet.
    /// (`parse_send_only` keeps its own copy of these checks: built on this function, with
    /// the same checks in either order, it cost the Read and Atomic round trips 12 and 14
    /// instructions more, `bench/scripts/instructions.sh`.)
    #[inline(always)]
    pub(crate) fn send_only_checked(slot: &'a PacketSlot) -> Option<RxPacket<'a>> {
        const CODE: u8 = opcode::Opcode::SendOnly.code();
        let pkt = RxPacket::only_checked::<CODE, { bth::HEADER_LEN }>(slot)?;
        #[cfg(test)]
        crate::probe::count(crate::probe::Path::SendOnlyParse);
        Some(pkt)
    }

    /// [`RxPacket::send_only_checked`] of an RDMA Write Only (no immediate data) of one
    /// line, its payload inline behind the BTH and RETH, whose bytes 5..8 the caller
    /// checked (header length a BTH's and a RETH's, payload inline, no flag but
    /// [`ACK_FLAG`]): the same checks for that opcode and header length, and the packet
    /// [`RxPacket::parse_any`] gives.
    #[inline(always)]
    pub(crate) fn write_only_checked(slot: &'a PacketSlot) -> Option<RxPacket<'a>> {
        const CODE: u8 = opcode::Opcode::RdmaWriteOnly.code();
        RxPacket::only_checked::<CODE, { bth::HEADER_LEN + reth::HEADER_LEN }>(slot)
    }

    /// The checks of [`RxPacket::send_only_checked`] and [`RxPacket::write_only_checked`]
    /// for opcode `CODE`, whose headers (`HDR` bytes) the caller found in bytes 5..8
    /// (with the payload inline, no flag but [`ACK_FLAG`]): the opcode and the BTH's
    /// transport version, the inline payload's bounds behind the headers, a riding
    /// word's bits.
    #[inline(always)]
    fn only_checked<const CODE: u8, const HDR: usize>(
        slot: &'a PacketSlot,
    ) -> Option<RxPacket<'a>> {
        debug_assert_eq!(
            [slot.hdr_len, slot.kind, slot.reserved & !ACK_FLAG],
            [HDR as u8, KIND_INLINE, 0]
        );
        let bth = u16::from_le_bytes([slot.data[0], slot.data[1] & 0x0f]);
        if bth != u16::from_le_bytes([CODE, 0]) || slot.payload_len as usize > SLOT_DATA - HDR {
            return None;
        }
        if slot.reserved & ACK_FLAG != 0 && slot.payload_off & 0xff00_0000_e000_0000 != 0 {
            return None;
        }
        // (A constant row: the lookup folds away.)
        let info = opcode::info_of_code(CODE)?;
        debug_assert_eq!(info.header_len(), HDR);
        Some(RxPacket {
            slot,
            cont: &[],
            info,
            payload: Payload::Inline {
                start: HDR,
                len: slot.payload_len as usize,
            },
        })
    }

    /// [`RxPacket::parse`] of any packet: the general checks.
    #[inline(always)]
    pub(crate) fn parse_any(
        slot: &'a PacketSlot,
        cont: &'a [PacketSlot],
    ) -> std::result::Result<RxPacket<'a>, SlotError> {
        let hdr_len = slot.hdr_len as usize;
        if !(shmhca_proto::wire::bth::HEADER_LEN..=SLOT_DATA).contains(&hdr_len) {
            return Err(SlotError::HeaderLength(slot.hdr_len));
        }
        // The checks of `BthRepr::parse`, in its order, on the fields that can be wrong.
        let view = bth::Packet::new_unchecked(&slot.data[..]);
        if view.tver() != 0 {
            return Err(SlotError::Headers(WireError::UnsupportedVersion(
                view.tver(),
            )));
        }
        let code = slot.data[0];
        let Some(info) = opcode::info_of_code(code) else {
            return Err(SlotError::Headers(WireError::UnknownOpcode(code)));
        };
        if view.pad_count() != 0 && !info.payload {
            return Err(SlotError::Headers(WireError::PadWithoutPayload {
                opcode: info.opcode,
                pad_count: view.pad_count(),
            }));
        }
        if info.header_len() != hdr_len {
            return Err(SlotError::HeaderMismatch {
                parsed: info.header_len(),
                claimed: slot.hdr_len,
            });
        }
        if slot.kind != KIND_GATHER && !cont.is_empty() {
            // Only a gather list takes more than one line.
            return Err(SlotError::FrameLines {
                lines: 1 + cont.len(),
                expected: 1,
            });
        }
        let len = slot.payload_len;
        let payload = match slot.kind {
            KIND_NONE if len == 0 => Payload::None,
            KIND_INLINE if info.payload => {
                if hdr_len + len as usize > SLOT_DATA {
                    return Err(SlotError::InlineOverrun);
                }
                Payload::Inline {
                    start: hdr_len,
                    len: len as usize,
                }
            }
            KIND_DIRECT if info.payload => Payload::Direct {
                off: slot.payload_off,
                len,
            },
            KIND_GATHER if info.payload => {
                if slot.sge_count == 0 || slot.sge_count as usize > MAX_GATHER {
                    return Err(SlotError::GatherCount(slot.sge_count));
                }
                if cont.len() != continuation_slots(slot) {
                    return Err(SlotError::FrameLines {
                        lines: 1 + cont.len(),
                        expected: frame_lines(slot),
                    });
                }
                if hdr_len + 4 > SLOT_DATA {
                    return Err(SlotError::InlineOverrun);
                }
                let skip = u32::from_le_bytes(
                    slot.data[hdr_len..hdr_len + 4].try_into().expect("4 bytes"),
                );
                Payload::Gather {
                    count: slot.sge_count,
                    skip,
                    len,
                }
            }
            k => return Err(SlotError::PayloadKind(k)),
        };
        if slot.reserved & ACK_FLAG != 0 {
            check_riding_ack(slot, info)?;
        }
        Ok(RxPacket {
            slot,
            cont,
            info,
            payload,
        })
    }

    /// A view of the packet's BTH.
    #[inline]
    fn bth_view(&self) -> bth::Packet<&'a [u8]> {
        bth::Packet::new_unchecked(&self.slot.data[..bth::HEADER_LEN])
    }

    /// The BTH, decoded whole (parse checked its version and opcode).
    #[cfg(test)]
    pub(crate) fn bth(&self) -> BthRepr {
        let v = self.bth_view();
        BthRepr {
            opcode: self.info.opcode,
            solicited: v.solicited(),
            mig_req: v.mig_req(),
            pad_count: v.pad_count(),
            tver: v.tver(),
            pkey: v.pkey(),
            dest_qp: v.dest_qp(),
            ack_req: v.ack_req(),
            psn: v.psn(),
        }
    }

    /// The opcode.
    #[cfg(test)]
    pub(crate) fn opcode(&self) -> shmhca_proto::wire::opcode::Opcode {
        self.info.opcode
    }

    /// The BTH's PSN.
    #[inline]
    pub(crate) fn psn(&self) -> crate::psn::Psn {
        self.bth_view().psn()
    }

    /// The BTH's Solicited Event bit.
    #[inline]
    pub(crate) fn solicited(&self) -> bool {
        self.bth_view().solicited()
    }

    /// The BTH's AckReq bit.
    #[inline]
    pub(crate) fn ack_req(&self) -> bool {
        self.bth_view().ack_req()
    }

    /// The destination QP named in a slot's BTH, read before the slot is parsed (the
    /// data area always holds a whole BTH, whatever else the peer wrote).
    #[inline]
    pub(crate) fn dest_qp(slot: &PacketSlot) -> Qpn {
        bth::Packet::new_unchecked(&slot.data[..]).dest_qp()
    }

    /// The slot the packet was copied into.
    pub(crate) fn slot(&self) -> &'a PacketSlot {
        self.slot
    }

    /// Range `i` of a gather packet's list: (offset in the sender's arena, length).
    pub(crate) fn gather_entry(&self, i: usize) -> Option<(u64, u32)> {
        gather_entry(self.cont, i)
    }

    /// The bytes of extended header `h`, if the opcode carries it.
    #[inline]
    fn ext(&self, h: Headers) -> Option<&'a [u8]> {
        let set = self.info.headers;
        if !set.contains(h) {
            return None;
        }
        // Extended headers follow the BTH in the bit order of `Headers` (wire order).
        let before = Headers::from_bits_truncate(set.bits() & (h.bits() - 1)).len();
        let at = bth::HEADER_LEN + before;
        Some(&self.slot.data[at..at + h.len()])
    }

    /// The RETH.
    pub(crate) fn reth(&self) -> Option<RethRepr> {
        self.ext(Headers::RETH)
            .and_then(|b| RethRepr::parse(&reth::Packet::new_unchecked(b)).ok())
    }

    /// The AETH.
    pub(crate) fn aeth(&self) -> Option<AethRepr> {
        self.ext(Headers::AETH)
            .and_then(|b| AethRepr::parse(&aeth::Packet::new_unchecked(b)).ok())
    }

    /// The credit code and MSN of a positive Ack (an AETH whose syndrome is `000CCCCC`);
    /// `None` for any other syndrome or an opcode without an AETH. What [`aeth`] gives for
    /// a positive Ack, without decoding the other syndromes.
    ///
    /// [`aeth`]: RxPacket::aeth
    #[inline]
    pub(crate) fn positive_ack(
        &self,
    ) -> Option<(
        shmhca_proto::wire::aeth::CreditCode,
        shmhca_proto::wire::Msn,
    )> {
        let p = aeth::Packet::new_unchecked(self.ext(Headers::AETH)?);
        Some((p.ack_credits()?, p.msn()))
    }

    /// The AtomicETH.
    pub(crate) fn atomic_eth(&self) -> Option<AtomicEthRepr> {
        self.ext(Headers::ATOMIC_ETH)
            .and_then(|b| AtomicEthRepr::parse(&atomic_eth::Packet::new_unchecked(b)).ok())
    }

    /// The original value of an AtomicAckETH.
    pub(crate) fn atomic_orig(&self) -> Option<u64> {
        self.ext(Headers::ATOMIC_ACK_ETH).and_then(|b| {
            AtomicAckEthRepr::parse(&atomic_ack_eth::Packet::new_unchecked(b))
                .ok()
                .map(|r| r.orig)
        })
    }

    /// The immediate data.
    pub(crate) fn imm(&self) -> Option<u32> {
        self.ext(Headers::IMMDT)
            .and_then(|b| ImmDtRepr::parse(&immdt::Packet::new_unchecked(b)).ok())
            .map(|r| r.imm)
    }

    /// The R_Key of an IETH (Send with Invalidate).
    pub(crate) fn ieth(&self) -> Option<u32> {
        self.ext(Headers::IETH)
            .and_then(|b| {
                shmhca_proto::wire::IethRepr::parse(
                    &shmhca_proto::wire::ieth::Packet::new_unchecked(b),
                )
                .ok()
            })
            .map(|r| r.rkey)
    }
}

/// Range `i` of a gather list stored in continuation lines `cont`.
pub(crate) fn gather_entry(cont: &[PacketSlot], i: usize) -> Option<(u64, u32)> {
    let slot = cont.get(i / GATHER_PER_SLOT)?;
    let at = GATHER_START + (i % GATHER_PER_SLOT) * GATHER_ENTRY_LEN;
    let b = bytemuck::bytes_of(slot).get(at..at + GATHER_ENTRY_LEN)?;
    let off = u64::from_le_bytes(b[0..8].try_into().ok()?);
    let len = u32::from_le_bytes(b[8..12].try_into().ok()?);
    Some((off, len))
}

/// [`write_gather`] for other modules' tests.
#[cfg(test)]
pub(crate) fn write_gather_for_tests(list: &GatherList, cont: &mut [PacketSlot]) {
    write_gather(list, cont);
}

/// Writes a gather list into continuation slots.
#[cfg(test)]
fn write_gather(list: &GatherList, cont: &mut [PacketSlot]) {
    for (i, &(off, len)) in list.entries().iter().enumerate() {
        set_gather_entry(cont, i, off, len);
    }
}

/// Writes range `i` of a gather list into continuation lines `cont` (bytes 16..64 of a
/// line; bytes 0..16 are left alone); false if they have no room for it.
#[inline]
pub(crate) fn set_gather_entry(cont: &mut [PacketSlot], i: usize, off: u64, len: u32) -> bool {
    let Some(slot) = cont.get_mut(i / GATHER_PER_SLOT) else {
        return false;
    };
    let at = GATHER_START + (i % GATHER_PER_SLOT) * GATHER_ENTRY_LEN;
    let b = &mut bytemuck::bytes_of_mut(slot)[at..at + GATHER_ENTRY_LEN];
    b[0..8].copy_from_slice(&off.to_le_bytes());
    b[8..12].copy_from_slice(&len.to_le_bytes());
    b[12..16].fill(0);
    true
}

/// Writes a packet's transport headers straight into a slot, in wire order: the BTH
/// first, then the extended headers the opcode calls for. The SQ and RQ Logic build only
/// packets the opcode table allows (debug builds check the set on [`finish`]); writing in
/// place spares building a [`PacketRepr`](shmhca_proto::wire::PacketRepr) per packet.
///
/// [`finish`]: HeaderWriter::finish
pub(crate) struct HeaderWriter<'a> {
    slot: &'a mut PacketSlot,
    at: usize,
    #[cfg(debug_assertions)]
    written: Headers,
    #[cfg(debug_assertions)]
    opcode: shmhca_proto::wire::opcode::Opcode,
}

impl<'a> HeaderWriter<'a> {
    /// Starts a packet with its BTH.
    #[inline]
    pub(crate) fn new(slot: &'a mut PacketSlot, bth: &BthRepr) -> HeaderWriter<'a> {
        bth.emit(&mut bth::Packet::new_unchecked(
            &mut slot.data[..bth::HEADER_LEN],
        ));
        HeaderWriter {
            slot,
            at: bth::HEADER_LEN,
            #[cfg(debug_assertions)]
            written: Headers::NONE,
            #[cfg(debug_assertions)]
            opcode: bth.opcode,
        }
    }

    #[inline]
    fn next(&mut self, h: Headers) -> &mut [u8] {
        #[cfg(debug_assertions)]
        {
            debug_assert!(self.written.bits() < h.bits(), "headers out of wire order");
            self.written = self.written | h;
        }
        let at = self.at;
        self.at += h.len();
        &mut self.slot.data[at..self.at]
    }

    /// Appends a RETH.
    #[inline]
    pub(crate) fn reth(mut self, r: &RethRepr) -> Self {
        r.emit(&mut reth::Packet::new_unchecked(self.next(Headers::RETH)));
        self
    }

    /// Appends an AtomicETH.
    #[inline]
    pub(crate) fn atomic_eth(mut self, r: &AtomicEthRepr) -> Self {
        r.emit(&mut atomic_eth::Packet::new_unchecked(
            self.next(Headers::ATOMIC_ETH),
        ));
        self
    }

    /// Appends an AETH.
    #[inline]
    pub(crate) fn aeth(mut self, r: &AethRepr) -> Self {
        r.emit(&mut aeth::Packet::new_unchecked(self.next(Headers::AETH)));
        self
    }

    /// Appends an AtomicAckETH (the responder writes its Atomic Acknowledges from a
    /// template; tests compare the two).
    #[cfg(test)]
    pub(crate) fn atomic_ack_eth(mut self, orig: u64) -> Self {
        AtomicAckEthRepr { orig }.emit(&mut atomic_ack_eth::Packet::new_unchecked(
            self.next(Headers::ATOMIC_ACK_ETH),
        ));
        self
    }

    /// Appends Immediate Data.
    #[inline]
    pub(crate) fn immdt(mut self, imm: u32) -> Self {
        ImmDtRepr { imm }.emit(&mut immdt::Packet::new_unchecked(self.next(Headers::IMMDT)));
        self
    }

    /// Appends an IETH (the R_Key a Send with Invalidate invalidates).
    #[inline]
    pub(crate) fn ieth(mut self, rkey: u32) -> Self {
        shmhca_proto::wire::IethRepr { rkey }.emit(
            &mut shmhca_proto::wire::ieth::Packet::new_unchecked(self.next(Headers::IETH)),
        );
        self
    }

    /// Ends the headers: sets the slot's header length and returns the slot, for its
    /// payload.
    #[inline]
    pub(crate) fn finish(self) -> &'a mut PacketSlot {
        #[cfg(debug_assertions)]
        debug_assert_eq!(
            Some(self.written),
            self.opcode.info().map(|i| i.headers),
            "{:?} carries other headers",
            self.opcode
        );
        self.slot.hdr_len = self.at as u8;
        self.slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::psn::Psn;
    use shmhca_proto::wire::PacketRepr;
    use shmhca_proto::wire::bth::BthRepr;
    use shmhca_proto::wire::opcode::Opcode;
    use shmhca_proto::wire::{Qpn, reth::RethRepr};

    fn slot_with(opcode: Opcode, kind: u8, payload_len: u32) -> PacketSlot {
        let repr = PacketRepr {
            bth: BthRepr {
                opcode,
                solicited: false,
                mig_req: false,
                pad_count: 0,
                tver: 0,
                pkey: 0xffff,
                dest_qp: Qpn::new(7),
                ack_req: true,
                psn: Psn::new(201),
            },
            reth: (opcode == Opcode::RdmaWriteOnly).then_some(RethRepr {
                va: 0x1000,
                rkey: 0x100,
                dma_len: payload_len,
            }),
            aeth: None,
            atomic_eth: None,
            atomic_ack_eth: None,
            immdt: None,
            ieth: None,
        };
        let mut s = PacketSlot::zeroed();
        let n = repr.emit(&mut s.data).unwrap();
        s.hdr_len = n as u8;
        s.kind = kind;
        s.payload_len = payload_len;
        s
    }

    /// The Send Only shortcut of the parse against the general parse: a one-line Send Only
    /// with its payload inline and a riding Ack, each bit of its flag bytes, lengths,
    /// riding word and first BTH bytes flipped in turn (and two of those bits at once),
    /// with and without a continuation line. Where the shortcut takes a slot, the general
    /// parse gives the same packet; a slot the general parse accepts as such a Send Only,
    /// with no flag but ACK_FLAG, the shortcut takes (so the engine's common case is the
    /// short one).
    #[test]
    fn the_send_only_shortcut_parses_as_the_general_parse() {
        let mut base = slot_with(Opcode::SendOnly, KIND_INLINE, 5);
        base.reserved = ACK_FLAG;
        base.payload_off = (9 << 32) | (0x1f << 24) | 4; // PSN 9, credits 31, MSN 4
        let seen = std::cell::Cell::new((0, 0));
        let check = |s: &PacketSlot, cont: &[PacketSlot]| {
            let any = RxPacket::parse_any(s, cont);
            let short = RxPacket::parse_send_only(s, cont);
            let common = any.as_ref().is_ok_and(|p| {
                p.info.opcode == Opcode::SendOnly
                    && matches!(p.payload, Payload::Inline { .. })
                    && s.reserved & !ACK_FLAG == 0
            });
            match short {
                Some(p) => assert_eq!(
                    format!("{:?}", Ok::<_, SlotError>(p)),
                    format!("{any:?}"),
                    "the shortcut took {s:?} and must parse it as the general parse"
                ),
                None => assert!(!common, "a common Send Only missed the shortcut: {s:?}"),
            }
            let (taken, all) = seen.get();
            seen.set((taken + usize::from(short.is_some()), all + 1));
        };
        // The bytes the shortcut reads or that the parse checks: 5..24 of the line and the
        // BTH's first two.
        let bits: Vec<usize> = (5 * 8..24 * 8).chain(24 * 8..26 * 8).collect();
        let flip = |s: &mut PacketSlot, bit: usize| {
            bytemuck::bytes_of_mut(s)[bit / 8] ^= 1 << (bit % 8);
        };
        for cont in [&[][..], &[PacketSlot::zeroed()][..]] {
            check(&base, cont);
            for &a in &bits {
                let mut s = base;
                flip(&mut s, a);
                check(&s, cont);
                for &b in &bits {
                    if b > a {
                        let mut t = s;
                        flip(&mut t, b);
                        check(&t, cont);
                    }
                }
            }
        }
        let (taken, all) = seen.get();
        assert!(
            taken > 100 && taken < all / 2,
            "{taken} of {all} slots taken"
        );
    }

    /// Review 4: the Send Only shortcut against the general parse on random lines a
    /// hostile peer could write: every byte random, each of the fields the shortcut looks
    /// at drawn mostly from the values that pass it (so that both sides of each check are
    /// met), with zero to two continuation lines. Whatever the shortcut takes, the general
    /// parse takes as the same packet; every Send Only the general parse takes with its
    /// payload inline, no continuation line and no flag but ACK_FLAG, the shortcut takes.
    #[test]
    fn review4_the_send_only_shortcut_agrees_with_the_general_parse_on_random_lines() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut taken = 0;
        for _ in 0..400_000 {
            let mut s = PacketSlot::zeroed();
            for b in bytemuck::bytes_of_mut(&mut s).iter_mut() {
                *b = rnd() as u8;
            }
            let r = rnd();
            if r & 3 != 0 {
                s.hdr_len = [12, 12, 12, 16, 0, 40, 41, 255][(r >> 2) as usize % 8];
            }
            if r & (3 << 5) != 0 {
                s.kind = [
                    KIND_INLINE,
                    KIND_INLINE,
                    KIND_NONE,
                    KIND_DIRECT,
                    KIND_GATHER,
                    4,
                ][(r >> 7) as usize % 6];
            }
            if r & (3 << 10) != 0 {
                s.reserved =
                    [0, ACK_FLAG, ACK_FLAG | ICRC_FLAG, 0x80, 0x04][(r >> 12) as usize % 5];
            }
            if r & (3 << 15) != 0 {
                s.data[0] = [
                    Opcode::SendOnly.code(),
                    Opcode::SendOnly.code(),
                    0x05,
                    0x24,
                    0xff,
                ][(r >> 17) as usize % 5];
            }
            if r & (3 << 20) != 0 {
                s.data[1] &= [0xf0, 0xff, 0x30, 0x01][(r >> 22) as usize % 4];
            }
            if r & (3 << 25) != 0 {
                s.payload_len = [0, 1, 27, 28, 29, 40, u32::MAX, 1 << 31][(r >> 27) as usize % 8];
            }
            if r & (3 << 30) != 0 {
                s.payload_off &= [0, 0x00ff_ffff_1fff_ffff, u64::MAX, 0x00ff_ffff_ffff_ffff]
                    [(r >> 32) as usize % 4];
            }
            let cont = [PacketSlot::zeroed(); 2];
            let cont = &cont[..[0, 0, 0, 1, 2][(r >> 40) as usize % 5]];
            let any = RxPacket::parse_any(&s, cont);
            let short = RxPacket::parse_send_only(&s, cont);
            match short {
                Some(p) => {
                    taken += 1;
                    assert_eq!(
                        format!("{:?}", Ok::<_, SlotError>(p)),
                        format!("{any:?}"),
                        "{s:?}"
                    );
                }
                None => assert!(
                    !any.as_ref().is_ok_and(|p| p.info.opcode == Opcode::SendOnly
                        && matches!(p.payload, Payload::Inline { .. })
                        && cont.is_empty()
                        && s.reserved & !ACK_FLAG == 0),
                    "missed: {s:?}"
                ),
            }
        }
        assert!(taken > 100, "{taken}");
    }

    #[test]
    fn inline_direct_and_gather_payloads_parse() {
        let s = slot_with(Opcode::SendOnly, KIND_INLINE, 8);
        let p = RxPacket::parse(&s, &[]).unwrap();
        assert_eq!(p.payload, Payload::Inline { start: 12, len: 8 });

        let mut s = slot_with(Opcode::RdmaWriteOnly, KIND_DIRECT, 4000);
        s.payload_off = 8192;
        let p = RxPacket::parse(&s, &[]).unwrap();
        assert_eq!(
            p.payload,
            Payload::Direct {
                off: 8192,
                len: 4000
            }
        );
        assert_eq!(p.reth().unwrap().dma_len, 4000);
        assert_eq!(p.aeth(), None);
        assert_eq!(p.imm(), None);

        let mut s = slot_with(Opcode::SendOnly, KIND_GATHER, 300);
        s.sge_count = 3;
        s.data[12..16].copy_from_slice(&17u32.to_le_bytes());
        assert_eq!(
            RxPacket::parse(&s, &[]).unwrap_err(),
            SlotError::FrameLines {
                lines: 1,
                expected: 2
            },
            "a gather packet needs its continuation line"
        );
        let mut list = GatherList::default();
        for (o, l) in [(64u64, 100u32), (4096, 200), (9000, 17)] {
            assert!(list.push(o, l));
        }
        let mut cont = [PacketSlot::zeroed(); 1];
        write_gather(&list, &mut cont);
        let p = RxPacket::parse(&s, &cont).unwrap();
        assert_eq!(
            p.payload,
            Payload::Gather {
                count: 3,
                skip: 17,
                len: 300
            }
        );
        assert_eq!(p.gather_entry(1), Some((4096, 200)));
        assert_eq!(p.gather_entry(2), Some((9000, 17)));
    }

    #[test]
    fn every_opcode_reads_back_every_extended_header() {
        use shmhca_proto::wire::opcode::Headers;
        use shmhca_proto::wire::{
            AethRepr, AtomicAckEthRepr, AtomicEthRepr, IethRepr, ImmDtRepr, Msn, aeth::Syndrome,
        };
        for op in Opcode::ALL {
            let info = op.info().unwrap();
            let h = info.headers;
            let mut repr =
                PacketRepr::new(BthRepr::new(op, Qpn::new(0xABCDEF), Psn::new(0xFFFFFF)));
            if h.contains(Headers::RETH) {
                repr.reth = Some(RethRepr {
                    va: 0x1122_3344_5566_7788,
                    rkey: 0x99AA_BBCC,
                    dma_len: 77,
                });
            }
            if h.contains(Headers::ATOMIC_ETH) {
                repr.atomic_eth = Some(AtomicEthRepr {
                    va: 8,
                    rkey: 3,
                    swap_add: u64::MAX,
                    compare: 42,
                });
            }
            if h.contains(Headers::AETH) {
                repr.aeth = Some(AethRepr {
                    syndrome: Syndrome::from_u8(0x0C),
                    msn: Msn::new(0x123456),
                });
            }
            if h.contains(Headers::ATOMIC_ACK_ETH) {
                repr.atomic_ack_eth = Some(AtomicAckEthRepr {
                    orig: 0xDEAD_BEEF_0BAD_F00D,
                });
            }
            if h.contains(Headers::IMMDT) {
                repr.immdt = Some(ImmDtRepr { imm: 0x0102_0304 });
            }
            if h.contains(Headers::IETH) {
                repr.ieth = Some(IethRepr { rkey: 5 });
            }
            let mut s = PacketSlot::zeroed();
            s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
            let p = RxPacket::parse(&s, &[]).unwrap_or_else(|e| panic!("{op:?}: {e:?}"));
            assert_eq!(p.info.opcode, op);
            assert_eq!(p.bth(), repr.bth, "{op:?}");
            assert_eq!(p.reth(), repr.reth, "{op:?}");
            assert_eq!(p.atomic_eth(), repr.atomic_eth, "{op:?}");
            assert_eq!(p.aeth(), repr.aeth, "{op:?}");
            assert_eq!(
                p.atomic_orig(),
                repr.atomic_ack_eth.map(|a| a.orig),
                "{op:?}"
            );
            assert_eq!(p.imm(), repr.immdt.map(|i| i.imm), "{op:?}");
        }
    }

    #[test]
    fn malformed_slots_are_rejected() {
        let mut s = slot_with(Opcode::SendOnly, KIND_INLINE, 8);
        s.hdr_len = 200;
        assert_eq!(
            RxPacket::parse(&s, &[]).unwrap_err(),
            SlotError::HeaderLength(200)
        );
        let mut s = slot_with(Opcode::SendOnly, KIND_INLINE, 8);
        s.hdr_len = 16; // claims more header than the opcode has
        assert!(matches!(
            RxPacket::parse(&s, &[]),
            Err(SlotError::HeaderMismatch { .. })
        ));
        // An inline payload past line 0: 12 bytes of BTH and 29 of payload.
        let s = slot_with(Opcode::SendOnly, KIND_INLINE, 29);
        assert_eq!(
            RxPacket::parse(&s, &[]).unwrap_err(),
            SlotError::InlineOverrun
        );
        let s = slot_with(Opcode::SendOnly, KIND_INLINE, 28);
        assert!(
            RxPacket::parse(&s, &[]).is_ok(),
            "28 bytes fit behind the BTH"
        );
        let s = slot_with(Opcode::SendOnly, 9, 8);
        assert_eq!(
            RxPacket::parse(&s, &[]).unwrap_err(),
            SlotError::PayloadKind(9)
        );
        // An Acknowledge carries no payload.
        let mut ack = slot_with(Opcode::SendOnly, KIND_NONE, 0);
        ack.data[0] = 0x11;
        assert!(
            RxPacket::parse(&ack, &[]).is_err(),
            "Acknowledge needs an AETH"
        );
        let s = slot_with(Opcode::SendOnly, KIND_GATHER, 8);
        assert_eq!(
            RxPacket::parse(&s, &[]).unwrap_err(),
            SlotError::GatherCount(0)
        );
        let mut s = slot_with(Opcode::SendOnly, KIND_GATHER, 8);
        s.sge_count = 200;
        assert_eq!(continuation_slots(&s), 0, "a made-up count claims no slots");
        let cont = [PacketSlot::zeroed(); MAX_CONTINUATION];
        assert_eq!(
            RxPacket::parse(&s, &cont).unwrap_err(),
            SlotError::GatherCount(200)
        );
    }

    /// The slot is a line: its fields sit where the line ring leaves the line to its user
    /// (bytes 0..5 are the ring's), so a staged slot is written into the ring as it is.
    #[test]
    fn the_slot_is_one_line_with_its_fields_at_their_offsets() {
        assert_eq!(size_of::<PacketSlot>(), 64);
        assert_eq!(align_of::<PacketSlot>(), 64);
        let mut s = PacketSlot::zeroed();
        s.hdr_len = 0x11;
        s.kind = 0x22;
        s.reserved = 0x33;
        s.payload_len = 0x4455_6677;
        s.sge_count = 0x88;
        s.payload_off = 0x0102_0304_0506_0708;
        s.data[0] = 0x99;
        s.data[SLOT_DATA - 1] = 0xAA;
        let b = bytemuck::bytes_of(&s);
        assert_eq!(&b[..5], &[0; 5], "the ring's bytes are not the slot's");
        assert_eq!(b[5..8], [0x11, 0x22, 0x33]);
        assert_eq!(b[8..12], 0x4455_6677u32.to_le_bytes());
        assert_eq!(b[12..16], [0x88, 0, 0, 0]);
        assert_eq!(b[16..24], 0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!((b[24], b[63]), (0x99, 0xAA));
    }

    /// Gather entries fill bytes 16..64 of a continuation line, three to a line, and leave
    /// bytes 0..16 alone (the ring stamps bytes 0..5 of every line of a frame).
    #[test]
    fn gather_entries_leave_the_first_16_bytes_of_a_line_alone() {
        assert_eq!(
            (GATHER_PER_SLOT, MAX_CONTINUATION, MAX_PACKET_LINES),
            (3, 6, 7)
        );
        let mut cont = [PacketSlot::zeroed(); MAX_CONTINUATION];
        for c in &mut cont {
            bytemuck::bytes_of_mut(c)[..16].fill(0xEE);
        }
        for i in 0..MAX_GATHER {
            assert!(set_gather_entry(
                &mut cont,
                i,
                1000 + i as u64,
                10 + i as u32
            ));
        }
        assert!(
            !set_gather_entry(&mut cont, MAX_GATHER + 2, 0, 0),
            "no seventh line"
        );
        for c in &cont {
            assert_eq!(&bytemuck::bytes_of(c)[..16], &[0xEE; 16]);
        }
        for i in 0..MAX_GATHER {
            assert_eq!(
                gather_entry(&cont, i),
                Some((1000 + i as u64, 10 + i as u32))
            );
        }
        let line = bytemuck::bytes_of(&cont[1]);
        assert_eq!(line[16..24], 1003u64.to_le_bytes(), "entry 3 opens line 1");
        let mut s = slot_with(Opcode::SendOnly, KIND_GATHER, 300);
        for (n, lines) in [(1, 2), (3, 2), (4, 3), (15, 6), (16, 7)] {
            s.sge_count = n;
            assert_eq!(frame_lines(&s), lines, "{n} entries");
        }
    }

    /// The five common small packets each take one line: an 8-byte Send, an 8-byte RDMA
    /// Write with its RETH, an Atomic, an Ack and an Atomic Acknowledge.
    #[test]
    fn the_common_small_packets_fit_one_line() {
        use shmhca_proto::wire::aeth::Syndrome;
        use shmhca_proto::wire::{AethRepr, AtomicEthRepr, Msn, aeth::CreditCode};
        let bth = |op| BthRepr::new(op, Qpn::new(5), Psn::new(9));
        let ack = AethRepr {
            syndrome: Syndrome::Ack {
                credits: CreditCode::new(3),
            },
            msn: Msn::new(1),
        };
        let reth = RethRepr {
            va: 0x1000,
            rkey: 7,
            dma_len: 8,
        };
        let atomic = AtomicEthRepr {
            va: 8,
            rkey: 7,
            swap_add: 1,
            compare: 2,
        };
        let mut packets = Vec::new();
        let mut s = PacketSlot::zeroed();
        HeaderWriter::new(&mut s, &bth(Opcode::SendOnly)).finish();
        packets.push((s, 8));
        let mut s = PacketSlot::zeroed();
        HeaderWriter::new(&mut s, &bth(Opcode::RdmaWriteOnly))
            .reth(&reth)
            .finish();
        packets.push((s, 8));
        let mut s = PacketSlot::zeroed();
        HeaderWriter::new(&mut s, &bth(Opcode::CompareSwap))
            .atomic_eth(&atomic)
            .finish();
        packets.push((s, 0));
        let mut s = PacketSlot::zeroed();
        HeaderWriter::new(&mut s, &bth(Opcode::Acknowledge))
            .aeth(&ack)
            .finish();
        packets.push((s, 0));
        let mut s = PacketSlot::zeroed();
        HeaderWriter::new(&mut s, &bth(Opcode::AtomicAcknowledge))
            .aeth(&ack)
            .atomic_ack_eth(42)
            .finish();
        packets.push((s, 0));
        for (mut s, len) in packets {
            let hdr = s.hdr_len as usize;
            assert!(len <= PacketSlot::inline_room(hdr), "{hdr} + {len} bytes");
            if len > 0 {
                s.kind = KIND_INLINE;
                s.payload_len = len as u32;
                s.data[hdr..hdr + len].fill(0x5A);
            }
            assert_eq!(frame_lines(&s), 1);
            let p = RxPacket::parse(&s, &[]).unwrap();
            assert_eq!(p.payload.len() as usize, len);
        }
    }

    /// A frame must have exactly the lines its packet calls for: a packet without a
    /// gather list one, a gather packet one per three entries more.
    #[test]
    fn a_frame_with_another_line_count_than_its_packet_is_rejected() {
        let cont = [PacketSlot::zeroed(); MAX_CONTINUATION];
        for kind in [KIND_INLINE, KIND_DIRECT] {
            let s = slot_with(Opcode::SendOnly, kind, 8);
            assert!(RxPacket::parse(&s, &[]).is_ok());
            assert_eq!(
                RxPacket::parse(&s, &cont[..1]).unwrap_err(),
                SlotError::FrameLines {
                    lines: 2,
                    expected: 1
                }
            );
        }
        let mut s = slot_with(Opcode::SendOnly, KIND_GATHER, 300);
        s.sge_count = 4;
        for n in [0, 1, 3, 6] {
            assert_eq!(
                RxPacket::parse(&s, &cont[..n]).unwrap_err(),
                SlotError::FrameLines {
                    lines: 1 + n,
                    expected: 3
                }
            );
        }
        assert!(RxPacket::parse(&s, &cont[..2]).is_ok());
        s.sge_count = 17;
        assert_eq!(
            RxPacket::parse(&s, &cont).unwrap_err(),
            SlotError::GatherCount(17)
        );
    }

    proptest::proptest! {
        /// A slot is whatever the peer wrote: any bytes at all must be rejected or parse
        /// into a packet whose every accessor works, and agree with the generic parser.
        /// Half the cases get a real opcode and its header length, to get past the first
        /// checks.
        #[test]
        fn any_slot_is_rejected_or_parses_consistently(
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), size_of::<PacketSlot>()),
            op in 0..Opcode::ALL.len(),
            fix in proptest::prelude::any::<bool>(),
            kind in 0u8..5,
        ) {
            let mut s: PacketSlot = bytemuck::pod_read_unaligned(&raw);
            if fix {
                let opcode = Opcode::ALL[op];
                s.data[0] = opcode.code();
                s.data[1] &= 0xF0; // transport header version 0
                s.hdr_len = opcode.info().unwrap().header_len() as u8;
                s.kind = kind;
                s.payload_len %= 64;
            }
            if let Ok(p) = RxPacket::parse(&s, &[]) {
                let hdr = s.hdr_len as usize;
                let (repr, len) = PacketRepr::parse(&s.data[..hdr]).expect("both parsers agree");
                proptest::prop_assert_eq!(len, hdr);
                proptest::prop_assert_eq!(p.bth(), repr.bth);
                proptest::prop_assert_eq!(p.reth(), repr.reth);
                proptest::prop_assert_eq!(p.aeth(), repr.aeth);
                let positive = match repr.aeth {
                    Some(AethRepr { syndrome: shmhca_proto::wire::aeth::Syndrome::Ack { credits }, msn }) => {
                        Some((credits, msn))
                    }
                    _ => None,
                };
                proptest::prop_assert_eq!(p.positive_ack(), positive);
                proptest::prop_assert_eq!(p.atomic_eth(), repr.atomic_eth);
                proptest::prop_assert_eq!(p.atomic_orig(), repr.atomic_ack_eth.map(|a| a.orig));
                proptest::prop_assert_eq!(p.imm(), repr.immdt.map(|i| i.imm));
                if let Payload::Inline { start, len } = p.payload {
                    proptest::prop_assert!(start + len <= SLOT_DATA);
                }
                proptest::prop_assert_eq!(p.payload.len(), s.payload_len);
            }
        }
    }
}
