//! What an idle poll-mode engine thread does by default, and the warning when spinning
//! threads would outnumber the cores.
//!
//! # The default policy
//!
//! A poll-mode engine built without [`ContextBuilder::idle`](crate::ContextBuilder::idle)
//! (what [`Context::new`](crate::Context::new) makes on a machine with 4 cores or more) runs
//! [`IdlePolicy::default`](crate::IdlePolicy): it polls [`DEFAULT_SPINS`] empty iterations
//! (well under a millisecond in a release build: traffic with shorter gaps never waits for
//! a wake-up), then yields the CPU between polls while a QP has work in flight, and sleeps
//! once none has — on the kick words of [`super::wake`], so that a post or a peer's packet
//! wakes it at once — for at most [`DEFAULT_MAX_SLEEP`] at a time. An engine with nothing
//! to do thus costs a burst of polls per [`DEFAULT_MAX_SLEEP`], not a core.
//!
//! # Too many spinning threads
//!
//! A thread that spins gives its core back only when the scheduler takes it. When more
//! threads spin than there are cores, each waits for the others' time slices, and a
//! round trip that takes a microsecond takes milliseconds (76 ms per round trip of
//! `shmhca-perf --mode poll` with four spinning threads on two cores). So building a
//! poll-mode engine with [`IdlePolicy::Spin`](crate::IdlePolicy) counts the spinning engine
//! threads of this process; when they and one application thread (the one that polls
//! their completion queues) outnumber the cores this process may run on, one line is
//! printed on stderr, once per process, saying so and what to do. The build still
//! succeeds: the program works, only slowly, and a test or a one-off run may accept that.
//! Engines of other processes are not counted (this process cannot know them); a tool
//! that starts its peers knows them, as `shmhca-perf` does, and checks for itself.

use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Empty iterations a default poll-mode engine runs before it yields or sleeps.
pub(crate) const DEFAULT_SPINS: u32 = 10_000;

/// The longest sleep of a default poll-mode engine: how often an engine with nothing to do
/// wakes by itself (a post or a peer's packet wakes it at once).
pub(crate) const DEFAULT_MAX_SLEEP: Duration = Duration::from_millis(100);

/// Poll-mode engine threads of this process that spin when idle, alive or starting.
pub(crate) static SPINNING_ENGINES: Counter = Counter::new();

/// A count of live things (spinning engine threads), each held by a [`Counted`].
#[derive(Debug)]
pub(crate) struct Counter(AtomicUsize);

impl Counter {
    pub(crate) const fn new() -> Counter {
        Counter(AtomicUsize::new(0))
    }

    /// Counts one more; returns its token (which uncounts it when dropped) and how many
    /// there are now.
    pub(crate) fn count(&'static self) -> (Counted, usize) {
        let n = self.0.fetch_add(1, Ordering::Relaxed) + 1;
        (Counted(self), n)
    }
}

/// One counted thing of a [`Counter`], uncounted when dropped (the engine thread owns it
/// and drops it when it ends).
#[derive(Debug)]
pub(crate) struct Counted(&'static Counter);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The cores this process may run on (its affinity mask and CPU quota), 1 if unknown.
pub(crate) fn cores() -> usize {
    #[cfg(test)]
    if let Some(n) = tests::CORES.with(|c| c.get()) {
        return n;
    }
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// What to say when `engines` spinning poll-mode engine threads of this process and one
/// application thread would share `cores` cores; `None` when they fit.
pub(crate) fn oversubscription(engines: usize, cores: usize) -> Option<String> {
    let threads = engines.saturating_add(1);
    if engines == 0 || threads <= cores {
        return None;
    }
    let what = if engines == 1 {
        "a poll-mode engine thread that spins (IdlePolicy::Spin)".to_string()
    } else {
        format!("{engines} poll-mode engine threads that spin (IdlePolicy::Spin)")
    };
    Some(format!(
        "shmhca: warning: {what} and the application's thread outnumber this process's \
         {cores} core(s): each waits for the others' time slices (milliseconds per \
         message); use IdlePolicy::Backoff (the default), EngineMode::Inline, or fewer \
         poll-mode contexts"
    ))
}

/// Prints `message` on stderr unless a warning of this kind was printed already.
pub(crate) fn warn_once(message: &str) {
    #[cfg(test)]
    tests::WARNINGS.with(|w| w.borrow_mut().push(message.to_owned()));
    static WARNED: Once = Once::new();
    WARNED.call_once(|| eprintln!("{message}"));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Context, EngineMode, IdlePolicy};
    use shmhca_rings::segment::HugePages;
    use std::cell::{Cell, RefCell};

    thread_local! {
        /// The core count `cores()` returns on this thread (`None`: the machine's).
        pub(super) static CORES: Cell<Option<usize>> = const { Cell::new(None) };
        /// The warnings `warn_once` was asked to print on this thread.
        pub(super) static WARNINGS: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
    }

    /// Builds a context in `mode` with `idle` (`None`: the default) as if this process
    /// could run on `cores` cores; the warnings its build gave.
    fn warnings_of(mode: EngineMode, idle: Option<IdlePolicy>, cores: usize) -> Vec<String> {
        CORES.with(|c| c.set(Some(cores)));
        WARNINGS.with(|w| w.borrow_mut().clear());
        let mut b = Context::builder()
            .mode(mode)
            .arena_size(1 << 20)
            .huge_pages(HugePages::Never);
        if let Some(idle) = idle {
            b = b.idle(idle);
        }
        let ctx = b.build().unwrap();
        drop(ctx);
        CORES.with(|c| c.set(None));
        WARNINGS.with(|w| std::mem::take(&mut *w.borrow_mut()))
    }

    #[test]
    fn building_a_spinning_poll_engine_on_too_few_cores_warns() {
        let poll = EngineMode::Poll { cpu: None };
        let w = warnings_of(poll, Some(IdlePolicy::Spin), 1);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("IdlePolicy::Spin") && w[0].contains("1 core(s)"),
            "{w:?}"
        );
        // Room enough (fewer than 63 other spinning engines in this test binary), or
        // nothing that spins: no warning.
        assert_eq!(
            warnings_of(poll, Some(IdlePolicy::Spin), 64),
            [] as [String; 0]
        );
        assert_eq!(warnings_of(poll, None, 1), [] as [String; 0]);
        let backoff = IdlePolicy::default();
        assert_eq!(warnings_of(poll, Some(backoff), 1), [] as [String; 0]);
        let inline = EngineMode::Inline;
        assert_eq!(
            warnings_of(inline, Some(IdlePolicy::Spin), 1),
            [] as [String; 0]
        );
    }

    #[test]
    fn spinning_engines_that_fit_beside_the_application_thread_are_fine() {
        assert_eq!(oversubscription(0, 1), None, "nothing spins");
        assert_eq!(oversubscription(1, 2), None);
        assert_eq!(oversubscription(3, 4), None);
        assert_eq!(oversubscription(7, 64), None);
    }

    #[test]
    fn spinning_engines_that_outnumber_the_cores_are_named_with_what_to_do() {
        let one = oversubscription(1, 1).expect("an engine and the application on one core");
        assert!(one.contains("a poll-mode engine thread"), "{one}");
        let w = oversubscription(2, 2).expect("two engines and the application on 2 cores");
        assert!(w.contains("2 poll-mode engine threads"), "{w}");
        assert!(w.contains("2 core(s)"), "{w}");
        assert!(
            w.contains("IdlePolicy::Backoff") && w.contains("EngineMode::Inline"),
            "{w}"
        );
        assert!(!w.contains('\n'), "one line: {w}");
        assert!(oversubscription(4, 4).is_some());
        assert!(oversubscription(usize::MAX, 4).is_some(), "no overflow");
    }

    #[test]
    fn counted_things_are_uncounted_when_they_go() {
        static C: Counter = Counter::new();
        let (a, n) = C.count();
        let (b, m) = C.count();
        assert_eq!((n, m), (1, 2));
        drop(a);
        let (c, k) = C.count();
        assert_eq!(k, 2, "the first was uncounted");
        drop((b, c));
        assert_eq!(C.count().1, 1);
    }
}
