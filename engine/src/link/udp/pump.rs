//! The pump: the far end of a port's UDP links, driven by the engine that owns the port.
//!
//! * [`Pump::receive`] (at the start of every engine iteration) receives a burst
//!   (`recvmmsg`, non-blocking) into the receive-buffer ring, checks every datagram and
//!   publishes the good ones to their link's ring, where the same iteration takes them.
//! * [`Pump::send`] (after the iteration, or a direct post, published) takes the frames the
//!   engine published on each link, writes them as datagrams and sends them in bursts
//!   (`sendmmsg`).
//! * While the engine sleeps, a **watcher** thread ([`watch`]) waits in `poll(2)` on the
//!   socket and wakes the engine when a datagram arrives: the engine's sleep waits on
//!   futex words (its peers' kick words), which a socket cannot bump. The engine asks for
//!   a watch each time it goes to sleep ([`Pump::wait_on`]); the watcher bumps the kick word
//!   the sleep waits on. Because `poll(2)` is level-triggered, a datagram that arrived
//!   between the engine's last receive and its sleep is seen at once: no wake-up is lost.
//!   While the engine is awake the watcher waits on a futex word and costs nothing.
//!
//! So a packet crosses no thread on its way in or out: the engine that runs the protocol
//! makes the system calls, as a poll-mode NIC driver does.
//!
//! # Congestion notification (the RoCEv2 notification point)
//!
//! Every datagram is received with its IP TOS / traffic class ([`RxRing::tos`]). A valid
//! transport packet (its ICRC checked) for a local QP that arrives marked Congestion
//! Experienced (ECN bits `0b11`: a router on the way was congested) is counted
//! (`ce_marked_received`), and the receiving QP answers its sender with a Congestion
//! Notification Packet (`datagram::encode_cnp`): to the remote QP it talks to, from its
//! own source port, with its own TTL and traffic class — at most one per QP per
//! [`CNP_INTERVAL`] (`cnps_sent`). The time is the engine's clock, read once per receive
//! round that found a marked packet. shmhca is no *reaction point*: a CNP received is
//! counted (`cnps_received`) and nothing slows down, and it sets no ECN-capable codepoint
//! on what it sends (a QP's `traffic_class` may, and then its peer's routers may mark it).
//!
//! Safe code over [`super::socket`] and [`super::datagram`]; nothing is allocated per packet
//! (the buffers, the burst and the per-link bookkeeping are made with the port or link).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use rustix::thread::futex;
use shmhca_rings::lines::{Line, LinesConsumer, LinesProducer, MAX_FRAME_LINES, ShmLines};
use shmhca_rings::segment::Segment;

use super::UdpCounters;
use super::datagram::{self, DecodeError};
use super::ip_ids::IpIds;
use super::socket::{self, BURST, DGRAM_BYTES, IpOpts, RxRing, TxBurst, UdpSocket};
use crate::engine::wake;
use crate::link::LinkEnds;
use crate::mem::Mem;
use crate::psn::Psn;
use crate::timer::Clock;
use crate::wire::Qpn;
use crate::wire::slot::{PacketSlot, RxPacket};

/// The network namespace of the calling thread (the inode of its `ns/net`), if it can
/// be read.
pub(crate) fn thread_netns() -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/thread-self/ns/net")
        .ok()
        .map(|m| m.ino())
}

/// The most source-port sockets a port opens (one per distinct QP source port; beyond,
/// QPs send from the port's own socket).
const MAX_SENDERS: usize = 1024;
/// How long the watcher waits on the socket at a time before it looks at whether the
/// engine still sleeps (and at its stop flag).
const WATCH_POLL_MS: i32 = 50;
/// How long the watcher waits for a request at a time before it looks at its stop flag.
const WATCH_IDLE: Duration = Duration::from_millis(100);
/// In the watch page: the word the watcher bumps when the socket is readable while the
/// engine sleeps (the engine's sleep waits on it).
const WATCH_KICK: u64 = 0;
/// In the watch page: the word the engine bumps when it goes to sleep (a watch request).
const WATCH_REQUEST: u64 = 64;

/// The least time between two CNPs one local QP sends (as a notification point): a QP
/// that keeps receiving CE-marked packets sends one CNP, then none until this much later.
///
/// 50 µs is the notification point's interval of DCQCN (Zhu et al., "Congestion Control
/// for Large-Scale RDMA Deployments", SIGCOMM 2015: "at most one CNP every 50 µs per
/// flow"), which the reaction points of RoCE NICs are tuned to: their rate-increase timer
/// runs at a similar period (55 µs), so CNPs closer together tell them nothing more.
/// mlx5's `min_time_between_cnps` defaults to 4 µs, for a NIC that makes CNPs in hardware;
/// here each CNP is a datagram the engine writes and a share of a `sendmmsg`, so the
/// larger interval keeps a congested flow from costing a software link up to 250,000
/// extra datagrams a second per QP, while a congested sender still hears at the rate a
/// DCQCN reaction point needs.
pub(crate) const CNP_INTERVAL: Duration = Duration::from_micros(50);
const CNP_INTERVAL_NS: u64 = CNP_INTERVAL.as_nanos() as u64;

/// The send side's end of one link: the ring from the engine, and the arenas of the local
/// QPs that talk over it (by the remote QPN their packets carry).
pub(crate) struct TxEnd {
    addr: SocketAddr,
    from_engine: LinesConsumer<ShmLines>,
    /// The link segment (keeps it mapped).
    _segment: Mem,
    /// Per remote QP this link's packets go to: the local QP that talks to it.
    qps: Vec<Route>,
}

/// How the packets to one remote QP are sent: from which local QP, reading payloads from
/// which memory, with which IP header fields.
struct Route {
    remote: Qpn,
    local: Qpn,
    arena: Mem,
    opts: IpOpts,
    /// The socket its datagrams leave by (0: the port's; `k`: `TxPump::senders[k - 1]`),
    /// and the source address that gives them.
    via: u16,
    src: SocketAddr,
    /// When the local QP last sent a CNP (engine clock, ns; `None`: never).
    last_cnp: Option<u64>,
}

/// The receive side's end of one link: the ring to the engine.
pub(crate) struct RxEnd {
    addr: SocketAddr,
    to_engine: LinesProducer<ShmLines>,
    /// The link segment (keeps it mapped).
    _segment: Mem,
    /// Per frame published to the engine (by number, modulo the ring's capacity): the
    /// number of the datagram it came from, so that the pump knows which receive buffers
    /// the engine may still read.
    frame_dgram: Box<[u64]>,
    /// Frames published to the engine.
    pushed: u64,
    /// The IPv4 IDs the peer's QPs send, per local QP with a route on the link and the
    /// link's last (see `super::ip_ids`).
    ids: IpIds,
}

/// The pump's two ends of a link to `addr`: `ends`, attached to `segment` on the opener's
/// side.
pub(crate) fn link_ends(addr: SocketAddr, segment: Arc<Segment>, ends: LinkEnds) -> (TxEnd, RxEnd) {
    let segment = Mem::from_segment(segment);
    let cap = ends.tx.capacity();
    (
        TxEnd {
            addr,
            from_engine: ends.rx,
            _segment: segment.share(),
            qps: Vec::new(),
        },
        RxEnd {
            addr,
            to_engine: ends.tx,
            _segment: segment,
            frame_dgram: vec![0; cap].into_boxed_slice(),
            pushed: 0,
            ids: IpIds::default(),
        },
    )
}

impl TxEnd {
    fn route(&self, remote: Qpn) -> Option<&Route> {
        self.qps.iter().find(|r| r.remote == remote)
    }
}

impl RxEnd {
    /// Frames the engine has consumed (each frame to the engine is one line), and the
    /// ring's free lines; `None` if the engine broke the ring.
    fn consumed(&mut self) -> Option<(u64, usize)> {
        let cap = self.to_engine.capacity() as u64;
        let free = self.to_engine.free_lines().ok()?;
        Some((
            (self.to_engine.tail() + free as u64).saturating_sub(cap),
            free,
        ))
    }

    /// The oldest datagram a frame the engine has not consumed yet came from, if any.
    fn oldest_unconsumed(&mut self) -> Option<u64> {
        let (consumed, _) = self.consumed()?;
        if consumed >= self.pushed {
            return None;
        }
        let cap = self.frame_dgram.len() as u64;
        Some(self.frame_dgram[(consumed % cap) as usize])
    }
}

/// XORs `error` (an ICRC's error, 0 for none) into the ICRC ending `datagram`.
fn spoil_icrc(datagram: &mut [u8], error: u32) {
    if let Some(at) = datagram.len().checked_sub(4) {
        for (b, x) in datagram[at..].iter_mut().zip(error.to_le_bytes()) {
            *b ^= x;
        }
    }
}

fn bump(c: &mut u64, n: u64) {
    *c = c.wrapping_add(n);
}

/// The send side of a port's pump.
struct TxPump {
    tx: TxBurst,
    /// Where a frame the engine published is read to (made with the pump: a step clears
    /// no kilobyte of lines).
    lines: Option<Box<[Line; MAX_FRAME_LINES]>>,
    links: Vec<TxEnd>,
    /// Sockets bound to QPs' own source ports (ECMP entropy, as Linux RoCE drivers derive
    /// it), by port; a slot (`via - 1`) is emptied when no route and no staged datagram
    /// uses its socket any more ([`Pump::forget_qp`]), and reused.
    senders: Vec<Option<(u16, UdpSocket)>>,
    /// The arena of a packet with no route (its ICRC's check reads nothing from it).
    nomem: Mem,
    #[cfg(test)]
    hook: Option<super::DatagramHook>,
    /// A datagram the hook holds back (`Fate::Later`): its bytes, destination and options.
    #[cfg(test)]
    held: Option<(Vec<u8>, SocketAddr, IpOpts, u16)>,
    /// GSO sends of two datagrams or more that went (tests).
    #[cfg(test)]
    gso_sends: u64,
}

impl TxPump {
    /// Takes the frames the engine published on every link, writes them as datagrams and
    /// sends them in bursts; returns the frames taken. A burst the socket cannot take now
    /// stays staged, and the frames behind it stay in their rings (the engine sees a full
    /// link).
    fn step(&mut self, sock: &UdpSocket, counters: &mut UdpCounters) -> usize {
        #[cfg(test)]
        self.release_held();
        // Lent out for the step (the lines' slots are read while the pump stages).
        let mut lines = self
            .lines
            .take()
            .unwrap_or_else(|| Box::new([Line::ZERO; MAX_FRAME_LINES]));
        let mut moved = 0;
        let local = sock.local_addr();
        'links: for i in 0..self.links.len() {
            loop {
                // Room for a packet and the Ack that may ride in it.
                if self.tx.len() + 2 > BURST {
                    self.flush(sock, counters);
                    if self.tx.len() + 2 > BURST {
                        break 'links;
                    }
                }
                let n = match self.links[i].from_engine.recv(&mut lines) {
                    Ok(Some(n)) => n,
                    Ok(None) | Err(_) => break,
                };
                moved += 1;
                let slots: &[PacketSlot] = bytemuck::cast_slice(&lines[..n]);
                let remote = RxPacket::dest_qp(&slots[0]);
                let to = self.links[i].addr;
                let mut route = self.links[i].route(remote);
                let (opts, via, src) =
                    route.map_or((IpOpts::default(), 0, local), |r| (r.opts, r.via, r.src));
                // A riding Ack leaves as a datagram of its own, in the same send as its
                // carrier. With GSO the two go as one send (the longer first, as GSO
                // wants: the request, unless it is shorter than an Ack) and arrive
                // together. Without it the Ack goes first, so that a requester waiting
                // for it (a one-deep send queue) is free again when the request behind
                // it arrives, and answers with its own held Ack riding.
                let ack = datagram::carries_ack(&slots[0]);
                let ack_first = ack && !self.tx.gso();
                // A packet the fault stage corrupted (it stamped the ICRC of the packet
                // before) leaves with a bad ICRC — the error between the stamped ICRC and the
                // packet's now, never 0 for a flipped bit — and the receiver drops it, as it
                // drops a datagram corrupted on the wire. A riding Ack is corrupted with its
                // carrier (the stamped ICRC covers its word too), as over shared memory.
                let error =
                    crate::fault::icrc_error(slots, route.map_or(&self.nomem, |r| &r.arena));
                if ack_first {
                    if let Some(len) = self.write_riding_ack(&slots[0], src, to, error, counters) {
                        self.stage(len, to, opts, via);
                    }
                    route = self.links[i].route(remote);
                }
                let Some(buf) = self.tx.next_buf() else {
                    break 'links;
                };
                match datagram::encode(slots, route.map(|r| &r.arena), src, to, buf) {
                    Ok(len) => {
                        spoil_icrc(&mut buf[..len], error);
                        self.stage(len, to, opts, via)
                    }
                    Err(_) => bump(&mut counters.encode_dropped, 1),
                }
                if ack && !ack_first {
                    if let Some(len) = self.write_riding_ack(&slots[0], src, to, error, counters) {
                        self.stage(len, to, opts, via);
                    }
                }
            }
            self.links[i].from_engine.flush();
        }
        self.lines = Some(lines);
        self.flush(sock, counters);
        moved
    }

    /// Writes the positive Ack riding in `carrier` as an Acknowledge datagram of its own
    /// from `src` to `to`, its ICRC spoilt by the carrier's `error`, into the burst's next
    /// buffer (the caller checked for room for two); its length, to be staged.
    fn write_riding_ack(
        &mut self,
        carrier: &PacketSlot,
        src: SocketAddr,
        to: SocketAddr,
        error: u32,
        counters: &mut UdpCounters,
    ) -> Option<usize> {
        let buf = self.tx.next_buf()?;
        match datagram::riding_ack_datagram(carrier, src, to, buf)? {
            Ok(len) => {
                spoil_icrc(&mut buf[..len], error);
                Some(len)
            }
            Err(_) => {
                bump(&mut counters.encode_dropped, 1);
                None
            }
        }
    }

    /// Stages the datagram of `len` bytes just written (through the test hook), to be sent
    /// with `opts`.
    fn stage(&mut self, len: usize, to: SocketAddr, opts: IpOpts, via: u16) {
        #[cfg(test)]
        if let (Some(h), Some(buf)) = (self.hook.as_mut(), self.tx.next_buf()) {
            match h(&mut buf[..len]) {
                super::Fate::Send => {}
                super::Fate::Drop => return,
                super::Fate::Twice => {
                    let copy = buf[..len].to_vec();
                    self.tx.commit_with(len, to, opts, via);
                    self.stage_copy(&copy, to, opts, via);
                    return;
                }
                super::Fate::Later => {
                    let copy = buf[..len].to_vec();
                    self.release_held();
                    self.held = Some((copy, to, opts, via));
                    return;
                }
            }
            self.tx.commit_with(len, to, opts, via);
            self.release_held();
            return;
        }
        self.tx.commit_with(len, to, opts, via);
    }

    /// Stages a copy of a datagram (tests: a duplicate, a held one), if there is room.
    #[cfg(test)]
    fn stage_copy(&mut self, bytes: &[u8], to: SocketAddr, opts: IpOpts, via: u16) {
        if let Some(buf) = self.tx.next_buf() {
            buf[..bytes.len()].copy_from_slice(bytes);
            self.tx.commit_with(bytes.len(), to, opts, via);
        }
    }

    /// Stages the datagram held back, if any (tests).
    #[cfg(test)]
    fn release_held(&mut self) {
        if let Some((bytes, to, opts, via)) = self.held.take() {
            self.stage_copy(&bytes, to, opts, via);
        }
    }

    /// Sends what is staged.
    fn flush(&mut self, sock: &UdpSocket, counters: &mut UdpCounters) {
        if self.tx.is_empty() {
            return;
        }
        let senders = &self.senders;
        let r = self.tx.send_via(|via| {
            senders
                .get(usize::from(via).wrapping_sub(1))
                .and_then(Option::as_ref)
                .map_or(sock, |(_, s)| s)
        });
        bump(&mut counters.datagrams_sent, r.sent as u64);
        #[cfg(test)]
        {
            self.gso_sends += r.gso_sends as u64;
        }
        bump(&mut counters.send_dropped, r.dropped as u64);
    }
}

/// Whether a port sends runs of datagrams as UDP GSO sends: yes, unless
/// `SHMHCA_UDP_GSO` is `0` (for a NIC whose UDP segmentation offload would not number the
/// segments' IPv4 IDs 0, 1, 2, … as Linux does, which their ICRCs assume).
pub(crate) fn gso_wanted(var: Option<&std::ffi::OsStr>) -> bool {
    var.is_none_or(|v| v != "0")
}

/// Whether a port's socket takes GSO sends whole (`UDP_GRO`, see
/// [`UdpSocket::enable_gro`]): yes, unless `SHMHCA_UDP_GRO` is `0`.
pub(crate) fn gro_wanted(var: Option<&std::ffi::OsStr>) -> bool {
    var.is_none_or(|v| v != "0")
}

/// What one receive round found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RxRound {
    /// Datagrams were received, and this many published to the links (the rest dropped).
    Received(usize),
    /// Nothing was waiting.
    Empty,
    /// A link's ring, or the receive buffers, are full: the engine must consume first.
    NoRoom,
}

/// The CE-marked packets of one receive round: (the index of the link they came on, the
/// local QP they were for), at most [`BURST`] (a round receives no more). Made with the
/// pump and emptied each round: nothing is allocated or cleared per packet.
struct Marked {
    at: [(usize, Qpn); BURST],
    len: usize,
}

impl Marked {
    fn new() -> Marked {
        Marked {
            at: [(0, Qpn::new(0)); BURST],
            len: 0,
        }
    }

    fn push(&mut self, link: usize, qpn: Qpn) {
        if let Some(e) = self.at.get_mut(self.len) {
            *e = (link, qpn);
            self.len += 1;
        }
    }
}

/// The receive side of a port's pump.
struct RxPump {
    rx: RxRing,
    links: Vec<RxEnd>,
    /// A private copy of the datagram being checked.
    scratch: Box<[u8]>,
    /// The most datagrams one received message carries: 1, or [`socket::GRO_MAX_SEGS`]
    /// for a socket with `UDP_GRO` on (the kernel hands it GSO sends whole).
    max_segs: usize,
    /// Messages received that carried several datagrams (tests).
    #[cfg(test)]
    merged: u64,
    /// How many messages the next `recvmmsg` asks for (at most the room): 1 after a poll
    /// that found nothing, twice as many after one that got all it asked for, up to
    /// [`BURST`]. A `recvmmsg` that gets fewer than it asked for has the kernel try once
    /// more for the next and fail (`EAGAIN`), which cost a ping-pong ~0.2 µs a round trip
    /// here (`udp_bare_pingpong --gro` receiving with `recvmmsg` of 1 and of 2): the reply
    /// that ends a wait comes alone (one message, with `UDP_GRO`), and a stream's
    /// datagrams keep the polls full, so the ask grows back within a few.
    ask: usize,
    /// Receives that found data and got fewer messages than they asked for (tests).
    #[cfg(test)]
    overasked: u64,
}

impl RxPump {
    /// Receives a burst of datagrams — no more than every link's ring has room for, and
    /// only into buffers no unconsumed frame refers to — checks each (the IPv4 ID its ICRC
    /// holds with against its link's [`IpIds`], which `is_new` teaches), and publishes the
    /// good ones to their links' rings; lists in `marked` the good ones that arrived
    /// marked Congestion Experienced.
    fn step(
        &mut self,
        sock: &UdpSocket,
        counters: &mut UdpCounters,
        marked: &mut Marked,
        is_new: &impl Fn(Qpn, bool, Psn) -> bool,
    ) -> RxRound {
        let mut room = BURST;
        let mut oldest = self.rx.next();
        for l in &mut self.links {
            match l.consumed() {
                // A message merged by the kernel is up to `max_segs` frames: receive no
                // more messages than every ring has room for at that, but always one when
                // there is room for a frame (the datagrams of a merged one that do not
                // fit are lost, as on a wire: only when the engine lags far behind).
                Some((_, free)) => room = room.min((free / self.max_segs).max(free.min(1))),
                // A ring the engine broke takes no more (its link is down there).
                None => continue,
            }
            if let Some(d) = l.oldest_unconsumed() {
                oldest = oldest.min(d);
            }
        }
        let in_use = (self.rx.next() - oldest) as usize;
        room = room.min(self.rx.count().saturating_sub(in_use));
        if room == 0 {
            return RxRound::NoRoom;
        }
        let first = self.rx.next();
        let ask = room.min(self.ask);
        let n = match self.rx.recv(sock, ask) {
            Ok(0) | Err(_) => {
                self.ask = 1;
                return RxRound::Empty;
            }
            Ok(n) => n,
        };
        if n == ask {
            self.ask = (ask * 2).min(BURST);
        }
        #[cfg(test)]
        {
            self.overasked += u64::from(n < ask);
        }
        let local = sock.local_addr();
        let mut published = 0;
        for d in first..first + n as u64 {
            let (off, len, src) = self.rx.datagram(d);
            // A message the kernel merged: datagrams of `seg` bytes back to back, the last
            // maybe shorter (no segment size, or one not shorter than the message: one).
            let seg = match self.rx.segment(d) {
                0 => len.max(1),
                s => s.min(len.max(1)),
            };
            #[cfg(test)]
            {
                self.merged += u64::from(seg < len);
            }
            let mut at = 0;
            loop {
                let this = seg.min(len - at);
                bump(&mut counters.datagrams_received, 1);
                published += self.take(
                    d,
                    off + at as u64,
                    this,
                    src,
                    local,
                    counters,
                    marked,
                    is_new,
                );
                at += this;
                if at >= len {
                    break;
                }
            }
        }
        RxRound::Received(published)
    }

    /// Checks the datagram of `len` bytes at `off` of the ring (from message number `d`,
    /// from `src`) and publishes it to its link's ring if good; 1 if published, else 0.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn take(
        &mut self,
        d: u64,
        off: u64,
        len: usize,
        src: Option<SocketAddr>,
        local: SocketAddr,
        counters: &mut UdpCounters,
        marked: &mut Marked,
        is_new: &impl Fn(Qpn, bool, Psn) -> bool,
    ) -> usize {
        let Some(src) = src else {
            bump(&mut counters.malformed_dropped, 1);
            return 0;
        };
        let Some(li) = self.links.iter().position(|l| l.addr.ip() == src.ip()) else {
            bump(&mut counters.unknown_source_dropped, 1);
            return 0;
        };
        let l = &mut self.links[li];
        // (A merged message's segments may be longer than any RoCEv2 packet: malformed.)
        if len == 0
            || len > self.scratch.len()
            || self.rx.mem().read(off, &mut self.scratch[..len]).is_err()
        {
            bump(&mut counters.malformed_dropped, 1);
            return 0;
        }
        let slot = match datagram::decode_from(
            &self.scratch[..len],
            src,
            local,
            off,
            Some(&mut l.ids),
            is_new,
        ) {
            Ok(s) => s,
            Err(DecodeError::Icrc) => {
                bump(&mut counters.icrc_dropped, 1);
                return 0;
            }
            Err(DecodeError::Malformed) => {
                bump(&mut counters.malformed_dropped, 1);
                return 0;
            }
            Err(DecodeError::Cnp) => {
                bump(&mut counters.cnps_received, 1);
                return 0;
            }
        };
        if socket::is_ce(self.rx.tos(d)) {
            bump(&mut counters.ce_marked_received, 1);
            marked.push(li, RxPacket::dest_qp(&slot));
        }
        match l.to_engine.reserve(1) {
            Ok(Some(mut f)) => {
                let _ = f.write_line(0, bytemuck::cast_ref(&slot));
                f.commit();
                let cap = l.frame_dgram.len() as u64;
                l.frame_dgram[(l.pushed % cap) as usize] = d;
                l.pushed += 1;
                1
            }
            // Room was checked (or the engine broke the ring, or a merged message had more
            // datagrams than it had room for): the packet is lost, as on a wire.
            _ => {
                bump(&mut counters.malformed_dropped, 1);
                0
            }
        }
    }
}

/// One port's pump, owned and driven by its context's engine: the socket, both sides, the
/// watch page shared with the port's watcher thread, and the counters.
pub(crate) struct Pump {
    /// The port's number among the engine's pumps.
    pub(crate) id: u32,
    sock: Arc<UdpSocket>,
    tx: TxPump,
    rx: RxPump,
    /// The watch page: [`WATCH_KICK`] and [`WATCH_REQUEST`] (private memory of this
    /// process, shared with the watcher thread).
    watch: Mem,
    /// What the pump counted.
    pub(crate) counters: UdpCounters,
    /// The CE-marked packets of the current receive round.
    marked: Marked,
    /// The network namespace the port's socket was made in ([`thread_netns`]).
    netns: Option<u64>,
}

impl Pump {
    /// A pump for `sock`, receiving into `rx`; `watch` is the page it shares with the
    /// port's watcher thread ([`watch_page`]).
    pub(crate) fn new(sock: Arc<UdpSocket>, rx: RxRing, watch: Mem) -> Pump {
        Pump {
            id: 0,
            sock,
            tx: TxPump {
                lines: Some(Box::new([Line::ZERO; MAX_FRAME_LINES])),
                nomem: Mem::private(0),
                tx: {
                    let mut tx = TxBurst::new();
                    tx.set_gso(gso_wanted(std::env::var_os("SHMHCA_UDP_GSO").as_deref()));
                    tx
                },
                links: Vec::new(),
                senders: Vec::new(),
                #[cfg(test)]
                hook: None,
                #[cfg(test)]
                held: None,
                #[cfg(test)]
                gso_sends: 0,
            },
            rx: RxPump {
                // A ring whose buffers hold more than a datagram is one for merged messages.
                max_segs: if rx.buffer_bytes() > DGRAM_BYTES {
                    socket::GRO_MAX_SEGS
                } else {
                    1
                },
                rx,
                links: Vec::new(),
                scratch: vec![0u8; DGRAM_BYTES].into_boxed_slice(),
                #[cfg(test)]
                merged: 0,
                ask: 1,
                #[cfg(test)]
                overasked: 0,
            },
            watch,
            counters: UdpCounters::default(),
            marked: Marked::new(),
            // `new` runs where the socket was just bound.
            netns: thread_netns(),
        }
    }

    /// Adds a link's two ends.
    pub(crate) fn add_link(&mut self, tx: TxEnd, rx: RxEnd) {
        self.tx.links.push(tx);
        self.rx.links.push(rx);
    }

    /// Whether no QP talks over the link to `peer` (it has no route): the link may go.
    pub(crate) fn link_unused(&self, peer: IpAddr) -> bool {
        self.tx
            .links
            .iter()
            .find(|l| l.addr.ip() == peer)
            .is_none_or(|l| l.qps.is_empty())
    }

    /// Removes the two ends of the link to `peer`, once what the engine published on it
    /// has been sent (the engine removes its end at the same time: frames still in the
    /// ring towards it are dropped with it, and so are the receive buffers they held).
    pub(crate) fn remove_link(&mut self, peer: IpAddr) {
        self.send();
        self.tx.links.retain(|l| l.addr.ip() != peer);
        self.rx.links.retain(|l| l.addr.ip() != peer);
    }

    /// Local QP `local`, which reads its payloads from `arena`, talks to remote QP
    /// `remote` over the link to `peer`. Entries of local QPs that are gone (`alive` says
    /// which are not) are dropped first.
    ///
    /// # Errors
    /// Another live local QP talks to `remote` already (its QPN): the packets to a remote
    /// QP are read from one QP's memory, so two cannot share it.
    pub(crate) fn add_qp(
        &mut self,
        peer: IpAddr,
        remote: Qpn,
        local: Qpn,
        arena: Mem,
        alive: impl Fn(Qpn) -> bool,
    ) -> Result<(), Qpn> {
        let Some(l) = self.tx.links.iter_mut().find(|l| l.addr.ip() == peer) else {
            return Ok(());
        };
        l.qps.retain(|r| alive(r.local));
        if let Some(r) = l
            .qps
            .iter()
            .find(|r| r.remote == remote && r.local != local)
        {
            return Err(r.local);
        }
        l.qps.retain(|r| r.remote != remote);
        // Its own source port, as Linux derives it from the QPNs; the port's own socket if
        // that port cannot be bound (taken, e.g. by the peer's end on this same address).
        let main = self.sock.local_addr();
        let want = SocketAddr::new(main.ip(), shmhca_proto::roce::source_port(0, local, remote));
        let senders = &mut self.tx.senders;
        // A socket belongs to the network namespace of the thread that makes it: only in
        // the port's own (a caller may have moved its thread since it bound the port).
        let same_netns = self.netns.is_some() && self.netns == thread_netns();
        let via = match senders
            .iter()
            .position(|e| e.as_ref().is_some_and(|(p, _)| *p == want.port()))
        {
            Some(k) => Some(k),
            None if same_netns => {
                // A slot a closed socket left, else a new one (at most MAX_SENDERS).
                let free = senders.iter().position(Option::is_none);
                let k = free.or((senders.len() < MAX_SENDERS).then_some(senders.len()));
                k.and_then(|k| {
                    let s = UdpSocket::bind_sender(want).ok()?;
                    if k == senders.len() {
                        senders.push(None);
                    }
                    senders[k] = Some((want.port(), s));
                    Some(k)
                })
            }
            None => None,
        };
        let (via, src) = match via {
            Some(k) => (k as u16 + 1, want),
            None => (0, main),
        };
        l.qps.push(Route {
            remote,
            local,
            arena,
            opts: IpOpts::default(),
            via,
            src,
            last_cnp: None,
        });
        // The receive side tracks the IPv4 IDs of the peer QPs of the routes' local QPs
        // (and of no other QP: a datagram takes no slot), the new one afresh.
        let routes = &l.qps;
        if let Some(rx) = self.rx.links.iter_mut().find(|r| r.addr.ip() == peer) {
            rx.ids.retain(|q| routes.iter().any(|r| r.local == q));
            rx.ids.watch(local);
        }
        Ok(())
    }

    /// Local QP `local` is gone: what it staged leaves first, then its routes go, and with
    /// them the source-port sockets no route (and no datagram still staged) uses — a
    /// server that connects QP after QP keeps no socket per past connection.
    pub(crate) fn forget_qp(&mut self, local: Qpn) {
        if !self
            .tx
            .links
            .iter()
            .any(|l| l.qps.iter().any(|r| r.local == local))
        {
            return;
        }
        self.send();
        for l in &mut self.tx.links {
            l.qps.retain(|r| r.local != local);
        }
        for l in &mut self.rx.links {
            l.ids.forget(local);
        }
        let TxPump {
            links, senders, tx, ..
        } = &mut self.tx;
        for (k, slot) in senders.iter_mut().enumerate() {
            let via = k as u16 + 1;
            let used = links
                .iter()
                .flat_map(|l| l.qps.iter())
                .any(|r| r.via == via)
                || tx.stages_via(via);
            if slot.is_some() && !used {
                *slot = None;
            }
        }
    }

    /// The source-port sockets open (tests).
    #[cfg(test)]
    pub(crate) fn source_sockets(&self) -> usize {
        self.tx.senders.iter().flatten().count()
    }

    /// The IP header fields of local QP `local`'s packets (its `hop_limit` and
    /// `traffic_class`); whether it has a route on this pump.
    pub(crate) fn set_ip_opts(&mut self, local: Qpn, hop_limit: u8, traffic_class: u8) -> bool {
        let mut found = false;
        for r in self.tx.links.iter_mut().flat_map(|l| l.qps.iter_mut()) {
            if r.local == local {
                r.opts = IpOpts {
                    hop_limit,
                    traffic_class,
                };
                found = true;
            }
        }
        found
    }

    /// Installs a hook on every datagram sent (tests: drop, corrupt).
    #[cfg(test)]
    pub(crate) fn set_hook(&mut self, hook: super::DatagramHook) {
        self.tx.hook = Some(hook);
    }

    /// Turns UDP GSO on or off (tests: both ways of sending).
    #[cfg(test)]
    pub(crate) fn set_gso(&mut self, on: bool) {
        self.tx.tx.set_gso(on);
    }

    /// GSO sends of several datagrams so far (tests).
    #[cfg(test)]
    pub(crate) fn gso_sends(&self) -> u64 {
        self.tx.gso_sends
    }

    /// Messages received whole that carried several datagrams (a GSO send, `UDP_GRO`), so
    /// far (tests).
    #[cfg(test)]
    pub(crate) fn merged_receives(&self) -> u64 {
        self.rx.merged
    }

    /// Receives that found data and got fewer messages than they asked for (the kernel
    /// tried once more, in vain), so far (tests).
    #[cfg(test)]
    pub(crate) fn overasked_receives(&self) -> u64 {
        self.rx.overasked
    }

    /// Receives what waits on the socket into the links' rings, and stages a CNP for each
    /// local QP that received a CE-marked packet and has sent none for [`CNP_INTERVAL`]
    /// (`clock` is read once, and only if a packet was marked); returns the frames
    /// published to the links (datagrams dropped are no work for the engine). `is_new`
    /// says whether a local QP would take a packet's PSN as new
    /// ([`super::ip_ids::psn_is_new`] of the engine's QP): only such packets teach the
    /// links which IPv4 IDs their peers send.
    pub(crate) fn receive(
        &mut self,
        clock: &impl Clock,
        is_new: &impl Fn(Qpn, bool, Psn) -> bool,
    ) -> usize {
        self.marked.len = 0;
        let n = match self
            .rx
            .step(&self.sock, &mut self.counters, &mut self.marked, is_new)
        {
            RxRound::Received(n) => n,
            RxRound::Empty | RxRound::NoRoom => 0,
        };
        if self.marked.len > 0 {
            self.notify(clock.now().as_nanos());
        }
        n
    }

    /// The notification point: for each (link, local QP) this round marked, a CNP to the
    /// remote QP that local QP talks to, unless it sent one less than [`CNP_INTERVAL`] before
    /// `now` (ns). A QP with no route on that link (not one of this port's, or gone) gets
    /// none. The CNPs are staged; [`Pump::send`] sends them (or here, if the burst fills).
    fn notify(&mut self, now: u64) {
        for i in 0..self.marked.len.min(BURST) {
            let (li, qpn) = self.marked.at[i];
            let Some(link) = self.tx.links.get_mut(li) else {
                continue;
            };
            let to = link.addr;
            let Some(r) = link.qps.iter_mut().find(|r| r.local == qpn) else {
                continue;
            };
            if r.last_cnp
                .is_some_and(|t| now.saturating_sub(t) < CNP_INTERVAL_NS)
            {
                continue;
            }
            r.last_cnp = Some(now);
            let (remote, src, opts, via) = (r.remote, r.src, r.opts, r.via);
            if self.tx.tx.is_full() {
                self.tx.flush(&self.sock, &mut self.counters);
            }
            // (A burst the socket takes nothing of now: no CNP, as if it were lost.)
            let Some(buf) = self.tx.tx.next_buf() else {
                continue;
            };
            match datagram::encode_cnp(remote, src, to, buf) {
                Ok(len) => {
                    bump(&mut self.counters.cnps_sent, 1);
                    self.tx.stage(len, to, opts, via);
                }
                Err(_) => bump(&mut self.counters.encode_dropped, 1),
            }
        }
    }

    /// Sends what the engine published; returns the frames taken.
    pub(crate) fn send(&mut self) -> usize {
        self.tx.step(&self.sock, &mut self.counters)
    }

    /// Whether nothing is staged to send (the socket took everything).
    pub(crate) fn idle(&self) -> bool {
        self.tx.tx.is_empty()
    }

    /// Before the engine sleeps (in its sleep's gather step, after it announced itself as a
    /// sleeper): adds the watch's kick word to the set — read now, before the request — and
    /// asks the watcher to watch the socket.
    pub(crate) fn wait_on(&self, set: &mut wake::WaitSet) {
        set.add_shared(&self.watch, WATCH_KICK);
        if let Ok(request) = self.watch.atomic_u32(WATCH_REQUEST) {
            // SYNC: Release pairs with the watcher's Acquire load (nothing else rides on it:
            // the socket itself is the work).
            request.fetch_add(1, Ordering::Release);
            let _ = futex::wake(request, futex::Flags::empty(), 1);
        }
    }
}

/// The pumps an engine drives: empty unless the context has a [`super::UdpPort`] (then
/// one branch per iteration).
#[derive(Default)]
pub(crate) struct Pumps {
    pumps: Vec<Pump>,
    next_id: u32,
}

impl Pumps {
    /// Whether there is none.
    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.pumps.is_empty()
    }

    /// Adds `pump`; returns its number.
    pub(crate) fn add(&mut self, mut pump: Pump) -> u32 {
        self.next_id = self.next_id.wrapping_add(1);
        pump.id = self.next_id;
        self.pumps.push(pump);
        self.next_id
    }

    /// Pump number `id`.
    pub(crate) fn get_mut(&mut self, id: u32) -> Option<&mut Pump> {
        self.pumps.iter_mut().find(|p| p.id == id)
    }

    /// Removes pump number `id` (its socket closes when the watcher's handle goes too).
    pub(crate) fn remove(&mut self, id: u32) -> Option<Pump> {
        let i = self.pumps.iter().position(|p| p.id == id)?;
        Some(self.pumps.swap_remove(i))
    }

    /// Every pump's [`Pump::receive`] (CNPs timed by `clock`, the engine's; `is_new` the
    /// engine's word on a packet's PSN); the frames published to the links.
    pub(crate) fn receive(
        &mut self,
        clock: &impl Clock,
        is_new: &impl Fn(Qpn, bool, Psn) -> bool,
    ) -> usize {
        self.pumps
            .iter_mut()
            .map(|p| p.receive(clock, is_new))
            .sum()
    }

    /// Every pump's [`Pump::send`]; the frames taken.
    pub(crate) fn send(&mut self) -> usize {
        self.pumps.iter_mut().map(Pump::send).sum()
    }

    /// Whether every pump has sent everything.
    pub(crate) fn idle(&self) -> bool {
        self.pumps.iter().all(Pump::idle)
    }

    /// Adds every pump's counters to `s`.
    pub(crate) fn add_counters(&self, s: &mut shmhca_proto::stats::Stats) {
        for p in &self.pumps {
            add_counters(s, &p.counters);
        }
    }
}

/// Adds a port's counters to an engine's.
pub(crate) fn add_counters(s: &mut shmhca_proto::stats::Stats, c: &UdpCounters) {
    s.datagrams_sent += c.datagrams_sent;
    s.datagrams_received += c.datagrams_received;
    s.icrc_dropped += c.icrc_dropped;
    s.malformed_dropped += c.malformed_dropped;
    s.cnps_received += c.cnps_received;
    s.ce_marked_received += c.ce_marked_received;
    s.cnps_sent += c.cnps_sent;
    s.unknown_source_dropped += c.unknown_source_dropped;
    s.send_dropped += c.send_dropped;
    s.encode_dropped += c.encode_dropped;
}

impl Pumps {
    /// Whether local QP `local` has a route to remote QP `remote` on some pump (its
    /// destination was made for it).
    pub(crate) fn has_route(&self, local: Qpn, remote: Qpn) -> bool {
        self.pumps.iter().any(|p| {
            p.tx.links
                .iter()
                .flat_map(|l| l.qps.iter())
                .any(|r| r.local == local && r.remote == remote)
        })
    }

    /// Every pump's [`Pump::forget_qp`].
    pub(crate) fn forget_qp(&mut self, local: Qpn) {
        for p in &mut self.pumps {
            p.forget_qp(local);
        }
    }

    /// Every pump's [`Pump::set_ip_opts`].
    pub(crate) fn set_ip_opts(&mut self, local: Qpn, hop_limit: u8, traffic_class: u8) {
        for p in &mut self.pumps {
            if p.set_ip_opts(local, hop_limit, traffic_class) {
                return;
            }
        }
    }

    /// Every pump's [`Pump::wait_on`].
    pub(crate) fn wait_on(&self, set: &mut wake::WaitSet) {
        for p in &self.pumps {
            p.wait_on(set);
        }
    }
}

/// A new watch page (zeroed words).
pub(crate) fn watch_page() -> Mem {
    Mem::private(4096)
}

/// Asks the watcher sharing `page` to look at its stop flag now.
pub(crate) fn nudge_watcher(page: &Mem) {
    if let Ok(request) = page.atomic_u32(WATCH_REQUEST) {
        request.fetch_add(1, Ordering::Release);
        let _ = futex::wake(request, futex::Flags::empty(), 1);
    }
}

/// The watcher thread of a port: until `stop`, waits for the engine's requests (one each
/// time it goes to sleep) on `page`, and for each watches `sock` while the engine sleeps
/// (`engine_page` holds its sleeper count), waking it when a datagram is there.
pub(crate) fn watch(sock: &UdpSocket, page: &Mem, engine_page: &Mem, stop: &AtomicBool) {
    let (Ok(request), Ok(kick), Ok(sleepers)) = (
        page.atomic_u32(WATCH_REQUEST),
        page.atomic_u32(WATCH_KICK),
        engine_page.atomic_u32(crate::arena::WAKE_WORD),
    ) else {
        return;
    };
    // The page starts zeroed (`watch_page`): a request made before this thread first ran
    // (the engine may go to sleep as soon as `bind` added the pump, long before a new
    // thread gets a core on a loaded machine) differs from 0 and is served. Reading the
    // word here instead took such a request for "nothing asked", and the engine slept on
    // unwatched.
    let mut seen = 0;
    while !stop.load(Ordering::Relaxed) {
        let now = request.load(Ordering::Acquire);
        if now == seen {
            let ts = futex::Timespec {
                tv_sec: 0,
                tv_nsec: WATCH_IDLE.as_nanos() as _,
            };
            // Woken, timed out, interrupted or changed: look again.
            let _ = futex::wait(request, futex::Flags::empty(), seen, Some(&ts));
            continue;
        }
        seen = now;
        watch_once(sock, kick, sleepers, stop);
    }
}

/// One watch: until the engine wakes (or `stop`), waits for the socket to be readable, and
/// then wakes the engine through `kick`. A request that comes meanwhile is served again
/// by the caller, so the engine is never left asleep unwatched.
fn watch_once(sock: &UdpSocket, kick: &AtomicU32, sleepers: &AtomicU32, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        if sock.wait_readable(WATCH_POLL_MS) {
            wake::wake(sleepers, kick, false);
            return;
        }
        if sleepers.load(Ordering::Relaxed) == 0 {
            return;
        }
    }
}

#[cfg(test)]
mod watch_tests {
    use super::*;
    use std::time::Instant;

    /// The engine asks for a watch (it goes to sleep, `Pump::wait_on`) before the port's
    /// watcher thread, which `UdpPort::bind` has just started, first ran — on a loaded
    /// machine a new thread may wait that long for a core. The watcher must serve that
    /// request: a datagram there must wake the engine. (It took the request word as it
    /// found it for "nothing asked yet", and the engine slept its whole `max_sleep`, 30 s
    /// in `sleeping_engines_ping_pong_on_two_qps_over_one_link`, while its peer's transport
    /// timer ran out.)
    #[test]
    fn a_watch_requested_before_the_watcher_first_runs_is_served() {
        let sock = Arc::new(UdpSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap());
        let page = watch_page();
        let engine_page = Mem::private(4096);
        // The engine: one sleeper, its watch request, and a datagram arrives.
        engine_page
            .atomic_u32(crate::arena::WAKE_WORD)
            .unwrap()
            .store(1, Ordering::Relaxed);
        page.atomic_u32(WATCH_REQUEST)
            .unwrap()
            .fetch_add(1, Ordering::Release);
        let peer = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        peer.send_to(b"datagram", sock.local_addr()).unwrap();
        // Only now does the watcher start.
        let stop = Arc::new(AtomicBool::new(false));
        let watcher = {
            let (sock, page, engine_page, stop) = (
                sock.clone(),
                page.share(),
                engine_page.share(),
                stop.clone(),
            );
            std::thread::spawn(move || watch(&sock, &page, &engine_page, &stop))
        };
        let kick = page.atomic_u32(WATCH_KICK).unwrap();
        let start = Instant::now();
        while kick.load(Ordering::Acquire) == 0 && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let kicked = kick.load(Ordering::Acquire);
        stop.store(true, Ordering::Relaxed);
        nudge_watcher(&page);
        watcher.join().unwrap();
        assert_eq!(kicked, 1, "the sleeping engine was never woken");
    }
}
