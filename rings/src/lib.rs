//! Shared-memory segments and the cross-process SPSC ring under shmhca.
//!
//! * [`segment`]: a memfd-backed [`Segment`] (huge pages when available), sealed, with a
//!   validated header, that can be sent to another process as a file descriptor and
//!   mapped there read-write or read-only.
//! * [`ring`]: a single-producer single-consumer ring of fixed-size slots with burst
//!   operations, one implementation over two storages: the heap (in-process, and for loom
//!   and Miri) and a segment (between processes). The consumer trusts nothing it reads
//!   from shared memory: an impossible index is reported as [`ring::LinkBroken`].
//! * [`lines`]: a single-producer single-consumer ring of stamped 64-byte lines with no
//!   tail index: a small packet is one line, announced by the sequence stamp in it. The
//!   consumer validates every stamp and count like an index.
//! * [`doorbell`]: a two-level atomic bitmap through which posting threads tell a poll
//!   loop which queues have new work.
//! * [`fdpass`]: sending and receiving file descriptors over a Unix socket (`SCM_RIGHTS`).
//! * [`sync`]: the atomics shim that swaps in loom under `--cfg shmhca_loom`.
//!
//! Unsafe code lives only in [`segment`], the ring's storage and the line ring; everything else denies it.
#![deny(unsafe_code)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod doorbell;
pub mod fdpass;
pub mod lines;
pub mod ring;
pub mod segment;
pub mod sync;

pub use bytemuck::{Pod, Zeroable};
pub use ring::{Consumer, LinkBroken, Producer};
pub use segment::{Access, HugePages, PageSize, Segment, SegmentBuilder};
