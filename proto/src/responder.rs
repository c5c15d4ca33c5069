//! The RQ Logic's state ([`Responder`]: ePSN, MSN, the message in progress, the responses
//! waiting to leave, the Atomics executed, the Ack owed), its checks of a request (spec/01,
//! spec/02) and what each refusal means: one table.
//!
//! Every check of the receive pipeline fails with a [`RespError`] that names the check and
//! the fault. The checks that need nothing but the packet's headers and the QP's context
//! are here ([`check_state`], [`check_psn`], [`check_opcode_sequence`],
//! [`check_operation_enabled`], [`check_packet_length`]); the driver runs them in the order
//! of the rxe responder (`CHK_PSN → CHK_OP_SEQ → CHK_OP_VALID → CHK_RESOURCE → CHK_LENGTH →
//! CHK_RKEY → EXECUTE`) with its own checks of resources, keys and memory between them. [`verdict`] is the only place that says, for each, what
//! the requester is told (the AETH syndrome of spec/01 Table 17-3 and the Nak codes of
//! Table 17-4), how a receive WQE in use completes, and whether the QP goes to the Error
//! state — the rxe responder's `resp_states` error arms, as Rust types.
//!
//! ```
//! use shmhca_proto::psn::Psn;
//! use shmhca_proto::responder::{Fresh, Reply, RespError, check_psn, verdict};
//! use shmhca_proto::wire::aeth::NakCode;
//!
//! // ePSN 10: PSN 10 is new, 9 a duplicate, 12 means 10 and 11 were lost...
//! assert_eq!(check_psn(Psn::new(10), Psn::new(10), false), Ok(Fresh::New));
//! assert_eq!(check_psn(Psn::new(9), Psn::new(10), false), Ok(Fresh::Duplicate));
//! let lost = check_psn(Psn::new(12), Psn::new(10), false).unwrap_err();
//! // ... which one PSN Sequence Error Nak tells the requester; the QP lives on.
//! let v = verdict(lost);
//! assert_eq!(v.reply, Reply::Nak(NakCode::PsnSequenceError));
//! assert!(!v.fatal);
//! // Once that Nak is out, later packets ahead of ePSN are dropped silently.
//! let again = check_psn(Psn::new(13), Psn::new(10), true).unwrap_err();
//! assert_eq!(again, RespError::PsnAheadNakOutstanding);
//! assert_eq!(verdict(again).reply, Reply::Nothing);
//! ```

mod pipeline;

pub use pipeline::{
    RecvCopyError, Request, ResponderDriver, check_rd_atomic_resources, handle_request,
    recv_completion, refuse,
};

use crate::completion::WcStatus;
use crate::psn::{self, Psn, PsnRegion};
use crate::qp::{AccessFlags, MAX_RD_ATOMIC, QpState};
use crate::wire::Msn;
use crate::wire::aeth::NakCode;
use crate::wire::aeth::Syndrome;
use crate::wire::opcode::{OpClass, OpcodeInfo, Position};
use crate::wqe::{Cursor, RqWqe};
use alloc::collections::VecDeque;
use core::mem::size_of;

/// The positive Ack a QP owes its requester: the last PSN accepted and the MSN then. A
/// request accepted later overwrites it, so one Ack covers every request before it (Ack
/// coalescing); the driver sends it at the end of its iteration, or lets it ride in a
/// request of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwedAck {
    /// The last PSN accepted: the Ack's PSN.
    pub psn: Psn,
    /// The MSN after it.
    pub msn: u32,
}

/// An RDMA Read being answered.
#[derive(Debug, Clone, Copy)]
pub struct ReadJob {
    /// PSN of the first response (the request's PSN).
    pub psn: Psn,
    /// The virtual address read (the request's RETH).
    pub va: u64,
    /// The R_Key it was read through.
    pub rkey: u32,
    /// Bytes to read.
    pub len: u32,
    /// Response packets in all.
    pub npkts: u32,
    /// The next response packet to send.
    pub next: u32,
    /// The MSN its responses carry.
    pub msn: u32,
    /// It answers a duplicate request (it holds no responder resource).
    pub dup: bool,
}

impl ReadJob {
    /// The responses to the RDMA Read at `psn` described by `reth`, `npkts` packets with
    /// MSN `msn`; `dup` if it answers a duplicate request.
    pub fn new(psn: Psn, reth: &crate::wire::RethRepr, npkts: u32, msn: u32, dup: bool) -> ReadJob {
        ReadJob {
            psn,
            va: reth.va,
            rkey: reth.rkey,
            len: reth.dma_len,
            npkts,
            next: 0,
            msn,
            dup,
        }
    }
}

/// A response waiting to leave.
#[derive(Debug, Clone, Copy)]
pub enum Out {
    /// A positive Ack.
    Ack {
        /// The PSN acknowledged.
        psn: Psn,
        /// The MSN.
        msn: u32,
    },
    /// A Nak (sequence error) or RNR Nak.
    Nak {
        /// The PSN.
        psn: Psn,
        /// Its AETH syndrome.
        syndrome: Syndrome,
    },
    /// The Nak of a fatal error (the QP went to Error): sent after everything queued
    /// before it, and nothing after it.
    Fatal {
        /// The PSN refused.
        psn: Psn,
        /// The Nak code.
        code: NakCode,
    },
    /// The responses of an RDMA Read.
    Read(ReadJob),
    /// An Atomic Acknowledge.
    Atomic {
        /// The request's PSN.
        psn: Psn,
        /// The original value of the target.
        orig: u64,
        /// The MSN.
        msn: u32,
        /// It answers a duplicate request (it holds no responder resource).
        dup: bool,
    },
}

/// The message being received.
#[derive(Debug, Clone, Copy)]
pub enum Inbound {
    /// Between messages.
    Idle,
    /// A multi-packet Send.
    Send {
        /// The receive WQE it fills.
        wqe: RqWqe,
        /// Where its next bytes go.
        cursor: Cursor,
        /// Bytes received so far.
        got: u64,
    },
    /// A multi-packet RDMA Write.
    Write {
        /// Where its first packet wrote (the RETH's address).
        va: u64,
        /// The R_Key it writes through.
        rkey: u32,
        /// Bytes written so far.
        done: u64,
        /// Bytes in all (the RETH's DMA length).
        total: u64,
    },
}

/// RQ Logic state of one QP.
#[derive(Debug)]
pub struct Responder {
    /// ePSN.
    pub epsn: Psn,
    /// MSN: the number of the last message completed (24-bit).
    pub msn: u32,
    /// The message being received.
    pub cur: Inbound,
    /// Responses waiting to leave, in PSN order (bounded: see [`Responder::push_out`]).
    pub out: VecDeque<Out>,
    /// Atomics executed: PSN and original value, to answer a duplicate without executing it
    /// twice. The newest at the back.
    pub atomics: VecDeque<(Psn, u64, u32)>,
    /// A Nak (sequence error or RNR) is outstanding for ePSN: later out-of-order packets are
    /// dropped silently until ePSN arrives.
    pub nak_outstanding: bool,
    /// The credit count last reported, if any.
    pub advertised: Option<u32>,
    /// New Reads and Atomics queued, for the responder-resources limit (the answers sent
    /// early still held, [`Responder::early`], included).
    pub rd_atomic_queued: u32,
    /// New Reads and Atomics a receive fast path (the engine's `read_fast`, `atomic_fast`) answered
    /// at once, in the receive step, whose responder resources are still counted: the
    /// pipeline queues their responses and frees the resources when step 3 sends them, so
    /// a request later in the same burst (a requester past its initiator depth) finds them
    /// taken. They are freed ([`Responder::settle`]) once that burst is over: when the
    /// responses are drained (step 3, `drain_queued`), or when a request of a later burst
    /// looks at the resources.
    pub early: u32,
    /// The burst the early answers were sent in: the engine's count of packets received
    /// before it (`Stats::packets_received`, raised at the end of each link's burst, so the
    /// same all through one burst of this QP's link and higher in any later one).
    pub early_burst: u64,
    /// Answers to duplicate Reads and Atomics queued (at most [`MAX_RD_ATOMIC`]): they
    /// re-send what a new request's resource produced, and must not take the resources the
    /// requester may use for new requests.
    pub dup_queued: u32,
    /// An [`Out::Fatal`] is queued: in the Error state the responses ahead of it still
    /// leave (they answer requests accepted before the error).
    pub closing: bool,
    /// The status the receive WQE of the current Send completes with when flushed: the
    /// local error of a fatal error whose completion found the receive CQ full.
    pub cur_status: WcStatus,
    /// The receive WQE a Write with Immediate took in the resources check, until it
    /// executes (or is refused: then it completes in error).
    pub held: Option<RqWqe>,
    /// The positive Ack owed for the requests accepted (the engine's `responder::owed`). Only while
    /// nothing is queued in `out`: a response queued after it carries it or follows it.
    pub owed: Option<OwedAck>,
    /// Whether the SQ Logic has built a request since the last owed Ack that was held
    /// back and left alone: this QP answers what it receives, so an owed Ack is worth
    /// holding back an iteration for a request to ride in (the engine's step 4). A QP that
    /// only receives (a stream's receiver) never holds its Acks back.
    pub replies: bool,
    /// Listed on its link's owed list in an iteration that sends the held list (its Ack
    /// came an iteration after the others): that flush keeps it listed, so that its Ack
    /// too is held back one iteration, not sent at once with theirs.
    pub listed_late: bool,
    /// Acknowledge only the packets that ask (AckReq) and the last packet of each message,
    /// not every First or Middle packet accepted: for links where each Ack is a datagram
    /// of its own (RoCEv2). The requester asks often enough (its last packet of every
    /// message, and within any cap of packets in flight) that it never waits for an Ack
    /// it did not ask for; the Ack of a later packet acknowledges the earlier ones.
    pub acks_when_asked: bool,
}

/// Room for the response queue: every Read/Atomic resource and as many answers to
/// duplicates, plus Acks and a Nak between them. Its bound is enforced, so it never
/// reallocates.
pub const OUT_CAP: usize = 4 * MAX_RD_ATOMIC as usize + 4;

impl Responder {
    /// An RQ Logic with nothing received.
    pub fn new() -> Responder {
        Responder {
            epsn: Psn::new(0),
            msn: 0,
            cur: Inbound::Idle,
            out: VecDeque::with_capacity(OUT_CAP),
            atomics: VecDeque::with_capacity(MAX_RD_ATOMIC as usize),
            nak_outstanding: false,
            advertised: None,
            rd_atomic_queued: 0,
            early: 0,
            early_burst: 0,
            dup_queued: 0,
            closing: false,
            cur_status: WcStatus::WrFlushErr,
            held: None,
            owed: None,
            replies: false,
            listed_late: false,
            acks_when_asked: false,
        }
    }

    /// Bytes of the response queues.
    pub fn memory_bytes(&self) -> usize {
        self.out.capacity() * size_of::<Out>()
            + self.atomics.capacity() * size_of::<(Psn, u64, u32)>()
    }

    /// Programs the RQ Logic on Init → RTR.
    pub fn start(&mut self, epsn: Psn) {
        *self = Responder::new();
        self.epsn = epsn;
    }

    /// Whether responses wait to be sent (not counting an owed Ack: the engine's
    /// `OwedAcks` lists those).
    pub fn has_output(&self) -> bool {
        !self.out.is_empty()
    }

    /// Drops the responses queued and the Ack owed: the peer is gone
    /// (the engine's `requester::on_peer_lost`).
    pub fn drop_output(&mut self) {
        self.out.clear();
        self.rd_atomic_queued = 0;
        self.dup_queued = 0;
        self.closing = false;
        self.owed = None;
    }

    /// The positive Ack owed, if any.
    pub fn owed_ack(&self) -> Option<OwedAck> {
        self.owed
    }

    /// The receive WQE in use: a half-received Send's, or the one a Write with Immediate
    /// took (for completing in error, or flushing).
    pub fn take_current_wqe(&mut self) -> Option<RqWqe> {
        if let Some(wqe) = self.held.take() {
            return Some(wqe);
        }
        match core::mem::replace(&mut self.cur, Inbound::Idle) {
            Inbound::Send { wqe, .. } => Some(wqe),
            other => {
                self.cur = other;
                None
            }
        }
    }

    /// The status to flush the receive WQE of [`Responder::take_current_wqe`] with.
    pub fn current_flush_status(&self) -> WcStatus {
        self.cur_status
    }

    /// Undoes [`Responder::take_current_wqe`] (the CQ was full).
    pub fn put_back_current_wqe(&mut self, wqe: RqWqe) {
        self.cur = Inbound::Send {
            wqe,
            cursor: Cursor::default(),
            got: 0,
        };
    }

    /// Records the positive Ack owed for `psn` (MSN `msn`), replacing the one owed: it
    /// acknowledges every request before it too. Behind a queued response it is queued
    /// instead, so that it does not overtake it.
    pub fn owe(&mut self, psn: Psn, msn: u32) {
        if self.out.is_empty() {
            self.owed = Some(OwedAck { psn, msn });
        } else {
            self.queue(Out::Ack { psn, msn });
        }
    }

    /// Queues a Nak or RNR Nak for `psn`; later out-of-sequence packets are dropped until
    /// ePSN arrives.
    pub fn queue_nak(&mut self, psn: Psn, syndrome: Syndrome) {
        self.queue(Out::Nak { psn, syndrome });
        self.nak_outstanding = true;
    }

    /// Queues response `o`. A new RDMA Read's or Atomic's response acknowledges every
    /// request before it (spec/01: it "implicitly Acks all unAck'd requests issued
    /// before"), with an AETH that reports credits: the owed Ack is dropped. Anything else
    /// — a Nak, which reports no credits, or the answer to a duplicate, whose PSN is older
    /// — leaves after the owed Ack, which is queued first.
    pub fn queue(&mut self, o: Out) {
        match o {
            Out::Read(ReadJob { dup: false, .. }) | Out::Atomic { dup: false, .. } => {
                self.owed = None;
            }
            _ => {
                if let Some(a) = self.owed.take() {
                    self.push_out(Out::Ack {
                        psn: a.psn,
                        msn: a.msn,
                    });
                }
            }
        }
        self.push_out(o);
    }

    /// Appends `o` to the response queue: an Ack behind an Ack replaces it; Acks and
    /// Naks are dropped past the room kept for what cannot be dropped.
    pub fn push_out(&mut self, o: Out) {
        if let (Out::Ack { psn, msn }, Some(Out::Ack { psn: p, msn: m })) = (o, self.out.back_mut())
        {
            *p = psn;
            *m = msn;
            return;
        }
        // Acks and Naks (other than the fatal one) are bounded by nothing the requester
        // promised: a requester that does not read its ring while it repeats a request
        // that is RNR Nak'd again each time (or alternates it with accepted ones) would
        // queue them without end. Past the room kept for a Read or Atomic response per
        // responder resource, per answer to a duplicate Read or Atomic, and a fatal Nak they
        // are dropped, as a lossy link would; the requester's retransmission recovers
        // (spec/02). (Both counts are raised before their entry is queued, so the room
        // kept always covers every entry that cannot be dropped.)
        let droppable = matches!(o, Out::Ack { .. } | Out::Nak { .. });
        let reserved = usize::from(MAX_RD_ATOMIC).saturating_sub(self.rd_atomic_queued as usize)
            + usize::from(MAX_RD_ATOMIC).saturating_sub(self.dup_queued as usize)
            + 1;
        if droppable && self.out.len() + reserved >= OUT_CAP {
            return;
        }
        debug_assert!(self.out.len() < OUT_CAP, "response queue bound");
        if self.out.len() < OUT_CAP {
            self.out.push_back(o);
        }
    }

    /// Queues the Nak of a fatal error, the last response of this QP.
    pub fn queue_fatal(&mut self, psn: Psn, code: NakCode) {
        self.queue(Out::Fatal { psn, code });
        self.closing = true;
    }

    /// Records a new Read's or Atomic's answer sent by a receive fast path in the burst
    /// `burst` ([`Responder::early`]): what [`Responder::queue`] records for its response —
    /// the resource taken, the owed Ack dropped (the answer acknowledges every request
    /// before it).
    pub fn answered(&mut self, burst: u64) {
        debug_assert!(self.early == 0 || self.early_burst == burst);
        self.rd_atomic_queued += 1;
        self.early += 1;
        self.early_burst = burst;
        self.owed = None;
    }

    /// Frees the resources of the early answers if they were sent in a burst before
    /// `burst` (the one being received): the pipeline would have sent their responses at
    /// the end of that one.
    #[inline]
    pub fn settle(&mut self, burst: u64) {
        if self.early > 0 && self.early_burst != burst {
            self.settle_all();
        }
    }

    /// Frees the resources of the early answers (no burst is being received: the
    /// pipeline's responses would have been sent by now).
    #[inline]
    pub fn settle_all(&mut self) {
        self.rd_atomic_queued -= self.early;
        self.early = 0;
        self.early_burst = 0;
    }

    /// A Read's or Atomic's answer left: its resource (or its duplicate's slot) is free.
    pub fn release_rd_atomic(&mut self, dup: bool) {
        if dup {
            self.dup_queued -= 1;
        } else {
            self.rd_atomic_queued -= 1;
        }
    }

    /// The MSN after one more message completed (24 bits, wrapping).
    pub fn next_msn(&mut self) -> u32 {
        self.msn = (self.msn + 1) & Msn::MASK;
        self.msn
    }
}

impl Default for Responder {
    fn default() -> Responder {
        Responder::new()
    }
}

/// The check of the receive pipeline that failed, in the order the checks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// The QP is not in a state that receives (before RTR, Error, Reset).
    State,
    /// The PSN against ePSN.
    Psn,
    /// The opcode against the message in progress.
    OpcodeSequence,
    /// The operation against the QP's remote access enables.
    OperationEnabled,
    /// A receive WQE, room in the receive CQ, a responder resource.
    Resources,
    /// Payload length and the extended headers the opcode calls for.
    Length,
    /// R_Key, protection domain, access rights and bounds.
    RKey,
    /// Carrying the request out.
    Execute,
}

/// A request the RQ Logic refuses: the check that failed and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RespError {
    /// The QP does not receive in its current state: the packet is dropped.
    NotReceiving,
    /// The PSN is ahead of ePSN: packets were lost (spec/04, "a PSN Sequence Error Nak is
    /// returned").
    PsnAhead,
    /// The PSN is ahead of ePSN while a Nak for ePSN is outstanding: the requester already
    /// knows and will resend from ePSN, so the packet is dropped without a second Nak.
    PsnAheadNakOutstanding,
    /// A Middle or Last packet outside a message of its kind, or a First or Only packet
    /// inside one.
    OpcodeOutOfSequence,
    /// An RDMA Write, Read or Atomic the QP's access flags do not enable.
    OperationNotEnabled,
    /// A Send or RDMA Write with Immediate and no receive WQE posted (spec/02: "it results
    /// in the return of an RNR Nak").
    NoReceiveWqe,
    /// A message that completes a receive WQE while the receive CQ has no room: the receive
    /// is not ready either.
    ReceiveCqFull,
    /// More RDMA Reads and Atomics outstanding than the responder resources the requester
    /// was given.
    TooManyReadAtomic,
    /// A First or Middle packet not exactly one PMTU long, a Last packet empty or longer
    /// than a PMTU, an Only packet longer than a PMTU, or a Write whose packets do not add
    /// up to its RETH's DMA length.
    BadLength,
    /// The RETH, AtomicETH or IETH the opcode calls for is missing.
    MissingHeader,
    /// An Atomic on an address that is not a multiple of 8.
    MisalignedAtomic,
    /// The R_Key names no region or window of this QP's protection domain that allows the
    /// access over the whole range.
    RKeyViolation,
    /// A Send with Invalidate names a key this QP may not invalidate.
    InvalidateRefused,
    /// A Send longer than its receive WQE's scatter list.
    ReceiveTooShort,
    /// The payload could not be copied (the peer's payload reference is out of bounds, or
    /// the destination is unusable).
    CopyFailed,
    /// The Atomic could not be carried out on the target word.
    AtomicFailed,
    /// An RDMA Read's region went away while its responses were being generated.
    ReadSourceGone,
}

/// What the requester is told about a refused request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// Nothing: the packet is dropped.
    Nothing,
    /// A Nak with this code (spec/01 Table 17-4).
    Nak(NakCode),
    /// An RNR Nak with the QP's minimum RNR timer (spec/01 Table 17-3, syndrome 001TTTTT).
    RnrNak,
}

/// What a [`RespError`] means: one row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// The check that failed.
    pub check: Check,
    /// The AETH syndrome sent back.
    pub reply: Reply,
    /// The status a receive WQE in use (a Send's, or one taken for an RDMA Write with
    /// Immediate) completes with; `None` for refusals that leave it in place to be used by
    /// the retried packet.
    pub recv_status: Option<WcStatus>,
    /// Whether the QP goes to the Error state (its Nak is the last packet it sends).
    pub fatal: bool,
    /// Whether the packet is counted as dropped (not answered as a request at all, or
    /// answered only with a sequence Nak).
    pub dropped: bool,
}

impl RespError {
    /// Every error, in the order of the checks that raise them (tests walk the table).
    pub const ALL: [RespError; 17] = [
        RespError::NotReceiving,
        RespError::PsnAhead,
        RespError::PsnAheadNakOutstanding,
        RespError::OpcodeOutOfSequence,
        RespError::OperationNotEnabled,
        RespError::NoReceiveWqe,
        RespError::ReceiveCqFull,
        RespError::TooManyReadAtomic,
        RespError::BadLength,
        RespError::MissingHeader,
        RespError::MisalignedAtomic,
        RespError::RKeyViolation,
        RespError::InvalidateRefused,
        RespError::ReceiveTooShort,
        RespError::CopyFailed,
        RespError::AtomicFailed,
        RespError::ReadSourceGone,
    ];
}

/// The table: what each refusal sends, how the receive WQE in use completes, whether the
/// QP is lost.
///
/// Sequence errors and "not ready" are recoverable: the requester resends (from ePSN, or
/// the same packet after the RNR timer) and nothing was done. Every other refusal is a
/// request the requester should never have sent: Invalid Request, Remote Access Error or
/// Remote Operational Error, the QP goes to the Error state (the requester's completes the
/// request in error and goes there too), and a receive WQE in use completes with a local
/// error so local software learns of it as well.
pub const fn verdict(e: RespError) -> Verdict {
    use Check as C;
    use NakCode::{InvalidRequest, PsnSequenceError, RemoteAccessError, RemoteOperationalError};
    use WcStatus::{LocLenErr, LocProtErr, LocQpOpErr};
    const fn fatal(check: Check, code: NakCode, status: WcStatus) -> Verdict {
        Verdict {
            check,
            reply: Reply::Nak(code),
            recv_status: Some(status),
            fatal: true,
            dropped: false,
        }
    }
    const fn retry(check: Check, reply: Reply, dropped: bool) -> Verdict {
        Verdict {
            check,
            reply,
            recv_status: None,
            fatal: false,
            dropped,
        }
    }
    match e {
        RespError::NotReceiving => retry(C::State, Reply::Nothing, true),
        RespError::PsnAhead => retry(C::Psn, Reply::Nak(PsnSequenceError), true),
        RespError::PsnAheadNakOutstanding => retry(C::Psn, Reply::Nothing, true),
        RespError::OpcodeOutOfSequence => fatal(C::OpcodeSequence, InvalidRequest, LocQpOpErr),
        RespError::OperationNotEnabled => fatal(C::OperationEnabled, InvalidRequest, LocQpOpErr),
        RespError::NoReceiveWqe | RespError::ReceiveCqFull => {
            retry(C::Resources, Reply::RnrNak, false)
        }
        RespError::TooManyReadAtomic => fatal(C::Resources, InvalidRequest, LocQpOpErr),
        RespError::BadLength | RespError::MissingHeader | RespError::MisalignedAtomic => {
            fatal(C::Length, InvalidRequest, LocQpOpErr)
        }
        RespError::RKeyViolation => fatal(C::RKey, RemoteAccessError, LocQpOpErr),
        RespError::InvalidateRefused => fatal(C::RKey, InvalidRequest, LocProtErr),
        RespError::ReceiveTooShort => fatal(C::Execute, InvalidRequest, LocLenErr),
        RespError::CopyFailed => fatal(C::Execute, InvalidRequest, LocQpOpErr),
        RespError::AtomicFailed => fatal(C::Execute, RemoteOperationalError, LocQpOpErr),
        RespError::ReadSourceGone => fatal(C::Execute, RemoteAccessError, LocQpOpErr),
    }
}

/// Whether a request that passed the PSN check is new or a duplicate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fresh {
    /// PSN = ePSN: executed.
    New,
    /// Before ePSN: answered again, not executed again.
    Duplicate,
}

/// The QP receives only from RTR on, and not in the Error state.
#[inline]
pub fn check_state(state: QpState) -> Result<(), RespError> {
    if state.receives() {
        Ok(())
    } else {
        Err(RespError::NotReceiving)
    }
}

/// Check 1, PSN against ePSN ([`psn::classify`]); `nak_outstanding`: a sequence error or
/// RNR Nak for ePSN is outstanding (later packets ahead of it are then dropped silently).
/// A new request ([`Fresh::New`]) ends the Nak's wait: the caller clears its flag.
#[inline]
pub fn check_psn(psn: Psn, epsn: Psn, nak_outstanding: bool) -> Result<Fresh, RespError> {
    match psn::classify(psn, epsn) {
        PsnRegion::Valid => Ok(Fresh::New),
        PsnRegion::Duplicate => Ok(Fresh::Duplicate),
        PsnRegion::Invalid if nak_outstanding => Err(RespError::PsnAheadNakOutstanding),
        PsnRegion::Invalid => Err(RespError::PsnAhead),
    }
}

/// Check 2, Opcode sequence: Middle and Last continue a message of their kind; First and
/// Only start one. `in_message`: the class of the message in progress (a Send or an RDMA
/// Write), `None` between messages.
#[inline]
pub fn check_opcode_sequence(
    in_message: Option<OpClass>,
    info: &OpcodeInfo,
) -> Result<(), RespError> {
    let continuing = matches!(info.position, Position::Middle | Position::Last);
    let ok = match (in_message, info.class) {
        (Some(OpClass::Send), OpClass::Send) | (Some(OpClass::RdmaWrite), OpClass::RdmaWrite) => {
            continuing
        }
        (None, _) => !continuing,
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(RespError::OpcodeOutOfSequence)
    }
}

/// Check 3, Operation enabled: RDMA Write, Read and Atomic need the QP's remote access
/// enables (`access`).
#[inline]
pub fn check_operation_enabled(access: AccessFlags, class: OpClass) -> Result<(), RespError> {
    let need = match class {
        OpClass::RdmaWrite => Some(AccessFlags::REMOTE_WRITE),
        OpClass::RdmaReadRequest => Some(AccessFlags::REMOTE_READ),
        OpClass::CompareSwap | OpClass::FetchAdd => Some(AccessFlags::REMOTE_ATOMIC),
        _ => None,
    };
    if need.is_some_and(|n| !access.contains(n)) {
        Err(RespError::OperationNotEnabled)
    } else {
        Ok(())
    }
}

/// Check 5, Length: whether a packet at `position` may carry `len` payload bytes with this
/// PMTU (First and Middle exactly a PMTU, Last one byte to a PMTU, Only at most a PMTU).
#[inline]
pub fn check_packet_length(position: Position, len: u32, pmtu: u32) -> Result<(), RespError> {
    let ok = match position {
        Position::First | Position::Middle => len == pmtu,
        Position::Last => (1..=pmtu).contains(&len),
        Position::Only => len <= pmtu,
    };
    if ok {
        Ok(())
    } else {
        Err(RespError::BadLength)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::wire::opcode::Opcode;

    fn row(e: RespError) -> (Reply, Option<WcStatus>, bool) {
        let v = verdict(e);
        (v.reply, v.recv_status, v.fatal)
    }

    /// spec/01 ("Request Packet PSN Verification"), spec/04 (a PSN ahead of ePSN means
    /// lost packets: "a PSN Sequence Error Nak is returned", Table 17-4 code 00000), spec/03
    /// (the Retry Count covers that Nak: the requester resends, the QP lives on).
    #[test]
    fn a_psn_ahead_gets_one_sequence_nak_and_the_qp_lives_on() {
        assert_eq!(
            row(RespError::PsnAhead),
            (Reply::Nak(NakCode::PsnSequenceError), None, false)
        );
        assert_eq!(
            row(RespError::PsnAheadNakOutstanding),
            (Reply::Nothing, None, false)
        );
        assert!(verdict(RespError::PsnAhead).dropped);
        assert_eq!(row(RespError::NotReceiving), (Reply::Nothing, None, false));
    }

    /// spec/02: a Send or RDMA Write with Immediate with no receive WQE posted "results in
    /// the return of an RNR Nak" and a retransmission; spec/03 (RNR Retry Count): the
    /// responder is "temporarily unable to handle that request" — not an error.
    #[test]
    fn no_receive_wqe_is_an_rnr_nak_and_the_receive_stays() {
        for e in [RespError::NoReceiveWqe, RespError::ReceiveCqFull] {
            assert_eq!(row(e), (Reply::RnrNak, None, false), "{e:?}");
            assert!(!verdict(e).dropped);
        }
    }

    /// spec/01 Table 17-4: Invalid Request (00001) for requests the responder cannot make
    /// sense of — out of sequence, not enabled, beyond the responder resources, a bad
    /// length or missing header; the QP is lost and a receive in use completes with a local
    /// error (a receive too short for its Send: a local length error).
    #[test]
    fn malformed_requests_are_invalid_requests_and_fatal() {
        for e in [
            RespError::OpcodeOutOfSequence,
            RespError::OperationNotEnabled,
            RespError::TooManyReadAtomic,
            RespError::BadLength,
            RespError::MissingHeader,
            RespError::MisalignedAtomic,
            RespError::CopyFailed,
        ] {
            assert_eq!(
                row(e),
                (
                    Reply::Nak(NakCode::InvalidRequest),
                    Some(WcStatus::LocQpOpErr),
                    true
                ),
                "{e:?}"
            );
        }
        assert_eq!(
            row(RespError::ReceiveTooShort),
            (
                Reply::Nak(NakCode::InvalidRequest),
                Some(WcStatus::LocLenErr),
                true
            )
        );
        assert_eq!(
            row(RespError::InvalidateRefused),
            (
                Reply::Nak(NakCode::InvalidRequest),
                Some(WcStatus::LocProtErr),
                true
            )
        );
    }

    /// spec/01 Table 17-4: Remote Access Error (00010) for an R_Key, domain, rights or
    /// bounds violation (the R_Key "required to gain access to the region or window"),
    /// also when a Read's region goes while it is answered; Remote Operational Error
    /// (00011) when the responder fails to carry out a valid Atomic.
    #[test]
    fn access_and_operational_errors_are_fatal_with_their_codes() {
        for e in [RespError::RKeyViolation, RespError::ReadSourceGone] {
            assert_eq!(
                row(e),
                (
                    Reply::Nak(NakCode::RemoteAccessError),
                    Some(WcStatus::LocQpOpErr),
                    true
                )
            );
        }
        assert_eq!(
            row(RespError::AtomicFailed),
            (
                Reply::Nak(NakCode::RemoteOperationalError),
                Some(WcStatus::LocQpOpErr),
                true
            )
        );
    }

    /// The table's invariants: a fatal refusal always answers with a Nak and completes a
    /// receive in use; a recoverable one never completes it (the retried packet uses it).
    #[test]
    fn fatal_refusals_complete_the_receive_and_recoverable_ones_keep_it() {
        for e in RespError::ALL {
            let v = verdict(e);
            assert_eq!(v.fatal, v.recv_status.is_some(), "{e:?}");
            if v.fatal {
                assert!(matches!(v.reply, Reply::Nak(c) if c != NakCode::PsnSequenceError));
                assert!(!v.dropped);
            }
        }
    }

    /// Each error belongs to the check that raises it, in the pipeline's order.
    #[test]
    fn each_error_names_its_check() {
        let checks: Vec<Check> = RespError::ALL.iter().map(|&e| verdict(e).check).collect();
        assert_eq!(
            checks,
            [
                Check::State,
                Check::Psn,
                Check::Psn,
                Check::OpcodeSequence,
                Check::OperationEnabled,
                Check::Resources,
                Check::Resources,
                Check::Resources,
                Check::Length,
                Check::Length,
                Check::Length,
                Check::RKey,
                Check::RKey,
                Check::Execute,
                Check::Execute,
                Check::Execute,
                Check::Execute,
            ]
        );
    }

    /// spec/02 "Obey the Ordering Rules": a message's packets arrive First, Middle…, Last
    /// (or Only), and none of another kind in between.
    #[test]
    fn opcode_sequence() {
        let info = |op: Opcode| op.info().expect("an RC opcode");
        let send = Some(OpClass::Send);
        assert!(check_opcode_sequence(None, info(Opcode::SendFirst)).is_ok());
        assert!(check_opcode_sequence(None, info(Opcode::SendMiddle)).is_err());
        assert!(check_opcode_sequence(send, info(Opcode::SendMiddle)).is_ok());
        assert!(check_opcode_sequence(send, info(Opcode::SendLast)).is_ok());
        assert!(check_opcode_sequence(send, info(Opcode::SendOnly)).is_err());
        assert!(check_opcode_sequence(send, info(Opcode::RdmaWriteLast)).is_err());
        assert!(check_opcode_sequence(send, info(Opcode::RdmaReadRequest)).is_err());
        let write = Some(OpClass::RdmaWrite);
        assert!(check_opcode_sequence(write, info(Opcode::RdmaWriteMiddle)).is_ok());
        assert!(check_opcode_sequence(write, info(Opcode::SendLast)).is_err());
        assert!(check_opcode_sequence(None, info(Opcode::FetchAdd)).is_ok());
    }

    /// spec/01: RDMA Write, Read and Atomic need their remote access enable; a Send needs
    /// none.
    #[test]
    fn operations_need_their_enables() {
        let none = AccessFlags::NONE;
        assert!(check_operation_enabled(none, OpClass::Send).is_ok());
        for (class, flag) in [
            (OpClass::RdmaWrite, AccessFlags::REMOTE_WRITE),
            (OpClass::RdmaReadRequest, AccessFlags::REMOTE_READ),
            (OpClass::CompareSwap, AccessFlags::REMOTE_ATOMIC),
            (OpClass::FetchAdd, AccessFlags::REMOTE_ATOMIC),
        ] {
            assert_eq!(
                check_operation_enabled(none, class),
                Err(RespError::OperationNotEnabled)
            );
            assert!(
                check_operation_enabled(
                    AccessFlags::from_bits(AccessFlags::ALL.bits() & !flag.bits()).unwrap(),
                    class
                )
                .is_err()
            );
            assert!(check_operation_enabled(flag, class).is_ok());
        }
    }

    /// spec/04 "Maximum Data Payload Size": First and Middle carry exactly a PMTU, Last one
    /// byte up to a PMTU, Only up to a PMTU (zero included).
    #[test]
    fn packet_lengths() {
        use Position::*;
        for (position, len, ok) in [
            (First, 256, true),
            (First, 255, false),
            (Middle, 256, true),
            (Middle, 257, false),
            (Last, 1, true),
            (Last, 256, true),
            (Last, 0, false),
            (Last, 257, false),
            (Only, 0, true),
            (Only, 256, true),
            (Only, 257, false),
        ] {
            assert_eq!(
                check_packet_length(position, len, 256).is_ok(),
                ok,
                "{position:?} {len}"
            );
        }
    }

    /// Only RTR, RTS, SQD and SQE receive.
    #[test]
    fn states_that_receive() {
        for (state, ok) in [
            (QpState::Reset, false),
            (QpState::Init, false),
            (QpState::Rtr, true),
            (QpState::Rts, true),
            (QpState::Sqd, true),
            (QpState::Sqe, true),
            (QpState::Error, false),
        ] {
            assert_eq!(check_state(state).is_ok(), ok, "{state:?}");
        }
    }
}
