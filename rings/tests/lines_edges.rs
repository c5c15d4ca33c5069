//! The line ring's judgements exactly at their edges (issue 24, item 15: `cargo mutants`
//! found them unchecked): a shared ring whose header or lines end exactly at the segment's
//! end is accepted, one a peer declares a line ring or a header too long is refused with
//! the right error; a frame takes exactly as many lines as it has; a consumer that finds
//! the ring empty hands back what it read.

use std::sync::Arc;

use shmhca_rings::lines::{self, LINE_BYTES, Line, LineOutOfFrame, MAX_FRAME_LINES};
use shmhca_rings::ring::RingOpenError;
use shmhca_rings::segment::{HugePages, Segment};

const KIND: u32 = 0x4c45;
/// Bytes before a shared ring's first line (its header and indices).
const LINES_OFFSET: usize = 256;

fn segment(data_len: usize) -> Arc<Segment> {
    Arc::new(
        Segment::builder(KIND, data_len)
            .huge_pages(HugePages::Never)
            .create()
            .unwrap(),
    )
}

/// Writes the header a peer would write for a ring of `capacity` lines at `offset`
/// (magic, version, line size, capacity), whether or not it fits.
fn forge_header(seg: &Segment, offset: usize, capacity: u64) {
    let mut h = Vec::new();
    h.extend_from_slice(&lines::LINES_MAGIC.to_ne_bytes());
    h.extend_from_slice(&lines::LINES_VERSION.to_ne_bytes());
    h.extend_from_slice(&(LINE_BYTES as u32).to_ne_bytes());
    h.extend_from_slice(&capacity.to_ne_bytes());
    seg.write_at(offset, &h).unwrap();
}

fn line(byte: u8) -> Line {
    Line([byte; LINE_BYTES])
}

#[test]
fn a_ring_ending_exactly_at_the_segments_end_is_accepted() {
    let seg = segment(64 << 10);
    let data_len = seg.data_len();
    let capacity = 64;
    let needed = lines::shm_lines_bytes(capacity).unwrap();
    assert_eq!(needed, capacity * LINE_BYTES + LINES_OFFSET);
    let offset = data_len - needed;
    lines::init_shm_lines(&seg, offset, capacity).unwrap();
    let mut p = lines::shm_lines_producer(seg.clone(), offset).unwrap();
    let mut c = lines::shm_lines_consumer(seg.clone(), offset).unwrap();
    // The last line of the segment carries a frame and comes back.
    for i in 0..capacity {
        let mut f = p.reserve(1).unwrap().expect("room");
        f.write_line(0, &line(i as u8)).unwrap();
        f.commit();
        let mut out = [Line::ZERO; MAX_FRAME_LINES];
        assert_eq!(c.recv(&mut out).unwrap(), Some(1));
        assert_eq!(out[0].0[8..], line(i as u8).0[8..]);
    }
}

#[test]
fn a_peer_declaring_lines_past_the_segments_end_is_refused() {
    let seg = segment(64 << 10);
    let data_len = seg.data_len();
    // A ring of 64 lines that fits exactly; then its header claims 128 lines (64 × 64 more
    // bytes than there are), then 65... no: capacities are powers of two, so the smallest
    // overrun a header can claim at a given offset is the next power of two, or the same
    // capacity one alignment step (128 bytes) further on.
    let fit = data_len - (64 * LINE_BYTES + LINES_OFFSET);
    forge_header(&seg, fit, 64);
    lines::shm_lines_consumer(seg.clone(), fit).expect("fits exactly");
    forge_header(&seg, fit, 128);
    let err = lines::shm_lines_consumer(seg.clone(), fit).unwrap_err();
    assert!(
        matches!(err, RingOpenError::DoesNotFit { needed, offset, data_len: d }
            if needed == (128 * LINE_BYTES + LINES_OFFSET) as u64 && offset == fit && d == data_len),
        "{err:?}"
    );
    let past = fit + 128;
    forge_header(&seg, past, 64);
    let err = lines::shm_lines_producer(seg.clone(), past).unwrap_err();
    assert!(
        matches!(err, RingOpenError::DoesNotFit { needed, .. }
            if needed == (64 * LINE_BYTES + LINES_OFFSET) as u64),
        "{err:?}"
    );
    // A capacity whose lines alone are more than the segment (the sum of capacity and line
    // size would fit).
    forge_header(&seg, 0, 1 << 10);
    assert!(matches!(
        lines::shm_lines_consumer(seg.clone(), 0),
        Err(RingOpenError::DoesNotFit { .. })
    ));
}

#[test]
fn a_header_ending_exactly_at_the_segments_end_is_read_and_one_past_is_refused() {
    let seg = segment(64 << 10);
    let data_len = seg.data_len();
    // The header (and indices) fit exactly: it is read and judged — here, its one line
    // does not fit.
    let at_end = data_len - LINES_OFFSET;
    forge_header(&seg, at_end, 1);
    let err = lines::shm_lines_consumer(seg.clone(), at_end).unwrap_err();
    assert!(
        matches!(err, RingOpenError::DoesNotFit { needed, .. }
            if needed == (LINE_BYTES + LINES_OFFSET) as u64),
        "{err:?}"
    );
    // One alignment step further, the header itself does not fit.
    let past = at_end + 128;
    let err = lines::shm_lines_producer(seg.clone(), past).unwrap_err();
    assert!(
        matches!(err, RingOpenError::HeaderOutOfBounds { offset, data_len: d }
            if offset == past && d == data_len),
        "{err:?}"
    );
}

#[test]
fn a_frame_takes_exactly_its_lines() {
    let (mut p, mut c) = lines::heap_lines(16).unwrap();
    let mut f = p.reserve(3).unwrap().expect("room");
    f.write_lines(&[line(1), line(2), line(3)]).unwrap();
    // One line too many: refused, naming the first line outside, nothing written.
    assert_eq!(
        f.write_lines(&[line(9); 4]),
        Err(LineOutOfFrame { line: 3, lines: 3 })
    );
    assert_eq!(
        f.write_line(3, &line(9)),
        Err(LineOutOfFrame { line: 3, lines: 3 })
    );
    f.commit();
    let mut out = [Line::ZERO; MAX_FRAME_LINES];
    assert_eq!(c.recv(&mut out).unwrap(), Some(3));
    for (i, l) in out[..3].iter().enumerate() {
        assert_eq!(l.0[8..], line(i as u8 + 1).0[8..], "line {i}");
    }
}

#[test]
fn a_consumer_that_finds_the_ring_empty_hands_back_what_it_read() {
    // 16 lines: the consumer publishes by itself every 4 lines.
    let (mut p, mut c) = lines::heap_lines(16).unwrap();
    let mut f = p.reserve(1).unwrap().expect("room");
    f.write_line(0, &line(5)).unwrap();
    f.commit();
    let mut out = [Line::ZERO; MAX_FRAME_LINES];
    assert_eq!(c.recv(&mut out).unwrap(), Some(1));
    assert_eq!(p.free_lines().unwrap(), 15, "not published yet");
    assert_eq!(c.recv(&mut out).unwrap(), None);
    assert_eq!(p.free_lines().unwrap(), 16, "published when found empty");
    // has_frame does the same.
    let mut f = p.reserve(2).unwrap().expect("room");
    f.write_lines(&[line(6), line(7)]).unwrap();
    f.commit();
    assert_eq!(c.recv(&mut out).unwrap(), Some(2));
    assert_eq!(p.free_lines().unwrap(), 14);
    assert!(!c.has_frame().unwrap());
    assert_eq!(p.free_lines().unwrap(), 16);
}

/// An idle consumer polls an empty ring without storing its head again: each store would
/// take the head's cache line from the producer on every empty poll. The test plants a
/// value in the shared head word; polling an empty ring whose head was already published
/// leaves it there.
#[test]
fn polling_an_empty_ring_stores_nothing_when_the_head_is_published() {
    let seg = segment(64 << 10);
    let offset = 0;
    lines::init_shm_lines(&seg, offset, 16).unwrap();
    let mut c = lines::shm_lines_consumer(seg.clone(), offset).unwrap();
    let head_word = offset + 128;
    seg.write_at(head_word, &5u64.to_ne_bytes()).unwrap();
    let mut out = [Line::ZERO; MAX_FRAME_LINES];
    for _ in 0..3 {
        assert_eq!(c.recv(&mut out).unwrap(), None);
        assert!(!c.has_frame().unwrap());
    }
    let mut word = [0u8; 8];
    seg.read_at(head_word, &mut word).unwrap();
    assert_eq!(
        u64::from_ne_bytes(word),
        5,
        "the consumer stored its head again"
    );
    // Once it has read something, finding the ring empty publishes it (see
    // a_consumer_that_finds_the_ring_empty_hands_back_what_it_read).
    drop(c);
}
