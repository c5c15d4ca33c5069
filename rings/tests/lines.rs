//! The line ring over both storages: frames of 1 to 16 lines, padding at a lap's end,
//! full and empty, the lazy head, stamp wrap-around, two threads, attach errors, and a
//! hostile peer's garbage stamps, counts and head values.

use std::collections::VecDeque;
use std::sync::Arc;

use proptest::prelude::*;
use shmhca_rings::lines::{
    self, HeapLines, LINE_BYTES, Line, LineOutOfFrame, LineStorage, LinesConsumer, LinesProducer,
    MAX_FRAME_LINES, PADDING, ReserveError, ShmLines,
};
use shmhca_rings::ring::{self, LinkBroken, RingOpenError, Violation};
use shmhca_rings::segment::{Access, HugePages, Segment};

const KIND: u32 = 0x4c4e;
/// The shared rings below sit at this offset; head at +128, line 0 at +256.
const OFF: usize = 1024;
const HEAD: usize = OFF + 128;
const LINE0: usize = OFF + 256;

fn segment(len: usize) -> Arc<Segment> {
    Arc::new(
        Segment::builder(KIND, len)
            .huge_pages(HugePages::Never)
            .create()
            .unwrap(),
    )
}

type ShmPair = (LinesProducer<ShmLines>, LinesConsumer<ShmLines>);

fn shm_pair(capacity: usize) -> (Arc<Segment>, ShmPair) {
    let seg = segment(OFF + lines::shm_lines_bytes(capacity).unwrap());
    lines::init_shm_lines(&seg, OFF, capacity).unwrap();
    let p = lines::shm_lines_producer(Arc::clone(&seg), OFF).unwrap();
    let c = lines::shm_lines_consumer(Arc::clone(&seg), OFF).unwrap();
    (seg, (p, c))
}

/// The content of line `i` of frame `seq` (user bytes 5..64; 0..5 are the ring's).
fn line_of(seq: u64, i: usize) -> Line {
    let mut line = Line::ZERO;
    for (b, byte) in line.0.iter_mut().enumerate().skip(lines::USER_START) {
        *byte = (seq.wrapping_mul(31).wrapping_add((i * 64 + b) as u64) % 251) as u8;
    }
    line
}

/// Sends frame `seq` of `n` lines; false if there is no room.
fn send<S: LineStorage>(p: &mut LinesProducer<S>, seq: u64, n: usize) -> bool {
    let Some(mut frame) = p.reserve(n).unwrap() else {
        return false;
    };
    for i in 0..n {
        frame.write_line(i, &line_of(seq, i)).unwrap();
    }
    frame.commit();
    true
}

/// Receives until the ring is empty (at most a ring's worth); returns how many frames.
fn drain<S: LineStorage>(c: &mut LinesConsumer<S>) -> usize {
    let mut n = 0;
    while recv(c).is_some() {
        n += 1;
        assert!(n <= c.capacity(), "more frames than the ring holds");
    }
    n
}

/// Checks that `out[..n]` is frame `seq` of `n` lines, stamps and count included.
fn check_frame(out: &[Line], seq: u64, n: usize) {
    assert!((1..=MAX_FRAME_LINES).contains(&n), "frame {seq}: {n} lines");
    assert_eq!(out[0].count() as usize, n, "frame {seq}: count byte");
    for (i, line) in out[..n].iter().enumerate() {
        assert_eq!(
            &line.0[lines::USER_START..],
            &line_of(seq, i).0[lines::USER_START..],
            "frame {seq} line {i}: user bytes"
        );
        if i > 0 {
            assert_eq!(line.count(), 0);
            assert_eq!(line.stamp(), out[0].stamp());
        }
    }
}

fn recv<S: LineStorage>(c: &mut LinesConsumer<S>) -> Option<(Box<[Line; MAX_FRAME_LINES]>, usize)> {
    let mut out = Box::new([Line::ZERO; MAX_FRAME_LINES]);
    c.recv(&mut out).unwrap().map(|n| (out, n))
}

// ---------------------------------------------------------------------------------------
// Behaviour
// ---------------------------------------------------------------------------------------

#[test]
fn capacity_and_frame_size_errors_say_which() {
    assert!(lines::heap_lines(0).is_err());
    assert!(lines::heap_lines(12).is_err());
    let (mut p, _c) = lines::heap_lines(8).unwrap();
    assert_eq!(p.max_frame_lines(), 8);
    for bad in [0, 9, 17] {
        let err = p.reserve(bad).unwrap_err();
        assert_eq!(err, ReserveError::FrameSize { lines: bad, max: 8 });
        assert!(err.to_string().contains("1..=8"), "{err}");
    }
    let (mut p, _c) = lines::heap_lines(64).unwrap();
    assert_eq!(p.max_frame_lines(), MAX_FRAME_LINES);
    assert!(matches!(
        p.reserve(17),
        Err(ReserveError::FrameSize { lines: 17, max: 16 })
    ));
    let mut frame = p.reserve(2).unwrap().unwrap();
    assert_eq!(
        frame.write_line(2, &Line::ZERO),
        Err(LineOutOfFrame { line: 2, lines: 2 })
    );
    assert!(frame.write_lines(&[Line::ZERO; 3]).is_err());
}

fn one_line_frames_full_and_empty<S: LineStorage>(
    mut p: LinesProducer<S>,
    mut c: LinesConsumer<S>,
) {
    let cap = p.capacity() as u64;
    let mut next_send = 0;
    let mut next_recv = 0;
    for _round in 0..5 {
        while send(&mut p, next_send, 1) {
            next_send += 1;
            assert!(
                next_send - next_recv <= cap,
                "more frames sent than the ring holds"
            );
        }
        assert_eq!(
            next_send - next_recv,
            cap,
            "a ring of 1-line frames fills every line"
        );
        while let Some((out, n)) = recv(&mut c) {
            assert!(next_recv < next_send, "more frames received than sent");
            check_frame(&out[..], next_recv, n);
            next_recv += 1;
        }
        assert_eq!(next_recv, next_send);
    }
}

#[test]
fn heap_one_line_frames_full_and_empty() {
    let (p, c) = lines::heap_lines(8).unwrap();
    one_line_frames_full_and_empty(p, c);
}

#[test]
fn shm_one_line_frames_full_and_empty() {
    let (_seg, (p, c)) = shm_pair(8);
    one_line_frames_full_and_empty(p, c);
}

fn frames_pad_the_end_of_a_lap<S: LineStorage>(mut p: LinesProducer<S>, mut c: LinesConsumer<S>) {
    // Capacity 16, 5-line frames: three fill 15 lines, the fourth needs a 1-line padding
    // and starts the next lap.
    for seq in 0..3 {
        assert!(send(&mut p, seq, 5));
    }
    assert_eq!(p.tail(), 15);
    // No room for padding + frame until the consumer gives lines back.
    assert!(!send(&mut p, 3, 5));
    for seq in 0..3 {
        let (out, n) = recv(&mut c).unwrap();
        assert_eq!(n, 5);
        check_frame(&out[..], seq, n);
    }
    assert!(recv(&mut c).is_none(), "empty; head published");
    assert!(send(&mut p, 3, 5));
    assert_eq!(
        p.tail(),
        16 + 5,
        "padding filled line 15, the frame starts lap 1"
    );
    let (out, n) = recv(&mut c).unwrap();
    check_frame(&out[..], 3, n);
    assert_eq!(out[0].stamp(), 2, "lap 1");
    assert_eq!(c.head(), 21);
}

#[test]
fn heap_frames_pad_the_end_of_a_lap() {
    let (p, c) = lines::heap_lines(16).unwrap();
    frames_pad_the_end_of_a_lap(p, c);
}

#[test]
fn shm_frames_pad_the_end_of_a_lap() {
    let (_seg, (p, c)) = shm_pair(16);
    frames_pad_the_end_of_a_lap(p, c);
}

#[test]
fn padding_published_even_when_the_frame_must_wait() {
    let (mut p, mut c) = lines::heap_lines(16).unwrap();
    assert!(send(&mut p, 0, 14));
    let (_, n) = recv(&mut c).unwrap();
    assert_eq!(n, 14);
    assert!(recv(&mut c).is_none()); // publishes head 14
    // An 16-line frame at line 14: padding (2 lines) fits now, the frame needs line 16+16.
    assert!(!send(&mut p, 1, 16));
    assert_eq!(p.tail(), 16, "padding written");
    assert!(recv(&mut c).is_none(), "the consumer skips the padding");
    assert_eq!(c.head(), 16);
    assert!(
        send(&mut p, 1, 16),
        "a whole-ring frame fits once head is published"
    );
    let (out, n) = recv(&mut c).unwrap();
    check_frame(&out[..], 1, n);
}

#[test]
fn head_is_published_every_quarter_and_when_empty() {
    let (mut p, mut c) = lines::heap_lines(16).unwrap();
    for seq in 0..16 {
        assert!(send(&mut p, seq, 1));
    }
    for _ in 0..3 {
        recv(&mut c).unwrap();
    }
    assert_eq!(
        p.free_lines().unwrap(),
        0,
        "3 lines read: less than a quarter, not yet published"
    );
    recv(&mut c).unwrap();
    assert_eq!(p.free_lines().unwrap(), 4, "a quarter read: published");
    recv(&mut c).unwrap();
    assert_eq!(p.free_lines().unwrap(), 4);
    c.flush();
    assert_eq!(p.free_lines().unwrap(), 5, "flush publishes");
    drain(&mut c);
    assert_eq!(
        p.free_lines().unwrap(),
        16,
        "finding the ring empty publishes"
    );
}

#[test]
fn a_dropped_frame_publishes_nothing_and_leaves_no_trace() {
    let (mut p, mut c) = lines::heap_lines(8).unwrap();
    {
        let mut frame = p.reserve(3).unwrap().unwrap();
        for i in 0..3 {
            frame.write_line(i, &line_of(99, i)).unwrap();
        }
        // Not committed: dropped here.
    }
    assert!(recv(&mut c).is_none());
    // A shorter frame at the same place: the lines the dropped frame wrote are not taken
    // for frames.
    assert!(send(&mut p, 0, 1));
    assert!(send(&mut p, 1, 1));
    for seq in 0..2 {
        let (out, n) = recv(&mut c).unwrap();
        check_frame(&out[..], seq, n);
    }
    assert!(recv(&mut c).is_none());
}

#[test]
fn user_bytes_5_to_8_travel_in_every_line() {
    let (mut p, mut c) = lines::heap_lines(16).unwrap();
    let mut frame = p.reserve(3).unwrap().unwrap();
    for i in 0..3 {
        let mut line = Line::ZERO;
        line.0[..5].copy_from_slice(&[0xEE; 5]); // the ring's: ignored
        line.0[5..8].copy_from_slice(&[i as u8 + 1, 0xAB, 0xCD]);
        line.0[63] = 0x77;
        frame.write_line(i, &line).unwrap();
    }
    frame.commit();
    let (out, n) = recv(&mut c).unwrap();
    assert_eq!(n, 3);
    for (i, line) in out[..3].iter().enumerate() {
        assert_eq!(line.stamp(), 1);
        assert_eq!(line.count(), if i == 0 { 3 } else { 0 });
        assert_eq!(&line.0[5..8], &[i as u8 + 1, 0xAB, 0xCD]);
        assert_eq!(line.0[63], 0x77);
    }
}

/// A shared ring whose indices start at `start` (as a producer and consumer that detached
/// there would leave it): every line carries the stamp of the lap before the one in which
/// it will next be written.
fn shm_pair_at(capacity: usize, start: u64) -> (Arc<Segment>, ShmPair) {
    let seg = segment(OFF + lines::shm_lines_bytes(capacity).unwrap());
    lines::init_shm_lines(&seg, OFF, capacity).unwrap();
    let shift = capacity.trailing_zeros();
    for pos in 0..capacity as u64 {
        let cap = capacity as u64;
        let next = start.wrapping_add((pos.wrapping_sub(start)) & (cap - 1));
        // stamp(next) - 1, the stamp of the lap before.
        let stale = (next >> shift) as u32;
        seg.write_at(LINE0 + pos as usize * LINE_BYTES, &stale.to_le_bytes())
            .unwrap();
    }
    seg.write_at(HEAD, &start.to_ne_bytes()).unwrap();
    seg.write_at(OFF + 72, &start.to_ne_bytes()).unwrap();
    let p = lines::shm_lines_producer(Arc::clone(&seg), OFF).unwrap();
    let c = lines::shm_lines_consumer(Arc::clone(&seg), OFF).unwrap();
    (seg, (p, c))
}

#[test]
fn stamps_and_indices_wrap() {
    // Through the u32 stamp wrap (lap 2^32 - 1 has stamp 0) and the u64 index wrap.
    for start in [
        ((1u64 << 32) - 2) * 16 + 3,
        u64::MAX - 40,
        u64::MAX - 15, // a lap start
    ] {
        let (_seg, (mut p, mut c)) = shm_pair_at(16, start);
        let mut seq = 0;
        let mut got = 0;
        for round in 0..40u64 {
            let n = (round as usize * 7) % 16 + 1;
            let mut tries = 0;
            while !send(&mut p, seq, n) {
                // Full: take a frame out, or skip a padding frame.
                if let Some((out, m)) = recv(&mut c) {
                    check_frame(&out[..], got, m);
                    got += 1;
                }
                tries += 1;
                assert!(tries <= 32, "no room after the consumer drained the ring");
            }
            seq += 1;
        }
        while let Some((out, m)) = recv(&mut c) {
            check_frame(&out[..], got, m);
            got += 1;
        }
        assert_eq!(got, seq, "start {start}");
    }
}

#[test]
fn reattach_continues_where_the_ends_left() {
    let (seg, (mut p, mut c)) = shm_pair(8);
    for seq in 0..3 {
        assert!(send(&mut p, seq, 2));
    }
    recv(&mut c).unwrap();
    drop(p);
    drop(c);
    let mut p = lines::shm_lines_producer(Arc::clone(&seg), OFF).unwrap();
    let mut c = lines::shm_lines_consumer(Arc::clone(&seg), OFF).unwrap();
    assert_eq!((p.tail(), c.head()), (6, 2));
    assert!(send(&mut p, 3, 2));
    for seq in 1..4 {
        let (out, n) = recv(&mut c).unwrap();
        check_frame(&out[..], seq, n);
    }
    assert!(recv(&mut c).is_none());
}

#[test]
fn heap_two_threads_everything_once_in_order() {
    two_threads(lines::heap_lines(64).unwrap(), 200_000);
}

#[test]
fn shm_two_threads_everything_once_in_order() {
    let (_seg, pair) = shm_pair(32);
    two_threads(pair, 200_000);
}

fn frame_len(seq: u64, max: usize) -> usize {
    // Mostly 1-line frames, now and then long ones up to the maximum.
    let x = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58;
    if x < 40 { 1 } else { (x as usize % max) + 1 }
}

fn two_threads<S: LineStorage + Send + 'static>(
    (mut p, mut c): (LinesProducer<S>, LinesConsumer<S>),
    frames: u64,
) {
    let max = p.max_frame_lines();
    let producer = std::thread::spawn(move || {
        for seq in 0..frames {
            while !send(&mut p, seq, frame_len(seq, max)) {
                std::hint::spin_loop();
            }
        }
        p
    });
    let mut out = [Line::ZERO; MAX_FRAME_LINES];
    let mut seq = 0;
    while seq < frames {
        match c.recv(&mut out).unwrap() {
            Some(n) => {
                assert_eq!(n, frame_len(seq, max));
                check_frame(&out, seq, n);
                seq += 1;
            }
            None => std::thread::yield_now(),
        }
    }
    producer.join().unwrap();
    assert_eq!(c.recv(&mut out).unwrap(), None);
}

// ---------------------------------------------------------------------------------------
// Model-based: any sequence of sends, abandoned reservations and receives
// ---------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Send(usize),
    Abandon(usize),
    Recv,
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1..=MAX_FRAME_LINES).prop_map(Op::Send),
        1 => (1..=MAX_FRAME_LINES).prop_map(Op::Abandon),
        4 => Just(Op::Recv),
        1 => Just(Op::Flush),
    ]
}

proptest! {
    #[test]
    fn any_sequence_matches_a_queue(
        shift in 0u32..7,
        ops in proptest::collection::vec(op(), 1..300),
    ) {
        let capacity = 1usize << shift;
        let (mut p, mut c) = lines::heap_lines(capacity).unwrap();
        let max = p.max_frame_lines();
        let mut model: VecDeque<(u64, usize)> = VecDeque::new();
        let mut seq = 0u64;
        for op in ops {
            match op {
                Op::Send(n) | Op::Abandon(n) if n > max => {
                    prop_assert!(p.reserve(n).is_err());
                }
                Op::Send(n) => {
                    if send(&mut p, seq, n) {
                        model.push_back((seq, n));
                        seq += 1;
                    } else if model.is_empty() {
                        // No room, yet nothing to read: the consumer has not published its
                        // head yet, or a padding frame stands in the way. Finding the ring
                        // empty publishes head (and skips a padding); then there is room,
                        // at the latest after a second turn (the padding written by the
                        // first retry).
                        let mut sent = false;
                        for _ in 0..2 {
                            prop_assert!(recv(&mut c).is_none());
                            if send(&mut p, seq, n) {
                                sent = true;
                                break;
                            }
                        }
                        prop_assert!(sent, "no room in an empty ring");
                        model.push_back((seq, n));
                        seq += 1;
                    }
                }
                Op::Abandon(n) => {
                    if let Some(mut frame) = p.reserve(n).unwrap() {
                        frame.write_line(0, &line_of(12345, 0)).unwrap();
                    }
                }
                Op::Recv => match recv(&mut c) {
                    Some((out, n)) => {
                        let (s, len) = model.pop_front().expect("a frame the model lacks");
                        prop_assert_eq!(n, len);
                        check_frame(&out[..], s, n);
                    }
                    None => prop_assert!(model.is_empty(), "a frame was lost"),
                },
                Op::Flush => c.flush(),
            }
            let in_flight = p.tail().wrapping_sub(c.head());
            prop_assert!(in_flight <= capacity as u64);
        }
        // Drain, then the producer must find the whole ring free (liveness of the lazy head).
        while let Some((out, n)) = recv(&mut c) {
            let (s, len) = model.pop_front().unwrap();
            prop_assert_eq!(n, len);
            check_frame(&out[..], s, n);
        }
        prop_assert!(model.is_empty());
        prop_assert_eq!(p.free_lines().unwrap(), capacity);
        if !send(&mut p, seq, max) {
            // Only the padding this send wrote may stand in the way: the consumer skips it.
            prop_assert!(recv(&mut c).is_none());
            prop_assert!(send(&mut p, seq, max));
        }
    }

    #[test]
    fn any_frame_sizes_across_two_threads(
        sizes in proptest::collection::vec(1..=MAX_FRAME_LINES, 1..200),
        shift in 4u32..7,
    ) {
        let (mut p, mut c) = lines::heap_lines(1 << shift).unwrap();
        let sizes = Arc::new(sizes);
        let s = Arc::clone(&sizes);
        let producer = std::thread::spawn(move || {
            for (seq, &n) in s.iter().enumerate() {
                while !send(&mut p, seq as u64, n) {
                    std::thread::yield_now();
                }
            }
        });
        let mut out = [Line::ZERO; MAX_FRAME_LINES];
        for (seq, &len) in sizes.iter().enumerate() {
            let n = loop {
                match c.recv(&mut out).unwrap() {
                    Some(n) => break n,
                    None => std::thread::yield_now(),
                }
            };
            prop_assert_eq!(n, len);
            check_frame(&out, seq as u64, n);
        }
        producer.join().unwrap();
    }
}

// ---------------------------------------------------------------------------------------
// A hostile peer
// ---------------------------------------------------------------------------------------

fn write_word(seg: &Segment, pos: usize, stamp: u32, count: u8) {
    let mut w = [0u8; 5];
    w[..4].copy_from_slice(&stamp.to_le_bytes());
    w[4] = count;
    seg.write_at(LINE0 + pos * LINE_BYTES, &w).unwrap();
}

fn assert_broken_forever(c: &mut LinesConsumer<ShmLines>, want: Violation) -> LinkBroken {
    let mut out = [Line::ZERO; MAX_FRAME_LINES];
    let err = c.recv(&mut out).unwrap_err();
    assert_eq!(err.violation(), want);
    let text = err.to_string();
    assert!(text.contains("tear the link down"), "{text}");
    for _ in 0..3 {
        assert_eq!(c.recv(&mut out).unwrap_err(), err, "stays broken");
        assert_eq!(c.has_frame().unwrap_err(), err);
    }
    err
}

#[test]
fn consumer_reports_a_stamp_from_another_lap() {
    for bad in [2u32, 3, 0xFFFF_FFFF, 0x8000_0000] {
        let (seg, (_p, mut c)) = shm_pair(8);
        write_word(&seg, 0, bad, 1);
        let err = assert_broken_forever(
            &mut c,
            Violation::StampOutOfRange {
                index: 0,
                found: bad,
                expected: 1,
            },
        );
        assert!(err.to_string().contains("stamp"), "{err}");
    }
}

/// Once broken, a consumer stays broken whatever the peer writes next: a well-formed frame
/// at head, or head's line made stale again (an empty ring), are still the broken ring.
#[test]
fn a_broken_consumer_stays_broken_when_the_peer_writes_a_good_frame_or_nothing() {
    let (seg, (_p, mut c)) = shm_pair(8);
    write_word(&seg, 0, 1, 0); // a frame of 0 lines
    let mut out = [Line::ZERO; MAX_FRAME_LINES];
    let err = c.recv(&mut out).unwrap_err();
    for (stamp, count) in [(1, 1), (0, 0), (1, 1)] {
        write_word(&seg, 0, stamp, count);
        assert_eq!(c.recv(&mut out).unwrap_err(), err, "stamp {stamp}");
        assert_eq!(c.has_frame().unwrap_err(), err, "stamp {stamp}");
    }
}

#[test]
fn consumer_reports_bad_line_counts() {
    for bad in [0u8, 17, 0x80, 0xFE] {
        let (seg, (_p, mut c)) = shm_pair(32);
        write_word(&seg, 0, 1, bad);
        assert_broken_forever(
            &mut c,
            Violation::BadLineCount {
                index: 0,
                count: bad,
            },
        );
    }
}

#[test]
fn consumer_reports_a_frame_past_the_end_and_padding_at_a_lap_start() {
    let (seg, (mut p, mut c)) = shm_pair(8);
    for seq in 0..6 {
        assert!(send(&mut p, seq, 1));
    }
    for _ in 0..6 {
        recv(&mut c).unwrap();
    }
    write_word(&seg, 6, 1, 3);
    let err = assert_broken_forever(
        &mut c,
        Violation::FrameOverrunsRing {
            index: 6,
            lines: 3,
            capacity: 8,
        },
    );
    assert!(err.to_string().contains("never wrap"), "{err}");

    let (seg, (_p, mut c)) = shm_pair(8);
    write_word(&seg, 0, 1, PADDING);
    let err = assert_broken_forever(
        &mut c,
        Violation::FrameOverrunsRing {
            index: 0,
            lines: 0,
            capacity: 8,
        },
    );
    assert!(err.to_string().contains("padding"), "{err}");
}

#[test]
fn consumer_reports_a_bad_continuation_line() {
    for (stamp, count) in [(0u32, 0u8), (2, 0), (1, 1), (1, PADDING)] {
        let (seg, (mut p, mut c)) = shm_pair(8);
        assert!(send(&mut p, 0, 3));
        write_word(&seg, 2, stamp, count);
        assert_broken_forever(
            &mut c,
            Violation::BadContinuationLine {
                index: 2,
                found: stamp,
                count,
                expected: 1,
            },
        );
    }
}

#[test]
fn producer_reports_an_impossible_head() {
    for bad in [9u64, 100, u64::MAX, 1 << 63] {
        let (seg, (mut p, _c)) = shm_pair(8);
        for seq in 0..8 {
            assert!(send(&mut p, seq, 1));
        }
        seg.write_at(HEAD, &bad.to_ne_bytes()).unwrap();
        let err = p.reserve(1).unwrap_err();
        let ReserveError::Broken(broken) = err else {
            panic!("{err}")
        };
        assert_eq!(
            broken.violation(),
            Violation::HeadOutOfRange {
                head: bad,
                previous: 0,
                tail: 8
            }
        );
        assert_eq!(p.reserve(1).unwrap_err(), err, "stays broken");
        assert_eq!(p.free_lines().unwrap_err(), broken);
    }
    // Going back is as impossible as running ahead.
    let (seg, (mut p, mut c)) = shm_pair(8);
    for seq in 0..8 {
        assert!(send(&mut p, seq, 1));
    }
    drain(&mut c);
    assert_eq!(p.free_lines().unwrap(), 8);
    seg.write_at(HEAD, &3u64.to_ne_bytes()).unwrap();
    assert!(p.free_lines().is_err());
}

proptest! {
    /// A peer that scribbles arbitrary bytes over lines and head between operations: no
    /// panic, no hang; every error names a violation and sticks; every accepted frame is a
    /// frame the producer sent, or carries this lap's stamps and a count in range.
    #[test]
    fn garbage_anywhere_never_panics_or_hangs(
        shift in 0u32..6,
        steps in proptest::collection::vec(
            (0usize..4, any::<usize>(), any::<[u8; 8]>(), 1..=MAX_FRAME_LINES),
            1..200,
        ),
    ) {
        let capacity = 1usize << shift;
        let (seg, (mut p, mut c)) = shm_pair(capacity);
        let mut out = [Line::ZERO; MAX_FRAME_LINES];
        let mut consumer_broken = None;
        let mut producer_broken = None;
        for (what, at, bytes, n) in steps {
            match what {
                0 => {
                    // Scribble on a line's first word, or anywhere in it.
                    let pos = at % capacity;
                    let within = (at / capacity) % (LINE_BYTES - 7);
                    let off = if at % 2 == 0 { 0 } else { within };
                    seg.write_at(LINE0 + pos * LINE_BYTES + off, &bytes).unwrap();
                }
                1 => seg.write_at(HEAD, &bytes).unwrap(),
                2 => match p.reserve(n.min(p.max_frame_lines())) {
                    Ok(Some(mut f)) => {
                        for i in 0..f.lines() {
                            f.write_line(i, &line_of(at as u64, i)).unwrap();
                        }
                        f.commit();
                    }
                    Ok(None) => {}
                    Err(ReserveError::Broken(b)) => {
                        let head_error = matches!(b.violation(), Violation::HeadOutOfRange { .. });
                        prop_assert!(head_error, "{}", b);
                        if let Some(prev) = producer_broken { prop_assert_eq!(prev, b); }
                        producer_broken = Some(b);
                    }
                    Err(e) => prop_assert!(false, "{e}"),
                },
                _ => match c.recv(&mut out) {
                    Ok(Some(n)) => {
                        prop_assert!((1..=MAX_FRAME_LINES.min(capacity)).contains(&n));
                        prop_assert_eq!(out[0].count() as usize, n);
                        for line in &out[1..n] {
                            prop_assert_eq!(line.stamp(), out[0].stamp());
                            prop_assert_eq!(line.count(), 0);
                        }
                    }
                    Ok(None) => {}
                    Err(b) => {
                        if let Some(prev) = consumer_broken { prop_assert_eq!(prev, b); }
                        consumer_broken = Some(b);
                        prop_assert!(!b.to_string().is_empty());
                    }
                },
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Attach
// ---------------------------------------------------------------------------------------

#[test]
fn attach_errors_say_which() {
    let seg = segment(OFF + lines::shm_lines_bytes(64).unwrap());
    // Nothing initialised there.
    let err = lines::shm_lines_consumer(Arc::clone(&seg), OFF).unwrap_err();
    assert_eq!(err, RingOpenError::BadLinesMagic { found: 0 });
    assert!(err.to_string().contains("init_shm_lines"), "{err}");
    // A slot ring is not a line ring.
    ring::init_shm_ring::<u64>(&seg, OFF, 8).unwrap();
    assert!(matches!(
        lines::shm_lines_producer(Arc::clone(&seg), OFF),
        Err(RingOpenError::BadLinesMagic { .. })
    ));
    assert!(matches!(
        lines::init_shm_lines(&seg, OFF + 64, 8),
        Err(ring::RingInitError::Misaligned { offset }) if offset == OFF + 64
    ));
    assert!(matches!(
        lines::init_shm_lines(&seg, OFF, 128),
        Err(ring::RingInitError::DoesNotFit { .. })
    ));
    lines::init_shm_lines(&seg, OFF, 64).unwrap();
    // A corrupt capacity, a foreign version, a foreign line size.
    for (at, bytes, check) in [
        (16usize, 3u64.to_le_bytes().to_vec(), 0),
        (16, (1u64 << 40).to_le_bytes().to_vec(), 0),
        (8, 2u32.to_le_bytes().to_vec(), 1),
        (12, 128u32.to_le_bytes().to_vec(), 2),
    ] {
        let mut saved = vec![0; bytes.len()];
        seg.read_at(OFF + at, &mut saved).unwrap();
        seg.write_at(OFF + at, &bytes).unwrap();
        let err = lines::shm_lines_consumer(Arc::clone(&seg), OFF).unwrap_err();
        match check {
            0 => assert!(matches!(err, RingOpenError::BadCapacity { .. }), "{err}"),
            1 => assert!(matches!(
                err,
                RingOpenError::VersionMismatch { found: 2, .. }
            )),
            _ => assert!(matches!(
                err,
                RingOpenError::SlotSizeMismatch { found: 128, .. }
            )),
        }
        seg.write_at(OFF + at, &saved).unwrap();
    }
    // One producer and one consumer.
    let p = lines::shm_lines_producer(Arc::clone(&seg), OFF).unwrap();
    let c = lines::shm_lines_consumer(Arc::clone(&seg), OFF).unwrap();
    assert_eq!(
        lines::shm_lines_producer(Arc::clone(&seg), OFF).unwrap_err(),
        RingOpenError::AlreadyAttached { end: "producer" }
    );
    assert_eq!(
        lines::shm_lines_consumer(Arc::clone(&seg), OFF).unwrap_err(),
        RingOpenError::AlreadyAttached { end: "consumer" }
    );
    drop((p, c));
    // A producer attaching to a ring whose head is impossible.
    seg.write_at(HEAD, &1000u64.to_ne_bytes()).unwrap();
    assert!(matches!(
        lines::shm_lines_producer(Arc::clone(&seg), OFF),
        Err(RingOpenError::Broken(_))
    ));
    // Read-only mappings cannot hold ring ends.
    let ro = Arc::new(
        Segment::open(seg.share_fd().unwrap(), KIND, Access::ReadOnly, usize::MAX).unwrap(),
    );
    assert_eq!(
        lines::shm_lines_consumer(ro, OFF).unwrap_err(),
        RingOpenError::SegmentReadOnly
    );
}

#[test]
fn heap_lines_storage_is_debuggable() {
    let (p, c): (LinesProducer<HeapLines>, LinesConsumer<HeapLines>) =
        lines::heap_lines(4).unwrap();
    assert!(format!("{p:?}").contains("capacity: 4"));
    assert!(format!("{c:?}").contains("head: 0"));
}
