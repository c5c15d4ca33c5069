//! SQ Logic (the requester) as this engine drives it (spec/01).
//!
//! The SQ Logic itself is the protocol core's ([`shmhca_proto::requester`]): the send
//! window, the gates before a new WQE (fence, initiator depth, end-to-end credits), the
//! retry counters and timers, and the transmit path that segments each message into
//! request packets and goes back N after a loss. This module is what it needs of the
//! engine:
//!
//! - the WQEs the application posts, taken from the send ring (`fetch`) or posted
//!   directly by a post that may run the engine (`post`);
//! - the template path (`post_fast`): a single-packet request on an idle QP,
//!   its header written from the QP's template straight into the link's next slot — the
//!   link's fast path, checked against the general one by the engine's `fast_tests`;
//! - the transmit driver (`Driver`): the link a QP sends on (a request becomes a
//!   `PacketSlot`, its payload by reference into the arena or copied inline, an owed Ack
//!   riding in it), cursor arithmetic over the QP's private scatter/gather tables, and
//!   memory window operations;
//! - what a timer expiry means for the application (`on_tick`: completions, the Error
//!   state, [`crate::Qp::last_error`]) and the loss of a fabric peer (`on_peer_lost`).

use crate::completion::WcStatus;
use crate::context::{Env, LinkTx, QpSlot};
use crate::dma::{self, Cursor, Sgl};
use crate::mem::Mem;
use crate::qp::{AccessFlags, QpState};
use crate::tables::mw::{BindRequest, MwType};
use crate::wire::Qpn;
use crate::wire::atomic_eth::AtomicEthRepr;
use crate::wire::bth;
use crate::wire::opcode::Opcode;
use crate::wire::reth::RethRepr;
use crate::wire::slot::{HeaderWriter, PacketSlot};
use crate::wire::slot::{MAX_CONTINUATION, SLOT_DATA};
use crate::wqe::{DataLoc, SqWqe, WqeFlags, WqeOp};

pub use shmhca_proto::requester::{
    BthTemplate, DEFAULT_PKEY, LinkWait, Requester, Step, Timeout, next_psn,
};
use shmhca_proto::requester::{RequestPacket, SendError, SqDriver};

/// Takes newly posted WQEs from the SQ ring into the window.
pub(crate) fn fetch(qp: &mut QpSlot) {
    while qp.proto.req.has_room() {
        let Some(w) = qp.sq.take() else { break };
        accept(qp, w);
    }
}

/// Appends a WQE to the window (from the send ring, or posted directly);
/// the window has room (the application never has more than `max_send_wr` outstanding).
pub(crate) fn accept(qp: &mut QpSlot, w: SqWqe) {
    qp.proto.req.accept(w, qp.proto.cfg.path_mtu.bytes());
}

/// Takes a WQE posted directly (`Device::run_for_post`) and sends what the QP can send now, up to
/// `budget` packets; returns how many were queued (as [`transmit`]). A single-packet Send
/// or Write whose payload fits the slot, posted on an idle QP, takes the template path
/// ([`post_fast`], a Send on an instance of its own), a Read or Atomic its own
/// ([`post_rd_atomic_fast`]); anything else is queued and sent by [`transmit`]. `direct`: the
/// template path may write its packet straight into the link (`LinkTx::send_line`).
pub(crate) fn post<L: LinkTx + ?Sized>(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    tx: &mut L,
    w: &SqWqe,
    budget: usize,
    direct: bool,
) -> usize {
    // A Send, the most common post, on a path of its own (its opcode and headers known).
    let fast = if w.op == WqeOp::Send {
        post_fast::<L, true>(qp, env, tx, w, direct)
    } else if w.op.is_rd_atomic() {
        post_rd_atomic_fast(qp, env, tx, w, direct)
    } else {
        post_fast::<L, false>(qp, env, tx, w, direct)
    };
    if fast {
        return 1;
    }
    accept(qp, *w);
    transmit(qp, env, tx, budget)
}

/// The template path: sends `w` as one packet built straight into the link's next slot
/// from the QP's header template, and records in the window what go-back-N needs to send
/// it again (the WQE, its PSN) — if the QP is in RTS and idle (nothing queued or being
/// resent, no RNR wait, no WQE waiting for credit), `w` is a Send or RDMA Write (with or
/// without immediate data) of one packet whose payload fits the slot, its fence and its
/// credit let it start, and the link has room. Returns false, having changed nothing,
/// otherwise: [`transmit`] then applies the same rules the long way, and builds the same
/// bytes when it resends the packet. The packet is sent with `LinkTx::send_line`: straight
/// into the link's ring when `direct` and nothing is queued before it. `SEND`: `w` is a
/// Send, the most common post: compiled with its opcode and headers known (one instance
/// for it, one for the rest, and the Send's costs fewer registers kept on the stack:
/// ~35 instructions a message, `bench/scripts/instructions.sh`).
#[inline(always)]
pub(crate) fn post_fast<L: LinkTx + ?Sized, const SEND: bool>(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    tx: &mut L,
    w: &SqWqe,
    direct: bool,
) -> bool {
    const BTH: usize = bth::HEADER_LEN;
    const RETH: usize = crate::wire::reth::HEADER_LEN;
    const IMM: usize = crate::wire::immdt::HEADER_LEN;
    // The Only opcode and its headers: RETH (a Write), ImmDt (with immediate data). `SEND`:
    // `w` is a Send (the caller looked).
    debug_assert!(!SEND || w.op == WqeOp::Send);
    let (opcode, reth, imm) = if SEND {
        (Opcode::SendOnly, 0, 0)
    } else {
        match w.op {
            WqeOp::Send => (Opcode::SendOnly, 0, 0),
            WqeOp::SendImm => (Opcode::SendOnlyWithImmediate, 0, IMM),
            WqeOp::Write => (Opcode::RdmaWriteOnly, RETH, 0),
            WqeOp::WriteImm => (Opcode::RdmaWriteOnlyWithImmediate, RETH, IMM),
            _ => return false,
        }
    };
    let hdr = BTH + reth + imm;
    // A payload that fits the slot is below the smallest PMTU (256): one packet.
    const _: () = assert!(SLOT_DATA <= 256);
    let len = w.len as usize;
    let src = match w.data {
        // (The room as the slice below is bounded, so that its check is this one.)
        DataLoc::Single(e) if hdr + len <= SLOT_DATA && len <= e.len as usize => e.off,
        DataLoc::Empty if len == 0 => 0,
        _ => return false,
    };
    let Some((template, consumers)) =
        qp.proto
            .req
            .fast_gate(qp.proto.state, w, qp.proto.cfg.max_rd_atomic)
    else {
        return false;
    };
    let Some(slot) = tx.next_slot() else {
        return false;
    };
    if len > 0 && qp.mem.read(src, &mut slot.data[hdr..hdr + len]).is_err() {
        // Unreadable data: the long way completes the WQE with a local error.
        return false;
    }
    let psn = qp.proto.req.window().npsn();
    let pad = ((4 - len % 4) % 4) as u8;
    let solicited = w.flags.has(WqeFlags::SOLICITED);
    template.write(&mut slot.data, opcode, solicited, pad, psn);
    if reth > 0 {
        RethRepr {
            va: w.remote_addr,
            rkey: w.rkey,
            dma_len: w.len,
        }
        .emit(&mut crate::wire::reth::Packet::new_unchecked(
            &mut slot.data[BTH..BTH + RETH],
        ));
    }
    if imm > 0 {
        crate::wire::ImmDtRepr { imm: w.imm }.emit(&mut crate::wire::immdt::Packet::new_unchecked(
            &mut slot.data[hdr - IMM..hdr],
        ));
    }
    slot.hdr_len = hdr as u8;
    slot.payload_len = len as u32;
    if len > 0 {
        slot.kind = crate::wire::slot::KIND_INLINE;
    }
    // The bookkeeping of `accept` and `transmit` for this WQE, before the packet leaves —
    // and before the riding Ack's call, so that the WQE and its counts are not kept
    // across it (~5 instructions a message).
    qp.proto.req.fast_posted(w, consumers);
    env.stats.packets_sent += 1;
    env.stats.inline_bytes_sent += len as u64;
    #[cfg(test)]
    {
        qp.fast_posts += 1;
    }
    crate::responder::ride_owed_ack(qp, env, slot);
    tx.send_line(direct);
    true
}

/// The template path of an RDMA Read of one response (at most a PMTU) or an Atomic: one
/// request packet without payload (BTH and RETH, or BTH and AtomicETH) built straight into
/// the link's next slot, and the window's record of it as [`post_fast`] makes it — under
/// the conditions of [`post_fast`] (RTS, idle, no RNR wait, no WQE waiting for credit, the
/// fence, room on the link) and the initiator depth (`max_rd_atomic`), which the normal
/// path checks before a Read or Atomic starts. A scatter list in a table (which the normal
/// path sends only with room for continuation slots, though a request carries none) goes
/// the normal way. Returns false, having changed nothing, otherwise.
///
/// A Read or Atomic request has no payload, so nothing can fail once the gates pass: the
/// normal path's `build_request` writes the same headers (AckReq set, no SE, no pad), and
/// go-back-N rebuilds the same bytes from the WQE.
#[inline]
fn post_rd_atomic_fast<L: LinkTx + ?Sized>(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    tx: &mut L,
    w: &SqWqe,
    direct: bool,
) -> bool {
    const BTH: usize = bth::HEADER_LEN;
    let (opcode, hdr) = match w.op {
        WqeOp::Read => (Opcode::RdmaReadRequest, BTH + crate::wire::reth::HEADER_LEN),
        WqeOp::CompareSwap => (
            Opcode::CompareSwap,
            BTH + crate::wire::atomic_eth::HEADER_LEN,
        ),
        WqeOp::FetchAdd => (Opcode::FetchAdd, BTH + crate::wire::atomic_eth::HEADER_LEN),
        _ => return false,
    };
    // One response: the window records a span of one PSN (`SendWindow::push_sent`).
    if w.op == WqeOp::Read && w.len > qp.proto.cfg.path_mtu.bytes() {
        return false;
    }
    if matches!(w.data, DataLoc::Table { .. }) {
        return false;
    }
    let Some((template, consumers)) =
        qp.proto
            .req
            .fast_gate(qp.proto.state, w, qp.proto.cfg.max_rd_atomic)
    else {
        return false;
    };
    let Some(slot) = tx.next_slot() else {
        return false;
    };
    let psn = qp.proto.req.window().npsn();
    template.write(&mut slot.data, opcode, false, 0, psn);
    if w.op == WqeOp::Read {
        RethRepr {
            va: w.remote_addr,
            rkey: w.rkey,
            dma_len: w.len,
        }
        .emit(&mut crate::wire::reth::Packet::new_unchecked(
            &mut slot.data[BTH..hdr],
        ));
    } else {
        let cas = w.op == WqeOp::CompareSwap;
        AtomicEthRepr {
            va: w.remote_addr,
            rkey: w.rkey,
            swap_add: if cas { w.swap } else { w.compare_add },
            compare: if cas { w.compare_add } else { 0 },
        }
        .emit(&mut crate::wire::atomic_eth::Packet::new_unchecked(
            &mut slot.data[BTH..hdr],
        ));
    }
    slot.hdr_len = hdr as u8;
    slot.payload_len = 0;
    // The bookkeeping of `accept` and `transmit` for this WQE (it consumes no receive WQE),
    // as in `post_fast`: before the packet leaves and the riding Ack's call.
    qp.proto.req.fast_posted(w, consumers);
    env.stats.packets_sent += 1;
    #[cfg(test)]
    {
        qp.fast_posts += 1;
    }
    crate::responder::ride_owed_ack(qp, env, slot);
    tx.send_line(direct);
    true
}

/// Sends up to `budget` request packets of a QP; returns how many were queued.
#[inline]
pub(crate) fn transmit<L: LinkTx + ?Sized>(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    tx: &mut L,
    budget: usize,
) -> usize {
    // The engine offers every active QP a turn each iteration, and most have nothing to
    // send: that answer costs two loads here instead of a call. (An RNR wait that has
    // ended is cleared by the full path even when nothing waits behind it.)
    if !qp.proto.req.wants_transmit() {
        return 0;
    }
    transmit_some(qp, env, tx, budget)
}

/// [`transmit`] when there is something to send (or an RNR wait to look at): the protocol
/// core's transmit path ([`shmhca_proto::requester::transmit`]) driven over this engine's
/// link, memory and memory window table ([`Driver`]), then what it asks of the engine.
#[inline(never)]
fn transmit_some<L: LinkTx + ?Sized>(
    qp: &mut QpSlot,
    env: &mut Env<'_>,
    tx: &mut L,
    budget: usize,
) -> usize {
    if !matches!(qp.proto.state, QpState::Rts | QpState::Sqd) || qp.proto.req.rnr_waiting(env) {
        return 0;
    }
    let (state, cfg) = (qp.proto.state, qp.proto.cfg);
    let t = shmhca_proto::requester::transmit(&mut Driver { qp, env, tx }, state, &cfg, budget);
    env.stats.packets_sent += t.sent as u64;
    env.stats.retransmitted += t.retransmitted;
    env.stats.inline_bytes_sent += t.inline_bytes;
    if t.local_error {
        qp.enter_error(env);
    } else if t.local > 0 {
        crate::completer::retire(qp, env);
    }
    t.sent + t.local
}

/// The engine's side of the SQ Logic's transmit path: a QP, this engine's resources and the
/// link the QP sends on.
struct Driver<'q, 'e, 'r, L: ?Sized> {
    qp: &'q mut QpSlot,
    env: &'e mut Env<'r>,
    tx: &'q mut L,
}

impl<L: LinkTx + ?Sized> SqDriver for Driver<'_, '_, '_, L> {
    #[inline(always)]
    fn req(&mut self) -> &mut Requester {
        &mut self.qp.proto.req
    }

    /// A multi-element list may need continuation slots for its gather list.
    #[inline]
    fn has_room(&mut self, data: &DataLoc) -> bool {
        self.tx.has_room_for(continuation_room(data))
    }

    #[inline]
    fn send(&mut self, p: &RequestPacket<'_>) -> Result<u64, SendError> {
        let Some((slot, cont)) = self.tx.next_packet(continuation_room(p.data)) else {
            return Err(SendError::NoRoom);
        };
        let qp = &mut *self.qp;
        let inline =
            write_request(slot, cont, p, (&qp.mem, &qp.tables)).ok_or(SendError::BadData)?;
        crate::responder::ride_owed_ack(qp, self.env, slot);
        self.tx.commit();
        Ok(inline)
    }

    fn peer_mark(&mut self) -> u64 {
        self.tx.peer_mark()
    }

    #[inline]
    fn cursor_at(&self, data: &DataLoc, off: u64) -> Option<Cursor> {
        Cursor::at(Sgl::new(data, &self.qp.tables), off)
    }

    #[inline]
    fn advance(&self, data: &DataLoc, mut cursor: Cursor, n: u64) -> Cursor {
        cursor.advance(Sgl::new(data, &self.qp.tables), n);
        cursor
    }

    #[cold]
    fn execute_local(&mut self, w: &SqWqe) -> WcStatus {
        execute_local(w, self.qp.proto.pd.get(), self.qp.proto.qpn, self.env)
    }
}

/// Continuation slots a packet whose payload comes from `data` may need: a multi-element
/// list's gather list takes up to [`MAX_CONTINUATION`].
#[inline(always)]
fn continuation_room(data: &DataLoc) -> usize {
    match data {
        DataLoc::Table { .. } => MAX_CONTINUATION,
        _ => 0,
    }
}

/// Executes a memory window operation posted on QP `qpn` of protection domain `pd`.
fn execute_local(w: &SqWqe, pd: u32, qpn: Qpn, env: &mut Env<'_>) -> WcStatus {
    match w.op {
        WqeOp::BindMw => {
            let kind = if w.swap & 0x100 != 0 {
                MwType::Two
            } else {
                MwType::One
            };
            let Some(access) = AccessFlags::from_bits(w.swap as u8) else {
                return WcStatus::MwBindErr;
            };
            let r = BindRequest {
                new_key: w.rkey,
                kind,
                mr_key: w.imm,
                va: w.remote_addr,
                len: w.compare_add,
                access,
            };
            match env.res.mws.bind(&env.res.mrs, pd, qpn, &r) {
                Ok(()) => WcStatus::Success,
                Err(_) => WcStatus::MwBindErr,
            }
        }
        WqeOp::LocalInv => match env.mws.invalidate(w.rkey, pd, None) {
            Ok(()) => WcStatus::Success,
            Err(_) => WcStatus::LocProtErr,
        },
        _ => WcStatus::LocQpOpErr,
    }
}

/// Writes request packet `p` into `slot` (and a gather list into `cont` for a payload
/// spanning several elements), the payload described from the QP's arena and private
/// tables (`mem`): copied into the slot when it fits, else by reference. Returns the bytes
/// copied; `None` if the WQE's list does not cover the payload.
fn write_request(
    slot: &mut PacketSlot,
    cont: &mut [PacketSlot],
    p: &RequestPacket<'_>,
    (mem, tables): (&Mem, &Mem),
) -> Option<u64> {
    let mut h = HeaderWriter::new(slot, &p.bth);
    if let Some(r) = &p.reth {
        h = h.reth(r);
    }
    if let Some(a) = &p.atomic_eth {
        h = h.atomic_eth(a);
    }
    if let Some(imm) = p.imm {
        h = h.immdt(imm);
    }
    if let Some(rkey) = p.ieth {
        h = h.ieth(rkey);
    }
    let slot = h.finish();
    dma::describe(
        slot,
        cont,
        mem,
        Sgl::new(p.data, tables),
        p.cursor,
        p.payload_len,
    )
}

/// Runs the QP's timers ([`Requester::handle_timeout`], the time from the engine's clock
/// through the `Env`) and does what an expiry means: counts the timeout, and when the Retry
/// Count is spent fails the oldest unfinished WQE with RetryExcErr, records why in
/// [`crate::Qp::last_error`] and moves the QP to the Error state. `responses_waiting`: the
/// QP's link has unread packets (its last burst was full), so the timer is looked at again
/// once they are read.
pub(crate) fn on_tick(qp: &mut QpSlot, env: &mut Env<'_>, responses_waiting: bool) {
    match qp.proto.req.handle_timeout(env, responses_waiting) {
        Timeout::Nothing => {}
        Timeout::Resend(_) => env.stats.timeouts += 1,
        Timeout::Exhausted { seq, link_full } => {
            env.stats.timeouts += 1;
            if link_full {
                record_link_full(qp, env);
            } else {
                crate::completer::record_exhausted(qp, crate::completer::Exhausted::Timer);
            }
            if let Some(seq) = seq {
                qp.proto.req.complete(seq, WcStatus::RetryExcErr);
            }
            qp.enter_error(env);
        }
    }
}

/// The QP's link went down and the QP stays as it is (a fabric link: see
/// `OnPeerLoss::FailNextRequest`), `why` being the link's reason. Its oldest unfinished request,
/// if it has one, completes with RetryExcErr — no answer can come, so that is how its
/// retries would end, only sooner — and the QP enters the Error state; without one the QP
/// keeps its state and its receives, and responses queued for the peer are dropped.
/// Error path only.
#[cold]
pub(crate) fn on_peer_lost(qp: &mut QpSlot, env: &mut Env<'_>, why: Option<&str>) {
    qp.proto.resp.drop_output();
    let Some(seq) = qp.proto.req.oldest_unfinished() else {
        qp.proto.req.stop_timers();
        return;
    };
    let text = format!(
        "transport retry count exhausted at once: the link to the peer is down ({}), so no \
         request can be answered; the peer acknowledged up to PSN {}",
        why.unwrap_or("its ring broke"),
        qp.proto.req.window().acked().get()
    );
    *qp.shared
        .last_error
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(text);
    qp.proto.req.complete(seq, WcStatus::RetryExcErr);
    qp.enter_error(env);
}

/// Records in words why the QP fails ([`crate::Qp::last_error`]) when its Retry Count ran
/// out while a request waited for room on the link. Error path only.
#[cold]
fn record_link_full(qp: &QpSlot, env: &mut Env<'_>) {
    let waited = match qp.proto.req.link_wait() {
        LinkWait::Since(t) => env.now().saturating_duration_since(t).as_millis(),
        _ => 0,
    };
    let (link, peer) = match qp.proto.cfg.dest {
        Some(d) => (d.link.index(), d.qpn.get()),
        None => (0, 0),
    };
    let acked = qp.proto.req.window().acked().get();
    let text = format!(
        "transport retry count exhausted (retry_cnt {retry}): no room on the link to peer \
         QP {peer:#x} (link {link}) for about {waited} ms: the peer stopped consuming (its engine \
         reads none of the packets this side sends, though the link is up); the peer \
         acknowledged up to PSN {acked}",
        retry = qp.proto.cfg.retry_cnt,
    );
    *qp.shared
        .last_error
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(text);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::VecLink;
    use crate::psn::Psn;
    use crate::wire::aeth::CreditCode;
    use crate::wire::slot::RxPacket;
    use crate::wqe::{NO_MR, SgeEntry};
    use crate::{AccessFlags, Context, QpAttr, QpCaps};
    use std::time::Duration;

    /// A context whose QPs (`qps` of them, all in RTS at `sq_psn`, sending to QP 9 over a
    /// link whose far end nobody reads) the tests drive stage by stage, and a region of
    /// 4 KiB to stage payloads in.
    struct Rig {
        ctx: Context,
        qps: Vec<crate::Qp>,
        mr: crate::Mr,
        _pd: crate::Pd,
        _cq: crate::Cq,
        _ends: crate::raw_peer::RawEnds,
    }

    fn rig(qps: usize, sq_psn: u32, credits: bool) -> Rig {
        let ctx = crate::raw_peer::inline_context_on(crate::timer::TestClock::new());
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(256).unwrap();
        let (link, ends, _arena) = crate::raw_peer::raw_peer_link(&ctx, 64, 9, 4096);
        let qps = (0..qps)
            .map(|_| {
                let mut qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
                crate::raw_peer::connect_to_raw_peer(&mut qp, link, 9, sq_psn, credits);
                qp
            })
            .collect();
        let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        Rig {
            ctx,
            qps,
            mr,
            _pd: pd,
            _cq: cq,
            _ends: ends,
        }
    }

    impl Rig {
        /// Runs `f` on QP `i`'s engine side.
        fn stage<R>(&self, i: usize, f: impl FnOnce(&mut QpSlot, &mut Env<'_>) -> R) -> R {
            let qpn = self.qps[i].qpn();
            self.ctx
                .shared
                .engine
                .with(|e| e.with_stage(qpn, f))
                .expect("the QP is live")
        }
    }

    /// Stages `bytes` at `at` in region `mr`; the WQE data that points at them.
    fn data(mr: &crate::Mr, at: u64, bytes: &[u8]) -> DataLoc {
        if bytes.is_empty() {
            return DataLoc::Empty;
        }
        mr.write_at(at, bytes).unwrap();
        DataLoc::Single(SgeEntry {
            off: mr.src_off(at, bytes.len() as u64).unwrap(),
            len: bytes.len() as u32,
            mr: NO_MR,
        })
    }

    fn wqe(op: WqeOp, flags: u8, data: DataLoc, len: u32) -> SqWqe {
        SqWqe {
            wr_id: 77,
            op,
            flags: WqeFlags(flags | WqeFlags::SIGNALED),
            imm: 0xCAFE_0001,
            len,
            remote_addr: 0x1234_5678_9ABC,
            rkey: 0x4242,
            compare_add: 0,
            swap: 0,
            data,
        }
    }

    fn link(room: usize) -> VecLink {
        let mut l = VecLink::default();
        l.room = room;
        l
    }

    /// The packets `link` carries, parsed: (opcode, PSN, AckReq).
    fn sent(link: &VecLink) -> Vec<(Opcode, u32, bool)> {
        link.sent
            .iter()
            .map(|p| {
                let rx = RxPacket::parse(&p[0], &p[1..]).expect("a well-formed packet");
                (rx.opcode(), rx.psn().get(), rx.ack_req())
            })
            .collect()
    }

    /// Acknowledges everything QP `q` sent and retires it.
    fn ack_all(q: &mut QpSlot) {
        let last = q.proto.req.window().npsn().sub(1);
        q.proto.req.acknowledged(last, &q.proto.cfg);
        while q.proto.req.window().retired() < q.proto.req.window().started() {
            let seq = q.proto.req.window().retired();
            q.proto.req.complete(seq, WcStatus::Success);
            q.proto.req.retire_oldest();
        }
    }

    /// Posts `w` on QP 0 of `r` (it must take the template path; `posted` checks the QP
    /// right after), sends it again as a go-back-N retransmission, and hands the same WQE
    /// to the normal path on QP 1: the three packets' bytes must be the same. Both QPs end
    /// with everything acknowledged. The packet's PSN and payload length.
    fn template_matches_normal(
        r: &Rig,
        w: SqWqe,
        what: &str,
        posted: impl FnOnce(&mut QpSlot),
    ) -> (Psn, u32) {
        let mut fast = link(4);
        let psn = r.stage(0, |q, env| {
            let before = q.fast_posts;
            let psn = q.proto.req.window().npsn();
            assert_eq!(post(q, env, &mut fast, &w, 16, true), 1);
            assert_eq!(q.fast_posts, before + 1, "{what} takes the template path");
            assert_eq!(q.proto.req.window().npsn(), psn.add(1), "{what}");
            assert_eq!(q.proto.req.window().sent_to(), psn.add(1), "{what}");
            assert!(
                q.proto.req.timer().armed(),
                "{what}: the transport timer runs"
            );
            posted(q);
            // Go-back-N: the same packet again, built the normal way.
            assert!(q.proto.req.resend_from(psn), "{what}: a retry left");
            assert_eq!(transmit(q, env, &mut fast, 16), 1);
            ack_all(q);
            assert_eq!(
                q.proto.req.rd_atomic(),
                0,
                "{what}: acknowledged, out of the initiator depth"
            );
            psn
        });
        let mut normal = link(4);
        r.stage(1, |q, env| {
            accept(q, w);
            assert_eq!(transmit(q, env, &mut normal, 16), 1);
            ack_all(q);
        });
        assert_eq!(fast.sent.len(), 2, "{what}");
        let bytes = |p: &Vec<PacketSlot>| bytemuck::bytes_of(&p[0]).to_vec();
        assert_eq!(bytes(&fast.sent[0]), bytes(&normal.sent[0]), "{what}");
        assert_eq!(bytes(&fast.sent[1]), bytes(&fast.sent[0]), "{what}");
        let rx = RxPacket::parse(&fast.sent[0][0], &[]).unwrap();
        assert_eq!((rx.psn(), rx.ack_req()), (psn, true), "{what}");
        (psn, rx.payload.len())
    }

    /// Issue 10 "short paths": a single-packet post on an idle QP is built from the
    /// header template, and its bytes are those the normal path builds for the same WQE —
    /// the first time (on a twin QP) and again as a go-back-N retransmission.
    #[test]
    fn a_template_post_builds_the_bytes_of_the_normal_path() {
        let r = rig(2, 0xFF_FFFD, false);
        let mut case = 0u64;
        for (op, max) in [
            (WqeOp::Send, 28),
            (WqeOp::SendImm, 24),
            (WqeOp::Write, 12),
            (WqeOp::WriteImm, 8),
        ] {
            for len in [0u32, 1, 3, 8, max] {
                for flags in [0, WqeFlags::SOLICITED] {
                    case += 1;
                    let bytes: Vec<u8> = (0..len).map(|i| (i as u8) ^ (case as u8)).collect();
                    let w = wqe(op, flags, data(&r.mr, case * 128 % 4096, &bytes), len);
                    let what = format!("{op:?}, {len} bytes, flags {flags}");
                    let (psn, payload) = template_matches_normal(&r, w, &what, |_| ());
                    assert_eq!(payload, len, "{what}, PSN {psn:?}");
                }
            }
        }
        // The PSNs wrapped past 2^24 on the way.
        r.stage(0, |q, _| {
            assert!(q.proto.req.window().npsn().get() < 0xFF_FFFD)
        });
        r.stage(0, |q, _| assert_eq!(q.fast_posts, case));
    }

    /// A Read of at most a PMTU (one response), a Compare and Swap and a Fetch and Add, on
    /// an idle QP, are built from the header template too: their bytes are those the normal
    /// path builds, the first time and again as a go-back-N retransmission, and each takes
    /// its place in the initiator depth as on the normal path.
    #[test]
    fn a_template_read_or_atomic_builds_the_bytes_of_the_normal_path() {
        let r = rig(2, 0xFF_FFFD, false);
        let mut case = 0u64;
        for (op, len) in [
            (WqeOp::Read, 0u32),
            (WqeOp::Read, 1),
            (WqeOp::Read, 8),
            (WqeOp::Read, 255),
            (WqeOp::Read, 256),
            (WqeOp::CompareSwap, 8),
            (WqeOp::FetchAdd, 8),
        ] {
            for flags in [0, WqeFlags::SOLICITED, WqeFlags::FENCE] {
                case += 1;
                let mut w = wqe(op, flags, data(&r.mr, case * 256 % 4096, &[0; 8]), len);
                w.remote_addr = 0x1000_0000_0000_0008 ^ (case << 3);
                w.compare_add = 0x0102_0304_0506_0708 ^ case;
                w.swap = 0x1112_1314_1516_1718 ^ case;
                let what = format!("{op:?}, {len} bytes, flags {flags}");
                template_matches_normal(&r, w, &what, |q| {
                    // It takes its place in the initiator depth until it is acknowledged.
                    assert_eq!(q.proto.req.rd_atomic(), 1, "{what}");
                });
            }
        }
        r.stage(0, |q, _| assert_eq!(q.fast_posts, case));
    }

    /// A Read or Atomic the template path does not take goes the normal way: past the
    /// initiator depth (it waits for the one outstanding), fenced behind a Read, a Read of
    /// more than one response, behind queued work.
    #[test]
    fn reads_and_atomics_the_template_path_does_not_take_go_the_normal_way() {
        let r = rig(1, 0, false);
        let read = |len: u32, flags: u8| wqe(WqeOp::Read, flags, data(&r.mr, 0, &[0; 8]), len);
        let fadd = wqe(WqeOp::FetchAdd, 0, data(&r.mr, 64, &[0; 8]), 8);
        let mut l = link(16);
        r.stage(0, |q, env| {
            assert_eq!(post(q, env, &mut l, &read(8, 0), 16, true), 1);
            assert_eq!(q.fast_posts, 1);
            // The initiator depth is 1: the Atomic waits for the Read.
            assert_eq!(post(q, env, &mut l, &fadd, 16, true), 0);
            // Queued work: a Read behind it waits its turn too.
            assert_eq!(post(q, env, &mut l, &read(8, 0), 16, true), 0);
            assert_eq!(q.fast_posts, 1);
            ack_all(q);
            assert_eq!(transmit(q, env, &mut l, 16), 1);
            ack_all(q);
            assert_eq!(transmit(q, env, &mut l, 16), 1);
            ack_all(q);
            assert_eq!(q.proto.req.rd_atomic(), 0);
            // A Read of two responses: the normal path.
            assert_eq!(post(q, env, &mut l, &read(257, 0), 16, true), 1);
            assert_eq!(q.fast_posts, 1);
            ack_all(q);
        });
        // A fenced Read behind a Read, with room for two in flight.
        r.stage(0, |q, env| {
            q.proto.cfg.max_rd_atomic = 2;
            assert_eq!(post(q, env, &mut l, &read(8, 0), 16, true), 1);
            assert_eq!(post(q, env, &mut l, &read(8, WqeFlags::FENCE), 16, true), 0);
            assert_eq!(q.fast_posts, 2);
            ack_all(q);
            assert_eq!(transmit(q, env, &mut l, 16), 1);
            // Without a fence, a second Read goes beside the first.
            assert_eq!(post(q, env, &mut l, &read(8, 0), 16, true), 1);
            assert_eq!(q.fast_posts, 3);
            assert_eq!(q.proto.req.rd_atomic(), 2);
            ack_all(q);
        });
        use Opcode::*;
        let psns: Vec<_> = sent(&l).iter().map(|p| (p.0, p.1)).collect();
        assert_eq!(
            psns,
            [
                (RdmaReadRequest, 0),
                (FetchAdd, 1),
                (RdmaReadRequest, 2),
                (RdmaReadRequest, 3),
                (RdmaReadRequest, 5),
                (RdmaReadRequest, 6),
                (RdmaReadRequest, 7),
            ]
        );
    }

    /// A Read or an Atomic, with room under the initiator depth, does not pass what waits
    /// before it: a Send waiting for credit, a WQE the full link holds back, an RNR wait.
    /// It waits in the window, posted order kept.
    #[test]
    fn reads_and_atomics_wait_behind_what_waits() {
        let r = rig(1, 10, true);
        let mr = &r.mr;
        let send = wqe(WqeOp::Send, 0, data(mr, 0, &[7; 8]), 8);
        let read = wqe(WqeOp::Read, 0, data(mr, 1024, &[0; 8]), 8);
        let fadd = wqe(WqeOp::FetchAdd, 0, data(mr, 2048, &[0; 8]), 8);
        let mut l = link(64);
        r.stage(0, |q, env| {
            q.proto.cfg.max_rd_atomic = 4;
            // No credit yet: the first Send goes alone and waits; the Read waits behind it.
            assert_eq!(post(q, env, &mut l, &send, 16, true), 1);
            assert_eq!(q.proto.req.limited(), Some(0));
            assert_eq!(post(q, env, &mut l, &read, 16, true), 0);
            assert_eq!(q.fast_posts, 0);
            q.proto.req.acknowledged(Psn::new(10), &q.proto.cfg);
            q.proto.req.update_credits(CreditCode::encode(8), 1);
            assert_eq!(transmit(q, env, &mut l, 16), 1);
            ack_all(q);
        });
        // A full link holds a Send back: the Atomic behind it waits too.
        let mut full = link(0);
        r.stage(0, |q, env| {
            assert_eq!(post(q, env, &mut full, &send, 16, true), 0);
            full.room = 4;
            assert_eq!(post(q, env, &mut full, &fadd, 16, true), 2);
            assert_eq!(q.fast_posts, 0);
            ack_all(q);
            // An RNR wait with nothing queued: the Read waits for its end.
            let npsn = q.proto.req.window().npsn();
            assert!(
                q.proto
                    .req
                    .rnr_wait(npsn, Duration::from_secs(3600), &q.proto.cfg)
            );
            assert_eq!(post(q, env, &mut l, &read, 16, true), 0);
            assert_eq!(q.fast_posts, 0);
            // The wait ends (an hour on the test clock).
            q.proto.req.start_timers(env);
            env.jump_to(q.proto.req.rnr_timer().at().expect("the RNR wait runs"));
            assert_eq!(transmit(q, env, &mut l, 16), 1);
            ack_all(q);
        });
        use Opcode::*;
        let order = |p: &VecLink| -> Vec<_> { sent(p).iter().map(|p| (p.0, p.1)).collect() };
        assert_eq!(
            order(&l),
            [(SendOnly, 10), (RdmaReadRequest, 11), (RdmaReadRequest, 14)]
        );
        assert_eq!(order(&full), [(SendOnly, 12), (FetchAdd, 13)]);
    }

    /// What the template path does not take goes the normal way, in posted order: a post
    /// behind queued work, without credit (and a Write behind a Send waiting for credit),
    /// on a full link, during an RNR wait, a fenced post behind a Read, a post outside
    /// RTS, and WQEs that are not one inline packet.
    #[test]
    fn posts_the_template_path_does_not_take_go_the_normal_way_in_order() {
        let mut r = rig(1, 10, true);
        let mr = &r.mr;
        let send = |len: u32| wqe(WqeOp::Send, 0, data(mr, 0, &vec![7; len as usize]), len);
        let write = wqe(WqeOp::Write, 0, data(mr, 512, &[1; 8]), 8);
        let mut l = link(64);
        r.stage(0, |q, env| {
            // No credit yet: the first Send goes alone, with AckReq, and waits.
            assert_eq!(post(q, env, &mut l, &send(8), 16, true), 1);
            assert_eq!(q.proto.req.limited(), Some(0));
            // A Write does not consume credit but must not pass the waiting Send.
            assert_eq!(post(q, env, &mut l, &write, 16, true), 0);
            assert_eq!(q.fast_posts, 0);
            // Credit comes with the Ack of the first Send; the Write is queued, so the
            // next Send goes behind it.
            q.proto.req.acknowledged(Psn::new(10), &q.proto.cfg);
            q.proto.req.update_credits(CreditCode::encode(8), 1);
            assert_eq!(post(q, env, &mut l, &send(8), 16, true), 2);
            assert_eq!(q.fast_posts, 0);
            // Idle, with credit: the template path.
            assert_eq!(post(q, env, &mut l, &send(8), 16, true), 1);
            assert_eq!(q.fast_posts, 1);
            // A Send larger than a slot holds inline, or than one packet: the normal path.
            assert_eq!(post(q, env, &mut l, &send(101), 16, true), 1);
            assert_eq!(post(q, env, &mut l, &send(300), 16, true), 2);
            assert_eq!(q.fast_posts, 1);
        });
        use Opcode::*;
        assert_eq!(
            sent(&l),
            [
                (SendOnly, 10, true),
                (RdmaWriteOnly, 11, true),
                (SendOnly, 12, true),
                (SendOnly, 13, true),
                (SendOnly, 14, true),
                (SendFirst, 15, false),
                (SendLast, 16, true),
            ]
        );
        // A full link: the WQE waits in the window and goes when there is room.
        let mut full = link(0);
        r.stage(0, |q, env| {
            ack_all(q);
            assert_eq!(post(q, env, &mut full, &send(8), 16, true), 0);
            full.room = 1;
            assert_eq!(transmit(q, env, &mut full, 16), 1);
            assert_eq!(sent(&full), [(SendOnly, 17, true)]);
            ack_all(q);
            // An RNR wait: nothing goes until it ends.
            let npsn = q.proto.req.window().npsn();
            assert!(
                q.proto
                    .req
                    .rnr_wait(npsn, Duration::from_secs(3600), &q.proto.cfg)
            );
            let mut l = link(4);
            assert_eq!(post(q, env, &mut l, &send(8), 16, true), 0);
            q.proto.req.start_timers(env);
            env.jump_to(q.proto.req.rnr_timer().at().expect("the RNR wait runs"));
            assert_eq!(transmit(q, env, &mut l, 16), 1);
            ack_all(q);
            // A fenced Send waits for the Read before it.
            let read = wqe(WqeOp::Read, 0, data(mr, 1024, &[0; 8]), 8);
            assert_eq!(post(q, env, &mut l, &read, 16, true), 1);
            let fenced = wqe(WqeOp::Send, WqeFlags::FENCE, data(mr, 0, &[3; 8]), 8);
            assert_eq!(post(q, env, &mut l, &fenced, 16, true), 0);
            ack_all(q);
            assert_eq!(q.proto.req.rd_atomic(), 0);
            assert_eq!(transmit(q, env, &mut l, 16), 1);
            ack_all(q);
            // The Send and the Read before the fence.
            assert_eq!(q.fast_posts, 2);
            let psns: Vec<_> = sent(&l).iter().map(|p| (p.0, p.1)).collect();
            assert_eq!(
                psns,
                [(SendOnly, 18), (RdmaReadRequest, 19), (SendOnly, 20)]
            );
        });
        // Outside RTS (SQ drained): accepted, sent once back in RTS.
        r.qps[0].modify(&QpAttr::new(QpState::Sqd)).unwrap();
        let mut l = link(4);
        let w = send(8);
        r.stage(0, |q, env| {
            assert_eq!(post(q, env, &mut l, &w, 16, true), 0);
        });
        r.qps[0].modify(&QpAttr::new(QpState::Rts)).unwrap();
        r.stage(0, |q, env| {
            assert_eq!(transmit(q, env, &mut l, 16), 1);
            assert_eq!(q.fast_posts, 2);
        });
        assert_eq!(sent(&l), [(Opcode::SendOnly, 21, true)]);
    }

    /// A WQE whose data is shorter than its length (which `post_send` never makes) is a
    /// local error on the template path's watch too, never a packet of stray bytes.
    #[test]
    fn a_wqe_whose_data_falls_short_is_a_local_error() {
        let r0 = rig(1, 0, false);
        let short = match data(&r0.mr, 0, &[5; 4]) {
            DataLoc::Single(e) => e,
            _ => unreachable!(),
        };
        for data in [DataLoc::Single(short), DataLoc::Empty] {
            let r = rig(1, 0, false);
            let mut l = link(4);
            r.stage(0, |q, env| {
                let w = wqe(WqeOp::Send, 0, data, 8);
                assert_eq!(post(q, env, &mut l, &w, 16, true), 0);
                assert_eq!(q.proto.state, QpState::Error);
                assert_eq!(q.proto.req.wqe(0).done, Some(WcStatus::LocQpOpErr));
            });
            assert!(l.sent.is_empty(), "{data:?}");
        }
    }

    /// A fence waits only for Reads and Atomics: a fenced post with none outstanding, and
    /// a post without fence behind an outstanding Read, take the template path.
    #[test]
    fn a_fence_alone_or_a_read_alone_keeps_the_template_path() {
        let r = rig(1, 0, false);
        let mut l = link(8);
        r.stage(0, |q, env| {
            let fenced = wqe(WqeOp::Send, WqeFlags::FENCE, data(&r.mr, 0, &[1; 8]), 8);
            assert_eq!(post(q, env, &mut l, &fenced, 16, true), 1);
            let read = wqe(WqeOp::Read, 0, data(&r.mr, 64, &[0; 8]), 8);
            assert_eq!(post(q, env, &mut l, &read, 16, true), 1);
            assert_eq!(q.proto.req.rd_atomic(), 1);
            let plain = wqe(WqeOp::Send, 0, data(&r.mr, 0, &[2; 8]), 8);
            assert_eq!(post(q, env, &mut l, &plain, 16, true), 1);
            assert_eq!(q.fast_posts, 3, "the Read too");
        });
        use Opcode::*;
        assert_eq!(
            sent(&l),
            [
                (SendOnly, 0, true),
                (RdmaReadRequest, 1, true),
                (SendOnly, 2, true)
            ]
        );
    }
}

#[cfg(all(test, not(shmhca_loom)))]
mod link_full_tests;
