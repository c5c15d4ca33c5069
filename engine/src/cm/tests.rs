//! Connection-manager tests that need the crate's insides: raw peers built from the
//! channel and message code, link and engine state checked directly.

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use shmhca_rings::fdpass::send_with_fds;
use shmhca_rings::segment::HugePages;

use super::channel::Chan;
use super::msg::{LinkMode, Message, Req};
use super::*;
use crate::link::{self, LinkId};
use crate::qp::{AccessFlags, QpState};
use crate::wire::Qpn;
use crate::{Context, EngineMode};

fn ctx() -> Context {
    Context::builder()
        .arena_size(4 << 20)
        .huge_pages(HugePages::Never)
        .mode(EngineMode::Inline)
        .build()
        .unwrap()
}

fn sock(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("shmhca-cm-unit-{tag}-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

fn read_msg(s: &UnixStream, max_fds: usize) -> (Message, Vec<OwnedFd>) {
    let chan = Chan {
        stream: s,
        path: Path::new("raw"),
        peer: "server",
        deadline: Instant::now() + Duration::from_secs(30),
        timeout: Duration::from_secs(30),
        drive: None,
    };
    chan.recv("a message", max_fds)
        .map_err(|f| f.error)
        .unwrap()
}

#[test]
fn a_client_that_stops_after_req_leaves_the_server_clean() {
    let server = ctx();
    let client = ctx();
    let path = sock("stop-after-req");
    let listener = server.listen(&path).unwrap();
    let (pd, cq) = (server.alloc_pd().unwrap(), server.create_cq(8).unwrap());
    let free = server.arena_free();
    let p = path.clone();
    let raw = std::thread::spawn(move || {
        // A client that does everything right up to the REQ, then goes quiet.
        let s = UnixStream::connect(&p).unwrap();
        let Message::Hello(_) = read_msg(&s, 0).0 else {
            panic!("no HELLO")
        };
        let seg = link::create_link_segment(64, HugePages::Never).unwrap();
        let offer = ConnectParams::default().offer(Qpn::new(0x1002), 5);
        let req = Message::Req(Req {
            identity: 0xabc,
            trace_id: 3,
            link_mode: LinkMode::New,
            arena_layout: super::msg::ArenaLayout::Segment,
            link_token: 0x77,
            offer,
            private_data: vec![],
        });
        let client_pd = client.alloc_pd().unwrap();
        let (arena, _) = super::segments::share_arena(&client.shared, &client_pd).unwrap();
        let page = client.shared.engine_page.share_fd().unwrap();
        send_with_fds(
            &s,
            &req.encode(),
            &[seg.as_fd(), page.as_fd(), arena.as_fd()],
        )
        .unwrap();
        let (rep, fds) = read_msg(&s, 2);
        assert!(matches!(rep, Message::Rep(_)), "{rep:?}");
        assert_eq!(
            fds.len(),
            2,
            "the server's engine page and arena travel with the REP"
        );
        std::thread::sleep(Duration::from_millis(600));
    });
    // While the server waits for the RTU, its link and QP exist.
    let err = listener
        .accept(
            &pd,
            &cq,
            &cq,
            &ConnectParams::default().handshake_timeout(Duration::from_millis(300)),
        )
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("no RTU") && msg.contains("stopped half-way"),
        "{msg}"
    );
    raw.join().unwrap();
    assert!(server.cm_links().is_empty());
    assert!(
        server
            .shared
            .engine
            .with(|e| e.link_mut(LinkId::new(0)).is_none()),
        "the link made from the REQ is removed from the engine"
    );
    assert_eq!(server.arena_free(), free, "the QP's staging is freed");
    drop(listener);
    assert!(!path.exists());
}

#[test]
fn concurrent_connects_to_one_peer_make_one_link() {
    let server = ctx();
    let client = Arc::new(ctx());
    let path = sock("concurrent");
    let listener = server.listen(&path).unwrap();
    let (pd, cq) = (server.alloc_pd().unwrap(), server.create_cq(64).unwrap());
    let threads: Vec<_> = (0..6)
        .map(|_| {
            let (c, p) = (client.clone(), path.clone());
            std::thread::spawn(move || {
                let (pd, cq) = (c.alloc_pd().unwrap(), c.create_cq(8).unwrap());
                let conn = c
                    .connect(&p, &pd, &cq, &cq, &ConnectParams::default())
                    .unwrap();
                (conn.link(), conn, pd, cq)
            })
        })
        .collect();
    let accepted: Vec<_> = (0..6)
        .map(|_| {
            listener
                .accept(&pd, &cq, &cq, &ConnectParams::default())
                .unwrap()
        })
        .collect();
    let made: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(
        made.iter().all(|m| m.0 == made[0].0),
        "one link on the client"
    );
    assert!(accepted.iter().all(|c| c.link() == accepted[0].link()));
    assert_eq!(client.cm_links().len(), 1, "{:?}", client.cm_links());
    assert_eq!(server.cm_links().len(), 1);
    assert_eq!(server.cm_links()[0].connections, 6);
    drop(made);
    drop(accepted);
    assert!(client.cm_links().is_empty() && server.cm_links().is_empty());
}

#[test]
fn a_context_can_connect_to_its_own_listener() {
    let c = Arc::new(ctx());
    let path = sock("self");
    let listener = c.listen(&path).unwrap();
    let (c2, p) = (c.clone(), path.clone());
    let t = std::thread::spawn(move || {
        let (pd, cq) = (c2.alloc_pd().unwrap(), c2.create_cq(8).unwrap());
        let conn = c2
            .connect(&p, &pd, &cq, &cq, &ConnectParams::default())
            .unwrap();
        (conn, pd, cq)
    });
    let (pd, mut cq) = (c.alloc_pd().unwrap(), c.create_cq(8).unwrap());
    let mut a = listener
        .accept(&pd, &cq, &cq, &ConnectParams::default())
        .unwrap();
    let (mut b, bpd, mut bcq) = t.join().unwrap();
    assert_eq!(a.peer_engine(), c.engine_identity());
    assert_ne!(
        a.link(),
        b.link(),
        "each end of the segment is its own link"
    );
    // A second connection in the other direction reuses the pair.
    let (c3, p) = (c.clone(), path.clone());
    let t = std::thread::spawn(move || {
        let (pd, cq) = (c3.alloc_pd().unwrap(), c3.create_cq(8).unwrap());
        let conn = c3
            .connect(&p, &pd, &cq, &cq, &ConnectParams::default())
            .unwrap();
        (conn, pd, cq)
    });
    let a2 = listener
        .accept(&pd, &cq, &cq, &ConnectParams::default())
        .unwrap();
    let (b2, _pd2, _cq2) = t.join().unwrap();
    // Either end may serve either role: the same two links, crossed or not.
    let mut first = [a.link(), b.link()];
    let mut second = [a2.link(), b2.link()];
    first.sort();
    second.sort();
    assert_eq!(first, second, "no new link");
    assert_eq!(c.cm_links().len(), 2);
    // Traffic over the loop.
    let src = bpd.alloc_mr(64, AccessFlags::NONE).unwrap();
    let dst = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, b"to myself").unwrap();
    a.post_recv(&crate::RecvWr::new(1, &[dst.sge(0, 64).unwrap()]))
        .unwrap();
    b.post_send(&crate::SendWr::new(
        2,
        crate::SendOp::Send,
        &[src.sge(0, 9).unwrap()],
    ))
    .unwrap();
    let mut wc = [crate::WorkCompletion::default(); 1];
    let start = Instant::now();
    while cq.poll(&mut wc) == 0 {
        assert!(start.elapsed() < Duration::from_secs(30));
    }
    assert_eq!(
        (wc[0].status, wc[0].byte_len),
        (crate::WcStatus::Success, 9)
    );
    while bcq.poll(&mut wc) == 0 {
        assert!(start.elapsed() < Duration::from_secs(30));
    }
    let mut got = [0u8; 9];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"to myself");
}

/// A connected pair of contexts in this process (the accept runs on a thread).
fn connected(server: &Arc<Context>, client: &Context, path: &Path) -> (Connection, Connection) {
    let listener = server.listen(path).unwrap();
    let s = server.clone();
    let t = std::thread::spawn(move || {
        let (pd, cq) = (s.alloc_pd().unwrap(), s.create_cq(8).unwrap());
        listener
            .accept(&pd, &cq, &cq, &ConnectParams::default())
            .unwrap()
    });
    let (pd, cq) = (client.alloc_pd().unwrap(), client.create_cq(8).unwrap());
    let c = client
        .connect(path, &pd, &cq, &cq, &ConnectParams::default())
        .unwrap();
    (t.join().unwrap(), c)
}

fn eventually(what: &str, f: impl Fn() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(30), "never: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn bytes_after_setup_end_the_connection_on_both_sides() {
    let server = Arc::new(ctx());
    let client = ctx();
    let (s, c) = connected(&server, &client, &sock("late-bytes"));
    (&*c.stream).write_all(b"surprise").unwrap();
    eventually("the server drops the connection", || !s.is_peer_connected());
    let why = s.peer_gone_reason().unwrap();
    assert!(
        why.contains("sent data other than keepalives on the connection socket after setup"),
        "{why}"
    );
    assert_eq!(s.state(), QpState::Error);
    eventually("the client sees the server close it", || {
        !c.is_peer_connected()
    });
    assert_eq!(c.state(), QpState::Error);
}

#[test]
fn keepalives_split_across_writes_are_heard_and_a_bad_byte_inside_one_is_not() {
    let server = Arc::new(ctx());
    let client = ctx();
    let (s, c) = connected(&server, &client, &sock("split-keepalive"));
    let ka = Message::Keepalive.encode();
    // The test sends the client's keepalives itself, in halves: its watcher stops sending.
    c.watcher.remove(c.key);
    for _ in 0..3 {
        (&*c.stream).write_all(&ka[..5]).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        (&*c.stream).write_all(&ka[5..]).unwrap();
    }
    std::thread::sleep(KEEPALIVE_INTERVAL * 2);
    assert!(s.is_peer_connected(), "{:?}", s.peer_gone_reason());
    assert!(s.peer_silent_for() < KEEPALIVE_INTERVAL * 5);
    // A keepalive with one byte changed (here: another message type) is garbage.
    let mut bad = ka.clone();
    bad[10] = 4; // RTU
    (&*c.stream).write_all(&bad).unwrap();
    eventually("the server drops the connection", || !s.is_peer_connected());
    let why = s.peer_gone_reason().unwrap();
    assert!(why.contains("other than keepalives"), "{why}");
}

#[test]
fn silence_limits_shorter_than_three_keepalives_are_refused() {
    let p = ConnectParams::default().peer_silence_limit(Some(KEEPALIVE_INTERVAL * 2));
    match p.validate() {
        Err(crate::Error::InvalidArgument { name, .. }) => assert_eq!(name, "peer_silence_limit"),
        other => panic!("{other:?}"),
    }
    let p = ConnectParams::default().peer_silence_limit(Some(KEEPALIVE_INTERVAL * 3));
    assert!(p.validate().is_ok());
}

#[test]
fn a_link_the_engine_tore_down_is_not_reused() {
    let server = Arc::new(ctx());
    let client = ctx();
    let path = sock("broken-link");
    let (s1, c1) = connected(&server, &client, &path);
    // The engine finds the peer broke a ring: the link is down in the engine only.
    client
        .shared
        .engine
        .with(|e| e.link_down(c1.link(), "a ring index out of range".into()));
    let (s2, c2) = connected(&server, &client, &path);
    assert_ne!(c2.link(), c1.link(), "a new link, not the broken one");
    assert_ne!(s2.link(), s1.link());
    assert_eq!(c2.state(), QpState::Rts);
    let links = client.cm_links();
    assert_eq!(links.len(), 2);
    assert!(links.iter().any(|l| l.id == c1.link() && !l.up));
}

#[test]
fn poll_mode_engines_connect_exchange_and_see_a_close() {
    let poll = || {
        Arc::new(
            Context::builder()
                .arena_size(4 << 20)
                .huge_pages(HugePages::Never)
                .mode(EngineMode::Poll { cpu: None })
                .idle(crate::IdlePolicy::Backoff {
                    spins: 100,
                    max_sleep: Duration::from_micros(200),
                })
                .build()
                .unwrap(),
        )
    };
    let (server, client) = (poll(), poll());
    let path = sock("poll-mode");
    let listener = server.listen(&path).unwrap();
    let s2 = server.clone();
    let t = std::thread::spawn(move || {
        let (pd, mut cq) = (s2.alloc_pd().unwrap(), s2.create_cq(8).unwrap());
        let mut conn = listener
            .accept(&pd, &cq, &cq, &ConnectParams::default())
            .unwrap();
        let buf = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        conn.post_recv(&crate::RecvWr::new(1, &[buf.sge(0, 64).unwrap()]))
            .unwrap();
        conn.post_recv(&crate::RecvWr::new(2, &[buf.sge(0, 64).unwrap()]))
            .unwrap();
        let mut wc = [crate::WorkCompletion::default(); 2];
        let start = Instant::now();
        let mut n = 0;
        // The first receive gets the message; the second is flushed when the client
        // closes the connection.
        while n < 2 {
            n += cq.poll(&mut wc[n..]);
            assert!(start.elapsed() < Duration::from_secs(30), "{wc:?}");
        }
        assert_eq!((wc[0].wr_id, wc[0].status), (1, crate::WcStatus::Success));
        assert_eq!(
            (wc[1].wr_id, wc[1].status),
            (2, crate::WcStatus::WrFlushErr)
        );
        assert!(!conn.is_peer_connected());
        assert_eq!(conn.state(), QpState::Error);
    });
    let (pd, mut cq) = (client.alloc_pd().unwrap(), client.create_cq(8).unwrap());
    let mut conn = client
        .connect(&path, &pd, &cq, &cq, &ConnectParams::default())
        .unwrap();
    conn.post_send(&crate::SendWr::inline(7, crate::SendOp::Send, b"poll mode"))
        .unwrap();
    let mut wc = [crate::WorkCompletion::default(); 1];
    let start = Instant::now();
    while cq.poll(&mut wc) == 0 {
        assert!(start.elapsed() < Duration::from_secs(30));
    }
    assert_eq!(wc[0].status, crate::WcStatus::Success);
    drop(conn);
    t.join().unwrap();
    assert!(client.cm_links().is_empty());
}
