//! The line ring's consumer against a hostile producer, case by case and under a racing
//! writer: for every word a peer can put where the consumer expects the next frame — any
//! stamp near the expected one, any count byte, padding — at every position of rings of 1,
//! 2, 4 and 32 lines, in lap 0, in a later lap and across the stamp and index wrap, the
//! consumer's answer is the one the protocol (`shmhca_rings::lines`) prescribes; and a peer
//! rewriting a frame while it is copied out never gets an unvalidated line past the copy.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use shmhca_rings::lines::{
    self, LINE_BYTES, Line, LinesConsumer, LinesProducer, MAX_FRAME_LINES, PADDING, ShmLines,
};
use shmhca_rings::ring::Violation;
use shmhca_rings::segment::{HugePages, Segment};

const KIND: u32 = 0x4c48;
const OFF: usize = 1024;
const HEAD: usize = OFF + 128;
const PARKED_TAIL: usize = OFF + 72;
const LINE0: usize = OFF + 256;

type ShmPair = (LinesProducer<ShmLines>, LinesConsumer<ShmLines>);

/// A shared ring of `capacity` lines whose indices start at `start`, every line carrying
/// the stamp of the lap before the one in which it is next written (what honest ends
/// that detached there leave behind).
fn pair_at(capacity: usize, start: u64) -> (Arc<Segment>, ShmPair) {
    let seg = Arc::new(
        Segment::builder(KIND, OFF + lines::shm_lines_bytes(capacity).unwrap())
            .huge_pages(HugePages::Never)
            .create()
            .unwrap(),
    );
    lines::init_shm_lines(&seg, OFF, capacity).unwrap();
    let cap = capacity as u64;
    for pos in 0..cap {
        let next = start.wrapping_add(pos.wrapping_sub(start) & (cap - 1));
        let stale = stamp(next, capacity).wrapping_sub(1);
        seg.write_at(LINE0 + pos as usize * LINE_BYTES, &stale.to_le_bytes())
            .unwrap();
    }
    seg.write_at(HEAD, &start.to_ne_bytes()).unwrap();
    seg.write_at(PARKED_TAIL, &start.to_ne_bytes()).unwrap();
    let p = lines::shm_lines_producer(Arc::clone(&seg), OFF).unwrap();
    let c = lines::shm_lines_consumer(Arc::clone(&seg), OFF).unwrap();
    (seg, (p, c))
}

/// The stamp of line `index` (the protocol's, computed independently).
fn stamp(index: u64, capacity: usize) -> u32 {
    ((index / capacity as u64) as u32).wrapping_add(1)
}

fn write_word(seg: &Segment, pos: usize, stamp: u32, count: u8) {
    let mut w = [0u8; 8];
    w[..4].copy_from_slice(&stamp.to_le_bytes());
    w[4] = count;
    w[5..8].copy_from_slice(b"usr");
    seg.write_at(LINE0 + pos * LINE_BYTES, &w).unwrap();
}

/// What the protocol says the consumer must do with the word found at its head.
#[derive(Debug, PartialEq, Eq)]
enum Want {
    /// Empty (`None`), head now at this index.
    Empty(u64),
    /// A frame of this many lines.
    Frame(usize),
    Broken(Violation),
}

/// The oracle: the consumer at `head` of a `capacity`-line ring finds (`stamp`, `count`)
/// in the line at head; continuation lines carry this lap's stamp if `good_cont`, else
/// the previous lap's.
fn oracle(capacity: usize, head: u64, found: u32, count: u8, good_cont: bool) -> Want {
    let cap = capacity as u64;
    let pos = head % cap;
    let expected = stamp(head, capacity);
    if found == expected.wrapping_sub(1) {
        return Want::Empty(head);
    }
    if found != expected {
        return Want::Broken(Violation::StampOutOfRange {
            index: head,
            found,
            expected,
        });
    }
    if count == PADDING {
        if pos == 0 {
            return Want::Broken(Violation::FrameOverrunsRing {
                index: head,
                lines: 0,
                capacity: cap,
            });
        }
        // Skipped; line 0 of the next lap still carries this lap's stamp: empty.
        return Want::Empty(head.wrapping_add(cap - pos));
    }
    if count == 0 || usize::from(count) > MAX_FRAME_LINES {
        return Want::Broken(Violation::BadLineCount { index: head, count });
    }
    if pos + u64::from(count) > cap {
        return Want::Broken(Violation::FrameOverrunsRing {
            index: head,
            lines: count,
            capacity: cap,
        });
    }
    if count > 1 && !good_cont {
        return Want::Broken(Violation::BadContinuationLine {
            index: head.wrapping_add(1),
            found: expected.wrapping_sub(1),
            count: 0,
            expected,
        });
    }
    Want::Frame(usize::from(count))
}

fn consume(c: &mut LinesConsumer<ShmLines>) -> Want {
    let mut out = [Line::ZERO; MAX_FRAME_LINES];
    match c.recv(&mut out) {
        Ok(None) => Want::Empty(c.head()),
        Ok(Some(n)) => {
            // The caller's copy: the validated first word, this lap's continuation words.
            assert_eq!(out[0].count() as usize, n);
            assert_eq!(&out[0].0[5..8], b"usr");
            for line in &out[1..n] {
                assert_eq!((line.stamp(), line.count()), (out[0].stamp(), 0));
            }
            Want::Frame(n)
        }
        Err(b) => {
            let again = c.recv(&mut out).unwrap_err();
            assert_eq!(again, b, "a broken ring stays broken");
            Want::Broken(b.violation())
        }
    }
}

#[test]
fn every_word_at_the_head_gets_the_protocols_answer() {
    let mut cases = 0;
    for capacity in [1usize, 2, 4, 32] {
        let cap = capacity as u64;
        // Lap 0, a later lap, the lap whose stamp is 0 (u32 wrap), the u64 index wrap.
        for base in [
            0u64,
            3 * cap,
            ((1u64 << 32) - 1) * cap,
            0u64.wrapping_sub(cap),
        ] {
            let mut positions = vec![0, 1 % cap, cap / 2, cap - 1];
            positions.dedup();
            for pos in positions {
                let head = base.wrapping_add(pos);
                let e = stamp(head, capacity);
                let stamps = [
                    e,
                    e.wrapping_sub(1),
                    e.wrapping_add(1),
                    e.wrapping_sub(2),
                    0,
                    u32::MAX,
                ];
                let counts = [0u8, 1, 2, 3, 4, 16, 17, 0x80, 0xFE, PADDING];
                for &s in &stamps {
                    for &n in &counts {
                        for good_cont in [false, true] {
                            let (seg, (_p, mut c)) = pair_at(capacity, head);
                            if good_cont {
                                for i in 1..usize::from(n).min(MAX_FRAME_LINES) {
                                    let at = (pos as usize + i) % capacity;
                                    write_word(&seg, at, e, 0);
                                }
                            }
                            write_word(&seg, pos as usize, s, n);
                            let want = oracle(capacity, head, s, n, good_cont);
                            let got = consume(&mut c);
                            assert_eq!(
                                got, want,
                                "capacity {capacity}, head {head}, stamp {s}, count {n}, \
                                 continuation lines written: {good_cont}"
                            );
                            cases += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(cases > 1000);
}

/// A peer that keeps flipping a published frame's last continuation line between this
/// lap's stamp and a wrong one while the consumer copies the frame out: every frame the
/// consumer accepts is consistent in the caller's copy (the checks judge the copy, not the
/// shared lines, which may have changed since), and every refusal names that line.
/// Bounded in frames and time; a ring that breaks is replaced.
#[test]
fn a_frame_rewritten_during_the_copy_is_judged_by_the_copy() {
    const CAP: usize = 16;
    const LAST: usize = CAP - 1;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let (mut accepted, mut refused) = (0u32, 0u32);
    // The ring the peer attacks, and the index of the frame its consumer reads next.
    let (seg, (_p, mut c)) = pair_at(CAP, 0);
    let shared = Arc::new(std::sync::Mutex::new((seg, 0u64)));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (shared, stop) = (Arc::clone(&shared), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let (seg, head) = shared.lock().unwrap().clone();
                let e = stamp(head, CAP);
                // The frame: continuation lines of this lap, then its first word.
                for i in 1..CAP {
                    write_word(&seg, i, e, 0);
                }
                write_word(&seg, 0, e, CAP as u8);
                for k in 0..256u32 {
                    write_word(&seg, LAST, if k % 2 == 0 { e ^ 8 } else { e }, 0);
                }
            }
        })
    };
    let mut out = [Line::ZERO; MAX_FRAME_LINES];
    while accepted + refused < 5_000 && std::time::Instant::now() < deadline {
        match c.recv(&mut out) {
            Ok(None) => std::thread::yield_now(),
            Ok(Some(n)) => {
                assert_eq!(n, CAP);
                let e = out[0].stamp();
                assert_eq!(e, stamp(c.head() - CAP as u64, CAP));
                for line in &out[1..n] {
                    assert_eq!((line.stamp(), line.count()), (e, 0), "an unchecked line");
                }
                accepted += 1;
                shared.lock().unwrap().1 = c.head();
            }
            Err(b) => {
                assert!(
                    matches!(b.violation(), Violation::BadContinuationLine { index, .. } if index % CAP as u64 == LAST as u64),
                    "{b}"
                );
                refused += 1;
                drop(c);
                let (seg, (_p, fresh)) = pair_at(CAP, 0);
                c = fresh;
                *shared.lock().unwrap() = (seg, 0);
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    assert!(accepted + refused > 0, "the peer never wrote a frame");
}
