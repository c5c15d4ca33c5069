//! shmhca-bench: `shmhca-perf`, perftest's latency and bandwidth tools for shmhca, and the
//! criterion micro-benchmarks in `benches/`.
//!
//! The library holds everything `shmhca-perf` is made of ([`perf`]); the binary
//! `src/bin/shmhca-perf.rs` only calls [`perf::main`].
#![forbid(unsafe_code)]

pub mod perf;
