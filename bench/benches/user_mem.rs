//! Registered application memory against arena regions (criterion), between two engines
//! driven by this thread (inline mode), the same buffer kind on both sides:
//!
//! * `send/{arena,vec,memfd,memfd_pd}/N`: one N-byte Send from A's buffer into B's, until both
//!   completions are polled — a sender's registered buffer is copied into its shadow at
//!   post time; the receiver's is written in place.
//! * `write16/{arena,vec,memfd,memfd_pd}/N`: 16 RDMA Writes of N bytes in flight, until all 16
//!   completions — bandwidth of the source path.
//! * `read16/{arena,vec,memfd,memfd_pd}/N`: 16 RDMA Reads of N bytes from B's buffer into A's — B's
//!   responder stages a registered buffer in its shadow per response packet.
//!
//! `cargo bench -p shmhca-bench --bench user_mem`
#![allow(missing_docs)]

use std::ops::Deref;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use shmhca::{
    AccessFlags, Context, Cq, Destination, EngineMode, Memfd, Mr, Mtu, Pd, Qp, QpAttr, QpCaps,
    QpState, RecvWr, SendOp, SendWr, UserMr, WcStatus, WorkCompletion,
};

const LEN: usize = 1 << 20;

#[derive(Clone, Copy)]
enum Kind {
    Arena,
    Vec,
    Memfd,
    /// A region in place in a protection domain over the application's memfd
    /// (`Context::alloc_pd_over`, `Pd::reg_mr_at`): no shadow.
    MemfdPd,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Arena => "arena",
            Kind::Vec => "vec",
            Kind::Memfd => "memfd",
            Kind::MemfdPd => "memfd_pd",
        }
    }
}

enum Buf {
    Arena(Mr),
    Vec(UserMr<Vec<u8>>),
    Memfd(UserMr<Memfd>),
}

impl Deref for Buf {
    type Target = Mr;
    fn deref(&self) -> &Mr {
        match self {
            Buf::Arena(m) => m,
            Buf::Vec(m) => m,
            Buf::Memfd(m) => m,
        }
    }
}

/// Bytes of a memfd domain kept for shmhca's own use (inline staging).
const STAGING: u64 = 1 << 20;

fn memfd(len: u64, sealing: bool) -> std::os::fd::OwnedFd {
    let mut flags = rustix::fs::MemfdFlags::CLOEXEC;
    if sealing {
        flags |= rustix::fs::MemfdFlags::ALLOW_SEALING;
    }
    let fd = rustix::fs::memfd_create("bench", flags).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    fd
}

fn pd(ctx: &Context, kind: Kind) -> Pd {
    match kind {
        Kind::MemfdPd => ctx
            .alloc_pd_over(memfd(LEN as u64 + STAGING, true), STAGING)
            .unwrap(),
        _ => ctx.alloc_pd().unwrap(),
    }
}

fn buf(pd: &Pd, kind: Kind) -> Buf {
    match kind {
        Kind::MemfdPd => Buf::Arena(pd.reg_mr_at(0, LEN as u64, AccessFlags::ALL).unwrap()),
        Kind::Arena => Buf::Arena(pd.alloc_mr(LEN as u64, AccessFlags::ALL).unwrap()),
        Kind::Vec => Buf::Vec(pd.reg_mr(vec![0u8; LEN], AccessFlags::ALL).unwrap()),
        Kind::Memfd => {
            let m = Memfd::map(memfd(LEN as u64, true)).unwrap();
            Buf::Memfd(pd.reg_mr(m, AccessFlags::ALL).unwrap())
        }
    }
}

struct Side {
    ctx: Context,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    buf: Buf,
}

fn setup(kind: Kind) -> (Side, Side) {
    let mk = || {
        Context::builder()
            .mode(EngineMode::Inline)
            .arena_size(8 << 20)
            .build()
            .unwrap()
    };
    let (ca, cb) = (mk(), mk());
    let (la, lb) = ca.link_with(&cb).unwrap();
    let side = |ctx: Context| {
        let pd = pd(&ctx, kind);
        let cq = ctx.create_cq(256).unwrap();
        let caps = QpCaps {
            max_send_wr: 64,
            max_recv_wr: 64,
            ..QpCaps::default()
        };
        let qp = ctx.create_qp(&pd, &cq, &cq, caps).unwrap();
        let buf = buf(&pd, kind);
        Side {
            ctx,
            _pd: pd,
            cq,
            qp,
            buf,
        }
    };
    let (mut a, mut b) = (side(ca), side(cb));
    let (qa, qb) = (a.qp.qpn(), b.qp.qpn());
    for (qp, link, remote) in [(&mut a.qp, la, qb), (&mut b.qp, lb, qa)] {
        qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::ALL))
            .unwrap();
        qp.modify(
            &QpAttr::new(QpState::Rtr)
                .path_mtu(Mtu::Mtu4096)
                .dest(Destination { link, qpn: remote })
                .rq_psn(0)
                .max_dest_rd_atomic(16)
                .min_rnr_timer(1),
        )
        .unwrap();
        qp.modify(
            &QpAttr::new(QpState::Rts)
                .sq_psn(0)
                .timeout(14)
                .retry_cnt(7)
                .rnr_retry(7)
                .max_rd_atomic(16),
        )
        .unwrap();
    }
    (a, b)
}

fn poll(a: &mut Side, b: &Side, n: usize) {
    let mut wc = [WorkCompletion::default(); 16];
    let mut got = 0;
    while got < n {
        a.ctx.progress();
        b.ctx.progress();
        let k = a.cq.poll(&mut wc[..(n - got).min(16)]);
        for w in &wc[..k] {
            assert_eq!(w.status, WcStatus::Success);
        }
        got += k;
    }
}

const KINDS: [Kind; 4] = [Kind::Arena, Kind::Vec, Kind::Memfd, Kind::MemfdPd];

fn send(c: &mut Criterion) {
    let mut g = c.benchmark_group("send");
    for n in [64u32, 4096, 65536] {
        g.throughput(Throughput::Bytes(u64::from(n)));
        for kind in KINDS {
            let (mut a, mut b) = setup(kind);
            g.bench_function(BenchmarkId::new(kind.name(), n), |bench| {
                bench.iter(|| {
                    let r = [b.buf.sge(0, n).unwrap()];
                    b.qp.post_recv(&RecvWr::new(1, &r)).unwrap();
                    let s = [a.buf.sge(0, n).unwrap()];
                    a.qp.post_send(&SendWr::new(2, SendOp::Send, &s)).unwrap();
                    poll(&mut a, &b, 1);
                    let mut wc = [WorkCompletion::default(); 1];
                    while b.cq.poll(&mut wc) == 0 {
                        a.ctx.progress();
                        b.ctx.progress();
                    }
                });
            });
        }
    }
    g.finish();
}

fn rdma16(c: &mut Criterion, name: &str, read: bool) {
    let mut g = c.benchmark_group(name);
    for n in [4096u32, 65536] {
        g.throughput(Throughput::Bytes(16 * u64::from(n)));
        for kind in KINDS {
            let (mut a, b) = setup(kind);
            g.bench_function(BenchmarkId::new(kind.name(), n), |bench| {
                bench.iter(|| {
                    for i in 0..16u64 {
                        let off = i * u64::from(n);
                        let remote = b.buf.remote(off);
                        let op = if read {
                            SendOp::RdmaRead(remote)
                        } else {
                            SendOp::RdmaWrite(remote)
                        };
                        let s = [a.buf.sge(off, n).unwrap()];
                        a.qp.post_send(&SendWr::new(i, op, &s)).unwrap();
                    }
                    poll(&mut a, &b, 16);
                });
            });
        }
    }
    g.finish();
}

fn write16(c: &mut Criterion) {
    rdma16(c, "write16", false);
}

fn read16(c: &mut Criterion) {
    rdma16(c, "read16", true);
}

criterion_group!(benches, send, write16, read16);
criterion_main!(benches);
