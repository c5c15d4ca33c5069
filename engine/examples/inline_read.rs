//! RDMA Reads (or Atomics) between two inline-mode engines driven from one thread, as
//! `shmhca-perf read_lat` / `atomic_lat` run them: side a posts one request, then polls its
//! CQ until the completion, driving side b's engine once between its polls. No cross-core
//! traffic, so under callgrind it counts the instructions of one round trip
//! (`bench/scripts/instructions.sh`). Arguments: iterations (default 100,000), then
//! `--atomic` for a Fetch and Add of 8 bytes instead of an 8-byte Read.
//!
//! ```sh
//! cargo run --release -p shmhca --example inline_read -- 100000
//! cargo run --release -p shmhca --example inline_read -- 100000 --atomic
//! ```

mod common;

use shmhca::*;

fn main() -> shmhca::Result<()> {
    let mut iters = 100_000u64;
    let mut atomic = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--atomic" => atomic = true,
            _ => match arg.parse() {
                Ok(n) => iters = n,
                Err(_) => {
                    eprintln!("inline_read: {arg}: give the iterations and optionally --atomic");
                    std::process::exit(2);
                }
            },
        }
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
    let ma = pa.alloc_mr(8, AccessFlags::LOCAL_WRITE)?;
    let mb = pb.alloc_mr(8, access)?;
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
        qa.post_send(&SendWr::new(i, op, &[ma.sge(0, 8)?]))?;
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
