//! The C types of `<infiniband/verbs.h>` (Debian 12, rdma-core 44), generated once by
//! `scripts/bindgen.sh`; their layout tests run in `cargo test`, and `tests/c_layout.rs`
//! checks the fields verbs.h's static inline functions reach against the system's compiler.
#![allow(missing_docs, unreachable_pub)]

mod verbs;
pub use verbs::*;

/// `__VERBS_ABI_IS_EXTENDED`: `ibv_context.abi_compat` of a context with a `verbs_context`.
pub const VERBS_ABI_IS_EXTENDED: *mut core::ffi::c_void = usize::MAX as *mut core::ffi::c_void;
