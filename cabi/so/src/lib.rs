//! `libibverbs.so.1` over shmhca, as Debian's verbs programs load it: the cdylib of
//! [`shmhca_verbs_core`] (`cabi/`), which holds all of its code — the exported functions,
//! their symbol versions and the objects behind them.
//!
//! This crate only makes the shared library, so that Cargo builds it with the release
//! profile's link-time optimization across shmhca's crates (the verbs entry points and the
//! engine they call compiled as one program, as an application linking shmhca's Rust API
//! is): `cargo build --release -p shmhca-verbs` writes `target/release/libibverbs.so` and
//! the link `libibverbs.so.1` to it that `shmhca exec` puts first on a program's library
//! path.

/// The library's code; linked in whole (its exported functions are its `#[export_name]`
/// items and the versioned trampolines of its `abi` module).
pub use shmhca_verbs_core;

unsafe extern "C" {
    /// A symbol of the object that holds every exported function's versioned trampoline
    /// (`shmhca_verbs_core::abi`, written by its build script).
    fn __shmhca_verbs_abi_anchor();
}

/// Refers to that object, so that the linker takes it: nothing calls the trampolines, and a
/// build without LTO (`cargo test`'s) links an rlib's objects only as they are needed.
#[used]
static ANCHOR: unsafe extern "C" fn() = __shmhca_verbs_abi_anchor;
