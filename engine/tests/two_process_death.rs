//! Peer death: the peer process is killed with SIGKILL while this side has work requests
//! posted. The socket's hang-up moves the QP to the Error state, every posted receive and
//! send completes with a flush error, the link is torn down, and nothing is left behind —
//! whether the dead peer was the client or the server.
mod cm_support;

use std::time::Instant;

use cm_support::*;
use shmhca::*;

const SERVER_DIES: &str = "the_server_is_killed_and_the_client_flushes";
const CLIENT_DIES: &str = "the_client_is_killed_and_the_server_flushes";
const READY: u32 = 0x0EAD_0001;

/// The doomed peer: says ready, posts no receives (so our Sends get RNR NAKs and stay
/// outstanding), and keeps its engine running until it is killed.
fn doomed(conn: &mut Connection, cq: &mut Cq) -> ! {
    conn.post_send(&SendWr::new(1, SendOp::SendWithImm(READY), &[]))
        .unwrap();
    assert_eq!(wait(cq, 1)[0].status, WcStatus::Success);
    loop {
        let _ = cq.poll(&mut [WorkCompletion::default(); 8]);
        std::thread::yield_now();
    }
}

/// The survivor: posts receives and Sends, kills the peer, and checks everything flushes.
fn survive(ctx: &Context, pd: &Pd, conn: &mut Connection, cq: &mut Cq, peer: Peer) {
    let buf = pd.alloc_mr(64 << 10, AccessFlags::LOCAL_WRITE).unwrap();
    conn.post_recv(&RecvWr::new(100, &[buf.sge(0, 64).unwrap()]))
        .unwrap();
    let ready = wait(cq, 1)[0];
    assert_eq!(
        (ready.status, ready.imm_data),
        (WcStatus::Success, Some(READY))
    );
    for i in 0..8u64 {
        conn.post_recv(&RecvWr::new(i, &[buf.sge(i * 1024, 1024).unwrap()]))
            .unwrap();
    }
    for i in 0..4u64 {
        let sgl = [buf.sge(32 << 10, 3000).unwrap()];
        conn.post_send(&SendWr::new(10 + i, SendOp::Send, &sgl))
            .unwrap();
    }
    // The peer has no receive posted: our Sends are RNR NAKed and retried for ever.
    let early = drain_for(cq, std::time::Duration::from_millis(50));
    assert!(
        early.is_empty(),
        "nothing completes while the peer lives: {early:?}"
    );
    assert!(conn.is_peer_connected());

    let killed = Instant::now();
    peer.kill();
    let mut wcs = wait(cq, 12);
    let took = killed.elapsed();
    wcs.sort_by_key(|w| w.wr_id);
    let ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13]);
    for w in &wcs {
        assert_eq!(w.status, WcStatus::WrFlushErr, "{w:?}");
    }
    eprintln!("all 12 work requests flushed {took:?} after SIGKILL");
    assert_eq!(conn.state(), QpState::Error);
    assert!(!conn.is_peer_connected());
    let why = conn.peer_gone_reason().expect("a reason");
    assert!(why.contains("closed") || why.contains("ended"), "{why}");
    let links = ctx.cm_links();
    assert_eq!(links.len(), 1, "{links:?}");
    assert!(!links[0].up, "the dead peer's link is torn down");
    assert_eq!((links[0].connections, links[0].live_connections), (1, 0));
    // A QP in the Error state flushes new work at once.
    conn.post_recv(&RecvWr::new(77, &[buf.sge(0, 8).unwrap()]))
        .unwrap();
    let w = wait(cq, 1)[0];
    assert_eq!((w.wr_id, w.status), (77, WcStatus::WrFlushErr));
}

#[test]
fn the_client_is_killed_and_the_server_flushes() {
    if let Some((_, path)) = role() {
        let ctx = context(8 << 20);
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(64).unwrap();
        let mut conn = ctx
            .connect(&path, &pd, &cq, &cq, &ConnectParams::default())
            .unwrap();
        doomed(&mut conn, &mut cq);
    }
    let _serial = serial();
    let shm_before = dev_shm_entries();
    let dir = SockDir::new("death-c");
    let path = dir.sock("server.sock");
    let ctx = context(8 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(64).unwrap();
    let listener = ctx.listen(&path).unwrap();
    let peer = spawn_peer(CLIENT_DIES, "client", path.to_str().unwrap());
    let mut conn = listener
        .accept_timeout(DEADLINE, &pd, &cq, &cq, &ConnectParams::default())
        .unwrap();
    survive(&ctx, &pd, &mut conn, &mut cq, peer);
    drop(conn);
    assert!(
        ctx.cm_links().is_empty(),
        "the link is removed with its last connection"
    );
    drop(listener);
    dir.assert_empty_and_remove();
    assert_eq!(dev_shm_entries(), shm_before);
}

#[test]
fn the_server_is_killed_and_the_client_flushes() {
    if let Some((_, path)) = role() {
        let ctx = context(8 << 20);
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(64).unwrap();
        let listener = ctx.listen(&path).unwrap();
        let mut conn = listener
            .accept_timeout(DEADLINE, &pd, &cq, &cq, &ConnectParams::default())
            .unwrap();
        doomed(&mut conn, &mut cq);
    }
    let _serial = serial();
    let shm_before = dev_shm_entries();
    let dir = SockDir::new("death-s");
    let path = dir.sock("server.sock");
    let ctx = context(8 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(64).unwrap();
    let peer = spawn_peer(SERVER_DIES, "server", path.to_str().unwrap());
    // The socket file appears at bind(), a moment before listen(): retry until it listens.
    let start = Instant::now();
    let mut conn = loop {
        match ctx.connect(&path, &pd, &cq, &cq, &ConnectParams::default()) {
            Ok(c) => break c,
            Err(e) if start.elapsed() < DEADLINE => {
                let msg = e.to_string();
                assert!(
                    msg.contains("no such socket") || msg.contains("nobody listens"),
                    "{msg}"
                );
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            Err(e) => panic!("the server never listened: {e}"),
        }
    };
    assert_eq!(conn.peer_pid(), peer.pid());
    survive(&ctx, &pd, &mut conn, &mut cq, peer);
    drop(conn);
    assert!(ctx.cm_links().is_empty());
    // The killed server could not remove its socket file: a new listener replaces it.
    assert!(exists(&path), "a SIGKILLed listener leaves its socket file");
    let listener = ctx.listen(&path).expect("a stale socket is replaced");
    drop(listener);
    dir.assert_empty_and_remove();
    assert_eq!(dev_shm_entries(), shm_before);
}
