//! A protection domain whose arena is the application's memfd (`Context::alloc_pd_over`)
//! and regions registered in place in it (`Pd::reg_mr_at`): every operation with the
//! bytes checked, written only through the application's own mapping; no shadow, no
//! sender-side copy; shmhca never writes the application's bytes; the refusals.
mod common;

use std::os::fd::OwnedFd;

use common::*;
use shmhca::*;

const LEN: usize = 256 << 10;
const STAGING: u64 = 64 << 10;

fn memfd(len: usize, sealing: bool) -> OwnedFd {
    let mut flags = rustix::fs::MemfdFlags::CLOEXEC;
    if sealing {
        flags |= rustix::fs::MemfdFlags::ALLOW_SEALING;
    }
    let fd = rustix::fs::memfd_create("shmhca-user-pd", flags).unwrap();
    rustix::fs::ftruncate(&fd, len as u64).unwrap();
    fd
}

/// The application's own writable mapping of its memfd.
fn user_map(fd: &OwnedFd) -> memmap2::MmapMut {
    let file = std::fs::File::from(fd.try_clone().unwrap());
    // SAFETY: the mapping is only written and read by this test, between operations that
    // do not touch the same bytes.
    unsafe { memmap2::MmapMut::map_mut(&file) }.unwrap()
}

/// A pair whose A side's domain is over a memfd the test filled with `fill` first.
fn memfd_pair(staging: u64, caps: QpCaps) -> (Pair, memmap2::MmapMut) {
    let p = Params {
        caps,
        ..Params::default()
    };
    let ca = context(4 << 20);
    let cb = context(4 << 20);
    let (la, lb) = ca.link_with(&cb).unwrap();
    let fd = memfd(LEN, true);
    let mut map = user_map(&fd);
    map[..LEN].copy_from_slice(&pattern(LEN, 0x5a));
    let pd = ca.alloc_pd_over(fd, staging).unwrap();
    let cq = ca.create_cq(4096).unwrap();
    let qp = ca.create_qp(&pd, &cq, &cq, p.caps).unwrap();
    let mut a = End {
        ctx: ca,
        pd,
        cq,
        qp,
        link: la,
    };
    let mut b = end(cb, lb, &p);
    let (qa, qb) = (a.qp.qpn(), b.qp.qpn());
    connect(&mut a.qp, la, qb, p.psn_a, p.psn_b, &p);
    connect(&mut b.qp, lb, qa, p.psn_b, p.psn_a, &p);
    (Pair { a, b }, map)
}

/// The address of byte 0 of a memfd domain's file.
fn base(pd: &Pd) -> u64 {
    pd.reg_mr_at(0, 1, AccessFlags::NONE).unwrap().addr()
}

#[test]
fn every_operation_from_and_into_the_memfd_in_place_without_a_copy() {
    let caps = QpCaps {
        max_inline_data: 0,
        ..QpCaps::default()
    };
    let (mut p, mut map) = memfd_pair(0, caps);
    assert_eq!(
        p.a.pd.arena_free(),
        0,
        "with staging 0 the whole file is the user's"
    );
    // Registration does not copy, allocate or write anything.
    let before = map[..].to_vec();
    let src = p.a.pd.reg_mr_at(4096, 128 << 10, AccessFlags::ALL).unwrap();
    let dst =
        p.a.pd
            .reg_mr_at(192 << 10, 64 << 10, AccessFlags::ALL)
            .unwrap();
    assert_eq!(&map[..], &before[..], "registration wrote the user's bytes");
    assert_eq!(src.addr(), base(&p.a.pd) + 4096);
    let mb = p.b.pd.alloc_mr(128 << 10, AccessFlags::ALL).unwrap();

    let mut wr = 0;
    for n in [1usize, 1000, 5 * 1024 + 17, 64 << 10] {
        let n32 = n as u32;
        // Send: the user writes through its own mapping only.
        let data = pattern(n, n as u8);
        map[4096 + 24..4096 + 24 + n].copy_from_slice(&data);
        p.b.qp
            .post_recv(&RecvWr::new(1, &[mb.sge(0, n32).unwrap()]))
            .unwrap();
        let stats_a = p.a.ctx.stats();
        wr += 1;
        p.a.qp
            .post_send(&SendWr::new(wr, SendOp::Send, &[src.sge(24, n32).unwrap()]))
            .unwrap();
        assert_eq!(wait_b(&mut p, 1)[0].status, WcStatus::Success);
        assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
        let mut got = vec![0; n];
        mb.read_at(0, &mut got).unwrap();
        assert_eq!(got, data, "Send {n}");
        let after = p.a.ctx.stats();
        // Tiny payloads (and a message's tiny last-packet tail) travel inline in the
        // packet, one copy on any path; the bulk is read by the peer from the memfd itself.
        let inlined = after.inline_bytes_sent - stats_a.inline_bytes_sent;
        assert!(
            inlined < 64,
            "Send {n}: {inlined} bytes copied by the sender"
        );
        assert_eq!(after.payload_bytes_copied, stats_a.payload_bytes_copied);

        // RDMA Write from the memfd.
        let data = pattern(n, n as u8 ^ 0x77);
        map[4096 + 24..4096 + 24 + n].copy_from_slice(&data);
        wr += 1;
        p.a.qp
            .post_send(&SendWr::new(
                wr,
                SendOp::RdmaWrite(mb.remote(0)),
                &[src.sge(24, n32).unwrap()],
            ))
            .unwrap();
        assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
        mb.read_at(0, &mut got).unwrap();
        assert_eq!(got, data, "Write {n}");

        // The peer's RDMA Read of the memfd, in place.
        let data = pattern(n, n as u8 ^ 0x33);
        map[4096 + 100..4096 + 100 + n].copy_from_slice(&data);
        wr += 1;
        p.b.qp
            .post_send(&SendWr::new(
                wr,
                SendOp::RdmaRead(src.remote(100)),
                &[mb.sge(0, n32).unwrap()],
            ))
            .unwrap();
        assert_eq!(wait_b(&mut p, 1)[0].status, WcStatus::Success);
        mb.read_at(0, &mut got).unwrap();
        assert_eq!(got, data, "peer's Read {n}");

        // Into the memfd: the peer's Send, the peer's RDMA Write, and A's RDMA Read.
        let data = pattern(n, n as u8 ^ 0x99);
        mb.write_at(0, &data).unwrap();
        p.a.qp
            .post_recv(&RecvWr::new(2, &[dst.sge(0, n32).unwrap()]))
            .unwrap();
        wr += 1;
        p.b.qp
            .post_send(&SendWr::new(wr, SendOp::Send, &[mb.sge(0, n32).unwrap()]))
            .unwrap();
        assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
        assert_eq!(wait_b(&mut p, 1)[0].status, WcStatus::Success);
        assert_eq!(
            &map[(192 << 10)..(192 << 10) + n],
            &data[..],
            "Send into {n}"
        );

        let data = pattern(n, n as u8 ^ 0x44);
        mb.write_at(0, &data).unwrap();
        wr += 1;
        p.b.qp
            .post_send(&SendWr::new(
                wr,
                SendOp::RdmaWrite(dst.remote(0)),
                &[mb.sge(0, n32).unwrap()],
            ))
            .unwrap();
        assert_eq!(wait_b(&mut p, 1)[0].status, WcStatus::Success);
        assert_eq!(
            &map[(192 << 10)..(192 << 10) + n],
            &data[..],
            "Write into {n}"
        );

        let data = pattern(n, n as u8 ^ 0x55);
        mb.write_at(0, &data).unwrap();
        wr += 1;
        p.a.qp
            .post_send(&SendWr::new(
                wr,
                SendOp::RdmaRead(mb.remote(0)),
                &[dst.sge(0, n32).unwrap()],
            ))
            .unwrap();
        assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
        assert_eq!(
            &map[(192 << 10)..(192 << 10) + n],
            &data[..],
            "Read into {n}"
        );
    }

    // Atomics on a word of the memfd, executed by A's engine for the peer.
    map[(192 << 10)..(192 << 10) + 8].copy_from_slice(&40u64.to_ne_bytes());
    wr += 1;
    p.b.qp
        .post_send(&SendWr::new(
            wr,
            SendOp::FetchAdd {
                remote: dst.remote(0),
                add: 2,
            },
            &[mb.sge(0, 8).unwrap()],
        ))
        .unwrap();
    assert_eq!(wait_b(&mut p, 1)[0].status, WcStatus::Success);
    assert_eq!(mb.load_u64(0).unwrap(), 40);
    assert_eq!(&map[(192 << 10)..(192 << 10) + 8], &42u64.to_ne_bytes());

    // Deregistering leaves the user's bytes as they are.
    let snapshot = map[..].to_vec();
    drop(src);
    drop(dst);
    p.settle();
    assert_eq!(
        &map[..],
        &snapshot[..],
        "deregistration zeroed the user's bytes"
    );
    // The user's mapping still writes after all of it.
    map[0] = 0xAB;
}

#[test]
fn staging_carries_inline_and_alloc_mr_and_never_touches_the_user_part() {
    let (mut p, map) = memfd_pair(STAGING, QpCaps::default());
    let user_part = (LEN as u64 - STAGING) as usize;
    let before = map[..user_part].to_vec();
    let staged = p.a.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    assert!(staged.addr() >= base(&p.a.pd) + user_part as u64);
    let mb = p.b.pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(1, &[mb.sge(0, 64).unwrap()]))
        .unwrap();
    p.a.qp
        .post_send(&SendWr::inline(1, SendOp::Send, b"inline!"))
        .unwrap();
    assert_eq!(wait_b(&mut p, 1)[0].byte_len, 7);
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    let mut got = [0u8; 7];
    mb.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"inline!");
    assert_eq!(
        &map[..user_part],
        &before[..],
        "staging spilled into the user's part"
    );
    // The user's part cannot be registered past its end.
    let e =
        p.a.pd
            .reg_mr_at(user_part as u64 - 10, 11, AccessFlags::NONE)
            .unwrap_err();
    assert!(e.to_string().contains("yours"), "{e}");
}

#[test]
fn refusals_name_the_problem() {
    let ctx = context(1 << 20);
    let e = ctx.alloc_pd_over(memfd(LEN, false), 0).unwrap_err();
    assert!(matches!(e, Error::MemfdAdopt(_)), "{e}");
    assert!(e.to_string().contains("MFD_ALLOW_SEALING"), "{e}");
    let e = ctx.alloc_pd_over(memfd(0, true), 0).unwrap_err();
    assert!(e.to_string().contains("ftruncate"), "{e}");
    let e = ctx.alloc_pd_over(memfd(4096, true), 8192).unwrap_err();
    assert!(e.to_string().contains("staging"), "{e}");
    // reg_mr_at on an ordinary domain, and empty or out-of-range ranges.
    let pd = ctx.alloc_pd().unwrap();
    let e = pd.reg_mr_at(0, 64, AccessFlags::NONE).unwrap_err();
    assert!(e.to_string().contains("alloc_pd_over"), "{e}");
    let pd = ctx.alloc_pd_over(memfd(LEN, true), 0).unwrap();
    assert!(pd.reg_mr_at(0, 0, AccessFlags::NONE).is_err());
    assert!(pd.reg_mr_at(LEN as u64, 1, AccessFlags::NONE).is_err());
    assert!(pd.reg_mr_at(u64::MAX, 2, AccessFlags::NONE).is_err());
    let mut whole = pd
        .reg_mr_at(0, LEN as u64, AccessFlags::LOCAL_WRITE)
        .unwrap();
    assert!(
        whole.as_mut_slice().is_err(),
        "the user's mapping aliases it"
    );
    // No staging: a QP with inline data has nowhere to stage it.
    let cq = ctx.create_cq(16).unwrap();
    assert!(ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).is_err());
    let caps = QpCaps {
        max_inline_data: 0,
        ..QpCaps::default()
    };
    ctx.create_qp(&pd, &cq, &cq, caps).unwrap();
}
