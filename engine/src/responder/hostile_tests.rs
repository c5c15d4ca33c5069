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
