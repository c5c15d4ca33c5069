//! perftest's habits that `shmhca-perf` follows (issue 24, item 12): the server address as
//! the last positional argument, `--out_json` replacing an earlier report in looped
//! scripts, `-D` on latency tests, perftest's printed TX depth 1 of latency tests,
//! and refusal texts that say what is true (`-u` keeps its default of 18: see
//! `shmhca_bench::perf::opts::DEFAULT_QP_TIMEOUT`).
//!
//! Runs are short (a few hundred iterations, or `-D 2`) so that a debug build on a loaded
//! 2-core machine finishes them in seconds; they are serialised (each keeps two processes
//! busy) and use a private `TMPDIR` and working directory.

mod common;
use common::{EXE, Scratch};

use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

/// Runs shmhca-perf in `scratch` with `args`; kills it (and fails) after two minutes.
fn run(scratch: &Scratch, args: &[&str]) -> Output {
    let mut child = Command::new(EXE)
        .args(args)
        .current_dir(&scratch.0)
        .env("TMPDIR", &scratch.0)
        .env_remove("SHMHCA_PCAP")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "shmhca-perf {args:?} did not finish within 120 s\nstderr:\n{}",
                text(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Asserts success and returns stdout.
fn ok(out: &Output, args: &[&str]) -> String {
    assert!(
        out.status.success(),
        "shmhca-perf {args:?} failed ({})\nstdout:\n{}\nstderr:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Asserts a refusal and returns stderr.
fn refused(out: &Output, args: &[&str]) -> String {
    assert!(
        !out.status.success(),
        "shmhca-perf {args:?} should have been refused\nstdout:\n{}",
        text(&out.stdout)
    );
    text(&out.stderr)
}

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn the_server_address_is_taken_last_on_the_line_as_perftest() {
    let _g = serial();
    let s = Scratch::new("host");
    for host in ["localhost", "127.0.0.1", "::1"] {
        let args = ["send_lat", "-s", "8", "-n", "100", host];
        let out = ok(&run(&s, &args), &args);
        assert!(out.contains("t_typical"), "no latency table:\n{out}");
    }
    let args = ["send_lat", "-s", "8", "-n", "100", "192.0.2.7"];
    let err = refused(&run(&s, &args), &args);
    assert!(
        err.contains("HOST 192.0.2.7") && err.contains("localhost") && err.contains("--server"),
        "the refusal should name the host and say what to do:\n{err}"
    );
}

#[test]
fn out_json_replaces_an_earlier_report_but_no_other_file() {
    let _g = serial();
    let s = Scratch::new("outjson");
    let args = ["send_lat", "-n", "100", "--out_json"];
    ok(&run(&s, &args), &args);
    let report = s.path("perftest_out.json");
    let first = std::fs::read_to_string(&report).unwrap();
    // A looped script runs the same line again: perftest rewrites its file.
    let args2 = ["send_lat", "-s", "16", "-n", "100", "--out_json"];
    ok(&run(&s, &args2), &args2);
    let second = std::fs::read_to_string(&report).unwrap();
    assert_ne!(first, second, "the second run's report replaces the first");
    let doc: serde_json::Value = serde_json::from_str(&second).unwrap();
    assert_eq!(doc["test_info"]["test"], "Send_Latency_Test");
    // No temporary file is left beside it.
    let names: Vec<String> = std::fs::read_dir(&s.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("perftest_out"))
        .collect();
    assert_eq!(names, ["perftest_out.json"]);

    // Any other file is refused and left as it was: JSON that is not a report, and text.
    for (name, content) in [
        ("other.json", "{\"results\": 1, \"mine\": true}\n"),
        ("notes.txt", "my notes\n"),
    ] {
        let p = s.path(name);
        std::fs::write(&p, content).unwrap();
        let args = [
            "send_lat",
            "-n",
            "100",
            "--out_json",
            "--out_json_file",
            name,
        ];
        let err = refused(&run(&s, &args), &args);
        assert!(err.contains("exists"), "{err}");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), content);
    }
}

#[test]
fn latency_tests_take_d_as_perftest() {
    let _g = serial();
    let s = Scratch::new("latdur");
    // --check: every iteration carries its own pattern (marker for write_lat), so both
    // sides must number the steps' iterations alike.
    for test in ["send_lat", "write_lat", "read_lat"] {
        let args = [test, "-D", "2", "--check", "--json", "r.json", "--force"];
        let out = ok(&run(&s, &args), &args);
        assert!(
            !out.contains("BW peak"),
            "no bandwidth warning on a latency test:\n{out}"
        );
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(s.path("r.json")).unwrap()).unwrap();
        assert_eq!(doc["params"]["duration"]["seconds"], 2, "{}", doc["params"]);
        let iters = doc["results"][0]["iterations"].as_u64().unwrap_or(0);
        assert!(iters > 0, "a 2 s run measured iterations: {doc}");
    }
    // -D with -n is refused as for bandwidth tests.
    let args = ["send_lat", "-D", "2", "-n", "100"];
    let err = refused(&run(&s, &args), &args);
    assert!(err.contains("-n and -D"), "{err}");
}

#[test]
fn defaults_are_perftests_printed_parameters() {
    let _g = serial();
    let s = Scratch::new("defaults");
    let args = ["send_lat", "-n", "100", "--json", "r.json"];
    let out = ok(&run(&s, &args), &args);
    let depth = out
        .lines()
        .find(|l| l.trim_start().starts_with("TX depth"))
        .unwrap_or_else(|| panic!("no TX depth line:\n{out}"));
    assert!(depth.trim_end().ends_with(": 1"), "{depth}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(s.path("r.json")).unwrap()).unwrap();
    // -u stays 18, not perftest's 14: see DEFAULT_QP_TIMEOUT (67 ms is shorter than a
    // loaded machine stalls the peer process).
    assert_eq!(doc["params"]["qp_timeout"], 18, "{}", doc["params"]);
    assert_eq!(doc["params"]["tx_depth"], 1, "{}", doc["params"]);
    // Bandwidth tests keep perftest's 128.
    let args = ["write_bw", "-n", "100", "--json", "w.json"];
    ok(&run(&s, &args), &args);
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(s.path("w.json")).unwrap()).unwrap();
    assert_eq!(doc["params"]["tx_depth"], 128, "{}", doc["params"]);
}

#[test]
fn refusals_say_what_is_true() {
    let _g = serial();
    let s = Scratch::new("refuse");
    let args = ["send_bw", "--use-srq"];
    let err = refused(&run(&s, &args), &args);
    // shmhca has SRQs: the tool does not use one, the library does not lack them.
    assert!(!err.contains("no shared receive queues"), "{err}");
    assert!(err.contains("create_srq"), "{err}");
    let args = ["write_bw", "--write_with_imm"];
    let err = refused(&run(&s, &args), &args);
    // The flag applies to write_bw too, and shmhca has the operation.
    assert!(!err.contains("write_lat uses RDMA Write only"), "{err}");
    assert!(err.contains("RdmaWriteWithImm"), "{err}");
}
