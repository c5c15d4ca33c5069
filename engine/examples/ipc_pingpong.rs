//! IPC ping-pong between two processes over shmhca: the client sends a message, the server
//! sends it straight back, the client checks every byte and records the round-trip time.
//!
//! Run it in two terminals:
//!
//! ```text
//! cargo run --release -p shmhca --example ipc_pingpong -- --server /tmp/pingpong.sock
//! cargo run --release -p shmhca --example ipc_pingpong -- --client /tmp/pingpong.sock
//! ```
//!
//! or in one, letting it start its own server process:
//!
//! ```text
//! cargo run --release -p shmhca --example ipc_pingpong
//! ```
//!
//! Client options (the server learns them from the connection's private data):
//! `--size BYTES` (message size, default 64), `--iters N` (timed round trips, default
//! 100000), `--warmup N` (untimed round trips first, default 1000). Either side:
//! `--poll` runs the engine on its own thread instead of inside the polling calls (worth it
//! with 4 or more cores).
//!
//! The server accepts one client, serves it, and exits. Messages up to 256 bytes travel
//! inline; larger ones are sent from a registered memory region and echoed zero-copy from
//! the server's receive buffer.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use shmhca::cm::ConnectParams;
use shmhca::{
    AccessFlags, Connection, Context, EngineMode, Mr, QpCaps, RecvWr, SendFlags, SendOp, SendWr,
    WcOpcode, WcStatus, WorkCompletion,
};

/// Receive buffers kept posted on each side.
const SLOTS: u64 = 16;
/// Messages at most this long are sent inline.
const INLINE: u32 = 256;
/// Send work request ids start here (receives use 0..SLOTS).
const SEND: u64 = 1 << 32;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Debug, Clone, Copy)]
struct Run {
    size: u32,
    iters: u64,
    warmup: u64,
}

impl Run {
    fn to_bytes(self) -> Vec<u8> {
        let mut b = Vec::with_capacity(20);
        b.extend_from_slice(&self.size.to_le_bytes());
        b.extend_from_slice(&self.iters.to_le_bytes());
        b.extend_from_slice(&self.warmup.to_le_bytes());
        b
    }

    fn from_bytes(b: &[u8]) -> Res<Run> {
        if b.len() != 20 {
            return Err(format!(
                "the client sent {} bytes of private data, expected 20",
                b.len()
            )
            .into());
        }
        Ok(Run {
            size: u32::from_le_bytes(b[..4].try_into()?),
            iters: u64::from_le_bytes(b[4..12].try_into()?),
            warmup: u64::from_le_bytes(b[12..20].try_into()?),
        })
    }
}

fn context(poll: bool) -> Res<Context> {
    let mode = if poll {
        EngineMode::Poll { cpu: None }
    } else {
        EngineMode::Inline
    };
    Ok(Context::builder().arena_size(32 << 20).mode(mode).build()?)
}

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 2 * SLOTS as u32,
        max_recv_wr: SLOTS as u32,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: INLINE,
    }
}

/// The byte pattern of message `i`.
fn message(size: u32, i: u64) -> Vec<u8> {
    (0..size as u64)
        .map(|k| (k.wrapping_mul(131) ^ i.wrapping_mul(7)) as u8)
        .collect()
}

fn post_slot(conn: &mut Connection, buf: &Mr, slot: u64, size: u32) -> Res<()> {
    let sgl = [buf.sge(slot * u64::from(size.max(1)), size)?];
    conn.post_recv(&RecvWr::new(slot, &sgl))?;
    Ok(())
}

fn next(cq: &mut shmhca::Cq, out: &mut [WorkCompletion]) -> Res<usize> {
    let n = cq.poll(out);
    for wc in &out[..n] {
        if wc.status != WcStatus::Success {
            return Err(format!("work request {} failed: {:?}", wc.wr_id, wc.status).into());
        }
    }
    Ok(n)
}

/// Accepts one client on `path` and echoes every message it sends.
fn serve(path: &Path, poll: bool) -> Res<()> {
    let ctx = context(poll)?;
    let pd = ctx.alloc_pd()?;
    let mut cq = ctx.create_cq(256)?;
    let listener = ctx.listen(path)?;
    eprintln!("server: listening on {}", path.display());
    let mut conn = listener.accept(&pd, &cq, &cq, &ConnectParams::default().caps(caps()))?;
    let run = Run::from_bytes(conn.peer_private_data())?;
    eprintln!(
        "server: client pid {} connected; {} + {} messages of {} bytes",
        conn.peer_pid(),
        run.warmup,
        run.iters,
        run.size
    );
    let stride = u64::from(run.size.max(1));
    let buf = pd.alloc_mr(SLOTS * stride, AccessFlags::LOCAL_WRITE)?;
    for slot in 0..SLOTS {
        post_slot(&mut conn, &buf, slot, run.size)?;
    }
    let total = run.warmup + run.iters;
    let (mut echoed, mut completed) = (0u64, 0u64);
    let mut wcs = [WorkCompletion::default(); 32];
    let mut inline = vec![0u8; run.size as usize];
    while completed < total {
        let n = cq.poll(&mut wcs);
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                // Once every message is in, the client may hang up: that flushes the
                // spare receives.
                if wc.status == WcStatus::WrFlushErr
                    && wc.opcode == WcOpcode::Recv
                    && echoed == total
                {
                    continue;
                }
                return Err(format!("work request {} failed: {:?}", wc.wr_id, wc.status).into());
            }
            match wc.opcode {
                WcOpcode::Recv => {
                    let slot = wc.wr_id;
                    let len = wc.byte_len;
                    if len <= INLINE {
                        // Copy it out: the receive buffer is free again at once.
                        buf.read_at(slot * stride, &mut inline[..len as usize])?;
                        let wr = SendWr::inline(SEND + slot, SendOp::Send, &inline[..len as usize]);
                        conn.post_send(&wr)?;
                        post_slot(&mut conn, &buf, slot, run.size)?;
                    } else {
                        // Zero-copy: send from the receive buffer, repost it once sent.
                        let sgl = [buf.sge(slot * stride, len)?];
                        conn.post_send(&SendWr::new(SEND + slot, SendOp::Send, &sgl))?;
                    }
                    echoed += 1;
                }
                WcOpcode::Send => {
                    if run.size > INLINE {
                        post_slot(&mut conn, &buf, wc.wr_id - SEND, run.size)?;
                    }
                    completed += 1;
                }
                other => return Err(format!("unexpected completion {other:?}").into()),
            }
        }
    }
    eprintln!("server: echoed {echoed} messages");
    // Keep the engine running until the client has hung up, so it gets every Ack.
    let start = Instant::now();
    while conn.is_peer_connected() && start.elapsed() < Duration::from_secs(10) {
        let _ = cq.poll(&mut wcs);
    }
    Ok(())
}

/// Connects to `path`, runs the ping-pong, returns the timed round trips.
fn ping(path: &Path, run: Run, poll: bool) -> Res<Vec<Duration>> {
    let ctx = context(poll)?;
    let pd = ctx.alloc_pd()?;
    let mut cq = ctx.create_cq(256)?;
    let params = ConnectParams::default()
        .caps(caps())
        .private_data(run.to_bytes());
    let mut conn = ctx.connect(path, &pd, &cq, &cq, &params)?;
    eprintln!(
        "client: connected to server pid {}, PMTU {} bytes, engine {:?}",
        conn.peer_pid(),
        conn.config().path_mtu.bytes(),
        ctx.mode()
    );
    let stride = u64::from(run.size.max(1));
    let rbuf = pd.alloc_mr(SLOTS * stride, AccessFlags::LOCAL_WRITE)?;
    let sbuf = pd.alloc_mr(stride, AccessFlags::NONE)?;
    for slot in 0..SLOTS {
        post_slot(&mut conn, &rbuf, slot, run.size)?;
    }
    let mut rtts = Vec::with_capacity(run.iters as usize);
    let mut wcs = [WorkCompletion::default(); 32];
    let mut got = vec![0u8; run.size as usize];
    for i in 0..run.warmup + run.iters {
        let msg = message(run.size, i);
        if run.size > INLINE {
            sbuf.write_at(0, &msg)?;
        }
        let start = Instant::now();
        if run.size <= INLINE {
            conn.post_send(&SendWr::inline(SEND, SendOp::Send, &msg).flags(SendFlags::SIGNALED))?;
        } else {
            let sgl = [sbuf.sge(0, run.size)?];
            conn.post_send(&SendWr::new(SEND, SendOp::Send, &sgl))?;
        }
        // Wait for the echo (and our Send's completion, which comes first or later).
        let (mut echo, mut sent) = (None, false);
        while echo.is_none() || !sent {
            let n = next(&mut cq, &mut wcs)?;
            for wc in &wcs[..n] {
                match wc.opcode {
                    WcOpcode::Recv => {
                        if echo.is_none() {
                            echo = Some((*wc, start.elapsed()));
                        }
                    }
                    _ => sent = true,
                }
            }
        }
        let (wc, rtt) = echo.expect("the loop waits for it");
        if i >= run.warmup {
            rtts.push(rtt);
        }
        if wc.byte_len != run.size {
            return Err(format!("echo {i} is {} bytes, sent {}", wc.byte_len, run.size).into());
        }
        rbuf.read_at(wc.wr_id * stride, &mut got)?;
        if got != msg {
            return Err(format!("echo {i} differs from the message sent").into());
        }
        post_slot(&mut conn, &rbuf, wc.wr_id, run.size)?;
    }
    Ok(rtts)
}

fn report(run: Run, rtts: &mut [Duration]) {
    rtts.sort();
    let pct = |p: f64| rtts[((rtts.len() as f64 - 1.0) * p).round() as usize];
    let total: Duration = rtts.iter().sum();
    println!(
        "{} round trips of {} bytes: min {:?}  p50 {:?}  p90 {:?}  p99 {:?}  p99.9 {:?}  max {:?}  mean {:?}  ({:.0} round trips/s)",
        rtts.len(),
        run.size,
        pct(0.0),
        pct(0.5),
        pct(0.9),
        pct(0.99),
        pct(0.999),
        pct(1.0),
        total / rtts.len().max(1) as u32,
        rtts.len() as f64 / total.as_secs_f64()
    );
}

/// Starts this program as the server on `path` and runs the client against it.
fn both(run: Run, poll: bool) -> Res<Vec<Duration>> {
    let path = std::env::temp_dir().join(format!("shmhca-pingpong-{}.sock", std::process::id()));
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("--server").arg(&path);
    if poll {
        cmd.arg("--poll");
    }
    let mut server = cmd.spawn()?;
    // The socket appears at bind(), just before the server listens: retry briefly.
    let start = Instant::now();
    let rtts = loop {
        match ping(&path, run, poll) {
            Ok(r) => break r,
            Err(e)
                if start.elapsed() < Duration::from_secs(10)
                    && e.to_string().contains("socket") =>
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                let _ = server.kill();
                let _ = server.wait();
                return Err(e);
            }
        }
    };
    let status = server.wait()?;
    if !status.success() {
        return Err(format!("the server process failed: {status}").into());
    }
    Ok(rtts)
}

fn usage() -> ! {
    eprintln!(
        "usage: ipc_pingpong [--server PATH | --client PATH] [--size BYTES] [--iters N] [--warmup N] [--poll]"
    );
    std::process::exit(2)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut server, mut client, mut poll) = (None::<PathBuf>, None::<PathBuf>, false);
    let mut run = Run {
        size: 64,
        iters: 100_000,
        warmup: 1000,
    };
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| usage());
        match a.as_str() {
            "--server" => server = Some(value().into()),
            "--client" => client = Some(value().into()),
            "--size" => run.size = value().parse().unwrap_or_else(|_| usage()),
            "--iters" => run.iters = value().parse().unwrap_or_else(|_| usage()),
            "--warmup" => run.warmup = value().parse().unwrap_or_else(|_| usage()),
            "--poll" => poll = true,
            _ => usage(),
        }
    }
    if run.iters == 0 || run.size > 1 << 20 {
        eprintln!("--iters must be at least 1 and --size at most 1 MiB");
        usage();
    }
    let result = match (server, client) {
        (Some(p), None) => serve(&p, poll).map(|()| None),
        (None, Some(p)) => ping(&p, run, poll).map(Some),
        (None, None) => both(run, poll).map(Some),
        _ => usage(),
    };
    match result {
        Ok(Some(mut rtts)) => report(run, &mut rtts),
        Ok(None) => {}
        Err(e) => {
            eprintln!("ipc_pingpong: {e}");
            std::process::exit(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the example as a test: this test binary re-executed is the server.
    #[test]
    fn pingpong_between_two_processes() {
        if let Ok(path) = std::env::var("IPC_PINGPONG_SERVER") {
            serve(Path::new(&path), false).unwrap();
            return;
        }
        let path =
            std::env::temp_dir().join(format!("shmhca-pingpong-test-{}.sock", std::process::id()));
        let mut server = Command::new(std::env::current_exe().unwrap())
            .args([
                "tests::pingpong_between_two_processes",
                "--exact",
                "--nocapture",
            ])
            .env("IPC_PINGPONG_SERVER", &path)
            .spawn()
            .unwrap();
        for size in [0u32, 1, 256, 257, 5000] {
            let run = Run {
                size,
                iters: 50,
                warmup: 5,
            };
            let start = Instant::now();
            let rtts = loop {
                match ping(&path, run, false) {
                    Ok(r) => break r,
                    Err(e)
                        if start.elapsed() < Duration::from_secs(30)
                            && e.to_string().contains("socket") =>
                    {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => {
                        let _ = server.kill();
                        panic!("{e}");
                    }
                }
            };
            assert_eq!(rtts.len(), 50, "size {size}");
            assert!(server.wait().unwrap().success(), "size {size}");
            if size != 5000 {
                server = Command::new(std::env::current_exe().unwrap())
                    .args([
                        "tests::pingpong_between_two_processes",
                        "--exact",
                        "--nocapture",
                    ])
                    .env("IPC_PINGPONG_SERVER", &path)
                    .spawn()
                    .unwrap();
            }
        }
        assert!(!path.exists(), "the server removed its socket");
    }
}
