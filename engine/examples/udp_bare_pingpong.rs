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
//! it), `--gso` (as `--acks`, but the Ack-sized datagram and the message leave as ONE UDP
//! GSO send, `UDP_SEGMENT`, the longer first, and arrive by one `recvmmsg`, as shmhca
//! sends an Ack and the reply it rides with: the line for what the wire format forces
//! of an implementation that sends as shmhca does), `--gro` (as `--gso`, with `UDP_GRO`
//! on the receiving socket: the GSO send arrives whole, by one `recvmsg`, its segment size
//! in a control message, and is cut by the program instead of the kernel), `--stream` (the client sends
//! `--iters` datagrams of `--size` bytes as fast as the socket takes them and the server
//! counts the bytes that arrive: the bare line for a bandwidth test; the server prints
//! the goodput).
//!
//! The client prints the mean round trip and, in brackets, the median.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
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
    gso: bool,
    gro: bool,
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
        gso: false,
        gro: false,
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
            "--gso" => (args.acks, args.gso) = (true, true),
            "--gro" => (args.acks, args.gso, args.gro) = (true, true, true),
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

/// `SOL_UDP`'s option and control message for UDP GSO (the segment size, a `u16`).
const UDP_SEGMENT: libc::c_int = 103;

/// Sends `a` and `b` (not longer than `a`) to `to` as one UDP GSO send: two datagrams,
/// one pass through the kernel's send path.
fn gso_send(sock: &UdpSocket, a: &[u8], b: &[u8], to: SocketAddr) -> std::io::Result<()> {
    // SAFETY: plain old data, all zeroes valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let slen = match to {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage has room for and the alignment of a sockaddr_in.
            let sin = unsafe { &mut *(&raw mut ss).cast::<libc::sockaddr_in>() };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = v4.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            // SAFETY: sockaddr_storage has room for and the alignment of a sockaddr_in6.
            let sin6 = unsafe { &mut *(&raw mut ss).cast::<libc::sockaddr_in6>() };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = v6.port().to_be();
            sin6.sin6_addr.s6_addr = v6.ip().octets();
            size_of::<libc::sockaddr_in6>()
        }
    };
    let mut iov = [
        libc::iovec {
            iov_base: a.as_ptr() as *mut _,
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b.as_ptr() as *mut _,
            iov_len: b.len(),
        },
    ];
    // One control message: UDP_SEGMENT, a u16, in CMSG_SPACE(2) <= 24 bytes.
    let mut ctrl = [0u64; 3];
    // SAFETY: plain old data, all zeroes valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&raw mut ss).cast();
    msg.msg_namelen = slen as libc::socklen_t;
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = 2;
    msg.msg_control = ctrl.as_mut_ptr().cast();
    // SAFETY: a pure computation.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(2) } as _;
    // SAFETY: `msg` points at `ctrl`, which has room for CMSG_SPACE(2) bytes: the first
    // header is there.
    let c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    // SAFETY: plain old data, all zeroes valid.
    let mut hdr: libc::cmsghdr = unsafe { std::mem::zeroed() };
    hdr.cmsg_level = libc::SOL_UDP;
    hdr.cmsg_type = UDP_SEGMENT;
    // SAFETY: a pure computation.
    hdr.cmsg_len = unsafe { libc::CMSG_LEN(2) } as _;
    // SAFETY: `c` is the first header inside `ctrl` (non-null: `ctrl` has room for it).
    unsafe { c.write_unaligned(hdr) };
    // SAFETY: the header's data lies inside `ctrl` (CMSG_SPACE(2) bytes from `c`).
    let data = unsafe { libc::CMSG_DATA(c) };
    // SAFETY: two bytes of the header's data, inside `ctrl`.
    unsafe { data.cast::<u16>().write_unaligned(a.len() as u16) };
    // SAFETY: `msg` points at live buffers, address and control data of the lengths given.
    let r = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, 0) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// What [`recv_two`] received: each datagram's length and source, and how many came.
type Two = ([(usize, Option<SocketAddr>); 2], usize);

/// The address in `ss`, if IPv4 or IPv6.
fn from_raw(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match i32::from(ss.ss_family) {
        libc::AF_INET => {
            // SAFETY: the kernel wrote a sockaddr_in (its family says so).
            let sin = unsafe { &*(&raw const *ss).cast::<libc::sockaddr_in>() };
            Some(SocketAddr::from((
                sin.sin_addr.s_addr.to_ne_bytes(),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the kernel wrote a sockaddr_in6 (its family says so).
            let sin6 = unsafe { &*(&raw const *ss).cast::<libc::sockaddr_in6>() };
            Some(SocketAddr::from((
                sin6.sin6_addr.s6_addr,
                u16::from_be(sin6.sin6_port),
            )))
        }
        _ => None,
    }
}

/// Receives up to two datagrams with one `recvmmsg` into `bufs` (non-blocking with
/// `spin`, else waiting for the first).
fn recv_two(sock: &UdpSocket, bufs: &mut [Vec<u8>; 2], spin: bool) -> std::io::Result<Two> {
    let [b0, b1] = bufs;
    let mut iov = [
        libc::iovec {
            iov_base: b0.as_mut_ptr().cast(),
            iov_len: b0.len(),
        },
        libc::iovec {
            iov_base: b1.as_mut_ptr().cast(),
            iov_len: b1.len(),
        },
    ];
    // SAFETY: plain old data, all zeroes valid.
    let mut names: [libc::sockaddr_storage; 2] = unsafe { std::mem::zeroed() };
    // SAFETY: plain old data, all zeroes valid.
    let mut hdrs: [libc::mmsghdr; 2] = unsafe { std::mem::zeroed() };
    for ((h, v), name) in hdrs.iter_mut().zip(iov.iter_mut()).zip(names.iter_mut()) {
        h.msg_hdr.msg_iov = v;
        h.msg_hdr.msg_iovlen = 1;
        h.msg_hdr.msg_name = (name as *mut libc::sockaddr_storage).cast();
        h.msg_hdr.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    }
    let flags = if spin {
        libc::MSG_DONTWAIT
    } else {
        libc::MSG_WAITFORONE
    };
    // SAFETY: two headers over two live buffers of the lengths given.
    let r = unsafe {
        libc::recvmmsg(
            sock.as_raw_fd(),
            hdrs.as_mut_ptr(),
            2,
            flags,
            std::ptr::null_mut(),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((
        [
            (hdrs[0].msg_len as usize, from_raw(&names[0])),
            (hdrs[1].msg_len as usize, from_raw(&names[1])),
        ],
        r as usize,
    ))
}

/// `SOL_UDP`'s option and control message for UDP GRO (the segment size, an `int`).
const UDP_GRO: libc::c_int = 104;

/// `--gro`: receives one datagram with `recvmsg` into `bufs[0]` — with `UDP_GRO` on, a GSO
/// send arrives whole, its segment size in a control message — and splits it: the second
/// segment is copied to `bufs[1]`.
fn recv_gro(sock: &UdpSocket, bufs: &mut [Vec<u8>; 2], spin: bool) -> std::io::Result<Two> {
    let [b0, b1] = bufs;
    let mut iov = libc::iovec {
        iov_base: b0.as_mut_ptr().cast(),
        iov_len: b0.len(),
    };
    // SAFETY: plain old data, all zeroes valid.
    let mut name: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut ctrl = [0u64; 8];
    // SAFETY: plain old data, all zeroes valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&raw mut name).cast();
    msg.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctrl.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(&ctrl) as _;
    let flags = if spin { libc::MSG_DONTWAIT } else { 0 };
    // SAFETY: `msg` points at live buffers of the lengths given.
    let r = unsafe { libc::recvmsg(sock.as_raw_fd(), &raw mut msg, flags) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let len = r as usize;
    let mut seg = len;
    // SAFETY: the kernel wrote `msg_controllen` bytes of control messages into `ctrl`:
    // the headers CMSG_FIRSTHDR and CMSG_NXTHDR return lie inside them, each with its data.
    let mut c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !c.is_null() {
        // SAFETY: as above.
        let hdr = unsafe { c.read_unaligned() };
        if hdr.cmsg_level == libc::SOL_UDP && hdr.cmsg_type == UDP_GRO {
            // SAFETY: as above (UDP_GRO's data is an int).
            let data = unsafe { libc::CMSG_DATA(c) };
            // SAFETY: as above.
            seg = unsafe { data.cast::<i32>().read_unaligned() } as usize;
        }
        // SAFETY: as above.
        c = unsafe { libc::CMSG_NXTHDR(&msg, c) };
    }
    let from = from_raw(&name);
    if seg == 0 || seg >= len {
        return Ok(([(len, from), (0, None)], 1));
    }
    let rest = (len - seg).min(seg);
    b1[..rest].copy_from_slice(&b0[seg..seg + rest]);
    Ok(([(seg, from), (rest, from)], 2))
}

/// `--gso` with `--spin`: busy-polls [`recv_two`] until something arrives, up to `within`.
fn recv_gso(
    sock: &UdpSocket,
    bufs: &mut [Vec<u8>; 2],
    spin: bool,
    gro: bool,
    within: Duration,
) -> std::io::Result<Two> {
    let deadline = Instant::now() + within;
    let mut tries = 0u32;
    loop {
        let r = if gro {
            recv_gro(sock, bufs, spin)
        } else {
            recv_two(sock, bufs, spin)
        };
        match r {
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
        if a.gso {
            // The longer first: GSO cuts at the first's length, the last may be shorter.
            let (first, second) = if msg.len() >= ack.len() {
                (msg, &ack[..])
            } else {
                (&ack[..], msg)
            };
            if let Err(e) = gso_send(&sock, first, second, to) {
                die(&format!("a GSO send failed: {e}"));
            }
            return;
        }
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
    if a.gro {
        let on: libc::c_int = 1;
        // SAFETY: an int option of the size given; the socket is open.
        let r = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_UDP,
                UDP_GRO,
                (&raw const on).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            die(&format!("UDP_GRO: {}", std::io::Error::last_os_error()));
        }
    }
    let mut two = [vec![0u8; 65_536], vec![0u8; 65_536]];
    let Some(server) = a.server else {
        // The server: echo every datagram to where it came from (bounded: it stops after
        // 10 s without one, or after the client's `iters` + warm-up).
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap_or_else(|e| die(&format!("{e}")));
        println!("echoing on {}:{}", a.local, a.port);
        if a.gso {
            // Until the client's `iters` and warm-up are echoed, or 10 s of silence.
            let mut left = u64::from(a.iters) + 100;
            while left > 0 {
                let Ok((got, n)) =
                    recv_gso(&sock, &mut two, a.spin, a.gro, Duration::from_secs(10))
                else {
                    return;
                };
                for (k, &(len, from)) in got.iter().enumerate().take(n) {
                    if let (false, Some(from)) = (len == ack.len(), from) {
                        send(&two[k][..len], from);
                        left = left.saturating_sub(1);
                    }
                }
            }
            return;
        }
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
        if a.gso {
            loop {
                match recv_gso(&sock, &mut two, a.spin, a.gro, Duration::from_secs(2)) {
                    Ok((got, n)) => {
                        let Some(k) = got[..n].iter().position(|&(len, _)| len != ack.len()) else {
                            continue;
                        };
                        let len = got[k].0;
                        if len != a.size || two[k][..len] != msg[..] {
                            die(&format!("round {i}: an echo of {len} bytes that differs"));
                        }
                        return;
                    }
                    Err(e) => die(&format!(
                        "round {i}: no echo within 2 s ({e}); is the server up?"
                    )),
                }
            }
        }
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
    // Each round's time too, for the median (a shared host's stalls move the mean).
    let mut each = Vec::with_capacity(a.iters as usize);
    let start = Instant::now();
    let mut prev = start;
    for i in 0..a.iters {
        round(i);
        let now = Instant::now();
        each.push(now - prev);
        prev = now;
    }
    let took = start.elapsed();
    each.sort_unstable();
    println!(
        "{} round trips of {} bytes: {:.2} µs each (median {:.2} µs)",
        a.iters,
        a.size,
        took.as_secs_f64() * 1e6 / f64::from(a.iters),
        each[each.len() / 2].as_secs_f64() * 1e6
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
