//! Arenas: the shared memory that memory regions and per-QP inline staging are carved from,
//! one per protection domain, and the engine page.
//!
//! # What a peer can see
//!
//! Each protection domain has its own arena: one [`Segment`] (memfd, huge pages when
//! available) created with [`Sharing::CreatorWrites`], so that the kernel refuses any
//! writable mapping of it but this process's own. A peer receives the arena of a protection
//! domain (as a read-only descriptor) only when one of that domain's QPs connects to it, and
//! reads it for what zero-copy needs: gather buffers of Sends and RDMA Writes, RDMA Read
//! sources, inline staging. An arena holds user data only — regions and copies of inline
//! data — never engine bookkeeping: scatter/gather tables, queues, keys and counts live in
//! private memory. A block is zeroed when it is freed, so a deregistered region's bytes
//! are gone before a peer could read them again, and memory never allocated is zero.
//!
//! The engine page is a separate one-page segment every peer maps read-only: it holds the
//! engine's sleeper count (see [`crate::engine::wake`]), whether it may sleep, and its
//! process id (for `shmhca stat`), nothing else.
//!
//! The allocator is a first-fit free list with coalescing. It runs on the control path only
//! (registering and deregistering memory, creating QPs), never per packet.

use std::collections::BTreeMap;
use std::sync::Arc;

use shmhca_rings::segment::{HugePages, Segment, Sharing};

use crate::error::{Error, Result};
use crate::mem::Mem;

/// The segment kind tag of an arena.
pub(crate) const ARENA_KIND: u32 = 0x4152_4e41; // "ARNA"
/// The segment kind tag of an engine page.
pub(crate) const ENGINE_PAGE_KIND: u32 = 0x4547_4150; // "PAGE"
/// Bytes of the engine page's data area.
pub(crate) const ENGINE_PAGE_LEN: usize = 4096;

/// Where the engine's sleeper count lives in its engine page: its own cache line. It counts
/// the engine's threads asleep (or about to be); whoever gives the engine work (a local
/// post, a peer's packets) reads it and, if it is not 0, bumps its kick word and wakes them
/// (see [`crate::engine::wake`]).
pub(crate) const WAKE_WORD: u64 = 0;
/// A word saying whether this engine may sleep at all (1) or always polls (0); peers read
/// it at link setup and, while it is 0, one engine iteration in `PUBLISH_EVERY`, and skip
/// the wake-up check while it is 0. An inline engine turns it to 1 (never back) when its
/// application takes a completion channel's fd (`Device::allow_fd_sleep`).
pub(crate) const MAY_SLEEP: u64 = 64;

/// The engine's process id (a little-endian u64), which `shmhca stat` shows for a link's
/// peer (it is the peer's claim, shown as such, never trusted).
pub(crate) const PID_WORD: u64 = 128;

/// The largest memfd [`Arena::adopt`] takes: 1 TiB (a peer maps at most its
/// `ConnectParams::max_peer_arena` of it).
pub(crate) const MAX_ADOPTED_LEN: usize = 1 << 40;

/// Smallest alignment of any allocation: a cache line, so that no two regions share one.
pub(crate) const MIN_ALIGN: u64 = 64;

/// Creates an engine page announcing whether the engine may sleep.
pub(crate) fn create_engine_page(may_sleep: bool) -> Result<Arc<Segment>> {
    let seg = Segment::builder(ENGINE_PAGE_KIND, ENGINE_PAGE_LEN)
        .name("shmhca-engine")
        .huge_pages(HugePages::Never)
        .sharing(Sharing::CreatorWrites)
        .create()?;
    seg.write_at(MAY_SLEEP as usize, &u32::from(may_sleep).to_ne_bytes())
        .and_then(|()| {
            seg.write_at(
                PID_WORD as usize,
                &u64::from(std::process::id()).to_le_bytes(),
            )
        })
        .map_err(|e| Error::invalid("engine page", e.to_string()))?;
    Ok(Arc::new(seg))
}

/// A block of an arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Block {
    /// Offset from the start of the arena's data area.
    pub(crate) off: u64,
    /// Length in bytes (rounded up to [`MIN_ALIGN`]).
    pub(crate) len: u64,
}

/// An arena segment and its allocator.
pub(crate) struct Arena {
    segment: Arc<Segment>,
    mem: Mem,
    /// Free blocks: offset → length. Adjacent blocks are always merged.
    free: BTreeMap<u64, u64>,
    free_bytes: u64,
    /// Bytes at the start that belong to the application (an arena over its memfd, see
    /// [`Arena::adopt`]): never allocated, never zeroed; freeing a block there is a no-op.
    user_len: u64,
}

impl Arena {
    /// Creates an arena of at least `size` bytes. Its pages are committed as they are first
    /// allocated (allocation zero-fills, on the control path), not all at once.
    pub(crate) fn create(size: u64, huge: HugePages) -> Result<Arena> {
        let total = usize::try_from(size)
            .map_err(|_| Error::invalid("arena size", format!("{size} bytes is too large")))?;
        let segment = Arc::new(
            Segment::builder(ARENA_KIND, total)
                .name("shmhca-arena")
                .huge_pages(huge)
                .sharing(Sharing::CreatorWrites)
                .populate(false)
                .create()?,
        );
        Ok(Arena::over(segment, 0))
    }

    /// An arena over the application's memfd `fd` (see [`Segment::adopt`]: sealed, mapped,
    /// no header). Its first `len - staging` bytes stay the application's: shmhca never
    /// allocates, zeroes or writes them (regions over them are registered in place with
    /// [`crate::Pd::reg_mr_at`]); the last `staging` bytes (from the next cache line) are
    /// the allocator's, for QP inline staging and [`crate::Pd::alloc_mr`].
    pub(crate) fn adopt(fd: std::os::fd::OwnedFd, staging: u64) -> Result<Arena> {
        let segment = Segment::adopt(fd, ARENA_KIND, MAX_ADOPTED_LEN)?;
        let len = segment.data_len() as u64;
        if staging > len {
            return Err(Error::invalid(
                "staging",
                format!(
                    "{staging} bytes, more than the memfd's {len}: give shmhca at most the \
                     whole file (0 keeps all of it yours)"
                ),
            ));
        }
        Ok(Arena::over(Arc::new(segment), len - staging))
    }

    /// An arena over an existing writable segment whose first `user_len` bytes are the
    /// application's.
    fn over(segment: Arc<Segment>, user_len: u64) -> Arena {
        let mem = Mem::from_segment(segment.clone());
        let start = user_len.div_ceil(MIN_ALIGN) * MIN_ALIGN;
        let end = mem.len() as u64 / MIN_ALIGN * MIN_ALIGN;
        let usable = end.saturating_sub(start);
        let mut free = BTreeMap::new();
        if usable > 0 {
            free.insert(start, usable);
        }
        Arena {
            segment,
            mem,
            free,
            free_bytes: usable,
            user_len,
        }
    }

    /// Bytes at the start that are the application's (0 for an arena shmhca created).
    pub(crate) fn user_len(&self) -> u64 {
        self.user_len
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
        // Free memory is already zero (see `free`); writing the zeros commits the pages
        // now, on the control path, so that the packet path never faults on them.
        self.mem
            .zero(start, len)
            .map_err(|_| Error::invalid("arena block", "outside the arena"))?;
        Ok(Block { off: start, len })
    }

    /// Zeroes a block and returns it to the free list, merging it with its neighbours.
    pub(crate) fn free(&mut self, block: Block) {
        if block.off < self.user_len {
            // A region registered in place over the application's bytes: they stay as
            // they are, and the allocator never owned them.
            return;
        }
        // A peer that can read this arena must not read what the block held.
        let _ = self.mem.zero(block.off, block.len);
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

/// The arenas of a context's protection domains, with the number of objects (the `Pd`
/// handle, its memory regions — live or waiting to be freed — and its QPs) that keep each
/// one alive. An arena is unmapped, and its memory given back, when its count reaches zero.
#[derive(Default)]
pub(crate) struct PdArenas {
    slots: Vec<Option<(Arena, u32)>>,
    free: Vec<u32>,
}

/// The most protection domains one context can hold.
pub(crate) const MAX_PDS: u32 = crate::limits::MAX_PDS;

impl PdArenas {
    /// Adds a protection domain with a new arena of `size` bytes, referenced once (by its
    /// handle); returns its number.
    pub(crate) fn create(&mut self, size: u64, huge: HugePages) -> Result<u32> {
        self.insert(Arena::create(size, huge))
    }

    /// Adds a protection domain whose arena is the application's memfd (see
    /// [`Arena::adopt`]), referenced once; returns its number.
    pub(crate) fn adopt(&mut self, fd: std::os::fd::OwnedFd, staging: u64) -> Result<u32> {
        self.insert(Arena::adopt(fd, staging))
    }

    fn insert(&mut self, arena: Result<Arena>) -> Result<u32> {
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                let i = u32::try_from(self.slots.len())
                    .ok()
                    .filter(|&i| i < MAX_PDS)
                    .ok_or(Error::LimitReached {
                        what: "protection domains in one context",
                        limit: MAX_PDS,
                    })?;
                self.slots.push(None);
                i
            }
        };
        match arena {
            Ok(arena) => {
                self.slots[index as usize] = Some((arena, 1));
                Ok(index)
            }
            Err(e) => {
                self.free.push(index);
                Err(e)
            }
        }
    }

    /// The arena of protection domain `pd`.
    pub(crate) fn get(&self, pd: u32) -> Option<&Arena> {
        self.slots.get(pd as usize)?.as_ref().map(|(a, _)| a)
    }

    /// The arena of protection domain `pd`, to allocate or free in.
    pub(crate) fn get_mut(&mut self, pd: u32) -> Option<&mut Arena> {
        self.slots.get_mut(pd as usize)?.as_mut().map(|(a, _)| a)
    }

    /// One more object keeps `pd`'s arena alive.
    pub(crate) fn hold(&mut self, pd: u32) {
        if let Some(Some((_, n))) = self.slots.get_mut(pd as usize) {
            *n += 1;
        }
    }

    /// One object fewer keeps `pd`'s arena alive; the last one frees it.
    pub(crate) fn unhold(&mut self, pd: u32) {
        let Some(slot) = self.slots.get_mut(pd as usize) else {
            return;
        };
        if let Some((_, n)) = slot.as_mut() {
            *n -= 1;
            if *n == 0 {
                *slot = None;
                self.free.push(pd);
            }
        }
    }

    /// Bytes free in every arena.
    pub(crate) fn free_bytes(&self) -> u64 {
        self.slots
            .iter()
            .flatten()
            .map(|(a, _)| a.free_bytes())
            .sum()
    }

    /// The page size of the first live arena.
    pub(crate) fn first_page_size(&self) -> Option<shmhca_rings::segment::PageSize> {
        self.slots
            .iter()
            .flatten()
            .next()
            .map(|(a, _)| a.segment().page_size())
    }

    /// Live protection domains.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.slots.iter().flatten().count()
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
