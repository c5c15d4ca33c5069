//! Property: random mixes of work requests complete in posted order, with the data a
//! sequential model of the RC semantics predicts: requests execute in order at the
//! responder, so a Read sees every earlier Write. A Write may overtake the *data* of an
//! earlier Read (IBA: Read responses may be produced after later requests execute —
//! here they travel by reference), so a Write overlapping an earlier Read is fenced, as an
//! application must; this also exercises the fence.
mod common;

use common::*;
use proptest::prelude::*;
use shmhca::*;

#[derive(Debug, Clone)]
enum Op {
    Send {
        len: usize,
        imm: Option<u32>,
    },
    Write {
        off: usize,
        len: usize,
        imm: Option<u32>,
    },
    Read {
        off: usize,
        len: usize,
    },
    FetchAdd {
        word: usize,
        add: u64,
    },
    CmpSwap {
        word: usize,
        compare_hit: bool,
        swap: u64,
    },
}

const TARGET: usize = 16 * 1024;
const WORDS: usize = 8;

fn op() -> impl Strategy<Value = Op> {
    let len = prop_oneof![0usize..8, 8usize..300, 300usize..5000];
    prop_oneof![
        (len.clone(), proptest::option::of(any::<u32>()))
            .prop_map(|(len, imm)| Op::Send { len, imm }),
        (
            0usize..TARGET,
            len.clone(),
            proptest::option::of(any::<u32>())
        )
            .prop_map(|(off, len, imm)| Op::Write {
                off: off.min(TARGET - len.min(TARGET)),
                len,
                imm
            }),
        (0usize..TARGET, len).prop_map(|(off, len)| Op::Read {
            off: off.min(TARGET - len.min(TARGET)),
            len
        }),
        (0usize..WORDS, any::<u64>()).prop_map(|(word, add)| Op::FetchAdd { word, add }),
        (0usize..WORDS, any::<bool>(), any::<u64>()).prop_map(|(word, compare_hit, swap)| {
            Op::CmpSwap {
                word,
                compare_hit,
                swap,
            }
        }),
    ]
}

fn mtu() -> impl Strategy<Value = Mtu> {
    prop_oneof![Just(Mtu::Mtu256), Just(Mtu::Mtu1024), Just(Mtu::Mtu4096)]
}

fn run(ops: Vec<Op>, mtu: Mtu, signal_every: usize) -> std::result::Result<(), TestCaseError> {
    let caps = QpCaps {
        max_send_wr: 256,
        max_recv_wr: 256,
        max_send_sge: 2,
        ..QpCaps::default()
    };
    let mut p = pair(&Params {
        caps,
        mtu,
        arena: 32 << 20,
        ..Params::default()
    });
    let src = p.a.pd.alloc_mr(8192, AccessFlags::NONE).unwrap();
    let src_bytes = pattern(8192, 77);
    src.write_at(0, &src_bytes).unwrap();
    let results =
        p.a.pd
            .alloc_mr((ops.len() * 5000 + 8) as u64, AccessFlags::LOCAL_WRITE)
            .unwrap();
    let rbufs =
        p.b.pd
            .alloc_mr((ops.len() * 5000 + 8) as u64, AccessFlags::LOCAL_WRITE)
            .unwrap();
    let target =
        p.b.pd
            .alloc_mr(
                TARGET as u64,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            )
            .unwrap();
    let words =
        p.b.pd
            .alloc_mr(
                (WORDS * 8) as u64,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC,
            )
            .unwrap();
    let mut model_target = vec![0u8; TARGET];
    let mut model_words = [0u64; WORDS];
    for (i, w) in model_words.iter_mut().enumerate() {
        *w = i as u64 * 1000;
        words.write_at(i as u64 * 8, &w.to_ne_bytes()).unwrap();
    }
    // What each request must leave: (result offset, expected bytes) and receives.
    let mut expect_results: Vec<(usize, Vec<u8>)> = vec![];
    // (wr_id, length, immediate, buffer offset, bytes) of each expected receive.
    type Recv = (u64, usize, Option<u32>, usize, Vec<u8>);
    let mut expect_recvs: Vec<Recv> = vec![];
    let n = ops.len();
    let mut signaled = vec![];
    let mut reads: Vec<(usize, usize)> = vec![];
    for (i, op) in ops.iter().enumerate() {
        let roff = i * 5000;
        let signal = i % signal_every == 0 || i == n - 1;
        if signal {
            signaled.push(i as u64);
        }
        let flags = if signal {
            SendFlags::SIGNALED
        } else {
            SendFlags::NONE
        };
        // Gather lists are split in two where possible, to exercise multi-SGE packets.
        let split = |len: usize| -> Vec<Sge<'_>> {
            if len >= 2 {
                vec![
                    src.sge(0, (len / 2) as u32).unwrap(),
                    src.sge(4096, (len - len / 2) as u32).unwrap(),
                ]
            } else {
                vec![src.sge(100, len as u32).unwrap()]
            }
        };
        let gathered = |len: usize| -> Vec<u8> {
            if len >= 2 {
                [
                    &src_bytes[..len / 2],
                    &src_bytes[4096..4096 + len - len / 2],
                ]
                .concat()
            } else {
                src_bytes[100..100 + len].to_vec()
            }
        };
        match *op {
            Op::Send { len, imm } => {
                p.b.qp
                    .post_recv(&RecvWr::new(
                        i as u64,
                        &[rbufs.sge(roff as u64, 5000).unwrap()],
                    ))
                    .unwrap();
                expect_recvs.push((i as u64, len, imm, roff, gathered(len)));
                let sgl = split(len);
                let o = imm.map_or(SendOp::Send, SendOp::SendWithImm);
                p.a.qp
                    .post_send(&SendWr::new(i as u64, o, &sgl).flags(flags))
                    .unwrap();
            }
            Op::Write { off, len, imm } => {
                let len = len.min(TARGET - off);
                let overlaps = reads
                    .iter()
                    .any(|&(ro, rl)| ro < off + len && off < ro + rl);
                let flags = if overlaps {
                    flags | SendFlags::FENCE
                } else {
                    flags
                };
                model_target[off..off + len].copy_from_slice(&gathered(len));
                let sgl = split(len);
                let o = match imm {
                    Some(v) => {
                        p.b.qp.post_recv(&RecvWr::new(i as u64, &[])).unwrap();
                        expect_recvs.push((i as u64, len, Some(v), roff, vec![]));
                        SendOp::RdmaWriteWithImm(target.remote(off as u64), v)
                    }
                    None => SendOp::RdmaWrite(target.remote(off as u64)),
                };
                p.a.qp
                    .post_send(&SendWr::new(i as u64, o, &sgl).flags(flags))
                    .unwrap();
            }
            Op::Read { off, len } => {
                let len = len.min(TARGET - off);
                reads.push((off, len));
                expect_results.push((roff, model_target[off..off + len].to_vec()));
                let sgl = [results.sge(roff as u64, len as u32).unwrap()];
                p.a.qp
                    .post_send(
                        &SendWr::new(i as u64, SendOp::RdmaRead(target.remote(off as u64)), &sgl)
                            .flags(flags),
                    )
                    .unwrap();
            }
            Op::FetchAdd { word, add } => {
                expect_results.push((roff, model_words[word].to_ne_bytes().to_vec()));
                model_words[word] = model_words[word].wrapping_add(add);
                let sgl = [results.sge(roff as u64, 8).unwrap()];
                let o = SendOp::FetchAdd {
                    remote: words.remote(word as u64 * 8),
                    add,
                };
                p.a.qp
                    .post_send(&SendWr::new(i as u64, o, &sgl).flags(flags))
                    .unwrap();
            }
            Op::CmpSwap {
                word,
                compare_hit,
                swap,
            } => {
                let cur = model_words[word];
                let compare = if compare_hit { cur } else { cur ^ 1 };
                expect_results.push((roff, cur.to_ne_bytes().to_vec()));
                if compare_hit {
                    model_words[word] = swap;
                }
                let sgl = [results.sge(roff as u64, 8).unwrap()];
                let o = SendOp::CompareSwap {
                    remote: words.remote(word as u64 * 8),
                    compare,
                    swap,
                };
                p.a.qp
                    .post_send(&SendWr::new(i as u64, o, &sgl).flags(flags))
                    .unwrap();
            }
        }
    }
    let sc = wait_a(&mut p, signaled.len());
    prop_assert!(sc.iter().all(|w| w.status == WcStatus::Success), "{:?}", sc);
    prop_assert_eq!(
        sc.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        signaled,
        "send completions in posted order"
    );
    let rc = wait_b(&mut p, expect_recvs.len());
    for (wc, (id, len, imm, roff, data)) in rc.iter().zip(&expect_recvs) {
        prop_assert_eq!(
            (wc.status, wc.wr_id, wc.byte_len as usize, wc.imm_data),
            (WcStatus::Success, *id, *len, *imm)
        );
        let mut got = vec![0u8; data.len()];
        rbufs.read_at(*roff as u64, &mut got).unwrap();
        prop_assert_eq!(&got, data);
    }
    for (roff, data) in &expect_results {
        let mut got = vec![0u8; data.len()];
        results.read_at(*roff as u64, &mut got).unwrap();
        prop_assert_eq!(&got, data, "result at {}", roff);
    }
    let mut t = vec![0u8; TARGET];
    target.read_at(0, &mut t).unwrap();
    prop_assert!(t == model_target, "the target differs from the model");
    for (i, w) in model_words.iter().enumerate() {
        prop_assert_eq!(words.load_u64(i as u64 * 8).unwrap(), *w);
    }
    prop_assert_eq!(src.in_flight() + results.in_flight() + rbufs.in_flight(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_mixes_complete_in_order_with_the_modelled_data(
        ops in proptest::collection::vec(op(), 1..60),
        mtu in mtu(),
        signal_every in 1usize..5,
    ) {
        run(ops, mtu, signal_every)?;
    }
}
