//! The receive fast paths of RDMA Reads and Atomics ([`super::read_fast`],
//! [`super::atomic_fast`]), the completer's answer fast path and the riding Ack against a
//! hostile peer: requests and responses at the edges of what the fast paths take, each
//! run through the fast paths and through the slow paths with the harness of
//! [`super::fast_tests`] (the same packets, completions, statistics, memory, QP state),
//! and checked against the spec where it says what must happen.

use super::fast_tests::{
    Op, Outcome, atomic_ack, atomic_request, credits, post, read_request, read_response,
    request_direct, request_direct_with, respond, respond_data, rq, run, run_in, same_both_ways,
};
use super::tests::Rig;
use crate::probe::Path;
use crate::psn::Psn;
use crate::wire::aeth::{NakCode, Syndrome};
use crate::wire::opcode::Opcode;
use crate::wire::{AtomicEthRepr, IethRepr, RethRepr};
use crate::{AccessFlags, MwType, QpAttr, QpState, SendOp, SendWr};

/// A scenario's requests (before the engine runs).
type Scenario = dyn Fn(&mut Rig);

/// Where a Read goes on a rig: VA and length.
type Where = dyn Fn(&Rig) -> (u64, u32);

/// The VA of the rig's region.
fn base(r: &Rig) -> u64 {
    r.reth(0, 0).va
}

/// The rig's region is 64 KiB.
const REGION: u64 = 64 << 10;

/// An RDMA Read Request at PSN offset `k` through `reth`.
fn read_with(r: &mut Rig, k: u32, reth: RethRepr) {
    r.request(Opcode::RdmaReadRequest, k, |p| p.reth = Some(reth), b"");
}

/// An Atomic `op` at PSN offset `k` on `va` through `rkey`.
fn atomic_with(r: &mut Rig, op: Opcode, k: u32, va: u64, rkey: u32, swap_add: u64) {
    r.request(
        op,
        k,
        |p| {
            p.atomic_eth = Some(AtomicEthRepr {
                va,
                rkey,
                swap_add,
                compare: 0,
            })
        },
        b"",
    );
}

/// Gives the rig's QP four responder resources (`max_dest_rd_atomic`), through SQD.
fn four_resources(r: &mut Rig) {
    r.qp.modify(&QpAttr::new(QpState::Sqd)).unwrap();
    r.step();
    r.qp.modify(&QpAttr::new(QpState::Sqd).max_dest_rd_atomic(4))
        .unwrap();
    r.qp.modify(&QpAttr::new(QpState::Rts)).unwrap();
    r.step();
}

/// The opcodes and absolute PSNs of what a scenario sent.
fn ops(out: &Outcome) -> Vec<(Opcode, u32)> {
    out.sent.iter().map(|s| (s.0, s.1)).collect()
}

/// The attack: Reads at the very edges of the region — ending exactly at its end, one
/// byte past it, a VA that wraps around 2^64 (through a valid R_Key), zero bytes at and
/// past the end and at the top of the address space — each alone in its burst. The fast
/// path must answer exactly what the pipeline answers (the data, or the R_Key Violation
/// Nak with the QP in Error), never read outside the region.
#[test]
fn reads_at_the_edges_of_the_region_are_answered_as_in_the_pipeline() {
    let cases: [(&Where, bool); 9] = [
        (&|r| (base(r) + REGION - 8, 8), true),
        (&|r| (base(r) + REGION - 256, 256), true),
        (&|r| (base(r) + REGION - 7, 8), false),
        (&|r| (base(r) + REGION, 1), false),
        (&|_| (u64::MAX - 3, 8), false),
        (&|r| (base(r).wrapping_sub(8), 16), false),
        (&|r| (base(r) + REGION, 0), true),
        (&|_| (u64::MAX, 0), true),
        (&|r| (base(r) + (1 << 40), 8), false),
    ];
    for (i, (at, ok)) in cases.iter().enumerate() {
        let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
            r.mr.write_at(REGION - 256, &[0x5a; 256]).unwrap();
            let (va, len) = at(r);
            let mut reth = r.reth(0, len);
            reth.va = va;
            read_with(r, 0, reth);
            r.step();
        });
        let fast = taken[Path::Read as usize];
        assert_eq!(fast, u64::from(*ok), "case {i}: {:?}", out.sent);
        if *ok {
            assert_eq!(out.sent[0].0, Opcode::RdmaReadResponseOnly, "case {i}");
            assert_eq!(out.state, QpState::Rts, "case {i}");
        } else {
            let nak = out.sent[0].2.map(|a| a.syndrome);
            assert_eq!(
                nak,
                Some(Syndrome::Nak(NakCode::RemoteAccessError)),
                "case {i}"
            );
            assert_eq!(out.state, QpState::Error, "case {i}");
        }
    }
}

/// The attack: Atomics on the last word of the region, straddling its end (misaligned and
/// aligned-but-past), on a VA that wraps, misaligned inside it, and through the R_Key of
/// a region of another protection domain (valid, but not this QP's). Only the first is
/// executed, once, as the pipeline executes it; every other is the pipeline's Nak, and no
/// memory changes.
#[test]
fn atomics_at_the_edges_and_through_foreign_keys_are_refused_as_in_the_pipeline() {
    for case in 0..6 {
        let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
            r.mr.write_at(REGION - 8, &41u64.to_ne_bytes()).unwrap();
            let other_pd = r.ctx.alloc_pd().unwrap();
            let other = other_pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
            let base = r.reth(0, 0).va;
            let rkey = r.reth(0, 0).rkey;
            let (va, key) = match case {
                0 => (base + REGION - 8, rkey),
                1 => (base + REGION - 4, rkey),
                2 => (base + REGION, rkey),
                3 => (u64::MAX - 7, rkey),
                4 => (base + 12, rkey),
                _ => (other.remote(0).addr, other.remote(0).rkey),
            };
            atomic_with(r, Opcode::FetchAdd, 0, va, key, 1);
            r.step();
            let mut word = [0; 8];
            other.read_at(0, &mut word).unwrap();
            assert_eq!(word, [0; 8], "the other domain's region is untouched");
            r.mr.read_at(REGION - 8, &mut word).unwrap();
            let want = if case == 0 { 42u64 } else { 41 };
            assert_eq!(u64::from_ne_bytes(word), want, "case {case}");
        });
        assert_eq!(
            taken[Path::Atomic as usize],
            u64::from(case == 0),
            "case {case}: {:?}",
            out.sent
        );
        if case != 0 {
            assert_eq!(out.state, QpState::Error, "case {case}");
        }
    }
}

/// The attack: a Read through the R_Key of a region of another protection domain, and
/// through the R_Key of a deregistered region: both the pipeline's R_Key Violation, no
/// data sent.
#[test]
fn reads_through_foreign_or_dead_keys_are_refused_as_in_the_pipeline() {
    for case in 0..2 {
        let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
            let other_pd = r.ctx.alloc_pd().unwrap();
            let other = other_pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
            other.write_at(0, b"secret!!").unwrap();
            let remote = other.remote(0);
            if case == 1 {
                // A region of this QP's domain, gone.
                let dead = r.pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
                let remote = dead.remote(0);
                drop(dead);
                read_with(
                    r,
                    0,
                    RethRepr {
                        va: remote.addr,
                        rkey: remote.rkey,
                        dma_len: 8,
                    },
                );
            } else {
                read_with(
                    r,
                    0,
                    RethRepr {
                        va: remote.addr,
                        rkey: remote.rkey,
                        dma_len: 8,
                    },
                );
            }
            r.step();
        });
        eprintln!(
            "CASE {case} {:?} {:?} {:?}",
            out.sent, out.state, out.completions
        );
        assert_eq!(taken[Path::Read as usize], 0, "case {case}");
        assert_eq!(out.sent.len(), 1, "case {case}");
        assert_eq!(
            out.sent[0].2.map(|a| a.syndrome),
            Some(Syndrome::Nak(NakCode::RemoteAccessError))
        );
        assert!(out.bodies.iter().all(|b| b.5.is_empty() && b.4 == 0));
    }
}

/// The attack: a requester past the responder resources it was given (one): eight new
/// Reads and Atomics in one burst. The first is answered (on the fast path), the second
/// finds the resource held by the first's early answer and gets the pipeline's fatal
/// Invalid Request Nak (spec/01: the responder serves no more than it agreed); nothing
/// behind it executes.
#[test]
fn reads_and_atomics_past_the_responder_resources_in_one_burst_are_refused_as_in_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
        for k in 0..8 {
            if k % 2 == 0 {
                read_request(r, k, 4096, 8);
            } else {
                atomic_request(r, Opcode::FetchAdd, k, 2048, (1, 0));
            }
        }
        r.step();
    });
    assert_eq!(taken[Path::Read as usize], 1);
    assert_eq!(taken[Path::Atomic as usize], 0);
    assert_eq!(
        ops(&out),
        [
            (Opcode::RdmaReadResponseOnly, rq(0)),
            (Opcode::Acknowledge, rq(1))
        ]
    );
    assert_eq!(out.state, QpState::Error);
    assert_eq!(out.memory.0[2048..2056], [0; 8], "no Atomic executed");
}

/// The attack: one new Read or Atomic per burst, back to back across bursts, with idle
/// iterations and Sends between, so that the early answer of one burst still counts its
/// resource (no step 3 visit settled it) when the next burst's request looks: the
/// resource must be free again, as the pipeline's is once step 3 sent its response —
/// every request answered, on the fast path.
#[test]
fn early_answers_free_their_resource_for_the_next_burst() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
        let mut k = 0;
        for round in 0..12 {
            if round % 3 == 0 {
                atomic_request(r, Opcode::FetchAdd, k, 2048, (1, 0));
            } else {
                read_request(r, k, 4096, 8);
            }
            k += 1;
            r.step();
            if round % 4 == 1 {
                r.step();
                r.step();
            }
            if round % 5 == 2 {
                // A Write Only (fast path of its own) alone in a burst.
                let reth = r.reth(1024, 4);
                r.request(Opcode::RdmaWriteOnly, k, |p| p.reth = Some(reth), b"wxyz");
                k += 1;
                r.step();
            }
        }
    });
    assert_eq!(taken[Path::Read as usize], 8);
    assert_eq!(taken[Path::Atomic as usize], 4);
    assert_eq!(out.state, QpState::Rts);
    assert_eq!(out.memory.0[2048..2056], 4u64.to_ne_bytes());
}

/// The attack: the responder resources agreed are larger (four, set in SQD), and a burst
/// brings six new Reads: four are answered (the fast path only the first, while nothing
/// is queued), the fifth gets the pipeline's fatal Nak, as in the pipeline.
#[test]
fn a_burst_of_reads_past_four_resources_is_refused_as_in_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
        four_resources(r);
        // Four bursts of four: every one answered.
        for k in 0..16 {
            read_request(r, k, 4096, 8);
            if k % 4 == 3 {
                r.step();
            }
        }
        for k in 16..22 {
            read_request(r, k, 4096, 8);
        }
        r.step();
    });
    assert_eq!(taken[Path::Read as usize], 20);
    let sent = ops(&out);
    assert_eq!(sent.len(), 21, "{sent:?}");
    assert_eq!(sent[20], (Opcode::Acknowledge, rq(20)));
    assert_eq!(out.state, QpState::Error);
}

/// The attack: duplicates of a fast-answered Atomic, in the same burst as the original,
/// in later bursts, many times over, and after sixteen newer Atomics pushed it out of the
/// result cache. Each duplicate still cached gets the saved original value, the word is
/// changed exactly once per new Atomic, and one pushed out gets no answer — as in the
/// pipeline.
#[test]
fn duplicates_of_a_fast_atomic_never_execute_it_again() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
        r.mr.write_at(2048, &100u64.to_ne_bytes()).unwrap();
        atomic_request(r, Opcode::FetchAdd, 0, 2048, (1, 0));
        atomic_request(r, Opcode::FetchAdd, 0, 2048, (1, 0));
        r.step();
        for _ in 0..3 {
            atomic_request(r, Opcode::FetchAdd, 0, 2048, (1000, 0));
            r.step();
        }
        // Sixteen newer Atomics, one per burst: the first falls out of the cache.
        for k in 1..=16 {
            atomic_request(r, Opcode::CompareSwap, k, 2048, (7, 7));
            r.step();
        }
        atomic_request(r, Opcode::FetchAdd, 0, 2048, (1000, 0));
        atomic_request(r, Opcode::CompareSwap, 1, 2048, (1000, 1000));
        r.step();
    });
    assert_eq!(taken[Path::Atomic as usize], 17);
    let mut word = [0; 8];
    word.copy_from_slice(&out.memory.0[2048..2056]);
    // 100 + 1, then the Compare and Swaps (compare 7: only once it is 7, never).
    assert_eq!(u64::from_ne_bytes(word), 101);
    let origs: Vec<_> = out.bodies[..5].iter().map(|b| b.0).collect();
    assert_eq!(origs, [Some(100); 5]);
}

/// The attack: Reads and Atomics at ePSN around the PSN wrap (the rig's ePSN starts at
/// 0xFFFFFE), each answered on the fast path with the wrapped PSN, and a duplicate of the
/// Read just before the wrap sent after it (an old PSN, numerically larger).
#[test]
fn reads_and_atomics_across_the_psn_wrap_are_answered_as_in_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
        r.mr.write_at(4096, b"wrapping").unwrap();
        read_request(r, 0, 4096, 8);
        r.step();
        atomic_request(r, Opcode::FetchAdd, 1, 8192, (1, 0));
        r.step();
        read_request(r, 2, 4096, 8);
        r.step();
        read_request(r, 0, 4096, 8);
        atomic_request(r, Opcode::FetchAdd, 1, 8192, (1, 0));
        r.step();
        read_request(r, 3, 4096, 8);
        r.step();
    });
    assert_eq!(taken[Path::Read as usize], 3);
    assert_eq!(taken[Path::Atomic as usize], 1);
    assert_eq!(
        ops(&out),
        [
            (Opcode::RdmaReadResponseOnly, 0xFF_FFFE),
            (Opcode::AtomicAcknowledge, 0xFF_FFFF),
            (Opcode::RdmaReadResponseOnly, 0),
            (Opcode::RdmaReadResponseOnly, 0xFF_FFFE),
            (Opcode::AtomicAcknowledge, 0xFF_FFFF),
            (Opcode::RdmaReadResponseOnly, 1),
        ]
    );
    assert_eq!(out.bodies[3].0, None);
    assert_eq!(out.bodies[4].0, out.bodies[1].0);
}

/// The attack: the peer stops reading its ring while it sends Reads, one per burst (as a
/// requester that already gave up on the responses would), until the ring (128 lines) is
/// full: the 129th Read finds no slot, so the fast path leaves it to the pipeline (queued,
/// nothing lost, nothing sent twice); once the peer reads again it leaves, and the next
/// Read is fast again — as in the pipeline.
#[test]
fn reads_on_a_full_ring_fall_back_to_the_pipeline() {
    let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
        r.mr.write_at(4096, b"ringfull").unwrap();
        for k in 0..129 {
            read_request(r, k, 4096, 8);
            r.step();
        }
        // Read the ring (the first 128 responses, dropped here) and let the last leave.
        let mut buf = [crate::wire::slot::PacketSlot::default(); 64];
        let mut n = 0;
        while n < 128 {
            n += r.rx.pop_burst(&mut buf[..(128 - n).min(64)]).unwrap();
        }
        r.step();
        read_request(r, 129, 4096, 8);
        r.step();
    });
    assert_eq!(taken[Path::Read as usize], 129, "{taken:?}");
    assert_eq!(
        ops(&out),
        [
            (Opcode::RdmaReadResponseOnly, rq(128)),
            (Opcode::RdmaReadResponseOnly, rq(129))
        ]
    );
    assert_eq!(out.state, QpState::Rts);
}

/// The attack: a Read Response Only of the oldest WQE with the wrong length (one byte
/// short, one byte long), the wrong opcode (Atomic Acknowledge of a Read, Read response
/// of an Atomic), a PSN one ahead, one before (already acknowledged), with a Nak's
/// syndrome: each the slow path's answer (bad response, implied Nak or drop), never data
/// written outside the Read's scatter list.
#[test]
fn forged_read_responses_and_atomic_acks_are_taken_as_by_the_slow_path() {
    let cases: [(&Scenario, Op); 9] = [
        (&|r| read_response(r, 0, 1, &[1; 7]), Op::Read(8)),
        (&|r| read_response(r, 0, 1, &[1; 9]), Op::Read(8)),
        (&|r| atomic_ack(r, 0, 1, 5), Op::Read(8)),
        (&|r| read_response(r, 0, 1, &[1; 8]), Op::FetchAdd),
        (&|r| read_response(r, 1, 1, &[1; 8]), Op::Read(8)),
        (&|r| read_response(r, 0xFF_FFFF, 1, &[1; 8]), Op::Read(8)),
        (&|r| atomic_ack(r, 1, 1, 5), Op::CompareSwap),
        (
            &|r| {
                let op = Opcode::RdmaReadResponseOnly;
                let nak = Syndrome::Nak(NakCode::RemoteAccessError);
                respond_data(r, op, 0, (nak, 1), None, &[1; 8]);
            },
            Op::Read(8),
        ),
        (
            &|r| {
                // A Read of 300 bytes (two responses) answered with one Only.
                respond_data(
                    r,
                    Opcode::RdmaReadResponseOnly,
                    0,
                    (credits(4), 1),
                    None,
                    &[1; 300],
                );
            },
            Op::Read(300),
        ),
    ];
    for (i, (case, op)) in cases.iter().enumerate() {
        let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
            post(r, 4, &[*op]);
            let _ =
                r.rx.pop_burst(&mut [crate::wire::slot::PacketSlot::default(); 8]);
            case(r);
            r.step();
        });
        assert_eq!(
            taken[Path::ReadResponse as usize] + taken[Path::AtomicAck as usize],
            0,
            "case {i}"
        );
        // The scatter list is [0, len): nothing written past it.
        let len = match op {
            Op::Read(n) => *n as usize,
            _ => 8,
        };
        assert!(
            out.memory.0[len..1024].iter().all(|b| *b == 0),
            "case {i}: written past the scatter list"
        );
    }
}

/// The attack: a correct Read Response Only and Atomic Acknowledge of the oldest WQE that
/// arrive while the QP is in SQD (drained), or after it went to Error: the fast path takes
/// neither (RTS only), the slow path's answer stands.
#[test]
fn answers_in_sqd_or_error_are_taken_as_by_the_slow_path() {
    for (state, op) in [
        (QpState::Sqd, Op::Read(8)),
        (QpState::Sqd, Op::FetchAdd),
        (QpState::Error, Op::Read(8)),
        (QpState::Error, Op::CompareSwap),
    ] {
        let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
            post(r, 4, &[op]);
            r.qp.modify(&QpAttr::new(state)).unwrap();
            r.step();
            if matches!(op, Op::Read(_)) {
                read_response(r, 0, 1, b"12345678");
            } else {
                atomic_ack(r, 0, 1, 77);
            }
            r.step();
        });
        assert_eq!(
            taken[Path::ReadResponse as usize] + taken[Path::AtomicAck as usize],
            0,
            "{state:?} {op:?}"
        );
        assert_eq!(out.state, state);
    }
}

/// The attack: a riding positive Ack (in a request's line) whose PSN falls on an
/// outstanding Read's PSN, together with the Read's real response in the same burst,
/// and an Atomic Acknowledge behind a request carrying a riding Ack for it: the fast
/// paths leave what the slow paths leave (a plain Ack inside a Read's PSNs is an implied
/// Nak there, not a completion).
#[test]
fn a_riding_ack_on_a_reads_psn_is_taken_as_by_the_slow_path() {
    for op in [Op::Read(8), Op::FetchAdd] {
        let (out, _) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
            r.post_recv(1);
            post(r, 4, &[op]);
            // A Send to us carrying a positive Ack of PSN 0 (our Read or Atomic).
            let psn = Psn::new(rq(0));
            let repr = crate::wire::PacketRepr::new(crate::wire::BthRepr::new(
                Opcode::SendOnly,
                r.qp.qpn(),
                psn,
            ));
            let mut s = crate::wire::slot::PacketSlot::default();
            s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
            s.kind = crate::wire::slot::KIND_INLINE;
            s.payload_len = 4;
            let at = usize::from(s.hdr_len);
            s.data[at..at + 4].copy_from_slice(b"ride");
            let word = crate::wire::slot::riding_word(0, credits(4).to_u8(), 1);
            assert!(crate::wire::slot::set_riding_ack(&mut s, word));
            assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
            r.step();
            match op {
                Op::Read(_) => read_response(r, 0, 1, b"87654321"),
                _ => atomic_ack(r, 0, 1, 9),
            }
            r.step();
        });
        assert_eq!(out.completions.len(), 2, "{op:?}: {:?}", out.completions);
    }
}

/// A riding Ack of our oldest Send (credit code 4: a syndrome whose low bits are set)
/// takes the Ack fast path straight from its word in RTS, and the full path in SQD, where
/// the fast paths do not run; both ways the same completions, and with the fast paths off
/// none is taken.
#[test]
fn a_riding_ack_takes_the_ack_fast_path_in_rts_only() {
    for sqd in [false, true] {
        let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
            r.post_recv(1);
            post(r, 4, &[Op::Send(8)]);
            if sqd {
                r.qp.modify(&QpAttr::new(QpState::Sqd)).unwrap();
                r.step();
            }
            // A Send Only of nothing to us, carrying a positive Ack of PSN 0 (our Send).
            with_riding_ack(r, Opcode::SendOnly, 0, |_| {}, (0, 1));
            r.step();
            r.step();
        });
        assert_eq!(taken[Path::Ack as usize], u64::from(!sqd), "SQD: {sqd}");
        assert_eq!(out.completions.len(), 2, "SQD {sqd}: {:?}", out.completions);
    }
}

/// Responses the SQ Logic cannot take are dropped and counted (`Stats::dropped`), both
/// ways: a Read Response of a PSN never sent, a second Read Response of a PSN already
/// acknowledged (a duplicate) and an Ack of our Read after the QP moved to the Error
/// state. Each counts one more than the same scenario without it.
#[test]
fn responses_out_of_the_window_or_the_state_are_counted_as_dropped() {
    let never_sent = |bad: bool| {
        move |r: &mut Rig| {
            post(r, 4, &[Op::Read(8)]);
            if bad {
                read_response(r, 1, 1, b"readdata");
            }
            r.step();
        }
    };
    let duplicate = |bad: bool| {
        move |r: &mut Rig| {
            post(r, 4, &[Op::Read(8)]);
            read_response(r, 0, 1, b"readdata");
            r.step();
            if bad {
                read_response(r, 0, 1, b"readdata");
            }
            r.step();
        }
    };
    let in_error = |bad: bool| {
        move |r: &mut Rig| {
            post(r, 4, &[Op::Read(8)]);
            r.qp.modify(&QpAttr::new(QpState::Error)).unwrap();
            r.step();
            if bad {
                respond(r, 0, credits(4), 1);
            }
            r.step();
        }
    };
    let cases: [(&str, &Scenario, &Scenario); 3] = [
        ("a PSN never sent", &never_sent(false), &never_sent(true)),
        ("a duplicate", &duplicate(false), &duplicate(true)),
        ("in Error", &in_error(false), &in_error(true)),
    ];
    for (what, without, with) in cases {
        let (a, _) = same_both_ways(AccessFlags::ALL, without);
        let (b, _) = same_both_ways(AccessFlags::ALL, with);
        assert_eq!(b.stats.dropped, a.stats.dropped + 1, "{what}");
    }
}

// --- The pipeline's response is built in step 3; the fast path's in the receive step. ---

/// A Read (or an Atomic) answered on the fast path, and behind it in the same burst a Nak
/// of one of the QP's own requests (Remote Access Error) that moves the QP to the Error
/// state before step 3. The pipeline, which sends the response in step 3, finds the QP in
/// Error and discards it; the fast path sent it in the receive step, while the QP was in
/// RTS. Both are allowed (a response to a request received in RTS, sent before the QP
/// failed; the requester that gets none retries and finds the QP gone), the response is
/// the one the pipeline would have sent, and everything else is the same: the Atomic
/// executed once both ways, the same completions, state and memory. Pinned down here as
/// a known difference of the fast path, as the credits of `fast_tests`'
/// `a_send_behind_a_fast_read_is_acked_as_in_the_pipeline` are.
#[test]
fn an_answer_sent_before_the_qp_fails_in_the_same_burst_is_the_only_difference() {
    for atomic in [false, true] {
        let scenario = |r: &mut Rig| {
            r.mr.write_at(2048, &5u64.to_ne_bytes()).unwrap();
            post(r, 4, &[Op::Send(8)]);
            let _ =
                r.rx.pop_burst(&mut [crate::wire::slot::PacketSlot::default(); 8]);
            if atomic {
                atomic_request(r, Opcode::FetchAdd, 0, 2048, (1, 0));
            } else {
                read_request(r, 0, 4096, 8);
            }
            respond(r, 0, Syndrome::Nak(NakCode::RemoteAccessError), 0);
            r.step();
        };
        let (slow, _) = run(false, AccessFlags::ALL, &scenario);
        let (fast, taken) = run(true, AccessFlags::ALL, &scenario);
        assert_eq!(taken[Path::Read as usize] + taken[Path::Atomic as usize], 1);
        assert!(slow.sent.is_empty(), "{:?}", slow.sent);
        let want = if atomic {
            Opcode::AtomicAcknowledge
        } else {
            Opcode::RdmaReadResponseOnly
        };
        assert_eq!(ops(&fast), [(want, rq(0))]);
        assert_eq!(fast.state, QpState::Error);
        assert_eq!(
            (&fast.completions, fast.state, &fast.req, &fast.memory),
            (&slow.completions, slow.state, &slow.req, &slow.memory)
        );
        let word = if atomic { 6u64 } else { 5 };
        assert_eq!(
            fast.memory.0[2048..2056],
            word.to_ne_bytes(),
            "executed once"
        );
        assert_eq!(fast.stats.packets_sent, slow.stats.packets_sent + 1);
    }
}

/// The attack: a Read through a memory window, and before its response is built in the
/// pipeline's step 3 the window stops working: a Send with Invalidate of the (type 2)
/// window behind the Read in the same burst, or a Local Invalidate the application posted
/// behind a Read of its own that waits for the initiator depth (one), released in the same
/// burst by the response to the Read ahead of it, so that step 3 executes it before it
/// drains the responses (and, as a control, one posted before the burst, which runs at
/// once: the Read arrives to a dead key both ways). The pipeline
/// checks the R_Key again when it builds the response and answers with the fatal Remote
/// Access Error Nak; the fast path, which built the response in the receive step and
/// skipped the second check ("nothing can change the region between the two"), sent the
/// data and left the QP in RTS. Reads through a window (the only keys that can stop
/// working within an iteration) go to the pipeline; the last case, the window left alone,
/// is answered with its data both ways.
#[test]
fn a_read_through_a_window_invalidated_before_step_3_is_answered_as_in_the_pipeline() {
    for case in 0..4 {
        let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
            r.post_recv(1);
            let mr =
                r.pd.alloc_mr(4096, AccessFlags::ALL | AccessFlags::MW_BIND)
                    .unwrap();
            mr.write_at(0, b"windowed").unwrap();
            let mw = r.pd.alloc_mw(MwType::Two).unwrap();
            let rkey = mw.rkey_with_tag(1);
            let bind = mr.mw_bind(0, 64, AccessFlags::REMOTE_READ);
            let wr = SendWr::new(9, SendOp::BindMw { rkey, bind }, &[]);
            r.qp.post_send(&wr).unwrap();
            r.step();
            r.step();
            if case == 1 {
                let wr = SendWr::new(10, SendOp::LocalInv(rkey), &[]);
                r.qp.post_send(&wr).unwrap();
            }
            if case == 2 {
                // Two Reads of ours: the second waits for the first's response.
                post(r, 4, &[Op::Read(8), Op::Read(8)]);
                let wr = SendWr::new(10, SendOp::LocalInv(rkey), &[]);
                r.qp.post_send(&wr).unwrap();
                r.step();
            }
            let va = mr.addr();
            read_with(
                r,
                0,
                RethRepr {
                    va,
                    rkey,
                    dma_len: 8,
                },
            );
            if case == 0 {
                r.request(
                    Opcode::SendOnlyWithInvalidate,
                    1,
                    |p| p.ieth = Some(IethRepr { rkey }),
                    b"abcd",
                );
            }
            if case == 2 {
                read_response(r, 0, 1, b"12345678");
            }
            r.step();
            drop(mw);
        });
        assert_eq!(taken[Path::Read as usize], 0, "case {case}");
        // Our own requests aside: the answers to the peer's Read.
        let answers: Vec<_> = out
            .sent
            .iter()
            .filter(|s| s.0 != Opcode::RdmaReadRequest)
            .collect();
        if case == 3 {
            assert_eq!(ops(&out), [(Opcode::RdmaReadResponseOnly, rq(0))]);
            assert_eq!(out.bodies[0].5, b"windowed");
            assert_eq!(out.state, QpState::Rts);
        } else {
            let nak = answers[0].2.map(|a| a.syndrome);
            assert_eq!(nak, Some(Syndrome::Nak(NakCode::RemoteAccessError)));
            assert_eq!(answers.len(), 1, "case {case}: no data");
            assert_eq!(out.state, QpState::Error);
        }
    }
}

/// A Read of 8 bytes answered on the fast path (inline: the bytes copied into the slot)
/// and behind it in the same burst an RDMA Write over the same bytes. The pipeline copies
/// the bytes in step 3, after the Write executed, and returns the Write's bytes; the fast
/// path returns the bytes of when the Read arrived. Without a fence the requester cannot
/// tell which it gets (a Read may see a later Write or not), and the fast path's is the
/// one of the requests' order; everything else (memory, Acks, MSNs, state) is the same.
/// Pinned down as a known difference.
#[test]
fn a_read_overwritten_in_the_same_burst_returns_the_bytes_of_its_arrival() {
    let scenario = |r: &mut Rig| {
        r.mr.write_at(4096, b"original").unwrap();
        read_request(r, 0, 4096, 8);
        let reth = r.reth(4096, 8);
        r.request(
            Opcode::RdmaWriteOnly,
            1,
            |p| p.reth = Some(reth),
            b"replaced",
        );
        r.step();
    };
    let (mut slow, _) = run(false, AccessFlags::ALL, &scenario);
    let (fast, taken) = run(true, AccessFlags::ALL, &scenario);
    assert_eq!(taken[Path::Read as usize], 1);
    assert_eq!(fast.bodies[0].5, b"original");
    assert_eq!(slow.bodies[0].5, b"replaced");
    slow.bodies[0].5 = fast.bodies[0].5.clone();
    assert_eq!(fast, slow);
}

/// Publishes `op` at PSN offset `k` built by `f`, carrying a riding positive Ack of our
/// PSN `psn` with MSN `msn` in its line.
fn with_riding_ack(
    r: &mut Rig,
    op: Opcode,
    k: u32,
    f: impl FnOnce(&mut crate::wire::PacketRepr),
    (psn, msn): (u32, u32),
) {
    let mut repr =
        crate::wire::PacketRepr::new(crate::wire::BthRepr::new(op, r.qp.qpn(), Psn::new(rq(k))));
    f(&mut repr);
    let mut s = crate::wire::slot::PacketSlot::default();
    s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
    let word = crate::wire::slot::riding_word(psn, credits(4).to_u8(), msn);
    assert!(crate::wire::slot::set_riding_ack(&mut s, word));
    assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
}

/// The attack: Reads and Atomics that carry a riding positive Ack in their line — of our
/// outstanding Send (it completes), of a PSN never sent, of our own outstanding Read
/// (inside a Read's PSNs: an implied Nak, not a completion) — interleaved with the Read's
/// real response in the same burst. The fast answer and the riding Ack leave what the
/// slow paths leave — in one case in another order, by design (see `answer_fast`): the
/// Atomic's answer leaves in the receive step, ahead of the Read of ours that the riding
/// Ack's implied Nak makes step 3 send again; the pipeline sends it behind. The packets
/// themselves, and everything else, are the same.
#[test]
fn reads_and_atomics_carrying_riding_acks_are_taken_as_in_the_pipeline() {
    for case in 0..4 {
        let scenario = |r: &mut Rig| {
            let ours = if case >= 2 { Op::Read(8) } else { Op::Send(8) };
            post(r, 4, &[ours]);
            let _ =
                r.rx.pop_burst(&mut [crate::wire::slot::PacketSlot::default(); 8]);
            let acked = if case == 1 { 5 } else { 0 };
            if case % 2 == 0 {
                let reth = r.reth(4096, 8);
                with_riding_ack(
                    r,
                    Opcode::RdmaReadRequest,
                    0,
                    |p| p.reth = Some(reth),
                    (acked, 1),
                );
            } else {
                let reth = r.reth(2048, 8);
                with_riding_ack(
                    r,
                    Opcode::FetchAdd,
                    0,
                    |p| {
                        p.atomic_eth = Some(AtomicEthRepr {
                            va: reth.va,
                            rkey: reth.rkey,
                            swap_add: 3,
                            compare: 0,
                        })
                    },
                    (acked, 1),
                );
            }
            if case == 2 {
                read_response(r, 0, 1, b"response");
            }
            r.step();
            r.step();
            if case == 3 {
                read_response(r, 0, 1, b"response");
                r.step();
            }
        };
        let (mut slow, _) = run(false, AccessFlags::ALL, &scenario);
        let (mut fast, taken) = run(true, AccessFlags::ALL, &scenario);
        if case == 3 {
            assert_eq!(fast.sent[0].0, Opcode::AtomicAcknowledge);
            assert_eq!(slow.sent[1].0, Opcode::AtomicAcknowledge);
            for o in [&mut slow, &mut fast] {
                let mut both: Vec<_> = o.sent.iter().cloned().zip(o.bodies.clone()).collect();
                both.sort_by_key(|p| format!("{p:?}"));
                (o.sent, o.bodies) = both.into_iter().unzip();
            }
        }
        assert_eq!(fast, slow, "case {case}");
        let out = fast;
        assert_eq!(
            taken[Path::Read as usize] + taken[Path::Atomic as usize],
            1,
            "case {case}"
        );
        assert_eq!(out.state, QpState::Rts, "case {case}");
    }
}

/// The attack: Reads and Atomics on a QP still in RTR (it answers, it sends no requests
/// of its own): the fast paths answer there too, as the pipeline does — including a
/// duplicate, one past the resources (fatal) and a bad key.
#[test]
fn reads_and_atomics_in_rtr_are_answered_as_in_the_pipeline() {
    let scenarios: [&Scenario; 3] = [
        &|r| {
            r.mr.write_at(4096, b"rtr-read").unwrap();
            read_request(r, 0, 4096, 8);
            r.step();
            atomic_request(r, Opcode::CompareSwap, 1, 2048, (9, 0));
            r.step();
            read_request(r, 0, 4096, 8);
            atomic_request(r, Opcode::CompareSwap, 1, 2048, (9, 0));
            r.step();
        },
        &|r| {
            read_request(r, 0, 4096, 8);
            read_request(r, 1, 4096, 8);
            r.step();
        },
        &|r| {
            let mut reth = r.reth(0, 8);
            reth.rkey ^= 0x100;
            read_with(r, 0, reth);
            r.step();
        },
    ];
    for (i, scenario) in scenarios.iter().enumerate() {
        let (slow, _) = run_in(false, AccessFlags::ALL, QpState::Rtr, scenario);
        let (fast, taken) = run_in(true, AccessFlags::ALL, QpState::Rtr, scenario);
        assert_eq!(fast, slow, "scenario {i}");
        if i == 0 {
            assert_eq!(taken[Path::Read as usize], 1);
            assert_eq!(taken[Path::Atomic as usize], 1);
            assert_eq!(fast.memory.0[2048..2056], 9u64.to_ne_bytes());
        }
    }
}

/// The attack: a duplicate of a fast-answered Read that names another range, a bad
/// R_Key, or more than a PMTU: the duplicate is checked again as a new Read would be and
/// answered (or refused) as in the pipeline — never served from the original's range.
#[test]
fn duplicates_of_a_fast_read_are_checked_again_as_in_the_pipeline() {
    for case in 0..3 {
        let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
            r.mr.write_at(4096, b"first---").unwrap();
            r.mr.write_at(5000, b"second--").unwrap();
            read_request(r, 0, 4096, 8);
            r.step();
            let mut reth = r.reth(5000, 8);
            match case {
                0 => {}
                1 => reth.rkey ^= 0x100,
                _ => reth.dma_len = 600,
            }
            read_with(r, 0, reth);
            r.step();
            r.step();
            r.step();
        });
        assert_eq!(taken[Path::Read as usize], 1, "case {case}");
        assert_eq!(out.bodies[0].5, b"first---");
        if case == 0 {
            assert_eq!(out.bodies[1].5, b"second--");
        }
    }
}

/// The attack: Read and Atomic requests that carry a payload they should not have (inline
/// bytes, or a reference past the peer's arena): ignored both ways, as the pipeline
/// ignores it — no read of the peer's arena out of bounds, the same answer.
#[test]
fn reads_and_atomics_with_a_payload_are_answered_as_in_the_pipeline() {
    for case in 0..4 {
        let (out, _) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
            let reth = r.reth(4096, 8);
            let mut repr = crate::wire::PacketRepr::new(crate::wire::BthRepr::new(
                if case < 2 {
                    Opcode::RdmaReadRequest
                } else {
                    Opcode::FetchAdd
                },
                r.qp.qpn(),
                Psn::new(rq(0)),
            ));
            if case < 2 {
                repr.reth = Some(reth);
            } else {
                repr.atomic_eth = Some(AtomicEthRepr {
                    va: reth.va,
                    rkey: reth.rkey,
                    swap_add: 1,
                    compare: 0,
                });
            }
            let mut s = crate::wire::slot::PacketSlot::default();
            s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
            if case % 2 == 0 {
                s.kind = crate::wire::slot::KIND_INLINE;
                s.payload_len = 8;
            } else {
                s.kind = crate::wire::slot::KIND_DIRECT;
                s.payload_off = u64::MAX - 4;
                s.payload_len = 200;
            }
            assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
            r.step();
        });
        assert!(out.sent.len() <= 1, "case {case}: {:?}", out.sent);
    }
}

/// The attack: a Read Response Only of our oldest Read whose payload is a reference past
/// the end of the peer's arena (or wrapping around 2^64), and an Atomic Acknowledge whose
/// AETH acknowledges with a reserved syndrome: the slow path's bad response both ways,
/// nothing written.
#[test]
fn read_responses_with_a_bad_payload_reference_are_bad_responses_as_in_the_slow_path() {
    for case in 0..3 {
        let (out, taken) = same_both_ways(AccessFlags::ALL, &|r: &mut Rig| {
            post(r, 4, &[Op::Read(200)]);
            let _ =
                r.rx.pop_burst(&mut [crate::wire::slot::PacketSlot::default(); 8]);
            let mut repr = crate::wire::PacketRepr::new(crate::wire::BthRepr::new(
                Opcode::RdmaReadResponseOnly,
                r.qp.qpn(),
                Psn::new(0),
            ));
            repr.aeth = Some(crate::wire::AethRepr {
                syndrome: if case == 2 {
                    Syndrome::from_u8(0b0110_0000)
                } else {
                    credits(4)
                },
                msn: crate::wire::Msn::new(1),
            });
            let mut s = crate::wire::slot::PacketSlot::default();
            s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
            s.kind = crate::wire::slot::KIND_DIRECT;
            s.payload_off = if case == 0 { 4000 } else { u64::MAX - 100 };
            s.payload_len = 200;
            assert_eq!(r.tx.push_burst(&[s]).unwrap(), 1);
            r.step();
        });
        // The fast path takes the one with a good AETH, to its copy, which fails.
        assert_eq!(
            taken[Path::ReadResponse as usize],
            u64::from(case != 2),
            "case {case}"
        );
        assert_eq!(out.completions[0].status, crate::WcStatus::BadRespErr);
        assert!(
            out.memory.0[..1024].iter().all(|b| *b == 0),
            "case {case}: nothing written"
        );
    }
}

/// The attack: an Atomic through a type 2 window followed in the same burst by a Send with
/// Invalidate of it, and a Read of zero bytes through a window key followed by the same:
/// both are answered as in the pipeline (the Atomic executes and is answered when it
/// arrives, both ways; a Read of nothing checks no key), and both still take their fast
/// paths — only a Read of data through a window goes to the pipeline. (But for the
/// credits of the answer, by design: see `fast_tests`.)
#[test]
fn an_atomic_or_empty_read_through_a_window_then_invalidated_keeps_its_fast_path() {
    for atomic in [true, false] {
        let scenario = |r: &mut Rig| {
            r.post_recv(1);
            let mr =
                r.pd.alloc_mr(4096, AccessFlags::ALL | AccessFlags::MW_BIND)
                    .unwrap();
            mr.write_at(0, &40u64.to_ne_bytes()).unwrap();
            let mw = r.pd.alloc_mw(MwType::Two).unwrap();
            let rkey = mw.rkey_with_tag(1);
            let rights = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
            let bind = mr.mw_bind(0, 64, rights);
            let wr = SendWr::new(9, SendOp::BindMw { rkey, bind }, &[]);
            r.qp.post_send(&wr).unwrap();
            r.step();
            r.step();
            if atomic {
                atomic_with(r, Opcode::FetchAdd, 0, mr.addr(), rkey, 2);
            } else {
                let reth = RethRepr {
                    va: mr.addr(),
                    rkey,
                    dma_len: 0,
                };
                read_with(r, 0, reth);
            }
            r.request(
                Opcode::SendOnlyWithInvalidate,
                1,
                |p| p.ieth = Some(IethRepr { rkey }),
                b"abcd",
            );
            r.step();
            let mut word = [0; 8];
            mr.read_at(0, &mut word).unwrap();
            let want = if atomic { 42u64 } else { 40 };
            assert_eq!(u64::from_ne_bytes(word), want);
            drop(mw);
        };
        let (mut slow, _) = run(false, AccessFlags::ALL, &scenario);
        let (out, taken) = run(true, AccessFlags::ALL, &scenario);
        // The known difference: the credits of when the answer is built (the Send behind
        // it had not taken its receive WQE yet).
        slow.sent[0].2 = out.sent[0].2;
        assert_eq!(out, slow);
        let path = if atomic { Path::Atomic } else { Path::Read };
        assert_eq!(taken[path as usize], 1);
        assert_eq!(out.state, QpState::Rts);
        assert_eq!(out.sent.len(), 2, "{:?}", out.sent);
    }
}

/// The attack, with responder resources to spare (four) so that only the QP's state holds
/// the fast path back: a new Read at ePSN behind a Read whose responses are still queued
/// (its answer must wait its turn: responses leave in PSN order), and a Read at ePSN in
/// the middle of a multi-packet Send or RDMA Write (an opcode sequence error, which the
/// pipeline Naks; the Write holds no receive WQE). None is answered early; both ways
/// agree.
#[test]
fn a_read_behind_queued_responses_or_inside_a_send_is_left_to_the_pipeline() {
    let behind_queued = |r: &mut Rig| {
        four_resources(r);
        // Three responses (PMTU 256), queued; the next Read at PSN 3.
        read_request(r, 0, 0, 600);
        read_request(r, 3, 4096, 8);
        r.step();
        r.step();
    };
    let (out, taken) = same_both_ways(AccessFlags::ALL, &behind_queued);
    assert_eq!(taken[Path::Read as usize], 0);
    let psns: Vec<_> = out.sent.iter().map(|s| s.1).collect();
    assert_eq!(psns, [rq(0), rq(1), rq(2), rq(3)], "in PSN order");
    for write in [false, true] {
        let inside = |r: &mut Rig| {
            four_resources(r);
            if write {
                let reth = r.reth(0, 600);
                request_direct_with(r, Opcode::RdmaWriteFirst, 0, 256, |p| p.reth = Some(reth));
            } else {
                request_direct(r, Opcode::SendFirst, 0, 256);
            }
            read_request(r, 1, 4096, 8);
            r.step();
        };
        let (out, taken) = same_both_ways(AccessFlags::ALL, &inside);
        assert_eq!(taken[Path::Read as usize], 0, "write: {write}");
        assert!(
            out.sent.iter().all(|s| s.0 != Opcode::RdmaReadResponseOnly),
            "no answer to a Read inside a message (write: {write}): {:?}",
            out.sent
        );
    }
}
