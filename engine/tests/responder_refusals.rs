//! A responder that refuses a request for good (a Remote Access Error Nak) says why on its
//! QP ([`Qp::last_error`]): which check failed, the key, the range and the access asked for.
//! The requester's completion only carries RemAccessErr; the responder's side, which sees
//! just a QP gone to Error (its own work flushed), had nothing to go on (issue 24: a
//! RemAccessErr seen once under load could not be told apart from a stale key, a wrong
//! range or missing rights).
mod common;

use common::*;
use shmhca::*;

/// Posts an RDMA Write of `len` bytes from A to `remote`, waits for its completion and
/// returns it with B's QP's `last_error` once the Nak has left.
fn refused(p: &mut Pair, src: &Mr, remote: RemoteAddr, len: u32) -> (WcStatus, Option<String>) {
    p.a.qp
        .post_send(&SendWr::new(
            1,
            SendOp::RdmaWrite(remote),
            &[src.sge(0, len).unwrap()],
        ))
        .unwrap();
    let wcs = wait_a(p, 1);
    p.settle();
    (wcs[0].status, p.b.qp.last_error())
}

fn setup() -> (Pair, Mr, Mr) {
    let p = pair(&Params::default());
    let src = p.a.pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
    let target =
        p.b.pd
            .alloc_mr(4096, AccessFlags::REMOTE_WRITE | AccessFlags::LOCAL_WRITE)
            .unwrap();
    (p, src, target)
}

#[test]
fn an_unknown_key_is_named_on_the_responders_qp() {
    let (mut p, src, target) = setup();
    let mut bad = target.remote(0);
    bad.rkey ^= 0x0100;
    let (status, why) = refused(&mut p, &src, bad, 100);
    assert_eq!(status, WcStatus::RemAccessErr);
    let why = why.expect("the responder's QP says why it failed");
    assert!(why.contains(&format!("{:#x}", bad.rkey)), "{why}");
    assert!(why.contains("no region"), "{why}");
    assert!(why.contains("RDMA Write"), "{why}");
}

#[test]
fn a_range_past_the_region_is_named_with_its_bounds() {
    let (mut p, src, target) = setup();
    let at = target.remote(4000);
    let (status, why) = refused(&mut p, &src, at, 200);
    assert_eq!(status, WcStatus::RemAccessErr);
    let why = why.expect("the responder's QP says why it failed");
    assert!(why.contains("outside the region"), "{why}");
    assert!(why.contains("200 bytes"), "{why}");
    assert!(why.contains(&format!("{:#x}", at.addr)), "{why}");
}

#[test]
fn a_stale_key_is_told_apart_from_an_unknown_one() {
    let (mut p, src, _target) = setup();
    let old =
        p.b.pd
            .alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let stale = old.remote(0);
    old.deregister().unwrap();
    let _reuse =
        p.b.pd
            .alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let (status, why) = refused(&mut p, &src, stale, 100);
    assert_eq!(status, WcStatus::RemAccessErr);
    let why = why.expect("the responder's QP says why it failed");
    assert!(why.contains("deregistered"), "{why}");
}

#[test]
fn missing_rights_are_named() {
    let (mut p, src, _target) = setup();
    let ro = p.b.pd.alloc_mr(4096, AccessFlags::REMOTE_READ).unwrap();
    let (status, why) = refused(&mut p, &src, ro.remote(0), 100);
    assert_eq!(status, WcStatus::RemAccessErr);
    let why = why.expect("the responder's QP says why it failed");
    assert!(why.contains("does not grant"), "{why}");
}

#[test]
fn a_good_write_leaves_no_error() {
    let (mut p, src, target) = setup();
    p.a.qp
        .post_send(&SendWr::new(
            1,
            SendOp::RdmaWrite(target.remote(0)),
            &[src.sge(0, 100).unwrap()],
        ))
        .unwrap();
    let wcs = wait_a(&mut p, 1);
    assert_eq!(wcs[0].status, WcStatus::Success);
    assert_eq!(p.b.qp.last_error(), None);
}
