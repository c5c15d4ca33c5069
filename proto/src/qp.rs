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
