//! The QP context as the engine holds it, and what the protocol stages work with.
//!
//! The SQ Logic ([`crate::requester`]), the completer ([`crate::completer`]) and the RQ Logic
//! ([`crate::responder`]) are functions over a [`QpSlot`] plus an [`Env`] (this engine's
//! memory, tables, completion queues, the time) and the [`LinkTx`] of the link the QP
//! talks over. They never read a clock of their own or touch a thread: the time comes from the
//! engine's [`Clock`] through the `Env` (a [`TestClock`](crate::timer::TestClock) in tests),
//! the engine calls them, and so do the scenario tests, which move packets between two
//! contexts by hand.

use crate::sync::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::Arc;

use shmhca_rings::ring::{Consumer, HeapStorage};

use crate::arena::PdArenas;
use crate::completer;
use crate::completion::{WcOpcode, WcStatus, WorkCompletion};
use crate::link::TxBatch;
use crate::mem::Mem;
use crate::qp::AccessFlags;
use crate::qp::{MAX_SGE, QpState};
use crate::tables::cq::CqTable;
use crate::tables::mr::{AccessDenied, MrTable};
use crate::tables::mw::MwTable;
use crate::tables::srq::SrqTable;
use crate::timer::{Clock, Deadline, EngineClock, Timestamp};
use crate::wire::Qpn;
use crate::wire::slot::PacketSlot;
use crate::wqe::{DataLoc, NO_MR, RqWqe, SqWqe};
use shmhca_proto::ids::PdId;
use shmhca_proto::responder::recv_completion;

/// What a QP's application handle and the engine share.
#[derive(Debug)]
pub(crate) struct QpShared {
    /// Mirror of the QP state, written by the engine (Release), read by `post_*` (Acquire).
    pub(crate) state: AtomicU8,
    /// Send WQEs retired (their window slot, gather table row and inline staging row are
    /// free again). Written by the engine with Release, read by `post_send` with Acquire.
    pub(crate) sq_retired: AtomicU64,
    /// Receive WQEs retired.
    pub(crate) rq_retired: AtomicU64,
    /// Initiator depth, mirrored for `post_send`'s checks.
    pub(crate) max_rd_atomic: AtomicU8,
    /// Set by the engine while the requester knows of fewer than
    /// [`CREDIT_WATCH`](crate::responder::CREDIT_WATCH) receive WQEs, that is of none (or
    /// has had no report yet):
    /// then `post_recv` rings the doorbell so that the engine can send a credit update.
    /// Otherwise a receive needs no doorbell at all: the engine finds it when a message
    /// arrives.
    pub(crate) rq_watch: AtomicBool,
    /// Why the QP last went to the Error state, in words, when a completion status alone
    /// does not say it (which retry counter ran out, the last PSN the peer acknowledged;
    /// which R_Key check this QP's responder failed a peer's request on).
    /// Written by the engine on that error only, read by [`crate::Qp::last_error`].
    pub(crate) last_error: std::sync::Mutex<Option<String>>,
}

impl QpShared {
    pub(crate) fn new() -> QpShared {
        QpShared {
            state: AtomicU8::new(QpState::Reset as u8),
            sq_retired: AtomicU64::new(0),
            rq_retired: AtomicU64::new(0),
            max_rd_atomic: AtomicU8::new(0),
            rq_watch: AtomicBool::new(true),
            last_error: std::sync::Mutex::new(None),
        }
    }

    /// The QP's state as last published by the engine.
    // In line across crates in a build without LTO (a program's own profile may run none):
    // this is called per message.
    #[inline]
    pub(crate) fn state(&self) -> QpState {
        // SYNC: Acquire pairs with the Release store in `QpSlot::set_state`.
        QpState::from_u8(self.state.load(Ordering::Acquire))
    }
}

/// Counters of an engine (a snapshot is returned by [`crate::Context::stats`]; `shmhca stat`
/// shows every running engine's, per QP too). A receive posted late shows as RNR Naks and a
/// retransmission, nothing else:
///
/// ```
/// use shmhca::{AccessFlags, Loopback, RecvWr, SendOp, SendWr, WcStatus};
///
/// let mut lo = Loopback::new()?;
/// let src = lo.a.pd.alloc_mr(64, AccessFlags::NONE)?;
/// let dst = lo.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
/// // The Send goes first, the receive is posted late...
/// lo.a.qp.post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 8)?]))?;
/// for _ in 0..10_000 {
///     if lo.b.ctx.stats().rnr_naks_sent > 0 {
///         break;
///     }
///     lo.b.ctx.progress();
/// }
/// assert!(lo.b.ctx.stats().rnr_naks_sent >= 1);
/// lo.b.qp.post_recv(&RecvWr::new(2, &[dst.sge(0, 64)?]))?;
/// // ... so the message arrives, once the sender has waited and sent it again.
/// assert_eq!(lo.wait_b()?.status, WcStatus::Success);
/// assert!(lo.a.ctx.stats().rnr_naks_received >= 1);
/// assert!(lo.a.ctx.stats().retransmitted >= 1);
/// # Ok::<(), shmhca::Error>(())
/// ```
pub use shmhca_proto::stats::Stats;

/// The engine state every protocol stage may use; lent to one as an [`Env`].
pub(crate) struct Resources {
    /// The protection domains' arenas.
    pub(crate) pds: PdArenas,
    pub(crate) mrs: MrTable,
    /// Memory windows.
    pub(crate) mws: MwTable,
    /// Shared receive queues.
    pub(crate) srqs: SrqTable,
    pub(crate) cqs: CqTable,
    pub(crate) stats: Stats,
    /// The clock the protocol timers run on (the system's, or a test's).
    pub(crate) clock: EngineClock,
    /// The context's asynchronous events (the device holds the same queue): raised on
    /// cold paths only.
    pub(crate) async_events: Arc<crate::async_events::AsyncQueue>,
}

impl Resources {
    /// Lends these to a protocol stage. The clock ([`Resources::clock`]) is read on first
    /// use (see [`Env::now`]); tests give the engine a [`TestClock`](crate::timer::TestClock)
    /// and move it themselves.
    pub(crate) fn env(&mut self) -> Env<'_> {
        Env {
            now: None,
            coarse: None,
            res: self,
        }
    }
}

/// This engine's side of things, lent to a protocol stage.
pub(crate) struct Env<'a> {
    /// The time of this engine iteration, read from the precise clock when first needed:
    /// most iterations need no time at all (see [`Timestamp`] on what reading it costs).
    now: Option<Timestamp>,
    /// The coarse time of this iteration, read when first needed: enough to tell that a
    /// deadline is still far away.
    coarse: Option<Timestamp>,
    /// The engine's tables, counters and clock (one pointer: lending them costs one store).
    /// An `Env` derefs to them, so a stage writes `env.cqs`, `env.stats`.
    pub(crate) res: &'a mut Resources,
}

impl std::ops::Deref for Env<'_> {
    type Target = Resources;
    #[inline(always)]
    fn deref(&self) -> &Resources {
        self.res
    }
}

impl std::ops::DerefMut for Env<'_> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut Resources {
        self.res
    }
}

impl Env<'_> {
    /// Starts `d` if it was armed to start later.
    pub(crate) fn start(&mut self, d: &mut Deadline) {
        if let Deadline::Starting(_) = d {
            let now = self.now();
            // (Read here, not when the Env is lent: most iterations start no timer.)
            d.start(now, self.res.clock.resolution());
        }
    }

    /// The time of this iteration (read from the engine clock once).
    #[inline]
    pub(crate) fn now(&mut self) -> Timestamp {
        let clock = &self.res.clock;
        *self.now.get_or_insert_with(|| clock.now())
    }

    /// Whether `d` has passed. Reads the precise clock only when the coarse clock cannot
    /// tell that `d` is still ahead (see [`Deadline::expired_by`]).
    #[inline]
    pub(crate) fn expired(&mut self, d: &Deadline) -> bool {
        if !matches!(d, Deadline::At(_)) {
            return false;
        }
        if let Some(now) = self.now {
            return d.expired(now);
        }
        let coarse = *self.coarse.get_or_insert_with(|| self.res.clock.coarse());
        let lag = self.res.clock.coarse_lag();
        d.expired_by(coarse, lag, || self.now())
    }

    /// Checks a remote access of `len` bytes at `va` with R_Key `rkey`, arriving at QP `qpn`
    /// of protection domain `pd`: through a memory window if the key is a window's (its
    /// range, rights, domain and QP decide), else through the region's own key. Returns the
    /// arena offset of `va`.
    #[inline(always)]
    pub(crate) fn check_remote(
        &self,
        rkey: u32,
        (pd, qpn): (PdId, Qpn),
        need: AccessFlags,
        va: u64,
        len: u64,
    ) -> Result<u64, AccessDenied> {
        if len != 0 && crate::tables::mw::is_window_key(rkey) {
            self.res
                .mws
                .check_remote(&self.res.mrs, rkey, (pd.get(), qpn), need, va, len)
        } else {
            self.mrs.check_remote(rkey, pd.get(), need, va, len)
        }
    }

    /// Takes the next receive WQE for QP `qp`: from its shared receive queue if it has one,
    /// else from its own receive queue.
    #[inline]
    pub(crate) fn take_recv(&mut self, qp: &mut QpSlot) -> Option<RqWqe> {
        match qp.srq {
            None => qp.rq.take(),
            Some(SrqBinding { srq, scratch }) => {
                let res = &mut *self.res;
                res.srqs.take(srq, &qp.tables, scratch, &res.async_events)
            }
        }
    }

    /// Drops the in-flight references a retired WQE held on its memory regions; `tables` is
    /// the QP's private table memory, where a multi-element list is.
    #[inline]
    pub(crate) fn release(&mut self, data: &DataLoc, tables: &Mem) {
        // The common cases without a table to read, inline in the caller: nothing, or one
        // range (inline data staged in the arena has no region: NO_MR).
        match *data {
            DataLoc::Empty => {}
            DataLoc::Single(e) => {
                if e.mr != NO_MR {
                    self.res.mrs.release(e.mr, &mut self.res.pds);
                }
            }
            DataLoc::Table { .. } => self.release_table(data, tables),
        }
    }

    /// [`Env::release`] of a multi-element list, whose regions are in the QP's table memory.
    #[inline(never)]
    fn release_table(&mut self, data: &DataLoc, tables: &Mem) {
        let mut mrs = [0u32; MAX_SGE as usize];
        let mut n = 0;
        data.for_each_mr(tables, |mr| {
            if n < mrs.len() {
                mrs[n] = mr;
                n += 1;
            }
        });
        for &mr in &mrs[..n] {
            self.res.mrs.release(mr, &mut self.res.pds);
        }
    }
}

#[cfg(test)]
impl Env<'_> {
    /// Moves the engine's test clock to `t` (if it is behind) and forgets the time this
    /// iteration read, so that the next question reads the clock again. Panics on an
    /// engine on the system clock: a test that jumps in time builds its context with a
    /// test clock.
    pub(crate) fn jump_to(&mut self, t: Timestamp) {
        match &self.res.clock {
            EngineClock::Test(c) => c.advance_to(t),
            EngineClock::System => panic!("Env::jump_to needs an engine on a TestClock"),
        }
        self.now = None;
        self.coarse = None;
    }
}

impl shmhca_proto::timer::Timers for Env<'_> {
    #[inline]
    fn now(&mut self) -> Timestamp {
        Env::now(self)
    }

    #[inline]
    fn start(&mut self, d: &mut Deadline) {
        Env::start(self, d)
    }

    #[inline]
    fn expired(&mut self, d: &Deadline) -> bool {
        Env::expired(self, d)
    }
}

/// What the protocol stages need of a link to send packets: room, a packet to fill, and a
/// way to queue it. The stages are generic over it and know nothing else of links, so a
/// second kind of link (e.g. RoCEv2 datagrams over UDP carrying the same packets) needs an
/// implementation of this trait and a receive loop in the engine, and no change to the SQ
/// Logic, the RQ Logic or the completer. Receiving is the engine's side: it takes packets
/// from a link and hands each, checked, to [`crate::responder::on_request`] or
/// [`crate::completer::on_response`].
///
/// The shared-memory link implements it with [`TxBatch`]; the scenario tests with a plain
/// vector ([`VecLink`]).
pub(crate) trait LinkTx {
    /// Whether one more packet with up to `extra` continuation slots fits now.
    fn has_room_for(&mut self, extra: usize) -> bool;
    /// The next packet to fill (its first slot and `extra` continuation slots), or `None`
    /// if there is no room. The stage calls [`LinkTx::commit`] once it is filled, or
    /// drops it (nothing is sent).
    fn next_packet(&mut self, extra: usize) -> Option<(&mut PacketSlot, &mut [PacketSlot])>;
    /// Queues the packet last returned by [`LinkTx::next_packet`].
    fn commit(&mut self);
    /// Sends the one-line packet last returned by [`LinkTx::next_packet`]`(0)`: straight
    /// into the link, if `direct` and the link can (see `TxBatch::send_line`), else as
    /// [`LinkTx::commit`] queues it.
    #[inline]
    fn send_line(&mut self, direct: bool) {
        let _ = direct;
        self.commit();
    }
    /// How far the peer has read the link (a count that only grows), looked up afresh:
    /// two equal answers mean the peer freed no room in between. For a QP that waits for
    /// room only (a slow path: it reads the peer's index).
    fn peer_mark(&mut self) -> u64;

    /// Whether one more single-slot packet fits now.
    #[inline]
    fn has_room(&mut self) -> bool {
        self.has_room_for(0)
    }

    /// The next single-slot packet to fill.
    #[inline]
    fn next_slot(&mut self) -> Option<&mut PacketSlot> {
        self.next_packet(0).map(|(s, _)| s)
    }
}

impl LinkTx for TxBatch {
    #[inline]
    fn has_room_for(&mut self, extra: usize) -> bool {
        TxBatch::has_room_for(self, extra)
    }

    #[inline]
    fn next_packet(&mut self, extra: usize) -> Option<(&mut PacketSlot, &mut [PacketSlot])> {
        TxBatch::next_packet(self, extra)
    }

    #[inline]
    fn commit(&mut self) {
        TxBatch::commit(self)
    }

    #[inline(always)]
    fn next_slot(&mut self) -> Option<&mut PacketSlot> {
        TxBatch::next_line(self)
    }

    #[inline(always)]
    fn send_line(&mut self, direct: bool) {
        TxBatch::send_line(self, direct)
    }

    fn peer_mark(&mut self) -> u64 {
        TxBatch::peer_mark(self)
    }
}

/// A link that collects the packets sent into a vector (scenario tests drive the protocol
/// stages with it, without rings or engines).
#[cfg(test)]
#[derive(Default)]
pub(crate) struct VecLink {
    /// The packets queued, each as its slots.
    pub(crate) sent: Vec<Vec<PacketSlot>>,
    /// Packets that fit before the link reports no room.
    pub(crate) room: usize,
    /// What [`LinkTx::peer_mark`] answers (the test moves it to play a peer that reads).
    pub(crate) mark: u64,
    filling: Vec<PacketSlot>,
}

#[cfg(test)]
impl LinkTx for VecLink {
    fn has_room_for(&mut self, _extra: usize) -> bool {
        self.sent.len() < self.room
    }

    fn next_packet(&mut self, extra: usize) -> Option<(&mut PacketSlot, &mut [PacketSlot])> {
        if !self.has_room_for(extra) {
            return None;
        }
        self.filling = vec![PacketSlot::default(); 1 + extra];
        self.filling.split_first_mut()
    }

    fn commit(&mut self) {
        let mut packet = std::mem::take(&mut self.filling);
        let extra = crate::wire::slot::continuation_slots(&packet[0]);
        packet.truncate(1 + extra);
        self.sent.push(packet);
    }

    fn peer_mark(&mut self) -> u64 {
        self.mark
    }
}

/// A queue of work requests the application posts and the engine takes, as the protocol
/// stages see it: take the next one, count those waiting. (The queue is a ring in this
/// process's private memory; the stages never see the ring.) Counts what it gave out.
pub(crate) struct Posted<T>(Consumer<T, HeapStorage<T>>, u64);

impl<T: Copy> Posted<T> {
    /// The engine's end of a queue.
    pub(crate) fn new(ring: Consumer<T, HeapStorage<T>>) -> Posted<T> {
        Posted(ring, 0)
    }

    /// The next work request, if one was posted.
    #[inline]
    pub(crate) fn take(&mut self) -> Option<T> {
        // A heap ring of this process: no peer can break it.
        let w = self.0.pop().ok().flatten();
        self.1 += u64::from(w.is_some());
        w
    }

    /// How many were taken so far: a poster that knows how many it pushed tells from it
    /// that the queue is empty without looking at the ring.
    #[inline]
    pub(crate) fn taken(&self) -> u64 {
        self.1
    }

    /// Whether none is waiting: one load when none is known (nothing cached changes).
    #[inline(always)]
    pub(crate) fn looks_empty(&self) -> bool {
        self.0.looks_empty()
    }

    /// How many are waiting.
    #[inline]
    pub(crate) fn waiting(&mut self) -> u32 {
        self.0.available().map_or(0, |n| n as u32)
    }

    /// Whether exactly `known` are waiting, `known` a count [`Posted::waiting`] returned:
    /// one load, nothing checked (a count read wrong only compares unequal).
    #[inline(always)]
    pub(crate) fn still_waiting(&self, known: u32) -> bool {
        self.0.peek_available() == Some(u64::from(known))
    }
}

/// A QP's shared receive queue, as the QP holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SrqBinding {
    /// The shared receive queue's number.
    pub(crate) srq: shmhca_proto::ids::SrqId,
    /// The offset in the QP's `tables` of its scratch row, where the scatter list of a WQE
    /// taken from the SRQ is copied (see [`crate::tables::srq`]).
    pub(crate) scratch: u64,
}

/// A QP as the engine holds it, its slot: the protocol half ([`shmhca_proto::qp::Qp`]:
/// number, domain, state, context, CQs, SQ and RQ Logic) beside what the engine owns for
/// it — its memory (arena, the peer's arena, private tables), the queues the application
/// posts to, what it shares with the application, and the link-side state of riding Acks.
pub(crate) struct QpSlot {
    /// The protocol half.
    pub(crate) proto: shmhca_proto::qp::Qp,
    /// The protection domain's arena: this QP's gather sources, scatter targets, RDMA
    /// targets and inline staging.
    pub(crate) mem: Mem,
    /// The arena the peer QP sends from (read-only), known from RTR on; before that an
    /// empty memory, where every payload reference is out of range.
    pub(crate) peer_mem: Mem,
    /// Private memory holding the rows of multi-element scatter/gather lists (written by
    /// `post_send`/`post_recv`, read by the engine; no peer can map it).
    pub(crate) tables: Mem,
    /// Send WQEs posted by the application.
    pub(crate) sq: Posted<SqWqe>,
    /// Receive WQEs posted by the application.
    pub(crate) rq: Posted<RqWqe>,
    pub(crate) shared: Arc<QpShared>,
    /// Receive WQEs taken from the RQ ring and retired (for `QpShared::rq_retired`).
    pub(crate) rq_retired: u64,
    /// In the Error state: the last flush of the receive WQEs stopped at a full receive CQ
    /// (the engine keeps the QP active to finish it).
    pub(crate) rq_flush_pending: bool,
    /// The shared receive queue this QP takes its receive WQEs from (its own `rq` stays
    /// empty).
    pub(crate) srq: Option<SrqBinding>,
    /// The credit code of the receive WQEs last counted, and that count (the Acks'
    /// `credit_code`: recomputed only when the count changed).
    pub(crate) credits: crate::responder::CreditCache,
    /// Posts sent on the template path (tests check that it is taken).
    #[cfg(test)]
    pub(crate) fast_posts: u64,
    /// Turns this QP took in step 3 (tests check that an iteration had none to give).
    #[cfg(test)]
    pub(crate) visits: u64,
}

impl QpSlot {
    /// Changes the state and publishes it to the application.
    pub(crate) fn set_state(&mut self, state: QpState) {
        self.proto.state = state;
        // SYNC: Release pairs with the Acquire load in `QpShared::state`.
        self.shared.state.store(state as u8, Ordering::Release);
    }

    /// Moves the QP to the Error state (spec: a fatal error on either side). Work requests
    /// still queued complete with a flush error as the engine retires them. Its timers
    /// stop: nothing is retried in the Error state, and an armed timer would keep the QP
    /// in the engine's timed set (the engine never idle) — forever if its link is down.
    pub(crate) fn enter_error(&mut self, env: &mut Env<'_>) {
        let entering = self.proto.state != QpState::Error;
        if entering {
            self.set_state(QpState::Error);
        }
        self.proto.req.stop_timers();
        completer::retire(self, env);
        flush_receives(self, env);
        // After the flushes it announces (a program that drains the CQ on this event and
        // then destroys the QP must find the flush completions there).
        if entering && self.srq.is_some() {
            self.last_wqe_reached(env);
        }
    }

    /// A QP on an SRQ entered the Error state: it takes no more receives from the SRQ
    /// (`IBV_EVENT_QP_LAST_WQE_REACHED`).
    #[cold]
    #[inline(never)]
    pub(crate) fn last_wqe_reached(&self, env: &Env<'_>) {
        env.async_events.raise(crate::AsyncEvent::QpLastWqeReached {
            qpn: self.proto.qpn,
        });
    }

    /// The first request since the QP entered RTR arrived while it is still in RTR
    /// (`IBV_EVENT_COMM_EST`); the caller checked `comm_est_pending`.
    #[cold]
    #[inline(never)]
    pub(crate) fn comm_established(&mut self, env: &Env<'_>) {
        self.proto.comm_est_pending = false;
        if self.proto.state == QpState::Rtr {
            env.async_events.raise(crate::AsyncEvent::CommEstablished {
                qpn: self.proto.qpn,
            });
        }
    }

    /// Completes receive WQE `wqe` with `wc`: retires it (its regions and its queue slot
    /// are free again), then pushes the completion — so that an application reacting to
    /// the completion finds the slot free and the regions idle. False, with nothing done,
    /// if the receive CQ is full.
    pub(crate) fn complete_recv(
        &mut self,
        env: &mut Env<'_>,
        wqe: &RqWqe,
        wc: WorkCompletion,
    ) -> bool {
        if !env.cqs.has_room(self.proto.recv_cq) {
            return false;
        }
        self.retire_recv(env, wqe);
        if wc.status == WcStatus::WrFlushErr {
            env.stats.flushed += 1;
        }
        let pushed = env.cqs.push(self.proto.recv_cq, wc);
        debug_assert!(pushed, "room was checked");
        true
    }

    /// Counts one receive WQE retired and publishes it. (In line: both receive steps' fast
    /// paths call it, and called from two places it was compiled out of line.)
    #[inline(always)]
    pub(crate) fn retire_recv(&mut self, env: &mut Env<'_>, wqe: &RqWqe) {
        env.release(&wqe.data, &self.tables);
        if self.srq.is_some() {
            // Counted by the SRQ when the WQE was taken.
            return;
        }
        self.rq_retired += 1;
        // SYNC: Release pairs with the Acquire load in `Qp::post_recv`: the engine's writes
        // into the buffers happen-before the application reuses the slot.
        self.shared
            .rq_retired
            .store(self.rq_retired, Ordering::Release);
    }
}

/// Completes every receive WQE of a QP in the Error state with a flush error, as far as the
/// receive CQ has room.
pub(crate) fn flush_receives(qp: &mut QpSlot, env: &mut Env<'_>) {
    if qp.proto.state != QpState::Error {
        return;
    }
    // Until every receive WQE is flushed, the CQ was full.
    qp.rq_flush_pending = true;
    // A message half received when the error struck.
    if let Some(wqe) = qp.proto.resp.take_current_wqe() {
        let wc = recv_completion(
            &qp.proto,
            wqe.wr_id,
            qp.proto.resp.current_flush_status(),
            WcOpcode::Recv,
            0,
            None,
            false,
        );
        if !qp.complete_recv(env, &wqe, wc) {
            qp.proto.resp.put_back_current_wqe(wqe);
            return;
        }
    }
    loop {
        if !env.cqs.has_room(qp.proto.recv_cq) {
            return;
        }
        let Some(wqe) = qp.rq.take() else { break };
        let wc = recv_completion(
            &qp.proto,
            wqe.wr_id,
            WcStatus::WrFlushErr,
            WcOpcode::Recv,
            0,
            None,
            false,
        );
        qp.complete_recv(env, &wqe, wc);
    }
    qp.rq_flush_pending = false;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::psn::Psn;
    use crate::wire::opcode::Opcode;
    use crate::wire::slot::RxPacket;
    use crate::wqe::{DataLoc, WqeFlags, WqeOp};
    use crate::{EngineMode, QpCaps};

    fn wqe(op: WqeOp, len: u32) -> SqWqe {
        SqWqe {
            wr_id: 7,
            op,
            flags: WqeFlags(WqeFlags::SIGNALED),
            imm: 0,
            len,
            remote_addr: 0x1000,
            rkey: 0x42,
            compare_add: 0,
            swap: 0,
            data: DataLoc::Empty,
        }
    }

    /// The SQ Logic runs against a link that is a plain vector: the protocol stages need
    /// nothing of rings or engines to produce packets, and stop when the link is full.
    #[test]
    fn the_sq_logic_sends_through_any_link() {
        let ctx = crate::Context::builder()
            .mode(EngineMode::Inline)
            .huge_pages(shmhca_rings::HugePages::Never)
            .build()
            .unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let mut qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
        let (link, _ends, _arena) = crate::raw_peer::raw_peer_link(&ctx, 64, 9, 4096);
        crate::raw_peer::connect_to_raw_peer(&mut qp, link, 9, 100, true);
        let mut vec_link = VecLink {
            room: 1,
            ..VecLink::default()
        };
        let qpn = qp.qpn();
        ctx.shared.engine.with(|e| {
            e.with_stage(qpn, |q, env| {
                crate::requester::accept(q, wqe(WqeOp::Write, 0));
                crate::requester::accept(q, wqe(WqeOp::Read, 1000));
                let tx = &mut vec_link;
                assert_eq!(crate::requester::transmit(q, env, tx, 16), 1);
                assert!(q.proto.req.window().has_work(), "the Read waits for room");
                tx.room = 2;
                assert_eq!(crate::requester::transmit(q, env, tx, 16), 1);
                // A Read of 1,000 bytes at PMTU 256 takes 4 response PSNs.
                assert_eq!(q.proto.req.window().npsn(), Psn::new(105));
            })
            .unwrap()
        });
        let parsed: Vec<_> = vec_link
            .sent
            .iter()
            .map(|p| RxPacket::parse(&p[0], &p[1..]).unwrap())
            .collect();
        assert_eq!(parsed[0].bth().opcode, Opcode::RdmaWriteOnly);
        assert_eq!(parsed[0].reth().unwrap().rkey, 0x42);
        assert_eq!(parsed[0].bth().psn, Psn::new(100));
        assert_eq!(parsed[0].bth().dest_qp, Qpn::new(9));
        assert_eq!(parsed[1].bth().opcode, Opcode::RdmaReadRequest);
        assert_eq!(parsed[1].bth().psn, Psn::new(101));
        assert_eq!(parsed[1].reth().unwrap().dma_len, 1000);
    }
}
