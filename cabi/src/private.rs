//! rdma-core's private provider ABI (`IBVERBS_PRIVATE_<N>`). Debian's perftest links the
//! mlx5 and efa providers directly, and the loader (BIND_NOW) refuses to start it unless
//! every symbol they import from libibverbs exists in that version node. shmhca loads no
//! provider, so none of these is ever called by a working program: the driver-registration
//! entry point (called from the providers' constructors) does nothing, and every other one
//! fails (ENOSYS, or null).

use std::ffi::{c_int, c_void};

use crate::util::set_errno;

/// `verbs_register_driver_<N>`: providers call it from their constructors; shmhca loads
/// no provider, so nothing is registered. (`verbs_allow_disassociate_destroy`, the node's
/// one data symbol, is a byte 0 defined by build.rs's assembly.)
#[unsafe(export_name = "__shmhca_verbs_register_driver")]
pub extern "C" fn verbs_register_driver(_ops: *const c_void) {}

macro_rules! enosys {
    ($($name:ident),* $(,)?) => {$(
        #[doc = concat!("`", stringify!($name), "` (private provider ABI): ENOSYS, shmhca loads no provider.")]
        #[unsafe(export_name = concat!("__shmhca_", stringify!($name)))]
        pub extern "C" fn $name() -> c_int {
            set_errno(libc::ENOSYS);
            libc::ENOSYS
        }
    )*};
}

macro_rules! null {
    ($($name:ident),* $(,)?) => {$(
        #[doc = concat!("`", stringify!($name), "` (private provider ABI): null, errno ENOSYS.")]
        #[unsafe(export_name = concat!("__shmhca_", stringify!($name)))]
        pub extern "C" fn $name() -> *mut c_void {
            set_errno(libc::ENOSYS);
            std::ptr::null_mut()
        }
    )*};
}

macro_rules! nothing {
    ($($name:ident),* $(,)?) => {$(
        #[doc = concat!("`", stringify!($name), "` (private provider ABI): does nothing.")]
        #[unsafe(export_name = concat!("__shmhca_", stringify!($name)))]
        pub extern "C" fn $name() {}
    )*};
}

null!(_verbs_init_and_alloc_context, verbs_open_device);
nothing!(
    verbs_init_cq,
    verbs_set_ops,
    verbs_uninit_context,
    __verbs_log
);

/// `__ioctl_final_num_attrs` (private provider ABI): 0 attributes.
#[unsafe(export_name = "__shmhca___ioctl_final_num_attrs")]
pub extern "C" fn __ioctl_final_num_attrs() -> u32 {
    0
}

enosys!(
    execute_ioctl,
    ibv_cmd_advise_mr,
    ibv_cmd_alloc_dm,
    ibv_cmd_alloc_mw,
    ibv_cmd_alloc_pd,
    ibv_cmd_attach_mcast,
    ibv_cmd_close_xrcd,
    ibv_cmd_create_ah,
    ibv_cmd_create_counters,
    ibv_cmd_create_cq,
    ibv_cmd_create_cq_ex,
    ibv_cmd_create_flow,
    ibv_cmd_create_flow_action_esp,
    ibv_cmd_create_qp,
    ibv_cmd_create_qp_ex,
    ibv_cmd_create_qp_ex2,
    ibv_cmd_create_rwq_ind_table,
    ibv_cmd_create_srq,
    ibv_cmd_create_srq_ex,
    ibv_cmd_create_wq,
    ibv_cmd_dealloc_mw,
    ibv_cmd_dealloc_pd,
    ibv_cmd_dereg_mr,
    ibv_cmd_destroy_ah,
    ibv_cmd_destroy_counters,
    ibv_cmd_destroy_cq,
    ibv_cmd_destroy_flow,
    ibv_cmd_destroy_flow_action,
    ibv_cmd_destroy_qp,
    ibv_cmd_destroy_rwq_ind_table,
    ibv_cmd_destroy_srq,
    ibv_cmd_destroy_wq,
    ibv_cmd_detach_mcast,
    ibv_cmd_free_dm,
    ibv_cmd_get_context,
    ibv_cmd_modify_cq,
    ibv_cmd_modify_flow_action_esp,
    ibv_cmd_modify_qp,
    ibv_cmd_modify_qp_ex,
    ibv_cmd_modify_srq,
    ibv_cmd_modify_wq,
    ibv_cmd_open_qp,
    ibv_cmd_open_xrcd,
    ibv_cmd_poll_cq,
    ibv_cmd_post_recv,
    ibv_cmd_post_send,
    ibv_cmd_post_srq_recv,
    ibv_cmd_query_context,
    ibv_cmd_query_device_any,
    ibv_cmd_query_mr,
    ibv_cmd_query_port,
    ibv_cmd_query_qp,
    ibv_cmd_query_srq,
    ibv_cmd_read_counters,
    ibv_cmd_reg_dmabuf_mr,
    ibv_cmd_reg_dm_mr,
    ibv_cmd_reg_mr,
    ibv_cmd_req_notify_cq,
    ibv_cmd_rereg_mr,
    ibv_cmd_resize_cq,
    ibv_read_ibdev_sysfs_file,
);
