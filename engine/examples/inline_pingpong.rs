//! A Send ping-pong between two inline-mode engines driven from one thread: no cross-core
//! traffic, so under callgrind it counts the instructions of the packet path itself (see
//! `bench/scripts/instructions.sh`). Arguments: round trips (default 100,000) and message
//! size in bytes (default 8), then any of
//!
//! * `--inline`: post each Send with its bytes inline (`SendWr::inline`), as perftest does
//!   for small messages by default; without it each Send carries a one-entry gather list
//!   over a registered region (the figure `instructions.sh` has always reported);
//! * `--locked-probe`: adds one `lock`-prefixed read-modify-write (`fetch_add`) and one
//!   implicitly locked `xchg` (`swap`) per one-way message, outside the engine, so that
//!   `instructions.sh --self-test` can check that it counts exactly 2 more locked
//!   instructions per message.
//!
//! ```sh
//! cargo run --release -p shmhca --example inline_pingpong -- 100000 8
//! cargo run --release -p shmhca --example inline_pingpong -- 100000 8 --inline
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

/// The command line: round trips, message size, `--inline`, `--locked-probe`.
struct Args {
    iters: u64,
    size: u32,
    inline: bool,
    probe: bool,
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut args = Args {
        iters: 100_000,
        size: 8,
        inline: false,
        probe: false,
    };
    let mut positional = 0;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--inline" => args.inline = true,
            "--locked-probe" => args.probe = true,
            _ if arg.starts_with('-') => {
                return Err(format!(
                    "unknown option {arg}: the options are --inline and --locked-probe"
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
    if args.inline && args.size > QpCaps::default().max_inline_data {
        return Err(format!(
            "--inline with {} bytes: inline sends carry at most {} bytes (QpCaps::default().max_inline_data)",
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
        probe,
    } = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("inline_pingpong: {e}");
            std::process::exit(2);
        }
    };
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
    let start = std::time::Instant::now();
    let mut wc = [WorkCompletion::default(); 4];
    while sends != [iters, iters] {
        for (side, cq) in [&mut ca, &mut cb].into_iter().enumerate() {
            let n = cq.poll(&mut wc);
            for w in &wc[..n] {
                assert_eq!(w.status, WcStatus::Success, "{w:?}");
                sends[side] += 1;
            }
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "sends completed: {sends:?} of {iters} each"
        );
    }
    println!("{iters} round trips");
    Ok(())
}
