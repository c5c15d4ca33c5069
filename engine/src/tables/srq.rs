//! Shared receive queues as the engine holds them.
//!
//! An SRQ is one receive ring (SPSC: the application's [`crate::Srq`] posts, the engine
//! consumes) whose WQEs the RQ Logic of every QP attached to it takes, one message at a
//! time. There is still one consumer: the engine, under its token, serves every QP of the
//! context. A WQE taken by a QP leaves the SRQ at once: its multi-element scatter list is
//! copied from the SRQ's table row into the QP's own scratch row (a QP receives one message
//! at a time), so the SRQ's rows are free again in taking order even though the QPs retire
//! their receives in any order. The SRQ's `retired` counter therefore counts WQEs *taken*:
//! posted − taken is exactly what the SRQ holds, for `post_recv`'s room check and for the
//! limit event.

use crate::sync::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use shmhca_rings::ring::{Consumer, HeapStorage};

use crate::arena::PdArenas;
use crate::async_events::{AsyncEvent, AsyncQueue};
use crate::mem::Mem;
use crate::slots::SlotTable;
use crate::tables::mr::MrTable;
use crate::wqe::{DataLoc, NO_MR, RqWqe, SGE_ENTRY_LEN, SgeEntry};

/// What an SRQ's application handle and the engine share.
#[derive(Debug, Default)]
pub(crate) struct SrqShared {
    /// WQEs taken from the ring by QPs. Written by the engine (Release), read by
    /// `Srq::post_recv` (Acquire) before it reuses a slot and its table row.
    pub(crate) taken: AtomicU64,
    /// The armed limit (0: not armed). Set by `Srq::arm_limit`, cleared by the engine when
    /// it fires.
    pub(crate) limit: AtomicU32,
    /// Set once by the engine when the limit fired; cleared by `Srq::limit_reached`.
    pub(crate) limit_fired: AtomicBool,
}

/// One SRQ.
pub(crate) struct SrqCtx {
    pub(crate) pd: u32,
    rq: Consumer<RqWqe, HeapStorage<RqWqe>>,
    /// Private memory of the scatter rows of multi-element WQEs.
    tables: Mem,
    pub(crate) max_sge: u32,
    shared: Arc<SrqShared>,
    taken: u64,
    /// QPs attached.
    pub(crate) qps: u32,
    /// The application's handle was dropped: the SRQ goes with its last QP.
    orphan: bool,
}

/// The table.
pub(crate) struct SrqTable {
    entries: SlotTable<SrqCtx>,
}

/// The most SRQs one context can hold.
pub(crate) const MAX_SRQS: u32 = crate::limits::MAX_SRQS;

impl Default for SrqTable {
    fn default() -> SrqTable {
        SrqTable {
            entries: SlotTable::new(MAX_SRQS, 8),
        }
    }
}

impl SrqTable {
    /// Adds an SRQ; returns its index, or `None` past [`MAX_SRQS`].
    pub(crate) fn insert(
        &mut self,
        pd: u32,
        rq: Consumer<RqWqe, HeapStorage<RqWqe>>,
        tables: Mem,
        max_sge: u32,
        shared: Arc<SrqShared>,
    ) -> Option<u32> {
        self.entries
            .insert_with(|_, _| SrqCtx {
                pd,
                rq,
                tables,
                max_sge,
                shared,
                taken: 0,
                qps: 0,
                orphan: false,
            })
            .map(|(i, _)| i)
    }

    /// The SRQ at `index`.
    pub(crate) fn get_mut(&mut self, index: u32) -> Option<&mut SrqCtx> {
        self.entries.at_mut(index)
    }

    /// Takes the next receive WQE of SRQ `index` for a QP whose private scratch row (of the
    /// SRQ's `max_sge` entries) is at `scratch` of `qp_tables`. `None` if the SRQ is empty.
    ///
    /// Fires the limit event if, after this, fewer WQEs than the armed limit remain: the
    /// polled flag (`Srq::limit_reached`) and an asynchronous event in `events`.
    pub(crate) fn take(
        &mut self,
        srq: shmhca_proto::ids::SrqId,
        qp_tables: &Mem,
        scratch: u64,
        events: &AsyncQueue,
    ) -> Option<RqWqe> {
        let s = self.entries.at_mut(srq.get())?;
        let mut wqe = s.rq.pop().ok().flatten()?;
        if let DataLoc::Table { table, n } = wqe.data {
            let mut ok = n <= s.max_sge;
            for i in 0..n.min(s.max_sge) {
                let e = SgeEntry::read(&s.tables, table, i).unwrap_or(SgeEntry {
                    off: 0,
                    len: 0,
                    mr: NO_MR,
                });
                ok &= qp_tables
                    .write(scratch + u64::from(i) * SGE_ENTRY_LEN, &e.to_bytes())
                    .is_ok();
            }
            // Rows are written by `Srq::post_recv` within bounds; a failure here would be
            // an engine bug, and yields an empty list (a length error), never a panic.
            wqe.data = if ok {
                DataLoc::Table { table: scratch, n }
            } else {
                DataLoc::Empty
            };
        }
        s.taken += 1;
        // SYNC: Release pairs with the Acquire load in `Srq::post_recv`: the row was read
        // before the application may write it again.
        s.shared.taken.store(s.taken, Ordering::Release);
        // SYNC: Relaxed: the limit is a hint the application armed; a stale read delays the
        // event by one receive at most.
        let limit = s.shared.limit.load(Ordering::Relaxed);
        if limit != 0 && s.rq.available().unwrap_or(0) < limit as usize {
            s.shared.limit.store(0, Ordering::Relaxed);
            // SYNC: Release pairs with the Acquire swap in `Srq::limit_reached`.
            s.shared.limit_fired.store(true, Ordering::Release);
            events.raise(AsyncEvent::SrqLimitReached { srq: srq.get() });
        }
        Some(wqe)
    }

    /// Detaches a QP from SRQ `index`; frees an orphaned SRQ with its last QP.
    pub(crate) fn detach(&mut self, index: u32, mrs: &mut MrTable, pds: &mut PdArenas) {
        let Some(s) = self.entries.at_mut(index) else {
            return;
        };
        s.qps = s.qps.saturating_sub(1);
        if s.orphan && s.qps == 0 {
            self.free(index, mrs, pds);
        }
    }

    /// The application dropped SRQ `index`: freed now if no QP uses it, else with its last
    /// QP.
    pub(crate) fn orphan(&mut self, index: u32, mrs: &mut MrTable, pds: &mut PdArenas) {
        let Some(s) = self.entries.at_mut(index) else {
            return;
        };
        s.orphan = true;
        if s.qps == 0 {
            self.free(index, mrs, pds);
        }
    }

    /// Removes SRQ `index`, releasing the regions its remaining WQEs held.
    fn free(&mut self, index: u32, mrs: &mut MrTable, pds: &mut PdArenas) {
        let Some(mut s) = self.entries.remove_at(index) else {
            return;
        };
        while let Ok(Some(wqe)) = s.rq.pop() {
            wqe.data.for_each_mr(&s.tables, |mr| mrs.release(mr, pds));
        }
        pds.unhold(s.pd);
    }
}
