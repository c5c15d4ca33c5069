//! Ring behaviour over both storages: capacities, single and burst operations, chunks,
//! wrap-around, full and empty, a hostile peer's garbage indices, and attach errors.

use std::sync::Arc;

use shmhca_rings::ring::{
    self, CapacityError, ChunkError, Consumer, MAX_CAPACITY, Producer, PushError, RingInitError,
    RingOpenError, Storage, Violation,
};
use shmhca_rings::segment::{Access, HugePages, Segment};
use shmhca_rings::{Pod, Zeroable};

const KIND: u32 = 0x1111;
/// The shared rings below sit at this offset; tail is at +128, head at +256.
const OFF: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
struct Slot64 {
    seq: u64,
    payload: [u64; 7],
}

impl Slot64 {
    fn new(seq: u64) -> Self {
        Slot64 {
            seq,
            payload: [seq.wrapping_mul(0x9e37_79b9_7f4a_7c15); 7],
        }
    }
}

fn segment(len: usize) -> Arc<Segment> {
    Arc::new(
        Segment::builder(KIND, len)
            .huge_pages(HugePages::Never)
            .create()
            .unwrap(),
    )
}

type ShmPair<T> = (
    Producer<T, ring::ShmStorage<T>>,
    Consumer<T, ring::ShmStorage<T>>,
);

fn shm_pair<T: Pod>(capacity: usize) -> (Arc<Segment>, ShmPair<T>) {
    let seg = segment(OFF + ring::shm_ring_bytes::<T>(capacity).unwrap());
    ring::init_shm_ring::<T>(&seg, OFF, capacity).unwrap();
    let p = ring::shm_producer::<T>(Arc::clone(&seg), OFF).unwrap();
    let c = ring::shm_consumer::<T>(Arc::clone(&seg), OFF).unwrap();
    (seg, (p, c))
}

fn write_u64(seg: &Segment, offset: usize, value: u64) {
    seg.write_at(offset, &value.to_ne_bytes()).unwrap();
}

const TAIL: usize = OFF + 128;
const HEAD: usize = OFF + 256;

// ---- capacities -------------------------------------------------------------------------

#[test]
fn capacity_must_be_a_nonzero_power_of_two() {
    assert_eq!(ring::heap_ring::<u8>(0).unwrap_err(), CapacityError::Zero);
    assert_eq!(
        ring::heap_ring::<u8>(3).unwrap_err(),
        CapacityError::NotPowerOfTwo { capacity: 3 }
    );
    assert_eq!(
        ring::heap_ring::<u8>(100).unwrap_err(),
        CapacityError::NotPowerOfTwo { capacity: 100 }
    );
    assert!(matches!(
        ring::heap_ring::<u8>(MAX_CAPACITY * 2),
        Err(CapacityError::TooLarge { .. })
    ));
    assert_eq!(ring::shm_ring_bytes::<u64>(0), Err(CapacityError::Zero));
    assert_eq!(
        ring::shm_ring_bytes::<u64>(6),
        Err(CapacityError::NotPowerOfTwo { capacity: 6 })
    );
    assert_eq!(ring::shm_ring_bytes::<u64>(8), Ok(384 + 64));
    assert_eq!(ring::heap_ring::<u8>(1).unwrap().0.capacity(), 1);
    let seg = segment(1 << 16);
    assert_eq!(
        ring::init_shm_ring::<u64>(&seg, 0, 12),
        Err(RingInitError::Capacity(CapacityError::NotPowerOfTwo {
            capacity: 12
        }))
    );
    assert_eq!(
        ring::init_shm_ring::<u64>(&seg, 0, 0),
        Err(RingInitError::Capacity(CapacityError::Zero))
    );
}

// ---- generic behaviour, run over both storages -----------------------------------------

fn single_full_and_empty<S: Storage<u64>>(mut p: Producer<u64, S>, mut c: Consumer<u64, S>) {
    let cap = p.capacity();
    assert_eq!(c.pop().unwrap(), None, "a new ring is empty");
    assert_eq!(c.available().unwrap(), 0);
    assert_eq!(p.free_slots().unwrap(), cap);
    for i in 0..cap as u64 {
        p.push(i).unwrap();
    }
    assert!(
        matches!(p.push(99), Err(PushError::Full(99))),
        "full returns the value"
    );
    assert_eq!(p.free_slots().unwrap(), 0);
    assert_eq!(c.available().unwrap(), cap);
    assert_eq!(c.pop().unwrap(), Some(0));
    assert_eq!(p.free_slots().unwrap(), 1, "a pop frees one slot");
    p.push(cap as u64).unwrap();
    for i in 1..=cap as u64 {
        assert_eq!(c.pop().unwrap(), Some(i));
    }
    assert_eq!(c.pop().unwrap(), None);
    assert_eq!(p.free_slots().unwrap(), cap);
}

fn bursts<S: Storage<u64>>(mut p: Producer<u64, S>, mut c: Consumer<u64, S>) {
    let cap = p.capacity();
    assert_eq!(cap, 8);
    let values: Vec<u64> = (0..20).collect();
    assert_eq!(p.push_burst(&values[..5]).unwrap(), 5);
    assert_eq!(p.push_burst(&values[5..]).unwrap(), 3, "only what fits");
    assert_eq!(p.push_burst(&values[8..]).unwrap(), 0, "full");
    let mut out = [0u64; 6];
    assert_eq!(c.pop_burst(&mut out).unwrap(), 6);
    assert_eq!(out, [0, 1, 2, 3, 4, 5]);
    assert_eq!(p.push_burst(&values[8..]).unwrap(), 6, "wraps around");
    let mut out = [0u64; 32];
    assert_eq!(c.pop_burst(&mut out).unwrap(), 8);
    assert_eq!(&out[..8], &[6, 7, 8, 9, 10, 11, 12, 13]);
    assert_eq!(c.pop_burst(&mut out).unwrap(), 0);
    assert_eq!(c.pop_burst(&mut []).unwrap(), 0);
    assert_eq!(p.push_burst(&[]).unwrap(), 0);
    // pop_each: at most `max`, oldest first, across the ring's end, each slot freed.
    assert_eq!(p.push_burst(&values[..8]).unwrap(), 8);
    let mut seen = vec![];
    assert_eq!(c.pop_each(0, |v| seen.push(v)).unwrap(), 0);
    assert_eq!(c.pop_each(3, |v| seen.push(v)).unwrap(), 3);
    assert_eq!(seen, [0, 1, 2]);
    assert_eq!(
        p.free_slots().unwrap(),
        3,
        "the values handed over are freed"
    );
    assert_eq!(p.push_burst(&values[8..11]).unwrap(), 3, "wraps around");
    assert_eq!(c.pop_each(100, |v| seen.push(v)).unwrap(), 8);
    assert_eq!(seen, (0..11).collect::<Vec<u64>>());
    assert_eq!(c.pop_each(100, |v| seen.push(v)).unwrap(), 0, "empty");
    // A panic in the callback: the values it returned from are gone, the one it panicked
    // on comes again.
    assert_eq!(p.push_burst(&values[11..15]).unwrap(), 4);
    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        c.pop_each(4, |v| {
            assert_ne!(v, 13, "a callback that fails on 13");
            seen.push(v);
        })
    }));
    assert!(got.is_err());
    assert_eq!(&seen[11..], &[11, 12]);
    assert_eq!(
        p.free_slots().unwrap(),
        6,
        "11 and 12 released, 13 and 14 not"
    );
    assert_eq!(c.pop_each(4, |v| seen.push(v)).unwrap(), 2);
    assert_eq!(&seen[11..], &[11, 12, 13, 14]);
}

fn chunks<S: Storage<u64>>(mut p: Producer<u64, S>, mut c: Consumer<u64, S>) {
    assert_eq!(p.capacity(), 8);
    assert_eq!(
        p.write_chunk(9).err(),
        Some(ChunkError::TooFewSlots {
            requested: 9,
            available: 8
        })
    );
    let mut w = p.write_chunk(5).unwrap();
    assert_eq!(w.len(), 5);
    assert_eq!(
        w.write(1, 10).unwrap_err(),
        ChunkError::OutOfOrder {
            index: 1,
            written: 0,
            len: 5
        },
        "no gaps"
    );
    w.write(0, 100).unwrap();
    w.write(0, 0).unwrap(); // rewriting is fine
    w.push(1).unwrap();
    assert_eq!(w.fill([2, 3, 4, 5, 6]), 3, "fill stops at the chunk's end");
    assert_eq!(w.push(7), Err(7));
    assert_eq!(
        w.write(5, 5).unwrap_err(),
        ChunkError::OutOfOrder {
            index: 5,
            written: 5,
            len: 5
        }
    );
    assert_eq!(
        c.available().unwrap(),
        0,
        "nothing is visible before commit"
    );
    w.commit(3).unwrap();
    assert_eq!(c.available().unwrap(), 3, "commit(3) publishes exactly 3");

    // A dropped chunk publishes nothing; an over-commit publishes nothing.
    {
        let mut unused = p.write_chunk(2).unwrap();
        unused.push(77).unwrap();
    } // dropped without commit
    let mut w = p.write_chunk(2).unwrap();
    w.push(3).unwrap();
    assert_eq!(
        w.commit(2).unwrap_err(),
        ChunkError::CommitTooMany {
            requested: 2,
            limit: 1
        }
    );
    assert_eq!(c.available().unwrap(), 3);
    let mut w = p.write_chunk(5).unwrap();
    assert_eq!(w.fill(3..), 5);
    assert_eq!(w.commit_all(), 5);
    assert_eq!(p.free_slots().unwrap(), 0);

    let r = c.read_chunk(8).unwrap();
    assert_eq!(r.len(), 8);
    assert_eq!(r.iter().collect::<Vec<_>>(), (0..8).collect::<Vec<_>>());
    assert_eq!(r.get(8), None);
    assert_eq!(
        r.commit(9).unwrap_err(),
        ChunkError::CommitTooMany {
            requested: 9,
            limit: 8
        }
    );
    assert_eq!(
        c.available().unwrap(),
        8,
        "a failed commit releases nothing"
    );
    let r = c.read_chunk(3).unwrap();
    r.commit(2).unwrap();
    assert_eq!(c.pop().unwrap(), Some(2));
    assert_eq!(p.free_slots().unwrap(), 3);
    assert!(matches!(
        c.read_chunk(6).err(),
        Some(ChunkError::TooFewSlots {
            requested: 6,
            available: 5
        })
    ));
    let r = c.read_chunk(5).unwrap();
    assert_eq!(r.get(4), Some(7));
    assert_eq!(r.commit_all(), 5);
    assert_eq!(c.pop().unwrap(), None);
}

/// Many laps with burst sizes that do not divide the capacity: every value arrives once,
/// in order.
fn wrap_around_many_times<S: Storage<u64>>(mut p: Producer<u64, S>, mut c: Consumer<u64, S>) {
    let mut next_in = 0u64;
    let mut next_out = 0u64;
    let mut buf = [0u64; 7];
    let mut out = [0u64; 5];
    let rounds: u64 = if cfg!(miri) { 400 } else { 20_000 };
    for round in 0..rounds {
        let want = (round % 7) as usize + 1;
        for (i, b) in buf.iter_mut().enumerate().take(want) {
            *b = next_in + i as u64;
        }
        let pushed = match round % 3 {
            0 => p.push_burst(&buf[..want]).unwrap(),
            1 => match p.push(next_in) {
                Ok(()) => 1,
                Err(PushError::Full(_)) => 0,
                Err(e) => panic!("{e}"),
            },
            _ => {
                let free = p.free_slots().unwrap();
                let mut w = p.write_chunk(want.min(free)).unwrap();
                w.fill(next_in..);
                w.commit_all()
            }
        };
        next_in += pushed as u64;
        let take = (round % 5) as usize + 1;
        let n = match round % 3 {
            0 => c.pop_burst(&mut out[..take]).unwrap(),
            1 => {
                let avail = c.available().unwrap().min(take);
                let r = c.read_chunk(avail).unwrap();
                for (i, v) in r.iter().enumerate() {
                    out[i] = v;
                }
                r.commit_all()
            }
            _ => {
                let mut k = 0;
                let n = c
                    .pop_each(take, |v| {
                        out[k] = v;
                        k += 1;
                    })
                    .unwrap();
                assert_eq!(n, k, "pop_each counts what it handed over");
                n
            }
        };
        for &v in &out[..n] {
            assert_eq!(v, next_out, "value out of order or lost");
            next_out += 1;
        }
    }
    while let Some(v) = c.pop().unwrap() {
        assert_eq!(v, next_out);
        next_out += 1;
    }
    assert_eq!(next_out, next_in);
    assert!(next_in > rounds, "many laps of an 8-slot ring: {next_in}");
}

#[test]
fn heap_single_full_and_empty() {
    let (p, c) = ring::heap_ring(4).unwrap();
    single_full_and_empty(p, c);
}
#[test]
fn shm_single_full_and_empty() {
    let (_seg, (p, c)) = shm_pair::<u64>(4);
    single_full_and_empty(p, c);
}
#[test]
fn heap_bursts() {
    let (p, c) = ring::heap_ring(8).unwrap();
    bursts(p, c);
}
#[test]
fn shm_bursts() {
    let (_seg, (p, c)) = shm_pair::<u64>(8);
    bursts(p, c);
}
#[test]
fn heap_chunks() {
    let (p, c) = ring::heap_ring(8).unwrap();
    chunks(p, c);
}
#[test]
fn shm_chunks() {
    let (_seg, (p, c)) = shm_pair::<u64>(8);
    chunks(p, c);
}
#[test]
fn heap_wrap_around() {
    let (p, c) = ring::heap_ring(8).unwrap();
    wrap_around_many_times(p, c);
}
#[test]
fn shm_wrap_around() {
    let (_seg, (p, c)) = shm_pair::<u64>(8);
    wrap_around_many_times(p, c);
}

#[test]
fn shm_slots_of_several_cache_lines() {
    #[derive(Clone, Copy, Pod, Zeroable, PartialEq, Debug)]
    #[repr(C)]
    struct Big([u64; 32]); // 256 bytes
    let (_seg, (mut p, mut c)) = shm_pair::<Big>(4);
    let mut out = [Big([0; 32]); 3];
    for lap in 0..10u64 {
        let vals: Vec<Big> = (0..3).map(|i| Big([lap * 10 + i; 32])).collect();
        assert_eq!(p.push_burst(&vals).unwrap(), 3);
        assert_eq!(c.pop_burst(&mut out).unwrap(), 3);
        assert_eq!(&out[..], &vals[..]);
    }
}

#[test]
fn indices_wrap_at_u64_max() {
    // A ring whose indices start just below 2^64: the wrapping arithmetic must carry on.
    let (seg, _) = shm_pair::<u64>(8);
    ring::init_shm_ring::<u64>(&seg, OFF, 8).unwrap();
    let start = u64::MAX - 5;
    write_u64(&seg, TAIL, start);
    write_u64(&seg, HEAD, start);
    let mut p = ring::shm_producer::<u64>(Arc::clone(&seg), OFF).unwrap();
    let mut c = ring::shm_consumer::<u64>(Arc::clone(&seg), OFF).unwrap();
    for i in 0..100u64 {
        assert_eq!(p.push_burst(&[i, i + 1000]).unwrap(), 2);
        assert_eq!(c.pop().unwrap(), Some(i));
        assert_eq!(c.pop().unwrap(), Some(i + 1000));
    }
    let mut raw = [0u8; 8];
    seg.read_at(TAIL, &mut raw).unwrap();
    assert_eq!(
        u64::from_ne_bytes(raw),
        start.wrapping_add(200),
        "tail wrapped past zero"
    );
}

#[test]
fn heap_two_threads_everything_once_in_order() {
    const COUNT: u64 = if cfg!(miri) { 500 } else { 1_000_000 };
    let (mut p, mut c) = ring::heap_ring::<u64>(64).unwrap();
    let producer = std::thread::spawn(move || {
        let mut next = 0u64;
        let mut buf = [0u64; 32];
        while next < COUNT {
            let n = ((next % 32) + 1).min(COUNT - next) as usize;
            for (i, b) in buf[..n].iter_mut().enumerate() {
                *b = next + i as u64;
            }
            let pushed = p.push_burst(&buf[..n]).unwrap();
            next += pushed as u64;
            if pushed == 0 {
                std::hint::spin_loop();
            }
        }
    });
    let mut expected = 0u64;
    let mut out = [0u64; 32];
    while expected < COUNT {
        let n = c.pop_burst(&mut out).unwrap();
        for &v in &out[..n] {
            assert_eq!(v, expected);
            expected += 1;
        }
        if n == 0 {
            std::hint::spin_loop();
        }
    }
    producer.join().unwrap();
    assert_eq!(c.pop().unwrap(), None);
}

// ---- a hostile peer ---------------------------------------------------------------------

fn assert_broken_forever<T: Copy + std::fmt::Debug, S: Storage<T>>(
    c: &mut Consumer<T, S>,
    v: Violation,
) {
    let err = c.pop().unwrap_err();
    assert_eq!(err.violation(), v);
    assert!(err.to_string().contains("link broken"), "{err}");
    // Sticky: every later call returns it, whatever the peer does now.
    assert_eq!(c.available().unwrap_err(), err);
    let mut out = [];
    assert_eq!(c.pop_burst(&mut out).unwrap_err(), err);
    assert_eq!(c.read_chunk(0).err(), Some(ChunkError::Broken(err)));
}

#[test]
fn consumer_reports_tail_far_ahead() {
    let (seg, (_p, mut c)) = shm_pair::<u64>(64);
    write_u64(&seg, TAIL, 1234);
    assert_broken_forever(
        &mut c,
        Violation::TailTooFarAhead {
            tail: 1234,
            head: 0,
            capacity: 64,
        },
    );
    let text = c.pop().unwrap_err().to_string();
    assert!(
        text.contains(
            "producer index 1234 is 1234 slots ahead of consumer index 0 but capacity is 64"
        ),
        "{text}"
    );
    // Repairing the index does not un-break the ring.
    write_u64(&seg, TAIL, 0);
    assert!(c.pop().is_err());
}

#[test]
fn consumer_reports_tail_behind_head() {
    let (seg, (mut p, mut c)) = shm_pair::<u64>(8);
    p.push_burst(&[1, 2, 3]).unwrap();
    let mut out = [0; 3];
    assert_eq!(c.pop_burst(&mut out).unwrap(), 3);
    write_u64(&seg, TAIL, 1);
    assert_broken_forever(&mut c, Violation::TailBehindHead { tail: 1, head: 3 });
}

#[test]
fn consumer_reports_tail_going_back() {
    let (seg, (mut p, mut c)) = shm_pair::<u64>(8);
    p.push_burst(&[1, 2, 3, 4]).unwrap();
    assert_eq!(c.pop().unwrap(), Some(1)); // caches tail = 4, head = 1
    assert_eq!(c.available().unwrap(), 3);
    write_u64(&seg, TAIL, 2); // still ahead of head, but behind what was published
    let mut out = [0; 8];
    // 3 slots are known: they are delivered without a reload...
    assert_eq!(c.pop_burst(&mut out[..3]).unwrap(), 3);
    // ...and the next reload sees tail 2 behind head 4.
    assert_broken_forever(&mut c, Violation::TailBehindHead { tail: 2, head: 4 });

    let (seg, (mut p, mut c)) = shm_pair::<u64>(8);
    p.push_burst(&[1, 2, 3, 4]).unwrap();
    assert_eq!(c.pop().unwrap(), Some(1));
    write_u64(&seg, TAIL, 3);
    let err = c.available().unwrap_err();
    assert_eq!(
        err.violation(),
        Violation::TailWentBack {
            previous: 4,
            tail: 3
        }
    );
}

#[test]
fn consumer_survives_any_garbage_tail() {
    // Random and extreme values: the consumer either accepts a consistent index and returns
    // only published-or-garbage-but-in-bounds slots, or reports LinkBroken. Never a panic.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let specials = [
        u64::MAX,
        u64::MAX / 2,
        u64::MAX / 2 + 1,
        1 << 63,
        65,
        64,
        63,
        0,
        1,
    ];
    for i in 0..2000 {
        let (seg, (_p, mut c)) = shm_pair::<Slot64>(64);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let garbage = if i < specials.len() {
            specials[i]
        } else {
            x >> (x % 64)
        };
        write_u64(&seg, TAIL, garbage);
        let mut out = [Slot64::new(0); 32];
        match c.pop_burst(&mut out) {
            Ok(n) => {
                assert!(garbage <= 64, "accepted impossible tail {garbage}");
                assert_eq!(n as u64, garbage.min(32));
            }
            Err(e) => assert!(garbage > 64, "rejected possible tail {garbage}: {e}"),
        }
    }
}

#[test]
fn producer_reports_impossible_head() {
    // Head beyond tail.
    let (seg, (mut p, _c)) = shm_pair::<u64>(4);
    for i in 0..4 {
        p.push(i).unwrap();
    }
    write_u64(&seg, HEAD, 9);
    let err = match p.push(5) {
        Err(PushError::Broken(e)) => e,
        other => panic!("expected LinkBroken, got {other:?}"),
    };
    assert_eq!(
        err.violation(),
        Violation::HeadOutOfRange {
            head: 9,
            previous: 0,
            tail: 4
        }
    );
    assert_eq!(p.free_slots().unwrap_err(), err, "sticky");
    assert_eq!(p.push_burst(&[1]).unwrap_err(), err);
    assert_eq!(p.write_chunk(0).err(), Some(ChunkError::Broken(err)));

    // Head going back.
    let (seg, (mut p, mut c)) = shm_pair::<u64>(4);
    for i in 0..4 {
        p.push(i).unwrap();
    }
    let mut out = [0; 2];
    c.pop_burst(&mut out).unwrap();
    p.push(4).unwrap(); // reloads head = 2
    write_u64(&seg, HEAD, 1);
    p.push(5).unwrap(); // one slot still known free: no reload
    let err = p.push(6).unwrap_err();
    assert!(matches!(
        err,
        PushError::Broken(e) if e.violation() == Violation::HeadOutOfRange { head: 1, previous: 2, tail: 6 }
    ));

    // u64::MAX.
    let (seg, (mut p, _c)) = shm_pair::<u64>(4);
    for i in 0..4 {
        p.push(i).unwrap();
    }
    write_u64(&seg, HEAD, u64::MAX);
    assert!(matches!(p.push(0), Err(PushError::Broken(_))));
}

#[test]
fn garbage_in_slots_is_just_data() {
    // A peer may rewrite a slot at any time; the consumer only ever hands out copies, so
    // the value the caller holds cannot change under it.
    let (seg, (mut p, mut c)) = shm_pair::<Slot64>(8);
    p.push(Slot64::new(7)).unwrap();
    let first = c.read_chunk(1).unwrap().get(0).unwrap();
    seg.write_at(OFF + 384, &[0xFF; 64]).unwrap();
    assert_eq!(first, Slot64::new(7), "the copy is private");
    let again = c.pop().unwrap().unwrap();
    assert_eq!(
        again.seq,
        u64::MAX,
        "garbage arrives as garbage, without harm"
    );
}

// ---- attaching --------------------------------------------------------------------------

#[test]
fn attach_errors_say_which() {
    let seg = segment(8192);
    assert_eq!(
        ring::shm_consumer::<u64>(Arc::clone(&seg), 0).unwrap_err(),
        RingOpenError::BadMagic { found: 0 }
    );
    ring::init_shm_ring::<u64>(&seg, 0, 16).unwrap();
    assert_eq!(
        ring::shm_consumer::<u32>(Arc::clone(&seg), 0).unwrap_err(),
        RingOpenError::SlotSizeMismatch {
            expected: 4,
            found: 8
        }
    );
    assert_eq!(
        ring::shm_producer::<u64>(Arc::clone(&seg), 64).unwrap_err(),
        RingOpenError::Misaligned { offset: 64 }
    );
    assert!(matches!(
        ring::shm_producer::<u64>(Arc::clone(&seg), 8192).unwrap_err(),
        RingOpenError::HeaderOutOfBounds { .. }
    ));
    assert!(matches!(
        ring::shm_producer::<u64>(Arc::clone(&seg), usize::MAX - 127).unwrap_err(),
        RingOpenError::HeaderOutOfBounds { .. }
    ));
    // Capacity and version as a corrupt header would have them.
    seg.write_at(16, &3u64.to_ne_bytes()).unwrap();
    assert_eq!(
        ring::shm_producer::<u64>(Arc::clone(&seg), 0).unwrap_err(),
        RingOpenError::BadCapacity { found: 3 }
    );
    seg.write_at(16, &(1u64 << 40).to_ne_bytes()).unwrap();
    assert_eq!(
        ring::shm_producer::<u64>(Arc::clone(&seg), 0).unwrap_err(),
        RingOpenError::BadCapacity { found: 1 << 40 }
    );
    seg.write_at(16, &(1u64 << 20).to_ne_bytes()).unwrap();
    assert!(matches!(
        ring::shm_producer::<u64>(Arc::clone(&seg), 0).unwrap_err(),
        RingOpenError::DoesNotFit { .. }
    ));
    seg.write_at(8, &9u32.to_ne_bytes()).unwrap();
    assert!(matches!(
        ring::shm_producer::<u64>(Arc::clone(&seg), 0).unwrap_err(),
        RingOpenError::VersionMismatch { found: 9, .. }
    ));
    // init errors
    assert!(matches!(
        ring::init_shm_ring::<u64>(&seg, 4096, 1024).unwrap_err(),
        RingInitError::DoesNotFit { .. }
    ));
    assert_eq!(
        ring::init_shm_ring::<u64>(&seg, 100, 4).unwrap_err(),
        RingInitError::Misaligned { offset: 100 }
    );
    assert_eq!(
        ring::init_shm_ring::<()>(&seg, 0, 4).unwrap_err(),
        RingInitError::UnsupportedSlot { size: 0, align: 1 }
    );
}

#[test]
fn read_only_segments_cannot_hold_ring_ends() {
    let seg = segment(8192);
    ring::init_shm_ring::<u64>(&seg, 0, 16).unwrap();
    let ro = Arc::new(
        Segment::open(
            seg.try_clone_fd().unwrap(),
            KIND,
            Access::ReadOnly,
            usize::MAX,
        )
        .unwrap(),
    );
    assert_eq!(
        ring::shm_producer::<u64>(Arc::clone(&ro), 0).unwrap_err(),
        RingOpenError::SegmentReadOnly
    );
    assert_eq!(
        ring::shm_consumer::<u64>(Arc::clone(&ro), 0).unwrap_err(),
        RingOpenError::SegmentReadOnly
    );
    assert_eq!(
        ring::init_shm_ring::<u64>(&ro, 0, 16),
        Err(RingInitError::SegmentReadOnly)
    );
}

#[test]
fn one_producer_and_one_consumer_per_ring() {
    let (seg, (p, c)) = shm_pair::<u64>(8);
    assert_eq!(
        ring::shm_producer::<u64>(Arc::clone(&seg), OFF).unwrap_err(),
        RingOpenError::AlreadyAttached { end: "producer" }
    );
    assert_eq!(
        ring::shm_consumer::<u64>(Arc::clone(&seg), OFF).unwrap_err(),
        RingOpenError::AlreadyAttached { end: "consumer" }
    );
    drop(p);
    drop(c);
    // After detaching, new ends attach and carry on from the indices in the ring.
    let mut p = ring::shm_producer::<u64>(Arc::clone(&seg), OFF).unwrap();
    p.push(5).unwrap();
    drop(p);
    let mut p = ring::shm_producer::<u64>(Arc::clone(&seg), OFF).unwrap();
    p.push(6).unwrap();
    let mut c = ring::shm_consumer::<u64>(Arc::clone(&seg), OFF).unwrap();
    assert_eq!(c.pop().unwrap(), Some(5));
    assert_eq!(c.pop().unwrap(), Some(6));
}

#[test]
fn attaching_to_inconsistent_indices_fails() {
    let seg = segment(8192);
    ring::init_shm_ring::<u64>(&seg, 0, 16).unwrap();
    write_u64(&seg, 128, 100); // tail 100, head 0, capacity 16
    assert!(matches!(
        ring::shm_consumer::<u64>(Arc::clone(&seg), 0).unwrap_err(),
        RingOpenError::Broken(e) if matches!(e.violation(), Violation::TailTooFarAhead { tail: 100, head: 0, capacity: 16 })
    ));
    assert!(matches!(
        ring::shm_producer::<u64>(Arc::clone(&seg), 0).unwrap_err(),
        RingOpenError::Broken(_)
    ));
    // The failed attaches left the ends free.
    write_u64(&seg, 128, 0);
    ring::shm_consumer::<u64>(Arc::clone(&seg), 0).unwrap();
    ring::shm_producer::<u64>(Arc::clone(&seg), 0).unwrap();
}
