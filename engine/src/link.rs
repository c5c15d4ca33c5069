//! Links: the packet path between two engines.
//!
//! A link is a shared segment holding two SPSC rings of [`PacketSlot`]s, one per
//! direction. Each side also holds, read-only, the peer's engine page (to wake it) and the
//! arenas of the peer QPs connected over the link, so payloads sent by reference can be
//! copied straight out of them. The side that creates the segment sends on ring 0 and
//! receives on ring 1; the side that opens it does the opposite.
//!
//! # The packet slot
//!
//! A slot is 128 bytes (two cache lines): 16 bytes of slot metadata, then 112 bytes holding
//! the IBA transport headers exactly as on the wire (BTH and extended headers, big-endian)
//! and, for small payloads, the payload right behind them — so a short packet, slot
//! metadata included, fits in the first cache line. Larger payloads stay in the sender's
//! arena and the slot names them (zero-copy): one contiguous range, or — for a payload that
//! spans several scatter/gather elements — a gather list of up to [`MAX_GATHER`] ranges,
//! carried in one or two *continuation slots* pushed right behind the packet's slot, in the
//! same burst. A gather list is part of the packet: no table of the sender's lives in
//! shared memory.
//!
//! Nothing in a received slot is trusted: `RxPacket::parse` copies nothing but checks
//! every length and kind against the slot's bounds and the opcode table, and every offset
//! into the peer's arena is bounds-checked at copy time against the length of the mapping
//! (a private copy, taken when it was mapped).

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use shmhca_rings::ring::{
    Consumer, LinkBroken, Producer, ShmStorage, init_shm_ring, shm_consumer, shm_producer,
    shm_ring_bytes,
};
use shmhca_rings::segment::{HugePages, Segment};

use crate::error::{Error, Result};
use crate::mem::Mem;
use crate::wire::Qpn;
use crate::wire::opcode::{self, Headers, OpcodeInfo};
use crate::wire::{
    AethRepr, AtomicAckEthRepr, AtomicEthRepr, BthRepr, Error as WireError, ImmDtRepr, RethRepr,
    aeth, atomic_ack_eth, atomic_eth, bth, immdt, reth,
};

/// Identifies a link of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LinkId(pub(crate) u32);

impl LinkId {
    /// The link's index in its engine.
    pub fn index(self) -> u32 {
        self.0
    }
}

/// Bytes of a slot's data area (headers + inline payload).
pub const SLOT_DATA: usize = 112;

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
pub const MAX_GATHER: usize = crate::qp::MAX_SGE as usize;
/// Bytes of one gather entry in a continuation slot: offset (u64 LE), length (u32 LE),
/// reserved (u32, zero).
pub const GATHER_ENTRY_LEN: usize = 16;
/// Gather entries per continuation slot.
pub const GATHER_PER_SLOT: usize = size_of::<PacketSlot>() / GATHER_ENTRY_LEN;
/// Most continuation slots behind one packet.
pub const MAX_CONTINUATION: usize = MAX_GATHER.div_ceil(GATHER_PER_SLOT);

/// How many continuation slots follow `slot` (0 unless it is a gather packet; a count the
/// peer made up above [`MAX_GATHER`] yields 0, and the receiver rejects the slot).
pub fn continuation_slots(slot: &PacketSlot) -> usize {
    let n = slot.sge_count as usize;
    if slot.kind == KIND_GATHER && n <= MAX_GATHER {
        n.div_ceil(GATHER_PER_SLOT)
    } else {
        0
    }
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

/// One packet on a link. `#[repr(C)]`, 128 bytes, any bit pattern valid.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct PacketSlot {
    /// Bytes of transport headers at the start of `data`.
    pub hdr_len: u8,
    /// How the payload is carried: one of the `KIND_*` constants.
    pub kind: u8,
    /// Gather entries (kind [`KIND_GATHER`]).
    pub sge_count: u8,
    /// Flags: [`ICRC_FLAG`](crate::fault::ICRC_FLAG) (the packet carries an ICRC, set by a
    /// sender injecting faults); other bits zero.
    pub reserved: u8,
    /// Payload bytes.
    pub payload_len: u32,
    /// Arena offset of the payload (direct) or of the first gather entry (gather).
    pub payload_off: u64,
    /// Transport headers, then inline payload or the gather skip.
    pub data: [u8; SLOT_DATA],
}

const _: () = assert!(size_of::<PacketSlot>() == 128);

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
    Headers(crate::wire::Error),
    /// The parsed headers are not `hdr_len` bytes.
    HeaderMismatch { parsed: usize, claimed: u8 },
    /// A payload on an opcode without one, or the reverse, or an unknown kind.
    PayloadKind(u8),
    /// The inline payload overruns the slot.
    InlineOverrun,
    /// Gather with no entries, or more than [`MAX_GATHER`].
    GatherCount(u8),
    /// The continuation slots of a gather packet are missing.
    MissingContinuation,
}

/// A received packet: a checked view of a slot copied out of a ring.
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
    /// The continuation slots (gather entries) that followed it.
    cont: &'a [PacketSlot],
    /// The opcode's row of the opcode table.
    pub(crate) info: &'static OpcodeInfo,
    pub(crate) payload: Payload,
}

impl<'a> RxPacket<'a> {
    /// Parses and checks a slot copied out of a ring, with the continuation slots that
    /// followed it ([`continuation_slots`] of them; pass `&[]` for other packets).
    #[inline]
    pub(crate) fn parse(
        slot: &'a PacketSlot,
        cont: &'a [PacketSlot],
    ) -> std::result::Result<RxPacket<'a>, SlotError> {
        let hdr_len = slot.hdr_len as usize;
        if !(crate::wire::bth::HEADER_LEN..=SLOT_DATA).contains(&hdr_len) {
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
                if cont.len() < continuation_slots(slot) {
                    return Err(SlotError::MissingContinuation);
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
    pub(crate) fn opcode(&self) -> crate::wire::opcode::Opcode {
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
    #[cfg(test)]
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
    pub(crate) fn positive_ack(&self) -> Option<(crate::wire::aeth::CreditCode, crate::wire::Msn)> {
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
                crate::wire::IethRepr::parse(&crate::wire::ieth::Packet::new_unchecked(b)).ok()
            })
            .map(|r| r.rkey)
    }
}

/// Range `i` of a gather list stored in continuation slots `cont`.
pub(crate) fn gather_entry(cont: &[PacketSlot], i: usize) -> Option<(u64, u32)> {
    let slot = cont.get(i / GATHER_PER_SLOT)?;
    let at = (i % GATHER_PER_SLOT) * GATHER_ENTRY_LEN;
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

/// Writes range `i` of a gather list into continuation slots `cont`; false if they have no
/// room for it.
#[inline]
pub(crate) fn set_gather_entry(cont: &mut [PacketSlot], i: usize, off: u64, len: u32) -> bool {
    let Some(slot) = cont.get_mut(i / GATHER_PER_SLOT) else {
        return false;
    };
    let at = (i % GATHER_PER_SLOT) * GATHER_ENTRY_LEN;
    let b = &mut bytemuck::bytes_of_mut(slot)[at..at + GATHER_ENTRY_LEN];
    b[0..8].copy_from_slice(&off.to_le_bytes());
    b[8..12].copy_from_slice(&len.to_le_bytes());
    b[12..16].fill(0);
    true
}

/// Writes a packet's transport headers straight into a slot, in wire order: the BTH
/// first, then the extended headers the opcode calls for. The SQ and RQ Logic build only
/// packets the opcode table allows (debug builds check the set on [`finish`]); writing in
/// place spares building a [`PacketRepr`](crate::wire::PacketRepr) per packet.
///
/// [`finish`]: HeaderWriter::finish
pub(crate) struct HeaderWriter<'a> {
    slot: &'a mut PacketSlot,
    at: usize,
    #[cfg(debug_assertions)]
    written: Headers,
    #[cfg(debug_assertions)]
    opcode: crate::wire::opcode::Opcode,
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
        crate::wire::IethRepr { rkey }.emit(&mut crate::wire::ieth::Packet::new_unchecked(
            self.next(Headers::IETH),
        ));
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

/// Packets buffered for one link's outgoing ring, published once per burst.
pub(crate) struct TxBatch {
    producer: Producer<PacketSlot, ShmStorage<PacketSlot>>,
    buf: Box<[PacketSlot]>,
    len: usize,
    /// Ring slots known to be free (beyond `len`), refreshed only when it runs out.
    free: usize,
    broken: Option<LinkBroken>,
}

/// Packets one link sends per engine iteration (one publish).
pub(crate) const TX_BURST: usize = 64;

impl TxBatch {
    fn new(producer: Producer<PacketSlot, ShmStorage<PacketSlot>>) -> TxBatch {
        TxBatch {
            producer,
            buf: vec![PacketSlot::zeroed(); TX_BURST + MAX_CONTINUATION].into_boxed_slice(),
            len: 0,
            free: 0,
            broken: None,
        }
    }

    /// Whether one more packet with up to `extra` continuation slots can be queued without
    /// waiting for the peer: the burst has room (it is published once per engine
    /// iteration, see [`Link::publish`]) and so does the ring.
    pub(crate) fn has_room_for(&mut self, extra: usize) -> bool {
        if self.broken.is_some() || self.len >= TX_BURST {
            return false;
        }
        let need = self.len + 1 + extra.min(MAX_CONTINUATION);
        if need <= self.free {
            return true;
        }
        match self.producer.free_slots() {
            Ok(f) => self.free = f,
            Err(e) => self.broken = Some(e),
        }
        self.broken.is_none() && need <= self.free
    }

    /// The next slot to fill, or `None` if there is no room. Call [`TxBatch::commit`] after
    /// filling it.
    #[cfg(test)]
    pub(crate) fn next_slot(&mut self) -> Option<&mut PacketSlot> {
        self.next_slot_for(0)
    }

    /// The next slot to fill for a packet that may need up to `extra` continuation slots
    /// (a gather list), and room for those, or `None` if there is no room.
    pub(crate) fn next_packet(
        &mut self,
        extra: usize,
    ) -> Option<(&mut PacketSlot, &mut [PacketSlot])> {
        let extra = extra.min(MAX_CONTINUATION);
        self.next_slot_for(extra)?;
        let (slot, rest) = self.buf[self.len..].split_first_mut()?;
        Some((slot, &mut rest[..extra]))
    }

    fn next_slot_for(&mut self, extra: usize) -> Option<&mut PacketSlot> {
        if !self.has_room_for(extra) {
            return None;
        }
        let slot = &mut self.buf[self.len];
        // Only the metadata needs clearing: the data area is written up to hdr_len plus the
        // payload, and the receiver reads nothing beyond.
        slot.hdr_len = 0;
        slot.kind = KIND_NONE;
        slot.sge_count = 0;
        slot.reserved = 0;
        slot.payload_len = 0;
        slot.payload_off = 0;
        Some(slot)
    }

    /// Queues the packet last returned by [`TxBatch::next_slot`] or
    /// [`TxBatch::next_packet`], with the continuation slots its gather list fills.
    pub(crate) fn commit(&mut self) {
        debug_assert!(self.len < TX_BURST);
        let slot = &self.buf[self.len];
        let n = if slot.kind == KIND_GATHER {
            continuation_slots(slot)
        } else {
            0
        };
        debug_assert!(self.len + 1 + n <= self.free.min(self.buf.len()));
        self.len += 1 + n;
    }

    /// Forgets the packets queued from position `len` on (the fault stage re-queues them).
    pub(crate) fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Queues a whole packet (its slot and continuation slots); false if there is no room.
    pub(crate) fn push_packet(&mut self, slots: &[PacketSlot]) -> bool {
        let Some((first, rest)) = slots.split_first() else {
            return true;
        };
        let Some((slot, cont)) = self.next_packet(rest.len()) else {
            return false;
        };
        *slot = *first;
        cont.copy_from_slice(&rest[..cont.len()]);
        self.commit();
        true
    }

    /// The packets queued and not yet published.
    pub(crate) fn queued(&self) -> &[PacketSlot] {
        &self.buf[..self.len]
    }

    /// Whether no packet is queued (`queued().is_empty()`, without forming the slice).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many slots are queued (`queued().len()`, without forming the slice).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Publishes the queued packets (one index store); returns how many.
    pub(crate) fn flush(&mut self) -> usize {
        if self.len == 0 || self.broken.is_some() {
            return 0;
        }
        match self.producer.push_burst(&self.buf[..self.len]) {
            Ok(n) => {
                debug_assert_eq!(n, self.len, "room was checked before queueing");
                self.free = self.free.saturating_sub(n);
                self.len = 0;
                n
            }
            Err(e) => {
                self.broken = Some(e);
                0
            }
        }
    }

    /// Why the ring broke, if it did.
    pub(crate) fn broken(&self) -> Option<&LinkBroken> {
        self.broken.as_ref()
    }
}

/// The segment kind tag of a link.
pub(crate) const LINK_KIND: u32 = 0x4b4e_494c; // "LINK"
const LINK_MAGIC: u64 = u64::from_le_bytes(*b"SHLINK\0\x01");
/// Packet slots per direction.
pub(crate) const DEFAULT_LINK_SLOTS: usize = 1024;
/// The most packet slots per direction a link may have (`ContextBuilder::link_slots`); an
/// opener refuses a larger link segment.
pub(crate) const MAX_LINK_SLOTS: usize = crate::limits::MAX_LINK_SLOTS;

/// The link header at data offset 0: where the two rings are.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct LinkHeader {
    magic: u64,
    ring_off: [u64; 2],
}

/// Which end of a link segment this process holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// Created the segment: sends on ring 0.
    Creator,
    /// Opened it: sends on ring 1.
    Opener,
    /// Both ends in one engine (a context linked with itself): sends and receives on
    /// ring 0, so a QP can talk to itself or to another QP of the same context.
    Loopback,
}

/// Bytes of a link segment's data area with `slots` packet slots per direction.
fn link_segment_len(slots: usize) -> Result<usize> {
    let ring = shm_ring_bytes::<PacketSlot>(slots)
        .map_err(|e| Error::invalid("link slots", e.to_string()))?;
    Ok(4096 + 2 * ring.div_ceil(4096) * 4096)
}

/// Maps a link segment a peer created: at most the size of a link of [`MAX_LINK_SLOTS`]
/// slots, not populated (its ring pages are faulted in as packets first use them).
pub(crate) fn open_link_segment(fd: std::os::fd::OwnedFd) -> Result<Arc<Segment>> {
    let seg = Segment::open(
        fd,
        LINK_KIND,
        shmhca_rings::segment::Access::ReadWrite,
        link_segment_len(MAX_LINK_SLOTS)?,
    )?;
    Ok(Arc::new(seg))
}

/// Creates a link segment with `slots` packet slots per direction.
pub(crate) fn create_link_segment(slots: usize, huge: HugePages) -> Result<Arc<Segment>> {
    if slots > MAX_LINK_SLOTS {
        return Err(Error::invalid(
            "link slots",
            format!("{slots}; a link has at most {MAX_LINK_SLOTS} slots per direction"),
        ));
    }
    let ring = shm_ring_bytes::<PacketSlot>(slots)
        .map_err(|e| Error::invalid("link slots", e.to_string()))?;
    let stride = ring.div_ceil(4096) * 4096;
    let first = 4096;
    let seg = Segment::builder(LINK_KIND, link_segment_len(slots)?)
        .name("shmhca-link")
        .huge_pages(huge)
        .create()?;
    let offs = [first as u64, (first + stride) as u64];
    for off in offs {
        init_shm_ring::<PacketSlot>(&seg, off as usize, slots)
            .map_err(|e| Error::invalid("link segment", e.to_string()))?;
    }
    let hdr = LinkHeader {
        magic: LINK_MAGIC,
        ring_off: offs,
    };
    seg.write_at(0, bytemuck::bytes_of(&hdr))
        .map_err(|e| Error::invalid("link segment", e.to_string()))?;
    Ok(Arc::new(seg))
}

/// The two ring ends of one side of a link.
pub(crate) struct LinkEnds {
    pub(crate) tx: Producer<PacketSlot, ShmStorage<PacketSlot>>,
    pub(crate) rx: Consumer<PacketSlot, ShmStorage<PacketSlot>>,
}

/// Attaches this side's ends of the rings in a link segment (created here or received).
///
/// A received segment was laid out by the peer, so nothing in it is trusted: each ring
/// offset must leave the link header alone and hold a valid ring that fits in the segment
/// (its slot count a power of two the ring layer accepts), and the two rings must be
/// distinct and must not overlap. The slot counts checked are the private copies the ring
/// ends keep, so a peer rewriting a ring header afterwards changes nothing.
///
/// # Errors
/// [`Error::Connect`] naming the ring and what is wrong with it.
pub(crate) fn attach(segment: &Arc<Segment>, side: Side) -> Result<LinkEnds> {
    let bad = |what: String| {
        Error::Connect(format!(
            "the link segment is malformed: {what} (the peer is broken, hostile or another shmhca version)"
        ))
    };
    let mut raw = [0u8; size_of::<LinkHeader>()];
    segment
        .read_at(0, &mut raw)
        .map_err(|e| Error::Connect(format!("link segment has no header: {e}")))?;
    let hdr: LinkHeader = bytemuck::pod_read_unaligned(&raw);
    if hdr.magic != LINK_MAGIC {
        return Err(Error::Connect(format!(
            "link segment header magic {:#x} is not shmhca's {LINK_MAGIC:#x}: the peer is not shmhca or another version",
            hdr.magic
        )));
    }
    let data_len = segment.data_len();
    let off = |i: usize| {
        let o = hdr.ring_off[i];
        match usize::try_from(o) {
            Ok(o) if o >= size_of::<LinkHeader>() && o < data_len => Ok(o),
            _ => Err(bad(format!(
                "ring {i} is at offset {o:#x}, outside {:#x}..{data_len:#x} (after the link header, inside the segment's {data_len} data bytes)",
                size_of::<LinkHeader>()
            ))),
        }
    };
    let (offs, tx_ring, rx_ring) = match side {
        Side::Creator => ([off(0)?, off(1)?], 0, 1),
        Side::Opener => ([off(0)?, off(1)?], 1, 0),
        Side::Loopback => ([off(0)?, off(0)?], 0, 0),
    };
    if side != Side::Loopback && offs[0] == offs[1] {
        return Err(bad(format!(
            "both rings are at the same offset {:#x}; each direction needs its own ring",
            offs[0]
        )));
    }
    let ring_err = |i: usize, e: shmhca_rings::ring::RingOpenError| {
        bad(format!("ring {i} at offset {:#x}: {e}", offs[i]))
    };
    let tx = shm_producer(segment.clone(), offs[tx_ring]).map_err(|e| ring_err(tx_ring, e))?;
    let rx = shm_consumer(segment.clone(), offs[rx_ring]).map_err(|e| ring_err(rx_ring, e))?;
    if side != Side::Loopback {
        // The extents as the ring ends will use them (their private slot counts).
        let extent = |i: usize, slots: usize| {
            let len = shm_ring_bytes::<PacketSlot>(slots)
                .map_err(|e| bad(format!("ring {i} at offset {:#x}: {e}", offs[i])))?;
            Ok::<_, Error>((offs[i], offs[i].saturating_add(len)))
        };
        let t = extent(tx_ring, tx.capacity())?;
        let r = extent(rx_ring, rx.capacity())?;
        if t.0 < r.1 && r.0 < t.1 {
            let (r0, r1) = if tx_ring == 0 { (t, r) } else { (r, t) };
            return Err(bad(format!(
                "ring 0 ({:#x}..{:#x}) and ring 1 ({:#x}..{:#x}) overlap",
                r0.0, r0.1, r1.0, r1.1
            )));
        }
    }
    Ok(LinkEnds { tx, rx })
}

/// What tells a peer's arenas apart: the memfd's device and inode numbers (or, for a peer
/// in this process, its protection domain and engine numbers).
pub(crate) type ArenaKey = (u64, u64);

/// One link as the engine holds it.
pub(crate) struct Link {
    /// Keeps the link segment mapped.
    _segment: Arc<Segment>,
    pub(crate) rx: Consumer<PacketSlot, ShmStorage<PacketSlot>>,
    pub(crate) tx: TxBatch,
    /// The peer's engine page, read-only (its wake-up word).
    peer_page: Mem,
    /// The peer's arenas mapped for this link (read-only), by their identity.
    peer_arenas: Vec<(ArenaKey, Mem)>,
    /// Which arena each connected peer QP sends payloads from.
    peer_qps: Vec<(Qpn, usize)>,
    /// Set when the link is torn down (peer broke a ring, or hung up).
    pub(crate) down: Option<String>,
    /// The last receive burst was full: more packets may be waiting in the ring, among
    /// them responses that would stop a transport timer (see `requester::on_tick`).
    pub(crate) rx_backlog: bool,
    /// The pcap endpoint numbers of this side and the peer.
    pub(crate) endpoints: (u32, u32),
    /// Whether received packets are traced (not when the sender traces to the same file).
    pub(crate) rx_tap: bool,
    /// Whether the peer engine may sleep (then it must be woken after sending to it).
    peer_may_sleep: bool,
    /// The peer context, when it lives in this process (`Context::link_with`): where a
    /// peer QP's arena is looked up when a QP is given its destination.
    pub(crate) local_peer: Option<std::sync::Weak<crate::verbs::Shared>>,
}

impl Link {
    /// Publishes this iteration's outgoing burst with one index store, and wakes the peer
    /// engine if it may be asleep.
    ///
    /// Called for every link every iteration, and mostly with nothing queued: that answer
    /// costs one load here, not a call.
    #[inline]
    pub(crate) fn publish(&mut self) {
        if self.tx.is_empty() {
            return; // nothing queued (flush would push nothing)
        }
        self.publish_queued();
    }

    /// [`Link::publish`] when packets are queued.
    #[inline(never)]
    fn publish_queued(&mut self) {
        if self.tx.flush() > 0 {
            if let Some(word) = self.peer_wake() {
                crate::engine::wake::wake(word);
            }
        }
    }

    /// The peer's wake word, if the peer may sleep.
    #[inline]
    pub(crate) fn peer_wake(&self) -> Option<&std::sync::atomic::AtomicU32> {
        if !self.peer_may_sleep {
            return None;
        }
        self.peer_page.atomic_u32(crate::arena::WAKE_WORD).ok()
    }

    /// The process id the peer's engine page claims (for display only).
    pub(crate) fn peer_pid(&self) -> Option<u32> {
        let mut b = [0u8; 8];
        self.peer_page.read(crate::arena::PID_WORD, &mut b).ok()?;
        u32::try_from(u64::from_le_bytes(b)).ok()
    }

    /// The peer arena named `key`, if it was mapped for this link already.
    pub(crate) fn peer_arena(&self, key: ArenaKey) -> Option<&Mem> {
        self.peer_arenas
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, m)| m)
    }

    /// Records that peer QP `qpn` sends from the peer arena `key`, mapped as `mem` (ignored
    /// if that arena is known already).
    pub(crate) fn add_peer_qp(&mut self, qpn: Qpn, key: ArenaKey, mem: Mem) {
        let at = match self.peer_arenas.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                self.peer_arenas.push((key, mem));
                self.peer_arenas.len() - 1
            }
        };
        match self.peer_qps.iter_mut().find(|(q, _)| *q == qpn) {
            Some(e) => e.1 = at,
            None => self.peer_qps.push((qpn, at)),
        }
    }

    /// The arena peer QP `qpn` sends from, as recorded by [`Link::add_peer_qp`].
    pub(crate) fn peer_qp_arena(&self, qpn: Qpn) -> Option<&Mem> {
        let (_, i) = self.peer_qps.iter().find(|(q, _)| *q == qpn)?;
        self.peer_arenas.get(*i).map(|(_, m)| m)
    }

    pub(crate) fn new(
        segment: Arc<Segment>,
        ends: LinkEnds,
        peer_page: Mem,
        endpoints: (u32, u32),
    ) -> Link {
        // Read once: the peer decides at creation whether it may ever sleep.
        let peer_may_sleep = peer_page
            .atomic_u32(crate::arena::MAY_SLEEP)
            .is_ok_and(|w| w.load(std::sync::atomic::Ordering::Relaxed) != 0);
        Link {
            _segment: segment,
            rx: ends.rx,
            tx: TxBatch::new(ends.tx),
            peer_page,
            peer_arenas: Vec::new(),
            peer_qps: Vec::new(),
            local_peer: None,
            down: None,
            rx_backlog: false,
            endpoints,
            rx_tap: true,
            peer_may_sleep,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::psn::Psn;
    use crate::wire::PacketRepr;
    use crate::wire::bth::BthRepr;
    use crate::wire::opcode::Opcode;
    use crate::wire::{Qpn, reth::RethRepr};

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
            SlotError::MissingContinuation,
            "a gather packet needs its continuation slot"
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
        use crate::wire::opcode::Headers;
        use crate::wire::{
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
        let s = slot_with(Opcode::SendOnly, KIND_INLINE, 101);
        assert_eq!(
            RxPacket::parse(&s, &[]).unwrap_err(),
            SlotError::InlineOverrun
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
                s.payload_len %= 128;
            }
            if let Ok(p) = RxPacket::parse(&s, &[]) {
                let hdr = s.hdr_len as usize;
                let (repr, len) = PacketRepr::parse(&s.data[..hdr]).expect("both parsers agree");
                proptest::prop_assert_eq!(len, hdr);
                proptest::prop_assert_eq!(p.bth(), repr.bth);
                proptest::prop_assert_eq!(p.reth(), repr.reth);
                proptest::prop_assert_eq!(p.aeth(), repr.aeth);
                let positive = match repr.aeth {
                    Some(AethRepr { syndrome: crate::wire::aeth::Syndrome::Ack { credits }, msn }) => {
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

    /// A link segment laid out by a (possibly hostile) creator: the rings at `rings`
    /// (offset, slot count), the header naming `offs`; `data_len` data bytes.
    fn crafted(data_len: usize, rings: &[(usize, usize)], offs: [u64; 2]) -> Arc<Segment> {
        let seg = Segment::builder(LINK_KIND, data_len)
            .huge_pages(HugePages::Never)
            .create()
            .unwrap();
        for &(off, slots) in rings {
            init_shm_ring::<PacketSlot>(&seg, off, slots).unwrap();
        }
        let hdr = LinkHeader {
            magic: LINK_MAGIC,
            ring_off: offs,
        };
        seg.write_at(0, bytemuck::bytes_of(&hdr)).unwrap();
        Arc::new(seg)
    }

    /// The segment as the other side opens it.
    fn opened(seg: &Segment) -> Arc<Segment> {
        open_link_segment(seg.try_clone_fd().unwrap()).unwrap()
    }

    fn refused(seg: &Arc<Segment>, side: Side) -> String {
        match attach(seg, side) {
            Ok(_) => panic!("a crafted link segment was accepted ({side:?})"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_link_whose_two_rings_are_one_is_refused() {
        let seg = crafted(64 << 10, &[(4096, 64)], [4096, 4096]);
        for side in [Side::Opener, Side::Creator] {
            let why = refused(&opened(&seg), side);
            assert!(why.contains("same offset"), "{why}");
        }
    }

    #[test]
    fn a_link_whose_rings_overlap_is_refused() {
        // Ring 0 spans 4096 + 384 + 64 * 128 bytes; ring 1 starts inside it, and the other
        // way round.
        let a = crafted(64 << 10, &[(4096, 64), (8192, 8)], [4096, 8192]);
        let b = crafted(64 << 10, &[(4096, 64), (8192, 8)], [8192, 4096]);
        for seg in [a, b] {
            for side in [Side::Opener, Side::Creator] {
                let why = refused(&opened(&seg), side);
                assert!(why.contains("overlap"), "{why}");
            }
        }
    }

    #[test]
    fn a_ring_over_the_link_header_is_refused() {
        // A ring offset inside the link header is refused before anything is read there.
        let seg = crafted(64 << 10, &[(4096, 8)], [0, 4096]);
        let why = refused(&opened(&seg), Side::Opener);
        assert!(
            why.contains("link segment") && why.contains("ring 0"),
            "{why}"
        );
    }

    #[test]
    fn rings_past_the_end_or_with_huge_slot_counts_are_refused() {
        let len = 64 << 10;
        // Offsets past the end, at the end, and so large that adding to them overflows.
        for off in [len as u64 + 4096, len as u64, u64::MAX - 63, 1 << 63] {
            let seg = crafted(len, &[(4096, 8)], [4096, off]);
            let why = refused(&opened(&seg), Side::Opener);
            assert!(why.contains("ring 1"), "{off:#x}: {why}");
        }
        // A slot count that does not fit, is not a power of two, or is absurd.
        for slots in [1u64 << 20, 1 << 40, 3, 0, u64::MAX] {
            let seg = crafted(len, &[(4096, 8), (16384, 8)], [4096, 16384]);
            // The capacity field follows magic (8 bytes), version and slot size (4 each).
            seg.write_at(16384 + 16, &slots.to_le_bytes()).unwrap();
            let why = refused(&opened(&seg), Side::Opener);
            assert!(why.contains("ring 1"), "{slots}: {why}");
        }
        // A ring that ends one slot past the end of the segment.
        let seg = crafted(len, &[(4096, 8), (16384, 8)], [4096, 16384]);
        let fits = (len - 16384 - 384) / size_of::<PacketSlot>();
        let over = fits.next_power_of_two() as u64;
        assert!(16384 + 384 + over as usize * size_of::<PacketSlot>() > len);
        seg.write_at(16384 + 16, &over.to_le_bytes()).unwrap();
        let why = refused(&opened(&seg), Side::Opener);
        assert!(why.contains("ring 1"), "{why}");
    }

    #[test]
    fn a_well_formed_crafted_link_attaches() {
        let seg = crafted(64 << 10, &[(4096, 64), (16384, 8)], [4096, 16384]);
        let ends = attach(&opened(&seg), Side::Opener).unwrap();
        assert_eq!((ends.tx.capacity(), ends.rx.capacity()), (8, 64));
    }

    #[test]
    fn a_link_segment_carries_packets_both_ways() {
        let seg = create_link_segment(8, HugePages::Never).unwrap();
        let peer_view = Arc::new(
            Segment::open(
                seg.try_clone_fd().unwrap(),
                LINK_KIND,
                shmhca_rings::segment::Access::ReadWrite,
                usize::MAX,
            )
            .unwrap(),
        );
        let a = attach(&seg, Side::Creator).unwrap();
        let b = attach(&peer_view, Side::Opener).unwrap();
        let mut atx = TxBatch::new(a.tx);
        let mut brx = b.rx;
        for i in 0..20u32 {
            let s = atx.next_slot().expect("room");
            s.payload_len = i;
            atx.commit();
            atx.flush();
            let got = brx.pop().unwrap().unwrap();
            assert_eq!(got.payload_len, i);
        }
        // Fill the ring: room runs out at capacity, without losing anything.
        let mut n = 0;
        while atx.next_slot().is_some() {
            atx.commit();
            n += 1;
            assert!(n <= 8 + TX_BURST, "room must run out");
        }
        atx.flush();
        assert_eq!(n, 8);
        let mut out = [PacketSlot::zeroed(); 16];
        assert_eq!(brx.pop_burst(&mut out).unwrap(), 8);
        let mut btx = TxBatch::new(b.tx);
        let mut arx = a.rx;
        btx.next_slot().unwrap().payload_len = 99;
        btx.commit();
        btx.flush();
        assert_eq!(arx.pop().unwrap().unwrap().payload_len, 99);
    }
}
