//! The protocol timers on a test clock ([`shmhca::timer::TestClock`]): the transport timer,
//! RNR waits and both retry counts, checked to the nanosecond of protocol time with no
//! waiting at all — the engines run only when the test drives them and time moves only
//! when the test moves it. (`timers.rs` checks the same rules on the wall clock.)

use std::time::Duration;

use shmhca::timer::TestClock;
use shmhca::*;

/// Engine iterations a step drives both engines for: plenty for any packet exchange that
/// needs no time to pass.
const SETTLE: usize = 200;

struct Rig {
    clock: TestClock,
    a: Context,
    b: Context,
    cq_a: Cq,
    qa: Qp,
    qb: Qp,
    src: Mr,
}

/// A QP on `a` (on the test clock) connected to one on `b`. `peer_rts`: whether B's QP goes
/// to RTS (else it stays in Init and drops everything, as a peer that is gone). `b_rnr`:
/// B's Min RNR NAK Timer code.
fn rig(timeout: u8, retry_cnt: u8, rnr_retry: u8, peer_rts: bool, b_rnr: u8) -> Rig {
    let clock = TestClock::new();
    let a = Context::builder()
        .mode(EngineMode::Inline)
        .progress(Progress::Manual)
        .test_clock(&clock)
        .arena_size(1 << 20)
        .build()
        .unwrap();
    let b = Context::builder()
        .mode(EngineMode::Inline)
        .progress(Progress::Manual)
        .arena_size(1 << 20)
        .build()
        .unwrap();
    let (la, lb) = a.link_with(&b).unwrap();
    let (pd_a, pd_b) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
    let (cq_a, cq_b) = (a.create_cq(16).unwrap(), b.create_cq(16).unwrap());
    let mut qa = a.create_qp(&pd_a, &cq_a, &cq_a, QpCaps::default()).unwrap();
    let mut qb = b.create_qp(&pd_b, &cq_b, &cq_b, QpCaps::default()).unwrap();
    let init = QpAttr::new(QpState::Init).access(AccessFlags::NONE);
    qa.modify(&init).unwrap();
    qb.modify(&init).unwrap();
    let rtr = |link, qpn, rnr| {
        QpAttr::new(QpState::Rtr)
            .path_mtu(Mtu::Mtu1024)
            .dest(Destination { link, qpn })
            .rq_psn(0)
            .max_dest_rd_atomic(1)
            .min_rnr_timer(rnr)
    };
    let rts = QpAttr::new(QpState::Rts)
        .sq_psn(0)
        .timeout(timeout)
        .retry_cnt(retry_cnt)
        .rnr_retry(rnr_retry)
        .max_rd_atomic(1);
    qa.modify(&rtr(la, qb.qpn(), 1)).unwrap();
    qa.modify(&rts).unwrap();
    if peer_rts {
        qb.modify(&rtr(lb, qa.qpn(), b_rnr)).unwrap();
        qb.modify(&rts).unwrap();
    }
    let src = pd_a.alloc_mr(64, AccessFlags::NONE).unwrap();
    Rig {
        clock,
        a,
        b,
        cq_a,
        qa,
        qb,
        src,
    }
}

impl Rig {
    /// Drives both engines with the clock standing still.
    fn settle(&self) {
        for _ in 0..SETTLE {
            self.a.progress();
            self.b.progress();
        }
    }

    fn send(&mut self) {
        self.qa
            .post_send(&SendWr::new(
                1,
                SendOp::Send,
                &[self.src.sge(0, 8).unwrap()],
            ))
            .unwrap();
        self.settle();
    }

    /// How long until A's next timer, on the test clock.
    fn next(&self) -> Duration {
        self.a.next_timer().expect("a timer is armed")
    }

    fn completion(&mut self) -> Option<WorkCompletion> {
        let mut wc = [WorkCompletion::default()];
        (self.cq_a.poll(&mut wc) == 1).then_some(wc[0])
    }
}

/// Ttr of a Local Ack Timeout: 4.096 µs × 2^timeout.
fn ttr(timeout: u8) -> Duration {
    Duration::from_nanos(4096 << timeout)
}

/// spec/01: a timeout is detected no sooner than Ttr after the request was sent (and no
/// later than 4·Ttr). On the test clock: not one nanosecond early, and at once after.
#[test]
fn a_transport_timeout_fires_at_ttr_and_not_a_nanosecond_before() {
    let mut r = rig(14, 7, 0, false, 1);
    r.send();
    // Nothing happens while time stands still, however often the engine runs.
    r.settle();
    assert_eq!(r.a.stats().timeouts, 0);
    let wait = r.next();
    assert!(
        wait >= ttr(14) && wait <= 4 * ttr(14),
        "the timer is armed for Ttr = {:?} (plus the clock's resolution): {wait:?}",
        ttr(14)
    );
    r.clock.advance(wait - Duration::from_nanos(1));
    r.settle();
    assert_eq!(r.a.stats().timeouts, 0, "one nanosecond early");
    assert_eq!(r.a.stats().retransmitted, 0);
    r.clock.advance(Duration::from_nanos(1));
    r.settle();
    assert_eq!(r.a.stats().timeouts, 1, "on time");
    assert_eq!(
        r.a.stats().retransmitted,
        1,
        "and the request is sent again"
    );
    assert!(r.completion().is_none(), "retries are left");
}

/// spec/01: after Retry Count retries the request completes with RetryExcErr (IBV_WC_RETRY_EXC_ERR):
/// retry_cnt + 1 timeouts in all, whatever the timeout's length — here 4.3 s each, 17 s of
/// protocol time in no wall time.
#[test]
fn the_retry_count_runs_out_after_retry_cnt_plus_one_timeouts() {
    let mut r = rig(20, 3, 0, false, 1);
    r.send();
    for n in 1..=4u64 {
        assert!(r.completion().is_none(), "before timeout {n}");
        let wait = r.next();
        assert!(wait >= ttr(20), "timeout {n} armed for {wait:?}");
        r.clock.advance(wait);
        r.settle();
        assert_eq!(r.a.stats().timeouts, n);
    }
    let wc = r.completion().expect("the retries ran out");
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RetryExcErr));
    assert_eq!(r.a.stats().retransmitted, 3, "retry_cnt retransmissions");
    assert_eq!(r.qa.state(), QpState::Error);
    assert!(
        r.a.next_timer().is_none(),
        "no timer runs in the Error state"
    );
}

/// spec/04 "Minimum RNR NAK Timer Field": after an RNR Nak the requester waits at least
/// the time the responder's code asks (code 0: 655.36 ms) before it sends again, and
/// RNR Retry Count retries later the request completes with RnrRetryExcErr.
#[test]
fn an_rnr_wait_lasts_what_the_code_says_and_the_rnr_retries_run_out() {
    // B has no receive posted: every Send is RNR Nak'd with code 0.
    let mut r = rig(31, 7, 2, true, 0);
    let asked = Duration::from_micros(655_360);
    r.send();
    for n in 1..=2u64 {
        assert_eq!(r.a.stats().rnr_naks_received, n, "RNR Nak {n}");
        let wait = r.next();
        assert!(
            wait >= asked && wait < asked + Duration::from_millis(1),
            "RNR wait {n}: {wait:?}, asked {asked:?}"
        );
        r.clock.advance(wait - Duration::from_nanos(1));
        r.settle();
        assert_eq!(
            r.a.stats().retransmitted,
            n - 1,
            "not before the wait is over"
        );
        r.clock.advance(Duration::from_nanos(1));
        r.settle();
        assert_eq!(r.a.stats().retransmitted, n, "sent again once it is");
    }
    // The third RNR Nak exhausts rnr_retry = 2.
    assert_eq!(r.a.stats().rnr_naks_received, 3);
    let wc = r.completion().expect("the RNR retries ran out");
    assert_eq!(wc.status, WcStatus::RnrRetryExcErr);
    assert_eq!(r.a.stats().timeouts, 0, "no transport timeout on the way");
    drop(r.qb);
}

/// An engine on the test clock never times out by itself, however long the test runs:
/// only the test's clock moves its timers.
#[test]
fn a_test_clock_that_stands_still_stops_every_timer() {
    let mut r = rig(1, 7, 0, false, 1);
    r.send();
    // Ttr is 8 µs here: on the system clock this loop would time out many times over.
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_millis(20) {
        r.settle();
    }
    assert_eq!(r.a.stats().timeouts, 0);
    assert!(r.completion().is_none());
}
