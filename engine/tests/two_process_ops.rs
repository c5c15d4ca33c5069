//! Every operation between two processes connected by the connection manager: Send, Send
//! with Immediate, RDMA Write, RDMA Write with Immediate, RDMA Read, Compare-and-Swap and
//! Fetch-and-Add, at sizes 0, 1, PMTU−1, PMTU, PMTU+1 and several PMTUs, with one and with
//! several scatter/gather elements, every byte checked.
//!
//! The parent listens; the child (this binary re-executed) connects, offering a smaller
//! PMTU, reads and writes the parent's memory, then serves as an echo: each Send comes back
//! as a Send with Immediate, each RDMA Write with Immediate comes back as a Send of the
//! bytes written.
mod cm_support;

use cm_support::*;
use shmhca::*;

const TEST: &str = "every_operation_between_two_processes";
/// Immediate data of the child's "ready" message and of the parent's "quit".
const READY: u32 = 0x5EAD_0001;
const QUIT: u32 = 0xDEAD_BEEF;
/// Bytes of each receive slot of the child, and the split of its two scatter elements.
const SLOT: u64 = 32 << 10;
const HEAD: u64 = 100;
const SLOTS: u64 = 8;
/// Layout of the child's big region.
const READ_AREA: u64 = 0;
const WRITE_AREA: u64 = 64 << 10;
const ATOMIC_WORD: u64 = 128 << 10;
const READ_SEED: u8 = 0x5A;

fn caps(sge: u32) -> QpCaps {
    QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: sge,
        max_recv_sge: sge,
        max_inline_data: 64,
    }
}

/// Splits `len` bytes at `base` of `mr` into `parts` scatter/gather elements spread over
/// the region (at `base`, `base + 20000`, `base + 40000`, ...).
fn split<'a>(mr: &'a Mr, base: u64, len: u32, parts: u32) -> Vec<Sge<'a>> {
    if len == 0 {
        return Vec::new();
    }
    let parts = parts.min(len);
    let each = len / parts;
    (0..parts)
        .map(|i| {
            let n = if i == parts - 1 {
                len - each * (parts - 1)
            } else {
                each
            };
            mr.sge(base + u64::from(i) * 20_000, n).unwrap()
        })
        .collect()
}

/// Writes `data` into `mr` across the same elements [`split`] makes.
fn write_split(mr: &Mr, base: u64, data: &[u8], parts: u32) {
    let mut done = 0usize;
    for (i, s) in split(mr, base, data.len() as u32, parts).iter().enumerate() {
        let n = s.len() as usize;
        mr.write_at(base + i as u64 * 20_000, &data[done..done + n])
            .unwrap();
        done += n;
    }
}

/// Reads back what [`split`]'s elements hold, concatenated.
fn read_split(mr: &Mr, base: u64, len: usize, parts: u32) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut done = 0usize;
    for (i, s) in split(mr, base, len as u32, parts).iter().enumerate() {
        let n = s.len() as usize;
        mr.read_at(base + i as u64 * 20_000, &mut out[done..done + n])
            .unwrap();
        done += n;
    }
    out
}
#[test]
fn every_operation_between_two_processes() {
    if let Some((role, arg)) = role() {
        assert_eq!(role, "client");
        return echo_client(&arg);
    }
    let _serial = serial();
    let shm_before = dev_shm_entries();
    let dir = SockDir::new("ops");
    let path = dir.sock("ops.sock");
    let ctx = context(32 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(1024).unwrap();
    // The child reads the first half and writes the second half of this region.
    let shared = pd
        .alloc_mr(
            8192,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    shared.write_at(0, &pattern(4096, 11)).unwrap();
    let src = pd.alloc_mr(64 << 10, AccessFlags::NONE).unwrap();
    let dst = pd.alloc_mr(64 << 10, AccessFlags::LOCAL_WRITE).unwrap();
    let rbuf = pd.alloc_mr(64 << 10, AccessFlags::LOCAL_WRITE).unwrap();
    let word = pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();

    let listener = ctx.listen(&path).unwrap();
    let peer = spawn_peer(TEST, "client", path.to_str().unwrap());
    let params = ConnectParams::default()
        .caps(caps(4))
        .private_data(shared.remote(0).to_bytes().to_vec());
    let mut conn = listener
        .accept_timeout(DEADLINE, &pd, &cq, &cq, &params)
        .unwrap();
    assert_eq!(conn.peer_pid(), peer.pid());
    assert_eq!(conn.peer_uid(), rustix::process::geteuid().as_raw());
    assert_eq!(conn.state(), QpState::Rts);
    let cfg = conn.config();
    assert_eq!(
        cfg.path_mtu,
        Mtu::Mtu1024,
        "the smaller of the two PMTUs is used"
    );
    assert_eq!(cfg.dest.map(|d| d.qpn), Some(conn.peer_qpn()));
    assert_eq!(conn.peer_caps(), caps(2));
    let remote = RemoteAddr::from_bytes(conn.peer_private_data().try_into().expect("12 bytes"));

    // The child reads our first half, writes our second half, then says it is ready.
    let mut wr_id = 1u64;
    let post_echo_recv = |conn: &mut Connection, id: u64| {
        let sgl = [
            rbuf.sge(0, 10).unwrap(),
            rbuf.sge(10, (64 << 10) - 10).unwrap(),
        ];
        conn.post_recv(&RecvWr::new(id, &sgl)).unwrap();
    };
    post_echo_recv(&mut conn, 0);
    let ready = wait(&mut cq, 1)[0];
    assert_eq!(
        (ready.status, ready.opcode, ready.imm_data),
        (WcStatus::Success, WcOpcode::Recv, Some(READY))
    );
    let mut half = vec![0u8; 4096];
    shared.read_at(4096, &mut half).unwrap();
    assert_eq!(
        half,
        pattern(4096, 0x33),
        "the child's RDMA Write into this process"
    );

    let pmtu = 1024usize;
    let sizes = [0, 1, pmtu - 1, pmtu, pmtu + 1, 5 * pmtu + 17];
    let read_area = pattern(64 << 10, READ_SEED);

    // Posts `wr` and a receive for the echo; returns the send's and the echo's completions.
    let exchange = |conn: &mut Connection, cq: &mut Cq, wr: &SendWr<'_>, echo: bool| {
        if echo {
            post_echo_recv(conn, 7);
        }
        conn.post_send(wr).unwrap();
        let wcs = wait(cq, 1 + usize::from(echo));
        let send = *wcs
            .iter()
            .find(|w| w.wr_id == wr.wr_id)
            .expect("the send's completion");
        assert_eq!(send.status, WcStatus::Success, "{wr:?}: {wcs:?}");
        let recv = wcs.iter().find(|w| w.wr_id == 7).copied();
        if echo {
            let r = recv.expect("the echo");
            assert_eq!(r.status, WcStatus::Success, "{r:?}");
        }
        (send, recv)
    };
    let echoed = |len: usize| {
        let mut b = vec![0u8; len];
        rbuf.read_at(0, &mut b).unwrap();
        b
    };

    for (i, &len) in sizes.iter().enumerate() {
        for parts in [1u32, 3] {
            if parts == 3 && len < 3 {
                continue;
            }
            let seed = (i as u8) << 4 | parts as u8;
            let data = pattern(len, seed);
            let what = format!("{len} bytes in {parts} element(s)");
            write_split(&src, 0, &data, parts);
            let gather = split(&src, 0, len as u32, parts);

            // Send: echoed back with the length as immediate data.
            wr_id += 1;
            let (s, r) = exchange(
                &mut conn,
                &mut cq,
                &SendWr::new(wr_id, SendOp::Send, &gather),
                true,
            );
            assert_eq!(s.opcode, WcOpcode::Send);
            let r = r.unwrap();
            assert_eq!(
                (r.byte_len as usize, r.imm_data),
                (len, Some(len as u32)),
                "Send {what}"
            );
            assert_eq!(echoed(len), data, "Send {what}");

            // Send with Immediate: the child echoes the complement of our immediate.
            let imm = 0x1000_0000 | (i as u32) << 8 | parts;
            wr_id += 1;
            let (_, r) = exchange(
                &mut conn,
                &mut cq,
                &SendWr::new(wr_id, SendOp::SendWithImm(imm), &gather),
                true,
            );
            let r = r.unwrap();
            assert_eq!(
                (r.byte_len as usize, r.imm_data),
                (len, Some(!imm)),
                "Send with Imm {what}"
            );
            assert_eq!(echoed(len), data, "Send with Imm {what}");

            // RDMA Write, then RDMA Read of the same bytes into several elements.
            wr_id += 1;
            let (s, _) = exchange(
                &mut conn,
                &mut cq,
                &SendWr::new(wr_id, SendOp::RdmaWrite(remote.offset(WRITE_AREA)), &gather),
                false,
            );
            assert_eq!(s.opcode, WcOpcode::RdmaWrite);
            dst.write_at(0, &vec![0xEE; 64 << 10][..]).unwrap();
            let scatter = split(&dst, 0, len as u32, parts);
            wr_id += 1;
            let (s, _) = exchange(
                &mut conn,
                &mut cq,
                &SendWr::new(wr_id, SendOp::RdmaRead(remote.offset(WRITE_AREA)), &scatter),
                false,
            );
            assert_eq!(
                (s.opcode, s.byte_len as usize),
                (WcOpcode::RdmaRead, len),
                "Read {what}"
            );
            assert_eq!(
                read_split(&dst, 0, len, parts),
                data,
                "Write then Read {what}"
            );

            // RDMA Write with Immediate: the child echoes what landed in its memory.
            let data2 = pattern(len, seed ^ 0xFF);
            write_split(&src, 0, &data2, parts);
            let imm = 0x8000_0000 | len as u32;
            wr_id += 1;
            let (s, r) = exchange(
                &mut conn,
                &mut cq,
                &SendWr::new(
                    wr_id,
                    SendOp::RdmaWriteWithImm(remote.offset(WRITE_AREA), imm),
                    &gather,
                ),
                true,
            );
            assert_eq!(s.opcode, WcOpcode::RdmaWrite);
            let r = r.unwrap();
            assert_eq!(
                (r.byte_len as usize, r.imm_data),
                (len, Some(!imm)),
                "Write with Imm {what}"
            );
            assert_eq!(echoed(len), data2, "Write with Imm {what}");

            // RDMA Read of the child's pre-filled area, from an odd offset.
            dst.write_at(0, &vec![0xEE; 64 << 10][..]).unwrap();
            wr_id += 1;
            let (s, _) = exchange(
                &mut conn,
                &mut cq,
                &SendWr::new(
                    wr_id,
                    SendOp::RdmaRead(remote.offset(READ_AREA + 3)),
                    &scatter,
                ),
                false,
            );
            assert_eq!(s.byte_len as usize, len);
            assert_eq!(
                read_split(&dst, 0, len, parts),
                &read_area[3..3 + len],
                "Read {what}"
            );
        }
    }

    // Inline data.
    wr_id += 1;
    let (_, r) = exchange(
        &mut conn,
        &mut cq,
        &SendWr::inline(wr_id, SendOp::Send, b"inline bytes, copied at post time"),
        true,
    );
    assert_eq!(r.unwrap().byte_len, 33);
    assert_eq!(echoed(33), b"inline bytes, copied at post time");

    // Atomics on the child's word (zero at start).
    let atomics = [
        (
            SendOp::FetchAdd {
                remote: remote.offset(ATOMIC_WORD),
                add: 5,
            },
            0u64,
            WcOpcode::FetchAdd,
        ),
        (
            SendOp::FetchAdd {
                remote: remote.offset(ATOMIC_WORD),
                add: 7,
            },
            5,
            WcOpcode::FetchAdd,
        ),
        (
            SendOp::CompareSwap {
                remote: remote.offset(ATOMIC_WORD),
                compare: 12,
                swap: 99,
            },
            12,
            WcOpcode::CompSwap,
        ),
        (
            SendOp::CompareSwap {
                remote: remote.offset(ATOMIC_WORD),
                compare: 1,
                swap: 5,
            },
            99,
            WcOpcode::CompSwap,
        ),
    ];
    for (op, original, opcode) in atomics {
        wr_id += 1;
        let sgl = [word.sge(0, 8).unwrap()];
        let (s, _) = exchange(&mut conn, &mut cq, &SendWr::new(wr_id, op, &sgl), false);
        assert_eq!(s.opcode, opcode);
        assert_eq!(word.load_u64(0).unwrap(), original, "{op:?}");
    }
    wr_id += 1;
    let sgl = [word.sge(0, 8).unwrap()];
    exchange(
        &mut conn,
        &mut cq,
        &SendWr::new(wr_id, SendOp::RdmaRead(remote.offset(ATOMIC_WORD)), &sgl),
        false,
    );
    assert_eq!(
        word.load_u64(0).unwrap(),
        99,
        "the failed compare left the word alone"
    );

    // Quit: the child closes its connection and exits.
    wr_id += 1;
    exchange(
        &mut conn,
        &mut cq,
        &SendWr::new(wr_id, SendOp::SendWithImm(QUIT), &[]),
        false,
    );
    peer.expect_success();
    eventually("the QP notices the peer has gone", || {
        !conn.is_peer_connected()
    });
    assert!(conn.peer_gone_reason().is_some());
    assert_eq!(ctx.cm_links().len(), 1);
    assert!(
        !ctx.cm_links()[0].up,
        "the link is torn down with its last live connection"
    );
    drop(conn);
    assert!(
        ctx.cm_links().is_empty(),
        "the link is removed with its last connection"
    );
    drop(listener);
    assert!(!exists(&path), "the listener removes its socket");
    dir.assert_empty_and_remove();
    assert_eq!(dev_shm_entries(), shm_before);
}

/// The child: connects, reads and writes the parent's region, then echoes until told to
/// quit.
fn echo_client(path: &str) {
    let ctx = context(32 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(1024).unwrap();
    let big = pd.alloc_mr(256 << 10, AccessFlags::ALL).unwrap();
    big.write_at(READ_AREA, &pattern(64 << 10, READ_SEED))
        .unwrap();
    let rbuf = pd.alloc_mr(SLOT * SLOTS, AccessFlags::LOCAL_WRITE).unwrap();
    let tmp = pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
    let params = ConnectParams::default()
        .mtu(Mtu::Mtu1024)
        .caps(caps(2))
        .private_data(big.remote(0).to_bytes().to_vec());
    let mut conn = ctx.connect(path, &pd, &cq, &cq, &params).unwrap();
    assert_eq!(conn.config().path_mtu, Mtu::Mtu1024);
    assert_eq!(conn.peer_caps(), caps(4));
    let parent = RemoteAddr::from_bytes(conn.peer_private_data().try_into().expect("12 bytes"));

    let post_slot = |conn: &mut Connection, slot: u64| {
        let base = slot * SLOT;
        let sgl = [
            rbuf.sge(base, HEAD as u32).unwrap(),
            rbuf.sge(base + HEAD, (SLOT - HEAD) as u32).unwrap(),
        ];
        conn.post_recv(&RecvWr::new(slot, &sgl)).unwrap();
    };
    for slot in 0..SLOTS {
        post_slot(&mut conn, slot);
    }

    // Read the parent's first half, write its second half, say ready.
    let sgl = [tmp.sge(0, 4096).unwrap()];
    conn.post_send(&SendWr::new(1, SendOp::RdmaRead(parent), &sgl))
        .unwrap();
    assert_eq!(wait(&mut cq, 1)[0].status, WcStatus::Success);
    let mut got = vec![0u8; 4096];
    tmp.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(4096, 11), "RDMA Read of the parent's memory");
    tmp.write_at(4096, &pattern(4096, 0x33)).unwrap();
    let sgl = [tmp.sge(4096, 4096).unwrap()];
    conn.post_send(&SendWr::new(
        2,
        SendOp::RdmaWrite(parent.offset(4096)),
        &sgl,
    ))
    .unwrap();
    assert_eq!(wait(&mut cq, 1)[0].status, WcStatus::Success);
    // Its completion may come after the parent's first message: the loop takes it.
    conn.post_send(&SendWr::new(3, SendOp::SendWithImm(READY), &[]))
        .unwrap();

    loop {
        let wc = wait(&mut cq, 1)[0];
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        match wc.opcode {
            WcOpcode::Recv if wc.imm_data == Some(QUIT) => break,
            WcOpcode::Recv => {
                // Echo the received bytes from the slot's own two elements.
                let len = wc.byte_len;
                let base = wc.wr_id * SLOT;
                let head = len.min(HEAD as u32);
                let mut sgl = Vec::new();
                if head > 0 {
                    sgl.push(rbuf.sge(base, head).unwrap());
                }
                if len > head {
                    sgl.push(rbuf.sge(base + HEAD, len - head).unwrap());
                }
                let imm = wc.imm_data.map_or(len, |i| !i);
                conn.post_send(&SendWr::new(
                    1000 + wc.wr_id,
                    SendOp::SendWithImm(imm),
                    &sgl,
                ))
                .unwrap();
            }
            WcOpcode::RecvRdmaWithImm => {
                let imm = wc.imm_data.expect("immediate data");
                let len = imm & 0xffff;
                assert_eq!(
                    wc.byte_len, len,
                    "a Write with Immediate reports its length"
                );
                let sgl = if len > 0 {
                    vec![big.sge(WRITE_AREA, len).unwrap()]
                } else {
                    Vec::new()
                };
                conn.post_send(&SendWr::new(2000, SendOp::SendWithImm(!imm), &sgl))
                    .unwrap();
                post_slot(&mut conn, wc.wr_id);
            }
            // "ready" and the echoes of Writes hold no receive slot.
            WcOpcode::Send if wc.wr_id == 3 || wc.wr_id >= 2000 => {}
            WcOpcode::Send => post_slot(&mut conn, wc.wr_id - 1000),
            other => panic!("unexpected completion {other:?}: {wc:?}"),
        }
    }
}
