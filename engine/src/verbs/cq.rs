//! Completion queues.

use std::sync::Arc;
use std::time::{Duration, Instant};

use shmhca_rings::ring::{StampedConsumer, stamped_ring};

use crate::completion::WorkCompletion;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::tables::cq::{Arm, Signal};
use crate::verbs::EngineMode;
use crate::verbs::channel::{self, CompChannel};

/// The deepest completion queue.
pub(crate) const MAX_CQ_DEPTH: u32 = crate::limits::MAX_CQ_DEPTH;

/// A completion queue: work completions of the QPs created with it, oldest first.
///
/// A full CQ never loses a completion: the engine holds the work request back (and
/// answers incoming Sends with RNR Naks) until the application polls.
///
/// ```
/// use shmhca::{AccessFlags, Loopback, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion};
///
/// let mut lo = Loopback::new()?;
/// let mr = lo.a.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
/// let target = lo.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
/// lo.a.qp.post_send(&SendWr::new(7, SendOp::RdmaWrite(target.remote(0)), &[mr.sge(0, 8)?]))?;
/// // Poll in batches; in inline mode each poll also runs the engine.
/// let mut wcs = [WorkCompletion::default(); 16];
/// let n = loop {
///     let n = lo.a.cq.poll(&mut wcs);
///     if n > 0 {
///         break n;
///     }
///     lo.progress();
/// };
/// assert_eq!(n, 1);
/// assert_eq!((wcs[0].wr_id, wcs[0].opcode, wcs[0].status), (7, WcOpcode::RdmaWrite, WcStatus::Success));
/// # Ok::<(), shmhca::Error>(())
/// ```
pub struct Cq {
    shared: Arc<Device>,
    pub(crate) cqn: shmhca_proto::ids::CqId,
    /// The application's end of the queue's stamped ring: a completion is there when its
    /// slot's stamp says so (one load), no producer index to read first.
    consumer: StampedConsumer<WorkCompletion>,
    /// The channel this queue reports to and its slot there.
    channel: Option<(Arc<Signal>, u32)>,
    /// A channel of its own, made by the first [`Cq::wait`] in poll mode.
    own_channel: Option<CompChannel>,
    /// The last poll found the queue empty (the engine thread steps back for an
    /// application that keeps doing that: `Device::on_app_poll`).
    last_empty: bool,
}

impl Cq {
    pub(crate) fn create(shared: &Arc<Device>, depth: u32) -> Result<Cq> {
        if depth == 0 || depth > MAX_CQ_DEPTH {
            return Err(Error::invalid(
                "completion queue depth",
                format!("{depth}; a CQ holds 1 to {MAX_CQ_DEPTH} completions"),
            ));
        }
        let (producer, consumer) = stamped_ring(depth.next_power_of_two() as usize)
            .map_err(|e| Error::invalid("completion queue depth", e.to_string()))?;
        let cqn =
            shared
                .engine
                .with(|e| e.res.cqs.insert(producer))
                .ok_or(Error::LimitReached {
                    what: "completion queues in one context",
                    limit: crate::tables::cq::MAX_CQS,
                })?;
        Ok(Cq {
            shared: shared.clone(),
            cqn,
            consumer,
            channel: None,
            own_channel: None,
            last_empty: false,
        })
    }

    /// Makes this queue report its events to `channel` (once, at creation).
    pub(crate) fn attach(&mut self, channel: &CompChannel) -> Result<()> {
        let slot = channel.attach(self.cqn.get())?;
        let signal = channel.signal.clone();
        let cqn = self.cqn;
        self.shared.engine.with(|e| {
            if let Some(n) = e.res.cqs.notify(cqn) {
                n.attach(signal.clone(), slot);
            }
        });
        self.channel = Some((signal, slot));
        Ok(())
    }

    /// This queue's number: what [`CompChannel::get_event`] returns for it.
    pub fn number(&self) -> u32 {
        self.cqn.get()
    }

    /// Arms the queue (one-shot, like `ibv_req_notify_cq`): the next completion — with
    /// `solicited_only`, the next receive completion of a message sent with
    /// [`SendFlags::SOLICITED`](crate::SendFlags), or the next completion in error —
    /// raises an event on the queue's channel. Completions already in the queue raise none:
    /// after arming, poll once more before waiting. Re-arm after each event.
    ///
    /// Arming takes the engine token (in poll mode it waits for the engine thread to finish
    /// its iteration), so that no completion pushed after it can miss it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the queue has no channel (create it with
    /// [`Context::create_cq_with_channel`](crate::Context::create_cq_with_channel)).
    pub fn req_notify(&mut self, solicited_only: bool) -> Result<()> {
        if self.channel.is_none() {
            return Err(Error::invalid(
                "req_notify",
                "this completion queue has no completion channel: create it with \
                 Context::create_cq_with_channel, or use Cq::wait",
            ));
        }
        self.arm(if solicited_only {
            Arm::Solicited
        } else {
            Arm::Next
        });
        Ok(())
    }

    fn arm(&self, arm: Arm) {
        let cqn = self.cqn;
        self.shared.engine.with(|e| e.res.cqs.arm(cqn, arm));
        // The application may wait on the channel's fd without calling shmhca: a helper
        // sleeping its tick must now sleep on the kick words instead (inline mode).
        if self
            .channel
            .as_ref()
            .is_some_and(|(s, _)| s.fd_taken.load(std::sync::atomic::Ordering::Relaxed))
        {
            self.shared.nudge_helper();
        }
    }

    /// Waits until the queue holds a completion or `timeout` passes, without spinning a
    /// core; returns whether completions are ready (take them with [`Cq::poll`]).
    ///
    /// In poll mode it sleeps on an event channel of the queue's own (made on first use).
    /// In inline mode the waiting thread runs the engine itself, and between runs sleeps
    /// on the engine's kick words with [`IdlePolicy::Backoff`](crate::IdlePolicy), where a
    /// peer's packet wakes it, or yields with `Spin`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a queue created with a channel (its events belong to
    /// the channel: wait with [`CompChannel::get_event`]); a failure of the eventfd.
    pub fn wait(&mut self, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        if self.channel.is_some() && self.own_channel.is_none() {
            return Err(Error::invalid(
                "wait",
                "this completion queue reports to a completion channel: arm it with \
                 req_notify and wait with CompChannel::get_event",
            ));
        }
        loop {
            self.shared.progress_inline();
            if !self.consumer.looks_empty() {
                return Ok(true);
            }
            let left = match deadline.checked_duration_since(Instant::now()) {
                Some(l) if !l.is_zero() => l,
                _ => return Ok(false),
            };
            if self.shared.mode == EngineMode::Inline {
                let _blocked = self.shared.block();
                let consumer = &mut self.consumer;
                self.shared
                    .idle_wait(Some(left), || !consumer.looks_empty());
                continue;
            }
            // About to sleep: an engine thread that stepped back for this thread's polls
            // takes over again.
            self.shared.resume_engine();
            if self.own_channel.is_none() {
                let ch = CompChannel::create(&self.shared)?;
                self.attach(&ch)?;
                self.own_channel = Some(ch);
            }
            self.arm(Arm::Next);
            // Completions that arrived before the arm raised no event.
            if !self.consumer.looks_empty() {
                return Ok(true);
            }
            if let Some(ch) = self.own_channel.as_mut() {
                ch.get_event(Some(left))?;
            }
        }
    }

    /// Moves up to `out.len()` completions into `out`; returns how many. In inline mode,
    /// when the queue holds none, it first runs the engine once.
    ///
    /// A poll that finds completions waiting hands them out without running the engine, as
    /// polling a NIC's completion queue gives the NIC no work: the application has work of
    /// its own, and an Ack the engine holds back to ride in its next request is not sent
    /// alone by an iteration that had nothing new for it (perftest's latency loops poll
    /// the send queue's completion, then the receive queue's, then post).
    pub fn poll(&mut self, out: &mut [WorkCompletion]) -> usize {
        let ready = !self.consumer.looks_empty();
        // Inline mode keeps no `last_empty` (only a poll-mode engine thread steps back).
        if self.shared.mode == EngineMode::Inline {
            // The empty poll's case: the queue is empty (one load; a pop would check and
            // cache more) and the engine's quick look found nothing to do, so it still is;
            // after a full iteration, or with the engine busy elsewhere, the queue is
            // looked at again.
            if !ready && (!self.shared.progress_in_line() || self.consumer.looks_empty()) {
                return 0;
            }
            return self.pop_into(out);
        }
        self.poll_thread_mode(out, ready)
    }

    /// [`Cq::poll`] in poll mode. (Out of line: in line, the backstop's look in
    /// `Device::on_app_poll` took registers from inline mode's poll, 5 to 9 instructions a
    /// message.)
    #[inline(never)]
    fn poll_thread_mode(&mut self, out: &mut [WorkCompletion], ready: bool) -> usize {
        self.shared.on_app_poll(self.last_empty, ready);
        if self.consumer.looks_empty() {
            self.last_empty = true;
            return 0;
        }
        let n = self.pop_into(out);
        self.last_empty = n == 0;
        n
    }

    /// The pop of [`Cq::poll`], in line again since the stamped ring's pop needs no stack
    /// frame (out of line it was, for the poll that finds nothing: the old ring's copy loop
    /// saved and restored registers; now the empty poll costs the same either way).
    #[inline(always)]
    fn pop_into(&mut self, out: &mut [WorkCompletion]) -> usize {
        self.consumer.pop_burst(out)
    }

    /// Hands up to `max` completions, oldest first, to `f`; returns how many. As
    /// [`Cq::poll`] (in inline mode it first runs the engine once), for a caller that puts
    /// each completion somewhere of its own — a C `ibv_poll_cq` writes each into the
    /// program's array — with no array of [`WorkCompletion`]s to fill first.
    ///
    /// ```
    /// # use shmhca::*;
    /// # fn main() -> Result<()> {
    /// let ctx = Context::builder().mode(EngineMode::Inline).arena_size(1 << 20).build()?;
    /// let mut cq = ctx.create_cq(16)?;
    /// let mut ids = Vec::new();
    /// assert_eq!(cq.poll_each(4, |wc| ids.push(wc.wr_id)), 0, "nothing completed yet");
    /// # Ok(())
    /// # }
    /// ```
    #[inline]
    pub fn poll_each(&mut self, max: usize, f: impl FnMut(WorkCompletion)) -> usize {
        let ready = !self.consumer.looks_empty();
        if self.shared.mode == EngineMode::Inline {
            // Completions waiting, and the empty poll's case, as in `poll`.
            if !ready && (!self.shared.progress_in_line() || self.consumer.looks_empty()) {
                return 0;
            }
            return self.consumer.pop_each(max, f);
        }
        self.shared.on_app_poll(self.last_empty, ready);
        let n = self.consumer.pop_each(max, f);
        self.last_empty = n == 0;
        n
    }

    /// One completion, if there is one (in inline mode, when none is waiting, it runs the
    /// engine once first; see [`Cq::poll`]).
    pub fn poll_one(&mut self) -> Option<WorkCompletion> {
        if self.shared.mode == EngineMode::Inline {
            if self.consumer.looks_empty() {
                self.shared.progress();
            }
            return self.consumer.pop();
        }
        let ready = !self.consumer.looks_empty();
        self.shared.on_app_poll(self.last_empty, ready);
        let wc = self.consumer.pop();
        self.last_empty = wc.is_none();
        wc
    }

    /// Polls until `out` is full or `timeout` passes; returns how many completions arrived.
    /// Busy-polls (it is meant for tests and simple programs, not a blocking wait).
    pub fn poll_until(&mut self, out: &mut [WorkCompletion], timeout: Duration) -> usize {
        let start = Instant::now();
        let mut n = 0;
        while n < out.len() {
            n += self.poll(&mut out[n..]);
            if n < out.len() && start.elapsed() >= timeout {
                break;
            }
        }
        n
    }

    /// Capacity in completions.
    pub fn capacity(&self) -> usize {
        self.consumer.capacity()
    }

    pub(crate) fn same_context(&self, shared: &Arc<Device>) -> bool {
        Arc::ptr_eq(&self.shared, shared)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        let cqn = self.cqn;
        self.shared.engine.with(|e| e.res.cqs.remove(cqn));
        if let Some((signal, slot)) = &self.channel {
            channel::detach(signal, *slot);
        }
    }
}

impl std::fmt::Debug for Cq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cq")
            .field("cqn", &self.cqn)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::verbs::wr::{RecvWr, SendOp, SendWr, WcOpcode, WcStatus};
    use crate::{AccessFlags, Context, EngineMode};
    use shmhca_rings::segment::HugePages;

    fn context(mode: EngineMode) -> Context {
        Context::builder()
            .arena_size(1 << 20)
            .huge_pages(HugePages::Never)
            .mode(mode)
            .build()
            .unwrap()
    }

    /// `poll_each` hands completions over oldest first, never more than asked for, and
    /// counts what it handed over; it runs the engine itself in inline mode.
    #[test]
    fn poll_each_hands_over_completions_in_order_up_to_max() {
        let ctx = context(EngineMode::Inline);
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(64).unwrap();
        let (mut a, mut b) = crate::raw_peer::loopback_pair(&ctx, &pd, &cq);
        let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        for i in 0..5u64 {
            b.post_recv(&RecvWr::new(100 + i, &[mr.sge(64 * i, 64).unwrap()]))
                .unwrap();
        }
        for i in 0..5u32 {
            a.post_send(&SendWr::new(
                u64::from(i),
                SendOp::Send,
                &[mr.sge(1024, 8 + i).unwrap()],
            ))
            .unwrap();
        }
        let mut got = Vec::new();
        let start = Instant::now();
        while got.len() < 10 {
            let mut k = 0;
            let n = cq.poll_each(3, |wc| {
                got.push(wc);
                k += 1;
            });
            assert!(n <= 3, "at most the 3 asked for: {n}");
            assert_eq!(n, k, "the count is what was handed over");
            assert!(start.elapsed() < Duration::from_secs(20), "{got:?}");
        }
        assert!(got.iter().all(|w| w.status == WcStatus::Success), "{got:?}");
        let recvs: Vec<_> = got
            .iter()
            .filter(|w| w.opcode == WcOpcode::Recv)
            .map(|w| (w.wr_id, w.byte_len))
            .collect();
        assert_eq!(
            recvs,
            (0..5).map(|i| (100 + i, 8 + i as u32)).collect::<Vec<_>>()
        );
        let sends: Vec<_> = got
            .iter()
            .filter(|w| w.opcode == WcOpcode::Send)
            .map(|w| w.wr_id)
            .collect();
        assert_eq!(sends, [0, 1, 2, 3, 4]);
        assert_eq!(cq.poll_each(8, |_| panic!("nothing is left")), 0);
    }

    /// perftest's latency loop (`ib_send_lat`): separate send and receive CQs, each Send
    /// signaled; the client posts, polls its send CQ until the Send completes, then its
    /// receive CQ, then reposts the receive; the server receives, reposts, sends, then
    /// polls its send CQ. Two inline contexts whose owed Acks are held back an iteration
    /// (as with the progress helper), stepped in turn from one thread, one call each per
    /// turn. Every Ack must ride in the next Send: a poll that finds a completion waiting
    /// runs no engine iteration that would send the held Ack alone (before: 400 lone Acks
    /// in the 200 round trips, each a line and a receive step more).
    #[test]
    fn a_poll_that_finds_a_completion_runs_no_iteration_that_sends_the_held_ack_alone() {
        use crate::QpCaps;
        use crate::verbs::wr::WorkCompletion;
        let (a, b) = (context(EngineMode::Inline), context(EngineMode::Inline));
        for c in [&a, &b] {
            c.shared.engine.with(|e| e.hold_acks = true);
        }
        let (la, lb) = a.link_with(&b).unwrap();
        let side = |c: &Context| {
            let pd = c.alloc_pd().unwrap();
            let (scq, rcq) = (c.create_cq(16).unwrap(), c.create_cq(16).unwrap());
            let qp = c.create_qp(&pd, &scq, &rcq, QpCaps::default()).unwrap();
            let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
            (pd, scq, rcq, qp, mr)
        };
        let (_pa, mut a_scq, mut a_rcq, mut qa, ma) = side(&a);
        let (_pb, mut b_scq, mut b_rcq, mut qb, mb) = side(&b);
        let (na, nb) = (qa.qpn(), qb.qpn());
        crate::raw_peer::connect_rts(&mut qa, la, nb, 14);
        crate::raw_peer::connect_rts(&mut qb, lb, na, 14);
        qa.post_recv(&RecvWr::new(0, &[ma.sge(64, 8).unwrap()]))
            .unwrap();
        qb.post_recv(&RecvWr::new(0, &[mb.sge(64, 8).unwrap()]))
            .unwrap();
        const ROUNDS: u64 = 200;
        // Each side's place in its loop: 0 post the Send, 1 wait for the Send's completion,
        // 2 wait for a receive, 3 repost the receive (the server: 2, 3, 0, 1).
        let (mut at_a, mut at_b) = (0u8, 2u8);
        let (mut done_a, mut done_b) = (0u64, 0u64);
        let ok = |w: Option<WorkCompletion>| {
            w.map(|w| assert_eq!(w.status, WcStatus::Success, "{w:?}"))
                .is_some()
        };
        let start = Instant::now();
        while done_a < ROUNDS || done_b < ROUNDS {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "stuck at {done_a}/{done_b}"
            );
            if done_a < ROUNDS {
                at_a = match at_a {
                    0 => {
                        qa.post_send(
                            &SendWr::new(done_a, SendOp::Send, &[ma.sge(0, 8).unwrap()])
                                .flags(crate::SendFlags::SIGNALED),
                        )
                        .unwrap();
                        1
                    }
                    1 => 1 + u8::from(ok(a_scq.poll_one())),
                    2 => 2 + u8::from(ok(a_rcq.poll_one())),
                    _ => {
                        qa.post_recv(&RecvWr::new(0, &[ma.sge(64, 8).unwrap()]))
                            .unwrap();
                        done_a += 1;
                        0
                    }
                };
            }
            if done_b < ROUNDS {
                at_b = match at_b {
                    2 => 2 + u8::from(ok(b_rcq.poll_one())),
                    3 => {
                        qb.post_recv(&RecvWr::new(0, &[mb.sge(64, 8).unwrap()]))
                            .unwrap();
                        0
                    }
                    0 => {
                        qb.post_send(
                            &SendWr::new(done_b, SendOp::Send, &[mb.sge(0, 8).unwrap()])
                                .flags(crate::SendFlags::SIGNALED),
                        )
                        .unwrap();
                        1
                    }
                    _ => {
                        if ok(b_scq.poll_one()) {
                            done_b += 1;
                            2
                        } else {
                            1
                        }
                    }
                };
            }
        }
        // The last round's Acks may leave alone (no Send follows them): one per side.
        for (who, c) in [("client", &a), ("server", &b)] {
            let st = c.stats();
            let alone = st.acks_sent - st.acks_riding;
            assert!(
                alone <= 2,
                "the {who} sent {alone} Acks alone in {ROUNDS} round trips: {st:?}"
            );
        }
    }

    /// Busy `poll_each` calls on an empty CQ count as a busy poller's, as `poll`'s do: the
    /// poll-mode engine thread steps back for them.
    #[test]
    fn empty_poll_each_calls_make_the_engine_thread_step_back() {
        let ctx = context(EngineMode::Poll { cpu: None });
        let mut cq = ctx.create_cq(16).unwrap();
        let start = Instant::now();
        while ctx
            .shared
            .app_drives
            .load(std::sync::atomic::Ordering::Relaxed)
            == 0
        {
            assert_eq!(cq.poll_each(16, |_| panic!("no completion")), 0);
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the engine thread never stepped back"
            );
        }
    }
}
