//! Timers of QPs that only wait — for an Ack under the transport timer, or for the end of
//! an RNR wait — fire while their engine has nothing else to do. Such a QP leaves the
//! engine's active set for its timed set, so its engine's iterations are quiet until the
//! timer check; the timer must fire all the same, on a spinning engine thread and on one
//! that may sleep (it must not sleep while a timer is armed). The requester's engine runs
//! in poll mode; the responder's is an inline one the test drives (or leaves silent).
mod common;

use std::time::{Duration, Instant};

use common::*;
use shmhca::*;

/// How long a wait may take before it is a failure: generous, nothing here measures speed.
const DEADLINE: Duration = Duration::from_secs(20);

/// Sleeps of up to a minute: an engine thread that slept through an armed timer misses
/// the deadline.
const SLEEPY: IdlePolicy = IdlePolicy::Backoff {
    spins: 100,
    max_sleep: Duration::from_secs(60),
};

/// A requester context in poll mode (`idle`) and a responder context in inline mode with
/// manual progress, linked, one connected QP each; Local Ack Timeout 10 (about 4 ms).
fn rig(idle: IdlePolicy) -> Pair {
    let p = Params {
        timeout: 10,
        ..Params::default()
    };
    let ca = Context::builder()
        .arena_size(4 << 20)
        .huge_pages(shmhca_rings::HugePages::Never)
        .mode(EngineMode::Poll { cpu: None })
        .idle(idle)
        .build()
        .unwrap();
    let pair = pair_of(ca, context(4 << 20), &p);
    // The responder's first credit report reaches the requester before the test starts.
    let start = Instant::now();
    while pair.b.ctx.stats().acks_sent == 0 {
        pair.b.ctx.progress();
        assert!(start.elapsed() < DEADLINE, "no credit report");
    }
    pair
}

/// Drives B (when `drive_b`) until `done` holds for A's counters.
fn until(p: &Pair, what: &str, drive_b: bool, done: impl Fn(&Stats) -> bool) {
    let start = Instant::now();
    while !done(&p.a.ctx.stats()) {
        if drive_b {
            p.b.ctx.progress();
        } else {
            std::thread::yield_now();
        }
        assert!(start.elapsed() < DEADLINE, "no {what} in {DEADLINE:?}");
    }
}

/// Drives B until A's CQ holds the Send's completion and B's the receive's; checks both.
fn complete(p: &mut Pair) {
    let start = Instant::now();
    let mut wc = [WorkCompletion::default(); 4];
    let (mut on_a, mut on_b) = (vec![], vec![]);
    while on_a.is_empty() || on_b.is_empty() {
        p.b.ctx.progress();
        let n = p.b.cq.poll(&mut wc);
        on_b.extend_from_slice(&wc[..n]);
        let n = p.a.cq.poll(&mut wc);
        on_a.extend_from_slice(&wc[..n]);
        assert!(start.elapsed() < DEADLINE, "completions {on_a:?} {on_b:?}");
    }
    assert_eq!((on_a[0].wr_id, on_a[0].status), (1, WcStatus::Success));
    assert_eq!((on_b[0].wr_id, on_b[0].status), (2, WcStatus::Success));
    assert_eq!((on_a.len(), on_b.len()), (1, 1), "one Send, delivered once");
}

/// A's Send to a silent B times out and is sent again, on A's engine thread alone.
fn transport_timer_fires(idle: IdlePolicy) {
    let mut p = rig(idle);
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    let dst = p.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(2, &[dst.sge(0, 64).unwrap()]))
        .unwrap();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 8).unwrap()]))
        .unwrap();
    // B's engine is not driven: nothing reaches A, whose QP only waits for its Ack.
    until(&p, "transport timeouts", false, |s| s.timeouts >= 2);
    complete(&mut p);
}

/// A's Send to B without a receive posted draws RNR Naks; each RNR wait ends and A's
/// engine thread sends again, with nothing else to do meanwhile.
fn rnr_waits_end(idle: IdlePolicy) {
    let mut p = rig(idle);
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    let dst = p.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 8).unwrap()]))
        .unwrap();
    until(&p, "RNR retries", true, |s| s.rnr_naks_received >= 3);
    p.b.qp
        .post_recv(&RecvWr::new(2, &[dst.sge(0, 64).unwrap()]))
        .unwrap();
    complete(&mut p);
}

#[test]
fn a_spinning_engine_thread_times_out_a_silent_peer() {
    transport_timer_fires(IdlePolicy::Spin);
}

#[test]
fn a_sleepy_engine_thread_times_out_a_silent_peer() {
    transport_timer_fires(SLEEPY);
}

#[test]
fn a_spinning_engine_thread_retries_after_rnr_waits() {
    rnr_waits_end(IdlePolicy::Spin);
}

#[test]
fn a_sleepy_engine_thread_retries_after_rnr_waits() {
    rnr_waits_end(SLEEPY);
}
