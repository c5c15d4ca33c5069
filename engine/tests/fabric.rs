//! The fabric (`shmhca::fabric`): contexts take LIDs in a rendezvous directory, swap LID and
//! QPN out of band, and go to RTR by LID or GID — in one process and between two; a peer
//! that comes after the RTR, one that never comes, stale lock files, a refused directory,
//! and a peer that leaves or is SIGKILLed (its QPs' next request fails at once; idle ones
//! stay as they are for the peer-loss grace, then go to Error).
mod cm_support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cm_support::*;
use shmhca::fabric::{self, FabricAddr};
use shmhca::*;

/// A private rendezvous directory (mode 0700), removed when dropped (after the contexts
/// in it: each removes its own files).
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let d = SockDir::new(&format!("fabric-{tag}"));
        std::fs::set_permissions(&d.path, std::fs::Permissions::from_mode(0o700)).unwrap();
        Dir(d.path)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A LID nobody holds in `dir`.
fn free_lid(dir: &Path, not: u16) -> u16 {
    (1..=fabric::MAX_LID)
        .find(|&l| l != not && !fabric::dir::lid_held(dir, l))
        .unwrap()
}

struct Side {
    ctx: Context,
    pd: Pd,
    cq: Cq,
    qp: Qp,
    buf: Mr,
}

fn side(ctx: Context) -> Side {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
    let buf = pd
        .alloc_mr(
            64 << 10,
            AccessFlags::LOCAL_WRITE
                | AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_ATOMIC,
        )
        .unwrap();
    Side {
        ctx,
        pd,
        cq,
        qp,
        buf,
    }
}

/// Init → RTR (by `rtr`'s destination) → RTS with a Local Ack Timeout of `timeout` and
/// `retries` retries.
fn connect(qp: &mut Qp, rtr: QpAttr, timeout: u8, retries: u8) -> Result<()> {
    qp.modify(&QpAttr::new(QpState::Init).access(
        AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
    ))?;
    rts(qp, rtr, timeout, retries)
}

/// Init → RTR → RTS.
fn rts(qp: &mut Qp, rtr: QpAttr, timeout: u8, retries: u8) -> Result<()> {
    qp.modify(
        &rtr.path_mtu(Mtu::Mtu4096)
            .rq_psn(0)
            .max_dest_rd_atomic(4)
            .min_rnr_timer(1),
    )?;
    qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(0)
            .timeout(timeout)
            .retry_cnt(retries)
            .rnr_retry(7)
            .max_rd_atomic(4),
    )
}

fn rtr() -> QpAttr {
    QpAttr::new(QpState::Rtr)
}

/// Posts `wr` on `qp` and waits for its completion.
fn post_wait(qp: &mut Qp, cq: &mut Cq, wr: &SendWr<'_>) -> WorkCompletion {
    qp.post_send(wr).unwrap();
    let w = wait(cq, 1)[0];
    assert_eq!(w.wr_id, wr.wr_id);
    w
}

/// Send, RDMA Write, RDMA Read and Fetch-and-Add from `a` to `b` (both set up), with `b`'s
/// region known.
fn exercise(a: &mut Side, b: &mut Side) {
    let data = pattern(5000, 3);
    a.buf.write_at(0, &data).unwrap();
    b.qp.post_recv(&RecvWr::new(1, &[b.buf.sge(0, 8192).unwrap()]))
        .unwrap();
    let sge = [a.buf.sge(0, 5000).unwrap()];
    assert_eq!(
        post_wait(&mut a.qp, &mut a.cq, &SendWr::new(10, SendOp::Send, &sge)).status,
        WcStatus::Success
    );
    let got = wait(&mut b.cq, 1)[0];
    assert_eq!((got.status, got.byte_len), (WcStatus::Success, 5000));
    let mut back = vec![0u8; 5000];
    b.buf.read_at(0, &mut back).unwrap();
    assert_eq!(back, data);

    let w = SendWr::new(11, SendOp::RdmaWrite(b.buf.remote(10_000)), &sge);
    assert_eq!(
        post_wait(&mut a.qp, &mut a.cq, &w).status,
        WcStatus::Success
    );
    b.buf.read_at(10_000, &mut back).unwrap();
    assert_eq!(back, data);

    b.buf.write_at(20_000, &pattern(3000, 9)).unwrap();
    let into = [a.buf.sge(30_000, 3000).unwrap()];
    let w = SendWr::new(12, SendOp::RdmaRead(b.buf.remote(20_000)), &into);
    assert_eq!(
        post_wait(&mut a.qp, &mut a.cq, &w).status,
        WcStatus::Success
    );
    let mut r = vec![0u8; 3000];
    a.buf.read_at(30_000, &mut r).unwrap();
    assert_eq!(r, pattern(3000, 9));

    b.buf.write_at(40_000, &7u64.to_le_bytes()).unwrap();
    let res = [a.buf.sge(40_000, 8).unwrap()];
    let add = SendOp::FetchAdd {
        remote: b.buf.remote(40_000),
        add: 5,
    };
    assert_eq!(
        post_wait(&mut a.qp, &mut a.cq, &SendWr::new(13, add, &res)).status,
        WcStatus::Success
    );
    let mut v = [0u8; 8];
    a.buf.read_at(40_000, &mut v).unwrap();
    assert_eq!(u64::from_le_bytes(v), 7, "the original value");
    b.buf.read_at(40_000, &mut v).unwrap();
    assert_eq!(u64::from_le_bytes(v), 12);
}

#[test]
fn two_contexts_go_to_rts_by_lid_and_by_gid_and_every_operation_works() {
    let dir = Dir::new("ops");
    let mut a = side(context(1 << 20));
    let mut b = side(context(1 << 20));
    let aa = a.ctx.join_fabric_in(&dir.0).unwrap();
    let ab = b.ctx.join_fabric_in(&dir.0).unwrap();
    assert_ne!(aa.lid, ab.lid);
    assert_eq!(aa.gid, fabric::gid_of_lid(aa.lid));
    assert_eq!(a.ctx.fabric_addr(), Some(aa));
    assert_eq!(a.ctx.join_fabric_in(&dir.0).unwrap(), aa, "joined once");
    let (na, nb) = (a.qp.qpn(), b.qp.qpn());
    // a by LID, b by GID.
    connect(&mut a.qp, rtr().dest_lid(ab.lid, nb), 14, 7).unwrap();
    connect(&mut b.qp, rtr().dest_gid(aa.gid, na), 14, 7).unwrap();
    exercise(&mut a, &mut b);
    exercise(&mut b, &mut a);
    // One link each way, made once and reused.
    assert_eq!(a.ctx.fabric_links().len(), 1, "{:?}", a.ctx.fabric_links());
    assert_eq!(b.ctx.fabric_links().len(), 1);
    assert!(a.ctx.fabric_links()[0].attached && a.ctx.fabric_links()[0].up);
    // A second pair of QPs between the same engines reuses the link.
    let mut a2 = a
        .ctx
        .create_qp(&a.pd, &a.cq, &a.cq, QpCaps::default())
        .unwrap();
    let mut b2 = b
        .ctx
        .create_qp(&b.pd, &b.cq, &b.cq, QpCaps::default())
        .unwrap();
    let (na2, nb2) = (a2.qpn(), b2.qpn());
    connect(&mut a2, rtr().dest_lid(ab.lid, nb2), 14, 7).unwrap();
    connect(&mut b2, rtr().dest_lid(aa.lid, na2), 14, 7).unwrap();
    assert_eq!(a.ctx.fabric_links().len(), 1);
    assert_eq!(b.ctx.fabric_links().len(), 1);
    assert_eq!(
        a2.config().dest,
        a.qp.config().dest.map(|d| Destination {
            link: d.link,
            qpn: nb2
        })
    );
}

#[test]
fn poll_mode_engines_work_and_a_dropped_peer_leaves_an_idle_qp_as_it_is() {
    let dir = Dir::new("poll");
    // No grace: the QP stays as it is for as long as the test looks.
    let poll = || {
        Context::builder()
            .arena_size(1 << 20)
            .huge_pages(shmhca_rings::HugePages::Never)
            .mode(EngineMode::Poll { cpu: None })
            .peer_loss_grace(None)
            .build()
            .unwrap()
    };
    let mut a = side(poll());
    let mut b = side(context(1 << 20)); // one of each mode
    let aa = a.ctx.join_fabric_in(&dir.0).unwrap();
    let ab = b.ctx.join_fabric_in(&dir.0).unwrap();
    let (na, nb) = (a.qp.qpn(), b.qp.qpn());
    connect(&mut a.qp, rtr().dest_lid(ab.lid, nb), 14, 7).unwrap();
    connect(&mut b.qp, rtr().dest_lid(aa.lid, na), 14, 7).unwrap();
    exercise(&mut a, &mut b);
    exercise(&mut b, &mut a);
    a.qp.post_recv(&RecvWr::new(77, &[a.buf.sge(0, 64).unwrap()]))
        .unwrap();
    // b goes away (its QP, its regions, its context). Without a grace, as in InfiniBand,
    // nothing tells a's QP: it stays in RTS with its receive posted.
    drop(b);
    eventually("the link is down", || {
        !a.ctx.fabric_links().iter().any(|l| l.up)
    });
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(a.qp.state(), QpState::Rts, "{:?}", a.qp.last_error());
    assert!(
        a.cq.poll(&mut [WorkCompletion::default(); 4]) == 0,
        "no completion for an idle QP whose peer left"
    );
    // A request then fails as its retries would (at once: no answer can come), and the
    // QP's receive is flushed behind it.
    a.qp.post_send(&SendWr::new(5, SendOp::Send, &[])).unwrap();
    let wcs = wait(&mut a.cq, 2);
    let send = wcs.iter().find(|w| w.wr_id == 5).unwrap();
    let recv = wcs.iter().find(|w| w.wr_id == 77).unwrap();
    assert_eq!(send.status, WcStatus::RetryExcErr);
    assert_eq!(recv.status, WcStatus::WrFlushErr);
    assert_eq!(a.qp.state(), QpState::Error);
    let why = a.qp.last_error().unwrap_or_default();
    assert!(why.contains("peer"), "{why}");
    eventually("b's LID files are removed", || {
        !exists(&fabric::dir::lock_path(&dir.0, ab.lid))
    });
}

#[test]
fn a_request_outstanding_when_the_peer_leaves_fails_with_retry_exceeded_at_once() {
    let dir = Dir::new("leave");
    let mut a = side(context(1 << 20));
    let b = side(context(1 << 20));
    let aa = a.ctx.join_fabric_in(&dir.0).unwrap();
    let ab = b.ctx.join_fabric_in(&dir.0).unwrap();
    let mut bq = b.qp;
    // The longest Local Ack Timeout (about 2.4 hours per try) and RNR retries without
    // end: only the link going down can end the request within the test.
    connect(&mut a.qp, rtr().dest_lid(ab.lid, bq.qpn()), 31, 7).unwrap();
    connect(&mut bq, rtr().dest_lid(aa.lid, a.qp.qpn()), 31, 7).unwrap();
    a.qp.post_recv(&RecvWr::new(1, &[a.buf.sge(0, 64).unwrap()]))
        .unwrap();
    // b posts no receive: the Send waits (for an RNR retry, or for room) until b leaves.
    a.qp.post_send(&SendWr::new(2, SendOp::Send, &[a.buf.sge(0, 8).unwrap()]))
        .unwrap();
    drop((bq, b.buf, b.cq, b.pd, b.ctx));
    let mut wcs = wait(&mut a.cq, 2);
    wcs.sort_by_key(|w| w.wr_id);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (1, WcStatus::WrFlushErr));
    assert_eq!((wcs[1].wr_id, wcs[1].status), (2, WcStatus::RetryExcErr));
    assert_eq!(a.qp.state(), QpState::Error);
    let why = a.qp.last_error().unwrap_or_default();
    assert!(why.contains("the link to the peer is down"), "{why}");
}

#[test]
fn many_qps_going_to_rtr_at_once_from_both_sides_share_one_link() {
    // Both LID orders: either side may be the one that makes the link.
    for (la, lb) in [(10, 20), (20, 10)] {
        let dir = Dir::new("race");
        let (ca, cb) = (context(4 << 20), context(4 << 20));
        ca.join_fabric_as(&dir.0, la).unwrap();
        cb.join_fabric_as(&dir.0, lb).unwrap();
        let (pa, pb) = (ca.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
        let (qa_cq, qb_cq) = (ca.create_cq(256).unwrap(), cb.create_cq(256).unwrap());
        let caps = QpCaps {
            max_inline_data: 0,
            ..QpCaps::default()
        };
        let qas: Vec<Qp> = (0..6)
            .map(|_| ca.create_qp(&pa, &qa_cq, &qa_cq, caps).unwrap())
            .collect();
        let qbs: Vec<Qp> = (0..6)
            .map(|_| cb.create_qp(&pb, &qb_cq, &qb_cq, caps).unwrap())
            .collect();
        let (na, nb): (Vec<Qpn>, Vec<Qpn>) = (
            qas.iter().map(|q| q.qpn()).collect(),
            qbs.iter().map(|q| q.qpn()).collect(),
        );
        // Each QP goes to RTS in a thread of its own, all at once.
        let mut threads = Vec::new();
        for (i, mut q) in qas.into_iter().enumerate() {
            let peer = nb[i];
            threads.push(std::thread::spawn(move || {
                connect(&mut q, rtr().dest_lid(lb, peer), 14, 7).map(|()| q)
            }));
        }
        for (i, mut q) in qbs.into_iter().enumerate() {
            let peer = na[i];
            threads.push(std::thread::spawn(move || {
                connect(&mut q, rtr().dest_gid(fabric::gid_of_lid(la), peer), 14, 7).map(|()| q)
            }));
        }
        let mut qps: Vec<Qp> = threads
            .into_iter()
            .map(|t| t.join().unwrap().unwrap())
            .collect();
        for c in [&ca, &cb] {
            let links = c.fabric_links();
            assert_eq!(links.len(), 1, "one link per pair of engines: {links:?}");
            assert!(links[0].attached && links[0].up);
        }
        // Every pair talks: an empty Send with immediate data, the smallest message that
        // completes on both sides.
        let (qa_cq, qb_cq) = (&mut { qa_cq }, &mut { qb_cq });
        let (qas, qbs) = qps.split_at_mut(6);
        for (qa, qb) in qas.iter_mut().zip(qbs.iter_mut()) {
            qb.post_recv(&RecvWr::new(1, &[])).unwrap();
            qa.post_send(&SendWr::new(2, SendOp::SendWithImm(7), &[]))
                .unwrap();
            assert_eq!(wait(qb_cq, 1)[0].status, WcStatus::Success);
            assert_eq!(wait(qa_cq, 1)[0].status, WcStatus::Success);
        }
        drop(qps);
    }
}

#[test]
fn garbage_and_stalled_clients_on_the_socket_hold_nobody_up() {
    use std::io::Write;
    let dir = Dir::new("hostile");
    let mut a = side(context(1 << 20));
    let mut b = side(context(1 << 20));
    let aa = a.ctx.join_fabric_in(&dir.0).unwrap();
    let ab = b.ctx.join_fabric_in(&dir.0).unwrap();
    let sock = fabric::dir::sock_path(&dir.0, ab.lid);
    // Clients that connect and say nothing, and one that sends garbage.
    let stalled: Vec<_> = (0..4)
        .map(|_| std::os::unix::net::UnixStream::connect(&sock).unwrap())
        .collect();
    let mut junk = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    junk.write_all(&[0xa5; 48]).unwrap();
    let mut hello_then_junk = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    hello_then_junk.write_all(b"SHMHCAFB\x01\x00\x01").unwrap();
    // The real peers are served all the same.
    let (na, nb) = (a.qp.qpn(), b.qp.qpn());
    connect(&mut a.qp, rtr().dest_lid(ab.lid, nb), 14, 7).unwrap();
    connect(&mut b.qp, rtr().dest_lid(aa.lid, na), 14, 7).unwrap();
    exercise(&mut a, &mut b);
    // The garbage was answered by closing the socket.
    junk.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut buf = [0u8; 64];
    assert_eq!(std::io::Read::read(&mut junk, &mut buf).unwrap(), 0);
    drop(stalled);
}

#[test]
fn fabric_destinations_are_checked() {
    let dir = Dir::new("checks");
    let mut a = side(context(1 << 20));
    a.qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::NONE))
        .unwrap();
    let attr = rtr()
        .path_mtu(Mtu::Mtu1024)
        .rq_psn(0)
        .max_dest_rd_atomic(1)
        .min_rnr_timer(1);
    // Not on the fabric yet.
    let e = a.qp.modify(&attr.dest_lid(5, Qpn::new(0x100))).unwrap_err();
    assert!(e.to_string().contains("join_fabric"), "{e}");
    a.ctx.join_fabric_in(&dir.0).unwrap();
    for (bad, what) in [
        (attr.dest_lid(0, Qpn::new(0x100)), "unicast"),
        (attr.dest_lid(0xc001, Qpn::new(0x100)), "unicast"),
        (
            attr.dest_gid(
                std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped().octets(),
                Qpn::new(0x100),
            ),
            "not a shmhca fabric GID",
        ),
    ] {
        let e = a.qp.modify(&bad).unwrap_err();
        assert!(e.to_string().contains(what), "{e}");
        assert_eq!(a.qp.state(), QpState::Init);
    }
    // Another directory for a context on the fabric already.
    let other = Dir::new("checks-other");
    assert!(a.ctx.join_fabric_in(&other.0).is_err());
}

#[test]
fn an_rtr_before_the_peer_exists_is_served_when_it_appears() {
    // The late peer's LID below and above the waiting side's: either may make links.
    for (mine, later) in [(300, 200), (300, 400)] {
        let dir = Dir::new("later");
        let mut a = side(context(1 << 20));
        let mut b = side(context(1 << 20)); // its QP exists; its engine is not on the fabric yet
        let aa = a.ctx.join_fabric_as(&dir.0, mine).unwrap();
        assert!(!fabric::dir::lid_held(&dir.0, later));
        let nb = b.qp.qpn();
        connect(&mut a.qp, rtr().dest_lid(later, nb), 14, 7).unwrap();
        assert_eq!(a.qp.state(), QpState::Rts, "{:?}", a.qp.last_error());
        let links = a.ctx.fabric_links();
        assert!(
            links.len() == 1 && !links[0].attached && links[0].up,
            "{links:?}"
        );
        let data = pattern(3000, 1);
        a.buf.write_at(0, &data).unwrap();
        a.qp.post_send(&SendWr::new(
            1,
            SendOp::Send,
            &[a.buf.sge(0, 3000).unwrap()],
        ))
        .unwrap();
        // Nobody reads the link yet: nothing completes.
        assert!(drain_for(&mut a.cq, Duration::from_millis(30)).is_empty());
        assert_eq!(
            b.ctx.join_fabric_as(&dir.0, later).unwrap(),
            FabricAddr {
                lid: later,
                gid: fabric::gid_of_lid(later)
            }
        );
        connect(&mut b.qp, rtr().dest_lid(aa.lid, a.qp.qpn()), 14, 7).unwrap();
        b.qp.post_recv(&RecvWr::new(2, &[b.buf.sge(0, 4096).unwrap()]))
            .unwrap();
        let got = wait(&mut b.cq, 1)[0];
        assert_eq!((got.status, got.byte_len), (WcStatus::Success, 3000));
        let mut back = vec![0u8; 3000];
        b.buf.read_at(0, &mut back).unwrap();
        assert_eq!(back, data);
        assert_eq!(wait(&mut a.cq, 1)[0].status, WcStatus::Success);
        // Both ways, and the other operations, over the link that waited.
        exercise(&mut b, &mut a);
        exercise(&mut a, &mut b);
        let links = a.ctx.fabric_links();
        assert!(links.len() == 1 && links[0].attached, "{links:?}");
    }
}

#[test]
fn a_lid_nobody_ever_takes_ends_in_retry_exceeded() {
    let dir = Dir::new("never");
    let mut a = side(context(1 << 20));
    let aa = a.ctx.join_fabric_in(&dir.0).unwrap();
    let nobody = free_lid(&dir.0, aa.lid);
    // Ttr = 4.096 µs × 2^10 ≈ 4 ms, one retry.
    connect(&mut a.qp, rtr().dest_lid(nobody, Qpn::new(0x1234)), 10, 1).unwrap();
    a.qp.post_send(&SendWr::new(9, SendOp::Send, &[a.buf.sge(0, 100).unwrap()]))
        .unwrap();
    let w = wait(&mut a.cq, 1)[0];
    assert_eq!((w.wr_id, w.status), (9, WcStatus::RetryExcErr));
    assert_eq!(a.qp.state(), QpState::Error);
}

#[test]
fn a_stale_lock_file_is_reclaimed_and_a_loose_directory_refused() {
    let dir = Dir::new("stale");
    // A lock file a dead process left (nobody holds its lock), with its socket file.
    let lid = 77;
    std::fs::write(fabric::dir::lock_path(&dir.0, lid), b"").unwrap();
    std::fs::write(fabric::dir::sock_path(&dir.0, lid), b"").unwrap();
    assert!(!fabric::dir::lid_held(&dir.0, lid));
    let a = context(1 << 20);
    assert_eq!(a.join_fabric_as(&dir.0, lid).unwrap().lid, lid);
    assert!(fabric::dir::lid_held(&dir.0, lid));
    let b = context(1 << 20);
    let e = b.join_fabric_as(&dir.0, lid).unwrap_err();
    assert!(e.to_string().contains("held"), "{e}");
    drop(a);
    // The fabric thread removes the files once the context is gone.
    eventually("the LID's files are removed", || {
        !exists(&fabric::dir::lock_path(&dir.0, lid))
            && !exists(&fabric::dir::sock_path(&dir.0, lid))
    });
    assert_eq!(b.join_fabric_as(&dir.0, lid).unwrap().lid, lid);
    drop(b);

    let loose = Dir::new("loose");
    std::fs::set_permissions(&loose.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let e = context(1 << 20).join_fabric_in(&loose.0).unwrap_err();
    assert!(e.to_string().contains("chmod 700"), "{e}");
    let entries = std::fs::read_dir(&loose.0).unwrap().count();
    assert_eq!(entries, 0, "nothing was created in a refused directory");
}

// ---- Two processes ----

/// Writes `text` to `dir/name` so that a reader never sees it half-written.
fn publish(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!("{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

/// Reads `dir/name` once it exists.
fn fetch(dir: &Path, name: &str) -> Vec<u64> {
    let start = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(dir.join(name)) {
            return s.split_whitespace().map(|w| w.parse().unwrap()).collect();
        }
        assert!(start.elapsed() < DEADLINE, "{name} never came");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The out-of-band exchange of a verbs program, through files in the test's directory:
/// LID, QPN, and the address and R_Key of the buffer.
fn swap(dir: &Path, me: &str, peer: &str, s: &Side) -> Vec<u64> {
    let addr = s.ctx.fabric_addr().unwrap();
    publish(
        dir,
        me,
        &format!(
            "{} {} {} {}",
            addr.lid,
            s.qp.qpn().get(),
            s.buf.addr(),
            s.buf.rkey()
        ),
    );
    fetch(dir, peer)
}

const TWO_OPS: &str = "two_processes_swap_lids_and_run_every_operation";

#[test]
fn two_processes_swap_lids_and_run_every_operation() {
    if let Some((role, arg)) = role() {
        assert_eq!(role, "client");
        let dir = PathBuf::from(arg);
        let mut c = side(context(1 << 20));
        c.ctx.join_fabric_in(&dir).unwrap();
        let p = swap(&dir, "client", "server", &c);
        let gid = fabric::gid_of_lid(p[0] as u16);
        connect(&mut c.qp, rtr().dest_gid(gid, Qpn::new(p[1] as u32)), 14, 7).unwrap();
        let remote = |off: u64| RemoteAddr {
            addr: p[2] + off,
            rkey: p[3] as u32,
        };
        let data = pattern(6000, 4);
        c.buf.write_at(0, &data).unwrap();
        let sge = [c.buf.sge(0, 6000).unwrap()];
        let w = SendWr::new(1, SendOp::RdmaWrite(remote(0)), &sge);
        assert_eq!(
            post_wait(&mut c.qp, &mut c.cq, &w).status,
            WcStatus::Success
        );
        let into = [c.buf.sge(10_000, 6000).unwrap()];
        let w = SendWr::new(2, SendOp::RdmaRead(remote(0)), &into);
        assert_eq!(
            post_wait(&mut c.qp, &mut c.cq, &w).status,
            WcStatus::Success
        );
        let mut back = vec![0u8; 6000];
        c.buf.read_at(10_000, &mut back).unwrap();
        assert_eq!(back, data, "read back what was written");
        let res = [c.buf.sge(20_000, 8).unwrap()];
        let add = SendOp::FetchAdd {
            remote: remote(8192),
            add: 3,
        };
        assert_eq!(
            post_wait(&mut c.qp, &mut c.cq, &SendWr::new(3, add, &res)).status,
            WcStatus::Success
        );
        let w = SendWr::new(4, SendOp::Send, &sge);
        assert_eq!(
            post_wait(&mut c.qp, &mut c.cq, &w).status,
            WcStatus::Success
        );
        // The server's message to us.
        c.qp.post_recv(&RecvWr::new(5, &[c.buf.sge(30_000, 100).unwrap()]))
            .unwrap();
        let got = wait(&mut c.cq, 1)[0];
        assert_eq!((got.status, got.byte_len), (WcStatus::Success, 4));
        let mut bye = [0u8; 4];
        c.buf.read_at(30_000, &mut bye).unwrap();
        assert_eq!(&bye, b"done");
        // Stay until the server saw our Ack of it.
        let _ = fetch(&dir, "server-done");
        return;
    }
    let _serial = serial();
    let dir = Dir::new("two");
    let mut s = side(context(1 << 20));
    s.ctx.join_fabric_in(&dir.0).unwrap();
    s.buf.write_at(8192, &40u64.to_le_bytes()).unwrap();
    let peer = spawn_peer(TWO_OPS, "client", dir.0.to_str().unwrap());
    s.qp.modify(
        &QpAttr::new(QpState::Init).access(
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
        ),
    )
    .unwrap();
    // Posted in Init, before the client can send.
    s.qp.post_recv(&RecvWr::new(1, &[s.buf.sge(16_384, 8192).unwrap()]))
        .unwrap();
    let p = swap(&dir.0, "server", "client", &s);
    rts(
        &mut s.qp,
        rtr().dest_lid(p[0] as u16, Qpn::new(p[1] as u32)),
        14,
        7,
    )
    .unwrap();
    let got = wait(&mut s.cq, 1)[0];
    assert_eq!((got.status, got.byte_len), (WcStatus::Success, 6000));
    let mut back = vec![0u8; 6000];
    s.buf.read_at(0, &mut back).unwrap();
    assert_eq!(back, pattern(6000, 4), "the RDMA Write");
    s.buf.read_at(16_384, &mut back).unwrap();
    assert_eq!(back, pattern(6000, 4), "the Send");
    let mut v = [0u8; 8];
    s.buf.read_at(8192, &mut v).unwrap();
    assert_eq!(u64::from_le_bytes(v), 43, "the Fetch-and-Add");
    s.buf.write_at(100, b"done").unwrap();
    let sge = [s.buf.sge(100, 4).unwrap()];
    let w = SendWr::new(2, SendOp::Send, &sge);
    assert_eq!(
        post_wait(&mut s.qp, &mut s.cq, &w).status,
        WcStatus::Success
    );
    publish(&dir.0, "server-done", "1");
    peer.expect_success();
}

const TWO_KILL: &str = "a_sigkilled_peer_moves_the_qp_to_error_after_the_grace";

#[test]
fn a_sigkilled_peer_moves_the_qp_to_error_after_the_grace() {
    if let Some((_, arg)) = role() {
        let dir = PathBuf::from(arg);
        let mut c = side(context(1 << 20));
        c.ctx.join_fabric_in(&dir).unwrap();
        let p = swap(&dir, "doomed", "survivor", &c);
        connect(
            &mut c.qp,
            rtr().dest_lid(p[0] as u16, Qpn::new(p[1] as u32)),
            14,
            7,
        )
        .unwrap();
        let w = SendWr::new(1, SendOp::SendWithImm(0xdead), &[]);
        assert_eq!(
            post_wait(&mut c.qp, &mut c.cq, &w).status,
            WcStatus::Success
        );
        // Keep the engine running until killed (bounded, in case the parent died).
        let start = Instant::now();
        while start.elapsed() < DEADLINE {
            let _ = c.cq.poll(&mut [WorkCompletion::default(); 4]);
            std::thread::sleep(Duration::from_millis(1));
        }
        return;
    }
    let _serial = serial();
    let dir = Dir::new("kill");
    let mut s = side(context(1 << 20));
    s.ctx.join_fabric_in(&dir.0).unwrap();
    let peer = spawn_peer(TWO_KILL, "doomed", dir.0.to_str().unwrap());
    let p = swap(&dir.0, "survivor", "doomed", &s);
    connect(
        &mut s.qp,
        rtr().dest_lid(p[0] as u16, Qpn::new(p[1] as u32)),
        14,
        7,
    )
    .unwrap();
    for i in 0..4u64 {
        s.qp.post_recv(&RecvWr::new(i, &[s.buf.sge(i * 1024, 1024).unwrap()]))
            .unwrap();
    }
    let ready = wait(&mut s.cq, 1)[0];
    assert_eq!(
        (ready.status, ready.imm_data),
        (WcStatus::Success, Some(0xdead))
    );
    assert!(s.ctx.fabric_links()[0].up, "up");
    let killed = Instant::now();
    peer.kill();
    // The default grace: the idle QP goes to the Error state within a second of the
    // hang-up (not at once: a ping-pong whose peer exits after its last message finishes
    // its loop first), and its receives are flushed.
    let mut wcs = wait(&mut s.cq, 3);
    let took = killed.elapsed();
    eprintln!("3 receives flushed {took:?} after SIGKILL");
    wcs.sort_by_key(|w| w.wr_id);
    for w in &wcs {
        assert_eq!(w.status, WcStatus::WrFlushErr, "{w:?}");
    }
    assert_eq!(s.qp.state(), QpState::Error);
    let why = s.qp.last_error().unwrap_or_default();
    assert!(why.contains("the peer is gone"), "{why}");
    // And the context hears it as a fatal error of that QP (IBV_EVENT_QP_FATAL).
    assert_eq!(
        s.ctx.get_async_event(Some(Duration::from_secs(5))).unwrap(),
        Some(AsyncEvent::QpFatal { qpn: s.qp.qpn() })
    );
    assert!(
        !s.ctx.fabric_links().iter().any(|l| l.up),
        "the link is down"
    );
    assert!(
        took >= fabric::DEFAULT_PEER_LOSS_GRACE,
        "{took:?}: no grace"
    );
    // Generous for a busy machine; the watcher sees the hang-up within milliseconds.
    assert!(took < Duration::from_secs(20), "{took:?}");
}
