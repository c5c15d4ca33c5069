//! The engine: this process's HCA. One poll loop, DPDK-style.
//!
//! Each [`Engine::poll`] iteration first asks whether there is anything to do at all
//! ([`Engine::idle_now`]): the engine's own word ([`Engine::idle_word`]: settled — no QP in
//! any set, no Ack owed, nothing queued — as the last iteration that found nothing left
//! it, unsettled by anything that changes that; and no stats publication due), the
//! doorbell's summary word and one load per link. An empty poll ends there, compiled into
//! the completion queue's poll, with no call. Otherwise:
//!
//! 1. takes the doorbells rung by `post_send`/`post_recv` into the active set, and the
//!    watched send queues that hold new WQEs (poll mode: see [`Engine::watch_sq`]); an
//!    iteration with nothing rung, nothing active and nothing received returns here, after
//!    the doorbell's summary word and one load per link (QPs that only wait for an Ack or
//!    the end of an RNR wait are not active: they are in the timed set, which rejoins the
//!    active set one iteration in [`TIMER_EVERY`]; a Read or an Atomic posted directly and
//!    sent whole puts its QP there at once, [`Engine::post_direct`]);
//! 2. receives a burst (up to [`RX_BURST`]) from each link and runs the RQ Logic or the
//!    completer on each packet, by opcode (a positive Ack riding in a request right after
//!    the request);
//! 3. for each active QP only: fetches new send WQEs, runs its timers, sends its queued
//!    responses (Naks, RDMA Read responses, Atomic Acknowledges) and runs the SQ Logic;
//! 4. sends the positive Acks the QPs owe, one per QP for everything it accepted
//!    ([`crate::responder::OwedAcks`]);
//! 5. publishes each link's outgoing burst with one index store, and takes down a link whose
//!    send ring the peer broke, waking all its QPs.
//!
//! Its cost grows with the QPs that have work, not with the QPs that exist: idle QPs are not
//! in the active set and are never looked at. The same `poll` runs on a dedicated engine
//! thread (poll mode) or inside the application's own `Cq::poll` (inline mode).

pub(crate) mod cell;
pub(crate) mod doorbell;
pub(crate) mod idle;
pub(crate) mod progress;
pub(crate) mod wake;

use std::sync::Arc;

use crate::arena::PdArenas;
use crate::completer;
use crate::context::{Env, QpSlot, Resources, Stats, flush_receives};
use crate::error::{Error, Result};
use crate::link::{Link, LinkId, OnPeerLoss, TxBatch};
use crate::mem::Mem;
use crate::qp::{QpAttr, QpState, plan_modify};
use crate::requester;
use crate::responder;
use crate::slots::SlotTable;
use crate::tables::cq::CqTable;
use crate::tables::mr::MrTable;
use crate::timer::Timestamp;
use crate::trace::tap::Trace;
use crate::wire::Qpn;
use crate::wire::slot::{PacketSlot, RxPacket, continuation_slots};
use crate::wqe::{SgeEntry, SqWqe, WqeFlags};
use doorbell::{ActiveSet, MAX_QPS};
use shmhca_rings::lines::{Line, MAX_FRAME_LINES};

/// Packets (frames) taken from one link per iteration.
pub(crate) const RX_BURST: usize = 32;
/// Request packets one QP may send per iteration (fairness between QPs).
const TX_BUDGET: usize = 32;
/// Iterations between two timer checks (a check costs at most one clock read, and only
/// while some QP has a timer armed; see [`crate::timer::Timestamp`]).
pub(crate) const TIMER_EVERY: u32 = 8;

/// Iterations whose step 2 does not look for a lone Send Only line after one found
/// something else (`Iteration::straight`): its look at the links, repeated by the full
/// step 2, cost a Read round trip ~90 instructions when made every iteration.
const STRAIGHT_BACKOFF: u32 = 16;
/// Iterations without a new WQE on any watched send queue after which the engine stops
/// watching them (see [`Engine::watch_sq`]).
const WATCH_IDLE: u32 = 4096;
/// The most send queues watched at once (each costs one load per iteration).
const MAX_WATCHED: u32 = 64;
/// Bits of a QPN that index the QP table; the rest is a generation tag.
const QP_INDEX_BITS: u32 = 12;
/// The bit of [`Engine::idle_word`] set while the engine is not settled (the sign bit:
/// the word read as an `i32` is then negative).
const UNSETTLED: u32 = 1 << 31;
/// The most links (peer engines, or `Context::link_with` pairs) one context can have.
pub(crate) const MAX_LINKS: u32 = crate::limits::MAX_LINKS;
const _: () = assert!(MAX_QPS <= 1 << QP_INDEX_BITS);

/// The engine's state: everything the poll loop touches.
pub(crate) struct Engine {
    /// The arena, memory regions, completion queues and counters.
    pub(crate) res: Resources,
    qps: SlotTable<QpSlot>,
    links: SlotTable<Link>,
    active: ActiveSet,
    /// QPs step 3 must visit whatever the receive step finds: their doorbell rang (new send
    /// WQEs to fetch), or something of their own put them in the active set since the last
    /// step 3 — a modify, a receive posted where the engine must look at it, their link
    /// going down — rather than a post (see [`Iteration::receive`]). Cleared by step 3.
    rung: ActiveSet,
    /// QPs out of the active set that only wait for a timer — an Ack awaited under the
    /// transport timer, or the end of an RNR wait: put back in the active set by the
    /// iterations that check timers (one in [`TIMER_EVERY`]). It may also hold QPs whose
    /// timers were disarmed since (an Ack came: that made them active); they leave it at
    /// that check.
    timed: ActiveSet,
    /// Where a received frame is copied out of its ring (private memory): a packet's slot,
    /// then its continuation lines.
    rx: Box<[Line; MAX_FRAME_LINES]>,
    /// Packet capture and observation; `None` when off (one branch per burst).
    pub(crate) trace: Option<Box<Trace>>,
    /// Iterations until the next timer check.
    timer_countdown: u32,
    /// The empty poll's word ([`Engine::idle_now`]), two things in one so that the
    /// shortcut's look at this engine's own state is one compare: the iterations until
    /// the stats area is next published (bits 0..31; the first iteration publishes), and
    /// [`UNSETTLED`] (bit 31), clear only while the engine is *settled*: no QP in any set
    /// (active, rung, timed), no Ack owed, no send queue watched, no fault stage or UDP
    /// port running, and every link with no backlog, nothing queued and its head published
    /// — as the last full iteration found it ([`Engine::nothing_due`]), with nothing
    /// changed since: the full iteration and every method that could change any of it set
    /// the bit first ([`Engine::unsettle`]). Read as an `i32`, the word is above 1 exactly
    /// when the engine is settled and no publication is due at the next iteration. Debug
    /// builds check the bit against the state at every use.
    idle_word: u32,
    /// An empty memory: what the trace reads payloads from when a packet's arena is unknown.
    nomem: Mem,
    /// Where `shmhca stat` reads this engine's counters and QPs (see `stats_area`).
    pub(crate) stats_area: Option<crate::stats_area::StatsArea>,
    /// The fault stage (`ContextBuilder::faults`); `None` when off (one branch per QP
    /// served and one per iteration).
    pub(crate) faults: Option<Box<crate::fault::Faults>>,
    /// Received packets dropped because their ICRC did not check.
    pub(crate) icrc_dropped: u64,
    /// The QPs that owe a positive Ack, by link: sent at the end of the iteration after
    /// the one that found them owing (unless the Ack rode in a request first).
    owed: responder::OwedAcks,
    /// Whether the owed Acks listed have been held back one iteration already (the next
    /// iteration with a list sends them).
    owed_held: bool,
    /// Whether this iteration listed an owed Ack of a QP that does not reply
    /// (`Responder::replies`): the list is sent at the end of the iteration, not held.
    owed_now: bool,
    /// Iterations left before step 2 looks for a lone Send Only line again
    /// (`Iteration::straight`) after it found a packet of another kind: a stream of Reads
    /// or a burst of packets does not pay the look every iteration.
    pub(crate) straight_skip: u32,
    /// Whether owed Acks are held back one iteration (so that one can ride in a request
    /// the application posts in reply) rather than sent at the end of their own: only
    /// where the next iteration is sure to come — a poll-mode engine thread, or an inline
    /// engine with the progress helper. With `Progress::Manual`, an application that
    /// stops calling after it received a message must not leave the sender without its
    /// Ack (and retrying into `RetryExcErr`).
    pub(crate) hold_acks: bool,
    /// Whether the engine watches the send queues of QPs it was just rung for (poll mode,
    /// with `membarrier`): it looks at their send rings itself every iteration and
    /// `post_send` does not ring (`Doorbell::ring_unless_watched`), until they have been
    /// idle for [`WATCH_IDLE`] iterations or the engine thread is about to sleep.
    pub(crate) watch_sq: bool,
    /// The watched QPs (the doorbell's watch bits, mirrored), how many, and the
    /// iterations left before they are unwatched.
    watched: ActiveSet,
    watched_count: u32,
    watch_idle: u32,
    /// The pumps of this context's UDP ports (`link::udp`), which the engine drives: each
    /// iteration receives their datagrams first and sends what it published last. Empty
    /// without a port (one branch per iteration and per direct post).
    pub(crate) udp: crate::link::udp::pump::Pumps,
    /// Stats publications so far (tests: the idle engine's pace).
    #[cfg(test)]
    pub(crate) stats_publications: u64,
}

impl Engine {
    /// An engine that raises its asynchronous events into `async_events`.
    pub(crate) fn new(async_events: Arc<crate::async_events::AsyncQueue>) -> Engine {
        Engine {
            res: Resources {
                pds: PdArenas::default(),
                mrs: MrTable::default(),
                mws: Default::default(),
                srqs: Default::default(),
                cqs: CqTable::default(),
                stats: Stats::default(),
                clock: Default::default(),
                async_events,
            },
            // Generations 1..=4095, so no QPN is 0 or 1 (the special QPs of the IBA).
            qps: SlotTable::new(MAX_QPS as u32, 24 - QP_INDEX_BITS),
            links: SlotTable::new(MAX_LINKS, 8),
            active: ActiveSet::new(),
            rung: ActiveSet::new(),
            timed: ActiveSet::new(),
            rx: Box::new([Line::ZERO; MAX_FRAME_LINES]),
            trace: None,
            timer_countdown: TIMER_EVERY,
            idle_word: UNSETTLED | 1,
            nomem: Mem::private(0),
            stats_area: None,
            faults: None,
            icrc_dropped: 0,
            owed: responder::OwedAcks::new(MAX_LINKS as usize, MAX_QPS),
            owed_held: false,
            owed_now: false,
            straight_skip: 0,
            hold_acks: false,
            watch_sq: false,
            watched: ActiveSet::new(),
            watched_count: 0,
            watch_idle: WATCH_IDLE,
            udp: Default::default(),
            #[cfg(test)]
            stats_publications: 0,
        }
    }

    /// The QPs (for the stats area).
    pub(crate) fn qps(&self) -> impl Iterator<Item = &QpSlot> {
        self.qps.iter().map(|(_, q)| q)
    }

    /// The QPs, to change (the fabric gives a peer arena that came late to the QPs facing
    /// it).
    pub(crate) fn qps_mut(&mut self) -> impl Iterator<Item = &mut QpSlot> {
        self.unsettle();
        self.qps.iter_mut().map(|(_, q)| q)
    }

    /// The links and their numbers (for the stats area).
    pub(crate) fn links(&self) -> impl Iterator<Item = (LinkId, &Link)> {
        self.links.iter().map(|(i, l)| (LinkId::new(i), l))
    }

    /// Adds a QP built by `make` from its index and QPN.
    pub(crate) fn add_qp(&mut self, make: impl FnOnce(Qpn) -> QpSlot) -> Result<(u32, Qpn)> {
        self.unsettle();
        let qpn = |index, generation| Qpn::new(generation << QP_INDEX_BITS | index);
        let (index, generation) =
            self.qps
                .insert_with(|i, g| make(qpn(i, g)))
                .ok_or(Error::LimitReached {
                    what: "queue pairs in one context",
                    limit: MAX_QPS as u32,
                })?;
        Ok((index, qpn(index, generation)))
    }

    /// Removes a QP: its unfinished work requests are dropped and their memory regions
    /// released. An Ack it still owes (held back for a request to ride in) leaves first.
    pub(crate) fn remove_qp(&mut self, index: u32) {
        self.unsettle();
        self.send_owed_now(index);
        let Some(mut qp) = self.qps.remove_at(index) else {
            return;
        };
        if !self.udp.is_empty() {
            // Its routes and source-port socket on the context's UDP ports.
            self.udp.forget_qp(qp.proto.qpn);
        }
        self.active.remove(index);
        self.timed.remove(index);
        self.rung.remove(index);
        self.res.mws.unbind_qp(qp.proto.qpn);
        discard_queues(&mut qp, &mut self.res.env());
    }

    /// Runs `f` on QP `qpn` and this engine's resources, as a protocol stage sees them
    /// (tests that drive a stage by hand).
    #[cfg(test)]
    pub(crate) fn with_stage<R>(
        &mut self,
        qpn: Qpn,
        f: impl FnOnce(&mut QpSlot, &mut crate::context::Env<'_>) -> R,
    ) -> Option<R> {
        self.unsettle();
        let index = qpn.get() & ((1 << QP_INDEX_BITS) - 1);
        let qp = self.qps.at_mut(index).filter(|q| q.proto.qpn == qpn)?;
        Some(f(qp, &mut self.res.env()))
    }

    /// The QP numbered `qpn`.
    pub(crate) fn qp_by_qpn(&self, qpn: Qpn) -> Option<&QpSlot> {
        let index = qpn.get() & ((1 << QP_INDEX_BITS) - 1);
        self.qps.at(index).filter(|q| q.proto.qpn == qpn)
    }

    /// The QP at `index`.
    pub(crate) fn qp_mut(&mut self, index: u32) -> Option<&mut QpSlot> {
        self.unsettle();
        self.qps.at_mut(index)
    }

    /// Sends now the Ack QP `index` owes, if any (one held back for a request to ride in
    /// included), and publishes its link: before the QP is destroyed or modified, so that a
    /// request whose completion the application may have seen is acknowledged whatever the
    /// application does with the QP next (a receiver that destroys its QP after the last
    /// message must not leave the sender retrying into `RetryExcErr`).
    fn send_owed_now(&mut self, index: u32) {
        self.unsettle();
        let Engine {
            res,
            qps,
            links,
            trace,
            faults,
            udp,
            ..
        } = self;
        let Some(qp) = qps
            .at_mut(index)
            .filter(|q| q.proto.resp.owed_ack().is_some())
        else {
            return;
        };
        let Some(d) = qp.proto.cfg.dest else { return };
        let Some(link) = links
            .at_mut(d.link.index())
            .filter(|l| l.down.is_none() && l.tx.broken().is_none())
        else {
            return;
        };
        // No room: it stays owed (and listed) for the next iteration.
        send_owed(qp, d.link, link, &mut res.env(), faults, trace);
        link.publish();
        // Over UDP the datagram leaves now: the application may destroy the QP and exit
        // before another iteration.
        if !udp.is_empty() {
            udp.send();
        }
    }

    /// Applies a modify-QP call (see [`plan_modify`]); on error nothing changes. An Ack the
    /// QP owes leaves first (see [`Engine::send_owed_now`]).
    pub(crate) fn modify_qp(&mut self, index: u32, attr: &QpAttr) -> Result<()> {
        self.unsettle();
        self.send_owed_now(index);
        let links = &self.links;
        let qp = self
            .qps
            .at_mut(index)
            .ok_or(Error::ForeignObject { what: "QP" })?;
        let (to, cfg) = plan_modify(qp.proto.state, &qp.proto.cfg, attr)?;
        if attr.path_mtu.is_some() || attr.dest.is_some() {
            check_path_mtu(links, &cfg)?;
        }
        let mut peer_mem = None;
        if let Some(d) = attr.dest {
            let link = links
                .at(d.link.index())
                .filter(|l| l.down.is_none())
                .ok_or_else(|| {
                    Error::invalid(
                        "dest",
                        format!("link {} is not a live link of this context", d.link.index()),
                    )
                })?;
            peer_mem = Some(link.peer_qp_arena(d.qpn).map(Mem::share).ok_or_else(|| {
                Error::invalid(
                    "dest",
                    format!(
                        "QP {:#x} is not known on link {}: connect through the connection \
                         manager, or create it in a context linked with Context::link_with",
                        d.qpn.get(),
                        d.link.index()
                    ),
                )
            })?);
            // Over UDP the port reads a remote QP's packets from the memory of the QP its
            // destination was made for: another QP must not use that destination.
            if link.max_in_flight.is_some() && !self.udp.has_route(qp.proto.qpn, d.qpn) {
                return Err(Error::invalid(
                    "dest",
                    format!(
                        "this destination (remote QP {:#x}) was not made for QP {:#x}: \
                         make one for it with UdpPort::destination",
                        d.qpn.get(),
                        qp.proto.qpn.get()
                    ),
                ));
            }
        }
        let from = qp.proto.state;
        qp.proto.cfg = cfg;
        if let Some(m) = peer_mem {
            qp.peer_mem = m;
        }
        let mut env = self.res.env();
        match to {
            QpState::Reset => {
                discard_queues(qp, &mut env);
                qp.proto.req.reset();
                *qp.shared
                    .last_error
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = None;
                // Before `start` forgets the count told: `advertise` stores the flag only
                // when the count it records changes.
                responder::advertise(qp, None);
                qp.proto.resp.start(cfg.rq_psn);
                qp.set_state(QpState::Reset);
            }
            QpState::Rtr if from == QpState::Init => {
                // (As at Reset: the flag first, then the count forgotten.)
                responder::advertise(qp, None);
                qp.proto.resp.start(cfg.rq_psn);
                // Over a UDP link each Ack is a datagram: only what asks is acknowledged.
                qp.proto.resp.acks_when_asked = cfg
                    .dest
                    .and_then(|d| links.at(d.link.index()))
                    .is_some_and(|l| l.max_in_flight.is_some());
                qp.set_state(QpState::Rtr);
                qp.proto.comm_est_pending = true;
            }
            QpState::Rts if from == QpState::Rtr => {
                qp.proto.comm_est_pending = false;
                qp.proto
                    .req
                    .start(&cfg, crate::timer::Clock::resolution(&self.res.clock));
                // A UDP link caps the packets in flight (a loss resends at most that many).
                let cap = cfg
                    .dest
                    .and_then(|d| links.at(d.link.index()))
                    .and_then(|l| l.max_in_flight);
                qp.proto.req.set_max_in_flight(cap);
                qp.set_state(QpState::Rts);
            }
            QpState::Error => qp.enter_error(&mut env),
            s => qp.set_state(s),
        }
        qp.shared
            .max_rd_atomic
            .store(cfg.max_rd_atomic, std::sync::atomic::Ordering::Relaxed);
        if !self.udp.is_empty()
            && (attr.hop_limit.is_some() || attr.traffic_class.is_some() || attr.dest.is_some())
        {
            let qpn = qp.proto.qpn;
            self.udp.set_ip_opts(qpn, cfg.hop_limit, cfg.traffic_class);
        }
        self.active.insert(index);
        self.rung.insert(index);
        Ok(())
    }

    /// Adds a link; returns its id.
    ///
    /// # Errors
    /// [`Error::LimitReached`] when the context has [`MAX_LINKS`] links.
    pub(crate) fn add_link(&mut self, link: Link) -> Result<LinkId> {
        self.unsettle();
        let (i, _) = self
            .links
            .insert_with(|_, _| link)
            .ok_or(Error::LimitReached {
                what: "links (peer engines) of one context",
                limit: MAX_LINKS,
            })?;
        Ok(LinkId::new(i))
    }

    /// The link `id`.
    pub(crate) fn link_mut(&mut self, id: LinkId) -> Option<&mut Link> {
        self.unsettle();
        self.links.at_mut(id.index())
    }

    /// Tears a link down: the QPs using it go to the Error state on the next iteration.
    pub(crate) fn link_down(&mut self, id: LinkId, why: String) {
        self.unsettle();
        if let Some(l) = self.link_mut(id) {
            l.down.get_or_insert(why);
        }
        wake_link_qps(&self.qps, &mut self.active, &mut self.rung, id);
    }

    /// Adds the pump of a UDP port (`link::udp`); returns its number. (Through here, not
    /// `udp.add`: the empty poll's summary word then stops standing for "no port".)
    pub(crate) fn add_pump(&mut self, pump: crate::link::udp::pump::Pump) -> u32 {
        self.unsettle();
        self.udp.add(pump)
    }

    /// Removes a link no QP uses any more.
    pub(crate) fn remove_link(&mut self, id: LinkId) {
        self.unsettle();
        self.links.remove_at(id.index());
    }

    /// One iteration of the poll loop (the steps of the module's doc, each a method of
    /// [`Iteration`]); returns the packets received and sent.
    ///
    /// An iteration that would find nothing to do returns at once ([`Engine::idle_now`]):
    /// an empty poll costs a handful of loads and no call.
    #[inline(always)]
    pub(crate) fn poll(&mut self, doorbell: &doorbell::Doorbell) -> usize {
        if self.idle_now(doorbell) {
            return 0;
        }
        self.poll_busy(doorbell)
    }

    /// [`Engine::poll`] once [`Engine::idle_now`] said there may be work.
    #[inline(always)]
    pub(crate) fn poll_busy(&mut self, doorbell: &doorbell::Doorbell) -> usize {
        self.unsettle();
        if self.udp.is_empty() {
            self.poll_links(doorbell)
        } else {
            self.poll_udp(doorbell)
        }
    }

    /// [`Engine::poll`] with UDP ports: their datagrams are received into their links'
    /// rings first, and what the iteration published on their links is sent last. The
    /// work is the frames published to the links each way and what the iteration did:
    /// datagrams dropped (a stranger's, malformed, a bad ICRC) are none, so that a flood
    /// of them lets the engine sleep. The pumps ask the QPs' state whether a packet's PSN
    /// is new (`link::udp::ip_ids`: only such packets teach a link its peer's IPv4 IDs).
    #[inline(never)]
    fn poll_udp(&mut self, doorbell: &doorbell::Doorbell) -> usize {
        let qps = &self.qps;
        let is_new = |qpn: Qpn, request: bool, psn: crate::psn::Psn| {
            qps.at(qpn.get() & ((1 << QP_INDEX_BITS) - 1))
                .filter(|q| q.proto.qpn == qpn)
                .is_some_and(|q| crate::link::udp::ip_ids::psn_is_new(&q.proto, request, psn))
        };
        let published = self.udp.receive(&self.res.clock, &is_new);
        let work = self.poll_links(doorbell);
        work + published + self.udp.send()
    }

    /// [`Engine::poll`] over the links' rings. (Never inlined: inlined into both callers,
    /// its body changed how the compiler inlined the receive path into it, which cost the
    /// shared-memory path about 50 instructions a message.)
    #[inline(never)]
    fn poll_links(&mut self, doorbell: &doorbell::Doorbell) -> usize {
        self.count_down_to_stats();
        if self.watched_count > 0 {
            self.scan_watched(doorbell);
        }
        if self.nothing_due(doorbell) {
            return 0;
        }
        let (mut it, mut env) = self.iteration();
        let straight = if *it.straight_skip == 0 {
            it.straight(&mut env, doorbell)
        } else {
            *it.straight_skip -= 1;
            None
        };
        let mut work = if let Some(n) = straight {
            // Steps 1 and 2 took one lone packet (issue 27, item 9): an iteration whose
            // steps 3 to 5 would find nothing to do ends here, with what they would
            // change — the timer countdown, the hold of the owed Acks — changed as they
            // would (nothing is queued on any link: `straight`'s condition).
            if it.active.is_empty()
                && *it.timer_countdown > 1
                && (it.owed.is_empty() || (*it.hold_acks && !*it.owed_held && !*it.owed_now))
            {
                *it.timer_countdown -= 1;
                *it.owed_held = !it.owed.is_empty();
                *it.owed_now = false;
                return n;
            }
            n
        } else {
            it.take_doorbells(doorbell); // 1
            it.receive(&mut env) // 2
        };
        let check_timers = it.timer_turn();
        work += it.serve_active(&mut env, check_timers); // 3
        it.send_owed_acks(&mut env); // 4
        it.publish(); // 5
        work
    }

    /// The empty poll's shortcut: true (and the stats countdown counted) when the full
    /// iteration would only count down — no QP active, waiting for a timer or owing an Ack;
    /// no fault stage, watched send queue or UDP port; no doorbell
    /// rung; every live link with nothing received, no backlog and nothing queued; and no
    /// stats publication due: exactly the case where [`Engine::poll_links`] would return 0
    /// from [`Engine::nothing_due`] after counting down, with the same effect (a link's
    /// ring publishes its head when found empty, in either). Anything else takes the full
    /// iteration.
    ///
    /// What only this engine changes is read from its word ([`Engine::idle_word`]),
    /// settled by the full iteration that found nothing to do ([`Engine::nothing_due`]; never
    /// with a fault stage, set when the context is built, or a UDP port, added through
    /// [`Engine::add_pump`]); what others change is read where they change it: the
    /// doorbell's summary word (this process's posts) and each live link's next stamp (the
    /// peer's frames). Timers need no look: a QP whose timer is armed is in the active or
    /// the timed set, and the word is unsettled while either holds one. The peer's frames
    /// cost one load per live link, not one word for all: the peer can write only its
    /// ring (and shared words of ours that every peer can write, where a hostile one could
    /// undo another's mark and hide its frames), and a mark of its own besides each
    /// frame's stamp would cost every publication a second line between the cores.
    #[inline(always)]
    pub(crate) fn idle_now(&mut self, doorbell: &doorbell::Doorbell) -> bool {
        // With the fast paths off (`responder::fast_tests`), every poll is a full iteration:
        // the reference the shortcut must agree with.
        #[cfg(test)]
        if !crate::probe::enabled() {
            return false;
        }
        // The word first: a busy engine (unsettled: negative) or a publication due goes on
        // to the full iteration at once.
        if (self.idle_word as i32) <= 1 || doorbell.rung() {
            return false;
        }
        debug_assert!(self.nothing_private(), "the engine's word hid work");
        // Settled, each live link's head is published (`quiet` found its ring empty): only
        // its next line's stamp is left to look at.
        if !self
            .links
            .all(|l| l.down.is_some() || l.rx.nothing_at_head())
        {
            return false;
        }
        self.idle_word -= 1;
        #[cfg(test)]
        crate::probe::count(crate::probe::Path::IdlePoll);
        true
    }

    /// Whether no QP is in any set, no Ack is owed, no send queue watched, and every live
    /// link has no backlog, nothing queued and its head published (what a clear
    /// [`UNSETTLED`] in [`Engine::idle_word`] stands for; debug builds check the word
    /// against it).
    fn nothing_private(&self) -> bool {
        let sets = self.active.summary()
            | self.rung.summary()
            | self.timed.summary()
            | self.owed.link_summary();
        sets == 0
            && self.watched_count == 0
            && self.faults.is_none()
            && self.udp.is_empty()
            && self.links.all(|l| {
                l.down.is_some() || (!l.rx_backlog && l.tx.is_empty() && l.rx.head_published())
            })
    }

    /// Sets [`UNSETTLED`] in the engine's word ([`Engine::idle_word`]): first thing in
    /// every method that may change what a settled engine stands for.
    #[inline(always)]
    fn unsettle(&mut self) {
        self.idle_word |= UNSETTLED;
    }

    /// Counts down to the next publication of the stats area, and publishes it when due:
    /// one branch per iteration when none is due, with or without a stats area.
    #[inline(always)]
    fn count_down_to_stats(&mut self) {
        self.idle_word -= 1;
        if self.idle_word & !UNSETTLED == 0 {
            self.publish_stats();
        }
    }

    /// Whether this iteration has nothing to do ([`Engine::quiet`]) and no timer check is
    /// due: then it only counts down to the next timer check, if some QP out of the active
    /// set waits for a timer (the iteration that checks is a full one).
    #[inline(always)]
    fn nothing_due(&mut self, doorbell: &doorbell::Doorbell) -> bool {
        if !self.quiet(doorbell) {
            return false;
        }
        if self.timed.is_empty() {
            // The next empty polls can take the shortcut ([`Engine::idle_now`]). (The full
            // iteration set UNSETTLED as it began.)
            if self.watched_count == 0 && self.rung.is_empty() && self.udp.is_empty() {
                self.idle_word &= !UNSETTLED;
            }
            return true;
        }
        if self.timer_countdown > 1 {
            self.timer_countdown -= 1;
            return true;
        }
        false
    }

    /// Lends the engine to one iteration: the rest of it as an [`Iteration`], and its Env
    /// (one per iteration: the clock is read at most once).
    #[inline(always)]
    fn iteration(&mut self) -> (Iteration<'_>, Env<'_>) {
        let Engine {
            res,
            qps,
            links,
            active,
            rung,
            timed,
            rx,
            trace,
            timer_countdown,
            nomem,
            faults,
            icrc_dropped,
            owed,
            hold_acks,
            owed_held,
            owed_now,
            straight_skip,
            watch_sq,
            watched,
            watched_count,
            ..
        } = self;
        let it = Iteration {
            qps,
            links,
            active,
            rung,
            timed,
            rx,
            trace,
            faults,
            nomem,
            icrc_dropped,
            timer_countdown,
            owed,
            owed_held,
            owed_now,
            straight_skip,
            hold_acks,
            watch_sq,
            watched,
            watched_count,
        };
        (it, res.env())
    }

    /// The engine's counters, with its UDP ports' added.
    pub(crate) fn stats(&self) -> Stats {
        let mut s = self.res.stats;
        self.udp.add_counters(&mut s);
        s
    }

    /// The engine thread went to sleep once more: counts it, and publishes the stats area
    /// (an engine asleep runs no iteration that would, and `shmhca stat` should see what
    /// it did up to its sleep).
    #[cold]
    pub(crate) fn note_sleep(&mut self) {
        self.res.stats.sleeps += 1;
        self.publish_stats();
    }

    /// Publishes the stats area, if there is one: one iteration in
    /// [`PUBLISH_EVERY`](crate::stats_area::PUBLISH_EVERY), and before the engine thread
    /// sleeps.
    #[cold]
    #[inline(never)]
    fn publish_stats(&mut self) {
        #[cfg(test)]
        {
            self.stats_publications += 1;
        }
        self.idle_word = (self.idle_word & UNSETTLED) | crate::stats_area::PUBLISH_EVERY;
        // A peer that took a completion channel's fd since its link was set up now wants
        // to be woken (`Device::allow_fd_sleep`): looked at here, off the packet path.
        for (_, link) in self.links.iter_mut() {
            link.refresh_peer_may_sleep();
        }
        if let Some(mut area) = self.stats_area.take() {
            use crate::stats_area::{LinkRow, QpRow};
            let links = self.links().map(|(id, link)| LinkRow {
                id: id.index(),
                up: link.down.is_none(),
                peer_pid: link.peer_pid().unwrap_or(0),
                qps: self
                    .qps()
                    .filter(|q| q.proto.cfg.dest.is_some_and(|d| d.link == id))
                    .count() as u32,
            });
            let qps = self.qps().map(|q| QpRow {
                qpn: q.proto.qpn.get(),
                state: q.proto.state,
                dest: q.proto.cfg.dest.map(|d| (d.link.index(), d.qpn.get())),
                npsn: q.proto.req.window().npsn().get(),
                acked: q.proto.req.window().acked().get(),
                epsn: q.proto.resp.epsn.get(),
            });
            area.publish(&self.stats(), links, qps);
            self.stats_area = Some(area);
        }
    }

    /// Puts QP `index` in the active set, so that the next iteration looks at it: what a
    /// doorbell does, for work queued under the engine token (a receive posted in inline
    /// mode), without the doorbell's locked instructions.
    pub(crate) fn wake_qp(&mut self, index: u32) {
        self.unsettle();
        if self.qps.at(index).is_some() {
            self.active.insert(index);
            self.rung.insert(index);
        }
    }

    /// Whether QP `index` is in the active set (for tests).
    #[cfg(test)]
    pub(crate) fn is_active(&self, index: u32) -> bool {
        self.active.contains(index)
    }

    /// Whether QP `index` is in the timed set (for tests).
    #[cfg(test)]
    pub(crate) fn is_timed(&self, index: u32) -> bool {
        self.timed.contains(index)
    }

    /// Looks at the watched send queues: one with new WQEs counts as rung. After
    /// [`WATCH_IDLE`] iterations in which none had any, stops watching them all.
    fn scan_watched(&mut self, doorbell: &doorbell::Doorbell) {
        if self.take_watched_work() {
            self.watch_idle = WATCH_IDLE;
            return;
        }
        self.watch_idle -= 1;
        if self.watch_idle == 0 {
            self.unwatch_all(doorbell);
        }
    }

    /// Marks the watched QPs whose send rings hold new WQEs as rung; whether there were any.
    fn take_watched_work(&mut self) -> bool {
        let mut found = false;
        let mut summary = self.watched.summary();
        while summary != 0 {
            let w = summary.trailing_zeros();
            summary &= summary - 1;
            let mut bits = self.watched.word(w);
            while bits != 0 {
                let i = w * 64 + bits.trailing_zeros();
                bits &= bits - 1;
                // The QP now at this index, whichever it is (a QP destroyed and another
                // created in its place inherits the watch: its posts do not ring either).
                let Some(qp) = self.qps.at_mut(i) else {
                    continue;
                };
                if qp.sq.waiting() > 0 {
                    self.active.insert(i);
                    self.rung.insert(i);
                    found = true;
                }
            }
        }
        found
    }

    /// Stops watching every watched send queue: clears the watch bits, runs the
    /// process-wide barrier (`membarrier`), then looks at the queues once more — a post
    /// that still saw its bit set published its WQE before the barrier, so this last look
    /// finds it (the asymmetric Dekker of `shmhca_rings::doorbell`).
    /// Stops watching every send queue (posts ring again): before the engine thread steps
    /// back for a busy-polling application (`Device::step_back`).
    pub(crate) fn stop_watching(&mut self, doorbell: &doorbell::Doorbell) {
        self.unwatch_all(doorbell);
    }

    fn unwatch_all(&mut self, doorbell: &doorbell::Doorbell) {
        self.unsettle();
        if self.watched_count == 0 {
            return;
        }
        let mut summary = self.watched.summary();
        while summary != 0 {
            let w = summary.trailing_zeros();
            summary &= summary - 1;
            let mut bits = self.watched.word(w);
            while bits != 0 {
                doorbell.unwatch(w * 64 + bits.trailing_zeros());
                bits &= bits - 1;
            }
        }
        cell::heavy_barrier();
        self.take_watched_work();
        self.watched.clear();
        self.watched_count = 0;
        self.watch_idle = WATCH_IDLE;
    }

    /// Adds the kick word of every live link's peer to a sleeper's wait set.
    pub(crate) fn wait_on_links(&self, set: &mut wake::WaitSet) {
        for (_, link) in self.links.iter() {
            if link.down.is_none() {
                link.wait_on_peer(set);
            }
        }
        self.udp.wait_on(set);
    }

    /// Before the engine thread sleeps: stops watching send queues (their posts must ring
    /// and wake it), then says whether the engine is still idle.
    pub(crate) fn prepare_sleep(&mut self, doorbell: &doorbell::Doorbell) -> bool {
        if !self.idle() {
            return false;
        }
        self.unwatch_all(doorbell);
        self.idle()
    }

    /// Whether an iteration would do nothing, checked at the cost of an empty poll: the
    /// doorbell's summary word and one load per link (the stamp of its receive ring's next
    /// line).
    /// Then no QP is active (a QP that only waits for a timer is in the timed set: `poll`
    /// counts the timer countdown down for it), the fault stage is off, and every live link
    /// has nothing received, no backlog and nothing queued to publish — exactly the case
    /// where the full iteration would change no state.
    #[inline]
    fn quiet(&mut self, doorbell: &doorbell::Doorbell) -> bool {
        self.active.is_empty()
            && self.owed.is_empty()
            && self.faults.is_none()
            && !doorbell.rung()
            && self.links.iter_mut().all(|(_, l)| {
                l.down.is_some() || (!l.rx_backlog && l.tx.is_empty() && l.rx.empty_at_head())
            })
    }

    /// Sends what was just posted on QP `index` right away (a post that may run the
    /// engine, see `Device::notify`): fetches its new
    /// WQEs, runs its SQ Logic (and sends any response waiting) and publishes its link —
    /// without the rest of a poll iteration, which the next [`Engine::poll`] does.
    #[inline(never)]
    pub(crate) fn send_now(&mut self, index: u32) {
        self.send_with(index, None);
    }

    /// Takes a WQE posted directly (`Device::run_for_post`: no trip through the send ring) and sends
    /// it now, after any WQEs still in the ring so that the posted order holds (a
    /// single-packet post on an idle QP straight into the link's slot: see
    /// [`requester::post`]). Returns false if the QP is gone.
    /// `ring_pushed`: how many WQEs the poster has pushed on the QP's send ring so far
    /// (when the engine has taken as many, the ring is not looked at). `rd_atomic`: whether
    /// `wqe` is a Read or an Atomic (the poster knows).
    #[inline(always)]
    pub(crate) fn post_direct(
        &mut self,
        index: u32,
        wqe: &SqWqe,
        ring_pushed: u64,
        rd_atomic: bool,
    ) -> bool {
        if rd_atomic {
            return self.post_rd_atomic_direct(index, wqe, ring_pushed);
        }
        self.send_posted(index, wqe, ring_pushed)
    }

    /// [`Engine::send_with`] of a WQE posted directly: an instance of its own, which never
    /// looks at whether there is one.
    #[inline(never)]
    fn send_posted(&mut self, index: u32, wqe: &SqWqe, ring_pushed: u64) -> bool {
        self.send_with(index, Some((wqe, ring_pushed)))
    }

    /// The straight post of Send `wr` (`WRITE`: of RDMA Write `wr` to `remote`) of one
    /// element `entry` (of registered memory or of the request's inline staging row),
    /// posted directly
    /// (`Device::run_for_post`): only what a NIC does for it, with no WQE built before it
    /// (the window's record is written from these values). Its gate — no fault stage,
    /// capture tap or UDP port; the QP live, connected, every WQE its poster pushed on
    /// the send ring taken; the link up; then the template path's own
    /// ([`requester::post_fast`]: RTS, an idle window, no RNR wait, no credit limit, the
    /// fence, the credit, a payload that fits the line, room on the link) — answers before
    /// anything changes. Then the packet goes straight into the link's ring from the QP's
    /// template with any owed Ack riding in it, the window records it, and the owed Ack's
    /// bookkeeping follows, as [`Engine::send_with`] does. Returns false, having changed
    /// nothing, when a gate is closed: the caller then posts the WQE the general way
    /// ([`Engine::post_direct`]), which gives the same answer.
    /// (A Write is an instance of its own, the template path's with its opcode and RETH
    /// known.)
    #[inline(never)]
    pub(crate) fn post_send_straight<const WRITE: bool>(
        &mut self,
        index: u32,
        ring_pushed: u64,
        wr: &crate::verbs::wr::SendWr<'_>,
        entry: SgeEntry,
        remote: crate::verbs::mr::RemoteAddr,
    ) -> bool {
        #[cfg(test)]
        if !crate::probe::enabled() {
            return false;
        }
        let Engine {
            res,
            qps,
            links,
            active,
            trace,
            faults,
            owed,
            owed_held,
            udp,
            idle_word,
            ..
        } = self;
        if faults.is_some() || trace.is_some() || !udp.is_empty() {
            return false;
        }
        let Some(qp) = qps.at_mut(index) else {
            return false;
        };
        let Some(d) = qp.proto.cfg.dest else {
            return false;
        };
        let Some(link) = links.at_mut(d.link.index()) else {
            return false;
        };
        if qp.sq.taken() != ring_pushed || link.down.is_some() {
            return false;
        }
        // (Never in memory: the template path reads it, the window's record is written
        // from it, field by field.)
        let flags = WqeFlags(wr.flags.wqe_bits());
        let w = if WRITE {
            SqWqe::write_of(wr.wr_id, flags, entry, remote.addr, remote.rkey)
        } else {
            SqWqe::send_of(wr.wr_id, flags, entry)
        };
        let was_owed = qp.proto.resp.owed_ack().is_some();
        let mut env = res.env();
        let tx = &mut link.tx;
        let posted = if WRITE {
            requester::post_fast::<TxBatch, false>(qp, &mut env, tx, &w, true)
        } else {
            requester::post_fast::<TxBatch, true>(qp, &mut env, tx, &w, true)
        };
        if !posted {
            return false;
        }
        *idle_word |= UNSETTLED;
        active.insert(index);
        responder::drain(qp, &mut env, tx);
        // An owed Ack rode (the line the template path built has room for it, and the QP
        // is in RTS): it has left. Were one still owed, it would stay on the owed list for
        // step 4 (one look: nothing may forget an Ack that has not left).
        debug_assert!(qp.proto.resp.owed_ack().is_none());
        if was_owed && qp.proto.resp.owed_ack().is_none() {
            owed.forget_head(d.link.index(), index);
            if owed.is_empty() {
                *owed_held = false;
            }
        }
        link.publish_post();
        #[cfg(test)]
        crate::probe::count(if WRITE {
            crate::probe::Path::StraightWrite
        } else {
            crate::probe::Path::StraightSend
        });
        true
    }

    /// What the engine keeps for QP `index` besides the QP's own state, for the tests
    /// that compare a fast path with the general one: whether an Ack is owed (listed),
    /// whether the owed Acks are held back, whether the QP is in the active set.
    #[cfg(test)]
    pub(crate) fn post_state(&self, index: u32) -> (bool, bool, bool) {
        (
            !self.owed.is_empty(),
            self.owed_held,
            self.active.contains(index),
        )
    }

    /// [`Engine::post_direct`] of a Read or an Atomic. The post gives its QP a turn in step 3
    /// of the next iteration, as every post does — unless the request went whole (the
    /// template path's, most often) and the QP has no work left, what the end of that turn
    /// would decide: then it only waits for its answer, in the timed set, and the next
    /// iteration need not visit it. A QP the active set held already stays there. (Sends
    /// and Writes keep the turn: the receive step takes the QP out of the active set again
    /// when the riding Ack of its answer leaves it nothing to do, see
    /// [`Iteration::receive`]; and with the timed set instead their ping-pong and stream
    /// cost more, 21 and 76 instructions a message, `bench/scripts/instructions.sh`.)
    #[inline(never)]
    fn post_rd_atomic_direct(&mut self, index: u32, wqe: &SqWqe, ring_pushed: u64) -> bool {
        let was_active = self.active.contains(index);
        if !self.send_posted(index, wqe, ring_pushed) {
            return false;
        }
        if let Some(qp) = self.qps.at(index) {
            if !was_active && !needs_attention(qp) && qp.proto.state == QpState::Rts {
                self.active.remove(index);
                if waits_for_timer(qp) {
                    self.timed.insert(index);
                }
            }
        }
        true
    }

    /// Fetches QP `index`'s new WQEs, takes `wqe` after them, runs its SQ Logic (and sends
    /// any response waiting) and publishes its link; false if the QP is gone.
    #[inline(always)]
    fn send_with(&mut self, index: u32, wqe: Option<(&SqWqe, u64)>) -> bool {
        self.unsettle();
        let Engine {
            res,
            qps,
            links,
            active,
            trace,
            faults,
            owed,
            owed_held,
            udp,
            ..
        } = self;
        let Some(qp) = qps.at_mut(index) else {
            return false;
        };
        active.insert(index);
        if wqe.is_none_or(|(_, pushed)| qp.sq.taken() != pushed) {
            requester::fetch(qp);
        }
        let wqe = wqe.map(|(w, _)| w);
        let link = qp.proto.cfg.dest.and_then(|d| {
            links
                .at_mut(d.link.index())
                .filter(|l| l.down.is_none())
                .map(|l| (d, l))
        });
        let Some((d, link)) = link else {
            if let Some(w) = wqe {
                requester::accept(qp, *w);
            }
            return true;
        };
        let mut env = res.env();
        let was_owed = qp.proto.resp.owed_ack().is_some();
        // The template path writes its packet straight into the link's ring unless the
        // fault stage or the capture tap must see it staged first.
        let staged = faults.is_some() || trace.is_some();
        // (Where the fault stage and the tap start looking: only they need it.)
        let before = if staged { link.tx.len() } else { 0 };
        let tx = &mut link.tx;
        let direct = !staged;
        #[cfg(test)]
        let direct = direct && crate::probe::enabled();
        let sent = match wqe {
            Some(w) => requester::post(qp, &mut env, tx, w, TX_BUDGET, direct),
            None => requester::transmit(qp, &mut env, tx, TX_BUDGET),
        };
        if sent > 0 {
            responder::drain(qp, &mut env, tx);
            // An Ack still owed (held back, or the last iteration found the link full)
            // rode in the request if it could, else follows it; either way it has left.
            // (Mostly it rode, or none was owed: one look, not a call.)
            if qp.proto.resp.owed_ack().is_some() {
                responder::send_owed_ack(qp, &mut env, tx);
            }
            if was_owed && qp.proto.resp.owed_ack().is_none() {
                owed.forget_head(d.link.index(), index);
                // The next Ack owed is held back from the iteration that finds it.
                if owed.is_empty() {
                    *owed_held = false;
                }
            }
        }
        if staged {
            if let Some(f) = faults.as_deref_mut() {
                f.on_sent(d.link, &mut link.tx, before, &qp.mem);
            }
            if let Some(t) = trace.as_deref_mut() {
                trace_sent(t, d.link, link.endpoints, &link.tx, before, &qp.mem);
            }
        }
        link.publish_post();
        if !udp.is_empty() {
            udp.send();
        }
        true
    }

    /// Whether no QP has work pending (the engine thread may sleep).
    pub(crate) fn idle(&self) -> bool {
        self.active.is_empty()
            && self.timed.is_empty()
            && self.owed.is_empty()
            && !self.faults.as_ref().is_some_and(|f| f.holding())
            && self.udp.idle()
    }

    /// What the fault stage did, and the packets dropped for a bad ICRC.
    pub(crate) fn fault_stats(&self) -> crate::fault::FaultStats {
        let mut s = self.faults.as_ref().map(|f| f.stats).unwrap_or_default();
        s.icrc_dropped = self.icrc_dropped;
        s
    }

    /// The earliest time at which a timer of this engine expires — the transport timer or
    /// the RNR wait of any QP — or `None` when no timer is armed.
    ///
    /// For whoever lets the engine sleep (the poll-mode engine thread with a backoff
    /// policy, automatic progress, a completion channel's waiter): sleep no longer than
    /// until this time, then drive the engine ([`Engine::poll`]), and the timer fires on
    /// time. `deadline.saturating_duration_since(crate::timer::now())` is the sleep length
    /// (zero: poll now). A timer armed after this call (by a later poll) is not counted, so
    /// ask again after every poll that did work.
    ///
    /// Timers armed since the engine last looked at its timers start counting now, as
    /// they would at the next timer check ([`crate::timer::Deadline::arm_later`]). Costs
    /// one clock read and a walk over the active and timed QPs (a QP with a timer armed is
    /// in one of the two sets): call it before sleeping, not on every poll.
    pub(crate) fn next_deadline(&mut self) -> Option<Timestamp> {
        let mut env = self.res.env();
        let mut earliest: Option<Timestamp> = None;
        for set in [&self.active, &self.timed] {
            let mut summary = set.summary();
            while summary != 0 {
                let w = summary.trailing_zeros();
                summary &= summary - 1;
                let mut bits = set.word(w);
                while bits != 0 {
                    let i = w * 64 + bits.trailing_zeros();
                    bits &= bits - 1;
                    let Some(qp) = self.qps.at_mut(i) else {
                        continue;
                    };
                    qp.proto.req.start_timers(&mut env);
                    if let Some(t) = qp.proto.poll_at() {
                        earliest = Some(earliest.map_or(t, |e| e.min(t)));
                    }
                }
            }
        }
        earliest
    }

    /// Flushes the capture file, if any.
    pub(crate) fn flush_trace(&self) {
        if let Some(t) = self.trace.as_ref().and_then(|t| t.pcap.as_ref()) {
            t.flush();
        }
    }
}

/// The engine as one iteration of the poll loop ([`Engine::poll`]) borrows it: the QP
/// and link tables, the sets, the Ack bookkeeping and the taps, each borrowed on its own
/// so that a step can hold a QP, its link and the rest at once. The iteration's Env is
/// lent to each step beside it. Every step is `#[inline(always)]` into `poll`, and this
/// struct then lives in registers, not memory. It must hold nothing whose address a call
/// takes (such as the Env itself): that keeps all of it in memory, every use of a field
/// becomes a load, and the hot path costs ~25 instructions more per message
/// (`bench/scripts/instructions.sh`).
struct Iteration<'e> {
    qps: &'e mut SlotTable<QpSlot>,
    links: &'e mut SlotTable<Link>,
    active: &'e mut ActiveSet,
    rung: &'e mut ActiveSet,
    timed: &'e mut ActiveSet,
    rx: &'e mut Box<[Line; MAX_FRAME_LINES]>,
    trace: &'e mut Option<Box<Trace>>,
    faults: &'e mut Option<Box<crate::fault::Faults>>,
    nomem: &'e Mem,
    icrc_dropped: &'e mut u64,
    timer_countdown: &'e mut u32,
    owed: &'e mut responder::OwedAcks,
    owed_held: &'e mut bool,
    owed_now: &'e mut bool,
    straight_skip: &'e mut u32,
    hold_acks: &'e bool,
    watch_sq: &'e bool,
    watched: &'e mut ActiveSet,
    watched_count: &'e mut u32,
}

impl Iteration<'_> {
    /// Step 1: the QPs whose doorbell rang join the active set (and the rung set: they
    /// have new send WQEs to fetch); where the engine watches send queues, it starts
    /// watching theirs (up to [`MAX_WATCHED`]).
    #[inline(always)]
    fn take_doorbells(&mut self, doorbell: &doorbell::Doorbell) {
        let Iteration {
            active,
            rung,
            watched,
            watched_count,
            watch_sq,
            ..
        } = self;
        doorbell.take(|i| {
            active.insert(i);
            rung.insert(i);
            if **watch_sq && **watched_count < MAX_WATCHED && !watched.contains(i) {
                doorbell.watch(i);
                watched.insert(i);
                **watched_count += 1;
            }
        });
    }

    /// Step 2: up to [`RX_BURST`] frames from each live link, one at a time, each copied
    /// out of the ring once into private lines (a packet's slot, then its continuation
    /// lines), traced, checked (ICRC, destination QP, parse), then run through the RQ
    /// Logic (a request, then the positive Ack riding in it) or the completer (a response);
    /// a QP joins the active set if that gave it work, or the timed set if it now only
    /// waits for a timer, and leaves the active set if only a post put it there and it has
    /// no work left (step 3 would only take it out). A ring the peer
    /// broke takes the link down (its QPs learn it in step 3). Notes whether a burst left
    /// frames behind (`rx_backlog`). The frames received.
    ///
    /// One loop nest, not a helper per burst and per frame: split further (inlined), the
    /// receive step cost ~5 instructions more per message (`bench/scripts/instructions.sh`).
    #[inline(always)]
    fn receive(&mut self, env: &mut Env<'_>) -> usize {
        let mut work = 0;
        for (l, link) in self.links.iter_mut() {
            if link.down.is_some() {
                continue;
            }
            let mut n = 0;
            while n < RX_BURST {
                let lines = match link.rx.recv(self.rx) {
                    Ok(Some(lines)) => lines,
                    Ok(None) => break,
                    Err(e) => {
                        link.down = Some(e.to_string());
                        wake_link_qps(self.qps, self.active, self.rung, LinkId::new(l));
                        break;
                    }
                };
                n += 1;
                // Exactly the frame's lines: the rest of the buffer is stale.
                let slots: &[PacketSlot] = bytemuck::cast_slice(&self.rx[..lines]);
                // The QP first (the BTH's place of the destination QP holds three bytes whatever
                // else the peer wrote); the packet is parsed only for a QP of this link, after the
                // trace and the ICRC check have seen it.
                let qpn = RxPacket::dest_qp(&slots[0]);
                let index = qpn.get() & ((1 << QP_INDEX_BITS) - 1);
                let qp = self.qps.at_mut(index).filter(|qp| {
                    qp.proto.qpn == qpn && qp.proto.cfg.dest.map(|d| d.link) == Some(LinkId::new(l))
                });
                if let Some(t) = self.trace.as_deref_mut() {
                    let sender = qp.as_ref().map_or(self.nomem, |q| &q.peer_mem);
                    t.packet(
                        LinkId::new(l),
                        link.endpoints,
                        false,
                        link.rx_tap,
                        slots,
                        sender,
                    );
                }
                // A packet stamped with an ICRC (its sender injects faults) is checked first and
                // dropped silently if it fails, as an HCA drops a corrupted packet.
                if slots[0].reserved & crate::fault::ICRC_FLAG != 0
                    && !crate::fault::icrc_ok(
                        slots,
                        qp.as_ref().map_or(self.nomem, |q| &q.peer_mem),
                    )
                {
                    *self.icrc_dropped += 1;
                    continue;
                }
                let Some(qp) = qp else {
                    env.stats.dropped += 1;
                    continue;
                };
                // The common small Send is known from the parse: the RQ Logic then skips
                // what the parse settled.
                let (pkt, send_only) = match RxPacket::parse_send_only(&slots[0], &slots[1..]) {
                    Some(pkt) => (pkt, true),
                    None => match RxPacket::parse_any(&slots[0], &slots[1..]) {
                        Ok(pkt) => (pkt, false),
                        Err(_) => {
                            env.stats.dropped += 1;
                            continue;
                        }
                    },
                };
                if pkt.info.request {
                    // A Read's or an Atomic's answer may go on the link at once, unless the fault
                    // stage or the trace must see it among what step 3 sends.
                    let tx =
                        (self.faults.is_none() && self.trace.is_none()).then_some(&mut link.tx);
                    let owed = (&mut *self.owed, &mut *self.owed_now, *self.owed_held);
                    take_request(qp, env, owed, (l, index), &slots[0], |qp, env| {
                        responder::on_request(qp, env, tx, &pkt, send_only)
                    });
                } else {
                    completer::on_response(qp, env, &pkt);
                }
                // Step 3 looks at the QP only if the packet gave it work there; one that now only
                // waits for a timer goes (or stays) in the timed set. One a post left active
                // (not in the rung set) leaves it when the packet left it nothing to do: a
                // ping-pong's answer whose riding Ack completed the post. (A QP rung this
                // iteration is active already; an owed Ack is on the owed list.)
                if needs_attention(qp) {
                    self.active.insert(index);
                } else {
                    if self.active.contains(index) && !self.rung.contains(index) {
                        self.active.remove(index);
                    }
                    if waits_for_timer(qp) {
                        self.timed.insert(index);
                    }
                }
            }
            link.rx_backlog = n == RX_BURST;
            work += n;
            env.stats.packets_received += n as u64;
        }
        work
    }

    /// Steps 1 and 2 when they come to one lone packet (issue 27, items 6 and 9): no
    /// doorbell rung and no QP rung, no fault stage or trace, and exactly one live link
    /// with anything at head — a lone line ([`LinesConsumer::lone_behind`]), whose bytes
    /// 5..8 say a Send Only's slot (headers a BTH alone, payload inline, no flag but a
    /// riding Ack) or an RDMA Write Only's (a BTH and a RETH) —, every live link with no
    /// backlog, nothing queued and its send ring whole. The line is copied once into
    /// private memory (by the look that finds it) and checked there ([`take_lone`]:
    /// [`RxPacket::send_only_checked`] or [`RxPacket::write_only_checked`], its QP's and
    /// link's match); then it is taken, and runs through the RQ Logic as step 2 runs it
    /// (the Write's checks those of the receive fast path, `responder::on_write_only`).
    /// Or its bytes 5..8 say a response's slot ([`response_word`]: an Acknowledge, a Read
    /// Response Only with its data inline, an Atomic Acknowledge): it is parsed on the copy
    /// by the full step's parse and handed to the completer as step 2 hands it
    /// ([`take_lone_response`]). The packets received (1; 0 when every live link is
    /// empty, where step 2 would receive nothing); `None`, with nothing changed but the
    /// empty links' heads published (as any look at an empty ring does), for anything
    /// else: steps 1 and 2 then run in full.
    ///
    /// What step 2 would have done besides is nothing: the other links are empty, and
    /// this one is empty behind the packet (so its head is published, as step 2's second
    /// look publishes it). The QP's sets end as step 2 leaves them.
    #[inline(always)]
    fn straight(&mut self, env: &mut Env<'_>, doorbell: &doorbell::Doorbell) -> Option<usize> {
        #[cfg(test)]
        if !crate::probe::enabled() {
            return None;
        }
        if self.faults.is_some() || self.trace.is_some() || doorbell.rung() || !self.rung.is_empty()
        {
            return None;
        }
        // Bytes 5..8 of the line (in its first word's top three bytes): header length a
        // BTH's, payload inline, no flag but ACK_FLAG — what `parse_send_only` wants of
        // them, known before the copy; a Write Only's: a BTH and a RETH.
        const HDR: u64 = crate::wire::bth::HEADER_LEN as u64;
        const WANT: u64 = HDR + ((crate::wire::slot::KIND_INLINE as u64) << 8);
        const WRITE_HDR: u64 = HDR + crate::wire::reth::HEADER_LEN as u64;
        const WANT_WRITE: u64 = WANT - HDR + WRITE_HDR;
        const ACK: u64 = (crate::wire::slot::ACK_FLAG as u64) << 16;
        // The two header lengths differ in one bit: either pattern is one compare.
        const EITHER: u64 = WANT ^ WANT_WRITE;
        const _: () = assert!(EITHER.count_ones() == 1 && WANT_WRITE & EITHER != 0);
        // A request's pattern (the riding Ack's flag aside): a Send Only's or a Write Only's.
        let request = |word: u64| (word & !ACK) | EITHER == WANT_WRITE;
        let mut found = None;
        for (l, link) in self.links.iter_mut() {
            if link.down.is_some() {
                continue;
            }
            if link.rx_backlog || !link.tx.is_empty() || link.tx.broken().is_some() {
                return None;
            }
            let Some(first) = link.rx.look(&mut self.rx[0])? else {
                continue;
            };
            if found.is_some()
                || (!request(first >> 40) && !response_word(first >> 40))
                || !link.rx.lone_behind(first)
            {
                *self.straight_skip = STRAIGHT_BACKOFF;
                return None;
            }
            found = Some((l, link, first));
        }
        // Nothing received anywhere: step 2 would find every ring empty and publish its
        // head, as the look did.
        let Some((l, link, first)) = found else {
            return Some(0);
        };
        let sets = (&mut *self.active, &mut *self.timed);
        let (qps, line, skip) = (&mut *self.qps, &self.rx[0], &mut *self.straight_skip);
        if !request(first >> 40) {
            return take_lone_response(env, qps, line, (l, link), skip, sets);
        }
        let owed = (&mut *self.owed, &mut *self.owed_now, *self.owed_held);
        // (Each an instance in line: the Write's out of line cost the Send's step ~20
        // instructions a message and the Write ~60, `bench/scripts/instructions.sh`.)
        if (first >> 40) & EITHER != 0 {
            return take_lone::<true>(env, qps, line, (l, link), skip, owed, sets);
        }
        take_lone::<false>(env, qps, line, (l, link), skip, owed, sets)
    }

    /// Whether this iteration checks timers: one in [`TIMER_EVERY`], busy or not (a stream
    /// of packets on one QP must not hold back another QP's RNR wait). An iteration takes
    /// well under a microsecond when idle, so timers fire within a few microseconds of
    /// their deadline; the check reads the clock only if some active QP has a timer armed.
    /// The QPs that wait for a timer then take their turn in step 3.
    #[inline(always)]
    fn timer_turn(&mut self) -> bool {
        *self.timer_countdown -= 1;
        let check_timers = *self.timer_countdown == 0;
        if check_timers {
            *self.timer_countdown = TIMER_EVERY;
            self.active.take_all(self.timed);
        }
        check_timers
    }

    /// Step 3: each active QP (walking a copy of each word of the set, so that members
    /// can leave meanwhile): its new send WQEs (if rung), its timers
    /// (if this iteration checks them), the requests its SQ Logic sends and its queued
    /// responses (Naks, RDMA Read responses, Atomic Acknowledges), shown to the fault
    /// stage and the trace — or, if its link is down or its send ring broken, the Error
    /// state; then the receives an Error QP flushes and the completions it retires. It
    /// leaves the active set when it has nothing more to do (for the timed set if it waits
    /// for a timer). The request packets sent.
    ///
    /// One loop nest, not a helper per QP: split further (inlined), the step cost up to
    /// ~10 instructions more per message (`bench/scripts/instructions.sh`).
    #[inline(always)]
    fn serve_active(&mut self, env: &mut Env<'_>, check_timers: bool) -> usize {
        let mut work = 0;
        let mut summary = self.active.summary();
        while summary != 0 {
            let w = summary.trailing_zeros();
            summary &= summary - 1;
            let mut bits = self.active.word(w);
            while bits != 0 {
                let i = w * 64 + bits.trailing_zeros();
                bits &= bits - 1;
                let Some(qp) = self.qps.at_mut(i) else {
                    self.active.remove(i);
                    continue;
                };
                #[cfg(test)]
                {
                    qp.visits += 1;
                }
                if self.rung.contains(i) {
                    requester::fetch(qp);
                }
                let link = qp
                    .proto
                    .cfg
                    .dest
                    .and_then(|d| self.links.at_mut(d.link.index()));
                match link {
                    Some(link) if link.down.is_none() && link.tx.broken().is_none() => {
                        if check_timers
                            && (qp.proto.req.timer().armed() || qp.proto.req.rnr_timer().armed())
                        {
                            requester::on_tick(qp, env, link.rx_backlog);
                        }
                        let before = link.tx.len();
                        let tx = &mut link.tx;
                        work += requester::transmit(qp, env, tx, TX_BUDGET);
                        responder::drain(qp, env, tx);
                        if let Some(f) = self.faults.as_deref_mut() {
                            if let Some(d) = qp.proto.cfg.dest {
                                f.on_sent(d.link, &mut link.tx, before, &qp.mem);
                            }
                        }
                        if let (Some(t), Some(d)) = (self.trace.as_deref_mut(), qp.proto.cfg.dest) {
                            trace_sent(t, d.link, link.endpoints, &link.tx, before, &qp.mem);
                        }
                    }
                    // The link is down, or the peer broke its send ring: the QP goes to the
                    // Error state. (A ring only broken takes the link down in step 5, which
                    // wakes every QP of the link: one the receive step took out of the
                    // active set, or an idle one, must learn it too.)
                    Some(link)
                        if qp.proto.state != QpState::Error && qp.proto.state != QpState::Reset =>
                    {
                        if link.on_peer_loss == OnPeerLoss::FailNextRequest {
                            let broken = link.tx.broken().map(|e| e.to_string());
                            let why = link.down.as_deref().or(broken.as_deref());
                            requester::on_peer_lost(qp, env, why);
                        } else {
                            qp.enter_error(env);
                        }
                    }
                    Some(_) => {}
                    None => {}
                }
                if qp.proto.state == QpState::Error {
                    flush_receives(qp, env);
                }
                completer::retire(qp, env);
                if !needs_attention(qp) {
                    self.active.remove(i);
                    if waits_for_timer(qp) {
                        self.timed.insert(i);
                    }
                }
            }
        }
        self.rung.clear();
        work
    }

    /// Step 4: the owed Acks. Where `hold_acks`, the Ack of a QP that replies to what it
    /// receives (`Responder::replies`) is held back one iteration: an application that
    /// answers a request at once (a ping-pong) sends its answer before the next iteration,
    /// and the Ack rides in the answer's line (`responder::ride_owed_ack`) instead of
    /// taking a line of its own ahead of it. The next iteration sends what is still owed:
    /// within microseconds in poll mode, or at the application's next call in inline mode
    /// (two progress-helper ticks at the latest, half the transport timer). A stream's
    /// receiver, which sends no requests, sends its Acks at once.
    #[inline(always)]
    fn send_owed_acks(&mut self, env: &mut Env<'_>) {
        if !self.owed.is_empty() {
            if *self.hold_acks && !*self.owed_held && !*self.owed_now {
                *self.owed_held = true;
            } else {
                flush_owed_acks(
                    self.owed,
                    self.qps,
                    self.links,
                    env,
                    self.faults,
                    self.trace,
                    *self.owed_held,
                );
                // Acks listed late stay, held back now: the next iteration sends them.
                *self.owed_held = *self.owed_held && !self.owed.is_empty();
            }
        }
        *self.owed_now = false;
    }

    /// Step 5: publishes every link's outgoing burst (with the packets the fault stage
    /// held that are due now). A ring the peer broke while this iteration sent on it (its
    /// consumer index went out of range): whichever step saw it first — the owed Acks of
    /// step 4 included — the link goes down here and its QPs learn it next iteration.
    #[inline(always)]
    fn publish(&mut self) {
        if let Some(f) = self.faults.as_deref_mut() {
            release_held(f, self.links, self.trace);
        }
        for (l, link) in self.links.iter_mut() {
            link.publish();
            if link.down.is_none() {
                if let Some(e) = link.tx.broken() {
                    link.down = Some(e.to_string());
                    wake_link_qps(self.qps, self.active, self.rung, LinkId::new(l));
                }
            }
        }
    }
}

/// A QP's path MTU fits its link's (a UDP link's port's active MTU).
fn check_path_mtu(links: &SlotTable<Link>, cfg: &crate::qp::QpConfig) -> Result<()> {
    let max = cfg
        .dest
        .and_then(|d| links.at(d.link.index()))
        .and_then(|l| l.max_mtu);
    match max {
        Some(max) if cfg.path_mtu.bytes() > max.bytes() => Err(Error::invalid(
            "path_mtu",
            format!(
                "{} bytes is over the active MTU of the UDP port this QP's destination is \
                 on ({} bytes: what fits its interface's MTU as RoCEv2 datagrams); set \
                 path_mtu to {} or less, or raise the interface's MTU",
                cfg.path_mtu.bytes(),
                max.bytes(),
                max.bytes()
            ),
        )),
        _ => Ok(()),
    }
}

/// Starts a fault-stage iteration: queues the held packets that are due on their links
/// (traced as sent now, with the arena they came from).
fn release_held(
    f: &mut crate::fault::Faults,
    links: &mut SlotTable<Link>,
    trace: &mut Option<Box<Trace>>,
) {
    f.tick();
    if !f.holding() {
        return;
    }
    for (l, link) in links.iter_mut() {
        if link.down.is_some() {
            continue;
        }
        let endpoints = link.endpoints;
        f.release(LinkId::new(l), &mut link.tx, |slots, mem| {
            if let Some(t) = trace.as_deref_mut() {
                t.packet(LinkId::new(l), endpoints, true, true, slots, mem);
            }
        });
    }
    f.forget_stale();
}

/// Sends the positive Acks the listed QPs owe (one per QP, covering every request it
/// accepted), link by link; a QP whose link has no room stays listed for the next
/// iteration. `held`: the list was held back an iteration (see step 4). The one place
/// owed Acks leave, apart from [`Engine::send_now`]'s path and [`Engine::send_owed_now`].
fn flush_owed_acks(
    owed: &mut responder::OwedAcks,
    qps: &mut SlotTable<QpSlot>,
    links: &mut SlotTable<Link>,
    env: &mut Env<'_>,
    faults: &mut Option<Box<crate::fault::Faults>>,
    trace: &mut Option<Box<Trace>>,
    held: bool,
) {
    owed.settle();
    let mut summary = owed.link_summary();
    while summary != 0 {
        let w = summary.trailing_zeros();
        summary &= summary - 1;
        let mut bits = owed.link_word(w);
        while bits != 0 {
            let l = w * 64 + bits.trailing_zeros();
            bits &= bits - 1;
            let mut list = owed.take(l);
            let mut link = links
                .at_mut(l)
                .filter(|k| k.down.is_none() && k.tx.broken().is_none());
            while let Some(i) = owed.pop(&mut list) {
                // Entries are hints: the QP may have sent its Ack, gone, or moved.
                let Some(qp) = qps.at_mut(i) else { continue };
                let Some(d) = qp
                    .proto
                    .cfg
                    .dest
                    .filter(|_| qp.proto.resp.owed_ack().is_some())
                else {
                    continue;
                };
                if d.link.index() != l {
                    owed.relist(d.link.index(), i);
                    continue;
                }
                // A link that went down: its QPs learn it in step 3 and go to Error.
                let Some(link) = link.as_deref_mut() else {
                    continue;
                };
                if held {
                    // Listed in this iteration: held back until the next.
                    if std::mem::take(&mut qp.proto.resp.listed_late) {
                        owed.relist(l, i);
                        continue;
                    }
                    // Held back an iteration, no request came to carry it: the QP stops
                    // holding its Acks back until it sends a request again.
                    qp.proto.resp.replies = false;
                }
                if !send_owed(qp, d.link, link, env, faults, trace) {
                    owed.relist(l, i);
                }
            }
        }
    }
}

/// Queues the Ack `qp` owes on `link` (its link, `id`), through the fault stage and the
/// trace; false if the link has no room (it stays owed).
fn send_owed(
    qp: &mut QpSlot,
    id: LinkId,
    link: &mut Link,
    env: &mut Env<'_>,
    faults: &mut Option<Box<crate::fault::Faults>>,
    trace: &mut Option<Box<Trace>>,
) -> bool {
    let before = link.tx.len();
    if !responder::send_owed_ack(qp, env, &mut link.tx) {
        return false;
    }
    if let Some(f) = faults.as_deref_mut() {
        f.on_sent(id, &mut link.tx, before, &qp.mem);
    }
    if let Some(t) = trace.as_deref_mut() {
        trace_sent(t, id, link.endpoints, &link.tx, before, &qp.mem);
    }
    true
}

/// Puts every QP of link `id` in the active set and the rung set (the link went down: step
/// 3 must show them).
fn wake_link_qps(
    qps: &SlotTable<QpSlot>,
    active: &mut ActiveSet,
    rung: &mut ActiveSet,
    id: LinkId,
) {
    for (i, q) in qps.iter() {
        if q.proto.cfg.dest.is_some_and(|d| d.link == id) {
            active.insert(i);
            rung.insert(i);
        }
    }
}

/// Traces the packets a QP queued on `tx` from position `from` on; their payloads sent by
/// reference are in `mem`, the QP's arena.
fn trace_sent(
    t: &mut crate::trace::tap::Trace,
    id: LinkId,
    endpoints: (u32, u32),
    tx: &TxBatch,
    from: usize,
    mem: &Mem,
) {
    let queued = tx.queued();
    let mut i = from;
    while i < queued.len() {
        let end = (i + 1 + continuation_slots(&queued[i])).min(queued.len());
        t.packet(id, endpoints, true, true, &queued[i..end], mem);
        i = end;
    }
}

/// The end of [`Iteration::straight`]: the lone line copied into `line`, found on link
/// `l` (`link`), a Send Only's (`WRITE`: an RDMA Write Only's) by its bytes 5..8. Its QP
/// (of that link) found and the line checked ([`RxPacket::send_only_checked`],
/// [`RxPacket::write_only_checked`]), the line is taken and runs through the RQ Logic as
/// step 2 runs it ([`take_request`]), the QP left in the sets (`active`, `timed`) as step
/// 2 leaves it; 1, the packets received. A line refused here sets the back-off
/// (`straight_skip`) and gives `None`, nothing taken: the full step runs.
#[inline(always)]
fn take_lone<const WRITE: bool>(
    env: &mut Env<'_>,
    qps: &mut SlotTable<QpSlot>,
    line: &Line,
    (l, link): (u32, &mut Link),
    straight_skip: &mut u32,
    owed: (&mut responder::OwedAcks, &mut bool, bool),
    (active, timed): (&mut ActiveSet, &mut ActiveSet),
) -> Option<usize> {
    let slot: &PacketSlot = bytemuck::cast_ref(line);
    let (index, qp) = lone_qp(qps, slot, l);
    // A line refused here (another opcode with the same headers — a Send Last, a Write
    // Middle or Last, a Write First —, or no QP of the link) holds the step back as any
    // line it does not take: each would pay this look and then the full step's.
    let pkt = if WRITE {
        RxPacket::write_only_checked(slot)
    } else {
        RxPacket::send_only_checked(slot)
    };
    let (Some(qp), Some(pkt)) = (qp, pkt) else {
        *straight_skip = STRAIGHT_BACKOFF;
        return None;
    };
    link.rx.release_lone();
    #[cfg(test)]
    crate::probe::count(if WRITE {
        crate::probe::Path::StraightWriteReceive
    } else {
        crate::probe::Path::StraightReceive
    });
    // From here as step 2 runs a request (see `receive`).
    take_request(qp, env, owed, (l, index), slot, |qp, env| {
        if WRITE {
            responder::on_write_only(qp, env, &pkt)
        } else {
            responder::on_send_only(qp, env, &pkt)
        }
    });
    took_lone(qp, index, env, (active, timed))
}

/// The QP a lone line of link `l` is for, and its index: one of this link's, or `None`
/// (as step 2 finds it).
#[inline(always)]
fn lone_qp<'q>(
    qps: &'q mut SlotTable<QpSlot>,
    slot: &PacketSlot,
    l: u32,
) -> (u32, Option<&'q mut QpSlot>) {
    let qpn = RxPacket::dest_qp(slot);
    let index = qpn.get() & ((1 << QP_INDEX_BITS) - 1);
    let qp = qps.at_mut(index).filter(|qp| {
        qp.proto.qpn == qpn && qp.proto.cfg.dest.map(|d| d.link) == Some(LinkId::new(l))
    });
    (index, qp)
}

/// The end of the straight step's taking of a line for QP `index`: the QP left in the
/// sets as step 2 leaves it (no QP is rung: a QP active now is one a post left so), the
/// packet counted; 1, the packets received.
#[inline(always)]
fn took_lone(
    qp: &QpSlot,
    index: u32,
    env: &mut Env<'_>,
    (active, timed): (&mut ActiveSet, &mut ActiveSet),
) -> Option<usize> {
    if needs_attention(qp) {
        active.insert(index);
    } else {
        active.remove(index);
        if waits_for_timer(qp) {
            timed.insert(index);
        }
    }
    env.stats.packets_received += 1;
    Some(1)
}

/// Bytes 5..8 of a lone line the straight receive step takes as a response (in the
/// first word's top three bytes, as [`Iteration::straight`] reads them): headers the
/// length of a BTH and an AETH with no payload (an Acknowledge, a Read Response Only of
/// no bytes) or with its payload inline (a Read Response Only, First or Last), or of a
/// BTH, an AETH and an AtomicAckETH (an Atomic Acknowledge); no flag (a response carries
/// no riding Ack, and a line stamped with an ICRC goes to the full step, which checks
/// it). A length, not an opcode: a Send with Immediate or Invalidate has a response's
/// header length too, and the parse ([`response_of`]) turns it away.
#[inline(always)]
fn response_word(word: u64) -> bool {
    let [none, inline, atomic] = RESPONSE_WORDS;
    word == none || word == inline || word == atomic
}

/// The patterns [`response_word`] takes.
const RESPONSE_WORDS: [u64; 3] = {
    const RESP: u64 = (crate::wire::bth::HEADER_LEN + crate::wire::aeth::HEADER_LEN) as u64;
    const INLINE: u64 = (crate::wire::slot::KIND_INLINE as u64) << 8;
    [
        RESP,
        RESP + INLINE,
        RESP + crate::wire::atomic_ack_eth::HEADER_LEN as u64,
    ]
};

/// [`take_lone`] of a response ([`response_word`]): parsed on the line's private copy with
/// every check of the full step's parse ([`RxPacket::parse_any`]), and, if it is a
/// response for a QP of this link, taken and handed to the completer as step 2 hands it
/// ([`completer::on_response`]), the QP left in the sets as step 2 leaves it; 1, the
/// packets received. Anything else sets the back-off and gives `None`, nothing taken.
#[inline(always)]
fn take_lone_response(
    env: &mut Env<'_>,
    qps: &mut SlotTable<QpSlot>,
    line: &Line,
    (l, link): (u32, &mut Link),
    straight_skip: &mut u32,
    (active, timed): (&mut ActiveSet, &mut ActiveSet),
) -> Option<usize> {
    let slot: &PacketSlot = bytemuck::cast_ref(line);
    let (index, qp) = lone_qp(qps, slot, l);
    let pkt = response_of(slot);
    let (Some(qp), Some(pkt)) = (qp, pkt) else {
        *straight_skip = STRAIGHT_BACKOFF;
        return None;
    };
    link.rx.release_lone();
    #[cfg(test)]
    crate::probe::count(crate::probe::Path::StraightResponse);
    completer::on_response(qp, env, &pkt);
    took_lone(qp, index, env, (active, timed))
}

/// The response a lone line holds, parsed by [`RxPacket::parse_any`] (every check of the
/// full step's parse); `None` for a request or a line that fails a check. (Out of line:
/// the general parse in line made the straight step's every Send pay ~15 instructions,
/// its registers' saves.)
#[inline(never)]
fn response_of(slot: &PacketSlot) -> Option<RxPacket<'_>> {
    RxPacket::parse_any(slot, &[])
        .ok()
        .filter(|p| !p.info.request)
}

/// A request's steps in step 2 (the full receive step's and the straight one's), its QP
/// found: `respond` (the RQ Logic) with the Ack riding in its line around it, and the Ack
/// it owes then listed on `owed` (the list, whether one is listed of a QP that does not
/// reply, whether the list is held back) under `at` (link, QP index).
///
/// A program waiting for its send queue's completion event gets it before the event of
/// the request that carried the Ack, as from an HCA, whose Ack leaves before the peer's
/// reply: with the send CQ armed the riding Ack is handled first (one that waits on one
/// channel for both queues, as perftest's `-e`, takes one completion per event and
/// expects the send's). Otherwise a positive Ack riding in the request's line (the parse
/// checked the word) is handled right after the request, as if it had followed in its own
/// line: after the request's completion.
#[inline(always)]
fn take_request(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    (owed, owed_now, owed_held): (&mut responder::OwedAcks, &mut bool, bool),
    (link, index): (u32, u32),
    slot: &PacketSlot,
    respond: impl FnOnce(&mut QpSlot, &mut Env<'_>),
) {
    let rides = slot.reserved & crate::wire::slot::ACK_FLAG != 0;
    let ack_first = rides && env.cqs.armed(qp.proto.send_cq);
    if ack_first {
        completer::on_riding_ack(qp, env, crate::wire::slot::riding_ack_of(slot));
    }
    respond(qp, env);
    if qp.proto.resp.owed_ack().is_some() {
        let newly = owed.push(link, index);
        *owed_now |= !qp.proto.resp.replies;
        // The held list leaves this iteration: this Ack is held its own.
        qp.proto.resp.listed_late = newly && owed_held && qp.proto.resp.replies;
    }
    if rides && !ack_first {
        completer::on_riding_ack(qp, env, crate::wire::slot::riding_ack_of(slot));
    }
}

/// Whether a QP has work now and must stay in the active set. One without, that waits for a
/// timer ([`waits_for_timer`]), goes to the timed set: until the timer check nothing but a
/// received packet (which makes it active again) gives it work — a WQE held by an RNR
/// wait goes when the wait ends, which the timer check sees. (In line in every step that
/// asks: out of line it cost a call per packet.)
#[inline(always)]
fn needs_attention(qp: &QpSlot) -> bool {
    let req = &qp.proto.req;
    (req.window().has_work() && !req.rnr_timer().armed())
        || qp.proto.resp.has_output()
        || req.window().oldest_done()
        || (qp.proto.state == QpState::Error && req.window().fetched() > req.window().retired())
        || qp.rq_flush_pending
}

/// Whether a QP has a timer armed: the transport timer, or an RNR wait.
fn waits_for_timer(qp: &QpSlot) -> bool {
    qp.proto.req.timer().armed() || qp.proto.req.rnr_timer().armed()
}

/// Drops every queued work request of a QP without completions (destroy, or Reset),
/// releasing the memory regions they held, and tells the application its queues are empty.
fn discard_queues(qp: &mut QpSlot, env: &mut Env<'_>) {
    requester::fetch(qp);
    loop {
        let win = qp.proto.req.window();
        if win.retired() == win.fetched() {
            requester::fetch(qp);
            let win = qp.proto.req.window();
            if win.retired() == win.fetched() {
                break;
            }
        }
        let w = qp.proto.req.retire_oldest();
        env.release(&w.wqe.data, &qp.tables);
    }
    qp.shared.sq_retired.store(
        qp.proto.req.window().retired(),
        std::sync::atomic::Ordering::Release,
    );
    if let Some(wqe) = qp.proto.resp.take_current_wqe() {
        qp.retire_recv(env, &wqe);
    }
    while let Some(wqe) = qp.rq.take() {
        qp.retire_recv(env, &wqe);
    }
    qp.rq_flush_pending = false;
}

// Connection manager hooks (crate::cm).
impl Engine {
    /// The peer of the QP numbered `qpn` went away: the QP goes to the Error state, so its
    /// work requests complete with flush errors. Returns false if there is no such QP (it
    /// was destroyed; its number is not reused for a while, thanks to the generation tag).
    pub(crate) fn peer_gone(&mut self, qpn: Qpn) -> bool {
        self.unsettle();
        let index = qpn.get() & ((1 << QP_INDEX_BITS) - 1);
        let exists = self.qp_by_qpn(qpn).is_some();
        exists && self.modify_qp(index, &QpAttr::new(QpState::Error)).is_ok()
    }
}

// Asynchronous events (crate::async_events).
impl Engine {
    /// A fatal error outside any work request struck the QP numbered `qpn` (its peer
    /// died): raises [`AsyncEvent::QpFatal`](crate::AsyncEvent) (`IBV_EVENT_QP_FATAL`),
    /// moves the QP to the Error state (its work requests complete with flush errors; a QP
    /// on an SRQ also raises its last-WQE event) and records `why` as its
    /// [`Qp::last_error`](crate::Qp::last_error). Returns false, with nothing done, if
    /// there is no such QP or it is in the Error state already.
    #[cold]
    pub(crate) fn qp_fatal(&mut self, qpn: Qpn, why: &str) -> bool {
        self.unsettle();
        let index = qpn.get() & ((1 << QP_INDEX_BITS) - 1);
        if self
            .qp_by_qpn(qpn)
            .is_none_or(|q| q.proto.state == QpState::Error)
        {
            return false;
        }
        // The event announces a QP already in the Error state, with its reason: both are
        // published first. Then the rest of the move (timers, flushes), and only then an
        // SRQ's QP's last-WQE event, which an HCA reports after the fatal one.
        let Some(q) = self.qps.at_mut(index) else {
            return false;
        };
        *q.shared
            .last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(why.to_owned());
        q.set_state(QpState::Error);
        let on_srq = q.srq.is_some();
        self.res
            .async_events
            .raise(crate::AsyncEvent::QpFatal { qpn });
        if self.modify_qp(index, &QpAttr::new(QpState::Error)).is_err() {
            return false;
        }
        if on_srq {
            if let Some(q) = self.qps.at_mut(index) {
                q.last_wqe_reached(&self.res.env());
            }
        }
        true
    }
}

// The fabric's peer-loss grace (crate::fabric).
impl Engine {
    /// Moves every QP facing link `id` that is not in the Error or Reset state yet to the
    /// Error state with a fatal-error event ([`Engine::qp_fatal`]), recording why
    /// (`Qp::last_error`): the link went down (`why`) and the grace the fabric gives such
    /// QPs is over.
    pub(crate) fn fail_link_qps(&mut self, id: LinkId, why: &str) {
        self.unsettle();
        let facing: Vec<(Qpn, Qpn)> = self
            .qps
            .iter()
            .filter(|(_, q)| !matches!(q.proto.state, QpState::Error | QpState::Reset))
            .filter_map(|(_, q)| {
                let d = q.proto.cfg.dest.filter(|d| d.link == id)?;
                Some((q.proto.qpn, d.qpn))
            })
            .collect();
        for (qpn, peer) in facing {
            let text = format!(
                "the peer is gone ({why}); its QP {:#x} can answer nothing more, so this QP \
                 went to the Error state (IBV_EVENT_QP_FATAL)",
                peer.get()
            );
            self.qp_fatal(qpn, &text);
        }
    }
}

/// `Engine::qp_fatal` called by hand (the fabric calls it when a lost peer's grace ends).
#[cfg(all(test, not(shmhca_loom)))]
mod qp_fatal_tests {
    use crate::verbs::wr::{RecvWr, WcStatus, WorkCompletion};
    use crate::{AccessFlags, AsyncEvent, QpState};

    #[test]
    fn qp_fatal_moves_the_qp_to_error_records_why_and_raises_the_event_once() {
        let ctx = crate::raw_peer::inline_context();
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(16).unwrap();
        let (mut a, b) = crate::raw_peer::loopback_pair(&ctx, &pd, &cq);
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        a.post_recv(&RecvWr::new(7, &[mr.sge(0, 64).unwrap()]))
            .unwrap();
        let qpn = a.qpn();
        assert!(
            ctx.shared
                .engine
                .with(|e| e.qp_fatal(qpn, "the peer process died"))
        );
        assert_eq!(a.state(), QpState::Error);
        assert_eq!(a.last_error().as_deref(), Some("the peer process died"));
        assert_eq!(ctx.try_get_async_event(), Some(AsyncEvent::QpFatal { qpn }));
        assert_eq!(ctx.try_get_async_event(), None, "B's QP is untouched");
        assert_eq!(b.state(), QpState::Rts);
        // Its receive is flushed.
        let mut wc = [WorkCompletion::default(); 2];
        assert_eq!(cq.poll(&mut wc), 1);
        assert_eq!((wc[0].wr_id, wc[0].status), (7, WcStatus::WrFlushErr));
        // Already in Error, or no such QP: nothing more.
        assert!(!ctx.shared.engine.with(|e| e.qp_fatal(qpn, "again")));
        let gone = crate::wire::Qpn::new(qpn.get() ^ 0x80_0000);
        assert!(!ctx.shared.engine.with(|e| e.qp_fatal(gone, "no QP")));
        assert_eq!(ctx.try_get_async_event(), None);
        assert_eq!(a.last_error().as_deref(), Some("the peer process died"));
    }
}

/// The watched send queues (poll mode's doorbell-free posts), driven by hand: an inline
/// context with `watch_sq` switched on, posting while this thread holds the engine token
/// so that posts take the ring path (`Device::notify`), as they do in poll mode.
#[cfg(all(test, not(shmhca_loom)))]
mod idle_tests;

#[cfg(all(test, not(shmhca_loom)))]
mod watch_tests {
    use crate::verbs::wr::{RecvWr, SendOp, SendWr, WcStatus, WorkCompletion};
    use crate::{AccessFlags, Context, Cq, Qp};

    fn connect(ctx: &Context, pd: &crate::Pd, cq: &Cq) -> (Qp, Qp) {
        crate::raw_peer::loopback_pair(ctx, pd, cq)
    }

    /// Posts one Send from `a` to `b` through the ring path; whether it rang the doorbell.
    fn send(ctx: &Context, a: &mut Qp, b: &mut Qp, mr: &crate::Mr, id: u64) -> bool {
        b.post_recv(&RecvWr::new(id, &[mr.sge(8, 8).unwrap()]))
            .unwrap();
        ctx.shared.engine.with(|_| {
            a.post_send(&SendWr::new(id, SendOp::Send, &[mr.sge(0, 8).unwrap()]))
                .unwrap();
        });
        ctx.shared.doorbell.rung()
    }

    fn completions(ctx: &Context, cq: &mut Cq, want: usize) {
        let mut wc = [WorkCompletion::default(); 4];
        let mut got = 0;
        for _ in 0..1000 {
            ctx.progress();
            let n = cq.poll(&mut wc);
            assert!(wc[..n].iter().all(|w| w.status == WcStatus::Success));
            got += n;
            if got == want {
                return;
            }
        }
        panic!("{got} of {want} completions");
    }

    #[test]
    fn posts_to_a_watched_send_queue_ring_nothing_and_still_go_out() {
        if !super::cell::barrier_available() {
            return;
        }
        let ctx = crate::raw_peer::small_inline_context();
        ctx.shared.engine.with(|e| e.watch_sq = true);
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(16).unwrap();
        let (mut a, mut b) = connect(&ctx, &pd, &cq);
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        assert!(send(&ctx, &mut a, &mut b, &mr, 1), "not watched yet: rung");
        completions(&ctx, &mut cq, 2);
        // The engine took that ring and now watches the send queue.
        for id in 2..5 {
            assert!(!send(&ctx, &mut a, &mut b, &mr, id), "watched: no ring");
            completions(&ctx, &mut cq, 2);
        }
        // A QP destroyed while watched, and another created at its index: its posts are
        // not rung either, and still go out.
        let index = a.index;
        drop(a);
        let (mut c, mut d) = connect(&ctx, &pd, &cq);
        let (sender, receiver) = if c.index == index {
            (&mut c, &mut d)
        } else {
            assert_eq!(d.index, index, "the freed index is reused");
            (&mut d, &mut c)
        };
        assert!(!send(&ctx, sender, receiver, &mr, 9));
        completions(&ctx, &mut cq, 2);
        // Idle long enough, the engine stops watching: posts ring again.
        for _ in 0..super::WATCH_IDLE + 8 {
            ctx.progress();
        }
        assert!(send(&ctx, sender, receiver, &mr, 10), "unwatched: rung");
        completions(&ctx, &mut cq, 2);
    }
}

/// The timed set, driven by hand against a raw peer: a QP that only waits for an Ack or for
/// the end of an RNR wait is passed by (out of the active set), and its timer still fires
/// when the engine has nothing else to do (inline mode, every iteration quiet but the
/// timer checks).
#[cfg(all(test, not(shmhca_loom)))]
mod timed_tests {
    use std::time::{Duration, Instant};

    use crate::mem::Mem;
    use crate::psn::Psn;
    use crate::wire::aeth::{AethRepr, CreditCode, RnrTimer, Syndrome};
    use crate::wire::opcode::Opcode;
    use crate::wire::slot::{PacketSlot, continuation_slots};
    use crate::wire::{BthRepr, Msn, PacketRepr};
    use crate::{
        AccessFlags, Context, Cq, Mr, Pd, Qp, QpCaps, SendOp, SendWr, WcStatus, WorkCompletion,
    };

    const PEER: u32 = 9;

    /// A peer's one-line Send Only to QP `qpn` at PSN `psn`, carrying "ping" inline.
    fn ping_line(qpn: crate::Qpn, psn: u32) -> PacketSlot {
        let repr = PacketRepr::new(BthRepr::new(Opcode::SendOnly, qpn, Psn::new(psn)));
        let mut s = PacketSlot::default();
        s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
        s.kind = crate::wire::slot::KIND_INLINE;
        s.payload_len = 4;
        s.data[12..16].copy_from_slice(b"ping");
        s
    }

    struct Rig {
        ctx: Context,
        _pd: Pd,
        cq: Cq,
        qp: Qp,
        mr: Mr,
        peer: crate::raw_peer::RawEnds,
        _arena: Mem,
    }

    /// A QP in RTS towards a raw peer, its transport timer short (Local Ack Timeout 8:
    /// about 1 ms), sending without end-to-end credits.
    fn rig() -> Rig {
        let ctx = crate::raw_peer::inline_context();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let mut qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
        let (link, peer, arena) = crate::raw_peer::raw_peer_link(&ctx, 64, PEER, 4096);
        crate::raw_peer::connect_to_raw_peer_with_timeout(&mut qp, link, PEER, 0, false, 8);
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        Rig {
            ctx,
            _pd: pd,
            cq,
            qp,
            mr,
            peer,
            _arena: arena,
        }
    }

    impl Rig {
        /// The PSNs of the requests the QP sent since the last call.
        fn requests(&mut self) -> Vec<u32> {
            let mut buf = [PacketSlot::default(); 16];
            let mut out = vec![];
            let mut skip = 0;
            loop {
                let n = self.peer.rx.pop_burst(&mut buf).unwrap();
                if n == 0 {
                    return out;
                }
                for s in &buf[..n] {
                    if skip > 0 {
                        skip -= 1;
                        continue;
                    }
                    skip = continuation_slots(s);
                    let (repr, _) = PacketRepr::parse(&s.data[..usize::from(s.hdr_len)]).unwrap();
                    if repr.bth.opcode.info().unwrap().request {
                        out.push(repr.bth.psn.get());
                    }
                }
            }
        }

        /// Whether the QP is in the engine's active set and in its timed set.
        fn sets(&self) -> (bool, bool) {
            let i = self.qp.index;
            self.ctx
                .shared
                .engine
                .with(|e| (e.is_active(i), e.is_timed(i)))
        }

        /// The peer answers PSN `psn` with `syndrome`.
        fn answer(&mut self, psn: u32, syndrome: Syndrome, msn: u32) {
            let mut r = PacketRepr::new(BthRepr::new(
                Opcode::Acknowledge,
                self.qp.qpn(),
                Psn::new(psn),
            ));
            r.aeth = Some(AethRepr {
                syndrome,
                msn: Msn::new(msn),
            });
            let mut s = PacketSlot::default();
            s.hdr_len = r.emit(&mut s.data).unwrap() as u8;
            assert_eq!(self.peer.tx.push_burst(&[s]).unwrap(), 1);
        }

        /// Drives the engine until the QP sends a request again; its PSNs.
        fn until_sent(&mut self, what: &str) -> Vec<u32> {
            let start = Instant::now();
            loop {
                self.ctx.progress();
                let sent = self.requests();
                if !sent.is_empty() {
                    return sent;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(20),
                    "no {what} in 20 s"
                );
            }
        }

        /// Acknowledges PSN 0 and checks the Send's completion; then, within one timer
        /// check, the engine has nothing left to look at.
        fn ack_and_complete(&mut self) {
            let ack = Syndrome::Ack {
                credits: CreditCode::NONE,
            };
            self.answer(0, ack, 1);
            let mut wc = [WorkCompletion::default(); 2];
            let mut n = 0;
            for _ in 0..100 {
                n += self.cq.poll(&mut wc[n..]);
            }
            assert_eq!(n, 1);
            assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::Success));
            for _ in 0..=super::TIMER_EVERY {
                self.ctx.progress();
            }
            assert_eq!(self.sets(), (false, false));
            assert!(self.ctx.shared.engine.with(|e| e.idle()));
        }
    }

    #[test]
    fn a_qp_waiting_for_its_ack_is_timed_not_active_and_its_timer_fires() {
        let mut r = rig();
        r.qp.post_send(&SendWr::new(1, SendOp::Send, &[r.mr.sge(0, 8).unwrap()]))
            .unwrap();
        r.ctx.progress();
        assert_eq!(r.requests(), [0]);
        r.ctx.progress();
        assert_eq!(r.sets(), (false, true), "waiting for its Ack only");
        assert!(!r.ctx.shared.engine.with(|e| e.idle()), "a timer is armed");
        assert!(r.ctx.next_timer().is_some(), "the timed QP's timer counts");
        // Nothing arrives: every iteration but the timer checks is quiet, and the timer
        // fires all the same.
        assert_eq!(r.until_sent("retransmission"), [0]);
        assert_eq!(r.ctx.stats().timeouts, 1);
        r.ctx.progress();
        assert_eq!(r.sets(), (false, true), "waiting for its Ack again");
        r.ack_and_complete();
    }

    /// A lone Send Only line that acknowledges nothing, taken by the straight receive
    /// step (issue 27) while the QP waits for its own Send's Ack, leaves the QP waiting
    /// for its timer only — timed, not active —, and the timer fires.
    #[test]
    fn a_send_received_straight_while_waiting_for_an_ack_leaves_the_qp_timed() {
        let mut r = rig();
        let sge = [r.mr.sge(32, 32).unwrap()];
        r.qp.post_recv(&crate::RecvWr::new(7, &sge)).unwrap();
        r.ctx.progress(); // the connection's turn
        r.qp.post_send(&SendWr::new(1, SendOp::Send, &[r.mr.sge(0, 8).unwrap()]))
            .unwrap();
        assert_eq!(r.requests(), [0]);
        assert_eq!(r.sets(), (true, false), "a Send keeps its turn");
        let s = ping_line(r.qp.qpn(), 0);
        assert_eq!(r.peer.tx.push_burst(&[s]).unwrap(), 1);
        let before = crate::probe::taken(crate::probe::Path::StraightReceive);
        r.ctx.progress();
        assert_eq!(
            crate::probe::taken(crate::probe::Path::StraightReceive),
            before + 1,
            "taken straight"
        );
        assert_eq!(r.sets(), (false, true), "waiting for its Ack only");
        let mut wc = [WorkCompletion::default(); 2];
        assert_eq!(r.cq.poll(&mut wc), 1);
        assert_eq!((wc[0].wr_id, wc[0].byte_len), (7, 4));
        assert_eq!(r.until_sent("retransmission"), [0]);
        assert_eq!(r.ctx.stats().timeouts, 1);
    }

    /// A lone Send Only line behind a full burst (the previous iteration took
    /// [`RX_BURST`] frames, so the link may hold more: `rx_backlog`): the straight step
    /// leaves it to step 2, which takes it and finds the ring drained — an iteration
    /// that took it straight would leave the backlog mark standing, and the engine would
    /// not settle (mutation testing found no test of this condition).
    #[test]
    fn a_lone_line_behind_a_full_burst_takes_the_full_receive_step() {
        let ctx = crate::raw_peer::inline_context();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
        let (link, mut peer, _arena) = crate::raw_peer::raw_peer_link(&ctx, 64, PEER, 4096);
        crate::raw_peer::connect_to_raw_peer_with_timeout(&mut qp, link, PEER, 0, false, 8);
        let sge = [mr.sge(0, 64).unwrap()];
        qp.post_recv(&crate::RecvWr::new(7, &sge)).unwrap();
        ctx.progress(); // the connection's turn
        let send_only = |psn: u32| ping_line(qp.qpn(), psn);
        // A full burst of duplicates (the PSN before ePSN 0), then the new Send.
        let burst = vec![send_only(0xff_ffff); super::RX_BURST];
        assert_eq!(peer.tx.push_burst(&burst).unwrap(), super::RX_BURST);
        ctx.progress();
        let backlog = |ctx: &Context| {
            ctx.shared
                .engine
                .with(|e| e.link_mut(link).unwrap().rx_backlog)
        };
        assert!(backlog(&ctx), "a full burst leaves the mark");
        // (The burst's first look held the straight step back: let it look again.)
        ctx.shared.engine.with(|e| e.straight_skip = 0);
        assert_eq!(peer.tx.push_burst(&[send_only(0)]).unwrap(), 1);
        let before = crate::probe::taken(crate::probe::Path::StraightReceive);
        ctx.progress();
        assert_eq!(
            crate::probe::taken(crate::probe::Path::StraightReceive),
            before,
            "not straight"
        );
        assert!(!backlog(&ctx), "step 2 found the ring drained");
        let mut wc = [WorkCompletion::default(); 2];
        let mut cq = cq;
        assert_eq!(cq.poll(&mut wc), 1);
        assert_eq!((wc[0].wr_id, wc[0].byte_len), (7, 4));
    }

    /// Lone lines on two links at once: the straight receive step takes neither (step 2
    /// takes both, link by link, in one iteration), so that their completions come in
    /// the order step 2 gives them.
    #[test]
    fn lone_lines_on_two_links_at_once_take_the_full_receive_step() {
        let ctx = crate::raw_peer::inline_context();
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(16).unwrap();
        let mr = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
        let mut ends = vec![];
        for k in 0..2u64 {
            let mut qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
            let (link, peer, arena) = crate::raw_peer::raw_peer_link(&ctx, 64, PEER, 4096);
            crate::raw_peer::connect_to_raw_peer_with_timeout(&mut qp, link, PEER, 0, false, 8);
            let sge = [mr.sge(64 * k, 64).unwrap()];
            qp.post_recv(&crate::RecvWr::new(k, &sge)).unwrap();
            ends.push((qp, peer, arena));
        }
        ctx.progress(); // the connections' turn
        for (qp, peer, _) in &mut ends {
            assert_eq!(peer.tx.push_burst(&[ping_line(qp.qpn(), 0)]).unwrap(), 1);
        }
        let before = crate::probe::taken(crate::probe::Path::StraightReceive);
        ctx.progress();
        assert_eq!(
            crate::probe::taken(crate::probe::Path::StraightReceive),
            before,
            "not straight"
        );
        let mut wc = [WorkCompletion::default(); 4];
        let n = cq.poll(&mut wc);
        assert_eq!(n, 2, "both in one iteration");
        assert_eq!([wc[0].wr_id, wc[1].wr_id], [0, 1], "link by link");
    }

    /// A Read or an Atomic sent whole by the direct path (inline mode: the template path)
    /// leaves its QP waiting for its answer only: in the timed set, out of the active set,
    /// so that the next iteration has nothing to visit (before: active until that
    /// iteration's step 3). Its timer still fires and resends it. A Send keeps its turn.
    #[test]
    fn a_read_or_atomic_sent_whole_leaves_its_qp_timed_not_active() {
        let mut r = rig();
        r.ctx.progress(); // the connection's turn: the QP leaves the active set
        assert_eq!(r.sets(), (false, false));
        r.qp.post_send(&SendWr::new(1, SendOp::Send, &[r.mr.sge(0, 8).unwrap()]))
            .unwrap();
        assert_eq!(r.requests(), [0], "the post sent the Send itself");
        assert_eq!(r.sets(), (true, false), "a Send keeps its turn");
        r.ack_and_complete();
        let read = SendOp::RdmaRead(r.mr.remote(0));
        r.qp.post_send(&SendWr::new(2, read, &[r.mr.sge(0, 8).unwrap()]))
            .unwrap();
        assert_eq!(r.requests(), [1], "the post sent the Read itself");
        assert_eq!(r.sets(), (false, true), "waiting for its response only");
        assert!(!r.ctx.shared.engine.with(|e| e.idle()), "a timer is armed");
        assert_eq!(r.until_sent("the Read again"), [1]);
        assert_eq!(r.ctx.stats().timeouts, 1);
    }

    /// A QP the active set held before the post of an Atomic (or a Read) stays there: the
    /// next iteration gives it its turn, and then it waits for its answer only.
    #[test]
    fn an_atomic_posted_on_an_active_qp_leaves_it_active() {
        let mut r = rig();
        let op = SendOp::FetchAdd {
            remote: r.mr.remote(0),
            add: 1,
        };
        r.qp.post_send(&SendWr::new(1, op, &[r.mr.sge(0, 8).unwrap()]))
            .unwrap();
        assert_eq!(r.requests(), [0], "the post sent the Atomic itself");
        assert_eq!(
            r.sets(),
            (true, false),
            "active since the connection: it stays"
        );
        r.ctx.progress();
        assert_eq!(r.sets(), (false, true), "then waiting for its answer only");
    }

    #[test]
    fn a_qp_in_an_rnr_wait_is_timed_not_active_and_retries_when_it_ends() {
        let mut r = rig();
        r.qp.post_send(&SendWr::new(1, SendOp::Send, &[r.mr.sge(0, 8).unwrap()]))
            .unwrap();
        r.ctx.progress();
        assert_eq!(r.requests(), [0]);
        // 10 ms: long enough that the waits below see it armed on a loaded machine.
        let rnr = Syndrome::RnrNak {
            timer: RnrTimer::new(20),
        };
        r.answer(0, rnr, 0);
        r.ctx.progress();
        r.ctx.progress();
        assert_eq!(r.ctx.stats().rnr_naks_received, 1);
        assert_eq!(
            r.sets(),
            (false, true),
            "the Send waits for the RNR wait to end"
        );
        assert_eq!(r.until_sent("retry after the RNR wait"), [0]);
        r.ack_and_complete();
    }

    mod stranding;
}
