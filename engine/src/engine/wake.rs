//! Sleeping and waking an idle poll-mode engine thread.
//!
//! An engine whose idle policy lets it sleep publishes a *wake word* in its engine page (which
//! peers map read-only) and sleeps on it with a futex. The protocol is Dekker's: the
//! sleeper stores 1 to the word, then looks for work once more, then waits; a waker
//! publishes its work (a ring index), then loads the word and wakes the futex if it is 1.
//! A sequentially consistent fence sits between the store and the load on both sides, so
//! at least one of them sees the other: either the sleeper finds the work, or the waker
//! sees the word and wakes it. `FUTEX_WAKE` needs only read access to the word, so a peer
//! can wake this engine through its read-only mapping of the engine page.
//!
//! The word counts its sleepers (the poll-mode engine thread; in inline mode, application
//! threads blocked in a wait and the progress helper), and a wake-up wakes them all.
//!
//! Engines that never sleep (spin policy, or inline mode) publish `MAY_SLEEP = 0`, and their
//! peers skip the fence entirely: the cost is paid only by those who asked for sleeping.

use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::time::Duration;

use rustix::thread::futex;

/// After publishing work for an engine that may sleep: wakes it if it is asleep.
#[inline]
pub(crate) fn wake(word: &AtomicU32) {
    // SYNC: SeqCst fence pairs with the one in `sleep` (Dekker): the work published before
    // this fence, or the sleeper's store of 1, is seen by the other side.
    fence(Ordering::SeqCst);
    if word.load(Ordering::Relaxed) != 0 {
        // A failed wake (never expected for a valid address) only costs the sleeper its
        // timeout; there is nothing better to do with the error here.
        let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
    }
}

/// Sleeps on `word` for at most `max`, unless `has_work` (run after announcing the sleep)
/// finds work. Returns whether it slept.
pub(crate) fn sleep(word: &AtomicU32, max: Duration, has_work: impl FnOnce() -> bool) -> bool {
    // Sleepers are counted (not flagged), so that one leaving does not hide another.
    let sleepers = word.fetch_add(1, Ordering::Relaxed) + 1;
    // SYNC: SeqCst fence pairs with the one in `wake`.
    fence(Ordering::SeqCst);
    let slept = if has_work() {
        false
    } else {
        let ts = futex::Timespec {
            tv_sec: max.as_secs() as _,
            tv_nsec: max.subsec_nanos() as _,
        };
        // Woken, timed out, interrupted or the count changed: all mean "look for work
        // again".
        let _ = futex::wait(word, futex::Flags::empty(), sleepers, Some(&ts));
        true
    };
    word.fetch_sub(1, Ordering::Relaxed);
    slept
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;
    use std::time::Instant;

    #[test]
    fn a_sleeper_is_woken_long_before_its_timeout() {
        let word = Arc::new(AtomicU32::new(0));
        let work = Arc::new(AtomicBool::new(false));
        let (w2, k2) = (word.clone(), work.clone());
        let sleeper = std::thread::spawn(move || {
            let start = Instant::now();
            while !k2.load(Ordering::Acquire) {
                sleep(&w2, Duration::from_secs(20), || k2.load(Ordering::Acquire));
            }
            start.elapsed()
        });
        std::thread::sleep(Duration::from_millis(50));
        work.store(true, Ordering::Release);
        wake(&word);
        let took = sleeper.join().unwrap();
        assert!(
            took < Duration::from_secs(10),
            "the wake-up was lost: {took:?}"
        );
    }

    #[test]
    fn work_found_after_announcing_prevents_the_sleep() {
        let word = AtomicU32::new(0);
        assert!(!sleep(&word, Duration::from_secs(20), || true));
        assert_eq!(word.load(Ordering::Relaxed), 0);
        assert!(sleep(&word, Duration::from_millis(1), || false));
    }
}
