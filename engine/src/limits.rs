//! The device limits: every cap the engine enforces, defined once.
//!
//! The code that enforces a limit reads it from here, and so does
//! [`Context::query_device`](crate::Context::query_device), which reports them as a
//! [`DeviceAttr`] (`ibv_query_device`). A limit changed here changes both.

use shmhca_rings::segment::PageSize;

/// The most queue pairs one context holds: one doorbell's worth (64 × 64).
pub const MAX_QPS: u32 = shmhca_rings::doorbell::MAX_QUEUES as u32;
/// The deepest send or receive queue (work requests).
pub const MAX_QUEUE_DEPTH: u32 = 16384;
/// The most scatter/gather elements of one work request.
pub const MAX_SGE: u32 = crate::wire::slot::MAX_GATHER as u32;
/// The most inline data of one work request (bytes).
pub const MAX_INLINE_DATA: u32 = 4096;
/// The largest message (spec/05: zero to 2 GiB).
pub const MAX_MESSAGE: u64 = 1 << 31;
/// The most RDMA Read / Atomic requests one QP may have outstanding in either direction
/// (initiator depth and responder resources): the protocol core's.
pub const MAX_RD_ATOMIC: u8 = shmhca_proto::qp::MAX_RD_ATOMIC;
/// The most completion queues one context holds (a power of two: CQ numbers carry a
/// generation above the index).
pub const MAX_CQS: u32 = 1 << 16;
/// The deepest completion queue (completions).
pub const MAX_CQ_DEPTH: u32 = 1 << 20;
/// The most protection domains one context holds.
pub const MAX_PDS: u32 = 1 << 16;
/// The most memory regions one context holds (a 23-bit index: R_Keys with the high bit set
/// name memory windows).
pub const MAX_MRS: u32 = 1 << 23;
/// The most memory windows one context holds.
pub const MAX_MWS: u32 = 1 << 20;
/// The most shared receive queues one context holds.
pub const MAX_SRQS: u32 = 1 << 16;
/// The most links (peer engines, or `Context::link_with` pairs) one context holds.
pub const MAX_LINKS: u32 = 4096;
/// The most lines (64 bytes each; a small packet takes one) per direction of a link
/// (`ContextBuilder::link_slots`).
pub const MAX_LINK_SLOTS: usize = 1 << 14;
/// The fewest lines per direction of a link (`ContextBuilder::link_slots`): room for the
/// longest packet, a gather list of 16 ranges (7 lines).
pub const MIN_LINK_SLOTS: usize = 8;

const _: () = assert!(MAX_CQS.is_power_of_two());
const _: () = assert!(MAX_INLINE_DATA as u64 <= MAX_MESSAGE);

/// How atomic the RDMA Atomic operations are (`ibv_atomic_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AtomicCap {
    /// Atomic with respect to every other atomic access to the same aligned word: the
    /// responder's engine executes Compare & Swap and Fetch & Add with the CPU's own atomic
    /// instructions on the target memory, so they are atomic also against the owning
    /// application's atomic accesses (`IBV_ATOMIC_GLOB`).
    Global,
}

/// What a context supports and is configured with (`ibv_device_attr`), from
/// [`Context::query_device`](crate::Context::query_device). Every limit is the one the
/// code enforces: going past it is an error naming the limit
/// ([`Error::LimitReached`](crate::Error::LimitReached) for a table that is full,
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a size out of range).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceAttr {
    /// Queue pairs one context holds ([`MAX_QPS`]).
    pub max_qp: u32,
    /// Work requests of one send or receive queue ([`MAX_QUEUE_DEPTH`]).
    pub max_qp_wr: u32,
    /// Scatter/gather elements of one work request ([`MAX_SGE`]).
    pub max_sge: u32,
    /// Bytes of inline data of one send work request ([`MAX_INLINE_DATA`]).
    pub max_inline_data: u32,
    /// Completion queues one context holds ([`MAX_CQS`]).
    pub max_cq: u32,
    /// Completions one completion queue holds ([`MAX_CQ_DEPTH`]).
    pub max_cqe: u32,
    /// Protection domains one context holds ([`MAX_PDS`]).
    pub max_pd: u32,
    /// Memory regions one context holds ([`MAX_MRS`]).
    pub max_mr: u32,
    /// Memory windows one context holds ([`MAX_MWS`]).
    pub max_mw: u32,
    /// Shared receive queues one context holds ([`MAX_SRQS`]).
    pub max_srq: u32,
    /// Bytes of one memory region: as for a message ([`MAX_MESSAGE`]); a region must also
    /// fit in its protection domain's arena (`arena_size`).
    pub max_mr_size: u64,
    /// Bytes of one message ([`MAX_MESSAGE`]).
    pub max_msg_size: u64,
    /// RDMA Reads and Atomics one QP may have outstanding as requester (initiator depth,
    /// [`MAX_RD_ATOMIC`]).
    pub max_qp_init_rd_atom: u8,
    /// RDMA Reads and Atomics one QP accepts at once as responder (responder resources,
    /// [`MAX_RD_ATOMIC`]).
    pub max_qp_rd_atom: u8,
    /// How atomic the Atomic operations are.
    pub atomic_cap: AtomicCap,
    /// The largest path MTU.
    pub max_mtu: crate::Mtu,
    /// The page size of this context's arenas: that of its first protection domain's arena
    /// (4 KiB pages while it has none; huge pages when they were asked for and available).
    pub page_size: PageSize,
    /// Bytes of each protection domain's arena (`ContextBuilder::arena_size`).
    pub arena_size: u64,
    /// Links (peer engines) one context holds ([`MAX_LINKS`]).
    pub max_links: u32,
    /// Lines (64 bytes each) per direction of the links this context creates
    /// (`ContextBuilder::link_slots`).
    pub link_slots: usize,
    /// The most lines per direction a link may have ([`MAX_LINK_SLOTS`]).
    pub max_link_slots: usize,
}
