//! The engine's own hand-offs, on its real code (see `shmhca_loom_tests::engine`: which
//! code runs, and the few things `--cfg shmhca_loom` substitutes).
//!
//! Mutations (mutation points `shmhca_rings::sync::weaken`; each test of `mod mutations`
//! asserts that loom catches it and that the weakened line ran):
//!
//! * `completer sq_retired store`: `completer::publish_retired` stores `sq_retired` with
//!   Relaxed — the application rewrites a gather-table row the engine may still be reading
//!   (caught by `send_queue_credit`);
//! * `Qp::refresh_sq load`: `Qp::refresh_sq` loads `sq_retired` with Relaxed — same;
//! * `MrTable::release`: the in-flight store (`held`) is Relaxed — the application reads a
//!   receive region that the engine's copy into it is not ordered before (caught by
//!   `in_flight_release`).

use shmhca_loom_tests::check;
use shmhca_loom_tests::engine::{error_flush_races_post, in_flight_release, send_queue_credit};

#[test]
fn send_queue_credit_reuses_a_row_only_after_the_engine() {
    check(send_queue_credit);
}

#[test]
fn in_flight_counts_order_the_engine_copy_before_the_read() {
    check(in_flight_release);
}

#[test]
fn error_flush_racing_posts_completes_everything_once() {
    check(error_flush_races_post);
}

/// Proof that the models can fail.
#[cfg(shmhca_loom)]
mod mutations {
    use super::*;
    use shmhca_loom_tests::assert_mutation_caught;

    fn caught(point: &'static str, model: fn()) {
        assert_mutation_caught(point, "Causality violation", model);
    }

    #[test]
    fn sq_retired_stored_relaxed_is_caught() {
        caught("completer sq_retired store", send_queue_credit);
    }

    #[test]
    fn refresh_sq_loading_relaxed_is_caught() {
        caught("Qp::refresh_sq load", send_queue_credit);
    }

    #[test]
    fn mr_release_relaxed_is_caught() {
        caught("MrTable::release", in_flight_release);
    }
}
