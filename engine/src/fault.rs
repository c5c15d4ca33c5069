//! Fault injection: a link that loses, duplicates, reorders, delays and corrupts packets.
//!
//! Shared memory never loses a packet, so without help the RC recovery paths (go-back-N,
//! duplicate detection, implied Naks, the transport timer, retry exhaustion) would never run.
//! A context built with [`ContextBuilder::faults`](crate::ContextBuilder::faults) or
//! [`ContextBuilder::fault_rule`](crate::ContextBuilder::fault_rule) passes every packet it
//! *sends* through this module before the packet reaches the link: faults are per
//! direction (configure each end), seeded and reproducible (a SplitMix64 generator of our
//! own), and counted ([`FaultStats`], from
//! [`Context::fault_stats`](crate::Context::fault_stats)).
//!
//! | fault | what happens to the packet |
//! |---|---|
//! | drop | never sent |
//! | duplicate | sent twice, back to back |
//! | reorder | swapped with the next packet to the same link (or, if the QP's burst has no next packet, held until the link's next burst and sent behind it) |
//! | delay | held for 1 to [`MAX_DELAY_ITERATIONS`] engine iterations |
//! | corrupt | one bit of its headers or inline payload flipped (never the BTH's variant resv8a byte) |
//!
//! # Example
//!
//! The first Send packet A sends is lost; the transport timer (Local Ack Timeout 8:
//! about 1 ms) expires and A sends it again, so B still gets the message, once:
//!
//! ```
//! use shmhca::fault::FaultAction;
//! use shmhca::wire::opcode::Opcode;
//! use shmhca::*;
//!
//! let mut lost = false;
//! let a = Context::builder()
//!     .mode(EngineMode::Inline)
//!     .arena_size(1 << 20)
//!     // A rule aims at one packet; FaultConfig's rates draw faults at random instead.
//!     .fault_rule(move |e| match e.headers.bth.opcode {
//!         Opcode::SendOnly if !lost => {
//!             lost = true;
//!             FaultAction::Drop
//!         }
//!         _ => FaultAction::Pass,
//!     })
//!     .build()?;
//! let b = Context::builder().mode(EngineMode::Inline).arena_size(1 << 20).build()?;
//! let (link_a, link_b) = a.link_with(&b)?;
//! let (pd_a, pd_b) = (a.alloc_pd()?, b.alloc_pd()?);
//! let (mut cq_a, mut cq_b) = (a.create_cq(16)?, b.create_cq(16)?);
//! let mut qa = a.create_qp(&pd_a, &cq_a, &cq_a, QpCaps::default())?;
//! let mut qb = b.create_qp(&pd_b, &cq_b, &cq_b, QpCaps::default())?;
//! let (na, nb) = (qa.qpn(), qb.qpn());
//! for (qp, link, qpn) in [(&mut qa, link_a, nb), (&mut qb, link_b, na)] {
//!     qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::NONE))?;
//!     qp.modify(&QpAttr::new(QpState::Rtr).path_mtu(Mtu::Mtu4096)
//!         .dest(Destination { link, qpn }).rq_psn(0).max_dest_rd_atomic(1).min_rnr_timer(1))?;
//!     qp.modify(&QpAttr::new(QpState::Rts).sq_psn(0).timeout(8)
//!         .retry_cnt(7).rnr_retry(7).max_rd_atomic(1))?;
//! }
//! let src = pd_a.alloc_mr(64, AccessFlags::NONE)?;
//! let dst = pd_b.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
//! src.write_at(0, b"resent")?;
//! qb.post_recv(&RecvWr::new(1, &[dst.sge(0, 64)?]))?;
//! qa.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 6)?]))?;
//! let mut wc = [WorkCompletion::default(); 1];
//! let mut sent = false;
//! for _ in 0..10_000_000 {
//!     sent = sent || cq_a.poll(&mut wc) == 1; // drives A, whose timer resends
//!     if sent && cq_b.poll(&mut wc) == 1 {
//!         break;
//!     }
//! }
//! assert_eq!((wc[0].wr_id, wc[0].status, wc[0].byte_len), (1, WcStatus::Success, 6));
//! assert_eq!(a.fault_stats().dropped, 1);
//! assert!(a.stats().timeouts >= 1 && a.stats().retransmitted >= 1);
//! assert_eq!(cq_b.poll(&mut wc), 0); // delivered once
//! # Ok::<(), shmhca::Error>(())
//! ```
//!
//! # Riding Acks
//!
//! A positive Ack that rides in the line of a request (see [`crate::wire::slot`]) is a
//! packet of its own to the fault stage, as it is in the capture: a rule sees it as an
//! Acknowledge, and rates and rules decide its fate apart from its carrier's. Passed, it
//! rides on, and is lost, sent twice, delayed or corrupted with its carrier; any other
//! action takes it out of the carrier and it follows as a standalone Ack that suffers that
//! fault.
//!
//! # The ICRC
//!
//! A sender whose faults may corrupt (a corruption rate above 0, or a rule) stamps every
//! packet with its RoCEv2 ICRC — the CRC [`trace::roce::icrc`](crate::trace::roce::icrc)
//! computes, over fixed pseudo IPv4/UDP headers — and sets [`ICRC_FLAG`] in the slot. The
//! receiver checks the ICRC of every flagged packet before anything else and silently drops
//! a packet that fails (counted as [`FaultStats::icrc_dropped`]), as a real HCA does.
//! Unflagged packets are not checked, so a fault-free sender costs the receiver one test of
//! a byte it has in cache already. The flag and the ICRC are the peer's data like anything
//! else in a slot: a peer that sets the flag gets its packets checked, and every offset the
//! check reads is bounds-checked.
//!
//! The ICRC of a carrier covers its riding Ack's word too.
//!
//! Where the ICRC travels depends on the slot's kind (each spot is otherwise unused): in
//! slot bytes 12..16 (`sge_count` and `zero`) for a packet whose payload is inline or
//! absent, in the 4 data bytes after
//! the headers for a payload sent by reference, and in the 4 bytes after the gather skip for
//! a gather packet.
//!
//! A capture ([`ContextBuilder::pcap`](crate::ContextBuilder::pcap)) records packets as
//! they leave the fault stage: a dropped packet is absent, a duplicated one appears twice,
//! a delayed or reordered one where it was finally sent, and a corrupted one with its
//! flipped bit and with the ICRC the sender stamped before the flip — so Wireshark flags
//! its ICRC as wrong.

use crate::error::{Error, Result};
use crate::link::{LinkId, TxBatch};
use crate::mem::Mem;
use crate::trace::{Direction, PacketEvent};
use crate::wire::bth;
use crate::wire::slot::{
    ACK_FLAG, KIND_DIRECT, KIND_GATHER, KIND_INLINE, KIND_NONE, MAX_CONTINUATION, PacketSlot,
    SLOT_DATA, clear_riding_ack, continuation_slots, gather_entry, riding_ack, riding_ack_of,
};

/// What injected faults do to the packets one context sends. Rates are per packet, each in
/// `0.0..=1.0`, and their sum at most 1. `Default` injects nothing.
///
/// ```
/// use shmhca::fault::{FaultAction, FaultConfig};
/// use shmhca::wire::opcode::Opcode;
///
/// let faults = FaultConfig { drop: 0.01, duplicate: 0.001, reorder: 0.001, seed: 7, ..Default::default() };
/// let ctx = shmhca::Context::builder()
///     .faults(faults)
///     // A rule decides first, for tests that aim at one packet: here every Ack is lost.
///     .fault_rule(|e| if e.headers.bth.opcode == Opcode::Acknowledge { FaultAction::Drop } else { FaultAction::Pass })
///     .build()?;
/// assert_eq!(ctx.fault_stats().dropped, 0);
/// # Ok::<(), shmhca::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FaultConfig {
    /// Probability that a packet is dropped.
    pub drop: f64,
    /// Probability that a packet is sent twice.
    pub duplicate: f64,
    /// Probability that a packet is swapped with the next one to the same link.
    pub reorder: f64,
    /// Probability that a packet is held for a few engine iterations.
    pub delay: f64,
    /// Probability that one bit of a packet is flipped (the receiver's ICRC check drops it).
    pub corrupt: f64,
    /// Seed of the generator that draws the faults: the same seed and the same packets give
    /// the same faults.
    pub seed: u64,
}

impl FaultConfig {
    /// Whether it injects nothing.
    pub fn is_none(&self) -> bool {
        self.rates().iter().all(|&(_, r)| r == 0.0)
    }

    fn rates(&self) -> [(&'static str, f64); 5] {
        [
            ("drop", self.drop),
            ("duplicate", self.duplicate),
            ("reorder", self.reorder),
            ("delay", self.delay),
            ("corrupt", self.corrupt),
        ]
    }

    /// Checks the rates.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming a rate that is not a number in `0.0..=1.0`, or
    /// saying that the rates add up to more than 1.
    pub fn validate(&self) -> Result<()> {
        for (name, r) in self.rates() {
            if !(0.0..=1.0).contains(&r) {
                return Err(Error::invalid(
                    "faults",
                    format!(
                        "the {name} rate is {r}; a rate is a probability per packet, \
                         from 0.0 to 1.0 (0.01 drops one packet in a hundred)"
                    ),
                ));
            }
        }
        let sum: f64 = self.rates().iter().map(|&(_, r)| r).sum();
        if sum > 1.0 + 1e-9 {
            return Err(Error::invalid(
                "faults",
                format!(
                    "the rates add up to {sum}; each packet suffers at most one fault, so \
                     drop + duplicate + reorder + delay + corrupt must be at most 1.0"
                ),
            ));
        }
        Ok(())
    }
}

/// What the fault stage does with one sent packet (the answer of a fault rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// Send it unchanged (a rule's `Pass` leaves the packet to the configured rates).
    Pass,
    /// Do not send it.
    Drop,
    /// Send it twice.
    Duplicate,
    /// Swap it with the next packet to the same link.
    Reorder,
    /// Hold it for a few engine iterations.
    Delay,
    /// Flip one bit of it.
    Corrupt,
}

/// What the fault stage of one context did, and what its receive side dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Packets that went through the fault stage (sent packets, before faults; a riding
    /// Ack counts as a packet of its own).
    pub packets: u64,
    /// Packets dropped.
    pub dropped: u64,
    /// Packets sent twice.
    pub duplicated: u64,
    /// Packets swapped with a later one.
    pub reordered: u64,
    /// Packets held for a while.
    pub delayed: u64,
    /// Packets sent with a bit flipped.
    pub corrupted: u64,
    /// Received packets dropped because their ICRC did not check.
    pub icrc_dropped: u64,
}

/// A fault rule: decides per sent packet (see
/// [`ContextBuilder::fault_rule`](crate::ContextBuilder::fault_rule)).
pub(crate) type FaultRule = Box<dyn FnMut(&PacketEvent<'_>) -> FaultAction + Send>;

/// Bit of [`PacketSlot::reserved`] saying the packet carries an ICRC.
pub use crate::wire::slot::ICRC_FLAG;

/// The most engine iterations a delayed packet is held.
pub const MAX_DELAY_ITERATIONS: u64 = 16;

/// Iterations after which a held packet for a link that is gone is forgotten.
const FORGET_AFTER: u64 = 1 << 16;

/// The largest payload one packet carries (the largest PMTU); a flagged packet claiming
/// more fails its ICRC check.
const MAX_PACKET_PAYLOAD: usize = 4096;

/// SplitMix64: small, fast, and good enough to draw faults.
#[derive(Debug, Clone)]
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A packet held back (delayed, or reordered past the end of its burst).
struct Held {
    link: LinkId,
    release_at: u64,
    len: usize,
    slots: [PacketSlot; 1 + MAX_CONTINUATION],
    /// Where its payload sent by reference lives (for the capture).
    mem: Mem,
}

/// The fault stage of one engine.
pub(crate) struct Faults {
    cfg: FaultConfig,
    rule: Option<FaultRule>,
    rng: SplitMix,
    /// Whether sent packets carry an ICRC (corruption is possible).
    icrc: bool,
    pub(crate) stats: FaultStats,
    iteration: u64,
    held: Vec<Held>,
    scratch: Vec<PacketSlot>,
}

impl Faults {
    /// A fault stage; `cfg` must have been validated.
    pub(crate) fn new(cfg: FaultConfig, rule: Option<FaultRule>) -> Faults {
        Faults {
            icrc: cfg.corrupt > 0.0 || rule.is_some(),
            rng: SplitMix(cfg.seed),
            cfg,
            rule,
            stats: FaultStats::default(),
            iteration: 0,
            held: Vec::new(),
            scratch: Vec::new(),
        }
    }

    fn decide(&mut self, link: LinkId, slot: &PacketSlot) -> FaultAction {
        if let Some(rule) = self.rule.as_mut() {
            if let Ok((headers, _)) = crate::wire::PacketRepr::parse(slot.headers()) {
                let a = rule(&PacketEvent {
                    direction: Direction::Sent,
                    link,
                    headers: &headers,
                    payload_len: slot.payload_len,
                });
                if a != FaultAction::Pass {
                    return a;
                }
            }
        }
        if self.cfg.is_none() {
            return FaultAction::Pass;
        }
        let mut r = self.rng.next_f64();
        let c = &self.cfg;
        for (rate, action) in [
            (c.drop, FaultAction::Drop),
            (c.duplicate, FaultAction::Duplicate),
            (c.reorder, FaultAction::Reorder),
            (c.delay, FaultAction::Delay),
            (c.corrupt, FaultAction::Corrupt),
        ] {
            if r < rate {
                return action;
            }
            r -= rate;
        }
        FaultAction::Pass
    }

    /// Passes the packets queued on `tx` from position `from` on (just sent by one QP, whose
    /// arena is `mem`) through the fault stage.
    pub(crate) fn on_sent(&mut self, link: LinkId, tx: &mut TxBatch, from: usize, mem: &Mem) {
        let queued = tx.queued();
        if queued.len() <= from {
            return;
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        scratch.extend_from_slice(&queued[from..]);
        tx.truncate(from);
        let mut swap: Option<(usize, usize)> = None;
        // The action already decided for the packet at `i` (a riding Ack taken out of its
        // carrier).
        let mut decided: Option<FaultAction> = None;
        let mut i = 0;
        while i < scratch.len() {
            let end = (i + 1 + continuation_slots(&scratch[i])).min(scratch.len());
            let action = match decided.take() {
                Some(a) => a,
                None => {
                    self.stats.packets += 1;
                    self.decide(link, &scratch[i])
                }
            };
            // A riding Ack is a packet of its own here, as in the capture: rules and rates
            // decide its fate apart from its carrier's. Passed, it rides on (and is lost,
            // sent twice or corrupted with its carrier); otherwise it leaves its carrier and
            // follows it as a standalone Ack, which then suffers its own fault.
            if let Some(ack) = riding_ack(&scratch[i]) {
                self.stats.packets += 1;
                let a = self.decide(link, &ack);
                if a != FaultAction::Pass {
                    clear_riding_ack(&mut scratch[i]);
                    scratch.insert(end, ack);
                    decided = Some(a);
                }
            }
            if self.icrc {
                stamp_icrc(&mut scratch[i..end], mem);
            }
            let waiting = swap.take();
            match action {
                FaultAction::Pass => self.push(link, tx, &scratch[i..end], mem),
                FaultAction::Drop => self.stats.dropped += 1,
                FaultAction::Duplicate => {
                    self.stats.duplicated += 1;
                    self.push(link, tx, &scratch[i..end], mem);
                    self.push(link, tx, &scratch[i..end], mem);
                }
                FaultAction::Corrupt => {
                    self.stats.corrupted += 1;
                    let pick = self.rng.next_u64();
                    flip_bit(&mut scratch[i], pick);
                    self.push(link, tx, &scratch[i..end], mem);
                }
                FaultAction::Delay => {
                    self.stats.delayed += 1;
                    let wait = 1 + self.rng.next_u64() % MAX_DELAY_ITERATIONS;
                    self.hold(link, self.iteration + wait, &scratch[i..end], mem);
                }
                FaultAction::Reorder => {
                    self.stats.reordered += 1;
                    if end < scratch.len() && waiting.is_none() {
                        swap = Some((i, end));
                    } else {
                        self.hold(link, self.iteration + 1, &scratch[i..end], mem);
                    }
                }
            }
            if let Some((a, b)) = waiting {
                self.push(link, tx, &scratch[a..b], mem);
            }
            i = end;
        }
        if let Some((a, b)) = swap {
            self.push(link, tx, &scratch[a..b], mem);
        }
        self.scratch = scratch;
    }

    /// Queues a packet, or holds it until the link has room (a duplicate may have taken it).
    fn push(&mut self, link: LinkId, tx: &mut TxBatch, slots: &[PacketSlot], mem: &Mem) {
        if !tx.push_packet(slots) {
            self.hold(link, self.iteration, slots, mem);
        }
    }

    fn hold(&mut self, link: LinkId, release_at: u64, slots: &[PacketSlot], mem: &Mem) {
        let mut h = Held {
            link,
            release_at,
            len: slots.len().min(1 + MAX_CONTINUATION),
            slots: [PacketSlot::default(); 1 + MAX_CONTINUATION],
            mem: mem.share(),
        };
        h.slots[..h.len].copy_from_slice(&slots[..h.len]);
        self.held.push(h);
    }

    /// Starts an engine iteration.
    pub(crate) fn tick(&mut self) {
        self.iteration += 1;
    }

    /// Whether packets are held.
    pub(crate) fn holding(&self) -> bool {
        !self.held.is_empty()
    }

    /// Queues on `tx` the held packets of `link` that are due (as room allows); calls
    /// `sent` on each, with the arena its payload lives in.
    pub(crate) fn release(
        &mut self,
        link: LinkId,
        tx: &mut TxBatch,
        mut sent: impl FnMut(&[PacketSlot], &Mem),
    ) {
        let now = self.iteration;
        let mut k = 0;
        while k < self.held.len() {
            let h = &self.held[k];
            if h.link == link && h.release_at <= now {
                if !tx.push_packet(&h.slots[..h.len]) {
                    break;
                }
                let h = self.held.remove(k);
                sent(&h.slots[..h.len], &h.mem);
            } else {
                k += 1;
            }
        }
    }

    /// Forgets held packets no link took for a long time (their link is gone).
    pub(crate) fn forget_stale(&mut self) {
        let now = self.iteration;
        self.held
            .retain(|h| h.release_at.saturating_add(FORGET_AFTER) > now);
    }
}

/// Flips one bit, chosen by `pick`, of the headers or inline payload of `slot`, never in
/// the BTH's resv8a byte (which the ICRC does not cover).
fn flip_bit(slot: &mut PacketSlot, pick: u64) {
    let hdr = (slot.hdr_len as usize).min(SLOT_DATA);
    let inline = if slot.kind == KIND_INLINE {
        slot.payload_len as usize
    } else {
        0
    };
    let n = (hdr + inline).min(SLOT_DATA);
    if n < 2 {
        return;
    }
    let mut byte = (pick as usize >> 3) % (n - 1);
    if byte >= bth::RESV8A_OFFSET {
        byte += 1;
    }
    slot.data[byte] ^= 1 << (pick & 7);
}

/// Where the ICRC of a slot travels (see the module docs), as a byte range of the slot's
/// data area, or `None` for slot bytes 12..16, `sge_count` and `zero` (inline or no
/// payload: `payload_off` may hold a riding Ack). `Err` if the slot has no room for it.
fn icrc_spot(slot: &PacketSlot) -> std::result::Result<Option<usize>, ()> {
    let hdr = slot.hdr_len as usize;
    let at = match slot.kind {
        KIND_NONE | KIND_INLINE => return Ok(None),
        KIND_DIRECT => hdr,
        KIND_GATHER => hdr + 4,
        _ => return Err(()),
    };
    if at + 4 <= SLOT_DATA {
        Ok(Some(at))
    } else {
        Err(())
    }
}

/// Computes the ICRC of a packet (its slot and continuation slots), reading a payload sent
/// by reference from `mem`; `None` if the packet is malformed or its payload unreadable.
pub(crate) fn packet_icrc(slots: &[PacketSlot], mem: &Mem) -> Option<u32> {
    let (slot, cont) = slots.split_first()?;
    let hdr_len = slot.hdr_len as usize;
    if !(bth::HEADER_LEN..=SLOT_DATA).contains(&hdr_len) {
        return None;
    }
    let headers = &slot.data[..hdr_len];
    let len = slot.payload_len as usize;
    if len > MAX_PACKET_PAYLOAD {
        return None;
    }
    let mut buf = [0u8; MAX_PACKET_PAYLOAD + 4];
    match slot.kind {
        KIND_NONE => {
            if len != 0 {
                return None;
            }
        }
        KIND_INLINE => {
            let src = slot.data.get(hdr_len..hdr_len + len)?;
            buf[..len].copy_from_slice(src);
        }
        KIND_DIRECT => mem.read(slot.payload_off, &mut buf[..len]).ok()?,
        KIND_GATHER => {
            let skip = slot.data.get(hdr_len..hdr_len + 4)?;
            let mut skip = u64::from(u32::from_le_bytes(skip.try_into().ok()?));
            let mut got = 0;
            for i in 0..usize::from(slot.sge_count) {
                if got >= len {
                    break;
                }
                let (off, elen) = gather_entry(cont, i)?;
                let take = (u64::from(elen).saturating_sub(skip) as usize).min(len - got);
                mem.read(off.checked_add(skip)?, &mut buf[got..got + take])
                    .ok()?;
                got += take;
                skip = skip.saturating_sub(u64::from(elen));
            }
            if got != len {
                return None;
            }
        }
        _ => return None,
    }
    // The pad bytes the BTH announces follow the payload (zeroes, as the capture has them).
    let pad = usize::from((headers[1] >> 4) & 3);
    let transport_len = hdr_len + len + pad;
    let dest_qp = u32::from_be_bytes([0, headers[5], headers[6], headers[7]]);
    let framing = crate::trace::roce::frame_headers(
        crate::trace::roce::Endpoint::engine(1),
        crate::trace::roce::Endpoint::engine(2),
        0,
        dest_qp,
        transport_len,
    )
    .ok()?;
    let ip = framing[14..34].try_into().ok()?;
    let udp = framing[34..42].try_into().ok()?;
    // A riding Ack is part of the line: a bit flipped in its word fails the check too. (The
    // ICRC is then not the carrier's RoCEv2 ICRC; the capture only uses the difference
    // between the carried and the recomputed one.)
    let riding = riding_ack_of(slot).word.to_be_bytes();
    let riding: &[u8] =
        if slot.reserved & ACK_FLAG != 0 && matches!(slot.kind, KIND_NONE | KIND_INLINE) {
            &riding
        } else {
            &[]
        };
    Some(crate::trace::roce::icrc(
        ip,
        udp,
        &[headers, &buf[..len + pad], riding],
    ))
}

/// Stamps a packet with its ICRC and [`ICRC_FLAG`] (a packet with no room for it goes
/// unstamped, and unchecked).
fn stamp_icrc(slots: &mut [PacketSlot], mem: &Mem) {
    let Some(crc) = packet_icrc(slots, mem) else {
        return;
    };
    let slot = &mut slots[0];
    match icrc_spot(slot) {
        Ok(None) => {
            let b = crc.to_le_bytes();
            slot.sge_count = b[0];
            slot.zero = [b[1], b[2], b[3]];
        }
        Ok(Some(at)) => slot.data[at..at + 4].copy_from_slice(&crc.to_le_bytes()),
        Err(()) => return,
    }
    slot.reserved |= ICRC_FLAG;
}

/// The ICRC a flagged packet carries.
fn carried_icrc(slot: &PacketSlot) -> Option<u32> {
    match icrc_spot(slot).ok()? {
        None => Some(u32::from_le_bytes([
            slot.sge_count,
            slot.zero[0],
            slot.zero[1],
            slot.zero[2],
        ])),
        Some(at) => Some(u32::from_le_bytes(slot.data[at..at + 4].try_into().ok()?)),
    }
}

/// The receiver's check of a packet that carries [`ICRC_FLAG`]: whether its ICRC matches
/// its headers and payload (read from the sender's arena `mem`).
pub(crate) fn icrc_ok(slots: &[PacketSlot], mem: &Mem) -> bool {
    let Some(slot) = slots.first() else {
        return false;
    };
    match (carried_icrc(slot), packet_icrc(slots, mem)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// For the capture: the XOR between the ICRC a flagged packet carries and the one its
/// bytes have now (0 for an intact packet). XORed into the capture's own ICRC it gives the
/// ICRC the sender stamped (for a carrier of a riding Ack, a value other than the right
/// one), so a corrupted packet shows a bad ICRC.
pub(crate) fn icrc_error(slots: &[PacketSlot], mem: &Mem) -> u32 {
    let Some(slot) = slots.first().filter(|s| s.reserved & ICRC_FLAG != 0) else {
        return 0;
    };
    match (carried_icrc(slot), packet_icrc(slots, mem)) {
        (Some(a), Some(b)) => a ^ b,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_validated_with_a_clear_error() {
        assert!(FaultConfig::default().validate().is_ok());
        assert!(FaultConfig::default().is_none());
        for bad in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            let cfg = FaultConfig {
                reorder: bad,
                ..Default::default()
            };
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains("reorder rate"), "{e}");
        }
        let cfg = FaultConfig {
            drop: 0.6,
            corrupt: 0.6,
            ..Default::default()
        };
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("add up to"), "{e}");
    }

    #[test]
    fn the_generator_is_reproducible_and_roughly_uniform() {
        let mut a = SplitMix(7);
        let mut b = SplitMix(7);
        let mut below = 0;
        for _ in 0..10_000 {
            let x = a.next_f64();
            assert_eq!(x, b.next_f64());
            assert!((0.0..1.0).contains(&x));
            below += usize::from(x < 0.25);
        }
        assert!((2_200..2_800).contains(&below), "{below}");
        assert_ne!(SplitMix(8).next_u64(), SplitMix(7).next_u64());
    }

    fn send_only(payload: &[u8]) -> PacketSlot {
        use crate::psn::Psn;
        use crate::wire::{BthRepr, PacketRepr, Qpn, opcode::Opcode};
        let repr = PacketRepr::new(BthRepr::new(Opcode::SendOnly, Qpn::new(0x123), Psn::new(5)));
        let mut s = PacketSlot::default();
        let n = repr.emit(&mut s.data).unwrap();
        s.hdr_len = n as u8;
        s.kind = KIND_INLINE;
        s.payload_len = payload.len() as u32;
        s.data[n..n + payload.len()].copy_from_slice(payload);
        s
    }

    /// The stamped ICRC is the one the capture writer puts behind the same packet, in slot
    /// bytes 12..16 for an inline payload. With a riding Ack in `payload_off` the ICRC
    /// leaves the word alone and covers it too (so it is no longer the carrier's RoCEv2
    /// ICRC); intact, the packet checks and the capture sees no error.
    #[test]
    fn the_stamped_icrc_is_the_roce_icrc() {
        let roce = |s: &PacketSlot| {
            let f = crate::trace::roce::frame_headers(
                crate::trace::roce::Endpoint::engine(1),
                crate::trace::roce::Endpoint::engine(2),
                0,
                0x123,
                12 + 11,
            )
            .unwrap();
            crate::trace::roce::icrc(
                f[14..34].try_into().unwrap(),
                f[34..42].try_into().unwrap(),
                &[&s.data[..12 + 11]],
            )
        };
        let stamped = |s: &PacketSlot| {
            let spare: [u8; 4] = bytemuck::bytes_of(s)[12..16].try_into().unwrap();
            u32::from_le_bytes(spare)
        };
        let mem = Mem::private(0);
        let mut plain = [send_only(b"hello, icrc")];
        stamp_icrc(&mut plain, &mem);
        assert_eq!(plain[0].reserved & ICRC_FLAG, ICRC_FLAG);
        assert_eq!(stamped(&plain[0]), roce(&plain[0]));
        assert!(icrc_ok(&plain, &mem));
        assert_eq!(icrc_error(&plain, &mem), 0);

        let mut s = [send_only(b"hello, icrc")];
        let word = crate::wire::slot::riding_word(77, 0x1f, 5);
        assert!(crate::wire::slot::set_riding_ack(&mut s[0], word));
        stamp_icrc(&mut s, &mem);
        assert_eq!(s[0].payload_off, word);
        assert_eq!(s[0].reserved & ICRC_FLAG, ICRC_FLAG);
        assert_ne!(stamped(&s[0]), roce(&s[0]));
        assert!(icrc_ok(&s, &mem));
        assert_eq!(icrc_error(&s, &mem), 0);
        let mut bad = s;
        bad[0].data[20] ^= 4;
        assert_ne!(icrc_error(&bad, &mem), 0, "the capture flags it");
    }

    /// Every flipped bit (outside resv8a) fails the check; a direct payload is read from
    /// the sender's memory and a change there fails it too.
    #[test]
    fn every_corruption_fails_the_check() {
        let mem = Mem::private(0);
        let mut s = [send_only(b"abcdefgh")];
        stamp_icrc(&mut s, &mem);
        for pick in 0..(20 * 8) {
            let mut c = s;
            flip_bit(&mut c[0], pick);
            assert!(!icrc_ok(&c, &mem), "bit pick {pick}");
            assert_ne!(icrc_error(&c, &mem), 0);
        }
        let arena = Mem::private(4096);
        arena.write(100, &[7u8; 300]).unwrap();
        let mut d = [send_only(b"")];
        d[0].kind = KIND_DIRECT;
        d[0].payload_len = 300;
        d[0].payload_off = 100;
        stamp_icrc(&mut d, &arena);
        assert!(icrc_ok(&d, &arena));
        arena.write(250, &[8]).unwrap();
        assert!(!icrc_ok(&d, &arena));
        // A payload out of the arena, or above the largest PMTU, never checks.
        d[0].payload_off = 4000;
        assert!(!icrc_ok(&d, &arena));
        d[0].payload_len = 5000;
        assert!(!icrc_ok(&d, &arena));
        // A flag with a kind the link does not know.
        let mut k = s;
        k[0].kind = 9;
        assert!(!icrc_ok(&k, &arena));
    }
}
