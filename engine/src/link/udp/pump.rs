//! The pump: the far end of a port's UDP links. Moves frames the engine published into
//! datagrams (`sendmmsg`) and datagrams into frames for the engine (`recvmmsg`), checking
//! every datagram on the way in. Safe code over [`super::socket`] and
//! [`super::datagram`]; nothing allocated per packet (the buffers, the burst and the
//! per-peer bookkeeping are made when a port or link is).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;

use shmhca_rings::lines::{Line, LinesConsumer, LinesProducer, MAX_FRAME_LINES, ShmLines};
use shmhca_rings::segment::Segment;

use super::SharedCounters;
use super::datagram::{self, DecodeError};
use super::socket::{BURST, DGRAM_BYTES, RxRing, TxBurst, UdpSocket};
use crate::link::LinkEnds;
use crate::mem::Mem;
use crate::wire::Qpn;
use crate::wire::slot::{PacketSlot, RxPacket};

/// What the port's handle tells its pump thread.
pub(crate) enum Command {
    /// A new link, to a peer address.
    AddPeer(Box<PeerEnd>),
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

/// The pump's end of one link: the rings to and from the engine, the peer's address, and
/// the arenas of the local QPs that talk to it (by the remote QPN their packets carry).
pub(crate) struct PeerEnd {
    addr: SocketAddr,
    /// Keeps the link segment mapped (the ring ends hold it too).
    _segment: Arc<Segment>,
    /// The link segment, for the kick word this end bumps.
    kick: Mem,
    kick_off: u64,
    /// The engine's page (its sleeper count).
    engine_page: Mem,
    to_engine: LinesProducer<ShmLines>,
    from_engine: LinesConsumer<ShmLines>,
    qps: Vec<(Qpn, Mem)>,
    /// Per frame published to the engine (by number, modulo the ring's capacity): the
    /// number of the datagram it came from, so that the pump knows which receive buffers
    /// the engine may still read.
    frame_dgram: Box<[u64]>,
    /// Frames published to the engine.
    pushed: u64,
    /// Frames published since the engine was last woken.
    unwoken: bool,
}

impl PeerEnd {
    /// The pump's end of a link to `addr`: `ends`, attached to `segment` on the opener's
    /// side; `engine_page` is the engine's page (to wake it).
    pub(crate) fn new(
        addr: SocketAddr,
        segment: Arc<Segment>,
        ends: LinkEnds,
        engine_page: Mem,
    ) -> PeerEnd {
        let cap = ends.tx.capacity();
        PeerEnd {
            addr,
            kick: Mem::from_segment(segment.clone()),
            _segment: segment,
            kick_off: ends.kick[0],
            engine_page,
            to_engine: ends.tx,
            from_engine: ends.rx,
            qps: Vec::new(),
            frame_dgram: vec![0; cap].into_boxed_slice(),
            pushed: 0,
            unwoken: false,
        }
    }

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

    fn arena(&self, remote: Qpn) -> Option<&Mem> {
        self.qps.iter().find(|(q, _)| *q == remote).map(|(_, m)| m)
    }

    /// Wakes the engine if a thread of it sleeps (after frames were published).
    fn wake_engine(&mut self) {
        if !std::mem::take(&mut self.unwoken) {
            return;
        }
        if let (Ok(sleepers), Ok(kick)) = (
            self.engine_page.atomic_u32(crate::arena::WAKE_WORD),
            self.kick.atomic_u32(self.kick_off),
        ) {
            crate::engine::wake::wake(sleepers, kick, false);
        }
    }
}

/// The pump of one port.
pub(crate) struct Pump {
    sock: UdpSocket,
    tx: TxBurst,
    rx: RxRing,
    peers: Vec<PeerEnd>,
    commands: mpsc::Receiver<Command>,
    counters: Arc<SharedCounters>,
    /// A private copy of the datagram being checked.
    scratch: Box<[u8]>,
    #[cfg(test)]
    hook: Option<super::DatagramHook>,
}

fn bump(c: &AtomicU64, n: u64) {
    if n != 0 {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

impl Pump {
    pub(crate) fn new(
        sock: UdpSocket,
        rx: RxRing,
        commands: mpsc::Receiver<Command>,
        counters: Arc<SharedCounters>,
    ) -> Pump {
        Pump {
            sock,
            tx: TxBurst::new(),
            rx,
            peers: Vec::new(),
            commands,
            counters,
            scratch: vec![0u8; DGRAM_BYTES].into_boxed_slice(),
            #[cfg(test)]
            hook: None,
        }
    }

    /// Runs until `stop` is set: steps while there is traffic, and sleeps on the socket
    /// (1 ms at a time, so frames the engine publishes meanwhile wait at most that long)
    /// after a run of empty steps.
    pub(crate) fn run(&mut self, stop: &AtomicBool) {
        let mut idle = 0u32;
        while !stop.load(Ordering::Relaxed) {
            self.take_commands();
            if self.step() > 0 {
                idle = 0;
                continue;
            }
            idle += 1;
            if idle < 256 {
                std::thread::yield_now();
            } else {
                self.sock.wait_readable(1);
            }
        }
    }

    /// Applies the commands waiting.
    fn take_commands(&mut self) {
        while let Ok(c) = self.commands.try_recv() {
            match c {
                Command::AddPeer(p) => self.peers.push(*p),
                Command::AddQp {
                    peer,
                    remote,
                    arena,
                } => {
                    if let Some(p) = self.peers.iter_mut().find(|p| p.addr.ip() == peer) {
                        p.qps.retain(|(q, _)| *q != remote);
                        p.qps.push((remote, arena));
                    }
                }
                #[cfg(test)]
                Command::Hook(h) => self.hook = Some(h),
            }
        }
    }

    /// One round: frames to datagrams, then datagrams to frames. The packets moved.
    pub(crate) fn step(&mut self) -> usize {
        self.send_step() + self.recv_step()
    }

    /// Takes the frames the engine published on every link, writes them as datagrams and
    /// sends them in bursts. A burst the socket cannot take now stays staged, and the
    /// frames behind it stay in their rings (the engine sees a full link).
    fn send_step(&mut self) -> usize {
        let mut lines = [Line::ZERO; MAX_FRAME_LINES];
        let mut moved = 0;
        let local = self.sock.local_addr();
        'peers: for i in 0..self.peers.len() {
            loop {
                // Room for a packet and the Ack that may ride in it.
                if self.tx.len() + 2 > BURST {
                    self.flush();
                    if self.tx.len() + 2 > BURST {
                        break 'peers;
                    }
                }
                let n = match self.peers[i].from_engine.recv(&mut lines) {
                    Ok(Some(n)) => n,
                    Ok(None) | Err(_) => break,
                };
                moved += 1;
                let slots: &[PacketSlot] = bytemuck::cast_slice(&lines[..n]);
                let remote = RxPacket::dest_qp(&slots[0]);
                if self.peers[i].arena(remote).is_none() {
                    // Registered after this step began: look again.
                    self.take_commands();
                }
                let to = self.peers[i].addr;
                let Some(buf) = self.tx.next_buf() else {
                    break 'peers;
                };
                match datagram::encode(slots, self.peers[i].arena(remote), local, to, buf) {
                    Ok(len) => self.stage(len, to),
                    Err(_) => bump(&self.counters.encode_dropped, 1),
                }
                let Some(buf) = self.tx.next_buf() else {
                    break 'peers;
                };
                if let Some(r) = datagram::riding_ack_datagram(&slots[0], local, to, buf) {
                    match r {
                        Ok(len) => self.stage(len, to),
                        Err(_) => bump(&self.counters.encode_dropped, 1),
                    }
                }
            }
            self.peers[i].from_engine.flush();
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

    /// Receives a burst of datagrams — no more than every link's ring has room for, and
    /// only into buffers no unconsumed frame refers to — checks each, and publishes the
    /// good ones to their links' engine.
    fn recv_step(&mut self) -> usize {
        let mut room = BURST;
        let mut oldest = self.rx.next();
        for p in &mut self.peers {
            match p.consumed() {
                Some((_, free)) => room = room.min(free),
                None => room = 0,
            }
            if let Some(d) = p.oldest_unconsumed() {
                oldest = oldest.min(d);
            }
        }
        if self.peers.is_empty() {
            // No link yet: datagrams are read and dropped (counted), not left to fill the
            // socket's queue.
            room = BURST;
        }
        let in_use = (self.rx.next() - oldest) as usize;
        room = room.min(self.rx.count().saturating_sub(in_use));
        if room == 0 {
            return 0;
        }
        let first = self.rx.next();
        let n = match self.rx.recv(&self.sock, room) {
            Ok(n) => n,
            Err(_) => return 0,
        };
        bump(&self.counters.datagrams_received, n as u64);
        let local = self.sock.local_addr();
        for d in first..first + n as u64 {
            let (off, len, src) = self.rx.datagram(d);
            let Some(src) = src else {
                bump(&self.counters.malformed_dropped, 1);
                continue;
            };
            let Some(p) = self.peers.iter_mut().find(|p| p.addr.ip() == src.ip()) else {
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
            };
            match p.to_engine.reserve(1) {
                Ok(Some(mut f)) => {
                    let _ = f.write_line(0, bytemuck::cast_ref(&slot));
                    f.commit();
                    let cap = p.frame_dgram.len() as u64;
                    p.frame_dgram[(p.pushed % cap) as usize] = d;
                    p.pushed += 1;
                    p.unwoken = true;
                }
                // Room was checked: cannot be; the packet is lost, as on a wire.
                _ => bump(&self.counters.malformed_dropped, 1),
            }
        }
        for p in &mut self.peers {
            p.wake_engine();
        }
        n
    }
}
