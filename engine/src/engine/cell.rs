//! The engine token: whoever holds it runs the engine; nobody ever waits for it on the
//! packet path.
//!
//! The engine's state is owned by whichever thread holds the token: the poll-mode engine
//! thread for one iteration at a time, or, in inline mode, the application thread that is
//! polling. [`EngineCell::try_with`] takes the token only if it is free — an application
//! polling its CQ while the engine thread runs simply does not drive the engine that time.
//! Control operations (creating QPs, registering memory, modifying a QP) use
//! [`EngineCell::with`], which does wait, and asks the engine thread to step aside between
//! iterations.
//!
//! # Two ways in: the owner's fast path and the shared slow path
//!
//! Almost always one thread takes the token over and over (the engine thread in poll mode,
//! the polling application thread in inline mode). A compare-and-swap per entry would cost
//! it a locked instruction every poll and every post; instead the token is *biased* to
//! that thread (the classic asymmetric Dekker of biased locking, with the kernel's
//! `membarrier(2)` as the heavy side):
//!
//! * **Owner fast path.** The thread named in `bias` enters with a plain store of `busy =
//!   true`, a compiler fence and a load of `bias`: still itself, it holds the token; else it
//!   clears `busy` and takes the slow path. No locked instruction, no fence instruction.
//! * **Slow path.** Anyone else takes `lock` with a compare-and-swap (as before), then, if
//!   the token is biased to some thread, *revokes* the bias: stores `bias = 0`, runs
//!   `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` and then reads `busy`. The barrier makes
//!   every running thread of the process execute a full fence (a thread not running has
//!   been through the kernel's full barrier of a context switch), so it stands for the
//!   fence the owner left out: either the owner's `busy = true` is visible to the revoker
//!   after it, or the owner's later load of `bias` sees 0 and the owner backs off. A
//!   revoker that finds `busy` set does not enter (`try_with` returns `None`, `with`
//!   retries): the owner is inside and will leave. Every slow-path holder reads `busy`
//!   (Acquire) before it touches the value, so a revoked owner still inside is waited out
//!   by whoever comes next, and the owner's last release is ordered before them.
//! * **One flag per owner.** Each thread that may own the token has its own `busy` flag (an
//!   owner slot, given to one thread for the cell's life at its first install, and named
//!   in the low bits of `bias` beside the thread; a thread that finds every slot taken
//!   never becomes the owner). A shared flag would let an owner whose bias was revoked and
//!   handed to another thread, while it was still on its way through its fast path, clear
//!   the new owner's flag as it backs off — and the next slow path would then enter beside
//!   the new owner (`loom-tests/tests/token.rs`, `ownership_moves`, found it once the
//!   engine thread stepped back for busy-polling applications and the bias began to move).
//!   A slow-path holder reads the flag of the owner revoked last until it has seen it
//!   clear.
//! * **Who is the owner.** A thread that took the token on the slow path
//!   [`BIAS_AFTER`]-times in a row with nobody else trying meanwhile becomes the owner; it
//!   installs itself as it releases the slow path (`bias = me` before `lock = false`), and
//!   only a thread can install itself. A revocation doubles the streak the next owner needs
//!   (up to [`BIAS_AFTER_MAX`]), unless the revoked bias had served at least
//!   [`BIAS_PAID_OFF`] entries (then the cost of a barrier, a few microseconds, was paid
//!   back many times), which resets it: two threads taking turns settle on the slow path
//!   instead of trading barriers.
//! * **Without membarrier** (a kernel that refuses `MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED`,
//!   registered once per process at the first bias; or Miri) no bias is ever installed:
//!   every entry is the compare-and-swap, as before.
//!
//! * **Who is who.** A thread is named by its thread pointer (the address of its TCB, which
//!   the x86-64 and AArch64 TLS ABIs keep in `fs:0` and `TPIDR_EL0`): unique among live
//!   threads, read in one instruction. A thread-local would cost the library build (a
//!   `cdylib`, whose TLS is reached through `__tls_get_addr`) a call per entry: 4.5 % of
//!   a perftest receiver's samples, every poll and every post. A thread that ended may
//!   leave its pointer to a new thread, which then inherits its owner slot and its bias:
//!   the same name, and the ended thread is not inside. Elsewhere (other architectures,
//!   Miri, loom) a number from a thread-local names it.
//!
//! The hand-off costs: the owner's fast path, a load of `bias`, a load and two plain stores
//! of `busy`; a revocation, one `membarrier` system call (an inter-processor interrupt to
//! the CPUs running this process's threads) — on the control path, or the progress helper
//! taking over from an idle application.
//!
//! loom cannot model `membarrier`: under `--cfg shmhca_loom` both sides use a SeqCst
//! fence instead (the owner's compiler fence becomes one, and so does the barrier), which
//! has the same guarantee for this store–load pattern. `loom-tests/tests/token.rs` checks
//! the slow path, the bias hand-over and revocation that way, with mutations it catches.

#![allow(unsafe_code)]

use crate::sync::{AtomicBool, AtomicU32, AtomicU64, Ordering, weaken};
use std::cell::UnsafeCell;

/// Uncontended slow-path entries in a row after which a thread becomes the owner. Under
/// loom the engine's own models never bias the token (their model threads would spin on
/// stale reads of `busy` in `with` far past loom's branch bound); `tests/token.rs` models
/// the bias on [`LoomToken`], which biases after one entry.
pub(crate) const BIAS_AFTER: u32 = if cfg!(shmhca_loom) { u32::MAX } else { 16 };
/// The most such entries a thread needs, after repeated revocations.
pub(crate) const BIAS_AFTER_MAX: u32 = 1 << 16;
/// Fast-path entries after which a revoked bias counts as having paid off.
pub(crate) const BIAS_PAID_OFF: u64 = 1 << 12;

/// A value owned by whoever holds the token.
pub(crate) struct EngineCell<T> {
    /// The slow path's token (compare-and-swap).
    lock: AtomicBool,
    /// Per owner slot (the low bits of `bias`): set by the owner of that slot while it is inside on
    /// the fast path (plain stores, by that thread only: a slot is given to one thread for
    /// the cell's life, so an owner whose bias moved to another thread, still on its way
    /// through a stale fast path, can only ever set and clear its own flag, never the new
    /// owner's).
    busy: [AtomicBool; OWNER_SLOTS],
    /// The owner whose bias was revoked last and not yet seen outside (0: none): every
    /// slow-path holder reads its flag before it touches the value (written and read under
    /// `lock` only).
    revoked_owner: AtomicU64,
    /// The owner's name ([`thread_id`]) with its owner slot in the low bits
    /// ([`SLOT_MASK`]); 0: no owner.
    bias: AtomicU64,
    /// A hint for the policy: someone failed to take the token (plain stores only).
    contended: AtomicBool,
    /// A hint for the policy: a bias was revoked.
    revoked: AtomicBool,
    /// Control operations waiting for the token.
    waiting: AtomicU32,
    /// Who becomes the owner; touched only by the token's holder.
    policy: UnsafeCell<Policy>,
    value: UnsafeCell<T>,
}

/// The bias policy's state (private to the token's holder).
struct Policy {
    /// The thread of the last slow-path entry, and how many in a row it made.
    last: u64,
    streak: u32,
    /// The streak that makes an owner now, and after a bias that paid off.
    threshold: u32,
    initial: u32,
    /// Fast-path entries of the current (or last) bias.
    served: u64,
    /// The thread ([`thread_id`]) each owner slot belongs to (0: none yet), for the cell's
    /// life.
    slot_thread: [u64; OWNER_SLOTS],
}

/// Threads that can ever hold a cell's bias (others always take the slow path).
const OWNER_SLOTS: usize = 8;

/// The bits of `bias` (and of `revoked_owner`) that hold the owner's slot; a thread's name
/// ([`thread_id`]) has them clear.
const SLOT_MASK: u64 = OWNER_SLOTS as u64 - 1;

const _: () = assert!(OWNER_SLOTS.is_power_of_two() && OWNER_SLOTS <= 8);

/// The owner slot named in `bias` (an owner's bias word, not 0).
#[inline(always)]
fn slot_of(bias: u64) -> usize {
    (bias & SLOT_MASK) as usize
}

// SAFETY: the value and the policy are only reached through `try_with`/`with`, which hand
// them to one thread at a time (the token), and `T: Send` lets that thread be any thread.
unsafe impl<T: Send> Sync for EngineCell<T> {}

/// What the owner's fast path found.
enum Fast<'a> {
    /// The calling thread is the owner and entered: it holds the token until this drops.
    Entered(FastToken<'a>),
    /// The calling thread is the owner and inside already (no nesting): the token is
    /// held, by itself.
    Inside,
    /// The calling thread is not the owner, or its bias was revoked as it entered: the
    /// slow path decides.
    NotOwner,
}

/// The token as held, on either path: released when it drops (the guards are held for
/// their `Drop` only).
enum Token<'a> {
    Fast { _guard: FastToken<'a> },
    Slow { _guard: SlowToken<'a> },
}

/// Releases the owner's fast path when dropped, also on unwinding.
struct FastToken<'a>(&'a AtomicBool);

impl Drop for FastToken<'_> {
    // In line across crates in a build without LTO (a program's own profile may run none):
    // this is called per message.
    #[inline]
    fn drop(&mut self) {
        // SYNC: Release pairs with the Acquire load of `busy` of the next slow-path holder
        // (in `enter_slow`): everything the owner did to the value happens-before its use.
        self.0
            .store(false, weaken(Ordering::Release, "EngineCell busy release"));
    }
}

/// Releases the slow path when dropped, also on unwinding (installing the bias first if
/// the policy says so).
struct SlowToken<'a> {
    lock: &'a AtomicBool,
    bias: &'a AtomicU64,
    install: u64,
}

impl Drop for SlowToken<'_> {
    fn drop(&mut self) {
        if self.install != 0 {
            // Only the thread itself installs its bias, while it still holds the lock: its
            // own later fast-path entries are ordered after this by program order, and
            // anyone else revokes under the lock it is about to release.
            self.bias.store(self.install, Ordering::Relaxed);
        }
        // SYNC: Release pairs with the Acquire of the next successful `compare_exchange`
        // in `enter_slow`: everything done to the value happens-before the next holder's use.
        self.lock.store(false, Ordering::Release);
    }
}

impl<T> EngineCell<T> {
    pub(crate) fn new(value: T) -> EngineCell<T> {
        EngineCell::biased_after(value, BIAS_AFTER)
    }

    /// A cell whose owner is the thread that took it `bias_after` times in a row first.
    fn biased_after(value: T, bias_after: u32) -> EngineCell<T> {
        EngineCell {
            lock: AtomicBool::new(false),
            busy: std::array::from_fn(|_| AtomicBool::new(false)),
            revoked_owner: AtomicU64::new(0),
            bias: AtomicU64::new(0),
            contended: AtomicBool::new(false),
            revoked: AtomicBool::new(false),
            waiting: AtomicU32::new(0),
            policy: UnsafeCell::new(Policy {
                last: 0,
                streak: 0,
                threshold: bias_after,
                initial: bias_after,
                served: 0,
                slot_thread: [0; OWNER_SLOTS],
            }),
            value: UnsafeCell::new(value),
        }
    }

    /// Whether some thread owns the token's bias: taking the token from another thread
    /// then revokes it (a `membarrier`); with no owner, the slow path is a compare and swap.
    pub(crate) fn biased(&self) -> bool {
        self.bias.load(Ordering::Relaxed) != 0
    }

    /// Runs `f` on the value if the token is free; `None` if someone else holds it (or the
    /// calling thread holds it already: no nesting).
    #[inline]
    pub(crate) fn try_with<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        self.try_with_if(|| true, f)
    }

    /// [`EngineCell::try_with`] of `quick` then, if it returned `None`, `full` (under the
    /// same token), for a call whose common case is quick: on the owner's fast path, when
    /// `quick` answers, nothing else runs and nothing is called — the rest (the slow path,
    /// `full`) is out of line, so the quick case saves and restores no registers for it.
    #[inline(always)]
    pub(crate) fn try_with_quick<R>(
        &self,
        quick: impl FnOnce(&mut T) -> Option<R>,
        full: impl FnOnce(&mut T) -> R,
    ) -> Option<R> {
        let token = match self.enter_fast() {
            Fast::Entered(token) => token,
            Fast::Inside => return None,
            Fast::NotOwner => return self.try_with_quick_slow(quick, full),
        };
        // SYNC: the fast token (see `enter_fast`) gives this thread exclusive use of the
        // value until `token` drops.
        // SAFETY: this thread holds the fast token: it set `busy` and then read `bias` as
        // its own after the light barrier (see `try_with_if`), so no other `&mut T` exists,
        // and none will until `token` drops.
        let value = unsafe { &mut *self.value.get() };
        match quick(value) {
            Some(r) => {
                drop(token);
                Some(r)
            }
            None => Some(Self::finish_quick(token, value, full)),
        }
    }

    /// The rest of [`EngineCell::try_with_quick`] on the fast path: `full`, then the token
    /// released. Returns `full`'s value, not an `Option` (the caller wraps it): where the
    /// quick case is compiled into a completion queue's poll, an `Option` returned from
    /// here cost two moves per call.
    #[inline(never)]
    fn finish_quick<R>(token: FastToken<'_>, value: &mut T, full: impl FnOnce(&mut T) -> R) -> R {
        let r = full(value);
        drop(token);
        r
    }

    /// [`EngineCell::try_with_quick`] when the calling thread is not the owner.
    #[inline(never)]
    fn try_with_quick_slow<R>(
        &self,
        quick: impl FnOnce(&mut T) -> Option<R>,
        full: impl FnOnce(&mut T) -> R,
    ) -> Option<R> {
        self.try_with(|v| match quick(v) {
            Some(r) => r,
            None => full(v),
        })
    }

    /// [`EngineCell::try_with`] if `slow()`; else runs `f` only if the calling thread owns
    /// the token (the owner's fast path), `None` otherwise — never taking the lock, so
    /// never revoking another thread's bias (a `membarrier`): for callers with another way
    /// to hand over their work. `slow` is asked only when the caller is not the owner (the
    /// owner's post pays nothing for it).
    #[inline(always)]
    pub(crate) fn try_with_if<R>(
        &self,
        slow: impl FnOnce() -> bool,
        f: impl FnOnce(&mut T) -> R,
    ) -> Option<R> {
        // One call of `f` on either path (the token, fast or slow, is held until `_token`
        // drops at the end), so that `f` is inlined here.
        let _token = match self.enter_fast() {
            Fast::Entered(token) => Token::Fast { _guard: token },
            Fast::Inside => return None,
            Fast::NotOwner if !slow() => return None,
            Fast::NotOwner => {
                let install = self.enter_slow(thread_id())?;
                Token::Slow {
                    _guard: SlowToken {
                        lock: &self.lock,
                        bias: &self.bias,
                        install,
                    },
                }
            }
        };
        // SYNC: the fast token (see `enter_fast`) or the slow token (see `enter_slow`) gives
        // this thread exclusive use of the value until `_token` drops.
        // SAFETY: this thread holds the token: on the fast path it set `busy` and then read
        // `bias` as its own after the light barrier; on the slow path `enter_slow` took
        // `lock` and saw `busy` clear after revoking any bias. So no other `&mut T` exists,
        // and none will until `_token` drops.
        let value = unsafe { &mut *self.value.get() };
        Some(f(value))
    }

    /// The owner's fast path (see [`Fast`]).
    #[inline(always)]
    fn enter_fast(&self) -> Fast<'_> {
        let me = thread_id();
        let bias = self.bias.load(Ordering::Relaxed);
        // The bias is this thread's name with a slot in the low bits exactly when the two
        // differ in those bits only, which then give the slot. (0, no owner, never
        // matches: a name is never below the slot bits.)
        let slot = bias ^ me;
        if slot > SLOT_MASK {
            return Fast::NotOwner;
        }
        // Only this thread stores into its slot's flag: set means it is inside already.
        let busy = &self.busy[slot as usize];
        if busy.load(Ordering::Relaxed) {
            return Fast::Inside;
        }
        busy.store(true, Ordering::Relaxed);
        light_barrier();
        if self.bias.load(Ordering::Relaxed) == bias {
            let token = FastToken(busy);
            // SYNC: `busy` set, then `bias` read as ours after the light barrier: every
            // revoker's `membarrier` comes after that load (and then sees `busy`), or
            // before it (and then we would have read 0) — the asymmetric Dekker of the
            // module docs. Slow-path holders read `busy` before touching the value.
            // SAFETY: no other `&mut Policy` exists (see the SYNC above: the policy is
            // touched by the token's holder only) and none will until `token` drops.
            let policy = unsafe { &mut *self.policy.get() };
            policy.served += 1;
            return Fast::Entered(token);
        }
        busy.store(false, Ordering::Release);
        Fast::NotOwner
    }

    /// The slow path: takes the lock, revokes the bias, waits out nobody. `Some(install)`
    /// when this thread now holds the token (`install`: its bias word, its name and slot,
    /// if it becomes the owner as it leaves, else 0); `None` if the token is held.
    #[cold]
    #[inline(never)]
    fn enter_slow(&self, me: u64) -> Option<u64> {
        // SYNC: Acquire pairs with the Release store in `SlowToken::drop`.
        if self
            .lock
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.contended.store(true, Ordering::Relaxed);
            return None;
        }
        let owner = self.bias.load(Ordering::Relaxed);
        if owner != 0 {
            self.bias.store(0, Ordering::Relaxed);
            self.revoked.store(true, Ordering::Relaxed);
            self.revoked_owner.store(owner, Ordering::Relaxed);
            heavy_barrier();
        }
        // The owner revoked now, or earlier and not yet seen outside, may be inside.
        let revoked = self.revoked_owner.load(Ordering::Relaxed);
        if revoked != 0 {
            // SYNC: Acquire pairs with the Release store in `FastToken::drop`: the owner's
            // last run happens-before ours. Read after the barrier (if the bias was revoked
            // now) or after the revoker's barrier (ordered before us by `lock`).
            if self.busy[slot_of(revoked)]
                .load(weaken(Ordering::Acquire, "EngineCell busy acquire"))
            {
                self.contended.store(true, Ordering::Relaxed);
                // SYNC: Release as in `SlowToken::drop` (nothing was touched).
                self.lock.store(false, Ordering::Release);
                return None;
            }
            // Seen outside: it can no longer enter (its bias is gone; a stale fast path
            // only sets and clears its own flag), so later holders need not look.
            self.revoked_owner.store(0, Ordering::Relaxed);
        }
        // SAFETY: this thread holds the token (lock taken, no owner inside, none can enter
        // with `bias` 0), and the policy is touched only by the token's holder.
        let policy = unsafe { &mut *self.policy.get() };
        if self.revoked.load(Ordering::Relaxed) {
            self.revoked.store(false, Ordering::Relaxed);
            policy.threshold = if policy.served >= BIAS_PAID_OFF {
                policy.initial
            } else {
                policy.threshold.saturating_mul(2).min(BIAS_AFTER_MAX)
            };
            policy.streak = 0;
        }
        if self.contended.load(Ordering::Relaxed) {
            self.contended.store(false, Ordering::Relaxed);
            policy.streak = 0;
        }
        if policy.last == me {
            policy.streak = policy.streak.saturating_add(1);
        } else {
            policy.last = me;
            policy.streak = 1;
        }
        if policy.streak >= policy.threshold && barrier_available() {
            // Its own slot, or the first free one.
            let slots = &mut policy.slot_thread;
            let slot = slots
                .iter()
                .position(|&t| t == me)
                .or_else(|| slots.iter().position(|&t| t == 0));
            if let Some(i) = slot {
                slots[i] = me;
                policy.streak = 0;
                policy.served = 0;
                return Some(me | i as u64);
            }
        }
        Some(0)
    }

    /// Runs `f` on the value, waiting for the token (control path only).
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        struct Waiting<'a>(&'a AtomicU32);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(&self.waiting);
        let mut f = Some(f);
        let mut spins = 0u32;
        loop {
            if let Some(r) = self.try_with(|v| (f.take().expect("called once"))(v)) {
                break r;
            }
            spins += 1;
            if spins < 64 {
                crate::sync::spin_loop();
            } else {
                crate::sync::yield_now();
            }
        }
    }

    /// Whether a control operation is waiting (the engine thread should step aside).
    #[inline]
    pub(crate) fn control_waiting(&self) -> bool {
        self.waiting.load(Ordering::Relaxed) != 0
    }

    /// Whether the calling thread is the owner (enters on the fast path).
    #[cfg(any(test, shmhca_loom))]
    pub(crate) fn is_owner(&self) -> bool {
        let bias = self.bias.load(Ordering::Relaxed);
        bias != 0 && bias & !SLOT_MASK == thread_id()
    }
}

/// This thread's name: unique among the process's live threads, never 0, its
/// [`SLOT_MASK`] bits clear. Its thread pointer where one instruction reads it (see the
/// module docs), else its number from a thread-local shifted past the slot bits.
#[inline(always)]
fn thread_id() -> u64 {
    #[cfg(all(
        not(shmhca_loom),
        not(miri),
        target_os = "linux",
        any(target_arch = "x86_64", target_arch = "aarch64")
    ))]
    {
        let tp = thread_pointer();
        // The TCB is aligned to more than 8 bytes (glibc: 64; the TLS block's alignment),
        // so its slot bits are clear (`names_are_distinct_among_live_threads_and_stable`).
        debug_assert!(tp != 0 && tp & SLOT_MASK == 0, "thread pointer {tp:#x}");
        tp
    }
    #[cfg(not(all(
        not(shmhca_loom),
        not(miri),
        target_os = "linux",
        any(target_arch = "x86_64", target_arch = "aarch64")
    )))]
    {
        thread_number() << OWNER_SLOTS.trailing_zeros()
    }
}

/// The thread pointer: the address of the thread's TCB, which the TLS ABI keeps in `fs:0`
/// (x86-64: the TCB's first word points to itself) or `TPIDR_EL0` (AArch64).
#[cfg(all(
    not(shmhca_loom),
    not(miri),
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64")
))]
#[inline(always)]
fn thread_pointer() -> u64 {
    let tp: u64;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: reads the word at `fs:0`, which the x86-64 TLS ABI keeps mapped and holding
    // the thread pointer for every thread's life; no other effect.
    unsafe {
        std::arch::asm!(
            "mov {}, qword ptr fs:[0]",
            out(reg) tp,
            options(nostack, readonly, preserves_flags, pure)
        );
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: reads a system register every thread may read; no other effect.
    unsafe {
        std::arch::asm!(
            "mrs {}, tpidr_el0",
            out(reg) tp,
            options(nostack, nomem, preserves_flags, pure)
        );
    }
    tp
}

/// This thread's number: unique in the process, never 0, never reused, kept in a
/// thread-local from the thread's first call on.
#[cfg(not(all(
    not(shmhca_loom),
    not(miri),
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64")
)))]
#[inline]
fn thread_number() -> u64 {
    #[cfg(not(shmhca_loom))]
    std::thread_local! {
        static NUMBER: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }
    #[cfg(shmhca_loom)]
    loom::thread_local! {
        static NUMBER: std::cell::Cell<u64> = std::cell::Cell::new(0);
    }
    NUMBER.with(|n| {
        let v = n.get();
        if v != 0 {
            return v;
        }
        // Once per thread. (A std atomic also under loom: the numbers need no model.)
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let me = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        n.set(me);
        me
    })
}

/// The owner's side of the asymmetric fence: a compiler fence (the `membarrier` of a
/// revoker supplies the processor's), a SeqCst fence under loom.
#[inline(always)]
fn light_barrier() {
    #[cfg(not(shmhca_loom))]
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
    // Mutation "EngineCell owner fence": the owner leaves out its side of the fence.
    #[cfg(shmhca_loom)]
    if weaken(Ordering::SeqCst, "EngineCell owner fence") == Ordering::SeqCst {
        loom::sync::atomic::fence(Ordering::SeqCst);
    }
}

/// The revoker's side: `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` (a SeqCst fence
/// under loom). Also the engine's, when it stops watching send queues (only ever after
/// [`barrier_available`] said yes).
pub(crate) fn heavy_barrier() {
    #[cfg(shmhca_loom)]
    loom::sync::atomic::fence(Ordering::SeqCst);
    #[cfg(not(shmhca_loom))]
    {
        use rustix::thread::{MembarrierCommand, membarrier};
        // Only reached after the registration succeeded; then the kernel does not fail the
        // command (membarrier(2): EPERM only when unregistered). A child forked from a
        // registered process is not registered although it inherited the flag that says
        // so: register again and retry once. If it still failed, going on would be
        // unsound: stop rather than risk the engine state.
        let barrier = || membarrier(MembarrierCommand::PrivateExpedited);
        if let Err(e) = barrier().or_else(|_| {
            membarrier(MembarrierCommand::RegisterPrivateExpedited).and_then(|()| barrier())
        }) {
            eprintln!(
                "shmhca: membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) failed after its \
                 registration succeeded ({e}); cannot revoke the engine token's owner safely"
            );
            std::process::abort();
        }
    }
}

/// Whether this process can use the owner fast path: registers it for
/// `MEMBARRIER_CMD_PRIVATE_EXPEDITED` once (false under Miri, or if the kernel refuses).
// In line across crates in a build without LTO (a program's own profile may run none):
// this is called per message.
#[inline]
pub(crate) fn barrier_available() -> bool {
    #[cfg(shmhca_loom)]
    return true;
    #[cfg(all(not(shmhca_loom), miri))]
    return false;
    #[cfg(all(not(shmhca_loom), not(miri)))]
    {
        static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *REGISTERED.get_or_init(|| {
            use rustix::thread::{MembarrierCommand, membarrier};
            membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok()
                && membarrier(MembarrierCommand::PrivateExpedited).is_ok()
        })
    }
}
/// The engine token over a counter in a loom cell, for the loom models of
/// `loom-tests/tests/token.rs` (reached through `shmhca::testing`): every access to the
/// counter is announced to loom, so two holders overlapping is a causality violation.
#[cfg(shmhca_loom)]
pub struct LoomToken(EngineCell<loom::cell::UnsafeCell<u64>>);

#[cfg(shmhca_loom)]
impl Default for LoomToken {
    fn default() -> LoomToken {
        LoomToken(EngineCell::biased_after(loom::cell::UnsafeCell::new(0), 1))
    }
}

#[cfg(shmhca_loom)]
impl LoomToken {
    /// Adds `n` to the counter if the token is free (`EngineCell::try_with`); whether it was.
    pub fn try_add(&self, n: u64) -> bool {
        self.0
            .try_with(|c| c.with_mut(|p| unsafe_add(p, n)))
            .is_some()
    }

    /// Adds `n`, waiting for the token (`EngineCell::with`).
    pub fn add(&self, n: u64) {
        self.0.with(|c| c.with_mut(|p| unsafe_add(p, n)));
    }

    /// The counter (waiting for the token).
    pub fn get(&self) -> u64 {
        // SAFETY: the loom cell hands out the pointer for this read only, under the token.
        self.0.with(|c| c.with(|p| unsafe { *p }))
    }

    /// Whether the calling model thread is the token's owner (enters on the fast path).
    pub fn is_owner(&self) -> bool {
        self.0.is_owner()
    }
}

#[cfg(shmhca_loom)]
fn unsafe_add(p: *mut u64, n: u64) {
    // SAFETY: the loom cell hands out the pointer for this access only, under the token
    // (loom reports it if two holders overlap).
    unsafe { *p += n }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn try_with_refuses_while_held_and_with_waits() {
        let cell = Arc::new(EngineCell::new(0u64));
        cell.try_with(|v| {
            assert!(cell.try_with(|_| ()).is_none(), "the token is held");
            *v += 1;
        })
        .unwrap();
        // Non-atomic read-modify-writes under the token: the count comes out exact only if
        // no two holders ever overlapped.
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let c = cell.clone();
                std::thread::spawn(move || {
                    let mut got = 0u64;
                    for _ in 0..10_000 {
                        c.with(|v| *v += 1);
                        if c.try_with(|v| *v += 1).is_some() {
                            got += 1;
                        }
                    }
                    got
                })
            })
            .collect();
        let tried: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        let total = cell.with(|v| *v);
        assert_eq!(total, 1 + 40_000 + tried);
        assert!(!cell.control_waiting());
    }

    /// Takes the token on the slow path until this thread is the owner.
    fn become_owner(cell: &EngineCell<u64>) {
        for _ in 0..BIAS_AFTER_MAX {
            if cell.is_owner() {
                return;
            }
            cell.try_with(|v| *v += 1).unwrap();
        }
        panic!("no bias after {BIAS_AFTER_MAX} uncontended entries");
    }

    #[test]
    fn a_thread_taking_the_token_alone_becomes_its_owner() {
        if !barrier_available() {
            eprintln!("membarrier unavailable: the token stays on its slow path");
            return;
        }
        let cell = EngineCell::new(0u64);
        for _ in 1..BIAS_AFTER {
            cell.try_with(|v| *v += 1).unwrap();
            assert!(!cell.is_owner(), "biased before {BIAS_AFTER} entries");
        }
        cell.try_with(|v| *v += 1).unwrap();
        assert!(cell.is_owner());
        // The owner's entries go the fast path and leave `lock` alone.
        cell.try_with(|_| ()).unwrap();
        assert!(
            !cell.lock.load(Ordering::Relaxed)
                && cell.busy.iter().all(|b| !b.load(Ordering::Relaxed))
        );
        // No nesting on the fast path either; the nested try is refused by the fast path
        // itself, without a revocation of the owner's own bias.
        cell.try_with(|_| assert!(cell.try_with(|_| ()).is_none()))
            .unwrap();
        assert!(cell.is_owner(), "a nested try revoked the owner's bias");
        assert!(!cell.revoked.load(Ordering::Relaxed));
        assert_eq!(cell.with(|v| *v), u64::from(BIAS_AFTER));
        // SAFETY: the token is not held (the test's only thread is outside it).
        let served = unsafe { (*cell.policy.get()).served };
        assert_eq!(served, 3, "three entries on the fast path");
    }

    #[test]
    fn another_thread_revokes_the_bias_and_waits_out_an_owner_inside() {
        if !barrier_available() {
            return;
        }
        let cell = Arc::new(EngineCell::new(0u64));
        become_owner(&cell);
        // The owner is outside: another thread gets the token at once, revoking the bias.
        let c = cell.clone();
        std::thread::spawn(move || assert_eq!(c.try_with(|v| *v), Some(u64::from(BIAS_AFTER))))
            .join()
            .unwrap();
        assert!(!cell.is_owner());
        // SAFETY: the token is not held (the other thread was joined).
        let threshold = unsafe { (*cell.policy.get()).threshold };
        assert_eq!(threshold, 2 * BIAS_AFTER);
        // The owner inside: another thread's `try_with` is refused and its `with` waits.
        become_owner(&cell);
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (leave_tx, leave_rx) = std::sync::mpsc::channel::<()>();
        let c = cell.clone();
        let owner = cell.clone();
        let inside = std::thread::spawn(move || {
            // This thread is not the owner: make it one, then hold the token.
            become_owner(&owner);
            owner
                .try_with(|v| {
                    entered_tx.send(()).unwrap();
                    leave_rx.recv().unwrap();
                    *v += 1000;
                })
                .unwrap();
        });
        entered_rx.recv().unwrap();
        assert!(c.try_with(|_| ()).is_none(), "the owner is inside");
        let waiter = std::thread::spawn(move || c.with(|v| *v));
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!waiter.is_finished(), "`with` waits for the owner to leave");
        leave_tx.send(()).unwrap();
        inside.join().unwrap();
        let seen = waiter.join().unwrap();
        assert!(
            seen >= 1000,
            "the owner's run happens-before the next holder's: {seen}"
        );
    }

    #[test]
    fn an_owner_and_contenders_never_overlap() {
        // One thread polls with `try_with` (it becomes the owner, is revoked, re-biased)
        // while others take the token with `with`, as control operations do; non-atomic
        // read-modify-writes come out exact only if no two holders ever overlapped.
        let cell = Arc::new(EngineCell::new(0u64));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (c, s) = (cell.clone(), stop.clone());
        let poller = std::thread::spawn(move || {
            let mut got = 0u64;
            while !s.load(Ordering::Relaxed) {
                if c.try_with(|v| *v += 1).is_some() {
                    got += 1;
                }
            }
            got
        });
        let controls: Vec<_> = (0..2)
            .map(|_| {
                let c = cell.clone();
                std::thread::spawn(move || {
                    for _ in 0..300 {
                        c.with(|v| *v += 1);
                        std::thread::yield_now();
                    }
                })
            })
            .collect();
        for t in controls {
            t.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        let polled = poller.join().unwrap();
        assert_eq!(cell.with(|v| *v), polled + 600);
    }

    #[test]
    fn names_are_distinct_among_live_threads_and_stable() {
        let me = thread_id();
        assert_ne!(me, 0);
        assert_eq!(me & SLOT_MASK, 0, "a name leaves the slot bits clear");
        assert_eq!(thread_id(), me, "the same on every call");
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let done_rx = Arc::new(std::sync::Mutex::new(done_rx));
        // Alive at once: no two share a name.
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (tx, done) = (tx.clone(), done_rx.clone());
                std::thread::spawn(move || {
                    tx.send(thread_id()).unwrap();
                    let _ = done.lock().unwrap().recv();
                })
            })
            .collect();
        let mut names: Vec<u64> = (0..4).map(|_| rx.recv().unwrap()).collect();
        names.push(me);
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), 5, "{names:x?}");
        assert!(names.iter().all(|n| n & SLOT_MASK == 0));
        drop(done_tx);
        for t in threads {
            t.join().unwrap();
        }
    }

    /// Every thread that becomes an owner gets a slot of its own while there are free ones
    /// (slots are not tied to a remainder of the thread's name, which two threads can share).
    #[test]
    fn owner_slots_go_to_the_threads_that_become_owners() {
        if !barrier_available() {
            return;
        }
        let cell = Arc::new(EngineCell::new(0u64));
        // All alive until the end (a thread that ended may pass its name, and with it its
        // slot, to the next one), each becoming the owner in turn.
        let all_done = Arc::new(std::sync::Barrier::new(OWNER_SLOTS + 1));
        let mut threads = Vec::new();
        let mut slots = Vec::new();
        for _ in 0..OWNER_SLOTS {
            let (c, done) = (cell.clone(), all_done.clone());
            let (tx, rx) = std::sync::mpsc::channel();
            threads.push(std::thread::spawn(move || {
                become_owner(&c);
                tx.send(c.bias.load(Ordering::Relaxed)).unwrap();
                done.wait();
            }));
            slots.push(slot_of(rx.recv().unwrap()));
        }
        all_done.wait();
        for t in threads {
            t.join().unwrap();
        }
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(slots.len(), OWNER_SLOTS, "one slot each: {slots:?}");
        // The count comes out exact: no two holders ever overlapped.
        let entries = cell.with(|v| *v);
        assert!(entries >= u64::from(BIAS_AFTER) * OWNER_SLOTS as u64);
    }

    #[test]
    fn the_token_is_released_when_f_panics() {
        let cell = EngineCell::new(1);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            cell.with(|_| panic!("boom"));
        }));
        assert!(r.is_err());
        assert_eq!(cell.try_with(|v| *v), Some(1));
    }
}
