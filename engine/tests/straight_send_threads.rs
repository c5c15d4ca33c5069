//! Review 10 (issue 27's straight Send): Sends posted from two threads at once on two QPs
//! of one context and one link — each post may take the engine's straight post, or find
//! the engine held by the other poster or the progress helper (or, in poll mode, running
//! on its own thread) and go through the send ring — while the receiver answers nothing
//! but Acks, held back by its own helper. Every message arrives once, in order, with its
//! bytes, and every signaled Send completes, both with an inline sender and with a
//! poll-mode one.

mod common;

use std::time::{Duration, Instant};

use common::{Params, connect};
use shmhca::{
    AccessFlags, Context, EngineMode, Progress, QpCaps, RecvWr, SendFlags, SendOp, SendWr,
    WcStatus, WorkCompletion,
};

const MESSAGES: u64 = 3000;
const DEPTH: u32 = 16;
const RECVS: u64 = 64;

fn build(mode: EngineMode) -> Context {
    Context::builder()
        .arena_size(16 << 20)
        .huge_pages(shmhca_rings::HugePages::Never)
        .mode(mode)
        .progress(Progress::Auto)
        .build()
        .expect("context")
}

fn two_posters_on_one_link(sender: EngineMode) {
    let p = Params {
        caps: QpCaps {
            max_send_wr: DEPTH,
            max_recv_wr: RECVS as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        },
        ..Params::default()
    };
    let (ca, cb) = (build(sender), build(EngineMode::Inline));
    let (la, lb) = ca.link_with(&cb).unwrap();
    let (pda, pdb) = (ca.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
    let mut rcq = cb.create_cq(1024).unwrap();
    let mut senders = vec![];
    let mut receivers = vec![];
    for _ in 0..2 {
        let scq = ca.create_cq(256).unwrap();
        let qa = ca.create_qp(&pda, &scq, &scq, p.caps).unwrap();
        let qb = cb.create_qp(&pdb, &rcq, &rcq, p.caps).unwrap();
        senders.push((qa, scq));
        receivers.push(qb);
    }
    for k in 0..2 {
        let (qa, qb) = (senders[k].0.qpn(), receivers[k].qpn());
        connect(&mut senders[k].0, la, qb, 100 + k as u32, 9000, &p);
        connect(&mut receivers[k], lb, qa, 9000, 100 + k as u32, &p);
    }
    let rmr = pdb
        .alloc_mr(2 * RECVS * 64, AccessFlags::LOCAL_WRITE)
        .unwrap();
    for (k, q) in receivers.iter_mut().enumerate() {
        for i in 0..RECVS {
            let at = (k as u64 * RECVS + i) * 64;
            q.post_recv(&RecvWr::new(at, &[rmr.sge(at, 64).unwrap()]))
                .unwrap();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    std::thread::scope(|s| {
        for (k, (qp, cq)) in senders.iter_mut().enumerate() {
            let pda = &pda;
            s.spawn(move || {
                let mr = pda.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
                let (mut posted, mut done) = (0u64, 0u64);
                let mut wc = [WorkCompletion::default(); 16];
                while posted < MESSAGES {
                    // Every 4th Send signaled: at most DEPTH outstanding.
                    if posted - done + 4 > u64::from(DEPTH) {
                        let n = cq.poll(&mut wc);
                        for w in &wc[..n] {
                            assert_eq!(w.status, WcStatus::Success, "sender {k}: {w:?}");
                            done = w.wr_id + 1;
                        }
                        assert!(Instant::now() < deadline, "sender {k} stuck at {posted}");
                        continue;
                    }
                    let mut bytes = [0u8; 16];
                    bytes[..8].copy_from_slice(&posted.to_le_bytes());
                    bytes[8] = k as u8;
                    let flags = if posted % 4 == 3 {
                        SendFlags::SIGNALED
                    } else {
                        SendFlags::NONE
                    };
                    match posted % 3 {
                        0 => qp
                            .post_send(&SendWr::inline(posted, SendOp::Send, &bytes).flags(flags))
                            .unwrap(),
                        1 => {
                            let at = (posted % 64) * 16;
                            mr.write_at(at, &bytes).unwrap();
                            qp.post_send_single(posted, flags, &mr.sge(at, 16).unwrap())
                                .unwrap();
                        }
                        _ => {
                            let at = 2048 + (posted % 64) * 16;
                            mr.write_at(at, &bytes).unwrap();
                            let sge = [mr.sge(at, 16).unwrap()];
                            qp.post_send(&SendWr::new(posted, SendOp::Send, &sge).flags(flags))
                                .unwrap();
                        }
                    }
                    posted += 1;
                }
                while done < MESSAGES {
                    let n = cq.poll(&mut wc);
                    for w in &wc[..n] {
                        assert_eq!(w.status, WcStatus::Success, "sender {k}: {w:?}");
                        done = w.wr_id + 1;
                    }
                    assert!(Instant::now() < deadline, "sender {k}: {done} completed");
                }
            });
        }
        // The receiver: both QPs' messages, each QP's in order.
        let mut next = [0u64; 2];
        let mut wc = [WorkCompletion::default(); 32];
        let mut bytes = [0u8; 16];
        while next.iter().any(|&n| n < MESSAGES) {
            let n = rcq.poll(&mut wc);
            for w in &wc[..n] {
                assert_eq!(w.status, WcStatus::Success, "{w:?}");
                assert_eq!(w.byte_len, 16, "{w:?}");
                let k = receivers.iter().position(|q| q.qpn() == w.qp_num).unwrap();
                rmr.read_at(w.wr_id, &mut bytes).unwrap();
                let seq = u64::from_le_bytes(bytes[..8].try_into().unwrap());
                assert_eq!(
                    (seq, bytes[8]),
                    (next[k], k as u8),
                    "QP {k}'s messages in order"
                );
                next[k] += 1;
                receivers[k]
                    .post_recv(&RecvWr::new(w.wr_id, &[rmr.sge(w.wr_id, 64).unwrap()]))
                    .unwrap();
            }
            assert!(Instant::now() < deadline, "received {next:?}");
        }
    });
}

#[test]
fn sends_posted_from_two_threads_on_one_link_arrive_once_in_order_inline() {
    two_posters_on_one_link(EngineMode::Inline);
}

#[test]
fn sends_posted_from_two_threads_on_one_link_arrive_once_in_order_poll_mode() {
    two_posters_on_one_link(EngineMode::Poll { cpu: None });
}
