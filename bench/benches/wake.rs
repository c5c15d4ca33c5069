//! Completion-channel wake latency between processes: how long an idle waiter, asleep in
//! `poll(2)` on its completion channel's fd (as an async runtime's `AsyncFd` is), takes to
//! wake after a peer process posts a Send.
//!
//! The parent (process A) listens, accepts one connection, arms its receive queue and
//! sleeps in `poll(2)` on the channel's fd, nothing spinning in it but what shmhca itself
//! runs. The child (process B, this binary re-executed with `SHMHCA_WAKE_ROLE=sender`)
//! connects, then every `WAKE_GAP_US` (default 2,000 µs, so that A is asleep again)
//! writes the time (`CLOCK_MONOTONIC`, which both processes share) into an 8-byte message
//! and posts it. A, woken, reads the clock, drains the channel and the queue, and records
//! wake time − send time for each message that woke it from `poll(2)`. The distribution
//! (HdrHistogram) is printed per waiter configuration:
//!
//! * `inline spin`: the defaults (an inline engine, `IdlePolicy::Spin`), the progress
//!   helper running the engine while the application waits on the fd;
//! * `inline backoff`: inline, `IdlePolicy::Backoff`;
//! * `poll backoff`: an engine thread with `IdlePolicy::Backoff`.
//!
//! The sender uses the defaults (inline, spin) in every case.
//!
//! ```text
//! cargo bench -p shmhca-bench --bench wake
//! WAKE_SAMPLES=5000 WAKE_MODES="inline-backoff" cargo bench -p shmhca-bench --bench wake
//! ```

use std::os::fd::AsFd;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use shmhca::*;

const ROLE_ENV: &str = "SHMHCA_WAKE_ROLE";
const PATH_ENV: &str = "SHMHCA_WAKE_PATH";
const SAMPLES_ENV: &str = "WAKE_SAMPLES";
const GAP_ENV: &str = "WAKE_GAP_US";
const RECVS: u64 = 32;
const MSG: u64 = 64;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn backoff() -> IdlePolicy {
    IdlePolicy::Backoff {
        spins: 100,
        max_sleep: Duration::from_millis(100),
    }
}

fn main() {
    if std::env::var(ROLE_ENV).as_deref() == Ok("sender") {
        return sender();
    }
    let modes = std::env::var("WAKE_MODES")
        .unwrap_or_else(|_| "inline-spin inline-backoff poll-backoff".into());
    println!(
        "{:<16} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "waiter", "samples", "p50 µs", "p90 µs", "p99 µs", "max µs", "lost"
    );
    for mode in modes.split_whitespace() {
        let builder = match mode {
            "inline-spin" => Context::builder().mode(EngineMode::Inline),
            "inline-backoff" => Context::builder().mode(EngineMode::Inline).idle(backoff()),
            "poll-backoff" => Context::builder()
                .mode(EngineMode::Poll { cpu: None })
                .idle(backoff()),
            other => {
                eprintln!(
                    "WAKE_MODES: unknown mode {other} (inline-spin, inline-backoff, poll-backoff)"
                );
                std::process::exit(2);
            }
        };
        let (h, lost) = waiter(builder.arena_size(4 << 20));
        println!(
            "{:<16} {:>8} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9}",
            mode,
            h.len(),
            h.value_at_quantile(0.5) as f64 / 1e3,
            h.value_at_quantile(0.9) as f64 / 1e3,
            h.value_at_quantile(0.99) as f64 / 1e3,
            h.max() as f64 / 1e3,
            lost
        );
    }
}

/// Process A: returns the wake latencies (ns) and how many messages were found without a
/// wake from `poll(2)` (completions that arrived while it was awake).
fn waiter(builder: ContextBuilder) -> (Histogram<u64>, u64) {
    let samples = env_u64(SAMPLES_ENV, 2000);
    let dir = std::env::temp_dir().join(format!("shmhca-wake-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("wake.sock");
    let ctx = builder.build().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mut channel = ctx.create_comp_channel().unwrap();
    let mut cq = ctx
        .create_cq_with_channel(2 * RECVS as u32, &channel)
        .unwrap();
    let rx = pd.alloc_mr(RECVS * MSG, AccessFlags::LOCAL_WRITE).unwrap();
    // Taken once, before the connection is set up, as an async server builds its
    // `AsyncFd` first: the peer then knows from link setup that it must wake this engine.
    let fd = channel.as_fd().try_clone_to_owned().unwrap();
    let listener = ctx.listen(&path).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(ROLE_ENV, "sender")
        .env(PATH_ENV, &path)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut conn = listener
        .accept_timeout(
            Duration::from_secs(30),
            &pd,
            &cq,
            &cq,
            &ConnectParams::default(),
        )
        .unwrap();
    for i in 0..RECVS {
        conn.post_recv(&RecvWr::new(i, &[rx.sge(i * MSG, MSG as u32).unwrap()]))
            .unwrap();
    }
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    let mut lost = 0u64;
    let mut got = 0u64;
    let mut wc = [WorkCompletion::default(); 16];
    let warmup = 20;
    let deadline = Instant::now() + Duration::from_secs(30 + samples / 100);
    cq.req_notify(false).unwrap();
    while got < samples + warmup && Instant::now() < deadline {
        let mut pfd = [rustix::event::PollFd::new(
            &fd,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: 1,
            tv_nsec: 0,
        };
        if rustix::event::poll(&mut pfd, Some(&ts)).unwrap_or(0) == 0 {
            continue;
        }
        let woke = now_ns();
        let mut from_wake = true;
        while channel.try_get_event().unwrap().is_some() {}
        loop {
            let mut n = cq.poll(&mut wc);
            if n == 0 {
                // Re-arm, then look once more (completions before the arm raise nothing);
                // what that finds arrived while this process was awake: not a wake-up.
                cq.req_notify(false).unwrap();
                n = cq.poll(&mut wc);
                if n == 0 {
                    break;
                }
                from_wake = false;
            }
            handle(
                &wc[..n],
                &rx,
                &mut conn,
                woke,
                from_wake,
                &mut h,
                &mut lost,
                &mut got,
                warmup,
            );
            from_wake = false;
        }
    }
    let _ = child.wait();
    drop(conn);
    let _ = std::fs::remove_dir_all(&dir);
    (h, lost)
}

#[allow(clippy::too_many_arguments)]
fn handle(
    wcs: &[WorkCompletion],
    rx: &Mr,
    conn: &mut Connection,
    woke: u64,
    from_wake: bool,
    h: &mut Histogram<u64>,
    lost: &mut u64,
    got: &mut u64,
    warmup: u64,
) {
    for (k, w) in wcs.iter().enumerate() {
        assert_eq!(w.status, WcStatus::Success, "{w:?}");
        let mut b = [0u8; 8];
        rx.read_at(w.wr_id * MSG, &mut b).unwrap();
        let sent = u64::from_le_bytes(b);
        *got += 1;
        if *got > warmup {
            if from_wake && k == 0 {
                let _ = h.record(woke.saturating_sub(sent).max(1));
            } else {
                *lost += 1;
            }
        }
        conn.post_recv(&RecvWr::new(
            w.wr_id,
            &[rx.sge(w.wr_id * MSG, MSG as u32).unwrap()],
        ))
        .unwrap();
    }
}

/// Process B: connects and sends a timestamp every gap.
fn sender() {
    let path = std::env::var(PATH_ENV).unwrap();
    let samples = env_u64(SAMPLES_ENV, 2000) + 20;
    let gap = Duration::from_micros(env_u64(GAP_ENV, 2000));
    let ctx = Context::builder()
        .mode(EngineMode::Inline)
        .arena_size(4 << 20)
        .build()
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(64).unwrap();
    let tx = pd.alloc_mr(MSG, AccessFlags::NONE).unwrap();
    let mut conn = ctx
        .connect(&path, &pd, &cq, &cq, &ConnectParams::default())
        .unwrap();
    let mut wc = [WorkCompletion::default(); 4];
    for i in 0..samples {
        std::thread::sleep(gap);
        tx.write_at(0, &now_ns().to_le_bytes()).unwrap();
        conn.post_send(&SendWr::new(i, SendOp::Send, &[tx.sge(0, 8).unwrap()]))
            .unwrap();
        // Wait for the Ack (bounded), sleeping: this process must not take A's CPU.
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if cq.poll(&mut wc) > 0 {
                assert_eq!(wc[0].status, WcStatus::Success, "{:?}", wc[0]);
                break;
            }
            assert!(Instant::now() < until, "no Ack in 10 s");
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}
