//! The measurement loops allocate nothing per iteration: a run of many iterations makes
//! (almost) exactly as many heap allocations as a run of few, for every test.
//!
//! A counting global allocator sees every allocation of this test process; each test runs
//! `shmhca-perf --in-process` (client and server threads, both engines in this process)
//! twice, with few and with many iterations, and compares the counts. Set-up, reporting and
//! tear-down cost the same in both runs; anything done per message (a `String` built for
//! an error message that never happens, a `Vec` per batch) shows up as thousands of extra
//! allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use shmhca_bench::perf::opts::Options;

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours, passed through.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours, passed through.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours, passed through.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// One run at a time: the counter is process-wide.
static SERIAL: Mutex<()> = Mutex::new(());

/// Allocations made by one in-process run of `test` with `iters` iterations.
fn allocations(test: &str, extra: &[&str], iters: u64) -> u64 {
    let n = iters.to_string();
    let mut args = vec![
        "shmhca-perf",
        test,
        "--in-process",
        "-n",
        &n,
        "--warmup",
        "10",
        "--progress-after",
        "3600",
    ];
    args.extend_from_slice(extra);
    let opts =
        Options::parse_from(args.iter().copied()).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    shmhca_bench::perf::run::run(&opts).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    ALLOCATIONS.load(Ordering::Relaxed) - before
}

/// Runs `test` with 200 and with 5,200 iterations: 5,000 more must not cost even one
/// allocation per 50 of them.
fn check(test: &str, extra: &[&str]) {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let few = allocations(test, extra, 200);
    let many = allocations(test, extra, 5_200);
    assert!(
        many <= few + 100,
        "{test} {extra:?}: {few} allocations for 200 iterations but {many} for 5,200: \
         the loop allocates per iteration"
    );
}

#[test]
fn send_lat() {
    check("send_lat", &["-s", "8"]);
}

#[test]
fn send_lat_above_inline() {
    check("send_lat", &["-s", "4096"]);
}

#[test]
fn write_lat() {
    check("write_lat", &["-s", "8"]);
}

#[test]
fn read_lat() {
    check("read_lat", &["-s", "64"]);
}

#[test]
fn atomic_lat() {
    check("atomic_lat", &[]);
}

#[test]
fn send_bw() {
    check("send_bw", &["-s", "8"]);
}

#[test]
fn write_bw() {
    check("write_bw", &["-s", "4096"]);
}

#[test]
fn read_bw() {
    check("read_bw", &["-s", "4096"]);
}

#[test]
fn atomic_bw() {
    check("atomic_bw", &[]);
}
