//! The QP context and its state machine (spec/03, spec/04, IBA chapter 10/12 transitions).
//!
//! A QP's state changes only through [`plan_modify`], which takes the current state and
//! context plus the caller's [`QpAttr`] and returns the new state and context — or an error
//! naming the missing or out-of-range attribute, in which case nothing changes. It is a pure
//! function; the engine applies its side effects (resetting the SQ and RQ Logic, flushing
//! queues on Error).

use crate::error::{Error, Result};
use crate::psn::Psn;

pub use shmhca_proto::qp::{AccessFlags, Destination, InvalidMtu, Mtu, QpConfig, QpState};

/// The most RDMA Read / Atomic requests one QP may have outstanding in either direction.
pub const MAX_RD_ATOMIC: u8 = crate::limits::MAX_RD_ATOMIC;
/// The deepest send or receive queue.
pub const MAX_QUEUE_DEPTH: u32 = crate::limits::MAX_QUEUE_DEPTH;
/// The most scatter/gather elements of one work request.
pub const MAX_SGE: u32 = crate::limits::MAX_SGE;
/// The most inline data of one work request.
pub const MAX_INLINE_DATA: u32 = crate::limits::MAX_INLINE_DATA;
/// The largest message (spec/05: zero to 2 GiB).
pub const MAX_MESSAGE: u64 = crate::limits::MAX_MESSAGE;

/// What a QP is created with (`ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth: how many send work requests may be outstanding.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Most gather elements of one send work request.
    pub max_send_sge: u32,
    /// Most scatter elements of one receive work request.
    pub max_recv_sge: u32,
    /// Most bytes of inline data of one send work request.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> QpCaps {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        }
    }
}

impl QpCaps {
    /// Checks every capability against the device limits.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first capability out of range.
    pub fn validate(&self) -> Result<()> {
        let depth = |name, v: u32| {
            if v == 0 || v > MAX_QUEUE_DEPTH {
                Err(Error::invalid(
                    name,
                    format!("{v}; a queue holds 1 to {MAX_QUEUE_DEPTH} work requests"),
                ))
            } else {
                Ok(())
            }
        };
        depth("max_send_wr", self.max_send_wr)?;
        depth("max_recv_wr", self.max_recv_wr)?;
        let sge = |name, v: u32| {
            if v == 0 || v > MAX_SGE {
                Err(Error::invalid(
                    name,
                    format!("{v}; a work request has 1 to {MAX_SGE} scatter/gather elements"),
                ))
            } else {
                Ok(())
            }
        };
        sge("max_send_sge", self.max_send_sge)?;
        sge("max_recv_sge", self.max_recv_sge)?;
        if self.max_inline_data > MAX_INLINE_DATA {
            return Err(Error::invalid(
                "max_inline_data",
                format!(
                    "{}; at most {MAX_INLINE_DATA} bytes can be sent inline",
                    self.max_inline_data
                ),
            ));
        }
        Ok(())
    }
}

/// Attributes of a modify-QP call; `None` leaves an attribute out (the `attr_mask` of
/// `ibv_modify_qp`). Build with the setters:
///
/// ```
/// use shmhca::{QpAttr, QpState, Mtu};
/// let rtr = QpAttr::new(QpState::Rtr).path_mtu(Mtu::Mtu1024).rq_psn(201);
/// assert_eq!(rtr.state, QpState::Rtr);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpAttr {
    /// The state to move to (required).
    pub state: QpState,
    /// Remote access enables (required for Reset → Init).
    pub access: Option<AccessFlags>,
    /// Path MTU (required for Init → RTR).
    pub path_mtu: Option<Mtu>,
    /// Link and remote QPN (required for Init → RTR, unless `fabric_dest` is set).
    pub dest: Option<Destination>,
    /// The remote port (LID or GID) and QPN on the fabric: [`Qp::modify`](crate::Qp::modify)
    /// finds the link to that port's engine and sets `dest` from it (see [`crate::fabric`];
    /// the context must have joined the fabric). Set with [`QpAttr::dest_lid`] or
    /// [`QpAttr::dest_gid`]; an alternative to `dest`, never with it.
    pub fabric_dest: Option<crate::fabric::addr::FabricDest>,
    /// The RQ Logic's first expected PSN: the remote SQ's start PSN (required for Init → RTR).
    pub rq_psn: Option<u32>,
    /// Responder resources: RDMA Read/Atomic requests this QP accepts at once (required for
    /// Init → RTR, 0..=16).
    pub max_dest_rd_atomic: Option<u8>,
    /// The RNR Nak timer code this QP's RQ Logic sends (required for Init → RTR, 0..=31).
    ///
    /// A Send (or RDMA Write with Immediate) that finds no receive posted is answered with
    /// an RNR Nak, and the sender waits this long (code 1 = 0.01 ms … 31 = 491.52 ms, 0 =
    /// 655.36 ms) before sending it again. An application that re-posts its receive only
    /// after answering (an echo server) pays that wait on many messages, silently: the
    /// counters [`Stats::rnr_naks_sent`](crate::Stats::rnr_naks_sent) here and
    /// `rnr_naks_received` at the sender show it, as does `shmhca stat`. Post receives
    /// before the messages they take, keep more than one posted, or use a small code.
    pub min_rnr_timer: Option<u8>,
    /// Whether the remote RQ Logic reports end-to-end credits (spec/02; optional, default yes).
    pub remote_credits: Option<bool>,
    /// The SQ Logic's start PSN (required for RTR → RTS).
    pub sq_psn: Option<u32>,
    /// Local Ack Timeout: the transport timer is 4.096 µs × 2^timeout; 0 disables it
    /// (required for RTR → RTS, 0..=31).
    pub timeout: Option<u8>,
    /// Retry Count for timeouts and sequence-error Naks (required for RTR → RTS, 0..=7).
    pub retry_cnt: Option<u8>,
    /// RNR Retry Count; 7 retries forever (required for RTR → RTS, 0..=7).
    pub rnr_retry: Option<u8>,
    /// Initiator depth: RDMA Read/Atomic requests this QP has outstanding at once; must not
    /// exceed the remote's responder resources (required for RTR → RTS, 0..=16).
    pub max_rd_atomic: Option<u8>,
    /// The IP TTL (IPv4) or hop limit (IPv6) of the QP's packets over a UDP link
    /// (`ibv_ah_attr.grh.hop_limit`; optional in Init → RTR; 0: the host's default, 64).
    /// Shared-memory links have no IP header: there it is kept and changes nothing.
    pub hop_limit: Option<u8>,
    /// The IP TOS (IPv4) or traffic class (IPv6) of the QP's packets over a UDP link: DSCP
    /// and ECN bits (`ibv_ah_attr.grh.traffic_class`; optional in Init → RTR). The CNPs the
    /// QP sends (for CE-marked packets it receives) go with it too. shmhca sets no ECN bits
    /// of its own (0: not ECN-capable; it does not slow down for CNPs): ECT(0) is `| 0b10`.
    pub traffic_class: Option<u8>,
}

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty),* $(,)?) => {
        $( $(#[$doc])* pub fn $name(mut self, v: $ty) -> QpAttr { self.$name = Some(v); self } )*
    };
}

impl QpAttr {
    /// Attributes that move the QP to `state` and change nothing else.
    pub fn new(state: QpState) -> QpAttr {
        QpAttr {
            state,
            access: None,
            path_mtu: None,
            dest: None,
            fabric_dest: None,
            rq_psn: None,
            max_dest_rd_atomic: None,
            min_rnr_timer: None,
            remote_credits: None,
            sq_psn: None,
            timeout: None,
            retry_cnt: None,
            rnr_retry: None,
            max_rd_atomic: None,
            hop_limit: None,
            traffic_class: None,
        }
    }

    setters! {
        /// Sets the remote access enables.
        access: AccessFlags,
        /// Sets the path MTU.
        path_mtu: Mtu,
        /// Sets the link and remote QPN.
        dest: Destination,
        /// Sets the RQ Logic's expected PSN.
        rq_psn: u32,
        /// Sets the responder resources.
        max_dest_rd_atomic: u8,
        /// Sets the minimum RNR Nak timer code.
        min_rnr_timer: u8,
        /// Sets whether the remote reports credits.
        remote_credits: bool,
        /// Sets the SQ start PSN.
        sq_psn: u32,
        /// Sets the Local Ack Timeout.
        timeout: u8,
        /// Sets the Retry Count.
        retry_cnt: u8,
        /// Sets the RNR Retry Count.
        rnr_retry: u8,
        /// Sets the initiator depth.
        max_rd_atomic: u8,
        /// Sets the IP TTL or hop limit over a UDP link.
        hop_limit: u8,
        /// Sets the IP TOS or traffic class over a UDP link.
        traffic_class: u8,
    }

    /// Sets the remote QP by the LID of its port and its QPN (`ibv_ah_attr.dlid` and
    /// `dest_qp_num`): an alternative to [`QpAttr::dest`] for a context on the fabric (see
    /// [`crate::fabric`]).
    pub fn dest_lid(mut self, lid: u16, qpn: crate::wire::Qpn) -> QpAttr {
        self.fabric_dest = Some(crate::fabric::addr::FabricDest {
            peer: crate::fabric::addr::FabricPeer::Lid(lid),
            qpn,
        });
        self
    }

    /// Sets the remote QP by the GID of its port and its QPN (`ibv_ah_attr.grh.dgid`):
    /// as [`QpAttr::dest_lid`], for programs that address by GID (`-g 0`).
    pub fn dest_gid(mut self, gid: [u8; 16], qpn: crate::wire::Qpn) -> QpAttr {
        self.fabric_dest = Some(crate::fabric::addr::FabricDest {
            peer: crate::fabric::addr::FabricPeer::Gid(gid),
            qpn,
        });
        self
    }

    /// The names of the attributes that are set, in declaration order.
    fn present(&self) -> impl Iterator<Item = &'static str> + '_ {
        [
            ("access", self.access.is_some()),
            ("path_mtu", self.path_mtu.is_some()),
            ("dest", self.dest.is_some()),
            ("rq_psn", self.rq_psn.is_some()),
            ("max_dest_rd_atomic", self.max_dest_rd_atomic.is_some()),
            ("min_rnr_timer", self.min_rnr_timer.is_some()),
            ("remote_credits", self.remote_credits.is_some()),
            ("sq_psn", self.sq_psn.is_some()),
            ("timeout", self.timeout.is_some()),
            ("retry_cnt", self.retry_cnt.is_some()),
            ("rnr_retry", self.rnr_retry.is_some()),
            ("max_rd_atomic", self.max_rd_atomic.is_some()),
            ("hop_limit", self.hop_limit.is_some()),
            ("traffic_class", self.traffic_class.is_some()),
        ]
        .into_iter()
        .filter_map(|(n, set)| set.then_some(n))
    }
}

/// Which attributes a transition requires and which it allows besides.
fn rules(from: QpState, to: QpState) -> Option<(&'static [&'static str], &'static [&'static str])> {
    use QpState::*;
    const NONE: &[&str] = &[];
    Some(match (from, to) {
        (_, Reset) | (_, Error) => (NONE, NONE),
        (Reset, Init) => (&["access"], NONE),
        (Init, Init) => (NONE, &["access"]),
        (Init, Rtr) => (
            &[
                "path_mtu",
                "dest",
                "rq_psn",
                "max_dest_rd_atomic",
                "min_rnr_timer",
            ],
            &["access", "remote_credits", "hop_limit", "traffic_class"],
        ),
        (Rtr, Rts) => (
            &[
                "sq_psn",
                "timeout",
                "retry_cnt",
                "rnr_retry",
                "max_rd_atomic",
            ],
            &["access", "min_rnr_timer"],
        ),
        (Rts, Rts) | (Sqe, Rts) => (NONE, &["access", "min_rnr_timer"]),
        (Rts, Sqd) => (NONE, NONE),
        (Sqd, Rts) => (NONE, &["access", "min_rnr_timer"]),
        (Sqd, Sqd) => (
            NONE,
            &[
                "access",
                "min_rnr_timer",
                "timeout",
                "retry_cnt",
                "rnr_retry",
                "max_rd_atomic",
                "max_dest_rd_atomic",
            ],
        ),
        _ => return None,
    })
}

fn range(name: &'static str, v: u8, max: u8, what: &str) -> Result<()> {
    if v > max {
        return Err(Error::invalid(name, format!("{v}; {what} is 0..={max}")));
    }
    Ok(())
}

/// Validates a modify-QP call and computes the QP's new state and context.
///
/// # Errors
/// [`Error::InvalidTransition`] for a transition the state machine does not have,
/// [`Error::MissingAttribute`] for a missing required attribute, and
/// [`Error::InvalidArgument`] for an attribute out of range or not allowed in this
/// transition. On error the caller keeps the old state and context.
pub fn plan_modify(from: QpState, cur: &QpConfig, attr: &QpAttr) -> Result<(QpState, QpConfig)> {
    let to = attr.state;
    let (required, optional) = rules(from, to).ok_or(Error::InvalidTransition { from, to })?;
    if let Some(missing) = required.iter().find(|r| !attr.present().any(|p| p == **r)) {
        return Err(Error::MissingAttribute {
            from,
            to,
            attribute: missing,
        });
    }
    if let Some(extra) = attr
        .present()
        .find(|p| !required.contains(p) && !optional.contains(p))
    {
        return Err(Error::invalid(
            "modify QP",
            format!("attribute `{extra}` cannot be set in the {from:?} -> {to:?} transition"),
        ));
    }
    let mut next = *cur;
    if to == QpState::Reset {
        next = QpConfig::default();
    }
    if let Some(a) = attr.access {
        next.access = a;
    }
    if let Some(m) = attr.path_mtu {
        next.path_mtu = m;
    }
    if let Some(d) = attr.dest {
        next.dest = Some(d);
    }
    if let Some(p) = attr.rq_psn {
        if p > Psn::MASK {
            return Err(Error::invalid(
                "rq_psn",
                format!("{p:#x}; a PSN is 24 bits (0..=0xffffff)"),
            ));
        }
        next.rq_psn = Psn::new(p);
    }
    if let Some(p) = attr.sq_psn {
        if p > Psn::MASK {
            return Err(Error::invalid(
                "sq_psn",
                format!("{p:#x}; a PSN is 24 bits (0..=0xffffff)"),
            ));
        }
        next.sq_psn = Psn::new(p);
    }
    if let Some(v) = attr.max_dest_rd_atomic {
        range(
            "max_dest_rd_atomic",
            v,
            MAX_RD_ATOMIC,
            "the responder resources",
        )?;
        next.max_dest_rd_atomic = v;
    }
    if let Some(v) = attr.max_rd_atomic {
        range("max_rd_atomic", v, MAX_RD_ATOMIC, "the initiator depth")?;
        next.max_rd_atomic = v;
    }
    if let Some(v) = attr.min_rnr_timer {
        range("min_rnr_timer", v, 31, "the RNR Nak timer code")?;
        next.min_rnr_timer = v;
    }
    if let Some(v) = attr.timeout {
        range("timeout", v, 31, "the Local Ack Timeout")?;
        next.timeout = v;
    }
    if let Some(v) = attr.retry_cnt {
        range("retry_cnt", v, 7, "the Retry Count")?;
        next.retry_cnt = v;
    }
    if let Some(v) = attr.rnr_retry {
        range("rnr_retry", v, 7, "the RNR Retry Count")?;
        next.rnr_retry = v;
    }
    if let Some(v) = attr.remote_credits {
        next.remote_credits = v;
    }
    if let Some(v) = attr.hop_limit {
        next.hop_limit = v;
    }
    if let Some(v) = attr.traffic_class {
        next.traffic_class = v;
    }
    Ok((to, next))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::LinkId;
    use crate::wire::Qpn;

    fn dest() -> Destination {
        Destination {
            link: LinkId::new(0),
            qpn: Qpn::new(0x1234),
        }
    }

    fn rtr() -> QpAttr {
        QpAttr::new(QpState::Rtr)
            .path_mtu(Mtu::Mtu1024)
            .dest(dest())
            .rq_psn(201)
            .max_dest_rd_atomic(4)
            .min_rnr_timer(12)
    }

    fn rts() -> QpAttr {
        QpAttr::new(QpState::Rts)
            .sq_psn(201)
            .timeout(14)
            .retry_cnt(7)
            .rnr_retry(7)
            .max_rd_atomic(4)
    }

    fn walk(attrs: &[QpAttr]) -> Result<(QpState, QpConfig)> {
        let mut s = (QpState::Reset, QpConfig::default());
        for a in attrs {
            s = plan_modify(s.0, &s.1, a)?;
        }
        Ok(s)
    }

    #[test]
    fn reset_init_rtr_rts_applies_every_attribute() {
        let init = QpAttr::new(QpState::Init).access(AccessFlags::REMOTE_WRITE);
        let (state, cfg) = walk(&[init, rtr(), rts()]).unwrap();
        assert_eq!(state, QpState::Rts);
        assert_eq!(cfg.path_mtu, Mtu::Mtu1024);
        assert_eq!(cfg.rq_psn, Psn::new(201));
        assert_eq!(cfg.sq_psn, Psn::new(201));
        assert_eq!(cfg.max_dest_rd_atomic, 4);
        assert_eq!(cfg.min_rnr_timer, 12);
        assert_eq!(cfg.timeout, 14);
        assert_eq!(cfg.access, AccessFlags::REMOTE_WRITE);
        assert_eq!(cfg.dest, Some(dest()));
    }

    #[test]
    fn each_missing_required_attribute_is_named() {
        let init = QpAttr::new(QpState::Init).access(AccessFlags::NONE);
        let (s, cfg) = walk(&[init]).unwrap();
        for name in [
            "path_mtu",
            "dest",
            "rq_psn",
            "max_dest_rd_atomic",
            "min_rnr_timer",
        ] {
            let mut a = rtr();
            match name {
                "path_mtu" => a.path_mtu = None,
                "dest" => a.dest = None,
                "rq_psn" => a.rq_psn = None,
                "max_dest_rd_atomic" => a.max_dest_rd_atomic = None,
                _ => a.min_rnr_timer = None,
            }
            match plan_modify(s, &cfg, &a) {
                Err(Error::MissingAttribute { attribute, .. }) => assert_eq!(attribute, name),
                other => panic!("{name}: {other:?}"),
            }
        }
        let (s, cfg) = plan_modify(s, &cfg, &rtr()).unwrap();
        for name in [
            "sq_psn",
            "timeout",
            "retry_cnt",
            "rnr_retry",
            "max_rd_atomic",
        ] {
            let mut a = rts();
            match name {
                "sq_psn" => a.sq_psn = None,
                "timeout" => a.timeout = None,
                "retry_cnt" => a.retry_cnt = None,
                "rnr_retry" => a.rnr_retry = None,
                _ => a.max_rd_atomic = None,
            }
            let err = plan_modify(s, &cfg, &a).unwrap_err();
            assert!(err.to_string().contains(name), "{err}");
        }
    }

    #[test]
    fn out_of_range_values_are_rejected() {
        let (s, cfg) = walk(&[QpAttr::new(QpState::Init).access(AccessFlags::NONE)]).unwrap();
        let bad = [
            rtr().rq_psn(0x100_0000),
            rtr().max_dest_rd_atomic(17),
            rtr().min_rnr_timer(32),
        ];
        for a in bad {
            assert!(matches!(
                plan_modify(s, &cfg, &a),
                Err(Error::InvalidArgument { .. })
            ));
        }
        let (s, cfg) = plan_modify(s, &cfg, &rtr()).unwrap();
        for a in [rts().retry_cnt(8), rts().rnr_retry(8), rts().timeout(32)] {
            assert!(plan_modify(s, &cfg, &a).is_err());
        }
        assert!(Mtu::from_bytes(1000).is_err());
        assert_eq!(Mtu::from_bytes(4096).unwrap().bytes(), 4096);
    }

    #[test]
    fn transitions_outside_the_state_machine_fail() {
        let cfg = QpConfig::default();
        assert!(matches!(
            plan_modify(QpState::Reset, &cfg, &rts()),
            Err(Error::InvalidTransition { .. })
        ));
        assert!(matches!(
            plan_modify(QpState::Init, &cfg, &rts()),
            Err(Error::InvalidTransition { .. })
        ));
        // Any state can go to Error and Reset.
        for s in [QpState::Init, QpState::Rtr, QpState::Rts, QpState::Sqd] {
            assert_eq!(
                plan_modify(s, &cfg, &QpAttr::new(QpState::Error))
                    .unwrap()
                    .0,
                QpState::Error
            );
            assert_eq!(
                plan_modify(s, &cfg, &QpAttr::new(QpState::Reset))
                    .unwrap()
                    .0,
                QpState::Reset
            );
        }
    }

    #[test]
    fn attributes_not_allowed_in_a_transition_are_rejected() {
        let err = plan_modify(
            QpState::Reset,
            &QpConfig::default(),
            &QpAttr::new(QpState::Init)
                .access(AccessFlags::NONE)
                .sq_psn(5),
        )
        .unwrap_err();
        assert!(err.to_string().contains("sq_psn"), "{err}");
    }

    #[test]
    fn caps_are_checked_against_device_limits() {
        assert!(QpCaps::default().validate().is_ok());
        let bad = [
            QpCaps {
                max_send_wr: 0,
                ..QpCaps::default()
            },
            QpCaps {
                max_recv_wr: MAX_QUEUE_DEPTH + 1,
                ..QpCaps::default()
            },
            QpCaps {
                max_send_sge: 17,
                ..QpCaps::default()
            },
            QpCaps {
                max_inline_data: MAX_INLINE_DATA + 1,
                ..QpCaps::default()
            },
        ];
        for c in bad {
            assert!(c.validate().is_err(), "{c:?}");
        }
    }
}
