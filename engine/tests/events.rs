//! Waiting for completions: completion channels, `Cq::req_notify` with the solicited-event
//! bit, and `Cq::wait`, in inline and poll mode.
mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::*;
use shmhca::*;

const LONG: Duration = Duration::from_secs(20);
/// How long a test waits for an event that must not come (generous: the engines run
/// meanwhile, so the completion itself arrives within microseconds).
const QUIET: Duration = Duration::from_millis(200);

fn backoff() -> IdlePolicy {
    IdlePolicy::Backoff {
        spins: 100,
        max_sleep: Duration::from_millis(100),
    }
}

fn inline() -> ContextBuilder {
    Context::builder().mode(EngineMode::Inline)
}

fn inline_backoff() -> ContextBuilder {
    inline().idle(backoff())
}

fn poll_backoff() -> ContextBuilder {
    Context::builder()
        .mode(EngineMode::Poll { cpu: None })
        .idle(backoff())
}

/// Posts `n` receives on B.
fn post_recvs(b: &mut End, n: usize) -> Mr {
    let dst =
        b.pd.alloc_mr(64 * n as u64, AccessFlags::LOCAL_WRITE)
            .unwrap();
    for i in 0..n {
        b.qp.post_recv(&RecvWr::new(
            100 + i as u64,
            &[dst.sge(64 * i as u64, 64).unwrap()],
        ))
        .unwrap();
    }
    dst
}

/// From another thread, after `delay`: A sends B `n` small messages with `flags` (besides
/// SIGNALED) and drives its engine until they complete. Returns A and the completions.
fn send_later(
    mut a: End,
    delay: Duration,
    n: usize,
    flags: SendFlags,
) -> std::thread::JoinHandle<(End, Vec<WorkCompletion>)> {
    std::thread::spawn(move || {
        std::thread::sleep(delay);
        let src = a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
        src.write_at(0, b"solicit!").unwrap();
        for i in 0..n {
            let sge = [src.sge(0, 8).unwrap()];
            let wr = SendWr::new(i as u64, SendOp::Send, &sge).flags(SendFlags::SIGNALED | flags);
            a.qp.post_send(&wr).unwrap();
        }
        let mut wcs = vec![];
        let start = Instant::now();
        while wcs.len() < n {
            wcs.extend(a.cq.poll_one());
            assert!(start.elapsed() < LONG, "the sends never completed");
        }
        (a, wcs)
    })
}

/// Polls B's CQ (driving B only) until `n` completions are there.
fn take(b: &mut End, n: usize) -> Vec<WorkCompletion> {
    let mut out = vec![];
    let start = Instant::now();
    while out.len() < n {
        out.extend(b.cq.poll_one());
        assert!(
            start.elapsed() < LONG,
            "only {} of {n} completions",
            out.len()
        );
    }
    out
}

fn one_event_per_arm(b_mode: ContextBuilder) {
    let (p, ch) = pair_built(inline(), b_mode, &Params::default(), true);
    let (_cha, mut ch) = ch.unwrap();
    let Pair { a, mut b } = p;
    let _dst = post_recvs(&mut b, 2);
    b.cq.req_notify(false).unwrap();
    assert_eq!(b.cq.poll_one(), None, "poll once more after arming");
    let sender = send_later(a, Duration::from_millis(50), 2, SendFlags::NONE);
    assert_eq!(ch.get_event(Some(LONG)).unwrap(), Some(b.cq.number()));
    let wcs = take(&mut b, 2);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    let (_a, sent) = sender.join().unwrap();
    assert!(sent.iter().all(|w| w.status == WcStatus::Success));
    // One-shot: the second completion raised no event, and neither does arming again
    // with nothing arriving.
    assert_eq!(ch.get_event(Some(QUIET)).unwrap(), None);
    b.cq.req_notify(false).unwrap();
    assert_eq!(ch.get_event(Some(QUIET)).unwrap(), None);
}

#[test]
fn an_armed_queue_raises_one_event_inline_backoff() {
    one_event_per_arm(inline_backoff());
}

#[test]
fn an_armed_queue_raises_one_event_inline_spin() {
    one_event_per_arm(inline());
}

#[test]
fn an_armed_queue_raises_one_event_poll_backoff() {
    one_event_per_arm(poll_backoff());
}

fn solicited_only(b_mode: ContextBuilder) {
    let (p, ch) = pair_built(inline(), b_mode, &Params::default(), true);
    let (_cha, mut ch) = ch.unwrap();
    let Pair { a, mut b } = p;
    let _dst = post_recvs(&mut b, 2);
    b.cq.req_notify(true).unwrap();
    // An unsolicited message arrives (its completion is in the CQ) but wakes nobody.
    let (a, sent) = send_later(a, Duration::ZERO, 1, SendFlags::NONE)
        .join()
        .unwrap();
    assert_eq!(sent[0].status, WcStatus::Success);
    assert_eq!(ch.get_event(Some(QUIET)).unwrap(), None);
    let wc = take(&mut b, 1)[0];
    assert!(!wc.solicited && wc.status == WcStatus::Success, "{wc:?}");
    // A solicited one does: the arm was still there.
    let sender = send_later(a, Duration::from_millis(50), 1, SendFlags::SOLICITED);
    assert_eq!(ch.get_event(Some(LONG)).unwrap(), Some(b.cq.number()));
    let wc = take(&mut b, 1)[0];
    assert!(wc.solicited && wc.status == WcStatus::Success, "{wc:?}");
    sender.join().unwrap();
}

#[test]
fn solicited_only_wakes_for_a_solicited_message_inline() {
    solicited_only(inline_backoff());
}

#[test]
fn solicited_only_wakes_for_a_solicited_message_poll() {
    solicited_only(poll_backoff());
}

/// An error completion notifies even a waiter who asked for solicited events only (as in
/// ibverbs). B is never driven by this test: its progress helper answers.
#[test]
fn an_error_completion_notifies_a_solicited_only_waiter() {
    let (p, ch) = pair_built(inline_backoff(), inline(), &Params::default(), true);
    let (mut ch, _chb) = ch.unwrap();
    let Pair { mut a, b } = p;
    let target =
        b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let src = a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    a.cq.req_notify(true).unwrap();
    let mut bad = target.remote(0);
    bad.rkey ^= 0x5a5a_5a00;
    let sge = [src.sge(0, 8).unwrap()];
    a.qp.post_send(&SendWr::new(1, SendOp::RdmaWrite(bad), &sge))
        .unwrap();
    assert_eq!(ch.get_event(Some(LONG)).unwrap(), Some(a.cq.number()));
    let wc = a.cq.poll_one().expect("the completion raised the event");
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
}

/// The application waits on the fd with poll(2), as an async runtime does, and calls
/// nothing in shmhca meanwhile: the engine thread (poll mode) or the progress helper
/// (inline mode) runs the engine and raises the event.
fn fd_becomes_readable(b_mode: ContextBuilder) {
    let (p, ch) = pair_built(inline(), b_mode, &Params::default(), true);
    let (_cha, mut ch) = ch.unwrap();
    let Pair { a, mut b } = p;
    let _dst = post_recvs(&mut b, 1);
    b.cq.req_notify(false).unwrap();
    let sender = send_later(a, Duration::from_millis(50), 1, SendFlags::NONE);
    let fd = ch.as_fd();
    let mut fds = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    let ts = rustix::event::Timespec {
        tv_sec: LONG.as_secs() as _,
        tv_nsec: 0,
    };
    let n = rustix::event::poll(&mut fds, Some(&ts)).unwrap();
    assert_eq!(n, 1, "the fd did not become readable");
    assert_eq!(ch.try_get_event().unwrap(), Some(b.cq.number()));
    assert_eq!(ch.try_get_event().unwrap(), None);
    assert_eq!(take(&mut b, 1)[0].status, WcStatus::Success);
    sender.join().unwrap();
}

#[test]
fn the_fd_becomes_readable_inline_backoff() {
    fd_becomes_readable(inline_backoff());
}

#[test]
fn the_fd_becomes_readable_inline_spin() {
    // Spin: nobody wakes the helper, which runs the engine every tick.
    fd_becomes_readable(inline());
}

#[test]
fn the_fd_becomes_readable_poll_backoff() {
    fd_becomes_readable(poll_backoff());
}

fn cq_wait(b_mode: ContextBuilder) {
    let (p, _) = pair_built(inline(), b_mode, &Params::default(), false);
    let Pair { a, mut b } = p;
    let _dst = post_recvs(&mut b, 1);
    assert!(
        !b.cq.wait(Duration::from_millis(20)).unwrap(),
        "nothing came"
    );
    let sender = send_later(a, Duration::from_millis(50), 1, SendFlags::NONE);
    assert!(b.cq.wait(LONG).unwrap());
    assert_eq!(b.cq.poll_one().unwrap().status, WcStatus::Success);
    sender.join().unwrap();
}

#[test]
fn cq_wait_returns_when_a_completion_arrives_inline_backoff() {
    cq_wait(inline_backoff());
}

#[test]
fn cq_wait_returns_when_a_completion_arrives_inline_spin() {
    cq_wait(inline());
}

#[test]
fn cq_wait_returns_when_a_completion_arrives_poll_backoff() {
    cq_wait(poll_backoff());
}

#[test]
fn cq_wait_returns_when_a_completion_arrives_poll_spin() {
    cq_wait(
        Context::builder()
            .mode(EngineMode::Poll { cpu: None })
            .idle(IdlePolicy::Spin),
    );
}

#[test]
fn misuse_is_refused_with_a_clear_error() {
    let ctx = inline().build().unwrap();
    let other = inline().build().unwrap();
    let mut cq = ctx.create_cq(4).unwrap();
    let e = cq.req_notify(false).unwrap_err().to_string();
    assert!(e.contains("create_cq_with_channel"), "{e}");
    let ch = ctx.create_comp_channel().unwrap();
    let mut on_channel = ctx.create_cq_with_channel(4, &ch).unwrap();
    let e = on_channel.wait(Duration::ZERO).unwrap_err().to_string();
    assert!(e.contains("CompChannel::get_event"), "{e}");
    assert!(matches!(
        other.create_cq_with_channel(4, &ch),
        Err(Error::ForeignObject { .. })
    ));
}

/// A program that waits on one completion channel for both its send and its receive queue
/// (perftest 4.5's `ib_send_lat -e`) gets the events in the order an HCA raises them: the
/// completion of its message before that of the peer's reply, although the reply carries
/// the Ack that completes the message (a riding Ack). It takes one completion per event,
/// and expects the event it waits for; served in the other order it waits for ever.
#[test]
fn a_shared_channel_gets_the_send_event_before_the_reply_that_acknowledged_it() {
    const N: u64 = 100;
    let p = Params::default();
    let build = |x: ContextBuilder| {
        x.arena_size(p.arena)
            .huge_pages(shmhca_rings::HugePages::Never)
            .build()
            .unwrap()
    };
    let (ca, cb) = (build(poll_backoff()), build(poll_backoff()));
    let (la, lb) = ca.link_with(&cb).unwrap();
    // A: the receive queue takes the channel's first slot, the send queue the second (an
    // order that a channel reporting by slot would get wrong).
    let mut ch = ca.create_comp_channel().unwrap();
    let pda = ca.alloc_pd().unwrap();
    let mut rcq = ca.create_cq_with_channel(64, &ch).unwrap();
    let mut scq = ca.create_cq_with_channel(64, &ch).unwrap();
    let mut qa = ca.create_qp(&pda, &scq, &rcq, p.caps).unwrap();
    let mut b = end(cb, lb, &p);
    let (na, nb) = (qa.qpn(), b.qp.qpn());
    connect(&mut qa, la, nb, p.psn_a, p.psn_b, &p);
    connect(&mut b.qp, lb, na, p.psn_b, p.psn_a, &p);
    let ma = pda.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..N {
        qa.post_recv(&RecvWr::new(i, &[ma.sge(0, 8).unwrap()]))
            .unwrap();
    }
    scq.req_notify(false).unwrap();
    rcq.req_notify(false).unwrap();
    // B pings, and pings again as soon as A's pong is in (its Ack of the pong riding in
    // the next ping).
    let peer = std::thread::spawn(move || {
        let mb = b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        for i in 0..N {
            b.qp.post_recv(&RecvWr::new(i, &[mb.sge(0, 8).unwrap()]))
                .unwrap();
        }
        let start = Instant::now();
        for i in 0..N {
            let sge = [mb.sge(8, 8).unwrap()];
            b.qp.post_send(&SendWr::new(i, SendOp::Send, &sge).flags(SendFlags::SIGNALED))
                .unwrap();
            let mut got = 0;
            while got < 2 {
                if let Some(w) = b.cq.poll_one() {
                    assert_eq!(w.status, WcStatus::Success, "{w:?}");
                    got += 1;
                }
                assert!(start.elapsed() < LONG, "B stalled at ping {i}");
            }
        }
        b
    });
    let mut wrong = vec![];
    // Out of order, an event may never come: the test then goes on without it.
    let mut next_event = |want: &Cq, what: &str, i: u64| {
        let got = ch.get_event(Some(Duration::from_secs(2))).unwrap();
        if got != Some(want.number()) {
            wrong.push(format!("{what} {i}: {got:?}"));
        }
        got
    };
    for i in 0..N {
        let q = next_event(&rcq, "receive", i);
        // As perftest does: re-arm the queue the event was for, then poll once.
        let which = if q == Some(scq.number()) {
            &mut scq
        } else {
            &mut rcq
        };
        which.req_notify(false).unwrap();
        if rcq.poll_one().is_none() {
            // Served out of order: take it anyway, to go on.
            let start = Instant::now();
            while rcq.poll_one().is_none() {
                assert!(start.elapsed() < LONG, "no receive {i}");
            }
        }
        let sge = [ma.sge(16, 8).unwrap()];
        qa.post_send(&SendWr::new(i, SendOp::Send, &sge).flags(SendFlags::SIGNALED))
            .unwrap();
        let q = next_event(&scq, "send", i);
        let which = if q == Some(rcq.number()) {
            &mut rcq
        } else {
            &mut scq
        };
        which.req_notify(false).unwrap();
        let start = Instant::now();
        while scq.poll_one().is_none() {
            assert!(start.elapsed() < LONG, "no send completion {i}");
        }
    }
    let _b = peer.join().unwrap();
    assert!(
        wrong.is_empty(),
        "{} of {N} events came for the other queue, first at: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
}
