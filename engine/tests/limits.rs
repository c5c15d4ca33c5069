//! Limits and resources: every table has a documented cap that is an error, not an
//! overflow; sizes the machine cannot back are refused; memory comes back.
//!
//! This file's tests look at this process's own mappings, so it creates no other arenas.

use shmhca::{AccessFlags, Context, EngineMode, Error};

fn ctx() -> Context {
    Context::builder()
        .mode(EngineMode::Inline)
        .arena_size(1 << 20)
        .build()
        .unwrap()
}

#[test]
fn arena_sizes_the_machine_cannot_back_are_refused_with_the_reason() {
    let e = Context::builder().arena_size(0).build().unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    assert!(e.to_string().contains("arena_size"), "{e}");
    // 1 TiB: more than this machine has. The old code tried to populate it and was
    // OOM-killed; now it is an error before anything is mapped.
    let e = Context::builder().arena_size(1 << 40).build().unwrap_err();
    let text = e.to_string();
    assert!(text.contains("more than this machine"), "{text}");
}

#[test]
fn completion_queues_are_capped_with_a_clear_error_and_come_back() {
    let c = ctx();
    let limit = 1 << 16;
    let mut cqs = Vec::with_capacity(limit);
    for _ in 0..limit {
        cqs.push(c.create_cq(1).unwrap());
    }
    match c.create_cq(1) {
        Err(Error::LimitReached { what, limit: l }) => {
            assert!(what.contains("completion queues"), "{what}");
            assert_eq!(l, limit as u32);
        }
        other => panic!("expected LimitReached, got {other:?}"),
    }
    cqs.truncate(limit / 2);
    for _ in 0..limit / 2 {
        cqs.push(c.create_cq(1).unwrap());
    }
}

/// The mapping of this process that contains `addr`, as /proc/self/maps shows it.
fn mapping_of(addr: u64) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .find(|l| {
            let range = l.split_whitespace().next().unwrap();
            let (lo, hi) = range.split_once('-').unwrap();
            let lo = u64::from_str_radix(lo, 16).unwrap();
            let hi = u64::from_str_radix(hi, 16).unwrap();
            (lo..hi).contains(&addr)
        })
        .map(str::to_owned)
}

#[test]
fn a_protection_domains_arena_is_unmapped_with_its_last_user() {
    let c = ctx();
    let pd = c.alloc_pd().unwrap();
    let cq = c.create_cq(4).unwrap();
    let qp = c
        .create_qp(&pd, &cq, &cq, shmhca::QpCaps::default())
        .unwrap();
    let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let addr = mr.addr();
    let m = mapping_of(addr).expect("the region is mapped");
    assert!(m.contains("shmhca-arena"), "{m}");
    // The handle goes first: the region and the QP keep the arena.
    drop(pd);
    assert!(mapping_of(addr).is_some_and(|m| m.contains("shmhca-arena")));
    drop(mr);
    assert!(mapping_of(addr).is_some_and(|m| m.contains("shmhca-arena")));
    drop(qp);
    assert!(
        !mapping_of(addr).is_some_and(|m| m.contains("shmhca-arena")),
        "the arena is still mapped after its last region, QP and handle went"
    );
}

#[test]
fn each_protection_domain_has_an_arena_of_its_own() {
    let c = ctx();
    let (a, b) = (c.alloc_pd().unwrap(), c.alloc_pd().unwrap());
    let ma = a.alloc_mr(4096, AccessFlags::NONE).unwrap();
    let mb = b.alloc_mr(4096, AccessFlags::NONE).unwrap();
    let (sa, sb) = (
        mapping_of(ma.addr()).unwrap(),
        mapping_of(mb.addr()).unwrap(),
    );
    let range = |m: &str| m.split_whitespace().next().unwrap().to_owned();
    assert_ne!(range(&sa), range(&sb), "two domains share one mapping");
    assert_eq!(a.arena_free(), b.arena_free());
}
