use super::*;
use crate::timer::{Clock, ManualClock};
use crate::wqe::DataLoc;

/// Local Ack Timeout 14: 4.096 µs × 2^14, about 67 ms.
const TIMEOUT: u8 = 14;

fn cfg(retry_cnt: u8, rnr_retry: u8) -> QpConfig {
    QpConfig {
        sq_psn: Psn::new(100),
        retry_cnt,
        rnr_retry,
        timeout: TIMEOUT,
        max_rd_atomic: 1,
        remote_credits: false,
        ..QpConfig::default()
    }
}

fn wqe(op: WqeOp, len: u32) -> SqWqe {
    SqWqe {
        wr_id: 7,
        op,
        flags: WqeFlags(WqeFlags::SIGNALED),
        imm: 0,
        len,
        remote_addr: 0x1000,
        rkey: 0x42,
        compare_add: 0,
        swap: 0,
        data: DataLoc::Empty,
    }
}

/// A requester in RTS on `clock` with one `op` WQE of `len` bytes sent whole (as the
/// engine's transmit path drives it); returns it and the WQE's first PSN.
fn sent_one(c: &QpConfig, clock: &ManualClock, op: WqeOp, len: u32) -> Requester {
    let mut req = Requester::new(8);
    req.start(c, clock.resolution());
    req.accept(wqe(op, len), c.path_mtu.bytes());
    send_all(&mut req, c);
    req.start_timers(&mut clock.timers());
    req
}

/// Sends every packet the transmit point may send now; returns their PSNs.
fn send_all(req: &mut Requester, c: &QpConfig) -> Vec<u32> {
    let mut psns = Vec::new();
    for _ in 0..64 {
        let Step::Packet {
            seq,
            new_wqe,
            point,
        } = req.next_step(QpState::Rts, c.max_rd_atomic)
        else {
            break;
        };
        if new_wqe {
            req.begin_wqe();
        }
        let w = *req.wqe(seq);
        let psn = w.first_psn.add(point.pkt);
        req.note_sent(&w, psn);
        psns.push(psn.get());
        let next = (!Requester::ends_wqe(&w, point.pkt)).then(Cursor::default);
        req.packet_sent(next);
    }
    req.after_transmit(!psns.is_empty(), None);
    psns
}

/// Runs the timers at each deadline in turn (the clock jumps there), up to `n` times;
/// returns what each expiry meant.
fn expiries(req: &mut Requester, clock: &ManualClock, n: usize) -> Vec<Timeout> {
    let mut out = Vec::new();
    for _ in 0..n {
        req.start_timers(&mut clock.timers());
        let Some(at) = req.timer().at() else { break };
        clock.advance_to(at);
        let t = req.handle_timeout(&mut clock.timers(), false);
        out.push(t);
        if matches!(t, Timeout::Exhausted { .. }) {
            break;
        }
    }
    out
}

/// spec/01 "On Timeout, Request Packet Is Resent": each expiry with no response
/// resends from the oldest unacknowledged PSN and spends one of the Retry Count; the
/// expiry with none left fails the oldest WQE. Seven retries (the most the field holds)
/// of a 67 ms timer take no wall time on the manual clock.
#[test]
fn the_retry_count_runs_out_after_retry_cnt_resends() {
    let clock = ManualClock::new(Timestamp::from_nanos(5));
    let c = cfg(7, 0);
    let mut req = sent_one(&c, &clock, WqeOp::Send, 3000);
    let start = clock.now();
    let out = expiries(&mut req, &clock, 20);
    let mut want = vec![Timeout::Resend(Psn::new(100)); 7];
    want.push(Timeout::Exhausted {
        seq: Some(0),
        link_full: false,
    });
    assert_eq!(out, want);
    assert_eq!(req.retry_state(), (None, 0, 0));
    // Eight periods of at least Ttr each went by on the manual clock.
    let ttr = req.ttr().unwrap();
    let waited = clock.now().saturating_duration_since(start);
    assert!(
        waited >= ttr * 8 && waited < ttr * 9,
        "{waited:?} for Ttr {ttr:?}"
    );
    // After each resend the transmit point is back at the first PSN: the whole message
    // (3 packets at PMTU 1024) goes again.
    let mut again = sent_one(&c, &clock, WqeOp::Send, 3000);
    assert_eq!(
        expiries(&mut again, &clock, 1),
        [Timeout::Resend(Psn::new(100))]
    );
    assert_eq!(send_all(&mut again, &c), [100, 101, 102]);
}

/// Retry Count 0: the first expiry fails the WQE.
#[test]
fn retry_cnt_zero_fails_at_the_first_expiry() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let mut req = sent_one(&cfg(0, 0), &clock, WqeOp::Write, 8);
    assert_eq!(
        expiries(&mut req, &clock, 3),
        [Timeout::Exhausted {
            seq: Some(0),
            link_full: false
        }]
    );
}

/// A response that makes progress fills the Retry Count again, and an expiry after it
/// starts a new period instead of resending: the timer detects the cessation of
/// responses (spec/01), so a timeout comes between Ttr and 2 Ttr after the last one.
#[test]
fn progress_refills_the_count_and_restarts_the_period() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(2, 0);
    let mut req = Requester::new(8);
    req.start(&c, clock.resolution());
    for _ in 0..2 {
        req.accept(wqe(WqeOp::Send, 8), c.path_mtu.bytes());
    }
    assert_eq!(send_all(&mut req, &c), [100, 101]);
    req.start_timers(&mut clock.timers());
    assert_eq!(
        expiries(&mut req, &clock, 1),
        [Timeout::Resend(Psn::new(100))]
    );
    assert_eq!(req.retry_state().1, 1);
    assert_eq!(send_all(&mut req, &c), [100, 101]);
    // The first Send is acknowledged: the count is full again, the timer runs on.
    assert!(req.acknowledged(Psn::new(100), &c));
    assert_eq!(req.retry_state(), (None, 2, 0));
    assert!(req.timer().armed());
    assert_eq!(
        expiries(&mut req, &clock, 1),
        [Timeout::Nothing],
        "a new period"
    );
    assert_eq!(req.retry_state().1, 2);
    // No response for a whole period: a timeout, from the PSN after the acknowledged.
    assert_eq!(
        expiries(&mut req, &clock, 1),
        [Timeout::Resend(Psn::new(101))]
    );
    // Everything acknowledged: the timer stops.
    assert!(req.acknowledged(Psn::new(101), &c));
    assert!(!req.timer().armed());
    assert_eq!(expiries(&mut req, &clock, 1), []);
}

/// Responses waiting to be handled hold the timeout back: the one that would stop the
/// timer may be among them.
#[test]
fn responses_waiting_hold_the_timeout_back() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(1, 0);
    let mut req = sent_one(&c, &clock, WqeOp::Send, 8);
    clock.advance_to(req.timer().at().unwrap());
    assert_eq!(
        req.handle_timeout(&mut clock.timers(), true),
        Timeout::Nothing
    );
    assert!(req.timer().armed(), "looked at again later");
    assert_eq!(
        req.handle_timeout(&mut clock.timers(), false),
        Timeout::Resend(Psn::new(100))
    );
}

/// spec/01 RNR: each RNR Nak waits the time it names, then the request goes again,
/// spending one of the RNR Retry Count; with none left the Nak fails the WQE (the
/// caller's, on `false`). The transport timer stops during the wait.
#[test]
fn rnr_naks_spend_the_rnr_retry_count() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(3, 2);
    let mut req = sent_one(&c, &clock, WqeOp::Send, 8);
    let wait = crate::wire::aeth::RnrTimer::new(14).duration(); // 1.28 ms
    for left in [1, 0] {
        assert!(req.rnr_wait(Psn::new(100), wait, &c));
        assert_eq!(req.retry_state().2, left);
        assert!(!req.timer().armed(), "no transport timer during the wait");
        req.start_timers(&mut clock.timers());
        assert!(req.rnr_waiting(&mut clock.timers()), "nothing goes yet");
        let at = req.rnr_timer().at().unwrap();
        assert!(at >= clock.now().after(wait), "no sooner than the Nak asks");
        clock.advance_to(at);
        assert!(!req.rnr_waiting(&mut clock.timers()), "the wait is over");
        assert_eq!(send_all(&mut req, &c), [100], "sent again");
    }
    assert!(!req.rnr_wait(Psn::new(100), wait, &c), "no RNR retry left");
    // RNR Retry Count 7 means forever (spec/01).
    let c7 = cfg(3, RNR_RETRY_FOREVER);
    let mut forever = sent_one(&c7, &clock, WqeOp::Send, 8);
    for _ in 0..100 {
        assert!(forever.rnr_wait(Psn::new(100), wait, &c7));
    }
    assert_eq!(forever.retry_state().2, RNR_RETRY_FOREVER);
}

/// A request waiting for room on a full link counts against the transport timer: each
/// expiry spends a retry and sends nothing again; none left fails it with `link_full`.
/// A peer that frees room between two looks is slow, not stopped: no retry is spent.
#[test]
fn a_request_waiting_for_room_times_out_like_one_sent() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(1, 0);
    let mut req = Requester::new(8);
    req.start(&c, clock.resolution());
    req.accept(wqe(WqeOp::Send, 8), c.path_mtu.bytes());
    assert!(matches!(
        req.next_step(QpState::Rts, 1),
        Step::Packet { new_wqe: true, .. }
    ));
    // No room on the link (the peer read 10 lines so far).
    req.after_transmit(false, Some(10));
    assert_eq!(req.link_wait(), LinkWait::Waiting);
    assert!(!req.window().outstanding());
    // The peer frees room, but others take it: a new period.
    req.after_transmit(false, Some(15));
    assert_eq!(expiries(&mut req, &clock, 1), [Timeout::Nothing]);
    assert_eq!(req.retry_state().1, 1);
    // It frees nothing any more: timeouts, nothing resent, then the failure.
    req.after_transmit(false, Some(15));
    let out = expiries(&mut req, &clock, 5);
    assert_eq!(out[0], Timeout::Resend(Psn::new(100)));
    assert!(matches!(req.link_wait(), LinkWait::Since(_)));
    assert_eq!(
        out[1..],
        [Timeout::Exhausted {
            seq: Some(0),
            link_full: true
        }]
    );
}

/// The gates before a new WQE: the fence waits for Reads in flight, the initiator depth
/// bounds them, and a Send without credit goes alone and holds the rest.
#[test]
fn the_gates_of_a_new_wqe() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(1, 0);
    let mut req = sent_one(&c, &clock, WqeOp::Read, 8);
    assert_eq!(req.rd_atomic(), 1);
    // A second Read waits for the initiator depth (1).
    req.accept(wqe(WqeOp::Read, 8), c.path_mtu.bytes());
    assert_eq!(req.next_step(QpState::Rts, 1), Step::Stop);
    assert!(matches!(
        req.next_step(QpState::Rts, 2),
        Step::Packet { .. }
    ));
    // Not in RTS (SQ drained): nothing new starts.
    assert_eq!(req.next_step(QpState::Sqd, 2), Step::Stop);

    // A fenced Send waits for the Read before it.
    let mut fenced = sent_one(&c, &clock, WqeOp::Read, 8);
    let mut w = wqe(WqeOp::Send, 8);
    w.flags = WqeFlags(WqeFlags::SIGNALED | WqeFlags::FENCE);
    fenced.accept(w, 1024);
    assert_eq!(fenced.next_step(QpState::Rts, 4), Step::Stop);
    assert!(fenced.fast_gate(QpState::Rts, &w, 4).is_none());

    // Credits: a Send the responder has not allowed goes alone, its successor waits.
    let credited = QpConfig {
        remote_credits: true,
        ..c
    };
    let mut limited = Requester::new(8);
    limited.start(&credited, clock.resolution());
    limited.update_credits(CreditCode::new(0), 0); // no receive WQE at the responder
    limited.accept(wqe(WqeOp::Send, 8), 1024);
    limited.accept(wqe(WqeOp::Send, 8), 1024);
    assert_eq!(send_all(&mut limited, &credited), [100]);
    assert_eq!(limited.limited(), Some(0));
    // Its Ack (a receive WQE was found for it) lets the next one go.
    assert!(limited.acknowledged(Psn::new(100), &credited));
    assert_eq!(send_all(&mut limited, &credited), [101]);
}
