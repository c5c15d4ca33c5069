//! Completion channels: waiting for completions without spinning.
//!
//! A [`CompChannel`] is a file descriptor (an eventfd) that becomes readable when a
//! completion queue attached to it has an *event*: a completion arrived after the
//! application armed the queue with [`Cq::req_notify`](crate::Cq::req_notify). It works
//! with `poll`/`epoll`, mio and tokio's `AsyncFd` (it implements [`AsFd`] and [`AsRawFd`]),
//! or blocks in [`CompChannel::get_event`].
//!
//! # Mapping from ibverbs
//!
//! | ibverbs | shmhca |
//! |---|---|
//! | `ibv_create_comp_channel` | [`Context::create_comp_channel`](crate::Context::create_comp_channel) |
//! | `ibv_create_cq(…, channel, …)` | [`Context::create_cq_with_channel`](crate::Context::create_cq_with_channel) |
//! | `ibv_req_notify_cq(cq, solicited_only)` | [`Cq::req_notify`](crate::Cq::req_notify) |
//! | `ibv_get_cq_event` (blocking) | [`CompChannel::get_event`] (with a timeout) |
//! | `ibv_get_cq_event` on a non-blocking fd | [`CompChannel::try_get_event`] |
//! | `ibv_ack_cq_events` | not needed: an event is consumed when returned, and a [`Cq`](crate::Cq) can be dropped at any time (its pending event is then discarded) |
//! | `channel->fd` | [`AsFd`] / [`AsRawFd`] (non-blocking, readable while events are pending) |
//! | the CQ pointer of an event | the CQ's number, [`Cq::number`](crate::Cq::number) |
//!
//! The rules are ibverbs': arming is one-shot (re-arm after each event, then poll the CQ
//! once more before waiting, since completions that arrived before the arm raise no
//! event); with `solicited_only` the event waits for a receive completion of a message
//! whose sender set the solicited-event bit ([`SendFlags::SOLICITED`](crate::SendFlags)),
//! or for a completion in error (errors always notify).
//!
//! Events come in the order they were raised, whatever queues they are for (among those a
//! wait collects at once; a queue re-armed and fired again before the collection counts
//! at its last event), and in the order an HCA raises them: a message's send completion before the receive completion
//! of the peer's reply, although the Ack that completes the message rides in the reply
//! (when the send queue is armed the engine handles that Ack first). A program that
//! waits on one channel for both its queues and takes one completion per event (perftest
//! 4.5's `ib_send_lat -e`) relies on it.
//!
//! # Cost
//!
//! Nothing while no queue is armed: the engine's completion push checks a flag in its own
//! private memory. An armed queue costs, once per event, one atomic bit set and one
//! `write(2)` to the eventfd; a riding Ack in a request, one load while a queue is armed.
//!
//! # Who runs the engine while the application sleeps
//!
//! In poll mode the engine thread does. In inline mode [`CompChannel::get_event`] and
//! [`Cq::wait`](crate::Cq::wait) drive the engine from the waiting thread; with
//! [`IdlePolicy::Backoff`](crate::IdlePolicy) they sleep on the engine's kick words between
//! runs (a peer's packet wakes them within microseconds), with `IdlePolicy::Spin` they poll
//! and yield. An application that waits on the fd itself (an async runtime) relies on the
//! progress helper ([`Progress::Auto`](crate::Progress)), which sleeps on its kick words
//! while a notification is armed: with `Backoff`, and with `Spin` (the default) as soon as
//! the application has taken the fd ([`AsFd`] / [`AsRawFd`]), which tells peers to wake
//! this engine from then on. (Before, a `Spin` engine's helper slept its tick — 0.1 to
//! 5 ms, 50 ms without connected QPs — and the event came that late.)
//!
//! # Wake latency between processes
//!
//! `cargo bench -p shmhca-bench --bench wake` measures it: process A sleeps in `poll(2)`
//! on the channel's fd (taken before it connects, as an async server builds its
//! `AsyncFd`), process B posts a Send carrying its `CLOCK_MONOTONIC` time every 2 ms, A
//! records the time from B's post to its return from `poll(2)`; 1,000 samples per row.
//! On the 2-vCPU KVM guest of the README, on 2026-11-28, shared with six other builds
//! (load average 11 for the run before the change, 20 after):
//!
//! | waiter | p50 | p90 | p99 | max |
//! |---|---|---|---|---|
//! | inline, `Spin` (the default), before | 8,012 µs | 8,372 µs | 14,844 µs | 41,681 µs |
//! | inline, `Spin` (the default), after | 16 µs | 20 µs | 28 µs | 46 µs |
//! | inline, `Backoff`, before | 27 µs | 54 µs | 1,567 µs | 10,183 µs |
//! | inline, `Backoff`, after | 18 µs | 24 µs | 33 µs | 1,358 µs |
//! | poll mode, `Backoff`, before | 27 µs | 36 µs | 54 µs | 76 µs |
//! | poll mode, `Backoff`, after | 27 µs | 35 µs | 51 µs | 85 µs |
//!
//! Before, the default engine's helper slept its tick (0.1 to 5 ms, and longer under
//! load) and raised the event only then. An eventfd wake-up between two sleeping processes
//! costs tens of µs on this machine; a long tail is the machine's load (another process
//! on the core), not the channel.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{EventfdFlags, PollFd, PollFlags, eventfd};
use shmhca_rings::doorbell::{Doorbell, MAX_QUEUES};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::tables::cq::Signal;
use crate::verbs::EngineMode;

/// The most completion queues one channel serves.
pub const MAX_CQS_PER_CHANNEL: u32 = MAX_QUEUES as u32;

/// A completion channel: an fd that is readable while completion queues attached to it have
/// events. See the [module documentation](self) for the ibverbs mapping.
///
/// ```
/// use std::time::Duration;
/// use shmhca::Context;
/// let ctx = Context::builder().arena_size(1 << 20).build()?;
/// let mut channel = ctx.create_comp_channel()?;
/// let mut cq = ctx.create_cq_with_channel(16, &channel)?;
/// cq.req_notify(false)?;
/// // Nothing completed: no event.
/// assert_eq!(channel.get_event(Some(Duration::from_millis(1)))?, None);
/// # Ok::<(), shmhca::Error>(())
/// ```
pub struct CompChannel {
    pub(crate) signal: Arc<Signal>,
    shared: Arc<Device>,
    /// Events taken from the fired set, not yet returned.
    pending: VecDeque<u32>,
    /// The events of one collection, with their stamps, to sort (kept to reuse its room).
    taken: Vec<(u64, u32)>,
}

impl CompChannel {
    pub(crate) fn create(shared: &Arc<Device>) -> Result<CompChannel> {
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(|e| Error::io("creating the completion channel's eventfd", e.into()))?;
        let signal = Signal {
            fd,
            fired: Doorbell::new(MAX_QUEUES),
            cqns: (0..MAX_QUEUES).map(|_| AtomicU32::new(0)).collect(),
            stamps: (0..MAX_QUEUES).map(|_| AtomicU64::new(0)).collect(),
            next_stamp: AtomicU64::new(0),
            free: Mutex::new((0..MAX_CQS_PER_CHANNEL).rev().collect()),
            fd_taken: AtomicBool::new(false),
        };
        Ok(CompChannel {
            signal: Arc::new(signal),
            shared: shared.clone(),
            pending: VecDeque::new(),
            taken: Vec::new(),
        })
    }

    pub(crate) fn same_context(&self, shared: &Arc<Device>) -> bool {
        Arc::ptr_eq(&self.shared, shared)
    }

    /// The next event without waiting: the number ([`Cq::number`](crate::Cq::number)) of a
    /// completion queue that had an event, or `None`. Use it after the fd became readable
    /// (an async runtime's readiness), until it returns `None`.
    ///
    /// Readiness is a hint, as with any fd: the fd can be readable once with no event behind
    /// it (an event raised by another thread while this one collected the previous event),
    /// so a `None` right after readiness means "wait on the fd again".
    ///
    /// In inline mode it first runs the engine once (as [`Cq::poll`](crate::Cq::poll) does).
    ///
    /// # Errors
    /// Reading the eventfd failed (not expected).
    pub fn try_get_event(&mut self) -> Result<Option<u32>> {
        if let Some(cq) = self.pending.pop_front() {
            return Ok(Some(cq));
        }
        self.shared.progress_inline();
        self.collect()?;
        Ok(self.pending.pop_front())
    }

    /// Waits for the next event, up to `timeout` (`None`: for ever); returns the number of
    /// the completion queue that had it, or `None` when the time ran out. Arm the queues
    /// first ([`Cq::req_notify`](crate::Cq::req_notify)).
    ///
    /// In poll mode it sleeps in `poll(2)` on the fd. In inline mode the calling thread runs
    /// the engine, and between runs sleeps on its kick words (with
    /// [`IdlePolicy::Backoff`](crate::IdlePolicy)) or yields (with `Spin`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when it would wait for ever for nothing: `timeout` is `None`
    /// and no completion queue is attached to the channel (none was created with it, or all
    /// were destroyed, also while it waited); reading or polling the eventfd failed (not
    /// expected).
    pub fn get_event(&mut self, timeout: Option<Duration>) -> Result<Option<u32>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(cq) = self.try_get_event()? {
                return Ok(Some(cq));
            }
            if deadline.is_none() && self.attached() == 0 {
                return Err(Error::invalid(
                    "get_event",
                    "no completion queue is attached to this completion channel, so waiting \
                     for ever would never end: create one with Context::create_cq_with_channel \
                     first, or pass a timeout",
                ));
            }
            let left = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(l) if !l.is_zero() => Some(l),
                    _ => return Ok(None),
                },
                None => None,
            };
            // About to sleep: an engine thread that stepped back for this thread's polls
            // takes over again.
            self.shared.resume_engine();
            if self.shared.mode == EngineMode::Inline {
                let signal = self.signal.clone();
                let _blocked = self.shared.block();
                self.shared.idle_wait(left, || readable(&signal.fd));
            } else {
                wait_readable(&self.signal.fd, left)?;
            }
        }
    }

    /// How many completion queues are attached to the channel now.
    fn attached(&self) -> u32 {
        let free = self
            .signal
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len();
        MAX_CQS_PER_CHANNEL - free as u32
    }

    /// Moves the fired queues into `pending`.
    fn collect(&mut self) -> Result<()> {
        let mut buf = [0u8; 8];
        match rustix::io::read(&self.signal.fd, &mut buf) {
            Ok(_) | Err(rustix::io::Errno::AGAIN) => {}
            Err(e) => return Err(Error::io("reading the completion channel", e.into())),
        }
        let Signal {
            fired,
            cqns,
            stamps,
            ..
        } = &*self.signal;
        let taken = &mut self.taken;
        taken.clear();
        fired.take(|slot| {
            // SYNC: the slot's CQ number was stored before the queue could be armed (both
            // under the engine token), and the fired bit's Acquire orders these loads
            // after it and the stamp written before it.
            let cq = cqns[slot as usize].load(Ordering::Relaxed);
            if cq != 0 {
                taken.push((stamps[slot as usize].load(Ordering::Relaxed), cq));
            }
        });
        // In the order raised: a program waiting for the send queue's event must not get
        // the receive queue's, raised after it, first.
        taken.sort_unstable();
        self.pending.extend(taken.iter().map(|&(_, cq)| cq));
        Ok(())
    }

    /// Takes a slot for CQ `cqn` (control path).
    pub(crate) fn attach(&self, cqn: u32) -> Result<u32> {
        let slot = self
            .signal
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .ok_or(Error::LimitReached {
                what: "completion queues on one completion channel",
                limit: MAX_CQS_PER_CHANNEL,
            })?;
        self.signal.cqns[slot as usize].store(cqn, Ordering::Relaxed);
        Ok(slot)
    }
}

/// Gives a queue's channel slot back (its CQ was destroyed), and wakes a thread waiting on
/// the channel, so that a [`CompChannel::get_event`] with no timeout sees that no queue is
/// left to wait for.
pub(crate) fn detach(signal: &Signal, slot: u32) {
    signal.cqns[slot as usize].store(0, Ordering::Relaxed);
    signal
        .free
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(slot);
    // An eventfd write fails only when the counter would overflow (it is then readable).
    let _ = rustix::io::write(&signal.fd, &1u64.to_ne_bytes());
}

/// Whether `fd` is readable now.
pub(crate) fn readable(fd: impl AsFd) -> bool {
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    let zero = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    rustix::event::poll(&mut fds, Some(&zero)).is_ok_and(|n| n > 0)
}

/// Sleeps until `fd` is readable or `left` passes.
pub(crate) fn wait_readable(fd: impl AsFd, left: Option<Duration>) -> Result<()> {
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    let ts = left.map(|l| rustix::event::Timespec {
        tv_sec: l.as_secs() as _,
        tv_nsec: l.subsec_nanos() as _,
    });
    match rustix::event::poll(&mut fds, ts.as_ref()) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(Error::io("waiting on an eventfd", e.into())),
    }
}

impl AsFd for CompChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.signal.fd_taken.store(true, Ordering::Relaxed);
        self.shared.allow_fd_sleep();
        self.signal.fd.as_fd()
    }
}

impl AsRawFd for CompChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.signal.fd_taken.store(true, Ordering::Relaxed);
        self.shared.allow_fd_sleep();
        self.signal.fd.as_raw_fd()
    }
}

impl std::fmt::Debug for CompChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompChannel")
            .field("fd", &self.signal.fd.as_raw_fd())
            .finish_non_exhaustive()
    }
}
