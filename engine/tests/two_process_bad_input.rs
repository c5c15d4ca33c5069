//! Bad input across a real process boundary: a peer refused by its uid (SO_PEERCRED sees
//! the other process), a peer that speaks garbage, and a message larger than the peer's
//! receive buffer. Each side gets a clear error, the listener stays usable, nothing hangs
//! and nothing is left behind.
mod cm_support;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use cm_support::*;
use shmhca::cm::PeerPolicy;
use shmhca::*;

const REFUSED: &str = "a_peer_of_a_refused_uid_is_told_why_and_the_listener_serves_the_next";
const TOO_BIG: &str = "a_message_larger_than_the_peers_receive_buffer_fails_on_both_sides";

#[test]
fn a_peer_of_a_refused_uid_is_told_why_and_the_listener_serves_the_next() {
    if let Some((role, path)) = role() {
        let ctx = context(4 << 20);
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(8).unwrap();
        match role.as_str() {
            "refused" => {
                let e = ctx
                    .connect(&path, &pd, &cq, &cq, &ConnectParams::default())
                    .unwrap_err();
                let e = e.to_string();
                assert!(
                    e.contains("server rejected the connection (peer refused)"),
                    "{e}"
                );
                assert!(e.contains("admits only uid"), "{e}");
                assert!(ctx.cm_links().is_empty());
            }
            "garbage" => {
                let mut s = UnixStream::connect(&path).unwrap();
                s.write_all(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 TLS hello?")
                    .unwrap();
                // Everything the server sent, up to its close (a reset, as our garbage was
                // left unread, comes after the data).
                let mut reply = Vec::new();
                let _ = s.read_to_end(&mut reply);
                // The HELLO, then a REJ that says why.
                assert!(reply.starts_with(b"SHMHCACM"), "{reply:?}");
                let text = String::from_utf8_lossy(&reply);
                assert!(text.contains("not a shmhca connection manager"), "{text}");
            }
            "good" => {
                let conn = ctx
                    .connect(&path, &pd, &cq, &cq, &ConnectParams::default())
                    .unwrap();
                assert_eq!(conn.state(), QpState::Rts);
            }
            r => panic!("unknown role {r}"),
        }
        return;
    }
    let _serial = serial();
    let dir = SockDir::new("refused");
    let path = dir.sock("svc.sock");
    let ctx = context(4 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8).unwrap();
    let free = ctx.arena_free();
    let mut listener = ctx.listen(&path).unwrap();
    let me = rustix::process::geteuid().as_raw();
    listener.set_peer_policy(PeerPolicy::Uid(me + 1));
    let arg = path.to_str().unwrap();

    let peer = spawn_peer(REFUSED, "refused", arg);
    let e = listener
        .accept_timeout(DEADLINE, &pd, &cq, &cq, &ConnectParams::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("refused the client (pid {})", peer.pid())),
        "{e}"
    );
    assert!(e.contains(&format!("runs as uid {me}")), "{e}");
    peer.expect_success();

    listener.set_peer_policy(PeerPolicy::SameUser);
    let peer = spawn_peer(REFUSED, "garbage", arg);
    let e = listener
        .accept_timeout(DEADLINE, &pd, &cq, &cq, &ConnectParams::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a shmhca connection manager"), "{e}");
    peer.expect_success();
    assert!(ctx.cm_links().is_empty());
    assert_eq!(ctx.arena_free(), free);

    let peer = spawn_peer(REFUSED, "good", arg);
    let conn = listener
        .accept_timeout(DEADLINE, &pd, &cq, &cq, &ConnectParams::default())
        .unwrap();
    assert_eq!(conn.peer_pid(), peer.pid());
    peer.expect_success();
    drop(conn);
    drop(listener);
    assert!(ctx.cm_links().is_empty());
    assert_eq!(ctx.arena_free(), free);
    dir.assert_empty_and_remove();
}

#[test]
fn a_message_larger_than_the_peers_receive_buffer_fails_on_both_sides() {
    if let Some((_, path)) = role() {
        let ctx = context(4 << 20);
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(8).unwrap();
        let mut conn = ctx
            .connect(&path, &pd, &cq, &cq, &ConnectParams::default())
            .unwrap();
        let buf = pd.alloc_mr(100, AccessFlags::LOCAL_WRITE).unwrap();
        conn.post_recv(&RecvWr::new(1, &[buf.sge(0, 100).unwrap()]))
            .unwrap();
        let wc = wait(&mut cq, 1)[0];
        assert_eq!((wc.wr_id, wc.status), (1, WcStatus::LocLenErr), "{wc:?}");
        // Keep the engine running until the parent has seen its error and hung up.
        while conn.is_peer_connected() {
            let _ = cq.poll(&mut [WorkCompletion::default(); 4]);
            std::thread::yield_now();
        }
        return;
    }
    let _serial = serial();
    let dir = SockDir::new("toobig");
    let path = dir.sock("svc.sock");
    let ctx = context(4 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(8).unwrap();
    let listener = ctx.listen(&path).unwrap();
    let peer = spawn_peer(TOO_BIG, "client", path.to_str().unwrap());
    let mut conn = listener
        .accept_timeout(DEADLINE, &pd, &cq, &cq, &ConnectParams::default())
        .unwrap();
    let src = pd.alloc_mr(4096, AccessFlags::NONE).unwrap();
    conn.post_send(&SendWr::new(9, SendOp::Send, &[src.sge(0, 3000).unwrap()]))
        .unwrap();
    let wc = wait(&mut cq, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status),
        (9, WcStatus::RemInvReqErr),
        "3000 bytes into a 100-byte receive: {wc:?}"
    );
    drop(conn);
    peer.expect_success();
    drop(listener);
    assert!(ctx.cm_links().is_empty());
    dir.assert_empty_and_remove();
}
