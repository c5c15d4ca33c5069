//! Two connected QPs in one process: the smallest complete set-up, for examples and for the
//! tests of programs built on shmhca.

use crate::error::Result;
use crate::qp::{AccessFlags, Destination, Mtu, QpAttr, QpCaps, QpState};
use crate::verbs::{Context, Cq, EngineMode, Pd, Qp};

/// One end of a [`Loopback`]: its engine, protection domain, completion queue (for sends and
/// receives alike) and QP in RTS.
pub struct LoopbackEnd {
    /// The QP, in RTS, connected to the other end's.
    pub qp: Qp,
    /// The completion queue of both the QP's queues.
    pub cq: Cq,
    /// The protection domain of the QP; allocate the end's regions here.
    pub pd: Pd,
    /// The end's engine (its HCA), in inline mode.
    pub ctx: Context,
}

/// Two inline-mode engines in this process, linked, each with one QP in RTS connected to
/// the other's — what two processes get from [`cm`](crate::cm), set up by hand the way the
/// README's first example does. The QPs allow `access` (remote write, read and atomic by
/// default), with PSN 0 both ways, a 4096-byte path MTU, one Read or Atomic outstanding each
/// way, 7 retries and the shortest RNR timer.
///
/// Both engines run inline: nothing moves unless a call drives them, so a loop that waits
/// for a completion calls [`Loopback::progress`] (or polls both CQs).
///
/// ```
/// use shmhca::{AccessFlags, Loopback, RecvWr, SendOp, SendWr, WcStatus, WorkCompletion};
///
/// let mut lo = Loopback::new()?;
/// let src = lo.a.pd.alloc_mr(64, AccessFlags::NONE)?;
/// let dst = lo.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
/// src.write_at(0, b"ping")?;
/// lo.b.qp.post_recv(&RecvWr::new(1, &[dst.sge(0, 64)?]))?;
/// lo.a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 4)?]))?;
/// let wc = lo.wait_b()?;
/// assert_eq!((wc.wr_id, wc.status, wc.byte_len), (1, WcStatus::Success, 4));
/// # Ok::<(), shmhca::Error>(())
/// ```
pub struct Loopback {
    /// The first end.
    pub a: LoopbackEnd,
    /// The second end.
    pub b: LoopbackEnd,
}

/// How many engine iterations [`Loopback::wait_a`] and [`Loopback::wait_b`] run before
/// they give up.
const WAIT_ITERATIONS: u32 = 1_000_000;

impl Loopback {
    /// Two connected QPs allowing remote write, read and atomic access.
    ///
    /// # Errors
    /// What building a context, a domain, a queue or a QP can fail with (shared memory
    /// refused by the system, for instance).
    pub fn new() -> Result<Loopback> {
        Loopback::with_access(
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
        )
    }

    /// Two connected QPs allowing `access` (a QP's remote access flags, as
    /// [`QpAttr::access`]).
    ///
    /// # Errors
    /// As [`Loopback::new`].
    pub fn with_access(access: AccessFlags) -> Result<Loopback> {
        let build = || -> Result<(Context, Pd, Cq)> {
            let ctx = Context::builder()
                .mode(EngineMode::Inline)
                .arena_size(4 << 20)
                .build()?;
            let pd = ctx.alloc_pd()?;
            let cq = ctx.create_cq(256)?;
            Ok((ctx, pd, cq))
        };
        let ((ca, pa, qa_cq), (cb, pb, qb_cq)) = (build()?, build()?);
        let (la, lb) = ca.link_with(&cb)?;
        let mut qa = ca.create_qp(&pa, &qa_cq, &qa_cq, QpCaps::default())?;
        let mut qb = cb.create_qp(&pb, &qb_cq, &qb_cq, QpCaps::default())?;
        let (na, nb) = (qa.qpn(), qb.qpn());
        for (qp, link, qpn) in [(&mut qa, la, nb), (&mut qb, lb, na)] {
            qp.modify(&QpAttr::new(QpState::Init).access(access))?;
            qp.modify(
                &QpAttr::new(QpState::Rtr)
                    .path_mtu(Mtu::Mtu4096)
                    .dest(Destination { link, qpn })
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
        Ok(Loopback {
            a: LoopbackEnd {
                qp: qa,
                cq: qa_cq,
                pd: pa,
                ctx: ca,
            },
            b: LoopbackEnd {
                qp: qb,
                cq: qb_cq,
                pd: pb,
                ctx: cb,
            },
        })
    }

    /// Runs both engines once.
    pub fn progress(&self) {
        self.a.ctx.progress();
        self.b.ctx.progress();
    }

    /// Drives both engines until end A's completion queue has a completion, and returns it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if none came within a
    /// million engine iterations (nothing was posted that completes there).
    pub fn wait_a(&mut self) -> Result<crate::WorkCompletion> {
        let Loopback { a, b } = self;
        wait(a, b)
    }

    /// Drives both engines until end B's completion queue has a completion, and returns it.
    ///
    /// # Errors
    /// As [`Loopback::wait_a`].
    pub fn wait_b(&mut self) -> Result<crate::WorkCompletion> {
        let Loopback { a, b } = self;
        wait(b, a)
    }
}

/// Polls the completion queue of `this`, running both engines between polls, for a bounded
/// number of iterations.
fn wait(this: &mut LoopbackEnd, other: &LoopbackEnd) -> Result<crate::WorkCompletion> {
    let mut wc = [crate::WorkCompletion::default(); 1];
    for _ in 0..WAIT_ITERATIONS {
        if this.cq.poll(&mut wc) == 1 {
            return Ok(wc[0]);
        }
        this.ctx.progress();
        other.ctx.progress();
    }
    Err(crate::Error::invalid(
        "Loopback wait",
        "no completion after a million engine iterations: was a work request posted that \
         completes at this end (and a receive for a Send)?",
    ))
}
