//! An application that waits on a completion channel's fd itself (an async runtime's
//! `AsyncFd`), with an inline engine that does not sleep (`IdlePolicy::Spin`, the
//! default): a peer's Send must wake it through the kick words, not at the progress
//! helper's next tick. Not timed: what is checked is the mechanism — the helper sleeps on
//! the kick words (the sleeper count shows it), the peer's engine learns that it must
//! wake this one, and the fd becomes readable after the post.
//!
//! Before the fix the helper of a `Spin` engine only ever slept its tick on its own word
//! (the sleeper count stayed 0) and peers never woke it: the event was raised 0.1 to
//! 5 ms late (50 ms with no connected QP), which is what issue 24 measured.

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::*;
use shmhca_rings::segment::HugePages;

/// An inline context with no progress helper: its engine runs only when this thread
/// drives it (the peer of the contexts whose helpers are tested here).
fn manual_context() -> Context {
    Context::builder()
        .mode(EngineMode::Inline)
        .progress(Progress::Manual)
        .huge_pages(HugePages::Never)
        .arena_size(1 << 20)
        .build()
        .unwrap()
}

fn context() -> Context {
    Context::builder()
        .mode(EngineMode::Inline)
        .idle(IdlePolicy::Spin)
        .progress(Progress::Auto)
        .huge_pages(HugePages::Never)
        .arena_size(1 << 20)
        .build()
        .unwrap()
}

fn connect(qp: &mut Qp, link: LinkId, remote: Qpn) {
    connect_with(qp, link, remote, AccessFlags::NONE);
}

fn connect_with(qp: &mut Qp, link: LinkId, remote: Qpn, access: AccessFlags) {
    qp.modify(&QpAttr::new(QpState::Init).access(access))
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
            .timeout(14)
            .retry_cnt(7)
            .rnr_retry(7)
            .max_rd_atomic(1),
    )
    .unwrap();
}

/// Waits (bounded) until the channel's `fd` is readable; the application does not drive
/// the engine meanwhile.
fn until_readable(fd: &std::os::fd::OwnedFd) {
    until("the channel's fd never became readable", || {
        let mut p = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
        let ts = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 1_000_000,
        };
        rustix::event::poll(&mut p, Some(&ts)).unwrap_or(0) > 0
    });
}

/// Waits (bounded) until `a`'s progress helper sleeps on the kick words (its application
/// took the fd and armed a queue), then runs peer `b` until its link `link_b` wakes `a`: a
/// link set up before `a` took the fd learns that `a` may sleep at `b`'s next stats
/// publication (one iteration in PUBLISH_EVERY), and from then on wakes `a` after
/// publishing to it.
fn helper_asleep_and_woken_by(a: &Context, b: &Context, link_b: LinkId) {
    until(
        "the progress helper never slept on the kick words (sleeper count stayed 0)",
        || a.shared.sleepers().load(Ordering::Relaxed) > 0,
    );
    for _ in 0..=crate::stats_area::PUBLISH_EVERY {
        b.progress();
    }
    let wakes = b
        .shared
        .engine
        .with(|e| e.link_mut(link_b).map(|l| l.wakes_peer()));
    assert_eq!(wakes, Some(true), "the peer engine does not wake this one");
}

/// Waits (bounded) until `f` holds; panics with `what` if it never does.
fn until(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < end, "{what}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn a_peer_send_wakes_the_helper_of_a_spinning_inline_engine_whose_channel_fd_was_taken() {
    peer_send_wakes_the_sleeping_helper(context(), 64, false);
}

/// As above, with the peer's Send written straight into the link's ring by its post
/// (issue 27's direct post: 8 bytes, on an idle QP; the peer's engine run only by this
/// thread, so that the post surely runs it): the post wakes this engine all the same.
#[test]
fn a_peer_direct_post_wakes_the_helper_of_a_spinning_inline_engine_whose_channel_fd_was_taken() {
    let b = manual_context();
    peer_send_wakes_the_sleeping_helper(b, 8, true);
}

/// A context whose application took its completion channel's fd (as `AsyncFd::new` does)
/// and armed its receive CQ, its progress helper asleep on the kick words; peer `b` posts
/// a Send of `len` bytes (`direct`: one that must go straight into the link's ring, and
/// bump the kick word the helper sleeps on): the fd becomes readable and the completion
/// is there, without the application driving its engine.
fn peer_send_wakes_the_sleeping_helper(b: Context, len: u32, direct: bool) {
    let a = context();
    let (link_a, link_b) = a.link_with(&b).unwrap();
    let (pd_a, pd_b) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
    let mut channel = a.create_comp_channel().unwrap();
    let mut rcq = a.create_cq_with_channel(16, &channel).unwrap();
    let scq_a = a.create_cq(16).unwrap();
    let mut cq_b = b.create_cq(16).unwrap();
    let mut qa = a.create_qp(&pd_a, &scq_a, &rcq, QpCaps::default()).unwrap();
    let mut qb = b.create_qp(&pd_b, &cq_b, &cq_b, QpCaps::default()).unwrap();
    let (na, nb) = (qa.qpn(), qb.qpn());
    connect(&mut qa, link_a, nb);
    connect(&mut qb, link_b, na);
    let dst = pd_a.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let src = pd_b.alloc_mr(4096, AccessFlags::NONE).unwrap();
    qa.post_recv(&RecvWr::new(1, &[dst.sge(0, 64).unwrap()]))
        .unwrap();

    // The application takes the fd (as `AsyncFd::new` does) and arms the queue.
    let fd = channel.as_fd().try_clone_to_owned().unwrap();
    rcq.req_notify(false).unwrap();
    // Its progress helper now sleeps on the kick words, where peers can wake it.
    helper_asleep_and_woken_by(&a, &b, link_b);
    let taken_direct = || crate::probe::taken(crate::probe::Path::DirectPost);
    let kicks = || {
        b.shared
            .engine
            .with(|e| e.link_mut(link_b).map(|l| l.kicks()))
    };
    if direct {
        until("the progress helper stopped sleeping", || {
            a.shared.sleepers().load(Ordering::Relaxed) > 0
        });
    }
    let (before, kicked) = (taken_direct(), kicks());
    qb.post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, len).unwrap()]))
        .unwrap();
    if direct {
        assert_eq!(
            taken_direct(),
            before + 1,
            "the Send went straight into the ring"
        );
        // The post bumped the kick word the sleeping helper waits on (it slept before the
        // post, so the post's look for sleepers found it).
        assert_ne!(kicks(), kicked, "the post did not wake the sleeping engine");
    }
    // The fd becomes readable (bounded; the application does not drive the engine).
    until_readable(&fd);
    assert_eq!(
        channel.get_event(Some(Duration::from_secs(10))).unwrap(),
        Some(rcq.number())
    );
    let mut wc = [WorkCompletion::default(); 2];
    assert_eq!(rcq.poll(&mut wc), 1);
    assert_eq!((wc[0].status, wc[0].byte_len), (WcStatus::Success, len));
    // B's Send completes (A's helper Acks it): nothing more to check there.
    let _ = cq_b.poll(&mut wc);
}

#[test]
fn a_link_set_up_after_the_fd_was_taken_wakes_the_engine_from_the_start() {
    let (a, b, c) = (context(), context(), context());
    // Before: a Spin engine's peers never wake it.
    let (_, link_b) = a.link_with(&b).unwrap();
    let wakes = |ctx: &Context, link| {
        ctx.shared
            .engine
            .with(|e| e.link_mut(link).map(|l| l.wakes_peer()))
    };
    assert_eq!(wakes(&b, link_b), Some(false));
    let channel = a.create_comp_channel().unwrap();
    let _fd = channel.as_fd().try_clone_to_owned().unwrap();
    // A link made now reads the announcement at setup.
    let (_, link_c) = a.link_with(&c).unwrap();
    assert_eq!(wakes(&c, link_c), Some(true));
    // Engines that do not wait on an fd are still not woken by their peers.
    let (c_to_b, b_to_c) = c.link_with(&b).unwrap();
    assert_eq!(
        (wakes(&c, c_to_b), wakes(&b, b_to_c)),
        (Some(false), Some(false))
    );
}

/// A Read answered on the peer's fast path, its response queued in the link's batch and
/// published with the iteration's burst (not written straight into the ring: review 9),
/// wakes this context's progress helper asleep on the kick words, and the fd becomes
/// readable with the Read's completion and bytes there.
#[test]
fn a_read_answered_on_the_fast_path_wakes_the_sleeping_helper() {
    let a = context();
    let b = manual_context();
    let (link_a, link_b) = a.link_with(&b).unwrap();
    let (pd_a, pd_b) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
    let mut channel = a.create_comp_channel().unwrap();
    let mut scq = a.create_cq_with_channel(16, &channel).unwrap();
    let rcq_a = a.create_cq(16).unwrap();
    let cq_b = b.create_cq(16).unwrap();
    let mut qa = a.create_qp(&pd_a, &scq, &rcq_a, QpCaps::default()).unwrap();
    let mut qb = b.create_qp(&pd_b, &cq_b, &cq_b, QpCaps::default()).unwrap();
    let (na, nb) = (qa.qpn(), qb.qpn());
    connect(&mut qa, link_a, nb);
    connect_with(&mut qb, link_b, na, AccessFlags::REMOTE_READ);
    let dst = pd_a.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let src = pd_b.alloc_mr(4096, AccessFlags::REMOTE_READ).unwrap();
    src.write_at(40, b"straight").unwrap();

    let fd = channel.as_fd().try_clone_to_owned().unwrap();
    scq.req_notify(false).unwrap();
    helper_asleep_and_woken_by(&a, &b, link_b);
    let taken_direct = || crate::probe::taken(crate::probe::Path::DirectPost);
    let taken_fast = || crate::probe::taken(crate::probe::Path::Read);
    let kicks = || {
        b.shared
            .engine
            .with(|e| e.link_mut(link_b).map(|l| l.kicks()))
    };
    let into = [dst.sge(0, 8).unwrap()];
    qa.post_send(&SendWr::new(1, SendOp::RdmaRead(src.remote(40)), &into))
        .unwrap();
    until("the helper stopped sleeping", || {
        a.shared.sleepers().load(Ordering::Relaxed) > 0
    });
    // B's engine, run only here, answers the Read on its fast path, staged.
    let (before, direct, kicked) = (taken_fast(), taken_direct(), kicks());
    until("the peer never answered the Read", || {
        b.progress();
        taken_fast() > before
    });
    assert_eq!(taken_fast(), before + 1, "one response, on the fast path");
    assert_eq!(taken_direct(), direct, "staged, not straight into the ring");
    assert_ne!(
        kicks(),
        kicked,
        "the publication did not wake the sleeping engine"
    );
    until_readable(&fd);
    assert_eq!(
        channel.get_event(Some(Duration::from_secs(10))).unwrap(),
        Some(scq.number())
    );
    let mut wc = [WorkCompletion::default(); 2];
    assert_eq!(scq.poll(&mut wc), 1);
    assert_eq!(
        (wc[0].status, wc[0].opcode, wc[0].byte_len),
        (WcStatus::Success, WcOpcode::RdmaRead, 8)
    );
    let mut got = [0u8; 8];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"straight");
}
