//! Engines on their own threads (poll mode): spinning, and sleeping until woken.
mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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

/// Two poll-mode contexts with `idle`, linked, a connected QP each, and a 64-byte region
/// each for the messages.
fn connected(idle: IdlePolicy) -> (End, End, Mr, Mr) {
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
    (a, b, sa, sb)
}

fn ping_pong(idle: IdlePolicy, pause: Duration) -> (Stats, Stats) {
    let (mut a, mut b, sa, sb) = connected(idle);
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

/// Set in the child that [`a_poller_whose_engine_threads_never_get_the_core_is_served`] runs.
const STARVED_CHILD: &str = "SHMHCA_TEST_STARVED_CHILD";

/// A program pinned to one core under `SCHED_FIFO` (as latency benchmarks are run): its
/// engine threads inherit both, and a FIFO thread is never preempted by one of its own
/// priority, so they run only when the program blocks — and a busy poll never blocks. The
/// engine thread never sees the polls to step back for them; the polls must run the engine
/// themselves (before, they spun forever on queues no engine filled: `ib_send_lat` under
/// `chrt -f 10 taskset -c 0` hung). This test runs itself again that way, as a child.
#[test]
fn a_poller_whose_engine_threads_never_get_the_core_is_served() {
    if std::env::var_os(STARVED_CHILD).is_some() {
        starved_ping_pong();
        return;
    }
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: SCHED_FIFO needs root (CI runs this test as root)");
        return;
    }
    let name = "a_poller_whose_engine_threads_never_get_the_core_is_served";
    let log = std::env::temp_dir().join(format!("shmhca-starved-{}.log", std::process::id()));
    let file = std::fs::File::create(&log).unwrap();
    let mut child = match Command::new("chrt")
        .args(["-f", "1", "taskset", "-c", "0"])
        .arg(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(STARVED_CHILD, "1")
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let _ = std::fs::remove_file(&log);
            eprintln!("skipped: chrt is not installed (apt-get install util-linux)");
            return;
        }
        Err(e) => panic!("starting chrt: {e}"),
    };
    // The child's own polls are bounded; this bounds the whole (a debug build polls slowly).
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    assert!(
        status.is_some_and(|s| s.success()),
        "the child under SCHED_FIFO on one core: {status:?}\n{text}"
    );
}

/// In the child: 20 Sends between two poll-mode contexts of this process, whose engine
/// threads share the polling thread's core and priority; each wait bounded by its count of
/// polls, not by time.
fn starved_ping_pong() {
    // (The polls serve the engine after 250 ms without its thread: `UNSERVED_FOR`.)
    const MAX_POLLS: u64 = 1 << 26;
    let idle = IdlePolicy::Backoff {
        spins: 1000,
        max_sleep: Duration::from_millis(100),
    };
    let (mut a, mut b, sa, sb) = connected(idle);
    for round in 0..20u64 {
        b.qp.post_recv(&RecvWr::new(round, &[sb.sge(0, 64).unwrap()]))
            .unwrap();
        a.qp.post_send(&SendWr::new(round, SendOp::Send, &[sa.sge(0, 8).unwrap()]))
            .unwrap();
        let (mut recv, mut sent) = (None, None);
        let mut wc = [WorkCompletion::default(); 4];
        let mut polls = 0u64;
        while recv.is_none() || sent.is_none() {
            polls += 1;
            assert!(
                polls <= MAX_POLLS,
                "round {round}: {MAX_POLLS} polls of both queues found {recv:?} and {sent:?}\nA: {:?}\nB: {:?}",
                a.ctx.stats(),
                b.ctx.stats()
            );
            if b.cq.poll(&mut wc[..1]) == 1 {
                recv = Some(wc[0]);
            }
            if a.cq.poll(&mut wc[..1]) == 1 {
                sent = Some(wc[0]);
            }
        }
        // Once found out, the polls go on running the engine: no round waits for the
        // count again.
        assert!(
            round == 0 || polls < 1 << 16,
            "round {round} took {polls} polls: the polls stopped running the engine after round 0"
        );
        let (r, s) = (recv.unwrap(), sent.unwrap());
        assert_eq!(
            (r.status, r.wr_id, r.byte_len),
            (WcStatus::Success, round, 8)
        );
        assert_eq!((s.status, s.wr_id), (WcStatus::Success, round));
    }
}
