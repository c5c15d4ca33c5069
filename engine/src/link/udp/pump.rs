//! The pump: the far end of a port's UDP links, in two halves on two threads that share
//! the socket.
//!
//! * [`TxPump`] takes the frames the engine published on each link, writes them as
//!   datagrams and sends them in bursts (`sendmmsg`). When there are none it sleeps as an
//!   engine does ([`crate::engine::wake::sleep`]) on the kick words the engine bumps after
//!   publishing: its "engine page" says it may sleep, so the engine wakes it, and an idle
//!   port costs no CPU and adds no delay.
//! * [`RxPump`] receives bursts (`recvmmsg`) into the receive-buffer ring, checks every
//!   datagram and publishes the good ones to their link's engine (waking it if it sleeps).
//!   When there are none it sleeps in `poll(2)` on the socket.
//!
//! Safe code over [`super::socket`] and [`super::datagram`]; nothing is allocated per packet
//! (the buffers, the burst and the per-link bookkeeping are made with the port or link).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use shmhca_rings::lines::{Line, LinesConsumer, LinesProducer, MAX_FRAME_LINES, ShmLines};
use shmhca_rings::segment::Segment;

use super::SharedCounters;
use super::datagram::{self, DecodeError};
use super::socket::{BURST, DGRAM_BYTES, RxRing, TxBurst, UdpSocket};
use crate::engine::wake;
use crate::link::LinkEnds;
use crate::mem::Mem;
use crate::wire::Qpn;
use crate::wire::slot::{PacketSlot, RxPacket};

/// How long the receive half sleeps on the socket at most before it looks at its commands
/// and the stop flag again.
const RX_SLEEP_MS: i32 = 50;
/// How long the send half sleeps at most (it is woken by the engine and by the port).
const TX_SLEEP: Duration = Duration::from_millis(100);
/// Empty rounds the send half spins (yielding) before it sleeps.
const TX_SPIN: u32 = 64;

/// What the port's handle tells the send half.
pub(crate) enum TxCommand {
    /// A new link, to a peer address.
    AddLink(Box<TxEnd>),
    /// A QP on the link to `peer` talks to remote QP `remote`; its payloads are read from
    /// `arena`.
    AddQp {
        peer: IpAddr,
        remote: Qpn,
        arena: Mem,
    },
    /// A hook on every datagram sent (tests).
    #[cfg(test)]
    Hook(super::DatagramHook),
}

/// The send half's end of one link: the ring from the engine, the word the engine bumps
/// after publishing on it, and the arenas of the local QPs that talk over it (by the
/// remote QPN their packets carry).
pub(crate) struct TxEnd {
    addr: SocketAddr,
    from_engine: LinesConsumer<ShmLines>,
    /// The link segment (keeps it mapped; holds the engine's kick word for this end).
    segment: Mem,
    /// Where the engine's kick word for this end is in the segment.
    wait_off: u64,
    qps: Vec<(Qpn, Mem)>,
}

/// The receive half's end of one link: the ring to the engine and what waking the engine
/// takes.
pub(crate) struct RxEnd {
    addr: SocketAddr,
    to_engine: LinesProducer<ShmLines>,
    /// The link segment (keeps it mapped; holds the kick word this end bumps).
    segment: Mem,
    kick_off: u64,
    /// The engine's page (its sleeper count).
    engine_page: Mem,
    /// Per frame published to the engine (by number, modulo the ring's capacity): the
    /// number of the datagram it came from, so that the pump knows which receive buffers
    /// the engine may still read.
    frame_dgram: Box<[u64]>,
    /// Frames published to the engine.
    pushed: u64,
    /// Frames were published since the engine was last woken.
    unwoken: bool,
}

/// The pump's two ends of a link to `addr`: `ends`, attached to `segment` on the opener's
/// side; `engine_page` is the engine's page (to wake it).
pub(crate) fn link_ends(
    addr: SocketAddr,
    segment: Arc<Segment>,
    ends: LinkEnds,
    engine_page: Mem,
) -> (TxEnd, RxEnd) {
    let segment = Mem::from_segment(segment);
    let cap = ends.tx.capacity();
    (
        TxEnd {
            addr,
            from_engine: ends.rx,
            segment: segment.share(),
            wait_off: ends.kick[1],
            qps: Vec::new(),
        },
        RxEnd {
            addr,
            to_engine: ends.tx,
            segment,
            kick_off: ends.kick[0],
            engine_page,
            frame_dgram: vec![0; cap].into_boxed_slice(),
            pushed: 0,
            unwoken: false,
        },
    )
}

impl TxEnd {
    fn arena(&self, remote: Qpn) -> Option<&Mem> {
        self.qps.iter().find(|(q, _)| *q == remote).map(|(_, m)| m)
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

    /// Wakes the engine if a thread of it sleeps (after frames were published).
    fn wake_engine(&mut self) {
        if !std::mem::take(&mut self.unwoken) {
            return;
        }
        if let (Ok(sleepers), Ok(kick)) = (
            self.engine_page.atomic_u32(crate::arena::WAKE_WORD),
            self.segment.atomic_u32(self.kick_off),
        ) {
            wake::wake(sleepers, kick, false);
        }
    }
}

fn bump(c: &AtomicU64, n: u64) {
    if n != 0 {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// How the port's handle wakes the send half: the send half's page (its sleeper count, and
/// `MAY_SLEEP = 1` for the engine to read) and its local kick word.
#[derive(Clone)]
pub(crate) struct TxWaker {
    /// The page the engine's links see as their peer's engine page.
    pub(crate) page: Arc<Mem>,
    pub(crate) local: Arc<AtomicU32>,
}

impl TxWaker {
    pub(crate) fn new() -> TxWaker {
        let page = Mem::private(4096);
        if let Ok(w) = page.atomic_u32(crate::arena::MAY_SLEEP) {
            w.store(1, Ordering::Relaxed);
        }
        TxWaker {
            page: Arc::new(page),
            local: Arc::new(AtomicU32::new(0)),
        }
    }

    /// Wakes the send half if it sleeps (after a command was sent, or to stop it).
    pub(crate) fn wake(&self) {
        if let Ok(sleepers) = self.page.atomic_u32(crate::arena::WAKE_WORD) {
            wake::wake(sleepers, &self.local, true);
        }
    }
}

/// The send half of a port's pump.
pub(crate) struct TxPump {
    sock: Arc<UdpSocket>,
    tx: TxBurst,
    links: Vec<TxEnd>,
    /// The kick words the engine bumps, one per link (what a sleep waits on).
    waits: Vec<(Mem, u64)>,
    commands: mpsc::Receiver<TxCommand>,
    counters: Arc<SharedCounters>,
    waker: TxWaker,
    #[cfg(test)]
    hook: Option<super::DatagramHook>,
}

impl TxPump {
    pub(crate) fn new(
        sock: Arc<UdpSocket>,
        commands: mpsc::Receiver<TxCommand>,
        counters: Arc<SharedCounters>,
        waker: TxWaker,
    ) -> TxPump {
        TxPump {
            sock,
            tx: TxBurst::new(),
            links: Vec::new(),
            waits: Vec::new(),
            commands,
            counters,
            waker,
            #[cfg(test)]
            hook: None,
        }
    }

    /// Runs until `stop` is set: steps while the engine publishes, sleeps when it does not.
    pub(crate) fn run(&mut self, stop: &AtomicBool) {
        // Made here: it holds the kernel's view of the words (raw pointers), and stays on
        // this thread.
        let mut set = wake::WaitSet::default();
        let mut idle = 0u32;
        while !stop.load(Ordering::Relaxed) {
            self.take_commands();
            if self.step() > 0 || !self.tx.is_empty() {
                idle = 0;
                if !self.tx.is_empty() {
                    // The socket's buffer is full: let the kernel drain it.
                    std::thread::yield_now();
                }
                continue;
            }
            idle += 1;
            if idle < TX_SPIN {
                std::thread::yield_now();
                continue;
            }
            let TxPump {
                links,
                waits,
                waker,
                ..
            } = self;
            let Ok(sleepers) = waker.page.atomic_u32(crate::arena::WAKE_WORD) else {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            };
            wake::sleep(
                sleepers,
                &waker.local,
                &mut set,
                TX_SLEEP,
                |set| {
                    for (mem, off) in waits.iter() {
                        set.add_shared(mem, *off);
                    }
                    true
                },
                || {
                    stop.load(Ordering::Relaxed)
                        || links
                            .iter_mut()
                            .any(|l| l.from_engine.has_frame().unwrap_or(false))
                },
            );
        }
    }

    /// Applies the commands waiting.
    fn take_commands(&mut self) {
        while let Ok(c) = self.commands.try_recv() {
            match c {
                TxCommand::AddLink(l) => {
                    self.waits.push((l.segment.share(), l.wait_off));
                    self.links.push(*l);
                }
                TxCommand::AddQp {
                    peer,
                    remote,
                    arena,
                } => {
                    if let Some(l) = self.links.iter_mut().find(|l| l.addr.ip() == peer) {
                        l.qps.retain(|(q, _)| *q != remote);
                        l.qps.push((remote, arena));
                    }
                }
                #[cfg(test)]
                TxCommand::Hook(h) => self.hook = Some(h),
            }
        }
    }

    /// Takes the frames the engine published on every link, writes them as datagrams and
    /// sends them in bursts; returns the frames taken. A burst the socket cannot take now
    /// stays staged, and the frames behind it stay in their rings (the engine sees a full
    /// link).
    pub(crate) fn step(&mut self) -> usize {
        let mut lines = [Line::ZERO; MAX_FRAME_LINES];
        let mut moved = 0;
        let local = self.sock.local_addr();
        'links: for i in 0..self.links.len() {
            loop {
                // Room for a packet and the Ack that may ride in it.
                if self.tx.len() + 2 > BURST {
                    self.flush();
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
                if self.links[i].arena(remote).is_none() {
                    // Registered after this step began: look again.
                    self.take_commands();
                }
                let to = self.links[i].addr;
                let Some(buf) = self.tx.next_buf() else {
                    break 'links;
                };
                match datagram::encode(slots, self.links[i].arena(remote), local, to, buf) {
                    Ok(len) => self.stage(len, to),
                    Err(_) => bump(&self.counters.encode_dropped, 1),
                }
                let Some(buf) = self.tx.next_buf() else {
                    break 'links;
                };
                if let Some(r) = datagram::riding_ack_datagram(&slots[0], local, to, buf) {
                    match r {
                        Ok(len) => self.stage(len, to),
                        Err(_) => bump(&self.counters.encode_dropped, 1),
                    }
                }
            }
            self.links[i].from_engine.flush();
        }
        self.flush();
        moved
    }

    /// Stages the datagram of `len` bytes just written (through the test hook).
    fn stage(&mut self, len: usize, to: SocketAddr) {
        #[cfg(test)]
        if let (Some(h), Some(buf)) = (self.hook.as_mut(), self.tx.next_buf()) {
            if !h(&mut buf[..len]) {
                return;
            }
        }
        self.tx.commit(len, to);
    }

    /// Sends what is staged.
    fn flush(&mut self) {
        if self.tx.is_empty() {
            return;
        }
        let r = self.tx.send(&self.sock);
        bump(&self.counters.datagrams_sent, r.sent as u64);
        bump(&self.counters.send_dropped, r.dropped as u64);
    }
}

/// What one receive round found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RxRound {
    /// Datagrams were received (this many).
    Received(usize),
    /// Nothing was waiting.
    Empty,
    /// A link's ring, or the receive buffers, are full: the engine must consume first.
    NoRoom,
}

/// The receive half of a port's pump.
pub(crate) struct RxPump {
    sock: Arc<UdpSocket>,
    rx: RxRing,
    links: Vec<RxEnd>,
    commands: mpsc::Receiver<RxEnd>,
    counters: Arc<SharedCounters>,
    /// A private copy of the datagram being checked.
    scratch: Box<[u8]>,
}

impl RxPump {
    pub(crate) fn new(
        sock: Arc<UdpSocket>,
        rx: RxRing,
        commands: mpsc::Receiver<RxEnd>,
        counters: Arc<SharedCounters>,
    ) -> RxPump {
        RxPump {
            sock,
            rx,
            links: Vec::new(),
            commands,
            counters,
            scratch: vec![0u8; DGRAM_BYTES].into_boxed_slice(),
        }
    }

    /// Runs until `stop` is set: receives while datagrams come, sleeps on the socket when
    /// none do, and waits (briefly) for the engine when it has no room.
    pub(crate) fn run(&mut self, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            while let Ok(l) = self.commands.try_recv() {
                self.links.push(l);
            }
            match self.step() {
                RxRound::Received(_) => {}
                RxRound::Empty => {
                    self.sock.wait_readable(RX_SLEEP_MS);
                }
                RxRound::NoRoom => std::thread::sleep(Duration::from_micros(20)),
            }
        }
    }

    /// Receives a burst of datagrams — no more than every link's ring has room for, and
    /// only into buffers no unconsumed frame refers to — checks each, and publishes the
    /// good ones to their links' engine.
    pub(crate) fn step(&mut self) -> RxRound {
        let mut room = BURST;
        let mut oldest = self.rx.next();
        for l in &mut self.links {
            match l.consumed() {
                Some((_, free)) => room = room.min(free),
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
        let n = match self.rx.recv(&self.sock, room) {
            Ok(0) | Err(_) => return RxRound::Empty,
            Ok(n) => n,
        };
        bump(&self.counters.datagrams_received, n as u64);
        let local = self.sock.local_addr();
        for d in first..first + n as u64 {
            let (off, len, src) = self.rx.datagram(d);
            let Some(src) = src else {
                bump(&self.counters.malformed_dropped, 1);
                continue;
            };
            let Some(l) = self.links.iter_mut().find(|l| l.addr.ip() == src.ip()) else {
                bump(&self.counters.unknown_source_dropped, 1);
                continue;
            };
            if len == 0 || self.rx.mem().read(off, &mut self.scratch[..len]).is_err() {
                bump(&self.counters.malformed_dropped, 1);
                continue;
            }
            let slot = match datagram::decode(&self.scratch[..len], src, local, off) {
                Ok(s) => s,
                Err(DecodeError::Icrc) => {
                    bump(&self.counters.icrc_dropped, 1);
                    continue;
                }
                Err(DecodeError::Malformed) => {
                    bump(&self.counters.malformed_dropped, 1);
                    continue;
                }
                Err(DecodeError::Cnp) => {
                    bump(&self.counters.cnps_received, 1);
                    continue;
                }
            };
            match l.to_engine.reserve(1) {
                Ok(Some(mut f)) => {
                    let _ = f.write_line(0, bytemuck::cast_ref(&slot));
                    f.commit();
                    let cap = l.frame_dgram.len() as u64;
                    l.frame_dgram[(l.pushed % cap) as usize] = d;
                    l.pushed += 1;
                    l.unwoken = true;
                }
                // Room was checked (or the engine broke the ring): the packet is lost, as
                // on a wire.
                _ => bump(&self.counters.malformed_dropped, 1),
            }
        }
        for l in &mut self.links {
            l.wake_engine();
        }
        RxRound::Received(n)
    }
}
