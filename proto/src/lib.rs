//! shmhca's protocol core: the InfiniBand Reliable Connected transport as a library that
//! does no I/O.
//!
//! This crate holds what every link and every driver of the transport share, and nothing
//! that touches the machine: the packet headers ([`wire`]), PSN arithmetic ([`psn`]),
//! completion statuses ([`completion`]), end-to-end credits ([`credit`]), the transport and
//! RNR timers with the [`Clock`](timer::Clock) and [`Timers`](timer::Timers) that pass the
//! time in ([`timer`]), the QP vocabulary and its protocol half ([`qp`]: state, context,
//! [`Qp`](qp::Qp)), and the transport's logic: the SQ Logic ([`requester`]: send window,
//! gates, retry counters, timers, and the transmit path behind
//! [`SqDriver`](requester::SqDriver)), the completer ([`completer`]: its checks, what each
//! outcome does, retiring send WQEs) and the RQ
//! Logic's state, its receive pipeline behind
//! [`ResponderDriver`](responder::ResponderDriver) and its refusal table ([`responder`]).
//!
//! It is `no_std` with no dependencies: it cannot read a clock, start a thread, take a lock,
//! map memory or touch a ring — the compiler and Cargo keep it so, not a convention. The
//! engine (crate `shmhca`) owns all of that and drives this core; a test drives it with a
//! [`ManualClock`](timer::ManualClock), plain buffers and a vector for a link.
//!
//! ```text
//!  shmhca (engine)   Context, Qp, Cq, Mr … │ cm │ poll loop │ links (shm rings) │ memory
//!        │ drives: SqDriver (a link, memory, MW table) · Timers (its clock)
//!        │         CompleterDriver · SendCompletions · ResponderDriver (memory,
//!        │         keys, CQs, the Error state) · Response / Request (headers it parsed)
//!        ▼
//!  shmhca-proto      qp::Qp = state · QpConfig · CQ ids · Requester · Responder
//!                    requester (window, gates, retries, timers, transmit → RequestPacket)
//!                    completer (check_response → Outcome → act, retire)
//!                    responder (state, handle_request: checks, execute, verdict)
//!                    wire · psn · completion · credit · timer · wqe · send_window · stats
//! ```
//!
//! The engine re-exports every module here under the same name (`shmhca::wire`,
//! `shmhca::psn`, …), so programs that use shmhca never name this crate.
//!
//! ```
//! use shmhca_proto::psn::Psn;
//! use shmhca_proto::wire::{BthRepr, Qpn, bth, opcode::Opcode};
//!
//! let sent = BthRepr::new(Opcode::SendOnly, Qpn::new(0x12), Psn::new(0xFF_FFFF));
//! let mut buf = [0u8; bth::HEADER_LEN];
//! sent.emit(&mut bth::Packet::new_checked(&mut buf[..])?);
//! let got = BthRepr::parse(&bth::Packet::new_checked(&buf[..])?)?;
//! assert_eq!(got, sent);
//! assert_eq!(got.psn + 1, Psn::new(0), "PSNs wrap at 2^24");
//! # Ok::<(), shmhca_proto::wire::Error>(())
//! ```
// Its tests use std (formatting, vectors); the library itself never does.
#![cfg_attr(not(test), no_std)]
#![forbid(unsafe_code)]

// The send window's ring of WQEs is allocated once, when a QP is created.
extern crate alloc;

pub mod completer;
pub mod completion;
pub mod credit;
pub mod ids;
pub mod mem;
pub mod psn;
pub mod qp;
pub mod requester;
pub mod responder;
pub mod roce;
pub mod send_window;
pub mod stats;
pub mod timer;
pub mod wire;
pub mod wqe;
