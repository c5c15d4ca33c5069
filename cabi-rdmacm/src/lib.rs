//! `librdmacm.so.1` over shmhca: unmodified RDMA CM programs (Debian's `rping`, perftest's
//! `-R`) connect RC QPs between processes of one machine, started with
//! `shmhca exec -- PROGRAM ARGS…`, which puts this library (and shmhca's `libibverbs.so.1`)
//! first on their library path.
//!
//! Like rdma-core's librdmacm, it is built on the public verbs API only ([`ffi`]: it links
//! `libibverbs.so.1` and calls `ibv_get_device_list`, `ibv_open_device`, `ibv_query_port`,
//! `ibv_create_qp`, `ibv_modify_qp`…; at run time shmhca's, see the `shmhca-verbs` crate).
//! What the kernel's CM does with InfiniBand CM messages is done here over a Unix socket per
//! listening port in the per-user fabric directory ([`wire`]): a connect sends the client's
//! LID, GID, QPN, PSN, RDMA read resources and private data; the accept answers with the
//! server's, and each side moves its QP INIT → RTR → RTS with the peer's LID (or GID), QPN
//! and PSN, exactly as a verbs program connecting by hand does ([`dev`]).
//!
//! Addresses must be this machine's (127.0.0.0/8, ::1, this host's interfaces'): shmhca
//! connects processes of one machine, so any other address is refused with EADDRNOTAVAIL
//! and one line saying so ([`addr`]). The port space is RDMA_PS_TCP (RC QPs); the rest of
//! rdma-core's ABI (rsockets, UD, multicast, `rdma_create_ep`…) sets ENOSYS ([`stubs`]).
//!
//! Symbols carry rdma-core's versions (`RDMACM_1.0` … `RDMACM_1.3`, `symbols.txt`, made
//! by `build.rs`); the SONAME is `librdmacm.so.1`, with a link of that name next to the
//! cdylib in `target/<profile>/`.
//!
//! # Safety contract
//!
//! Every exported function takes the pointers `rdma_cma.h` documents for it: objects this
//! library made and has not destroyed, or null (checked: EINVAL). No panic crosses into C.
#![allow(clippy::missing_safety_doc)] // the contract above is every function's
#![allow(clippy::multiple_unsafe_ops_per_block)] // FFI: each block's SAFETY covers its pointer

pub mod abi;
pub mod addr;
pub mod cm;
pub mod dev;
pub mod ffi;
pub mod stubs;
mod util;
pub mod wire;
