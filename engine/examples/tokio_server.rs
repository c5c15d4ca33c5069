//! One tokio task serves many connections: every QP completes on one CQ, the CQ reports to a
//! completion channel, and the task awaits the channel's fd with `AsyncFd` — no thread
//! spins while nothing arrives.
//!
//! The server context runs inline with `IdlePolicy::Backoff` and automatic progress (the
//! default): while the task awaits the fd with the CQ armed, the progress helper sleeps on
//! the engine's wake word; a client's packet wakes it, it runs the engine, and the
//! completion makes the fd readable. A client thread (another context, linked in this
//! process) sends pings on every connection and checks each pong.
//!
//! ```sh
//! cargo run --release -p shmhca --example tokio_server -- 64 1000   # connections, rounds
//! ```

use std::io;
use std::time::{Duration, Instant};

use shmhca::*;
use tokio::io::unix::AsyncFd;

/// Bytes of each message (a ping carries the connection and round numbers).
const MSG: u32 = 16;

struct Side {
    ctx: Context,
    _pd: Pd,
    cq: Cq,
    qps: Vec<Qp>,
    mr: Mr,
}

/// A context with `n` QPs on one CQ (on `channel` if given) and one buffer: receive slot
/// `k` at `k × MSG`, send slot `k` at `(n + k) × MSG`.
fn side(ctx: Context, n: usize, channel: Option<&CompChannel>) -> Result<Side> {
    let pd = ctx.alloc_pd()?;
    let depth = (4 * n as u32).next_power_of_two();
    let cq = match channel {
        Some(ch) => ctx.create_cq_with_channel(depth, ch)?,
        None => ctx.create_cq(depth)?,
    };
    let qps = (0..n)
        .map(|_| ctx.create_qp(&pd, &cq, &cq, QpCaps::default()))
        .collect::<Result<Vec<_>>>()?;
    let mr = pd.alloc_mr(2 * n as u64 * u64::from(MSG), AccessFlags::LOCAL_WRITE)?;
    Ok(Side {
        ctx,
        _pd: pd,
        cq,
        qps,
        mr,
    })
}

fn connect(qp: &mut Qp, link: LinkId, remote: Qpn) -> Result<()> {
    qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::NONE))?;
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(Mtu::Mtu1024)
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
    )
}

fn post_recv(s: &mut Side, k: usize) -> Result<()> {
    let sge = [s.mr.sge(k as u64 * u64::from(MSG), MSG)?];
    s.qps[k].post_recv(&RecvWr::new(k as u64, &sge))
}

/// Sends `bytes` on connection `k` from its send slot.
fn send(s: &mut Side, k: usize, bytes: &[u8; MSG as usize]) -> Result<()> {
    let n = s.qps.len() as u64;
    let off = (n + k as u64) * u64::from(MSG);
    s.mr.write_at(off, bytes)?;
    let sge = [s.mr.sge(off, MSG)?];
    s.qps[k].post_send(&SendWr::new(k as u64, SendOp::Send, &sge))
}

fn message(k: usize, round: u64) -> [u8; MSG as usize] {
    let mut m = [0u8; MSG as usize];
    m[..8].copy_from_slice(&(k as u64).to_le_bytes());
    m[8..].copy_from_slice(&round.to_le_bytes());
    m
}

/// Waits for the channel's next event (the CQ was armed): the task sleeps in the runtime.
async fn next_event(channel: &mut AsyncFd<CompChannel>) -> io::Result<()> {
    loop {
        let mut guard = channel.readable_mut().await?;
        // `try_io` clears the readiness only when the closure reports WouldBlock, so an
        // event that arrives meanwhile is never lost.
        match guard.try_io(|c| match c.get_mut().try_get_event() {
            Ok(Some(_cq)) => Ok(()),
            Ok(None) => Err(io::ErrorKind::WouldBlock.into()),
            Err(e) => Err(io::Error::other(e)),
        }) {
            Ok(r) => return r,
            Err(_would_block) => continue,
        }
    }
}

/// The server: one task answers every ping on every connection with a pong.
async fn serve(
    mut s: Side,
    channel: CompChannel,
    total: u64,
) -> std::result::Result<Side, Box<dyn std::error::Error>> {
    // SAFETY: the channel owns its eventfd (an `OwnedFd` closed only when the channel is
    // dropped, which the `AsyncFd` owns) and `as_raw_fd` always returns that same fd.
    let mut channel = unsafe { AsyncFd::register(channel) }
        .map_err(|e| Box::<dyn std::error::Error>::from(e.to_string()))?;
    let mut wcs = [WorkCompletion::default(); 64];
    let mut answered = 0;
    let mut buf = [0u8; MSG as usize];
    while answered < total {
        // Arm, then look once more: completions that came before the arm raise no event.
        s.cq.req_notify(false)?;
        let mut n = s.cq.poll(&mut wcs);
        if n == 0 {
            next_event(&mut channel).await?;
            n = s.cq.poll(&mut wcs);
        }
        for wc in &wcs[..n] {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            if wc.opcode != WcOpcode::Recv {
                continue; // a pong was acknowledged
            }
            let k = wc.wr_id as usize;
            s.mr.read_at(k as u64 * u64::from(MSG), &mut buf)?;
            post_recv(&mut s, k)?;
            send(&mut s, k, &buf)?;
            answered += 1;
        }
    }
    Ok(s)
}

/// The client: every round, a ping on each connection, then all the pongs.
fn client(mut c: Side, rounds: u64) -> Result<Duration> {
    let n = c.qps.len();
    let mut wcs = [WorkCompletion::default(); 64];
    let mut buf = [0u8; MSG as usize];
    let start = Instant::now();
    for round in 0..rounds {
        for k in 0..n {
            send(&mut c, k, &message(k, round))?;
        }
        let (mut pongs, mut acked) = (0, 0);
        while pongs < n || acked < n {
            let got = c.cq.poll(&mut wcs);
            for wc in &wcs[..got] {
                assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                if wc.opcode == WcOpcode::Recv {
                    let k = wc.wr_id as usize;
                    c.mr.read_at(k as u64 * u64::from(MSG), &mut buf)?;
                    assert_eq!(buf, message(k, round), "the pong echoes the ping");
                    post_recv(&mut c, k)?;
                    pongs += 1;
                } else {
                    acked += 1;
                }
            }
        }
    }
    let took = start.elapsed();
    drop(c.ctx);
    Ok(took)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let arg = |i: usize, default: u64| -> u64 {
        std::env::args()
            .nth(i)
            .map(|a| a.parse().expect("the arguments are numbers"))
            .unwrap_or(default)
    };
    let (n, rounds) = (arg(1, 64) as usize, arg(2, 200));
    let build = |idle| {
        Context::builder()
            .mode(EngineMode::Inline)
            .idle(idle)
            .arena_size(4 << 20)
            .huge_pages(shmhca_rings::HugePages::Never)
            .build()
    };
    let backoff = IdlePolicy::Backoff {
        spins: 1,
        max_sleep: Duration::from_millis(10),
    };
    let (srv_ctx, cli_ctx) = (build(backoff)?, build(IdlePolicy::Spin)?);
    let (ls, lc) = srv_ctx.link_with(&cli_ctx)?;
    let channel = srv_ctx.create_comp_channel()?;
    let mut srv = side(srv_ctx, n, Some(&channel))?;
    let mut cli = side(cli_ctx, n, None)?;
    for k in 0..n {
        let (qs, qc) = (srv.qps[k].qpn(), cli.qps[k].qpn());
        connect(&mut srv.qps[k], ls, qc)?;
        connect(&mut cli.qps[k], lc, qs)?;
        post_recv(&mut srv, k)?;
        post_recv(&mut cli, k)?;
    }
    let client = std::thread::spawn(move || client(cli, rounds));
    let srv = serve(srv, channel, n as u64 * rounds).await?;
    let took = client.join().expect("the client thread")?;
    let total = n as u64 * rounds;
    println!(
        "{total} pings on {n} connections served by one task in {:.3} s ({:.1} µs per round of {n})",
        took.as_secs_f64(),
        took.as_secs_f64() * 1e6 / rounds as f64
    );
    drop(srv);
    Ok(())
}
