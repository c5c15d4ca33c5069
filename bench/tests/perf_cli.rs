//! Runs the `shmhca-perf` binary as a user would: each of the eight tests through its
//! self-spawned peer, the two-terminal roles, bad input, a peer that dies, Ctrl-C; checks
//! the tables, `--json`, `--hgrm`, `-H`, `--output`, and that nothing is left behind.
//!
//! The runs are serialised (each one keeps two processes busy) and use a private `TMPDIR`,
//! so "nothing left behind" is checked exactly.

mod common;
use common::{EXE, Scratch};

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

static SERIAL: Mutex<()> = Mutex::new(());

fn command(scratch: &Scratch, args: &[&str]) -> Command {
    let mut c = Command::new(EXE);
    // In the scratch directory: files a run writes by default (perftest_out.json) land
    // there, not in the source tree.
    c.args(args)
        .current_dir(&scratch.0)
        .env("TMPDIR", &scratch.0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Waits for `child` with a deadline; kills it (and fails) past it.
fn wait(mut child: Child, limit: Duration, what: &str) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what} did not finish within {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn run(scratch: &Scratch, args: &[&str]) -> Output {
    let child = command(scratch, args).spawn().unwrap();
    wait(
        child,
        Duration::from_secs(120),
        &format!("shmhca-perf {args:?}"),
    )
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

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

/// The data rows after the table head `head_start`.
fn rows(stdout: &str, head_start: &str) -> Vec<Vec<f64>> {
    let mut lines = stdout.lines().skip_while(|l| !l.starts_with(head_start));
    assert!(lines.next().is_some(), "no table head in\n{stdout}");
    lines
        .take_while(|l| !l.starts_with("---"))
        .map(|l| {
            l.split_whitespace()
                .map(|f| {
                    f.parse::<f64>()
                        .unwrap_or_else(|_| panic!("field {f:?} of {l:?}"))
                })
                .collect()
        })
        .collect()
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 0.006 + 1e-6 * b.abs()
}

const LAT_HEAD: &str = " #bytes #iterations    t_min[usec]";
const BW_HEAD: &str = " #bytes     #iterations    BW peak[MiB/sec]";

fn check_lat(test: &str, size: u64) {
    let s = Scratch::new(test);
    let json = s.path("out.json");
    let hgrm = s.path("out.hgrm");
    let size_s = size.to_string();
    let mut args = vec![test, "-n", "300", "--warmup", "50"];
    if !test.starts_with("atomic") {
        args.extend(["-s", &size_s]);
    }
    let (j, h) = (json.to_str().unwrap(), hgrm.to_str().unwrap());
    args.extend(["--json", j, "--hgrm", h]);
    let out = run(&s, &args);
    let stdout = ok(&out, &args);
    assert!(stdout.contains(" Test\n"), "{stdout}");
    let r = rows(&stdout, LAT_HEAD);
    assert_eq!(r.len(), 1, "{stdout}");
    let r = &r[0];
    assert_eq!(r.len(), 9, "{r:?}");
    let (bytes, iters, min, max, typ, avg, _stdev, p99, p999) =
        (r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8]);
    assert_eq!((bytes as u64, iters as u64), (size, 300));
    assert!(min > 0.0 && min <= typ && typ <= max, "{r:?}");
    assert!(typ <= p99 && p99 <= p999 && p999 <= max, "{r:?}");
    assert!(min <= avg && avg <= max, "{r:?}");

    let doc = read_json(&json);
    assert_eq!(doc["test"], test);
    assert_eq!(doc["kind"], "latency");
    assert_eq!(doc["params"]["iterations"], 300);
    let row = &doc["results"][0];
    assert_eq!(row["bytes"].as_u64(), Some(size));
    assert_eq!(row["iterations"].as_u64(), Some(300));
    for (k, v) in [
        ("t_min_usec", min),
        ("t_max_usec", max),
        ("t_typical_usec", typ),
        ("t_avg_usec", avg),
        ("p99_usec", p99),
        ("p99_9_usec", p999),
    ] {
        assert!(
            close(row[k].as_f64().unwrap(), v),
            "{k}: json {} table {v}",
            row[k]
        );
    }
    let one_way = matches!(test, "send_lat" | "write_lat");
    assert_eq!(doc["params"]["one_way"], one_way);
    for k in ["before_setup", "after_setup", "measure_start", "end"] {
        assert!(doc["rss_kib"][k].as_u64().unwrap() > 0, "rss {k}");
    }
    // The measurement itself does not grow the process (everything is allocated and
    // touched before it starts).
    let (start, end) = (
        doc["rss_kib"]["measure_start"].as_u64().unwrap(),
        doc["rss_kib"]["end"].as_u64().unwrap(),
    );
    assert!(
        end <= start + 512,
        "RSS grew from {start} to {end} KiB during the run"
    );
    assert!(doc["machine"]["cpus"].as_u64().unwrap() >= 1);
    // perftest's default queues (128 deep) cost less than 256 KiB per QP besides its MRs.
    let qp_bytes = doc["engine"]["qps"][0]["memory_bytes"].as_u64().unwrap();
    assert!(
        qp_bytes > 0 && qp_bytes < 256 << 10,
        "{qp_bytes} bytes per QP"
    );

    let hg = std::fs::read_to_string(&hgrm).unwrap();
    assert!(hg.starts_with("       Value     Percentile TotalCount 1/(1-Percentile)"));
    let last = hg
        .lines()
        .rfind(|l| !l.starts_with('#') && !l.trim().is_empty())
        .unwrap();
    let cols: Vec<&str> = last.split_whitespace().collect();
    assert_eq!((cols[1], cols[2]), ("1.000000000000", "300"), "{last}");
    assert!(s.leftovers().is_empty(), "{:?}", s.leftovers());
}

fn check_bw(test: &str, size: u64, extra: &[&str]) {
    let s = Scratch::new(test);
    let json = s.path("out.json");
    let size_s = size.to_string();
    let mut args = vec![test, "-n", "2000", "--warmup", "100"];
    if !test.starts_with("atomic") {
        args.extend(["-s", &size_s]);
    }
    args.extend(["--json", json.to_str().unwrap()]);
    args.extend(extra);
    let out = run(&s, &args);
    let stdout = ok(&out, &args);
    let r = rows(&stdout, BW_HEAD);
    assert_eq!(r.len(), 1, "{stdout}");
    let r = &r[0];
    assert_eq!(r.len(), 5, "{r:?}");
    let (bytes, iters, peak, avg, rate) = (r[0], r[1], r[2], r[3], r[4]);
    assert_eq!((bytes as u64, iters as u64), (size, 2000));
    assert!(avg > 0.0 && peak >= avg, "{r:?}");
    // MsgRate and the average bandwidth describe the same run.
    let from_rate = rate * 1e6 * size as f64 / 1_048_576.0;
    assert!(
        (from_rate - avg).abs() <= 0.01 * avg + 0.01,
        "rate {rate} Mpps x {size} B = {from_rate} MiB/s, table says {avg}"
    );
    let doc = read_json(&json);
    assert_eq!(doc["kind"], "bandwidth");
    let row = &doc["results"][0];
    let qps = doc["params"]["qps"].as_u64().unwrap();
    assert_eq!(row["messages"].as_u64(), Some(2000 * qps));
    assert!(close(row["bw_average_mib_sec"].as_f64().unwrap(), avg));
    assert!(close(row["bw_peak_mib_sec"].as_f64().unwrap(), peak));
    assert!((row["msg_rate_mpps"].as_f64().unwrap() - rate).abs() < 1e-5);
    assert!(s.leftovers().is_empty(), "{:?}", s.leftovers());
}

#[test]
fn send_lat() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    check_lat("send_lat", 8);
}

#[test]
fn write_lat() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    check_lat("write_lat", 8);
}

#[test]
fn write_lat_above_inline_and_one_pmtu() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    check_lat("write_lat", 5000);
}

#[test]
fn read_lat() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    check_lat("read_lat", 8);
}

#[test]
fn atomic_lat() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    check_lat("atomic_lat", 8);
}

#[test]
fn send_bw() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    check_bw("send_bw", 65536, &[]);
    check_bw("send_bw", 8, &["-q", "2"]);
}

#[test]
fn write_bw() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    check_bw("write_bw", 65536, &["-m", "1024"]);
}

#[test]
fn read_bw() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    check_bw("read_bw", 65536, &["-q", "3"]);
}

#[test]
fn atomic_bw() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    check_bw("atomic_bw", 8, &[]);
    check_bw("atomic_bw", 8, &["-A", "CMP_AND_SWAP", "-q", "2"]);
}

#[test]
fn send_lat_in_poll_mode() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("poll");
    let args = ["send_lat", "-n", "100", "--warmup", "10", "--mode", "poll"];
    let out = run(&s, &args);
    let stdout = ok(&out, &args);
    assert!(stdout.contains(" Engine mode     : poll"), "{stdout}");
    assert_eq!(rows(&stdout, LAT_HEAD).len(), 1);
}

#[test]
fn all_sizes_and_histogram_output() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("all");
    let args = ["read_lat", "-a", "-n", "5", "--warmup", "0"];
    let out = run(&s, &args);
    let stdout = ok(&out, &args);
    let r = rows(&stdout, LAT_HEAD);
    let sizes: Vec<u64> = r.iter().map(|row| row[0] as u64).collect();
    assert_eq!(sizes, (1..=23).map(|e| 1u64 << e).collect::<Vec<_>>());

    let args = ["send_lat", "-n", "20", "--warmup", "5", "-H"];
    let stdout = ok(&run(&s, &args), &args);
    let list: Vec<&str> = stdout
        .lines()
        .skip_while(|l| *l != "#, usec")
        .skip(1)
        .collect();
    assert_eq!(list.len(), 20, "{stdout}");
    for (i, l) in list.iter().enumerate() {
        let (n, v) = l.split_once(", ").unwrap();
        assert_eq!(n.parse::<usize>().unwrap(), i + 1);
        assert!(v.parse::<f64>().unwrap() > 0.0);
    }

    let args = [
        "send_lat", "-n", "20", "--warmup", "5", "--output", "latency",
    ];
    let stdout = ok(&run(&s, &args), &args);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(stdout.trim().parse::<f64>().unwrap() > 0.0);

    let args = [
        "write_bw",
        "-n",
        "200",
        "--output",
        "message_rate",
        "--report_gbits",
    ];
    let stdout = ok(&run(&s, &args), &args);
    assert!(stdout.trim().parse::<f64>().unwrap() > 0.0, "{stdout}");
    assert!(s.leftovers().is_empty(), "{:?}", s.leftovers());
}

fn fails_with(s: &Scratch, args: &[&str], needle: &str) {
    let out = run(s, args);
    let err = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "shmhca-perf {args:?}: {}\n{err}",
        out.status
    );
    assert!(
        err.contains(needle),
        "shmhca-perf {args:?}: expected {needle:?} in\n{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(s.leftovers().is_empty(), "{:?}", s.leftovers());
}

#[test]
fn bad_flags_name_the_problem_and_exit_1() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("bad");
    fails_with(&s, &["send_lat", "-s", "0"], "-s 0");
    fails_with(&s, &["send_bw", "-s", "2000000000"], "message size");
    fails_with(&s, &["write_bw", "-m", "1000"], "not a PMTU");
    fails_with(&s, &["send_bw", "-t", "0"], "-t 0");
    fails_with(&s, &["send_bw", "-t", "99999"], "queue depth");
    fails_with(&s, &["ping_lat"], "ping_lat");
    fails_with(&s, &[], "no test given");
    fails_with(&s, &["read_lat", "--cpu", "4096"], "does not exist");
    let missing = s.path("nobody.sock");
    fails_with(
        &s,
        &["send_lat", "--client", missing.to_str().unwrap()],
        "no such socket",
    );
    let plain = s.path("plain.txt");
    std::fs::write(&plain, "x").unwrap();
    fails_with(
        &s,
        &["send_lat", "--client", plain.to_str().unwrap()],
        "not a socket",
    );
    std::fs::remove_file(&plain).unwrap();
}

#[test]
fn a_peer_that_is_not_shmhca_is_refused() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("garbage");
    let sock = s.path("garbage.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let t = std::thread::spawn(move || {
        use std::io::Write;
        if let Ok((mut c, _)) = listener.accept() {
            let _ = c.write_all(b"HTTP/1.1 200 OK\r\n\r\nhello, not shmhca at all........");
            std::thread::sleep(Duration::from_millis(500));
        }
    });
    let args = [
        "send_lat",
        "--client",
        sock.to_str().unwrap(),
        "--connect-timeout",
        "3",
    ];
    let out = run(&s, &args);
    t.join().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("connecting to the server at"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    std::fs::remove_file(&sock).unwrap();
}

fn wait_for_socket(p: &Path) {
    let start = Instant::now();
    while !p.exists() {
        assert!(start.elapsed() < Duration::from_secs(20), "no socket {p:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn server_and_client_in_two_processes() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("roles");
    let sock = s.path("perf.sock");
    let p = sock.to_str().unwrap();
    let server = command(
        &s,
        &["write_lat", "-n", "200", "--warmup", "10", "--server", p],
    )
    .spawn()
    .unwrap();
    wait_for_socket(&sock);
    let args = ["write_lat", "-n", "200", "--warmup", "10", "--client", p];
    let client = run(&s, &args);
    let stdout = ok(&client, &args);
    assert_eq!(rows(&stdout, LAT_HEAD).len(), 1);
    let server = wait(server, Duration::from_secs(30), "the server");
    let sout = ok(&server, &["--server"]);
    assert!(sout.contains("RDMA_Write Latency Test"), "{sout}");
    assert!(sout.contains(" remote address: "), "{sout}");
    assert!(!sock.exists(), "the server left its socket behind");
}

/// `--server PATH` removes only the socket it made: a path it refuses (a file that is not
/// a socket, a live server's socket) is left as it was.
#[test]
fn a_refused_server_path_is_left_alone() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("refused");
    let plain = s.path("precious.txt");
    std::fs::write(&plain, "not yours").unwrap();
    let out = run(&s, &["send_lat", "--server", plain.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(!text(&out.stderr).contains("panicked"));
    assert_eq!(
        std::fs::read_to_string(&plain).ok().as_deref(),
        Some("not yours"),
        "shmhca-perf --server deleted a file it refused"
    );

    // A second server on a live server's socket is refused and leaves it in place: the
    // first server still gets its client.
    let sock = s.path("perf.sock");
    let p = sock.to_str().unwrap();
    let first = command(&s, &["send_lat", "-n", "100", "--server", p])
        .spawn()
        .unwrap();
    wait_for_socket(&sock);
    let second = run(&s, &["send_lat", "-n", "100", "--server", p]);
    assert_eq!(second.status.code(), Some(1));
    assert!(
        text(&second.stderr).contains("live listener"),
        "{}",
        text(&second.stderr)
    );
    assert!(
        sock.exists(),
        "the refused server removed the live server's socket"
    );
    let args = ["send_lat", "-n", "100", "--client", p];
    ok(&run(&s, &args), &args);
    let first = wait(first, Duration::from_secs(30), "the first server");
    ok(&first, &["--server"]);
    assert!(!sock.exists(), "the server left its socket behind");
}

#[test]
fn parameter_mismatch_is_refused_on_both_sides() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("mismatch");
    let sock = s.path("perf.sock");
    let p = sock.to_str().unwrap();
    let server = command(&s, &["send_lat", "-s", "8", "--server", p])
        .spawn()
        .unwrap();
    wait_for_socket(&sock);
    let out = run(&s, &["send_lat", "-s", "16", "--client", p]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("-s is 16 here but 8 at the peer"), "{err}");
    let server = wait(server, Duration::from_secs(30), "the server");
    assert_eq!(server.status.code(), Some(1));
    let serr = text(&server.stderr);
    assert!(serr.contains("-s is 8 here but 16 at the peer"), "{serr}");
    assert!(!sock.exists());
}

#[test]
fn a_peer_that_dies_is_reported() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("death");
    let sock = s.path("perf.sock");
    let p = sock.to_str().unwrap();
    let big = ["send_lat", "-n", "100000000", "--warmup", "0"];
    let mut server = command(&s, &[&big[..], &["--server", p]].concat())
        .spawn()
        .unwrap();
    wait_for_socket(&sock);
    let mut client = command(&s, &[&big[..], &["--client", p]].concat())
        .spawn()
        .unwrap();
    // Let the run get going, then kill the server outright.
    wait_until_running(&mut client);
    server.kill().unwrap();
    server.wait().unwrap();
    let out = wait(
        client,
        Duration::from_secs(20),
        "the client after its peer died",
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("peer went away"), "{err}");
    let _ = std::fs::remove_file(&sock);
}

/// Waits (at most 60 s, however slow the machine) until `child` has printed its table
/// head: it is connected and its run is under way; then a little longer. Its stdout is
/// drained from then on (not returned by `wait`).
fn wait_until_running(child: &mut Child) {
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.starts_with(" #bytes") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the run never started");
    std::thread::sleep(Duration::from_millis(300));
}

fn signal(child: &Child, sig: &str) {
    let st = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill {sig} failed");
}

/// A receive-only server whose client is stopped (SIGSTOP) ends with a clear error after
/// `--idle-timeout` instead of waiting forever (issue 8, item 10).
#[test]
fn a_stopped_peer_ends_the_run_after_the_idle_timeout() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for test in ["send_bw", "write_bw"] {
        let s = Scratch::new("stopped");
        let sock = s.path("perf.sock");
        let p = sock.to_str().unwrap();
        let args = [test, "-s", "64", "-n", "100000000", "--idle-timeout", "2"];
        let server = command(&s, &[&args[..], &["--server", p]].concat())
            .spawn()
            .unwrap();
        wait_for_socket(&sock);
        let mut client = command(&s, &[&args[..], &["--client", p]].concat())
            .spawn()
            .unwrap();
        wait_until_running(&mut client);
        signal(&client, "-STOP");
        let start = Instant::now();
        let out = wait(
            server,
            Duration::from_secs(30),
            "the server of a stopped client",
        );
        let waited = start.elapsed();
        signal(&client, "-KILL");
        client.wait().unwrap();
        assert_eq!(out.status.code(), Some(1), "{test}");
        let err = text(&out.stderr);
        assert!(err.contains("nothing from the peer for"), "{test}: {err}");
        assert!(err.contains("--idle-timeout"), "{test}: {err}");
        assert!(waited < Duration::from_secs(15), "{test}: {waited:?}");
        assert!(!sock.exists(), "{test}: the server left its socket behind");
    }
}

#[test]
fn ctrl_c_stops_the_peer_and_removes_the_temp_dir() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("sigint");
    let child = command(&s, &["send_lat", "-n", "100000000", "--warmup", "0"])
        .spawn()
        .unwrap();
    let pid = child.id();
    // Wait until the run has started: the table head is printed once both sides are
    // connected.
    let mut child = child;
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.starts_with(" #bytes") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("the run never started");
    let dir = std::fs::read_dir(&s.0)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("shmhca-perf-")
        })
        .expect("the run's temp dir");
    std::thread::sleep(Duration::from_millis(300));
    let status = Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = wait(child, Duration::from_secs(10), "shmhca-perf after SIGINT");
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("interrupted"));
    assert!(!dir.exists(), "the temp dir {dir:?} is still there");
    // The server process is gone too: no process runs with our socket path.
    let sock = dir.join("perf.sock");
    std::thread::sleep(Duration::from_millis(200));
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd);
            assert!(
                !cmd.contains(sock.to_str().unwrap()),
                "the server {:?} still runs",
                e.path()
            );
        }
    }
}

#[test]
fn nothing_is_left_in_dev_shm() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let list = || -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.contains("shmhca"))
                    .collect()
            })
            .unwrap_or_default()
    };
    let before = list();
    let s = Scratch::new("shm");
    let args = ["write_bw", "-n", "100", "--warmup", "10"];
    ok(&run(&s, &args), &args);
    assert_eq!(list(), before);
    assert!(s.leftovers().is_empty());
}

#[test]
fn a_client_that_dies_is_reported_by_the_server() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("cdeath");
    let sock = s.path("perf.sock");
    let p = sock.to_str().unwrap();
    // write_bw: the server only drives its engine and waits for the client's "done".
    let big = ["write_bw", "-s", "4096", "-n", "100000000", "--warmup", "0"];
    let server = command(&s, &[&big[..], &["--server", p]].concat())
        .spawn()
        .unwrap();
    wait_for_socket(&sock);
    let mut client = command(&s, &[&big[..], &["--client", p]].concat())
        .spawn()
        .unwrap();
    wait_until_running(&mut client);
    client.kill().unwrap();
    client.wait().unwrap();
    let out = wait(
        server,
        Duration::from_secs(20),
        "the server after its client died",
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("peer went away"), "{err}");
    assert!(!sock.exists(), "the server left its socket behind");
}

#[test]
fn both_sides_in_one_process() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("inproc");
    for args in [
        &["write_lat", "-n", "300", "--warmup", "10", "--in-process"][..],
        &[
            "send_bw",
            "-s",
            "1024",
            "-n",
            "3000",
            "-q",
            "2",
            "--in-process",
        ][..],
    ] {
        let stdout = ok(&run(&s, args), args);
        assert!(stdout.contains("in-process link"), "{stdout}");
        let head = if args[0].ends_with("lat") {
            LAT_HEAD
        } else {
            BW_HEAD
        };
        assert_eq!(rows(&stdout, head).len(), 1, "{stdout}");
    }
}

#[test]
fn progress_goes_to_stderr() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("progress");
    // Shown from the start (the default is after two seconds).
    let args = [
        "send_lat",
        "-n",
        "50000",
        "--warmup",
        "0",
        "--output",
        "latency",
        "--progress-after",
        "0",
    ];
    let out = run(&s, &args);
    let stdout = ok(&out, &args);
    assert_eq!(
        stdout.lines().count(),
        1,
        "progress must not go to stdout: {stdout}"
    );
    let err = text(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("shmhca-perf: send_lat 2 B: "))
        .unwrap_or_else(|| panic!("no progress line in\n{err}"));
    assert!(
        line.contains("% (") && line.contains("of 50000 iterations"),
        "{line}"
    );
}

/// Processes (not zombies) whose command line mentions `needle`.
fn live_processes_mentioning(needle: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let (Ok(cmd), Ok(stat)) = (
            std::fs::read(e.path().join("cmdline")),
            std::fs::read_to_string(e.path().join("stat")),
        ) else {
            continue;
        };
        let zombie = stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z'));
        if !zombie && String::from_utf8_lossy(&cmd).contains(needle) {
            found.push(e.path());
        }
    }
    found
}

#[test]
fn a_killed_client_takes_its_server_and_temp_dir_along() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("sigkill");
    let mut child = command(&s, &["send_lat", "-n", "100000000", "--warmup", "0"])
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.starts_with(" #bytes") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("the run never started");
    let dir = std::fs::read_dir(&s.0)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("shmhca-perf-")
        })
        .expect("the run's temp dir");
    let sock = dir.join("perf.sock");
    assert_eq!(live_processes_mentioning(sock.to_str().unwrap()).len(), 1);
    child.kill().unwrap(); // SIGKILL: no handler runs in the client
    child.wait().unwrap();
    let start = Instant::now();
    while dir.exists() || !live_processes_mentioning(sock.to_str().unwrap()).is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "server or {dir:?} still there after the client was killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `args` and returns stdout, failing on an error exit.
fn run_ok(s: &Scratch, args: &[&str]) -> String {
    ok(&run(s, args), args)
}

/// The flags of perftest's own example command lines (its README's and man page's), as
/// written there: each runs, or is refused with an error naming the flag and the reason
/// (GPU memory; a core this machine lacks), never with "unexpected argument".
#[test]
fn perftest_example_command_lines_run_unchanged() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("examples");
    // man perftest, example 2.
    let out = run_ok(&s, &["read_lat", "-s", "32", "-n", "5000"]);
    assert_eq!(rows(&out, LAT_HEAD)[0][..2], [32.0, 5000.0], "{out}");
    // README "Command-line Examples".
    let out = run_ok(&s, &["write_bw", "-d", "mlx5_0"]);
    assert!(
        out.contains(" Ignored flags   : -d mlx5_0 (no meaning here)"),
        "{out}"
    );
    assert_eq!(rows(&out, BW_HEAD).len(), 1);
    let out = run_ok(&s, &["write_bw", "--numa_node=1", "-d", "mlx5_0"]);
    assert!(out.contains("--numa_node 1"), "{out}");
    run_ok(&s, &["write_bw", "--disable_numa", "-d", "mlx5_0"]);
    run_ok(
        &s,
        &["write_bw", "-d", "mlx5_0", "--data_validation", "-t", "128"],
    );
    run_ok(
        &s,
        &[
            "read_bw",
            "-d",
            "mlx5_0",
            "--data_validation",
            "-t",
            "128",
            "-q",
            "4",
        ],
    );
    run_ok(
        &s,
        &[
            "write_bw",
            "-d",
            "mlx5_0",
            "--data_validation",
            "--data_validation_debug",
            "-t",
            "128",
        ],
    );
    run_ok(&s, &["write_bw", "--pin_cores=0", "-d", "mlx5_0"]);
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    if ncpu <= 8 {
        fails_with(
            &s,
            &["write_bw", "--pin_cores=0-3,8", "-d", "mlx5_0"],
            "does not exist (this machine has cores",
        );
    }
    // man perftest, example 1, and the README's bidirectional line. As written in a
    // release build; a debug build keeps the flags with 64 KiB messages: its first
    // completion of 8 MiB ones comes after 100 x 8 MiB x 3 QPs x 2 directions of copying,
    // past the measurement window on a slow machine (a clear error, tests/perf_duration.rs).
    let size = if cfg!(debug_assertions) {
        "65536"
    } else {
        "8388608"
    };
    let out = run_ok(&s, &["write_bw", "-s", size, "-b", "-D", "5", "-q", "3"]);
    assert!(out.contains("RDMA_Write Bidirectional BW Test"), "{out}");
    let r = rows(&out, BW_HEAD);
    assert!(
        r.len() == 1 && r[0][0] == size.parse::<f64>().unwrap() && r[0][3] > 0.0,
        "{out}"
    );
    let out = run_ok(
        &s,
        &[
            "write_bw",
            "-d",
            "mlx5_0",
            "--data_validation",
            "-t",
            "128",
            "-b",
        ],
    );
    assert_eq!(rows(&out, BW_HEAD).len(), 1, "{out}");
    fails_with(
        &s,
        &[
            "write_bw",
            "-d",
            "mlx5_0",
            "--use_cuda=0",
            "--data_validation",
            "-t",
            "128",
        ],
        "--use_cuda: not available",
    );
}

/// perftest's defaults: a post list of 1 and no warm-up; -c other than RC, -e, and
/// --out_json's misspellings get clear errors, not a suggestion of another flag.
#[test]
fn perftest_defaults_and_flag_errors() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("pflags");
    let json = s.path("run.json");
    run_ok(
        &s,
        &["send_bw", "-n", "200", "--json", json.to_str().unwrap()],
    );
    let doc = read_json(&json);
    assert_eq!(doc["params"]["post_list"], 1, "{doc}");
    assert_eq!(doc["params"]["warmup"], 0, "{doc}");
    run_ok(
        &s,
        &[
            "send_lat",
            "-n",
            "200",
            "--json",
            s.path("l.json").to_str().unwrap(),
        ],
    );
    assert_eq!(read_json(&s.path("l.json"))["params"]["warmup"], 0);
    run_ok(&s, &["send_bw", "-c", "RC", "-n", "100"]);
    fails_with(&s, &["send_bw", "-c", "UD"], "shmhca implements RC only");
    // -e sleeps on completion events; where there is nothing to sleep on it says so.
    run_ok(&s, &["send_lat", "-e", "-n", "200"]);
    run_ok(&s, &["send_bw", "-e", "-n", "2000"]);
    fails_with(&s, &["write_lat", "-e"], "no event to sleep on");
    fails_with(&s, &["send_lat", "-X", "1"], "single completion vector");
    let out = run(&s, &["send_bw", "--out_json"]);
    // The flag is known now: no "did you mean --outs".
    assert!(
        !text(&out.stderr).contains("--outs"),
        "{}",
        text(&out.stderr)
    );
    std::fs::remove_file(s.path("run.json")).unwrap();
}

/// --out_json writes perftest's keys; files that exist are never overwritten without
/// --force.
#[test]
fn out_json_has_perftest_keys_and_nothing_is_overwritten() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("ojson");
    let f = s.path("p.json");
    let fp = f.to_str().unwrap();
    run_ok(
        &s,
        &["write_bw", "-n", "200", "--out_json", "--out_json_file", fp],
    );
    let doc = read_json(&f);
    for k in [
        "MsgSize",
        "n_iterations",
        "BW_peak",
        "BW_average",
        "MsgRate",
    ] {
        assert!(doc["results"][k].is_number(), "{k} in {doc}");
    }
    assert_eq!(doc["test_info"]["test"], "RDMA_Write_BW_Test");
    assert_eq!(doc["test_info"]["Connection_type"], "RC");
    // A file that is not a report (here half of one) is refused, untouched; an earlier
    // report itself is replaced, as perftest does (perf_habits.rs).
    let before = std::fs::read(&f).unwrap();
    let half = s.path("half.json");
    std::fs::write(&half, &before[..before.len() / 2]).unwrap();
    fails_with(
        &s,
        &[
            "write_bw",
            "-n",
            "200",
            "--out_json",
            "--out_json_file",
            half.to_str().unwrap(),
        ],
        "does not overwrite",
    );
    assert_eq!(std::fs::read(&half).unwrap(), &before[..before.len() / 2]);
    let hgrm = s.path("x.hgrm");
    std::fs::write(&hgrm, "mine").unwrap();
    fails_with(
        &s,
        &["send_lat", "-n", "100", "--hgrm", hgrm.to_str().unwrap()],
        "does not overwrite",
    );
    assert_eq!(std::fs::read_to_string(&hgrm).unwrap(), "mine");
    assert_eq!(std::fs::read(&f).unwrap(), before);
    run_ok(
        &s,
        &[
            "send_lat",
            "-n",
            "100",
            "--out_json",
            "--out_json_file",
            fp,
            "--force",
        ],
    );
    let doc = read_json(&f);
    for k in [
        "t_min",
        "t_max",
        "t_typical",
        "t_avg",
        "t_stdev",
        "percentile_99",
        "percentile_99.9",
    ] {
        assert!(doc["results"][k].is_number(), "{k} in {doc}");
    }
}

/// -D runs by time (no peak, as perftest) and --run_infinitely prints a line per interval
/// until interrupted; send_bw's server counts what arrived against the client's count.
#[test]
fn duration_and_run_infinitely() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("dur");
    for test in ["send_bw", "write_bw", "read_bw", "atomic_bw"] {
        let start = Instant::now();
        let out = run_ok(&s, &[test, "-D", "2", "-s", "8"]);
        assert!(start.elapsed() >= Duration::from_secs(2), "{test}");
        assert!(out.contains("WARNING: BW peak won't be measured"), "{out}");
        let r = rows(&out, BW_HEAD);
        assert_eq!(r.len(), 1, "{out}");
        assert_eq!(r[0][2], 0.0, "no peak in a timed run: {out}");
        assert!(r[0][1] > 0.0 && r[0][3] > 0.0, "{out}");
    }
    fails_with(
        &s,
        &["send_lat", "--run_infinitely"],
        "for the bandwidth tests",
    );
    fails_with(&s, &["send_bw", "-D", "4", "-f", "2"], "twice the margin");
    fails_with(&s, &["send_bw", "-D", "2", "-n", "100"], "give one");

    // Interrupted once it has printed two interval lines (however long a loaded machine
    // takes to get there), not after a fixed time.
    let mut child = command(&s, &["send_bw", "--run_infinitely", "-D", "1", "-s", "64"])
        .spawn()
        .unwrap();
    let pipe = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        let mut all = String::new();
        let mut data = 0;
        for line in std::io::BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if line.starts_with(" 64 ") {
                data += 1;
                if data == 2 {
                    let _ = tx.send(());
                }
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let two = rx.recv_timeout(Duration::from_secs(60));
    signal(&child, "-INT");
    let out = wait(child, Duration::from_secs(20), "--run_infinitely");
    let stdout = reader.join().unwrap();
    assert!(
        two.is_ok(),
        "no two interval lines within 60 s\n{stdout}\n{}",
        text(&out.stderr)
    );
    let lines = rows(&stdout, BW_HEAD);
    assert!(lines.len() >= 2, "{stdout}");
    assert!(lines.iter().all(|l| l[0] == 64.0 && l[3] > 0.0), "{stdout}");
    assert!(s.leftovers().is_empty(), "{:?}", s.leftovers());
}

/// --svg draws the run (plotters' SVG), -a with --hgrm writes one .hgrm per size, and
/// neither overwrites a file that exists.
#[test]
fn svg_and_one_hgrm_per_size() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("svg");
    let svg = s.path("lat.svg");
    let hgrm = s.path("lat.hgrm");
    run_ok(
        &s,
        &[
            "write_lat",
            "-a",
            "-n",
            "20",
            "--svg",
            svg.to_str().unwrap(),
            "--hgrm",
            hgrm.to_str().unwrap(),
        ],
    );
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"), "{}", &text[..100.min(text.len())]);
    assert!(text.contains("Latency by message size") && text.contains("Latency by percentile"));
    for e in 1..=23 {
        let p = s.path(&format!("lat-{}.hgrm", 1u64 << e));
        let h = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p:?}: {e}"));
        assert!(h.contains("Percentile") && h.contains("#[Mean"), "{h}");
    }
    assert!(!hgrm.exists(), "with -a the sizes get files of their own");
    fails_with(
        &s,
        &["send_lat", "-n", "20", "--svg", svg.to_str().unwrap()],
        "does not overwrite",
    );
    assert_eq!(std::fs::read_to_string(&svg).unwrap(), text);
    fails_with(
        &s,
        &["send_bw", "--svg", s.path("x.svg").to_str().unwrap()],
        "add -a",
    );
    let bw = s.path("bw.svg");
    run_ok(
        &s,
        &["write_bw", "-a", "-n", "20", "--svg", bw.to_str().unwrap()],
    );
    assert!(
        std::fs::read_to_string(&bw)
            .unwrap()
            .contains("Bandwidth by message size")
    );
}

/// --hlog writes HdrHistogram's interval log, readable by hdrhistogram's own parser, with
/// every measured sample in its intervals.
#[test]
fn hlog_is_an_interval_log() {
    use hdrhistogram::serialization::Deserializer;
    use hdrhistogram::serialization::interval_log::{IntervalLogIterator, LogEntry};
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("hlog");
    let f = s.path("run.hlog");
    run_ok(
        &s,
        &["send_lat", "-n", "3000", "--hlog", f.to_str().unwrap()],
    );
    let bytes = std::fs::read(&f).unwrap();
    let mut samples = 0;
    let mut intervals = 0;
    for e in IntervalLogIterator::new(&bytes) {
        if let LogEntry::Interval(h) = e.unwrap() {
            assert_eq!(h.tag().unwrap().as_str(), "size-2");
            let raw = base64_decode(h.encoded_histogram());
            let hist: hdrhistogram::Histogram<u64> =
                Deserializer::new().deserialize(&mut &raw[..]).unwrap();
            samples += hist.len();
            intervals += 1;
        }
    }
    assert!(intervals >= 1);
    assert_eq!(samples, 3000);
    fails_with(
        &s,
        &["send_lat", "-n", "100", "--hlog", f.to_str().unwrap()],
        "does not overwrite",
    );
    fails_with(
        &s,
        &["send_bw", "--hlog", s.path("b.hlog").to_str().unwrap()],
        "--hlog apply to latency tests",
    );
}

/// Standard base64 (the interval log's histogram encoding).
fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let mut out = Vec::new();
    for chunk in s.trim_end_matches('=').as_bytes().chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= val(c) << (18 - 6 * i);
        }
        let n = chunk.len() * 6 / 8;
        for i in 0..n {
            out.push((acc >> (16 - 8 * i)) as u8);
        }
    }
    out
}

/// -b: both sides run the requests and check what the other's brought; the table adds
/// the two directions; tests without -b say so.
#[test]
fn bidirectional_write_and_read() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("bidir");
    for test in ["write_bw", "read_bw"] {
        let out = run_ok(&s, &[test, "-b", "-n", "500", "-q", "2", "-s", "4096"]);
        assert!(out.contains("Bidirectional BW Test"), "{out}");
        let r = rows(&out, BW_HEAD);
        assert!(r.len() == 1 && r[0][3] > 0.0, "{out}");
    }
    fails_with(&s, &["send_bw", "-b"], "not yet for send_bw");
    fails_with(&s, &["send_lat", "-b"], "latency tests go both ways");
}
