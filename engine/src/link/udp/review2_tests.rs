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
/// Fails on the code under review: B's message is refused on all 8 tries.
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
    let mut stream = |ids: &mut IpIds, peer: &mut Peer, epsn_a: &mut u32| {
        for _ in 0..gap {
            let want = *epsn_a;
            assert!(ids.believe(request(peer, a, want), |q, _, p| q == a
                && p.get() == want));
            *epsn_a += 1;
        }
    };
    // B's next message, and the peer's 7 retries of it, a stream's worth of IDs apart.
    let mut taken_on = None;
    for attempt in 0..8 {
        stream(&mut ids, &mut peer, &mut epsn_a);
        let want = epsn_b;
        if ids.believe(request(&mut peer, b, want), |q, _, p| q == b && p.get() == want) {
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
