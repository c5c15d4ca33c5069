//! Sharing and mapping what the two sides hand each other over the socket: the link
//! segment (when the peer created it), the peer's engine page, and the arena of each peer
//! QP's protection domain. All descriptor-to-mapping code of the connection manager is
//! here: [`new_link`], [`share_arena`], [`share_engine_page`] and [`attach_peer_arena`].

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use shmhca_rings::segment::{Access, Segment};

use crate::arena::{ARENA_KIND, ENGINE_PAGE_KIND, ENGINE_PAGE_LEN};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::link::{self, Link, LinkId, OnPeerLoss, Side};
use crate::mem::Mem;
use crate::verbs::Pd;
use crate::wire::Qpn;

use super::msg::ArenaLayout;

/// The link segment of a new link.
pub(crate) enum LinkSegment {
    /// Made by this side ([`link::create_link_segment`]).
    Made(Arc<Segment>),
    /// Received from the peer, which made it.
    Received(OwnedFd),
}

/// Maps a new link's segment and the peer's engine page and adds the link to the engine.
///
/// # Errors
/// The link segment or the engine page cannot be mapped or is malformed (see
/// [`link::attach`]), or the engine has no room for another link.
pub(crate) fn new_link(
    shared: &Arc<Device>,
    segment: LinkSegment,
    side: Side,
    peer_page: OwnedFd,
    peer_trace_id: u32,
    on_peer_loss: OnPeerLoss,
) -> Result<LinkId> {
    let segment = match segment {
        LinkSegment::Made(s) => s,
        LinkSegment::Received(fd) => link::open_link_segment(fd)?,
    };
    let page = Segment::open(
        peer_page,
        ENGINE_PAGE_KIND,
        Access::ReadOnly,
        ENGINE_PAGE_LEN,
    )?;
    let ends = link::attach(&segment, side)?;
    let mut l = Link::new(
        segment,
        ends,
        Mem::from_segment(Arc::new(page)),
        (shared.id, peer_trace_id),
    );
    l.on_peer_loss = on_peer_loss;
    let id = shared.engine.with(|e| e.add_link(l))?;
    // A sleeping engine thread waits on the kick words of the links it knew of: it must
    // gather them again, this one included.
    shared.kick();
    Ok(id)
}

/// A read-only descriptor of this engine's page, to send to a peer with a new link.
pub(crate) fn share_engine_page(shared: &Device) -> Result<OwnedFd> {
    shared
        .engine_page
        .share_fd()
        .map_err(|e| Error::io("sharing the engine page", e))
}

/// A read-only descriptor of the arena of `pd`, to send to a peer, and how it is laid out.
pub(super) fn share_arena(shared: &Arc<Device>, pd: &Pd) -> Result<(OwnedFd, ArenaLayout)> {
    share_pd_arena(shared, pd.pdn)
}

/// [`share_arena`] of protection domain number `pdn` (the fabric's setup knows a QP's
/// domain by number).
pub(crate) fn share_pd_arena(shared: &Device, pdn: u32) -> Result<(OwnedFd, ArenaLayout)> {
    let seg = shared
        .engine
        .with(|e| e.res.pds.get(pdn).map(|a| a.segment().clone()))
        .ok_or(Error::ForeignObject {
            what: "the protection domain",
        })?;
    let layout = if seg.has_header() {
        ArenaLayout::Segment
    } else {
        ArenaLayout::Memfd
    };
    let fd = seg
        .share_fd()
        .map_err(|e| Error::io("sharing the protection domain's arena", e))?;
    Ok((fd, layout))
}

/// Records on link `id` that peer QP `qpn` sends from the arena behind `fd`: mapped
/// read-only (never populated, refused above `max` bytes) unless this link mapped that
/// arena already.
pub(crate) fn attach_peer_arena(
    shared: &Arc<Device>,
    id: LinkId,
    qpn: u32,
    fd: OwnedFd,
    layout: ArenaLayout,
    max: u64,
) -> Result<()> {
    let key =
        Segment::identity(fd.as_fd()).map_err(|e| Error::io("identifying the peer's arena", e))?;
    let qpn = Qpn::new(qpn);
    let known = shared.engine.with(|e| {
        let link = e.link_mut(id)?;
        let mem = link.peer_arena(key)?.share();
        link.add_peer_qp(qpn, key, mem);
        Some(())
    });
    if known.is_some() {
        return Ok(());
    }
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    let arena = match layout {
        ArenaLayout::Segment => Segment::open(fd, ARENA_KIND, Access::ReadOnly, max)?,
        // An application's memfd: no header to check; `open_raw` insists on the shrink seal,
        // so the owner can never pull the pages out from under this mapping.
        ArenaLayout::Memfd => Segment::open_raw(fd, ARENA_KIND, Access::ReadOnly, max)?,
    };
    let mem = Mem::from_segment(Arc::new(arena));
    shared
        .engine
        .with(|e| e.link_mut(id).map(|l| l.add_peer_qp(qpn, key, mem)))
        .ok_or_else(|| Error::Connect("the link went down during connection setup".into()))
}
