//! Hostile review 2: what the per-QP IPv4 ID tracks (`ip_ids`) do with a genuine peer
//! whose IDs come from one counter for all its traffic to this host — Linux soft-RoCE
//! (`rxe`: `__ip_select_ident`, one `ip_idents` bucket per (source, destination, UDP)),
//! which every QP of that host, and every non-DF UDP datagram its users send to this host,
//! moves on.

use super::ip_ids::{AHEAD, IpIds, Seen};
use crate::psn::Psn;
use crate::wire::Qpn;

/// One peer host: one ID counter, as rxe's bucket.
struct Peer {
    id: u16,
}

impl Peer {
    fn next(&mut self) -> u16 {
        self.id = self.id.wrapping_add(1);
        self.id
    }
}

/// A request from the peer to local QP `qpn` at `psn`, with the peer's next ID.
fn request(peer: &mut Peer, qpn: Qpn, psn: u32) -> Seen {
    Seen {
        qpn,
        id: peer.next(),
        request: true,
        psn: Psn::new(psn),
        // The same packet sent again has the same bytes.
        digest: psn,
    }
}

/// Local QP B receives a Send now and then (a ping-pong, a control channel) while local
/// QP A, over the same link, receives a stream from the same peer host (or any user of
/// that host sends non-DF UDP to this host): between two packets of B — a message and its
/// retry after the peer's retransmission timeout — the peer's counter moves on by more
/// than `AHEAD`. Every genuine packet of B, every retry, is refused as not following on,
/// and no jump is ever confirmed (a jump wants B's next packet within `AHEAD` of the
/// last): the peer exhausts its retry count (7) and B's connection dies, though no
/// packet was forged or corrupt.
///
/// Before the fix of the review (branch review2) B's message was refused on all 8 tries.
#[test]
fn a_quiet_qp_is_not_cut_off_by_another_qps_stream_from_the_same_host() {
    let (a, b) = (Qpn::new(0x11), Qpn::new(0x12));
    let mut ids = IpIds::default();
    ids.watch(a);
    ids.watch(b);
    let mut peer = Peer { id: 0x4000 };
    // What each local QP's responder expects next (the engine's word: `psn_is_new`).
    let (mut epsn_a, mut epsn_b) = (100u32, 500u32);
    // Both learn the peer's IDs from their first messages.
    for (q, e) in [(a, &mut epsn_a), (b, &mut epsn_b)] {
        let want = *e;
        assert!(ids.believe(request(&mut peer, q, want), |_, _, p| p.get() == want));
        *e += 1;
    }
    // Between two packets of B: the stream to A, its packets each new and taken.
    let gap = u32::from(AHEAD) + 1000;
    let stream = |ids: &mut IpIds, peer: &mut Peer, epsn_a: &mut u32| {
        for _ in 0..gap {
            let want = *epsn_a;
            assert!(ids.believe(request(peer, a, want), |q, _, p| q == a && p.get() == want));
            *epsn_a += 1;
        }
    };
    // B's next message, and the peer's 7 retries of it, a stream's worth of IDs apart.
    let mut taken_on = None;
    for attempt in 0..8 {
        stream(&mut ids, &mut peer, &mut epsn_a);
        let want = epsn_b;
        if ids.believe(request(&mut peer, b, want), |q, _, p| {
            q == b && p.get() == want
        }) {
            taken_on = Some(attempt);
            break;
        }
    }
    assert!(
        taken_on.is_some(),
        "a genuine soft-RoCE peer's message to a quiet QP refused on every try (the peer's \
         retry count is exhausted): its IDs moved on by {gap} between tries, counted by the \
         peer's other traffic to this host"
    );
}

/// Hostile review 2, a check of something found sound (`RxRing::recv` keeps the
/// `recvmmsg` entries of an empty poll for the next): after a thousand empty polls asking
/// for varying counts, datagrams of several lengths (one truncated), sources and TOS /
/// traffic classes (ECN CE among them) are each reported with their own length, source and
/// TOS, and again after more empty polls — over IPv4 and IPv6 loopback.
#[test]
fn datagrams_after_many_empty_polls_keep_their_lengths_sources_and_tos() {
    use super::socket::{BURST, DGRAM_BYTES, IpOpts, RxRing, TxBurst, UdpSocket};
    use std::net::SocketAddr;
    use std::time::{Duration, Instant};

    fn drain(rx: &mut RxRing, b: &UdpSocket, want: usize) -> Vec<(usize, SocketAddr, u8)> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut got = Vec::new();
        while got.len() < want {
            assert!(Instant::now() < deadline, "received {got:?}");
            let first = rx.next();
            // One at a time: entries prepared for more are reused for fewer.
            let n = rx.recv(b, 1 + got.len() % 3).unwrap();
            for d in first..first + n as u64 {
                let (_, len, from) = rx.datagram(d);
                got.push((len, from.unwrap(), rx.tos(d)));
            }
            if n == 0 {
                b.wait_readable(10);
            }
        }
        got
    }

    for (x, y) in [("127.0.0.1", "127.0.0.2"), ("::1", "::1")] {
        let sa = |ip: &str| -> SocketAddr {
            if ip.contains(':') {
                format!("[{ip}]:0").parse().unwrap()
            } else {
                format!("{ip}:0").parse().unwrap()
            }
        };
        let b = UdpSocket::bind(sa(x)).unwrap();
        let a = UdpSocket::bind(sa(x)).unwrap();
        let c = UdpSocket::bind(sa(y)).unwrap();
        let mut rx = RxRing::new(BURST);
        for k in 0..1000 {
            assert_eq!(rx.recv(&b, 1 + k % BURST).unwrap(), 0);
        }
        let mut tx = TxBurst::new();
        for (len, tc) in [(100usize, 0x02u8), (333, 0x03), (40, 0x00)] {
            tx.next_buf().unwrap();
            let opts = IpOpts {
                hop_limit: 0,
                traffic_class: tc,
            };
            tx.commit_with(len, b.local_addr(), opts, 0);
        }
        assert_eq!(tx.send(&a).sent, 3);
        let from_a = a.local_addr();
        assert_eq!(
            drain(&mut rx, &b, 3),
            [(100, from_a, 0x02), (333, from_a, 0x03), (40, from_a, 0x00)],
            "{x}"
        );
        for k in 0..1000 {
            assert_eq!(rx.recv(&b, BURST - k % BURST).unwrap(), 0);
        }
        // An oversized datagram (truncated: length 0) from a std socket, then one from
        // another address.
        let s = std::net::UdpSocket::bind(sa(x)).unwrap();
        s.send_to(&vec![1u8; DGRAM_BYTES + 10], b.local_addr())
            .unwrap();
        let mut tx = TxBurst::new();
        tx.next_buf().unwrap();
        tx.commit_with(
            64,
            b.local_addr(),
            IpOpts {
                hop_limit: 0,
                traffic_class: 0x01,
            },
            0,
        );
        assert_eq!(tx.send(&c).sent, 1);
        assert_eq!(
            drain(&mut rx, &b, 2),
            [(0, s.local_addr().unwrap(), 0), (64, c.local_addr(), 0x01)],
            "{x}"
        );
    }
}

/// Hostile review 2 (L-1), corrected to what holds: a blind spoofer that sends each PSN
/// guess twice — the same bytes, IDs X and X + 1 — moves a track when, and only when, the
/// guess is a PSN the QP takes as new: the same guess that has its forged request taken by
/// the engine (RoCEv2's barrier), at twice the datagrams. A guess that misses moves
/// nothing, however often it is sent, and so does a guess sent twice with the same ID.
/// (The `ip_ids` docs and the README used to say a single lucky guess could not.)
#[test]
fn a_spoofers_guess_sent_twice_moves_a_track_only_with_a_psn_the_qp_takes() {
    let q = Qpn::new(0x12);
    let mut ids = IpIds::default();
    ids.watch(q);
    let epsn = 40u32;
    let new = |_: Qpn, _: bool, p: Psn| p.get() == epsn;
    let genuine = |id: u16, psn: u32| Seen {
        qpn: q,
        id,
        request: true,
        psn: Psn::new(psn),
        digest: psn,
    };
    assert!(
        ids.believe(genuine(0x1000, 40), new),
        "the peer's first packet teaches its ID"
    );
    // The genuine request at 40 was taken: the engine expects 41 now.
    let epsn = 41u32;
    let new = |_: Qpn, _: bool, p: Psn| p.get() == epsn;
    let forged = |id: u16, psn: u32| Seen {
        qpn: q,
        id,
        request: true,
        psn: Psn::new(psn),
        digest: 0xbad,
    };
    // Misses (PSNs the QP would not take), each twice, and a hit twice with one ID: the
    // far IDs are refused and nothing moves; the genuine peer's next packet is taken.
    for psn in [0u32, 39, 42, 0x7f_ffff] {
        assert!(!ids.believe(forged(0x9000, psn), new), "{psn}");
        assert!(!ids.believe(forged(0x9001, psn), new), "{psn}");
    }
    assert!(!ids.believe(forged(0x9000, 41), new));
    assert!(!ids.believe(forged(0x9000, 41), new), "the same ID twice");
    assert!(
        ids.believe(genuine(0x1001, 41), new),
        "the genuine peer follows on"
    );
    // The genuine request at 41 was taken; the spoofer's lucky guess of 42, twice.
    let epsn = 42u32;
    let new = |_: Qpn, _: bool, p: Psn| p.get() == epsn;
    assert!(
        !ids.believe(forged(0x9000, 42), new),
        "a far ID alone is refused"
    );
    assert!(
        ids.believe(forged(0x9001, 42), new),
        "the lucky guess again moves the track (and its request is the engine's to take)"
    );
}
