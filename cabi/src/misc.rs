//! The rest of the public ABI: names of enum values, rate conversions, fork support, and
//! what shmhca does not have (address handles, multicast, imports, dma-buf, ECE), each
//! failing with the errno rdma-core's providers use and one `shmhca:` line.

use std::ffi::{c_char, c_int, c_void};
use std::ptr;

use crate::ffi::*;
use crate::util::{set_errno, unsupported};

/// `ibv_wc_status_str`.
#[unsafe(export_name = "__shmhca_ibv_wc_status_str")]
pub extern "C" fn ibv_wc_status_str(status: ibv_wc_status) -> *const c_char {
    let s: &'static std::ffi::CStr = match status {
        IBV_WC_SUCCESS => c"success",
        IBV_WC_LOC_LEN_ERR => c"local length error",
        IBV_WC_LOC_QP_OP_ERR => c"local QP operation error",
        IBV_WC_LOC_EEC_OP_ERR => c"local EE context operation error",
        IBV_WC_LOC_PROT_ERR => c"local protection error",
        IBV_WC_WR_FLUSH_ERR => c"Work Request Flushed Error",
        IBV_WC_MW_BIND_ERR => c"memory window bind error",
        IBV_WC_BAD_RESP_ERR => c"bad response error",
        IBV_WC_LOC_ACCESS_ERR => c"local access error",
        IBV_WC_REM_INV_REQ_ERR => c"remote invalid request error",
        IBV_WC_REM_ACCESS_ERR => c"remote access error",
        IBV_WC_REM_OP_ERR => c"remote operation error",
        IBV_WC_RETRY_EXC_ERR => c"transport retry counter exceeded",
        IBV_WC_RNR_RETRY_EXC_ERR => c"RNR retry counter exceeded",
        IBV_WC_LOC_RDD_VIOL_ERR => c"local RDD violation error",
        IBV_WC_REM_INV_RD_REQ_ERR => c"remote invalid RD request",
        IBV_WC_REM_ABORT_ERR => c"aborted error",
        IBV_WC_INV_EECN_ERR => c"invalid EE context number",
        IBV_WC_INV_EEC_STATE_ERR => c"invalid EE context state",
        IBV_WC_FATAL_ERR => c"fatal error",
        IBV_WC_RESP_TIMEOUT_ERR => c"response timeout error",
        IBV_WC_GENERAL_ERR => c"general error",
        IBV_WC_TM_ERR => c"TM error",
        IBV_WC_TM_RNDV_INCOMPLETE => c"TM software rendezvous",
        _ => c"unknown",
    };
    s.as_ptr()
}

/// `ibv_node_type_str`.
#[unsafe(export_name = "__shmhca_ibv_node_type_str")]
pub extern "C" fn ibv_node_type_str(t: ibv_node_type) -> *const c_char {
    let s: &'static std::ffi::CStr = match t {
        IBV_NODE_CA => c"InfiniBand channel adapter",
        IBV_NODE_SWITCH => c"InfiniBand switch",
        IBV_NODE_ROUTER => c"InfiniBand router",
        IBV_NODE_RNIC => c"iWARP NIC",
        IBV_NODE_USNIC => c"usNIC",
        IBV_NODE_USNIC_UDP => c"usNIC UDP",
        IBV_NODE_UNSPECIFIED => c"unspecified",
        _ => c"unknown",
    };
    s.as_ptr()
}

/// `ibv_port_state_str`.
#[unsafe(export_name = "__shmhca_ibv_port_state_str")]
pub extern "C" fn ibv_port_state_str(s: ibv_port_state) -> *const c_char {
    let s: &'static std::ffi::CStr = match s {
        IBV_PORT_NOP => c"PORT_NOP",
        IBV_PORT_DOWN => c"PORT_DOWN",
        IBV_PORT_INIT => c"PORT_INIT",
        IBV_PORT_ARMED => c"PORT_ARMED",
        IBV_PORT_ACTIVE => c"PORT_ACTIVE",
        IBV_PORT_ACTIVE_DEFER => c"PORT_ACTIVE_DEFER",
        _ => c"invalid state",
    };
    s.as_ptr()
}

/// `ibv_event_type_str`.
#[unsafe(export_name = "__shmhca_ibv_event_type_str")]
pub extern "C" fn ibv_event_type_str(e: ibv_event_type) -> *const c_char {
    let s: &'static std::ffi::CStr = match e {
        IBV_EVENT_CQ_ERR => c"CQ error",
        IBV_EVENT_QP_FATAL => c"local work queue catastrophic error",
        IBV_EVENT_QP_REQ_ERR => c"invalid request local work queue error",
        IBV_EVENT_QP_ACCESS_ERR => c"local access violation work queue error",
        IBV_EVENT_COMM_EST => c"communication established",
        IBV_EVENT_SQ_DRAINED => c"send queue drained",
        IBV_EVENT_PATH_MIG => c"path migrated",
        IBV_EVENT_PATH_MIG_ERR => c"path migration request error",
        IBV_EVENT_DEVICE_FATAL => c"local catastrophic error",
        IBV_EVENT_PORT_ACTIVE => c"port active",
        IBV_EVENT_PORT_ERR => c"port error",
        IBV_EVENT_LID_CHANGE => c"LID change",
        IBV_EVENT_PKEY_CHANGE => c"P_Key change",
        IBV_EVENT_SM_CHANGE => c"SM change",
        IBV_EVENT_SRQ_ERR => c"SRQ catastrophic error",
        IBV_EVENT_SRQ_LIMIT_REACHED => c"SRQ limit reached",
        IBV_EVENT_QP_LAST_WQE_REACHED => c"last WQE reached",
        IBV_EVENT_CLIENT_REREGISTER => c"client reregistration",
        IBV_EVENT_GID_CHANGE => c"GID table change",
        IBV_EVENT_WQ_FATAL => c"WQ fatal",
        _ => c"unknown",
    };
    s.as_ptr()
}

/// (rate, Mb/s) for every `ibv_rate`.
const RATES: [(ibv_rate, c_int); 23] = [
    (IBV_RATE_2_5_GBPS, 2_500),
    (IBV_RATE_5_GBPS, 5_000),
    (IBV_RATE_10_GBPS, 10_000),
    (IBV_RATE_20_GBPS, 20_000),
    (IBV_RATE_30_GBPS, 30_000),
    (IBV_RATE_40_GBPS, 40_000),
    (IBV_RATE_60_GBPS, 60_000),
    (IBV_RATE_80_GBPS, 80_000),
    (IBV_RATE_120_GBPS, 120_000),
    (IBV_RATE_14_GBPS, 14_062),
    (IBV_RATE_56_GBPS, 56_250),
    (IBV_RATE_112_GBPS, 112_500),
    (IBV_RATE_168_GBPS, 168_750),
    (IBV_RATE_25_GBPS, 25_781),
    (IBV_RATE_100_GBPS, 103_125),
    (IBV_RATE_200_GBPS, 206_250),
    (IBV_RATE_300_GBPS, 309_375),
    (IBV_RATE_28_GBPS, 28_125),
    (IBV_RATE_50_GBPS, 53_125),
    (IBV_RATE_400_GBPS, 425_000),
    (IBV_RATE_600_GBPS, 637_500),
    (IBV_RATE_800_GBPS, 850_000),
    (IBV_RATE_1200_GBPS, 1_275_000),
];

/// `ibv_rate_to_mbps`.
#[unsafe(export_name = "__shmhca_ibv_rate_to_mbps")]
pub extern "C" fn ibv_rate_to_mbps(rate: ibv_rate) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.1)
}

/// `mbps_to_ibv_rate`.
#[unsafe(export_name = "__shmhca_mbps_to_ibv_rate")]
pub extern "C" fn mbps_to_ibv_rate(mbps: c_int) -> ibv_rate {
    RATES
        .iter()
        .find(|r| r.1 == mbps)
        .map_or(IBV_RATE_MAX, |r| r.0)
}

/// `ibv_rate_to_mult`: the multiple of 2.5 Gb/s (the first nine rates).
#[unsafe(export_name = "__shmhca_ibv_rate_to_mult")]
pub extern "C" fn ibv_rate_to_mult(rate: ibv_rate) -> c_int {
    RATES[..9]
        .iter()
        .find(|r| r.0 == rate)
        .map_or(-1, |r| r.1 / 2_500)
}

/// `mult_to_ibv_rate`.
#[unsafe(export_name = "__shmhca_mult_to_ibv_rate")]
pub extern "C" fn mult_to_ibv_rate(mult: c_int) -> ibv_rate {
    RATES[..9]
        .iter()
        .find(|r| r.1 == mult * 2_500)
        .map_or(IBV_RATE_MAX, |r| r.0)
}

/// `ibv_fork_init`: nothing to do (shmhca pins no memory).
#[unsafe(export_name = "__shmhca_ibv_fork_init")]
pub extern "C" fn ibv_fork_init() -> c_int {
    0
}

/// `ibv_is_fork_initialized`: fork protection is not needed.
#[unsafe(export_name = "__shmhca_ibv_is_fork_initialized")]
pub extern "C" fn ibv_is_fork_initialized() -> ibv_fork_status {
    IBV_FORK_UNNEEDED
}

/// `ibv_dontfork_range`: nothing to do.
#[unsafe(export_name = "__shmhca_ibv_dontfork_range")]
pub extern "C" fn ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// `ibv_dofork_range`: nothing to do.
#[unsafe(export_name = "__shmhca_ibv_dofork_range")]
pub extern "C" fn ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// `ibv_get_sysfs_path`: shmhca has no sysfs directory.
#[unsafe(export_name = "__shmhca_ibv_get_sysfs_path")]
pub extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// `ibv_read_sysfs_file`: shmhca's device has no sysfs files.
#[unsafe(export_name = "__shmhca_ibv_read_sysfs_file")]
pub extern "C" fn ibv_read_sysfs_file(
    _dir: *const c_char,
    _file: *const c_char,
    _buf: *mut c_char,
    _size: usize,
) -> c_int {
    set_errno(libc::ENOENT);
    -1
}

/// `ibv_query_qp_data_in_order`: no in-order guarantee is promised (0).
#[unsafe(export_name = "__shmhca_ibv_query_qp_data_in_order")]
pub extern "C" fn ibv_query_qp_data_in_order(
    _qp: *mut ibv_qp,
    _op: ibv_wr_opcode,
    _flags: u32,
) -> c_int {
    0
}

macro_rules! null_unsupported {
    ($($name:ident($($a:ident: $t:ty),*) => $what:literal;)*) => {$(
        #[doc = concat!("`", stringify!($name), "`: not supported (null, errno EOPNOTSUPP).")]
        #[unsafe(export_name = concat!("__shmhca_", stringify!($name)))]
        pub extern "C" fn $name($($a: $t),*) -> *mut c_void {
            $(let _ = $a;)*
            unsupported($what, "shmhca has only RC queue pairs over its own fabric", libc::EOPNOTSUPP);
            ptr::null_mut()
        }
    )*};
}

macro_rules! errno_unsupported {
    ($($name:ident($($a:ident: $t:ty),*) => $what:literal, $ret:expr;)*) => {$(
        #[doc = concat!("`", stringify!($name), "`: not supported.")]
        #[unsafe(export_name = concat!("__shmhca_", stringify!($name)))]
        pub extern "C" fn $name($($a: $t),*) -> c_int {
            $(let _ = $a;)*
            let e = unsupported($what, "shmhca has only RC queue pairs over its own fabric", libc::EOPNOTSUPP);
            $ret(e)
        }
    )*};
}

fn neg1(_e: c_int) -> c_int {
    -1
}
fn same(e: c_int) -> c_int {
    e
}

null_unsupported! {
    ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) => "address handles (UD)";
    ibv_create_ah_from_wc(pd: *mut ibv_pd, wc: *mut ibv_wc, grh: *mut c_void, port: u8) => "address handles (UD)";
    ibv_import_device(fd: c_int) => "ibv_import_device";
    ibv_import_pd(c: *mut ibv_context, h: u32) => "ibv_import_pd";
    ibv_import_mr(pd: *mut ibv_pd, h: u32) => "ibv_import_mr";
    ibv_import_dm(c: *mut ibv_context, h: u32) => "device memory";
    ibv_reg_dmabuf_mr(pd: *mut ibv_pd, off: u64, len: usize, iova: u64, fd: c_int, access: c_int) => "dma-buf memory regions";
}

errno_unsupported! {
    ibv_destroy_ah(ah: *mut ibv_ah) => "address handles (UD)", same;
    ibv_init_ah_from_wc(c: *mut ibv_context, port: u8, wc: *mut ibv_wc, grh: *mut c_void, attr: *mut ibv_ah_attr) => "address handles (UD)", neg1;
    ibv_attach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) => "multicast", same;
    ibv_detach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) => "multicast", same;
    ibv_rereg_mr(mr: *mut ibv_mr, flags: c_int, pd: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_int) => "ibv_rereg_mr", same;
    ibv_resolve_eth_l2_from_gid(c: *mut ibv_context, attr: *mut ibv_ah_attr, mac: *mut u8, vid: *mut u16) => "Ethernet address resolution (RoCE)", same;
    ibv_set_ece(qp: *mut ibv_qp, ece: *mut c_void) => "enhanced connection establishment (ECE)", same;
    ibv_query_ece(qp: *mut ibv_qp, ece: *mut c_void) => "enhanced connection establishment (ECE)", same;
}

/// `ibv_unimport_pd`: nothing was imported.
#[unsafe(export_name = "__shmhca_ibv_unimport_pd")]
pub extern "C" fn ibv_unimport_pd(_pd: *mut ibv_pd) {}
/// `ibv_unimport_mr`: nothing was imported.
#[unsafe(export_name = "__shmhca_ibv_unimport_mr")]
pub extern "C" fn ibv_unimport_mr(_mr: *mut ibv_mr) {}
/// `ibv_unimport_dm`: nothing was imported.
#[unsafe(export_name = "__shmhca_ibv_unimport_dm")]
pub extern "C" fn ibv_unimport_dm(_dm: *mut c_void) {}
/// `ibv_copy_qp_attr_from_kern`: there is no kernel ABI; nothing is copied.
#[unsafe(export_name = "__shmhca_ibv_copy_qp_attr_from_kern")]
pub extern "C" fn ibv_copy_qp_attr_from_kern(_dst: *mut ibv_qp_attr, _src: *mut c_void) {}
/// `ibv_copy_ah_attr_from_kern`: there is no kernel ABI; nothing is copied.
#[unsafe(export_name = "__shmhca_ibv_copy_ah_attr_from_kern")]
pub extern "C" fn ibv_copy_ah_attr_from_kern(_dst: *mut ibv_ah_attr, _src: *mut c_void) {}
/// `ibv_copy_path_rec_from_kern`: there is no kernel ABI; nothing is copied.
#[unsafe(export_name = "__shmhca_ibv_copy_path_rec_from_kern")]
pub extern "C" fn ibv_copy_path_rec_from_kern(_dst: *mut c_void, _src: *mut c_void) {}
/// `ibv_copy_path_rec_to_kern`: there is no kernel ABI; nothing is copied.
#[unsafe(export_name = "__shmhca_ibv_copy_path_rec_to_kern")]
pub extern "C" fn ibv_copy_path_rec_to_kern(_dst: *mut c_void, _src: *mut c_void) {}
