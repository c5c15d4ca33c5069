//! The atomics shim: every atomic, `UnsafeCell` and spin hint the ring code uses comes
//! from here, so one namespaced cfg swaps the whole set for [loom]'s model-checked
//! versions.
//!
//! Build with `RUSTFLAGS="--cfg shmhca_loom"` to get loom's types (this is what
//! `shmhca-loom-tests` does); without it these are the `core` types, at zero cost.
//! The cfg is namespaced (not plain `loom`) so that dependencies that have their own
//! loom switch are not flipped with us.
//!
//! Atomics that live *in shared memory* are different: loom can only model memory it
//! allocated itself, and a segment is an `mmap` shared with another process. They
//! always come from [`shm`], which is `core`'s atomics under every cfg. The ring code
//! is generic over its storage so that the very same index logic runs on loom's atomics
//! (heap storage) and on the real ones (shared-memory storage).
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

/// Atomics placed in shared memory. Always the real ones (loom cannot model an `mmap`).
pub mod shm {
    pub use core::sync::atomic::{AtomicU32, AtomicU64};
}
