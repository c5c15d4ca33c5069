//! RNR Naks and retries, end-to-end credits, and the transport timer.
mod common;

use std::time::{Duration, Instant};

use common::*;
use shmhca::*;

#[test]
fn a_send_before_the_receive_is_posted_is_retried_after_rnr_naks() {
    let mut p = pair(&Params {
        min_rnr_timer: 1,
        rnr_retry: 7,
        ..Params::default()
    });
    let src = p.a.pd.alloc_mr(4096, AccessFlags::NONE).unwrap();
    src.write_at(0, &pattern(3000, 5)).unwrap();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 3000).unwrap()]))
        .unwrap();
    // Let the first packet be refused a few times.
    let start = Instant::now();
    while p.a.ctx.stats().rnr_naks_received < 3 {
        p.pump();
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no RNR Nak arrived"
        );
    }
    let dst = p.b.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(2, &[dst.sge(0, 4096).unwrap()]))
        .unwrap();
    let rc = wait_b(&mut p, 1)[0];
    assert_eq!((rc.status, rc.byte_len), (WcStatus::Success, 3000));
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    let mut got = vec![0u8; 3000];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(3000, 5));
    assert!(p.b.ctx.stats().naks_sent >= 3);
}

#[test]
fn rnr_retry_count_exhausted_fails_the_request() {
    let mut p = pair(&Params {
        min_rnr_timer: 1,
        rnr_retry: 2,
        ..Params::default()
    });
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 8).unwrap()]))
        .unwrap();
    let wc = wait_a(&mut p, 1)[0];
    assert_eq!(wc.status, WcStatus::RnrRetryExcErr, "{wc:?}");
    assert_eq!(
        p.a.ctx.stats().rnr_naks_received,
        3,
        "the first try and two retries"
    );
    let b = p.b.ctx.stats();
    assert_eq!(
        (b.rnr_naks_sent, b.naks_sent),
        (3, 3),
        "counted as RNR Naks: {b:?}"
    );
    assert_eq!(p.a.qp.state(), QpState::Error);
}

#[test]
fn credits_let_a_stream_of_sends_flow_without_rnr_naks() {
    let caps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        ..QpCaps::default()
    };
    let mut p = pair(&Params {
        caps,
        ..Params::default()
    });
    let src = p.a.pd.alloc_mr(4096, AccessFlags::NONE).unwrap();
    let dst = p.b.pd.alloc_mr(64 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut received = 0;
    let mut sent = 0u64;
    // The receiver keeps 16 receives posted; the sender always has more to send.
    for i in 0..16u64 {
        p.b.qp
            .post_recv(&RecvWr::new(i, &[dst.sge(i * 64, 64).unwrap()]))
            .unwrap();
    }
    let mut next_recv = 16u64;
    let start = Instant::now();
    while received < 1000 {
        while sent < 1000 && p.a.qp.sq_outstanding() < 64 {
            p.a.qp
                .post_send(
                    &SendWr::new(sent, SendOp::Send, &[src.sge(0, 32).unwrap()])
                        .flags(SendFlags::NONE),
                )
                .unwrap();
            sent += 1;
        }
        p.pump();
        while let Some(wc) = p.b.cq.poll_one() {
            assert_eq!(wc.status, WcStatus::Success);
            received += 1;
            let slot = next_recv % 64;
            p.b.qp
                .post_recv(&RecvWr::new(next_recv, &[dst.sge(slot * 64, 64).unwrap()]))
                .unwrap();
            next_recv += 1;
        }
        while p.a.cq.poll_one().is_some() {}
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "stalled at {received}"
        );
    }
    assert_eq!(
        p.a.ctx.stats().rnr_naks_received,
        0,
        "credits kept the sender within the posted receives"
    );
}

#[test]
fn new_receives_reach_a_requester_that_knows_of_none_and_only_then() {
    let mut p = pair(&Params::default());
    let dst = p.b.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let post = |p: &mut Pair, i: u64| {
        p.b.qp
            .post_recv(&RecvWr::new(i, &[dst.sge(i * 64, 64).unwrap()]))
            .unwrap();
    };
    // Connected with an empty RQ: the responder's first report says 0 credits.
    p.settle();
    let acks = |p: &Pair| p.b.ctx.stats().acks_sent;
    let at_start = acks(&p);
    assert_eq!(at_start, 1, "one unsolicited report of 0 credits");

    // Receives posted: the requester, which knows of none, is told without being asked.
    post(&mut p, 0);
    p.settle();
    assert_eq!(
        acks(&p),
        at_start + 1,
        "a credit update for the first receive"
    );

    // The requester knows of one: more receives need no update (and no doorbell); the
    // Acks of its Sends report them.
    for i in 1..16 {
        post(&mut p, i);
        p.settle();
    }
    assert_eq!(
        acks(&p),
        at_start + 1,
        "no update once the requester knows of a receive"
    );

    // And the credits were real: 16 Sends go through without an RNR Nak.
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    for i in 0..16u64 {
        p.a.qp
            .post_send(&SendWr::new(i, SendOp::Send, &[src.sge(0, 8).unwrap()]))
            .unwrap();
    }
    let (mut received, start) = (0, Instant::now());
    while received < 16 {
        p.pump();
        while let Some(wc) = p.b.cq.poll_one() {
            assert_eq!(wc.status, WcStatus::Success);
            received += 1;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "stalled at {received}"
        );
    }
    assert_eq!(p.a.ctx.stats().rnr_naks_received, 0);
}

#[test]
fn an_unresponsive_peer_times_out_and_retries_then_fails() {
    // Local Ack Timeout 1: Ttr = 8.192 µs. The peer's engine is never driven.
    let mut p = pair(&Params {
        timeout: 1,
        retry: 3,
        ..Params::default()
    });
    let dst =
        p.b.pd
            .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            1,
            SendOp::RdmaWrite(dst.remote(0)),
            &[src.sge(0, 8).unwrap()],
        ))
        .unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            2,
            SendOp::RdmaWrite(dst.remote(8)),
            &[src.sge(0, 8).unwrap()],
        ))
        .unwrap();
    let start = Instant::now();
    let mut wcs = vec![];
    while wcs.len() < 2 {
        p.a.ctx.progress();
        if let Some(wc) = p.a.cq.poll_one() {
            wcs.push(wc);
        }
        assert!(start.elapsed() < Duration::from_secs(10), "never timed out");
    }
    assert_eq!((wcs[0].wr_id, wcs[0].status), (1, WcStatus::RetryExcErr));
    assert_eq!((wcs[1].wr_id, wcs[1].status), (2, WcStatus::WrFlushErr));
    let s = p.a.ctx.stats();
    assert_eq!(s.timeouts, 4, "the first expiry and three retries");
    assert!(
        s.retransmitted >= 3,
        "each retry resends from the first unacknowledged request: {s:?}"
    );
}

#[test]
fn a_late_peer_is_recovered_by_retransmission() {
    // The peer wakes up after a few timeouts: the retransmitted requests are executed once,
    // the duplicates re-acknowledged.
    let mut p = pair(&Params {
        timeout: 1,
        retry: 7,
        ..Params::default()
    });
    let dst =
        p.b.pd
            .alloc_mr(
                64,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC,
            )
            .unwrap();
    let src = p.a.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, b"retried!").unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            1,
            SendOp::RdmaWrite(dst.remote(0)),
            &[src.sge(0, 8).unwrap()],
        ))
        .unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            2,
            SendOp::FetchAdd {
                remote: dst.remote(8),
                add: 1,
            },
            &[src.sge(8, 8).unwrap()],
        ))
        .unwrap();
    let start = Instant::now();
    while p.a.ctx.stats().timeouts < 2 {
        p.a.ctx.progress();
        assert!(start.elapsed() < Duration::from_secs(10));
    }
    let wcs = wait_a(&mut p, 2);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    let mut got = [0u8; 8];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"retried!");
    assert_eq!(dst.load_u64(8).unwrap(), 1, "the atomic ran exactly once");
    let mut orig = [0u8; 8];
    src.read_at(8, &mut orig).unwrap();
    assert_eq!(u64::from_ne_bytes(orig), 0);
}

#[test]
fn multi_packet_messages_without_loss_retransmit_nothing() {
    // Found by the connection-manager tests: continuation packets were counted as
    // retransmissions.
    let mut p = pair(&Params::default()); // PMTU 1024
    let src = p.a.pd.alloc_mr(8192, AccessFlags::NONE).unwrap();
    let dst =
        p.b.pd
            .alloc_mr(8192, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
            .unwrap();
    let back = p.a.pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(7, &[dst.sge(0, 8192).unwrap()]))
        .unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            1,
            SendOp::Send,
            &[src.sge(0, 3 * 1024).unwrap()],
        ))
        .unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            2,
            SendOp::RdmaRead(dst.remote(0)),
            &[back.sge(0, 5000).unwrap()],
        ))
        .unwrap();
    assert_eq!(wait_b(&mut p, 1)[0].status, WcStatus::Success);
    assert!(
        wait_a(&mut p, 2)
            .iter()
            .all(|w| w.status == WcStatus::Success)
    );
    let s = p.a.ctx.stats();
    assert_eq!(
        s.timeouts + s.rnr_naks_received + p.b.ctx.stats().naks_sent,
        0
    );
    assert_eq!(s.retransmitted, 0, "{s:?}");
    assert_eq!(
        s.packets_sent - s.acks_sent,
        3 + 1,
        "three Send packets and one Read request: {s:?}"
    );
}

#[test]
fn an_ack_leaves_even_if_the_receiver_stops_polling() {
    // Found by the connection manager's tests: an Ack held back for a later engine
    // iteration never left when the receiving application stopped polling (inline mode).
    let p = pair(&Params::default());
    let (mut a, mut b) = (p.a, p.b);
    let src = a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    let dst = b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    b.qp.post_recv(&RecvWr::new(7, &[dst.sge(0, 64).unwrap()]))
        .unwrap();
    a.qp.post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 8).unwrap()]))
        .unwrap();
    // B's application polls until it has the message, then does something else.
    let mut wc = [WorkCompletion::default(); 1];
    loop {
        a.ctx.progress();
        if b.cq.poll(&mut wc) == 1 {
            break;
        }
    }
    assert_eq!(wc[0].status, WcStatus::Success);
    // Only A's engine runs from now on.
    let got = a.cq.poll_until(&mut wc, Duration::from_secs(10));
    assert_eq!(got, 1);
    assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
}

#[test]
fn a_write_with_immediate_refused_for_want_of_a_receive_succeeds_when_retried() {
    // Found by the trust review (issue 8, item 11a): the responder took the RNR-Nak'd
    // Write for one in progress, so its retry was Nak'd Invalid Request.
    let mut p = pair(&Params {
        min_rnr_timer: 1,
        rnr_retry: 7,
        ..Params::default()
    });
    let src = p.a.pd.alloc_mr(4096, AccessFlags::NONE).unwrap();
    src.write_at(0, &pattern(700, 9)).unwrap();
    let dst =
        p.b.pd
            .alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            1,
            SendOp::RdmaWriteWithImm(dst.remote(100), 0xfeed),
            &[src.sge(0, 700).unwrap()],
        ))
        .unwrap();
    // No receive posted: the Write Only with Immediate is refused with an RNR Nak.
    let start = Instant::now();
    while p.a.ctx.stats().rnr_naks_received < 1 {
        p.pump();
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no RNR Nak arrived"
        );
    }
    assert_eq!(p.b.qp.state(), QpState::Rts, "an RNR Nak is not an error");
    let buf = p.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(2, &[buf.sge(0, 64).unwrap()]))
        .unwrap();
    let rc = wait_b(&mut p, 1)[0];
    assert_eq!(
        (rc.wr_id, rc.status, rc.opcode, rc.byte_len, rc.imm_data),
        (
            2,
            WcStatus::Success,
            WcOpcode::RecvRdmaWithImm,
            700,
            Some(0xfeed)
        ),
        "{rc:?}"
    );
    let sc = wait_a(&mut p, 1)[0];
    assert_eq!((sc.wr_id, sc.status), (1, WcStatus::Success), "{sc:?}");
    let mut got = vec![0u8; 700];
    dst.read_at(100, &mut got).unwrap();
    assert_eq!(got, pattern(700, 9));
    assert_eq!(p.a.qp.state(), QpState::Rts);
    assert_eq!(p.b.qp.state(), QpState::Rts);
}
