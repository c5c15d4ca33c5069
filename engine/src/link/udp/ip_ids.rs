//! The IPv4 identifications a link's peer sends, learned per local QP, so that solving for
//! the ID a datagram's ICRC covers (a UDP socket cannot see it) neither weakens the ICRC
//! nor hands a spoofer a way to cut a peer off.
//!
//! # The problem
//!
//! The ICRC covers the IPv4 ID. Linux sends ID 0 for a Don't Fragment datagram from an
//! unconnected socket (shmhca, and Linux programs on plain sockets) and 0, 1, 2, … for the
//! segments of one GSO send; a RoCE NIC, and Linux soft-RoCE, count their IDs up. Any
//! corruption of a datagram is "explained" by *some* ID with probability 2^-16 (the CRC is
//! affine in the ID's 16 bits: [`shmhca_proto::roce::solve_ipv4_id`]), so a receiver that
//! takes whatever ID solves the ICRC checks it with 16 bits, not 32. And the ICRC is no
//! secret: a spoofer who knows a peer's address and a QPN makes datagrams that solve for
//! any ID it likes.
//!
//! # The rules
//!
//! Per local QP that talks over the link (a route: [`IpIds::watch`], made by
//! `UdpPort::destination`, never by a datagram — nothing a stranger sends takes a slot or
//! pushes one out), what its peer QP's IDs are: not known yet, *zero* (0, and a GSO run's
//! 1 … 63), or *counting* (the last one).
//!
//! * ID 0 holds the ICRC with all 32 bits: always taken. So is an ID below
//!   [`GSO_SEGMENTS`] (a GSO segment's place in its send; 63 values: a corrupt datagram
//!   passes one time in 2^26).
//! * A higher ID is solved for only for a peer QP known to count, and taken when it
//!   follows on from the last ([`AHEAD`] after, [`BEHIND`] before): a corrupt datagram
//!   passes one time in about 2^20. For a peer QP known to send 0 nothing is solved for:
//!   its ICRC is checked with ID 0, all 32 bits (besides the GSO segments').
//! * **What is known moves only with a packet whose PSN the QP would take as new**: a
//!   request at its responder's ePSN (or right after the last such request, for a burst the
//!   engine has not seen yet), a response inside the PSNs its requester has outstanding.
//!   The engine's state answers (`is_new`, the QP's own ePSN and send window, read where
//!   the pump checks the datagram: a function call, no lock, nothing allocated). A datagram
//!   with another PSN is passed to the engine if its ID follows on (the engine drops it or
//!   answers a duplicate, as over any link) but moves nothing.
//!
//! # Why a blind spoofer cannot use it
//!
//! A spoofer who does not see the traffic knows the peer's address and the QPN, not the
//! PSNs. Its datagrams that follow on from the last ID reach the engine (which takes none
//! without the right PSN), and move no track; those that do not follow on are dropped. To
//! move a track it needs a PSN the QP would take as new: a 2^-24 guess for a request, the
//! outstanding window's width in 2^24 for a response — exactly what it needs to have a
//! forged request or Ack *accepted by the engine*, the barrier RoCEv2 has anyway. A jump
//! of the track (a counting peer idle for long, whose ID moved on by more than [`AHEAD`];
//! a peer known as zero that turns out to count) needs two such packets, the second's ID
//! following on from the first's, and the second a later packet (a later PSN) or the same
//! one sent again (the same bytes): no spoofer's single lucky guess, no single corrupt
//! datagram, and no pair of corrupt copies of one packet.
//!
//! # The first packet of a counting peer
//!
//! A NIC's first packet to a QP carries an ID nobody knows. It is taken, and its ID
//! learned, if its PSN is new to the QP (a corrupt first datagram passes one time in
//! 2^16, once per connection), unless the link's peer is known to send ID 0 (some QP of it
//! does, none counts): then it waits for a second packet that follows on (a retry), as a
//! jump does, and a corrupt datagram from a Linux peer never passes for a NIC's first.
#![forbid(unsafe_code)]

use crate::psn::Psn;
use crate::wire::Qpn;

/// IDs below this are GSO segments' (their place in one send; shmhca sends runs of at most
/// 64): taken from any peer QP as they are, and they move no track.
pub(crate) const GSO_SEGMENTS: u16 = 64;
/// How far after the last ID a new one may be (packets to other QPs of the peer, or lost
/// ones, in between).
pub(crate) const AHEAD: u16 = 4096;
/// How far before the last ID one may be (reordering).
pub(crate) const BEHIND: u16 = 64;

/// What a peer QP's IDs are known to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Nothing with a new PSN has come yet.
    Unknown,
    /// It sends ID 0 (and GSO segments' IDs): nothing is solved for.
    Zero,
    /// It counts its IDs up: the last one a packet with a new PSN carried.
    Counting(u16),
}

/// What one local QP's peer QP sends.
#[derive(Debug, Clone, Copy)]
struct Track {
    /// The local QP (the BTH destination QP of the packets).
    qpn: Qpn,
    kind: Kind,
    /// A packet with a new PSN whose ID did not follow on: its ID, PSN and digest. The
    /// track jumps with the next packet with a new PSN whose ID follows on from it, if that
    /// is a later packet (its PSN after) or the same one sent again (its digest the same).
    jump: Option<(u16, Psn, u32)>,
    /// The PSN after the last request with a new PSN (the next of a burst the engine has
    /// not taken yet is new too).
    next_request: Option<Psn>,
}

/// Whether `id` follows on from `last`: at most [`AHEAD`] after it, or [`BEHIND`] before.
fn near(last: u16, id: u16) -> bool {
    id.wrapping_sub(last) <= AHEAD || last.wrapping_sub(id) <= BEHIND
}

/// Whether `id` comes after `from` by 1 to [`AHEAD`].
fn after(from: u16, id: u16) -> bool {
    id.wrapping_sub(from).wrapping_sub(1) < AHEAD
}

/// What [`IpIds::believe`] looks at in a received packet.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Seen {
    /// Its destination QP (a local QP).
    pub(crate) qpn: Qpn,
    /// The IPv4 ID its ICRC holds with.
    pub(crate) id: u16,
    /// Whether it is a request (else a response).
    pub(crate) request: bool,
    /// Its PSN.
    pub(crate) psn: Psn,
    /// A digest of its bytes, the same for the same packet sent again (its ICRC with ID 0).
    pub(crate) digest: u32,
}

/// The IPv4 IDs a link's peer QPs send, one track per local QP that talks over the link
/// (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct IpIds {
    tracks: Vec<Track>,
    /// Tracks still [`Kind::Unknown`] (while none is, an ID 0 or a GSO segment's needs no
    /// look at the tracks).
    unknown: usize,
}

impl IpIds {
    /// Local QP `qpn` talks over the link (to a new peer QP): its track starts afresh.
    pub(crate) fn watch(&mut self, qpn: Qpn) {
        self.forget(qpn);
        self.tracks.push(Track {
            qpn,
            kind: Kind::Unknown,
            jump: None,
            next_request: None,
        });
        self.unknown += 1;
    }

    /// Local QP `qpn` talks over the link no more.
    pub(crate) fn forget(&mut self, qpn: Qpn) {
        self.retain(|q| q != qpn);
    }

    /// Keeps the tracks of the local QPs `keep` says.
    pub(crate) fn retain(&mut self, keep: impl Fn(Qpn) -> bool) {
        self.tracks.retain(|t| keep(t.qpn));
        self.unknown = self
            .tracks
            .iter()
            .filter(|t| t.kind == Kind::Unknown)
            .count();
    }

    /// The local QPs tracked (tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.tracks.len()
    }

    /// Whether packet `p`, whose ICRC holds with IPv4 ID `p.id`, is believable, learning
    /// from it (see the module docs); `is_new` says whether its QP would take its PSN as
    /// new (asked only when it matters).
    pub(crate) fn believe(&mut self, p: Seen, is_new: impl Fn(Qpn, bool, Psn) -> bool) -> bool {
        let Seen {
            qpn,
            id,
            request,
            psn,
            digest,
        } = p;
        let small = id < GSO_SEGMENTS;
        if small && self.unknown == 0 {
            return true;
        }
        let Some(i) = self.tracks.iter().position(|t| t.qpn == qpn) else {
            // No local QP of this link is that QPN: the engine drops the packet. An ID
            // 0 or a GSO segment's is taken as from any peer (the engine has the last
            // word); an ID to solve for has nothing to follow on from.
            return small;
        };
        let mut t = self.tracks[i];
        let new = is_new(qpn, request, psn) || (request && t.next_request == Some(psn));
        if new && request {
            t.next_request = Some(psn.add(1));
        }
        let (believed, kind) = match t.kind {
            Kind::Unknown if small && new => (true, Kind::Zero),
            k if small => (true, k),
            Kind::Counting(last) if near(last, id) => {
                (true, if new { Kind::Counting(id) } else { t.kind })
            }
            Kind::Unknown if new && !self.zero_peer() => (true, Kind::Counting(id)),
            k if new => match t.jump {
                Some((from, at, was))
                    if after(from, id) && (psn.after(at) || (psn == at && digest == was)) =>
                {
                    (true, Kind::Counting(id))
                }
                _ => {
                    t.jump = Some((id, psn, digest));
                    (false, k)
                }
            },
            k => (false, k),
        };
        if kind != t.kind {
            if t.kind == Kind::Unknown {
                self.unknown -= 1;
            }
            t.kind = kind;
            t.jump = None;
        }
        self.tracks[i] = t;
        believed
    }

    /// Whether the link's peer is known to send ID 0: some QP of it does, none counts.
    fn zero_peer(&self) -> bool {
        let mut zero = false;
        for t in &self.tracks {
            match t.kind {
                Kind::Counting(_) => return false,
                Kind::Zero => zero = true,
                Kind::Unknown => {}
            }
        }
        zero
    }
}

/// Whether `qp` would take a packet with `psn` as new: a request at its responder's ePSN
/// (in a state that takes requests), a response to a request it has outstanding (in a
/// state that sends). What the pump asks of the engine's state through `is_new`.
pub(crate) fn psn_is_new(qp: &shmhca_proto::qp::Qp, request: bool, psn: Psn) -> bool {
    use crate::QpState::{Rtr, Rts, Sqd, Sqe};
    match (request, qp.state) {
        (true, Rtr | Rts | Sqd | Sqe) => psn == qp.resp.epsn,
        (false, Rts | Sqd | Sqe) => {
            let w = qp.req.window();
            psn.after(w.acked()) && psn.before(w.sent_to())
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const Q: Qpn = Qpn::new(0x12);

    fn any_new(_: Qpn, _: bool, _: Psn) -> bool {
        true
    }

    fn never_new(_: Qpn, _: bool, _: Psn) -> bool {
        false
    }

    fn p(n: u32) -> Psn {
        Psn::new(n)
    }

    /// A packet to `qpn` with `id`, `psn`, whose digest is its PSN's (the same packet
    /// sent again has the same).
    fn seen(qpn: Qpn, id: u16, request: bool, psn: Psn) -> Seen {
        Seen {
            qpn,
            id,
            request,
            psn,
            digest: psn.get(),
        }
    }

    /// A counting peer QP: its first packet with a new PSN is taken and learned, the next
    /// ones follow on; one that does not follow on is refused; a burst's requests after the
    /// one at ePSN are new too.
    #[test]
    fn a_counting_peer_is_learned_from_its_first_new_packet_and_followed() {
        let mut ids = IpIds::default();
        ids.watch(Q);
        let epsn = |_: Qpn, _: bool, s: Psn| s == p(10);
        assert!(
            !ids.believe(seen(Q, 0x1234, true, p(9)), epsn),
            "not new: not learned"
        );
        assert!(
            ids.believe(seen(Q, 0x1234, true, p(10)), epsn),
            "the first learns"
        );
        assert!(
            ids.believe(seen(Q, 0x1235, true, p(11)), epsn),
            "next of the burst"
        );
        assert!(ids.believe(seen(Q, 0x1236, true, p(12)), epsn));
        assert!(
            ids.believe(seen(Q, 0x1300, false, p(3)), never_new),
            "within AHEAD"
        );
        assert!(
            ids.believe(seen(Q, 0x1200, false, p(3)), never_new),
            "within BEHIND"
        );
        assert!(!ids.believe(seen(Q, 0x9000, true, p(13)), epsn), "far off");
        assert!(ids.believe(seen(Q, 0, true, p(13)), epsn), "ID 0 always");
        assert!(
            ids.believe(seen(Q, 5, true, p(13)), epsn),
            "a GSO segment's"
        );
        assert_eq!(ids.tracks[0].kind, Kind::Counting(0x1236));
    }

    /// Hostile review M1: forged datagrams (any PSN: they would be dropped later as out of
    /// the window) whose IDs step by AHEAD move no track, however many; the genuine peer's
    /// next packet is taken.
    #[test]
    fn packets_with_a_psn_the_qp_would_not_take_move_no_track() {
        let mut ids = IpIds::default();
        ids.watch(Q);
        let mut epsn = 0u32;
        let mut genuine = 0x1000u16;
        for _ in 0..4 {
            genuine += 1;
            let e = epsn;
            assert!(ids.believe(seen(Q, genuine, true, p(e)), |_, _, s| s == p(e)));
            epsn += 1;
        }
        let mut forged = genuine;
        for _ in 0..32 {
            forged = forged.wrapping_add(AHEAD);
            let e = epsn;
            ids.believe(seen(Q, forged, true, p(0xdead)), |_, _, s| s == p(e));
            ids.believe(seen(Q, forged, false, p(0xbeef)), |_, _, s| s == p(e));
        }
        assert_eq!(ids.tracks[0].kind, Kind::Counting(genuine));
        let e = epsn;
        assert!(ids.believe(seen(Q, genuine + 1, true, p(e)), |_, _, s| s == p(e)));
    }

    /// Hostile review L2: a peer QP known to send ID 0 gets no ID solved for (beyond a GSO
    /// segment's); local QPs are tracked only as routes make them, so datagrams to other
    /// QPNs take no slot and push no track out.
    #[test]
    fn a_zero_peer_gets_nothing_solved_for_and_strangers_take_no_slot() {
        let mut ids = IpIds::default();
        ids.watch(Q);
        assert!(ids.believe(seen(Q, 0, true, p(1)), any_new));
        assert_eq!(ids.tracks[0].kind, Kind::Zero);
        for id in [64u16, 0x1234, 0xffff] {
            assert!(!ids.believe(seen(Q, id, true, p(2)), never_new), "{id:#x}");
        }
        for q in 0..1000u32 {
            assert!(!ids.believe(seen(Qpn::new(0x100 + q), 0x4000, true, p(0)), any_new));
            assert!(ids.believe(seen(Qpn::new(0x100 + q), 0, true, p(0)), any_new));
        }
        assert_eq!(ids.len(), 1);
        assert_eq!(ids.tracks[0].kind, Kind::Zero);
        // Another QP of this Linux peer: its first solved ID waits for a second.
        let r = Qpn::new(0x13);
        ids.watch(r);
        assert!(!ids.believe(seen(r, 0x5000, true, p(0)), any_new));
    }

    /// A jump — a peer known as zero that counts after all, a counting peer whose ID moved
    /// far on while idle — takes two packets with new PSNs whose IDs follow on: one alone
    /// (a corrupt datagram, a spoofer's lucky PSN) moves nothing.
    #[test]
    fn a_jump_takes_two_new_packets_that_follow_on() {
        let mut ids = IpIds::default();
        ids.watch(Q);
        assert!(ids.believe(seen(Q, 0x100, true, p(0)), any_new));
        assert!(
            !ids.believe(seen(Q, 0x9000, true, p(1)), any_new),
            "one far"
        );
        assert!(
            !ids.believe(seen(Q, 0x9000, true, p(1)), any_new),
            "the same again"
        );
        assert!(
            ids.believe(seen(Q, 0x9001, true, p(1)), any_new),
            "its next follows on"
        );
        assert_eq!(ids.tracks[0].kind, Kind::Counting(0x9001));
        // Corrupt copies of one packet (its PSN, other bytes) never confirm each other.
        let copy = |id: u16, digest: u32| Seen {
            digest,
            ..seen(Q, id, true, p(2))
        };
        for k in 0..100u16 {
            assert!(
                !ids.believe(copy(0x2000 + k, u32::from(k)), any_new),
                "copy {k}"
            );
        }
        assert_eq!(ids.tracks[0].kind, Kind::Counting(0x9001));
        // From zero.
        let r = Qpn::new(0x13);
        ids.watch(r);
        assert!(ids.believe(seen(r, 0, true, p(0)), any_new));
        assert!(!ids.believe(seen(r, 0x7000, true, p(1)), any_new));
        assert!(
            !ids.believe(seen(r, 0x7001, true, p(1)), never_new),
            "not new: no jump"
        );
        assert!(ids.believe(seen(r, 0x7002, true, p(1)), any_new));
    }

    /// A route made again (a QP reset and connected anew) starts afresh; a route forgotten
    /// leaves no track.
    #[test]
    fn watch_starts_afresh_and_forget_removes() {
        let mut ids = IpIds::default();
        ids.watch(Q);
        assert!(ids.believe(seen(Q, 0x100, true, p(0)), any_new));
        ids.watch(Q);
        assert_eq!(ids.len(), 1);
        assert!(
            ids.believe(seen(Q, 0x8000, true, p(0)), any_new),
            "learned afresh"
        );
        ids.forget(Q);
        assert_eq!(ids.len(), 0);
        assert!(!ids.believe(seen(Q, 0x8001, true, p(1)), any_new));
        assert_eq!(ids.unknown, 0);
    }
}
