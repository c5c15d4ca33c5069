//! What each checked response does ([`act`]: the one table from [`Outcome`] to action, the
//! rxe completer's `comp_state`s as values), over a [`CompleterDriver`] that owns what the
//! core does not: the memory a Read's data and an Atomic's original value land in, the
//! Error state's side effects, and the counters.

use crate::completion::WcStatus;
use crate::psn::Psn;
use crate::qp::Qp;
use crate::wire::aeth::{AethRepr, Syndrome};

use super::{Outcome, Response};

/// The retry counter that ran out (the driver says so to the application, e.g. in words
/// in the QP's last error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exhausted {
    /// The Retry Count, spent by transport timeouts (and any resends before them).
    Timer,
    /// The Retry Count, spent by resends after PSN Sequence Error Naks or lost responses.
    Resent,
    /// The RNR Retry Count.
    Rnr,
}

/// A counter [`act`] moves (the driver keeps its statistics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// A response dropped: a duplicate, one answering nothing in flight, one the QP's
    /// state takes none of, a loss already being resent.
    Dropped,
    /// A Nak received (sequence error or fatal).
    Nak,
    /// An RNR Nak received.
    RnrNak,
}

/// A Read response's payload could not be written into its WQE's scatter list: the
/// payload's bytes are out of the sender's bounds, the list is shorter than the Read, or its
/// memory is gone. The response is a bad one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotCopied;

/// What [`act`] needs of whoever drives the QP.
pub trait CompleterDriver {
    /// The QP's protocol half.
    fn qp(&mut self) -> &mut Qp;

    /// Copies the payload of the response being handled into the scatter list of WQE
    /// `seq`, `offset` bytes in; the bytes copied, or [`NotCopied`] if the payload or the
    /// list cannot take it (a bad response).
    fn copy_read_response(&mut self, seq: u64, offset: u32) -> Result<u64, NotCopied>;

    /// Writes an Atomic's original value `orig` into the scatter list of WQE `seq`, as far
    /// as it reaches (at most 8 bytes).
    fn write_orig(&mut self, seq: u64, orig: u64);

    /// Retires the WQEs done ([`super::retire`]).
    fn retire(&mut self);

    /// Moves the QP to the Error state (its WQEs flush, its timers stop).
    fn enter_error(&mut self);

    /// `which` retry counter ran out (before the WQE fails and the QP enters the Error
    /// state).
    fn exhausted(&mut self, which: Exhausted);

    /// Counts one of `c`.
    fn count(&mut self, c: Counted);
}

/// Does what `outcome` (of [`check_response`](super::check_response) on `r`) says.
pub fn act<D: CompleterDriver>(d: &mut D, r: &Response, outcome: Outcome) {
    match outcome {
        Outcome::EarlyCredits(credits, msn) => {
            d.qp().req.keep_early_credits(credits, msn);
            return;
        }
        Outcome::Dropped => {
            d.count(Counted::Dropped);
            return;
        }
        Outcome::Credits(credits, msn) => {
            d.qp().req.update_credits(credits, msn);
            return;
        }
        Outcome::ImpliedNak(missing) => {
            implied_nak(d, missing);
            return;
        }
        Outcome::Bad(seq) => {
            bad_response(d, seq);
            return;
        }
        Outcome::BadThenRetire(seq) => bad_response(d, seq),
        Outcome::NotAResponse => d.count(Counted::Dropped),
        Outcome::Ack {
            seq,
            psn,
            credits,
            msn,
        } => {
            let req = &mut d.qp().req;
            if psn == req.wqe(seq).last_psn() {
                req.complete(seq, WcStatus::Success);
            }
            progress(d.qp(), psn);
            d.qp().req.update_credits(credits, msn);
        }
        Outcome::RnrNak { seq, psn, timer } => {
            d.count(Counted::RnrNak);
            progress(d.qp(), psn.sub(1));
            let qp = d.qp();
            if !qp.req.rnr_wait(psn, timer.duration(), &qp.cfg) {
                d.exhausted(Exhausted::Rnr);
                d.qp().req.complete(seq, WcStatus::RnrRetryExcErr);
                d.enter_error();
                return;
            }
        }
        Outcome::SequenceError { psn } => {
            d.count(Counted::Nak);
            progress(d.qp(), psn.sub(1));
            retry_from(d, psn);
        }
        Outcome::FatalNak { seq, psn, status } => {
            d.count(Counted::Nak);
            progress(d.qp(), psn.sub(1));
            d.qp().req.complete(seq, status);
            d.enter_error();
        }
        Outcome::ReadResponse {
            seq,
            psn,
            offset,
            last,
        } => {
            credits_of(d.qp(), r);
            if d.copy_read_response(seq, offset).is_err() {
                return bad_response(d, seq);
            }
            let req = &mut d.qp().req;
            req.response_seen(seq);
            if last {
                req.complete(seq, WcStatus::Success);
            }
            progress(d.qp(), psn);
        }
        Outcome::AtomicAck { seq, psn, orig } => {
            d.write_orig(seq, orig);
            credits_of(d.qp(), r);
            d.qp().req.complete(seq, WcStatus::Success);
            progress(d.qp(), psn);
        }
    }
    d.retire();
}

/// Applies the credits of a response's positive AETH, if it has one.
fn credits_of(qp: &mut Qp, r: &Response) {
    if let Some(AethRepr {
        syndrome: Syndrome::Ack { credits },
        msn,
    }) = r.aeth
    {
        qp.req.update_credits(credits, msn.get());
    }
}

/// Records acknowledgement up to `psn` and restarts the transport timer.
#[inline]
fn progress(qp: &mut Qp, psn: Psn) {
    qp.req.acknowledged(psn, &qp.cfg);
}

/// A response showed that responses from `missing` on were lost: request them again, as a
/// sequence-error Nak would (it spends the Retry Count) — once: the responses to the first
/// requests that follow (a long Read's remaining responses, the Acks behind them) show the
/// same loss and are dropped until `missing` is acknowledged.
///
/// Everything before `missing` is acknowledged: the WQEs that end before it were completed
/// by [`Requester::ack_before`](crate::requester::Requester::ack_before), and the
/// acknowledged PSN must cover them, or a later retry would start from a PSN no WQE holds
/// any more and send nothing.
fn implied_nak<D: CompleterDriver>(d: &mut D, missing: Psn) {
    progress(d.qp(), missing.sub(1));
    if d.qp().req.already_resending_from(missing) {
        d.count(Counted::Dropped);
        return;
    }
    retry_from(d, missing);
    d.qp().req.resending_from(missing);
}

/// Sends again from `psn`, or fails the QP when the Retry Count is spent.
fn retry_from<D: CompleterDriver>(d: &mut D, psn: Psn) {
    if d.qp().req.resend_from(psn) {
        return;
    }
    d.exhausted(Exhausted::Resent);
    let req = &mut d.qp().req;
    if let Some(seq) = req.window().find(psn) {
        req.complete(seq, WcStatus::RetryExcErr);
    }
    d.enter_error();
}

/// A malformed or unexpected response: the WQE fails with a bad-response error and the QP
/// goes to the Error state.
pub fn bad_response<D: CompleterDriver>(d: &mut D, seq: u64) {
    d.qp().req.complete(seq, WcStatus::BadRespErr);
    d.enter_error();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completer::check_response;
    use crate::ids::{CqId, PdId};
    use crate::qp::{Mtu, QpConfig, QpState};
    use crate::requester::Step;
    use crate::wire::aeth::{CreditCode, NakCode, RnrTimer};
    use crate::wire::opcode::{OpClass, Position};
    use crate::wire::{Msn, Qpn};
    use crate::wqe::{Cursor, DataLoc, SqWqe, WqeFlags, WqeOp};
    use alloc::vec::Vec;
    use core::time::Duration;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Did {
        Copied(u64, u32),
        Orig(u64, u64),
        Retire,
        Error,
        Exhausted(Exhausted),
        Count(Counted),
    }

    struct Rec {
        qp: Qp,
        did: Vec<Did>,
        copy_ok: bool,
    }

    impl CompleterDriver for Rec {
        fn qp(&mut self) -> &mut Qp {
            &mut self.qp
        }
        fn copy_read_response(&mut self, seq: u64, offset: u32) -> Result<u64, NotCopied> {
            self.did.push(Did::Copied(seq, offset));
            if self.copy_ok {
                Ok(256)
            } else {
                Err(NotCopied)
            }
        }
        fn write_orig(&mut self, seq: u64, orig: u64) {
            self.did.push(Did::Orig(seq, orig));
        }
        fn retire(&mut self) {
            self.did.push(Did::Retire);
        }
        fn enter_error(&mut self) {
            self.qp.state = QpState::Error;
            self.did.push(Did::Error);
        }
        fn exhausted(&mut self, which: Exhausted) {
            self.did.push(Did::Exhausted(which));
        }
        fn count(&mut self, c: Counted) {
            self.did.push(Did::Count(c));
        }
    }

    /// A QP in RTS (Retry Count `retry`, RNR Retry Count `rnr`, PMTU 256) that sent `ops`.
    fn rec(ops: &[(WqeOp, u32)], retry: u8, rnr: u8) -> Rec {
        let mut qp = Qp::new(Qpn::new(3), PdId::new(0), (CqId::new(0), CqId::new(0)), 8);
        qp.state = QpState::Rts;
        qp.cfg = QpConfig {
            path_mtu: Mtu::Mtu256,
            retry_cnt: retry,
            rnr_retry: rnr,
            max_rd_atomic: 4,
            remote_credits: false,
            ..QpConfig::default()
        };
        qp.req.start(&qp.cfg, Duration::from_nanos(1));
        for &(op, len) in ops {
            let w = SqWqe {
                wr_id: 1,
                op,
                flags: WqeFlags(WqeFlags::SIGNALED),
                imm: 0,
                len,
                remote_addr: 0,
                rkey: 0,
                compare_add: 0,
                swap: 0,
                data: DataLoc::Empty,
            };
            qp.req.accept(w, 256);
        }
        while let Step::Packet {
            seq,
            new_wqe,
            point,
        } = qp.req.next_step(QpState::Rts, 4)
        {
            if new_wqe {
                qp.req.begin_wqe();
            }
            let w = *qp.req.wqe(seq);
            qp.req.note_sent(&w, w.first_psn.add(point.pkt));
            let last = crate::requester::Requester::ends_wqe(&w, point.pkt);
            qp.req.packet_sent((!last).then(Cursor::default));
        }
        Rec {
            qp,
            did: Vec::new(),
            copy_ok: true,
        }
    }

    fn resp(class: OpClass, psn: u32, syndrome: Option<Syndrome>) -> Response {
        Response {
            class,
            position: Position::Only,
            psn: Psn::new(psn),
            aeth: syndrome.map(|syndrome| AethRepr {
                syndrome,
                msn: Msn::new(0),
            }),
            atomic_orig: None,
            payload_len: 0,
            has_payload: false,
        }
    }

    fn handle(d: &mut Rec, r: Response) {
        let o = check_response(d.qp.state, &mut d.qp.req, &d.qp.cfg, &r);
        act(d, &r, o);
    }

    /// spec/01: each RNR Nak waits and spends one RNR retry; the Nak that finds none left
    /// fails the WQE with RnrRetryExcErr and the QP (after saying which counter ran out).
    #[test]
    fn rnr_naks_until_the_count_runs_out() {
        let mut d = rec(&[(WqeOp::Send, 8)], 3, 1);
        let rnr = Some(Syndrome::RnrNak {
            timer: RnrTimer::new(1),
        });
        handle(&mut d, resp(OpClass::Acknowledge, 0, rnr));
        assert_eq!(d.did, [Did::Count(Counted::RnrNak), Did::Retire]);
        assert!(d.qp.req.rnr_timer().armed());
        d.did.clear();
        handle(&mut d, resp(OpClass::Acknowledge, 0, rnr));
        assert_eq!(
            d.did,
            [
                Did::Count(Counted::RnrNak),
                Did::Exhausted(Exhausted::Rnr),
                Did::Error
            ]
        );
        assert_eq!(d.qp.req.wqe(0).done, Some(WcStatus::RnrRetryExcErr));
    }

    /// A PSN Sequence Error Nak resends from its PSN, spending the Retry Count; with none
    /// left the WQE fails with RetryExcErr.
    #[test]
    fn sequence_errors_until_the_retry_count_runs_out() {
        let mut d = rec(&[(WqeOp::Send, 600)], 1, 0);
        let seq_err = Some(Syndrome::Nak(NakCode::PsnSequenceError));
        handle(&mut d, resp(OpClass::Acknowledge, 1, seq_err));
        assert_eq!(d.qp.req.window().acked(), Psn::new(0), "packet 0 arrived");
        assert_eq!(d.qp.req.window().tx().pkt, 1, "resent from packet 1");
        handle(&mut d, resp(OpClass::Acknowledge, 1, seq_err));
        assert!(d.did.contains(&Did::Exhausted(Exhausted::Resent)));
        assert_eq!(d.qp.req.wqe(0).done, Some(WcStatus::RetryExcErr));
        // The QP fails, then what is done retires (the flush).
        assert_eq!(d.did[d.did.len() - 2..], [Did::Error, Did::Retire]);
    }

    /// An Ack inside a Read's PSNs shows its responses lost: it is requested again once,
    /// and a second response showing the same loss is dropped, not another retry.
    #[test]
    fn a_loss_is_resent_once() {
        let mut d = rec(&[(WqeOp::Read, 600), (WqeOp::Send, 8)], 3, 0);
        let ok = Some(Syndrome::Ack {
            credits: CreditCode::new(31),
        });
        handle(&mut d, resp(OpClass::Acknowledge, 3, ok));
        assert_eq!(d.qp.req.retry_state(), (Some(Psn::new(0)), 2, 0));
        d.did.clear();
        handle(&mut d, resp(OpClass::Acknowledge, 3, ok));
        assert_eq!(d.did, [Did::Count(Counted::Dropped)]);
        assert_eq!(d.qp.req.retry_state().1, 2, "no second retry spent");
    }

    /// A Read response is copied at its offset; one that cannot be copied is a bad
    /// response: the WQE fails and the QP with it. An Atomic Acknowledge's value is
    /// written and the Atomic completes.
    #[test]
    fn read_data_and_atomic_values_land_or_fail_the_qp() {
        let mut d = rec(&[(WqeOp::Read, 300)], 3, 0);
        let read = |psn, position, len| Response {
            position,
            payload_len: len,
            has_payload: true,
            ..resp(OpClass::RdmaReadResponse, psn, None)
        };
        handle(&mut d, read(0, Position::First, 256));
        assert_eq!(d.did, [Did::Copied(0, 0), Did::Retire]);
        d.copy_ok = false;
        d.did.clear();
        handle(&mut d, read(1, Position::Last, 44));
        assert_eq!(d.did, [Did::Copied(0, 256), Did::Error]);
        assert_eq!(d.qp.req.wqe(0).done, Some(WcStatus::BadRespErr));

        let mut a = rec(&[(WqeOp::FetchAdd, 8)], 3, 0);
        let ack = Response {
            atomic_orig: Some(41),
            ..resp(
                OpClass::AtomicAcknowledge,
                0,
                Some(Syndrome::Ack {
                    credits: CreditCode::new(31),
                }),
            )
        };
        handle(&mut a, ack);
        assert_eq!(a.did, [Did::Orig(0, 41), Did::Retire]);
        assert_eq!(a.qp.req.wqe(0).done, Some(WcStatus::Success));
        assert_eq!(a.qp.req.window().acked(), Psn::new(0));
    }

    /// A fatal Nak fails its WQE with the mapped status and the QP; a response the state
    /// does not take is counted dropped and changes nothing.
    #[test]
    fn fatal_naks_and_drops() {
        let mut d = rec(&[(WqeOp::Write, 8)], 3, 0);
        let nak = Some(Syndrome::Nak(NakCode::RemoteAccessError));
        handle(&mut d, resp(OpClass::Acknowledge, 0, nak));
        assert_eq!(
            d.did,
            [Did::Count(Counted::Nak), Did::Error, Did::Retire],
            "the QP fails, then the WQE retires with its status"
        );
        assert_eq!(d.qp.req.wqe(0).done, Some(WcStatus::RemAccessErr));
        d.did.clear();
        handle(&mut d, resp(OpClass::Acknowledge, 0, nak));
        assert_eq!(d.did, [Did::Count(Counted::Dropped)], "the QP is in Error");
    }

    /// An Ack of a WQE's last PSN completes it; an Ack of a PSN inside a multi-packet
    /// message only acknowledges up to it (spec/01: the message completes when its last
    /// packet is acknowledged).
    #[test]
    fn an_ack_inside_a_message_does_not_complete_it() {
        let mut d = rec(&[(WqeOp::Send, 600)], 3, 0);
        let ok = Some(Syndrome::Ack {
            credits: CreditCode::new(31),
        });
        handle(&mut d, resp(OpClass::Acknowledge, 1, ok));
        assert_eq!(d.qp.req.window().acked(), Psn::new(1));
        assert_eq!(d.qp.req.wqe(0).done, None, "packet 2 is not acknowledged");
        handle(&mut d, resp(OpClass::Acknowledge, 2, ok));
        assert_eq!(d.qp.req.window().acked(), Psn::new(2));
        assert_eq!(d.qp.req.wqe(0).done, Some(WcStatus::Success));
        assert_eq!(d.did, [Did::Retire, Did::Retire]);
    }

    /// spec/02: the AETH of a Read response (its Only or Last) reports credits like an
    /// Ack's; they are applied, and a Send that waits for credit may go on.
    #[test]
    fn a_read_responses_credits_are_applied() {
        let mut d = rec(&[], 3, 0);
        d.qp.cfg.remote_credits = true;
        d.qp.req.start(&d.qp.cfg, Duration::from_nanos(1));
        let read = SqWqe {
            wr_id: 1,
            op: WqeOp::Read,
            flags: WqeFlags(WqeFlags::SIGNALED),
            imm: 0,
            len: 8,
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
            data: DataLoc::Empty,
        };
        d.qp.req.accept(read, 256);
        d.qp.req.next_step(QpState::Rts, 4);
        d.qp.req.begin_wqe();
        let w = *d.qp.req.wqe(0);
        d.qp.req.note_sent(&w, w.first_psn);
        d.qp.req.packet_sent(None);
        assert!(!d.qp.req.credits().allows(1), "no credit known yet");
        let r = Response {
            payload_len: 8,
            has_payload: true,
            aeth: Some(AethRepr {
                syndrome: Syndrome::Ack {
                    credits: CreditCode::encode(2),
                },
                msn: Msn::new(1),
            }),
            ..resp(OpClass::RdmaReadResponse, 0, None)
        };
        handle(&mut d, r);
        assert_eq!(d.did, [Did::Copied(0, 0), Did::Retire]);
        assert_eq!(d.qp.req.wqe(0).done, Some(WcStatus::Success));
        assert!(d.qp.req.credits().allows(2), "two receive WQEs reported");
        assert!(!d.qp.req.credits().allows(3));
    }
}
