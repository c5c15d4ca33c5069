//! `--idle-timeout`: a side that hears nothing from its peer for that long ends the run
//! with [`PerfError::PeerIdle`] instead of waiting forever. A peer that died is noticed
//! sooner (its QPs leave RTS; with `--roce`, its [pulse](crate::perf::pulse) stops at once);
//! this catches one that is stopped (`SIGSTOP`, a debugger) or
//! hung, whose QPs stay connected but which sends nothing — a receive-only side (the
//! server of `send_bw`, `write_bw`, `read_bw`, `atomic_bw`) would otherwise wait forever.
//!
//! Two watches share the limit: the measurement loops' liveness check
//! measurement loops (time since the loop last made progress), and [`IdleWatch`] while a
//! side waits on the control channel (time since this engine last received a packet:
//! during `write_bw` the server's CQ sees nothing, but its engine receives every Write).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use shmhca::Context;

use crate::perf::error::PerfError;

/// The default `--idle-timeout`, in seconds.
pub const DEFAULT_IDLE_TIMEOUT_SECS: u64 = 10;

/// The limit in milliseconds; 0 = wait forever. Set once per run by [`set_timeout`]
/// (both sides of `--in-process` share the options, so one value serves both).
static TIMEOUT_MS: AtomicU64 = AtomicU64::new(DEFAULT_IDLE_TIMEOUT_SECS * 1000);

/// Sets the limit (`None`: wait forever).
pub fn set_timeout(t: Option<Duration>) {
    let ms = t.map_or(0, |t| {
        u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1)
    });
    TIMEOUT_MS.store(ms, Ordering::Relaxed);
}

/// The limit (`None`: wait forever).
pub fn timeout() -> Option<Duration> {
    match TIMEOUT_MS.load(Ordering::Relaxed) {
        0 => None,
        ms => Some(Duration::from_millis(ms)),
    }
}

/// The error for a peer silent for `waited` while this side was `what`.
pub fn idle_error(waited: Duration, what: &str) -> PerfError {
    PerfError::PeerIdle(format!(
        "nothing from the peer for {:.1} s while {what}: it is stopped (SIGSTOP, a debugger) or hung; \
         --idle-timeout SECS waits longer (0: forever)",
        waited.as_secs_f64()
    ))
}

/// Calls between two looks at the engine's counters (a look takes the engine's lock in
/// poll mode, so not on every call).
const CHECK_EVERY: u32 = 1024;

/// Watches an engine's received-packet count while a side waits on the control channel.
#[derive(Debug)]
pub struct IdleWatch {
    what: &'static str,
    calls: u32,
    packets: u64,
    since: Instant,
    limit: Option<Duration>,
}

impl IdleWatch {
    /// A watch for a wait described by `what` (e.g. "waiting for the client's end of size").
    pub fn new(ctx: &Context, what: &'static str) -> IdleWatch {
        IdleWatch {
            what,
            calls: 0,
            packets: ctx.stats().packets_received,
            since: Instant::now(),
            limit: timeout(),
        }
    }

    /// One more turn of the wait.
    ///
    /// # Errors
    /// [`PerfError::PeerIdle`] once `ctx` has received no packet for the limit;
    /// [`PerfError::PeerGone`] once `--roce`'s [pulse](crate::perf::pulse) says the peer's
    /// process ended.
    pub fn check(&mut self, ctx: &Context) -> Result<(), PerfError> {
        self.calls = self.calls.wrapping_add(1);
        if self.calls % CHECK_EVERY != 0 {
            return Ok(());
        }
        crate::perf::pulse::check()?;
        let Some(limit) = self.limit else {
            return Ok(());
        };
        let packets = ctx.stats().packets_received;
        if packets != self.packets {
            self.packets = packets;
            self.since = Instant::now();
            return Ok(());
        }
        let waited = self.since.elapsed();
        if waited > limit {
            return Err(idle_error(waited, self.what));
        }
        Ok(())
    }
}
