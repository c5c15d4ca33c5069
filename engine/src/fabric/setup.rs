//! Setting up a link and swapping arenas with a peer LID: the client's half ([`resolve`],
//! run by `Qp::modify` going to RTR) and the server's ([`serve`], run by a handler thread
//! of the fabric thread for each request).
//!
//! ```text
//!   client (RTR by LID)                         server (the LID's fabric thread)
//!   HELLO(identity, LID, wanted LID) ─────────▶
//!                  ◀──────────────── WELCOME(identity, LID)
//!   LINK reuse(token) | offer(token)+[segment, page] | need
//!                  ◀──────────────── LINK_REPLY ok(token)[+page] | offer(token)+[segment, page]
//!                                                | unknown | retry
//!   (after an offer from the server) DONE+[page] ─▶
//!   ATTACH(my QPN, wanted QPN)+[my arena] ─────▶  maps it for the link
//!                  ◀──────────────── ATTACH_REPLY(found)[+its arena]
//!   (the socket stays open when this exchange made the link; else it is closed)
//! ```
//!
//! Who makes a new link: a side that has a pending link to the other's LID (made while no
//! engine held it) offers that one, whoever asks; otherwise the side with the lower LID
//! makes it (the client offers a new segment, or asks the server with `need`). All link
//! creation between two engines thus happens in one of them, where the LIDs being set up
//! are marked busy: a server whose LID is the lower waits while a thread of its own sets a
//! link up with the client (that thread will finish: the client's server side never
//! waits), then answers from its table.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shmhca_rings::fdpass::{recv_with_fds, send_with_fds};
use shmhca_rings::segment::{Access, Segment};

use super::msg::{LEN, LinkAsk, LinkReply, Msg};
use super::{Fabric, FabricDest, FabricSlot, MAX_PEER_ARENA, PeerLink, dir};
use crate::arena::{ENGINE_PAGE_KIND, ENGINE_PAGE_LEN};
use crate::cm::msg::ArenaLayout;
use crate::cm::segments::{LinkSegment, attach_peer_arena, new_link, share_engine_page};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::link::{self, Link, LinkId, OnPeerLoss, Side};
use crate::mem::Mem;
use crate::qp::Destination;
use crate::wire::Qpn;

/// How long one exchange with a peer may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a resolution may take in all (retries included).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(30);

/// Why one attempt did not finish.
enum Attempt {
    /// Try again (the server was busy, or a link this side knew is gone).
    Again,
    Fail(Error),
}

impl From<Error> for Attempt {
    fn from(e: Error) -> Attempt {
        Attempt::Fail(e)
    }
}

fn err(lid: u16, what: impl std::fmt::Display) -> Error {
    Error::Connect(format!("fabric, LID {lid:#x}: {what}"))
}

/// Sends one message with descriptors.
fn send(s: &UnixStream, lid: u16, m: &Msg, fds: &[BorrowedFd<'_>]) -> Result<()> {
    send_with_fds(s, &m.encode(), fds)
        .map_err(|e| err(lid, format_args!("sending {}: {e}", m.name())))
}

/// Receives one message and at most `max_fds` descriptors (the socket's read timeout
/// bounds each wait).
fn recv(s: &UnixStream, lid: u16, what: &str, max_fds: usize) -> Result<(Msg, Vec<OwnedFd>)> {
    let mut b = [0u8; LEN];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < LEN {
        match recv_with_fds(s, &mut b[got..], max_fds.saturating_sub(fds.len())) {
            Ok((0, _)) => {
                return Err(err(
                    lid,
                    format_args!("the peer closed the socket while this side waited for {what}"),
                ));
            }
            Ok((n, more)) => {
                got += n;
                fds.extend(more);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(err(
                    lid,
                    format_args!("no {what} from the peer within {STEP_TIMEOUT:?}"),
                ));
            }
            Err(e) => return Err(err(lid, format_args!("receiving {what}: {e}"))),
        }
    }
    let m = Msg::decode(&b).map_err(|m| err(lid, format_args!("malformed {what}: {}", m.0)))?;
    Ok((m, fds))
}

/// Checks that the peer process is of this user.
fn check_peer(s: &UnixStream, lid: u16, uid: u32) -> Result<u32> {
    let cred = rustix::net::sockopt::socket_peercred(s)
        .map_err(|e| err(lid, format_args!("reading the peer's credentials: {e}")))?;
    if cred.uid.as_raw() != uid {
        return Err(err(
            lid,
            format_args!(
                "the process behind the socket (pid {}) belongs to uid {}, not to this user (uid {uid}): refused",
                cred.pid.as_raw_pid(),
                cred.uid.as_raw()
            ),
        ));
    }
    Ok(cred.pid.as_raw_pid() as u32)
}

fn timeouts(s: &UnixStream) {
    let _ = s.set_read_timeout(Some(STEP_TIMEOUT));
    let _ = s.set_write_timeout(Some(STEP_TIMEOUT));
}

/// A read-only descriptor of protection domain `pdn`'s arena, and whether it is an
/// application's memfd (no header).
fn share_pd_arena(shared: &Device, pdn: u32) -> Result<(OwnedFd, bool)> {
    crate::cm::segments::share_pd_arena(shared, pdn)
        .map(|(fd, layout)| (fd, layout == ArenaLayout::Memfd))
}

fn layout(memfd: bool) -> ArenaLayout {
    if memfd {
        ArenaLayout::Memfd
    } else {
        ArenaLayout::Segment
    }
}

/// Makes sure link `id` knows peer QP `qpn` (an empty arena until the real one comes), so
/// that a QP can go to RTR towards it.
fn ensure_peer_qp(shared: &Device, id: LinkId, qpn: Qpn) {
    shared.engine.with(|e| {
        if let Some(l) = e.link_mut(id) {
            if l.peer_qp_arena(qpn).is_none() {
                l.add_peer_qp(qpn, (u64::MAX, u64::from(qpn.get())), Mem::private(0));
            }
        }
    });
}

/// Maps peer QP `qpn`'s arena for link `id` and gives it to the local QPs already facing it.
fn take_peer_arena(
    shared: &Arc<Device>,
    id: LinkId,
    qpn: Qpn,
    fd: OwnedFd,
    memfd: bool,
) -> Result<()> {
    attach_peer_arena(shared, id, qpn.get(), fd, layout(memfd), MAX_PEER_ARENA)?;
    shared.engine.with(|e| {
        let Some(mem) = e
            .link_mut(id)
            .and_then(|l| l.peer_qp_arena(qpn).map(Mem::share))
        else {
            return;
        };
        let d = Some(Destination { link: id, qpn });
        for q in e.qps_mut().filter(|q| q.proto.cfg.dest == d) {
            q.peer_mem = mem.share();
        }
    });
    Ok(())
}

/// A link made before any engine held its peer LID: this side is its creator; the peer's
/// engine page is a blank one until an engine attaches.
fn pending_link(shared: &Arc<Device>) -> Result<(LinkId, Arc<Segment>)> {
    let seg = link::create_link_segment(shared.link_slots, shared.huge_pages)?;
    let ends = link::attach(&seg, Side::Creator)?;
    let mut l = Link::new(
        seg.clone(),
        ends,
        Mem::private(ENGINE_PAGE_LEN),
        (shared.id, 0),
    );
    l.on_peer_loss = OnPeerLoss::FailNextRequest;
    let id = shared.engine.with(|e| e.add_link(l))?;
    shared.kick();
    Ok((id, seg))
}

/// An engine attached to pending link `id`: its page and trace id replace the blanks.
fn attached(shared: &Arc<Device>, id: LinkId, page: OwnedFd, trace_id: u32) -> Result<()> {
    let page = Segment::open(page, ENGINE_PAGE_KIND, Access::ReadOnly, ENGINE_PAGE_LEN)?;
    shared.engine.with(|e| {
        if let Some(l) = e.link_mut(id) {
            l.set_peer_page(Mem::from_segment(Arc::new(page)));
            l.endpoints.1 = trace_id;
        }
    });
    shared.kick();
    Ok(())
}

/// The engine of the peer at LID `lid` agreed on a link with this one: which, under
/// what token.
struct Agreed {
    lid: u16,
    token: u64,
    identity: u64,
}

/// Maps the agreed link (the segment made here, this side its creator, or received from
/// the peer), adds it to the engine as a fabric link (its QPs outlive a lost peer for the
/// grace: [`OnPeerLoss::FailNextRequest`]) and lists it in the fabric's table as up.
fn up_link(
    shared: &Arc<Device>,
    fabric: &Fabric,
    peer: Agreed,
    segment: LinkSegment,
    peer_page: OwnedFd,
    trace_id: u32,
) -> Result<LinkId> {
    let side = match segment {
        LinkSegment::Made(_) => Side::Creator,
        LinkSegment::Received(_) => Side::Opener,
    };
    let id = new_link(
        shared,
        segment,
        side,
        peer_page,
        trace_id,
        OnPeerLoss::FailNextRequest,
    )?;
    fabric.lock().peers.push(PeerLink {
        lid: peer.lid,
        id,
        token: peer.token,
        identity: Some(peer.identity),
        segment: None,
        socket: None,
        up: true,
        down_at: None,
    });
    Ok(id)
}

/// Whether the engine still has link `id` up.
fn engine_up(shared: &Device, id: LinkId) -> bool {
    shared
        .engine
        .with(|e| e.link_mut(id).is_some_and(|l| l.down.is_none()))
}

/// Tears link `id` down (its QPs learn it as `OnPeerLoss::FailNextRequest` says) and marks
/// its entry down.
pub(crate) fn tear_down(shared: &Device, t: &mut super::Table, id: LinkId, why: &str) {
    if let Some(p) = t.peers.iter_mut().find(|p| p.id == id) {
        p.up = false;
        p.down_at = Some((std::time::Instant::now(), why.to_string()));
        p.segment = None;
        p.socket = None;
    }
    shared.engine.with(|e| {
        // Hear the peer's last words first (the Acks it sent), bounded.
        for _ in 0..256 {
            if e.poll(&shared.doorbell) == 0 {
                break;
            }
        }
        e.link_down(id, why.to_string());
        e.poll(&shared.doorbell);
    });
    shared.kick();
}

/// Marks a LID busy while set up; unmarked when dropped.
struct Busy<'a> {
    fabric: &'a Fabric,
    lid: u16,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.fabric.lock().unbusy(self.lid);
        self.fabric.changed.notify_all();
    }
}

/// The destination of this context's QP `qpn` (in protection domain `pdn`) facing `dest`:
/// the link to the peer's engine, made or reused, with the arenas swapped. Run by
/// `Qp::modify` before it moves the QP to RTR.
///
/// # Errors
/// [`Error::InvalidArgument`] when the context has not joined the fabric or `dest` names
/// no unicast LID or fabric GID; [`Error::Connect`] when the peer's socket refuses (another
/// user) or breaks the protocol, or the setup takes longer than 30 s;
/// [`Error::SegmentCreate`]/[`Error::SegmentOpen`] for segments that cannot be made or
/// mapped; [`Error::LimitReached`] past 4,096 links.
pub(crate) fn resolve(
    shared: &Arc<Device>,
    qpn: Qpn,
    pdn: u32,
    dest: FabricDest,
) -> Result<Destination> {
    let fabric = FabricSlot::of(shared).get().ok_or_else(|| {
        Error::invalid(
            "dest_lid",
            "this context has not joined the fabric: call Context::join_fabric first",
        )
    })?;
    let lid = dest.lid()?;
    if lid == fabric.lid {
        return loopback(shared, &fabric, dest.qpn);
    }
    let deadline = Instant::now() + RESOLVE_TIMEOUT;
    loop {
        match attempt(shared, &fabric, qpn, pdn, lid, dest.qpn, deadline) {
            Ok(link) => {
                return Ok(Destination {
                    link,
                    qpn: dest.qpn,
                });
            }
            Err(Attempt::Fail(e)) => return Err(e),
            Err(Attempt::Again) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(Attempt::Again) => {
                return Err(err(
                    lid,
                    format_args!(
                        "no link could be agreed with the peer within {RESOLVE_TIMEOUT:?}"
                    ),
                ));
            }
        }
    }
}

/// A destination in this very context: its loopback link.
fn loopback(shared: &Arc<Device>, fabric: &Fabric, qpn: Qpn) -> Result<Destination> {
    let mut t = fabric.lock();
    let id = match t.live(fabric.lid) {
        Some(p) => p.id,
        None => {
            let ctx = crate::verbs::Context {
                shared: shared.clone(),
            };
            let (id, _) = ctx.link_with(&ctx)?;
            t.peers.push(PeerLink {
                lid: fabric.lid,
                id,
                token: 0,
                identity: Some(crate::cm::CmState::of(shared).identity),
                segment: None,
                socket: None,
                up: true,
                down_at: None,
            });
            id
        }
    };
    drop(t);
    // `Qp::modify` finds the local QP's arena; a QPN that does not exist (yet) gets a blank.
    shared.find_local_peer_qp(Destination { link: id, qpn });
    ensure_peer_qp(shared, id, qpn);
    Ok(Destination { link: id, qpn })
}

/// What this side knows of its link to a LID when it asks.
#[derive(Clone, Copy)]
enum Known {
    None,
    Up {
        id: LinkId,
        token: u64,
        identity: u64,
    },
    Pending {
        id: LinkId,
        token: u64,
    },
}

fn attempt(
    shared: &Arc<Device>,
    fabric: &Arc<Fabric>,
    qpn: Qpn,
    pdn: u32,
    lid: u16,
    want: Qpn,
    deadline: Instant,
) -> std::result::Result<LinkId, Attempt> {
    // Wait for any setup of ours with that LID to end, then mark it ours.
    let mut t = fabric.lock();
    while t.busy.contains(&lid) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Attempt::Again);
        }
        t = fabric
            .changed
            .wait_timeout(t, left.min(Duration::from_millis(100)))
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    let mut known = match t.live(lid) {
        Some(p) => match (p.identity, &p.segment) {
            (Some(identity), _) => Known::Up {
                id: p.id,
                token: p.token,
                identity,
            },
            (None, Some(_)) => Known::Pending {
                id: p.id,
                token: p.token,
            },
            (None, None) => Known::None,
        },
        None => Known::None,
    };
    if let Known::Up { id, .. } = known {
        if !engine_up(shared, id) {
            // The engine tore it down by itself (a broken ring): never reused.
            tear_down(shared, &mut t, id, "the link broke");
            known = Known::None;
        }
    }
    t.busy.push(lid);
    drop(t);
    let _busy = Busy { fabric, lid };

    let path = dir::sock_path(&fabric.dir, lid);
    let stream = match UnixStream::connect(&path) {
        Ok(s) => s,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
            ) =>
        {
            // No engine holds that LID (yet): as on a fabric, RTR succeeds and the packets
            // wait on a link nobody reads, for the engine that may come.
            let id = match known {
                Known::Up { id, .. } | Known::Pending { id, .. } => id,
                Known::None => {
                    let (id, seg) = pending_link(shared)?;
                    fabric.lock().peers.push(PeerLink {
                        lid,
                        id,
                        token: crate::cm::random_u64(),
                        identity: None,
                        segment: Some(seg),
                        socket: None,
                        up: true,
                        down_at: None,
                    });
                    id
                }
            };
            ensure_peer_qp(shared, id, want);
            return Ok(id);
        }
        Err(e) => {
            return Err(err(lid, format_args!("connecting to {}: {e}", path.display())).into());
        }
    };
    check_peer(&stream, lid, fabric.uid)?;
    timeouts(&stream);
    send(
        &stream,
        lid,
        &Msg::Hello {
            identity: crate::cm::CmState::of(shared).identity,
            trace_id: shared.id,
            lid: fabric.lid,
            target_lid: lid,
        },
        &[],
    )?;
    let (identity, trace_id) = match recv(&stream, lid, "WELCOME", 0)? {
        (
            Msg::Welcome {
                identity,
                trace_id,
                lid: l,
            },
            _,
        ) if l == lid => (identity, trace_id),
        (m, _) => {
            return Err(err(lid, format_args!("the peer sent {} for WELCOME", m.name())).into());
        }
    };
    if let Known::Up {
        id, identity: i, ..
    } = known
    {
        if i != identity {
            // Another engine holds the LID now: the old one is gone.
            tear_down(
                shared,
                &mut fabric.lock(),
                id,
                "the peer LID's engine was replaced (its process ended)",
            );
            known = Known::None;
        }
    }
    let page = share_engine_page(shared)?;
    // The new segment this side makes, when it is the one to make it.
    let mut made: Option<(Arc<Segment>, u64)> = None;
    let pending_seg = |id| {
        fabric
            .lock()
            .peers
            .iter()
            .find(|p| p.id == id)
            .and_then(|p| p.segment.clone())
    };
    let ask = match known {
        Known::Up { token, .. } => {
            send(&stream, lid, &Msg::Link(LinkAsk::Reuse(token)), &[])?;
            LinkAsk::Reuse(token)
        }
        Known::Pending { id, token } => {
            let seg = pending_seg(id).ok_or(Attempt::Again)?;
            send(
                &stream,
                lid,
                &Msg::Link(LinkAsk::OfferPending(token)),
                &[seg.as_fd(), page.as_fd()],
            )?;
            LinkAsk::OfferPending(token)
        }
        Known::None if fabric.lid < lid => {
            let seg = link::create_link_segment(shared.link_slots, shared.huge_pages)?;
            let token = crate::cm::random_u64();
            send(
                &stream,
                lid,
                &Msg::Link(LinkAsk::Offer(token)),
                &[seg.as_fd(), page.as_fd()],
            )?;
            made = Some((seg, token));
            LinkAsk::Offer(token)
        }
        Known::None => {
            send(&stream, lid, &Msg::Link(LinkAsk::Need), &[])?;
            LinkAsk::Need
        }
    };
    let (reply, mut fds) = recv(&stream, lid, "LINK_REPLY", 2)?;
    let mut keep = false;
    let id = match (reply, ask) {
        (Msg::LinkReply(LinkReply::Ok(t)), LinkAsk::Reuse(token))
            if t == token && fds.is_empty() =>
        {
            match known {
                Known::Up { id, .. } => id,
                _ => return Err(Attempt::Again),
            }
        }
        (
            Msg::LinkReply(LinkReply::Ok(t)),
            LinkAsk::Offer(token) | LinkAsk::OfferPending(token),
        ) if t == token => {
            match (fds.pop(), fds.is_empty()) {
                (Some(peer_page), true) => {
                    // Taken: the link is up.
                    keep = true;
                    match (made.take(), known) {
                        (Some((seg, _)), _) => up_link(
                            shared,
                            fabric,
                            Agreed {
                                lid,
                                token,
                                identity,
                            },
                            LinkSegment::Made(seg),
                            peer_page,
                            trace_id,
                        )?,
                        (None, Known::Pending { id, .. }) => {
                            attached(shared, id, peer_page, trace_id)?;
                            id
                        }
                        _ => return Err(Attempt::Again),
                    }
                }
                (None, _) => {
                    // The server had the link already (an engine of ours gave it): it is
                    // up here too.
                    let mut t = fabric.lock();
                    match t.by_token(lid, token) {
                        Some(p) if p.identity == Some(identity) => p.id,
                        _ => return Err(Attempt::Again),
                    }
                }
                _ => {
                    return Err(
                        err(lid, "the peer's LINK_REPLY carried too many descriptors").into(),
                    );
                }
            }
        }
        (Msg::LinkReply(LinkReply::Ok(t)), LinkAsk::Need) if fds.is_empty() => {
            // The server made the link with our server side meanwhile.
            let mut t2 = fabric.lock();
            match t2.by_token(lid, t) {
                Some(p) if p.identity == Some(identity) => p.id,
                _ => {
                    return Err(err(
                        lid,
                        "the peer engine holds a link to this one that this side does not know",
                    )
                    .into());
                }
            }
        }
        (Msg::LinkReply(LinkReply::Offer(t)), _) if fds.len() == 2 => {
            let peer_page = fds.pop().expect("two descriptors");
            let seg = fds.pop().expect("two descriptors");
            if let Known::Up { id, .. } = known {
                // The server no longer had the link this side knew: it made a new one.
                tear_down(
                    shared,
                    &mut fabric.lock(),
                    id,
                    "the peer engine replaced this link with a new one",
                );
            }
            if let Known::Pending { id, .. } = known {
                // Both sides made a link before the other existed; the server's won.
                tear_down(
                    shared,
                    &mut fabric.lock(),
                    id,
                    "the peer engine made its own link to this one before either existed; QPs that were facing it must be created again",
                );
            }
            let id = up_link(
                shared,
                fabric,
                Agreed {
                    lid,
                    token: t,
                    identity,
                },
                LinkSegment::Received(seg),
                peer_page,
                trace_id,
            )
            .map_err(|e| {
                err(
                    lid,
                    format_args!("the peer's link segment is unusable: {e}"),
                )
            })?;
            send(&stream, lid, &Msg::Done, &[page.as_fd()])?;
            keep = true;
            id
        }
        (Msg::LinkReply(LinkReply::Unknown), _) => {
            if let Known::Up { id, .. } = known {
                tear_down(
                    shared,
                    &mut fabric.lock(),
                    id,
                    "the peer engine no longer has this link",
                );
            }
            return Err(Attempt::Again);
        }
        (Msg::LinkReply(LinkReply::Retry), _) => return Err(Attempt::Again),
        (m, _) => {
            return Err(err(
                lid,
                format_args!("the peer sent {} ({m:?}) for LINK_REPLY", m.name()),
            )
            .into());
        }
    };
    if keep {
        // Up from now on (its socket is watched only once this exchange is over).
        let mut t = fabric.lock();
        if let Some(p) = t.peers.iter_mut().find(|p| p.id == id) {
            p.identity = Some(identity);
            p.segment = None;
        }
    }
    // The arenas: ours for the peer, the wanted QP's for us. A link this exchange made is
    // torn down if the exchange fails now: it would have no socket to watch.
    let swapped = swap_arenas(shared, &stream, lid, id, qpn, pdn, want);
    if let Err(e) = swapped {
        if keep {
            tear_down(
                shared,
                &mut fabric.lock(),
                id,
                "the peer failed half-way through the link's setup",
            );
        }
        return Err(e.into());
    }
    if keep {
        let socket = Arc::new(
            stream
                .try_clone()
                .map_err(|e| Error::io("keeping the fabric link's socket", e))?,
        );
        if let Some(p) = fabric.lock().peers.iter_mut().find(|p| p.id == id) {
            p.socket = Some(socket);
        }
        fabric.wake();
    }
    Ok(id)
}

/// The client's ATTACH: sends this QP's arena, takes the wanted peer QP's (or a blank, if
/// the peer has no such QP yet).
fn swap_arenas(
    shared: &Arc<Device>,
    stream: &UnixStream,
    lid: u16,
    id: LinkId,
    qpn: Qpn,
    pdn: u32,
    want: Qpn,
) -> Result<()> {
    let (arena, memfd) = share_pd_arena(shared, pdn)?;
    send(
        stream,
        lid,
        &Msg::Attach {
            qpn: qpn.get(),
            want: want.get(),
            memfd,
        },
        &[arena.as_fd()],
    )?;
    match recv(stream, lid, "ATTACH_REPLY", 1)? {
        (Msg::AttachReply { found: true, memfd }, mut fds) if fds.len() == 1 => {
            let fd = fds.pop().expect("one descriptor");
            take_peer_arena(shared, id, want, fd, memfd)
                .map_err(|e| err(lid, format_args!("the peer QP's arena is unusable: {e}")))
        }
        (Msg::AttachReply { found: false, .. }, fds) if fds.is_empty() => {
            ensure_peer_qp(shared, id, want);
            Ok(())
        }
        (m, _) => Err(err(
            lid,
            format_args!("the peer sent {} for ATTACH_REPLY", m.name()),
        )),
    }
}

/// Serves one client of this context's fabric socket (a handler thread). Errors end the
/// exchange: the client sees the socket close and reports it.
/// Holds the context only once the client said HELLO: a client that connects and stalls
/// does not keep a dropped context alive.
pub(crate) fn serve(
    shared: &std::sync::Weak<Device>,
    fabric: &Arc<Fabric>,
    stream: UnixStream,
) -> Result<()> {
    let me = fabric.lid;
    timeouts(&stream);
    let (identity, trace_id, client) = match recv(&stream, me, "HELLO", 0)? {
        (
            Msg::Hello {
                identity,
                trace_id,
                lid,
                target_lid,
            },
            _,
        ) if target_lid == me && lid != me => (identity, trace_id, lid),
        (m, _) => return Err(err(me, format_args!("a client sent {m:?} for HELLO"))),
    };
    let Some(shared) = shared.upgrade() else {
        return Ok(()); // the context is gone
    };
    let shared = &shared;
    send(
        &stream,
        client,
        &Msg::Welcome {
            identity: crate::cm::CmState::of(shared).identity,
            trace_id: shared.id,
            lid: me,
        },
        &[],
    )?;
    let (ask, mut fds) = match recv(&stream, client, "LINK", 2)? {
        (Msg::Link(a), fds) => (a, fds),
        (m, _) => {
            return Err(err(
                client,
                format_args!("the client sent {} for LINK", m.name()),
            ));
        }
    };
    let page = share_engine_page(shared)?;
    let deadline = Instant::now() + STEP_TIMEOUT;
    let mut t = fabric.lock();
    if me < client {
        // A thread of ours may be making the link with this client: let it finish.
        while t.busy.contains(&client) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                drop(t);
                return send(&stream, client, &Msg::LinkReply(LinkReply::Retry), &[]);
            }
            t = fabric
                .changed
                .wait_timeout(t, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
    // What this side has for the client's LID.
    let mut entry = t
        .live(client)
        .map(|p| (p.id, p.token, p.identity, p.segment.clone()));
    if let Some((id, token, Some(i), _)) = entry {
        let stale = i != identity || !engine_up(shared, id);
        // A `need` may cross the link this side just made with the client (its server
        // side recorded it before our thread's exchange ended): answered with the token.
        let unknown_to_client = match ask {
            LinkAsk::Reuse(x) | LinkAsk::Offer(x) | LinkAsk::OfferPending(x) => x != token,
            LinkAsk::Need => false,
        };
        if stale || unknown_to_client {
            tear_down(
                shared,
                &mut t,
                id,
                "the peer engine no longer knows this link (its process ended, or it dropped the link)",
            );
            entry = None;
        }
    }
    if let (Some((id, _, None, _)), LinkAsk::OfferPending(_)) = (&entry, ask) {
        let id = *id;
        // Both made a link before the other existed: the lower LID's is kept.
        if client < me {
            tear_down(
                shared,
                &mut t,
                id,
                "the peer engine made its own link to this one before either existed; QPs that were facing it must be created again",
            );
            entry = None;
        }
    }
    let mut keep = false;
    let id = match (entry, ask) {
        (Some((id, token, Some(_), _)), _) => {
            drop(t);
            send(&stream, client, &Msg::LinkReply(LinkReply::Ok(token)), &[])?;
            id
        }
        (Some((id, token, None, Some(seg))), _) => {
            // Our pending link: the client takes it.
            t.busy.push(client);
            drop(t);
            let _busy = Busy {
                fabric,
                lid: client,
            };
            send(
                &stream,
                client,
                &Msg::LinkReply(LinkReply::Offer(token)),
                &[seg.as_fd(), page.as_fd()],
            )?;
            let peer_page = match recv(&stream, client, "DONE", 1)? {
                (Msg::Done, mut fds) if fds.len() == 1 => fds.pop().expect("one descriptor"),
                (m, _) => {
                    return Err(err(
                        client,
                        format_args!("the client sent {} for DONE", m.name()),
                    ));
                }
            };
            attached(shared, id, peer_page, trace_id)?;
            keep = true;
            id
        }
        (Some((id, ..)), _) => {
            // A pending entry without its segment: cannot be (it is kept while pending).
            drop(t);
            return Err(err(
                client,
                format_args!("link {} is in no usable state", id.index()),
            ));
        }
        (None, LinkAsk::Offer(token) | LinkAsk::OfferPending(token)) => {
            drop(t);
            let (seg, peer_page) = match (fds.pop(), fds.pop()) {
                (Some(p), Some(s)) if fds.is_empty() => (s, p),
                _ => {
                    return Err(err(
                        client,
                        "the client's LINK offer did not carry a segment and a page",
                    ));
                }
            };
            let id = up_link(
                shared,
                fabric,
                Agreed {
                    lid: client,
                    token,
                    identity,
                },
                LinkSegment::Received(seg),
                peer_page,
                trace_id,
            )
            .map_err(|e| {
                err(
                    client,
                    format_args!("the client's link segment is unusable: {e}"),
                )
            })?;
            send(
                &stream,
                client,
                &Msg::LinkReply(LinkReply::Ok(token)),
                &[page.as_fd()],
            )?;
            keep = true;
            id
        }
        (None, LinkAsk::Need) => {
            t.busy.push(client);
            drop(t);
            let _busy = Busy {
                fabric,
                lid: client,
            };
            let seg = link::create_link_segment(shared.link_slots, shared.huge_pages)?;
            let token = crate::cm::random_u64();
            send(
                &stream,
                client,
                &Msg::LinkReply(LinkReply::Offer(token)),
                &[seg.as_fd(), page.as_fd()],
            )?;
            let peer_page = match recv(&stream, client, "DONE", 1)? {
                (Msg::Done, mut fds) if fds.len() == 1 => fds.pop().expect("one descriptor"),
                (m, _) => {
                    return Err(err(
                        client,
                        format_args!("the client sent {} for DONE", m.name()),
                    ));
                }
            };
            let id = up_link(
                shared,
                fabric,
                Agreed {
                    lid: client,
                    token,
                    identity,
                },
                LinkSegment::Made(seg),
                peer_page,
                trace_id,
            )?;
            keep = true;
            id
        }
        (None, LinkAsk::Reuse(_)) => {
            drop(t);
            return send(&stream, client, &Msg::LinkReply(LinkReply::Unknown), &[]);
        }
    };
    if keep {
        // Up from now on (its socket is watched only once this exchange is over).
        let mut t = fabric.lock();
        if let Some(p) = t.peers.iter_mut().find(|p| p.id == id) {
            p.identity = Some(identity);
            p.segment = None;
        }
    }
    // The arenas. A link this exchange made is torn down if the exchange fails now: it
    // would have no socket to watch.
    let replied = serve_attach(shared, &stream, client, id);
    if replied.is_err() && keep {
        tear_down(
            shared,
            &mut fabric.lock(),
            id,
            "the peer failed half-way through the link's setup",
        );
        return replied;
    }
    if keep {
        let stream = Arc::new(stream);
        if let Some(p) = fabric.lock().peers.iter_mut().find(|p| p.id == id) {
            p.socket = Some(stream);
        }
        fabric.wake();
    }
    replied
}

/// The server's side of ATTACH: maps the client QP's arena, answers with the wanted QP's.
fn serve_attach(shared: &Arc<Device>, stream: &UnixStream, client: u16, id: LinkId) -> Result<()> {
    let (qpn, want, memfd, fd) = match recv(stream, client, "ATTACH", 1)? {
        (Msg::Attach { qpn, want, memfd }, mut fds) if fds.len() == 1 => (
            Qpn::new(qpn),
            Qpn::new(want),
            memfd,
            fds.pop().expect("one descriptor"),
        ),
        (m, _) => {
            return Err(err(
                client,
                format_args!("the client sent {} for ATTACH", m.name()),
            ));
        }
    };
    take_peer_arena(shared, id, qpn, fd, memfd).map_err(|e| {
        err(
            client,
            format_args!("the client QP's arena is unusable: {e}"),
        )
    })?;
    let pd = shared
        .engine
        .with(|e| e.qp_by_qpn(want).map(|q| q.proto.pd));
    match pd.map(|pdn| share_pd_arena(shared, pdn.get())) {
        Some(Ok((arena, memfd))) => send(
            stream,
            client,
            &Msg::AttachReply { found: true, memfd },
            &[arena.as_fd()],
        ),
        _ => send(
            stream,
            client,
            &Msg::AttachReply {
                found: false,
                memfd: false,
            },
            &[],
        ),
    }
}
