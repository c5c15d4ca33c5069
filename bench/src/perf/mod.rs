//! `shmhca-perf`: perftest's eight RC tests (send/write/read/atomic, latency and bandwidth)
//! over shmhca, with perftest's flags and table layouts.
//!
//! ```text
//! shmhca-perf send_lat -s 8 -n 100000          # starts its own peer process
//! shmhca-perf write_bw -s 65536 --json out.json
//! shmhca-perf read_lat --server /tmp/perf.sock # terminal 1
//! shmhca-perf read_lat --client /tmp/perf.sock # terminal 2
//! ```
//!
//! The pieces: [`opts`] (command line and its checks), [`params`] (what both sides agree on,
//! exchanged as connection private data), [`setup`] (contexts, memory, QPs and connections),
//! [`control`] (the in-band control channel: barriers and end-of-run status), [`lat`] and
//! [`bw`] (the measurement loops), [`stats`] and [`report`] (perftest's tables, `--json`,
//! `--hgrm`), [`check`] (the data pattern and each size's verdicts), [`sequence`] (the
//! per-size barriers, warm-up and measurement), [`output`] (what the client prints and
//! writes), [`process`] (the self-spawned peer and clean-up on every path), [`placement`]
//! (which core each thread gets, and the warning when spinning threads outnumber cores),
//! [`roce`] (`--roce`: the two sides on two hosts, set up over a TCP exchange), [`pulse`]
//! (`--roce`'s TCP connection kept open as the peer's pulse: its early close says the
//! peer's process ended, and ends this side's waits at once), [`run`] (the program and its
//! roles).

pub mod bw;
pub mod check;
pub mod control;
pub mod error;
pub mod idle;
pub mod lat;
pub mod opts;
pub mod output;
pub mod params;
pub mod placement;
pub mod process;
pub mod pulse;
pub mod report;
pub mod roce;
pub mod run;
pub mod sequence;
pub mod setup;
pub mod stats;

pub use error::PerfError;
pub use run::main;

#[cfg(test)]
mod failure_tests;
