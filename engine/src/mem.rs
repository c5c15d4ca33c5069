//! Byte access to shared memory: the one module of the engine that touches memory by pointer.
//!
//! A [`Mem`] is a view of one mapping (my arena, a peer's arena mapped read-only, or private
//! heap memory: a QP's scatter/gather tables) together with a handle that keeps the mapping
//! alive. Every access is
//! bounds-checked against the length recorded when the view was made — a private copy, never
//! a length read back from shared memory — so an offset from a hostile peer can at worst
//! fail the check.
//!
//! # The memory model: DMA, not references
//!
//! The bytes behind a `Mem` are shared with another process (or, in loopback, with another
//! thread of this one) exactly as host memory is shared with a NIC's DMA engine: the engine
//! copies payload into an application's buffer while the application may be reading the
//! buffer next to it. So nothing here hands out a Rust reference to shared bytes except
//! [`Mem::slice_mut`], whose caller must prove exclusivity; all other access is a raw
//! `copy` of plain bytes, for which every bit pattern is a valid value. A racing reader can
//! see a torn *value*, never undefined behaviour of the kind that breaks this process's own
//! invariants: no byte read here is ever trusted before it has been validated, and no byte
//! written here is ever read back as anything but bytes.

#![allow(unsafe_code)]

use std::any::Any;
use std::cell::UnsafeCell;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use shmhca_rings::segment::{Access, Segment};

pub(crate) use shmhca_proto::mem::OutOfRange;

/// A bounds-checked view of one mapping.
pub(crate) struct Mem {
    base: NonNull<u8>,
    len: usize,
    writable: bool,
    /// Keeps the mapping alive as long as the view.
    _owner: Arc<dyn Any + Send + Sync>,
    /// Under loom: the cells every access is announced to (see `crate::sync::LoomLines`).
    #[cfg(shmhca_loom)]
    lines: Arc<crate::sync::LoomLines>,
}

// SAFETY: `Mem` is a pointer plus a keep-alive handle; the memory it points to is shared
// memory that every access treats as racy plain bytes (see the module docs), so moving the
// view to another thread or using it from several threads adds no hazard the accessors do
// not already handle.
unsafe impl Send for Mem {}
// SAFETY: as for `Send`: `&Mem` only offers bounds-checked raw copies and atomics.
unsafe impl Sync for Mem {}

/// Maps `len` bytes of `file` read-write and shared (a memfd registered as a
/// [`crate::verbs::UserMr`]).
///
/// `memmap2` marks this `unsafe` because another writer of the file could change the bytes
/// under a `&mut [u8]`; the mapping returned here is only reached through `Mem`'s raw
/// copies of racy bytes (a `Memfd` never hands out a slice), so that cannot break an
/// aliasing guarantee.
pub(crate) fn map_file_shared(
    file: &std::fs::File,
    len: usize,
) -> std::io::Result<memmap2::MmapMut> {
    // SAFETY: see the function docs: no reference to the mapped bytes is ever made from this
    // mapping, and the `Memfd` owning it keeps the file open while it exists.
    unsafe { memmap2::MmapOptions::new().len(len).map_mut(file) }
}

/// A registered application buffer, owned for as long as a [`Mem`] views it.
pub(crate) struct UserOwner<B>(UnsafeCell<B>);
// SAFETY: after `Mem::over_user` took its pointer, the buffer is only reached through `Mem`'s
// raw copies (see the module docs), never through `&B`, until `into_inner` has it back alone.
unsafe impl<B: Send> Sync for UserOwner<B> {}

impl<B> UserOwner<B> {
    /// The buffer, once nothing views it any more.
    pub(crate) fn into_inner(self) -> B {
        self.0.into_inner()
    }
}
// SAFETY: (loom builds only) the loom cells are touched only by the threads of a loom
// model, which loom runs one at a time, checking every access; they hold no data.
#[cfg(shmhca_loom)]
unsafe impl Sync for crate::sync::LoomLines {}
// SAFETY: as for `Sync`.
#[cfg(shmhca_loom)]
unsafe impl Send for crate::sync::LoomLines {}

/// Zero-initialised private heap storage for a [`Mem`].
struct HeapBytes(Box<[UnsafeCell<u64>]>);
// SAFETY: the cells are only ever accessed through `Mem`'s raw copies (see module docs).
unsafe impl Sync for HeapBytes {}
// SAFETY: owning a boxed slice of integers; nothing is tied to a thread.
unsafe impl Send for HeapBytes {}

/// The granularity of [`Mem::refresh`]: a page, so that a chunk is one `memcmp` call and
/// at most one `memmove` call over memory one TLB entry maps.
pub(crate) const REFRESH_CHUNK: usize = 4096;

/// `std::ptr::copy` (memmove semantics) with the lengths of small messages, 8 to 16 bytes,
/// done inline: both overlapping 8-byte words are loaded before either is stored, so
/// overlapping ranges come out as with `copy`. Anything else goes to `copy` (a call into
/// the C library's `memmove`, about 20 instructions for a few bytes).
///
/// # Safety
/// As `std::ptr::copy`: `src` valid for reads and `dst` for writes of `len` bytes.
#[inline(always)]
unsafe fn move_bytes(src: *const u8, dst: *mut u8, len: usize) {
    if (8..=16).contains(&len) {
        // (`len >= 8`: both words lie inside the ranges the caller vouches for, the second
        // starting at `len - 8`; unaligned accesses are allowed.)
        let tail = len - 8;
        // SAFETY: the first 8 bytes of the source range.
        let head_word = unsafe { src.cast::<u64>().read_unaligned() };
        // SAFETY: `tail + 8 == len`: inside the source range.
        let src_tail = unsafe { src.add(tail) };
        // SAFETY: the last 8 bytes of the source range.
        let tail_word = unsafe { src_tail.cast::<u64>().read_unaligned() };
        // SAFETY: the first 8 bytes of the destination range.
        unsafe { dst.cast::<u64>().write_unaligned(head_word) };
        // SAFETY: `tail + 8 == len`: inside the destination range.
        let dst_tail = unsafe { dst.add(tail) };
        // SAFETY: the last 8 bytes of the destination range.
        unsafe { dst_tail.cast::<u64>().write_unaligned(tail_word) };
    } else {
        // SAFETY: passed on from the caller.
        unsafe { std::ptr::copy(src, dst, len) };
    }
}

/// [`Mem::refresh`] of anything but the smallest messages: `len` bytes from `src` to
/// `dst`, copied at once below a [`REFRESH_CHUNK`], else a chunk at a time, each written
/// only if `memcmp` finds it different.
///
/// # Safety
/// `src` valid for reads and `dst` for reads and writes of `len` bytes. (Overlapping
/// ranges are no undefined behaviour, but come out wrong: chunks go front to back.)
#[inline(never)]
unsafe fn refresh_chunks(src: *const u8, dst: *mut u8, len: usize) {
    if len < REFRESH_CHUNK {
        // SAFETY: the caller's promise.
        unsafe { std::ptr::copy(src, dst, len) };
        return;
    }
    let mut at = 0;
    while at < len {
        let n = REFRESH_CHUNK.min(len - at);
        // SAFETY: `at + n <= len`: inside the source range (the caller's promise).
        let from = unsafe { src.add(at) };
        // SAFETY: as above, the destination range.
        let to = unsafe { dst.add(at) };
        // SAFETY: `memcmp` only reads both ranges: racy plain bytes, this module's
        // memory model. A chunk changing while it is compared (a writer breaking verbs'
        // rule that posted bytes stay put until the completion) comes out as torn as a
        // copy would have made it.
        let same = unsafe { libc::memcmp(from.cast(), to.cast(), n) } == 0;
        if !same {
            // SAFETY: as above, `dst` writable.
            unsafe { move_bytes(from, to, n) };
        }
        at += n;
    }
}

impl Mem {
    /// A view of a segment's data area, writable if the segment is mapped read-write.
    pub(crate) fn from_segment(segment: Arc<Segment>) -> Mem {
        let base = segment.data_ptr();
        let len = segment.data_len();
        let writable = segment.access() == Access::ReadWrite;
        Mem {
            base,
            len,
            writable,
            _owner: segment,
            #[cfg(shmhca_loom)]
            lines: Arc::new(crate::sync::LoomLines::new(len)),
        }
    }

    /// A zero-filled, 8-byte aligned, writable buffer of `len` bytes in this process's
    /// private heap: memory no other process can map. Shared between the application's
    /// handles and the engine like any `Mem` (racy plain bytes).
    pub(crate) fn private(len: usize) -> Mem {
        let words = len.div_ceil(8).max(1);
        let cells: Box<[UnsafeCell<u64>]> = (0..words).map(|_| UnsafeCell::new(0)).collect();
        let owner = Arc::new(HeapBytes(cells));
        let base = NonNull::new(owner.0.as_ptr() as *mut u8).expect("a boxed slice is non-null");
        Mem {
            base,
            len,
            writable: true,
            _owner: owner,
            #[cfg(shmhca_loom)]
            lines: Arc::new(crate::sync::LoomLines::new(len)),
        }
    }

    /// A writable view of a buffer the application registered ([`crate::verbs::UserMr`]):
    /// ordinary process memory (or a memfd mapped only here) that no peer can map. The
    /// buffer moves into the returned owner, which the view (and every view shared from it)
    /// keeps alive; the application gets it back from the owner once every view is gone.
    pub(crate) fn over_user<B: crate::user_buffer::UserBuffer>(buf: B) -> (Mem, Arc<UserOwner<B>>) {
        let owner = Arc::new(UserOwner(UnsafeCell::new(buf)));
        // SAFETY: the owner was just created, so this is the only access to the buffer; the
        // pointer taken here stays valid while the owner lives, because every implementor
        // of the sealed `UserBuffer` keeps its bytes at a fixed address when moved (a heap
        // allocation or a mapping) and the owner never touches the buffer again until
        // `UserOwner::into_inner`, which needs the last reference (no view left).
        let (ptr, len) = unsafe { (*owner.0.get()).raw_parts() };
        let base = NonNull::new(ptr).unwrap_or(NonNull::dangling());
        let keep: Arc<dyn Any + Send + Sync> = owner.clone();
        (
            Mem {
                base,
                len: if ptr.is_null() { 0 } else { len },
                writable: true,
                _owner: keep,
                #[cfg(shmhca_loom)]
                lines: Arc::new(crate::sync::LoomLines::new(len)),
            },
            owner,
        )
    }

    /// Another view of the same memory (shares the keep-alive handle).
    pub(crate) fn share(&self) -> Mem {
        Mem {
            base: self.base,
            len: self.len,
            writable: self.writable,
            _owner: self._owner.clone(),
            #[cfg(shmhca_loom)]
            lines: self.lines.clone(),
        }
    }

    /// A read-only view of the same memory: what a peer's engine gets of an arena when both
    /// run in this process (`Context::link_with`). It refuses writes as a peer's read-only
    /// mapping would.
    pub(crate) fn read_only(&self) -> Mem {
        Mem {
            writable: false,
            ..self.share()
        }
    }

    /// The view's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The address of byte 0 in this process.
    pub(crate) fn base_addr(&self) -> u64 {
        self.base.as_ptr() as u64
    }

    /// Checks that `off..off+len` lies inside the view; returns `off` as a `usize`.
    #[inline]
    pub(crate) fn check(&self, off: u64, len: u64) -> Result<usize, OutOfRange> {
        let end = off.checked_add(len).ok_or(OutOfRange)?;
        if end > self.len as u64 {
            return Err(OutOfRange);
        }
        Ok(off as usize)
    }

    #[inline]
    fn ptr_at(&self, off: usize) -> *mut u8 {
        // SAFETY: every caller checked `off..off+len` with `check`, so `off <= self.len` and
        // the result stays inside (or one past the end of) the mapping.
        unsafe { self.base.as_ptr().add(off) }
    }

    /// The address of the writable range `off..off+len`, for the UDP socket layer, which
    /// has the kernel write received datagrams there (`recvmmsg`): the range is checked
    /// here, the pointer stays valid while this view (or any view sharing its owner) lives.
    /// Writing through it is the caller's `unsafe`, under the same racy-bytes rules as
    /// [`Mem::write`].
    pub(crate) fn writable_range(&self, off: u64, len: u64) -> Result<*mut u8, OutOfRange> {
        if !self.writable {
            return Err(OutOfRange);
        }
        let off = self.check(off, len)?;
        Ok(self.ptr_at(off))
    }

    /// Copies `dst.len()` bytes starting at `off` out of the view.
    #[inline]
    pub(crate) fn read(&self, off: u64, dst: &mut [u8]) -> Result<(), OutOfRange> {
        let off = self.check(off, dst.len() as u64)?;
        #[cfg(shmhca_loom)]
        self.lines.track(off, dst.len(), false);
        // SAFETY: the source range is inside the live mapping (checked above, kept alive by
        // `_owner`); `dst` is a private buffer that cannot overlap shared memory handed out
        // only through raw copies; bytes have no invalid values.
        unsafe { move_bytes(self.ptr_at(off), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the view at `off`.
    #[inline]
    pub(crate) fn write(&self, off: u64, src: &[u8]) -> Result<(), OutOfRange> {
        if !self.writable {
            return Err(OutOfRange);
        }
        let off = self.check(off, src.len() as u64)?;
        #[cfg(shmhca_loom)]
        self.lines.track(off, src.len(), true);
        // SAFETY: destination inside the live, writable mapping (checked above); `src` is an
        // ordinary slice; `copy` tolerates overlap.
        unsafe { move_bytes(src.as_ptr(), self.ptr_at(off), src.len()) };
        Ok(())
    }

    /// Sets `len` bytes at `off` to zero.
    pub(crate) fn zero(&self, off: u64, len: u64) -> Result<(), OutOfRange> {
        if !self.writable {
            return Err(OutOfRange);
        }
        let off = self.check(off, len)?;
        #[cfg(shmhca_loom)]
        self.lines.track(off, len as usize, true);
        // SAFETY: range inside the live, writable mapping (checked above).
        unsafe { std::ptr::write_bytes(self.ptr_at(off), 0, len as usize) };
        Ok(())
    }

    /// Copies `len` bytes from `src` at `src_off` to `dst` at `dst_off` — the engine's "DMA".
    #[inline]
    pub(crate) fn copy(
        src: &Mem,
        src_off: u64,
        dst: &Mem,
        dst_off: u64,
        len: u64,
    ) -> Result<(), OutOfRange> {
        Mem::copy_inlined(src, src_off, dst, dst_off, len)
    }

    /// [`Mem::copy`], compiled into its caller (a copy of a few bytes on a hot path).
    #[inline(always)]
    pub(crate) fn copy_inlined(
        src: &Mem,
        src_off: u64,
        dst: &Mem,
        dst_off: u64,
        len: u64,
    ) -> Result<(), OutOfRange> {
        let (from, to) = Mem::copy_ends(src, src_off, dst, dst_off, len)?;
        // SAFETY: both ranges are inside live mappings (`copy_ends`), the destination is
        // writable; `copy` has memmove semantics, so a loopback copy within one arena that
        // overlaps is still defined.
        unsafe { move_bytes(from, to, len as usize) };
        Ok(())
    }

    /// The two ends of a copy of `len` bytes from `src` at `src_off` to `dst` at
    /// `dst_off`: checked (the destination writable, both ranges inside their mappings),
    /// as addresses.
    #[inline(always)]
    fn copy_ends(
        src: &Mem,
        src_off: u64,
        dst: &Mem,
        dst_off: u64,
        len: u64,
    ) -> Result<(*mut u8, *mut u8), OutOfRange> {
        if !dst.writable {
            return Err(OutOfRange);
        }
        let s = src.check(src_off, len)?;
        let d = dst.check(dst_off, len)?;
        #[cfg(shmhca_loom)]
        {
            src.lines.track(s, len as usize, false);
            dst.lines.track(d, len as usize, true);
        }
        Ok((src.ptr_at(s), dst.ptr_at(d)))
    }

    /// Copies `len` bytes from `src` at `src_off` to `dst` at `dst_off`, as [`Mem::copy`],
    /// but from [`REFRESH_CHUNK`] bytes up writes only the chunks whose bytes differ
    /// ([`refresh_chunks`]): a registered buffer's shadow on each post. A program that
    /// posts the same bytes again (perftest, any program that resends a buffer it did not
    /// change) then only reads, and the shadow's cache lines stay shared with the peer's
    /// core that reads them, instead of moving to this core for the write and back for the
    /// peer's read, every line of every message. Changed bytes cost the comparison up to
    /// the first difference of each chunk on top of the copy. The ranges must not overlap
    /// (a shadow never overlaps its buffer).
    #[inline]
    pub(crate) fn refresh(
        src: &Mem,
        src_off: u64,
        dst: &Mem,
        dst_off: u64,
        len: u64,
    ) -> Result<(), OutOfRange> {
        let (from, to) = Mem::copy_ends(src, src_off, dst, dst_off, len)?;
        let len = len as usize;
        if (8..=16).contains(&len) {
            // SAFETY: both ranges are inside live mappings (`copy_ends`), the
            // destination writable. (A small message's path is the copy's, instruction
            // for instruction.)
            unsafe { move_bytes(from, to, len) };
        } else {
            // SAFETY: as above.
            unsafe { refresh_chunks(from, to, len) };
        }
        Ok(())
    }

    #[inline]
    fn atomic_at(&self, off: u64) -> Result<&AtomicU64, OutOfRange> {
        if !self.writable || self.base_addr().wrapping_add(off) % 8 != 0 {
            return Err(OutOfRange);
        }
        let off = self.check(off, 8)?;
        // SAFETY: the 8 bytes are inside the live mapping, 8-byte aligned (checked above) and
        // writable; memory shared with other processes is exactly what `AtomicU64` is for,
        // and the reference does not outlive `self`, which keeps the mapping alive.
        Ok(unsafe { AtomicU64::from_ptr(self.ptr_at(off) as *mut u64) })
    }

    /// Atomic Fetch and Add on the 64-bit word at `off` (8-byte aligned); returns the
    /// original value.
    pub(crate) fn fetch_add_u64(&self, off: u64, add: u64) -> Result<u64, OutOfRange> {
        Ok(self.atomic_at(off)?.fetch_add(add, Ordering::SeqCst))
    }

    /// Atomic Compare and Swap on the 64-bit word at `off`; returns the original value.
    pub(crate) fn compare_swap_u64(
        &self,
        off: u64,
        compare: u64,
        swap: u64,
    ) -> Result<u64, OutOfRange> {
        let word = self.atomic_at(off)?;
        Ok(
            match word.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(v) | Err(v) => v,
            },
        )
    }

    /// The 4-byte aligned word at `off` as an atomic, for loads and futex waits/wakes.
    ///
    /// Also given for read-only views (a peer's arena): the engine only loads from and
    /// futex-wakes such a word, which read-only memory allows; it never stores through it.
    pub(crate) fn atomic_u32(&self, off: u64) -> Result<&AtomicU32, OutOfRange> {
        if off % 4 != 0 || self.base_addr() % 4 != 0 {
            return Err(OutOfRange);
        }
        let off = self.check(off, 4)?;
        // SAFETY: the 4 bytes are inside the live mapping and 4-byte aligned (checked
        // above); shared memory between processes is what atomics are for; the reference
        // does not outlive `self`, which keeps the mapping alive; and no caller stores
        // through it unless the view is writable.
        Ok(unsafe { AtomicU32::from_ptr(self.ptr_at(off) as *mut u32) })
    }

    /// Atomically loads the 64-bit word at `off`.
    pub(crate) fn load_u64(&self, off: u64) -> Result<u64, OutOfRange> {
        Ok(self.atomic_at(off)?.load(Ordering::SeqCst))
    }

    /// A mutable slice of `len` bytes at `off`.
    ///
    /// # Safety
    ///
    /// For the slice's lifetime nothing else may access those bytes: no other slice, no
    /// engine copy (no posted work request and no remote access may target them). The
    /// caller proves this; see [`crate::Mr::as_mut_slice`].
    // A `&mut` from `&self` is the point: the mapping is shared memory, and the caller's
    // proof of exclusivity (the contract above) is what makes the borrow unique.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut(&self, off: u64, len: u64) -> Result<&mut [u8], OutOfRange> {
        if !self.writable {
            return Err(OutOfRange);
        }
        let off = self.check(off, len)?;
        // Under loom, taking the slice counts as a write of all of it.
        #[cfg(shmhca_loom)]
        self.lines.track(off, len as usize, true);
        // SAFETY: inside the live, writable mapping (checked above); exclusivity is the
        // caller's obligation, stated in this function's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr_at(off), len as usize) })
    }
}

impl std::fmt::Debug for Mem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mem")
            .field("base", &self.base)
            .field("len", &self.len)
            .field("writable", &self.writable)
            .finish()
    }
}

/// The protocol core reads tables (and, in time, payloads) through this.
impl shmhca_proto::mem::Memory for Mem {
    #[inline]
    fn read(&self, off: u64, dst: &mut [u8]) -> Result<(), OutOfRange> {
        Mem::read(self, off, dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `move_bytes` moves exactly what `copy_within` (memmove) moves, for every length up
    /// to 32 (the inline 8-to-16-byte path and `copy` on either side of it) and every
    /// shift of the destination against the source, overlapping either way or not.
    #[test]
    fn small_moves_match_memmove() {
        for len in 0..=32usize {
            for src in 0..24usize {
                for dst in 0..24usize {
                    let start: Vec<u8> = (0..64u8).map(|b| b.wrapping_mul(37) ^ 0x5a).collect();
                    let mut want = start.clone();
                    want.copy_within(src..src + len, dst);
                    let mut got = start;
                    let base = got.as_mut_ptr();
                    let (from, to) = (base.wrapping_add(src), base.wrapping_add(dst));
                    // SAFETY: `src + len` and `dst + len` are at most 56, inside the 64 bytes
                    // of `got`, which both pointers come from.
                    unsafe { move_bytes(from, to, len) };
                    assert_eq!(got, want, "len {len}, from {src} to {dst}");
                }
            }
        }
    }

    #[test]
    fn bounds_are_enforced() {
        let m = Mem::private(64);
        assert!(m.write(60, &[1, 2, 3, 4]).is_ok());
        assert_eq!(m.write(61, &[1, 2, 3, 4]), Err(OutOfRange));
        assert_eq!(m.write(u64::MAX - 1, &[1, 2, 3, 4]), Err(OutOfRange));
        let mut b = [0u8; 4];
        m.read(60, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3, 4]);
        assert_eq!(m.read(64, &mut [0u8; 1]), Err(OutOfRange));
        assert!(m.read(64, &mut []).is_ok());
    }

    #[test]
    fn copy_between_views_and_within_one() {
        let a = Mem::private(32);
        let b = Mem::private(32);
        a.write(0, b"hello, world").unwrap();
        Mem::copy(&a, 0, &b, 4, 12).unwrap();
        let mut out = [0u8; 16];
        b.read(0, &mut out).unwrap();
        assert_eq!(&out, b"\0\0\0\0hello, world");
        // Overlapping copy inside one view behaves as memmove.
        Mem::copy(&b, 4, &b, 6, 12).unwrap();
        b.read(0, &mut out).unwrap();
        assert_eq!(&out[6..16], b"hello, wor");
        assert_eq!(Mem::copy(&a, 30, &b, 0, 4), Err(OutOfRange));
    }

    /// `refresh` leaves the destination as `copy` would, whatever differs and wherever
    /// the ranges start and end against the chunks; out-of-range or read-only
    /// destinations fail as `copy` does.
    #[test]
    fn a_refresh_leaves_what_a_copy_leaves() {
        let len = 3 * REFRESH_CHUNK + 100;
        let src = Mem::private(len);
        let pattern: Vec<u8> = (0..len).map(|i| (i * 13 + i / 4096) as u8).collect();
        src.write(0, &pattern).unwrap();
        for (off, n) in [
            (0, len),
            (5, len - 5),
            (REFRESH_CHUNK, 2 * REFRESH_CHUNK + 7),
            (9, 40),
        ] {
            for changed in [
                vec![],
                vec![0],
                vec![n - 1],
                vec![1, REFRESH_CHUNK + 3, n / 2],
            ] {
                let dst = Mem::private(len);
                Mem::copy(&src, 0, &dst, 0, len as u64).unwrap();
                for &c in &changed {
                    if c < n {
                        dst.write((off + c) as u64, &[!pattern[off + c]]).unwrap();
                    }
                }
                Mem::refresh(&src, off as u64, &dst, off as u64, n as u64).unwrap();
                let mut got = vec![0u8; len];
                dst.read(0, &mut got).unwrap();
                assert_eq!(got, pattern, "range {off}+{n}, changed {changed:?}");
            }
        }
        let dst = Mem::private(len);
        assert_eq!(Mem::refresh(&src, 0, &dst, 1, len as u64), Err(OutOfRange));
        assert_eq!(Mem::refresh(&src, 1, &dst, 0, len as u64), Err(OutOfRange));
        assert_eq!(
            Mem::refresh(&src, 0, &dst.read_only(), 0, 8),
            Err(OutOfRange)
        );
    }

    #[test]
    fn atomics_need_alignment_and_return_the_original() {
        let m = Mem::private(64);
        m.write(8, &5u64.to_ne_bytes()).unwrap();
        assert_eq!(m.fetch_add_u64(8, 3), Ok(5));
        assert_eq!(m.load_u64(8), Ok(8));
        assert_eq!(m.compare_swap_u64(8, 7, 100), Ok(8)); // no swap
        assert_eq!(m.compare_swap_u64(8, 8, 100), Ok(8)); // swapped
        assert_eq!(m.load_u64(8), Ok(100));
        assert_eq!(m.fetch_add_u64(4, 1), Err(OutOfRange));
        assert_eq!(m.fetch_add_u64(64, 1), Err(OutOfRange));
    }
}
