//! The C compiler's layout of the verbs.h fields the static inlines reach (`tests/c/layout.c`,
//! compiled against the system's headers by build.rs) next to the Rust layout this library
//! uses; `tests/c_layout.rs` compares them.

use std::ffi::{CStr, c_char};
use std::mem::{offset_of, size_of};

use crate::ffi::*;

#[repr(C)]
struct Probe {
    name: *const c_char,
    value: usize,
}

unsafe extern "C" {
    static shmhca_verbs_layout: [Probe; 0];
    static shmhca_verbs_layout_len: usize;
}

/// The C table: (`struct.field` or `sizeof struct`, value).
pub fn c_layout() -> Vec<(String, usize)> {
    // SAFETY: the table and its length are constants of tests/c/layout.c; each name is a
    // NUL-terminated string literal.
    unsafe {
        let n = shmhca_verbs_layout_len;
        let base = (&raw const shmhca_verbs_layout).cast::<Probe>();
        (0..n)
            .map(|i| {
                let p = &*base.add(i);
                (
                    CStr::from_ptr(p.name).to_string_lossy().into_owned(),
                    p.value,
                )
            })
            .collect()
    }
}

macro_rules! rust_table {
    ($( $kind:ident $s:ident $(. $f:ident)* ;)*) => {
        vec![$( rust_table!(@one $kind $s $(. $f)*) ),*]
    };
    (@one size $s:ident) => { (format!("sizeof {}", stringify!($s)), size_of::<$s>()) };
    (@one off $s:ident . $($f:ident).+) => {
        (format!("{}.{}", stringify!($s), stringify!($($f).+).replace(' ', "")), offset_of!($s, $($f).+))
    };
}

/// The same entries from the Rust types.
pub fn rust_layout() -> Vec<(String, usize)> {
    let mut v: Vec<(String, usize)> = rust_table! {
        size ibv_context; off ibv_context.device; off ibv_context.ops; off ibv_context.cmd_fd;
        off ibv_context.async_fd; off ibv_context.num_comp_vectors; off ibv_context.mutex;
        off ibv_context.abi_compat;
        size ibv_context_ops; off ibv_context_ops.alloc_mw; off ibv_context_ops.bind_mw;
        off ibv_context_ops.dealloc_mw; off ibv_context_ops.poll_cq;
        off ibv_context_ops.req_notify_cq; off ibv_context_ops.post_srq_recv;
        off ibv_context_ops.post_send; off ibv_context_ops.post_recv;
        size verbs_context; off verbs_context.query_port; off verbs_context.advise_mr;
        off verbs_context.alloc_null_mr; off verbs_context.read_counters;
        off verbs_context.create_counters; off verbs_context.reg_dm_mr;
        off verbs_context.alloc_dm; off verbs_context.modify_cq; off verbs_context.post_srq_ops;
        off verbs_context.create_wq; off verbs_context.query_rt_values;
        off verbs_context.create_cq_ex; off verbs_context.priv_;
        off verbs_context.query_device_ex; off verbs_context.ibv_create_flow;
        off verbs_context.open_qp; off verbs_context.create_qp_ex;
        off verbs_context.get_srq_num; off verbs_context.create_srq_ex;
        off verbs_context.open_xrcd; off verbs_context.close_xrcd; off verbs_context.sz;
        off verbs_context.context;
        size ibv_device; off ibv_device.node_type; off ibv_device.transport_type;
        off ibv_device.name; off ibv_device.dev_name; off ibv_device.dev_path;
        off ibv_device.ibdev_path;
        size ibv_qp; off ibv_qp.context; off ibv_qp.qp_context; off ibv_qp.pd;
        off ibv_qp.send_cq; off ibv_qp.recv_cq; off ibv_qp.srq; off ibv_qp.qp_num;
        off ibv_qp.state; off ibv_qp.qp_type;
        size ibv_qp_ex; off ibv_qp_ex.qp_base; off ibv_qp_ex.comp_mask; off ibv_qp_ex.wr_id;
        off ibv_qp_ex.wr_flags; off ibv_qp_ex.wr_atomic_cmp_swp;
        off ibv_qp_ex.wr_atomic_fetch_add; off ibv_qp_ex.wr_bind_mw;
        off ibv_qp_ex.wr_local_inv; off ibv_qp_ex.wr_rdma_read; off ibv_qp_ex.wr_rdma_write;
        off ibv_qp_ex.wr_rdma_write_imm; off ibv_qp_ex.wr_send; off ibv_qp_ex.wr_send_imm;
        off ibv_qp_ex.wr_send_inv; off ibv_qp_ex.wr_send_tso; off ibv_qp_ex.wr_set_ud_addr;
        off ibv_qp_ex.wr_set_xrc_srqn; off ibv_qp_ex.wr_set_inline_data;
        off ibv_qp_ex.wr_set_inline_data_list; off ibv_qp_ex.wr_set_sge;
        off ibv_qp_ex.wr_set_sge_list; off ibv_qp_ex.wr_start; off ibv_qp_ex.wr_complete;
        off ibv_qp_ex.wr_abort; off ibv_qp_ex.wr_atomic_write;
        size ibv_cq; off ibv_cq.context; off ibv_cq.channel; off ibv_cq.cq_context;
        off ibv_cq.handle; off ibv_cq.cqe; off ibv_cq.mutex; off ibv_cq.cond;
        off ibv_cq.comp_events_completed; off ibv_cq.async_events_completed;
        size ibv_comp_channel; off ibv_comp_channel.context; off ibv_comp_channel.fd;
        off ibv_comp_channel.refcnt;
        size ibv_srq; off ibv_srq.context; off ibv_srq.srq_context; off ibv_srq.pd;
        size ibv_pd; off ibv_pd.context;
        size ibv_mr; off ibv_mr.context; off ibv_mr.pd; off ibv_mr.addr; off ibv_mr.length;
        off ibv_mr.lkey; off ibv_mr.rkey;
        size ibv_mw; off ibv_mw.context; off ibv_mw.pd; off ibv_mw.rkey; off ibv_mw.type_;
        size ibv_wc; off ibv_wc.wr_id; off ibv_wc.status; off ibv_wc.opcode;
        off ibv_wc.byte_len; off ibv_wc.__bindgen_anon_1; off ibv_wc.qp_num; off ibv_wc.src_qp;
        off ibv_wc.wc_flags; off ibv_wc.pkey_index; off ibv_wc.slid; off ibv_wc.sl;
        off ibv_wc.dlid_path_bits;
        size ibv_send_wr; off ibv_send_wr.wr_id; off ibv_send_wr.next;
        off ibv_send_wr.sg_list; off ibv_send_wr.num_sge; off ibv_send_wr.opcode;
        off ibv_send_wr.send_flags; off ibv_send_wr.__bindgen_anon_1;
        off ibv_send_wr.wr.rdma.remote_addr; off ibv_send_wr.wr.rdma.rkey;
        off ibv_send_wr.wr.atomic.compare_add; off ibv_send_wr.wr.atomic.swap;
        off ibv_send_wr.__bindgen_anon_2.bind_mw.rkey;
        size ibv_recv_wr; off ibv_recv_wr.wr_id; off ibv_recv_wr.next; off ibv_recv_wr.sg_list;
        off ibv_recv_wr.num_sge;
        size ibv_sge; off ibv_sge.addr; off ibv_sge.length; off ibv_sge.lkey;
        size ibv_mw_bind; off ibv_mw_bind.wr_id; off ibv_mw_bind.send_flags;
        off ibv_mw_bind.bind_info;
        size ibv_port_attr; off ibv_port_attr.lid; off ibv_port_attr.link_layer;
        off ibv_port_attr.port_cap_flags2;
        size ibv_qp_init_attr_ex; off ibv_qp_init_attr_ex.comp_mask; off ibv_qp_init_attr_ex.pd;
        off ibv_qp_init_attr_ex.send_ops_flags;
        size ibv_device_attr_ex; size ibv_gid_entry;
    };
    // Names bindgen changed: C's `priv`, `type`, the anonymous unions.
    for (name, _) in &mut v {
        *name = name
            .replace(".priv_", ".priv")
            .replace(".type_", ".type")
            .replace("ibv_wc.__bindgen_anon_1", "ibv_wc.imm_data")
            .replace("ibv_send_wr.__bindgen_anon_1", "ibv_send_wr.imm_data")
            .replace(
                "ibv_send_wr.__bindgen_anon_2.bind_mw",
                "ibv_send_wr.bind_mw",
            );
    }
    v
}
