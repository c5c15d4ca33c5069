//! Hostile review of the timed set: a QP that waits for an Ack or for the end of an RNR
//! wait is out of the active set, and whatever happens to it meanwhile — the application
//! moves it to Error or SQD or destroys it, its retries run out, its link goes down, the
//! peer sends a duplicate Ack or a Nak, the application posts again — it must not be
//! stranded (in neither set while it has work) nor complete anything twice.

use std::time::{Duration, Instant};

use super::{Rig, rig};
use crate::wire::aeth::{CreditCode, NakCode, RnrTimer, Syndrome};
use crate::wire::slot::{KIND_GATHER, MAX_GATHER, PacketSlot};
use crate::{QpAttr, QpState, SendOp, SendWr, WcStatus, WorkCompletion};

impl Rig {
    /// Posts Send `id` (8 bytes) and drives the engine until it is sent; its PSNs.
    fn post(&mut self, id: u64) -> Vec<u32> {
        self.qp
            .post_send(&SendWr::new(
                id,
                SendOp::Send,
                &[self.mr.sge(0, 8).unwrap()],
            ))
            .unwrap();
        self.until_sent("the Send")
    }

    /// Drives the engine until `want` completions came, or 20 s passed; a few more
    /// iterations then show that no further completion follows.
    fn completions(&mut self, want: usize) -> Vec<(u64, WcStatus)> {
        let mut wc = [WorkCompletion::default(); 8];
        let mut got = vec![];
        let start = Instant::now();
        while got.len() < want && start.elapsed() < Duration::from_secs(20) {
            self.ctx.progress();
            let n = self.cq.poll(&mut wc);
            got.extend(wc[..n].iter().map(|w| (w.wr_id, w.status)));
        }
        for _ in 0..4 * super::super::TIMER_EVERY {
            self.ctx.progress();
            let n = self.cq.poll(&mut wc);
            got.extend(wc[..n].iter().map(|w| (w.wr_id, w.status)));
        }
        got
    }

    /// After a timer check, the engine has nothing left to look at.
    fn settles(&self) {
        for _ in 0..=super::super::TIMER_EVERY {
            self.ctx.progress();
        }
        assert!(
            self.ctx.shared.engine.with(|e| e.idle()),
            "the engine is idle"
        );
    }

    /// The QP waits for its Ack (timed, not active).
    fn waits(&self) {
        self.ctx.progress();
        assert_eq!(self.sets(), (false, true), "waiting for its Ack only");
    }
}

const ACK: Syndrome = Syndrome::Ack {
    credits: CreditCode::NONE,
};

#[test]
fn a_timed_qp_moved_to_error_flushes_its_send_once() {
    let mut r = rig();
    assert_eq!(r.post(1), [0]);
    r.waits();
    r.qp.modify(&QpAttr::new(QpState::Error)).unwrap();
    assert_eq!(r.completions(1), [(1, WcStatus::WrFlushErr)]);
    // An Ack arriving late completes nothing.
    r.answer(0, ACK, 1);
    assert_eq!(r.completions(0), []);
    r.settles();
    assert_eq!(
        r.ctx.stats().timeouts,
        0,
        "nothing is retried in the Error state"
    );
}

#[test]
fn a_timed_qp_moved_to_sqd_completes_on_its_ack() {
    let mut r = rig();
    assert_eq!(r.post(1), [0]);
    r.waits();
    r.qp.modify(&QpAttr::new(QpState::Sqd)).unwrap();
    r.ctx.progress();
    r.answer(0, ACK, 1);
    assert_eq!(r.completions(1), [(1, WcStatus::Success)]);
    r.settles();
}

#[test]
fn a_timed_qp_whose_retries_run_out_completes_with_an_error_once() {
    let mut r = rig();
    assert_eq!(r.post(1), [0]);
    r.waits();
    // The peer stays silent: 7 retries (Local Ack Timeout about 1 ms), then the error.
    assert_eq!(r.completions(1), [(1, WcStatus::RetryExcErr)]);
    assert_eq!(r.ctx.stats().timeouts, 8);
    r.settles();
}

#[test]
fn a_timed_qp_destroyed_leaves_nothing_behind() {
    let mut r = rig();
    assert_eq!(r.post(1), [0]);
    r.waits();
    let (index, qpn) = (r.qp.index, r.qp.qpn());
    let pd = r.ctx.alloc_pd().unwrap();
    let fresh = r.ctx.create_qp(&pd, &r.cq, &r.cq, crate::QpCaps::default());
    let old = std::mem::replace(&mut r.qp, fresh.unwrap());
    drop(old);
    assert!(
        !r.ctx
            .shared
            .engine
            .with(|e| e.is_timed(index) || e.is_active(index)),
        "a destroyed QP leaves both sets"
    );
    // The peer's Ack for the destroyed QP is dropped.
    let mut s = PacketSlot::default();
    let mut p = crate::wire::PacketRepr::new(crate::wire::BthRepr::new(
        crate::wire::opcode::Opcode::Acknowledge,
        qpn,
        crate::psn::Psn::new(0),
    ));
    p.aeth = Some(crate::wire::aeth::AethRepr {
        syndrome: ACK,
        msn: crate::wire::Msn::new(1),
    });
    s.hdr_len = p.emit(&mut s.data).unwrap() as u8;
    r.peer.tx.push_burst(&[s]).unwrap();
    assert_eq!(r.completions(0), []);
    r.settles();
}

#[test]
fn a_timed_qp_whose_link_goes_down_flushes_its_send_once() {
    let mut r = rig();
    assert_eq!(r.post(1), [0]);
    r.waits();
    // The peer publishes a gather packet without its continuation slots: the link goes
    // down, and the QP waiting for its Ack must learn it.
    let s = PacketSlot {
        kind: KIND_GATHER,
        sge_count: MAX_GATHER as u8,
        ..PacketSlot::default()
    };
    r.peer.tx.push_burst(&[s]).unwrap();
    let got = r.completions(1);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].0, 1);
    assert_ne!(got[0].1, WcStatus::Success);
    assert_eq!(r.qp.state(), QpState::Error);
    r.settles();
}

#[test]
fn a_duplicate_ack_leaves_a_timed_qp_timed_and_its_timer_fires() {
    let mut r = rig();
    assert_eq!(r.post(1), [0]);
    r.waits();
    // An Ack of the PSN before the first (a credit update: the fast path's credits only).
    r.answer(0xFF_FFFF, ACK, 0);
    r.ctx.progress();
    assert!(r.sets().1, "still waiting for its Ack");
    assert_eq!(r.completions(0), []);
    assert_eq!(r.until_sent("retransmission"), [0]);
    r.answer(0, ACK, 1);
    assert_eq!(r.completions(1), [(1, WcStatus::Success)]);
    r.settles();
}

#[test]
fn a_send_posted_during_an_rnr_wait_follows_the_retry_in_order() {
    let mut r = rig();
    assert_eq!(r.post(1), [0]);
    let rnr = Syndrome::RnrNak {
        timer: RnrTimer::new(20),
    };
    r.answer(0, rnr, 0);
    r.ctx.progress();
    r.ctx.progress();
    assert_eq!(r.sets(), (false, true), "in the RNR wait");
    r.qp.post_send(&SendWr::new(2, SendOp::Send, &[r.mr.sge(0, 8).unwrap()]))
        .unwrap();
    r.ctx.progress();
    let mut sent = r.until_sent("retry after the RNR wait");
    for _ in 0..4 {
        r.ctx.progress();
        sent.extend(r.requests());
    }
    assert_eq!(sent, [0, 1]);
    r.answer(1, ACK, 2);
    assert_eq!(
        r.completions(2),
        [(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    r.settles();
}

#[test]
fn a_nak_to_a_timed_qp_resends_and_completes_once() {
    let mut r = rig();
    assert_eq!(r.post(1), [0]);
    assert_eq!(r.post(2), [1]);
    r.waits();
    // PSN 0 arrived, PSN 1 did not: a sequence error Nak at 1.
    r.answer(1, Syndrome::Nak(NakCode::PsnSequenceError), 1);
    let sent = r.until_sent("the resend");
    assert_eq!(sent.last(), Some(&1));
    assert_eq!(r.completions(1), [(1, WcStatus::Success)]);
    r.answer(1, ACK, 2);
    assert_eq!(r.completions(1), [(2, WcStatus::Success)]);
    r.settles();
}

#[test]
fn a_qp_in_a_long_rnr_wait_moved_to_error_flushes_and_settles() {
    let mut r = rig();
    assert_eq!(r.post(1), [0]);
    // Timer code 0: the longest wait, 655 ms.
    let rnr = Syndrome::RnrNak {
        timer: RnrTimer::new(0),
    };
    r.answer(0, rnr, 0);
    r.ctx.progress();
    r.ctx.progress();
    assert_eq!(r.sets(), (false, true), "in the RNR wait");
    r.qp.modify(&QpAttr::new(QpState::Error)).unwrap();
    assert_eq!(r.completions(1), [(1, WcStatus::WrFlushErr)]);
    r.settles();
    assert!(
        r.requests().is_empty(),
        "nothing is retried in the Error state"
    );
}

#[test]
fn a_timed_qp_reset_completes_nothing_and_settles() {
    let mut r = rig();
    assert_eq!(r.post(1), [0]);
    r.waits();
    r.qp.modify(&QpAttr::new(QpState::Reset)).unwrap();
    assert_eq!(r.completions(0), []);
    r.answer(0, ACK, 1);
    assert_eq!(r.completions(0), []);
    r.settles();
}
