//! The C types of `<rdma/rdma_cma.h>` and the `<infiniband/verbs.h>` types it uses,
//! generated once by `scripts/bindgen.sh` (committed), and the verbs functions this library
//! calls: the public API of `libibverbs.so.1` only, as rdma-core's librdmacm uses it.
#![allow(missing_docs)]

mod rdma_cma;
pub use rdma_cma::*;

unsafe extern "C" {
    pub fn ibv_get_device_list(num: *mut libc::c_int) -> *mut *mut ibv_device;
    pub fn ibv_free_device_list(list: *mut *mut ibv_device);
    pub fn ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context;
    pub fn ibv_query_device(ctx: *mut ibv_context, attr: *mut ibv_device_attr) -> libc::c_int;
    pub fn ibv_query_port(ctx: *mut ibv_context, port: u8, attr: *mut ibv_port_attr)
    -> libc::c_int;
    pub fn ibv_query_gid(
        ctx: *mut ibv_context,
        port: u8,
        index: libc::c_int,
        gid: *mut ibv_gid,
    ) -> libc::c_int;
    pub fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd;
    pub fn ibv_create_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp;
    pub fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: libc::c_int)
    -> libc::c_int;
    pub fn ibv_destroy_qp(qp: *mut ibv_qp) -> libc::c_int;
}
