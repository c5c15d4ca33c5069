//! Mapping what a peer hands over when a new link is made: the link segment (when the peer
//! created it) and the peer's arena. All descriptor-to-mapping code of the connection
//! manager is here, in [`new_link`].

use std::os::fd::OwnedFd;
use std::sync::Arc;

use shmhca_rings::segment::{Access, Segment};

use crate::arena::ARENA_KIND;
use crate::error::Result;
use crate::link::{self, Link, LinkId, Side};
use crate::mem::Mem;
use crate::verbs::Shared;

/// The link segment of a new link.
pub(super) enum LinkSegment {
    /// Made by this side ([`link::create_link_segment`]).
    Made(Arc<Segment>),
    /// Received from the peer, which made it.
    Received(OwnedFd),
}

/// Maps a new link's segment and the peer's arena and adds the link to the engine.
///
/// # Errors
/// The link segment or the arena cannot be mapped or is malformed (see [`link::attach`]).
pub(super) fn new_link(
    shared: &Arc<Shared>,
    segment: LinkSegment,
    side: Side,
    peer_arena: OwnedFd,
    peer_trace_id: u32,
) -> Result<LinkId> {
    let segment = match segment {
        LinkSegment::Made(s) => s,
        LinkSegment::Received(fd) => {
            Arc::new(Segment::open(fd, link::LINK_KIND, Access::ReadWrite)?)
        }
    };
    let arena = Segment::open(peer_arena, ARENA_KIND, Access::ReadOnly)?;
    let ends = link::attach(&segment, side)?;
    let l = Link::new(
        segment,
        ends,
        Mem::from_segment(Arc::new(arena)),
        (shared.id, peer_trace_id),
    );
    Ok(shared.engine.with(|e| e.add_link(l)))
}
