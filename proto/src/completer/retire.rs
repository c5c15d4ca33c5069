//! Retiring send WQEs (spec/01: "completes in order"): the oldest finished WQEs leave the
//! window in posted order, signaled ones (and every error) with a send completion; in the
//! Error state every remaining WQE is retired with a flush error.
//!
//! The order of the driver's steps is part of the contract (the engine's loom model checks
//! it): a WQE's memory is released and its queue slot published ([`SendCompletions::publish`])
//! *before* its completion is pushed, so that an application reacting to the completion
//! finds the slot free and its regions idle.

use crate::completion::{WcOpcode, WcStatus, WorkCompletion};
use crate::qp::QpState;
use crate::requester::Requester;
use crate::wire::Qpn;
use crate::wqe::{DataLoc, WqeFlags, WqeOp};

/// What retiring send WQEs needs of the driver: the send CQ, the memory the WQEs held, the
/// queue the application posts to, and a way to tell the application its slots are free.
pub trait SendCompletions {
    /// Whether the send CQ has room for one more completion.
    fn has_room(&mut self) -> bool;

    /// A retired WQE's scatter/gather list `data`: its memory is idle again.
    fn release(&mut self, data: &DataLoc);

    /// The WQEs before sequence number `retired` are retired: the application may reuse
    /// their queue slots.
    fn publish(&mut self, retired: u64);

    /// Pushes a send completion (room was checked).
    fn push(&mut self, wc: WorkCompletion);

    /// In the Error state: takes the WQEs the application posted meanwhile into `req`'s
    /// window, so that they are flushed too.
    fn fetch(&mut self, req: &mut Requester);
}

/// Whether [`retire`] has anything to do: the oldest WQE is done, or the QP is in the Error
/// state. Asked for every active QP every iteration, so it costs a few loads, not a call.
#[inline(always)]
pub fn can_retire(req: &Requester, state: QpState) -> bool {
    state == QpState::Error || req.window().oldest_done()
}

/// Retires the finished WQEs of QP `qpn` (in `state`) in order through `c`; stops when the
/// send CQ is full (the rest stay and are retired later). Returns how many were retired
/// with a flush error.
pub fn retire<C: SendCompletions>(req: &mut Requester, state: QpState, qpn: Qpn, c: &mut C) -> u64 {
    let error = state == QpState::Error;
    if error {
        c.fetch(req);
    }
    let mut flushed = 0;
    let mut published = req.window().retired();
    loop {
        let win = req.window();
        let seq = win.retired();
        if seq == win.fetched() || (!error && seq == win.started()) {
            break;
        }
        // Only what the completion and the release need (not a copy of the whole slot).
        let slot = win.wqe(seq);
        let status = match slot.done {
            Some(s) => s,
            None if error => WcStatus::WrFlushErr,
            None => break,
        };
        let signaled = slot.wqe.flags.has(WqeFlags::SIGNALED) || status != WcStatus::Success;
        if signaled && !c.has_room() {
            break;
        }
        let (wr_id, op, len, data) = (slot.wqe.wr_id, slot.wqe.op, slot.wqe.len, slot.wqe.data);
        c.release(&data);
        req.retire_oldest();
        if signaled {
            published = req.window().retired();
            c.publish(published);
            if status == WcStatus::WrFlushErr {
                flushed += 1;
            }
            c.push(WorkCompletion {
                wr_id,
                status,
                opcode: wc_opcode(op),
                byte_len: if op == WqeOp::Read { len } else { 0 },
                imm_data: None,
                qp_num: qpn,
                solicited: false,
                invalidated_rkey: None,
            });
        }
        if error {
            c.fetch(req);
        }
    }
    if published != req.window().retired() {
        c.publish(req.window().retired());
    }
    flushed
}

/// The completion opcode of a send WQE.
#[inline]
pub fn wc_opcode(op: WqeOp) -> WcOpcode {
    // A table in the order of `WqeOp`'s variants (a load; the `match` it stands for
    // compiled to a jump, a branch per completion).
    const BY_OP: [WcOpcode; 10] = [
        WcOpcode::Send,      // Send
        WcOpcode::Send,      // SendImm
        WcOpcode::RdmaWrite, // Write
        WcOpcode::RdmaWrite, // WriteImm
        WcOpcode::RdmaRead,  // Read
        WcOpcode::CompSwap,  // CompareSwap
        WcOpcode::FetchAdd,  // FetchAdd
        WcOpcode::Send,      // SendInv
        WcOpcode::BindMw,    // BindMw
        WcOpcode::LocalInv,  // LocalInv
    ];
    BY_OP[op as usize]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::psn::Psn;
    use crate::qp::QpConfig;
    use crate::requester::{AckFast, Step};
    use crate::wire::aeth::CreditCode;
    use crate::wqe::{Cursor, SqWqe};
    use alloc::vec::Vec;
    use core::time::Duration;

    /// What the driver was asked, in order.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Call {
        Release(u64),
        Publish(u64),
        Push(u64, WcStatus),
    }

    struct Recorder {
        calls: Vec<Call>,
        room: usize,
        posted: Vec<SqWqe>,
        wcs: Vec<WorkCompletion>,
    }

    impl SendCompletions for Recorder {
        fn has_room(&mut self) -> bool {
            self.room > 0
        }
        fn release(&mut self, data: &DataLoc) {
            let DataLoc::Single(e) = *data else {
                panic!("single")
            };
            self.calls.push(Call::Release(e.off));
        }
        fn publish(&mut self, retired: u64) {
            self.calls.push(Call::Publish(retired));
        }
        fn push(&mut self, wc: WorkCompletion) {
            self.room -= 1;
            self.calls.push(Call::Push(wc.wr_id, wc.status));
            self.wcs.push(wc);
        }
        fn fetch(&mut self, req: &mut Requester) {
            while req.has_room() && !self.posted.is_empty() {
                req.accept(self.posted.remove(0), 1024);
            }
        }
    }

    /// Sends every packet `req` (in RTS) may send now.
    fn send_all(req: &mut Requester) {
        while let Step::Packet { seq, new_wqe, .. } = req.next_step(QpState::Rts, 0) {
            if new_wqe {
                req.begin_wqe();
            }
            let w = *req.wqe(seq);
            req.note_sent(&w, w.first_psn);
            req.packet_sent(None::<Cursor>);
        }
    }

    /// Accepts a signaled Read as WQE `seq` of `req` (in RTS) and sends its request.
    fn send_read(req: &mut Requester, wr_id: u64, seq: u64) {
        let mut w = wqe(wr_id, true);
        w.op = WqeOp::Read;
        req.accept(w, 1024);
        req.next_step(QpState::Rts, 1);
        req.begin_wqe();
        let r = *req.wqe(seq);
        req.note_sent(&r, r.first_psn);
        req.packet_sent(None::<Cursor>);
    }

    fn wqe(wr_id: u64, signaled: bool) -> SqWqe {
        SqWqe {
            wr_id,
            op: WqeOp::Send,
            flags: WqeFlags(if signaled { WqeFlags::SIGNALED } else { 0 }),
            imm: 0,
            len: 8,
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
            data: DataLoc::Single(crate::wqe::SgeEntry {
                off: wr_id * 100,
                len: 8,
                mr: 0,
            }),
        }
    }

    /// A requester that sent Sends `ids` (signaled unless listed in `quiet`), PSN 0 on.
    fn sent(ids: &[u64], quiet: &[u64]) -> (Requester, QpConfig) {
        let cfg = QpConfig {
            remote_credits: false,
            retry_cnt: 1,
            ..QpConfig::default()
        };
        let mut req = Requester::new(8);
        req.start(&cfg, Duration::from_nanos(1));
        for &id in ids {
            req.accept(wqe(id, !quiet.contains(&id)), 1024);
        }
        send_all(&mut req);
        (req, cfg)
    }

    fn recorder(room: usize) -> Recorder {
        Recorder {
            calls: Vec::new(),
            room,
            posted: Vec::new(),
            wcs: Vec::new(),
        }
    }

    /// spec/01: WQEs complete in order; an unsignaled success retires without a
    /// completion; each WQE's memory is released and its slot published before its
    /// completion is pushed.
    #[test]
    fn retired_in_order_released_and_published_before_completed() {
        let (mut req, cfg) = sent(&[1, 2, 3], &[2]);
        assert!(!can_retire(&req, QpState::Rts));
        assert_eq!(
            req.ack_fast(Psn::new(2), CreditCode::new(31), 3, &cfg),
            Some(AckFast::Acked { end: 3 })
        );
        assert!(can_retire(&req, QpState::Rts));
        let mut c = recorder(8);
        assert_eq!(retire(&mut req, QpState::Rts, Qpn::new(5), &mut c), 0);
        use Call::*;
        assert_eq!(
            c.calls,
            [
                Release(100),
                Publish(1),
                Push(1, WcStatus::Success),
                Release(200),
                Release(300),
                Publish(3),
                Push(3, WcStatus::Success),
            ]
        );
        assert_eq!(req.window().retired(), 3);
    }

    /// A full send CQ stops retiring at the first WQE that needs a completion; the rest
    /// stay, and an unsignaled one retired before it is still published.
    #[test]
    fn a_full_cq_stops_retiring() {
        let (mut req, cfg) = sent(&[1, 2], &[1]);
        req.ack_fast(Psn::new(1), CreditCode::new(31), 2, &cfg);
        let mut c = recorder(0);
        retire(&mut req, QpState::Rts, Qpn::new(5), &mut c);
        assert_eq!(c.calls, [Call::Release(100), Call::Publish(1)]);
        assert_eq!(req.window().retired(), 1);
    }

    /// In the Error state every WQE left — sent, not acknowledged, or posted meanwhile —
    /// retires with a flush error, signaled or not.
    #[test]
    fn the_error_state_flushes_everything() {
        let (mut req, _) = sent(&[1, 2], &[2]);
        let mut c = recorder(8);
        c.posted.push(wqe(3, false));
        assert!(can_retire(&req, QpState::Error));
        assert_eq!(retire(&mut req, QpState::Error, Qpn::new(5), &mut c), 3);
        let pushes: Vec<_> = c
            .calls
            .iter()
            .filter_map(|c| match c {
                Call::Push(id, s) => Some((*id, *s)),
                _ => None,
            })
            .collect();
        assert_eq!(
            pushes,
            [
                (1, WcStatus::WrFlushErr),
                (2, WcStatus::WrFlushErr),
                (3, WcStatus::WrFlushErr)
            ]
        );
        assert_eq!(req.window().retired(), 3);
    }

    /// The Ack fast path takes only an Ack that ends exactly at the oldest WQEs' last
    /// PSN; a duplicate brings only credits; one beyond what was sent, or inside a message,
    /// is left to the full checks.
    #[test]
    fn the_ack_fast_path_takes_only_what_it_can_decide() {
        let (mut req, cfg) = sent(&[1, 2], &[]);
        let code = CreditCode::new(31);
        assert_eq!(req.ack_fast(Psn::new(2), code, 2, &cfg), None, "never sent");
        assert_eq!(
            req.ack_fast(Psn::new(0), code, 1, &cfg),
            Some(AckFast::Acked { end: 1 })
        );
        assert_eq!(req.window().acked(), Psn::new(0));
        assert_eq!(req.wqe(0).done, Some(WcStatus::Success));
        assert_eq!(req.wqe(1).done, None);
        assert_eq!(
            req.ack_fast(Psn::new(0), code, 1, &cfg),
            Some(AckFast::Credits),
            "a duplicate"
        );
        // A Read in the window: its data is missing, the full checks decide.
        let mut read = Requester::new(4);
        read.start(&cfg, Duration::from_nanos(1));
        send_read(&mut read, 9, 0);
        assert_eq!(read.ack_fast(Psn::new(0), code, 1, &cfg), None);
    }

    /// Each send WQE's operation completes with its opcode.
    #[test]
    fn each_operation_completes_with_its_opcode() {
        use WcOpcode as C;
        for (op, wc) in [
            (WqeOp::Send, C::Send),
            (WqeOp::SendImm, C::Send),
            (WqeOp::SendInv, C::Send),
            (WqeOp::Write, C::RdmaWrite),
            (WqeOp::WriteImm, C::RdmaWrite),
            (WqeOp::Read, C::RdmaRead),
            (WqeOp::CompareSwap, C::CompSwap),
            (WqeOp::FetchAdd, C::FetchAdd),
            (WqeOp::BindMw, C::BindMw),
            (WqeOp::LocalInv, C::LocalInv),
        ] {
            assert_eq!(wc_opcode(op), wc, "{op:?}");
        }
    }

    /// An Ack the fast path refuses at a WQE behind ones it passed — inside the second of
    /// two Sends (two packets), or at a Read behind a Send — changes nothing: the WQEs it
    /// passed (and marked done on the way) are not done, nothing is acknowledged.
    #[test]
    fn an_ack_refused_past_the_oldest_wqe_leaves_it_not_done() {
        let code = CreditCode::new(31);
        let (mut two, cfg) = sent(&[1], &[]);
        let mut w = wqe(2, true);
        w.len = 2048; // two packets of the PMTU of 1024
        two.accept(w, 1024);
        while let Step::Packet {
            seq,
            new_wqe,
            point,
        } = two.next_step(QpState::Rts, 0)
        {
            if new_wqe {
                two.begin_wqe();
            }
            let w = *two.wqe(seq);
            two.note_sent(&w, w.first_psn.add(point.pkt));
            let last = Requester::ends_wqe(&w, point.pkt);
            two.packet_sent((!last).then(Cursor::default));
        }
        assert_eq!(two.window().sent_to(), Psn::new(3));
        let (mut read, _) = sent(&[1], &[]);
        send_read(&mut read, 2, 1);
        for (req, psn) in [(&mut two, 1), (&mut read, 1)] {
            let acked = req.window().acked();
            assert_eq!(req.ack_fast(Psn::new(psn), code, 2, &cfg), None);
            assert_eq!((req.wqe(0).done, req.wqe(1).done), (None, None));
            assert_eq!(req.window().acked(), acked);
        }
        // The Ack of the whole: both done.
        assert_eq!(
            two.ack_fast(Psn::new(2), code, 2, &cfg),
            Some(AckFast::Acked { end: 2 })
        );
        assert_eq!(two.wqe(0).done, Some(WcStatus::Success));
        assert_eq!(two.wqe(1).done, Some(WcStatus::Success));
    }

    /// The credits of a fast Ack: counted from the consuming count of the message its MSN
    /// names — the last WQE it acknowledges (the usual case), or an older one (an MSN that
    /// lags) — as the full path counts them.
    #[test]
    fn the_credits_of_a_fast_ack_count_from_the_message_its_msn_names() {
        for (msn, limit) in [(2, 6), (1, 5)] {
            let (mut req, mut cfg) = sent(&[], &[]);
            cfg.remote_credits = true;
            let mut req2 = Requester::new(8);
            core::mem::swap(&mut req, &mut req2);
            req.start(&cfg, Duration::from_nanos(1));
            // An unsolicited Ack before the first PSN: no credits yet.
            req.update_credits(CreditCode::encode(0), 0);
            for id in [1, 2, 3] {
                req.accept(wqe(id, true), 1024);
            }
            // Sends start with one packet each without credits only as limited ones: give
            // them room to start.
            req.update_credits(CreditCode::encode(3), 0);
            send_all(&mut req);
            assert_eq!(req.window().sent_to(), Psn::new(3));
            assert_eq!(
                req.ack_fast(Psn::new(1), CreditCode::encode(4), msn, &cfg),
                Some(AckFast::Acked { end: 2 }),
                "MSN {msn}"
            );
            assert!(req.credits().allows(limit), "MSN {msn}");
            assert!(!req.credits().allows(limit + 1), "MSN {msn}");
        }
    }

    /// Outside the Error state retiring stops at the first WQE not done: the oldest, done,
    /// retires; the one behind it, sent but not acknowledged, stays (it is not flushed).
    #[test]
    fn retiring_stops_at_the_first_wqe_not_done() {
        let (mut req, cfg) = sent(&[1, 2], &[]);
        assert_eq!(
            req.ack_fast(Psn::new(0), CreditCode::new(31), 1, &cfg),
            Some(AckFast::Acked { end: 1 })
        );
        let mut c = recorder(8);
        assert_eq!(retire(&mut req, QpState::Rts, Qpn::new(5), &mut c), 0);
        use Call::*;
        assert_eq!(
            c.calls,
            [Release(100), Publish(1), Push(1, WcStatus::Success)]
        );
        assert_eq!(req.window().retired(), 1);
        assert_eq!(req.wqe(1).done, None);
        // Nothing more to do until it is acknowledged.
        let mut c = recorder(8);
        assert!(!can_retire(&req, QpState::Rts));
        assert_eq!(retire(&mut req, QpState::Rts, Qpn::new(5), &mut c), 0);
        assert_eq!(c.calls, []);
    }

    /// A completed RDMA Read's completion carries its length and the RDMA Read opcode; a
    /// Send's, the Send opcode; both name the QP.
    #[test]
    fn a_read_completion_carries_its_length() {
        let cfg = QpConfig {
            remote_credits: false,
            ..QpConfig::default()
        };
        let mut req = Requester::new(8);
        req.start(&cfg, Duration::from_nanos(1));
        let mut r = wqe(1, true);
        r.op = WqeOp::Read;
        r.len = 300;
        req.accept(r, 1024);
        req.accept(wqe(2, true), 1024);
        while let Step::Packet { seq, new_wqe, .. } = req.next_step(QpState::Rts, 1) {
            if new_wqe {
                req.begin_wqe();
            }
            let w = *req.wqe(seq);
            req.note_sent(&w, w.first_psn);
            req.packet_sent(None::<Cursor>);
        }
        req.complete(0, WcStatus::Success);
        req.complete(1, WcStatus::Success);
        let mut c = recorder(8);
        retire(&mut req, QpState::Rts, Qpn::new(5), &mut c);
        let got: Vec<_> = c
            .wcs
            .iter()
            .map(|wc| (wc.wr_id, wc.opcode, wc.byte_len, wc.qp_num))
            .collect();
        assert_eq!(
            got,
            [
                (1, WcOpcode::RdmaRead, 300, Qpn::new(5)),
                (2, WcOpcode::Send, 0, Qpn::new(5))
            ]
        );
    }
}
