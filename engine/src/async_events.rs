//! Asynchronous events: what the device tells the application outside any completion
//! queue (`ibv_get_async_event`).
//!
//! Each [`Context`](crate::Context) has one queue of [`AsyncEvent`]s, which the engine
//! fills and the application empties with
//! [`Context::get_async_event`](crate::Context::get_async_event) (blocking, with a
//! timeout) or [`Context::try_get_async_event`](crate::Context::try_get_async_event); its
//! fd ([`Context::async_event_fd`](crate::Context::async_event_fd)) is readable exactly
//! while events are queued, for `poll`/`epoll` or an async runtime.
//!
//! # Mapping from ibverbs
//!
//! | ibverbs | shmhca |
//! |---|---|
//! | `ibv_get_async_event` | [`Context::get_async_event`](crate::Context::get_async_event) (with a timeout) |
//! | `ibv_get_async_event` on a non-blocking `async_fd` | [`Context::try_get_async_event`](crate::Context::try_get_async_event) |
//! | `ibv_ack_async_event` | not needed: an event is consumed when returned |
//! | `context->async_fd` | [`Context::async_event_fd`](crate::Context::async_event_fd) |
//! | `IBV_EVENT_QP_FATAL` | [`AsyncEvent::QpFatal`] |
//! | `IBV_EVENT_COMM_EST` | [`AsyncEvent::CommEstablished`] |
//! | `IBV_EVENT_SRQ_LIMIT_REACHED` | [`AsyncEvent::SrqLimitReached`] |
//! | `IBV_EVENT_QP_LAST_WQE_REACHED` | [`AsyncEvent::QpLastWqeReached`] |
//!
//! # Cost
//!
//! None on the message path: events are raised on error and state-change paths only (a
//! QP's first request in RTR costs one flag test per request). Raising one takes a lock
//! and writes the eventfd once.
//!
//! The queue holds at most [`MAX_ASYNC_EVENTS`] events: an application that never reads
//! them loses the newest ones past that (counted), and its memory does not grow.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::event::{EventfdFlags, eventfd};

use crate::error::{Error, Result};
use crate::wire::Qpn;

/// The most events a context's queue holds; past it the newest are dropped.
pub const MAX_ASYNC_EVENTS: usize = 4096;

/// An asynchronous event of a context (`struct ibv_async_event`): something happened to a
/// QP or an SRQ outside any work request.
///
/// ```
/// use std::time::Duration;
/// use shmhca::{AsyncEvent, Context};
///
/// let ctx = Context::builder().arena_size(1 << 20).build()?;
/// match ctx.get_async_event(Some(Duration::from_millis(1)))? {
///     Some(AsyncEvent::QpFatal { qpn }) => eprintln!("QP {:#x} failed", qpn.get()),
///     Some(AsyncEvent::SrqLimitReached { srq }) => eprintln!("refill SRQ {srq}"),
///     Some(other) => eprintln!("{other:?}"),
///     None => {} // nothing happened within the timeout
/// }
/// # Ok::<(), shmhca::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AsyncEvent {
    /// `IBV_EVENT_QP_FATAL`: the QP met an error outside any work request (its peer is
    /// gone) and is now in the Error state; [`Qp::last_error`](crate::Qp::last_error) says
    /// why.
    QpFatal {
        /// The QP's number ([`Qp::qpn`](crate::Qp::qpn)).
        qpn: Qpn,
    },
    /// `IBV_EVENT_COMM_EST`: the QP received its first request while in the RTR state
    /// (once per entry into RTR). A QP that moved to RTS before its peer sent anything
    /// does not raise it, as with a hardware HCA.
    CommEstablished {
        /// The QP's number.
        qpn: Qpn,
    },
    /// `IBV_EVENT_SRQ_LIMIT_REACHED`: a QP took a receive from the SRQ and fewer than its
    /// armed limit remain ([`Srq::arm_limit`](crate::Srq::arm_limit)); the limit is
    /// disarmed.
    SrqLimitReached {
        /// The SRQ's number ([`Srq::number`](crate::Srq::number)).
        srq: u32,
    },
    /// `IBV_EVENT_QP_LAST_WQE_REACHED`: a QP attached to an SRQ entered the Error state;
    /// it will take no more receives from the SRQ (once per entry into Error).
    QpLastWqeReached {
        /// The QP's number.
        qpn: Qpn,
    },
}

/// A context's queue of asynchronous events and its eventfd (a semaphore: one count per
/// event queued, so it is readable exactly while events wait). The engine raises (under
/// its token, from the stages through `Resources::async_events`); the application takes.
pub(crate) struct AsyncQueue {
    events: Mutex<VecDeque<AsyncEvent>>,
    fd: OwnedFd,
    /// Events dropped because the queue was full.
    dropped: AtomicU64,
}

impl AsyncQueue {
    /// An empty queue.
    ///
    /// # Errors
    /// The eventfd could not be created.
    pub(crate) fn new() -> Result<AsyncQueue> {
        let fd = eventfd(
            0,
            EventfdFlags::SEMAPHORE | EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC,
        )
        .map_err(|e| Error::io("creating the asynchronous events' eventfd", e.into()))?;
        Ok(AsyncQueue {
            events: Mutex::new(VecDeque::new()),
            fd,
            dropped: AtomicU64::new(0),
        })
    }

    /// Queues `event` and makes the fd readable; drops it (counted) if the queue is full.
    #[cold]
    #[inline(never)]
    pub(crate) fn raise(&self, event: AsyncEvent) {
        let mut q = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= MAX_ASYNC_EVENTS {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        q.push_back(event);
        // Under the lock, so the count matches the queue. An eventfd write fails only when
        // the counter would overflow, far above MAX_ASYNC_EVENTS.
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// The oldest event, if any (consumes one count of the fd).
    pub(crate) fn take(&self) -> Option<AsyncEvent> {
        let mut q = self.events.lock().unwrap_or_else(|e| e.into_inner());
        let ev = q.pop_front()?;
        self.take_count();
        Some(ev)
    }

    /// Drops the queued events of SRQ `srq` (destroyed: its number may name another one
    /// soon, which must not get them).
    pub(crate) fn forget_srq(&self, srq: u32) {
        let mut q = self.events.lock().unwrap_or_else(|e| e.into_inner());
        let before = q.len();
        q.retain(|e| !matches!(e, AsyncEvent::SrqLimitReached { srq: s } if *s == srq));
        for _ in q.len()..before {
            self.take_count();
        }
    }

    /// Takes one count of the fd (a semaphore eventfd: one read, one count), only if it is
    /// readable: its flags are shared with the C ABI's `async_fd`, which is blocking, and a
    /// C program may read that fd itself — this must never block while holding the queue
    /// (the engine raises under its token). Called with the queue locked.
    fn take_count(&self) {
        let mut p = [rustix::event::PollFd::new(
            &self.fd,
            rustix::event::PollFlags::IN,
        )];
        let now = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        if rustix::event::poll(&mut p, Some(&now)).is_ok_and(|n| n > 0) {
            let mut buf = [0u8; 8];
            let _ = rustix::io::read(&self.fd, &mut buf);
        }
    }

    /// Events dropped so far because the queue was full.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// The eventfd.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl std::fmt::Debug for AsyncQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncQueue")
            .field("dropped", &self.dropped())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(q: &AsyncQueue) -> bool {
        let mut fds = [rustix::event::PollFd::new(
            &q.fd,
            rustix::event::PollFlags::IN,
        )];
        let zero = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        rustix::event::poll(&mut fds, Some(&zero)).is_ok_and(|n| n > 0)
    }

    #[test]
    fn the_fd_is_readable_exactly_while_events_wait_and_a_flood_is_bounded() {
        let q = AsyncQueue::new().unwrap();
        assert!(!readable(&q));
        let ev = |n| AsyncEvent::QpFatal { qpn: Qpn::new(n) };
        q.raise(ev(1));
        q.raise(ev(2));
        assert!(readable(&q));
        assert_eq!(q.take(), Some(ev(1)));
        assert!(readable(&q));
        assert_eq!(q.take(), Some(ev(2)));
        assert!(!readable(&q));
        assert_eq!(q.take(), None);
        for n in 0..MAX_ASYNC_EVENTS as u32 + 10 {
            q.raise(ev(n));
        }
        assert_eq!(q.dropped(), 10);
        for n in 0..MAX_ASYNC_EVENTS as u32 {
            assert_eq!(q.take(), Some(ev(n)), "the oldest kept, the newest dropped");
        }
        assert_eq!(q.take(), None);
        assert!(!readable(&q));
    }
}
