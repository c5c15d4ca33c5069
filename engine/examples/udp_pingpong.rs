//! A ping-pong between two hosts over RoCEv2 (UDP port 4791): the client sends a message,
//! the server sends it back, the client checks every byte and reports the round-trip time.
//! The two sides exchange their QP numbers over TCP (port 18515 on the server's address)
//! (and their UDP addresses) first, as `ibv_rc_pingpong` does.
//!
//! ```text
//! server$ cargo run --release -p shmhca --example udp_pingpong -- 198.18.0.1
//! client$ cargo run --release -p shmhca --example udp_pingpong -- 198.18.0.2 198.18.0.1
//! ```
//!
//! The first argument is this host's address (its UDP port 4791 must be free: not held by
//! Linux soft-RoCE), the second, on the client, the server's. Options after them:
//! `--size BYTES` (default 64, at most 65536), `--iters N` (default 10000).

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use shmhca::{
    AccessFlags, Context, Cq, EngineMode, Mtu, QpAttr, QpCaps, QpState, Qpn, RecvWr, SendOp,
    SendWr, UdpPort, WcStatus, WorkCompletion,
};

/// The TCP port of the QPN exchange (the one `ibv_rc_pingpong` uses).
const EXCHANGE_PORT: u16 = 18515;

fn die(msg: &str) -> ! {
    eprintln!("udp_pingpong: {msg}");
    std::process::exit(1)
}

/// Ends the program with `what` and the error, on an I/O error.
trait OrDie<T> {
    fn or_die(self, what: &str) -> T;
}

impl<T> OrDie<T> for std::io::Result<T> {
    fn or_die(self, what: &str) -> T {
        self.unwrap_or_else(|e| die(&format!("{what}: {e}")))
    }
}

fn next_wc(cq: &mut Cq) -> WorkCompletion {
    let mut wc = [WorkCompletion::default()];
    let deadline = Instant::now() + Duration::from_secs(10);
    // Each poll runs the engine (inline mode), which receives the port's datagrams itself.
    while cq.poll(&mut wc) == 0 {
        if Instant::now() > deadline {
            die("no completion within 10 s (is the peer running, and the path free of filters?)");
        }
    }
    if wc[0].status != WcStatus::Success {
        die(&format!("a work request failed: {:?}", wc[0]));
    }
    wc[0]
}

fn main() -> shmhca::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut addrs = Vec::new();
    let (mut size, mut iters) = (64u32, 10_000u32);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut num = |what: &str| -> u32 {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| die(&format!("{what} needs a number")))
        };
        match a.as_str() {
            "--size" => size = num("--size"),
            "--iters" => iters = num("--iters"),
            _ => addrs.push(
                a.parse::<IpAddr>()
                    .unwrap_or_else(|_| die(&format!("{a} is not an IP address"))),
            ),
        }
    }
    if !(1..=65536).contains(&size) {
        die("--size is 1 to 65536 bytes");
    }
    let (local, server) = match addrs[..] {
        [local] => (local, None),
        [local, server] => (local, Some(server)),
        _ => die("give this host's address, and on the client the server's"),
    };

    // Inline: this thread's posts and polls run the engine, and the engine makes the
    // socket's system calls; no other thread is on a packet's way.
    let ctx = Context::builder().mode(EngineMode::Inline).build()?;
    let port = UdpPort::bind(&ctx, local)?;
    let pd = ctx.alloc_pd()?;
    let mut cq = ctx.create_cq(64)?;
    let mut qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default())?;
    let mr = pd.alloc_mr(2 * 65536, AccessFlags::LOCAL_WRITE)?;

    // Exchange QPNs: one line each, "QPN\n".
    let mut stream = match server {
        None => {
            let l =
                TcpListener::bind((local, EXCHANGE_PORT)).or_die("listening for the QPN exchange");
            println!("waiting for a client on {local}:{EXCHANGE_PORT}");
            l.accept().or_die("accepting the client").0
        }
        Some(s) => TcpStream::connect((s, EXCHANGE_PORT)).or_die("connecting to the server"),
    };
    // Exchange "QPN ADDRESS" lines (the address the peer's UDP port is bound to: not
    // necessarily the TCP connection's source address).
    writeln!(stream, "{} {local}", qp.qpn().get()).or_die("sending the QPN");
    // One reader for the whole exchange (a second one could miss what the first buffered).
    let mut reader = BufReader::new(stream.try_clone().or_die("cloning the TCP stream"));
    let mut line = String::new();
    reader.read_line(&mut line).or_die("reading the peer's QPN");
    let (peer_qpn, peer_ip) = match line.split_whitespace().collect::<Vec<_>>()[..] {
        [q, a] => match (q.parse::<u32>(), a.parse::<IpAddr>()) {
            (Ok(q), Ok(a)) => (Qpn::new(q), a),
            _ => die(&format!("the peer sent {line:?}, not \"QPN ADDRESS\"")),
        },
        _ => die(&format!("the peer sent {line:?}, not \"QPN ADDRESS\"")),
    };

    let dest = port.destination(&qp, peer_ip, peer_qpn)?;
    qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::NONE))?;
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(Mtu::Mtu1024)
            .dest(dest)
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
    // Both sides post their first receive, then say so: no Send meets an empty queue. The
    // client receives its echoes at 64 KiB; the server alternates between two buffers
    // (message i lands in buffer i % 2, echoed from there while the next one is posted).
    let client = server.is_some();
    let buf = |i: u64| if client { 65536 } else { (i % 2) * 65536 };
    // Two receives stay posted on each side (as perftest keeps its receive queue full): a
    // side whose last receive was consumed would otherwise owe its peer a credit update
    // (a datagram of its own) at each repost.
    for i in 0..2 {
        qp.post_recv(&RecvWr::new(i, &[mr.sge(buf(i), 65536)?]))?;
    }
    stream.write_all(b"ready\n").or_die("sending ready");
    line.clear();
    reader.read_line(&mut line).or_die("reading ready");

    let msg: Vec<u8> = (0..size).map(|i| (i * 13 + 7) as u8).collect();
    let mut back = vec![0u8; size as usize];
    let start = Instant::now();
    for i in 0..u64::from(iters) {
        if client {
            mr.write_at(0, &msg)?;
            qp.post_send(&SendWr::new(i, SendOp::Send, &[mr.sge(0, size)?]))?;
            // The Send's completion and the echo, in either order.
            let mut got_echo = false;
            for _ in 0..2 {
                let wc = next_wc(&mut cq);
                got_echo |= wc.opcode == shmhca::WcOpcode::Recv;
            }
            if !got_echo {
                die("no echo");
            }
            mr.read_at(65536, &mut back)?;
            if back != msg {
                die(&format!("round trip {i}: the echo differs"));
            }
            qp.post_recv(&RecvWr::new(i + 2, &[mr.sge(buf(i + 2), 65536)?]))?;
        } else {
            let wc = next_wc(&mut cq);
            // Echo from the buffer the message landed in; it takes a message again once
            // the echo has completed.
            qp.post_send(&SendWr::new(
                i,
                SendOp::Send,
                &[mr.sge(buf(i), wc.byte_len)?],
            ))?;
            next_wc(&mut cq);
            qp.post_recv(&RecvWr::new(i + 2, &[mr.sge(buf(i + 2), 65536)?]))?;
        }
    }
    let took = start.elapsed();
    // The last message's Ack must leave before either side exits: the server says when
    // its last echo has completed, and the client runs its engine until then.
    if client {
        stream.set_nonblocking(true).or_die("the TCP stream");
        line.clear();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !line.ends_with('\n') && Instant::now() < deadline {
            ctx.progress();
            match reader.read_line(&mut line) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => die(&format!("reading done: {e}")),
            }
        }
    } else {
        stream.write_all(b"done\n").or_die("sending done");
    }
    if client {
        println!(
            "{iters} round trips of {size} bytes: {:.2} µs each ({:?})",
            took.as_secs_f64() * 1e6 / f64::from(iters),
            port.counters()
        );
    }
    Ok(())
}
