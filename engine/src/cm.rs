//! Connection setup between processes: the connection manager (CM).
//!
//! A service listens on a Unix-domain socket path ([`Context::listen`]); a client connects
//! to it ([`Context::connect`]). Over the socket the two exchange HELLO / REQ / REP / RTU
//! messages ([`msg`]) carrying what spec/03 and spec/04 say the connection managers
//! exchange — QPN, start PSN, PMTU, Local Ack Timeout, Target Ack Delay, Retry Count, RNR
//! Retry Count, minimum RNR NAK timer, end-to-end credit support, responder resources and
//! initiator depth, queue depths and up to 256 bytes of private data — pass the link
//! segment and the arenas with `SCM_RIGHTS`, and bring both QPs to RTS. Each side gets a
//! [`Connection`]: the ready [`Qp`](crate::Qp) (it derefs to it) plus what the peer sent.
//!
//! ```text
//!   client                                   server
//!   connect(path) ───────────────────────▶  accept()        SO_PEERCRED checked both ways
//!                 ◀─────────────── HELLO    engine identity, protocol version
//!   QP → Init
//!   REQ ─── [link, engine page,] arena ──▶                  (link, page: new link only)
//!                                           QP → Init → RTR
//!                 ◀─ REP [engine page,] arena
//!   QP → RTR → RTS
//!   RTU ─────────────────────────────────▶  QP → RTS
//!        (the socket stays open: its hang-up tells the other side the peer is gone;
//!         each side's watcher sends a KEEPALIVE on it every KEEPALIVE_INTERVAL)
//! ```
//!
//! A QP may take its receives from a shared receive queue
//! ([`Listener::accept_with_srq`], [`Context::connect_with_srq`]; `rdma_create_qp` with
//! `qp_init_attr.srq`): its offer then says it reports no end-to-end credits, and the
//! peer's QP sends without waiting for them (spec/02).
//!
//! Parameters are negotiated as the IBA CM does: the PMTU is the smaller of the two
//! offers; a side's initiator depth never exceeds the other's responder resources; each
//! side's RNR Retry Count is the one its peer asks for (spec/03: "supplied by the remote
//! CA's CM"); a side's Local Ack Timeout is raised to cover the peer's Target Ack Delay.
//! A field out of range, or an offer this side cannot meet, is answered with a REJ whose
//! reason names it; both sides return [`Error::Connect`](crate::Error::Connect) saying
//! what went wrong. The negotiation is one pure function, the same for both sides.
//!
//! # Accepting
//!
//! A [`Listener`] never blocks on a client. Each client accepted gets a small state machine
//! (HELLO sent → REQ received, REP sent → RTU received) in the listener's table of
//! handshakes in progress; every accept call takes the clients pending on the socket and
//! advances each handshake whose client has sent something, waiting in `poll(2)` only up to
//! the caller's deadline ([`Listener::accept_timeout`], [`Listener::try_accept`]). A client
//! that stalls half-way stays in the table until its handshake timeout and costs the others
//! nothing; in inline mode the engine keeps running while an accept call waits, so the
//! context's other connections keep their peers acknowledged.
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
//! the peer sees the same. After setup only KEEPALIVEs may be sent on the socket: a peer that
//! sends anything else is treated as gone. A link the engine tears down by itself (a peer
//! broke a ring) is never reused for new connections.
//!
//! # Silent peers
//!
//! A peer whose process is stopped (SIGSTOP, a debugger) or hung keeps its socket open, so
//! its hang-up never comes. Each side's watcher sends a KEEPALIVE on every connection socket
//! every [`KEEPALIVE_INTERVAL`] whatever the traffic, and notes when the peer's last one
//! arrived: [`Connection::peer_silent_for`] says how long the peer has been quiet (a
//! receive-only side has no other way to tell a stopped peer from an idle one), and
//! [`ConnectParams::peer_silence_limit`] ends the connection as if the peer had hung up
//! once it stays silent that long.
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

//! # Modules
//!
//! [`msg`] is the wire format; `params` holds [`ConnectParams`] and the negotiation (one
//! pure function); `channel` reads and writes messages with deadlines; `handshake` holds the
//! client's and the server's halves; `listener` the server's socket and its handshakes in
//! progress; `connection` the result; `segments` maps what a peer hands over; `links`
//! counts links per peer engine; `watch` notices peers that go away.

pub mod msg;

mod channel;
mod connection;
mod handshake;
pub(crate) mod links;
mod listener;
mod params;
pub(crate) mod segments;
pub(crate) mod watch;

pub use connection::{Connection, LinkInfo, connect, connect_with_srq};
pub use listener::{Listener, MAX_HANDSHAKES, MAX_HANDSHAKES_PER_PEER};
pub use params::{ConnectParams, DEFAULT_MAX_PEER_ARENA, PeerPolicy};
pub use watch::KEEPALIVE_INTERVAL;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::verbs::{Context, Cq, Pd, Shared, Srq};
use links::Links;
use watch::Watcher;

/// 64 pseudo-random bits (identities, tokens, start PSNs; not for secrets).
pub(crate) fn random_u64() -> u64 {
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
    pub(crate) fn watcher(&self, shared: &Arc<Shared>) -> Result<Arc<Watcher>> {
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

    /// Connects to the listener at `path` with this side's QP on the shared receive queue
    /// `srq` (see [`connect_with_srq`] and [`Listener::accept_with_srq`]): the ibverbs
    /// program's `rdma_create_qp` with `qp_init_attr.srq` set.
    ///
    /// # Errors
    /// See [`connect_with_srq`].
    pub fn connect_with_srq(
        &self,
        path: impl AsRef<Path>,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: &Srq,
        params: &ConnectParams,
    ) -> Result<Connection> {
        connect_with_srq(self, path, pd, send_cq, recv_cq, srq, params)
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
mod tests;
