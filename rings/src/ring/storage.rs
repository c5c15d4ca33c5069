//! Where a ring's two indices and its slots live: on the heap (one process; the storage
//! loom and Miri check) or in a [`Segment`] (between processes).
//!
//! The ring logic in [`super`] is written once, against the sealed [`Storage`] trait.
//!
//! # Shared-memory layout
//!
//! A ring occupies [`shm_ring_bytes`](super::shm_ring_bytes) bytes at a 128-byte-aligned
//! offset in a segment's data area:
//!
//! ```text
//! +0    RingMeta (magic, version, slot size, capacity), then the two attach flags
//! +128  tail: the producer index (u64), alone on its 128-byte line pair
//! +256  head: the consumer index (u64), alone on its 128-byte line pair
//! +384  capacity slots of size_of::<T>() bytes each
//! ```
//!
//! 128 bytes rather than 64 because Intel's adjacent-line prefetcher fetches cache lines in
//! pairs: two indices 64 bytes apart would still interfere (crossbeam's `CachePadded` makes
//! the same choice on x86_64).
//!
//! # Under loom
//!
//! With `--cfg shmhca_loom` the segment is the same memfd mapping and the index code is
//! the same (`atomic_u64` at `TAIL_OFFSET`/`HEAD_OFFSET`, `load_*`/`store_*`), but two
//! things are substituted so that loom can see them: the two index words are loom atomics,
//! written into the segment at their offsets by `init_shm_ring`, and every slot access is
//! also announced to a loom cell, one per slot, kept in the segment after the slot array
//! (`loom_cells_offset`). Slot bytes are still copied exactly as without loom.

// Raw access to slots and to atomics placed in an mmap; each unsafe block says why it is
// sound.
#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use crossbeam_utils::CachePadded;

use crate::segment::Segment;
use crate::sync::{self, Ordering, UnsafeCell};

/// Offset of the producer index from the start of a shared ring.
pub(super) const TAIL_OFFSET: usize = 128;
/// Offset of the consumer index from the start of a shared ring.
pub(super) const HEAD_OFFSET: usize = 256;
/// Offset of slot 0 from the start of a shared ring.
pub(super) const SLOTS_OFFSET: usize = 384;
/// Required alignment of a shared ring's offset in the data area.
pub(super) const RING_ALIGN: usize = 128;
/// Offset of the producer's attach flag.
const PRODUCER_CLAIM_OFFSET: usize = 64;
/// Offset of the consumer's attach flag.
const CONSUMER_CLAIM_OFFSET: usize = 68;

/// The first bytes of a shared ring: written by [`init_shm_ring`](super::init_shm_ring),
/// copied out and validated by every attach.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub(super) struct RingMeta {
    pub(super) magic: u64,
    pub(super) version: u32,
    pub(super) slot_size: u32,
    pub(super) capacity: u64,
}

mod sealed {
    /// The storage operations the ring logic needs. Sealed: only this module implements it.
    ///
    /// Indices are free-running `u64`s; a slot is addressed by `index & mask`.
    #[allow(unreachable_pub)] // the sealed-trait pattern: public, but not nameable outside
    pub trait RawStorage<T: Copy> {
        /// Slot count (a power of two), a private copy validated at creation/attach.
        fn capacity(&self) -> usize;
        fn load_tail(&self, order: super::Ordering) -> u64;
        fn store_tail(&self, value: u64, order: super::Ordering);
        fn load_head(&self, order: super::Ordering) -> u64;
        fn store_head(&self, value: u64, order: super::Ordering);
        /// Writes `values` into the slots from index `first` on (wrapping around).
        ///
        /// # Safety
        ///
        /// The caller is the producer and owns these slots: `values.len()` ≤ free slots
        /// counted from `first`, i.e. the consumer has released them (Acquire on head).
        unsafe fn write_slots(&self, first: u64, values: &[T]);
        /// Copies the slots from index `first` on (wrapping around) into `out`.
        ///
        /// # Safety
        ///
        /// The caller is the consumer and these slots are published: `out.len()` ≤
        /// available slots counted from `first` (Acquire on tail).
        unsafe fn read_slots(&self, first: u64, out: &mut [T]);
        /// Writes one slot.
        ///
        /// # Safety
        ///
        /// As [`write_slots`](RawStorage::write_slots) for one slot.
        unsafe fn write_slot(&self, index: u64, value: T);
        /// Copies one slot out.
        ///
        /// # Safety
        ///
        /// As [`read_slots`](RawStorage::read_slots) for one slot.
        unsafe fn read_slot(&self, index: u64) -> T;
        /// Hints that the slot at `index` will be read soon. Never faults.
        fn prefetch(&self, index: u64) {
            let _ = index;
        }
    }
}

pub(super) use sealed::RawStorage;

/// Where a ring's indices and slots live: [`HeapStorage`] or [`ShmStorage`]. Sealed.
pub trait Storage<T: Copy>: RawStorage<T> {}

impl<T: Copy, S: RawStorage<T>> Storage<T> for S {}

// ---------------------------------------------------------------------------------------
// Heap storage
// ---------------------------------------------------------------------------------------

struct HeapRing<T> {
    tail: CachePadded<sync::AtomicU64>,
    head: CachePadded<sync::AtomicU64>,
    slots: Box<[UnsafeCell<MaybeUninit<T>>]>,
    mask: usize,
}

// SAFETY: the slots are only touched under the SPSC protocol: a slot is written by the one
// producer while the consumer cannot see it (before the Release store of tail) and read by
// the one consumer while the producer cannot reuse it (before the Release store of head), so
// shared access from two threads never races; T: Send lets values move between them.
unsafe impl<T: Send> Sync for HeapRing<T> {}

/// In-process storage: indices and slots in one heap allocation shared by the two ends.
/// Uses the [`sync`](crate::sync) shim, so it is what loom and Miri check.
pub struct HeapStorage<T> {
    ring: Arc<HeapRing<T>>,
}

impl<T> std::fmt::Debug for HeapStorage<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeapStorage")
            .field("capacity", &self.ring.slots.len())
            .finish_non_exhaustive()
    }
}

impl<T: Copy> HeapStorage<T> {
    /// Two handles on a new ring of `capacity` slots (already validated: a power of two).
    pub(super) fn new_pair(capacity: usize) -> (Self, Self) {
        let slots = (0..capacity)
            .map(|_| UnsafeCell::new(MaybeUninit::uninit()))
            .collect::<Box<[_]>>();
        let ring = Arc::new(HeapRing {
            tail: CachePadded::new(sync::AtomicU64::new(0)),
            head: CachePadded::new(sync::AtomicU64::new(0)),
            slots,
            mask: capacity - 1,
        });
        (
            HeapStorage {
                ring: Arc::clone(&ring),
            },
            HeapStorage { ring },
        )
    }
}

impl<T: Copy> sealed::RawStorage<T> for HeapStorage<T> {
    #[inline(always)]
    fn capacity(&self) -> usize {
        self.ring.mask + 1
    }
    #[inline(always)]
    fn load_tail(&self, order: Ordering) -> u64 {
        self.ring.tail.load(order)
    }
    #[inline(always)]
    fn store_tail(&self, value: u64, order: Ordering) {
        self.ring.tail.store(value, order);
    }
    #[inline(always)]
    fn load_head(&self, order: Ordering) -> u64 {
        self.ring.head.load(order)
    }
    #[inline(always)]
    fn store_head(&self, value: u64, order: Ordering) {
        self.ring.head.store(value, order);
    }
    // Under loom every slot access goes through its loom cell, so that loom tracks it.
    #[cfg(shmhca_loom)]
    #[inline(always)]
    unsafe fn write_slots(&self, first: u64, values: &[T]) {
        for (i, value) in values.iter().enumerate() {
            // SAFETY: as in write_slot.
            unsafe { self.write_slot(first.wrapping_add(i as u64), *value) };
        }
    }
    #[cfg(shmhca_loom)]
    #[inline(always)]
    unsafe fn read_slots(&self, first: u64, out: &mut [T]) {
        for (i, out) in out.iter_mut().enumerate() {
            // SAFETY: as in read_slot.
            *out = unsafe { self.read_slot(first.wrapping_add(i as u64)) };
        }
    }
    #[cfg(shmhca_loom)]
    #[inline(always)]
    unsafe fn write_slot(&self, index: u64, value: T) {
        let slot = &self.ring.slots[(index as usize) & self.ring.mask];
        // SAFETY: the caller owns this slot (free: released by the consumer), so no one else
        // accesses it; the write is in bounds of the cell.
        slot.with_mut(|p| unsafe { p.write(MaybeUninit::new(value)) });
    }
    #[cfg(shmhca_loom)]
    #[inline(always)]
    unsafe fn read_slot(&self, index: u64) -> T {
        let slot = &self.ring.slots[(index as usize) & self.ring.mask];
        // SAFETY: the caller guarantees the slot is published: the producer initialised it
        // before its Release store of tail, which our Acquire load saw, and will not write it
        // again before we release it.
        slot.with(|p| unsafe { p.cast::<T>().read() })
    }

    // Without loom the slots are one contiguous array of T, copied in at most two runs.
    #[cfg(not(shmhca_loom))]
    #[inline(always)]
    unsafe fn write_slots(&self, first: u64, values: &[T]) {
        if values.len() <= SMALL_BURST {
            for (i, v) in values.iter().enumerate() {
                // SAFETY: as in write_slot; the caller owns every slot of the burst.
                unsafe { self.write_slot(first.wrapping_add(i as u64), *v) };
            }
            return;
        }
        let (a, b) = runs(first, values.len(), self.ring.mask);
        // SAFETY: the caller owns these slots (free: released by the consumer); `runs` keeps
        // both runs inside the array (a + b ≤ capacity); `values` is not ring memory.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), self.slot_ptr(first), a) };
        // SAFETY: as above, for the run after the wrap.
        unsafe {
            std::ptr::copy_nonoverlapping(values.as_ptr().wrapping_add(a), self.slot_ptr(0), b)
        };
    }
    #[cfg(not(shmhca_loom))]
    #[inline(always)]
    unsafe fn read_slots(&self, first: u64, out: &mut [T]) {
        if out.len() <= SMALL_BURST {
            for (i, o) in out.iter_mut().enumerate() {
                // SAFETY: as in read_slot; every slot of the burst is published.
                *o = unsafe { self.read_slot(first.wrapping_add(i as u64)) };
            }
            return;
        }
        let (a, b) = runs(first, out.len(), self.ring.mask);
        // SAFETY: the caller guarantees these slots are published (initialised by the
        // producer before its Release store of tail, which our Acquire load saw) and not
        // reused before we release them; both runs are inside the array.
        unsafe { std::ptr::copy_nonoverlapping(self.slot_ptr(first), out.as_mut_ptr(), a) };
        // SAFETY: as above, for the run after the wrap.
        unsafe {
            std::ptr::copy_nonoverlapping(self.slot_ptr(0), out.as_mut_ptr().wrapping_add(a), b)
        };
    }
    #[cfg(not(shmhca_loom))]
    #[inline(always)]
    unsafe fn write_slot(&self, index: u64, value: T) {
        // SAFETY: as in write_slots, for one slot.
        unsafe { self.slot_ptr(index).write(value) };
    }
    #[cfg(not(shmhca_loom))]
    #[inline(always)]
    unsafe fn read_slot(&self, index: u64) -> T {
        // SAFETY: as in read_slots, for one slot.
        unsafe { self.slot_ptr(index).read() }
    }
}

#[cfg(not(shmhca_loom))]
impl<T> HeapStorage<T> {
    /// Pointer to the slot for `index` (masked, so in bounds). The slots are a contiguous
    /// array with T's layout (`UnsafeCell` and `MaybeUninit` are `repr(transparent)`), and
    /// writing through a pointer derived from a shared reference to `UnsafeCell` contents
    /// is allowed.
    #[inline(always)]
    fn slot_ptr(&self, index: u64) -> *mut T {
        let slot = (index as usize) & self.ring.mask;
        self.ring
            .slots
            .as_ptr()
            .cast::<T>()
            .cast_mut()
            .wrapping_add(slot)
    }
}

/// Splits `len` slots starting at `first` into the run before the wrap and the run after.
#[inline(always)]
fn runs(first: u64, len: usize, mask: usize) -> (usize, usize) {
    let start = (first as usize) & mask;
    let before_wrap = len.min(mask + 1 - start);
    (before_wrap, len - before_wrap)
}

// ---------------------------------------------------------------------------------------
// Shared-memory storage
// ---------------------------------------------------------------------------------------

/// Which end of a shared ring a [`ShmStorage`] serves (selects the attach flag).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum End {
    Producer,
    Consumer,
}

/// Storage in a [`Segment`]: indices and slots at an offset in its data area.
///
/// Holds the segment (an `Arc`) so the mapping outlives every pointer into it. Capacity
/// and slot size are private copies validated at attach; nothing is re-read from the
/// shared header afterwards.
pub struct ShmStorage<T> {
    segment: Arc<Segment>,
    base: NonNull<u8>,
    slots: NonNull<u8>,
    mask: usize,
    end: End,
    _slot: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for ShmStorage<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmStorage")
            .field("capacity", &(self.mask + 1))
            .field("end", &self.end)
            .field("segment", &self.segment)
            .finish_non_exhaustive()
    }
}

// SAFETY: the raw pointers point into the mapping owned by `segment` (an Arc, Send + Sync),
// which lives as long as this value; the memory is accessed only through atomics and raw
// copies, which are valid from any thread.
unsafe impl<T> Send for ShmStorage<T> {}

impl<T: Pod> ShmStorage<T> {
    /// Wraps the ring at `offset`. The caller has validated that the whole ring (header and
    /// `capacity` slots) lies inside the segment's data area, that `offset` is
    /// [`RING_ALIGN`]-aligned, and that the segment is mapped read-write.
    pub(super) fn new(segment: Arc<Segment>, offset: usize, capacity: usize, end: End) -> Self {
        let data = segment.data_ptr();
        // SAFETY: (caller) offset + SLOTS_OFFSET + capacity * size_of::<T>() <= data_len, so
        // both pointers are inside the mapping.
        let base = unsafe { data.add(offset) };
        // SAFETY: as above.
        let slots = unsafe { base.add(SLOTS_OFFSET) };
        ShmStorage {
            segment,
            base,
            slots,
            mask: capacity - 1,
            end,
            _slot: PhantomData,
        }
    }

    fn atomic_u64(&self, offset: usize) -> &sync::shm::AtomicU64 {
        // SAFETY: offset is TAIL_OFFSET or HEAD_OFFSET, inside the validated ring header,
        // 8-aligned (the ring is 128-aligned in a page-aligned data area); the mapping is
        // read-write and lives as long as &self. AtomicU64 has no invalid bit patterns, and
        // atomics are the one sound way to share a word with a concurrent writer.
        unsafe {
            &*self
                .base
                .as_ptr()
                .wrapping_add(offset)
                .cast::<sync::shm::AtomicU64>()
        }
    }

    fn claim_flag(&self) -> &sync::shm::AtomicU32 {
        let offset = match self.end {
            End::Producer => PRODUCER_CLAIM_OFFSET,
            End::Consumer => CONSUMER_CLAIM_OFFSET,
        };
        // SAFETY: as in atomic_u64: inside the header line, 4-aligned, mapped read-write.
        unsafe {
            &*self
                .base
                .as_ptr()
                .wrapping_add(offset)
                .cast::<sync::shm::AtomicU32>()
        }
    }

    /// Marks this end as attached; false if another handle already holds it.
    pub(super) fn claim(&self) -> bool {
        // AcqRel: the swap orders against the Release store in `Drop` of a previous holder
        // (pairs with it), and our later accesses come after it.
        self.claim_flag().swap(1, Ordering::AcqRel) == 0
    }

    /// Resets both attach flags (ring initialisation, before the ring is shared).
    pub(super) fn reset_claims(segment: &Segment, offset: usize) {
        // SAFETY: the caller (init_shm_ring) validated that the ring header lies inside the
        // read-write data area at a 128-aligned offset.
        let base = unsafe { segment.data_ptr().add(offset) };
        for flag in [PRODUCER_CLAIM_OFFSET, CONSUMER_CLAIM_OFFSET] {
            // SAFETY: inside the header line, 4-aligned, mapped read-write.
            let atomic = unsafe {
                &*base
                    .as_ptr()
                    .wrapping_add(flag)
                    .cast::<sync::shm::AtomicU32>()
            };
            atomic.store(0, Ordering::Relaxed);
        }
        for index in [TAIL_OFFSET, HEAD_OFFSET] {
            // SAFETY: inside the header, 8-aligned, mapped read-write.
            let atomic = unsafe {
                &*base
                    .as_ptr()
                    .wrapping_add(index)
                    .cast::<sync::shm::AtomicU64>()
            };
            atomic.store(0, Ordering::Relaxed);
        }
    }

    /// Pointer to the slot for `index` (masked, so always in bounds).
    #[inline(always)]
    fn slot_ptr(&self, index: u64) -> *mut u8 {
        let slot = (index as usize) & self.mask;
        // In bounds: slot < capacity, and capacity slots lie inside the mapping (checked at
        // attach), so this never wraps; wrapping_add just keeps the arithmetic safe code.
        self.slots.as_ptr().wrapping_add(slot * size_of::<T>())
    }
}

/// Bursts up to this many slots are copied slot by slot (see `write_slots`).
const SMALL_BURST: usize = 4;

/// Under loom: the cell through which the accesses of one slot are tracked.
#[cfg(shmhca_loom)]
type SlotCell = UnsafeCell<()>;

/// Under loom: where a shared ring's slot cells start, from the ring's start.
#[cfg(shmhca_loom)]
pub(super) fn loom_cells_offset(slots_end: usize) -> usize {
    slots_end.next_multiple_of(align_of::<SlotCell>())
}

/// Under loom: bytes a shared ring of `capacity` slots needs after its slot array.
#[cfg(shmhca_loom)]
pub(super) fn loom_extra_bytes(slots_end: usize, capacity: usize) -> usize {
    loom_cells_offset(slots_end) - slots_end + capacity * size_of::<SlotCell>()
}

#[cfg(shmhca_loom)]
impl<T: Pod> ShmStorage<T> {
    /// Places fresh loom objects in a ring being initialised: the two index words, and one
    /// cell per slot after the slot array. The caller (`init_shm_ring`) checked that
    /// `shm_ring_bytes` (which counts the cells under loom) fit at `offset`.
    pub(super) fn loom_init(segment: &Segment, offset: usize, capacity: usize) {
        // SAFETY: inside the read-write data area, checked by the caller.
        let base = unsafe { segment.data_ptr().add(offset) }.as_ptr();
        for index in [TAIL_OFFSET, HEAD_OFFSET] {
            // SAFETY: 128 bytes at a 128-aligned offset inside the header, nothing else
            // there; a loom atomic is a small handle with no drop glue.
            unsafe {
                base.wrapping_add(index)
                    .cast::<sync::shm::AtomicU64>()
                    .write(sync::shm::AtomicU64::new(0))
            };
        }
        let cells = base.wrapping_add(loom_cells_offset(SLOTS_OFFSET + capacity * size_of::<T>()));
        for i in 0..capacity {
            let cell = cells.cast::<SlotCell>().wrapping_add(i);
            // SAFETY: the cell array lies inside the ring (see `loom_extra_bytes`), aligned
            // for the cell type; a loom cell has no drop glue.
            unsafe { cell.write(SlotCell::new(())) };
        }
    }

    /// Announces to loom an access to the `n` slots from index `first` on.
    fn loom_track(&self, first: u64, n: usize, write: bool) {
        let cells = self
            .base
            .as_ptr()
            .wrapping_add(loom_cells_offset(
                SLOTS_OFFSET + (self.mask + 1) * size_of::<T>(),
            ))
            .cast::<SlotCell>();
        for i in 0..n {
            let slot = (first.wrapping_add(i as u64) as usize) & self.mask;
            // SAFETY: slot < capacity; the cells were written by `loom_init` and live as
            // long as the mapping (held by `self.segment`).
            let cell = unsafe { &*cells.wrapping_add(slot) };
            if write {
                cell.with_mut(|_| ());
            } else {
                cell.with(|_| ());
            }
        }
    }
}

impl<T: Pod> sealed::RawStorage<T> for ShmStorage<T> {
    #[inline(always)]
    fn capacity(&self) -> usize {
        self.mask + 1
    }
    #[inline(always)]
    fn load_tail(&self, order: Ordering) -> u64 {
        self.atomic_u64(TAIL_OFFSET).load(order)
    }
    #[inline(always)]
    fn store_tail(&self, value: u64, order: Ordering) {
        // (Mutation point of the loom models: publishing the tail with Relaxed.)
        let order = sync::weaken(order, "ShmStorage::store_tail");
        self.atomic_u64(TAIL_OFFSET).store(value, order);
    }
    #[inline(always)]
    fn load_head(&self, order: Ordering) -> u64 {
        self.atomic_u64(HEAD_OFFSET).load(order)
    }
    #[inline(always)]
    fn store_head(&self, value: u64, order: Ordering) {
        self.atomic_u64(HEAD_OFFSET).store(value, order);
    }
    #[inline(always)]
    unsafe fn write_slots(&self, first: u64, values: &[T]) {
        #[cfg(shmhca_loom)]
        self.loom_track(first, values.len(), true);
        if values.len() <= SMALL_BURST {
            // A few slots: fixed-size copies the compiler inlines beat a memcpy call.
            for (i, v) in values.iter().enumerate() {
                // SAFETY: as in write_slot; the caller owns every slot of the burst.
                unsafe { self.write_slot(first.wrapping_add(i as u64), *v) };
            }
            return;
        }
        let (a, b) = runs(first, values.len(), self.mask);
        let src = values.as_ptr().cast::<u8>();
        // SAFETY: `runs` keeps [start, start+a) and [0, b) inside the slot array (a + b ≤
        // capacity by the caller's contract); `values` is ordinary memory, not the mapping.
        // Byte copies need no alignment. A hostile peer writing the same bytes concurrently
        // can only garble its own data: T is Pod, any bytes are a valid T.
        unsafe {
            std::ptr::copy_nonoverlapping(src, self.slot_ptr(first), a * size_of::<T>());
        }
        // SAFETY: the second run, as above; `src` + a slots is still inside `values`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.wrapping_add(a * size_of::<T>()),
                self.slots.as_ptr(),
                b * size_of::<T>(),
            );
        }
    }
    #[inline(always)]
    unsafe fn read_slots(&self, first: u64, out: &mut [T]) {
        #[cfg(shmhca_loom)]
        self.loom_track(first, out.len(), false);
        if out.len() <= SMALL_BURST {
            for (i, o) in out.iter_mut().enumerate() {
                // SAFETY: as in read_slot; every slot of the burst is published.
                *o = unsafe { self.read_slot(first.wrapping_add(i as u64)) };
            }
            return;
        }
        let (a, b) = runs(first, out.len(), self.mask);
        let dst = out.as_mut_ptr().cast::<u8>();
        // SAFETY: as in write_slots, both runs are inside the slot array and `out` is private
        // memory. This is the copy-out that makes the consumer immune to a peer rewriting a
        // slot after we looked at it: the caller only ever sees this private copy, and any
        // bytes form a valid T (Pod).
        unsafe {
            std::ptr::copy_nonoverlapping(self.slot_ptr(first), dst, a * size_of::<T>());
        }
        // SAFETY: the second run, as above; `dst` + a slots is still inside `out`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.slots.as_ptr(),
                dst.wrapping_add(a * size_of::<T>()),
                b * size_of::<T>(),
            );
        }
    }
    #[inline(always)]
    unsafe fn write_slot(&self, index: u64, value: T) {
        #[cfg(shmhca_loom)]
        self.loom_track(index, 1, true);
        // SAFETY: the masked slot lies inside the slot array; unaligned write of a Pod value
        // through a raw pointer, no reference to shared memory is formed.
        unsafe { self.slot_ptr(index).cast::<T>().write_unaligned(value) };
    }
    #[inline(always)]
    unsafe fn read_slot(&self, index: u64) -> T {
        #[cfg(shmhca_loom)]
        self.loom_track(index, 1, false);
        // SAFETY: as in read_slots: in bounds, copied out, any bytes are a valid T (Pod).
        unsafe { self.slot_ptr(index).cast::<T>().read_unaligned() }
    }
    #[inline(always)]
    fn prefetch(&self, index: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let slot = self.slot_ptr(index);
            let mut line = 0;
            while line < size_of::<T>() {
                // SAFETY: prefetch is a hint that never faults; the address is inside the
                // slot (line < size_of::<T>()).
                unsafe {
                    core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                        slot.wrapping_add(line).cast::<i8>(),
                    );
                }
                line += 64;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = index;
    }
}

impl<T> Drop for ShmStorage<T> {
    fn drop(&mut self) {
        let offset = match self.end {
            End::Producer => PRODUCER_CLAIM_OFFSET,
            End::Consumer => CONSUMER_CLAIM_OFFSET,
        };
        // SAFETY: as in claim_flag; the segment is still alive (dropped after this).
        let flag = unsafe {
            &*self
                .base
                .as_ptr()
                .wrapping_add(offset)
                .cast::<sync::shm::AtomicU32>()
        };
        // SYNC: Release pairs with the AcqRel swap in `claim` of the next handle on this end:
        // everything this handle did happens before the next one starts.
        flag.store(0, Ordering::Release);
    }
}

// ---------------------------------------------------------------------------------------
// Stamped heap ring
// ---------------------------------------------------------------------------------------

/// One slot of a stamped ring: the value and, beside it, the stamp of the index it holds.
/// A cache line of its own (for a value of up to 56 bytes: a completion is 40), as an
/// mlx5 CQE: the consumer reading one slot and the producer writing the next never share
/// a line, and a slot's address is its index shifted.
#[repr(C, align(64))]
struct StampedSlot<T> {
    /// `index + 1` of the value written last (0: never written).
    stamp: sync::AtomicU64,
    value: UnsafeCell<MaybeUninit<T>>,
}

struct StampedRing<T> {
    slots: Box<[StampedSlot<T>]>,
    /// The consumer's index, as last published.
    head: CachePadded<sync::AtomicU64>,
}

// SAFETY: a slot's value is only touched under the stamped SPSC protocol: written by the
// one producer while the consumer cannot take it (before the Release store of its stamp)
// and read by the one consumer while the producer cannot reuse it (before the Release
// store of head), so shared access from two threads never races; T: Send lets values move.
unsafe impl<T: Send> Sync for StampedRing<T> {}

/// A ring of `capacity` slots (a power of two, checked by the caller) in one process whose
/// consumer knows a slot is full from the slot's own stamp, not from a producer index
/// (mlx5's CQE owner bit, with a lap stamp): see [`stamped_ring`](super::stamped_ring).
pub(super) fn stamped_pair<T: Copy>(capacity: usize) -> (StampedProducer<T>, StampedConsumer<T>) {
    let ring = Arc::new(StampedRing {
        slots: (0..capacity)
            .map(|_| StampedSlot {
                stamp: sync::AtomicU64::new(0),
                value: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect(),
        head: CachePadded::new(sync::AtomicU64::new(0)),
    });
    let mask = capacity as u64 - 1;
    let base = NonNull::from(&ring.slots[0]);
    (
        StampedProducer {
            ring: Arc::clone(&ring),
            base,
            tail: 0,
            cached_head: 0,
            mask,
        },
        StampedConsumer {
            ring,
            base,
            next: base,
            want: 1,
            mask,
        },
    )
}

/// The slot of `index` in the slots at `base` (`mask + 1` of them).
///
/// # Safety
///
/// `base` points to the first of the `mask + 1` slots of a ring that outlives the
/// returned reference.
#[inline(always)]
unsafe fn stamped_slot<'a, T>(
    base: NonNull<StampedSlot<T>>,
    mask: u64,
    index: u64,
) -> &'a StampedSlot<T> {
    // SAFETY: `index & mask` < `mask + 1`, the number of slots from `base` (the caller's
    // promise): the offset stays in bounds of the slot array.
    let slot = unsafe { base.add((index & mask) as usize) };
    // SAFETY: an in-bounds, initialised slot of a ring that outlives the reference (the
    // caller's promise); slots are only ever shared (`&`), their contents are atomics and
    // cells.
    unsafe { slot.as_ref() }
}

// SAFETY: an end holds its ring (an `Arc` of a `Sync` ring) and a pointer into it, which
// stays valid wherever the end goes; the SPSC protocol needs only that each end is used by
// one thread at a time (`&mut self` for every operation that moves it).
unsafe impl<T: Send> Send for StampedProducer<T> {}
// SAFETY: as for the producer.
unsafe impl<T: Send> Send for StampedConsumer<T> {}

/// The writing end of a stamped ring (see [`stamped_ring`](super::stamped_ring)).
pub struct StampedProducer<T> {
    /// Keeps the slots alive (`base` points into them).
    ring: Arc<StampedRing<T>>,
    /// The first slot (read through [`stamped_slot`]: no bounds check, no second load).
    base: NonNull<StampedSlot<T>>,
    /// The next index to write (private: the consumer goes by the stamps).
    tail: u64,
    /// The consumer's index as last loaded.
    cached_head: u64,
    mask: u64,
}

impl<T> std::fmt::Debug for StampedProducer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StampedProducer")
            .field("tail", &self.tail)
            .field("cached_head", &self.cached_head)
            .field("capacity", &(self.mask + 1))
            .finish()
    }
}

impl<T: Copy> StampedProducer<T> {
    /// Number of slots.
    pub fn capacity(&self) -> usize {
        (self.mask + 1) as usize
    }

    /// Whether one more value fits. Reloads the consumer's index only when the cached one
    /// says the ring is full.
    #[inline(always)]
    pub fn has_room(&mut self) -> bool {
        self.tail.wrapping_sub(self.cached_head) <= self.mask || self.refresh_head()
    }

    #[cold]
    #[inline(never)]
    fn refresh_head(&mut self) -> bool {
        // SYNC POINT: Acquire pairs with the Release store in `StampedConsumer::publish`:
        // the consumer's copies out of the slots it released happen before we rewrite them.
        let order = sync::mutation::weaken(Ordering::Acquire, "StampedRing head load");
        let head = self.ring.head.load(order);
        // Only the consumer of this process moves it: forward, never past tail.
        debug_assert!(
            head.wrapping_sub(self.cached_head) <= self.tail.wrapping_sub(self.cached_head),
            "the consumer's index moves forward and never passes the producer's"
        );
        self.cached_head = head;
        self.tail.wrapping_sub(head) <= self.mask
    }

    /// Free slots now (reloads the consumer's index).
    pub fn free_slots(&mut self) -> usize {
        self.refresh_head();
        (self.mask + 1 - self.tail.wrapping_sub(self.cached_head)) as usize
    }

    /// Writes `value` into the next slot and stamps it.
    ///
    /// # Errors
    ///
    /// The value back if the ring is full.
    #[inline(always)]
    pub fn push(&mut self, value: T) -> Result<(), T> {
        match self.reserve() {
            Some(r) => {
                r.write(value);
                Ok(())
            }
            None => Err(value),
        }
    }

    /// The next slot, if the ring has room for it: the room is checked once, here, and
    /// the value written later ([`StampedReservation::write`]), after work the caller
    /// does only when there is room (a completion made once its queue can take it), with
    /// the slot's address and index kept across that work.
    ///
    /// ```
    /// let (mut tx, mut rx) = shmhca_rings::ring::stamped_ring::<u32>(1).unwrap();
    /// tx.reserve().unwrap().write(7);
    /// assert!(tx.reserve().is_none(), "full");
    /// assert_eq!(rx.pop(), Some(7));
    /// ```
    #[inline(always)]
    pub fn reserve(&mut self) -> Option<StampedReservation<'_, T>> {
        if !self.has_room() {
            return None;
        }
        let tail = self.tail;
        // SAFETY: `base` points to the `mask + 1` slots of `self.ring`, which we hold (and
        // the reservation holds `self`, so the ring outlives it).
        let slot = unsafe { stamped_slot(self.base, self.mask, tail) };
        Some(StampedReservation {
            producer: self,
            slot,
            tail,
        })
    }
}

/// The next slot of a stamped ring, free to be written ([`StampedProducer::reserve`]):
/// it holds its producer, so nothing else is written before it; dropped unwritten, it
/// leaves the ring as it was.
pub struct StampedReservation<'p, T> {
    producer: &'p mut StampedProducer<T>,
    slot: &'p StampedSlot<T>,
    /// The index of the slot (the producer's next one).
    tail: u64,
}

impl<T: Copy> StampedReservation<'_, T> {
    /// Writes `value` into the slot and stamps it: the consumer may take it from now on.
    #[inline(always)]
    pub fn write(self, value: T) {
        let (slot, tail) = (self.slot, self.tail);
        // SAFETY: the slot is free (the consumer released it: `has_room` in `reserve`,
        // Acquire on head, or never used), and this end is the only producer (the
        // reservation holds it by `&mut` since that check).
        slot.value
            .with_mut(|p| unsafe { p.write(MaybeUninit::new(value)) });
        // SYNC POINT: Release pairs with the Acquire load in `StampedConsumer::take`: the
        // value written above is visible to a consumer that sees this stamp.
        let order = sync::mutation::weaken(Ordering::Release, "StampedRing stamp store");
        slot.stamp.store(tail.wrapping_add(1), order);
        self.producer.tail = tail.wrapping_add(1);
    }
}

/// The reading end of a stamped ring (see [`stamped_ring`](super::stamped_ring)).
pub struct StampedConsumer<T> {
    /// Keeps the slots alive (`base` points into them).
    ring: Arc<StampedRing<T>>,
    /// The first slot (read through [`stamped_slot`]: no bounds check, no second load).
    base: NonNull<StampedSlot<T>>,
    /// The slot of the next index to read, `want - 1` (an empty look is two loads and a
    /// compare: this pointer, the stamp it points to, against `want`).
    next: NonNull<StampedSlot<T>>,
    /// The stamp the next value carries: the next index to read, plus 1.
    want: u64,
    mask: u64,
}

impl<T> std::fmt::Debug for StampedConsumer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StampedConsumer")
            .field("head", &self.want.wrapping_sub(1))
            .field("capacity", &(self.mask + 1))
            .finish()
    }
}

impl<T: Copy> StampedConsumer<T> {
    /// Number of slots.
    pub fn capacity(&self) -> usize {
        (self.mask + 1) as usize
    }

    /// The slot of the next index, if it holds that index's value.
    #[inline(always)]
    fn take(&self) -> Option<&StampedSlot<T>> {
        // SAFETY: `next` points to slot `(want - 1) & mask` of `self.ring`, which we hold.
        let slot = unsafe { self.next.as_ref() };
        // SYNC POINT: Acquire pairs with the Release store of the stamp in
        // `StampedProducer::push`: the value is the one written with this stamp.
        let order = sync::mutation::weaken(Ordering::Acquire, "StampedRing stamp load");
        (slot.stamp.load(order) == self.want).then_some(slot)
    }

    /// Whether the ring looks empty: one load, the stamp of the next slot.
    #[inline(always)]
    pub fn looks_empty(&self) -> bool {
        self.take().is_none()
    }

    /// Hands up to `max` values, oldest first, to `f`; returns how many. Publishes the
    /// consumer's index once, after the last (or as `f` unwinds: the values handed out,
    /// the one it panicked on included, are released).
    #[inline(always)]
    pub fn pop_each(&mut self, max: usize, mut f: impl FnMut(T)) -> usize {
        /// The consumer's position during a pop, in locals (registers: `f` writes memory
        /// the compiler cannot tell from the consumer's), written back and published when
        /// dropped: at the end, or as `f` unwinds.
        struct Pos<'c, T> {
            c: &'c mut StampedConsumer<T>,
            next: NonNull<StampedSlot<T>>,
            want: u64,
            n: usize,
        }
        impl<T> Drop for Pos<'_, T> {
            #[inline(always)]
            fn drop(&mut self) {
                self.c.next = self.next;
                self.c.want = self.want;
                if self.n > 0 {
                    // SYNC POINT: Release pairs with the Acquire load in
                    // `StampedProducer::refresh_head`: our copies happen before the
                    // rewrites.
                    let order = sync::mutation::weaken(Ordering::Release, "StampedRing head store");
                    self.c.ring.head.store(self.want.wrapping_sub(1), order);
                }
            }
        }
        let (base, mask) = (self.base, self.mask);
        let mut pos = Pos {
            next: self.next,
            want: self.want,
            n: 0,
            c: self,
        };
        while pos.n < max {
            // SAFETY: `next` points to slot `(want - 1) & mask` of the ring, which we hold.
            let slot = unsafe { pos.next.as_ref() };
            // SYNC POINT: Acquire pairs with the Release store of the stamp in
            // `StampedProducer::push`: the value is the one written with this stamp.
            let order = sync::mutation::weaken(Ordering::Acquire, "StampedRing stamp load");
            if slot.stamp.load(order) != pos.want {
                break;
            }
            // SAFETY: the slot's stamp says it holds the value of index `want - 1`, written
            // before the stamp's Release store our Acquire load saw; the producer does not
            // rewrite it before we publish an index past it (when `pos` drops, after the
            // copy).
            let value = slot.value.with(|p| unsafe { p.cast::<T>().read() });
            // SAFETY: `base` points to the `mask + 1` slots of the ring, which we hold; the
            // slot of index `want` is the next one to read.
            pos.next = NonNull::from(unsafe { stamped_slot(base, mask, pos.want) });
            pos.want = pos.want.wrapping_add(1);
            pos.n += 1;
            f(value);
        }
        pos.n
    }

    /// Moves up to `out.len()` values into `out`; returns how many.
    #[inline(always)]
    pub fn pop_burst(&mut self, out: &mut [T]) -> usize {
        let max = out.len();
        let mut slots = out.iter_mut();
        self.pop_each(max, |v| {
            if let Some(o) = slots.next() {
                *o = v;
            }
        })
    }

    /// One value, if there is one.
    #[inline]
    pub fn pop(&mut self) -> Option<T> {
        let mut got = None;
        self.pop_each(1, |v| got = Some(v));
        got
    }
}
