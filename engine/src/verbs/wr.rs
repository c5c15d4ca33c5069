//! Work requests and work completions.

/// Work completions (`ibv_wc`), from the protocol core. Through a QP:
///
/// ```
/// use shmhca::{AccessFlags, Loopback, SendOp, SendWr, WcStatus};
///
/// let mut lo = Loopback::new()?;
/// let mr = lo.a.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
/// // An RDMA Write to a key the peer never gave out fails: the status says how (and the
/// // QP goes to the Error state).
/// let bad = shmhca::RemoteAddr { addr: 0, rkey: 0xdead };
/// lo.a.qp.post_send(&SendWr::new(1, SendOp::RdmaWrite(bad), &[mr.sge(0, 8)?]))?;
/// let wc = lo.wait_a()?;
/// assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RemAccessErr));
/// # Ok::<(), shmhca::Error>(())
/// ```
pub use crate::completion::WorkCompletion;
pub use crate::completion::{WcOpcode, WcStatus};
pub use crate::verbs::mr::RemoteAddr;
use crate::verbs::mr::Sge;
use crate::wqe::WqeFlags;

/// The operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Send: the data lands in the peer's next receive buffer.
    Send,
    /// Send with 32 bits of immediate data delivered in the peer's receive completion.
    SendWithImm(u32),
    /// RDMA Write into the peer's memory; the peer sees no completion.
    RdmaWrite(RemoteAddr),
    /// RDMA Write that also consumes a receive buffer at the peer and delivers the immediate
    /// data in its completion.
    RdmaWriteWithImm(RemoteAddr, u32),
    /// RDMA Read of the peer's memory into this request's scatter list.
    RdmaRead(RemoteAddr),
    /// Atomic Compare and Swap on an 8-byte aligned word of the peer; the original value
    /// lands in this request's 8-byte scatter buffer.
    CompareSwap {
        /// The word.
        remote: RemoteAddr,
        /// Compared with the word.
        compare: u64,
        /// Written if equal.
        swap: u64,
    },
    /// Atomic Fetch and Add on an 8-byte aligned word of the peer; the original value lands
    /// in this request's 8-byte scatter buffer.
    FetchAdd {
        /// The word.
        remote: RemoteAddr,
        /// Added to it.
        add: u64,
    },
    /// Send whose last packet asks the peer to invalidate the type 2 memory window bound
    /// with this R_Key (which must be bound to the peer QP this request arrives at); the
    /// peer's receive completion reports the key in
    /// [`WorkCompletion::invalidated_rkey`]. A key the peer cannot invalidate fails the
    /// request with [`WcStatus::RemInvReqErr`] and both QPs go to the Error state.
    SendWithInv(u32),
    /// Binds a type 2 memory window (`IBV_WR_BIND_MW`) to this QP: from then on `rkey`
    /// (the window's index with a consumer-chosen tag, [`crate::Mw::rkey_with_tag`]) gives
    /// this QP's peer the window's rights over its range. Executed in order with the
    /// QP's other work requests; completes with [`WcOpcode::BindMw`], or with
    /// [`WcStatus::MwBindErr`] (QP to Error) if the window is not an unbound type 2 window
    /// of this QP's domain, the region lacks `MW_BIND`, the range leaves the region, or
    /// the rights exceed what the region allows. No scatter/gather list.
    BindMw {
        /// The window's key after the bind (it names the window).
        rkey: u32,
        /// Where and with which rights.
        bind: MwBind,
    },
    /// Invalidates the type 2 memory window bound with this R_Key (`IBV_WR_LOCAL_INV`):
    /// the key stops working for the peer. Completes with [`WcOpcode::LocalInv`], or with
    /// [`WcStatus::LocProtErr`] (QP to Error) if the key names no bound type 2 window of
    /// this QP's domain. No scatter/gather list.
    LocalInv(u32),
}

/// Where a memory window is bound and with which rights (`ibv_mw_bind_info`); made with
/// [`crate::Mr::mw_bind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MwBind {
    /// The L_Key of the memory region the window lies in (registered with `MW_BIND`).
    pub lkey: u32,
    /// The window's first byte: an address of the region ([`crate::Mr::addr`] + offset).
    pub addr: u64,
    /// Its length in bytes (0 unbinds a type 1 window).
    pub len: u64,
    /// Its remote rights: any of `REMOTE_READ`, `REMOTE_WRITE`, `REMOTE_ATOMIC` (write and
    /// atomic need the region's `LOCAL_WRITE`). A window's rights are its own: they need
    /// not be rights of the region's own R_Key.
    pub access: crate::AccessFlags,
}

/// Flags of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags(u8);

impl SendFlags {
    /// No flags: an unsignaled request (it completes silently unless it fails).
    pub const NONE: SendFlags = SendFlags(0);
    /// Generate a work completion when it completes successfully.
    pub const SIGNALED: SendFlags = SendFlags(1);
    /// Start only after every earlier RDMA Read and Atomic has completed.
    pub const FENCE: SendFlags = SendFlags(2);
    /// Set the Solicited Event bit on the last packet.
    pub const SOLICITED: SendFlags = SendFlags(4);
    /// Copy the gather list's bytes at post time: the buffers may be reused as soon as
    /// `post_send` returns.
    pub const INLINE: SendFlags = SendFlags(8);

    /// Whether every flag of `other` is set.
    pub fn contains(self, other: SendFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// The WQE's flags of these: signaled, fenced, solicited (the same bits).
    #[inline(always)]
    pub(crate) fn wqe_bits(self) -> u8 {
        self.0 & (WqeFlags::SIGNALED | WqeFlags::FENCE | WqeFlags::SOLICITED)
    }
}

const _: () = assert!(
    SendFlags::SIGNALED.0 == WqeFlags::SIGNALED
        && SendFlags::FENCE.0 == WqeFlags::FENCE
        && SendFlags::SOLICITED.0 == WqeFlags::SOLICITED
);

impl std::ops::BitOr for SendFlags {
    type Output = SendFlags;
    fn bitor(self, rhs: SendFlags) -> SendFlags {
        SendFlags(self.0 | rhs.0)
    }
}

/// What a send work request carries or where its results go.
#[derive(Debug, Clone, Copy)]
pub enum Data<'a> {
    /// A gather list (Send, Write) or scatter list (Read, Atomic result) in registered memory.
    Sgl(&'a [Sge<'a>]),
    /// Bytes copied at post time (at most the QP's `max_inline_data`); they need not be in
    /// registered memory. Only for Send and RDMA Write.
    Inline(&'a [u8]),
}

/// A send work request (`ibv_send_wr`).
///
/// The four kinds of request, one after the other:
///
/// ```
/// use shmhca::{AccessFlags, Loopback, RecvWr, SendOp, SendWr, WcStatus};
///
/// let mut lo = Loopback::new()?;
/// let local = lo.a.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
/// let remote = lo.b.pd.alloc_mr(
///     4096,
///     AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ
///         | AccessFlags::REMOTE_ATOMIC,
/// )?;
/// let rx = lo.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
/// // Send, its bytes inline (copied at post time, no region needed).
/// lo.b.qp.post_recv(&RecvWr::new(1, &[rx.sge(0, 64)?]))?;
/// lo.a.qp.post_send(&SendWr::inline(10, SendOp::Send, b"hi"))?;
/// // RDMA Write of bytes 0..8 of `local` to bytes 100..108 of `remote`.
/// local.write_at(0, &42u64.to_le_bytes())?;
/// lo.a.qp.post_send(&SendWr::new(11, SendOp::RdmaWrite(remote.remote(100)), &[local.sge(0, 8)?]))?;
/// // RDMA Read of them back into bytes 8..16.
/// lo.a.qp.post_send(&SendWr::new(12, SendOp::RdmaRead(remote.remote(100)), &[local.sge(8, 8)?]))?;
/// // Fetch and Add on the word at 200; the original value lands in bytes 16..24.
/// let add = SendOp::FetchAdd { remote: remote.remote(200), add: 5 };
/// lo.a.qp.post_send(&SendWr::new(13, add, &[local.sge(16, 8)?]))?;
/// for wr_id in 10..14 {
///     let wc = lo.wait_a()?;
///     assert_eq!((wc.wr_id, wc.status), (wr_id, WcStatus::Success));
/// }
/// assert_eq!(lo.wait_b()?.byte_len, 2);
/// assert_eq!(local.load_u64(8)?, 42);
/// assert_eq!(remote.load_u64(200)?, 5);
/// # Ok::<(), shmhca::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    /// Returned in the work completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// The data.
    pub data: Data<'a>,
    /// Flags.
    pub flags: SendFlags,
}

impl<'a> SendWr<'a> {
    /// A signaled work request for `op` over the list `sgl`.
    pub fn new(wr_id: u64, op: SendOp, sgl: &'a [Sge<'a>]) -> SendWr<'a> {
        SendWr {
            wr_id,
            op,
            data: Data::Sgl(sgl),
            flags: SendFlags::SIGNALED,
        }
    }

    /// A signaled work request for `op` carrying `bytes` inline.
    pub fn inline(wr_id: u64, op: SendOp, bytes: &'a [u8]) -> SendWr<'a> {
        SendWr {
            wr_id,
            op,
            data: Data::Inline(bytes),
            flags: SendFlags::SIGNALED,
        }
    }

    /// Replaces the flags.
    pub fn flags(mut self, flags: SendFlags) -> SendWr<'a> {
        self.flags = flags;
        self
    }
}

/// A receive work request (`ibv_recv_wr`).
///
/// ```
/// use shmhca::{AccessFlags, Loopback, RecvWr, SendOp, SendWr};
///
/// let mut lo = Loopback::new()?;
/// let rx = lo.b.pd.alloc_mr(256, AccessFlags::LOCAL_WRITE)?;
/// // Receives are taken in the order they were posted, one per message.
/// lo.b.qp.post_recv(&RecvWr::new(1, &[rx.sge(0, 128)?]))?;
/// lo.b.qp.post_recv(&RecvWr::new(2, &[rx.sge(128, 128)?]))?;
/// lo.a.qp.post_send(&SendWr::inline(3, SendOp::Send, b"head"))?;
/// lo.a.qp.post_send(&SendWr::inline(4, SendOp::Send, b"body"))?;
/// assert_eq!(lo.wait_b()?.wr_id, 1);
/// let wc = lo.wait_b()?;
/// assert_eq!((wc.wr_id, wc.byte_len), (2, 4));
/// let mut body = [0u8; 4];
/// rx.read_at(128, &mut body)?;
/// assert_eq!(&body, b"body");
/// # Ok::<(), shmhca::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct RecvWr<'a> {
    /// Returned in the work completion.
    pub wr_id: u64,
    /// Where an incoming message is scattered.
    pub sgl: &'a [Sge<'a>],
}

impl<'a> RecvWr<'a> {
    /// A receive work request.
    pub fn new(wr_id: u64, sgl: &'a [Sge<'a>]) -> RecvWr<'a> {
        RecvWr { wr_id, sgl }
    }
}
