//! A protection domain over the application's memfd (`Context::alloc_pd_over`) connected
//! to another process through the connection manager: the REQ/REP say the arena has no
//! header, the peer maps the memfd read-only (checking its seals), and every byte moves
//! in place — a Send from the memfd, a peer's RDMA Read of it, a peer's RDMA Write into
//! it — with the owner reading and writing only through its own mapping.
mod cm_support;

use cm_support::*;
use shmhca::*;

const TEST: &str = "a_memfd_domain_serves_another_process_in_place";
const QUIT: u32 = 0x0D0E_0F00;
/// The memfd: 256 KiB of the application's data, then 128 KiB of staging for shmhca.
const USER: usize = 256 << 10;
const STAGING: u64 = 128 << 10;
const CHUNK: usize = 64 << 10;

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    }
}

#[test]
fn a_memfd_domain_serves_another_process_in_place() {
    if let Some((role, arg)) = role() {
        assert_eq!(role, "child");
        return child(&arg);
    }
    let _serial = serial();
    let dir = SockDir::new("memfdpd");
    let path = dir.sock("memfdpd.sock");
    let fd = rustix::fs::memfd_create(
        "shmhca-memfd-pd",
        rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
    )
    .unwrap();
    rustix::fs::ftruncate(&fd, USER as u64 + STAGING).unwrap();
    let file = std::fs::File::from(fd.try_clone().unwrap());
    // SAFETY: this test is the only writer of the mapping, and it reads the bytes the peer
    // wrote only after that Write completed (the peer's QUIT follows it).
    let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }.unwrap();
    map[..CHUNK].copy_from_slice(&pattern(CHUNK, 1));
    map[CHUNK..2 * CHUNK].copy_from_slice(&pattern(CHUNK, 2));

    let ctx = context(8 << 20);
    let pd = ctx.alloc_pd_over(fd, STAGING).unwrap();
    let mr = pd.reg_mr_at(0, USER as u64, AccessFlags::ALL).unwrap();
    let mut cq = ctx.create_cq(64).unwrap();
    let listener = ctx.listen(&path).unwrap();
    let peer = spawn_peer(TEST, "child", path.to_str().unwrap());
    let params = ConnectParams::default()
        .caps(caps())
        .private_data(mr.remote(0).to_bytes().to_vec());
    let mut conn = listener
        .accept_timeout(DEADLINE, &pd, &cq, &cq, &params)
        .unwrap();
    let copied_before = ctx.stats().payload_bytes_copied;
    conn.post_recv(&RecvWr::new(7, &[mr.sge(3 * CHUNK as u64, 64).unwrap()]))
        .unwrap();
    // A Send straight from the memfd.
    conn.post_send(&SendWr::new(
        1,
        SendOp::Send,
        &[mr.sge(0, CHUNK as u32).unwrap()],
    ))
    .unwrap();
    // The peer checks it, reads the second chunk, writes the third, then says QUIT.
    let wcs = wait(&mut cq, 2);
    for wc in &wcs {
        assert_eq!(wc.status, WcStatus::Success, "{wcs:?}");
    }
    let quit = wcs.iter().find(|w| w.opcode == WcOpcode::Recv).unwrap();
    assert_eq!(quit.imm_data, Some(QUIT));
    assert_eq!(
        &map[2 * CHUNK..3 * CHUNK],
        &pattern(CHUNK, 3)[..],
        "the peer's RDMA Write landed in the memfd, seen through the application's mapping"
    );
    assert_eq!(
        ctx.stats().payload_bytes_copied - copied_before,
        CHUNK as u64,
        "this engine copied only the peer's Write into the memfd (the one copy every byte \
         gets); the Send and the peer's Read were read by the peer straight from the memfd"
    );
    peer.expect_success();
    drop(conn);
    drop(listener);
    dir.assert_empty_and_remove();
}

fn child(path: &str) {
    let ctx = context(8 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(64).unwrap();
    let buf = pd
        .alloc_mr(3 * CHUNK as u64, AccessFlags::LOCAL_WRITE)
        .unwrap();
    let params = ConnectParams::default().caps(caps());
    let mut conn = ctx.connect(path, &pd, &cq, &cq, &params).unwrap();
    let remote = RemoteAddr::from_bytes(conn.peer_private_data().try_into().expect("12 bytes"));
    let mut got = vec![0u8; CHUNK];
    let ok = |wcs: Vec<WorkCompletion>| {
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    };

    conn.post_recv(&RecvWr::new(1, &[buf.sge(0, CHUNK as u32).unwrap()]))
        .unwrap();
    ok(wait(&mut cq, 1));
    buf.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(CHUNK, 1), "the Send from the memfd");

    let read = SendOp::RdmaRead(remote.offset(CHUNK as u64));
    conn.post_send(&SendWr::new(
        2,
        read,
        &[buf.sge(CHUNK as u64, CHUNK as u32).unwrap()],
    ))
    .unwrap();
    ok(wait(&mut cq, 1));
    buf.read_at(CHUNK as u64, &mut got).unwrap();
    assert_eq!(got, pattern(CHUNK, 2), "an RDMA Read of the memfd");

    buf.write_at(2 * CHUNK as u64, &pattern(CHUNK, 3)).unwrap();
    let write = SendOp::RdmaWrite(remote.offset(2 * CHUNK as u64));
    conn.post_send(&SendWr::new(
        3,
        write,
        &[buf.sge(2 * CHUNK as u64, CHUNK as u32).unwrap()],
    ))
    .unwrap();
    ok(wait(&mut cq, 1));
    conn.post_send(&SendWr::new(4, SendOp::SendWithImm(QUIT), &[]))
        .unwrap();
    ok(wait(&mut cq, 1));
    drop(conn);
}
