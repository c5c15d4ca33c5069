//! Timed runs (`-D`) that cannot measure anything end with an error that says why, not
//! with "0 iterations, 0.00 MiB/s" and exit code 0 (issue 24: a debug build printed that
//! after 21-31 s of `write_bw -s 8388608 -b -D 5 -q 3`).
//!
//! The runs here are sized by volume, not by the machine's speed: 1024 requests of 64 MiB
//! per completion are 64 GiB of copying before the first completion can come, which no
//! machine does within the 2 s the window needs (it would take 32 GB/s). Filling 64 MiB
//! with the data pattern takes a debug build on a loaded machine more than the default 10 s
//! of `--idle-timeout`, during which its peer hears nothing: the runs wait up to 100 s.

use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

mod common;

use common::{EXE, text};

static SERIAL: Mutex<()> = Mutex::new(());

/// Runs shmhca-perf with `args` in a private temp dir; kills it (and fails) after 120 s.
fn run(name: &str, args: &[&str]) -> Output {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("spd-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut child = Command::new(EXE)
        .args(args)
        .current_dir(&dir)
        .env("TMPDIR", &dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting shmhca-perf");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            let _ = std::fs::remove_dir_all(&dir);
            panic!(
                "shmhca-perf {args:?} did not end within 120 s\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    out
}

/// Asserts the run failed for lack of a measurement, with the message that says why and
/// what to do, and printed no table row.
fn nothing_measured(o: &Output, window: &str) {
    let all = text(o);
    assert_eq!(o.status.code(), Some(1), "{all}");
    let err = String::from_utf8_lossy(&o.stderr);
    for needle in [
        "nothing measured",
        &format!("no request completed between {window} after the start"),
        "lower -s, -t or -Q, lengthen -D, or use a release build",
    ] {
        assert!(err.contains(needle), "{needle:?} missing in\n{all}");
    }
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        !stdout
            .lines()
            .any(|l| l.trim_start().starts_with("67108864")),
        "a row was printed for a run that measured nothing\n{all}"
    );
}

#[test]
fn a_duration_run_whose_window_sees_no_completion_fails_and_says_why() {
    let o = run(
        "empty",
        &[
            "write_bw",
            "-s",
            "67108864",
            "-t",
            "1024",
            "-Q",
            "1024",
            "-D",
            "3",
            "-f",
            "1",
            "--idle-timeout",
            "100",
        ],
    );
    nothing_measured(&o, "1 s and 2 s");
}

/// -b: both sides run timed; the client's error is the same.
#[test]
fn a_bidirectional_duration_run_that_measures_nothing_fails_too() {
    let o = run(
        "empty-b",
        &[
            "write_bw",
            "-s",
            "67108864",
            "-t",
            "1024",
            "-Q",
            "1024",
            "-D",
            "3",
            "-f",
            "1",
            "--idle-timeout",
            "100",
            "-b",
        ],
    );
    nothing_measured(&o, "1 s and 2 s");
}
