//! Memory windows end to end (spec/05: "Bind Memory Window support is required"): type 1
//! windows bound with the Bind MW verb and type 2 windows bound with a work request;
//! RDMA Write, Read and Atomics through them with the bytes checked; every invalidation
//! rule (rebinding, unbinding, deallocation, Local Invalidate, Send with Invalidate) and the
//! completion error or Nak of each misuse; and a window used between two processes.
mod cm_support;
mod common;

use common::*;
use shmhca::*;

/// B's region behind the windows: 16 KiB, `MW_BIND` and `LOCAL_WRITE`, no remote rights of
/// its own (so anything that works remotely works through a window).
fn target(p: &Pair) -> Mr {
    let mr =
        p.b.pd
            .alloc_mr(16 << 10, AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE)
            .unwrap();
    mr.write_at(0, &pattern(16 << 10, 7)).unwrap();
    mr
}

fn rights() -> AccessFlags {
    AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC
}

/// Binds type 1 window `mw` on B's QP and waits for the bind's completion.
fn bind1(p: &mut Pair, mw: &mut Mw, bind: MwBind) -> (u32, WorkCompletion) {
    let key = p.b.qp.bind_mw(mw, 77, bind, SendFlags::SIGNALED).unwrap();
    let wc = wait_b(p, 1)[0];
    (key, wc)
}

/// Posts `op` from B (a bind or an invalidate, no data) and returns its completion.
fn post_b(p: &mut Pair, op: SendOp) -> WorkCompletion {
    p.b.qp.post_send(&SendWr::new(78, op, &[])).unwrap();
    wait_b(p, 1)[0]
}

/// Runs `op` from A with `len` bytes of `buf` and returns its completion.
fn run_a(p: &mut Pair, op: SendOp, buf: &Mr, len: u32) -> WorkCompletion {
    let sgl = [buf.sge(0, len).unwrap()];
    p.a.qp.post_send(&SendWr::new(1, op, &sgl)).unwrap();
    wait_a(p, 1)[0]
}

fn a_buf(p: &Pair) -> Mr {
    let mr = p.a.pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
    mr.write_at(0, &pattern(8192, 99)).unwrap();
    mr
}

fn read_mr(mr: &Mr, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mr.read_at(off, &mut v).unwrap();
    v
}

/// A remote access that must be refused: A's request fails with a remote access error, and
/// B's region is unchanged.
fn refused(p: &mut Pair, op: SendOp, buf: &Mr, len: u32, mr: &Mr) {
    let before = read_mr(mr, 0, mr.len() as usize);
    let wc = run_a(p, op, buf, len);
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
    p.settle();
    assert_eq!(
        p.b.qp.state(),
        QpState::Error,
        "the responder goes to Error"
    );
    assert_eq!(p.b.ctx.stats().rem_access_naks_sent, 1);
    assert_eq!(read_mr(mr, 0, mr.len() as usize), before, "nothing written");
}

#[test]
fn write_read_and_atomics_through_a_type_1_window() {
    let mut p = pair(&Params::default());
    let mr = target(&p);
    let buf = a_buf(&p);
    let mut mw = p.b.pd.alloc_mw(MwType::One).unwrap();
    assert_eq!(mw.kind(), MwType::One);
    let (key, wc) = bind1(&mut p, &mut mw, mr.mw_bind(4096, 8192, rights()));
    assert_eq!(
        (wc.status, wc.opcode, wc.wr_id),
        (WcStatus::Success, WcOpcode::BindMw, 77)
    );
    assert_eq!(mw.rkey(), key);
    assert_ne!(key, mr.rkey());
    let at = |off: u64| RemoteAddr {
        addr: mr.addr() + 4096 + off,
        rkey: key,
    };
    // Write 3000 bytes (three packets) at window offset 100.
    let wc = run_a(&mut p, SendOp::RdmaWrite(at(100)), &buf, 3000);
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    assert_eq!(read_mr(&mr, 4196, 3000), pattern(8192, 99)[..3000]);
    assert_eq!(
        read_mr(&mr, 4096, 100),
        pattern(16 << 10, 7)[4096..4196],
        "around it untouched"
    );
    // Read the window's last 2000 bytes.
    let dst = p.a.pd.alloc_mr(2000, AccessFlags::LOCAL_WRITE).unwrap();
    let wc = run_a(&mut p, SendOp::RdmaRead(at(8192 - 2000)), &dst, 2000);
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    assert_eq!(
        read_mr(&dst, 0, 2000),
        read_mr(&mr, 4096 + 8192 - 2000, 2000)
    );
    // Atomics on an aligned word of the window.
    mr.write_at(4096 + 4000, &5u64.to_ne_bytes()).unwrap();
    let res = p.a.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let wc = run_a(
        &mut p,
        SendOp::FetchAdd {
            remote: at(4000),
            add: 10,
        },
        &res,
        8,
    );
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    assert_eq!(res.load_u64(0).unwrap(), 5);
    let wc = run_a(
        &mut p,
        SendOp::CompareSwap {
            remote: at(4000),
            compare: 15,
            swap: 99,
        },
        &res,
        8,
    );
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    assert_eq!(res.load_u64(0).unwrap(), 15);
    assert_eq!(mr.load_u64(4096 + 4000).unwrap(), 99);
    // The region's own key has no remote rights: it is still refused.
    refused(&mut p, SendOp::RdmaWrite(mr.remote(0)), &buf, 8, &mr);
}

#[test]
fn a_window_is_checked_against_its_own_range_and_rights_not_the_regions() {
    // The region allows everything; the window only reads 1 KiB of it.
    for case in 0..3 {
        let mut p = pair(&Params::default());
        let mr =
            p.b.pd
                .alloc_mr(8192, AccessFlags::ALL | AccessFlags::MW_BIND)
                .unwrap();
        let buf = a_buf(&p);
        let mut mw = p.b.pd.alloc_mw(MwType::One).unwrap();
        let (key, wc) = bind1(
            &mut p,
            &mut mw,
            mr.mw_bind(1024, 1024, AccessFlags::REMOTE_READ),
        );
        assert!(wc.is_ok(), "{wc:?}");
        let at = |off: u64| RemoteAddr {
            addr: mr.addr() + off,
            rkey: key,
        };
        match case {
            // A right the window lacks (the region has it).
            0 => refused(&mut p, SendOp::RdmaWrite(at(1024)), &buf, 16, &mr),
            // Past the window's end (inside the region).
            1 => refused(&mut p, SendOp::RdmaRead(at(2048 - 8)), &buf, 16, &mr),
            // Before its start.
            _ => refused(&mut p, SendOp::RdmaRead(at(1000)), &buf, 16, &mr),
        }
    }
}

#[test]
fn rebinding_unbinding_and_deallocating_a_type_1_window_kill_its_old_key() {
    for case in 0..3 {
        let mut p = pair(&Params::default());
        let mr = target(&p);
        let buf = a_buf(&p);
        let mut mw = p.b.pd.alloc_mw(MwType::One).unwrap();
        let (old, _) = bind1(&mut p, &mut mw, mr.mw_bind(0, 4096, rights()));
        let wc = run_a(
            &mut p,
            SendOp::RdmaWrite(RemoteAddr {
                addr: mr.addr(),
                rkey: old,
            }),
            &buf,
            8,
        );
        assert!(wc.is_ok(), "the first key works: {wc:?}");
        match case {
            0 => {
                let (new, wc) = bind1(&mut p, &mut mw, mr.mw_bind(0, 4096, rights()));
                assert!(wc.is_ok());
                assert_ne!(new, old);
                let wc = run_a(
                    &mut p,
                    SendOp::RdmaWrite(RemoteAddr {
                        addr: mr.addr() + 8,
                        rkey: new,
                    }),
                    &buf,
                    8,
                );
                assert!(wc.is_ok(), "the new key works: {wc:?}");
            }
            1 => {
                let (_, wc) = bind1(&mut p, &mut mw, mr.mw_bind(0, 0, rights()));
                assert!(wc.is_ok(), "a zero-length bind unbinds: {wc:?}");
            }
            _ => drop(mw),
        }
        refused(
            &mut p,
            SendOp::RdmaWrite(RemoteAddr {
                addr: mr.addr(),
                rkey: old,
            }),
            &buf,
            8,
            &mr,
        );
    }
}

#[test]
fn a_type_2_window_works_until_a_local_invalidate() {
    let mut p = pair(&Params::default());
    let mr = target(&p);
    let buf = a_buf(&p);
    let mw = p.b.pd.alloc_mw(MwType::Two).unwrap();
    let key = mw.rkey_with_tag(0x42);
    assert_eq!(key & 0xff, 0x42, "the low 8 bits are the consumer's");
    let wc = post_b(
        &mut p,
        SendOp::BindMw {
            rkey: key,
            bind: mr.mw_bind(512, 1024, rights()),
        },
    );
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::BindMw)
    );
    let at = RemoteAddr {
        addr: mr.addr() + 512,
        rkey: key,
    };
    let wc = run_a(&mut p, SendOp::RdmaWrite(at), &buf, 1024);
    assert!(wc.is_ok(), "{wc:?}");
    assert_eq!(read_mr(&mr, 512, 1024), pattern(8192, 99)[..1024]);
    // A bound type 2 window cannot be bound again before it is invalidated.
    let wc = post_b(&mut p, SendOp::LocalInv(key));
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::LocalInv)
    );
    // Rebound with another tag after the invalidation: the old key stays dead.
    let key2 = mw.rkey_with_tag(0x43);
    let wc = post_b(
        &mut p,
        SendOp::BindMw {
            rkey: key2,
            bind: mr.mw_bind(0, 64, rights()),
        },
    );
    assert!(wc.is_ok(), "{wc:?}");
    let wc = run_a(
        &mut p,
        SendOp::RdmaRead(RemoteAddr {
            addr: mr.addr(),
            rkey: key2,
        }),
        &buf,
        64,
    );
    assert!(wc.is_ok(), "{wc:?}");
    refused(&mut p, SendOp::RdmaWrite(at), &buf, 8, &mr);
}

#[test]
fn send_with_invalidate_invalidates_the_window_and_reports_its_key() {
    let mut p = pair(&Params::default());
    let mr = target(&p);
    let buf = a_buf(&p);
    let rbuf = p.b.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let mw = p.b.pd.alloc_mw(MwType::Two).unwrap();
    let key = mw.rkey_with_tag(9);
    let wc = post_b(
        &mut p,
        SendOp::BindMw {
            rkey: key,
            bind: mr.mw_bind(0, 4096, rights()),
        },
    );
    assert!(wc.is_ok(), "{wc:?}");
    p.b.qp
        .post_recv(&RecvWr::new(5, &[rbuf.sge(0, 4096).unwrap()]))
        .unwrap();
    // Three packets; the IETH rides on the last.
    let wc = run_a(&mut p, SendOp::SendWithInv(key), &buf, 2500);
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::Send),
        "{wc:?}"
    );
    let rc = wait_b(&mut p, 1)[0];
    assert_eq!(
        (rc.status, rc.opcode, rc.byte_len, rc.invalidated_rkey),
        (WcStatus::Success, WcOpcode::Recv, 2500, Some(key)),
        "{rc:?}"
    );
    assert_eq!(read_mr(&rbuf, 0, 2500), pattern(8192, 99)[..2500]);
    refused(
        &mut p,
        SendOp::RdmaWrite(RemoteAddr {
            addr: mr.addr(),
            rkey: key,
        }),
        &buf,
        8,
        &mr,
    );
}

/// A Send with Invalidate naming a key the responder may not invalidate: A's Send fails
/// with a remote invalid request error, B's receive with a local protection error.
fn bad_send_with_invalidate(p: &mut Pair, key: u32) {
    let buf = a_buf(p);
    let rbuf = p.b.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(5, &[rbuf.sge(0, 4096).unwrap()]))
        .unwrap();
    let wc = run_a(p, SendOp::SendWithInv(key), &buf, 100);
    assert_eq!(wc.status, WcStatus::RemInvReqErr, "{wc:?}");
    let rc = wait_b(p, 1)[0];
    assert_eq!((rc.wr_id, rc.status), (5, WcStatus::LocProtErr), "{rc:?}");
    assert_eq!(p.b.ctx.stats().inv_req_naks_sent, 1);
}

#[test]
fn send_with_invalidate_of_a_key_it_may_not_invalidate_is_an_invalid_request() {
    // A type 1 window (only rebinding or deallocation invalidates it).
    let mut p = pair(&Params::default());
    let mr = target(&p);
    let mut mw = p.b.pd.alloc_mw(MwType::One).unwrap();
    let (key, _) = bind1(&mut p, &mut mw, mr.mw_bind(0, 64, rights()));
    bad_send_with_invalidate(&mut p, key);

    // An unknown key, and a region's key.
    let mut p = pair(&Params::default());
    bad_send_with_invalidate(&mut p, 0x8012_3401);
    let mut p = pair(&Params::default());
    let mr = target(&p);
    bad_send_with_invalidate(&mut p, mr.rkey());

    // A type 2 window bound to another QP of B.
    let mut p = pair(&Params::default());
    let mr = target(&p);
    let mut other =
        p.b.ctx
            .create_qp(&p.b.pd, &p.b.cq, &p.b.cq, QpCaps::default())
            .unwrap();
    connect(&mut other, p.b.link, p.a.qp.qpn(), 1, 1, &Params::default());
    let mw = p.b.pd.alloc_mw(MwType::Two).unwrap();
    let key = mw.rkey_with_tag(1);
    other
        .post_send(&SendWr::new(
            3,
            SendOp::BindMw {
                rkey: key,
                bind: mr.mw_bind(0, 64, rights()),
            },
            &[],
        ))
        .unwrap();
    assert!(wait_b(&mut p, 1)[0].is_ok());
    bad_send_with_invalidate(&mut p, key);
}

#[test]
fn a_type_2_window_works_only_through_the_qp_it_is_bound_to() {
    let mut p = pair(&Params::default());
    let mr = target(&p);
    let buf = a_buf(&p);
    // A second connection between the same two contexts and domains.
    let prm = Params::default();
    let mut qa2 =
        p.a.ctx
            .create_qp(&p.a.pd, &p.a.cq, &p.a.cq, QpCaps::default())
            .unwrap();
    let mut qb2 =
        p.b.ctx
            .create_qp(&p.b.pd, &p.b.cq, &p.b.cq, QpCaps::default())
            .unwrap();
    let (n_a2, n_b2) = (qa2.qpn(), qb2.qpn());
    connect(&mut qa2, p.a.link, n_b2, 10, 20, &prm);
    connect(&mut qb2, p.b.link, n_a2, 20, 10, &prm);
    // Bound on B's first QP...
    let mw = p.b.pd.alloc_mw(MwType::Two).unwrap();
    let key = mw.rkey_with_tag(3);
    assert!(
        post_b(
            &mut p,
            SendOp::BindMw {
                rkey: key,
                bind: mr.mw_bind(0, 4096, rights())
            }
        )
        .is_ok()
    );
    // ...and used by A through the second connection: refused.
    let before = read_mr(&mr, 0, 4096);
    let sgl = [buf.sge(0, 8).unwrap()];
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
    assert_eq!(
        (wc.qp_num, wc.status),
        (n_a2, WcStatus::RemAccessErr),
        "{wc:?}"
    );
    assert_eq!(read_mr(&mr, 0, 4096), before);
    assert_eq!(qb2.state(), QpState::Error);
    // Through the first connection it still works.
    let wc = run_a(
        &mut p,
        SendOp::RdmaWrite(RemoteAddr {
            addr: mr.addr(),
            rkey: key,
        }),
        &buf,
        8,
    );
    assert!(wc.is_ok(), "{wc:?}");
}

/// A bind posted on B that must fail with a bind error and take B's QP to Error.
fn bind_fails(p: &mut Pair, op: SendOp) {
    let wc = post_b(p, op);
    assert_eq!((wc.wr_id, wc.status), (78, WcStatus::MwBindErr), "{wc:?}");
    assert_eq!(p.b.qp.state(), QpState::Error);
}

#[test]
fn every_bad_bind_completes_with_a_bind_error() {
    let rw = AccessFlags::REMOTE_WRITE;
    type Case = fn(&Pair, &Mr, &Mw) -> SendOp;
    let cases: [(&str, Case); 7] = [
        ("window past its region", |_, mr, mw| SendOp::BindMw {
            rkey: mw.rkey_with_tag(1),
            bind: mr.mw_bind((16 << 10) - 100, 101, AccessFlags::REMOTE_READ),
        }),
        ("window before its region", |_, mr, mw| SendOp::BindMw {
            rkey: mw.rkey_with_tag(1),
            bind: MwBind {
                lkey: mr.lkey(),
                addr: mr.addr() - 1,
                len: 8,
                access: AccessFlags::REMOTE_READ,
            },
        }),
        (
            "remote write on a region without local write",
            |p, _, mw| {
                let ro = p.b.pd.alloc_mr(4096, AccessFlags::MW_BIND).unwrap();
                let op = SendOp::BindMw {
                    rkey: mw.rkey_with_tag(1),
                    bind: ro.mw_bind(0, 64, AccessFlags::REMOTE_WRITE),
                };
                std::mem::forget(ro); // keep its key live until the bind ran
                op
            },
        ),
        ("a region without MW_BIND", |p, _, mw| {
            let plain = p.b.pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
            let op = SendOp::BindMw {
                rkey: mw.rkey_with_tag(1),
                bind: plain.mw_bind(0, 64, AccessFlags::REMOTE_READ),
            };
            std::mem::forget(plain);
            op
        }),
        ("a right that is not a remote right", |_, mr, mw| {
            SendOp::BindMw {
                rkey: mw.rkey_with_tag(1),
                bind: mr.mw_bind(0, 64, AccessFlags::LOCAL_WRITE),
            }
        }),
        ("a region of another protection domain", |p, _, mw| {
            let pd2 = p.b.ctx.alloc_pd().unwrap();
            let other = pd2
                .alloc_mr(4096, AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE)
                .unwrap();
            let op = SendOp::BindMw {
                rkey: mw.rkey_with_tag(1),
                bind: other.mw_bind(0, 64, AccessFlags::REMOTE_READ),
            };
            std::mem::forget(other);
            std::mem::forget(pd2);
            op
        }),
        ("a deregistered region", |p, _, mw| {
            let gone =
                p.b.pd
                    .alloc_mr(4096, AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE)
                    .unwrap();
            let op = SendOp::BindMw {
                rkey: mw.rkey_with_tag(1),
                bind: gone.mw_bind(0, 64, AccessFlags::REMOTE_READ),
            };
            drop(gone);
            op
        }),
    ];
    for (what, make) in cases {
        let mut p = pair(&Params::default());
        let mr = target(&p);
        let mw = p.b.pd.alloc_mw(MwType::Two).unwrap();
        let op = make(&p, &mr, &mw);
        eprintln!("case: {what}");
        bind_fails(&mut p, op);
        let _ = rw;
    }

    // A type 2 window bound twice without an invalidation.
    let mut p = pair(&Params::default());
    let mr = target(&p);
    let mw = p.b.pd.alloc_mw(MwType::Two).unwrap();
    assert!(
        post_b(
            &mut p,
            SendOp::BindMw {
                rkey: mw.rkey_with_tag(1),
                bind: mr.mw_bind(0, 64, rw)
            }
        )
        .is_ok()
    );
    bind_fails(
        &mut p,
        SendOp::BindMw {
            rkey: mw.rkey_with_tag(2),
            bind: mr.mw_bind(0, 64, rw),
        },
    );

    // A type 1 window named by a bind work request (type 1 windows use the Bind MW verb).
    let mut p = pair(&Params::default());
    let mr = target(&p);
    let mw = p.b.pd.alloc_mw(MwType::One).unwrap();
    bind_fails(
        &mut p,
        SendOp::BindMw {
            rkey: mw.rkey_with_tag(1),
            bind: mr.mw_bind(0, 64, rw),
        },
    );

    // A window of another protection domain than the QP's.
    let mut p = pair(&Params::default());
    let mr = target(&p);
    let pd2 = p.b.ctx.alloc_pd().unwrap();
    let mw2 = pd2.alloc_mw(MwType::Two).unwrap();
    bind_fails(
        &mut p,
        SendOp::BindMw {
            rkey: mw2.rkey_with_tag(1),
            bind: mr.mw_bind(0, 64, rw),
        },
    );
    // (Type 1: refused when posted.)
    let mut mw1 = pd2.alloc_mw(MwType::One).unwrap();
    let err =
        p.b.qp
            .bind_mw(&mut mw1, 1, mr.mw_bind(0, 64, rw), SendFlags::SIGNALED)
            .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    // And a type 2 window given to the Bind MW verb.
    let mut mw2b = p.b.pd.alloc_mw(MwType::Two).unwrap();
    let err =
        p.b.qp
            .bind_mw(&mut mw2b, 1, mr.mw_bind(0, 64, rw), SendFlags::SIGNALED)
            .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
}

#[test]
fn a_bad_local_invalidate_completes_with_a_protection_error() {
    let keys: [fn(&Pair, &Mr, &mut Mw) -> u32; 4] = [
        |_, _, mw| mw.rkey(),              // type 1 (bound below)
        |_, _, _| 0x8055_5501,             // unknown
        |_, mr, _| mr.rkey(),              // a region's key
        |_, _, mw| mw.rkey_with_tag(0x77), // type 1 window, wrong tag
    ];
    for key_of in keys {
        let mut p = pair(&Params::default());
        let mr = target(&p);
        let mut mw = p.b.pd.alloc_mw(MwType::One).unwrap();
        let _ = bind1(&mut p, &mut mw, mr.mw_bind(0, 64, rights()));
        let key = key_of(&p, &mr, &mut mw);
        let wc = post_b(&mut p, SendOp::LocalInv(key));
        assert_eq!(
            (wc.status, wc.opcode),
            (WcStatus::LocProtErr, WcOpcode::LocalInv),
            "{key:#x}"
        );
        assert_eq!(p.b.qp.state(), QpState::Error);
    }
    // A type 2 window already invalidated.
    let mut p = pair(&Params::default());
    let mr = target(&p);
    let mw = p.b.pd.alloc_mw(MwType::Two).unwrap();
    let key = mw.rkey_with_tag(5);
    assert!(
        post_b(
            &mut p,
            SendOp::BindMw {
                rkey: key,
                bind: mr.mw_bind(0, 64, rights())
            }
        )
        .is_ok()
    );
    assert!(post_b(&mut p, SendOp::LocalInv(key)).is_ok());
    assert_eq!(
        post_b(&mut p, SendOp::LocalInv(key)).status,
        WcStatus::LocProtErr
    );
}

#[test]
fn a_region_with_bound_windows_cannot_be_deregistered() {
    let mut p = pair(&Params::default());
    let mr = target(&p);
    let mw = p.b.pd.alloc_mw(MwType::Two).unwrap();
    let key = mw.rkey_with_tag(1);
    assert!(
        post_b(
            &mut p,
            SendOp::BindMw {
                rkey: key,
                bind: mr.mw_bind(0, 64, rights())
            }
        )
        .is_ok()
    );
    let (mr, err) = mr.deregister().unwrap_err().into_parts();
    assert!(
        matches!(err, Error::MrHasWindows { windows: 1, .. }),
        "{err}"
    );
    assert!(post_b(&mut p, SendOp::LocalInv(key)).is_ok());
    mr.deregister().expect("no window bound any more");
}

#[test]
fn dropping_the_region_kills_its_windows() {
    let mut p = pair(&Params::default());
    let mr = target(&p);
    let addr = mr.addr();
    let buf = a_buf(&p);
    let mut mw = p.b.pd.alloc_mw(MwType::One).unwrap();
    let (key, _) = bind1(&mut p, &mut mw, mr.mw_bind(0, 64, rights()));
    drop(mr);
    let keep = p.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let wc = run_a(
        &mut p,
        SendOp::RdmaWrite(RemoteAddr { addr, rkey: key }),
        &buf,
        8,
    );
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
    drop(keep);
}

#[test]
fn binds_and_invalidates_complete_in_order_with_other_work() {
    let mut p = pair(&Params::default());
    let mr = target(&p);
    let mw = p.b.pd.alloc_mw(MwType::Two).unwrap();
    let key = mw.rkey_with_tag(1);
    let src = p.b.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let rbuf = p.a.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..3 {
        p.a.qp
            .post_recv(&RecvWr::new(i, &[rbuf.sge(0, 4096).unwrap()]))
            .unwrap();
    }
    // Send, bind, send, invalidate, send: completions in posted order, unsignaled binds silent.
    let sgl = [src.sge(0, 3000).unwrap()];
    let b = &mut p.b.qp;
    b.post_send(&SendWr::new(1, SendOp::Send, &sgl)).unwrap();
    b.post_send(&SendWr::new(
        2,
        SendOp::BindMw {
            rkey: key,
            bind: mr.mw_bind(0, 64, rights()),
        },
        &[],
    ))
    .unwrap();
    b.post_send(&SendWr::new(3, SendOp::Send, &sgl).flags(SendFlags::NONE))
        .unwrap();
    b.post_send(&SendWr::new(4, SendOp::LocalInv(key), &[]).flags(SendFlags::NONE))
        .unwrap();
    b.post_send(&SendWr::new(5, SendOp::Send, &sgl)).unwrap();
    let wcs = wait_b(&mut p, 3);
    let got: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.opcode, w.status)).collect();
    assert_eq!(
        got,
        [
            (1, WcOpcode::Send, WcStatus::Success),
            (2, WcOpcode::BindMw, WcStatus::Success),
            (5, WcOpcode::Send, WcStatus::Success)
        ]
    );
    assert_eq!(wait_a(&mut p, 3).len(), 3);
    // The invalidate ran: binding again with a new tag works.
    assert!(
        post_b(
            &mut p,
            SendOp::BindMw {
                rkey: mw.rkey_with_tag(2),
                bind: mr.mw_bind(0, 64, rights())
            }
        )
        .is_ok()
    );
}

// ---------------------------------------------------------------------------------------
// Between two processes.

const TEST: &str = "a_type_2_window_between_two_processes";

/// The parent binds a type 2 window over part of a region and sends its key; the child
/// writes into the window, reads it back, then Sends with Invalidate; a last write through
/// the dead key is refused.
#[test]
fn a_type_2_window_between_two_processes() {
    use cm_support::*;
    if let Some((role, arg)) = role() {
        assert_eq!(role, "client");
        return window_client(&arg);
    }
    let _serial = serial();
    let dir = SockDir::new("mw");
    let path = dir.sock("mw.sock");
    let ctx = cm_support::context(16 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(64).unwrap();
    let mr = pd
        .alloc_mr(8192, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)
        .unwrap();
    let rbuf = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let listener = ctx.listen(&path).unwrap();
    let peer = spawn_peer(TEST, "client", path.to_str().unwrap());
    let mut conn = listener
        .accept_timeout(DEADLINE, &pd, &cq, &cq, &ConnectParams::default())
        .unwrap();
    for i in 0..2 {
        conn.post_recv(&RecvWr::new(100 + i, &[rbuf.sge(0, 64).unwrap()]))
            .unwrap();
    }
    let mw = pd.alloc_mw(MwType::Two).unwrap();
    let key = mw.rkey_with_tag(0xA5);
    conn.post_send(&SendWr::new(
        1,
        SendOp::BindMw {
            rkey: key,
            bind: mr.mw_bind(
                4096,
                1024,
                AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            ),
        },
        &[],
    ))
    .unwrap();
    assert!(wait(&mut cq, 1)[0].is_ok());
    let window = RemoteAddr {
        addr: mr.addr() + 4096,
        rkey: key,
    };
    conn.post_send(&SendWr::inline(2, SendOp::Send, &window.to_bytes()))
        .unwrap();
    let mut recvs = Vec::new();
    while recvs.is_empty() {
        for wc in wait(&mut cq, 1) {
            assert!(wc.is_ok(), "{wc:?}");
            if wc.opcode == WcOpcode::Recv {
                recvs.push(wc);
            }
        }
    }
    // The child's Send with Invalidate arrives after its Write and Read.
    assert_eq!(recvs[0].invalidated_rkey, Some(key), "{:?}", recvs[0]);
    let mut got = vec![0u8; 1024];
    mr.read_at(4096, &mut got).unwrap();
    assert_eq!(
        got,
        pattern(1024, 0x3C),
        "the child's write through the window"
    );
    let mut around = vec![0u8; 4096];
    mr.read_at(0, &mut around).unwrap();
    assert!(around.iter().all(|&b| b == 0), "nothing outside the window");
    // The child's last write, through the dead key, is refused: this QP Naks it and
    // goes to Error.
    eventually("the refused write", || {
        ctx.progress();
        conn.state() == QpState::Error
    });
    assert_eq!(ctx.stats().rem_access_naks_sent, 1);
    peer.expect_success();
    drop(conn);
    drop(listener);
    dir.assert_empty_and_remove();
}

fn window_client(path: &str) {
    use cm_support::*;
    let ctx = cm_support::context(16 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(64).unwrap();
    let buf = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let mut conn = ctx
        .connect(path, &pd, &cq, &cq, &ConnectParams::default())
        .unwrap();
    conn.post_recv(&RecvWr::new(9, &[buf.sge(0, 12).unwrap()]))
        .unwrap();
    let wc = wait(&mut cq, 1)[0];
    assert!(wc.is_ok() && wc.byte_len == 12, "{wc:?}");
    let mut b = [0u8; 12];
    buf.read_at(0, &mut b).unwrap();
    let window = RemoteAddr::from_bytes(b);
    buf.write_at(0, &pattern(1024, 0x3C)).unwrap();
    let sgl = [buf.sge(0, 1024).unwrap()];
    conn.post_send(&SendWr::new(1, SendOp::RdmaWrite(window), &sgl))
        .unwrap();
    assert!(wait(&mut cq, 1)[0].is_ok());
    let rsgl = [buf.sge(2048, 1024).unwrap()];
    conn.post_send(&SendWr::new(2, SendOp::RdmaRead(window), &rsgl))
        .unwrap();
    assert!(wait(&mut cq, 1)[0].is_ok());
    let mut back = vec![0u8; 1024];
    buf.read_at(2048, &mut back).unwrap();
    assert_eq!(back, pattern(1024, 0x3C), "read back through the window");
    conn.post_send(&SendWr::new(3, SendOp::SendWithInv(window.rkey), &[]))
        .unwrap();
    assert!(wait(&mut cq, 1)[0].is_ok());
    // The key is dead now.
    conn.post_send(&SendWr::new(4, SendOp::RdmaWrite(window), &sgl))
        .unwrap();
    let wc = wait(&mut cq, 1)[0];
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
}
