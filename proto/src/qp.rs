//! The QP's state and access vocabulary (spec/03, spec/04; IBA 10.3.1): what the protocol
//! stages and every layer above them say of a QP.
//!
//! ```
//! use shmhca_proto::qp::{AccessFlags, QpState};
//!
//! assert!(QpState::Rts.sends() && QpState::Rtr.receives() && !QpState::Rtr.sends());
//! let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
//! assert!(rw.contains(AccessFlags::REMOTE_WRITE) && rw.remote_writable());
//! assert_eq!(AccessFlags::from_bits(0x80), None, "unknown bits are refused");
//! ```

use crate::ids::{CqId, LinkId, PdId};
use crate::psn::Psn;
use crate::wire::Qpn;

/// The states of a QP (IBA 10.3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum QpState {
    /// Just created or reset: nothing can be posted or received.
    Reset = 0,
    /// Initialised: receives may be posted; nothing is processed.
    Init = 1,
    /// Ready to Receive: inbound requests are processed; posting a send is an error.
    Rtr = 2,
    /// Ready to Send: fully operational.
    Rts = 3,
    /// Send Queue Drained: sends are accepted but not started.
    Sqd = 4,
    /// Send Queue Error: a local send error; the RQ still works.
    Sqe = 5,
    /// Error: everything posted completes with a flush error.
    Error = 6,
}

impl QpState {
    /// Decodes the value of a state mirror; anything unknown reads as `Error`.
    // In line across crates in a build without LTO (a program's own profile may run none):
    // this is called per message.
    #[inline]
    pub fn from_u8(v: u8) -> QpState {
        match v {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            4 => QpState::Sqd,
            5 => QpState::Sqe,
            _ => QpState::Error,
        }
    }

    /// Whether receives may be posted (Init, RTR, RTS, SQD, SQE; in Error they are flushed).
    pub fn can_post_recv(self) -> bool {
        !matches!(self, QpState::Reset)
    }

    /// Whether the RQ Logic processes inbound requests.
    pub fn receives(self) -> bool {
        matches!(
            self,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        )
    }

    /// Whether the SQ Logic starts new work requests.
    pub fn sends(self) -> bool {
        matches!(self, QpState::Rts)
    }
}

/// Access rights of a memory region or, for the remote ones, enables of a QP (spec/03
/// "Enable/disable RDMA and Atomic Operations").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AccessFlags(u8);

impl AccessFlags {
    /// No access beyond local reads.
    pub const NONE: AccessFlags = AccessFlags(0);
    /// The engine may write the memory for this process (receive buffers, Read and Atomic
    /// results).
    pub const LOCAL_WRITE: AccessFlags = AccessFlags(1);
    /// Peers may RDMA Write it.
    pub const REMOTE_WRITE: AccessFlags = AccessFlags(2);
    /// Peers may RDMA Read it.
    pub const REMOTE_READ: AccessFlags = AccessFlags(4);
    /// Peers may run atomics on it.
    pub const REMOTE_ATOMIC: AccessFlags = AccessFlags(8);
    /// Memory windows may be bound over the region (`IBV_ACCESS_MW_BIND`); see
    /// shmhca's `Mw`.
    pub const MW_BIND: AccessFlags = AccessFlags(16);
    /// Every local and remote data right (not [`AccessFlags::MW_BIND`]).
    pub const ALL: AccessFlags = AccessFlags(15);

    /// Whether every flag of `other` is set here.
    pub fn contains(self, other: AccessFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// The raw bits.
    pub fn bits(self) -> u8 {
        self.0
    }

    /// Whether a peer can change memory with these rights.
    pub fn remote_writable(self) -> bool {
        self.0 & (Self::REMOTE_WRITE.0 | Self::REMOTE_ATOMIC.0) != 0
    }

    /// Flags from raw bits, rejecting unknown bits.
    pub fn from_bits(bits: u8) -> Option<AccessFlags> {
        (bits & !(Self::ALL.0 | Self::MW_BIND.0) == 0).then_some(AccessFlags(bits))
    }
}

impl core::ops::BitOr for AccessFlags {
    type Output = AccessFlags;
    fn bitor(self, rhs: AccessFlags) -> AccessFlags {
        AccessFlags(self.0 | rhs.0)
    }
}

impl core::ops::BitOrAssign for AccessFlags {
    fn bitor_assign(&mut self, rhs: AccessFlags) {
        self.0 |= rhs.0;
    }
}

/// The most RDMA Read / Atomic requests one QP may have outstanding in either direction
/// (initiator depth and responder resources).
pub const MAX_RD_ATOMIC: u8 = 16;

/// Path MTU: the largest payload of one packet (spec/04 "Maximum Data Payload Size").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl Mtu {
    /// The payload size in bytes.
    pub fn bytes(self) -> u32 {
        match self {
            Mtu::Mtu256 => 256,
            Mtu::Mtu512 => 512,
            Mtu::Mtu1024 => 1024,
            Mtu::Mtu2048 => 2048,
            Mtu::Mtu4096 => 4096,
        }
    }

    /// The MTU of exactly `bytes` bytes.
    ///
    /// # Errors
    /// [`InvalidMtu`] unless `bytes` is 256, 512, 1024, 2048 or 4096 (the engine's
    /// `shmhca::Error` converts from it, so `?` works in either).
    pub fn from_bytes(bytes: u32) -> Result<Mtu, InvalidMtu> {
        Ok(match bytes {
            256 => Mtu::Mtu256,
            512 => Mtu::Mtu512,
            1024 => Mtu::Mtu1024,
            2048 => Mtu::Mtu2048,
            4096 => Mtu::Mtu4096,
            _ => return Err(InvalidMtu(bytes)),
        })
    }
}

/// A path MTU that is not one of the five InfiniBand defines; holds the bytes asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidMtu(pub u32);

impl core::fmt::Display for InvalidMtu {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "{} bytes; the PMTU is one of 256, 512, 1024, 2048, 4096",
            self.0
        )
    }
}

/// Where a QP's packets go: the link to the peer engine and the peer's QP number
/// (the address vector and destination QPN of `ibv_qp_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Destination {
    /// The link to the engine hosting the remote QP.
    pub link: LinkId,
    /// The remote QP's number.
    pub qpn: Qpn,
}

/// The programmed part of a QP context (spec/04, Figure 3-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpConfig {
    /// Remote access enables.
    pub access: AccessFlags,
    /// Path MTU.
    pub path_mtu: Mtu,
    /// Where packets go.
    pub dest: Option<Destination>,
    /// The RQ Logic's initial ePSN.
    pub rq_psn: Psn,
    /// Responder resources.
    pub max_dest_rd_atomic: u8,
    /// RNR Nak timer code sent by the RQ Logic.
    pub min_rnr_timer: u8,
    /// Whether the remote reports credits.
    pub remote_credits: bool,
    /// SQ start PSN.
    pub sq_psn: Psn,
    /// Local Ack Timeout.
    pub timeout: u8,
    /// Retry Count.
    pub retry_cnt: u8,
    /// RNR Retry Count.
    pub rnr_retry: u8,
    /// Initiator depth.
    pub max_rd_atomic: u8,
    /// The IP TTL (IPv4) or hop limit (IPv6) of its packets over RoCEv2
    /// (`ibv_ah_attr.grh.hop_limit`); 0: the host's default.
    pub hop_limit: u8,
    /// The IP TOS (IPv4) or traffic class (IPv6) of its packets over RoCEv2 (DSCP and ECN
    /// bits, `ibv_ah_attr.grh.traffic_class`).
    pub traffic_class: u8,
}

impl Default for QpConfig {
    fn default() -> QpConfig {
        QpConfig {
            access: AccessFlags::NONE,
            path_mtu: Mtu::Mtu1024,
            dest: None,
            rq_psn: Psn::new(0),
            max_dest_rd_atomic: 0,
            min_rnr_timer: 0,
            remote_credits: true,
            sq_psn: Psn::new(0),
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            max_rd_atomic: 0,
            hop_limit: 0,
            traffic_class: 0,
        }
    }
}

/// A QP's protocol half: the QP context of spec/04 as the transport needs it — its number,
/// protection domain, state and programmed context, its completion queues, the SQ Logic
/// ([`Requester`](crate::requester::Requester)) and the RQ Logic
/// ([`Responder`](crate::responder::Responder)). Whoever drives the QP owns the rest (its
/// memory, the queues the application posts to, what it shares with the application) and
/// holds this beside it; the engine calls the two together its QP slot.
///
/// ```
/// use shmhca_proto::ids::{CqId, PdId};
/// use shmhca_proto::qp::{Qp, QpState};
/// use shmhca_proto::wire::Qpn;
///
/// let qp = Qp::new(Qpn::new(0x11), PdId::new(1), (CqId::new(2), CqId::new(3)), 64);
/// assert_eq!(qp.state, QpState::Reset);
/// assert!(!qp.req.window().has_work());
/// ```
#[derive(Debug)]
pub struct Qp {
    /// The QP's number.
    pub qpn: Qpn,
    /// Its protection domain.
    pub pd: PdId,
    /// Its state (the driver publishes it to the application as it changes).
    pub state: QpState,
    /// Its programmed context.
    pub cfg: QpConfig,
    /// The completion queue of its send work.
    pub send_cq: CqId,
    /// The completion queue of its receive work.
    pub recv_cq: CqId,
    /// SQ Logic and completer state.
    pub req: crate::requester::Requester,
    /// RQ Logic state.
    pub resp: crate::responder::Responder,
    /// Set on entry into RTR; the first request received while still in RTR clears it
    /// (the driver raises its Communication Established event, once per entry).
    pub comm_est_pending: bool,
}

impl Qp {
    /// QP `qpn` of protection domain `pd`, completing into `(send_cq, recv_cq)`, with a
    /// send queue of `sq_depth` WQEs; in the Reset state.
    pub fn new(qpn: Qpn, pd: PdId, (send_cq, recv_cq): (CqId, CqId), sq_depth: u32) -> Qp {
        Qp {
            qpn,
            pd,
            state: QpState::Reset,
            cfg: QpConfig::default(),
            send_cq,
            recv_cq,
            req: crate::requester::Requester::new(sq_depth),
            resp: crate::responder::Responder::new(),
            comm_est_pending: false,
        }
    }

    /// When the QP next needs the driver's attention by the clock: the earliest of its
    /// started timers (the transport timer, the RNR wait), `None` if neither runs. Timers
    /// armed on the packet path start at the driver's next look at the clock
    /// ([`Requester::start_timers`](crate::requester::Requester::start_timers)): start them
    /// first for an answer that counts them.
    pub fn poll_at(&self) -> Option<crate::timer::Timestamp> {
        match (self.req.timer().at(), self.req.rnr_timer().at()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timer::{Clock, ManualClock, Timestamp};
    use core::time::Duration;

    /// `poll_at` is the earliest started timer: none at first; the transport timer once a
    /// request went; an RNR wait (which stops the transport timer) alone.
    #[test]
    fn poll_at_is_the_earliest_started_timer() {
        let clock = ManualClock::new(Timestamp::from_nanos(1_000));
        let mut qp = Qp::new(Qpn::new(1), PdId::new(0), (CqId::new(0), CqId::new(0)), 4);
        qp.cfg.timeout = 14;
        qp.cfg.rnr_retry = 3;
        qp.req.start(&qp.cfg, clock.resolution());
        assert_eq!(qp.poll_at(), None);
        qp.req.after_transmit(false, Some(0)); // waits for room: the timer runs
        qp.req.start_timers(&mut clock.timers());
        let ttr = qp.req.ttr().unwrap();
        assert_eq!(
            qp.poll_at(),
            Some(clock.now().after(ttr + clock.resolution()))
        );
        let wait = Duration::from_micros(10);
        assert!(qp.req.rnr_wait(crate::psn::Psn::new(0), wait, &qp.cfg));
        qp.req.start_timers(&mut clock.timers());
        assert_eq!(
            qp.poll_at(),
            Some(clock.now().after(wait + clock.resolution()))
        );
    }

    /// `from_u8` decodes every state's own value back to it, and anything unknown reads
    /// as `Error` (its doc comment).
    #[test]
    fn from_u8_round_trips_every_state_and_reads_unknown_as_error() {
        use QpState::*;
        for s in [Reset, Init, Rtr, Rts, Sqd, Sqe, Error] {
            assert_eq!(QpState::from_u8(s as u8), s);
        }
        for v in [7, 8, 0x80, 255] {
            assert_eq!(QpState::from_u8(v), Error, "{v}");
        }
    }

    /// Receives may be posted in every state but Reset (in Error they are flushed).
    #[test]
    fn receives_can_be_posted_in_every_state_but_reset() {
        use QpState::*;
        assert!(!Reset.can_post_recv());
        for s in [Init, Rtr, Rts, Sqd, Sqe, Error] {
            assert!(s.can_post_recv(), "{s:?}");
        }
    }

    /// The raw bits are the flags' values; `|` and `|=` set the union (idempotently);
    /// `from_bits` takes back exactly the known bits.
    #[test]
    fn access_flags_bits_and_union() {
        assert_eq!(AccessFlags::NONE.bits(), 0);
        assert_eq!(AccessFlags::LOCAL_WRITE.bits(), 1);
        assert_eq!(
            (AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ).bits(),
            6
        );
        assert_eq!(
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_READ,
            AccessFlags::REMOTE_READ
        );
        assert_eq!(
            AccessFlags::ALL | AccessFlags::LOCAL_WRITE,
            AccessFlags::ALL
        );
        let mut f = AccessFlags::NONE;
        f |= AccessFlags::REMOTE_ATOMIC;
        f |= AccessFlags::LOCAL_WRITE;
        f |= AccessFlags::LOCAL_WRITE;
        assert_eq!(f.bits(), 9);
        assert!(f.contains(AccessFlags::REMOTE_ATOMIC) && f.contains(AccessFlags::LOCAL_WRITE));
        for bits in 0..=0x1f {
            assert_eq!(
                AccessFlags::from_bits(bits).map(AccessFlags::bits),
                Some(bits)
            );
        }
        for bits in [0x20, 0x40, 0x80, 0xff] {
            assert_eq!(AccessFlags::from_bits(bits), None);
        }
    }

    /// A peer can change memory through Remote Write or Remote Atomic rights, not through
    /// local or read rights alone.
    #[test]
    fn remote_writable_only_with_remote_write_or_atomic() {
        let f = |bits| AccessFlags::from_bits(bits).unwrap();
        for (flags, writable) in [
            (AccessFlags::NONE, false),
            (AccessFlags::LOCAL_WRITE, false),
            (AccessFlags::REMOTE_READ, false),
            (AccessFlags::MW_BIND, false),
            (f(1 | 4 | 16), false),
            (AccessFlags::REMOTE_WRITE, true),
            (AccessFlags::REMOTE_ATOMIC, true),
            (AccessFlags::ALL, true),
        ] {
            assert_eq!(flags.remote_writable(), writable, "{flags:?}");
        }
    }

    /// `Mtu::from_bytes` accepts exactly the five InfiniBand sizes, each the MTU of that
    /// many bytes; anything else is an `InvalidMtu` holding what was asked, and says so.
    #[test]
    fn mtu_from_bytes_accepts_exactly_the_five_sizes() {
        let all = [
            Mtu::Mtu256,
            Mtu::Mtu512,
            Mtu::Mtu1024,
            Mtu::Mtu2048,
            Mtu::Mtu4096,
        ];
        for (m, bytes) in all.into_iter().zip([256, 512, 1024, 2048, 4096]) {
            assert_eq!(m.bytes(), bytes);
            assert_eq!(Mtu::from_bytes(bytes), Ok(m));
        }
        for bytes in [0, 1, 128, 255, 257, 1000, 1500, 4095, 8192, u32::MAX] {
            assert_eq!(Mtu::from_bytes(bytes), Err(InvalidMtu(bytes)));
        }
        assert_eq!(
            alloc::format!("{}", Mtu::from_bytes(300).unwrap_err()),
            "300 bytes; the PMTU is one of 256, 512, 1024, 2048, 4096"
        );
    }
}
