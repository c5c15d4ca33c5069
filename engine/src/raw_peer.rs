//! Test rigs shared by the in-crate suites: a link whose far end the test drives slot by
//! slot (the hostile-input proptests, the credit-flow tests), and a pair of QPs joined over
//! a loopback link (the engine-token and in-flight-count tests).

use crate::link::{self, Link, LinkEnds, Side};
use crate::mem::Mem;
use crate::wire::Qpn;
use crate::{Context, LinkId};
use shmhca_rings::segment::HugePages;

/// Adds to `ctx` a link of `slots` slots a direction whose far end is returned to the test,
/// as a peer would hold it (the test creates the segment, the engine opens it), with peer
/// QP `peer_qpn` sending from a private arena of `arena_len` bytes (also returned, to
/// write payloads into).
pub(crate) fn raw_peer_link(
    ctx: &Context,
    slots: usize,
    peer_qpn: u32,
    arena_len: usize,
) -> (LinkId, LinkEnds, Mem) {
    let seg = link::create_link_segment(slots, HugePages::Never).unwrap();
    let theirs = link::open_link_segment(seg.try_clone_fd().unwrap()).unwrap();
    let ends = link::attach(&theirs, Side::Opener).unwrap();
    let mut l = Link::new(theirs, ends, Mem::private(4096), (1, 2));
    let peer_arena = Mem::private(arena_len);
    l.add_peer_qp(Qpn::new(peer_qpn), (1, 1), peer_arena.share());
    let id = ctx.shared.engine.with(|e| e.add_link(l)).unwrap();
    let mine = link::attach(&seg, Side::Creator).unwrap();
    (id, mine, peer_arena)
}

/// Two QPs of `ctx` joined over a loopback link, in RTS (PMTU 1024, one Read/Atomic each
/// way, access flags none).
pub(crate) fn loopback_pair(
    ctx: &Context,
    pd: &crate::Pd,
    cq: &crate::Cq,
) -> (crate::Qp, crate::Qp) {
    use crate::{AccessFlags, Destination, Mtu, QpAttr, QpCaps, QpState};
    let (link, _) = ctx.link_with(ctx).unwrap();
    let mut a = ctx.create_qp(pd, cq, cq, QpCaps::default()).unwrap();
    let mut b = ctx.create_qp(pd, cq, cq, QpCaps::default()).unwrap();
    let (qa, qb) = (a.qpn(), b.qpn());
    for (qp, remote) in [(&mut a, qb), (&mut b, qa)] {
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
                .timeout(14)
                .retry_cnt(7)
                .rnr_retry(7)
                .max_rd_atomic(1),
        )
        .unwrap();
    }
    (a, b)
}

/// A context in inline mode with manual progress (no helper thread touches its engine
/// between a test's steps) and no huge pages.
pub(crate) fn inline_context() -> Context {
    Context::builder()
        .mode(crate::EngineMode::Inline)
        .progress(crate::Progress::Manual)
        .huge_pages(HugePages::Never)
        .build()
        .unwrap()
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
