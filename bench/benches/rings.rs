//! In-process ring throughput: this ring (heap and shared-memory storage) against rtrb, for
//! 16-, 64- and 256-byte slots, one element at a time and in bursts of 32; and the line ring
//! (`shmhca_rings::lines`, shared memory) against the slot ring for one packet: a 1-line
//! frame against a 64- and a 128-byte slot (the engine's `PacketSlot`), a 4-line frame
//! against a 256-byte slot, singly and in bursts of 32 (groups `lines_*`).
//!
//! `lines_pingpong_rtt` is the one group with two threads (not pinned: on a shared host a
//! pinned thread can land on a core another process holds): a round trip of one packet each way, the line ring (a 1-line frame:
//! the receiver polls the line the packet lands in) against the slot ring (64- and 128-byte
//! slots: the receiver polls the tail index, then reads the slot), so it measures cache-line
//! transfers, not only instructions. Both sides poll with a spin-loop hint between looks.
//!
//! ```text
//! cargo bench -p shmhca-bench --bench rings
//! cargo bench -p shmhca-bench --bench rings -- lines_
//! ```
//!
//! Each iteration pushes then pops (single) or pushes 32 then pops 32 (burst) on one thread,
//! so the figures measure the cost of the ring operations themselves (index bookkeeping,
//! validation, copies), not cache-line transfer between cores; the ping-pong bench measures
//! that.

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use shmhca_rings::Pod;
use shmhca_rings::lines::{self, Line, MAX_FRAME_LINES};
use shmhca_rings::ring;
use shmhca_rings::segment::{HugePages, Segment};

const CAPACITY: usize = 1024;
const BURST: usize = 32;

fn shm_ring<T: Pod>() -> (
    ring::Producer<T, ring::ShmStorage<T>>,
    ring::Consumer<T, ring::ShmStorage<T>>,
) {
    let seg = Arc::new(
        Segment::builder(0xbe7c, ring::shm_ring_bytes::<T>(CAPACITY).unwrap())
            .huge_pages(HugePages::Auto)
            .create()
            .unwrap(),
    );
    ring::init_shm_ring::<T>(&seg, 0, CAPACITY).unwrap();
    (
        ring::shm_producer::<T>(Arc::clone(&seg), 0).unwrap(),
        ring::shm_consumer::<T>(seg, 0).unwrap(),
    )
}

fn value<T: Pod>(i: u64) -> T {
    let mut v = T::zeroed();
    bytemuck::bytes_of_mut(&mut v)[..8].copy_from_slice(&i.to_ne_bytes());
    v
}

fn single<T: Pod + Default + Send>(c: &mut Criterion, size: usize) {
    let mut group = c.benchmark_group(format!("single_{size}B"));
    group.throughput(Throughput::Elements(1));
    let v: T = value(7);

    let (mut p, mut q) = ring::heap_ring::<T>(CAPACITY).unwrap();
    group.bench_function(BenchmarkId::new("shmhca_heap", size), |b| {
        b.iter(|| {
            p.push(black_box(v)).unwrap();
            black_box(q.pop().unwrap())
        })
    });
    let (mut p, mut q) = shm_ring::<T>();
    group.bench_function(BenchmarkId::new("shmhca_shm", size), |b| {
        b.iter(|| {
            p.push(black_box(v)).unwrap();
            black_box(q.pop().unwrap())
        })
    });
    let (mut p, mut q) = rtrb::RingBuffer::<T>::new(CAPACITY);
    group.bench_function(BenchmarkId::new("rtrb", size), |b| {
        b.iter(|| {
            p.push(black_box(v)).unwrap();
            black_box(q.pop().unwrap())
        })
    });
    group.finish();
}

fn burst<T: Pod + Default + Send>(c: &mut Criterion, size: usize) {
    let mut group = c.benchmark_group(format!("burst32_{size}B"));
    group.throughput(Throughput::Elements(BURST as u64));
    let input: Vec<T> = (0..BURST as u64).map(value).collect();
    let mut out = vec![T::zeroed(); BURST];

    let (mut p, mut q) = ring::heap_ring::<T>(CAPACITY).unwrap();
    group.bench_function(BenchmarkId::new("shmhca_heap", size), |b| {
        b.iter(|| {
            assert_eq!(p.push_burst(black_box(&input)).unwrap(), BURST);
            assert_eq!(q.pop_burst(black_box(&mut out)).unwrap(), BURST);
        })
    });
    let (mut p, mut q) = shm_ring::<T>();
    group.bench_function(BenchmarkId::new("shmhca_shm", size), |b| {
        b.iter(|| {
            assert_eq!(p.push_burst(black_box(&input)).unwrap(), BURST);
            assert_eq!(q.pop_burst(black_box(&mut out)).unwrap(), BURST);
        })
    });
    let (mut p, mut q) = rtrb::RingBuffer::<T>::new(CAPACITY);
    group.bench_function(BenchmarkId::new("rtrb_chunk", size), |b| {
        b.iter(|| {
            let chunk = p.write_chunk_uninit(BURST).unwrap();
            assert_eq!(
                chunk.fill_from_iter(black_box(&input).iter().copied()),
                BURST
            );
            let chunk = q.read_chunk(BURST).unwrap();
            let (first, second) = chunk.as_slices();
            out[..first.len()].copy_from_slice(first);
            out[first.len()..].copy_from_slice(second);
            chunk.commit_all();
            black_box(&mut out);
        })
    });
    group.finish();
}

fn shm_lines() -> (
    lines::LinesProducer<lines::ShmLines>,
    lines::LinesConsumer<lines::ShmLines>,
) {
    let seg = Arc::new(
        Segment::builder(0xbe7d, lines::shm_lines_bytes(CAPACITY).unwrap())
            .huge_pages(HugePages::Auto)
            .create()
            .unwrap(),
    );
    lines::init_shm_lines(&seg, 0, CAPACITY).unwrap();
    (
        lines::shm_lines_producer(Arc::clone(&seg), 0).unwrap(),
        lines::shm_lines_consumer(seg, 0).unwrap(),
    )
}

/// Sends one frame of `frame.len()` lines and receives it.
#[inline(always)]
fn line_round_trip(
    p: &mut lines::LinesProducer<lines::ShmLines>,
    q: &mut lines::LinesConsumer<lines::ShmLines>,
    frame: &[Line],
    out: &mut [Line; MAX_FRAME_LINES],
) -> usize {
    let mut f = p.reserve(frame.len()).unwrap().unwrap();
    for (i, line) in frame.iter().enumerate() {
        f.write_line(i, line).unwrap();
    }
    f.commit();
    q.recv(out).unwrap().unwrap()
}

/// One packet through the line ring (a frame of `LINES` lines) against one slot of the
/// same size (and, for one line, the engine's 128-byte slot) through the slot ring.
fn lines_single<const LINES: usize, T: Pod + Default + Send>(c: &mut Criterion, slot: usize) {
    let mut group = c.benchmark_group(format!("lines_single_{}B_vs_slot_{slot}B", LINES * 64));
    group.throughput(Throughput::Elements(1));
    let frame = [Line([7; 64]); LINES];
    let mut out = [Line::ZERO; MAX_FRAME_LINES];
    let (mut p, mut q) = shm_lines();
    group.bench_function(BenchmarkId::new("lines_shm", LINES), |b| {
        b.iter(|| black_box(line_round_trip(&mut p, &mut q, black_box(&frame), &mut out)))
    });
    let v: T = value(7);
    let (mut p, mut q) = shm_ring::<T>();
    group.bench_function(BenchmarkId::new("slot_ring_shm", slot), |b| {
        b.iter(|| {
            p.push(black_box(v)).unwrap();
            black_box(q.pop().unwrap())
        })
    });
    group.finish();
}

/// 32 one-line frames sent, then received, against bursts of 32 slots of 64 and 128 bytes.
fn lines_burst(c: &mut Criterion) {
    let mut group = c.benchmark_group("lines_burst32_64B");
    group.throughput(Throughput::Elements(BURST as u64));
    let line = Line([7; 64]);
    let mut out = [Line::ZERO; MAX_FRAME_LINES];
    let (mut p, mut q) = shm_lines();
    group.bench_function(BenchmarkId::new("lines_shm", 1), |b| {
        b.iter(|| {
            for _ in 0..BURST {
                let mut f = p.reserve(1).unwrap().unwrap();
                f.write_line(0, black_box(&line)).unwrap();
                f.commit();
            }
            for _ in 0..BURST {
                assert_eq!(q.recv(black_box(&mut out)).unwrap(), Some(1));
            }
        })
    });
    fn slots<T: Pod>(
        group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        size: usize,
    ) {
        let input: Vec<T> = (0..BURST as u64).map(value).collect();
        let mut out = vec![T::zeroed(); BURST];
        let (mut p, mut q) = shm_ring::<T>();
        group.bench_function(BenchmarkId::new("slot_ring_shm", size), |b| {
            b.iter(|| {
                assert_eq!(p.push_burst(black_box(&input)).unwrap(), BURST);
                assert_eq!(q.pop_burst(black_box(&mut out)).unwrap(), BURST);
            })
        });
    }
    slots::<[u64; 8]>(&mut group, 64);
    slots::<[u64; 16]>(&mut group, 128);
    group.finish();
}

/// Runs `echo` on a second thread until `body` returns; `echo` gets a stop flag to poll
/// while idle.
fn with_echo<E, B>(echo: E, body: B)
where
    E: FnOnce(&AtomicBool) + Send + 'static,
    B: FnOnce(),
{
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    let echo = std::thread::spawn(move || echo(&flag));
    body();
    stop.store(true, Ordering::Relaxed);
    echo.join().unwrap();
}

/// Round trips of one packet through a pair of line rings (1-line frames) or slot rings,
/// between two threads.
fn pingpong(c: &mut Criterion) {
    let mut group = c.benchmark_group("lines_pingpong_rtt");
    group.throughput(Throughput::Elements(1));
    group.measurement_time(Duration::from_secs(3));

    let ((mut ping_tx, mut ping_rx), (mut pong_tx, mut pong_rx)) = (shm_lines(), shm_lines());
    with_echo(
        move |stop| {
            let mut out = [Line::ZERO; MAX_FRAME_LINES];
            while !stop.load(Ordering::Relaxed) {
                match ping_rx.recv(&mut out).unwrap() {
                    Some(n) => while line_round_trip_send(&mut pong_tx, &out[..n]).is_none() {},
                    None => std::hint::spin_loop(),
                }
            }
        },
        || {
            let line = [Line([7; 64])];
            let mut out = [Line::ZERO; MAX_FRAME_LINES];
            group.bench_function(BenchmarkId::new("lines_shm", 64), |b| {
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    for _ in 0..iters {
                        line_round_trip_send(&mut ping_tx, &line).unwrap();
                        while pong_rx.recv(&mut out).unwrap().is_none() {
                            std::hint::spin_loop();
                        }
                    }
                    start.elapsed()
                })
            });
        },
    );

    fn slots<T: Pod + Send>(
        group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        size: usize,
    ) {
        let ((mut ping_tx, mut ping_rx), (mut pong_tx, mut pong_rx)) =
            (shm_ring::<T>(), shm_ring::<T>());
        with_echo(
            move |stop| {
                while !stop.load(Ordering::Relaxed) {
                    match ping_rx.pop().unwrap() {
                        Some(v) => while pong_tx.push(v).is_err() {},
                        None => std::hint::spin_loop(),
                    }
                }
            },
            || {
                let v: T = value(7);
                group.bench_function(BenchmarkId::new("slot_ring_shm", size), |b| {
                    b.iter_custom(|iters| {
                        let start = Instant::now();
                        for _ in 0..iters {
                            ping_tx.push(black_box(v)).unwrap();
                            while pong_rx.pop().unwrap().is_none() {
                                std::hint::spin_loop();
                            }
                        }
                        start.elapsed()
                    })
                });
            },
        );
    }
    slots::<[u64; 8]>(&mut group, 64);
    slots::<[u64; 16]>(&mut group, 128);
    group.finish();
}

/// Sends one frame; `None` if there is no room.
#[inline(always)]
fn line_round_trip_send(
    p: &mut lines::LinesProducer<lines::ShmLines>,
    frame: &[Line],
) -> Option<()> {
    let mut f = p.reserve(frame.len()).unwrap()?;
    f.write_lines(frame).unwrap();
    f.commit();
    Some(())
}

fn benches(c: &mut Criterion) {
    pingpong(c);
    lines_single::<1, [u64; 8]>(c, 64);
    lines_single::<1, [u64; 16]>(c, 128);
    lines_single::<4, [u64; 32]>(c, 256);
    lines_burst(c);
    single::<[u64; 2]>(c, 16);
    single::<[u64; 8]>(c, 64);
    single::<[u64; 32]>(c, 256);
    burst::<[u64; 2]>(c, 16);
    burst::<[u64; 8]>(c, 64);
    burst::<[u64; 32]>(c, 256);
}

criterion_group!(rings, benches);
criterion_main!(rings);
