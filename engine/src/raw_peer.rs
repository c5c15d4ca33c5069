//! Test rigs shared by the in-crate suites: a link whose far end the test drives packet by
//! packet (the hostile-input proptests, the credit-flow tests), and a pair of QPs joined
//! over a loopback link (the engine-token and in-flight-count tests).

use std::collections::VecDeque;

use crate::link::{self, Link, Side};
use crate::mem::Mem;
use crate::wire::Qpn;
use crate::wire::slot::{MAX_PACKET_LINES, PacketSlot, frame_lines};
use crate::{Context, LinkId};
use shmhca_rings::lines::{
    Line, LinesConsumer, LinesProducer, MAX_FRAME_LINES, ReserveError, ShmLines,
};
use shmhca_rings::ring::LinkBroken;
use shmhca_rings::segment::HugePages;

/// The test's sending end of a link: takes packets as the engine stages them (a slot, then
/// the continuation lines of its gather list) and publishes each as one frame, its lines as
/// they are.
pub(crate) struct SlotTx(pub(crate) LinesProducer<ShmLines>);

impl SlotTx {
    /// Publishes the packets in `slots`, one frame each — a slot and the continuation lines
    /// its gather count calls for, as far as `slots` has them (a cut list goes as a shorter
    /// frame, as a hostile peer may send it) — until the ring has no room; returns the
    /// slots published.
    pub(crate) fn push_burst(&mut self, slots: &[PacketSlot]) -> Result<usize, LinkBroken> {
        let mut at = 0;
        while at < slots.len() {
            let end = (at + frame_lines(&slots[at])).min(slots.len());
            if !self.push_frame(&slots[at..end])? {
                break;
            }
            at = end;
        }
        Ok(at)
    }

    /// Publishes `lines` as one frame, whatever they hold; false if the ring has no room
    /// now.
    ///
    /// # Panics
    /// If `lines` is empty or longer than a frame.
    pub(crate) fn push_frame(&mut self, lines: &[PacketSlot]) -> Result<bool, LinkBroken> {
        match self.0.reserve(lines.len()) {
            Ok(Some(mut f)) => {
                f.write_lines(bytemuck::cast_slice(lines)).unwrap();
                f.commit();
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(ReserveError::Broken(e)) => Err(e),
            Err(e) => panic!("{e}"),
        }
    }

    /// Slots that surely fit now, in any burst: each takes a line, and a burst that wraps
    /// around the ring's end loses at most the lines of a packet's frame to padding.
    pub(crate) fn free_slots(&mut self) -> Result<usize, LinkBroken> {
        Ok(self.0.free_lines()?.saturating_sub(MAX_PACKET_LINES - 1))
    }
}

/// The test's receiving end of a link: the lines of the engine's frames, handed out as a
/// stream of slots (a packet's slot, then its continuation lines).
pub(crate) struct SlotRx {
    rx: LinesConsumer<ShmLines>,
    pending: VecDeque<PacketSlot>,
}

impl SlotRx {
    /// Takes up to `out.len()` slots of the packets the engine sent (a packet's
    /// continuation lines may come in the next call); returns how many.
    ///
    /// # Panics
    /// If a frame's line count is not the one its packet calls for.
    pub(crate) fn pop_burst(&mut self, out: &mut [PacketSlot]) -> Result<usize, LinkBroken> {
        let mut lines = [Line::ZERO; MAX_FRAME_LINES];
        while self.pending.len() < out.len() {
            let Some(n) = self.rx.recv(&mut lines)? else {
                break;
            };
            let slots: &[PacketSlot] = bytemuck::cast_slice(&lines[..n]);
            assert_eq!(
                n,
                frame_lines(&slots[0]),
                "the engine sent a frame of {n} lines"
            );
            self.pending.extend(slots);
        }
        let n = out.len().min(self.pending.len());
        for (o, s) in out.iter_mut().zip(self.pending.drain(..n)) {
            *o = s;
        }
        Ok(n)
    }

    /// The next slot the engine sent, if any (see [`SlotRx::pop_burst`]).
    pub(crate) fn pop(&mut self) -> Result<Option<PacketSlot>, LinkBroken> {
        let mut one = [PacketSlot::default()];
        Ok((self.pop_burst(&mut one)? == 1).then_some(one[0]))
    }
}

/// The test's ends of a raw peer link.
pub(crate) struct RawEnds {
    /// Publishes to the engine.
    pub(crate) tx: SlotTx,
    /// Takes what the engine sent.
    pub(crate) rx: SlotRx,
    /// The link segment as the test maps it: all of it is the peer's to write (the kick
    /// words too).
    pub(crate) segment: Mem,
}

/// Adds to `ctx` a link of `slots` lines a direction whose far end is returned to the test,
/// as a peer would hold it (the test creates the segment, the engine opens it), with peer
/// QP `peer_qpn` sending from a private arena of `arena_len` bytes (also returned, to
/// write payloads into).
pub(crate) fn raw_peer_link(
    ctx: &Context,
    slots: usize,
    peer_qpn: u32,
    arena_len: usize,
) -> (LinkId, RawEnds, Mem) {
    let seg = link::create_link_segment(slots, HugePages::Never).unwrap();
    let theirs = link::open_link_segment(seg.try_clone_fd().unwrap()).unwrap();
    let ends = link::attach(&theirs, Side::Opener).unwrap();
    let mut l = Link::new(theirs, ends, Mem::private(4096), (1, 2));
    let peer_arena = Mem::private(arena_len);
    l.add_peer_qp(Qpn::new(peer_qpn), (1, 1), peer_arena.share());
    let id = ctx.shared.engine.with(|e| e.add_link(l)).unwrap();
    let mine = link::attach(&seg, Side::Creator).unwrap();
    let ends = RawEnds {
        segment: Mem::from_segment(seg),
        tx: SlotTx(mine.tx),
        rx: SlotRx {
            rx: mine.rx,
            pending: VecDeque::new(),
        },
    };
    (id, ends, peer_arena)
}

/// Two QPs of `ctx` joined over a loopback link, in RTS (PMTU 1024, one Read/Atomic each
/// way, access flags none).
pub(crate) fn loopback_pair(
    ctx: &Context,
    pd: &crate::Pd,
    cq: &crate::Cq,
) -> (crate::Qp, crate::Qp) {
    use crate::QpCaps;
    let (link, _) = ctx.link_with(ctx).unwrap();
    let mut a = ctx.create_qp(pd, cq, cq, QpCaps::default()).unwrap();
    let mut b = ctx.create_qp(pd, cq, cq, QpCaps::default()).unwrap();
    let (qa, qb) = (a.qpn(), b.qpn());
    connect_rts(&mut a, link, qb, 14);
    connect_rts(&mut b, link, qa, 14);
    (a, b)
}

/// Takes `qp` to RTS towards QP `remote` over `link`: PSNs 0, PMTU 1024, one Read/Atomic
/// each way, access flags none, transport timer `timeout` (the spec's exponent), seven
/// retries of each kind.
pub(crate) fn connect_rts(
    qp: &mut crate::Qp,
    link: crate::LinkId,
    remote: crate::wire::Qpn,
    timeout: u8,
) {
    use crate::{AccessFlags, Destination, Mtu, QpAttr, QpState};
    qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::NONE))
        .unwrap();
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(Mtu::Mtu1024)
            .dest(Destination { link, qpn: remote })
            .rq_psn(0)
            .max_dest_rd_atomic(1)
            .min_rnr_timer(1),
    )
    .unwrap();
    qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(0)
            .timeout(timeout)
            .retry_cnt(7)
            .rnr_retry(7)
            .max_rd_atomic(1),
    )
    .unwrap();
}

/// A context in inline mode with manual progress (no helper thread touches its engine
/// between a test's steps) and no huge pages.
pub(crate) fn inline_context() -> Context {
    inline_context_builder().build().unwrap()
}

/// [`inline_context`] whose protocol timers run on `clock` (a test moves it; see
/// `Env::jump_to`).
pub(crate) fn inline_context_on(clock: crate::timer::TestClock) -> Context {
    inline_context_builder().test_clock(&clock).build().unwrap()
}

/// [`inline_context`] with a 1 MiB arena per protection domain.
pub(crate) fn small_inline_context() -> Context {
    inline_context_builder()
        .arena_size(1 << 20)
        .build()
        .unwrap()
}

fn inline_context_builder() -> crate::ContextBuilder {
    Context::builder()
        .mode(crate::EngineMode::Inline)
        .progress(crate::Progress::Manual)
        .huge_pages(HugePages::Never)
}

/// Takes `qp` through Init and RTR to RTS towards peer QP `peer` on `link` (MTU 256, every
/// access flag, receive PSN 0, send PSN `sq_psn`, end-to-end credits as `credits` says):
/// the set-up the unit tests' raw peers talk to.
pub(crate) fn connect_to_raw_peer(
    qp: &mut crate::Qp,
    link: crate::LinkId,
    peer: u32,
    sq_psn: u32,
    credits: bool,
) {
    connect_to_raw_peer_with_timeout(qp, link, peer, sq_psn, credits, 14);
}

/// [`connect_to_raw_peer`] with Local Ack Timeout `timeout` (14: about 67 ms; 8: about 1 ms).
pub(crate) fn connect_to_raw_peer_with_timeout(
    qp: &mut crate::Qp,
    link: crate::LinkId,
    peer: u32,
    sq_psn: u32,
    credits: bool,
    timeout: u8,
) {
    use crate::{QpAttr, QpState};
    raw_peer_to_rtr(qp, link, peer, credits);
    qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(sq_psn)
            .timeout(timeout)
            .retry_cnt(7)
            .rnr_retry(7)
            .max_rd_atomic(1),
    )
    .unwrap();
}

/// Takes `qp` through Init to RTR towards peer QP `peer` on `link`, as
/// [`connect_to_raw_peer`] does before its last step.
pub(crate) fn raw_peer_to_rtr(qp: &mut crate::Qp, link: crate::LinkId, peer: u32, credits: bool) {
    use crate::{AccessFlags, Destination, Mtu, QpAttr, QpState, Qpn};
    qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::ALL))
        .unwrap();
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(Mtu::Mtu256)
            .dest(Destination {
                link,
                qpn: Qpn::new(peer),
            })
            .rq_psn(0)
            .max_dest_rd_atomic(1)
            .min_rnr_timer(1)
            .remote_credits(credits),
    )
    .unwrap();
}

/// The line of a standalone Acknowledge from a raw peer to QP `qpn`: `psn`, `syndrome`,
/// MSN `msn`.
pub(crate) fn ack_line_to(
    qpn: crate::Qpn,
    psn: u32,
    syndrome: crate::wire::aeth::Syndrome,
    msn: u32,
) -> crate::wire::slot::PacketSlot {
    use crate::wire::{BthRepr, Msn, PacketRepr, aeth::AethRepr, opcode::Opcode};
    let mut repr = PacketRepr::new(BthRepr::new(
        Opcode::Acknowledge,
        qpn,
        crate::psn::Psn::new(psn),
    ));
    repr.aeth = Some(AethRepr {
        syndrome,
        msn: Msn::new(msn),
    });
    let mut s = crate::wire::slot::PacketSlot::default();
    s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
    s
}
