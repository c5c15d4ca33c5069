//! L_Key → memory region, for the hot path: two levels of atomic pointers indexed by the
//! key's region index (a key is `index << 8 | tag`), read with plain loads (no lock, no
//! locked instruction); registrations take a mutex. Each queue keeps the last key it
//! looked up in a [`KeyCache`], valid until any region of the context is removed.

use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

use crate::objects::MrObj;

const LEAF: usize = 4096;
const ROOT: usize = (1 << 23) / LEAF;

type Leaf = [AtomicPtr<MrObj>; LEAF];

/// The table.
pub struct MrKeys {
    root: Box<[AtomicPtr<Leaf>]>,
    write: Mutex<()>,
    /// Regions removed so far: a [`KeyCache`] filled at another count is stale.
    removed: AtomicU64,
}

/// The last L_Key a queue looked up and its region, as of a count of removals: the post
/// path's lookup when a program posts from one region (nearly always), one compare instead
/// of the table's two levels. Used by one thread at a time (its queue's).
pub struct KeyCache {
    key: u32,
    removed: u64,
    mr: *const MrObj,
}

impl Default for KeyCache {
    fn default() -> Self {
        // A count no table reaches: the first lookup fills the cache.
        KeyCache {
            key: 0,
            removed: u64::MAX,
            mr: std::ptr::null(),
        }
    }
}

impl Default for MrKeys {
    fn default() -> Self {
        Self::new()
    }
}

impl MrKeys {
    /// An empty table.
    pub fn new() -> MrKeys {
        MrKeys {
            root: (0..ROOT)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
            write: Mutex::new(()),
            removed: AtomicU64::new(0),
        }
    }

    fn slot(&self, key: u32, make: bool) -> Option<&AtomicPtr<MrObj>> {
        let index = (key >> 8) as usize;
        let root = self.root.get(index / LEAF)?;
        // SYNC: Acquire pairs with the Release store that published the leaf.
        let mut leaf = root.load(Ordering::Acquire);
        if leaf.is_null() {
            if !make {
                return None;
            }
            let fresh: Box<Leaf> = Box::new(std::array::from_fn(|_| AtomicPtr::default()));
            leaf = Box::into_raw(fresh);
            // SYNC: Release publishes the zeroed leaf (the writer holds the mutex).
            root.store(leaf, Ordering::Release);
        }
        // SAFETY: leaves are allocated here and freed only in Drop.
        Some(unsafe { &(*leaf)[index % LEAF] })
    }

    /// The region whose L_Key is `key`.
    #[inline]
    pub fn get(&self, key: u32) -> Option<&MrObj> {
        // SYNC: Acquire pairs with the Release store in `insert`.
        let p = self.slot(key, false)?.load(Ordering::Acquire);
        if p.is_null() {
            return None;
        }
        // SAFETY: a registered region stays allocated until `remove` took it out of the
        // table (deregistering a region while posting with its key is the caller's race,
        // as with any verbs provider).
        let mr = unsafe { &*p };
        (mr.mr.lkey == key).then_some(mr)
    }

    /// [`MrKeys::get`] through `cache`, which it refills on a miss.
    #[inline(always)]
    pub fn get_cached(&self, cache: &mut KeyCache, key: u32) -> Option<&MrObj> {
        // SYNC: Relaxed: a removal that happened before this post (the program's own
        // ordering between its threads, or this thread) is seen, by coherence; one racing
        // with it is the program's race, as in `get`. The region's fields were published to
        // this thread by the Acquire load that filled the cache.
        let removed = self.removed.load(Ordering::Relaxed);
        if cache.key == key && cache.removed == removed {
            // SAFETY: filled by `get` with this key, and no region was removed since: the
            // region is still registered, hence allocated.
            return Some(unsafe { &*cache.mr });
        }
        self.refill(cache, key, removed)
    }

    #[inline(never)]
    fn refill(&self, cache: &mut KeyCache, key: u32, removed: u64) -> Option<&MrObj> {
        let mr = self.get(key)?;
        *cache = KeyCache { key, removed, mr };
        Some(mr)
    }

    /// Enters a region under its key.
    pub fn insert(&self, key: u32, mr: *mut MrObj) {
        let _w = self.write.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = self.slot(key, true) {
            // SYNC: Release publishes the region's fields to `get`.
            s.store(mr, Ordering::Release);
        }
    }

    /// Removes the region of `key`.
    pub fn remove(&self, key: u32) {
        let _w = self.write.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = self.slot(key, false) {
            s.store(std::ptr::null_mut(), Ordering::Release);
        }
        // Before the region can be freed (the caller frees it after this returns): every
        // cache filled before now misses from here on.
        self.removed.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for MrKeys {
    fn drop(&mut self) {
        for r in self.root.iter() {
            let leaf = r.load(Ordering::Acquire);
            if !leaf.is_null() {
                // SAFETY: allocated by Box::into_raw in `slot`, freed once here.
                drop(unsafe { Box::from_raw(leaf) });
            }
        }
    }
}
