//! Queries: `Context::query_device` reports the limits the code enforces (going one past
//! each is refused, naming it), and `Qp::query` reports a QP's state, attributes and PSNs.
//!
//! Limits not exhausted here, because reaching them costs more than a test should (65,536
//! arenas, 2^23 regions, 4,096 link segments), are enforced from the same constants in
//! `shmhca::limits`.

mod common;

use std::time::Duration;

use common::{Params, pair};
use shmhca::{
    AccessFlags, AtomicCap, Context, Destination, EngineMode, Error, Mtu, QpAttr, QpCaps, QpState,
    RecvWr, SendOp, SendWr, WcStatus,
};
use shmhca_rings::{HugePages, PageSize};

fn ctx(arena: u64) -> Context {
    Context::builder()
        .mode(EngineMode::Inline)
        .huge_pages(HugePages::Never)
        .arena_size(arena)
        .build()
        .unwrap()
}

#[track_caller]
fn invalid<T: std::fmt::Debug>(r: Result<T, Error>, name: &str) {
    match r {
        Err(e @ Error::InvalidArgument { .. }) => {
            assert!(e.to_string().contains(name), "{e} does not name {name}")
        }
        other => panic!("expected InvalidArgument for {name}, got {other:?}"),
    }
}

#[test]
fn the_device_reports_its_configuration() {
    let c = ctx(8 << 20);
    let dev = c.query_device();
    assert_eq!(dev.arena_size, 8 << 20);
    assert_eq!(dev.page_size, PageSize::Base4K);
    assert_eq!(dev.link_slots, 1024);
    assert_eq!(dev.max_mtu, Mtu::Mtu4096);
    assert_eq!(dev.atomic_cap, AtomicCap::Global);
    assert_eq!(dev.max_msg_size, 1 << 31, "spec/05: messages up to 2 GiB");
    let pd = c.alloc_pd().unwrap();
    // A region is limited by the arena as well as by max_mr_size.
    assert!(matches!(
        pd.alloc_mr(dev.arena_size + 1, AccessFlags::NONE),
        Err(Error::ArenaExhausted { .. })
    ));
    let c = Context::builder()
        .mode(EngineMode::Inline)
        .link_slots(64)
        .arena_size(1 << 20)
        .build()
        .unwrap();
    assert_eq!(c.query_device().link_slots, 64);
}

#[test]
fn queue_and_request_sizes_are_enforced_at_the_queried_limits() {
    let c = ctx(8 << 20);
    let dev = c.query_device();
    let pd = c.alloc_pd().unwrap();

    // Completion queue depth.
    let cq = c.create_cq(dev.max_cqe).unwrap();
    invalid(c.create_cq(dev.max_cqe + 1), "completion queue depth");

    // QP capabilities.
    let small = QpCaps {
        max_send_wr: 1,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let at = |f: fn(&mut QpCaps, u32), v| {
        let mut caps = small;
        f(&mut caps, v);
        c.create_qp(&pd, &cq, &cq, caps)
    };
    type Set = fn(&mut QpCaps, u32);
    let fields: [(&str, Set, u32); 5] = [
        ("max_send_wr", |c, v| c.max_send_wr = v, dev.max_qp_wr),
        ("max_recv_wr", |c, v| c.max_recv_wr = v, dev.max_qp_wr),
        ("max_send_sge", |c, v| c.max_send_sge = v, dev.max_sge),
        ("max_recv_sge", |c, v| c.max_recv_sge = v, dev.max_sge),
        (
            "max_inline_data",
            |c, v| c.max_inline_data = v,
            dev.max_inline_data,
        ),
    ];
    for (name, set, max) in fields {
        let qp = at(set, max).unwrap_or_else(|e| panic!("{name} = {max}: {e}"));
        assert_eq!(qp.query().caps, {
            let mut caps = small;
            set(&mut caps, max);
            caps
        });
        drop(qp);
        invalid(at(set, max + 1), name);
    }

    // Memory region size.
    invalid(
        pd.alloc_mr(dev.max_mr_size + 1, AccessFlags::NONE),
        "memory region length",
    );

    // Initiator depth and responder resources.
    let mut qp = c.create_qp(&pd, &cq, &cq, small).unwrap();
    qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::NONE))
        .unwrap();
    let (link, qpn) = (c.link_with(&c).unwrap().0, qp.qpn());
    let rtr = |n: u8| {
        QpAttr::new(QpState::Rtr)
            .path_mtu(Mtu::Mtu1024)
            .dest(Destination { link, qpn })
            .rq_psn(0)
            .max_dest_rd_atomic(n)
            .min_rnr_timer(1)
    };
    invalid(
        qp.modify(&rtr(dev.max_qp_rd_atom + 1)),
        "max_dest_rd_atomic",
    );
    qp.modify(&rtr(dev.max_qp_rd_atom)).unwrap();
    let rts = |n: u8| {
        QpAttr::new(QpState::Rts)
            .sq_psn(0)
            .timeout(14)
            .retry_cnt(7)
            .rnr_retry(7)
            .max_rd_atomic(n)
    };
    invalid(
        qp.modify(&rts(dev.max_qp_init_rd_atom + 1)),
        "max_rd_atomic",
    );
    qp.modify(&rts(dev.max_qp_init_rd_atom)).unwrap();

    // Link slots.
    let slots = |n| {
        Context::builder()
            .mode(EngineMode::Inline)
            .arena_size(1 << 20)
            .link_slots(n)
            .build()
    };
    slots(dev.max_link_slots).unwrap();
    invalid(slots(dev.max_link_slots * 2), "link_slots");
    // Lines: the longest packet (a gather list of 16 ranges) takes 7.
    slots(8).unwrap();
    invalid(slots(4), "link_slots");
}

#[test]
fn a_message_one_byte_over_the_queried_maximum_is_refused() {
    let p = Params {
        mtu: Mtu::Mtu4096,
        caps: QpCaps {
            max_send_sge: 16,
            ..QpCaps::default()
        },
        arena: 256 << 20,
        ..Params::default()
    };
    let mut p = pair(&p);
    let dev = p.a.ctx.query_device();
    assert_eq!(u64::from(dev.max_sge), 16);
    // Sixteen elements over one region: 16 × 128 MiB is the maximum exactly; one more
    // byte in the last element is one too many. B's engine is never driven (nothing is
    // read: payloads travel by reference).
    let per = u32::try_from(dev.max_msg_size / 16).unwrap();
    let mr =
        p.a.pd
            .alloc_mr(u64::from(per) + 1, AccessFlags::NONE)
            .unwrap();
    let mut sgl: Vec<_> = (0..16).map(|_| mr.sge(0, per).unwrap()).collect();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &sgl))
        .unwrap();
    sgl[15] = mr.sge(0, per + 1).unwrap();
    invalid(
        p.a.qp.post_send(&SendWr::new(2, SendOp::Send, &sgl)),
        "message length",
    );
}

#[test]
fn the_queried_number_of_qps_and_cqs_is_what_a_context_holds() {
    let c = ctx(1 << 20);
    let dev = c.query_device();
    let pd = c.alloc_pd().unwrap();
    let mut cqs = Vec::with_capacity(dev.max_cq as usize);
    for _ in 0..dev.max_cq {
        cqs.push(c.create_cq(1).unwrap());
    }
    match c.create_cq(1) {
        Err(Error::LimitReached { limit, .. }) => assert_eq!(limit, dev.max_cq),
        other => panic!("expected LimitReached, got {other:?}"),
    }
    cqs.truncate(1);
    let caps = QpCaps {
        max_send_wr: 1,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let mut qps = Vec::with_capacity(dev.max_qp as usize);
    for _ in 0..dev.max_qp {
        qps.push(c.create_qp(&pd, &cqs[0], &cqs[0], caps).unwrap());
    }
    match c.create_qp(&pd, &cqs[0], &cqs[0], caps) {
        Err(Error::LimitReached { what, limit }) => {
            assert!(what.contains("queue pairs"), "{what}");
            assert_eq!(limit, dev.max_qp);
        }
        other => panic!("expected LimitReached, got {other:?}"),
    }
}

#[test]
fn a_qp_reports_its_state_attributes_and_psns() {
    let params = Params::default();
    let mut p = pair(&params);
    let a = p.a.qp.query();
    assert_eq!(a.qpn, p.a.qp.qpn());
    assert_eq!(a.state, QpState::Rts);
    assert_eq!(a.caps, params.caps);
    let cfg = a.config;
    assert_eq!(cfg.access, params.access);
    assert_eq!(cfg.path_mtu, params.mtu);
    assert_eq!(
        cfg.dest,
        Some(Destination {
            link: p.a.link,
            qpn: p.b.qp.qpn()
        })
    );
    assert_eq!(cfg.sq_psn.get(), params.psn_a);
    assert_eq!(cfg.rq_psn.get(), params.psn_b);
    assert_eq!(
        (cfg.timeout, cfg.retry_cnt, cfg.rnr_retry, cfg.min_rnr_timer),
        (
            params.timeout,
            params.retry,
            params.rnr_retry,
            params.min_rnr_timer
        )
    );
    assert_eq!(
        (cfg.max_rd_atomic, cfg.max_dest_rd_atomic),
        (params.rd_atomic, params.rd_atomic)
    );
    assert_eq!(a.next_send_psn, params.psn_a);
    assert_eq!(a.expected_psn, params.psn_b);
    // 4.096 µs × 2^14.
    assert_eq!(a.transport_timeout, Some(Duration::from_nanos(4096 << 14)));

    // A 3000-byte Send is three packets at a 1024-byte MTU: both ends' PSNs move by 3.
    let src = p.a.pd.alloc_mr(3000, AccessFlags::NONE).unwrap();
    let dst = p.b.pd.alloc_mr(3000, AccessFlags::LOCAL_WRITE).unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(1, &[dst.sge(0, 3000).unwrap()]))
        .unwrap();
    p.a.qp
        .post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 3000).unwrap()]))
        .unwrap();
    assert_eq!(common::wait_b(&mut p, 1)[0].status, WcStatus::Success);
    assert_eq!(common::wait_a(&mut p, 1)[0].status, WcStatus::Success);
    assert_eq!(p.a.qp.query().next_send_psn, params.psn_a + 3);
    assert_eq!(p.b.qp.query().expected_psn, params.psn_a + 3);
    assert_eq!(
        p.b.qp.query().next_send_psn,
        params.psn_b,
        "B sent no request"
    );

    // State changes show.
    p.a.qp.modify(&QpAttr::new(QpState::Error)).unwrap();
    assert_eq!(p.a.qp.query().state, QpState::Error);
    let fresh =
        p.a.ctx
            .create_qp(&p.a.pd, &p.a.cq, &p.a.cq, QpCaps::default());
    let q = fresh.unwrap().query();
    assert_eq!(q.state, QpState::Reset);
    assert_eq!(q.transport_timeout, None, "no timer before RTS");
}
