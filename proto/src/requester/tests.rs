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

// ---------------------------------------------------------------------------------------
// The state the requester reports, and the operations the completer drives it with.

use crate::ids::LinkId;
use crate::qp::Destination;
use crate::wire::aeth::RnrTimer;

/// A QP config with a destination (so the template path has its BTH), credits as asked.
fn dest_cfg(remote_credits: bool) -> QpConfig {
    QpConfig {
        dest: Some(Destination {
            link: LinkId::new(0),
            qpn: Qpn::new(0x12_3456),
        }),
        remote_credits,
        ..cfg(2, 0)
    }
}

/// A requester of `depth` WQEs in RTS with `c`.
fn rts(c: &QpConfig, clock: &ManualClock, depth: u32) -> Requester {
    let mut req = Requester::new(depth);
    req.start(c, clock.resolution());
    req
}

/// As [`send_all`], but passing over the memory window operations too (each new one is
/// run and completed successfully, as the driver does); returns the PSNs sent and the
/// local operations run.
fn drive(req: &mut Requester, c: &QpConfig) -> (Vec<u32>, Vec<u64>) {
    let mut locals = Vec::new();
    let mut psns = Vec::new();
    for _ in 0..16 {
        match req.next_step(QpState::Rts, c.max_rd_atomic) {
            Step::Local { seq, new_wqe } => {
                if let Some(w) = req.run_local(new_wqe) {
                    locals.push(w.wr_id);
                    req.complete(seq, WcStatus::Success);
                }
            }
            Step::Packet { .. } => psns.extend(send_all(req, c)),
            Step::Stop => break,
        }
    }
    (psns, locals)
}

/// Acknowledges, completes and retires every WQE up to `psn` (what the completer does for
/// an Ack of `psn`).
fn ack_through(req: &mut Requester, psn: u32, c: &QpConfig) {
    req.acknowledged(Psn::new(psn), c);
    while req.window().retired() < req.window().started()
        && !req
            .wqe(req.window().retired())
            .last_psn()
            .after(Psn::new(psn))
    {
        req.complete(req.window().retired(), WcStatus::Success);
        req.retire_oldest();
    }
}

fn fenced(op: WqeOp) -> SqWqe {
    SqWqe {
        flags: WqeFlags(WqeFlags::SIGNALED | WqeFlags::FENCE),
        ..wqe(op, 8)
    }
}

/// The BTH a template writes, as bytes.
fn bth_of(t: &BthTemplate, opcode: Opcode, solicited: bool, pad: u8, psn: Psn) -> [u8; 12] {
    let mut out = [0u8; 12];
    t.write(&mut out, opcode, solicited, pad, psn);
    out
}

/// A fresh requester holds nothing: no Read or Atomic in flight, no WQE limited by
/// credits, nothing to send, no template before RTS, and its window takes `depth` WQEs
/// in as many bytes as their slots need.
#[test]
fn a_new_requester_holds_nothing() {
    let req = Requester::new(5);
    assert_eq!(req.rd_atomic(), 0);
    assert_eq!(req.limited(), None);
    assert!(!req.wants_transmit());
    assert!(req.template().is_none(), "no template before RTS");
    assert_eq!(req.oldest_unfinished(), None, "nothing sent or waiting");
    assert!(req.window().capacity() >= 5);
    assert_eq!(
        req.memory_bytes(),
        req.window().capacity() * size_of::<SendWqe>()
    );
    assert_eq!(req.memory_bytes(), req.window().memory_bytes());
}

/// `reset` (QP reset) drops everything: the window, the counters, the timers, the
/// template; only the depth stays.
#[test]
fn a_reset_drops_everything() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = dest_cfg(true);
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::Read, 8), 1024);
    req.accept(wqe(WqeOp::Send, 8), 1024);
    send_all(&mut req, &c);
    req.start_timers(&mut clock.timers());
    assert_eq!((req.rd_atomic(), req.limited()), (1, Some(1)));
    assert!(req.timer().armed() && req.template().is_some());
    let bytes = req.memory_bytes();
    req.reset();
    assert_eq!((req.rd_atomic(), req.limited()), (0, None));
    assert_eq!(req.retry_state(), (None, 0, 0));
    assert!(!req.timer().armed() && !req.rnr_timer().armed());
    assert!(req.template().is_none());
    assert!(!req.wants_transmit() && !req.window().outstanding());
    assert_eq!(req.window().fetched(), 0);
    assert_eq!(req.memory_bytes(), bytes);
}

/// `wants_transmit`: something to send, or an RNR wait to look at; neither once all is
/// sent and no wait runs.
#[test]
fn wants_transmit_means_work_or_an_rnr_wait() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(1, 3);
    let mut req = rts(&c, &clock, 4);
    assert!(!req.wants_transmit());
    req.accept(wqe(WqeOp::Send, 8), 1024);
    assert!(req.wants_transmit(), "a WQE to send, no RNR wait");
    assert_eq!(send_all(&mut req, &c), [100]);
    assert!(!req.wants_transmit(), "all sent, no RNR wait");
    // An RNR wait with nothing left to send again (it names nPSN).
    assert!(req.rnr_wait(Psn::new(101), Duration::from_millis(1), &c));
    assert!(!req.window().has_work());
    assert!(req.wants_transmit(), "an RNR wait to look at");
    req.start_timers(&mut clock.timers());
    clock.advance_to(req.rnr_timer().at().unwrap());
    assert!(!req.rnr_waiting(&mut clock.timers()));
    assert!(!req.wants_transmit());
}

/// spec/02 "Providing Initial Credits": the credits of an Ack received in RTR are applied
/// on RTS, so the first Sends need not wait.
#[test]
fn credits_announced_in_rtr_apply_at_rts() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = QpConfig {
        remote_credits: true,
        ..cfg(1, 0)
    };
    let mut early = Requester::new(4);
    early.keep_early_credits(CreditCode::encode(2), 0);
    early.start(&c, clock.resolution());
    let mut none = rts(&c, &clock, 4);
    for r in [&mut early, &mut none] {
        r.accept(wqe(WqeOp::Send, 8), 1024);
        r.accept(wqe(WqeOp::Send, 8), 1024);
    }
    assert_eq!(send_all(&mut early, &c), [100, 101]);
    assert_eq!(early.limited(), None);
    assert_eq!(
        send_all(&mut none, &c),
        [100],
        "no credit: the first goes alone"
    );
}

/// spec/04 "Ack Timeout and Missing Packet(s) Retry Counter": a resend after a sequence
/// error spends one retry and sends again from the PSN named; none left, it refuses and
/// changes nothing.
#[test]
fn resend_from_spends_one_retry_and_rewinds() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(2, 0);
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::Send, 8), 1024);
    req.accept(wqe(WqeOp::Send, 8), 1024);
    assert_eq!(send_all(&mut req, &c), [100, 101]);
    assert!(req.resend_from(Psn::new(101)));
    assert_eq!(req.retry_state().1, 1);
    assert_eq!(send_all(&mut req, &c), [101]);
    assert!(req.resend_from(Psn::new(100)));
    assert_eq!(req.retry_state().1, 0);
    assert_eq!(send_all(&mut req, &c), [100, 101]);
    assert!(!req.resend_from(Psn::new(100)), "no retry left");
    assert_eq!(req.retry_state().1, 0);
    assert_eq!(send_all(&mut req, &c), [], "nothing rewound");
}

/// The loss a response shows is resent for once: `already_resending_from` tells the
/// later responses showing the same loss, until progress clears it.
#[test]
fn a_loss_is_resent_for_once_until_progress() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(2, 0);
    let mut req = sent_one(&c, &clock, WqeOp::Send, 3000);
    assert!(!req.already_resending_from(Psn::new(101)));
    req.resending_from(Psn::new(101));
    assert_eq!(req.retry_state().0, Some(Psn::new(101)));
    assert!(req.already_resending_from(Psn::new(101)));
    assert!(!req.already_resending_from(Psn::new(102)));
    assert!(req.acknowledged(Psn::new(101), &c));
    assert_eq!(req.retry_state().0, None);
    assert!(!req.already_resending_from(Psn::new(101)));
}

/// `stop_timers` (the QP went to the Error state) stops the transport timer and the RNR
/// wait: nothing is retried.
#[test]
fn stop_timers_stops_both_timers() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(2, 2);
    let mut req = sent_one(&c, &clock, WqeOp::Send, 8);
    assert!(req.timer().armed());
    req.stop_timers();
    assert!(!req.timer().armed());
    assert!(req.rnr_wait(Psn::new(100), Duration::from_millis(1), &c));
    assert!(req.rnr_timer().armed());
    req.stop_timers();
    assert!(!req.rnr_timer().armed());
    clock.advance(Duration::from_secs(10));
    assert_eq!(
        req.handle_timeout(&mut clock.timers(), false),
        Timeout::Nothing
    );
}

/// `complete` records the completer's verdict on the WQE, which retires with it.
#[test]
fn a_completed_wqe_retires_with_its_status() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let mut req = sent_one(&cfg(1, 0), &clock, WqeOp::Write, 8);
    assert_eq!(req.wqe(0).done, None);
    req.complete(0, WcStatus::RemOpErr);
    assert_eq!(req.wqe(0).done, Some(WcStatus::RemOpErr));
    assert_eq!(req.retire_oldest().done, Some(WcStatus::RemOpErr));
}

/// spec/02 "MSN Indicates Last Message Completed by RQ Logic", "LSN + 1 for Each SQ WQE
/// That Doesn't Need RQ WQE": the MSN of an Ack is the SSN of a message (the first WQE has
/// SSN 1, MSN 0 names none); the credit base is the count of consuming messages up to it.
/// An MSN older than the window remembers is unknown.
#[test]
fn an_msn_maps_to_the_consuming_count_of_its_message() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(1, 0);
    let mut req = rts(&c, &clock, 8);
    assert_eq!(req.consumers_at(0), Some(0), "nothing posted yet");
    // SSN 1 Send (1), 2 Write (1), 3 Send (2), 4 Write with Immediate (3).
    for op in [WqeOp::Send, WqeOp::Write, WqeOp::Send, WqeOp::WriteImm] {
        req.accept(wqe(op, 8), 1024);
    }
    let at: Vec<_> = [4, 3, 2, 1, 0].map(|m| req.consumers_at(m)).into();
    assert_eq!(at, [Some(3), Some(2), Some(1), Some(1), Some(0)]);
    assert_eq!(req.consumers_at(5), None, "not posted yet");
    assert_eq!(req.consumers_at(Psn::MASK), None, "before the first");

    // A window of two forgets the older messages.
    let mut small = rts(&c, &clock, 2);
    for _ in 0..2 {
        small.accept(wqe(WqeOp::Send, 8), 1024);
    }
    send_all(&mut small, &c);
    ack_through(&mut small, 101, &c);
    small.accept(wqe(WqeOp::Send, 8), 1024);
    assert_eq!(small.consumers_at(3), Some(3));
    assert_eq!(small.consumers_at(2), Some(2));
    assert_eq!(small.consumers_at(1), None, "no longer in the window");
    assert_eq!(small.consumers_at(0), Some(0), "MSN 0: before the first");
}

/// spec/02 "SQ Logic's Behavior When No Credits Are Available": a Send without credit
/// sends its first packet, with AckReq, and waits; an Ack whose credit count shows a
/// receive WQE lets the rest of it go.
#[test]
fn credit_from_an_ack_releases_a_limited_send() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = QpConfig {
        remote_credits: true,
        ..cfg(1, 0)
    };
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::Send, 3000), 1024);
    assert_eq!(send_all(&mut req, &c), [100], "only the first packet");
    assert_eq!(req.limited(), Some(0));
    assert_eq!(send_all(&mut req, &c), [], "it waits");
    // An (unsolicited) Ack: MSN 0, one receive WQE posted.
    req.update_credits(CreditCode::encode(1), 0);
    assert_eq!(req.limited(), None);
    assert!(req.credits().allows(1) && !req.credits().allows(2));
    assert_eq!(send_all(&mut req, &c), [101, 102]);
}

/// spec/02: a positive Ack of the first packet of a limited Send means the responder found
/// a receive WQE for it: the rest of the message goes. A Write with Immediate needs its
/// receive WQE at its last packet: what follows it waits for the Ack of that one.
#[test]
fn a_limited_message_goes_on_once_its_receive_wqe_is_found() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = QpConfig {
        remote_credits: true,
        ..cfg(1, 0)
    };
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::Send, 3000), 1024);
    assert_eq!(send_all(&mut req, &c), [100]);
    assert!(req.acknowledged(Psn::new(100), &c));
    assert_eq!(send_all(&mut req, &c), [101, 102]);

    let mut imm = rts(&c, &clock, 4);
    imm.accept(wqe(WqeOp::WriteImm, 3000), 1024);
    imm.accept(wqe(WqeOp::Write, 8), 1024);
    assert_eq!(send_all(&mut imm, &c), [100, 101, 102], "the whole message");
    assert_eq!(imm.limited(), Some(0));
    assert!(imm.acknowledged(Psn::new(100), &c));
    assert_eq!(
        send_all(&mut imm, &c),
        [],
        "its last packet is not acknowledged"
    );
    assert!(imm.acknowledged(Psn::new(102), &c));
    assert_eq!(send_all(&mut imm, &c), [103]);
}

/// spec/02 third bullet: RDMA Writes without Immediate, Reads and Atomics need no receive
/// WQE: they go without regard to credits, and do not hold what follows.
#[test]
fn writes_reads_and_atomics_go_without_credit() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = QpConfig {
        remote_credits: true,
        max_rd_atomic: 4,
        ..cfg(1, 0)
    };
    let mut req = rts(&c, &clock, 8);
    for op in [WqeOp::Write, WqeOp::Read, WqeOp::FetchAdd, WqeOp::Write] {
        req.accept(wqe(op, 8), 1024);
    }
    assert_eq!(send_all(&mut req, &c), [100, 101, 102, 103]);
    assert_eq!(req.limited(), None);
}

/// spec/02 "Obey the Ordering Rules": a Send whose credit count allows it is not limited
/// (`begin_wqe` limits only a consuming WQE without credit).
#[test]
fn a_send_with_credit_is_not_limited() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = QpConfig {
        remote_credits: true,
        ..cfg(1, 0)
    };
    let mut req = rts(&c, &clock, 4);
    req.update_credits(CreditCode::encode(1), 0);
    req.accept(wqe(WqeOp::Send, 3000), 1024);
    req.accept(wqe(WqeOp::Send, 8), 1024);
    assert_eq!(send_all(&mut req, &c), [100, 101, 102, 103]);
    assert_eq!(req.limited(), Some(1), "the second Send has no credit");
}

/// `retire_oldest`: a Read or Atomic that was started frees its place in the initiator
/// depth when it retires; one flushed before it started, or a Send, changes nothing.
#[test]
fn retiring_a_started_read_frees_its_initiator_slot() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(1, 0); // initiator depth 1
    let mut req = rts(&c, &clock, 4);
    for op in [WqeOp::Send, WqeOp::Read, WqeOp::CompareSwap] {
        req.accept(wqe(op, 8), 1024);
    }
    assert_eq!(send_all(&mut req, &c), [100, 101], "the Atomic waits");
    assert_eq!(req.rd_atomic(), 1);
    req.complete(0, WcStatus::Success);
    req.retire_oldest();
    assert_eq!(req.rd_atomic(), 1, "a Send is not a Read");
    req.complete(1, WcStatus::Success);
    req.retire_oldest();
    assert_eq!(req.rd_atomic(), 0);
    // The Atomic never started (flushed).
    req.complete(2, WcStatus::WrFlushErr);
    assert_eq!(req.retire_oldest().done, Some(WcStatus::WrFlushErr));
    assert_eq!(req.rd_atomic(), 0);
}

/// `retire_oldest` of the limited WQE lifts the hold it had on the WQEs behind it.
#[test]
fn retiring_the_limited_wqe_lifts_its_hold() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = QpConfig {
        remote_credits: true,
        ..cfg(1, 0)
    };
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::Send, 8), 1024);
    req.accept(wqe(WqeOp::Write, 8), 1024);
    assert_eq!(send_all(&mut req, &c), [100]);
    assert_eq!(req.limited(), Some(0));
    assert!(req.acknowledged(Psn::new(100), &c));
    req.complete(0, WcStatus::Success);
    req.retire_oldest();
    assert_eq!(req.limited(), None);
    assert_eq!(send_all(&mut req, &c), [101]);
}

/// The window takes WQEs up to its depth, and room comes back as they retire.
#[test]
fn the_window_has_room_up_to_its_depth() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(1, 0);
    let mut req = rts(&c, &clock, 2);
    assert!(req.has_room());
    req.accept(wqe(WqeOp::Send, 8), 1024);
    assert!(req.has_room());
    req.accept(wqe(WqeOp::Send, 8), 1024);
    assert!(!req.has_room());
    send_all(&mut req, &c);
    ack_through(&mut req, 100, &c);
    assert!(req.has_room());
}

/// spec/01 "nPSN Update": each WQE takes as many PSNs as its request packets (a Send or
/// Write of 3000 bytes at PMTU 1024: 3), a Read as many as its responses (6 KiB: 6), an
/// Atomic one (its length field is not a payload), and a memory window operation none.
#[test]
fn each_operation_takes_its_psns() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = QpConfig {
        max_rd_atomic: 4,
        ..cfg(1, 0)
    };
    let mut req = rts(&c, &clock, 8);
    let ops = [
        (WqeOp::BindMw, 0),
        (WqeOp::Send, 3000),
        (WqeOp::LocalInv, 0),
        (WqeOp::Read, 6 * 1024),
        (WqeOp::CompareSwap, 4096),
        (WqeOp::Write, 3000),
    ];
    for (i, (op, len)) in ops.into_iter().enumerate() {
        req.accept(
            SqWqe {
                wr_id: i as u64,
                ..wqe(op, len)
            },
            1024,
        );
    }
    let (psns, locals) = drive(&mut req, &c);
    assert_eq!(locals, [0, 2], "the local operations run once each");
    assert_eq!(psns, [100, 101, 102, 103, 109, 110, 111, 112]);
    let first: Vec<_> = (0..6).map(|s| req.wqe(s).first_psn.get()).collect();
    assert_eq!(first[1..], [100, 103, 103, 109, 110]);
    let spans: Vec<_> = (0..6).map(|s| req.wqe(s).span).collect();
    assert_eq!(spans, [0, 3, 0, 6, 1, 3]);
    assert_eq!(req.window().npsn(), Psn::new(113));
}

/// `run_local`: a new memory window operation is handed to the driver to execute; one a
/// go-back-N rewind comes back to is passed over, not executed twice.
#[test]
fn a_local_operation_runs_once_even_after_a_rewind() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(3, 0);
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::Send, 8), 1024);
    req.accept(
        SqWqe {
            wr_id: 99,
            ..wqe(WqeOp::BindMw, 0)
        },
        1024,
    );
    req.accept(wqe(WqeOp::Send, 8), 1024);
    assert_eq!(send_all(&mut req, &c), [100]);
    assert_eq!(
        req.next_step(QpState::Rts, 1),
        Step::Local {
            seq: 1,
            new_wqe: true
        }
    );
    assert_eq!(req.run_local(true).map(|w| w.wr_id), Some(99));
    req.complete(1, WcStatus::Success);
    assert_eq!(send_all(&mut req, &c), [101]);
    // A sequence error from PSN 100: the Send, the bind (passed over) and the Send again.
    assert!(req.resend_from(Psn::new(100)));
    assert_eq!(send_all(&mut req, &c), [100]);
    assert_eq!(
        req.next_step(QpState::Rts, 1),
        Step::Local {
            seq: 1,
            new_wqe: false
        }
    );
    assert_eq!(req.run_local(false).map(|w| w.wr_id), None);
    assert_eq!(send_all(&mut req, &c), [101]);
}

/// spec/02 "SQ Logic's Behavior When No Credits Are Available", spec/01: AckReq goes on
/// the last packet of each message, on every Read or Atomic request, and on the first
/// packet of a limited Send (it waits for that packet's Ack) — not on the others.
#[test]
fn ack_req_on_last_packets_reads_atomics_and_a_limited_first() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    // (op, whether limited by credits) -> AckReq of packets 0, 1, 2
    let cases = [
        (WqeOp::Send, false, [false, false, true]),
        (WqeOp::Write, false, [false, false, true]),
        (WqeOp::Send, true, [true, false, true]),
        (WqeOp::SendImm, true, [true, false, true]),
        (WqeOp::WriteImm, true, [false, false, true]),
        (WqeOp::Read, false, [true, true, true]),
    ];
    for (op, limited, want) in cases {
        let c = QpConfig {
            remote_credits: limited,
            ..cfg(1, 0)
        };
        let mut req = rts(&c, &clock, 4);
        req.accept(wqe(op, 3000), 1024);
        let Step::Packet { seq, .. } = req.next_step(QpState::Rts, 1) else {
            panic!("{op:?} goes")
        };
        req.begin_wqe();
        assert_eq!(req.limited().is_some(), limited, "{op:?}");
        let w = *req.wqe(seq);
        let got = [0, 1, 2].map(|k| req.ack_req(seq, &w, k));
        assert_eq!(got, want, "{op:?}, limited {limited}");
    }
    let mut req = rts(&cfg(1, 0), &clock, 4);
    req.accept(wqe(WqeOp::FetchAdd, 8), 1024);
    req.next_step(QpState::Rts, 1);
    req.begin_wqe();
    assert!(req.ack_req(0, &req.wqe(0).clone(), 0));
}

/// A fenced WQE waits only for Reads and Atomics in flight (spec/02 "Obey the Ordering
/// Rules"): with none, it goes at once.
#[test]
fn a_fence_with_nothing_to_wait_for_does_not_hold() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(1, 0);
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::Write, 8), 1024);
    req.accept(fenced(WqeOp::Send), 1024);
    assert_eq!(send_all(&mut req, &c), [100, 101]);
}

/// A transmission that finds room ends the wait for the link (`after_transmit` with no
/// full mark).
#[test]
fn a_transmission_that_finds_room_ends_the_link_wait() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(1, 0);
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::Send, 8), 1024);
    req.after_transmit(false, Some(3));
    assert_eq!(req.link_wait(), LinkWait::Waiting);
    assert_eq!(send_all(&mut req, &c), [100]); // ends with after_transmit(true, None)
    assert_eq!(req.link_wait(), LinkWait::No);
}

/// `handle_timeout`: an expiry with nothing unacknowledged and no request waiting for room
/// is no timeout (here the request that waited for room was held back by SQD instead).
#[test]
fn an_expiry_with_nothing_waiting_is_no_timeout() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(2, 0);
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::Send, 8), 1024);
    req.after_transmit(false, Some(3));
    assert!(req.timer().armed(), "the wait for room is timed");
    assert_eq!(req.next_step(QpState::Sqd, 1), Step::Stop);
    req.after_transmit(false, None);
    assert_eq!(expiries(&mut req, &clock, 3), [Timeout::Nothing]);
    assert_eq!(req.retry_state().1, 2, "no retry spent");
}

/// spec/01 RNR: the transport timer does not run during an RNR wait; an expiry then
/// (after a response re-armed it) spends no retry and resends nothing.
#[test]
fn no_timeout_during_an_rnr_wait() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(2, 3);
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::Send, 8), 1024);
    req.accept(wqe(WqeOp::Send, 8), 1024);
    assert_eq!(send_all(&mut req, &c), [100, 101]);
    let wait = RnrTimer::new(0).duration(); // 655 ms, longer than Ttr (67 ms)
    assert!(req.rnr_wait(Psn::new(101), wait, &c));
    assert!(req.acknowledged(Psn::new(100), &c));
    assert!(req.timer().armed());
    assert_eq!(expiries(&mut req, &clock, 1), [Timeout::Nothing]);
    assert_eq!(req.retry_state().1, 2);
    assert!(req.rnr_waiting(&mut clock.timers()), "still waiting");
}

/// spec/01 RNR Retry Count 7 means retry forever: an RNR Nak never spends it.
#[test]
fn rnr_retry_seven_never_runs_out() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = cfg(1, RNR_RETRY_FOREVER);
    let mut req = sent_one(&c, &clock, WqeOp::Send, 8);
    for _ in 0..10 {
        assert!(req.rnr_wait(Psn::new(100), Duration::from_micros(10), &c));
        assert_eq!(req.retry_state().2, RNR_RETRY_FOREVER);
    }
}

/// `oldest_unfinished`: the oldest unacknowledged request's WQE, or with none the oldest
/// waiting to be sent, or none at all.
#[test]
fn the_oldest_unfinished_wqe() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = QpConfig {
        remote_credits: true,
        ..cfg(1, 0)
    };
    let mut req = rts(&c, &clock, 4);
    assert_eq!(req.oldest_unfinished(), None);
    req.update_credits(CreditCode::encode(2), 0);
    for _ in 0..3 {
        req.accept(wqe(WqeOp::Send, 8), 1024);
    }
    assert_eq!(req.oldest_unfinished(), Some(0), "waiting to be sent");
    assert_eq!(send_all(&mut req, &c), [100, 101, 102]);
    assert_eq!(req.oldest_unfinished(), Some(0));
    ack_through(&mut req, 100, &c);
    assert_eq!(req.oldest_unfinished(), Some(1));
    ack_through(&mut req, 102, &c);
    assert_eq!(req.oldest_unfinished(), None);
}

// ---------------------------------------------------------------------------------------
// The template path.

/// The template is made on RTS from the destination: none before, none without one.
#[test]
fn the_template_comes_with_rts_and_a_destination() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    assert!(Requester::new(4).template().is_none());
    assert!(rts(&cfg(1, 0), &clock, 4).template().is_none());
    let t = rts(&dest_cfg(false), &clock, 4)
        .template()
        .expect("a template");
    let want = BthTemplate::new(Qpn::new(0x12_3456));
    let args = (Opcode::SendOnly, false, 0, Psn::new(5));
    assert_eq!(
        bth_of(&t, args.0, args.1, args.2, args.3),
        bth_of(&want, args.0, args.1, args.2, args.3)
    );
}

/// `BthTemplate::write` writes the BTH `BthRepr::emit` makes for the request: the opcode,
/// SE, PadCnt and PSN given, AckReq set, the default P_Key and the destination QP; and
/// nothing past the header.
#[test]
fn a_template_writes_the_bth_of_its_request() {
    let t = BthTemplate::new(Qpn::new(0xAB_CDEF));
    for (opcode, se, pad, psn) in [
        (Opcode::SendOnly, false, 0, 0),
        (Opcode::SendOnlyWithImmediate, true, 3, 0xFF_FFFF),
        (Opcode::RdmaWriteOnly, false, 1, 77),
        (Opcode::RdmaReadRequest, false, 0, 12_345),
        (Opcode::FetchAdd, true, 2, 1),
    ] {
        let mut out = [0xA5u8; 16];
        t.write(&mut out, opcode, se, pad, Psn::new(psn));
        let mut want = [0u8; 12];
        BthRepr {
            solicited: se,
            pad_count: pad,
            ack_req: true,
            ..BthRepr::new(opcode, Qpn::new(0xAB_CDEF), Psn::new(psn))
        }
        .emit(&mut bth::Packet::new_unchecked(&mut want[..]));
        assert_eq!(out[..12], want, "{opcode:?}");
        assert_eq!(out[12..], [0xA5; 4], "past the header");
    }
}

/// `fast_gate` on an idle QP in RTS lets a single-packet post through with the template
/// and the consuming count it will have (a Send consumes a receive WQE, a Write not).
#[test]
fn an_idle_qp_takes_the_template_path() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let req = rts(&dest_cfg(false), &clock, 4);
    let t = req.template().unwrap();
    let (gt, n) = req
        .fast_gate(QpState::Rts, &wqe(WqeOp::Send, 8), 1)
        .unwrap();
    let args = (Opcode::SendOnly, true, 1, Psn::new(100));
    assert_eq!(
        bth_of(&gt, args.0, args.1, args.2, args.3),
        bth_of(&t, args.0, args.1, args.2, args.3)
    );
    assert_eq!(n, 1);
    let (_, n) = req
        .fast_gate(QpState::Rts, &wqe(WqeOp::Write, 8), 1)
        .unwrap();
    assert_eq!(n, 0);
    let (_, n) = req
        .fast_gate(QpState::Rts, &wqe(WqeOp::Read, 8), 1)
        .unwrap();
    assert_eq!(n, 0);
    let (_, n) = req
        .fast_gate(QpState::Rts, &fenced(WqeOp::Send), 1)
        .unwrap();
    assert_eq!(n, 1, "a fence with no Read in flight does not hold");
}

/// `fast_gate`: only RTS takes the template path.
#[test]
fn the_template_path_is_for_rts_only() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let req = rts(&dest_cfg(false), &clock, 4);
    let send = wqe(WqeOp::Send, 8);
    for state in [QpState::Sqd, QpState::Rtr, QpState::Error, QpState::Sqe] {
        assert!(req.fast_gate(state, &send, 1).is_none(), "{state:?}");
    }
    assert!(req.fast_gate(QpState::Rts, &send, 1).is_some());
}

/// `fast_gate`: queued work goes first (posted order, spec/02 "Obey the Ordering Rules").
#[test]
fn the_template_path_does_not_pass_queued_work() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = dest_cfg(false);
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::Write, 8), 1024);
    assert!(
        req.fast_gate(QpState::Rts, &wqe(WqeOp::Write, 8), 1)
            .is_none()
    );
    send_all(&mut req, &c);
    assert!(
        req.fast_gate(QpState::Rts, &wqe(WqeOp::Write, 8), 1)
            .is_some()
    );
}

/// `fast_gate`: a WQE waiting for credit holds everything behind it, even a Write that
/// needs none (spec/02 "Obey the Ordering Rules").
#[test]
fn the_template_path_does_not_pass_a_limited_wqe() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = dest_cfg(true);
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::Send, 8), 1024);
    assert_eq!(send_all(&mut req, &c), [100]);
    assert_eq!(req.limited(), Some(0));
    assert!(!req.window().has_work());
    assert!(
        req.fast_gate(QpState::Rts, &wqe(WqeOp::Write, 8), 1)
            .is_none()
    );
}

/// `fast_gate`: nothing new goes during an RNR wait, even with nothing to resend.
#[test]
fn the_template_path_waits_out_an_rnr_wait() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = QpConfig {
        rnr_retry: 3,
        ..dest_cfg(false)
    };
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::Send, 8), 1024);
    send_all(&mut req, &c);
    ack_through(&mut req, 100, &c);
    assert!(req.rnr_wait(Psn::new(101), Duration::from_millis(1), &c));
    assert!(!req.window().has_work());
    let send = wqe(WqeOp::Send, 8);
    assert!(req.fast_gate(QpState::Rts, &send, 1).is_none());
    req.start_timers(&mut clock.timers());
    clock.advance_to(req.rnr_timer().at().unwrap());
    assert!(!req.rnr_waiting(&mut clock.timers()));
    assert!(req.fast_gate(QpState::Rts, &send, 1).is_some());
}

/// `fast_gate`: a fenced post waits for the Read in flight; one without the fence does
/// not (spec/02 "Obey the Ordering Rules").
#[test]
fn the_template_path_obeys_the_fence() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = QpConfig {
        max_rd_atomic: 4,
        ..dest_cfg(false)
    };
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::Read, 8), 1024);
    send_all(&mut req, &c);
    assert_eq!(req.rd_atomic(), 1);
    assert!(
        req.fast_gate(QpState::Rts, &fenced(WqeOp::Send), 4)
            .is_none()
    );
    assert!(
        req.fast_gate(QpState::Rts, &wqe(WqeOp::Send, 8), 4)
            .is_some()
    );
}

/// `fast_gate`: a Read or Atomic goes while the initiator depth has room.
#[test]
fn the_template_path_obeys_the_initiator_depth() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = dest_cfg(false);
    let mut req = rts(&c, &clock, 4);
    let read = wqe(WqeOp::Read, 8);
    let (_, n) = req.fast_gate(QpState::Rts, &read, 1).unwrap();
    req.fast_posted(&read, n);
    assert_eq!(req.rd_atomic(), 1);
    let fadd = wqe(WqeOp::FetchAdd, 8);
    assert!(req.fast_gate(QpState::Rts, &fadd, 1).is_none());
    assert!(req.fast_gate(QpState::Rts, &fadd, 2).is_some());
    assert!(req.fast_gate(QpState::Rts, &fadd, 0).is_none());
}

/// `fast_gate`: a Send goes the template way only with credit for it (spec/02); a Write
/// needs none.
#[test]
fn the_template_path_needs_credit_for_a_send() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = dest_cfg(true);
    let mut req = rts(&c, &clock, 4);
    let send = wqe(WqeOp::Send, 8);
    assert!(req.fast_gate(QpState::Rts, &send, 1).is_none(), "no credit");
    assert!(
        req.fast_gate(QpState::Rts, &wqe(WqeOp::Write, 8), 1)
            .is_some()
    );
    req.update_credits(CreditCode::encode(1), 0);
    let (_, n) = req.fast_gate(QpState::Rts, &send, 1).expect("one credit");
    assert_eq!(n, 1);
    req.fast_posted(&send, n);
    assert!(req.fast_gate(QpState::Rts, &send, 1).is_none(), "used");
    let (_, n) = req
        .fast_gate(QpState::Rts, &wqe(WqeOp::Write, 8), 1)
        .unwrap();
    assert_eq!(n, 1);
}

/// `fast_posted` records the post as the long path would: its SSN (an Ack's MSN names
/// it), its consuming count, its PSN in the window, the Read in flight, and the transport
/// timer runs.
#[test]
fn a_template_post_is_recorded_like_a_normal_one() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = QpConfig {
        max_rd_atomic: 4,
        ..dest_cfg(false)
    };
    let mut req = rts(&c, &clock, 4);
    let send = wqe(WqeOp::Send, 8);
    let (_, n) = req.fast_gate(QpState::Rts, &send, 4).unwrap();
    req.fast_posted(&send, n);
    assert_eq!(req.consumers_at(1), Some(1), "MSN 1 names it");
    assert_eq!(req.consumers_at(0), Some(0));
    assert_eq!(req.window().npsn(), Psn::new(101));
    assert_eq!(req.wqe(0).first_psn, Psn::new(100));
    assert!(req.window().outstanding() && !req.wants_transmit());
    req.start_timers(&mut clock.timers());
    assert!(req.timer().at().is_some(), "the transport timer runs");
    let (_, n) = req.fast_gate(QpState::Rts, &send, 4).unwrap();
    assert_eq!(n, 2);
    let read = wqe(WqeOp::Read, 8);
    let (_, n) = req.fast_gate(QpState::Rts, &read, 4).unwrap();
    assert_eq!(n, 1);
    req.fast_posted(&read, n);
    assert_eq!(req.rd_atomic(), 1);
    assert_eq!(req.consumers_at(2), Some(1));
    assert_eq!(req.consumers_at(1), Some(1));
    // Lost: a timeout resends both from the first PSN.
    assert_eq!(
        expiries(&mut req, &clock, 1),
        [Timeout::Resend(Psn::new(100))]
    );
    assert_eq!(send_all(&mut req, &c), [100, 101]);
}

/// spec/02 "SQ Logic's Behavior When No Credits Are Available": a Send with Invalidate is
/// a Send: without credit it sends its first packet, which must carry AckReq ("to ensure
/// that the responder generates a response"), and waits for that Ack.
#[test]
fn a_limited_send_with_invalidate_asks_for_the_ack_it_waits_for() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = QpConfig {
        remote_credits: true,
        ..cfg(1, 0)
    };
    let mut req = rts(&c, &clock, 4);
    req.accept(wqe(WqeOp::SendInv, 3000), 1024);
    let Step::Packet { seq, .. } = req.next_step(QpState::Rts, 1) else {
        panic!("the first packet goes")
    };
    req.begin_wqe();
    assert_eq!(req.limited(), Some(seq));
    let w = *req.wqe(seq);
    assert!(req.ack_req(seq, &w, 0), "the packet it waits an Ack for");
    assert_eq!(send_all(&mut req, &c), [100], "then it waits");
    assert!(req.acknowledged(Psn::new(100), &c));
    assert_eq!(send_all(&mut req, &c), [101, 102]);
}

/// `update_credits_of` (a Read's response or an Atomic's Acknowledge, the consuming count
/// of the WQE it acknowledged at hand) leaves the credits and the limited WQE exactly as
/// `update_credits` (`consumers_at`'s search) does — for every MSN, whether it names that
/// WQE, an older or a newer one, with consuming messages and local operations around it,
/// and for a window too small to remember the oldest.
#[test]
fn update_credits_of_agrees_with_update_credits() {
    let clock = ManualClock::new(Timestamp::from_nanos(0));
    let c = QpConfig {
        remote_credits: true,
        max_rd_atomic: 8,
        ..cfg(1, 0)
    };
    let ops = [
        WqeOp::Send,
        WqeOp::Read,
        WqeOp::BindMw,
        WqeOp::FetchAdd,
        WqeOp::Send,
        WqeOp::Read,
        WqeOp::LocalInv,
        WqeOp::Read,
        WqeOp::WriteImm,
        WqeOp::CompareSwap,
    ];
    let build = |depth: u32, n: usize| {
        let mut req = rts(&c, &clock, depth);
        for (i, &op) in ops[..n].iter().enumerate() {
            let len = if op.is_rd_atomic() { 8 } else { 0 };
            req.accept(
                SqWqe {
                    wr_id: i as u64,
                    ..wqe(op, len)
                },
                1024,
            );
        }
        drive(&mut req, &c);
        req
    };
    let mut compared = 0;
    for depth in [4, 16] {
        for n in 1..=ops.len().min(depth as usize) {
            for seq in (0..n).filter(|&s| ops[s].is_rd_atomic()) {
                for msn in 0..=n as u32 + 1 {
                    for code in [0, 3, 31] {
                        let (mut a, mut b) = (build(depth, n), build(depth, n));
                        a.update_credits_of(CreditCode::new(code), msn, seq as u64);
                        b.update_credits(CreditCode::new(code), msn);
                        let at =
                            format!("depth {depth}, {n} WQEs, WQE {seq}, MSN {msn}, code {code}");
                        assert_eq!(
                            format!("{:?}", a.credits()),
                            format!("{:?}", b.credits()),
                            "{at}"
                        );
                        assert_eq!(a.limited(), b.limited(), "{at}");
                        compared += 1;
                    }
                }
            }
        }
    }
    assert!(compared > 200, "{compared} cases");
}
