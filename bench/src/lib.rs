//! shmhca-bench: `shmhca-perf`, perftest's latency and bandwidth tools for shmhca, and the
//! criterion micro-benchmarks in `benches/`.
//!
//! The library holds everything `shmhca-perf` is made of ([`perf`]); the binary
//! `src/bin/shmhca-perf.rs` only calls [`perf::main`]. [`plot`] draws runs as SVG (for
//! `shmhca-perf --svg` and `shmhca plot`).
#![forbid(unsafe_code)]

pub mod perf;
pub mod plot;
pub mod soak;
