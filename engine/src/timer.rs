//! The transport and RNR timers (re-exported from [`shmhca_proto::timer`]) and the engine's
//! clock: [`SystemClock`], `CLOCK_MONOTONIC` read through the vDSO.
//!
//! The protocol core never reads a clock; the engine holds a [`Clock`] and passes the time
//! in. [`SystemClock`] is the one a [`Context`](crate::Context) uses unless a test gives it a
//! manual one.

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
