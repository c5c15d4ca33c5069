//! The engine's atomics shim: the atomics through which the application's handles and the
//! engine hand work to each other come from here, so that `--cfg shmhca_loom` swaps them for
//! loom's model-checked ones (as `shmhca_rings::sync` does for the rings and the doorbell).
//!
//! What goes through the shim: the QP's shared words ([`QpShared`](crate::context::QpShared):
//! state, `sq_retired`, `rq_retired`, ...), the regions' in-flight counts
//! ([`MrShared`](crate::tables::mr::MrShared)) and the engine token
//! ([`EngineCell`](crate::engine::cell::EngineCell)). Atomics in shared memory (a peer's
//! sleeper count and kick words, remote atomics on an arena) and process-wide counters stay `std`'s.
//!
//! Under loom, besides the atomics, [`LoomLines`] lets a [`Mem`](crate::mem::Mem) announce
//! each byte access to loom, so that a missing happens-before edge between the
//! application's and the engine's accesses to memory (inline staging, gather tables,
//! memory regions) is reported as a causality violation. Without loom it does not exist.
//!
//! [`weaken`] marks the orderings the loom models weaken on purpose (see
//! `shmhca_rings::sync::mutation`).

pub(crate) use shmhca_rings::sync::{Ordering, spin_loop, weaken};

/// Gives the processor to another thread (under loom: to another thread of the model).
#[inline]
pub(crate) fn yield_now() {
    #[cfg(not(shmhca_loom))]
    std::thread::yield_now();
    #[cfg(shmhca_loom)]
    loom::thread::yield_now();
}

#[cfg(not(shmhca_loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64};

#[cfg(shmhca_loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64};

/// Under loom: one loom cell per line of a [`Mem`](crate::mem::Mem), through which every
/// access to its bytes is announced to loom (the bytes themselves are copied as without
/// loom). Made with the memory, shared by all its views.
#[cfg(shmhca_loom)]
pub(crate) struct LoomLines {
    cells: Box<[loom::cell::UnsafeCell<()>]>,
    /// log2 of the bytes one cell covers.
    shift: u32,
}

#[cfg(shmhca_loom)]
impl LoomLines {
    /// The most cells of one memory: larger memories get coarser lines.
    const MAX_CELLS: usize = 1024;

    /// Cells for `len` bytes: one per 64-byte line, or per larger power of two so that
    /// there are at most [`Self::MAX_CELLS`].
    pub(crate) fn new(len: usize) -> LoomLines {
        let mut shift = 6;
        while len.div_ceil(1 << shift) > Self::MAX_CELLS {
            shift += 1;
        }
        let n = len.div_ceil(1 << shift);
        LoomLines {
            cells: (0..n).map(|_| loom::cell::UnsafeCell::new(())).collect(),
            shift,
        }
    }

    /// Announces a read (`write` false) or a write of `len` bytes at `off` (in bounds).
    pub(crate) fn track(&self, off: usize, len: usize, write: bool) {
        // While a model unwinds from a failure loom reported, destructors (a region
        // zeroed as it is freed) must not report again: a second panic would abort.
        if len == 0 || std::thread::panicking() {
            return;
        }
        let (first, last) = (off >> self.shift, (off + len - 1) >> self.shift);
        for cell in &self.cells[first..=last.min(self.cells.len() - 1)] {
            if write {
                cell.with_mut(|_| ());
            } else {
                cell.with(|_| ());
            }
        }
    }
}
