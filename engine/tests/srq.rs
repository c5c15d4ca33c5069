//! Shared receive queues end to end: one SRQ feeding several QPs under load (every message
//! arrives exactly once, bytes checked), the limit event, the credit field of a QP on an
//! SRQ (spec/02: the invalid code 11111), RNR Naks while the SRQ is empty and the recovery
//! once receives are posted, and the errors.
mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use shmhca::wire::aeth::{CreditCode, Syndrome};
use shmhca::*;

/// B: one context with an SRQ and `n` QPs on it; A: `n` peer contexts with one QP each.
struct Fan {
    b: Context,
    b_pd: Pd,
    b_cq: Cq,
    srq: Srq,
    b_qps: Vec<Qp>,
    peers: Vec<(Context, Pd, Cq, Qp)>,
}

fn fan(n: usize, depth: u32, max_sge: u32) -> Fan {
    let p = Params {
        caps: QpCaps {
            max_send_wr: 32,
            ..QpCaps::default()
        },
        ..Params::default()
    };
    let b = context(16 << 20);
    let b_pd = b.alloc_pd().unwrap();
    let b_cq = b.create_cq(4096).unwrap();
    let srq = b_pd.create_srq(depth, max_sge).unwrap();
    let mut b_qps = Vec::new();
    let mut peers = Vec::new();
    for i in 0..n {
        let a = context(4 << 20);
        let (la, lb) = a.link_with(&b).unwrap();
        let a_pd = a.alloc_pd().unwrap();
        let a_cq = a.create_cq(256).unwrap();
        let mut qa = a.create_qp(&a_pd, &a_cq, &a_cq, p.caps).unwrap();
        let mut qb = b
            .create_qp_with_srq(&b_pd, &b_cq, &b_cq, &srq, p.caps)
            .unwrap();
        let (na, nb) = (qa.qpn(), qb.qpn());
        connect(&mut qb, lb, na, 500 + i as u32, 900 + i as u32, &p);
        // The peer of a QP on an SRQ gets no credits: it is told so (as the CM's end-to-end
        // credit bit would), and relies on RNR Naks.
        qa.modify(&QpAttr::new(QpState::Init).access(p.access))
            .unwrap();
        qa.modify(
            &QpAttr::new(QpState::Rtr)
                .path_mtu(p.mtu)
                .dest(Destination { link: la, qpn: nb })
                .rq_psn(500 + i as u32)
                .max_dest_rd_atomic(p.rd_atomic)
                .min_rnr_timer(1)
                .remote_credits(false),
        )
        .unwrap();
        qa.modify(
            &QpAttr::new(QpState::Rts)
                .sq_psn(900 + i as u32)
                .timeout(14)
                .retry_cnt(7)
                .rnr_retry(7)
                .max_rd_atomic(p.rd_atomic),
        )
        .unwrap();
        b_qps.push(qb);
        peers.push((a, a_pd, a_cq, qa));
    }
    Fan {
        b,
        b_pd,
        b_cq,
        srq,
        b_qps,
        peers,
    }
}

impl Fan {
    fn pump(&self) {
        for (a, ..) in &self.peers {
            a.progress();
        }
        self.b.progress();
    }

    /// Polls B's CQ until `n` completions came.
    fn wait_b(&mut self, n: usize) -> Vec<WorkCompletion> {
        let mut out = vec![WorkCompletion::default(); n];
        let mut got = 0;
        let start = Instant::now();
        while got < n {
            self.pump();
            got += self.b_cq.poll(&mut out[got..]);
            assert!(start.elapsed() < Duration::from_secs(30), "{got} of {n}");
        }
        out
    }

    /// Polls peer `i`'s CQ until one completion came.
    fn wait_a(&mut self, i: usize) -> WorkCompletion {
        let mut wc = [WorkCompletion::default()];
        let start = Instant::now();
        loop {
            self.pump();
            if self.peers[i].2.poll(&mut wc) == 1 {
                return wc[0];
            }
            assert!(start.elapsed() < Duration::from_secs(30), "no completion");
        }
    }

    /// Sends `len` bytes from peer `i`.
    fn send(&mut self, i: usize, src: &Mr, len: u32) {
        let sgl = [src.sge(0, len).unwrap()];
        self.peers[i]
            .3
            .post_send(&SendWr::new(1, SendOp::Send, &sgl))
            .unwrap();
    }
}

/// The bytes of message `seq` of peer `peer`: its identity in the first 8 bytes, then a
/// pattern of both.
fn message(peer: usize, seq: u32) -> Vec<u8> {
    let len = 8 + (seq as usize * 397) % 3000;
    let mut m = pattern(len, (peer as u8).wrapping_mul(40).wrapping_add(seq as u8));
    m[..4].copy_from_slice(&(peer as u32).to_le_bytes());
    m[4..8].copy_from_slice(&seq.to_le_bytes());
    m
}

#[test]
fn one_srq_feeds_several_qps_under_load_and_every_message_arrives_once() {
    const PEERS: usize = 3;
    const PER_PEER: u32 = 150;
    const SLOTS: u32 = 24;
    const SLOT: u64 = 4096;
    let mut f = fan(PEERS, SLOTS, 2);
    // Receive slots of two elements each (a 100-byte head and the rest).
    let rbuf = f
        .b_pd
        .alloc_mr(SLOT * u64::from(SLOTS), AccessFlags::LOCAL_WRITE)
        .unwrap();
    let post = |srq: &mut Srq, slot: u32| {
        let base = u64::from(slot) * SLOT;
        let sgl = [
            rbuf.sge(base, 100).unwrap(),
            rbuf.sge(base + 100, (SLOT - 100) as u32).unwrap(),
        ];
        srq.post_recv(&RecvWr::new(u64::from(slot), &sgl)).unwrap();
    };
    // Half the slots to start with: the SRQ runs dry and RNR Naks throttle the peers.
    for slot in 0..SLOTS / 2 {
        post(&mut f.srq, slot);
    }
    let mut spare: Vec<u32> = (SLOTS / 2..SLOTS).collect();
    // Each peer keeps up to WINDOW messages in flight, each from its own slot of its source
    // region (rewritten only once its send completed): more than the SRQ holds.
    const WINDOW: u32 = 8;
    let srcs: Vec<Mr> = f
        .peers
        .iter()
        .map(|(_, pd, ..)| {
            pd.alloc_mr(SLOT * u64::from(WINDOW), AccessFlags::NONE)
                .unwrap()
        })
        .collect();
    let mut next = [0u32; PEERS];
    let mut done = [0u32; PEERS];
    let mut expect = [0u32; PEERS];
    let mut seen = vec![vec![false; PER_PEER as usize]; PEERS];
    let mut received = 0u32;
    let qp_of: Vec<Qpn> = f.b_qps.iter().map(|q| q.qpn()).collect();
    let start = Instant::now();
    while received < PEERS as u32 * PER_PEER {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "stuck at {received}"
        );
        for i in 0..PEERS {
            while next[i] < PER_PEER && next[i] - done[i] < WINDOW {
                let m = message(i, next[i]);
                let off = u64::from(next[i] % WINDOW) * SLOT;
                srcs[i].write_at(off, &m).unwrap();
                let sgl = [srcs[i].sge(off, m.len() as u32).unwrap()];
                f.peers[i]
                    .3
                    .post_send(&SendWr::new(u64::from(next[i]), SendOp::Send, &sgl))
                    .unwrap();
                next[i] += 1;
            }
            let mut wcs = [WorkCompletion::default(); 8];
            let n = f.peers[i].2.poll(&mut wcs);
            for wc in &wcs[..n] {
                assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                assert_eq!(wc.wr_id, u64::from(done[i]), "sends complete in order");
                done[i] += 1;
            }
        }
        f.pump();
        let mut wcs = [WorkCompletion::default(); 8];
        let n = f.b_cq.poll(&mut wcs);
        for wc in &wcs[..n] {
            assert_eq!(
                (wc.status, wc.opcode),
                (WcStatus::Success, WcOpcode::Recv),
                "{wc:?}"
            );
            let slot = wc.wr_id as u32;
            let mut got = vec![0u8; wc.byte_len as usize];
            rbuf.read_at(u64::from(slot) * SLOT, &mut got).unwrap();
            let peer = u32::from_le_bytes(got[..4].try_into().unwrap()) as usize;
            let seq = u32::from_le_bytes(got[4..8].try_into().unwrap());
            assert!(peer < PEERS && seq < PER_PEER, "{peer} {seq}");
            assert_eq!(got, message(peer, seq), "message {seq} of peer {peer}");
            assert_eq!(wc.qp_num, qp_of[peer], "arrived at the peer's QP");
            assert!(
                !seen[peer][seq as usize],
                "message {seq} of peer {peer} twice"
            );
            assert_eq!(seq, expect[peer], "in order on each QP");
            expect[peer] += 1;
            seen[peer][seq as usize] = true;
            received += 1;
            // Repost the slot (and, now and then, one spare: the SRQ fills up again).
            post(&mut f.srq, slot);
            if received % 16 == 0 {
                if let Some(s) = spare.pop() {
                    post(&mut f.srq, s);
                }
            }
        }
    }
    assert!(seen.iter().flatten().all(|&s| s));
    assert!(
        f.b.stats().rnr_naks_sent > 0,
        "the SRQ ran dry at some point (RNR Naks), under load"
    );
}

#[test]
fn the_limit_event_fires_once_when_fewer_than_the_limit_remain() {
    let mut f = fan(2, 16, 1);
    let rbuf = f.b_pd.alloc_mr(16 * 256, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..10u64 {
        f.srq
            .post_recv(&RecvWr::new(i, &[rbuf.sge(i * 256, 256).unwrap()]))
            .unwrap();
    }
    assert_eq!(f.srq.outstanding(), 10);
    let srcs: Vec<Mr> = f
        .peers
        .iter()
        .map(|(_, pd, ..)| pd.alloc_mr(64, AccessFlags::NONE).unwrap())
        .collect();
    // Unarmed: nothing fires.
    f.send(0, &srcs[0], 10);
    f.wait_b(1);
    assert!(!f.srq.limit_reached());
    f.srq.arm_limit(5);
    // 9 → 5 left, from both QPs: still not fewer than 5.
    for k in 0..4 {
        f.send(k % 2, &srcs[k % 2], 10);
        f.wait_b(1);
        assert!(!f.srq.limit_reached(), "{} left", f.srq.outstanding());
    }
    assert_eq!(f.srq.outstanding(), 5);
    // The next take leaves 4: the event fires, once.
    f.send(1, &srcs[1], 10);
    f.wait_b(1);
    assert_eq!(f.srq.outstanding(), 4);
    assert!(f.srq.limit_reached(), "fewer than 5 left");
    assert!(!f.srq.limit_reached(), "reported once");
    // Disarmed by firing: more takes do not fire it again...
    f.send(0, &srcs[0], 10);
    f.wait_b(1);
    assert!(!f.srq.limit_reached());
    // ...until armed again.
    f.srq.arm_limit(3);
    f.send(0, &srcs[0], 10);
    f.wait_b(1);
    assert!(f.srq.limit_reached(), "2 left < 3");
    for i in 0..2 {
        assert!(f.wait_a(i).is_ok());
    }
}

#[test]
fn a_qp_on_an_srq_reports_the_invalid_credit_code() {
    let mut f = fan(1, 16, 1);
    let codes = Arc::new(Mutex::new(Vec::new()));
    let c = codes.clone();
    f.b.observe_packets(move |ev| {
        if let (trace::Direction::Sent, Some(aeth)) = (ev.direction, ev.headers.aeth) {
            if let Syndrome::Ack { credits } = aeth.syndrome {
                c.lock().unwrap().push(credits);
            }
        }
    });
    let rbuf = f.b_pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..8u64 {
        f.srq
            .post_recv(&RecvWr::new(i, &[rbuf.sge(i * 512, 512).unwrap()]))
            .unwrap();
    }
    let src = f.peers[0].1.alloc_mr(512, AccessFlags::NONE).unwrap();
    for _ in 0..3 {
        f.send(0, &src, 300);
        assert!(f.wait_a(0).is_ok());
    }
    assert_eq!(f.wait_b(3).len(), 3);
    let codes = codes.lock().unwrap();
    assert!(!codes.is_empty(), "B acknowledged");
    assert!(
        codes.iter().all(|&c| c == CreditCode::NONE),
        "every Ack carries 11111, though 5 receives wait: {codes:?}"
    );
}

#[test]
fn an_empty_srq_rnr_naks_and_the_send_completes_once_a_receive_is_posted() {
    let mut f = fan(1, 4, 1);
    let src = f.peers[0].1.alloc_mr(2048, AccessFlags::NONE).unwrap();
    src.write_at(0, &pattern(2048, 3)).unwrap();
    f.send(0, &src, 2048);
    let start = Instant::now();
    while f.b.stats().rnr_naks_sent < 2 {
        f.pump();
        assert!(start.elapsed() < Duration::from_secs(20), "no RNR Nak");
    }
    let mut wc = [WorkCompletion::default()];
    assert_eq!(
        f.peers[0].2.poll(&mut wc),
        0,
        "the Send waits, it does not fail"
    );
    let rbuf = f.b_pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    f.srq
        .post_recv(&RecvWr::new(7, &[rbuf.sge(0, 4096).unwrap()]))
        .unwrap();
    let wc = f.wait_b(1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (7, WcStatus::Success, 2048)
    );
    let mut got = vec![0u8; 2048];
    rbuf.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(2048, 3));
    assert!(f.wait_a(0).is_ok());
    assert_eq!(f.b_qps[0].state(), QpState::Rts);
}

#[test]
fn srq_errors() {
    let mut f = fan(1, 4, 2);
    let rbuf = f.b_pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    // A full SRQ.
    for i in 0..4u64 {
        f.srq
            .post_recv(&RecvWr::new(i, &[rbuf.sge(i * 64, 64).unwrap()]))
            .unwrap();
    }
    let err = f
        .srq
        .post_recv(&RecvWr::new(9, &[rbuf.sge(0, 64).unwrap()]))
        .unwrap_err();
    assert!(matches!(err, Error::QueueFull { depth: 4, .. }), "{err}");
    // Too many elements; a region without LOCAL_WRITE; one of another domain.
    let mut srq2 = f.b_pd.create_srq(4, 1).unwrap();
    let two = [rbuf.sge(0, 8).unwrap(), rbuf.sge(8, 8).unwrap()];
    assert!(matches!(
        srq2.post_recv(&RecvWr::new(1, &two)).unwrap_err(),
        Error::InvalidArgument { .. }
    ));
    let ro = f.b_pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    assert!(matches!(
        srq2.post_recv(&RecvWr::new(1, &[ro.sge(0, 8).unwrap()]))
            .unwrap_err(),
        Error::InvalidArgument { .. }
    ));
    let pd2 = f.b.alloc_pd().unwrap();
    let other = pd2.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    assert!(matches!(
        srq2.post_recv(&RecvWr::new(1, &[other.sge(0, 8).unwrap()]))
            .unwrap_err(),
        Error::InvalidArgument { .. }
    ));
    // Bad sizes.
    assert!(f.b_pd.create_srq(0, 1).is_err());
    assert!(f.b_pd.create_srq(4, 0).is_err());
    assert!(f.b_pd.create_srq(4, 17).is_err());
    // A QP on an SRQ of another protection domain.
    let err =
        f.b.create_qp_with_srq(&pd2, &f.b_cq, &f.b_cq, &f.srq, QpCaps::default())
            .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    // Posting to the QP's own receive queue.
    let err = f.b_qps[0]
        .post_recv(&RecvWr::new(1, &[rbuf.sge(0, 8).unwrap()]))
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    // Destroying an SRQ in use is refused; once its QP is gone it works, and the regions
    // of its waiting receives are free again.
    let (srq, err) = f.srq.destroy().unwrap_err().into_parts();
    assert!(matches!(err, Error::SrqInUse { qps: 1 }), "{err}");
    assert_eq!(rbuf.in_flight(), 4);
    drop(f.b_qps);
    srq.destroy().expect("no QP uses it");
    assert_eq!(rbuf.in_flight(), 0);
    rbuf.deregister().expect("free");
    srq2.destroy().unwrap();
}

#[test]
fn a_dropped_srq_keeps_serving_its_qps_until_the_last_goes() {
    let mut f = fan(1, 4, 1);
    let rbuf = f.b_pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    f.srq
        .post_recv(&RecvWr::new(3, &[rbuf.sge(0, 4096).unwrap()]))
        .unwrap();
    let stand_in = f.b_pd.create_srq(1, 1).unwrap();
    drop(std::mem::replace(&mut f.srq, stand_in));
    let src = f.peers[0].1.alloc_mr(64, AccessFlags::NONE).unwrap();
    src.write_at(0, b"still here").unwrap();
    f.send(0, &src, 10);
    let wc = f.wait_b(1)[0];
    assert_eq!((wc.wr_id, wc.byte_len), (3, 10));
    assert_eq!(rbuf.in_flight(), 0);
}
