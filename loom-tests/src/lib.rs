//! Models of shmhca's lock-free hand-offs, run under [loom] with
//! `RUSTFLAGS="--cfg shmhca_loom" cargo test -p shmhca-loom-tests --release`.
//!
//! Each scenario is an ordinary function that starts a producer thread and consumes on the
//! calling thread. [`check`] runs it under loom's model checker when the crate is built
//! with `--cfg shmhca_loom` (every interleaving up to [`DEFAULT_MAX_PREEMPTIONS`]
//! preemptions, or `LOOM_MAX_PREEMPTIONS` if set), and otherwise as a plain std-thread
//! stress test repeated [`STRESS_RUNS`] times, so `cargo test --workspace` still runs it.
//!
//! The ring scenarios assert that each value arrives exactly once and in order, and that
//! the ring ends empty. Under loom the slots are loom `UnsafeCell`s, so a missing
//! happens-before edge between a slot write and its read shows up as a causality
//! violation; `tests/ring.rs` proves it by running the scenarios on rings whose orderings
//! were deliberately weakened (`shmhca_rings::ring::Mutation`, compiled only under
//! `--cfg shmhca_loom`) and asserting that loom fails.
//!
//!
//! Beyond the ring: [`doorbell`] runs the engine's real [`Doorbell`] (no ring is lost, and
//! the work published before a ring is visible to the taker), and [`engine`] runs the
//! engine's own code (a context, its QPs and regions) for the hand-offs between the
//! application and the engine: the send queue's credit, in-flight counts, an error flush.
//!
//! [loom]: https://docs.rs/loom
#![deny(unsafe_code)]

pub mod engine;

use shmhca_rings::doorbell::Doorbell;
use shmhca_rings::ring::{Consumer, HeapStorage, Producer, PushError, ShmStorage, Storage};
use shmhca_rings::sync::{AtomicU64, Ordering};

#[cfg(shmhca_loom)]
use loom::{sync::Arc, thread};
#[cfg(not(shmhca_loom))]
use std::{sync::Arc, thread};

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

/// The producer and consumer of a shared-memory ring of `u32` (`ShmStorage`).
pub type ShmPair = (
    Producer<u32, ShmStorage<u32>>,
    Consumer<u32, ShmStorage<u32>>,
);

/// A maker of the rings a scenario runs on.
pub type MakeRing<S> = fn(usize) -> (Producer<u32, S>, Consumer<u32, S>);

/// A storage the ring scenarios run on: [`HeapStorage`] or [`ShmStorage`].
pub trait ModelStorage: Storage<u32> + Send + 'static {}
impl<S: Storage<u32> + Send + 'static> ModelStorage for S {}

/// Runs `scenario` under loom (with `--cfg shmhca_loom`) or as a repeated stress test.
pub fn check(scenario: impl Fn() + Send + Sync + 'static) {
    #[cfg(shmhca_loom)]
    {
        let mut builder = loom::model::Builder::new();
        if builder.preemption_bound.is_none() {
            builder.preemption_bound = Some(DEFAULT_MAX_PREEMPTIONS);
        }
        // The engine models take many more steps per execution than the ring models.
        builder.max_branches = builder.max_branches.max(MAX_BRANCHES);
        builder.check(scenario);
    }
    #[cfg(not(shmhca_loom))]
    for _ in 0..STRESS_RUNS {
        scenario();
    }
}

/// Branches (scheduling decisions) one execution of a model may take: an engine poll
/// iteration is a few dozen atomic operations.
pub const MAX_BRANCHES: usize = 200_000;

/// Runs `model` under loom and asserts that it fails with a message containing `want`.
#[cfg(shmhca_loom)]
pub fn assert_loom_catches(what: &str, want: &str, model: impl Fn() + Send + Sync + 'static) {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(model)));
    let payload = result.expect_err(&format!("loom did not catch the bug: {what}"));
    let message = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(
        message.contains(want),
        "{what}: loom failed, but not with \"{want}\": {message}"
    );
    eprintln!("{what}: loom reported: {message}");
}

/// Runs `model` with the ordering at mutation point `point` weakened (see
/// `shmhca_rings::sync::mutation`), asserts that loom fails it with a message containing
/// `want`, and that the weakened line ran: the proof that a model can fail.
#[cfg(shmhca_loom)]
pub fn assert_mutation_caught(point: &'static str, want: &str, model: fn()) {
    let ((), hits) =
        shmhca_rings::sync::mutation::run(point, || assert_loom_catches(point, want, model));
    assert!(hits > 0, "{point}: the weakened line never ran");
}

fn push_one<S: ModelStorage>(p: &mut Producer<u32, S>, mut value: u32) {
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
pub fn single<S: ModelStorage>(make: MakeRing<S>, capacity: usize, count: u32) {
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
pub fn bursts<S: ModelStorage>(
    make: MakeRing<S>,
    capacity: usize,
    bursts: &'static [usize],
    out_len: usize,
) {
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
pub fn chunks<S: ModelStorage>(make: MakeRing<S>, capacity: usize, count: u32, chunk: usize) {
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

/// A ring in shared memory, as the engine's links use them: a memfd segment, the ring
/// initialised at offset 0 with `init_shm_ring` and both ends attached with
/// `shm_producer`/`shm_consumer`. Under loom the segment is the real one; only its two
/// index words and one tracking cell per slot are loom objects (see `ShmStorage`).
pub fn shm_ring(capacity: usize) -> ShmPair {
    use shmhca_rings::ring::{init_shm_ring, shm_consumer, shm_producer, shm_ring_bytes};
    use shmhca_rings::segment::{HugePages, Segment};
    let bytes = shm_ring_bytes::<u32>(capacity).unwrap();
    let seg = std::sync::Arc::new(
        Segment::builder(0x5348_4d52, bytes)
            .huge_pages(HugePages::Never)
            .create()
            .unwrap(),
    );
    init_shm_ring::<u32>(&seg, 0, capacity).unwrap();
    let p = shm_producer(std::sync::Arc::clone(&seg), 0).unwrap();
    let c = shm_consumer(seg, 0).unwrap();
    (p, c)
}

/// Queues of the doorbell models (two words of 64, so rings cross a word boundary).
const DOORBELL_QUEUES: usize = 128;

/// The correct doorbell, for passing to [`doorbell`].
pub fn correct_doorbell() -> Doorbell {
    Doorbell::new(DOORBELL_QUEUES)
}

/// The engine's doorbell between posting threads and the poll loop. Each poster, for each
/// queue in its list (every queue in one list only), publishes the queue's work — a
/// Relaxed store, so that only the doorbell's own ordering can make it visible — then
/// rings it. The calling thread takes twice while the posters run, and once more after
/// they are done. Every queue must be reported exactly once, and its work must be
/// visible when it is reported.
pub fn doorbell(make: fn() -> Doorbell, posters: &'static [&'static [u32]]) {
    let bell = Arc::new(make());
    let work: Arc<Vec<AtomicU64>> =
        Arc::new((0..DOORBELL_QUEUES).map(|_| AtomicU64::new(0)).collect());
    let threads: Vec<_> = posters
        .iter()
        .map(|&queues| {
            let (bell, work) = (Arc::clone(&bell), Arc::clone(&work));
            thread::spawn(move || {
                for &q in queues {
                    work[q as usize].store(u64::from(q) + 1, Ordering::Relaxed);
                    bell.ring(q);
                }
            })
        })
        .collect();
    let mut seen = [false; DOORBELL_QUEUES];
    let mut report = |q: u32| {
        assert!(!seen[q as usize], "queue {q} reported twice");
        seen[q as usize] = true;
        assert_eq!(
            work[q as usize].load(Ordering::Relaxed),
            u64::from(q) + 1,
            "queue {q} was reported but its work is not visible"
        );
    };
    for _ in 0..2 {
        bell.take(&mut report);
        thread::yield_now();
    }
    for t in threads {
        t.join().unwrap();
    }
    bell.take(&mut report);
    let rung: usize = posters.iter().map(|p| p.len()).sum();
    assert_eq!(seen.iter().filter(|s| **s).count(), rung, "a ring was lost");
}

/// A watched queue ([`Doorbell::watch`]) while the taker stops watching it: the poster
/// publishes the queue's work (Relaxed) and calls [`Doorbell::ring_unless_watched`]; the
/// taker unwatches, runs its process-wide barrier (a SeqCst fence here: loom cannot model
/// `membarrier`) and looks at the work once more. The work must not be lost: the taker's
/// last look finds it, or the poster rang (and the next take reports it).
pub fn doorbell_watch(make: fn() -> Doorbell) {
    let bell = Arc::new(make());
    let work = Arc::new(AtomicU64::new(0));
    bell.watch(0);
    let poster = {
        let (bell, work) = (Arc::clone(&bell), Arc::clone(&work));
        thread::spawn(move || {
            work.store(1, Ordering::Relaxed);
            bell.ring_unless_watched(0);
        })
    };
    bell.unwatch(0);
    #[cfg(shmhca_loom)]
    loom::sync::atomic::fence(Ordering::SeqCst);
    #[cfg(not(shmhca_loom))]
    std::sync::atomic::fence(Ordering::SeqCst);
    let found = work.load(Ordering::Relaxed) == 1;
    poster.join().unwrap();
    let mut rung = false;
    bell.take(|q| rung |= q == 0);
    assert!(found || rung, "a post to a queue being unwatched was lost");
}
