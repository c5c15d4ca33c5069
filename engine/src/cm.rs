//! Connection setup between processes: the connection manager (CM).
//!
//! A service listens on a Unix-domain socket path ([`Context::listen`]); a client connects
//! to it ([`Context::connect`]). Over the socket the two exchange HELLO / REQ / REP / RTU
//! messages ([`msg`]) carrying what spec/03 and spec/04 say the connection managers
//! exchange — QPN, start PSN, PMTU, Local Ack Timeout, Target Ack Delay, Retry Count, RNR
//! Retry Count, minimum RNR NAK timer, end-to-end credit support, responder resources and
//! initiator depth, queue depths and up to 256 bytes of private data — pass the link
//! segment and the arenas with `SCM_RIGHTS`, and bring both QPs to RTS. Each side gets a
//! [`Connection`]: the ready [`Qp`] (it derefs to it) plus what the peer sent.
//!
//! ```text
//!   client                                   server
//!   connect(path) ───────────────────────▶  accept()        SO_PEERCRED checked both ways
//!                 ◀─────────────── HELLO    engine identity, protocol version
//!   QP → Init
//!   REQ ──────── [link fd, arena fd] ────▶                  (fds only for a new link)
//!                                           QP → Init → RTR
//!                 ◀───────── REP [arena fd]
//!   QP → RTR → RTS
//!   RTU ─────────────────────────────────▶  QP → RTS
//!        (the socket stays open: its hang-up tells the other side the peer is gone)
//! ```
//!
//! Parameters are negotiated as the IBA CM does: the PMTU is the smaller of the two
//! offers; a side's initiator depth never exceeds the other's responder resources; each
//! side's RNR Retry Count is the one its peer asks for (spec/03: "supplied by the remote
//! CA's CM"); a side's Local Ack Timeout is raised to cover the peer's Target Ack Delay.
//! A field out of range, or an offer this side cannot meet, is answered with a REJ whose
//! reason names it; both sides return [`Error::Connect`] saying what went wrong.
//!
//! # One link per pair of engines
//!
//! All connections between the same two engines share one link (the poll loop visits every
//! link on every iteration: 1,000 QPs between two processes cost one link). Each engine has
//! a random 64-bit identity ([`Context::engine_identity`]) that the server sends first; the
//! client reuses its link to that engine if it has one (the REQ names it by the token its
//! creator chose) or creates a new link segment. A link is torn down when the last of its
//! connections loses its peer and removed when the last [`Connection`] over it is dropped
//! ([`Context::cm_links`] shows them).
//!
//! # Peer death
//!
//! Each connection keeps its socket open for its life. A watcher thread per context blocks
//! in `poll(2)` on all of them; when a peer closes its connection or its process dies, the
//! engine first processes what the peer had already put on the link (its last Acks), then
//! the QP goes to the Error state — within milliseconds — and its work requests complete
//! with [`WcStatus::WrFlushErr`](crate::WcStatus::WrFlushErr); when it was the link's last
//! live connection the link is torn down. Dropping a [`Connection`] closes its socket, so
//! the peer sees the same. Nothing may be sent on the socket after setup: a peer that does
//! is treated as gone. A link the engine tears down by itself (a peer broke a ring) is never
//! reused for new connections.
//!
//! # Example
//!
//! ```
//! use shmhca::{Context, cm::ConnectParams, RecvWr, SendWr, SendOp, WcStatus, AccessFlags};
//! # fn main() -> shmhca::Result<()> {
//! let path = std::env::temp_dir().join(format!("shmhca-doc-{}.sock", std::process::id()));
//! let server = Context::builder().arena_size(1 << 20).build()?;
//! let listener = server.listen(&path)?;
//! let service = std::thread::spawn(move || -> shmhca::Result<Vec<u8>> {
//!     let (pd, mut cq) = (server.alloc_pd()?, server.create_cq(16)?);
//!     let buf = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
//!     let mut conn = listener.accept(&pd, &cq, &cq, &ConnectParams::default())?;
//!     conn.post_recv(&RecvWr::new(1, &[buf.sge(0, 64)?]))?;
//!     let mut wc = [Default::default(); 1];
//!     while cq.poll(&mut wc) == 0 {}
//!     assert_eq!(wc[0].status, WcStatus::Success);
//!     let mut got = vec![0; wc[0].byte_len as usize];
//!     buf.read_at(0, &mut got)?;
//!     Ok(got)
//! });
//!
//! let client = Context::builder().arena_size(1 << 20).build()?;
//! let (pd, mut cq) = (client.alloc_pd()?, client.create_cq(16)?);
//! let mut conn = client.connect(&path, &pd, &cq, &cq, &ConnectParams::default())?;
//! let msg = pd.alloc_mr(64, AccessFlags::NONE)?;
//! msg.write_at(0, b"hello")?;
//! conn.post_send(&SendWr::new(7, SendOp::Send, &[msg.sge(0, 5)?]))?;
//! let mut wc = [Default::default(); 1];
//! while cq.poll(&mut wc) == 0 {}
//! assert_eq!(wc[0].status, WcStatus::Success);
//! assert_eq!(service.join().unwrap()?, b"hello");
//! # Ok(())
//! # }
//! ```

pub mod msg;

pub(crate) mod links;
pub(crate) mod watch;

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shmhca_rings::fdpass::{recv_with_fds, send_with_fds};
use shmhca_rings::segment::{Access, Segment};

use crate::arena::{ARENA_KIND, ENGINE_PAGE_KIND, ENGINE_PAGE_LEN};
use crate::error::{Error, Result};
use crate::link::{self, Link, LinkId, Side};
use crate::mem::Mem;
use crate::qp::{AccessFlags, Destination, MAX_RD_ATOMIC, Mtu, QpAttr, QpCaps, QpState};
use crate::verbs::{Context, Cq, Pd, Qp, Shared};
use crate::wire::Qpn;
use links::{LinkEntry, LinkRef, Links, Plan};
use msg::{
    HEADER_LEN, Header, Hello, LinkMode, MAX_PRIVATE_DATA, Message, MsgError, Offer, Rej,
    RejectReason, Rep, Req,
};
use watch::{ConnStatus, Watched, Watcher};

/// 64 pseudo-random bits (identities, tokens, start PSNs; not for secrets).
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::hash::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// The connection manager's state of one context.
pub(crate) struct CmState {
    /// This engine's identity: the process id above a random nonce.
    pub(crate) identity: u64,
    pub(crate) links: Links,
    watcher: Mutex<Option<Arc<Watcher>>>,
}

impl CmState {
    pub(crate) fn new() -> CmState {
        CmState {
            identity: u64::from(std::process::id()) << 32 | (random_u64() & 0xffff_ffff),
            links: Links::default(),
            watcher: Mutex::new(None),
        }
    }

    /// The watcher of this context, started on first use.
    fn watcher(&self, shared: &Arc<Shared>) -> Result<Arc<Watcher>> {
        let mut w = self.watcher.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = w.as_ref() {
            return Ok(w.clone());
        }
        let started = Watcher::start(shared)?;
        *w = Some(started.clone());
        Ok(started)
    }
}

impl Drop for CmState {
    fn drop(&mut self) {
        if let Some(w) = self
            .watcher
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            w.stop();
        }
    }
}

/// Whom a side admits, judged by the peer's credentials on the socket (`SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PeerPolicy {
    /// Only processes running as this process's effective user (the default).
    #[default]
    SameUser,
    /// Any user that can open the socket (its file permissions still apply).
    AnyUser,
    /// Only processes of this user id.
    Uid(u32),
}

impl PeerPolicy {
    /// Whether a peer of user `uid` is admitted; if not, why.
    fn admit(self, uid: u32) -> std::result::Result<(), String> {
        let allowed = match self {
            PeerPolicy::AnyUser => return Ok(()),
            PeerPolicy::SameUser => rustix::process::geteuid().as_raw(),
            PeerPolicy::Uid(u) => u,
        };
        if uid == allowed {
            Ok(())
        } else {
            Err(format!(
                "the peer runs as uid {uid} but the peer policy ({self:?}) admits only uid {allowed}: run both as the same user or set the policy (PeerPolicy::Uid / PeerPolicy::AnyUser)"
            ))
        }
    }
}

/// The parameters one side brings to a connection. `Default` is sensible: default
/// [`QpCaps`], PMTU 4096, remote write, read and atomic access enabled on the QP, Local Ack
/// Timeout 14 (67 ms), Retry Count 7, RNR Retry Count 7 (forever), minimum RNR timer 12
/// (0.64 ms), 4 responder resources and initiator depth 4, a random start PSN, no private
/// data, a 5-second handshake timeout, and peers of the same user only.
///
/// ```
/// use shmhca::{cm::ConnectParams, Mtu, QpCaps};
/// let p = ConnectParams::default()
///     .mtu(Mtu::Mtu1024)
///     .caps(QpCaps { max_send_wr: 256, ..QpCaps::default() })
///     .private_data(&b"hello"[..]);
/// assert!(p.validate().is_ok());
/// assert!(ConnectParams::default().private_data(vec![0; 257]).validate().is_err());
/// ```
#[derive(Debug, Clone)]
pub struct ConnectParams {
    caps: QpCaps,
    mtu: Mtu,
    access: AccessFlags,
    local_ack_timeout: u8,
    target_ack_delay: u8,
    retry_count: u8,
    rnr_retry_count: u8,
    min_rnr_timer: u8,
    responder_resources: u8,
    initiator_depth: u8,
    start_psn: Option<u32>,
    private_data: Vec<u8>,
    handshake_timeout: Duration,
    peer_policy: PeerPolicy,
    max_peer_arena: u64,
}

/// The default largest peer arena a connection maps: 4 GiB.
pub const DEFAULT_MAX_PEER_ARENA: u64 = 4 << 30;

impl Default for ConnectParams {
    fn default() -> ConnectParams {
        ConnectParams {
            caps: QpCaps::default(),
            mtu: Mtu::Mtu4096,
            access: AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_ATOMIC,
            local_ack_timeout: 14,
            target_ack_delay: 0,
            retry_count: 7,
            rnr_retry_count: 7,
            min_rnr_timer: 12,
            responder_resources: 4,
            initiator_depth: 4,
            start_psn: None,
            private_data: Vec::new(),
            handshake_timeout: Duration::from_secs(5),
            peer_policy: PeerPolicy::SameUser,
            max_peer_arena: DEFAULT_MAX_PEER_ARENA,
        }
    }
}

impl ConnectParams {
    /// The largest arena this side maps of the peer's (default
    /// [`DEFAULT_MAX_PEER_ARENA`]): a peer that offers a larger one is refused with an error
    /// naming both sizes. A peer's arena is mapped read-only and never populated: it
    /// costs address space, not memory.
    pub fn max_peer_arena(mut self, bytes: u64) -> ConnectParams {
        self.max_peer_arena = bytes;
        self
    }

    /// The QP's queue capabilities.
    pub fn caps(mut self, caps: QpCaps) -> ConnectParams {
        self.caps = caps;
        self
    }

    /// The largest PMTU this side accepts; the connection uses the smaller of both sides'.
    pub fn mtu(mut self, mtu: Mtu) -> ConnectParams {
        self.mtu = mtu;
        self
    }

    /// The QP's remote access enables (what the peer may do to this side's memory
    /// regions, on top of each region's own access flags).
    pub fn access(mut self, access: AccessFlags) -> ConnectParams {
        self.access = access;
        self
    }

    /// Local Ack Timeout (0..=31): this side's transport timer is 4.096 µs × 2^value (0
    /// disables it). Raised if needed to exceed the peer's Target Ack Delay.
    pub fn local_ack_timeout(mut self, v: u8) -> ConnectParams {
        self.local_ack_timeout = v;
        self
    }

    /// Target Ack Delay (0..=31, same scale): the longest this side's engine may take to
    /// acknowledge a request — larger for an inline-mode engine whose application polls
    /// rarely. The peer's Local Ack Timeout is raised to cover it.
    pub fn target_ack_delay(mut self, v: u8) -> ConnectParams {
        self.target_ack_delay = v;
        self
    }

    /// Retry Count (0..=7) of this side's SQ Logic for timeouts and sequence errors.
    pub fn retry_count(mut self, v: u8) -> ConnectParams {
        self.retry_count = v;
        self
    }

    /// RNR Retry Count (0..=7, 7 = forever) the *peer* uses when this side answers with an
    /// RNR NAK (spec/03: supplied by the remote CA's CM).
    pub fn rnr_retry_count(mut self, v: u8) -> ConnectParams {
        self.rnr_retry_count = v;
        self
    }

    /// The RNR NAK timer code (0..=31) this side's RQ Logic sends.
    pub fn min_rnr_timer(mut self, v: u8) -> ConnectParams {
        self.min_rnr_timer = v;
        self
    }

    /// Responder resources (0..=16): RDMA Reads and Atomics from the peer this side
    /// serves at once. The peer's initiator depth is capped to it.
    pub fn responder_resources(mut self, v: u8) -> ConnectParams {
        self.responder_resources = v;
        self
    }

    /// Initiator depth (0..=16): RDMA Reads and Atomics this side has outstanding at once
    /// (capped to the peer's responder resources; 0 forbids posting them).
    pub fn initiator_depth(mut self, v: u8) -> ConnectParams {
        self.initiator_depth = v;
        self
    }

    /// The SQ start PSN (24 bits; default random).
    pub fn start_psn(mut self, psn: u32) -> ConnectParams {
        self.start_psn = Some(psn);
        self
    }

    /// Up to 256 bytes for the peer's application (e.g. a region's
    /// [`RemoteAddr::to_bytes`](crate::RemoteAddr::to_bytes)); it gets them from
    /// [`Connection::peer_private_data`].
    pub fn private_data(mut self, data: impl Into<Vec<u8>>) -> ConnectParams {
        self.private_data = data.into();
        self
    }

    /// How long the whole handshake may take (default 5 s): a peer that stops half-way is
    /// an error after this long, not a hang.
    pub fn handshake_timeout(mut self, t: Duration) -> ConnectParams {
        self.handshake_timeout = t;
        self
    }

    /// Whom [`Context::connect`] accepts as a server (default: the same user). A
    /// [`Listener`] has its own policy ([`Listener::set_peer_policy`]): the side that
    /// listens decides whom it admits.
    pub fn peer_policy(mut self, p: PeerPolicy) -> ConnectParams {
        self.peer_policy = p;
        self
    }

    /// Checks every parameter's range.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first parameter out of range.
    pub fn validate(&self) -> Result<()> {
        self.caps.validate()?;
        let small = |name: &'static str, v: u8, max: u8| {
            if v > max {
                Err(Error::invalid(
                    name,
                    format!("{v}; ConnectParams::{name} takes 0..={max}"),
                ))
            } else {
                Ok(())
            }
        };
        small("local_ack_timeout", self.local_ack_timeout, 31)?;
        small("target_ack_delay", self.target_ack_delay, 31)?;
        small("retry_count", self.retry_count, 7)?;
        small("rnr_retry_count", self.rnr_retry_count, 7)?;
        small("min_rnr_timer", self.min_rnr_timer, 31)?;
        small(
            "responder_resources",
            self.responder_resources,
            MAX_RD_ATOMIC,
        )?;
        small("initiator_depth", self.initiator_depth, MAX_RD_ATOMIC)?;
        if let Some(p) = self.start_psn.filter(|&p| p > 0xff_ffff) {
            return Err(Error::invalid(
                "start_psn",
                format!("{p:#x}; a PSN is 24 bits (0..=0xffffff)"),
            ));
        }
        if self.private_data.len() > MAX_PRIVATE_DATA {
            return Err(Error::invalid(
                "private_data",
                format!(
                    "{} bytes; a connection carries at most {MAX_PRIVATE_DATA} bytes of private data",
                    self.private_data.len()
                ),
            ));
        }
        if self.handshake_timeout.is_zero() {
            return Err(Error::invalid(
                "handshake_timeout",
                "zero; give the peer some time, e.g. a few seconds",
            ));
        }
        Ok(())
    }

    /// This side's offer, for a QP `qpn` starting at `psn`.
    fn offer(&self, qpn: Qpn, psn: u32) -> Offer {
        Offer {
            qpn: qpn.get(),
            start_psn: psn,
            pmtu: self.mtu.bytes() as u16,
            local_ack_timeout: self.local_ack_timeout,
            target_ack_delay: self.target_ack_delay,
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            min_rnr_timer: self.min_rnr_timer,
            credits: 1,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            max_send_wr: self.caps.max_send_wr,
            max_recv_wr: self.caps.max_recv_wr,
            max_send_sge: self.caps.max_send_sge,
            max_recv_sge: self.caps.max_recv_sge,
            max_inline_data: self.caps.max_inline_data,
        }
    }

    fn psn(&self) -> u32 {
        self.start_psn
            .unwrap_or_else(|| random_u64() as u32 & 0xff_ffff)
    }
}

/// This side's Local Ack Timeout, raised to exceed the peer's Target Ack Delay (0 stays 0:
/// no transport timer).
fn effective_timeout(own: u8, peer_ack_delay: u8) -> u8 {
    if own == 0 {
        0
    } else {
        own.max(peer_ack_delay.saturating_add(1)).min(31)
    }
}

/// What went wrong in a handshake, and what to tell the peer.
struct Fail {
    error: Error,
    /// A REJ to send before closing.
    reject: Option<RejectReason>,
    /// The peer closed the socket before sending a single byte (a probe, not a client).
    closed_before_start: bool,
}

impl Fail {
    /// An error the peer is not told about (it broke the connection, or rejected us).
    fn quiet(error: Error) -> Fail {
        Fail {
            error,
            reject: None,
            closed_before_start: false,
        }
    }

    /// An error answered with a REJ carrying the error's text.
    fn reject(reason: RejectReason, error: Error) -> Fail {
        Fail {
            error,
            reject: Some(reason),
            closed_before_start: false,
        }
    }
}

/// The socket during a handshake, with a deadline for the whole exchange.
struct Chan<'a> {
    stream: &'a UnixStream,
    path: &'a Path,
    /// "server" or "client": who is at the other end.
    peer: &'static str,
    deadline: Instant,
    timeout: Duration,
}

impl Chan<'_> {
    fn err(&self, what: impl std::fmt::Display) -> Error {
        Error::Connect(format!("{}: {what}", self.path.display()))
    }

    fn remaining(&self, waiting_for: &str) -> std::result::Result<Duration, Fail> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Fail::quiet(self.err(format_args!(
                "no {waiting_for} from the {} within {:?}: the peer stopped half-way (ConnectParams::handshake_timeout sets the limit)",
                self.peer, self.timeout
            ))));
        }
        Ok(left)
    }

    fn send(&self, m: &Message, fds: &[BorrowedFd<'_>]) -> std::result::Result<(), Fail> {
        let left = self.remaining("room to send")?;
        let _ = self.stream.set_write_timeout(Some(left));
        send_with_fds(self.stream, &m.encode(), fds).map_err(|e| {
            Fail::quiet(self.err(format_args!(
                "sending {} to the {}: {e}",
                m.name(),
                self.peer
            )))
        })
    }

    /// Sends a REJ, ignoring errors (the connection is being abandoned anyway).
    fn send_reject(&self, reason: RejectReason, text: String) {
        let _ = self.send(&Message::Rej(Rej { reason, text }), &[]);
    }

    fn read_exact(
        &self,
        buf: &mut [u8],
        what: &str,
        max_fds: usize,
        fds: &mut Vec<OwnedFd>,
        first: bool,
    ) -> std::result::Result<(), Fail> {
        let mut got = 0;
        while got < buf.len() {
            let left = self.remaining(what)?;
            let _ = self.stream.set_read_timeout(Some(left));
            match recv_with_fds(self.stream, &mut buf[got..], max_fds - fds.len()) {
                Ok((0, _)) => {
                    let mut f = Fail::quiet(self.err(format_args!(
                        "the {} closed the connection while this side waited for {what}",
                        self.peer
                    )));
                    f.closed_before_start = first && got == 0;
                    return Err(f);
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
                    ) => {}
                Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                    return Err(Fail::reject(
                        RejectReason::ProtocolError,
                        self.err(format_args!("the {} sent {what} with {e}", self.peer)),
                    ));
                }
                Err(e) => {
                    return Err(Fail::quiet(
                        self.err(format_args!("receiving {what} from the {}: {e}", self.peer)),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Receives one message and at most `max_fds` descriptors with it.
    fn recv(
        &self,
        what: &str,
        max_fds: usize,
    ) -> std::result::Result<(Message, Vec<OwnedFd>), Fail> {
        let mut fds = Vec::new();
        let mut hdr = [0u8; HEADER_LEN];
        self.read_exact(&mut hdr, what, max_fds, &mut fds, true)?;
        let malformed = |e: MsgError| {
            let reason = match e {
                MsgError::Version { .. } => RejectReason::UnsupportedVersion,
                _ => RejectReason::ProtocolError,
            };
            Fail::reject(
                reason,
                self.err(format_args!("malformed {what} from the {}: {e}", self.peer)),
            )
        };
        let h = Header::parse(&hdr).map_err(malformed)?;
        let mut body = vec![0u8; h.body_len as usize];
        self.read_exact(&mut body, what, max_fds, &mut fds, false)?;
        let m = Message::decode(h.msg_type, &body).map_err(malformed)?;
        Ok((m, fds))
    }

    /// The error for a message of the wrong type (a REJ is reported as the peer's
    /// rejection).
    fn unexpected(&self, expected: &str, got: Message) -> Fail {
        match got {
            Message::Rej(r) => Fail::quiet(self.err(format_args!(
                "the {} rejected the connection ({}): {}",
                self.peer, r.reason, r.text
            ))),
            m => Fail::reject(
                RejectReason::ProtocolError,
                self.err(format_args!(
                    "the {} sent {} where {expected} belongs",
                    self.peer,
                    m.name()
                )),
            ),
        }
    }

    /// Checks the peer's credentials against `policy`.
    fn check_peer(&self, policy: PeerPolicy) -> std::result::Result<PeerCred, Fail> {
        let cred = rustix::net::sockopt::socket_peercred(self.stream).map_err(|e| {
            Fail::quiet(self.err(format_args!(
                "reading the {}'s credentials (SO_PEERCRED): {e}",
                self.peer
            )))
        })?;
        let cred = PeerCred {
            pid: cred.pid.as_raw_pid() as u32,
            uid: cred.uid.as_raw(),
        };
        policy.admit(cred.uid).map_err(|why| {
            Fail::reject(
                RejectReason::PeerRefused,
                self.err(format_args!(
                    "refused the {} (pid {}): {why}",
                    self.peer, cred.pid
                )),
            )
        })?;
        Ok(cred)
    }
}

#[derive(Debug, Clone, Copy)]
struct PeerCred {
    pid: u32,
    uid: u32,
}

/// A link segment and the peer's engine page received or made for a new link.
fn new_link(
    shared: &Arc<Shared>,
    segment: Arc<Segment>,
    side: Side,
    peer_page: OwnedFd,
    peer_trace_id: u32,
) -> Result<LinkId> {
    let page = Segment::open(
        peer_page,
        ENGINE_PAGE_KIND,
        Access::ReadOnly,
        ENGINE_PAGE_LEN,
    )?;
    let ends = link::attach(&segment, side)?;
    let l = Link::new(
        segment,
        ends,
        Mem::from_segment(Arc::new(page)),
        (shared.id, peer_trace_id),
    );
    shared.engine.with(|e| e.add_link(l))
}

/// Takes the last of the `n` descriptors a REP must carry: the peer's arena.
fn one_arena(
    chan: &Chan<'_>,
    fds: &mut Vec<OwnedFd>,
    n: usize,
) -> std::result::Result<OwnedFd, Fail> {
    match fds.pop() {
        Some(fd) if fds.len() + 1 == n => Ok(fd),
        _ => Err(Fail::reject(
            RejectReason::ProtocolError,
            chan.err(format_args!(
                "the server's REP carried {} file descriptors instead of {n}",
                fds.len()
            )),
        )),
    }
}

/// A read-only descriptor of the arena of `pd`, to send to a peer.
fn share_arena(shared: &Arc<Shared>, pd: &Pd) -> Result<OwnedFd> {
    let pdn = pd.pdn;
    let seg = shared
        .engine
        .with(|e| e.res.pds.get(pdn).map(|a| a.segment().clone()))
        .ok_or(Error::ForeignObject {
            what: "the protection domain",
        })?;
    seg.share_fd()
        .map_err(|e| Error::io("sharing the protection domain's arena", e))
}

/// Records on link `id` that peer QP `qpn` sends from the arena behind `fd`: mapped
/// read-only (never populated, refused above `max` bytes) unless this link mapped that
/// arena already.
fn attach_peer_arena(
    shared: &Arc<Shared>,
    id: LinkId,
    qpn: u32,
    fd: OwnedFd,
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
    let arena = Segment::open(fd, ARENA_KIND, Access::ReadOnly, max)?;
    let mem = Mem::from_segment(Arc::new(arena));
    shared
        .engine
        .with(|e| e.link_mut(id).map(|l| l.add_peer_qp(qpn, key, mem)))
        .ok_or_else(|| Error::Connect("the link went down during connection setup".into()))
}

/// A finished handshake.
struct Established {
    qp: Qp,
    link: LinkRef,
    cred: PeerCred,
    peer_identity: u64,
    peer: Offer,
    peer_private_data: Vec<u8>,
}

/// Brings `qp` from Reset to Init.
fn to_init(qp: &mut Qp, params: &ConnectParams) -> Result<()> {
    qp.modify(&QpAttr::new(QpState::Init).access(params.access))
}

/// Brings `qp` from Init to RTR facing `peer` over `link`.
fn to_rtr(
    qp: &mut Qp,
    params: &ConnectParams,
    link: LinkId,
    peer: &Offer,
    mtu: Mtu,
    resp: u8,
) -> Result<()> {
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(mtu)
            .dest(Destination {
                link,
                qpn: Qpn::new(peer.qpn),
            })
            .rq_psn(peer.start_psn)
            .max_dest_rd_atomic(resp)
            .min_rnr_timer(params.min_rnr_timer)
            .remote_credits(peer.credits == 1),
    )
}

/// Brings `qp` from RTR to RTS.
fn to_rts(qp: &mut Qp, params: &ConnectParams, psn: u32, peer: &Offer, depth: u8) -> Result<()> {
    qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(psn)
            .timeout(effective_timeout(
                params.local_ack_timeout,
                peer.target_ack_delay,
            ))
            .retry_cnt(params.retry_count)
            .rnr_retry(peer.rnr_retry_count)
            .max_rd_atomic(depth),
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

/// Checks the server's REP against the REQ; returns the PMTU to use.
fn check_rep(
    chan: &Chan<'_>,
    params: &ConnectParams,
    rep: &Rep,
    token: u64,
) -> std::result::Result<Mtu, Fail> {
    if rep.link_token != token {
        return Err(Fail::reject(
            RejectReason::ProtocolError,
            chan.err("the server's REP names another link than the REQ"),
        ));
    }
    let invalid = |e: Error| {
        Fail::reject(
            RejectReason::InvalidParameter,
            chan.err(format_args!("the server's REP is invalid: {e}")),
        )
    };
    rep.offer.check().map_err(invalid)?;
    let mtu = Mtu::from_bytes(u32::from(rep.offer.pmtu)).map_err(invalid)?;
    if mtu > params.mtu {
        return Err(Fail::reject(
            RejectReason::Incompatible,
            chan.err(format_args!(
                "the server chose PMTU {} above the {} this side offered",
                mtu.bytes(),
                params.mtu.bytes()
            )),
        ));
    }
    if rep.offer.initiator_depth > params.responder_resources {
        return Err(Fail::reject(
            RejectReason::Incompatible,
            chan.err(format_args!(
                "the server's initiator depth {} exceeds the {} responder resources this side offered",
                rep.offer.initiator_depth, params.responder_resources
            )),
        ));
    }
    Ok(mtu)
}

fn client_handshake(
    shared: &Arc<Shared>,
    chan: &Chan<'_>,
    pd: &Pd,
    send_cq: &Cq,
    recv_cq: &Cq,
    params: &ConnectParams,
) -> std::result::Result<Established, Fail> {
    let cred = chan.check_peer(params.peer_policy)?;
    let hello = match chan.recv("HELLO (is it a shmhca listener?)", 0)? {
        (Message::Hello(h), _) => h,
        (m, _) => return Err(chan.unexpected("HELLO", m)),
    };
    let aborted = |e: Error| Fail::reject(RejectReason::Aborted, e);
    let mut qp = Qp::create(shared, pd, send_cq, recv_cq, params.caps).map_err(aborted)?;
    to_init(&mut qp, params).map_err(aborted)?;
    let psn = params.psn();
    let offer = params.offer(qp.qpn(), psn);
    let cm = &shared.cm;
    let mut force_new = false;
    let own_arena = share_arena(shared, pd).map_err(aborted)?;
    let (rep, link, mtu, peer_arena) = loop {
        let plan = cm
            .links
            .plan(&shared.engine, hello.identity, chan.deadline, force_new);
        let req = |link_mode, link_token| {
            Message::Req(Req {
                identity: cm.identity,
                trace_id: shared.id,
                link_mode,
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
                        let mtu = check_rep(chan, params, &rep, token)?;
                        let arena = one_arena(chan, &mut fds, 1)?;
                        break (rep, held, mtu, arena);
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
                let page = shared
                    .engine_page
                    .share_fd()
                    .map_err(|e| aborted(Error::io("sharing the engine page", e)))?;
                chan.send(
                    &req(LinkMode::New, token),
                    &[seg.as_fd(), page.as_fd(), own_arena.as_fd()],
                )?;
                let (rep, mut fds) = match chan.recv("REP", 2)? {
                    (Message::Rep(rep), fds) => (rep, fds),
                    (m, _) => return Err(chan.unexpected("REP", m)),
                };
                let mtu = check_rep(chan, params, &rep, token)?;
                let arena = one_arena(chan, &mut fds, 2)?;
                let Some(page) = fds.pop() else {
                    return Err(Fail::reject(
                        RejectReason::ProtocolError,
                        chan.err("the server's REP for a new link carried no engine page"),
                    ));
                };
                let id =
                    new_link(shared, seg, Side::Creator, page, hello.trace_id).map_err(|e| {
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
                break (rep, LinkRef::counted(shared, id), mtu, arena);
            }
        }
    };
    let depth = params.initiator_depth.min(rep.offer.responder_resources);
    let ready = (|| {
        attach_peer_arena(
            shared,
            link.id,
            rep.offer.qpn,
            peer_arena,
            params.max_peer_arena,
        )
        .map_err(|e| {
            Fail::reject(
                RejectReason::InvalidParameter,
                chan.err(format_args!("the server's arena is unusable: {e}")),
            )
        })?;
        to_rtr(
            &mut qp,
            params,
            link.id,
            &rep.offer,
            mtu,
            params.responder_resources,
        )
        .map_err(aborted)?;
        to_rts(&mut qp, params, psn, &rep.offer, depth).map_err(aborted)?;
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

fn server_handshake(
    shared: &Arc<Shared>,
    chan: &Chan<'_>,
    policy: PeerPolicy,
    pd: &Pd,
    send_cq: &Cq,
    recv_cq: &Cq,
    params: &ConnectParams,
) -> std::result::Result<Established, Fail> {
    let cred = chan.check_peer(policy)?;
    let cm = &shared.cm;
    // A failed send shows up below, as the client's REJ or hang-up when reading its REQ.
    let _ = chan.send(
        &Message::Hello(Hello {
            identity: cm.identity,
            trace_id: shared.id,
        }),
        &[],
    );
    let mut first = true;
    let (req, link, new, peer_arena) = loop {
        let (req, mut fds) = match chan.recv("REQ", 3) {
            Ok((Message::Req(r), fds)) => (r, fds),
            Ok((m, _)) => return Err(chan.unexpected("REQ", m)),
            Err(mut f) => {
                f.closed_before_start &= first;
                return Err(f);
            }
        };
        req.offer.check().map_err(|e| {
            Fail::reject(
                RejectReason::InvalidParameter,
                chan.err(format_args!("the client's REQ is invalid: {e}")),
            )
        })?;
        let protocol = |what: String| Fail::reject(RejectReason::ProtocolError, chan.err(what));
        let reuse_side = match req.link_mode {
            LinkMode::New => None,
            LinkMode::ReuseClientCreated => Some(Side::Opener),
            LinkMode::ReuseServerCreated => Some(Side::Creator),
        };
        match reuse_side {
            None => {
                let n = fds.len();
                let Ok([seg_fd, page, arena]) = <[OwnedFd; 3]>::try_from(std::mem::take(&mut fds))
                else {
                    return Err(protocol(format!(
                        "the client's REQ asks for a new link but carries {n} file descriptors instead of 3 (link segment, engine page, arena)"
                    )));
                };
                let bad = |e: Error| {
                    Fail::reject(
                        RejectReason::InvalidParameter,
                        chan.err(format_args!(
                            "the client's link segment or engine page is unusable: {e}"
                        )),
                    )
                };
                let seg = link::open_link_segment(seg_fd).map_err(bad)?;
                let id = new_link(shared, seg, Side::Opener, page, req.trace_id).map_err(bad)?;
                cm.links.opened(LinkEntry {
                    id,
                    peer: req.identity,
                    token: req.link_token,
                    side: Side::Opener,
                    peer_pid: cred.pid,
                    refs: 1,
                    live: 1,
                    up: true,
                });
                break (req, LinkRef::counted(shared, id), true, arena);
            }
            Some(side) => {
                let n = fds.len();
                let Ok([arena]) = <[OwnedFd; 1]>::try_from(std::mem::take(&mut fds)) else {
                    return Err(protocol(format!(
                        "the client's REQ reuses a link but carries {n} file descriptors instead of 1 (arena)"
                    )));
                };
                if let Some(id) =
                    cm.links
                        .reserve(&shared.engine, req.identity, req.link_token, side)
                {
                    break (req, LinkRef::counted(shared, id), false, arena);
                }
                if !first {
                    return Err(protocol(
                        "the client named an unknown link twice; it must send a new link after an unknown-link REJ"
                            .into(),
                    ));
                }
                first = false;
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
            }
        }
    };
    // Checked by `Offer::check` above; the error path cannot be taken.
    let mtu = Mtu::from_bytes(u32::from(req.offer.pmtu))
        .map_err(|e| Fail::reject(RejectReason::InvalidParameter, e))?
        .min(params.mtu);
    let resp = params.responder_resources.min(req.offer.initiator_depth);
    let depth = params.initiator_depth.min(req.offer.responder_resources);
    let no_resources = |e: Error| Fail::reject(RejectReason::NoResources, e);
    let mut qp = Qp::create(shared, pd, send_cq, recv_cq, params.caps).map_err(no_resources)?;
    let aborted = |e: Error| Fail::reject(RejectReason::Aborted, e);
    to_init(&mut qp, params).map_err(aborted)?;
    attach_peer_arena(
        shared,
        link.id,
        req.offer.qpn,
        peer_arena,
        params.max_peer_arena,
    )
    .map_err(|e| {
        Fail::reject(
            RejectReason::InvalidParameter,
            chan.err(format_args!("the client's arena is unusable: {e}")),
        )
    })?;
    to_rtr(&mut qp, params, link.id, &req.offer, mtu, resp).map_err(aborted)?;
    let psn = params.psn();
    let mut offer = params.offer(qp.qpn(), psn);
    offer.pmtu = mtu.bytes() as u16;
    offer.responder_resources = resp;
    offer.initiator_depth = depth;
    let rep = Message::Rep(Rep {
        link_token: req.link_token,
        offer,
        private_data: params.private_data.clone(),
    });
    let own_arena = share_arena(shared, pd).map_err(aborted)?;
    if new {
        let page = shared
            .engine_page
            .share_fd()
            .map_err(|e| aborted(Error::io("sharing the engine page", e)))?;
        chan.send(&rep, &[page.as_fd(), own_arena.as_fd()])?;
    } else {
        chan.send(&rep, &[own_arena.as_fd()])?;
    }
    match chan.recv("RTU", 0)? {
        (Message::Rtu, _) => {}
        (m, _) => return Err(chan.unexpected("RTU", m)),
    }
    to_rts(&mut qp, params, psn, &req.offer, depth).map_err(aborted)?;
    Ok(Established {
        qp,
        link,
        cred,
        peer_identity: req.identity,
        peer: req.offer,
        peer_private_data: req.private_data,
    })
}

/// Ends a handshake: on failure tells the peer why (when it should be told) and returns the
/// failure; on success watches the connection for the peer's hang-up.
fn finish(
    chan: &Chan<'_>,
    stream: &Arc<UnixStream>,
    watcher: Arc<Watcher>,
    result: std::result::Result<Established, Fail>,
) -> std::result::Result<Connection, Fail> {
    let est = match result {
        Ok(e) => e,
        Err(f) => {
            if let Some(reason) = f.reject {
                // The peer adds its own context; tell it just what went wrong.
                let text = f.error.to_string();
                let prefix = format!("connection setup: {}: ", chan.path.display());
                let text = text.strip_prefix(&prefix).unwrap_or(&text).to_string();
                chan.send_reject(reason, text);
            }
            return Err(f);
        }
    };
    let status = Arc::new(ConnStatus {
        live: est.link.live.clone(),
        why: Mutex::new(None),
    });
    let key = watcher.add(Watched {
        stream: stream.clone(),
        qpn: est.qp.qpn(),
        link: est.link.id,
        status: status.clone(),
    });
    Ok(Connection {
        qp: Some(est.qp),
        stream: stream.clone(),
        watcher,
        key,
        status,
        link: est.link,
        path: chan.path.to_path_buf(),
        cred: est.cred,
        peer_identity: est.peer_identity,
        peer: est.peer,
        peer_private_data: est.peer_private_data,
    })
}

/// Connects to the listener at `path` and returns a connection whose QP (in `pd`,
/// completing on `send_cq` / `recv_cq`) is in RTS. Same as [`Context::connect`].
///
/// # Errors
/// [`Error::InvalidArgument`] for parameters out of range (before anything is sent);
/// [`Error::Connect`] naming the problem for a wrong path, no listener, a peer that is not
/// shmhca, a refused peer (either way), incompatible or invalid parameters, a peer that
/// stops half-way (after the handshake timeout) or closes the socket;
/// [`Error::SegmentOpen`]/[`Error::SegmentCreate`] when a segment cannot be made or the
/// server's arena is unusable. Nothing is left behind on error.
pub fn connect(
    ctx: &Context,
    path: impl AsRef<Path>,
    pd: &Pd,
    send_cq: &Cq,
    recv_cq: &Cq,
    params: &ConnectParams,
) -> Result<Connection> {
    let path = path.as_ref();
    params.validate()?;
    let shared = &ctx.shared;
    let watcher = shared.cm.watcher(shared)?;
    let stream = Arc::new(UnixStream::connect(path).map_err(|e| connect_error(path, &e))?);
    let chan = Chan {
        stream: &stream,
        path,
        peer: "server",
        deadline: Instant::now() + params.handshake_timeout,
        timeout: params.handshake_timeout,
    };
    let result = client_handshake(shared, &chan, pd, send_cq, recv_cq, params);
    finish(&chan, &stream, watcher, result).map_err(|f| f.error)
}

/// The error of connecting to a socket path.
fn connect_error(path: &Path, e: &io::Error) -> Error {
    let p = path.display();
    Error::Connect(match e.kind() {
        io::ErrorKind::NotFound => {
            format!("{p}: no such socket ({e}): start the listener first, or check the path")
        }
        io::ErrorKind::ConnectionRefused
            if std::fs::symlink_metadata(path).is_ok_and(|m| !m.file_type().is_socket()) =>
        {
            format!("{p}: not a socket ({e}): pass the path a shmhca Listener is bound to")
        }
        io::ErrorKind::ConnectionRefused => format!(
            "{p}: nobody listens on this socket ({e}): the listener has exited; start it again"
        ),
        io::ErrorKind::PermissionDenied => {
            format!("{p}: permission denied ({e}): the socket belongs to another user")
        }
        _ => match e.raw_os_error() {
            Some(code) if code == rustix::io::Errno::NOTSOCK.raw_os_error() => {
                format!("{p}: not a socket ({e}): pass the path a shmhca Listener is bound to")
            }
            _ => format!("{p}: cannot connect ({e})"),
        },
    })
}

/// Binds and listens on `path`. The socket is made under a temporary name in the same
/// directory and hard-linked into place once it listens, so the path never exists without
/// accepting connections (a client that sees it is not refused), and `link(2)` never replaces
/// a file that appeared meanwhile. Falls back to binding `path` itself where that is not
/// possible (a temporary name too long for a socket address, a file system without links).
fn bind_in_place(path: &Path) -> Result<UnixListener> {
    let p = path.display();
    // Clients connect by this path, so it must fit a socket address itself.
    if let Err(e) = std::os::unix::net::SocketAddr::from_pathname(path) {
        return Err(Error::Connect(format!(
            "{p}: not usable as a Unix socket path ({e}); it must be shorter than 108 bytes"
        )));
    }
    let tmp = path.with_file_name(format!(".shmhca-{:016x}.sock", random_u64()));
    if let Ok(listener) = UnixListener::bind(&tmp) {
        let linked = std::fs::hard_link(&tmp, path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => return Ok(listener),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(Error::Connect(format!(
                    "{p}: another listener bound it just now ({e})"
                )));
            }
            Err(_) => {} // no hard links here: bind the path itself
        }
    }
    UnixListener::bind(path).map_err(|e| {
        Error::Connect(match e.kind() {
            io::ErrorKind::NotFound => format!("{p}: the directory does not exist ({e})"),
            io::ErrorKind::InvalidInput => format!(
                "{p}: not usable as a Unix socket path ({e}); it must be shorter than 108 bytes"
            ),
            io::ErrorKind::AddrInUse => format!("{p}: another listener bound it just now ({e})"),
            _ => format!("{p}: cannot listen ({e})"),
        })
    })
}

/// A listening socket: [`Listener::accept`] turns each client into a [`Connection`]. The
/// socket path is removed when the listener is dropped.
pub struct Listener {
    shared: Arc<Shared>,
    listener: UnixListener,
    path: PathBuf,
    /// Device and inode of the socket file this listener created.
    ino: (u64, u64),
    policy: PeerPolicy,
}

impl Listener {
    /// Listens on `path` (same as [`Context::listen`]). A stale socket file left by a
    /// process that died is replaced; a live listener's is not.
    ///
    /// # Errors
    /// [`Error::Connect`] if a live listener owns `path`, if `path` exists and is not a
    /// socket (it is never removed), if it is too long for a Unix socket (108 bytes) or its
    /// directory does not exist; [`Error::Io`] for other system errors.
    pub fn bind(ctx: &Context, path: impl AsRef<Path>) -> Result<Listener> {
        let path = path.as_ref().to_path_buf();
        let p = path.display();
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_socket() => match UnixStream::connect(&path) {
                Ok(_) => {
                    return Err(Error::Connect(format!(
                        "{p}: a live listener already owns this socket: use another path or stop that process"
                    )));
                }
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    // Stale: its listener is gone.
                    std::fs::remove_file(&path)
                        .map_err(|e| Error::io(format!("removing the stale socket {p}"), e))?;
                }
                Err(e) => return Err(Error::io(format!("probing the existing socket {p}"), e)),
            },
            Ok(_) => {
                return Err(Error::Connect(format!(
                    "{p} exists and is not a socket: refusing to replace it; choose another path"
                )));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("examining {p}"), e)),
        }
        let listener = bind_in_place(&path)?;
        let m = std::fs::symlink_metadata(&path)
            .map_err(|e| Error::io(format!("examining the new socket {p}"), e))?;
        Ok(Listener {
            shared: ctx.shared.clone(),
            listener,
            path,
            ino: (m.dev(), m.ino()),
            policy: PeerPolicy::SameUser,
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whom [`Listener::accept`] admits (default: the same user).
    pub fn peer_policy(&self) -> PeerPolicy {
        self.policy
    }

    /// Sets whom [`Listener::accept`] admits.
    pub fn set_peer_policy(&mut self, policy: PeerPolicy) {
        self.policy = policy;
    }

    /// Waits for a client and sets up a connection with it: its QP (in `pd`, completing on
    /// `send_cq` / `recv_cq`) is in RTS when this returns. Clients that connect and close
    /// without a word (such as [`Listener::bind`] probing whether a listener is alive) are
    /// skipped.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for parameters out of range; [`Error::Connect`] naming
    /// the problem when this client is refused, speaks garbage, offers invalid or
    /// incompatible parameters, or stops half-way (after the handshake timeout); the
    /// listener stays usable for the next client. Nothing is left behind on error.
    pub fn accept(
        &self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        params: &ConnectParams,
    ) -> Result<Connection> {
        self.accept_until(None, pd, send_cq, recv_cq, params)
    }

    /// [`Listener::accept`], giving up if no client arrives within `timeout`.
    ///
    /// # Errors
    /// As [`Listener::accept`], and [`Error::Connect`] when no client came in time.
    pub fn accept_timeout(
        &self,
        timeout: Duration,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        params: &ConnectParams,
    ) -> Result<Connection> {
        self.accept_until(Some(Instant::now() + timeout), pd, send_cq, recv_cq, params)
    }

    fn accept_until(
        &self,
        deadline: Option<Instant>,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        params: &ConnectParams,
    ) -> Result<Connection> {
        params.validate()?;
        let watcher = self.shared.cm.watcher(&self.shared)?;
        loop {
            if let Some(d) = deadline {
                self.wait_for_client(d)?;
            }
            let stream = loop {
                match self.listener.accept() {
                    Ok((s, _)) => break Arc::new(s),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        return Err(Error::io(
                            format!("accepting a client on {}", self.path.display()),
                            e,
                        ));
                    }
                }
            };
            let chan = Chan {
                stream: &stream,
                path: &self.path,
                peer: "client",
                deadline: Instant::now() + params.handshake_timeout,
                timeout: params.handshake_timeout,
            };
            let result = server_handshake(
                &self.shared,
                &chan,
                self.policy,
                pd,
                send_cq,
                recv_cq,
                params,
            );
            match finish(&chan, &stream, watcher.clone(), result) {
                Ok(c) => return Ok(c),
                Err(f) if f.closed_before_start => {}
                Err(f) => return Err(f.error),
            }
        }
    }

    /// Waits until a client is pending or `deadline` passes.
    fn wait_for_client(&self, deadline: Instant) -> Result<()> {
        use rustix::event::{PollFd, PollFlags};
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Connect(format!(
                    "{}: no client connected in time",
                    self.path.display()
                )));
            }
            let ts = rustix::time::Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: i64::from(left.subsec_nanos()),
            };
            let mut fds = [PollFd::new(&self.listener, PollFlags::IN)];
            match rustix::event::poll(&mut fds, Some(&ts)) {
                Ok(0) | Err(rustix::io::Errno::INTR) => {}
                Ok(_) => return Ok(()),
                Err(e) => return Err(Error::io("waiting for a client", e.into())),
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Remove the path only if it is still the socket this listener made.
        if let Ok(m) = std::fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == self.ino {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("path", &self.path)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// A connected QP and the socket that keeps the connection: the [`Qp`] is in RTS (it
/// derefs to it), the socket tells each side when the other goes away. Dropping it
/// destroys the QP and closes the socket; the peer's QP then goes to the Error state.
pub struct Connection {
    /// Present until drop.
    qp: Option<Qp>,
    stream: Arc<UnixStream>,
    watcher: Arc<Watcher>,
    key: u64,
    status: Arc<ConnStatus>,
    /// Dropped after the QP (fields drop after `Drop::drop`).
    link: LinkRef,
    path: PathBuf,
    cred: PeerCred,
    peer_identity: u64,
    peer: Offer,
    peer_private_data: Vec<u8>,
}

impl Connection {
    /// The QP.
    pub fn qp(&self) -> &Qp {
        self.qp
            .as_ref()
            .expect("the QP lives until the connection is dropped")
    }

    /// The QP, to post work requests or modify it.
    pub fn qp_mut(&mut self) -> &mut Qp {
        self.qp
            .as_mut()
            .expect("the QP lives until the connection is dropped")
    }

    /// The private data the peer sent (empty if none).
    pub fn peer_private_data(&self) -> &[u8] {
        &self.peer_private_data
    }

    /// The peer's process id (from `SO_PEERCRED`).
    pub fn peer_pid(&self) -> u32 {
        self.cred.pid
    }

    /// The peer's user id (from `SO_PEERCRED`).
    pub fn peer_uid(&self) -> u32 {
        self.cred.uid
    }

    /// The peer QP's number.
    pub fn peer_qpn(&self) -> Qpn {
        Qpn::new(self.peer.qpn)
    }

    /// The peer QP's queue capabilities (e.g. how many receives it can have posted).
    pub fn peer_caps(&self) -> QpCaps {
        self.peer.caps()
    }

    /// The peer engine's identity ([`Context::engine_identity`] over there).
    pub fn peer_engine(&self) -> u64 {
        self.peer_identity
    }

    /// The link the QP talks over (shared by every connection with the same peer engine).
    pub fn link(&self) -> LinkId {
        self.link.id
    }

    /// The socket path of the connection's listener.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the peer is still connected (false once it closed the connection or died;
    /// the QP is then in the Error state).
    pub fn is_peer_connected(&self) -> bool {
        if self.status.live.load(Ordering::Acquire) {
            return true;
        }
        // The watcher clears the flag while it holds the engine and moves the QP to Error;
        // taking the engine once waits for it to finish, so the QP's state agrees.
        self.link.shared.engine.with(|_| ());
        false
    }

    /// Why the peer is gone, once it is.
    pub fn peer_gone_reason(&self) -> Option<String> {
        self.status.gone_reason()
    }
}

impl std::ops::Deref for Connection {
    type Target = Qp;
    fn deref(&self) -> &Qp {
        self.qp()
    }
}

impl std::ops::DerefMut for Connection {
    fn deref_mut(&mut self) -> &mut Qp {
        self.qp_mut()
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Take in what the peer already put on the link and let the Acks for it leave (in
        // inline mode nobody else would run the engine): the peer then sees its last
        // messages acknowledged before it sees the connection close. A few bursts at most:
        // a peer that keeps sending cannot hold the drop up.
        let shared = &self.link.shared;
        for _ in 0..4 {
            if shared.engine.with(|e| e.poll(&shared.doorbell)) == 0 {
                break;
            }
        }
        drop(self.qp.take());
        self.watcher.remove(self.key);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        // `self.link` drops next: the link is torn down or removed if this was its last.
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("qp", &self.qp)
            .field("peer_pid", &self.cred.pid)
            .field("peer_qpn", &self.peer_qpn())
            .field("link", &self.link.id)
            .field("peer_connected", &self.is_peer_connected())
            .finish_non_exhaustive()
    }
}

/// A link of this context to a peer engine, as the connection manager counts it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LinkInfo {
    /// The link.
    pub id: LinkId,
    /// The peer engine's identity.
    pub peer_engine: u64,
    /// The peer's process id.
    pub peer_pid: u32,
    /// Connections over it not yet dropped.
    pub connections: u32,
    /// Connections over it whose peer is still there.
    pub live_connections: u32,
    /// False once torn down (its last live connection lost its peer); such a link is never
    /// reused and goes away when its last connection is dropped.
    pub up: bool,
}

impl Context {
    /// Listens for connections on the Unix socket `path` (see [`Listener::bind`]).
    ///
    /// # Errors
    /// See [`Listener::bind`].
    pub fn listen(&self, path: impl AsRef<Path>) -> Result<Listener> {
        Listener::bind(self, path)
    }

    /// Connects to the listener at `path` (see [`connect`]).
    ///
    /// # Errors
    /// See [`connect`].
    pub fn connect(
        &self,
        path: impl AsRef<Path>,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        params: &ConnectParams,
    ) -> Result<Connection> {
        connect(self, path, pd, send_cq, recv_cq, params)
    }

    /// This engine's identity in connection setup: the process id in the high 32 bits, a
    /// random nonce below.
    pub fn engine_identity(&self) -> u64 {
        self.shared.cm.identity
    }

    /// The links the connection manager made or accepted, with their connection counts.
    pub fn cm_links(&self) -> Vec<LinkInfo> {
        self.shared
            .cm
            .links
            .snapshot()
            .into_iter()
            .map(|e| LinkInfo {
                id: e.id,
                peer_engine: e.peer,
                peer_pid: e.peer_pid,
                connections: e.refs,
                live_connections: e.live,
                up: e.up,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EngineMode;
    use shmhca_rings::segment::HugePages;
    use std::io::Write;

    fn ctx() -> Context {
        Context::builder()
            .arena_size(4 << 20)
            .huge_pages(HugePages::Never)
            .mode(EngineMode::Inline)
            .build()
            .unwrap()
    }

    fn sock(tag: &str) -> PathBuf {
        let p =
            std::env::temp_dir().join(format!("shmhca-cm-unit-{tag}-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    fn read_msg(s: &UnixStream, max_fds: usize) -> (Message, Vec<OwnedFd>) {
        let chan = Chan {
            stream: s,
            path: Path::new("raw"),
            peer: "server",
            deadline: Instant::now() + Duration::from_secs(30),
            timeout: Duration::from_secs(30),
        };
        chan.recv("a message", max_fds)
            .map_err(|f| f.error)
            .unwrap()
    }

    #[test]
    fn a_client_that_stops_after_req_leaves_the_server_clean() {
        let server = ctx();
        let client = ctx();
        let path = sock("stop-after-req");
        let listener = server.listen(&path).unwrap();
        let (pd, cq) = (server.alloc_pd().unwrap(), server.create_cq(8).unwrap());
        let free = server.arena_free();
        let p = path.clone();
        let raw = std::thread::spawn(move || {
            // A client that does everything right up to the REQ, then goes quiet.
            let s = UnixStream::connect(&p).unwrap();
            let Message::Hello(_) = read_msg(&s, 0).0 else {
                panic!("no HELLO")
            };
            let seg = link::create_link_segment(64, HugePages::Never).unwrap();
            let offer = ConnectParams::default().offer(Qpn::new(0x1002), 5);
            let req = Message::Req(Req {
                identity: 0xabc,
                trace_id: 3,
                link_mode: LinkMode::New,
                link_token: 0x77,
                offer,
                private_data: vec![],
            });
            let client_pd = client.alloc_pd().unwrap();
            let arena = share_arena(&client.shared, &client_pd).unwrap();
            let page = client.shared.engine_page.share_fd().unwrap();
            send_with_fds(
                &s,
                &req.encode(),
                &[seg.as_fd(), page.as_fd(), arena.as_fd()],
            )
            .unwrap();
            let (rep, fds) = read_msg(&s, 2);
            assert!(matches!(rep, Message::Rep(_)), "{rep:?}");
            assert_eq!(
                fds.len(),
                2,
                "the server's engine page and arena travel with the REP"
            );
            std::thread::sleep(Duration::from_millis(600));
        });
        // While the server waits for the RTU, its link and QP exist.
        let err = listener
            .accept(
                &pd,
                &cq,
                &cq,
                &ConnectParams::default().handshake_timeout(Duration::from_millis(300)),
            )
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("no RTU") && msg.contains("stopped half-way"),
            "{msg}"
        );
        raw.join().unwrap();
        assert!(server.cm_links().is_empty());
        assert!(
            server
                .shared
                .engine
                .with(|e| e.link_mut(LinkId(0)).is_none()),
            "the link made from the REQ is removed from the engine"
        );
        assert_eq!(server.arena_free(), free, "the QP's staging is freed");
        drop(listener);
        assert!(!path.exists());
    }

    #[test]
    fn concurrent_connects_to_one_peer_make_one_link() {
        let server = ctx();
        let client = Arc::new(ctx());
        let path = sock("concurrent");
        let listener = server.listen(&path).unwrap();
        let (pd, cq) = (server.alloc_pd().unwrap(), server.create_cq(64).unwrap());
        let threads: Vec<_> = (0..6)
            .map(|_| {
                let (c, p) = (client.clone(), path.clone());
                std::thread::spawn(move || {
                    let (pd, cq) = (c.alloc_pd().unwrap(), c.create_cq(8).unwrap());
                    let conn = c
                        .connect(&p, &pd, &cq, &cq, &ConnectParams::default())
                        .unwrap();
                    (conn.link(), conn, pd, cq)
                })
            })
            .collect();
        let accepted: Vec<_> = (0..6)
            .map(|_| {
                listener
                    .accept(&pd, &cq, &cq, &ConnectParams::default())
                    .unwrap()
            })
            .collect();
        let made: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(
            made.iter().all(|m| m.0 == made[0].0),
            "one link on the client"
        );
        assert!(accepted.iter().all(|c| c.link() == accepted[0].link()));
        assert_eq!(client.cm_links().len(), 1, "{:?}", client.cm_links());
        assert_eq!(server.cm_links().len(), 1);
        assert_eq!(server.cm_links()[0].connections, 6);
        drop(made);
        drop(accepted);
        assert!(client.cm_links().is_empty() && server.cm_links().is_empty());
    }

    #[test]
    fn a_context_can_connect_to_its_own_listener() {
        let c = Arc::new(ctx());
        let path = sock("self");
        let listener = c.listen(&path).unwrap();
        let (c2, p) = (c.clone(), path.clone());
        let t = std::thread::spawn(move || {
            let (pd, cq) = (c2.alloc_pd().unwrap(), c2.create_cq(8).unwrap());
            let conn = c2
                .connect(&p, &pd, &cq, &cq, &ConnectParams::default())
                .unwrap();
            (conn, pd, cq)
        });
        let (pd, mut cq) = (c.alloc_pd().unwrap(), c.create_cq(8).unwrap());
        let mut a = listener
            .accept(&pd, &cq, &cq, &ConnectParams::default())
            .unwrap();
        let (mut b, bpd, mut bcq) = t.join().unwrap();
        assert_eq!(a.peer_engine(), c.engine_identity());
        assert_ne!(
            a.link(),
            b.link(),
            "each end of the segment is its own link"
        );
        // A second connection in the other direction reuses the pair.
        let (c3, p) = (c.clone(), path.clone());
        let t = std::thread::spawn(move || {
            let (pd, cq) = (c3.alloc_pd().unwrap(), c3.create_cq(8).unwrap());
            let conn = c3
                .connect(&p, &pd, &cq, &cq, &ConnectParams::default())
                .unwrap();
            (conn, pd, cq)
        });
        let a2 = listener
            .accept(&pd, &cq, &cq, &ConnectParams::default())
            .unwrap();
        let (b2, _pd2, _cq2) = t.join().unwrap();
        // Either end may serve either role: the same two links, crossed or not.
        let mut first = [a.link(), b.link()];
        let mut second = [a2.link(), b2.link()];
        first.sort();
        second.sort();
        assert_eq!(first, second, "no new link");
        assert_eq!(c.cm_links().len(), 2);
        // Traffic over the loop.
        let src = bpd.alloc_mr(64, AccessFlags::NONE).unwrap();
        let dst = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        src.write_at(0, b"to myself").unwrap();
        a.post_recv(&crate::RecvWr::new(1, &[dst.sge(0, 64).unwrap()]))
            .unwrap();
        b.post_send(&crate::SendWr::new(
            2,
            crate::SendOp::Send,
            &[src.sge(0, 9).unwrap()],
        ))
        .unwrap();
        let mut wc = [crate::WorkCompletion::default(); 1];
        let start = Instant::now();
        while cq.poll(&mut wc) == 0 {
            assert!(start.elapsed() < Duration::from_secs(30));
        }
        assert_eq!(
            (wc[0].status, wc[0].byte_len),
            (crate::WcStatus::Success, 9)
        );
        while bcq.poll(&mut wc) == 0 {
            assert!(start.elapsed() < Duration::from_secs(30));
        }
        let mut got = [0u8; 9];
        dst.read_at(0, &mut got).unwrap();
        assert_eq!(&got, b"to myself");
    }

    /// A connected pair of contexts in this process (the accept runs on a thread).
    fn connected(server: &Arc<Context>, client: &Context, path: &Path) -> (Connection, Connection) {
        let listener = server.listen(path).unwrap();
        let s = server.clone();
        let t = std::thread::spawn(move || {
            let (pd, cq) = (s.alloc_pd().unwrap(), s.create_cq(8).unwrap());
            listener
                .accept(&pd, &cq, &cq, &ConnectParams::default())
                .unwrap()
        });
        let (pd, cq) = (client.alloc_pd().unwrap(), client.create_cq(8).unwrap());
        let c = client
            .connect(path, &pd, &cq, &cq, &ConnectParams::default())
            .unwrap();
        (t.join().unwrap(), c)
    }

    fn eventually(what: &str, f: impl Fn() -> bool) {
        let start = Instant::now();
        while !f() {
            assert!(start.elapsed() < Duration::from_secs(30), "never: {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn bytes_after_setup_end_the_connection_on_both_sides() {
        let server = Arc::new(ctx());
        let client = ctx();
        let (s, c) = connected(&server, &client, &sock("late-bytes"));
        (&*c.stream).write_all(b"surprise").unwrap();
        eventually("the server drops the connection", || !s.is_peer_connected());
        let why = s.peer_gone_reason().unwrap();
        assert!(
            why.contains("sent data on the connection socket after setup"),
            "{why}"
        );
        assert_eq!(s.state(), QpState::Error);
        eventually("the client sees the server close it", || {
            !c.is_peer_connected()
        });
        assert_eq!(c.state(), QpState::Error);
    }

    #[test]
    fn a_link_the_engine_tore_down_is_not_reused() {
        let server = Arc::new(ctx());
        let client = ctx();
        let path = sock("broken-link");
        let (s1, c1) = connected(&server, &client, &path);
        // The engine finds the peer broke a ring: the link is down in the engine only.
        client
            .shared
            .engine
            .with(|e| e.link_down(c1.link(), "a ring index out of range".into()));
        let (s2, c2) = connected(&server, &client, &path);
        assert_ne!(c2.link(), c1.link(), "a new link, not the broken one");
        assert_ne!(s2.link(), s1.link());
        assert_eq!(c2.state(), QpState::Rts);
        let links = client.cm_links();
        assert_eq!(links.len(), 2);
        assert!(links.iter().any(|l| l.id == c1.link() && !l.up));
    }

    #[test]
    fn poll_mode_engines_connect_exchange_and_see_a_close() {
        let poll = || {
            Arc::new(
                Context::builder()
                    .arena_size(4 << 20)
                    .huge_pages(HugePages::Never)
                    .mode(EngineMode::Poll { cpu: None })
                    .idle(crate::IdlePolicy::Backoff {
                        spins: 100,
                        max_sleep: Duration::from_micros(200),
                    })
                    .build()
                    .unwrap(),
            )
        };
        let (server, client) = (poll(), poll());
        let path = sock("poll-mode");
        let listener = server.listen(&path).unwrap();
        let s2 = server.clone();
        let t = std::thread::spawn(move || {
            let (pd, mut cq) = (s2.alloc_pd().unwrap(), s2.create_cq(8).unwrap());
            let mut conn = listener
                .accept(&pd, &cq, &cq, &ConnectParams::default())
                .unwrap();
            let buf = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
            conn.post_recv(&crate::RecvWr::new(1, &[buf.sge(0, 64).unwrap()]))
                .unwrap();
            conn.post_recv(&crate::RecvWr::new(2, &[buf.sge(0, 64).unwrap()]))
                .unwrap();
            let mut wc = [crate::WorkCompletion::default(); 2];
            let start = Instant::now();
            let mut n = 0;
            // The first receive gets the message; the second is flushed when the client
            // closes the connection.
            while n < 2 {
                n += cq.poll(&mut wc[n..]);
                assert!(start.elapsed() < Duration::from_secs(30), "{wc:?}");
            }
            assert_eq!((wc[0].wr_id, wc[0].status), (1, crate::WcStatus::Success));
            assert_eq!(
                (wc[1].wr_id, wc[1].status),
                (2, crate::WcStatus::WrFlushErr)
            );
            assert!(!conn.is_peer_connected());
            assert_eq!(conn.state(), QpState::Error);
        });
        let (pd, mut cq) = (client.alloc_pd().unwrap(), client.create_cq(8).unwrap());
        let mut conn = client
            .connect(&path, &pd, &cq, &cq, &ConnectParams::default())
            .unwrap();
        conn.post_send(&crate::SendWr::inline(7, crate::SendOp::Send, b"poll mode"))
            .unwrap();
        let mut wc = [crate::WorkCompletion::default(); 1];
        let start = Instant::now();
        while cq.poll(&mut wc) == 0 {
            assert!(start.elapsed() < Duration::from_secs(30));
        }
        assert_eq!(wc[0].status, crate::WcStatus::Success);
        drop(conn);
        t.join().unwrap();
        assert!(client.cm_links().is_empty());
    }
}
