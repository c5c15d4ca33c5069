//! Shared receive queues (`ibv_srq`): one receive queue feeding many QPs.
//! See the docs of [`Srq`] for how it works.

use crate::sync::Ordering;
use std::sync::Arc;

use shmhca_rings::ring::{HeapStorage, Producer, heap_ring};

use crate::device::Device;
use crate::error::{Error, Refused, Result};
use crate::mem::Mem;
use crate::qp::{AccessFlags, MAX_QUEUE_DEPTH, MAX_SGE};
use crate::tables::srq::{MAX_SRQS, SrqShared};
use crate::verbs::mr::{Pd, Sge};
use crate::verbs::wr::RecvWr;
use crate::wqe::{DataLoc, RqWqe, SGE_ENTRY_LEN, SgeEntry};

/// Shared receive queues (`ibv_srq`): one receive queue feeding many QPs.
///
/// A QP created with [`Context::create_qp_with_srq`](crate::Context::create_qp_with_srq)
/// takes its receive WQEs from the SRQ (in posting order, whichever of its QPs a message
/// arrives at) instead of its own receive queue, which it does not have: post receives
/// with [`Srq::post_recv`]. When the SRQ is empty, an arriving Send (or Write with
/// Immediate) gets an RNR Nak and is retried by its requester, as with a QP's own queue.
///
/// **Credits.** A QP on an SRQ cannot say how many receive WQEs wait for *its* peer —
/// they are shared with other QPs — so its Acks carry the invalid credit code 11111
/// ("not providing credit information", spec/02 Table 17-8). Its peer's SQ Logic then
/// behaves as without credits (spec/02: one Send at a time past its first packet, until
/// acknowledged); give the peer QP `remote_credits(false)` when you connect it by hand
/// ([`QpAttr::remote_credits`](crate::QpAttr::remote_credits)), which lifts that limit
/// and leaves flow control to RNR Naks. The connection manager does this by itself
/// ([`Listener::accept_with_srq`](crate::cm::Listener::accept_with_srq),
/// [`Context::connect_with_srq`](crate::Context::connect_with_srq)): the handshake tells
/// the peer.
///
/// **The limit event** (`IBV_EVENT_SRQ_LIMIT_REACHED`). [`Srq::arm_limit`]`(n)` arms it:
/// when the engine takes a receive from the SRQ and fewer than `n` remain, the event fires
/// once and disarms itself. It is reported by a flag the application reads with
/// [`Srq::limit_reached`] (true once per event); arm again to hear of the next one.
///
/// **One consumer.** The application is the SRQ ring's only producer (posting takes
/// `&mut self`) and the engine, which serves every QP of the context, its only consumer.
///
/// Dropping it while QPs use it keeps it alive (with its receives) until the last of them
/// is destroyed; [`Srq::destroy`] refuses instead.
///
/// ```
/// use shmhca::{AccessFlags, Context, EngineMode, QpCaps, RecvWr};
///
/// let ctx = Context::builder().mode(EngineMode::Inline).build()?;
/// let pd = ctx.alloc_pd()?;
/// let cq = ctx.create_cq(64)?;
/// let mut srq = pd.create_srq(64, 1)?;
/// let buf = pd.alloc_mr(64 * 256, AccessFlags::LOCAL_WRITE)?;
/// for i in 0..64u64 {
///     srq.post_recv(&RecvWr::new(i, &[buf.sge(i * 256, 256)?]))?;
/// }
/// assert_eq!(srq.outstanding(), 64);
/// srq.arm_limit(8); // limit_reached() once fewer than 8 remain
/// // Any number of QPs take their receives from it.
/// let qp1 = ctx.create_qp_with_srq(&pd, &cq, &cq, &srq, QpCaps::default())?;
/// let qp2 = ctx.create_qp_with_srq(&pd, &cq, &cq, &srq, QpCaps::default())?;
/// # let _ = (qp1, qp2);
/// # Ok::<(), shmhca::Error>(())
/// ```
pub struct Srq {
    pub(crate) shared: Arc<Device>,
    pub(crate) index: u32,
    pub(crate) pdn: u32,
    pub(crate) max_sge: u32,
    depth: u32,
    rq: Producer<RqWqe, HeapStorage<RqWqe>>,
    sshared: Arc<SrqShared>,
    posted: u64,
    taken: u64,
    /// Private memory of the scatter rows of multi-element receives (`depth` rows).
    tables: Mem,
}

impl Pd {
    /// A shared receive queue of `depth` receives of at most `max_sge` elements each, for
    /// QPs of this domain (`ibv_create_srq`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a depth of 0 or above 16,384 or `max_sge` of 0 or
    /// above 16; [`Error::LimitReached`] past 65,536 SRQs in the context.
    pub fn create_srq(&self, depth: u32, max_sge: u32) -> Result<Srq> {
        if depth == 0 || depth > MAX_QUEUE_DEPTH {
            return Err(Error::invalid(
                "SRQ depth",
                format!("{depth}; an SRQ holds 1 to {MAX_QUEUE_DEPTH} receives"),
            ));
        }
        if max_sge == 0 || max_sge > MAX_SGE {
            return Err(Error::invalid(
                "SRQ max_sge",
                format!("{max_sge}; a receive has 1 to {MAX_SGE} elements"),
            ));
        }
        let (rq, consumer) = heap_ring(depth.next_power_of_two() as usize)
            .map_err(|e| Error::invalid("SRQ depth", e.to_string()))?;
        let rows = if max_sge > 1 {
            u64::from(depth) * u64::from(max_sge) * SGE_ENTRY_LEN
        } else {
            0
        };
        let tables = Mem::private(rows as usize);
        let engine_tables = tables.share();
        let sshared = Arc::new(SrqShared::default());
        let s = sshared.clone();
        let pdn = self.pdn;
        let index = self
            .shared
            .engine
            .with(|e| {
                let i = e
                    .res
                    .srqs
                    .insert(pdn, consumer, engine_tables, max_sge, s)?;
                e.res.pds.hold(pdn);
                Some(i)
            })
            .ok_or(Error::LimitReached {
                what: "shared receive queues in one context",
                limit: MAX_SRQS,
            })?;
        Ok(Srq {
            shared: self.shared.clone(),
            index,
            pdn,
            max_sge,
            depth,
            rq,
            sshared,
            posted: 0,
            taken: 0,
            tables,
        })
    }
}

impl Srq {
    /// Its number in its context: what [`AsyncEvent::SrqLimitReached`](crate::AsyncEvent)
    /// names it by. A destroyed SRQ's number may be given to a new one.
    pub fn number(&self) -> u32 {
        self.index
    }

    /// Its depth: how many receives it holds at most.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Receives posted and not yet taken by a QP.
    pub fn outstanding(&mut self) -> u32 {
        self.refresh();
        (self.posted - self.taken) as u32
    }

    fn refresh(&mut self) {
        // SYNC: Acquire pairs with the Release store of `taken` in `SrqTable::take`.
        self.taken = self.sshared.taken.load(Ordering::Acquire);
    }

    /// Posts a receive (`ibv_post_srq_recv`): the next message to arrive at any QP on this
    /// SRQ may land in it.
    ///
    /// # Errors
    /// [`Error::QueueFull`] when `depth` receives wait, [`Error::InvalidArgument`] for
    /// more than `max_sge` elements, a region without `LOCAL_WRITE` or of another
    /// protection domain, [`Error::ForeignObject`] for a region of another context.
    /// Nothing is posted on error.
    pub fn post_recv(&mut self, wr: &RecvWr<'_>) -> Result<()> {
        if self.posted - self.taken >= u64::from(self.depth) {
            self.refresh();
            if self.posted - self.taken >= u64::from(self.depth) {
                return Err(Error::QueueFull {
                    queue: "shared receive queue",
                    depth: self.depth,
                });
            }
        }
        self.check(wr.sgl)?;
        let entry = |s: &Sge<'_>| SgeEntry {
            off: s.mr.dst_off(s.offset),
            len: s.len,
            mr: s.mr.index,
        };
        let data = match wr.sgl {
            [] => DataLoc::Empty,
            [s] => DataLoc::Single(entry(s)),
            many => {
                // Rows are taken in posting order, and fewer than `depth` receives wait:
                // this row's previous receive was taken (its entries copied out).
                let row = self.posted % u64::from(self.depth);
                let table = row * u64::from(self.max_sge) * SGE_ENTRY_LEN;
                for (i, s) in many.iter().enumerate() {
                    self.tables
                        .write(table + i as u64 * SGE_ENTRY_LEN, &entry(s).to_bytes())
                        .map_err(|_| Error::invalid("scatter list", "longer than its row"))?;
                }
                DataLoc::Table {
                    table,
                    n: many.len() as u32,
                }
            }
        };
        for s in wr.sgl {
            s.mr.inflight.post_outside(1);
        }
        if self
            .rq
            .push(RqWqe {
                wr_id: wr.wr_id,
                data,
            })
            .is_err()
        {
            unreachable!("the SRQ ring holds depth WQEs and fewer wait");
        }
        self.posted += 1;
        Ok(())
    }

    fn check(&self, sgl: &[Sge<'_>]) -> Result<()> {
        if sgl.len() > self.max_sge as usize {
            return Err(Error::invalid(
                "scatter list",
                format!(
                    "{} elements; this SRQ takes at most {}",
                    sgl.len(),
                    self.max_sge
                ),
            ));
        }
        for s in sgl {
            if !Arc::ptr_eq(&s.mr.shared, &self.shared) {
                return Err(Error::ForeignObject {
                    what: "a memory region in the list",
                });
            }
            if s.mr.pdn != self.pdn {
                return Err(Error::invalid(
                    "scatter list",
                    "a memory region of another protection domain than the SRQ's",
                ));
            }
            if !s.mr.access().contains(AccessFlags::LOCAL_WRITE) {
                return Err(Error::invalid(
                    "scatter list",
                    format!(
                        "memory region {:#x} lacks LOCAL_WRITE, which the engine needs to write received data into it",
                        s.mr.lkey()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Arms the SRQ limit event: it fires once when, after a QP took a receive, fewer than
    /// `n` remain (0 disarms). See [`Srq::limit_reached`].
    pub fn arm_limit(&self, n: u32) {
        // SYNC: Relaxed: the engine reads it on its next take; nothing else depends on it.
        self.sshared.limit.store(n, Ordering::Relaxed);
    }

    /// Whether the limit event fired since the last call (true once per event; the event
    /// disarms itself: arm again with [`Srq::arm_limit`]).
    pub fn limit_reached(&self) -> bool {
        // SYNC: Acquire pairs with the engine's Release store in `SrqTable::take`.
        self.sshared.limit_fired.swap(false, Ordering::Acquire)
    }

    /// Destroys the SRQ now (`ibv_destroy_srq`); its waiting receives are dropped (their
    /// regions are free again, no completions).
    ///
    /// # Errors
    /// Gives the SRQ back (a [`Refused`]; `?` turns it into [`Error`]) with [`Error::SrqInUse`] while QPs use it.
    // The SRQ is given back by value, as `Mr::deregister` gives its region back.
    #[allow(clippy::result_large_err)]
    pub fn destroy(self) -> std::result::Result<(), Refused<Srq>> {
        let index = self.index;
        let qps = self
            .shared
            .engine
            .with(|e| e.res.srqs.get_mut(index).map_or(0, |s| s.qps));
        if qps != 0 {
            return Err(Refused::new(self, Error::SrqInUse { qps }));
        }
        drop(self);
        Ok(())
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        let index = self.index;
        self.shared.engine.with(|e| {
            let crate::context::Resources { srqs, mrs, pds, .. } = &mut e.res;
            srqs.orphan(index, mrs, pds);
        });
        // Its number may soon name another SRQ, which must not get its events.
        self.shared.async_events.forget_srq(self.number());
    }
}

impl std::fmt::Debug for Srq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Srq")
            .field("depth", &self.depth)
            .field("max_sge", &self.max_sge)
            .finish_non_exhaustive()
    }
}
