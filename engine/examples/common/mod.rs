//! What the single-thread examples share: two inline-mode contexts in this process, linked,
//! each with a protection domain, a completion queue and an RC QP connected to the other's.

use shmhca::*;

/// Two connected sides (`a` and `b`). Fields drop in order: the QPs before the queues and
/// domains they use, the contexts last.
pub(crate) struct Pair {
    /// Side a's QP, connected to `qb`.
    pub(crate) qa: Qp,
    /// Side b's QP, connected to `qa`.
    pub(crate) qb: Qp,
    /// Side a's completion queue (sends and receives).
    pub(crate) ca: Cq,
    /// Side b's completion queue.
    pub(crate) cb: Cq,
    /// Side a's protection domain.
    pub(crate) pa: Pd,
    /// Side b's protection domain.
    pub(crate) pb: Pd,
    /// Side a's context.
    pub(crate) a: Context,
    /// Side b's context.
    pub(crate) b: Context,
}

/// Builds a [`Pair`]: CQs of `cq_depth`, QPs with `caps`, both in RTS (PMTU 4096, one
/// outstanding Read or Atomic each way, retries and RNR retries 7).
#[allow(dead_code)] // not every example that shares this module uses it
pub(crate) fn connected_pair(cq_depth: u32, caps: QpCaps) -> shmhca::Result<Pair> {
    connected_pair_with(cq_depth, caps, AccessFlags::NONE)
}

/// [`connected_pair`] with the QPs' remote access rights `access` (RDMA Read, Write,
/// Atomic).
#[allow(dead_code)] // not every example that shares this module uses it
pub(crate) fn connected_pair_with(
    cq_depth: u32,
    caps: QpCaps,
    access: AccessFlags,
) -> shmhca::Result<Pair> {
    let ctx = || {
        Context::builder()
            .mode(EngineMode::Inline)
            .arena_size(4 << 20)
            .huge_pages(shmhca_rings::HugePages::Never)
            .build()
    };
    let (a, b) = (ctx()?, ctx()?);
    let (la, lb) = a.link_with(&b)?;
    let (pa, pb) = (a.alloc_pd()?, b.alloc_pd()?);
    let (ca, cb) = (a.create_cq(cq_depth)?, b.create_cq(cq_depth)?);
    let mut qa = a.create_qp(&pa, &ca, &ca, caps)?;
    let mut qb = b.create_qp(&pb, &cb, &cb, caps)?;
    let (na, nb) = (qa.qpn(), qb.qpn());
    for (qp, link, remote) in [(&mut qa, la, nb), (&mut qb, lb, na)] {
        qp.modify(&QpAttr::new(QpState::Init).access(access))?;
        qp.modify(
            &QpAttr::new(QpState::Rtr)
                .path_mtu(Mtu::Mtu4096)
                .dest(Destination { link, qpn: remote })
                .rq_psn(0)
                .max_dest_rd_atomic(1)
                .min_rnr_timer(1),
        )?;
        qp.modify(
            &QpAttr::new(QpState::Rts)
                .sq_psn(0)
                .timeout(14)
                .retry_cnt(7)
                .rnr_retry(7)
                .max_rd_atomic(1),
        )?;
    }
    Ok(Pair {
        qa,
        qb,
        ca,
        cb,
        pa,
        pb,
        a,
        b,
    })
}
