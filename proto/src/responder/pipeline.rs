//! The RQ Logic's receive pipeline (spec/01, spec/02): a request runs through the checks in
//! the rxe responder's order (`CHK_PSN → CHK_OP_SEQ → CHK_OP_VALID → CHK_RESOURCE →
//! CHK_LENGTH → CHK_RKEY → EXECUTE`), is executed, and is acknowledged; the first check
//! that fails refuses it, and [`verdict`](super::verdict) says what the refusal sends back,
//! how a receive WQE in use completes, and whether the QP is lost ([`refuse`]).
//!
//! What touches memory and the driver's tables — receive WQEs and the receive CQ, R_Key
//! and memory window checks, payload copies, the Atomic on the target word, the Error
//! state — goes through a [`ResponderDriver`]. Responses (Acks, Naks, Read responses,
//! Atomic Acknowledges) are queued in the [`Responder`](super::Responder) and the driver
//! sends them.

use crate::completion::{WcOpcode, WcStatus, WorkCompletion};
use crate::psn::{self, Psn};
use crate::qp::{AccessFlags, MAX_RD_ATOMIC, Qp};
use crate::wire::aeth::{NakCode, RnrTimer, Syndrome};
use crate::wire::opcode::{OpClass, OpcodeInfo, Position};
use crate::wire::{AtomicEthRepr, RethRepr};
use crate::wqe::{Cursor, RqWqe};

use super::{
    Fresh, Inbound, Out, ReadJob, Reply, RespError, check_opcode_sequence, check_operation_enabled,
    check_packet_length, check_psn, check_state, verdict,
};

/// What the RQ Logic reads of a request packet: its headers, parsed and bounds-checked by
/// the link that received it.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    /// Its opcode's row of the opcode table.
    pub info: &'static OpcodeInfo,
    /// Its PSN.
    pub psn: Psn,
    /// Bytes of payload.
    pub payload_len: u32,
    /// Its RETH, if it has one.
    pub reth: Option<RethRepr>,
    /// Its AtomicETH, if it has one.
    pub atomic_eth: Option<AtomicEthRepr>,
    /// Its immediate data, if it has some.
    pub imm: Option<u32>,
    /// The R_Key its IETH names, if it has one.
    pub ieth: Option<u32>,
    /// Its Solicited Event bit.
    pub solicited: bool,
    /// Its AckReq bit: the requester asks for an Ack of this packet.
    pub ack_req: bool,
}

/// Why a Send's payload did not land in its receive WQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvCopyError {
    /// The receive WQE's scatter list is shorter than the message.
    TooShort,
    /// The payload's bytes are out of the sender's bounds, or the list's memory is gone.
    Failed,
}

/// What the receive pipeline needs of whoever drives the QP.
pub trait ResponderDriver {
    /// The QP's protocol half.
    fn qp(&mut self) -> &mut Qp;

    /// The driver's count of packets received before the current burst (the same all
    /// through one burst of the QP's link, higher in any later one): early answers'
    /// resources are settled against it ([`Responder::settle`](super::Responder::settle)).
    fn burst(&mut self) -> u64;

    /// Whether the receive CQ has room for one more completion.
    fn recv_cq_has_room(&mut self) -> bool;

    /// Takes the next receive WQE (from the QP's receive queue or its shared one).
    fn take_recv(&mut self) -> Option<RqWqe>;

    /// Invalidates the type 2 memory window `rkey` bound to this QP (a Send with
    /// Invalidate); false if this QP may not.
    fn invalidate(&mut self, rkey: u32) -> bool;

    /// Copies the request's payload into `wqe`'s scatter list from `cursor` on (moving
    /// it); the bytes copied.
    fn copy_to_recv(&mut self, wqe: &RqWqe, cursor: &mut Cursor) -> Result<u64, RecvCopyError>;

    /// Checks a remote access of `len` bytes at `va` through `rkey` with rights `need` in
    /// this QP's domain; the offset in its memory, or [`RespError::RKeyViolation`] (the
    /// driver may record why).
    fn check_rkey(
        &mut self,
        rkey: u32,
        need: AccessFlags,
        va: u64,
        len: u64,
    ) -> Result<u64, RespError>;

    /// Writes the request's payload (`len` bytes) at `off` of the QP's memory, its last
    /// bytes last.
    fn write_payload(&mut self, off: u64, len: u32) -> Result<(), RespError>;

    /// Runs an Atomic on the 8-byte word at `off`: compare-and-swap (`cas`) of `compare`
    /// with `swap_add`, or fetch-and-add of `swap_add`; the original value, `None` if the
    /// word cannot be operated on (its memory is gone).
    fn atomic(&mut self, off: u64, cas: bool, compare: u64, swap_add: u64) -> Option<u64>;

    /// Retires `wqe` and pushes `wc` to the receive CQ (in that order); false, with
    /// nothing done, if the CQ is full.
    fn complete_recv(&mut self, wqe: &RqWqe, wc: WorkCompletion) -> bool;

    /// Moves the QP to the Error state.
    fn enter_error(&mut self);

    /// Counts a packet dropped.
    fn dropped(&mut self);
}

/// Handles request `r` the full way: the checks, then the execution; a refusal is
/// answered as the table says ([`refuse`]).
pub fn handle_request<D: ResponderDriver>(d: &mut D, r: &Request) {
    if let Err(e) = receive(d, r) {
        refuse(d, r.psn, e);
    }
}

fn receive<D: ResponderDriver>(d: &mut D, r: &Request) -> Result<(), RespError> {
    let burst = d.burst();
    let qp = d.qp();
    qp.resp.settle(burst);
    check_state(qp.state)?;
    let fresh = check_psn(r.psn, qp.resp.epsn, qp.resp.nak_outstanding)?;
    if fresh == Fresh::Duplicate {
        return duplicate(d, r);
    }
    qp.resp.nak_outstanding = false;
    let in_message = match qp.resp.cur {
        Inbound::Idle => None,
        Inbound::Send { .. } => Some(OpClass::Send),
        Inbound::Write { .. } => Some(OpClass::RdmaWrite),
    };
    check_opcode_sequence(in_message, r.info)?;
    check_operation_enabled(qp.cfg.access, r.info.class)?;
    match r.info.class {
        OpClass::Send => send(d, r),
        OpClass::RdmaWrite => write(d, r),
        OpClass::RdmaReadRequest => read(d, r),
        OpClass::CompareSwap | OpClass::FetchAdd => atomic(d, r),
        _ => Err(RespError::NotReceiving),
    }
}

/// Answers a refused request as [`verdict`] says: a Nak (the last packet of the QP if the
/// error is fatal, a receive WQE in use completing in error), an RNR Nak, or nothing.
pub fn refuse<D: ResponderDriver>(d: &mut D, psn: Psn, e: RespError) {
    let v = verdict(e);
    if v.dropped {
        d.dropped();
    }
    match v.reply {
        Reply::Nothing => {}
        Reply::Nak(code) if v.fatal => {
            fatal(d, psn, code, v.recv_status.unwrap_or(WcStatus::LocQpOpErr));
        }
        // A sequence error names the PSN expected: the requester resends from there.
        Reply::Nak(code) => {
            let resp = &mut d.qp().resp;
            let epsn = resp.epsn;
            resp.queue_nak(epsn, Syndrome::Nak(code));
        }
        Reply::RnrNak => {
            let qp = d.qp();
            let timer = RnrTimer::new(qp.cfg.min_rnr_timer);
            qp.resp.queue_nak(psn, Syndrome::RnrNak { timer });
        }
    }
}

/// A fatal refusal: its Nak is the QP's last packet, a receive WQE in use completes with
/// `local` (or, the CQ being full, is flushed with it later), and the QP goes to the Error
/// state.
fn fatal<D: ResponderDriver>(d: &mut D, psn: Psn, code: NakCode, local: WcStatus) {
    let qp = d.qp();
    qp.resp.queue_fatal(psn, code);
    if let Some(wqe) = qp.resp.take_current_wqe() {
        let wc = recv_completion(qp, wqe.wr_id, local, WcOpcode::Recv, 0, None, false);
        if !d.complete_recv(&wqe, wc) {
            let resp = &mut d.qp().resp;
            resp.put_back_current_wqe(wqe);
            resp.cur_status = local;
        }
    } else {
        qp.resp.cur = Inbound::Idle;
    }
    d.enter_error();
}

/// A receive completion of `qp`.
pub fn recv_completion(
    qp: &Qp,
    wr_id: u64,
    status: WcStatus,
    opcode: WcOpcode,
    byte_len: u32,
    imm_data: Option<u32>,
    solicited: bool,
) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status,
        opcode,
        byte_len,
        imm_data,
        qp_num: qp.qpn,
        solicited,
        invalidated_rkey: None,
    }
}

/// The request at `psn` is accepted: ePSN moves past it and its Ack is owed.
fn ack(qp: &mut Qp, psn: Psn) {
    let msn = qp.resp.msn;
    qp.resp.epsn = psn.add(1);
    qp.resp.owe(psn, msn);
}

/// Request `r`, a packet of a Send or RDMA Write (`last`: of its message), is accepted:
/// its Ack is owed, unless the QP acknowledges only what asks
/// ([`Responder::acks_when_asked`](crate::responder::Responder::acks_when_asked)) and this
/// First or Middle packet does not ask — then only ePSN moves past it.
fn accept(qp: &mut Qp, r: &Request, last: bool) {
    if qp.resp.acks_when_asked && !last && !r.ack_req {
        qp.resp.epsn = r.psn.add(1);
    } else {
        ack(qp, r.psn);
    }
}

/// Check 4, Resources of a message that completes a receive WQE: room in the receive CQ
/// (on its last packet) and the receive WQE. A Send takes its WQE on its first packet (it
/// becomes the message in progress); a Write with Immediate on its last (held until it
/// executes). Either way nothing is done before it is there, so an RNR Nak leaves nothing
/// half done.
fn check_receive_resources<D: ResponderDriver>(
    d: &mut D,
    last: bool,
    class: OpClass,
) -> Result<(), RespError> {
    if last && !d.recv_cq_has_room() {
        return Err(RespError::ReceiveCqFull);
    }
    let resp = &d.qp().resp;
    let needed = match class {
        OpClass::Send => matches!(resp.cur, Inbound::Idle),
        _ => resp.held.is_none(),
    };
    if needed {
        let wqe = d.take_recv().ok_or(RespError::NoReceiveWqe)?;
        let resp = &mut d.qp().resp;
        if class == OpClass::Send {
            resp.cur = Inbound::Send {
                wqe,
                cursor: Cursor::default(),
                got: 0,
            };
        } else {
            resp.held = Some(wqe);
        }
    }
    Ok(())
}

/// Check 4, Resources of an RDMA Read or Atomic: a responder resource (the requester was
/// told how many it may use).
pub fn check_rd_atomic_resources(qp: &Qp) -> Result<(), RespError> {
    if qp.resp.rd_atomic_queued >= u32::from(qp.cfg.max_dest_rd_atomic.max(1)) {
        Err(RespError::TooManyReadAtomic)
    } else {
        Ok(())
    }
}

fn send<D: ResponderDriver>(d: &mut D, r: &Request) -> Result<(), RespError> {
    let info = r.info;
    let last = matches!(info.position, Position::Last | Position::Only);
    check_receive_resources(d, last, OpClass::Send)?;
    check_packet_length(info.position, r.payload_len, d.qp().cfg.path_mtu.bytes())?;
    let ieth = match (last && info.invalidate, r.ieth) {
        (false, _) => None,
        (true, Some(key)) => Some(key),
        (true, None) => return Err(RespError::MissingHeader),
    };
    // 6. Send with Invalidate: the type 2 window bound to this QP with the IETH's key stops
    // working before the message completes.
    if let Some(key) = ieth {
        if !d.invalidate(key) {
            return Err(RespError::InvalidateRefused);
        }
    }
    // 7. Execute.
    let Inbound::Send {
        wqe,
        mut cursor,
        mut got,
    } = d.qp().resp.cur
    else {
        // The resources check made it current.
        return Err(RespError::OpcodeOutOfSequence);
    };
    match d.copy_to_recv(&wqe, &mut cursor) {
        Ok(n) => got += n,
        Err(RecvCopyError::TooShort) => return Err(RespError::ReceiveTooShort),
        Err(RecvCopyError::Failed) => return Err(RespError::CopyFailed),
    }
    if last {
        d.qp().resp.cur = Inbound::Idle;
        complete_recv(d, &wqe, (WcOpcode::Recv, ieth), got as u32, r);
        d.qp().resp.next_msn();
    } else {
        d.qp().resp.cur = Inbound::Send { wqe, cursor, got };
    }
    accept(d.qp(), r, last);
    Ok(())
}

/// Retires receive WQE `wqe` and completes it successfully with the message that ended in
/// `r` (its immediate data and Solicited Event bit) and, for a Send with Invalidate, the
/// key it invalidated. The caller checked the CQ has room before touching anything.
fn complete_recv<D: ResponderDriver>(
    d: &mut D,
    wqe: &RqWqe,
    (opcode, invalidated): (WcOpcode, Option<u32>),
    byte_len: u32,
    r: &Request,
) {
    let qp = d.qp();
    let mut wc = recv_completion(
        qp,
        wqe.wr_id,
        WcStatus::Success,
        opcode,
        byte_len,
        r.imm,
        r.solicited,
    );
    wc.invalidated_rkey = invalidated;
    let completed = d.complete_recv(wqe, wc);
    debug_assert!(completed, "room was checked");
}

fn write<D: ResponderDriver>(d: &mut D, r: &Request) -> Result<(), RespError> {
    let info = r.info;
    let len = u64::from(r.payload_len);
    let pmtu = d.qp().cfg.path_mtu.bytes();
    let last = matches!(info.position, Position::Last | Position::Only);
    // 4. A Write with Immediate consumes a receive WQE on its last packet.
    if r.imm.is_some() {
        check_receive_resources(d, last, OpClass::RdmaWrite)?;
    }
    // 5. Length. The Write in progress: a new one named by the RETH, or the one continued.
    // It is recorded only once the packet is accepted, so that an RNR Nak leaves the
    // responder idle and the retried packet is taken for what it is.
    let (va, rkey, done, total) = match (r.reth, d.qp().resp.cur) {
        (Some(reth), _) => (reth.va, reth.rkey, 0, u64::from(reth.dma_len)),
        (
            None,
            Inbound::Write {
                va,
                rkey,
                done,
                total,
            },
        ) => (va, rkey, done, total),
        (None, _) => return Err(RespError::MissingHeader),
    };
    check_packet_length(info.position, len as u32, pmtu)?;
    let left = total - done;
    if !(if last { len == left } else { len < left }) {
        return Err(RespError::BadLength);
    }
    // 6. R_Key. The whole message's range is checked on its first packet (the RETH names
    // it), and each packet's piece again, in case the region went away in between.
    if matches!(info.position, Position::First | Position::Only) {
        d.check_rkey(rkey, AccessFlags::REMOTE_WRITE, va, total)?;
    }
    let off = d.check_rkey(rkey, AccessFlags::REMOTE_WRITE, va.wrapping_add(done), len)?;
    // 7. Execute.
    d.write_payload(off, len as u32)?;
    if last {
        d.qp().resp.cur = Inbound::Idle;
        if let Some(w) = d.qp().resp.held.take() {
            complete_recv(d, &w, (WcOpcode::RecvRdmaWithImm, None), total as u32, r);
        }
        d.qp().resp.next_msn();
    } else {
        d.qp().resp.cur = Inbound::Write {
            va,
            rkey,
            done: done + len,
            total,
        };
    }
    accept(d.qp(), r, last);
    Ok(())
}

fn read<D: ResponderDriver>(d: &mut D, r: &Request) -> Result<(), RespError> {
    let psn = r.psn;
    check_rd_atomic_resources(d.qp())?;
    let reth = r.reth.ok_or(RespError::MissingHeader)?;
    let npkts = check_read(d, &reth)?;
    let qp = d.qp();
    let msn = qp.resp.next_msn();
    qp.resp.rd_atomic_queued += 1;
    qp.resp
        .queue(Out::Read(ReadJob::new(psn, &reth, npkts, msn, false)));
    qp.resp.epsn = psn.add(npkts);
    Ok(())
}

/// Check 6 of an RDMA Read (new or repeated): its R_Key grants remote read over the whole
/// range; the number of response packets it takes.
fn check_read<D: ResponderDriver>(d: &mut D, reth: &RethRepr) -> Result<u32, RespError> {
    let len = u64::from(reth.dma_len);
    d.check_rkey(reth.rkey, AccessFlags::REMOTE_READ, reth.va, len)?;
    let pmtu = d.qp().cfg.path_mtu.bytes();
    Ok(psn::read_response_packets(reth.dma_len, pmtu))
}

fn atomic<D: ResponderDriver>(d: &mut D, r: &Request) -> Result<(), RespError> {
    let psn = r.psn;
    check_rd_atomic_resources(d.qp())?;
    let a = r.atomic_eth.ok_or(RespError::MissingHeader)?;
    if a.va % 8 != 0 {
        // Atomics work on naturally aligned 64-bit words.
        return Err(RespError::MisalignedAtomic);
    }
    let off = d.check_rkey(a.rkey, AccessFlags::REMOTE_ATOMIC, a.va, 8)?;
    let cas = r.info.class == OpClass::CompareSwap;
    let orig = d
        .atomic(off, cas, a.compare, a.swap_add)
        .ok_or(RespError::AtomicFailed)?;
    let resp = &mut d.qp().resp;
    let msn = resp.next_msn();
    if resp.atomics.len() == MAX_RD_ATOMIC as usize {
        resp.atomics.pop_front();
    }
    resp.atomics.push_back((psn, orig, msn));
    resp.rd_atomic_queued += 1;
    resp.queue(Out::Atomic {
        psn,
        orig,
        msn,
        dup: false,
    });
    resp.epsn = psn.add(1);
    Ok(())
}

/// Answers a duplicate request without executing it again.
fn duplicate<D: ResponderDriver>(d: &mut D, r: &Request) -> Result<(), RespError> {
    match r.info.class {
        OpClass::Send | OpClass::RdmaWrite => {
            let resp = &mut d.qp().resp;
            let (psn, msn) = (resp.epsn.sub(1), resp.msn);
            resp.owe(psn, msn);
        }
        OpClass::RdmaReadRequest => {
            // The requester asks again from some response on: serve that range again.
            let Some(reth) = r.reth else {
                return Ok(());
            };
            // Checked again like a new Read, and refused like one: the region may have gone
            // since the original.
            let npkts = check_read(d, &reth)?;
            let resp = &mut d.qp().resp;
            if resp.dup_queued < u32::from(MAX_RD_ATOMIC) {
                resp.dup_queued += 1;
                let msn = resp.msn;
                resp.queue(Out::Read(ReadJob::new(r.psn, &reth, npkts, msn, true)));
            }
        }
        OpClass::CompareSwap | OpClass::FetchAdd => {
            let psn = r.psn;
            let resp = &mut d.qp().resp;
            if let Some(&(p, orig, msn)) = resp.atomics.iter().find(|(p, ..)| *p == psn) {
                if resp.dup_queued < u32::from(MAX_RD_ATOMIC) {
                    resp.dup_queued += 1;
                    resp.queue(Out::Atomic {
                        psn: p,
                        orig,
                        msn,
                        dup: true,
                    });
                }
            }
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{CqId, PdId};
    use crate::qp::{Mtu, QpState};
    use crate::responder::OwedAck;
    use crate::wire::Qpn;
    use crate::wire::opcode::Opcode;
    use crate::wqe::DataLoc;
    use alloc::vec::Vec;

    /// A driver that records what it was asked; its receive queue, CQ room, key check and
    /// copies are set by the test.
    struct Rec {
        qp: Qp,
        recvs: Vec<RqWqe>,
        cq_room: usize,
        key_ok: bool,
        copy: Result<u64, RecvCopyError>,
        completions: Vec<WorkCompletion>,
        errors: usize,
        dropped: usize,
        atomics: Vec<(u64, bool, u64, u64)>,
        word: u64,
    }

    impl ResponderDriver for Rec {
        fn qp(&mut self) -> &mut Qp {
            &mut self.qp
        }
        fn burst(&mut self) -> u64 {
            1
        }
        fn recv_cq_has_room(&mut self) -> bool {
            self.cq_room > 0
        }
        fn take_recv(&mut self) -> Option<RqWqe> {
            (!self.recvs.is_empty()).then(|| self.recvs.remove(0))
        }
        fn invalidate(&mut self, rkey: u32) -> bool {
            rkey == 0x77
        }
        fn copy_to_recv(&mut self, _: &RqWqe, c: &mut Cursor) -> Result<u64, RecvCopyError> {
            if let Ok(n) = self.copy {
                c.skip += n;
            }
            self.copy
        }
        fn check_rkey(
            &mut self,
            _: u32,
            _: AccessFlags,
            va: u64,
            _: u64,
        ) -> Result<u64, RespError> {
            if self.key_ok {
                Ok(va)
            } else {
                Err(RespError::RKeyViolation)
            }
        }
        fn write_payload(&mut self, _: u64, _: u32) -> Result<(), RespError> {
            Ok(())
        }
        fn atomic(&mut self, off: u64, cas: bool, compare: u64, add: u64) -> Option<u64> {
            self.atomics.push((off, cas, compare, add));
            let orig = self.word;
            self.word = if cas {
                if orig == compare { add } else { orig }
            } else {
                orig + add
            };
            Some(orig)
        }
        fn complete_recv(&mut self, _: &RqWqe, wc: WorkCompletion) -> bool {
            if self.cq_room == 0 {
                return false;
            }
            self.cq_room -= 1;
            self.completions.push(wc);
            true
        }
        fn enter_error(&mut self) {
            self.qp.state = QpState::Error;
            self.errors += 1;
        }
        fn dropped(&mut self) {
            self.dropped += 1;
        }
    }

    fn rec() -> Rec {
        let mut qp = Qp::new(Qpn::new(7), PdId::new(0), (CqId::new(0), CqId::new(0)), 4);
        qp.state = QpState::Rtr;
        qp.cfg.path_mtu = Mtu::Mtu256;
        qp.cfg.access = AccessFlags::ALL;
        qp.cfg.max_dest_rd_atomic = 2;
        qp.cfg.min_rnr_timer = 12;
        qp.resp.start(Psn::new(100));
        Rec {
            qp,
            recvs: Vec::new(),
            cq_room: 8,
            key_ok: true,
            copy: Ok(256),
            completions: Vec::new(),
            errors: 0,
            dropped: 0,
            atomics: Vec::new(),
            word: 5,
        }
    }

    fn recv(wr_id: u64) -> RqWqe {
        RqWqe {
            wr_id,
            data: DataLoc::Empty,
        }
    }

    fn req(op: Opcode, psn: u32, len: u32) -> Request {
        Request {
            info: op.info().expect("an RC opcode"),
            psn: Psn::new(psn),
            payload_len: len,
            reth: None,
            atomic_eth: None,
            imm: None,
            ieth: None,
            solicited: false,
            ack_req: true,
        }
    }

    fn queued(d: &Rec) -> Vec<Out> {
        d.qp.resp.out.iter().copied().collect()
    }

    /// spec/02: a Send with no receive WQE gets an RNR Nak with the QP's minimum RNR
    /// timer and nothing is consumed; posted, the retried Send fills it, completes it,
    /// and owes an Ack.
    #[test]
    fn a_send_without_a_receive_is_rnr_nakked_then_delivered() {
        let mut d = rec();
        handle_request(&mut d, &req(Opcode::SendOnly, 100, 8));
        assert!(matches!(
            queued(&d)[..],
            [Out::Nak { psn, syndrome: Syndrome::RnrNak { timer } }]
                if psn == Psn::new(100) && timer == RnrTimer::new(12)
        ));
        assert_eq!(d.qp.resp.epsn, Psn::new(100), "nothing consumed");
        d.recvs.push(recv(9));
        d.copy = Ok(8);
        handle_request(&mut d, &req(Opcode::SendOnly, 100, 8));
        assert_eq!(d.completions.len(), 1);
        assert_eq!(
            (
                d.completions[0].wr_id,
                d.completions[0].byte_len,
                d.completions[0].status
            ),
            (9, 8, WcStatus::Success)
        );
        assert_eq!(d.qp.resp.epsn, Psn::new(101));
        // Its Ack queues behind the RNR Nak (it never overtakes a queued response).
        assert!(matches!(
            queued(&d)[..],
            [Out::Nak { .. }, Out::Ack { psn, .. }] if psn == Psn::new(100)
        ));
        assert_eq!(d.qp.resp.owed_ack(), None);
    }

    /// With `acks_when_asked` (a link where each Ack is a datagram), the First and Middle
    /// packets of a Send or Write that do not ask for an Ack owe none; one that asks, and
    /// every message's last packet, do. Without it (the default) every packet accepted
    /// owes one.
    #[test]
    fn acks_when_asked_owes_only_what_asks_and_last_packets() {
        let quiet = |op, psn, len| Request {
            ack_req: false,
            ..req(op, psn, len)
        };
        let owed = |d: &Rec| d.qp.resp.owed_ack().map(|a| a.psn.get());
        for when_asked in [false, true] {
            let mut d = rec();
            d.qp.resp.acks_when_asked = when_asked;
            d.recvs.push(recv(1));
            handle_request(&mut d, &quiet(Opcode::SendFirst, 100, 256));
            assert_eq!(d.qp.resp.epsn, Psn::new(101), "accepted either way");
            assert_eq!(owed(&d), (!when_asked).then_some(100), "{when_asked}");
            handle_request(&mut d, &req(Opcode::SendMiddle, 101, 256));
            assert_eq!(owed(&d), Some(101), "it asks: {when_asked}");
            handle_request(&mut d, &quiet(Opcode::SendMiddle, 102, 256));
            assert_eq!(owed(&d), Some(if when_asked { 101 } else { 102 }));
            d.copy = Ok(10);
            handle_request(&mut d, &quiet(Opcode::SendLast, 103, 10));
            assert_eq!(owed(&d), Some(103), "a last packet: {when_asked}");
            let w = |op, psn, len| Request {
                reth: Some(RethRepr {
                    va: 0,
                    rkey: 1,
                    dma_len: 512,
                }),
                ..quiet(op, psn, len)
            };
            handle_request(&mut d, &w(Opcode::RdmaWriteFirst, 104, 256));
            assert_eq!(owed(&d), Some(if when_asked { 103 } else { 104 }));
            handle_request(&mut d, &quiet(Opcode::RdmaWriteLast, 105, 256));
            assert_eq!(owed(&d), Some(105));
        }
    }

    /// A multi-packet Send: First and Middle fill one receive WQE, the Last completes it
    /// with the whole length; a Middle out of sequence is an Invalid Request and fatal, its
    /// receive WQE completing in error.
    #[test]
    fn a_multi_packet_send_and_an_opcode_out_of_sequence() {
        let mut d = rec();
        d.recvs.push(recv(1));
        handle_request(&mut d, &req(Opcode::SendFirst, 100, 256));
        handle_request(&mut d, &req(Opcode::SendMiddle, 101, 256));
        d.copy = Ok(10);
        handle_request(&mut d, &req(Opcode::SendLast, 102, 10));
        assert_eq!(d.completions[0].byte_len, 522);
        assert_eq!(d.qp.resp.epsn, Psn::new(103));
        // A Write Middle with no Write in progress.
        handle_request(&mut d, &req(Opcode::RdmaWriteMiddle, 103, 256));
        assert_eq!(d.errors, 1);
        assert!(matches!(
            queued(&d)[..],
            [
                ..,
                Out::Fatal {
                    code: NakCode::InvalidRequest,
                    ..
                }
            ]
        ));
        // A Send in progress when a fatal error strikes completes in error.
        let mut e = rec();
        e.recvs.push(recv(2));
        handle_request(&mut e, &req(Opcode::SendFirst, 100, 256));
        handle_request(&mut e, &req(Opcode::SendFirst, 101, 256));
        assert_eq!(
            e.completions.last().map(|c| c.status),
            Some(WcStatus::LocQpOpErr)
        );
    }

    /// spec/04: a PSN ahead of ePSN gets one sequence-error Nak naming ePSN, and later ones
    /// are dropped silently until ePSN arrives; a duplicate Send is acknowledged again.
    #[test]
    fn sequence_errors_and_duplicates() {
        let mut d = rec();
        d.recvs.push(recv(1));
        handle_request(&mut d, &req(Opcode::SendOnly, 102, 8));
        handle_request(&mut d, &req(Opcode::SendOnly, 103, 8));
        assert!(matches!(
            queued(&d)[..],
            [Out::Nak { psn, syndrome: Syndrome::Nak(NakCode::PsnSequenceError) }]
                if psn == Psn::new(100)
        ));
        assert_eq!(d.dropped, 2, "both counted dropped, one Nak");
        handle_request(&mut d, &req(Opcode::SendOnly, 100, 8));
        assert_eq!(d.completions.len(), 1);
        assert!(!d.qp.resp.nak_outstanding);
        handle_request(&mut d, &req(Opcode::SendOnly, 99, 8));
        assert_eq!(d.completions.len(), 1, "a duplicate is not executed again");
    }

    /// An R_Key violation is a Remote Access Error Nak and fatal; a Write whose packets do
    /// not add up to its RETH length is an Invalid Request.
    #[test]
    fn writes_checked_by_key_and_length() {
        let reth = RethRepr {
            va: 0x1000,
            rkey: 0x42,
            dma_len: 300,
        };
        let mut d = rec();
        d.key_ok = false;
        let w = Request {
            reth: Some(reth),
            ..req(Opcode::RdmaWriteFirst, 100, 256)
        };
        handle_request(&mut d, &w);
        assert!(matches!(
            queued(&d)[..],
            [Out::Fatal {
                code: NakCode::RemoteAccessError,
                ..
            }]
        ));
        let mut e = rec();
        handle_request(&mut e, &w);
        assert_eq!(e.qp.resp.epsn, Psn::new(101));
        handle_request(&mut e, &req(Opcode::RdmaWriteLast, 101, 100));
        assert!(matches!(
            queued(&e)[..],
            [
                ..,
                Out::Fatal {
                    code: NakCode::InvalidRequest,
                    ..
                }
            ]
        ));
    }

    /// An Atomic executes once: its duplicate is answered with the saved original value; a
    /// misaligned one is an Invalid Request; past the responder resources, too.
    #[test]
    fn atomics_run_once_and_within_the_resources() {
        let eth = |va| AtomicEthRepr {
            va,
            rkey: 1,
            swap_add: 3,
            compare: 0,
        };
        let fadd = |psn, va| Request {
            atomic_eth: Some(eth(va)),
            ..req(Opcode::FetchAdd, psn, 0)
        };
        let mut d = rec();
        handle_request(&mut d, &fadd(100, 0x10));
        handle_request(&mut d, &fadd(100, 0x10));
        assert_eq!(d.atomics.len(), 1, "the duplicate did not run again");
        assert_eq!(d.word, 8);
        let origs: Vec<u64> = queued(&d)
            .iter()
            .filter_map(|o| match o {
                Out::Atomic { orig, .. } => Some(*orig),
                _ => None,
            })
            .collect();
        assert_eq!(origs, [5, 5]);
        handle_request(&mut d, &fadd(101, 0x10));
        handle_request(&mut d, &fadd(102, 0x10));
        assert!(
            matches!(
                queued(&d)[..],
                [
                    ..,
                    Out::Fatal {
                        code: NakCode::InvalidRequest,
                        ..
                    }
                ]
            ),
            "past max_dest_rd_atomic (2)"
        );
        let mut m = rec();
        handle_request(&mut m, &fadd(100, 0x11));
        assert!(matches!(queued(&m)[..], [Out::Fatal { .. }]), "misaligned");
    }

    /// A Send with Invalidate invalidates the key it names before it completes, and
    /// reports it; one it may not invalidate is refused.
    #[test]
    fn send_with_invalidate() {
        let mut d = rec();
        d.recvs.push(recv(1));
        d.copy = Ok(8);
        let inv = |key| Request {
            ieth: Some(key),
            ..req(Opcode::SendOnlyWithInvalidate, 100, 8)
        };
        handle_request(&mut d, &inv(0x77));
        assert_eq!(d.completions[0].invalidated_rkey, Some(0x77));
        let mut e = rec();
        e.recvs.push(recv(1));
        handle_request(&mut e, &inv(0x78));
        assert_eq!(e.errors, 1);
        assert_eq!(e.completions[0].status, WcStatus::LocProtErr);
    }

    fn read_req(psn: u32, va: u64, dma_len: u32) -> Request {
        Request {
            reth: Some(RethRepr {
                va,
                rkey: 0x42,
                dma_len,
            }),
            ..req(Opcode::RdmaReadRequest, psn, 0)
        }
    }

    /// The Read jobs queued: (PSN, va, length, responses, MSN, duplicate).
    fn read_jobs(d: &Rec) -> Vec<(Psn, u64, u32, u32, u32, bool)> {
        queued(d)
            .iter()
            .filter_map(|o| match o {
                Out::Read(j) => Some((j.psn, j.va, j.len, j.npkts, j.msn, j.dup)),
                _ => None,
            })
            .collect()
    }

    fn fatal_queued(d: &Rec) -> bool {
        queued(d).iter().any(|o| matches!(o, Out::Fatal { .. }))
    }

    /// spec/01: a new RDMA Read is queued as a Read job (a new message: the MSN moves),
    /// holds a responder resource until its responses leave, and moves ePSN past all its
    /// response PSNs.
    #[test]
    fn a_new_read_counts_a_resource_and_moves_epsn_by_its_responses() {
        let mut d = rec();
        handle_request(&mut d, &read_req(100, 0x1000, 600));
        assert_eq!(read_jobs(&d), [(Psn::new(100), 0x1000, 600, 3, 1, false)]);
        assert_eq!(d.qp.resp.rd_atomic_queued, 1);
        assert_eq!(d.qp.resp.epsn, Psn::new(103), "three responses at PMTU 256");
        assert_eq!((d.errors, d.dropped), (0, 0));
        // The next request is expected after the Read's response PSNs.
        d.recvs.push(recv(1));
        d.copy = Ok(8);
        handle_request(&mut d, &req(Opcode::SendOnly, 103, 8));
        assert_eq!(d.completions.len(), 1);
        assert_eq!(d.qp.resp.epsn, Psn::new(104));
    }

    /// spec/01 (duplicates): a duplicate RDMA Read is served again, without a new
    /// resource, in one of MAX_RD_ATOMIC duplicate slots; with none free it is dropped
    /// silently (no Nak, the QP stays); a slot freed serves the next one.
    #[test]
    fn a_duplicate_read_is_re_served_within_the_duplicate_slots_then_dropped() {
        let mut d = rec();
        handle_request(&mut d, &read_req(100, 0x1000, 600));
        for _ in 0..=MAX_RD_ATOMIC {
            handle_request(&mut d, &read_req(101, 0x1100, 344));
        }
        let jobs = read_jobs(&d);
        assert_eq!(jobs.len(), 1 + usize::from(MAX_RD_ATOMIC));
        assert!(
            jobs[1..]
                .iter()
                .all(|&j| j == (Psn::new(101), 0x1100, 344, 2, 1, true))
        );
        assert_eq!(d.qp.resp.dup_queued, u32::from(MAX_RD_ATOMIC));
        assert_eq!(d.qp.resp.rd_atomic_queued, 1, "no new resource");
        assert_eq!(d.qp.resp.epsn, Psn::new(103));
        assert_eq!((d.errors, d.dropped), (0, 0));
        assert!(!fatal_queued(&d));
        d.qp.resp.release_rd_atomic(true);
        handle_request(&mut d, &read_req(101, 0x1100, 344));
        assert_eq!(read_jobs(&d).len(), 2 + usize::from(MAX_RD_ATOMIC));
    }

    /// A duplicate Atomic is answered with its saved value in one of MAX_RD_ATOMIC
    /// duplicate slots, and dropped silently with none free.
    #[test]
    fn a_duplicate_atomic_is_answered_within_the_duplicate_slots_then_dropped() {
        let mut d = rec();
        let fadd = Request {
            atomic_eth: Some(AtomicEthRepr {
                va: 0x10,
                rkey: 1,
                swap_add: 3,
                compare: 0,
            }),
            ..req(Opcode::FetchAdd, 100, 0)
        };
        handle_request(&mut d, &fadd);
        for _ in 0..=MAX_RD_ATOMIC {
            handle_request(&mut d, &fadd);
        }
        let dups = queued(&d)
            .iter()
            .filter(|o| {
                matches!(
                    o,
                    Out::Atomic {
                        orig: 5,
                        dup: true,
                        ..
                    }
                )
            })
            .count();
        assert_eq!(dups, usize::from(MAX_RD_ATOMIC));
        assert_eq!(d.qp.resp.dup_queued, u32::from(MAX_RD_ATOMIC));
        assert_eq!(d.atomics.len(), 1, "executed once");
        assert_eq!((d.errors, d.dropped), (0, 0));
    }

    /// The saved values of the Atomics executed are kept (up to MAX_RD_ATOMIC): a
    /// duplicate of an older one is answered with its own original value.
    #[test]
    fn each_atomics_original_value_is_kept_for_its_duplicate() {
        let mut d = rec();
        let at = |op, psn| Request {
            atomic_eth: Some(AtomicEthRepr {
                va: 0x10,
                rkey: 1,
                swap_add: 3,
                compare: 5,
            }),
            ..req(op, psn, 0)
        };
        handle_request(&mut d, &at(Opcode::CompareSwap, 100));
        handle_request(&mut d, &at(Opcode::FetchAdd, 101));
        assert_eq!(
            d.atomics,
            [(0x10, true, 5, 3), (0x10, false, 5, 3)],
            "CompareSwap then FetchAdd, by opcode"
        );
        assert_eq!(d.word, 6);
        d.qp.resp.out.clear();
        handle_request(&mut d, &at(Opcode::CompareSwap, 100));
        handle_request(&mut d, &at(Opcode::FetchAdd, 101));
        let dups: Vec<(Psn, u64)> = queued(&d)
            .iter()
            .filter_map(|o| match *o {
                Out::Atomic {
                    psn,
                    orig,
                    dup: true,
                    ..
                } => Some((psn, orig)),
                _ => None,
            })
            .collect();
        assert_eq!(dups, [(Psn::new(100), 5), (Psn::new(101), 3)]);
        assert_eq!(d.atomics.len(), 2, "not executed again");
    }

    /// spec/01 (duplicates): a duplicate Send or RDMA Write is not executed again, but
    /// the Ack is owed again, for ePSN - 1 (acknowledging everything before it too).
    #[test]
    fn a_duplicate_send_or_write_re_owes_the_ack_for_epsn_minus_1() {
        let mut d = rec();
        d.recvs.push(recv(1));
        d.copy = Ok(8);
        handle_request(&mut d, &req(Opcode::SendOnly, 100, 8));
        let write = Request {
            reth: Some(RethRepr {
                va: 0x1000,
                rkey: 0x42,
                dma_len: 8,
            }),
            ..req(Opcode::RdmaWriteOnly, 101, 8)
        };
        handle_request(&mut d, &write);
        let owed = Some(OwedAck {
            psn: Psn::new(101),
            msn: 2,
        });
        assert_eq!(d.qp.resp.owed_ack(), owed);
        d.qp.resp.owed = None; // the Ack left
        handle_request(&mut d, &req(Opcode::SendOnly, 100, 8));
        assert_eq!(d.qp.resp.owed_ack(), owed, "a duplicate Send");
        d.qp.resp.owed = None;
        handle_request(&mut d, &write);
        assert_eq!(d.qp.resp.owed_ack(), owed, "a duplicate Write");
        assert_eq!(d.completions.len(), 1, "nothing executed again");
        assert_eq!(d.qp.resp.epsn, Psn::new(102));
    }

    /// A Write's packets add up exactly to its RETH length: a Last with exactly what is
    /// left completes it; a Middle carrying all that is left, or a Last with less, is an
    /// Invalid Request (fatal).
    #[test]
    fn a_writes_packets_add_up_exactly_to_its_reth_length() {
        let first = |dma_len| Request {
            reth: Some(RethRepr {
                va: 0x1000,
                rkey: 0x42,
                dma_len,
            }),
            ..req(Opcode::RdmaWriteFirst, 100, 256)
        };
        let mut d = rec();
        handle_request(&mut d, &first(556));
        handle_request(&mut d, &req(Opcode::RdmaWriteMiddle, 101, 256));
        handle_request(&mut d, &req(Opcode::RdmaWriteLast, 102, 44));
        assert!(!fatal_queued(&d));
        assert_eq!(d.errors, 0);
        assert_eq!(d.qp.resp.epsn, Psn::new(103));
        assert!(matches!(d.qp.resp.cur, Inbound::Idle));
        assert_eq!(d.qp.resp.msn, 1, "one message");

        let mut m = rec();
        handle_request(&mut m, &first(512));
        handle_request(&mut m, &req(Opcode::RdmaWriteMiddle, 101, 256));
        assert!(fatal_queued(&m), "a Middle cannot end the Write");
        assert_eq!(m.errors, 1);

        let mut l = rec();
        handle_request(&mut l, &first(300));
        handle_request(&mut l, &req(Opcode::RdmaWriteLast, 101, 40));
        assert!(fatal_queued(&l), "a Last short of the length");
        assert_eq!(l.errors, 1);
    }

    /// A fatal error with a Send in progress: its receive WQE completes with the local
    /// error; with the receive CQ full it is put back and the status recorded, to be
    /// flushed with it later.
    #[test]
    fn a_fatal_error_with_the_receive_cq_full_puts_the_wqe_back() {
        let mut d = rec();
        d.recvs.push(recv(2));
        handle_request(&mut d, &req(Opcode::SendFirst, 100, 256));
        handle_request(&mut d, &req(Opcode::SendFirst, 101, 256));
        assert_eq!(d.completions.len(), 1);
        assert_eq!(d.qp.resp.current_flush_status(), WcStatus::WrFlushErr);
        assert!(d.qp.resp.take_current_wqe().is_none(), "completed");

        let mut f = rec();
        f.cq_room = 0;
        f.recvs.push(recv(2));
        handle_request(&mut f, &req(Opcode::SendFirst, 100, 256));
        handle_request(&mut f, &req(Opcode::SendFirst, 101, 256));
        assert!(f.completions.is_empty());
        assert_eq!(f.errors, 1);
        assert!(fatal_queued(&f));
        assert_eq!(f.qp.resp.current_flush_status(), WcStatus::LocQpOpErr);
        assert_eq!(f.qp.resp.take_current_wqe().map(|w| w.wr_id), Some(2));
    }
}
