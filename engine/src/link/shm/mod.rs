//! The shared-memory link: the packet path between two engines of one machine.
//!
//! A link is a shared segment holding two SPSC line rings ([`shmhca_rings::lines`]), one
//! per direction. Each side also holds, read-only, the peer's engine page (to wake it) and
//! the arenas of the peer QPs connected over the link, so payloads sent by reference can be
//! copied straight out of them. The side that creates the segment sends on ring 0 and
//! receives on ring 1; the side that opens it does the opposite.
//!
//! What travels on a ring is a packet as one frame of lines: a [`PacketSlot`] (one line,
//! whose bytes are the frame's first line as they are) and the continuation lines of its
//! gather list, if it has one. The slot format lives in [`slot`], which writes and
//! parses it; this module moves frames (each staged packet out as one
//! frame, frames in) and owns the shared segment.
//!
//! Nothing in a received frame is trusted: the ring checks its stamps and line count, the
//! engine parses each packet with `RxPacket::parse` against the frame's line count, and
//! every offset into the peer's arena is bounds-checked at copy time against the length of
//! the mapping (a private copy, taken when it was mapped).

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use shmhca_rings::lines::{
    Line, LinesConsumer, LinesProducer, ReserveError, ShmLines, init_shm_lines, shm_lines_bytes,
    shm_lines_consumer, shm_lines_producer,
};
use shmhca_rings::ring::LinkBroken;
use shmhca_rings::segment::{HugePages, Segment};

use crate::error::{Error, Result};
use crate::mem::Mem;
use crate::wire::Qpn;
use slot::{KIND_NONE, MAX_CONTINUATION, MAX_PACKET_LINES, PacketSlot, SLOT_BYTES, frame_lines};

// A slot is a line of the ring as it is: its own bytes start where the ring leaves the line
// to its user, and a packet's frame fits a frame of the ring.
const _: () = assert!(SLOT_BYTES == shmhca_rings::lines::LINE_BYTES);
const _: () = assert!(align_of::<PacketSlot>() == align_of::<Line>());
const _: () = assert!(std::mem::offset_of!(PacketSlot, hdr_len) == shmhca_rings::lines::USER_START);
const _: () = assert!(MAX_PACKET_LINES <= shmhca_rings::lines::MAX_FRAME_LINES);
// A batch's free-line count (a u32) holds any ring's line count.
const _: () = assert!(MAX_LINK_SLOTS <= u32::MAX as usize);

pub use crate::ids::LinkId;

pub mod slot;

/// Packets staged for one link's outgoing ring, each published as one frame once per
/// burst.
pub(crate) struct TxBatch {
    producer: LinesProducer<ShmLines>,
    /// The staged packets: each a slot, then the continuation lines of its gather list.
    buf: Box<[PacketSlot]>,
    /// Lines staged (packets and their continuation lines): each is a line of the ring.
    len: usize,
    /// Ring lines known to be free (beyond `len`), refreshed only when they run out. (A
    /// u32, a ring having at most `MAX_LINK_SLOTS` lines: with `sent_direct` it takes the
    /// word a usize took, and the link keeps its 512 bytes, a shift to index.)
    free: u32,
    broken: Option<LinkBroken>,
    /// A packet went straight into the ring since the last publication
    /// ([`TxBatch::send_line`]): the peer may need waking though nothing is queued.
    sent_direct: bool,
}

/// Packets one link sends per engine iteration (one publish).
pub(crate) const TX_BURST: usize = 64;
/// Lines a batch holds: a whole packet behind any of the [`TX_BURST`] first lines.
const BATCH_LINES: usize = TX_BURST + MAX_CONTINUATION;

impl TxBatch {
    fn new(producer: LinesProducer<ShmLines>) -> TxBatch {
        TxBatch {
            producer,
            buf: vec![PacketSlot::zeroed(); BATCH_LINES].into_boxed_slice(),
            len: 0,
            free: 0,
            broken: None,
            sent_direct: false,
        }
    }

    /// Whether one more packet with up to `extra` continuation lines can be queued without
    /// waiting for the peer: the burst has room (it is published once per engine
    /// iteration, see [`Link::publish`]) and so does the ring. (A burst that reaches the
    /// ring's end gives the lines up to it to padding; a packet whose frame then finds no
    /// room stays queued, in order, until the peer has made some: [`TxBatch::flush`].)
    pub(crate) fn has_room_for(&mut self, extra: usize) -> bool {
        if self.broken.is_some() || self.len >= TX_BURST {
            return false;
        }
        let need = self.len + 1 + extra.min(MAX_CONTINUATION);
        if need <= self.free as usize {
            return true;
        }
        match self.producer.free_lines() {
            Ok(f) => self.free = u32::try_from(f).unwrap_or(u32::MAX),
            Err(e) => self.broken = Some(e),
        }
        self.broken.is_none() && need <= self.free as usize
    }

    /// How far the peer has read the ring: the index of the first line it has not freed
    /// (a count that only grows), reloaded from the peer. Two equal answers mean it freed
    /// nothing in between (`requester::LinkWait`: a peer still reading is not a peer that
    /// stopped). 0 once the ring is broken.
    pub(crate) fn peer_mark(&mut self) -> u64 {
        let ring = self.producer.capacity() as u64;
        match self.producer.free_lines() {
            Ok(free) => (self.producer.tail() + free as u64).wrapping_sub(ring),
            Err(_) => 0,
        }
    }

    /// The next slot to fill, or `None` if there is no room. Call [`TxBatch::commit`] after
    /// filling it.
    #[cfg(test)]
    pub(crate) fn next_slot(&mut self) -> Option<&mut PacketSlot> {
        self.next_line()
    }

    /// [`TxBatch::next_packet`]`(0)`, the slot of a one-line packet, compiled into its
    /// caller when the room is known (the template path's every post): the rest out of
    /// line.
    #[inline(always)]
    pub(crate) fn next_line(&mut self) -> Option<&mut PacketSlot> {
        if self.len < TX_BURST && self.len < self.free as usize && self.broken.is_none() {
            return Some(self.clear_slot());
        }
        self.next_slot_for(0)
    }

    /// The next slot to fill for a packet that may need up to `extra` continuation lines
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
        Some(self.clear_slot())
    }

    /// The slot at `len`, its metadata cleared.
    #[inline(always)]
    fn clear_slot(&mut self) -> &mut PacketSlot {
        let slot = &mut self.buf[self.len];
        // Only the metadata needs clearing: the data area is written up to hdr_len plus the
        // payload, and the receiver reads nothing beyond. (Bytes 0..5 are the ring's; bytes
        // 13..16 are written only by the fault stage, as an ICRC the receiver reads only
        // under ICRC_FLAG, which is cleared here.)
        slot.hdr_len = 0;
        slot.kind = KIND_NONE;
        slot.sge_count = 0;
        slot.reserved = 0;
        slot.payload_len = 0;
        slot.payload_off = 0;
        slot
    }

    /// Lines of the packet staged at `at` (its slot and continuation lines). The buffer
    /// has room for a whole packet behind any of the [`TX_BURST`] first lines.
    #[inline(always)]
    fn packet_lines(&self, at: usize) -> usize {
        debug_assert!(at < TX_BURST);
        frame_lines(&self.buf[at])
    }

    /// Queues the packet last returned by [`TxBatch::next_slot`] or
    /// [`TxBatch::next_packet`], with the continuation lines its gather list fills.
    #[inline]
    pub(crate) fn commit(&mut self) {
        debug_assert!(self.len < TX_BURST);
        let n = self.packet_lines(self.len);
        debug_assert!(self.len + n <= (self.free as usize).min(self.buf.len()));
        self.len += n;
    }

    /// Sends the one-line packet built in the slot [`TxBatch::next_packet`]`(0)` returned:
    /// straight into the ring's next line, stamped at once (the stamp is the doorbell), when
    /// `direct` and nothing is queued before it — no staged copy, no later flush; else
    /// queues it as [`TxBatch::commit`] does. (Nothing queued: the slot is the batch's
    /// first, private memory the packet was built in, and is copied into the ring while it
    /// is in this core's cache. A ring that turns out broken keeps the packet queued, as a
    /// flush would have left it.) The caller publishes with [`Link::publish_post`], which
    /// wakes the peer for it.
    ///
    /// `direct` is false when something must see the packet in the batch before it goes:
    /// the fault stage or the capture tap.
    #[inline(always)]
    pub(crate) fn send_line(&mut self, direct: bool) {
        if direct && self.len == 0 {
            debug_assert_eq!(frame_lines(&self.buf[0]), 1, "a one-line packet");
            // One line always fits before the ring's end (no padding), and the line is
            // free: `next_line` (or `has_room_for`) counted it when it handed out the slot.
            match self.producer.push_line(bytemuck::cast_ref(&self.buf[0])) {
                Ok(true) => {
                    debug_assert!(self.free >= 1);
                    self.free -= 1;
                    self.sent_direct = true;
                    #[cfg(test)]
                    crate::probe::count(crate::probe::Path::DirectPost);
                    return;
                }
                Ok(false) => debug_assert!(false, "a line counted free is not free"),
                Err(e) => self.broken = Some(e),
            }
        }
        self.commit();
    }

    /// Whether a packet went straight into the ring since the last call ([`TxBatch::send_line`]).
    #[inline(always)]
    fn take_sent_direct(&mut self) -> bool {
        std::mem::take(&mut self.sent_direct)
    }

    /// Forgets the packets queued from position `len` on (the fault stage re-queues them).
    pub(crate) fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Queues a whole packet (its slot and continuation lines); false if there is no room.
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

    /// The packets queued and not yet published (each a slot and its continuation lines).
    pub(crate) fn queued(&self) -> &[PacketSlot] {
        &self.buf[..self.len]
    }

    /// Whether no packet is queued (`queued().is_empty()`, without forming the slice).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many lines are queued (`queued().len()`, without forming the slice).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Publishes the queued packets, each as one frame written from its staged lines as
    /// they are; returns how many lines went. Packets the ring has no room for now (a burst
    /// that reached the ring's end gave lines to padding) stay queued, in order, for the
    /// next call.
    #[inline]
    pub(crate) fn flush(&mut self) -> usize {
        if self.len == 0 || self.broken.is_some() {
            return 0;
        }
        if self.len == 1 {
            // One one-line packet (a gather packet takes two lines or more): most bursts.
            // A one-line frame never needs padding before it.
            return match self.producer.push_line(bytemuck::cast_ref(&self.buf[0])) {
                Ok(true) => {
                    self.free = self.free.saturating_sub(1);
                    self.len = 0;
                    1
                }
                Ok(false) => 0,
                Err(e) => {
                    self.broken = Some(e);
                    0
                }
            };
        }
        self.flush_frames()
    }

    /// [`TxBatch::flush`] of more than one line: frame by frame (out of line, so that the
    /// one-line case needs none of its registers).
    #[inline(never)]
    fn flush_frames(&mut self) -> usize {
        let tail = self.producer.tail();
        let mut at = 0;
        while at < self.len {
            let n = self.packet_lines(at);
            match self.producer.reserve(n) {
                Ok(Some(mut frame)) => {
                    let lines: &[Line] = bytemuck::cast_slice(&self.buf[at..at + n]);
                    // The frame has `n` lines: writing `n` cannot fail.
                    let written = if n == 1 {
                        frame.write_line(0, &lines[0])
                    } else {
                        frame.write_lines(lines)
                    };
                    debug_assert!(written.is_ok());
                    frame.commit();
                }
                Ok(None) => break,
                Err(ReserveError::Broken(e)) => {
                    self.broken = Some(e);
                    break;
                }
                Err(ReserveError::FrameSize { .. }) => {
                    // A ring smaller than a packet's frame: `attach` refuses such rings, so
                    // this cannot be; were it so, the packet is dropped (as a lost packet,
                    // which the transport recovers), not left to block the queue.
                    debug_assert!(false, "a frame of {n} lines does not fit the ring");
                }
            }
            at += n;
        }
        let used = self.producer.tail().wrapping_sub(tail) as usize;
        self.free = self
            .free
            .saturating_sub(u32::try_from(used).unwrap_or(u32::MAX));
        if at < self.len {
            self.buf.copy_within(at..self.len, 0);
        }
        self.len -= at;
        at
    }

    /// Why the ring broke, if it did.
    pub(crate) fn broken(&self) -> Option<&LinkBroken> {
        self.broken.as_ref()
    }
}

/// The segment kind tag of a link.
pub(crate) const LINK_KIND: u32 = 0x4b4e_494c; // "LINK"
/// The link format's magic; its last byte is the format version (3: riding Acks, and the
/// fault stage's ICRC of inline packets in slot bytes 12..16), so that engines of
/// different formats refuse each other's links instead of misreading them.
const LINK_MAGIC: u64 = u64::from_le_bytes(*b"SHLINK\0\x03");
/// Lines per direction (`ContextBuilder::link_slots`; a small packet takes one line).
pub(crate) const DEFAULT_LINK_SLOTS: usize = 1024;
/// The most lines per direction a link may have (`ContextBuilder::link_slots`); an
/// opener refuses a larger link segment.
pub(crate) const MAX_LINK_SLOTS: usize = crate::limits::MAX_LINK_SLOTS;
/// The fewest lines per direction a link may have: room for the longest frame of a packet
/// ([`MAX_PACKET_LINES`]), so that every packet can be sent; an opener refuses a link
/// segment with a smaller ring.
pub(crate) const MIN_LINK_SLOTS: usize = crate::limits::MIN_LINK_SLOTS;
const _: () = assert!(MIN_LINK_SLOTS >= MAX_PACKET_LINES && MIN_LINK_SLOTS.is_power_of_two());

/// Where each direction's kick word is in a link segment: the sender on ring `i` bumps word
/// `i` after it published packets to a peer that sleeps (see [`crate::engine::wake`]). Each
/// on its own cache line, after the link header.
pub(crate) const KICK_OFF: [u64; 2] = [64, 128];
/// Bytes at the start of a link segment that no ring may use: the header and the kick words.
const LINK_HEADER_BYTES: usize = 192;

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

/// Bytes of a link segment's data area with `slots` lines per direction.
fn link_segment_len(slots: usize) -> Result<usize> {
    let ring = shm_lines_bytes(slots).map_err(|e| Error::invalid("link slots", e.to_string()))?;
    Ok(4096 + 2 * ring.div_ceil(4096) * 4096)
}

/// Maps a link segment a peer created: at most the size of a link of [`MAX_LINK_SLOTS`]
/// lines, not populated (its ring pages are faulted in as packets first use them).
pub(crate) fn open_link_segment(fd: std::os::fd::OwnedFd) -> Result<Arc<Segment>> {
    let seg = Segment::open(
        fd,
        LINK_KIND,
        shmhca_rings::segment::Access::ReadWrite,
        link_segment_len(MAX_LINK_SLOTS)?,
    )?;
    Ok(Arc::new(seg))
}

/// Creates a link segment with `slots` lines per direction.
pub(crate) fn create_link_segment(slots: usize, huge: HugePages) -> Result<Arc<Segment>> {
    if !(MIN_LINK_SLOTS..=MAX_LINK_SLOTS).contains(&slots) {
        return Err(Error::invalid(
            "link slots",
            format!("{slots}; a link has {MIN_LINK_SLOTS} to {MAX_LINK_SLOTS} lines per direction"),
        ));
    }
    let ring = shm_lines_bytes(slots).map_err(|e| Error::invalid("link slots", e.to_string()))?;
    let stride = ring.div_ceil(4096) * 4096;
    let first = 4096;
    let seg = Segment::builder(LINK_KIND, link_segment_len(slots)?)
        .name("shmhca-link")
        .huge_pages(huge)
        .create()?;
    let offs = [first as u64, (first + stride) as u64];
    for off in offs {
        init_shm_lines(&seg, off as usize, slots)
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
    pub(crate) tx: LinesProducer<ShmLines>,
    pub(crate) rx: LinesConsumer<ShmLines>,
    /// The offsets of the kick word this side bumps and of the one its peer bumps.
    pub(crate) kick: [u64; 2],
}

/// Attaches this side's ends of the rings in a link segment (created here or received).
///
/// A received segment was laid out by the peer, so nothing in it is trusted: each ring
/// offset must leave the link header alone and hold a valid line ring that fits in the
/// segment (its line count a power of two the ring layer accepts, and at least
/// [`MIN_LINK_SLOTS`] so that every packet's frame fits), and the two rings must be
/// distinct and must not overlap. The line counts checked are the private copies the ring
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
            Ok(o) if o >= LINK_HEADER_BYTES && o < data_len => Ok(o),
            _ => Err(bad(format!(
                "ring {i} is at offset {o:#x}, outside {LINK_HEADER_BYTES:#x}..{data_len:#x} (after the link header and kick words, inside the segment's {data_len} data bytes)"
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
    let tx =
        shm_lines_producer(segment.clone(), offs[tx_ring]).map_err(|e| ring_err(tx_ring, e))?;
    let rx =
        shm_lines_consumer(segment.clone(), offs[rx_ring]).map_err(|e| ring_err(rx_ring, e))?;
    for (i, lines) in [(tx_ring, tx.capacity()), (rx_ring, rx.capacity())] {
        if lines < MIN_LINK_SLOTS {
            return Err(bad(format!(
                "ring {i} at offset {:#x} has {lines} lines; a link ring needs at least {MIN_LINK_SLOTS}, room for the longest packet",
                offs[i]
            )));
        }
    }
    if side != Side::Loopback {
        // The extents as the ring ends will use them (their private line counts).
        let extent = |i: usize, lines: usize| {
            let len = shm_lines_bytes(lines)
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
    Ok(LinkEnds {
        tx,
        rx,
        kick: [KICK_OFF[tx_ring], KICK_OFF[rx_ring]],
    })
}

/// What tells a peer's arenas apart: the memfd's device and inode numbers (or, for a peer
/// in this process, its protection domain and engine numbers).
pub(crate) type ArenaKey = (u64, u64);

/// What the QPs facing a link do when it goes down (its peer hung up or broke a ring).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnPeerLoss {
    /// Every one enters the Error state: the connection manager's links, where a
    /// connection ends with its peer.
    ErrorQps,
    /// Each stays as it is, as an RC QP does in InfiniBand when its peer vanishes (no
    /// packet tells it), until it has a request to send: that fails with RetryExcErr, what
    /// its retries would end in, and the QP enters the Error state
    /// (`requester::on_peer_lost`). The fabric's links, which verbs programs use: a
    /// ping-pong whose peer exits after the last message keeps its spare receives. (The
    /// fabric moves the idle ones to the Error state after its peer-loss grace:
    /// `Engine::fail_link_qps`.)
    FailNextRequest,
}

/// One link as the engine holds it.
pub(crate) struct Link {
    /// Keeps the link segment mapped.
    _segment: Arc<Segment>,
    /// The link segment again, for its kick words ([`KICK_OFF`]).
    kick: Mem,
    /// The offsets of this side's kick word and of the peer's.
    kick_off: [u64; 2],
    pub(crate) rx: LinesConsumer<ShmLines>,
    pub(crate) tx: TxBatch,
    /// The peer's engine page, read-only (its wake-up word).
    peer_page: Mem,
    /// The peer's arenas mapped for this link (read-only), by their identity.
    peer_arenas: Vec<(ArenaKey, Mem)>,
    /// Which arena each connected peer QP sends payloads from.
    peer_qps: Vec<(Qpn, usize)>,
    /// Set when the link is torn down (peer broke a ring, or hung up).
    pub(crate) down: Option<String>,
    /// What the QPs facing the link do when it goes down.
    pub(crate) on_peer_loss: OnPeerLoss,
    /// The last receive burst was full: more packets may be waiting in the ring, among
    /// them responses that would stop a transport timer (see `requester::on_tick`).
    pub(crate) rx_backlog: bool,
    /// The pcap endpoint numbers of this side and the peer.
    pub(crate) endpoints: (u32, u32),
    /// Whether received packets are traced (not when the sender traces to the same file).
    pub(crate) rx_tap: bool,
    /// The largest path MTU a QP over this link may have: a UDP link's port's active MTU
    /// (what fits the interface's MTU); `None` on shared memory.
    pub(crate) max_mtu: Option<crate::qp::Mtu>,
    /// The most request packets a QP over this link keeps unacknowledged (a UDP link's
    /// cap: see `Requester::set_max_in_flight`); `None` on shared memory.
    pub(crate) max_in_flight: Option<u32>,
    /// Whether the peer engine may sleep (then it must be woken after sending to it). Read
    /// at setup; while false, looked up again at each stats publication of this engine
    /// (one iteration in `PUBLISH_EVERY`: nothing on the packet path), since an inline
    /// peer announces it later, once, when its application takes a completion channel's fd
    /// after the link was set up (`Device::allow_fd_sleep`); true for good once seen.
    peer_may_sleep: bool,
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

    /// [`Link::publish`] after a post, which may have sent its packet straight into the
    /// ring ([`TxBatch::send_line`]): publishes what is queued behind it, then wakes the
    /// peer engine if it may be asleep and anything went — one look for sleepers, after
    /// every line of the post is in the ring, as [`Link::publish`] does.
    #[inline]
    pub(crate) fn publish_post(&mut self) {
        let direct = self.tx.take_sent_direct();
        if !direct {
            self.publish();
            return;
        }
        if !self.tx.is_empty() {
            self.tx.flush();
        }
        if self.peer_may_sleep {
            self.wake_peer();
        }
    }

    /// [`Link::publish`] when packets are queued.
    #[inline(never)]
    fn publish_queued(&mut self) {
        if self.tx.flush() > 0 && self.peer_may_sleep {
            self.wake_peer();
        }
    }

    /// Looks whether the peer has announced since setup that it may sleep (one load of its
    /// engine page, which it writes once); remembered when it has. Called one engine
    /// iteration in `PUBLISH_EVERY`.
    #[cold]
    pub(crate) fn refresh_peer_may_sleep(&mut self) {
        if !self.peer_may_sleep {
            self.peer_may_sleep = self
                .peer_page
                .atomic_u32(crate::arena::MAY_SLEEP)
                .is_ok_and(|w| w.load(std::sync::atomic::Ordering::Relaxed) != 0);
        }
    }

    /// Whether this side wakes the peer after publishing to it (tests).
    #[cfg(test)]
    pub(crate) fn wakes_peer(&self) -> bool {
        self.peer_may_sleep
    }

    /// How many times this side has bumped its kick word (tests: each wake-up of a
    /// sleeping peer bumps it once).
    #[cfg(test)]
    pub(crate) fn kicks(&self) -> u32 {
        self.kick
            .atomic_u32(self.kick_off[0])
            .map_or(0, |w| w.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Wakes the peer engine if some thread of it sleeps: its sleeper count is in its
    /// engine page, the word to bump is this side's kick word of the link.
    fn wake_peer(&self) {
        if let Ok(sleepers) = self.peer_page.atomic_u32(crate::arena::WAKE_WORD) {
            crate::engine::wake::wake_with(
                sleepers,
                || self.kick.atomic_u32(self.kick_off[0]).ok(),
                false,
            );
        }
    }

    /// Adds the kick word the peer bumps for this side to a sleeper's wait set.
    pub(crate) fn wait_on_peer(&self, set: &mut crate::engine::wake::WaitSet) {
        set.add_shared(&self.kick, self.kick_off[1]);
    }

    /// The process id the peer's engine page claims (for display only).
    pub(crate) fn peer_pid(&self) -> Option<u32> {
        let mut b = [0u8; 8];
        self.peer_page.read(crate::arena::PID_WORD, &mut b).ok()?;
        u32::try_from(u64::from_le_bytes(b)).ok()
    }

    /// Replaces the peer's engine page: a link made before any engine held its peer's LID
    /// had a blank one until an engine attached ([`crate::fabric`]).
    pub(crate) fn set_peer_page(&mut self, page: Mem) {
        self.peer_page = page;
        self.peer_may_sleep = false;
        self.refresh_peer_may_sleep();
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
            kick: Mem::from_segment(segment.clone()),
            kick_off: ends.kick,
            _segment: segment,
            rx: ends.rx,
            tx: TxBatch::new(ends.tx),
            peer_page,
            peer_arenas: Vec::new(),
            peer_qps: Vec::new(),
            down: None,
            on_peer_loss: OnPeerLoss::ErrorQps,
            rx_backlog: false,
            endpoints,
            rx_tap: true,
            max_mtu: None,
            max_in_flight: None,
            peer_may_sleep,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::slot::{KIND_GATHER, set_gather_entry};
    use shmhca_rings::lines::MAX_FRAME_LINES;

    /// A link segment laid out by a (possibly hostile) creator: the rings at `rings`
    /// (offset, line count), the header naming `offs`; `data_len` data bytes.
    fn crafted(data_len: usize, rings: &[(usize, usize)], offs: [u64; 2]) -> Arc<Segment> {
        let seg = Segment::builder(LINK_KIND, data_len)
            .huge_pages(HugePages::Never)
            .create()
            .unwrap();
        for &(off, lines) in rings {
            init_shm_lines(&seg, off, lines).unwrap();
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

    /// Bytes of a line ring's header (before its lines).
    const RING_HEADER: usize = 256;

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
        // Ring 0 spans 4096 + 256 + 64 * 64 bytes; ring 1 starts inside it, and the other
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
    fn a_ring_over_the_kick_words_is_refused() {
        // A ring laid over a kick word would have this side's wake-ups bump a ring index.
        for off in [KICK_OFF[0], KICK_OFF[1]] {
            let seg = crafted(64 << 10, &[(4096, 8)], [4096, off]);
            let why = refused(&opened(&seg), Side::Opener);
            assert!(
                why.contains("ring 1") && why.contains("kick words"),
                "{why}"
            );
        }
    }

    #[test]
    fn a_link_tells_each_side_which_kick_word_to_bump_and_which_to_wait_on() {
        let seg = create_link_segment(8, HugePages::Never).unwrap();
        let creator = attach(&seg, Side::Creator).unwrap();
        let opener = attach(&opened(&seg), Side::Opener).unwrap();
        let own = create_link_segment(8, HugePages::Never).unwrap();
        let looped = attach(&own, Side::Loopback).unwrap();
        assert_eq!(creator.kick, [KICK_OFF[0], KICK_OFF[1]]);
        assert_eq!(opener.kick, [KICK_OFF[1], KICK_OFF[0]]);
        assert_eq!(looped.kick, [KICK_OFF[0], KICK_OFF[0]]);
    }

    #[test]
    fn a_ring_too_small_for_the_longest_packet_is_refused() {
        // A valid line ring of 4 lines: a gather packet of 16 ranges takes 7.
        let seg = crafted(64 << 10, &[(4096, 8), (16384, 4)], [4096, 16384]);
        for side in [Side::Opener, Side::Creator] {
            let why = refused(&opened(&seg), side);
            assert!(
                why.contains("ring 1") && why.contains("4 lines") && why.contains("at least 8"),
                "{why}"
            );
        }
        assert!(create_link_segment(4, HugePages::Never).is_err());
    }

    #[test]
    fn rings_past_the_end_or_with_huge_line_counts_are_refused() {
        let len = 64 << 10;
        // Offsets past the end, at the end, and so large that adding to them overflows.
        for off in [len as u64 + 4096, len as u64, u64::MAX - 63, 1 << 63] {
            let seg = crafted(len, &[(4096, 8)], [4096, off]);
            let why = refused(&opened(&seg), Side::Opener);
            assert!(why.contains("ring 1"), "{off:#x}: {why}");
        }
        // A line count that does not fit, is not a power of two, or is absurd.
        for lines in [1u64 << 20, 1 << 40, 3, 0, u64::MAX] {
            let seg = crafted(len, &[(4096, 8), (16384, 8)], [4096, 16384]);
            // The capacity field follows magic (8 bytes), version and line size (4 each).
            seg.write_at(16384 + 16, &lines.to_le_bytes()).unwrap();
            let why = refused(&opened(&seg), Side::Opener);
            assert!(why.contains("ring 1"), "{lines}: {why}");
        }
        // A ring that ends one line past the end of the segment.
        let seg = crafted(len, &[(4096, 8), (16384, 8)], [4096, 16384]);
        let fits = (len - 16384 - RING_HEADER) / size_of::<PacketSlot>();
        let over = fits.next_power_of_two() as u64;
        assert!(16384 + RING_HEADER + over as usize * size_of::<PacketSlot>() > len);
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

    /// Both ends of a fresh link, the creator's and the opener's.
    fn pair(lines: usize) -> (LinkEnds, LinkEnds) {
        let seg = create_link_segment(lines, HugePages::Never).unwrap();
        let peer_view = opened(&seg);
        let a = attach(&seg, Side::Creator).unwrap();
        let b = attach(&peer_view, Side::Opener).unwrap();
        (a, b)
    }

    #[test]
    fn a_link_segment_carries_packets_both_ways_one_line_each() {
        let (a, b) = pair(8);
        let mut atx = TxBatch::new(a.tx);
        let mut brx = b.rx;
        let mut out = [Line::ZERO; MAX_FRAME_LINES];
        for i in 0..20u32 {
            let s = atx.next_slot().expect("room");
            s.payload_len = i;
            s.data[39] = i as u8;
            atx.commit();
            assert_eq!(atx.flush(), 1);
            assert_eq!(brx.recv(&mut out).unwrap(), Some(1), "one line a packet");
            let got: &PacketSlot = bytemuck::cast_ref(&out[0]);
            assert_eq!((got.payload_len, got.data[39]), (i, i as u8));
        }
        // Fill the ring: room runs out at capacity, without losing anything.
        let mut n = 0;
        while atx.next_slot().is_some() {
            atx.commit();
            n += 1;
            assert!(n <= 8 + TX_BURST, "room must run out");
        }
        assert_eq!(atx.flush(), 8);
        assert_eq!(n, 8);
        let mut got = 0;
        while brx.recv(&mut out).unwrap().is_some() {
            got += 1;
        }
        assert_eq!(got, 8);
        let mut btx = TxBatch::new(b.tx);
        let mut arx = a.rx;
        btx.next_slot().unwrap().payload_len = 99;
        btx.commit();
        btx.flush();
        assert_eq!(arx.recv(&mut out).unwrap(), Some(1));
        assert_eq!(
            bytemuck::cast_ref::<Line, PacketSlot>(&out[0]).payload_len,
            99
        );
    }

    /// A one-line packet sent with `send_line(true)` on an empty batch is in the ring at
    /// once, stamped (the peer reads it before any flush), nothing is queued, and the
    /// publication learns, once, that it went; behind a queued packet, or with `direct`
    /// false, it is queued, and goes in order. Lines sent directly count against the
    /// ring's room as queued ones do.
    #[test]
    fn a_line_sent_directly_is_in_the_ring_at_once_and_never_passes_a_queued_one() {
        let (a, b) = pair(8);
        let mut tx = TxBatch::new(a.tx);
        let mut rx = b.rx;
        let mut out = [Line::ZERO; MAX_FRAME_LINES];
        let len = |l: &Line| bytemuck::cast_ref::<Line, PacketSlot>(l).payload_len;
        tx.next_slot().expect("room").payload_len = 1;
        tx.send_line(true);
        assert!(tx.is_empty());
        assert!(tx.take_sent_direct());
        assert!(!tx.take_sent_direct(), "told once");
        assert_eq!(
            rx.recv(&mut out).unwrap(),
            Some(1),
            "in the ring before a flush"
        );
        assert_eq!(len(&out[0]), 1);
        // Not direct: queued, as `commit` queues it.
        tx.next_slot().unwrap().payload_len = 2;
        tx.send_line(false);
        assert_eq!(tx.len(), 1);
        // Direct, behind a queued packet: queued behind it.
        tx.next_slot().unwrap().payload_len = 3;
        tx.send_line(true);
        assert_eq!(tx.len(), 2);
        assert!(!tx.take_sent_direct());
        assert_eq!(
            rx.recv(&mut out).unwrap(),
            None,
            "nothing passed the queued one"
        );
        assert_eq!(tx.flush(), 2);
        for want in [2, 3] {
            assert_eq!(rx.recv(&mut out).unwrap(), Some(1));
            assert_eq!(len(&out[0]), want);
        }
        assert_eq!(
            rx.recv(&mut out).unwrap(),
            None,
            "publishes the consumer's index"
        );
        // As many direct lines as the ring has, then no room (the caller goes the long
        // way), across the ring's end (a one-line frame needs no padding).
        let mut n = 0;
        while let Some(s) = tx.next_slot() {
            s.payload_len = 10 + n;
            tx.send_line(true);
            n += 1;
            assert!(n <= 8, "room must run out");
        }
        assert_eq!(n, 8);
        assert!(tx.is_empty());
        for want in 10..18 {
            assert_eq!(rx.recv(&mut out).unwrap(), Some(1));
            assert_eq!(len(&out[0]), want);
        }
        assert_eq!(rx.recv(&mut out).unwrap(), None);
        assert!(tx.next_slot().is_some(), "room again once the peer read");
    }

    /// A gather packet goes as one frame of its slot and continuation lines; when the
    /// burst reaches the ring's end and the padding leaves no room for the next frame, it
    /// stays queued and goes, in order, once the peer has made room.
    #[test]
    fn a_packet_that_finds_no_room_past_the_padding_waits_in_order() {
        let (a, b) = pair(8);
        let mut tx = TxBatch::new(a.tx);
        let mut rx = b.rx;
        let mut out = [Line::ZERO; MAX_FRAME_LINES];
        // Six one-line packets, received: the ring's next frame starts at line 6.
        for i in 0..6 {
            tx.next_slot().unwrap().payload_len = i;
            tx.commit();
        }
        assert_eq!(tx.flush(), 6);
        for _ in 0..6 {
            assert_eq!(rx.recv(&mut out).unwrap(), Some(1));
        }
        rx.flush();
        // A gather packet of 4 ranges (3 lines: does not fit in lines 6..8), then a
        // one-line packet.
        let (slot, cont) = tx.next_packet(2).expect("room for 3 lines");
        slot.kind = KIND_GATHER;
        slot.sge_count = 4;
        slot.payload_len = 1000;
        for i in 0..4 {
            assert!(set_gather_entry(cont, i, 64 * i as u64, 250));
        }
        tx.commit();
        tx.next_slot().unwrap().payload_len = 77;
        tx.commit();
        assert_eq!(tx.len(), 4);
        // Padding takes lines 6..8; the gather frame fits at 0..3, the last packet at 3.
        assert_eq!(tx.flush(), 4);
        assert_eq!(rx.recv(&mut out).unwrap(), Some(3));
        let lines: &[PacketSlot] = bytemuck::cast_slice(&out[..3]);
        assert_eq!(lines[0].sge_count, 4);
        assert_eq!(
            crate::wire::slot::gather_entry(&lines[1..3], 3),
            Some((192, 250))
        );
        assert_eq!(rx.recv(&mut out).unwrap(), Some(1));
        assert_eq!(
            bytemuck::cast_ref::<Line, PacketSlot>(&out[0]).payload_len,
            77
        );
        rx.flush();

        // Five more (lines 4..8, 0), received: the next frame starts at line 1 (index 17).
        for i in 0..5 {
            tx.next_slot().unwrap().payload_len = i;
            tx.commit();
        }
        assert_eq!(tx.flush(), 5);
        while rx.recv(&mut out).unwrap().is_some() {}
        // Five one-line packets (lines 1..6) and a 3-line gather packet: 8 lines staged,
        // as many as are free. The gather frame does not fit in lines 6..8, the padding
        // takes them, and then there is no room for it until the peer reads.
        for i in 0..5 {
            tx.next_slot().unwrap().payload_len = 10 + i;
            tx.commit();
        }
        let (slot, _) = tx.next_packet(2).expect("8 lines are free");
        slot.kind = KIND_GATHER;
        slot.sge_count = 4;
        slot.payload_len = 55;
        tx.commit();
        assert_eq!(tx.len(), 8);
        assert_eq!(tx.flush(), 5, "the five one-line packets went");
        assert_eq!(tx.len(), 3, "the gather packet waits, whole");
        assert_eq!(tx.flush(), 0, "still no room");
        assert!(
            tx.next_slot().is_none(),
            "nothing more until the peer reads"
        );
        for i in 0..5 {
            assert_eq!(rx.recv(&mut out).unwrap(), Some(1));
            assert_eq!(
                bytemuck::cast_ref::<Line, PacketSlot>(&out[0]).payload_len,
                10 + i
            );
        }
        assert_eq!(
            rx.recv(&mut out).unwrap(),
            None,
            "publishes the consumer's index"
        );
        assert_eq!(tx.flush(), 3);
        assert!(tx.is_empty());
        assert_eq!(rx.recv(&mut out).unwrap(), Some(3));
        assert_eq!(
            bytemuck::cast_ref::<Line, PacketSlot>(&out[0]).payload_len,
            55
        );
    }
}
