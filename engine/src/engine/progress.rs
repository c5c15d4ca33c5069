//! Automatic progress: a sleeping helper thread that drives an inline engine the
//! application has left alone (libfabric's `FI_PROGRESS_AUTO`).
//!
//! An RC peer runs a transport timer against this engine: a request it sent must be
//! acknowledged within its Local Ack Timeout, or it retransmits and in the end fails with
//! `RetryExcErr` — even though this side received the message. In inline mode the engine
//! runs only inside the application's calls, so an application that computes for a while
//! without calling shmhca would let its peers' timers expire. The helper prevents that:
//!
//! * The application's own progress calls ([`Device::progress`]) bump a *progress mark*, a
//!   counter only the token holder writes (a plain store, no locked instruction; the
//!   application's fast path is otherwise unchanged).
//! * The helper wakes every [`tick`](Engine::progress_tick) (a quarter of the shortest
//!   transport timer of this engine's QPs, between [`MIN_TICK`] and [`MAX_TICK`]). If the
//!   mark has not moved since its last look, the application has not driven the engine for
//!   at least one tick: the helper takes the engine token (only then: never while the
//!   application is active) and runs the engine until it has nothing to do.
//! * So a packet that arrives while the application computes is answered within two ticks,
//!   half the shortest transport timer.
//!
//! With [`IdlePolicy::Backoff`](crate::IdlePolicy) and a completion notification armed
//! ([`Cq::req_notify`](crate::Cq::req_notify)) by an application that is not itself
//! blocked in shmhca (an async runtime waiting on the channel's fd), the helper sleeps on
//! the engine's kick words instead, so that a peer's packet wakes it at once and the event
//! reaches the channel within microseconds.
//!
//! A poll-mode engine needs no helper: its thread is the progress. With `IdlePolicy::Spin`
//! it never stops; with `Backoff` (its default) it sleeps only when no QP has work in
//! flight, and a peer's packet wakes it (the peer sees the engine page's sleeper count and
//! bumps its kick word), so its sleep never outlasts a peer's timer.
//!
//! Where the `timers` work adds `Engine::next_deadline()`, the tick can also be cut short
//! to the engine's own next timer deadline (see the note in [`Engine::progress_tick`]).

use std::sync::atomic::{Ordering, fence};

use rustix::thread::futex;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::device::Device;
use crate::engine::Engine;
use crate::qp::QpState;

/// Who makes progress when the application does not call into shmhca (inline mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Progress {
    /// A helper thread drives the engine whenever the application has not for a fraction
    /// of the shortest transport timer, so a busy application never lets a peer's timer
    /// expire (the default). It sleeps the rest of the time and takes the engine only while
    /// the application leaves it alone; the application's own calls cost nothing more.
    #[default]
    Auto,
    /// Only the application's calls drive an inline engine (`Cq::poll`,
    /// `Context::progress`, the posts). An application that stops calling for longer than
    /// a peer's Local Ack Timeout makes that peer's requests fail with `RetryExcErr`.
    /// Deterministic: tests that pump engines by hand use it.
    Manual,
}

impl Progress {
    /// The default: [`Progress::Manual`] if `SHMHCA_PROGRESS` is `manual`, else
    /// [`Progress::Auto`].
    pub(crate) fn from_env() -> Progress {
        match std::env::var_os("SHMHCA_PROGRESS") {
            Some(v) if v.eq_ignore_ascii_case("manual") => Progress::Manual,
            _ => Progress::Auto,
        }
    }
}

/// The shortest tick: below it waking would cost more than it saves.
pub(crate) const MIN_TICK: Duration = Duration::from_micros(100);
/// The longest tick while the engine has a connected QP.
pub(crate) const MAX_TICK: Duration = Duration::from_millis(5);
/// The tick of an engine without connected QPs (nothing can time out; new QPs are seen
/// within this).
const IDLE_TICK: Duration = Duration::from_millis(50);
/// Engine iterations one drive runs at most (enough to reach a timer check after the last
/// packet: see `TIMER_EVERY`).
const DRIVE_ITERATIONS: u32 = 64;

impl Engine {
    /// How often the helper looks at the progress mark: a quarter of the shortest transport
    /// timer among connected QPs (a packet is answered within two ticks), clamped to
    /// [`MIN_TICK`]..=[`MAX_TICK`]; [`IDLE_TICK`] when no QP is connected.
    ///
    /// This side's own Local Ack Timeout stands for the peer's (connections set up by the
    /// CM agree on comparable values; the CM raises each side's timeout over the other's
    /// Target Ack Delay). When `Engine::next_deadline()` exists, take the minimum with the
    /// time to it as well, so that this engine's own timers fire on time while the
    /// application computes.
    pub(crate) fn progress_tick(&self) -> Duration {
        let mut tick = None::<Duration>;
        for q in self.qps() {
            if !matches!(q.proto.state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
                continue;
            }
            let t = if q.proto.cfg.timeout == 0 {
                MAX_TICK
            } else {
                // Ttr = 4.096 µs × 2^timeout (spec/01), computed here so that this does not
                // depend on how the timer module rounds it to its clock.
                Duration::from_nanos(4096u64 << q.proto.cfg.timeout.min(31)) / 4
            };
            tick = Some(tick.map_or(t, |m| m.min(t)));
        }
        tick.map_or(IDLE_TICK, |t| t.clamp(MIN_TICK, MAX_TICK))
    }
}

/// Starts the helper of an inline engine. It holds only a weak reference between ticks and
/// ends within a tick of the context's last handle going away.
pub(crate) fn spawn(shared: &Arc<Device>) -> std::io::Result<()> {
    let weak = Arc::downgrade(shared);
    std::thread::Builder::new()
        .name("shmhca-progress".into())
        .spawn(move || helper(weak))
        .map(|_| ())
}

/// Runs the engine until it has no work (bounded). Does not move the progress mark: the
/// helper's runs must not look like the application's.
fn drive(shared: &Device) -> Option<(usize, Duration)> {
    shared.engine.try_with(|e| {
        let mut work = 0;
        let mut quiet = 0;
        for _ in 0..DRIVE_ITERATIONS {
            let n = e.poll(&shared.doorbell);
            work += n;
            quiet = if n == 0 { quiet + 1 } else { 0 };
            if quiet > super::TIMER_EVERY && e.idle() {
                break;
            }
        }
        (work, e.progress_tick())
    })
}

/// The helper's look for work before it sleeps on the kick words (and again in a long
/// sleep, `wake::sleep`): an application thread blocked in a wait, or the engine's work. A token
/// held elsewhere counts as work, as in every other sleeper's look: the look could not
/// see the rings, and its holder may be a post (`send_now`, which receives nothing) — a
/// frame published before this thread was counted (or whose waker raced the count) would
/// then wait for the next tick.
fn helper_looks(shared: &Device) -> bool {
    shared.blocked.load(Ordering::Relaxed) > 0 || drive(shared).is_none_or(|(work, _)| work > 0)
}

fn helper(weak: Weak<Device>) {
    let mut seen = u64::MAX;
    let mut tick = IDLE_TICK;
    let mut wait_set = super::wake::WaitSet::default();
    loop {
        let Some(shared) = weak.upgrade() else {
            return;
        };
        let mark = shared.progress_mark.load(Ordering::Relaxed);
        // An application thread blocked in a wait drives the engine itself (it wakes on a
        // peer's packet, and at least every MAX_TICK): it is not idle.
        let app_idle = mark == seen && shared.blocked.load(Ordering::Relaxed) == 0;
        seen = mark;
        if app_idle && let Some((_, t)) = drive(&shared) {
            tick = t;
        }
        // An async application waits for an armed event without calling shmhca: sleep on
        // its kick words so that a peer's packet wakes this helper at once.
        let on_word = shared.helper_may_sleep()
            && shared.notify_armed()
            && shared.blocked.load(Ordering::Relaxed) == 0;
        if on_word {
            // An application thread that blocks in a wait drives the engine itself: leave
            // the engine to it (it may be asleep on the same word, and only it knows what
            // it waits for).
            let app_blocked = || shared.blocked.load(Ordering::Relaxed) > 0;
            shared.sleep(&mut wait_set, tick, || helper_looks(&shared));
            if !app_blocked()
                && let Some((_, t)) = drive(&shared)
            {
                tick = t;
            }
            // The engine ran: the next look must not take the mark as the application's.
            seen = u64::MAX;
        } else {
            // Sleep the tick on the helper's own word, so that an arm (which needs this
            // helper asleep on the kick words) cuts it short: Dekker with `nudge_helper`.
            // Only what the sleep needs is kept: a context whose last handle goes away
            // meanwhile is freed at once.
            let (word, armed, may_sleep, fd_sleep) = (
                shared.helper_word.clone(),
                shared.notify_armed.clone(),
                shared.may_sleep,
                shared.fd_sleep.clone(),
            );
            drop(shared);
            word.store(1, Ordering::Relaxed);
            // SYNC: SeqCst fence pairs with the one in `nudge_helper`: either this sees
            // the arm, or the arming thread sees the 1 and wakes the futex.
            fence(Ordering::SeqCst);
            let may_sleep = may_sleep || fd_sleep.load(Ordering::Relaxed);
            if !(may_sleep && armed.load(Ordering::Relaxed) != 0) {
                let ts = futex::Timespec {
                    tv_sec: tick.as_secs() as _,
                    tv_nsec: tick.subsec_nanos() as _,
                };
                // Woken, timed out or interrupted: all mean "look again".
                let _ = futex::wait(&word, futex::Flags::PRIVATE, 1, Some(&ts));
            }
            word.store(0, Ordering::Relaxed);
        }
    }
}

/// Empty polls between two looks of the engine thread that tell a busy-polling
/// application (one poll per completion, as a program waiting for events makes, stays far
/// below). Once the thread has stepped back, any poll counts, and one per [`STEP`] keeps it
/// back (see [`Device::step_back`]).
pub(crate) const BUSY_POLLS: u64 = 64;
/// Empty polls of a context's completion queues, with the engine thread not stepped back
/// ([`BUSY_POLLS`] of them make a thread that runs step back), between two looks at whether
/// the thread runs at all (`Device::unserved_window`): one that did not go round its loop
/// for [`UNSERVED_FOR`] is not being scheduled — a program pinned to one core under
/// `SCHED_FIFO`, whose engine thread inherits both and so never preempts it — and the
/// polls run the engine themselves (`Device::serve_unserved`) until it runs again.
pub(crate) const UNSERVED_POLLS: u32 = 1 << 16;
/// How long the engine thread must not have gone round its loop, seen at the end of a
/// window of [`UNSERVED_POLLS`], before the polls serve it (`Device::unserved_window`):
/// far longer than a thread waits for a core on a busy machine, or sleeps by its idle
/// policy before a peer's packet wakes it — serving such a thread, the polls and it took
/// the token from each other as it came back (`ib_send_lat -n 20000` 0.29 → 0.35 µs with a
/// window's wait).
pub(crate) const UNSERVED_FOR: Duration = Duration::from_millis(250);
/// How long the stepped-back engine thread first sleeps between two looks at the
/// application's polls. Each look that found polls doubles it, up to [`MAX_STEP`].
pub(crate) const STEP: Duration = Duration::from_millis(1);
/// The longest step. Each wake-up of the stepped-back thread takes a core from a spinning
/// application or engine for ~15 µs on a 2-core machine; at one per 1 ms step that was
/// 7% of `ib_send_bw -s 8`'s message rate (paired rounds, 2026-11-29), at one per 8 ms it
/// is under 1%.
pub(crate) const MAX_STEP: Duration = Duration::from_millis(8);
/// Steps without a single poll after which the stepped-back thread takes over: a program
/// the scheduler preempted (on a loaded machine, for a few milliseconds at a time) comes
/// back to poll; one that stopped polling has its engine run again within this many
/// [`STEP`]s of quiet, or one [`MAX_STEP`] — at most 16 ms after its last poll, far within
/// a peer's transport timer (perftest's, 67 ms).
pub(crate) const QUIET_STEPS: u32 = 3;

impl Device {
    /// Whether the application polled its completion queues busily (at least
    /// [`BUSY_POLLS`] empty polls) since the last call, which updates `seen`.
    pub(crate) fn app_polls_busily(&self, seen: &mut u64) -> bool {
        let n = self.empty_polls.load(Ordering::Relaxed);
        let busy = n.wrapping_sub(*seen) >= BUSY_POLLS;
        *seen = n;
        busy
    }

    /// Whether the application polled at all since the last call, which updates `seen`
    /// (while the thread is stepped back, when every poll is counted).
    pub(crate) fn app_polls_at_all(&self, seen: &mut u64) -> bool {
        let n = self.empty_polls.load(Ordering::Relaxed);
        let polled = n != *seen;
        *seen = n;
        polled
    }

    /// Poll mode, called by the engine thread when it has nothing to do and the
    /// application busy-polls a completion queue: steps back, so that the application's
    /// own polls and posts run the engine (as in inline mode) instead of four threads — two
    /// applications and two engine threads — taking turns on too few cores, each packet
    /// waiting for a thread to be scheduled. The thread sleeps on [`Device::app_drives`]
    /// (peers do not count it as a sleeper: their packets wake nobody), looks after a
    /// [`STEP`], then at intervals that double while the polls keep coming (up to
    /// [`MAX_STEP`]), and takes over again once the polls stop (the application computes, waits
    /// in a blocking call, or polls its memory as `ib_write_lat` does), or at once when a
    /// wait for a completion event calls [`Device::resume_engine`].
    ///
    /// Stepping back takes [`BUSY_POLLS`] empty polls in a look; staying back, any poll at
    /// all in the last [`QUIET_STEPS`] looks (`Device::on_app_poll` counts every poll while
    /// the thread is back). A receiver
    /// whose polls keep finding completions (`ib_send_bw`'s server) makes few empty ones,
    /// and a program the scheduler preempted for a while makes few polls: with the step's
    /// own test the thread took over from both, hundreds of times a second — each time a
    /// `membarrier` to take the token's bias from the application and one to give it back,
    /// a second spinning thread, and a receive queue drained while the application was away
    /// (RNR Naks, each stalling the sender a `min_rnr_timer`).
    pub(crate) fn step_back(&self, seen: &mut u64) {
        // Posts must ring while the thread is away: it stops watching send queues, and the
        // application's own iterations watch none (unwatching costs a `membarrier`, which
        // has no place in an application's poll).
        let Some(watching) = self.engine.try_with(|e| {
            e.stop_watching(&self.doorbell);
            std::mem::replace(&mut e.watch_sq, false)
        }) else {
            return;
        };
        let word = &self.app_drives;
        word.store(1, Ordering::Relaxed);
        // This thread runs: the polls' backstop for one that does not is off
        // (`Device::unserved_window` would turn it off only at its next window's end, after
        // the thread takes over again).
        self.serving.store(false, Ordering::Relaxed);
        // A post that came before the application saw the flag: sent now.
        self.progress();
        // A window of this long without a poll gives the engine back to the thread.
        let quiet_enough = STEP * QUIET_STEPS;
        let (mut step, mut quiet) = (STEP, Duration::ZERO);
        loop {
            let ts = futex::Timespec {
                tv_sec: 0,
                tv_nsec: step.as_nanos() as _,
            };
            // Woken, timed out or interrupted: all mean "look again".
            let _ = futex::wait(word, futex::Flags::PRIVATE, 1, Some(&ts));
            // (This thread alone writes it: no read-modify-write.)
            let looks = self.step_looks.load(Ordering::Relaxed);
            self.step_looks.store(looks + 1, Ordering::Relaxed);
            if word.load(Ordering::Relaxed) == 0 {
                break;
            }
            if self.app_polls_at_all(seen) {
                quiet = Duration::ZERO;
                step = (step * 2).min(MAX_STEP);
            } else {
                quiet += step;
                if quiet >= quiet_enough {
                    break;
                }
            }
        }
        word.store(0, Ordering::Relaxed);
        // Polls made before the thread came back (the application's last ones before a
        // wait, say) must not send it away again.
        *seen = self.empty_polls.load(Ordering::Relaxed);
        self.engine.with(|e| e.watch_sq = watching);
    }

    /// Poll mode: brings a stepped-back engine thread back at once (an application about
    /// to wait for a completion event, which its own polls would no longer drive).
    pub(crate) fn resume_engine(&self) {
        if self.app_drives.load(Ordering::Relaxed) != 0 {
            self.app_drives.store(0, Ordering::Relaxed);
            let _ = futex::wake(&self.app_drives, futex::Flags::PRIVATE, 1);
        }
    }
}

impl Device {
    /// After arming a completion queue whose channel's fd the application holds (it may
    /// wait on it without calling shmhca): wakes the progress helper if it sleeps its tick,
    /// so that it sleeps on the kick words instead (and a peer's packet reaches the channel
    /// within microseconds). Arming paths only; nothing on the packet path.
    pub(crate) fn nudge_helper(&self) {
        if !self.helper_may_sleep() {
            return;
        }
        // SYNC: SeqCst fence pairs with the one in `helper`.
        fence(Ordering::SeqCst);
        if self.helper_word.load(Ordering::Relaxed) != 0 {
            let _ = futex::wake(&self.helper_word, futex::Flags::PRIVATE, 1);
        }
    }
}

impl Device {
    /// Inline mode: one step of a blocking wait (up to `left`), driven by the waiting
    /// thread itself. Runs the engine; if that did nothing and `ready` is false, sleeps on
    /// its kick words until a peer's packet or a post wakes it (with `IdlePolicy::Backoff`),
    /// or yields the CPU (with `Spin`, where nobody would wake it). The caller loops.
    pub(crate) fn idle_wait(&self, left: Option<Duration>, mut ready: impl FnMut() -> bool) {
        // The token is busy (the progress helper, another thread): its holder may be about
        // to raise what this thread waits for, and would not wake it: do not sleep.
        let moved = || self.try_progress().is_none_or(|n| n > 0);
        if moved() || ready() {
            return;
        }
        if !self.may_sleep {
            std::thread::yield_now();
            return;
        }
        // Wake up at least every MAX_TICK: this engine's own timers need it to run.
        let max = left.map_or(MAX_TICK, |l| l.min(MAX_TICK));
        self.sleep(&mut super::wake::WaitSet::default(), max, || {
            moved() || ready()
        });
    }

    /// Counts this thread as blocked in a wait that drives the engine itself, until the
    /// guard drops: the progress helper then leaves the engine and the sleeping to it.
    pub(crate) fn block(&self) -> Blocked<'_> {
        self.blocked.fetch_add(1, Ordering::Relaxed);
        Blocked(self)
    }
}

/// See [`Device::block`].
pub(crate) struct Blocked<'a>(&'a Device);

impl Drop for Blocked<'_> {
    fn drop(&mut self) {
        self.0.blocked.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(all(test, not(shmhca_loom)))]
#[path = "fd_wake_tests.rs"]
mod fd_wake_tests;

/// The progress helper's look before it sleeps on the kick words.
#[cfg(all(test, not(shmhca_loom)))]
mod helper_look_tests {
    use std::sync::mpsc;

    use crate::verbs::wr::{RecvWr, SendOp, SendWr};
    use crate::{AccessFlags, Context, EngineMode, IdlePolicy, Progress};
    use shmhca_rings::segment::HugePages;

    /// A frame is in a ring (published before the helper was counted, or by a waker whose
    /// load of the count raced it: nobody kicks) while an application thread holds the
    /// engine token (a post: `send_now` receives nothing). The helper's look cannot see the
    /// ring: it must not take that for "no work" and sleep its tick (up to `MAX_TICK`) with
    /// the frame waiting. It said "no work" before: the token-busy case was `false`.
    #[test]
    fn a_token_held_elsewhere_keeps_the_helper_awake() {
        let ctx = Context::builder()
            .arena_size(1 << 20)
            .huge_pages(HugePages::Never)
            .mode(EngineMode::Inline)
            .idle(IdlePolicy::default())
            .progress(Progress::Manual)
            .build()
            .unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let (mut a, mut b) = crate::raw_peer::loopback_pair(&ctx, &pd, &cq);
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        b.post_recv(&RecvWr::new(1, &[mr.sge(0, 8).unwrap()]))
            .unwrap();
        // An inline post sends at once: the Send is now in the loopback link's ring.
        a.post_send(&SendWr::new(2, SendOp::Send, &[mr.sge(8, 8).unwrap()]))
            .unwrap();
        let shared = &ctx.shared;
        let looked = std::thread::scope(|s| {
            let (held_tx, held_rx) = mpsc::channel();
            let (done_tx, done_rx) = mpsc::channel::<()>();
            s.spawn(move || {
                shared.engine.with(|_| {
                    held_tx.send(()).unwrap();
                    let _ = done_rx.recv();
                });
            });
            held_rx.recv().unwrap();
            let looked = super::helper_looks(shared);
            done_tx.send(()).unwrap();
            looked
        });
        // The frame was there to be found.
        let found = super::drive(shared).map(|(work, _)| work);
        assert!(
            found.is_some_and(|w| w > 0),
            "no frame was pending: {found:?}"
        );
        assert!(
            looked,
            "the helper took a busy token for no work and would sleep its tick"
        );
    }
}

/// The poll-mode engine thread steps back for an application that busy-polls its CQ, whose
/// polls and posts then run the engine, and takes over again when the polls stop or the
/// application waits.
#[cfg(all(test, not(shmhca_loom)))]
mod step_back_tests {
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    use crate::verbs::wr::{RecvWr, SendFlags, SendOp, SendWr, WcStatus};
    use crate::{AccessFlags, Context, EngineMode, IdlePolicy};
    use shmhca_rings::segment::HugePages;

    const LONG: Duration = Duration::from_secs(20);

    #[test]
    fn a_busy_poller_drives_the_engine_and_the_thread_comes_back_when_it_stops() {
        let ctx = Context::builder()
            .arena_size(1 << 20)
            .huge_pages(HugePages::Never)
            .mode(EngineMode::Poll { cpu: None })
            .idle(IdlePolicy::Backoff {
                spins: 256,
                max_sleep: Duration::from_millis(10),
            })
            .build()
            .unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(64).unwrap();
        let (mut a, mut b) = crate::raw_peer::loopback_pair(&ctx, &pd, &cq);
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let drives = || ctx.shared.app_drives.load(Ordering::Relaxed) != 0;
        let busy_poll_until_it_steps_back = |cq: &mut crate::Cq| {
            let start = Instant::now();
            while !drives() {
                assert!(cq.poll_one().is_none());
                assert!(
                    start.elapsed() < LONG,
                    "the engine thread never stepped back"
                );
            }
        };
        // Busy polling an empty CQ: the thread steps back.
        busy_poll_until_it_steps_back(&mut cq);
        // Stepped back, a post and the application's polls carry a message through (the
        // thread sleeps its step meanwhile: whoever moves it, it arrives).
        b.post_recv(&RecvWr::new(1, &[mr.sge(0, 8).unwrap()]))
            .unwrap();
        a.post_send(&SendWr::new(2, SendOp::Send, &[mr.sge(8, 8).unwrap()]))
            .unwrap();
        let mut got = vec![];
        let start = Instant::now();
        while got.len() < 2 {
            got.extend(cq.poll_one());
            assert!(start.elapsed() < LONG, "only {got:?}");
        }
        assert!(got.iter().all(|w| w.status == WcStatus::Success), "{got:?}");
        // The polls stop: the thread takes over within a few steps.
        let start = Instant::now();
        while drives() {
            std::thread::sleep(Duration::from_millis(1));
            assert!(start.elapsed() < LONG, "the engine thread never came back");
        }
        // Back to busy polling, then a wait: the thread is called back at once.
        busy_poll_until_it_steps_back(&mut cq);
        assert!(!cq.wait(Duration::from_millis(1)).unwrap());
        assert!(!drives(), "a wait brings the engine thread back");
    }

    /// A poll-mode context with a loopback pair of QPs (`a` sends to `b`) on one CQ and a
    /// 64-byte region, for the tests of the engine thread's step-back.
    struct StepRig {
        ctx: Context,
        pd: crate::Pd,
        cq: crate::Cq,
        a: crate::Qp,
        b: crate::Qp,
        mr: crate::Mr,
    }

    impl StepRig {
        /// `None` (saying so in one line) without `membarrier`: the engine token then has
        /// no owner for a thread to become.
        fn new() -> Option<StepRig> {
            if !crate::engine::cell::barrier_available() {
                eprintln!("skipped: membarrier(2) is not available on this kernel");
                return None;
            }
            let ctx = poll_context();
            let pd = ctx.alloc_pd().unwrap();
            let cq = ctx.create_cq(256).unwrap();
            let (a, b) = crate::raw_peer::loopback_pair(&ctx, &pd, &cq);
            let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
            Some(StepRig {
                ctx,
                pd,
                cq,
                a,
                b,
                mr,
            })
        }
    }

    /// A poll-mode context with the default idle policy.
    fn poll_context() -> Context {
        Context::builder()
            .arena_size(1 << 20)
            .huge_pages(HugePages::Never)
            .mode(EngineMode::Poll { cpu: None })
            .build()
            .unwrap()
    }

    /// Busy-polls `cq` until the engine thread has stepped back and this thread has come to
    /// own the engine token (within `LONG` of `start`).
    fn drive(ctx: &Context, cq: &mut crate::Cq, start: Instant) {
        while !(ctx.shared.app_drives.load(Ordering::Relaxed) != 0 && ctx.shared.engine.is_owner())
        {
            cq.poll_one();
            assert!(start.elapsed() < LONG, "this thread never came to drive");
        }
    }

    /// While the application keeps polling, the stepped-back thread looks at its polls
    /// less and less often: a step that doubles up to `MAX_STEP`, not one per `STEP`
    /// (each look takes a core from a spinning thread on a small machine). Counted over
    /// 200 ms of busy polling: at most one look per 8 ms plus the first few steps (1, 2 and
    /// 4 ms) and slack for a late wake-up; the old steps made one per 1 ms (~200). A run
    /// where the thread came back meanwhile (the host stalled this poller for 3 ms) proves
    /// nothing and is tried again.
    #[test]
    fn stepped_back_the_thread_looks_less_often_while_polls_keep_coming() {
        let Some(StepRig {
            ctx,
            pd: _pd,
            mut cq,
            ..
        }) = StepRig::new()
        else {
            return;
        };
        let start = Instant::now();
        let window = Duration::from_millis(200);
        loop {
            assert!(
                start.elapsed() < LONG,
                "the engine thread never stayed back"
            );
            drive(&ctx, &mut cq, start);
            let looks = ctx.shared.step_looks.load(Ordering::Relaxed);
            let begun = Instant::now();
            while begun.elapsed() < window {
                cq.poll_one();
            }
            let looked = ctx.shared.step_looks.load(Ordering::Relaxed) - looks;
            if ctx.shared.app_drives.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let most = (window.as_millis() / super::MAX_STEP.as_millis()) as u64 + 3 + 5;
            assert!(
                looked <= most,
                "{looked} looks in {window:?} of polls (at most {most})"
            );
            return;
        }
    }

    /// While the engine thread has stepped back, the application's posts run the engine as
    /// inline mode's do: a Send on an idle QP leaves by the template path before the post
    /// returns (not through the send ring for a later poll), and a receive is counted in
    /// flight under the token (no `fetch_add` on the region's shared counter).
    #[test]
    fn stepped_back_the_applications_posts_run_the_engine_directly() {
        let Some(StepRig {
            ctx,
            pd: _pd,
            mut cq,
            mut a,
            mut b,
            mr,
        }) = StepRig::new()
        else {
            return;
        };
        let drives = || ctx.shared.app_drives.load(Ordering::Relaxed) != 0;
        let fast_posts = |index: u32| {
            ctx.shared
                .engine
                .with(|e| e.qps.at_mut(index).map(|q| q.fast_posts))
                .unwrap()
        };
        let outside = || mr.inflight.posted.load(Ordering::Relaxed);
        // Receives to spare, and one message first: its Ack tells the requester of them (a
        // QP limited by credit takes the long way).
        for i in 0..8 {
            b.post_recv(&RecvWr::new(100 + i, &[mr.sge(0, 8).unwrap()]))
                .unwrap();
        }
        a.post_send(
            &SendWr::new(100, SendOp::Send, &[mr.sge(8, 8).unwrap()]).flags(SendFlags::SIGNALED),
        )
        .unwrap();
        let start = Instant::now();
        let mut got = 0;
        while got < 2 {
            got += usize::from(cq.poll_one().is_some());
            assert!(start.elapsed() < LONG, "the first message did not complete");
        }
        // The engine thread may come back between the check and the post (it looks every
        // STEP): such a round proves nothing and is tried again.
        let start = Instant::now();
        let mut proved = 0;
        for i in 0..1000u64 {
            if proved == 3 {
                break;
            }
            assert!(
                start.elapsed() < LONG,
                "the engine thread never stayed back"
            );
            drive(&ctx, &mut cq, start);
            let (sends, recvs) = (fast_posts(a.index), outside());
            b.post_recv(&RecvWr::new(i, &[mr.sge(0, 8).unwrap()]))
                .unwrap();
            a.post_send(&SendWr::new(i, SendOp::Send, &[mr.sge(8, 8).unwrap()]))
                .unwrap();
            let (sent_fast, recv_outside) = (fast_posts(a.index) == sends + 1, outside() != recvs);
            let stayed_back = drives();
            // Both complete, whoever moved them.
            let mut got = 0;
            while got < 2 {
                got += usize::from(cq.poll_one().is_some());
                assert!(start.elapsed() < LONG, "message {i} did not complete");
            }
            if stayed_back {
                assert!(sent_fast, "round {i}: the Send was not sent by its post");
                assert!(
                    !recv_outside,
                    "round {i}: the receive was counted outside the token"
                );
                proved += 1;
            }
        }
        assert_eq!(
            proved, 3,
            "three rounds with the thread stepped back throughout"
        );
    }

    /// Stepped back, the thread counts every poll of the application, not only those after
    /// an empty one: a receiver whose polls keep finding completions keeps it back (it took
    /// over from such a receiver hundreds of times a second, each time with a `membarrier`
    /// each way, and drained its receive queue while the receiver was away).
    #[test]
    fn stepped_back_a_poll_after_a_completion_keeps_the_thread_back() {
        let Some(StepRig {
            ctx,
            pd: _pd,
            mut cq,
            mut a,
            mut b,
            mr,
        }) = StepRig::new()
        else {
            return;
        };
        let drives = || ctx.shared.app_drives.load(Ordering::Relaxed) != 0;
        let polls = || ctx.shared.empty_polls.load(Ordering::Relaxed);
        let start = Instant::now();
        let mut proved = 0;
        for i in 0..1000u64 {
            if proved == 3 {
                break;
            }
            assert!(
                start.elapsed() < LONG,
                "the engine thread never stayed back"
            );
            drive(&ctx, &mut cq, start);
            b.post_recv(&RecvWr::new(i, &[mr.sge(0, 8).unwrap()]))
                .unwrap();
            a.post_send(&SendWr::new(i, SendOp::Send, &[mr.sge(8, 8).unwrap()]))
                .unwrap();
            let mut got = 0;
            while got < 2 {
                got += usize::from(cq.poll_one().is_some());
                assert!(start.elapsed() < LONG, "message {i} did not complete");
            }
            // The last poll found a completion: the next one is not a busy poller's empty
            // poll after an empty one, and it counts all the same.
            let before = polls();
            let back = drives();
            assert!(cq.poll_one().is_none());
            let counted = polls() != before;
            // (A round where the thread came back meanwhile proves nothing.)
            if back && drives() {
                assert!(
                    counted,
                    "round {i}: a poll after a completion was not counted"
                );
                proved += 1;
            }
        }
        assert_eq!(
            proved, 3,
            "three rounds with the thread stepped back throughout"
        );
    }

    /// While one thread's polls drive the engine, another thread's receives are queued for
    /// it (the receive ring, counted with a `fetch_add`) instead of taking the token from
    /// it: no `membarrier` per post, and the driver stays the owner of the token's fast
    /// path. (Another thread's Send still runs the engine at once, as it always did: it
    /// takes the token when it must, so that the Send does not wait for the driver.)
    #[test]
    fn another_threads_receives_leave_the_driving_thread_its_token() {
        let Some(StepRig {
            ctx,
            pd: _pd,
            mut cq,
            mut a,
            mut b,
            mr,
        }) = StepRig::new()
        else {
            return;
        };
        let drives = || ctx.shared.app_drives.load(Ordering::Relaxed) != 0;
        let start = Instant::now();
        let mut proved = 0;
        for i in 0..1000u64 {
            if proved == 3 {
                break;
            }
            assert!(
                start.elapsed() < LONG,
                "the engine thread never stayed back"
            );
            drive(&ctx, &mut cq, start);
            std::thread::scope(|s| {
                s.spawn(|| {
                    b.post_recv(&RecvWr::new(i, &[mr.sge(0, 8).unwrap()]))
                        .unwrap();
                });
            });
            let kept = ctx.shared.engine.is_owner();
            a.post_send(&SendWr::new(i, SendOp::Send, &[mr.sge(8, 8).unwrap()]))
                .unwrap();
            let stayed_back = drives();
            let mut got = 0;
            while got < 2 {
                got += usize::from(cq.poll_one().is_some());
                assert!(start.elapsed() < LONG, "message {i} did not complete");
            }
            if stayed_back {
                assert!(
                    kept,
                    "round {i}: another thread's receive took the token's bias"
                );
                proved += 1;
            }
        }
        assert_eq!(
            proved, 3,
            "three rounds with the thread stepped back throughout"
        );
    }
}

/// The polls' backstop for an engine thread that is never scheduled
/// (`Device::serve_unserved`), with a thread that is.
#[cfg(all(test, not(shmhca_loom)))]
mod unserved_tests {
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    use super::UNSERVED_POLLS;
    use crate::{Context, EngineMode, IdlePolicy};
    use shmhca_rings::segment::HugePages;

    /// A poll-mode engine thread that runs all along but never steps back — it spins
    /// (`IdlePolicy::Spin` never does), as it would with work on every iteration (another
    /// thread's stream, a peer's RDMA writes) — while the application busy-polls a queue
    /// that stays empty for many windows of `UNSERVED_POLLS` polls. The thread is served:
    /// the polls must leave the engine to it. From the first window on, every poll took it
    /// for a thread not scheduled, for the rest of the program (a poll that found
    /// completions kept the count past the threshold): it ran the engine whenever the token
    /// had no owner — a compare and swap on the token's line per poll against the spinning
    /// thread — and revoked the thread's bias with a `membarrier` once per window: 458,752
    /// of 524,288 polls (8 windows) served it, of which 125,000 to 165,000 ran the engine,
    /// in runs of this test then. Now only a thread that has not gone round its loop for
    /// `UNSERVED_FOR` (250 ms) is served; the bound below leaves room for a loaded host
    /// that keeps it off its cores that long.
    #[test]
    fn polls_leave_the_engine_to_a_thread_that_runs() {
        polls_of(1);
    }

    /// The same with two application threads, each busy-polling a queue of its own: each
    /// took the token on every poll, against the thread and against each other.
    #[test]
    fn polls_of_two_threads_leave_the_engine_to_a_thread_that_runs() {
        polls_of(2);
    }

    /// `threads` threads each poll an empty queue of a spinning poll-mode engine (whose
    /// thread never steps back) for 16 windows of `UNSERVED_POLLS` polls (or a minute):
    /// fewer than half the windows' polls may serve the engine (those after a loaded host
    /// kept the thread off its cores for `UNSERVED_FOR`); all but the first did.
    fn polls_of(threads: u32) {
        let ctx = Context::builder()
            .arena_size(1 << 20)
            .huge_pages(HugePages::Never)
            .mode(EngineMode::Poll { cpu: None })
            .idle(IdlePolicy::Spin)
            .build()
            .unwrap();
        let windows = 16u32;
        let polls: u32 = std::thread::scope(|s| {
            let pollers: Vec<_> = (0..threads)
                .map(|_| {
                    let mut cq = ctx.create_cq(16).unwrap();
                    s.spawn(move || {
                        let start = Instant::now();
                        let mut polls = 0u32;
                        while polls < windows * UNSERVED_POLLS
                            && start.elapsed() < Duration::from_secs(60)
                        {
                            for _ in 0..1024 {
                                assert!(cq.poll_one().is_none());
                            }
                            polls += 1024;
                        }
                        polls
                    })
                })
                .collect();
            pollers.into_iter().map(|p| p.join().unwrap()).sum()
        });
        let served = ctx.shared.unserved_runs.load(Ordering::Relaxed);
        assert!(
            served < u64::from(threads * windows / 2 * UNSERVED_POLLS),
            "{served} of {polls} polls served the engine that its spinning thread runs"
        );
    }
}
