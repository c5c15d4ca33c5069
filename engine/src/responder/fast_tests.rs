//! The fast paths (issue 10, "short paths for the common case") against the slow paths
//! they shortcut: each scenario runs twice on the rig of [`super::tests`] — once with the
//! fast paths on, once with them off ([`crate::probe::set_enabled`]) — and must leave the same
//! answers on the wire (opcode, PSN, AETH with its MSN and credits), the same completions,
//! the same statistics, the same memory and the same responder and requester state. The
//! probe's counters show which path each packet took: the common case takes the fast path,
//! the unusual ones (duplicate, out of sequence, no receive WQE, bad R_Key, QP in error, a
//! multi-packet message in progress, a Nak, a Read outstanding) go to the slow path.

use super::tests::{RQ_PSN, Rig, rig_in};
use crate::probe::Path;
use crate::psn::Psn;
use crate::wire::aeth::{AethRepr, CreditCode, NakCode, RnrTimer, Syndrome};
use crate::wire::opcode::Opcode;
use crate::wire::slot::PacketSlot;
use crate::wire::{BthRepr, IethRepr, ImmDtRepr, Msn, PacketRepr};
use crate::{AccessFlags, QpAttr, QpState, RecvWr, SendOp, SendWr, Stats, WorkCompletion};

/// A packet the engine sent: opcode, PSN (absolute), AETH.
pub(super) type Sent = (Opcode, u32, Option<AethRepr>);

/// The rest of a packet the engine sent: its original value (an Atomic Acknowledge), pad
/// count, kind, payload length, payload offset (by reference) and inline payload bytes.
pub(super) type Body = (Option<u64>, u8, u8, u32, u64, Vec<u8>);

/// A packet's flags and the Ack riding in it, if any (its riding word).
pub(super) type Riding = (u8, Option<u64>);

/// What a scenario left behind.
#[derive(Debug, PartialEq)]
pub(super) struct Outcome {
    pub(super) sent: Vec<Sent>,
    /// What each packet sent carried besides its headers: its whole slot but the header
    /// bytes (payload bytes inline, or the arena range it names, and the pad count) and an
    /// Atomic Acknowledge's original value.
    pub(super) bodies: Vec<Body>,
    /// Each packet's flags and the Ack riding in it.
    pub(super) riding: Vec<Riding>,
    /// Each request packet's header bytes, whole (what `sent` parses of them, and the
    /// rest: a RETH's address, key and length, immediate data, an AtomicETH's operands),
    /// the address relative to the rig's region.
    pub(super) headers: Vec<Vec<u8>>,
    pub(super) completions: Vec<WorkCompletion>,
    pub(super) stats: Stats,
    pub(super) state: QpState,
    /// The responder's state, as `Debug` prints it.
    pub(super) resp: String,
    /// The requester's state: its window's counters and PSNs, credits, retry counts (the
    /// WQEs themselves hold addresses that differ between two rigs).
    pub(super) req: String,
    pub(super) memory: Memory,
    /// The rig's region's in-flight count ([`crate::Mr::in_flight`]): each WQE retired
    /// must have given back what it held.
    pub(super) in_flight: u32,
    /// The context's async events not taken by the scenario, as `Debug` prints them (a
    /// straight step that skipped Communication Established passed every scenario before:
    /// review 12).
    pub(super) events: Vec<String>,
    /// Whether the QP is in the engine's active set and in its timed set (a straight step
    /// that left a QP waiting for its RNR timer out of the timed set passed every scenario
    /// that compared the end state alone: review 14).
    pub(super) sets: (bool, bool),
}

/// The rig's region, compared in full, printed in short.
#[derive(PartialEq)]
pub(super) struct Memory(pub(super) Vec<u8>);

impl std::fmt::Debug for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let used: Vec<_> = self.0.iter().enumerate().filter(|b| *b.1 != 0).collect();
        write!(f, "{} bytes, non-zero at {used:?}", self.0.len())
    }
}

/// How many times each fast path was taken, in the order of [`Path`] (receive, Ack,
/// credits, Read Response, Atomic Acknowledge, Read Request, Atomic).
pub(super) type Taken = [u64; crate::probe::PATHS];

/// Runs `scenario` on a fresh rig with the fast paths on or off; returns what it left and
/// how many times each fast path was taken.
pub(super) fn run(
    fast: bool,
    access: AccessFlags,
    scenario: &dyn Fn(&mut Rig),
) -> (Outcome, Taken) {
    run_in(fast, access, QpState::Rts, scenario)
}

/// [`run`] on a rig whose QP is in `state` (RTR or RTS) to start with.
pub(super) fn run_in(
    fast: bool,
    access: AccessFlags,
    state: QpState,
    scenario: &dyn Fn(&mut Rig),
) -> (Outcome, Taken) {
    crate::probe::set_enabled(fast);
    let mut r = rig_in(access, state);
    let before = crate::probe::all_taken();
    scenario(&mut r);
    r.step();
    let after = crate::probe::all_taken();
    let taken: Taken = std::array::from_fn(|i| after[i] - before[i]);
    crate::probe::set_enabled(true);
    let (sent, bodies, riding, headers) = sent_with_bodies(&mut r);
    let mut completions = vec![];
    loop {
        let got = r.completions();
        if got.is_empty() {
            break;
        }
        completions.extend(got);
    }
    let qpn = r.qp.qpn();
    let (resp, req) = r.ctx.shared.engine.with(|e| {
        e.with_stage(qpn, |q, _| {
            // No burst is being received: the early answers' resources are free, as the
            // pipeline's would be once it sent their responses.
            q.proto.resp.settle_all();
            let (w, req) = (q.proto.req.window(), &q.proto.req);
            let counters = (w.retired(), w.started(), w.fetched(), w.npsn(), w.acked());
            let (retrying, retry_left, rnr_left) = req.retry_state();
            let rest = (req.rd_atomic(), req.credits(), req.limited(), retrying);
            let retries = (
                retry_left,
                rnr_left,
                req.timer().armed(),
                req.rnr_timer().armed(),
            );
            let req = format!("{counters:?} {rest:?} {retries:?}");
            (format!("{:?}", q.proto.resp), req)
        })
        .unwrap()
    });
    let mut memory = vec![0; 8192];
    r.mr.read_at(0, &mut memory).unwrap();
    let index = r.qp.index;
    let sets = r
        .ctx
        .shared
        .engine
        .with(|e| (e.is_active(index), e.is_timed(index)));
    let mut events = vec![];
    while let Some(e) = r.ctx.try_get_async_event() {
        events.push(format!("{e:?}"));
    }
    let outcome = Outcome {
        sent,
        bodies,
        riding,
        headers,
        completions,
        stats: r.ctx.stats(),
        state: r.qp.state(),
        resp,
        req,
        memory: Memory(memory),
        in_flight: r.mr.in_flight(),
        events,
        sets,
    };
    (outcome, taken)
}

/// Runs `scenario` through the fast paths and through the slow paths, checks that both
/// leave the same outcome, and returns it with the fast paths' counts.
pub(super) fn same_both_ways(access: AccessFlags, scenario: &dyn Fn(&mut Rig)) -> (Outcome, Taken) {
    let (slow, none) = run(false, access, scenario);
    assert_eq!(none, [0; crate::probe::PATHS], "the fast paths are off");
    let (fast, taken) = run(true, access, scenario);
    assert_eq!(
        fast, slow,
        "the fast paths must leave what the slow paths leave"
    );
    (fast, taken)
}

/// Every packet the engine sent since the last look (single-slot packets: Acks, Naks,
/// Read responses, requests without gather lists), what each carried, the Ack riding in
/// it, and the header bytes of the requests.
fn sent_with_bodies(r: &mut Rig) -> (Vec<Sent>, Vec<Body>, Vec<Riding>, Vec<Vec<u8>>) {
    let (mut out, mut bodies, mut riding, mut headers) = (vec![], vec![], vec![], vec![]);
    let base = r.mr.remote(0).addr;
    let mut buf = [PacketSlot::default(); 64];
    loop {
        let n = r.rx.pop_burst(&mut buf).unwrap();
        if n == 0 {
            return (out, bodies, riding, headers);
        }
        for s in &buf[..n] {
            let ack = (s.reserved & crate::wire::slot::ACK_FLAG != 0).then_some(s.payload_off);
            riding.push((s.reserved, ack));
            let hdr = usize::from(s.hdr_len);
            let (repr, _) = PacketRepr::parse(&s.data[..hdr]).unwrap();
            if repr.aeth.is_none() {
                // A RETH's or AtomicETH's address (right after the BTH) relative to the
                // rig's region, whose address differs between two rigs.
                let mut h = s.data[..hdr].to_vec();
                if repr.reth.is_some() || repr.atomic_eth.is_some() {
                    let va = u64::from_be_bytes(h[12..20].try_into().unwrap());
                    h[12..20].copy_from_slice(&va.wrapping_sub(base).to_be_bytes());
                }
                headers.push(h);
            }
            out.push((repr.bth.opcode, repr.bth.psn.get(), repr.aeth));
            let inline = if s.kind == crate::wire::slot::KIND_INLINE {
                s.data[hdr..hdr + s.payload_len as usize].to_vec()
            } else {
                vec![]
            };
            let direct = if s.kind == crate::wire::slot::KIND_DIRECT {
                s.payload_off
            } else {
                0
            };
            let orig = repr.atomic_ack_eth.map(|a| a.orig);
            let pad = repr.bth.pad_count;
            bodies.push((orig, pad, s.kind, s.payload_len, direct, inline));
        }
    }
}

/// An RDMA Write Only with Immediate at PSN `k` (relative to the rig's start) through
/// `reth`, carrying immediate `value` and `payload` inline.
fn write_imm(r: &mut Rig, k: u32, reth: crate::wire::RethRepr, value: u32, payload: &[u8]) {
    r.request(
        Opcode::RdmaWriteOnlyWithImmediate,
        k,
        |p| {
            p.reth = Some(reth);
            p.immdt = imm(value);
        },
        payload,
    );
}

/// Publishes request `op` at PSN offset `k` from [`RQ_PSN`] with `len` bytes of payload
/// from the peer's arena (more than a slot holds inline).
pub(super) fn request_direct(r: &mut Rig, op: Opcode, k: u32, len: u32) {
    request_direct_with(r, op, k, len, |_| {});
}

/// [`request_direct`], `f` adding headers.
pub(super) fn request_direct_with(
    r: &mut Rig,
    op: Opcode,
    k: u32,
    len: u32,
    f: impl FnOnce(&mut PacketRepr),
) {
    let psn = Psn::new(rq(k));
    let mut repr = PacketRepr::new(BthRepr::new(op, r.qp.qpn(), psn));
    f(&mut repr);
    let mut s = PacketSlot::default();
    s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
    s.kind = crate::wire::slot::KIND_DIRECT;
    s.payload_off = 0;
    s.payload_len = len;
    assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
}

fn imm(v: u32) -> Option<ImmDtRepr> {
    Some(ImmDtRepr { imm: v })
}

/// The PSN offset `k` from the responder's first expected PSN, absolute.
pub(super) fn rq(k: u32) -> u32 {
    Psn::new(RQ_PSN).add(k).get()
}

/// The answer expected for the last request accepted at offset `k` with MSN `msn`.
fn ack(k: u32, msn: u32, credits: u32) -> Sent {
    (
        Opcode::Acknowledge,
        rq(k),
        Some(AethRepr {
            syndrome: Syndrome::Ack {
                credits: CreditCode::encode(credits),
            },
            msn: Msn::new(msn),
        }),
    )
}

// --- The receive fast path ---

/// A Send Only, a Send Only with Immediate, an RDMA Write Only and a Write Only with
/// Immediate, each at ePSN: all four take the fast path, with the pipeline's completions,
/// Ack (PSN, MSN, credits), statistics and memory.
#[test]
fn sends_and_writes_only_at_epsn_take_the_receive_fast_path() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.post_recv(4);
        r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
        r.request(
            Opcode::SendOnlyWithImmediate,
            1,
            |p| p.immdt = imm(9),
            b"efgh",
        );
        let reth = r.reth(4096, 4);
        r.request(Opcode::RdmaWriteOnly, 2, |p| p.reth = Some(reth), b"wxyz");
        let reth = r.reth(6000, 3);
        write_imm(r, 3, reth, 7, b"123");
        r.step();
    });
    assert_eq!(taken[0], 4, "every packet took the fast path");
    assert_eq!(
        taken[Path::SendOnlyParse as usize],
        1,
        "the Send Only took the parse's shortcut"
    );
    assert_eq!(out.sent, [ack(3, 4, 1)], "one Ack, after the completions");
    assert_eq!(out.completions.len(), 3);
    assert_eq!(out.completions[1].imm_data, Some(9));
    assert_eq!(out.completions[2].byte_len, 3);
    assert_eq!(&out.memory.0[..4], b"abcd");
    assert_eq!(&out.memory.0[512..516], b"efgh");
    assert_eq!(&out.memory.0[4096..4100], b"wxyz");
    assert_eq!(&out.memory.0[6000..6003], b"123");
    assert_eq!(out.stats.payload_bytes_copied, 15);
}

/// A duplicate Send is answered by the pipeline (an Ack again, nothing executed twice).
#[test]
fn a_duplicate_goes_to_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.post_recv(2);
        r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
        r.step();
        r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
        r.step();
    });
    assert_eq!(taken[0], 1, "only the first copy");
    assert_eq!(out.completions.len(), 1);
    assert_eq!(out.sent, [ack(0, 1, 1), ack(0, 1, 1)]);
}

/// Out of sequence: the packet ahead of ePSN gets its Nak from the pipeline, and the packet
/// at ePSN that ends the Nak's wait goes through it too; the one after it is fast again.
#[test]
fn out_of_sequence_and_the_nak_it_leaves_go_to_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.post_recv(4);
        r.request(Opcode::SendOnly, 2, |_| {}, b"late");
        r.step();
        r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
        r.request(Opcode::SendOnly, 1, |_| {}, b"efgh");
        r.step();
    });
    assert_eq!(
        taken[0], 1,
        "only the Send after the one that ended the Nak's wait"
    );
    assert_eq!(
        out.sent[0].2.unwrap().syndrome,
        Syndrome::Nak(NakCode::PsnSequenceError)
    );
    assert_eq!(out.completions.len(), 2);
}

/// No receive WQE: the pipeline's RNR Nak.
#[test]
fn no_receive_wqe_goes_to_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
        r.step();
    });
    assert_eq!(taken[0], 0);
    assert!(matches!(
        out.sent[0].2.unwrap().syndrome,
        Syndrome::RnrNak { timer } if timer == RnrTimer::new(1)
    ));
}

/// Sends `sends` 4-byte Sends at PSN offsets 0.. in two steps of 32 receives each: the
/// first 64 fill the shared 64-entry CQ with receive completions; any beyond find it full.
fn fill_receive_cq(r: &mut Rig, sends: u32) {
    for (first, end) in [(0, 32), (32, sends)] {
        r.post_recv(32);
        for k in first..end {
            r.request(Opcode::SendOnly, k, |_| {}, b"abcd");
        }
        r.step();
    }
}

/// A receive CQ without room: the pipeline's RNR Nak (the first 64 Sends filled it).
#[test]
fn a_full_receive_cq_goes_to_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        fill_receive_cq(r, 65);
    });
    assert_eq!(taken[0], 64, "every Send the CQ had room for");
    assert!(matches!(
        out.sent.last().unwrap().2.unwrap().syndrome,
        Syndrome::RnrNak { .. }
    ));
    assert_eq!(out.completions.len(), 64);
}

/// A bad R_Key, a Write on a QP without remote write, and a Write whose payload is not its
/// RETH's length: the pipeline's Naks.
#[test]
fn refused_writes_go_to_the_pipeline() {
    let bad_key = |r: &mut Rig| {
        let mut reth = r.reth(0, 4);
        reth.rkey ^= 0xFFFF_0000;
        r.request(Opcode::RdmaWriteOnly, 0, |p| p.reth = Some(reth), b"abcd");
        r.step();
    };
    let (out, taken) = same_both_ways(AccessFlags::ALL, &bad_key);
    assert_eq!(taken[0], 0);
    assert_eq!(
        out.sent[0].2.unwrap().syndrome,
        Syndrome::Nak(NakCode::RemoteAccessError)
    );
    assert_eq!(out.state, QpState::Error);
    let (_, taken) = same_both_ways(AccessFlags::REMOTE_READ, &|r| {
        let reth = r.reth(0, 4);
        r.request(Opcode::RdmaWriteOnly, 0, |p| p.reth = Some(reth), b"abcd");
    });
    assert_eq!(taken[0], 0, "remote write not enabled");
    let (_, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.post_recv(1);
        let reth = r.reth(0, 8);
        write_imm(r, 0, reth, 1, b"abcd");
    });
    assert_eq!(taken[0], 0, "payload shorter than the RETH's length");
}

/// A QP in the Error state receives nothing.
#[test]
fn a_qp_in_error_goes_to_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.post_recv(1);
        r.qp.modify(&QpAttr::new(QpState::Error)).unwrap();
        r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
        r.step();
    });
    assert_eq!(taken[0], 0);
    assert_eq!(out.state, QpState::Error);
    // A receive posted in the Error state is there when the packet arrives (it is
    // flushed after the packets of the iteration): still not received.
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.qp.modify(&QpAttr::new(QpState::Error)).unwrap();
        r.step();
        let sge = [r.mr.sge(0, 64).unwrap()];
        r.qp.post_recv(&RecvWr::new(9, &sge)).unwrap();
        r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
        r.step();
    });
    assert_eq!(taken[0], 0);
    assert_eq!(out.completions.len(), 1);
    assert_eq!(out.completions[0].status, crate::WcStatus::WrFlushErr);
    assert_eq!(&out.memory.0[..4], &[0; 4]);
}

/// A Send Only and a Write Only of exactly a PMTU take the fast path; one byte more is
/// the pipeline's (an Invalid Request Nak).
#[test]
fn a_pmtu_is_the_most_a_fast_path_packet_carries() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.post_recv(1);
        request_direct(r, Opcode::SendOnly, 0, 256);
        let reth = r.reth(4096, 256);
        request_direct_with(r, Opcode::RdmaWriteOnly, 1, 256, |p| p.reth = Some(reth));
        r.step();
    });
    assert_eq!(taken[0], 2);
    assert_eq!(out.sent, [ack(1, 2, 0)]);
    for op in [Opcode::SendOnly, Opcode::RdmaWriteOnly] {
        let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
            r.post_recv(1);
            let reth = r.reth(4096, 257);
            request_direct_with(r, op, 0, 257, |p| {
                if op == Opcode::RdmaWriteOnly {
                    p.reth = Some(reth);
                }
            });
            r.step();
        });
        assert_eq!(taken[0], 0, "{op:?} of 257 bytes");
        assert_eq!(
            out.sent[0].2.unwrap().syndrome,
            Syndrome::Nak(NakCode::InvalidRequest)
        );
    }
}

/// A Send Only with Invalidate goes to the pipeline (it invalidates a key first: here one
/// that names no window, so the pipeline refuses it).
#[test]
fn a_send_with_invalidate_goes_to_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.post_recv(1);
        r.request(
            Opcode::SendOnlyWithInvalidate,
            0,
            |p| p.ieth = Some(IethRepr { rkey: 0x1234_5678 }),
            b"abcd",
        );
        r.step();
    });
    assert_eq!(taken[0], 0);
    assert_eq!(out.state, QpState::Error);
}

/// A multi-packet Send in progress: a Send Only or a Write Only in its middle is out of
/// sequence (the pipeline's fatal Nak), and its Last packet is no fast-path packet.
#[test]
fn a_multi_packet_message_in_progress_goes_to_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.post_recv(1);
        request_direct(r, Opcode::SendFirst, 0, 256);
        r.request(Opcode::SendOnly, 1, |_| {}, b"abcd");
        r.step();
    });
    assert_eq!(taken[0], 0);
    assert_eq!(
        out.sent.last().unwrap().2.unwrap().syndrome,
        Syndrome::Nak(NakCode::InvalidRequest)
    );
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.post_recv(2);
        request_direct(r, Opcode::SendFirst, 0, 256);
        r.request(Opcode::SendLast, 1, |_| {}, b"abcd");
        r.request(Opcode::SendOnly, 2, |_| {}, b"efgh");
        r.step();
    });
    assert_eq!(taken[0], 1, "the Send Only after the message");
    assert_eq!(out.completions[0].byte_len, 260);
}

/// A Send longer than its receive WQE takes the fast path up to the copy, and fails as the
/// pipeline fails it: Invalid Request Nak, the WQE completing in error, the QP in Error.
#[test]
fn a_send_too_long_for_its_wqe_fails_as_in_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        let sge = [r.mr.sge(0, 2).unwrap()];
        r.qp.post_recv(&RecvWr::new(5, &sge)).unwrap();
        r.step();
        r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
        r.step();
    });
    assert_eq!(taken[0], 1);
    assert_eq!(out.state, QpState::Error);
    assert_eq!(out.completions[0].wr_id, 5);
    assert_ne!(out.completions[0].status, crate::WcStatus::Success);
}

/// The Send Only the parse knows (`RxPacket::parse_send_only`: one line, payload inline)
/// into receive WQEs its straight copy does not take: one with no scatter list (too short:
/// the pipeline's Invalid Request Nak, the WQE in error); and WQEs whose region — in the
/// arena, or a registered buffer — was deregistered after `post_recv` (the region lives on
/// while the WQE holds it: the Send completes into it, as in the pipeline).
#[test]
fn sends_into_no_buffer_or_a_deregistered_region_are_received_as_in_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.qp.post_recv(&RecvWr::new(5, &[])).unwrap();
        r.step();
        r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
        r.step();
    });
    assert_eq!(taken[0], 1);
    assert_eq!(taken[Path::SendOnlyParse as usize], 1);
    assert_eq!(out.state, QpState::Error);
    assert_eq!(
        statuses(&out),
        [(5, crate::WcStatus::LocLenErr)],
        "the WQE completes as too short"
    );

    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        let arena = r.pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
        let user = r.pd.reg_mr(vec![0u8; 4096], AccessFlags::ALL).unwrap();
        for (i, mr) in [&arena, &*user].into_iter().enumerate() {
            let sge = [mr.sge(8, 16).unwrap()];
            r.qp.post_recv(&RecvWr::new(i as u64, &sge)).unwrap();
        }
        drop(arena);
        drop(user);
        r.step();
        r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
        r.request(Opcode::SendOnly, 1, |_| {}, b"efghijklmnop");
        r.step();
    });
    assert_eq!(taken[0], 2);
    assert_eq!(taken[Path::SendOnlyParse as usize], 2);
    assert_eq!(out.state, QpState::Rts);
    assert_eq!(
        statuses(&out),
        [(0, crate::WcStatus::Success), (1, crate::WcStatus::Success)]
    );
    assert_eq!(out.stats.payload_bytes_copied, 16);
}

/// [`same_both_ways`] of a scenario that also returns bytes of memory outside the rig's
/// region (a registered buffer, another region): they must be the same both ways too.
fn same_both_ways_with(
    access: AccessFlags,
    scenario: &dyn Fn(&mut Rig) -> Vec<u8>,
) -> (Outcome, Taken, Vec<u8>) {
    let seen = std::cell::RefCell::new(vec![]);
    let (out, taken) = same_both_ways(access, &|r| {
        let bytes = scenario(r);
        seen.borrow_mut().push(bytes);
    });
    let mut seen = seen.into_inner();
    assert_eq!(seen.len(), 2);
    let fast = seen.pop().unwrap();
    assert_eq!(
        fast, seen[0],
        "the fast paths must leave the memory the slow paths leave"
    );
    (out, taken, fast)
}

/// Sends into receive WQEs of one range in a registered buffer ([`crate::Pd::reg_mr`]) and in
/// an arena region (item 7: resolved when posted) land where the pipeline puts them: at the
/// element's offset in the buffer itself (not its shadow in the arena), nothing around them
/// touched; the fitting ones on the fast path.
#[test]
fn sends_into_registered_buffers_land_as_in_the_pipeline() {
    let (out, taken, bytes) = same_both_ways_with(AccessFlags::ALL, &|r| {
        let user =
            r.pd.reg_mr(vec![0u8; 256], AccessFlags::LOCAL_WRITE)
                .unwrap();
        let sges = [user.sge(8, 16).unwrap(), user.sge(100, 4).unwrap()];
        for (i, sge) in sges.iter().enumerate() {
            r.qp.post_recv(&RecvWr::new(i as u64, std::slice::from_ref(sge)))
                .unwrap();
        }
        let arena = [r.mr.sge(40, 12).unwrap()];
        r.qp.post_recv(&RecvWr::new(2, &arena)).unwrap();
        r.step();
        r.request(Opcode::SendOnly, 0, |_| {}, b"abcdefghijkl");
        r.request(Opcode::SendOnly, 1, |_| {}, b"wxyz");
        r.request(Opcode::SendOnly, 2, |_| {}, b"ABCDEFGHIJKL");
        r.step();
        let mut b = vec![0u8; 256];
        user.read_at(0, &mut b).unwrap();
        // The shadow (the arena block a peer reads) is not where a receive lands.
        b.push(u8::from(user.in_flight() == 0));
        b
    });
    assert_eq!(taken[0], 3);
    assert_eq!(taken[Path::SendOnlyParse as usize], 3);
    assert_eq!(
        statuses(&out),
        [
            (0, crate::WcStatus::Success),
            (1, crate::WcStatus::Success),
            (2, crate::WcStatus::Success)
        ]
    );
    let mut want = vec![0u8; 256];
    want[8..20].copy_from_slice(b"abcdefghijkl");
    want[100..104].copy_from_slice(b"wxyz");
    want.push(1);
    assert_eq!(bytes, want);
    assert_eq!(&out.memory.0[40..52], b"ABCDEFGHIJKL");
    assert_eq!(out.stats.payload_bytes_copied, 28);
}

/// A Send longer than a receive WQE whose region — a registered buffer, or an arena region —
/// was deregistered after `post_recv`: the pipeline's Invalid Request Nak and length error,
/// nothing copied, the QP in Error, both ways.
#[test]
fn a_send_too_long_for_a_deregistered_regions_wqe_fails_as_in_the_pipeline() {
    for user in [true, false] {
        let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
            let buf =
                r.pd.reg_mr(vec![0u8; 64], AccessFlags::LOCAL_WRITE)
                    .unwrap();
            let arena = r.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
            let mr: &crate::Mr = if user { &buf } else { &arena };
            r.qp.post_recv(&RecvWr::new(9, &[mr.sge(8, 2).unwrap()]))
                .unwrap();
            drop(buf);
            drop(arena);
            r.step();
            r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
            r.step();
        });
        assert_eq!(taken[0], 1, "registered buffer: {user}");
        assert_eq!(out.state, QpState::Error);
        assert_eq!(statuses(&out), [(9, crate::WcStatus::LocLenErr)]);
        assert_eq!(out.stats.payload_bytes_copied, 0);
    }
}

/// A region deregistered after `post_recv` and a new one registered before the Send
/// arrives: the Send lands in the old region (which the WQE keeps alive), never in the new
/// one, as in the pipeline.
#[test]
fn a_region_registered_after_a_deregistration_is_not_written_by_the_old_wqe() {
    for user in [true, false] {
        let (out, taken, bytes) = same_both_ways_with(AccessFlags::ALL, &|r| {
            let old: Box<dyn std::ops::Deref<Target = crate::Mr>> = if user {
                Box::new(
                    r.pd.reg_mr(vec![0u8; 64], AccessFlags::LOCAL_WRITE)
                        .unwrap(),
                )
            } else {
                Box::new(Box::new(
                    r.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap(),
                ))
            };
            r.qp.post_recv(&RecvWr::new(3, &[old.sge(8, 16).unwrap()]))
                .unwrap();
            drop(old);
            let new =
                r.pd.reg_mr(vec![0u8; 64], AccessFlags::LOCAL_WRITE)
                    .unwrap();
            let new_arena = r.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
            r.step();
            r.request(Opcode::SendOnly, 0, |_| {}, b"stale?");
            r.step();
            let mut b = vec![0u8; 128];
            new.read_at(0, &mut b[..64]).unwrap();
            new_arena.read_at(0, &mut b[64..]).unwrap();
            b
        });
        assert_eq!(taken[0], 1, "registered buffer: {user}");
        assert_eq!(out.state, QpState::Rts);
        assert_eq!(statuses(&out), [(3, crate::WcStatus::Success)]);
        assert_eq!(out.stats.payload_bytes_copied, 6);
        assert_eq!(bytes, vec![0u8; 128], "the new regions are untouched");
    }
}

// --- The receive fast paths of RDMA Reads and Atomics ---

/// An RDMA Read Request at PSN offset `k` of `len` bytes at offset `at` of the rig's
/// region.
pub(super) fn read_request(r: &mut Rig, k: u32, at: u64, len: u32) {
    let reth = r.reth(at, len);
    r.request(Opcode::RdmaReadRequest, k, |p| p.reth = Some(reth), b"");
}

/// An Atomic (`op`) at PSN offset `k` on the word at offset `at` of the rig's region.
pub(super) fn atomic_request(
    r: &mut Rig,
    op: Opcode,
    k: u32,
    at: u64,
    (swap_add, compare): (u64, u64),
) {
    let reth = r.reth(at, 8);
    r.request(
        op,
        k,
        |p| {
            p.atomic_eth = Some(crate::wire::AtomicEthRepr {
                va: reth.va,
                rkey: reth.rkey,
                swap_add,
                compare,
            })
        },
        b"",
    );
}

/// Reads of one response (0, 8, 24 bytes inline, 25 and 256 bytes by reference), a Fetch
/// and Add and a Compare and Swap, each at ePSN, one per iteration: each takes its fast
/// path, with the pipeline's responses (opcode, PSN, AETH with MSN and credits, data,
/// original value), memory, statistics and responder state.
#[test]
fn reads_and_atomics_at_epsn_take_the_receive_fast_paths() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.mr.write_at(4096, &(0..=255).collect::<Vec<u8>>())
            .unwrap();
        r.mr.write_at(8192 - 8, &7u64.to_ne_bytes()).unwrap();
        let mut k = 0;
        for len in [0, 8, 24, 25, 256] {
            read_request(r, k, 4096, len);
            r.step();
            k += 1;
        }
        atomic_request(r, Opcode::FetchAdd, k, 8192 - 8, (5, 0));
        r.step();
        atomic_request(r, Opcode::CompareSwap, k + 1, 8192 - 8, (99, 12));
        r.step();
        atomic_request(r, Opcode::CompareSwap, k + 2, 8192 - 8, (98, 99));
        r.step();
    });
    assert_eq!(taken[Path::Read as usize], 5);
    assert_eq!(taken[Path::Atomic as usize], 3);
    let ops: Vec<_> = out.sent.iter().map(|s| s.0).collect();
    use Opcode::*;
    assert_eq!(
        ops,
        [
            RdmaReadResponseOnly,
            RdmaReadResponseOnly,
            RdmaReadResponseOnly,
            RdmaReadResponseOnly,
            RdmaReadResponseOnly,
            AtomicAcknowledge,
            AtomicAcknowledge,
            AtomicAcknowledge
        ]
    );
    assert_eq!(out.bodies[1].5, (0..8).collect::<Vec<u8>>());
    assert_eq!(out.bodies[1].1, 0);
    assert_eq!(out.bodies[3].3, 25);
    assert_eq!(out.bodies[3].1, 3, "25 bytes pad to 28");
    let origs: Vec<_> = out.bodies[5..].iter().map(|b| b.0).collect();
    assert_eq!(origs, [Some(7), Some(12), Some(99)]);
    assert_eq!(out.memory.0[8192 - 8..], 98u64.to_ne_bytes());
    assert_eq!(out.stats.inline_bytes_sent, 8 + 24);
}

/// Requests the Read and Atomic fast paths refuse, each answered as the pipeline answers
/// it: a bad R_Key, out of the region's bounds, a QP without remote read or atomic access,
/// a misaligned Atomic, a PSN ahead of ePSN, a Read of two responses, a Read behind a
/// queued response, a second Read or Atomic in one iteration past the responder resources
/// (one) — and a zero-length Read through a bad R_Key, which both ways answer (it names no
/// memory).
#[test]
fn reads_and_atomics_the_fast_paths_refuse_are_answered_as_in_the_pipeline() {
    const FADD: Opcode = Opcode::FetchAdd;
    let cases: [(&Scenario, AccessFlags, [u64; 2]); 12] = [
        (
            &|r| {
                let mut reth = r.reth(0, 8);
                reth.rkey ^= 0x100;
                r.request(Opcode::RdmaReadRequest, 0, |p| p.reth = Some(reth), b"");
            },
            AccessFlags::ALL,
            [0, 0],
        ),
        (
            &|r| read_request(r, 0, (64 << 10) - 4, 8),
            AccessFlags::ALL,
            [0, 0],
        ),
        (
            &|r| read_request(r, 0, 0, 8),
            AccessFlags::LOCAL_WRITE,
            [0, 0],
        ),
        (
            &|r| atomic_request(r, FADD, 0, 0, (1, 0)),
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
            [0, 0],
        ),
        (
            &|r| atomic_request(r, FADD, 0, 4, (1, 0)),
            AccessFlags::ALL,
            [0, 0],
        ),
        (
            &|r| atomic_request(r, FADD, 0, (64 << 10) - 4, (1, 0)),
            AccessFlags::ALL,
            [0, 0],
        ),
        (&|r| read_request(r, 1, 0, 8), AccessFlags::ALL, [0, 0]),
        (&|r| read_request(r, 0, 0, 257), AccessFlags::ALL, [0, 0]),
        (
            &|r| {
                read_request(r, 0, 0, 600);
                read_request(r, 3, 0, 8);
            },
            AccessFlags::ALL,
            [0, 0],
        ),
        (
            &|r| {
                read_request(r, 0, 0, 8);
                read_request(r, 1, 0, 8);
            },
            AccessFlags::ALL,
            [1, 0],
        ),
        (
            &|r| {
                atomic_request(r, FADD, 0, 0, (1, 0));
                read_request(r, 1, 0, 8);
                atomic_request(r, FADD, 1, 0, (1, 0));
            },
            AccessFlags::ALL,
            [0, 1],
        ),
        (
            &|r| {
                let mut reth = r.reth(0, 0);
                reth.rkey ^= 0x100;
                r.request(Opcode::RdmaReadRequest, 0, |p| p.reth = Some(reth), b"");
            },
            AccessFlags::ALL,
            // Zero bytes name no memory: no key to check, either way.
            [1, 0],
        ),
    ];
    for (i, (case, access, want)) in cases.iter().enumerate() {
        let (out, taken) = same_both_ways(*access, &|r: &mut Rig| {
            case(r);
            r.step();
        });
        let got = [taken[Path::Read as usize], taken[Path::Atomic as usize]];
        assert_eq!(got, *want, "case {i}: {:?}", out.sent);
    }
}

/// Duplicates of a Read and of an Atomic answered on the fast path: the Read's data again
/// (checked again), the Atomic's saved original value without executing it twice — as the
/// pipeline answers them; and a duplicate in the same burst as its original.
#[test]
fn duplicates_of_fast_reads_and_atomics_are_answered_as_in_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.post_recv(1);
        r.mr.write_at(4096, b"original").unwrap();
        read_request(r, 0, 4096, 8);
        r.step();
        atomic_request(r, Opcode::FetchAdd, 1, 4096, (1, 0));
        r.step();
        read_request(r, 0, 4096, 8);
        atomic_request(r, Opcode::FetchAdd, 1, 4096, (1, 0));
        r.step();
        // A new Read and, in the same burst, a duplicate of it (its answer queued): the
        // queue drained in step 3 frees the new one's resource too, for the next Read.
        read_request(r, 2, 4096, 8);
        read_request(r, 2, 4096, 8);
        r.step();
        read_request(r, 3, 4096, 8);
        r.step();
    });
    assert_eq!(taken[Path::Read as usize], 3);
    assert_eq!(taken[Path::Atomic as usize], 1);
    let ops: Vec<_> = out.sent.iter().map(|s| (s.0, s.1)).collect();
    use Opcode::*;
    assert_eq!(
        ops,
        [
            (RdmaReadResponseOnly, rq(0)),
            (AtomicAcknowledge, rq(1)),
            (RdmaReadResponseOnly, rq(0)),
            (AtomicAcknowledge, rq(1)),
            (RdmaReadResponseOnly, rq(2)),
            (RdmaReadResponseOnly, rq(2)),
            (RdmaReadResponseOnly, rq(3)),
        ]
    );
    assert_eq!(out.bodies[0].5, b"original");
    assert_ne!(out.bodies[2].5, b"original", "the word the Atomic changed");
    assert_eq!(out.bodies[3].0, out.bodies[1].0);
    assert_eq!(out.bodies[1].0, Some(u64::from_ne_bytes(*b"original")));
}

/// A Send Only behind a fast Read in the same iteration: its Ack follows the Read's
/// response, with the pipeline's MSN and credits, and everything else is as the pipeline
/// leaves it — but for one field, by design: the Read's response reports the credits of
/// when it is built, in the receive step, before the Send behind it took its receive WQE
/// (the pipeline builds it in step 3, after). Both counts were true when reported, and the
/// Ack that follows reports the same count both ways. (The pipeline queues that Ack behind
/// the Read's response; with the response gone, it is owed, as the Ack of a Send alone is,
/// and leaves at the end of the iteration — where an engine holds owed Acks back for a
/// request to ride in, it may ride.)
#[test]
fn a_send_behind_a_fast_read_is_acked_as_in_the_pipeline() {
    let scenario = |r: &mut Rig| {
        r.post_recv(1);
        read_request(r, 0, 4096, 8);
        r.request(Opcode::SendOnly, 1, |_| {}, b"abcd");
        r.step();
    };
    let (mut slow, _) = run(false, AccessFlags::ALL, &scenario);
    let (fast, taken) = run(true, AccessFlags::ALL, &scenario);
    assert_eq!(taken[Path::Read as usize], 1);
    assert_eq!(taken[Path::Receive as usize], 1);
    let credits = |s: &Sent| match s.2 {
        Some(AethRepr {
            syndrome: Syndrome::Ack { credits },
            ..
        }) => credits.credits(),
        _ => unreachable!("{s:?}"),
    };
    assert_eq!(
        credits(&fast.sent[0]),
        Some(1),
        "the receive WQE not taken yet"
    );
    assert_eq!(credits(&slow.sent[0]), Some(0), "the receive WQE taken");
    slow.sent[0].2 = fast.sent[0].2;
    assert_eq!(fast, slow);
    let ops: Vec<_> = fast.sent.iter().map(|s| (s.0, s.1)).collect();
    assert_eq!(
        ops,
        [
            (Opcode::RdmaReadResponseOnly, rq(0)),
            (Opcode::Acknowledge, rq(1))
        ]
    );
}

// --- The completer's Ack fast path ---

/// Publishes an Acknowledge for PSN `psn` (absolute) with `syndrome` and MSN `msn`.
pub(super) fn respond(r: &mut Rig, psn: u32, syndrome: Syndrome, msn: u32) {
    let mut repr = PacketRepr::new(BthRepr::new(Opcode::Acknowledge, r.qp.qpn(), Psn::new(psn)));
    repr.aeth = Some(AethRepr {
        syndrome,
        msn: Msn::new(msn),
    });
    let mut s = PacketSlot::default();
    s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
    assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
}

pub(super) fn credits(n: u32) -> Syndrome {
    Syndrome::Ack {
        credits: CreditCode::encode(n),
    }
}

/// A work request of the requester scenarios, with its length.
#[derive(Clone, Copy, Debug)]
pub(super) enum Op {
    Send(u32),
    Write(u32),
    Read(u32),
    /// A Fetch and Add (of 8 bytes).
    FetchAdd,
    /// A Compare and Swap (of 8 bytes).
    CompareSwap,
}

impl Op {
    /// The verbs operation of this request at `remote`, with its length.
    fn at(self, remote: crate::RemoteAddr) -> (SendOp, u32) {
        match self {
            Op::Send(len) => (SendOp::Send, len),
            Op::Write(len) => (SendOp::RdmaWrite(remote), len),
            Op::Read(len) => (SendOp::RdmaRead(remote), len),
            Op::FetchAdd => (SendOp::FetchAdd { remote, add: 3 }, 8),
            Op::CompareSwap => (
                SendOp::CompareSwap {
                    remote,
                    compare: 0,
                    swap: 5,
                },
                8,
            ),
        }
    }
}

/// Gives the requester `n` credits (an unsolicited Ack of the PSN before its first) and
/// posts `ops`, which the engine sends.
pub(super) fn post(r: &mut Rig, n: u32, ops: &[Op]) {
    respond(r, Psn::new(0).sub(1).get(), credits(n), 0);
    r.step();
    post_only(r, 0, ops);
    r.step();
}

/// Publishes response `op` at PSN `psn` (absolute) with an AETH of `syndrome` and MSN
/// `msn`, the original value `orig` of an Atomic Acknowledge, and `payload` inline (a
/// payload larger than the slot holds: as many bytes of the peer's arena, by reference).
pub(super) fn respond_data(
    r: &mut Rig,
    op: Opcode,
    psn: u32,
    (syndrome, msn): (Syndrome, u32),
    orig: Option<u64>,
    payload: &[u8],
) {
    let mut repr = PacketRepr::new(BthRepr::new(op, r.qp.qpn(), Psn::new(psn)));
    repr.aeth = Some(AethRepr {
        syndrome,
        msn: Msn::new(msn),
    });
    repr.atomic_ack_eth = orig.map(|orig| crate::wire::AtomicAckEthRepr { orig });
    let mut s = PacketSlot::default();
    s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
    let at = usize::from(s.hdr_len);
    if payload.len() > PacketSlot::inline_room(at) {
        // By reference: the peer's arena (zeros), not `payload`'s bytes.
        s.kind = crate::wire::slot::KIND_DIRECT;
        s.payload_off = 0;
        s.payload_len = payload.len() as u32;
    } else if !payload.is_empty() {
        s.kind = crate::wire::slot::KIND_INLINE;
        s.payload_len = payload.len() as u32;
        s.data[at..at + payload.len()].copy_from_slice(payload);
    }
    assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
}

/// The RDMA Read Response Only of PSN `psn` (absolute) carrying `payload`.
pub(super) fn read_response(r: &mut Rig, psn: u32, msn: u32, payload: &[u8]) {
    let op = Opcode::RdmaReadResponseOnly;
    respond_data(r, op, psn, (credits(4), msn), None, payload);
}

/// The Atomic Acknowledge of PSN `psn` (absolute) with original value `orig`.
pub(super) fn atomic_ack(r: &mut Rig, psn: u32, msn: u32, orig: u64) {
    let op = Opcode::AtomicAcknowledge;
    respond_data(r, op, psn, (credits(4), msn), Some(orig), &[]);
}

/// The Read Response Only of a Read of one response and the Atomic Acknowledges of a
/// Fetch and Add and a Compare and Swap, each answering the oldest WQE, take the fast
/// paths with the slow path's completions (byte count), memory (the data and the original
/// values), acknowledged PSN, credits and statistics.
#[test]
fn read_responses_and_atomic_acks_of_the_oldest_wqe_take_the_fast_paths() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        post(
            r,
            8,
            &[
                Op::Read(8),
                Op::FetchAdd,
                Op::CompareSwap,
                Op::Read(0),
                Op::Read(256),
                Op::Send(4),
            ],
        );
        read_response(r, 0, 1, b"readdata");
        r.step();
        atomic_ack(r, 1, 2, 0x0102_0304_0506_0708);
        r.step();
        atomic_ack(r, 2, 3, u64::MAX - 1);
        r.step();
        read_response(r, 3, 4, b"");
        r.step();
        read_response(r, 4, 5, &[0x5A; 256]);
        r.step();
        respond(r, 5, credits(3), 6);
        r.step();
    });
    assert_eq!(taken[Path::ReadResponse as usize], 3);
    assert_eq!(taken[Path::AtomicAck as usize], 2);
    assert_eq!(taken[Path::Ack as usize], 1);
    assert_eq!(out.completions.len(), 6);
    assert!(
        out.completions
            .iter()
            .all(|c| c.status == crate::WcStatus::Success)
    );
    assert_eq!(out.completions[0].byte_len, 8);
    assert_eq!(out.completions[4].byte_len, 256);
    assert_eq!(&out.memory.0[..8], b"readdata");
    assert_eq!(
        out.memory.0[1024..1032],
        0x0102_0304_0506_0708u64.to_ne_bytes()
    );
    assert_eq!(out.memory.0[2048..2056], (u64::MAX - 1).to_ne_bytes());
}

/// The answered WQE retired in line (issue 27, `retire_acked` for a Read or an Atomic):
/// an unsignaled Read and an unsignaled Fetch and Add leave no completion but give their
/// initiator slot back (the next one goes); a Read answered while the send CQ is full
/// stays done until the application polls, then completes with its length — as the slow
/// path leaves them.
#[test]
fn answered_reads_and_atomics_retire_as_in_the_slow_path() {
    fn post_quiet(r: &mut Rig, wr_id: u64, op: Op) {
        let at = 1024 * wr_id;
        let (op, len) = op.at(r.mr.remote(4096 + at));
        let sge = [r.mr.sge(at, len).unwrap()];
        let wr = SendWr::new(wr_id, op, &sge).flags(crate::SendFlags::NONE);
        r.qp.post_send(&wr).unwrap();
    }
    // The send completions the scenario's polls took, for each run.
    let seen = std::cell::RefCell::new(vec![]);
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        seen.borrow_mut().clear();
        fill_receive_cq(r, 64);
        respond(r, Psn::new(0).sub(1).get(), credits(8), 0);
        r.step();
        post_quiet(r, 0, Op::Read(8));
        post_quiet(r, 1, Op::FetchAdd);
        post_only(r, 2, &[Op::Read(8)]);
        r.step();
        read_response(r, 0, 1, b"quietrd!");
        r.step();
        atomic_ack(r, 1, 2, 7);
        r.step();
        read_response(r, 2, 3, b"fullcq!!");
        r.step();
        let mut n = 0;
        while n < 64 {
            for c in r.completions() {
                match c.opcode {
                    crate::WcOpcode::Recv => n += 1,
                    _ => seen.borrow_mut().push((c.wr_id, c.byte_len)),
                }
            }
        }
        r.step();
    });
    assert_eq!(taken[Path::ReadResponse as usize], 2, "{out:#?}");
    assert_eq!(taken[Path::AtomicAck as usize], 1);
    // Each answer retired in line, all of it (the full CQ's Read as far as it could go),
    // then that Read by the retire fast path once the CQ had room.
    assert_eq!(taken[Path::Retire as usize], 5);
    let mut got = seen.take();
    got.extend(out.completions.iter().map(|c| (c.wr_id, c.byte_len)));
    assert_eq!(got, [(2, 8)]);
    assert!(out.req.starts_with("(3, 3, 3,"), "all retired: {}", out.req);
}

/// Read responses and Atomic Acknowledges the fast paths do not take, each as the slow
/// path takes it: the wrong length, a Nak's syndrome, a First where an Only belongs (a
/// Read of two responses), an Atomic Acknowledge of a Read and a Read response of an
/// Atomic, a Read response that acknowledges a Send before it, a duplicate, a PSN never
/// sent, in SQD, an Atomic Acknowledge with a payload, a First or a Last of the whole
/// length where the Only of a one-response Read belongs, and an Only of a later PSN than
/// the oldest Read's (whose response is missing).
#[test]
fn unusual_read_responses_and_atomic_acks_go_to_the_slow_path() {
    fn ack(msn: u32) -> (Syndrome, u32) {
        (credits(4), msn)
    }
    let cases: [&Scenario; 16] = [
        &|r| {
            post(r, 8, &[Op::Read(8)]);
            read_response(r, 0, 1, b"short");
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::Read(8)]);
            let op = Opcode::RdmaReadResponseOnly;
            let nak = Syndrome::Nak(NakCode::RemoteAccessError);
            respond_data(r, op, 0, (nak, 1), None, b"readdata");
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::Read(300)]);
            let op = Opcode::RdmaReadResponseFirst;
            respond_data(r, op, 0, ack(1), None, &[1; 256]);
            r.step();
            let op = Opcode::RdmaReadResponseLast;
            respond_data(r, op, 1, ack(1), None, &[2; 44]);
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::Read(300)]);
            read_response(r, 0, 1, &[1; 256]);
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::Read(8)]);
            atomic_ack(r, 0, 1, 7);
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::FetchAdd]);
            read_response(r, 0, 1, b"readdata");
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::Send(4), Op::Read(8)]);
            read_response(r, 1, 2, b"readdata");
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::Read(8)]);
            read_response(r, 0, 1, b"readdata");
            r.step();
            read_response(r, 0, 1, b"readdata");
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::Read(8)]);
            read_response(r, 1, 1, b"readdata");
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::Read(8)]);
            r.qp.modify(&QpAttr::new(QpState::Sqd)).unwrap();
            r.step();
            read_response(r, 0, 1, b"readdata");
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::FetchAdd]);
            let op = Opcode::AtomicAcknowledge;
            respond_data(r, op, 0, ack(1), Some(9), b"pad!");
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::Read(8)]);
            let op = Opcode::RdmaReadResponseFirst;
            respond_data(r, op, 0, ack(1), None, b"readdata");
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::Read(8)]);
            let op = Opcode::RdmaReadResponseLast;
            respond_data(r, op, 0, ack(1), None, b"readdata");
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::Read(8), Op::Send(4)]);
            read_response(r, 1, 2, b"readdata");
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::Read(600)]);
            // A Middle (no AETH) of a PMTU, by reference, as the Read's first response.
            let op = Opcode::RdmaReadResponseMiddle;
            let repr = PacketRepr::new(BthRepr::new(op, r.qp.qpn(), Psn::new(0)));
            let mut s = PacketSlot::default();
            s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
            s.kind = crate::wire::slot::KIND_DIRECT;
            s.payload_len = 256;
            assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::FetchAdd]);
            let op = Opcode::AtomicAcknowledge;
            let nak = Syndrome::Nak(NakCode::RemoteAccessError);
            respond_data(r, op, 0, (nak, 1), Some(9), &[]);
            r.step();
        },
    ];
    // What each case leaves, the slow path's answer: the completions (WR id, status) and
    // the QP's state. A response the completer refuses is a bad response (the QP fails);
    // a PSN never sent, an Atomic Acknowledge with a payload (malformed: the parse drops
    // it) and a Read response that skips the Read (an implied Nak: the Read is resent)
    // complete nothing.
    use crate::WcStatus::{BadRespErr, Success};
    let failed = (&[(0, BadRespErr)][..], QpState::Error);
    let expected: [(&[(u64, crate::WcStatus)], QpState); 16] = [
        failed,
        failed,
        (&[(0, Success)], QpState::Rts),
        failed,
        failed,
        failed,
        (&[(0, Success), (1, Success)], QpState::Rts),
        (&[(0, Success)], QpState::Rts),
        (&[], QpState::Rts),
        (&[(0, Success)], QpState::Sqd),
        (&[], QpState::Rts),
        failed,
        failed,
        (&[], QpState::Rts),
        failed,
        failed,
    ];
    for (i, (case, (wcs, state))) in cases.iter().zip(expected).enumerate() {
        let (out, taken) = same_both_ways(AccessFlags::ALL, *case);
        let fast = taken[Path::ReadResponse as usize] + taken[Path::AtomicAck as usize];
        // The duplicate's first copy is the only one fast.
        assert_eq!(fast, u64::from(i == 7), "case {i}");
        assert_eq!((&statuses(&out)[..], out.state), (wcs, state), "case {i}");
    }
}

/// Acks of the oldest Sends (one Ack covering two, then one covering the third) take the
/// fast path with the slow path's completions, acknowledged PSN, credits and statistics.
#[test]
fn acks_of_the_oldest_sends_take_the_ack_fast_path() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        post(r, 8, &[Op::Send(4), Op::Send(4), Op::Write(4)]);
        respond(r, 1, credits(6), 2);
        r.step();
        respond(r, 2, credits(5), 2);
        r.step();
    });
    assert_eq!(taken[1], 2);
    assert_eq!(out.completions.len(), 3);
    assert!(
        out.completions
            .iter()
            .all(|c| c.status == crate::WcStatus::Success)
    );
    assert_eq!(out.sent.len(), 3, "the three requests");
}

/// Retiring (issue 27): WQEs done with success retire on the completer's retire fast path,
/// several at once in its loop, as the core's retire retires them: a signaled one with its
/// completion, an unsignaled one without (its slot published with the next signaled one,
/// or at the end), a Read's with its length. A WQE done with an error (a Nak) leaves it to
/// the core's retire, which flushes the rest.
#[test]
fn done_wqes_retire_on_the_retire_fast_path_as_in_the_core() {
    fn post_quiet(r: &mut Rig, wr_id: u64, at: u64, signaled: bool) {
        let sge = [r.mr.sge(at, 4).unwrap()];
        let flags = if signaled {
            crate::SendFlags::SIGNALED
        } else {
            crate::SendFlags::NONE
        };
        let wr = SendWr::new(wr_id, SendOp::Send, &sge).flags(flags);
        r.qp.post_send(&wr).unwrap();
    }
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        post(r, 8, &[Op::Send(4)]);
        post_quiet(r, 1, 1024, false);
        post_quiet(r, 2, 2048, false);
        post_quiet(r, 3, 3072, true);
        post_quiet(r, 4, 4096, false);
        r.step();
        // The first three: a signaled one and two unsignaled ones behind it.
        respond(r, 2, credits(6), 3);
        r.step();
        // The fourth (signaled), then the fifth alone (unsignaled: no completion).
        respond(r, 3, credits(6), 4);
        r.step();
        respond(r, 4, credits(6), 5);
        r.step();
    });
    assert_eq!(taken[Path::Retire as usize], 3, "one run per Ack");
    let ids: Vec<_> = out.completions.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, [0, 3]);
    assert!(out.req.starts_with("(5, 5, 5,"), "all retired: {}", out.req);
    // A Read's completion carries its length; a Nak'd Write fails, and the Send behind it
    // is flushed (the core's retire, after the fast path retired the Read).
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        post(r, 8, &[Op::Read(8), Op::Write(8), Op::Send(4)]);
        read_response(r, 0, 1, b"readdata");
        r.step();
        respond(r, 1, Syndrome::Nak(NakCode::RemoteAccessError), 1);
        r.step();
    });
    assert!(taken[Path::Retire as usize] >= 1);
    let got: Vec<_> = out
        .completions
        .iter()
        .map(|c| (c.wr_id, c.status, c.byte_len))
        .collect();
    assert_eq!(
        got,
        [
            (0, crate::WcStatus::Success, 8),
            (1, crate::WcStatus::RemAccessErr, 0),
            (2, crate::WcStatus::WrFlushErr, 0)
        ]
    );
}

/// Duplicate and unsolicited positive Acks (credit updates: the responder sends one when
/// its receive queue grows back from nearly empty) take the completer's credit fast path,
/// which leaves what the slow path leaves: the credits, and nothing else. Among them one
/// with the "invalid" credit code (no count), and an old one with fewer credits.
#[test]
fn credit_updates_take_the_credit_fast_path() {
    let scenario = |r: &mut Rig| {
        // One credit: the second Send waits for more.
        post(r, 1, &[Op::Send(4), Op::Send(4)]);
        respond(r, 0, credits(0), 1);
        r.step();
        respond(r, 0, credits(4), 1);
        r.step();
        respond(r, Psn::new(0).sub(1).get(), credits(2), 0);
        let none = Syndrome::Ack {
            credits: CreditCode::NONE,
        };
        respond(r, 0, none, 1);
    };
    let before = crate::probe::taken(Path::Credits);
    let (out, taken) = same_both_ways(AccessFlags::ALL, &scenario);
    assert_eq!(
        crate::probe::taken(Path::Credits) - before,
        4,
        "post's first credit Ack, and the three after the Send's Ack"
    );
    assert_eq!(taken[1], 1, "the Ack of the first Send");
    assert_eq!(out.sent.len(), 2, "the second Send went once credit came");
}

/// A duplicate Ack, a Nak, an RNR Nak, an Ack inside a two-packet Send and an Ack that
/// leaves a Read unanswered (an implied Nak) go to the slow path.
#[test]
fn unusual_acks_go_to_the_slow_path() {
    let cases: [&dyn Fn(&mut Rig); 5] = [
        &|r| {
            post(r, 8, &[Op::Send(4)]);
            respond(r, 0, credits(7), 1);
            r.step();
            respond(r, 0, credits(7), 1);
        },
        &|r| {
            post(r, 8, &[Op::Send(4)]);
            respond(r, 0, Syndrome::Nak(NakCode::RemoteAccessError), 0);
        },
        &|r| {
            post(r, 8, &[Op::Send(4)]);
            let timer = RnrTimer::new(1);
            respond(r, 0, Syndrome::RnrNak { timer }, 0);
        },
        &|r| {
            post(r, 8, &[Op::Send(300)]);
            respond(r, 0, credits(7), 0);
        },
        &|r| {
            post(r, 8, &[Op::Read(4), Op::Send(4)]);
            respond(r, 1, credits(7), 2);
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        let (_, taken) = same_both_ways(AccessFlags::ALL, *case);
        let want = u64::from(i == 0); // the first Ack of the duplicate case is fast
        assert_eq!(taken[1], want, "case {i}");
    }
}

/// The completions a scenario left: (WR id, status), in order.
fn statuses(out: &Outcome) -> Vec<(u64, crate::WcStatus)> {
    out.completions
        .iter()
        .map(|c| (c.wr_id, c.status))
        .collect()
}

/// A Nak of our Send (not a sequence error or an RNR Nak) completes it with the status
/// its code names (spec/04 "NAK codes") and moves the QP to the Error state: Invalid
/// Request, Remote Access Error and Remote Operational Error their own; Invalid RD Request
/// (never sent on RC) and the reserved codes are a bad response.
#[test]
fn naks_complete_the_send_with_the_status_of_their_code() {
    use crate::WcStatus::*;
    for (code, status) in [
        (NakCode::InvalidRequest, RemInvReqErr),
        (NakCode::RemoteAccessError, RemAccessErr),
        (NakCode::RemoteOperationalError, RemOpErr),
        (NakCode::InvalidRdRequest, BadRespErr),
        (NakCode::Unknown(9), BadRespErr),
    ] {
        let (out, _) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
            post(r, 8, &[Op::Send(4)]);
            respond(r, 0, Syndrome::Nak(code), 0);
            r.step();
        });
        assert_eq!(
            (statuses(&out), out.state),
            (vec![(0, status)], QpState::Error),
            "{code:?}"
        );
        assert_eq!(out.stats.naks_received, 1, "{code:?}");
    }
}

// --- Hostile requests: what a peer may put in a fast-path packet (review of issue 10) ---

/// The Nak syndrome of the first packet sent.
fn first_syndrome(out: &Outcome) -> Syndrome {
    out.sent[0].2.unwrap().syndrome
}

/// An RDMA Write Only whose range leaves the region — one byte past its end, a VA that
/// wraps around, two bytes before its start — is the pipeline's Remote Access Error, with nothing written.
#[test]
fn a_write_out_of_its_region_goes_to_the_pipeline() {
    let past_end = |r: &mut Rig| {
        let reth = r.reth((64 << 10) - 3, 4);
        r.request(Opcode::RdmaWriteOnly, 0, |p| p.reth = Some(reth), b"abcd");
    };
    let wraps = |r: &mut Rig| {
        let mut reth = r.reth(0, 4);
        reth.va = u64::MAX - 1;
        r.request(Opcode::RdmaWriteOnly, 0, |p| p.reth = Some(reth), b"abcd");
    };
    let before_start = |r: &mut Rig| {
        // Two bytes before the region, two in it.
        let mut reth = r.reth(0, 4);
        reth.va = reth.va.wrapping_sub(2);
        r.request(Opcode::RdmaWriteOnly, 0, |p| p.reth = Some(reth), b"abcd");
    };
    let cases: [&dyn Fn(&mut Rig); 3] = [&past_end, &wraps, &before_start];
    for (i, case) in cases.iter().enumerate() {
        let (out, taken) = same_both_ways(AccessFlags::ALL, *case);
        assert_eq!(taken[0], 0, "case {i}");
        assert_eq!(
            first_syndrome(&out),
            Syndrome::Nak(NakCode::RemoteAccessError),
            "case {i}"
        );
        assert_eq!(out.state, QpState::Error, "case {i}");
        assert!(out.memory.0.iter().all(|&b| b == 0), "case {i}");
    }
}

/// An RDMA Write Only through the R_Key of a region of another protection domain, or of a
/// region of this one without remote write: refused by the pipeline, nothing written.
#[test]
fn a_write_through_a_key_without_the_right_goes_to_the_pipeline() {
    let other_pd = |r: &mut Rig| {
        let pd = r.ctx.alloc_pd().unwrap();
        let mr = pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
        let dst = mr.remote(0);
        let reth = crate::wire::RethRepr {
            va: dst.addr,
            rkey: dst.rkey,
            dma_len: 4,
        };
        r.request(Opcode::RdmaWriteOnly, 0, |p| p.reth = Some(reth), b"abcd");
        r.step();
        let mut got = [9u8; 4];
        mr.read_at(0, &mut got).unwrap();
        assert_eq!(got, [0; 4], "another domain's region is untouched");
    };
    let read_only = |r: &mut Rig| {
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
        let mr = r.pd.alloc_mr(4096, access).unwrap();
        let dst = mr.remote(0);
        let reth = crate::wire::RethRepr {
            va: dst.addr,
            rkey: dst.rkey,
            dma_len: 4,
        };
        r.post_recv(1);
        write_imm(r, 0, reth, 3, b"abcd");
        r.step();
        let mut got = [9u8; 4];
        mr.read_at(0, &mut got).unwrap();
        assert_eq!(got, [0; 4], "a region without remote write is untouched");
    };
    let cases: [&dyn Fn(&mut Rig); 2] = [&other_pd, &read_only];
    for (i, case) in cases.iter().enumerate() {
        let (out, taken) = same_both_ways(AccessFlags::ALL, *case);
        assert_eq!(taken[0], 0, "case {i}");
        assert_eq!(
            first_syndrome(&out),
            Syndrome::Nak(NakCode::RemoteAccessError),
            "case {i}"
        );
    }
}

/// Zero-length messages: a Send Only and a Write Only with Immediate of no bytes (the
/// latter with an R_Key that names nothing, which a zero-length Write never uses), and a
/// Write Only whose RETH claims bytes the packet does not carry.
#[test]
fn zero_length_messages_are_handled_as_in_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.post_recv(2);
        r.request(Opcode::SendOnly, 0, |_| {}, b"");
        let mut reth = r.reth(0, 0);
        reth.rkey ^= 0x00FF_FF00;
        write_imm(r, 1, reth, 4, b"");
        r.step();
    });
    assert_eq!(taken[0], 2);
    assert_eq!(out.completions.len(), 2);
    assert!(out.completions.iter().all(|c| c.byte_len == 0));
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        let reth = r.reth(0, 4);
        r.request(Opcode::RdmaWriteOnly, 0, |p| p.reth = Some(reth), b"");
        r.step();
    });
    assert_eq!(taken[0], 0, "the RETH claims 4 bytes, the packet has none");
    assert_eq!(first_syndrome(&out), Syndrome::Nak(NakCode::InvalidRequest));
}

/// A Write Only with Immediate that fails two checks at once — a bad R_Key and no
/// receive WQE, or a bad R_Key and a full receive CQ — gets the pipeline's first answer
/// (the RNR Nak of the resources check).
#[test]
fn a_write_with_immediate_failing_two_checks_gets_the_first_answer() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        let mut reth = r.reth(0, 4);
        reth.rkey ^= 0xFFFF_0000;
        write_imm(r, 0, reth, 1, b"abcd");
        r.step();
    });
    assert_eq!(taken[0], 0);
    assert!(matches!(first_syndrome(&out), Syndrome::RnrNak { .. }));
    assert_eq!(out.state, QpState::Rts);
}

/// Payload that the peer's arena does not hold (a direct payload past its end): the Send
/// and the Write with Immediate take the fast path up to the copy and fail as the pipeline
/// fails them, with their receive WQEs where the pipeline leaves them.
#[test]
fn a_payload_outside_the_peers_arena_fails_as_in_the_pipeline() {
    for op in [Opcode::SendOnly, Opcode::RdmaWriteOnlyWithImmediate] {
        let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
            r.post_recv(1);
            let psn = Psn::new(rq(0));
            let mut repr = PacketRepr::new(BthRepr::new(op, r.qp.qpn(), psn));
            if op == Opcode::RdmaWriteOnlyWithImmediate {
                repr.reth = Some(r.reth(4096, 16));
                repr.immdt = imm(2);
            }
            let mut s = PacketSlot::default();
            s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
            s.kind = crate::wire::slot::KIND_DIRECT;
            s.payload_off = u64::MAX - 8;
            s.payload_len = 16;
            assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
            r.step();
        });
        assert_eq!(taken[0], 1, "{op:?}");
        assert_eq!(out.state, QpState::Error, "{op:?}");
        assert_eq!(out.completions.len(), 1, "{op:?}");
        assert_ne!(out.completions[0].status, crate::WcStatus::Success);
    }
}

/// A Send Only and a Write Only behind an RDMA Read whose responses are still queued:
/// their Ack leaves after the Read's responses, as in the pipeline.
#[test]
fn a_send_behind_a_queued_read_is_acked_as_in_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.post_recv(1);
        let reth = r.reth(0, 600);
        r.request(Opcode::RdmaReadRequest, 0, |p| p.reth = Some(reth), b"");
        r.request(Opcode::SendOnly, 3, |_| {}, b"abcd");
        let reth = r.reth(4096, 4);
        r.request(Opcode::RdmaWriteOnly, 4, |p| p.reth = Some(reth), b"wxyz");
        r.step();
        r.step();
    });
    assert_eq!(taken[0], 2);
    let last = out.sent.last().unwrap();
    assert_eq!((last.0, last.1), (Opcode::Acknowledge, rq(4)));
}

/// A Send Only with the Solicited Event bit and a pad count the payload does not need, to
/// a QP drained to SQD (which still receives, through the pipeline).
#[test]
fn odd_header_bits_and_the_sqd_state_are_handled_as_in_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.post_recv(2);
        r.request(
            Opcode::SendOnlyWithImmediate,
            0,
            |p| {
                p.bth.solicited = true;
                p.bth.pad_count = 3;
                p.immdt = imm(5);
            },
            b"abcd",
        );
        r.step();
        r.qp.modify(&QpAttr::new(QpState::Sqd)).unwrap();
        r.step();
        r.request(Opcode::SendOnly, 1, |_| {}, b"efgh");
        r.step();
    });
    assert_eq!(taken[0], 1, "the one received in RTS");
    assert_eq!(out.completions.len(), 2);
    assert!(out.completions[0].solicited);
    assert_eq!(out.completions[0].byte_len, 4);
}

// --- Hostile Acks (review of issue 10) ---

/// A scenario run both ways.
type Scenario = dyn Fn(&mut Rig);

/// An Ack of nPSN (nothing sent there), one far beyond it, one with a reserved syndrome,
/// one with the "invalid" credit code, one whose MSN goes back: each as the slow path
/// takes it (dropped, a bad response, credits kept or not).
#[test]
fn acks_beyond_npsn_or_with_odd_fields_are_handled_as_in_the_slow_path() {
    let cases: [(&Scenario, u64); 5] = [
        (
            &|r| {
                post(r, 8, &[Op::Send(4), Op::Send(4)]);
                respond(r, 2, credits(7), 2);
            },
            0,
        ),
        (
            &|r| {
                post(r, 8, &[Op::Send(4), Op::Send(4)]);
                respond(r, 1 << 22, credits(7), 2);
            },
            0,
        ),
        (
            &|r| {
                post(r, 8, &[Op::Send(4), Op::Send(4)]);
                respond(r, 1, Syndrome::Reserved(0b010_00000), 2);
            },
            0,
        ),
        (
            &|r| {
                post(r, 1, &[Op::Send(4), Op::Send(4), Op::Send(4)]);
                respond(
                    r,
                    0,
                    Syndrome::Ack {
                        credits: CreditCode::NONE,
                    },
                    1,
                );
                r.step();
            },
            1,
        ),
        (
            &|r| {
                post(r, 8, &[Op::Send(4), Op::Send(4)]);
                respond(r, 0, credits(31), 1);
                r.step();
                respond(r, 1, credits(0), 0);
                r.step();
            },
            2,
        ),
    ];
    for (i, (case, want)) in cases.iter().enumerate() {
        let (_, taken) = same_both_ways(AccessFlags::ALL, *case);
        assert_eq!(taken[1], *want, "case {i}");
    }
}

/// An Ack at the last PSN of a two-packet Send is fast; one at its first packet, or one
/// at the first packet of a Send partly sent (the link's ring full), is the slow path's.
#[test]
fn acks_of_multi_packet_sends_are_handled_as_in_the_slow_path() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        post(r, 8, &[Op::Send(4), Op::Send(300)]);
        respond(r, 1, credits(7), 1);
        r.step();
        respond(r, 2, credits(6), 2);
        r.step();
    });
    assert_eq!(taken[1], 1, "only the Ack of the Send's last packet");
    assert_eq!(out.completions.len(), 2);
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        // 40,000 bytes are 157 packets of 256: more than the link's ring holds.
        post(r, 8, &[Op::Send(40_000)]);
        respond(r, 100, credits(7), 0);
        r.step();
    });
    assert_eq!(taken[1], 0);
    assert!(out.completions.is_empty());
}

/// Acks while the requester waits: after an RNR Nak (an Ack of a PSN sent before it
/// rewound), in SQD, and a plain Ack of an RDMA Read's PSN.
#[test]
fn acks_while_the_requester_waits_are_handled_as_in_the_slow_path() {
    let cases: [&dyn Fn(&mut Rig); 3] = [
        &|r| {
            post(r, 8, &[Op::Send(4), Op::Send(4)]);
            let timer = RnrTimer::new(20);
            respond(r, 0, Syndrome::RnrNak { timer }, 0);
            r.step();
            respond(r, 1, credits(7), 2);
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::Send(4), Op::Send(4)]);
            r.qp.modify(&QpAttr::new(QpState::Sqd)).unwrap();
            r.step();
            respond(r, 1, credits(7), 2);
            r.step();
        },
        &|r| {
            post(r, 8, &[Op::Send(4), Op::Read(4), Op::Send(4)]);
            respond(r, 1, credits(7), 2);
            r.step();
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        let (out, taken) = same_both_ways(AccessFlags::ALL, *case);
        // The Ack after the RNR Nak acknowledges both Sends: fast, and the resend the
        // RNR timer would have made has nothing left to send.
        assert_eq!(taken[1], u64::from(i == 0), "case {i}");
        if i == 0 {
            assert_eq!(out.completions.len(), 2);
        }
    }
}

/// An RNR Nak, then an Ack of everything before the RNR timer fires: when it fires, the
/// requester sends nothing again (both ways) and stays in RTS.
#[test]
fn an_ack_after_an_rnr_nak_leaves_nothing_to_resend() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        post(r, 8, &[Op::Send(4), Op::Send(4)]);
        let timer = RnrTimer::new(1);
        respond(r, 0, Syndrome::RnrNak { timer }, 0);
        r.step();
        respond(r, 1, credits(7), 2);
        r.step();
        std::thread::sleep(timer.duration() * 4 + std::time::Duration::from_millis(5));
        for _ in 0..4 {
            r.step();
        }
    });
    assert_eq!(taken[1], 1);
    assert_eq!(out.state, QpState::Rts);
    assert_eq!(
        out.sent.len(),
        2,
        "the two Sends, nothing again: {:?}",
        out.sent
    );
    assert_eq!(out.completions.len(), 2);
}

/// A QP in RTR receives: a Send Only, a Send Only with Immediate and a Write Only with
/// Immediate at ePSN take the fast path with the pipeline's completions and Ack; the
/// Acks its requester receives before RTS (its peer's initial credits) are no fast-path
/// Acks.
#[test]
fn a_qp_in_rtr_receives_on_the_fast_path_as_in_the_pipeline() {
    let scenario = |r: &mut Rig| {
        r.post_recv(3);
        r.request(Opcode::SendOnly, 0, |_| {}, b"abcd");
        r.request(
            Opcode::SendOnlyWithImmediate,
            1,
            |p| p.immdt = imm(8),
            b"efgh",
        );
        let reth = r.reth(4096, 4);
        write_imm(r, 2, reth, 9, b"wxyz");
        r.step();
        respond(r, Psn::new(0).sub(1).get(), credits(8), 0);
        r.step();
    };
    let (slow, none) = run_in(false, AccessFlags::ALL, QpState::Rtr, &scenario);
    assert_eq!(none, [0; crate::probe::PATHS]);
    let (fast, taken) = run_in(true, AccessFlags::ALL, QpState::Rtr, &scenario);
    assert_eq!(fast, slow);
    // The receive fast path thrice, the owed Ack's QP listed in the first word once, the
    // Send Only's parse once.
    assert_eq!(taken[..10], [3, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
    assert_eq!(taken[Path::SendOnlyParse as usize], 1);
    assert_eq!(fast.state, QpState::Rtr);
    assert_eq!(fast.completions.len(), 3);
    assert_eq!(fast.sent, [ack(2, 3, 0)]);
}

/// A Send waiting for credit after its first packet (spec/02: a limited Send sends one)
/// holds PSNs before nPSN that were never sent. An Ack of its last PSN answers nothing
/// sent: dropped both ways (it used to complete both Sends, the second never sent whole);
/// once credit comes the rest goes and its Ack completes it. An Ack of its first packet
/// completes only the Send before it.
#[test]
fn an_ack_of_a_psn_never_sent_is_dropped_both_ways() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        post(r, 1, &[Op::Send(4), Op::Send(300)]);
        respond(r, 2, credits(0), 2);
        r.step();
        assert!(r.completions().is_empty(), "PSN 2 was never sent");
        respond(r, 0, credits(1), 1);
        r.step();
        respond(r, 2, credits(0), 2);
        r.step();
    });
    assert_eq!(taken[1], 2, "the two Acks of PSNs sent");
    assert_eq!(out.stats.dropped, 1);
    assert_eq!(out.completions.len(), 2);
    let ops: Vec<_> = out.sent.iter().map(|s| (s.0, s.1)).collect();
    assert_eq!(
        ops,
        [
            (Opcode::SendOnly, 0),
            (Opcode::SendFirst, 1),
            (Opcode::SendLast, 2)
        ]
    );
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        post(r, 1, &[Op::Send(4), Op::Send(300)]);
        respond(r, 1, credits(0), 1);
        r.step();
    });
    assert_eq!(taken[1], 0);
    assert_eq!(out.completions.len(), 1);
}

/// Acks while the send CQ is full (64 receives filled the shared CQ): the Sends they
/// complete cannot retire; a second Ack behind a done, unretired Send is the slow path's,
/// and every completion arrives once the CQ is polled.
#[test]
fn acks_while_the_send_cq_is_full_are_handled_as_in_the_slow_path() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        fill_receive_cq(r, 64);
        post(r, 8, &[Op::Send(4), Op::Send(4), Op::Send(4)]);
        respond(r, 0, credits(7), 1);
        r.step();
        respond(r, 1, credits(6), 2);
        r.step();
        let mut n = 0;
        while n < 64 {
            n += r.completions().len();
        }
        r.step();
        respond(r, 2, credits(5), 3);
        r.step();
    });
    assert_eq!(taken[0], 64);
    assert_eq!(taken[1], 2, "the first Ack and the last one");
    assert_eq!(
        out.completions.len(),
        3,
        "the three Sends, after the receives"
    );
}

/// One Ack of several Sends while the send CQ is full (issue 27: the Ack fast path's retire
/// passes over the unsignaled ones and drops them together): the two unsignaled Sends
/// before the signaled one retire (their regions released), the signaled one and the
/// unsignaled one behind it wait for the application's poll, then retire with the next
/// Ack's turn — as the slow path leaves them. Then an Ack of two more, the first unsignaled.
#[test]
fn a_coalesced_ack_while_the_send_cq_is_full_retires_as_in_the_slow_path() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        fill_receive_cq(r, 64);
        // Credit for every Send (the peer's unsolicited update).
        respond(r, Psn::new(0).sub(1).get(), credits(8), 0);
        r.step();
        post_signaled(r, 1, 1024, false);
        post_signaled(r, 2, 2048, false);
        post_signaled(r, 3, 3072, true);
        post_signaled(r, 4, 4096, false);
        r.step();
        respond(r, 3, credits(7), 4);
        r.step();
        let mut n = 0;
        while n < 64 {
            n += r.completions().len();
        }
        r.step();
        post_signaled(r, 5, 1024, false);
        post_signaled(r, 6, 2048, true);
        r.step();
        respond(r, 5, credits(7), 6);
        r.step();
    });
    assert_eq!(taken[Path::Ack as usize], 2, "{out:#?}");
    let ids: Vec<_> = out.completions.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, [3, 6]);
    assert!(out.req.starts_with("(6, 6, 6,"), "all retired: {}", out.req);
}

/// Acks the fast path takes into an armed send CQ and into a destroyed one (issue 27: the
/// completion written into the slot its queue reserved): the armed queue raises its one
/// event for the first completion and is disarmed, and a destroyed queue takes the
/// completions (they go nowhere) while the WQEs retire all the same — both as the slow
/// path leaves them.
#[test]
fn acks_into_an_armed_or_a_destroyed_send_cq_are_handled_as_in_the_slow_path() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        let mut ch = r.ctx.create_comp_channel().unwrap();
        r.cq.attach(&ch).unwrap();
        r.cq.req_notify(false).unwrap();
        post(r, 8, &[Op::Send(4), Op::Send(4), Op::Send(4)]);
        respond(r, 0, credits(7), 1);
        r.step();
        let cqn = r.cq.number();
        assert_eq!(
            ch.try_get_event().unwrap(),
            Some(cqn),
            "the first completion"
        );
        respond(r, 1, credits(6), 2);
        r.step();
        assert_eq!(ch.try_get_event().unwrap(), None, "the arm is spent");
        assert_eq!(r.completions().len(), 2);
        // The queue destroyed: the third Send's completion goes nowhere.
        let other = r.ctx.create_cq(4).unwrap();
        drop(std::mem::replace(&mut r.cq, other));
        respond(r, 2, credits(5), 3);
        r.step();
    });
    assert_eq!(taken[Path::Ack as usize], 3);
    assert!(out.completions.is_empty(), "{out:#?}");
    assert!(out.req.starts_with("(3, 3, 3,"), "all retired: {}", out.req);
}

// --- Random Acks, fast paths on and off (hostile review of issue 10) ---

/// A random stream of Acknowledges, RDMA Read Responses Only and Atomic Acknowledges —
/// any PSN around the window, any syndrome byte (an RNR Nak's timer the longest, so that
/// no wait ends within a run), any MSN, Read data of any length — after random Sends,
/// Writes, Reads and Atomics: the Ack, credit and answer fast paths leave what the slow
/// path leaves.
mod random_acks {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u32..600).prop_map(Op::Send),
            (0u32..600).prop_map(Op::Write),
            (0u32..600).prop_map(Op::Read),
            Just(Op::FetchAdd),
            Just(Op::CompareSwap),
        ]
    }

    /// What answers: an Acknowledge, an RDMA Read Response Only of this many bytes, or an
    /// Atomic Acknowledge.
    #[derive(Debug, Clone, Copy)]
    enum Kind {
        Ack,
        ReadOnly(u32),
        AtomicAck,
    }

    /// (PSN relative to the first sent, syndrome byte, MSN, what).
    fn answer() -> impl Strategy<Value = (i32, u8, u32, Kind)> {
        let syndrome = prop_oneof![3 => 0u8..32, 1 => any::<u8>()];
        let kind = prop_oneof![
            3 => Just(Kind::Ack),
            1 => prop_oneof![Just(0u32), Just(8), 0u32..300].prop_map(Kind::ReadOnly),
            1 => Just(Kind::AtomicAck),
        ];
        (
            -3i32..12,
            syndrome,
            prop_oneof![4 => 0u32..12, 1 => any::<u32>()],
            kind,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 128,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn random_acks_leave_what_the_slow_path_leaves(
            n in 0u32..8,
            ops in vec(op(), 1..5),
            acks in vec(answer(), 1..6),
        ) {
            let scenario = |r: &mut Rig| {
                post(r, n, &ops);
                for &(at, syndrome, msn, kind) in &acks {
                    // An RNR Nak waits 655 ms (timer code 0): longer than the run.
                    let syndrome = if syndrome >> 5 == 0b001 { 0b001_00000 } else { syndrome };
                    let psn = Psn::new(0).add(at.rem_euclid(1 << 24) as u32).get();
                    let syndrome = Syndrome::from_u8(syndrome);
                    match kind {
                        Kind::Ack => respond(r, psn, syndrome, msn),
                        Kind::ReadOnly(len) => {
                            let op = Opcode::RdmaReadResponseOnly;
                            let data = vec![0xC3; len as usize];
                            respond_data(r, op, psn, (syndrome, msn), None, &data);
                        }
                        Kind::AtomicAck => {
                            let op = Opcode::AtomicAcknowledge;
                            let orig = Some(u64::from(msn) * 0x0101);
                            respond_data(r, op, psn, (syndrome, msn), orig, &[]);
                        }
                    }
                    r.step();
                }
            };
            same_both_ways(AccessFlags::ALL, &scenario);
        }
    }
}

/// A random stream of single-packet and multi-packet requests — Sends and Writes, with
/// and without immediate data, RDMA Reads and Atomics, at PSNs around ePSN (duplicates
/// among them), payloads inline or by reference (some outside the peer's arena), R_Keys
/// and ranges good or bad (Atomics misaligned or not), receives posted in between — under
/// random access flags: the receive fast paths leave what the pipeline leaves.
mod random_requests {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    /// One step of the peer: a request, or receives posted by the application.
    #[derive(Debug, Clone)]
    enum Step {
        Recv(u64),
        Request {
            op: u8,
            at: i32,
            len: u32,
            direct: Option<u64>,
            reth: (u64, Option<u32>, bool),
        },
    }

    const OPS: [Opcode; 13] = [
        Opcode::RdmaReadRequest,
        Opcode::FetchAdd,
        Opcode::CompareSwap,
        Opcode::SendOnly,
        Opcode::SendOnlyWithImmediate,
        Opcode::RdmaWriteOnly,
        Opcode::RdmaWriteOnlyWithImmediate,
        Opcode::SendFirst,
        Opcode::SendMiddle,
        Opcode::SendLast,
        Opcode::SendLastWithImmediate,
        Opcode::RdmaWriteFirst,
        Opcode::RdmaWriteLast,
    ];

    fn step() -> impl Strategy<Value = Step> {
        let request = (
            // Mostly single-packet requests (the fast paths' own), which leave the QP
            // alive for the next step more often than a stray Middle or Last.
            prop_oneof![3 => 0..7u8, 1 => 0..OPS.len() as u8],
            prop_oneof![6 => Just(0i32), 2 => 1i32..3, 1 => -2i32..5],
            prop_oneof![4 => 0u32..64, 1 => 0u32..400],
            proptest::option::weighted(0.3, prop_oneof![0u64..4096, any::<u64>()]),
            (
                prop_oneof![4 => 0u64..(64 << 10), 1 => any::<u64>()],
                // `None`: the payload's length (the common case).
                prop_oneof![6 => Just(None), 2 => (0u32..400).prop_map(Some), 1 => any::<u32>().prop_map(Some)],
                prop::bool::weighted(0.9),
            ),
        )
            .prop_map(|(op, at, len, direct, reth)| Step::Request {
                op,
                at,
                len,
                direct,
                reth,
            });
        prop_oneof![1 => (0u64..3).prop_map(Step::Recv), 4 => request]
    }

    fn access() -> impl Strategy<Value = AccessFlags> {
        prop_oneof![
            3 => Just(AccessFlags::ALL),
            1 => Just(AccessFlags::LOCAL_WRITE),
            1 => Just(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE),
            1 => Just(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ),
        ]
    }

    /// The responder's ePSN now, as an offset from [`RQ_PSN`].
    pub(super) fn epsn_offset(r: &Rig) -> u32 {
        let qpn = r.qp.qpn();
        let epsn = r
            .ctx
            .shared
            .engine
            .with(|e| e.with_stage(qpn, |q, _| q.proto.resp.epsn))
            .unwrap();
        epsn.get().wrapping_sub(RQ_PSN) & 0xFF_FFFF
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 128,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn random_requests_leave_what_the_pipeline_leaves(
            access in access(),
            steps in vec(step(), 1..8),
        ) {
            let scenario = |r: &mut Rig| {
                for s in &steps {
                    match *s {
                        Step::Recv(n) => r.post_recv(n),
                        Step::Request { op, at, len, direct, reth: (off, rlen, good_key) } => {
                            let op = OPS[usize::from(op)];
                            // `at` counts from the PSN the responder expects now, so that
                            // most requests are new (and some duplicates or ahead).
                            let k = epsn_offset(r).wrapping_add(at.rem_euclid(1 << 24) as u32);
                            let info = op.info().unwrap();
                            let room = crate::wire::slot::SLOT_DATA - info.header_len();
                            let len = if direct.is_none() { len.min(room as u32) } else { len };
                            // A Read or an Atomic carries no payload: `len` is the Read's.
                            let (len, rlen) = if info.payload { (len, rlen) } else { (0, rlen.or(Some(len))) };
                            let direct = direct.filter(|_| info.payload);
                            let mut reth = r.reth(off, rlen.unwrap_or(len));
                            if !good_key {
                                reth.rkey ^= 0x100;
                            }
                            let headers = |p: &mut PacketRepr| {
                                if info.headers.contains(crate::wire::opcode::Headers::RETH) {
                                    p.reth = Some(reth);
                                }
                                if info.headers.contains(crate::wire::opcode::Headers::ATOMIC_ETH) {
                                    // Mostly aligned, as an application's would be.
                                    let va = if off % 5 == 0 { reth.va } else { reth.va & !7 };
                                    p.atomic_eth = Some(crate::wire::AtomicEthRepr {
                                        va,
                                        rkey: reth.rkey,
                                        swap_add: u64::from(len),
                                        compare: 0,
                                    });
                                }
                                if info.immediate {
                                    p.immdt = imm(0x1234);
                                }
                            };
                            match direct {
                                Some(off) => {
                                    let psn = Psn::new(rq(k));
                                    let mut repr = PacketRepr::new(BthRepr::new(op, r.qp.qpn(), psn));
                                    headers(&mut repr);
                                    let mut s = PacketSlot::default();
                                    s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
                                    s.kind = crate::wire::slot::KIND_DIRECT;
                                    s.payload_off = off;
                                    s.payload_len = len;
                                    assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
                                }
                                None => {
                                    let payload = vec![0xA5; len as usize];
                                    r.request(op, k, headers, &payload);
                                }
                            }
                        }
                    }
                    r.step();
                }
            };
            same_both_ways(access, &scenario);
        }
    }
}

/// Posts `ops` (as [`post`] does, without its credits and its engine turns).
fn post_only(r: &mut Rig, first: u64, ops: &[Op]) {
    for (i, &op) in ops.iter().enumerate() {
        let (i, at) = (first + i as u64, 1024 * i as u64);
        let remote = r.mr.remote(4096 + at);
        let (op, len) = op.at(remote);
        let sge = [r.mr.sge(at, len).unwrap()];
        r.qp.post_send(&SendWr::new(i, op, &sge)).unwrap();
    }
}

/// Issue 27's direct post: a post the template path takes, with nothing queued on the
/// link before it, writes its line straight into the link's ring and stamps it — and
/// leaves what the staged way leaves (the fast paths off: the line staged in the link's
/// batch and copied into the ring when the post publishes): the same packets with the same
/// Acks riding in them, completions, statistics, state and memory. Sends, Writes, a Read
/// and Atomics; an owed Ack riding in the first; posts the template path does not take (a
/// payload larger than a line holds, an Atomic waiting for the initiator depth) staged in
/// between.
#[test]
fn a_direct_post_leaves_what_the_staged_post_leaves() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        // Owed Acks held back an iteration, as with the progress helper (the QP has sent
        // a request, so it replies).
        r.ctx.shared.engine.with(|e| e.hold_acks = true);
        r.post_recv(4);
        post(r, 8, &[Op::Send(8)]);
        r.request(Opcode::SendOnly, 0, |_| {}, b"ping");
        r.step();
        post_only(
            r,
            1,
            &[Op::Send(8), Op::Write(12), Op::Send(100), Op::Send(0)],
        );
        respond(r, 4, credits(8), 5);
        r.step();
        post_only(r, 5, &[Op::Read(8), Op::FetchAdd, Op::Send(4)]);
        r.step();
        read_response(r, 5, 6, &[7; 8]);
        r.step();
        atomic_ack(r, 6, 7, 42);
        r.step();
        post_only(r, 8, &[Op::CompareSwap]);
        r.step();
    });
    // The first Send, the Sends of 8 and 0 bytes, the Write, the Read, the Compare and
    // Swap; not the Send of 100 bytes, nor the Fetch and Add (behind the Read), nor the
    // Send behind it.
    let direct = taken[Path::DirectPost as usize];
    assert_eq!(direct, 6, "{out:#?}");
    assert_eq!(out.stats.acks_riding, 1, "{out:#?}");
    assert!(out.riding.iter().any(|r| r.1.is_some()));
}

/// Issue 27's straight post: `Qp::post_send` builds the WQE of a Send or Write of one
/// element or of inline bytes, and of a Read or Atomic into one element, without the
/// general path's checks — and leaves what the general path leaves (the fast paths off):
/// the same packets, header bytes included (a RETH's address, key and length, immediate
/// data, an AtomicETH's operands), completions, statistics, state and memory (a Read's
/// data and an Atomic's original value land where the general path puts them), and the
/// same errors for the requests it hands to the general path (a full queue, inline bytes
/// beyond `max_inline_data`, an element of another protection domain, a misaligned or
/// short Atomic, inline data for a Read, a list longer than `max_send_sge`, a result
/// buffer without `LOCAL_WRITE`, a Read with an initiator depth of 0). Requests it
/// does not take (a list with the `INLINE` flag, a Send with Invalidate) are posted by
/// the general path in between.
#[test]
fn a_straight_post_leaves_what_the_general_post_leaves() {
    use crate::SendFlags;
    use std::cell::RefCell;
    let _inline = super::tests::InlineRigs::of(64);
    fn sge(mr: &crate::Mr, at: u64, len: u32) -> [crate::Sge<'_>; 1] {
        [mr.sge(at, len).unwrap()]
    }
    let errors = RefCell::new(vec![]);
    // The region's elements in flight, looked at along the way.
    let in_flight = RefCell::new(vec![]);
    let scenario = |r: &mut Rig| {
        let look = |r: &Rig| in_flight.borrow_mut().push(r.mr.in_flight());
        let post = |qp: &mut crate::Qp, wr: &SendWr<'_>| {
            if let Err(e) = qp.post_send(wr) {
                // (Without addresses, which differ between two rigs.)
                let text = e
                    .to_string()
                    .split(' ')
                    .filter(|w| w.len() < 10 || !w.starts_with("0x"))
                    .collect::<Vec<_>>()
                    .join(" ");
                errors.borrow_mut().push(format!("{}: {text}", wr.wr_id));
            }
        };
        r.mr.write_at(0, b"0123456789abcdefghijklmnopqrstuv")
            .unwrap();
        respond(r, Psn::new(0).sub(1).get(), credits(16), 0);
        r.step();
        let (mr, sig) = (&r.mr, SendFlags::SIGNALED);
        let remote = |at: u64| mr.remote(4096 + at);
        // Eight requests, the send queue's depth, all straight.
        let solicited = sig | SendFlags::SOLICITED;
        post(
            &mut r.qp,
            &SendWr::new(1, SendOp::Send, &sge(mr, 0, 8)).flags(solicited),
        );
        let imm = SendOp::SendWithImm(0xABCD);
        post(
            &mut r.qp,
            &SendWr::new(2, imm, &sge(mr, 8, 5)).flags(SendFlags::NONE),
        );
        let write = SendOp::RdmaWrite(remote(0));
        post(&mut r.qp, &SendWr::new(3, write, &sge(mr, 16, 12)));
        let write_imm = SendOp::RdmaWriteWithImm(remote(64), 7);
        let fenced = sig | SendFlags::FENCE;
        post(
            &mut r.qp,
            &SendWr::new(4, write_imm, &sge(mr, 0, 3)).flags(fenced),
        );
        post(&mut r.qp, &SendWr::inline(5, SendOp::Send, b"inline!!"));
        post(&mut r.qp, &SendWr::inline(6, SendOp::Send, b""));
        post(&mut r.qp, &SendWr::new(7, SendOp::Send, &sge(mr, 0, 0)));
        let write = SendOp::RdmaWrite(remote(128));
        post(&mut r.qp, &SendWr::inline(8, write, b"abc"));
        // Refused: the queue is full.
        post(&mut r.qp, &SendWr::new(9, SendOp::Send, &sge(mr, 0, 8)));
        look(r);
        r.step();
        // Resent from the fifth: the inline bytes again, from their staging rows.
        let nak = Syndrome::Nak(NakCode::PsnSequenceError);
        respond(r, 4, nak, 4);
        r.step();
        respond(r, 7, credits(16), 8);
        r.step();
        look(r);
        let (mr, qp) = (&r.mr, &mut r.qp);
        let remote = |at: u64| mr.remote(4096 + at);
        // Refused: too many inline bytes, an element of another protection domain.
        post(qp, &SendWr::inline(10, SendOp::Send, &[1; 65]));
        let pd = r.ctx.alloc_pd().unwrap();
        let other = pd.alloc_mr(64, AccessFlags::ALL).unwrap();
        post(qp, &SendWr::new(11, SendOp::Send, &sge(&other, 0, 8)));
        // The general path's: a list inline, a Send with Invalidate.
        let inline = sig | SendFlags::INLINE;
        post(
            qp,
            &SendWr::new(12, SendOp::Send, &sge(mr, 32, 8)).flags(inline),
        );
        let inv = SendOp::SendWithInv(0x55);
        post(qp, &SendWr::new(13, inv, &sge(mr, 0, 4)));
        // Straight again: a Send, a Read, a Fetch and Add and a Compare and Swap.
        let unsignaled = SendFlags::NONE;
        post(
            qp,
            &SendWr::new(14, SendOp::Send, &sge(mr, 40, 8)).flags(unsignaled),
        );
        let read = SendOp::RdmaRead(remote(256));
        post(qp, &SendWr::new(15, read, &sge(mr, 1024, 8)));
        let add = |at| SendOp::FetchAdd {
            remote: remote(at),
            add: 3,
        };
        post(qp, &SendWr::new(16, add(512), &sge(mr, 2048, 8)));
        let cas = SendOp::CompareSwap {
            remote: remote(520),
            compare: 1,
            swap: 2,
        };
        post(qp, &SendWr::new(17, cas, &sge(mr, 2056, 8)));
        // And inline bytes up to `max_inline_data`, behind them (never acknowledged).
        post(qp, &SendWr::inline(24, SendOp::Send, &[7; 64]));
        // Refused: a misaligned Atomic, a short one, inline data for a Read, two elements.
        post(qp, &SendWr::new(18, add(513), &sge(mr, 2048, 8)));
        post(qp, &SendWr::new(19, add(512), &sge(mr, 2048, 4)));
        post(qp, &SendWr::inline(20, read, b"12345678"));
        let two = [mr.sge(0, 4).unwrap(), mr.sge(8, 4).unwrap()];
        post(qp, &SendWr::new(21, SendOp::Send, &two));
        // Refused: a result buffer without LOCAL_WRITE.
        let read_only = r.pd.alloc_mr(64, AccessFlags::REMOTE_READ).unwrap();
        post(qp, &SendWr::new(22, read, &sge(&read_only, 0, 8)));
        look(r);
        r.step();
        // The Read's data and the Atomics' original values land in their buffers.
        read_response(r, 11, 12, b"readdata");
        r.step();
        atomic_ack(r, 12, 13, 42);
        r.step();
        atomic_ack(r, 13, 14, 9);
        r.step();
        // Refused: a Read with an initiator depth of 0 (set in SQD).
        r.qp.modify(&QpAttr::new(QpState::Sqd)).unwrap();
        r.step();
        r.qp.modify(&QpAttr::new(QpState::Sqd).max_rd_atomic(0))
            .unwrap();
        post(&mut r.qp, &SendWr::new(23, read, &sge(&r.mr, 1024, 8)));
        look(r);
    };
    let (out, taken) = same_both_ways(AccessFlags::ALL, &scenario);
    let errors = errors.into_inner();
    let (slow, fast) = errors.split_at(errors.len() / 2);
    assert_eq!(fast, slow, "the same errors both ways");
    let in_flight = in_flight.into_inner();
    assert_eq!(
        in_flight,
        [5, 0, 5, 0, 5, 0, 5, 0],
        "the same elements in flight both ways, all released"
    );
    let refused: Vec<_> = fast.iter().map(|e| e.split(':').next().unwrap()).collect();
    assert_eq!(
        refused,
        ["9", "10", "11", "18", "19", "20", "21", "22", "23"],
        "{fast:#?}"
    );
    assert_eq!(taken[Path::StraightPost as usize], 13, "{out:#?}");
    let done: Vec<_> = out
        .completions
        .iter()
        .map(|c| (c.wr_id, c.status))
        .collect();
    use crate::WcStatus::Success;
    let signaled = [1, 3, 4, 5, 6, 7, 8, 12, 13, 15, 16, 17];
    assert_eq!(
        done,
        signaled.map(|id| (id, Success)),
        "every signaled request completed"
    );
    assert_eq!(&out.memory.0[1024..1032], b"readdata");
    assert_eq!(&out.memory.0[2048..2056], &42u64.to_ne_bytes());
    assert_eq!(&out.memory.0[2056..2064], &9u64.to_ne_bytes());
}

/// A QP in RTR refuses sends on the straight path as on the general one.
#[test]
fn a_straight_post_is_refused_before_rts_as_the_general_post() {
    let errors = std::cell::RefCell::new(vec![]);
    let scenario = |r: &mut Rig| {
        let sge = [r.mr.sge(0, 8).unwrap()];
        for wr in [
            SendWr::new(1, SendOp::Send, &sge),
            SendWr::new(2, SendOp::RdmaRead(r.mr.remote(4096)), &sge),
        ] {
            let e = r.qp.post_send(&wr).expect_err("not in RTS");
            errors.borrow_mut().push(e.to_string());
        }
    };
    let outcomes: Vec<_> = [false, true]
        .map(|fast| run_in(fast, AccessFlags::ALL, QpState::Rtr, &scenario))
        .into();
    assert_eq!(outcomes[0].0, outcomes[1].0);
    assert_eq!(outcomes[1].1[Path::StraightPost as usize], 0);
    let errors = errors.into_inner();
    assert_eq!(errors.len(), 4);
    assert_eq!(errors[..2], errors[2..]);
    assert!(errors[0].contains("RTS"), "{errors:?}");
}

/// A fenced request on the straight post (review 9): `FENCE` reaches the WQE, so a Send of
/// a Read's result buffer, fenced behind the Read, waits for the Read's response and
/// carries the bytes it brought — as on the general path — not the buffer's bytes of
/// when it was posted. (A straight post that dropped the flag passed every other test.)
#[test]
fn a_fenced_straight_post_waits_for_the_read_before_it() {
    use crate::SendFlags;
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
        r.mr.write_at(1024, b"stale!!!").unwrap();
        respond(r, Psn::new(0).sub(1).get(), credits(16), 0);
        r.step();
        let (mr, qp) = (&r.mr, &mut r.qp);
        let into = [mr.sge(1024, 8).unwrap()];
        let read = SendOp::RdmaRead(mr.remote(4096));
        qp.post_send(&SendWr::new(1, read, &into)).unwrap();
        let fenced = SendFlags::SIGNALED | SendFlags::FENCE;
        qp.post_send(&SendWr::new(2, SendOp::Send, &into).flags(fenced))
            .unwrap();
        r.step();
        read_response(r, 0, 1, b"readdata");
        r.step();
        respond(r, 1, credits(16), 2);
        r.step();
    });
    assert_eq!(taken[Path::StraightPost as usize], 2, "{out:#?}");
    let ops: Vec<_> = out.sent.iter().map(|s| (s.0, s.1)).collect();
    assert_eq!(
        ops,
        [(Opcode::RdmaReadRequest, 0), (Opcode::SendOnly, 1)],
        "{out:#?}"
    );
    assert_eq!(
        out.bodies[1].5, b"readdata",
        "the Send carries the Read's bytes"
    );
    let done: Vec<_> = out
        .completions
        .iter()
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        done,
        [(1, crate::WcStatus::Success), (2, crate::WcStatus::Success)]
    );
}

/// Where the capture tap (a packet observer) or the fault stage must see a post's packet
/// in the link's batch, the post stages it there, as before issue 27's direct post: the
/// observer sees it sent, and the fault stage duplicates it.
#[test]
fn with_a_tap_or_a_fault_stage_a_post_is_staged_where_they_see_it() {
    use crate::trace::Direction;
    use std::sync::{Arc, Mutex};
    let direct = || crate::probe::taken(Path::DirectPost);
    // The packet observer.
    let mut r = super::tests::rig(AccessFlags::ALL);
    let seen: Arc<Mutex<Vec<(Direction, Opcode)>>> = Arc::default();
    let s2 = seen.clone();
    r.ctx
        .observe_packets(move |e| s2.lock().unwrap().push((e.direction, e.headers.bth.opcode)));
    let before = direct();
    post(&mut r, 8, &[Op::Send(8), Op::Write(8)]);
    assert_eq!(direct(), before, "no direct post under the tap");
    let sent: Vec<_> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.0 == Direction::Sent)
        .map(|e| e.1)
        .collect();
    assert_eq!(sent, [Opcode::SendOnly, Opcode::RdmaWriteOnly]);
    assert_eq!(r.answers().len(), 2);
    // Without it, the same posts go direct.
    r.ctx.stop_observing();
    post_only(&mut r, 2, &[Op::Send(8)]);
    assert_eq!(direct(), before + 1);
    assert_eq!(r.answers().len(), 1);

    // The fault stage, duplicating every packet.
    let mut r = duplicating_rig();
    let before = direct();
    post(&mut r, 8, &[Op::Send(8)]);
    assert_eq!(direct(), before, "no direct post under the fault stage");
    let answers = r.answers();
    let sends = answers.iter().filter(|a| a.0 == Opcode::SendOnly).count();
    assert_eq!(sends, 2, "sent twice: {answers:?}");
}

/// The answers of the receive fast paths of Reads and Atomics, built in the link's batch
/// in the receive step, are left to the pipeline where the capture tap or the fault stage
/// must see what is sent (they look at what step 3 sends): the observer sees the Read
/// Response and the Atomic Acknowledge sent, and the fault stage duplicates them. Without
/// a tap or fault stage the same requests take the fast paths, staged (review 9: the
/// fast paths' answers under a tap or a fault stage passed every other test).
#[test]
fn with_a_tap_or_a_fault_stage_reads_and_atomics_are_answered_where_they_see_it() {
    use crate::trace::Direction;
    use std::sync::{Arc, Mutex};
    let taken = |p: Path| crate::probe::taken(p);
    let requests = |r: &mut Rig, k: u32| {
        r.mr.write_at(64, b"tapped!!").unwrap();
        // (Each in its burst: the rig's QP has one responder resource.)
        read_request(r, k, 64, 8);
        r.step();
        atomic_request(r, Opcode::FetchAdd, k + 1, 128, (1, 0));
        r.step();
    };
    // The packet observer.
    let mut r = super::tests::rig(AccessFlags::ALL);
    let seen: Arc<Mutex<Vec<(Direction, Opcode)>>> = Arc::default();
    let s2 = seen.clone();
    r.ctx
        .observe_packets(move |e| s2.lock().unwrap().push((e.direction, e.headers.bth.opcode)));
    let before = (
        taken(Path::Read),
        taken(Path::Atomic),
        taken(Path::DirectPost),
    );
    requests(&mut r, 0);
    let after = (
        taken(Path::Read),
        taken(Path::Atomic),
        taken(Path::DirectPost),
    );
    let sent: Vec<_> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.0 == Direction::Sent)
        .map(|e| e.1)
        .collect();
    assert_eq!(
        sent,
        [Opcode::RdmaReadResponseOnly, Opcode::AtomicAcknowledge],
        "the observer sees both answers sent"
    );
    assert_eq!(after, before, "no fast answer under the tap");
    let ops: Vec<_> = r.answers().iter().map(|a| (a.0, a.1)).collect();
    assert_eq!(
        ops,
        [
            (Opcode::RdmaReadResponseOnly, 0),
            (Opcode::AtomicAcknowledge, 1)
        ]
    );
    // Without it, the next two take the fast paths (staged: not straight into the ring).
    r.ctx.stop_observing();
    requests(&mut r, 2);
    let after = (
        taken(Path::Read),
        taken(Path::Atomic),
        taken(Path::DirectPost),
    );
    assert_eq!(after, (before.0 + 1, before.1 + 1, before.2));
    assert_eq!(r.answers().len(), 2);

    // The fault stage, duplicating every packet.
    let mut r = duplicating_rig();
    let before = (
        taken(Path::Read),
        taken(Path::Atomic),
        taken(Path::DirectPost),
    );
    requests(&mut r, 0);
    r.step();
    let after = (
        taken(Path::Read),
        taken(Path::Atomic),
        taken(Path::DirectPost),
    );
    let answers = r.answers();
    let count = |op| answers.iter().filter(|a| a.0 == op).count();
    assert_eq!(
        (
            count(Opcode::RdmaReadResponseOnly),
            count(Opcode::AtomicAcknowledge)
        ),
        (2, 2),
        "each sent twice: {answers:?}"
    );
    assert_eq!(after, before, "no fast answer under the fault stage");
}

/// Issue 27's owed Ack: the QP of an owed Ack listed in the owed lists' first word (no
/// list touched) and the Ack's credit code kept with the count it encodes leave what the
/// lists and a fresh count leave: an Ack held back rides in the answer with the credits of
/// the ride (receives posted between the request and the answer counted), one not
/// answered leaves alone an iteration later, and one owed when the QP moves to Error
/// leaves before it.
#[test]
fn owed_acks_in_the_first_word_with_kept_credit_codes_leave_what_the_lists_leave() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        // Owed Acks held back an iteration, as with the progress helper; the QP has sent
        // a request, so it replies.
        r.ctx.shared.engine.with(|e| e.hold_acks = true);
        r.post_recv(4);
        post(r, 8, &[Op::Send(8)]);
        // Pings answered at once, each receive re-posted before the answer: their Acks
        // ride, the second with the credit code kept from the first's count (4).
        for k in 0..2 {
            r.request(Opcode::SendOnly, k, |_| {}, b"ping");
            r.step();
            r.post_recv(1);
            post_only(r, 1 + u64::from(k), &[Op::Send(8)]);
            r.step();
        }
        // Two receives posted between a ping and its answer: the riding Ack reports the
        // count of the ride (5), not the one kept (4).
        r.request(Opcode::SendOnly, 2, |_| {}, b"pin3");
        r.step();
        r.post_recv(2);
        post_only(r, 3, &[Op::Send(8)]);
        r.step();
        // Not answered: held back an iteration, then alone (4 left).
        r.request(Opcode::SendOnly, 3, |_| {}, b"pin4");
        r.step();
        r.step();
        // Owed when the QP moves to Error: it leaves first (3 left).
        r.request(Opcode::SendOnly, 4, |_| {}, b"pin5");
        r.step();
        r.qp.modify(&QpAttr::new(QpState::Error)).unwrap();
    });
    assert!(taken[Path::OwedFirst as usize] >= 4, "{taken:?}");
    assert!(taken[Path::CreditCache as usize] >= 1, "{taken:?}");
    // The last two Acks (the rig's look at the link takes what the posts' engine turns
    // sent before): alone an iteration later with the 4 receives left, and before the
    // move to Error with 3.
    let acks: Vec<_> = out
        .sent
        .iter()
        .filter(|s| s.0 == Opcode::Acknowledge)
        .copied()
        .collect();
    assert_eq!(acks, [ack(3, 4, 4), ack(4, 5, 3)], "{out:#?}");
}

/// Publishes a Send Only of nothing at PSN offset `k` carrying a riding Ack of our PSN
/// `psn` with `syndrome` and MSN `msn` in its line (a receive must be posted for it).
fn riding(r: &mut Rig, k: u32, psn: u32, syndrome: Syndrome, msn: u32) {
    let repr = PacketRepr::new(BthRepr::new(Opcode::SendOnly, r.qp.qpn(), Psn::new(rq(k))));
    let mut s = PacketSlot::default();
    s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
    let word = crate::wire::slot::riding_word(psn, syndrome.to_u8(), msn);
    assert!(crate::wire::slot::set_riding_ack(&mut s, word));
    assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
}

/// Posts an 8-byte Send `wr_id`, signaled or not, from offset `at` of the rig's region.
fn post_signaled(r: &mut Rig, wr_id: u64, at: u64, signaled: bool) {
    let sge = [r.mr.sge(at, 8).unwrap()];
    let flags = if signaled {
        crate::SendFlags::SIGNALED
    } else {
        crate::SendFlags::NONE
    };
    r.qp.post_send(&SendWr::new(wr_id, SendOp::Send, &sge).flags(flags))
        .unwrap();
}

/// Acks riding in requests (issue 27), taken in their carrier's receive step: each case
/// leaves what the slow path leaves (packets, completions, statistics, memory, state), and
/// only the Acks that complete the oldest WQEs exactly take the Ack fast path — one
/// completing several WQEs, unsignaled ones among them, and Acks whose credit count
/// changes; not a duplicate (its credits only), an Ack of a PSN never sent, one inside a
/// two-packet Send behind a one-packet Send (passed over first, then refused: the Send
/// must not stay done), one at a Read's PSN (a Read outstanding), a riding Nak. After an
/// RNR Nak an Ack of both Sends is the fast path's, as a standalone one is.
#[test]
fn riding_acks_take_the_ack_fast_path_only_where_the_slow_path_agrees() {
    type Case = (&'static str, u64, &'static dyn Fn(&mut Rig));
    let cases: [Case; 9] = [
        ("several, unsignaled among them", 1, &|r| {
            post(r, 8, &[Op::Send(4)]);
            post_signaled(r, 1, 1024, false);
            post_signaled(r, 2, 2048, false);
            post_signaled(r, 3, 3072, true);
            post_signaled(r, 4, 4096, false);
            r.step();
            riding(r, 0, 3, credits(6), 4);
            r.step();
        }),
        ("a duplicate", 1, &|r| {
            post(r, 8, &[Op::Send(4), Op::Send(4)]);
            riding(r, 0, 0, credits(6), 1);
            r.step();
            riding(r, 1, 0, credits(2), 1);
            r.step();
        }),
        ("a PSN never sent", 0, &|r| {
            post(r, 8, &[Op::Send(4)]);
            riding(r, 0, 1, credits(6), 2);
            r.step();
        }),
        ("credit changes", 2, &|r| {
            // One credit: the second Send waits for the first one's Ack to grant more.
            post(r, 1, &[Op::Send(4), Op::Send(4), Op::Send(4)]);
            riding(r, 0, 0, credits(1), 1);
            r.step();
            r.step();
            riding(r, 1, 1, credits(4), 2);
            r.step();
            r.step();
        }),
        ("inside a two-packet Send", 0, &|r| {
            post(r, 8, &[Op::Send(4), Op::Send(300)]);
            riding(r, 0, 1, credits(6), 1);
            r.step();
        }),
        ("a Read outstanding", 0, &|r| {
            post(r, 8, &[Op::Send(4), Op::Read(4), Op::Send(4)]);
            riding(r, 0, 1, credits(6), 2);
            r.step();
        }),
        ("a Send before a Read", 1, &|r| {
            post(r, 8, &[Op::Send(4), Op::Read(4)]);
            riding(r, 0, 0, credits(6), 1);
            r.step();
        }),
        ("a Nak", 0, &|r| {
            post(r, 8, &[Op::Send(4)]);
            riding(r, 0, 0, Syndrome::Nak(NakCode::RemoteAccessError), 1);
            r.step();
        }),
        ("after an RNR Nak", 1, &|r| {
            post(r, 8, &[Op::Send(4), Op::Send(4)]);
            respond(
                r,
                0,
                Syndrome::RnrNak {
                    timer: RnrTimer::new(20),
                },
                0,
            );
            r.step();
            riding(r, 0, 1, credits(7), 2);
            r.step();
        }),
    ];
    for (name, fast, case) in cases {
        let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
            r.post_recv(4);
            case(r);
        });
        assert_eq!(taken[Path::Ack as usize], fast, "{name}: {out:#?}");
        if name == "several, unsignaled among them" {
            let sends: Vec<_> = out
                .completions
                .iter()
                .filter(|c| c.opcode == crate::WcOpcode::Send)
                .map(|c| c.wr_id)
                .collect();
            assert_eq!(sends, [0, 3], "{name}");
            assert!(out.req.starts_with("(4, 5, 5,"), "{name}: {}", out.req);
        }
    }
}

/// Review 4: issue 27's ping-pong paths (the Send Only parse, the straight receive, the
/// owed Ack's first word, the kept credit code, the template post with its riding Ack)
/// against the slow paths, over random interleavings of pings (in sequence, duplicate or
/// ahead), receives posted with no engine turn between, answers posted, Acks of the
/// answers, extra iterations, with owed Acks held back or not, and a move to Error (or
/// SQD) at the end.
mod review4_random_pingpong {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        /// A Send Only of `len` bytes at ePSN + `at`, with or without SE.
        Ping { at: i32, len: u8, se: bool },
        /// `n` receives posted, no engine turn.
        Recv(u8),
        /// A Send posted (the template path, with the owed Ack riding).
        Answer,
        /// The peer acknowledges every answer sent so far (credits `credits`).
        AckAll { credits: u16 },
        /// One more engine iteration.
        Turn,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            5 => (prop_oneof![6 => Just(0i32), 1 => -1i32..3], 0u8..29, prop::bool::weighted(0.2))
                .prop_map(|(at, len, se)| Step::Ping { at, len, se }),
            2 => (0u8..3).prop_map(Step::Recv),
            3 => Just(Step::Answer),
            1 => (0u16..40).prop_map(|credits| Step::AckAll { credits }),
            2 => Just(Step::Turn),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 256,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn review4_random_pingpongs_leave_what_the_slow_paths_leave(
            hold in any::<bool>(),
            recvs in 0u8..5,
            steps in vec(step(), 1..16),
            end in 0u8..3,
        ) {
            let scenario = |r: &mut Rig| {
                let mut receives = random_round_start(r, hold, 0, recvs);
                let mut answers = 0u32;
                for s in &steps {
                    match *s {
                        Step::Ping { at, len, se } => {
                            let k = super::random_requests::epsn_offset(r).wrapping_add(at as u32);
                            let payload: Vec<u8> = (0..len).collect();
                            let psn = Psn::new(RQ_PSN).add(k);
                            let mut bth = BthRepr::new(Opcode::SendOnly, r.qp.qpn(), psn);
                            bth.solicited = se;
                            let repr = PacketRepr::new(bth);
                            let mut sl = PacketSlot::default();
                            sl.hdr_len = repr.emit(&mut sl.data).unwrap() as u8;
                            if len > 0 {
                                sl.kind = crate::wire::slot::KIND_INLINE;
                                sl.payload_len = u32::from(len);
                                let h = usize::from(sl.hdr_len);
                                sl.data[h..h + payload.len()].copy_from_slice(&payload);
                            }
                            assert_eq!(r.tx.push_burst(&[sl]).unwrap(), 1);
                            r.step();
                        }
                        Step::Recv(n) => receives.post(r, n),
                        Step::Answer if answers < 7 => {
                            post_only(r, u64::from(answers), &[Op::Send(8)]);
                            answers += 1;
                        }
                        Step::Answer => {}
                        Step::AckAll { credits: c } => {
                            if answers > 0 {
                                respond(r, answers - 1, credits(u32::from(c)), answers);
                                r.step();
                            }
                        }
                        Step::Turn => r.step(),
                    }
                }
                match end {
                    0 => {}
                    1 => r.qp.modify(&QpAttr::new(QpState::Error)).unwrap(),
                    _ => {
                        let _ = r.qp.modify(&QpAttr::new(QpState::Sqd));
                    }
                }
            };
            same_both_ways(AccessFlags::ALL, &scenario);
        }
    }
}

/// The receive WQEs a random round posts: 512 bytes each, the `n`th at `base` + 512 × (`n`
/// mod 32), `n` its ID.
struct Receives {
    base: u64,
    next: u64,
}

impl Receives {
    /// Posts `n` more.
    fn post(&mut self, r: &mut Rig, n: u8) {
        for _ in 0..n {
            let at = self.base + (self.next % 32) * 512;
            let sge = [r.mr.sge(at, 512).unwrap()];
            r.qp.post_recv(&RecvWr::new(self.next, &sge)).unwrap();
            self.next += 1;
        }
    }
}

/// The start of a random round: the owed Acks held back or not, credits for the answers
/// (the peer's Ack of nothing), then `recvs` receives at `base`, with no turn between.
fn random_round_start(r: &mut Rig, hold: bool, base: u64, recvs: u8) -> Receives {
    r.ctx.shared.engine.with(|e| e.hold_acks = hold);
    respond(r, Psn::new(0).sub(1).get(), credits(1000), 0);
    r.step();
    let mut receives = Receives { base, next: 0 };
    receives.post(r, recvs);
    receives
}

// --- Review 5 (branch ack-retire): random rounds of posts and Acks, both ways ---

/// Random rounds against the rewritten Ack fast path (one pass marking WQEs done and
/// unmarking them on a refusal, the MSN/last-WQE credit shortcut, the retire without
/// asking): posts of Sends, Writes (one or several packets), Reads and Atomics, signaled
/// or not; standalone and riding Acks at PSNs around the first unacknowledged one, any
/// syndrome byte, MSNs around the last SSN (or any); the application's polls in between
/// (the shared CQ fills). Fast paths on and off must leave the same.
mod review5_random_rounds {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;
    use std::cell::Cell;

    #[derive(Debug, Clone)]
    enum Act {
        Post(Vec<(Op, bool)>),
        Ack {
            at: i32,
            syndrome: u8,
            msn: Result<i32, u32>,
            riding: bool,
        },
        Poll(usize),
        Step,
        /// To SQD (true) or back to RTS (false).
        Drain(bool),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u32..600).prop_map(Op::Send),
            2 => (0u32..600).prop_map(Op::Write),
            1 => (0u32..600).prop_map(Op::Read),
            1 => Just(Op::FetchAdd),
        ]
    }

    fn act() -> impl Strategy<Value = Act> {
        let syndrome = prop_oneof![20 => 0u8..32, 1 => any::<u8>()];
        let msn = prop_oneof![4 => (-6i32..3).prop_map(Ok), 1 => any::<u32>().prop_map(Err)];
        prop_oneof![
            3 => vec((op(), prop_oneof![Just(true), Just(false)]), 1..6).prop_map(Act::Post),
            6 => (prop_oneof![1 => 0x40i32..0x4B, 2 => 0i32..5], syndrome, msn, any::<bool>()).prop_map(|(at, syndrome, msn, riding)| {
                Act::Ack { at, syndrome, msn, riding }
            }),
            1 => (0usize..20).prop_map(Act::Poll),
            1 => Just(Act::Step),
            1 => any::<bool>().prop_map(Act::Drain),
        ]
    }

    /// The first PSN not acknowledged and the WQEs fetched (the SSN of the last); with
    /// `end` = j < 0x40, the last PSN of started WQE j from the oldest, if there is one.
    fn window(r: &Rig, end: i32) -> (Psn, u64) {
        let qpn = r.qp.qpn();
        r.ctx.shared.engine.with(|e| {
            e.with_stage(qpn, |q, _| {
                let w = q.proto.req.window();
                let seq = w.retired() + (end & 0x3F) as u64;
                if end >= 0x40 || seq >= w.started() {
                    (w.acked().add(1), w.fetched())
                } else {
                    (w.wqe(seq).last_psn(), w.fetched())
                }
            })
            .unwrap()
        })
    }

    fn post_one(r: &mut Rig, id: u64, op: Op, signaled: bool) {
        let at = (id % 24) * 1024;
        let remote = r.mr.remote(32768 + (id % 8) * 1024);
        let (op, len) = op.at(remote);
        let sge = [r.mr.sge(at, len).unwrap()];
        let flags = if signaled {
            crate::SendFlags::SIGNALED
        } else {
            crate::SendFlags::NONE
        };
        let _ = r.qp.post_send(&SendWr::new(id, op, &sge).flags(flags));
    }

    static TAKEN_ACK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    static TAKEN_CREDITS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    static RIDING: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 1000,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn review5_random_rounds_leave_what_the_slow_path_leaves(
            n in 0u32..10,
            acts in vec(act(), 1..40),
            sq_psn in prop_oneof![Just(0u32), 0xFF_FFF0u32..0x100_0000],
        ) {
            super::super::tests::SQ_PSN.with(|p| p.set(sq_psn));
            let polled = std::cell::RefCell::new(Vec::<Vec<crate::WorkCompletion>>::new());
            let scenario = |r: &mut Rig| {
                polled.borrow_mut().push(vec![]);
                let (ids, carrier) = (Cell::new(0u64), Cell::new(0u32));
                r.post_recv(32);
                respond(r, Psn::new(sq_psn).sub(1).get(), credits(n), 0);
                r.step();
                for a in &acts {
                    match a {
                        Act::Post(ops) => {
                            for &(op, signaled) in ops {
                                post_one(r, ids.get(), op, signaled);
                                ids.set(ids.get() + 1);
                            }
                            r.step();
                        }
                        &Act::Ack { at, syndrome, msn, riding: ride } => {
                            let (first, fetched) = window(r, at);
                            let psn = if at >= 0x40 { first.add((at - 0x43).rem_euclid(1 << 24) as u32) } else { first }.get();
                            let msn = match msn {
                                Ok(d) => (fetched as i64 + i64::from(d)).rem_euclid(1 << 24) as u32,
                                Err(any) => any,
                            };
                            let syndrome = if syndrome >> 5 == 0b001 { 0b001_00000 } else { syndrome };
                            if ride && syndrome >> 5 == 0 {
                                riding(r, carrier.get(), psn, Syndrome::from_u8(syndrome), msn & 0xFF_FFFF);
                                carrier.set(carrier.get() + 1);
                            } else {
                                respond(r, psn, Syndrome::from_u8(syndrome), msn);
                            }
                            r.step();
                        }
                        &Act::Poll(k) => {
                            let mut wc = [crate::WorkCompletion::default(); 20];
                            let got = r.cq.poll(&mut wc[..k]);
                            polled.borrow_mut().last_mut().unwrap().extend_from_slice(&wc[..got]);
                        }
                        Act::Step => r.step(),
                        &Act::Drain(sqd) => {
                            let to = if sqd { QpState::Sqd } else { QpState::Rts };
                            let _ = r.qp.modify(&QpAttr::new(to));
                            r.step();
                        }
                    }
                }
            };
            let (out, taken) = same_both_ways(AccessFlags::ALL, &scenario);
            TAKEN_ACK.fetch_add(taken[Path::Ack as usize], std::sync::atomic::Ordering::Relaxed);
            TAKEN_CREDITS.fetch_add(taken[Path::Credits as usize], std::sync::atomic::Ordering::Relaxed);
            RIDING.fetch_add(out.stats.acks_riding, std::sync::atomic::Ordering::Relaxed);
            if std::env::var_os("REVIEW5_SHOW").is_some() {
                eprintln!("ack {} credits {} {:?}", TAKEN_ACK.load(std::sync::atomic::Ordering::Relaxed), TAKEN_CREDITS.load(std::sync::atomic::Ordering::Relaxed), out.stats);
            }
            let polled = polled.into_inner();
            prop_assert_eq!(&polled[0], &polled[1], "the completions polled on the way");
        }
    }
}

/// Review 5 (pre-existing, not from `ack-retire`): the responder's MSN counts messages; a
/// memory window bind posted on the send queue is none (no PSN, never sent), but the
/// requester numbers it in its SSN. With one credit, a Bind, then a Send and a Send of
/// three packets (limited: its first packet probes): the Ack of the first Send (MSN 1: the
/// responder completed its first message) granting one more receive lets the second Send
/// go on, as it does without the Bind. With the Bind the MSN is
/// taken to name the Bind, whose consuming count is one less: the credit is lost and the
/// second Send waits, limited (stop-and-wait from then on while credits are tight).
#[test]
fn review5_a_memory_window_bind_takes_no_credit() {
    let run = |bind: bool| {
        let mut r = super::tests::rig(AccessFlags::ALL);
        respond(&mut r, Psn::new(0).sub(1).get(), credits(1), 0);
        r.step();
        let _keep;
        if bind {
            let mr =
                r.pd.alloc_mr(4096, AccessFlags::ALL | AccessFlags::MW_BIND)
                    .unwrap();
            let mw = r.pd.alloc_mw(crate::MwType::Two).unwrap();
            let rkey = mw.rkey_with_tag(1);
            let bind = mr.mw_bind(0, 64, AccessFlags::REMOTE_READ);
            let wr = SendWr::new(9, SendOp::BindMw { rkey, bind }, &[]);
            r.qp.post_send(&wr).unwrap();
            r.step();
            r.step();
            _keep = (mr, mw);
        }
        post_only(&mut r, 1, &[Op::Send(8), Op::Send(600)]);
        r.step();
        let before: Vec<_> = sent_with_bodies(&mut r).0;
        // The responder completed message 1 (the first Send, PSN 0) and grants one more.
        respond(&mut r, 0, credits(1), 1);
        r.step();
        r.step();
        let after: Vec<_> = sent_with_bodies(&mut r).0;
        let sends = |v: &[Sent]| v.iter().filter(|s| s.2.is_none()).count();
        (sends(&before), sends(&after))
    };
    // Without a Bind: the first Send and the first packet of the second (limited: it
    // probes), then its two others on the Ack's credit.
    assert_eq!(
        run(false),
        (2, 2),
        "without a Bind: the second Send goes on the Ack"
    );
    assert_eq!(
        run(true),
        run(false),
        "a Bind is no message: it takes no credit"
    );
}

/// The empty poll's shortcut (`Engine::idle_now`) against full iterations: idle polls
/// between the requester's Sends and their Acks, between the peer's requests, over more
/// than a stats period (the shortcut counts down to the publication as the full iteration
/// does), with receives posted and the peer's frames arriving while the engine is idle,
/// leave what full iterations leave.
#[test]
fn idle_polls_leave_what_full_iterations_leave() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        let idle = |r: &mut Rig, n: u32| {
            for _ in 0..n {
                r.step();
            }
        };
        idle(r, 50);
        post(r, 8, &[Op::Send(4), Op::Write(4)]);
        idle(r, 20);
        respond(r, 1, credits(6), 2);
        idle(r, crate::stats_area::PUBLISH_EVERY + 20);
        for (k, at) in [(0, 512), (1, 1024)] {
            r.qp.post_recv(&RecvWr::new(
                70 + u64::from(k),
                &[r.mr.sge(at, 64).unwrap()],
            ))
            .unwrap();
            idle(r, 20);
            request_direct(r, Opcode::SendOnly, k, 4);
            idle(r, 20);
        }
    });
    assert!(
        taken[Path::IdlePoll as usize] > u64::from(crate::stats_area::PUBLISH_EVERY),
        "the idle polls took the shortcut: {taken:?}"
    );
    assert_eq!(out.completions.len(), 4, "{:?}", out.completions);
}

/// A rig whose engine has a fault stage that duplicates every packet it sends.
fn duplicating_rig() -> super::tests::Rig {
    let r = super::tests::rig(AccessFlags::ALL);
    r.ctx.shared.engine.with(|e| {
        let cfg = crate::fault::FaultConfig {
            duplicate: 1.0,
            ..Default::default()
        };
        e.faults = Some(Box::new(crate::fault::Faults::new(cfg, None)));
    });
    r
}

/// The engine's straight Send (`Engine::post_send_straight`) leaves the engine's own
/// bookkeeping as the general post does: after a Send in which the owed Ack of a ping
/// rode (held back an iteration, as with the progress helper), no Ack is owed or held
/// and the QP has its turn in the active set; a Send on a link taken down is not sent (it
/// waits in the window, and the QP goes to the Error state at the next iteration) — the
/// same packets, completions and state both ways.
#[test]
fn a_straight_send_leaves_the_engines_bookkeeping_as_the_general_send() {
    let states = std::cell::RefCell::new(vec![]);
    let look = |r: &Rig| {
        let index = r.qp.index;
        let state = r.ctx.shared.engine.with(|e| e.post_state(index));
        states.borrow_mut().push(state);
    };
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.ctx.shared.engine.with(|e| e.hold_acks = true);
        r.post_recv(4);
        post(r, 8, &[Op::Send(8)]);
        look(r);
        for k in 0..2 {
            r.request(Opcode::SendOnly, k, |_| {}, b"ping");
            r.step();
            look(r);
            post_only(r, 1 + u64::from(k), &[Op::Send(8)]);
            look(r);
            r.step();
        }
        // The link taken down: the next Send waits.
        let link = r.qp.query().config.dest.unwrap().link;
        r.ctx
            .shared
            .engine
            .with(|e| e.link_down(link, "the test took it down".into()));
        post_only(r, 3, &[Op::Send(8)]);
        look(r);
        r.step();
    });
    let states = states.into_inner();
    let (slow, fast) = states.split_at(states.len() / 2);
    assert_eq!(fast, slow, "the same bookkeeping both ways");
    // (Owed, held, active.)
    assert_eq!(
        fast[1],
        (true, true, false),
        "the ping's Ack held back: {fast:?}"
    );
    assert_eq!(
        fast[2],
        (false, false, true),
        "it rode in the Send: {fast:?}"
    );
    assert_eq!(out.stats.acks_riding, 2, "{out:#?}");
    assert_eq!(taken[Path::StraightPost as usize], 4, "{out:#?}");
    // (Review 10: the engine's own straight post took the three on a live link, not
    // `post_direct` after it declined.)
    assert_eq!(taken[Path::StraightSend as usize], 3, "{taken:?}");
    assert_eq!(out.state, QpState::Error, "{out:#?}");
    let sends = out.sent.iter().filter(|s| s.0 == Opcode::SendOnly).count();
    assert_eq!(sends, 3, "not the Send on the link taken down: {out:#?}");
}

/// The verbs C ABI's Send of one element (`Qp::post_send_single`) goes through the
/// engine's straight post as `post_send`'s Sends do, with its ID and flags: each Send
/// leaves what the general post leaves, only the signaled ones complete (with their IDs),
/// and the solicited one has the SE bit set.
#[test]
fn a_single_element_send_of_the_verbs_abi_leaves_what_the_general_post_leaves() {
    use crate::SendFlags;
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        respond(r, Psn::new(0).sub(1).get(), credits(16), 0);
        r.step();
        r.mr.write_at(0, b"0123456789abcdef").unwrap();
        let sge = r.mr.sge(4, 8).unwrap();
        let sig = SendFlags::SIGNALED;
        for (id, flags) in [
            (10, sig | SendFlags::SOLICITED),
            (11, SendFlags::NONE),
            (12, sig),
        ] {
            r.qp.post_send_single(id, flags, &sge).unwrap();
        }
        r.step();
        respond(r, 2, credits(16), 3);
        r.step();
    });
    assert_eq!(taken[Path::DirectPost as usize], 3, "{out:#?}");
    assert_eq!(taken[Path::StraightSend as usize], 3, "{taken:?}");
    let done: Vec<_> = out.completions.iter().map(|c| c.wr_id).collect();
    assert_eq!(done, [10, 12], "{out:#?}");
    let se: Vec<_> = out.headers.iter().map(|h| h[1] & 0x80 != 0).collect();
    assert_eq!(se, [true, false, false], "{out:#?}");
    assert!(out.bodies.iter().all(|b| b.5 == b"456789ab"), "{out:#?}");
}

// --- The straight receive step (issue 27, items 6 and 9) ---

/// A Send Only at PSN offset `k` with `payload` inline and, with `ack` (PSN, MSN), a
/// positive Ack of ours riding in it (credits for 8), as a requester's straight post
/// writes it.
fn ping_slot(r: &Rig, k: u32, payload: &[u8], ack: Option<(u32, u32)>) -> PacketSlot {
    let repr = PacketRepr::new(BthRepr::new(Opcode::SendOnly, r.qp.qpn(), Psn::new(rq(k))));
    line_slot(repr, payload, ack)
}

/// The line of request `repr` with `payload` inline and, with `ack` (PSN, MSN), a
/// positive Ack of ours riding in it (credits for 8), as a requester's straight post
/// writes it.
fn line_slot(repr: PacketRepr, payload: &[u8], ack: Option<(u32, u32)>) -> PacketSlot {
    let mut s = PacketSlot::default();
    s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
    s.kind = crate::wire::slot::KIND_INLINE;
    s.payload_len = payload.len() as u32;
    let at = usize::from(s.hdr_len);
    s.data[at..at + payload.len()].copy_from_slice(payload);
    if let Some((psn, msn)) = ack {
        let word = crate::wire::slot::riding_word(psn, credits(8).to_u8(), msn);
        assert!(crate::wire::slot::set_riding_ack(&mut s, word));
    }
    s
}

/// Publishes [`ping_slot`]'s line.
fn ping(r: &mut Rig, k: u32, payload: &[u8], ack: Option<(u32, u32)>) {
    let s = ping_slot(r, k, payload, ack);
    assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
}

/// A ping-pong's receiving half on the straight receive step (issue 27): each ping a lone
/// Send Only line carrying the Ack of our last Send, taken straight, its Ack held back
/// and riding in the answer, the iteration ended without steps 3 to 5 — over more than
/// a timer period (an iteration that checks timers runs them) — leaves what the full
/// step leaves; so does a ping not answered, whose Ack leaves alone one iteration later.
#[test]
fn lone_send_onlys_take_the_straight_receive_step_as_the_full_one() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.ctx.shared.engine.with(|e| e.hold_acks = true);
        r.post_recv(4);
        post(r, 8, &[Op::Send(8)]);
        // (The credits' Ack held the straight step back some full iterations.)
        r.ctx.shared.engine.with(|e| e.straight_skip = 0);
        for k in 0..12u32 {
            ping(r, k, b"ping", Some((k, k + 1)));
            r.step();
            let sge = [r.mr.sge(2048 + 64 * u64::from(k), 64).unwrap()];
            r.qp.post_recv(&RecvWr::new(100 + u64::from(k), &sge))
                .unwrap();
            post_only(r, 1 + u64::from(k), &[Op::Send(8)]);
            r.step();
        }
        // (The Sends so far, each with an Ack riding in it, out of the way.)
        let sends = r.answers();
        assert!(sends.iter().all(|a| a.0 == Opcode::SendOnly), "{sends:?}");
        ping(r, 12, b"last", Some((12, 13)));
        r.step();
        assert!(r.answers().is_empty(), "held back an iteration");
        r.step();
        let acks = r.answers();
        assert_eq!(acks.len(), 1, "then sent alone: {acks:?}");
        assert_eq!(acks[0].0, Opcode::Acknowledge);
    });
    assert_eq!(taken[Path::StraightReceive as usize], 13, "{taken:?}");
    assert_eq!(out.completions.len(), 13 + 13, "{:?}", out.completions);
    assert_eq!(out.stats.acks_riding, 12, "{out:#?}");
}

/// Two lines in the ring at once: the first is not lone, and the full step takes both
/// (and the look that found it holds the straight step back a few iterations).
#[test]
fn two_lines_at_once_take_the_full_receive_step() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.post_recv(4);
        ping(r, 0, b"one", None);
        ping(r, 1, b"two", None);
        r.step();
        ping(r, 2, b"three", None);
        r.step();
    });
    assert_eq!(taken[Path::StraightReceive as usize], 0, "{taken:?}");
    assert_eq!(taken[Path::Receive as usize], 3, "{taken:?}");
    assert_eq!(out.completions.len(), 3);
}

/// Lone lines a hostile or broken peer writes, each alone on a fresh rig: the straight
/// step takes only a Send Only whose every checked field is right — a wrong destination
/// QP, a payload longer than the line holds, a payload by reference, another flag, a
/// riding Nak, another transport version, another opcode of the same header length —
/// go to the full step, which drops or refuses them; a PSN one ahead of or behind ePSN
/// is taken straight and refused by the RQ Logic's pipeline. Each leaves what the full
/// step leaves.
#[test]
fn hostile_lone_lines_are_received_as_the_full_step_receives_them() {
    type Case = (&'static str, u64, &'static dyn Fn(&Rig, &mut PacketSlot));
    let cases: [Case; 12] = [
        ("another generation of the QP's index", 0, &|r, s| {
            let q = r.qp.qpn().get() ^ (1 << 12);
            s.data[5..8].copy_from_slice(&q.to_be_bytes()[1..]);
        }),
        ("a QP number no QP has", 0, &|r, s| {
            let q = r.qp.qpn().get() + 1;
            s.data[5..8].copy_from_slice(&q.to_be_bytes()[1..]);
        }),
        ("a PSN one ahead", 1, &|_, s| {
            s.data[9..12].copy_from_slice(&rq(2).to_be_bytes()[1..]);
        }),
        ("a PSN one behind", 1, &|_, s| {
            s.data[9..12].copy_from_slice(&rq(0).to_be_bytes()[1..]);
        }),
        (
            "a payload one byte longer than the line holds",
            0,
            &|_, s| {
                s.payload_len = 29;
            },
        ),
        ("a payload of 4 GiB", 0, &|_, s| s.payload_len = u32::MAX),
        ("a payload by reference", 0, &|_, s| {
            s.kind = crate::wire::slot::KIND_DIRECT;
        }),
        ("an ICRC flag", 0, &|_, s| {
            s.reserved |= crate::wire::slot::ICRC_FLAG;
        }),
        ("an unknown flag", 0, &|_, s| s.reserved |= 0x80),
        ("a riding Nak", 0, &|_, s| {
            let nak = Syndrome::Nak(NakCode::PsnSequenceError).to_u8();
            let word = crate::wire::slot::riding_word(0, nak, 0);
            assert!(crate::wire::slot::set_riding_ack(s, word));
        }),
        ("transport version 1", 0, &|_, s| s.data[1] |= 1),
        ("a Send First", 0, &|_, s| {
            s.data[0] = Opcode::SendFirst.code()
        }),
    ];
    for (what, straight, change) in cases {
        let scenario = |r: &mut Rig| {
            r.post_recv(4);
            if straight == 1 {
                // The PSN cases: one accepted first, so that one behind is a duplicate.
                ping(r, 0, b"good", None);
                r.step();
            }
            let mut s = ping_slot(r, straight as u32, b"ping", None);
            change(r, &mut s);
            assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
            r.step();
        };
        let (_, taken) = same_both_ways(AccessFlags::ALL, &scenario);
        assert_eq!(
            taken[Path::StraightReceive as usize],
            straight * 2,
            "{what}: {taken:?}"
        );
    }
}

// --- Review 10 (issue 27's straight Send): random posts of Sends, both ways ---

/// Random rounds against the engine's straight Send (`Engine::post_send_straight`) and
/// the verbs ABI's Send of one element: Sends of one registered element, of inline bytes,
/// of none, through `post_send_single`, or too large for a line; signaled or not,
/// solicited, fenced; Reads before them (the fence); pings from the peer (owed Acks,
/// held back or not), receives, Acks of everything sent with any credits; the QP
/// drained to SQD and back to RTS, or moved to Error; the link taken down. Fast paths on
/// and off must leave the same, and each post the same answer.
mod rev10_random_straight_sends {
    use super::*;
    use crate::SendFlags;
    use proptest::collection::vec;
    use proptest::prelude::*;
    use std::cell::RefCell;

    #[derive(Debug, Clone)]
    enum Step {
        /// A Send: `how` 0 one element, 1 inline bytes, 2 `post_send_single`, 3 an element
        /// larger than a line; `flags` bit 0 signaled, 1 solicited, 2 fence.
        Send { how: u8, len: u8, flags: u8 },
        /// An RDMA Read of 8 bytes.
        Read,
        /// A Send Only from the peer at the expected PSN.
        Ping,
        /// `n` receives posted, no engine turn.
        Recv(u8),
        /// The peer acknowledges everything sent so far.
        AckAll { credits: u16 },
        /// Owed Acks held back (or not) from now on.
        Hold(bool),
        /// One more engine iteration.
        Turn,
        /// The QP drained (SQD), then back to RTS after `turns` iterations.
        Drain { turns: u8 },
        /// The QP moved to Error.
        Error,
        /// The link taken down.
        LinkDown,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            8 => (0u8..4, 0u8..40, 0u8..8).prop_map(|(how, len, flags)| Step::Send { how, len, flags }),
            1 => Just(Step::Read),
            3 => Just(Step::Ping),
            2 => (0u8..3).prop_map(Step::Recv),
            3 => (0u16..40).prop_map(|credits| Step::AckAll { credits }),
            1 => any::<bool>().prop_map(Step::Hold),
            3 => Just(Step::Turn),
            1 => (0u8..3).prop_map(|turns| Step::Drain { turns }),
            1 => Just(Step::Error),
            1 => Just(Step::LinkDown),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 384,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn rev10_random_straight_sends_leave_what_the_general_post_leaves(
            hold in any::<bool>(),
            recvs in 0u8..5,
            steps in vec(step(), 1..24),
        ) {
            let _inline = super::super::tests::InlineRigs::of(64);
            let answers = RefCell::new(vec![]);
            let scenario = |r: &mut Rig| {
                r.mr.write_at(0, &[0x5a; 512]).unwrap();
                let mut receives = random_round_start(r, hold, 8192, recvs);
                let mut id = 100u64;
                for s in &steps {
                    match *s {
                        Step::Send { how, len, flags } => {
                            id += 1;
                            let mut f = SendFlags::NONE;
                            if flags & 1 != 0 {
                                f = f | SendFlags::SIGNALED;
                            }
                            if flags & 2 != 0 {
                                f = f | SendFlags::SOLICITED;
                            }
                            if flags & 4 != 0 {
                                f = f | SendFlags::FENCE;
                            }
                            let bytes = [b'a' + (id % 26) as u8; 64];
                            let len = u32::from(len);
                            let got = match how {
                                0 => {
                                    let sge = [r.mr.sge(u64::from(len), len).unwrap()];
                                    r.qp.post_send(&SendWr::new(id, SendOp::Send, &sge).flags(f))
                                }
                                1 => r.qp.post_send(
                                    &SendWr::inline(id, SendOp::Send, &bytes[..len as usize])
                                        .flags(f),
                                ),
                                2 => {
                                    let sge = r.mr.sge(u64::from(len), len).unwrap();
                                    r.qp.post_send_single(id, f, &sge)
                                }
                                _ => {
                                    let sge = [r.mr.sge(0, 200 + len).unwrap()];
                                    r.qp.post_send(&SendWr::new(id, SendOp::Send, &sge).flags(f))
                                }
                            };
                            answers.borrow_mut().push(format!("{id}: {:?}", got.err()));
                        }
                        Step::Read => {
                            id += 1;
                            let sge = [r.mr.sge(4096, 8).unwrap()];
                            let remote = r.mr.remote(2048);
                            let wr = SendWr::new(id, SendOp::RdmaRead(remote), &sge)
                                .flags(SendFlags::SIGNALED);
                            let got = r.qp.post_send(&wr);
                            answers.borrow_mut().push(format!("{id}: {:?}", got.err()));
                        }
                        Step::Ping => {
                            let k = super::random_requests::epsn_offset(r);
                            r.request(Opcode::SendOnly, k, |_| {}, b"ping");
                            r.step();
                        }
                        Step::Recv(n) => receives.post(r, n),
                        Step::AckAll { credits: c } => {
                            let qpn = r.qp.qpn();
                            let (npsn, started) = r
                                .ctx
                                .shared
                                .engine
                                .with(|e| {
                                    e.with_stage(qpn, |q, _| {
                                        let w = q.proto.req.window();
                                        (w.npsn(), w.started())
                                    })
                                })
                                .unwrap();
                            if started > 0 {
                                respond(r, npsn.sub(1).get(), credits(u32::from(c)), started as u32);
                                r.step();
                            }
                        }
                        Step::Hold(h) => r.ctx.shared.engine.with(|e| e.hold_acks = h),
                        Step::Turn => r.step(),
                        Step::Drain { turns } => {
                            let got = r.qp.modify(&QpAttr::new(QpState::Sqd));
                            answers.borrow_mut().push(format!("sqd: {:?}", got.err()));
                            for _ in 0..turns {
                                r.step();
                            }
                            let got = r.qp.modify(&QpAttr::new(QpState::Rts));
                            answers.borrow_mut().push(format!("rts: {:?}", got.err()));
                        }
                        Step::Error => {
                            let _ = r.qp.modify(&QpAttr::new(QpState::Error));
                        }
                        Step::LinkDown => {
                            let link = r.qp.query().config.dest.unwrap().link;
                            r.ctx
                                .shared
                                .engine
                                .with(|e| e.link_down(link, "the test took it down".into()));
                        }
                    }
                    let index = r.qp.index;
                    let state = r.ctx.shared.engine.with(|e| e.post_state(index));
                    answers.borrow_mut().push(format!("{state:?}"));
                }
            };
            same_both_ways(AccessFlags::ALL, &scenario);
            let answers = answers.into_inner();
            let (slow, fast) = answers.split_at(answers.len() / 2);
            prop_assert_eq!(fast, slow);
        }
    }
}

/// Review 11: random lone lines, one an iteration, each looked at by the straight receive
/// step (its back-off cleared) — Send Onlys at PSNs around ePSN with payloads of any
/// length the line holds (and one more), with or without a positive Ack of ours riding
/// in them (any PSN around the window, any MSN), between receives posted, Sends of ours
/// posted, the queue polled or not, and iterations with
/// nothing new — with owed Acks held back or not: the straight step leaves what the full
/// step leaves.
mod random_straight {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        Ping {
            at: i32,
            len: usize,
            ack: Option<(i32, u32)>,
        },
        Recv(u64),
        Send,
        Poll,
        Idle,
    }

    fn step() -> impl Strategy<Value = Step> {
        let ping = (
            prop_oneof![6 => Just(0i32), 1 => -2i32..3],
            prop_oneof![4 => 0usize..29, 1 => Just(29usize)],
            proptest::option::weighted(
                0.6,
                (-2i32..6, prop_oneof![3 => 0u32..8, 1 => any::<u32>()]),
            ),
        )
            .prop_map(|(at, len, ack)| Step::Ping { at, len, ack });
        prop_oneof![
            6 => ping,
            2 => (0u64..3).prop_map(Step::Recv),
            2 => Just(Step::Send),
            1 => Just(Step::Poll),
            2 => Just(Step::Idle),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 256,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn random_lone_lines_leave_what_the_full_step_leaves(
            hold in any::<bool>(),
            steps in vec(step(), 1..24),
        ) {
            let scenario = |r: &mut Rig| {
                r.ctx.shared.engine.with(|e| e.hold_acks = hold);
                r.post_recv(2);
                post(r, 8, &[Op::Send(8)]);
                let mut wr = 1u64;
                let mut rwr = 1000u64;
                for s in &steps {
                    match *s {
                        Step::Ping { at, len, ack } => {
                            let k = random_requests::epsn_offset(r)
                                .wrapping_add(at.rem_euclid(1 << 24) as u32);
                            let payload = vec![0x5A; len];
                            let mut sl = ping_slot(r, 0, &payload[..len.min(28)], None);
                            sl.data[9..12].copy_from_slice(&rq(k).to_be_bytes()[1..]);
                            sl.payload_len = len as u32;
                            if let Some((psn, msn)) = ack {
                                let psn = Psn::new(0).add(psn.rem_euclid(1 << 24) as u32).get();
                                let word = crate::wire::slot::riding_word(psn, credits(8).to_u8(), msn);
                                assert!(crate::wire::slot::set_riding_ack(&mut sl, word));
                            }
                            assert_eq!(r.tx.push_burst(&[sl]).unwrap(), 1);
                        }
                        Step::Recv(n) => {
                            for _ in 0..n {
                                let sge = [r.mr.sge(4096 + 64 * (rwr % 32), 64).unwrap()];
                                if r.qp.post_recv(&RecvWr::new(rwr, &sge)).is_err() {
                                    break;
                                }
                                rwr += 1;
                            }
                        }
                        Step::Send => {
                            let sge = [r.mr.sge(0, 8).unwrap()];
                            if r.qp.post_send(&SendWr::new(wr, SendOp::Send, &sge)).is_ok() {
                                wr += 1;
                            }
                        }
                        Step::Poll => {
                            let mut wc = [WorkCompletion::default(); 4];
                            r.cq.poll(&mut wc);
                        }
                        Step::Idle => {}
                    }
                    r.ctx.shared.engine.with(|e| e.straight_skip = 0);
                    r.step();
                }
            };
            same_both_ways(AccessFlags::ALL, &scenario);
        }
    }
}

/// Review 11: lone lines that pass the straight step's first look (bytes 5..8: a BTH
/// alone, or a BTH and a RETH, the payload inline, no flag) but not its later checks — a
/// Send Last, an RDMA Write Last, a Send Only to no QP of the link, an RDMA Write First —
/// hold the straight step back as every
/// other line it does not take does (`STRAIGHT_BACKOFF`): otherwise each such line pays
/// the look and then the full step's.
#[test]
fn lone_lines_refused_after_the_look_hold_the_straight_step_back() {
    let cases = [
        "a Send Last",
        "an RDMA Write Last",
        "a Send Only to no QP",
        "an RDMA Write First",
    ];
    for what in cases {
        let mut r = super::tests::rig(AccessFlags::ALL);
        r.post_recv(2);
        r.ctx.shared.engine.with(|e| e.straight_skip = 0);
        let mut s = ping_slot(&r, 0, b"ping", None);
        if what == "an RDMA Write First" {
            s = write_slot(&r, 0, r.reth(1024, 4), b"ping", None);
        }
        match what {
            "a Send Last" => s.data[0] = Opcode::SendLast.code(),
            "an RDMA Write First" => s.data[0] = Opcode::RdmaWriteFirst.code(),
            "an RDMA Write Last" => s.data[0] = Opcode::RdmaWriteLast.code(),
            _ => {
                let q = r.qp.qpn().get() + 1;
                s.data[5..8].copy_from_slice(&q.to_be_bytes()[1..]);
            }
        }
        assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
        r.step();
        let skip = r.ctx.shared.engine.with(|e| e.straight_skip);
        assert!(skip > 0, "{what}: the straight step looks again at once");
    }
}

// --- The straight RDMA Write (issue 27: write_lat's Write, both sides) ---

/// An RDMA Write Only at PSN offset `k` through `reth` with `payload` inline (at most 12
/// bytes: a line holds 40, 28 of them the headers) and, with `ack` (PSN, MSN), a
/// positive Ack of ours riding in it, as a requester's straight post writes it.
fn write_slot(
    r: &Rig,
    k: u32,
    reth: crate::wire::RethRepr,
    payload: &[u8],
    ack: Option<(u32, u32)>,
) -> PacketSlot {
    let psn = Psn::new(rq(k));
    let mut repr = PacketRepr::new(BthRepr::new(Opcode::RdmaWriteOnly, r.qp.qpn(), psn));
    repr.reth = Some(reth);
    line_slot(repr, payload, ack)
}

/// Publishes [`write_slot`]'s line.
fn write_line(r: &mut Rig, k: u32, at: u64, payload: &[u8], ack: Option<(u32, u32)>) {
    let reth = r.reth(at, payload.len() as u32);
    let s = write_slot(r, k, reth, payload, ack);
    assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
}

/// The engine's straight post of an RDMA Write (`Engine::post_send_straight::<true>`):
/// Writes of one registered element (8 and 0 bytes) and of inline bytes, one with the
/// owed Ack of a ping riding in it (held back an iteration), leave what the general post
/// leaves — the same packets, RETHs (address, key, length) and payloads, riding Acks,
/// completions, statistics, state and the engine's bookkeeping (owed, held, active).
/// What it does not take goes the general way in between: a Write too large for a line,
/// a Write with Immediate, a Write of no inline bytes.
#[test]
fn a_straight_write_leaves_what_the_general_write_leaves() {
    use std::cell::RefCell;
    let _inline = super::tests::InlineRigs::of(64);
    let states = RefCell::new(vec![]);
    let look = |r: &Rig| {
        let index = r.qp.index;
        let state = r.ctx.shared.engine.with(|e| e.post_state(index));
        states.borrow_mut().push(state);
    };
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.ctx.shared.engine.with(|e| e.hold_acks = true);
        r.post_recv(4);
        r.mr.write_at(0, b"0123456789abcdef").unwrap();
        post(r, 8, &[Op::Write(8)]);
        look(r);
        r.request(Opcode::SendOnly, 0, |_| {}, b"ping");
        r.step();
        look(r);
        let remote = r.mr.remote(4096);
        let wr = SendWr::inline(1, SendOp::RdmaWrite(remote), b"inline!!");
        r.qp.post_send(&wr).unwrap();
        look(r);
        r.step();
        post_only(r, 2, &[Op::Write(0), Op::Write(100)]);
        let imm = SendOp::RdmaWriteWithImm(r.mr.remote(5000), 7);
        r.qp.post_send(&SendWr::inline(4, imm, b"imm")).unwrap();
        let none = SendWr::inline(5, SendOp::RdmaWrite(r.mr.remote(6000)), b"");
        r.qp.post_send(&none).unwrap();
        r.step();
        respond(r, 5, credits(8), 6);
        r.step();
        look(r);
    });
    let states = states.into_inner();
    let (slow, fast) = states.split_at(states.len() / 2);
    assert_eq!(fast, slow, "the same bookkeeping both ways");
    // (Owed, held, active.)
    assert_eq!(fast[1], (true, true, false), "the ping's Ack held back");
    assert_eq!(fast[2], (false, false, true), "it rode in the Write");
    assert_eq!(out.stats.acks_riding, 1, "{out:#?}");
    // The Writes of 8 bytes, inline bytes and 0 bytes of a region.
    assert_eq!(taken[Path::StraightWrite as usize], 3, "{taken:?}");
    assert_eq!(taken[Path::StraightSend as usize], 0, "{taken:?}");
    let writes = out.sent.iter().filter(|s| s.0 == Opcode::RdmaWriteOnly);
    assert_eq!(writes.count(), 5, "{out:#?}");
    assert!(out.bodies.iter().any(|b| b.5 == b"inline!!"), "{out:#?}");
    assert!(out.bodies.iter().any(|b| b.5 == b"01234567"), "{out:#?}");
    assert_eq!(out.completions.len(), 1 + 6, "{:?}", out.completions);
    assert_eq!(out.state, QpState::Rts);
}

/// A write_lat ping-pong's receiving half on the straight receive step: each ping a lone
/// RDMA Write Only line carrying the Ack of our last Write, taken straight — the payload
/// where its RETH says, the Ack held back and riding in our answer (itself a straight
/// Write), the iteration ended without steps 3 to 5 — over more than a timer period,
/// leaves what the full step leaves; so does a ping not answered, whose Ack leaves alone
/// one iteration later.
#[test]
fn lone_write_onlys_take_the_straight_receive_step_as_the_full_one() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.ctx.shared.engine.with(|e| e.hold_acks = true);
        post(r, 8, &[Op::Write(8)]);
        // (The credits' Ack held the straight step back some full iterations.)
        r.ctx.shared.engine.with(|e| e.straight_skip = 0);
        for k in 0..12u32 {
            let bytes = (u64::from(k) + 1).to_le_bytes();
            write_line(r, k, 2048 + 8 * u64::from(k), &bytes, Some((k, k + 1)));
            r.step();
            post_only(r, 1 + u64::from(k), &[Op::Write(8)]);
            r.step();
        }
        let writes = r.answers();
        assert!(
            writes.iter().all(|a| a.0 == Opcode::RdmaWriteOnly),
            "{writes:?}"
        );
        write_line(r, 12, 4000, b"last", Some((12, 13)));
        r.step();
        assert!(r.answers().is_empty(), "held back an iteration");
        r.step();
        let acks = r.answers();
        assert_eq!(acks.len(), 1, "then sent alone: {acks:?}");
        assert_eq!(acks[0].0, Opcode::Acknowledge);
    });
    assert_eq!(taken[Path::StraightWriteReceive as usize], 13, "{taken:?}");
    assert_eq!(taken[Path::StraightReceive as usize], 0, "{taken:?}");
    assert_eq!(taken[Path::StraightWrite as usize], 13, "{taken:?}");
    assert_eq!(
        out.completions.len(),
        13,
        "our Writes: {:?}",
        out.completions
    );
    assert_eq!(out.stats.acks_riding, 12, "{out:#?}");
    for k in 0..12u64 {
        let at = 2048 + 8 * k as usize;
        assert_eq!(out.memory.0[at..at + 8], (k + 1).to_le_bytes(), "ping {k}");
    }
    assert_eq!(&out.memory.0[4000..4004], b"last");
}

/// Lone Write Only lines a hostile or broken peer writes, each alone on a fresh rig: the
/// straight step takes the line when its headers and payload are well formed, and the RQ
/// Logic then refuses, as the full step's, what it must — an R_Key of no region, the
/// R_Key of a region of another protection domain, a range past the region's end, a RETH
/// length other than the payload's, a PSN one ahead of or behind ePSN, a QP without
/// remote write (a Nak, the QP in the Error state, or a duplicate's Ack); lines it must
/// not take go to the full step: a wrong destination QP, a payload longer than the line
/// holds, a payload by reference, a riding Nak, another transport version, another
/// opcode with the same headers (a Write First, a Read Request, a Write Only with
/// Immediate's opcode without its ImmDt). Each leaves what the full step leaves, the
/// region of the other domain untouched both ways.
#[test]
fn hostile_lone_write_lines_are_received_as_the_full_step_receives_them() {
    use std::cell::RefCell;
    /// (What, whether the straight step takes it, access of the QP, the change.)
    type Case = (
        &'static str,
        u64,
        AccessFlags,
        &'static dyn Fn(&Rig, &crate::Mr, &mut PacketSlot),
    );
    const ALL: AccessFlags = AccessFlags::ALL;
    let cases: [Case; 16] = [
        ("an R_Key of no region", 1, ALL, &|_, _, s| {
            let key = u32::from_be_bytes(s.data[20..24].try_into().unwrap()) ^ 0xFFFF_0000;
            s.data[20..24].copy_from_slice(&key.to_be_bytes());
        }),
        (
            "the R_Key of another domain's region",
            1,
            ALL,
            &|_, other, s| {
                let at = other.remote(0);
                s.data[12..20].copy_from_slice(&at.addr.to_be_bytes());
                s.data[20..24].copy_from_slice(&at.rkey.to_be_bytes());
            },
        ),
        ("a range past the region's end", 1, ALL, &|r, _, s| {
            let va = r.mr.remote(0).addr + r.mr.len() - 2;
            s.data[12..20].copy_from_slice(&va.to_be_bytes());
        }),
        (
            "a RETH length longer than the payload",
            1,
            ALL,
            &|_, _, s| {
                s.data[24..28].copy_from_slice(&8u32.to_be_bytes());
            },
        ),
        (
            "a RETH length shorter than the payload",
            1,
            ALL,
            &|_, _, s| {
                s.data[24..28].copy_from_slice(&2u32.to_be_bytes());
            },
        ),
        ("a PSN one ahead", 2, ALL, &|_, _, s| {
            s.data[9..12].copy_from_slice(&rq(2).to_be_bytes()[1..]);
        }),
        ("a PSN one behind", 2, ALL, &|_, _, s| {
            s.data[9..12].copy_from_slice(&rq(0).to_be_bytes()[1..]);
        }),
        (
            "a QP without remote write",
            1,
            AccessFlags::REMOTE_READ,
            &|_, _, _| {},
        ),
        ("a QP number no QP has", 0, ALL, &|r, _, s| {
            let q = r.qp.qpn().get() + 1;
            s.data[5..8].copy_from_slice(&q.to_be_bytes()[1..]);
        }),
        (
            "a payload one byte longer than the line holds",
            0,
            ALL,
            &|_, _, s| {
                s.payload_len = 13;
            },
        ),
        ("a payload by reference", 0, ALL, &|_, _, s| {
            s.kind = crate::wire::slot::KIND_DIRECT;
        }),
        ("a riding Nak", 0, ALL, &|_, _, s| {
            let nak = Syndrome::Nak(NakCode::PsnSequenceError).to_u8();
            let word = crate::wire::slot::riding_word(0, nak, 0);
            assert!(crate::wire::slot::set_riding_ack(s, word));
        }),
        ("transport version 1", 0, ALL, &|_, _, s| s.data[1] |= 1),
        ("a Write First", 0, ALL, &|_, _, s| {
            s.data[0] = Opcode::RdmaWriteFirst.code()
        }),
        ("a Read Request", 0, ALL, &|_, _, s| {
            s.data[0] = Opcode::RdmaReadRequest.code()
        }),
        (
            "a Write Only with Immediate's opcode",
            0,
            ALL,
            &|_, _, s| s.data[0] = Opcode::RdmaWriteOnlyWithImmediate.code(),
        ),
    ];
    for (what, straight, access, change) in cases {
        let others = RefCell::new(vec![]);
        let scenario = |r: &mut Rig| {
            let pd = r.ctx.alloc_pd().unwrap();
            let other = pd.alloc_mr(64, AccessFlags::ALL).unwrap();
            let psn = u32::from(straight == 2);
            if psn == 1 {
                // The PSN cases: one accepted first, so that one behind is a duplicate.
                write_line(r, 0, 1024, b"good", None);
                r.step();
            }
            let mut s = write_slot(r, psn, r.reth(1024, 4), b"evil", None);
            change(r, &other, &mut s);
            assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
            r.step();
            let mut bytes = vec![0; 64];
            other.read_at(0, &mut bytes).unwrap();
            others.borrow_mut().push(bytes);
        };
        let (out, taken) = same_both_ways(access, &scenario);
        assert_eq!(
            taken[Path::StraightWriteReceive as usize],
            straight,
            "{what}: {taken:?}"
        );
        assert!(
            others.borrow().iter().all(|b| b.iter().all(|&x| x == 0)),
            "{what}: the other domain's region written"
        );
        if straight == 1 {
            // Each refused by the RQ Logic: a Nak, the QP in the Error state.
            assert_eq!(out.state, QpState::Error, "{what}: {out:#?}");
            assert!(
                matches!(out.sent[0].2.map(|a| a.syndrome), Some(Syndrome::Nak(_))),
                "{what}: {out:#?}"
            );
            assert_eq!(&out.memory.0[1024..1028], [0; 4], "{what}");
        }
    }
}

/// A Write whose Ack was lost, sent again with other bytes (a duplicate at the PSN before
/// ePSN), then the next: taken by the straight step all three, the duplicate answered
/// by the pipeline with the Ack again; the memory both ways the same.
#[test]
fn a_straight_write_sent_again_after_a_lost_ack_is_acked_as_in_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.ctx.shared.engine.with(|e| e.straight_skip = 0);
        write_line(r, 0, 1024, b"abcd", None);
        r.step();
        r.step();
        let lost = r.answers();
        assert_eq!(lost.len(), 1, "{lost:?}");
        write_line(r, 0, 1024, b"WXYZ", None);
        r.step();
        write_line(r, 1, 1028, b"efgh", None);
        r.step();
    });
    assert_eq!(taken[Path::StraightWriteReceive as usize], 3, "{taken:?}");
    let acks: Vec<_> = out.sent.iter().map(|s| (s.0, s.1)).collect();
    assert_eq!(
        acks,
        [(Opcode::Acknowledge, rq(0)), (Opcode::Acknowledge, rq(1))],
        "{out:#?}"
    );
    assert_eq!(out.state, QpState::Rts);
}

/// Sends and Writes interleaved both ways: lone Send Only and Write Only lines (with the
/// Acks of ours riding), a zero-length Write and a Write with Immediate (the full step's),
/// answered by Sends and Writes of ours (the straight posts) — what the full step and the
/// general post leave.
#[test]
fn interleaved_straight_sends_and_writes_leave_what_the_general_paths_leave() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        r.ctx.shared.engine.with(|e| e.hold_acks = true);
        r.post_recv(8);
        post(r, 8, &[Op::Send(8)]);
        r.ctx.shared.engine.with(|e| e.straight_skip = 0);
        for k in 0..6u32 {
            let ack = Some((k, k + 1));
            if k % 2 == 0 {
                ping(r, k, b"ping", ack);
            } else {
                write_line(r, k, 4096 + 8 * u64::from(k), b"write", ack);
            }
            r.step();
            let op = if k % 3 == 0 {
                Op::Write(8)
            } else {
                Op::Send(8)
            };
            post_only(r, 1 + u64::from(k), &[op]);
            r.step();
        }
        r.answers();
        let reth = r.reth(5000, 0);
        r.request(Opcode::RdmaWriteOnly, 6, |p| p.reth = Some(reth), b"");
        r.step();
        let reth = r.reth(5008, 3);
        write_imm(r, 7, reth, 9, b"imm");
        r.step();
        r.step();
    });
    assert_eq!(taken[Path::StraightReceive as usize], 3, "{taken:?}");
    assert_eq!(taken[Path::StraightWriteReceive as usize], 3, "{taken:?}");
    assert_eq!(taken[Path::StraightWrite as usize], 2, "{taken:?}");
    assert_eq!(taken[Path::StraightSend as usize], 1 + 4, "{taken:?}");
    assert_eq!(out.stats.acks_riding, 6, "{out:#?}");
    assert_eq!(&out.memory.0[5008..5011], b"imm");
    let recv = out
        .completions
        .iter()
        .filter(|c| c.opcode == crate::WcOpcode::Recv);
    assert_eq!(recv.count(), 3, "{:?}", out.completions);
}

/// The straight receive step's responses (issue 27): each lone response line — a Read
/// Response Only with its data inline and of no bytes, the Atomic Acknowledges of a Fetch
/// and Add and a Compare and Swap, a positive Ack, a Read's response by reference (the
/// full step's), a Nak, a duplicate Ack — taken straight where its pattern says a
/// response, with the full step's completions, memory, credits and state both ways.
#[test]
fn lone_responses_take_the_straight_receive_step_as_the_full_one() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        post(
            r,
            8,
            &[
                Op::Read(8),
                Op::FetchAdd,
                Op::CompareSwap,
                Op::Read(0),
                Op::Read(256),
                Op::Send(4),
                Op::Send(4),
            ],
        );
        let each = |r: &mut Rig, respond_with: &dyn Fn(&mut Rig)| {
            // (Each look of the lines before may have held the step back.)
            r.ctx.shared.engine.with(|e| e.straight_skip = 0);
            respond_with(r);
            r.step();
        };
        each(r, &|r| read_response(r, 0, 1, b"readdata"));
        each(r, &|r| atomic_ack(r, 1, 2, 0x0102_0304_0506_0708));
        each(r, &|r| atomic_ack(r, 2, 3, u64::MAX - 1));
        each(r, &|r| read_response(r, 3, 4, b""));
        // By reference (the data does not fit the line): the full step's.
        each(r, &|r| read_response(r, 4, 5, &[0x5A; 256]));
        each(r, &|r| respond(r, 5, credits(3), 6));
        // A duplicate Ack, then an RNR Nak of the last Send.
        each(r, &|r| respond(r, 5, credits(3), 6));
        let rnr = Syndrome::RnrNak {
            timer: crate::wire::aeth::RnrTimer::new(1),
        };
        each(r, &|r| respond(r, 6, rnr, 6));
    });
    // The Read by reference went to the full step; every other response straight, and
    // the credits' Ack `post` begins with.
    assert_eq!(taken[Path::StraightResponse as usize], 8, "{taken:?}");
    assert_eq!(taken[Path::ReadResponse as usize], 3, "{taken:?}");
    assert_eq!(taken[Path::AtomicAck as usize], 2, "{taken:?}");
    assert_eq!(out.completions.len(), 6, "{:?}", out.completions);
    assert_eq!(&out.memory.0[..8], b"readdata");
    assert_eq!(
        out.memory.0[1024..1032],
        0x0102_0304_0506_0708u64.to_ne_bytes()
    );
    assert_eq!(out.stats.rnr_naks_received, 1, "{out:#?}");
}

/// Lone response lines a hostile or broken peer writes, each after a Read and a Fetch and
/// Add are posted on a fresh rig: whatever the straight step takes or leaves, the outcome
/// is the full step's — lines for another QP, with a request's opcode behind a response's
/// header length, with the ICRC flag, a Read response longer or shorter than the Read, an
/// Atomic Acknowledge's opcode with a Read response's headers, another transport version,
/// a response of a PSN never sent, a Nak with an unknown code.
#[test]
fn hostile_lone_response_lines_are_received_as_the_full_step_receives_them() {
    type Mutate = fn(&mut PacketSlot);
    let cases: [(&str, bool, Mutate); 9] = [
        ("good", true, |_| {}),
        ("another QP", false, |s| s.data[5] ^= 1),
        ("a Send Only's opcode", false, |s| {
            s.data[0] = Opcode::SendOnly.code()
        }),
        ("the ICRC flag", false, |s| {
            s.reserved |= crate::wire::slot::ICRC_FLAG
        }),
        ("7 bytes", true, |s| s.payload_len = 7),
        ("9 bytes", true, |s| s.payload_len = 9),
        ("an Atomic Acknowledge's opcode", false, |s| {
            s.data[0] = Opcode::AtomicAcknowledge.code()
        }),
        ("transport version 1", false, |s| s.data[1] |= 0x01),
        ("a PSN never sent", true, |s| {
            s.data[11] = s.data[11].wrapping_add(9)
        }),
    ];
    for (what, straight, mutate) in cases {
        // How many the straight step took of the line (the fast run's count).
        let took = std::cell::Cell::new(0);
        let (out, _) = same_both_ways(AccessFlags::ALL, &|r| {
            post(r, 8, &[Op::Read(8), Op::FetchAdd]);
            r.ctx.shared.engine.with(|e| e.straight_skip = 0);
            let mut repr = PacketRepr::new(BthRepr::new(
                Opcode::RdmaReadResponseOnly,
                r.qp.qpn(),
                Psn::new(0),
            ));
            repr.aeth = Some(AethRepr {
                syndrome: credits(4),
                msn: Msn::new(1),
            });
            let mut s = PacketSlot::default();
            s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
            s.kind = crate::wire::slot::KIND_INLINE;
            s.payload_len = 8;
            let at = usize::from(s.hdr_len);
            s.data[at..at + 8].copy_from_slice(b"readdata");
            mutate(&mut s);
            assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
            let before = crate::probe::taken(Path::StraightResponse);
            r.step();
            took.set(crate::probe::taken(Path::StraightResponse) - before);
            r.step();
            atomic_ack(r, 1, 2, 7);
            r.step();
            r.step();
        });
        assert_eq!(took.get(), u64::from(straight), "{what}");
        if what == "good" {
            assert_eq!(out.completions.len(), 2, "{what}");
            assert_eq!(&out.memory.0[..8], b"readdata", "{what}");
        }
    }
}
// --- Review 13 (branch ack28): the Ack -> retire -> completion path on a nearly full CQ ---

/// Random rounds against `retire_acked` (the Ack fast path's and the answer fast path's
/// retire, issue 27) where it is most fragile: the shared CQ filled to within a few slots
/// first, so that a send completion finds it full mid-run (the WQEs before it retired,
/// it and the rest left for later, order kept), the application polling a few at a time;
/// Sends, Writes, one-response Reads and Atomics, signaled or not (regions released);
/// Acks of any WQE's last PSN (coalesced) or beside it, standalone or riding, the oldest
/// WQE's exact answer (Read response of its length, Atomic Acknowledge), a lying syndrome
/// or MSN; the send CQ destroyed, the QP to SQD and back or to Error on the way. Fast
/// paths on and off must leave the same (packets, completions polled, stats, memory,
/// in-flight counts, state).
mod review13_full_cq_rounds {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;
    use std::cell::Cell;

    #[derive(Debug, Clone)]
    enum Act {
        Post(Vec<(Op, bool)>),
        /// An Ack of the last PSN of the `at`th started WQE from the oldest (or beside it).
        Ack {
            at: u8,
            off: i8,
            syndrome: u8,
            msn: Result<i32, u32>,
            riding: bool,
        },
        /// The oldest WQE's exact answer (a Read's response of its length, an Atomic's
        /// Acknowledge, a Send's or Write's Ack).
        Answer {
            msn: i32,
        },
        Poll(usize),
        Step,
        DestroyCq,
        Drain(bool),
        Error,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u32..300).prop_map(Op::Send),
            2 => (0u32..300).prop_map(Op::Write),
            2 => (0u32..256).prop_map(Op::Read),
            1 => Just(Op::FetchAdd),
        ]
    }

    fn act() -> impl Strategy<Value = Act> {
        let syndrome = prop_oneof![30 => Just(0u8), 10 => 0u8..32, 1 => any::<u8>()];
        let msn = prop_oneof![6 => (-4i32..2).prop_map(Ok), 1 => any::<u32>().prop_map(Err)];
        prop_oneof![
            4 => vec((op(), prop::bool::weighted(0.4)), 1..6).prop_map(Act::Post),
            6 => (0u8..8, prop_oneof![6 => Just(0i8), 1 => -2i8..3], syndrome, msn, any::<bool>())
                .prop_map(|(at, off, syndrome, msn, riding)| Act::Ack { at, off, syndrome, msn, riding }),
            3 => (-3i32..2).prop_map(|msn| Act::Answer { msn }),
            2 => (0usize..6).prop_map(Act::Poll),
            1 => Just(Act::Step),
            1 => prop::bool::weighted(0.1).prop_map(|d| if d { Act::DestroyCq } else { Act::Step }),
            1 => any::<bool>().prop_map(Act::Drain),
            1 => prop::bool::weighted(0.05).prop_map(|e| if e { Act::Error } else { Act::Step }),
        ]
    }

    /// What the peer needs of the window: the oldest WQE's first PSN, operation and
    /// length (if one is started), the last PSN of the `at`th started one (else the first
    /// PSN not acknowledged), and the WQEs fetched.
    fn window(r: &Rig, at: u8) -> (Option<(Psn, crate::wqe::WqeOp, u32)>, Psn, u64) {
        let qpn = r.qp.qpn();
        r.ctx.shared.engine.with(|e| {
            e.with_stage(qpn, |q, _| {
                let w = q.proto.req.window();
                let oldest = (w.retired() < w.started()).then(|| {
                    let o = w.wqe(w.retired());
                    (o.first_psn, o.wqe.op, o.wqe.len)
                });
                let seq = w.retired() + u64::from(at);
                let psn = if seq < w.started() {
                    w.wqe(seq).last_psn()
                } else {
                    w.acked().add(1)
                };
                (oldest, psn, w.fetched())
            })
            .unwrap()
        })
    }

    fn post_one(r: &mut Rig, id: u64, op: Op, signaled: bool) {
        let at = (id % 24) * 1024;
        let remote = r.mr.remote(32768 + (id % 8) * 1024);
        let (op, len) = op.at(remote);
        let sge = [r.mr.sge(at, len).unwrap()];
        let flags = if signaled {
            crate::SendFlags::SIGNALED
        } else {
            crate::SendFlags::NONE
        };
        let _ = r.qp.post_send(&SendWr::new(id, op, &sge).flags(flags));
    }

    fn msn_of(fetched: u64, d: i32) -> u32 {
        (fetched as i64 + i64::from(d)).rem_euclid(1 << 24) as u32
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 600,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn review13_retire_on_a_nearly_full_cq_leaves_what_the_slow_path_leaves(
            fill in 52u32..=64,
            n in prop_oneof![Just(31u32), 0u32..8],
            acts in vec(act(), 1..40),
        ) {
            let polled = std::cell::RefCell::new(Vec::<Vec<crate::WorkCompletion>>::new());
            let scenario = |r: &mut Rig| {
                polled.borrow_mut().push(vec![]);
                let (ids, carrier) = (Cell::new(0u64), Cell::new(fill));
                fill_receive_cq(r, fill);
                respond(r, Psn::new(0).sub(1).get(), credits(n), 0);
                r.step();
                for a in &acts {
                    match a {
                        Act::Post(ops) => {
                            for &(op, signaled) in ops {
                                post_one(r, ids.get(), op, signaled);
                                ids.set(ids.get() + 1);
                            }
                            r.step();
                        }
                        &Act::Ack { at, off, syndrome, msn, riding: ride } => {
                            let (_, last, fetched) = window(r, at);
                            let psn = if off >= 0 { last.add(off as u32) } else { last.sub(off.unsigned_abs().into()) }.get();
                            let msn = match msn {
                                Ok(d) => msn_of(fetched, d),
                                Err(any) => any & 0xFF_FFFF,
                            };
                            let syndrome = if syndrome >> 5 == 0b001 { 0b001_00000 } else { syndrome };
                            if ride && syndrome >> 5 == 0 {
                                // Riding in a request the responder has not seen (its PSN
                                // the next it expects).
                                riding(r, carrier.get(), psn, Syndrome::from_u8(syndrome), msn);
                                carrier.set(carrier.get() + 1);
                            } else {
                                respond(r, psn, Syndrome::from_u8(syndrome), msn);
                            }
                            r.step();
                        }
                        &Act::Answer { msn } => {
                            let (oldest, last, fetched) = window(r, 0);
                            let Some((first, op, len)) = oldest else { continue };
                            let a = (credits(4), msn_of(fetched, msn));
                            match op {
                                crate::wqe::WqeOp::Read => {
                                    let data = vec![0x5A; len as usize];
                                    respond_data(r, Opcode::RdmaReadResponseOnly, first.get(), a, None, &data);
                                }
                                o if o.is_atomic() => {
                                    respond_data(r, Opcode::AtomicAcknowledge, first.get(), a, Some(0x1234), &[]);
                                }
                                _ => respond(r, last.get(), a.0, a.1),
                            }
                            r.step();
                        }
                        &Act::Poll(k) => {
                            let mut wc = [crate::WorkCompletion::default(); 8];
                            let got = r.cq.poll(&mut wc[..k]);
                            polled.borrow_mut().last_mut().unwrap().extend_from_slice(&wc[..got]);
                        }
                        Act::Step => r.step(),
                        Act::DestroyCq => {
                            let other = r.ctx.create_cq(4).unwrap();
                            drop(std::mem::replace(&mut r.cq, other));
                            r.step();
                        }
                        &Act::Drain(sqd) => {
                            let to = if sqd { QpState::Sqd } else { QpState::Rts };
                            let _ = r.qp.modify(&QpAttr::new(to));
                            r.step();
                        }
                        Act::Error => {
                            let _ = r.qp.modify(&QpAttr::new(QpState::Error));
                            r.step();
                        }
                    }
                }
            };
            let (out, taken) = same_both_ways(AccessFlags::ALL, &scenario);
            if std::env::var_os("REVIEW13_SHOW").is_some() {
                eprintln!("ack {} answer {} {} retire {} wcs {} req {}", taken[Path::Ack as usize], taken[Path::ReadResponse as usize], taken[Path::AtomicAck as usize], taken[Path::Retire as usize], out.completions.len(), out.req);
            }
            let polled = polled.into_inner();
            prop_assert_eq!(&polled[0], &polled[1], "the completions polled on the way");
        }
    }
}

/// Review 13: the Ack fast path's and the answer fast path's retire (`retire_acked`) meet
/// a WQE with a gather list (two elements: `DataLoc::Table`, which it leaves to the full
/// retire) behind unsignaled ones it already passed over (their regions released, not
/// yet dropped from the window): the full retire must go on from there — each region
/// released once, every WQE retired, the completions in order — as the slow path leaves
/// it; with room in the CQ, with the CQ full mid-run, and a Read of two elements answered
/// on the answer fast path. (No other test posts a gather list on this path: the rig's
/// `max_send_sge` was 1.)
#[test]
fn review13_gather_lists_behind_passed_over_wqes_retire_as_in_the_slow_path() {
    struct Sge1;
    impl Drop for Sge1 {
        fn drop(&mut self) {
            super::tests::MAX_SEND_SGE.with(|c| c.set(1));
        }
    }
    super::tests::MAX_SEND_SGE.with(|c| c.set(2));
    let _reset = Sge1;
    fn post2(r: &mut Rig, id: u64, op: SendOp, at: u64, two: bool, signaled: bool) {
        let one = [r.mr.sge(at, 8).unwrap()];
        let both = [r.mr.sge(at, 8).unwrap(), r.mr.sge(at + 512, 8).unwrap()];
        let sge: &[crate::Sge<'_>] = if two { &both } else { &one };
        let flags = if signaled {
            crate::SendFlags::SIGNALED
        } else {
            crate::SendFlags::NONE
        };
        r.qp.post_send(&SendWr::new(id, op, sge).flags(flags))
            .unwrap();
    }
    for full in [false, true] {
        // Sends: one element unsignaled, two unsignaled, one signaled, one unsignaled; one
        // Ack of all four.
        let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
            if full {
                fill_receive_cq(r, 64);
            }
            respond(r, Psn::new(0).sub(1).get(), credits(16), 0);
            r.step();
            post2(r, 0, SendOp::Send, 0, false, false);
            post2(r, 1, SendOp::Send, 1024, true, false);
            post2(r, 2, SendOp::Send, 2048, false, true);
            post2(r, 3, SendOp::Send, 3072, true, false);
            post2(r, 4, SendOp::Send, 4096, false, true);
            // Not acknowledged: its region stays held (a region released twice would show
            // here).
            post2(r, 5, SendOp::Send, 5120, false, true);
            r.step();
            respond(r, 4, credits(16), 5);
            r.step();
            if full {
                let mut n = 0;
                while n < 64 {
                    n += r.completions().len();
                }
                r.step();
            }
        });
        assert_eq!(taken[Path::Ack as usize], 1, "full {full}: {out:#?}");
        let ids: Vec<_> = out.completions.iter().map(|c| c.wr_id).collect();
        assert_eq!(ids, [2, 4], "full {full}");
        assert_eq!(out.in_flight, 1, "full {full}: the last Send's region only");
        assert!(
            out.req.starts_with("(5, 6, 6,"),
            "five retired: {}",
            out.req
        );
    }
    // Reads of two elements answered on the answer fast path, signaled and not, behind an
    // unsignaled Send of two; a Send not acknowledged behind them.
    let remote_at = |r: &Rig, k: u64| r.mr.remote(16384 + 1024 * k);
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        respond(r, Psn::new(0).sub(1).get(), credits(16), 0);
        r.step();
        post2(r, 0, SendOp::Send, 0, true, false);
        r.step();
        respond(r, 0, credits(16), 1);
        r.step();
        let remote = remote_at(r, 1);
        post2(r, 1, SendOp::RdmaRead(remote), 1024, true, false);
        r.step();
        read_response(r, 1, 2, &[0xA5; 16]);
        r.step();
        let remote = remote_at(r, 2);
        post2(r, 2, SendOp::RdmaRead(remote), 2048, true, true);
        r.step();
        read_response(r, 2, 3, &[0x5A; 16]);
        r.step();
        post2(r, 3, SendOp::Send, 3072, false, true);
        r.step();
    });
    assert_eq!(taken[Path::ReadResponse as usize], 2, "{out:#?}");
    let got: Vec<_> = out
        .completions
        .iter()
        .map(|c| (c.wr_id, c.byte_len))
        .collect();
    assert_eq!(got, [(2, 16)]);
    assert_eq!(out.in_flight, 1, "the last Send's region only");
    assert!(
        out.req.starts_with("(3, 4, 4,"),
        "three retired: {}",
        out.req
    );
}

/// Review 12: random rounds of the straight RDMA Write both ways — Writes of ours
/// (one element, inline bytes, an element too large for a line; signaled, solicited,
/// fenced or not), Sends and Reads (answered or not); the peer's lone Write Only lines at PSNs around ePSN with
/// payloads up to one byte more than a line holds, RETH lengths around the payload's,
/// addresses in the region, at its end, wrapping around 2^64, in a region of another
/// domain, in a region without remote write, in a region deregistered meanwhile, with a
/// riding Ack, a random opcode or BTH flags byte (TVer, pad count, SE, M); Acks and
/// PSN Sequence Error Naks of ours (go-back-N resends the straight Writes), the owed Acks
/// held back or not, SQD, Error and the link down: the straight paths leave what the
/// general ones leave, the other regions' bytes included.
mod rev12_random_straight_writes {
    use super::*;
    use crate::SendFlags;
    use proptest::collection::vec;
    use proptest::prelude::*;
    use std::cell::RefCell;

    #[derive(Debug, Clone)]
    enum Step {
        /// A Write of ours: `how` 0 one element, 1 inline bytes, 2 an element of 200 bytes;
        /// `flags` bit 0 signaled, 1 solicited, 2 fence.
        Write { how: u8, len: u8, flags: u8 },
        /// A Send of ours of 8 bytes.
        Send,
        /// An RDMA Read of ours of 8 bytes (what a fenced Write waits for).
        Read,
        /// The peer's Read Response Only of the first PSN not acknowledged.
        ReadResp,
        /// A lone Write Only line of the peer's.
        Line {
            at: i32,
            len: u8,
            dlen: i8,
            target: u8,
            ack: Option<(i32, u32)>,
            byte: Option<(usize, u8)>,
        },
        /// A Send Only line of the peer's at ePSN.
        Ping,
        /// `n` receives posted.
        Recv(u8),
        /// The peer acknowledges everything sent so far.
        AckAll { credits: u16 },
        /// The peer's PSN Sequence Error Nak of the first PSN not acknowledged.
        NakSeq,
        /// Owed Acks held back (or not) from now on.
        Hold(bool),
        /// One more engine iteration.
        Turn,
        /// The region of the `Dereg` target deregistered.
        Dereg,
        /// The QP drained (SQD), then back to RTS.
        Drain,
        /// The QP moved to Error.
        Error,
        /// The link taken down.
        LinkDown,
    }

    fn step() -> impl Strategy<Value = Step> {
        let line = (
            prop_oneof![6 => Just(0i32), 1 => -2i32..3],
            prop_oneof![6 => 0u8..13, 1 => Just(13u8)],
            prop_oneof![6 => Just(0i8), 1 => -1i8..2],
            0u8..8,
            proptest::option::weighted(
                0.5,
                (-2i32..6, prop_oneof![3 => 0u32..8, 1 => any::<u32>()]),
            ),
            proptest::option::weighted(0.15, (0usize..2, any::<u8>())),
        )
            .prop_map(|(at, len, dlen, target, ack, byte)| Step::Line {
                at,
                len,
                dlen,
                target,
                ack,
                byte,
            });
        prop_oneof![
            6 => (0u8..3, 0u8..14, 0u8..8).prop_map(|(how, len, flags)| Step::Write { how, len, flags }),
            2 => Just(Step::Send),
            1 => Just(Step::Read),
            1 => Just(Step::ReadResp),
            8 => line,
            1 => Just(Step::Ping),
            1 => (0u8..3).prop_map(Step::Recv),
            3 => (0u16..40).prop_map(|credits| Step::AckAll { credits }),
            2 => Just(Step::NakSeq),
            1 => any::<bool>().prop_map(Step::Hold),
            3 => Just(Step::Turn),
            1 => Just(Step::Dereg),
            1 => Just(Step::Drain),
            1 => Just(Step::Error),
            1 => Just(Step::LinkDown),
        ]
    }

    /// The requester's window: (next PSN, WQEs started, the last PSN acknowledged).
    fn window(r: &Rig) -> (Psn, u64, Psn) {
        let qpn = r.qp.qpn();
        r.ctx
            .shared
            .engine
            .with(|e| {
                e.with_stage(qpn, |q, _| {
                    let w = q.proto.req.window();
                    (w.npsn(), w.started(), w.acked())
                })
            })
            .unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 384,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn rev12_random_straight_writes_leave_what_the_general_paths_leave(
            hold in any::<bool>(),
            recvs in 0u8..4,
            steps in vec(step(), 1..24),
        ) {
            let _inline = super::super::tests::InlineRigs::of(64);
            let answers = RefCell::new(vec![]);
            let scenario = |r: &mut Rig| {
                r.mr.write_at(0, &[0x5a; 512]).unwrap();
                let other_pd = r.ctx.alloc_pd().unwrap();
                let other = other_pd.alloc_mr(256, AccessFlags::ALL).unwrap();
                let read_only = r
                    .pd
                    .alloc_mr(256, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
                    .unwrap();
                let gone = RefCell::new(Some(r.pd.alloc_mr(256, AccessFlags::ALL).unwrap()));
                let gone_at = gone.borrow().as_ref().unwrap().remote(16);
                let mut receives = random_round_start(r, hold, 8192, recvs);
                let mut id = 100u64;
                for s in &steps {
                    match *s {
                        Step::Write { how, len, flags } => {
                            id += 1;
                            let mut f = SendFlags::NONE;
                            if flags & 1 != 0 {
                                f = f | SendFlags::SIGNALED;
                            }
                            if flags & 2 != 0 {
                                f = f | SendFlags::SOLICITED;
                            }
                            if flags & 4 != 0 {
                                f = f | SendFlags::FENCE;
                            }
                            let bytes = [b'a' + (id % 26) as u8; 64];
                            let len = u32::from(len);
                            let remote = r.mr.remote(4096 + 8 * (id % 64));
                            let op = SendOp::RdmaWrite(remote);
                            let got = match how {
                                0 => {
                                    let sge = [r.mr.sge(u64::from(len) * 3, len).unwrap()];
                                    r.qp.post_send(&SendWr::new(id, op, &sge).flags(f))
                                }
                                1 => r.qp.post_send(
                                    &SendWr::inline(id, op, &bytes[..len as usize]).flags(f),
                                ),
                                _ => {
                                    let sge = [r.mr.sge(0, 200).unwrap()];
                                    r.qp.post_send(&SendWr::new(id, op, &sge).flags(f))
                                }
                            };
                            answers.borrow_mut().push(format!("{id}: {:?}", got.err()));
                        }
                        Step::Send => {
                            id += 1;
                            let sge = [r.mr.sge(0, 8).unwrap()];
                            let got = r.qp.post_send(&SendWr::new(id, SendOp::Send, &sge));
                            answers.borrow_mut().push(format!("{id}: {:?}", got.err()));
                        }
                        Step::Read => {
                            id += 1;
                            let sge = [r.mr.sge(6144, 8).unwrap()];
                            let remote = r.mr.remote(2048);
                            let wr = SendWr::new(id, SendOp::RdmaRead(remote), &sge)
                                .flags(SendFlags::SIGNALED);
                            let got = r.qp.post_send(&wr);
                            answers.borrow_mut().push(format!("{id}: {:?}", got.err()));
                        }
                        Step::ReadResp => {
                            let (npsn, started, acked) = window(r);
                            if started > 0 && acked.add(1) != npsn {
                                read_response(r, acked.add(1).get(), started as u32, b"response");
                            }
                        }
                        Step::Line { at, len, dlen, target, ack, byte } => {
                            let k = super::random_requests::epsn_offset(r)
                                .wrapping_add(at.rem_euclid(1 << 24) as u32);
                            let payload = [0xC0 | len; 13];
                            let dma_len = (i32::from(len) + i32::from(dlen)).max(0) as u32;
                            let reth = match target {
                                0..=2 => r.reth(2048 + 16 * u64::from(target), dma_len),
                                3 => r.reth(r.mr.len() - 4, dma_len),
                                4 => crate::wire::RethRepr {
                                    va: u64::MAX - 3,
                                    rkey: r.mr.remote(0).rkey,
                                    dma_len,
                                },
                                5 => {
                                    let at = other.remote(16);
                                    crate::wire::RethRepr { va: at.addr, rkey: at.rkey, dma_len }
                                }
                                6 => {
                                    let at = read_only.remote(16);
                                    crate::wire::RethRepr { va: at.addr, rkey: at.rkey, dma_len }
                                }
                                _ => crate::wire::RethRepr {
                                    va: gone_at.addr,
                                    rkey: gone_at.rkey,
                                    dma_len,
                                },
                            };
                            let n = usize::from(len).min(12);
                            let mut sl = write_slot(r, k, reth, &payload[..n], None);
                            sl.payload_len = u32::from(len);
                            if let Some((at, b)) = byte {
                                sl.data[at] = b;
                            }
                            if let Some((psn, msn)) = ack {
                                let psn = Psn::new(0).add(psn.rem_euclid(1 << 24) as u32).get();
                                let word =
                                    crate::wire::slot::riding_word(psn, credits(8).to_u8(), msn);
                                assert!(crate::wire::slot::set_riding_ack(&mut sl, word));
                            }
                            assert_eq!(r.tx.push_burst(&[sl]).unwrap(), 1);
                        }
                        Step::Ping => {
                            let k = super::random_requests::epsn_offset(r);
                            let sl = ping_slot(r, k, b"ping", None);
                            assert_eq!(r.tx.push_burst(&[sl]).unwrap(), 1);
                        }
                        Step::Recv(n) => receives.post(r, n),
                        Step::AckAll { credits: c } => {
                            let (npsn, started, _) = window(r);
                            if started > 0 {
                                respond(r, npsn.sub(1).get(), credits(u32::from(c)), started as u32);
                            }
                        }
                        Step::NakSeq => {
                            let (npsn, started, acked) = window(r);
                            if started > 0 && acked.add(1) != npsn {
                                let nak = Syndrome::Nak(NakCode::PsnSequenceError);
                                respond(r, acked.add(1).get(), nak, 0);
                            }
                        }
                        Step::Hold(h) => r.ctx.shared.engine.with(|e| e.hold_acks = h),
                        Step::Turn => {}
                        Step::Dereg => drop(gone.borrow_mut().take()),
                        Step::Drain => {
                            let got = r.qp.modify(&QpAttr::new(QpState::Sqd));
                            answers.borrow_mut().push(format!("sqd: {:?}", got.err()));
                            r.step();
                            let got = r.qp.modify(&QpAttr::new(QpState::Rts));
                            answers.borrow_mut().push(format!("rts: {:?}", got.err()));
                        }
                        Step::Error => {
                            let _ = r.qp.modify(&QpAttr::new(QpState::Error));
                        }
                        Step::LinkDown => {
                            let link = r.qp.query().config.dest.unwrap().link;
                            r.ctx
                                .shared
                                .engine
                                .with(|e| e.link_down(link, "the test took it down".into()));
                        }
                    }
                    r.ctx.shared.engine.with(|e| e.straight_skip = 0);
                    r.step();
                    let index = r.qp.index;
                    let state = r.ctx.shared.engine.with(|e| e.post_state(index));
                    answers.borrow_mut().push(format!("{state:?}"));
                }
                let mut bytes = vec![0; 256];
                other.read_at(0, &mut bytes).unwrap();
                answers.borrow_mut().push(format!("other: {bytes:?}"));
                read_only.read_at(0, &mut bytes).unwrap();
                answers.borrow_mut().push(format!("read only: {bytes:?}"));
            };
            same_both_ways(AccessFlags::ALL, &scenario);
            let answers = answers.into_inner();
            let (slow, fast) = answers.split_at(answers.len() / 2);
            prop_assert_eq!(fast, slow);
        }
    }

    /// Review 12: straight Writes (8 bytes of a region, inline bytes) whose packets were
    /// lost, sent again by go-back-N after a PSN Sequence Error Nak (from the window's
    /// records, which the straight post wrote from its values): the same packets — headers
    /// (RETH address, key, length), payloads, PSNs — as the first time.
    #[test]
    fn review12_straight_writes_resent_by_go_back_n_carry_their_first_bytes() {
        let _inline = super::super::tests::InlineRigs::of(64);
        crate::probe::set_enabled(true);
        let mut r = super::super::tests::rig(AccessFlags::ALL);
        respond(&mut r, Psn::new(0).sub(1).get(), credits(8), 0);
        r.step();
        r.mr.write_at(0, b"01234567").unwrap();
        let before = crate::probe::all_taken();
        let sge = [r.mr.sge(0, 8).unwrap()];
        let op = SendOp::RdmaWrite(r.mr.remote(4096));
        let signaled = SendFlags::SIGNALED;
        r.qp.post_send(&SendWr::new(1, op, &sge).flags(signaled))
            .unwrap();
        let op = SendOp::RdmaWrite(r.mr.remote(5000));
        r.qp.post_send(&SendWr::inline(2, op, b"inline!!").flags(signaled))
            .unwrap();
        r.step();
        let taken = crate::probe::all_taken()[Path::StraightWrite as usize];
        assert_eq!(taken - before[Path::StraightWrite as usize], 2);
        let first = sent_with_bodies(&mut r);
        assert_eq!(first.0.len(), 2, "{first:?}");
        let (npsn, _, acked) = window(&r);
        assert_eq!(acked.add(3), npsn);
        respond(
            &mut r,
            acked.add(1).get(),
            Syndrome::Nak(NakCode::PsnSequenceError),
            0,
        );
        r.step();
        r.step();
        let again = sent_with_bodies(&mut r);
        assert_eq!(again, first, "go-back-N sends the same packets");
        respond(&mut r, npsn.sub(1).get(), credits(8), 2);
        r.step();
        let mut wc = [WorkCompletion::default(); 4];
        let n = r.cq.poll(&mut wc);
        let got: Vec<_> = wc[..n].iter().map(|c| (c.wr_id, c.status)).collect();
        assert_eq!(
            got,
            [(1, crate::WcStatus::Success), (2, crate::WcStatus::Success)]
        );
    }

    /// Review 12: lone Write Only lines to a QP in RTR (it has never sent; the first
    /// request establishes communication): taken straight, what the full step leaves —
    /// the Communication Established event included (no test looked at it: the straight
    /// step's Write without `comm_established` passed every test).
    #[test]
    fn review12_straight_writes_to_a_qp_in_rtr_leave_what_the_full_step_leaves() {
        use std::cell::RefCell;
        let events = RefCell::new(vec![]);
        let scenario = |r: &mut Rig| {
            r.ctx.shared.engine.with(|e| e.straight_skip = 0);
            write_line(r, 0, 1024, b"abcd", None);
            r.step();
            write_line(r, 1, 1028, b"efghijkl", None);
            r.step();
            // A duplicate, then one ahead: answered by the pipeline.
            write_line(r, 1, 1028, b"XXXXXXXX", None);
            r.step();
            write_line(r, 5, 1040, b"ahead", None);
            r.step();
            let mut got = vec![];
            while let Some(e) = r.ctx.try_get_async_event() {
                got.push(e);
            }
            events.borrow_mut().push(got);
        };
        let (slow, none) = run_in(false, AccessFlags::ALL, QpState::Rtr, &scenario);
        assert_eq!(none, [0; crate::probe::PATHS]);
        let (fast, taken) = run_in(true, AccessFlags::ALL, QpState::Rtr, &scenario);
        assert_eq!(fast, slow);
        let events = events.into_inner();
        assert_eq!(events[1], events[0], "the same events both ways");
        assert!(
            matches!(events[1][..], [crate::AsyncEvent::CommEstablished { .. }]),
            "{events:?}"
        );
        assert_eq!(taken[Path::StraightWriteReceive as usize], 4, "{taken:?}");
        assert_eq!(fast.state, QpState::Rtr);
        assert_eq!(&fast.memory.0[1024..1036], b"abcdefghijkl");
    }

    /// Review 12: lone Write Only lines through a type 1 memory window (bound with remote
    /// write over part of a region of the QP's domain): one inside the window lands; one in
    /// the region but past the window's end, and one through the window's old key after it
    /// was bound again, are refused (a Nak, the QP in the Error state) — as the full step
    /// does, and writing nothing.
    #[test]
    fn review12_straight_writes_through_a_memory_window_are_checked_as_in_the_full_step() {
        use std::cell::RefCell;
        for case in ["inside", "past the window", "old key"] {
            let region = RefCell::new(vec![]);
            let scenario = |r: &mut Rig| {
                let access = AccessFlags::ALL | AccessFlags::MW_BIND;
                let mr = r.pd.alloc_mr(1024, access).unwrap();
                let mut mw = r.pd.alloc_mw(crate::MwType::One).unwrap();
                let bind = mr.mw_bind(256, 64, AccessFlags::REMOTE_WRITE);
                let key = r.qp.bind_mw(&mut mw, 7, bind, SendFlags::SIGNALED).unwrap();
                r.step();
                if case == "old key" {
                    let bind = mr.mw_bind(256, 64, AccessFlags::REMOTE_WRITE);
                    r.qp.bind_mw(&mut mw, 8, bind, SendFlags::SIGNALED).unwrap();
                    r.step();
                }
                let at = if case == "past the window" { 316 } else { 300 };
                let reth = crate::wire::RethRepr {
                    va: mr.addr() + at,
                    rkey: key,
                    dma_len: 8,
                };
                r.ctx.shared.engine.with(|e| e.straight_skip = 0);
                let s = write_slot(r, 0, reth, b"windowed", None);
                assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
                r.step();
                let mut bytes = vec![0; 1024];
                mr.read_at(0, &mut bytes).unwrap();
                region.borrow_mut().push(bytes);
            };
            let (out, taken) = same_both_ways(AccessFlags::ALL, &scenario);
            assert_eq!(
                taken[Path::StraightWriteReceive as usize],
                1,
                "{case}: {taken:?}"
            );
            let region = region.into_inner();
            assert_eq!(region[0], region[1], "{case}");
            if case == "inside" {
                assert_eq!(&region[1][300..308], b"windowed");
                assert_eq!(out.state, QpState::Rts);
            } else {
                assert!(region[1].iter().all(|&b| b == 0), "{case}");
                assert_eq!(out.state, QpState::Error, "{case}");
            }
        }
    }

    /// Review 12: lone Write Only lines to a QP drained (SQD: its responder still
    /// receives), then to the QP back in RTS: the straight step takes them, the first to
    /// the pipeline (the fast path's gate wants RTR or RTS), as the full step does.
    #[test]
    fn review12_straight_writes_to_a_drained_qp_leave_what_the_full_step_leaves() {
        let scenario = |r: &mut Rig| {
            post(r, 8, &[Op::Write(8)]);
            respond(
                r,
                Psn::new(0).sub(1).get().wrapping_add(1) & 0xFF_FFFF,
                credits(8),
                1,
            );
            r.step();
            r.qp.modify(&QpAttr::new(QpState::Sqd)).unwrap();
            r.step();
            r.step();
            r.ctx.shared.engine.with(|e| e.straight_skip = 0);
            write_line(r, 0, 1024, b"sqd!", None);
            r.step();
            r.qp.modify(&QpAttr::new(QpState::Rts)).unwrap();
            r.step();
            r.ctx.shared.engine.with(|e| e.straight_skip = 0);
            write_line(r, 1, 1028, b"rts!", None);
            r.step();
        };
        let (out, taken) = same_both_ways(AccessFlags::ALL, &scenario);
        assert_eq!(taken[Path::StraightWriteReceive as usize], 2, "{taken:?}");
        assert_eq!(&out.memory.0[1024..1032], b"sqd!rts!");
        assert_eq!(out.state, QpState::Rts);
    }

    /// Review 12: the same for a lone Send Only line first (the straight Send,
    /// `on_send_only`): the Communication Established event raised as the full step
    /// raises it (its `comm_established` removed, every test passed too).
    #[test]
    fn review12_a_straight_send_to_a_qp_in_rtr_raises_communication_established() {
        use std::cell::RefCell;
        let events = RefCell::new(vec![]);
        let scenario = |r: &mut Rig| {
            r.post_recv(2);
            r.ctx.shared.engine.with(|e| e.straight_skip = 0);
            ping(r, 0, b"ping", None);
            r.step();
            let mut got = vec![];
            while let Some(e) = r.ctx.try_get_async_event() {
                got.push(e);
            }
            events.borrow_mut().push(got);
        };
        let (slow, none) = run_in(false, AccessFlags::ALL, QpState::Rtr, &scenario);
        assert_eq!(none, [0; crate::probe::PATHS]);
        let (fast, taken) = run_in(true, AccessFlags::ALL, QpState::Rtr, &scenario);
        assert_eq!(fast, slow);
        assert_eq!(taken[Path::StraightReceive as usize], 1, "{taken:?}");
        let events = events.into_inner();
        assert_eq!(events[1], events[0], "the same events both ways");
        assert!(
            matches!(events[1][..], [crate::AsyncEvent::CommEstablished { .. }]),
            "{events:?}"
        );
    }
}

// --- Review 14: the straight receive step's responses, step by step ---

/// What one poll left, for [`stepwise_both_ways`]: the packets sent and the completions
/// polled since the last look, the QP's place in the engine's sets and its owed Acks'
/// hold, its timers, state and next PSN, and the statistics.
fn snapshot(r: &mut Rig) -> String {
    let answers = r.answers();
    let wc = r.completions();
    let qpn = r.qp.qpn();
    let index = qpn.get() & 0xfff;
    let stats = r.ctx.stats();
    let (sets, qp) = r.ctx.shared.engine.with(|e| {
        let sets = (e.post_state(index), e.is_timed(index));
        let qp = e.with_stage(qpn, |q, _| {
            let req = &q.proto.req;
            let w = req.window();
            (
                req.timer().armed(),
                req.rnr_timer().armed(),
                q.proto.state,
                (w.retired(), w.started(), w.fetched(), w.npsn(), w.acked()),
                format!("{:?}", req.credits()),
            )
        });
        (sets, qp)
    });
    format!("{answers:?} {wc:?} {sets:?} {qp:?} {stats:?}")
}

/// A scenario of [`stepwise_both_ways`]: the rig, and the function it steps with.
type Stepwise<'a> = &'a dyn Fn(&mut Rig, &dyn Fn(&mut Rig));

/// Runs `scenario` both ways ([`same_both_ways`]), and compares what every poll left
/// ([`snapshot`]), not only the end: the straight step's early return must not leave for
/// a later poll what the full iteration does in this one. The scenario steps with the
/// function it is given (which clears the straight step's back-off first).
fn stepwise_both_ways(scenario: Stepwise<'_>) -> Taken {
    let logs = std::cell::RefCell::new(vec![]);
    let (_, taken) = same_both_ways(AccessFlags::ALL, &|r| {
        let log = std::cell::RefCell::new(vec![]);
        let step = |r: &mut Rig| {
            r.ctx.shared.engine.with(|e| e.straight_skip = 0);
            r.step();
            log.borrow_mut().push(snapshot(r));
        };
        scenario(r, &step);
        logs.borrow_mut().push(log.into_inner());
    });
    let logs = logs.into_inner();
    assert_eq!(logs.len(), 2);
    for (i, (slow, fast)) in logs[0].iter().zip(&logs[1]).enumerate() {
        if std::env::var_os("REV14_LOG").is_some() {
            println!("poll {i}: {fast}");
        }
        assert_eq!(
            fast, slow,
            "poll {i}: the straight step must leave what the full one leaves"
        );
    }
    taken
}

/// A PSN Sequence Error Nak in a lone line: go-back-N resends in the same poll both ways.
#[test]
fn rev14_a_psn_sequence_error_nak_resends_in_the_same_poll() {
    let taken = stepwise_both_ways(&|r, step| {
        post(r, 8, &[Op::Send(4), Op::Send(4), Op::Send(4)]);
        step(r);
        respond(r, 0, Syndrome::Nak(NakCode::PsnSequenceError), 1);
        step(r);
        step(r);
        respond(r, 2, credits(8), 3);
        step(r);
        step(r);
    });
    assert!(taken[Path::StraightResponse as usize] >= 1, "{taken:?}");
}

/// A Remote Access Error Nak: the QP to Error, its WQEs flushed, in the same polls.
#[test]
fn rev14_a_remote_access_error_nak_flushes_in_the_same_poll() {
    let taken = stepwise_both_ways(&|r, step| {
        post(r, 8, &[Op::Write(4), Op::Send(4), Op::Read(8)]);
        step(r);
        respond(r, 0, Syndrome::Nak(NakCode::RemoteAccessError), 1);
        step(r);
        step(r);
        // An Ack after the Error state: dropped or ignored alike.
        respond(r, 2, credits(8), 3);
        step(r);
        step(r);
    });
    assert!(taken[Path::StraightResponse as usize] >= 1, "{taken:?}");
}

/// An Ack with credits: the Sends that waited for them go in the same poll.
#[test]
fn rev14_an_ack_with_credits_sends_what_waited_in_the_same_poll() {
    let taken = stepwise_both_ways(&|r, step| {
        post(r, 1, &[Op::Send(4), Op::Send(4), Op::Send(4), Op::Send(4)]);
        step(r);
        respond(r, 0, credits(4), 1);
        step(r);
        step(r);
        respond(r, 3, credits(4), 4);
        step(r);
        step(r);
    });
    assert!(taken[Path::StraightResponse as usize] >= 1, "{taken:?}");
}

/// More Reads than the responder's Read credits: each Read's response lets the next go,
/// in the same poll both ways; an RNR Nak arms the wait alike.
#[test]
fn rev14_read_responses_release_reads_waiting_for_read_credits_in_the_same_poll() {
    let taken = stepwise_both_ways(&|r, step| {
        // (The rig's max_rd_atomic is 1: one Read at a time.)
        let reads = [Op::Read(8); 4];
        post(r, 8, &reads);
        step(r);
        for k in 0..4 {
            read_response(r, k, k + 1, b"readdata");
            step(r);
        }
        step(r);
        post_only(r, 4, &[Op::Send(4)]);
        step(r);
        let rnr = Syndrome::RnrNak {
            timer: crate::wire::aeth::RnrTimer::new(1),
        };
        respond(r, 4, rnr, 4);
        step(r);
        step(r);
    });
    assert!(taken[Path::StraightResponse as usize] >= 4, "{taken:?}");
}

/// Hostile Read responses of one inline line with a multi-packet Read's opcodes (First
/// and Last with an AETH, Middle without), for a Read of 8 bytes, then the Ack of a
/// duplicate, then the right Read Response Only: alike poll by poll.
#[test]
fn rev14_read_response_first_middle_last_lone_lines_are_received_alike() {
    stepwise_both_ways(&|r, step| {
        post(r, 8, &[Op::Read(8), Op::FetchAdd]);
        step(r);
        for op in [Opcode::RdmaReadResponseFirst, Opcode::RdmaReadResponseLast] {
            respond_data(r, op, 0, (credits(4), 1), None, b"readdata");
            step(r);
        }
        let mut repr = PacketRepr::new(BthRepr::new(
            Opcode::RdmaReadResponseMiddle,
            r.qp.qpn(),
            Psn::new(0),
        ));
        repr.aeth = None;
        let mut s = PacketSlot::default();
        s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
        s.kind = crate::wire::slot::KIND_INLINE;
        s.payload_len = 8;
        assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
        step(r);
        respond(r, Psn::new(0).sub(1).get(), credits(2), 0);
        step(r);
        read_response(r, 0, 1, b"readdata");
        step(r);
        atomic_ack(r, 1, 2, 9);
        step(r);
        step(r);
    });
}

/// Acks for a QP in SQD and then in Error: alike poll by poll.
#[test]
fn rev14_acks_for_a_qp_in_sqd_and_error_are_received_alike() {
    stepwise_both_ways(&|r, step| {
        post(r, 8, &[Op::Send(4), Op::Send(4)]);
        step(r);
        r.qp.modify(&QpAttr::new(QpState::Sqd)).unwrap();
        step(r);
        respond(r, 0, credits(4), 1);
        step(r);
        step(r);
        r.qp.modify(&QpAttr::new(QpState::Error)).unwrap();
        step(r);
        respond(r, 1, credits(4), 2);
        step(r);
        step(r);
    });
}

/// Hostile lone response lines, each on a fresh rig after a Read, a Send and a Fetch and
/// Add went out, then the good answers: poll by poll alike — inline lengths past the
/// line's room, a payload length with no payload, the pad count, a Nak of every code, an
/// RNR Nak of a Read, an Ack of a PSN before the window, an Ack of the whole window at
/// once (implicit completion of the Read: a bad response), another QP's number on this
/// link.
#[test]
fn rev14_hostile_lone_responses_leave_every_poll_as_the_full_step_leaves_it() {
    type Make = fn(&mut Rig);
    fn slot_of(r: &Rig, op: Opcode, psn: u32, syndrome: Syndrome, orig: Option<u64>) -> PacketSlot {
        let mut repr = PacketRepr::new(BthRepr::new(op, r.qp.qpn(), Psn::new(psn)));
        repr.aeth = Some(AethRepr {
            syndrome,
            msn: Msn::new(1),
        });
        repr.atomic_ack_eth = orig.map(|orig| crate::wire::AtomicAckEthRepr { orig });
        let mut s = PacketSlot::default();
        s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
        s
    }
    fn push(r: &mut Rig, s: PacketSlot) {
        assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
    }
    let cases: [(&str, Make); 12] = [
        ("inline past the room", |r| {
            let mut s = slot_of(r, Opcode::RdmaReadResponseOnly, 0, credits(4), None);
            s.kind = crate::wire::slot::KIND_INLINE;
            s.payload_len = 25;
            push(r, s);
        }),
        ("inline of u32::MAX bytes", |r| {
            let mut s = slot_of(r, Opcode::RdmaReadResponseOnly, 0, credits(4), None);
            s.kind = crate::wire::slot::KIND_INLINE;
            s.payload_len = u32::MAX;
            push(r, s);
        }),
        ("no payload but a length", |r| {
            let mut s = slot_of(r, Opcode::RdmaReadResponseOnly, 0, credits(4), None);
            s.payload_len = 8;
            push(r, s);
        }),
        ("a pad count", |r| {
            let mut s = slot_of(r, Opcode::RdmaReadResponseOnly, 0, credits(4), None);
            s.kind = crate::wire::slot::KIND_INLINE;
            s.payload_len = 8;
            s.data[1] |= 0x30;
            push(r, s);
        }),
        ("Invalid Request Nak", |r| {
            let nak = Syndrome::Nak(NakCode::InvalidRequest);
            push(r, slot_of(r, Opcode::Acknowledge, 1, nak, None));
        }),
        ("Remote Operational Error Nak", |r| {
            let nak = Syndrome::Nak(NakCode::RemoteOperationalError);
            push(r, slot_of(r, Opcode::Acknowledge, 1, nak, None));
        }),
        ("PSN Sequence Error Nak of the Read", |r| {
            let nak = Syndrome::Nak(NakCode::PsnSequenceError);
            push(r, slot_of(r, Opcode::Acknowledge, 0, nak, None));
        }),
        ("RNR Nak of the Read", |r| {
            let rnr = Syndrome::RnrNak {
                timer: RnrTimer::new(1),
            };
            push(r, slot_of(r, Opcode::Acknowledge, 0, rnr, None));
        }),
        ("an Ack before the window", |r| {
            let psn = Psn::new(0).sub(5).get();
            push(r, slot_of(r, Opcode::Acknowledge, psn, credits(4), None));
        }),
        ("an Ack of the whole window", |r| {
            push(r, slot_of(r, Opcode::Acknowledge, 2, credits(4), None));
        }),
        ("an Atomic Acknowledge of the Read", |r| {
            push(
                r,
                slot_of(r, Opcode::AtomicAcknowledge, 0, credits(4), Some(7)),
            );
        }),
        ("another QP's number", |r| {
            let mut s = slot_of(r, Opcode::Acknowledge, 1, credits(4), None);
            s.data[5] ^= 0x10;
            push(r, s);
        }),
    ];
    for (what, make) in cases {
        println!("{what}");
        stepwise_both_ways(&|r, step| {
            post(r, 8, &[Op::Read(8), Op::Send(4), Op::FetchAdd]);
            step(r);
            make(r);
            step(r);
            step(r);
            read_response(r, 0, 1, b"readdata");
            step(r);
            respond(r, 1, credits(4), 2);
            step(r);
            atomic_ack(r, 2, 3, 9);
            step(r);
            step(r);
        });
    }
}

/// Lone Acks for a QP in Reset and then RTR again (no requests sent): alike poll by poll.
#[test]
fn rev14_an_ack_for_a_qp_in_reset_is_received_alike() {
    stepwise_both_ways(&|r, step| {
        post(r, 8, &[Op::Send(4), Op::Send(4)]);
        step(r);
        r.qp.modify(&QpAttr::new(QpState::Reset)).unwrap();
        step(r);
        respond(r, 0, credits(4), 1);
        step(r);
        step(r);
        respond(r, 1, Syndrome::Nak(NakCode::PsnSequenceError), 1);
        step(r);
        step(r);
    });
}

/// A ping-pong on one QP with the owed Acks held (`hold_acks`): the peer's Sends come in
/// straight and owe Acks, this side's Sends are acknowledged by lone Acks in between, an
/// RNR Nak's wait passes and the timer turn resends — poll by poll alike, the timer
/// countdown and the hold of the owed Acks included.
#[test]
fn rev14_a_held_ack_ping_pong_with_lone_acks_and_an_rnr_wait_is_alike_poll_by_poll() {
    stepwise_both_ways(&|r, step| {
        r.ctx.shared.engine.with(|e| e.hold_acks = true);
        r.post_recv(4);
        post(r, 8, &[Op::Send(4)]);
        step(r);
        for k in 0..3u32 {
            r.request(Opcode::SendOnly, k, |_| {}, b"ping");
            step(r);
            respond(r, k, credits(8), k + 1);
            step(r);
            post_only(r, u64::from(k) + 1, &[Op::Send(4)]);
            step(r);
        }
        let rnr = Syndrome::RnrNak {
            timer: RnrTimer::new(1),
        };
        respond(r, 3, rnr, 3);
        step(r);
        std::thread::sleep(std::time::Duration::from_millis(5));
        for _ in 0..(2 * crate::engine::TIMER_EVERY) {
            step(r);
        }
        respond(r, 3, credits(8), 4);
        for _ in 0..(2 * crate::engine::TIMER_EVERY) {
            step(r);
        }
    });
}

/// Lone Sends with Immediate and with Invalidate, inline and of no bytes: their headers
/// (a BTH and a 4-byte ImmDt or IETH) are as long as a BTH and an AETH, so bytes 5..8 say
/// a response's slot ([`crate::engine`]'s `response_word`); the parse turns them away and
/// the full step takes them — poll by poll as with the straight step off.
#[test]
fn rev14_lone_sends_with_a_response_header_length_are_received_alike() {
    let taken = stepwise_both_ways(&|r, step| {
        r.post_recv(4);
        r.request(
            Opcode::SendOnlyWithImmediate,
            0,
            |p| p.immdt = Some(ImmDtRepr { imm: 7 }),
            b"abcd",
        );
        step(r);
        r.request(
            Opcode::SendOnlyWithImmediate,
            1,
            |p| p.immdt = Some(ImmDtRepr { imm: 8 }),
            b"",
        );
        step(r);
        r.request(
            Opcode::SendOnlyWithInvalidate,
            2,
            |p| p.ieth = Some(IethRepr { rkey: 0x1234 }),
            b"abcd",
        );
        step(r);
        step(r);
    });
    assert_eq!(taken[Path::StraightResponse as usize], 0, "{taken:?}");
}
