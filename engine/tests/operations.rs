//! Every operation at every size class, end to end between two engines, checking every byte
//! and every completion.
mod common;

use common::*;
use shmhca::*;

const PMTU: usize = 1024;
const SIZES: [usize; 7] = [0, 1, PMTU - 1, PMTU, PMTU + 1, 10 * PMTU + 17, 64 * PMTU];
/// Bytes of guard on each side of every target buffer, which must stay untouched.
const GUARD: usize = 64;
const GUARD_BYTE: u8 = 0xA5;

fn guarded(pd: &Pd, len: usize, access: AccessFlags) -> Mr {
    let mr = pd.alloc_mr((len + 2 * GUARD) as u64, access).unwrap();
    mr.write_at(0, &vec![GUARD_BYTE; len + 2 * GUARD]).unwrap();
    mr
}

fn check_guards(mr: &Mr, len: usize) {
    let mut g = vec![0u8; GUARD];
    mr.read_at(0, &mut g).unwrap();
    assert!(
        g.iter().all(|&b| b == GUARD_BYTE),
        "bytes before the buffer were written"
    );
    mr.read_at((GUARD + len) as u64, &mut g).unwrap();
    assert!(
        g.iter().all(|&b| b == GUARD_BYTE),
        "bytes after the buffer were written"
    );
}

fn read(mr: &Mr, off: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mr.read_at(off as u64, &mut v).unwrap();
    v
}

#[test]
fn send_and_send_with_immediate_at_every_size() {
    let mut p = pair(&Params::default());
    for (i, &len) in SIZES.iter().enumerate() {
        for imm in [None, Some(0xdead_0000 + i as u32)] {
            let data = pattern(len, i as u8);
            let src =
                p.a.pd
                    .alloc_mr(len.max(1) as u64, AccessFlags::NONE)
                    .unwrap();
            src.write_at(0, &data).unwrap();
            let dst = guarded(&p.b.pd, len, AccessFlags::LOCAL_WRITE);
            let sge = dst.sge(GUARD as u64, len as u32).unwrap();
            p.b.qp
                .post_recv(&RecvWr::new(100 + i as u64, &[sge]))
                .unwrap();
            let op = imm.map_or(SendOp::Send, SendOp::SendWithImm);
            let g = src.sge(0, len as u32).unwrap();
            p.a.qp.post_send(&SendWr::new(i as u64, op, &[g])).unwrap();
            let rc = wait_b(&mut p, 1)[0];
            assert_eq!(rc.status, WcStatus::Success, "len {len}: {rc:?}");
            assert_eq!(
                (rc.wr_id, rc.byte_len, rc.imm_data),
                (100 + i as u64, len as u32, imm)
            );
            assert_eq!(rc.opcode, WcOpcode::Recv);
            assert_eq!(rc.qp_num, p.b.qp.qpn());
            let sc = wait_a(&mut p, 1)[0];
            assert_eq!(
                (sc.status, sc.wr_id, sc.opcode),
                (WcStatus::Success, i as u64, WcOpcode::Send)
            );
            assert_eq!(read(&dst, GUARD, len), data, "len {len}");
            check_guards(&dst, len);
        }
    }
}

#[test]
fn rdma_write_and_write_with_immediate_at_every_size() {
    let mut p = pair(&Params::default());
    for (i, &len) in SIZES.iter().enumerate() {
        for imm in [None, Some(0x1234_5678 ^ i as u32)] {
            let data = pattern(len, 3 + i as u8);
            let src =
                p.a.pd
                    .alloc_mr(len.max(1) as u64, AccessFlags::NONE)
                    .unwrap();
            src.write_at(0, &data).unwrap();
            let dst = guarded(
                &p.b.pd,
                len,
                AccessFlags::REMOTE_WRITE | AccessFlags::LOCAL_WRITE,
            );
            let remote = dst.remote(GUARD as u64);
            let op = match imm {
                None => SendOp::RdmaWrite(remote),
                Some(v) => {
                    // A Write with Immediate consumes a receive WQE (no data lands in it).
                    p.b.qp.post_recv(&RecvWr::new(500 + i as u64, &[])).unwrap();
                    SendOp::RdmaWriteWithImm(remote, v)
                }
            };
            p.a.qp
                .post_send(&SendWr::new(
                    i as u64,
                    op,
                    &[src.sge(0, len as u32).unwrap()],
                ))
                .unwrap();
            let sc = wait_a(&mut p, 1)[0];
            assert_eq!(
                (sc.status, sc.opcode),
                (WcStatus::Success, WcOpcode::RdmaWrite),
                "{sc:?}"
            );
            if let Some(v) = imm {
                let rc = wait_b(&mut p, 1)[0];
                assert_eq!(rc.status, WcStatus::Success);
                assert_eq!(rc.opcode, WcOpcode::RecvRdmaWithImm);
                assert_eq!(
                    (rc.imm_data, rc.byte_len, rc.wr_id),
                    (Some(v), len as u32, 500 + i as u64)
                );
            } else {
                assert_eq!(
                    p.b.cq.poll_one(),
                    None,
                    "a plain Write makes no completion at the target"
                );
            }
            assert_eq!(read(&dst, GUARD, len), data, "len {len}");
            check_guards(&dst, len);
        }
    }
}

#[test]
fn rdma_read_at_every_size() {
    let mut p = pair(&Params::default());
    for (i, &len) in SIZES.iter().enumerate() {
        let data = pattern(len, 9 + i as u8);
        let src =
            p.b.pd
                .alloc_mr(len.max(1) as u64, AccessFlags::REMOTE_READ)
                .unwrap();
        src.write_at(0, &data).unwrap();
        let dst = guarded(&p.a.pd, len, AccessFlags::LOCAL_WRITE);
        p.a.qp
            .post_send(&SendWr::new(
                i as u64,
                SendOp::RdmaRead(src.remote(0)),
                &[dst.sge(GUARD as u64, len as u32).unwrap()],
            ))
            .unwrap();
        let sc = wait_a(&mut p, 1)[0];
        assert_eq!(
            (sc.status, sc.opcode, sc.byte_len),
            (WcStatus::Success, WcOpcode::RdmaRead, len as u32),
            "{sc:?}"
        );
        assert_eq!(read(&dst, GUARD, len), data, "len {len}");
        check_guards(&dst, len);
    }
}

#[test]
fn atomics_run_on_the_target_word_and_return_the_original() {
    let mut p = pair(&Params::default());
    let target =
        p.b.pd
            .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC)
            .unwrap();
    target.write_at(8, &100u64.to_ne_bytes()).unwrap();
    let result = guarded(&p.a.pd, 8, AccessFlags::LOCAL_WRITE);
    let res = || result.sge(GUARD as u64, 8).unwrap();
    let ops = [
        (
            SendOp::FetchAdd {
                remote: target.remote(8),
                add: 5,
            },
            100,
            105,
        ),
        (
            SendOp::CompareSwap {
                remote: target.remote(8),
                compare: 7,
                swap: 1,
            },
            105,
            105,
        ),
        (
            SendOp::CompareSwap {
                remote: target.remote(8),
                compare: 105,
                swap: u64::MAX,
            },
            105,
            u64::MAX,
        ),
        (
            SendOp::FetchAdd {
                remote: target.remote(8),
                add: 2,
            },
            u64::MAX,
            1,
        ),
    ];
    for (i, (op, orig, after)) in ops.into_iter().enumerate() {
        p.a.qp
            .post_send(&SendWr::new(i as u64, op, &[res()]))
            .unwrap();
        let sc = wait_a(&mut p, 1)[0];
        assert_eq!(sc.status, WcStatus::Success, "{sc:?}");
        let expect_op = if matches!(op, SendOp::FetchAdd { .. }) {
            WcOpcode::FetchAdd
        } else {
            WcOpcode::CompSwap
        };
        assert_eq!(sc.opcode, expect_op);
        assert_eq!(
            u64::from_ne_bytes(read(&result, GUARD, 8).try_into().unwrap()),
            orig,
            "op {i}"
        );
        assert_eq!(target.load_u64(8).unwrap(), after, "op {i}");
        check_guards(&result, 8);
    }
}

#[test]
fn scatter_gather_lists_on_both_sides() {
    let caps = QpCaps {
        max_send_sge: 4,
        max_recv_sge: 4,
        ..QpCaps::default()
    };
    let mut p = pair(&Params {
        caps,
        ..Params::default()
    });
    // Gather 3 pieces from 2 regions; scatter into 4 pieces of other sizes.
    let a1 = p.a.pd.alloc_mr(8192, AccessFlags::NONE).unwrap();
    let a2 = p.a.pd.alloc_mr(8192, AccessFlags::NONE).unwrap();
    let pieces = [(&a1, 100u64, 700u32), (&a2, 0, 2500), (&a1, 5000, 1)];
    let mut expect = vec![];
    for (k, (mr, off, len)) in pieces.iter().enumerate() {
        let d = pattern(*len as usize, 40 + k as u8);
        mr.write_at(*off, &d).unwrap();
        expect.extend(d);
    }
    let gather: Vec<Sge> = pieces
        .iter()
        .map(|(m, o, l)| m.sge(*o, *l).unwrap())
        .collect();
    let b1 = p.b.pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
    let scatter_spec = [(0u64, 1000u32), (3000, 17), (4096, 1500), (7000, 1000)];
    let scatter: Vec<Sge> = scatter_spec
        .iter()
        .map(|(o, l)| b1.sge(*o, *l).unwrap())
        .collect();
    p.b.qp.post_recv(&RecvWr::new(1, &scatter)).unwrap();
    p.a.qp
        .post_send(&SendWr::new(2, SendOp::Send, &gather))
        .unwrap();
    let rc = wait_b(&mut p, 1)[0];
    assert_eq!((rc.status, rc.byte_len), (WcStatus::Success, 3201));
    let mut got = vec![];
    let mut left = expect.len();
    for (o, l) in scatter_spec {
        let n = (l as usize).min(left);
        got.extend(read(&b1, o as usize, n));
        left -= n;
    }
    assert_eq!(got, expect);
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);

    // The same list gathered into an RDMA Write, and scattered by an RDMA Read.
    let w =
        p.b.pd
            .alloc_mr(
                4096,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            )
            .unwrap();
    p.a.qp
        .post_send(&SendWr::new(3, SendOp::RdmaWrite(w.remote(10)), &gather))
        .unwrap();
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    assert_eq!(read(&w, 10, 3201), expect);
    let r1 = p.a.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let r2 = p.a.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let rs = [r1.sge(1, 1200).unwrap(), r2.sge(0, 2001).unwrap()];
    p.a.qp
        .post_send(&SendWr::new(4, SendOp::RdmaRead(w.remote(10)), &rs))
        .unwrap();
    let sc = wait_a(&mut p, 1)[0];
    assert_eq!((sc.status, sc.byte_len), (WcStatus::Success, 3201));
    let mut back = read(&r1, 1, 1200);
    back.extend(read(&r2, 0, 2001));
    assert_eq!(back, expect);
}

#[test]
fn inline_data_is_copied_at_post_time() {
    let caps = QpCaps {
        max_inline_data: 512,
        ..QpCaps::default()
    };
    let mut p = pair(&Params {
        caps,
        ..Params::default()
    });
    let dst =
        p.b.pd
            .alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let rbuf = p.b.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(1, &[rbuf.sge(0, 4096).unwrap()]))
        .unwrap();
    for len in [0usize, 1, 50, 100, 101, 300, 512] {
        let mut bytes = pattern(len, len as u8);
        p.a.qp
            .post_send(&SendWr::inline(
                len as u64,
                SendOp::RdmaWrite(dst.remote(0)),
                &bytes,
            ))
            .unwrap();
        bytes.iter_mut().for_each(|b| *b = !*b); // the caller may reuse its buffer at once
        assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
        bytes.iter_mut().for_each(|b| *b = !*b);
        assert_eq!(read(&dst, 0, len), bytes, "len {len}");
    }
    // Inline Send of bytes from a registered region (the INLINE flag).
    let src = p.a.pd.alloc_mr(512, AccessFlags::NONE).unwrap();
    src.write_at(0, &pattern(512, 1)).unwrap();
    let sgl = [src.sge(0, 512).unwrap()];
    let wr = SendWr::new(9, SendOp::Send, &sgl).flags(SendFlags::SIGNALED | SendFlags::INLINE);
    p.a.qp.post_send(&wr).unwrap();
    assert_eq!(src.in_flight(), 0, "an inline send does not pin its source");
    src.write_at(0, &[0u8; 512]).unwrap();
    assert_eq!(wait_b(&mut p, 1)[0].byte_len, 512);
    assert_eq!(read(&rbuf, 0, 512), pattern(512, 1));
    // Too much inline data is refused at post time.
    let err =
        p.a.qp
            .post_send(&SendWr::inline(0, SendOp::Send, &[0; 513]))
            .unwrap_err();
    assert!(err.to_string().contains("max_inline_data"), "{err}");
}

#[test]
fn unsignaled_requests_complete_silently_but_free_their_slots() {
    let caps = QpCaps {
        max_send_wr: 4,
        ..QpCaps::default()
    };
    let mut p = pair(&Params {
        caps,
        ..Params::default()
    });
    let dst =
        p.b.pd
            .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    for round in 0..10u64 {
        for k in 0..3u64 {
            src.write_at(0, &(round * 10 + k).to_le_bytes()).unwrap();
            let sgl = [src.sge(0, 8).unwrap()];
            let wr = SendWr::new(k, SendOp::RdmaWrite(dst.remote(0)), &sgl).flags(SendFlags::NONE);
            p.a.qp.post_send(&wr).unwrap();
            p.settle();
        }
        // The 4th is signaled: its completion means all before it completed too.
        let sgl = [src.sge(0, 8).unwrap()];
        let wr = SendWr::new(99, SendOp::RdmaWrite(dst.remote(8)), &sgl);
        p.a.qp.post_send(&wr).unwrap();
        let wc = wait_a(&mut p, 1)[0];
        assert_eq!((wc.wr_id, wc.status), (99, WcStatus::Success));
        assert_eq!(
            p.a.cq.poll_one(),
            None,
            "unsignaled requests made completions"
        );
    }
}

#[test]
fn a_full_queue_is_an_error_and_nothing_is_dropped() {
    let caps = QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        ..QpCaps::default()
    };
    let mut p = pair(&Params {
        caps,
        ..Params::default()
    });
    let buf = p.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..8 {
        p.b.qp
            .post_recv(&RecvWr::new(i, &[buf.sge(0, 64).unwrap()]))
            .unwrap();
    }
    let err =
        p.b.qp
            .post_recv(&RecvWr::new(8, &[buf.sge(0, 64).unwrap()]))
            .unwrap_err();
    assert!(matches!(err, Error::QueueFull { depth: 8, .. }), "{err}");
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    // Post without driving the peer, so nothing can complete.
    let mut posted = 0;
    loop {
        match p.a.qp.post_send(&SendWr::new(
            posted,
            SendOp::Send,
            &[src.sge(0, 1).unwrap()],
        )) {
            Ok(()) => posted += 1,
            Err(Error::QueueFull { .. }) => break,
            Err(e) => panic!("{e}"),
        }
        assert!(posted <= 8);
    }
    assert_eq!(posted, 8);
    let sc = wait_a(&mut p, 8);
    let ids: Vec<u64> = sc.iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, (0..8).collect::<Vec<_>>(), "in order, none lost");
    assert_eq!(wait_b(&mut p, 8).len(), 8);
}

#[test]
fn the_cq_filling_up_holds_completions_back_without_losing_them() {
    let ca = context(8 << 20);
    let cb = context(8 << 20);
    let (la, lb) = ca.link_with(&cb).unwrap();
    let params = Params::default();
    let pda = ca.alloc_pd().unwrap();
    let pdb = cb.alloc_pd().unwrap();
    let mut small_cq = ca.create_cq(2).unwrap();
    let mut cqb = cb.create_cq(64).unwrap();
    let mut qa = ca
        .create_qp(&pda, &small_cq, &small_cq, QpCaps::default())
        .unwrap();
    let mut qb = cb.create_qp(&pdb, &cqb, &cqb, QpCaps::default()).unwrap();
    let (na, nb) = (qa.qpn(), qb.qpn());
    connect(&mut qa, la, nb, 1, 2, &params);
    connect(&mut qb, lb, na, 2, 1, &params);
    let dst = pdb
        .alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    let src = pda.alloc_mr(64, AccessFlags::NONE).unwrap();
    for i in 0..20 {
        qa.post_send(&SendWr::new(
            i,
            SendOp::RdmaWrite(dst.remote(0)),
            &[src.sge(0, 8).unwrap()],
        ))
        .unwrap();
    }
    for _ in 0..1000 {
        ca.progress();
        cb.progress();
    }
    let mut ids = vec![];
    while ids.len() < 20 {
        ca.progress();
        cb.progress();
        if let Some(wc) = small_cq.poll_one() {
            assert_eq!(wc.status, WcStatus::Success);
            ids.push(wc.wr_id);
        }
    }
    assert_eq!(ids, (0..20).collect::<Vec<_>>());
    assert_eq!(cqb.poll_one(), None);
}

#[test]
fn each_atomic_acknowledge_gives_its_responder_resource_back() {
    // One responder resource: Atomics one after another each find it free again.
    let mut p = pair(&Params {
        rd_atomic: 1,
        ..Params::default()
    });
    let word =
        p.b.pd
            .alloc_mr(8, AccessFlags::REMOTE_ATOMIC | AccessFlags::LOCAL_WRITE)
            .unwrap();
    let result = p.a.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..5u64 {
        p.a.qp
            .post_send(&SendWr::new(
                i,
                SendOp::FetchAdd {
                    remote: word.remote(0),
                    add: 1,
                },
                &[result.sge(0, 8).unwrap()],
            ))
            .unwrap();
        let wc = wait_a(&mut p, 1)[0];
        assert_eq!((wc.wr_id, wc.status), (i, WcStatus::Success), "{wc:?}");
        assert_eq!(result.load_u64(0).unwrap(), i);
    }
    assert_eq!(word.load_u64(0).unwrap(), 5);
    assert_eq!(p.b.qp.state(), QpState::Rts);
}

/// Reads and Fetch and Adds kept at the initiator depth, which equals the responder's
/// resources, while each engine runs on its own thread (review 9): the requester sends a
/// new request as soon as a response frees its depth, and the responder — whose answer
/// left at once, straight into the link's ring, in the middle of its receive burst — must
/// have given that response's resource back by the time the new request arrives. (With the
/// resource held until the burst's end, a request the requester sent after it saw the
/// response, in the same burst, found none: an Invalid Request Nak, RemInvReqErr, and the
/// QP in Error — `shmhca-perf read_bw` and `atomic_bw` failed so.)
#[test]
fn requests_at_the_initiator_depth_never_exceed_the_responder_resources() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};
    const DEPTH: u8 = shmhca::qp::MAX_RD_ATOMIC;
    const REQUESTS: u64 = 20_000;
    let p = pair(&Params {
        rd_atomic: DEPTH,
        ..Params::default()
    });
    let Pair { mut a, b } = p;
    let src = b.pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
    src.write_at(0, b"responder").unwrap();
    let remote = src.remote(0);
    let word = src.remote(64);
    // The responder's engine, on a thread of its own until the requester is done.
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let responder = std::thread::spawn(move || {
        while !stopped.load(Ordering::Relaxed) {
            b.ctx.progress();
        }
        b
    });
    let dst = a.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let (mut posted, mut done) = (0u64, 0u64);
    let mut wc = [WorkCompletion::default(); 16];
    let start = Instant::now();
    while done < REQUESTS {
        while posted < REQUESTS && posted - done < u64::from(DEPTH) {
            let at = (posted % u64::from(DEPTH)) * 16;
            let into = [dst.sge(at, 8).unwrap()];
            let op = if posted % 2 == 0 {
                SendOp::RdmaRead(remote)
            } else {
                SendOp::FetchAdd {
                    remote: word,
                    add: 1,
                }
            };
            let flags = SendFlags::SIGNALED;
            a.qp.post_send(&SendWr::new(posted, op, &into).flags(flags))
                .unwrap();
            posted += 1;
        }
        a.ctx.progress();
        let n = a.cq.poll(&mut wc);
        for c in &wc[..n] {
            assert_eq!(
                c.status,
                WcStatus::Success,
                "request {} of {REQUESTS}: {c:?}",
                c.wr_id
            );
        }
        done += n as u64;
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "only {done} of {REQUESTS} requests completed"
        );
    }
    stop.store(true, Ordering::Relaxed);
    let b = responder.join().unwrap();
    assert_eq!(src.load_u64(64).unwrap(), REQUESTS / 2, "each Atomic once");
    assert_eq!((a.qp.state(), b.qp.state()), (QpState::Rts, QpState::Rts));
}
