//! The line ring's stamp protocol (`shmhca_rings::lines`, the heap storage: each line's
//! first word a loom atomic, each line a loom cell) under loom, or, without
//! `--cfg shmhca_loom`, as a std-thread stress test.
//!
//! A producer thread sends frames of given sizes through a tiny ring, retrying while there
//! is no room; the consumer receives them and checks every user byte, so a frame read
//! before it is complete, or overwritten before it was copied, is caught twice: as a loom
//! causality violation on the line's cell, and as wrong bytes.
//!
//! Mutations (each test of `mod mutations` asserts that loom catches it; the names are the
//! mutation points in `shmhca_rings::lines`, see `shmhca_rings::sync::mutation`):
//!
//! * `Lines::store_stamp`: the producer stores a frame's first word (its stamp) Relaxed;
//! * `Lines::load_stamp`: the consumer loads the stamp Relaxed;
//! * `Lines::stamp_before_data`: the producer stores the stamp when it reserves the frame,
//!   before writing the lines;
//! * `Lines::store_head`: the consumer publishes head Relaxed;
//! * `Lines::load_head`: the producer reloads head Relaxed;
//! * `Lines::head_before_copy`: the consumer publishes head before copying the frame out;
//! * `Lines::look`: the straight receive step's look loads the stamp Relaxed (review 11);
//! * `Lines::no_head_when_empty`: the consumer never publishes head when it finds the ring
//!   empty: a producer that needs more than three quarters of the ring starves (the
//!   scenario's bounded wait reports it).

use shmhca_loom_tests::check;
use shmhca_rings::lines::{HeapLines, Line, LinesConsumer, LinesProducer, MAX_FRAME_LINES};

#[cfg(shmhca_loom)]
use loom::thread;
#[cfg(not(shmhca_loom))]
use std::thread;

/// How long a model waits for the other side before it calls the wait starvation: under
/// loom a yield lets the other thread run, so a correct model never comes close; without
/// loom (a loaded machine), no bound.
const PATIENCE: u64 = if cfg!(shmhca_loom) { 1_000 } else { u64::MAX };

/// The user bytes of line `i` of frame `seq`.
fn line_of(seq: usize, i: usize) -> Line {
    let mut line = Line::ZERO;
    line.0[5] = seq as u8;
    line.0[6] = i as u8;
    line.0[8] = 0xA0 | seq as u8;
    line.0[63] = 0x50 | i as u8;
    line
}

/// Sends `sizes` (frames of that many lines) through a heap line ring of `capacity` lines
/// and receives them on the calling thread, checking every frame.
fn frames(capacity: usize, sizes: &'static [usize]) {
    frames_with(capacity, sizes, false);
}

/// [`frames`], the consumer taking lone lines as the engine's straight receive step does
/// (`look`, `lone_behind`, `release_lone`) when `straight`.
fn frames_with(capacity: usize, sizes: &'static [usize], straight: bool) {
    let (mut p, mut c): (LinesProducer<HeapLines>, LinesConsumer<HeapLines>) =
        shmhca_rings::lines::heap_lines(capacity).unwrap();
    let producer = thread::spawn(move || {
        for (seq, &n) in sizes.iter().enumerate() {
            let mut waited = 0;
            loop {
                if let Some(mut frame) = p.reserve(n).unwrap() {
                    for i in 0..n {
                        frame.write_line(i, &line_of(seq, i)).unwrap();
                    }
                    frame.commit();
                    break;
                }
                waited += 1;
                assert!(
                    waited < PATIENCE,
                    "producer starved: no room for frame {seq}"
                );
                thread::yield_now();
            }
        }
    });
    let mut out = [Line::ZERO; MAX_FRAME_LINES];
    for (seq, &len) in sizes.iter().enumerate() {
        let mut waited = 0;
        let n = loop {
            // The engine's straight receive step (review 11): a lone line at head is
            // taken from the look's copy and released; anything else goes to `recv`.
            if straight
                && let Some(Some(first)) = c.look(&mut out[0])
                && c.lone_behind(first)
            {
                c.release_lone();
                break 1;
            }
            if let Some(n) = c.recv(&mut out).unwrap() {
                break n;
            }
            waited += 1;
            assert!(waited < PATIENCE, "consumer starved: no frame {seq}");
            thread::yield_now();
        };
        assert_eq!(n, len, "frame {seq}: line count");
        for (i, line) in out[..n].iter().enumerate() {
            let want = line_of(seq, i);
            assert_eq!(
                line.0[5..],
                want.0[5..],
                "frame {seq} line {i}: torn or stale"
            );
        }
    }
    producer.join().unwrap();
    assert_eq!(c.recv(&mut out).unwrap(), None, "nothing extra");
}

#[test]
fn one_line_frames_wrap_through_full_and_empty() {
    // Capacity 2, 4 frames: the producer meets a full ring, the stamps move to lap 2.
    check(|| frames(2, &[1, 1, 1, 1]));
}

#[test]
fn frames_of_several_lines_and_padding() {
    // Capacity 4: 3 lines, then 2 that do not fit before the end (a 1-line padding, then
    // lap 1 once the consumer gave lines 0 and 1 back), then 1.
    check(|| frames(4, &[3, 2, 1]));
}

#[test]
fn a_whole_ring_frame_needs_the_head_published_when_empty() {
    // Capacity 8 (head published every 2 lines or when empty): 7 lines, 1 line (read but
    // not yet published), then 8 lines, which need every line back.
    check(|| frames(8, &[7, 1, 8]));
}

/// Review 11: the straight receive step's look and release (one-line frames, through full
/// and empty, the lap's last line; then frames of several lines among them).
#[test]
fn lone_lines_taken_straight_wrap_through_full_and_empty() {
    check(|| frames_with(2, &[1, 1, 1, 1], true));
    check(|| frames_with(4, &[1, 3, 1, 2, 1], true));
}

/// Proof that the model can fail: each mutation point switched on must make it fail.
#[cfg(shmhca_loom)]
mod mutations {
    use super::*;
    use shmhca_loom_tests::assert_mutation_caught;

    fn caught(point: &'static str, want: &str, model: fn()) {
        assert_mutation_caught(point, want, model);
    }

    #[test]
    fn stamp_stored_relaxed_is_caught() {
        caught("Lines::store_stamp", "Causality violation", || {
            frames(2, &[1, 1])
        });
    }

    #[test]
    fn stamp_loaded_relaxed_is_caught() {
        caught("Lines::load_stamp", "Causality violation", || {
            frames(2, &[2])
        });
    }

    #[test]
    fn stamp_stored_before_the_data_is_caught() {
        caught("Lines::stamp_before_data", "Causality violation", || {
            frames(2, &[1])
        });
    }

    #[test]
    fn head_published_relaxed_is_caught() {
        // Needs a wrap: the producer must reuse a line the consumer released.
        caught("Lines::store_head", "Causality violation", || {
            frames(1, &[1, 1])
        });
    }

    #[test]
    fn head_loaded_relaxed_is_caught() {
        caught("Lines::load_head", "Causality violation", || {
            frames(1, &[1, 1])
        });
    }

    #[test]
    fn head_published_before_the_copy_is_caught() {
        caught("Lines::head_before_copy", "Causality violation", || {
            frames(1, &[1, 1])
        });
    }

    /// Review 11: the straight step's look loading the stamp Relaxed.
    #[test]
    fn stamp_looked_at_relaxed_is_caught() {
        caught("Lines::look", "Causality violation", || {
            frames_with(2, &[1], true)
        });
    }

    /// Review 11: `release_lone` publishing head Relaxed (the lone line's copy may then
    /// be overwritten before it is made).
    #[test]
    fn head_released_lone_relaxed_is_caught() {
        caught("Lines::store_head", "Causality violation", || {
            frames_with(1, &[1, 1], true)
        });
    }

    #[test]
    fn head_never_published_when_empty_is_caught() {
        caught("Lines::no_head_when_empty", "producer starved", || {
            frames(8, &[7, 1, 8])
        });
    }
}
