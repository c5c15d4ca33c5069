//! RQ Logic (the responder): executes request packets and answers them (spec/01, spec/02).
//!
//! The receive path is a pipeline of named checks in the order of the rxe responder
//! (`CHK_PSN → CHK_OP_SEQ → CHK_OP_VALID → CHK_RESOURCE → CHK_LENGTH → CHK_RKEY →
//! EXECUTE`). Each check is a function that returns `Result<_, RespError>`; the first that
//! fails refuses the packet, and one table (`verdict`) says what each refusal sends back
//! (the AETH syndrome), how a receive WQE in use completes, and whether the QP is lost.
//! The table and the checks that need only the headers and the QP's context (state, PSN,
//! opcode sequence, enables, packet length) are the protocol core's
//! ([`shmhca_proto::responder`]); the resources, keys and memory are the engine's:
//!
//! 1. **PSN** against ePSN ([`crate::psn::classify`]): the expected PSN is executed; a
//!    duplicate is answered again without being executed again (an Ack for Sends and
//!    Writes, the saved result for an Atomic, the data again for a Read); a PSN ahead of
//!    ePSN means packets were lost and gets one PSN Sequence Error Nak.
//! 2. **Opcode sequence**: Middle/Last only inside a message of the same kind, First/Only
//!    only outside one.
//! 3. **Operation enabled** on this QP (remote write/read/atomic enables).
//! 4. **Resources**: a Send or a Write with Immediate needs a receive WQE and, to complete
//!    it, room in the receive CQ — else an RNR Nak with the QP's minimum RNR timer; Reads
//!    and Atomics need a responder resource.
//! 5. **Length**: First/Middle packets carry exactly a PMTU, Last/Only at most one; a Write
//!    carries exactly its RETH length; the extended headers the opcode calls for are there;
//!    an Atomic's address is 8-byte aligned.
//! 6. **R_Key**: key, protection domain, access rights and bounds from the RETH/AtomicETH
//!    (and the key a Send with Invalidate names).
//! 7. **Execute** (copy the payload — a Send longer than its receive WQE is refused here —,
//!    run the Atomic, queue Read responses) and **acknowledge**.
//!
//! A fatal refusal moves the QP to the Error state. Its Nak is the last packet the QP
//! sends: the responses of the requests accepted before it (RDMA Read responses, Atomic
//! Acknowledges, Acks) still leave first, in PSN order, as the rxe responder acknowledges
//! each request before it turns to the next.
//!
//! Positive Acks are off the critical path (`responder/owed.rs`): an accepted request
//! records the Ack the QP owes, and the engine sends the owed Acks at the end of its
//! iteration, one per QP for everything accepted. Naks, RNR Naks, Read responses and
//! Atomic Acknowledges go through a queue and leave in PSN order as the link has room; an
//! Ack never overtakes the responses of an earlier Read. (A new Read of one response or
//! a new Atomic that finds the queue empty is answered at once, in the receive step, by
//! a fast path: see `answer_fast`.)

#[cfg(test)]
mod fast_tests;
#[cfg(test)]
mod hostile_tests;
mod owed;
#[cfg(test)]
mod rd_hostile_tests;
#[cfg(test)]
mod ride_hostile_tests;
#[cfg(test)]
mod ride_tests;
#[cfg(test)]
mod tests;

use crate::completion::WorkCompletion;
pub(crate) use owed::OwedAcks;
pub(crate) use shmhca_proto::responder::{Inbound, Out, ReadJob, RespError, verdict};
use shmhca_proto::responder::{OwedAck, RecvCopyError, Request, ResponderDriver};

use std::sync::atomic::Ordering;

use crate::completion::{WcOpcode, WcStatus};
use crate::context::{Env, LinkTx, QpSlot};
use crate::dma::{self, CopyError, Cursor, Sgl};
use crate::psn::Psn;
use crate::qp::{AccessFlags, MAX_RD_ATOMIC, QpState};
use crate::user_mem::Local;
use crate::wire::Msn;
use crate::wire::aeth::{AethRepr, CreditCode, NakCode, Syndrome};
use crate::wire::bth::BthRepr;
use crate::wire::opcode::{OpClass, Opcode, Position};
use crate::wire::slot::{
    HeaderWriter, KIND_DIRECT, KIND_INLINE, KIND_NONE, PacketSlot, RxPacket, can_carry_ack,
    riding_word, set_riding_ack,
};
use crate::wqe::{DataLoc, NO_MR, RqWqe, SgeEntry};
use shmhca_proto::responder::Reply;

/// Handles one request packet addressed to this QP's RQ Logic: runs it through the checks
/// and, if one refuses it, answers as the table ([`verdict`]) says. With `tx` (the QP's
/// link, when nothing needs to look at the packets sent before they leave), a new RDMA
/// Read of one response or a new Atomic is answered at once ([`read_fast`],
/// [`atomic_fast`]). `send_only`: `pkt` is what [`RxPacket::parse_send_only`] takes (a
/// one-line Send Only with its payload inline), for [`send_only_inline_fast`].
pub(crate) fn on_request<L: LinkTx + ?Sized>(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    tx: Option<&mut L>,
    pkt: &RxPacket<'_>,
    send_only: bool,
) {
    if qp.proto.comm_est_pending {
        qp.comm_established(env);
    }
    if send_only {
        if send_only_inline_fast(qp, env, pkt) {
            return;
        }
    } else if receive_fast(qp, env, pkt) {
        return;
    }
    if let Some(tx) = tx {
        if answer_fast(qp, env, tx, pkt) {
            return;
        }
    }
    let r = request_of(pkt);
    shmhca_proto::responder::handle_request(&mut Receiver { qp, env, pkt }, &r);
}

/// [`on_request`] of a packet [`RxPacket::parse_send_only`] took, for the engine's
/// straight receive step (issue 27): the same steps, less the answer a Read or an Atomic
/// may send at once (a Send has none), so that it needs no link.
#[inline(always)]
pub(crate) fn on_send_only(qp: &mut QpSlot, env: &mut Env<'_>, pkt: &RxPacket<'_>) {
    if qp.proto.comm_est_pending {
        qp.comm_established(env);
    }
    if send_only_inline_fast(qp, env, pkt) {
        return;
    }
    on_only_full(qp, env, pkt);
}

/// [`on_request`] of a packet [`RxPacket::write_only_checked`] took, for the engine's
/// straight receive step: a one-line RDMA Write Only, its payload inline. The same steps,
/// as [`on_send_only`]: the receive fast path's gate and its Write ([`write_only_fast`]:
/// every check the pipeline makes — operation enabled, length at most a PMTU and the
/// RETH's, R_Key, domain, rights and bounds), else the pipeline, which refuses what the
/// fast path would not take, in the spec's order.
#[inline(always)]
pub(crate) fn on_write_only(qp: &mut QpSlot, env: &mut Env<'_>, pkt: &RxPacket<'_>) {
    if qp.proto.comm_est_pending {
        qp.comm_established(env);
    }
    debug_assert_eq!(pkt.info.opcode, Opcode::RdmaWriteOnly);
    if at_epsn_idle(qp, pkt) && write_only_in_line(qp, env, pkt) {
        #[cfg(test)]
        crate::probe::count(crate::probe::Path::Receive);
        return;
    }
    on_only_full(qp, env, pkt);
}

/// [`on_send_only`] and [`on_write_only`] past their fast paths: the pipeline.
#[cold]
#[inline(never)]
fn on_only_full(qp: &mut QpSlot, env: &mut Env<'_>, pkt: &RxPacket<'_>) {
    let r = request_of(pkt);
    shmhca_proto::responder::handle_request(&mut Receiver { qp, env, pkt }, &r);
}

/// Refuses the request `pkt` (at `psn`) a short path found wrong, as the full pipeline
/// would ([`shmhca_proto::responder::refuse`]).
#[cold]
fn refuse(qp: &mut QpSlot, env: &mut Env<'_>, pkt: &RxPacket<'_>, psn: Psn, e: RespError) {
    shmhca_proto::responder::refuse(&mut Receiver { qp, env, pkt }, psn, e);
}

/// What the RQ Logic reads of a request packet.
fn request_of(pkt: &RxPacket<'_>) -> Request {
    Request {
        info: pkt.info,
        psn: pkt.psn(),
        payload_len: pkt.payload.len(),
        reth: pkt.reth(),
        atomic_eth: pkt.atomic_eth(),
        imm: pkt.imm(),
        ieth: pkt.ieth(),
        solicited: pkt.solicited(),
        ack_req: pkt.ack_req(),
    }
}

/// The engine's side of the RQ Logic's receive pipeline: the QP slot (its memory, queues
/// and what it shares with the application), this engine's resources, and the request
/// being handled (whose payload is copied from the peer's memory).
struct Receiver<'q, 'e, 'r, 'p> {
    qp: &'q mut QpSlot,
    env: &'e mut Env<'r>,
    pkt: &'p RxPacket<'p>,
}

impl ResponderDriver for Receiver<'_, '_, '_, '_> {
    #[inline(always)]
    fn qp(&mut self) -> &mut shmhca_proto::qp::Qp {
        &mut self.qp.proto
    }

    fn burst(&mut self) -> u64 {
        self.env.stats.packets_received
    }

    fn recv_cq_has_room(&mut self) -> bool {
        self.env.cqs.has_room(self.qp.proto.recv_cq)
    }

    fn take_recv(&mut self) -> Option<RqWqe> {
        self.env.take_recv(self.qp)
    }

    fn invalidate(&mut self, rkey: u32) -> bool {
        let qp = &self.qp.proto;
        self.env
            .mws
            .invalidate(rkey, qp.pd.get(), Some(qp.qpn))
            .is_ok()
    }

    fn copy_to_recv(&mut self, wqe: &RqWqe, cursor: &mut Cursor) -> Result<u64, RecvCopyError> {
        let qp = &*self.qp;
        let local = Local::new(&qp.mem, &self.env.res.mrs);
        let sgl = Sgl::new(&wqe.data, &qp.tables);
        match dma::copy_payload(self.pkt, &qp.peer_mem, &local, sgl, cursor) {
            Ok(n) => {
                self.env.stats.payload_bytes_copied += n;
                Ok(n)
            }
            Err(CopyError::DestinationFull) => Err(RecvCopyError::TooShort),
            Err(_) => Err(RecvCopyError::Failed),
        }
    }

    fn check_rkey(
        &mut self,
        rkey: u32,
        need: AccessFlags,
        va: u64,
        len: u64,
    ) -> Result<u64, RespError> {
        check_rkey(self.qp, self.env, rkey, need, va, len)
    }

    fn write_payload(&mut self, off: u64, len: u32) -> Result<(), RespError> {
        write_payload(self.qp, self.env, self.pkt, off, len)
    }

    fn atomic(&mut self, off: u64, cas: bool, compare: u64, swap_add: u64) -> Option<u64> {
        let mem = Local::new(&self.qp.mem, &self.env.res.mrs);
        let orig = if cas {
            mem.compare_swap_u64(off, compare, swap_add)
        } else {
            mem.fetch_add_u64(off, swap_add)
        };
        orig.ok()
    }

    fn complete_recv(&mut self, wqe: &RqWqe, wc: WorkCompletion) -> bool {
        self.qp.complete_recv(self.env, wqe, wc)
    }

    fn enter_error(&mut self) {
        self.qp.enter_error(self.env);
    }

    fn dropped(&mut self) {
        self.env.stats.dropped += 1;
    }
}

/// The receive fast path (issue 10): a Send Only or RDMA Write Only (with or without
/// immediate data) at ePSN, on an RTR or RTS QP with its own receive queue and nothing
/// pending (no message in progress, no receive WQE held, no Nak outstanding), in one
/// straight function. It makes exactly the pipeline's checks — operation enabled,
/// resources, length, R_Key — and delivers as the pipeline does: the same completion, the
/// same owed Ack, the same statistics.
///
/// The checks without side effects come first; if one fails, or a receive WQE or room in
/// the receive CQ is missing, it returns false with nothing changed and the pipeline takes
/// the packet from the start (and refuses it in the spec's order). Once it took the
/// receive WQE nothing but the copy can fail, and a failed copy is refused as the pipeline
/// refuses it, with the WQE where the pipeline would have put it.
#[inline]
fn receive_fast(qp: &mut QpSlot, env: &mut Env<'_>, pkt: &RxPacket<'_>) -> bool {
    #[cfg(test)]
    if !crate::probe::enabled() {
        return false;
    }
    let info = pkt.info;
    if info.position != Position::Only || !at_epsn_idle(qp, pkt) {
        return false;
    }
    let taken = match info.class {
        OpClass::Send if !info.invalidate => send_only_fast(qp, env, pkt),
        OpClass::RdmaWrite => write_only_fast(qp, env, pkt),
        _ => false,
    };
    #[cfg(test)]
    if taken {
        crate::probe::count(crate::probe::Path::Receive);
    }
    taken
}

/// The gate of the receive fast paths of Sends and Writes: `pkt` at ePSN, on an RTR or RTS
/// QP with its own receive queue and nothing pending (no message in progress, no receive
/// WQE held, no Nak outstanding).
#[inline(always)]
fn at_epsn_idle(qp: &QpSlot, pkt: &RxPacket<'_>) -> bool {
    let resp = &qp.proto.resp;
    pkt.psn() == resp.epsn
        && matches!(qp.proto.state, QpState::Rts | QpState::Rtr)
        && matches!(resp.cur, Inbound::Idle)
        && resp.held.is_none()
        && !resp.nak_outstanding
        && qp.srq.is_none()
}

/// [`receive_fast`] of a packet [`RxPacket::parse_send_only`] took (issue 27): a one-line
/// Send Only, its payload inline behind the BTH and at most `SLOT_DATA - 12` bytes — under
/// any PMTU, so that the opcode, position and length checks are settled. The same gate and
/// the same steps as [`send_only_fast`]; a payload that fits a receive WQE of one range is
/// written straight from the slot (what [`dma::copy_payload`] does for it), any other goes
/// through `copy_payload`.
#[inline(always)]
fn send_only_inline_fast(qp: &mut QpSlot, env: &mut Env<'_>, pkt: &RxPacket<'_>) -> bool {
    #[cfg(test)]
    if !crate::probe::enabled() {
        return false;
    }
    debug_assert!(
        pkt.info.opcode == Opcode::SendOnly
            && matches!(pkt.payload, crate::wire::slot::Payload::Inline { start, len }
                if start == crate::wire::bth::HEADER_LEN && len <= qp.proto.cfg.path_mtu.bytes() as usize)
    );
    if !at_epsn_idle(qp, pkt) {
        return false;
    }
    // 4. Resources: room in the receive CQ, then the receive WQE.
    if !env.cqs.has_room(qp.proto.recv_cq) {
        return false;
    }
    let Some(wqe) = qp.rq.take() else {
        return false;
    };
    // 7. Execute.
    const AT: usize = crate::wire::bth::HEADER_LEN;
    let slot = pkt.slot();
    let len = slot.payload_len as usize;
    let copied = match wqe.data {
        DataLoc::Single(e) if len <= e.len as usize => match slot.data.get(AT..AT + len) {
            Some(bytes) => Local::new(&qp.mem, &env.res.mrs)
                .write(e.off, bytes)
                .map(|()| len as u64)
                .map_err(|_| CopyError::BadDestination),
            None => Err(CopyError::BadSource),
        },
        _ => dma::copy_payload(
            pkt,
            &qp.peer_mem,
            &Local::new(&qp.mem, &env.res.mrs),
            Sgl::new(&wqe.data, &qp.tables),
            &mut Cursor::default(),
        ),
    };
    accept_send(qp, env, pkt, wqe, copied, None);
    #[cfg(test)]
    crate::probe::count(crate::probe::Path::Receive);
    true
}

/// The receive fast paths of RDMA Reads and Atomics (issue 10): a new request at ePSN,
/// on an RTR or RTS QP with nothing pending (no message in progress, no receive WQE held,
/// no Nak outstanding, no response queued — the answer would have to wait its turn), is
/// answered straight into the link's next slot: the Read Response Only of a Read of at
/// most a PMTU ([`read_fast`]), the Atomic Acknowledge of an Atomic ([`atomic_fast`]). It
/// skips the response queue and the second R_Key check of the queued Read's response
/// (nothing can change a region's key between the two here; a memory window's can — a
/// Send with Invalidate later in the burst, a Local Invalidate or bind that step 3 runs
/// before it drains — so a Read through a window goes to the pipeline), and makes the
/// pipeline's checks in its order (operation enabled, resources, headers, alignment,
/// R_Key); if one fails, or the link has no room, it returns false with nothing changed,
/// and the pipeline takes the packet from the start. The answer is the one step 3 would
/// send — the same headers, data, MSN; the credits of when it is built — and the state
/// the same once the burst is over ([`Responder::early`]). It skips step 3 for the QP too:
/// nothing is left queued, so an engine that has nothing else for the QP does not visit
/// it. Two things differ from the pipeline, both in the sender's favour and both allowed
/// by the spec: the answer leaves before the requests the QP itself sends this iteration
/// (another stream), and an Ack owed behind it in the same burst is owed, as any Ack with
/// nothing queued, not queued behind a response that has left. And, as the answer is
/// built when the request arrives, not after the rest of the burst: a Read's inline bytes
/// are those of its arrival, before a Write later in the burst changes them, and an
/// answer sent before a later packet of the burst moves the QP to the Error state is not
/// discarded as a queued one is (`rd_hostile_tests` pins both down).
#[inline]
fn answer_fast<L: LinkTx + ?Sized>(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    tx: &mut L,
    pkt: &RxPacket<'_>,
) -> bool {
    #[cfg(test)]
    if !crate::probe::enabled() {
        return false;
    }
    let info = pkt.info;
    let resp = &qp.proto.resp;
    if !matches!(
        info.class,
        OpClass::RdmaReadRequest | OpClass::CompareSwap | OpClass::FetchAdd
    ) || pkt.psn() != resp.epsn
        || !matches!(qp.proto.state, QpState::Rts | QpState::Rtr)
        || !matches!(resp.cur, Inbound::Idle)
        || resp.held.is_some()
        || resp.nak_outstanding
        || !resp.out.is_empty()
        || resp.closing
    {
        return false;
    }
    let Some(dest) = qp.proto.cfg.dest else {
        return false;
    };
    // 4. Resources (the pipeline checks them before the headers).
    qp.proto.resp.settle(env.stats.packets_received);
    if qp.proto.resp.rd_atomic_queued >= u32::from(qp.proto.cfg.max_dest_rd_atomic.max(1)) {
        return false;
    }
    if info.class == OpClass::RdmaReadRequest {
        read_fast(qp, env, tx, dest.qpn, pkt)
    } else {
        atomic_fast(qp, env, tx, dest.qpn, pkt)
    }
}

/// A new RDMA Read Request of one response on the fast path ([`answer_fast`]); false,
/// with nothing changed, if the pipeline must take it.
#[inline]
fn read_fast<L: LinkTx + ?Sized>(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    tx: &mut L,
    dest: crate::wire::Qpn,
    pkt: &RxPacket<'_>,
) -> bool {
    // 3. Operation enabled.
    if !qp.proto.cfg.access.contains(AccessFlags::REMOTE_READ) {
        return false;
    }
    let Some(reth) = pkt.reth() else {
        return false;
    };
    // One response (a Read of at most a PMTU, or of nothing).
    let len = reth.dma_len;
    if len > qp.proto.cfg.path_mtu.bytes() {
        return false;
    }
    // A window's key may stop working before step 3, where the pipeline checks it again
    // and Naks the Read if it did: the pipeline's. (A Read of nothing checks no key.)
    if len != 0 && crate::tables::mw::is_window_key(reth.rkey) {
        return false;
    }
    // 6. R_Key, once: the response is built now, from the range it checked.
    let Ok(off) = env.check_remote(
        reth.rkey,
        (qp.proto.pd, qp.proto.qpn),
        AccessFlags::REMOTE_READ,
        reth.va,
        u64::from(len),
    ) else {
        return false;
    };
    // A registered application buffer is staged in its shadow, which the peer can read.
    let Some(off) = env.mrs.stage_read(off, u64::from(len), &qp.mem) else {
        return false;
    };
    // 7. Execute: the response, as `read_response` builds it.
    let psn = pkt.psn();
    let msn = (qp.proto.resp.msn + 1) & Msn::MASK;
    let credits = credit_code(qp);
    let Some(slot) = tx.next_slot() else {
        return false;
    };
    // The headers `HeaderWriter` writes (BTH and AETH, as an Acknowledge's) and the
    // payload as `dma::describe` places one range: inline if it fits the slot, else by
    // reference; a Read of nothing leaves the slot's kind as it is.
    let pad = ((4 - len % 4) % 4) as u8;
    let syndrome = Syndrome::Ack { credits };
    let op = Opcode::RdmaReadResponseOnly;
    write_aeth_headers(slot, op, pad, dest, psn, syndrome, msn, None);
    let hdr = usize::from(slot.hdr_len);
    slot.payload_len = len;
    let mut inline = 0;
    if len as usize <= PacketSlot::inline_room(hdr) {
        if len > 0 {
            slot.kind = KIND_INLINE;
            let end = hdr + len as usize;
            if qp.mem.read(off, &mut slot.data[hdr..end]).is_err() {
                // Unreadable (it cannot be, the range was checked): the slot is not
                // committed, and the pipeline answers as it does.
                return false;
            }
            inline = u64::from(len);
        }
    } else {
        slot.kind = KIND_DIRECT;
        slot.payload_off = off;
    }
    // Queued in the link's batch, published with the iteration's burst: not straight into
    // the ring. The resource stays held until the burst is over (`Responder::early`); an
    // answer the requester could see in the middle of the burst would let it send a new
    // request, within its initiator depth, that this burst then refuses for want of that
    // resource (review 9).
    tx.commit();
    env.stats.packets_sent += 1;
    env.stats.inline_bytes_sent += inline;
    // The pipeline's bookkeeping: the message counted, the resource held until step 3,
    // the owed Ack dropped (the response acknowledges every request before it), ePSN on.
    let resp = &mut qp.proto.resp;
    resp.msn = msn;
    resp.answered(env.stats.packets_received);
    resp.epsn = psn.add(1);
    #[cfg(test)]
    crate::probe::count(crate::probe::Path::Read);
    true
}

/// A new Atomic on the fast path ([`answer_fast`]); false, with nothing changed, if the
/// pipeline must take it. Once it has the link's slot, only the atomic operation itself
/// can fail, and that is refused as the pipeline refuses it.
#[inline]
fn atomic_fast<L: LinkTx + ?Sized>(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    tx: &mut L,
    dest: crate::wire::Qpn,
    pkt: &RxPacket<'_>,
) -> bool {
    // 3. Operation enabled.
    if !qp.proto.cfg.access.contains(AccessFlags::REMOTE_ATOMIC) {
        return false;
    }
    // 5. Its header, and a naturally aligned 64-bit word.
    let Some(a) = pkt.atomic_eth() else {
        return false;
    };
    if a.va % 8 != 0 {
        return false;
    }
    // 6. R_Key.
    let Ok(off) = env.check_remote(
        a.rkey,
        (qp.proto.pd, qp.proto.qpn),
        AccessFlags::REMOTE_ATOMIC,
        a.va,
        8,
    ) else {
        return false;
    };
    let psn = pkt.psn();
    let Some(slot) = tx.next_slot() else {
        return false;
    };
    // 7. Execute.
    let mem = Local::new(&qp.mem, &env.res.mrs);
    let orig = if pkt.info.class == OpClass::CompareSwap {
        mem.compare_swap_u64(off, a.compare, a.swap_add)
    } else {
        mem.fetch_add_u64(off, a.swap_add)
    };
    let Ok(orig) = orig else {
        // The slot is not committed; the pipeline's state at this point is this one.
        refuse(qp, env, pkt, psn, RespError::AtomicFailed);
        #[cfg(test)]
        crate::probe::count(crate::probe::Path::Atomic);
        return true;
    };
    let msn = qp.proto.resp.next_msn();
    let code = credit_code(qp);
    write_ack_headers(
        slot,
        Opcode::AtomicAcknowledge,
        dest,
        psn,
        Syndrome::Ack { credits: code },
        msn,
        Some(orig),
    );
    slot.kind = KIND_NONE;
    // Queued, not sent straight into the ring: as a Read's answer (`read_fast`).
    tx.commit();
    env.stats.packets_sent += 1;
    advertise(qp, code.credits());
    // The pipeline's bookkeeping: the result kept for a duplicate, the resource held until
    // step 3, the owed Ack dropped, ePSN on.
    let resp = &mut qp.proto.resp;
    if resp.atomics.len() == MAX_RD_ATOMIC as usize {
        resp.atomics.pop_front();
    }
    resp.atomics.push_back((psn, orig, msn));
    resp.answered(env.stats.packets_received);
    resp.epsn = psn.add(1);
    #[cfg(test)]
    crate::probe::count(crate::probe::Path::Atomic);
    true
}

/// A Send Only (not with Invalidate) on the fast path; false, with nothing changed, if
/// the pipeline must take it.
#[inline]
fn send_only_fast(qp: &mut QpSlot, env: &mut Env<'_>, pkt: &RxPacket<'_>) -> bool {
    // 5. Length (before the resources here: it changes nothing, and a failure goes to the
    // pipeline, which checks the resources first).
    if pkt.payload.len() > qp.proto.cfg.path_mtu.bytes() {
        return false;
    }
    // 4. Resources: room in the receive CQ, then the receive WQE.
    if !env.cqs.has_room(qp.proto.recv_cq) {
        return false;
    }
    let Some(wqe) = qp.rq.take() else {
        return false;
    };
    // 7. Execute.
    let copied = dma::copy_payload(
        pkt,
        &qp.peer_mem,
        &Local::new(&qp.mem, &env.res.mrs),
        Sgl::new(&wqe.data, &qp.tables),
        &mut Cursor::default(),
    );
    accept_send(qp, env, pkt, wqe, copied, pkt.imm());
    true
}

/// The end of a Send Only on a fast path, its payload `copied` into receive WQE `wqe`:
/// delivered ([`deliver_fast`]), or, if the copy failed, refused as the pipeline refuses
/// it, with the WQE where the pipeline would have put it. `imm`: the packet's immediate
/// data.
#[inline(always)]
fn accept_send(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    pkt: &RxPacket<'_>,
    wqe: RqWqe,
    copied: Result<u64, CopyError>,
    imm: Option<u32>,
) {
    let n = match copied {
        Ok(n) => n,
        Err(e) => {
            // The pipeline's state at this point: the WQE is the message in progress.
            qp.proto.resp.cur = Inbound::Send {
                wqe,
                cursor: Cursor::default(),
                got: 0,
            };
            let e = match e {
                CopyError::DestinationFull => RespError::ReceiveTooShort,
                _ => RespError::CopyFailed,
            };
            refuse(qp, env, pkt, pkt.psn(), e);
            return;
        }
    };
    env.stats.payload_bytes_copied += n;
    deliver_fast(qp, env, &wqe, WcOpcode::Recv, n as u32, imm, pkt);
}

/// The execute step of an RDMA Write packet (fast path and pipeline alike): copies its
/// payload to `len` bytes at arena offset `off`, already checked against the R_Key.
fn write_payload(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    pkt: &RxPacket<'_>,
    off: u64,
    len: u32,
) -> Result<(), RespError> {
    write_payload_in_line(qp, env, pkt, off, len)
}

/// [`write_payload`] compiled into its caller (the straight receive step's Write).
#[inline(always)]
fn write_payload_in_line(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    pkt: &RxPacket<'_>,
    off: u64,
    len: u32,
) -> Result<(), RespError> {
    // The payload is exactly `len` bytes (checked by the callers): its last bytes land
    // last (`dma::copy_write_payload`).
    if pkt.payload.len() != len {
        return Err(RespError::CopyFailed);
    }
    let n = dma::copy_write_payload(pkt, &qp.peer_mem, &Local::new(&qp.mem, &env.res.mrs), off)
        .map_err(|_| RespError::CopyFailed)?;
    env.stats.payload_bytes_copied += n;
    Ok(())
}

/// An RDMA Write Only (with or without immediate data) on the fast path; false, with
/// nothing changed, if the pipeline must take it.
#[inline]
fn write_only_fast(qp: &mut QpSlot, env: &mut Env<'_>, pkt: &RxPacket<'_>) -> bool {
    write_only_in_line(qp, env, pkt)
}

/// [`write_only_fast`] compiled into its caller: the straight receive step's Write (out
/// of line, its call and its copy's cost the Write 19 instructions a message,
/// `bench/scripts/instructions.sh`).
#[inline(always)]
fn write_only_in_line(qp: &mut QpSlot, env: &mut Env<'_>, pkt: &RxPacket<'_>) -> bool {
    let psn = pkt.psn();
    // 3. Operation enabled.
    if !qp.proto.cfg.access.contains(AccessFlags::REMOTE_WRITE) {
        return false;
    }
    // 5. Length: at most a PMTU, exactly the RETH's.
    let Some(reth) = pkt.reth() else {
        return false;
    };
    let len = pkt.payload.len();
    if len > qp.proto.cfg.path_mtu.bytes() || len != reth.dma_len {
        return false;
    }
    // 6. R_Key: the message's range is the packet's (the pipeline checks it twice, for the
    // message and for the packet, with the same arguments).
    let Ok(off) = env.check_remote(
        reth.rkey,
        (qp.proto.pd, qp.proto.qpn),
        AccessFlags::REMOTE_WRITE,
        reth.va,
        u64::from(len),
    ) else {
        return false;
    };
    // 4. Resources: a Write with Immediate completes a receive WQE.
    let imm = pkt.imm();
    let wqe = if imm.is_some() {
        if !env.cqs.has_room(qp.proto.recv_cq) {
            return false;
        }
        let Some(wqe) = qp.rq.take() else {
            return false;
        };
        Some(wqe)
    } else {
        None
    };
    // 7. Execute.
    if write_payload_in_line(qp, env, pkt, off, len).is_err() {
        // The pipeline's state at this point: the receive WQE held.
        qp.proto.resp.held = wqe;
        refuse(qp, env, pkt, psn, RespError::CopyFailed);
        return true;
    }
    match wqe {
        Some(w) => deliver_fast(qp, env, &w, WcOpcode::RecvRdmaWithImm, len, imm, pkt),
        None => {
            let msn = qp.proto.resp.next_msn();
            qp.proto.resp.epsn = psn.add(1);
            qp.proto.resp.owe(psn, msn);
        }
    }
    true
}

/// Completes receive WQE `wqe` (taken from the QP's own receive queue, the receive CQ has
/// room) with the message of `pkt`, and accepts `pkt` as the pipeline does: retired, its
/// completion (with immediate data `imm`) pushed, the MSN counted, ePSN advanced, the Ack
/// owed.
#[inline(always)]
fn deliver_fast(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    wqe: &RqWqe,
    opcode: WcOpcode,
    byte_len: u32,
    imm: Option<u32>,
    pkt: &RxPacket<'_>,
) {
    let psn = pkt.psn();
    let wc = shmhca_proto::responder::recv_completion(
        &qp.proto,
        wqe.wr_id,
        WcStatus::Success,
        opcode,
        byte_len,
        imm,
        pkt.solicited(),
    );
    qp.retire_recv(env, wqe);
    let pushed = env.cqs.push(qp.proto.recv_cq, wc);
    debug_assert!(pushed, "room was checked");
    let msn = qp.proto.resp.next_msn();
    qp.proto.resp.epsn = psn.add(1);
    qp.proto.resp.owe(psn, msn);
}

/// Check 6, R_Key: `len` bytes at `va` through `rkey`, with access `need`, in this QP's domain;
/// the offset in the arena.
fn check_rkey(
    qp: &QpSlot,
    env: &Env<'_>,
    rkey: u32,
    need: AccessFlags,
    va: u64,
    len: u64,
) -> Result<u64, RespError> {
    env.check_remote(rkey, (qp.proto.pd, qp.proto.qpn), need, va, len)
        .map_err(|why| {
            record_rkey_refusal(qp, rkey, need, va, len, why);
            RespError::RKeyViolation
        })
}

/// Records in words why this responder refused a request's R_Key ([`crate::Qp::last_error`]):
/// the requester's completion says only RemAccessErr, and this side only sees its QP go to
/// the Error state. Error path only (the refusal is fatal to the QP).
#[cold]
#[inline(never)]
fn record_rkey_refusal(
    qp: &QpSlot,
    rkey: u32,
    need: AccessFlags,
    va: u64,
    len: u64,
    why: crate::tables::mr::AccessDenied,
) {
    use crate::tables::mr::AccessDenied as D;
    let op = if need.contains(AccessFlags::REMOTE_WRITE) {
        "an RDMA Write"
    } else if need.contains(AccessFlags::REMOTE_READ) {
        "an RDMA Read"
    } else {
        "an Atomic"
    };
    let why = match why {
        D::UnknownKey => "no region or window of this context has this key",
        D::StaleKey => "the key's region or window was deregistered (a stale key)",
        D::WrongPd => "the region is in another protection domain than this QP",
        D::WrongQp => "the window is bound to another QP",
        D::NoRights => "the region does not grant that remote access",
        D::OutOfBounds => "the range is outside the region",
    };
    let text = format!(
        "this QP's responder refused {op} of {len} bytes at {va:#x} with R_Key {rkey:#x}: \
         {why}; it sent a Remote Access Error Nak (the requester's completion: RemAccessErr)"
    );
    *qp.shared
        .last_error
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(text);
}

/// Sends queued responses as far as the link has room, then, if credits went up while the
/// requester may be waiting for them, an unsolicited Ack (spec/02).
///
/// In the Error state only Naks leave, unless a fatal Nak of this responder is queued:
/// then the responses ahead of it leave too, in order, and the Nak last.
///
/// An Ack queued here (behind a Read's responses) leaves in order; an owed Ack leaves
/// with [`send_owed_ack`] at the end of the iteration. Either way an Ack never waits for a
/// later iteration unless the link is full: in inline mode there may be none — the
/// application that just received its completion may stop polling — and a real HCA
/// acknowledges whatever the application does.
///
/// Called for every active QP every iteration, and nearly always with nothing to do: that
/// answer costs a few loads here ([`credit_update_due`]), not a call.
#[inline(always)]
pub(crate) fn drain<L: LinkTx + ?Sized>(qp: &mut QpSlot, env: &mut Env<'_>, tx: &mut L) {
    if qp.proto.resp.has_output() && !drain_queued(qp, env, tx) {
        return; // the link is full (the credit update waits behind), or a fatal Nak left
    }
    if credit_update_due(qp) {
        send_credit_update(qp, env, tx);
    }
}

/// Sends the queued responses as far as the link has room ([`drain`]); whether the credit
/// update may follow (all sent, and the last was not a fatal Nak).
#[inline(never)]
fn drain_queued<L: LinkTx + ?Sized>(qp: &mut QpSlot, env: &mut Env<'_>, tx: &mut L) -> bool {
    // The early answers were ahead of everything queued, and sent.
    qp.proto.resp.settle_all();
    let Some(dest) = qp.proto.cfg.dest else {
        return false;
    };
    let pmtu = qp.proto.cfg.path_mtu.bytes();
    let discard = qp.proto.state == QpState::Error && !qp.proto.resp.closing;
    while let Some(front) = qp.proto.resp.out.front_mut() {
        match *front {
            Out::Nak { psn, syndrome } => {
                if !emit_nak(tx, env, dest.qpn, psn, syndrome, qp.proto.resp.msn) {
                    return false;
                }
            }
            Out::Fatal { psn, code } => {
                if !emit_nak(
                    tx,
                    env,
                    dest.qpn,
                    psn,
                    Syndrome::Nak(code),
                    qp.proto.resp.msn,
                ) {
                    return false;
                }
                // The last response: whatever is queued behind it answers nothing.
                let resp = &mut qp.proto.resp;
                resp.out.clear();
                resp.rd_atomic_queued = 0;
                resp.dup_queued = 0;
                resp.closing = false;
                return false;
            }
            _ if discard => {}
            Out::Ack { psn, msn } => {
                let code = credit_code(qp);
                if !emit_aeth(
                    tx,
                    env,
                    dest.qpn,
                    Opcode::Acknowledge,
                    psn,
                    Syndrome::Ack { credits: code },
                    msn,
                    None,
                ) {
                    return false;
                }
                advertise(qp, code.credits());
                env.stats.acks_sent += 1;
            }
            Out::Atomic {
                psn,
                orig,
                msn,
                dup,
            } => {
                let code = credit_code(qp);
                if !emit_aeth(
                    tx,
                    env,
                    dest.qpn,
                    Opcode::AtomicAcknowledge,
                    psn,
                    Syndrome::Ack { credits: code },
                    msn,
                    Some(orig),
                ) {
                    return false;
                }
                advertise(qp, code.credits());
                qp.proto.resp.release_rd_atomic(dup);
            }
            Out::Read(ref mut job) => {
                let mut j = *job;
                while j.next < j.npkts {
                    if !tx.has_room() {
                        if let Some(Out::Read(job)) = qp.proto.resp.out.front_mut() {
                            *job = j;
                        }
                        return false;
                    }
                    if let Err(psn) = read_response(qp, env, tx, dest.qpn, &j, pmtu) {
                        // The region went away mid-read: the Nak goes next, and last.
                        // (The Nak gives back every responder resource.)
                        let resp = &mut qp.proto.resp;
                        resp.out.pop_front();
                        resp.out.push_front(Out::Fatal {
                            psn,
                            code: fatal_code(RespError::ReadSourceGone),
                        });
                        resp.closing = true;
                        qp.enter_error(env);
                        break;
                    }
                    j.next += 1;
                }
                if j.next < j.npkts {
                    continue;
                }
                qp.proto.resp.release_rd_atomic(j.dup);
            }
        }
        qp.proto.resp.out.pop_front();
    }
    true
}

/// Whether [`drain`] sends an unsolicited credit update: the requester was told of fewer
/// than [`CREDIT_WATCH`] receive WQEs (none, or no report yet), no Ack is owed (it reports
/// the credits when it leaves, at the end of the iteration), the QP reports credits (not in
/// the Error state; a QP on a shared receive queue reports the invalid code, spec/02 Table
/// 17-8: there is nothing to update), and the report would tell the requester something:
/// the first report, or a receive WQE waiting where the requester was told of none
/// ([`CREDIT_WATCH`] is 1). The last is one load of the receive queue's index, here rather
/// than behind a call: a QP with no receives posted (a sender's) meets the rest on every
/// post.
#[inline(always)]
fn credit_update_due(qp: &QpSlot) -> bool {
    const _: () = assert!(CREDIT_WATCH == 1, "the look below is for none against some");
    qp.proto.resp.advertised.is_none_or(|a| a < CREDIT_WATCH)
        && qp.proto.resp.owed.is_none()
        && qp.proto.state != QpState::Error
        && qp.srq.is_none()
        && (qp.proto.resp.advertised.is_none() || !qp.rq.looks_empty())
}

#[cfg(test)]
thread_local! {
    /// Calls of [`send_credit_update`] on this thread (tests: an update looked for with
    /// nothing to report is work for nothing).
    static CREDIT_UPDATE_CALLS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many times this thread's engine runs called [`send_credit_update`] (tests).
#[cfg(test)]
pub(crate) fn credit_update_calls() -> u64 {
    CREDIT_UPDATE_CALLS.with(std::cell::Cell::get)
}

/// Unsolicited credit update ([`drain`], when [`credit_update_due`]): when credits grew
/// from (nearly) nothing, tell the requester rather than leave it probing.
#[inline(never)]
fn send_credit_update<L: LinkTx + ?Sized>(qp: &mut QpSlot, env: &mut Env<'_>, tx: &mut L) {
    #[cfg(test)]
    CREDIT_UPDATE_CALLS.with(|c| c.set(c.get() + 1));
    let Some(dest) = qp.proto.cfg.dest else {
        return;
    };
    let available = qp.rq.waiting();
    let stale = qp.proto.resp.advertised.is_none_or(|a| a < available);
    if stale && qp.proto.state.receives() {
        let code = CreditCode::encode(available);
        let psn = qp.proto.resp.epsn.sub(1);
        if emit_aeth(
            tx,
            env,
            dest.qpn,
            Opcode::Acknowledge,
            psn,
            Syndrome::Ack { credits: code },
            qp.proto.resp.msn,
            None,
        ) {
            advertise(qp, code.credits());
            env.stats.acks_sent += 1;
        }
    }
}

/// Sends the positive Ack `qp` owes, if any, with the credits of now; false if the link has
/// no room (it stays owed). In the Error state it is dropped, as queued Acks are.
///
/// Called once per iteration for every QP that owes one (the engine's `flush_owed_acks`),
/// so the Ack leaves after the receive completions of the requests it acknowledges.
pub(crate) fn send_owed_ack<L: LinkTx + ?Sized>(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    tx: &mut L,
) -> bool {
    let Some(a) = qp.proto.resp.owed else {
        return true;
    };
    let Some(dest) = qp
        .proto
        .cfg
        .dest
        .filter(|_| qp.proto.state != QpState::Error)
    else {
        qp.proto.resp.owed = None;
        return true;
    };
    let code = credit_code(qp);
    if !emit_aeth(
        tx,
        env,
        dest.qpn,
        Opcode::Acknowledge,
        a.psn,
        Syndrome::Ack { credits: code },
        a.msn,
        None,
    ) {
        return false;
    }
    qp.proto.resp.owed = None;
    advertise(qp, code.credits());
    env.stats.acks_sent += 1;
    true
}

/// Puts the positive Ack `qp` owes, if any, in request `slot` its SQ Logic has just built
/// for the same peer QP (not yet committed), when the slot can carry one
/// ([`can_carry_ack`]: a payload inline or absent): the Ack leaves with the request instead
/// of in a line of its own, with the bookkeeping of [`send_owed_ack`] (the credits of now,
/// advertised; `acks_sent`), so the end-of-iteration flush finds nothing left for this QP.
/// Called by both request builders (the template path and `transmit`).
/// Every request built passes here: it marks the QP as one that replies
/// ([`Responder::replies`]).
#[inline(always)]
pub(crate) fn ride_owed_ack(qp: &mut QpSlot, env: &mut Env<'_>, slot: &mut PacketSlot) {
    qp.proto.resp.replies = true;
    if qp.proto.resp.owed.is_some() && can_carry_ack(slot) {
        ride(qp, env, slot);
    }
}

/// [`ride_owed_ack`] once an Ack is owed and the slot has room. With the credit code kept
/// from the last count (the common case) it calls nothing, so it saves no registers.
#[inline(never)]
fn ride(qp: &mut QpSlot, env: &mut Env<'_>, slot: &mut PacketSlot) {
    let Some(a) = qp.proto.resp.owed else { return };
    if qp.proto.state == QpState::Error {
        return; // `send_owed_ack` drops it
    }
    match kept_credit_code(qp) {
        Some(code) => put_riding_ack(qp, env, slot, a, code),
        None => ride_counting(qp, env, slot, a),
    }
}

/// [`ride`] when the receive WQEs must be counted for the credit code.
#[inline(never)]
fn ride_counting(qp: &mut QpSlot, env: &mut Env<'_>, slot: &mut PacketSlot, a: OwedAck) {
    let code = count_credits(qp);
    put_riding_ack(qp, env, slot, a, code);
}

/// Puts owed Ack `a` with credit code `code` in `slot` if it has room, with the bookkeeping
/// of [`send_owed_ack`].
#[inline(always)]
fn put_riding_ack(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    slot: &mut PacketSlot,
    a: OwedAck,
    code: CreditCode,
) {
    let word = riding_word(
        a.psn.get(),
        Syndrome::Ack { credits: code }.to_u8(),
        Msn::new(a.msn).get(),
    );
    if set_riding_ack(slot, word) {
        qp.proto.resp.owed = None;
        advertise(qp, code.credits());
        env.stats.acks_sent += 1;
        env.stats.acks_riding += 1;
    }
}

/// The Nak code of a fatal error.
fn fatal_code(e: RespError) -> NakCode {
    match verdict(e).reply {
        Reply::Nak(code) => code,
        _ => NakCode::InvalidRequest,
    }
}

/// Below this many credits reported, the responder watches for new receive WQEs and sends
/// an unsolicited credit update when some arrive: 1, i.e. only while the requester knows of
/// none. A requester that knows of even one receive WQE is not held back (spec/02: only a
/// Send beyond its limit waits), and the Ack of what it sends reports the receives posted
/// meanwhile; an update then would be a packet per re-posted receive for nothing (a
/// ping-pong keeping 4 receives posted paid one per message when this was 4).
pub(crate) const CREDIT_WATCH: u32 = 1;

/// Records the credit count last reported to the requester (`None`: none yet) and tells
/// `post_recv` whether new receives must ring the doorbell ([`QpShared::rq_watch`]).
///
/// [`QpShared::rq_watch`]: crate::context::QpShared::rq_watch
pub(crate) fn advertise(qp: &mut QpSlot, credits: Option<u32>) {
    // The same count again (a ping-pong's every Ack): the watch flag already says what it
    // would say (only this function writes it, from this count).
    if qp.proto.resp.advertised == credits {
        return;
    }
    qp.proto.resp.advertised = credits;
    let watch = credits.is_none_or(|c| c < CREDIT_WATCH);
    // Stored only on a change, so that the line the application reads stays in its cache.
    // SYNC: Relaxed: a stale value costs at most one credit update, never progress (a
    // requester without credit still sends one message at a time, spec/02).
    if qp.shared.rq_watch.load(Ordering::Relaxed) != watch {
        qp.shared.rq_watch.store(watch, Ordering::Relaxed);
    }
}

/// The credit code for the receive WQEs posted now (Table 17-8, rounded down). A QP on a
/// shared receive queue has no receive WQEs of its own to count — the SRQ's are shared
/// with other QPs — so it reports the invalid code 11111 ("not providing credit
/// information", spec/02): its requester sends as without credits.
///
/// Every Ack asks; most find the count they found last (a ping-pong's receiver re-posts
/// what it took before it answers): the code kept with that count ([`CreditCache`])
/// serves, one load of the RQ's index, none of its checks nor the encoding.
#[inline]
fn credit_code(qp: &mut QpSlot) -> CreditCode {
    kept_credit_code(qp).unwrap_or_else(|| count_credits(qp))
}

/// [`credit_code`] without counting: `None` when the receive WQEs must be counted.
#[inline(always)]
fn kept_credit_code(qp: &QpSlot) -> Option<CreditCode> {
    if qp.srq.is_some() {
        return Some(CreditCode::NONE);
    }
    #[cfg(test)]
    let fast = crate::probe::enabled();
    #[cfg(not(test))]
    let fast = true;
    if fast && qp.rq.still_waiting(qp.credits.count) {
        #[cfg(test)]
        crate::probe::count(crate::probe::Path::CreditCache);
        return Some(qp.credits.code);
    }
    None
}

/// [`credit_code`] when the count changed: counts the receive WQEs and keeps the code.
#[inline(never)]
fn count_credits(qp: &mut QpSlot) -> CreditCode {
    let count = qp.rq.waiting();
    let code = CreditCode::encode(count);
    qp.credits = CreditCache { count, code };
    code
}

/// A QP's credit code and the count of receive WQEs it encodes ([`credit_code`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CreditCache {
    /// The receive WQEs counted, or `u32::MAX` (more than any RQ holds) before the first
    /// count.
    count: u32,
    /// The code of `count`.
    code: CreditCode,
}

impl Default for CreditCache {
    fn default() -> CreditCache {
        CreditCache {
            count: u32::MAX,
            code: CreditCode::NONE,
        }
    }
}

/// Sends a Nak or RNR Nak (an Acknowledge with `syndrome`) and counts it; false if the link
/// has no room.
fn emit_nak<L: LinkTx + ?Sized>(
    tx: &mut L,
    env: &mut Env<'_>,
    dest: crate::wire::Qpn,
    psn: Psn,
    syndrome: Syndrome,
    msn: u32,
) -> bool {
    let sent = emit_aeth(tx, env, dest, Opcode::Acknowledge, psn, syndrome, msn, None);
    if sent {
        env.stats.nak_sent(syndrome);
    }
    sent
}

/// Emits an Acknowledge or Atomic Acknowledge; false if the link has no room.
#[allow(clippy::too_many_arguments)]
fn emit_aeth<L: LinkTx + ?Sized>(
    tx: &mut L,
    env: &mut Env<'_>,
    dest: crate::wire::Qpn,
    opcode: Opcode,
    psn: Psn,
    syndrome: Syndrome,
    msn: u32,
    atomic_orig: Option<u64>,
) -> bool {
    let Some(slot) = tx.next_slot() else {
        return false;
    };
    write_ack_headers(slot, opcode, dest, psn, syndrome, msn, atomic_orig);
    slot.kind = KIND_NONE;
    tx.commit();
    env.stats.packets_sent += 1;
    true
}

/// Writes the headers of an Acknowledge (BTH and AETH) or Atomic Acknowledge (and the
/// AtomicAckETH of `atomic_orig`) into `slot` and sets its header length: the bytes
/// [`HeaderWriter`] writes, built in two registers. Every field but the PSN, the MSN, the
/// destination QP and the syndrome is a constant of an Ack (no SE, MigReq, pad or AckReq,
/// TVer 0, the default P_Key).
#[inline]
fn write_ack_headers(
    slot: &mut crate::wire::slot::PacketSlot,
    opcode: Opcode,
    dest: crate::wire::Qpn,
    psn: Psn,
    syndrome: Syndrome,
    msn: u32,
    atomic_orig: Option<u64>,
) {
    debug_assert!(matches!(
        opcode,
        Opcode::Acknowledge | Opcode::AtomicAcknowledge
    ));
    write_aeth_headers(slot, opcode, 0, dest, psn, syndrome, msn, atomic_orig);
}

/// [`write_ack_headers`] for any response with an AETH right behind the BTH — an
/// Acknowledge, an Atomic Acknowledge (with `atomic_orig`), an RDMA Read Response Only
/// (the fast path's) — with pad count `pad` (the one field besides the opcode that
/// differs from an Ack's).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn write_aeth_headers(
    slot: &mut crate::wire::slot::PacketSlot,
    opcode: Opcode,
    pad: u8,
    dest: crate::wire::Qpn,
    psn: Psn,
    syndrome: Syndrome,
    msn: u32,
    atomic_orig: Option<u64>,
) {
    debug_assert_eq!(opcode == Opcode::AtomicAcknowledge, atomic_orig.is_some());
    debug_assert!(pad < 4);
    // BTH bytes 0..8: opcode, flags (the pad count in bits 5..4), P_Key, reserved (0),
    // destination QP.
    let head = (u64::from(opcode.code()) << 56)
        | (u64::from(pad & 3) << 52)
        | (u64::from(crate::wire::BthRepr::DEFAULT_PKEY) << 32)
        | u64::from(dest.get());
    // BTH bytes 8..12: AckReq and reserved (0), PSN; then the AETH: syndrome, MSN.
    let tail = (u64::from(psn.get()) << 32)
        | (u64::from(syndrome.to_u8()) << 24)
        | u64::from(Msn::new(msn).get());
    slot.data[..8].copy_from_slice(&head.to_be_bytes());
    slot.data[8..16].copy_from_slice(&tail.to_be_bytes());
    let mut len = crate::wire::bth::HEADER_LEN + crate::wire::aeth::HEADER_LEN;
    if let Some(orig) = atomic_orig {
        slot.data[len..len + 8].copy_from_slice(&orig.to_be_bytes());
        len += 8;
    }
    slot.hdr_len = len as u8;
}

fn bth(opcode: Opcode, dest: crate::wire::Qpn, psn: Psn) -> BthRepr {
    BthRepr {
        opcode,
        solicited: false,
        mig_req: false,
        pad_count: 0,
        tver: 0,
        pkey: crate::wire::BthRepr::DEFAULT_PKEY,
        dest_qp: dest,
        ack_req: false,
        psn,
    }
}

/// Emits response packet `job.next` of an RDMA Read (the link has room). Fails with the
/// PSN to Nak (Remote Access Error) if the region can no longer be read.
fn read_response<L: LinkTx + ?Sized>(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    tx: &mut L,
    dest: crate::wire::Qpn,
    job: &ReadJob,
    pmtu: u32,
) -> Result<(), Psn> {
    let k = job.next;
    let offset = k * pmtu;
    let plen = (job.len - offset).min(pmtu);
    let psn = job.psn.add(k);
    let off = env
        .check_remote(
            job.rkey,
            (qp.proto.pd, qp.proto.qpn),
            AccessFlags::REMOTE_READ,
            job.va.wrapping_add(u64::from(offset)),
            u64::from(plen),
        )
        .map_err(|_| psn)?;
    // A registered application buffer is staged in its shadow, which the peer can read.
    let off = env
        .mrs
        .stage_read(off, u64::from(plen), &qp.mem)
        .ok_or(psn)?;
    let position = match (job.npkts, k) {
        (1, _) => Position::Only,
        (_, 0) => Position::First,
        (n, k) if k + 1 == n => Position::Last,
        _ => Position::Middle,
    };
    let credits = credit_code(qp);
    let Some(slot) = tx.next_slot() else {
        unreachable!("room was checked");
    };
    let mut b = bth(
        Opcode::find(OpClass::RdmaReadResponse, position, false, false)
            .expect("every read response position has an opcode"),
        dest,
        psn,
    );
    b.pad_count = ((4 - plen % 4) % 4) as u8;
    let mut h = HeaderWriter::new(slot, &b);
    if position != Position::Middle {
        h = h.aeth(&AethRepr {
            syndrome: Syndrome::Ack { credits },
            msn: Msn::new(job.msn),
        });
    }
    let slot = h.finish();
    let src = DataLoc::Single(SgeEntry {
        off,
        len: plen,
        mr: NO_MR,
    });
    // One range of the checked region: it lies in the arena, so this cannot fail; if it
    // did, the requester gets a Nak, not a panic here.
    let inline = dma::describe(
        slot,
        &mut [],
        &qp.mem,
        Sgl::new(&src, &qp.tables),
        Cursor::default(),
        plen,
    )
    .ok_or(psn)?;
    tx.commit();
    env.stats.packets_sent += 1;
    env.stats.inline_bytes_sent += inline;
    Ok(())
}

#[cfg(test)]
mod ack_header_tests {
    use bytemuck::Zeroable;

    use super::*;
    use crate::wire::Qpn;
    use crate::wire::slot::PacketSlot;

    /// The Ack template writes exactly what the generic header writer writes, for the
    /// edges of every field and every syndrome byte.
    #[test]
    fn ack_template_matches_the_header_writer() {
        for syn in 0..=u8::MAX {
            for (dest, psn, msn) in [
                (0, 0, 0),
                (0xFF_FFFF, 0xFF_FFFF, 0xFF_FFFF),
                (0x12_3456, 0xAB_CDEF, 0x01_0203),
                (1, 0x80_0000, 0x7F_FFFF),
            ] {
                for orig in [None, Some(0x0102_0304_0506_0708u64), Some(u64::MAX)] {
                    let opcode = if orig.is_some() {
                        Opcode::AtomicAcknowledge
                    } else {
                        Opcode::Acknowledge
                    };
                    let (dest, psn) = (Qpn::new(dest), Psn::new(psn));
                    let syndrome = Syndrome::from_u8(syn);
                    let mut want = PacketSlot::zeroed();
                    let h = HeaderWriter::new(&mut want, &bth(opcode, dest, psn)).aeth(&AethRepr {
                        syndrome,
                        msn: Msn::new(msn),
                    });
                    match orig {
                        Some(o) => h.atomic_ack_eth(o).finish(),
                        None => h.finish(),
                    };
                    // Garbage where the headers go: every byte must be written.
                    let mut got = PacketSlot::zeroed();
                    got.data.fill(0xA5);
                    write_ack_headers(&mut got, opcode, dest, psn, syndrome, msn, orig);
                    let n = want.hdr_len as usize;
                    assert_eq!(got.hdr_len, want.hdr_len);
                    assert_eq!(got.data[..n], want.data[..n], "{syndrome:?} {orig:?}");
                }
                // The Read Response Only of the fast path, with every pad count.
                for pad in 0..4 {
                    let (dest, psn) = (Qpn::new(dest), Psn::new(psn));
                    let syndrome = Syndrome::from_u8(syn);
                    let op = Opcode::RdmaReadResponseOnly;
                    let mut b = bth(op, dest, psn);
                    b.pad_count = pad;
                    let mut want = PacketSlot::zeroed();
                    HeaderWriter::new(&mut want, &b)
                        .aeth(&AethRepr {
                            syndrome,
                            msn: Msn::new(msn),
                        })
                        .finish();
                    let mut got = PacketSlot::zeroed();
                    got.data.fill(0xA5);
                    write_aeth_headers(&mut got, op, pad, dest, psn, syndrome, msn, None);
                    let n = want.hdr_len as usize;
                    assert_eq!(got.hdr_len, want.hdr_len);
                    assert_eq!(got.data[..n], want.data[..n], "{syndrome:?} pad {pad}");
                }
            }
        }
    }
}
