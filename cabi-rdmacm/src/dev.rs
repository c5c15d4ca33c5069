//! The verbs side, through `libibverbs.so.1`'s public API only (at run time, shmhca's): the
//! device every id uses (shmhca has one, port 1), its LID/GID, and the QP transitions
//! RESET → INIT (at `rdma_create_qp`) and INIT → RTR → RTS (at connect/accept, with the
//! peer's LID or GID, QPN and PSN), and → ERR (at disconnect).

use std::ptr;
use std::sync::{Mutex, OnceLock};

use crate::ffi::*;
use crate::util::say_once;

/// The opened device.
pub(crate) struct Dev {
    /// Its context (kept open for the life of the process, as rdma-core's librdmacm does).
    pub(crate) ctx: *mut ibv_context,
    /// Port 1's LID.
    pub(crate) lid: u16,
    /// Port 1's GID 0.
    pub(crate) gid: [u8; 16],
    /// Port 1's active MTU.
    pub(crate) mtu: ibv_mtu,
    /// The device's `max_qp_rd_atom` (responder resources).
    pub(crate) max_rd: u8,
    /// The device's `max_qp_init_rd_atom` (initiator depth).
    pub(crate) max_init_rd: u8,
    /// The protection domain `rdma_create_qp` uses when given none.
    default_pd: Mutex<usize>,
}

// SAFETY: the context is thread-safe (verbs' contract); the pointers are only passed to verbs.
unsafe impl Send for Dev {}
// SAFETY: as above.
unsafe impl Sync for Dev {}

static DEV: OnceLock<Result<Dev, i32>> = OnceLock::new();

/// The device, opened at the first call.
pub(crate) fn dev() -> Result<&'static Dev, i32> {
    DEV.get_or_init(open).as_ref().map_err(|&e| e)
}

fn open() -> Result<Dev, i32> {
    let mut n = 0;
    // SAFETY: verbs' device list, freed below.
    let list = unsafe { ibv_get_device_list(&mut n) };
    if list.is_null() || n < 1 {
        say_once(
            "rdma_cm: no verbs device (run the program with `shmhca exec -- PROGRAM`)".to_string(),
        );
        if !list.is_null() {
            // SAFETY: the list just returned.
            unsafe { ibv_free_device_list(list) };
        }
        return Err(libc::ENODEV);
    }
    // SAFETY: a list of `n` ≥ 1 devices.
    let ctx = unsafe { ibv_open_device(*list) };
    // SAFETY: the list just returned (the context stays valid).
    unsafe { ibv_free_device_list(list) };
    if ctx.is_null() {
        return Err(crate::util::errno());
    }
    // SAFETY: all-zero is valid for these C structs; verbs fills them.
    let mut port: ibv_port_attr = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
    // SAFETY: an open context and out structs of the right types.
    let rc = unsafe {
        query_port(ctx, &mut port) | ibv_query_device(ctx, &mut attr) | {
            ibv_query_gid(ctx, 1, 0, &mut gid)
        }
    };
    if rc != 0 {
        return Err(libc::ENODEV);
    }
    Ok(Dev {
        ctx,
        lid: port.lid,
        // SAFETY: a GID is 16 bytes whichever way it is read.
        gid: unsafe { gid.raw },
        mtu: port.active_mtu,
        max_rd: attr.max_qp_rd_atom.clamp(1, 255) as u8,
        max_init_rd: attr.max_qp_init_rd_atom.clamp(1, 255) as u8,
        default_pd: Mutex::new(0),
    })
}

/// The extended context of `ctx` if it has the operation at `op_off` (verbs.h's
/// `verbs_get_ctx_op`).
///
/// # Safety
/// `ctx` is an open context of libibverbs.
unsafe fn vctx(ctx: *mut ibv_context, op_off: usize) -> Option<*mut verbs_context> {
    // SAFETY: verbs.h's `verbs_get_ctx`: the extended context ends with the `ibv_context`
    // when `abi_compat` says so; `sz` says how much of it (from the end) exists.
    unsafe {
        if (*ctx).abi_compat != usize::MAX as *mut libc::c_void {
            return None;
        }
        let off = std::mem::offset_of!(verbs_context, context);
        let v = ctx.cast::<u8>().sub(off).cast::<verbs_context>();
        ((*v).sz >= size_of::<verbs_context>() - op_off).then_some(v)
    }
}

/// `ibv_query_port` as verbs.h's inline does it: the context's `query_port` with the full
/// struct's size (the exported compatibility entry point fills only the old prefix).
///
/// # Safety
/// `ctx` is an open context of libibverbs.
unsafe fn query_port(ctx: *mut ibv_context, port: &mut ibv_port_attr) -> libc::c_int {
    // SAFETY: the caller's context.
    let v = unsafe { vctx(ctx, std::mem::offset_of!(verbs_context, query_port)) };
    // SAFETY: `v` is the context's extended part, which has this field.
    match v.and_then(|v| unsafe { (*v).query_port }) {
        // SAFETY: the context's own operation, called as verbs.h does.
        Some(f) => unsafe { f(ctx, 1, port, size_of::<ibv_port_attr>()) },
        // SAFETY: the compatibility entry point, given the full (larger) struct.
        None => unsafe { ibv_query_port(ctx, 1, port) },
    }
}

impl Dev {
    /// The protection domain for QPs made without one (allocated once).
    pub(crate) fn default_pd(&self) -> Result<*mut ibv_pd, i32> {
        let mut g = self.default_pd.lock().map_err(|_| libc::EIO)?;
        if *g == 0 {
            // SAFETY: the open context.
            let pd = unsafe { ibv_alloc_pd(self.ctx) };
            if pd.is_null() {
                return Err(crate::util::errno());
            }
            *g = pd as usize;
        }
        Ok(*g as *mut ibv_pd)
    }
}

/// The access a CM QP gets at INIT (rdma-core: remote read and write; atomics too).
const ACCESS: u32 = IBV_ACCESS_LOCAL_WRITE
    | IBV_ACCESS_REMOTE_WRITE
    | IBV_ACCESS_REMOTE_READ
    | IBV_ACCESS_REMOTE_ATOMIC;

fn modify(qp: *mut ibv_qp, a: &mut ibv_qp_attr, mask: u32, what: &str) -> Result<(), i32> {
    // SAFETY: the caller's QP (made by rdma_create_qp or the program) and a filled attr.
    let rc = unsafe { ibv_modify_qp(qp, a, mask as i32) };
    if rc != 0 {
        if std::env::var_os("SHMHCA_VERBS_DEBUG").is_some() {
            eprintln!("shmhca: rdma_cm: moving the QP to {what} failed (errno {rc})");
        }
        return Err(rc);
    }
    Ok(())
}

/// RESET → INIT on port 1.
pub(crate) fn to_init(qp: *mut ibv_qp) -> Result<(), i32> {
    // SAFETY: all-zero is a valid ibv_qp_attr.
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.pkey_index = 0;
    a.qp_access_flags = ACCESS;
    modify(
        qp,
        &mut a,
        IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
        "INIT",
    )
}

/// What connecting a QP to its peer needs.
pub(crate) struct Connect {
    /// The peer's LID (used when non-zero) and GID.
    pub(crate) lid: u16,
    /// The peer's GID.
    pub(crate) gid: [u8; 16],
    /// The peer's QPN.
    pub(crate) qpn: u32,
    /// The peer's first PSN (our receive PSN).
    pub(crate) peer_psn: u32,
    /// Our first send PSN.
    pub(crate) my_psn: u32,
    /// RDMA reads/atomics we accept at once.
    pub(crate) responder_resources: u8,
    /// RDMA reads/atomics we issue at once.
    pub(crate) initiator_depth: u8,
    /// Transport retries.
    pub(crate) retry_count: u8,
    /// RNR retries.
    pub(crate) rnr_retry: u8,
}

/// INIT → RTR → RTS connected to the peer.
pub(crate) fn to_rts(d: &Dev, qp: *mut ibv_qp, c: &Connect) -> Result<(), i32> {
    // SAFETY: all-zero is a valid ibv_qp_attr.
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = d.mtu;
    a.dest_qp_num = c.qpn;
    a.rq_psn = c.peer_psn;
    a.max_dest_rd_atomic = c.responder_resources.clamp(1, d.max_rd);
    a.min_rnr_timer = 12;
    a.ah_attr.port_num = 1;
    a.ah_attr.dlid = c.lid;
    if c.lid == 0 {
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid.raw = c.gid;
        a.ah_attr.grh.hop_limit = 1;
    }
    modify(
        qp,
        &mut a,
        IBV_QP_STATE
            | IBV_QP_AV
            | IBV_QP_PATH_MTU
            | IBV_QP_DEST_QPN
            | IBV_QP_RQ_PSN
            | IBV_QP_MAX_DEST_RD_ATOMIC
            | IBV_QP_MIN_RNR_TIMER,
        "RTR",
    )?;
    // SAFETY: as above.
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = c.retry_count.min(7);
    a.rnr_retry = c.rnr_retry.min(7);
    a.sq_psn = c.my_psn;
    a.max_rd_atomic = c.initiator_depth.clamp(1, d.max_init_rd);
    modify(
        qp,
        &mut a,
        IBV_QP_STATE
            | IBV_QP_TIMEOUT
            | IBV_QP_RETRY_CNT
            | IBV_QP_RNR_RETRY
            | IBV_QP_SQ_PSN
            | IBV_QP_MAX_QP_RD_ATOMIC,
        "RTS",
    )
}

/// → ERR (outstanding work completes flushed), as rdma-core's `rdma_disconnect` does.
pub(crate) fn to_err(qp: *mut ibv_qp) {
    if qp.is_null() {
        return;
    }
    // SAFETY: all-zero is a valid ibv_qp_attr.
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = IBV_QPS_ERR;
    let _ = modify(qp, &mut a, IBV_QP_STATE, "ERR");
}

/// Creates an RC QP the `ibv_create_qp_ex` way (the context's `create_qp_ex` operation,
/// as verbs.h's inline does), for `rdma_create_qp_ex`.
pub(crate) fn create_qp_ex(ctx: *mut ibv_context, attr: *mut ibv_qp_init_attr_ex) -> *mut ibv_qp {
    // SAFETY: an open context of libibverbs.
    let v = unsafe { vctx(ctx, std::mem::offset_of!(verbs_context, create_qp_ex)) };
    // SAFETY: `v` is the context's extended part, which has this field.
    match v.and_then(|v| unsafe { (*v).create_qp_ex }) {
        // SAFETY: the context's own operation, called as verbs.h's ibv_create_qp_ex does.
        Some(f) => unsafe { f(ctx, attr) },
        None => ptr::null_mut(),
    }
}
