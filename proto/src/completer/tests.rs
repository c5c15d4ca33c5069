use super::*;
use crate::qp::Mtu;
use crate::requester::Step;
use crate::wire::Msn;
use crate::wqe::{Cursor, DataLoc, SqWqe, WqeFlags};
use core::time::Duration;

fn cfg() -> QpConfig {
    QpConfig {
        sq_psn: Psn::new(10),
        path_mtu: Mtu::Mtu256,
        max_rd_atomic: 4,
        remote_credits: false,
        retry_cnt: 3,
        ..QpConfig::default()
    }
}

/// A requester that sent `ops` (op, length), each whole; PSNs from 10.
fn sent(ops: &[(WqeOp, u32)]) -> Requester {
    let c = cfg();
    let mut req = Requester::new(8);
    req.start(&c, Duration::from_nanos(1));
    for &(op, len) in ops {
        req.accept(
            SqWqe {
                wr_id: 1,
                op,
                flags: WqeFlags(WqeFlags::SIGNALED),
                imm: 0,
                len,
                remote_addr: 0,
                rkey: 1,
                compare_add: 0,
                swap: 0,
                data: DataLoc::Empty,
            },
            256,
        );
    }
    // Bounded: a transmit point that does not move fails the test instead of hanging it.
    for _ in 0..64 {
        let Step::Packet {
            seq,
            new_wqe,
            point,
        } = req.next_step(QpState::Rts, 4)
        else {
            return req;
        };
        if new_wqe {
            req.begin_wqe();
        }
        let w = *req.wqe(seq);
        req.note_sent(&w, w.first_psn.add(point.pkt));
        req.packet_sent((!Requester::ends_wqe(&w, point.pkt)).then(Cursor::default));
    }
    panic!("the transmit point does not reach the end of {ops:?}")
}

fn resp(class: OpClass, position: Position, psn: u32, syndrome: Option<Syndrome>) -> Response {
    Response {
        class,
        position,
        psn: Psn::new(psn),
        aeth: syndrome.map(|syndrome| AethRepr {
            syndrome,
            msn: Msn::new(0),
        }),
        atomic_orig: None,
        payload_len: 0,
        has_payload: false,
    }
}

const ACK: Syndrome = Syndrome::Ack {
    credits: CreditCode::new(31),
};

fn ack(psn: u32) -> Response {
    resp(OpClass::Acknowledge, Position::Only, psn, Some(ACK))
}

fn check(req: &mut Requester, r: Response) -> Outcome {
    check_response(QpState::Rts, req, &cfg(), &r)
}

/// An Ack of the last Send completes it and, implicitly, the Send before it; one at or
/// before the acknowledged PSN only brings credits; one beyond what was sent is dropped.
#[test]
fn acks_and_the_implicit_acknowledgement() {
    let mut req = sent(&[(WqeOp::Send, 8), (WqeOp::Send, 8)]);
    assert_eq!(check(&mut req, ack(12)), Outcome::Dropped, "never sent");
    assert!(matches!(
        check(&mut req, ack(11)),
        Outcome::Ack { seq: 1, .. }
    ));
    assert_eq!(
        req.wqe(0).done,
        Some(WcStatus::Success),
        "implicitly acknowledged"
    );
    assert!(req.acknowledged(Psn::new(11), &cfg()));
    assert!(matches!(check(&mut req, ack(11)), Outcome::Credits(..)));
    // A duplicate that is not an Ack has nothing to give.
    let nak = resp(
        OpClass::Acknowledge,
        Position::Only,
        11,
        Some(Syndrome::Nak(NakCode::InvalidRequest)),
    );
    assert_eq!(check(&mut req, nak), Outcome::Dropped);
    // Not in a state that takes responses.
    let mut reset = sent(&[(WqeOp::Send, 8)]);
    assert_eq!(
        check_response(QpState::Error, &mut reset, &cfg(), &ack(10)),
        Outcome::Dropped
    );
}

/// Naks map to their statuses (spec/01 Table "NAK codes"), a sequence error and an RNR
/// Nak to their retries, a reserved syndrome to a bad response; an Ack without an AETH
/// is malformed.
#[test]
fn naks_and_bad_acks() {
    let cases = [
        (NakCode::InvalidRequest, WcStatus::RemInvReqErr),
        (NakCode::RemoteAccessError, WcStatus::RemAccessErr),
        (NakCode::RemoteOperationalError, WcStatus::RemOpErr),
    ];
    for (code, status) in cases {
        let mut req = sent(&[(WqeOp::Write, 8)]);
        let nak = resp(
            OpClass::Acknowledge,
            Position::Only,
            10,
            Some(Syndrome::Nak(code)),
        );
        assert_eq!(
            check(&mut req, nak),
            Outcome::FatalNak {
                seq: 0,
                psn: Psn::new(10),
                status
            }
        );
    }
    let mut req = sent(&[(WqeOp::Write, 8)]);
    let seq_err = Syndrome::Nak(NakCode::PsnSequenceError);
    let r = resp(OpClass::Acknowledge, Position::Only, 10, Some(seq_err));
    assert_eq!(
        check(&mut req, r),
        Outcome::SequenceError { psn: Psn::new(10) }
    );
    let r = resp(OpClass::Acknowledge, Position::Only, 10, None);
    assert_eq!(check(&mut req, r), Outcome::Bad(0));
    let r = resp(
        OpClass::Acknowledge,
        Position::Only,
        10,
        Some(Syndrome::Reserved(0x7f)),
    );
    assert_eq!(check(&mut req, r), Outcome::BadThenRetire(0));
    let r = resp(OpClass::Send, Position::Only, 10, None);
    assert_eq!(check(&mut req, r), Outcome::NotAResponse);
}

/// A Read of 600 bytes at PMTU 256 takes three responses, First, Middle, Last, of 256,
/// 256 and 88 bytes; a later one is an implied Nak, a wrong position or length is bad,
/// and an Ack inside the Read's PSNs means its responses were lost.
#[test]
fn read_responses_in_sequence() {
    let mut req = sent(&[(WqeOp::Read, 600)]);
    let read = |psn, position, len| Response {
        payload_len: len,
        has_payload: true,
        ..resp(OpClass::RdmaReadResponse, position, psn, None)
    };
    assert_eq!(
        check(&mut req, read(11, Position::Middle, 256)),
        Outcome::ImpliedNak(Psn::new(10))
    );
    assert_eq!(
        check(&mut req, read(10, Position::Only, 256)),
        Outcome::Bad(0)
    );
    assert_eq!(
        check(&mut req, read(10, Position::First, 255)),
        Outcome::Bad(0)
    );
    assert_eq!(
        check(&mut req, read(10, Position::First, 256)),
        Outcome::ReadResponse {
            seq: 0,
            psn: Psn::new(10),
            offset: 0,
            last: false
        }
    );
    req.response_seen(0);
    assert_eq!(check(&mut req, ack(11)), Outcome::ImpliedNak(Psn::new(11)));
    req.response_seen(0);
    assert_eq!(
        check(&mut req, read(12, Position::Last, 88)),
        Outcome::ReadResponse {
            seq: 0,
            psn: Psn::new(12),
            offset: 512,
            last: true
        }
    );
    // A response to a Send's PSN is bad.
    let mut send = sent(&[(WqeOp::Send, 8)]);
    assert_eq!(
        check(&mut send, read(10, Position::Only, 8)),
        Outcome::Bad(0)
    );
}

/// An Atomic Acknowledge answers an Atomic at its PSN with a positive AETH, its original
/// value and no payload; a later response means it was lost.
#[test]
fn atomic_acknowledges() {
    let atomic = |orig, has_payload| Response {
        atomic_orig: orig,
        has_payload,
        ..resp(OpClass::AtomicAcknowledge, Position::Only, 10, Some(ACK))
    };
    let mut req = sent(&[(WqeOp::FetchAdd, 8), (WqeOp::Send, 8)]);
    assert_eq!(check(&mut req, atomic(None, false)), Outcome::Bad(0));
    assert_eq!(check(&mut req, atomic(Some(5), true)), Outcome::Bad(0));
    assert_eq!(
        check(&mut req, atomic(Some(5), false)),
        Outcome::AtomicAck {
            seq: 0,
            psn: Psn::new(10),
            orig: 5
        }
    );
    assert_eq!(check(&mut req, ack(11)), Outcome::ImpliedNak(Psn::new(10)));
    let mut write = sent(&[(WqeOp::Write, 8)]);
    assert_eq!(check(&mut write, atomic(Some(5), false)), Outcome::Bad(0));
}

fn read(psn: u32, position: Position, len: u32) -> Response {
    Response {
        payload_len: len,
        has_payload: true,
        ..resp(OpClass::RdmaReadResponse, position, psn, None)
    }
}

fn read_ok(psn: u32, offset: u32, last: bool) -> Outcome {
    Outcome::ReadResponse {
        seq: 0,
        psn: Psn::new(psn),
        offset,
        last,
    }
}

/// spec/02 "Credits Provided in Unsolicited Ack Packet": an unsolicited or duplicate Ack
/// is always an Acknowledge opcode; a duplicate RDMA Read response or Atomic Acknowledge
/// (even with a positive AETH) is only a duplicate: dropped, its credits not taken.
#[test]
fn only_a_duplicate_acknowledge_brings_credits() {
    let mut req = sent(&[(WqeOp::Read, 8), (WqeOp::FetchAdd, 8)]);
    let only = Response {
        aeth: Some(AethRepr {
            syndrome: ACK,
            msn: Msn::new(0),
        }),
        ..read(10, Position::Only, 8)
    };
    assert_eq!(check(&mut req, only), read_ok(10, 0, true));
    req.response_seen(0);
    req.complete(0, WcStatus::Success);
    let atomic = Response {
        atomic_orig: Some(3),
        ..resp(OpClass::AtomicAcknowledge, Position::Only, 11, Some(ACK))
    };
    assert!(matches!(check(&mut req, atomic), Outcome::AtomicAck { .. }));
    assert!(req.acknowledged(Psn::new(11), &cfg()));
    assert_eq!(check(&mut req, only), Outcome::Dropped);
    assert_eq!(check(&mut req, atomic), Outcome::Dropped);
    assert_eq!(
        check(&mut req, ack(11)),
        Outcome::Credits(CreditCode::new(31), 0)
    );
}

/// spec/01 RDMA Read responses: a Read answered in several responses takes them First,
/// Middle…, Last in PSN order; a Middle is neither the first nor the last, a Last is the
/// last and not the first, each carries exactly its share of the data.
#[test]
fn read_response_positions() {
    // 700 bytes at PMTU 256: responses at 10, 11, 12 of 256, 256, 188 bytes.
    let mut req = sent(&[(WqeOp::Read, 700)]);
    assert_eq!(
        check(&mut req, read(10, Position::Middle, 256)),
        Outcome::Bad(0),
        "a Middle first"
    );
    assert_eq!(
        check(&mut req, read(10, Position::Last, 256)),
        Outcome::Bad(0),
        "a Last first"
    );
    assert_eq!(
        check(&mut req, read(10, Position::First, 256)),
        read_ok(10, 0, false)
    );
    req.response_seen(0);
    assert_eq!(
        check(&mut req, read(11, Position::Last, 256)),
        Outcome::Bad(0),
        "a Last before the last"
    );
    assert_eq!(
        check(&mut req, read(11, Position::Only, 256)),
        Outcome::Bad(0)
    );
    assert_eq!(
        check(&mut req, read(11, Position::Middle, 255)),
        Outcome::Bad(0),
        "short"
    );
    assert_eq!(
        check(&mut req, read(11, Position::Middle, 256)),
        read_ok(11, 256, false)
    );
    req.response_seen(0);
    assert_eq!(
        check(&mut req, read(12, Position::Middle, 188)),
        Outcome::Bad(0),
        "a Middle last"
    );
    assert_eq!(
        check(&mut req, read(12, Position::Last, 256)),
        Outcome::Bad(0),
        "long"
    );
    assert_eq!(
        check(&mut req, read(12, Position::Last, 188)),
        read_ok(12, 512, true)
    );

    // A Read answered in one response takes an Only, nothing else.
    for position in [Position::First, Position::Middle, Position::Last] {
        let mut one = sent(&[(WqeOp::Read, 100)]);
        assert_eq!(
            check(&mut one, read(10, position, 100)),
            Outcome::Bad(0),
            "{position:?}"
        );
    }
    let mut one = sent(&[(WqeOp::Read, 100)]);
    assert_eq!(
        check(&mut one, read(10, Position::Only, 100)),
        read_ok(10, 0, true)
    );
}

/// A Read requested again from response `resp_seen` on is answered as a new Read: First
/// (or Only) there, then Middle and Last.
#[test]
fn a_read_requested_again_restarts_at_first() {
    let mut req = sent(&[(WqeOp::Read, 700)]);
    assert_eq!(
        check(&mut req, read(10, Position::First, 256)),
        read_ok(10, 0, false)
    );
    req.response_seen(0);
    assert_eq!(
        check(&mut req, read(11, Position::First, 256)),
        read_ok(11, 256, false)
    );
    req.response_seen(0);
    assert_eq!(
        check(&mut req, read(12, Position::Only, 188)),
        read_ok(12, 512, true)
    );
}

/// Step 4: a Read response before the one expected is a duplicate (dropped), one after it
/// shows the responses between lost (an implied Nak from the one expected).
#[test]
fn a_read_response_out_of_sequence() {
    let mut req = sent(&[(WqeOp::Read, 700)]);
    assert_eq!(
        check(&mut req, read(10, Position::First, 256)),
        read_ok(10, 0, false)
    );
    req.response_seen(0);
    assert_eq!(
        check(&mut req, read(10, Position::First, 256)),
        Outcome::Dropped,
        "a duplicate"
    );
    assert_eq!(
        check(&mut req, read(12, Position::Last, 188)),
        Outcome::ImpliedNak(Psn::new(11))
    );
}

/// An Atomic Acknowledge needs a positive AETH: one without an AETH, or with a Nak or RNR
/// Nak syndrome, is bad even at the Atomic's PSN with its original value.
#[test]
fn an_atomic_acknowledge_needs_a_positive_aeth() {
    for syndrome in [
        None,
        Some(Syndrome::Nak(NakCode::InvalidRequest)),
        Some(Syndrome::RnrNak {
            timer: RnrTimer::new(1),
        }),
    ] {
        let mut req = sent(&[(WqeOp::CompareSwap, 8)]);
        let r = Response {
            atomic_orig: Some(9),
            ..resp(OpClass::AtomicAcknowledge, Position::Only, 10, syndrome)
        };
        assert_eq!(check(&mut req, r), Outcome::Bad(0), "{syndrome:?}");
    }
}
