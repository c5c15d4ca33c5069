//! Attacks on memory windows, shared receive queues and registered application memory, by
//! a peer that completed the handshake honestly (it uses the verbs to send whatever keys,
//! addresses and lengths it likes) and by a careless application using the safe API.
//!
//! Each test names the promise of the README's security model it checks: a peer writes my
//! memory only through an R_Key I granted with remote write, reads only what I granted,
//! and cannot crash, hang or bloat me.
mod common;

use common::*;
use shmhca::*;

fn rights() -> AccessFlags {
    AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC
}

fn read_mr(mr: &Mr, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mr.read_at(off, &mut v).unwrap();
    v
}

/// Runs `op` from A with the first `len` bytes of `buf` and returns its completion.
fn run_a(p: &mut Pair, op: SendOp, buf: &Mr, len: u32) -> WorkCompletion {
    let sgl = [buf.sge(0, len).unwrap()];
    p.a.qp.post_send(&SendWr::new(1, op, &sgl)).unwrap();
    wait_a(p, 1)[0]
}

/// A's source buffer: 8 KiB of a pattern.
fn a_buf(p: &Pair) -> Mr {
    let mr = p.a.pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
    mr.write_at(0, &pattern(8192, 99)).unwrap();
    mr
}

/// Registers and drops regions of `len` bytes in `pd` until one gets `key` (the 8-bit
/// generation of a region key wraps after 255 registrations); returns it, registered
/// with `access`.
fn region_with_key(pd: &Pd, len: u64, access: AccessFlags, key: u32) -> Mr {
    for _ in 0..1024 {
        let mr = pd.alloc_mr(len, access).unwrap();
        if mr.rkey() == key {
            return mr;
        }
    }
    panic!("no region got key {key:#x} again");
}

/// Promise: a peer writes my memory only through a key I granted with remote write.
///
/// The application binds a window over a region, then drops the region (allowed: it only
/// kills the window's key). Later it registers a local-only region, which by the wrap of
/// the key's generation gets the dropped region's key at the same address. The window
/// still naming that key must not reach the new region.
#[test]
fn a_window_of_a_dropped_region_never_reaches_a_later_region_with_the_same_key() {
    let mut p = pair(&Params::default());
    let access = AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE;
    let mr = p.b.pd.alloc_mr(4096, access).unwrap();
    let (old_key, addr) = (mr.rkey(), mr.addr());
    let mut mw = p.b.pd.alloc_mw(MwType::One).unwrap();
    let key =
        p.b.qp
            .bind_mw(
                &mut mw,
                5,
                mr.mw_bind(0, 4096, rights()),
                SendFlags::SIGNALED,
            )
            .unwrap();
    assert!(wait_b(&mut p, 1)[0].is_ok());
    drop(mr);
    // A private, local-only region (no remote rights, no MW_BIND).
    let victim = region_with_key(&p.b.pd, 4096, AccessFlags::LOCAL_WRITE, old_key);
    assert_eq!(victim.addr(), addr, "the same block again");
    victim.write_at(0, &[0xee; 64]).unwrap();
    let buf = a_buf(&p);
    let wc = run_a(
        &mut p,
        SendOp::RdmaWrite(RemoteAddr { addr, rkey: key }),
        &buf,
        64,
    );
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
    assert_eq!(read_mr(&victim, 0, 64), [0xee; 64], "nothing written");
}

/// A second connection between the pair's two contexts and domains.
fn second_connection(p: &Pair) -> (Qp, Qp) {
    let prm = Params::default();
    let mut qa =
        p.a.ctx
            .create_qp(&p.a.pd, &p.a.cq, &p.a.cq, QpCaps::default())
            .unwrap();
    let mut qb =
        p.b.ctx
            .create_qp(&p.b.pd, &p.b.cq, &p.b.cq, QpCaps::default())
            .unwrap();
    let (na, nb) = (qa.qpn(), qb.qpn());
    connect(&mut qa, p.a.link, nb, 10, 20, &prm);
    connect(&mut qb, p.b.link, na, 20, 10, &prm);
    (qa, qb)
}

/// Promise: a type 2 window is usable only by the peer of the QP it was bound to.
///
/// The QP goes away with the window still bound; a later QP of the same domain gets the
/// same QP number (the generation in a QPN wraps) and is connected to another peer. That
/// peer must not reach memory through the window.
#[test]
fn a_type_2_window_of_a_destroyed_qp_never_works_through_a_later_qp_with_its_number() {
    let mut p = pair(&Params::default());
    let access = AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE;
    let mr = p.b.pd.alloc_mr(4096, access).unwrap();
    mr.write_at(0, &[0xee; 64]).unwrap();
    let mw = p.b.pd.alloc_mw(MwType::Two).unwrap();
    let key = mw.rkey_with_tag(9);
    let (qa1, mut qb1) = second_connection(&p);
    let old_qpn = qb1.qpn();
    qb1.post_send(&SendWr::new(
        3,
        SendOp::BindMw {
            rkey: key,
            bind: mr.mw_bind(0, 4096, rights()),
        },
        &[],
    ))
    .unwrap();
    assert!(wait_b(&mut p, 1)[0].is_ok());
    drop(qb1);
    drop(qa1);
    // Later QPs of B's domain until one gets the old number.
    let mut qb2 = None;
    for _ in 0..5000 {
        let q =
            p.b.ctx
                .create_qp(&p.b.pd, &p.b.cq, &p.b.cq, QpCaps::default())
                .unwrap();
        if q.qpn() == old_qpn {
            qb2 = Some(q);
            break;
        }
    }
    let mut qb2 = qb2.expect("QP numbers wrap");
    let prm = Params::default();
    let mut qa2 =
        p.a.ctx
            .create_qp(&p.a.pd, &p.a.cq, &p.a.cq, QpCaps::default())
            .unwrap();
    connect(&mut qa2, p.a.link, qb2.qpn(), 10, 20, &prm);
    connect(&mut qb2, p.b.link, qa2.qpn(), 20, 10, &prm);
    let buf = a_buf(&p);
    let sgl = [buf.sge(0, 64).unwrap()];
    qa2.post_send(&SendWr::new(
        1,
        SendOp::RdmaWrite(RemoteAddr {
            addr: mr.addr(),
            rkey: key,
        }),
        &sgl,
    ))
    .unwrap();
    let wc = wait_a(&mut p, 1)[0];
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
    assert_eq!(read_mr(&mr, 0, 64), [0xee; 64], "nothing written");
}

/// Promise (of the safe API): bytes behind a `&mut [u8]` change only through it.
///
/// `Mr::as_mut_slice` refuses regions with remote write rights, but a region registered
/// with `MW_BIND | LOCAL_WRITE` can get a window with remote write at any time — even
/// while the slice lives, since binding does not borrow the region. A peer writing through
/// the window would change the bytes under the slice.
#[test]
fn no_mutable_slice_of_a_region_a_window_can_make_remotely_writable() {
    let mut p = pair(&Params::default());
    let buf = a_buf(&p);
    let mut mr =
        p.b.pd
            .alloc_mr(4096, AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE)
            .unwrap();
    let bind = mr.mw_bind(0, 4096, AccessFlags::REMOTE_WRITE);
    let addr = mr.addr();
    let mut mw = p.b.pd.alloc_mw(MwType::One).unwrap();
    match mr.as_mut_slice() {
        Err(e) => assert!(matches!(e, Error::MrRemoteWritable { .. }), "{e}"),
        Ok(slice) => {
            slice[..64].fill(1);
            let key =
                p.b.qp
                    .bind_mw(&mut mw, 5, bind, SendFlags::SIGNALED)
                    .unwrap();
            assert!(wait_b(&mut p, 1)[0].is_ok());
            let wc = run_a(
                &mut p,
                SendOp::RdmaWrite(RemoteAddr { addr, rkey: key }),
                &buf,
                64,
            );
            assert!(
                !wc.is_ok() || slice[..64] == [1; 64],
                "a peer wrote under a live &mut [u8]"
            );
        }
    }
    // The same for a registered buffer (which the engine also reads through a window with
    // remote read, to stage a peer's RDMA Read, while the slice lives).
    let mut v =
        p.b.pd
            .reg_mr(vec![0u8; 4096], AccessFlags::MW_BIND)
            .unwrap();
    assert!(
        v.as_mut_slice().is_err(),
        "a window can make it remotely readable"
    );
}

/// Promise: a peer reaches a registered buffer only inside the granted range, whatever
/// addresses, lengths and alignments it names (they become "bit 62" local offsets inside
/// the engine: none may alias another buffer or index out of the table).
#[test]
fn a_peer_reaches_a_registered_buffer_only_inside_the_granted_range() {
    let mut p = pair(&Params::default());
    let buf = a_buf(&p);
    let dst = p.a.pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
    // Two registered buffers side by side in B's table; only the first is granted.
    let granted =
        p.b.pd
            .reg_mr(pattern(4096, 1), rights() | AccessFlags::LOCAL_WRITE)
            .unwrap();
    let other =
        p.b.pd
            .reg_mr(pattern(4096, 2), AccessFlags::LOCAL_WRITE)
            .unwrap();
    let (base, key) = (granted.addr(), granted.rkey());
    let at = |addr: u64| RemoteAddr { addr, rkey: key };
    let mut bad: Vec<(SendOp, u32)> = vec![
        (SendOp::RdmaWrite(at(base + 4000)), 100), // straddles the end
        (SendOp::RdmaRead(at(base + 4000)), 100),
        (SendOp::RdmaWrite(at(base - 1)), 8), // starts before
        (SendOp::RdmaRead(at(base.wrapping_add(1 << 62))), 8), // the local-offset bit
        (SendOp::RdmaRead(at(base | 0xff_ffff << 32)), 8), // a huge table index
        (SendOp::RdmaWrite(at(u64::MAX - 3)), 8), // wraps around
        (SendOp::RdmaRead(at(other.addr())), 8), // the neighbour, with the wrong key
    ];
    for (remote, len) in [(base + 4092, 8), (base + 4096, 8), (!7u64, 8)] {
        bad.push((
            SendOp::FetchAdd {
                remote: at(remote),
                add: 1,
            },
            len,
        ));
    }
    let (granted_before, other_before) = (read_mr(&granted, 0, 4096), read_mr(&other, 0, 4096));
    for (op, len) in bad {
        // Each refusal takes B's QP to Error: a fresh connection for each.
        let (mut qa, _qb) = second_connection(&p);
        let sgl = [match op {
            SendOp::RdmaRead(_) => dst.sge(0, len).unwrap(),
            _ => buf.sge(0, len).unwrap(),
        }];
        if qa.post_send(&SendWr::new(1, op, &sgl)).is_err() {
            // This side's requester refuses it already (a misaligned Atomic); the
            // responder's own check is in the raw-packet suites.
            continue;
        }
        let wc = wait_a(&mut p, 1)[0];
        assert!(
            matches!(wc.status, WcStatus::RemAccessErr | WcStatus::RemInvReqErr),
            "{op:?}: {wc:?}"
        );
        assert_eq!(read_mr(&dst, 0, 8), [0; 8], "{op:?}: nothing read");
    }
    assert_eq!(read_mr(&granted, 0, 4096), granted_before);
    assert_eq!(read_mr(&other, 0, 4096), other_before);
    // The whole granted range works, to its last byte and its last aligned word.
    let (mut qa, _qb) = second_connection(&p);
    let sgl = [dst.sge(0, 4096).unwrap()];
    qa.post_send(&SendWr::new(2, SendOp::RdmaRead(at(base)), &sgl))
        .unwrap();
    assert!(wait_a(&mut p, 1)[0].is_ok());
    assert_eq!(read_mr(&dst, 0, 4096), granted_before);
    let sgl = [dst.sge(0, 8).unwrap()];
    qa.post_send(&SendWr::new(
        3,
        SendOp::FetchAdd {
            remote: at(base + 4088),
            add: 1,
        },
        &sgl,
    ))
    .unwrap();
    assert!(wait_a(&mut p, 1)[0].is_ok());
}

/// Promise: only a window key I bound works, and only inside the window. Keys with the
/// window bit naming no window, a freed one, a stale tag; accesses straddling the
/// window's end over a registered buffer; and a Read that ends exactly at the window's end
/// returns exactly the window's bytes.
#[test]
fn window_keys_are_checked_against_the_live_binding_and_its_range() {
    let mut p = pair(&Params::default());
    let buf = a_buf(&p);
    let dst = p.a.pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
    let reg =
        p.b.pd
            .reg_mr(
                pattern(8192, 5),
                AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE,
            )
            .unwrap();
    let base = reg.addr();
    let mut mw = p.b.pd.alloc_mw(MwType::One).unwrap();
    let old =
        p.b.qp
            .bind_mw(
                &mut mw,
                5,
                reg.mw_bind(1000, 2000, rights()),
                SendFlags::SIGNALED,
            )
            .unwrap();
    assert!(wait_b(&mut p, 1)[0].is_ok());
    let key =
        p.b.qp
            .bind_mw(
                &mut mw,
                6,
                reg.mw_bind(1000, 2000, rights()),
                SendFlags::SIGNALED,
            )
            .unwrap();
    assert!(wait_b(&mut p, 1)[0].is_ok());
    let freed = {
        let mut gone = p.b.pd.alloc_mw(MwType::One).unwrap();
        let k =
            p.b.qp
                .bind_mw(
                    &mut gone,
                    7,
                    reg.mw_bind(0, 8192, rights()),
                    SendFlags::SIGNALED,
                )
                .unwrap();
        assert!(wait_b(&mut p, 1)[0].is_ok());
        k
    };
    let bad = [
        (
            SendOp::RdmaRead(RemoteAddr {
                addr: base + 1000,
                rkey: old,
            }),
            8,
        ),
        (
            SendOp::RdmaRead(RemoteAddr {
                addr: base,
                rkey: freed,
            }),
            8,
        ),
        (
            SendOp::RdmaRead(RemoteAddr {
                addr: base + 1000,
                rkey: 0xffff_ff01,
            }),
            8,
        ),
        (
            SendOp::RdmaRead(RemoteAddr {
                addr: base + 1000,
                rkey: key ^ 0x7f00_0000,
            }),
            8,
        ),
        (
            SendOp::RdmaRead(RemoteAddr {
                addr: base + 2900,
                rkey: key,
            }),
            200,
        ),
        (
            SendOp::RdmaWrite(RemoteAddr {
                addr: base + 999,
                rkey: key,
            }),
            8,
        ),
        (
            SendOp::RdmaWrite(RemoteAddr {
                addr: base + 2996,
                rkey: key,
            }),
            8,
        ),
    ];
    for (op, len) in bad {
        let (mut qa, _qb) = second_connection(&p);
        let sgl = [match op {
            SendOp::RdmaRead(_) => dst.sge(0, len).unwrap(),
            _ => buf.sge(0, len).unwrap(),
        }];
        qa.post_send(&SendWr::new(1, op, &sgl)).unwrap();
        let wc = wait_a(&mut p, 1)[0];
        assert_eq!(wc.status, WcStatus::RemAccessErr, "{op:?}: {wc:?}");
        assert_eq!(read_mr(&dst, 0, 8), [0; 8], "{op:?}: nothing read");
    }
    assert_eq!(read_mr(&reg, 0, 8192), pattern(8192, 5), "nothing written");
    // Exactly the window: 2000 bytes from offset 1000, three packets.
    let (mut qa, _qb) = second_connection(&p);
    let sgl = [dst.sge(0, 2000).unwrap()];
    let op = SendOp::RdmaRead(RemoteAddr {
        addr: base + 1000,
        rkey: key,
    });
    qa.post_send(&SendWr::new(2, op, &sgl)).unwrap();
    assert!(wait_a(&mut p, 1)[0].is_ok());
    assert_eq!(read_mr(&dst, 0, 2000), pattern(8192, 5)[1000..3000]);
    assert_eq!(read_mr(&dst, 2000, 8), [0; 8], "nothing past the window");
}
