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
            .bind_mw(&mut mw, 5, mr.mw_bind(0, 4096, rights()), SendFlags::SIGNALED)
            .unwrap();
    assert!(wait_b(&mut p, 1)[0].is_ok());
    drop(mr);
    // A private, local-only region (no remote rights, no MW_BIND).
    let victim = region_with_key(&p.b.pd, 4096, AccessFlags::LOCAL_WRITE, old_key);
    assert_eq!(victim.addr(), addr, "the same block again");
    victim.write_at(0, &[0xee; 64]).unwrap();
    let buf = a_buf(&p);
    let wc = run_a(&mut p, SendOp::RdmaWrite(RemoteAddr { addr, rkey: key }), &buf, 64);
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{wc:?}");
    assert_eq!(read_mr(&victim, 0, 64), [0xee; 64], "nothing written");
}
