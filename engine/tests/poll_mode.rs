//! Engines on their own threads (poll mode): spinning, and sleeping until woken.
mod common;

use std::time::Duration;

use common::*;
use shmhca::*;

fn poll_ctx(idle: IdlePolicy) -> Context {
    Context::builder()
        .arena_size(4 << 20)
        .huge_pages(shmhca_rings::HugePages::Never)
        .mode(EngineMode::Poll { cpu: None })
        .idle(idle)
        .build()
        .unwrap()
}

fn wait_cq(cq: &mut Cq, n: usize, what: &str, a: &Context, b: &Context) -> Vec<WorkCompletion> {
    let mut out = vec![WorkCompletion::default(); n];
    let got = cq.poll_until(&mut out, Duration::from_secs(20));
    assert_eq!(
        got,
        n,
        "{what}: only {got} completions: {:?}\nA: {:?}\nB: {:?}",
        &out[..got],
        a.stats(),
        b.stats()
    );
    out
}

fn ping_pong(idle: IdlePolicy, pause: Duration) -> (Stats, Stats) {
    let ca = poll_ctx(idle);
    let cb = poll_ctx(idle);
    let (la, lb) = ca.link_with(&cb).unwrap();
    let p = Params::default();
    let mut a = end(ca, la, &p);
    let mut b = end(cb, lb, &p);
    let (qa, qb) = (a.qp.qpn(), b.qp.qpn());
    connect(&mut a.qp, la, qb, 1, 2, &p);
    connect(&mut b.qp, lb, qa, 2, 1, &p);
    let sa = a.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let sb = b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    for round in 0..20u64 {
        // Let the engines go idle (and, with a backoff policy, fall asleep).
        std::thread::sleep(pause);
        b.qp.post_recv(&RecvWr::new(round, &[sb.sge(0, 64).unwrap()]))
            .unwrap();
        sa.write_at(0, &round.to_le_bytes()).unwrap();
        a.qp.post_send(&SendWr::new(round, SendOp::Send, &[sa.sge(0, 8).unwrap()]))
            .unwrap();
        let rc = wait_cq(
            &mut b.cq,
            1,
            &format!("round {round}: the receive"),
            &a.ctx,
            &b.ctx,
        )[0];
        assert_eq!(
            (rc.status, rc.wr_id, rc.byte_len),
            (WcStatus::Success, round, 8)
        );
        let mut got = [0u8; 8];
        sb.read_at(0, &mut got).unwrap();
        assert_eq!(u64::from_le_bytes(got), round);
        assert_eq!(
            wait_cq(
                &mut a.cq,
                1,
                &format!("round {round}: the send"),
                &a.ctx,
                &b.ctx
            )[0]
            .status,
            WcStatus::Success
        );
    }
    (a.ctx.stats(), b.ctx.stats())
}

#[test]
fn spinning_engine_threads_carry_traffic() {
    ping_pong(IdlePolicy::Spin, Duration::ZERO);
}

#[test]
fn sleeping_engines_are_woken_by_posts_and_by_peer_packets() {
    // Sleeps of up to a minute: a lost wake-up leaves a completion missing past the 20 s
    // of `wait_cq`, and the test fails.
    let idle = IdlePolicy::Backoff {
        spins: 1000,
        max_sleep: Duration::from_secs(60),
    };
    let (sa, sb) = ping_pong(idle, Duration::from_millis(20));
    assert!(
        sa.sleeps > 0 && sb.sleeps > 0,
        "the engines never slept: {sa:?} {sb:?}"
    );
}
