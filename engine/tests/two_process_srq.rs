//! Shared receive queues over the connection manager, between processes: one server
//! process with one SRQ feeding the QPs of four connections from two client processes
//! (one client with ordinary QPs, one whose own QPs are on an SRQ too), many Sends of
//! varied sizes, every message arriving exactly once with its bytes checked, the SRQ limit
//! event firing while the server holds back its receives, and the handshake telling each
//! side whether its peer's QP reports end-to-end credits (a QP on an SRQ does not).
mod cm_support;

use std::collections::{HashMap, HashSet};

use cm_support::*;
use shmhca::*;

const TEST: &str = "one_srq_serves_connections_from_two_processes";
/// Messages each client sends on each of its connections.
const M: u32 = 300;
/// Connections per client process.
const CONNS: u32 = 2;
/// Receive slots (and the depth of the server's SRQ).
const DEPTH: u32 = 64;
const SLOT: u64 = 4096;
/// Receives posted before the limit event fires, and the limit.
const FIRST: u32 = 20;
const LIMIT: u32 = 5;
/// Send-queue depth of the clients (a window of outstanding Sends).
const WINDOW: u32 = 32;
const DONE: u32 = 0xD0E;

/// Client kinds (the first byte of their private data).
const RQ: u8 = 0;
const ON_SRQ: u8 = 1;

/// Message `seq` of connection `conn` of client `kind`: a 16-byte header naming it and its
/// length, then a pattern of all three.
fn message(kind: u8, conn: u32, seq: u32) -> Vec<u8> {
    let len = 16 + ((seq * 397 + conn * 131 + u32::from(kind) * 57) % 4000) as usize;
    let mut m = pattern(len, kind.wrapping_mul(77) ^ (conn as u8) ^ (seq as u8));
    m[0..4].copy_from_slice(&u32::from(kind).to_le_bytes());
    m[4..8].copy_from_slice(&conn.to_le_bytes());
    m[8..12].copy_from_slice(&seq.to_le_bytes());
    m[12..16].copy_from_slice(&(len as u32).to_le_bytes());
    m
}

fn post_slot(srq: &mut Srq, rx: &Mr, slot: u64) {
    srq.post_recv(&RecvWr::new(
        slot,
        &[rx.sge(slot * SLOT, SLOT as u32).unwrap()],
    ))
    .unwrap();
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

#[test]
fn one_srq_serves_connections_from_two_processes() {
    if let Some((role, arg)) = role() {
        return client(&role, &arg);
    }
    let _serial = serial();
    let dir = SockDir::new("srqcm");
    let path = dir.sock("server.sock");
    let ctx = context(32 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(4096).unwrap();
    let rx = pd
        .alloc_mr(SLOT * u64::from(DEPTH), AccessFlags::LOCAL_WRITE)
        .unwrap();
    let tx = pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    let mut srq = pd.create_srq(DEPTH, 1).unwrap();
    // The limit event: armed at LIMIT with FIRST receives posted, it must fire once the
    // QPs have taken FIRST - LIMIT + 1 of them.
    for slot in 0..u64::from(FIRST) {
        post_slot(&mut srq, &rx, slot);
    }
    srq.arm_limit(LIMIT);
    assert!(!srq.limit_reached(), "nothing was taken yet");
    let listener = ctx.listen(&path).unwrap();
    let a = spawn_peer(TEST, "rq", path.to_str().unwrap());
    let b = spawn_peer(TEST, "srq", path.to_str().unwrap());

    let mut conns = Vec::new();
    let mut who: HashMap<Qpn, (u8, u32)> = HashMap::new();
    for _ in 0..2 * CONNS {
        let c = listener
            .accept_with_srq(&pd, &cq, &cq, &srq, &ConnectParams::default())
            .unwrap();
        let (kind, conn) = (
            c.peer_private_data()[0],
            u32::from(c.peer_private_data()[1]),
        );
        // The server's QP is on the SRQ; whether its peer reports credits depends on the
        // client's kind, which the client's offer told.
        assert_eq!(
            c.query().config.remote_credits,
            kind == RQ,
            "kind {kind}: a client QP on an SRQ reports no credits, one with its own RQ does"
        );
        assert!(who.insert(c.qpn(), (kind, conn)).is_none());
        conns.push(c);
    }
    let pids: HashSet<u32> = conns.iter().map(Connection::peer_pid).collect();
    assert_eq!(pids, HashSet::from([a.pid(), b.pid()]));

    // Receive without posting more until the limit event fired; then keep the SRQ full.
    let total = (2 * CONNS * M) as usize;
    let mut seen: HashSet<(u8, u32, u32)> = HashSet::new();
    let mut held = Vec::new();
    let mut buf = vec![0u8; SLOT as usize];
    let mut fired = false;
    while seen.len() < total {
        let wc = wait(&mut cq, 1)[0];
        assert_eq!(
            (wc.status, wc.opcode),
            (WcStatus::Success, WcOpcode::Recv),
            "{wc:?}"
        );
        let len = wc.byte_len as usize;
        assert!(len >= 16, "{wc:?}");
        rx.read_at(wc.wr_id * SLOT, &mut buf[..len]).unwrap();
        let (kind, conn, seq) = (buf[0], le32(&buf, 4), le32(&buf, 8));
        assert_eq!(le32(&buf, 12) as usize, len, "the length it was sent with");
        assert!(
            kind <= ON_SRQ && conn < CONNS && seq < M,
            "{:?}",
            &buf[..16]
        );
        assert_eq!(
            who[&wc.qp_num],
            (kind, conn),
            "the message came on its sender's connection"
        );
        assert!(
            buf[..len] == message(kind, conn, seq)[..],
            "message {seq} of connection {conn} of client {kind} is corrupt"
        );
        assert!(
            seen.insert((kind, conn, seq)),
            "message {seq} of connection {conn} of client {kind} arrived twice"
        );
        if !fired {
            held.push(wc.wr_id);
            if seen.len() < (FIRST - LIMIT + 1) as usize {
                continue;
            }
            // FIRST - LIMIT + 1 taken: fewer than LIMIT remain.
            assert!(srq.limit_reached(), "the SRQ limit event fired");
            assert!(!srq.limit_reached(), "once per event");
            fired = true;
            // Fill the SRQ: the slots held back and those never used; from now on each
            // slot is posted again as its receive completes.
            for slot in held.drain(..).chain(u64::from(FIRST)..u64::from(DEPTH)) {
                post_slot(&mut srq, &rx, slot);
            }
            continue;
        }
        post_slot(&mut srq, &rx, wc.wr_id);
    }
    assert!(fired);
    assert!(!srq.limit_reached(), "not armed again");

    // Each client receives DONE on each connection (the SRQ client on its own SRQ).
    let stage = tx.sge(0, 0).unwrap();
    for c in &mut conns {
        c.post_send(&SendWr::new(9, SendOp::SendWithImm(DONE), &[stage]))
            .unwrap();
    }
    let sent = wait(&mut cq, conns.len());
    assert!(
        sent.iter().all(|w| w.status == WcStatus::Success),
        "{sent:?}"
    );
    a.expect_success();
    b.expect_success();
    drop(conns);
    drop(listener);
    dir.assert_empty_and_remove();
}

/// A client: `CONNS` connections to the server; `M` Sends on each, at most `WINDOW`
/// outstanding per connection; then waits for the server's DONE on each.
fn client(role: &str, path: &str) {
    let kind = match role {
        "rq" => RQ,
        "srq" => ON_SRQ,
        other => panic!("unknown role {other}"),
    };
    let ctx = context(16 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(1024).unwrap();
    let tx = pd
        .alloc_mr(u64::from(CONNS * WINDOW) * SLOT, AccessFlags::LOCAL_WRITE)
        .unwrap();
    let rx = pd
        .alloc_mr(u64::from(CONNS) * 64, AccessFlags::LOCAL_WRITE)
        .unwrap();
    let mut srq = (kind == ON_SRQ).then(|| pd.create_srq(8, 1).unwrap());
    let params = |i: u32| {
        ConnectParams::default()
            .caps(QpCaps {
                max_send_wr: WINDOW,
                ..QpCaps::default()
            })
            .private_data(vec![kind, i as u8])
    };
    let mut conns: Vec<Connection> = (0..CONNS)
        .map(|i| match &srq {
            Some(s) => ctx
                .connect_with_srq(path, &pd, &cq, &cq, s, &params(i))
                .unwrap(),
            None => ctx.connect(path, &pd, &cq, &cq, &params(i)).unwrap(),
        })
        .collect();
    for (i, c) in conns.iter_mut().enumerate() {
        // The server's QP is on an SRQ: the handshake said it reports no credits, and
        // that its receive depth is the SRQ's.
        assert!(
            !c.query().config.remote_credits,
            "the server reports no credits"
        );
        assert_eq!(c.peer_caps().max_recv_wr, DEPTH);
        let sge = [rx.sge(i as u64 * 64, 64).unwrap()];
        match &mut srq {
            Some(s) => s.post_recv(&RecvWr::new(100 + i as u64, &sge)).unwrap(),
            None => c.post_recv(&RecvWr::new(100 + i as u64, &sge)).unwrap(),
        }
    }
    let mut next = [0u32; CONNS as usize];
    let mut inflight = [0u32; CONNS as usize];
    let mut done = 0;
    let mut wcs = [WorkCompletion::default(); 64];
    let start = std::time::Instant::now();
    while done < CONNS {
        for (i, c) in conns.iter_mut().enumerate() {
            while next[i] < M && inflight[i] < WINDOW {
                let seq = next[i];
                let m = message(kind, i as u32, seq);
                let at = (i as u64 * u64::from(WINDOW) + u64::from(seq % WINDOW)) * SLOT;
                tx.write_at(at, &m).unwrap();
                let sge = [tx.sge(at, m.len() as u32).unwrap()];
                c.post_send(&SendWr::new(i as u64, SendOp::Send, &sge))
                    .unwrap();
                next[i] += 1;
                inflight[i] += 1;
            }
        }
        let n = cq.poll(&mut wcs);
        for wc in &wcs[..n] {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            match wc.opcode {
                WcOpcode::Send => inflight[wc.wr_id as usize] -= 1,
                WcOpcode::Recv => {
                    assert_eq!(wc.imm_data, Some(DONE), "{wc:?}");
                    done += 1;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        if n == 0 {
            assert!(
                start.elapsed() < DEADLINE,
                "sent {next:?}, {inflight:?} in flight"
            );
            std::thread::yield_now();
        }
    }
    assert_eq!(next, [M; CONNS as usize]);
    assert_eq!(
        inflight, [0; CONNS as usize],
        "DONE comes after every Send completed"
    );
}

/// The SRQ must belong to the connection's context and protection domain: refused before
/// anything is sent.
#[test]
fn an_srq_of_another_domain_or_context_is_refused() {
    if role().is_some() {
        return;
    }
    let dir = SockDir::new("srqcm-bad");
    let path = dir.sock("s.sock");
    let ctx = context(4 << 20);
    let other = context(4 << 20);
    let (pd, pd2) = (ctx.alloc_pd().unwrap(), ctx.alloc_pd().unwrap());
    let cq = ctx.create_cq(16).unwrap();
    let srq2 = pd2.create_srq(4, 1).unwrap();
    let foreign = other.alloc_pd().unwrap().create_srq(4, 1).unwrap();
    let listener = ctx.listen(&path).unwrap();
    let p = ConnectParams::default();
    let e = listener
        .accept_with_srq(&pd, &cq, &cq, &srq2, &p)
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("protection domain"),
        "{e}"
    );
    let e = listener
        .try_accept_with_srq(std::time::Duration::ZERO, &pd, &cq, &cq, &foreign, &p)
        .unwrap_err();
    assert!(matches!(e, Error::ForeignObject { .. }), "{e}");
    let e = ctx
        .connect_with_srq(&path, &pd, &cq, &cq, &srq2, &p)
        .unwrap_err();
    assert!(e.to_string().contains("protection domain"), "{e}");
    assert_eq!(listener.handshakes_in_progress(), 0, "nothing was sent");
    drop(listener);
    dir.assert_empty_and_remove();
}
