//! The completer's checks: the SQ Logic's validation of each response (spec/01 "SQ Logic
//! Validation of Each Response", the rxe completer's checks), as a pure function from a
//! response and the [`Requester`] to an [`Outcome`].
//!
//! Each response is checked in turn:
//!
//! 1. **State.** RTS, SQD and SQE take responses; in RTR only an Ack's initial credits are
//!    kept.
//! 2. **PSN.** At or before the last acknowledged PSN it is a duplicate (or an unsolicited
//!    Ack, spec/02): only its credits are kept. At or after the first PSN not sent yet (nPSN,
//!    or before it the rest of a Send waiting for credit) it answers nothing sent: dropped.
//! 3. **Implicit acknowledgement.** A response for PSN p acknowledges every request before
//!    p, so Sends and RDMA Writes that end before p complete. An RDMA Read or Atomic that
//!    ends before p cannot be acknowledged that way — its data is missing — so the response
//!    is taken as an implied Nak and the read is requested again.
//! 4. **Opcode and sequence.** Acks, RNR Naks and Naks; RDMA Read responses must arrive
//!    First, Middle…, Last (or Only) with the expected PSN and exactly the expected
//!    payload; an Atomic Acknowledge must answer an Atomic.
//!
//! What each outcome does — writing Read data and the Atomic's original value into the
//! WQE's scatter list, completions, the Error state — is the driver's (the engine's `act`,
//! one table from outcome to action); the checks have one effect of their own: the
//! implicit acknowledgement completes the Sends and Writes before the response's PSN
//! ([`Requester::ack_before`]), before its own outcome is known.
//!
//! ```
//! use shmhca_proto::completer::{Outcome, Response, check_response};
//! use shmhca_proto::psn::Psn;
//! use shmhca_proto::qp::{QpConfig, QpState};
//! use shmhca_proto::requester::Requester;
//! use shmhca_proto::wire::aeth::{AethRepr, CreditCode, NakCode, Syndrome};
//! use shmhca_proto::wire::opcode::{OpClass, Position};
//! use shmhca_proto::wire::Msn;
//!
//! let cfg = QpConfig { sq_psn: Psn::new(7), ..QpConfig::default() };
//! let mut req = Requester::new(4);
//! req.start(&cfg, core::time::Duration::from_nanos(1));
//! // Nothing was sent: an Ack of PSN 7 answers nothing.
//! let ack = |psn, syndrome| Response {
//!     class: OpClass::Acknowledge,
//!     position: Position::Only,
//!     psn: Psn::new(psn),
//!     aeth: Some(AethRepr { syndrome, msn: Msn::new(1) }),
//!     atomic_orig: None,
//!     payload_len: 0,
//!     has_payload: false,
//! };
//! let ok = Syndrome::Ack { credits: CreditCode::new(31) };
//! assert_eq!(check_response(QpState::Rts, &mut req, &cfg, &ack(7, ok)), Outcome::Dropped);
//! // In RTR, an Ack's credits are kept for RTS.
//! assert!(matches!(
//!     check_response(QpState::Rtr, &mut req, &cfg, &ack(7, ok)),
//!     Outcome::EarlyCredits(..)
//! ));
//! # let _ = NakCode::InvalidRequest;
//! ```

mod act;
mod retire;

pub use act::{CompleterDriver, Counted, Exhausted, NotCopied, act, bad_response};
pub use retire::{SendCompletions, can_retire, retire, wc_opcode};

use crate::completion::WcStatus;
use crate::psn::Psn;
use crate::qp::{QpConfig, QpState};
use crate::requester::Requester;
use crate::send_window::SendWqe;
use crate::wire::aeth::{AethRepr, CreditCode, NakCode, RnrTimer, Syndrome};
use crate::wire::opcode::{OpClass, Position};
use crate::wqe::WqeOp;

/// What the completer's checks need of a response packet: its headers, parsed and
/// bounds-checked by the link that received it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Response {
    /// Its opcode's class (an Acknowledge, an RDMA Read response, an Atomic Acknowledge;
    /// anything else is not a response).
    pub class: OpClass,
    /// Its opcode's position in a message.
    pub position: Position,
    /// Its PSN.
    pub psn: Psn,
    /// Its AETH, if it has one.
    pub aeth: Option<AethRepr>,
    /// The original value of its AtomicAckETH, if it has one.
    pub atomic_orig: Option<u64>,
    /// Bytes of payload it carries.
    pub payload_len: u32,
    /// Whether it carries a payload at all (a zero-length one counts).
    pub has_payload: bool,
}

/// What a response turned out to be, once checked ([`check_response`]): the driver maps
/// each to its action in one table (the rxe completer's `comp_state`s, as values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// In RTR: the peer's initial credits (spec/02 "Providing Initial Credits"), kept for
    /// RTS ([`Requester::keep_early_credits`]).
    EarlyCredits(CreditCode, u32),
    /// Nothing to do but count it dropped: the QP takes no responses in its state, the
    /// response answers nothing in flight, or it is a duplicate (no credits in it).
    Dropped,
    /// A duplicate or unsolicited Ack: only its credits are kept (spec/02).
    Credits(CreditCode, u32),
    /// The responses from this PSN on were lost (an RDMA Read or Atomic before the
    /// response, or a plain Ack inside one's PSNs): an implied Nak.
    ImpliedNak(Psn),
    /// A positive Ack of WQE `seq` at PSN `psn`.
    Ack {
        /// The WQE.
        seq: u64,
        /// The PSN acknowledged.
        psn: Psn,
        /// The credits it announces.
        credits: CreditCode,
        /// Its MSN.
        msn: u32,
    },
    /// An RNR Nak for WQE `seq` at PSN `psn`.
    RnrNak {
        /// The WQE.
        seq: u64,
        /// The PSN refused.
        psn: Psn,
        /// How long to wait.
        timer: RnrTimer,
    },
    /// A PSN Sequence Error Nak: everything before `psn` arrived, resend from it.
    SequenceError {
        /// The PSN the responder expects.
        psn: Psn,
    },
    /// A Nak that fails WQE `seq` with `status` and the QP.
    FatalNak {
        /// The WQE.
        seq: u64,
        /// The PSN refused.
        psn: Psn,
        /// The completion status it maps to.
        status: WcStatus,
    },
    /// The next RDMA Read response of WQE `seq`, `offset` bytes into its data; `last` if
    /// it ends the Read.
    ReadResponse {
        /// The WQE.
        seq: u64,
        /// The response's PSN.
        psn: Psn,
        /// Where its bytes go in the WQE's data.
        offset: u32,
        /// Whether it is the Read's last response.
        last: bool,
    },
    /// The Atomic Acknowledge of WQE `seq`, with the target's original value.
    AtomicAck {
        /// The WQE.
        seq: u64,
        /// The response's PSN.
        psn: Psn,
        /// The original value.
        orig: u64,
    },
    /// Malformed, or not what WQE `seq` expects: it fails with a bad-response error and
    /// the QP goes to the Error state.
    Bad(u64),
    /// Bad, but found while the QP's work goes on: the WQEs done are still retired after.
    BadThenRetire(u64),
    /// A request opcode (a driver dispatches by opcode: it never gets here), dropped; the
    /// WQEs done are retired.
    NotAResponse,
}

/// Checks a response to a QP in `state` whose SQ Logic is `req` and whose context is
/// `cfg`: the steps of the module documentation, in order; the first that decides gives
/// the outcome. Its one effect: the Sends and Writes before the response's PSN complete
/// (step 3).
pub fn check_response(
    state: QpState,
    req: &mut Requester,
    cfg: &QpConfig,
    r: &Response,
) -> Outcome {
    check(state, req, cfg, r).unwrap_or_else(|early| early)
}

/// [`check_response`]'s steps, each ending the pipeline with `Err` when it decides.
fn check(
    state: QpState,
    req: &mut Requester,
    cfg: &QpConfig,
    r: &Response,
) -> Result<Outcome, Outcome> {
    check_state(state, r)?;
    let psn = check_psn(req, r)?;
    let seq = check_implicit_ack(req, psn)?;
    let w = *req.wqe(seq);
    Ok(match r.class {
        OpClass::Acknowledge => check_ack(&w, seq, psn, r.aeth),
        OpClass::RdmaReadResponse => check_read_response(cfg, &w, seq, psn, r),
        OpClass::AtomicAcknowledge => check_atomic_ack(&w, seq, psn, r),
        _ => Outcome::NotAResponse,
    })
}

/// Step 1: whether the QP's state takes responses: RTS, SQD and SQE do; in RTR only an
/// Ack's initial credits are kept.
fn check_state(state: QpState, r: &Response) -> Result<(), Outcome> {
    if state == QpState::Rtr {
        if let (
            OpClass::Acknowledge,
            Some(AethRepr {
                syndrome: Syndrome::Ack { credits },
                msn,
            }),
        ) = (r.class, r.aeth)
        {
            return Err(Outcome::EarlyCredits(credits, msn.get()));
        }
    }
    if !matches!(state, QpState::Rts | QpState::Sqd | QpState::Sqe) {
        return Err(Outcome::Dropped);
    }
    Ok(())
}

/// Step 2: the PSN answers something in flight — after the last acknowledged PSN and
/// before the first one not sent (behind nPSN is not enough: a Send waiting for credit
/// after its first packet holds PSNs up to nPSN that were never sent).
fn check_psn(req: &Requester, r: &Response) -> Result<Psn, Outcome> {
    let psn = r.psn;
    let window = req.window();
    if psn.diff(window.acked()) <= 0 {
        return Err(match r.aeth {
            Some(AethRepr {
                syndrome: Syndrome::Ack { credits },
                msn,
            }) if r.class == OpClass::Acknowledge => Outcome::Credits(credits, msn.get()),
            _ => Outcome::Dropped,
        });
    }
    if psn.diff(window.sent_to()) >= 0 {
        return Err(Outcome::Dropped);
    }
    Ok(psn)
}

/// Step 3: the response acknowledges every request before `psn` (the Sends and Writes that
/// end before it complete here); an RDMA Read or Atomic before it lost its response.
/// Returns the WQE the response is for.
fn check_implicit_ack(req: &mut Requester, psn: Psn) -> Result<u64, Outcome> {
    req.ack_before(psn).map_err(Outcome::ImpliedNak)?;
    req.window().find(psn).ok_or(Outcome::Dropped)
}

/// Step 4 for an Acknowledge of WQE `w`: its syndrome decides.
fn check_ack(w: &SendWqe, seq: u64, psn: Psn, aeth: Option<AethRepr>) -> Outcome {
    let Some(aeth) = aeth else {
        return Outcome::Bad(seq);
    };
    match aeth.syndrome {
        // A plain Ack inside a Read's or Atomic's PSNs: its responses were lost (spec/04
        // "Ack Timeout and Missing Packet(s) Retry Counter").
        Syndrome::Ack { .. } if w.wqe.op.is_rd_atomic() => {
            Outcome::ImpliedNak(w.missing_response())
        }
        Syndrome::Ack { credits } => Outcome::Ack {
            seq,
            psn,
            credits,
            msn: aeth.msn.get(),
        },
        Syndrome::RnrNak { timer } => Outcome::RnrNak { seq, psn, timer },
        Syndrome::Nak(NakCode::PsnSequenceError) => Outcome::SequenceError { psn },
        Syndrome::Nak(code) => Outcome::FatalNak {
            seq,
            psn,
            status: match code {
                NakCode::InvalidRequest => WcStatus::RemInvReqErr,
                NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                NakCode::RemoteOperationalError => WcStatus::RemOpErr,
                _ => WcStatus::BadRespErr,
            },
        },
        Syndrome::Reserved(_) => Outcome::BadThenRetire(seq),
    }
}

/// Step 4 for an RDMA Read response: for a Read, the next response expected (a later one
/// is an implied Nak, an earlier one a duplicate), at the right position (a Read requested
/// again from response `resp_seen` on is answered as a new Read: First or Only there),
/// with exactly the bytes expected and, if any, a positive AETH.
fn check_read_response(cfg: &QpConfig, w: &SendWqe, seq: u64, psn: Psn, r: &Response) -> Outcome {
    if w.wqe.op != WqeOp::Read {
        return Outcome::Bad(seq);
    }
    let expected = w.missing_response();
    if psn != expected {
        return if psn.after(expected) {
            Outcome::ImpliedNak(expected)
        } else {
            Outcome::Dropped // a duplicate response
        };
    }
    let pmtu = cfg.path_mtu.bytes();
    let last = w.resp_seen + 1 == w.span;
    let position_ok = match r.position {
        Position::Only => last,
        Position::First => !last,
        Position::Middle => w.resp_seen > 0 && !last,
        Position::Last => w.resp_seen > 0 && last,
    };
    let offset = w.resp_seen * pmtu;
    let want = (w.wqe.len - offset).min(pmtu);
    let aeth_ok = r
        .aeth
        .is_none_or(|a| matches!(a.syndrome, Syndrome::Ack { .. }));
    if !position_ok || r.payload_len != want || !aeth_ok {
        return Outcome::Bad(seq);
    }
    Outcome::ReadResponse {
        seq,
        psn,
        offset,
        last,
    }
}

/// Step 4 for an Atomic Acknowledge: it answers an Atomic, at its PSN, with a positive
/// AETH, the original value and no payload.
fn check_atomic_ack(w: &SendWqe, seq: u64, psn: Psn, r: &Response) -> Outcome {
    let ok_aeth = matches!(r.aeth.map(|a| a.syndrome), Some(Syndrome::Ack { .. }));
    let Some(orig) = r.atomic_orig else {
        return Outcome::Bad(seq);
    };
    if !w.wqe.op.is_atomic() || psn != w.first_psn || !ok_aeth || r.has_payload {
        return Outcome::Bad(seq);
    }
    Outcome::AtomicAck { seq, psn, orig }
}

#[cfg(test)]
mod review5_tests;
#[cfg(test)]
mod tests;
