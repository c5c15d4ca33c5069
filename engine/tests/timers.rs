//! Timers that mean what they say (spec/01 "SQ Logic's Transport Timer", spec/04 "Minimum
//! RNR NAK Timer Field"): an RNR wait lasts at least the timer value the responder asked
//! for and not much longer, and a transport timeout is detected between Ttr and 4·Ttr.
//!
//! The waits are measured on the wire: a packet observer on the requester's engine stamps
//! every packet it sends and receives, and the wait is the time from the packet that starts
//! a timer (an RNR Nak received, a request sent) to the retransmission that ends it. The
//! lower bounds are the spec's and hold on any machine. The upper bounds are liveness
//! bounds for a loaded machine — the smallest and the median of several waits — and are
//! still far below what a clock with a 4 ms tick gives (every timer at least 4 ms longer
//! than its value).

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Pair, Params, pair};
use shmhca::trace::{Direction, PacketEvent};
use shmhca::wire::aeth::Syndrome;
use shmhca::{AccessFlags, RecvWr, SendOp, SendWr, WcStatus};

/// What the requester's engine saw, stamped when it saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// A request packet sent.
    Request,
    /// An RNR Nak received.
    RnrNak,
    /// Anything else.
    Other,
}

fn classify(ev: &PacketEvent<'_>) -> Seen {
    match (ev.direction, ev.headers.aeth) {
        (Direction::Sent, None) => Seen::Request,
        (Direction::Received, Some(a)) if matches!(a.syndrome, Syndrome::RnrNak { .. }) => {
            Seen::RnrNak
        }
        _ => Seen::Other,
    }
}

/// Stamps every packet A's engine sends and receives.
fn record(p: &Pair) -> Arc<Mutex<Vec<(Instant, Seen)>>> {
    let log = Arc::new(Mutex::new(Vec::with_capacity(4096)));
    let l = log.clone();
    p.a.ctx.observe_packets(move |ev| {
        let t = Instant::now();
        l.lock().unwrap().push((t, classify(ev)));
    });
    log
}

fn sorted(mut v: Vec<Duration>) -> Vec<Duration> {
    v.sort();
    v
}

/// The waits between each RNR Nak A received and the retransmission that followed it, for
/// a responder whose minimum RNR timer is `code`; `n` waits.
fn rnr_waits(code: u8, n: usize) -> Vec<Duration> {
    let mut p = pair(&Params {
        min_rnr_timer: code,
        rnr_retry: 7,
        ..Params::default()
    });
    p.settle();
    let log = record(&p);
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    let dst = p.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    // No receive is posted at B: every Send draws an RNR Nak.
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 8).unwrap()]))
        .unwrap();
    let start = Instant::now();
    while p.a.ctx.stats().rnr_naks_received < n as u64 + 1 {
        p.pump();
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "only {} RNR Naks in 30 s",
            p.a.ctx.stats().rnr_naks_received
        );
    }
    p.a.ctx.stop_observing();
    // The Send still completes once a receive is there.
    p.b.qp
        .post_recv(&RecvWr::new(9, &[dst.sge(0, 64).unwrap()]))
        .unwrap();
    let wc = common::wait_a(&mut p, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::Success));

    let log = log.lock().unwrap();
    let mut waits = vec![];
    for (i, &(t, seen)) in log.iter().enumerate() {
        if seen != Seen::RnrNak {
            continue;
        }
        if let Some(&(r, _)) = log[i + 1..].iter().find(|(_, s)| *s == Seen::Request) {
            waits.push(r - t);
        }
    }
    assert!(waits.len() >= n, "{} waits measured: {log:?}", waits.len());
    sorted(waits)
}

/// Checks the RNR waits of timer `code`, whose value is `value`.
fn check_rnr(code: u8, value: Duration) {
    let waits = rnr_waits(code, 9);
    let (min, median) = (waits[0], waits[waits.len() / 2]);
    eprintln!("RNR timer code {code} ({value:?}): min {min:?}, median {median:?}, all {waits:?}");
    // spec/04: the requester waits at least the timer value before retrying.
    for w in &waits {
        assert!(
            *w >= value,
            "an RNR wait of {w:?} is shorter than {value:?}"
        );
    }
    // And not much longer: a 4 ms clock tick would add at least 4 ms to every one.
    assert!(
        min <= value + Duration::from_micros(500),
        "the shortest of {} RNR waits took {min:?} for a timer of {value:?}: {waits:?}",
        waits.len()
    );
    assert!(
        median <= value + Duration::from_millis(3),
        "the median RNR wait took {median:?} for a timer of {value:?}: {waits:?}"
    );
}

#[test]
fn rnr_timer_code_1_waits_10_microseconds_not_a_clock_tick() {
    check_rnr(1, Duration::from_micros(10));
}

#[test]
fn rnr_timer_code_12_waits_640_microseconds() {
    check_rnr(12, Duration::from_micros(640));
}

#[test]
fn rnr_timer_code_14_waits_1280_microseconds() {
    check_rnr(14, Duration::from_micros(1280));
}

/// The gaps between a request, its retransmissions and its failure, for a Local Ack
/// Timeout of 8 and a peer that never answers (B's engine is never driven).
fn transport_gaps(retries: u8) -> Vec<Duration> {
    let mut p = pair(&Params {
        timeout: 8,
        retry: retries,
        ..Params::default()
    });
    let log = record(&p);
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
    let start = Instant::now();
    let (wc, failed_at) = loop {
        p.a.ctx.progress();
        if let Some(wc) = p.a.cq.poll_one() {
            break (wc, Instant::now());
        }
        assert!(start.elapsed() < Duration::from_secs(20), "never timed out");
    };
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RetryExcErr));
    p.a.ctx.stop_observing();
    assert_eq!(p.a.ctx.stats().timeouts, u64::from(retries) + 1);
    // The request and its retransmissions, then the completion: each gap is one timeout.
    let mut sent: Vec<Instant> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, s)| *s == Seen::Request)
        .map(|&(t, _)| t)
        .collect();
    assert_eq!(
        sent.len(),
        usize::from(retries) + 1,
        "the request and each retry"
    );
    sent.push(failed_at);
    sent.windows(2).map(|w| w[1] - w[0]).collect()
}

#[test]
fn a_short_transport_timeout_is_detected_between_ttr_and_4_ttr() {
    // Local Ack Timeout 8: Ttr = 4.096 µs × 2^8 = 1.048576 ms. Two requests, each retried
    // 7 times: 16 timeouts.
    let ttr = Duration::from_nanos(4096 << 8);
    let mut gaps = transport_gaps(7);
    gaps.extend(transport_gaps(7));
    let gaps = sorted(gaps);
    let (min, median) = (gaps[0], gaps[gaps.len() / 2]);
    eprintln!("transport timeout, Ttr {ttr:?}: min {min:?}, median {median:?}, all {gaps:?}");
    // spec/01: a timeout is detected no sooner than Ttr after the request...
    for g in &gaps {
        assert!(
            *g >= ttr,
            "a timeout detected after {g:?}, before Ttr = {ttr:?}"
        );
    }
    // ...and no later than 4·Ttr; a 4 ms clock tick made every one at least 8 ms.
    assert!(
        median <= 4 * ttr,
        "the median timeout took {median:?}, over 4·Ttr = {:?}: {gaps:?}",
        4 * ttr
    );
    assert!(
        min <= ttr + Duration::from_micros(500),
        "the shortest timeout took {min:?} for Ttr = {ttr:?}: {gaps:?}"
    );
}

#[test]
fn next_timer_says_how_long_an_application_may_sleep() {
    // Ttr = 67.1 ms; B's engine is never driven.
    let ttr = Duration::from_nanos(4096 << 14);
    let mut p = pair(&Params {
        timeout: 14,
        ..Params::default()
    });
    p.a.ctx.progress();
    assert_eq!(
        p.a.ctx.next_timer(),
        None,
        "no timer armed before anything is sent"
    );
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
    p.a.ctx.progress();
    // The transport timer runs: it expires within Ttr from now.
    let left = p.a.ctx.next_timer().expect("the transport timer is armed");
    assert!(
        left <= ttr + Duration::from_micros(1),
        "{left:?} > Ttr {ttr:?}"
    );
    assert_eq!(p.a.ctx.stats().timeouts, 0);
    // Sleeping that long and then driving the engine is enough for it to fire.
    std::thread::sleep(left);
    for _ in 0..16 {
        p.a.ctx.progress();
    }
    assert_eq!(
        p.a.ctx.stats().timeouts,
        1,
        "the timer fired when next_timer said"
    );
    // It was re-armed for the retransmission.
    let again = p.a.ctx.next_timer().expect("re-armed after the retry");
    assert!(again <= ttr + Duration::from_micros(1));
}

/// A transport timer does not expire while the Ack that stops it waits, unread, in the
/// receive ring behind other traffic: after a pause longer than Ttr (a process that was not
/// scheduled), the engine reads what arrived before it concludes that nothing did.
#[test]
fn a_transport_timer_waits_for_the_acks_already_in_the_ring() {
    use common::{connect, context};
    use shmhca::QpCaps;
    const FLOOD: usize = 10;
    const SENDS: usize = 32;
    let p = Params {
        timeout: 8, // Ttr 1.05 ms
        ..Params::default()
    };
    let caps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        ..QpCaps::default()
    };
    let (ca, cb) = (context(p.arena), context(p.arena));
    let (la, lb) = ca.link_with(&cb).unwrap();
    let (pda, pdb) = (ca.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
    let (mut cqa, mut cqb) = (ca.create_cq(4096).unwrap(), cb.create_cq(4096).unwrap());
    // B's flooding QPs are made first: B's engine serves them before the answering QP, so
    // their packets fill the ring ahead of its Ack.
    let mut floods = Vec::new();
    for _ in 0..FLOOD {
        let qa = ca.create_qp(&pda, &cqa, &cqa, caps).unwrap();
        let qb = cb.create_qp(&pdb, &cqb, &cqb, caps).unwrap();
        floods.push((qa, qb));
    }
    let mut a1 = ca.create_qp(&pda, &cqa, &cqa, caps).unwrap();
    let mut b1 = cb.create_qp(&pdb, &cqb, &cqb, caps).unwrap();
    let (qa1, qb1) = (a1.qpn(), b1.qpn());
    connect(&mut a1, la, qb1, 1, 2, &p);
    connect(&mut b1, lb, qa1, 2, 1, &p);
    for (qa, qb) in &mut floods {
        let (na, nb) = (qa.qpn(), qb.qpn());
        connect(qa, la, nb, 3, 4, &p);
        connect(qb, lb, na, 4, 3, &p);
    }
    let dst_a = pda.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let dst_b = pdb.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let src_a = pda.alloc_mr(64, AccessFlags::NONE).unwrap();
    let src_b = pdb.alloc_mr(64, AccessFlags::NONE).unwrap();
    for (qa, _) in &mut floods {
        for i in 0..SENDS {
            qa.post_recv(&RecvWr::new(i as u64, &[dst_a.sge(0, 8).unwrap()]))
                .unwrap();
        }
    }
    b1.post_recv(&RecvWr::new(0, &[dst_b.sge(0, 8).unwrap()]))
        .unwrap();

    // A's request leaves, and A's timer checks start its transport timer.
    a1.post_send(&SendWr::new(1, SendOp::Send, &[src_a.sge(0, 8).unwrap()]))
        .unwrap();
    for _ in 0..16 {
        ca.progress();
    }
    // B answers it behind FLOOD × SENDS Sends of its own.
    for (_, qb) in &mut floods {
        for i in 0..SENDS {
            qb.post_send(&SendWr::new(
                i as u64,
                SendOp::Send,
                &[src_b.sge(0, 8).unwrap()],
            ))
            .unwrap();
        }
    }
    for _ in 0..(FLOOD * SENDS / 32 + 2) {
        cb.progress();
    }
    // A is "descheduled" for longer than Ttr, then reads its ring, 32 packets at a time.
    std::thread::sleep(Duration::from_millis(5));
    let before = ca.stats().timeouts;
    for _ in 0..FLOOD * SENDS / 32 + 4 {
        ca.progress();
    }
    assert_eq!(
        ca.stats().timeouts,
        before,
        "the transport timer expired although its Ack was waiting in the ring"
    );
    // And everything completes.
    let want_a = 1 + FLOOD * SENDS;
    let want_b = 1 + FLOOD * SENDS;
    let (mut got_a, mut got_b) = (0, 0);
    let start = Instant::now();
    let mut wcs = [shmhca::WorkCompletion::default(); 64];
    while got_a < want_a || got_b < want_b {
        ca.progress();
        cb.progress();
        for (cq, got) in [(&mut cqa, &mut got_a), (&mut cqb, &mut got_b)] {
            let n = cq.poll(&mut wcs);
            assert!(
                wcs[..n].iter().all(|w| w.status == WcStatus::Success),
                "{wcs:?}"
            );
            *got += n;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{got_a}/{want_a} {got_b}/{want_b}"
        );
    }
}
