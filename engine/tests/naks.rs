//! Each Nak provoked on purpose: the right completion status on both sides, the QPs in the
//! Error state, and nothing written outside the target buffer.
mod common;

use common::*;
use shmhca::*;

const GUARD_BYTE: u8 = 0x5A;

fn setup() -> (Pair, Mr, Mr) {
    let p = pair(&Params::default());
    let src = p.a.pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, &pattern(8192, 1)).unwrap();
    let target =
        p.b.pd
            .alloc_mr(
                4096,
                AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::LOCAL_WRITE,
            )
            .unwrap();
    target.write_at(0, &[GUARD_BYTE; 4096]).unwrap();
    (p, src, target)
}

fn untouched(mr: &Mr) {
    let mut v = vec![0u8; mr.len() as usize];
    mr.read_at(0, &mut v).unwrap();
    assert!(v.iter().all(|&b| b == GUARD_BYTE), "the target was written");
}

/// Posts `op` from A, expects it to fail with `status`, and both QPs to end in Error with
/// later work flushed.
fn expect_nak(p: &mut Pair, src: &Mr, op: SendOp, len: u32, status: WcStatus) {
    p.a.qp
        .post_send(&SendWr::new(1, op, &[src.sge(0, len).unwrap()]))
        .unwrap();
    // A second request queued behind it is flushed.
    p.a.qp
        .post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 1).unwrap()]))
        .unwrap();
    let wcs = wait_a(p, 2);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (1, status), "{wcs:?}");
    assert_eq!(
        (wcs[1].wr_id, wcs[1].status),
        (2, WcStatus::WrFlushErr),
        "{wcs:?}"
    );
    assert_eq!(p.a.qp.state(), QpState::Error);
    p.settle();
    assert_eq!(
        p.b.qp.state(),
        QpState::Error,
        "the responder moves to Error too"
    );
    let b = p.b.ctx.stats();
    assert_eq!(b.naks_sent, 1, "one Nak, sent once");
    let of_its_kind = match status {
        WcStatus::RemAccessErr => b.rem_access_naks_sent,
        WcStatus::RemInvReqErr => b.inv_req_naks_sent,
        WcStatus::RemOpErr => b.rem_op_naks_sent,
        s => panic!("no Nak kind for {s:?}"),
    };
    assert_eq!(of_its_kind, 1, "counted by its kind: {b:?}");
    let a = p.a.ctx.stats();
    assert_eq!(a.naks_received, 1, "{a:?}");
    assert_eq!(a.flushed, 1, "the request behind it was flushed: {a:?}");
}

#[test]
fn bad_rkey_is_a_remote_access_error() {
    let (mut p, src, target) = setup();
    let mut bad = target.remote(0);
    bad.rkey ^= 0x0100; // another index
    expect_nak(
        &mut p,
        &src,
        SendOp::RdmaWrite(bad),
        100,
        WcStatus::RemAccessErr,
    );
    untouched(&target);
}

#[test]
fn stale_rkey_of_a_deregistered_region_is_refused() {
    let (mut p, src, target) = setup();
    let old =
        p.b.pd
            .alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let stale = old.remote(0);
    old.deregister().unwrap();
    // A new region may reuse the table entry: the tag in the key catches it.
    let reuse =
        p.b.pd
            .alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    reuse.write_at(0, &[GUARD_BYTE; 4096]).unwrap();
    expect_nak(
        &mut p,
        &src,
        SendOp::RdmaWrite(stale),
        100,
        WcStatus::RemAccessErr,
    );
    untouched(&reuse);
    untouched(&target);
}

#[test]
fn out_of_bounds_write_and_read_are_remote_access_errors() {
    let (mut p, src, target) = setup();
    expect_nak(
        &mut p,
        &src,
        SendOp::RdmaWrite(target.remote(4000)),
        200,
        WcStatus::RemAccessErr,
    );
    untouched(&target);
    let (mut p, src, target) = setup();
    expect_nak(
        &mut p,
        &src,
        SendOp::RdmaRead(target.remote(1)),
        4096,
        WcStatus::RemAccessErr,
    );
    let before = {
        let mut v = vec![0u8; 8192];
        src.read_at(0, &mut v).unwrap();
        v
    };
    assert_eq!(
        before,
        pattern(8192, 1),
        "the read's local buffer was not written"
    );
}

#[test]
fn write_without_remote_write_permission_is_refused() {
    let (mut p, src, _) = setup();
    let ro = p.b.pd.alloc_mr(4096, AccessFlags::REMOTE_READ).unwrap();
    ro.write_at(0, &[GUARD_BYTE; 4096]).unwrap();
    expect_nak(
        &mut p,
        &src,
        SendOp::RdmaWrite(ro.remote(0)),
        64,
        WcStatus::RemAccessErr,
    );
    untouched(&ro);
}

#[test]
fn a_region_of_another_protection_domain_is_refused() {
    let (mut p, src, _) = setup();
    let other_pd = p.b.ctx.alloc_pd().unwrap();
    let foreign = other_pd
        .alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    foreign.write_at(0, &[GUARD_BYTE; 4096]).unwrap();
    expect_nak(
        &mut p,
        &src,
        SendOp::RdmaWrite(foreign.remote(0)),
        64,
        WcStatus::RemAccessErr,
    );
    untouched(&foreign);
}

#[test]
fn atomic_without_atomic_permission_is_refused() {
    let (mut p, src, target) = setup();
    expect_nak(
        &mut p,
        &src,
        SendOp::FetchAdd {
            remote: target.remote(8),
            add: 1,
        },
        8,
        WcStatus::RemAccessErr,
    );
    untouched(&target);
}

#[test]
fn receive_buffer_too_small_fails_on_both_sides() {
    let (mut p, src, _) = setup();
    let small = p.b.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    small.write_at(0, &[GUARD_BYTE; 4096]).unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(77, &[small.sge(1000, 100).unwrap()]))
        .unwrap();
    expect_nak(&mut p, &src, SendOp::Send, 3000, WcStatus::RemInvReqErr);
    let rc = wait_b(&mut p, 1)[0];
    assert_eq!((rc.wr_id, rc.status), (77, WcStatus::LocLenErr), "{rc:?}");
    let mut v = vec![0u8; 4096];
    small.read_at(0, &mut v).unwrap();
    assert!(
        v[..1000].iter().all(|&b| b == GUARD_BYTE),
        "written before the buffer"
    );
    assert!(
        v[1100..].iter().all(|&b| b == GUARD_BYTE),
        "written after the buffer"
    );
}

#[test]
fn misaligned_atomics_are_rejected_at_post_time() {
    let (mut p, src, target) = setup();
    let err =
        p.a.qp
            .post_send(&SendWr::new(
                1,
                SendOp::CompareSwap {
                    remote: target.remote(4),
                    compare: 0,
                    swap: 1,
                },
                &[src.sge(0, 8).unwrap()],
            ))
            .unwrap_err();
    assert!(err.to_string().contains("aligned"), "{err}");
    // And a result buffer that is not 8 bytes.
    let err =
        p.a.qp
            .post_send(&SendWr::new(
                1,
                SendOp::FetchAdd {
                    remote: target.remote(8),
                    add: 1,
                },
                &[src.sge(0, 4).unwrap()],
            ))
            .unwrap_err();
    assert!(err.to_string().contains("8 bytes"), "{err}");
    assert_eq!(
        p.a.qp.state(),
        QpState::Rts,
        "a refused post changes nothing"
    );
}

#[test]
fn error_state_flushes_receives_and_later_posts() {
    let (mut p, src, _) = setup();
    let buf = p.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..3 {
        p.b.qp
            .post_recv(&RecvWr::new(i, &[buf.sge(0, 64).unwrap()]))
            .unwrap();
    }
    p.b.qp.modify(&QpAttr::new(QpState::Error)).unwrap();
    let wcs = wait_b(&mut p, 3);
    assert!(
        wcs.iter().all(|w| w.status == WcStatus::WrFlushErr),
        "{wcs:?}"
    );
    assert_eq!(buf.in_flight(), 0, "flushed receives release their buffers");
    // Posting in Error is accepted and flushed.
    p.b.qp
        .post_recv(&RecvWr::new(9, &[buf.sge(0, 64).unwrap()]))
        .unwrap();
    assert_eq!(wait_b(&mut p, 1)[0].status, WcStatus::WrFlushErr);
    p.a.qp.modify(&QpAttr::new(QpState::Error)).unwrap();
    p.a.qp
        .post_send(&SendWr::new(5, SendOp::Send, &[src.sge(0, 8).unwrap()]))
        .unwrap();
    let wc = wait_a(&mut p, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::WrFlushErr));
    assert_eq!(src.in_flight(), 0);
    assert_eq!(p.b.ctx.stats().flushed, 4, "three receives, then one more");
    assert_eq!(p.a.ctx.stats().flushed, 1);
}

/// Posts a request that the responder accepts and answers (`first`, with result buffer
/// `result`) and then a Write with a bad R_Key; both are sent before either is answered.
/// The accepted request completes with its result, the Write with a remote access error.
fn accepted_then_refused(p: &mut Pair, src: &Mr, first: SendOp, result: Sge<'_>) {
    let mut bad =
        p.b.pd
            .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap()
            .remote(0);
    bad.rkey ^= 0x0100;
    p.a.qp.post_send(&SendWr::new(1, first, &[result])).unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            2,
            SendOp::RdmaWrite(bad),
            &[src.sge(0, 16).unwrap()],
        ))
        .unwrap();
    let wcs = wait_a(p, 2);
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(1, WcStatus::Success), (2, WcStatus::RemAccessErr)],
        "the responses of accepted requests leave before the Nak: {wcs:?}"
    );
    assert_eq!(p.a.qp.state(), QpState::Error);
    p.settle();
    assert_eq!(p.b.qp.state(), QpState::Error);
    assert_eq!(p.b.ctx.stats().naks_sent, 1, "one Nak, sent once");
}

#[test]
fn an_atomic_before_a_refused_write_completes_with_its_result() {
    // Found by the trust review (issue 8, item 11b): the fatal Nak discarded the Atomic
    // Acknowledge queued before it, so the executed FetchAdd failed with RetryExcErr.
    let (mut p, src, _) = setup();
    let word =
        p.b.pd
            .alloc_mr(64, AccessFlags::REMOTE_ATOMIC | AccessFlags::LOCAL_WRITE)
            .unwrap();
    word.write_at(8, &40u64.to_ne_bytes()).unwrap();
    let result = p.a.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    accepted_then_refused(
        &mut p,
        &src,
        SendOp::FetchAdd {
            remote: word.remote(8),
            add: 2,
        },
        result.sge(0, 8).unwrap(),
    );
    assert_eq!(
        word.load_u64(8).unwrap(),
        42,
        "the FetchAdd ran exactly once"
    );
    assert_eq!(
        result.load_u64(0).unwrap(),
        40,
        "it returned the original value"
    );
}

#[test]
fn a_read_before_a_refused_write_completes_with_its_data() {
    // As above for an RDMA Read of several response packets.
    let (mut p, src, target) = setup();
    target.write_at(0, &pattern(4096, 3)).unwrap();
    let back = p.a.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    accepted_then_refused(
        &mut p,
        &src,
        SendOp::RdmaRead(target.remote(0)),
        back.sge(0, 3000).unwrap(),
    );
    let mut got = vec![0u8; 3000];
    back.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(4096, 3)[..3000]);
}

#[test]
fn a_receive_failed_while_the_receive_cq_is_full_completes_once_there_is_room() {
    // Found while checking issue 8, item 6: a Send that failed the receive WQE in use while
    // the receive CQ was full lost that WQE — no completion, its region in flight forever.
    let p = Params::default();
    let (ca, cb) = (context(p.arena), context(p.arena));
    let (la, lb) = ca.link_with(&cb).unwrap();
    let mut a = end(ca, la, &p);
    let pdb = cb.alloc_pd().unwrap();
    let mut full_cq = cb.create_cq(1).unwrap();
    let mut qb = cb
        .create_qp(&pdb, &full_cq, &full_cq, QpCaps::default())
        .unwrap();
    let (na, nb) = (a.qp.qpn(), qb.qpn());
    connect(&mut a.qp, la, nb, p.psn_a, p.psn_b, &p);
    connect(&mut qb, lb, na, p.psn_b, p.psn_a, &p);
    let src = a.pd.alloc_mr(4096, AccessFlags::NONE).unwrap();
    let buf = pdb.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    // A first message fills B's CQ, which B does not poll yet.
    qb.post_recv(&RecvWr::new(1, &[buf.sge(0, 64).unwrap()]))
        .unwrap();
    a.qp.post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 8).unwrap()]))
        .unwrap();
    assert_eq!(
        poll_n(&a.ctx, &cb, &mut a.cq, 1)[0].status,
        WcStatus::Success
    );
    // A second one overflows its receive buffer on its first packet.
    let small = pdb.alloc_mr(100, AccessFlags::LOCAL_WRITE).unwrap();
    qb.post_recv(&RecvWr::new(2, &[small.sge(0, 100).unwrap()]))
        .unwrap();
    a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 3000).unwrap()]))
        .unwrap();
    let wc = poll_n(&a.ctx, &cb, &mut a.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::RemInvReqErr), "{wc:?}");
    assert_eq!(qb.state(), QpState::Error);
    assert_eq!(small.in_flight(), 1, "held until its completion fits");
    // Room made: the failed receive completes, once, with its local error.
    let wcs = poll_n(&a.ctx, &cb, &mut full_cq, 2);
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(1, WcStatus::Success), (2, WcStatus::LocLenErr)],
        "{wcs:?}"
    );
    for _ in 0..100 {
        a.ctx.progress();
        cb.progress();
    }
    assert_eq!(full_cq.poll_one(), None, "completed once");
    assert_eq!(small.in_flight(), 0);
}

#[test]
fn a_region_deregistered_mid_read_ends_the_read_with_a_remote_access_error() {
    // The responder's Nak for the response it can no longer read is the last packet it
    // sends: the responses before it arrive, nothing after it.
    let p = Params::default(); // PMTU 1024
    let small_links = || {
        Context::builder()
            .arena_size(p.arena)
            .huge_pages(shmhca_rings::HugePages::Never)
            .mode(EngineMode::Inline)
            .link_slots(8)
            .build()
            .unwrap()
    };
    let (ca, cb) = (small_links(), small_links());
    let (la, lb) = ca.link_with(&cb).unwrap();
    let mut a = end(ca, la, &p);
    let mut b = end(cb, lb, &p);
    let (na, nb) = (a.qp.qpn(), b.qp.qpn());
    connect(&mut a.qp, la, nb, p.psn_a, p.psn_b, &p);
    connect(&mut b.qp, lb, na, p.psn_b, p.psn_a, &p);
    let target = b.pd.alloc_mr(16 * 1024, AccessFlags::REMOTE_READ).unwrap();
    let back = a.pd.alloc_mr(16 * 1024, AccessFlags::LOCAL_WRITE).unwrap();
    a.qp.post_send(&SendWr::new(
        1,
        SendOp::RdmaRead(target.remote(0)),
        &[back.sge(0, 16 * 1024).unwrap()],
    ))
    .unwrap();
    a.qp.post_send(&SendWr::new(
        2,
        SendOp::RdmaRead(target.remote(0)),
        &[back.sge(0, 8).unwrap()],
    ))
    .unwrap();
    // B takes both requests and sends what its eight link lines hold of the first read
    // (one line a response).
    b.ctx.progress();
    target.deregister().unwrap();
    let wcs = poll_n(&a.ctx, &b.ctx, &mut a.cq, 2);
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(1, WcStatus::RemAccessErr), (2, WcStatus::WrFlushErr)],
        "{wcs:?}"
    );
    for _ in 0..100 {
        a.ctx.progress();
        b.ctx.progress();
    }
    assert_eq!(b.qp.state(), QpState::Error);
    let s = b.ctx.stats();
    assert_eq!(s.naks_sent, 1, "{s:?}");
    assert_eq!(
        s.packets_sent - s.acks_sent - s.naks_sent,
        8,
        "the eight responses sent before the region went away, none after: {s:?}"
    );
}
