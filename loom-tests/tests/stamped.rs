//! The stamped ring (`shmhca_rings::ring::stamped_ring`, the engine's completion queues)
//! under loom, or, without `--cfg shmhca_loom`, as a std-thread stress test.
//!
//! A producer thread pushes values through a tiny ring, retrying while it is full; the
//! consumer (the calling thread) takes them, one at a time or in bursts, and checks each:
//! a value read before it was written, or after the producer rewrote its slot, is caught
//! as a loom causality violation on the slot's cell (and as a wrong value).
//!
//! Mutations (mutation points of `shmhca_rings::ring`, see `shmhca_rings::sync::mutation`;
//! each test of `mod mutations` asserts that loom catches it and that the point ran):
//!
//! * `StampedRing stamp store`: the producer stores a slot's stamp Relaxed;
//! * `StampedRing stamp load`: the consumer loads it Relaxed;
//! * `StampedRing head store`: the consumer publishes its index Relaxed;
//! * `StampedRing head load`: the producer reloads it Relaxed.

use shmhca_loom_tests::check;
use shmhca_rings::ring::stamped_ring;

#[cfg(shmhca_loom)]
use loom::thread;
#[cfg(not(shmhca_loom))]
use std::thread;

/// Pushes `count` values through a stamped ring of `capacity` slots; the consumer takes
/// up to `burst` per call and checks that they come in order, each once.
fn stamped(capacity: usize, count: u64, burst: usize) {
    let (mut p, mut c) = stamped_ring::<[u64; 2]>(capacity).unwrap();
    let producer = thread::spawn(move || {
        for i in 0..count {
            let mut v = [i, !i];
            while let Err(back) = p.push(v) {
                v = back;
                thread::yield_now();
            }
        }
    });
    let mut next = 0;
    while next < count {
        let n = c.pop_each(burst, |v| {
            assert_eq!(v, [next, !next], "value {next} arrives whole and in order");
            next += 1;
        });
        if n == 0 {
            thread::yield_now();
        }
    }
    assert!(c.looks_empty() && c.pop().is_none(), "nothing more");
    producer.join().unwrap();
}

#[test]
fn stamped_one_at_a_time_wraps_through_full_and_empty() {
    // Capacity 2, 4 values: the producer meets a full ring and reloads the consumer's
    // index, the stamps go round twice, the consumer meets an empty ring.
    check(|| stamped(2, 4, 1));
}

#[test]
fn stamped_bursts_with_capacity_one() {
    check(|| stamped(1, 3, 4));
}

/// Proof that the model can fail.
#[cfg(shmhca_loom)]
mod mutations {
    use super::*;
    use shmhca_loom_tests::assert_mutation_caught;

    fn caught(point: &'static str, model: fn()) {
        assert_mutation_caught(point, "Causality violation", model);
    }

    #[test]
    fn stamp_stored_relaxed_is_caught() {
        caught("StampedRing stamp store", || stamped(2, 2, 1));
    }

    #[test]
    fn stamp_loaded_relaxed_is_caught() {
        caught("StampedRing stamp load", || stamped(2, 2, 1));
    }

    #[test]
    fn head_stored_relaxed_is_caught() {
        caught("StampedRing head store", || stamped(1, 3, 1));
    }

    #[test]
    fn head_loaded_relaxed_is_caught() {
        caught("StampedRing head load", || stamped(1, 3, 1));
    }
}
