//! The QP state rules a user relies on (spec/03: posting in RTR, transitions).
mod common;

use common::*;
use shmhca::*;

#[test]
fn posting_follows_the_state_machine() {
    let p = Params::default();
    let ctx = context(4 << 20);
    let (link, _) = ctx.link_with(&ctx).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let mut qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let sge = [mr.sge(0, 8).unwrap()];
    assert_eq!(qp.state(), QpState::Reset);
    // Reset: nothing can be posted.
    assert!(matches!(
        qp.post_recv(&RecvWr::new(1, &sge)),
        Err(Error::InvalidState { .. })
    ));
    assert!(matches!(
        qp.post_send(&SendWr::new(1, SendOp::Send, &sge)),
        Err(Error::InvalidState { .. })
    ));
    qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::NONE))
        .unwrap();
    // Init: receives yes, sends no.
    qp.post_recv(&RecvWr::new(1, &sge)).unwrap();
    assert!(matches!(
        qp.post_send(&SendWr::new(1, SendOp::Send, &sge)),
        Err(Error::InvalidState {
            state: QpState::Init,
            ..
        })
    ));
    let qpn = qp.qpn();
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(p.mtu)
            .dest(Destination { link, qpn })
            .rq_psn(5)
            .max_dest_rd_atomic(1)
            .min_rnr_timer(1),
    )
    .unwrap();
    // RTR: posting a send is an immediate error (spec/03), receives are fine.
    let err = qp
        .post_send(&SendWr::new(1, SendOp::Send, &sge))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidState {
                state: QpState::Rtr,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("RTS"), "{err}");
    qp.post_recv(&RecvWr::new(2, &sge)).unwrap();
    // A failed transition leaves the QP as it was.
    let bad = QpAttr::new(QpState::Rts)
        .sq_psn(5)
        .timeout(14)
        .retry_cnt(9)
        .rnr_retry(7)
        .max_rd_atomic(1);
    assert!(qp.modify(&bad).is_err());
    assert_eq!(qp.state(), QpState::Rtr);
    let missing = QpAttr::new(QpState::Rts)
        .sq_psn(5)
        .timeout(14)
        .rnr_retry(7)
        .max_rd_atomic(1);
    match qp.modify(&missing) {
        Err(Error::MissingAttribute { attribute, .. }) => assert_eq!(attribute, "retry_cnt"),
        other => panic!("{other:?}"),
    }
    qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(5)
            .timeout(14)
            .retry_cnt(7)
            .rnr_retry(7)
            .max_rd_atomic(1),
    )
    .unwrap();
    assert_eq!(qp.state(), QpState::Rts);
    // Loopback: the QP talks to itself; the two receives take the two sends.
    mr.write_at(0, b"loopback").unwrap();
    qp.post_send(&SendWr::new(10, SendOp::Send, &sge)).unwrap();
    qp.post_send(&SendWr::new(11, SendOp::Send, &sge)).unwrap();
    let mut cq = cq;
    let wcs = poll_n(&ctx, &ctx, &mut cq, 4);
    let mut ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
    ids.sort();
    assert_eq!(ids, [1, 2, 10, 11]);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    // SQD: sends are accepted but not started until back in RTS.
    qp.modify(&QpAttr::new(QpState::Sqd)).unwrap();
    qp.post_recv(&RecvWr::new(3, &sge)).unwrap();
    qp.post_send(&SendWr::new(12, SendOp::Send, &sge)).unwrap();
    for _ in 0..100 {
        ctx.progress();
    }
    assert_eq!(cq.poll_one(), None, "nothing starts in SQD");
    qp.modify(&QpAttr::new(QpState::Rts)).unwrap();
    assert_eq!(poll_n(&ctx, &ctx, &mut cq, 2).len(), 2);
    // Reset drops everything without completions and allows starting over.
    qp.post_recv(&RecvWr::new(4, &sge)).unwrap();
    qp.modify(&QpAttr::new(QpState::Reset)).unwrap();
    assert_eq!(mr.in_flight(), 0);
    for _ in 0..10 {
        ctx.progress();
    }
    assert_eq!(cq.poll_one(), None, "Reset makes no completions");
    assert_eq!(qp.state(), QpState::Reset);
}

#[test]
fn capabilities_out_of_range_are_refused_at_creation() {
    let ctx = context(4 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let caps = QpCaps {
        max_send_wr: 0,
        ..QpCaps::default()
    };
    let err = ctx.create_qp(&pd, &cq, &cq, caps).unwrap_err();
    assert!(err.to_string().contains("max_send_wr"), "{err}");
    assert!(ctx.create_cq(0).is_err());
    assert!(pd.alloc_mr(0, AccessFlags::NONE).is_err());
    let other = context(4 << 20);
    let opd = other.alloc_pd().unwrap();
    assert!(matches!(
        ctx.create_qp(&opd, &cq, &cq, QpCaps::default()),
        Err(Error::ForeignObject { .. })
    ));
}

#[test]
fn a_region_in_use_cannot_be_freed_or_mutably_borrowed() {
    let mut p = pair(&Params::default());
    let mut buf = p.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    assert!(buf.as_mut_slice().is_ok());
    p.b.qp
        .post_recv(&RecvWr::new(1, &[buf.sge(0, 64).unwrap()]))
        .unwrap();
    assert_eq!(buf.in_flight(), 1);
    assert!(matches!(
        buf.as_mut_slice(),
        Err(Error::MrBusy { in_flight: 1, .. })
    ));
    let buf = match buf.deregister() {
        Err(r) if matches!(r.error(), Error::MrBusy { .. }) => r.into_value(),
        other => panic!("deregistered while in use: {other:?}"),
    };
    // Complete the receive; then the region is free again.
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    src.write_at(0, b"12345678").unwrap();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 8).unwrap()]))
        .unwrap();
    wait_b(&mut p, 1);
    let mut buf = buf;
    assert_eq!(&buf.as_mut_slice().unwrap()[..8], b"12345678");
    buf.deregister().unwrap();
    // Remote-writable memory never hands out a slice.
    let mut rw =
        p.b.pd
            .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    assert!(matches!(
        rw.as_mut_slice(),
        Err(Error::MrRemoteWritable { .. })
    ));
}

#[test]
fn dropping_a_region_in_flight_defers_its_free_and_kills_its_key() {
    let mut p = pair(&Params::default());
    let free0 = p.b.ctx.arena_free();
    let buf =
        p.b.pd
            .alloc_mr(
                1 << 20,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            )
            .unwrap();
    let remote = buf.remote(0);
    p.b.qp
        .post_recv(&RecvWr::new(1, &[buf.sge(0, 64).unwrap()]))
        .unwrap();
    drop(buf);
    assert!(
        p.b.ctx.arena_free() < free0,
        "still held by the posted receive"
    );
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 8).unwrap()]))
        .unwrap();
    assert_eq!(wait_b(&mut p, 1)[0].status, WcStatus::Success);
    assert_eq!(p.b.ctx.arena_free(), free0, "freed after the last use");
    // Its R_Key is dead.
    p.a.qp
        .post_send(&SendWr::new(
            2,
            SendOp::RdmaWrite(remote),
            &[src.sge(0, 8).unwrap()],
        ))
        .unwrap();
    let wcs = wait_a(&mut p, 2);
    assert_eq!(wcs[1].status, WcStatus::RemAccessErr, "{wcs:?}");
}

#[test]
fn a_qp_with_128_deep_queues_costs_under_256_kib() {
    let ctx = context(8 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256).unwrap();
    // Generous capabilities, as a latency benchmark would use.
    let caps = QpCaps {
        max_send_wr: 128,
        max_recv_wr: 128,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 256,
    };
    let free0 = ctx.arena_free();
    let qp = ctx.create_qp(&pd, &cq, &cq, caps).unwrap();
    let bytes = qp.memory_bytes();
    let arena_used = free0 - ctx.arena_free();
    assert!(bytes < 256 * 1024, "a QP costs {bytes} bytes");
    assert!(
        arena_used as usize <= bytes,
        "arena staging {arena_used} is part of the count"
    );
    eprintln!(
        "QP footprint with 128-deep queues: {bytes} bytes ({arena_used} of them in the arena)"
    );
}
