//! The riding Ack (issue 10, "The fast path", item 2): a positive Ack the QP owes rides in
//! the line of the next request with an inline or no payload it sends to the peer
//! ([`super::ride_owed_ack`]); where owed Acks are held back one iteration, an application
//! that answers at once sends no Ack line at all. A riding Ack the peer sends is handled
//! after its carrier, as a standalone Ack; a flag where no Ack may ride, or a word that is
//! not a positive Ack, makes the whole frame malformed.

use crate::raw_peer::{RawEnds, ack_line_to, connect_to_raw_peer, inline_context, raw_peer_link};
use crate::wire::aeth::{CreditCode, NakCode, RnrTimer, Syndrome};
use crate::wire::opcode::Opcode;
use crate::wire::slot::{
    ACK_FLAG, KIND_DIRECT, KIND_INLINE, PacketSlot, RxPacket, riding_ack, riding_word,
};
use crate::wire::{BthRepr, PacketRepr, RethRepr};
use crate::{Context, Cq, Mr, Pd, Qp, QpCaps, QpState, Qpn, RecvWr, SendOp, SendWr};
use crate::{WcOpcode, WorkCompletion};

const PEER: u32 = 0x2002;
const SQ_PSN: u32 = 500;
/// Lines of the link's rings.
const RING: usize = 64;

struct Rig {
    ctx: Context,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
    ends: RawEnds,
}

/// A QP connected to a raw peer, 4 receives posted, in a context with manual progress
/// (owed Acks leave at the end of their iteration) or, with `hold`, one whose owed Acks
/// are held back an iteration (as with the progress helper or in poll mode).
fn rig_with(ctx: Context, hold: bool) -> Rig {
    rig_full(ctx, hold, false)
}

/// [`rig_with`], with end-to-end credits where `credits` (the peer's Acks limit the
/// rig's Sends).
fn rig_full(ctx: Context, hold: bool, credits: bool) -> Rig {
    ctx.shared.engine.with(|e| e.hold_acks = hold);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(512).unwrap();
    let caps = QpCaps {
        max_send_wr: 128,
        max_recv_wr: 16,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    let mut qp = ctx.create_qp(&pd, &cq, &cq, caps).unwrap();
    let (id, ends, _arena) = raw_peer_link(&ctx, RING, PEER, 4096);
    connect_to_raw_peer(&mut qp, id, PEER, SQ_PSN, credits);
    let mr = pd.alloc_mr(8192, crate::AccessFlags::ALL).unwrap();
    for i in 0..4 {
        qp.post_recv(&RecvWr::new(100 + i, &[mr.sge(i * 64, 64).unwrap()]))
            .unwrap();
    }
    let mut rig = Rig {
        ctx,
        _pd: pd,
        cq,
        qp,
        mr,
        ends,
    };
    // The receives just posted may bring a credit update: out of the way.
    rig.ctx.progress();
    rig.ctx.progress();
    assert!(
        rig.sent()
            .iter()
            .all(|s| opcode_of(s) == Opcode::Acknowledge.code())
    );
    rig
}

fn rig() -> Rig {
    rig_with(inline_context(), false)
}

impl Rig {
    /// Posts a Send of `len` bytes (`id`): 8 go inline in the slot, 100 by reference.
    fn send(&mut self, id: u64, len: u32) {
        let sge = [self.mr.sge(4096, len).unwrap()];
        self.qp
            .post_send(&SendWr::new(id, SendOp::Send, &sge))
            .unwrap();
    }

    /// The frames the engine published, first lines only (every frame here is one line).
    fn sent(&mut self) -> Vec<PacketSlot> {
        let mut out = vec![PacketSlot::default(); RING];
        let mut all = vec![];
        loop {
            let n = self.ends.rx.pop_burst(&mut out).unwrap();
            if n == 0 {
                return all;
            }
            all.extend_from_slice(&out[..n]);
        }
    }

    /// Completions, in order.
    fn completions(&mut self) -> Vec<WorkCompletion> {
        let mut wc = [WorkCompletion::default(); 64];
        let n = self.cq.poll(&mut wc);
        wc[..n].to_vec()
    }

    /// Publishes one frame of one line.
    fn push(&mut self, s: PacketSlot) {
        assert!(self.ends.tx.push_frame(&[s]).unwrap());
    }
}

/// A request from the peer to the rig's QP: `op` at `psn`, `payload` inline (and the RETH
/// of an RDMA Write at offset 1024 of the rig's region).
fn request(rig: &Rig, op: Opcode, psn: u32, payload: &[u8]) -> PacketSlot {
    let mut repr = PacketRepr::new(BthRepr::new(op, rig.qp.qpn(), crate::psn::Psn::new(psn)));
    repr.bth.ack_req = true;
    if op == Opcode::RdmaWriteOnly {
        repr.reth = Some(RethRepr {
            va: rig.mr.addr() + 1024,
            rkey: rig.mr.rkey(),
            dma_len: payload.len() as u32,
        });
    }
    let mut s = PacketSlot::default();
    s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
    s.kind = KIND_INLINE;
    s.payload_len = payload.len() as u32;
    let at = s.hdr_len as usize;
    s.data[at..at + payload.len()].copy_from_slice(payload);
    s
}

/// A standalone Acknowledge to the rig's QP for `psn`, MSN `msn`, with `syndrome`.
fn ack_line(rig: &Rig, psn: u32, syndrome: Syndrome, msn: u32) -> PacketSlot {
    ack_line_to(rig.qp.qpn(), psn, syndrome, msn)
}

/// A positive Ack's syndrome (4 credits).
fn ack4() -> u8 {
    Syndrome::Ack {
        credits: CreditCode::encode(4),
    }
    .to_u8()
}

/// `s` with riding word `word` and the flag (written by hand, as a peer may).
fn with_riding(mut s: PacketSlot, word: u64) -> PacketSlot {
    s.payload_off = word;
    s.reserved |= ACK_FLAG;
    s
}

/// The opcode of a frame's first line.
fn opcode_of(s: &PacketSlot) -> u8 {
    s.data[0]
}

/// The riding word packs what a standalone Ack's last 8 header bytes say, and the line
/// rebuilt from it is that Ack: opcode, the carrier's P_Key and destination QP, the PSN,
/// the syndrome and the MSN.
#[test]
fn a_riding_word_rebuilds_the_standalone_ack() {
    let rig = rig();
    let word = riding_word(0x00ab_cdef, ack4(), 0x0012_3456);
    let carrier = with_riding(request(&rig, Opcode::SendOnly, 3, b"12345678"), word);
    let carrier_pkt = RxPacket::parse(&carrier, &[]).unwrap();
    assert_eq!(carrier_pkt.payload.len(), 8);
    let a = riding_ack(&carrier).unwrap();
    let want = ack_line(
        &rig,
        0x00ab_cdef,
        Syndrome::Ack {
            credits: CreditCode::encode(4),
        },
        0x0012_3456,
    );
    assert_eq!(a.data, want.data);
    assert_eq!(a.hdr_len, want.hdr_len);
    let pkt = RxPacket::parse(&a, &[]).unwrap();
    assert_eq!(pkt.opcode(), Opcode::Acknowledge);
    assert_eq!(pkt.bth().pkey, carrier_pkt.bth().pkey);
    assert_eq!(pkt.bth().dest_qp, rig.qp.qpn());
    // PSN and MSN are 24 bits: higher bits of the arguments do not leak into other fields.
    assert_eq!(riding_word(0xff00_0001, 0, 0xff00_0002), (1 << 32) | 2);
    // Without the flag there is no riding Ack, whatever `payload_off` holds.
    let mut plain = carrier;
    plain.reserved = 0;
    assert!(riding_ack(&plain).is_none());
}

/// The QP owes the peer an Ack (for a Send it just received) when it sends 8-byte Sends
/// that waited for room on the link: the first one carries the Ack, and no Ack leaves in a
/// line of its own (the same iteration: no holding back needed).
#[test]
fn an_owed_ack_rides_in_the_next_request_line() {
    let mut rig = rig();
    // Fill the peer's ring (it does not read): the last Sends wait in the send queue.
    for i in 0..RING as u64 + 4 {
        rig.send(i, 8);
    }
    rig.ctx.progress();
    let first = rig.sent();
    assert_eq!(first.len(), RING, "the ring holds {RING} lines");
    assert!(first.iter().all(|s| s.reserved & ACK_FLAG == 0));
    // The peer reads its ring, and sends a Send: in the same iteration the QP accepts it
    // (and owes its Ack) and sends the Sends that waited.
    let before = rig.ctx.stats();
    let s = request(&rig, Opcode::SendOnly, 0, b"peer-msg");
    rig.push(s);
    rig.ctx.progress();
    let sent = rig.sent();
    let after = rig.ctx.stats();
    assert_eq!(sent.len(), 4, "the 4 Sends that waited, no Ack line");
    assert!(
        sent.iter().all(|s| opcode_of(s) == Opcode::SendOnly.code()),
        "no standalone Ack"
    );
    assert_eq!(
        sent[0].reserved & ACK_FLAG,
        ACK_FLAG,
        "the first carries it"
    );
    assert!(sent[1..].iter().all(|s| s.reserved & ACK_FLAG == 0));
    // The Ack a standalone line would have been: PSN 0, MSN 1, to the peer's QP.
    let a = riding_ack(&sent[0]).unwrap();
    let a = RxPacket::parse(&a, &[]).unwrap();
    assert_eq!(a.opcode(), Opcode::Acknowledge);
    assert_eq!(a.psn().get(), 0);
    assert_eq!(a.bth().dest_qp, Qpn::new(PEER));
    let (_, msn) = a.positive_ack().unwrap();
    assert_eq!(msn.get(), 1);
    assert_eq!(after.acks_sent, before.acks_sent + 1);
    assert_eq!(after.acks_riding, before.acks_riding + 1);
    assert_eq!(after.packets_sent, before.packets_sent + 4);
    // Nothing is owed any more: the next iterations send nothing.
    rig.ctx.progress();
    rig.ctx.progress();
    assert!(rig.sent().is_empty());
}

/// A request whose payload travels by reference has no room for an Ack (`payload_off`
/// names the payload): the Ack leaves in a line of its own.
#[test]
fn an_owed_ack_that_cannot_ride_leaves_alone() {
    let mut rig = rig();
    for i in 0..RING as u64 + 2 {
        rig.send(i, 100);
    }
    rig.ctx.progress();
    assert_eq!(rig.sent().len(), RING);
    let s = request(&rig, Opcode::SendOnly, 0, b"peer-msg");
    rig.push(s);
    rig.ctx.progress();
    let sent = rig.sent();
    assert_eq!(sent.len(), 3, "{sent:?}");
    assert!(sent.iter().all(|s| s.reserved & ACK_FLAG == 0));
    assert_eq!(sent[0].kind, KIND_DIRECT);
    assert_eq!(opcode_of(&sent[2]), Opcode::Acknowledge.code());
    assert_eq!(rig.ctx.stats().acks_riding, 0);
}

/// Where owed Acks are held back (`hold_acks`): a QP that has sent no request yet (a
/// stream's receiver) sends its Ack at once. Once it sends requests, the Ack of a request
/// the application answers at once rides in the answer (a ping-pong sends no Ack line);
/// one it does not answer leaves alone at the end of the next iteration, and the QP stops
/// holding its Acks back until it sends a request again.
#[test]
fn a_held_ack_rides_in_the_answer_or_leaves_an_iteration_later() {
    super::ride_hostile_tests::owed_both_ways(
        a_held_ack_rides_in_the_answer_or_leaves_an_iteration_later_once,
    );
}

fn a_held_ack_rides_in_the_answer_or_leaves_an_iteration_later_once() {
    let mut held = rig_with(inline_context(), true);
    let rig = &mut held;
    let before = rig.ctx.stats();
    let ack_psn = |sent: &[PacketSlot]| {
        assert_eq!(sent.len(), 1, "{sent:?}");
        assert_eq!(opcode_of(&sent[0]), Opcode::Acknowledge.code());
        RxPacket::parse(&sent[0], &[]).unwrap().psn().get()
    };
    // A request before the QP ever sent one: its Ack leaves at once.
    rig.push(request(rig, Opcode::SendOnly, 0, b"stream-0"));
    assert_eq!(rig.completions().len(), 1);
    assert_eq!(ack_psn(&rig.sent()), 0);
    // The QP sends a request: from now on it replies.
    rig.send(1, 8);
    assert_eq!(rig.sent().len(), 1);
    // The ping: received in the iteration the application's poll of the CQ runs, which
    // returns its completion; the Ack is held.
    rig.push(request(rig, Opcode::SendOnly, 1, b"ping-one"));
    assert_eq!(rig.completions().len(), 1);
    assert!(rig.sent().is_empty(), "held back");
    // The answer carries it.
    rig.send(2, 8);
    let sent = rig.sent();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(opcode_of(&sent[0]), Opcode::SendOnly.code());
    let a = RxPacket::parse(&riding_ack(&sent[0]).unwrap(), &[])
        .unwrap()
        .psn();
    assert_eq!(a.get(), 1);
    rig.ctx.progress();
    rig.ctx.progress();
    assert!(rig.sent().is_empty(), "nothing left owed");
    // A request not answered: its Ack waits one iteration, then leaves alone.
    rig.push(request(rig, Opcode::SendOnly, 2, b"ping-two"));
    rig.ctx.progress();
    assert!(rig.sent().is_empty());
    rig.ctx.progress();
    assert_eq!(ack_psn(&rig.sent()), 2);
    // The QP stopped holding back: the next request's Ack leaves at once.
    rig.push(request(rig, Opcode::SendOnly, 3, b"stream-3"));
    rig.ctx.progress();
    assert_eq!(ack_psn(&rig.sent()), 3);
    let after = rig.ctx.stats();
    assert_eq!(after.acks_sent, before.acks_sent + 4);
    assert_eq!(after.acks_riding, before.acks_riding + 1);
    // Without holding back (manual progress), a replying QP's unanswered request's Ack
    // leaves at the end of its own iteration.
    let mut manual = self::rig();
    manual.send(1, 8);
    assert_eq!(manual.sent().len(), 1);
    manual.push(request(&manual, Opcode::SendOnly, 0, b"ping-one"));
    manual.ctx.progress();
    assert_eq!(ack_psn(&manual.sent()), 0);
}

/// With the progress helper (`Progress::Auto`), an Ack held back for a request the
/// application received and then stopped calling shmhca still leaves: the helper runs the
/// next iteration within two ticks.
#[test]
fn the_progress_helper_sends_a_held_ack_when_the_application_stops_calling() {
    let ctx = Context::builder()
        .mode(crate::EngineMode::Inline)
        .progress(crate::Progress::Auto)
        .huge_pages(shmhca_rings::segment::HugePages::Never)
        .build()
        .unwrap();
    let mut rig = rig_with(ctx, true);
    // The QP replies to what it receives (it has sent a request): its Acks are held back.
    rig.send(1, 8);
    assert_eq!(rig.sent().len(), 1);
    rig.push(request(&rig, Opcode::SendOnly, 0, b"ping-one"));
    let mut got = vec![];
    let start = std::time::Instant::now();
    while got.is_empty() {
        got = rig.completions();
        assert!(start.elapsed().as_secs() < 30, "the Send never arrived");
    }
    // The application calls nothing from now on.
    let start = std::time::Instant::now();
    let ack = loop {
        if let Some(s) = rig.ends.rx.pop().unwrap() {
            break s;
        }
        assert!(
            start.elapsed().as_secs() < 30,
            "the held Ack never left (the helper did not run the next iteration)"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    };
    assert_eq!(opcode_of(&ack), Opcode::Acknowledge.code());
    assert_eq!(RxPacket::parse(&ack, &[]).unwrap().psn().get(), 0);
}

/// The receiver handles the carrier first, then the Ack riding in it: the receive
/// completion of the peer's Send comes before the send completion its Ack causes.
#[test]
fn a_riding_ack_completes_after_its_carrier() {
    let mut rig = rig();
    rig.send(1, 8);
    rig.ctx.progress();
    assert_eq!(rig.sent().len(), 1);
    let s = request(&rig, Opcode::SendOnly, 0, b"carrier!");
    rig.push(with_riding(s, riding_word(SQ_PSN, ack4(), 1)));
    let mut got = vec![];
    for _ in 0..10 {
        rig.ctx.progress();
        got.extend(rig.completions());
    }
    let kinds: Vec<_> = got.iter().map(|c| (c.opcode, c.wr_id, c.is_ok())).collect();
    assert_eq!(
        kinds,
        [(WcOpcode::Recv, 100, true), (WcOpcode::Send, 1, true)],
        "the receive completion, then the one the riding Ack caused"
    );
    let mut b = [0u8; 8];
    rig.mr.read_at(0, &mut b).unwrap();
    assert_eq!(&b, b"carrier!");
    assert_eq!(rig.ctx.stats().dropped, 0);
}

/// Frames a peer made up: the flag on a packet that cannot carry an Ack, or a word that
/// is not a positive Ack. Each frame is malformed as a whole: dropped and counted, neither
/// the carrier nor the Ack has an effect, and the link goes on (an honest Send behind
/// them is delivered).
#[test]
fn a_frame_with_a_bad_riding_ack_is_dropped_whole() {
    let mut rig = rig();
    rig.send(1, 8);
    rig.ctx.progress();
    assert_eq!(rig.sent().len(), 1);
    let good = riding_word(SQ_PSN, ack4(), 1);
    let send = request(&rig, Opcode::SendOnly, 0, b"hostile!");
    let nak = Syndrome::Nak(NakCode::PsnSequenceError).to_u8();
    let rnr = Syndrome::RnrNak {
        timer: RnrTimer::new(1),
    }
    .to_u8();
    let mut by_reference = send;
    by_reference.kind = KIND_DIRECT;
    let mut bad = vec![
        // A payload by reference: `payload_off` names it, no Ack can be there.
        with_riding(by_reference, good),
        // A response cannot carry an Ack.
        with_riding(
            ack_line(
                &rig,
                SQ_PSN,
                Syndrome::Ack {
                    credits: CreditCode::encode(4),
                },
                1,
            ),
            good,
        ),
        // A Nak, an RNR Nak, a reserved syndrome, AckReq or reserved bits set.
        with_riding(send, riding_word(SQ_PSN, nak, 1)),
        with_riding(send, riding_word(SQ_PSN, rnr, 1)),
        with_riding(send, riding_word(SQ_PSN, 0b0100_0000, 1)),
        with_riding(send, good | 1 << 63),
        with_riding(send, good | 1 << 56),
        with_riding(send, u64::MAX),
    ];
    // A word without the flag is nothing: ignored.
    let mut unflagged = with_riding(send, good);
    unflagged.reserved = 0;
    let n_bad = bad.len() as u64;
    let before = rig.ctx.stats();
    for s in bad.drain(..) {
        rig.push(s);
        rig.ctx.progress();
    }
    let mid = rig.ctx.stats();
    assert_eq!(mid.dropped, before.dropped + n_bad, "each frame is dropped");
    assert!(
        rig.completions().is_empty(),
        "neither carrier nor Ack took effect"
    );
    assert_eq!(rig.qp.state(), QpState::Rts);
    // The link goes on: an honest Send lands, and our Send stays unacknowledged.
    rig.push(unflagged);
    for _ in 0..4 {
        rig.ctx.progress();
    }
    let c = rig.completions();
    assert_eq!(c.len(), 1, "{c:?}");
    assert_eq!((c[0].opcode, c[0].wr_id), (WcOpcode::Recv, 100));
    let mut b = [0u8; 8];
    rig.mr.read_at(0, &mut b).unwrap();
    assert_eq!(&b, b"hostile!");
}

/// A riding Ack for a PSN the QP never sent (ahead of its window) or an old one is handled
/// as the same Ack alone would be: ignored, the carrier delivered, the QP unharmed.
#[test]
fn a_riding_ack_out_of_range_is_handled_like_a_standalone_one() {
    let mut outcomes = vec![];
    for ride in [false, true] {
        let mut rig = rig();
        rig.send(1, 8);
        rig.ctx.progress();
        assert_eq!(rig.sent().len(), 1);
        for (psn, ack_psn) in [(0, SQ_PSN + 1000), (1, SQ_PSN - 3)] {
            let s = request(&rig, Opcode::SendOnly, psn, b"carrier!");
            if ride {
                rig.push(with_riding(s, riding_word(ack_psn, ack4(), 1)));
            } else {
                rig.push(s);
                let a = ack_line(
                    &rig,
                    ack_psn,
                    Syndrome::Ack {
                        credits: CreditCode::encode(4),
                    },
                    1,
                );
                rig.push(a);
            }
            for _ in 0..3 {
                rig.ctx.progress();
            }
        }
        let c: Vec<_> = rig
            .completions()
            .iter()
            .map(|c| (c.opcode, c.wr_id, c.is_ok()))
            .collect();
        outcomes.push((c, rig.qp.state(), rig.ctx.stats().dropped));
    }
    assert_eq!(outcomes[0], outcomes[1], "riding and standalone alike");
    assert_eq!(outcomes[1].1, QpState::Rts);
    assert!(
        outcomes[1]
            .0
            .iter()
            .all(|&(op, _, ok)| op == WcOpcode::Recv && ok),
        "{:?}",
        outcomes[1]
    );
}

/// The trace shows a riding Ack as the packet it stands for, right after its carrier, in
/// both directions: the packet observer and the capture file (decoded by tshark when it
/// is installed: its own RoCEv2 frame, an InfiniBand Acknowledge, nothing malformed).
#[test]
fn the_trace_shows_a_riding_ack_as_its_own_packet_after_its_carrier() {
    use std::sync::{Arc, Mutex};
    let mut rig = rig();
    let seen: Arc<Mutex<Vec<(crate::trace::Direction, Opcode)>>> = Arc::default();
    let s2 = seen.clone();
    rig.ctx
        .observe_packets(move |e| s2.lock().unwrap().push((e.direction, e.headers.bth.opcode)));
    let dir = std::env::temp_dir().join(format!("shmhca-ride-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pcap = dir.join("ride.pcap");
    rig.ctx.trace_to(&pcap).unwrap();
    for i in 0..RING as u64 + 1 {
        rig.send(i, 8);
    }
    rig.ctx.progress();
    rig.sent();
    // Received: a Send carrying an Ack of the QP's first Send.
    let s = request(&rig, Opcode::SendOnly, 0, b"carrier!");
    rig.push(with_riding(s, riding_word(SQ_PSN, ack4(), 1)));
    rig.ctx.progress();
    let sent = rig.sent();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].reserved & ACK_FLAG, ACK_FLAG);
    rig.ctx.stop_trace();
    use crate::trace::Direction::{Received, Sent};
    let seen = seen.lock().unwrap().clone();
    let tail = &seen[seen.len() - 4..];
    assert_eq!(
        tail,
        [
            (Received, Opcode::SendOnly),
            (Received, Opcode::Acknowledge),
            (Sent, Opcode::SendOnly),
            (Sent, Opcode::Acknowledge),
        ],
        "{seen:?}"
    );
    let have_tshark = std::process::Command::new("tshark")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if have_tshark {
        let out = std::process::Command::new("tshark")
            .arg("-r")
            .arg(&pcap)
            .args(["-o", "ip.check_checksum:TRUE", "-T", "fields"])
            .args(["--disable-heuristic", "rpcrdma_infiniband"])
            .args(["-e", "infiniband.bth.opcode", "-e", "infiniband.bth.psn"])
            .args(["-e", "infiniband.aeth.msn", "-e", "_ws.expert"])
            .output()
            .unwrap();
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len() - 4..];
        // Opcodes 4 (Send Only) and 17 (Acknowledge); the riding Acks' PSN and MSN.
        assert!(tail[0].starts_with("4\t0\t"), "{text}");
        assert!(tail[1].starts_with(&format!("17\t{SQ_PSN}\t1")), "{text}");
        assert!(tail[2].starts_with("4\t"), "{text}");
        assert!(tail[3].starts_with("17\t0\t1"), "{text}");
        assert!(
            !text.contains("Bad") && !text.contains("Malformed"),
            "{text}"
        );
    } else {
        eprintln!("tshark not installed: the capture's decoding is not checked");
    }
    let _ = std::fs::remove_file(&pcap);
    let _ = std::fs::remove_dir(&dir);
}

/// A held-back Ack leaves before its QP is destroyed or modified: an application that
/// destroys its QP (or moves it to Error) right after the last message's completion must
/// not leave the sender retrying into `RetryExcErr` (found by `completion_order`'s test).
#[test]
fn a_held_ack_leaves_before_its_qp_is_destroyed_or_modified() {
    super::ride_hostile_tests::owed_both_ways(
        a_held_ack_leaves_before_its_qp_is_destroyed_or_modified_once,
    );
}

fn a_held_ack_leaves_before_its_qp_is_destroyed_or_modified_once() {
    for destroy in [true, false] {
        let mut rig = rig_with(inline_context(), true);
        // The QP replies to what it receives (it has sent a request).
        rig.send(1, 8);
        assert_eq!(rig.sent().len(), 1);
        let before = rig.ctx.stats().acks_sent;
        rig.push(request(&rig, Opcode::SendOnly, 0, b"the-last"));
        assert_eq!(rig.completions().len(), 1);
        assert!(rig.sent().is_empty(), "held back");
        let Rig {
            ctx,
            mut qp,
            mut ends,
            ..
        } = rig;
        if destroy {
            drop(qp);
        } else {
            qp.modify(&crate::QpAttr::new(QpState::Error)).unwrap();
        }
        let ack = ends.rx.pop().unwrap().expect("the Ack left");
        assert_eq!(opcode_of(&ack), Opcode::Acknowledge.code());
        let pkt = RxPacket::parse(&ack, &[]).unwrap();
        assert_eq!(pkt.psn().get(), 0);
        assert!(pkt.positive_ack().is_some());
        assert_eq!(ctx.stats().acks_sent, before + 1);
    }
}

/// A riding Ack is handled in the receive step of its carrier, right after the carrier's
/// own completion (as if the Ack had followed the request in a line of its own), whether
/// or not the QP is in the active set: here the engine ran an iteration after the Send
/// left, so the QP only waits for its Ack (before, the Ack was kept for the next
/// iteration, and this iteration gave the carrier's completion alone).
#[test]
fn a_riding_ack_is_handled_right_after_its_carriers_completion() {
    let mut rig = rig();
    rig.send(1, 8);
    rig.ctx.progress();
    assert_eq!(rig.sent().len(), 1);
    let index = rig.qp.index;
    assert!(
        !rig.ctx.shared.engine.with(|e| e.is_active(index)),
        "the QP waits for its Ack"
    );
    carrier_then_its_send_in_one_poll(&mut rig);
}

/// The peer's Send Only carrying the Ack of the rig's Send 1 arrives; one poll (one
/// iteration) gives the carrier's completion, then the Send's.
fn carrier_then_its_send_in_one_poll(rig: &mut Rig) {
    let s = request(rig, Opcode::SendOnly, 0, b"carrier!");
    rig.push(with_riding(s, riding_word(SQ_PSN, ack4(), 1)));
    let got: Vec<_> = rig
        .completions()
        .iter()
        .map(|c| (c.opcode, c.wr_id, c.status))
        .collect();
    assert_eq!(
        got,
        [
            (WcOpcode::Recv, 100, crate::WcStatus::Success),
            (WcOpcode::Send, 1, crate::WcStatus::Success)
        ],
        "the carrier's completion, then the Send's, from one iteration"
    );
}

/// A QP whose answer arrives while a post holds it in the active set (it posted since the
/// last iteration, as a ping-pong's QP has: its answer went out by the direct path) has
/// the riding Ack handled in the carrier's receive step and leaves the active set there:
/// the Send completes in the carrier's iteration, and step 3 has nothing to visit (before,
/// it visited the QP only to take it out).
#[test]
fn a_posting_qp_whose_riding_ack_completes_it_leaves_the_active_set_in_the_receive_step() {
    let mut rig = rig();
    rig.send(1, 8);
    assert_eq!(rig.sent().len(), 1, "the Send left by the direct path");
    let index = rig.qp.index;
    assert!(rig.ctx.shared.engine.with(|e| e.is_active(index)));
    let visits = |rig: &Rig| {
        rig.ctx
            .shared
            .engine
            .with(|e| e.qp_mut(index).map(|q| q.visits))
            .unwrap()
    };
    let before = visits(&rig);
    carrier_then_its_send_in_one_poll(&mut rig);
    assert_eq!(visits(&rig), before, "step 3 had no turn to give the QP");
    assert!(
        !rig.ctx
            .shared
            .engine
            .with(|e| e.is_active(index) || e.is_timed(index)),
        "nothing left for step 3 or the timer"
    );
}

/// What a riding Ack says besides its PSN counts as the same Ack alone would: its credits
/// (read with its MSN) release the Sends that wait for credit, and a QP no longer in RTS
/// handles it the full way (in Error it completes nothing: the Sends are flushed).
#[test]
fn a_riding_acks_credits_and_state_count_as_a_standalone_ones() {
    for error in [false, true] {
        let mut outcomes = vec![];
        for ride in [false, true] {
            let mut rig = rig_full(inline_context(), false, true);
            // The peer reports no receive left: of the next five Sends the first goes (none
            // is outstanding), the others wait for credit.
            rig.send(1, 8);
            rig.ctx.progress();
            rig.sent();
            let none = Syndrome::Ack {
                credits: CreditCode::encode(0),
            };
            rig.push(ack_line(&rig, SQ_PSN, none, 1));
            rig.ctx.progress();
            for id in 2..=6 {
                rig.send(id, 8);
            }
            rig.ctx.progress();
            let before = rig.sent().len();
            if error {
                rig.qp.modify(&crate::QpAttr::new(QpState::Error)).unwrap();
            }
            // The peer took a receive for Send 2 (MSN 2) and reports 4 more: Sends 3 to 6.
            let s = request(&rig, Opcode::SendOnly, 0, b"carrier!");
            if ride {
                rig.push(with_riding(s, riding_word(SQ_PSN + 1, ack4(), 2)));
            } else {
                rig.push(s);
                rig.push(ack_line(
                    &rig,
                    SQ_PSN + 1,
                    Syndrome::Ack {
                        credits: CreditCode::encode(4),
                    },
                    2,
                ));
            }
            for _ in 0..4 {
                rig.ctx.progress();
            }
            let after: Vec<_> = rig.sent().iter().map(opcode_of).collect();
            let c: Vec<_> = rig
                .completions()
                .iter()
                .map(|c| (c.opcode, c.wr_id, c.status))
                .collect();
            outcomes.push((before, after, c, rig.qp.state()));
        }
        assert_eq!(
            outcomes[0], outcomes[1],
            "riding and standalone alike (error: {error})"
        );
        let (before, after, c, _) = &outcomes[1];
        if error {
            // Send 1 completed before (the peer's first Ack); 2 to 6 are flushed.
            for id in 2..=6 {
                assert!(
                    c.contains(&(WcOpcode::Send, id, crate::WcStatus::WrFlushErr)),
                    "Send {id} flushed in Error: {c:?}"
                );
            }
        } else {
            assert_eq!(*before, 1, "Sends 3 to 6 wait for credit");
            let sends = after
                .iter()
                .filter(|&&o| o == Opcode::SendOnly.code())
                .count();
            assert_eq!(
                sends, 4,
                "the credits released all four at once: {after:x?}"
            );
            assert!(
                c.contains(&(WcOpcode::Send, 2, crate::WcStatus::Success)),
                "{c:?}"
            );
        }
    }
}

/// Riding Acks kept in one burst for QPs whose slots lie in different words of the engine's
/// QP set (slots 0 and 65 of 66 QPs on one link) are each handled, for their own QP: both
/// Sends complete after their carriers, and the walk over the set's words ends.
#[test]
fn riding_acks_of_qps_in_different_words_of_the_set_are_each_handled() {
    let ctx = inline_context();
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(512).unwrap();
    let (id, mut ends, _arena) = raw_peer_link(&ctx, 256, PEER, 4096);
    let mr = pd.alloc_mr(8192, crate::AccessFlags::ALL).unwrap();
    let caps = QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    let mut qps: Vec<Qp> = (0..66)
        .map(|_| {
            let mut qp = ctx.create_qp(&pd, &cq, &cq, caps).unwrap();
            connect_to_raw_peer(&mut qp, id, PEER, SQ_PSN, false);
            qp
        })
        .collect();
    let ends_of = [0usize, 65];
    for (n, &q) in ends_of.iter().enumerate() {
        let at = 64 * n as u64;
        qps[q]
            .post_recv(&RecvWr::new(100 + q as u64, &[mr.sge(at, 64).unwrap()]))
            .unwrap();
        let sge = [mr.sge(4096, 8).unwrap()];
        qps[q]
            .post_send(&SendWr::new(q as u64, SendOp::Send, &sge))
            .unwrap();
    }
    ctx.progress();
    let mut out = vec![PacketSlot::default(); 256];
    while ends.rx.pop_burst(&mut out).unwrap() > 0 {}
    // One burst: a Send Only to each, carrying a positive Ack of its Send.
    let frames: Vec<PacketSlot> = ends_of
        .iter()
        .map(|&q| {
            let mut repr = PacketRepr::new(BthRepr::new(
                Opcode::SendOnly,
                qps[q].qpn(),
                crate::psn::Psn::new(0),
            ));
            repr.bth.ack_req = true;
            let mut s = PacketSlot::default();
            s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
            with_riding(s, riding_word(SQ_PSN, ack4(), 1))
        })
        .collect();
    assert_eq!(ends.tx.push_burst(&frames).unwrap(), frames.len());
    let mut got = vec![];
    let mut wc = [WorkCompletion::default(); 16];
    for _ in 0..10 {
        ctx.progress();
        let n = cq.poll(&mut wc);
        got.extend(wc[..n].iter().map(|c| (c.opcode, c.wr_id, c.is_ok())));
    }
    got.sort_by_key(|c| c.1);
    assert_eq!(
        got,
        [
            (WcOpcode::Send, 0, true),
            (WcOpcode::Send, 65, true),
            (WcOpcode::Recv, 100, true),
            (WcOpcode::Recv, 165, true)
        ]
    );
}

/// A second QP B on the rig's link (the rig's QP is A): A's index, the link, and B, with
/// the set-up's traffic out of the way.
fn second_qp_on_the_link(rig: &mut Rig) -> (u32, crate::link::LinkId, crate::Qp) {
    let a = rig.qp.index;
    let link = rig
        .ctx
        .shared
        .engine
        .with(|e| e.qp_mut(a).unwrap().proto.cfg.dest.unwrap().link);
    let caps = crate::QpCaps {
        max_send_wr: 128,
        max_recv_wr: 16,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    let mut b = rig.ctx.create_qp(&rig._pd, &rig.cq, &rig.cq, caps).unwrap();
    connect_to_raw_peer(&mut b, link, PEER, SQ_PSN, false);
    rig.ctx.progress();
    rig.ctx.progress();
    rig.sent();
    let _ = rig.completions();
    (a, link, b)
}

/// The peer writes an impossible consumer index in the ring the engine sends on (the
/// opener's send ring is the second; its head at byte 128 of the ring), and B's posts find
/// it broken once they need room (its Sends wait: B stays active).
fn break_send_ring_under_posts(rig: &mut Rig, b: &mut crate::Qp) {
    let ring = shmhca_rings::lines::shm_lines_bytes(RING).unwrap();
    let off = 4096 + ring.div_ceil(4096) * 4096 + 128;
    rig.ends
        .segment
        .write(off as u64, &(u64::MAX / 2).to_le_bytes())
        .unwrap();
    let sge = [rig.mr.sge(4096, 8).unwrap()];
    for i in 0..100 {
        b.post_send(&SendWr::new(1000 + i, SendOp::Send, &sge))
            .unwrap();
    }
}

/// Runs a few timer periods of iterations; whether `link` is down and QP `a`'s state.
fn after_a_while(rig: &Rig, link: crate::link::LinkId, a: u32) -> (bool, QpState) {
    for _ in 0..(4 * crate::engine::TIMER_EVERY) {
        rig.ctx.progress();
    }
    rig.ctx.shared.engine.with(|e| {
        (
            e.link_mut(link).unwrap().down.is_some(),
            e.qp_mut(a).unwrap().proto.state,
        )
    })
}

/// Review 3 (issue 27): a QP that posted (active, not rung) and whose riding Ack then
/// completes it leaves the active set in the receive step. If the peer broke the link's
/// send ring meanwhile (seen by another QP's post: `link.down` not set yet), step 3's visit
/// of that other QP took the link down without waking the link's QPs, and step 5 saw the
/// link down already: the QP that left the active set in the receive step was never told.
/// Before the receive step took it out it had its turn in step 3 and went to the Error
/// state there (its receives flushed). Whatever the order, every QP of a link that goes
/// down must learn it.
#[test]
fn a_qp_whose_riding_ack_completes_it_learns_of_a_send_ring_broken_meanwhile() {
    let mut rig = rig();
    let (a, link, mut b) = second_qp_on_the_link(&mut rig);
    // A's Send leaves by the direct path: A is active (a post), not rung.
    rig.send(1, 8);
    assert_eq!(rig.sent().len(), 1);
    assert!(rig.ctx.shared.engine.with(|e| e.is_active(a)));
    break_send_ring_under_posts(&mut rig, &mut b);
    assert!(
        rig.ctx
            .shared
            .engine
            .with(|e| e.link_mut(link).unwrap().tx.broken().is_some()),
        "the ring is broken, seen by B's posts"
    );
    // A's answer, whose riding Ack completes A's Send.
    let s = request(&rig, Opcode::SendOnly, 0, b"carrier!");
    rig.push(with_riding(s, riding_word(SQ_PSN, ack4(), 1)));
    let (down, state) = after_a_while(&rig, link, a);
    assert!(down, "the link is down");
    assert_eq!(state, QpState::Error, "A learned that its link went down");
}

/// Review 3 (the gap behind the test above, older than issue 27): a QP that is in no set
/// (idle, receives posted) was not told that its link went down when the engine found the
/// send ring broken in another QP's step-3 visit: that visit set `link.down` without
/// waking the link's QPs, and step 5 woke them only for a link not down yet.
#[test]
fn an_idle_qp_learns_of_a_send_ring_broken_by_another_qps_post() {
    let mut rig = rig();
    let (a, link, mut b) = second_qp_on_the_link(&mut rig);
    assert!(
        rig.ctx
            .shared
            .engine
            .with(|e| !e.is_active(a) && !e.is_timed(a))
    );
    break_send_ring_under_posts(&mut rig, &mut b);
    let (down, state) = after_a_while(&rig, link, a);
    assert!(down, "the link is down");
    assert_eq!(
        state,
        QpState::Error,
        "the idle QP learned that its link went down"
    );
}
