//! The extended send API (`ibv_qp_ex`, `ibv_wr_*`), which perftest uses by default. Each
//! `ibv_wr_<op>` starts a request (with `qp->wr_id` and `qp->wr_flags`); the request is
//! posted as soon as its data is set (`ibv_wr_set_sge`, `_sge_list`, `_inline_data`,
//! `_inline_data_list`), or at once for those without data (local invalidate, bind);
//! `ibv_wr_complete` returns the first error since `ibv_wr_start`. So requests go out as
//! they are built, not all at `ibv_wr_complete`, and `ibv_wr_abort` cannot take back those
//! already built (a difference no program that completes its batches can see).

use std::ffi::c_void;

use shmhca::{RemoteAddr, SendOp};

use crate::ffi::*;
use crate::post::{Gather, bind_of, post_one};
use crate::qp::QpObj;
use crate::util::{guard, unsupported};

/// The request being built.
#[derive(Default)]
pub struct ExState {
    op: Option<SendOp>,
    wr_id: u64,
    flags: u32,
    err: i32,
}

/// # Safety
/// `qp` is the `ibv_qp_ex` of a live QP of ours.
#[inline(always)]
unsafe fn q<'a>(qp: *mut ibv_qp_ex) -> &'a mut QpObj {
    // SAFETY: the caller's promise; the ibv_qp_ex is the QpObj's first field.
    unsafe { &mut *qp.cast::<QpObj>() }
}

#[inline]
fn begin(qp: *mut ibv_qp_ex, op: SendOp) {
    // SAFETY: verbs.h's inlines pass the program's QP.
    let o = unsafe { q(qp) };
    o.ex.op = Some(op);
    o.ex.wr_id = o.qpx.wr_id;
    o.ex.flags = o.qpx.wr_flags;
}

#[inline]
fn finish(qp: *mut ibv_qp_ex, data: Gather<'_>) {
    // SAFETY: as in `begin`.
    let o = unsafe { q(qp) };
    let Some(op) = o.ex.op.take() else {
        if o.ex.err == 0 {
            o.ex.err = libc::EINVAL;
        }
        return;
    };
    let (wr_id, flags) = (o.ex.wr_id, o.ex.flags);
    if let Err(e) = post_one(o, wr_id, op, data, flags) {
        if o.ex.err == 0 {
            o.ex.err = e;
        }
    }
}

unsafe extern "C" fn wr_start(qp: *mut ibv_qp_ex) {
    guard("ibv_wr_start", (), || {
        // SAFETY: as in `begin`.
        let o = unsafe { q(qp) };
        o.ex = ExState::default();
    })
}

unsafe extern "C" fn wr_complete(qp: *mut ibv_qp_ex) -> i32 {
    guard("ibv_wr_complete", libc::EIO, || {
        // SAFETY: as in `begin`.
        let o = unsafe { q(qp) };
        let e = if o.ex.op.is_some() {
            libc::EINVAL
        } else {
            o.ex.err
        };
        o.ex = ExState::default();
        e
    })
}

unsafe extern "C" fn wr_abort(qp: *mut ibv_qp_ex) {
    guard("ibv_wr_abort", (), || {
        // SAFETY: as in `begin`.
        let o = unsafe { q(qp) };
        o.ex = ExState::default();
    })
}

unsafe extern "C" fn wr_send(qp: *mut ibv_qp_ex) {
    guard("ibv_wr_send", (), || begin(qp, SendOp::Send))
}
unsafe extern "C" fn wr_send_imm(qp: *mut ibv_qp_ex, imm: __be32) {
    guard("ibv_wr_send_imm", (), || {
        // `__be32`: the Rust API's immediate is the value the bytes encode.
        begin(qp, SendOp::SendWithImm(u32::from_be(imm)))
    })
}
unsafe extern "C" fn wr_send_inv(qp: *mut ibv_qp_ex, rkey: u32) {
    guard("ibv_wr_send_inv", (), || {
        begin(qp, SendOp::SendWithInv(rkey))
    })
}
unsafe extern "C" fn wr_rdma_write(qp: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    guard("ibv_wr_rdma_write", (), || {
        begin(qp, SendOp::RdmaWrite(RemoteAddr { addr, rkey }))
    })
}
unsafe extern "C" fn wr_rdma_write_imm(qp: *mut ibv_qp_ex, rkey: u32, addr: u64, imm: __be32) {
    guard("ibv_wr_rdma_write_imm", (), || {
        begin(
            qp,
            SendOp::RdmaWriteWithImm(RemoteAddr { addr, rkey }, u32::from_be(imm)),
        )
    })
}
unsafe extern "C" fn wr_rdma_read(qp: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    guard("ibv_wr_rdma_read", (), || {
        begin(qp, SendOp::RdmaRead(RemoteAddr { addr, rkey }))
    })
}
unsafe extern "C" fn wr_atomic_cmp_swp(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    addr: u64,
    compare: u64,
    swap: u64,
) {
    guard("ibv_wr_atomic_cmp_swp", (), || {
        begin(
            qp,
            SendOp::CompareSwap {
                remote: RemoteAddr { addr, rkey },
                compare,
                swap,
            },
        )
    })
}
unsafe extern "C" fn wr_atomic_fetch_add(qp: *mut ibv_qp_ex, rkey: u32, addr: u64, add: u64) {
    guard("ibv_wr_atomic_fetch_add", (), || {
        begin(
            qp,
            SendOp::FetchAdd {
                remote: RemoteAddr { addr, rkey },
                add,
            },
        )
    })
}
unsafe extern "C" fn wr_local_inv(qp: *mut ibv_qp_ex, rkey: u32) {
    guard("ibv_wr_local_inv", (), || {
        begin(qp, SendOp::LocalInv(rkey));
        finish(qp, Gather::Sgl(&[]));
    })
}
unsafe extern "C" fn wr_bind_mw(
    qp: *mut ibv_qp_ex,
    _mw: *mut ibv_mw,
    rkey: u32,
    info: *const ibv_mw_bind_info,
) {
    guard("ibv_wr_bind_mw", (), || {
        // SAFETY: the program's bind info or null.
        let bind = unsafe { info.as_ref() }
            .ok_or(libc::EINVAL)
            .and_then(bind_of);
        match bind {
            Ok(bind) => {
                begin(qp, SendOp::BindMw { rkey, bind });
                finish(qp, Gather::Sgl(&[]));
            }
            Err(e) => {
                // SAFETY: as in `begin`.
                let o = unsafe { q(qp) };
                if o.ex.err == 0 {
                    o.ex.err = e;
                }
            }
        }
    })
}

unsafe extern "C" fn wr_set_sge(qp: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    guard("ibv_wr_set_sge", (), || {
        let s = [ibv_sge { addr, length, lkey }];
        finish(qp, Gather::Sgl(&s));
    })
}
unsafe extern "C" fn wr_set_sge_list(qp: *mut ibv_qp_ex, n: usize, list: *const ibv_sge) {
    guard("ibv_wr_set_sge_list", (), || {
        let l: &[ibv_sge] = if n == 0 || list.is_null() {
            &[]
        } else {
            // SAFETY: the program's `n` elements.
            unsafe { std::slice::from_raw_parts(list, n) }
        };
        finish(qp, Gather::Sgl(l));
    })
}
unsafe extern "C" fn wr_set_inline_data(qp: *mut ibv_qp_ex, addr: *mut c_void, length: usize) {
    guard("ibv_wr_set_inline_data", (), || {
        let b = [ibv_data_buf { addr, length }];
        finish(qp, Gather::Inline(&b));
    })
}
unsafe extern "C" fn wr_set_inline_data_list(
    qp: *mut ibv_qp_ex,
    n: usize,
    list: *const ibv_data_buf,
) {
    guard("ibv_wr_set_inline_data_list", (), || {
        let l: &[ibv_data_buf] = if n == 0 || list.is_null() {
            &[]
        } else {
            // SAFETY: the program's `n` buffers.
            unsafe { std::slice::from_raw_parts(list, n) }
        };
        finish(qp, Gather::Inline(l));
    })
}

fn refuse(qp: *mut ibv_qp_ex, what: &'static str) {
    let e = unsupported(
        what,
        "shmhca's QPs are RC, without TSO or atomic write",
        libc::EOPNOTSUPP,
    );
    // SAFETY: as in `begin`.
    let o = unsafe { q(qp) };
    if o.ex.err == 0 {
        o.ex.err = e;
    }
}
unsafe extern "C" fn wr_send_tso(qp: *mut ibv_qp_ex, _h: *mut c_void, _hs: u16, _mss: u16) {
    guard("ibv_wr_send_tso", (), || refuse(qp, "ibv_wr_send_tso"))
}
unsafe extern "C" fn wr_set_ud_addr(qp: *mut ibv_qp_ex, _ah: *mut ibv_ah, _qpn: u32, _qkey: u32) {
    guard("ibv_wr_set_ud_addr", (), || {
        refuse(qp, "ibv_wr_set_ud_addr")
    })
}
unsafe extern "C" fn wr_set_xrc_srqn(qp: *mut ibv_qp_ex, _srqn: u32) {
    guard("ibv_wr_set_xrc_srqn", (), || {
        refuse(qp, "ibv_wr_set_xrc_srqn")
    })
}
unsafe extern "C" fn wr_atomic_write(
    qp: *mut ibv_qp_ex,
    _rkey: u32,
    _addr: u64,
    _wr: *const c_void,
) {
    guard("ibv_wr_atomic_write", (), || {
        refuse(qp, "ibv_wr_atomic_write")
    })
}

/// Fills a QP's function table.
pub(crate) fn fill(x: &mut ibv_qp_ex) {
    x.wr_start = Some(wr_start);
    x.wr_complete = Some(wr_complete);
    x.wr_abort = Some(wr_abort);
    x.wr_send = Some(wr_send);
    x.wr_send_imm = Some(wr_send_imm);
    x.wr_send_inv = Some(wr_send_inv);
    x.wr_rdma_write = Some(wr_rdma_write);
    x.wr_rdma_write_imm = Some(wr_rdma_write_imm);
    x.wr_rdma_read = Some(wr_rdma_read);
    x.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
    x.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
    x.wr_local_inv = Some(wr_local_inv);
    x.wr_bind_mw = Some(wr_bind_mw);
    x.wr_set_sge = Some(wr_set_sge);
    x.wr_set_sge_list = Some(wr_set_sge_list);
    x.wr_set_inline_data = Some(wr_set_inline_data);
    x.wr_set_inline_data_list = Some(wr_set_inline_data_list);
    x.wr_send_tso = Some(wr_send_tso);
    x.wr_set_ud_addr = Some(wr_set_ud_addr);
    x.wr_set_xrc_srqn = Some(wr_set_xrc_srqn);
    x.wr_atomic_write = Some(wr_atomic_write);
}
