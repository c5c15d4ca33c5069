//! Models of the engine's own hand-offs, run on the engine's real code (crate `shmhca`
//! built with `--cfg shmhca_loom`) through its public API.
//!
//! Each model builds one context with a loopback link (`Context::link_with` itself) and two
//! QPs connected to each other over it, then runs the application on model threads and the
//! engine on another, which calls [`Context::progress`] until the application is done.
//!
//! What runs is the real code: `Qp::post_send`/`post_recv` (credit checks, gather tables,
//! in-flight counts, the SQ/RQ rings, the doorbell), `Engine::poll` (doorbell, requester,
//! the link's shared-memory rings, responder, completer, flushes), `Cq::poll`, and the
//! `Mr` checks. What `--cfg shmhca_loom` substitutes, and nothing else:
//!
//! * there is no engine thread (poll mode starts none under loom): the model's engine
//!   thread is the one calling `Context::progress`, as an inline-mode application would;
//! * the engine's shared words (QP state, `sq_retired`, `rq_retired`, in-flight counts,
//!   the engine token) and the rings' indices are loom atomics (`shmhca::sync`,
//!   `shmhca_rings::sync`);
//! * every byte access of a `Mem` (arenas, gather tables, inline staging) is announced to
//!   a loom cell per 64-byte line, so that an access not ordered after a conflicting one
//!   is a causality violation; the bytes are still copied as without loom;
//! * segments are real memfds; no timer is armed (transport timer off, receives posted
//!   before the sends arrive, so no RNR Nak), so the clock the engine reads never decides
//!   anything.

use shmhca::{
    AccessFlags, Context, Cq, Destination, EngineMode, IdlePolicy, Mr, Mtu, Pd, Qp, QpAttr, QpCaps,
    QpState, RecvWr, SendOp, SendWr, WcStatus, WorkCompletion,
};
use shmhca_rings::segment::HugePages;

#[cfg(shmhca_loom)]
use loom::{
    sync::Arc,
    sync::atomic::{AtomicBool, Ordering},
    thread,
};
#[cfg(not(shmhca_loom))]
use std::{
    sync::Arc,
    sync::atomic::{AtomicBool, Ordering},
    thread,
};

/// One context, a loopback link and two connected QPs: A sends to B.
pub struct Loopback {
    /// The context (moved to the engine thread by [`EngineThread::start`]).
    pub ctx: Context,
    /// The protection domain of both QPs.
    pub pd: Pd,
    /// A's completion queue (sends).
    pub cq_a: Cq,
    /// B's completion queue (receives).
    pub cq_b: Cq,
    /// The sender.
    pub a: Qp,
    /// The receiver.
    pub b: Qp,
}

/// Builds a [`Loopback`] whose QPs have `caps`, both in RTS.
pub fn loopback(caps: QpCaps) -> Loopback {
    let ctx = Context::builder()
        .arena_size(16 << 10)
        .huge_pages(HugePages::Never)
        .mode(EngineMode::Poll { cpu: None })
        // The model's engine never sleeps (the poll-mode default backs off to sleep).
        .idle(IdlePolicy::Spin)
        .link_slots(8)
        .build()
        .expect("context");
    let (link, _) = ctx.link_with(&ctx).expect("loopback link");
    let pd = ctx.alloc_pd().expect("pd");
    let cq_a = ctx.create_cq(4).expect("cq");
    let cq_b = ctx.create_cq(4).expect("cq");
    let mut a = ctx.create_qp(&pd, &cq_a, &cq_a, caps).expect("qp");
    let mut b = ctx.create_qp(&pd, &cq_b, &cq_b, caps).expect("qp");
    let (qa, qb) = (a.qpn(), b.qpn());
    for (qp, remote) in [(&mut a, qb), (&mut b, qa)] {
        qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::REMOTE_WRITE))
            .unwrap();
        qp.modify(
            &QpAttr::new(QpState::Rtr)
                .path_mtu(Mtu::Mtu256)
                .dest(Destination { link, qpn: remote })
                .rq_psn(0)
                .max_dest_rd_atomic(0)
                .min_rnr_timer(1),
        )
        .unwrap();
        // Local Ack Timeout 0: no transport timer (see the module docs).
        qp.modify(
            &QpAttr::new(QpState::Rts)
                .sq_psn(0)
                .timeout(0)
                .retry_cnt(7)
                .rnr_retry(7)
                .max_rd_atomic(0),
        )
        .unwrap();
    }
    Loopback {
        ctx,
        pd,
        cq_a,
        cq_b,
        a,
        b,
    }
}

/// The engine thread: drives `ctx` until `done` is set.
pub struct EngineThread {
    done: Arc<AtomicBool>,
    thread: thread::JoinHandle<()>,
}

impl EngineThread {
    /// Starts driving `ctx` on a thread of the model.
    pub fn start(ctx: Context) -> EngineThread {
        let done = Arc::new(AtomicBool::new(false));
        let d = Arc::clone(&done);
        let thread = thread::spawn(move || {
            while !d.load(Ordering::Acquire) {
                if ctx.progress() == 0 {
                    thread::yield_now();
                }
            }
            drop(ctx);
        });
        EngineThread { done, thread }
    }

    /// Stops the engine thread and waits for it.
    pub fn stop(self) {
        self.done.store(true, Ordering::Release);
        self.thread.join().unwrap();
    }
}

/// Polls `cq` until it yields one completion.
pub fn poll_one(cq: &mut Cq) -> WorkCompletion {
    loop {
        if let Some(wc) = cq.poll_one() {
            return wc;
        }
        thread::yield_now();
    }
}

/// Posts `wr` on `qp`, retrying while the send queue is full (the credit path: each retry
/// reloads `sq_retired` in `Qp::refresh_sq`).
pub fn post_send_when_room(qp: &mut Qp, wr: &SendWr<'_>) {
    loop {
        match qp.post_send(wr) {
            Ok(()) => return,
            Err(shmhca::Error::QueueFull { .. }) => thread::yield_now(),
            Err(e) => panic!("post_send: {e}"),
        }
    }
}

/// Waits until no posted work request counts `mr` in flight (`Mr::in_flight`, Acquire).
pub fn wait_idle(mr: &Mr) {
    while mr.in_flight() != 0 {
        thread::yield_now();
    }
}

/// Bytes message `i` carries: two gather elements of [`HALF`] bytes each.
pub const HALF: u32 = 4;

fn message(i: u64) -> [u8; 2 * HALF as usize] {
    let mut m = [0u8; 2 * HALF as usize];
    for (k, b) in m.iter_mut().enumerate() {
        *b = (i as u8) * 16 + k as u8 + 1;
    }
    m
}

fn debug_count() {
    static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if n % 1000 == 0 && std::env::var_os("SHMHCA_LOOM_PROGRESS").is_some() {
        eprintln!("execution {n}");
    }
}

/// The caps of the models: a send queue of depth 1 whose Sends gather two elements (so
/// each `post_send` writes row 0 of the QP's private gather table, which the engine reads
/// while sending and again while retiring the WQE).
pub const CAPS: QpCaps = QpCaps {
    max_send_wr: 1,
    max_recv_wr: 2,
    max_send_sge: 2,
    max_recv_sge: 1,
    max_inline_data: 0,
};

/// The regions of a model: `src` holds message `i` at `64 i`; `dst[i]` receives it.
fn regions(pd: &Pd, count: u64) -> (Mr, Vec<Mr>) {
    let src = pd
        .alloc_mr(64 * count, AccessFlags::LOCAL_WRITE)
        .expect("mr");
    let dst: Vec<Mr> = (0..count)
        .map(|_| pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).expect("mr"))
        .collect();
    for i in 0..count {
        src.write_at(64 * i, &message(i)).unwrap();
    }
    (src, dst)
}

fn post_recvs(b: &mut Qp, dst: &[Mr]) {
    for (i, mr) in dst.iter().enumerate() {
        let sge = [mr.sge(0, 2 * HALF).unwrap()];
        b.post_recv(&RecvWr::new(100 + i as u64, &sge)).unwrap();
    }
}

fn send_wr<'a>(src: &'a Mr, i: u64, sgl: &'a mut Vec<shmhca::Sge<'a>>) -> SendWr<'a> {
    sgl.push(src.sge(64 * i, HALF).unwrap());
    sgl.push(src.sge(64 * i + u64::from(HALF), HALF).unwrap());
    SendWr::new(i, SendOp::Send, sgl)
}

fn check_received(mr: &Mr, i: u64) {
    let mut got = [0u8; 2 * HALF as usize];
    mr.read_at(0, &mut got).unwrap();
    assert_eq!(got, message(i), "receive {i} holds the wrong bytes");
}

/// **The send queue's credit.** The application (the calling thread) posts two Sends on A
/// ([`CAPS`]: a send queue of depth 1, two gather elements), then polls A's CQ for both
/// completions, in order, and checks what B received. The second post finds the queue
/// full until the engine has retired the first WQE — `completer` stores `sq_retired` with
/// Release after its last read of the WQE's gather-table row, `Qp::refresh_sq` loads it
/// with Acquire — and then rewrites that row. The engine (a thread) moves everything: SQ
/// ring, doorbell, requester, the loopback link's shared-memory rings, responder (copies
/// each payload from A's region into B's), completer, both CQs. B's receives are posted
/// before the engine starts.
pub fn send_queue_credit() {
    debug_count();
    let Loopback {
        ctx,
        pd,
        mut cq_a,
        cq_b,
        mut a,
        mut b,
    } = loopback(CAPS);
    let (src, dst) = regions(&pd, 2);
    post_recvs(&mut b, &dst);
    let engine = EngineThread::start(ctx);
    for i in 0..2 {
        let mut sgl = Vec::new();
        post_send_when_room(&mut a, &send_wr(&src, i, &mut sgl));
    }
    for i in 0..2 {
        let wc = poll_one(&mut cq_a);
        assert_eq!((wc.wr_id, wc.status), (i, WcStatus::Success), "send {i}");
        check_received(&dst[i as usize], i);
    }
    engine.stop();
    drop((a, b, cq_a, cq_b, src, dst, pd));
}

/// **In-flight counts.** A Send is posted on A and a receive on B before the engine
/// starts; the application (the calling thread) then waits until B's receive region is
/// idle (`Mr::in_flight` back to 0, Acquire: `MrTable::release` lowers it with a Release store
/// after the engine's copy into the region) and reads it — with no other synchronisation
/// with the engine. Then it checks that the Send completed.
pub fn in_flight_release() {
    debug_count();
    let Loopback {
        ctx,
        pd,
        mut cq_a,
        cq_b,
        mut a,
        mut b,
    } = loopback(CAPS);
    let (src, dst) = regions(&pd, 1);
    post_recvs(&mut b, &dst);
    let engine = EngineThread::start(ctx);
    let mut sgl = Vec::new();
    post_send_when_room(&mut a, &send_wr(&src, 0, &mut sgl));
    wait_idle(&dst[0]);
    check_received(&dst[0], 0);
    let wc = poll_one(&mut cq_a);
    assert_eq!((wc.wr_id, wc.status), (0, WcStatus::Success));
    wait_idle(&src);
    engine.stop();
    drop((a, b, cq_a, cq_b, src, dst, pd));
}

/// **A QP error flush racing a post.** The application (the calling thread) posts a Send
/// on A, moves A to the Error state (`Qp::modify`, which takes the engine token from the
/// running engine thread), posts a second Send and a receive on A (accepted in Error, to be
/// flushed), then polls A's CQ. Every work request completes exactly once: the sends in
/// order, the first with Success or a flush error (whether it went out before the error
/// is the race), the second and the receive flushed; afterwards nothing is outstanding and
/// no region counts anything in flight.
pub fn error_flush_races_post() {
    debug_count();
    let Loopback {
        ctx,
        pd,
        mut cq_a,
        cq_b,
        mut a,
        mut b,
    } = loopback(CAPS);
    let (src, dst) = regions(&pd, 2);
    post_recvs(&mut b, &dst[..1]);
    let engine = EngineThread::start(ctx);
    let mut sgl = Vec::new();
    post_send_when_room(&mut a, &send_wr(&src, 0, &mut sgl));
    a.modify(&QpAttr::new(QpState::Error)).unwrap();
    let mut sgl = Vec::new();
    post_send_when_room(&mut a, &send_wr(&src, 1, &mut sgl));
    let sge = [dst[1].sge(0, 2 * HALF).unwrap()];
    a.post_recv(&RecvWr::new(200, &sge)).unwrap();
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    while sends.len() + recvs.len() < 3 {
        let wc = poll_one(&mut cq_a);
        if wc.wr_id >= 100 {
            recvs.push((wc.wr_id, wc.status));
        } else {
            sends.push((wc.wr_id, wc.status));
        }
    }
    assert_eq!(recvs, [(200, WcStatus::WrFlushErr)]);
    assert_eq!(sends[0].0, 0);
    assert!(
        matches!(sends[0].1, WcStatus::Success | WcStatus::WrFlushErr),
        "{sends:?}"
    );
    assert_eq!(sends[1], (1, WcStatus::WrFlushErr));
    assert_eq!(a.sq_outstanding(), 0);
    assert_eq!((src.in_flight(), dst[1].in_flight()), (0, 0));
    engine.stop();
    drop((a, b, cq_a, cq_b, src, dst, pd));
}
