//! The RQ Logic against a hostile requester: sequences of requests that aim at the
//! response queue's bound, the owed-Ack lists and the receive WQE a request holds. Uses
//! the rig of `tests.rs` (the real engine, the peer's end of a real link in this test).

use super::tests::{Answer, Rig, nak, rig};
use crate::wire::PacketRepr;
use crate::wire::aeth::NakCode;
use crate::wire::opcode::Opcode;
use crate::{AccessFlags, QpState};

/// The PSN offset just before [`RQ_PSN`]: a duplicate while nothing was accepted.
const BEFORE: u32 = 0xFF_FFFF;

impl Rig {
    /// Publishes a request as [`Rig::request`] does, running the engine first while the
    /// peer's ring is full (the engine reads it; it does not read ours).
    fn push(&mut self, op: Opcode, psn: u32, f: impl FnOnce(&mut PacketRepr), payload: &[u8]) {
        let mut tries = 0;
        while self.tx.free_slots().unwrap() == 0 {
            self.step();
            tries += 1;
            assert!(tries < 100, "the engine stopped reading the peer's ring");
        }
        self.request(op, psn, f, payload);
    }

    /// Reads the answers until the engine sends no more.
    fn all_answers(&mut self) -> Vec<Answer> {
        let mut all = vec![];
        for _ in 0..200 {
            self.step();
            let got = self.answers();
            if got.is_empty() && !all.is_empty() {
                break;
            }
            all.extend(got);
        }
        all
    }
}

/// A requester that stops reading its ring and fills the response queue with what it may
/// queue without bound (RNR Naks, each the answer to the same Send again), then with the
/// answers to duplicate Reads (at most 16) and a new Read, then makes the QP fail: the
/// fatal Nak must still find room (no panic on the queue's bound, nothing lost), and be
/// the last thing the QP sends once the requester reads again.
#[test]
fn a_full_response_queue_still_takes_the_fatal_nak() {
    let mut r = rig(AccessFlags::ALL);
    // No receive posted: every Send at ePSN is an RNR Nak. Enough of them to fill the
    // link and then the response queue's share for droppable answers.
    for _ in 0..400 {
        r.push(Opcode::SendOnly, 0, |_| {}, b"abcd");
    }
    // Answers to duplicate Reads: answered again, each a queued Read job.
    for _ in 0..16 {
        let reth = r.reth(0, 4);
        r.push(
            Opcode::RdmaReadRequest,
            BEFORE,
            |p| p.reth = Some(reth),
            &[],
        );
    }
    // A new Read (the one responder resource), then a request out of sequence: fatal.
    let reth = r.reth(0, 4);
    r.push(Opcode::RdmaReadRequest, 0, |p| p.reth = Some(reth), &[]);
    r.push(Opcode::SendMiddle, 1, |_| {}, b"abcd");
    for _ in 0..4 {
        r.step();
    }
    assert_eq!(r.qp.state(), QpState::Error);
    let got = r.all_answers();
    assert_eq!(
        got.last(),
        Some(&(Opcode::Acknowledge, 1, nak(NakCode::InvalidRequest))),
        "the fatal Nak leaves last ({} answers)",
        got.len()
    );
}

/// The request kinds the property below sends (every header they call for is filled).
const OPS: [Opcode; 15] = [
    Opcode::SendOnly,
    Opcode::SendFirst,
    Opcode::SendMiddle,
    Opcode::SendLast,
    Opcode::SendOnlyWithImmediate,
    Opcode::SendLastWithImmediate,
    Opcode::RdmaWriteOnly,
    Opcode::RdmaWriteFirst,
    Opcode::RdmaWriteMiddle,
    Opcode::RdmaWriteLast,
    Opcode::RdmaWriteOnlyWithImmediate,
    Opcode::RdmaWriteLastWithImmediate,
    Opcode::RdmaReadRequest,
    Opcode::FetchAdd,
    Opcode::CompareSwap,
];

/// One step of a hostile requester: a request (opcode, PSN offset from ePSN, payload
/// length choice, DMA length choice), posting receives, polling the CQ, reading or
/// ignoring the ring, running the engine, or the application failing the QP.
#[derive(Debug, Clone, Copy)]
enum Act {
    Request(usize, i8, u8, u8),
    PostRecv(u8),
    PollCq,
    Read(bool),
    Step,
    Fail,
}

fn act() -> impl proptest::strategy::Strategy<Value = Act> {
    use proptest::prelude::*;
    prop_oneof![
        // Mostly what an honest requester sends (a whole message at ePSN, a short
        // payload), among anything else.
        6 => (prop::sample::select(&[0usize, 4, 6, 10, 12, 13][..]), 0u8..2)
            .prop_map(|(o, l)| Act::Request(o, 0, l, l)),
        1 => (0..OPS.len(), -3i8..=2, 0u8..4, 0u8..4)
            .prop_map(|(o, d, l, r)| Act::Request(o, d, l, r)),
        3 => (0u8..6).prop_map(Act::PostRecv),
        1 => Just(Act::PollCq),
        1 => any::<bool>().prop_map(Act::Read),
        1 => Just(Act::Step),
        1 => Just(Act::Step),
        1 => (0u8..8).prop_map(|n| if n == 0 { Act::Fail } else { Act::Step }),
    ]
}

impl Rig {
    /// Publishes request `op` at PSN offset `delta` from the QP's ePSN, with a payload of
    /// `len` bytes from the peer's arena and, where the opcode calls for one, a RETH
    /// of `dma_len` bytes at offset 0 of the region, an AtomicETH or immediate data.
    /// Nothing if the peer's ring is full.
    fn hostile_request(&mut self, op: Opcode, delta: i8, len: u32, dma_len: u32) {
        use crate::psn::Psn;
        use crate::wire::slot::{KIND_DIRECT, PacketSlot};
        use crate::wire::{AtomicEthRepr, BthRepr, ImmDtRepr};
        if self.tx.free_slots().unwrap() == 0 {
            return;
        }
        let epsn = Psn::new(self.qp.query().expected_psn);
        let psn = epsn.add(delta as i32 as u32);
        let mut p = PacketRepr::new(BthRepr::new(op, self.qp.qpn(), psn));
        let info = op.info().unwrap();
        use crate::wire::opcode::OpClass;
        let first = matches!(
            info.position,
            crate::wire::opcode::Position::First | crate::wire::opcode::Position::Only
        );
        if (info.class == OpClass::RdmaWrite && first) || info.class == OpClass::RdmaReadRequest {
            p.reth = Some(self.reth(0, dma_len));
        }
        if matches!(info.class, OpClass::FetchAdd | OpClass::CompareSwap) {
            let t = self.mr.remote(64);
            p.atomic_eth = Some(AtomicEthRepr {
                va: t.addr,
                rkey: t.rkey,
                swap_add: 1,
                compare: 0,
            });
        }
        if matches!(
            op,
            Opcode::SendOnlyWithImmediate
                | Opcode::SendLastWithImmediate
                | Opcode::RdmaWriteOnlyWithImmediate
                | Opcode::RdmaWriteLastWithImmediate
        ) {
            p.immdt = Some(ImmDtRepr { imm: 7 });
        }
        let mut s = PacketSlot::default();
        s.hdr_len = p.emit(&mut s.data).unwrap() as u8;
        if info.payload && len > 0 {
            s.kind = KIND_DIRECT;
            s.payload_off = 0;
            s.payload_len = len;
        }
        assert_eq!(self.tx.push_burst(&[s]).unwrap(), 1);
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

    /// Any sequence of plausible requests — new, duplicate and ahead of ePSN, in and out
    /// of sequence, too long, too short, without receives, with the CQ full, with the
    /// requester not reading its ring, the QP failed by the application at any point —
    /// never panics the engine, and every receive posted completes exactly once (in
    /// success or in error) by the time the QP has gone to the Error state and its CQ is
    /// drained: none is lost, none is completed twice.
    #[test]
    fn every_receive_completes_exactly_once_whatever_the_requester_sends(
        acts in proptest::collection::vec(act(), 1..120),
    ) {
        let mut r = rig(AccessFlags::ALL);
        let mut next_id = 100u64;
        let mut posted = std::collections::BTreeSet::new();
        let mut completed = std::collections::BTreeMap::<u64, u32>::new();
        let mut reading = true;
        let mut oks = 0u32;
        let mut poll = |r: &mut Rig, completed: &mut std::collections::BTreeMap<u64, u32>| {
            for wc in r.completions() {
                if wc.wr_id >= 100 {
                    if wc.is_ok() { oks += 1; }
                    *completed.entry(wc.wr_id).or_default() += 1;
                }
            }
        };
        for a in acts {
            match a {
                Act::Request(o, d, l, m) => {
                    let len = [4, 0, 256, 300][usize::from(l)];
                    let dma = [4, 0, 256, 1024][usize::from(m)];
                    r.hostile_request(OPS[o], d, len, dma);
                }
                Act::PostRecv(n) => {
                    for _ in 0..n {
                        let sge = [r.mr.sge((next_id % 32) * 512, 512).unwrap()];
                        if r.qp.post_recv(&crate::RecvWr::new(next_id, &sge)).is_ok() {
                            posted.insert(next_id);
                        }
                        next_id += 1;
                    }
                }
                Act::PollCq => poll(&mut r, &mut completed),
                Act::Read(on) => reading = on,
                Act::Step => r.step(),
                Act::Fail => {
                    let _ = r.qp.modify(&crate::QpAttr::new(QpState::Error));
                }
            }
            r.step();
            if reading {
                r.answers();
            }
        }
        let _ = r.qp.modify(&crate::QpAttr::new(QpState::Error));
        for _ in 0..50 {
            r.step();
            r.answers();
            poll(&mut r, &mut completed);
        }

        let twice: Vec<_> = completed.iter().filter(|(_, n)| **n > 1).collect();
        proptest::prop_assert!(twice.is_empty(), "completed twice: {:?}", twice);
        let done: std::collections::BTreeSet<u64> = completed.keys().copied().collect();
        proptest::prop_assert_eq!(done, posted);
    }
}

/// A Send that took its receive WQE on its First packet, then a Middle packet that is
/// fatal (a bad length) while the receive CQ is full: the WQE must not be lost. Once the
/// application polls, it completes once, with the local error, and every other receive
/// posted is flushed once.
#[test]
fn a_receive_in_use_when_a_fatal_error_meets_a_full_cq_completes_once_later() {
    let mut r = rig(AccessFlags::ALL);
    let mut id = 100;
    let mut filled = false;
    // Fill the CQ with receive completions, never polling it: the first Send refused for
    // want of CQ room (an RNR Nak while a receive is posted) says it is full.
    for _ in 0..300 {
        let sge = [r.mr.sge(0, 512).unwrap()];
        if r.qp.post_recv(&crate::RecvWr::new(id, &sge)).is_ok() {
            id += 1;
        }
        r.hostile_request(Opcode::SendOnly, 0, 4, 0);
        r.step();
        if r.answers().iter().any(super::tests::is_rnr) {
            filled = true;
            break;
        }
    }
    assert!(filled, "the CQ never filled");
    let posted: Vec<u64> = (100..id).collect();
    // The receive the Send takes on its First packet, then a Middle of the wrong length.
    r.hostile_request(Opcode::SendFirst, 0, 256, 0);
    r.step();
    r.hostile_request(Opcode::SendMiddle, 0, 4, 0);
    r.step();
    assert_eq!(r.qp.state(), QpState::Error);
    let mut seen = std::collections::BTreeMap::<u64, Vec<crate::WcStatus>>::new();
    for _ in 0..50 {
        r.step();
        r.answers();
        for wc in r.completions() {
            seen.entry(wc.wr_id).or_default().push(wc.status);
        }
    }
    let mut got: Vec<u64> = seen.keys().copied().collect();
    got.sort_unstable();
    assert_eq!(got, posted, "every receive completes");
    assert!(seen.values().all(|s| s.len() == 1), "once: {seen:?}");
    let local = seen
        .values()
        .filter(|s| s[0] == crate::WcStatus::LocQpOpErr)
        .count();
    assert_eq!(
        local, 1,
        "the receive in use completes with the local error: {seen:?}"
    );
}
