//! The default idle policy (issue 24, item 9): a poll-mode engine built without
//! `ContextBuilder::idle` — what `Context::new()` makes on a machine with 4 cores or more —
//! spins a bounded while when it has nothing to do, then sleeps until a post or a peer's
//! packet wakes it, instead of burning its core forever.
//!
//! Measured with the engine's own counter of the times it went to sleep (`Stats::sleeps`),
//! not with CPU time, which a loaded machine would blur.
mod common;

use std::time::{Duration, Instant};

use common::*;
use shmhca::*;

/// A poll-mode context with every option but the idle policy given.
fn default_poll_ctx() -> Context {
    Context::builder()
        .arena_size(4 << 20)
        .huge_pages(shmhca_rings::HugePages::Never)
        .mode(EngineMode::Poll { cpu: None })
        .build()
        .unwrap()
}

/// Waits (at most 60 s: a debug build on a loaded 2-core machine) until `ctx`'s engine has
/// gone to sleep more than `before` times.
fn wait_for_sleep(ctx: &Context, before: u64, what: &str) -> u64 {
    let start = Instant::now();
    loop {
        let sleeps = ctx.stats().sleeps;
        if sleeps > before {
            return sleeps;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{what}: the engine never went to sleep in 60 s with nothing to do: {:?}",
            ctx.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn wait_cq(cq: &mut Cq, what: &str) -> WorkCompletion {
    let mut wc = [WorkCompletion::default()];
    let got = cq.poll_until(&mut wc, Duration::from_secs(20));
    assert_eq!(got, 1, "{what}: no completion in 20 s");
    assert_eq!(wc[0].status, WcStatus::Success, "{what}: {:?}", wc[0]);
    wc[0]
}

#[test]
fn the_default_idle_policy_backs_off() {
    assert!(
        matches!(IdlePolicy::default(), IdlePolicy::Backoff { .. }),
        "{:?}",
        IdlePolicy::default()
    );
}

#[test]
fn a_default_poll_engine_with_nothing_to_do_goes_to_sleep() {
    let ctx = default_poll_ctx();
    wait_for_sleep(&ctx, 0, "a context without QPs");
}

/// Two default poll-mode engines, linked and with a connected QP pair: after a message
/// they fall asleep; a post wakes the sender's engine, the peer's packet the receiver's,
/// and the message arrives; then they sleep again.
#[test]
fn default_poll_engines_sleep_between_messages_and_wake_for_them() {
    let (ca, cb) = (default_poll_ctx(), default_poll_ctx());
    let (la, lb) = ca.link_with(&cb).unwrap();
    let p = Params::default();
    let mut a = end(ca, la, &p);
    let mut b = end(cb, lb, &p);
    let (qa, qb) = (a.qp.qpn(), b.qp.qpn());
    connect(&mut a.qp, la, qb, 1, 2, &p);
    connect(&mut b.qp, lb, qa, 2, 1, &p);
    let sa = a.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let sb = b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let (mut slept_a, mut slept_b) = (0, 0);
    for round in 0..3u64 {
        slept_a = wait_for_sleep(&a.ctx, slept_a, "the sender");
        slept_b = wait_for_sleep(&b.ctx, slept_b, "the receiver");
        b.qp.post_recv(&RecvWr::new(round, &[sb.sge(0, 64).unwrap()]))
            .unwrap();
        sa.write_at(0, &round.to_le_bytes()).unwrap();
        a.qp.post_send(&SendWr::new(round, SendOp::Send, &[sa.sge(0, 8).unwrap()]))
            .unwrap();
        let rc = wait_cq(&mut b.cq, "the receive");
        assert_eq!((rc.wr_id, rc.byte_len), (round, 8));
        let mut got = [0u8; 8];
        sb.read_at(0, &mut got).unwrap();
        assert_eq!(u64::from_le_bytes(got), round);
        wait_cq(&mut a.cq, "the send");
    }
}
