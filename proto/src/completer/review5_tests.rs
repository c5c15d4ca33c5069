//! Review 5 (branch `ack-retire`): the rewritten Ack fast path ([`Requester::ack_fast`]:
//! one pass marking WQEs done and unmarking them on a refusal, the acknowledged PSN moved
//! without a second check, the credits from the last WQE's consuming count when the MSN
//! names it) against the completer's checks and actions for the same positive Ack, on
//! random windows: Sends and Writes of one or several packets, Reads, Atomics, memory
//! window operations (no PSN), signaled or not, partly sent, partly acknowledged, the
//! window wrapped, PSNs near the 24-bit wrap, credits on or off, the transport timer on or
//! off. The whole requester (its `Debug`: window slots, PSNs, credits, limited WQE, retry
//! counts, timers) must be what the slow path leaves when the fast path takes the Ack, and
//! untouched when it refuses it.

use super::*;
use crate::requester::{AckFast, Step};
use crate::wire::Msn;
use crate::wqe::{Cursor, DataLoc, SqWqe, WqeFlags};
use alloc::format;
use core::time::Duration;

#[derive(Default)]
struct Sink {
    room: usize,
}

impl SendCompletions for Sink {
    fn has_room(&mut self) -> bool {
        self.room > 0
    }
    fn release(&mut self, _: &DataLoc) {}
    fn publish(&mut self, _: u64) {}
    fn push(&mut self, _: crate::completion::WorkCompletion) {
        self.room -= 1;
    }
    fn fetch(&mut self, _: &mut Requester) {}
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn sq_wqe(rng: &mut Rng, id: u64) -> SqWqe {
    let op = match rng.below(12) {
        0..=3 => WqeOp::Send,
        4 => WqeOp::SendImm,
        5..=6 => WqeOp::Write,
        7 => WqeOp::WriteImm,
        8 => WqeOp::Read,
        9 => WqeOp::FetchAdd,
        10 => WqeOp::BindMw,
        _ => WqeOp::CompareSwap,
    };
    let len = match op {
        WqeOp::FetchAdd | WqeOp::CompareSwap => 8,
        WqeOp::BindMw => 0,
        _ => [0, 8, 1024, 1025, 3000][rng.below(5) as usize],
    };
    SqWqe {
        wr_id: id,
        op,
        flags: WqeFlags(if rng.below(3) == 0 {
            0
        } else {
            WqeFlags::SIGNALED
        }),
        imm: 0,
        len,
        remote_addr: 0,
        rkey: 0,
        compare_add: 0,
        swap: 0,
        data: DataLoc::Empty,
    }
}

/// Sends up to `budget` packets (runs memory window operations on the way).
fn transmit(req: &mut Requester, budget: u64) {
    for _ in 0..budget {
        match req.next_step(QpState::Rts, 4) {
            Step::Stop => return,
            Step::Local { new_wqe, .. } => {
                let seq = req.window().started();
                if req.run_local(new_wqe).is_some() {
                    req.complete(seq, WcStatus::Success);
                }
            }
            Step::Packet {
                seq,
                new_wqe,
                point,
            } => {
                if new_wqe {
                    req.begin_wqe();
                }
                let w = *req.wqe(seq);
                let psn = w.first_psn.add(point.pkt);
                req.note_sent(&w, psn);
                let last = Requester::ends_wqe(&w, point.pkt);
                req.packet_sent((!last).then(Cursor::default));
            }
        }
    }
}

/// A positive Ack through the completer's checks and actions, as the engine's slow path
/// does (without the retire).
fn slow(req: &mut Requester, cfg: &QpConfig, psn: Psn, code: CreditCode, msn: u32) -> Outcome {
    let r = Response {
        class: OpClass::Acknowledge,
        position: Position::Only,
        psn,
        aeth: Some(AethRepr {
            syndrome: Syndrome::Ack { credits: code },
            msn: Msn::new(msn),
        }),
        atomic_orig: None,
        payload_len: 0,
        has_payload: false,
    };
    let outcome = check_response(QpState::Rts, req, cfg, &r);
    match outcome {
        Outcome::Credits(c, m) => req.update_credits(c, m),
        Outcome::Ack {
            seq,
            psn,
            credits,
            msn,
        } => {
            if psn == req.wqe(seq).last_psn() {
                req.complete(seq, WcStatus::Success);
            }
            req.acknowledged(psn, cfg);
            req.update_credits(credits, msn);
        }
        _ => {}
    }
    outcome
}

/// A random requester, the same for the same seed; returns it, its configuration and the
/// Ack to try (PSN, credit code, MSN).
fn build(seed: u64) -> (Requester, QpConfig, (Psn, CreditCode, u32)) {
    let mut rng = Rng(seed | 1);
    let sq_psn = match rng.below(3) {
        0 => 0,
        1 => 0xFF_FFFF - rng.below(12) as u32,
        _ => rng.below(1 << 24) as u32,
    };
    let cfg = QpConfig {
        remote_credits: rng.below(2) == 0,
        retry_cnt: 7,
        rnr_retry: 7,
        timeout: if rng.below(2) == 0 { 0 } else { 14 },
        max_rd_atomic: 4,
        sq_psn: Psn::new(sq_psn),
        ..QpConfig::default()
    };
    let mut req = Requester::new(8);
    req.start(&cfg, Duration::from_nanos(1));
    req.update_credits(CreditCode::new(rng.below(32) as u8), 0);
    let mut id = 0;
    let mut sink = Sink::default();
    for _ in 0..rng.below(6) + 1 {
        while req.has_room() && rng.below(3) != 0 {
            req.accept(sq_wqe(&mut rng, id), 1024);
            id += 1;
        }
        transmit(&mut req, rng.below(12));
        // Some Acks, the slow way, then retire.
        for _ in 0..rng.below(3) {
            let (psn, code, msn) = ack(&mut rng, &req);
            slow(&mut req, &cfg, psn, code, msn);
            // Reads and Atomics answered now and then: their WQEs done, acknowledged.
            let oldest = req.window().retired();
            if oldest < req.window().started() && rng.below(2) == 0 {
                let w = *req.wqe(oldest);
                if w.wqe.op.is_rd_atomic()
                    && w.done.is_none()
                    && w.last_psn().before(req.window().sent_to())
                {
                    req.complete(oldest, WcStatus::Success);
                    req.acknowledged(w.last_psn(), &cfg);
                }
            }
            sink.room = rng.below(4) as usize;
            retire(&mut req, QpState::Rts, crate::wire::Qpn::new(1), &mut sink);
        }
    }
    let a = ack(&mut rng, &req);
    (req, cfg, a)
}

/// A hostile positive Ack: a PSN at the end of one of the oldest WQEs, around the
/// acknowledged PSN, or anywhere; any credit code; an MSN around the SSN of the last WQE
/// fetched, or anything.
fn ack(rng: &mut Rng, req: &Requester) -> (Psn, CreditCode, u32) {
    let win = req.window();
    let psn = match rng.below(4) {
        0 | 1 => {
            let seq = win.retired() + rng.below(4);
            if seq < win.started() {
                win.wqe(seq).last_psn().add(rng.below(3) as u32).sub(1)
            } else {
                win.acked().add(1)
            }
        }
        2 => win.acked().add(rng.below(8) as u32).sub(2),
        _ => Psn::new(rng.below(1 << 24) as u32),
    };
    let fetched = win.fetched() as u32;
    let msn = match rng.below(4) {
        0 => rng.below(1 << 24) as u32,
        _ => fetched.wrapping_sub(rng.below(6) as u32).wrapping_add(1) & 0xFF_FFFF,
    };
    (psn, CreditCode::new(rng.below(32) as u8), msn)
}

#[test]
fn review5_ack_fast_does_what_the_checks_and_actions_do() {
    let (mut acked, mut credits, mut refused) = (0, 0, 0);
    // REVIEW5_SEED=k runs seeds from k * 60,000 (a longer search, outside CI).
    let base: u64 = std::env::var("REVIEW5_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    for seed in base * 60_000..(base + 1) * 60_000 {
        let (mut fast, cfg, (psn, code, msn)) = build(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let (mut slow_req, _, _) = build(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let before = format!("{fast:?}");
        assert_eq!(
            before,
            format!("{slow_req:?}"),
            "seed {seed}: deterministic"
        );
        let got = fast.ack_fast(psn, code, msn, &cfg);
        let outcome = slow(&mut slow_req, &cfg, psn, code, msn);
        match got {
            None => {
                refused += 1;
                assert_eq!(
                    format!("{fast:?}"),
                    before,
                    "seed {seed}: a refusal changes nothing ({outcome:?})"
                );
            }
            Some(AckFast::Credits) => {
                credits += 1;
                assert!(
                    matches!(outcome, Outcome::Credits(..)),
                    "seed {seed}: {outcome:?}"
                );
                assert_eq!(format!("{fast:?}"), format!("{slow_req:?}"), "seed {seed}");
            }
            Some(AckFast::Acked { .. }) => {
                acked += 1;
                assert!(
                    matches!(outcome, Outcome::Ack { .. }),
                    "seed {seed}: {outcome:?}"
                );
                assert_eq!(
                    format!("{fast:?}"),
                    format!("{slow_req:?}"),
                    "seed {seed}: {psn:?} {code:?} {msn}"
                );
            }
        }
    }
    std::eprintln!("review5: acked {acked} credits {credits} refused {refused}");
    assert!(
        acked > 1000 && credits > 1000 && refused > 1000,
        "{acked} {credits} {refused}"
    );
}

/// The MSN of an Ack is the SSN of the last message the responder completed (spec/02),
/// and the responder counts messages: a memory window operation posted before a Send is
/// no message (it has no PSN and never reaches the responder). The requester numbers it
/// all the same (`accept` counts every WQE in its SSN), so an MSN names the WQE one
/// earlier per local operation after it, and the credits count from that WQE's consuming
/// count: fewer than the responder granted. Here a Bind, then two Sends; the responder
/// completed the first Send (its MSN 1) and grants one more receive: the second Send may
/// go. (Pre-existing: not from `ack-retire`; both paths share `consumers_at`.)
#[test]
fn review5_an_msn_counts_messages_not_memory_window_operations() {
    let cfg = QpConfig {
        remote_credits: true,
        retry_cnt: 7,
        ..QpConfig::default()
    };
    let mut req = Requester::new(8);
    req.start(&cfg, Duration::from_nanos(1));
    req.update_credits(CreditCode::encode(1), 0);
    let mut rng = Rng(1);
    let mut bind = sq_wqe(&mut rng, 0);
    bind.op = WqeOp::BindMw;
    bind.len = 0;
    req.accept(bind, 1024);
    for id in [1, 2] {
        let mut send = sq_wqe(&mut rng, id);
        send.op = WqeOp::Send;
        send.len = 8;
        req.accept(send, 1024);
    }
    transmit(&mut req, 1); // the Bind
    let mut sink = Sink { room: 8 };
    retire(&mut req, QpState::Rts, crate::wire::Qpn::new(1), &mut sink);
    transmit(&mut req, 1); // the first Send (one credit)
    let first = *req.wqe(1);
    assert_eq!(first.consumers, 1);
    // The responder completed message 1 (the first Send) and has one receive left.
    assert_eq!(
        req.ack_fast(first.first_psn, CreditCode::encode(1), 1, &cfg),
        Some(AckFast::Acked { end: 2 })
    );
    assert!(
        req.credits().allows(2),
        "one credit after the first Send: the second Send (consuming count 2) may go"
    );
}
