//! The engine token (`shmhca::engine::cell`): its slow path (compare-and-swap), the owner's
//! fast path, the bias hand-over and its revocation, on the real code.
//!
//! loom cannot model `membarrier(2)`: under `--cfg shmhca_loom` the owner's compiler fence
//! and the revoker's `membarrier` are both a SeqCst fence, which gives the store–load
//! ordering the asymmetric pair gives for real (the owner's `busy = true` is seen by the
//! revoker, or the revoker's `bias = 0` by the owner). The modelled token (`LoomToken`)
//! makes a thread its owner after one uncontended slow-path entry, so that a model reaches
//! the fast path within a few steps (the engine's own token never biases under loom: the
//! models of `tests/engine.rs` check the engine's hand-offs over the slow path). The token guards a counter in a loom cell: two holders
//! overlapping is a causality violation, and the final count says that every entry that
//! reported success ran exactly once.
//!
//! Mutations (each test of `mod mutations` asserts that loom catches it and that the
//! weakened line ran):
//!
//! * `EngineCell owner fence`: the owner leaves out its fence (a store–load pair without
//!   any barrier: the owner enters while a revoker sees it outside);
//! * `EngineCell busy release`: the owner's exit store of `busy` is Relaxed — its writes
//!   are not ordered before the next slow-path holder's;
//! * `EngineCell busy acquire`: the slow path reads `busy` with Relaxed — same, from the
//!   other side.
//!
//! Only under `--cfg shmhca_loom` (the token's unit tests in `engine/src/engine/cell.rs`
//! cover it on std threads).
#![cfg(shmhca_loom)]

use loom::{sync::Arc, thread};
use shmhca::testing::LoomToken;
use shmhca_loom_tests::check;

/// A thread takes the token twice (the first entry makes it the owner, the second is the
/// fast path) while another takes it once with `try_with` (revoking the bias if it is set)
/// and then waits for it with `with`.
fn owner_and_revoker() {
    {
        let token = Arc::new(LoomToken::default());
        let t = token.clone();
        let owner = thread::spawn(move || {
            let mut added = 0;
            for _ in 0..2 {
                if t.try_add(1) {
                    added += 1;
                }
            }
            added
        });
        let t = token.clone();
        let other = thread::spawn(move || {
            let tried = if t.try_add(10) { 10 } else { 0 };
            t.add(100);
            tried + 100
        });
        let total = owner.join().unwrap() + other.join().unwrap();
        assert_eq!(token.get(), total, "an entry ran twice or not at all");
    }
}

/// The owner, biased, enters on the fast path while a control operation (`with`) takes
/// the token: the revocation and the hand-back.
fn biased_owner_and_control() {
    {
        let token = Arc::new(LoomToken::default());
        // Bias the token to the main thread before the other starts.
        assert!(token.try_add(1));
        assert!(
            token.is_owner(),
            "one uncontended entry makes an owner under loom"
        );
        let t = token.clone();
        let control = thread::spawn(move || t.add(100));
        let mut added = 1;
        for _ in 0..2 {
            if token.try_add(1) {
                added += 1;
            }
        }
        control.join().unwrap();
        assert_eq!(token.get(), added + 100);
    }
}

/// The bias moves from one thread to another while the first is still on its way through
/// its fast path: the main thread is the owner and starts an entry; the other revokes it,
/// takes the token twice on the slow path (which makes it the owner: the revocation doubled
/// the streak needed) and enters on its own fast path. The first thread's stale entry must
/// neither overlap the new owner's nor clear its "inside" flag (after which anyone's slow
/// path would take the token from under it).
fn ownership_moves() {
    {
        let token = Arc::new(LoomToken::default());
        assert!(token.try_add(1));
        assert!(token.is_owner());
        let t = token.clone();
        let other = thread::spawn(move || {
            for _ in 0..3 {
                t.add(100);
            }
        });
        let mut added = 1;
        for _ in 0..2 {
            if token.try_add(1) {
                added += 1;
            }
        }
        other.join().unwrap();
        assert_eq!(token.get(), added + 300, "an entry ran twice or not at all");
    }
}

#[test]
fn a_bias_that_moves_to_another_thread_never_overlaps() {
    check(ownership_moves);
}

#[test]
fn owner_and_revoker_never_overlap() {
    check(owner_and_revoker);
}

#[test]
fn a_biased_owner_and_a_control_operation_never_overlap() {
    check(biased_owner_and_control);
}

/// Proof that the models can fail.
mod mutations {
    use super::*;
    use shmhca_loom_tests::assert_mutation_caught;

    fn caught(point: &'static str, model: fn()) {
        assert_mutation_caught(point, "Causality violation", model);
    }

    #[test]
    fn an_owner_without_its_fence_is_caught() {
        caught("EngineCell owner fence", biased_owner_and_control);
    }

    #[test]
    fn a_relaxed_owner_exit_is_caught() {
        caught("EngineCell busy release", biased_owner_and_control);
    }

    #[test]
    fn a_relaxed_busy_check_is_caught() {
        caught("EngineCell busy acquire", biased_owner_and_control);
    }
}
