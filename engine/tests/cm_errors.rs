//! Bad input to the connection manager: wrong paths, peers that are not shmhca, refused
//! peers, invalid or incompatible parameters, peers that stop half-way, malformed
//! messages and descriptors. Each gets a clear error naming the problem on the side that
//! detects it (and, where the peer can be told, a REJ saying why), nothing panics or hangs,
//! and nothing is left behind: no link, no QP staging in the arena, no socket file.
//!
//! The misbehaving peers are raw Unix sockets in a thread of this process, speaking (or
//! failing to speak) the documented message format of [`shmhca::cm::msg`].
mod cm_support;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::thread::JoinHandle;
use std::time::Duration;

use cm_support::*;
use shmhca::cm::msg::{
    ArenaLayout, HEADER_LEN, Header, LinkMode, MAGIC, Message, Offer, Rej, RejectReason, Rep, Req,
    VERSION,
};
use shmhca::cm::{ConnectParams, PeerPolicy};
use shmhca::*;

/// A context, a PD and a CQ, with the arena's free bytes at the start.
struct Side {
    ctx: Context,
    pd: Pd,
    cq: Cq,
    free: u64,
}

fn side() -> Side {
    let ctx = context(4 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let free = ctx.arena_free();
    Side { ctx, pd, cq, free }
}

impl Side {
    fn connect(&self, path: &Path, params: &ConnectParams) -> Result<Connection> {
        self.ctx.connect(path, &self.pd, &self.cq, &self.cq, params)
    }

    fn accept(&self, l: &Listener, params: &ConnectParams) -> Result<Connection> {
        l.accept_timeout(DEADLINE, &self.pd, &self.cq, &self.cq, params)
    }

    /// Nothing of a failed setup is left: no link, no QP staging.
    fn assert_clean(&self) {
        assert!(self.ctx.cm_links().is_empty(), "{:?}", self.ctx.cm_links());
        assert_eq!(
            self.ctx.arena_free(),
            self.free,
            "the arena got its bytes back"
        );
    }
}

fn short() -> ConnectParams {
    ConnectParams::default().handshake_timeout(Duration::from_millis(300))
}

fn connect_error(e: Error) -> String {
    match e {
        Error::Connect(m) => m,
        other => panic!("expected Error::Connect, got {other:?}"),
    }
}

fn write_msg(s: &mut UnixStream, m: &Message) {
    s.write_all(&m.encode()).unwrap();
}

fn read_msg(s: &mut UnixStream) -> Message {
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let h = Header::parse(&h).unwrap();
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).unwrap();
    Message::decode(h.msg_type, &body).unwrap()
}

fn read_rej(s: &mut UnixStream) -> Rej {
    match read_msg(s) {
        Message::Rej(r) => r,
        m => panic!("expected a REJ, got {m:?}"),
    }
}

/// Connects a raw client and reads the server's HELLO.
fn raw_client(path: &Path) -> UnixStream {
    let mut s = UnixStream::connect(path).unwrap();
    assert!(matches!(read_msg(&mut s), Message::Hello(_)));
    s
}

/// A plausible offer (what a real client would send).
fn offer() -> Offer {
    Offer {
        qpn: 0x1002,
        start_psn: 77,
        pmtu: 4096,
        local_ack_timeout: 14,
        target_ack_delay: 0,
        retry_count: 7,
        rnr_retry_count: 7,
        min_rnr_timer: 12,
        credits: 1,
        responder_resources: 4,
        initiator_depth: 4,
        max_send_wr: 128,
        max_recv_wr: 128,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    }
}

fn req(mode: LinkMode, offer: Offer) -> Message {
    Message::Req(Req {
        identity: 0x1234_5678,
        trace_id: 1,
        link_mode: mode,
        arena_layout: ArenaLayout::Segment,
        link_token: 99,
        offer,
        private_data: Vec::new(),
    })
}

/// A raw server at `path` that serves one client with `f`.
fn raw_server(path: &Path, f: impl FnOnce(UnixStream) + Send + 'static) -> JoinHandle<()> {
    let l = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        f(s);
    })
}

/// A client with `params` connects to a raw server served by `f` (at a fresh path under a
/// directory named `name`); returns the client's error message, once the server is done,
/// the client has left nothing behind and the directory is empty again.
fn client_error_against(
    name: &str,
    params: &ConnectParams,
    f: impl FnOnce(UnixStream) + Send + 'static,
) -> String {
    let c = side();
    let dir = SockDir::new(name);
    let path = dir.sock("svc.sock");
    let srv = raw_server(&path, f);
    let e = connect_error(c.connect(&path, params).unwrap_err());
    srv.join().unwrap();
    c.assert_clean();
    std::fs::remove_file(&path).unwrap();
    dir.assert_empty_and_remove();
    e
}

/// The server's half of a handshake up to the client's REQ: sends HELLO, returns the REQ.
fn hello_then_req(s: &mut UnixStream, identity: u64) -> Req {
    write_msg(
        s,
        &Message::Hello(shmhca::cm::msg::Hello {
            identity,
            trace_id: 1,
        }),
    );
    match read_msg(s) {
        Message::Req(r) => r,
        m => panic!("expected a REQ, got {m:?}"),
    }
}

#[test]
fn a_wrong_path_names_the_problem() {
    let c = side();
    let dir = SockDir::new("err-path");
    let e = connect_error(c.connect(&dir.sock("nobody.sock"), &short()).unwrap_err());
    assert!(
        e.contains("nobody.sock") && e.contains("no such socket"),
        "{e}"
    );
    // A regular file is not a socket.
    let file = dir.sock("file");
    std::fs::write(&file, b"not a socket").unwrap();
    let e = connect_error(c.connect(&file, &short()).unwrap_err());
    assert!(e.contains("not a socket"), "{e}");
    // Listening there refuses to replace it, and leaves it alone.
    let e = connect_error(c.ctx.listen(&file).unwrap_err());
    assert!(e.contains("not a socket") && e.contains("refusing"), "{e}");
    assert_eq!(std::fs::read(&file).unwrap(), b"not a socket");
    std::fs::remove_file(&file).unwrap();
    // A directory that does not exist; a path too long for a Unix socket.
    let e = connect_error(c.ctx.listen(dir.sock("no/such/dir.sock")).unwrap_err());
    assert!(e.contains("directory does not exist"), "{e}");
    let long = dir.sock(&"x".repeat(120));
    let e = connect_error(c.ctx.listen(&long).unwrap_err());
    assert!(e.contains("108 bytes"), "{e}");
    c.assert_clean();
    dir.assert_empty_and_remove();
}

#[test]
fn a_live_listener_keeps_its_path_and_a_stale_one_is_replaced() {
    let s = side();
    let c = side();
    let dir = SockDir::new("err-live");
    let path = dir.sock("svc.sock");
    let first = s.ctx.listen(&path).unwrap();
    let e = connect_error(s.ctx.listen(&path).unwrap_err());
    assert!(e.contains("live listener"), "{e}");
    // The probe that found it alive is skipped by accept: the next client is served.
    let p = path.clone();
    let client = std::thread::spawn(move || {
        let conn = c.connect(&p, &ConnectParams::default()).unwrap();
        assert_eq!(conn.state(), QpState::Rts);
    });
    let conn = s.accept(&first, &ConnectParams::default()).unwrap();
    client.join().unwrap();
    drop(conn);
    drop(first);
    assert!(!exists(&path), "the listener removes its path");
    // A socket file whose listener is gone (std does not remove it) is replaced.
    drop(UnixListener::bind(&path).unwrap());
    assert!(exists(&path));
    let again = s.ctx.listen(&path).expect("a stale socket is replaced");
    drop(again);
    dir.assert_empty_and_remove();
}

#[test]
fn a_listener_does_not_remove_a_successors_socket() {
    let s = side();
    let dir = SockDir::new("err-succ");
    let path = dir.sock("svc.sock");
    let l = s.ctx.listen(&path).unwrap();
    // Someone removes our socket and another listener takes the path.
    std::fs::remove_file(&path).unwrap();
    let other = UnixListener::bind(&path).unwrap();
    drop(l);
    assert!(exists(&path), "the successor's socket stays");
    drop(other);
    std::fs::remove_file(&path).unwrap();
    dir.assert_empty_and_remove();
}

#[test]
fn garbage_from_a_client_is_rejected_and_the_listener_stays_usable() {
    let s = side();
    let dir = SockDir::new("err-garbage-c");
    let path = dir.sock("svc.sock");
    let l = s.ctx.listen(&path).unwrap();
    let p = path.clone();
    let raw = std::thread::spawn(move || {
        let mut c = raw_client(&p);
        c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        read_rej(&mut c)
    });
    let e = connect_error(s.accept(&l, &short()).unwrap_err());
    assert!(
        e.contains("not a shmhca connection manager") && e.contains("GET / HT"),
        "{e}"
    );
    let rej = raw.join().unwrap();
    assert_eq!(rej.reason, RejectReason::ProtocolError);
    assert!(rej.text.contains("not a shmhca"), "{}", rej.text);
    s.assert_clean();

    // Still listening: a real client gets through.
    let c = side();
    let p = path.clone();
    let t = std::thread::spawn(move || drop(c.connect(&p, &ConnectParams::default()).unwrap()));
    drop(s.accept(&l, &ConnectParams::default()).unwrap());
    t.join().unwrap();
    drop(l);
    dir.assert_empty_and_remove();
}

#[test]
fn garbage_from_a_server_is_an_error_for_the_client() {
    let e = client_error_against("err-garbage-s", &short(), |mut s| {
        s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n").unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    assert!(
        e.contains("not a shmhca connection manager") && e.contains("SSH-2.0-"),
        "{e}"
    );
}

#[test]
fn a_silent_server_times_out() {
    let e = client_error_against("err-silent", &short(), |mut s| {
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest); // says nothing until the client gives up
    });
    assert!(
        e.contains("no HELLO") && e.contains("stopped half-way"),
        "{e}"
    );
}

#[test]
fn a_server_that_stops_after_hello_times_out() {
    let e = client_error_against("err-after-hello", &short(), |mut s| {
        hello_then_req(&mut s, 7);
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest); // never answers
    });
    assert!(
        e.contains("no REP") && e.contains("stopped half-way"),
        "{e}"
    );
}

#[test]
fn a_client_that_stops_or_hangs_up_half_way() {
    let s = side();
    let dir = SockDir::new("err-half");
    let path = dir.sock("svc.sock");
    let l = s.ctx.listen(&path).unwrap();
    // Reads the HELLO, then says nothing.
    let p = path.clone();
    let raw = std::thread::spawn(move || {
        let c = raw_client(&p);
        std::thread::sleep(Duration::from_millis(600));
        drop(c);
    });
    let e = connect_error(s.accept(&l, &short()).unwrap_err());
    assert!(
        e.contains("no REQ") && e.contains("stopped half-way"),
        "{e}"
    );
    raw.join().unwrap();
    // Sends half a header, then hangs up.
    let p = path.clone();
    let raw = std::thread::spawn(move || {
        let mut c = raw_client(&p);
        c.write_all(&MAGIC[..5]).unwrap();
    });
    let e = connect_error(s.accept(&l, &short()).unwrap_err());
    assert!(
        e.contains("closed the connection while this side waited for REQ"),
        "{e}"
    );
    raw.join().unwrap();
    s.assert_clean();
    drop(l);
    dir.assert_empty_and_remove();
}

#[test]
fn an_invalid_offer_is_rejected_naming_the_field_on_both_sides() {
    let s = side();
    let dir = SockDir::new("err-offer");
    let path = dir.sock("svc.sock");
    let l = s.ctx.listen(&path).unwrap();
    let bad = [
        (
            Offer {
                pmtu: 1000,
                ..offer()
            },
            "path MTU",
        ),
        (
            Offer {
                max_recv_wr: 0,
                ..offer()
            },
            "max_recv_wr",
        ),
        (
            Offer {
                max_send_wr: 1 << 20,
                ..offer()
            },
            "max_send_wr",
        ),
        (
            Offer {
                retry_count: 9,
                ..offer()
            },
            "retry_count",
        ),
        (
            Offer {
                initiator_depth: 200,
                ..offer()
            },
            "initiator_depth",
        ),
        (
            Offer {
                start_psn: 1 << 24,
                ..offer()
            },
            "start_psn",
        ),
        (Offer { qpn: 0, ..offer() }, "qpn"),
    ];
    for (o, field) in bad {
        let p = path.clone();
        let raw = std::thread::spawn(move || {
            let mut c = raw_client(&p);
            write_msg(&mut c, &req(LinkMode::ReuseClientCreated, o));
            read_rej(&mut c)
        });
        let e = connect_error(s.accept(&l, &short()).unwrap_err());
        assert!(
            e.contains("REQ is invalid") && e.contains(field),
            "{field}: {e}"
        );
        let rej = raw.join().unwrap();
        assert_eq!(rej.reason, RejectReason::InvalidParameter, "{field}");
        assert!(rej.text.contains(field), "{field}: {}", rej.text);
    }
    s.assert_clean();
    drop(l);
    dir.assert_empty_and_remove();
}

#[test]
fn malformed_messages_are_rejected() {
    let s = side();
    let dir = SockDir::new("err-malformed");
    let path = dir.sock("svc.sock");
    let l = s.ctx.listen(&path).unwrap();
    let cases: Vec<(Vec<u8>, &str, RejectReason)> = vec![
        // Another protocol version.
        (
            {
                let mut b = req(LinkMode::ReuseClientCreated, offer()).encode();
                b[8..10].copy_from_slice(&(VERSION + 1).to_le_bytes());
                b
            },
            Box::leak(
                format!(
                    "version {}, this side speaks version {VERSION}",
                    VERSION + 1
                )
                .into_boxed_str(),
            ),
            RejectReason::UnsupportedVersion,
        ),
        // A body larger than any message.
        (
            {
                let mut b = req(LinkMode::ReuseClientCreated, offer()).encode();
                b[12..16].copy_from_slice(&1_000_000u32.to_le_bytes());
                b
            },
            "exceeds the limit of 1024 bytes",
            RejectReason::ProtocolError,
        ),
        // Private data longer than allowed.
        (
            {
                let mut m = req(LinkMode::ReuseClientCreated, offer());
                if let Message::Req(r) = &mut m {
                    r.private_data = vec![1; 300];
                }
                m.encode()
            },
            "private data is at most 256 bytes",
            RejectReason::ProtocolError,
        ),
        // The wrong message at this point.
        (
            Message::Rtu.encode(),
            "sent RTU where REQ belongs",
            RejectReason::ProtocolError,
        ),
    ];
    for (bytes, expect, reason) in cases {
        let p = path.clone();
        let raw = std::thread::spawn(move || {
            let mut c = raw_client(&p);
            c.write_all(&bytes).unwrap();
            read_rej(&mut c)
        });
        let e = connect_error(s.accept(&l, &short()).unwrap_err());
        assert!(e.contains(expect), "{expect}: {e}");
        let rej = raw.join().unwrap();
        assert_eq!(rej.reason, reason, "{expect}: {}", rej.text);
    }
    s.assert_clean();
    drop(l);
    dir.assert_empty_and_remove();
}

#[test]
fn descriptors_that_are_not_what_the_req_says_are_refused() {
    use shmhca_rings::fdpass::send_with_fds;
    use shmhca_rings::segment::Segment;
    use std::os::fd::AsFd;
    let s = side();
    let dir = SockDir::new("err-fds");
    let path = dir.sock("svc.sock");
    let l = s.ctx.listen(&path).unwrap();
    // The segment kinds (see link.rs and arena.rs).
    const LINK_KIND: u32 = 0x4b4e_494c;
    const ARENA_KIND: u32 = 0x4152_4e41;
    const PAGE_KIND: u32 = 0x4547_4150;
    let (pipe_r, _pipe_w) = std::io::pipe().unwrap();
    let seg = |kind| {
        Segment::builder(kind, 8192)
            .huge_pages(shmhca_rings::HugePages::Never)
            .create()
            .unwrap()
    };
    let (arena, not_a_link) = (seg(ARENA_KIND), seg(LINK_KIND));
    let page = Segment::builder(PAGE_KIND, 4096)
        .huge_pages(shmhca_rings::HugePages::Never)
        .create()
        .unwrap();
    let fd = |s: &Segment| s.try_clone_fd().unwrap();
    let pipe = || pipe_r.as_fd().try_clone_to_owned().unwrap();
    let cases: Vec<(LinkMode, Vec<std::os::fd::OwnedFd>, &str)> = vec![
        (
            LinkMode::New,
            vec![],
            "carries 0 file descriptors instead of 3",
        ),
        (
            LinkMode::ReuseClientCreated,
            vec![pipe(), pipe()],
            "reuses a link but carries 2 file descriptors instead of 1",
        ),
        (
            LinkMode::New,
            vec![pipe(), fd(&page), fd(&arena)],
            "not a memfd",
        ),
        (
            LinkMode::New,
            vec![fd(&arena), fd(&page), fd(&arena)],
            "segment kind",
        ),
        (
            LinkMode::New,
            vec![fd(&not_a_link), fd(&page), fd(&arena)],
            "not shmhca's",
        ),
    ];
    for (mode, fds, expect) in cases {
        let p = path.clone();
        let raw = std::thread::spawn(move || {
            let c = raw_client(&p);
            let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
            send_with_fds(&c, &req(mode, offer()).encode(), &borrowed).unwrap();
            let mut c = c;
            read_rej(&mut c)
        });
        let e = connect_error(s.accept(&l, &short()).unwrap_err());
        assert!(e.contains(expect), "{expect}: {e}");
        let rej = raw.join().unwrap();
        assert!(
            matches!(
                rej.reason,
                RejectReason::ProtocolError | RejectReason::InvalidParameter
            ),
            "{expect}: {rej:?}"
        );
    }
    s.assert_clean();
    drop(l);
    dir.assert_empty_and_remove();
}

#[test]
fn an_unknown_link_token_is_answered_once_then_refused() {
    let s = side();
    let dir = SockDir::new("err-token");
    let path = dir.sock("svc.sock");
    let l = s.ctx.listen(&path).unwrap();
    let p = path.clone();
    let raw = std::thread::spawn(move || {
        use shmhca_rings::fdpass::send_with_fds;
        // A reused link's REQ carries the client's arena.
        let arena = shmhca_rings::segment::Segment::builder(0x4152_4e41, 8192)
            .huge_pages(shmhca_rings::HugePages::Never)
            .create()
            .unwrap();
        let mut c = raw_client(&p);
        let fds = [arena.as_fd()];
        send_with_fds(
            &c,
            &req(LinkMode::ReuseClientCreated, offer()).encode(),
            &fds,
        )
        .unwrap();
        let first = read_rej(&mut c);
        send_with_fds(
            &c,
            &req(LinkMode::ReuseServerCreated, offer()).encode(),
            &fds,
        )
        .unwrap();
        (first, read_rej(&mut c))
    });
    let e = connect_error(s.accept(&l, &short()).unwrap_err());
    assert!(e.contains("unknown link twice"), "{e}");
    let (first, second) = raw.join().unwrap();
    assert_eq!(first.reason, RejectReason::UnknownLink, "{first:?}");
    assert_eq!(second.reason, RejectReason::ProtocolError);
    s.assert_clean();
    drop(l);
    dir.assert_empty_and_remove();
}

#[test]
fn a_server_offering_what_the_client_cannot_do_is_rejected() {
    let cases = [
        (
            Offer {
                pmtu: 1024,
                initiator_depth: 2,
                ..offer()
            },
            RejectReason::ProtocolError,
            "carried 0 file descriptors instead of 2",
        ),
        (
            Offer {
                pmtu: 8192,
                ..offer()
            },
            RejectReason::InvalidParameter,
            "path MTU",
        ),
        (
            Offer {
                pmtu: 4096,
                ..offer()
            },
            RejectReason::Incompatible,
            "above the 1024",
        ),
        (
            Offer {
                pmtu: 1024,
                initiator_depth: 9,
                ..offer()
            },
            RejectReason::Incompatible,
            "initiator depth 9",
        ),
    ];
    for (o, reason, expect) in cases {
        let params = short().mtu(Mtu::Mtu1024).responder_resources(2);
        let e = client_error_against("err-rep", &params, move |mut s| {
            let r = hello_then_req(&mut s, 42);
            assert_eq!(r.link_mode, LinkMode::New);
            let token = r.link_token;
            write_msg(
                &mut s,
                &Message::Rep(Rep {
                    link_token: token,
                    arena_layout: ArenaLayout::Segment,
                    offer: o,
                    private_data: Vec::new(),
                }),
            );
            let rej = read_rej(&mut s);
            assert_eq!(rej.reason, reason, "{}", rej.text);
            assert!(rej.text.contains(expect), "{}", rej.text);
        });
        assert!(e.contains(expect), "{expect}: {e}");
    }
}

#[test]
fn a_refused_user_is_told_on_both_sides() {
    let me = rustix::process::geteuid().as_raw();
    let other = me.wrapping_add(4242);
    let dir = SockDir::new("err-uid");
    let path = dir.sock("svc.sock");

    // The listener admits only another user.
    let s = side();
    let c = side();
    let mut l = s.ctx.listen(&path).unwrap();
    assert_eq!(l.peer_policy(), PeerPolicy::SameUser);
    l.set_peer_policy(PeerPolicy::Uid(other));
    let p = path.clone();
    let client = std::thread::spawn(move || {
        let e = c.connect(&p, &short());
        c.assert_clean();
        connect_error(e.unwrap_err())
    });
    let e = connect_error(s.accept(&l, &short()).unwrap_err());
    assert!(
        e.contains("refused the client") && e.contains(&format!("uid {me}")),
        "{e}"
    );
    assert!(e.contains(&format!("admits only uid {other}")), "{e}");
    let ce = client.join().unwrap();
    assert!(
        ce.contains("server rejected the connection (peer refused)"),
        "{ce}"
    );
    assert!(ce.contains(&format!("admits only uid {other}")), "{ce}");
    s.assert_clean();

    // The client admits only another user as its server.
    l.set_peer_policy(PeerPolicy::AnyUser);
    let c = side();
    let p = path.clone();
    let client = std::thread::spawn(move || {
        let e = c.connect(&p, &short().peer_policy(PeerPolicy::Uid(other)));
        c.assert_clean();
        connect_error(e.unwrap_err())
    });
    let e = connect_error(s.accept(&l, &short()).unwrap_err());
    assert!(
        e.contains("client rejected the connection (peer refused)"),
        "{e}"
    );
    let ce = client.join().unwrap();
    assert!(ce.contains("refused the server"), "{ce}");
    s.assert_clean();

    // Same user: admitted by both defaults.
    let c = side();
    let p = path.clone();
    let client = std::thread::spawn(move || c.connect(&p, &ConnectParams::default()).map(drop));
    let conn = s.accept(&l, &ConnectParams::default()).unwrap();
    assert_eq!(conn.peer_uid(), me);
    client.join().unwrap().unwrap();
    drop(conn);
    drop(l);
    dir.assert_empty_and_remove();
}

#[test]
fn bad_parameters_fail_before_anything_is_sent() {
    let c = side();
    let dir = SockDir::new("err-params");
    let path = dir.sock("svc.sock");
    let l = c.ctx.listen(&path).unwrap();
    let bad = [
        (
            ConnectParams::default().private_data(vec![0; 257]),
            "private_data",
        ),
        (ConnectParams::default().retry_count(8), "retry_count"),
        (
            ConnectParams::default().initiator_depth(17),
            "initiator_depth",
        ),
        (ConnectParams::default().start_psn(1 << 24), "start_psn"),
        (
            ConnectParams::default().handshake_timeout(Duration::ZERO),
            "handshake_timeout",
        ),
        (
            ConnectParams::default().caps(QpCaps {
                max_send_wr: 0,
                ..QpCaps::default()
            }),
            "max_send_wr",
        ),
    ];
    for (p, name) in bad {
        match c.connect(&path, &p) {
            Err(Error::InvalidArgument { name: n, .. }) => assert_eq!(n, name),
            other => panic!("{name}: {other:?}"),
        }
    }
    // Nobody connected.
    let e = connect_error(
        l.accept_timeout(
            Duration::from_millis(100),
            &c.pd,
            &c.cq,
            &c.cq,
            &ConnectParams::default(),
        )
        .unwrap_err(),
    );
    assert!(e.contains("no client connected in time"), "{e}");
    c.assert_clean();
    drop(l);
    dir.assert_empty_and_remove();
}

#[test]
fn objects_of_another_context_are_refused_and_the_server_is_told() {
    let s = side();
    let c = side();
    let stranger = side();
    let dir = SockDir::new("err-foreign");
    let path = dir.sock("svc.sock");
    let l = s.ctx.listen(&path).unwrap();
    let server = std::thread::spawn(move || {
        let e = s.accept(&l, &short());
        s.assert_clean();
        drop(l);
        connect_error(e.unwrap_err())
    });
    // The client's PD belongs to another context: the QP cannot be made.
    let e = c
        .ctx
        .connect(&path, &stranger.pd, &c.cq, &c.cq, &short())
        .unwrap_err();
    assert!(matches!(e, Error::ForeignObject { .. }), "{e:?}");
    let se = server.join().unwrap();
    assert!(
        se.contains("client rejected the connection (setup aborted)"),
        "{se}"
    );
    c.assert_clean();
    dir.assert_empty_and_remove();
}

/// Item 5 of issue 8: a client that sends half a REQ and stalls must not hold an
/// inline-mode server up. `accept_timeout(2 ms)` keeps its deadline (it says no client
/// completed yet), and the server's other connection keeps exchanging messages meanwhile:
/// while the accept call waits, it runs the inline engine.
#[test]
fn a_stalled_handshake_costs_the_servers_other_connections_nothing() {
    const MESSAGES: u64 = 200;
    let mut s = side();
    let dir = SockDir::new("err-stall");
    let path = dir.sock("svc.sock");
    let l = s.ctx.listen(&path).unwrap();
    // Long enough that the stalled handshake outlives the test on a slow machine.
    let server_params = ConnectParams::default().handshake_timeout(Duration::from_secs(30));

    // A well-behaved client that sends numbered messages, each acknowledged.
    let p = path.clone();
    let good = std::thread::spawn(move || {
        let mut c = side();
        let mut conn = c.connect(&p, &ConnectParams::default()).unwrap();
        for i in 0..MESSAGES {
            conn.post_send(&SendWr::inline(i, SendOp::Send, &i.to_le_bytes()))
                .unwrap();
            let wc = wait(&mut c.cq, 1);
            assert_eq!((wc[0].wr_id, wc[0].status), (i, WcStatus::Success));
        }
        conn
    });
    let mut sconn = s.accept(&l, &server_params).unwrap();

    // The stalled client: HELLO read, half a REQ sent, then silence until told to leave.
    // (The HELLO comes from the server's next accept call: handshakes advance in them.)
    let (stalled_tx, stalled_rx) = std::sync::mpsc::channel();
    let (leave_tx, leave_rx) = std::sync::mpsc::channel::<()>();
    let p = path.clone();
    let stalled = std::thread::spawn(move || {
        let mut c = raw_client(&p);
        let bytes = req(LinkMode::New, offer()).encode();
        c.write_all(&bytes[..HEADER_LEN + 10]).unwrap();
        stalled_tx.send(()).unwrap();
        let _ = leave_rx.recv();
    });

    // Receives for the good client's messages, re-posted as they complete.
    let bufs: Vec<_> = (0..32)
        .map(|_| s.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap())
        .collect();
    for (i, b) in bufs.iter().enumerate() {
        sconn
            .post_recv(&RecvWr::new(i as u64, &[b.sge(0, 64).unwrap()]))
            .unwrap();
    }
    let mut next = 0u64;
    let mut wc = [WorkCompletion::default(); 16];
    let mut stalling = false;
    let start = std::time::Instant::now();
    while next < MESSAGES || !stalling {
        assert!(
            start.elapsed() < DEADLINE,
            "only {next} messages arrived (stalled client in place: {stalling})"
        );
        stalling |= stalled_rx.try_recv().is_ok();
        let t = std::time::Instant::now();
        let e = connect_error(
            l.accept_timeout(
                Duration::from_millis(2),
                &s.pd,
                &s.cq,
                &s.cq,
                &server_params,
            )
            .unwrap_err(),
        );
        assert!(
            e.contains("no client connected in time"),
            "a stalled client is no connection and no error yet: {e}"
        );
        // Generous: the old code waited for the whole handshake timeout here.
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        let n = s.cq.poll(&mut wc);
        for w in &wc[..n] {
            assert_eq!(w.status, WcStatus::Success, "{w:?}");
            let b = &bufs[w.wr_id as usize];
            let mut got = [0u8; 8];
            b.read_at(0, &mut got).unwrap();
            assert_eq!(u64::from_le_bytes(got), next, "in order, intact");
            next += 1;
            sconn
                .post_recv(&RecvWr::new(w.wr_id, &[b.sge(0, 64).unwrap()]))
                .unwrap();
        }
    }
    // try_accept says the same without an error: no connection yet.
    assert!(
        l.try_accept(Duration::ZERO, &s.pd, &s.cq, &s.cq, &server_params)
            .unwrap()
            .is_none()
    );
    assert_eq!(
        l.handshakes_in_progress(),
        1,
        "the stalled client is still there"
    );
    let cconn = good.join().unwrap();
    assert_eq!(sconn.state(), QpState::Rts);
    assert_eq!(cconn.state(), QpState::Rts);

    // The stalled client leaves: the next accept call reports it, and the listener serves
    // the next client.
    leave_tx.send(()).unwrap();
    stalled.join().unwrap();
    let e = connect_error(s.accept(&l, &server_params).unwrap_err());
    assert!(
        e.contains("closed the connection while this side waited for REQ"),
        "{e}"
    );
    drop((cconn, sconn, bufs));
    let c = side();
    let p = path.clone();
    let t = std::thread::spawn(move || drop(c.connect(&p, &ConnectParams::default()).unwrap()));
    drop(s.accept(&l, &ConnectParams::default()).unwrap());
    t.join().unwrap();
    drop(l);
    dir.assert_empty_and_remove();
}

/// The device and inode of the file at `path` (not following a symbolic link).
fn file_id(path: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).unwrap();
    (m.dev(), m.ino())
}

/// Item 9 of issue 8 (library side): listening removes only what the listener created.
/// Nothing that is not a stale socket is replaced, and a listener's drop removes its path
/// only while it is still its own socket.
#[test]
fn listen_removes_only_what_it_created() {
    let s = side();
    let dir = SockDir::new("err-owned");
    let path = dir.sock("svc.sock");

    // A regular file, a directory, a symbolic link (to a live socket, even): refused, and
    // left exactly as they were.
    std::fs::write(&path, b"precious").unwrap();
    let id = file_id(&path);
    let e = connect_error(s.ctx.listen(&path).unwrap_err());
    assert!(e.contains("not a socket") && e.contains("refusing"), "{e}");
    assert_eq!(
        (file_id(&path), std::fs::read(&path).unwrap()),
        (id, b"precious".to_vec())
    );
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir(&path).unwrap();
    assert!(s.ctx.listen(&path).is_err());
    assert!(std::fs::symlink_metadata(&path).unwrap().is_dir());
    std::fs::remove_dir(&path).unwrap();
    let target = dir.sock("target.sock");
    let other = UnixListener::bind(&target).unwrap();
    std::os::unix::fs::symlink(&target, &path).unwrap();
    assert!(s.ctx.listen(&path).is_err());
    assert!(std::fs::symlink_metadata(&path).unwrap().is_symlink());
    assert!(exists(&target));
    std::fs::remove_file(&path).unwrap();

    // A live listener that is not shmhca: its socket stays.
    let id = file_id(&target);
    let e = connect_error(s.ctx.listen(&target).unwrap_err());
    assert!(e.contains("live listener"), "{e}");
    assert_eq!(file_id(&target), id);
    drop(other);
    std::fs::remove_file(&target).unwrap();

    // A live shmhca listener: a second listen on its path fails and its socket stays, still
    // serving clients.
    let first = s.ctx.listen(&path).unwrap();
    let id = file_id(&path);
    let e = connect_error(s.ctx.listen(&path).unwrap_err());
    assert!(e.contains("live listener"), "{e}");
    assert_eq!(
        file_id(&path),
        id,
        "the live listener's socket is the same file"
    );
    let c = side();
    let p = path.clone();
    let client =
        std::thread::spawn(move || drop(c.connect(&p, &ConnectParams::default()).unwrap()));
    drop(s.accept(&first, &ConnectParams::default()).unwrap());
    client.join().unwrap();

    // Dropped, it removes its own socket ...
    drop(first);
    assert!(!exists(&path));
    // ... but not a regular file that replaced it.
    let l = s.ctx.listen(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, b"someone else's").unwrap();
    drop(l);
    assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");
    std::fs::remove_file(&path).unwrap();
    s.assert_clean();
    dir.assert_empty_and_remove();
}

/// A live listener that does not accept, its backlog full: a second listen on its path
/// must neither hang probing it nor take the path.
#[test]
fn listen_does_not_hang_on_a_listener_with_a_full_backlog() {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let s = side();
    let dir = SockDir::new("err-backlog");
    let path = dir.sock("svc.sock");
    let addr = SocketAddrUnix::new(&path).unwrap();
    let server = rustix::net::socket(AddressFamily::UNIX, SocketType::STREAM, None).unwrap();
    rustix::net::bind(&server, &addr).unwrap();
    rustix::net::listen(&server, 0).unwrap();
    // Fill the backlog: connects that would block.
    let mut clients = Vec::new();
    loop {
        let c = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::NONBLOCK,
            None,
        )
        .unwrap();
        match rustix::net::connect(&c, &addr) {
            Ok(()) => clients.push(c),
            Err(rustix::io::Errno::AGAIN) => break,
            Err(e) => panic!("{e}"),
        }
        assert!(clients.len() < 10_000, "the backlog never filled");
    }
    let id = file_id(&path);
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.clone();
    let ctx = s.ctx;
    let t = std::thread::spawn(move || {
        let r = ctx.listen(&p).map(drop);
        tx.send(r.map_err(connect_error)).unwrap();
    });
    let e = rx
        .recv_timeout(DEADLINE)
        .expect("listen() hung probing a listener with a full backlog")
        .unwrap_err();
    t.join().unwrap();
    assert!(e.contains("live listener"), "{e}");
    assert_eq!(file_id(&path), id);
    drop((clients, server));
    std::fs::remove_file(&path).unwrap();
    dir.assert_empty_and_remove();
}

/// The client's side of item 5: an inline-mode client waiting in `connect` for a server that
/// never answers keeps running its engine, so its other connections lose nothing.
#[test]
fn a_silent_server_costs_an_inline_clients_other_connections_nothing() {
    let mut c = side();
    let dir = SockDir::new("err-silent-other");
    let good_path = dir.sock("good.sock");
    let silent_path = dir.sock("silent.sock");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));

    // A well-behaved server that sends numbered messages to the client until told to stop,
    // each one acknowledged (its thread drives its own inline engine).
    let a = side();
    let l = a.ctx.listen(&good_path).unwrap();
    let st = stop.clone();
    let good = std::thread::spawn(move || {
        let mut a = a;
        let mut conn = a.accept(&l, &ConnectParams::default()).unwrap();
        let mut sent = 0u64;
        while !st.load(std::sync::atomic::Ordering::Relaxed) {
            conn.post_send(&SendWr::inline(sent, SendOp::Send, &sent.to_le_bytes()))
                .unwrap();
            let wc = wait(&mut a.cq, 1);
            assert_eq!((wc[0].wr_id, wc[0].status), (sent, WcStatus::Success));
            sent += 1;
        }
        (sent, conn, l)
    });
    let mut conn = c.connect(&good_path, &ConnectParams::default()).unwrap();
    let bufs: Vec<_> = (0..64)
        .map(|_| c.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap())
        .collect();
    for (i, b) in bufs.iter().enumerate() {
        conn.post_recv(&RecvWr::new(i as u64, &[b.sge(0, 64).unwrap()]))
            .unwrap();
    }

    // A server that accepts and never says a word: the client waits its handshake timeout.
    let silent = raw_server(&silent_path, |mut s| {
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    let params = ConnectParams::default().handshake_timeout(Duration::from_secs(2));
    let e = connect_error(c.connect(&silent_path, &params).unwrap_err());
    assert!(e.contains("no HELLO"), "{e}");
    silent.join().unwrap();
    std::fs::remove_file(&silent_path).unwrap();

    // Take in (and re-post receives for) everything sent, until the server stops; it
    // checks each of its sends completed successfully.
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut got = 0u64;
    let mut wc = [WorkCompletion::default(); 16];
    let start = std::time::Instant::now();
    while !good.is_finished() {
        assert!(start.elapsed() < DEADLINE, "the server never finished");
        let n = c.cq.poll(&mut wc);
        for w in &wc[..n] {
            assert_eq!(w.status, WcStatus::Success, "{w:?}");
            let b = &bufs[w.wr_id as usize];
            let mut v = [0u8; 8];
            b.read_at(0, &mut v).unwrap();
            assert_eq!(u64::from_le_bytes(v), got, "in order, intact");
            got += 1;
            conn.post_recv(&RecvWr::new(w.wr_id, &[b.sge(0, 64).unwrap()]))
                .unwrap();
        }
    }
    let (sent, sconn, l) = good.join().unwrap();
    assert!(sent > 0);
    while got < sent {
        assert!(start.elapsed() < DEADLINE, "{got} of {sent}");
        let n = c.cq.poll(&mut wc);
        for w in &wc[..n] {
            assert_eq!(w.status, WcStatus::Success, "{w:?}");
            got += 1;
        }
    }
    assert_eq!((conn.state(), sconn.state()), (QpState::Rts, QpState::Rts));
    drop((conn, sconn, l, bufs));
    dir.assert_empty_and_remove();
}

/// Clients of one process that connect and say nothing hold at most
/// `MAX_HANDSHAKES_PER_PEER` handshakes of an accept call: each newer one evicts the
/// oldest, which is told why (a REJ) and closed; the newest are kept, and are forgotten
/// when they leave.
#[test]
fn handshakes_in_progress_are_capped() {
    use shmhca::cm::{MAX_HANDSHAKES, MAX_HANDSHAKES_PER_PEER};
    let s = side();
    let dir = SockDir::new("err-cap");
    let path = dir.sock("svc.sock");
    let l = s.ctx.listen(&path).unwrap();
    let n = MAX_HANDSHAKES + 40;
    let mut clients: Vec<_> = (0..n)
        .map(|_| UnixStream::connect(&path).unwrap())
        .collect();
    let params = ConnectParams::default().handshake_timeout(DEADLINE);
    let try_accept = || {
        l.try_accept(Duration::from_millis(200), &s.pd, &s.cq, &s.cq, &params)
            .unwrap()
            .map(drop)
    };
    assert!(try_accept().is_none());
    assert_eq!(l.handshakes_in_progress(), MAX_HANDSHAKES_PER_PEER);
    let kept = n - MAX_HANDSHAKES_PER_PEER;
    // The oldest were evicted: a HELLO, a REJ saying why, and the end of the stream.
    for c in &mut clients[..kept] {
        assert!(matches!(read_msg(c), Message::Hello(_)));
        let rej = read_rej(c);
        assert_eq!(rej.reason, RejectReason::NoResources);
        assert!(rej.text.contains("make room"), "{}", rej.text);
        assert_eq!(c.read(&mut [0u8; 1]).unwrap(), 0, "closed");
    }
    // The newest got their HELLO and wait for nothing else.
    for c in &mut clients[kept..] {
        assert!(matches!(read_msg(c), Message::Hello(_)));
        c.set_nonblocking(true).unwrap();
        let e = c.read(&mut [0u8; 1]).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "still open");
    }
    // They leave without a word (not an error): the listener forgets them.
    drop(clients);
    let start = std::time::Instant::now();
    while l.handshakes_in_progress() != 0 {
        assert!(start.elapsed() < DEADLINE, "{}", l.handshakes_in_progress());
        assert!(try_accept().is_none());
    }
    drop(l);
    s.assert_clean();
    dir.assert_empty_and_remove();
}
