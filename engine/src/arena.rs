//! The arena: this process's shared memory, from which memory regions and per-QP staging
//! areas are carved.
//!
//! The arena is one [`Segment`] (memfd, huge pages when available). Connected peers map it
//! read-only, so every byte a peer needs to read — gather buffers of Sends and RDMA Writes,
//! RDMA Read sources, inline staging, multi-SGE gather tables — lives here and is named on
//! the wire by its offset. The first [`HEADER_LEN`] bytes hold the engine's wake-up word
//! (see [`crate::engine`]); allocations come after.
//!
//! The allocator is a first-fit free list with coalescing. It runs on the control path only
//! (registering and deregistering memory, creating QPs), never per packet.

use std::collections::BTreeMap;
use std::sync::Arc;

use shmhca_rings::segment::{HugePages, Segment};

use crate::error::{Error, Result};
use crate::mem::Mem;

/// The segment kind tag of an arena.
pub(crate) const ARENA_KIND: u32 = 0x4152_4e41; // "ARNA"

/// Bytes at the start of the arena reserved for the engine's shared header.
pub(crate) const HEADER_LEN: u64 = 4096;

/// Where the engine's wake-up word lives in the arena header: its own cache line. While
/// the engine thread sleeps it holds 1 and the thread waits on it with a futex; whoever
/// gives it work (a local post, a peer's packets) wakes it.
pub(crate) const WAKE_WORD: u64 = 64;
/// A word saying whether this engine may sleep at all (1) or always polls (0); peers read
/// it once, at link setup, and skip the wake-up check when it is 0.
pub(crate) const MAY_SLEEP: u64 = 128;

/// Smallest alignment of any allocation: a cache line, so that no two regions share one.
pub(crate) const MIN_ALIGN: u64 = 64;

/// A block of the arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Block {
    /// Offset from the start of the arena's data area.
    pub(crate) off: u64,
    /// Length in bytes (rounded up to [`MIN_ALIGN`]).
    pub(crate) len: u64,
}

/// The arena segment and its allocator.
pub(crate) struct Arena {
    segment: Arc<Segment>,
    mem: Mem,
    /// Free blocks: offset → length. Adjacent blocks are always merged.
    free: BTreeMap<u64, u64>,
    free_bytes: u64,
}

impl Arena {
    /// Creates an arena of at least `size` bytes.
    pub(crate) fn create(size: u64, huge: HugePages) -> Result<Arena> {
        let total = size
            .checked_add(HEADER_LEN)
            .ok_or_else(|| Error::invalid("arena size", format!("{size} bytes is too large")))?;
        let total = usize::try_from(total)
            .map_err(|_| Error::invalid("arena size", format!("{size} bytes is too large")))?;
        let segment = Arc::new(
            Segment::builder(ARENA_KIND, total)
                .name("shmhca-arena")
                .huge_pages(huge)
                .create()?,
        );
        Ok(Arena::over(segment))
    }

    /// An arena over an existing writable segment (used by tests).
    pub(crate) fn over(segment: Arc<Segment>) -> Arena {
        let mem = Mem::from_segment(segment.clone());
        let len = mem.len() as u64;
        let mut free = BTreeMap::new();
        let start = HEADER_LEN.min(len);
        let usable = (len - start) / MIN_ALIGN * MIN_ALIGN;
        if usable > 0 {
            free.insert(start, usable);
        }
        Arena {
            segment,
            mem,
            free,
            free_bytes: usable,
        }
    }

    /// The arena's memory.
    pub(crate) fn mem(&self) -> &Mem {
        &self.mem
    }

    /// The segment, to hand to peers.
    pub(crate) fn segment(&self) -> &Arc<Segment> {
        &self.segment
    }

    /// Bytes free in all blocks.
    pub(crate) fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Allocates `len` bytes (at least one cache line) aligned to `align` (a power of two,
    /// raised to [`MIN_ALIGN`]); the block is zero-filled.
    ///
    /// # Errors
    /// [`Error::ArenaExhausted`] when no free block fits.
    pub(crate) fn alloc(&mut self, len: u64, align: u64) -> Result<Block> {
        let align = align.max(MIN_ALIGN);
        debug_assert!(align.is_power_of_two());
        let len = len.max(1).div_ceil(MIN_ALIGN) * MIN_ALIGN;
        let found = self.free.iter().find_map(|(&off, &flen)| {
            let start = off.div_ceil(align) * align;
            let pad = start - off;
            (flen >= pad + len).then_some((off, flen, start))
        });
        let Some((off, flen, start)) = found else {
            return Err(Error::ArenaExhausted {
                requested: len,
                free: self.free_bytes,
                arena: self.mem.len() as u64,
            });
        };
        self.free.remove(&off);
        if start > off {
            self.free.insert(off, start - off);
        }
        let end = start + len;
        if off + flen > end {
            self.free.insert(end, off + flen - end);
        }
        self.free_bytes -= len;
        self.mem
            .zero(start, len)
            .expect("a free block lies inside the arena");
        Ok(Block { off: start, len })
    }

    /// Returns a block to the free list, merging it with its neighbours.
    pub(crate) fn free(&mut self, block: Block) {
        let mut off = block.off;
        let mut len = block.len;
        debug_assert!(!self.free.contains_key(&off), "double free of {block:?}");
        if let Some((&poff, &plen)) = self.free.range(..off).next_back() {
            if poff + plen == off {
                self.free.remove(&poff);
                off = poff;
                len += plen;
            }
        }
        if let Some(&nlen) = self.free.get(&(off + len)) {
            self.free.remove(&(off + len));
            len += nlen;
        }
        self.free.insert(off, len);
        self.free_bytes += block.len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arena(len: usize) -> Arena {
        Arena::create(len as u64, HugePages::Never).unwrap()
    }

    #[test]
    fn allocations_are_aligned_disjoint_and_zeroed() {
        let mut a = arena(1 << 20);
        let x = a.alloc(100, 64).unwrap();
        let y = a.alloc(4096, 4096).unwrap();
        let z = a.alloc(1, 8).unwrap();
        assert_eq!(x.len, 128);
        assert_eq!(y.off % 4096, 0);
        assert!(x.off >= HEADER_LEN);
        let overlap = |p: Block, q: Block| p.off < q.off + q.len && q.off < p.off + p.len;
        assert!(!overlap(x, y) && !overlap(y, z) && !overlap(x, z));
        a.mem().write(y.off, &[0xAB; 16]).unwrap();
        a.free(y);
        let y2 = a.alloc(4096, 4096).unwrap();
        let mut b = [1u8; 16];
        a.mem().read(y2.off, &mut b).unwrap();
        assert_eq!(b, [0; 16], "reused memory is zero-filled");
    }

    #[test]
    fn free_coalesces_so_the_whole_arena_comes_back() {
        let mut a = arena(1 << 20);
        let before = a.free_bytes();
        let blocks: Vec<_> = (0..50)
            .map(|i| a.alloc(1000 + i * 37, 64).unwrap())
            .collect();
        for (i, b) in blocks.iter().enumerate() {
            if i % 2 == 0 {
                a.free(*b);
            }
        }
        for (i, b) in blocks.iter().enumerate() {
            if i % 2 == 1 {
                a.free(*b);
            }
        }
        assert_eq!(a.free_bytes(), before);
        assert_eq!(a.free.len(), 1, "one block after all frees: {:?}", a.free);
        let all = a.alloc(before, 64).unwrap();
        assert_eq!(all.len, before);
    }

    #[test]
    fn exhaustion_is_an_error_naming_sizes() {
        let mut a = arena(64 * 1024);
        let err = a.alloc(10 << 20, 64).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("arena_size"), "{msg}");
        assert!(matches!(err, Error::ArenaExhausted { requested, .. } if requested == 10 << 20));
    }
}
