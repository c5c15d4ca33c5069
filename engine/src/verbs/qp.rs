//! Queue pairs: posting work requests and changing state.

use crate::sync::Ordering;
use crate::tables::mr::MrShared;
use std::sync::Arc;

use shmhca_rings::ring::{HeapStorage, Producer, heap_ring};

use crate::arena::Block;
use crate::context::{QpShared, QpSlot};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::mem::Mem;
use crate::qp::{AccessFlags, MAX_MESSAGE, QpAttr, QpCaps, QpConfig, QpState};
use crate::tables::mw::MwType;
use crate::verbs::EngineMode;
use crate::verbs::cq::Cq;
use crate::verbs::mr::{Pd, Sge};
use crate::verbs::mw::Mw;
use crate::verbs::srq::Srq;
use crate::verbs::wr::{Data, MwBind, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr};
use crate::wire::Qpn;
use crate::wqe::{DataLoc, NO_MR, RqWqe, SGE_ENTRY_LEN, SgeEntry, SqWqe, WqeFlags, WqeOp};

/// A QP's state and attributes, from [`Qp::query`] (`ibv_query_qp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpInfo {
    /// The QP number.
    pub qpn: Qpn,
    /// The current state.
    pub state: QpState,
    /// The programmed attributes: access flags, path MTU, destination, start PSNs, Local
    /// Ack Timeout, Retry and RNR Retry Counts, minimum RNR timer, initiator depth and
    /// responder resources, credit mode (as last set by [`Qp::modify`]).
    pub config: QpConfig,
    /// The capabilities it was created with.
    pub caps: QpCaps,
    /// The PSN of the next new request packet (nPSN): the start PSN plus the request
    /// packets sent so far, modulo 2^24.
    pub next_send_psn: u32,
    /// The PSN the responder expects next (ePSN): the remote's start PSN plus the request
    /// packets received in order, modulo 2^24.
    pub expected_psn: u32,
    /// The transport timer's period Ttr (4.096 µs × 2^timeout), fixed on RTR → RTS;
    /// `None` before RTS or when the timer is disabled (Local Ack Timeout 0).
    pub transport_timeout: Option<std::time::Duration>,
}

/// A reliable-connected queue pair.
///
/// A `Qp` is the single producer of its send and receive queues: posting takes `&mut self`.
/// It can move to another thread (`Send`) but not be shared (`!Sync`).
///
/// Post receives before the messages they take. A Send (or RDMA Write with Immediate) that
/// finds no receive posted is not lost: it is answered with an RNR Nak and sent again
/// after the receiver's [`min_rnr_timer`](crate::QpAttr::min_rnr_timer), up to
/// `rnr_retry` times (7: for ever). Nothing fails and nothing is reported but the delay —
/// an echo server that re-posts its receive only after answering pays one RNR wait per
/// message (2,000 echoes took 5 s instead of 18 ms) — so watch the counters:
/// [`Stats::rnr_naks_sent`](crate::Stats::rnr_naks_sent) (its example shows one),
/// `rnr_naks_received` at the sender, and `shmhca stat`, which says what to do when they
/// are not 0.
///
/// ```
/// use shmhca::{AccessFlags, Loopback, QpState, RecvWr, SendOp, SendWr, WcStatus};
///
/// let mut lo = Loopback::new()?;
/// assert_eq!(lo.a.qp.state(), QpState::Rts);
/// // Send with Immediate: the receiver gets the bytes and the 32-bit immediate.
/// let src = lo.a.pd.alloc_mr(4096, AccessFlags::NONE)?;
/// let dst = lo.b.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
/// src.write_at(0, &[9u8; 100])?;
/// lo.b.qp.post_recv(&RecvWr::new(1, &[dst.sge(0, 4096)?]))?;
/// lo.a.qp.post_send(&SendWr::new(2, SendOp::SendWithImm(0xfeed), &[src.sge(0, 100)?]))?;
/// let wc = lo.wait_b()?;
/// assert_eq!((wc.status, wc.byte_len, wc.imm_data), (WcStatus::Success, 100, Some(0xfeed)));
/// assert_eq!(lo.wait_a()?.wr_id, 2);
/// # Ok::<(), shmhca::Error>(())
/// ```
pub struct Qp {
    shared: Arc<Device>,
    pub(crate) index: u32,
    qpn: Qpn,
    pdn: u32,
    caps: QpCaps,
    sq: Producer<SqWqe, HeapStorage<SqWqe>>,
    rq: Producer<RqWqe, HeapStorage<RqWqe>>,
    qshared: Arc<QpShared>,
    sq_posted: u64,
    /// `sq_posted % max_send_wr`, kept as it goes (no division per post): the row of the
    /// next request in the inline staging area and the gather table.
    sq_row: u64,
    /// Send WQEs pushed on the send ring (the others were handed to the engine directly).
    sq_pushed: u64,
    sq_retired: u64,
    rq_posted: u64,
    rq_retired: u64,
    /// The protection domain's arena (inline staging lives there).
    mem: Mem,
    /// Private memory for the rows of multi-element lists: gather rows of sends
    /// (`max_send_wr` rows of `max_send_sge` entries) from offset 0, then scatter rows of
    /// receives from `scatter_at`. Shared with the engine's `QpSlot`, never with a peer.
    tables: Mem,
    scatter_at: u64,
    /// Inline staging in the arena (`max_send_wr` rows of `inline_row` bytes).
    inline: Option<Block>,
    inline_row: u64,
    /// The shared receive queue it takes its receives from.
    srq: Option<u32>,
}

impl Qp {
    pub(crate) fn create(
        shared: &Arc<Device>,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
    ) -> Result<Qp> {
        Qp::create_in(shared, pd, send_cq, recv_cq, None, caps)
    }

    /// Creates a QP, on shared receive queue `srq` if given.
    pub(crate) fn create_in(
        shared: &Arc<Device>,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: Option<&Srq>,
        caps: QpCaps,
    ) -> Result<Qp> {
        caps.validate()?;
        if let Some(srq) = srq {
            if !Arc::ptr_eq(&srq.shared, shared) {
                return Err(Error::ForeignObject {
                    what: "the shared receive queue",
                });
            }
            if srq.pdn != pd.pdn {
                return Err(Error::invalid(
                    "shared receive queue",
                    "an SRQ of another protection domain than the QP's: create the SRQ with the QP's domain",
                ));
            }
        }
        if !pd.same_context(shared) {
            return Err(Error::ForeignObject {
                what: "the protection domain",
            });
        }
        if !send_cq.same_context(shared) || !recv_cq.same_context(shared) {
            return Err(Error::ForeignObject {
                what: "the completion queue",
            });
        }
        let sq_cap = caps.max_send_wr.next_power_of_two() as usize;
        // A QP on an SRQ has no receive queue of its own (a ring of one, never used).
        let rq_cap = if srq.is_some() {
            1
        } else {
            caps.max_recv_wr.next_power_of_two() as usize
        };
        let (sq, sq_c) =
            heap_ring(sq_cap).map_err(|e| Error::invalid("max_send_wr", e.to_string()))?;
        let (rq, rq_c) =
            heap_ring(rq_cap).map_err(|e| Error::invalid("max_recv_wr", e.to_string()))?;
        let qshared = Arc::new(QpShared::new());
        let inline_row = u64::from(caps.max_inline_data).div_ceil(64) * 64;
        let (pdn, scq, rcq) = (pd.pdn, send_cq.cqn, recv_cq.cqn);
        let qs = qshared.clone();
        let gather_bytes = if caps.max_send_sge > 1 {
            u64::from(caps.max_send_wr) * u64::from(caps.max_send_sge) * SGE_ENTRY_LEN
        } else {
            0
        };
        let scatter_bytes = if let Some(srq) = srq {
            // One scratch row for the SRQ receive being filled (see `tables::srq`).
            u64::from(srq.max_sge) * SGE_ENTRY_LEN
        } else if caps.max_recv_sge > 1 {
            u64::from(caps.max_recv_wr) * u64::from(caps.max_recv_sge) * SGE_ENTRY_LEN
        } else {
            0
        };
        let tables = Mem::private((gather_bytes + scatter_bytes) as usize);
        let ctx_tables = tables.share();
        let mem = pd.mem.share();
        let ctx_mem = pd.mem.share();
        let inline_bytes = u64::from(caps.max_send_wr) * inline_row;
        let srq_index = srq.map(|s| s.index);
        let (index, qpn, inline) = shared.engine.with(|e| {
            let arena = e.res.pds.get_mut(pdn).ok_or(Error::ForeignObject {
                what: "the protection domain",
            })?;
            if let Some(i) = srq_index {
                if e.res.srqs.get_mut(i).is_none() {
                    return Err(Error::ForeignObject {
                        what: "the shared receive queue",
                    });
                }
            }
            let inline = match inline_bytes {
                0 => None,
                n => Some(arena.alloc(n, 64)?),
            };
            let added = e.add_qp(|qpn| QpSlot {
                proto: shmhca_proto::qp::Qp::new(
                    qpn,
                    shmhca_proto::ids::PdId::new(pdn),
                    (scq, rcq),
                    caps.max_send_wr,
                ),
                mem: ctx_mem,
                peer_mem: Mem::private(0),
                tables: ctx_tables,
                sq: crate::context::Posted::new(sq_c),
                rq: crate::context::Posted::new(rq_c),
                shared: qs,
                rq_retired: 0,
                rq_flush_pending: false,
                #[cfg(test)]
                fast_posts: 0,
                #[cfg(test)]
                visits: 0,
                credits: Default::default(),
                srq: srq_index.map(|srq| crate::context::SrqBinding {
                    srq: shmhca_proto::ids::SrqId::new(srq),
                    scratch: gather_bytes,
                }),
            });
            match added {
                Ok((index, qpn)) => {
                    e.res.pds.hold(pdn);
                    if let Some(s) = srq_index.and_then(|i| e.res.srqs.get_mut(i)) {
                        s.qps += 1;
                    }
                    Ok((index, qpn, inline))
                }
                Err(err) => {
                    if let (Some(b), Some(arena)) = (inline, e.res.pds.get_mut(pdn)) {
                        arena.free(b);
                    }
                    Err(err)
                }
            }
        })?;
        Ok(Qp {
            shared: shared.clone(),
            index,
            qpn,
            pdn,
            caps,
            sq,
            rq,
            qshared,
            sq_posted: 0,
            sq_row: 0,
            sq_pushed: 0,
            sq_retired: 0,
            rq_posted: 0,
            rq_retired: 0,
            mem,
            tables,
            scatter_at: gather_bytes,
            inline,
            inline_row,
            srq: srq_index,
        })
    }

    /// The QP number (what the peer puts in its destination).
    pub fn qpn(&self) -> Qpn {
        self.qpn
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.qshared.state()
    }

    /// Why the QP went to the Error state, in words, when the engine knows more than the
    /// completion status says: for `RetryExcErr` and `RnrRetryExcErr`, which retry counter
    /// ran out, after what, and the last PSN the peer acknowledged; on the responder's side
    /// of a Remote Access Error Nak (the peer's completion: `RemAccessErr`), which check
    /// refused which key, range and access. `None` if no such error happened.
    pub fn last_error(&self) -> Option<String> {
        self.qshared
            .last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The capabilities it was created with.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// Bytes this QP holds besides its memory regions: its send and receive rings, the
    /// SQ Logic's window of WQEs, the RQ Logic's response queues, its private
    /// scatter/gather tables and its inline staging in the arena.
    pub fn memory_bytes(&self) -> usize {
        let index = self.index;
        let engine_side = self
            .shared
            .engine
            .with(|e| {
                e.qp_mut(index)
                    .map(|q| q.proto.req.memory_bytes() + q.proto.resp.memory_bytes())
            })
            .unwrap_or(0);
        let rings =
            self.sq.capacity() * size_of::<SqWqe>() + self.rq.capacity() * size_of::<RqWqe>();
        let staging = self.inline.map_or(0, |b| b.len) as usize;
        size_of::<Qp>() + size_of::<QpSlot>() + rings + engine_side + staging + self.tables.len()
    }

    /// Changes the QP's state and attributes (`ibv_modify_qp`).
    ///
    /// # Errors
    /// A transition the state machine does not have, a missing required attribute, or an
    /// attribute out of range (each error names it); the QP is left unchanged. See
    /// [`plan_modify`](crate::qp::plan_modify).
    pub fn modify(&mut self, attr: &QpAttr) -> Result<()> {
        let index = self.index;
        let mut resolved;
        let mut attr = attr;
        if let Some(f) = attr.fabric_dest {
            if attr.dest.is_some() {
                return Err(Error::invalid(
                    "dest_lid",
                    "both a link destination (dest) and a fabric one (dest_lid/dest_gid): set one",
                ));
            }
            if attr.state != QpState::Rtr || self.state() != QpState::Init {
                return Err(Error::invalid(
                    "dest_lid",
                    "a fabric destination is set in the Init → RTR transition",
                ));
            }
            resolved = *attr;
            resolved.fabric_dest = None;
            let resolve = self.shared.fabric_resolve.get().ok_or_else(|| {
                Error::invalid(
                    "dest_lid",
                    "this context has not joined the fabric: call Context::join_fabric first",
                )
            })?;
            resolved.dest = Some(resolve(&self.shared, self.qpn, self.pdn, f)?);
            attr = &resolved;
        }
        if let Some(d) = attr.dest {
            self.shared.find_local_peer_qp(d);
        }
        self.shared.engine.with(|e| e.modify_qp(index, attr))?;
        self.shared.kick();
        Ok(())
    }

    /// The QP's programmed attributes.
    pub fn config(&self) -> QpConfig {
        let index = self.index;
        self.shared
            .engine
            .with(|e| e.qp_mut(index).map(|q| q.proto.cfg))
            .unwrap_or_default()
    }

    /// The QP's state and attributes (`ibv_query_qp`): what it was programmed with, what
    /// it was created with, and where its PSNs stand now.
    pub fn query(&self) -> QpInfo {
        let index = self.index;
        let live = self.shared.engine.with(|e| {
            e.qp_mut(index).map(|q| {
                (
                    q.proto.state,
                    q.proto.cfg,
                    q.proto.req.window().npsn().get(),
                    q.proto.resp.epsn.get(),
                    q.proto.req.ttr(),
                )
            })
        });
        let (state, config, next_send_psn, expected_psn, ttr) =
            live.unwrap_or((self.state(), QpConfig::default(), 0, 0, None));
        QpInfo {
            qpn: self.qpn,
            state,
            config,
            caps: self.caps,
            next_send_psn,
            expected_psn,
            transport_timeout: ttr,
        }
    }

    /// Send work requests posted and not yet retired.
    pub fn sq_outstanding(&mut self) -> u32 {
        self.refresh_sq();
        (self.sq_posted - self.sq_retired) as u32
    }

    #[inline]
    fn refresh_sq(&mut self) {
        // SYNC: Acquire pairs with the Release store of `sq_retired` in `completer::retire`.
        // (Mutation point of the loom models: this load with Relaxed.)
        let order = crate::sync::weaken(Ordering::Acquire, "Qp::refresh_sq load");
        self.sq_retired = self.qshared.sq_retired.load(order);
    }

    /// Whether a receive may be posted (fewer than `max_recv_wr` outstanding): the count
    /// of retired receives read again only when the one known says the queue is full.
    #[inline(always)]
    fn rq_room(&mut self) -> bool {
        let max = u64::from(self.caps.max_recv_wr);
        if self.rq_posted - self.rq_retired < max {
            return true;
        }
        self.refresh_rq();
        self.rq_posted - self.rq_retired < max
    }

    fn refresh_rq(&mut self) {
        // SYNC: Acquire pairs with the Release store of `rq_retired` in `QpSlot::retire_recv`.
        self.rq_retired = self.qshared.rq_retired.load(Ordering::Acquire);
    }

    /// Posts a send work request (`ibv_post_send`).
    ///
    /// Sends can be posted in RTS and SQD; in SQE and Error they are accepted and complete
    /// with a flush error. Inline data is copied before this returns.
    ///
    /// # Errors
    /// [`Error::InvalidState`] before RTS, [`Error::QueueFull`] when `max_send_wr` requests
    /// are outstanding, [`Error::InvalidArgument`] for a malformed request (too many
    /// elements, too much inline data, a misaligned or mis-sized Atomic, a Read or Atomic
    /// result buffer without `LOCAL_WRITE`, a message above 2 GiB, Reads/Atomics with an
    /// initiator depth of 0), [`Error::ForeignObject`] for memory of another context or
    /// protection domain. Nothing is posted on error.
    pub fn post_send(&mut self, wr: &SendWr<'_>) -> Result<()> {
        // A Send, the most common post, on an instance of its own (its operation known).
        let straight = match wr.op {
            SendOp::Send => self.post_send_straight::<SEND>(wr),
            SendOp::SendWithImm(_) | SendOp::RdmaWrite(_) | SendOp::RdmaWriteWithImm(..) => {
                self.post_send_straight::<WRITE>(wr)
            }
            _ => false,
        };
        if straight {
            return Ok(());
        }
        self.post_send_other(wr)
    }

    /// [`Qp::post_send`] of anything but a Send or Write its straight path takes: the
    /// straight path of Reads and Atomics, else the general one.
    #[inline(never)]
    fn post_send_other(&mut self, wr: &SendWr<'_>) -> Result<()> {
        if self.post_send_straight::<RD_ATOMIC>(wr) {
            return Ok(());
        }
        // The WQE is handed on where `prepare_send` built it (not moved out of the Result
        // first: a copy of every field on each post).
        let prepared = self.prepare_send(wr);
        let wqe = match &prepared {
            Ok(wqe) => wqe,
            Err(_) => return prepared.map(drop),
        };
        self.post_wqe(wqe, counted_sgl(wr));
        Ok(())
    }

    /// Whether a straight path may post now: room in the send queue (the retired count read
    /// again only when the queue looks full, as in `prepare`) and the QP past RTR. False
    /// sends the request to the general path, which says why not.
    #[inline(always)]
    fn straight_post_open(&mut self) -> bool {
        let max = u64::from(self.caps.max_send_wr);
        let full = self.sq_posted - self.sq_retired >= max && {
            self.refresh_sq();
            self.sq_posted - self.sq_retired >= max
        };
        !full
            && !matches!(
                self.qshared.state(),
                QpState::Reset | QpState::Init | QpState::Rtr
            )
    }

    /// [`Qp::post_send`]'s straight path, for the common request: a Send or RDMA Write
    /// (with or without immediate data) of one registered element or of inline bytes, or an
    /// RDMA Read or Atomic into one element, on a QP past RTR with room in its send queue;
    /// `KIND` says which of the three kinds it takes ([`SEND`]: `wr` is a Send, the caller
    /// looked; [`WRITE`]: another Send or a Write; [`RD_ATOMIC`]), each an instance of its
    /// own. Builds the WQE [`Qp::prepare`] builds for it — without the checks that cannot
    /// fail for these operations and this data (the data of a local operation, the element
    /// count, inline data of a Read or Atomic) — and posts it. Returns false, having posted
    /// nothing, for anything else or for a check that fails: the general path then does it
    /// or says why not. (Its only effects before that answer: inline bytes staged in the
    /// request's own row, which the general path stages again, and a registered buffer's
    /// bytes copied into its shadow, as the general path copies them.)
    #[inline(always)]
    fn post_send_straight<const KIND: u8>(&mut self, wr: &SendWr<'_>) -> bool {
        #[cfg(test)]
        if !crate::probe::enabled() {
            return false;
        }
        let none = RemoteAddr::default();
        let (op, imm, remote, compare_add, swap) = match wr.op {
            _ if KIND == SEND => {
                debug_assert!(matches!(wr.op, SendOp::Send));
                (WqeOp::Send, 0, none, 0, 0)
            }
            _ if KIND == WRITE => match wr.op {
                SendOp::SendWithImm(i) => (WqeOp::SendImm, i, none, 0, 0),
                SendOp::RdmaWrite(r) => (WqeOp::Write, 0, r, 0, 0),
                SendOp::RdmaWriteWithImm(r, i) => (WqeOp::WriteImm, i, r, 0, 0),
                _ => return false,
            },
            SendOp::RdmaRead(r) => (WqeOp::Read, 0, r, 0, 0),
            SendOp::CompareSwap {
                remote,
                compare,
                swap,
            } => (WqeOp::CompareSwap, 0, remote, compare, swap),
            SendOp::FetchAdd { remote, add } => (WqeOp::FetchAdd, 0, remote, add, 0),
            _ => return false,
        };
        if !self.straight_post_open() {
            return false;
        }
        let rd_atomic = KIND == RD_ATOMIC;
        debug_assert_eq!(op.is_rd_atomic(), rd_atomic);
        let (data, len, held) = match wr.data {
            Data::Sgl([s]) if !wr.flags.contains(SendFlags::INLINE) => {
                if !self.sge_ok(s, rd_atomic) || u64::from(s.len) > MAX_MESSAGE {
                    return false;
                }
                let off = if rd_atomic {
                    // (A result buffer: the initiator depth and an Atomic's word checked.)
                    let atomic = op.is_atomic();
                    if self.qshared.max_rd_atomic.load(Ordering::Relaxed) == 0
                        || (atomic && (remote.addr % 8 != 0 || s.len != 8))
                    {
                        return false;
                    }
                    s.mr.dst_off(s.offset)
                } else {
                    let Ok(off) = s.mr.src_off(s.offset, u64::from(s.len)) else {
                        return false;
                    };
                    off
                };
                let entry = SgeEntry {
                    off,
                    len: s.len,
                    mr: s.mr.index,
                };
                (DataLoc::Single(entry), s.len, std::slice::from_ref(s))
            }
            Data::Inline(bytes)
                if !rd_atomic && bytes.len() <= self.caps.max_inline_data as usize =>
            {
                // (`max_inline_data` is below 2 GiB: the length fits a message.)
                let len = bytes.len() as u32;
                if len == 0 {
                    (DataLoc::Empty, 0, &[][..])
                } else {
                    let Some(block) = self.inline else {
                        return false;
                    };
                    let off = block.off + self.sq_row * self.inline_row;
                    if self.mem.write(off, bytes).is_err() {
                        return false;
                    }
                    let entry = SgeEntry {
                        off,
                        len,
                        mr: NO_MR,
                    };
                    (DataLoc::Single(entry), len, &[][..])
                }
            }
            _ => return false,
        };
        // A Send or an RDMA Write of one element or of inline bytes: the engine's straight
        // post, with no WQE built here unless it declines.
        if KIND == SEND || (KIND == WRITE && op == WqeOp::Write) {
            if let DataLoc::Single(entry) = data {
                debug_assert_eq!(entry.len, len);
                if KIND == SEND {
                    self.post_send_entry::<false>(wr, entry, held, none);
                } else {
                    self.post_send_entry::<true>(wr, entry, held, remote);
                }
                #[cfg(test)]
                crate::probe::count(crate::probe::Path::StraightPost);
                return true;
            }
        }
        let wqe = SqWqe {
            wr_id: wr.wr_id,
            op,
            flags: WqeFlags(wr.flags.wqe_bits()),
            imm,
            len,
            remote_addr: remote.addr,
            rkey: remote.rkey,
            compare_add,
            swap,
            data,
        };
        self.post_wqe_inlined(&wqe, held, Some(rd_atomic));
        #[cfg(test)]
        crate::probe::count(crate::probe::Path::StraightPost);
        true
    }

    /// A Send of element `s` with `flags` (the verbs C ABI's most common post), compiled
    /// into its caller: [`Qp::post_send`] of `SendWr::new(wr_id, SendOp::Send, &[*s])`,
    /// except that an element of at most one inline staging row (the QP's
    /// `max_inline_data`, rounded up to 64 bytes) in a registered buffer — private memory,
    /// whose bytes would be copied into the region's shadow — is copied into the request's
    /// staging row instead, as inline data is: the request then holds no region (not
    /// counted in flight, nothing to release when it retires). Only the common case is
    /// here; anything else (a check that fails, a full queue, `INLINE` in `flags`) goes to
    /// [`Qp::post_send`], which does it or says why not.
    #[doc(hidden)]
    #[inline(always)]
    pub fn post_send_single(&mut self, wr_id: u64, flags: SendFlags, s: &Sge<'_>) -> Result<()> {
        if !self.straight_post_open()
            || !self.sge_ok(s, false)
            || flags.contains(SendFlags::INLINE)
            || u64::from(s.len) > MAX_MESSAGE
        {
            return self.post_send_general(wr_id, flags, s);
        }
        let len = s.len;
        let staged = match (s.mr.private_bytes(), self.inline) {
            (Some(bytes), Some(block)) if u64::from(len).wrapping_sub(1) < self.inline_row => {
                let off = block.off + self.sq_row * self.inline_row;
                Mem::copy_inlined(bytes, s.offset, &self.mem, off, u64::from(len))
                    .ok()
                    .map(|()| off)
            }
            _ => None,
        };
        let (entry, held) = match staged {
            Some(off) => (
                SgeEntry {
                    off,
                    len,
                    mr: NO_MR,
                },
                &[][..],
            ),
            None => match s.mr.src_off(s.offset, u64::from(len)) {
                Ok(off) => (
                    SgeEntry {
                        off,
                        len,
                        mr: s.mr.index,
                    },
                    std::slice::from_ref(s),
                ),
                Err(_) => return self.post_send_general(wr_id, flags, s),
            },
        };
        // (The request as `post_send` sees it: the straight post reads its ID and flags.)
        let wr = SendWr {
            wr_id,
            op: SendOp::Send,
            data: Data::Sgl(&[]),
            flags,
        };
        self.post_send_entry::<false>(&wr, entry, held, RemoteAddr::default());
        Ok(())
    }

    /// [`Qp::post_send_single`]'s way out: the request through [`Qp::post_send`].
    #[cold]
    #[inline(never)]
    fn post_send_general(&mut self, wr_id: u64, flags: SendFlags, s: &Sge<'_>) -> Result<()> {
        self.post_send(&SendWr::new(wr_id, SendOp::Send, std::slice::from_ref(s)).flags(flags))
    }

    /// Binds type 1 memory window `mw` (the Bind Memory Window verb, `ibv_bind_mw`) over
    /// `bind` and returns its new R_Key (also [`Mw::rkey`] from now on): the previous key
    /// stops working when the bind executes. The bind is posted on this QP's send queue and
    /// executed in order with its other work requests; it completes with
    /// [`WcOpcode::BindMw`](crate::WcOpcode::BindMw) if `flags` has `SIGNALED`, or with
    /// [`WcStatus::MwBindErr`](crate::WcStatus::MwBindErr) (the QP goes to Error) if the
    /// region is not live, lacks `MW_BIND`, the window leaves the region or its rights
    /// exceed the region's. A length of 0 unbinds the window. The window can then be used
    /// through any QP of its protection domain.
    ///
    /// # Errors
    /// As [`Qp::post_send`]; [`Error::InvalidArgument`] for a type 2 window (bind those
    /// with [`SendOp::BindMw`]) or a window of another protection domain,
    /// [`Error::ForeignObject`] for a window of another context.
    pub fn bind_mw(
        &mut self,
        mw: &mut Mw,
        wr_id: u64,
        bind: MwBind,
        flags: SendFlags,
    ) -> Result<u32> {
        if !Arc::ptr_eq(&mw.shared, &self.shared) {
            return Err(Error::ForeignObject {
                what: "the memory window",
            });
        }
        if mw.kind != MwType::One {
            return Err(Error::invalid(
                "memory window",
                "a type 2 window is bound with a SendOp::BindMw work request",
            ));
        }
        if mw.pdn != self.pdn {
            return Err(Error::invalid(
                "memory window",
                "a window of another protection domain than the QP's",
            ));
        }
        let rkey = mw.next_rkey();
        let wr = SendWr::new(wr_id, SendOp::BindMw { rkey, bind }, &[]).flags(flags);
        let mut wqe = self.prepare_send(&wr)?;
        wqe.swap &= !MW_TYPE2_BIT;
        self.post_wqe(&wqe, &[]);
        mw.rkey = rkey;
        Ok(rkey)
    }

    /// Queues a prepared WQE whose registered elements are `sgl` (counted in flight here).
    fn post_wqe(&mut self, wqe: &SqWqe, sgl: &[Sge<'_>]) {
        self.post_wqe_inlined(wqe, sgl, None);
    }

    /// [`Qp::post_wqe`], compiled into its caller; `rd_atomic`: whether `wqe` is a Read or
    /// an Atomic, when the caller knows (the engine then need not look).
    #[inline(always)]
    fn post_wqe_inlined(&mut self, wqe: &SqWqe, sgl: &[Sge<'_>], rd_atomic: Option<bool>) {
        self.count_posted();
        // When this call may run the engine (`Device::run_for_post`: inline mode, or poll
        // mode with the engine thread stepped back for this thread's polls): hand the WQE
        // straight to the SQ Logic and send it now, counting its elements under the token
        // (no locked instruction). Otherwise (the engine thread running, or the engine
        // busy elsewhere) it goes through the send ring like any other, counted before it
        // is pushed.
        let (index, pushed) = (self.index, self.sq_pushed);
        let direct = self.shared.run_for_post(
            #[inline(always)]
            |e| {
                count_held(sgl);
                let rd_atomic = rd_atomic.unwrap_or_else(|| wqe.op.is_rd_atomic());
                debug_assert_eq!(rd_atomic, wqe.op.is_rd_atomic());
                e.post_direct(index, wqe, pushed, rd_atomic)
            },
        );
        if let Some(taken) = direct {
            debug_assert!(taken, "a live QP takes its WQEs");
            return;
        }
        self.post_through_ring(*wqe, sgl);
    }

    /// Send `wr` (`WRITE`: RDMA Write `wr` to `remote`) of one element `entry`
    /// (registered, `sgl` its one element, or the request's inline staging row, `sgl`
    /// empty), as [`Qp::post_wqe_inlined`] posts its WQE — except that the engine's
    /// straight post (`Engine::post_send_straight`) gets the values, not a WQE: the WQE is
    /// built only where it declines, or where the engine cannot be run now.
    #[inline(always)]
    fn post_send_entry<const WRITE: bool>(
        &mut self,
        wr: &SendWr<'_>,
        entry: SgeEntry,
        sgl: &[Sge<'_>],
        remote: RemoteAddr,
    ) {
        self.count_posted();
        let wqe = move || {
            let flags = WqeFlags(wr.flags.wqe_bits());
            if WRITE {
                SqWqe::write_of(wr.wr_id, flags, entry, remote.addr, remote.rkey)
            } else {
                SqWqe::send_of(wr.wr_id, flags, entry)
            }
        };
        let (index, pushed) = (self.index, self.sq_pushed);
        let direct = self.shared.run_for_post(
            #[inline(always)]
            |e| {
                count_held(sgl);
                e.post_send_straight::<WRITE>(index, pushed, wr, entry, remote)
                    || e.post_direct(index, &wqe(), pushed, false)
            },
        );
        if let Some(taken) = direct {
            debug_assert!(taken, "a live QP takes its WQEs");
            return;
        }
        self.post_through_ring(wqe(), sgl);
    }

    /// Pushes `wqe` (its registered elements `sgl`) on the send ring for the engine, and
    /// rings: a post when the engine cannot be run now.
    #[inline(always)]
    fn post_through_ring(&mut self, wqe: SqWqe, sgl: &[Sge<'_>]) {
        for s in sgl {
            s.mr.inflight.post_outside(1);
        }
        if self.sq.push(wqe).is_err() {
            unreachable!("the send ring holds max_send_wr WQEs and fewer are outstanding");
        }
        self.sq_pushed += 1;
        self.ring_and_kick();
    }

    /// Posts several send work requests (`ibv_post_send` with a list). Stops at the first
    /// that fails; returns how many were posted along with the error.
    ///
    /// In poll mode the list goes through the send ring with one doorbell. In inline mode
    /// each request is handed to the engine as [`Qp::post_send`] hands it, and is on the
    /// wire when this returns (the engine busy on another thread: through the send ring).
    ///
    /// # Errors
    /// As [`Qp::post_send`], with the number posted before the failing request.
    pub fn post_send_batch(
        &mut self,
        wrs: &[SendWr<'_>],
    ) -> std::result::Result<(), (usize, Error)> {
        // Inline mode: each request goes the direct way of `post_send` (the template path
        // when it can), which sends it at once while the engine is free.
        if self.shared.mode == EngineMode::Inline {
            for (done, wr) in wrs.iter().enumerate() {
                self.post_send(wr).map_err(|e| (done, e))?;
            }
            return Ok(());
        }
        // The whole list's elements are counted in flight first, one `fetch_add` per region
        // (not per element); those of the requests not posted are taken back.
        count_outside(wrs, true);
        let mut done = 0;
        for wr in wrs {
            if let Err(e) = self.post_send_one(wr) {
                count_outside(&wrs[done..], false);
                if done > 0 {
                    self.ring_and_kick();
                }
                return Err((done, e));
            }
            done += 1;
        }
        if done > 0 {
            self.ring_and_kick();
        }
        Ok(())
    }

    fn ring_and_kick(&self) {
        self.shared.notify(self.index);
    }

    fn post_send_one(&mut self, wr: &SendWr<'_>) -> Result<()> {
        // (Its elements were counted in flight by the caller.)
        let wqe = self.prepare_send(wr)?;
        if self.sq.push(wqe).is_err() {
            unreachable!("the send ring holds max_send_wr WQEs and fewer are outstanding");
        }
        self.count_posted();
        self.sq_pushed += 1;
        Ok(())
    }

    /// Counts one more send request posted, and moves on to the next row.
    #[inline(always)]
    fn count_posted(&mut self) {
        self.sq_posted += 1;
        self.sq_row += 1;
        if self.sq_row == u64::from(self.caps.max_send_wr) {
            self.sq_row = 0;
        }
    }

    /// Checks a send work request and turns it into a WQE: inline data staged, gather lists
    /// written. Nothing is queued yet, and nothing counted in flight: the caller counts
    /// [`counted_sgl`] as it queues the WQE (under the engine token, or outside it).
    fn prepare_send(&mut self, wr: &SendWr<'_>) -> Result<SqWqe> {
        self.prepare(wr)
    }

    /// [`Qp::prepare_send`]'s body, compiled into each caller.
    #[inline(always)]
    fn prepare(&mut self, wr: &SendWr<'_>) -> Result<SqWqe> {
        let state = self.qshared.state();
        if matches!(state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(Error::InvalidState {
                operation: "post a send",
                state,
                hint: "sends can be posted once the QP is in RTS",
            });
        }
        if self.sq_posted - self.sq_retired >= u64::from(self.caps.max_send_wr) {
            self.refresh_sq();
            if self.sq_posted - self.sq_retired >= u64::from(self.caps.max_send_wr) {
                return Err(Error::QueueFull {
                    queue: "send queue",
                    depth: self.caps.max_send_wr,
                });
            }
        }
        let (op, imm, remote, compare_add, swap) = match wr.op {
            SendOp::Send => (WqeOp::Send, 0, None, 0, 0),
            SendOp::SendWithImm(i) => (WqeOp::SendImm, i, None, 0, 0),
            SendOp::RdmaWrite(r) => (WqeOp::Write, 0, Some(r), 0, 0),
            SendOp::RdmaWriteWithImm(r, i) => (WqeOp::WriteImm, i, Some(r), 0, 0),
            SendOp::RdmaRead(r) => (WqeOp::Read, 0, Some(r), 0, 0),
            SendOp::CompareSwap {
                remote,
                compare,
                swap,
            } => (WqeOp::CompareSwap, 0, Some(remote), compare, swap),
            SendOp::FetchAdd { remote, add } => (WqeOp::FetchAdd, 0, Some(remote), add, 0),
            SendOp::SendWithInv(rkey) => (WqeOp::SendInv, 0, Some(key_only(rkey)), 0, 0),
            SendOp::BindMw { rkey, bind } => (
                WqeOp::BindMw,
                bind.lkey,
                Some(RemoteAddr {
                    addr: bind.addr,
                    rkey,
                }),
                bind.len,
                u64::from(bind.access.bits()) | MW_TYPE2_BIT,
            ),
            SendOp::LocalInv(rkey) => (WqeOp::LocalInv, 0, Some(key_only(rkey)), 0, 0),
        };
        if op.is_local() {
            let empty = match wr.data {
                Data::Sgl(sgl) => sgl.is_empty(),
                Data::Inline(bytes) => bytes.is_empty(),
            };
            if !empty {
                return Err(Error::invalid(
                    "data",
                    "memory window binds and Local Invalidates carry no data: pass an empty list",
                ));
            }
        }
        if op.is_rd_atomic() && self.qshared.max_rd_atomic.load(Ordering::Relaxed) == 0 {
            return Err(Error::invalid(
                "operation",
                "the QP's initiator depth (max_rd_atomic) is 0: set it to at least 1 on RTR -> RTS to post RDMA Reads and Atomics",
            ));
        }
        let inline = matches!(wr.data, Data::Inline(_)) || wr.flags.contains(SendFlags::INLINE);
        if inline && op.is_rd_atomic() {
            return Err(Error::invalid(
                "data",
                "RDMA Reads and Atomics have a result buffer, not inline data",
            ));
        }
        // The row of this request in the inline staging area and the gather table.
        let row = || self.sq_row;
        debug_assert_eq!(
            self.sq_row,
            self.sq_posted % u64::from(self.caps.max_send_wr)
        );
        let (data, len) = match wr.data {
            Data::Inline(bytes) => (
                self.stage_inline(row(), bytes.len(), |dst, mem| mem.write(dst, bytes).is_ok())?,
                bytes.len() as u64,
            ),
            // The common case, one element in registered memory: checked and located in
            // one pass (as `check_sgl` and `gather_loc` do for a longer list).
            Data::Sgl([s]) if !inline => (
                DataLoc::Single(self.locate_one(s, op.is_rd_atomic(), "gather list")?),
                u64::from(s.len),
            ),
            Data::Sgl(sgl) => {
                let needs_write = op.is_rd_atomic();
                let len =
                    self.check_sgl(sgl, self.caps.max_send_sge, needs_write, "gather list")?;
                if inline {
                    // Copy the gather list's bytes now; the buffers are free on return.
                    let data = self.stage_inline(row(), len as usize, |mut dst, m| {
                        let mut buf = [0u8; 256];
                        for s in sgl {
                            let mut done = 0u64;
                            while done < u64::from(s.len) {
                                let n = (u64::from(s.len) - done).min(buf.len() as u64) as usize;
                                if s.mr.read_at(s.offset + done, &mut buf[..n]).is_err()
                                    || m.write(dst, &buf[..n]).is_err()
                                {
                                    return false;
                                }
                                done += n as u64;
                                dst += n as u64;
                            }
                        }
                        true
                    })?;
                    (data, len)
                } else {
                    (self.gather_loc(sgl, row(), op.is_rd_atomic())?, len)
                }
            }
        };
        if len > MAX_MESSAGE {
            return Err(Error::invalid(
                "message length",
                format!("{len} bytes; a message is at most 2 GiB"),
            ));
        }
        if let Some(r) = remote {
            if op.is_atomic() {
                if r.addr % 8 != 0 {
                    return Err(Error::invalid(
                        "remote address",
                        format!(
                            "{:#x} is not 8-byte aligned: atomics work on aligned 64-bit words",
                            r.addr
                        ),
                    ));
                }
                if len != 8 {
                    return Err(Error::invalid(
                        "data",
                        format!("an Atomic returns 8 bytes; its scatter list holds {len}"),
                    ));
                }
            }
        }
        let mut flags = 0;
        if wr.flags.contains(SendFlags::SIGNALED) {
            flags |= WqeFlags::SIGNALED;
        }
        if wr.flags.contains(SendFlags::FENCE) {
            flags |= WqeFlags::FENCE;
        }
        if wr.flags.contains(SendFlags::SOLICITED) {
            flags |= WqeFlags::SOLICITED;
        }
        let remote = remote.unwrap_or_default();
        let wqe = SqWqe {
            wr_id: wr.wr_id,
            op,
            flags: WqeFlags(flags),
            imm,
            len: len as u32,
            remote_addr: remote.addr,
            rkey: remote.rkey,
            compare_add,
            swap,
            data,
        };
        Ok(wqe)
    }

    /// Copies `len` bytes into inline staging row `row` with `fill(offset, mem)`.
    fn stage_inline(
        &self,
        row: u64,
        len: usize,
        fill: impl FnOnce(u64, &crate::mem::Mem) -> bool,
    ) -> Result<DataLoc> {
        if len > self.caps.max_inline_data as usize {
            return Err(Error::invalid(
                "inline data",
                format!(
                    "{len} bytes; this QP was created with max_inline_data {}",
                    self.caps.max_inline_data
                ),
            ));
        }
        if len == 0 {
            return Ok(DataLoc::Empty);
        }
        let Some(block) = self.inline else {
            return Err(Error::invalid(
                "inline data",
                "this QP was created with max_inline_data 0",
            ));
        };
        let off = block.off + row * self.inline_row;
        if !fill(off, &self.mem) {
            return Err(Error::invalid(
                "inline data",
                "the gather list could not be read",
            ));
        }
        Ok(DataLoc::Single(SgeEntry {
            off,
            len: len as u32,
            mr: NO_MR,
        }))
    }

    /// Checks a scatter/gather list; returns its total length.
    fn check_sgl(
        &self,
        sgl: &[Sge<'_>],
        max: u32,
        needs_write: bool,
        what: &'static str,
    ) -> Result<u64> {
        if sgl.len() > max as usize {
            return Err(Error::invalid(
                what,
                format!("{} elements; this QP takes at most {max}", sgl.len()),
            ));
        }
        let mut len = 0u64;
        for s in sgl {
            self.check_sge(s, needs_write, what)?;
            len += u64::from(s.len);
        }
        Ok(len)
    }

    /// Checks one element of a list (its bounds were checked when it was made): a region
    /// of this context and of the QP's protection domain, writable by the engine if
    /// `needs_write`.
    #[inline(always)]
    fn check_sge(&self, s: &Sge<'_>, needs_write: bool, what: &'static str) -> Result<()> {
        if !Arc::ptr_eq(&s.mr.shared, &self.shared) {
            return Err(foreign_region());
        }
        if s.mr.pdn != self.pdn {
            return Err(other_pd_region(what));
        }
        if needs_write && !s.mr.access().contains(AccessFlags::LOCAL_WRITE) {
            return Err(not_writable(what, s.mr.lkey()));
        }
        Ok(())
    }

    /// Whether [`Qp::check_sge`] passes `s` (no error built).
    #[inline(always)]
    fn sge_ok(&self, s: &Sge<'_>, needs_write: bool) -> bool {
        Arc::ptr_eq(&s.mr.shared, &self.shared)
            && s.mr.pdn == self.pdn
            && (!needs_write || s.mr.access().contains(AccessFlags::LOCAL_WRITE))
    }

    /// A list of one element (`s`): checked as [`Qp::check_sgl`] does (a one-element list
    /// never exceeds the element limit, which is at least 1), then located as
    /// [`Qp::gather_loc`] does: where the engine writes into it (`dest`: a result or
    /// receive buffer, which needs `LOCAL_WRITE`), or reads from it (a registered
    /// buffer's bytes copied into its shadow now).
    #[inline(always)]
    fn locate_one(&self, s: &Sge<'_>, dest: bool, what: &'static str) -> Result<SgeEntry> {
        debug_assert!(self.caps.max_send_sge >= 1 && self.caps.max_recv_sge >= 1);
        self.check_sge(s, dest, what)?;
        let off = if dest {
            s.mr.dst_off(s.offset)
        } else {
            s.mr.src_off(s.offset, u64::from(s.len))?
        };
        Ok(SgeEntry {
            off,
            len: s.len,
            mr: s.mr.index,
        })
    }

    /// Where the engine finds a list: inline in the WQE for one element, else a table row.
    /// A gather list's registered buffers are copied into their shadows now; a result
    /// buffer (`dest`: the scatter list of a Read or Atomic) is written in place.
    fn gather_loc(&self, sgl: &[Sge<'_>], row: u64, dest: bool) -> Result<DataLoc> {
        let mut offs = [0u64; crate::qp::MAX_SGE as usize];
        for (s, o) in sgl.iter().zip(offs.iter_mut()) {
            *o = if dest {
                s.mr.dst_off(s.offset)
            } else {
                s.mr.src_off(s.offset, u64::from(s.len))?
            };
        }
        let mut i = 0;
        let mut entry = |s: &Sge<'_>| {
            let e = SgeEntry {
                off: offs[i],
                len: s.len,
                mr: s.mr.index,
            };
            i += 1;
            e
        };
        Ok(match sgl {
            [] => DataLoc::Empty,
            [s] => DataLoc::Single(entry(s)),
            many => self.write_table(0, row, self.caps.max_send_sge, many.iter().map(entry))?,
        })
    }

    /// Writes a multi-element list into row `row` of the private table at `base`.
    fn write_table(
        &self,
        base: u64,
        row: u64,
        width: u32,
        entries: impl Iterator<Item = SgeEntry>,
    ) -> Result<DataLoc> {
        let table = base + row * u64::from(width) * SGE_ENTRY_LEN;
        let mut n = 0;
        for (i, e) in entries.enumerate() {
            self.tables
                .write(table + i as u64 * SGE_ENTRY_LEN, &e.to_bytes())
                .map_err(|_| Error::invalid("scatter/gather list", "longer than its table row"))?;
            n += 1;
        }
        Ok(DataLoc::Table { table, n })
    }

    /// Posts a receive work request (`ibv_post_recv`). Allowed from Init on; in Error it
    /// completes with a flush error.
    ///
    /// Post receives before the messages they take: a Send that arrives when none is posted
    /// is refused with an RNR Nak and sent again only after the QP's `min_rnr_timer`
    /// ([`QpAttr::min_rnr_timer`](crate::QpAttr::min_rnr_timer)), which costs that wait per
    /// message and shows nowhere else than in the counters
    /// ([`Stats::rnr_naks_sent`](crate::Stats::rnr_naks_sent), the peer's
    /// `rnr_naks_received`, `shmhca stat`).
    ///
    /// # Errors
    /// [`Error::InvalidState`] in Reset, [`Error::QueueFull`] when `max_recv_wr` receives
    /// are outstanding, [`Error::InvalidArgument`] for too many elements or a region
    /// without `LOCAL_WRITE`, [`Error::ForeignObject`].
    pub fn post_recv(&mut self, wr: &RecvWr<'_>) -> Result<()> {
        self.post_recv_with(wr, |mr, offset| mr.dst_off(offset))
    }

    /// [`Qp::post_recv`] of a receive of one element, `s`, compiled into its caller (the
    /// verbs C ABI's path for a receive of one element), with a registered buffer's offset
    /// found in line too. The element comes by value and no [`RecvWr`] is built unless the
    /// common case does not apply: a request in memory for the general path, made up front,
    /// cost its caller six stores and three loads per receive.
    #[doc(hidden)]
    #[inline(always)]
    pub fn post_recv_one_inlined(&mut self, wr_id: u64, s: Sge<'_>) -> Result<()> {
        if self.post_recv_fast(wr_id, &s, |mr, offset| mr.dst_off_inlined(offset)) {
            return Ok(());
        }
        self.post_recv_one_general(wr_id, s)
    }

    /// [`Qp::post_recv_one_inlined`] when the common case does not apply.
    #[cold]
    #[inline(never)]
    fn post_recv_one_general(&mut self, wr_id: u64, s: Sge<'_>) -> Result<()> {
        self.post_recv_general(&RecvWr::new(wr_id, std::slice::from_ref(&s)))
    }

    /// [`Qp::post_recv`]'s body, with `dst_off` locating an element's first byte: the
    /// common receive in line ([`Qp::post_recv_fast`]); any other, and every refusal, by
    /// [`Qp::post_recv_general`].
    #[inline(always)]
    fn post_recv_with(
        &mut self,
        wr: &RecvWr<'_>,
        dst_off: impl FnOnce(&crate::verbs::mr::Mr, u64) -> u64,
    ) -> Result<()> {
        if let [s] = wr.sgl {
            if self.post_recv_fast(wr.wr_id, s, dst_off) {
                return Ok(());
            }
        }
        self.post_recv_general(wr)
    }

    /// Posts the common receive — one element (`s`), the QP's own receive queue, RTS or
    /// RTR, room known, nothing to tell the engine, the element good — and returns true;
    /// false for any other, with nothing changed: [`Qp::post_recv_general`] then checks
    /// everything again in its order.
    #[inline(always)]
    fn post_recv_fast(
        &mut self,
        wr_id: u64,
        s: &Sge<'_>,
        dst_off: impl FnOnce(&crate::verbs::mr::Mr, u64) -> u64,
    ) -> bool {
        // SYNC: Relaxed: as in `post_recv_general`.
        if !(self.srq.is_none()
            && self.rq_room()
            && matches!(self.qshared.state(), QpState::Rts | QpState::Rtr)
            && !self.qshared.rq_watch.load(Ordering::Relaxed)
            && self.sge_ok(s, true))
        {
            return false;
        }
        let e = SgeEntry {
            off: dst_off(s.mr, s.offset),
            len: s.len,
            mr: s.mr.index,
        };
        let wqe = RqWqe {
            wr_id,
            data: DataLoc::Single(e),
        };
        // Counted under the engine token (a plain store) when this call may run the
        // engine, else with a `fetch_add`; either way before the WQE is published, so that
        // the engine's retire finds it counted.
        let counted = self
            .shared
            .run_for_post(
                #[inline(always)]
                |_| s.mr.inflight.post_held(1),
            )
            .is_some();
        if !counted {
            s.mr.inflight.post_outside(1);
        }
        if self.rq.push(wqe).is_err() {
            unreachable!("the receive ring holds max_recv_wr WQEs and fewer are outstanding");
        }
        self.rq_posted += 1;
        true
    }

    /// [`Qp::post_recv`] of any receive: every check in order, then the post.
    #[inline(never)]
    fn post_recv_general(&mut self, wr: &RecvWr<'_>) -> Result<()> {
        if self.srq.is_some() {
            return Err(Error::invalid(
                "post_recv",
                "this QP takes its receives from a shared receive queue: post them with Srq::post_recv",
            ));
        }
        let state = self.qshared.state();
        if !state.can_post_recv() {
            return Err(Error::InvalidState {
                operation: "post a receive",
                state,
                hint: "receives can be posted once the QP is in Init",
            });
        }
        if self.rq_posted - self.rq_retired >= u64::from(self.caps.max_recv_wr) {
            self.refresh_rq();
            if self.rq_posted - self.rq_retired >= u64::from(self.caps.max_recv_wr) {
                return Err(Error::QueueFull {
                    queue: "receive queue",
                    depth: self.caps.max_recv_wr,
                });
            }
        }
        let entry = |s: &Sge<'_>| SgeEntry {
            off: s.mr.dst_off(s.offset),
            len: s.len,
            mr: s.mr.index,
        };
        let data = match wr.sgl {
            [] => DataLoc::Empty,
            [s] => DataLoc::Single(self.locate_one(s, true, "scatter list")?),
            many => {
                self.check_sgl(many, self.caps.max_recv_sge, true, "scatter list")?;
                let row = self.rq_posted % u64::from(self.caps.max_recv_wr);
                self.write_table(
                    self.scatter_at,
                    row,
                    self.caps.max_recv_sge,
                    many.iter().map(entry),
                )?
            }
        };
        let wqe = RqWqe {
            wr_id: wr.wr_id,
            data,
        };
        // The doorbell is needed only when the engine has something to do about this
        // receive: report credits to a requester that knows of few (see
        // `QpShared::rq_watch`; a sleeping engine thread is woken for that), or flush it in
        // the Error state (any state but RTR and RTS, to keep the rare ones simple: a
        // receiver that never sends — perftest's bandwidth servers — stays in RTR).
        // Otherwise nothing is urgent until a message arrives for it.
        // SYNC: Relaxed: the WQE itself is published by the receive ring's Release push;
        // the flag only decides whether to tell the engine.
        let watch = !matches!(state, QpState::Rts | QpState::Rtr)
            || self.qshared.rq_watch.load(Ordering::Relaxed);
        // When this call may run the engine (`Device::run_for_post`): count the elements,
        // queue the WQE and (if watched) put the QP in the engine's active set, all under
        // the engine token — no locked instruction and no doorbell. Else (the engine
        // thread running, or the engine busy elsewhere) count with a `fetch_add`, queue,
        // and ring.
        let (rq, index) = (&mut self.rq, self.index);
        let held = self
            .shared
            .run_for_post(|e| {
                count_held(wr.sgl);
                if rq.push(wqe).is_err() {
                    unreachable!(
                        "the receive ring holds max_recv_wr WQEs and fewer are outstanding"
                    );
                }
                if watch {
                    e.wake_qp(index);
                }
            })
            .is_some();
        if !held {
            // (The engine runs elsewhere: the WQE was not queued above.)
            for s in wr.sgl {
                s.mr.inflight.post_outside(1);
            }
            if self.rq.push(wqe).is_err() {
                unreachable!("the receive ring holds max_recv_wr WQEs and fewer are outstanding");
            }
            if watch {
                self.shared.doorbell.ring(self.index);
            }
        }
        self.rq_posted += 1;
        if watch {
            // A thread asleep on the kick words (the engine thread, or an inline waiter)
            // must look at the QP.
            self.shared.kick();
        }
        Ok(())
    }
}

/// [`Qp::post_send_straight`]'s kinds of request: a Send (the caller looked), another
/// Send or an RDMA Write, an RDMA Read or an Atomic.
const SEND: u8 = 0;
const WRITE: u8 = 1;
const RD_ATOMIC: u8 = 2;

/// The elements of a send work request that point into registered memory and are counted
/// in flight until it retires: its gather (or result) list, unless its data is copied at
/// post time (inline).
fn counted_sgl<'a>(wr: &SendWr<'a>) -> &'a [Sge<'a>] {
    match wr.data {
        Data::Sgl(sgl) if !wr.flags.contains(SendFlags::INLINE) => sgl,
        _ => &[],
    }
}

/// Counts the elements of a list in flight, under the engine token (plain stores).
#[inline(always)]
fn count_held(sgl: &[Sge<'_>]) {
    match sgl {
        [] => {}
        [s] => s.mr.inflight.post_held(1),
        many => {
            for s in many {
                s.mr.inflight.post_held(1);
            }
        }
    }
}

/// Counts the registered elements of `wrs` in flight outside the engine token (`add`), or
/// takes them back (requests that were not posted after all), with one read-modify-write
/// per region: regions are gathered in a small table (a list with more distinct regions
/// counts the overflow one element at a time).
fn count_outside(wrs: &[SendWr<'_>], add: bool) {
    const REGIONS: usize = 8;
    let mut regions: [(Option<&MrShared>, u32); REGIONS] = [(None, 0); REGIONS];
    let apply = |r: &MrShared, n: u32| {
        if add {
            r.post_outside(n);
        } else {
            r.unpost_outside(n);
        }
    };
    for s in wrs.iter().flat_map(|wr| counted_sgl(wr)) {
        let r: &MrShared = &s.mr.inflight;
        match regions
            .iter_mut()
            .find(|(e, _)| e.is_none_or(|e| std::ptr::eq(e, r)))
        {
            Some(slot) => *slot = (Some(r), slot.1 + 1),
            None => apply(r, 1),
        }
    }
    for (r, n) in regions {
        if let Some(r) = r {
            apply(r, n);
        }
    }
}

/// The error for an element over a region of another context.
#[cold]
fn foreign_region() -> Error {
    Error::ForeignObject {
        what: "a memory region in the list",
    }
}

/// The error for an element over a region of another protection domain.
#[cold]
fn other_pd_region(what: &'static str) -> Error {
    Error::invalid(what, "a memory region of another protection domain")
}

/// The error for a result or receive buffer in a region without `LOCAL_WRITE`.
#[cold]
fn not_writable(what: &'static str, lkey: u32) -> Error {
    Error::invalid(
        what,
        format!(
            "memory region {lkey:#x} lacks LOCAL_WRITE, which the engine needs to write results or received data into it"
        ),
    )
}

/// Bit of a bind WQE's `swap` marking a type 2 window's bind (the low 8 bits are rights).
const MW_TYPE2_BIT: u64 = 0x100;

/// A key alone, for the work requests that carry one (Send with Invalidate, Local
/// Invalidate).
fn key_only(rkey: u32) -> RemoteAddr {
    RemoteAddr { addr: 0, rkey }
}

impl Drop for Qp {
    fn drop(&mut self) {
        let (index, pdn, inline, srq) = (self.index, self.pdn, self.inline, self.srq);
        self.shared.engine.with(|e| {
            e.remove_qp(index);
            if let Some(i) = srq {
                let crate::context::Resources { srqs, mrs, pds, .. } = &mut e.res;
                srqs.detach(i, mrs, pds);
            }
            if let (Some(b), Some(arena)) = (inline, e.res.pds.get_mut(pdn)) {
                arena.free(b);
            }
            e.res.pds.unhold(pdn);
        });
    }
}

impl std::fmt::Debug for Qp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qp")
            .field("qpn", &self.qpn)
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::slot::{KIND_INLINE, RxPacket};
    use crate::{Context, SendOp};

    /// The checks at post time, on one-element lists (the fast path that checks and
    /// locates the element in one pass) and on two-element lists (the general path) alike:
    /// a region of another context or protection domain, and a result or receive buffer
    /// without `LOCAL_WRITE`, are refused with an error naming the problem, and nothing is
    /// posted or counted in flight.
    #[test]
    fn one_element_lists_are_checked_like_longer_ones() {
        use crate::{AccessFlags, Error, RecvWr};
        let build = || {
            Context::builder()
                .mode(EngineMode::Inline)
                .progress(crate::Progress::Manual)
                .huge_pages(shmhca_rings::HugePages::Never)
                .build()
                .unwrap()
        };
        let (ctx, other) = (build(), build());
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let (link, _ends, _arena) = crate::raw_peer::raw_peer_link(&ctx, 64, 9, 4096);
        let caps = QpCaps {
            max_send_sge: 2,
            max_recv_sge: 2,
            ..QpCaps::default()
        };
        let mut qp = ctx.create_qp(&pd, &cq, &cq, caps).unwrap();
        crate::raw_peer::connect_to_raw_peer(&mut qp, link, 9, 0, false);
        let good = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let other_pd = ctx.alloc_pd().unwrap();
        let in_other_pd = other_pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let opd = other.alloc_pd().unwrap();
        let in_other_ctx = opd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let read_only = pd.alloc_mr(64, AccessFlags::NONE).unwrap();
        let remote = good.remote(0);
        type Check = fn(&Error) -> bool;
        let cases: [(&str, &crate::Mr, Check, bool); 3] = [
            // (what, the bad region, the error wanted, whether only buffers the engine
            // writes refuse it)
            (
                "another context's region",
                &in_other_ctx,
                |e| matches!(e, Error::ForeignObject { .. }),
                false,
            ),
            (
                "another domain's region",
                &in_other_pd,
                |e| {
                    matches!(e, Error::InvalidArgument { .. })
                        && e.to_string().contains("another protection domain")
                },
                false,
            ),
            (
                "a region without LOCAL_WRITE",
                &read_only,
                |e| {
                    matches!(e, Error::InvalidArgument { .. })
                        && e.to_string().contains("lacks LOCAL_WRITE")
                },
                true,
            ),
        ];
        for (case, bad, refused, only_written) in cases {
            let lists = [
                vec![bad.sge(8, 8).unwrap()],
                vec![good.sge(0, 8).unwrap(), bad.sge(8, 8).unwrap()],
            ];
            for list in &lists {
                let n = list.len();
                let mut posts = vec![
                    (
                        "Read",
                        qp.post_send(&SendWr::new(0, SendOp::RdmaRead(remote), list)),
                    ),
                    ("receive", qp.post_recv(&RecvWr::new(0, list))),
                ];
                if !only_written {
                    posts.push(("Send", qp.post_send(&SendWr::new(0, SendOp::Send, list))));
                }
                for (what, r) in posts {
                    match r {
                        Err(e) => assert!(refused(&e), "{case}, {what} of {n}: {e}"),
                        Ok(()) => panic!("{case}, {what} of {n}: accepted"),
                    }
                }
                assert_eq!(qp.sq_outstanding(), 0, "{case}, list of {n}");
                for mr in [&good, &in_other_pd, &in_other_ctx, &read_only] {
                    assert_eq!(mr.in_flight(), 0, "{case}, list of {n}");
                }
            }
        }
    }

    /// An inline-mode context (manual progress) with a QP in RTS connected to a raw peer
    /// (QPN 9) that the test reads packets from.
    struct RawSetup {
        qp: Qp,
        ends: crate::raw_peer::RawEnds,
        _arena: crate::mem::Mem,
        _cq: crate::Cq,
        _pd: crate::Pd,
        _ctx: Context,
    }

    impl RawSetup {
        fn new() -> RawSetup {
            let ctx = Context::builder()
                .mode(EngineMode::Inline)
                .progress(crate::Progress::Manual)
                .huge_pages(shmhca_rings::HugePages::Never)
                .build()
                .unwrap();
            let pd = ctx.alloc_pd().unwrap();
            let cq = ctx.create_cq(16).unwrap();
            let (link, ends, arena) = crate::raw_peer::raw_peer_link(&ctx, 64, 9, 4096);
            let mut qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
            crate::raw_peer::connect_to_raw_peer(&mut qp, link, 9, 0, false);
            RawSetup {
                qp,
                ends,
                _arena: arena,
                _cq: cq,
                _pd: pd,
                _ctx: ctx,
            }
        }
    }

    /// Takes every packet the raw peer has received: appends the PSN and inline payload of
    /// each request (all must carry their payload inline) to `payloads`, skips the rest
    /// (the Ack announcing the QP's receive credits).
    fn receive_inline(ends: &mut crate::raw_peer::RawEnds, payloads: &mut Vec<(u32, Vec<u8>)>) {
        while let Some(slot) = ends.rx.pop().unwrap() {
            let rx = RxPacket::parse(&slot, &[]).unwrap();
            if !rx.info.request {
                continue;
            }
            assert_eq!(slot.kind, KIND_INLINE);
            let h = slot.hdr_len as usize;
            let bytes = slot.data[h..h + slot.payload_len as usize].to_vec();
            payloads.push((rx.psn().get(), bytes));
        }
    }

    /// [`Qp::post_send_single`], the verbs C ABI's Send of one element: up to a staging
    /// row's bytes (64 here) of a registered buffer are copied into the request's inline
    /// staging at post time, so the request holds no region (none in flight) and sends the
    /// bytes posted, whatever the buffer holds afterwards; a longer element of the buffer,
    /// or an element of an arena region, is held in flight as [`Qp::post_send`] holds it.
    /// What it refuses, it refuses with `post_send`'s error (a region of another domain, a
    /// full send queue).
    #[test]
    fn a_single_send_stages_a_few_bytes_of_a_registered_buffer() {
        use crate::{AccessFlags, Error};
        let RawSetup {
            mut qp,
            mut ends,
            _pd: pd,
            _ctx: ctx,
            ..
        } = RawSetup::new();
        let buf = pd.reg_mr(vec![0u8; 4096], AccessFlags::NONE).unwrap();
        buf.write_at(
            0,
            b"staged, all 64 bytes of a row: ....................... the end",
        )
        .unwrap();
        let flags = SendFlags::SIGNALED;
        qp.post_send_single(1, flags, &buf.sge(0, 8).unwrap())
            .unwrap();
        qp.post_send_single(2, flags, &buf.sge(8, 24).unwrap())
            .unwrap();
        assert_eq!(buf.in_flight(), 0, "staged requests hold no region");
        buf.write_at(0, &[0xee; 64]).unwrap();
        let mut payloads = vec![];
        receive_inline(&mut ends, &mut payloads);
        let row = b"staged, all 64 bytes of a row: ....................... the end";
        assert_eq!(payloads, [(0, row[..8].to_vec()), (1, row[8..32].to_vec())]);
        // A whole row is staged too.
        qp.post_send_single(2, flags, &buf.sge(0, 64).unwrap())
            .unwrap();
        assert_eq!(buf.in_flight(), 0);

        // Longer than a row: through the shadow, held in flight until it retires.
        qp.post_send_single(3, flags, &buf.sge(0, 65).unwrap())
            .unwrap();
        assert_eq!(buf.in_flight(), 1);
        // An arena region has no shadow: held in flight, its bytes read in place.
        let arena = pd.alloc_mr(64, AccessFlags::NONE).unwrap();
        qp.post_send_single(4, flags, &arena.sge(0, 8).unwrap())
            .unwrap();
        assert_eq!(arena.in_flight(), 1);

        // Refused as `post_send` refuses it, nothing posted.
        let other_pd = ctx.alloc_pd().unwrap();
        let foreign = other_pd.reg_mr(vec![0u8; 64], AccessFlags::NONE).unwrap();
        let sge = foreign.sge(0, 8).unwrap();
        let single = qp.post_send_single(5, flags, &sge).unwrap_err();
        let general = qp
            .post_send(&SendWr::new(5, SendOp::Send, &[sge]).flags(flags))
            .unwrap_err();
        assert_eq!(single.to_string(), general.to_string());
        assert_eq!(foreign.in_flight(), 0);
        let posted = qp.sq_outstanding();
        assert_eq!(posted, 5);
        for i in posted..qp.caps().max_send_wr {
            qp.post_send_single(u64::from(i), flags, &buf.sge(0, 8).unwrap())
                .unwrap();
        }
        let full = qp.post_send_single(0, flags, &buf.sge(0, 8).unwrap());
        assert!(matches!(full, Err(Error::QueueFull { .. })), "{full:?}");
        assert_eq!(buf.in_flight(), 1, "only the longer element is held");
    }

    /// In inline mode a post list goes the direct way, request by request, when the
    /// engine is free (the send ring, a copy of each WQE in and out again, only while
    /// another thread holds the engine): every request is on the wire when the call
    /// returns, in posted order, and none went through the ring.
    #[test]
    fn an_inline_post_list_goes_out_directly() {
        let RawSetup {
            mut qp, mut ends, ..
        } = RawSetup::new();
        let bytes: Vec<[u8; 2]> = (0..5u8).map(|i| [i, 0xa5]).collect();
        let wrs: Vec<SendWr<'_>> = bytes
            .iter()
            .enumerate()
            .map(|(i, b)| SendWr::inline(i as u64, SendOp::Send, b))
            .collect();
        qp.post_send_batch(&wrs).unwrap();
        assert_eq!(qp.sq_pushed, 0, "no WQE went through the send ring");
        assert_eq!(qp.sq_outstanding(), 5);
        let mut payloads = vec![];
        receive_inline(&mut ends, &mut payloads);
        let want: Vec<_> = (0..5u32).map(|n| (n, vec![n as u8, 0xa5])).collect();
        assert_eq!(payloads, want);
    }

    /// Inline mode hands a post to the engine directly, after the WQEs still in the send
    /// ring (pushed there while another thread held the engine): the engine knows from the
    /// counts whether it must look at the ring, and posted order holds.
    #[test]
    fn a_direct_post_goes_after_the_wqes_in_the_send_ring() {
        let RawSetup {
            mut qp, mut ends, ..
        } = RawSetup::new();
        let mut payloads = vec![];
        for round in 0..2u8 {
            // As `post_send_one` queues (the engine was busy elsewhere): two WQEs in the ring.
            for i in 0..2 {
                let wqe = qp
                    .prepare_send(&SendWr::inline(0, SendOp::Send, &[round, i]))
                    .unwrap();
                qp.sq.push(wqe).unwrap();
                qp.count_posted();
                qp.sq_pushed += 1;
            }
            qp.post_send(&SendWr::inline(0, SendOp::Send, &[round, 2]))
                .unwrap();
            // The ring is empty now: this one may go straight out.
            qp.post_send(&SendWr::inline(0, SendOp::Send, &[round, 3]))
                .unwrap();
            receive_inline(&mut ends, &mut payloads);
        }
        let want: Vec<_> = (0..8u32)
            .map(|n| (n, vec![(n / 4) as u8, (n % 4) as u8]))
            .collect();
        assert_eq!(payloads, want);
    }

    /// A receive posted on a QP in RTR (perftest's bandwidth servers never leave it) gives
    /// the engine nothing to do, as in RTS: the poll after it takes the empty poll's
    /// shortcut. Before, every state but RTS rang the engine for each receive (the QP put
    /// in its active set: a full iteration per receive).
    #[test]
    fn a_receive_posted_in_rtr_gives_the_engine_nothing_to_do() {
        use crate::probe::{Path, taken};
        use crate::{AccessFlags, QpCaps, RecvWr, WorkCompletion};
        let ctx = crate::raw_peer::inline_context();
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(16).unwrap();
        let mut qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
        let (link, _ends, _arena) = crate::raw_peer::raw_peer_link(&ctx, 64, 0x2002, 4096);
        crate::raw_peer::raw_peer_to_rtr(&mut qp, link, 0x2002, false);
        let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        let mut wc = [WorkCompletion::default()];
        let mut post = |i: u64| {
            qp.post_recv(&RecvWr::new(i, &[mr.sge(64 * i, 64).unwrap()]))
                .unwrap();
        };
        post(0);
        // Whatever the first receive and the modify gave the engine, done.
        for _ in 0..8 {
            assert_eq!(cq.poll(&mut wc), 0);
        }
        let idle = taken(Path::IdlePoll);
        assert_eq!(cq.poll(&mut wc), 0);
        assert_eq!(taken(Path::IdlePoll), idle + 1, "the engine is idle");
        for i in 1..4 {
            post(i);
            assert_eq!(cq.poll(&mut wc), 0);
            assert_eq!(
                taken(Path::IdlePoll),
                idle + 1 + i,
                "receive {i} posted in RTR woke the engine"
            );
        }
    }

    /// Review 13: the flag `post_recv` reads (`QpShared::rq_watch`) says what the count the
    /// requester was told says. A Reset forgets that count (`Responder::start`: none told
    /// yet), so the flag must say "watch" again — `advertise`'s shortcut (the same count
    /// again: return) met the forgotten count already `None` and left the flag at "the
    /// requester knows of receives", which a later receive posted in RTR or RTS then
    /// trusted (no doorbell) until some credit report happened to change it.
    #[test]
    fn review13_a_reset_qp_watches_its_receives_again() {
        use crate::{AccessFlags, QpAttr, QpState, RecvWr, WorkCompletion};
        let ctx = crate::raw_peer::small_inline_context();
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(16).unwrap();
        let (mut a, mut b) = crate::raw_peer::loopback_pair(&ctx, &pd, &cq);
        let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let dst = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        for i in 0..2 {
            b.post_recv(&RecvWr::new(10 + i, &[dst.sge(8 * i, 8).unwrap()]))
                .unwrap();
        }
        a.post_send(&SendWr::new(0, SendOp::Send, &[src.sge(0, 8).unwrap()]))
            .unwrap();
        let mut wc = [WorkCompletion::default(); 8];
        let mut got = 0;
        for _ in 0..10_000 {
            ctx.progress();
            got += cq.poll(&mut wc);
            if got >= 2 {
                break;
            }
        }
        assert_eq!(got, 2);
        assert!(
            !b.qshared.rq_watch.load(Ordering::Relaxed),
            "the requester was told of a receive WQE"
        );
        b.modify(&QpAttr::new(QpState::Reset)).unwrap();
        ctx.progress();
        assert!(
            b.qshared.rq_watch.load(Ordering::Relaxed),
            "after a Reset nothing was told: the flag must watch again"
        );
    }

    /// The common receive, posted in line (`post_recv_with`: one element, RTS, the requester
    /// told of receive WQEs so that no doorbell is needed): its element counted in flight
    /// under the engine token (the owner's path) or outside it (the token held elsewhere:
    /// here by this very thread), the WQE received into — as the general path does.
    #[test]
    fn receives_posted_in_line_are_counted_and_received() {
        use crate::{AccessFlags, RecvWr, WcStatus, WorkCompletion};
        let ctx = crate::raw_peer::small_inline_context();
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(16).unwrap();
        let (mut a, mut b) = crate::raw_peer::loopback_pair(&ctx, &pd, &cq);
        let src = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let dst = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let mut drain = |want: usize| {
            let mut wc = [WorkCompletion::default(); 8];
            let mut got = vec![];
            for _ in 0..10_000 {
                ctx.progress();
                let n = cq.poll(&mut wc);
                got.extend(wc[..n].iter().map(|w| (w.wr_id, w.status)));
                if got.len() >= want {
                    return got;
                }
            }
            panic!("{got:?}: fewer than {want} completions");
        };
        let send = |a: &mut Qp, i: u64| {
            let sge = [src.sge(8 * i, 8).unwrap()];
            a.post_send(&SendWr::new(i, SendOp::Send, &sge)).unwrap();
        };
        src.write_at(0, b"0123456789abcdefghijklmnopqrstuv")
            .unwrap();
        // A first message: b's Ack tells a of the receive WQE left, so that b's next
        // receives need no doorbell (the requester knows of receive WQEs).
        for i in 0..2 {
            let sge = [dst.sge(8 * i, 8).unwrap()];
            b.post_recv(&RecvWr::new(10 + i, &sge)).unwrap();
        }
        send(&mut a, 0);
        assert_eq!(drain(2).len(), 2);
        assert!(!b.qshared.rq_watch.load(Ordering::Relaxed));
        let counts = || {
            let f = &dst.inflight;
            (
                f.held.load(std::sync::atomic::Ordering::Relaxed),
                f.posted.load(std::sync::atomic::Ordering::Relaxed),
            )
        };
        let (held, posted) = counts();
        // Elements the in-line path must refuse as the general path does: a region of
        // another protection domain, of another context, or without LOCAL_WRITE.
        let other_pd = ctx.alloc_pd().unwrap();
        let in_other_pd = other_pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let other = crate::raw_peer::small_inline_context();
        let opd = other.alloc_pd().unwrap();
        let in_other_ctx = opd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let read_only = pd.alloc_mr(64, AccessFlags::NONE).unwrap();
        for (mr, what) in [
            (&in_other_pd, "another protection domain"),
            (&in_other_ctx, "another context"),
            (&read_only, "no LOCAL_WRITE"),
        ] {
            let sge = [mr.sge(0, 8).unwrap()];
            let err = b.post_recv(&RecvWr::new(99, &sge)).unwrap_err();
            assert!(
                matches!(
                    err,
                    crate::Error::InvalidArgument { .. } | crate::Error::ForeignObject { .. }
                ),
                "{what}: {err:?}"
            );
            assert_eq!(mr.in_flight(), 0, "{what}");
        }
        b.post_recv(&RecvWr::new(12, &[dst.sge(16, 8).unwrap()]))
            .unwrap();
        ctx.shared.engine.with(|_| {
            b.post_recv(&RecvWr::new(13, &[dst.sge(24, 8).unwrap()]))
                .unwrap();
        });
        assert_eq!(
            counts(),
            (held + 1, posted + 1),
            "one under the token, one outside"
        );
        assert_eq!(dst.in_flight(), 3);
        for i in 1..4 {
            send(&mut a, i);
        }
        let mut got = drain(6);
        got.sort_unstable_by_key(|c| c.0);
        let want: Vec<_> = [1, 2, 3, 11, 12, 13]
            .map(|id| (id, WcStatus::Success))
            .into();
        assert_eq!(got, want);
        let mut bytes = [0u8; 32];
        dst.read_at(0, &mut bytes).unwrap();
        assert_eq!(&bytes, b"0123456789abcdefghijklmnopqrstuv");
        assert_eq!(dst.in_flight(), 0);
    }
}
