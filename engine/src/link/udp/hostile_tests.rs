//! What a stranger's datagrams can do to a `UdpPort`, from the hostile review of the UDP
//! link (M1, L2, L4, L6): a QP over a port, its peer a plain UDP socket that writes its
//! datagrams by hand (each ICRC computed for the IPv4 ID the test says: the receiver cannot
//! see the real one, so a socket plays a NIC that counts its IDs as well as Linux's ID 0),
//! and a spoofer on the peer's address.

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use super::UdpPort;
use super::datagram::icrc_with_id;
use crate::completion::{WcStatus, WorkCompletion};
use crate::{AccessFlags, Context, Cq, Mr, Mtu, Pd, Qp, QpCaps, Qpn, RecvWr};

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// A Send Only (BTH + `payload`, no pad) to `qpn` at `psn`, with the ICRC of IPv4 ID `id`
/// for `src` -> `dst`.
fn send_only(
    src: SocketAddr,
    dst: SocketAddr,
    id: u16,
    qpn: u32,
    psn: u32,
    payload: &[u8],
) -> Vec<u8> {
    assert_eq!(payload.len() % 4, 0);
    let mut p = vec![0u8; 12];
    p[0] = 0x04; // RC Send Only
    p[2..4].copy_from_slice(&0xFFFFu16.to_be_bytes());
    p[5..8].copy_from_slice(&qpn.to_be_bytes()[1..]);
    p[8] = 0x80; // AckReq
    p[9..12].copy_from_slice(&psn.to_be_bytes()[1..]);
    p.extend_from_slice(payload);
    let crc = icrc_with_id(src, dst, id, &[&p]).unwrap();
    p.extend_from_slice(&crc.to_le_bytes());
    p
}

/// The peer QP's number (the peer is a socket: nothing checks it).
const PEER_QPN: u32 = 0x77;
/// Receives posted, 64 bytes each.
const RECVS: u64 = 16;

/// A QP over a port (inline context), in RTS towards QP [`PEER_QPN`] of `peer`, a plain
/// socket, with [`RECVS`] receives posted (receive `k` lands at `64 k`).
struct Victim {
    ctx: Context,
    port: UdpPort,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
    peer: UdpSocket,
    /// Datagrams sent to the port so far.
    sent: u64,
}

impl Victim {
    fn new(me: &str, peer: &str) -> Victim {
        let ctx = crate::raw_peer::inline_context();
        let port = UdpPort::bind_addr(&ctx, sa(&format!("{me}:0"))).unwrap();
        let peer = UdpSocket::bind(sa(&format!("{peer}:0"))).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let mut qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
        let mr = pd.alloc_mr(64 * RECVS, AccessFlags::LOCAL_WRITE).unwrap();
        let dest = port
            .destination_at(&qp, peer.local_addr().unwrap(), Qpn::new(PEER_QPN))
            .unwrap();
        super::tests::bring_up_qp(&mut qp, dest, Mtu::Mtu1024, 14, |a| a);
        for k in 0..RECVS {
            qp.post_recv(&RecvWr::new(k, &[mr.sge(64 * k, 64).unwrap()]))
                .unwrap();
        }
        Victim {
            ctx,
            port,
            _pd: pd,
            cq,
            qp,
            mr,
            peer,
            sent: 0,
        }
    }

    fn qpn(&self) -> u32 {
        self.qp.qpn().get()
    }

    /// Sends from `from` (the peer, or a spoofer on its address) a Send Only to `qpn` at
    /// `psn` whose ICRC holds with IPv4 ID `id`.
    fn send(&mut self, from: Option<&UdpSocket>, id: u16, qpn: u32, psn: u32, payload: &[u8]) {
        let s = from.unwrap_or(&self.peer);
        let to = self.port.local_addr();
        s.send_to(
            &send_only(s.local_addr().unwrap(), to, id, qpn, psn, payload),
            to,
        )
        .unwrap();
        self.sent += 1;
    }

    /// Runs the engine until the port has received every datagram sent, and a few rounds
    /// more; the work the rounds reported.
    fn settle(&mut self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut work = 0;
        while self.port.counters().datagrams_received < self.sent {
            work += self.ctx.progress();
            assert!(Instant::now() < deadline, "{:?}", self.port.counters());
            std::thread::yield_now();
        }
        for _ in 0..4 {
            work += self.ctx.progress();
        }
        work
    }

    /// The receives completed since the last call: (receive number, its first 8 bytes).
    fn received(&mut self) -> Vec<(u64, [u8; 8])> {
        let mut wc = [WorkCompletion::default(); 16];
        let mut out = Vec::new();
        loop {
            let n = self.cq.poll(&mut wc);
            if n == 0 {
                return out;
            }
            for c in &wc[..n] {
                assert_eq!(c.status, WcStatus::Success, "{c:?}");
                let mut b = [0u8; 8];
                self.mr.read_at(64 * c.wr_id, &mut b).unwrap();
                out.push((c.wr_id, b));
            }
        }
    }
}

/// Hostile review M1: a peer that counts its IPv4 IDs up (a RoCE NIC) is not cut off by a
/// blind spoofer on its address who knows the QPN but no PSN: eight forged datagrams whose
/// IDs step by 4,096 (each the most the link takes after the last) move nothing, and the
/// peer's next packet is delivered. (Before: each moved the ID the link expects, and the
/// peer's datagrams failed their ICRC from then on.)
#[test]
fn a_blind_spoofer_cannot_push_a_counting_peers_ip_ids_off() {
    let _s = super::tests::serial();
    let mut v = Victim::new("127.0.214.1", "127.0.214.2");
    let spoofer = UdpSocket::bind("127.0.214.2:0").unwrap();
    let q = v.qpn();
    let mut id = 0x1000u16;
    for psn in 0..4 {
        id += 1;
        v.send(None, id, q, psn, b"real");
    }
    v.settle();
    assert_eq!(v.received().len(), 4);
    let mut forged = id;
    for _ in 0..8 {
        forged = forged.wrapping_add(4096);
        v.send(Some(&spoofer), forged, q, 0x00dead, b"junk");
    }
    v.settle();
    assert!(v.received().is_empty(), "a forged Send landed");
    v.send(None, id + 1, q, 4, b"next");
    v.settle();
    assert_eq!(
        v.received(),
        [(4, *b"next\0\0\0\0")],
        "the peer's next Send (ID {:#x}) after 8 forged datagrams: {:?}",
        id + 1,
        v.port.counters()
    );
}

/// Hostile review L2: a Linux peer (IPv4 ID 0) has its ICRC checked with all 32 bits: a
/// corrupt datagram whose ICRC happens to hold with some other ID (one in 2^16 of corrupt
/// ones) is dropped, not delivered as the first of a NIC's. (Before: the first such
/// datagram to a QP was taken for whatever ID solved its ICRC.)
#[test]
fn a_corrupt_datagram_of_a_linux_peer_is_caught_whatever_id_it_solves_for() {
    let _s = super::tests::serial();
    let mut v = Victim::new("127.0.215.1", "127.0.215.2");
    let q = v.qpn();
    v.send(None, 0, q, 0, b"good0000");
    v.settle();
    assert_eq!(v.received(), [(0, *b"good0000")]);
    // The next Send, corrupted on the way so that its ICRC holds with ID 0x4321.
    v.send(None, 0x4321, q, 1, b"corrupt!");
    v.settle();
    assert!(v.received().is_empty(), "a corrupt Send was delivered");
    assert_eq!(v.port.counters().icrc_dropped, 1);
    // Its resend.
    v.send(None, 0, q, 1, b"good1111");
    v.settle();
    assert_eq!(v.received(), [(1, *b"good1111")]);
}

/// Hostile review L2: datagrams to other QPNs (a hundred, each with an ID of its own) do
/// not push a counting peer's QP out of what the link knows: a corrupt datagram to it whose
/// ICRC solves for a far ID is still dropped. (Before: the link remembered the last 64
/// QPNs it saw, so 64 others made the QP's next solved ID "the first".)
#[test]
fn datagrams_to_other_qpns_do_not_make_a_qp_forget_its_peers_ids() {
    let _s = super::tests::serial();
    let mut v = Victim::new("127.0.216.1", "127.0.216.2");
    let spoofer = UdpSocket::bind("127.0.216.2:0").unwrap();
    let q = v.qpn();
    v.send(None, 0x1001, q, 0, b"nic00000");
    v.settle();
    assert_eq!(v.received(), [(0, *b"nic00000")]);
    for i in 0..100u32 {
        let other = (q + 1 + i) & 0xff_ffff;
        v.send(Some(&spoofer), 0x2000 + i as u16, other, 0, b"flood!!!");
    }
    v.settle();
    v.send(None, 0x9000, q, 1, b"corrupt!");
    v.settle();
    assert!(v.received().is_empty(), "a corrupt Send was delivered");
    v.send(None, 0x1002, q, 1, b"nic11111");
    v.settle();
    assert_eq!(v.received(), [(1, *b"nic11111")]);
}

/// Hostile review L6: datagrams dropped (a stranger's, malformed, a bad ICRC) are no work
/// for the engine, so a flood of them lets it sleep; a datagram delivered is.
#[test]
fn dropped_datagrams_are_no_work() {
    let _s = super::tests::serial();
    let mut v = Victim::new("127.0.217.1", "127.0.217.2");
    let stranger = UdpSocket::bind("127.0.217.9:0").unwrap();
    let q = v.qpn();
    let to = v.port.local_addr();
    v.settle(); // what bringing the QP up left to do
    for i in 0..20u8 {
        stranger.send_to(&[0x04; 40], to).unwrap();
        v.peer.send_to(&[i; 7], to).unwrap();
        let mut bad = send_only(v.peer.local_addr().unwrap(), to, 0, q, 0, b"bad!");
        bad[14] ^= 0x5a;
        v.peer.send_to(&bad, to).unwrap();
        v.sent += 3;
    }
    assert_eq!(v.settle(), 0, "{:?}", v.port.counters());
    let c = v.port.counters();
    assert_eq!(
        (
            c.unknown_source_dropped,
            c.malformed_dropped,
            c.icrc_dropped
        ),
        (20, 20, 20)
    );
    v.send(None, 0, q, 0, b"good");
    assert!(v.settle() > 0);
    assert_eq!(v.received().len(), 1);
}

/// Hostile review L4 (RoCEv2's design, documented on `UdpPort`): only the source address
/// binds a datagram to a QP, not the source port — any socket on the peer's address that
/// knows the QPN and the PSN lands a Send.
#[test]
fn any_port_on_the_peers_address_reaches_the_qp() {
    let _s = super::tests::serial();
    let mut v = Victim::new("127.0.218.1", "127.0.218.2");
    let stranger = UdpSocket::bind("127.0.218.2:0").unwrap();
    let q = v.qpn();
    v.send(Some(&stranger), 0, q, 0, b"forged!!");
    v.settle();
    assert_eq!(v.received(), [(0, *b"forged!!")]);
}

/// Hostile review 2 (M-1), end to end: a peer that counts its IPv4 IDs with one counter
/// for all its traffic to this host — Linux soft-RoCE (`__ip_select_ident`: one counter
/// per source, destination and protocol), which every other QP of that host moves on, and
/// so does every non-DF UDP datagram any user of that host sends to any port here — is cut
/// off once that counter moves on by more than `AHEAD` between two packets of this QP:
/// its message and every retry of it (the same PSN, the same bytes) are dropped for their
/// ICRC, and the peer runs out of retries. Nothing was forged or corrupt. Here the other
/// traffic never reaches the port (UDP to another port of this host): only the IDs of this
/// QP's own packets show it.
///
/// Before the fix of the review (branch review2) the Send was dropped on all 8 tries.
#[test]
fn review2_a_counting_peers_message_is_delivered_after_its_other_traffic() {
    let _s = super::tests::serial();
    let mut v = Victim::new("127.0.219.1", "127.0.219.2");
    let q = v.qpn();
    let mut id = 0x1000u16;
    v.send(None, id, q, 0, b"real");
    v.settle();
    assert_eq!(v.received().len(), 1, "the peer's first Send");
    let mut delivered = None;
    for attempt in 0..8 {
        // The peer's other datagrams to this host since its last packet to the QP.
        id = id.wrapping_add(super::ip_ids::AHEAD + 1000);
        v.send(None, id, q, 1, b"next");
        v.settle();
        if !v.received().is_empty() {
            delivered = Some(attempt);
            break;
        }
    }
    assert!(
        delivered.is_some(),
        "a genuine Send (and its 7 retries) from a peer whose ID counter moved on by {} \
         between tries never delivered: {:?}",
        super::ip_ids::AHEAD + 1000,
        v.port.counters()
    );
}

/// A port's socket takes GSO sends whole (`UDP_GRO`) and its pump cuts them: a peer's GSO
/// send of datagrams longer than any RoCEv2 packet, or of more tiny ones than make sense,
/// is dropped datagram by datagram (counted, nothing delivered, no panic), and a GSO send
/// of two good Sends (IPv4 IDs 0 and 1, as Linux numbers a GSO send's segments) delivers
/// both, in order.
#[test]
fn a_peers_gso_sends_are_cut_checked_and_counted_datagram_by_datagram() {
    use super::socket::{TxBurst, UdpSocket as Sock};
    let _s = super::tests::serial();
    let mut v = Victim::new("127.0.216.1", "127.0.216.2");
    let q = v.qpn();
    let gso = Sock::bind(sa("127.0.216.2:0")).unwrap();
    let to = v.port.local_addr();
    let mut tx = TxBurst::new();
    let mut burst = |v: &mut Victim, dgrams: &[Vec<u8>]| {
        for d in dgrams {
            let buf = tx.next_buf().unwrap();
            buf[..d.len()].copy_from_slice(d);
            tx.commit(d.len(), to);
        }
        let r = tx.send(&gso);
        assert_eq!((r.sent, r.gso_sends), (dgrams.len(), 1));
        v.sent += dgrams.len() as u64;
    };
    // Two longer than a RoCEv2 packet (a receive buffer holds 64 KiB, the pump's check copy
    // a packet's 4,160 bytes), and 100 bytes of junk whose ICRC fails.
    assert_eq!(
        gso.send_segmented(&[0x04; 10_100], 5000, to).unwrap(),
        10_100
    );
    v.sent += 3;
    v.settle();
    assert!(v.received().is_empty());
    let c = v.port.counters();
    let drops = |c: super::UdpCounters| (c.datagrams_received, c.malformed_dropped, c.icrc_dropped);
    assert_eq!(drops(c), (3, 2, 1), "{c:?}");
    // Thirty-two datagrams of 8 bytes: too short for a transport packet.
    burst(&mut v, &vec![vec![0x04; 8]; 32]);
    v.settle();
    assert!(v.received().is_empty());
    let c = v.port.counters();
    assert_eq!(drops(c), (35, 34, 1), "{c:?}");
    // Two good Sends in one GSO send: the second's ICRC made for ID 1 by the burst.
    let src = gso.local_addr();
    burst(
        &mut v,
        &[
            send_only(src, to, 0, q, 0, b"first..."),
            send_only(src, to, 0, q, 1, b"second.."),
        ],
    );
    v.settle();
    assert_eq!(v.received(), [(0, *b"first..."), (1, *b"second..")]);
    let c = v.port.counters();
    assert_eq!(drops(c), (37, 34, 1), "{c:?}");
}
