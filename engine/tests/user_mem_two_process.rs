//! Registered application memory between two processes: every operation with a buffer of
//! each kind on both sides, every byte checked.
//!
//! The parent sends from a `Vec`, receives into a memfd, reads into and takes Atomic results
//! into the `Vec`. The child (this binary re-executed) receives into a `Box<[u8]>` and
//! echoes from it (a Send with Immediate), and serves the parent's RDMA Writes, Reads and
//! Atomics on an anonymous `MmapMut` — data that reaches the parent only through the
//! shadow in the child's arena, since the parent cannot map the child's process memory.
mod cm_support;

use std::os::fd::OwnedFd;

use cm_support::*;
use shmhca::*;

const TEST: &str = "registered_memory_between_two_processes";
const QUIT: u32 = 0xDEAD_BEEF;
const LEN: usize = 64 << 10;
/// The child's mmap: written at WRITE_AREA, atomics at WORD.
const WRITE_AREA: u64 = 0;
const WORD: u64 = 60 << 10;
/// How many receives the child keeps posted, each SLOT bytes of its box.
const SLOT: u64 = 16 << 10;
const SLOTS: u64 = 4;

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 32,
        max_recv_wr: 32,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline_data: 64,
    }
}

fn memfd(len: usize) -> OwnedFd {
    let fd = rustix::fs::memfd_create(
        "shmhca-user-mem",
        rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
    )
    .unwrap();
    rustix::fs::ftruncate(&fd, len as u64).unwrap();
    fd
}

#[test]
fn registered_memory_between_two_processes() {
    if let Some((role, arg)) = role() {
        assert_eq!(role, "child");
        return child(&arg);
    }
    let _serial = serial();
    let dir = SockDir::new("usermem");
    let path = dir.sock("usermem.sock");
    let ctx = context(8 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(256).unwrap();
    let v = pd.reg_mr(vec![0u8; LEN], AccessFlags::LOCAL_WRITE).unwrap();
    let echo = pd
        .reg_mr(Memfd::map(memfd(LEN)).unwrap(), AccessFlags::LOCAL_WRITE)
        .unwrap();
    let listener = ctx.listen(&path).unwrap();
    let peer = spawn_peer(TEST, "child", path.to_str().unwrap());
    let mut conn = listener
        .accept_timeout(
            DEADLINE,
            &pd,
            &cq,
            &cq,
            &ConnectParams::default().caps(caps()),
        )
        .unwrap();
    let remote = RemoteAddr::from_bytes(conn.peer_private_data().try_into().expect("12 bytes"));
    let mut id = 0u64;
    let mut run =
        |conn: &mut Connection, cq: &mut Cq, op: SendOp, sgl: &[Sge<'_>], echo_of: bool| {
            id += 1;
            if echo_of {
                conn.post_recv(&RecvWr::new(0, &[echo.sge(0, LEN as u32).unwrap()]))
                    .unwrap();
            }
            conn.post_send(&SendWr::new(id, op, sgl)).unwrap();
            let wcs = wait(cq, 1 + usize::from(echo_of));
            for wc in &wcs {
                assert_eq!(wc.status, WcStatus::Success, "{op:?}: {wcs:?}");
            }
            wcs.iter().find(|w| w.wr_id == 0).copied()
        };
    let echoed = |n: usize| {
        let mut b = vec![0u8; n];
        echo.read_at(0, &mut b).unwrap();
        b
    };
    for (i, n) in [1usize, 100, 1024, 5 * 1024 + 3, 15 * 1024]
        .into_iter()
        .enumerate()
    {
        let seed = i as u8;
        let n32 = n as u32;
        // Send and Send with Immediate from the Vec; the child echoes from its Box into
        // our memfd.
        for op in [SendOp::Send, SendOp::SendWithImm(0x100 + i as u32)] {
            let data = pattern(n, seed ^ 0x40);
            v.write_at(8, &data).unwrap();
            let wc = run(&mut conn, &mut cq, op, &[v.sge(8, n32).unwrap()], true).unwrap();
            assert_eq!(wc.byte_len, n32, "{op:?} {n}");
            assert_eq!(echoed(n), data, "{op:?} {n}");
        }
        // RDMA Write (with Immediate: the child echoes what landed) from the Vec into the
        // child's mmap, then RDMA Read of it back into the Vec, in two elements.
        let data = pattern(n, seed ^ 0x80);
        v.write_at(8, &data).unwrap();
        let target = remote.offset(WRITE_AREA);
        run(
            &mut conn,
            &mut cq,
            SendOp::RdmaWrite(target),
            &[v.sge(8, n32).unwrap()],
            false,
        );
        v.write_at(0, &vec![0u8; n + 16]).unwrap();
        let half = n32 / 2;
        let sgl = [
            v.sge(8, half).unwrap(),
            v.sge(8 + u64::from(half), n32 - half).unwrap(),
        ];
        let sgl = if half == 0 { &sgl[1..] } else { &sgl[..] };
        run(&mut conn, &mut cq, SendOp::RdmaRead(target), sgl, false);
        let mut got = vec![0u8; n];
        v.read_at(8, &mut got).unwrap();
        assert_eq!(got, data, "Write then Read {n}");
        let data = pattern(n, seed ^ 0xC0);
        v.write_at(8, &data).unwrap();
        let op = SendOp::RdmaWriteWithImm(target, n32);
        run(&mut conn, &mut cq, op, &[v.sge(8, n32).unwrap()], true);
        assert_eq!(echoed(n), data, "Write with Imm {n}");
    }
    // Atomics on the child's mmap word (zero), results into the Vec.
    let word = remote.offset(WORD);
    let cases = [
        (
            SendOp::FetchAdd {
                remote: word,
                add: 9,
            },
            0u64,
        ),
        (
            SendOp::CompareSwap {
                remote: word,
                compare: 9,
                swap: 70,
            },
            9,
        ),
        (
            SendOp::FetchAdd {
                remote: word,
                add: 1,
            },
            70,
        ),
    ];
    for (op, orig) in cases {
        run(&mut conn, &mut cq, op, &[v.sge(1024, 8).unwrap()], false);
        assert_eq!(v.load_u64(1024).unwrap(), orig, "{op:?}");
    }
    run(&mut conn, &mut cq, SendOp::SendWithImm(QUIT), &[], false);
    peer.expect_success();
    drop(conn);
    drop(listener);
    let back: Vec<u8> = v.into_inner().unwrap();
    assert_eq!(back.len(), LEN);
    dir.assert_empty_and_remove();
}

fn child(path: &str) {
    let ctx = context(8 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(256).unwrap();
    let boxed = pd
        .reg_mr(
            vec![0u8; (SLOT * SLOTS) as usize].into_boxed_slice(),
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
    let map = pd
        .reg_mr(memmap2::MmapMut::map_anon(LEN).unwrap(), AccessFlags::ALL)
        .unwrap();
    let params = ConnectParams::default()
        .caps(caps())
        .private_data(map.remote(0).to_bytes().to_vec());
    let mut conn = ctx.connect(path, &pd, &cq, &cq, &params).unwrap();
    let post = |conn: &mut Connection, slot: u64| {
        let sgl = [
            boxed.sge(slot * SLOT, 10).unwrap(),
            boxed.sge(slot * SLOT + 10, (SLOT - 10) as u32).unwrap(),
        ];
        conn.post_recv(&RecvWr::new(slot, &sgl)).unwrap();
    };
    for slot in 0..SLOTS {
        post(&mut conn, slot);
    }
    loop {
        let wc = wait(&mut cq, 1)[0];
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        match wc.opcode {
            WcOpcode::Recv if wc.imm_data == Some(QUIT) => break,
            WcOpcode::Recv => {
                // Echo from the box (a registered buffer as source).
                let n = wc.byte_len;
                let base = wc.wr_id * SLOT;
                let sgl = [boxed.sge(base, n).unwrap()];
                conn.post_send(&SendWr::new(1000 + wc.wr_id, SendOp::SendWithImm(n), &sgl))
                    .unwrap();
            }
            WcOpcode::RecvRdmaWithImm => {
                let n = wc.imm_data.expect("the length");
                let sgl = [map.sge(WRITE_AREA, n).unwrap()];
                conn.post_send(&SendWr::new(2000, SendOp::SendWithImm(n), &sgl))
                    .unwrap();
                post(&mut conn, wc.wr_id);
            }
            WcOpcode::Send if wc.wr_id >= 2000 => {}
            WcOpcode::Send => post(&mut conn, wc.wr_id - 1000),
            other => panic!("unexpected completion {other:?}: {wc:?}"),
        }
    }
    drop(conn);
    let _: Box<[u8]> = boxed.into_inner().unwrap();
}
