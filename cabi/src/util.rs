//! What every exported function shares: no panic unwinds into C (each body runs under
//! [`guard`]), errors become the errno verbs specifies, and what is not supported says so on
//! stderr once.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;

/// Runs `f`; a panic (a bug) is reported on stderr and becomes `fail` instead of unwinding
/// into the C caller.
#[inline(always)]
pub fn guard<R>(name: &'static str, fail: R, f: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            caught(name);
            fail
        }
    }
}

/// [`guard`]'s report of a caught panic.
#[cold]
#[inline(never)]
fn caught(name: &str) {
    eprintln!("shmhca: internal error in {name} (a panic, caught): please report it");
    set_errno(libc::EIO);
}

/// Sets the C `errno`.
pub fn set_errno(e: i32) {
    // SAFETY: `__errno_location` returns this thread's errno, always valid to write.
    unsafe { *libc::__errno_location() = e };
}

/// The errno verbs uses for a failure of the Rust API.
pub fn errno_of(e: &shmhca::Error) -> i32 {
    use shmhca::Error as E;
    match e {
        E::QueueFull { .. } => libc::ENOMEM,
        E::InvalidState { .. } | E::InvalidTransition { .. } | E::MissingAttribute { .. } => {
            libc::EINVAL
        }
        E::InvalidArgument { .. } | E::OutOfBounds { .. } | E::ForeignObject { .. } => libc::EINVAL,
        E::MrBusy { .. } | E::SrqInUse { .. } | E::MrHasWindows { .. } => libc::EBUSY,
        E::MrRemoteWritable { .. } => libc::EACCES,
        E::ArenaExhausted { .. } | E::LimitReached { .. } => libc::ENOMEM,
        E::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        _ => libc::EIO,
    }
}

/// Reports a failed verb's reason on stderr when `SHMHCA_VERBS_DEBUG` is set (programs
/// print only `strerror(errno)`, which rarely says enough), and returns its errno.
pub fn fail(verb: &str, e: &shmhca::Error) -> i32 {
    if std::env::var_os("SHMHCA_VERBS_DEBUG").is_some() {
        eprintln!("shmhca: {verb}: {e}");
    }
    errno_of(e)
}

static SAID: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

/// Prints `shmhca: <what> is not supported by shmhca (<why>)` on stderr, once per process
/// and `what`, and returns `errno` (also set in `errno`).
pub fn unsupported(what: &'static str, why: &str, errno: i32) -> i32 {
    let first = match SAID.lock() {
        Ok(mut said) if !said.contains(&what) => {
            said.push(what);
            true
        }
        Ok(_) => false,
        Err(_) => true,
    };
    if first {
        eprintln!("shmhca: {what} is not supported by shmhca ({why})");
    }
    set_errno(errno);
    errno
}

/// The containing object of a C struct embedded at offset `off` of it.
///
/// # Safety
/// `p` must point at the embedded struct of a live `T` at offset `off`.
#[inline(always)]
pub unsafe fn container<C, T>(p: *mut C, off: usize) -> *mut T {
    // SAFETY: the caller's promise: `p` is `off` bytes into a `T`.
    unsafe { p.cast::<u8>().sub(off).cast::<T>() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic inside `guard` becomes its failure value and `EIO` in errno, never an
    /// unwind into the caller; without one, the body's value comes back.
    #[test]
    fn guard_turns_a_panic_into_the_failure_value_and_eio() {
        assert_eq!(guard("test", -1, || 7), 7);
        set_errno(0);
        assert_eq!(guard("test", -1, || -> i32 { panic!("a bug") }), -1);
        // SAFETY: this thread's errno.
        assert_eq!(unsafe { *libc::__errno_location() }, libc::EIO);
    }
}
