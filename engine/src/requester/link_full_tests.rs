//! Issue 24 item 5: a WQE waiting for room on a link its peer stopped reading counts
//! against the transport timer (spec/01 "Ttr begins after a request packet is scheduled for
//! transmission"), so a QP whose first packet never fits the full ring ends in the Error
//! state with RetryExcErr, its other WQEs flushed, and `last_error` saying why — instead of
//! staying in RTS forever with work posted.
//!
//! The peer is a raw link end held by the test: its process is alive and the link is never
//! declared dead (no connection manager watches it), but nobody reads what the engine
//! sends, as a peer whose engine stopped consuming would.

use std::time::{Duration, Instant};

use crate::raw_peer::{RawEnds, inline_context, raw_peer_link, raw_peer_to_rtr};
use crate::wire::slot::{PacketSlot, RxPacket, continuation_slots};
use crate::{
    AccessFlags, Context, Cq, LinkId, Mr, Pd, Qp, QpAttr, QpCaps, QpState, SendOp, SendWr,
    WcStatus, WorkCompletion,
};

const PEER: u32 = 9;
/// Lines of the link ring each way: a few packets fill it.
const RING: usize = 8;
/// The Retry Count of the QPs.
const RETRY_CNT: u8 = 2;
/// Local Ack Timeout: 4.096 µs × 2^8, about 1 ms.
const TIMEOUT: u8 = 8;
/// How long the tests drive the engine at most waiting for an outcome (seconds): an upper
/// bound on a loaded machine, never a measurement.
const BOUND: Duration = Duration::from_secs(30);
/// The first PSN of the QP whose packets never fit (QP a starts at 0).
const B_PSN: u32 = 5000;

struct Rig {
    ctx: Context,
    _pd: Pd,
    cq: Cq,
    mr: Mr,
    link: LinkId,
    peer: RawEnds,
    _arena: crate::mem::Mem,
}

fn rig() -> Rig {
    rig_on(inline_context())
}

/// A rig whose engine's timers run on a test clock (see [`expire`]).
fn timed_rig() -> Rig {
    rig_on(crate::raw_peer::inline_context_on(
        crate::timer::TestClock::new(),
    ))
}

fn rig_on(ctx: Context) -> Rig {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let (link, peer, arena) = raw_peer_link(&ctx, RING, PEER, 4096);
    let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    Rig {
        ctx,
        _pd: pd,
        cq,
        mr,
        link,
        peer,
        _arena: arena,
    }
}

impl Rig {
    /// A QP in RTS towards the raw peer, sending from PSN `sq_psn`, Retry Count
    /// [`RETRY_CNT`], timer [`TIMEOUT`].
    fn qp(&self, sq_psn: u32) -> Qp {
        let mut qp = self
            .ctx
            .create_qp(&self._pd, &self.cq, &self.cq, QpCaps::default())
            .unwrap();
        raw_peer_to_rtr(&mut qp, self.link, PEER, false);
        qp.modify(
            &QpAttr::new(QpState::Rts)
                .sq_psn(sq_psn)
                .timeout(TIMEOUT)
                .retry_cnt(RETRY_CNT)
                .rnr_retry(7)
                .max_rd_atomic(1),
        )
        .unwrap();
        qp
    }

    /// Posts `n` signaled 8-byte Sends on `qp`, wr_ids from `first`.
    fn post(&self, qp: &mut Qp, first: u64, n: u64) {
        for id in first..first + n {
            qp.post_send(&SendWr::new(
                id,
                SendOp::Send,
                &[self.mr.sge(0, 8).unwrap()],
            ))
            .unwrap();
        }
    }

    /// Drives the engine until `done` holds (panics after [`BOUND`] with `what`).
    fn drive_until(&self, what: &str, mut done: impl FnMut() -> bool) {
        let start = Instant::now();
        while !done() {
            for _ in 0..64 {
                self.ctx.progress();
            }
            assert!(start.elapsed() < BOUND, "{what} not within {BOUND:?}");
        }
    }

    /// The completions so far.
    fn completions(&mut self) -> Vec<WorkCompletion> {
        let mut out = vec![];
        let mut wc = [WorkCompletion::default(); 32];
        loop {
            let n = self.cq.poll(&mut wc);
            if n == 0 {
                return out;
            }
            out.extend_from_slice(&wc[..n]);
        }
    }

    /// The opcodes and PSNs of the packets the engine sent, read off the ring (which frees
    /// it).
    fn drain_peer(&mut self) -> Vec<(crate::wire::opcode::Opcode, u32)> {
        let mut buf = [PacketSlot::default(); 16];
        let mut out = vec![];
        let mut skip = 0;
        for _ in 0..1000 {
            let n = self.peer.rx.pop_burst(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            for s in &buf[..n] {
                if skip > 0 {
                    skip -= 1;
                    continue;
                }
                skip = continuation_slots(s);
                let rx = RxPacket::parse(s, &[]).unwrap();
                out.push((rx.opcode(), rx.psn().get()));
            }
        }
        out
    }
}

/// The statuses (by wr_id order) of the completions of QP `qpn` in `wcs`.
fn statuses(wcs: &[WorkCompletion], qpn: crate::Qpn) -> Vec<(u64, WcStatus)> {
    wcs.iter()
        .filter(|w| w.qp_num == qpn)
        .map(|w| (w.wr_id, w.status))
        .collect()
}

/// QP `a` fills the ring the peer does not read; QP `b`, set up over the same link after
/// that, posts two Sends whose first packet never fits. Both QPs end in Error: `b`'s first
/// Send with RetryExcErr, its second flushed, and its `last_error` names the full link —
/// and `b` never put a packet on the link.
#[test]
fn a_qp_whose_first_packet_never_fits_the_full_link_times_out() {
    let mut r = rig();
    let mut a = r.qp(0);
    // More Sends than the ring holds: the first ones fill it, the rest wait behind them.
    r.post(&mut a, 100, (RING * 2) as u64);
    for _ in 0..8 {
        r.ctx.progress();
    }
    let mut b = r.qp(B_PSN);
    r.post(&mut b, 200, 2);
    r.drive_until("QP b in the Error state", || b.state() == QpState::Error);
    // QP a too (its packets went out, its retransmissions did not fit).
    r.drive_until("QP a in the Error state", || a.state() == QpState::Error);

    let wcs = r.completions();
    let of_b = statuses(&wcs, b.qpn());
    assert_eq!(
        of_b,
        [(200, WcStatus::RetryExcErr), (201, WcStatus::WrFlushErr)],
        "QP b's Sends: the first fails on its Retry Count, the second is flushed"
    );
    let why = b.last_error().expect("QP b says why it failed");
    assert!(
        why.contains("no room on the link to peer") && why.contains("stopped consuming"),
        "{why}"
    );
    assert!(why.contains(&format!("retry_cnt {RETRY_CNT}")), "{why}");
    let of_a = statuses(&wcs, a.qpn());
    assert_eq!(of_a.len(), RING * 2, "{of_a:?}");
    assert_eq!(of_a[0], (100, WcStatus::RetryExcErr), "{of_a:?}");
    assert!(
        of_a[1..].iter().all(|&(_, s)| s == WcStatus::WrFlushErr),
        "{of_a:?}"
    );
    // Every timeout was counted against the Retry Count: the first try and RETRY_CNT
    // retries, for each QP.
    assert_eq!(r.ctx.stats().timeouts, 2 * (u64::from(RETRY_CNT) + 1));

    // Nothing of QP b ever reached the link (no PSN of its range), and it sends nothing
    // now that the ring has room.
    let mut psns = r.drain_peer();
    for _ in 0..64 {
        r.ctx.progress();
    }
    psns.extend(r.drain_peer());
    // (The ring also carries the QPs' first credit advertisement, an Acknowledge.)
    let requests: Vec<u32> = psns
        .iter()
        .filter(|(op, _)| op.info().is_some_and(|i| i.request))
        .map(|&(_, p)| p)
        .collect();
    assert!(requests.iter().all(|&p| p < B_PSN), "{psns:?}");
    assert!(
        !requests.is_empty(),
        "QP a's Sends filled the ring: {psns:?}"
    );
    assert_eq!(b.state(), QpState::Error);
}

/// A zero-length signaled Send, `wr_id` 7.
fn empty_send() -> crate::wqe::SqWqe {
    use crate::wqe::{DataLoc, SqWqe, WqeFlags, WqeOp};
    SqWqe {
        wr_id: 7,
        op: WqeOp::Send,
        flags: WqeFlags(WqeFlags::SIGNALED),
        imm: 0,
        len: 0,
        remote_addr: 0,
        rkey: 0,
        compare_add: 0,
        swap: 0,
        data: DataLoc::Empty,
    }
}

impl Rig {
    /// Runs `f` on `qp`'s engine side.
    fn stage<R>(
        &self,
        qp: &Qp,
        f: impl FnOnce(&mut crate::context::QpSlot, &mut crate::context::Env<'_>) -> R,
    ) -> R {
        let qpn = qp.qpn();
        self.ctx
            .shared
            .engine
            .with(|e| e.with_stage(qpn, f))
            .expect("the QP is live")
    }
}

/// Moves the engine's test clock to the QP's transport timer's deadline, so that it expires
/// at its next look.
fn expire(q: &mut crate::context::QpSlot, env: &mut crate::context::Env<'_>) {
    q.proto.req.start_timers(env);
    let at = q.proto.req.timer().at().expect("the transport timer runs");
    env.jump_to(at);
}

/// The retry semantics of a wait for room, one expiry at a time: each spends one of the
/// Retry Count and sends nothing (the request never left, the ring is still full); the
/// expiry with none left completes the waiting WQE with RetryExcErr and says why.
#[test]
fn each_expiry_while_waiting_for_room_spends_one_retry_and_sends_nothing() {
    use super::{LinkWait, accept, on_tick, transmit};
    use crate::context::VecLink;
    let mut r = timed_rig();
    let qp = r.qp(0);
    let mut full = VecLink::default(); // room for no packet
    r.stage(&qp, |q, env| {
        accept(q, empty_send());
        assert_eq!(transmit(q, env, &mut full, 16), 0);
        assert_eq!(q.proto.req.link_wait(), LinkWait::Waiting);
        assert!(!q.proto.req.window().outstanding(), "nothing left");
        on_tick(q, env, false);
        assert_eq!(
            q.proto.req.link_wait(),
            LinkWait::Waiting,
            "not expired yet"
        );
        for retries_left in (0..RETRY_CNT).rev() {
            let timeouts = env.stats.timeouts;
            expire(q, env);
            on_tick(q, env, false);
            assert_eq!(env.stats.timeouts, timeouts + 1);
            assert_eq!(q.proto.req.retry_state().1, retries_left);
            assert_eq!(q.proto.state, QpState::Rts);
            assert!(q.proto.req.timer().armed(), "a new period");
            assert_eq!(transmit(q, env, &mut full, 16), 0);
            assert!(full.sent.is_empty());
            assert!(matches!(q.proto.req.link_wait(), LinkWait::Since(_)));
        }
        expire(q, env);
        on_tick(q, env, false);
        assert_eq!(q.proto.state, QpState::Error);
        assert!(!q.proto.req.timer().armed());
    });
    let wcs = r.completions();
    assert_eq!(statuses(&wcs, qp.qpn()), [(7, WcStatus::RetryExcErr)]);
    let why = qp.last_error().unwrap();
    assert!(
        why.contains("no room on the link to peer QP 0x9 (link "),
        "{why}"
    );
    assert!(why.contains(" ms: the peer stopped consuming"), "{why}");
    assert!(full.sent.is_empty());
}

/// When the link has room again the waiting request goes, the wait is over, and once it
/// is acknowledged an expiry of the timer it started is no timeout; a WQE held back by
/// something else than the link (here the SQ drained state) is not waiting for room.
#[test]
fn a_wait_ends_when_the_request_goes_or_something_else_holds_it() {
    use super::{LinkWait, accept, on_tick, transmit};
    use crate::context::VecLink;
    let r = timed_rig();
    let qp = r.qp(0);
    r.stage(&qp, |q, env| {
        let mut full = VecLink::default();
        accept(q, empty_send());
        assert_eq!(transmit(q, env, &mut full, 16), 0);
        assert_eq!(q.proto.req.link_wait(), LinkWait::Waiting);
        let mut room = VecLink::default();
        room.room = 4;
        assert_eq!(transmit(q, env, &mut room, 16), 1);
        assert_eq!(q.proto.req.link_wait(), LinkWait::No, "the request went");
        assert!(
            q.proto
                .req
                .acknowledged(q.proto.req.window().npsn().sub(1), &q.proto.cfg)
        );
        let (timeouts, retries) = (env.stats.timeouts, q.proto.req.retry_state().1);
        assert!(
            !q.proto.req.timer().armed(),
            "nothing outstanding: the timer stopped"
        );
        let later = env.now().after(Duration::from_secs(3600));
        env.jump_to(later);
        on_tick(q, env, false);
        assert_eq!(
            (env.stats.timeouts, q.proto.req.retry_state().1),
            (timeouts, retries)
        );

        // A second Send waits for room, then the QP is drained: the Send is held by the
        // state, not by the link, even where the link has room.
        accept(q, empty_send());
        assert_eq!(transmit(q, env, &mut full, 16), 0);
        assert_eq!(q.proto.req.link_wait(), LinkWait::Waiting);
        q.proto.state = QpState::Sqd;
        assert_eq!(transmit(q, env, &mut room, 16), 0);
        assert_eq!(q.proto.req.link_wait(), LinkWait::No, "held by the state");
        expire(q, env);
        on_tick(q, env, false);
        assert_eq!(
            (env.stats.timeouts, q.proto.req.retry_state().1),
            (timeouts, retries)
        );
        assert_eq!(q.proto.state, QpState::Sqd);
    });
}

/// A link the peer still reads (it frees room between two looks, other traffic taking it
/// first) is busy, not stopped: an expiry after such a look starts a new period instead
/// of spending a retry; once the peer frees nothing for a whole period, it is a timeout.
#[test]
fn a_link_the_peer_still_reads_is_busy_not_stopped() {
    use super::{accept, on_tick, transmit};
    use crate::context::VecLink;
    let r = timed_rig();
    let qp = r.qp(0);
    r.stage(&qp, |q, env| {
        let mut busy = VecLink::default(); // never room for this QP
        accept(q, empty_send());
        assert_eq!(transmit(q, env, &mut busy, 16), 0);
        on_tick(q, env, false);
        let (timeouts, retries) = (env.stats.timeouts, q.proto.req.retry_state().1);
        for round in 0..3 {
            // The peer read some lines, and others' packets took the room.
            busy.mark += 5;
            assert_eq!(transmit(q, env, &mut busy, 16), 0);
            expire(q, env);
            on_tick(q, env, false);
            assert_eq!(
                (
                    env.stats.timeouts,
                    q.proto.req.retry_state().1,
                    q.proto.state
                ),
                (timeouts, retries, QpState::Rts),
                "round {round}: a new period, no retry spent"
            );
            assert!(q.proto.req.timer().armed());
        }
        // The peer stops: no room freed between two looks.
        assert_eq!(transmit(q, env, &mut busy, 16), 0);
        expire(q, env);
        on_tick(q, env, false);
        assert_eq!(env.stats.timeouts, timeouts + 1);
        assert_eq!(q.proto.req.retry_state().1, retries - 1);
    });
}

/// Over a real link: while the peer keeps reading a ring another QP keeps full, the QP
/// that finds no room is not failed, however many of its periods pass (the peer is slow,
/// not gone).
#[test]
fn a_qp_starved_of_room_on_a_link_the_peer_reads_stays_in_rts() {
    let mut r = rig();
    // QP a: a long timer (about 67 ms, seven retries), and far more Sends than the ring
    // holds: it takes whatever room the peer frees, ahead of b in each engine iteration.
    let mut a = r
        .ctx
        .create_qp(&r._pd, &r.cq, &r.cq, QpCaps::default())
        .unwrap();
    crate::raw_peer::connect_to_raw_peer_with_timeout(&mut a, r.link, PEER, 0, false, 14);
    r.post(&mut a, 100, 120);
    for _ in 0..8 {
        r.ctx.progress();
    }
    let mut b = r.qp(B_PSN);
    r.post(&mut b, 200, 1);
    // 40 rounds of 2 ms or more: far beyond b's (RETRY_CNT + 1) periods of about 1 ms.
    for _ in 0..40 {
        let mut one = [PacketSlot::default(); 2];
        r.peer.rx.pop_burst(&mut one).unwrap();
        for _ in 0..16 {
            r.ctx.progress();
        }
        std::thread::sleep(Duration::from_millis(2));
        if a.state() != QpState::Rts {
            break; // (a very slow machine: a's own timer ran out, b gets room now)
        }
    }
    assert_eq!(b.state(), QpState::Rts, "{:?}", b.last_error());
    assert!(statuses(&r.completions(), b.qpn()).is_empty());
}
