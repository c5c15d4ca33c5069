//! Spinning threads and cores in `shmhca-perf` (issue 24, item 9): a run whose spinning
//! threads outnumber the cores it may use says so in one line with what to do, a run where
//! nothing spins says nothing, and a poll-mode engine thread no longer inherits its
//! application thread's core.
//!
//! The runs restrict themselves to two cores (`--pin_cores 0,1`), so what they check does
//! not depend on the machine's size; they need a machine with two cores at least and skip
//! with one line on a smaller one. They are short (a few dozen iterations: spinning
//! threads on two cores cost tens of milliseconds per round trip) and serialised.

mod common;
use common::{EXE, Scratch};

use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use shmhca_bench::perf::opts::ModeArg;
use shmhca_bench::perf::placement::{oversubscription, spinning_threads, usable_cores};

static SERIAL: Mutex<()> = Mutex::new(());

/// The line of the warning, as the runs below look for it.
const WARNING: &str = "threads spin (client and server";

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether this process may run on cores 0 and 1, which the runs pin themselves to; if
/// not, says so.
fn two_cores() -> bool {
    let ids: Vec<usize> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .collect();
    let ok = ids.contains(&0) && ids.contains(&1);
    if !ok {
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "perf_spin: skipped: the runs need cores 0 and 1, this process may use {ids:?}"
        );
    }
    ok
}

fn spawn(scratch: &Scratch, args: &[&str]) -> Child {
    Command::new(EXE)
        .args(args)
        .current_dir(&scratch.0)
        .env("TMPDIR", &scratch.0)
        .env_remove("SHMHCA_PCAP")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Runs shmhca-perf to its end (two minutes at most) and checks it succeeded.
fn run(scratch: &Scratch, args: &[&str]) -> Output {
    let mut child = spawn(scratch, args);
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("shmhca-perf {args:?} did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "shmhca-perf {args:?} failed ({})\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn spinning_threads_are_counted_for_both_sides() {
    assert_eq!(spinning_threads(ModeArg::Poll, false), 4);
    assert_eq!(spinning_threads(ModeArg::Inline, false), 2);
    assert_eq!(
        spinning_threads(ModeArg::Poll, true),
        0,
        "-e: nothing spins"
    );
    assert_eq!(spinning_threads(ModeArg::Inline, true), 0);
}

#[test]
fn pinned_threads_count_the_cores_they_are_pinned_to() {
    // Every spinning thread pinned: the distinct cores.
    assert_eq!(usable_cores(8, &[Some(0), Some(1), Some(0), Some(1)]), 2);
    assert_eq!(usable_cores(8, &[Some(0), Some(1), Some(2), Some(3)]), 4);
    assert_eq!(usable_cores(8, &[Some(3), Some(3)]), 1);
    // One left to the scheduler: the cores of the mask.
    assert_eq!(usable_cores(2, &[Some(0), Some(1), None, None]), 2);
    assert_eq!(usable_cores(16, &[Some(0), None]), 16);
    assert_eq!(usable_cores(3, &[]), 3);
}

#[test]
fn the_warning_appears_exactly_when_spinning_threads_outnumber_cores() {
    assert_eq!(oversubscription(ModeArg::Poll, 4, 4), None);
    assert_eq!(oversubscription(ModeArg::Inline, 2, 2), None);
    assert_eq!(oversubscription(ModeArg::Poll, 0, 1), None);
    let poll = oversubscription(ModeArg::Poll, 4, 2).expect("4 threads on 2 cores");
    assert!(
        poll.contains("4 threads spin") && poll.contains("2 core(s)"),
        "{poll}"
    );
    assert!(
        poll.contains("--mode inline") && poll.contains("-e"),
        "says what to do: {poll}"
    );
    let inline = oversubscription(ModeArg::Inline, 2, 1).expect("2 threads on 1 core");
    assert!(
        inline.contains("-e") && !inline.contains("--mode inline"),
        "{inline}"
    );
    assert!(
        !poll.contains('\n') && !inline.contains('\n'),
        "one line each"
    );
}

/// Four spinning threads pinned to two cores: `--engine-cpu` given (the note of the old
/// code skipped that case), and the two-terminal roles (which it never looked at).
#[test]
fn a_poll_mode_run_on_two_cores_warns_whatever_pins_it() {
    let _g = serial();
    if !two_cores() {
        return;
    }
    let s = Scratch::new("warn");
    let args = [
        "send_lat",
        "--mode",
        "poll",
        "--pin_cores",
        "0,1",
        "--engine-cpu",
        "0,1",
        "-n",
        "20",
        "--warmup",
        "0",
    ];
    let err = stderr(&run(&s, &args));
    assert_eq!(
        err.matches(WARNING).count(),
        1,
        "one warning, from the client only:\n{err}"
    );
    assert!(
        err.contains("4 threads spin") && err.contains("2 core(s)"),
        "{err}"
    );
    let args = [
        "send_lat",
        "--in-process",
        "--mode",
        "poll",
        "--pin_cores",
        "0,1",
        "-n",
        "20",
        "--warmup",
        "0",
    ];
    let err = stderr(&run(&s, &args));
    assert!(err.contains(WARNING), "--in-process:\n{err}");
}

/// Nothing spins with `-e`, and two application threads fit two cores: no warning (the old
/// note warned of busy threads with `-e` too).
#[test]
fn runs_whose_spinning_threads_fit_say_nothing() {
    let _g = serial();
    if !two_cores() {
        return;
    }
    let s = Scratch::new("quiet");
    for args in [
        &[
            "send_lat",
            "-e",
            "--mode",
            "poll",
            "--pin_cores",
            "0,1",
            "-n",
            "20",
        ][..],
        &[
            "send_lat",
            "--mode",
            "inline",
            "--pin_cores",
            "0,1",
            "-n",
            "20",
        ][..],
    ] {
        let err = stderr(&run(&s, args));
        assert!(
            !err.contains(WARNING) && !err.contains("busy threads"),
            "{args:?}:\n{err}"
        );
    }
}

/// The cores thread `name` of process `pid` may run on (`Cpus_allowed_list`), once it
/// exists and `done` accepts them (20 s at most; then the last seen, if any).
fn thread_cores(pid: u32, name: &str, done: impl Fn(&str) -> bool) -> Option<String> {
    let start = Instant::now();
    let mut seen = None;
    while start.elapsed() < Duration::from_secs(20) {
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
            for t in tasks.flatten() {
                let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
                if comm.trim() != name {
                    continue;
                }
                let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
                if let Some(l) = status.lines().find(|l| l.starts_with("Cpus_allowed_list:")) {
                    let cores = l["Cpus_allowed_list:".len()..].trim().to_string();
                    if done(&cores) {
                        return Some(cores);
                    }
                    seen = Some(cores);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    seen
}

/// With two cores and no `--engine-cpu`, the client's engine thread is left to the
/// scheduler on both cores; it used to inherit the pin of the application thread that
/// created it, so that the two spinning threads of a side shared one core.
#[test]
fn a_poll_mode_engine_thread_does_not_share_its_application_threads_pin() {
    let _g = serial();
    if !two_cores() {
        return;
    }
    let s = Scratch::new("pin");
    // Long enough to be looked at (it is stopped once it has been).
    let args = [
        "send_lat",
        "--mode",
        "poll",
        "--pin_cores",
        "0,1",
        "-n",
        "100000",
    ];
    let mut child = spawn(&s, &args);
    // The engine thread exists once the client built its context; then its application
    // thread is pinned to core 0.
    let pid = child.id();
    let created = thread_cores(pid, "shmhca-engine", |_| true);
    let app = thread_cores(pid, "shmhca-perf", |c| c == "0");
    let engine = thread_cores(pid, "shmhca-engine", |_| true);
    // SIGTERM: the client cleans up and its spawned server ends with it.
    let _ = Command::new("kill").arg(child.id().to_string()).status();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(created.is_some(), "no engine thread appeared in 20 s");
    assert_eq!(app.as_deref(), Some("0"), "the client's application thread");
    assert_eq!(
        engine.as_deref(),
        Some("0-1"),
        "the client's engine thread may run on both cores"
    );
}
