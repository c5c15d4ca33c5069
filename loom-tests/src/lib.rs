//! Models of shmhca's lock-free hand-offs, run under [loom] with
//! `RUSTFLAGS="--cfg shmhca_loom" cargo test -p shmhca-loom-tests --release`.
//!
//! Each scenario is an ordinary function that starts a producer thread and consumes on the
//! calling thread. [`check`] runs it under loom's model checker when the crate is built
//! with `--cfg shmhca_loom` (every interleaving up to [`DEFAULT_MAX_PREEMPTIONS`]
//! preemptions, or `LOOM_MAX_PREEMPTIONS` if set), and otherwise as a plain std-thread
//! stress test repeated [`STRESS_RUNS`] times, so `cargo test --workspace` still runs it.
//!
//! Every scenario asserts that each value arrives exactly once and in order, and that the
//! ring ends empty. Under loom the slots are loom `UnsafeCell`s, so a missing
//! happens-before edge between a slot write and its read shows up as a causality
//! violation; `tests/ring.rs` proves it by running the scenarios on rings whose orderings
//! were deliberately weakened (`shmhca_rings::ring::Mutation`, compiled only under
//! `--cfg shmhca_loom`) and asserting that loom fails.
//!
//! [loom]: https://docs.rs/loom
#![forbid(unsafe_code)]

use shmhca_rings::ring::{Consumer, HeapStorage, Producer, PushError};

#[cfg(shmhca_loom)]
use loom::thread;
#[cfg(not(shmhca_loom))]
use std::thread;

/// Preemption bound used when `LOOM_MAX_PREEMPTIONS` is not set; keeps the whole loom run
/// to a few minutes on a 2-core machine.
pub const DEFAULT_MAX_PREEMPTIONS: usize = 3;

/// How many times a scenario runs when loom is not enabled.
pub const STRESS_RUNS: usize = 200;

/// The producer and consumer of a heap ring of `u32`.
pub type Pair = (
    Producer<u32, HeapStorage<u32>>,
    Consumer<u32, HeapStorage<u32>>,
);

/// Runs `scenario` under loom (with `--cfg shmhca_loom`) or as a repeated stress test.
pub fn check(scenario: impl Fn() + Send + Sync + 'static) {
    #[cfg(shmhca_loom)]
    {
        let mut builder = loom::model::Builder::new();
        if builder.preemption_bound.is_none() {
            builder.preemption_bound = Some(DEFAULT_MAX_PREEMPTIONS);
        }
        builder.check(scenario);
    }
    #[cfg(not(shmhca_loom))]
    for _ in 0..STRESS_RUNS {
        scenario();
    }
}

fn push_one(p: &mut Producer<u32, HeapStorage<u32>>, mut value: u32) {
    loop {
        match p.push(value) {
            Ok(()) => return,
            Err(PushError::Full(back)) => {
                value = back;
                thread::yield_now();
            }
            Err(PushError::Broken(e)) => panic!("{e}"),
        }
    }
}

/// Checks that `got` is the next expected value.
fn expect(next: &mut u32, got: u32) {
    assert_eq!(got, *next, "value lost, duplicated or out of order");
    *next += 1;
}

/// Single push and pop of `count` values through a ring made by `make(capacity)`. With
/// `count > capacity` the producer finds the ring full and the indices wrap around; the
/// consumer finds it empty.
pub fn single(make: fn(usize) -> Pair, capacity: usize, count: u32) {
    let (mut p, mut c) = make(capacity);
    let producer = thread::spawn(move || {
        for v in 0..count {
            push_one(&mut p, v);
        }
    });
    let mut next = 0;
    while next < count {
        match c.pop().unwrap() {
            Some(v) => expect(&mut next, v),
            None => thread::yield_now(),
        }
    }
    producer.join().unwrap();
    assert_eq!(c.pop().unwrap(), None, "nothing extra");
}

/// Bursts: the producer pushes `bursts` (sizes) with `push_burst`, retrying the rest when
/// the ring is full; the consumer drains with `pop_burst` into a buffer of `out_len`.
pub fn bursts(make: fn(usize) -> Pair, capacity: usize, bursts: &'static [usize], out_len: usize) {
    let count: u32 = bursts.iter().sum::<usize>() as u32;
    let (mut p, mut c) = make(capacity);
    let producer = thread::spawn(move || {
        let mut next = 0u32;
        for &size in bursts {
            let values: Vec<u32> = (next..next + size as u32).collect();
            let mut done = 0;
            while done < size {
                let n = p.push_burst(&values[done..]).unwrap();
                done += n;
                if n == 0 {
                    thread::yield_now();
                }
            }
            next += size as u32;
        }
    });
    let mut next = 0;
    let mut out = vec![0u32; out_len];
    while next < count {
        let n = c.pop_burst(&mut out).unwrap();
        for &v in &out[..n] {
            expect(&mut next, v);
        }
        if n == 0 {
            thread::yield_now();
        }
    }
    producer.join().unwrap();
    assert_eq!(c.pop_burst(&mut out).unwrap(), 0, "nothing extra");
}

/// Chunks: the producer fills `write_chunk`s of up to `chunk` slots and commits them; the
/// consumer reads `read_chunk`s of what is available (up to `chunk`), committing part of
/// each chunk first and the rest later.
pub fn chunks(make: fn(usize) -> Pair, capacity: usize, count: u32, chunk: usize) {
    let (mut p, mut c) = make(capacity);
    let producer = thread::spawn(move || {
        let mut next = 0u32;
        while next < count {
            let free = p.free_slots().unwrap();
            let n = free.min(chunk).min((count - next) as usize);
            if n == 0 {
                thread::yield_now();
                continue;
            }
            let mut w = p.write_chunk(n).unwrap();
            assert_eq!(w.fill(next..), n);
            next += w.commit_all() as u32;
        }
    });
    let mut next = 0;
    while next < count {
        let n = c.available().unwrap().min(chunk);
        if n == 0 {
            thread::yield_now();
            continue;
        }
        let r = c.read_chunk(n).unwrap();
        let first = r.get(0).unwrap();
        expect(&mut next, first);
        r.commit(1).unwrap();
        if n > 1 {
            let r = c.read_chunk(n - 1).unwrap();
            for v in r.iter() {
                expect(&mut next, v);
            }
            assert_eq!(r.commit_all(), n - 1);
        }
    }
    producer.join().unwrap();
    assert_eq!(c.available().unwrap(), 0, "nothing extra");
}

/// The correct ring, for passing to the scenarios.
pub fn correct_ring(capacity: usize) -> Pair {
    shmhca_rings::ring::heap_ring(capacity).unwrap()
}
