//! Test rig shared by the in-crate suites that play the peer themselves (the hostile-input
//! proptests and the credit-flow tests): a link whose far end the test drives slot by slot.

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
