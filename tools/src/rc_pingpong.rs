//! `shmhca rc-pingpong`: rdma-core's `ibv_rc_pingpong` over shmhca's RoCEv2 port, speaking
//! its TCP exchange, so that it pairs with `ibv_rc_pingpong -g N` on any RoCE device (a
//! ConnectX, Linux soft-RoCE, or shmhca's own verbs library under `shmhca exec --roce`).
//!
//! The exchange, as `ibv_rc_pingpong` does it on TCP port 18515: the client connects and
//! writes its address as `LID:QPN:PSN:GID` (`%04x:%06x:%06x:` and the GID's 16 bytes in
//! hex, NUL-terminated: 52 bytes), reads the server's, and writes `done`; the server reads
//! the client's, connects its QP, then writes its own. Then the ping-pong: both sides keep
//! `-r` receives posted, the client sends first, and each side sends its next message once
//! its last send and receive completed, `-n` times; `--chk` checks the first byte of every
//! page of each message received, as `ibv_rc_pingpong --chk` fills them (zero).
//!
//! The datagrams go to the address at the other end of the TCP connection: a peer whose
//! GID names another address is refused, saying so, unless `--trust-peer-gid` (else any
//! client could point this side's datagrams at a third host); an unspecified, multicast or
//! broadcast address never is taken. The client connects from its own GID's address, so
//! that a server that checks (this one) sees the address it will send to.

use std::io::{Read, Write};
use std::net::{IpAddr, TcpListener, ToSocketAddrs};

use shmhca_bench::perf::roce;
use std::time::{Duration, Instant};

use shmhca::roce::Gid;
use shmhca::{
    AccessFlags, Context, EngineMode, Mtu, QpAttr, QpCaps, QpState, Qpn, RecvWr, SendOp, SendWr,
    UdpPort, WcOpcode, WcStatus, WorkCompletion,
};

/// The exchange message's length: `"0000:000000:000000:" + 32 hex digits` and its NUL.
const MSG_LEN: usize = 52;
const PAGE: usize = 4096;

/// The options (those of `ibv_rc_pingpong` that apply, with its letters).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Opts {
    /// The server (none: be the server and wait for a client).
    pub(crate) host: Option<String>,
    /// TCP port of the exchange.
    #[arg(short = 'p', long, default_value_t = 18515)]
    pub(crate) port: u16,
    /// Message size in bytes.
    #[arg(short = 's', long, default_value_t = 4096)]
    pub(crate) size: usize,
    /// Messages each way.
    #[arg(short = 'n', long = "iters", default_value_t = 1000)]
    pub(crate) iters: u32,
    /// Receives kept posted.
    #[arg(short = 'r', long = "rx-depth", default_value_t = 500)]
    pub(crate) rx_depth: u32,
    /// Path MTU (default: the active MTU of the GID's interface).
    #[arg(short = 'm', long)]
    pub(crate) mtu: Option<u32>,
    /// The local GID: its index in the table `shmhca devinfo` prints.
    #[arg(short = 'g', long = "gid-idx")]
    pub(crate) gid_index: u32,
    /// Check the data received (as ibv_rc_pingpong --chk).
    #[arg(short = 'c', long = "chk")]
    pub(crate) check: bool,
    /// Send to the GID the peer's message names even when its TCP connection is with
    /// another address (a host whose RoCE and TCP addresses differ, a proxy). Without it
    /// such a peer is refused: datagrams go only to the TCP peer's address.
    #[arg(long = "trust-peer-gid")]
    pub(crate) trust_peer_gid: bool,
}

/// One side's address, as the exchange carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dest {
    lid: u16,
    qpn: u32,
    psn: u32,
    gid: [u8; 16],
}

impl Dest {
    fn to_wire(self) -> [u8; MSG_LEN] {
        let mut gid = String::new();
        for b in self.gid {
            gid.push_str(&format!("{b:02x}"));
        }
        let text = format!("{:04x}:{:06x}:{:06x}:{gid}", self.lid, self.qpn, self.psn);
        let mut out = [0u8; MSG_LEN];
        out[..text.len()].copy_from_slice(text.as_bytes());
        out
    }

    /// Parses a peer's message; what is wrong with it, else.
    fn from_wire(msg: &[u8]) -> Result<Dest, String> {
        let end = msg.iter().position(|b| *b == 0).unwrap_or(msg.len());
        let text = std::str::from_utf8(&msg[..end])
            .map_err(|_| "the peer's address is not text".to_string())?;
        let bad = || format!("the peer sent {text:?}, not LID:QPN:PSN:GID");
        let mut f = text.split(':');
        let mut num = |max: u32| {
            f.next()
                .and_then(|v| u32::from_str_radix(v, 16).ok())
                .filter(|v| *v <= max)
                .ok_or_else(bad)
        };
        let (lid, qpn, psn) = (num(0xffff)? as u16, num(0xff_ffff)?, num(0xff_ffff)?);
        // 32 hex digits (ASCII: slicing by byte offsets below stays on characters).
        let g = f
            .next()
            .filter(|g| g.len() == 32 && g.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(bad)?;
        let mut gid = [0u8; 16];
        for (i, b) in gid.iter_mut().enumerate() {
            *b = u8::from_str_radix(&g[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Dest { lid, qpn, psn, gid })
    }
}

/// Runs the ping-pong; what went wrong, else.
pub(crate) fn run(o: &Opts) -> Result<String, String> {
    if o.size == 0 || o.size > 1 << 24 || o.iters == 0 || !(2..=4096).contains(&o.rx_depth) {
        return Err("give -s 1 to 16777216 bytes, -n at least 1 and -r 2 to 4096 receives".into());
    }
    let table = shmhca::gid_table().map_err(|e| e.to_string())?;
    let local = table.get(o.gid_index as usize).ok_or_else(|| {
        format!(
            "-g {}: the GID table has {} entries (shmhca devinfo lists them)",
            o.gid_index,
            table.len()
        )
    })?;
    let ip = local.gid.ip();
    let ctx = Context::builder()
        .mode(EngineMode::Inline)
        .build()
        .map_err(|e| e.to_string())?;
    let port = UdpPort::bind(&ctx, ip).map_err(|e| format!("GID {} ({ip}): {e}", o.gid_index))?;
    let mtu = match o.mtu {
        None => port.active_mtu().unwrap_or(Mtu::Mtu1024),
        Some(m) => {
            Mtu::from_bytes(m).map_err(|_| format!("-m {m}: give 256, 512, 1024, 2048 or 4096"))?
        }
    };
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let depth = o.rx_depth + 1;
    let mut cq = ctx.create_cq(depth).map_err(|e| e.to_string())?;
    let caps = QpCaps {
        max_recv_wr: o.rx_depth,
        ..QpCaps::default()
    };
    let mut qp = ctx
        .create_qp(&pd, &cq, &cq, caps)
        .map_err(|e| e.to_string())?;
    // One buffer each way (ibv_rc_pingpong sends and receives in one: its receives land
    // where it sends from; two keep a check honest).
    let mr = pd
        .alloc_mr(2 * o.size as u64, AccessFlags::LOCAL_WRITE)
        .map_err(|e| e.to_string())?;
    qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::NONE))
        .map_err(|e| e.to_string())?;
    let psn = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
        & 0xff_ffff;
    let me = Dest {
        lid: 0,
        qpn: qp.qpn().get(),
        psn,
        gid: local.gid.octets(),
    };
    exchange(o, me, ip, |peer, tcp_peer| {
        if peer.gid[8..] == [0; 8] {
            return Err(
                "the peer sent no GID (a LID only): RoCE needs one; run ibv_rc_pingpong with -g N"
                    .to_string(),
            );
        }
        let to = roce::peer_rocev2_addr(
            Gid::from_octets(peer.gid).ip(),
            tcp_peer,
            o.trust_peer_gid,
            "the peer",
            "--trust-peer-gid",
        )?;
        let dest = port
            .destination(&qp, to, Qpn::new(peer.qpn))
            .map_err(|e| e.to_string())?;
        qp.modify(
            &QpAttr::new(QpState::Rtr)
                .path_mtu(mtu)
                .dest(dest)
                .rq_psn(peer.psn)
                .max_dest_rd_atomic(1)
                .min_rnr_timer(12)
                .hop_limit(1),
        )
        .map_err(|e| format!("RTR: {e}"))?;
        qp.modify(
            &QpAttr::new(QpState::Rts)
                .sq_psn(psn)
                .timeout(14)
                .retry_cnt(7)
                .rnr_retry(7)
                .max_rd_atomic(1),
        )
        .map_err(|e| format!("RTS: {e}"))
    })?;
    let (send_at, recv_at) = (0, o.size as u64);
    let len = o.size as u32;
    let recv = |qp: &mut shmhca::Qp| {
        let sge = mr.sge(recv_at, len).map_err(|e| e.to_string())?;
        qp.post_recv(&RecvWr::new(1, &[sge]))
            .map_err(|e| e.to_string())
    };
    let send = |qp: &mut shmhca::Qp| {
        let sge = mr.sge(send_at, len).map_err(|e| e.to_string())?;
        qp.post_send(&SendWr::new(2, SendOp::Send, &[sge]))
            .map_err(|e| e.to_string())
    };
    for _ in 0..o.rx_depth {
        recv(&mut qp)?;
    }
    let mut routs = o.rx_depth;
    let client = o.host.is_some();
    let start = Instant::now();
    let mut pending = 1u32;
    if client {
        send(&mut qp)?;
        pending |= 2;
    }
    let (mut scnt, mut rcnt) = (0u32, 0u32);
    let mut wc = [WorkCompletion::default(); 16];
    let mut last_progress = Instant::now();
    while scnt < o.iters || rcnt < o.iters {
        let n = cq.poll(&mut wc);
        if n == 0 {
            if last_progress.elapsed() > Duration::from_secs(30) {
                return Err(format!(
                    "no completion for 30 s ({scnt} sent, {rcnt} received): is the peer alive?"
                ));
            }
            continue;
        }
        last_progress = Instant::now();
        for c in &wc[..n] {
            if c.status != WcStatus::Success {
                return Err(format!(
                    "Failed status {:?} for wr_id {}",
                    c.status, c.wr_id
                ));
            }
            if c.opcode == WcOpcode::Recv {
                rcnt += 1;
                if o.check {
                    let mut b = [0u8; 1];
                    for page in (0..o.size).step_by(PAGE) {
                        mr.read_at(recv_at + page as u64, &mut b)
                            .map_err(|e| e.to_string())?;
                        if b[0] != 0 {
                            return Err("Invalid data".into());
                        }
                    }
                }
                routs -= 1;
                if routs <= 1 {
                    while routs < o.rx_depth {
                        recv(&mut qp)?;
                        routs += 1;
                    }
                }
                pending &= !1;
            } else {
                scnt += 1;
                pending &= !2;
            }
            if scnt < o.iters && pending == 0 {
                send(&mut qp)?;
                pending = 3;
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let bytes = o.size as f64 * f64::from(o.iters) * 2.0;
    // Let the last Ack leave (ibv_rc_pingpong destroys its QP and exits the same way).
    drop(qp);
    Ok(format!(
        "{} bytes in {secs:.2} seconds = {:.2} Mbit/sec\n{} iters in {secs:.2} seconds = {:.2} usec/iter",
        bytes as u64,
        bytes * 8.0 / secs / 1e6,
        o.iters,
        secs * 1e6 / f64::from(o.iters)
    ))
}

/// The TCP exchange: as the client (`o.host`, connecting from `local`, this side's GID's
/// address), or as the server; `connect` takes the peer's address and the address at the
/// other end of the TCP connection to RTS (the server does so before it answers, as
/// ibv_rc_pingpong does).
fn exchange(
    o: &Opts,
    me: Dest,
    local: IpAddr,
    mut connect: impl FnMut(&Dest, IpAddr) -> Result<(), String>,
) -> Result<Dest, String> {
    let limit = Some(Duration::from_secs(60));
    let io = |what: &str| {
        let what = what.to_string();
        move |e: std::io::Error| format!("{what}: {e}")
    };
    match &o.host {
        Some(h) => {
            let what = format!("connecting to {h}:{}", o.port);
            let addrs: Vec<_> = (h.as_str(), o.port)
                .to_socket_addrs()
                .map_err(io(&what))?
                .collect();
            // From this side's GID's address where the family allows (the server sends to
            // the address the connection comes from), else — or if that address cannot be
            // bound, e.g. a link-local GID, which needs its interface — from the kernel's
            // choice.
            let connect_limit = Duration::from_secs(20);
            let mut last = None;
            let mut s = None;
            'addrs: for a in &addrs {
                let same_family = a.ip().to_canonical().is_ipv4() == local.is_ipv4();
                for from in [same_family.then_some(local), None] {
                    match roce::connect_from(from, *a, connect_limit) {
                        Ok(c) => {
                            s = Some(c);
                            break 'addrs;
                        }
                        Err(e) => last = Some(e),
                    }
                    if from.is_none() {
                        break;
                    }
                }
            }
            let mut s = s.ok_or_else(|| {
                let e = last.unwrap_or_else(|| std::io::ErrorKind::NotFound.into());
                format!("{what} from {local}: {e}")
            })?;
            let tcp_peer = s.peer_addr().map_err(io("the TCP stream"))?.ip();
            s.set_read_timeout(limit).map_err(io("the TCP stream"))?;
            s.write_all(&me.to_wire())
                .map_err(io("sending the address"))?;
            let mut msg = [0u8; MSG_LEN];
            s.read_exact(&mut msg)
                .map_err(io("reading the server's address"))?;
            s.write_all(b"done\0").map_err(io("sending done"))?;
            let peer = Dest::from_wire(&msg)?;
            connect(&peer, tcp_peer)?;
            Ok(peer)
        }
        None => {
            let l = TcpListener::bind((IpAddr::from([0u8; 16]), o.port))
                .or_else(|_| TcpListener::bind((IpAddr::from([0u8; 4]), o.port)))
                .map_err(io(&format!("listening on TCP {}", o.port)))?;
            let (mut s, from) = l.accept().map_err(io("accepting the client"))?;
            s.set_read_timeout(limit).map_err(io("the TCP stream"))?;
            let mut msg = [0u8; MSG_LEN];
            s.read_exact(&mut msg)
                .map_err(io("reading the client's address"))?;
            let peer = Dest::from_wire(&msg)?;
            connect(&peer, from.ip())?;
            s.write_all(&me.to_wire())
                .map_err(io("sending the address"))?;
            // The client's "done" (or its close).
            let _ = s.read(&mut msg);
            Ok(peer)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exchange's format, as ibv_rc_pingpong writes and reads it (its gid_to_wire_gid
    /// writes the GID's bytes in order).
    #[test]
    fn the_exchange_message_round_trips_and_bad_ones_are_named() {
        let d = Dest {
            lid: 0,
            qpn: 0x1234,
            psn: 0xabcdef,
            gid: Gid::from(std::net::Ipv4Addr::new(198, 18, 0, 1)).octets(),
        };
        let w = d.to_wire();
        assert_eq!(
            &w[..51],
            b"0000:001234:abcdef:00000000000000000000ffffc6120001"
        );
        assert_eq!(w[51], 0);
        assert_eq!(Dest::from_wire(&w), Ok(d));
        for bad in [
            &b"hello"[..],
            b"0000:1000000:000000:00",
            b"zz:1:1:00000000000000000000ffffc6120001",
        ] {
            let e = Dest::from_wire(bad).unwrap_err();
            assert!(e.contains("LID:QPN:PSN:GID"), "{e}");
        }
        // A GID field of 32 bytes that are not 32 ASCII characters (a 3-byte '€' first):
        // refused, not a slice through a character (a panic).
        let mut msg = b"0000:000011:000000:".to_vec();
        msg.extend_from_slice("€".as_bytes());
        msg.extend_from_slice(&[b'0'; 29]);
        let e = Dest::from_wire(&msg).unwrap_err();
        assert!(e.contains("LID:QPN:PSN:GID"), "{e}");
    }
}
