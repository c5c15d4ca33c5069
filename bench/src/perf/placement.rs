//! Where a run's threads go, and the warning when the threads that spin outnumber the cores
//! they may run on.
//!
//! A run has two sides, client and server, in one process (`--in-process`) or two. Each
//! side's application thread polls its completion queue without pause, and in `--mode poll`
//! so does its engine thread: four spinning threads. With `-e` nothing spins (the
//! application sleeps on its completion channel, the engine backs off to sleep). A thread
//! that spins gives its core back only when the scheduler takes it, so when spinning
//! threads outnumber cores every round trip waits for time slices: `send_lat --mode poll`
//! on two cores took ~76 ms per round trip instead of microseconds. shmhca-perf then says
//! so on stderr, in one line with what to do, and runs all the same (the figures are
//! real, only useless as a measure of shmhca).
//!
//! Placement: the application threads are pinned to the first two cores this process may
//! run on (or `--cpu A,B`). A poll-mode engine thread goes to `--engine-cpu C,D`; without
//! it, where shmhca-perf places both sides (its own peer process, `--in-process`), to the
//! next two cores not taken by the application threads, and where there are none, nowhere
//! in particular: the engine is created before the application thread is pinned, so that
//! it never inherits that pin and shares its application thread's core (it did: each
//! engine thread ran on its application thread's core).

use crate::perf::opts::ModeArg;

/// Threads that poll without ever sleeping, client and server together: each side's
/// application thread, and in poll mode its engine thread; none with `-e`.
pub fn spinning_threads(mode: ModeArg, events: bool) -> usize {
    if events {
        return 0;
    }
    2 * (1 + usize::from(mode == ModeArg::Poll))
}

/// The cores the spinning threads can run on: when every one of them is pinned (`pins`,
/// one entry per spinning thread, `None` for a thread the scheduler places), the distinct
/// cores they are pinned to; otherwise the `mask` cores this process may run on.
pub fn usable_cores(mask: usize, pins: &[Option<usize>]) -> usize {
    let pinned: Option<Vec<usize>> = pins.iter().copied().collect();
    match pinned {
        Some(mut cores) if !cores.is_empty() => {
            cores.sort_unstable();
            cores.dedup();
            cores.len()
        }
        _ => mask,
    }
}

/// The default cores of the client's and the server's engine threads, for a run that
/// places both sides: the first two cores of `mask` that no application thread (`app`) is
/// pinned to; `None` for a side when there is no such core.
pub fn default_engine_cores(mask: &[usize], app: [Option<usize>; 2]) -> [Option<usize>; 2] {
    let mut free = mask.iter().copied().filter(|c| !app.contains(&Some(*c)));
    match (free.next(), free.next()) {
        (Some(a), Some(b)) => [Some(a), Some(b)],
        _ => [None, None],
    }
}

/// The warning for `spinning` threads on `cores` cores in `mode`, one line saying what to
/// do; `None` when they fit.
pub fn oversubscription(mode: ModeArg, spinning: usize, cores: usize) -> Option<String> {
    if spinning <= cores {
        return None;
    }
    let (threads, instead) = match mode {
        ModeArg::Poll => (
            "its application thread and its poll-mode engine thread",
            "use --mode inline (2 spinning threads), -e (nothing spins), or give 4 cores \
             (--pin_cores, --cpu and --engine-cpu)",
        ),
        ModeArg::Inline => (
            "its application thread",
            "use -e (nothing spins), or give 2 cores (--pin_cores, --cpu)",
        ),
    };
    Some(format!(
        "shmhca-perf: warning: {spinning} threads spin (client and server: each {threads}) \
         on {cores} core(s): every round trip waits for the scheduler's time slices \
         (milliseconds instead of microseconds); {instead}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_cores_are_the_next_two_free_ones() {
        assert_eq!(
            default_engine_cores(&[0, 1, 2, 3], [Some(0), Some(1)]),
            [Some(2), Some(3)]
        );
        assert_eq!(
            default_engine_cores(&[0, 1, 2, 3, 4], [Some(2), Some(0)]),
            [Some(1), Some(3)]
        );
        assert_eq!(
            default_engine_cores(&[0, 1, 2], [Some(0), Some(1)]),
            [None, None]
        );
        assert_eq!(default_engine_cores(&[], [None, None]), [None, None]);
    }
}
