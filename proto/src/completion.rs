//! Work completions: what the protocol core reports and the verbs layer hands to the
//! application (`ibv_wc`). Leaf vocabulary: the SQ Logic, the completer and the RQ Logic
//! produce these, the completion queues carry them, and nothing here knows of either.

use crate::wire::Qpn;

/// The status of a work completion (`ibv_wc_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// It worked.
    Success,
    /// An incoming message was larger than the receive buffer.
    LocLenErr,
    /// An internal inconsistency on this side (e.g. a malformed incoming request).
    LocQpOpErr,
    /// The work request was flushed: the QP is in the Error state.
    WrFlushErr,
    /// The peer answered with a malformed or unexpected response.
    BadRespErr,
    /// The peer rejected the request as invalid (Nak Invalid Request).
    RemInvReqErr,
    /// The peer refused access: bad R_Key, bounds, or rights (Nak Remote Access Error).
    RemAccessErr,
    /// The peer failed to carry the request out (Nak Remote Operational Error).
    RemOpErr,
    /// The transport retry count was exhausted (no response from the peer).
    RetryExcErr,
    /// The RNR retry count was exhausted (the peer never had a receive buffer).
    RnrRetryExcErr,
    /// A memory window bind failed (`IBV_WC_MW_BIND_ERR`): see shmhca's `SendOp::BindMw`.
    MwBindErr,
    /// A local protection error (`IBV_WC_LOC_PROT_ERR`): a Local Invalidate of a key that
    /// names no bound type 2 window of the QP's domain, or (receive side) a Send with
    /// Invalidate naming a key this QP may not invalidate.
    LocProtErr,
}

/// The operation a work completion reports (`ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// A Send (with or without immediate).
    Send,
    /// An RDMA Write (with or without immediate).
    RdmaWrite,
    /// An RDMA Read.
    RdmaRead,
    /// An Atomic Compare and Swap.
    CompSwap,
    /// An Atomic Fetch and Add.
    FetchAdd,
    /// A received Send.
    Recv,
    /// A receive consumed by an RDMA Write with Immediate.
    RecvRdmaWithImm,
    /// A memory window bind (shmhca's `Qp::bind_mw` or `SendOp::BindMw`).
    BindMw,
    /// A Local Invalidate (shmhca's `SendOp::LocalInv`).
    LocalInv,
}

/// A work completion (`ibv_wc`): what became of a work request, for the application.
///
/// ```
/// use shmhca_proto::completion::{WcOpcode, WcStatus, WorkCompletion};
/// use shmhca_proto::wire::Qpn;
///
/// // A Send with Immediate received into work request 7 of QP 0x12.
/// let wc = WorkCompletion {
///     wr_id: 7,
///     opcode: WcOpcode::Recv,
///     byte_len: 64,
///     imm_data: Some(0xbeef),
///     qp_num: Qpn::new(0x12),
///     ..WorkCompletion::default()
/// };
/// assert_eq!(wc.status, WcStatus::Success);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's `wr_id`.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// What it was.
    pub opcode: WcOpcode,
    /// Bytes received (receives) or transferred (RDMA Read).
    pub byte_len: u32,
    /// Immediate data, if the message carried some.
    pub imm_data: Option<u32>,
    /// The local QP.
    pub qp_num: Qpn,
    /// Whether the message had the Solicited Event bit set (receives).
    pub solicited: bool,
    /// The R_Key a received Send with Invalidate invalidated (`IBV_WC_WITH_INV`).
    pub invalidated_rkey: Option<u32>,
}

impl Default for WorkCompletion {
    fn default() -> WorkCompletion {
        WorkCompletion {
            wr_id: 0,
            status: WcStatus::Success,
            opcode: WcOpcode::Send,
            byte_len: 0,
            imm_data: None,
            qp_num: Qpn::new(0),
            solicited: false,
            invalidated_rkey: None,
        }
    }
}

impl WorkCompletion {
    /// Whether the status is [`WcStatus::Success`].
    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::Success
    }
}
