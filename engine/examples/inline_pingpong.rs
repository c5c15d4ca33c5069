//! A Send ping-pong between two inline-mode engines driven from one thread: no cross-core
//! traffic, so under callgrind it counts the instructions of the packet path itself (see
//! `bench/scripts/instructions.sh`). Arguments: round trips (default 100,000) and message
//! size in bytes (default 8), then any of
//!
//! * `--inline`: post each Send with its bytes inline (`SendWr::inline`), as perftest does
//!   for small messages by default; without it each Send carries a one-entry gather list
//!   over a registered region (the figure `instructions.sh` has always reported);
//! * `--write`: an RDMA Write ping-pong as `shmhca-perf write_lat` runs it instead: each
//!   side posts a signaled inline Write of the message (its last bytes a marker, the
//!   iteration's number) into the peer's region and watches its own region for the peer's
//!   marker, polling its CQ (which runs its engine) between looks; no receives posted;
//! * `--locked-probe`: adds one `lock`-prefixed read-modify-write (`fetch_add`) and one
//!   implicitly locked `xchg` (`swap`) per one-way message, outside the engine, so that
//!   `instructions.sh --self-test` can check that it counts exactly 2 more locked
//!   instructions per message.
//!
//! ```sh
//! cargo run --release -p shmhca --example inline_pingpong -- 100000 8
//! cargo run --release -p shmhca --example inline_pingpong -- 100000 8 --inline
//! cargo run --release -p shmhca --example inline_pingpong -- 100000 8 --write
//! ```

use std::sync::atomic::{AtomicU64, Ordering};

mod common;

use shmhca::*;

/// The word the locked probe modifies.
static PROBE: AtomicU64 = AtomicU64::new(0);

/// Two locked instructions (`lock xadd`/`lock add` and `xchg` with a memory operand).
#[inline(never)]
fn locked_probe() {
    std::hint::black_box(PROBE.fetch_add(1, Ordering::Relaxed));
    std::hint::black_box(PROBE.swap(std::hint::black_box(7), Ordering::Relaxed));
}

/// The command line: round trips, message size, `--inline`, `--write`, `--locked-probe`.
struct Args {
    iters: u64,
    size: u32,
    inline: bool,
    write: bool,
    probe: bool,
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut args = Args {
        iters: 100_000,
        size: 8,
        inline: false,
        write: false,
        probe: false,
    };
    let mut positional = 0;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--inline" => args.inline = true,
            "--write" => args.write = true,
            "--locked-probe" => args.probe = true,
            _ if arg.starts_with('-') => {
                return Err(format!(
                    "unknown option {arg}: the options are --inline, --write and --locked-probe"
                ));
            }
            _ => {
                let what = ["round trips", "message size"];
                let Some(name) = what.get(positional) else {
                    return Err(format!(
                        "unexpected argument {arg}: give at most round trips and message size"
                    ));
                };
                let n: u64 = arg
                    .parse()
                    .map_err(|_| format!("{name} must be a number, not {arg}"))?;
                if positional == 0 {
                    args.iters = n;
                } else {
                    args.size = u32::try_from(n)
                        .ok()
                        .filter(|&s| s > 0)
                        .ok_or_else(|| format!("message size {n}: give 1 to 2^32-1 bytes"))?;
                }
                positional += 1;
            }
        }
    }
    if (args.inline || args.write) && args.size > QpCaps::default().max_inline_data {
        return Err(format!(
            "--inline or --write with {} bytes: inline sends carry at most {} bytes (QpCaps::default().max_inline_data)",
            args.size,
            QpCaps::default().max_inline_data
        ));
    }
    Ok(args)
}

fn main() -> shmhca::Result<()> {
    let Args {
        iters,
        size,
        inline,
        write,
        probe,
    } = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("inline_pingpong: {e}");
            std::process::exit(2);
        }
    };
    if write {
        return write_pingpong(iters, size, probe);
    }
    let common::Pair {
        mut qa,
        mut qb,
        mut ca,
        mut cb,
        pa,
        pb,
        a,
        b,
    } = common::connected_pair(64, QpCaps::default())?;
    let len = u64::from(size) * 2;
    let (ma, mb) = (
        pa.alloc_mr(len, AccessFlags::LOCAL_WRITE)?,
        pb.alloc_mr(len, AccessFlags::LOCAL_WRITE)?,
    );
    let mut wc = [WorkCompletion::default(); 4];
    // Each side keeps a few receives posted; each round trip is a Send each way.
    for i in 0..4 {
        qa.post_recv(&RecvWr::new(i, &[ma.sge(u64::from(size), size)?]))?;
        qb.post_recv(&RecvWr::new(i, &[mb.sge(u64::from(size), size)?]))?;
    }
    // Each side waits for its receive as perftest's send_lat does: it polls its CQ (which
    // runs its own engine) while the other process runs (here: one iteration of the other
    // engine per poll). Send completions are counted as they come: a Send completes once
    // acknowledged, and its Ack rides in the answer (owed Acks are held back one engine
    // iteration, see `Engine::hold_acks`), or leaves alone an iteration later.
    let mut sends = [0u64; 2];
    let mut wait_recv = |cq: &mut Cq, me: usize, other: &Context| {
        loop {
            let n = cq.poll(&mut wc);
            let mut recv = false;
            for w in &wc[..n] {
                assert_eq!(w.status, WcStatus::Success, "{w:?}");
                match w.opcode {
                    WcOpcode::Recv => recv = true,
                    _ => sends[me] += 1,
                }
            }
            if recv {
                return;
            }
            other.progress();
        }
    };
    // Inline sends carry the bytes of a private buffer (shmhca-perf copies its region's).
    let payload = vec![0u8; if inline { size as usize } else { 0 }];
    let send = |qp: &mut Qp, mr: &Mr, i: u64| -> shmhca::Result<()> {
        if probe {
            locked_probe();
        }
        if inline {
            qp.post_send(&SendWr::inline(i, SendOp::Send, &payload))
        } else {
            qp.post_send(&SendWr::new(i, SendOp::Send, &[mr.sge(0, size)?]))
        }
    };
    // The default (gather list, no probe) posts inline in the loop as this example always
    // has, so that its instruction count stays comparable with earlier measurements (through
    // the closure it read 28 instructions more per message).
    for i in 0..iters {
        if inline || probe {
            send(&mut qa, &ma, i)?;
        } else {
            qa.post_send(&SendWr::new(i, SendOp::Send, &[ma.sge(0, size)?]))?;
        }
        wait_recv(&mut cb, 1, &a); // the ping arrives
        qb.post_recv(&RecvWr::new(i, &[mb.sge(u64::from(size), size)?]))?;
        if inline || probe {
            send(&mut qb, &mb, i)?;
        } else {
            qb.post_send(&SendWr::new(i, SendOp::Send, &[mb.sge(0, size)?]))?;
        }
        wait_recv(&mut ca, 0, &b); // the pong arrives
        qa.post_recv(&RecvWr::new(i, &[ma.sge(u64::from(size), size)?]))?;
    }
    // Every Send completes (the last ones by Acks of their own).
    complete_all([&mut ca, &mut cb], sends, iters, "sends");
    println!("{iters} round trips");
    Ok(())
}

/// Polls both sides' CQs until each has `iters` successful completions (`done` counted
/// so far, `what` naming them); panics after a minute.
fn complete_all(cqs: [&mut Cq; 2], mut done: [u64; 2], iters: u64, what: &str) {
    let start = std::time::Instant::now();
    let mut wc = [WorkCompletion::default(); 4];
    let [ca, cb] = cqs;
    while done != [iters, iters] {
        for (side, cq) in [&mut *ca, &mut *cb].into_iter().enumerate() {
            let n = cq.poll(&mut wc);
            for w in &wc[..n] {
                assert_eq!(w.status, WcStatus::Success, "{w:?}");
                done[side] += 1;
            }
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "{what} completed: {done:?} of {iters} each"
        );
    }
}

/// The `--write` ping-pong: `iters` round trips of two signaled inline RDMA Writes of
/// `size` bytes, as `shmhca-perf write_lat` posts them (one Write outstanding, every one
/// signaled: its TX depth and CQ moderation are 1), each side watching its region's last
/// bytes for the peer's marker.
fn write_pingpong(iters: u64, size: u32, probe: bool) -> shmhca::Result<()> {
    let common::Pair {
        mut qa,
        mut qb,
        mut ca,
        mut cb,
        pa,
        pb,
        a,
        b,
    } = common::connected_pair_with(64, QpCaps::default(), AccessFlags::REMOTE_WRITE)?;
    let len = u64::from(size) * 2;
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let (ma, mb) = (pa.alloc_mr(len, access)?, pb.alloc_mr(len, access)?);
    // Each Write lands in the second half of the peer's region, the marker in its last k
    // bytes (as write_lat: the iteration's number plus one, little-endian).
    let (ra, rb) = (ma.remote(u64::from(size)), mb.remote(u64::from(size)));
    let k = (size as usize).min(8);
    let at = u64::from(size) * 2 - k as u64;
    let mut payload = vec![0u8; size as usize];
    let mut seen = [0u8; 8];
    let mut wc = [WorkCompletion::default(); 4];
    let mut writes = [0u64; 2];
    // Polls `cq` (running its engine) and looks at `mr`'s marker, running the other engine
    // between looks, until the marker reads `m`.
    let mut wait_marker = |cq: &mut Cq, mr: &Mr, me: usize, other: &Context, m: &[u8]| {
        loop {
            let n = cq.poll(&mut wc);
            for w in &wc[..n] {
                assert_eq!(w.status, WcStatus::Success, "{w:?}");
                writes[me] += 1;
            }
            mr.read_at(at, &mut seen[..k])
                .expect("the marker is inside the region");
            if seen[..k] == *m {
                return;
            }
            other.progress();
        }
    };
    for i in 0..iters {
        let m = (i + 1).to_le_bytes();
        payload[size as usize - k..].copy_from_slice(&m[..k]);
        if probe {
            locked_probe();
        }
        qa.post_send(&SendWr::inline(i, SendOp::RdmaWrite(rb), &payload))?;
        wait_marker(&mut cb, &mb, 1, &a, &m[..k]); // the ping lands
        qb.post_send(&SendWr::inline(i, SendOp::RdmaWrite(ra), &payload))?;
        wait_marker(&mut ca, &ma, 0, &b, &m[..k]); // the pong lands
    }
    // Every Write completes (the last ones by Acks of their own).
    complete_all([&mut ca, &mut cb], writes, iters, "writes");
    println!("{iters} round trips");
    Ok(())
}
