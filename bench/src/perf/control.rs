//! The control channel: a QP of its own between the two sides, carrying small inline Sends
//! for the barriers around each measurement and the end-of-run status. Everything stays
//! in-band (no socket traffic during a run), and waiting on it drives this side's engine,
//! which serves the peer's RDMA Reads, Writes and Atomics meanwhile.

use shmhca::{Cq, Mr, QpState, RecvWr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion};

use crate::perf::error::PerfError;
use crate::perf::setup::DataQp;

/// Receive slots kept posted.
pub const SLOTS: u32 = 8;
/// Bytes of one slot.
pub const SLOT_LEN: u64 = 64;
/// Bytes of one message.
const MSG_LEN: usize = 16;
/// A barrier message.
const KIND_BARRIER: u32 = 0xBA44_1E40;
/// An abort message: the sender stopped with an error, whose text (UTF-8, up to
/// [`ABORT_TEXT_MAX`] bytes) follows the kind.
const KIND_ABORT: u32 = 0xAB0E_7E11;
/// Bytes of text an abort message carries at most (a slot less the kind).
pub const ABORT_TEXT_MAX: usize = SLOT_LEN as usize - 4;

/// One side's end of the control channel.
pub struct Control {
    qp: DataQp,
    cq: Cq,
    mr: Mr,
    wcs: [WorkCompletion; 16],
    /// Messages received and not yet consumed (the peer can be one barrier ahead).
    inbox: std::collections::VecDeque<(u32, u64)>,
    /// The text of the peer's abort message, once one came.
    peer_failed: Option<String>,
}

impl std::fmt::Debug for Control {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Control")
            .field("qp", &self.qp.qpn())
            .finish_non_exhaustive()
    }
}

impl Control {
    /// Wraps a connected (or about to be connected) QP, its CQ and its slot memory
    /// (`SLOTS * SLOT_LEN` bytes with local write access).
    pub fn new(qp: DataQp, cq: Cq, mr: Mr) -> Control {
        Control {
            qp,
            cq,
            mr,
            wcs: [WorkCompletion::default(); 16],
            inbox: std::collections::VecDeque::with_capacity(SLOTS as usize),
            peer_failed: None,
        }
    }

    /// Posts the receive slots (once, in Init or later).
    ///
    /// # Errors
    /// The engine refuses the receives.
    pub fn post_slots(&mut self) -> Result<(), PerfError> {
        for slot in 0..SLOTS {
            self.post_slot(u64::from(slot))?;
        }
        Ok(())
    }

    fn post_slot(&mut self, slot: u64) -> Result<(), PerfError> {
        let sge = self
            .mr
            .sge(slot * SLOT_LEN, SLOT_LEN as u32)
            .map_err(PerfError::engine("control receive buffer"))?;
        self.qp
            .post_recv(&RecvWr::new(slot, &[sge]))
            .map_err(PerfError::engine("posting a control receive"))
    }

    /// The control QP.
    pub fn qp(&self) -> &DataQp {
        &self.qp
    }

    /// The control QP, mutably (to bring it to RTS by hand).
    pub fn qp_mut(&mut self) -> &mut DataQp {
        &mut self.qp
    }

    /// Sends `(tag, value)` to the peer.
    ///
    /// # Errors
    /// The engine refuses the send, or a completion reports an error.
    pub fn send(&mut self, tag: u32, value: u64) -> Result<(), PerfError> {
        let mut b = [0u8; MSG_LEN];
        b[0..4].copy_from_slice(&KIND_BARRIER.to_le_bytes());
        b[4..8].copy_from_slice(&tag.to_le_bytes());
        b[8..16].copy_from_slice(&value.to_le_bytes());
        loop {
            match self.qp.post_send(&SendWr::inline(0, SendOp::Send, &b)) {
                Ok(()) => return Ok(()),
                Err(shmhca::Error::QueueFull { .. }) => {
                    self.drain()?;
                }
                Err(e) => return Err(PerfError::engine("sending a control message")(e)),
            }
        }
    }

    /// Polls the control CQ once (driving the engine in inline mode), queueing received
    /// messages in the inbox.
    fn drain(&mut self) -> Result<(), PerfError> {
        let n = self.cq.poll(&mut self.wcs);
        for i in 0..n {
            let wc = self.wcs[i];
            if wc.status != WcStatus::Success {
                return Err(if wc.status == WcStatus::WrFlushErr {
                    PerfError::PeerGone(
                        "the control QP was flushed (the peer process exited or its connection closed)"
                            .into(),
                    )
                } else {
                    PerfError::Completion {
                        what: "a control message",
                        status: wc.status,
                    }
                });
            }
            if wc.opcode != WcOpcode::Recv {
                continue;
            }
            if wc.wr_id >= u64::from(SLOTS) || u64::from(wc.byte_len) > SLOT_LEN {
                return Err(PerfError::NotPerf(format!(
                    "the peer sent a control message of {} bytes into slot {}; it is not shmhca-perf of this version",
                    wc.byte_len, wc.wr_id
                )));
            }
            let mut whole = [0u8; SLOT_LEN as usize];
            let got = &mut whole[..wc.byte_len as usize];
            self.mr
                .read_at(wc.wr_id * SLOT_LEN, got)
                .map_err(PerfError::engine("reading a control message"))?;
            self.post_slot(wc.wr_id)?;
            if got.len() >= 4 && u32::from_le_bytes([got[0], got[1], got[2], got[3]]) == KIND_ABORT
            {
                // Reported once the messages polled with it are queued (the peer's last
                // barrier can come with it), and on every later poll.
                self.peer_failed = Some(abort_text(&got[4..]));
                continue;
            }
            let mut b = [0u8; MSG_LEN];
            let n = got.len().min(MSG_LEN);
            b[..n].copy_from_slice(&got[..n]);
            let kind = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            if wc.byte_len as usize != MSG_LEN || kind != KIND_BARRIER {
                return Err(PerfError::NotPerf(format!(
                    "the peer sent a control message of {} bytes with kind {kind:#x}; it is not shmhca-perf of this version",
                    wc.byte_len
                )));
            }
            let tag = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let mut v = [0u8; 8];
            v.copy_from_slice(&b[8..16]);
            if self.inbox.len() >= SLOTS as usize {
                return Err(PerfError::NotPerf(format!(
                    "the peer sent control message {tag} out of turn"
                )));
            }
            self.inbox.push_back((tag, u64::from_le_bytes(v)));
        }
        match &self.peer_failed {
            Some(text) => Err(PerfError::PeerFailed(text.clone())),
            None => Ok(()),
        }
    }

    /// A barrier: sends `(tag, value)` and waits for the peer's message with the same tag;
    /// returns the peer's value. While waiting it drives this side's engine and calls
    /// `idle` (e.g. to serve a data CQ).
    ///
    /// # Errors
    /// [`PerfError::PeerGone`] when the control QP is flushed or leaves RTS (the peer
    /// died), [`PerfError::NotPerf`] for a message of another tag or format.
    pub fn barrier(
        &mut self,
        tag: u32,
        value: u64,
        idle: impl FnMut() -> Result<(), PerfError>,
    ) -> Result<u64, PerfError> {
        self.send(tag, value)?;
        self.wait(tag, idle)
    }

    /// Tells the peer that this side stops with `reason` (its error, cut to
    /// [`ABORT_TEXT_MAX`] bytes), so that a peer waiting on this side ends at once, naming
    /// the cause, instead of waiting out its idle timeout. Best effort: a control QP that
    /// is gone already takes nothing; waits at most `settle` for the peer's Ack.
    pub fn abort(&mut self, reason: &str, settle: std::time::Duration) {
        let mut cut = reason.len().min(ABORT_TEXT_MAX);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        let mut b = [0u8; SLOT_LEN as usize];
        b[0..4].copy_from_slice(&KIND_ABORT.to_le_bytes());
        b[4..4 + cut].copy_from_slice(&reason.as_bytes()[..cut]);
        let wr = SendWr::inline(0, SendOp::Send, &b[..4 + cut]);
        if self.qp.post_send(&wr).is_ok() {
            self.settle(settle);
        }
    }

    /// After this side's data QPs failed in a way that only says "the peer went away"
    /// (flushed, out of RTS), looks for the peer's abort message for at most `within`: a
    /// peer whose request this side's responder refused learns why (its completion's
    /// status) and says so. Returns its text; `None` if the peer said nothing (it died, or
    /// is not this version) or the control QP failed too.
    pub fn peer_abort(&mut self, within: std::time::Duration) -> Option<String> {
        let start = std::time::Instant::now();
        let mut turns = 0u32;
        while start.elapsed() < within {
            match self.drain() {
                Err(PerfError::PeerFailed(text)) => return Some(text),
                Err(_) => return None,
                Ok(()) => {}
            }
            turns = turns.wrapping_add(1);
            if turns % 1024 == 0 {
                if self.qp.state() != QpState::Rts {
                    return None;
                }
                std::thread::yield_now();
            }
        }
        None
    }

    /// Drives the engine until every control send has completed (the peer acknowledged
    /// it), the QP fails, or `timeout` passes; used for the last message, so that closing
    /// the connection cannot overtake it. Errors do not matter any more at that point.
    pub fn settle(&mut self, timeout: std::time::Duration) {
        let start = std::time::Instant::now();
        while self.qp.sq_outstanding() > 0 && start.elapsed() < timeout {
            if self.drain().is_err() {
                return;
            }
        }
    }

    /// Waits for the peer's message with tag `tag` and returns its value, driving this
    /// side's engine (and calling `idle`) meanwhile.
    ///
    /// # Errors
    /// As [`Control::barrier`].
    pub fn wait(
        &mut self,
        tag: u32,
        mut idle: impl FnMut() -> Result<(), PerfError>,
    ) -> Result<u64, PerfError> {
        let mut spins = 0u32;
        loop {
            if self.inbox.is_empty()
                && let Err(e) = self.drain()
                && self.inbox.is_empty()
            {
                return Err(e);
            }
            // (A message queued in the same poll as a failure is the peer's all the same: its
            // goodbye can arrive together with the flush of the connection it then closed.
            // The failure shows again below, as the QP's state.)
            if let Some((t, v)) = self.inbox.pop_front() {
                if t != tag {
                    return Err(PerfError::NotPerf(format!(
                        "the peer is at step {t} while this side is at step {tag}; both sides must run the same sizes"
                    )));
                }
                return Ok(v);
            }
            idle()?;
            spins = spins.wrapping_add(1);
            if spins % 4096 == 0 {
                let state = self.qp.state();
                if state != QpState::Rts {
                    return Err(PerfError::PeerGone(format!(
                        "the control QP is in the {state:?} state"
                    )));
                }
            }
        }
    }
}

/// The text of a peer's abort message, as this side prints it: the peer's bytes are not
/// trusted, so invalid UTF-8 and control characters (a terminal's escape sequences among
/// them) become `?`.
pub fn abort_text(bytes: &[u8]) -> String {
    let text: String = String::from_utf8_lossy(&bytes[..bytes.len().min(ABORT_TEXT_MAX)])
        .chars()
        .map(|c| {
            if c.is_control() || c == char::REPLACEMENT_CHARACTER {
                '?'
            } else {
                c
            }
        })
        .collect();
    if text.is_empty() {
        "(no reason given)".into()
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::perf::opts::Options;
    use crate::perf::setup::in_process_pair;
    use shmhca::QpAttr;

    /// The goodbye race: the peer's last message arrives, then the peer closes and this
    /// side's QP is flushed, all before this side polls — one poll sees the message and the
    /// flush. The message is the peer's all the same (a server that lost it exited with an
    /// error after a good run).
    #[test]
    fn a_message_polled_together_with_the_flush_is_still_delivered() {
        let opts = Options::parse_from(["shmhca-perf", "send_lat", "-n", "10"]).unwrap();
        let (mut a, mut b) = in_process_pair(&opts, (None, None)).unwrap();
        a.ctl.send(7, 42).unwrap();
        a.ctl.settle(std::time::Duration::from_secs(5));
        assert_eq!(
            a.ctl.qp.sq_outstanding(),
            0,
            "the message was not acknowledged"
        );
        b.ctl
            .qp
            .modify(&QpAttr::new(QpState::Error))
            .expect("moving the QP to Error");
        assert_eq!(b.ctl.wait(7, || Ok(())).unwrap(), 42);
        // Afterwards the flush is reported.
        assert!(matches!(
            b.ctl.wait(8, || Ok(())),
            Err(PerfError::PeerGone(_))
        ));
    }
}
