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
//! The pump is no thread: the engine that owns the port drives it
//! (`pump::Pumps`, a field of the engine). Every engine iteration first receives what
//! waits on the socket into the links' rings (one non-blocking `recvmmsg`), runs as over
//! any link, and last sends what it published (`sendmmsg`); a post that runs the engine
//! directly (inline mode, or a poll-mode engine stepped back for a busy-polling
//! application) sends its datagram before it returns. So a packet crosses no thread, as in
//! a poll-mode NIC driver, and the application's thread is the engine on a machine with
//! few cores. When the engine sleeps, the port's **watcher** thread waits in `poll(2)` on
//! the socket and wakes it (`pump::watch`): an idle port costs no CPU.
//!
//! Why this shape rather than an enum of link kinds or a trait in the engine: the engine's
//! hot path (receive loop, `serve_active`, publish) is monomorphic over the shared-memory
//! `Link`; an enum would put a match on every `link.tx`/`link.rx` use, a trait a dynamic
//! or generic dispatch. Here the engine's packet code is the same for both kinds of link,
//! and a context without a UDP port pays one branch per iteration and per direct post.
//! The ring hop costs one 64-byte line copy each way per packet, small beside a system
//! call per burst and the datagram copy.
//!
//! Buffers: a receive buffer is reused only once the engine has consumed every frame
//! that refers to it (the pump reads the consumer's position off the ring before it
//! receives into a buffer again), so a payload reference never sees a newer datagram. The
//! pump receives only between engine iterations, on the engine's own thread, and an
//! iteration copies the payload of every frame it takes before it ends: a frame the ring
//! counts as consumed has had its payload copied. (With a pump thread of its own, the
//! ring's consumer position, published as frames are taken and before their payloads are
//! copied, let a stranger's datagrams overwrite a checked payload: found by a hostile
//! review; gone with the thread.)
//!
//! # Addressing
//!
//! One [`UdpPort`] per local address (it binds (address, 4791)); one link per peer
//! address on it, made by the first [`UdpPort::destination`] to that peer. Received
//! datagrams find their link by source IP address (RoCEv2 peers send from any source
//! port); within the link, the engine finds the QP by the BTH's destination QP as on any
//! link. Nothing else binds a datagram to a QP (see "Who can reach a QP" on
//! [`UdpPort`]). A [`Destination`] is the link and the peer's QPN, given to
//! `QpAttr::dest` at RTR as with shared-memory links.
//!
//! # Addressing and the IP header
//!
//! * [`gid_table`](crate::gid_table) lists this host's addresses as RoCEv2 GIDs;
//!   [`UdpPort::destination_gid`] names a peer by GID.
//! * A port's [`UdpPort::active_mtu`] (from its interface's MTU) caps its QPs' path MTU.
//! * A QP's `hop_limit` and `traffic_class` ([`QpAttr`](crate::QpAttr)) are the TTL and
//!   TOS of its datagrams, per datagram (`sendmmsg` control messages), and of the CNPs it
//!   sends. Its ECN bits are what `traffic_class` says (default 0: not ECN-capable, so
//!   routers drop rather than mark); the TOS of each received datagram is read
//!   (`IP_RECVTOS` / `IPV6_RECVTCLASS`) for its ECN bits.
//! * Each QP sends from its own UDP source port (from both QPNs, as Linux RoCE drivers
//!   derive it, so ECMP keeps a connection on one path and spreads connections): a socket
//!   per source port, made in the port's network namespace; where that port cannot be
//!   bound (taken, or the caller's thread is in another namespace), the port's own.
//! * The request packets a QP keeps unacknowledged are capped (`MAX_IN_FLIGHT`): a loss
//!   costs a go-back-N resend of at most that many datagrams.
//!
//! # What is not done (yet)
//!
//! * No reaction to CNPs (opcode 0x81: checked and counted in `cnps_received`): shmhca is
//!   a RoCEv2 congestion *notification point* (a QP that receives packets marked
//!   Congestion Experienced answers their sender with CNPs, at most one per 50 µs: see
//!   `pump`), not a *reaction point*. (Peers' IPv4 IDs other than 0 are solved for, and
//!   must follow on per peer QP or per link, learned only from packets with a PSN the QP
//!   takes as new, or be a retransmission of a packet refused for its ID: `ip_ids`; an
//!   invalid credit code lifts the credit limit; MigReq is ignored, as the
//!   receive path never looks at it.)
//! * Every request's Ack is a datagram of its own (RoCEv2 has no Ack riding in a
//!   request), so an RC round trip is four datagrams where a bare UDP ping-pong is two.

pub(crate) mod datagram;
pub(crate) mod gid;
pub(crate) mod ip_ids;
pub(crate) mod pump;
pub(crate) mod socket;

#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod review2_tests;
#[cfg(test)]
mod tests;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

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
    /// side's packets marked for congestion. Counted, not acted on (no reaction point).
    pub cnps_received: u64,
    /// Valid transport packets (ICRC checked) received marked Congestion Experienced (IP
    /// ECN bits `0b11`): a router between the peer and this side was congested.
    pub ce_marked_received: u64,
    /// Congestion Notification Packets sent (this side as the notification point): one to
    /// the sender of CE-marked packets, at most one per local QP per 50 µs.
    pub cnps_sent: u64,
    /// Received datagrams dropped because no link of this port has their source address.
    pub unknown_source_dropped: u64,
    /// Datagrams the kernel refused for good (e.g. `EMSGSIZE`: over the path MTU).
    pub send_dropped: u64,
    /// Packets the engine sent that could not be written as a datagram (a destination QP
    /// never registered, a payload outside the sending QP's memory).
    pub encode_dropped: u64,
}

/// A test hook on every datagram the pump sends: it may change the bytes, and says what
/// becomes of the datagram — the project's fault stage for the UDP link (this kernel has
/// no `netem`).
#[cfg(test)]
pub(crate) type DatagramHook = Box<dyn FnMut(&mut [u8]) -> Fate + Send>;

/// What a [`DatagramHook`] does with a datagram.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fate {
    /// Sent.
    Send,
    /// Lost.
    Drop,
    /// Sent twice (a duplicate right behind it).
    Twice,
    /// Sent after the next datagram (or at the pump's next round): reordered.
    Later,
}

#[cfg(test)]
impl Fate {
    /// `Send` if `keep`, else `Drop`.
    pub(crate) fn send_if(keep: bool) -> Fate {
        if keep { Fate::Send } else { Fate::Drop }
    }
}

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
///
/// # Who can reach a QP
///
/// As in RoCEv2, only a datagram's **source IP address** binds it to a QP: a datagram
/// from the address a QP's destination names, from *any* source port, whose BTH names the
/// QP, is that QP's packet. The ICRC is a checksum anyone can compute, not an
/// authenticator. What stands between a sender that can use the peer's address and the
/// QP is what stands on any RoCE fabric: the PSN the QP expects (24 bits; a request
/// elsewhere is dropped or Nak'd), and an R_Key for RDMA. (What the port learns of the
/// peer's IPv4 IDs moves only with packets whose PSN the QP takes as new: a spoofer that
/// does not know it cannot make the peer's own datagrams fail their ICRC for good.)
///
/// So for a peer on this host — a loopback address, or this host's own address when two
/// processes of one machine talk over RoCEv2 — **any local process of any user** can bind
/// the peer's address on another port and send into the QP; for a peer on a host several
/// users share, any of them can. Use RoCEv2 between hosts (and users) you trust, as a RoCE
/// fabric is, and shmhca's shared-memory links between processes of one machine (the
/// fabric checks a peer's user).
pub struct UdpPort {
    /// The context's device (a handle, as a `Pd` holds one).
    shared: Arc<crate::device::Device>,
    local: SocketAddr,
    /// The receive buffers' memory: every QP on this port's links reads payloads from it.
    rx_mem: Mem,
    /// The port's pump among the engine's (`Engine::udp`).
    pump: u32,
    /// What fits the bound address's interface MTU (`None`: unknown, e.g. a wildcard
    /// address).
    active_mtu: Option<crate::qp::Mtu>,
    /// The cap on request packets in flight of the QPs over this port's links
    /// ([`MAX_IN_FLIGHT`]; tests lower it).
    max_in_flight: u32,
    /// The page the engine and the watcher thread share (`pump::watch_page`).
    watch: Mem,
    /// Tells the watcher thread to end.
    stop: Arc<AtomicBool>,
    /// The links made so far, by peer address.
    links: std::sync::Mutex<Vec<(IpAddr, LinkId)>>,
    watcher: Option<std::thread::JoinHandle<()>>,
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
/// Receive buffers of a port whose socket takes GSO sends whole (`UDP_GRO`; 64 KiB each:
/// 4 MiB, as [`RX_BUFFERS`]).
const GRO_RX_BUFFERS: usize = 64;

/// The most request packets a QP over a UDP link keeps unacknowledged: a loss costs a
/// go-back-N resend of at most this many datagrams (256 KiB at path MTU 1024), and the
/// sender never has more in flight than the port's receive buffers (and the kernel's
/// socket buffer) could take at once.
pub(crate) const MAX_IN_FLIGHT: u32 = 64;

impl UdpPort {
    /// Binds `addr`, port 4791, for `ctx`: the engine drives the port from then on, and a
    /// watcher thread wakes it from sleep when a datagram arrives.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an address that is not one unicast address (the
    /// unspecified address, multicast, broadcast).
    /// [`Error::Io`] if the socket cannot be bound — when 4791 is taken on that address,
    /// the message names the likely holder ("rdma_rxe owns UDP 4791 on this host" where
    /// Linux soft-RoCE is loaded).
    pub fn bind(ctx: &Context, addr: IpAddr) -> Result<UdpPort> {
        Self::bind_addr(ctx, SocketAddr::new(addr, ROCEV2_PORT))
    }

    /// [`UdpPort::bind`] on any port (tests bind port 0 on loopback addresses; peers are
    /// then found at their own bound port, see [`UdpPort::destination_at`]).
    pub(crate) fn bind_addr(ctx: &Context, addr: SocketAddr) -> Result<UdpPort> {
        let ip = addr.ip();
        let broadcast = matches!(ip, IpAddr::V4(v4) if v4.is_broadcast());
        if ip.is_unspecified() || ip.is_multicast() || broadcast {
            return Err(Error::invalid(
                "UdpPort::bind",
                format!(
                    "{ip} is not one address of this host: a RoCEv2 port binds one unicast \
                     address (its GID; see shmhca::gid_table), since every packet's ICRC \
                     covers the source and destination addresses"
                ),
            ));
        }
        let shared = &ctx.shared;
        let sock = Arc::new(socket::UdpSocket::bind(addr)?);
        let active_mtu = gid::active_mtu_of(addr.ip());
        let local = sock.local_addr();
        let rx = if pump::gro_wanted(std::env::var_os("SHMHCA_UDP_GRO").as_deref())
            && sock.enable_gro()
        {
            socket::RxRing::with_buffers(GRO_RX_BUFFERS, socket::GRO_BUFFER_BYTES)
        } else {
            socket::RxRing::new(RX_BUFFERS)
        };
        let rx_mem = rx.mem().read_only();
        let watch = pump::watch_page();
        let stop = Arc::new(AtomicBool::new(false));
        let watcher = {
            let (sock, page, engine_page, stop) = (
                sock.clone(),
                watch.share(),
                shared.engine_page_mem.share(),
                stop.clone(),
            );
            std::thread::Builder::new()
                .name("shmhca-udp-watch".to_string())
                .spawn(move || pump::watch(&sock, &page, &engine_page, &stop))
                .map_err(|e| Error::io("starting the UDP port's watcher thread", e))?
        };
        let pump = pump::Pump::new(sock, rx, watch.share());
        let pump = shared.engine.with(|e| e.add_pump(pump));
        // A sleeping engine thread waits on the words it knew of when it went to sleep:
        // wake it, so that it watches this port's socket too.
        shared.kick();
        Ok(UdpPort {
            shared: shared.clone(),
            local,
            rx_mem,
            pump,
            active_mtu,
            max_in_flight: MAX_IN_FLIGHT,
            watch,
            stop,
            links: std::sync::Mutex::new(Vec::new()),
            watcher: Some(watcher),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The largest path MTU of a QP over this port: what fits the MTU of the interface of
    /// the bound address as RoCEv2 datagrams (1500 gives 1024, 9000 gives 4096; loopback
    /// 4096); `None` when it is not known (a wildcard address). A QP whose `path_mtu` is
    /// larger fails its RTR transition with a message saying so.
    pub fn active_mtu(&self) -> Option<crate::qp::Mtu> {
        self.active_mtu
    }

    /// The GID of the bound address (`::ffff:a.b.c.d` for IPv4): what a peer names this
    /// port by, as in [`gid_table`](crate::gid_table).
    pub fn gid(&self) -> shmhca_proto::roce::Gid {
        shmhca_proto::roce::Gid::from(self.local.ip())
    }

    /// [`UdpPort::destination`] towards the RoCEv2 endpoint named by `gid` (an IPv6
    /// address, or `::ffff:a.b.c.d`), as `ah_attr.grh.dgid` names it in verbs.
    ///
    /// # Errors
    /// As [`UdpPort::destination`].
    pub fn destination_gid(
        &self,
        qp: &Qp,
        gid: shmhca_proto::roce::Gid,
        qpn: Qpn,
    ) -> Result<Destination> {
        self.destination(qp, gid.ip(), qpn)
    }

    /// What the port counted so far.
    pub fn counters(&self) -> UdpCounters {
        self.shared
            .engine
            .with(|e| e.udp.get_mut(self.pump).map(|p| p.counters))
            .unwrap_or_default()
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
        let link = self.link_to(peer)?;
        let pump = self.pump;
        let rx_mem = &self.rx_mem;
        self.shared.engine.with(|e| {
            let arena = e
                .qp_by_qpn(qp.qpn())
                .map(|q| q.mem.read_only())
                .ok_or(Error::ForeignObject { what: "QP" })?;
            let live: Vec<Qpn> = e.qps().map(|q| q.proto.qpn).collect();
            if let Some(p) = e.udp.get_mut(pump) {
                p.add_qp(peer.ip(), qpn, qp.qpn(), arena, |q| live.contains(&q))
                    .map_err(|holder| {
                        Error::invalid(
                            "UdpPort::destination",
                            format!(
                                "remote QP {:#x} at {} is the destination of this \
                                 context's QP {:#x} already: an RC QP talks to one QP, \
                                 so destroy that one first (or connect to another \
                                 remote QP)",
                                qpn.get(),
                                peer.ip(),
                                holder.get()
                            ),
                        )
                    })?;
            }
            if let Some(l) = e.link_mut(link) {
                l.add_peer_qp(qpn, RX_ARENA_KEY, rx_mem.share());
            }
            Ok(Destination { link, qpn })
        })
    }

    /// The link to `peer`, made (with its end at the pump) if there is none yet. Making
    /// one first removes the links no QP uses any more (no route at the pump, no QP whose
    /// destination names it): a server whose clients name address after address keeps a
    /// link only per address a live QP talks to.
    fn link_to(&self, peer: SocketAddr) -> Result<LinkId> {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, id)) = links.iter().find(|(ip, _)| *ip == peer.ip()) {
            return Ok(*id);
        }
        let shared = &self.shared;
        let pump = self.pump;
        shared.engine.with(|e| {
            links.retain(|&(ip, id)| {
                let named = e
                    .qps()
                    .any(|q| q.proto.cfg.dest.is_some_and(|d| d.link == id));
                let Some(p) = e.udp.get_mut(pump) else {
                    return true;
                };
                if named || !p.link_unused(ip) {
                    return true;
                }
                p.remove_link(ip);
                e.remove_link(id);
                false
            });
        });
        let seg = link::create_link_segment(shared.link_slots, HugePages::Never)?;
        let theirs = link::open_link_segment(
            seg.try_clone_fd()
                .map_err(|e| Error::io("duplicating the link segment fd", e))?,
        )?;
        let engine_end = link::attach(&seg, Side::Creator)?;
        let pump_end = link::attach(&theirs, Side::Opener)?;
        // The engine drives the pump itself: the link's far end never sleeps, so the
        // engine wakes nobody after publishing on it (its "engine page" says so: zeroes).
        let mut l = Link::new(seg, engine_end, Mem::private(4096), (shared.id, 0));
        l.on_peer_loss = link::OnPeerLoss::FailNextRequest;
        l.max_mtu = self.active_mtu;
        l.max_in_flight = Some(self.max_in_flight);
        let (tx_end, rx_end) = pump::link_ends(peer, theirs, pump_end);
        let pump = self.pump;
        let id = shared.engine.with(|e| {
            if e.udp.get_mut(pump).is_none() {
                return Err(Error::Connect(
                    "the UDP port's pump is gone from the engine".to_string(),
                ));
            }
            let id = e.add_link(l)?;
            if let Some(p) = e.udp.get_mut(pump) {
                p.add_link(tx_end, rx_end);
            }
            Ok(id)
        })?;
        links.push((peer.ip(), id));
        // A sleeping engine thread waits on the kick words of the links it knew of.
        shared.kick();
        Ok(id)
    }

    /// Sets the cap on packets in flight of QPs over links made from now on (tests).
    #[cfg(test)]
    pub(crate) fn set_max_in_flight(&mut self, cap: u32) {
        self.max_in_flight = cap;
    }

    /// Runs `f` on this port's pump (tests); `None` if it is gone.
    #[cfg(test)]
    fn with_pump<R>(&self, f: impl FnOnce(&mut pump::Pump) -> R) -> Option<R> {
        let pump = self.pump;
        self.shared.engine.with(|e| e.udp.get_mut(pump).map(f))
    }

    /// Installs a hook the pump runs on every datagram it sends (tests: drop, corrupt).
    #[cfg(test)]
    pub(crate) fn set_hook(&self, hook: DatagramHook) {
        self.with_pump(|p| p.set_hook(hook));
    }

    /// The pump's source-port sockets open (tests).
    #[cfg(test)]
    pub(crate) fn source_sockets(&self) -> usize {
        self.with_pump(|p| p.source_sockets()).unwrap_or(0)
    }

    /// The links this port keeps (tests).
    #[cfg(test)]
    pub(crate) fn link_count(&self) -> usize {
        self.links.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Turns the pump's UDP GSO sends on or off (tests).
    #[cfg(test)]
    pub(crate) fn set_gso(&self, on: bool) {
        self.with_pump(|p| p.set_gso(on));
    }

    /// The pump's GSO sends of several datagrams so far (tests).
    #[cfg(test)]
    pub(crate) fn gso_sends(&self) -> u64 {
        self.with_pump(|p| p.gso_sends()).unwrap_or(0)
    }

    /// The pump's messages received whole that carried several datagrams, so far (tests).
    #[cfg(test)]
    pub(crate) fn merged_receives(&self) -> u64 {
        self.with_pump(|p| p.merged_receives()).unwrap_or(0)
    }

    /// The pump's receives that got fewer messages than they asked for, so far (tests).
    #[cfg(test)]
    pub(crate) fn overasked_receives(&self) -> u64 {
        self.with_pump(|p| p.overasked_receives()).unwrap_or(0)
    }
}

impl Drop for UdpPort {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        pump::nudge_watcher(&self.watch);
        // The watcher looks at the flag now, or within its socket wait (50 ms).
        if let Some(t) = self.watcher.take() {
            let _ = t.join();
        }
        let links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let pump = self.pump;
        self.shared.engine.with(|e| {
            // What the engine published on the port's links leaves first; the socket closes
            // with the pump; its counters stay in the engine's.
            if let Some(p) = e.udp.get_mut(pump) {
                p.send();
            }
            if let Some(p) = e.udp.remove(pump) {
                pump::add_counters(&mut e.res.stats, &p.counters);
            }
            for (ip, id) in links.iter() {
                let why = format!("the UDP port {} to {ip} was closed", self.local);
                e.link_down(*id, why);
            }
        });
    }
}
