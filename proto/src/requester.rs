//! The SQ Logic's state machine (spec/01): the send window, the gates before a new WQE
//! starts, end-to-end credits, the retry counters and the two timers.
//!
//! A [`Requester`] decides; whoever drives it does the I/O. The engine's packet builder asks
//! it what to send next ([`Requester::next_step`]), tells it what went out
//! ([`Requester::begin_wqe`], [`Requester::packet_sent`]); the completer tells it what the
//! responses said ([`Requester::acknowledged`], [`Requester::rnr_wait`],
//! [`Requester::resend_from`], [`Requester::complete`]); and the timers run through
//! [`Requester::handle_timeout`], with the time passed in through a [`Timers`], so that a
//! test plays an hour of retries on a [`ManualClock`](crate::timer::ManualClock) in no time.
//! Its fields are private: the window, the counters and the timers change only through the
//! operations below.
//!
//! WQEs are processed strictly in posted order. Before a new WQE starts, three gates apply:
//! the fence (a fenced WQE waits for every earlier RDMA Read and Atomic to complete), the
//! initiator depth (Reads and Atomics in flight) and end-to-end credits (spec/02 "SQ Logic's
//! Behavior When No Credits Are Available": a limited Send sends only its first packet, with
//! AckReq, and waits).
//!
//! ```
//! use core::time::Duration;
//! use shmhca_proto::completion::WcStatus;
//! use shmhca_proto::psn::Psn;
//! use shmhca_proto::qp::{QpConfig, QpState};
//! use shmhca_proto::requester::{Requester, Step, Timeout};
//! use shmhca_proto::timer::{Clock, ManualClock, Timestamp, Timers};
//! use shmhca_proto::wqe::{DataLoc, SqWqe, WqeFlags, WqeOp};
//!
//! // Retry Count 1, Local Ack Timeout 14 (~67 ms).
//! let cfg = QpConfig { sq_psn: Psn::new(100), retry_cnt: 1, timeout: 14, ..QpConfig::default() };
//! let clock = ManualClock::new(Timestamp::from_nanos(0));
//! let mut req = Requester::new(4);
//! req.start(&cfg, clock.resolution());
//! let send = SqWqe { wr_id: 1, op: WqeOp::Send, flags: WqeFlags(WqeFlags::SIGNALED), imm: 0,
//!     len: 8, remote_addr: 0, rkey: 0, compare_add: 0, swap: 0, data: DataLoc::Empty };
//! req.accept(send, cfg.path_mtu.bytes());
//! // The packet builder asks what goes next and sends it.
//! let Step::Packet { seq, new_wqe: true, .. } = req.next_step(QpState::Rts, cfg.max_rd_atomic)
//! else { unreachable!() };
//! req.begin_wqe();
//! let w = *req.wqe(seq);
//! req.note_sent(&w, w.first_psn);
//! req.packet_sent(None);
//! req.after_transmit(true, None);
//! // No Ack ever comes: each expiry resends from the oldest unacknowledged PSN, until the
//! // Retry Count is spent.
//! let mut timers = clock.timers();
//! req.start_timers(&mut timers);
//! let mut outcomes = Vec::new();
//! for _ in 0..4 {
//!     clock.advance(Duration::from_secs(1));
//!     let out = req.handle_timeout(&mut clock.timers(), false);
//!     outcomes.push(out);
//!     if matches!(out, Timeout::Exhausted { .. }) { break; }
//!     req.start_timers(&mut clock.timers());
//! }
//! assert_eq!(outcomes, [Timeout::Resend(Psn::new(100)),
//!                       Timeout::Exhausted { seq: Some(0), link_full: false }]);
//! # let _ = WcStatus::RetryExcErr;
//! ```

use core::time::Duration;

use crate::completion::WcStatus;
use crate::credit::CreditState;
use crate::psn::{self, Psn};
use crate::qp::{QpConfig, QpState};
use crate::send_window::{SendWindow, SendWqe, TxPoint};
use crate::timer::{Deadline, RNR_RETRY_FOREVER, Timers, Timestamp};
use crate::wire::Qpn;
use crate::wire::aeth::CreditCode;
use crate::wire::bth::{self, BthRepr};
use crate::wire::opcode::Opcode;
use crate::wqe::{Cursor, SqWqe, WqeFlags, WqeOp};

mod transmit;

pub use transmit::{RequestPacket, SendError, SqDriver, Transmitted, request_packet, transmit};

/// The P_Key every packet carries (the default partition, full membership).
pub const DEFAULT_PKEY: u16 = BthRepr::DEFAULT_PKEY;

/// SQ Logic and completer state of one QP.
#[derive(Debug)]
pub struct Requester {
    /// The WQEs in flight and the transmit point.
    window: SendWindow,
    /// RDMA Reads and Atomics started and not retired.
    rd_atomic: u32,
    credits: CreditState,
    /// Consuming messages fetched so far.
    consumers: u64,
    /// SSN of the last message fetched: a Bind or Local Invalidate is no message (the
    /// responder's MSN never counts it) and takes none.
    ssn: u32,
    /// Local operations (Bind, Local Invalidate) fetched so far.
    locals: u64,
    /// One past the window sequence of the last local operation fetched (0: none): the
    /// WQEs from here on are all messages, so an MSN names one by its distance from the
    /// newest.
    after_local: u64,
    /// A consuming WQE started without credit: nothing after it starts until credit comes.
    limited: Option<u64>,
    retry_left: u8,
    /// A response showed the responses from this PSN on lost and the requests were sent
    /// again from it: later responses to the first requests are stale, not new losses, until
    /// this PSN is acknowledged (they must not spend the Retry Count again).
    retrying: Option<Psn>,
    rnr_left: u8,
    /// Transport timer: armed while requests are unacknowledged.
    timer: Deadline,
    /// Its period on the driver's clock (`None`: disabled), fixed at RTS.
    ttr: Option<Duration>,
    /// A response made progress since the timer was armed (it is re-armed lazily, so the
    /// packet path never reads the clock).
    progressed: bool,
    /// RNR wait: no transmission until it expires.
    rnr_timer: Deadline,
    /// The transmit point's packet is ready but the link has no room for it (as the last
    /// transmission attempt found): see [`LinkWait`].
    link_wait: LinkWait,
    /// The link's peer mark (see [`Requester::after_transmit`]) when the transmit point last
    /// found no room.
    link_mark: u64,
    /// Credits announced while the QP was in RTR, applied on RTS.
    early_credits: Option<(CreditCode, u32)>,
    /// The BTH of its single-packet requests, made on RTR → RTS (`None` before).
    template: Option<BthTemplate>,
    /// The most request packets sent and not acknowledged before the transmit point
    /// waits for an Ack (`None`: as many as the window holds). Set for links where a loss
    /// is likely and each packet costs a datagram ([`Requester::set_max_in_flight`]).
    max_in_flight: Option<u32>,
}

/// What the transmit point holds, as [`Requester::next_step`] finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing may go now: no work, a gate is closed (state, fence, initiator depth,
    /// credits), or a limited Send waits for credit after its first packet.
    Stop,
    /// A memory window operation at WQE `seq`: executed by the driver if `new_wqe` (then
    /// [`Requester::run_local`]), passed over if a go-back-N rewind came back to it.
    Local {
        /// Its sequence number in the window.
        seq: u64,
        /// Whether it was not started before.
        new_wqe: bool,
    },
    /// Packet `point.pkt` of WQE `seq` goes next. If `new_wqe`, the driver calls
    /// [`Requester::begin_wqe`] once it knows the link has room for it.
    Packet {
        /// Its WQE's sequence number in the window.
        seq: u64,
        /// Whether this is the WQE's first packet, not sent before.
        new_wqe: bool,
        /// The transmit point (WQE, packet, payload cursor).
        point: TxPoint,
    },
}

/// What the Ack fast path ([`Requester::ack_fast`]) did with a positive Ack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckFast {
    /// A duplicate or unsolicited Ack: its credits were applied, nothing else.
    Credits,
    /// It completed the oldest WQEs, those before `end` (a sequence number), Sends and RDMA
    /// Writes only, and moved the acknowledged PSN: the driver retires them.
    Acked {
        /// The sequence number after the last WQE it completed.
        end: u64,
    },
}

/// What an expiry of a QP's timers means ([`Requester::handle_timeout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timeout {
    /// Nothing to do (no timer passed, or it passed with nothing waiting, or responses
    /// arrived meanwhile and a new period started).
    Nothing,
    /// The transport timer expired: the requests from this PSN on go again (one of the
    /// Retry Count spent; the transmit point moved back).
    Resend(Psn),
    /// The transport timer expired with no retry left: WQE `seq` (the oldest unfinished, if
    /// any) completes with `RetryExcErr` and the QP goes to the Error state. `link_full`:
    /// the request waited for room on the link the whole time, it never left.
    Exhausted {
        /// The WQE that fails.
        seq: Option<u64>,
        /// Whether it was waiting for room on the link.
        link_full: bool,
    },
}

impl Requester {
    /// A requester for a send queue of `depth` WQEs.
    pub fn new(depth: u32) -> Requester {
        Requester {
            window: SendWindow::new(depth),
            rd_atomic: 0,
            credits: CreditState::new(true),
            consumers: 0,
            ssn: 0,
            locals: 0,
            after_local: 0,
            limited: None,
            retry_left: 0,
            retrying: None,
            rnr_left: 0,
            timer: Deadline::default(),
            ttr: None,
            progressed: false,
            rnr_timer: Deadline::default(),
            link_wait: LinkWait::No,
            link_mark: 0,
            early_credits: None,
            template: None,
            max_in_flight: None,
        }
    }

    /// Programs the SQ Logic on RTR → RTS: start PSN, retry counts, credit mode.
    /// `resolution` is that of the driver's clock (the transport timer is raised to what
    /// it can tell apart, see [`crate::timer::transport_timeout`]).
    pub fn start(&mut self, cfg: &QpConfig, resolution: Duration) {
        self.window.start_at(cfg.sq_psn);
        self.retry_left = cfg.retry_cnt;
        self.rnr_left = cfg.rnr_retry;
        self.credits = CreditState::new(cfg.remote_credits);
        self.ttr = crate::timer::transport_timeout(cfg.timeout, resolution);
        // The destination and the path MTU are set on INIT → RTR and never change after.
        self.template = cfg.dest.map(|d| BthTemplate::new(d.qpn));
        if let Some((code, msn)) = self.early_credits.take() {
            self.update_credits(code, msn);
        }
    }

    /// Drops everything (QP reset).
    pub fn reset(&mut self) {
        let depth = self.window.capacity() as u32;
        *self = Requester::new(depth);
    }

    /// The send window (read only: it changes through the operations of the requester).
    #[inline(always)]
    pub fn window(&self) -> &SendWindow {
        &self.window
    }

    /// WQE `seq` of the window.
    #[inline]
    pub fn wqe(&self, seq: u64) -> &SendWqe {
        self.window.wqe(seq)
    }

    /// RDMA Reads and Atomics started and not retired.
    #[inline]
    pub fn rd_atomic(&self) -> u32 {
        self.rd_atomic
    }

    /// The WQE started without credit that holds the WQEs behind it, if one does.
    #[inline]
    pub fn limited(&self) -> Option<u64> {
        self.limited
    }

    /// The end-to-end credit state.
    #[inline]
    pub fn credits(&self) -> &CreditState {
        &self.credits
    }

    /// The transport timer's period, fixed at RTS (`None`: disabled).
    pub fn ttr(&self) -> Option<Duration> {
        self.ttr
    }

    /// The transport timer.
    #[inline]
    pub fn timer(&self) -> &Deadline {
        &self.timer
    }

    /// The RNR wait.
    #[inline]
    pub fn rnr_timer(&self) -> &Deadline {
        &self.rnr_timer
    }

    /// Whether the transmit point waits for room on the link.
    #[inline]
    pub fn link_wait(&self) -> LinkWait {
        self.link_wait
    }

    /// What the retry counters stand at: the PSN being resent from after a loss, retries
    /// left, RNR retries left.
    pub fn retry_state(&self) -> (Option<Psn>, u8, u8) {
        (self.retrying, self.retry_left, self.rnr_left)
    }

    /// Bytes of the window.
    pub fn memory_bytes(&self) -> usize {
        self.window.memory_bytes()
    }

    /// Whether the QP has something to send or an RNR wait to look at: the answer that
    /// costs two loads for the many QPs with nothing to do.
    #[inline(always)]
    pub fn wants_transmit(&self) -> bool {
        self.window.has_work() || self.rnr_timer.armed()
    }

    /// Keeps the credits a positive Ack announced while the QP was in RTR (spec/02
    /// "Providing Initial Credits"), for [`Requester::start`] to apply.
    pub fn keep_early_credits(&mut self, credits: CreditCode, msn: u32) {
        self.early_credits = Some((credits, msn));
    }

    /// The peer acknowledged everything up to `psn` (a response made progress): the retry
    /// counters are full again, and the transport timer stops when nothing is outstanding
    /// or runs on (re-armed lazily: the packet path reads no clock). Returns whether `psn`
    /// moved the acknowledged PSN.
    pub fn acknowledged(&mut self, psn: Psn, cfg: &QpConfig) -> bool {
        if !self.window.acknowledge(psn) {
            return false;
        }
        self.progressed_to(cfg);
        true
    }

    /// What [`Requester::acknowledged`] does once the acknowledged PSN moved.
    #[inline]
    fn progressed_to(&mut self, cfg: &QpConfig) {
        self.retry_left = cfg.retry_cnt;
        self.retrying = None;
        self.rnr_left = cfg.rnr_retry;
        if !self.window.outstanding() {
            self.timer.disarm();
        } else if self.timer.armed() {
            self.progressed = true;
        } else if let Some(t) = self.ttr {
            self.timer.arm_later(t);
        }
    }

    /// An RNR Nak for the request at `psn`: waits `wait` before sending from `psn` again
    /// (the transport timer stops meanwhile), spending one RNR retry unless the count means
    /// forever (`cfg.rnr_retry` 7). False, with nothing changed, when none is left.
    pub fn rnr_wait(&mut self, psn: Psn, wait: Duration, cfg: &QpConfig) -> bool {
        if self.rnr_left == 0 {
            return false;
        }
        if cfg.rnr_retry != RNR_RETRY_FOREVER {
            self.rnr_left -= 1;
        }
        self.window.rewind(psn);
        self.timer.disarm();
        self.rnr_timer.arm_later(wait);
        true
    }

    /// Sends again from `psn` (a PSN Sequence Error Nak, lost responses), spending one of
    /// the Retry Count. False, with nothing changed, when none is left.
    pub fn resend_from(&mut self, psn: Psn) -> bool {
        if self.retry_left == 0 {
            return false;
        }
        self.retry_left -= 1;
        self.window.rewind(psn);
        true
    }

    /// Whether the requests from `missing` on were already sent again for the loss a
    /// response shows: later responses to the first requests show the same loss.
    pub fn already_resending_from(&self, missing: Psn) -> bool {
        self.retrying == Some(missing)
    }

    /// Records that the requests from `missing` on were sent again for a loss.
    pub fn resending_from(&mut self, missing: Psn) {
        self.retrying = Some(missing);
    }

    /// Stops both timers (the QP went to the Error state: nothing is retried).
    pub fn stop_timers(&mut self) {
        self.timer.disarm();
        self.rnr_timer.disarm();
    }

    /// WQE `seq` is done with `status` (the completer's verdict, or a local error): it
    /// retires, in order, with that status.
    #[inline]
    pub fn complete(&mut self, seq: u64, status: WcStatus) {
        self.window.complete(seq, status);
    }

    /// A response for PSN `psn` implicitly acknowledges the requests before it (spec/01):
    /// completes (successfully) every Send and Write that ends before `psn`, in order, and
    /// stops with the first PSN whose response is missing if a Read or Atomic ends before
    /// it (`Err`: an implied Nak). The acknowledged PSN is the caller's to move
    /// ([`Requester::acknowledged`]).
    pub fn ack_before(&mut self, psn: Psn) -> Result<(), Psn> {
        let win = &mut self.window;
        for seq in win.retired()..win.started() {
            let w = win.wqe(seq);
            if w.done.is_some() {
                continue;
            }
            if !w.last_psn().before(psn) {
                break;
            }
            if w.wqe.op.is_rd_atomic() {
                return Err(w.missing_response());
            }
            win.complete(seq, WcStatus::Success);
        }
        Ok(())
    }

    /// The Ack fast path: a positive Ack of `psn` (credits `credits`, MSN `msn`) on a QP
    /// in RTS, decided without the completer's full checks where they cannot change the
    /// outcome. At or before the acknowledged PSN (a duplicate, or the responder's
    /// unsolicited credit update) only its credits count: [`AckFast::Credits`]. An Ack that
    /// acknowledges exactly the oldest WQEs of the window — Sends and RDMA Writes not done
    /// yet, the last of them ending at `psn`, no Read or Atomic among them — completes them,
    /// moves the acknowledged PSN (retry counts full again, the timer as
    /// [`Requester::acknowledged`] says) and applies the credits: [`AckFast::Acked`] (the
    /// driver then retires them). Anything else changes nothing and returns `None`: the
    /// completer's checks decide it ([`check_response`](crate::completer::check_response)).
    #[inline(always)]
    pub fn ack_fast(
        &mut self,
        psn: Psn,
        credits: CreditCode,
        msn: u32,
        cfg: &QpConfig,
    ) -> Option<AckFast> {
        let win = &self.window;
        if psn.diff(win.acked()) <= 0 {
            self.update_credits(credits, msn);
            return Some(AckFast::Credits);
        }
        // After it, it must be before the first PSN not sent.
        if psn.diff(win.sent_to()) >= 0 {
            return None;
        }
        // The WQEs it acknowledges, oldest first, each marked done as it is found (one
        // pass): one that refuses the Ack unmarks them again (none was done before).
        let (first, started) = (win.retired(), win.started());
        let mut end = first;
        let consumers = loop {
            let w = self.window.wqe(end);
            if end == started || w.done.is_some() || w.span == 0 || w.wqe.op.is_rd_atomic() {
                return self.ack_fast_refused(first, end);
            }
            let (last, consumers) = (w.last_psn(), w.consumers);
            self.window.complete(end, WcStatus::Success);
            end += 1;
            if last == psn {
                break consumers;
            }
            if !last.before(psn) {
                return self.ack_fast_refused(first, end); // inside a multi-packet message
            }
        };
        // acknowledged(), its check that `psn` moves the acknowledged PSN made above.
        let moved = self.window.acknowledge(psn);
        debug_assert!(moved);
        self.progressed_to(cfg);
        self.update_credits_named(credits, msn, end, consumers);
        Some(AckFast::Acked { end })
    }

    /// [`Requester::update_credits`] of a response that acknowledged WQE `seq` last, not a
    /// local operation (a Read's response, an Atomic's Acknowledge): when its MSN names
    /// that WQE, as it does when the responder has executed it and everything before, the
    /// WQE's consuming count is the base, without [`Requester::consumers_at`]'s search.
    #[inline(always)]
    pub fn update_credits_of(&mut self, code: CreditCode, msn: u32, seq: u64) {
        let consumers = self.window.wqe(seq).consumers;
        self.update_credits_named(code, msn, seq + 1, consumers);
    }

    /// The credits of an Ack whose last acknowledged WQE is `end - 1` (no local operation),
    /// whose consuming count is `consumers`: consumers_at's answer when the MSN names that
    /// WQE (no local operation after it either), else its search.
    #[inline(always)]
    fn update_credits_named(&mut self, code: CreditCode, msn: u32, end: u64, consumers: u64) {
        let fetched = self.window.fetched();
        if u64::from(self.ssn.wrapping_sub(msn) & Psn::MASK) == fetched - end
            && self.after_local <= end
        {
            self.credits.update(code, consumers);
            self.credits_changed();
        } else {
            self.update_credits(code, msn);
        }
    }

    /// [`Requester::ack_fast`] refusing an Ack after it marked WQEs `first..end` done: they
    /// are not done again, and the Ack is the completer's checks' to decide.
    #[cold]
    fn ack_fast_refused(&mut self, first: u64, end: u64) -> Option<AckFast> {
        for seq in first..end {
            self.window.wqe_undone(seq);
        }
        None
    }

    /// One more RDMA Read response of WQE `seq` arrived; returns how many it has now.
    #[inline]
    pub fn response_seen(&mut self, seq: u64) -> u32 {
        self.window.response_seen(seq)
    }

    /// The consuming count of the message whose SSN is `msn`, if still known.
    pub fn consumers_at(&self, msn: u32) -> Option<u64> {
        let fetched = self.window.fetched();
        if fetched == 0 {
            return Some(0);
        }
        let back = u64::from(self.ssn.wrapping_sub(msn) & Psn::MASK);
        let known = fetched.min(self.window.capacity() as u64);
        if back == fetched - self.locals {
            return Some(0); // the MSN before the first message
        }
        if back < known && self.after_local + back < fetched {
            // No local operation among the newest `back + 1` WQEs.
            return Some(self.wqe(fetched - 1 - back).consumers);
        }
        // Count messages back from the newest, past the local operations.
        let mut left = back;
        for seq in (fetched - known..fetched).rev() {
            let w = self.wqe(seq);
            if matches!(w.wqe.op, WqeOp::BindMw | WqeOp::LocalInv) {
                continue;
            }
            if left == 0 {
                return Some(w.consumers);
            }
            left -= 1;
        }
        None
    }

    /// Applies the credit count and MSN of a positive Ack (spec/02).
    #[inline]
    pub fn update_credits(&mut self, code: CreditCode, msn: u32) {
        if let Some(base) = self.consumers_at(msn) {
            self.credits.update(code, base);
        }
        self.credits_changed();
    }

    /// Lets the limited WQE go on if the credits now allow it.
    #[inline]
    fn credits_changed(&mut self) {
        if let Some(seq) = self.limited {
            if self.credits.allows(self.wqe(seq).consumers) {
                self.limited = None;
            }
        }
    }

    /// Whether the limited WQE `seq` (started without credit) may go on: credit arrived
    /// for it, or the responder accepted its first packet (a positive Ack of that PSN
    /// means a receive WQE was found for the message; spec/02 "SQ Logic's Behavior When No
    /// Credits Are Available") — for a Write with Immediate, which needs the receive WQE at
    /// its last packet, the whole message.
    fn limited_resolved(&self, seq: u64) -> bool {
        let w = self.wqe(seq);
        let accepted = match w.wqe.op {
            WqeOp::Send | WqeOp::SendImm | WqeOp::SendInv => w.first_psn,
            _ => w.last_psn(),
        };
        self.credits.allows(w.consumers) || !accepted.after(self.window.acked())
    }

    /// Retires the oldest WQE (done, or flushed) and does the SQ Logic's bookkeeping;
    /// returns it.
    pub fn retire_oldest(&mut self) -> SendWqe {
        let w = *self.window.wqe(self.window.retired());
        self.drop_oldest();
        w
    }

    /// [`Requester::retire_oldest`] without the WQE handed back (for a caller that read
    /// what it needs of it in place, as the engine's retire fast path does).
    #[inline]
    pub fn drop_oldest(&mut self) {
        let seq = self.window.retired();
        let was_started = seq < self.window.started();
        if was_started && self.window.wqe(seq).wqe.op.is_rd_atomic() {
            self.rd_atomic -= 1;
        }
        self.window.drop_oldest();
        if self.limited == Some(seq) {
            self.limited = None;
        }
    }

    /// [`Requester::drop_oldest`] for a caller that read the oldest WQE's operation, `op`,
    /// in place (the engine's retire fast path): not read again.
    #[inline]
    pub fn drop_oldest_op(&mut self, op: WqeOp) {
        let seq = self.window.retired();
        debug_assert!(seq == self.window.started() || self.window.wqe(seq).wqe.op == op);
        if seq < self.window.started() && op.is_rd_atomic() {
            self.rd_atomic -= 1;
        }
        self.window.drop_oldest();
        if self.limited == Some(seq) {
            self.limited = None;
        }
    }

    /// [`Requester::drop_oldest`] of every WQE before `to`, all of them ones the Ack fast
    /// path completed ([`AckFast::Acked`]: Sends and RDMA Writes, started), for the
    /// engine's retire loop: no Read or Atomic to count off, nothing read of the WQEs, the
    /// started count left as it is, the window moved once for all of them. Only up to the
    /// `end` that [`AckFast::Acked`] named (debug builds check).
    #[inline]
    pub fn drop_acked_to(&mut self, to: u64) {
        debug_assert!(
            (self.window.retired()..to).all(|s| !self.window.wqe(s).wqe.op.is_rd_atomic())
        );
        // (The limited WQE is one of the window's: at or after the oldest.)
        if self.limited.is_some_and(|l| l < to) {
            self.limited = None;
        }
        self.window.drop_started_to(to);
    }

    /// [`Requester::drop_oldest`] of the oldest WQE, a Read or an Atomic its one response
    /// has just completed (the completer's answer fast path): its initiator slot given
    /// back, the window moved past it once, nothing else read of it.
    #[inline]
    pub fn drop_answered(&mut self) {
        let seq = self.window.retired();
        debug_assert!(self.window.wqe(seq).wqe.op.is_rd_atomic());
        self.rd_atomic -= 1;
        self.window.drop_started_to(seq + 1);
        if self.limited == Some(seq) {
            self.limited = None;
        }
    }

    /// Whether the window has room for one more WQE from the send queue.
    #[inline]
    pub fn has_room(&self) -> bool {
        self.window.has_room()
    }

    /// Appends a WQE taken from the send queue to the window (there is room: an
    /// application never has more than its queue's depth outstanding); `pmtu` is the
    /// QP's path MTU in bytes.
    pub fn accept(&mut self, w: SqWqe, pmtu: u32) {
        if matches!(w.op, WqeOp::BindMw | WqeOp::LocalInv) {
            self.locals += 1;
            self.after_local = self.window.fetched() + 1;
        } else {
            self.ssn = (self.ssn + 1) & Psn::MASK;
        }
        if w.op.consumes_rq_wqe() {
            self.consumers += 1;
        }
        let span = match w.op {
            WqeOp::BindMw | WqeOp::LocalInv => 0,
            WqeOp::Read => psn::read_response_packets(w.len, pmtu),
            WqeOp::CompareSwap | WqeOp::FetchAdd => 1,
            _ => psn::packets_for(u64::from(w.len), pmtu),
        };
        self.window.push(SendWqe {
            wqe: w,
            consumers: self.consumers,
            first_psn: Psn::new(0),
            span,
            resp_seen: 0,
            done: None,
        });
    }

    /// The template path's gates for `w`, a single-packet request posted on a QP in
    /// `state` whose initiator depth is `max_rd_atomic`: RTS, idle (nothing queued or being
    /// resent, no RNR wait, no WQE waiting for credit), its fence, its credit, and for a
    /// Read or Atomic the initiator depth. Returns the header template and the consuming
    /// count `w` will have, or `None` if it must go the long way ([`Requester::accept`]).
    /// Changes nothing: the driver builds the packet, then calls
    /// [`Requester::fast_posted`].
    #[inline(always)]
    pub fn fast_gate(
        &self,
        state: QpState,
        w: &SqWqe,
        max_rd_atomic: u8,
    ) -> Option<(BthTemplate, u64)> {
        let template = self.template?;
        if state != QpState::Rts
            || self.window.has_work()
            || self.limited.is_some()
            || self.rnr_timer.armed()
            || (w.flags.has(WqeFlags::FENCE) && self.rd_atomic > 0)
        {
            return None;
        }
        if w.op.is_rd_atomic() {
            return (self.rd_atomic < u32::from(max_rd_atomic))
                .then_some((template, self.consumers));
        }
        let consumes = w.op.consumes_rq_wqe();
        let consumers = self.consumers + u64::from(consumes);
        if consumes && !self.credits.allows(consumers) {
            return None;
        }
        Some((template, consumers))
    }

    /// The packet [`Requester::fast_gate`] let through went out: the window records what
    /// go-back-N needs to send it again (the WQE, its PSN), and the transport timer runs.
    #[inline(always)]
    pub fn fast_posted(&mut self, w: &SqWqe, consumers: u64) {
        self.ssn = (self.ssn + 1) & Psn::MASK;
        self.consumers = consumers;
        self.window.push_sent(w, consumers);
        if w.op.is_rd_atomic() {
            self.rd_atomic += 1;
        }
        self.keep_timer_running();
    }

    /// What goes next from the transmit point of a QP in `state` whose initiator depth is
    /// `max_rd_atomic`: the gates of spec/02 "Obey the Ordering Rules" for a WQE not yet
    /// started, the wait of a limited Send after its first packet.
    #[inline]
    pub fn next_step(&mut self, state: QpState, max_rd_atomic: u8) -> Step {
        if !self.window.has_work() || self.at_cap() {
            return Step::Stop;
        }
        let point = self.window.tx();
        let seq = point.seq;
        // A WQE not yet started: it gets its PSNs when its first packet goes.
        let new_wqe = seq == self.window.started();
        if let Some(l) = self.limited {
            if self.limited_resolved(l) {
                self.limited = None;
            }
        }
        let w = self.wqe(seq);
        if new_wqe {
            if state != QpState::Rts || self.limited.is_some() {
                return Step::Stop;
            }
            if w.wqe.flags.has(WqeFlags::FENCE) && self.rd_atomic > 0 {
                return Step::Stop;
            }
            if w.wqe.op.is_rd_atomic() && self.rd_atomic >= u32::from(max_rd_atomic) {
                return Step::Stop;
            }
        } else if self.limited == Some(seq)
            && point.pkt >= 1
            && matches!(w.wqe.op, WqeOp::Send | WqeOp::SendImm | WqeOp::SendInv)
        {
            // A limited Send waits after its first packet until credit arrives.
            return Step::Stop;
        }
        if w.wqe.op.is_local() {
            return Step::Local { seq, new_wqe };
        }
        Step::Packet {
            seq,
            new_wqe,
            point,
        }
    }

    /// Caps the request packets in flight (sent, not yet acknowledged) at `cap` (at least
    /// 2; `None`: no cap): the transmit path waits for an Ack at the cap, so that a loss
    /// costs a go-back-N resend of at most `cap` packets rather than of the whole window,
    /// and one packet in every `cap / 2` asks for an Ack (AckReq), so that the responder
    /// answers before the cap is reached. Single-packet Sends and Writes posted on an idle
    /// QP (the template path) are bounded by the send queue's depth instead.
    ///
    /// ```
    /// use shmhca_proto::requester::Requester;
    ///
    /// let mut req = Requester::new(64);
    /// req.set_max_in_flight(Some(1));
    /// assert_eq!(req.max_in_flight(), Some(2), "at least 2");
    /// ```
    pub fn set_max_in_flight(&mut self, cap: Option<u32>) {
        self.max_in_flight = cap.map(|c| c.clamp(2, Psn::MASK / 2));
    }

    /// The cap of [`Requester::set_max_in_flight`].
    pub fn max_in_flight(&self) -> Option<u32> {
        self.max_in_flight
    }

    /// The PSN of the packet at the transmit point.
    fn tx_psn(&self) -> Psn {
        let p = self.window.tx();
        if p.seq == self.window.started() {
            self.window.npsn()
        } else {
            self.window.wqe(p.seq).first_psn.add(p.pkt)
        }
    }

    /// Whether the packets in flight reached the cap (see [`Requester::set_max_in_flight`]).
    #[inline]
    fn at_cap(&self) -> bool {
        self.max_in_flight.is_some_and(|cap| {
            let out = self.tx_psn().diff(self.window.acked().add(1));
            out >= 0 && out as u32 >= cap
        })
    }

    /// Starts the WQE at the transmit point (its first packet is about to go): it gets its
    /// PSNs, counts against the initiator depth if it is a Read or Atomic, and becomes the
    /// limited WQE if it needs credit that has not come.
    pub fn begin_wqe(&mut self) {
        let w = self.window.start_next();
        let (op, consumers, seq) = (w.wqe.op, w.consumers, self.window.started() - 1);
        if op.is_rd_atomic() {
            self.rd_atomic += 1;
        }
        if op.consumes_rq_wqe() && !self.credits.allows(consumers) {
            self.limited = Some(seq);
        }
    }

    /// Whether packet `k` of `w` (WQE `seq`) needs AckReq: the last packet of each message, every
    /// Read or Atomic request, and the first packet of a limited Send (spec/02: it waits for
    /// that packet's Ack).
    #[inline]
    pub fn ack_req(&self, seq: u64, w: &SendWqe, k: u32) -> bool {
        let limited_first = self.limited == Some(seq)
            && k == 0
            && matches!(w.wqe.op, WqeOp::Send | WqeOp::SendImm | WqeOp::SendInv);
        limited_first
            || w.wqe.op.is_rd_atomic()
            || k + 1 >= w.span
            || self
                .max_in_flight
                .is_some_and(|cap| (w.first_psn.add(k).get() + 1) % (cap / 2) == 0)
    }

    /// Packet `psn` of `w` is about to go: whether it is a retransmission (sent before).
    #[inline]
    pub fn note_sent(&mut self, w: &SendWqe, psn: Psn) -> bool {
        self.window.note_sent(w, psn)
    }

    /// A request packet went out: the transmit point moves to the next packet of its WQE,
    /// whose payload starts at `next`, or with `None` to the next WQE (after its last
    /// packet, or a Read or Atomic request, which covers its whole WQE: see
    /// [`Requester::ends_wqe`]).
    #[inline]
    pub fn packet_sent(&mut self, next: Option<Cursor>) {
        match next {
            Some(c) => self.window.next_packet(c),
            None => self.window.next_wqe(),
        }
    }

    /// Whether packet `k` of `w` is its last (or the request of a Read or Atomic): the
    /// transmit point then moves to the next WQE.
    #[inline]
    pub fn ends_wqe(w: &SendWqe, k: u32) -> bool {
        w.wqe.op.is_rd_atomic() || k + 1 >= w.span
    }

    /// Passes over the memory window operation at the transmit point ([`Step::Local`]):
    /// a new one is started and returned for the driver to execute (then
    /// [`Requester::complete`] with its status); one a go-back-N rewind came back to is
    /// only passed over (it is not executed twice).
    pub fn run_local(&mut self, new_wqe: bool) -> Option<SqWqe> {
        if !new_wqe {
            self.window.next_wqe();
            return None;
        }
        let w = self.window.start_next().wqe;
        self.window.next_wqe();
        Some(w)
    }

    /// A transmission attempt ended: `sent` whether any request packet went (the
    /// transport timer runs from then on, unless it runs already), `full` the link's peer
    /// mark if it stopped for lack of room on the link (see [`LinkWait`]).
    #[inline]
    pub fn after_transmit(&mut self, sent: bool, full: Option<u64>) {
        if sent {
            self.keep_timer_running();
        }
        match full {
            Some(mark) => self.wait_for_link(mark),
            None => {
                if self.link_wait != LinkWait::No {
                    self.link_wait = LinkWait::No;
                }
            }
        }
    }

    /// Starts the transport timer after a request packet went out, unless it runs already:
    /// it detects the cessation of responses, not each packet's (spec/01). It starts at
    /// the driver's next look at the clock ([`Requester::start_timers`]).
    #[inline(always)]
    fn keep_timer_running(&mut self) {
        if !self.timer.armed() {
            if let Some(t) = self.ttr {
                self.timer.arm_later(t);
            }
        }
    }

    /// The transmit point found no room on the link: the transport timer runs for the
    /// request waiting there as for one sent (spec/01: "Ttr begins after a request packet
    /// is scheduled for transmission"), so a peer that stops reading its link cannot hold
    /// a QP in RTS forever, not even one whose first packet never left. The wait's start is
    /// reckoned at the timer's first expiry during it, one period back (the packet path
    /// reads no clock).
    ///
    /// A link the peer still reads, only more slowly than its QPs write (other QPs fill
    /// each burst first), is busy, not stopped: with nothing unacknowledged, the peer
    /// freeing room since the last look (`mark`, a count of what the peer read that only
    /// grows) counts as progress, as a response would, and the timer's period starts again
    /// at its expiry.
    #[cold]
    #[inline(never)]
    fn wait_for_link(&mut self, mark: u64) {
        if self.link_wait == LinkWait::No {
            self.link_wait = LinkWait::Waiting;
        } else if mark != self.link_mark && !self.window.outstanding() {
            self.progressed = true;
        }
        self.link_mark = mark;
        self.keep_timer_running();
    }

    /// Starts the timers armed to start later (on the packet path, which reads no clock).
    pub fn start_timers<T: Timers + ?Sized>(&mut self, t: &mut T) {
        t.start(&mut self.timer);
        t.start(&mut self.rnr_timer);
    }

    /// Whether an RNR wait stands in the way of transmitting now; one that has passed is
    /// cleared.
    #[inline]
    pub fn rnr_waiting<T: Timers + ?Sized>(&mut self, t: &mut T) -> bool {
        if self.rnr_timer.armed() {
            if !t.expired(&self.rnr_timer) {
                return true;
            }
            self.rnr_timer.disarm();
        }
        false
    }

    /// Runs the QP's timers at the time `t` gives (started first: see
    /// [`Requester::start_timers`]): the end of an RNR wait, and the transport timer (spec/01
    /// "On Timeout, Request Packet Is Resent"), unless `responses_waiting` (the driver has
    /// received packets for the QP it has not handled yet: the response that would stop
    /// the timer may be among them).
    ///
    /// The transport timer runs while requests are unacknowledged, and also while a request
    /// waits for room on the link ([`LinkWait`]): an expiry with nothing unacknowledged but a
    /// request waiting for room is a timeout as well. It spends one of the Retry Count and
    /// sends nothing again (nothing left); the waiting request goes when the link has room.
    /// The driver counts a [`Timeout::Resend`] or [`Timeout::Exhausted`] as a timeout.
    pub fn handle_timeout<T: Timers + ?Sized>(
        &mut self,
        t: &mut T,
        responses_waiting: bool,
    ) -> Timeout {
        self.start_timers(t);
        if t.expired(&self.rnr_timer) {
            self.rnr_timer.disarm();
        }
        if responses_waiting || !t.expired(&self.timer) {
            // (Responses waiting: the timer detects responses that stopped *arriving*, so
            // it is looked at again once they are handled.)
            return Timeout::Nothing;
        }
        self.timer.disarm();
        let link_wait = self.link_wait != LinkWait::No;
        if !(self.window.outstanding() || link_wait) || self.rnr_timer.armed() {
            return Timeout::Nothing;
        }
        if self.progressed {
            // Responses arrived since the timer was armed: it only detects the *cessation*
            // of responses (spec/01), so start a new period. A timeout is then detected
            // between Ttr and 2 Ttr after the last response, within the spec's
            // [Ttr, 4 Ttr].
            self.progressed = false;
            if let Some(p) = self.ttr {
                self.timer.arm_later(p);
            }
            return Timeout::Nothing;
        }
        if self.link_wait == LinkWait::Waiting {
            // The first period of the wait has passed (looked at here, on the expiry only,
            // so that the timer's checks pay nothing for it).
            let ttr = self.ttr.map_or(0, |p| p.as_nanos() as u64);
            let start = t.now().as_nanos().saturating_sub(ttr);
            self.link_wait = LinkWait::Since(Timestamp::from_nanos(start));
        }
        if self.retry_left == 0 {
            return Timeout::Exhausted {
                seq: self.oldest_unfinished(),
                link_full: link_wait,
            };
        }
        self.retry_left -= 1;
        let from = self.window.acked().add(1);
        self.window.rewind(from);
        if let Some(p) = self.ttr {
            self.timer.arm_later(p);
        }
        Timeout::Resend(from)
    }

    /// The oldest unacknowledged request's WQE, or with none, the oldest waiting to be
    /// sent.
    pub fn oldest_unfinished(&self) -> Option<u64> {
        let win = &self.window;
        win.find(win.acked().add(1)).or_else(|| {
            let seq = win.tx().seq;
            (seq < win.fetched()).then_some(seq)
        })
    }

    /// The header template of the QP's single-packet requests (`None` before RTS).
    #[inline]
    pub fn template(&self) -> Option<BthTemplate> {
        self.template
    }
}

/// Whether a QP's transmit point waits for room on its link, and since when.
///
/// A link is full when the peer reads it more slowly than this side writes, or not at all:
/// a peer that stopped consuming (its process alive, the link up) leaves it full for good.
/// A request waiting for room counts against the transport timer as one sent does: each
/// expiry while it waits spends one of the Retry Count (it is not sent again: it never
/// left), and when none is left the WQE completes with RetryExcErr and the rest are
/// flushed ([`Timeout::Exhausted`] with `link_full`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LinkWait {
    /// The last transmission attempt did not stop for lack of room.
    #[default]
    No,
    /// It did; the timer has not expired since.
    Waiting,
    /// It did, since about this time: one transport timer period before its first expiry
    /// during the wait (the period the wait started, if it armed the timer; earlier by
    /// less than a period if the timer ran already).
    Since(Timestamp),
}

/// The BTH of a QP's single-packet requests with what stays fixed from RTS on filled in
/// (P_Key, DestQP; M and TVer zero): the template path patches the opcode, SE, PadCnt,
/// AckReq and PSN.
///
/// Kept as the little-endian word of the header's first 8 bytes with the opcode and flags
/// byte zero, so that a write is two stores (that word with both patched in, then AckReq
/// and the PSN) rather than a read-modify-write per field.
#[derive(Debug, Clone, Copy)]
pub struct BthTemplate(u64);

impl BthTemplate {
    /// The template of requests to QP `dest`.
    pub fn new(dest: Qpn) -> BthTemplate {
        let mut b = [0u8; bth::HEADER_LEN];
        BthRepr {
            pkey: DEFAULT_PKEY,
            ..BthRepr::new(Opcode::SendOnly, dest, Psn::new(0))
        }
        .emit(&mut bth::Packet::new_unchecked(&mut b[..]));
        b[0] = 0;
        b[1] = 0;
        BthTemplate(u64::from_le_bytes([
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
        ]))
    }

    /// Writes the BTH of a request with AckReq set into `out` (at least
    /// [`bth::HEADER_LEN`] bytes). (The flags byte is SE, M, PadCnt and TVer from the high
    /// bit down, M and TVer zero; AckReq is the high bit of byte 8, the PSN bytes 9..12.)
    #[inline]
    pub fn write(&self, out: &mut [u8], opcode: Opcode, solicited: bool, pad: u8, psn: Psn) {
        let flags = (u8::from(solicited) << 7) | ((pad & 3) << 4);
        let head = self.0 | u64::from(opcode.code()) | (u64::from(flags) << 8);
        let tail = (0x8000_0000 | psn.get()).to_be_bytes();
        let out = &mut out[..bth::HEADER_LEN];
        out[..8].copy_from_slice(&head.to_le_bytes());
        out[8..].copy_from_slice(&tail);
    }
}

/// The nPSN after sending the request packet with PSN `cpsn` and opcode `opcode` (spec 01,
/// "Some Definitions"): `cpsn + read_response_packets(read_len, pmtu)` for an RDMA Read
/// request, `cpsn + 1` for any other packet. `read_len` (the RETH DMA length) and `pmtu`
/// are only looked at for an RDMA Read request.
///
/// ```
/// use shmhca_proto::psn::Psn;
/// use shmhca_proto::requester::next_psn;
/// use shmhca_proto::wire::opcode::Opcode;
/// // spec 01: a Read at PSN 267 that returns 6 responses moves nPSN to 273.
/// assert_eq!(next_psn(Psn::new(267), Opcode::RdmaReadRequest, 6 * 1024, 1024), Psn::new(273));
/// assert_eq!(next_psn(Psn::new(273), Opcode::SendOnly, 0, 1024), Psn::new(274));
/// ```
#[inline]
pub fn next_psn(cpsn: Psn, opcode: Opcode, read_len: u32, pmtu: u32) -> Psn {
    match opcode {
        Opcode::RdmaReadRequest => cpsn.add(psn::read_response_packets(read_len, pmtu)),
        _ => cpsn.add(1),
    }
}

#[cfg(test)]
mod tests;
