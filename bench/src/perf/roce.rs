//! `--roce`: the two sides on two hosts, over RoCEv2 (UDP 4791), split as perftest is:
//! the server waits for a client on TCP (`-p`, 18515), the client connects to HOST.
//!
//! Over that TCP connection each side writes one line, `shmhca-perf roce 2 ADDR PARAMS
//! QPS`: the address its RoCEv2 port is bound to, its run parameters (the same encoding the
//! connection manager's private data carries, in hex: the server checks them against its
//! own, the peer's buffer address and key among them), then the QPN and start PSN of its
//! control QP and of each data QP. The client writes first; the server answers once it has
//! read a line of this exchange. Each side binds a `UdpPort` on the address its end of the
//! TCP connection uses (or `--bind`, which the client then connects from too), takes its
//! QPs to RTS towards the peer's, and writes
//! `ready`; once it has read the peer's `ready`, the run starts, on the control QP as
//! between processes. Everything read from the peer is checked (length, format, count,
//! values) and every wait is bounded (`--connect-timeout`).
//!
//! Datagrams go only to the address at the other end of the TCP connection: a peer whose
//! line names another RoCEv2 address is refused, saying so, unless `--trust-peer-addr`
//! (a client could otherwise point a server's datagrams, its retries and Acks, at any
//! host's UDP 4791); an unspecified, multicast or broadcast address never is taken
//! ([`peer_rocev2_addr`]).
//!
//! A connection to the server that is not a client — silent for half of
//! `--connect-timeout` (at least 1 s), closed before a whole line, or a line of another
//! program — is dropped with one line on stderr, unanswered, and the server goes on waiting
//! for its client (as long as it takes, as perftest's server): a port scanner or a health
//! check does not end the run.
//!
//! After `ready` the TCP connection stays open as the peer's pulse (see
//! [`pulse`](crate::perf::pulse)): its closing before the run's end (EOF or reset, without
//! the peer's `bye`) says the peer's process ended, and this side's waits and loops end at
//! their next idle check, saying so, instead of at the transport retries' end or
//! `--idle-timeout`.

use std::io::{BufRead, BufReader, Read, Take, Write};
use std::net::{IpAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use shmhca::{Mtu, Qp, QpAttr, QpState, Qpn, UdpPort};

use crate::perf::control::Control;
use crate::perf::error::PerfError;
use crate::perf::opts::{Options, Role};
use crate::perf::params::RunParams;
use crate::perf::setup::{self, DataQp, Resources, Side};

/// What every line of the exchange starts with, whatever its version.
const FAMILY: &str = "shmhca-perf roce ";
/// The first words of this version's exchange line (2: the pulse's `bye`).
const MAGIC: &str = "shmhca-perf roce 2";
/// The longest exchange line read (the parameters and 1 + 1024 QPs fit well within).
const MAX_LINE: u64 = 64 << 10;

/// The connected side: `opts.role` says which (`RoceServer` or `RoceClient`).
///
/// # Errors
/// The TCP exchange fails or times out, the peer is not shmhca-perf or runs other
/// parameters, or a QP cannot be connected (the error says which and why).
pub fn side(opts: &Options, res: Resources) -> Result<Side, PerfError> {
    let limit = Duration::from_secs(opts.connect_timeout.max(1));
    let (mut wire, first, bind, trust, peer_role) = match &opts.role {
        Role::RoceServer {
            port,
            bind,
            trust_peer_addr,
        } => {
            let l = TcpListener::bind((IpAddr::from([0u16; 8]), *port))
                .or_else(|_| TcpListener::bind((IpAddr::from([0u8; 4]), *port)))
                .map_err(PerfError::io(format!("listening on TCP port {port}")))?;
            eprintln!(
                "shmhca-perf: {} server waiting for a client on TCP port {port} (--roce)",
                opts.test.name()
            );
            let (wire, line) = accept_client(&l, (limit / 2).max(Duration::from_secs(1)))?;
            (wire, Some(line), *bind, *trust_peer_addr, "client")
        }
        Role::RoceClient {
            host,
            port,
            bind,
            trust_peer_addr,
        } => {
            let addrs: Vec<_> = (host.as_str(), *port)
                .to_socket_addrs()
                .map_err(PerfError::io(format!("resolving {host}")))?
                .collect();
            // From the RoCEv2 address (`--bind`): the server sends to the address the
            // connection comes from.
            let s = addrs
                .iter()
                .find_map(|a| connect_from(*bind, *a, limit).ok())
                .ok_or_else(|| {
                    let from = bind.map_or(String::new(), |b| format!(" from {b}"));
                    PerfError::Peer(format!(
                        "no shmhca-perf server answered on {host}:{port}{from} within {} s (is it running with --roce and the same -p?)",
                        limit.as_secs()
                    ))
                })?;
            let who = format!("the server at {}", canonical_addr(s.peer_addr()));
            (Wire::new(s, who)?, None, *bind, *trust_peer_addr, "server")
        }
        _ => return Err(PerfError::Usage("--roce: not a RoCE role".into())),
    };
    let local = bind.unwrap_or_else(|| canonical(wire.w.local_addr().map(|a| a.ip())));
    let port = UdpPort::bind(&res.ctx, local)
        .map_err(PerfError::engine(format!("binding RoCEv2 on {local}")))?;
    let mtu = Mtu::from_bytes(path_mtu(opts.mtu, &port))
        .map_err(|e| PerfError::engine("the PMTU")(e.into()))?;
    let (ccq, cmr) = res.control_parts()?;
    let mut qps = Vec::with_capacity(opts.qps as usize + 1);
    for i in 0..=opts.qps {
        let (cq, caps, k) = if i == 0 {
            (&ccq, setup::control_caps(), "control")
        } else {
            (&res.cq, setup::data_caps(opts), "data")
        };
        qps.push(
            res.ctx
                .create_qp(&res.pd, cq, cq, caps)
                .map_err(PerfError::engine(format!("creating the {k} QP")))?,
        );
    }
    let psns: Vec<u32> = (0..qps.len()).map(|i| setup::start_psn(i as u32)).collect();
    let mine = res.params(opts);
    let mut line = format!("{MAGIC} {local} {}", hex(&mine.encode()));
    for (q, p) in qps.iter().zip(&psns) {
        line.push_str(&format!(" {:x}:{p:x}", q.qpn().get()));
    }
    line.push('\n');
    // (The server answers whatever the client's parameters: a client with other ones then
    // names the differences too.)
    wire.send(line.as_bytes(), "this side's parameters")?;
    let theirs = match first {
        Some(l) => l,
        None => wire.line(limit, "its parameters")?,
    };
    let (named, peer, remote) = parse(&theirs, qps.len(), &wire.who)?;
    let tcp_peer = canonical(wire.w.peer_addr().map(|a| a.ip()));
    let peer_ip = peer_rocev2_addr(named, tcp_peer, trust, &wire.who, "--trust-peer-addr")
        .map_err(PerfError::Peer)?;
    mine.check_peer(&peer)?;
    for ((qp, psn), (rqpn, rpsn)) in qps.iter_mut().zip(&psns).zip(&remote) {
        connect(qp, &port, peer_ip, *rqpn, *rpsn, *psn, mtu, opts)?;
    }
    wire.send(b"ready\n", "ready")?;
    if wire.line(limit, "its QPs to be ready")? != "ready" {
        return Err(PerfError::NotPerf(format!(
            "{} did not say ready",
            wire.who
        )));
    }
    // From here the connection is the peer's pulse (what was read past `ready` with it).
    let early = wire.r.buffer().to_vec();
    let pulse = crate::perf::pulse::arm(wire.w, peer_role, &early)?;
    let mut qps = qps.into_iter().map(DataQp::Own);
    let mut ctl = Control::new(qps.next().expect("the control QP"), ccq, cmr);
    ctl.post_slots()?;
    Ok(Side {
        res,
        ctl,
        qps: qps.collect(),
        peer,
        exchange: "RoCEv2 (UDP 4791; TCP exchange)",
        rss_after_kib: crate::perf::stats::rss_kib(),
        udp: Some(port),
        pulse: Some(pulse),
    })
}

/// The path MTU in bytes of QPs over `port` asked for `-m requested`: the interface's
/// active MTU where that is smaller (1500 gives 1024), as perftest takes it from the port.
pub(crate) fn path_mtu(requested: u32, port: &UdpPort) -> u32 {
    match port.active_mtu() {
        Some(a) if a.bytes() < requested => a.bytes(),
        _ => requested,
    }
}

/// Where this side sends its datagrams, given the RoCEv2 address the peer's exchange
/// message `named` and the address at the other end of its TCP connection, `tcp_peer`:
/// `tcp_peer` — the peer's message must name it, unless `trust_named` (the user's
/// `option`, e.g. `--trust-peer-addr`) says to send to `named` — and never an
/// unspecified, multicast or broadcast address. `who` names the peer in the errors.
///
/// A program that sent to whatever address the peer names would let any TCP client point
/// its datagrams (requests, retries, Acks) at a third host's UDP 4791.
///
/// # Errors
/// What is wrong, and what to do: the two addresses differ, or the address is not one
/// unicast address.
pub fn peer_rocev2_addr(
    named: IpAddr,
    tcp_peer: IpAddr,
    trust_named: bool,
    who: &str,
    option: &str,
) -> Result<IpAddr, String> {
    let (named, tcp_peer) = (named.to_canonical(), tcp_peer.to_canonical());
    let ip = if trust_named || named == tcp_peer {
        named
    } else {
        return Err(format!(
            "{who} names {named} as its RoCEv2 address, but its TCP connection is with \
             {tcp_peer}: this side sends datagrams only to the address at the other end of \
             the TCP connection (else a peer could point them at any host); run the peer \
             with its RoCEv2 address on the address it talks TCP from, or give {option} to \
             send to {named}"
        ));
    };
    let broadcast = matches!(ip, IpAddr::V4(v4) if v4.is_broadcast());
    if ip.is_unspecified() || ip.is_multicast() || broadcast {
        return Err(format!(
            "{who} names {ip} as its RoCEv2 address: not one unicast address (unspecified, \
             multicast or broadcast), refused"
        ));
    }
    Ok(ip)
}

/// A TCP connection to `to` within `limit`, from address `local` (any port) if given — so
/// that the peer sees the connection come from the address this side's RoCEv2 port is
/// bound to.
///
/// # Errors
/// `local` is of another family than `to`, cannot be bound, or the connection fails or
/// takes longer than `limit`.
pub fn connect_from(
    local: Option<IpAddr>,
    to: std::net::SocketAddr,
    limit: Duration,
) -> std::io::Result<TcpStream> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let Some(local) = local else {
        return TcpStream::connect_timeout(&to, limit);
    };
    let to = std::net::SocketAddr::new(to.ip().to_canonical(), to.port());
    let family = match (local.to_canonical(), to.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => AddressFamily::INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => AddressFamily::INET6,
        _ => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{local} and {to} are of two address families"),
            ));
        }
    };
    let fd = rustix::net::socket_with(
        family,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )?;
    rustix::net::bind(&fd, &std::net::SocketAddr::new(local.to_canonical(), 0))?;
    match rustix::net::connect(&fd, &to) {
        Ok(()) => {}
        Err(rustix::io::Errno::INPROGRESS) => {
            let ts = Timespec::try_from(limit).unwrap_or(Timespec {
                tv_sec: 10,
                tv_nsec: 0,
            });
            let mut p = [PollFd::new(&fd, PollFlags::OUT)];
            loop {
                match rustix::event::poll(&mut p, Some(&ts)) {
                    Ok(0) => return Err(std::io::ErrorKind::TimedOut.into()),
                    Ok(_) => break,
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => return Err(e.into()),
                }
            }
            rustix::net::sockopt::socket_error(&fd)??;
        }
        Err(e) => return Err(e.into()),
    }
    rustix::io::ioctl_fionbio(&fd, false)?;
    Ok(TcpStream::from(fd))
}

/// Accepts connections on `l` until one sends a line of this exchange within `stray_wait`
/// (its first line, read); drops the others (see the module's doc) with one line each.
///
/// # Errors
/// Accepting fails.
fn accept_client(l: &TcpListener, stray_wait: Duration) -> Result<(Wire, String), PerfError> {
    loop {
        let (s, from) = l.accept().map_err(PerfError::io("accepting the client"))?;
        let from = std::net::SocketAddr::new(from.ip().to_canonical(), from.port());
        let mut wire = Wire::new(s, format!("the client at {from}"))?;
        let why = match wire.read_line(Instant::now() + stray_wait) {
            Ok(line) if line.starts_with(FAMILY) => return Ok((wire, line)),
            Ok(line) => format!(
                "it sent {:?}, not shmhca-perf --roce's exchange",
                line.chars().take(40).collect::<String>()
            ),
            Err(e) => format!("it {e}"),
        };
        eprintln!(
            "shmhca-perf: ignored a TCP connection from {from} ({why}); still waiting for a client"
        );
    }
}

/// One side's end of the exchange's TCP connection.
struct Wire {
    /// Written to (and the pulse afterwards).
    w: TcpStream,
    /// Read from (at most [`MAX_LINE`] bytes in all: the exchange's three lines).
    r: BufReader<Take<TcpStream>>,
    /// The peer, for errors ("the server at ADDR").
    who: String,
}

/// Why no line came.
#[derive(Debug)]
enum LineError {
    /// Nothing for this long.
    Silent(Duration),
    /// Part of a line, then nothing for this long.
    Partial(usize, Duration),
    /// The connection closed after this many bytes.
    Closed(usize),
    /// More than [`MAX_LINE`] bytes and no end of line.
    TooLong,
    /// The connection failed.
    Io(std::io::Error),
}

impl std::fmt::Display for LineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LineError::Silent(t) => write!(f, "sent nothing for {:.1} s", t.as_secs_f64()),
            LineError::Partial(n, t) => write!(
                f,
                "sent {n} bytes and no end of line for {:.1} s",
                t.as_secs_f64()
            ),
            LineError::Closed(0) => write!(f, "closed the connection without a word"),
            LineError::Closed(n) => {
                write!(
                    f,
                    "closed the connection after {n} bytes, before the line's end"
                )
            }
            LineError::TooLong => write!(f, "sent more than {MAX_LINE} bytes without a line's end"),
            LineError::Io(e) => write!(f, "failed: {e}"),
        }
    }
}

impl Wire {
    fn new(s: TcpStream, who: String) -> Result<Wire, PerfError> {
        let what = || format!("the TCP connection with {who}");
        let _ = s.set_nodelay(true);
        s.set_write_timeout(Some(Duration::from_secs(10)))
            .map_err(PerfError::io(what()))?;
        let r = s.try_clone().map_err(PerfError::io(what()))?;
        Ok(Wire {
            w: s,
            r: BufReader::new(r.take(MAX_LINE)),
            who,
        })
    }

    fn send(&mut self, b: &[u8], what: &str) -> Result<(), PerfError> {
        self.w
            .write_all(b)
            .map_err(PerfError::io(format!("sending {what} to {}", self.who)))
    }

    /// The peer's next line, waiting at most `limit` for it, while this side waits for
    /// `step` ("its parameters").
    fn line(&mut self, limit: Duration, step: &str) -> Result<String, PerfError> {
        self.read_line(Instant::now() + limit).map_err(|e| {
            let hint = match e {
                LineError::Silent(_) | LineError::Partial(..) => {
                    "; is it shmhca-perf TEST --roce of this version? --connect-timeout SECS waits longer"
                }
                LineError::Closed(_) => " (its own error says why)",
                _ => "",
            };
            PerfError::Peer(format!(
                "{} {e} while this side waited for {step}{hint}",
                self.who
            ))
        })
    }

    /// One line, without its newline, by `deadline` (however the peer trickles it).
    fn read_line(&mut self, deadline: Instant) -> Result<String, LineError> {
        let start = Instant::now();
        let mut line = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let waited = start.elapsed();
            if left.is_zero() {
                return Err(if line.is_empty() {
                    LineError::Silent(waited)
                } else {
                    LineError::Partial(line.len(), waited)
                });
            }
            self.r
                .get_ref()
                .get_ref()
                .set_read_timeout(Some(left))
                .map_err(LineError::Io)?;
            let buf = match self.r.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    continue;
                }
                Err(e) => return Err(LineError::Io(e)),
            };
            if buf.is_empty() {
                return Err(if self.r.get_ref().limit() == 0 {
                    LineError::TooLong
                } else {
                    LineError::Closed(line.len())
                });
            }
            match buf.iter().position(|&b| b == b'\n') {
                Some(i) => {
                    line.extend_from_slice(&buf[..i]);
                    self.r.consume(i + 1);
                    let s = String::from_utf8_lossy(&line);
                    return Ok(s.trim_end().to_string());
                }
                None => {
                    let n = buf.len();
                    line.extend_from_slice(buf);
                    self.r.consume(n);
                }
            }
        }
    }
}

/// An address as IPv4 when it is an IPv4-mapped IPv6 one (a dual-stack listener's view).
fn canonical(a: std::io::Result<IpAddr>) -> IpAddr {
    a.map_or(IpAddr::from([127, 0, 0, 1]), |ip| ip.to_canonical())
}

/// A socket address as [`canonical`] has it, for messages.
fn canonical_addr(a: std::io::Result<std::net::SocketAddr>) -> String {
    a.map_or_else(
        |_| "its address".into(),
        |a| std::net::SocketAddr::new(a.ip().to_canonical(), a.port()).to_string(),
    )
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// What a peer's line says: its RoCEv2 address, its parameters, and `(QPN, PSN)` of each
/// of its QPs (the control QP first).
type PeerLine = (IpAddr, RunParams, Vec<(u32, u32)>);

/// The peer's line, which must name `want` QPs.
fn parse(line: &str, want: usize, who: &str) -> Result<PeerLine, PerfError> {
    let Some(rest) = line
        .strip_prefix(MAGIC)
        .filter(|r| r.is_empty() || r.starts_with(' '))
    else {
        return Err(PerfError::NotPerf(match line.strip_prefix(FAMILY) {
            Some(v) => format!(
                "{who} speaks shmhca-perf --roce exchange version {:?}, this build speaks {:?}: run the same version on both hosts",
                v.split_whitespace().next().unwrap_or(""),
                &MAGIC[FAMILY.len()..]
            ),
            None => format!(
                "{who} is not shmhca-perf --roce (it sent {:?})",
                line.chars().take(40).collect::<String>()
            ),
        }));
    };
    let mut f = rest.split_whitespace();
    let bad = |what: &str| PerfError::NotPerf(format!("{who} sent a malformed line: {what}"));
    let ip: IpAddr = f
        .next()
        .and_then(|a| a.parse().ok())
        .filter(|a: &IpAddr| !a.is_unspecified() && !a.is_multicast())
        .ok_or_else(|| bad("no RoCEv2 address"))?;
    let p = f.next().ok_or_else(|| bad("no parameters"))?;
    if p.len() % 2 != 0 || p.len() > 4096 {
        return Err(bad("the parameters are not hex bytes"));
    }
    let bytes: Option<Vec<u8>> = (0..p.len() / 2)
        .map(|i| u8::from_str_radix(p.get(2 * i..2 * i + 2)?, 16).ok())
        .collect();
    let peer = RunParams::decode(
        &bytes.ok_or_else(|| bad("the parameters are not hex"))?,
        who,
    )?;
    let qps: Option<Vec<(u32, u32)>> = f
        .map(|q| {
            let (n, p) = q.split_once(':')?;
            let (n, p) = (
                u32::from_str_radix(n, 16).ok()?,
                u32::from_str_radix(p, 16).ok()?,
            );
            (n > 0 && n <= 0xff_ffff && p <= 0xff_ffff).then_some((n, p))
        })
        .collect();
    let qps = qps.ok_or_else(|| bad("a QP is not QPN:PSN (24-bit hex each)"))?;
    if qps.len() != want {
        return Err(PerfError::Mismatch(format!(
            "{} QPs here but {} at the peer (-q)",
            want,
            qps.len()
        )));
    }
    Ok((ip, peer, qps))
}

/// Takes `qp` to RTS towards QP `rqpn` of the peer at `peer_ip`.
#[allow(clippy::too_many_arguments)]
fn connect(
    qp: &mut Qp,
    port: &UdpPort,
    peer_ip: IpAddr,
    rqpn: u32,
    rpsn: u32,
    psn: u32,
    mtu: Mtu,
    opts: &Options,
) -> Result<(), PerfError> {
    let qpn = qp.qpn().get();
    let what = || format!("connecting QP {qpn:#x} to {peer_ip} QP {rqpn:#x}");
    let dest = port
        .destination(qp, peer_ip, Qpn::new(rqpn))
        .map_err(PerfError::engine(what()))?;
    qp.modify(&QpAttr::new(QpState::Init).access(setup::remote_access()))
        .map_err(PerfError::engine(what()))?;
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(mtu)
            .dest(dest)
            .rq_psn(rpsn)
            .max_dest_rd_atomic(shmhca::qp::MAX_RD_ATOMIC)
            .min_rnr_timer(1),
    )
    .map_err(PerfError::engine(what()))?;
    setup::to_rts(qp, psn, opts, opts.outs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's line is checked: another program, bad hex, a malformed QP, a wrong count.
    #[test]
    fn a_peers_line_is_checked_and_what_is_wrong_is_said() {
        let who = "the peer";
        for (line, says) in [
            ("hello", "not shmhca-perf --roce"),
            ("shmhca-perf roce 2", "no RoCEv2 address"),
            ("shmhca-perf roce 1 10.0.0.1 00", "version \"1\""),
            ("shmhca-perf roce 2 0.0.0.0 00", "no RoCEv2 address"),
            ("shmhca-perf roce 2 10.0.0.1", "no parameters"),
            ("shmhca-perf roce 2 10.0.0.1 zz", "not hex"),
            ("shmhca-perf roce 2 10.0.0.1 abc", "not hex bytes"),
        ] {
            let e = parse(line, 1, who).unwrap_err().to_string();
            assert!(e.contains(says), "{line:?}: {e}");
        }
    }

    /// Hostile review L5: the datagrams go to the TCP peer's address; a peer's line that
    /// names another is refused (naming the option) unless the option says to trust it;
    /// an unspecified, multicast or broadcast address never is taken.
    #[test]
    fn datagrams_go_to_the_tcp_peers_address_unless_told_otherwise() {
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let check = |named: &str, tcp: &str, trust: bool| {
            peer_rocev2_addr(ip(named), ip(tcp), trust, "the client", "--trust-peer-addr")
        };
        assert_eq!(check("10.0.0.2", "10.0.0.2", false), Ok(ip("10.0.0.2")));
        assert_eq!(
            check("10.0.0.2", "::ffff:10.0.0.2", false),
            Ok(ip("10.0.0.2")),
            "a dual-stack listener's view of an IPv4 peer"
        );
        let e = check("192.0.2.7", "10.0.0.2", false).unwrap_err();
        assert!(
            e.contains("192.0.2.7") && e.contains("10.0.0.2") && e.contains("--trust-peer-addr"),
            "{e}"
        );
        assert_eq!(check("192.0.2.7", "10.0.0.2", true), Ok(ip("192.0.2.7")));
        for bad in ["255.255.255.255", "224.0.0.1", "0.0.0.0", "ff02::1", "::"] {
            let e = check(bad, "10.0.0.2", true).unwrap_err();
            assert!(e.contains("not one unicast address"), "{bad}: {e}");
        }
    }

    /// A connection made from a given address comes from it (what the server checks).
    #[test]
    fn connect_from_binds_the_local_address() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let to = l.local_addr().unwrap();
        let s = connect_from(Some(ip4(127, 0, 63, 9)), to, Duration::from_secs(5)).unwrap();
        assert_eq!(s.local_addr().unwrap().ip(), ip4(127, 0, 63, 9));
        let (_, from) = l.accept().unwrap();
        assert_eq!(from.ip(), ip4(127, 0, 63, 9));
        assert!(connect_from(Some("::1".parse().unwrap()), to, Duration::from_secs(5)).is_err());
    }

    fn ip4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
        IpAddr::from([a, b, c, d])
    }
}
