//! Engine micro-benchmarks (criterion):
//!
//! * `poll_iteration/{0,1000}_idle_qps`: one empty poll of an engine serving 1 connected QP
//!   and 0 or 1,000 more idle ones — the poll loop's cost must not grow with idle QPs.
//! * `poll_iteration/armed_timer`: the same with the busy QP's transport timer armed (a
//!   request the peer never answers; Local Ack Timeout 31, so it never expires here): what
//!   an empty poll costs while a timer runs and its deadline is far.
//! * `send_round_trip/{0,1000}_idle_qps`: an 8-byte Send and its completion at the
//!   receiver, between two engines driven by this thread, with 0 or 1,000 idle QP pairs
//!   beside the busy one.
//!
//! `cargo bench -p shmhca-bench --bench engine`
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use shmhca::{
    AccessFlags, Context, Cq, Destination, EngineMode, LinkId, Mtu, Pd, Qp, QpAttr, QpCaps,
    QpState, RecvWr, SendFlags, SendOp, SendWr, WorkCompletion,
};

struct Side {
    ctx: Context,
    pd: Pd,
    cq: Cq,
    link: LinkId,
    qps: Vec<Qp>,
}

fn connect(qp: &mut Qp, link: LinkId, remote: shmhca::Qpn, timeout: u8) {
    qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::REMOTE_WRITE))
        .unwrap();
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(Mtu::Mtu4096)
            .dest(Destination { link, qpn: remote })
            .rq_psn(0)
            .max_dest_rd_atomic(1)
            .min_rnr_timer(1),
    )
    .unwrap();
    qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(0)
            .timeout(timeout)
            .retry_cnt(7)
            .rnr_retry(7)
            .max_rd_atomic(1),
    )
    .unwrap();
}

/// Two linked contexts with `1 + idle` connected QP pairs; QP 0 is the busy one.
fn setup(idle: usize) -> (Side, Side) {
    setup_with(idle, 14)
}

/// `setup` with the QPs' Local Ack Timeout.
fn setup_with(idle: usize, timeout: u8) -> (Side, Side) {
    let mk = || {
        Context::builder()
            .mode(EngineMode::Inline)
            .arena_size(64 << 20)
            .build()
            .unwrap()
    };
    let (ca, cb) = (mk(), mk());
    let (la, lb) = ca.link_with(&cb).unwrap();
    let side = |ctx: Context, link| {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(1024).unwrap();
        Side {
            ctx,
            pd,
            cq,
            link,
            qps: vec![],
        }
    };
    let (mut a, mut b) = (side(ca, la), side(cb, lb));
    let caps = QpCaps {
        max_send_wr: 128,
        max_recv_wr: 128,
        ..QpCaps::default()
    };
    for _ in 0..=idle {
        let mut qa = a.ctx.create_qp(&a.pd, &a.cq, &a.cq, caps).unwrap();
        let mut qb = b.ctx.create_qp(&b.pd, &b.cq, &b.cq, caps).unwrap();
        let (na, nb) = (qa.qpn(), qb.qpn());
        connect(&mut qa, a.link, nb, timeout);
        connect(&mut qb, b.link, na, timeout);
        a.qps.push(qa);
        b.qps.push(qb);
    }
    // Let every QP's set-up traffic (initial credit Acks) settle.
    for _ in 0..1000 {
        a.ctx.progress();
        b.ctx.progress();
    }
    (a, b)
}

fn bench(c: &mut Criterion) {
    let mut poll = c.benchmark_group("poll_iteration");
    for idle in [0usize, 1000] {
        let (a, _b) = setup(idle);
        poll.bench_function(format!("{idle}_idle_qps"), |bch| {
            bch.iter(|| black_box(a.ctx.progress()))
        });
    }
    {
        let (mut a, b) = setup_with(0, 31);
        let dst =
            b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
                .unwrap();
        let src = a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
        a.qps[0]
            .post_send(&SendWr::new(
                1,
                SendOp::RdmaWrite(dst.remote(0)),
                &[src.sge(0, 8).unwrap()],
            ))
            .unwrap();
        // B's engine is never driven again: the Write stays unacknowledged.
        poll.bench_function("armed_timer", |bch| {
            bch.iter(|| black_box(a.ctx.progress()))
        });
        assert!(a.ctx.next_timer().is_some(), "the timer ran throughout");
    }
    poll.finish();

    let mut rt = c.benchmark_group("send_round_trip");
    for idle in [0usize, 1000] {
        let (mut a, mut b) = setup(idle);
        let src = a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
        let dst = b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let sgl = [src.sge(0, 8).unwrap()];
        let rsgl = [dst.sge(0, 64).unwrap()];
        let mut wcs = [WorkCompletion::default(); 16];
        let mut i = 0u64;
        rt.bench_function(format!("{idle}_idle_qps"), |bch| {
            bch.iter(|| {
                b.qps[0].post_recv(&RecvWr::new(i, &rsgl)).unwrap();
                let flags = if i % 64 == 0 {
                    SendFlags::SIGNALED | SendFlags::INLINE
                } else {
                    SendFlags::INLINE
                };
                a.qps[0]
                    .post_send(&SendWr::new(i, SendOp::Send, &sgl).flags(flags))
                    .unwrap();
                i += 1;
                loop {
                    a.ctx.progress();
                    if b.cq.poll(&mut wcs) > 0 {
                        break;
                    }
                }
                while a.cq.poll(&mut wcs) > 0 {}
            })
        });
    }
    rt.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
