//! What one side brings to a connection ([`ConnectParams`], [`PeerPolicy`]) and the
//! negotiation of the two sides' offers ([`negotiate`]): a pure function, the one place
//! where the connection's parameters are decided, used by both client and server.

use std::time::Duration;

use super::msg::{MAX_PRIVATE_DATA, Offer, RejectReason};
use super::random_u64;
use crate::error::{Error, Result};
use crate::qp::{AccessFlags, MAX_RD_ATOMIC, Mtu, QpCaps};
use crate::wire::Qpn;

/// Whom a side admits, judged by the peer's credentials on the socket (`SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PeerPolicy {
    /// Only processes running as this process's effective user (the default).
    #[default]
    SameUser,
    /// Any user that can open the socket (its file permissions still apply).
    AnyUser,
    /// Only processes of this user id.
    Uid(u32),
}

impl PeerPolicy {
    /// Whether a peer of user `uid` is admitted; if not, why.
    pub(super) fn admit(self, uid: u32) -> std::result::Result<(), String> {
        let allowed = match self {
            PeerPolicy::AnyUser => return Ok(()),
            PeerPolicy::SameUser => rustix::process::geteuid().as_raw(),
            PeerPolicy::Uid(u) => u,
        };
        if uid == allowed {
            Ok(())
        } else {
            Err(format!(
                "the peer runs as uid {uid} but the peer policy ({self:?}) admits only uid {allowed}: run both as the same user or set the policy (PeerPolicy::Uid / PeerPolicy::AnyUser)"
            ))
        }
    }
}

/// The parameters one side brings to a connection. `Default` is sensible: default
/// [`QpCaps`], PMTU 4096, remote write, read and atomic access enabled on the QP, Local Ack
/// Timeout 14 (67 ms), Retry Count 7, RNR Retry Count 7 (forever), minimum RNR timer 12
/// (0.64 ms), 4 responder resources and initiator depth 4, a random start PSN, no private
/// data, a 5-second handshake timeout, peers of the same user only, and no silence limit.
///
/// ```
/// use shmhca::{cm::ConnectParams, Mtu, QpCaps};
/// let p = ConnectParams::default()
///     .mtu(Mtu::Mtu1024)
///     .caps(QpCaps { max_send_wr: 256, ..QpCaps::default() })
///     .private_data(&b"hello"[..]);
/// assert!(p.validate().is_ok());
/// assert!(ConnectParams::default().private_data(vec![0; 257]).validate().is_err());
/// ```
#[derive(Debug, Clone)]
pub struct ConnectParams {
    pub(super) caps: QpCaps,
    pub(super) mtu: Mtu,
    pub(super) access: AccessFlags,
    pub(super) local_ack_timeout: u8,
    pub(super) target_ack_delay: u8,
    pub(super) retry_count: u8,
    pub(super) rnr_retry_count: u8,
    pub(super) min_rnr_timer: u8,
    pub(super) responder_resources: u8,
    pub(super) initiator_depth: u8,
    pub(super) start_psn: Option<u32>,
    pub(super) private_data: Vec<u8>,
    pub(super) handshake_timeout: Duration,
    pub(super) peer_policy: PeerPolicy,
    pub(super) silence_limit: Option<Duration>,
    pub(super) max_peer_arena: u64,
}

/// The default largest peer arena a connection maps: 4 GiB.
pub const DEFAULT_MAX_PEER_ARENA: u64 = 4 << 30;

impl Default for ConnectParams {
    fn default() -> ConnectParams {
        ConnectParams {
            caps: QpCaps::default(),
            mtu: Mtu::Mtu4096,
            access: AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_ATOMIC,
            local_ack_timeout: 14,
            target_ack_delay: 0,
            retry_count: 7,
            rnr_retry_count: 7,
            min_rnr_timer: 12,
            responder_resources: 4,
            initiator_depth: 4,
            start_psn: None,
            private_data: Vec::new(),
            handshake_timeout: Duration::from_secs(5),
            peer_policy: PeerPolicy::SameUser,
            silence_limit: None,
            max_peer_arena: DEFAULT_MAX_PEER_ARENA,
        }
    }
}

impl ConnectParams {
    /// The largest arena this side maps of the peer's (default
    /// [`DEFAULT_MAX_PEER_ARENA`]): a peer that offers a larger one is refused with an error
    /// naming both sizes. A peer's arena is mapped read-only and never populated: it
    /// costs address space, not memory.
    pub fn max_peer_arena(mut self, bytes: u64) -> ConnectParams {
        self.max_peer_arena = bytes;
        self
    }

    /// The QP's queue capabilities.
    pub fn caps(mut self, caps: QpCaps) -> ConnectParams {
        self.caps = caps;
        self
    }

    /// The largest PMTU this side accepts; the connection uses the smaller of both sides'.
    pub fn mtu(mut self, mtu: Mtu) -> ConnectParams {
        self.mtu = mtu;
        self
    }

    /// The QP's remote access enables (what the peer may do to this side's memory
    /// regions, on top of each region's own access flags).
    pub fn access(mut self, access: AccessFlags) -> ConnectParams {
        self.access = access;
        self
    }

    /// Local Ack Timeout (0..=31): this side's transport timer is 4.096 µs × 2^value (0
    /// disables it). Raised if needed to exceed the peer's Target Ack Delay.
    pub fn local_ack_timeout(mut self, v: u8) -> ConnectParams {
        self.local_ack_timeout = v;
        self
    }

    /// Target Ack Delay (0..=31, same scale): the longest this side's engine may take to
    /// acknowledge a request — larger for an inline-mode engine whose application polls
    /// rarely. The peer's Local Ack Timeout is raised to cover it.
    pub fn target_ack_delay(mut self, v: u8) -> ConnectParams {
        self.target_ack_delay = v;
        self
    }

    /// Retry Count (0..=7) of this side's SQ Logic for timeouts and sequence errors.
    pub fn retry_count(mut self, v: u8) -> ConnectParams {
        self.retry_count = v;
        self
    }

    /// RNR Retry Count (0..=7, 7 = forever) the *peer* uses when this side answers with an
    /// RNR NAK (spec/03: supplied by the remote CA's CM).
    pub fn rnr_retry_count(mut self, v: u8) -> ConnectParams {
        self.rnr_retry_count = v;
        self
    }

    /// The RNR NAK timer code (0..=31) this side's RQ Logic sends.
    pub fn min_rnr_timer(mut self, v: u8) -> ConnectParams {
        self.min_rnr_timer = v;
        self
    }

    /// Responder resources (0..=16): RDMA Reads and Atomics from the peer this side
    /// serves at once. The peer's initiator depth is capped to it.
    pub fn responder_resources(mut self, v: u8) -> ConnectParams {
        self.responder_resources = v;
        self
    }

    /// Initiator depth (0..=16): RDMA Reads and Atomics this side has outstanding at once
    /// (capped to the peer's responder resources; 0 forbids posting them).
    pub fn initiator_depth(mut self, v: u8) -> ConnectParams {
        self.initiator_depth = v;
        self
    }

    /// The SQ start PSN (24 bits; default random).
    pub fn start_psn(mut self, psn: u32) -> ConnectParams {
        self.start_psn = Some(psn);
        self
    }

    /// Up to 256 bytes for the peer's application (e.g. a region's
    /// [`RemoteAddr::to_bytes`](crate::RemoteAddr::to_bytes)); it gets them from
    /// [`Connection::peer_private_data`](super::Connection::peer_private_data).
    pub fn private_data(mut self, data: impl Into<Vec<u8>>) -> ConnectParams {
        self.private_data = data.into();
        self
    }

    /// How long the whole handshake may take (default 5 s): a peer that stops half-way is
    /// an error after this long, not a hang.
    pub fn handshake_timeout(mut self, t: Duration) -> ConnectParams {
        self.handshake_timeout = t;
        self
    }

    /// Whom [`Context::connect`](crate::Context::connect) accepts as a server (default: the same user). A
    /// [`Listener`](super::Listener) has its own policy ([`Listener::set_peer_policy`](super::Listener::set_peer_policy)): the side that
    /// listens decides whom it admits.
    pub fn peer_policy(mut self, p: PeerPolicy) -> ConnectParams {
        self.peer_policy = p;
        self
    }

    /// Ends the connection when the peer has been silent this long (default `None`: never).
    ///
    /// Each side's watcher thread sends a keepalive on the connection socket every
    /// [`KEEPALIVE_INTERVAL`](super::KEEPALIVE_INTERVAL), whatever the traffic; a peer whose
    /// process is stopped (SIGSTOP, a debugger) or hung sends none, yet its socket stays
    /// open. With a limit, such a connection ends as if the peer had hung up: its QP goes
    /// to the Error state, its work requests complete with flush errors, and
    /// [`Connection::peer_gone_reason`](super::Connection::peer_gone_reason) says so.
    /// Without one, [`Connection::peer_silent_for`](super::Connection::peer_silent_for) lets
    /// the application decide. The limit applies to this side only; it must be at least
    /// three keepalive intervals, and should be far more on a busy machine (a starved
    /// peer's watcher is late too).
    pub fn peer_silence_limit(mut self, limit: Option<Duration>) -> ConnectParams {
        self.silence_limit = limit;
        self
    }

    /// Checks every parameter's range.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first parameter out of range.
    pub fn validate(&self) -> Result<()> {
        self.caps.validate()?;
        let small = |name: &'static str, v: u8, max: u8| {
            if v > max {
                Err(Error::invalid(
                    name,
                    format!("{v}; ConnectParams::{name} takes 0..={max}"),
                ))
            } else {
                Ok(())
            }
        };
        small("local_ack_timeout", self.local_ack_timeout, 31)?;
        small("target_ack_delay", self.target_ack_delay, 31)?;
        small("retry_count", self.retry_count, 7)?;
        small("rnr_retry_count", self.rnr_retry_count, 7)?;
        small("min_rnr_timer", self.min_rnr_timer, 31)?;
        small(
            "responder_resources",
            self.responder_resources,
            MAX_RD_ATOMIC,
        )?;
        small("initiator_depth", self.initiator_depth, MAX_RD_ATOMIC)?;
        if let Some(p) = self.start_psn.filter(|&p| p > 0xff_ffff) {
            return Err(Error::invalid(
                "start_psn",
                format!("{p:#x}; a PSN is 24 bits (0..=0xffffff)"),
            ));
        }
        if self.private_data.len() > MAX_PRIVATE_DATA {
            return Err(Error::invalid(
                "private_data",
                format!(
                    "{} bytes; a connection carries at most {MAX_PRIVATE_DATA} bytes of private data",
                    self.private_data.len()
                ),
            ));
        }
        if let Some(l) = self
            .silence_limit
            .filter(|&l| l < super::KEEPALIVE_INTERVAL * 3)
        {
            return Err(Error::invalid(
                "peer_silence_limit",
                format!(
                    "{l:?}; a peer sends a keepalive every {:?}, so the limit must be at least three of those, and on a busy machine far more (seconds)",
                    super::KEEPALIVE_INTERVAL
                ),
            ));
        }
        if self.handshake_timeout.is_zero() {
            return Err(Error::invalid(
                "handshake_timeout",
                "zero; give the peer some time, e.g. a few seconds",
            ));
        }
        Ok(())
    }

    /// This side's offer, for a QP `qpn` starting at `psn`.
    pub(super) fn offer(&self, qpn: Qpn, psn: u32) -> Offer {
        Offer {
            qpn: qpn.get(),
            start_psn: psn,
            pmtu: self.mtu.bytes() as u16,
            local_ack_timeout: self.local_ack_timeout,
            target_ack_delay: self.target_ack_delay,
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            min_rnr_timer: self.min_rnr_timer,
            credits: 1,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            max_send_wr: self.caps.max_send_wr,
            max_recv_wr: self.caps.max_recv_wr,
            max_send_sge: self.caps.max_send_sge,
            max_recv_sge: self.caps.max_recv_sge,
            max_inline_data: self.caps.max_inline_data,
        }
    }

    /// The SQ start PSN: the one set, or a random one.
    pub(super) fn psn(&self) -> u32 {
        self.start_psn
            .unwrap_or_else(|| random_u64() as u32 & 0xff_ffff)
    }
}

/// This side's Local Ack Timeout, raised to exceed the peer's Target Ack Delay (0 stays 0:
/// no transport timer).
fn effective_timeout(own: u8, peer_ack_delay: u8) -> u8 {
    if own == 0 {
        0
    } else {
        own.max(peer_ack_delay.saturating_add(1)).min(31)
    }
}

/// Which side sent the offer being negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OfferFrom {
    /// A client's REQ: a proposal the server answers with what it agrees to.
    Client,
    /// A server's REP: the server's answer, which must not exceed what this (client) side
    /// offered.
    Server,
}

/// The parameters a connection runs with, agreed from this side's [`ConnectParams`] and the
/// peer's [`Offer`] by [`negotiate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Agreed {
    /// The path MTU: the smaller of both offers.
    pub(crate) mtu: Mtu,
    /// RDMA Reads and Atomics this side serves at once (`max_dest_rd_atomic`): its own
    /// responder resources, no more than the peer's initiator depth.
    pub(crate) responder_resources: u8,
    /// RDMA Reads and Atomics this side has outstanding (`max_rd_atomic`): its own initiator
    /// depth, no more than the peer's responder resources.
    pub(crate) initiator_depth: u8,
    /// This side's Local Ack Timeout, raised over the peer's Target Ack Delay.
    pub(crate) local_ack_timeout: u8,
    /// This side's Retry Count.
    pub(crate) retry_count: u8,
    /// The RNR Retry Count this side uses: the one the peer asked for.
    pub(crate) rnr_retry_count: u8,
    /// The RNR NAK timer code this side's RQ Logic sends.
    pub(crate) min_rnr_timer: u8,
    /// Whether the peer's RQ Logic reports end-to-end credits.
    pub(crate) remote_credits: bool,
}

/// Why an offer was refused: the REJ reason and a text naming the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub(crate) reason: RejectReason,
    pub(crate) text: String,
}

/// Negotiates the connection's parameters from this side's `own` parameters and the
/// `peer`'s offer, as the IBA CM does: the PMTU is the smaller of the two; a side's
/// initiator depth never exceeds the other's responder resources; each side's RNR Retry
/// Count is the one its peer asks for (spec/03: "supplied by the remote CA's CM"); a side's
/// Local Ack Timeout is raised to exceed the peer's Target Ack Delay.
///
/// A server's REP already carries the agreed PMTU and initiator depth; one above what this
/// side offered is refused as incompatible.
///
/// # Errors
/// A [`Refusal`] with [`RejectReason::InvalidParameter`] naming the first field of the
/// offer out of range, or [`RejectReason::Incompatible`] for a REP this side cannot meet.
pub(crate) fn negotiate(
    own: &ConnectParams,
    peer: &Offer,
    from: OfferFrom,
) -> std::result::Result<Agreed, Refusal> {
    let who = match from {
        OfferFrom::Client => "client's REQ",
        OfferFrom::Server => "server's REP",
    };
    let invalid = |e: Error| Refusal {
        reason: RejectReason::InvalidParameter,
        text: format!("the {who} is invalid: {e}"),
    };
    peer.check().map_err(invalid)?;
    let peer_mtu = Mtu::from_bytes(u32::from(peer.pmtu)).map_err(|e| invalid(e.into()))?;
    if from == OfferFrom::Server {
        let incompatible = |text: String| Refusal {
            reason: RejectReason::Incompatible,
            text,
        };
        if peer_mtu > own.mtu {
            return Err(incompatible(format!(
                "the server chose PMTU {} above the {} this side offered",
                peer_mtu.bytes(),
                own.mtu.bytes()
            )));
        }
        if peer.initiator_depth > own.responder_resources {
            return Err(incompatible(format!(
                "the server's initiator depth {} exceeds the {} responder resources this side offered",
                peer.initiator_depth, own.responder_resources
            )));
        }
    }
    Ok(Agreed {
        mtu: peer_mtu.min(own.mtu),
        responder_resources: own.responder_resources.min(peer.initiator_depth),
        initiator_depth: own.initiator_depth.min(peer.responder_resources),
        local_ack_timeout: effective_timeout(own.local_ack_timeout, peer.target_ack_delay),
        retry_count: own.retry_count,
        rnr_retry_count: peer.rnr_retry_count,
        min_rnr_timer: own.min_rnr_timer,
        remote_credits: peer.credits == 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer() -> Offer {
        ConnectParams::default().offer(Qpn::new(0x1002), 5)
    }

    fn agreed(own: &ConnectParams, peer: &Offer) -> Agreed {
        negotiate(own, peer, OfferFrom::Client).unwrap()
    }

    #[test]
    fn the_pmtu_is_the_smaller_offer() {
        let mut peer = offer();
        peer.pmtu = 1024;
        assert_eq!(agreed(&ConnectParams::default(), &peer).mtu, Mtu::Mtu1024);
        peer.pmtu = 4096;
        let own = ConnectParams::default().mtu(Mtu::Mtu512);
        assert_eq!(agreed(&own, &peer).mtu, Mtu::Mtu512);
    }

    #[test]
    fn initiator_depth_is_capped_by_the_peers_responder_resources() {
        let mut peer = offer();
        peer.responder_resources = 2;
        peer.initiator_depth = 3;
        let own = ConnectParams::default()
            .initiator_depth(8)
            .responder_resources(16);
        let a = agreed(&own, &peer);
        assert_eq!(a.initiator_depth, 2, "no more than the peer serves");
        assert_eq!(
            a.responder_resources, 3,
            "no more than the peer may ask for"
        );
        let own = ConnectParams::default()
            .initiator_depth(1)
            .responder_resources(0);
        let a = agreed(&own, &peer);
        assert_eq!((a.initiator_depth, a.responder_resources), (1, 0));
    }

    #[test]
    fn the_rnr_retry_count_is_the_peers() {
        let mut peer = offer();
        peer.rnr_retry_count = 2;
        let own = ConnectParams::default().rnr_retry_count(7);
        assert_eq!(agreed(&own, &peer).rnr_retry_count, 2);
        peer.rnr_retry_count = 7;
        let own = ConnectParams::default().rnr_retry_count(0);
        assert_eq!(agreed(&own, &peer).rnr_retry_count, 7);
    }

    #[test]
    fn the_ack_timeout_is_raised_over_the_peers_target_ack_delay() {
        let mut peer = offer();
        peer.target_ack_delay = 20;
        let own = ConnectParams::default().local_ack_timeout(14);
        assert_eq!(agreed(&own, &peer).local_ack_timeout, 21);
        peer.target_ack_delay = 3;
        assert_eq!(agreed(&own, &peer).local_ack_timeout, 14, "already above");
        peer.target_ack_delay = 31;
        assert_eq!(agreed(&own, &peer).local_ack_timeout, 31, "capped at 31");
        let own = ConnectParams::default().local_ack_timeout(0);
        assert_eq!(agreed(&own, &peer).local_ack_timeout, 0, "0 stays off");
    }

    #[test]
    fn own_settings_and_credits_pass_through() {
        let mut peer = offer();
        peer.credits = 0;
        let own = ConnectParams::default().retry_count(3).min_rnr_timer(5);
        let a = agreed(&own, &peer);
        assert_eq!((a.retry_count, a.min_rnr_timer), (3, 5));
        assert!(!a.remote_credits);
        peer.credits = 1;
        assert!(agreed(&own, &peer).remote_credits);
    }

    #[test]
    fn each_out_of_range_field_is_refused_naming_it() {
        type Bad = (&'static str, fn(&mut Offer));
        let cases: [Bad; 13] = [
            ("qpn", |o| o.qpn = 1),
            ("start_psn", |o| o.start_psn = 1 << 24),
            ("pmtu", |o| o.pmtu = 1000),
            ("local_ack_timeout", |o| o.local_ack_timeout = 32),
            ("target_ack_delay", |o| o.target_ack_delay = 32),
            ("retry_count", |o| o.retry_count = 8),
            ("rnr_retry_count", |o| o.rnr_retry_count = 8),
            ("min_rnr_timer", |o| o.min_rnr_timer = 32),
            ("credits", |o| o.credits = 2),
            ("responder_resources", |o| o.responder_resources = 17),
            ("initiator_depth", |o| o.initiator_depth = 17),
            ("max_send_wr", |o| o.max_send_wr = 0),
            ("max_recv_sge", |o| o.max_recv_sge = 0),
        ];
        for (field, spoil) in cases {
            let mut peer = offer();
            spoil(&mut peer);
            for from in [OfferFrom::Client, OfferFrom::Server] {
                let r = negotiate(&ConnectParams::default(), &peer, from).unwrap_err();
                assert_eq!(r.reason, RejectReason::InvalidParameter, "{field}");
                assert!(r.text.to_lowercase().contains(field), "{field}: {}", r.text);
            }
        }
    }

    #[test]
    fn a_rep_above_this_sides_offer_is_incompatible() {
        let own = ConnectParams::default()
            .mtu(Mtu::Mtu1024)
            .responder_resources(2);
        let mut rep = offer();
        rep.pmtu = 2048;
        let r = negotiate(&own, &rep, OfferFrom::Server).unwrap_err();
        assert_eq!(r.reason, RejectReason::Incompatible);
        assert!(r.text.contains("PMTU 2048"), "{}", r.text);
        // From a client the same offer is a proposal: the smaller PMTU is taken.
        assert_eq!(agreed(&own, &rep).mtu, Mtu::Mtu1024);
        let mut rep = offer();
        rep.pmtu = 1024;
        rep.initiator_depth = 3;
        let r = negotiate(&own, &rep, OfferFrom::Server).unwrap_err();
        assert_eq!(r.reason, RejectReason::Incompatible);
        assert!(r.text.contains("initiator depth 3"), "{}", r.text);
        rep.initiator_depth = 2;
        assert!(negotiate(&own, &rep, OfferFrom::Server).is_ok());
    }
}
