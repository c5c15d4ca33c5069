//! `--roce`: the two sides on two hosts, over RoCEv2 (UDP 4791), split as perftest is:
//! the server waits for a client on TCP (`-p`, 18515), the client connects to HOST.
//!
//! Over that TCP connection each side writes one line, `shmhca-perf roce 1 ADDR PARAMS
//! QPS`: the address its RoCEv2 port is bound to, its run parameters (the same encoding the connection manager's private data carries,
//! in hex: the server checks them against its own, the peer's buffer address and key
//! among them), then the QPN and start PSN of its control QP and of each data QP. Each
//! side binds a `UdpPort` on the address its end of the TCP connection uses (or
//! `--bind`), takes its QPs to RTS towards the peer's, and writes `ready`; once it has
//! read the peer's `ready`, the run starts, on the control QP as between processes.
//! Everything read from the peer is checked (length, format, count, values) and every
//! wait is bounded.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::Duration;

use shmhca::{Mtu, Qp, QpAttr, QpState, Qpn, UdpPort};

use crate::perf::control::Control;
use crate::perf::error::PerfError;
use crate::perf::opts::{Options, Role};
use crate::perf::params::RunParams;
use crate::perf::setup::{self, DataQp, Resources, Side};

/// The first words of the exchange line.
const MAGIC: &str = "shmhca-perf roce 1";
/// The longest exchange line read (the parameters and 1 + 1024 QPs fit well within).
const MAX_LINE: u64 = 64 << 10;

/// The connected side: `opts.role` says which (`RoceServer` or `RoceClient`).
///
/// # Errors
/// The TCP exchange fails or times out, the peer is not shmhca-perf or runs other
/// parameters, or a QP cannot be connected (the error says which and why).
pub fn side(opts: &Options, res: Resources) -> Result<Side, PerfError> {
    let limit = Duration::from_secs(opts.connect_timeout.max(1));
    let (stream, bind) = match &opts.role {
        Role::RoceServer { port, bind } => {
            let l = TcpListener::bind((IpAddr::from([0u16; 8]), *port))
                .or_else(|_| TcpListener::bind((IpAddr::from([0u8; 4]), *port)))
                .map_err(PerfError::io(format!("listening on TCP port {port}")))?;
            eprintln!(
                "shmhca-perf: {} server waiting for a client on TCP port {port} (--roce)",
                opts.test.name()
            );
            let (s, _) = l.accept().map_err(PerfError::io("accepting the client"))?;
            (s, *bind)
        }
        Role::RoceClient { host, port, bind } => {
            let addrs: Vec<_> = (host.as_str(), *port)
                .to_socket_addrs()
                .map_err(PerfError::io(format!("resolving {host}")))?
                .collect();
            let s = addrs
                .iter()
                .find_map(|a| TcpStream::connect_timeout(a, limit).ok())
                .ok_or_else(|| {
                    PerfError::Peer(format!(
                        "no shmhca-perf server answered on {host}:{port} within {} s (is it running with --roce and the same -p?)",
                        limit.as_secs()
                    ))
                })?;
            (s, *bind)
        }
        _ => return Err(PerfError::Usage("--roce: not a RoCE role".into())),
    };
    stream
        .set_read_timeout(Some(limit))
        .map_err(PerfError::io("the TCP connection"))?;
    let local = bind.unwrap_or_else(|| canonical(stream.local_addr().map(|a| a.ip())));
    let tcp_peer = canonical(stream.peer_addr().map(|a| a.ip()));
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
    let mut w = stream
        .try_clone()
        .map_err(PerfError::io("the TCP connection"))?;
    w.write_all(line.as_bytes())
        .map_err(PerfError::io("sending this side's parameters"))?;
    let mut r = BufReader::new(stream.take(MAX_LINE));
    let who = format!("the peer at {tcp_peer}");
    let theirs = read_line(&mut r, &who)?;
    let (peer_ip, peer, remote) = parse(&theirs, qps.len(), &who)?;
    mine.check_peer(&peer)?;
    for ((qp, psn), (rqpn, rpsn)) in qps.iter_mut().zip(&psns).zip(&remote) {
        connect(qp, &port, peer_ip, *rqpn, *rpsn, *psn, mtu, opts)?;
    }
    w.write_all(b"ready\n")
        .map_err(PerfError::io("sending ready"))?;
    if read_line(&mut r, &who)? != "ready" {
        return Err(PerfError::NotPerf(format!("{who} did not say ready")));
    }
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

/// An address as IPv4 when it is an IPv4-mapped IPv6 one (a dual-stack listener's view).
fn canonical(a: std::io::Result<IpAddr>) -> IpAddr {
    a.map_or(IpAddr::from([127, 0, 0, 1]), |ip| ip.to_canonical())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// One line from the peer, without its newline.
fn read_line(r: &mut impl BufRead, who: &str) -> Result<String, PerfError> {
    let mut s = String::new();
    let n = r
        .read_line(&mut s)
        .map_err(|e| PerfError::Peer(format!("{who}: reading its line: {e}")))?;
    if n == 0 || !s.ends_with('\n') {
        return Err(PerfError::Peer(format!(
            "{who} closed the connection (or sent more than {MAX_LINE} bytes) before its line ended"
        )));
    }
    Ok(s.trim_end().to_string())
}

/// What a peer's line says: its RoCEv2 address, its parameters, and `(QPN, PSN)` of each
/// of its QPs (the control QP first).
type PeerLine = (IpAddr, RunParams, Vec<(u32, u32)>);

/// The peer's line, which must name `want` QPs.
fn parse(line: &str, want: usize, who: &str) -> Result<PeerLine, PerfError> {
    let rest = line.strip_prefix(MAGIC).ok_or_else(|| {
        PerfError::NotPerf(format!(
            "{who} is not shmhca-perf --roce (it sent {:?})",
            line.chars().take(40).collect::<String>()
        ))
    })?;
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
            ("shmhca-perf roce 1", "no RoCEv2 address"),
            ("shmhca-perf roce 1 0.0.0.0 00", "no RoCEv2 address"),
            ("shmhca-perf roce 1 10.0.0.1", "no parameters"),
            ("shmhca-perf roce 1 10.0.0.1 zz", "not hex"),
            ("shmhca-perf roce 1 10.0.0.1 abc", "not hex bytes"),
        ] {
            let e = parse(line, 1, who).unwrap_err().to_string();
            assert!(e.contains(says), "{line:?}: {e}");
        }
    }
}
