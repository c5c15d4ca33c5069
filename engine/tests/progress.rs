//! Automatic progress: a live process answers its peers while its application computes.
//!
//! An RC requester runs a transport timer against its peer. In inline mode the engine runs
//! only inside the application's calls, so a receiver that computes without calling
//! shmhca would leave the sender's timer to expire (RetryExcErr) even though the message
//! was delivered — unless a helper drives the idle engine ([`Progress::Auto`], the default).
mod common;

use std::time::{Duration, Instant};

use common::*;
use shmhca::*;

/// The receiver's application is busy this long without calling shmhca.
const BUSY: Duration = Duration::from_millis(600);

/// A short transport timer (Local Ack Timeout 12: 16.8 ms; with Retry Count 7 the sender
/// gives up after about 8 expiries, well within `BUSY`).
fn params() -> Params {
    Params {
        timeout: 12,
        retry: 7,
        ..Params::default()
    }
}

/// A (inline mode) sends one message to B (built by `b`) whose application posts a receive
/// and then computes for [`BUSY`]. Returns the two completions.
fn send_to_a_busy_receiver(b: ContextBuilder) -> (WorkCompletion, WorkCompletion) {
    let p = params();
    let ca = context(p.arena);
    let cb = b
        .arena_size(p.arena)
        .huge_pages(shmhca_rings::HugePages::Never)
        .build()
        .unwrap();
    let Pair { mut a, mut b } = pair_of(ca, cb, &p);

    let dst = b.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    b.qp.post_recv(&RecvWr::new(2, &[dst.sge(0, 4096).unwrap()]))
        .unwrap();
    let sender = std::thread::spawn(move || {
        let src = a.pd.alloc_mr(4096, AccessFlags::NONE).unwrap();
        src.write_at(0, &pattern(1000, 9)).unwrap();
        a.qp.post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 1000).unwrap()]))
            .unwrap();
        let start = Instant::now();
        let wc = loop {
            if let Some(wc) = a.cq.poll_one() {
                break wc;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the send never completed"
            );
            std::thread::yield_now();
        };
        (wc, a, src)
    });
    // The receiver computes: no call into shmhca at all.
    std::thread::sleep(BUSY);
    let (wc_a, _a, _src) = sender.join().unwrap();
    let start = Instant::now();
    let wc_b = loop {
        if let Some(wc) = b.cq.poll_one() {
            break wc;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the receive never completed"
        );
    };
    if wc_b.status == WcStatus::Success {
        let mut got = vec![0u8; 1000];
        dst.read_at(0, &mut got).unwrap();
        assert_eq!(got, pattern(1000, 9));
    }
    (wc_a, wc_b)
}

#[test]
fn an_inline_receiver_busy_computing_still_acknowledges() {
    let (wc_a, wc_b) = send_to_a_busy_receiver(Context::builder().mode(EngineMode::Inline));
    assert_eq!(wc_b.status, WcStatus::Success, "{wc_b:?}");
    assert_eq!(
        wc_a.status,
        WcStatus::Success,
        "the receiver got the message, so the sender must not fail: {wc_a:?}"
    );
}

#[test]
fn an_inline_receiver_with_backoff_busy_computing_still_acknowledges() {
    let b = Context::builder()
        .mode(EngineMode::Inline)
        .idle(IdlePolicy::Backoff {
            spins: 100,
            max_sleep: Duration::from_secs(1),
        });
    let (wc_a, wc_b) = send_to_a_busy_receiver(b);
    assert_eq!(
        (wc_a.status, wc_b.status),
        (WcStatus::Success, WcStatus::Success)
    );
}

/// Poll mode needs no helper: with `Backoff` the engine thread sleeps (up to a second here,
/// far past the sender's timer) only while no QP has work in flight, and a peer's packet
/// wakes it.
#[test]
fn a_poll_mode_receiver_with_long_backoff_sleeps_still_acknowledges() {
    let b = Context::builder()
        .mode(EngineMode::Poll { cpu: None })
        .idle(IdlePolicy::Backoff {
            spins: 100,
            max_sleep: Duration::from_secs(1),
        });
    let (wc_a, wc_b) = send_to_a_busy_receiver(b);
    assert_eq!(
        (wc_a.status, wc_b.status),
        (WcStatus::Success, WcStatus::Success)
    );
}

/// With `Progress::Manual` nothing drives a busy inline receiver: the sender's timer
/// expires though the message was delivered (what `Progress::Auto` exists to prevent).
#[test]
fn with_manual_progress_a_busy_receiver_lets_the_senders_timer_expire() {
    let b = Context::builder()
        .mode(EngineMode::Inline)
        .progress(Progress::Manual);
    let (wc_a, wc_b) = send_to_a_busy_receiver(b);
    assert_eq!(wc_a.status, WcStatus::RetryExcErr, "{wc_a:?}");
    assert_eq!(wc_b.status, WcStatus::Success, "{wc_b:?}");
}
