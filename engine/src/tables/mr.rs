//! The engine's table of memory regions: keys, access checks, and deferred freeing.
//!
//! A key is `index << 8 | tag`: the index of the region's entry and an 8-bit generation tag
//! that changes every time the entry is reused, so a stale key (of a deregistered region)
//! is caught rather than resolving to whatever region now holds the entry. The same value
//! serves as L_Key and R_Key; whether it works remotely depends on the access flags.
//!
//! The table belongs to the engine and is only touched under the engine token: lookups on
//! the packet path, registration and deregistration on the control path. The only field
//! the application touches directly is the in-flight count in [`MrShared`].

use crate::sync::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::arena::{Block, PdArenas};
use crate::mem::Mem;
use crate::qp::AccessFlags;
use crate::slots::SlotTable;

/// The bit that marks a local offset as one in a registered buffer, not in the arena.
pub(crate) const USER_SPACE: u64 = 1 << 62;
const INDEX_MASK: u64 = 0xff_ffff;
const OFFSET_MASK: u64 = 0xffff_ffff;

/// The local offset of byte `offset` of the registered buffer of region `index`.
pub(crate) fn user_off(index: u32, offset: u64) -> u64 {
    USER_SPACE | (u64::from(index) & INDEX_MASK) << 32 | (offset & OFFSET_MASK)
}

/// Splits an offset in [`USER_SPACE`] into (region index, offset in its buffer).
pub(crate) fn split_user_off(off: u64) -> Option<(u32, u64)> {
    (off & USER_SPACE != 0).then_some((((off >> 32) & INDEX_MASK) as u32, off & OFFSET_MASK))
}

/// The part of a region shared with its application handle: how many scatter/gather
/// elements of posted, not yet retired work requests point into it.
///
/// Two words, so that neither a post under the engine token nor a retire needs a locked
/// instruction: the region's count is `held + posted` (wrapping).
///
/// * `posted` counts the elements posted *outside* the token (an engine thread running, or
///   the engine busy on another thread): any thread may post, so it is a `fetch_add`, made
///   before the WQE is published.
/// * `held` is written only by the token's holder, with a plain load and store: `+1` per
///   element posted under the token (`Device::run_for_post`: inline mode, or poll mode
///   with the engine thread stepped back for the posting thread's polls — `Qp::post_send`
///   hands its WQE straight to the engine, `post_recv` counts under the token), `−1` per
///   element retired
///   (every retire is the engine's). It wraps below zero when elements posted outside are
///   retired, which the sum undoes.
///
/// The application reads `held` (Acquire, pairing with the retire's Release store) and then
/// `posted`. While it checks a region (`Mr::as_mut_slice` with `&mut Mr`, `deregister` and
/// `into_inner` by value) no post of it can run — a post borrows the `Mr` — and every post
/// of it happened before; only retires run concurrently, and they only lower `held`. So the
/// sum read is the count at the moment `held` was read, or more: never less, and 0 only if
/// every element was retired then, with the engine's last access ordered before.
#[derive(Debug, Default)]
pub(crate) struct MrShared {
    /// Elements posted outside the engine token (`fetch_add` by the posters).
    pub(crate) posted: AtomicU32,
    /// Elements posted under the token minus elements retired (token holder only).
    pub(crate) held: AtomicU32,
}

impl MrShared {
    /// The elements in flight, for the application's checks (see the type's docs).
    #[inline]
    pub(crate) fn in_flight(&self) -> u32 {
        // SYNC: Acquire pairs with the Release store of `held` in `MrTable::release`: the
        // engine's last access into the region happens-before the application's next one.
        // Then `posted`: every post of a region being checked happened before the check.
        let held = self.held.load(Ordering::Acquire);
        held.wrapping_add(self.posted.load(Ordering::Acquire))
    }

    /// Counts `n` elements posted outside the engine token (before the WQE is published).
    #[inline]
    pub(crate) fn post_outside(&self, n: u32) {
        // SYNC: Relaxed: the WQE carrying the elements is published after this (a ring's
        // Release push), and the engine reads the count only after taking the WQE.
        self.posted.fetch_add(n, Ordering::Relaxed);
    }

    /// Takes back `n` elements counted by [`MrShared::post_outside`] whose work requests
    /// were not posted after all (never published to the engine).
    #[inline]
    pub(crate) fn unpost_outside(&self, n: u32) {
        self.posted.fetch_sub(n, Ordering::Relaxed);
    }

    /// Counts `n` elements posted by the holder of the engine token (a plain store).
    #[inline]
    pub(crate) fn post_held(&self, n: u32) {
        // SYNC: only token holders write `held`; the token orders them.
        let h = self.held.load(Ordering::Relaxed);
        self.held.store(h.wrapping_add(n), Ordering::Relaxed);
    }
}

/// One registered region.
#[derive(Debug)]
pub(crate) struct MrEntry {
    pub(crate) key: u32,
    pub(crate) pd: u32,
    pub(crate) access: AccessFlags,
    /// The block of its protection domain's arena holding it.
    pub(crate) block: Block,
    /// Length the user asked for (≤ block.len).
    pub(crate) len: u64,
    /// Its virtual address in this process (what peers put in RETH/AtomicETH).
    pub(crate) va: u64,
    pub(crate) shared: Arc<MrShared>,
    /// Deregistered (its handle dropped) while work requests still pointed into it: the
    /// key is dead and the memory is freed when `in_flight` reaches zero.
    pub(crate) zombie: bool,
    /// For a registered application buffer: the view of it (`block` is then its shadow in
    /// the arena, see [`crate::user_mem`]). Dropped with the entry, which lets the
    /// application have the buffer back.
    pub(crate) user: Option<Mem>,
}

impl MrEntry {
    /// The local offset of byte `start` of the region: in the arena, or in its buffer.
    pub(crate) fn local_off(&self, start: u64) -> u64 {
        match self.user {
            None => self.block.off + start,
            Some(_) => user_off(self.key >> 8, start),
        }
    }
}

/// Why a remote access was refused (the responder Naks with Remote Access Error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AccessDenied {
    UnknownKey,
    StaleKey,
    WrongPd,
    /// A type 2 memory window used through another QP than the one it is bound to.
    WrongQp,
    NoRights,
    OutOfBounds,
}

/// The table.
#[derive(Debug)]
pub(crate) struct MrTable {
    entries: SlotTable<MrEntry>,
}

impl Default for MrTable {
    fn default() -> MrTable {
        MrTable {
            entries: SlotTable::new(MAX_MRS, 8),
        }
    }
}

/// The most regions one context can hold (23-bit index: keys with the high bit set are
/// memory windows', see [`crate::tables::mw`]).
pub(crate) const MAX_MRS: u32 = crate::limits::MAX_MRS;

impl MrTable {
    /// Registers a region; returns its index and key.
    pub(crate) fn insert(
        &mut self,
        pd: u32,
        access: AccessFlags,
        block: Block,
        len: u64,
        va: u64,
        shared: Arc<MrShared>,
    ) -> Option<(u32, u32)> {
        // The generation (never 0, so that no key is 0) is the key's low 8 bits.
        self.entries
            .insert_with(|index, tag| MrEntry {
                key: index << 8 | tag,
                pd,
                access,
                block,
                len,
                va,
                shared,
                zombie: false,
                user: None,
            })
            .map(|(index, tag)| (index, index << 8 | tag))
    }

    /// The live entry named by `key`.
    pub(crate) fn by_key(&self, key: u32) -> Result<&MrEntry, AccessDenied> {
        let e = self.entries.at(key >> 8).ok_or(AccessDenied::UnknownKey)?;
        if e.key != key || e.zombie {
            return Err(AccessDenied::StaleKey);
        }
        Ok(e)
    }

    /// Checks a remote access of `len` bytes at `va` with R_Key `rkey` from a QP of
    /// protection domain `pd`; returns the arena offset of `va`.
    ///
    /// A zero-length access is not checked against the key (as in the IBA, a zero-length RDMA
    /// operation does not validate its R_Key) and resolves to offset 0.
    #[inline(always)]
    pub(crate) fn check_remote(
        &self,
        rkey: u32,
        pd: u32,
        need: AccessFlags,
        va: u64,
        len: u64,
    ) -> Result<u64, AccessDenied> {
        if len == 0 {
            return Ok(0);
        }
        let e = self.by_key(rkey)?;
        if e.pd != pd {
            return Err(AccessDenied::WrongPd);
        }
        if !e.access.contains(need) {
            return Err(AccessDenied::NoRights);
        }
        let start = va.checked_sub(e.va).ok_or(AccessDenied::OutOfBounds)?;
        let end = start.checked_add(len).ok_or(AccessDenied::OutOfBounds)?;
        if end > e.len {
            return Err(AccessDenied::OutOfBounds);
        }
        Ok(e.local_off(start))
    }

    /// Registers an application buffer viewed by `user`, with its shadow `block`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn insert_user(
        &mut self,
        pd: u32,
        access: AccessFlags,
        block: Block,
        len: u64,
        va: u64,
        shared: Arc<MrShared>,
        user: Mem,
    ) -> Option<(u32, u32)> {
        let (index, key) = self.insert(pd, access, block, len, va, shared)?;
        if let Some(e) = self.entries.at_mut(index) {
            e.user = Some(user);
        }
        Some((index, key))
    }

    /// The view of the application buffer of region `index` (live or zombie).
    #[inline]
    pub(crate) fn user_mem(&self, index: u32) -> Option<&Mem> {
        self.entries.at(index)?.user.as_ref()
    }

    /// Where a peer's RDMA Read of `len` bytes at local offset `off` (checked by
    /// [`MrTable::check_remote`]) can be read from: `off` itself in the arena, or for an
    /// application buffer its shadow, into which the bytes are copied now.
    pub(crate) fn stage_read(&self, off: u64, len: u64, arena: &Mem) -> Option<u64> {
        let Some((index, start)) = split_user_off(off) else {
            return Some(off);
        };
        let e = self.entries.at(index)?;
        let shadow = e.block.off.checked_add(start)?;
        Mem::copy(e.user.as_ref()?, start, arena, shadow, len).ok()?;
        Some(shadow)
    }

    /// Drops one in-flight reference of entry `index` (a WQE retired); frees the memory of
    /// a zombie whose last reference this was. A reference the region does not hold (a count
    /// already at zero) is ignored rather than wrapped around: whatever the caller believes,
    /// a region's count never underflows, so a busy region can never look free.
    pub(crate) fn release(&mut self, index: u32, pds: &mut PdArenas) {
        let Some(e) = self.entries.at(index) else {
            return;
        };
        // Only the token's holder lowers the count, so a count read as non-zero stays
        // non-zero until the store below; posts only raise it.
        let shared = &e.shared;
        let held = shared.held.load(Ordering::Relaxed);
        let count = held.wrapping_add(shared.posted.load(Ordering::Relaxed));
        if count == 0 {
            return;
        }
        // SYNC: Release pairs with the Acquire load in `MrShared::in_flight`: the engine's
        // last write into the region happens-before the application's next access. A plain
        // store: `held` has one writer at a time, the token's holder.
        // (Mutation point of the loom models: this store with Relaxed.)
        let order = crate::sync::weaken(Ordering::Release, "MrTable::release");
        shared.held.store(held.wrapping_sub(1), order);
        if count == 1 && e.zombie {
            self.free_entry(index, pds);
        }
    }

    /// Frees a dead entry's block in its arena, and the arena's hold on it.
    fn free_entry(&mut self, index: u32, pds: &mut PdArenas) {
        if let Some(e) = self.entries.remove_at(index) {
            if let Some(arena) = pds.get_mut(e.pd).filter(|_| e.block.len != 0) {
                arena.free(e.block);
            }
            pds.unhold(e.pd);
        }
    }

    /// Makes entry `index` leave its block allocated when it is freed (a region moved onto
    /// the arena whose pages could not be given back to the application: they still map
    /// the block, which must never be handed out again).
    pub(crate) fn keep_block(&mut self, index: u32) {
        if let Some(e) = self.entries.at_mut(index) {
            e.block.len = 0;
        }
    }

    /// Deregisters entry `index` (its handle is gone). Frees the memory now if nothing is in
    /// flight, else marks it a zombie freed by the last [`MrTable::release`].
    pub(crate) fn remove(&mut self, index: u32, pds: &mut PdArenas) {
        let Some(e) = self.entries.at_mut(index) else {
            return;
        };
        // SYNC: Acquire (in `in_flight`) pairs with the Release store in `release`.
        if e.shared.in_flight() == 0 {
            self.free_entry(index, pds);
        } else {
            e.zombie = true;
        }
    }

    /// Number of live and zombie entries.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shmhca_rings::segment::HugePages;

    const PD: u32 = 0;

    fn setup() -> (MrTable, PdArenas) {
        let mut pds = PdArenas::default();
        assert_eq!(pds.create(1 << 20, HugePages::Never).unwrap(), PD);
        (MrTable::default(), pds)
    }

    fn reg(t: &mut MrTable, a: &mut PdArenas, access: AccessFlags) -> (u32, u32, Arc<MrShared>) {
        let block = a.get_mut(PD).unwrap().alloc(4096, 64).unwrap();
        a.hold(PD);
        let shared = Arc::new(MrShared::default());
        let va = 0x7000_0000 + block.off;
        let (i, k) = t
            .insert(PD, access, block, 4096, va, shared.clone())
            .unwrap();
        (i, k, shared)
    }

    #[test]
    fn remote_checks_cover_key_pd_rights_and_bounds() {
        let (mut t, mut a) = setup();
        let (_, k, _) = reg(&mut t, &mut a, AccessFlags::REMOTE_WRITE);
        let e = t.by_key(k).unwrap();
        let (va, off) = (e.va, e.block.off);
        assert_eq!(
            t.check_remote(k, PD, AccessFlags::REMOTE_WRITE, va + 10, 100),
            Ok(off + 10)
        );
        assert_eq!(
            t.check_remote(k, PD + 1, AccessFlags::REMOTE_WRITE, va, 1),
            Err(AccessDenied::WrongPd)
        );
        assert_eq!(
            t.check_remote(k, PD, AccessFlags::REMOTE_READ, va, 1),
            Err(AccessDenied::NoRights)
        );
        assert_eq!(
            t.check_remote(k, PD, AccessFlags::REMOTE_WRITE, va + 4000, 97),
            Err(AccessDenied::OutOfBounds)
        );
        assert_eq!(
            t.check_remote(k, PD, AccessFlags::REMOTE_WRITE, va - 1, 1),
            Err(AccessDenied::OutOfBounds)
        );
        assert_eq!(
            t.check_remote(k, PD, AccessFlags::REMOTE_WRITE, u64::MAX, 2),
            Err(AccessDenied::OutOfBounds)
        );
        assert_eq!(
            t.check_remote(k ^ 0x100, PD, AccessFlags::REMOTE_WRITE, va, 1),
            Err(AccessDenied::UnknownKey)
        );
        // Zero-length accesses do not validate the key.
        assert_eq!(
            t.check_remote(0xdead, 9, AccessFlags::REMOTE_WRITE, 0, 0),
            Ok(0)
        );
    }

    #[test]
    fn a_stale_key_is_caught_after_the_entry_is_reused() {
        let (mut t, mut a) = setup();
        let (i, k, _) = reg(&mut t, &mut a, AccessFlags::REMOTE_READ);
        t.remove(i, &mut a);
        let (i2, k2, _) = reg(&mut t, &mut a, AccessFlags::REMOTE_READ);
        assert_eq!(i, i2, "the entry is reused");
        assert_ne!(k, k2);
        assert_eq!(t.by_key(k).unwrap_err(), AccessDenied::StaleKey);
        assert!(t.by_key(k2).is_ok());
    }

    #[test]
    fn memory_in_flight_is_freed_only_after_the_last_release() {
        let (mut t, mut a) = setup();
        let free0 = a.free_bytes();
        let (i, k, shared) = reg(&mut t, &mut a, AccessFlags::LOCAL_WRITE);
        shared.posted.store(2, Ordering::Relaxed);
        t.remove(i, &mut a);
        assert_eq!(t.by_key(k).unwrap_err(), AccessDenied::StaleKey);
        assert!(a.free_bytes() < free0, "still allocated");
        t.release(i, &mut a);
        assert!(a.free_bytes() < free0);
        t.release(i, &mut a);
        assert_eq!(a.free_bytes(), free0);
        assert_eq!(t.len(), 0);
    }
}

#[cfg(test)]
mod release_tests {
    use super::*;
    use shmhca_rings::segment::HugePages;

    #[test]
    fn a_release_the_region_does_not_hold_never_underflows_its_count() {
        let mut pds = PdArenas::default();
        let pd = pds.create(1 << 20, HugePages::Never).unwrap();
        let block = pds.get_mut(pd).unwrap().alloc(4096, 64).unwrap();
        pds.hold(pd);
        let shared = Arc::new(MrShared::default());
        let mut t = MrTable::default();
        let (i, _) = t
            .insert(pd, AccessFlags::LOCAL_WRITE, block, 4096, 0, shared.clone())
            .unwrap();
        // Never posted: a release for it (a lie, or a bug) must leave the count at zero,
        // not wrap it to 4294967295 and make the region look busy forever.
        t.release(i, &mut pds);
        t.release(i, &mut pds);
        assert_eq!(shared.in_flight(), 0);
        // And with one posted element, two releases drop exactly one.
        shared.posted.store(1, Ordering::Relaxed);
        t.release(i, &mut pds);
        t.release(i, &mut pds);
        assert_eq!(shared.in_flight(), 0);
    }

    #[test]
    fn the_last_region_of_a_domain_gives_its_arena_back() {
        let mut pds = PdArenas::default();
        let pd = pds.create(1 << 20, HugePages::Never).unwrap();
        let mut t = MrTable::default();
        let block = pds.get_mut(pd).unwrap().alloc(4096, 64).unwrap();
        pds.hold(pd);
        let (i, _) = t
            .insert(pd, AccessFlags::NONE, block, 4096, 0, Arc::default())
            .unwrap();
        pds.unhold(pd); // the Pd handle goes; the region keeps the arena
        assert_eq!(pds.len(), 1);
        t.remove(i, &mut pds);
        assert_eq!(pds.len(), 0, "the arena is unmapped with its last region");
    }
}

/// The two-word count through the verbs: elements posted under the engine token and
/// outside it (here: while the test's own thread holds the token, as a busy engine
/// would), retired in any mix.
#[cfg(all(test, not(shmhca_loom)))]
mod in_flight_tests {
    use crate::QpState;
    use crate::verbs::wr::{RecvWr, SendOp, SendWr, WcStatus, WorkCompletion};
    use crate::{AccessFlags, Context, Cq, EngineMode, Error, Qp, QpAttr};
    use shmhca_rings::segment::HugePages;

    fn pair(ctx: &Context, pd: &crate::Pd, cq: &Cq) -> (Qp, Qp) {
        crate::raw_peer::loopback_pair(ctx, pd, cq)
    }

    fn drain(ctx: &Context, cq: &mut Cq, want: usize) {
        let mut wc = [WorkCompletion::default(); 8];
        let mut got = 0;
        for _ in 0..10_000 {
            ctx.progress();
            let n = cq.poll(&mut wc);
            for w in &wc[..n] {
                assert_eq!(w.status, WcStatus::Success, "{w:?}");
            }
            got += n;
            if got >= want {
                return;
            }
        }
        panic!("{got} of {want} completions");
    }

    #[test]
    fn counts_posted_under_and_outside_the_token_sum_and_retire_to_zero() {
        let ctx = crate::raw_peer::small_inline_context();
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(16).unwrap();
        let (mut a, mut b) = pair(&ctx, &pd, &cq);
        let mut src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut dst = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        // One receive counted under the token (the owner's path), one outside it (the
        // token held by this very thread: `try_with` refuses, as for a busy engine).
        b.post_recv(&RecvWr::new(1, &[dst.sge(0, 8).unwrap()]))
            .unwrap();
        ctx.shared.engine.with(|_| {
            b.post_recv(&RecvWr::new(2, &[dst.sge(8, 8).unwrap()]))
                .unwrap();
        });
        let (held, posted) = (
            dst.inflight.held.load(std::sync::atomic::Ordering::Relaxed),
            dst.inflight
                .posted
                .load(std::sync::atomic::Ordering::Relaxed),
        );
        assert_eq!((held, posted), (1, 1), "one element each way");
        assert_eq!(dst.in_flight(), 2);
        assert!(matches!(
            dst.as_mut_slice(),
            Err(Error::MrBusy { in_flight: 2, .. })
        ));
        // Two sends from the same region: one direct under the token, one through the ring.
        a.post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 8).unwrap()]))
            .unwrap();
        ctx.shared.engine.with(|_| {
            a.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(8, 8).unwrap()]))
                .unwrap();
        });
        assert_eq!(src.in_flight(), 2);
        // Both receives and both sends complete: every count comes back to zero, even
        // though `held` went below zero on the way (elements posted outside, retired by
        // the engine).
        drain(&ctx, &mut cq, 4);
        assert_eq!((src.in_flight(), dst.in_flight()), (0, 0));
        assert!(dst.as_mut_slice().is_ok() && src.as_mut_slice().is_ok());
        assert!(dst.deregister().is_ok());
        assert!(src.deregister().is_ok());
    }

    #[test]
    fn a_region_dropped_with_mixed_elements_in_flight_is_freed_by_its_last_retire() {
        let ctx = crate::raw_peer::small_inline_context();
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(16).unwrap();
        let (mut a, mut b) = pair(&ctx, &pd, &cq);
        let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let free_before = ctx.arena_free();
        let dst = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        b.post_recv(&RecvWr::new(1, &[dst.sge(0, 8).unwrap()]))
            .unwrap();
        ctx.shared.engine.with(|_| {
            b.post_recv(&RecvWr::new(2, &[dst.sge(8, 8).unwrap()]))
                .unwrap();
        });
        let dst = match dst.deregister() {
            Err(r) if matches!(r.error(), Error::MrBusy { in_flight: 2, .. }) => r.into_value(),
            other => panic!("a region with two receives posted deregistered: {other:?}"),
        };
        drop(dst); // a zombie until its last element retires
        assert!(ctx.arena_free() < free_before);
        a.post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 8).unwrap()]))
            .unwrap();
        drain(&ctx, &mut cq, 2);
        assert!(ctx.arena_free() < free_before, "one receive still holds it");
        a.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 8).unwrap()]))
            .unwrap();
        drain(&ctx, &mut cq, 2);
        assert_eq!(ctx.arena_free(), free_before, "freed by its last retire");
    }

    #[test]
    fn receives_posted_in_the_error_state_are_flushed_under_and_outside_the_token() {
        let ctx = crate::raw_peer::small_inline_context();
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(16).unwrap();
        let (_a, mut b) = pair(&ctx, &pd, &cq);
        let dst = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        b.modify(&QpAttr::new(QpState::Error)).unwrap();
        for _ in 0..4 {
            ctx.progress();
        }
        let mut wc = [WorkCompletion::default(); 4];
        let mut flushed = |cq: &mut Cq| {
            let mut got = vec![];
            for _ in 0..100 {
                ctx.progress();
                let n = cq.poll(&mut wc);
                got.extend(wc[..n].iter().map(|w| (w.wr_id, w.status)));
            }
            got
        };
        // No doorbell for this one (posted under the token): the engine must still look
        // at the QP and flush it.
        b.post_recv(&RecvWr::new(1, &[dst.sge(0, 8).unwrap()]))
            .unwrap();
        assert_eq!(flushed(&mut cq), [(1, WcStatus::WrFlushErr)]);
        ctx.shared.engine.with(|_| {
            b.post_recv(&RecvWr::new(2, &[dst.sge(8, 8).unwrap()]))
                .unwrap();
        });
        assert_eq!(flushed(&mut cq), [(2, WcStatus::WrFlushErr)]);
        assert_eq!(dst.in_flight(), 0);
    }

    /// A post list counts each posted request's elements in flight once and takes back
    /// those of the requests not posted, whichever way it goes: in inline mode with the
    /// engine free each request goes out directly (counted under the token), with the
    /// engine busy (held here by the test) through the send ring, and in poll mode through
    /// the send ring with one count per region for the whole list.
    fn post_list_counts(mode: EngineMode, engine_busy: bool) {
        let ctx = Context::builder()
            .mode(mode)
            .progress(crate::Progress::Manual)
            .arena_size(1 << 20)
            .huge_pages(HugePages::Never)
            .build()
            .unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(32).unwrap();
        let (mut a, mut b) = pair(&ctx, &pd, &cq);
        let (s1, s2) = (
            pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap(),
            pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap(),
        );
        let dst = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
        let case = format!("{mode:?}, engine busy: {engine_busy}");
        // Posts `wrs` and returns its result with the regions' counts right after (before
        // the engine can retire anything).
        let post = |a: &mut Qp, wrs: &[SendWr<'_>]| {
            let go = |a: &mut Qp| (a.post_send_batch(wrs), (s1.in_flight(), s2.in_flight()));
            if engine_busy {
                ctx.shared.engine.with(|_| go(a))
            } else {
                go(a)
            }
        };
        for i in 0..3 {
            b.post_recv(&RecvWr::new(i, &[dst.sge(i * 64, 64).unwrap()]))
                .unwrap();
        }
        let (x, y) = ([s1.sge(0, 4).unwrap()], [s2.sge(0, 4).unwrap()]);
        // More elements than the QP's max_send_sge (1): refused.
        let too_many = [s1.sge(8, 4).unwrap(), s2.sge(8, 4).unwrap()];
        let wrs = [
            SendWr::new(1, SendOp::Send, &x),
            SendWr::new(2, SendOp::Send, &y),
            SendWr::new(3, SendOp::Send, &x),
            SendWr::new(4, SendOp::Send, &too_many),
            SendWr::new(5, SendOp::Send, &x),
        ];
        // The fourth request is refused: the three before it are posted and counted (s1:
        // 2 elements, s2: 1), the two from it on are not.
        let (r, counts) = post(&mut a, &wrs);
        let (done, err) = r.unwrap_err();
        assert_eq!(done, 3, "{case}");
        assert!(
            matches!(err, Error::InvalidArgument { .. }),
            "{case}: {err:?}"
        );
        assert_eq!(counts, (2, 1), "{case}");
        drain(&ctx, &mut cq, 6);
        assert_eq!(
            (s1.in_flight(), s2.in_flight(), dst.in_flight()),
            (0, 0, 0),
            "{case}"
        );
        // A whole list posted: every element counted once.
        for i in 0..3 {
            b.post_recv(&RecvWr::new(i, &[dst.sge(i * 64, 64).unwrap()]))
                .unwrap();
        }
        let (r, counts) = post(&mut a, &wrs[..3]);
        r.unwrap();
        assert_eq!(counts, (2, 1), "{case}");
        drain(&ctx, &mut cq, 6);
        assert_eq!((s1.in_flight(), s2.in_flight()), (0, 0), "{case}");
    }

    #[test]
    fn a_post_list_counts_its_elements_and_takes_back_those_not_posted() {
        post_list_counts(EngineMode::Inline, false);
        post_list_counts(EngineMode::Inline, true);
        post_list_counts(EngineMode::Poll { cpu: None }, true);
    }
}
