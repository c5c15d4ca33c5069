//! Queue pairs: creation (`ibv_create_qp`, and `ibv_create_qp_ex` through the
//! `verbs_context`), `ibv_modify_qp`, `ibv_query_qp`, `ibv_destroy_qp`. Only RC exists.

use std::ffi::c_int;
use std::ptr;

use shmhca::{Mtu, Qp, QpAttr, QpCaps, QpState};

use crate::context::CtxObj;
use crate::ffi::*;
use crate::mrkeys::KeyCache;
use crate::objects::{CqObj, PdObj, SrqObj, access_of, ctx, obj};
use crate::qpex::ExState;
use crate::util::{fail, guard, set_errno, unsupported};

/// The inline data every QP can take at least: one 64-byte staging row per send request
/// (see `create_qp`).
const STAGING_ROW: u32 = 64;

/// A queue pair. `qpx.qp_base` is the `ibv_qp` handed out; `&qpx` is its `ibv_qp_ex`.
#[repr(C)]
pub struct QpObj {
    /// What C sees.
    pub qpx: ibv_qp_ex,
    /// The Rust QP.
    pub rust: Qp,
    /// Its context (for L_Key lookups).
    pub ctx: *const CtxObj,
    /// `sq_sig_all`: every send request is signaled.
    pub sig_all: bool,
    /// Whether it was created with the extended send API (`ibv_qp_to_qp_ex` gives it).
    pub has_ex: bool,
    /// The work request the `ibv_wr_*` calls are building.
    pub ex: ExState,
    /// Its receives come from this SRQ (null: its own receive queue).
    pub srq: *mut SrqObj,
    /// The region of the last L_Key its sends named.
    pub(crate) send_key: KeyCache,
    /// The region of the last L_Key its receives named.
    pub(crate) recv_key: KeyCache,
}

pub(crate) fn state_to_c(s: QpState) -> ibv_qp_state {
    match s {
        QpState::Reset => IBV_QPS_RESET,
        QpState::Init => IBV_QPS_INIT,
        QpState::Rtr => IBV_QPS_RTR,
        QpState::Rts => IBV_QPS_RTS,
        QpState::Sqd => IBV_QPS_SQD,
        QpState::Sqe => IBV_QPS_SQE,
        QpState::Error => IBV_QPS_ERR,
    }
}

fn state_from_c(s: ibv_qp_state) -> Option<QpState> {
    Some(match s {
        IBV_QPS_RESET => QpState::Reset,
        IBV_QPS_INIT => QpState::Init,
        IBV_QPS_RTR => QpState::Rtr,
        IBV_QPS_RTS => QpState::Rts,
        IBV_QPS_SQD => QpState::Sqd,
        IBV_QPS_SQE => QpState::Sqe,
        IBV_QPS_ERR => QpState::Error,
        _ => return None,
    })
}

fn mtu_from_c(m: ibv_mtu) -> Option<Mtu> {
    if !(IBV_MTU_256..=IBV_MTU_4096).contains(&m) {
        return None;
    }
    Mtu::from_bytes(256 << (m - IBV_MTU_256)).ok()
}

pub(crate) fn mtu_to_c(m: Mtu) -> ibv_mtu {
    IBV_MTU_256 + (m.bytes() / 256).trailing_zeros()
}

#[allow(clippy::too_many_arguments)]
unsafe fn create(
    context: *mut ibv_context,
    pd: *mut ibv_pd,
    send_cq: *mut ibv_cq,
    recv_cq: *mut ibv_cq,
    srq: *mut ibv_srq,
    cap: &mut ibv_qp_cap,
    qp_type: ibv_qp_type,
    sig_all: c_int,
    qp_context: *mut std::ffi::c_void,
    has_ex: bool,
) -> *mut ibv_qp {
    if qp_type != IBV_QPT_RC {
        let what = match qp_type {
            IBV_QPT_UD => "UD queue pairs",
            IBV_QPT_UC => "UC queue pairs",
            IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV => "XRC queue pairs",
            _ => "this queue pair type",
        };
        unsupported(
            what,
            "shmhca is a Reliable Connected HCA: use IBV_QPT_RC",
            libc::EOPNOTSUPP,
        );
        return ptr::null_mut();
    }
    // SAFETY: our objects or null.
    let (Some(p), Some(scq), Some(rcq)) = (
        unsafe { obj::<_, PdObj>(pd) },
        unsafe { obj::<_, CqObj>(send_cq) },
        unsafe { obj::<_, CqObj>(recv_cq) },
    ) else {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    };
    // SAFETY: the context is ours.
    let Some(c) = (unsafe { ctx(context) }) else {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    };
    // SAFETY: ours or null.
    let s = unsafe { obj::<_, SrqObj>(srq) };
    let caps = QpCaps {
        max_send_wr: cap.max_send_wr.max(1),
        max_recv_wr: if s.is_some() {
            1
        } else {
            cap.max_recv_wr.max(1)
        },
        max_send_sge: cap.max_send_sge.max(1),
        max_recv_sge: if s.is_some() {
            1
        } else {
            cap.max_recv_sge.max(1)
        },
        // At least one staging row: a Send of up to that many bytes of a registered buffer
        // is copied there at post time rather than into the region's shadow, and holds no
        // region (`Qp::post_send_single`; perftest asks for no inline data on a device it
        // does not know). Without arena room for the rows, what the program asked for.
        max_inline_data: cap.max_inline_data.max(STAGING_ROW),
    };
    let create = |caps| match &s {
        Some(s) => c
            .ctx
            .create_qp_with_srq(&p.rust, &scq.rust, &rcq.rust, &s.rust, caps),
        None => c.ctx.create_qp(&p.rust, &scq.rust, &rcq.rust, caps),
    };
    let made = match create(caps) {
        Err(shmhca::Error::ArenaExhausted { .. }) if caps.max_inline_data > cap.max_inline_data => {
            create(QpCaps {
                max_inline_data: cap.max_inline_data,
                ..caps
            })
        }
        made => made,
    };
    let rust = match made {
        Ok(q) => q,
        Err(e) => {
            set_errno(fail("ibv_create_qp", &e));
            return ptr::null_mut();
        }
    };
    let got = rust.caps();
    cap.max_send_wr = got.max_send_wr;
    cap.max_send_sge = got.max_send_sge;
    cap.max_inline_data = got.max_inline_data;
    if s.is_none() {
        cap.max_recv_wr = got.max_recv_wr;
        cap.max_recv_sge = got.max_recv_sge;
    }
    // SAFETY: plain data (zeroed pthread objects are their static initializers).
    let mut qpx: ibv_qp_ex = unsafe { std::mem::zeroed() };
    let b = &mut qpx.qp_base;
    b.context = context;
    b.qp_context = qp_context;
    b.pd = pd;
    b.send_cq = send_cq;
    b.recv_cq = recv_cq;
    b.srq = srq;
    b.qp_num = rust.qpn().get();
    b.state = IBV_QPS_RESET;
    b.qp_type = IBV_QPT_RC;
    crate::qpex::fill(&mut qpx);
    let o = Box::new(QpObj {
        qpx,
        rust,
        ctx: c as *const CtxObj,
        sig_all: sig_all != 0,
        has_ex,
        ex: ExState::default(),
        srq: s.map_or(ptr::null_mut(), |s| s as *mut SrqObj),
        send_key: KeyCache::default(),
        recv_key: KeyCache::default(),
    });
    let qpn = o.rust.qpn().get();
    let p = Box::into_raw(o);
    c.qps
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((qpn, p as usize, 0));
    p.cast()
}

/// `ibv_create_qp`: RC only; the capabilities granted are written back.
#[unsafe(export_name = "__shmhca_ibv_create_qp")]
pub unsafe extern "C" fn ibv_create_qp(
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> *mut ibv_qp {
    guard("ibv_create_qp", ptr::null_mut(), || {
        // SAFETY: the caller's attributes or null; a pd of ours or null.
        let (Some(a), Some(p)) = (unsafe { attr.as_mut() }, unsafe { obj::<_, PdObj>(pd) }) else {
            set_errno(libc::EINVAL);
            return ptr::null_mut();
        };
        let context = p.pd.context;
        // SAFETY: forwarded.
        unsafe {
            create(
                context,
                pd,
                a.send_cq,
                a.recv_cq,
                a.srq,
                &mut a.cap,
                a.qp_type,
                a.sq_sig_all,
                a.qp_context,
                false,
            )
        }
    })
}

/// `verbs_context.create_qp_ex` (behind verbs.h's `ibv_create_qp_ex`): RC with the
/// extended send API (`IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`).
pub unsafe extern "C" fn create_qp_ex(
    context: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    guard("ibv_create_qp_ex", ptr::null_mut(), || {
        // SAFETY: the caller's attributes or null.
        let Some(a) = (unsafe { attr.as_mut() }) else {
            set_errno(libc::EINVAL);
            return ptr::null_mut();
        };
        let known = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
        if a.comp_mask & !known != 0 || a.comp_mask & IBV_QP_INIT_ATTR_PD == 0 {
            unsupported(
                "ibv_create_qp_ex attributes other than PD and SEND_OPS_FLAGS",
                "XRC, TSO, RSS and create flags",
                libc::EOPNOTSUPP,
            );
            return ptr::null_mut();
        }
        let ops = if a.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0 {
            a.send_ops_flags
        } else {
            0
        };
        let supported = IBV_QP_EX_WITH_RDMA_WRITE
            | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
            | IBV_QP_EX_WITH_SEND
            | IBV_QP_EX_WITH_SEND_WITH_IMM
            | IBV_QP_EX_WITH_RDMA_READ
            | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
            | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
            | IBV_QP_EX_WITH_LOCAL_INV
            | IBV_QP_EX_WITH_BIND_MW
            | IBV_QP_EX_WITH_SEND_WITH_INV;
        if ops & !u64::from(supported) != 0 {
            unsupported(
                "these send operations (TSO, atomic write)",
                "ibv_create_qp_ex send_ops_flags",
                libc::EOPNOTSUPP,
            );
            return ptr::null_mut();
        }
        // SAFETY: forwarded.
        unsafe {
            create(
                context,
                a.pd,
                a.send_cq,
                a.recv_cq,
                a.srq,
                &mut a.cap,
                a.qp_type,
                a.sq_sig_all,
                a.qp_context,
                ops != 0,
            )
        }
    })
}

/// `ibv_qp_to_qp_ex`: the extended QP of one created with send-ops flags, else null.
#[unsafe(export_name = "__shmhca_ibv_qp_to_qp_ex")]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp_ex {
    // SAFETY: ours or null.
    match unsafe { obj::<_, QpObj>(qp) } {
        Some(q) if q.has_ex => qp.cast(),
        _ => ptr::null_mut(),
    }
}

/// `ibv_modify_qp`. RTR's address vector (`ah_attr`: the peer's LID, or its GID with
/// `is_global`; on the RoCEv2 port, its GRH) and `dest_qp_num` name the peer QP; see
/// [`crate::addressing`].
#[unsafe(export_name = "__shmhca_ibv_modify_qp")]
pub unsafe extern "C" fn ibv_modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    guard("ibv_modify_qp", libc::EIO, || {
        // SAFETY: ours or null; the caller's attributes.
        let (Some(q), Some(a)) = (unsafe { obj::<_, QpObj>(qp) }, unsafe { attr.as_ref() }) else {
            return libc::EINVAL;
        };
        let m = mask as u32;
        let state = if m & IBV_QP_STATE != 0 {
            match state_from_c(a.qp_state) {
                Some(s) => s,
                None => return libc::EINVAL,
            }
        } else {
            q.rust.state()
        };
        let mut r = QpAttr::new(state);
        if m & IBV_QP_ALT_PATH != 0 || m & IBV_QP_PATH_MIG_STATE != 0 {
            return unsupported(
                "alternate paths (APM)",
                "ibv_modify_qp IBV_QP_ALT_PATH",
                libc::EOPNOTSUPP,
            );
        }
        if m & IBV_QP_PORT != 0 && a.port_num != 1 {
            return libc::EINVAL;
        }
        if m & IBV_QP_PKEY_INDEX != 0 && a.pkey_index != 0 {
            return libc::EINVAL;
        }
        if m & IBV_QP_ACCESS_FLAGS != 0 {
            match access_of(a.qp_access_flags as c_int, "ibv_modify_qp") {
                Ok(f) => r = r.access(f),
                Err(e) => return e,
            }
        }
        if m & IBV_QP_PATH_MTU != 0 {
            match mtu_from_c(a.path_mtu) {
                Some(mtu) => r = r.path_mtu(mtu),
                None => return libc::EINVAL,
            }
        }
        if m & IBV_QP_AV != 0 || m & IBV_QP_DEST_QPN != 0 {
            if m & IBV_QP_AV == 0 || m & IBV_QP_DEST_QPN == 0 {
                return libc::EINVAL;
            }
            // SAFETY: q.ctx is the QP's live context.
            let c = unsafe { &*q.ctx };
            match crate::addressing::with_destination(c, &q.rust, r, &a.ah_attr, a.dest_qp_num) {
                Ok(with) => r = with,
                Err(e) => return e,
            }
        }
        if m & IBV_QP_RQ_PSN != 0 {
            r = r.rq_psn(a.rq_psn & 0xff_ffff);
        }
        if m & IBV_QP_MAX_DEST_RD_ATOMIC != 0 {
            r = r.max_dest_rd_atomic(a.max_dest_rd_atomic);
        }
        if m & IBV_QP_MIN_RNR_TIMER != 0 {
            r = r.min_rnr_timer(a.min_rnr_timer);
        }
        if m & IBV_QP_SQ_PSN != 0 {
            r = r.sq_psn(a.sq_psn & 0xff_ffff);
        }
        if m & IBV_QP_TIMEOUT != 0 {
            r = r.timeout(a.timeout);
        }
        if m & IBV_QP_RETRY_CNT != 0 {
            r = r.retry_cnt(a.retry_cnt);
        }
        if m & IBV_QP_RNR_RETRY != 0 {
            r = r.rnr_retry(a.rnr_retry);
        }
        if m & IBV_QP_MAX_QP_RD_ATOMIC != 0 {
            r = r.max_rd_atomic(a.max_rd_atomic);
        }
        match q.rust.modify(&r) {
            Ok(()) => {
                q.qpx.qp_base.state = state_to_c(q.rust.state());
                0
            }
            Err(e) => fail("ibv_modify_qp", &e),
        }
    })
}

/// `ibv_query_qp`.
#[unsafe(export_name = "__shmhca_ibv_query_qp")]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    guard("ibv_query_qp", libc::EIO, || {
        // SAFETY: ours or null; the caller's structs.
        let (Some(q), Some(a)) = (unsafe { obj::<_, QpObj>(qp) }, unsafe { attr.as_mut() }) else {
            return libc::EINVAL;
        };
        let info = q.rust.query();
        let cfg = info.config;
        // SAFETY: plain data.
        *a = unsafe { std::mem::zeroed() };
        a.qp_state = state_to_c(info.state);
        a.cur_qp_state = a.qp_state;
        a.path_mtu = mtu_to_c(cfg.path_mtu);
        a.qp_access_flags = u32::from(cfg.access.bits());
        a.rq_psn = info.expected_psn;
        a.sq_psn = info.next_send_psn;
        a.dest_qp_num = cfg.dest.map_or(0, |d| d.qpn.get());
        a.max_dest_rd_atomic = cfg.max_dest_rd_atomic;
        a.min_rnr_timer = cfg.min_rnr_timer;
        a.timeout = cfg.timeout;
        a.retry_cnt = cfg.retry_cnt;
        a.rnr_retry = cfg.rnr_retry;
        a.max_rd_atomic = cfg.max_rd_atomic;
        a.port_num = 1;
        a.cap = ibv_qp_cap {
            max_send_wr: info.caps.max_send_wr,
            max_recv_wr: info.caps.max_recv_wr,
            max_send_sge: info.caps.max_send_sge,
            max_recv_sge: info.caps.max_recv_sge,
            max_inline_data: info.caps.max_inline_data,
        };
        // SAFETY: the caller's init attributes or null.
        if let Some(i) = unsafe { init.as_mut() } {
            let b = &q.qpx.qp_base;
            i.qp_context = b.qp_context;
            i.send_cq = b.send_cq;
            i.recv_cq = b.recv_cq;
            i.srq = b.srq;
            i.cap = a.cap;
            i.qp_type = IBV_QPT_RC;
            i.sq_sig_all = c_int::from(q.sig_all);
        }
        0
    })
}

/// `ibv_destroy_qp`.
#[unsafe(export_name = "__shmhca_ibv_destroy_qp")]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    guard("ibv_destroy_qp", libc::EIO, || {
        if qp.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: a QpObj of ours, given up by the caller; a QP's context outlives it.
        let c = unsafe { &*(*qp.cast::<QpObj>()).ctx };
        let reported = crate::context::unlink(&c.qps, qp as usize);
        // SAFETY: the QP's own mutex, condition and count (the object is freed only below).
        unsafe {
            crate::context::wait_for_acks(
                (&raw mut (*qp).mutex).cast(),
                (&raw mut (*qp).cond).cast(),
                &raw const (*qp).events_completed,
                reported,
            );
        }
        // SAFETY: a QpObj of ours, given up by the caller, unlinked and acknowledged.
        drop(unsafe { Box::from_raw(qp.cast::<QpObj>()) });
        0
    })
}
