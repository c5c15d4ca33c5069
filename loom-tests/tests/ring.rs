//! The ring under loom (or, without `--cfg shmhca_loom`, as a std-thread stress test), on
//! both storages: the heap (`HeapStorage`, the engine's SQ and RQ; its CQs are stamped rings, see
//! `tests/stamped.rs`) and shared memory
//! (`ShmStorage`, the engine's links: a real memfd segment, with loom atomics and slot
//! cells placed in it under loom; the index code is the real one).
//!
//! Mutations (each test of `mod mutations` asserts that loom catches it):
//!
//! * `ProducerPublishRelaxed`, `ProducerAcquireRelaxed`, `ConsumerAcquireRelaxed`,
//!   `ConsumerPublishRelaxed`: the generic ring code's four index orderings
//!   (`shmhca_rings::ring::Mutation`, per ring);
//! * `ShmStorage::store_tail`: the shared-memory storage stores the tail with Relaxed,
//!   whatever ordering the ring asks for (mutation point, see `shmhca_rings::sync::mutation`).

use shmhca_loom_tests::{bursts, check, chunks, correct_ring, shm_ring, single};

#[test]
fn single_push_pop_wraps_through_full_and_empty() {
    // Capacity 2, 4 values: the producer meets a full ring, indices wrap twice, the
    // consumer meets an empty one.
    check(|| single(correct_ring, 2, 4));
}

#[test]
fn single_capacity_one() {
    check(|| single(correct_ring, 1, 3));
}

#[test]
fn bursts_straddle_the_wrap() {
    // 3 then 3 into 4 slots, drained 2 at a time: the second burst wraps and is pushed
    // in parts when the ring is full.
    check(|| bursts(correct_ring, 4, &[3, 3], 2));
}

#[test]
fn bursts_larger_than_the_ring() {
    // A burst of 3 into 2 slots is pushed in parts.
    check(|| bursts(correct_ring, 2, &[3], 4));
}

#[test]
fn chunks_with_partial_commits() {
    check(|| chunks(correct_ring, 4, 6, 3));
}

#[test]
fn shm_single_push_pop_wraps_through_full_and_empty() {
    check(|| single(shm_ring, 2, 4));
}

#[test]
fn shm_bursts_straddle_the_wrap() {
    check(|| bursts(shm_ring, 4, &[3, 3], 2));
}

#[test]
fn shm_chunks_with_partial_commits() {
    check(|| chunks(shm_ring, 4, 6, 3));
}

/// Proof that the models can fail: rings whose orderings are deliberately weakened must
/// make loom report a causality violation (a slot read concurrent with its write).
#[cfg(shmhca_loom)]
mod mutations {
    use super::*;
    use shmhca_loom_tests::Pair;
    use shmhca_rings::ring::{Mutation, heap_ring_mutated};

    fn producer_publish_relaxed(capacity: usize) -> Pair {
        heap_ring_mutated(capacity, Mutation::ProducerPublishRelaxed).unwrap()
    }
    fn producer_acquire_relaxed(capacity: usize) -> Pair {
        heap_ring_mutated(capacity, Mutation::ProducerAcquireRelaxed).unwrap()
    }
    fn consumer_acquire_relaxed(capacity: usize) -> Pair {
        heap_ring_mutated(capacity, Mutation::ConsumerAcquireRelaxed).unwrap()
    }
    fn consumer_publish_relaxed(capacity: usize) -> Pair {
        heap_ring_mutated(capacity, Mutation::ConsumerPublishRelaxed).unwrap()
    }

    /// Runs `model` under loom and asserts that loom finds a causality violation.
    fn assert_loom_catches(what: &str, model: impl Fn() + Send + Sync + 'static) {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(model)));
        let payload = result.expect_err(&format!("loom did not catch the bug: {what}"));
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        assert!(
            message.contains("Causality violation"),
            "{what}: loom failed, but not with a causality violation: {message}"
        );
        eprintln!("{what}: loom reported: {message}");
    }

    #[test]
    fn producer_publishing_tail_relaxed_is_caught() {
        assert_loom_catches("producer publishes tail Relaxed", || {
            single(producer_publish_relaxed, 2, 2)
        });
    }

    #[test]
    fn consumer_loading_tail_relaxed_is_caught() {
        assert_loom_catches("consumer loads tail Relaxed", || {
            bursts(consumer_acquire_relaxed, 2, &[2], 2)
        });
    }

    #[test]
    fn consumer_publishing_head_relaxed_is_caught() {
        // Needs a wrap: the producer must reuse a slot the consumer released.
        assert_loom_catches("consumer publishes head Relaxed", || {
            single(consumer_publish_relaxed, 1, 2)
        });
    }

    #[test]
    fn shm_storage_storing_tail_relaxed_is_caught() {
        let (_, hits) = shmhca_rings::sync::mutation::run("ShmStorage::store_tail", || {
            assert_loom_catches("ShmStorage stores tail Relaxed", || single(shm_ring, 2, 2))
        });
        assert!(hits > 0, "the mutated store never ran");
    }

    #[test]
    fn producer_loading_head_relaxed_is_caught() {
        assert_loom_catches("producer loads head Relaxed", || {
            single(producer_acquire_relaxed, 1, 2)
        });
    }
}
