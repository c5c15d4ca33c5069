//! Moving a program's pages onto its protection domain's arena and back, in place
//! ([`Pd::reg_mr_in_place`](crate::Pd::reg_mr_in_place)): the one place that remaps memory.
//!
//! The arena's memfd is sealed against new writable shared mappings (`F_SEAL_FUTURE_WRITE`,
//! which is what keeps peers from ever writing it), so the program's range cannot be an
//! `mmap` of the memfd. It becomes instead a second mapping of the creator's own writable
//! mapping of the block: `mremap(block, 0, len, MREMAP_MAYMOVE | MREMAP_FIXED, addr)`,
//! which for a shared mapping and an old size of 0 maps the same file pages again at `addr`
//! (replacing what was there) without asking the file for a new mapping.

#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, Once, TryLockError};

use rustix::mm::{MapFlags, MremapFlags, ProtFlags};

/// The ranges of this process moved onto an arena (start → length), by every context: a
/// second region over pages already moved would move them again, onto its own block, and
/// leave the first region's block no longer the program's bytes.
static MOVED: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

/// Claims `addr..addr + len` for a region moved onto an arena; `false` (nothing claimed) if
/// it overlaps a range already claimed.
pub(crate) fn claim(addr: usize, len: usize) -> bool {
    protect_children();
    let _g = ForkGuard::take();
    let mut moved = MOVED.lock().unwrap_or_else(|e| e.into_inner());
    let end = addr.saturating_add(len);
    let before = moved
        .range(..end)
        .next_back()
        .is_some_and(|(&a, &l)| a.saturating_add(l) > addr);
    if before {
        return false;
    }
    moved.insert(addr, len);
    true
}

/// Gives up the claim on the range starting at `addr` (its region is gone, or never was).
pub(crate) fn unclaim(addr: usize) {
    let _g = ForkGuard::take();
    MOVED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&addr);
}

// Fork. A moved range is a shared mapping of the arena, which a child made by `fork`
// inherits as shared: its writes to the program's buffer would land in the parent's (and a
// peer's RDMA Read would see them), where a program expects the child's memory to be its
// own copy, as it is for every other page. So the child, before it returns from `fork`,
// replaces each moved range with a private copy of its bytes (`pthread_atfork`'s child
// handler); the parent keeps its shared pages. (A child that execs loses them all anyway.)

/// Held by whoever changes `MOVED`, and across `fork` by the thread forking (taken in the
/// prepare handler): so `MOVED`'s lock is free in the child, whose only thread reads it.
static FORK_GUARD: AtomicBool = AtomicBool::new(false);

/// [`FORK_GUARD`], held.
struct ForkGuard;

impl ForkGuard {
    fn take() -> ForkGuard {
        lock_fork_guard();
        ForkGuard
    }
}

impl Drop for ForkGuard {
    fn drop(&mut self) {
        unlock_fork_guard();
    }
}

fn lock_fork_guard() {
    // SYNC: Acquire pairs with the Release in `unlock_fork_guard`: what the last holder
    // did to `MOVED` is seen by the next. Contended only while a region is registered or
    // dropped at the moment another thread forks: cold.
    while FORK_GUARD
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        std::thread::yield_now();
    }
}

fn unlock_fork_guard() {
    // SYNC: Release pairs with the Acquire in `lock_fork_guard`.
    FORK_GUARD.store(false, Ordering::Release);
}

unsafe extern "C" {
    /// glibc's `pthread_atfork` (POSIX).
    fn pthread_atfork(
        prepare: Option<unsafe extern "C" fn()>,
        parent: Option<unsafe extern "C" fn()>,
        child: Option<unsafe extern "C" fn()>,
    ) -> std::ffi::c_int;
}

/// Installs the fork handlers, once per process (before the first range is moved).
fn protect_children() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        // SAFETY: the three handlers are `extern "C"` functions that live as long as the
        // process, never unwind and (in the child) call only async-signal-safe operations:
        // an atomic store, mmap, mremap and a copy.
        let r = unsafe {
            pthread_atfork(
                Some(before_fork),
                Some(after_fork_in_parent),
                Some(after_fork_in_child),
            )
        };
        if r != 0 {
            eprintln!(
                "shmhca: pthread_atfork failed ({r}): a child made by fork() will share the \
                 pages of in-place registered memory with its parent"
            );
        }
    });
}

unsafe extern "C" fn before_fork() {
    lock_fork_guard();
}

unsafe extern "C" fn after_fork_in_parent() {
    unlock_fork_guard();
}

unsafe extern "C" fn after_fork_in_child() {
    // The child's only thread: `MOVED`'s lock is free (every holder also held the guard,
    // which the forking thread held), and locking it allocates nothing.
    let moved = match MOVED.try_lock() {
        Ok(g) => g,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        Err(TryLockError::WouldBlock) => {
            unlock_fork_guard();
            return;
        }
    };
    for (&addr, &len) in moved.iter() {
        // SAFETY: `addr..addr + len` is a moved range (claimed, and mapped, by its region),
        // page-aligned; nothing else runs in the child during the handler.
        if unsafe { privatize(addr as *mut u8, len) }.is_err() {
            // Nothing to report it to without allocating: the range stays shared.
        }
    }
    drop(moved);
    unlock_fork_guard();
}

/// Replaces the mapping at `addr..addr + len` with private anonymous memory holding its
/// bytes.
///
/// # Safety
/// `addr..addr + len` is a mapping, page-aligned, that nothing else uses during the call
/// and no Rust reference points into.
unsafe fn privatize(addr: *mut u8, len: usize) -> rustix::io::Result<()> {
    // SAFETY: a fresh private mapping the kernel places where it likes.
    let tmp = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE,
        )
    }?;
    // SAFETY: both ranges are `len` bytes, distinct mappings; `addr` is readable.
    unsafe { std::ptr::copy_nonoverlapping(addr, tmp.cast::<u8>(), len) };
    // SAFETY: moves the private copy over `addr` (MREMAP_FIXED replaces what was there).
    match unsafe { rustix::mm::mremap_fixed(tmp, len, len, MremapFlags::MAYMOVE, addr.cast()) } {
        Ok(_) => Ok(()),
        Err(e) => {
            // SAFETY: `tmp` is ours and unused.
            let _ = unsafe { rustix::mm::munmap(tmp, len) };
            Err(e)
        }
    }
}

/// Copies the program's `len` bytes at `addr` into the arena block at `block`, then makes
/// `addr..addr + len` a mapping of the block's pages. If the remapping fails, `addr` is
/// private memory holding its bytes again (or, if even that fails, the error says so).
///
/// # Safety
/// `block..block + len` is a block of the arena's writable shared mapping that the caller
/// allocated and nothing else uses yet; `addr..addr + len` is memory the caller owns, mapped
/// read/write, used by nothing else during the call and referenced by no Rust reference;
/// both are page-aligned and `len` is a non-zero multiple of the page size.
pub(crate) unsafe fn move_onto_arena(
    block: *mut u8,
    addr: *mut u8,
    len: usize,
) -> std::io::Result<()> {
    // SAFETY: both ranges are valid for `len` bytes (the caller's contract) and disjoint:
    // the block is in the arena's mapping, which the program's memory is not part of.
    unsafe { std::ptr::copy_nonoverlapping(addr, block, len) };
    // SAFETY: `block` is page-aligned inside the arena's shared mapping, which lives on
    // (the caller's `Mr` holds the arena); `addr..addr + len` is the caller's to replace.
    // With an old size of 0 nothing is moved: the block's pages are mapped again at `addr`.
    let r = unsafe {
        rustix::mm::mremap_fixed(block.cast(), 0, len, MremapFlags::MAYMOVE, addr.cast())
    };
    match r {
        Ok(p) if p == addr.cast() => Ok(()),
        Ok(p) => {
            // MREMAP_FIXED never maps elsewhere; should a kernel do so, undo it.
            // SAFETY: `p..p + len` is the mapping this call just made, nobody knows it.
            let _ = unsafe { rustix::mm::munmap(p, len) };
            // SAFETY: as for `move_back`: the block still holds the bytes.
            unsafe { move_back(block, addr, len)? };
            Err(std::io::Error::other("mremap mapped the block elsewhere"))
        }
        Err(e) => {
            // The kernel may have unmapped `addr` already: private memory with the bytes.
            // SAFETY: the caller's contract, and the block holds the bytes (copied above).
            unsafe { move_back(block, addr, len)? };
            Err(e.into())
        }
    }
}

/// Makes `addr..addr + len` fresh private memory (anonymous, read/write) holding the bytes
/// of the arena block at `block`.
///
/// # Safety
/// `block..block + len` is a live block of the arena's mapping; `addr..addr + len` is
/// memory the caller's caller owns (a mapping of the block, or its own pages), used by
/// nothing else during the call and referenced by no Rust reference; both page-aligned.
pub(crate) unsafe fn move_back(block: *const u8, addr: *mut u8, len: usize) -> std::io::Result<()> {
    // SAFETY: replaces exactly the caller's range (MAP_FIXED) with new private pages; the
    // block's bytes are still reachable through the arena's own mapping.
    let p = unsafe {
        rustix::mm::mmap_anonymous(
            addr.cast(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE | MapFlags::FIXED,
        )
    }?;
    debug_assert_eq!(p, addr.cast());
    // SAFETY: `addr` is now `len` bytes of our own private memory, the block `len` bytes of
    // the arena; they are different mappings.
    unsafe { std::ptr::copy_nonoverlapping(block, addr, len) };
    Ok(())
}
