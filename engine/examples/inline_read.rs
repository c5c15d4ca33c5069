//! RDMA Reads (or Atomics) between two inline-mode engines driven from one thread, as
//! `shmhca-perf read_lat` / `atomic_lat` run them: side a posts one request, then polls its
//! CQ until the completion, driving side b's engine once between its polls. No cross-core
//! traffic, so under callgrind it counts the instructions of one round trip
//! (`bench/scripts/instructions.sh`). Arguments: iterations (default 100,000) and the Read's
//! size in bytes (default 8), then `--atomic` for a Fetch and Add (of 8 bytes) instead of a
//! Read.
//!
//! ```sh
//! cargo run --release -p shmhca --example inline_read -- 100000 8
//! cargo run --release -p shmhca --example inline_read -- 100000 8 --atomic
//! ```

mod common;

use shmhca::*;

fn main() -> shmhca::Result<()> {
    let mut iters = 100_000u64;
    let mut size = 8u32;
    let mut atomic = false;
    let mut positional = 0;
    for arg in std::env::args().skip(1) {
        if arg == "--atomic" {
            atomic = true;
            continue;
        }
        let parsed = arg.parse::<u64>().ok();
        match (positional, parsed) {
            (0, Some(n)) => iters = n,
            (1, Some(n)) if (1..=4096).contains(&n) => size = n as u32,
            _ => {
                eprintln!(
                    "inline_read: {arg}: give the iterations, the size (1 to 4096 bytes; 8 for --atomic) and optionally --atomic"
                );
                std::process::exit(2);
            }
        }
        positional += 1;
    }
    if atomic && size != 8 {
        eprintln!("inline_read: an Atomic works on 8 bytes, not {size}");
        std::process::exit(2);
    }
    let access = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
    // Every part is bound (not `..`): the parts not named would drop here.
    let common::Pair {
        mut qa,
        qb: _qb,
        mut ca,
        cb: _cb,
        pa,
        pb,
        a: _a,
        b,
    } = common::connected_pair_with(64, QpCaps::default(), access)?;
    let ma = pa.alloc_mr(u64::from(size), AccessFlags::LOCAL_WRITE)?;
    let mb = pb.alloc_mr(u64::from(size), access | AccessFlags::LOCAL_WRITE)?;
    let mut wc = [WorkCompletion::default(); 4];
    for i in 0..iters {
        let op = if atomic {
            SendOp::FetchAdd {
                remote: mb.remote(0),
                add: 1,
            }
        } else {
            SendOp::RdmaRead(mb.remote(0))
        };
        qa.post_send(&SendWr::new(i, op, &[ma.sge(0, size)?]))?;
        loop {
            let n = ca.poll(&mut wc);
            if n > 0 {
                assert_eq!(wc[0].status, WcStatus::Success, "{:?}", wc[0]);
                break;
            }
            b.progress();
        }
    }
    println!("{iters} {}", if atomic { "atomics" } else { "reads" });
    Ok(())
}
