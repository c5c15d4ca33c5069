//! In-process ring throughput: this ring (heap and shared-memory storage) against rtrb, for
//! 16-, 64- and 256-byte slots, one element at a time and in bursts of 32.
//!
//! ```text
//! cargo bench -p shmhca-bench --bench rings
//! ```
//!
//! Each iteration pushes then pops (single) or pushes 32 then pops 32 (burst) on one thread,
//! so the figures measure the cost of the ring operations themselves (index bookkeeping,
//! validation, copies), not cache-line transfer between cores; the ping-pong bench measures
//! that.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use shmhca_rings::Pod;
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

fn benches(c: &mut Criterion) {
    single::<[u64; 2]>(c, 16);
    single::<[u64; 8]>(c, 64);
    single::<[u64; 32]>(c, 256);
    burst::<[u64; 2]>(c, 16);
    burst::<[u64; 8]>(c, 64);
    burst::<[u64; 32]>(c, 256);
}

criterion_group!(rings, benches);
criterion_main!(rings);
