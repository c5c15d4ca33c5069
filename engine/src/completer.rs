//! The completer: the SQ Logic's handling of responses (spec/01 "SQ Logic Validation of
//! Each Response", the rxe completer's checks).
//!
//! The checks are the protocol core's ([`shmhca_proto::completer`]: state, PSN, implicit
//! acknowledgement, opcode and sequence, ending in an [`Outcome`]); this module runs them
//! on each response the engine receives and does what the outcome says (`act`, the one
//! table): Read response data and the Atomic's original value are written into the WQE's
//! scatter list, Naks map to completion statuses and the Error state, and the WQEs done
//! are retired in order (`retire`), signaled ones with a send completion.
//!
//! Two short paths come first and decide only what they can decide alone, with the same
//! effects: a positive Ack that completes the oldest Sends and Writes (`ack_fast`), and the
//! single response of a Read or Atomic (`answer_fast`); anything else goes the full way.

use crate::completion::{WcStatus, WorkCompletion};
use crate::context::{Env, QpSlot};
use crate::dma::{self, CopyError, Cursor, Sgl};
use crate::psn::Psn;
use crate::qp::QpState;
use crate::user_mem::Local;
use crate::wire::aeth::{AethRepr, CreditCode, Syndrome};
use crate::wire::opcode::{OpClass, Position};
use crate::wire::slot::{KeptAck, Payload, RxPacket};
use crate::wqe::{WqeFlags, WqeOp};

/// Handles one response packet addressed to this QP's SQ Logic.
pub(crate) fn on_response(qp: &mut QpSlot, env: &mut Env<'_>, pkt: &RxPacket<'_>) {
    if ack_fast(qp, env, pkt) || answer_fast(qp, env, pkt) {
        return;
    }
    on_response_full(qp, env, pkt);
}

/// Handles the riding Ack a request carried (`kept`: what `wire::slot::riding_ack_of` took
/// of its carrier), as [`on_response`] handles the standalone Acknowledge it stands for.
/// The Ack fast path reads its word directly: the carrier's parse checked that it is a
/// positive Ack, and nothing else of the line it stands for is needed there. Anything the
/// fast path does not take goes the full way on that line, rebuilt. (In line in both
/// receive steps, the general and the straight: out of line it cost 34 instructions.)
#[inline(always)]
pub(crate) fn on_riding_ack(qp: &mut QpSlot, env: &mut Env<'_>, kept: KeptAck) {
    let word = kept.word;
    // The word: BTH bytes 8..12 (AckReq and reserved, then the PSN) and the AETH.
    let syndrome = (word >> 24) as u8;
    if syndrome >> 5 == 0 && fast_paths_on() && qp.proto.state == QpState::Rts {
        let psn = Psn::new((word >> 32) as u32);
        let msn = (word as u32) & crate::wire::Msn::MASK;
        if ack_fast_at(qp, env, psn, CreditCode::new(syndrome), msn) {
            return;
        }
    }
    let line = crate::wire::slot::riding_ack_line(kept);
    on_response_full(qp, env, &RxPacket::riding(&line));
}

use crate::wqe::DataLoc;
use shmhca_proto::completer::{CompleterDriver, Counted, NotCopied, act};
pub use shmhca_proto::completer::{Exhausted, Outcome, Response, check_response};
use shmhca_proto::completer::{SendCompletions, can_retire};
use shmhca_proto::requester::{AckFast, Requester};

/// [`on_response`] past the Ack fast path: the checks (the protocol core's), then the
/// action.
fn on_response_full(qp: &mut QpSlot, env: &mut Env<'_>, pkt: &RxPacket<'_>) {
    let r = response_of(pkt);
    let outcome = check_response(qp.proto.state, &mut qp.proto.req, &qp.proto.cfg, &r);
    act(&mut Completer { qp, env, pkt }, &r, outcome);
}

/// What the completer's checks read of a response packet.
fn response_of(pkt: &RxPacket<'_>) -> Response {
    Response {
        class: pkt.info.class,
        position: pkt.info.position,
        psn: pkt.psn(),
        aeth: pkt.aeth(),
        atomic_orig: pkt.atomic_orig(),
        payload_len: pkt.payload.len(),
        has_payload: pkt.payload != Payload::None,
    }
}

/// The engine's side of the completer's actions ([`act`]): the QP slot (its memory and
/// what it shares with the application), this engine's resources, and the response being
/// handled (whose payload a Read's data comes from).
struct Completer<'q, 'e, 'r, 'p> {
    qp: &'q mut QpSlot,
    env: &'e mut Env<'r>,
    pkt: &'p RxPacket<'p>,
}

impl CompleterDriver for Completer<'_, '_, '_, '_> {
    #[inline(always)]
    fn qp(&mut self) -> &mut shmhca_proto::qp::Qp {
        &mut self.qp.proto
    }

    fn copy_read_response(&mut self, seq: u64, offset: u32) -> Result<u64, NotCopied> {
        let qp = &mut *self.qp;
        let data = qp.proto.req.wqe(seq).wqe.data;
        let sgl = Sgl::new(&data, &qp.tables);
        let mut cursor = Cursor::at(sgl, u64::from(offset)).ok_or(NotCopied)?;
        let local = Local::new(&qp.mem, &self.env.res.mrs);
        match dma::copy_payload(self.pkt, &qp.peer_mem, &local, sgl, &mut cursor) {
            Ok(n) => {
                self.env.stats.payload_bytes_copied += n;
                Ok(n)
            }
            Err(CopyError::BadSource | CopyError::DestinationFull | CopyError::BadDestination) => {
                Err(NotCopied)
            }
        }
    }

    fn write_orig(&mut self, seq: u64, orig: u64) {
        let data = self.qp.proto.req.wqe(seq).wqe.data;
        write_orig(self.qp, self.env, &data, orig);
    }

    #[inline]
    fn retire(&mut self) {
        retire(self.qp, self.env);
    }

    fn enter_error(&mut self) {
        self.qp.enter_error(self.env);
    }

    fn exhausted(&mut self, which: Exhausted) {
        record_exhausted(self.qp, which);
    }

    fn count(&mut self, c: Counted) {
        let s = &mut self.env.stats;
        match c {
            Counted::Dropped => s.dropped += 1,
            Counted::Nak => s.naks_received += 1,
            Counted::RnrNak => s.rnr_naks_received += 1,
        }
    }
}

/// The Ack fast path (issue 10): a positive Ack, on an RTS QP, that acknowledges the
/// oldest WQEs of the window — Sends and RDMA Writes not done yet, the last of them ending
/// exactly at the Ack's PSN, no RDMA Read or Atomic among them — completes and retires
/// them in one straight path, with the checks and the effects of the slow path (PSN
/// window, completions in order, acknowledged PSN and retry counts, credits). A positive
/// Ack at or before the last acknowledged PSN (a duplicate, or the responder's unsolicited
/// credit update) only updates the credits, as the slow path does. Anything else returns
/// false with nothing changed: an Ack inside a multi-packet message, before a Read's
/// responses, a Nak, an RNR Nak, a response with data.
#[inline]
fn ack_fast(qp: &mut QpSlot, env: &mut Env<'_>, pkt: &RxPacket<'_>) -> bool {
    if !fast_paths_on() || pkt.info.class != OpClass::Acknowledge || qp.proto.state != QpState::Rts
    {
        return false;
    }
    ack_fast_positive(qp, env, pkt)
}

/// [`ack_fast`] past the class and state checks (out of line: [`on_response`] takes every
/// response through them).
#[inline(never)]
fn ack_fast_positive(qp: &mut QpSlot, env: &mut Env<'_>, pkt: &RxPacket<'_>) -> bool {
    let Some((credits, msn)) = pkt.positive_ack() else {
        return false;
    };
    ack_fast_at(qp, env, pkt.psn(), credits, msn.get())
}

/// Whether the fast paths may be taken (always, but where a test turned them off to
/// compare them with the full paths).
#[inline(always)]
fn fast_paths_on() -> bool {
    #[cfg(test)]
    if !crate::probe::enabled() {
        return false;
    }
    true
}

/// [`ack_fast`] of a positive Ack of `psn` with `credits` and `msn`, on a QP in RTS: the
/// core decides ([`Requester::ack_fast`](shmhca_proto::requester::Requester::ack_fast));
/// the WQEs it completed are retired here.
#[inline]
fn ack_fast_at(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    psn: Psn,
    credits: CreditCode,
    msn: u32,
) -> bool {
    match qp.proto.req.ack_fast(psn, credits, msn, &qp.proto.cfg) {
        None => false,
        Some(AckFast::Credits) => {
            #[cfg(test)]
            crate::probe::count(crate::probe::Path::Credits);
            true
        }
        Some(AckFast::Acked { end }) => {
            // The oldest WQEs are done now (the QP is in RTS): retire without asking, in line.
            if !retire_acked::<false>(qp, env, end) {
                retire_full(qp, env);
            }
            #[cfg(test)]
            crate::probe::count(crate::probe::Path::Ack);
            true
        }
    }
}

/// Writes the original value `orig` an Atomic Acknowledge returned into an Atomic's
/// scatter list `data`, as far as the list reaches (at most 8 bytes). It lands in host
/// byte order, as a 64-bit load of the remote word would have returned it.
#[inline]
fn write_orig(qp: &QpSlot, env: &mut Env<'_>, data: &crate::wqe::DataLoc, orig: u64) {
    let bytes = orig.to_ne_bytes();
    let mem = Local::new(&qp.mem, &env.res.mrs);
    if let crate::wqe::DataLoc::Single(e) = *data {
        if e.len >= 8 {
            // The common case, one entry holding the word: the loop's one write. (A write
            // that fails leaves the buffer as the loop would: untouched.)
            let _ = mem.write(e.off, &bytes);
            return;
        }
    }
    let mut cursor = Cursor::default();
    let mut written = 0u64;
    let sgl = Sgl::new(data, &qp.tables);
    while written < 8 {
        let Some(e) = data.entry(&qp.tables, cursor.idx) else {
            break;
        };
        let n = (u64::from(e.len) - cursor.skip).min(8 - written);
        if mem
            .write(
                e.off + cursor.skip,
                &bytes[written as usize..(written + n) as usize],
            )
            .is_err()
        {
            break;
        }
        written += n;
        cursor.advance(sgl, n);
    }
}

/// The answer fast path (issue 10): the RDMA Read Response Only or the Atomic Acknowledge
/// of the oldest WQE of the window — an RDMA Read of one response or an Atomic, not done,
/// its PSN the first one not acknowledged — on an RTS QP, with a positive AETH and the
/// length (for an Atomic Acknowledge: no payload) the slow path demands. It skips the
/// slow path's search (no Send or Write before it to complete implicitly, no implied
/// Nak: nothing is older) and its opcode dispatch, and does what the slow path does with
/// it: credits, data (or original value) into the scatter list, done, acknowledged PSN and
/// retry counts, retired. Anything else returns false with nothing changed: a response
/// inside a multi-packet Read, of a later WQE, a duplicate, a Nak, a wrong length. A copy
/// into the scatter list that fails is the slow path's bad response, after the credits, as
/// there.
#[inline]
fn answer_fast(qp: &mut QpSlot, env: &mut Env<'_>, pkt: &RxPacket<'_>) -> bool {
    #[cfg(test)]
    if !crate::probe::enabled() {
        return false;
    }
    let info = pkt.info;
    let read = match info.class {
        OpClass::RdmaReadResponse if info.position == Position::Only => true,
        OpClass::AtomicAcknowledge => false,
        _ => return false,
    };
    if qp.proto.state != QpState::Rts {
        return false;
    }
    let Some(AethRepr {
        syndrome: Syndrome::Ack { credits },
        msn,
    }) = pkt.aeth()
    else {
        return false;
    };
    let psn = pkt.psn();
    let win = qp.proto.req.window();
    // 1. PSN window: after the last acknowledged PSN, before the first not sent.
    if psn.diff(win.acked()) <= 0 || psn.diff(win.sent_to()) >= 0 {
        return false;
    }
    // 2. The oldest WQE, at this very PSN: nothing older to acknowledge implicitly.
    let seq = win.retired();
    if seq == win.started() {
        return false;
    }
    let w = win.wqe(seq);
    if w.done.is_some() || w.first_psn != psn || w.resp_seen != 0 {
        return false;
    }
    // Only what is used (not a copy of the whole slot).
    let (op, len, span, data) = (w.wqe.op, w.wqe.len, w.span, w.wqe.data);
    // 3. Opcode and length.
    if read {
        // Only: the Read's one response, with exactly its length (at most a PMTU).
        if op != WqeOp::Read || span != 1 || pkt.payload.len() != len {
            return false;
        }
        let sgl = Sgl::new(&data, &qp.tables);
        let Some(mut cursor) = Cursor::at(sgl, 0) else {
            return false;
        };
        qp.proto.req.update_credits_of(credits, msn.get(), seq);
        // 4. Execute.
        match dma::copy_payload(
            pkt,
            &qp.peer_mem,
            &Local::new(&qp.mem, &env.res.mrs),
            sgl,
            &mut cursor,
        ) {
            Ok(n) => env.stats.payload_bytes_copied += n,
            Err(_) => {
                shmhca_proto::completer::bad_response(&mut Completer { qp, env, pkt }, seq);
                #[cfg(test)]
                crate::probe::count(crate::probe::Path::ReadResponse);
                return true;
            }
        }
        qp.proto.req.response_seen(seq);
        #[cfg(test)]
        crate::probe::count(crate::probe::Path::ReadResponse);
    } else {
        let Some(orig) = pkt.atomic_orig() else {
            return false;
        };
        if !op.is_atomic() || pkt.payload != Payload::None {
            return false;
        }
        // 4. Execute.
        write_orig(qp, env, &data, orig);
        qp.proto.req.update_credits_of(credits, msn.get(), seq);
        #[cfg(test)]
        crate::probe::count(crate::probe::Path::AtomicAck);
    }
    qp.proto.req.complete(seq, WcStatus::Success);
    qp.proto.req.acknowledged(psn, &qp.proto.cfg);
    // The oldest WQE is done now (the QP is in RTS): retire without asking, in line.
    if !retire_acked::<true>(qp, env, seq + 1) {
        retire_full(qp, env);
    }
    true
}

/// Records in words why the QP fails ([`crate::Qp::last_error`]): which counter ran out and
/// the last PSN the peer acknowledged. Error path only.
pub(crate) fn record_exhausted(qp: &QpSlot, which: Exhausted) {
    let acked = qp.proto.req.window().acked();
    let (acked, next) = (acked.get(), acked.add(1).get());
    let (retry, rnr) = (qp.proto.cfg.retry_cnt, qp.proto.cfg.rnr_retry);
    let text = match which {
        Exhausted::Timer => format!(
            "transport retry count exhausted (retry_cnt {retry}): the transport timer \
             expired with no retry left; the peer acknowledged up to PSN {acked} and never \
             answered PSN {next} (is the peer's engine running?)"
        ),
        Exhausted::Resent => format!(
            "transport retry count exhausted (retry_cnt {retry}): requests sent again after \
             PSN Sequence Error Naks or lost responses kept failing; the peer acknowledged \
             up to PSN {acked}, not PSN {next}"
        ),
        Exhausted::Rnr => format!(
            "RNR retry count exhausted (rnr_retry {rnr}): the peer had no receive WQE for \
             PSN {next} after every retry; the peer acknowledged up to PSN {acked} (post \
             receives at the peer before sending, or raise rnr_retry)"
        ),
    };
    *qp.shared
        .last_error
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(text);
}

/// Retires finished WQEs in order: signaled ones (and every error) with a send
/// completion; in the Error state every remaining WQE with a flush error. Stops when the
/// send CQ is full (the WQEs stay and are retired later). The order is the core's
/// ([`shmhca_proto::completer::retire`]): release, publish, then complete — a WQE's
/// regions and its queue slot are given back (the slot published in
/// [`QpShared::sq_retired`]) before its completion is pushed, so that an application
/// reacting to the completion can post again and deregister the regions.
///
/// [`QpShared::sq_retired`]: crate::context::QpShared::sq_retired
///
/// Called for every active QP every iteration: when the oldest WQE is not done (and the QP
/// is not in the Error state) nothing can retire, an answer that costs a few loads here,
/// not a call.
#[inline]
pub(crate) fn retire(qp: &mut QpSlot, env: &mut Env<'_>) {
    if !can_retire(&qp.proto.req, qp.proto.state) {
        return; // the oldest WQE is not done: nothing can retire
    }
    retire_some(qp, env);
}

/// [`retire`] when the oldest WQE is done, or in the Error state: the common case in a
/// straight line ([`retire_ok_fast`]), anything else the core's way.
#[inline(never)]
fn retire_some(qp: &mut QpSlot, env: &mut Env<'_>) {
    if fast_paths_on() && retire_ok_fast(qp, env) {
        return;
    }
    retire_full(qp, env);
}

/// The retire fast path (issue 27): outside the Error state, the oldest WQEs done with
/// success and holding one range or none (no gather table to read) retire in a tight loop,
/// with the core's order and rules ([`shmhca_proto::completer::retire`]): a signaled one
/// only if the send CQ has room (else it and the rest stay), its memory released and the
/// retired count published before its completion is pushed; unsignaled ones without a
/// completion, published with the next signaled one or at the end. The send CQ is looked
/// up once per completion ([`CqTable::push_with`](crate::tables::cq::CqTable::push_with)).
///
/// Returns true if it did all that retiring does now (it stopped at a WQE not done, at the
/// end of the started WQEs, or at a full send CQ); false at a WQE it leaves to the full
/// path (done with an error, a list of several elements) or in the Error state, with what
/// it retired before published, so that the full path goes on from there.
#[inline(always)]
fn retire_ok_fast(qp: &mut QpSlot, env: &mut Env<'_>) -> bool {
    if qp.proto.state == QpState::Error {
        return false;
    }
    let (qpn, send_cq) = (qp.proto.qpn, qp.proto.send_cq);
    let res = &mut *env.res;
    let req = &mut qp.proto.req;
    let shared = &*qp.shared;
    let mut published = req.window().retired();
    let all = loop {
        let win = req.window();
        let seq = win.retired();
        if seq == win.started() {
            break true;
        }
        let w = win.wqe(seq);
        match w.done {
            Some(WcStatus::Success) => {}
            None => break true,
            Some(_) => break false,
        }
        let (wr_id, op, len, flags) = (w.wqe.wr_id, w.wqe.op, w.wqe.len, w.wqe.flags);
        let mr = match w.wqe.data {
            DataLoc::Empty => crate::wqe::NO_MR,
            DataLoc::Single(e) => e.mr,
            DataLoc::Table { .. } => break false,
        };
        if !flags.has(WqeFlags::SIGNALED) {
            if mr != crate::wqe::NO_MR {
                res.mrs.release(mr, &mut res.pds);
            }
            req.drop_oldest_op(op);
            continue;
        }
        let pushed = res.cqs.push_with(
            send_cq,
            #[inline(always)]
            || {
                if mr != crate::wqe::NO_MR {
                    res.mrs.release(mr, &mut res.pds);
                }
                req.drop_oldest_op(op);
                published = req.window().retired();
                publish_retired(shared, published);
                WorkCompletion {
                    wr_id,
                    status: WcStatus::Success,
                    opcode: shmhca_proto::completer::wc_opcode(op),
                    byte_len: if op == WqeOp::Read { len } else { 0 },
                    imm_data: None,
                    qp_num: qpn,
                    solicited: false,
                    invalidated_rkey: None,
                }
            },
        );
        if !pushed {
            break true; // the send CQ is full: the rest wait for the application's poll
        }
    };
    let retired = req.window().retired();
    if published != retired {
        publish_retired(shared, retired);
    }
    #[cfg(test)]
    crate::probe::count(crate::probe::Path::Retire);
    all
}

/// [`retire_ok_fast`] after the Ack fast path completed the WQEs before `end`
/// ([`AckFast::Acked`]): Sends and Writes done with success on a QP in RTS, retired without
/// a look at their status, the state or a Read's count. The unsignaled ones are passed over
/// (a region one holds released as it is) and leave the window together
/// ([`Requester::drop_acked_to`]) with the next signaled one, before its completion, or at
/// the end. Returns as [`retire_ok_fast`] does; a WQE done after them (none in practice)
/// is left to the full path.
///
/// `ANSWERED`: the WQE before `end` is instead the oldest one, a Read or an Atomic its one
/// response has just completed ([`answer_fast`]): a Read's completion carries its length,
/// and its initiator slot is given back ([`Requester::drop_answered`]).
#[inline(always)]
fn retire_acked<const ANSWERED: bool>(qp: &mut QpSlot, env: &mut Env<'_>, end: u64) -> bool {
    debug_assert!(qp.proto.state == QpState::Rts);
    let (qpn, send_cq) = (qp.proto.qpn, qp.proto.send_cq);
    let res = &mut *env.res;
    let req = &mut qp.proto.req;
    let shared = &*qp.shared;
    let mut seq = req.window().retired();
    let mut published = seq;
    let all = loop {
        if seq == end {
            drop_passed::<ANSWERED>(req, shared, published, seq);
            // Done after them: only where done WQEs were left unretired before.
            let win = req.window();
            break seq == win.started() || win.wqe(seq).done.is_none();
        }
        let w = req.window().wqe(seq);
        debug_assert_eq!(w.done, Some(WcStatus::Success));
        let (wr_id, op, flags, len) = (w.wqe.wr_id, w.wqe.op, w.wqe.flags, w.wqe.len);
        let mr = match w.wqe.data {
            DataLoc::Empty => crate::wqe::NO_MR,
            DataLoc::Single(e) => e.mr,
            DataLoc::Table { .. } => {
                drop_passed::<ANSWERED>(req, shared, published, seq);
                break false;
            }
        };
        seq += 1;
        if !flags.has(WqeFlags::SIGNALED) {
            if mr != crate::wqe::NO_MR {
                res.mrs.release(mr, &mut res.pds);
            }
            continue;
        }
        let pushed = res.cqs.push_with(
            send_cq,
            #[inline(always)]
            || {
                if mr != crate::wqe::NO_MR {
                    res.mrs.release(mr, &mut res.pds);
                }
                drop_to::<ANSWERED>(req, seq);
                published = seq;
                publish_retired(shared, seq);
                WorkCompletion {
                    wr_id,
                    status: WcStatus::Success,
                    opcode: shmhca_proto::completer::wc_opcode(op),
                    // (No Read among the WQEs an Ack completed: no length to load.)
                    byte_len: if ANSWERED && op == WqeOp::Read {
                        len
                    } else {
                        0
                    },
                    imm_data: None,
                    qp_num: qpn,
                    solicited: false,
                    invalidated_rkey: None,
                }
            },
        );
        if !pushed {
            // The send CQ is full: this one and the rest wait for the application's poll;
            // the unsignaled ones before it retire.
            drop_passed::<ANSWERED>(req, shared, published, seq - 1);
            break true;
        }
    };
    // (Counted only when it did all of it: a run that leaves the rest to the full path
    // would look like one that did not.)
    #[cfg(test)]
    if all {
        crate::probe::count(crate::probe::Path::Retire);
    }
    all
}

/// [`retire_acked`]'s drop of the WQEs it passed over since it last published, up to
/// `to`, and their publication.
#[inline(always)]
fn drop_passed<const ANSWERED: bool>(
    req: &mut Requester,
    shared: &crate::context::QpShared,
    published: u64,
    to: u64,
) {
    if published != to {
        drop_to::<ANSWERED>(req, to);
        publish_retired(shared, to);
    }
}

/// [`retire_acked`]'s drop of the WQEs before `to` (`ANSWERED`: the one before it).
#[inline(always)]
fn drop_to<const ANSWERED: bool>(req: &mut Requester, to: u64) {
    if ANSWERED {
        req.drop_answered();
    } else {
        req.drop_acked_to(to);
    }
}

/// Tells the application that the send WQEs before `retired` are retired
/// ([`QpShared::sq_retired`](crate::context::QpShared::sq_retired)).
#[inline(always)]
fn publish_retired(shared: &crate::context::QpShared, retired: u64) {
    // SYNC: Release pairs with the Acquire load in `Qp::post_send`: the engine is done
    // with the retired WQEs' slots and buffers before the application reuses them. It
    // precedes the completion's push (itself a Release), so an application that saw the
    // completion sees the slot free.
    // (Mutation point of the loom models: this store with Relaxed.)
    let order = crate::sync::weaken(crate::sync::Ordering::Release, "completer sq_retired store");
    shared.sq_retired.store(retired, order);
}

/// [`retire_some`] the core's way ([`shmhca_proto::completer::retire`]).
#[inline(never)]
fn retire_full(qp: &mut QpSlot, env: &mut Env<'_>) {
    let (state, qpn) = (qp.proto.state, qp.proto.qpn);
    let mut c = Completions {
        send_cq: qp.proto.send_cq,
        pmtu: qp.proto.cfg.path_mtu.bytes(),
        sq: &mut qp.sq,
        tables: &qp.tables,
        shared: &qp.shared,
        env,
    };
    let flushed = shmhca_proto::completer::retire(&mut qp.proto.req, state, qpn, &mut c);
    env.stats.flushed += flushed;
}

/// The engine's side of retiring a QP's send WQEs: its send CQ, its posted send queue, the
/// regions its WQEs held, and the word the application reads its free slots from.
struct Completions<'a, 'e, 'r> {
    send_cq: shmhca_proto::ids::CqId,
    pmtu: u32,
    sq: &'a mut crate::context::Posted<crate::wqe::SqWqe>,
    tables: &'a crate::mem::Mem,
    shared: &'a crate::context::QpShared,
    env: &'e mut Env<'r>,
}

impl SendCompletions for Completions<'_, '_, '_> {
    #[inline]
    fn has_room(&mut self) -> bool {
        self.env.cqs.has_room(self.send_cq)
    }

    #[inline]
    fn release(&mut self, data: &DataLoc) {
        self.env.release(data, self.tables);
    }

    #[inline]
    fn publish(&mut self, retired: u64) {
        publish_retired(self.shared, retired);
    }

    #[inline]
    fn push(&mut self, wc: WorkCompletion) {
        let pushed = self.env.cqs.push(self.send_cq, wc);
        debug_assert!(pushed, "room was checked");
    }

    fn fetch(&mut self, req: &mut Requester) {
        while req.has_room() {
            let Some(w) = self.sq.take() else { break };
            req.accept(w, self.pmtu);
        }
    }
}
