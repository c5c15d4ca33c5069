//! Where a line ring's head index and lines live: on the heap (one process; the storage
//! the loom models check) or in a [`Segment`] (between processes).
//!
//! # Shared-memory layout
//!
//! A line ring occupies [`shm_lines_bytes`](super::shm_lines_bytes) bytes at a
//! 128-byte-aligned offset in a segment's data area:
//!
//! ```text
//! +0    LinesMeta (magic, version, line size, capacity)
//! +64   producer attach flag (u32), +68 consumer attach flag (u32),
//! +72   parked tail (u64): the producer's index, written only when a producer detaches
//! +128  head: the consumer index (u64), alone on its 128-byte line pair
//! +256  capacity lines of 64 bytes
//! ```
//!
//! # Under loom
//!
//! The heap storage keeps each line's first word in a loom atomic and the line itself in a
//! loom cell, so loom tracks the hand-off of every line; the protocol code in [`super`] is
//! the same for both storages. The shared-memory storage is not modelled (its atomics stay
//! `core`'s under every cfg): it differs from the heap one only in where the bytes are.

// Raw access to lines and to atomics placed in memory shared with the peer; each unsafe
// block says why it is sound.
#![allow(unsafe_code)]

use std::ptr::NonNull;
use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use crossbeam_utils::CachePadded;

use super::{LINE_BYTES, Line};
use crate::segment::Segment;
use crate::sync::{self, Ordering, UnsafeCell};

/// Asks the cache for the line at `p` in a state that allows writing it (x86-64:
/// `PREFETCHW`; AArch64: `PRFM PSTL1KEEP`; elsewhere nothing).
#[inline(always)]
fn prefetch_write(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHW is a hint. It reads and writes no memory and no register or flag
    // the program can see, never faults (not on an unmapped or foreign address either:
    // `p` may point at a page a peer truncated), and executes as a NOP on processors
    // without it (its opcode, 0F 0D /1, was reserved as a NOP before PREFETCHW existed).
    unsafe {
        core::arch::asm!("prefetchw [{p}]", p = in(reg) p, options(nostack, preserves_flags, readonly));
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: PRFM is a hint: no architectural effect, never faults.
    unsafe {
        core::arch::asm!("prfm pstl1keep, [{p}]", p = in(reg) p, options(nostack, preserves_flags, readonly));
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = p;
}

/// Offset of the consumer index from the start of a shared line ring.
const HEAD_OFFSET: usize = 128;
/// Offset of line 0 from the start of a shared line ring.
pub(super) const LINES_OFFSET: usize = 256;
/// Required alignment of a shared line ring's offset in the data area.
pub(super) const LINES_ALIGN: usize = 128;
/// Offset of the producer's attach flag.
const PRODUCER_CLAIM_OFFSET: usize = 64;
/// Offset of the consumer's attach flag.
const CONSUMER_CLAIM_OFFSET: usize = 68;
/// Offset of the producer index a detaching producer leaves for the next one.
const PARKED_TAIL_OFFSET: usize = 72;

/// The first bytes of a shared line ring: written by
/// [`init_shm_lines`](super::init_shm_lines), copied out and validated by every attach.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub(super) struct LinesMeta {
    pub(super) magic: u64,
    pub(super) version: u32,
    pub(super) line_size: u32,
    pub(super) capacity: u64,
}

mod sealed {
    use super::{Line, Ordering};

    /// The storage operations the line ring needs. Sealed: only this module implements it.
    ///
    /// Positions are line numbers below the capacity (masked again by the storage, so a
    /// position can never address memory outside the ring). A word is the first 8 bytes of
    /// a line read as a little-endian `u64`.
    #[allow(unreachable_pub)] // the sealed-trait pattern: public, but not nameable outside
    pub trait RawLines {
        /// Line count (a power of two), a private copy validated at creation/attach.
        fn capacity(&self) -> usize;
        /// Atomically loads the first word of the line at `pos`.
        fn load_word(&self, pos: usize, order: Ordering) -> u64;
        /// Atomically stores the first word of the line at `pos`.
        fn store_word(&self, pos: usize, word: u64, order: Ordering);
        fn load_head(&self, order: Ordering) -> u64;
        fn store_head(&self, value: u64, order: Ordering);
        /// Copies bytes 8..64 of `line` into the line at `pos`.
        ///
        /// # Safety
        ///
        /// The caller is the producer and owns the line: the consumer released it
        /// (Acquire on head) and cannot read it before the frame's stamp is stored.
        unsafe fn write_body(&self, pos: usize, line: &Line);
        /// Copies the lines `pos..pos + out.len()` (words included) into `out`.
        ///
        /// # Safety
        ///
        /// The caller is the consumer, `pos + out.len() ≤ capacity`, and these lines are
        /// published (their frame's stamp seen with Acquire) and not yet released.
        unsafe fn read_lines(&self, pos: usize, out: &mut [Line]);
        /// Asks for the line at `pos` in this core's cache, owned for writing (a hint:
        /// no effect on what any reader sees; see [`PREFETCH_AHEAD`](super::PREFETCH_AHEAD)).
        fn prefetch_for_write(&self, pos: usize) {
            let _ = pos;
        }
        /// Leaves the producer's index for a later producer (shared rings only).
        fn park_tail(&self, tail: u64) {
            let _ = tail;
        }
    }
}

pub(super) use sealed::RawLines;

/// Where a line ring's head and lines live: [`HeapLines`] or [`ShmLines`]. Sealed.
pub trait LineStorage: RawLines {}

impl<S: RawLines> LineStorage for S {}

// ---------------------------------------------------------------------------------------
// Heap storage
// ---------------------------------------------------------------------------------------

#[cfg(not(shmhca_loom))]
struct HeapRing {
    head: CachePadded<sync::AtomicU64>,
    /// The lines, each 64-aligned; the first word of each is accessed atomically.
    lines: Box<[UnsafeCell<Line>]>,
    mask: usize,
    /// The positions the producer asked to prefetch, in order (unit tests only: a hint has
    /// no other visible effect).
    #[cfg(test)]
    prefetched: std::sync::Mutex<Vec<usize>>,
}

#[cfg(shmhca_loom)]
struct HeapRing {
    head: CachePadded<sync::AtomicU64>,
    /// Each line's first word, as a loom atomic.
    words: Box<[sync::AtomicU64]>,
    /// Each line (its bytes 0..8 unused), as a loom cell.
    lines: Box<[UnsafeCell<Line>]>,
    mask: usize,
}

// SAFETY: the lines are only touched under the protocol: a line's user bytes are written by
// the one producer while the consumer cannot read them (before the Release store of the
// frame's stamp) and read by the one consumer while the producer cannot reuse them (before
// the Release store of head); first words are only accessed atomically.
unsafe impl Sync for HeapRing {}

/// In-process storage: head and lines in one heap allocation shared by the two ends. Uses
/// the [`sync`](crate::sync) shim, so it is what loom checks.
pub struct HeapLines {
    ring: Arc<HeapRing>,
}

impl std::fmt::Debug for HeapLines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeapLines")
            .field("capacity", &(self.ring.mask + 1))
            .finish_non_exhaustive()
    }
}

impl HeapLines {
    /// The positions prefetched so far, in order (unit tests only).
    #[cfg(all(test, not(shmhca_loom)))]
    pub(super) fn prefetched(&self) -> Vec<usize> {
        self.ring
            .prefetched
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default()
    }

    /// A copy of the line at `pos`, every byte (unit tests only, with no end writing).
    #[cfg(all(test, not(shmhca_loom)))]
    pub(super) fn line(&self, pos: usize) -> Line {
        let mut out = [Line::ZERO];
        // SAFETY: a unit test's ring, one thread: nothing writes the line meanwhile.
        unsafe { sealed::RawLines::read_lines(self, pos, &mut out) };
        out[0]
    }

    /// Two handles on a new ring of `capacity` lines (already validated: a power of two),
    /// every line zero (stamp 0: not yet written).
    pub(super) fn new_pair(capacity: usize) -> (Self, Self) {
        let lines = (0..capacity)
            .map(|_| UnsafeCell::new(Line::ZERO))
            .collect::<Box<[_]>>();
        let ring = Arc::new(HeapRing {
            head: CachePadded::new(sync::AtomicU64::new(0)),
            #[cfg(shmhca_loom)]
            words: (0..capacity).map(|_| sync::AtomicU64::new(0)).collect(),
            lines,
            mask: capacity - 1,
            #[cfg(all(test, not(shmhca_loom)))]
            prefetched: std::sync::Mutex::new(Vec::new()),
        });
        (
            HeapLines {
                ring: Arc::clone(&ring),
            },
            HeapLines { ring },
        )
    }

    /// Pointer to the line at `pos` (masked, so in bounds). The lines are a contiguous
    /// array with `Line`'s layout (`UnsafeCell` is `repr(transparent)`), and writing
    /// through a pointer derived from a shared reference to `UnsafeCell` contents is
    /// allowed.
    #[cfg(not(shmhca_loom))]
    #[inline(always)]
    fn line_ptr(&self, pos: usize) -> *mut Line {
        self.ring
            .lines
            .as_ptr()
            .cast::<Line>()
            .cast_mut()
            .wrapping_add(pos & self.ring.mask)
    }

    #[cfg(not(shmhca_loom))]
    #[inline(always)]
    fn word(&self, pos: usize) -> &sync::AtomicU64 {
        // SAFETY: the line is inside the array (masked) and 64-aligned, so its first 8
        // bytes are a valid, aligned u64 location for as long as &self; every access to a
        // first word while both ends run is atomic (read_lines copies words only of lines
        // whose writes happen before, by the protocol).
        unsafe { sync::AtomicU64::from_ptr(self.line_ptr(pos).cast::<u64>()) }
    }
}

impl sealed::RawLines for HeapLines {
    #[inline(always)]
    fn capacity(&self) -> usize {
        self.ring.mask + 1
    }
    #[inline(always)]
    fn load_head(&self, order: Ordering) -> u64 {
        self.ring.head.load(order)
    }
    #[inline(always)]
    fn store_head(&self, value: u64, order: Ordering) {
        self.ring.head.store(value, order);
    }

    #[cfg(not(shmhca_loom))]
    #[inline(always)]
    fn load_word(&self, pos: usize, order: Ordering) -> u64 {
        u64::from_le(self.word(pos).load(order))
    }
    #[cfg(not(shmhca_loom))]
    #[inline(always)]
    fn store_word(&self, pos: usize, word: u64, order: Ordering) {
        self.word(pos).store(word.to_le(), order);
    }
    #[cfg(not(shmhca_loom))]
    #[inline(always)]
    fn prefetch_for_write(&self, pos: usize) {
        #[cfg(test)]
        if let Ok(mut v) = self.ring.prefetched.lock() {
            v.push(pos & self.ring.mask);
        }
        prefetch_write(self.line_ptr(pos).cast::<u8>());
    }
    #[cfg(not(shmhca_loom))]
    #[inline(always)]
    unsafe fn write_body(&self, pos: usize, line: &Line) {
        let dst = self.line_ptr(pos).cast::<u8>().wrapping_add(8);
        // SAFETY: bytes 8..64 of a line inside the array; the caller owns the line; `line`
        // is private memory, not the ring.
        unsafe {
            std::ptr::copy_nonoverlapping(line.0.as_ptr().wrapping_add(8), dst, LINE_BYTES - 8)
        };
    }
    #[cfg(not(shmhca_loom))]
    #[inline(always)]
    unsafe fn read_lines(&self, pos: usize, out: &mut [Line]) {
        let pos = pos & self.ring.mask;
        // The caller guarantees pos + out.len() ≤ capacity and that the lines are published
        // and not reused before we release them; `out` is private memory.
        let src = self.line_ptr(pos);
        for (i, out) in out.iter_mut().enumerate() {
            // SAFETY: as above, for line pos + i; fixed-size copies inline (see ShmLines).
            *out = unsafe { src.wrapping_add(i).read() };
        }
    }

    #[cfg(shmhca_loom)]
    #[inline(always)]
    fn load_word(&self, pos: usize, order: Ordering) -> u64 {
        self.ring.words[pos & self.ring.mask].load(order)
    }
    #[cfg(shmhca_loom)]
    #[inline(always)]
    fn store_word(&self, pos: usize, word: u64, order: Ordering) {
        self.ring.words[pos & self.ring.mask].store(word, order);
    }
    #[cfg(shmhca_loom)]
    #[inline(always)]
    unsafe fn write_body(&self, pos: usize, line: &Line) {
        let cell = &self.ring.lines[pos & self.ring.mask];
        // SAFETY: the caller owns the line; the write is inside the cell.
        cell.with_mut(|p| unsafe { (&mut (*p).0)[8..].copy_from_slice(&line.0[8..]) });
    }
    #[cfg(shmhca_loom)]
    #[inline(always)]
    unsafe fn read_lines(&self, pos: usize, out: &mut [Line]) {
        for (i, out) in out.iter_mut().enumerate() {
            let at = (pos + i) & self.ring.mask;
            // SAFETY: the caller guarantees the line is published and not yet released.
            *out = self.ring.lines[at].with(|p| unsafe { *p });
            out.set_word(self.ring.words[at].load(Ordering::Relaxed));
        }
    }
}

// ---------------------------------------------------------------------------------------
// Shared-memory storage
// ---------------------------------------------------------------------------------------

/// Which end of a shared line ring a [`ShmLines`] serves (selects the attach flag).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum End {
    Producer,
    Consumer,
}

/// Storage in a [`Segment`]: head and lines at an offset in its data area.
///
/// Holds the segment (an `Arc`) so the mapping outlives every pointer into it. Capacity is
/// a private copy validated at attach; nothing is re-read from the shared header afterwards.
pub struct ShmLines {
    segment: Arc<Segment>,
    base: NonNull<u8>,
    lines: NonNull<u8>,
    mask: usize,
    end: End,
}

impl std::fmt::Debug for ShmLines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmLines")
            .field("capacity", &(self.mask + 1))
            .field("end", &self.end)
            .field("segment", &self.segment)
            .finish_non_exhaustive()
    }
}

// SAFETY: the raw pointers point into the mapping owned by `segment` (an Arc, Send + Sync),
// which lives as long as this value; the memory is accessed only through atomics and raw
// copies, which are valid from any thread.
unsafe impl Send for ShmLines {}

impl ShmLines {
    /// Wraps the ring at `offset`. The caller has validated that the whole ring (header and
    /// `capacity` lines) lies inside the segment's data area, that `offset` is
    /// [`LINES_ALIGN`]-aligned, and that the segment is mapped read-write.
    pub(super) fn new(segment: Arc<Segment>, offset: usize, capacity: usize, end: End) -> Self {
        let data = segment.data_ptr();
        // SAFETY: (caller) offset + LINES_OFFSET + capacity * 64 <= data_len, so both
        // pointers are inside the mapping.
        let base = unsafe { data.add(offset) };
        // SAFETY: as above.
        let lines = unsafe { base.add(LINES_OFFSET) };
        ShmLines {
            segment,
            base,
            lines,
            mask: capacity - 1,
            end,
        }
    }

    /// A `core` atomic at `offset` from the ring's start.
    fn atomic_u64(&self, offset: usize) -> &core::sync::atomic::AtomicU64 {
        // SAFETY: offset is HEAD_OFFSET or PARKED_TAIL_OFFSET, inside the validated header,
        // 8-aligned (the ring is 128-aligned in a page-aligned data area); the mapping is
        // read-write and lives as long as &self. Atomics are the one sound way to share a
        // word with a concurrent writer; any bits are a valid u64.
        unsafe {
            core::sync::atomic::AtomicU64::from_ptr(self.base.as_ptr().wrapping_add(offset).cast())
        }
    }

    fn claim_flag(&self) -> &core::sync::atomic::AtomicU32 {
        let offset = match self.end {
            End::Producer => PRODUCER_CLAIM_OFFSET,
            End::Consumer => CONSUMER_CLAIM_OFFSET,
        };
        // SAFETY: as in atomic_u64: inside the header line, 4-aligned, mapped read-write.
        unsafe {
            core::sync::atomic::AtomicU32::from_ptr(self.base.as_ptr().wrapping_add(offset).cast())
        }
    }

    /// Marks this end as attached; false if another handle already holds it.
    pub(super) fn claim(&self) -> bool {
        // AcqRel: the swap orders against the Release store in `Drop` of a previous holder
        // (pairs with it), and our later accesses come after it.
        self.claim_flag().swap(1, Ordering::AcqRel) == 0
    }

    /// The producer index left by the last producer that detached (0 on a fresh ring).
    pub(super) fn parked_tail(&self) -> u64 {
        // SYNC: Acquire pairs with the Release store in park_tail (through the claim flag's
        // hand-off as well).
        self.atomic_u64(PARKED_TAIL_OFFSET).load(Ordering::Acquire)
    }

    /// Pointer to the line at `pos` (masked, so always in bounds).
    #[inline(always)]
    fn line_ptr(&self, pos: usize) -> *mut u8 {
        // In bounds: pos & mask < capacity, and capacity lines lie inside the mapping
        // (checked at attach); wrapping_add just keeps the arithmetic safe code.
        self.lines
            .as_ptr()
            .wrapping_add((pos & self.mask) * LINE_BYTES)
    }

    #[inline(always)]
    fn word(&self, pos: usize) -> &core::sync::atomic::AtomicU64 {
        // SAFETY: the line is inside the mapping (masked) and 64-aligned (the lines start
        // 256 bytes into a 128-aligned ring in a page-aligned data area), so its first 8
        // bytes are an aligned u64 location for as long as &self (the Arc keeps the mapping).
        unsafe { core::sync::atomic::AtomicU64::from_ptr(self.line_ptr(pos).cast::<u64>()) }
    }
}

impl sealed::RawLines for ShmLines {
    #[inline(always)]
    fn capacity(&self) -> usize {
        self.mask + 1
    }
    #[inline(always)]
    fn load_word(&self, pos: usize, order: Ordering) -> u64 {
        u64::from_le(self.word(pos).load(order))
    }
    #[inline(always)]
    fn store_word(&self, pos: usize, word: u64, order: Ordering) {
        self.word(pos).store(word.to_le(), order);
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
    fn prefetch_for_write(&self, pos: usize) {
        prefetch_write(self.line_ptr(pos));
    }
    #[inline(always)]
    unsafe fn write_body(&self, pos: usize, line: &Line) {
        // SAFETY: bytes 8..64 of a line inside the mapping; no reference to shared memory
        // is formed; `line` is private memory. A hostile peer writing the same bytes can
        // only garble its own data.
        unsafe {
            std::ptr::copy_nonoverlapping(
                line.0.as_ptr().wrapping_add(8),
                self.line_ptr(pos).wrapping_add(8),
                LINE_BYTES - 8,
            )
        };
    }
    #[inline(always)]
    unsafe fn read_lines(&self, pos: usize, out: &mut [Line]) {
        // The caller guarantees pos + out.len() ≤ capacity, so the run is inside the
        // mapping; `out` is private memory. This is the one copy that makes the consumer
        // immune to a peer rewriting a line after it was validated: the caller sees only
        // this copy (whose validated first word it restores), and any bytes are a valid Line.
        // Line by line: fixed-size copies the compiler inlines (most frames are one line)
        // beat a memcpy call.
        let src = self.line_ptr(pos).cast::<Line>();
        for (i, out) in out.iter_mut().enumerate() {
            // SAFETY: as above, line pos + i is inside the run; lines are 64-aligned.
            *out = unsafe { src.wrapping_add(i).read() };
        }
    }
    fn park_tail(&self, tail: u64) {
        // SYNC: Release pairs with the Acquire load in parked_tail of the next producer.
        self.atomic_u64(PARKED_TAIL_OFFSET)
            .store(tail, Ordering::Release);
    }
}

impl Drop for ShmLines {
    fn drop(&mut self) {
        // SYNC: Release pairs with the AcqRel swap in `claim` of the next handle on this end:
        // everything this handle did (the parked tail, the last head) happens before the next
        // one starts.
        self.claim_flag().store(0, Ordering::Release);
    }
}
