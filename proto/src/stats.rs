//! The protocol's counters: what the SQ Logic, the RQ Logic and the completer count as they
//! work (packets, Acks and Naks by kind, retransmissions, timeouts, drops).

/// Counters of an engine's protocol work (shmhca's `Context::stats` returns a snapshot;
/// `shmhca stat` shows every running engine's, per QP too).
///
/// They show what costs time without failing anything. A Send that arrives before its
/// receive is posted is refused with an RNR Nak, and its sender waits the receiver's
/// `min_rnr_timer` before it sends it again: nothing fails, the message is only late, and
/// `rnr_naks_sent` here (`rnr_naks_received` at the sender) is where it shows (shmhca's
/// `Stats` shows it happen between two QPs).
///
/// ```
/// use shmhca_proto::stats::Stats;
/// use shmhca_proto::wire::{NakCode, RnrTimer, Syndrome};
///
/// let mut stats = Stats::default();
/// stats.nak_sent(Syndrome::RnrNak { timer: RnrTimer::new(14) });
/// stats.nak_sent(Syndrome::Nak(NakCode::PsnSequenceError));
/// assert_eq!((stats.naks_sent, stats.rnr_naks_sent, stats.seq_err_naks_sent), (2, 1, 1));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Packets pushed to links.
    pub packets_sent: u64,
    /// Packets taken from links.
    pub packets_received: u64,
    /// Payload bytes copied into this process's memory from packets (receive-side "DMA":
    /// Sends, RDMA Writes, RDMA Read responses).
    pub payload_bytes_copied: u64,
    /// Payload bytes copied into packet slots because they were small enough to travel
    /// inline (sender side).
    pub inline_bytes_sent: u64,
    /// Positive Acks sent.
    pub acks_sent: u64,
    /// Naks and RNR Naks sent (all kinds; the next five fields split them).
    pub naks_sent: u64,
    /// RNR Naks sent (a Send or Write with Immediate found no receive WQE).
    pub rnr_naks_sent: u64,
    /// PSN Sequence Error Naks sent.
    pub seq_err_naks_sent: u64,
    /// Invalid Request Naks sent.
    pub inv_req_naks_sent: u64,
    /// Remote Access Error Naks sent.
    pub rem_access_naks_sent: u64,
    /// Remote Operational Error Naks sent.
    pub rem_op_naks_sent: u64,
    /// Naks received (not RNR Naks: see `rnr_naks_received`).
    pub naks_received: u64,
    /// Work requests completed with a flush error (their QP was in the Error state).
    pub flushed: u64,
    /// Request packets sent again (go-back-N after a Nak, an RNR Nak or a timeout).
    pub retransmitted: u64,
    /// Transport timer expiries.
    pub timeouts: u64,
    /// RNR Naks received.
    pub rnr_naks_received: u64,
    /// Packets dropped: malformed, for an unknown QP, duplicate or out of window.
    pub dropped: u64,
    /// Times the poll-mode engine thread went to sleep (idle policy `Backoff`).
    pub sleeps: u64,
    /// Of `acks_sent`, Acks that rode in the line of a request to the same QP instead of
    /// taking a line of their own (not counted in `packets_sent`).
    pub acks_riding: u64,
    /// RoCEv2 datagrams handed to the kernel by the context's UDP ports (0 without one;
    /// the per-port figures: shmhca's `UdpPort::counters`).
    pub datagrams_sent: u64,
    /// RoCEv2 datagrams received by the UDP ports (good or bad).
    pub datagrams_received: u64,
    /// Received datagrams dropped because their ICRC did not check.
    pub icrc_dropped: u64,
    /// Received datagrams dropped as malformed (too short for their headers, pad or ICRC,
    /// an opcode not implemented, a payload over 4096 bytes, truncated).
    pub malformed_dropped: u64,
    /// Congestion Notification Packets received (counted, not acted on).
    pub cnps_received: u64,
    /// Valid RoCEv2 transport packets received marked Congestion Experienced (IP ECN bits
    /// `0b11`).
    pub ce_marked_received: u64,
    /// Congestion Notification Packets sent to the senders of CE-marked packets (at most
    /// one per QP per interval).
    pub cnps_sent: u64,
    /// Received datagrams dropped because no link of their port has their source address.
    pub unknown_source_dropped: u64,
    /// Datagrams the kernel refused for good (e.g. over the path MTU).
    pub send_dropped: u64,
    /// Packets that could not be written as a datagram (a payload outside the sending
    /// QP's memory, a destination QP never registered with the port).
    pub encode_dropped: u64,
}

impl Stats {
    /// Counts a Nak or RNR Nak sent with `syndrome`: in `naks_sent` and in its kind's field.
    pub fn nak_sent(&mut self, syndrome: crate::wire::aeth::Syndrome) {
        use crate::wire::aeth::{NakCode, Syndrome};
        self.naks_sent += 1;
        match syndrome {
            Syndrome::RnrNak { .. } => self.rnr_naks_sent += 1,
            Syndrome::Nak(NakCode::PsnSequenceError) => self.seq_err_naks_sent += 1,
            Syndrome::Nak(NakCode::InvalidRequest) => self.inv_req_naks_sent += 1,
            Syndrome::Nak(NakCode::RemoteAccessError) => self.rem_access_naks_sent += 1,
            Syndrome::Nak(NakCode::RemoteOperationalError) => self.rem_op_naks_sent += 1,
            _ => {}
        }
    }
}
