//! The riding Ack attacked: a peer that completed the handshake honestly and now writes
//! what it likes into the link ring, and the edge cases of the owed-Ack bookkeeping around
//! the riding Ack (held Acks, links going down, QPs modified or destroyed, the fault stage,
//! the counters).
//!
//! The receiving side's rule: a riding Ack is handled exactly as a standalone Ack that
//! followed its carrier would be, whatever became of the carrier (accepted, duplicate,
//! out of sequence, refused for want of a receive WQE, fatal, for another QP). Most tests
//! here run the same exchange twice — once with the Ack riding, once with the carrier and
//! a standalone Ack line — and compare what the application and the peer see. The sending
//! side's rule: every Ack owed leaves exactly once (riding or alone), however the owed
//! list was walked, and the counters say what went on the wire.
//!
//! Every context is inline with manual progress: nothing runs between a test's steps.

use crate::fault::FaultAction;
use crate::mem::Mem;
use crate::raw_peer::{
    RawEnds, ack_line_to, connect_to_raw_peer, inline_context, raw_peer_link, raw_peer_to_rtr,
};
use crate::wire::aeth::{CreditCode, Syndrome};
use crate::wire::opcode::Opcode;
use crate::wire::slot::{
    ACK_FLAG, ICRC_FLAG, KIND_GATHER, KIND_INLINE, KIND_NONE, PacketSlot, RxPacket, frame_lines,
    riding_word, set_gather_entry,
};
use crate::wire::{BthRepr, PacketRepr, RethRepr};
use crate::{
    AccessFlags, Context, Cq, LinkId, Mr, Pd, Qp, QpAttr, QpCaps, QpState, Qpn, RecvWr, RemoteAddr,
    SendOp, SendWr, Stats, WcOpcode, WcStatus,
};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// The raw peer's QP (and a second one on the same link).
const PEER: u32 = 0x2002;
const PEER2: u32 = 0x2003;
/// The first PSN the rig's QP sends.
const SQ_PSN: u32 = 500;
/// Lines of each ring of the link.
const RING: usize = 64;

/// How a rig is set up.
#[derive(Clone, Copy)]
struct Setup {
    /// Owed Acks held back an iteration (as in poll mode or with the progress helper).
    hold: bool,
    /// The QP's requester obeys end-to-end credits.
    credits: bool,
    /// Receives posted.
    recvs: u64,
    /// The first PSN the QP sends.
    sq_psn: u32,
    /// Taken to RTS (else left in RTR).
    rts: bool,
}

impl Default for Setup {
    fn default() -> Setup {
        Setup {
            hold: false,
            credits: false,
            recvs: 8,
            sq_psn: SQ_PSN,
            rts: true,
        }
    }
}

struct Rig {
    ctx: Context,
    pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
    ends: RawEnds,
    link: LinkId,
    /// The peer's arena (gather payloads are read from it).
    peer_mem: Mem,
    /// Completions polled and not yet looked at.
    polled: Vec<(Qpn, WcOpcode, u64, WcStatus)>,
}

/// The QP caps of every QP here.
fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 128,
        max_recv_wr: 16,
        max_send_sge: 4,
        max_recv_sge: 1,
        max_inline_data: 64,
    }
}

impl Rig {
    fn new(ctx: Context, s: Setup) -> Rig {
        ctx.shared.engine.with(|e| e.hold_acks = s.hold);
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(512).unwrap();
        let mut qp = ctx.create_qp(&pd, &cq, &cq, caps()).unwrap();
        let (link, ends, peer_mem) = raw_peer_link(&ctx, RING, PEER, 4096);
        if s.rts {
            connect_to_raw_peer(&mut qp, link, PEER, s.sq_psn, s.credits);
        } else {
            raw_peer_to_rtr(&mut qp, link, PEER, s.credits);
        }
        let mr = pd.alloc_mr(8192, AccessFlags::ALL).unwrap();
        for i in 0..s.recvs {
            qp.post_recv(&RecvWr::new(100 + i, &[mr.sge(i * 64, 64).unwrap()]))
                .unwrap();
        }
        let mut rig = Rig {
            ctx,
            pd,
            cq,
            qp,
            mr,
            ends,
            link,
            peer_mem,
            polled: vec![],
        };
        // The receives just posted may bring a credit update: out of the way.
        rig.settle();
        rig.frames();
        rig
    }

    /// A few iterations: enough for anything the engine does one or two iterations late
    /// (a held Ack, work kept for the next iteration) to be done.
    fn settle(&mut self) {
        for _ in 0..4 {
            self.ctx.progress();
        }
    }

    /// Posts a signaled Send of `len` bytes from offset 4096 of the region: 8 bytes travel
    /// inline, 100 by reference.
    fn send(&mut self, id: u64, len: u32) {
        post(&mut self.qp, &self.mr, id, len);
    }

    /// Posts an RDMA Read of 8 bytes of the peer into offset 2048 of the region.
    fn read(&mut self, id: u64) {
        let sge = [self.mr.sge(2048, 8).unwrap()];
        let remote = RemoteAddr {
            addr: 0x1000,
            rkey: 7,
        };
        self.qp
            .post_send(&SendWr::new(id, SendOp::RdmaRead(remote), &sge))
            .unwrap();
    }

    /// The frames the engine published since the last call, each as its lines.
    fn frames(&mut self) -> Vec<Vec<PacketSlot>> {
        let mut out = vec![PacketSlot::default(); 4 * RING];
        let mut lines = vec![];
        loop {
            let n = self.ends.rx.pop_burst(&mut out).unwrap();
            if n == 0 {
                break;
            }
            lines.extend_from_slice(&out[..n]);
        }
        let mut frames = vec![];
        let mut at = 0;
        while at < lines.len() {
            let end = (at + frame_lines(&lines[at])).min(lines.len());
            frames.push(lines[at..end].to_vec());
            at = end;
        }
        frames
    }

    /// What the engine published since the last call, decoded.
    fn sent(&mut self) -> Vec<Seen> {
        self.frames().iter().map(|f| seen(f)).collect()
    }

    /// Polls the CQ (one engine iteration in inline mode) into `polled`.
    fn poll(&mut self) {
        let mut wc = [crate::WorkCompletion::default(); 64];
        let n = self.cq.poll(&mut wc);
        self.polled.extend(
            wc[..n]
                .iter()
                .map(|c| (c.qp_num, c.opcode, c.wr_id, c.status)),
        );
    }

    /// The completions polled so far (and now), taken.
    fn completions(&mut self) -> Vec<(WcOpcode, u64, WcStatus)> {
        self.poll();
        self.polled
            .drain(..)
            .map(|(_, op, id, st)| (op, id, st))
            .collect()
    }

    /// Publishes one frame.
    fn push(&mut self, lines: &[PacketSlot]) {
        assert!(self.ends.tx.push_frame(lines).unwrap(), "the ring is full");
    }

    /// A request from the peer to the rig's QP (see [`request_to`]).
    fn request(&self, op: Opcode, psn: u32, payload: &[u8]) -> PacketSlot {
        let reth =
            matches!(op, Opcode::RdmaWriteOnly | Opcode::RdmaReadRequest).then(|| RethRepr {
                va: self.mr.addr() + 1024,
                rkey: self.mr.rkey(),
                dma_len: if op == Opcode::RdmaReadRequest {
                    8
                } else {
                    payload.len() as u32
                },
            });
        request_to(self.qp.qpn(), op, psn, payload, reth)
    }

    /// Sends a Send (id 0, PSN `SQ_PSN`) and throws its frame away: a QP that has sent a
    /// request is one whose owed Acks are worth holding back for a request to ride in.
    fn prime(&mut self) {
        self.send(0, 8);
        self.ctx.progress();
        assert_eq!(self.sent().len(), 1);
    }

    /// Whether the engine becomes idle (nothing active, timed, owed or kept) within a few
    /// timer checks (a QP leaves the timed set at a timer check).
    fn goes_idle(&mut self) -> bool {
        for _ in 0..4 * crate::engine::TIMER_EVERY {
            if self.ctx.shared.engine.with(|e| e.idle()) {
                return true;
            }
            self.ctx.progress();
        }
        false
    }
}

/// Posts a signaled Send of `len` bytes from offset 4096 of `mr` on `qp`.
fn post(qp: &mut Qp, mr: &Mr, id: u64, len: u32) {
    let sge = [mr.sge(4096, len).unwrap()];
    qp.post_send(&SendWr::new(id, SendOp::Send, &sge)).unwrap();
}

/// A request from the peer to QP `qpn`: `op` at `psn` with AckReq, `payload` inline, the
/// RETH `reth` if given.
fn request_to(
    qpn: Qpn,
    op: Opcode,
    psn: u32,
    payload: &[u8],
    reth: Option<RethRepr>,
) -> PacketSlot {
    let mut repr = PacketRepr::new(BthRepr::new(op, qpn, crate::psn::Psn::new(psn)));
    repr.bth.ack_req = true;
    repr.bth.pad_count = ((4 - payload.len() % 4) % 4) as u8;
    repr.reth = reth;
    let mut s = PacketSlot::default();
    s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
    s.payload_len = payload.len() as u32;
    s.kind = if payload.is_empty() {
        KIND_NONE
    } else {
        KIND_INLINE
    };
    let at = s.hdr_len as usize;
    s.data[at..at + payload.len()].copy_from_slice(payload);
    s
}

/// A positive Ack's syndrome with `n` credits.
fn ack_syn(n: u32) -> Syndrome {
    Syndrome::Ack {
        credits: CreditCode::encode(n),
    }
}

/// `s` with the riding Ack (`psn`, 4 credits, `msn`) and the flag, as a peer writes it.
fn with_riding(mut s: PacketSlot, psn: u32, msn: u32) -> PacketSlot {
    s.payload_off = riding_word(psn, ack_syn(4).to_u8(), msn);
    s.reserved |= ACK_FLAG;
    s
}

/// The frames of a carrier and its Ack: one flagged line, or the carrier and a standalone
/// Ack line behind it (to the carrier's destination QP).
fn carrier_and_ack(carrier: PacketSlot, psn: u32, msn: u32, ride: bool) -> Vec<PacketSlot> {
    if ride {
        vec![with_riding(carrier, psn, msn)]
    } else {
        let qpn = RxPacket::dest_qp(&carrier);
        vec![carrier, ack_line_to(qpn, psn, ack_syn(4), msn)]
    }
}

/// Stamps `s` (a one-line packet, payload inline or absent) with its ICRC as the fault
/// stage does: in slot bytes 12..16, with [`ICRC_FLAG`].
fn stamp_icrc(s: &mut PacketSlot) {
    let crc = crate::fault::packet_icrc(std::slice::from_ref(s), &Mem::private(0)).unwrap();
    let b = crc.to_le_bytes();
    s.sge_count = b[0];
    s.zero = [b[1], b[2], b[3]];
    s.reserved |= ICRC_FLAG;
}

/// A frame the engine sent, decoded: opcode, destination QP, PSN, AETH (syndrome byte and
/// MSN), the riding word if it carries one, and whether it carries an ICRC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Seen {
    op: u8,
    dest: u32,
    psn: u32,
    aeth: Option<(u8, u32)>,
    riding: Option<u64>,
    icrc: bool,
}

impl Seen {
    fn is_ack(&self) -> bool {
        self.op == Opcode::Acknowledge.code()
    }

    /// The riding Ack's PSN and MSN.
    fn ride(&self) -> Option<(u32, u32)> {
        self.riding
            .map(|w| ((w >> 32) as u32 & 0x00ff_ffff, w as u32 & 0x00ff_ffff))
    }
}

fn seen(frame: &[PacketSlot]) -> Seen {
    let s = &frame[0];
    let pkt = RxPacket::parse(s, &frame[1..]).expect("the engine sends well-formed frames");
    Seen {
        op: s.data[0],
        dest: RxPacket::dest_qp(s).get(),
        psn: pkt.psn().get(),
        aeth: pkt.aeth().map(|a| (a.syndrome.to_u8(), a.msn.get())),
        riding: (s.reserved & ACK_FLAG != 0).then_some(s.payload_off),
        icrc: s.reserved & ICRC_FLAG != 0,
    }
}

/// The frames as the packets they stand for, in a canonical order: a riding Ack becomes
/// an Acknowledge of its own (so that an Ack that rode in one run and left alone in the
/// other compare equal).
fn as_packets(sent: &[Seen]) -> Vec<Seen> {
    let mut out = vec![];
    for s in sent {
        out.push(Seen { riding: None, ..*s });
        if let Some(w) = s.riding {
            out.push(Seen {
                op: Opcode::Acknowledge.code(),
                dest: s.dest,
                psn: (w >> 32) as u32 & 0x00ff_ffff,
                aeth: Some(((w >> 24) as u8, w as u32 & 0x00ff_ffff)),
                riding: None,
                icrc: false,
            });
        }
    }
    out.sort();
    out
}

/// What happened to a carrier with an Ack of the rig QP's first Send riding in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// A Send at ePSN, accepted.
    Accepted,
    /// A Send the QP accepted already (a duplicate): re-acknowledged.
    Duplicate,
    /// A Send ahead of ePSN: a PSN Sequence Error Nak.
    Ahead,
    /// A Send with no receive WQE posted: an RNR Nak.
    NoReceive,
    /// An RDMA Write with a bad R_Key: a fatal Remote Access Error, the QP goes to Error.
    BadRkey,
    /// A Send Middle with no message begun: a fatal Invalid Request.
    NoFirst,
    /// An RDMA Read request, accepted: answered by a Read response.
    ReadRequest,
    /// A Send to a QPN with the QP's index and another generation: dropped whole.
    WrongQpn,
    /// A Send to the QP in the Error state.
    QpInError,
    /// A Send to the QP drained (SQD): the responder works, and so does the completer.
    QpDrained,
}

/// What the application and the peer saw after a fate, for comparison.
#[derive(Debug, PartialEq, Eq)]
struct Outcome {
    completions: Vec<(WcOpcode, u64, WcStatus)>,
    state: QpState,
    sent: Vec<Seen>,
    stats: Stats,
}

/// The rig's QP has Sends 1 and 2 (PSNs 500 and 501) unacknowledged; the peer sends a
/// carrier with fate `f`, and an Ack of PSN 500 riding in it (`ride`) or behind it alone.
fn run_fate(f: Fate, ride: bool) -> Outcome {
    let recvs = if f == Fate::NoReceive { 0 } else { 4 };
    let mut rig = Rig::new(
        inline_context(),
        Setup {
            recvs,
            ..Setup::default()
        },
    );
    rig.send(1, 8);
    rig.send(2, 8);
    rig.ctx.progress();
    assert_eq!(rig.sent().len(), 2);
    let qpn = rig.qp.qpn();
    match f {
        Fate::Duplicate => {
            let first = rig.request(Opcode::SendOnly, 0, b"first!!!");
            rig.push(&[first]);
            rig.settle();
        }
        Fate::QpInError => rig.qp.modify(&QpAttr::new(QpState::Error)).unwrap(),
        Fate::QpDrained => rig.qp.modify(&QpAttr::new(QpState::Sqd)).unwrap(),
        _ => {}
    }
    rig.completions();
    rig.sent();
    let carrier = match f {
        Fate::Accepted | Fate::Duplicate | Fate::NoReceive | Fate::QpInError | Fate::QpDrained => {
            rig.request(Opcode::SendOnly, 0, b"carrier!")
        }
        Fate::Ahead => rig.request(Opcode::SendOnly, 3, b"carrier!"),
        Fate::BadRkey => {
            let mut s = rig.request(Opcode::RdmaWriteOnly, 0, b"carrier!");
            // The R_Key's bytes in the RETH (after the BTH and the 8-byte address).
            s.data[12 + 8] ^= 0x5a;
            s
        }
        Fate::NoFirst => rig.request(Opcode::SendMiddle, 0, b"carrier!"),
        Fate::ReadRequest => rig.request(Opcode::RdmaReadRequest, 0, &[]),
        Fate::WrongQpn => request_to(
            Qpn::new((qpn.get() + (1 << 12)) & 0x00ff_ffff),
            Opcode::SendOnly,
            0,
            b"carrier!",
            None,
        ),
    };
    for line in carrier_and_ack(carrier, SQ_PSN, 1, ride) {
        rig.push(&[line]);
    }
    rig.settle();
    let mut stats = rig.ctx.stats();
    // One frame against two: the only counts that may differ.
    stats.packets_received = 0;
    if f == Fate::WrongQpn {
        stats.dropped = 0;
    }
    Outcome {
        completions: rig.completions(),
        state: rig.qp.state(),
        sent: as_packets(&rig.sent()),
        stats,
    }
}

/// A riding Ack is handled as a standalone Ack behind its carrier, whatever became of the
/// carrier: accepted, a duplicate, ahead of ePSN (Nak'd), without a receive WQE (RNR),
/// fatal (the QP goes to Error first, so the Ack finds it there), a Read request, for
/// another QP, or for a QP in Error or SQD. Checked against the same exchange with a
/// standalone Ack line: the same completions, QP state, packets sent and counters.
///
/// Defended by: the engine handling the riding word after `responder::on_request` for
/// every carrier that parsed, whatever the responder made of it. Handling it before the
/// carrier turns the fatal fates' flushed Send 1 into a success; handling it only where
/// the responder accepted the carrier (an Ack owed after it) loses the Ack of the Nak'd
/// and RNR fates (Send 1 never completes); both were tried on a scratch copy and fail
/// here.
#[test]
fn a_riding_ack_is_handled_as_a_standalone_ack_whatever_became_of_its_carrier() {
    use Fate::*;
    for f in [
        Accepted,
        Duplicate,
        Ahead,
        NoReceive,
        BadRkey,
        NoFirst,
        ReadRequest,
        WrongQpn,
        QpInError,
        QpDrained,
    ] {
        let alone = run_fate(f, false);
        let riding = run_fate(f, true);
        assert_eq!(riding, alone, "{f:?}: riding and standalone differ");
        // And the fate is what it says (the comparison is not between two no-ops).
        let send1_ok = riding
            .completions
            .contains(&(WcOpcode::Send, 1, WcStatus::Success));
        let acked = !matches!(f, BadRkey | NoFirst | WrongQpn | QpInError);
        assert_eq!(send1_ok, acked, "{f:?}: {riding:?}");
        let error = matches!(f, BadRkey | NoFirst | QpInError);
        assert_eq!(riding.state == QpState::Error, error, "{f:?}: {riding:?}");
    }
}

/// PSNs wrap at 2^24: a riding Ack acknowledges exactly the Sends up to its PSN across
/// the wrap, and nothing for a PSN the QP never sent (just past the last one sent, or half
/// the PSN space away), an old PSN, or one it already acknowledged — as a standalone Ack.
///
/// Defended by the completer's modular PSN window (`Psn::diff` against the last PSN
/// acknowledged and the first not sent) applied to the Ack rebuilt from the 24-bit PSN of
/// the riding word: with a plain integer difference in `Psn::diff` this fails (tried on a
/// scratch copy).
#[test]
fn a_riding_ack_across_the_psn_wrap_acknowledges_exactly_what_was_sent() {
    for ride in [false, true] {
        let mut rig = Rig::new(
            inline_context(),
            Setup {
                sq_psn: 0x00ff_fffe,
                ..Setup::default()
            },
        );
        for id in 1..=4 {
            rig.send(id, 8);
        }
        rig.ctx.progress();
        let psns: Vec<u32> = rig.sent().iter().map(|s| s.psn).collect();
        assert_eq!(psns, [0x00ff_fffe, 0x00ff_ffff, 0, 1]);
        let steps: [(u32, &[u64]); 7] = [
            (2, &[]),           // the first PSN not sent
            (0x0080_0001, &[]), // half the PSN space ahead
            (0x00ff_fffd, &[]), // before the first Send
            (0, &[1, 2, 3]),    // across the wrap
            (0x00ff_ffff, &[]), // acknowledged already
            (2, &[]),           // still not sent
            (1, &[4]),
        ];
        for (k, (ack_psn, want)) in steps.into_iter().enumerate() {
            let carrier = rig.request(Opcode::SendOnly, k as u32, b"carrier!");
            for line in carrier_and_ack(carrier, ack_psn, k as u32 + 1, ride) {
                rig.push(&[line]);
            }
            rig.settle();
            let done: Vec<u64> = rig
                .completions()
                .iter()
                .filter(|c| c.0 == WcOpcode::Send)
                .map(|c| {
                    assert_eq!(c.2, WcStatus::Success);
                    c.1
                })
                .collect();
            assert_eq!(done, want, "ride {ride}, Ack of PSN {ack_psn:#x}");
        }
        assert_eq!(rig.qp.state(), QpState::Rts);
        assert_eq!(rig.ctx.stats().retransmitted, 0, "ride {ride}");
    }
}

/// A riding Ack whose PSN lies beyond an RDMA Read the QP sent cannot acknowledge the
/// Read (its data never came): it is an implied Nak, and the Read is requested again —
/// neither the Read nor the Send behind it completes. As a standalone Ack would.
///
/// Defended by the completer's check of the WQEs an Ack covers (a Read or Atomic before
/// the Ack's PSN means its responses were lost), which the riding Ack goes through like
/// any Ack: an Ack that completed every WQE up to its PSN would complete the Read with
/// no data.
#[test]
fn a_riding_ack_cannot_acknowledge_a_read_whose_data_never_came() {
    let mut outcomes = vec![];
    for ride in [false, true] {
        let mut rig = Rig::new(inline_context(), Setup::default());
        rig.read(1);
        rig.send(2, 8);
        rig.ctx.progress();
        let first = rig.sent();
        assert_eq!(
            first.iter().map(|s| (s.op, s.psn)).collect::<Vec<_>>(),
            [
                (Opcode::RdmaReadRequest.code(), SQ_PSN),
                (Opcode::SendOnly.code(), SQ_PSN + 1)
            ]
        );
        let carrier = rig.request(Opcode::SendOnly, 0, b"carrier!");
        for line in carrier_and_ack(carrier, SQ_PSN + 1, 2, ride) {
            rig.push(&[line]);
        }
        rig.settle();
        let c = rig.completions();
        assert_eq!(c, [(WcOpcode::Recv, 100, WcStatus::Success)], "ride {ride}");
        let sent = as_packets(&rig.sent());
        assert!(
            sent.iter()
                .any(|s| s.op == Opcode::RdmaReadRequest.code() && s.psn == SQ_PSN),
            "the Read is requested again: {sent:?}"
        );
        outcomes.push((c, sent, rig.qp.state()));
    }
    assert_eq!(outcomes[0], outcomes[1], "riding and standalone alike");
}

/// A peer's riding Ack on a gather frame (its payload named by a list in a continuation
/// line) is malformed: the whole frame is dropped — its payload not delivered, its Ack not
/// handled — and the ring stays in step: the same frame without the flag is delivered
/// next, then an inline Send carrying the same Ack completes the QP's Send.
///
/// Defended by `check_riding_ack`'s kind check (only a payload inline or absent may carry
/// an Ack). Without it the flagged gather frame is delivered and its Ack handled.
#[test]
fn a_riding_ack_on_a_gather_frame_is_refused_with_its_frame() {
    let mut rig = Rig::new(inline_context(), Setup::default());
    rig.send(1, 8);
    rig.ctx.progress();
    assert_eq!(rig.sent().len(), 1);
    rig.peer_mem.write(0, b"gathered").unwrap();
    let mut s = rig.request(Opcode::SendOnly, 0, &[]);
    s.kind = KIND_GATHER;
    s.payload_len = 8;
    s.sge_count = 2;
    let hdr = s.hdr_len as usize;
    s.data[hdr..hdr + 4].copy_from_slice(&0u32.to_le_bytes());
    let mut cont = [PacketSlot::default()];
    assert!(set_gather_entry(&mut cont, 0, 0, 4));
    assert!(set_gather_entry(&mut cont, 1, 4, 4));
    let before = rig.ctx.stats();
    let flagged = with_riding(s, SQ_PSN, 1);
    assert_eq!(frame_lines(&flagged), 2);
    rig.push(&[flagged, cont[0]]);
    rig.settle();
    assert!(rig.completions().is_empty(), "neither payload nor Ack");
    assert_eq!(rig.ctx.stats().dropped, before.dropped + 1);
    assert!(rig.sent().is_empty(), "nothing to acknowledge");
    // The same frame unflagged: delivered, and acknowledged.
    rig.push(&[s, cont[0]]);
    rig.settle();
    assert_eq!(
        rig.completions(),
        [(WcOpcode::Recv, 100, WcStatus::Success)]
    );
    let mut b = [0u8; 8];
    rig.mr.read_at(0, &mut b).unwrap();
    assert_eq!(&b, b"gathered");
    // The Ack riding in an inline Send is taken.
    let carrier = rig.request(Opcode::SendOnly, 1, b"inline!!");
    rig.push(&[with_riding(carrier, SQ_PSN, 1)]);
    rig.settle();
    let c = rig.completions();
    assert!(c.contains(&(WcOpcode::Send, 1, WcStatus::Success)), "{c:?}");
    assert_eq!(rig.qp.state(), QpState::Rts);
}

/// A peer (or a fault stage) stamps an ICRC on a carrier, in slot bytes 12..16 beside the
/// riding word: a carrier whose bytes no longer match is dropped whole — neither its
/// payload nor its Ack counts — and the intact one is taken, Ack and all.
///
/// Defended by the receiver checking the ICRC before anything else, and reading it from
/// bytes 12..16 for a payload inline or absent (not from `payload_off`, where the riding
/// word is: reading it there drops every intact carrier with an Ack in it).
#[test]
fn an_icrc_checked_carrier_takes_its_riding_ack_with_it() {
    let mut rig = Rig::new(inline_context(), Setup::default());
    rig.send(1, 8);
    rig.ctx.progress();
    assert_eq!(rig.sent().len(), 1);
    let mut good = with_riding(rig.request(Opcode::SendOnly, 0, b"icrc-ok!"), SQ_PSN, 1);
    stamp_icrc(&mut good);
    assert!(crate::fault::icrc_ok(&[good], &Mem::private(0)));
    let mut bad = good;
    bad.data[12] ^= 0x10; // a payload bit, after the stamp
    rig.push(&[bad]);
    rig.settle();
    assert!(rig.completions().is_empty());
    assert_eq!(rig.ctx.fault_stats().icrc_dropped, 1);
    assert!(rig.sent().is_empty());
    rig.push(&[good]);
    rig.settle();
    let c = rig.completions();
    assert_eq!(
        c,
        [
            (WcOpcode::Recv, 100, WcStatus::Success),
            (WcOpcode::Send, 1, WcStatus::Success)
        ]
    );
    assert_eq!(rig.ctx.fault_stats().icrc_dropped, 1);
    let mut b = [0u8; 8];
    rig.mr.read_at(0, &mut b).unwrap();
    assert_eq!(&b, b"icrc-ok!");
}

/// A rig whose context's fault stage applies, to each Send Only it sends, the next action
/// of a script (Pass when the script is empty); the fault stage stamps every packet with
/// its ICRC.
fn faulty_rig() -> (Rig, Arc<Mutex<VecDeque<FaultAction>>>) {
    faulty_rig_for(Opcode::SendOnly)
}

/// [`faulty_rig`] whose script applies to the packets of opcode `op` it sends.
fn faulty_rig_for(op: Opcode) -> (Rig, Arc<Mutex<VecDeque<FaultAction>>>) {
    let script: Arc<Mutex<VecDeque<FaultAction>>> = Arc::default();
    let s2 = script.clone();
    let ctx = Context::builder()
        .mode(crate::EngineMode::Inline)
        .progress(crate::Progress::Manual)
        .huge_pages(shmhca_rings::segment::HugePages::Never)
        .fault_rule(move |e| {
            if e.headers.bth.opcode != op {
                return FaultAction::Pass;
            }
            s2.lock().unwrap().pop_front().unwrap_or(FaultAction::Pass)
        })
        .build()
        .unwrap();
    let mut rig = Rig::new(
        ctx,
        Setup {
            hold: true,
            ..Setup::default()
        },
    );
    rig.prime();
    (rig, script)
}

/// Through the sending side's fault stage: a carrier keeps its riding word intact beside
/// the ICRC the stage stamps (which checks); a duplicated carrier sends its Ack twice but
/// counts it once; a corrupted carrier fails its ICRC (so the receiver drops it, Ack and
/// all) while its riding word is untouched; a dropped carrier loses its Ack, which the
/// QP sends again when the peer sends the request again (as a duplicate).
///
/// Defended by `stamp_icrc` writing the ICRC of such packets to slot bytes 12..16: written
/// to `payload_off` as before the riding Ack, it overwrites the riding word (the first
/// check here fails).
#[test]
fn the_fault_stage_leaves_a_riding_ack_whole() {
    let (mut rig, script) = faulty_rig();
    let ack_of = |rig: &mut Rig, psn: u32, id: u64, action: FaultAction| {
        let r = rig.request(Opcode::SendOnly, psn, b"peer-msg");
        rig.push(&[r]);
        rig.poll();
        assert!(rig.sent().is_empty(), "held back");
        script.lock().unwrap().push_back(action);
        let before = rig.ctx.stats();
        rig.send(id, 8);
        let sent = rig.frames();
        let after = rig.ctx.stats();
        assert_eq!(after.acks_sent, before.acks_sent + 1, "{action:?}");
        assert_eq!(after.acks_riding, before.acks_riding + 1, "{action:?}");
        assert_eq!(after.packets_sent, before.packets_sent + 1, "{action:?}");
        sent
    };
    // Pass: the ICRC checks, the word is the Ack of PSN 0.
    let sent = ack_of(&mut rig, 0, 1, FaultAction::Pass);
    assert_eq!(sent.len(), 1);
    let s = seen(&sent[0]);
    assert!(s.icrc);
    assert_eq!(s.ride(), Some((0, 1)));
    assert!(crate::fault::icrc_ok(&sent[0], &Mem::private(0)));
    // Duplicate: twice the same line.
    let sent = ack_of(&mut rig, 1, 2, FaultAction::Duplicate);
    assert_eq!(sent.len(), 2);
    assert_eq!(
        bytemuck::bytes_of(&sent[0][0]),
        bytemuck::bytes_of(&sent[1][0])
    );
    assert_eq!(seen(&sent[0]).ride(), Some((1, 2)));
    // Corrupt: the ICRC fails; the word is intact (the receiver drops the line anyway).
    let sent = ack_of(&mut rig, 2, 3, FaultAction::Corrupt);
    assert_eq!(sent.len(), 1);
    assert!(!crate::fault::icrc_ok(&sent[0], &Mem::private(0)));
    assert_eq!(sent[0][0].reserved & ACK_FLAG, ACK_FLAG);
    assert_eq!(
        sent[0][0].payload_off >> 32 & 0x00ff_ffff,
        2,
        "the riding word is not what the fault stage flips"
    );
    // Drop: nothing leaves; the peer sends its request again and gets its Ack.
    let sent = ack_of(&mut rig, 3, 4, FaultAction::Drop);
    assert!(sent.is_empty());
    let again = rig.request(Opcode::SendOnly, 3, b"peer-msg");
    rig.push(&[again]);
    rig.settle();
    let sent = rig.sent();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert!(sent[0].is_ack());
    assert_eq!(sent[0].psn, 3);
    let f = rig.ctx.fault_stats();
    assert_eq!((f.duplicated, f.corrupted, f.dropped), (1, 1, 1));
}

/// The fault stage decides a riding Ack's fate apart from its carrier's, as the capture
/// shows them: two packets. A rule sees the Ack as an Acknowledge. Passed, the Ack rides
/// on; otherwise it leaves its carrier and follows it as a standalone Ack with its fault:
/// dropped (the peer sends its request again and gets its Ack), sent twice, corrupted (its
/// ICRC fails), held a few iterations. The carrier goes through untouched each time.
///
/// Defended by `Faults::on_sent` taking the riding Ack out of its carrier: before, rules
/// never saw a riding Ack, and it always shared its carrier's fate.
#[test]
fn the_fault_stage_decides_a_riding_acks_fate_apart_from_its_carrier() {
    let (mut rig, script) = faulty_rig_for(Opcode::Acknowledge);
    // The peer's Send `psn` is delivered, its Ack held; the rig's Send `id` would carry it.
    let answer = |rig: &mut Rig, psn: u32, id: u64, action: FaultAction| {
        let r = rig.request(Opcode::SendOnly, psn, b"peer-msg");
        rig.push(&[r]);
        rig.poll();
        assert!(rig.sent().is_empty(), "held back");
        script.lock().unwrap().push_back(action);
        rig.send(id, 8);
        let sent = rig.frames();
        assert!(script.lock().unwrap().is_empty(), "the rule saw the Ack");
        let carrier = seen(&sent[0]);
        assert_eq!(
            (carrier.op, carrier.psn),
            (Opcode::SendOnly.code(), SQ_PSN + id as u32)
        );
        assert!(crate::fault::icrc_ok(&sent[0], &Mem::private(0)));
        sent
    };
    let packets = rig.ctx.fault_stats().packets;
    // Pass: it rides.
    let sent = answer(&mut rig, 0, 1, FaultAction::Pass);
    assert_eq!(sent.len(), 1);
    assert_eq!(seen(&sent[0]).ride(), Some((0, 1)));
    assert_eq!(
        rig.ctx.fault_stats().packets,
        packets + 2,
        "carrier and Ack"
    );
    // Duplicate: the carrier alone, then the Ack twice.
    let sent = answer(&mut rig, 1, 2, FaultAction::Duplicate);
    let seen_all: Vec<Seen> = sent.iter().map(|f| seen(f)).collect();
    assert_eq!(seen_all.len(), 3, "{seen_all:?}");
    assert_eq!(seen_all[0].riding, None);
    for a in &seen_all[1..] {
        assert!(a.is_ack() && a.icrc, "{a:?}");
        assert_eq!((a.psn, a.aeth.map(|(_, msn)| msn)), (1, Some(2)));
    }
    assert!(crate::fault::icrc_ok(&sent[1], &Mem::private(0)));
    // Corrupt: the carrier intact, the Ack's ICRC fails.
    let sent = answer(&mut rig, 2, 3, FaultAction::Corrupt);
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0][0].reserved & ACK_FLAG, 0);
    assert!(!crate::fault::icrc_ok(&sent[1], &Mem::private(0)));
    // Delay: the carrier now, the Ack a few iterations later.
    let sent = answer(&mut rig, 3, 4, FaultAction::Delay);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0][0].reserved & ACK_FLAG, 0);
    for _ in 0..crate::fault::MAX_DELAY_ITERATIONS + 1 {
        rig.ctx.progress();
    }
    let later = rig.sent();
    assert_eq!(later.len(), 1, "{later:?}");
    assert!(later[0].is_ack());
    assert_eq!((later[0].psn, later[0].aeth.map(|(_, m)| m)), (3, Some(4)));
    // Drop: the carrier alone; the peer's duplicate request is answered with the Ack.
    let sent = answer(&mut rig, 4, 5, FaultAction::Drop);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0][0].reserved & ACK_FLAG, 0);
    let again = rig.request(Opcode::SendOnly, 4, b"peer-msg");
    rig.push(&[again]);
    rig.settle();
    let sent = rig.sent();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert!(sent[0].is_ack());
    assert_eq!(sent[0].psn, 4);
    let f = rig.ctx.fault_stats();
    assert_eq!(
        (f.duplicated, f.corrupted, f.delayed, f.dropped),
        (1, 1, 1, 1)
    );
    let c = rig.completions();
    assert_eq!(
        c.iter().filter(|c| c.0 == WcOpcode::Recv).count(),
        5,
        "{c:?}"
    );
}

/// The ICRC a fault-injecting sender stamps on a carrier covers its riding Ack: a bit
/// flipped in the word fails the check.
///
/// Defended by `packet_icrc` hashing the riding word: before, the ICRC covered the
/// carrier's headers and payload only.
#[test]
fn the_icrc_covers_the_riding_word() {
    let rig = Rig::new(inline_context(), Setup::default());
    let mut carrier = with_riding(rig.request(Opcode::SendOnly, 0, b"icrc-ok!"), SQ_PSN, 1);
    stamp_icrc(&mut carrier);
    assert!(crate::fault::icrc_ok(&[carrier], &Mem::private(0)));
    for bit in [0, 7, 24, 32, 55] {
        let mut bad = carrier;
        bad.payload_off ^= 1 << bit;
        assert!(
            !crate::fault::icrc_ok(&[bad], &Mem::private(0)),
            "bit {bit} of the riding word"
        );
    }
}

/// An Ack held back an iteration whose link then goes down is dropped with the link (the
/// QP goes to Error): nothing is sent, nothing panics, the engine becomes idle — the owed
/// list does not keep an entry for a dead link — and modifying or destroying the QP
/// afterwards (which would send a held Ack first) finds nothing to send.
///
/// Defended by `flush_owed_acks` dropping the entries of a link that is down: pushed back
/// instead, they stay listed forever and the engine never becomes idle (tried on a
/// scratch copy).
#[test]
fn a_held_ack_whose_link_goes_down_goes_with_it() {
    for then in ["modify", "destroy", "nothing"] {
        let mut rig = Rig::new(
            inline_context(),
            Setup {
                hold: true,
                ..Setup::default()
            },
        );
        rig.prime();
        let before = rig.ctx.stats();
        let r = rig.request(Opcode::SendOnly, 0, b"the-last");
        rig.push(&[r]);
        assert_eq!(rig.completions().len(), 1);
        assert!(rig.sent().is_empty(), "held back");
        let link = rig.link;
        rig.ctx
            .shared
            .engine
            .with(|e| e.link_down(link, "test".into()));
        rig.settle();
        assert_eq!(rig.qp.state(), QpState::Error);
        assert!(rig.goes_idle(), "{then}: the engine keeps working");
        match then {
            "modify" => rig.qp.modify(&QpAttr::new(QpState::Reset)).unwrap(),
            "destroy" => {
                let qp = std::mem::replace(
                    &mut rig.qp,
                    rig.ctx
                        .create_qp(&rig.pd, &rig.cq, &rig.cq, caps())
                        .unwrap(),
                );
                drop(qp);
            }
            _ => {}
        }
        rig.settle();
        assert!(rig.sent().is_empty());
        let after = rig.ctx.stats();
        assert_eq!(after.acks_sent, before.acks_sent, "{then}");
        assert_eq!(after.packets_sent, before.packets_sent, "{then}");
        assert!(rig.goes_idle(), "{then}");
    }
}

/// An Ack held back when its QP is modified, while the link has no room (the peer reads
/// nothing): `send_owed_now` cannot send it, so it stays owed and listed, and leaves once
/// the peer makes room — exactly once.
///
/// Defended by `send_owed_now` leaving a QP whose Ack found no room owed and on the owed
/// list: unlisted there (as if it had left), the Ack never leaves (tried on a scratch
/// copy); dropped, likewise.
#[test]
fn a_held_ack_that_finds_no_room_at_a_modify_leaves_later() {
    owed_both_ways(a_held_ack_that_finds_no_room_at_a_modify_leaves_later_once);
}

fn a_held_ack_that_finds_no_room_at_a_modify_leaves_later_once() {
    let mut rig = Rig::new(
        inline_context(),
        Setup {
            hold: true,
            ..Setup::default()
        },
    );
    for id in 0..RING as u64 {
        rig.send(id, 8);
    }
    rig.ctx.progress();
    // The peer's ring is full (the engine's frames are still in it: nothing read yet).
    let r = rig.request(Opcode::SendOnly, 0, b"ping-one");
    rig.push(&[r]);
    rig.poll();
    let before = rig.ctx.stats();
    rig.qp
        .modify(&QpAttr::new(QpState::Rts).min_rnr_timer(2))
        .unwrap();
    rig.settle();
    assert_eq!(rig.ctx.stats().acks_sent, before.acks_sent, "no room yet");
    // The peer reads its ring: the Ack leaves.
    let first = rig.sent();
    assert_eq!(first.len(), RING);
    assert!(first.iter().all(|s| !s.is_ack() && s.riding.is_none()));
    rig.settle();
    let sent = rig.sent();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert!(sent[0].is_ack());
    assert_eq!(sent[0].psn, 0);
    rig.settle();
    assert!(rig.sent().is_empty(), "only once");
    assert_eq!(rig.ctx.stats().acks_sent, before.acks_sent + 1);
}

/// Runs `test` with the fast paths off (every owed Ack's QP on a list, every credit code
/// counted afresh), then on: its assertions hold both ways, and the second run lists an
/// owed Ack's QP in the owed lists' first word (issue 27's owed Ack).
pub(super) fn owed_both_ways(test: fn()) {
    crate::probe::set_enabled(false);
    test();
    crate::probe::set_enabled(true);
    let before = crate::probe::taken(crate::probe::Path::OwedFirst);
    test();
    assert!(crate::probe::taken(crate::probe::Path::OwedFirst) > before);
}

/// A rig holding owed Acks back, with a second QP on its link (to the peer's `PEER2`, 4
/// receives posted), each of whose QPs has sent a request (PSN 500): QPs that reply.
fn two_qps() -> (Rig, Qp) {
    let mut rig = Rig::new(
        inline_context(),
        Setup {
            hold: true,
            ..Setup::default()
        },
    );
    let peer_mem = rig.peer_mem.share();
    let link = rig.link;
    rig.ctx.shared.engine.with(|e| {
        e.link_mut(link)
            .unwrap()
            .add_peer_qp(Qpn::new(PEER2), (1, 1), peer_mem)
    });
    let mut qp2 = rig
        .ctx
        .create_qp(&rig.pd, &rig.cq, &rig.cq, caps())
        .unwrap();
    connect_to_raw_peer(&mut qp2, link, PEER2, SQ_PSN, false);
    for i in 0..4 {
        qp2.post_recv(&RecvWr::new(
            200 + i,
            &[rig.mr.sge(1024 + i * 64, 64).unwrap()],
        ))
        .unwrap();
    }
    rig.settle();
    rig.sent();
    rig.prime();
    post(&mut qp2, &rig.mr, 0, 8);
    rig.ctx.progress();
    assert_eq!(rig.sent().len(), 1);
    (rig, qp2)
}

/// Two QPs that reply, whose requests arrive an iteration apart: each Ack is held back an
/// iteration of its own. The first QP's Ack, unanswered, leaves alone after its iteration;
/// the second's is not sent with it but rides in the answer the application posts next,
/// and its QP still holds its Acks back afterwards.
///
/// Defended by `flush_owed_acks` keeping a QP listed in the flushing iteration
/// (`Responder::listed_late`): before, the held list left whole, with the late Ack in it,
/// and that QP stopped holding its Acks back.
#[test]
fn an_ack_owed_an_iteration_later_is_held_back_an_iteration_of_its_own() {
    owed_both_ways(an_ack_owed_an_iteration_later_is_held_back_an_iteration_of_its_own_once);
}

fn an_ack_owed_an_iteration_later_is_held_back_an_iteration_of_its_own_once() {
    let (mut rig, mut qp2) = two_qps();
    let qpns = [rig.qp.qpn(), qp2.qpn()];
    let r = request_to(qpns[0], Opcode::SendOnly, 0, b"to-qp-0!", None);
    rig.push(&[r]);
    rig.poll();
    assert!(rig.sent().is_empty(), "held back");
    let r = request_to(qpns[1], Opcode::SendOnly, 0, b"to-qp-1!", None);
    rig.push(&[r]);
    rig.poll();
    let sent = rig.sent();
    assert_eq!(sent.len(), 1, "only the first QP's Ack: {sent:?}");
    assert!(sent[0].is_ack() && sent[0].dest == PEER, "{sent:?}");
    post(&mut qp2, &rig.mr, 1, 8);
    let sent = rig.sent();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!((sent[0].dest, sent[0].ride()), (PEER2, Some((0, 1))));
    // Still a QP that replies: its next Ack is held back again.
    let r = request_to(qpns[1], Opcode::SendOnly, 1, b"to-qp-1!", None);
    rig.push(&[r]);
    rig.poll();
    assert!(rig.sent().is_empty(), "held back again");
    rig.settle();
    let sent = rig.sent();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert!(sent[0].is_ack() && sent[0].dest == PEER2 && sent[0].psn == 1);
    // The peer acknowledges the QPs' Sends; nothing is left to do.
    rig.push(&[ack_line_to(qpns[0], SQ_PSN, ack_syn(4), 1)]);
    rig.push(&[ack_line_to(qpns[1], SQ_PSN + 1, ack_syn(4), 2)]);
    assert!(rig.goes_idle());
    drop(qp2);
}

/// Two QPs on one link, both of which have sent a request, owe Acks (both listed on the
/// link's owed list, held back an iteration); the application answers on one, both or
/// neither, in either order. Every
/// Ack leaves exactly once — riding in the answer, or alone an iteration later — however
/// `forget_head` took entries off the list; the list stays sound (a second round of Acks
/// leaves too), and the engine ends idle.
///
/// Defended by `forget_head` unlisting only the head and keeping the rest of the list:
/// dropping the rest (taking the whole list for the head's) leaves the other QP listed
/// nowhere the flush looks — its Ack never leaves, nor any later one (tried on a scratch
/// copy).
#[test]
fn every_owed_ack_of_a_link_leaves_once_whichever_rides() {
    owed_both_ways(every_owed_ack_of_a_link_leaves_once_whichever_rides_once);
}

fn every_owed_ack_of_a_link_leaves_once_whichever_rides_once() {
    // (Which QP's request arrives first — the other heads the list —, which answer.)
    for (first, answer) in [
        (0, &[][..]),
        (0, &[0][..]),
        (0, &[1][..]),
        (0, &[0, 1][..]),
        (0, &[1, 0][..]),
        (1, &[0][..]),
        (1, &[1][..]),
    ] {
        let (mut rig, mut qp2) = two_qps();
        let peers = [PEER, PEER2];
        let qpns = [rig.qp.qpn(), qp2.qpn()];
        let what = format!("first {first}, answer {answer:?}");
        // Round 1: a request to each QP in one burst.
        for q in [first, 1 - first] {
            let r = request_to(qpns[q], Opcode::SendOnly, 0, b"round-1!", None);
            rig.push(&[r]);
        }
        rig.poll();
        assert!(rig.sent().is_empty(), "{what}: held back");
        for &q in answer {
            if q == 0 {
                rig.send(1, 8);
            } else {
                post(&mut qp2, &rig.mr, 1, 8);
            }
        }
        rig.settle();
        let sent = rig.sent();
        for (q, &peer) in peers.iter().enumerate() {
            let acks: Vec<_> = sent
                .iter()
                .filter(|s| s.dest == peer)
                .filter_map(|s| {
                    if s.is_ack() {
                        s.aeth.map(|a| (s.psn, a.1))
                    } else {
                        s.ride()
                    }
                })
                .collect();
            assert_eq!(acks, [(0, 1)], "{what}: QP {q}'s Acks: {sent:?}");
            let rode = sent.iter().any(|s| s.dest == peer && s.riding.is_some());
            assert_eq!(rode, answer.contains(&q), "{what}: {sent:?}");
        }
        // Round 2: another request to each, carrying the Ack of the QP's last Send; no
        // answers. Each QP's Ack leaves alone.
        for q in [first, 1 - first] {
            let r = request_to(qpns[q], Opcode::SendOnly, 1, b"round-2!", None);
            let last = if answer.contains(&q) {
                SQ_PSN + 1
            } else {
                SQ_PSN
            };
            rig.push(&[with_riding(r, last, 1)]);
        }
        rig.settle();
        let sent = rig.sent();
        for (q, &peer) in peers.iter().enumerate() {
            let acks: Vec<_> = sent
                .iter()
                .filter(|s| s.dest == peer)
                .map(|s| (s.op, s.psn, s.riding))
                .collect();
            assert_eq!(
                acks,
                [(Opcode::Acknowledge.code(), 1, None)],
                "{what}: round 2, QP {q}"
            );
        }
        let done = rig
            .completions()
            .iter()
            .filter(|c| c.0 == WcOpcode::Send && c.2 == WcStatus::Success)
            .count();
        assert_eq!(done, 2 + answer.len(), "{what}");
        assert!(rig.goes_idle(), "{what}: the engine keeps working");
        drop(qp2);
    }
}

/// The counters say what went on the wire: `packets_sent` counts the lines (a riding Ack
/// takes none), `acks_sent` every Ack (riding, alone after a request that could not carry
/// it, alone after holding, alone before a destroy), `acks_riding` the lines with the
/// flag — through an Ack riding in a Send, one that cannot ride (a payload by reference),
/// one nobody answers, a Read response (which acknowledges by itself: no Ack), one owed
/// when the application posts an RDMA Read (no payload: it may carry the Ack), and one
/// sent as its QP is destroyed. (Which of them ride depends on the holding policy: the
/// counters must match the wire either way.)
///
/// Defended by `ride` counting `acks_sent` and `acks_riding` (and the request builders not
/// counting the Ack as a packet), and `send_owed_ack` not counting an Ack that rode: `ride`
/// not counting `acks_sent` fails here (tried on a scratch copy).
#[test]
fn the_counters_match_the_wire() {
    let mut rig = Rig::new(
        inline_context(),
        Setup {
            hold: true,
            ..Setup::default()
        },
    );
    rig.prime();
    let before = rig.ctx.stats();
    let mut lines = vec![];
    let mut step = |rig: &mut Rig, psn: u32, op: Opcode, answer: &dyn Fn(&mut Rig)| {
        let payload: &[u8] = if op == Opcode::SendOnly {
            b"peer-msg"
        } else {
            &[]
        };
        let r = rig.request(op, psn, payload);
        rig.push(&[r]);
        rig.poll();
        answer(rig);
        rig.settle();
        lines.extend(rig.sent());
    };
    step(&mut rig, 0, Opcode::SendOnly, &|r| r.send(1, 8));
    step(&mut rig, 1, Opcode::SendOnly, &|r| r.send(2, 100));
    step(&mut rig, 2, Opcode::SendOnly, &|_| {});
    step(&mut rig, 3, Opcode::RdmaReadRequest, &|_| {});
    step(&mut rig, 4, Opcode::SendOnly, &|r| r.read(3));
    // The last: held, then the QP destroyed (the Ack leaves first).
    let r = rig.request(Opcode::SendOnly, 5, b"the-last");
    rig.push(&[r]);
    rig.poll();
    let qp = std::mem::replace(
        &mut rig.qp,
        rig.ctx
            .create_qp(&rig.pd, &rig.cq, &rig.cq, caps())
            .unwrap(),
    );
    drop(qp);
    lines.extend(rig.sent());
    let after = rig.ctx.stats();
    let riding = lines.iter().filter(|s| s.riding.is_some()).count() as u64;
    let alone = lines.iter().filter(|s| s.is_ack()).count() as u64;
    assert!(riding >= 1 && alone >= 3, "{lines:?}");
    assert_eq!(after.packets_sent - before.packets_sent, lines.len() as u64);
    assert_eq!(after.acks_sent - before.acks_sent, riding + alone);
    assert_eq!(after.acks_riding - before.acks_riding, riding);
    // Each Ack acknowledges its own request, in order (the Read request's none).
    let mut acked: Vec<u32> = lines
        .iter()
        .filter_map(|s| {
            if s.is_ack() {
                Some(s.psn)
            } else {
                s.ride().map(|r| r.0)
            }
        })
        .collect();
    acked.sort();
    assert_eq!(acked, [0, 1, 2, 4, 5]);
}

/// A riding Ack that reaches a QP still in RTR is kept as the peer's initial credits
/// (spec/02 "Providing Initial Credits"), as a standalone Ack is — also when the
/// application moves the QP to RTS right after the carrier's iteration — and the QP then
/// sends what those credits allow.
///
/// Defended by the riding Ack going through the completer's RTR branch like any Ack (and,
/// since the engine keeps riding Acks for its next iteration, by a modify handling a kept
/// Ack first): a riding Ack dropped in RTR, as other responses to a QP not in RTS are,
/// leaves the QP without credits — it then sends only the first Send's packet (tried on a
/// scratch copy).
#[test]
fn a_riding_ack_to_a_qp_in_rtr_gives_its_initial_credits() {
    let mut outcomes = vec![];
    for ride in [false, true] {
        let mut rig = Rig::new(
            inline_context(),
            Setup {
                rts: false,
                credits: true,
                ..Setup::default()
            },
        );
        let carrier = rig.request(Opcode::SendOnly, 0, b"carrier!");
        let frames = if ride {
            let mut s = carrier;
            s.payload_off = riding_word(SQ_PSN - 1, ack_syn(2).to_u8(), 0);
            s.reserved |= ACK_FLAG;
            vec![s]
        } else {
            vec![
                carrier,
                ack_line_to(rig.qp.qpn(), SQ_PSN - 1, ack_syn(2), 0),
            ]
        };
        for f in frames {
            rig.push(&[f]);
        }
        rig.ctx.progress();
        rig.qp
            .modify(
                &QpAttr::new(QpState::Rts)
                    .sq_psn(SQ_PSN)
                    .timeout(14)
                    .retry_cnt(7)
                    .rnr_retry(7)
                    .max_rd_atomic(1),
            )
            .unwrap();
        for id in 1..=4 {
            rig.send(id, 8);
        }
        rig.settle();
        let sent: Vec<_> = rig
            .sent()
            .iter()
            .filter(|s| !s.is_ack())
            .map(|s| (s.op, s.psn))
            .collect();
        outcomes.push((sent, rig.completions(), rig.qp.state()));
    }
    assert_eq!(outcomes[0], outcomes[1], "riding and standalone alike");
    assert_eq!(
        outcomes[1].0.len(),
        3,
        "two Sends on the credits, the third's first packet: {:?}",
        outcomes[1]
    );
}

/// A QP destroyed right after an iteration that received a carrier with an Ack riding in
/// it, its slot taken at once by a new QP to the same peer that sends from the same PSN:
/// the old QP's Ack does not acknowledge the new QP's Send.
///
/// Guarded the bookkeeping of a kept riding Ack (until 2026-11-29 the engine kept one for
/// its next iteration, in the QP, with the QP's slot index in a set): the Ack must go with
/// its QP. Were it found by slot index alone, it would complete the successor's Send with
/// no Ack from the peer. Today the riding Ack is handled in its carrier's receive step and
/// nothing is kept; the test stays as the guard of any keeping to come.
#[test]
fn a_riding_ack_of_a_destroyed_qp_does_not_reach_its_successor() {
    let mut rig = Rig::new(inline_context(), Setup::default());
    rig.send(1, 8);
    rig.ctx.progress();
    assert_eq!(rig.sent().len(), 1);
    let carrier = rig.request(Opcode::SendOnly, 0, b"carrier!");
    rig.push(&[with_riding(carrier, SQ_PSN, 1)]);
    rig.ctx.progress();
    let old_index = rig.qp.index;
    let old = std::mem::replace(
        &mut rig.qp,
        rig.ctx
            .create_qp(&rig.pd, &rig.cq, &rig.cq, caps())
            .unwrap(),
    );
    drop(old);
    let mut qp = rig
        .ctx
        .create_qp(&rig.pd, &rig.cq, &rig.cq, caps())
        .unwrap();
    let link = rig.link;
    connect_to_raw_peer(&mut qp, link, PEER, SQ_PSN, false);
    assert_eq!(qp.index, old_index, "the slot is reused");
    post(&mut qp, &rig.mr, 7, 8);
    rig.settle();
    rig.poll();
    let new_qpn = qp.qpn();
    let of_new: Vec<_> = rig
        .polled
        .iter()
        .filter(|c| c.0 == new_qpn)
        .map(|c| (c.1, c.2, c.3))
        .collect();
    assert!(of_new.is_empty(), "{of_new:?}");
    let sent = rig.sent();
    assert!(
        sent.iter()
            .any(|s| s.op == Opcode::SendOnly.code() && s.psn == SQ_PSN),
        "{sent:?}"
    );
    assert_eq!(qp.state(), QpState::Rts);
    drop(qp);
}

/// What follows a carrier in the same burst comes after its riding Ack, as it would after
/// a standalone Ack line: here the rig's QP has Sends 1 and 2 out (PSNs 500, 501), and the
/// peer sends a Send carrying the Ack of 500, then, right behind it,
///
/// - an RDMA Write with a bad R_Key (the peer's application wrote to a region it no longer
///   has): the QP goes to Error, but Send 1, acknowledged before, has succeeded;
/// - an RNR Nak of PSN 500 (stale: a duplicate the peer's fault stage held, say): after
///   the Ack it is a duplicate response and dropped — no RNR wait, no RNR retry spent.
///
/// Compared with the same frames and a standalone Ack line behind the carrier.
///
/// Bug (commit 2d947be, engine/src/engine/mod.rs:489 and 1003-1040): the engine keeps a
/// riding Ack and handles it at the start of the next iteration (step 1b), so every packet
/// behind the carrier in the burst is handled before it: the fatal Write puts the QP in
/// Error first, so Send 1 — which the peer acknowledged — is flushed (`WrFlushErr`)
/// instead of succeeding; the stale RNR Nak rewinds the window and starts an RNR wait.
/// (With 78ade5f, which handled the riding Ack right after its carrier, this passes.)
#[test]

fn what_follows_a_carrier_comes_after_its_riding_ack() {
    for behind in ["fatal Write", "stale RNR Nak"] {
        let mut outcomes = vec![];
        for ride in [false, true] {
            let mut rig = Rig::new(inline_context(), Setup::default());
            rig.send(1, 8);
            rig.send(2, 8);
            rig.ctx.progress();
            assert_eq!(rig.sent().len(), 2);
            let carrier = rig.request(Opcode::SendOnly, 0, b"carrier!");
            let mut frames = carrier_and_ack(carrier, SQ_PSN, 1, ride);
            frames.push(if behind == "stale RNR Nak" {
                let rnr = Syndrome::RnrNak {
                    timer: crate::wire::aeth::RnrTimer::new(1),
                };
                ack_line_to(rig.qp.qpn(), SQ_PSN, rnr, 1)
            } else {
                let mut w = rig.request(Opcode::RdmaWriteOnly, 1, b"revoked!");
                w.data[12 + 8] ^= 0x5a; // the RETH's R_Key
                w
            });
            for f in frames {
                rig.push(&[f]);
            }
            rig.settle();
            let st = rig.ctx.stats();
            outcomes.push((
                rig.completions(),
                rig.qp.state(),
                as_packets(&rig.sent()),
                st.rnr_naks_received,
                st.retransmitted,
                st.dropped,
            ));
        }
        assert!(
            outcomes[0]
                .0
                .contains(&(WcOpcode::Send, 1, WcStatus::Success)),
            "{behind}: the standalone Ack completes Send 1: {:?}",
            outcomes[0]
        );
        assert_eq!(
            outcomes[1], outcomes[0],
            "{behind}: riding and standalone differ"
        );
    }
}

/// Malformed riding words a peer may write on an otherwise good carrier, beyond those of
/// `ride_tests` (credit codes, MSN bits, PSN bits at the top of the word), are either
/// refused with their frame or handled as the Ack they spell: never a panic, and the QP
/// stays usable.
///
/// Defended by `check_riding_ack` (AckReq and reserved byte zero, a positive Ack's
/// syndrome) and the completer's PSN window: without the first check the words with their
/// top byte set are taken (tried on a scratch copy).
#[test]
fn any_riding_word_is_refused_or_handled_without_harm() {
    let mut rig = Rig::new(inline_context(), Setup::default());
    rig.send(1, 8);
    rig.ctx.progress();
    assert_eq!(rig.sent().len(), 1);
    let mut psn = 0;
    let words = [
        0u64,
        u64::from(u32::MAX),
        0x00ff_ffff_1fff_ffff,
        0x00ff_ffff_0000_0000,
        0x0000_0000_ff00_0000,
        0x0000_0000_2000_0000,
        0x0100_0000_0000_0000,
        0x8000_0000_0000_0000,
        u64::MAX,
        0x0000_01f4_1f00_0001, // PSN 500, 31 (the invalid credit code), MSN 1
    ];
    for w in words {
        let before = rig.ctx.stats();
        let mut s = rig.request(Opcode::SendOnly, psn, b"anyword!");
        s.payload_off = w;
        s.reserved |= ACK_FLAG;
        rig.push(&[s]);
        rig.settle();
        let after = rig.ctx.stats();
        let syndrome = (w >> 24) as u8;
        let refused = w >> 56 != 0 || syndrome >> 5 != 0;
        assert_eq!(
            after.dropped > before.dropped,
            refused,
            "word {w:#018x}: dropped {} -> {}",
            before.dropped,
            after.dropped
        );
        if !refused {
            psn += 1; // the carrier was delivered
        }
        assert_eq!(rig.qp.state(), QpState::Rts, "word {w:#018x}");
    }
    let c = rig.completions();
    assert!(
        c.contains(&(WcOpcode::Send, 1, WcStatus::Success)),
        "the last word acknowledges Send 1: {c:?}"
    );
    let recvs = c.iter().filter(|c| c.0 == WcOpcode::Recv).count() as u32;
    assert_eq!(recvs, psn);
}

/// Takes `qp` to RTS towards peer QP `peer` on `link` as [`connect_to_raw_peer`] does,
/// with Local Ack Timeout `timeout` and Retry Count `retry`.
fn connect_with_retry(qp: &mut Qp, link: LinkId, peer: u32, timeout: u8, retry: u8) {
    raw_peer_to_rtr(qp, link, peer, false);
    qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(SQ_PSN)
            .timeout(timeout)
            .retry_cnt(retry)
            .rnr_retry(7)
            .max_rd_atomic(1),
    )
    .unwrap();
}

/// The transport timer of a Send expires at the very iteration that receives the peer's
/// Ack of it, riding in a request: the Ack arrived in time, so the Send succeeds and the
/// timer is stopped — as with the same Ack in a line of its own — rather than the timer
/// firing first and, its retries spent, failing the Send with `RetryExcErr` and the QP.
///
/// The test lines the carrier's iteration up with a timer check: the first expiry (one
/// retry allowed) shows which poll checked timers; every `TIMER_EVERY`-th poll of a quiet
/// engine checks them; the next check starts the retransmission's timer, a wait of a few
/// Ttr (about 1 ms each) makes it due, and the carrier arrives with the check after that.
///
/// Bug (commit 2d947be, engine/src/engine/mod.rs:489 and 423-427): the riding Ack is kept
/// for the next iteration, so step 3 of the carrier's own iteration checks the timer with
/// the Send still unacknowledged; the timer fires, the retry is spent, and the Send fails
/// with `RetryExcErr` (the QP in Error) although its Ack had arrived. (With 78ade5f, which
/// handled the riding Ack in step 2, this passes.)
#[test]

fn a_riding_ack_beats_the_timer_check_of_its_own_iteration() {
    let mut outcomes = vec![];
    for ride in [false, true] {
        let ctx = inline_context();
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(64).unwrap();
        let mut qp = ctx.create_qp(&pd, &cq, &cq, caps()).unwrap();
        let (link, mut ends, _peer_mem) = raw_peer_link(&ctx, RING, PEER, 4096);
        // Local Ack Timeout 8: Ttr about 1 ms; one retry.
        connect_with_retry(&mut qp, link, PEER, 8, 1);
        let mr = pd.alloc_mr(8192, AccessFlags::ALL).unwrap();
        for i in 0..4 {
            qp.post_recv(&RecvWr::new(100 + i, &[mr.sge(i * 64, 64).unwrap()]))
                .unwrap();
        }
        post(&mut qp, &mr, 1, 8);
        // Until the first expiry: that poll checked the timers (and sent the Send again).
        let start = std::time::Instant::now();
        while ctx.stats().timeouts == 0 {
            ctx.progress();
            assert!(
                start.elapsed().as_secs() < 5,
                "the transport timer never fired"
            );
        }
        let every = crate::engine::TIMER_EVERY;
        // The next check starts the retransmission's timer...
        for _ in 0..every {
            ctx.progress();
        }
        // ... which is due a few Ttr later (no poll meanwhile: no check either).
        let wait = std::time::Instant::now();
        while wait.elapsed() < std::time::Duration::from_millis(10) {
            std::hint::spin_loop();
        }
        // Up to the poll before the next check.
        for _ in 0..every - 1 {
            ctx.progress();
        }
        assert_eq!(ctx.stats().timeouts, 1, "no check yet");
        let carrier = request_to(qp.qpn(), Opcode::SendOnly, 0, b"in-time!", None);
        for line in carrier_and_ack(carrier, SQ_PSN, 1, ride) {
            assert!(ends.tx.push_frame(&[line]).unwrap());
        }
        for _ in 0..4 {
            ctx.progress();
        }
        let mut wc = [crate::WorkCompletion::default(); 16];
        let n = cq.poll(&mut wc);
        let c: Vec<_> = wc[..n]
            .iter()
            .map(|c| (c.opcode, c.wr_id, c.status))
            .collect();
        outcomes.push((c, qp.state()));
        drop(qp);
    }
    assert_eq!(
        outcomes[0].0,
        [
            (WcOpcode::Recv, 100, WcStatus::Success),
            (WcOpcode::Send, 1, WcStatus::Success)
        ],
        "the standalone Ack, handled before the timer check"
    );
    assert_eq!(outcomes[1], outcomes[0], "riding and standalone alike");
}

/// Review 4: an Ack held in the owed lists' first word for a QP that is destroyed (its Ack
/// leaves first), whose index a new QP on another link then takes: the stale entry (on the
/// first link) answers "listed" for the new QP, and the flush moves it to the new QP's
/// link. The new QP's Ack leaves exactly once, and the old one's exactly once, whichever
/// link is walked first.
#[test]
fn review4_a_stale_first_word_entry_whose_index_moves_to_another_link_acks_once() {
    owed_both_ways(review4_stale_first_word_once);
}

fn review4_stale_first_word_once() {
    let (mut rig, qp2) = two_qps();
    let old = qp2.qpn().get();
    // QP 2 owes an Ack, held back (QP 2 replies): the only entry, in the first word.
    rig.push(&[request_to(
        qp2.qpn(),
        Opcode::SendOnly,
        0,
        b"to-qp-2!",
        None,
    )]);
    rig.ctx.progress();
    assert!(rig.sent().is_empty(), "held back");
    drop(qp2);
    let acks: Vec<_> = rig.sent().into_iter().filter(|s| s.is_ack()).collect();
    assert_eq!(acks.len(), 1, "the destroyed QP's Ack left once: {acks:?}");
    assert_eq!(acks[0].dest, PEER2);
    // A new QP on a second link takes QP 2's index.
    let (link2, mut ends2, _arena2) = raw_peer_link(&rig.ctx, RING, PEER, 4096);
    let mut y = rig
        .ctx
        .create_qp(&rig.pd, &rig.cq, &rig.cq, caps())
        .unwrap();
    let mask = (1 << 12) - 1; // the engine's QP_INDEX_BITS
    assert_eq!(y.qpn().get() & mask, old & mask, "the index is reused");
    connect_to_raw_peer(&mut y, link2, PEER, SQ_PSN, false);
    for i in 0..4 {
        y.post_recv(&RecvWr::new(
            300 + i,
            &[rig.mr.sge(2048 + i * 64, 64).unwrap()],
        ))
        .unwrap();
    }
    rig.settle();
    let drain = |ends: &mut RawEnds| {
        let mut out = vec![PacketSlot::default(); 4 * RING];
        let mut acks = vec![];
        loop {
            let n = ends.rx.pop_burst(&mut out).unwrap();
            if n == 0 {
                break;
            }
            for s in &out[..n] {
                if s.data[0] == Opcode::Acknowledge.code() {
                    let psn = u32::from_be_bytes([0, s.data[9], s.data[10], s.data[11]]);
                    acks.push(psn);
                }
            }
        }
        acks
    };
    drain(&mut ends2);
    // Three requests to the new QP, one an iteration: each owes an Ack (the QP sent no
    // request: not held back).
    let mut acks = vec![];
    for psn in 0..3 {
        assert!(
            ends2
                .tx
                .push_frame(&[request_to(y.qpn(), Opcode::SendOnly, psn, b"to-y", None)])
                .unwrap()
        );
        rig.ctx.progress();
        acks.extend(drain(&mut ends2));
    }
    rig.settle();
    acks.extend(drain(&mut ends2));
    assert_eq!(acks, [0, 1, 2], "each request acknowledged once, in order");
    assert!(
        rig.sent().iter().all(|s| !s.is_ack()),
        "nothing more on the first link"
    );
}
