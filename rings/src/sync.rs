//! The atomics shim: every atomic, `UnsafeCell` and spin hint the ring code uses comes
//! from here, so one namespaced cfg swaps the whole set for [loom]'s model-checked
//! versions.
//!
//! Build with `RUSTFLAGS="--cfg shmhca_loom"` to get loom's types (this is what
//! `shmhca-loom-tests` does); without it these are the `core` types, at zero cost.
//! The cfg is namespaced (not plain `loom`) so that dependencies that have their own
//! loom switch are not flipped with us.
//!
//! Atomics that live *in shared memory* come from [`shm`]: `core`'s atomics, except that
//! under loom the index words of a shared ring are loom's, placed in the segment where
//! the real ones live (see `ShmStorage`), so the same index code is checked for both
//! storages. [`mutation`] holds the orderings the models weaken on purpose.
//!
//! [loom]: https://docs.rs/loom

#[cfg(not(shmhca_loom))]
mod imp {
    pub use core::sync::atomic::{AtomicU64, Ordering};

    /// Hint that we are busy-waiting (the `pause` instruction on x86).
    #[inline(always)]
    pub fn spin_loop() {
        core::hint::spin_loop();
    }

    /// An `UnsafeCell` with loom's closure-based access API, so that code written
    /// against it runs unchanged under loom, which tracks every access.
    #[derive(Debug)]
    #[repr(transparent)]
    pub struct UnsafeCell<T>(core::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        /// Wraps `value`.
        #[inline(always)]
        pub const fn new(value: T) -> Self {
            Self(core::cell::UnsafeCell::new(value))
        }

        /// Runs `f` with a pointer for reading the contents.
        #[inline(always)]
        pub fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0.get())
        }

        /// Runs `f` with a pointer for writing the contents.
        #[inline(always)]
        pub fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }
    }
}

#[cfg(shmhca_loom)]
mod imp {
    pub use loom::cell::UnsafeCell;
    pub use loom::sync::atomic::{AtomicU64, Ordering};

    /// Under loom a busy-wait must yield, or the model checker would explore the
    /// same spinning thread forever.
    #[inline(always)]
    pub fn spin_loop() {
        loom::thread::yield_now();
    }
}

pub use imp::*;

/// Atomics placed in shared memory.
///
/// Without loom they are `core`'s atomics. Under loom the index words of a shared ring are
/// loom's atomics, placed where the real ones live in the segment by
/// [`init_shm_ring`](crate::ring::init_shm_ring), so the models check the very code that
/// loads and stores the indices of a shared ring (see `ShmStorage`). The ring's attach
/// flags (4 bytes apart: no room for a loom atomic) stay `core`'s under every cfg.
pub mod shm {
    pub use core::sync::atomic::AtomicU32;
    #[cfg(not(shmhca_loom))]
    pub use core::sync::atomic::AtomicU64;
    #[cfg(shmhca_loom)]
    pub use loom::sync::atomic::AtomicU64;
}

/// Mutation points: orderings the loom models weaken on purpose, to show that they catch
/// the bug.
///
/// A hand-off's ordering is written `weaken(Ordering::Release, "name")` at the one place it
/// matters. Without loom, [`weaken`] returns the ordering unchanged (it inlines away).
/// Under loom, a model runs with `mutation::run` naming a point, and every `weaken`
/// with that name returns `Relaxed` instead; `run` also counts how often the point was
/// reached, so a model can prove it ran the weakened line.
pub mod mutation {
    use super::Ordering;

    /// `order`, or `Relaxed` when a loom model weakens the point `name` (see the module).
    #[inline(always)]
    pub fn weaken(order: Ordering, name: &'static str) -> Ordering {
        #[cfg(shmhca_loom)]
        if active::hit(name) {
            return Ordering::Relaxed;
        }
        let _ = name;
        order
    }

    /// True when a loom model has switched on the behavioural mutation point `name` (a
    /// step done in the wrong place rather than with a weaker ordering: see
    /// [`crate::lines`]). Always false without loom (it inlines away).
    #[inline(always)]
    pub fn mutated(name: &'static str) -> bool {
        #[cfg(shmhca_loom)]
        if active::hit(name) {
            return true;
        }
        let _ = name;
        false
    }

    /// Runs `f` with the point `name` weakened (on this OS thread, which is where loom
    /// runs every thread of a model); returns `f`'s result and how many times the point was
    /// reached.
    #[cfg(shmhca_loom)]
    pub fn run<R>(name: &'static str, f: impl FnOnce() -> R) -> (R, u64) {
        struct Reset;
        impl Drop for Reset {
            fn drop(&mut self) {
                active::ACTIVE.with(|a| a.set(None));
            }
        }
        active::ACTIVE.with(|a| a.set(Some(name)));
        active::HITS.with(|h| h.set(0));
        let reset = Reset;
        let r = f();
        drop(reset);
        (r, active::HITS.with(|h| h.get()))
    }

    /// How many times the point weakened by the [`run`] in progress (or the last one) was
    /// reached.
    #[cfg(shmhca_loom)]
    pub fn hits() -> u64 {
        active::HITS.with(|h| h.get())
    }

    #[cfg(shmhca_loom)]
    mod active {
        use std::cell::Cell;

        thread_local! {
            pub(super) static ACTIVE: Cell<Option<&'static str>> = const { Cell::new(None) };
            pub(super) static HITS: Cell<u64> = const { Cell::new(0) };
        }

        pub(super) fn hit(name: &'static str) -> bool {
            let on = ACTIVE.with(|a| a.get()) == Some(name);
            if on {
                HITS.with(|h| h.set(h.get() + 1));
            }
            on
        }
    }
}

pub use mutation::{mutated, weaken};
