//! The SQ Logic's send window: the WQEs between the oldest one not yet retired and the
//! newest one taken from the send queue, their PSNs, and the transmit point.
//!
//! The window is owned by the SQ Logic (shmhca's `requester::Requester`). The completer
//! reads it and asks it for the few changes a response makes — a WQE done, a Read response
//! seen, the acknowledged PSN moved on, a go-back-N rewind, the oldest WQE retired — through
//! the methods below; it never writes a field. Four counters order the WQEs:
//!
//! ```text
//!   retired ≤ tx_seq ≤ started ≤ fetched          (sequence numbers of WQEs, never wrap)
//!   [retired, started)  in flight: they have PSNs, some packets were sent
//!   [started, fetched)  taken from the send queue, not started
//!   tx_seq              the WQE whose packet `tx_pkt` goes next (< started while resending)
//! ```
//!
//! and three PSNs: `acked` (everything up to it is acknowledged), `npsn` (the next new
//! request packet) and `sent_to` (the PSN after the highest one ever sent: a packet behind
//! it is a retransmission).

use alloc::boxed::Box;
use alloc::vec;

use crate::completion::WcStatus;
use crate::psn::Psn;
use crate::wqe::Cursor;
use crate::wqe::{SqWqe, WqeFlags, WqeOp};

/// A send WQE inside the window.
#[derive(Debug, Clone, Copy)]
pub struct SendWqe {
    /// The work request as the application posted it.
    pub wqe: SqWqe,
    /// Messages consuming a receive WQE at the responder, up to and including this one.
    pub consumers: u64,
    /// PSN of its first packet (valid once started).
    pub first_psn: Psn,
    /// PSNs it occupies: its request packets, or for an RDMA Read its response packets.
    pub span: u32,
    /// RDMA Read responses received so far.
    pub resp_seen: u32,
    /// Set when the completer is done with it.
    pub done: Option<WcStatus>,
}

impl SendWqe {
    /// An unused window slot.
    pub const EMPTY: SendWqe = SendWqe {
        wqe: SqWqe {
            wr_id: 0,
            op: WqeOp::Send,
            flags: WqeFlags(0),
            imm: 0,
            len: 0,
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
            data: crate::wqe::DataLoc::Empty,
        },
        consumers: 0,
        first_psn: Psn::new(0),
        span: 0,
        resp_seen: 0,
        done: None,
    };

    /// PSN of its last packet (or last expected response).
    pub fn last_psn(&self) -> Psn {
        // A local operation (memory windows) has no PSN: span 0.
        self.first_psn.add(self.span.saturating_sub(1))
    }

    /// Whether `p` is one of its PSNs.
    pub fn holds(&self, p: Psn) -> bool {
        let d = p.diff(self.first_psn);
        d >= 0 && (d as u32) < self.span
    }

    /// The PSN of the first Read response still missing (for a Read; for an Atomic, its
    /// one response).
    pub fn missing_response(&self) -> Psn {
        self.first_psn.add(self.resp_seen)
    }
}

/// Where the next packet comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxPoint {
    /// The WQE.
    pub seq: u64,
    /// Its packet (for an RDMA Read: the first response to ask for).
    pub pkt: u32,
    /// The gather position of that packet; `None` after a rewind (derived from `pkt` when
    /// the packet is built).
    pub cursor: Option<Cursor>,
}

/// The send window of one QP.
#[derive(Debug)]
pub struct SendWindow {
    slots: Box<[SendWqe]>,
    retired: u64,
    started: u64,
    fetched: u64,
    tx: TxPoint,
    npsn: Psn,
    acked: Psn,
    sent_to: Psn,
}

impl SendWindow {
    /// A window for a send queue of `depth` WQEs.
    pub fn new(depth: u32) -> SendWindow {
        let cap = (depth as usize).next_power_of_two();
        SendWindow {
            slots: vec![SendWqe::EMPTY; cap].into_boxed_slice(),
            retired: 0,
            started: 0,
            fetched: 0,
            tx: TxPoint {
                seq: 0,
                pkt: 0,
                cursor: Some(Cursor::default()),
            },
            npsn: Psn::new(0),
            acked: Psn::new(0).sub(1),
            sent_to: Psn::new(0),
        }
    }

    /// Sets the first PSN (RTR → RTS): nothing is acknowledged or sent yet.
    pub fn start_at(&mut self, sq_psn: Psn) {
        self.npsn = sq_psn;
        self.acked = sq_psn.sub(1);
        self.sent_to = sq_psn;
    }

    /// Slots in the window.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Bytes of the window.
    pub fn memory_bytes(&self) -> usize {
        self.slots.len() * size_of::<SendWqe>()
    }

    /// WQEs retired.
    #[inline]
    pub fn retired(&self) -> u64 {
        self.retired
    }

    /// WQEs started (given PSNs).
    #[inline]
    pub fn started(&self) -> u64 {
        self.started
    }

    /// WQEs taken into the window.
    #[inline]
    pub fn fetched(&self) -> u64 {
        self.fetched
    }

    /// nPSN: the PSN of the next new request packet.
    #[inline]
    pub fn npsn(&self) -> Psn {
        self.npsn
    }

    /// The PSN after the highest request packet ever sent (for an RDMA Read or Atomic,
    /// after its last response's PSN): a response at or after it answers nothing sent.
    #[inline]
    pub fn sent_to(&self) -> Psn {
        self.sent_to
    }

    /// The last PSN acknowledged: everything up to it is.
    #[inline]
    pub fn acked(&self) -> Psn {
        self.acked
    }

    /// The transmit point.
    #[inline]
    pub fn tx(&self) -> TxPoint {
        self.tx
    }

    /// WQE `seq` (any sequence number maps to a slot; callers stay within the window).
    /// (The slot count a power of two, masked by itself less one: a loop over WQEs checks
    /// the bounds once, where a separate mask was checked against them on every access.)
    #[inline]
    pub fn wqe(&self, seq: u64) -> &SendWqe {
        &self.slots[seq as usize & (self.slots.len() - 1)]
    }

    #[inline]
    fn wqe_mut(&mut self, seq: u64) -> &mut SendWqe {
        &mut self.slots[seq as usize & (self.slots.len() - 1)]
    }

    /// The in-flight WQE holding PSN `p`.
    pub fn find(&self, p: Psn) -> Option<u64> {
        (self.retired..self.started).find(|&s| self.wqe(s).holds(p))
    }

    /// Whether any request is unacknowledged.
    #[inline]
    pub fn outstanding(&self) -> bool {
        self.acked.add(1) != self.npsn
    }

    /// Whether there is anything to transmit now or later.
    #[inline]
    pub fn has_work(&self) -> bool {
        self.tx.seq < self.fetched
    }

    /// Whether another WQE fits.
    #[inline]
    pub fn has_room(&self) -> bool {
        self.fetched - self.retired < self.slots.len() as u64
    }

    /// Whether the oldest WQE in flight is done (it can retire).
    #[inline]
    pub fn oldest_done(&self) -> bool {
        self.retired < self.started && self.wqe(self.retired).done.is_some()
    }

    /// Appends a WQE taken from the send queue (the caller checked [`SendWindow::has_room`]).
    pub fn push(&mut self, w: SendWqe) {
        debug_assert!(self.has_room());
        let seq = self.fetched;
        *self.wqe_mut(seq) = w;
        self.fetched += 1;
    }

    /// Appends a single-packet WQE `w` (with the count of consuming messages up to it),
    /// starts it and records its one packet as sent, in one step (the template path of an
    /// idle send queue: nothing is queued or being resent, so the transmit point is at the
    /// end of the window and moves past it). Returns its PSN. Afterwards the window is as
    /// [`SendWindow::push`], [`SendWindow::start_next`], [`SendWindow::note_sent`] and
    /// [`SendWindow::next_wqe`] leave it.
    #[inline(always)]
    pub fn push_sent(&mut self, w: &SqWqe, consumers: u64) -> Psn {
        debug_assert!(self.has_room() && !self.has_work() && self.started == self.fetched);
        debug_assert!(!self.npsn.before(self.sent_to), "a new PSN is not a resend");
        let (seq, psn) = (self.fetched, self.npsn);
        let slot = self.wqe_mut(seq);
        slot.wqe = *w;
        slot.consumers = consumers;
        slot.first_psn = psn;
        slot.span = 1;
        slot.resp_seen = 0;
        slot.done = None;
        self.fetched = seq + 1;
        self.started = seq + 1;
        self.npsn = psn.add(1);
        self.sent_to = self.npsn;
        // An idle window's transmit point is at the start of the WQE after its last (every
        // move that leaves a WQE, `next_wqe`, a rewind past the last, `drop_oldest`, starts
        // the next one at packet 0): only the WQE moves on.
        debug_assert_eq!(
            (self.tx.pkt, self.tx.cursor),
            (0, Some(Cursor::default())),
            "an idle window's transmit point is at a WQE's start"
        );
        self.tx.seq = seq + 1;
        psn
    }

    /// Starts the WQE at the transmit point (it is `started`): gives it its PSNs; returns
    /// it.
    pub fn start_next(&mut self) -> &SendWqe {
        debug_assert_eq!(self.tx.seq, self.started);
        let (seq, npsn) = (self.started, self.npsn);
        let w = self.wqe_mut(seq);
        w.first_psn = npsn;
        let span = w.span;
        self.npsn = npsn.add(span);
        self.started += 1;
        self.wqe(seq)
    }

    /// Records that packet `psn` of `w` goes out now; true if it was sent before (a
    /// go-back-N retransmission).
    pub fn note_sent(&mut self, w: &SendWqe, psn: Psn) -> bool {
        if psn.before(self.sent_to) {
            return true;
        }
        let k = psn.diff(w.first_psn) as u32;
        self.sent_to = psn.add(if w.wqe.op.is_rd_atomic() {
            w.span - k
        } else {
            1
        });
        false
    }

    /// Moves the transmit point to the next packet of its WQE, at gather position `cursor`.
    pub fn next_packet(&mut self, cursor: Cursor) {
        self.tx.pkt += 1;
        self.tx.cursor = Some(cursor);
    }

    /// Moves the transmit point to the start of the next WQE.
    pub fn next_wqe(&mut self) {
        self.tx = TxPoint {
            seq: self.tx.seq + 1,
            pkt: 0,
            cursor: Some(Cursor::default()),
        };
    }

    /// Marks WQE `seq` done with `status` (the completer, or a local error).
    pub fn complete(&mut self, seq: u64, status: WcStatus) {
        self.wqe_mut(seq).done = Some(status);
    }

    /// Takes back [`SendWindow::complete`] of WQE `seq` (a fast path that marked it and
    /// then found the Ack was not its to take).
    pub fn wqe_undone(&mut self, seq: u64) {
        self.wqe_mut(seq).done = None;
    }

    /// Counts one more Read response of WQE `seq`; returns the new count.
    pub fn response_seen(&mut self, seq: u64) -> u32 {
        let w = self.wqe_mut(seq);
        w.resp_seen += 1;
        w.resp_seen
    }

    /// Records acknowledgement up to `psn`; true if that is progress.
    pub fn acknowledge(&mut self, psn: Psn) -> bool {
        if psn.after(self.acked) {
            self.acked = psn;
            true
        } else {
            false
        }
    }

    /// Moves the transmit point back to PSN `p` (go-back-N): the WQE holding it and every
    /// one after it are sent again from that packet on, with their original PSNs.
    pub fn rewind(&mut self, p: Psn) {
        self.tx = match self.find(p) {
            Some(seq) => {
                let w = self.wqe(seq);
                TxPoint {
                    seq,
                    pkt: match w.wqe.op {
                        WqeOp::CompareSwap | WqeOp::FetchAdd => 0,
                        // Send/Write: the packet index; Read: the first response to ask for
                        // again.
                        _ => p.diff(w.first_psn) as u32,
                    },
                    cursor: None,
                }
            }
            // Nothing in flight holds p (it is nPSN): nothing to send again.
            None => TxPoint {
                seq: self.started,
                pkt: 0,
                cursor: Some(Cursor::default()),
            },
        };
    }

    /// Retires the oldest WQE (done, or flushed); returns it.
    pub fn retire_oldest(&mut self) -> SendWqe {
        let w = *self.wqe(self.retired);
        self.drop_oldest();
        w
    }

    /// [`SendWindow::retire_oldest`] without the WQE handed back (for a caller that read
    /// what it needs of it in place).
    #[inline]
    pub fn drop_oldest(&mut self) {
        self.retired += 1;
        if self.tx.seq < self.retired {
            self.tx = TxPoint {
                seq: self.retired,
                pkt: 0,
                cursor: Some(Cursor::default()),
            };
        }
        self.started = self.started.max(self.retired);
    }

    /// [`SendWindow::drop_oldest`] of every WQE before `to`, all of them started (the
    /// caller's Ack acknowledged them): the started count stays as it is, the transmit
    /// point moves past them if it was not.
    #[inline]
    pub fn drop_started_to(&mut self, to: u64) {
        debug_assert!(self.retired <= to && to <= self.started);
        self.retired = to;
        if self.tx.seq < to {
            self.tx = TxPoint {
                seq: to,
                pkt: 0,
                cursor: Some(Cursor::default()),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(span: u32) -> SendWqe {
        SendWqe {
            span,
            ..SendWqe::EMPTY
        }
    }

    #[test]
    fn starting_gives_consecutive_psns_and_rewind_finds_the_holder() {
        let mut win = SendWindow::new(4);
        win.start_at(Psn::new(0xFF_FFFE));
        win.push(send(3));
        win.push(send(1));
        assert_eq!(win.start_next().first_psn, Psn::new(0xFF_FFFE));
        win.next_wqe();
        assert_eq!(win.start_next().first_psn, Psn::new(1));
        win.next_wqe();
        assert_eq!(win.npsn(), Psn::new(2));
        assert!(win.outstanding() && !win.has_work());
        win.rewind(Psn::new(0));
        let tx = win.tx();
        assert_eq!((tx.seq, tx.pkt), (0, 2));
        assert!(
            tx.cursor.is_none(),
            "a rewind recomputes the gather position"
        );
        win.rewind(Psn::new(2)); // nPSN: nothing to resend
        assert_eq!((win.tx().seq, win.tx().pkt), (2, 0));
    }

    #[test]
    fn acknowledging_moves_only_forward_and_retiring_drags_the_transmit_point() {
        let mut win = SendWindow::new(2);
        win.start_at(Psn::new(10));
        win.push(send(2));
        win.start_next();
        assert!(!win.acknowledge(Psn::new(9)));
        assert!(win.acknowledge(Psn::new(11)));
        assert!(!win.acknowledge(Psn::new(10)));
        assert!(!win.outstanding());
        win.complete(0, WcStatus::Success);
        assert!(win.oldest_done());
        assert_eq!(win.retire_oldest().done, Some(WcStatus::Success));
        assert_eq!((win.retired(), win.tx().seq), (1, 1));
        assert!(win.has_room());
    }

    /// `push_sent` leaves the window as the four steps of the normal path do.
    #[test]
    fn pushing_a_sent_wqe_equals_push_start_send_and_advance() {
        for start in [0, 0xFF_FFFF] {
            let (mut a, mut b) = (SendWindow::new(4), SendWindow::new(4));
            a.start_at(Psn::new(start));
            b.start_at(Psn::new(start));
            for _ in 0..6 {
                let psn = a.push_sent(&send(1).wqe, 3);
                b.push(SendWqe {
                    consumers: 3,
                    ..send(1)
                });
                let w = *b.start_next();
                assert!(!b.note_sent(&w, w.first_psn));
                b.next_wqe();
                assert_eq!(psn, w.first_psn);
                let state = |x: &SendWindow| {
                    let tx = x.tx();
                    (
                        (x.retired, x.started, x.fetched, x.npsn, x.acked, x.sent_to),
                        (tx.seq, tx.pkt, tx.cursor),
                        format!("{:?}", x.wqe(x.fetched - 1)),
                    )
                };
                assert_eq!(format!("{:?}", state(&a)), format!("{:?}", state(&b)));
                for x in [&mut a, &mut b] {
                    x.acknowledge(psn);
                    x.complete(x.retired(), WcStatus::Success);
                    x.retire_oldest();
                }
            }
        }
    }

    /// `push_sent` moves only the transmit point's WQE: the point of an idle window is at
    /// a WQE's start (packet 0, gather position at the list's start) however the window
    /// became idle — the last packet of a multi-packet WQE resent after a rewind into it,
    /// a rewind to nPSN, the transmit point dragged by retiring. Each window then takes a
    /// WQE by `push_sent` and its twin by the normal path's four steps, and the two agree.
    #[test]
    fn push_sent_after_a_resend_a_rewind_or_a_retire_equals_the_normal_path() {
        let mid = Cursor { idx: 1, skip: 5 };
        // Sends a 3-packet WQE, then leaves the window idle in one of three ways.
        let idle = |how: u8| {
            let mut win = SendWindow::new(4);
            win.start_at(Psn::new(100));
            win.push(send(3));
            win.start_next();
            win.next_packet(mid);
            win.next_packet(mid);
            win.next_wqe();
            match how {
                // The rest of the WQE sent again from its second packet.
                0 => {
                    win.rewind(Psn::new(101));
                    assert_eq!((win.tx().pkt, win.tx().cursor), (1, None));
                    win.next_packet(mid);
                    win.next_wqe();
                }
                // A rewind to nPSN: nothing to send again.
                1 => win.rewind(Psn::new(103)),
                // Acknowledged, completed and retired.
                _ => {
                    win.acknowledge(Psn::new(102));
                    win.complete(0, WcStatus::Success);
                    win.retire_oldest();
                }
            }
            assert!(!win.has_work());
            win
        };
        for how in 0..3 {
            let (mut a, mut b) = (idle(how), idle(how));
            let psn = a.push_sent(&send(1).wqe, 0);
            b.push(send(1));
            let w = *b.start_next();
            assert!(!b.note_sent(&w, w.first_psn));
            b.next_wqe();
            assert_eq!(psn, w.first_psn, "case {how}");
            assert_eq!(a.tx(), b.tx(), "case {how}");
            assert_eq!(a.tx().cursor, Some(Cursor::default()), "case {how}");
            assert_eq!(
                (a.started, a.fetched, a.npsn, a.sent_to),
                (b.started, b.fetched, b.npsn, b.sent_to),
                "case {how}"
            );
        }
    }

    #[test]
    fn a_packet_behind_the_highest_sent_is_a_retransmission() {
        let mut win = SendWindow::new(2);
        win.push(send(2));
        let w = *win.start_next();
        assert!(!win.note_sent(&w, Psn::new(0)));
        assert!(!win.note_sent(&w, Psn::new(1)));
        assert!(win.note_sent(&w, Psn::new(0)));
    }
}
