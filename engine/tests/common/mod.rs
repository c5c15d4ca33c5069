//! Test helpers: two contexts in this process, linked, with one connected QP each.
#![allow(dead_code, missing_docs, unreachable_pub)]

use std::time::{Duration, Instant};

use shmhca::{
    AccessFlags, Context, Cq, Destination, EngineMode, LinkId, Mtu, Pd, Qp, QpAttr, QpCaps,
    QpState, WorkCompletion,
};

pub struct End {
    pub ctx: Context,
    pub pd: Pd,
    pub cq: Cq,
    pub qp: Qp,
    pub link: LinkId,
}

pub struct Pair {
    pub a: End,
    pub b: End,
}

pub struct Params {
    pub caps: QpCaps,
    pub mtu: Mtu,
    pub psn_a: u32,
    pub psn_b: u32,
    pub access: AccessFlags,
    pub rd_atomic: u8,
    pub arena: u64,
    pub timeout: u8,
    pub retry: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
}

impl Default for Params {
    fn default() -> Params {
        Params {
            caps: QpCaps::default(),
            mtu: Mtu::Mtu1024,
            psn_a: 201,
            psn_b: 7000,
            access: AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_ATOMIC,
            rd_atomic: 4,
            arena: 16 << 20,
            timeout: 14,
            retry: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
        }
    }
}

/// An inline context driven only by the test (`Progress::Manual`): the tests that use it
/// pump the engines by hand and some need a peer that does not answer.
pub fn context(arena: u64) -> Context {
    Context::builder()
        .arena_size(arena)
        .huge_pages(shmhca_rings::HugePages::Never)
        .mode(EngineMode::Inline)
        .progress(shmhca::Progress::Manual)
        .build()
        .expect("context")
}

pub fn end(ctx: Context, link: LinkId, p: &Params) -> End {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4096).unwrap();
    let qp = ctx.create_qp(&pd, &cq, &cq, p.caps).unwrap();
    End {
        ctx,
        pd,
        cq,
        qp,
        link,
    }
}

/// Brings `qp` to RTS talking to `remote` over `link`.
pub fn connect(
    qp: &mut Qp,
    link: LinkId,
    remote: shmhca::Qpn,
    sq_psn: u32,
    rq_psn: u32,
    p: &Params,
) {
    qp.modify(&QpAttr::new(QpState::Init).access(p.access))
        .unwrap();
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(p.mtu)
            .dest(Destination { link, qpn: remote })
            .rq_psn(rq_psn)
            .max_dest_rd_atomic(p.rd_atomic)
            .min_rnr_timer(p.min_rnr_timer),
    )
    .unwrap();
    qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(sq_psn)
            .timeout(p.timeout)
            .retry_cnt(p.retry)
            .rnr_retry(p.rnr_retry)
            .max_rd_atomic(p.rd_atomic),
    )
    .unwrap();
}

pub fn pair(p: &Params) -> Pair {
    pair_of(context(p.arena), context(p.arena), p)
}

/// Links two contexts built by the test and connects one QP of each (as [`pair`]).
pub fn pair_of(ca: Context, cb: Context, p: &Params) -> Pair {
    let (la, lb) = ca.link_with(&cb).unwrap();
    let mut a = end(ca, la, p);
    let mut b = end(cb, lb, p);
    let (qa, qb) = (a.qp.qpn(), b.qp.qpn());
    connect(&mut a.qp, la, qb, p.psn_a, p.psn_b, p);
    connect(&mut b.qp, lb, qa, p.psn_b, p.psn_a, p);
    Pair { a, b }
}

impl Pair {
    /// Drives both engines once.
    pub fn pump(&self) -> usize {
        self.a.ctx.progress() + self.b.ctx.progress()
    }

    /// Drives both engines until neither moves a packet for a while.
    pub fn settle(&self) {
        let mut idle = 0;
        let start = Instant::now();
        while idle < 50 {
            if self.pump() == 0 {
                idle += 1;
            } else {
                idle = 0;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "engines never settled"
            );
        }
    }
}

/// Polls A's CQ, driving both engines, until `n` completions arrived; panics after 20 s.
pub fn wait_a(pair: &mut Pair, n: usize) -> Vec<WorkCompletion> {
    let Pair { a, b } = pair;
    poll_n(&a.ctx, &b.ctx, &mut a.cq, n)
}

/// Polls B's CQ, driving both engines, until `n` completions arrived; panics after 20 s.
pub fn wait_b(pair: &mut Pair, n: usize) -> Vec<WorkCompletion> {
    let Pair { a, b } = pair;
    poll_n(&a.ctx, &b.ctx, &mut b.cq, n)
}

pub fn poll_n(ca: &Context, cb: &Context, cq: &mut Cq, n: usize) -> Vec<WorkCompletion> {
    let mut out = vec![WorkCompletion::default(); n];
    let mut got = 0;
    let start = Instant::now();
    while got < n {
        ca.progress();
        cb.progress();
        got += cq.poll(&mut out[got..]);
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "only {got} of {n} completions arrived: {:?}",
            &out[..got]
        );
    }
    out
}

/// A deterministic byte pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// Two contexts built from `a` and `b` (arena and huge pages set from `p`), linked, with
/// one connected QP each; with `channels`, each CQ reports to a completion channel of its
/// context (returned for A and B).
pub fn pair_built(
    a: shmhca::ContextBuilder,
    b: shmhca::ContextBuilder,
    p: &Params,
    channels: bool,
) -> (Pair, Option<(shmhca::CompChannel, shmhca::CompChannel)>) {
    let build = |x: shmhca::ContextBuilder| {
        x.arena_size(p.arena)
            .huge_pages(shmhca_rings::HugePages::Never)
            .build()
            .expect("context")
    };
    let (ca, cb) = (build(a), build(b));
    let (la, lb) = ca.link_with(&cb).unwrap();
    let mut a = end(ca, la, p);
    let mut b = end(cb, lb, p);
    let mut chans = None;
    if channels {
        let with_channel = |e: &mut End| {
            let ch = e.ctx.create_comp_channel().unwrap();
            e.cq = e.ctx.create_cq_with_channel(4096, &ch).unwrap();
            e.qp = e.ctx.create_qp(&e.pd, &e.cq, &e.cq, p.caps).unwrap();
            ch
        };
        chans = Some((with_channel(&mut a), with_channel(&mut b)));
    }
    let (qa, qb) = (a.qp.qpn(), b.qp.qpn());
    connect(&mut a.qp, la, qb, p.psn_a, p.psn_b, p);
    connect(&mut b.qp, lb, qa, p.psn_b, p.psn_a, p);
    (Pair { a, b }, chans)
}
