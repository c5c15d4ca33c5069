//! A peer that stops without closing anything (SIGSTOP, a debugger, a hung process): its
//! socket stays open, so only its silence gives it away. Each side's watcher sends a
//! keepalive on every connection socket every `KEEPALIVE_INTERVAL`; a receive-only side
//! sees how long its peer has been silent ([`Connection::peer_silent_for`]) and, with
//! [`ConnectParams::peer_silence_limit`], the connection ends like a hang-up: the QP goes to
//! the Error state and its work requests flush.
mod cm_support;

use std::time::{Duration, Instant};

use cm_support::*;
use shmhca::cm::KEEPALIVE_INTERVAL;
use shmhca::*;

const STOPPED_CLIENT: &str = "a_stopped_client_is_noticed_by_a_receive_only_server";
const HELLO: &[u8] = b"hello, then silence";

fn signal(pid: u32, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("a peer's pid is positive");
    rustix::process::kill_process(pid, sig).expect("signalling the peer");
}

#[test]
fn a_stopped_client_is_noticed_by_a_receive_only_server() {
    if let Some((_, path)) = role() {
        // The client: one message, then it idles (its engine and watcher threads running)
        // until it is stopped and killed.
        let ctx = context(8 << 20);
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(64).unwrap();
        let mut conn = ctx
            .connect(&path, &pd, &cq, &cq, &ConnectParams::default())
            .unwrap();
        conn.post_send(&SendWr::inline(1, SendOp::Send, HELLO))
            .unwrap();
        assert_eq!(wait(&mut cq, 1)[0].status, WcStatus::Success);
        loop {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let _serial = serial();
    let dir = SockDir::new("silent");
    let path = dir.sock("server.sock");
    let ctx = context(8 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(64).unwrap();
    let listener = ctx.listen(&path).unwrap();
    let peer = spawn_peer(STOPPED_CLIENT, "client", path.to_str().unwrap());
    // Generous against a busy machine: ten keepalive intervals at least.
    let limit = Duration::from_secs(3).max(KEEPALIVE_INTERVAL * 10);
    let params = ConnectParams::default().peer_silence_limit(Some(limit));
    let mut conn = listener
        .accept_timeout(DEADLINE, &pd, &cq, &cq, &params)
        .unwrap();
    let buf = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    conn.post_recv(&RecvWr::new(1, &[buf.sge(0, 64).unwrap()]))
        .unwrap();
    let w = wait(&mut cq, 1)[0];
    assert_eq!(
        (w.status, w.byte_len as usize),
        (WcStatus::Success, HELLO.len())
    );
    // A receive that only the peer's silence will end.
    conn.post_recv(&RecvWr::new(2, &[buf.sge(0, 64).unwrap()]))
        .unwrap();

    // An idle but live peer is heard from: its keepalives keep coming.
    std::thread::sleep(limit + KEEPALIVE_INTERVAL * 3);
    assert!(conn.is_peer_connected(), "{:?}", conn.peer_gone_reason());
    assert!(
        conn.peer_silent_for() < limit,
        "{:?}",
        conn.peer_silent_for()
    );
    assert!(drain_for(&mut cq, Duration::ZERO).is_empty());

    signal(peer.pid(), rustix::process::Signal::STOP);
    let stopped = Instant::now();
    eventually("the server notices its stopped client", || {
        !conn.is_peer_connected()
    });
    let took = stopped.elapsed();
    eprintln!("a stopped peer was noticed {took:?} after SIGSTOP (limit {limit:?})");
    assert!(took >= limit - KEEPALIVE_INTERVAL * 2, "{took:?}");
    assert!(conn.peer_silent_for() >= limit - KEEPALIVE_INTERVAL * 2);
    let why = conn.peer_gone_reason().expect("a reason");
    assert!(
        why.contains("keepalive") && why.contains("stopped"),
        "{why}"
    );
    assert_eq!(conn.state(), QpState::Error);
    let w = wait(&mut cq, 1)[0];
    assert_eq!((w.wr_id, w.status), (2, WcStatus::WrFlushErr));
    assert!(!ctx.cm_links()[0].up, "its link is torn down");

    signal(peer.pid(), rustix::process::Signal::CONT);
    peer.kill();
    drop(conn);
    assert!(ctx.cm_links().is_empty());
    drop(listener);
    dir.assert_empty_and_remove();
}

/// Without a limit, nothing ends the connection: the application reads the silence and
/// decides.
#[test]
fn without_a_limit_the_silence_is_only_reported() {
    if let Some((_, path)) = role() {
        let ctx = context(8 << 20);
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let _conn = ctx
            .connect(&path, &pd, &cq, &cq, &ConnectParams::default())
            .unwrap();
        loop {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let _serial = serial();
    let dir = SockDir::new("silent-nolimit");
    let path = dir.sock("server.sock");
    let ctx = context(8 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let listener = ctx.listen(&path).unwrap();
    let peer = spawn_peer(
        "without_a_limit_the_silence_is_only_reported",
        "client",
        path.to_str().unwrap(),
    );
    let conn = listener
        .accept_timeout(DEADLINE, &pd, &cq, &cq, &ConnectParams::default())
        .unwrap();
    eventually("a keepalive arrives", || {
        conn.peer_silent_for() < KEEPALIVE_INTERVAL * 5
    });
    signal(peer.pid(), rustix::process::Signal::STOP);
    let silent = KEEPALIVE_INTERVAL * 10;
    eventually("the silence grows", || conn.peer_silent_for() > silent);
    assert!(conn.is_peer_connected(), "no limit: still connected");
    assert_eq!(conn.state(), QpState::Rts);
    signal(peer.pid(), rustix::process::Signal::CONT);
    eventually("the peer is heard again once it runs", || {
        conn.peer_silent_for() < silent
    });
    peer.kill();
    drop(conn);
    drop(listener);
    dir.assert_empty_and_remove();
}
