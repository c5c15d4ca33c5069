//! The doorbell, the engine's real code (under loom with `--cfg shmhca_loom`, else as
//! std-thread stress tests). The send queue's credit path is modelled on the engine's own
//! code in `tests/engine.rs`.

use shmhca_loom_tests::{check, correct_doorbell, doorbell, doorbell_watch};

#[test]
fn doorbell_rings_in_one_word_and_across_words() {
    // Two posters: one rings queues 0 and 1 (the same word), the other queue 64 (the
    // next word), while the taker takes.
    check(|| doorbell(correct_doorbell, &[&[0, 1], &[64]]));
}

#[test]
fn doorbell_rings_from_two_posters_in_one_word() {
    check(|| doorbell(correct_doorbell, &[&[3], &[5]]));
}

#[test]
fn a_post_to_a_queue_being_unwatched_is_never_lost() {
    check(|| doorbell_watch(correct_doorbell));
}

/// Proof that these models can fail too.
#[cfg(shmhca_loom)]
mod mutations {
    use super::*;
    use shmhca_rings::doorbell::{Doorbell, Mutation};

    /// Runs `model` under loom and asserts that it fails with a message containing `want`.
    fn assert_loom_catches(what: &str, want: &str, model: impl Fn() + Send + Sync + 'static) {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(model)));
        let payload = result.expect_err(&format!("loom did not catch the bug: {what}"));
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        assert!(
            message.contains(want),
            "{what}: loom failed, but not with \"{want}\": {message}"
        );
        eprintln!("{what}: loom reported: {message}");
    }

    fn ring_relaxed() -> Doorbell {
        Doorbell::mutated(128, Mutation::RingRelaxed)
    }
    fn take_relaxed() -> Doorbell {
        Doorbell::mutated(128, Mutation::TakeRelaxed)
    }
    fn no_summary() -> Doorbell {
        Doorbell::mutated(128, Mutation::NoSummary)
    }
    fn watch_no_fence() -> Doorbell {
        Doorbell::mutated(128, Mutation::WatchNoFence)
    }

    #[test]
    fn a_poster_without_its_watch_fence_is_caught() {
        assert_loom_catches("ring_unless_watched without its fence", "was lost", || {
            doorbell_watch(watch_no_fence)
        });
    }

    // Two posters in one word: the second to ring finds the word non-empty and leaves
    // the summary alone, so only the word's own Release/Acquire carries its work (the
    // first one's also travels with the summary).
    #[test]
    fn ringing_relaxed_is_caught() {
        assert_loom_catches("ring with Relaxed", "its work is not visible", || {
            doorbell(ring_relaxed, &[&[0], &[1]])
        });
    }

    #[test]
    fn taking_relaxed_is_caught() {
        assert_loom_catches("take with Relaxed", "its work is not visible", || {
            doorbell(take_relaxed, &[&[0], &[1]])
        });
    }

    #[test]
    fn a_ring_that_does_not_name_its_word_is_caught() {
        assert_loom_catches("no summary bit", "a ring was lost", || {
            doorbell(no_summary, &[&[0], &[64]])
        });
    }
}
