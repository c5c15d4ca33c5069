//! Asynchronous events (`ibv_get_async_event`): the SRQ limit, the first request of a QP in
//! RTR (communication established), the last WQE of a QP on an SRQ that entered the Error
//! state; each raised once, taken once, and the event fd readable exactly while events wait.
mod common;

use std::time::Duration;

use common::*;
use shmhca::*;

const SHORT: Option<Duration> = Some(Duration::from_millis(5));

/// Whether `fd` is readable now.
fn readable(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    let mut fds = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    let zero = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    rustix::event::poll(&mut fds, Some(&zero)).is_ok_and(|n| n > 0)
}

/// A (RTS) and B linked, B's QP taking its receives from an SRQ of depth 16.
struct SrqPair {
    pair: Pair,
    srq: Srq,
}

fn srq_pair() -> SrqPair {
    let p = Params::default();
    let (ca, cb) = (context(p.arena), context(p.arena));
    let (la, lb) = ca.link_with(&cb).unwrap();
    let mut a = end(ca, la, &p);
    let mut b = end(cb, lb, &p);
    let srq = b.pd.create_srq(16, 1).unwrap();
    b.qp = b
        .ctx
        .create_qp_with_srq(&b.pd, &b.cq, &b.cq, &srq, p.caps)
        .unwrap();
    let (qa, qb) = (a.qp.qpn(), b.qp.qpn());
    connect(&mut b.qp, lb, qa, p.psn_b, p.psn_a, &p);
    a.qp.modify(&QpAttr::new(QpState::Init).access(p.access))
        .unwrap();
    a.qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(p.mtu)
            .dest(Destination { link: la, qpn: qb })
            .rq_psn(p.psn_b)
            .max_dest_rd_atomic(p.rd_atomic)
            .min_rnr_timer(1)
            .remote_credits(false),
    )
    .unwrap();
    a.qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(p.psn_a)
            .timeout(14)
            .retry_cnt(7)
            .rnr_retry(7)
            .max_rd_atomic(p.rd_atomic),
    )
    .unwrap();
    SrqPair {
        pair: Pair { a, b },
        srq,
    }
}

/// A at RTS, B left at RTR (it receives, sends nothing).
fn rtr_pair() -> Pair {
    let p = Params::default();
    let (ca, cb) = (context(p.arena), context(p.arena));
    let (la, lb) = ca.link_with(&cb).unwrap();
    let mut a = end(ca, la, &p);
    let mut b = end(cb, lb, &p);
    let (qa, qb) = (a.qp.qpn(), b.qp.qpn());
    connect(&mut a.qp, la, qb, p.psn_a, p.psn_b, &p);
    b.qp.modify(&QpAttr::new(QpState::Init).access(p.access))
        .unwrap();
    b.qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(p.mtu)
            .dest(Destination { link: lb, qpn: qa })
            .rq_psn(p.psn_a)
            .max_dest_rd_atomic(p.rd_atomic)
            .min_rnr_timer(1),
    )
    .unwrap();
    pair_of_ends(a, b)
}

fn pair_of_ends(a: End, b: End) -> Pair {
    Pair { a, b }
}

/// Sends 8 bytes from A to B and waits for both completions.
fn send_a_to_b(pair: &mut Pair, src: &Mr, id: u64) {
    pair.a
        .qp
        .post_send(&SendWr::new(id, SendOp::Send, &[src.sge(0, 8).unwrap()]))
        .unwrap();
    let wc = wait_b(pair, 1);
    assert_eq!(wc[0].status, WcStatus::Success);
    let wc = wait_a(pair, 1);
    assert_eq!(wc[0].status, WcStatus::Success);
}

#[test]
fn the_srq_limit_raises_one_event_naming_the_srq() {
    let mut f = srq_pair();
    let rbuf = f
        .pair
        .b
        .pd
        .alloc_mr(8 * 64, AccessFlags::LOCAL_WRITE)
        .unwrap();
    for i in 0..6u64 {
        f.srq
            .post_recv(&RecvWr::new(i, &[rbuf.sge(i * 64, 64).unwrap()]))
            .unwrap();
    }
    let src = f.pair.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    let b = &f.pair.b.ctx;
    assert!(!readable(b.async_event_fd()));
    f.srq.arm_limit(4);
    // 6 → 4 left: not fewer than 4.
    for id in 0..2 {
        send_a_to_b(&mut f.pair, &src, id);
    }
    assert_eq!(f.pair.b.ctx.get_async_event(SHORT).unwrap(), None);
    // 3 left: the event, once.
    send_a_to_b(&mut f.pair, &src, 2);
    let b = &f.pair.b.ctx;
    assert!(readable(b.async_event_fd()), "readable while it waits");
    assert_eq!(
        b.get_async_event(SHORT).unwrap(),
        Some(AsyncEvent::SrqLimitReached {
            srq: f.srq.number()
        })
    );
    assert!(!readable(b.async_event_fd()), "not once taken");
    assert_eq!(b.try_get_async_event(), None);
    // The polled flag still works beside it.
    assert!(f.srq.limit_reached());
    // Disarmed by firing.
    send_a_to_b(&mut f.pair, &src, 3);
    assert_eq!(f.pair.b.ctx.try_get_async_event(), None);
    // An event of an SRQ destroyed before it is read is dropped with it: its number may
    // soon name another SRQ, which must not get it.
    f.srq.arm_limit(8);
    send_a_to_b(&mut f.pair, &src, 4);
    assert!(readable(f.pair.b.ctx.async_event_fd()));
    let SrqPair { pair, srq } = f;
    drop(srq);
    assert_eq!(pair.b.ctx.try_get_async_event(), None);
    assert!(
        !readable(pair.b.ctx.async_event_fd()),
        "its count went with it"
    );
}

#[test]
fn the_first_request_in_rtr_raises_comm_established_once() {
    let mut pair = rtr_pair();
    let rbuf = pair
        .b
        .pd
        .alloc_mr(8 * 64, AccessFlags::LOCAL_WRITE)
        .unwrap();
    for i in 0..4u64 {
        pair.b
            .qp
            .post_recv(&RecvWr::new(i, &[rbuf.sge(i * 64, 64).unwrap()]))
            .unwrap();
    }
    let src = pair.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    assert_eq!(pair.b.ctx.try_get_async_event(), None);
    send_a_to_b(&mut pair, &src, 1);
    let qpn = pair.b.qp.qpn();
    assert_eq!(
        pair.b.ctx.get_async_event(SHORT).unwrap(),
        Some(AsyncEvent::CommEstablished { qpn })
    );
    // Once per entry into RTR.
    send_a_to_b(&mut pair, &src, 2);
    assert_eq!(pair.b.ctx.get_async_event(SHORT).unwrap(), None);
    // At RTS: none either.
    pair.b
        .qp
        .modify(
            &QpAttr::new(QpState::Rts)
                .sq_psn(Params::default().psn_b)
                .timeout(14)
                .retry_cnt(7)
                .rnr_retry(7)
                .max_rd_atomic(4),
        )
        .unwrap();
    send_a_to_b(&mut pair, &src, 3);
    assert_eq!(pair.b.ctx.try_get_async_event(), None);
    // The sender raised nothing.
    assert_eq!(pair.a.ctx.try_get_async_event(), None);
}

#[test]
fn qps_that_reach_rts_before_any_request_raise_no_event() {
    let mut pair = pair(&Params::default());
    let rbuf = pair.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    pair.b
        .qp
        .post_recv(&RecvWr::new(1, &[rbuf.sge(0, 64).unwrap()]))
        .unwrap();
    let src = pair.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    send_a_to_b(&mut pair, &src, 1);
    assert_eq!(pair.a.ctx.try_get_async_event(), None);
    assert_eq!(pair.b.ctx.try_get_async_event(), None);
}

#[test]
fn a_qp_on_an_srq_entering_error_raises_last_wqe_reached_once_per_entry() {
    let mut f = srq_pair();
    let qpn = f.pair.b.qp.qpn();
    let b = &f.pair.b.ctx;
    f.pair.b.qp.modify(&QpAttr::new(QpState::Error)).unwrap();
    assert_eq!(
        b.get_async_event(SHORT).unwrap(),
        Some(AsyncEvent::QpLastWqeReached { qpn })
    );
    assert_eq!(b.get_async_event(SHORT).unwrap(), None);
    // Again after Reset.
    f.pair.b.qp.modify(&QpAttr::new(QpState::Reset)).unwrap();
    f.pair
        .b
        .qp
        .modify(&QpAttr::new(QpState::Init).access(AccessFlags::REMOTE_WRITE))
        .unwrap();
    assert_eq!(f.pair.b.ctx.try_get_async_event(), None);
    f.pair.b.qp.modify(&QpAttr::new(QpState::Error)).unwrap();
    assert_eq!(
        f.pair.b.ctx.try_get_async_event(),
        Some(AsyncEvent::QpLastWqeReached { qpn })
    );
    // A's QP (no SRQ) going to Error raises nothing.
    f.pair.a.qp.modify(&QpAttr::new(QpState::Error)).unwrap();
    assert_eq!(f.pair.a.ctx.try_get_async_event(), None);
}

#[test]
fn a_blocked_waiter_drives_the_engine_and_gets_the_event() {
    let mut pair = rtr_pair();
    let rbuf = pair.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    pair.b
        .qp
        .post_recv(&RecvWr::new(1, &[rbuf.sge(0, 64).unwrap()]))
        .unwrap();
    let src = pair.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    let qpn = pair.b.qp.qpn();
    let b = &pair.b.ctx;
    std::thread::scope(|s| {
        // B's engine runs only in the waiter (a manual-progress inline context).
        let waiter = s.spawn(|| b.get_async_event(Some(Duration::from_secs(20))));
        pair.a
            .qp
            .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 8).unwrap()]))
            .unwrap();
        while !waiter.is_finished() {
            pair.a.ctx.progress();
            std::thread::yield_now();
        }
        assert_eq!(
            waiter.join().unwrap().unwrap(),
            Some(AsyncEvent::CommEstablished { qpn })
        );
    });
}
