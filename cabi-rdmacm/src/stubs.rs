//! What shmhca's rdma_cm does not provide: each entry point sets errno ENOSYS, says so once
//! on stderr (`shmhca: NAME is not supported …`) and returns -1 (a null pointer for
//! `rdma_get_devices`). `rpoll` is `poll` (on ordinary file descriptors, as rsockets' is).

use crate::util::{err, guard, say_once};

macro_rules! unsupported {
    ($($name:ident)*) => {$(
        #[doc = concat!("`", stringify!($name), "`: not supported (ENOSYS).")]
        #[unsafe(export_name = concat!("__shmhca_", stringify!($name)))]
        pub extern "C" fn $name() -> i64 {
            guard(stringify!($name), -1, || {
                say_once(format!(
                    "{} is not supported by shmhca's rdma_cm (RC connections through \
                     rdma_connect/rdma_accept only)",
                    stringify!($name)
                ));
                i64::from(err(libc::ENOSYS))
            })
        }
    )*};
}

unsupported! {
    raccept
    rbind
    rclose
    rconnect
    rdma_create_ep
    rdma_create_srq
    rdma_create_srq_ex
    rdma_destroy_ep
    rdma_destroy_srq
    rdma_free_devices
    rdma_get_request
    rdma_join_multicast
    rdma_leave_multicast
    rdma_migrate_id
    rdma_notify
    rfcntl
    rgetpeername
    rgetsockname
    rgetsockopt
    riomap
    riounmap
    riowrite
    rlisten
    rread
    rreadv
    rrecv
    rrecvfrom
    rrecvmsg
    rselect
    rsend
    rsendmsg
    rsendto
    rsetsockopt
    rshutdown
    rsocket
    rwrite
    rwritev
    rdma_join_multicast_ex
    rdma_establish
    rdma_init_qp_attr
    rdma_get_remote_ece
    rdma_reject_ece
    rdma_set_local_ece
}

/// `rdma_get_devices`: not supported (ENOSYS, null).
#[unsafe(export_name = "__shmhca_rdma_get_devices")]
pub extern "C" fn rdma_get_devices(_num: *mut libc::c_int) -> *mut *mut libc::c_void {
    guard("rdma_get_devices", std::ptr::null_mut(), || {
        say_once(
            "rdma_get_devices is not supported by shmhca's rdma_cm (use ibv_get_device_list)"
                .into(),
        );
        err(libc::ENOSYS);
        std::ptr::null_mut()
    })
}

/// `rpoll`: `poll` (the descriptors are ordinary ones: shmhca has no rsockets).
#[unsafe(export_name = "__shmhca_rpoll")]
pub unsafe extern "C" fn rpoll(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: libc::c_int,
) -> libc::c_int {
    // SAFETY: the caller's poll array of `nfds` entries, as for poll(2).
    guard("rpoll", -1, || unsafe { libc::poll(fds, nfds, timeout) })
}
