//! The two halves of the handshake: the client's ([`client_handshake`], blocking up to its
//! deadline, as [`connect`](super::connect) is) and the server's ([`ServerHandshake`], a
//! small state machine a [`Listener`](super::Listener) advances whenever its client has
//! sent something, so that no client can hold the server up).
//!
//! ```text
//!   server:  start ──HELLO──▶ Req ──REQ/REP──▶ Rtu ──RTU──▶ done
//!                              ▲ │ unknown link: REJ, once
//!                              └─┘
//! ```

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::channel::{Chan, Fail, MsgReader, PeerCred};
use super::links::{LinkEntry, LinkRef, Links, Plan};
use super::msg::{Hello, LinkMode, Message, Offer, Rej, RejectReason, Rep, Req};
use super::params::{Agreed, ConnectParams, OfferFrom, PeerPolicy, negotiate};
use super::random_u64;
use super::segments::{LinkSegment, attach_peer_arena, new_link, share_arena, share_engine_page};
use crate::device::Device;
use crate::error::Error;
use crate::link::{self, LinkId, OnPeerLoss, Side};
use crate::qp::{Destination, QpAttr, QpState};
use crate::verbs::{Cq, Pd, Qp, Srq};
use crate::wire::Qpn;

/// A finished handshake.
pub(super) struct Established {
    /// Dropped before `link`: no QP may ever point at a removed link.
    pub(super) qp: Qp,
    pub(super) link: LinkRef,
    pub(super) cred: PeerCred,
    pub(super) peer_identity: u64,
    pub(super) peer: Offer,
    pub(super) peer_private_data: Vec<u8>,
}

/// What a handshake makes its QP with: the caller's protection domain and completion
/// queues, and the shared receive queue it takes its receives from, if any
/// (`rdma_create_qp`'s `qp_init_attr.srq`).
#[derive(Clone, Copy)]
pub(super) struct QpSpec<'a> {
    pub(super) pd: &'a Pd,
    pub(super) send_cq: &'a Cq,
    pub(super) recv_cq: &'a Cq,
    pub(super) srq: Option<&'a Srq>,
}

impl QpSpec<'_> {
    /// Checks that the SRQ can serve a QP of this context and domain, before anything is
    /// sent (the other objects are checked when the QP is made, as `create_qp` does).
    ///
    /// # Errors
    /// [`Error::ForeignObject`] for an SRQ of another context, [`Error::InvalidArgument`]
    /// for one of another protection domain than `pd`.
    pub(super) fn check(&self, shared: &Arc<Device>) -> crate::Result<()> {
        let Some(srq) = self.srq else { return Ok(()) };
        if !Arc::ptr_eq(&srq.shared, shared) {
            return Err(Error::ForeignObject {
                what: "the shared receive queue",
            });
        }
        if srq.pdn != self.pd.pdn {
            return Err(Error::invalid(
                "shared receive queue",
                "an SRQ of another protection domain than the connection's: create the SRQ with the same Pd",
            ));
        }
        Ok(())
    }

    /// Makes the QP (in Reset).
    fn create(&self, shared: &Arc<Device>, params: &ConnectParams) -> crate::Result<Qp> {
        Qp::create_in(
            shared,
            self.pd,
            self.send_cq,
            self.recv_cq,
            self.srq,
            params.caps,
        )
    }

    /// This side's offer for its QP `qpn` starting at `psn`. A QP on an SRQ reports no
    /// end-to-end credits (its Acks carry the code 11111, spec/02), so the offer says so
    /// and the peer's SQ Logic does not wait for credits; its receive depth and scatter
    /// elements are the SRQ's.
    fn offer(&self, params: &ConnectParams, qpn: Qpn, psn: u32) -> Offer {
        let mut offer = params.offer(qpn, psn);
        if let Some(srq) = self.srq {
            offer.credits = 0;
            offer.max_recv_wr = srq.depth();
            offer.max_recv_sge = srq.max_sge;
        }
        offer
    }
}

/// Brings `qp` from Reset to Init.
fn to_init(qp: &mut Qp, params: &ConnectParams) -> crate::Result<()> {
    qp.modify(&QpAttr::new(QpState::Init).access(params.access))
}

/// Brings `qp` from Init to RTR facing the QP `peer` offered over `link`.
fn to_rtr(qp: &mut Qp, link: LinkId, peer: &Offer, agreed: &Agreed) -> crate::Result<()> {
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(agreed.mtu)
            .dest(Destination {
                link,
                qpn: Qpn::new(peer.qpn),
            })
            .rq_psn(peer.start_psn)
            .max_dest_rd_atomic(agreed.responder_resources)
            .min_rnr_timer(agreed.min_rnr_timer)
            .remote_credits(agreed.remote_credits),
    )
}

/// Brings `qp` from RTR to RTS, its send queue starting at `psn`.
fn to_rts(qp: &mut Qp, psn: u32, agreed: &Agreed) -> crate::Result<()> {
    qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(psn)
            .timeout(agreed.local_ack_timeout)
            .retry_cnt(agreed.retry_count)
            .rnr_retry(agreed.rnr_retry_count)
            .max_rd_atomic(agreed.initiator_depth),
    )
}

/// A link creation in progress ([`Plan::Create`]): ended by [`Creating::finish`], or by
/// dropping it (on any error).
struct Creating<'a> {
    links: &'a Links,
    peer: u64,
    done: bool,
}

impl Creating<'_> {
    /// Records the link made.
    fn finish(mut self, entry: LinkEntry) {
        self.done = true;
        self.links.created(entry);
    }
}

impl Drop for Creating<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.links.creation_failed(self.peer);
        }
    }
}

/// Checks the server's REP against the REQ and negotiates from it.
fn check_rep(
    chan: &Chan<'_>,
    params: &ConnectParams,
    rep: &Rep,
    token: u64,
) -> std::result::Result<Agreed, Fail> {
    if rep.link_token != token {
        return Err(Fail::reject(
            RejectReason::ProtocolError,
            chan.err("the server's REP names another link than the REQ"),
        ));
    }
    negotiate(params, &rep.offer, OfferFrom::Server)
        .map_err(|r| Fail::reject(r.reason, chan.err(r.text)))
}

/// Takes the last of the `n` descriptors a REP must carry: the server's arena.
fn one_arena(
    chan: &Chan<'_>,
    fds: &mut Vec<OwnedFd>,
    n: usize,
) -> std::result::Result<OwnedFd, Fail> {
    let got = fds.len();
    match fds.pop() {
        Some(fd) if got == n => Ok(fd),
        _ => Err(Fail::reject(
            RejectReason::ProtocolError,
            chan.err(format_args!(
                "the server's REP carried {got} file descriptors instead of {n}"
            )),
        )),
    }
}

/// The client's half: from the server's HELLO to the RTU sent.
pub(super) fn client_handshake(
    shared: &Arc<Device>,
    chan: &Chan<'_>,
    spec: QpSpec<'_>,
    params: &ConnectParams,
) -> std::result::Result<Established, Fail> {
    let cred = chan.check_peer(params.peer_policy)?;
    let hello = match chan.recv("HELLO (is it a shmhca listener?)", 0)? {
        (Message::Hello(h), _) => h,
        (m, _) => return Err(chan.unexpected("HELLO", m)),
    };
    let aborted = |e: Error| Fail::reject(RejectReason::Aborted, e);
    let mut qp = spec.create(shared, params).map_err(aborted)?;
    to_init(&mut qp, params).map_err(aborted)?;
    let psn = params.psn();
    let offer = spec.offer(params, qp.qpn(), psn);
    let cm = crate::cm::CmState::of(shared);
    let mut force_new = false;
    let (own_arena, own_layout) = share_arena(shared, spec.pd).map_err(aborted)?;
    let (rep, link, agreed, peer_arena) = loop {
        let plan = cm
            .links
            .plan(&shared.engine, hello.identity, chan.deadline, force_new);
        let req = |link_mode, link_token| {
            Message::Req(Req {
                identity: cm.identity,
                trace_id: shared.id,
                link_mode,
                arena_layout: own_layout,
                link_token,
                offer,
                private_data: params.private_data.clone(),
            })
        };
        match plan {
            Plan::Reuse { id, token, side } => {
                let held = LinkRef::counted(shared, id);
                // The connection manager's links are never loopback: this side holds the
                // creating or the opening end.
                let mode = if side == Side::Creator {
                    LinkMode::ReuseClientCreated
                } else {
                    LinkMode::ReuseServerCreated
                };
                chan.send(&req(mode, token), &[own_arena.as_fd()])?;
                match chan.recv("REP", 1)? {
                    (Message::Rep(rep), mut fds) => {
                        let agreed = check_rep(chan, params, &rep, token)?;
                        let arena = one_arena(chan, &mut fds, 1)?;
                        break (rep, held, agreed, arena);
                    }
                    (Message::Rej(r), _) if r.reason == RejectReason::UnknownLink => {
                        // The server dropped that link meanwhile: make a new one.
                        drop(held);
                        force_new = true;
                    }
                    (m, _) => return Err(chan.unexpected("REP", m)),
                }
            }
            Plan::Create => {
                // Until the link is recorded, dropping this ends the creation.
                let creating = Creating {
                    links: &cm.links,
                    peer: hello.identity,
                    done: false,
                };
                let seg = link::create_link_segment(shared.link_slots, shared.huge_pages)
                    .map_err(aborted)?;
                let token = random_u64();
                let page = share_engine_page(shared).map_err(aborted)?;
                chan.send(
                    &req(LinkMode::New, token),
                    &[seg.as_fd(), page.as_fd(), own_arena.as_fd()],
                )?;
                let (rep, mut fds) = match chan.recv("REP", 2)? {
                    (Message::Rep(rep), fds) => (rep, fds),
                    (m, _) => return Err(chan.unexpected("REP", m)),
                };
                let agreed = check_rep(chan, params, &rep, token)?;
                let arena = one_arena(chan, &mut fds, 2)?;
                let Some(page) = fds.pop() else {
                    return Err(Fail::reject(
                        RejectReason::ProtocolError,
                        chan.err("the server's REP for a new link carried no engine page"),
                    ));
                };
                let id = new_link(
                    shared,
                    LinkSegment::Made(seg),
                    Side::Creator,
                    page,
                    hello.trace_id,
                    OnPeerLoss::ErrorQps,
                )
                .map_err(|e| {
                    Fail::reject(
                        RejectReason::InvalidParameter,
                        chan.err(format_args!("the server's engine page is unusable: {e}")),
                    )
                })?;
                creating.finish(LinkEntry {
                    id,
                    peer: hello.identity,
                    token,
                    side: Side::Creator,
                    peer_pid: cred.pid,
                    refs: 1,
                    live: 1,
                    up: true,
                });
                break (rep, LinkRef::counted(shared, id), agreed, arena);
            }
        }
    };
    let ready = (|| {
        attach_peer_arena(
            shared,
            link.id,
            rep.offer.qpn,
            peer_arena,
            rep.arena_layout,
            params.max_peer_arena,
        )
        .map_err(|e| {
            Fail::reject(
                RejectReason::InvalidParameter,
                chan.err(format_args!("the server's arena is unusable: {e}")),
            )
        })?;
        to_rtr(&mut qp, link.id, &rep.offer, &agreed).map_err(aborted)?;
        to_rts(&mut qp, psn, &agreed).map_err(aborted)?;
        chan.send(&Message::Rtu, &[])
    })();
    if let Err(f) = ready {
        // The QP goes before its link: no QP may ever point at a removed link.
        drop(qp);
        drop(link);
        return Err(f);
    }
    Ok(Established {
        qp,
        link,
        cred,
        peer_identity: hello.identity,
        peer: rep.offer,
        peer_private_data: rep.private_data,
    })
}

/// A server's QP in RTR, its REP sent, waiting for the client's RTU.
struct AwaitingRtu {
    /// Dropped before `link`.
    qp: Qp,
    link: LinkRef,
    psn: u32,
    agreed: Agreed,
    req: Req,
}

/// Where a server's handshake stands.
enum Stage {
    /// HELLO sent, waiting for the REQ; `retried` once an unknown-link REJ was sent.
    Req { retried: bool },
    /// REP sent, waiting for the RTU.
    Rtu(Box<AwaitingRtu>),
}

/// A server's handshake with one client. Never blocks: [`ServerHandshake::advance`] takes
/// what the (non-blocking) socket holds and moves on as far as it allows.
pub(super) struct ServerHandshake {
    pub(super) stream: Arc<UnixStream>,
    deadline: Instant,
    timeout: Duration,
    cred: PeerCred,
    reader: MsgReader,
    stage: Stage,
}

impl ServerHandshake {
    /// Starts the handshake with a client just accepted: makes its socket non-blocking,
    /// checks its credentials against `policy` and sends the HELLO. The whole handshake must
    /// end within `timeout`.
    ///
    /// # Errors
    /// A [`Fail`] when the client is refused or the socket fails.
    pub(super) fn start(
        shared: &Device,
        stream: Arc<UnixStream>,
        path: &Path,
        policy: PeerPolicy,
        timeout: Duration,
    ) -> std::result::Result<ServerHandshake, Fail> {
        let hs = ServerHandshake {
            stream,
            deadline: Instant::now() + timeout,
            timeout,
            cred: PeerCred { pid: 0, uid: 0 },
            reader: MsgReader::new(true),
            stage: Stage::Req { retried: false },
        };
        let chan = hs.chan(path);
        hs.stream.set_nonblocking(true).map_err(|e| {
            Fail::quiet(chan.err(format_args!("making the client's socket non-blocking: {e}")))
        })?;
        let cred = chan.check_peer(policy)?;
        // A failed send shows up as the client's REJ or hang-up when reading its REQ.
        let _ = chan.send(
            &Message::Hello(Hello {
                identity: crate::cm::CmState::of(shared).identity,
                trace_id: shared.id,
            }),
            &[],
        );
        Ok(ServerHandshake { cred, ..hs })
    }

    /// The channel of this handshake (errors name `path`).
    pub(super) fn chan<'a>(&'a self, path: &'a Path) -> Chan<'a> {
        Chan {
            stream: &self.stream,
            path,
            peer: "client",
            deadline: self.deadline,
            timeout: self.timeout,
            drive: None,
        }
    }

    /// When the handshake must be done.
    pub(super) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The client's process id (SO_PEERCRED, read when its socket was accepted).
    pub(super) fn peer_pid(&self) -> u32 {
        self.cred.pid
    }

    /// When the handshake started (its socket was accepted).
    pub(super) fn started(&self) -> Instant {
        self.deadline
            .checked_sub(self.timeout)
            .unwrap_or(self.deadline)
    }

    /// Whether the client has not sent its REQ yet: it has cost this side nothing but a
    /// socket (no QP, no link), and is the first to go when a bound is hit.
    pub(super) fn awaits_req(&self) -> bool {
        matches!(self.stage, Stage::Req { .. })
    }

    /// What the handshake waits for.
    fn waiting_for(&self) -> &'static str {
        match self.stage {
            Stage::Req { .. } => "REQ",
            Stage::Rtu(_) => "RTU",
        }
    }

    /// Takes what the client has sent and moves on: `Some` once the connection is set up,
    /// `None` while waiting for the client to send more. A REQ is answered with a QP made as `spec`
    /// says, set up with `params` (those of the accept call
    /// that receives the REQ).
    ///
    /// # Errors
    /// A [`Fail`] when the client misbehaves, is refused, closes the socket or runs past the
    /// deadline, or this side cannot make the QP or link.
    pub(super) fn advance(
        &mut self,
        shared: &Arc<Device>,
        path: &Path,
        spec: QpSpec<'_>,
        params: &ConnectParams,
    ) -> std::result::Result<Option<Established>, Fail> {
        loop {
            let what = self.waiting_for();
            // A REQ brings the client's arena, and for a new link its link segment and engine
            // page too.
            let max_fds = if what == "REQ" { 3 } else { 0 };
            let stream = self.stream.clone();
            let chan = Chan {
                stream: &stream,
                path,
                peer: "client",
                deadline: self.deadline,
                timeout: self.timeout,
                drive: None,
            };
            let Some((m, fds)) = self.reader.advance(&chan, what, max_fds)? else {
                if Instant::now() >= self.deadline {
                    return Err(chan.late(what));
                }
                return Ok(None);
            };
            let stage = std::mem::replace(&mut self.stage, Stage::Req { retried: true });
            match (stage, m) {
                (Stage::Req { retried }, Message::Req(req)) => {
                    self.stage = self.on_req(shared, &chan, spec, params, req, fds, retried)?;
                }
                (Stage::Rtu(w), Message::Rtu) => {
                    let AwaitingRtu {
                        mut qp,
                        link,
                        psn,
                        agreed,
                        req,
                    } = *w;
                    if let Err(e) = to_rts(&mut qp, psn, &agreed) {
                        // The QP can also have gone to Error before the RTU was read: the
                        // client's first packets (sent once it was in RTS) broke the
                        // protocol. Say so rather than name the refused transition.
                        let e = if qp.state() == QpState::Error {
                            chan.err(
                                "the client's first packets were refused before its RTU was \
                                 read (the QP went to the Error state): the connection is dropped",
                            )
                        } else {
                            e
                        };
                        drop(qp);
                        drop(link);
                        return Err(Fail::reject(RejectReason::Aborted, e));
                    }
                    return Ok(Some(Established {
                        qp,
                        link,
                        cred: self.cred,
                        peer_identity: req.identity,
                        peer: req.offer,
                        peer_private_data: req.private_data,
                    }));
                }
                (stage, m) => {
                    let expected = match stage {
                        Stage::Req { .. } => "REQ",
                        Stage::Rtu(_) => "RTU",
                    };
                    // `stage` (a QP and link waiting for the RTU) drops here.
                    return Err(chan.unexpected(expected, m));
                }
            }
        }
    }

    /// Handles the client's REQ: finds or makes the link, makes the QP (to RTR) and sends
    /// the REP; or answers an unknown link with a REJ (once).
    #[allow(clippy::too_many_arguments)]
    fn on_req(
        &self,
        shared: &Arc<Device>,
        chan: &Chan<'_>,
        spec: QpSpec<'_>,
        params: &ConnectParams,
        req: Req,
        mut fds: Vec<OwnedFd>,
        retried: bool,
    ) -> std::result::Result<Stage, Fail> {
        let cm = crate::cm::CmState::of(shared);
        let agreed = negotiate(params, &req.offer, OfferFrom::Client)
            .map_err(|r| Fail::reject(r.reason, chan.err(r.text)))?;
        let protocol = |what: String| Fail::reject(RejectReason::ProtocolError, chan.err(what));
        let reuse_side = match req.link_mode {
            LinkMode::New => None,
            LinkMode::ReuseClientCreated => Some(Side::Opener),
            LinkMode::ReuseServerCreated => Some(Side::Creator),
        };
        let (link, new, peer_arena) = match reuse_side {
            None => {
                let n = fds.len();
                let Ok([seg_fd, page, arena]) = <[OwnedFd; 3]>::try_from(std::mem::take(&mut fds))
                else {
                    return Err(protocol(format!(
                        "the client's REQ asks for a new link but carries {n} file descriptors instead of 3 (link segment, engine page, arena)"
                    )));
                };
                let id = new_link(
                    shared,
                    LinkSegment::Received(seg_fd),
                    Side::Opener,
                    page,
                    req.trace_id,
                    OnPeerLoss::ErrorQps,
                )
                .map_err(|e| {
                    Fail::reject(
                        RejectReason::InvalidParameter,
                        chan.err(format_args!(
                            "the client's link segment or engine page is unusable: {e}"
                        )),
                    )
                })?;
                cm.links.opened(LinkEntry {
                    id,
                    peer: req.identity,
                    token: req.link_token,
                    side: Side::Opener,
                    peer_pid: self.cred.pid,
                    refs: 1,
                    live: 1,
                    up: true,
                });
                (LinkRef::counted(shared, id), true, arena)
            }
            Some(side) => {
                let n = fds.len();
                let Ok([arena]) = <[OwnedFd; 1]>::try_from(std::mem::take(&mut fds)) else {
                    return Err(protocol(format!(
                        "the client's REQ reuses a link but carries {n} file descriptors instead of 1 (arena)"
                    )));
                };
                let Some(id) = cm
                    .links
                    .reserve(&shared.engine, req.identity, req.link_token, side)
                else {
                    if retried {
                        return Err(protocol(
                            "the client named an unknown link twice; it must send a new link after an unknown-link REJ"
                                .into(),
                        ));
                    }
                    chan.send(
                        &Message::Rej(Rej {
                            reason: RejectReason::UnknownLink,
                            text: format!(
                                "no live link with token {:#x} to this client: send a new link",
                                req.link_token
                            ),
                        }),
                        &[],
                    )?;
                    return Ok(Stage::Req { retried: true });
                };
                (LinkRef::counted(shared, id), false, arena)
            }
        };
        let no_resources = |e: Error| Fail::reject(RejectReason::NoResources, e);
        let mut qp = spec.create(shared, params).map_err(no_resources)?;
        let aborted = |e: Error| Fail::reject(RejectReason::Aborted, e);
        let rtr = (|| {
            to_init(&mut qp, params).map_err(aborted)?;
            attach_peer_arena(
                shared,
                link.id,
                req.offer.qpn,
                peer_arena,
                req.arena_layout,
                params.max_peer_arena,
            )
            .map_err(|e| {
                Fail::reject(
                    RejectReason::InvalidParameter,
                    chan.err(format_args!("the client's arena is unusable: {e}")),
                )
            })?;
            to_rtr(&mut qp, link.id, &req.offer, &agreed).map_err(aborted)
        })();
        if let Err(f) = rtr {
            // The QP goes before its link.
            drop(qp);
            drop(link);
            return Err(f);
        }
        let psn = params.psn();
        let mut offer = spec.offer(params, qp.qpn(), psn);
        offer.pmtu = agreed.mtu.bytes() as u16;
        offer.responder_resources = agreed.responder_resources;
        offer.initiator_depth = agreed.initiator_depth;
        let fds = share_arena(shared, spec.pd).and_then(|(arena, layout)| {
            let fds = if new {
                vec![share_engine_page(shared)?, arena]
            } else {
                vec![arena]
            };
            Ok((fds, layout))
        });
        let sent = match fds {
            Ok((fds, arena_layout)) => {
                let rep = Message::Rep(Rep {
                    link_token: req.link_token,
                    arena_layout,
                    offer,
                    private_data: params.private_data.clone(),
                });
                let fds: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
                chan.send(&rep, &fds)
            }
            Err(e) => Err(aborted(e)),
        };
        let waiting = AwaitingRtu {
            qp,
            link,
            psn,
            agreed,
            req,
        };
        match sent {
            Ok(()) => Ok(Stage::Rtu(Box::new(waiting))),
            Err(f) => {
                drop(waiting);
                Err(f)
            }
        }
    }
}
