//! L_Key → memory region, for the hot path: two levels of atomic pointers indexed by the
//! key's region index (a key is `index << 8 | tag`), read with plain loads (no lock, no
//! locked instruction); registrations take a mutex.

use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, Ordering};

use crate::objects::MrObj;

const LEAF: usize = 4096;
const ROOT: usize = (1 << 23) / LEAF;

type Leaf = [AtomicPtr<MrObj>; LEAF];

/// The table.
pub struct MrKeys {
    root: Box<[AtomicPtr<Leaf>]>,
    write: Mutex<()>,
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
