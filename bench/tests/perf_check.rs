//! `shmhca-perf --check` on all eight tests, without and with injected faults (both ends
//! inject: the self-spawned peer takes the same flags), and a run whose check must fail.

use std::process::{Command, Output, Stdio};
use std::sync::Mutex;

/// Each run keeps two processes busy: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

mod common;

use common::{EXE, FAULTS, TESTS, text};

fn run(args: &[&str]) -> Output {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("spc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    Command::new(EXE)
        .args(args)
        .args(["-n", "300", "--check"])
        .current_dir(&dir)
        .env("TMPDIR", &dir)
        .stdin(Stdio::null())
        .output()
        .expect("running shmhca-perf")
}

#[test]
fn check_passes_on_all_eight_tests_without_faults() {
    for t in TESTS {
        let o = run(t);
        assert!(o.status.success(), "{t:?}: {}", text(&o));
        assert!(!text(&o).contains("faults (this side)"), "{t:?}");
    }
}

#[test]
fn check_passes_on_all_eight_tests_under_faults() {
    for t in TESTS {
        let args: Vec<&str> = t.iter().chain(FAULTS).copied().collect();
        let o = run(&args);
        let out = text(&o);
        assert!(o.status.success(), "{t:?}: {out}");
        let line = out
            .lines()
            .find(|l| l.contains("faults (this side)"))
            .unwrap_or_else(|| panic!("{t:?}: no fault report line: {out}"));
        assert!(!line.contains(" 0 dropped"), "{t:?}: {line}");
    }
}

/// The check is not vacuous: told to expect another pattern, the client fails, naming
/// the test, the iteration and the offset.
#[test]
fn check_catches_a_wrong_byte() {
    for (t, want) in [
        (
            &["send_lat", "-s", "64"][..],
            "send_lat: iteration 0: the server's answer: byte at offset 0",
        ),
        (
            &["read_lat", "-s", "64"][..],
            "read_lat: iteration 0: RDMA Read data: byte at offset 0",
        ),
        (
            &["atomic_lat"][..],
            "atomic_lat: iteration 0: the Atomic returned 0, expected 1",
        ),
        (&["read_bw", "-s", "64"][..], "first at offset 0 of 64"),
    ] {
        let args: Vec<&str> = t.iter().copied().chain(["--check-expect-wrong"]).collect();
        let o = run(&args);
        let out = text(&o);
        assert!(!o.status.success(), "{t:?} passed: {out}");
        assert!(out.contains(want), "{t:?}: {out}");
    }
}

#[test]
fn bad_fault_rates_are_refused() {
    let o = run(&["send_lat", "--drop", "1.5"]);
    let out = text(&o);
    assert!(!o.status.success());
    assert!(out.contains("drop rate is 1.5"), "{out}");
}
