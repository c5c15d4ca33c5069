//! Many QPs between the same two processes share one link; a connection in the other
//! direction reuses it too; closing some connections leaves the others working; one
//! process connected to two others keeps one link per peer and survives losing one.
mod cm_support;

use cm_support::*;
use shmhca::*;

const MANY: &str = "sixteen_qps_between_two_processes_share_one_link";
const FAN: &str = "one_process_connected_to_two_others";
const N: usize = 16;
const DROPPED: u32 = 0xD0D0_0001;
const QUIT: u32 = 0xDEAD_BEEF;
const PING: u32 = 8;
const REPLY: u32 = 7;

fn params(tag: u8) -> ConnectParams {
    ConnectParams::default().private_data(vec![tag])
}

/// Posts a receive of up to 256 bytes into slot `slot` of `mr`.
fn post_recv(conn: &mut Connection, mr: &Mr, slot: u64) {
    conn.post_recv(&RecvWr::new(slot, &[mr.sge(slot * 256, 256).unwrap()]))
        .unwrap();
}

/// Sends `data` (staged in slot `slot` of `mr`) with immediate `imm`.
fn send(conn: &mut Connection, mr: &Mr, slot: u64, data: &[u8], imm: u32) {
    mr.write_at(slot * 256, data).unwrap();
    let sgl = [mr.sge(slot * 256, data.len() as u32).unwrap()];
    conn.post_send(&SendWr::new(slot, SendOp::SendWithImm(imm), &sgl))
        .unwrap();
}

fn slot_bytes(mr: &Mr, slot: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    mr.read_at(slot * 256, &mut b).unwrap();
    b
}

/// The index of the connection whose QP is `qpn`.
fn which(conns: &[Connection], qpn: Qpn) -> usize {
    conns
        .iter()
        .position(|c| c.qpn() == qpn)
        .expect("a completion of one of our QPs")
}

#[test]
fn sixteen_qps_between_two_processes_share_one_link() {
    if let Some((role, arg)) = role() {
        assert_eq!(role, "many");
        return many_child(&arg);
    }
    let _serial = serial();
    let dir = SockDir::new("many");
    let ctx = context(32 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(4096).unwrap();
    let rx = pd.alloc_mr(256 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let tx = pd.alloc_mr(256 * 64, AccessFlags::NONE).unwrap();
    let listener = ctx.listen(dir.sock("parent.sock")).unwrap();
    let peer = spawn_peer(MANY, "many", dir.path.to_str().unwrap());

    // Accept 16, ordered by the index the child put in the private data.
    let mut conns: Vec<Option<Connection>> = (0..N).map(|_| None).collect();
    for _ in 0..N {
        let c = listener
            .accept_timeout(DEADLINE, &pd, &cq, &cq, &params(0xAA))
            .unwrap();
        let i = c.peer_private_data()[0] as usize;
        assert!(conns[i].is_none(), "index {i} twice");
        conns[i] = Some(c);
    }
    let mut conns: Vec<Connection> = conns.into_iter().map(Option::unwrap).collect();
    let links = ctx.cm_links();
    assert_eq!(links.len(), 1, "16 connections, one link: {links:?}");
    assert_eq!((links[0].connections, links[0].live_connections), (16, 16));
    assert_eq!(links[0].peer_pid, peer.pid());
    assert!(conns.iter().all(|c| c.link() == links[0].id));
    let peer_engine = conns[0].peer_engine();
    assert!(conns.iter().all(|c| c.peer_engine() == peer_engine));
    assert_eq!(
        peer_engine >> 32,
        u64::from(peer.pid()),
        "identity = pid + nonce"
    );

    // Each QP carries its own message both ways.
    for (i, c) in conns.iter_mut().enumerate() {
        post_recv(c, &rx, i as u64);
    }
    let got = wait(&mut cq, N);
    for wc in &got {
        assert_eq!(
            (wc.status, wc.opcode),
            (WcStatus::Success, WcOpcode::Recv),
            "{wc:?}"
        );
        let i = which(&conns, wc.qp_num);
        assert_eq!(
            wc.wr_id, i as u64,
            "the completion belongs to the QP it came on"
        );
        assert_eq!(wc.imm_data, Some(i as u32));
        assert_eq!(slot_bytes(&rx, i as u64, 64), pattern(64, i as u8));
    }
    for (i, c) in conns.iter_mut().enumerate() {
        send(
            c,
            &tx,
            i as u64,
            &pattern(64, 100 + i as u8),
            1000 + i as u32,
        );
    }

    // A connection the other way (we connect to the child's listener) reuses the link.
    // (Made before waiting for our Sends' completions: the child sits in accept, not
    // polling, so its engine acknowledges them only afterwards; see BUGS-cm.md #2.)
    let mut rev = ctx
        .connect(dir.sock("child.sock"), &pd, &cq, &cq, &params(0xBB))
        .unwrap();
    let sent = wait(&mut cq, N);
    assert!(
        sent.iter().all(|w| w.status == WcStatus::Success),
        "{sent:?}"
    );
    assert_eq!(
        rev.link(),
        conns[0].link(),
        "the reverse connection shares the link"
    );
    let links = ctx.cm_links();
    assert_eq!(links.len(), 1, "{links:?}");
    assert_eq!(links[0].connections, 17);
    post_recv(&mut rev, &rx, 40);
    send(&mut rev, &tx, 41, b"reverse", 41);
    let wcs = wait(&mut cq, 2);
    let r = wcs
        .iter()
        .find(|w| w.opcode == WcOpcode::Recv)
        .expect("reply");
    assert_eq!((r.status, r.imm_data), (WcStatus::Success, Some(42)));
    assert_eq!(slot_bytes(&rx, 40, 7), b"esrever");

    // The child closes the even-numbered connections, then says so on connection 1.
    post_recv(&mut conns[1], &rx, 50);
    let wc = wait(&mut cq, 1)[0];
    assert_eq!((wc.status, wc.imm_data), (WcStatus::Success, Some(DROPPED)));
    for (i, c) in conns.iter().enumerate() {
        if i % 2 == 0 {
            eventually(&format!("connection {i} sees its peer close"), || {
                !c.is_peer_connected() && c.state() == QpState::Error
            });
        }
    }
    for (i, c) in conns.iter().enumerate().filter(|(i, _)| i % 2 == 1) {
        assert!(c.is_peer_connected(), "connection {i} is still open");
        assert_eq!(c.state(), QpState::Rts, "connection {i}");
    }
    let links = ctx.cm_links();
    assert_eq!(links.len(), 1);
    assert!(links[0].up, "8 + 1 connections are still live");
    assert_eq!((links[0].connections, links[0].live_connections), (17, 9));

    // The odd ones still carry traffic.
    for (i, c) in conns.iter_mut().enumerate().filter(|(i, _)| i % 2 == 1) {
        send(c, &tx, i as u64, &pattern(32, i as u8), 2000 + i as u32);
    }
    let sent = wait(&mut cq, N / 2);
    assert!(
        sent.iter().all(|w| w.status == WcStatus::Success),
        "{sent:?}"
    );

    // Quit: the child exits; every connection ends and the link is torn down.
    send(&mut conns[1], &tx, 60, b"", QUIT);
    peer.expect_success();
    eventually("every connection sees the child exit", || {
        conns.iter().all(|c| !c.is_peer_connected()) && !rev.is_peer_connected()
    });
    let links = ctx.cm_links();
    assert!(!links[0].up && links[0].live_connections == 0, "{links:?}");
    drop(conns);
    assert_eq!(
        ctx.cm_links()[0].connections,
        1,
        "the reverse connection still holds it"
    );
    drop(rev);
    assert!(ctx.cm_links().is_empty());
    drop(listener);
    dir.assert_empty_and_remove();
}

fn many_child(dir: &str) {
    let dir = std::path::Path::new(dir);
    let ctx = context(32 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(4096).unwrap();
    let rx = pd.alloc_mr(256 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let tx = pd.alloc_mr(256 * 64, AccessFlags::NONE).unwrap();
    // Bound before connecting, so it exists when the parent has accepted us.
    let listener = ctx.listen(dir.join("child.sock")).unwrap();
    let mut conns: Vec<Option<Connection>> = (0..N)
        .map(|i| {
            Some(
                ctx.connect(dir.join("parent.sock"), &pd, &cq, &cq, &params(i as u8))
                    .unwrap(),
            )
        })
        .collect();
    let links = ctx.cm_links();
    assert_eq!(links.len(), 1, "{links:?}");
    assert_eq!(links[0].connections, 16);
    for (i, c) in conns.iter_mut().enumerate() {
        let c = c.as_mut().unwrap();
        post_recv(c, &rx, i as u64);
        send(c, &tx, i as u64, &pattern(64, i as u8), i as u32);
    }
    let live: Vec<Qpn> = conns.iter().map(|c| c.as_ref().unwrap().qpn()).collect();
    let wcs = wait(&mut cq, 2 * N);
    for wc in wcs.iter().filter(|w| w.opcode == WcOpcode::Recv) {
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        let i = live.iter().position(|&q| q == wc.qp_num).unwrap();
        assert_eq!(wc.imm_data, Some(1000 + i as u32));
        assert_eq!(slot_bytes(&rx, i as u64, 64), pattern(64, 100 + i as u8));
    }
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");

    let mut rev = listener
        .accept_timeout(DEADLINE, &pd, &cq, &cq, &params(0xCC))
        .unwrap();
    assert_eq!(rev.peer_private_data(), &[0xBB]);
    assert_eq!(rev.link(), conns[0].as_ref().unwrap().link());
    assert_eq!(ctx.cm_links()[0].connections, 17);
    post_recv(&mut rev, &rx, 40);
    let wc = wait(&mut cq, 1)[0];
    assert_eq!(wc.imm_data, Some(41));
    assert_eq!(slot_bytes(&rx, 40, 7), b"reverse");
    send(&mut rev, &tx, 41, b"esrever", 42);
    assert_eq!(wait(&mut cq, 1)[0].status, WcStatus::Success);

    // Close the even ones; the odd ones get a receive each for the parent's next message.
    for (i, c) in conns.iter_mut().enumerate() {
        if i % 2 == 0 {
            drop(c.take());
        } else {
            post_recv(c.as_mut().unwrap(), &rx, 20 + i as u64);
        }
    }
    assert_eq!(ctx.cm_links()[0].connections, 9);
    send(conns[1].as_mut().unwrap(), &tx, 50, b"", DROPPED);
    let mut quit = false;
    let mut received = 0;
    while !quit {
        let wc = wait(&mut cq, 1)[0];
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        if wc.opcode == WcOpcode::Recv {
            if wc.imm_data == Some(QUIT) {
                quit = true;
            } else {
                let i = wc.wr_id - 20;
                assert_eq!(wc.imm_data, Some(2000 + i as u32));
                assert_eq!(slot_bytes(&rx, wc.wr_id, 32), pattern(32, i as u8));
                received += 1;
                if i == 1 {
                    post_recv(conns[1].as_mut().unwrap(), &rx, 21);
                }
            }
        }
    }
    assert_eq!(
        received,
        N / 2,
        "every odd connection delivered its message"
    );
}

#[test]
fn one_process_connected_to_two_others() {
    if let Some((role, arg)) = role() {
        assert_eq!(role, "spoke");
        return spoke(&arg);
    }
    let _serial = serial();
    let dir = SockDir::new("fan");
    let path = dir.sock("hub.sock");
    let ctx = context(16 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(256).unwrap();
    let rx = pd.alloc_mr(256 * 8, AccessFlags::LOCAL_WRITE).unwrap();
    let tx = pd.alloc_mr(256 * 8, AccessFlags::NONE).unwrap();
    let listener = ctx.listen(&path).unwrap();
    let a = spawn_peer(FAN, "spoke", path.to_str().unwrap());
    let b = spawn_peer(FAN, "spoke", path.to_str().unwrap());
    let mut c1 = listener
        .accept_timeout(DEADLINE, &pd, &cq, &cq, &params(1))
        .unwrap();
    let mut c2 = listener
        .accept_timeout(DEADLINE, &pd, &cq, &cq, &params(2))
        .unwrap();
    if c1.peer_pid() != a.pid() {
        std::mem::swap(&mut c1, &mut c2);
    }
    assert_eq!((c1.peer_pid(), c2.peer_pid()), (a.pid(), b.pid()));
    assert_ne!(c1.link(), c2.link(), "one link per peer engine");
    assert_ne!(c1.peer_engine(), c2.peer_engine());
    let mut links = ctx.cm_links();
    links.sort_by_key(|l| l.id);
    assert_eq!(links.len(), 2, "{links:?}");

    // Each spoke says hello with its pid (first on its own, later when pinged); the hub
    // answers with the pid's bytes.
    let round = |c: &mut Connection, cq: &mut Cq, slot: u64, ping: bool| {
        post_recv(c, &rx, slot);
        let mut n = 1;
        if ping {
            send(c, &tx, slot, b"ping", PING);
            n += 1;
        }
        let wcs = wait(cq, n);
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
        let hello = wcs.iter().find(|w| w.opcode == WcOpcode::Recv).unwrap();
        assert_eq!(hello.imm_data, Some(c.peer_pid()));
        send(c, &tx, slot, &c.peer_pid().to_le_bytes(), REPLY);
        assert_eq!(wait(cq, 1)[0].status, WcStatus::Success);
    };
    round(&mut c1, &mut cq, 0, false);
    round(&mut c2, &mut cq, 1, false);

    // Spoke A dies: its connection and link go down; B's keep working.
    post_recv(&mut c1, &rx, 5);
    a.kill();
    let flushed = wait(&mut cq, 1)[0];
    assert_eq!(
        (flushed.status, flushed.wr_id),
        (WcStatus::WrFlushErr, 5),
        "the dead peer's posted receive is flushed"
    );
    assert!(!c1.is_peer_connected());
    eventually("A's link is torn down", || {
        ctx.cm_links().iter().any(|l| l.id == c1.link() && !l.up)
    });
    assert!(c2.is_peer_connected());
    assert!(ctx.cm_links().iter().any(|l| l.id == c2.link() && l.up));
    round(&mut c2, &mut cq, 2, true);
    send(&mut c2, &tx, 3, b"", QUIT);
    assert_eq!(wait(&mut cq, 1)[0].status, WcStatus::Success);
    b.expect_success();
    drop(c1);
    eventually("B's connection sees B exit", || !c2.is_peer_connected());
    drop(c2);
    assert!(ctx.cm_links().is_empty());
    drop(listener);
    dir.assert_empty_and_remove();
}

fn spoke(path: &str) {
    let ctx = context(16 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(256).unwrap();
    let rx = pd.alloc_mr(256 * 8, AccessFlags::LOCAL_WRITE).unwrap();
    let tx = pd.alloc_mr(256 * 8, AccessFlags::NONE).unwrap();
    let mut c = ctx.connect(path, &pd, &cq, &cq, &params(9)).unwrap();
    let me = std::process::id();
    let hello = |c: &mut Connection, cq: &mut Cq| {
        post_recv(c, &rx, 0);
        send(c, &tx, 0, b"hello", me);
        let wcs = wait(cq, 2);
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
        let r = wcs.iter().find(|w| w.opcode == WcOpcode::Recv).unwrap();
        assert_eq!(r.imm_data, Some(REPLY));
        assert_eq!(slot_bytes(&rx, 0, 4), me.to_le_bytes());
    };
    hello(&mut c, &mut cq);
    loop {
        post_recv(&mut c, &rx, 1);
        let wc = wait(&mut cq, 1)[0];
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        match wc.imm_data {
            Some(QUIT) => return,
            Some(PING) => hello(&mut c, &mut cq),
            other => panic!("unexpected message {other:?}"),
        }
    }
}
