//! The bare line for `udp_pingpong`: the same ping-pong with plain UDP datagrams between
//! the same two addresses, no RC transport. The server echoes each datagram; the client
//! sends one, waits for its echo, checks it, and reports the mean round trip. Both wait in
//! a blocking receive, or with `--spin` busy-poll a non-blocking socket (as shmhca's
//! engine polls its socket: the fair line for a spinning `udp_pingpong`).
//! `bench/scripts/compare_udp.sh` runs both in paired rounds (issue 28's target: shmhca's
//! round trip within 1.3x of this one).
//!
//! ```text
//! server$ cargo run --release -p shmhca --example udp_bare_pingpong -- 198.18.0.1
//! client$ cargo run --release -p shmhca --example udp_bare_pingpong -- 198.18.0.2 198.18.0.1
//! ```
//!
//! The first argument is this host's address, the second, on the client, the server's.
//! Options after them: `--size BYTES` (default 64, at most 65,000), `--iters N` (default
//! 10,000), `--port P` (default 18516: not RoCEv2's 4791, which shmhca's port may hold),
//! `--spin`, `--acks` (each side sends an Ack-sized datagram ahead of each message, as an
//! RC round trip over RoCEv2 does: four datagrams a round trip instead of two, each with
//! a `send_to` of its own — the line for what the wire format costs, whoever implements
//! it), `--stream` (the client sends `--iters` datagrams of `--size` bytes as fast as
//! the socket takes them and the server counts the bytes that arrive: the bare line for a
//! bandwidth test; the server prints the goodput).

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

fn die(msg: &str) -> ! {
    eprintln!("udp_bare_pingpong: {msg}");
    std::process::exit(1)
}

/// The command line.
struct Args {
    local: IpAddr,
    server: Option<IpAddr>,
    size: usize,
    iters: u32,
    port: u16,
    spin: bool,
    acks: bool,
    stream: bool,
}

fn parse() -> Args {
    let mut args = Args {
        local: IpAddr::from([0, 0, 0, 0]),
        server: None,
        size: 64,
        iters: 10_000,
        port: 18516,
        spin: false,
        acks: false,
        stream: false,
    };
    let mut addrs = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| -> u64 {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| die(&format!("{name} needs a number")))
        };
        match a.as_str() {
            "--spin" => args.spin = true,
            "--stream" => args.stream = true,
            "--acks" => args.acks = true,
            "--size" => args.size = value("--size") as usize,
            "--iters" => args.iters = u32::try_from(value("--iters")).unwrap_or(u32::MAX),
            "--port" => {
                args.port =
                    u16::try_from(value("--port")).unwrap_or_else(|_| die("--port: 1 to 65535"))
            }
            _ => addrs.push(
                a.parse::<IpAddr>()
                    .unwrap_or_else(|_| die(&format!("{a}: not an IP address or an option"))),
            ),
        }
    }
    match addrs[..] {
        [local] => args.local = local,
        [local, server] => (args.local, args.server) = (local, Some(server)),
        _ => die("give this host's address, and on the client the server's"),
    }
    if !(1..=65_000).contains(&args.size) || args.iters == 0 {
        die("--size is 1 to 65000 bytes, --iters at least 1");
    }
    args
}

/// Receives one datagram within `within`: a blocking receive with that timeout, or with
/// `spin` a busy poll of the non-blocking socket.
fn recv(
    sock: &UdpSocket,
    buf: &mut [u8],
    spin: bool,
    within: Duration,
) -> std::io::Result<(usize, SocketAddr)> {
    if !spin {
        return sock.recv_from(buf);
    }
    let deadline = Instant::now() + within;
    let mut tries = 0u32;
    loop {
        match sock.recv_from(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                tries = tries.wrapping_add(1);
                if tries % 1024 == 0 && Instant::now() > deadline {
                    return Err(e);
                }
            }
            r => return r,
        }
    }
}

fn main() {
    let a = parse();
    let sock = UdpSocket::bind(SocketAddr::new(a.local, a.port))
        .unwrap_or_else(|e| die(&format!("binding {}:{}: {e}", a.local, a.port)));
    if a.spin {
        sock.set_nonblocking(true)
            .unwrap_or_else(|e| die(&format!("{e}")));
    }
    let mut buf = vec![0u8; 65_536];
    // `--acks`: an RC Acknowledge's size on the wire (BTH 12, AETH 4, ICRC 4), told apart
    // from a message by its length (16 when the messages are 20 bytes).
    let ack = vec![0xACu8; if a.size == 20 { 16 } else { 20 }];
    let send = |msg: &[u8], to: SocketAddr| {
        if a.acks && sock.send_to(&ack, to).is_err() {
            die("sending an Ack failed");
        }
        if sock.send_to(msg, to).is_err() {
            die("sending failed");
        }
    };
    if a.stream {
        stream(&a, &sock, &mut buf);
        return;
    }
    let Some(server) = a.server else {
        // The server: echo every datagram to where it came from (bounded: it stops after
        // 10 s without one, or after the client's `iters` + warm-up).
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap_or_else(|e| die(&format!("{e}")));
        println!("echoing on {}:{}", a.local, a.port);
        let per_round = if a.acks { 2 } else { 1 };
        for _ in 0..(u64::from(a.iters) + 1_000) * per_round {
            let Ok((n, from)) = recv(&sock, &mut buf, a.spin, Duration::from_secs(10)) else {
                return;
            };
            if a.acks && n == ack.len() {
                continue;
            }
            send(&buf[..n], from);
        }
        return;
    };
    let to = SocketAddr::new(server, a.port);
    sock.set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap_or_else(|e| die(&format!("{e}")));
    let mut msg = vec![0u8; a.size];
    let mut round = |i: u32| {
        let k = a.size.min(4);
        msg[..k].copy_from_slice(&i.to_le_bytes()[..k]);
        send(&msg, to);
        let mut got = recv(&sock, &mut buf, a.spin, Duration::from_secs(2));
        if a.acks && matches!(got, Ok((n, _)) if n == ack.len()) {
            got = recv(&sock, &mut buf, a.spin, Duration::from_secs(2));
        }
        match got {
            Ok((n, _)) if n == a.size && buf[..n] == msg[..] => {}
            Ok((n, _)) => die(&format!("round {i}: an echo of {n} bytes that differs")),
            Err(e) => die(&format!(
                "round {i}: no echo within 2 s ({e}); is the server up?"
            )),
        }
    };
    // Warm-up, then the measured rounds.
    for i in 0..100 {
        round(i);
    }
    let start = Instant::now();
    for i in 0..a.iters {
        round(i);
    }
    let took = start.elapsed();
    println!(
        "{} round trips of {} bytes: {:.2} µs each",
        a.iters,
        a.size,
        took.as_secs_f64() * 1e6 / f64::from(a.iters)
    );
}

/// `--stream`: the client sends `iters` datagrams of `size` bytes (then ten empty ones,
/// the end mark); the server counts what arrives from the first datagram to the end mark
/// (or 2 s of silence) and prints the goodput.
fn stream(a: &Args, sock: &UdpSocket, buf: &mut [u8]) {
    let Some(server) = a.server else {
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap_or_else(|e| die(&format!("{e}")));
        println!("counting on {}:{}", a.local, a.port);
        let (mut bytes, mut n) = (0u64, 0u64);
        let mut start = None;
        loop {
            match sock.recv_from(buf) {
                Ok((0, _)) if start.is_some() => break,
                Ok((0, _)) => {}
                Ok((len, _)) => {
                    start.get_or_insert_with(Instant::now);
                    bytes += len as u64;
                    n += 1;
                    sock.set_read_timeout(Some(Duration::from_secs(2)))
                        .unwrap_or_else(|e| die(&format!("{e}")));
                }
                Err(_) => break,
            }
        }
        let secs = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
        println!(
            "{n} datagrams, {bytes} bytes in {secs:.3} s: {:.2} MB/s",
            bytes as f64 / secs.max(1e-9) / 1e6
        );
        return;
    };
    let to = SocketAddr::new(server, a.port);
    let msg = vec![7u8; a.size];
    for _ in 0..a.iters {
        // A full socket buffer: wait for room rather than drop (a blocking socket).
        if sock.send_to(&msg, to).is_err() {
            die("sending failed");
        }
    }
    for _ in 0..10 {
        let _ = sock.send_to(&[], to);
    }
    println!("sent {} datagrams of {} bytes", a.iters, a.size);
}
