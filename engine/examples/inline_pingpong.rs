//! A Send ping-pong between two inline-mode engines driven from one thread: no cross-core
//! traffic, so under callgrind it counts the instructions of the packet path itself (see
//! `bench/scripts/instructions.sh`). Arguments: round trips (default 100,000) and message
//! size in bytes (default 8).
//!
//! ```sh
//! cargo run --release -p shmhca --example inline_pingpong -- 100000 8
//! ```

use shmhca::*;

fn main() -> shmhca::Result<()> {
    let arg = |i: usize, default: u64| -> u64 {
        std::env::args()
            .nth(i)
            .map(|a| a.parse().expect("the arguments are numbers"))
            .unwrap_or(default)
    };
    let iters = arg(1, 100_000);
    let size = arg(2, 8) as u32;
    let ctx = |_| {
        Context::builder()
            .mode(EngineMode::Inline)
            .arena_size(4 << 20)
            .huge_pages(shmhca_rings::HugePages::Never)
            .build()
    };
    let (a, b) = (ctx(0)?, ctx(1)?);
    let (la, lb) = a.link_with(&b)?;
    let (pa, pb) = (a.alloc_pd()?, b.alloc_pd()?);
    let (mut ca, mut cb) = (a.create_cq(64)?, b.create_cq(64)?);
    let mut qa = a.create_qp(&pa, &ca, &ca, QpCaps::default())?;
    let mut qb = b.create_qp(&pb, &cb, &cb, QpCaps::default())?;
    let (na, nb) = (qa.qpn(), qb.qpn());
    for (qp, link, remote) in [(&mut qa, la, nb), (&mut qb, lb, na)] {
        qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::NONE))?;
        qp.modify(
            &QpAttr::new(QpState::Rtr)
                .path_mtu(Mtu::Mtu4096)
                .dest(Destination { link, qpn: remote })
                .rq_psn(0)
                .max_dest_rd_atomic(1)
                .min_rnr_timer(1),
        )?;
        qp.modify(
            &QpAttr::new(QpState::Rts)
                .sq_psn(0)
                .timeout(14)
                .retry_cnt(7)
                .rnr_retry(7)
                .max_rd_atomic(1),
        )?;
    }
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
    // A Send completes only once acknowledged: wait for both completions of each side.
    let mut wait = |cq: &mut Cq, want: usize| {
        let mut got = 0;
        while got < want {
            let n = cq.poll(&mut wc);
            for w in &wc[..n] {
                assert_eq!(w.status, WcStatus::Success, "{w:?}");
                got += 1;
            }
            a.progress();
            b.progress();
        }
    };
    for i in 0..iters {
        qa.post_send(&SendWr::new(i, SendOp::Send, &[ma.sge(0, size)?]))?;
        wait(&mut cb, 1); // the ping arrives
        qb.post_recv(&RecvWr::new(i, &[mb.sge(u64::from(size), size)?]))?;
        qb.post_send(&SendWr::new(i, SendOp::Send, &[mb.sge(0, size)?]))?;
        wait(&mut ca, 2); // the pong arrives, and the ping is acknowledged
        qa.post_recv(&RecvWr::new(i, &[ma.sge(u64::from(size), size)?]))?;
        wait(&mut cb, 1); // the pong is acknowledged
    }
    println!("{iters} round trips");
    Ok(())
}
