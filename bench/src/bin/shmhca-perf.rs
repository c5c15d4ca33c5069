//! `shmhca-perf`: perftest's latency and bandwidth tests over shmhca.
//!
//! ```text
//! shmhca-perf send_lat -s 8 -n 100000
//! shmhca-perf write_bw -s 65536 --json write_bw.json
//! shmhca-perf --help
//! ```
//!
//! See [`shmhca_bench::perf`] for what each test does and how it is measured.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    shmhca_bench::perf::main()
}
