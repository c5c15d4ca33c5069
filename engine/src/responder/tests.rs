//! The RQ Logic checked on the wire: the order of its checks (a request that fails two
//! gets the first one's answer) and when its Acks leave.
//!
//! The rig is the real engine of an inline-mode [`Context`] with one QP in RTS; its peer
//! is this test, holding the other end of a real link segment: it publishes the requests
//! it wants (PSN, opcode, headers of its choosing), drives the engine one iteration at a
//! time and reads the responses.

use shmhca_rings::segment::HugePages;

use crate::mem::Mem;
use crate::psn::Psn;
use crate::wire::aeth::{CreditCode, NakCode, Syndrome};
use crate::wire::opcode::Opcode;
use crate::wire::slot::{KIND_INLINE, PacketSlot, continuation_slots};
use crate::wire::{AtomicEthRepr, BthRepr, PacketRepr, RethRepr};
use crate::{
    AccessFlags, Context, Cq, Destination, EngineMode, Mr, Pd, Qp, QpAttr, QpCaps, QpState, Qpn,
    RecvWr, WorkCompletion,
};

const PEER_QPN: u32 = 0x4004;
/// The PSN the QP's RQ Logic expects first.
pub(super) const RQ_PSN: u32 = 0xFF_FFFE;

pub(super) struct Rig {
    pub(super) ctx: Context,
    pub(super) pd: Pd,
    pub(super) cq: Cq,
    pub(super) qp: Qp,
    /// Receive buffers and RDMA target, open to every remote access.
    pub(super) mr: Mr,
    pub(super) tx: crate::raw_peer::SlotTx,
    pub(super) rx: crate::raw_peer::SlotRx,
    _peer_arena: Mem,
    skip: usize,
}

/// A response the engine sent: opcode, PSN offset from [`RQ_PSN`], AETH syndrome.
pub(super) type Answer = (Opcode, u32, Option<Syndrome>);

std::thread_local! {
    /// The SQ PSN of the rigs this thread makes (review 5: PSNs that wrap).
    pub(super) static SQ_PSN: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// The `max_inline_data` of the rigs this thread makes (0 unless a test sets it).
    pub(super) static MAX_INLINE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// The rig's QP's `max_send_sge` (tests of gather lists set it, and back to 1).
    pub(super) static MAX_SEND_SGE: std::cell::Cell<u32> = const { std::cell::Cell::new(1) };
}

/// Rigs made while this lives take `max_inline_data` `n` ([`MAX_INLINE`]); back to 0 when
/// it is dropped, a failing test's unwinding included.
#[must_use]
pub(super) struct InlineRigs;

impl InlineRigs {
    pub(super) fn of(n: u32) -> InlineRigs {
        MAX_INLINE.with(|c| c.set(n));
        InlineRigs
    }
}

impl Drop for InlineRigs {
    fn drop(&mut self) {
        MAX_INLINE.with(|c| c.set(0));
    }
}

pub(super) fn rig(access: AccessFlags) -> Rig {
    rig_in(access, QpState::Rts)
}

/// [`rig`] with the QP left in `state`: RTR (it receives, sends nothing) or RTS.
pub(super) fn rig_in(access: AccessFlags, state: QpState) -> Rig {
    let ctx = Context::builder()
        .arena_size(1 << 20)
        .huge_pages(HugePages::Never)
        .mode(EngineMode::Inline)
        // Only this thread runs the engine (the fast-path tests count on its thread).
        .progress(crate::Progress::Manual)
        .build()
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let caps = QpCaps {
        max_send_wr: 8,
        max_recv_wr: 32,
        max_send_sge: MAX_SEND_SGE.with(std::cell::Cell::get),
        max_recv_sge: 1,
        max_inline_data: MAX_INLINE.with(std::cell::Cell::get),
    };
    let mut qp = ctx.create_qp(&pd, &cq, &cq, caps).unwrap();
    let (id, mine, peer_arena) = crate::raw_peer::raw_peer_link(&ctx, 128, PEER_QPN, 4096);
    qp.modify(&QpAttr::new(QpState::Init).access(access))
        .unwrap();
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(crate::Mtu::Mtu256)
            .dest(Destination {
                link: id,
                qpn: Qpn::new(PEER_QPN),
            })
            .rq_psn(RQ_PSN)
            .max_dest_rd_atomic(1)
            .min_rnr_timer(1)
            .remote_credits(true),
    )
    .unwrap();
    if state == QpState::Rts {
        qp.modify(
            &QpAttr::new(QpState::Rts)
                .sq_psn(SQ_PSN.with(std::cell::Cell::get))
                .max_rd_atomic(1)
                .timeout(0)
                .retry_cnt(7)
                .rnr_retry(7),
        )
        .unwrap();
    }
    let mr = pd.alloc_mr(64 << 10, AccessFlags::ALL).unwrap();
    let mut r = Rig {
        ctx,
        pd,
        cq,
        qp,
        mr,
        tx: mine.tx,
        rx: mine.rx,
        _peer_arena: peer_arena,
        skip: 0,
    };
    // The initial credit report (spec/02), out of the way.
    r.step();
    r.answers();
    r
}

impl Rig {
    /// Posts `n` receives and lets the engine report the credits (that Ack is dropped).
    pub(super) fn post_recv(&mut self, n: u64) {
        for i in 0..n {
            let sge = [self.mr.sge(i * 512, 512).unwrap()];
            self.qp.post_recv(&RecvWr::new(i, &sge)).unwrap();
        }
        self.step();
        self.answers();
    }

    /// Publishes a request at PSN offset `psn` from [`RQ_PSN`]; `f` adds headers.
    pub(super) fn request(
        &mut self,
        op: Opcode,
        psn: u32,
        f: impl FnOnce(&mut PacketRepr),
        payload: &[u8],
    ) {
        let psn = Psn::new(RQ_PSN).add(psn);
        let mut repr = PacketRepr::new(BthRepr::new(op, self.qp.qpn(), psn));
        f(&mut repr);
        let mut s = PacketSlot::default();
        s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
        if !payload.is_empty() {
            s.kind = KIND_INLINE;
            s.payload_len = payload.len() as u32;
            let at = usize::from(s.hdr_len);
            s.data[at..at + payload.len()].copy_from_slice(payload);
        }
        assert_eq!(self.tx.push_burst(&[s]).unwrap(), 1);
    }

    /// One engine iteration.
    pub(super) fn step(&mut self) {
        self.ctx.progress();
    }

    /// The responses sent so far, not read before.
    pub(super) fn answers(&mut self) -> Vec<Answer> {
        let mut out = vec![];
        let mut buf = [PacketSlot::default(); 64];
        loop {
            let n = self.rx.pop_burst(&mut buf).unwrap();
            if n == 0 {
                return out;
            }
            for s in &buf[..n] {
                if self.skip > 0 {
                    self.skip -= 1;
                    continue;
                }
                self.skip = continuation_slots(s);
                let (repr, _) = PacketRepr::parse(&s.data[..usize::from(s.hdr_len)]).unwrap();
                let psn = repr.bth.psn.diff(Psn::new(RQ_PSN)) as u32;
                out.push((repr.bth.opcode, psn, repr.aeth.map(|a| a.syndrome)));
            }
        }
    }

    pub(super) fn completions(&mut self) -> Vec<WorkCompletion> {
        let mut wc = [WorkCompletion::default(); 16];
        let n = self.cq.poll(&mut wc);
        wc[..n].to_vec()
    }

    pub(super) fn reth(&self, off: u64, len: u32) -> RethRepr {
        let r = self.mr.remote(off);
        RethRepr {
            va: r.addr,
            rkey: r.rkey,
            dma_len: len,
        }
    }
}

pub(super) fn nak(code: NakCode) -> Option<Syndrome> {
    Some(Syndrome::Nak(code))
}

pub(super) fn is_rnr(a: &Answer) -> bool {
    matches!(a.2, Some(Syndrome::RnrNak { .. }))
}

pub(super) fn is_ack(a: &Answer) -> bool {
    a.0 == Opcode::Acknowledge && matches!(a.2, Some(Syndrome::Ack { .. }))
}

// --- The order of the checks: a request failing two gets the first one's answer. ---

/// PSN before opcode sequence: a Send Middle out of sequence *and* ahead of ePSN gets a
/// PSN Sequence Error Nak (recoverable), not an Invalid Request (fatal).
#[test]
fn the_psn_check_comes_before_the_opcode_sequence() {
    let mut r = rig(AccessFlags::ALL);
    r.post_recv(2);
    r.request(Opcode::SendMiddle, 3, |_| {}, b"abcd");
    r.step();
    assert_eq!(
        r.answers(),
        [(Opcode::Acknowledge, 0, nak(NakCode::PsnSequenceError))]
    );
    assert_eq!(r.qp.state(), QpState::Rts, "a sequence error is not fatal");
}

/// Operation enabled before resources: an RDMA Write with Immediate on a QP without
/// remote write and with no receive posted gets an Invalid Request Nak, not an RNR Nak.
#[test]
fn the_operation_enabled_comes_before_the_resources() {
    let mut r = rig(AccessFlags::REMOTE_READ);
    let reth = r.reth(0, 4);
    r.request(
        Opcode::RdmaWriteOnlyWithImmediate,
        0,
        |p| {
            p.reth = Some(reth);
            p.immdt = Some(crate::wire::ImmDtRepr { imm: 1 });
        },
        b"abcd",
    );
    r.step();
    assert_eq!(
        r.answers(),
        [(Opcode::Acknowledge, 0, nak(NakCode::InvalidRequest))]
    );
    assert_eq!(r.qp.state(), QpState::Error);
}

/// Resources before length: an RDMA Write Only with Immediate whose payload is not its
/// RETH's length, with no receive posted, gets an RNR Nak (the requester retries later),
/// not an Invalid Request.
#[test]
fn the_resources_come_before_the_length() {
    let mut r = rig(AccessFlags::ALL);
    let reth = r.reth(0, 8);
    r.request(
        Opcode::RdmaWriteOnlyWithImmediate,
        0,
        |p| {
            p.reth = Some(reth);
            p.immdt = Some(crate::wire::ImmDtRepr { imm: 1 });
        },
        b"abcd",
    );
    r.step();
    let got = r.answers();
    assert_eq!(got.len(), 1);
    assert!(is_rnr(&got[0]) && got[0].1 == 0, "{got:?}");
    assert_eq!(r.qp.state(), QpState::Rts);
}

/// Resources before R_Key: with the one responder resource taken, a Read with a bad R_Key
/// is refused for the resource (Invalid Request), not for its key (Remote Access Error).
#[test]
fn the_responder_resources_come_before_the_rkey() {
    let mut r = rig(AccessFlags::ALL);
    let good = r.reth(0, 4);
    r.request(Opcode::RdmaReadRequest, 0, |p| p.reth = Some(good), &[]);
    let mut bad = r.reth(0, 4);
    bad.rkey ^= 0xFFFF_0000;
    r.request(Opcode::RdmaReadRequest, 1, |p| p.reth = Some(bad), &[]);
    r.step();
    let got = r.answers();
    assert_eq!(
        got.last(),
        Some(&(Opcode::Acknowledge, 1, nak(NakCode::InvalidRequest))),
        "the second Read exceeds max_dest_rd_atomic = 1: Invalid Request, not Remote Access"
    );
}

/// Length before R_Key: an RDMA Write Only whose payload is not its RETH's length, with a
/// bad R_Key, gets an Invalid Request Nak, not a Remote Access Error.
#[test]
fn the_length_comes_before_the_rkey() {
    let mut r = rig(AccessFlags::ALL);
    let mut reth = r.reth(0, 8);
    reth.rkey ^= 0xFFFF_0000;
    r.request(Opcode::RdmaWriteOnly, 0, |p| p.reth = Some(reth), b"abcd");
    r.step();
    assert_eq!(
        r.answers(),
        [(Opcode::Acknowledge, 0, nak(NakCode::InvalidRequest))]
    );
}

/// R_Key before execute: an Atomic with a bad R_Key is a Remote Access Error (the word is
/// never touched).
#[test]
fn the_rkey_comes_before_execution() {
    let mut r = rig(AccessFlags::ALL);
    r.mr.write_at(64, &7u64.to_ne_bytes()).unwrap();
    let t = r.mr.remote(64);
    r.request(
        Opcode::FetchAdd,
        0,
        |p| {
            p.atomic_eth = Some(AtomicEthRepr {
                va: t.addr,
                rkey: t.rkey ^ 0xFFFF_0000,
                swap_add: 1,
                compare: 0,
            })
        },
        &[],
    );
    r.step();
    assert_eq!(
        r.answers(),
        [(Opcode::Acknowledge, 0, nak(NakCode::RemoteAccessError))]
    );
    let mut word = [0u8; 8];
    r.mr.read_at(64, &mut word).unwrap();
    assert_eq!(u64::from_ne_bytes(word), 7);
}

// --- Acks off the critical path. ---

/// Requests that arrive in one burst are acknowledged by one Ack, for the last of them
/// (spec/01 lists "No Ack coalescing" among the simplifications of its walk-through: an
/// Ack may cover several requests), after their receive completions.
#[test]
fn a_burst_of_requests_gets_one_ack_after_its_completions() {
    let mut r = rig(AccessFlags::ALL);
    r.post_recv(12);
    let before = r.ctx.stats().acks_sent;
    for psn in 0..8 {
        r.request(Opcode::SendOnly, psn, |_| {}, b"abcd");
    }
    r.step();
    let got = r.answers();
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(is_ack(&got[0]) && got[0].1 == 7, "{got:?}");
    assert_eq!(r.ctx.stats().acks_sent, before + 1);
    assert_eq!(r.completions().len(), 8);
}

/// An RDMA Read's response acknowledges the requests before it: a Send, a Read and a Send
/// in one burst get the Read's response and one Ack for the last Send — not an Ack for the
/// first Send too.
#[test]
fn a_read_response_carries_the_ack_owed_before_it() {
    let mut r = rig(AccessFlags::ALL);
    r.post_recv(8);
    let reth = r.reth(4096, 4);
    r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
    r.request(Opcode::RdmaReadRequest, 1, |p| p.reth = Some(reth), &[]);
    r.request(Opcode::SendOnly, 2, |_| {}, b"abcd");
    r.step();
    let got = r.answers();
    let ops: Vec<(Opcode, u32)> = got.iter().map(|a| (a.0, a.1)).collect();
    assert_eq!(
        ops,
        [(Opcode::RdmaReadResponseOnly, 1), (Opcode::Acknowledge, 2)]
    );
}

/// Naks are not held back: an RNR Nak in a burst leaves in the same iteration, after the
/// Ack of the requests accepted before it (a Nak carries no credit count, so that Ack is
/// not folded into it).
#[test]
fn naks_leave_at_once_behind_the_ack_they_follow() {
    let mut r = rig(AccessFlags::ALL);
    r.post_recv(1);
    r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
    r.request(Opcode::SendOnly, 1, |_| {}, b"abcd");
    r.step();
    let got = r.answers();
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(is_ack(&got[0]) && got[0].1 == 0, "{got:?}");
    assert!(is_rnr(&got[1]) && got[1].1 == 1, "{got:?}");
}

/// A sequence error Nak leaves in the iteration that found the gap.
#[test]
fn a_sequence_nak_is_not_delayed() {
    let mut r = rig(AccessFlags::ALL);
    r.post_recv(4);
    r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
    r.request(Opcode::SendOnly, 2, |_| {}, b"abcd");
    r.step();
    assert_eq!(
        r.answers(),
        [
            (
                Opcode::Acknowledge,
                0,
                Some(Syndrome::Ack {
                    credits: CreditCode::encode(3)
                })
            ),
            (Opcode::Acknowledge, 1, nak(NakCode::PsnSequenceError)),
        ]
    );
}

/// A PSN ahead of ePSN gets one PSN Sequence Error Nak; more packets ahead of ePSN while
/// it is outstanding are dropped without another (and counted as dropped).
#[test]
fn one_sequence_nak_per_gap() {
    let mut r = rig(AccessFlags::ALL);
    r.post_recv(4);
    let dropped = r.ctx.stats().dropped;
    r.request(Opcode::SendOnly, 1, |_| {}, b"abcd");
    r.request(Opcode::SendOnly, 2, |_| {}, b"abcd");
    r.step();
    assert_eq!(
        r.answers(),
        [(Opcode::Acknowledge, 0, nak(NakCode::PsnSequenceError))]
    );
    assert_eq!(r.ctx.stats().dropped, dropped + 2);
}

/// Each remote operation needs its own enable: a Read on a QP without remote read, and an
/// Atomic on a QP without remote atomics, are Invalid Requests.
#[test]
fn reads_and_atomics_need_their_enables() {
    let mut r = rig(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC);
    let reth = r.reth(0, 4);
    r.request(Opcode::RdmaReadRequest, 0, |p| p.reth = Some(reth), &[]);
    r.step();
    assert_eq!(
        r.answers(),
        [(Opcode::Acknowledge, 0, nak(NakCode::InvalidRequest))]
    );

    let mut r = rig(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ);
    let t = r.mr.remote(64);
    r.request(
        Opcode::CompareSwap,
        0,
        |p| {
            p.atomic_eth = Some(AtomicEthRepr {
                va: t.addr,
                rkey: t.rkey,
                swap_add: 1,
                compare: 0,
            })
        },
        &[],
    );
    r.step();
    assert_eq!(
        r.answers(),
        [(Opcode::Acknowledge, 0, nak(NakCode::InvalidRequest))]
    );
}
