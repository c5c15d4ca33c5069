//! A failing completion on one side ends both sides at once, each naming that completion.
//!
//! Issue 24: a bidirectional `write_bw` run had an RDMA Write complete with RemAccessErr;
//! the failing side exited, and its peer either blamed "the peer process exited" (its own
//! Writes on the QP its responder had just failed were flushed) or, waiting on the control
//! channel, heard nothing for the whole `--idle-timeout` (10 s) before giving up as if the
//! peer were merely silent. Here the server's Writes use a wrong R_Key, so the client's
//! responder refuses them (a Remote Access Error Nak, RemAccessErr on the server): both
//! sides' errors must name that completion, and the client must not wait out its idle
//! timeout (set to 300 s, so a wait for it would show as a failure of this test's bound).

use std::sync::mpsc;
use std::time::Duration;

use crate::perf::PerfError;
use crate::perf::opts::Options;
use crate::perf::output::Output;
use crate::perf::sequence::run_sizes;
use crate::perf::setup::{Resources, cm_client, cm_server, in_process_pair};

/// How long the test waits for either side before failing (a bound on a hang, not a
/// timing assertion: a passing run ends in well under a second of work).
const BOUND: Duration = Duration::from_secs(240);

/// Runs `args` in process with the server's view of the client's R_Key broken; returns
/// (the client's error, the server's error).
fn run_with_bad_server_rkey(args: &[&str]) -> (String, String) {
    let mut argv = vec!["shmhca-perf"];
    argv.extend_from_slice(args);
    argv.extend_from_slice(&["--idle-timeout", "300"]);
    let opts = Options::parse_from(argv).expect("the test's flags parse");
    let (mut client, mut server) =
        in_process_pair(&opts, (None, None)).expect("an in-process pair");
    // A key of the client's that names no region: every Write of the server is refused.
    server.peer.buf.rkey ^= 0x0000_ff00;
    let (tx, rx) = mpsc::channel();
    let o = opts.clone();
    let txs = tx.clone();
    let s = std::thread::spawn(move || {
        let r = run_sizes(&o, &mut server, false, None);
        let _ = txs.send(("server", r.err().map(|e| e.to_string())));
        // Keep the side (its QPs and memory) until the client is done with it.
        server
    });
    let o = opts.clone();
    let c = std::thread::spawn(move || {
        let mut out = Output::new(&o);
        let r = run_sizes(&o, &mut client, true, Some(&mut out));
        let _ = tx.send(("client", r.err().map(|e| e.to_string())));
        client
    });
    let mut client_err = None;
    let mut server_err = None;
    for _ in 0..2 {
        let (who, e) = rx.recv_timeout(BOUND).expect(
            "a side neither finished nor failed within the bound (waiting for a silent peer?)",
        );
        let e = e.unwrap_or_else(|| format!("the {who} succeeded with a broken R_Key"));
        if who == "client" {
            client_err = Some(e);
        } else {
            server_err = Some(e);
        }
    }
    drop(c.join());
    drop(s.join());
    (client_err.expect("client"), server_err.expect("server"))
}

#[test]
fn a_refused_write_ends_both_sides_naming_the_completion() {
    let (client, server) = run_with_bad_server_rkey(&[
        "write_bw", "-s", "65536", "-b", "-q", "3", "-n", "40", "-t", "16",
    ]);
    eprintln!("client: {client}\nserver: {server}");
    assert!(
        server.contains("RDMA Write") && server.contains("RemAccessErr"),
        "server: {server}"
    );
    assert!(
        client.contains("RemAccessErr"),
        "the client's error does not name the failing completion: {client}"
    );
    assert!(
        !client.contains("silent"),
        "the client waited for a silent peer: {client}"
    );
}

/// The same with a duration run (`-D`), as in the command line.
#[test]
fn a_refused_write_ends_a_duration_run_on_both_sides() {
    let (client, server) = run_with_bad_server_rkey(&[
        "write_bw", "-s", "65536", "-b", "-q", "3", "-D", "1", "-t", "16",
    ]);
    assert!(server.contains("RemAccessErr"), "server: {server}");
    assert!(client.contains("RemAccessErr"), "client: {client}");
}
/// An abort message from a peer that is not shmhca-perf (or garbage) is reported as such,
/// its text cleaned of control characters and bounded.
#[test]
fn a_peer_abort_text_is_sanitised() {
    assert_eq!(
        crate::perf::control::abort_text(b"an RDMA Write\x1b[31m completed\n"),
        "an RDMA Write?[31m completed?"
    );
    assert_eq!(crate::perf::control::abort_text(&[0xff, 0xfe]), "??");
    assert_eq!(crate::perf::control::abort_text(&[]), "(no reason given)");
}

#[test]
fn the_abort_error_says_the_peer_stopped() {
    // What both sides print; the abort variant names its origin.
    let e = PerfError::PeerFailed("an RDMA Write completed with status RemAccessErr".into());
    assert!(e.to_string().contains("the peer stopped"), "{e}");
}

/// Issue 24's RemAccessErr: a side that gives up (here, as there, right after the start
/// barrier: its peer had been silent for `--idle-timeout` while it filled its buffers)
/// drops its side while the peer has started writing. If its memory region goes before
/// its connections, its engine answers the peer's Writes on the still-connected data QPs
/// in between with Remote Access Error Naks (a deregistered key), and the peer reports
/// RemAccessErr as if its request had been bad (failed before the fix: the server's error
/// was "an RDMA Write completed with status RemAccessErr"; now the peer is gone).
/// The QPs must go first: the peer then sees its QPs fail (peer gone), never a bad key.
#[test]
fn a_side_that_gives_up_mid_run_is_not_a_remote_access_error_for_its_peer() {
    let opts = Options::parse_from([
        "shmhca-perf",
        "write_bw",
        "-s",
        "65536",
        "-b",
        "-q",
        "3",
        "-D",
        "60",
        "-t",
        "16",
        "-Q",
        "1",
        "--idle-timeout",
        "300",
    ])
    .expect("the test's flags parse");
    let dir = std::env::temp_dir().join(format!("shmhca-perf-failure-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let path = dir.join("s.sock");
    let res = Resources::new(&opts, None).expect("server resources");
    let listener = res.ctx.listen(&path).expect("listening");
    let (tx, rx) = mpsc::channel();
    let o = opts.clone();
    let s = std::thread::spawn(move || {
        let mut side = match cm_server(&o, res, &listener, Some(Duration::from_secs(120))) {
            Ok(side) => side,
            Err(e) => {
                let _ = tx.send(Some(format!("server setup failed: {e}")));
                return;
            }
        };
        let r = run_sizes(&o, &mut side, false, None);
        let _ = tx.send(r.err().map(|e| e.to_string()));
    });
    let res = Resources::new(&opts, None).expect("client resources");
    let mut client = cm_client(&opts, res, &path).expect("connecting");
    client
        .ctl
        .barrier(0, 0, || Ok(()))
        .expect("the start barrier");
    {
        let ctx = &client.res.ctx;
        let start = ctx.stats().packets_received;
        for _ in 0..10_000_000u64 {
            ctx.progress();
            if ctx.stats().packets_received > start + 200 {
                break;
            }
        }
        assert!(
            ctx.stats().packets_received > start,
            "no Write of the server arrived"
        );
    }
    drop(client);
    let e = rx
        .recv_timeout(BOUND)
        .expect("the server neither finished nor failed within the bound")
        .expect("the server cannot finish without its peer");
    drop(s.join());
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("server: {e}");
    assert!(!e.starts_with("server setup failed"), "{e}");
    assert!(
        !e.contains("RemAccessErr"),
        "the peer's exit looked like a bad R_Key to the server: {e}"
    );
}
