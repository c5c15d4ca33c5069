//! What the verbs-ABI examples share: a context of the C library with its objects, made and
//! connected with the exported functions, and posts and polls through `ibv_context.ops` as
//! verbs.h's static inlines make them.

// An FFI example: each block drives the C ABI as a C program would, with the pointers it
// made; one SAFETY comment per block says so. (Each example uses part of this module.)
#![allow(clippy::multiple_unsafe_ops_per_block, dead_code)]

use std::ffi::c_int;
use std::ptr;

use shmhca_verbs_core::context::*;
use shmhca_verbs_core::ffi::*;
use shmhca_verbs_core::objects::*;
use shmhca_verbs_core::qp::*;

/// Receives each side keeps posted (perftest's `rx_depth` is larger; any depth above one
/// round trip's needs gives the same per-message figure).
pub(crate) const RX_DEPTH: u64 = 8;
/// Receives a QP can hold (perftest's `rx_depth` for bandwidth tests).
pub(crate) const MAX_RECV_WR: u64 = 512;
/// Every how many Sends one is signaled (perftest's default `cq_mod`).
pub(crate) const CQ_MOD: u64 = 100;
/// Where receives land in each side's buffer (Sends go from offset 0).
pub(crate) const RECV_AT: u64 = 2048;

/// One context with its objects.
pub(crate) struct Side {
    pub(crate) ctx: *mut ibv_context,
    pub(crate) ops: ibv_context_ops,
    pub(crate) pd: *mut ibv_pd,
    pub(crate) cq: *mut ibv_cq,
    pub(crate) qp: *mut ibv_qp,
    /// The program's buffer: the Send's bytes at 0, receives at `RECV_AT`.
    pub(crate) buf: Vec<u8>,
    /// The message size.
    pub(crate) size: u32,
    pub(crate) mr: *mut ibv_mr,
    /// The send request and its element, built once (as perftest's `ctx_set_send_wqes`
    /// does; its loops change only the request's id and signaled flag).
    pub(crate) send_wr: Box<ibv_send_wr>,
    pub(crate) send_sge: Box<ibv_sge>,
    /// The receive request and its element, built once (perftest's `ctx_set_recv_wqes`).
    pub(crate) recv_wr: Box<ibv_recv_wr>,
    pub(crate) recv_sge: Box<ibv_sge>,
    /// Sends posted.
    pub(crate) sent: u64,
    /// Signaled Sends whose completion was not yet polled.
    pub(crate) unpolled: u64,
}

/// Exits with `msg` and status 1 (an example, not a library: nothing to recover).
pub(crate) fn die(msg: &str) -> ! {
    let name = std::env::args().next().unwrap_or_default();
    let name = name.rsplit('/').next().unwrap_or("verbs example");
    eprintln!("{name}: {msg}");
    std::process::exit(1);
}

pub(crate) fn side(size: u32) -> Side {
    // SAFETY: the exported functions with the arguments verbs.h documents.
    unsafe {
        let mut n = 0;
        let list = ibv_get_device_list(&mut n);
        if list.is_null() || n < 1 {
            die("no shmhca device");
        }
        let ctx = ibv_open_device(*list);
        ibv_free_device_list(list);
        if ctx.is_null() {
            die("ibv_open_device failed");
        }
        let pd = ibv_alloc_pd(ctx);
        let cq = ibv_create_cq(ctx, 1024, ptr::null_mut(), ptr::null_mut(), 0);
        let mut buf = vec![0u8; 4096];
        let access = (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) as c_int;
        let mr = ibv_reg_mr(pd, buf.as_mut_ptr().cast(), buf.len(), access);
        if pd.is_null() || cq.is_null() || mr.is_null() {
            die("ibv_alloc_pd, ibv_create_cq or ibv_reg_mr failed");
        }
        let mut attr: ibv_qp_init_attr = std::mem::zeroed();
        attr.send_cq = cq;
        attr.recv_cq = cq;
        attr.cap = ibv_qp_cap {
            max_send_wr: 128,
            max_recv_wr: MAX_RECV_WR as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        attr.qp_type = IBV_QPT_RC;
        let qp = ibv_create_qp(pd, &mut attr);
        if qp.is_null() {
            die("ibv_create_qp failed");
        }
        let mut send_sge = Box::new(ibv_sge {
            addr: buf.as_ptr() as u64,
            length: size,
            lkey: (*mr).lkey,
        });
        let mut send_wr: Box<ibv_send_wr> = Box::new(std::mem::zeroed());
        send_wr.sg_list = &mut *send_sge;
        send_wr.num_sge = 1;
        send_wr.opcode = IBV_WR_SEND;
        let mut recv_sge = Box::new(ibv_sge {
            addr: buf.as_ptr() as u64 + RECV_AT,
            length: size,
            lkey: (*mr).lkey,
        });
        let mut recv_wr: Box<ibv_recv_wr> = Box::new(std::mem::zeroed());
        recv_wr.sg_list = &mut *recv_sge;
        recv_wr.num_sge = 1;
        Side {
            ctx,
            ops: (*ctx).ops,
            pd,
            cq,
            qp,
            buf,
            size,
            mr,
            send_wr,
            send_sge,
            recv_wr,
            recv_sge,
            sent: 0,
            unpolled: 0,
        }
    }
}

/// Moves `s`'s QP to RTS towards `peer`'s, addressed by the peer context's LID.
pub(crate) fn connect(s: &Side, peer: &Side) {
    // SAFETY: our contexts and QPs; plain-data attributes.
    unsafe {
        let Some(pc) = ctx_of(peer.ctx) else {
            die("not a shmhca context")
        };
        let mut attr: ibv_qp_attr = std::mem::zeroed();
        attr.qp_state = IBV_QPS_INIT;
        attr.port_num = 1;
        attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
        let m = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
        let init = ibv_modify_qp(s.qp, &mut attr, m as c_int);
        let mut attr: ibv_qp_attr = std::mem::zeroed();
        attr.qp_state = IBV_QPS_RTR;
        attr.path_mtu = IBV_MTU_4096;
        attr.dest_qp_num = (*peer.qp).qp_num;
        attr.max_dest_rd_atomic = 1;
        attr.min_rnr_timer = 12;
        attr.ah_attr.port_num = 1;
        attr.ah_attr.dlid = pc.lid;
        let m = IBV_QP_STATE
            | IBV_QP_AV
            | IBV_QP_PATH_MTU
            | IBV_QP_DEST_QPN
            | IBV_QP_RQ_PSN
            | IBV_QP_MAX_DEST_RD_ATOMIC
            | IBV_QP_MIN_RNR_TIMER;
        let rtr = ibv_modify_qp(s.qp, &mut attr, m as c_int);
        let mut attr: ibv_qp_attr = std::mem::zeroed();
        attr.qp_state = IBV_QPS_RTS;
        attr.timeout = 14;
        attr.retry_cnt = 7;
        attr.rnr_retry = 7;
        attr.max_rd_atomic = 1;
        let m = IBV_QP_STATE
            | IBV_QP_TIMEOUT
            | IBV_QP_RETRY_CNT
            | IBV_QP_RNR_RETRY
            | IBV_QP_SQ_PSN
            | IBV_QP_MAX_QP_RD_ATOMIC;
        let rts = ibv_modify_qp(s.qp, &mut attr, m as c_int);
        if init != 0 || rtr != 0 || rts != 0 {
            die("ibv_modify_qp to INIT, RTR or RTS failed");
        }
    }
}

/// Posts one receive of the message size at `RECV_AT` in `s`'s buffer: the request built
/// once, with id `id` (perftest reposts the same request).
pub(crate) fn post_recv(s: &mut Side, id: u64) {
    s.recv_wr.wr_id = id;
    let mut bad = ptr::null_mut();
    let post = s.ops.post_recv.unwrap_or_else(|| die("no post_recv op"));
    // SAFETY: our QP, a request whose list lives as long as `s`.
    if unsafe { post(s.qp, &mut *s.recv_wr, &mut bad) } != 0 {
        die("ibv_post_recv failed");
    }
}

/// Posts one Send of the message size from offset 0 of `s`'s buffer, signaled every
/// `CQ_MOD`th: the request built once, its id and signaled flag set per post (as perftest's
/// loops do).
pub(crate) fn post_send(s: &mut Side) {
    s.sent += 1;
    s.send_wr.wr_id = s.sent;
    if s.sent % CQ_MOD == 0 {
        s.send_wr.send_flags = IBV_SEND_SIGNALED;
        s.unpolled += 1;
    } else {
        s.send_wr.send_flags = 0;
    }
    let mut bad = ptr::null_mut();
    let post = s.ops.post_send.unwrap_or_else(|| die("no post_send op"));
    // SAFETY: our QP, a request whose list lives as long as `s`.
    if unsafe { post(s.qp, &mut *s.send_wr, &mut bad) } != 0 {
        die("ibv_post_send failed");
    }
}

/// Polls `s`'s CQ once (which runs its engine, inline mode); true if it held a receive.
/// Send completions are counted off as they come.
pub(crate) fn poll_once(s: &mut Side) -> bool {
    // SAFETY: plain data.
    let mut wc: ibv_wc = unsafe { std::mem::zeroed() };
    let poll = s.ops.poll_cq.unwrap_or_else(|| die("no poll_cq op"));
    // SAFETY: our CQ, room for one completion.
    let n = unsafe { poll(s.cq, 1, &mut wc) };
    if n < 0 {
        die("ibv_poll_cq failed");
    }
    if n == 0 {
        return false;
    }
    if wc.status != IBV_WC_SUCCESS {
        die(&format!("completion status {}", wc.status));
    }
    if wc.opcode == IBV_WC_RECV {
        return true;
    }
    s.unpolled = s.unpolled.saturating_sub(1);
    false
}

/// Destroys `s`'s objects in verbs' order.
pub(crate) fn teardown(s: Side) {
    // SAFETY: our objects, each destroyed once.
    let ok = unsafe {
        ibv_destroy_qp(s.qp) == 0
            && ibv_dereg_mr(s.mr) == 0
            && ibv_destroy_cq(s.cq) == 0
            && ibv_dealloc_pd(s.pd) == 0
            && ibv_close_device(s.ctx) == 0
    };
    if !ok {
        die("tearing down failed");
    }
}

/// Sets `SHMHCA_VERBS_MODE=inline` unless the environment sets a mode: both engines are
/// driven by this thread's calls. Call before the first context.
pub(crate) fn inline_mode() {
    if std::env::var_os("SHMHCA_VERBS_MODE").is_none() {
        // SAFETY: called before any other thread exists.
        unsafe { std::env::set_var("SHMHCA_VERBS_MODE", "inline") };
    }
}
