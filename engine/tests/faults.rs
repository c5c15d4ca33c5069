//! Every RC recovery path, each forced by a fault rule that hits one chosen packet: PSN
//! Sequence Error Naks and go-back-N, lost Acks (answered by a later Ack or by the
//! transport timer), duplicate Sends and Writes, duplicate Reads (checked again),
//! duplicate Atomics (answered from the saved result), lost Read responses, RNR Naks under
//! loss, lost credit updates, and retry exhaustion.
mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use shmhca::fault::FaultAction;
use shmhca::psn::Psn;
use shmhca::trace::PacketEvent;
use shmhca::wire::PacketRepr;
use shmhca::wire::aeth::Syndrome;
use shmhca::wire::opcode::Opcode;
use shmhca::*;

/// How long a wait may take before it is a failure: generous, nothing here measures speed.
const DEADLINE: Duration = Duration::from_secs(30);

type Pred = Box<dyn FnMut(&PacketRepr) -> bool + Send>;

/// A fault rule: `action` for the first `times` packets `pred` picks, `Pass` for the rest.
fn rule(
    action: FaultAction,
    times: u32,
    mut pred: impl FnMut(&PacketRepr) -> bool + Send + 'static,
) -> impl FnMut(&PacketEvent<'_>) -> FaultAction + Send + 'static {
    let mut left = times;
    move |e| {
        if left > 0 && pred(e.headers) {
            left -= 1;
            action
        } else {
            FaultAction::Pass
        }
    }
}

fn builder() -> ContextBuilder {
    Context::builder()
        .arena_size(16 << 20)
        .huge_pages(shmhca_rings::HugePages::Never)
        .mode(EngineMode::Inline)
}

/// Two linked contexts, one connected QP each; `a` and `b` are the fault rules of the
/// packets A and B send.
fn pair_with(p: &Params, a: Option<Pred>, b: Option<Pred>, action: (FaultAction, u32)) -> Pair {
    let with = |pred: Option<Pred>| match pred {
        Some(pred) => builder().fault_rule(rule(action.0, action.1, pred)),
        None => builder(),
    };
    let ca = with(a).build().unwrap();
    let cb = with(b).build().unwrap();
    let (la, lb) = ca.link_with(&cb).unwrap();
    let mut a = end(ca, la, p);
    let mut b = end(cb, lb, p);
    let (qa, qb) = (a.qp.qpn(), b.qp.qpn());
    connect(&mut a.qp, la, qb, p.psn_a, p.psn_b, p);
    connect(&mut b.qp, lb, qa, p.psn_b, p.psn_a, p);
    Pair { a, b }
}

/// A transport timer long enough (Local Ack Timeout 18: about 1 s) that it never fires
/// while the engines are driven, on a loaded machine too.
fn no_timeouts() -> Params {
    Params {
        timeout: 18,
        ..Params::default()
    }
}

/// A short transport timer (Local Ack Timeout 10: about 4 ms).
fn short_timeouts() -> Params {
    Params {
        timeout: 10,
        ..Params::default()
    }
}

fn psn(p: &PacketRepr) -> u32 {
    p.bth.psn.get()
}

fn is_ack(p: &PacketRepr) -> bool {
    p.bth.opcode == Opcode::Acknowledge
        && matches!(p.aeth.map(|a| a.syndrome), Some(Syndrome::Ack { .. }))
}

/// A positive Ack of a request from `first` on (not the responder's initial or unsolicited
/// credit update, which carries the PSN before `first` until a request arrived).
fn is_ack_of_request(h: &PacketRepr, first: u32) -> bool {
    is_ack(h) && psn(h) != Psn::new(first).sub(1).get()
}

/// Drives both engines until `done` holds.
fn until(p: &Pair, what: &str, mut done: impl FnMut(&Pair) -> bool) {
    let start = Instant::now();
    while !done(p) {
        p.pump();
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
    }
}

/// Records the packets a context sends.
fn record(ctx: &Context) -> Arc<Mutex<Vec<PacketRepr>>> {
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = Arc::clone(&log);
    ctx.observe_packets(move |e| {
        if e.direction == shmhca::trace::Direction::Sent {
            l.lock().unwrap().push(*e.headers);
        }
    });
    log
}

/// A lost request packet: the responder sees the next one out of sequence and Naks it
/// once (PSN Sequence Error); the requester goes back to the lost PSN and sends that
/// packet and the ones after it again. No timer is involved.
#[test]
fn a_lost_request_packet_gets_a_sequence_error_nak_and_go_back_n() {
    let p0 = no_timeouts();
    let lost = p0.psn_a + 1;
    let mut p = pair_with(
        &p0,
        Some(Box::new(move |h| {
            psn(h) == lost && h.bth.opcode.info().unwrap().request
        })),
        None,
        (FaultAction::Drop, 1),
    );
    let src = p.a.pd.alloc_mr(4096, AccessFlags::NONE).unwrap();
    let dst = p.b.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, &pattern(3000, 1)).unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(9, &[dst.sge(0, 4096).unwrap()]))
        .unwrap();
    p.settle();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 3000).unwrap()]))
        .unwrap();
    let rc = wait_b(&mut p, 1)[0];
    assert_eq!((rc.status, rc.byte_len), (WcStatus::Success, 3000));
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    let mut got = vec![0u8; 3000];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(3000, 1));
    let (a, b) = (p.a.ctx.stats(), p.b.ctx.stats());
    assert_eq!(p.a.ctx.fault_stats().dropped, 1);
    assert_eq!(b.seq_err_naks_sent, 1, "one Nak for the gap: {b:?}");
    assert_eq!(a.naks_received, 1);
    assert_eq!(a.retransmitted, 2, "the lost packet and the one after it");
    assert_eq!(a.timeouts, 0);
}

/// A lost Ack is made good by the next one: an Ack of a later PSN acknowledges every
/// request before it, so both Writes complete, nothing is sent again and no timer fires.
#[test]
fn a_lost_ack_is_covered_by_the_next_ack() {
    let p0 = no_timeouts();
    let first = p0.psn_a;
    let mut p = pair_with(
        &p0,
        None,
        Some(Box::new(move |h| is_ack_of_request(h, first))),
        (FaultAction::Drop, 1),
    );
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    let dst =
        p.b.pd
            .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    src.write_at(0, b"firstsecond!").unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            1,
            SendOp::RdmaWrite(dst.remote(0)),
            &[src.sge(0, 5).unwrap()],
        ))
        .unwrap();
    until(&p, "the first Ack to be dropped", |p| {
        p.b.ctx.fault_stats().dropped == 1
    });
    p.settle();
    assert_eq!(
        p.a.cq.poll_one(),
        None,
        "the first Write is not acknowledged"
    );
    p.a.qp
        .post_send(&SendWr::new(
            2,
            SendOp::RdmaWrite(dst.remote(5)),
            &[src.sge(5, 7).unwrap()],
        ))
        .unwrap();
    let wcs = wait_a(&mut p, 2);
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    let mut got = [0u8; 12];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"firstsecond!");
    let a = p.a.ctx.stats();
    assert_eq!((a.retransmitted, a.timeouts), (0, 0), "{a:?}");
}

/// A lost Ack with nothing behind it: the transport timer fires, the Send is sent again,
/// the responder sees a duplicate, acknowledges it again and does not deliver it twice —
/// the second receive WQE is still there for the next message.
#[test]
fn a_lost_ack_is_recovered_by_the_timer_and_the_duplicate_send_is_not_delivered_again() {
    let p0 = short_timeouts();
    let first = p0.psn_a;
    let mut p = pair_with(
        &p0,
        None,
        Some(Box::new(move |h| is_ack_of_request(h, first))),
        (FaultAction::Drop, 1),
    );
    let src = p.a.pd.alloc_mr(4096, AccessFlags::NONE).unwrap();
    let dst = p.b.pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, &pattern(2000, 3)).unwrap();
    src.write_at(2048, &pattern(100, 4)).unwrap();
    for i in 0..2u64 {
        p.b.qp
            .post_recv(&RecvWr::new(10 + i, &[dst.sge(i * 4096, 4096).unwrap()]))
            .unwrap();
    }
    p.settle();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 2000).unwrap()]))
        .unwrap();
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    let a = p.a.ctx.stats();
    assert!(a.timeouts >= 1 && a.retransmitted >= 1, "{a:?}");
    p.a.qp
        .post_send(&SendWr::new(
            2,
            SendOp::Send,
            &[src.sge(2048, 100).unwrap()],
        ))
        .unwrap();
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    let rc = wait_b(&mut p, 2);
    assert_eq!(
        rc.iter()
            .map(|w| (w.wr_id, w.status, w.byte_len))
            .collect::<Vec<_>>(),
        [(10, WcStatus::Success, 2000), (11, WcStatus::Success, 100)],
        "each message in its own receive"
    );
    p.settle();
    assert_eq!(p.b.cq.poll_one(), None, "no third receive completion");
    let mut got = vec![0u8; 100];
    dst.read_at(4096, &mut got).unwrap();
    assert_eq!(got, pattern(100, 4));
}

/// A duplicated Send and a duplicated Write with Immediate each use one receive WQE only,
/// and are acknowledged again.
#[test]
fn duplicate_sends_and_writes_with_immediate_use_one_receive() {
    let p0 = no_timeouts();
    let mut p = pair_with(
        &p0,
        Some(Box::new(|h| h.bth.opcode.info().unwrap().request)),
        None,
        (FaultAction::Duplicate, 2),
    );
    let src = p.a.pd.alloc_mr(4096, AccessFlags::NONE).unwrap();
    let dst =
        p.b.pd
            .alloc_mr(8192, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    src.write_at(0, &pattern(64, 7)).unwrap();
    for i in 0..3u64 {
        p.b.qp
            .post_recv(&RecvWr::new(20 + i, &[dst.sge(i * 1024, 1024).unwrap()]))
            .unwrap();
    }
    p.settle();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 64).unwrap()]))
        .unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            2,
            SendOp::RdmaWriteWithImm(dst.remote(4096), 77),
            &[src.sge(0, 64).unwrap()],
        ))
        .unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            3,
            SendOp::SendWithImm(5),
            &[src.sge(0, 8).unwrap()],
        ))
        .unwrap();
    assert!(
        wait_a(&mut p, 3)
            .iter()
            .all(|w| w.status == WcStatus::Success)
    );
    let rc = wait_b(&mut p, 3);
    assert_eq!(
        rc.iter()
            .map(|w| (w.wr_id, w.byte_len, w.imm_data))
            .collect::<Vec<_>>(),
        [(20, 64, None), (21, 64, Some(77)), (22, 8, Some(5))],
    );
    p.settle();
    assert_eq!(p.b.cq.poll_one(), None);
    assert_eq!(p.a.ctx.fault_stats().duplicated, 2);
}

/// A duplicate RDMA Write (its Ack lost, the timer resends it) is acknowledged and not
/// executed again: what the responder's application wrote into the target after the
/// first copy stays.
#[test]
fn a_duplicate_write_is_not_executed_again() {
    let p0 = short_timeouts();
    let first = p0.psn_a;
    let mut p = pair_with(
        &p0,
        None,
        Some(Box::new(move |h| is_ack_of_request(h, first))),
        (FaultAction::Drop, 1),
    );
    let src = p.a.pd.alloc_mr(4096, AccessFlags::NONE).unwrap();
    let dst =
        p.b.pd
            .alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    src.write_at(0, &pattern(2500, 9)).unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            1,
            SendOp::RdmaWrite(dst.remote(0)),
            &[src.sge(0, 2500).unwrap()],
        ))
        .unwrap();
    until(&p, "the Write's Ack to be dropped", |p| {
        p.b.ctx.fault_stats().dropped == 1
    });
    let mut got = vec![0u8; 2500];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(2500, 9));
    dst.write_at(0, &[0xEE; 2500]).unwrap();
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    assert!(p.a.ctx.stats().retransmitted >= 1);
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, vec![0xEE; 2500], "the duplicate wrote again");
}

/// Reads `len` bytes of B's region into A's, with B's responses in `b_rule`'s hands.
struct ReadRig {
    p: Pair,
    src: Mr,
    dst: Mr,
    log: Arc<Mutex<Vec<PacketRepr>>>,
}

fn read_rig(p0: &Params, b_rule: Pred, action: (FaultAction, u32), len: usize) -> ReadRig {
    let mut p = pair_with(p0, None, Some(b_rule), action);
    p.settle();
    let src = p.b.pd.alloc_mr(8192, AccessFlags::REMOTE_READ).unwrap();
    let dst = p.a.pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, &pattern(len, 11)).unwrap();
    let log = record(&p.a.ctx);
    p.a.qp
        .post_send(&SendWr::new(
            1,
            SendOp::RdmaRead(src.remote(0)),
            &[dst.sge(0, len as u32).unwrap()],
        ))
        .unwrap();
    ReadRig { p, src, dst, log }
}

fn read_requests(log: &Mutex<Vec<PacketRepr>>) -> Vec<(u32, u64, u32)> {
    log.lock()
        .unwrap()
        .iter()
        .filter(|h| h.bth.opcode == Opcode::RdmaReadRequest)
        .map(|h| {
            let r = h.reth.unwrap();
            (psn(h), r.va, r.dma_len)
        })
        .collect()
}

/// A lost Read response in the middle: the next response shows the gap (an implied Nak),
/// and the requester asks again from the lost response on — its PSN, its offset, the
/// length left — and gets every byte.
#[test]
fn a_lost_read_response_is_requested_again_from_its_offset() {
    let p0 = no_timeouts();
    let lost = p0.psn_a + 2;
    let mut r = read_rig(
        &p0,
        Box::new(move |h| h.bth.opcode == Opcode::RdmaReadResponseMiddle && psn(h) == lost),
        (FaultAction::Drop, 1),
        4096,
    );
    assert_eq!(wait_a(&mut r.p, 1)[0].status, WcStatus::Success);
    let mut got = vec![0u8; 4096];
    r.dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(4096, 11));
    let base = r.src.remote(0).addr;
    assert_eq!(
        read_requests(&r.log),
        [(p0.psn_a, base, 4096), (lost, base + 2048, 2048)],
        "the second request starts at the lost response"
    );
    assert_eq!(r.p.b.ctx.fault_stats().dropped, 1);
}

/// Every response of a Read lost: the transport timer sends the request again, and the
/// responder executes the duplicate again — from memory as it is now.
#[test]
fn a_duplicate_read_is_executed_again() {
    let p0 = short_timeouts();
    let mut r = read_rig(
        &p0,
        Box::new(|h| {
            h.bth.opcode.info().unwrap().class == shmhca::wire::opcode::OpClass::RdmaReadResponse
        }),
        (FaultAction::Drop, 3),
        3000,
    );
    until(&r.p, "the responses to be dropped", |p| {
        p.b.ctx.fault_stats().dropped == 3
    });
    r.src.write_at(0, &pattern(3000, 12)).unwrap();
    assert_eq!(wait_a(&mut r.p, 1)[0].status, WcStatus::Success);
    let mut got = vec![0u8; 3000];
    r.dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(3000, 12), "read again, not replayed");
    let base = r.src.remote(0).addr;
    let reqs = read_requests(&r.log);
    assert!(reqs.len() >= 2, "{reqs:?}");
    assert!(
        reqs.iter().all(|&q| q == (p0.psn_a, base, 3000)),
        "{reqs:?}"
    );
    assert!(r.p.a.ctx.stats().timeouts >= 1);
}

/// A duplicate Read is checked again like a new one: the region deregistered between the
/// original and the duplicate, the duplicate is refused with a Remote Access Error.
#[test]
fn a_duplicate_read_of_a_deregistered_region_is_refused() {
    let p0 = short_timeouts();
    let r = read_rig(
        &p0,
        Box::new(|h| {
            h.bth.opcode.info().unwrap().class == shmhca::wire::opcode::OpClass::RdmaReadResponse
        }),
        (FaultAction::Drop, 1),
        512,
    );
    let ReadRig { mut p, src, .. } = r;
    until(&p, "the response to be dropped", |p| {
        p.b.ctx.fault_stats().dropped == 1
    });
    drop(src);
    let wc = wait_a(&mut p, 1)[0];
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
    assert_eq!(p.b.ctx.stats().rem_access_naks_sent, 1);
}

/// A duplicate Atomic (its Atomic Acknowledge lost, the timer resends it) is answered
/// from the saved original value and never executed twice.
#[test]
fn a_duplicate_atomic_is_answered_from_its_saved_result() {
    let p0 = short_timeouts();
    let mut p = pair_with(
        &p0,
        None,
        Some(Box::new(|h| h.bth.opcode == Opcode::AtomicAcknowledge)),
        (FaultAction::Drop, 2),
    );
    let word =
        p.b.pd
            .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC)
            .unwrap();
    word.write_at(0, &100u64.to_ne_bytes()).unwrap();
    let res = p.a.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            1,
            SendOp::FetchAdd {
                remote: word.remote(0),
                add: 5,
            },
            &[res.sge(0, 8).unwrap()],
        ))
        .unwrap();
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    p.a.qp
        .post_send(&SendWr::new(
            2,
            SendOp::CompareSwap {
                remote: word.remote(0),
                compare: 105,
                swap: 999,
            },
            &[res.sge(8, 8).unwrap()],
        ))
        .unwrap();
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    let u64_at = |m: &Mr, off| {
        let mut b = [0u8; 8];
        m.read_at(off, &mut b).unwrap();
        u64::from_ne_bytes(b)
    };
    assert_eq!(
        u64_at(&res, 0),
        100,
        "the original value of the Fetch and Add"
    );
    assert_eq!(
        u64_at(&res, 8),
        105,
        "the original value of the Compare and Swap"
    );
    assert_eq!(u64_at(&word, 0), 999, "each executed once");
    assert_eq!(p.b.ctx.fault_stats().dropped, 2);
    assert!(p.a.ctx.stats().retransmitted >= 2);
}

/// An RNR Nak lost: the transport timer resends the Send, the next RNR Nak arrives, the
/// requester waits its RNR timer and succeeds once a receive is posted — the message
/// delivered once.
#[test]
fn rnr_naks_under_loss() {
    let p0 = Params {
        min_rnr_timer: 1,
        ..short_timeouts()
    };
    let mut p = pair_with(
        &p0,
        None,
        Some(Box::new(|h| {
            h.bth.opcode == Opcode::Acknowledge
                && matches!(h.aeth.map(|a| a.syndrome), Some(Syndrome::RnrNak { .. }))
        })),
        (FaultAction::Drop, 1),
    );
    let src = p.a.pd.alloc_mr(4096, AccessFlags::NONE).unwrap();
    src.write_at(0, &pattern(1500, 13)).unwrap();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 1500).unwrap()]))
        .unwrap();
    until(&p, "an RNR Nak after the lost one", |p| {
        p.a.ctx.stats().rnr_naks_received >= 1
    });
    assert_eq!(p.b.ctx.fault_stats().dropped, 1);
    assert!(
        p.a.ctx.stats().timeouts >= 1,
        "the lost RNR Nak left only the timer"
    );
    let dst = p.b.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(5, &[dst.sge(0, 4096).unwrap()]))
        .unwrap();
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    let rc = wait_b(&mut p, 1)[0];
    assert_eq!((rc.wr_id, rc.byte_len), (5, 1500));
    let mut got = vec![0u8; 1500];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(1500, 13));
    p.settle();
    assert_eq!(p.b.cq.poll_one(), None);
}

/// The responder's unsolicited credit update lost: the requester, still knowing of no
/// receive WQE, sends its Send limited — the first packet with AckReq — and goes on once
/// that is acknowledged, without an RNR Nak.
#[test]
fn a_lost_credit_update_leaves_the_send_limited_not_stuck() {
    let p0 = no_timeouts();
    let before_first = Psn::new(p0.psn_a).sub(1).get();
    let mut p = pair_with(
        &p0,
        None,
        Some(Box::new(move |h| {
            psn(h) == before_first
                && matches!(
                    h.aeth.map(|a| a.syndrome),
                    Some(Syndrome::Ack { credits }) if credits.credits().is_some_and(|c| c > 0)
                )
        })),
        (FaultAction::Drop, 1),
    );
    p.settle();
    let dst = p.b.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(5, &[dst.sge(0, 4096).unwrap()]))
        .unwrap();
    p.settle();
    assert_eq!(p.b.ctx.fault_stats().dropped, 1, "the update was lost");
    let log = record(&p.a.ctx);
    let src = p.a.pd.alloc_mr(4096, AccessFlags::NONE).unwrap();
    src.write_at(0, &pattern(3000, 14)).unwrap();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 3000).unwrap()]))
        .unwrap();
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    assert_eq!(wait_b(&mut p, 1)[0].byte_len, 3000);
    let sent: Vec<(Opcode, bool)> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|h| h.bth.opcode.info().unwrap().request)
        .map(|h| (h.bth.opcode, h.bth.ack_req))
        .collect();
    assert_eq!(
        sent,
        [
            (Opcode::SendFirst, true),
            (Opcode::SendMiddle, false),
            (Opcode::SendLast, true)
        ]
    );
    assert_eq!(p.a.ctx.stats().rnr_naks_received, 0);
}

/// Every Ack lost: the transport timer fires Retry Count + 1 times, the Write fails with
/// RetryExcErr, and the QP says in words which counter ran out and the last PSN the peer
/// acknowledged.
#[test]
fn retry_exhaustion_says_which_counter_ran_out_and_the_last_acknowledged_psn() {
    let p0 = Params {
        retry: 2,
        ..short_timeouts()
    };
    let first = p0.psn_a;
    let mut p = pair_with(
        &p0,
        None,
        Some(Box::new(move |h| {
            is_ack_of_request(h, first) && psn(h) != first
        })),
        (FaultAction::Drop, u32::MAX),
    );
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    let dst =
        p.b.pd
            .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    // The first Write is acknowledged; the second's Acks are all lost.
    for (i, op) in [(1, dst.remote(0)), (2, dst.remote(8))] {
        p.a.qp
            .post_send(&SendWr::new(
                i,
                SendOp::RdmaWrite(op),
                &[src.sge(0, 8).unwrap()],
            ))
            .unwrap();
        if i == 1 {
            assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
        }
    }
    let wc = wait_a(&mut p, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::RetryExcErr), "{wc:?}");
    assert_eq!(p.a.ctx.stats().timeouts, 3, "the first try and 2 retries");
    let why = p.a.qp.last_error().expect("an error text");
    assert!(why.contains("retry count"), "{why}");
    assert!(why.contains("transport timer"), "{why}");
    assert!(why.contains(&format!("PSN {first}")), "{why}");
}

/// RNR retry exhaustion names the RNR retry counter.
#[test]
fn rnr_retry_exhaustion_says_so() {
    let p0 = Params {
        rnr_retry: 1,
        min_rnr_timer: 1,
        ..no_timeouts()
    };
    let mut p = pair_with(&p0, None, None, (FaultAction::Pass, 0));
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 8).unwrap()]))
        .unwrap();
    let wc = wait_a(&mut p, 1)[0];
    assert_eq!(wc.status, WcStatus::RnrRetryExcErr);
    let why = p.a.qp.last_error().expect("an error text");
    assert!(why.contains("RNR retry count"), "{why}");
    let before = Psn::new(p0.psn_a).sub(1).get();
    assert!(why.contains(&format!("PSN {before}")), "{why}");
}
