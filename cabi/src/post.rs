//! The hot path, reached through `ibv_context.ops` by verbs.h's static inlines
//! (`ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`,
//! `ibv_post_srq_recv`, `ibv_bind_mw`). No allocation, lock or system call here: each
//! request's scatter/gather list is checked against the context's L_Key table and handed to
//! the Rust QP on the stack.

use std::ffi::c_int;

use shmhca::{
    MwBind, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};

use crate::context::{CtxObj, ctx_of};
use crate::ffi::*;
use crate::mrkeys::KeyCache;
use crate::objects::{CqObj, MrObj, MwObj, SrqObj, access_of, obj};
use crate::qp::QpObj;
use crate::util::{fail, guard};

/// Most scatter/gather elements of one request.
pub const MAX_SGE: usize = shmhca::qp::MAX_SGE as usize;
/// Most bytes of inline data.
pub const MAX_INLINE: usize = shmhca::qp::MAX_INLINE_DATA as usize;

/// What a send request carries.
#[derive(Clone, Copy)]
pub(crate) enum Gather<'a> {
    /// Registered memory.
    Sgl(&'a [ibv_sge]),
    /// Inline data in the program's buffers (copied at post time).
    Inline(&'a [ibv_data_buf]),
}

/// The Rust element of one verbs SGE: its L_Key names a region of this context, and its
/// address range lies inside the region.
#[inline(always)]
fn sge<'a>(c: &'a CtxObj, s: &ibv_sge) -> Result<Sge<'a>, c_int> {
    region_sge(c.mrs.get(s.lkey).ok_or(libc::EINVAL)?, s)
}

/// [`sge`] with the L_Key looked up through a queue's `cache`.
#[inline(always)]
fn sge_cached<'a>(c: &'a CtxObj, cache: &mut KeyCache, s: &ibv_sge) -> Result<Sge<'a>, c_int> {
    region_sge(c.mrs.get_cached(cache, s.lkey).ok_or(libc::EINVAL)?, s)
}

/// The Rust element of verbs SGE `s` in `mr`, the region its L_Key names.
#[inline(always)]
fn region_sge<'a>(mr: &'a MrObj, s: &ibv_sge) -> Result<Sge<'a>, c_int> {
    let off = s.addr.checked_sub(mr.mr.addr as u64).ok_or(libc::EINVAL)?;
    mr.region().sge(off, s.length).map_err(|_| libc::EINVAL)
}

/// Runs `f` on the shmhca elements of the C list `list`, each checked (L_Key, range):
/// `EINVAL` for a bad one or for more than [`MAX_SGE`]. The lists of zero and one element,
/// nearly every post, build no array.
#[inline(always)]
fn with_sges<'a, R>(
    c: &'a CtxObj,
    list: &[ibv_sge],
    f: impl FnOnce(&[Sge<'a>]) -> R,
) -> Result<R, c_int> {
    match list {
        [] => Ok(f(&[])),
        [one] => {
            let s = sge(c, one)?;
            Ok(f(std::slice::from_ref(&s)))
        }
        [first, rest @ ..] => {
            if list.len() > MAX_SGE {
                return Err(libc::EINVAL);
            }
            let mut flat = [sge(c, first)?; MAX_SGE];
            for (f, s) in flat[1..].iter_mut().zip(rest) {
                *f = sge(c, s)?;
            }
            Ok(f(&flat[..list.len()]))
        }
    }
}

/// Posts one send request on `q`.
#[inline(always)]
pub(crate) fn post_one(
    q: &mut QpObj,
    wr_id: u64,
    op: SendOp,
    data: Gather<'_>,
    vflags: u32,
) -> Result<(), c_int> {
    // SAFETY: a QP's context outlives it.
    let c: &CtxObj = unsafe { &*q.ctx };
    let known = IBV_SEND_FENCE | IBV_SEND_SIGNALED | IBV_SEND_SOLICITED | IBV_SEND_INLINE;
    if vflags & !known != 0 {
        return Err(libc::EINVAL);
    }
    let mut flags = SendFlags::NONE;
    if vflags & IBV_SEND_SIGNALED != 0 || q.sig_all {
        flags = flags | SendFlags::SIGNALED;
    }
    if vflags & IBV_SEND_FENCE != 0 {
        flags = flags | SendFlags::FENCE;
    }
    if vflags & IBV_SEND_SOLICITED != 0 {
        flags = flags | SendFlags::SOLICITED;
    }
    let carries = matches!(
        op,
        SendOp::Send
            | SendOp::SendWithImm(_)
            | SendOp::SendWithInv(_)
            | SendOp::RdmaWrite(_)
            | SendOp::RdmaWriteWithImm(..)
    );
    let inline_ok = carries && (vflags & IBV_SEND_INLINE != 0 || matches!(data, Gather::Inline(_)));
    let r = if inline_ok {
        match data {
            Gather::Sgl(list) => {
                // SAFETY: verbs' inline contract: each element's address/length are readable
                // bytes of the program (no L_Key needed).
                inline_post(
                    q,
                    wr_id,
                    op,
                    flags,
                    list.iter()
                        .map(|s| (s.addr as *const u8, s.length as usize)),
                )
            }
            Gather::Inline(bufs) => inline_post(
                q,
                wr_id,
                op,
                flags,
                bufs.iter().map(|b| (b.addr as *const u8, b.length)),
            ),
        }
    } else {
        let Gather::Sgl(list) = data else {
            return Err(libc::EINVAL);
        };
        with_sges(c, list, |slice| {
            q.rust
                .post_send(&SendWr::new(wr_id, op, slice).flags(flags))
        })?
    };
    r.map_err(|e| fail("ibv_post_send", &e))
}

/// Posts a request whose bytes are gathered from `parts` now (inline).
#[inline(never)]
fn inline_post(
    q: &mut QpObj,
    wr_id: u64,
    op: SendOp,
    flags: SendFlags,
    parts: impl Iterator<Item = (*const u8, usize)> + Clone,
) -> shmhca::Result<()> {
    let flags = flags | SendFlags::INLINE;
    let mut single: Option<&[u8]> = None;
    let mut count = 0;
    let mut total = 0usize;
    for (p, len) in parts.clone() {
        count += 1;
        total = total.saturating_add(len);
        if len > 0 && !p.is_null() {
            // SAFETY: the program's bytes, readable for `len` (verbs' contract for inline data).
            single = Some(unsafe { std::slice::from_raw_parts(p, len) });
        }
    }
    if total > MAX_INLINE {
        return Err(shmhca::Error::InvalidArgument {
            name: "inline data",
            reason: format!("{total} bytes; at most {MAX_INLINE}"),
        });
    }
    if count <= 1 || total == single.map_or(0, <[u8]>::len) {
        let bytes = single.unwrap_or(&[]);
        return q
            .rust
            .post_send(&SendWr::inline(wr_id, op, bytes).flags(flags));
    }
    let mut buf = [0u8; MAX_INLINE];
    let mut at = 0;
    for (p, len) in parts {
        if len > 0 && !p.is_null() {
            // SAFETY: as above; `at + len <= total <= MAX_INLINE`.
            buf[at..at + len].copy_from_slice(unsafe { std::slice::from_raw_parts(p, len) });
            at += len;
        }
    }
    q.rust
        .post_send(&SendWr::inline(wr_id, op, &buf[..at]).flags(flags))
}

/// The Rust operation of a verbs send request.
fn op_of(w: &ibv_send_wr) -> Result<SendOp, c_int> {
    // SAFETY: reading the union member the opcode selects (plain integers).
    let rdma = unsafe { w.wr.rdma };
    // SAFETY: as above.
    let atomic = unsafe { w.wr.atomic };
    // SAFETY: as above (imm_data and invalidate_rkey share 4 bytes).
    let raw = unsafe { w.__bindgen_anon_1.imm_data };
    // Immediate data is `__be32`: the program's bytes are the wire's, and the Rust API's
    // immediate is the value they encode. An R_Key (`invalidate_rkey`) is host order.
    let imm = u32::from_be(raw);
    let remote = RemoteAddr {
        addr: rdma.remote_addr,
        rkey: rdma.rkey,
    };
    let aremote = RemoteAddr {
        addr: atomic.remote_addr,
        rkey: atomic.rkey,
    };
    Ok(match w.opcode {
        IBV_WR_SEND => SendOp::Send,
        IBV_WR_SEND_WITH_IMM => SendOp::SendWithImm(imm),
        IBV_WR_SEND_WITH_INV => SendOp::SendWithInv(raw),
        IBV_WR_RDMA_WRITE => SendOp::RdmaWrite(remote),
        IBV_WR_RDMA_WRITE_WITH_IMM => SendOp::RdmaWriteWithImm(remote, imm),
        IBV_WR_RDMA_READ => SendOp::RdmaRead(remote),
        IBV_WR_ATOMIC_CMP_AND_SWP => SendOp::CompareSwap {
            remote: aremote,
            compare: atomic.compare_add,
            swap: atomic.swap,
        },
        IBV_WR_ATOMIC_FETCH_AND_ADD => SendOp::FetchAdd {
            remote: aremote,
            add: atomic.compare_add,
        },
        IBV_WR_LOCAL_INV => SendOp::LocalInv(raw),
        IBV_WR_BIND_MW => {
            // SAFETY: the bind member, selected by the opcode.
            let b = unsafe { w.__bindgen_anon_2.bind_mw };
            SendOp::BindMw {
                rkey: b.rkey,
                bind: bind_of(&b.bind_info)?,
            }
        }
        _ => return Err(libc::EINVAL),
    })
}

/// A window bind's place and rights.
pub(crate) fn bind_of(b: &ibv_mw_bind_info) -> Result<MwBind, c_int> {
    // SAFETY: the program's region or null.
    let mr = unsafe { b.mr.as_ref() }.ok_or(libc::EINVAL)?;
    Ok(MwBind {
        lkey: mr.lkey,
        addr: b.addr,
        len: b.length,
        access: access_of(b.mw_access_flags as c_int, "a memory window bind")?,
    })
}

/// `ops.post_send`.
pub unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    guard("ibv_post_send", libc::EIO, || {
        // SAFETY: our QP or null.
        let Some(q) = (unsafe { obj::<_, QpObj>(qp) }) else {
            return libc::EINVAL;
        };
        // SAFETY: the program's request list (its first request, or null).
        if let Some(first) = unsafe { wr.as_ref() } {
            if let Some(done) = send_one_sge(q, first) {
                if done != 0 && !bad.is_null() {
                    // SAFETY: the program's out pointer.
                    unsafe { bad.write(wr) };
                }
                return done;
            }
        }
        let mut w = wr;
        while !w.is_null() {
            // SAFETY: the program's request list.
            let r = unsafe { &*w };
            let done = op_of(r).and_then(|op| {
                let list: &[ibv_sge] = if r.num_sge <= 0 || r.sg_list.is_null() {
                    &[]
                } else {
                    // SAFETY: the program's `num_sge` elements.
                    unsafe { std::slice::from_raw_parts(r.sg_list, r.num_sge as usize) }
                };
                post_one(q, r.wr_id, op, Gather::Sgl(list), r.send_flags)
            });
            if let Err(e) = done {
                if !bad.is_null() {
                    // SAFETY: the program's out pointer.
                    unsafe { bad.write(w) };
                }
                return e;
            }
            w = r.next;
        }
        0
    })
}

/// The request nearly every program posts, alone: a Send of one element of registered
/// memory, with at most the signaled and solicited flags (perftest's `ib_send_lat` and
/// `ib_send_bw`). Posted through [`Qp::post_send_single`](shmhca::Qp::post_send_single), the
/// common case of [`Qp::post_send`](shmhca::Qp::post_send) compiled in here; the element
/// is checked as [`post_one`] checks it. `None`: anything else, for the
/// general path.
#[inline(always)]
fn send_one_sge(q: &mut QpObj, r: &ibv_send_wr) -> Option<c_int> {
    if !r.next.is_null()
        || r.opcode != IBV_WR_SEND
        || r.num_sge != 1
        || r.sg_list.is_null()
        || r.send_flags & !(IBV_SEND_SIGNALED | IBV_SEND_SOLICITED) != 0
    {
        return None;
    }
    // SAFETY: a QP's context outlives it.
    let c: &CtxObj = unsafe { &*q.ctx };
    // SAFETY: the program's one element (`num_sge` is 1).
    let s = match sge_cached(c, &mut q.send_key, unsafe { &*r.sg_list }) {
        Ok(s) => s,
        Err(e) => return Some(e),
    };
    let mut flags = SendFlags::NONE;
    if r.send_flags & IBV_SEND_SIGNALED != 0 || q.sig_all {
        flags = flags | SendFlags::SIGNALED;
    }
    if r.send_flags & IBV_SEND_SOLICITED != 0 {
        flags = flags | SendFlags::SOLICITED;
    }
    Some(match q.rust.post_send_single(r.wr_id, flags, &s) {
        Ok(()) => 0,
        Err(e) => fail("ibv_post_send", &e),
    })
}

/// Runs `post` over the receive list `wr`, setting `bad` at the first failure.
#[inline(always)]
fn each_recv(
    c: &CtxObj,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
    mut post: impl FnMut(&RecvWr<'_>) -> shmhca::Result<()>,
) -> c_int {
    let mut w = wr;
    while !w.is_null() {
        // SAFETY: the program's request list.
        let r = unsafe { &*w };
        let list: &[ibv_sge] = if r.num_sge <= 0 || r.sg_list.is_null() {
            &[]
        } else {
            // SAFETY: the program's `num_sge` elements.
            unsafe { std::slice::from_raw_parts(r.sg_list, r.num_sge as usize) }
        };
        let done = with_sges(c, list, |slice| {
            post(&RecvWr::new(r.wr_id, slice)).map_err(|e| fail("ibv_post_recv", &e))
        })
        .and_then(|r| r);
        if let Err(e) = done {
            if !bad.is_null() {
                // SAFETY: the program's out pointer.
                unsafe { bad.write(w) };
            }
            return e;
        }
        w = r.next;
    }
    0
}

/// `ops.post_recv`.
pub unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    guard("ibv_post_recv", libc::EIO, || {
        // SAFETY: our QP or null.
        let Some(q) = (unsafe { obj::<_, QpObj>(qp) }) else {
            return libc::EINVAL;
        };
        // SAFETY: the program's request list (its first request, or null).
        if let Some(first) = unsafe { wr.as_ref() } {
            if first.next.is_null()
                && first.num_sge == 1
                && !first.sg_list.is_null()
                && q.srq.is_null()
            {
                // SAFETY: the program's one element (`num_sge` is 1).
                return match recv_one_sge(q, first.wr_id, unsafe { &*first.sg_list }) {
                    Ok(()) => 0,
                    Err(e) => recv_failed(wr, bad, e),
                };
            }
        }
        recv_list(q, wr, bad)
    })
}

/// The receive nearly every program posts, alone with one element: checked as
/// [`each_recv`] checks it, posted through a copy of [`Qp::post_recv`](shmhca::Qp::post_recv)
/// made for it. Everything in line, with no closure between the checks and the post, so
/// that the entry point is one function: it was two (the post's own frame and register
/// saves), ~20 instructions per receive more.
#[inline(always)]
fn recv_one_sge(q: &mut QpObj, wr_id: u64, sge: &ibv_sge) -> Result<(), c_int> {
    // SAFETY: a QP's context outlives it.
    let c: &CtxObj = unsafe { &*q.ctx };
    let s = sge_cached(c, &mut q.recv_key, sge)?;
    match q.rust.post_recv_one_inlined(wr_id, s) {
        Ok(()) => Ok(()),
        Err(e) => Err(fail("ibv_post_recv", &e)),
    }
}

/// A refused receive `wr`: names it in `bad`, returns `e`.
#[cold]
fn recv_failed(wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr, e: c_int) -> c_int {
    if !bad.is_null() {
        // SAFETY: the program's out pointer.
        unsafe { bad.write(wr) };
    }
    e
}

/// `ops.post_recv` of any other list (several requests, several or no elements, a QP
/// on a shared receive queue).
#[inline(never)]
fn recv_list(q: &mut QpObj, wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr) -> c_int {
    if !q.srq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a QP's context outlives it.
    let c: &CtxObj = unsafe { &*q.ctx };
    each_recv(c, wr, bad, |r| q.rust.post_recv(r))
}

/// `ops.post_srq_recv`.
pub unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    guard("ibv_post_srq_recv", libc::EIO, || {
        // SAFETY: our SRQ or null.
        let Some(s) = (unsafe { obj::<_, SrqObj>(srq) }) else {
            return libc::EINVAL;
        };
        // SAFETY: the SRQ's context is ours.
        let Some(c) = (unsafe { ctx_of(s.srq.context) }) else {
            return libc::EINVAL;
        };
        each_recv(c, wr, bad, |r| s.rust.post_recv(r))
    })
}

fn status_to_c(s: WcStatus) -> ibv_wc_status {
    match s {
        WcStatus::Success => IBV_WC_SUCCESS,
        WcStatus::LocLenErr => IBV_WC_LOC_LEN_ERR,
        WcStatus::LocQpOpErr => IBV_WC_LOC_QP_OP_ERR,
        WcStatus::WrFlushErr => IBV_WC_WR_FLUSH_ERR,
        WcStatus::BadRespErr => IBV_WC_BAD_RESP_ERR,
        WcStatus::RemInvReqErr => IBV_WC_REM_INV_REQ_ERR,
        WcStatus::RemAccessErr => IBV_WC_REM_ACCESS_ERR,
        WcStatus::RemOpErr => IBV_WC_REM_OP_ERR,
        WcStatus::RetryExcErr => IBV_WC_RETRY_EXC_ERR,
        WcStatus::RnrRetryExcErr => IBV_WC_RNR_RETRY_EXC_ERR,
        WcStatus::MwBindErr => IBV_WC_MW_BIND_ERR,
        WcStatus::LocProtErr => IBV_WC_LOC_PROT_ERR,
    }
}

fn opcode_to_c(o: WcOpcode) -> ibv_wc_opcode {
    match o {
        WcOpcode::Send => IBV_WC_SEND,
        WcOpcode::RdmaWrite => IBV_WC_RDMA_WRITE,
        WcOpcode::RdmaRead => IBV_WC_RDMA_READ,
        WcOpcode::CompSwap => IBV_WC_COMP_SWAP,
        WcOpcode::FetchAdd => IBV_WC_FETCH_ADD,
        WcOpcode::Recv => IBV_WC_RECV,
        WcOpcode::RecvRdmaWithImm => IBV_WC_RECV_RDMA_WITH_IMM,
        WcOpcode::BindMw => IBV_WC_BIND_MW,
        WcOpcode::LocalInv => IBV_WC_LOCAL_INV,
    }
}

/// With `SHMHCA_VERBS_DEBUG`, says on stderr why completion `w` (as the program got it)
/// failed, as far as the QP knows.
#[cold]
fn explain(cq: &CqObj, w: &ibv_wc) {
    if std::env::var_os("SHMHCA_VERBS_DEBUG").is_none() {
        return;
    }
    // SAFETY: the CQ's context is ours.
    let Some(c) = (unsafe { ctx_of(cq.cq.context) }) else {
        return;
    };
    let qps = c.qps.lock().unwrap_or_else(|e| e.into_inner());
    let why = qps.iter().find(|q| q.0 == w.qp_num).and_then(|&(_, p, _)| {
        // SAFETY: a live QP of this context (removed from the list before it is freed).
        let q = unsafe { &*(p as *const QpObj) };
        q.rust
            .last_error()
            .map(|e| format!("{e} (QP state {:?})", q.rust.state()))
    });
    // SAFETY: a static C string for any status.
    let status = unsafe { std::ffi::CStr::from_ptr(crate::misc::ibv_wc_status_str(w.status)) };
    eprintln!(
        "shmhca: QP {:#x}: work request {} completed with {} ({}): {}",
        w.qp_num,
        w.wr_id,
        status.to_string_lossy(),
        w.status,
        why.as_deref().unwrap_or("no more is known")
    );
}

#[inline]
fn wc_to_c(w: &WorkCompletion) -> ibv_wc {
    let mut flags = 0;
    let mut imm = 0;
    if let Some(i) = w.imm_data {
        flags |= IBV_WC_WITH_IMM;
        // `__be32`, as the program reads it (an invalidated R_Key below is host order).
        imm = i.to_be();
    }
    if let Some(k) = w.invalidated_rkey {
        flags |= IBV_WC_WITH_INV;
        imm = k;
    }
    ibv_wc {
        wr_id: w.wr_id,
        status: status_to_c(w.status),
        opcode: opcode_to_c(w.opcode),
        vendor_err: 0,
        byte_len: w.byte_len,
        __bindgen_anon_1: ibv_wc__bindgen_ty_1 { imm_data: imm },
        qp_num: w.qp_num.get(),
        src_qp: 0,
        wc_flags: flags,
        pkey_index: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
    }
}

/// `ops.poll_cq`.
pub unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    guard("ibv_poll_cq", -1, || {
        // SAFETY: our CQ or null.
        let Some(o) = (unsafe { obj::<_, CqObj>(cq) }) else {
            return -1;
        };
        if n <= 0 {
            return 0;
        }
        if wc.is_null() {
            return -1;
        }
        if n == 1 {
            return match o.rust.poll_one() {
                Some(w) => {
                    let c = wc_to_c(&w);
                    // SAFETY: the program's array of `n` entries.
                    unsafe { wc.write(c) };
                    if c.status != IBV_WC_SUCCESS {
                        explain(o, &c);
                    }
                    1
                }
                None => 0,
            };
        }
        // Each completion straight into the program's array (no array of ours to
        // initialize per poll: a bandwidth test polls 16 at a time, mostly in vain).
        let mut done = 0;
        let mut failed = false;
        let got = o.rust.poll_each(n as usize, |w| {
            failed |= w.status != WcStatus::Success;
            // SAFETY: `poll_each` hands at most `n` completions: `done < n`, inside the
            // program's array.
            unsafe { wc.add(done).write(wc_to_c(&w)) };
            done += 1;
        });
        if failed {
            // SAFETY: the `got` entries just written.
            for c in unsafe { std::slice::from_raw_parts(wc, got) } {
                if c.status != IBV_WC_SUCCESS {
                    explain(o, c);
                }
            }
        }
        got as c_int
    })
}

/// `ops.req_notify_cq`.
pub unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    guard("ibv_req_notify_cq", libc::EIO, || {
        // SAFETY: our CQ or null.
        let Some(o) = (unsafe { obj::<_, CqObj>(cq) }) else {
            return libc::EINVAL;
        };
        match o.rust.req_notify(solicited_only != 0) {
            Ok(()) => 0,
            Err(e) => fail("ibv_req_notify_cq", &e),
        }
    })
}

/// `ops.bind_mw`: binds a type 1 window.
pub unsafe extern "C" fn bind_mw(qp: *mut ibv_qp, mw: *mut ibv_mw, b: *mut ibv_mw_bind) -> c_int {
    guard("ibv_bind_mw", libc::EIO, || {
        // SAFETY: our objects or null; the program's bind request.
        let (Some(q), Some(m), Some(b)) = (
            unsafe { obj::<_, QpObj>(qp) },
            unsafe { obj::<_, MwObj>(mw) },
            unsafe { b.as_ref() },
        ) else {
            return libc::EINVAL;
        };
        let bind = match bind_of(&b.bind_info) {
            Ok(x) => x,
            Err(e) => return e,
        };
        let mut flags = SendFlags::NONE;
        if b.send_flags & IBV_SEND_SIGNALED != 0 || q.sig_all {
            flags = flags | SendFlags::SIGNALED;
        }
        match q.rust.bind_mw(&mut m.rust, b.wr_id, bind, flags) {
            Ok(rkey) => {
                m.mw.rkey = rkey;
                0
            }
            Err(e) => fail("ibv_bind_mw", &e),
        }
    })
}
