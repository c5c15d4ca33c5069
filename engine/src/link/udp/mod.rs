//! The UDP link: RoCEv2 datagrams (the IBA transport packet in UDP, port 4791, with its
//! ICRC) between engines on different machines.
//!
//! # Shape: a shared-memory link whose far end is a datagram pump
//!
//! From the engine's side a UDP link is a link like any other: a pair of line rings with a
//! `Link` at the engine's end. The protocol stages send through the same
//! `LinkTx` (the link's `TxBatch`), the receive step takes frames from the ring and runs
//! them through the same checks and stages. What is different is the far end: not a peer
//! engine but this module's **pump**, which owns the UDP socket of one local address and
//!
//! * takes each frame the engine published, writes it as a datagram — transport headers,
//!   the payload *read from the sending QP's arena* (inline, one range, or a gather list;
//!   no reference crosses a machine), pad, ICRC — and sends bursts with `sendmmsg`
//!   (`datagram::encode`; a riding Ack goes as a datagram of its own);
//! * receives bursts with `recvmmsg` into a ring of buffers (`socket::RxRing`), checks
//!   every datagram (length against the opcode's headers, pad, payload size, ICRC: a bad
//!   one is dropped and counted, never Nak'd — `datagram::decode`) and publishes it to
//!   the engine as a one-line frame whose payload is inline, or a reference into the
//!   receive buffer: that buffer memory is the "peer arena" of every QP on the link, so
//!   the engine copies a payload once, from the datagram's bytes into the application's
//!   buffer.
//!
//! The pump is two threads sharing the socket: the send half sleeps like an engine when
//! there is nothing to send (the engine wakes it through the link's kick word, as it wakes
//! a peer engine that may sleep), the receive half sleeps in `poll(2)` on the socket. An
//! idle port costs no CPU and adds no wake-up delay.
//!
//! Why this shape rather than an enum of link kinds or a trait in the engine: the engine's
//! hot path (receive loop, `serve_active`, publish) is monomorphic over the shared-memory
//! `Link`; an enum would put a match on every `link.tx`/`link.rx` use, a trait a dynamic
//! or generic dispatch, and either moves the shared-memory path's instruction counts. Here
//! the engine is not changed at all: the shared-memory path is byte-for-byte the same
//! code. The ring hop costs one 64-byte line copy each way per packet, small beside a
//! system call per burst and the datagram copy. The two halves (`pump::TxPump`,
//! `pump::RxPump`) are plain structs with a `step`, so an engine iteration could drive
//! them instead of threads (see "What is not done").
//!
//! Buffers: a receive buffer is reused only once the engine has consumed every frame
//! that refers to it (the pump reads the consumer's position off the ring before it
//! receives into a buffer again), so a payload reference never sees a newer datagram.
//!
//! # Addressing
//!
//! One [`UdpPort`] per local address (it binds (address, 4791)); one link per peer
//! address on it, made by the first [`UdpPort::destination`] to that peer. Received
//! datagrams find their link by source IP address (RoCEv2 peers send from any source
//! port); within the link, the engine finds the QP by the BTH's destination QP as on any
//! link. A [`Destination`] is the link and the peer's QPN, given to
//! `QpAttr::dest` at RTR as with shared-memory links.
//!
//! # What is not done (yet)
//!
//! * One source port (4791) for every QP: per-QP source ports for ECMP need a socket per
//!   port or a raw socket.
//! * No GID table, no MTU from the interface, no TTL/traffic class from the QP, no reaction
//!   to CNPs (opcode 0x81: checked and counted in `cnps_received`): issue 28's later items.
//!   (Peers' IPv4 IDs other than 0 are solved for; an invalid credit code lifts the credit
//!   limit; MigReq is ignored, as the receive path never looks at it.)
//! * The pump runs on two threads of its own, and they need a core when packets move: an
//!   application that spins on its CQ without yielding, on a machine with as many
//!   spinning threads as cores, holds off the pump for a scheduler time slice (measured:
//!   8 ms per round trip between two processes on 2 cores, 83 µs once the application
//!   yields between empty polls — see the `udp_pingpong` example). Driving the pump from
//!   the engine iteration (one branch per iteration where UDP links exist, and the engine
//!   thread sleeping on the socket too) would remove that, the ring hop and the thread
//!   hand-offs, at the price of that branch on the shared-memory path.

pub(crate) mod datagram;
pub(crate) mod pump;
pub(crate) mod socket;

#[cfg(test)]
mod tests;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;

use crate::error::{Error, Result};
use crate::link::{self, Link, Side};
use crate::mem::Mem;
use crate::{Context, Destination, LinkId, Qp, Qpn};
use shmhca_rings::segment::HugePages;

pub use socket::ROCEV2_PORT;

/// Counters of a [`UdpPort`] (a snapshot: [`UdpPort::counters`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UdpCounters {
    /// Datagrams handed to the kernel.
    pub datagrams_sent: u64,
    /// Datagrams received (good or bad).
    pub datagrams_received: u64,
    /// Received datagrams dropped because their ICRC did not check.
    pub icrc_dropped: u64,
    /// Received datagrams dropped as malformed: too short for their headers, pad or ICRC,
    /// an opcode this HCA does not implement, a payload over 4096 bytes, or truncated.
    pub malformed_dropped: u64,
    /// Congestion Notification Packets received (opcode 0x81, checked): a peer saw this
    /// side's packets marked for congestion. Counted, not yet acted on.
    pub cnps_received: u64,
    /// Received datagrams dropped because no link of this port has their source address.
    pub unknown_source_dropped: u64,
    /// Datagrams the kernel refused for good (e.g. `EMSGSIZE`: over the path MTU).
    pub send_dropped: u64,
    /// Packets the engine sent that could not be written as a datagram (a destination QP
    /// never registered, a payload outside the sending QP's memory).
    pub encode_dropped: u64,
}

/// The counters as the pump thread updates them.
#[derive(Debug, Default)]
pub(crate) struct SharedCounters {
    pub(crate) datagrams_sent: AtomicU64,
    pub(crate) datagrams_received: AtomicU64,
    pub(crate) icrc_dropped: AtomicU64,
    pub(crate) malformed_dropped: AtomicU64,
    pub(crate) cnps_received: AtomicU64,
    pub(crate) unknown_source_dropped: AtomicU64,
    pub(crate) send_dropped: AtomicU64,
    pub(crate) encode_dropped: AtomicU64,
}

impl SharedCounters {
    fn snapshot(&self) -> UdpCounters {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        UdpCounters {
            datagrams_sent: r(&self.datagrams_sent),
            datagrams_received: r(&self.datagrams_received),
            icrc_dropped: r(&self.icrc_dropped),
            malformed_dropped: r(&self.malformed_dropped),
            cnps_received: r(&self.cnps_received),
            unknown_source_dropped: r(&self.unknown_source_dropped),
            send_dropped: r(&self.send_dropped),
            encode_dropped: r(&self.encode_dropped),
        }
    }
}

/// A test hook on every datagram the pump sends: it may change the bytes; returning false
/// drops the datagram.
#[cfg(test)]
pub(crate) type DatagramHook = Box<dyn FnMut(&mut [u8]) -> bool + Send>;

/// A RoCEv2 endpoint of one context on one local address: the UDP socket bound to
/// (address, 4791), its pump thread, and one link per peer address.
///
/// Two contexts — here in one process, on loopback addresses; normally on two hosts —
/// connect a QP each over UDP:
///
/// ```no_run
/// use shmhca::*;
/// use std::net::IpAddr;
///
/// let a = Context::builder().mode(EngineMode::Inline).build()?;
/// let b = Context::builder().mode(EngineMode::Inline).build()?;
/// let (ip_a, ip_b): (IpAddr, IpAddr) = ("127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap());
/// let port_a = UdpPort::bind(&a, ip_a)?;
/// let port_b = UdpPort::bind(&b, ip_b)?;
/// let (pd_a, pd_b) = (a.alloc_pd()?, b.alloc_pd()?);
/// let (cq_a, cq_b) = (a.create_cq(64)?, b.create_cq(64)?);
/// let mut qa = a.create_qp(&pd_a, &cq_a, &cq_a, QpCaps::default())?;
/// let mut qb = b.create_qp(&pd_b, &cq_b, &cq_b, QpCaps::default())?;
/// // What the two sides exchange out of band (a TCP socket, a file): address and QPN.
/// let (na, nb) = (qa.qpn(), qb.qpn());
/// let dest_a = port_a.destination(&qa, ip_b, nb)?;
/// let dest_b = port_b.destination(&qb, ip_a, na)?;
/// for (qp, dest) in [(&mut qa, dest_a), (&mut qb, dest_b)] {
///     qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::REMOTE_WRITE))?;
///     qp.modify(&QpAttr::new(QpState::Rtr).path_mtu(Mtu::Mtu1024)
///         .dest(dest).rq_psn(0).max_dest_rd_atomic(1).min_rnr_timer(1))?;
///     qp.modify(&QpAttr::new(QpState::Rts).sq_psn(0).timeout(14)
///         .retry_cnt(7).rnr_retry(7).max_rd_atomic(1))?;
/// }
/// // From here on, post and poll as over any link.
/// # Ok::<(), shmhca::Error>(())
/// ```
///
/// Dropping the port stops its pump and takes its links down (their QPs fail their next
/// request, as when a peer vanishes).
pub struct UdpPort {
    /// The context's device (a handle, as a `Pd` holds one).
    shared: Arc<crate::device::Device>,
    local: SocketAddr,
    /// The receive buffers' memory: every QP on this port's links reads payloads from it.
    rx_mem: Mem,
    to_tx: mpsc::Sender<pump::TxCommand>,
    to_rx: mpsc::Sender<pump::RxEnd>,
    /// Wakes the send half (after a command).
    waker: pump::TxWaker,
    stop: Arc<AtomicBool>,
    counters: Arc<SharedCounters>,
    /// The links made so far, by peer address.
    links: std::sync::Mutex<Vec<(IpAddr, LinkId)>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for UdpPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdpPort")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

/// The key under which a UDP link's QPs find their "peer arena" (the receive buffers).
const RX_ARENA_KEY: (u64, u64) = (u64::MAX - 1, 4791);

/// Receive buffers of a port (4,160 bytes each: about 4 MiB).
const RX_BUFFERS: usize = 1024;

impl UdpPort {
    /// Binds `addr`, port 4791, for `ctx`, and starts the port's pump thread.
    ///
    /// # Errors
    /// [`Error::Io`] if the socket cannot be bound — when 4791 is taken on that address,
    /// the message names the likely holder ("rdma_rxe owns UDP 4791 on this host" where
    /// Linux soft-RoCE is loaded).
    pub fn bind(ctx: &Context, addr: IpAddr) -> Result<UdpPort> {
        Self::bind_addr(ctx, SocketAddr::new(addr, ROCEV2_PORT))
    }

    /// [`UdpPort::bind`] on any port (tests bind port 0 on loopback addresses; peers are
    /// then found at their own bound port, see [`UdpPort::destination_at`]).
    pub(crate) fn bind_addr(ctx: &Context, addr: SocketAddr) -> Result<UdpPort> {
        let sock = Arc::new(socket::UdpSocket::bind(addr)?);
        let local = sock.local_addr();
        let rx = socket::RxRing::new(RX_BUFFERS);
        let rx_mem = rx.mem().read_only();
        let (to_tx, tx_commands) = mpsc::channel();
        let (to_rx, rx_commands) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(SharedCounters::default());
        let waker = pump::TxWaker::new();
        let mut port = UdpPort {
            shared: ctx.shared.clone(),
            local,
            rx_mem,
            to_tx,
            to_rx,
            waker: waker.clone(),
            stop: stop.clone(),
            counters: counters.clone(),
            links: std::sync::Mutex::new(Vec::new()),
            threads: Vec::new(),
        };
        let mut tx = pump::TxPump::new(sock.clone(), tx_commands, counters.clone(), waker);
        let mut rx = pump::RxPump::new(sock, rx, rx_commands, counters);
        let spawn = |half: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(format!("shmhca-udp-{half}"))
                .spawn(f)
                .map_err(|e| Error::io("starting a UDP pump thread", e))
        };
        let stop_tx = stop.clone();
        port.threads
            .push(spawn("tx", Box::new(move || tx.run(&stop_tx)))?);
        port.threads
            .push(spawn("rx", Box::new(move || rx.run(&stop)))?);
        Ok(port)
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// What the port counted so far.
    pub fn counters(&self) -> UdpCounters {
        self.counters.snapshot()
    }

    /// The destination for `qp` (a QP of this port's context) towards QP `qpn` of the
    /// RoCEv2 endpoint at `peer` (port 4791): makes the link to `peer` if this port has
    /// none yet, and tells the pump which memory `qp`'s payloads are read from. Give it to
    /// [`QpAttr::dest`](crate::QpAttr::dest) at RTR.
    ///
    /// # Errors
    /// `qp` is not a QP of this port's context, or the link cannot be made (the context
    /// has as many links as it may have).
    pub fn destination(&self, qp: &Qp, peer: IpAddr, qpn: Qpn) -> Result<Destination> {
        self.destination_at(qp, SocketAddr::new(peer, ROCEV2_PORT), qpn)
    }

    /// [`UdpPort::destination`] towards a peer bound at another port than 4791 (tests).
    pub(crate) fn destination_at(
        &self,
        qp: &Qp,
        peer: SocketAddr,
        qpn: Qpn,
    ) -> Result<Destination> {
        let arena = self
            .shared
            .engine
            .with(|e| e.qp_by_qpn(qp.qpn()).map(|q| q.mem.read_only()))
            .ok_or(Error::ForeignObject { what: "QP" })?;
        let link = self.link_to(peer)?;
        self.shared.engine.with(|e| {
            if let Some(l) = e.link_mut(link) {
                l.add_peer_qp(qpn, RX_ARENA_KEY, self.rx_mem.share());
            }
        });
        self.command(pump::TxCommand::AddQp {
            peer: peer.ip(),
            remote: qpn,
            arena,
        })?;
        Ok(Destination { link, qpn })
    }

    /// The link to `peer`, made (with its end at the pump) if there is none yet.
    fn link_to(&self, peer: SocketAddr) -> Result<LinkId> {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, id)) = links.iter().find(|(ip, _)| *ip == peer.ip()) {
            return Ok(*id);
        }
        let shared = &self.shared;
        let seg = link::create_link_segment(shared.link_slots, HugePages::Never)?;
        let theirs = link::open_link_segment(
            seg.try_clone_fd()
                .map_err(|e| Error::io("duplicating the link segment fd", e))?,
        )?;
        let engine_end = link::attach(&seg, Side::Creator)?;
        let pump_end = link::attach(&theirs, Side::Opener)?;
        // The pump never sleeps on the link's kick word (it sleeps on its socket and looks
        // at the rings as it wakes), so its "engine page" says it never sleeps.
        // The send half sleeps like an engine when idle: its page says so, and the engine
        // wakes it after publishing on the link.
        let mut l = Link::new(seg, engine_end, self.waker.page.share(), (shared.id, 0));
        l.on_peer_loss = link::OnPeerLoss::FailNextRequest;
        let id = shared.engine.with(|e| e.add_link(l))?;
        let (tx_end, rx_end) =
            pump::link_ends(peer, theirs, pump_end, shared.engine_page_mem.share());
        let sent = self
            .to_rx
            .send(rx_end)
            .map_err(|_| Error::Connect("the UDP pump has stopped".to_string()))
            .and_then(|()| self.command(pump::TxCommand::AddLink(Box::new(tx_end))));
        if let Err(e) = sent {
            shared.engine.with(|e| e.remove_link(id));
            return Err(e);
        }
        links.push((peer.ip(), id));
        // A sleeping engine thread waits on the kick words of the links it knew of.
        shared.kick();
        Ok(id)
    }

    fn command(&self, c: pump::TxCommand) -> Result<()> {
        self.to_tx
            .send(c)
            .map_err(|_| Error::Connect("the UDP pump has stopped".to_string()))?;
        self.waker.wake();
        Ok(())
    }

    /// Installs a hook the pump runs on every datagram it sends (tests: drop, corrupt).
    #[cfg(test)]
    pub(crate) fn set_hook(&self, hook: DatagramHook) {
        let _ = self.command(pump::TxCommand::Hook(hook));
    }
}

impl Drop for UdpPort {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.waker.wake();
        // The send half wakes now; the receive half within its socket sleep (50 ms).
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        for (ip, id) in links.iter() {
            let why = format!("the UDP port {} to {ip} was closed", self.local);
            self.shared.engine.with(|e| e.link_down(*id, why));
        }
    }
}
