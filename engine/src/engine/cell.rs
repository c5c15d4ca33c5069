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

#![allow(unsafe_code)]

use crate::sync::{AtomicBool, AtomicU32, Ordering};
use std::cell::UnsafeCell;

/// A value owned by whoever holds the token.
pub(crate) struct EngineCell<T> {
    busy: AtomicBool,
    /// Control operations waiting for the token.
    waiting: AtomicU32,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached through `try_with`/`with`, which hand out `&mut T` to
// one thread at a time (the token), and `T: Send` lets that thread be any thread.
unsafe impl<T: Send> Sync for EngineCell<T> {}

/// Releases the token when dropped, also on unwinding.
struct Token<'a>(&'a AtomicBool);

impl Drop for Token<'_> {
    fn drop(&mut self) {
        // SYNC: Release pairs with the Acquire of the next successful `compare_exchange`
        // in `try_with`: everything done to the value happens-before the next holder's use.
        self.0.store(false, Ordering::Release);
    }
}

impl<T> EngineCell<T> {
    pub(crate) fn new(value: T) -> EngineCell<T> {
        EngineCell {
            busy: AtomicBool::new(false),
            waiting: AtomicU32::new(0),
            value: UnsafeCell::new(value),
        }
    }

    /// Runs `f` on the value if the token is free; `None` if someone else holds it.
    #[inline]
    pub(crate) fn try_with<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        // SYNC: Acquire pairs with the Release store in `Token::drop`.
        self.busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        let _token = Token(&self.busy);
        // SYNC: the token gives this thread exclusive use of the value until `_token` drops.
        // SAFETY: `busy` went from false to true here, so no other `&mut T` exists (every
        // path to the value takes the token first), and none will until the token drops.
        let value = unsafe { &mut *self.value.get() };
        Some(f(value))
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
