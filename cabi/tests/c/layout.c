/* The offsets and sizes of every field <infiniband/verbs.h>'s static inline functions
 * reach, as the system's C compiler lays them out. src/layout.rs reads this table and
 * tests/c_layout.rs compares it with the Rust types (src/ffi, from bindgen). */
#include <stddef.h>
#include <infiniband/verbs.h>

struct shmhca_probe {
    const char *name;
    size_t value;
};

#define OFF(s, f) {#s "." #f, offsetof(struct s, f)}
#define SIZE(s) {"sizeof " #s, sizeof(struct s)}

const struct shmhca_probe shmhca_verbs_layout[] = {
    SIZE(ibv_context), OFF(ibv_context, device), OFF(ibv_context, ops), OFF(ibv_context, cmd_fd),
    OFF(ibv_context, async_fd), OFF(ibv_context, num_comp_vectors), OFF(ibv_context, mutex),
    OFF(ibv_context, abi_compat),
    SIZE(ibv_context_ops), OFF(ibv_context_ops, alloc_mw), OFF(ibv_context_ops, bind_mw),
    OFF(ibv_context_ops, dealloc_mw), OFF(ibv_context_ops, poll_cq),
    OFF(ibv_context_ops, req_notify_cq), OFF(ibv_context_ops, post_srq_recv),
    OFF(ibv_context_ops, post_send), OFF(ibv_context_ops, post_recv),
    SIZE(verbs_context), OFF(verbs_context, query_port), OFF(verbs_context, advise_mr),
    OFF(verbs_context, alloc_null_mr), OFF(verbs_context, read_counters),
    OFF(verbs_context, create_counters), OFF(verbs_context, reg_dm_mr),
    OFF(verbs_context, alloc_dm), OFF(verbs_context, modify_cq), OFF(verbs_context, post_srq_ops),
    OFF(verbs_context, create_wq), OFF(verbs_context, query_rt_values),
    OFF(verbs_context, create_cq_ex), OFF(verbs_context, priv),
    OFF(verbs_context, query_device_ex), OFF(verbs_context, ibv_create_flow),
    OFF(verbs_context, open_qp), OFF(verbs_context, create_qp_ex),
    OFF(verbs_context, get_srq_num), OFF(verbs_context, create_srq_ex),
    OFF(verbs_context, open_xrcd), OFF(verbs_context, close_xrcd), OFF(verbs_context, sz),
    OFF(verbs_context, context),
    SIZE(ibv_device), OFF(ibv_device, node_type), OFF(ibv_device, transport_type),
    OFF(ibv_device, name), OFF(ibv_device, dev_name), OFF(ibv_device, dev_path),
    OFF(ibv_device, ibdev_path),
    SIZE(ibv_qp), OFF(ibv_qp, context), OFF(ibv_qp, qp_context), OFF(ibv_qp, pd),
    OFF(ibv_qp, send_cq), OFF(ibv_qp, recv_cq), OFF(ibv_qp, srq), OFF(ibv_qp, qp_num),
    OFF(ibv_qp, state), OFF(ibv_qp, qp_type),
    SIZE(ibv_qp_ex), OFF(ibv_qp_ex, qp_base), OFF(ibv_qp_ex, comp_mask), OFF(ibv_qp_ex, wr_id),
    OFF(ibv_qp_ex, wr_flags), OFF(ibv_qp_ex, wr_atomic_cmp_swp),
    OFF(ibv_qp_ex, wr_atomic_fetch_add), OFF(ibv_qp_ex, wr_bind_mw),
    OFF(ibv_qp_ex, wr_local_inv), OFF(ibv_qp_ex, wr_rdma_read), OFF(ibv_qp_ex, wr_rdma_write),
    OFF(ibv_qp_ex, wr_rdma_write_imm), OFF(ibv_qp_ex, wr_send), OFF(ibv_qp_ex, wr_send_imm),
    OFF(ibv_qp_ex, wr_send_inv), OFF(ibv_qp_ex, wr_send_tso), OFF(ibv_qp_ex, wr_set_ud_addr),
    OFF(ibv_qp_ex, wr_set_xrc_srqn), OFF(ibv_qp_ex, wr_set_inline_data),
    OFF(ibv_qp_ex, wr_set_inline_data_list), OFF(ibv_qp_ex, wr_set_sge),
    OFF(ibv_qp_ex, wr_set_sge_list), OFF(ibv_qp_ex, wr_start), OFF(ibv_qp_ex, wr_complete),
    OFF(ibv_qp_ex, wr_abort), OFF(ibv_qp_ex, wr_atomic_write),
    SIZE(ibv_cq), OFF(ibv_cq, context), OFF(ibv_cq, channel), OFF(ibv_cq, cq_context),
    OFF(ibv_cq, handle), OFF(ibv_cq, cqe), OFF(ibv_cq, mutex), OFF(ibv_cq, cond),
    OFF(ibv_cq, comp_events_completed), OFF(ibv_cq, async_events_completed),
    SIZE(ibv_comp_channel), OFF(ibv_comp_channel, context), OFF(ibv_comp_channel, fd),
    OFF(ibv_comp_channel, refcnt),
    SIZE(ibv_srq), OFF(ibv_srq, context), OFF(ibv_srq, srq_context), OFF(ibv_srq, pd),
    SIZE(ibv_pd), OFF(ibv_pd, context),
    SIZE(ibv_mr), OFF(ibv_mr, context), OFF(ibv_mr, pd), OFF(ibv_mr, addr), OFF(ibv_mr, length),
    OFF(ibv_mr, lkey), OFF(ibv_mr, rkey),
    SIZE(ibv_mw), OFF(ibv_mw, context), OFF(ibv_mw, pd), OFF(ibv_mw, rkey), OFF(ibv_mw, type),
    SIZE(ibv_wc), OFF(ibv_wc, wr_id), OFF(ibv_wc, status), OFF(ibv_wc, opcode),
    OFF(ibv_wc, byte_len), OFF(ibv_wc, imm_data), OFF(ibv_wc, qp_num), OFF(ibv_wc, src_qp),
    OFF(ibv_wc, wc_flags), OFF(ibv_wc, pkey_index), OFF(ibv_wc, slid), OFF(ibv_wc, sl),
    OFF(ibv_wc, dlid_path_bits),
    SIZE(ibv_send_wr), OFF(ibv_send_wr, wr_id), OFF(ibv_send_wr, next),
    OFF(ibv_send_wr, sg_list), OFF(ibv_send_wr, num_sge), OFF(ibv_send_wr, opcode),
    OFF(ibv_send_wr, send_flags), OFF(ibv_send_wr, imm_data), OFF(ibv_send_wr, wr.rdma.remote_addr),
    OFF(ibv_send_wr, wr.rdma.rkey), OFF(ibv_send_wr, wr.atomic.compare_add),
    OFF(ibv_send_wr, wr.atomic.swap), OFF(ibv_send_wr, bind_mw.rkey),
    SIZE(ibv_recv_wr), OFF(ibv_recv_wr, wr_id), OFF(ibv_recv_wr, next), OFF(ibv_recv_wr, sg_list),
    OFF(ibv_recv_wr, num_sge),
    SIZE(ibv_sge), OFF(ibv_sge, addr), OFF(ibv_sge, length), OFF(ibv_sge, lkey),
    SIZE(ibv_mw_bind), OFF(ibv_mw_bind, wr_id), OFF(ibv_mw_bind, send_flags),
    OFF(ibv_mw_bind, bind_info),
    SIZE(ibv_port_attr), OFF(ibv_port_attr, lid), OFF(ibv_port_attr, link_layer),
    OFF(ibv_port_attr, port_cap_flags2),
    SIZE(ibv_qp_init_attr_ex), OFF(ibv_qp_init_attr_ex, comp_mask), OFF(ibv_qp_init_attr_ex, pd),
    OFF(ibv_qp_init_attr_ex, send_ops_flags),
    SIZE(ibv_device_attr_ex), SIZE(ibv_gid_entry),
};

const size_t shmhca_verbs_layout_len =
    sizeof(shmhca_verbs_layout) / sizeof(shmhca_verbs_layout[0]);
