//! The wake-up protocol against a hostile peer and with many links, on real engines that
//! sleep (poll mode, backoff policy). Every sleep here may last a minute; a completion that
//! takes 20 s is a lost wake-up.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rustix::thread::futex;

use crate::link::KICK_OFF;
use crate::raw_peer::raw_peer_link;
use crate::{
    AccessFlags, Context, Cq, EngineMode, IdlePolicy, LinkId, Mr, Pd, Qp, QpCaps, Qpn, RecvWr,
    SendOp, SendWr, WcStatus, WorkCompletion,
};

/// Longer than any test waits: a lost wake-up shows as a missing completion.
const MAX_SLEEP: Duration = Duration::from_secs(60);
/// How long a completion may take before the wake-up counts as lost.
const DEADLINE: Duration = Duration::from_secs(20);

fn sleepy() -> Context {
    Context::builder()
        .arena_size(1 << 20)
        .huge_pages(shmhca_rings::segment::HugePages::Never)
        .mode(EngineMode::Poll { cpu: None })
        .idle(IdlePolicy::Backoff {
            spins: 100,
            max_sleep: MAX_SLEEP,
        })
        .build()
        .unwrap()
}

/// Waits (politely: the engines need the cores) until the engine of `ctx` has a thread
/// asleep.
fn until_asleep(ctx: &Context) {
    let start = Instant::now();
    while ctx.shared.sleepers().load(Ordering::Relaxed) == 0 {
        assert!(start.elapsed() < DEADLINE, "the engine never fell asleep");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// One completion from `cq`, polled politely; panics naming `what` after [`DEADLINE`].
fn one(cq: &mut Cq, what: &str) -> WorkCompletion {
    let start = Instant::now();
    let mut wc = [WorkCompletion::default()];
    while cq.poll(&mut wc) == 0 {
        assert!(
            start.elapsed() < DEADLINE,
            "{what}: no completion in {DEADLINE:?} (a lost wake-up: the engines sleep up to {MAX_SLEEP:?})"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(wc[0].status, WcStatus::Success, "{what}: {:?}", wc[0]);
    wc[0]
}

/// A QP of a context, with its CQ and a small buffer.
struct End {
    qp: Qp,
    cq: Cq,
    mr: Mr,
    _pd: Pd,
}

fn end(ctx: &Context) -> End {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    End {
        qp,
        cq,
        mr,
        _pd: pd,
    }
}

fn connect(qp: &mut Qp, link: LinkId, remote: Qpn) {
    crate::raw_peer::connect_rts(qp, link, remote, 20);
}

/// Two sleepy contexts linked in this process, a QP each, connected.
fn pair(a_ctx: &Context, b_ctx: &Context) -> (End, End) {
    let (la, lb) = a_ctx.link_with(b_ctx).unwrap();
    let (mut a, mut b) = (end(a_ctx), end(b_ctx));
    let (qa, qb) = (a.qp.qpn(), b.qp.qpn());
    connect(&mut a.qp, la, qb);
    connect(&mut b.qp, lb, qa);
    (a, b)
}

/// One message from `from` to `to`, each engine let to fall asleep first: `to`'s engine is
/// woken by `from`'s packets (a peer's kick), `from`'s by its post (the local kick).
fn message(from: &mut End, to: &mut End, seq: u64, what: &str, sleepers: [&Context; 2]) {
    for ctx in sleepers {
        until_asleep(ctx);
    }
    to.qp
        .post_recv(&RecvWr::new(seq, &[to.mr.sge(0, 8).unwrap()]))
        .unwrap();
    from.mr.write_at(0, &seq.to_le_bytes()).unwrap();
    from.qp
        .post_send(&SendWr::new(
            seq,
            SendOp::Send,
            &[from.mr.sge(0, 8).unwrap()],
        ))
        .unwrap();
    let rc = one(&mut to.cq, &format!("{what} {seq}: the receive"));
    assert_eq!((rc.wr_id, rc.byte_len), (seq, 8));
    let mut got = [0u8; 8];
    to.mr.read_at(0, &mut got).unwrap();
    assert_eq!(u64::from_le_bytes(got), seq);
    one(&mut from.cq, &format!("{what} {seq}: the send"));
}

/// A tiny deterministic generator (xorshift).
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// A peer that completed the set-up honestly writes whatever it likes in both kick words of
/// its link (the one it bumps and the one the victim bumps): random values, a bump undone
/// at once (A-B-A), a value swapped in and back around a `FUTEX_WAKE`, wakes alone. Between
/// its bursts, with the victim asleep and the hostile quiet (so that none of its wakes can
/// stand in for a lost one), the victim still wakes for another peer's packets and for its
/// own posts, every time, and keeps sleeping in between.
#[test]
fn a_hostile_peer_scribbling_on_kick_words_hides_no_other_wake_up() {
    let victim = sleepy();
    let honest = sleepy();
    let (_link, raw, _arena) = raw_peer_link(&victim, 8, 0x77, 4096);
    let (mut v, mut h) = pair(&victim, &honest);
    let words = KICK_OFF.map(|off| raw.segment.atomic_u32(off).unwrap());
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let scribble = |x: &mut u64| {
        for _ in 0..64 {
            let w = words[(next(x) % 2) as usize];
            match next(x) % 4 {
                0 => w.store(next(x) as u32, Ordering::Release),
                1 => {
                    w.fetch_add(1, Ordering::Release);
                    w.fetch_sub(1, Ordering::Release);
                }
                2 => {
                    let _ = futex::wake(w, futex::Flags::empty(), i32::MAX as u32);
                }
                _ => {
                    let old = w.swap(next(x) as u32, Ordering::AcqRel);
                    let _ = futex::wake(w, futex::Flags::empty(), i32::MAX as u32);
                    w.store(old, Ordering::Release);
                }
            }
            if next(x) % 8 == 0 {
                std::thread::sleep(Duration::from_micros(next(x) % 500));
            }
        }
    };
    let both = [&victim, &honest];
    for seq in 0..15 {
        scribble(&mut x);
        message(&mut h, &mut v, seq, "honest peer to victim", both);
        scribble(&mut x);
        message(&mut v, &mut h, seq, "victim to honest peer", both);
    }
    let stats = victim.stats();
    assert!(stats.sleeps >= 30, "the victim hardly slept: {stats:?}");
}

/// An engine asleep when a link is added (here `Context::link_with`) waits on the new
/// link's kick word from then on: the first packet on it wakes the engine, with no control
/// operation on the sleeping side in between.
#[test]
fn an_engine_asleep_when_a_link_is_added_is_woken_by_its_first_packet() {
    let (a_ctx, b_ctx) = (sleepy(), sleepy());
    // B's QP exists before the link, so that nothing is done to B after it.
    let b = end(&b_ctx);
    until_asleep(&b_ctx);
    let (la, _lb) = a_ctx.link_with(&b_ctx).unwrap();
    // The kick of `link_with` woke B; let it fall asleep again, on the new wait set.
    until_asleep(&b_ctx);
    let before = b_ctx.stats().packets_received;
    let mut a = end(&a_ctx);
    connect(&mut a.qp, la, b.qp.qpn());
    until_asleep(&b_ctx);
    // B's QP is still in Reset: it drops the packet, but its engine must take it.
    a.qp.post_send(&SendWr::new(1, SendOp::Send, &[a.mr.sge(0, 8).unwrap()]))
        .unwrap();
    let start = Instant::now();
    while b_ctx.stats().packets_received == before {
        assert!(
            start.elapsed() < DEADLINE,
            "the sleeping engine never took the packet on its new link"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(b);
}

/// More links than one `futex_waitv` can wait on (127 besides the local word): the engine
/// still sleeps, and a packet on a link it could not wait on (added last) is taken within
/// the short sleep, not the minute of the backoff policy.
#[test]
fn an_engine_with_more_links_than_futex_waitv_takes_is_still_woken() {
    let victim = sleepy();
    let honest = sleepy();
    let raws: Vec<_> = (0..crate::engine::wake::MAX_WAIT)
        .map(|i| raw_peer_link(&victim, 8, 0x100 + i as u32, 64))
        .collect();
    let (mut v, mut h) = pair(&victim, &honest);
    let both = [&victim, &honest];
    for seq in 0..5 {
        message(&mut h, &mut v, seq, "honest peer to victim", both);
        message(&mut v, &mut h, seq, "victim to honest peer", both);
    }
    drop(raws);
}
