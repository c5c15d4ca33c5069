//! The transport and RNR timers (re-exported from [`shmhca_proto::timer`]) and the engine's
//! clock: [`SystemClock`], `CLOCK_MONOTONIC` read through the vDSO.
//!
//! The protocol core never reads a clock; the engine holds a [`Clock`] and passes the time
//! in. [`SystemClock`] is the one a [`Context`](crate::Context) uses unless it is built with
//! a [`TestClock`] ([`ContextBuilder::test_clock`](crate::ContextBuilder::test_clock)):
//! then its transport timers, RNR waits and retry counts run on the test's time, and a
//! test of a minute-long timeout takes no time at all.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub use shmhca_proto::timer::*;

/// The engine's clock: `CLOCK_MONOTONIC` for [`Clock::now`] and `CLOCK_MONOTONIC_COARSE` for
/// [`Clock::coarse`].
///
/// ```
/// use shmhca::timer::{Clock, SystemClock};
///
/// let a = SystemClock.now();
/// assert!(SystemClock.now() >= a);
/// assert!(SystemClock.coarse() <= SystemClock.now());
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> Timestamp {
        now()
    }

    fn resolution(&self) -> Duration {
        clock_resolution()
    }

    #[inline]
    fn coarse(&self) -> Timestamp {
        coarse()
    }

    fn coarse_lag(&self) -> Duration {
        // One tick, and one more for a tick that came late.
        coarse_resolution() * 2
    }
}

/// A clock for tests, shared by the test and the engines built with it
/// ([`ContextBuilder::test_clock`](crate::ContextBuilder::test_clock)): it stands still until
/// the test moves it, so protocol timers expire exactly when the test says, with no
/// waiting. Clones are the same clock.
///
/// A Send to a peer that never answers fails with `RetryExcErr` after `retry_cnt + 1`
/// transport timeouts; here the test jumps from one timeout to the next:
///
/// ```
/// use shmhca::timer::TestClock;
/// use shmhca::*;
///
/// let clock = TestClock::new();
/// let a = Context::builder().mode(EngineMode::Inline).test_clock(&clock).build()?;
/// let b = Context::builder().mode(EngineMode::Inline).build()?;
/// let (link, _) = a.link_with(&b)?;
/// let (pd, mut cq) = (a.alloc_pd()?, a.create_cq(4)?);
/// let (pd_b, cq_b) = (b.alloc_pd()?, b.create_cq(4)?);
/// let mut qp = a.create_qp(&pd, &cq, &cq, QpCaps::default())?;
/// // Its peer stays in Init: it drops every packet, as a peer that is gone would.
/// let mut peer = b.create_qp(&pd_b, &cq_b, &cq_b, QpCaps::default())?;
/// peer.modify(&QpAttr::new(QpState::Init).access(AccessFlags::NONE))?;
/// qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::NONE))?;
/// qp.modify(&QpAttr::new(QpState::Rtr).path_mtu(Mtu::Mtu1024).rq_psn(0)
///     .dest(Destination { link, qpn: peer.qpn() })
///     .max_dest_rd_atomic(1).min_rnr_timer(1))?;
/// // Local Ack Timeout 20: 4.3 s per try, 3 retries.
/// qp.modify(&QpAttr::new(QpState::Rts).sq_psn(0).timeout(20).retry_cnt(3).rnr_retry(0)
///     .max_rd_atomic(1))?;
/// let mr = pd.alloc_mr(64, AccessFlags::NONE)?;
/// qp.post_send(&SendWr::new(1, SendOp::Send, &[mr.sge(0, 8)?]))?;
/// let mut wc = [WorkCompletion::default()];
/// for _ in 0..100_000 {
///     if cq.poll(&mut wc) > 0 {
///         break;
///     }
///     a.progress();
///     b.progress();
///     if let Some(wait) = a.next_timer() {
///         clock.advance(wait); // the next timeout, now
///     }
/// }
/// assert_eq!(wc[0].status, WcStatus::RetryExcErr);
/// assert_eq!(a.stats().timeouts, 4, "the first try and 3 retries");
/// # Ok::<(), shmhca::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct TestClock(Arc<AtomicU64>);

impl TestClock {
    /// A clock standing at 1 s after its origin.
    pub fn new() -> TestClock {
        TestClock(Arc::new(AtomicU64::new(1_000_000_000)))
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        let d = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        // SYNC: Relaxed: the clock orders nothing; engines read it when they look at time.
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                Some(t.saturating_add(d))
            });
    }

    /// Moves the clock to `t` if `t` is ahead of it (a clock never goes back).
    pub fn advance_to(&self, t: Timestamp) {
        self.0.fetch_max(t.as_nanos(), Ordering::Relaxed);
    }
}

impl Clock for TestClock {
    #[inline]
    fn now(&self) -> Timestamp {
        Timestamp::from_nanos(self.0.load(Ordering::Relaxed))
    }

    /// One nanosecond: a test clock is exact.
    fn resolution(&self) -> Duration {
        Duration::from_nanos(1)
    }
}

/// The clock an engine's protocol timers run on.
#[derive(Debug, Clone, Default)]
pub(crate) enum EngineClock {
    /// [`SystemClock`].
    #[default]
    System,
    /// A test's.
    Test(TestClock),
}

impl Clock for EngineClock {
    #[inline]
    fn now(&self) -> Timestamp {
        match self {
            EngineClock::System => now(),
            EngineClock::Test(c) => c.now(),
        }
    }

    fn resolution(&self) -> Duration {
        match self {
            EngineClock::System => clock_resolution(),
            EngineClock::Test(c) => c.resolution(),
        }
    }

    #[inline]
    fn coarse(&self) -> Timestamp {
        match self {
            EngineClock::System => coarse(),
            EngineClock::Test(c) => c.now(),
        }
    }

    fn coarse_lag(&self) -> Duration {
        match self {
            EngineClock::System => SystemClock.coarse_lag(),
            EngineClock::Test(_) => Duration::ZERO,
        }
    }
}

/// The engine clock now (`CLOCK_MONOTONIC`, precise).
#[inline]
pub fn now() -> Timestamp {
    read(rustix::time::ClockId::Monotonic)
}

/// The coarse clock now (`CLOCK_MONOTONIC_COARSE`): the same time line as [`now`], never
/// ahead of it and behind it by less than [`coarse_resolution`] (one scheduler tick). Cheap
/// enough to read on every poll.
#[inline]
pub fn coarse() -> Timestamp {
    read(rustix::time::ClockId::MonotonicCoarse)
}

fn read(id: rustix::time::ClockId) -> Timestamp {
    let t = rustix::time::clock_gettime(id);
    Timestamp::from_nanos(t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64)
}

fn resolution(id: rustix::time::ClockId) -> Duration {
    let r = rustix::time::clock_getres(id);
    Duration::new(r.tv_sec as u64, r.tv_nsec as u32).max(Duration::from_nanos(1))
}

/// The resolution of [`now`] (1 ns on Linux with high-resolution timers).
pub fn clock_resolution() -> Duration {
    static RES: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *RES.get_or_init(|| resolution(rustix::time::ClockId::Monotonic))
}

/// The resolution of [`coarse`] (one scheduler tick, typically 1 to 4 ms).
pub fn coarse_resolution() -> Duration {
    static RES: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *RES.get_or_init(|| resolution(rustix::time::ClockId::MonotonicCoarse))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_clock_moves_and_has_a_resolution() {
        let a = now();
        std::thread::sleep(Duration::from_millis(1));
        assert!(now() > a);
        assert!(
            clock_resolution() <= Duration::from_micros(1),
            "a precise clock"
        );
        assert!(coarse_resolution() <= Duration::from_millis(100));
        // The coarse clock is on the same time line, never ahead, and behind by about a
        // tick (two allow for a tick that came late on a loaded machine).
        let fine = now();
        let c = coarse();
        assert!(c <= now());
        assert!(c.after(coarse_resolution() * 2 + Duration::from_millis(50)) >= fine);
        assert_eq!(
            fine.after(Duration::from_micros(7))
                .saturating_duration_since(fine),
            Duration::from_micros(7)
        );
        assert_eq!(a.saturating_duration_since(fine), Duration::ZERO);
        assert_eq!(SystemClock.coarse_lag(), coarse_resolution() * 2);
    }
}
