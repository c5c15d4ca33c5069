//! What every exported function shares: no panic unwinds into C, errno, and one-line notices.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;

/// Runs `f`; a panic (a bug) is reported on stderr and becomes `fail` (errno EIO) instead of
/// unwinding into the C caller.
pub(crate) fn guard<R>(name: &'static str, fail: R, f: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            eprintln!("shmhca: internal error in {name} (a panic, caught): please report it");
            set_errno(libc::EIO);
            fail
        }
    }
}

/// Sets the C `errno`.
pub(crate) fn set_errno(e: i32) {
    // SAFETY: `__errno_location` returns this thread's errno, always valid to write.
    unsafe { *libc::__errno_location() = e };
}

/// The C `errno`.
pub(crate) fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Sets `errno` to `e` and returns -1 (librdmacm's failure convention).
pub(crate) fn err(e: i32) -> libc::c_int {
    set_errno(e);
    -1
}

static SAID: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Prints `shmhca: <line>` on stderr once per process and line.
pub(crate) fn say_once(line: String) {
    let first = match SAID.lock() {
        Ok(mut said) if !said.contains(&line) => {
            said.push(line.clone());
            true
        }
        Ok(_) => false,
        Err(_) => true,
    };
    if first {
        eprintln!("shmhca: {line}");
    }
}
