//! Registered application memory (`Pd::reg_mr`) of every kind — a `Vec<u8>`, a `Box<[u8]>`,
//! an anonymous `MmapMut`, a memfd and a hugetlbfs memfd — in every operation, as source,
//! as destination and as the target of a peer's remote access, every byte checked; and the
//! misuses: empty, too large, unmappable memfd, missing access rights, deregistration while
//! in flight.
mod common;

use std::os::fd::OwnedFd;

use common::*;
use shmhca::*;

/// Sizes: empty, inline, one packet, several packets (PMTU 1024), not a multiple of 4.
const SIZES: [usize; 5] = [0, 5, 1000, 5 * 1024 + 17, 40 * 1024 + 3];
/// Bytes of every registered buffer.
const LEN: usize = 64 << 10;
/// Where in a buffer data goes (not 0, to check offsets are honoured).
const AT: u64 = 24;
/// The atomic word, 8-byte aligned.
const WORD: u64 = 48 << 10;

fn memfd(len: usize, huge: bool) -> Option<OwnedFd> {
    let mut flags = rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING;
    if huge {
        flags |= rustix::fs::MemfdFlags::HUGETLB;
    }
    let fd = rustix::fs::memfd_create("shmhca-user-mem-test", flags).ok()?;
    rustix::fs::ftruncate(&fd, len as u64).ok()?;
    Some(fd)
}

/// A hugetlbfs memfd of one huge page, if the machine has a free huge page.
fn huge_memfd() -> Option<Memfd> {
    let fd = memfd(2 << 20, true)?;
    let m = Memfd::map(fd).ok()?;
    Some(m)
}

/// Runs every operation between a buffer of A made by `a` and one of B made by `b`.
fn every_operation<BA: UserBuffer, BB: UserBuffer>(what: &str, a: BA, b: BB) {
    let mut p = pair(&Params {
        arena: 4 << 20,
        caps: QpCaps {
            max_send_sge: 4,
            max_recv_sge: 4,
            ..QpCaps::default()
        },
        ..Params::default()
    });
    let ma = p.a.pd.reg_mr(a, AccessFlags::LOCAL_WRITE).unwrap();
    let mb = p.b.pd.reg_mr(b, AccessFlags::ALL).unwrap();
    assert_eq!(ma.len(), mb.len());
    let len_a = ma.len();
    let mut wr = 0u64;
    for (i, &n) in SIZES.iter().enumerate() {
        let n32 = n as u32;
        for imm in [None, Some(0xabc0_0000 | i as u32)] {
            // Send (with Imm): A's buffer as source, B's as destination.
            let data = pattern(n, i as u8 ^ 0x11);
            ma.write_at(AT, &data).unwrap();
            mb.write_at(AT, &vec![0xEE; n + 8]).unwrap();
            p.b.qp
                .post_recv(&RecvWr::new(7, &[mb.sge(AT, n32 + 8).unwrap()]))
                .unwrap();
            wr += 1;
            let op = imm.map_or(SendOp::Send, SendOp::SendWithImm);
            p.a.qp
                .post_send(&SendWr::new(wr, op, &[ma.sge(AT, n32).unwrap()]))
                .unwrap();
            let rc = wait_b(&mut p, 1)[0];
            assert_eq!(rc.status, WcStatus::Success, "{what} Send {n}: {rc:?}");
            assert_eq!((rc.byte_len, rc.imm_data), (n32, imm));
            assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
            let mut got = vec![0u8; n + 8];
            mb.read_at(AT, &mut got).unwrap();
            assert_eq!(&got[..n], &data[..], "{what} Send {n}");
            assert_eq!(&got[n..], &[0xEE; 8], "{what} Send {n}: past the message");

            // RDMA Write (with Imm): A's buffer as source, B's as the remote target.
            let data = pattern(n, i as u8 ^ 0x22);
            ma.write_at(AT, &data).unwrap();
            mb.write_at(AT, &vec![0xEE; n + 8]).unwrap();
            let op = match imm {
                None => SendOp::RdmaWrite(mb.remote(AT)),
                Some(v) => {
                    p.b.qp.post_recv(&RecvWr::new(8, &[])).unwrap();
                    SendOp::RdmaWriteWithImm(mb.remote(AT), v)
                }
            };
            wr += 1;
            p.a.qp
                .post_send(&SendWr::new(wr, op, &[ma.sge(AT, n32).unwrap()]))
                .unwrap();
            let sc = wait_a(&mut p, 1)[0];
            assert_eq!(sc.status, WcStatus::Success, "{what} Write {n}: {sc:?}");
            if imm.is_some() {
                let rc = wait_b(&mut p, 1)[0];
                assert_eq!((rc.status, rc.imm_data), (WcStatus::Success, imm));
            }
            let mut got = vec![0u8; n + 8];
            mb.read_at(AT, &mut got).unwrap();
            assert_eq!(&got[..n], &data[..], "{what} Write {n}");
            assert_eq!(&got[n..], &[0xEE; 8], "{what} Write {n}: past the message");
        }

        // RDMA Read: B's buffer as the remote source (staged by B's responder), A's as
        // destination, split over two elements.
        let data = pattern(n, i as u8 ^ 0x33);
        mb.write_at(AT + 100, &data).unwrap();
        ma.write_at(0, &vec![0xEE; n + 2 * AT as usize]).unwrap();
        let half = n32 / 2;
        let sgl = [
            ma.sge(AT, half).unwrap(),
            ma.sge(AT + u64::from(half), n32 - half).unwrap(),
        ];
        let sgl = if n == 0 { &sgl[..0] } else { &sgl[..] };
        wr += 1;
        p.a.qp
            .post_send(&SendWr::new(wr, SendOp::RdmaRead(mb.remote(AT + 100)), sgl))
            .unwrap();
        let sc = wait_a(&mut p, 1)[0];
        assert_eq!(sc.status, WcStatus::Success, "{what} Read {n}: {sc:?}");
        assert_eq!(sc.byte_len, n32);
        let mut got = vec![0u8; n + 2 * AT as usize];
        ma.read_at(0, &mut got).unwrap();
        assert_eq!(
            &got[AT as usize..AT as usize + n],
            &data[..],
            "{what} Read {n}"
        );
        assert!(got[..AT as usize].iter().all(|&b| b == 0xEE));
        assert!(got[AT as usize + n..].iter().all(|&b| b == 0xEE));
    }

    // Atomics: B's word as the remote target (executed by B's engine on B's buffer), A's
    // buffer as the result.
    mb.write_at(WORD, &40u64.to_ne_bytes()).unwrap();
    let cases = [
        (
            SendOp::FetchAdd {
                remote: mb.remote(WORD),
                add: 2,
            },
            40,
            42,
        ),
        (
            SendOp::CompareSwap {
                remote: mb.remote(WORD),
                compare: 42,
                swap: 7,
            },
            42,
            7,
        ),
        (
            SendOp::CompareSwap {
                remote: mb.remote(WORD),
                compare: 1,
                swap: 9,
            },
            7,
            7,
        ),
    ];
    for (op, orig, after) in cases {
        wr += 1;
        p.a.qp
            .post_send(&SendWr::new(wr, op, &[ma.sge(WORD + 8, 8).unwrap()]))
            .unwrap();
        let sc = wait_a(&mut p, 1)[0];
        assert_eq!(sc.status, WcStatus::Success, "{what} {op:?}: {sc:?}");
        assert_eq!(ma.load_u64(WORD + 8).unwrap(), orig, "{what} {op:?} result");
        assert_eq!(mb.load_u64(WORD).unwrap(), after, "{what} {op:?} target");
    }

    // Nothing in flight any more: the buffers come back, with their contents.
    assert_eq!(ma.in_flight(), 0);
    ma.write_at(0, b"kept").unwrap();
    let a_back = ma.into_inner().unwrap();
    assert_eq!(a_back.byte_len() as u64, len_a);
    drop(mb);
    let _ = &mut p;
}

fn vec_buf() -> Vec<u8> {
    vec![0u8; LEN]
}

#[test]
fn a_vec_in_every_operation() {
    every_operation("Vec", vec_buf(), vec_buf());
}

#[test]
fn a_boxed_slice_in_every_operation() {
    every_operation(
        "Box<[u8]>",
        vec_buf().into_boxed_slice(),
        vec_buf().into_boxed_slice(),
    );
}

#[test]
fn an_anonymous_mmap_in_every_operation() {
    every_operation(
        "MmapMut",
        memmap2::MmapMut::map_anon(LEN).unwrap(),
        memmap2::MmapMut::map_anon(LEN).unwrap(),
    );
}

#[test]
fn a_memfd_in_every_operation() {
    let a = Memfd::map(memfd(LEN, false).unwrap()).unwrap();
    let b = Memfd::map(memfd(LEN, false).unwrap()).unwrap();
    every_operation("memfd", a, b);
}

#[test]
fn a_hugetlb_memfd_in_every_operation() {
    let (Some(a), Some(b)) = (huge_memfd(), huge_memfd()) else {
        eprintln!("skipped: no free huge pages for two MFD_HUGETLB memfds");
        return;
    };
    every_operation("hugetlb memfd", a, b);
}

#[test]
fn kinds_mix_with_arena_regions() {
    // A Vec on one side, a memfd on the other.
    let b = Memfd::map(memfd(LEN, false).unwrap()).unwrap();
    every_operation("Vec to memfd", vec_buf(), b);
}

#[test]
fn the_buffer_comes_back_with_what_was_received() {
    let mut p = pair(&Params::default());
    let dst =
        p.b.pd
            .reg_mr(vec![0u8; 100], AccessFlags::LOCAL_WRITE)
            .unwrap();
    let src = p.a.pd.alloc_mr(100, AccessFlags::NONE).unwrap();
    src.write_at(0, &pattern(100, 9)).unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(1, &[dst.as_sge().unwrap()]))
        .unwrap();
    // While the receive is posted the buffer cannot be taken back.
    let (dst, err) = dst.into_inner().unwrap_err().into_parts();
    assert!(matches!(err, Error::MrBusy { in_flight: 1, .. }), "{err}");
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.as_sge().unwrap()]))
        .unwrap();
    assert_eq!(wait_b(&mut p, 1)[0].status, WcStatus::Success);
    let v: Vec<u8> = dst.into_inner().unwrap();
    assert_eq!(v, pattern(100, 9), "received in place: no copy out needed");
}

#[test]
fn dropping_a_region_in_flight_keeps_its_buffer_until_the_completion() {
    let mut p = pair(&Params::default());
    let dst =
        p.b.pd
            .reg_mr(vec![0u8; 4096], AccessFlags::LOCAL_WRITE)
            .unwrap();
    let src = p.a.pd.alloc_mr(4096, AccessFlags::NONE).unwrap();
    src.write_at(0, &pattern(4096, 3)).unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(1, &[dst.as_sge().unwrap()]))
        .unwrap();
    let free = p.b.pd.arena_free();
    drop(dst);
    assert_eq!(
        p.b.pd.arena_free(),
        free,
        "the shadow (and buffer) live while the receive is posted"
    );
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.as_sge().unwrap()]))
        .unwrap();
    assert_eq!(wait_b(&mut p, 1)[0].status, WcStatus::Success);
    assert!(p.b.pd.arena_free() > free, "freed after the completion");
}

#[test]
fn misuse_is_refused_with_clear_errors() {
    let p = pair(&Params::default());
    let pd = &p.a.pd;
    // Empty buffers: the buffer comes back with the error.
    let (v, err) = pd
        .reg_mr(Vec::new(), AccessFlags::NONE)
        .unwrap_err()
        .into_parts();
    assert!(v.is_empty());
    assert!(err.to_string().contains("1 byte to 2 GiB"), "{err}");
    // Too large (an untouched anonymous mapping costs nothing).
    let big = memmap2::MmapMut::map_anon((2 << 30) + 1).unwrap();
    let err = pd.reg_mr(big, AccessFlags::NONE).unwrap_err().into_error();
    assert!(err.to_string().contains("2 GiB"), "{err}");
    // More than the arena can shadow.
    let err = pd
        .reg_mr(vec![0u8; 64 << 20], AccessFlags::NONE)
        .unwrap_err()
        .into_error();
    assert!(matches!(err, Error::ArenaExhausted { .. }), "{err}");
    // Memfds that cannot be registered: empty, or sealed against writing.
    let err = Memfd::map(memfd(0, false).unwrap()).unwrap_err();
    assert!(err.to_string().contains("ftruncate"), "{err}");
    let fd = rustix::fs::memfd_create(
        "sealed",
        rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
    )
    .unwrap();
    rustix::fs::ftruncate(&fd, 4096).unwrap();
    rustix::fs::fcntl_add_seals(&fd, rustix::fs::SealFlags::WRITE).unwrap();
    let err = Memfd::map(fd).unwrap_err();
    assert!(
        err.to_string().contains("cannot map it read-write"),
        "{err}"
    );
}

#[test]
fn access_rights_are_enforced() {
    let mut p = pair(&Params::default());
    // No LOCAL_WRITE: cannot receive into it, nor be a Read's destination.
    let ro = p.b.pd.reg_mr(vec![1u8; 64], AccessFlags::NONE).unwrap();
    let err =
        p.b.qp
            .post_recv(&RecvWr::new(1, &[ro.as_sge().unwrap()]))
            .unwrap_err();
    assert!(err.to_string().contains("LOCAL_WRITE"), "{err}");
    // No REMOTE_WRITE: a peer's Write is refused, and the buffer is untouched.
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    src.write_at(0, &[9u8; 64]).unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            1,
            SendOp::RdmaWrite(ro.remote(0)),
            &[src.as_sge().unwrap()],
        ))
        .unwrap();
    let sc = wait_a(&mut p, 1)[0];
    assert_eq!(sc.status, WcStatus::RemAccessErr, "{sc:?}");
    let mut got = [0u8; 64];
    ro.read_at(0, &mut got).unwrap();
    assert_eq!(got, [1u8; 64]);
}

#[test]
fn mutable_slices_only_where_nothing_else_can_touch_the_buffer() {
    let p = pair(&Params::default());
    let mut v =
        p.a.pd
            .reg_mr(vec![5u8; 64], AccessFlags::LOCAL_WRITE)
            .unwrap();
    v.as_mut_slice().unwrap()[0] = 6;
    let mut b = [0u8; 1];
    v.read_at(0, &mut b).unwrap();
    assert_eq!(b, [6]);
    let mut rr =
        p.a.pd
            .reg_mr(vec![5u8; 64], AccessFlags::REMOTE_READ)
            .unwrap();
    assert!(
        rr.as_mut_slice().is_err(),
        "the engine may stage it for a peer's Read"
    );
    let mut m =
        p.a.pd
            .reg_mr(
                Memfd::map(memfd(4096, false).unwrap()).unwrap(),
                AccessFlags::NONE,
            )
            .unwrap();
    let err = m.as_mut_slice().unwrap_err();
    assert!(err.to_string().contains("read_at/write_at"), "{err}");
}

#[test]
fn a_memory_window_over_a_registered_buffer_reaches_the_buffer() {
    let mut p = pair(&Params::default());
    let rights = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
    let mr =
        p.b.pd
            .reg_mr(
                vec![0u8; 8192],
                AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND | rights,
            )
            .unwrap();
    let mut mw = p.b.pd.alloc_mw(MwType::One).unwrap();
    let key =
        p.b.qp
            .bind_mw(
                &mut mw,
                1,
                mr.mw_bind(1024, 4096, rights),
                SendFlags::SIGNALED,
            )
            .unwrap();
    assert_eq!(wait_b(&mut p, 1)[0].status, WcStatus::Success);
    let at = RemoteAddr {
        addr: mr.addr() + 1024,
        rkey: key,
    };
    let src = p.a.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, &pattern(3000, 4)).unwrap();
    let g = [src.sge(0, 3000).unwrap()];
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::RdmaWrite(at), &g))
        .unwrap();
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    let mut got = vec![0u8; 3000];
    mr.read_at(1024, &mut got).unwrap();
    assert_eq!(
        got,
        pattern(3000, 4),
        "the Write through the window landed in the Vec"
    );
    // A Read through the window sees what the application wrote into the buffer.
    mr.write_at(1024, &pattern(3000, 5)).unwrap();
    p.a.qp
        .post_send(&SendWr::new(2, SendOp::RdmaRead(at), &g))
        .unwrap();
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    let mut got = vec![0u8; 3000];
    src.read_at(0, &mut got).unwrap();
    assert_eq!(
        got,
        pattern(3000, 5),
        "the Read through the window read the Vec"
    );
}

#[test]
fn a_shared_receive_queue_receives_into_a_registered_buffer() {
    let p = Params::default();
    let b = context(4 << 20);
    let b_pd = b.alloc_pd().unwrap();
    let mut b_cq = b.create_cq(64).unwrap();
    let mut srq = b_pd.create_srq(8, 1).unwrap();
    let a = context(4 << 20);
    let (la, lb) = a.link_with(&b).unwrap();
    let a_pd = a.alloc_pd().unwrap();
    let mut a_cq = a.create_cq(64).unwrap();
    let mut qa = a.create_qp(&a_pd, &a_cq, &a_cq, p.caps).unwrap();
    let mut qb = b
        .create_qp_with_srq(&b_pd, &b_cq, &b_cq, &srq, p.caps)
        .unwrap();
    let (na, nb) = (qa.qpn(), qb.qpn());
    connect(&mut qb, lb, na, 500, 900, &p);
    qa.modify(&QpAttr::new(QpState::Init).access(p.access))
        .unwrap();
    qa.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(p.mtu)
            .dest(Destination { link: la, qpn: nb })
            .rq_psn(500)
            .max_dest_rd_atomic(p.rd_atomic)
            .min_rnr_timer(1)
            .remote_credits(false),
    )
    .unwrap();
    qa.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(900)
            .timeout(14)
            .retry_cnt(7)
            .rnr_retry(7)
            .max_rd_atomic(p.rd_atomic),
    )
    .unwrap();
    let dst = b_pd
        .reg_mr(vec![0u8; 4096], AccessFlags::LOCAL_WRITE)
        .unwrap();
    srq.post_recv(&RecvWr::new(5, &[dst.sge(16, 3000).unwrap()]))
        .unwrap();
    let src = a_pd.alloc_mr(3000, AccessFlags::NONE).unwrap();
    src.write_at(0, &pattern(3000, 8)).unwrap();
    qa.post_send(&SendWr::new(1, SendOp::Send, &[src.as_sge().unwrap()]))
        .unwrap();
    let rc = poll_n(&a, &b, &mut b_cq, 1)[0];
    assert_eq!(
        (rc.status, rc.wr_id, rc.byte_len),
        (WcStatus::Success, 5, 3000)
    );
    assert_eq!(poll_n(&a, &b, &mut a_cq, 1)[0].status, WcStatus::Success);
    let mut got = vec![0u8; 3000];
    dst.read_at(16, &mut got).unwrap();
    assert_eq!(got, pattern(3000, 8), "received in place through the SRQ");
}
