//! The device: one engine and what every handle of its context shares — the engine cell
//! (the token), the doorbell, the engine page peers read, the kick word and the sleep
//! machinery — and the engine thread that drives it in poll mode.
//!
//! The verbs layer ([`crate::verbs`]) opens a device per [`Context`](crate::Context) and
//! its handles hold it; the connection manager ([`crate::cm`]) keeps its state in it. The
//! device imports neither: it is the bottom of the user-facing stack, above the engine.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};

use shmhca_rings::segment::{HugePages, Segment};

use crate::engine::Engine;
use crate::engine::cell::EngineCell;
use crate::engine::doorbell::Doorbell;
use crate::engine::wake;
use crate::ids::LinkId;
use crate::mem::Mem;

/// How the engine runs.
///
/// The two modes run the same protocol and talk to each other; only who drives the engine
/// differs. In poll mode completions come without any call driving the engine:
///
/// ```
/// use std::time::Duration;
/// use shmhca::{Context, EngineMode, IdlePolicy};
///
/// let inline = Context::builder().mode(EngineMode::Inline).arena_size(1 << 20).build()?;
/// let poll = Context::builder()
///     .mode(EngineMode::Poll { cpu: None }) // `Some(core)` pins the engine thread
///     .idle(IdlePolicy::default()) // spin a while, then sleep until there is work
///     .arena_size(1 << 20)
///     .build()?;
/// assert_eq!(poll.mode(), EngineMode::Poll { cpu: None });
/// // Wait for a completion: inline, `wait` runs the engine itself; in poll mode its
/// // thread does. Nothing was posted here, so both time out.
/// assert!(!inline.create_cq(16)?.wait(Duration::from_millis(1))?);
/// assert!(!poll.create_cq(16)?.wait(Duration::from_millis(1))?);
/// # Ok::<(), shmhca::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineMode {
    /// Run-to-completion: the engine runs inside the application's own calls
    /// ([`Cq::poll`](crate::Cq::poll), [`Context::progress`](crate::Context::progress), and right after each post). No extra thread;
    /// the default on machines with fewer than 4 cores.
    Inline,
    /// A dedicated engine thread polls, pinned to `cpu` if given; what it does when it has
    /// nothing to do is the [`IdlePolicy`] (by default it backs off to sleep, see
    /// [`ContextBuilder::idle`](crate::ContextBuilder::idle)).
    Poll {
        /// The core to pin the engine thread to.
        cpu: Option<usize>,
    },
}

impl EngineMode {
    /// Inline with fewer than 4 cores, else poll mode on an unpinned thread.
    pub fn default_for_this_machine() -> EngineMode {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if cores < 4 {
            EngineMode::Inline
        } else {
            EngineMode::Poll { cpu: None }
        }
    }
}

/// What an idle engine does when there is no work.
///
/// In poll mode it is the engine thread's policy. In inline mode `Backoff` lets threads
/// that wait for completions ([`Cq::wait`](crate::Cq::wait), [`CompChannel::get_event`](crate::CompChannel::get_event), the progress
/// helper while a notification is armed) sleep until a peer's packet wakes them; with
/// `Spin` they poll and yield. `Backoff` costs this engine's peers a fence per burst they
/// publish to it (to know whether to wake it), in either mode.
///
/// The default ([`IdlePolicy::default`]) is `Backoff` with 10,000 spins and sleeps of at
/// most 100 ms: a poll-mode engine with nothing to do ends up asleep instead of burning
/// its core. A context built without [`ContextBuilder::idle`](crate::ContextBuilder::idle) gets it in poll mode, and
/// `Spin` in inline mode (see there why).
///
/// ```
/// use shmhca::{Context, EngineMode, IdlePolicy};
/// assert!(matches!(IdlePolicy::default(), IdlePolicy::Backoff { .. }));
/// // The lowest latency, at the price of a core per engine even when idle:
/// let ctx = Context::builder()
///     .mode(EngineMode::Poll { cpu: None })
///     .idle(IdlePolicy::Spin)
///     .arena_size(1 << 20)
///     .build()?;
/// # drop(ctx);
/// # Ok::<(), shmhca::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdlePolicy {
    /// Keep polling (lowest latency; burns the core, even with nothing to do). Building a
    /// poll-mode engine with it prints a warning (once per process, on stderr) when this
    /// process's spinning engine threads and one application thread outnumber its cores.
    Spin,
    /// Poll `spins` empty iterations, then yield the CPU between polls while a QP has work
    /// in flight, and sleep once none has, for up to `max_sleep` at a time (a post or a
    /// peer's packet wakes it at once). The default, with 10,000 spins and 100 ms.
    Backoff {
        /// Empty iterations before yielding.
        spins: u32,
        /// The longest sleep between two polls.
        max_sleep: std::time::Duration,
    },
}

impl Default for IdlePolicy {
    /// `Backoff` with 10,000 spins and sleeps of at most 100 ms.
    fn default() -> IdlePolicy {
        IdlePolicy::Backoff {
            spins: crate::engine::idle::DEFAULT_SPINS,
            max_sleep: crate::engine::idle::DEFAULT_MAX_SLEEP,
        }
    }
}

/// Resolves a fabric destination for QP `qpn` of protection domain `pdn` (see
/// [`Device::fabric_resolve`]).
pub(crate) type FabricResolve = fn(
    &Arc<Device>,
    crate::wire::Qpn,
    u32,
    crate::fabric::addr::FabricDest,
) -> crate::error::Result<crate::qp::Destination>;

/// An engine and everything of it that the handles of its context share: the device a
/// [`Context`](crate::Context) opens. The verbs layer's handles hold an `Arc` of it; the
/// engine thread and the progress helper hold one while they run.
pub(crate) struct Device {
    pub(crate) engine: EngineCell<Engine>,
    pub(crate) doorbell: Doorbell,
    /// The engine page (sleeper count), handed to peers read-only.
    pub(crate) engine_page: Arc<Segment>,
    pub(crate) engine_page_mem: Mem,
    /// Bytes of each protection domain's arena.
    pub(crate) arena_size: u64,
    pub(crate) id: u32,
    pub(crate) mode: EngineMode,
    pub(crate) link_slots: usize,
    pub(crate) huge_pages: HugePages,
    /// How long after a fabric peer is lost its QPs that have nothing outstanding stay as
    /// they are before they go to the Error state (`None`: never, as in InfiniBand):
    /// [`ContextBuilder::peer_loss_grace`](crate::ContextBuilder::peer_loss_grace).
    pub(crate) peer_loss_grace: Option<std::time::Duration>,
    /// Whether the engine thread may sleep (poll mode with a backoff policy).
    pub(crate) may_sleep: bool,
    /// Inline mode without `may_sleep`: set (for good) when the application takes a
    /// completion channel's fd to wait on it itself. From then on the progress helper
    /// sleeps on the kick words while a notification is armed, and the engine page tells
    /// peers to wake it ([`Device::allow_fd_sleep`]).
    pub(crate) fd_sleep: Arc<std::sync::atomic::AtomicBool>,
    /// The connection manager's state (engine identity, links to peers, peer watcher),
    /// kept here so that it lives and dies with the device, but typed and owned by `cm`
    /// (`cm::CmState::of`): the device knows nothing of the layers above it.
    pub(crate) cm: std::sync::OnceLock<Box<dyn std::any::Any + Send + Sync>>,
    /// The in-process peer devices this one is linked with (`Context::link_with`): where a
    /// peer QP's arena is looked up when a QP is given its destination over that link.
    pub(crate) local_peers: Mutex<Vec<(LinkId, Weak<Device>)>>,
    /// Its membership of the fabric once it joined, kept here so that it ends with the
    /// device, but typed and owned by `fabric` (`fabric::FabricSlot::of`).
    pub(crate) fabric: std::sync::OnceLock<Box<dyn std::any::Any + Send + Sync>>,
    /// Set by the fabric when the context joins it: finds (or makes) the link to a fabric
    /// destination's engine at RTR (`Qp::modify` calls it; the device does not know how).
    pub(crate) fabric_resolve: std::sync::OnceLock<FabricResolve>,
    /// Counts the engine runs of the application's own calls (written by the token
    /// holder only: a plain store), read by the progress helper (`engine::progress`).
    pub(crate) progress_mark: crossbeam_utils::CachePadded<std::sync::atomic::AtomicU64>,
    /// Application threads blocked in a wait that drives the engine itself.
    pub(crate) blocked: AtomicU32,
    /// The engine's local kick word: bumped by this process's posts and control
    /// operations when an engine thread sleeps (see [`crate::engine::wake`]).
    pub(crate) kick: crossbeam_utils::CachePadded<AtomicU32>,
    /// Completion queues armed for a notification (the CQ table's mirror).
    pub(crate) notify_armed: Arc<AtomicU32>,
    /// The progress helper's own futex word: 1 while it sleeps a tick on it (see
    /// `engine::progress`), so that arming a queue can cut the sleep short.
    pub(crate) helper_word: Arc<AtomicU32>,
    /// Poll mode: polls of the application that found its CQ empty, and while the engine
    /// thread is stepped back all its polls (a plain store, no read-modify-write: several
    /// threads may lose each other's counts, and only "it moved" matters). The engine
    /// thread steps back while they keep coming (`engine::progress::step_back`).
    pub(crate) empty_polls: crossbeam_utils::CachePadded<std::sync::atomic::AtomicU64>,
    /// How many times a stepped-back engine thread has woken to look at the application's
    /// polls ([`Device::step_back`]; tests).
    pub(crate) step_looks: std::sync::atomic::AtomicU64,
    /// Poll mode: set while the engine thread has stepped back for a busy-polling
    /// application; the application's polls and posts then run the engine, as in inline
    /// mode. Also the futex word the stepped-back thread sleeps on (1 while stepped back).
    pub(crate) app_drives: crossbeam_utils::CachePadded<AtomicU32>,
    /// Poll mode: the engine thread's count of its loop's turns (a plain store per turn, by
    /// that thread only), which the polls look at once per window of
    /// [`UNSERVED_POLLS`](crate::engine::progress::UNSERVED_POLLS) empty polls
    /// ([`Device::unserved_window`]): whether the thread runs at all.
    pub(crate) engine_beat: crossbeam_utils::CachePadded<AtomicU32>,
    /// Poll mode: the engine thread's beat when a window of polls last saw it move, and when
    /// ([`Device::unserved_window`]; a window's end only, once per 65,536 polls).
    pub(crate) unserved_seen: Mutex<(u32, std::time::Instant)>,
    /// Poll mode: the application's polls run the engine for a thread that is not being
    /// scheduled ([`Device::unserved_window`]).
    pub(crate) serving: std::sync::atomic::AtomicBool,
    /// Poll mode: application polls that took the engine thread for one not scheduled,
    /// and so ran the engine or tried to ([`Device::serve_unserved`]; a plain store, as
    /// `empty_polls`; tests only).
    #[cfg(test)]
    pub(crate) unserved_runs: std::sync::atomic::AtomicU64,
    /// The context's asynchronous events (the engine raises into the same queue, through
    /// `Resources::async_events`).
    pub(crate) async_events: Arc<crate::async_events::AsyncQueue>,
}

impl Device {
    /// Runs one engine iteration if nobody else is; returns the work done.
    #[inline]
    pub(crate) fn progress(&self) -> usize {
        self.try_progress().unwrap_or(0)
    }

    /// [`Device::progress`] compiled into its caller: a completion queue's poll, whose
    /// empty case then makes no call at all (through `progress`, the call, its return and
    /// the register saves on both sides were 7 of an empty poll's 87 instructions).
    /// Whether anything may have changed: false only when the engine's quick look found
    /// nothing to do (the empty poll's case), so that the caller need not look at its
    /// queue again.
    #[inline(always)]
    pub(crate) fn progress_in_line(&self) -> bool {
        self.engine
            .try_with_quick(
                |e| {
                    self.mark_progress();
                    e.idle_now(&self.doorbell).then_some(false)
                },
                |e| {
                    e.poll_busy(&self.doorbell);
                    true
                },
            )
            // The token is busy: its holder may be producing completions.
            .unwrap_or(true)
    }

    /// Runs one engine iteration if nobody else is; `None` if someone holds the engine.
    /// Inlined into its callers: an empty poll then makes no call at all.
    #[inline(always)]
    pub(crate) fn try_progress(&self) -> Option<usize> {
        // The empty poll's case (`Engine::idle_now`) answers without a call; the rest of
        // the iteration is out of line.
        self.engine.try_with_quick(
            |e| {
                self.mark_progress();
                e.idle_now(&self.doorbell).then_some(0)
            },
            |e| e.poll_busy(&self.doorbell),
        )
    }

    /// Counts an engine run by the application (under the token): the progress helper sees
    /// the application is driving the engine. A plain store: only the token holder writes
    /// the mark.
    #[inline(always)]
    fn mark_progress(&self) {
        let mark = &self.progress_mark;
        mark.store(
            mark.load(Ordering::Relaxed).wrapping_add(1),
            Ordering::Relaxed,
        );
    }

    /// Whether a completion queue is armed for a notification.
    pub(crate) fn notify_armed(&self) -> bool {
        self.notify_armed.load(Ordering::Relaxed) != 0
    }

    /// Whether the progress helper may sleep on the kick words (peers wake it): with a
    /// backoff policy, or once the application took a channel fd ([`Device::fd_sleep`]).
    pub(crate) fn helper_may_sleep(&self) -> bool {
        self.may_sleep || self.fd_sleep.load(Ordering::Relaxed)
    }

    /// The application took a completion channel's fd: it may sleep in `poll(2)` on it
    /// with nobody running the engine but the progress helper. An inline engine that does
    /// not sleep (`IdlePolicy::Spin`) would leave that helper sleeping its tick (0.1 to
    /// 5 ms, 50 ms without connected QPs), and a peer's packet would raise the event only
    /// then. So, once: tell peers to wake this engine (its engine page's may-sleep word,
    /// which they read at link setup and, while it reads 0, one engine iteration in
    /// `PUBLISH_EVERY`) and let the helper sleep on the kick words (a nudge cuts its tick
    /// short). Poll mode and backoff engines have this already.
    ///
    /// Links set up after this are woken at once. A peer linked before wakes this engine
    /// once its own engine has run its next stats publication; packets it sends before
    /// that are seen at the helper's tick, as before.
    pub(crate) fn allow_fd_sleep(&self) {
        if self.mode != EngineMode::Inline
            || self.may_sleep
            || self.fd_sleep.load(Ordering::Relaxed)
        {
            return;
        }
        if self.fd_sleep.swap(true, Ordering::Relaxed) {
            return;
        }
        if let Ok(word) = self.engine_page_mem.atomic_u32(crate::arena::MAY_SLEEP) {
            word.store(1, Ordering::Release);
        }
        self.nudge_helper();
    }

    /// Drives the engine from the application's thread in inline mode.
    #[inline]
    pub(crate) fn progress_inline(&self) {
        if self.mode == EngineMode::Inline {
            self.progress();
        }
    }

    /// An application poll of a completion queue, before it looks at the queue: runs the
    /// engine in inline mode, and in poll mode while the engine thread has stepped back
    /// for the application (`engine::progress::step_back`) — unless completions are
    /// waiting in the queue (`ready`: see [`crate::Cq::poll`]). `empty`: the last poll of
    /// this queue found nothing (a busy poller's signature). In poll mode with the thread
    /// not stepped back, also the backstop for a thread that is never scheduled
    /// ([`Device::unserved_window`]), looked at on this path only: a stepped-back thread's
    /// polls pay nothing for it.
    #[inline]
    pub(crate) fn on_app_poll(&self, empty: bool, ready: bool) {
        if self.mode == EngineMode::Inline {
            if !ready {
                self.progress();
            }
            return;
        }
        let drives = self.app_drives.load(Ordering::Relaxed) != 0;
        // Stepped back, the thread stays back while any poll comes (a receiver's polls
        // that keep finding completions too): `Device::step_back`.
        if empty || drives {
            let n = &self.empty_polls;
            let polls = n.load(Ordering::Relaxed).wrapping_add(1);
            n.store(polls, Ordering::Relaxed);
            if !drives && polls % u64::from(crate::engine::progress::UNSERVED_POLLS) == 0 {
                self.unserved_window();
            }
        }
        if !ready {
            if drives {
                self.progress();
            } else if self.serving.load(Ordering::Relaxed) {
                self.serve_unserved(false);
            }
        }
    }

    /// Poll mode: runs the engine for the application's polls while
    /// [`Device::unserved_window`] finds the engine thread not scheduled (`serving`): the
    /// program is pinned to one core under a real-time policy its engine thread inherited,
    /// and a thread is never preempted by one of its own priority. `take`: the token's bias
    /// may be taken from the thread that owns it (a `membarrier`) — once per window, so that
    /// a thread merely slow to be scheduled and the polls do not take it back and forth per
    /// poll; the rest of the time the token only when it is the polling thread's or
    /// nobody's (then a compare and swap, until the polling thread owns it).
    #[cold]
    #[inline(never)]
    pub(crate) fn serve_unserved(&self, take: bool) {
        #[cfg(test)]
        {
            let n = &self.unserved_runs;
            n.store(n.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        }
        let take = take || !self.engine.biased();
        let _ = self
            .engine
            .try_with_if(|| take, |e| e.poll_busy(&self.doorbell));
    }

    /// The end of a window of [`UNSERVED_POLLS`](crate::engine::progress::UNSERVED_POLLS)
    /// empty polls of this context's queues with the engine thread not stepped back: sets
    /// `serving` if the thread has not gone round its loop ([`Device::engine_beat`]) for
    /// [`UNSERVED_FOR`](crate::engine::progress::UNSERVED_FOR) — far longer than a thread
    /// waits for a core on a busy machine or sleeps by its idle policy until a packet wakes
    /// it — and clears it once the thread runs again (it runs: whatever keeps it from
    /// stepping back, work on every iteration or `IdlePolicy::Spin`, is no reason to take
    /// the engine from it). A second poller at a window's end at once skips it.
    #[cold]
    #[inline(never)]
    fn unserved_window(&self) {
        let Ok(mut seen) = self.unserved_seen.try_lock() else {
            return;
        };
        let beat = self.engine_beat.load(Ordering::Relaxed);
        let now = std::time::Instant::now();
        let (last, since) = *seen;
        if beat != last {
            *seen = (beat, now);
            self.serving.store(false, Ordering::Relaxed);
        } else if now.duration_since(since) >= crate::engine::progress::UNSERVED_FOR {
            self.serving.store(true, Ordering::Relaxed);
            // Once per window, the token from whoever holds its bias.
            self.serve_unserved(true);
        }
    }

    /// Runs `f` on the engine now, from a post, if the application's own calls run the
    /// engine and it is free: in inline mode on any thread; in poll mode while the engine
    /// thread has stepped back for a busy-polling application, on the thread that owns the
    /// token (the one whose polls drive it), so that another thread's post does not revoke
    /// that bias (a `membarrier`) — it queues its work instead (a Send's doorbell then
    /// still runs the engine through [`Device::notify`], as it always did). Where there is
    /// no `membarrier` the token has no owner, and any thread takes it (a compare and swap,
    /// nothing to revoke). `None` when the caller must queue its work for the engine.
    #[inline(always)]
    pub(crate) fn run_for_post<R>(&self, f: impl FnOnce(&mut Engine) -> R) -> Option<R> {
        let inline = self.mode == EngineMode::Inline;
        if !inline && self.app_drives.load(Ordering::Relaxed) == 0 {
            return None;
        }
        // Whether the slow path may be taken is asked only off the owner's fast path (a
        // post from the owning thread, nearly every one, does not look at the barrier).
        self.engine
            .try_with_if(|| inline || !crate::engine::cell::barrier_available(), f)
    }

    /// Tells the engine there is new work for QP `index`: rings its doorbell, then runs the
    /// engine now (inline mode) or wakes its thread if it may be asleep (poll mode).
    #[inline]
    pub(crate) fn notify(&self, index: u32) {
        if self.mode == EngineMode::Inline {
            // (An inline engine watches no send queue: this rings.)
            self.doorbell.ring_unless_watched(index);
            // Someone else holds the engine (the progress helper, another thread): wake
            // any thread asleep on the kick words, so that it takes the doorbell.
            if self.engine.try_with(|e| e.send_now(index)).is_none() && self.helper_may_sleep() {
                self.wake_local();
            }
        } else if self.app_drives.load(Ordering::Relaxed) != 0 {
            // The engine thread stepped back for a busy-polling application: send now, as
            // inline mode does (its next poll would, else). A post that misses the flag
            // going up is sent by that next poll, or by the thread within its step.
            self.doorbell.ring_unless_watched(index);
            // The token is busy (the thread coming back, a control operation): make sure a
            // thread about to sleep takes the doorbell.
            if self.engine.try_with(|e| e.send_now(index)).is_none() && self.may_sleep {
                self.wake_local();
            }
        } else if self.doorbell.ring_unless_watched(index) && self.may_sleep {
            // Not rung when the engine thread watches the send queue: it looks at the
            // queue itself, and is awake (it stops watching before it sleeps).
            self.wake_local();
        }
    }

    /// Wakes a sleeping engine thread after a control operation gave it work.
    pub(crate) fn kick(&self) {
        if self.helper_may_sleep() {
            self.wake_local();
        }
    }

    /// Wakes this engine's sleeping threads, if any, after work was published for them.
    #[inline]
    fn wake_local(&self) {
        wake::wake(self.sleepers(), &self.kick, true);
    }

    /// Sleeps this thread for at most `max` unless `has_work` (the last look, run after the
    /// sleep was announced, and again in a long sleep: see [`wake::sleep`]) finds work or
    /// the engine is busy elsewhere; a post, a control operation or a peer's packets on any
    /// link wake it. Returns whether it slept.
    pub(crate) fn sleep(
        &self,
        set: &mut wake::WaitSet,
        max: std::time::Duration,
        has_work: impl FnMut() -> bool,
    ) -> bool {
        wake::sleep(
            self.sleepers(),
            &self.kick,
            set,
            max,
            |set| self.engine.try_with(|e| e.wait_on_links(set)).is_some(),
            has_work,
        )
    }

    /// Records that link `id` of this device leads to `peer`, a device of this process.
    /// (Such links, made by `Context::link_with`, live as long as the device: their ids are
    /// never reused for another peer.)
    pub(crate) fn add_local_peer(&self, id: LinkId, peer: &Arc<Device>) {
        let mut peers = self.local_peers.lock().unwrap_or_else(|e| e.into_inner());
        peers.retain(|(l, _)| *l != id);
        peers.push((id, Arc::downgrade(peer)));
    }

    /// For a destination over an in-process link (`Context::link_with`): records on the link
    /// the arena the peer QP sends from, found in the peer context. The two engine tokens
    /// are taken one after the other, never together.
    pub(crate) fn find_local_peer_qp(&self, d: crate::Destination) {
        let peer = self
            .local_peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|(l, _)| *l == d.link)
            .map(|(_, w)| w.clone());
        let Some(peer) = peer.and_then(|w| w.upgrade()) else {
            return;
        };
        let found = peer.engine.with(|e| {
            e.qp_by_qpn(d.qpn).map(|q| {
                let key = (u64::from(q.proto.pd.get()), u64::from(peer.id));
                (key, q.mem.read_only())
            })
        });
        if let Some((key, mem)) = found {
            self.engine.with(|e| {
                if let Some(l) = e.link_mut(d.link) {
                    l.add_peer_qp(d.qpn, key, mem);
                }
            });
        }
    }

    /// This engine's sleeper count (in its engine page, where peers read it).
    pub(crate) fn sleepers(&self) -> &std::sync::atomic::AtomicU32 {
        self.engine_page_mem
            .atomic_u32(crate::arena::WAKE_WORD)
            .expect("the engine page holds the sleeper count")
    }
}

/// The engine thread's look for work after it announced its sleep (and again after the
/// spin and the grace wait of a long sleep, `wake::sleep`): `progress` (an iteration; `None`: the token is held
/// elsewhere) did work, or could not look — the rings are then unseen, and the token's
/// holder may be a control operation or a post, which receive nothing — or `prepare` (stop
/// watching, then whether the engine is idle; `None`: the token is held elsewhere) says
/// stay awake. A busy token at the first step alone used to count as no work: when it was
/// free again for `prepare`, which looks at no ring, the thread slept its `max_sleep` with
/// a frame waiting whose publisher had not seen it counted.
fn stays_awake(
    progress: impl FnOnce() -> Option<usize>,
    prepare: impl FnOnce() -> Option<bool>,
) -> bool {
    progress().is_none_or(|n| n > 0) || !prepare().unwrap_or(false)
}

pub(crate) fn engine_thread(shared: Arc<Device>, cpu: Option<usize>, idle: IdlePolicy) {
    if let Some(cpu) = cpu {
        core_affinity::set_for_current(core_affinity::CoreId { id: cpu });
    }
    let mut idle_iters = 0u32;
    let mut n: u32 = 0;
    let mut wait_set = wake::WaitSet::default();
    let mut seen_polls = shared.empty_polls.load(Ordering::Relaxed);
    loop {
        n = n.wrapping_add(1);
        // (Read by the polls once per window of theirs: `Device::unserved_window`.)
        shared.engine_beat.store(n, Ordering::Relaxed);
        // The thread holds one reference; when it is the last, every handle is gone.
        if n % 1024 == 0 && Arc::strong_count(&shared) == 1 {
            break;
        }
        if shared.engine.control_waiting() {
            std::thread::yield_now();
            continue;
        }
        if shared.progress() > 0 {
            idle_iters = 0;
            continue;
        }
        match idle {
            IdlePolicy::Spin => std::hint::spin_loop(),
            IdlePolicy::Backoff { spins, max_sleep } => {
                idle_iters = idle_iters.saturating_add(1);
                // The application busy-polls its completion queues: let it drive.
                if idle_iters % 256 == 0 && shared.app_polls_busily(&mut seen_polls) {
                    shared.step_back(&mut seen_polls);
                    idle_iters = 0;
                    n |= 1023; // look at the reference count after every step back
                    continue;
                }
                if idle_iters < spins {
                    std::hint::spin_loop();
                    continue;
                }
                let idle_now = shared
                    .engine
                    .try_with(|e| e.prepare_sleep(&shared.doorbell))
                    .unwrap_or(false);
                if !idle_now {
                    // Work in flight (requests awaiting responses, timers): stay awake.
                    std::thread::yield_now();
                    continue;
                }
                // Work found after announcing the sleep keeps the thread awake; so does a
                // send queue it started to watch meanwhile (`prepare_sleep` stops watching,
                // so that posts ring and wake it), and a token held elsewhere.
                let slept = shared.sleep(&mut wait_set, max_sleep, || {
                    stays_awake(
                        || shared.try_progress(),
                        || {
                            shared
                                .engine
                                .try_with(|e| e.prepare_sleep(&shared.doorbell))
                        },
                    )
                });
                if slept {
                    shared.engine.with(|e| e.note_sleep());
                }
                idle_iters = 0;
                n |= 1023; // look at the reference count after every sleep
            }
        }
    }
}

/// The engine thread's look before it sleeps.
#[cfg(test)]
mod stays_awake_tests {
    /// The token is held elsewhere when the look's iteration tries it (a control operation,
    /// a post) and free again a moment later for `prepare_sleep`, which finds the engine
    /// idle (it looks at no ring). A frame may be waiting unseen (published before this
    /// thread was counted, or by a waker whose load of the count raced it): the thread
    /// must not sleep. It did: only the iteration's work counted.
    #[test]
    fn a_look_that_found_the_token_busy_keeps_the_thread_awake() {
        assert!(super::stays_awake(|| None, || Some(true)));
        // The other cases, as they were.
        assert!(super::stays_awake(|| Some(1), || Some(true)));
        assert!(super::stays_awake(|| Some(0), || None));
        assert!(super::stays_awake(|| Some(0), || Some(false)));
        assert!(!super::stays_awake(|| Some(0), || Some(true)));
    }
}
