//! shmhca: a software InfiniBand Host Channel Adapter — the Reliable Connected transport
//! between processes on one machine.
//!
//! Each process runs an *engine* (its HCA) that exchanges real IBA transport packets with
//! peer engines over lock-free rings in shared memory. Applications use a verbs-style API:
//! a [`Context`], protection domains ([`Pd`]), memory regions ([`Mr`]) carved from a shared
//! arena, completion queues ([`Cq`]) and reliable-connected queue pairs ([`Qp`]) with Send,
//! Send with Immediate, RDMA Write (with Immediate), RDMA Read and the two Atomics.
//!
//! The protocol follows the IBA RC chapters: [`qp`] (the QP state machine), [`requester`]
//! (SQ Logic), [`responder`] (RQ Logic), [`completer`], [`credit`] (end-to-end credits),
//! [`timer`], over the header formats of [`wire`] and the PSN arithmetic of [`psn`]. The
//! protocol stages are sans-IO: the engine passes packets, work requests and the time in.
#![deny(unsafe_code)]
#![warn(clippy::undocumented_unsafe_blocks)]
// Under loom there is no engine thread and no sleeping: its helpers go unused.
#![cfg_attr(shmhca_loom, allow(dead_code))]

pub(crate) mod arena;
pub mod cm;
pub mod completer;
pub mod completion;
pub(crate) mod context;
pub mod credit;
pub(crate) mod dma;
pub(crate) mod engine;
mod error;
pub mod fault;
#[cfg(test)]
mod hostile_tests;
pub mod limits;
pub mod link;
pub(crate) mod mem;
pub(crate) mod mr_table;
pub(crate) mod mw_table;
pub mod psn;
pub mod qp;
#[cfg(test)]
mod raw_peer;
pub mod requester;
pub mod responder;
pub(crate) mod send_window;
pub(crate) mod slots;
pub(crate) mod srq_table;
pub mod stats_area;
pub(crate) mod sync;
#[doc(hidden)]
pub mod testing;
pub mod timer;
pub mod trace;
pub(crate) mod user_mem;
pub mod verbs;
pub mod wire;
pub(crate) mod wqe;

pub use cm::{ConnectParams, Connection, Listener, PeerPolicy};
pub use context::Stats;
pub use error::{Error, Refused, Result};
pub use limits::{AtomicCap, DeviceAttr};
pub use link::LinkId;
pub use qp::{AccessFlags, Destination, Mtu, QpAttr, QpCaps, QpConfig, QpState};
pub use verbs::wr::{
    Data, MwBind, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};
pub use verbs::{
    CompChannel, Context, ContextBuilder, Cq, EngineMode, IdlePolicy, Mr, Mw, MwType, Pd, Progress,
    Qp, QpInfo, Sge, Srq,
};
pub use verbs::{Memfd, UserBuffer, UserMr};
pub use wire::Qpn;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
