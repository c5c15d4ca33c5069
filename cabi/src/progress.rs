//! Who drives the engine. verbs programs expect the HCA to make progress on its own:
//! perftest's `ib_write_lat` polls a byte of its buffer and calls no verb, and bandwidth
//! servers wait in a blocking TCP read. So each context runs shmhca's poll mode (an engine
//! thread) with the backoff idle policy (spin, then yield, then sleep until woken), unless
//! the environment says otherwise: `SHMHCA_VERBS_MODE=inline` (the program's verb calls
//! run the engine, with shmhca's progress helper), `SHMHCA_VERBS_IDLE=spin`,
//! `SHMHCA_VERBS_SPINS`, `SHMHCA_VERBS_MAX_SLEEP_US`, `SHMHCA_VERBS_CPU` (pin the engine).
//! The same place reads the other process-wide settings: `SHMHCA_VERBS_HUGE_PAGES` and
//! `SHMHCA_VERBS_ZERO_COPY` ([`zero_copy`]).
//!
//! A program that busy-polls its completion queue drives the engine itself: the engine
//! thread steps back while the polls keep coming (`shmhca`'s poll mode does that for any
//! application), so that two processes do not run four busy threads on two cores. Measured
//! on 2 cores (release, `ib_send_lat -F -s 8`, typical one-way latency,
//! `bench/scripts/compare_verbs.sh`): 0.45-0.56 µs, against 242-1,747 µs before the step
//! back; inline mode about the same.

use std::time::Duration;

use shmhca::{EngineMode, IdlePolicy};

/// The mode: poll (an engine thread, pinned to `SHMHCA_VERBS_CPU` if set), or inline with
/// `SHMHCA_VERBS_MODE=inline`.
pub fn engine_mode() -> EngineMode {
    if std::env::var("SHMHCA_VERBS_MODE").as_deref() == Ok("inline") {
        return EngineMode::Inline;
    }
    let cpu = std::env::var("SHMHCA_VERBS_CPU")
        .ok()
        .and_then(|v| v.parse().ok());
    EngineMode::Poll { cpu }
}

/// The engine thread's idle policy.
pub fn idle_policy() -> IdlePolicy {
    if std::env::var("SHMHCA_VERBS_IDLE").as_deref() == Ok("spin") {
        return IdlePolicy::Spin;
    }
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    match (env("SHMHCA_VERBS_SPINS"), env("SHMHCA_VERBS_MAX_SLEEP_US")) {
        (None, None) => IdlePolicy::default(),
        (spins, sleep) => IdlePolicy::Backoff {
            spins: spins.map_or(10_000, |s| u32::try_from(s).unwrap_or(u32::MAX)),
            max_sleep: Duration::from_micros(sleep.unwrap_or(100_000)),
        },
    }
}

/// Huge pages for the arenas only with `SHMHCA_VERBS_HUGE_PAGES=1`: a verbs program's
/// buffers are its own memory (the arena holds only their shadows and the QPs' staging), and
/// without a reserved pool every process would print the fallback warning.
pub fn huge_pages() -> shmhca_rings::segment::HugePages {
    match std::env::var("SHMHCA_VERBS_HUGE_PAGES").as_deref() {
        Ok("1") => shmhca_rings::segment::HugePages::Auto,
        _ => shmhca_rings::segment::HugePages::Never,
    }
}

/// Whether `ibv_reg_mr` moves page-aligned buffers of whole pages onto the protection
/// domain's arena in place, for zero copy (`SHMHCA_VERBS_ZERO_COPY=1`; read once per
/// process). See [`shmhca::Pd::reg_mr_in_place`]: such a buffer becomes readable by the
/// processes of connected peers, like any arena region. Any other buffer, or one the
/// engine refuses to move, is registered as today (a shadow in the arena for what peers
/// read).
pub fn zero_copy() -> bool {
    static ZERO_COPY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ZERO_COPY.get_or_init(|| std::env::var("SHMHCA_VERBS_ZERO_COPY").as_deref() == Ok("1"))
}
