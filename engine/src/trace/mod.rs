//! Packet capture: every packet an engine sends and receives, written to a pcap file with
//! RoCEv2 framing so that Wireshark and tshark decode it as InfiniBand.
//!
//! [`pcap::PcapWriter`] writes the file; [`roce`] builds the Ethernet / IPv4 / UDP framing
//! and the ICRC around each transport packet.
//!
//! # Example
//!
//! One Send captured for Wireshark ([`Context::trace_to`](crate::Context::trace_to);
//! [`ContextBuilder::pcap`](crate::ContextBuilder::pcap) from the start), and watched
//! packet by packet ([`Context::observe_packets`](crate::Context::observe_packets)):
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use shmhca::trace::Direction;
//! use shmhca::wire::opcode::Opcode;
//! use shmhca::{AccessFlags, Loopback, RecvWr, SendOp, SendWr, WcStatus};
//!
//! let mut lo = Loopback::new()?;
//! let file = std::env::temp_dir().join(format!("shmhca-doc-trace-{}.pcap", std::process::id()));
//! lo.a.ctx.trace_to(&file)?;
//! let seen = Arc::new(Mutex::new(Vec::new()));
//! let log = seen.clone();
//! lo.a.ctx.observe_packets(move |e| log.lock().unwrap().push((e.direction, e.headers.bth.opcode)));
//!
//! let src = lo.a.pd.alloc_mr(64, AccessFlags::NONE)?;
//! let dst = lo.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
//! lo.b.qp.post_recv(&RecvWr::new(1, &[dst.sge(0, 64)?]))?;
//! lo.a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 8)?]))?;
//! assert_eq!(lo.wait_a()?.status, WcStatus::Success); // A has B's Ack
//! lo.a.ctx.stop_trace(); // flushes the file
//!
//! let seen = seen.lock().unwrap();
//! assert!(seen.contains(&(Direction::Sent, Opcode::SendOnly)));
//! assert!(seen.contains(&(Direction::Received, Opcode::Acknowledge)));
//! // A pcap file: its 24-byte header, then a record per packet A sent or received.
//! let pcap = std::fs::read(&file)?;
//! assert!(pcap.len() > 24 + 2 * 16);
//! # std::fs::remove_file(&file)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # One capture file per process
//!
//! A context captures when built with [`ContextBuilder::pcap`](crate::ContextBuilder::pcap),
//! with `SHMHCA_PCAP=FILE` in the environment (the builder's default), or after
//! [`Context::trace_to`](crate::Context::trace_to). Contexts of one process naming the
//! same file share it (each packet between them is recorded once, by its sender). Two
//! processes never write one file — their records would interleave into a file no reader
//! can parse — and `SHMHCA_PCAP` is inherited by every process a program starts (a test
//! harness, `shmhca-perf`'s own peer, the `ipc_pingpong` example's server). So a capture
//! file is locked while a process writes it (an exclusive `flock`, which the kernel drops
//! when that process closes the file or dies), and a file another live process holds is
//! never truncated or written:
//!
//! * named by `ContextBuilder::pcap` or `Context::trace_to`, it is refused with
//!   [`Error::InvalidArgument`](crate::Error::InvalidArgument) naming the file;
//! * named by `SHMHCA_PCAP`, this process writes [`per_process_path`] instead —
//!   `capture.pcap` becomes `capture.4242.pcap` in process 4242 — and says so once on
//!   stderr. The first process to open the file keeps the name as given.
//!
//! `shmhca-perf` names its files itself: its client writes `FILE`, its server (its own
//! peer process, or `--server`) `FILE` with `.server` before the extension.
//!
//! A file no process holds is truncated and rewritten by the next capture, as before.
//!
//! ```
//! use std::path::Path;
//! use shmhca::trace::per_process_path;
//! assert_eq!(per_process_path(Path::new("/tmp/run.pcap"), 4242), Path::new("/tmp/run.4242.pcap"));
//! assert_eq!(per_process_path(Path::new("capture"), 7), Path::new("capture.7"));
//! ```

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

pub mod pcap;
pub mod roce;
pub(crate) mod tap;

/// Which way a traced packet went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Sent by this engine.
    Sent,
    /// Received by this engine.
    Received,
}

/// A packet seen by a packet observer ([`crate::Context::observe_packets`]).
#[derive(Debug, Clone, Copy)]
pub struct PacketEvent<'a> {
    /// Sent or received.
    pub direction: Direction,
    /// The link it went over.
    pub link: crate::LinkId,
    /// Its transport headers.
    pub headers: &'a crate::wire::PacketRepr,
    /// Its payload length in bytes.
    pub payload_len: u32,
}

/// Where process `pid` writes a capture named by `SHMHCA_PCAP` when another process
/// already writes `path`: the pid before the extension (`run.pcap` → `run.PID.pcap`), or
/// after a name without one (`run` → `run.PID`). See [the module](self).
pub fn per_process_path(path: &Path, pid: u32) -> PathBuf {
    let name = match (path.file_stem(), path.extension()) {
        (Some(stem), Some(ext)) => {
            let mut n = stem.to_os_string();
            n.push(format!(".{pid}."));
            n.push(ext);
            n
        }
        _ => {
            let mut n = path.file_name().unwrap_or_default().to_os_string();
            n.push(format!(".{pid}"));
            n
        }
    };
    path.with_file_name(name)
}
