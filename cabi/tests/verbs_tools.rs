//! Unmodified Debian 12 verbs programs over shmhca, two processes each, started through
//! `shmhca exec` (issue 26's acceptance). Each test skips with one line when its program is
//! not installed, unless `SHMHCA_REQUIRE_VERBS_TOOLS=1` (set by .ci/run). Every program's
//! wait is bounded and every child is killed if the test fails.

mod common;

use common::{DEADLINE, SERIAL, pair, pair_env, start, tool};

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Iterations: fewer in a debug build (the engine is ~10x slower unoptimized).
fn iters(release: u32, debug: u32) -> String {
    if cfg!(debug_assertions) {
        debug
    } else {
        release
    }
    .to_string()
}

#[test]
fn ibv_devices_lists_shmhca0() {
    let Some(p) = tool("ibv_devices") else { return };
    let _g = lock();
    let out = start(&p, &[]).wait(DEADLINE);
    assert!(out.ok(), "{out}");
    assert!(out.stdout.contains("shmhca0"), "{out}");
    assert!(
        out.stderr.contains("shmhca: running") || !common::target_dir().join("shmhca").exists(),
        "{out}"
    );
}

#[test]
fn ibv_devinfo_shows_an_active_port() {
    let Some(p) = tool("ibv_devinfo") else { return };
    let _g = lock();
    let out = start(&p, &["-v"]).wait(DEADLINE);
    assert!(out.ok(), "{out}");
    for want in [
        "hca_id:\tshmhca0",
        "PORT_ACTIVE (4)",
        "active_mtu:\t\t4096 (5)",
        "port_lid:",
        "link_layer:\t\tInfiniBand",
        "GID[  0]:",
    ] {
        assert!(out.stdout.contains(want), "no {want:?} in\n{out}");
    }
}

fn pingpong(prog: &str, extra: &[&str]) {
    let Some(p) = tool(prog) else { return };
    let _g = lock();
    let n = iters(1000, 1000);
    let mut args = vec!["-n", &n, "--chk"];
    args.extend_from_slice(extra);
    let (s, c) = pair(&p, &args, &args);
    assert!(s.ok() && c.ok(), "server: {s}\nclient: {c}");
    assert!(c.stdout.contains("iters in"), "{c}");
    assert!(s.stdout.contains("iters in"), "{s}");
}

#[test]
fn ibv_rc_pingpong() {
    pingpong("ibv_rc_pingpong", &[]);
}

#[test]
fn ibv_rc_pingpong_by_gid() {
    pingpong("ibv_rc_pingpong", &["-g", "0"]);
}

#[test]
fn ibv_rc_pingpong_with_events() {
    pingpong("ibv_rc_pingpong", &["-e"]);
}

#[test]
fn ibv_rc_pingpong_4096_bytes() {
    pingpong("ibv_rc_pingpong", &["-s", "4096"]);
}

#[test]
fn ibv_rc_pingpong_new_send_api() {
    pingpong("ibv_rc_pingpong", &["-N"]);
}

#[test]
fn ibv_srq_pingpong() {
    pingpong("ibv_srq_pingpong", &[]);
}

/// A perftest latency test: server and client with the same arguments; the client prints
/// perftest's table.
fn perftest(prog: &str, args: &[&str]) {
    let Some(p) = tool(prog) else { return };
    let _g = lock();
    let (s, c) = pair(&p, args, args);
    assert!(s.ok() && c.ok(), "server: {s}\nclient: {c}");
    assert!(c.stdout.contains("#bytes"), "no table: {c}");
}

fn lat(prog: &str, extra: &[&str]) {
    // All sizes (-a): 23 sizes, so fewer iterations each.
    let n = if extra.contains(&"-a") {
        iters(1000, 50)
    } else {
        iters(100_000, 1000)
    };
    let mut args = vec!["-F", "-n", &n];
    args.extend_from_slice(extra);
    perftest(prog, &args);
}

#[test]
fn ib_send_lat() {
    lat("ib_send_lat", &[]);
}

#[test]
fn ib_send_lat_all_sizes() {
    lat("ib_send_lat", &["-a"]);
}

#[test]
fn ib_send_lat_old_post_send() {
    lat("ib_send_lat", &["--use_old_post_send"]);
}

/// Events on one channel for both queues (Debian's perftest 4.5): it takes one completion
/// per event and expects the send queue's after posting, which a riding Ack handled after
/// the reply that carried it, or events handed out by slot, got wrong (it waited for
/// ever, both sides in `ibv_get_cq_event`).
#[test]
fn ib_send_lat_events() {
    lat("ib_send_lat", &["-e"]);
}

#[test]
fn ib_write_lat() {
    lat("ib_write_lat", &[]);
}

#[test]
fn ib_write_lat_all_sizes() {
    lat("ib_write_lat", &["-a"]);
}

#[test]
fn ib_read_lat() {
    lat("ib_read_lat", &[]);
}

#[test]
fn ib_atomic_lat() {
    lat("ib_atomic_lat", &[]);
}

#[test]
fn ib_atomic_lat_compare_and_swap() {
    lat("ib_atomic_lat", &["-A", "CMP_AND_SWAP"]);
}

fn bw(prog: &str, extra: &[&str]) {
    let n = if extra.contains(&"-a") {
        iters(1000, 50)
    } else {
        iters(5000, 500)
    };
    let mut args = vec!["-F", "-n", &n];
    args.extend_from_slice(extra);
    perftest(prog, &args);
}

#[test]
fn ib_send_bw() {
    bw("ib_send_bw", &[]);
}

#[test]
fn ib_send_bw_4_qps() {
    bw("ib_send_bw", &["-q", "4"]);
}

#[test]
fn ib_write_bw() {
    bw("ib_write_bw", &[]);
}

#[test]
fn ib_write_bw_bidirectional() {
    bw("ib_write_bw", &["-b"]);
}

#[test]
fn ib_write_bw_all_sizes() {
    bw("ib_write_bw", &["-a", "--report_gbits"]);
}

#[test]
fn ib_read_bw() {
    bw("ib_read_bw", &[]);
}

#[test]
fn ib_read_bw_4_qps() {
    bw("ib_read_bw", &["-q", "4"]);
}

/// UD fails at once with a clear message, and nothing hangs.
#[test]
fn ib_send_lat_ud_is_refused() {
    let Some(p) = tool("ib_send_lat") else { return };
    let _g = lock();
    let (s, c) = pair(&p, &["-c", "UD", "-F"], &["-c", "UD", "-F"]);
    assert!(!c.ok(), "{c}");
    assert!(
        c.stderr.contains("shmhca: UD queue pairs is not supported")
            || s.stderr.contains("shmhca: UD queue pairs is not supported"),
        "server: {s}\nclient: {c}"
    );
}

#[test]
fn ibv_ud_pingpong_is_refused() {
    let Some(p) = tool("ibv_ud_pingpong") else {
        return;
    };
    let _g = lock();
    let out = start(&p, &["-p", &common::free_port().to_string()]).wait(DEADLINE);
    assert!(!out.ok(), "{out}");
    assert!(
        out.stderr
            .contains("shmhca: UD queue pairs is not supported"),
        "{out}"
    );
}

/// `SHMHCA_VERBS_ZERO_COPY=1`: perftest's page-aligned whole-page buffers are moved onto
/// the arena in place (each side's debug line says so) and `ib_write_bw -s 65536` runs.
#[test]
fn ib_write_bw_zero_copy() {
    let Some(p) = tool("ib_write_bw") else { return };
    let _g = lock();
    let n = iters(5000, 500);
    let args = ["-F", "-s", "65536", "-n", &n];
    let env = [("SHMHCA_VERBS_ZERO_COPY", "1"), ("SHMHCA_VERBS_DEBUG", "1")];
    let (s, c) = pair_env(&p, &args, &args, &env);
    assert!(s.ok() && c.ok(), "server: {s}\nclient: {c}");
    assert!(c.stdout.contains("#bytes"), "no table: {c}");
    for (who, o) in [("server", &s), ("client", &c)] {
        assert!(
            o.stderr.contains("moved onto the arena in place"),
            "the {who}'s buffer was not registered in place: {o}"
        );
    }
}
