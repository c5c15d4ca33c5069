//! shmhca: a software InfiniBand Host Channel Adapter — the Reliable Connected transport
//! between processes on one machine.
//!
//! Each process runs an *engine* (its HCA) that exchanges real IBA transport packets with
//! peer engines over lock-free rings in shared memory. Applications use a verbs-style API:
//! a [`Context`], protection domains ([`Pd`]), memory regions ([`Mr`]) carved from a shared
//! arena, completion queues ([`Cq`]) and reliable-connected queue pairs ([`Qp`]) with Send,
//! Send with Immediate, RDMA Write (with Immediate), RDMA Read and the two Atomics.
//!
//! The protocol follows the IBA RC chapters. Its core is the crate `shmhca-proto`, sans
//! I/O: the QP state machine and context ([`qp`]), the SQ Logic ([`requester`]: the send
//! window, gates, retries, timers and the transmit path), the completer's checks and the
//! RQ Logic's state, checks and refusal table, end-to-end credits ([`credit`]) and the
//! timers ([`timer`]), over the header formats of [`wire`] and the PSN arithmetic of
//! [`psn`]. This crate drives it: it passes packets, work requests, memory and the time in.
//!
//! # Who owns what
//!
//! ```text
//!  application ──▶ verbs (Context, Pd, Mr, Cq, Qp, Srq, Mw)        cm (Listener, Connection)
//!                     │ handles hold an Arc of the device                │ keeps its state in it
//!                     ▼                                                  ▼
//!                  device ── one engine, its doorbell, engine page, kick word, engine thread
//!                     │ the engine token (EngineCell) guards everything below
//!                     ▼
//!                  engine (poll loop) ── owns ──▶ tables/ (MR, MW, SRQ, CQ + notify)
//!                     │                           QP slots (context::QpSlot: the core's
//!                     │                             Qp + memory, posted queues, app mirror)
//!                     │                           links (link::shm: rings, slot format)
//!                     │                           the clock (system, or a TestClock)
//!                     │ lends an Env (tables, stats, clock: proto's Timers) and a link
//!                     ▼
//!                  drivers of the core: requester (template path, transmit Driver,
//!                  timer outcomes) · responder (Receiver: receive WQEs, keys, memory;
//!                  short paths, responses sent) · completer (Completer, SendCompletions)
//!                  · dma (copies)
//!                     │ call, through SqDriver / ResponderDriver / CompleterDriver /
//!                     │ SendCompletions / Timers / Memory
//!                     ▼
//!                  shmhca-proto (no_std, no dependencies, no unsafe): qp::Qp (state,
//!                  context, CQ ids, Requester, Responder) · requester (window, gates,
//!                  retries, timers, transmit) · completer (checks → Outcome → act,
//!                  retire) · responder (state, receive pipeline, refusal table) · wire · psn · credit ·
//!                  timer (Clock, Timers, ManualClock) · wqe + Memory · send_window · stats
//! ```
//!
//! Arrows point down only: nothing below imports what is above it (`verbs` and `cm` are
//! above `device`; the device holds the CM's state without knowing its type). The core
//! crate is where the compiler keeps the protocol free of clocks, threads, rings and
//! `unsafe`; what stays in this crate of the stages is what touches memory, links and the
//! engine's tables — it talks to links only through `context::LinkTx` and reads the time
//! only through the `Env`.
//!
//! # Quick start
//!
//! Two engines in this process, a QP on each, connected by hand (between processes,
//! [`cm`] does this over a Unix socket), and one Send:
//!
//! ```
//! use shmhca::*;
//!
//! let a = Context::builder().mode(EngineMode::Inline).build()?;
//! let b = Context::builder().mode(EngineMode::Inline).build()?;
//! let (link_a, link_b) = a.link_with(&b)?;
//! let (pd_a, pd_b) = (a.alloc_pd()?, b.alloc_pd()?);
//! let (cq_a, mut cq_b) = (a.create_cq(64)?, b.create_cq(64)?);
//! let mut qa = a.create_qp(&pd_a, &cq_a, &cq_a, QpCaps::default())?;
//! let mut qb = b.create_qp(&pd_b, &cq_b, &cq_b, QpCaps::default())?;
//! let (na, nb) = (qa.qpn(), qb.qpn());
//! for (qp, link, qpn) in [(&mut qa, link_a, nb), (&mut qb, link_b, na)] {
//!     qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::REMOTE_WRITE))?;
//!     qp.modify(&QpAttr::new(QpState::Rtr).path_mtu(Mtu::Mtu4096)
//!         .dest(Destination { link, qpn }).rq_psn(0)
//!         .max_dest_rd_atomic(1).min_rnr_timer(1))?;
//!     qp.modify(&QpAttr::new(QpState::Rts).sq_psn(0).timeout(14)
//!         .retry_cnt(7).rnr_retry(7).max_rd_atomic(1))?;
//! }
//! let src = pd_a.alloc_mr(4096, AccessFlags::NONE)?;
//! let dst = pd_b.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
//! src.write_at(0, b"hello, RDMA")?;
//! qb.post_recv(&RecvWr::new(1, &[dst.sge(0, 4096)?]))?;
//! qa.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 11)?]))?;
//! let mut wc = [WorkCompletion::default(); 1];
//! while cq_b.poll(&mut wc) == 0 {
//!     a.progress(); // inline mode: the application's calls run the engines
//! }
//! assert_eq!((wc[0].status, wc[0].byte_len), (WcStatus::Success, 11));
//! # Ok::<(), shmhca::Error>(())
//! ```
//!
//! [`Loopback`] is that set-up in one call, for examples and for the tests of programs built
//! on shmhca.
//!
//! # Where to find what
//!
//! | to | see |
//! |---|---|
//! | connect processes (REQ/REP/RTU over a Unix socket) | [`cm`] (its example runs both ends), [`Listener`] (accepting in an event loop), [`Connection`] (a peer's hang-up) |
//! | choose the engine mode, idle policy, arena size, capture | [`ContextBuilder`] |
//! | allocate and register memory; your own buffers and memfds | [`Pd`], [`Mr`], [`Pd::reg_mr`], [`Memfd`], [`Context::alloc_pd_over`] |
//! | post Send, RDMA Write, Read, Atomics | [`SendWr`], [`SendOp`], [`Qp`] |
//! | post receives; shared receive queues | [`RecvWr`], [`Srq`] |
//! | completions and their statuses; sleeping until one comes | [`WorkCompletion`], [`Cq`], [`CompChannel`] |
//! | memory windows | [`Mw`], [`MwBind`] |
//! | errors: what went wrong and what to do; those that hand back what they took | [`Error`], [`Refused`] |
//! | inject loss, duplicates, reordering, corruption | [`fault`] (a lost packet resent), [`fault::FaultConfig`] |
//! | capture packets for Wireshark | [`trace`] (a capture), [`ContextBuilder::pcap`], [`Context::trace_to`], [`Context::observe_packets`] |
//! | counters (RNR Naks, retransmissions, timeouts…) | [`Stats`] (its example: a receive posted late), `shmhca stat` |
#![deny(unsafe_code)]
#![warn(clippy::undocumented_unsafe_blocks)]
// Under loom there is no engine thread and no sleeping: its helpers go unused.
#![cfg_attr(shmhca_loom, allow(dead_code))]

pub(crate) mod arena;
pub mod async_events;
pub mod cm;
pub mod completer;
pub use shmhca_proto::completion;
pub(crate) mod context;
pub use shmhca_proto::credit;
#[cfg(test)]
mod credit_flow_tests;
pub(crate) mod device;
pub(crate) mod dma;
pub(crate) mod engine;
mod error;
pub mod fabric;
pub mod fault;
#[cfg(test)]
mod hostile_tests;
pub(crate) mod ids;
pub mod limits;
pub mod link;
pub(crate) mod mem;
#[cfg(test)]
mod probe;
pub use shmhca_proto::psn;
pub mod qp;
#[cfg(test)]
mod raw_peer;
pub mod requester;
pub mod responder;
pub use shmhca_proto::roce;
pub(crate) mod slots;
pub mod stats_area;
pub(crate) mod sync;
pub(crate) mod tables;
#[doc(hidden)]
pub mod testing;
pub mod timer;
pub mod trace;
pub(crate) mod user_buffer;
pub(crate) mod user_mem;
pub mod verbs;
pub mod wire;
pub(crate) use shmhca_proto::wqe;

pub use cm::{ConnectParams, Connection, Listener, PeerPolicy};
pub use context::Stats;
pub use error::{Error, Refused, Result};
pub use fabric::{FabricAddr, FabricDest, FabricLink, FabricPeer};
pub use limits::{AtomicCap, DeviceAttr};
pub use link::LinkId;
pub use link::udp::gid::{GidEntry, gid_table};
pub use link::udp::{UdpCounters, UdpPort};
pub use qp::{AccessFlags, Destination, Mtu, QpAttr, QpCaps, QpConfig, QpState};
pub use verbs::wr::{
    Data, MwBind, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};
pub use verbs::{
    AsyncEvent, CompChannel, Context, ContextBuilder, Cq, EngineMode, IdlePolicy, Loopback,
    LoopbackEnd, Mr, Mw, MwType, Pd, Progress, Qp, QpInfo, Sge, Srq,
};
pub use verbs::{Memfd, RawBuffer, UserBuffer, UserMr};
pub use wire::Qpn;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
