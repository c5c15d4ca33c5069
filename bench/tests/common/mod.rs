//! What the tests that run `shmhca-perf` share: the binary and a private directory per test.

// Each test crate uses what it needs of this module.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Output;
use std::sync::atomic::{AtomicU32, Ordering};

/// The `shmhca-perf` binary cargo built for these tests.
pub(crate) const EXE: &str = env!("CARGO_BIN_EXE_shmhca-perf");

/// The eight tests, each with a size that takes several packets (the atomics' is fixed).
pub(crate) const TESTS: [&[&str]; 8] = [
    &["send_lat", "-s", "3000"],
    &["write_lat", "-s", "3000"],
    &["read_lat", "-s", "3000"],
    &["atomic_lat"],
    &["send_bw", "-s", "3000"],
    &["write_bw", "-s", "3000"],
    &["read_bw", "-s", "3000"],
    &["atomic_bw"],
];

/// 2% of each fault: a few dozen of each in a short run. `-u 16`: a 268 ms transport
/// timer — short enough for a short run, long enough that on a loaded machine an inline
/// engine's process left unscheduled for a while does not exhaust the Retry Count (a live
/// process then acknowledges nothing: issue 9's automatic progress is the real fix).
pub(crate) const FAULTS: &[&str] = &[
    "--drop",
    "0.02",
    "--dup",
    "0.02",
    "--reorder",
    "0.02",
    "--corrupt",
    "0.01",
    "--delay",
    "0.01",
    "--seed",
    "9",
    "-u",
    "16",
];

/// A finished run's status and output, for an assertion's message.
pub(crate) fn text(o: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A private directory for one test (its runs' working directory and `TMPDIR`), removed
/// with everything in it when the test ends.
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Scratch {
    /// A new empty directory named after `name`, this process and a counter. Short: the
    /// socket paths made inside must stay under 108 bytes.
    pub(crate) fn new(name: &str) -> Scratch {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("spt-{name}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }

    /// `name` inside the directory.
    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Entries shmhca-perf made in the directory (its temp dirs and sockets).
    pub(crate) fn leftovers(&self) -> Vec<String> {
        std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("shmhca-perf-") || n.ends_with(".sock"))
            .collect()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
