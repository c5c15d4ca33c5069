//! Two engines of this process over the UDP link: every operation across sizes on
//! loopback (IPv4 and IPv6), loss and corruption recovered, garbage counted; and two
//! network namespaces joined by a veth pair (root only), with a capture decoded as
//! InfiniBand and its ICRCs checked by a CRC of the test's own.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use super::UdpPort;
use crate::completion::{WcStatus, WorkCompletion};
use crate::{
    AccessFlags, Context, Cq, Mr, Mtu, Pd, Qp, QpAttr, QpCaps, QpState, RecvWr, SendOp, SendWr,
};

/// The tests of this file run one at a time: each moves packets through threads that need
/// a core, and the transport timers run on the wall clock, so several at once on a small
/// machine (the namespace test runs tshark) could starve one into retry exhaustion. With the
/// machine's UDP 4791 lock ([`crate::testing::udp_4791_lock`]): they bind port 4791 on
/// loopback addresses, which another test binary or another checkout's tests running at
/// the same time may want.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub(super) fn serial() -> (std::sync::MutexGuard<'static, ()>, crate::testing::PortLock) {
    (
        SERIAL.lock().unwrap_or_else(|e| e.into_inner()),
        crate::testing::udp_4791_lock(),
    )
}

/// One side: a context (inline, manual progress), its port, and a QP with its memory.
struct End {
    ctx: Context,
    port: UdpPort,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    /// Source and landing memory (1 MiB).
    mr: Mr,
}

const MR_LEN: u64 = 1 << 20;

fn end(addr: SocketAddr) -> End {
    let ctx = crate::raw_peer::inline_context();
    let port = UdpPort::bind_addr(&ctx, addr).unwrap();
    end_on(ctx, port)
}

/// An end over `port` of `ctx`: a QP and a region of every access.
fn end_on(ctx: Context, port: UdpPort) -> End {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
    let mr = pd
        .alloc_mr(MR_LEN, AccessFlags::ALL | AccessFlags::LOCAL_WRITE)
        .unwrap();
    End {
        ctx,
        port,
        _pd: pd,
        cq,
        qp,
        mr,
    }
}

/// Two ends bound at `a` and `b` (port 0: the kernel picks), their QPs in RTS towards each
/// other at path MTU `mtu`, with transport timer exponent `timeout`.
fn pair(a: &str, b: &str, mtu: Mtu, timeout: u8) -> (End, End) {
    let mut x = end(SocketAddr::new(a.parse().unwrap(), 0));
    let mut y = end(SocketAddr::new(b.parse().unwrap(), 0));
    connect(&mut x, &y, mtu, timeout);
    connect(&mut y, &x, mtu, timeout);
    (x, y)
}

fn connect(me: &mut End, peer: &End, mtu: Mtu, timeout: u8) {
    let dest = me
        .port
        .destination_at(&me.qp, peer.port.local_addr(), peer.qp.qpn())
        .unwrap();
    bring_up(me, dest, mtu, timeout);
}

/// Takes `me`'s QP to RTS towards `dest` at path MTU `mtu`, transport timer exponent
/// `timeout`, seven retries of each kind.
fn bring_up(me: &mut End, dest: crate::Destination, mtu: Mtu, timeout: u8) {
    bring_up_with(me, dest, mtu, timeout, |a| a);
}

/// [`bring_up`], with `rtr` adding to the RTR attributes (a GRH's hop limit and traffic
/// class).
fn bring_up_with(
    me: &mut End,
    dest: crate::Destination,
    mtu: Mtu,
    timeout: u8,
    rtr: impl FnOnce(QpAttr) -> QpAttr,
) {
    bring_up_qp(&mut me.qp, dest, mtu, timeout, rtr);
}

/// [`bring_up_with`] for a QP of its own (the hostile tests' victim, whose peer is a plain
/// socket).
pub(super) fn bring_up_qp(
    qp: &mut Qp,
    dest: crate::Destination,
    mtu: Mtu,
    timeout: u8,
    rtr: impl FnOnce(QpAttr) -> QpAttr,
) {
    qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::ALL))
        .unwrap();
    qp.modify(&rtr(QpAttr::new(QpState::Rtr)
        .path_mtu(mtu)
        .dest(dest)
        .rq_psn(0)
        .max_dest_rd_atomic(4)
        .min_rnr_timer(1)))
        .unwrap();
    qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(0)
            .timeout(timeout)
            .retry_cnt(7)
            .rnr_retry(7)
            .max_rd_atomic(4),
    )
    .unwrap();
}

/// The engine makes the system calls itself: an inline context's post leaves as a datagram
/// before `post_send` returns, and the peer's poll of its CQ receives it (no thread of the
/// port's runs in between).
#[test]
fn an_inline_post_is_a_datagram_before_it_returns_and_a_poll_receives_it() {
    let _serial = serial();
    let (mut x, mut y) = pair("127.0.0.11", "127.0.0.12", Mtu::Mtu1024, 14);
    y.qp.post_recv(&RecvWr::new(7, &[y.mr.sge(0, 64).unwrap()]))
        .unwrap();
    x.mr.write_at(0, b"straight out").unwrap();
    let sent = x.port.counters().datagrams_sent;
    x.qp.post_send(&SendWr::new(1, SendOp::Send, &[x.mr.sge(0, 12).unwrap()]))
        .unwrap();
    // (The first transmit also advertises x's credits: an Ack datagram of its own.)
    assert!(
        x.port.counters().datagrams_sent > sent,
        "the post sent its datagram"
    );
    // Loopback delivers within the sender's system call; allow the kernel a few polls.
    let mut wc = [WorkCompletion::default()];
    let mut polls = 0;
    while y.cq.poll(&mut wc) == 0 {
        polls += 1;
        assert!(polls < 100_000, "no receive after {polls} polls");
        if polls % 1000 == 0 {
            std::thread::yield_now();
        }
    }
    assert_eq!((wc[0].status, wc[0].wr_id), (WcStatus::Success, 7));
    assert_eq!(read(&y.mr, 0, 12), b"straight out");
    assert!(y.port.counters().datagrams_received >= 1);
}

/// Runs both engines until `cq` yields a completion (10 s at most).
fn wait_cq(cq: &mut Cq, ctxs: [&Context; 2], ports: [&UdpPort; 2]) -> WorkCompletion {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut wc = [WorkCompletion::default()];
    loop {
        ctxs[0].progress();
        ctxs[1].progress();
        if cq.poll(&mut wc) == 1 {
            return wc[0];
        }
        assert!(
            Instant::now() < deadline,
            "no completion within 10 s; counters {:?} / {:?}, stats {:?} / {:?}",
            ports[0].counters(),
            ports[1].counters(),
            ctxs[0].stats(),
            ctxs[1].stats()
        );
        std::thread::yield_now();
    }
}

/// The next completion of `$on` (`$x` or `$y`), running both ends.
macro_rules! wait {
    ($on:ident, $x:ident, $y:ident) => {
        wait_cq(&mut $on.cq, [&$x.ctx, &$y.ctx], [&$x.port, &$y.port])
    };
}

/// A pattern for message `tag` of `len` bytes.
fn pattern(tag: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(tag * 7) as u8)
        .collect()
}

fn read(mr: &Mr, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mr.read_at(off, &mut v).unwrap();
    v
}

fn ok(wc: WorkCompletion, wr_id: u64) {
    assert_eq!((wc.wr_id, wc.status), (wr_id, WcStatus::Success), "{wc:?}");
}

/// Send, RDMA Write, RDMA Read and both Atomics from `x` to `y`, every size in `sizes`
/// (single- and multi-packet at the pair's MTU), every byte checked.
fn every_operation(x: &mut End, y: &mut End, sizes: &[usize]) {
    let mut id = 0u64;
    for &len in sizes {
        id += 1;
        let l32 = len as u32;
        // Send: y's receive buffer at 512 KiB.
        let data = pattern(id, len);
        x.mr.write_at(0, &data).unwrap();
        y.qp.post_recv(&RecvWr::new(
            id,
            &[y.mr.sge(512 << 10, l32.max(1)).unwrap()],
        ))
        .unwrap();
        let sgl = [x.mr.sge(0, l32).unwrap()];
        x.qp.post_send(&SendWr::new(id, SendOp::Send, &sgl[..usize::from(len > 0)]))
            .unwrap();
        ok(wait!(x, x, y), id);
        let wc = wait!(y, x, y);
        ok(wc, id);
        assert_eq!(wc.byte_len as usize, len);
        assert_eq!(read(&y.mr, 512 << 10, len), data, "Send of {len} bytes");

        // RDMA Write to y at 256 KiB.
        id += 1;
        let data = pattern(id, len);
        x.mr.write_at(0, &data).unwrap();
        let op = SendOp::RdmaWrite(y.mr.remote(256 << 10));
        x.qp.post_send(&SendWr::new(id, op, &sgl[..usize::from(len > 0)]))
            .unwrap();
        ok(wait!(x, x, y), id);
        assert_eq!(read(&y.mr, 256 << 10, len), data, "Write of {len} bytes");

        // RDMA Read of y's bytes at 128 KiB into x at 768 KiB.
        id += 1;
        let data = pattern(id, len);
        y.mr.write_at(128 << 10, &data).unwrap();
        let dst = [x.mr.sge(768 << 10, l32).unwrap()];
        let op = SendOp::RdmaRead(y.mr.remote(128 << 10));
        x.qp.post_send(&SendWr::new(id, op, &dst[..usize::from(len > 0)]))
            .unwrap();
        ok(wait!(x, x, y), id);
        assert_eq!(read(&x.mr, 768 << 10, len), data, "Read of {len} bytes");
    }
    // Atomics on y's word at 64: Fetch and Add, then Compare and Swap (hit and miss).
    y.mr.write_at(64, &40u64.to_le_bytes()).unwrap();
    let word = y.mr.remote(64);
    let orig = [x.mr.sge(8, 8).unwrap()];
    let ops = [
        (
            SendOp::FetchAdd {
                remote: word,
                add: 2,
            },
            40u64,
            42u64,
        ),
        (
            SendOp::CompareSwap {
                remote: word,
                compare: 42,
                swap: 7,
            },
            42,
            7,
        ),
        (
            SendOp::CompareSwap {
                remote: word,
                compare: 1,
                swap: 9,
            },
            7,
            7,
        ),
    ];
    for (op, was, now) in ops {
        id += 1;
        x.qp.post_send(&SendWr::new(id, op, &orig)).unwrap();
        ok(wait!(x, x, y), id);
        assert_eq!(
            u64::from_le_bytes(read(&x.mr, 8, 8).try_into().unwrap()),
            was
        );
        assert_eq!(
            u64::from_le_bytes(read(&y.mr, 64, 8).try_into().unwrap()),
            now
        );
    }
}

/// Sizes around the inline limit, the MTU (1024) and several packets.
const SIZES: [usize; 10] = [0, 1, 8, 28, 29, 1023, 1024, 1025, 4096, 100_003];

#[test]
fn every_operation_across_sizes_over_ipv4_loopback() {
    let _serial = serial();
    let (mut x, mut y) = pair("127.0.0.1", "127.0.0.2", Mtu::Mtu1024, 14);
    every_operation(&mut x, &mut y, &SIZES);
    every_operation(&mut y, &mut x, &[4096, 5000]);
    let (cx, cy) = (x.port.counters(), y.port.counters());
    assert!(
        cx.datagrams_sent > 100 && cy.datagrams_received > 100,
        "{cx:?} {cy:?}"
    );
    assert_eq!((cx.icrc_dropped, cy.icrc_dropped), (0, 0));
    assert_eq!((cx.malformed_dropped, cy.malformed_dropped), (0, 0));
    assert_eq!((cx.encode_dropped, cy.encode_dropped), (0, 0));
}

#[test]
fn every_operation_across_sizes_over_ipv6_loopback_at_mtu_4096() {
    let _serial = serial();
    let (mut x, mut y) = pair("::1", "::1", Mtu::Mtu4096, 14);
    every_operation(&mut x, &mut y, &[0, 5, 4095, 4096, 4097, 65_536]);
}

/// The sender's port drops every 50th datagram and flips a byte of every 71st: the
/// receiver counts the ICRC failures, go-back-N recovers everything, every byte checks.
#[test]
fn lost_and_corrupted_datagrams_are_counted_and_recovered() {
    let _serial = serial();
    let (mut x, mut y) = pair("127.0.0.3", "127.0.0.4", Mtu::Mtu1024, 14);
    let mut n = 0u64;
    x.port.set_hook(Box::new(move |d: &mut [u8]| {
        n += 1;
        if n % 71 == 0 {
            let at = d.len() / 2;
            d[at] ^= 0x40;
        }
        super::Fate::send_if(n % 50 != 0)
    }));
    every_operation(&mut x, &mut y, &[1, 1025, 30_000, 4096]);
    let cy = y.port.counters();
    assert!(cy.icrc_dropped > 0, "{cy:?}");
    assert!(x.ctx.stats().retransmitted > 0, "{:?}", x.ctx.stats());
}

/// A QP over a UDP link keeps at most the port's cap of request packets unacknowledged,
/// and asks for an Ack often enough that it never waits for one it did not ask for: with
/// a cap of 8, a 100 KB message (98 packets) goes 8 at a time, also through losses.
#[test]
fn the_packets_in_flight_stay_under_the_cap_through_losses() {
    use std::sync::{Arc, Mutex};
    let _serial = serial();
    let mut x = end("127.0.0.15:0".parse().unwrap());
    let mut y = end("127.0.0.16:0".parse().unwrap());
    x.port.set_max_in_flight(8);
    connect(&mut x, &y, Mtu::Mtu1024, 14);
    connect(&mut y, &x, Mtu::Mtu1024, 14);
    /// The highest request PSN x sent, the highest PSN y acknowledged, the largest gap
    /// seen between them when x sent, x's requests and those that asked for an Ack.
    #[derive(Default)]
    struct Seen {
        acked: Option<u32>,
        max_gap: u32,
        requests: u32,
        ack_reqs: u32,
    }
    let seen = Arc::new(Mutex::new(Seen::default()));
    let psn = |d: &[u8]| u32::from_be_bytes([0, d[9], d[10], d[11]]);
    let (sx, sy) = (seen.clone(), seen.clone());
    let mut n = 0u32;
    x.port.set_hook(Box::new(move |d: &mut [u8]| {
        n += 1;
        let mut s = sx.lock().unwrap();
        // Requests (not Acks, opcode 0x11): how far past the last Ack y sent.
        if d.len() >= 12 && d[0] != 0x11 {
            s.requests += 1;
            s.ack_reqs += u32::from(d[8] >> 7);
            if let Some(a) = s.acked {
                let gap = psn(d).wrapping_sub(a) & 0xff_ffff;
                if gap < 1 << 23 {
                    s.max_gap = s.max_gap.max(gap);
                }
            }
        }
        // Every 23rd datagram is lost.
        super::Fate::send_if(n % 23 != 0)
    }));
    y.port.set_hook(Box::new(move |d: &mut [u8]| {
        // Acks, RDMA Read responses (0x0d-0x10), Atomic Acks (0x12): each acknowledges
        // up to its PSN.
        if d.len() >= 12 && (0x0d..=0x12).contains(&d[0]) {
            let mut s = sy.lock().unwrap();
            let p = psn(d);
            let newer = s
                .acked
                .is_none_or(|a| (p.wrapping_sub(a) & 0xff_ffff) < 1 << 23);
            if newer {
                s.acked = Some(p);
            }
        }
        super::Fate::Send
    }));
    every_operation(&mut x, &mut y, &[100_000]);
    let s = seen.lock().unwrap();
    assert!(s.requests > 98, "{} requests", s.requests);
    assert!(
        s.max_gap <= 8,
        "a request went {} PSNs past the last Ack",
        s.max_gap
    );
    assert!(
        s.ack_reqs >= s.requests / 8,
        "{} of {} requests asked for an Ack",
        s.ack_reqs,
        s.requests
    );
    assert!(x.ctx.stats().retransmitted > 0, "{:?}", x.ctx.stats());
}

/// Loss, duplication, reordering and corruption together, both ways (the UDP link's fault
/// hook: this kernel has no `netem`): every operation at every size completes with every
/// byte right, and the duplicates and reordered datagrams are absorbed by the transport.
#[test]
fn loss_duplication_reordering_and_corruption_lose_nothing() {
    let _serial = serial();
    let (mut x, mut y) = pair("127.0.0.19", "127.0.0.20", Mtu::Mtu1024, 14);
    let faults = |salt: u64| {
        let mut n = salt;
        Box::new(move |d: &mut [u8]| {
            n += 1;
            if n % 31 == 0 {
                let at = d.len() / 3;
                d[at] ^= 0x10;
            }
            match n {
                _ if n % 29 == 0 => super::Fate::Drop,
                _ if n % 13 == 0 => super::Fate::Twice,
                _ if n % 17 == 0 => super::Fate::Later,
                _ => super::Fate::Send,
            }
        })
    };
    x.port.set_hook(faults(0));
    y.port.set_hook(faults(7));
    every_operation(&mut x, &mut y, &SIZES);
    every_operation(&mut y, &mut x, &[1, 4096, 30_000]);
    let (sx, sy) = (x.ctx.stats(), y.ctx.stats());
    assert!(sx.retransmitted + sy.retransmitted > 0, "{sx:?} {sy:?}");
    assert!(sx.icrc_dropped + sy.icrc_dropped > 0, "{sx:?} {sy:?}");
    assert!(
        sx.dropped + sy.dropped > 0,
        "duplicates are dropped: {sx:?} {sy:?}"
    );
}

/// Garbage from the peer's address and from an unknown address is counted and dropped, and
/// so are a peer's CNPs (as CNPs); the QPs go on working.
#[test]
fn garbage_datagrams_are_counted_and_change_nothing() {
    let _serial = serial();
    let (mut x, mut y) = pair("127.0.0.5", "127.0.0.6", Mtu::Mtu1024, 14);
    let to = x.port.local_addr();
    let from_peer = std::net::UdpSocket::bind("127.0.0.6:0").unwrap();
    let stranger = std::net::UdpSocket::bind("127.0.0.7:0").unwrap();
    let mut seed = 1u32;
    for len in 0..200usize {
        let mut b: Vec<u8> = (0..len)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (seed >> 24) as u8
            })
            .collect();
        if len > 12 {
            b[0] = 0x04; // a Send Only, to get past the opcode check
        }
        from_peer.send_to(&b, to).unwrap();
    }
    stranger.send_to(&[0x04; 64], to).unwrap();
    // Three Congestion Notification Packets from the peer: counted, nothing else.
    let mut cnp = vec![0u8; 28];
    cnp[0] = super::datagram::OPCODE_CNP;
    cnp[7] = 0x12;
    let crc = super::datagram::icrc(from_peer.local_addr().unwrap(), to, &[&cnp]).unwrap();
    cnp.extend_from_slice(&crc.to_le_bytes());
    for _ in 0..3 {
        from_peer.send_to(&cnp, to).unwrap();
    }
    // Operations still work, in both directions.
    every_operation(&mut y, &mut x, &[8, 2000]);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let c = x.port.counters();
        let bad = c.icrc_dropped + c.malformed_dropped;
        if bad == 200 && c.unknown_source_dropped == 1 && c.cnps_received == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "{c:?}");
        x.ctx.progress();
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A port's counters are part of its context's `Stats` (what `shmhca stat` shows), and
/// stay there when the port closes.
#[test]
fn a_ports_counters_are_in_the_contexts_stats_and_stay_after_it_closes() {
    let _serial = serial();
    let ctx = crate::raw_peer::inline_context();
    let port = UdpPort::bind_addr(&ctx, "127.0.0.13:0".parse().unwrap()).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4).unwrap();
    let qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
    let stranger = std::net::UdpSocket::bind("127.0.0.14:0").unwrap();
    port.destination_at(&qp, stranger.local_addr().unwrap(), crate::Qpn::new(0x11))
        .unwrap();
    // Three datagrams from the link's peer address: too short to be RoCEv2.
    for _ in 0..3 {
        stranger.send_to(b"short", port.local_addr()).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while port.counters().malformed_dropped < 3 {
        assert!(Instant::now() < deadline, "{:?}", port.counters());
        ctx.progress();
    }
    let c = port.counters();
    let s = ctx.stats();
    assert_eq!(
        (s.datagrams_received, s.malformed_dropped, s.icrc_dropped),
        (c.datagrams_received, c.malformed_dropped, c.icrc_dropped)
    );
    assert_eq!(s.malformed_dropped, 3);
    drop(port);
    let after = ctx.stats();
    assert_eq!((after.datagrams_received, after.malformed_dropped), (3, 3));
}

/// A QP's `hop_limit` and `traffic_class` are the TTL and TOS of its datagrams (its
/// requests and its Acks); a QP that sets none sends the defaults (64, 0). Each end of a
/// connection sends from the same source port, derived from both QPNs as Linux does (ECMP
/// keeps a connection on one path). In a namespace
/// of the test's own, captured on its loopback (root only).
#[test]
fn a_qps_hop_limit_traffic_class_and_source_port_are_its_datagrams() {
    use super::socket::netns::{Netns, PacketCapture, available};
    let _serial = serial();
    if !available("a_qps_hop_limit_traffic_class_and_source_port_are_its_datagrams") {
        return;
    }
    let ns = Netns::new(&format!("shmhca-grh-{}", std::process::id() % 100_000)).unwrap();
    let cap = ns.run(|| PacketCapture::open("lo")).unwrap().unwrap();
    let (xa, ya): (IpAddr, IpAddr) = ("127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap());
    let mut x = end_in(&ns, xa);
    let mut y = end_in(&ns, ya);
    // (Called in the namespace: a QP's source-port socket is made in the caller's.)
    let (xp, xq, yq) = (&x.port, &x.qp, y.qp.qpn());
    let dest = ns.run(|| xp.destination(xq, ya, yq)).unwrap().unwrap();
    bring_up_with(&mut x, dest, Mtu::Mtu1024, 14, |a| {
        a.hop_limit(9).traffic_class(0x20)
    });
    assert_eq!(
        (x.qp.config().hop_limit, x.qp.config().traffic_class),
        (9, 0x20)
    );
    let (yp, yqp, xq) = (&y.port, &y.qp, x.qp.qpn());
    let dest = ns.run(|| yp.destination(yqp, xa, xq)).unwrap().unwrap();
    bring_up(&mut y, dest, Mtu::Mtu1024, 14);
    every_operation(&mut x, &mut y, &[8]);
    let packets = cap.ipv4_udp_packets(4791, 8, Duration::from_secs(5));
    let from_x = packets
        .iter()
        .filter(|p| p[12..16] == [127, 0, 0, 1])
        .count();
    assert!(
        from_x > 0 && from_x < packets.len(),
        "captured {} datagrams, {from_x} from x",
        packets.len()
    );
    // Both ends send from the connection's own source port (Linux's, from the QPNs).
    let sport = shmhca_proto::roce::source_port(0, x.qp.qpn(), y.qp.qpn());
    assert!(sport >= 0xc000);
    for p in &packets {
        let from_x = p[12..16] == [127, 0, 0, 1];
        let want = if from_x { (9, 0x20) } else { (64, 0) };
        assert_eq!(
            (p[8], p[1]),
            want,
            "(TTL, TOS) of a datagram from x: {from_x}"
        );
        let ihl = usize::from(p[0] & 15) * 4;
        assert_eq!(
            u16::from_be_bytes([p[ihl], p[ihl + 1]]),
            sport,
            "the source port of a datagram from x: {from_x}"
        );
    }
}

/// Two connected ends on loopback addresses `x_ip` and `y_ip` (inline, manual progress),
/// `x`'s fault stage corrupting 30% of the packets it sends (seeded with `seed`).
fn corrupting_pair(x_ip: &str, y_ip: &str, seed: u64) -> (End, End) {
    let ctx = Context::builder()
        .mode(crate::EngineMode::Inline)
        .progress(crate::Progress::Manual)
        .huge_pages(shmhca_rings::HugePages::Never)
        .faults(crate::fault::FaultConfig {
            corrupt: 0.3,
            seed,
            ..Default::default()
        })
        .build()
        .unwrap();
    let port = UdpPort::bind_addr(&ctx, format!("{x_ip}:0").parse().unwrap()).unwrap();
    let mut x = end_on(ctx, port);
    let mut y = end(format!("{y_ip}:0").parse().unwrap());
    connect(&mut x, &y, Mtu::Mtu1024, 10);
    connect(&mut y, &x, Mtu::Mtu1024, 10);
    (x, y)
}

/// A packet the fault stage corrupted leaves as a datagram with the ICRC of the intact
/// packet, so the receiver drops it and the sender resends it: no corrupted byte is ever
/// delivered. (Inline 8-byte Sends: a flipped payload bit would otherwise arrive with a
/// fresh, valid ICRC.)
#[test]
fn a_packet_the_fault_stage_corrupts_is_dropped_by_its_icrc_not_delivered() {
    let _serial = serial();
    let (mut x, mut y) = corrupting_pair("127.0.0.23", "127.0.0.24", 5);
    for i in 0..200u64 {
        let msg = (i * 0x0101_0101_0101_0101).to_le_bytes();
        x.mr.write_at(0, &msg).unwrap();
        y.qp.post_recv(&RecvWr::new(i, &[y.mr.sge(4096, 8).unwrap()]))
            .unwrap();
        x.qp.post_send(&SendWr::new(i, SendOp::Send, &[x.mr.sge(0, 8).unwrap()]))
            .unwrap();
        let got = wait!(y, x, y);
        assert_eq!((got.wr_id, got.status), (i, WcStatus::Success));
        assert_eq!(read(&y.mr, 4096, 8), msg, "message {i}");
        assert_eq!(wait!(x, x, y).status, WcStatus::Success);
    }
    let (f, c) = (x.ctx.fault_stats(), y.port.counters());
    assert!(f.corrupted > 10, "{f:?}");
    assert!(c.icrc_dropped > 0, "{c:?}");
}

/// The same when the corrupted request carries a riding Ack (a ping-pong whose side with the
/// fault stage holds its Acks back to ride in its next Send): the carrier still leaves with
/// a bad ICRC and is dropped, never delivered with a fresh, valid one (shmhca-perf's RoCEv2
/// runs under faults once got a flipped byte through this way).
#[test]
fn a_corrupted_request_carrying_a_riding_ack_is_dropped_not_delivered() {
    let _serial = serial();
    let (mut x, mut y) = corrupting_pair("127.0.0.27", "127.0.0.28", 11);
    x.ctx.shared.engine.with(|e| e.hold_acks = true);
    // Receives are wr_id `i`, sends `SENT + i`: the next receive completion of `$on`,
    // every completion before it a successful send.
    const SENT: u64 = 1 << 32;
    macro_rules! received {
        ($on:ident) => {{
            loop {
                let wc = wait!($on, x, y);
                assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                if wc.wr_id < SENT {
                    break wc.wr_id;
                }
            }
        }};
    }
    for i in 0..200u64 {
        let (to_y, to_x) = (pattern(i, 8), pattern(i + 1000, 8));
        x.qp.post_recv(&RecvWr::new(i, &[x.mr.sge(4096, 8).unwrap()]))
            .unwrap();
        y.qp.post_recv(&RecvWr::new(i, &[y.mr.sge(4096, 8).unwrap()]))
            .unwrap();
        x.mr.write_at(0, &to_y).unwrap();
        x.qp.post_send(&SendWr::new(
            SENT + i,
            SendOp::Send,
            &[x.mr.sge(0, 8).unwrap()],
        ))
        .unwrap();
        assert_eq!(received!(y), i);
        assert_eq!(read(&y.mr, 4096, 8), to_y, "message {i} to y");
        y.mr.write_at(0, &to_x).unwrap();
        y.qp.post_send(&SendWr::new(
            SENT + i,
            SendOp::Send,
            &[y.mr.sge(0, 8).unwrap()],
        ))
        .unwrap();
        assert_eq!(received!(x), i);
        assert_eq!(read(&x.mr, 4096, 8), to_x, "reply {i} to x");
    }
    let (f, c) = (x.ctx.fault_stats(), y.port.counters());
    assert!(f.corrupted > 10, "{f:?}");
    assert!(c.icrc_dropped > 0, "{c:?}");
}

/// A receiver that destroys its QP right after its last receive completed, before its
/// engine runs again (ibv_rc_pingpong's last message, then exit), still acknowledges that
/// message: the Ack it held back (to ride in a reply) leaves as a datagram at the destroy.
#[test]
fn an_ack_held_back_leaves_when_the_qp_is_destroyed() {
    let _serial = serial();
    let (mut x, mut y) = pair("127.0.0.21", "127.0.0.22", Mtu::Mtu1024, 10);
    // Acks held back one iteration, as a poll-mode engine (or one with a progress helper)
    // holds them.
    y.ctx.shared.engine.with(|e| e.hold_acks = true);
    // y sends first (a QP that replies has its Acks held back to ride in a reply).
    x.qp.post_recv(&RecvWr::new(3, &[x.mr.sge(0, 64).unwrap()]))
        .unwrap();
    y.qp.post_send(&SendWr::new(4, SendOp::Send, &[y.mr.sge(0, 8).unwrap()]))
        .unwrap();
    assert_eq!(wait!(x, x, y).status, WcStatus::Success);
    assert_eq!(wait!(y, x, y).status, WcStatus::Success);
    y.qp.post_recv(&RecvWr::new(1, &[y.mr.sge(0, 64).unwrap()]))
        .unwrap();
    x.qp.post_send(&SendWr::new(2, SendOp::Send, &[x.mr.sge(0, 8).unwrap()]))
        .unwrap();
    // y's polls run its engine once each: the one that finds the Send holds its Ack back.
    let mut wc = [WorkCompletion::default()];
    let deadline = Instant::now() + Duration::from_secs(10);
    while y.cq.poll(&mut wc) == 0 {
        assert!(Instant::now() < deadline, "no receive");
    }
    assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::Success));
    let End { qp, ctx, port, .. } = y;
    drop(qp);
    let sent = wait_cq(&mut x.cq, [&x.ctx, &x.ctx], [&x.port, &x.port]);
    assert_eq!((sent.wr_id, sent.status), (2, WcStatus::Success));
    drop((port, ctx));
}

/// An Ack that rode in a reply's line leaves as its own datagram in the reply's post,
/// together with the reply. With UDP GSO the two go as one send (the reply first, as the
/// longer: GSO wants every datagram but the last of one size) and arrive together; without
/// it the Ack goes first, so that a requester waiting for it (its send queue full, as
/// ibv_rc_pingpong's and perftest's one-deep ones are) has its send completed by the time
/// the reply arrives, and its next request carries its own held Ack instead of an
/// iteration spent waiting flushing that Ack alone.
#[test]
fn a_riding_ack_leaves_with_the_reply_that_carried_it() {
    let _serial = serial();
    let (ack, send) = (
        crate::wire::opcode::Opcode::Acknowledge.code(),
        crate::wire::opcode::Opcode::SendOnly.code(),
    );
    for (gso, want) in [(false, [ack, send]), (true, [send, ack])] {
        let (mut x, mut y) = pair("127.0.0.25", "127.0.0.26", Mtu::Mtu1024, 10);
        y.ctx.shared.engine.with(|e| e.hold_acks = true);
        y.port.set_gso(gso);
        let sent = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = sent.clone();
        y.port.set_hook(Box::new(move |d: &mut [u8]| {
            log.lock().unwrap().push(d[0]);
            super::Fate::Send
        }));
        for i in 0..3u64 {
            y.qp.post_recv(&RecvWr::new(i, &[y.mr.sge(0, 64).unwrap()]))
                .unwrap();
            x.qp.post_recv(&RecvWr::new(i, &[x.mr.sge(0, 64).unwrap()]))
                .unwrap();
        }
        // Round one settles the credits (y's first Acks carry its new credit count at once).
        for round in 0..3u64 {
            x.qp.post_send(&SendWr::new(
                round,
                SendOp::Send,
                &[x.mr.sge(0, 8).unwrap()],
            ))
            .unwrap();
            let mut wc = [WorkCompletion::default()];
            let deadline = Instant::now() + Duration::from_secs(10);
            // y's polls run its engine once each: the one that finds the Send holds the Ack.
            while y.cq.poll(&mut wc) == 0 {
                x.ctx.progress();
                assert!(Instant::now() < deadline, "no receive");
            }
            assert_eq!((wc[0].wr_id, wc[0].status), (round, WcStatus::Success));
            sent.lock().unwrap().clear();
            let gso_sends = y.port.gso_sends();
            y.qp.post_send(&SendWr::new(
                round,
                SendOp::Send,
                &[y.mr.sge(0, 8).unwrap()],
            ))
            .unwrap();
            let order = sent.lock().unwrap().clone();
            if round > 0 {
                assert_eq!(order, want, "gso {gso}, round {round}: the reply's post");
                assert_eq!(
                    y.port.gso_sends() - gso_sends,
                    u64::from(gso),
                    "gso {gso}: one GSO send for the two"
                );
            }
            assert_eq!(wait!(x, x, y).status, WcStatus::Success);
            assert_eq!(wait!(x, x, y).status, WcStatus::Success);
            assert_eq!(wait!(y, x, y).status, WcStatus::Success);
        }
    }
}

/// The Ack and the reply it rides with, one GSO send, reach the requester's port as ONE
/// message (`UDP_GRO`: the receiving socket does not cut it into two socket buffers, which
/// cost about a datagram's whole trip), which its pump cuts: the Ack completes the Send,
/// the reply the receive, every byte right. Without `UDP_GRO` the socket handed the two
/// over as two datagrams and no message carried two.
#[test]
fn an_ack_and_its_reply_arrive_as_one_message_and_are_cut_by_the_pump() {
    let _serial = serial();
    let (mut x, mut y) = pair("127.0.0.27", "127.0.0.28", Mtu::Mtu1024, 10);
    y.ctx.shared.engine.with(|e| e.hold_acks = true);
    for i in 0..4u64 {
        y.qp.post_recv(&RecvWr::new(i, &[y.mr.sge(0, 64).unwrap()]))
            .unwrap();
        x.qp.post_recv(&RecvWr::new(i, &[x.mr.sge(4096, 64).unwrap()]))
            .unwrap();
    }
    let mut merged = Vec::new();
    let mut overasked: Vec<u64> = Vec::new();
    for round in 0..4u64 {
        let (to_y, to_x) = (pattern(round, 8), pattern(round + 100, 8));
        x.mr.write_at(0, &to_y).unwrap();
        x.qp.post_send(&SendWr::new(
            10 + round,
            SendOp::Send,
            &[x.mr.sge(0, 8).unwrap()],
        ))
        .unwrap();
        let mut wc = [WorkCompletion::default()];
        let deadline = Instant::now() + Duration::from_secs(10);
        while y.cq.poll(&mut wc) == 0 {
            x.ctx.progress();
            assert!(Instant::now() < deadline, "no receive");
        }
        assert_eq!((wc[0].wr_id, wc[0].status), (round, WcStatus::Success));
        assert_eq!(read(&y.mr, 0, 8), to_y);
        let before = x.port.merged_receives();
        let over = x.port.overasked_receives();
        y.mr.write_at(1024, &to_x).unwrap();
        // The reply, with y's held Ack riding: one GSO send.
        y.qp.post_send(&SendWr::new(
            20 + round,
            SendOp::Send,
            &[y.mr.sge(1024, 8).unwrap()],
        ))
        .unwrap();
        // x's Send and receive complete (in either order).
        let mut ids = [wait!(x, x, y), wait!(x, x, y)].map(|wc| {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            wc.wr_id
        });
        ids.sort_unstable();
        assert_eq!(ids, [round, 10 + round]);
        assert_eq!(read(&x.mr, 4096, 8), to_x);
        merged.push(x.port.merged_receives() - before);
        overasked.push(x.port.overasked_receives() - over);
        assert_eq!(wait!(y, x, y).status, WcStatus::Success);
    }
    // Round 0 settles the credits (y's first Ack may leave alone); from then on each
    // reply and its Ack arrive as one message.
    assert_eq!(
        merged[1..],
        [1, 1, 1],
        "messages of two datagrams per round"
    );
    // x waited for each reply with empty polls, then received it with a `recvmmsg` that
    // asked for one message: the kernel made no second try for a message that was not
    // there. (Asking for the room, it did, every round; in round 0 y's Ack came alone,
    // then the reply.)
    assert_eq!(
        overasked[1..],
        [0, 0, 0],
        "receives that asked for more than came"
    );
    let c = x.port.counters();
    assert_eq!((c.icrc_dropped, c.malformed_dropped), (0, 0), "{c:?}");
}

/// A burst that waits on the socket when the receiver polls again (here 40 datagrams, GSO
/// off, while y's engine did not run) is taken whole and in order: the receive after the
/// empty polls asks for one message, and each receive that got all it asked for doubles
/// the ask (1, 2, 4, 8, 16, then the rest), so a stream is back at full bursts within a
/// few receives.
#[test]
fn a_burst_after_empty_polls_is_taken_whole_as_the_ask_doubles() {
    let _serial = serial();
    let (mut x, mut y) = pair("127.0.0.29", "127.0.0.30", Mtu::Mtu1024, 10);
    x.port.set_gso(false);
    const N: u64 = 40;
    for i in 0..N {
        y.qp.post_recv(&RecvWr::new(i, &[y.mr.sge(64 * i, 64).unwrap()]))
            .unwrap();
    }
    // y's engine polls the empty socket first.
    for _ in 0..3 {
        y.ctx.progress();
    }
    let c0 = y.port.counters();
    for i in 0..N {
        x.mr.write_at(8 * i, &pattern(i, 8)).unwrap();
        x.qp.post_send(&SendWr::new(
            i,
            SendOp::Send,
            &[x.mr.sge(8 * i, 8).unwrap()],
        ))
        .unwrap();
    }
    x.ctx.progress();
    for i in 0..N {
        let wc = wait!(y, x, y);
        assert_eq!((wc.wr_id, wc.status), (i, WcStatus::Success), "in order");
        assert_eq!(read(&y.mr, 64 * i, 8), pattern(i, 8));
    }
    let c = y.port.counters();
    assert!(c.datagrams_received - c0.datagrams_received >= N, "{c:?}");
    assert_eq!((c.malformed_dropped, c.icrc_dropped), (0, 0), "{c:?}");
}

/// `SHMHCA_UDP_GRO=0` leaves a port's socket cutting GSO sends; anything else (or
/// nothing) has them arrive whole.
#[test]
fn shmhca_udp_gro_0_turns_gro_off() {
    use super::pump::gro_wanted;
    use std::ffi::OsStr;
    assert!(gro_wanted(None));
    assert!(!gro_wanted(Some(OsStr::new("0"))));
    assert!(gro_wanted(Some(OsStr::new("1"))));
}

/// `SHMHCA_UDP_GSO=0` turns GSO sends off; anything else (or nothing) leaves them on.
#[test]
fn shmhca_udp_gso_0_turns_gso_off() {
    use super::pump::gso_wanted;
    use std::ffi::OsStr;
    assert!(gso_wanted(None));
    assert!(!gso_wanted(Some(OsStr::new("0"))));
    assert!(gso_wanted(Some(OsStr::new("1"))));
}

/// A new QP of `x`'s with a destination made for it towards remote QP `qpn` at `peer`
/// (its route, and source-port socket, at the port), left in Reset.
fn qp_towards(x: &End, peer: SocketAddr, qpn: u32) -> Qp {
    let qp = x
        .ctx
        .create_qp(&x._pd, &x.cq, &x.cq, QpCaps::default())
        .unwrap();
    x.port
        .destination_at(&qp, peer, crate::Qpn::new(qpn))
        .unwrap();
    qp
}

/// A destroyed QP's source-port socket is closed with its route (hostile review M2): a
/// server that connects QP after QP, each client with a QPN of its own (so each pair a
/// source port of its own), keeps no socket per past connection, and would otherwise run
/// out of file descriptors.
#[test]
fn a_destroyed_qps_source_port_socket_is_closed() {
    let _serial = serial();
    let x = end("127.0.0.27:0".parse().unwrap());
    let peer: SocketAddr = "127.0.0.28:4791".parse().unwrap();
    let mut qps = Vec::new();
    for i in 0..8u32 {
        qps.push(qp_towards(&x, peer, 0x1000 + 7 * i));
    }
    assert_eq!(x.port.source_sockets(), 8, "one per live QP pair");
    drop(qps);
    assert_eq!(x.port.source_sockets(), 0, "none left by destroyed QPs");
    for i in 0..64u32 {
        let qp = qp_towards(&x, peer, 0x2000 + 7 * i);
        assert_eq!(x.port.source_sockets(), 1, "cycle {i}");
        drop(qp);
    }
    assert_eq!(x.port.source_sockets(), 0);
}

/// A link no QP uses any more is removed when the port makes its next one (hostile review
/// M3): a server whose clients name address after address (in rc-pingpong's GID, a
/// verbs server's `grh.dgid`) keeps a link per address a live QP talks to, not one per
/// address ever named. A link a live QP uses stays, and works.
#[test]
fn a_link_no_qp_uses_is_removed_when_the_next_is_made() {
    let _serial = serial();
    let (mut x, mut y) = pair("127.0.0.29", "127.0.0.30", Mtu::Mtu1024, 10);
    assert_eq!(x.port.link_count(), 1);
    for i in 0..32u8 {
        let peer = SocketAddr::new(IpAddr::from([10, 99, 0, i + 1]), 4791);
        let qp = qp_towards(&x, peer, 0x22);
        assert_eq!(
            x.port.link_count(),
            2,
            "address {i}: y's link and this QP's"
        );
        drop(qp);
    }
    // y's link, used all along by x's QP, still carries a message.
    y.qp.post_recv(&RecvWr::new(1, &[y.mr.sge(0, 64).unwrap()]))
        .unwrap();
    x.qp.post_send(&SendWr::new(2, SendOp::Send, &[x.mr.sge(0, 8).unwrap()]))
        .unwrap();
    assert_eq!(wait!(y, x, y).status, WcStatus::Success);
    assert_eq!(wait!(x, x, y).status, WcStatus::Success);
}

/// A destination made for one QP is refused at another's RTR (hostile review L7): the
/// port reads the packets to a remote QP from the memory of the QP the destination was
/// made for, so a copied `Destination` would have sent the first QP's bytes.
#[test]
fn a_destination_made_for_another_qp_is_refused() {
    let _serial = serial();
    let x = end("127.0.0.31:0".parse().unwrap());
    let y = end("127.0.0.32:0".parse().unwrap());
    let dest = x
        .port
        .destination_at(&x.qp, y.port.local_addr(), y.qp.qpn())
        .unwrap();
    let mut other = x
        .ctx
        .create_qp(&x._pd, &x.cq, &x.cq, QpCaps::default())
        .unwrap();
    other
        .modify(&QpAttr::new(QpState::Init).access(AccessFlags::ALL))
        .unwrap();
    let e = other
        .modify(
            &QpAttr::new(QpState::Rtr)
                .path_mtu(Mtu::Mtu1024)
                .dest(dest)
                .rq_psn(0)
                .max_dest_rd_atomic(4)
                .min_rnr_timer(1),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("was not made for QP"), "{e}");
    assert_eq!(other.state(), QpState::Init, "nothing changed");
}

/// Two local QPs cannot name the same remote QP: the port reads the packets to a remote
/// QP from one QP's memory (another protection domain's bytes must never go out as this
/// QP's payload). Once the first QP is destroyed, the remote QP is free again.
#[test]
fn two_local_qps_cannot_share_one_remote_qp() {
    let ctx = crate::raw_peer::inline_context();
    let port = UdpPort::bind_addr(&ctx, "127.0.0.17:0".parse().unwrap()).unwrap();
    let (pd1, pd2) = (ctx.alloc_pd().unwrap(), ctx.alloc_pd().unwrap());
    let cq = ctx.create_cq(8).unwrap();
    let q1 = ctx.create_qp(&pd1, &cq, &cq, QpCaps::default()).unwrap();
    let q2 = ctx.create_qp(&pd2, &cq, &cq, QpCaps::default()).unwrap();
    let peer: SocketAddr = "127.0.0.18:4791".parse().unwrap();
    let remote = crate::Qpn::new(0x42);
    port.destination_at(&q1, peer, remote).unwrap();
    // The same QP again is fine (an RTR retried).
    port.destination_at(&q1, peer, remote).unwrap();
    let err = port
        .destination_at(&q2, peer, remote)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("0x42") && err.contains(&format!("{:#x}", q1.qpn().get())),
        "{err}"
    );
    // Another remote QP is fine.
    port.destination_at(&q2, peer, crate::Qpn::new(0x43))
        .unwrap();
    drop(q1);
    port.destination_at(&q2, peer, remote).unwrap();
}

/// A port binds one unicast address: the ICRC covers the addresses, so a wildcard bind
/// would fail every packet's check without a word.
#[test]
fn a_wildcard_multicast_or_broadcast_address_is_refused() {
    let ctx = crate::raw_peer::inline_context();
    for a in ["0.0.0.0", "::", "224.0.0.1", "ff02::1", "255.255.255.255"] {
        let err = UdpPort::bind_addr(&ctx, SocketAddr::new(a.parse().unwrap(), 0))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(a) && err.contains("unicast address"),
            "{a}: {err}"
        );
    }
}

#[test]
fn a_taken_port_is_a_clear_error() {
    let _serial = serial();
    let ctx = crate::raw_peer::inline_context();
    let a = UdpPort::bind_addr(&ctx, "127.0.0.8:0".parse().unwrap()).unwrap();
    let err = UdpPort::bind_addr(&ctx, a.local_addr())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("4791") && err.contains(&a.local_addr().to_string()),
        "{err}"
    );
}

/// The reference CRC-32 (bit by bit, reflected polynomial 0xEDB88320), independent of
/// the crate's ICRC code.
fn reference_crc(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// The ICRC of an IPv4 RoCEv2 packet (`ip` starts at the IP header), from the spec's
/// masking rules, computed by [`reference_crc`]; and the one it carries.
fn icrc_of_captured(ip: &[u8]) -> Option<(u32, u32)> {
    let ihl = usize::from(ip.first()? & 15) * 4;
    let total = usize::from(u16::from_be_bytes([*ip.get(2)?, *ip.get(3)?]));
    let ip = ip.get(..total)?;
    let mut pseudo = vec![0xFFu8; 8];
    let mut h = ip[..ihl].to_vec();
    h[1] = 0xFF;
    h[8] = 0xFF;
    h[10] = 0xFF;
    h[11] = 0xFF;
    pseudo.extend_from_slice(&h);
    let mut udp = ip.get(ihl..ihl + 8)?.to_vec();
    udp[6] = 0xFF;
    udp[7] = 0xFF;
    pseudo.extend_from_slice(&udp);
    let mut t = ip.get(ihl + 8..total - 4)?.to_vec();
    *t.get_mut(4)? = 0xFF;
    pseudo.extend_from_slice(&t);
    let carried = u32::from_le_bytes(ip[total - 4..].try_into().ok()?);
    Some((reference_crc(&pseudo), carried))
}

/// The IPv4 packets of a pcap file (Ethernet link type), as bytes from the IP header.
fn pcap_ipv4_packets(file: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    if file.len() < 24 {
        return out;
    }
    let le = file[..4] == [0xD4, 0xC3, 0xB2, 0xA1] || file[..4] == [0x4D, 0x3C, 0xB2, 0xA1];
    let u32_at = |b: &[u8]| {
        let a = [b[0], b[1], b[2], b[3]];
        if le {
            u32::from_le_bytes(a)
        } else {
            u32::from_be_bytes(a)
        }
    };
    let mut at = 24;
    while at + 16 <= file.len() {
        let caplen = u32_at(&file[at + 8..]) as usize;
        let Some(frame) = file.get(at + 16..at + 16 + caplen) else {
            break;
        };
        if frame.len() > 14 && frame[12..14] == [0x08, 0x00] {
            out.push(frame[14..].to_vec());
        }
        at += 16 + caplen;
    }
    out
}

/// Two network namespaces joined by a veth pair (198.18.0.1 and 198.18.0.2, port 4791),
/// made and removed by the test: every operation across sizes, with loss; then, if
/// dumpcap and tshark are here, a capture of the veth decoded as InfiniBand, every ICRC
/// checked by a CRC of the test's own.
#[test]
fn two_namespaces_over_a_veth_pair() {
    let _serial = serial();
    use super::socket::netns::{Netns, available, ip};
    if !available("two_namespaces_over_a_veth_pair") {
        return;
    }
    let tag = std::process::id() % 100_000;
    let ns_a = Netns::new(&format!("shmhca-a-{tag}")).unwrap();
    let ns_b = Netns::new(&format!("shmhca-b-{tag}")).unwrap();
    let (va, vb) = (format!("shva{tag}"), format!("shvb{tag}"));
    ip(&[
        "link", "add", &va, "netns", &ns_a.0, "type", "veth", "peer", "name", &vb, "netns", &ns_b.0,
    ])
    .unwrap();
    ip(&["-n", &ns_a.0, "addr", "add", "198.18.0.1/30", "dev", &va]).unwrap();
    ip(&["-n", &ns_b.0, "addr", "add", "198.18.0.2/30", "dev", &vb]).unwrap();
    // Datagrams cross (and are captured) one by one, as a NIC puts them on the wire: a
    // veth would carry a GSO send whole to the other end (where the receiving socket cuts
    // it), and the capture would see one IP packet of several RoCEv2 packets. Cut here,
    // the segments show the IPv4 IDs the kernel gives them, which their ICRCs must cover.
    for (ns, v) in [(&ns_a.0, &va), (&ns_b.0, &vb)] {
        ip(&["-n", ns, "link", "set", v, "gso_max_segs", "1"]).unwrap();
    }
    ip(&["-n", &ns_a.0, "link", "set", &va, "up"]).unwrap();
    ip(&["-n", &ns_b.0, "link", "set", &vb, "up"]).unwrap();
    let (a_ip, b_ip): (IpAddr, IpAddr) =
        ("198.18.0.1".parse().unwrap(), "198.18.0.2".parse().unwrap());

    // A capture of the veth in namespace A, if dumpcap and tshark are here.
    let tools = ["dumpcap", "tshark"].iter().all(|t| {
        std::process::Command::new(t)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if !tools {
        eprintln!(
            "two_namespaces_over_a_veth_pair: capture check skipped (dumpcap/tshark not installed)"
        );
    }
    let pcap = std::env::temp_dir().join(format!("shmhca-udp-veth-{tag}.pcap"));
    /// Removes the capture file however the test ends.
    struct RemoveFile(std::path::PathBuf);
    impl Drop for RemoveFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _remove = RemoveFile(pcap.clone());
    /// Stops (kills) the capture however the test ends.
    struct Capture(std::process::Child);
    impl Drop for Capture {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let capture = tools.then(|| {
        let c = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &ns_a.0,
                "dumpcap",
                "-q",
                "-P",
                "-i",
                &va,
                "-f",
                "udp port 4791",
                "-w",
            ])
            .arg(&pcap)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // dumpcap needs a moment to start capturing (bounded: 100 × 20 ms).
        for _ in 0..100 {
            if pcap.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(200));
        Capture(c)
    });

    let mut x = end_in(&ns_a, a_ip);
    let mut y = end_in(&ns_b, b_ip);
    connect_real(&mut x, &y, b_ip);
    connect_real(&mut y, &x, a_ip);
    every_operation(&mut x, &mut y, &[0, 1, 29, 1024, 1025, 20_000]);
    // Loss on the wire: every 9th datagram from A dropped.
    let mut n = 0u64;
    x.port.set_hook(Box::new(move |_| {
        n += 1;
        super::Fate::send_if(n % 9 != 0)
    }));
    every_operation(&mut x, &mut y, &[3000, 9000]);
    assert!(x.ctx.stats().retransmitted > 0);

    if let Some(mut c) = capture {
        std::thread::sleep(Duration::from_millis(300));
        // dumpcap finishes its file on SIGINT (sent by `kill` to its pid only).
        let _ = std::process::Command::new("kill")
            .args(["-INT", &c.0.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while c.0.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(c);
        let out = std::process::Command::new("tshark")
            .arg("-r")
            .arg(&pcap)
            .args(["--disable-heuristic", "rpcrdma_infiniband"])
            .args([
                "-T",
                "fields",
                "-e",
                "infiniband.bth.opcode",
                "-e",
                "_ws.malformed",
                "-e",
                "_ws.expert",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.len() > 50, "captured {} packets", lines.len());
        for l in &lines {
            let f: Vec<&str> = l.split('\t').collect();
            assert!(
                !f[0].is_empty(),
                "a packet tshark did not decode as InfiniBand: {l:?}"
            );
            assert!(f.get(1).is_none_or(|m| m.is_empty()), "malformed: {l:?}");
        }
        let bytes = std::fs::read(&pcap).unwrap();
        let packets = pcap_ipv4_packets(&bytes);
        assert_eq!(packets.len(), lines.len());
        let ids: Vec<u16> = packets
            .iter()
            .map(|p| u16::from_be_bytes([p[4], p[5]]))
            .collect();
        for p in &packets {
            let (want, carried) = icrc_of_captured(p).expect("a whole RoCEv2 packet");
            assert_eq!(want, carried, "ICRC of a captured packet");
        }
        // The IDs are each datagram's place in its GSO send (0 for one sent alone), and
        // some went several to a send (an Ack and its request, a message's packets).
        assert!(ids.iter().all(|&id| id < 64), "IP IDs {ids:?}");
        assert!(ids.iter().any(|&id| id > 0), "no GSO send among {ids:?}");
    }
    drop((x, y));
    ip(&["-n", &ns_a.0, "link", "del", &va]).unwrap();
}

/// An end whose socket lives in namespace `ns` (a socket keeps the namespace it was made
/// in; the engine and the pump thread need nothing of it).
fn end_in(ns: &super::socket::netns::Netns, ip: IpAddr) -> End {
    let ctx = crate::raw_peer::inline_context();
    let port = ns.run(|| UdpPort::bind(&ctx, ip)).unwrap().unwrap();
    end_on(ctx, port)
}

/// [`connect`] through the public [`UdpPort::destination`] (peer at port 4791).
fn connect_real(me: &mut End, peer: &End, peer_ip: IpAddr) {
    let dest = me.port.destination(&me.qp, peer_ip, peer.qp.qpn()).unwrap();
    bring_up(me, dest, Mtu::Mtu1024, 14);
}

/// A poll-mode context whose engine thread sleeps when idle, up to 30 s at a time: only a
/// wake-up (a peer's datagram seen by the port's watcher) ends such a sleep early.
fn poll_context() -> Context {
    Context::builder()
        .mode(crate::EngineMode::Poll { cpu: None })
        .idle(crate::IdlePolicy::Backoff {
            spins: 1000,
            max_sleep: Duration::from_secs(30),
        })
        .huge_pages(shmhca_rings::HugePages::Never)
        .arena_size(4 << 20)
        .build()
        .unwrap()
}

/// The next completion of `cq` (its engine runs on its own thread), within 10 s.
fn next_wc(cq: &mut Cq) -> WorkCompletion {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut wc = [WorkCompletion::default()];
    while cq.poll(&mut wc) == 0 {
        assert!(Instant::now() < deadline, "no completion within 10 s");
        std::thread::yield_now();
    }
    wc[0]
}

/// Engine threads that sleep when idle, two QP pairs over one UDP link (each QP in a
/// protection domain of its own): ping-pongs on both pairs, then a pause long enough for every
/// engine thread and pump to fall asleep, then more: the pumps wake the engines and the
/// engines wake the pumps.
#[test]
fn sleeping_engines_ping_pong_on_two_qps_over_one_link() {
    let _serial = serial();
    let (ca, cb) = (poll_context(), poll_context());
    let (ip_a, ip_b) = ("127.0.0.9", "127.0.0.10");
    let pa = UdpPort::bind_addr(&ca, SocketAddr::new(ip_a.parse().unwrap(), 0)).unwrap();
    let pb = UdpPort::bind_addr(&cb, SocketAddr::new(ip_b.parse().unwrap(), 0)).unwrap();
    struct Q {
        _pd: Pd,
        cq: Cq,
        qp: Qp,
        mr: Mr,
    }
    let make = |ctx: &Context| {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
        let mr = pd.alloc_mr(1 << 16, AccessFlags::LOCAL_WRITE).unwrap();
        Q {
            _pd: pd,
            cq,
            qp,
            mr,
        }
    };
    let mut pairs: Vec<(Q, Q)> = (0..2).map(|_| (make(&ca), make(&cb))).collect();
    for (a, b) in &mut pairs {
        let da = pa
            .destination_at(&a.qp, pb.local_addr(), b.qp.qpn())
            .unwrap();
        let db = pb
            .destination_at(&b.qp, pa.local_addr(), a.qp.qpn())
            .unwrap();
        assert_eq!(
            da.link,
            pa.destination_at(&a.qp, pb.local_addr(), b.qp.qpn())
                .unwrap()
                .link
        );
        for (q, d) in [(&mut a.qp, da), (&mut b.qp, db)] {
            q.modify(&QpAttr::new(QpState::Init).access(AccessFlags::NONE))
                .unwrap();
            q.modify(
                &QpAttr::new(QpState::Rtr)
                    .path_mtu(Mtu::Mtu1024)
                    .dest(d)
                    .rq_psn(0)
                    .max_dest_rd_atomic(1)
                    .min_rnr_timer(1),
            )
            .unwrap();
            q.modify(
                &QpAttr::new(QpState::Rts)
                    .sq_psn(0)
                    .timeout(14)
                    .retry_cnt(7)
                    .rnr_retry(7)
                    .max_rd_atomic(1),
            )
            .unwrap();
        }
    }
    let mut round = 0u64;
    let mut ping_pong = |pairs: &mut Vec<(Q, Q)>, rounds: u64| {
        for _ in 0..rounds {
            round += 1;
            for (k, (a, b)) in pairs.iter_mut().enumerate() {
                let len = 1 + (round as usize * 37 + k * 1000) % 3000;
                let msg = pattern(round * 2 + k as u64, len);
                b.qp.post_recv(&RecvWr::new(round, &[b.mr.sge(4096, 4096).unwrap()]))
                    .unwrap();
                a.qp.post_recv(&RecvWr::new(round, &[a.mr.sge(4096, 4096).unwrap()]))
                    .unwrap();
                a.mr.write_at(0, &msg).unwrap();
                a.qp.post_send(&SendWr::new(
                    round,
                    SendOp::Send,
                    &[a.mr.sge(0, len as u32).unwrap()],
                ))
                .unwrap();
                // b answers as soon as it has the request, with the bytes it got.
                let mut got = [next_wc(&mut b.cq), WorkCompletion::default()];
                if got[0].opcode != crate::completion::WcOpcode::Recv {
                    got[1] = got[0];
                    got[0] = next_wc(&mut b.cq);
                }
                ok(got[0], round);
                assert_eq!(read(&b.mr, 4096, len), msg, "request of round {round}");
                let reply = b.mr.sge(4096, len as u32).unwrap();
                b.qp.post_send(&SendWr::new(round, SendOp::Send, &[reply]))
                    .unwrap();
                // a: its Send's completion and the reply; b: its reply's completion.
                let (mut sends, mut recvs) = (0, 0);
                while sends + recvs < 2 {
                    let wc = next_wc(&mut a.cq);
                    ok(wc, round);
                    if wc.opcode == crate::completion::WcOpcode::Recv {
                        recvs += 1;
                    } else {
                        sends += 1;
                    }
                }
                assert_eq!(read(&a.mr, 4096, len), msg, "reply of round {round}");
                let need = if got[1].wr_id == round { 0 } else { 1 };
                for _ in 0..need {
                    ok(next_wc(&mut b.cq), round);
                }
            }
        }
    };
    ping_pong(&mut pairs, 100);
    // Both engine threads fall asleep (for up to 30 s): each port's watcher must wake its
    // engine when the peer's datagram arrives.
    std::thread::sleep(Duration::from_millis(400));
    let slept = (ca.stats().sleeps, cb.stats().sleeps);
    let t = Instant::now();
    ping_pong(&mut pairs, 1);
    let woke_in = t.elapsed();
    ping_pong(&mut pairs, 50);
    assert!(slept.0 > 0 && slept.1 > 0, "the engines slept: {slept:?}");

    eprintln!("sleeping_engines_ping_pong: first round after sleeping took {woke_in:?}");
    assert!(woke_in < Duration::from_secs(2), "{woke_in:?}");
    let (ka, kb) = (pa.counters(), pb.counters());
    assert_eq!(ka.encode_dropped + kb.encode_dropped, 0, "{ka:?} {kb:?}");
    assert_eq!(ka.icrc_dropped + kb.icrc_dropped, 0, "{ka:?} {kb:?}");
}

/// Takes `me`'s QP to RTS towards `peer`'s QP, its datagrams sent with IP traffic class
/// `tc` (its ECN bits included) and TTL `ttl` (0: the default).
fn connect_tc(me: &mut End, peer: &End, tc: u8, ttl: u8) {
    let dest = me
        .port
        .destination_at(&me.qp, peer.port.local_addr(), peer.qp.qpn())
        .unwrap();
    bring_up_with(me, dest, Mtu::Mtu1024, 14, |a| {
        a.hop_limit(ttl).traffic_class(tc)
    });
}

/// `count` 64-byte Sends from `x` to `y`, posted in batches of 16 (as fast as both
/// engines take them), each completed on both sides.
fn sends(x: &mut End, y: &mut End, count: u64) {
    let mut id = 0;
    while id < count {
        let batch = (count - id).min(16);
        for i in id..id + batch {
            y.qp.post_recv(&RecvWr::new(i, &[y.mr.sge(4096, 64).unwrap()]))
                .unwrap();
            x.qp.post_send(&SendWr::new(i, SendOp::Send, &[x.mr.sge(0, 64).unwrap()]))
                .unwrap();
        }
        for i in id..id + batch {
            ok(wait!(y, x, y), i);
            ok(wait!(x, x, y), i);
        }
        id += batch;
    }
}

/// Runs both ends until `x` has received every CNP `y` sent (5 s at most: loopback loses
/// none); the CNPs sent.
fn settle_cnps(x: &End, y: &End) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        x.ctx.progress();
        y.ctx.progress();
        let (sent, got) = (y.port.counters().cnps_sent, x.port.counters().cnps_received);
        if sent == got {
            return sent;
        }
        assert!(Instant::now() < deadline, "{got} of {sent} CNPs arrived");
        std::thread::yield_now();
    }
}

/// A QP whose traffic class marks its datagrams Congestion Experienced (ECN bits 0b11,
/// alone or under a DSCP; over IPv4 and IPv6) sends 300 Sends as fast as they go: its
/// peer, the notification point, counts every one as marked and answers with CNPs — at
/// least one, and at most one per `CNP_INTERVAL` of the time the test took (+1) — which
/// this side counts as received, as many as were sent; the peer's own (unmarked) packets
/// bring no CNP back. The counts are the contexts' `Stats` too.
#[test]
fn ce_marked_packets_bring_cnps_back_at_most_one_per_interval() {
    let _serial = serial();
    for (a, b, tc) in [
        ("127.0.0.31", "127.0.0.32", 0x03u8),
        ("127.0.0.33", "127.0.0.34", 0xbb),
        ("::1", "::1", 0x03),
    ] {
        let mut x = end(SocketAddr::new(a.parse().unwrap(), 0));
        let mut y = end(SocketAddr::new(b.parse().unwrap(), 0));
        connect_tc(&mut x, &y, tc, 0);
        connect(&mut y, &x, Mtu::Mtu1024, 14);
        let start = Instant::now();
        sends(&mut x, &mut y, 300);
        let cnps = settle_cnps(&x, &y);
        let elapsed = start.elapsed();
        let (cx, cy) = (x.port.counters(), y.port.counters());
        assert!(cy.ce_marked_received >= 300, "{tc:#x}: {cy:?}");
        let bound = elapsed.as_nanos() / super::pump::CNP_INTERVAL.as_nanos() + 1;
        assert!(
            cnps >= 1 && u128::from(cnps) <= bound,
            "{tc:#x}: {cnps} CNPs in {elapsed:?} (at most {bound}); {cy:?}"
        );
        assert_eq!(cx.cnps_received, cnps, "{tc:#x}");
        // Nothing the other way: y's packets were not marked.
        assert_eq!(
            (cx.ce_marked_received, cx.cnps_sent, cy.cnps_received),
            (0, 0, 0),
            "{tc:#x}: {cx:?} / {cy:?}"
        );
        // Nor did a CNP break anything: no drops, nothing malformed.
        assert_eq!((cx.malformed_dropped, cx.icrc_dropped), (0, 0), "{cx:?}");
        let (sx, sy) = (x.ctx.stats(), y.ctx.stats());
        assert_eq!((sx.cnps_received, sy.cnps_sent), (cnps, cnps));
        assert_eq!(sy.ce_marked_received, cy.ce_marked_received);
    }
}

/// Not-ECT (0b00), ECT(1) (0b01) and ECT(0) (0b10) datagrams, with and without a DSCP,
/// are not marked: no CNP comes back for 100 Sends.
#[test]
fn packets_not_marked_ce_bring_no_cnp() {
    let _serial = serial();
    for (k, tc) in [0x00u8, 0x01, 0x02, 0xb8, 0xba].into_iter().enumerate() {
        let mut x = end(SocketAddr::new(
            format!("127.0.0.{}", 41 + 2 * k).parse().unwrap(),
            0,
        ));
        let mut y = end(SocketAddr::new(
            format!("127.0.0.{}", 42 + 2 * k).parse().unwrap(),
            0,
        ));
        connect_tc(&mut x, &y, tc, 0);
        connect(&mut y, &x, Mtu::Mtu1024, 14);
        sends(&mut x, &mut y, 100);
        settle_cnps(&x, &y);
        let (cx, cy) = (x.port.counters(), y.port.counters());
        assert!(cy.datagrams_received >= 100, "{tc:#x}: {cy:?}");
        assert_eq!(
            (cy.ce_marked_received, cy.cnps_sent, cx.cnps_received),
            (0, 0, 0),
            "{tc:#x}: {cy:?}"
        );
    }
}

/// The interval runs on the engine's clock: with the notification point's engine on a
/// test clock that stands still, any number of marked packets bring exactly one CNP; a
/// nanosecond short of `CNP_INTERVAL` later still none more; at the interval, one more.
/// Each CNP is the annex's, to the QP that sent the marked packets (seen by a hook on
/// the notification point's datagrams): opcode 0x81, P_Key 0xFFFF, BECN, that QP's
/// number, PSN 0, 16 zero bytes.
#[test]
fn the_cnp_interval_runs_on_the_engine_clock_and_cnps_go_to_the_marked_sender() {
    let _serial = serial();
    let clock = crate::timer::TestClock::new();
    let ctx = crate::raw_peer::inline_context_on(clock.clone());
    let port = UdpPort::bind_addr(&ctx, "127.0.0.52:0".parse().unwrap()).unwrap();
    let mut y = end_on(ctx, port);
    let mut x = end("127.0.0.51:0".parse().unwrap());
    connect_tc(&mut x, &y, 0x03, 0);
    connect(&mut y, &x, Mtu::Mtu1024, 14);
    let cnps = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Vec<u8>>::new()));
    let seen = cnps.clone();
    y.port.set_hook(Box::new(move |d| {
        if d.first() == Some(&super::datagram::OPCODE_CNP) {
            seen.lock().unwrap().push(d.to_vec());
        }
        super::Fate::Send
    }));
    let interval = super::pump::CNP_INTERVAL;
    let mut marked = 0;
    for (advance, more, want) in [
        (Duration::ZERO, 50, 1),
        (interval - Duration::from_nanos(1), 20, 1),
        (Duration::from_nanos(1), 1, 2),
        (Duration::ZERO, 20, 2),
        (interval * 3, 5, 3),
    ] {
        clock.advance(advance);
        sends(&mut x, &mut y, more);
        marked += more;
        assert_eq!(settle_cnps(&x, &y), want, "after {advance:?}");
        assert!(y.port.counters().ce_marked_received >= marked);
    }
    let cnps = cnps.lock().unwrap();
    assert_eq!(cnps.len(), 3);
    let qpn = x.qp.qpn().get().to_be_bytes();
    for c in cnps.iter() {
        assert_eq!(c.len(), 12 + 16 + 4);
        assert_eq!(c[..5], [0x81, 0, 0xff, 0xff, 0x40]);
        assert_eq!(c[5..8], qpn[1..], "to the QP that sent the marked packets");
        assert_eq!(c[8..28], [0; 20], "PSN 0, 16 reserved bytes");
    }
}

/// The CNPs leave with the notification point's QP's TTL and traffic class, from its
/// source port, and arrive at the marked sender's port; captured on the loopback of a
/// namespace of the test's own (root only).
#[test]
fn a_cnp_goes_with_its_qps_ttl_traffic_class_and_source_port() {
    use super::socket::netns::{Netns, PacketCapture, available};
    let _serial = serial();
    if !available("a_cnp_goes_with_its_qps_ttl_traffic_class_and_source_port") {
        return;
    }
    let ns = Netns::new(&format!("shmhca-cnp-{}", std::process::id() % 100_000)).unwrap();
    // Captured one datagram at a time (a GSO send cut at the device, as on a wire).
    super::socket::netns::ip(&["-n", &ns.0, "link", "set", "lo", "gso_max_segs", "1"]).unwrap();
    let cap = ns.run(|| PacketCapture::open("lo")).unwrap().unwrap();
    let (xa, ya): (IpAddr, IpAddr) = ("127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap());
    let mut x = end_in(&ns, xa);
    let mut y = end_in(&ns, ya);
    let (xp, xq, yq) = (&x.port, &x.qp, y.qp.qpn());
    let dest = ns.run(|| xp.destination(xq, ya, yq)).unwrap().unwrap();
    bring_up_with(&mut x, dest, Mtu::Mtu1024, 14, |a| a.traffic_class(0x03));
    let (yp, yqp, xq) = (&y.port, &y.qp, x.qp.qpn());
    let dest = ns.run(|| yp.destination(yqp, xa, xq)).unwrap().unwrap();
    bring_up_with(&mut y, dest, Mtu::Mtu1024, 14, |a| {
        a.hop_limit(17).traffic_class(0x68)
    });
    sends(&mut x, &mut y, 20);
    let n = settle_cnps(&x, &y);
    assert!(n >= 1);
    let packets = cap.ipv4_udp_packets(4791, 64, Duration::from_secs(2));
    let sport = shmhca_proto::roce::source_port(0, x.qp.qpn(), y.qp.qpn());
    let cnps: Vec<&Vec<u8>> = packets
        .iter()
        .filter(|p| {
            let ihl = usize::from(p[0] & 15) * 4;
            p.get(ihl + 8) == Some(&0x81)
        })
        .collect();
    assert!(!cnps.is_empty(), "no CNP among {} datagrams", packets.len());
    for p in cnps {
        let ihl = usize::from(p[0] & 15) * 4;
        assert_eq!(p[12..20], [127, 0, 0, 2, 127, 0, 0, 1], "from y to x");
        assert_eq!((p[8], p[1]), (17, 0x68), "(TTL, TOS) of y's QP");
        assert_eq!(u16::from_be_bytes([p[ihl], p[ihl + 1]]), sport);
        assert_eq!(p.len(), ihl + 8 + 12 + 16 + 4);
    }
}
