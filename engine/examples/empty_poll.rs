//! Empty polls: what a program's `Cq::poll` costs when nothing arrived. Two inline-mode
//! engines in this process, a connected QP each; one Send from a to b completes on both
//! sides (so the QPs have carried traffic and their Ack has left), then side a polls its
//! empty completion queue the given number of times (default 1,000,000), each poll running
//! a's engine once as an inline engine does. Under callgrind two counts, differenced, give
//! the instructions of one empty poll (`bench/scripts/instructions.sh`).
//!
//! ```sh
//! cargo run --release -p shmhca --example empty_poll -- 1000000
//! ```

mod common;

use shmhca::*;

fn main() -> shmhca::Result<()> {
    let polls = match std::env::args().nth(1).map(|a| a.parse::<u64>()) {
        None => 1_000_000,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            eprintln!("empty_poll: give the number of polls (a whole number)");
            std::process::exit(2);
        }
    };
    // Every part is bound (not `..`): the parts not named would drop here.
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
    let src = pa.alloc_mr(64, AccessFlags::NONE)?;
    let dst = pb.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
    qb.post_recv(&RecvWr::new(1, &[dst.sge(0, 64)?]))?;
    qa.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 8)?]))?;
    let mut wc = [WorkCompletion::default(); 4];
    let (mut sent, mut received) = (false, false);
    while !(sent && received) {
        received |= cb.poll(&mut wc) > 0;
        sent |= ca.poll(&mut wc) > 0;
    }
    // Whatever is still owed or held back on either side leaves now.
    for _ in 0..64 {
        a.progress();
        b.progress();
    }
    let mut found = 0;
    for _ in 0..polls {
        found += ca.poll(&mut wc);
    }
    assert_eq!(found, 0, "the completion queue was to stay empty");
    println!("{polls} empty polls");
    Ok(())
}
