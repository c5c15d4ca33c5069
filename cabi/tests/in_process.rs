//! The C ABI's data path in one process: two contexts opened with `ibv_open_device`, objects
//! made with the exported functions, and every post and poll through `ibv_context.ops` and
//! `ibv_qp_ex` — as verbs.h's static inlines call them. The two QPs are connected with the
//! Rust API (a link between the two engines of this process); connecting by LID/GID is the
//! cross-process tests' part (verbs_tools).

// A test of an FFI: each block drives the C ABI as a C program would, with the pointers it
// made; one SAFETY comment per block says so.
#![allow(clippy::multiple_unsafe_ops_per_block)]

use std::ffi::c_int;
use std::ptr;
use std::time::{Duration, Instant};

use shmhca_verbs_core::context::*;
use shmhca_verbs_core::ffi::*;
use shmhca_verbs_core::objects::*;
use shmhca_verbs_core::qp::*;

struct Side {
    ch: *mut ibv_comp_channel,
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    buf: Vec<u8>,
    mr: *mut ibv_mr,
}

fn ops(c: *mut ibv_context) -> ibv_context_ops {
    // SAFETY: a context of ours.
    unsafe { (*c).ops }
}

fn side(access: c_int, with_channel: bool) -> Side {
    // SAFETY: the exported functions with the arguments verbs.h documents.
    unsafe {
        let mut n = 0;
        let list = ibv_get_device_list(&mut n);
        assert_eq!(n, 1);
        let ctx = ibv_open_device(*list);
        ibv_free_device_list(list);
        assert!(!ctx.is_null());
        let pd = ibv_alloc_pd(ctx);
        let ch = if with_channel {
            ibv_create_comp_channel(ctx)
        } else {
            ptr::null_mut()
        };
        let cq = ibv_create_cq(ctx, 64, 0x5eed as *mut std::ffi::c_void, ch, 0);
        let mut buf = vec![0u8; 8192];
        let mr = ibv_reg_mr(pd, buf.as_mut_ptr().cast(), buf.len(), access);
        assert!(!mr.is_null());
        let mut attr: ibv_qp_init_attr_ex = std::mem::zeroed();
        attr.send_cq = cq;
        attr.recv_cq = cq;
        attr.cap = ibv_qp_cap {
            max_send_wr: 32,
            max_recv_wr: 32,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 256,
        };
        attr.qp_type = IBV_QPT_RC;
        attr.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
        attr.pd = pd;
        attr.send_ops_flags = u64::from(
            IBV_QP_EX_WITH_SEND
                | IBV_QP_EX_WITH_RDMA_WRITE
                | IBV_QP_EX_WITH_RDMA_READ
                | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
                | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP,
        );
        let create = shmhca_verbs_core::context::ctx_of(ctx)
            .unwrap()
            .vctx
            .create_qp_ex
            .unwrap();
        let qp = create(ctx, &mut attr);
        assert!(!qp.is_null());
        Side {
            ch,
            ctx,
            pd,
            cq,
            qp,
            buf,
            mr,
        }
    }
}

fn connect(a: &Side, b: &Side) {
    // SAFETY: our contexts and QPs.
    unsafe {
        let ca = ctx_of(a.ctx).unwrap();
        let cb = ctx_of(b.ctx).unwrap();
        let (la, lb) = ca.ctx.link_with(&cb.ctx).unwrap();
        for (s, link, peer) in [(a, la, b.qp), (b, lb, a.qp)] {
            let mut attr: ibv_qp_attr = std::mem::zeroed();
            attr.qp_state = IBV_QPS_INIT;
            attr.port_num = 1;
            attr.qp_access_flags =
                IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
            let m = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
            assert_eq!(ibv_modify_qp(s.qp, &mut attr, m as c_int), 0);
            let q = &mut *s.qp.cast::<QpObj>();
            let dest = shmhca::Destination {
                link,
                qpn: shmhca::Qpn::new((*peer).qp_num),
            };
            q.rust
                .modify(
                    &shmhca::QpAttr::new(shmhca::QpState::Rtr)
                        .path_mtu(shmhca::Mtu::Mtu4096)
                        .dest(dest)
                        .rq_psn(0)
                        .max_dest_rd_atomic(4)
                        .min_rnr_timer(1),
                )
                .unwrap();
            let mut attr: ibv_qp_attr = std::mem::zeroed();
            attr.qp_state = IBV_QPS_RTS;
            attr.timeout = 14;
            attr.retry_cnt = 7;
            attr.rnr_retry = 7;
            attr.max_rd_atomic = 4;
            let m = IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC;
            assert_eq!(ibv_modify_qp(s.qp, &mut attr, m as c_int), 0);
            assert_eq!((*s.qp).state, IBV_QPS_RTS);
        }
    }
}

fn poll(s: &Side) -> ibv_wc {
    let t = Instant::now();
    let poll = ops(s.ctx).poll_cq.unwrap();
    loop {
        // SAFETY: plain data.
        let mut wc: ibv_wc = unsafe { std::mem::zeroed() };
        // SAFETY: our CQ, one entry.
        let n = unsafe { poll(s.cq, 1, &mut wc) };
        assert!(n >= 0);
        if n == 1 {
            return wc;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no completion");
        std::thread::yield_now();
    }
}

fn sge(s: &Side, off: usize, len: u32) -> ibv_sge {
    ibv_sge {
        addr: s.buf.as_ptr() as u64 + off as u64,
        length: len,
        // SAFETY: our region.
        lkey: unsafe { (*s.mr).lkey },
    }
}

fn send_wr(list: &mut [ibv_sge], opcode: ibv_wr_opcode, flags: u32) -> ibv_send_wr {
    // SAFETY: plain data.
    let mut w: ibv_send_wr = unsafe { std::mem::zeroed() };
    w.wr_id = 7;
    w.sg_list = list.as_mut_ptr();
    w.num_sge = list.len() as c_int;
    w.opcode = opcode;
    w.send_flags = flags;
    w
}

#[test]
fn sends_writes_reads_and_atomics_through_the_c_abi() {
    let access = (IBV_ACCESS_LOCAL_WRITE
        | IBV_ACCESS_REMOTE_WRITE
        | IBV_ACCESS_REMOTE_READ
        | IBV_ACCESS_REMOTE_ATOMIC) as c_int;
    let mut a = side(access, false);
    let b = side(access, false);
    connect(&a, &b);
    let post_send = ops(a.ctx).post_send.unwrap();
    let post_recv = ops(b.ctx).post_recv.unwrap();
    // SAFETY: our objects, and requests whose lists live across the calls.
    unsafe {
        // Send with immediate, two elements, through ops.post_send.
        a.buf[..5].copy_from_slice(b"hello");
        a.buf[100..106].copy_from_slice(b", RDMA");
        let mut rl = [sge(&b, 0, 64)];
        let mut r: ibv_recv_wr = std::mem::zeroed();
        r.wr_id = 9;
        r.sg_list = rl.as_mut_ptr();
        r.num_sge = 1;
        let mut bad_r = ptr::null_mut();
        assert_eq!(post_recv(b.qp, &mut r, &mut bad_r), 0);
        let mut sl = [sge(&a, 0, 5), sge(&a, 100, 6)];
        let mut w = send_wr(&mut sl, IBV_WR_SEND_WITH_IMM, IBV_SEND_SIGNALED);
        w.__bindgen_anon_1.imm_data = 0x1234_5678u32.to_be();
        let mut bad = ptr::null_mut();
        assert_eq!(post_send(a.qp, &mut w, &mut bad), 0);
        let wa = poll(&a);
        assert_eq!(
            (wa.status, wa.opcode, wa.wr_id),
            (IBV_WC_SUCCESS, IBV_WC_SEND, 7)
        );
        let wb = poll(&b);
        assert_eq!(
            (wb.status, wb.opcode, wb.wr_id, wb.byte_len),
            (IBV_WC_SUCCESS, IBV_WC_RECV, 9, 11)
        );
        assert_eq!(wb.qp_num, (*b.qp).qp_num);
        assert!(wb.wc_flags & IBV_WC_WITH_IMM != 0);
        assert_eq!(u32::from_be(wb.__bindgen_anon_1.imm_data), 0x1234_5678);
        assert_eq!(&b.buf[..11], b"hello, RDMA");

        // A bad L_Key fails the post with EINVAL and names the request.
        let mut sl = [ibv_sge {
            lkey: 0xdead_0001,
            ..sge(&a, 0, 4)
        }];
        let mut w = send_wr(&mut sl, IBV_WR_SEND, IBV_SEND_SIGNALED);
        let mut bad = ptr::null_mut();
        assert_eq!(post_send(a.qp, &mut w, &mut bad), libc::EINVAL);
        assert_eq!(bad, &mut w as *mut ibv_send_wr);
        // An address outside the region, too.
        let mut sl = [ibv_sge {
            addr: a.buf.as_ptr() as u64 + 8190,
            ..sge(&a, 0, 4)
        }];
        let mut w = send_wr(&mut sl, IBV_WR_SEND, IBV_SEND_SIGNALED);
        assert_eq!(post_send(a.qp, &mut w, &mut bad), libc::EINVAL);
        // An opcode verbs does not have.
        let mut w = send_wr(&mut [], 99, IBV_SEND_SIGNALED);
        assert_eq!(post_send(a.qp, &mut w, &mut bad), libc::EINVAL);
        // A bad L_Key in a list's second element, and a list longer than a QP takes.
        let mut sl = [
            sge(&a, 0, 4),
            ibv_sge {
                lkey: 0xdead_0001,
                ..sge(&a, 8, 4)
            },
        ];
        let mut w = send_wr(&mut sl, IBV_WR_SEND, IBV_SEND_SIGNALED);
        assert_eq!(post_send(a.qp, &mut w, &mut bad), libc::EINVAL);
        let mut sl = vec![sge(&a, 0, 1); 1024];
        let mut w = send_wr(&mut sl, IBV_WR_SEND, IBV_SEND_SIGNALED);
        assert_eq!(post_send(a.qp, &mut w, &mut bad), libc::EINVAL);

        // The extended API: RDMA Write, then Read back, then Fetch and Add, then CAS.
        let qx = ibv_qp_to_qp_ex(a.qp);
        assert!(!qx.is_null());
        let x = &mut *qx;
        let rkey = (*b.mr).rkey;
        let raddr = b.buf.as_ptr() as u64;
        a.buf[200..208].copy_from_slice(&41u64.to_le_bytes());
        (x.wr_start.unwrap())(qx);
        x.wr_id = 1;
        x.wr_flags = IBV_SEND_SIGNALED;
        (x.wr_rdma_write.unwrap())(qx, rkey, raddr + 1024);
        (x.wr_set_sge.unwrap())(qx, (*a.mr).lkey, a.buf.as_ptr() as u64 + 200, 8);
        x.wr_id = 2;
        (x.wr_rdma_read.unwrap())(qx, rkey, raddr + 1024);
        (x.wr_set_sge.unwrap())(qx, (*a.mr).lkey, a.buf.as_ptr() as u64 + 300, 8);
        x.wr_id = 3;
        (x.wr_atomic_fetch_add.unwrap())(qx, rkey, raddr + 1024, 1);
        (x.wr_set_sge.unwrap())(qx, (*a.mr).lkey, a.buf.as_ptr() as u64 + 400, 8);
        x.wr_id = 4;
        (x.wr_atomic_cmp_swp.unwrap())(qx, rkey, raddr + 1024, 42, 100);
        (x.wr_set_sge.unwrap())(qx, (*a.mr).lkey, a.buf.as_ptr() as u64 + 500, 8);
        assert_eq!((x.wr_complete.unwrap())(qx), 0);
        for id in 1..=4 {
            let wc = poll(&a);
            assert_eq!((wc.status, wc.wr_id), (IBV_WC_SUCCESS, id), "request {id}");
        }
        let word =
            |s: &Side, off: usize| u64::from_le_bytes(s.buf[off..off + 8].try_into().unwrap());
        assert_eq!(word(&a, 300), 41, "read back what was written");
        assert_eq!(word(&a, 400), 41, "fetch and add's original");
        assert_eq!(word(&a, 500), 42, "compare and swap's original");
        assert_eq!(word(&b, 1024), 100);

        // Inline data through the extended API (no L_Key needed).
        let mut rl = [sge(&b, 2048, 64)];
        r.sg_list = rl.as_mut_ptr();
        assert_eq!(post_recv(b.qp, &mut r, &mut bad_r), 0);
        (x.wr_start.unwrap())(qx);
        x.wr_id = 5;
        (x.wr_send.unwrap())(qx);
        let mut msg = *b"inline!";
        (x.wr_set_inline_data.unwrap())(qx, msg.as_mut_ptr().cast(), msg.len());
        assert_eq!((x.wr_complete.unwrap())(qx), 0);
        assert_eq!(poll(&a).wr_id, 5);
        assert_eq!(poll(&b).byte_len, 7);
        assert_eq!(&b.buf[2048..2055], b"inline!");

        // Teardown in verbs order.
        for s in [&a, &b] {
            assert_eq!(ibv_destroy_qp(s.qp), 0);
            assert_eq!(ibv_dereg_mr(s.mr), 0);
            assert_eq!(ibv_destroy_cq(s.cq), 0);
            assert_eq!(ibv_dealloc_pd(s.pd), 0);
        }
        for s in [&a, &b] {
            assert_eq!(ibv_close_device(s.ctx), 0);
        }
    }
}

/// `ibv_poll_cq` with room for several completions (perftest's bandwidth tests poll 16 at a
/// time) writes each into the program's array in order, never more than asked for, and
/// failed ones with their status.
/// A Send or a receive of one element, alone, takes a path of its own with the region of
/// the last L_Key its queue named kept (`KeyCache`): a key whose region was deregistered
/// since must fail the post (not reach the freed region), and a region of another
/// protection domain or a range past the region's end too.
#[test]
fn one_element_posts_refuse_a_deregistered_region_s_key() {
    let access = IBV_ACCESS_LOCAL_WRITE as c_int;
    let a = side(access, false);
    let mut b = side(access, false);
    connect(&a, &b);
    let (send_a, recv_a) = (ops(a.ctx).post_send.unwrap(), ops(a.ctx).post_recv.unwrap());
    let (send_b, recv_b) = (ops(b.ctx).post_send.unwrap(), ops(b.ctx).post_recv.unwrap());
    // SAFETY: our objects, and requests whose lists live across the calls.
    unsafe {
        let mut other = vec![0u8; 4096];
        let mr2 = ibv_reg_mr(a.pd, other.as_mut_ptr().cast(), other.len(), access);
        assert!(!mr2.is_null());
        let base = other.as_ptr() as u64;
        let in_mr2 = |off: u64, len: u32| ibv_sge {
            addr: base + off,
            length: len,
            lkey: (*mr2).lkey,
        };
        // A receive into mr2 and a Send from it: each queue's cache now names mr2.
        let mut rl = [in_mr2(0, 64)];
        let mut r: ibv_recv_wr = std::mem::zeroed();
        r.wr_id = 1;
        r.sg_list = rl.as_mut_ptr();
        r.num_sge = 1;
        let mut bad_r = ptr::null_mut();
        assert_eq!(recv_a(a.qp, &mut r, &mut bad_r), 0);
        let mut bl = [sge(&b, 0, 64)];
        let mut rb: ibv_recv_wr = std::mem::zeroed();
        rb.wr_id = 2;
        rb.sg_list = bl.as_mut_ptr();
        rb.num_sge = 1;
        assert_eq!(recv_b(b.qp, &mut rb, &mut bad_r), 0);
        other[..4].copy_from_slice(b"mr2!");
        let mut sl = [in_mr2(0, 4)];
        let mut w = send_wr(&mut sl, IBV_WR_SEND, IBV_SEND_SIGNALED);
        let mut bad = ptr::null_mut();
        assert_eq!(send_a(a.qp, &mut w, &mut bad), 0);
        let mut bsl = [sge(&b, 100, 3)];
        let mut wb = send_wr(&mut bsl, IBV_WR_SEND, IBV_SEND_SIGNALED);
        b.buf[100..103].copy_from_slice(b"b2a");
        assert_eq!(send_b(b.qp, &mut wb, &mut bad), 0);
        let mut got = Vec::new();
        for _ in 0..2 {
            let w = poll(&a);
            assert_eq!(w.status, IBV_WC_SUCCESS);
            got.push(w.opcode);
        }
        got.sort();
        assert_eq!(got, [IBV_WC_SEND, IBV_WC_RECV]);
        for _ in 0..2 {
            assert_eq!(poll(&b).status, IBV_WC_SUCCESS);
        }
        assert_eq!(&b.buf[..4], b"mr2!");
        assert_eq!(&other[..3], b"b2a");

        // A range past the region's end, through the same cached key.
        let mut sl = [in_mr2(4090, 8)];
        let mut w = send_wr(&mut sl, IBV_WR_SEND, 0);
        assert_eq!(send_a(a.qp, &mut w, &mut bad), libc::EINVAL);
        assert_eq!(bad, &mut w as *mut ibv_send_wr);
        let mut rl = [in_mr2(4090, 8)];
        r.sg_list = rl.as_mut_ptr();
        bad_r = ptr::null_mut();
        assert_eq!(recv_a(a.qp, &mut r, &mut bad_r), libc::EINVAL);
        assert_eq!(bad_r, &mut r as *mut ibv_recv_wr);

        // mr2 deregistered: its key fails both posts with EINVAL, naming the request.
        let stale = (*mr2).lkey;
        assert_eq!(ibv_dereg_mr(mr2), 0);
        let gone = |len: u32| ibv_sge {
            addr: base,
            length: len,
            lkey: stale,
        };
        let mut sl = [gone(4)];
        let mut w = send_wr(&mut sl, IBV_WR_SEND, IBV_SEND_SIGNALED);
        bad = ptr::null_mut();
        assert_eq!(send_a(a.qp, &mut w, &mut bad), libc::EINVAL);
        assert_eq!(bad, &mut w as *mut ibv_send_wr);
        let mut rl = [gone(64)];
        r.sg_list = rl.as_mut_ptr();
        bad_r = ptr::null_mut();
        assert_eq!(recv_a(a.qp, &mut r, &mut bad_r), libc::EINVAL);
        assert_eq!(bad_r, &mut r as *mut ibv_recv_wr);

        // A region of another protection domain of the same context.
        let pd2 = ibv_alloc_pd(a.ctx);
        let mr3 = ibv_reg_mr(pd2, other.as_mut_ptr().cast(), other.len(), access);
        assert!(!mr3.is_null());
        let mut sl = [ibv_sge {
            lkey: (*mr3).lkey,
            ..gone(4)
        }];
        let mut w = send_wr(&mut sl, IBV_WR_SEND, IBV_SEND_SIGNALED);
        assert_eq!(send_a(a.qp, &mut w, &mut bad), libc::EINVAL);
        let mut rl = [ibv_sge {
            lkey: (*mr3).lkey,
            ..gone(64)
        }];
        r.sg_list = rl.as_mut_ptr();
        bad_r = ptr::null_mut();
        assert_eq!(recv_a(a.qp, &mut r, &mut bad_r), libc::EINVAL);
        assert_eq!(bad_r, &mut r as *mut ibv_recv_wr);
        assert_eq!(ibv_dereg_mr(mr3), 0);
        assert_eq!(ibv_dealloc_pd(pd2), 0);
    }
}

/// A Send of a few bytes of a registered buffer, alone (perftest's `ib_send_bw` post), is
/// copied into the QP's inline staging at post time, as `IBV_SEND_INLINE` data is — a QP
/// created without inline data gets a staging row of 64 bytes all the same (and says so in
/// `max_inline_data`). The request then holds no region: the program may rewrite the buffer
/// and deregister the region before the Send completes (here it waits for a receive,
/// refused with RNR Naks until one is posted), and the receiver gets the bytes posted.
/// (Before, the bytes went into the region's shadow and the request held the region until
/// it completed: `ibv_dereg_mr` failed with EBUSY.)
#[test]
fn a_small_send_is_staged_at_post_and_holds_no_region() {
    let access = IBV_ACCESS_LOCAL_WRITE as c_int;
    let mut a = side(access, false);
    let b = side(access, false);
    // SAFETY: our objects, and requests whose lists live across the calls.
    unsafe {
        // a's QP again, asking for no inline data (as perftest does for our device).
        assert_eq!(ibv_destroy_qp(a.qp), 0);
        let mut init: ibv_qp_init_attr = std::mem::zeroed();
        init.send_cq = a.cq;
        init.recv_cq = a.cq;
        init.cap = ibv_qp_cap {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        init.qp_type = IBV_QPT_RC;
        a.qp = ibv_create_qp(a.pd, &mut init);
        assert!(!a.qp.is_null());
        assert_eq!(init.cap.max_inline_data, 64);
        connect(&a, &b);
        a.buf[..8].copy_from_slice(b"staged!!");
        let mut sl = [sge(&a, 0, 8)];
        let mut w = send_wr(&mut sl, IBV_WR_SEND, IBV_SEND_SIGNALED);
        let mut bad = ptr::null_mut();
        assert_eq!((ops(a.ctx).post_send.unwrap())(a.qp, &mut w, &mut bad), 0);
        a.buf[..8].copy_from_slice(b"changed!");
        assert_eq!(ibv_dereg_mr(a.mr), 0, "the Send holds no region");
        let mut rl = [sge(&b, 0, 64)];
        let mut r: ibv_recv_wr = std::mem::zeroed();
        r.wr_id = 3;
        r.sg_list = rl.as_mut_ptr();
        r.num_sge = 1;
        let mut bad_r = ptr::null_mut();
        assert_eq!((ops(b.ctx).post_recv.unwrap())(b.qp, &mut r, &mut bad_r), 0);
        let wb = poll(&b);
        assert_eq!((wb.status, wb.wr_id, wb.byte_len), (IBV_WC_SUCCESS, 3, 8));
        assert_eq!(&b.buf[..8], b"staged!!");
        assert_eq!(poll(&a).status, IBV_WC_SUCCESS);
    }
}

#[test]
fn a_poll_of_several_fills_the_array_in_order() {
    let access = IBV_ACCESS_LOCAL_WRITE as c_int;
    let a = side(access, false);
    let b = side(access, false);
    connect(&a, &b);
    let post_send = ops(a.ctx).post_send.unwrap();
    let post_recv = ops(b.ctx).post_recv.unwrap();
    let poll = ops(b.ctx).poll_cq.unwrap();
    // SAFETY: our objects, and requests whose lists live across the calls.
    unsafe {
        for i in 0..5u64 {
            let mut rl = [sge(&b, 64 * i as usize, 64)];
            let mut r: ibv_recv_wr = std::mem::zeroed();
            r.wr_id = 100 + i;
            r.sg_list = rl.as_mut_ptr();
            r.num_sge = 1;
            let mut bad = ptr::null_mut();
            assert_eq!(post_recv(b.qp, &mut r, &mut bad), 0);
        }
        for i in 0..5u32 {
            let mut sl = [sge(&a, 0, 8 + i)];
            let mut w = send_wr(&mut sl, IBV_WR_SEND, 0);
            let mut bad = ptr::null_mut();
            assert_eq!(post_send(a.qp, &mut w, &mut bad), 0);
        }
        let mut wc: [ibv_wc; 16] = std::mem::zeroed();
        // A sentinel past what may be written.
        wc[3].wr_id = 0xdead;
        let mut got: Vec<ibv_wc> = vec![];
        let t = Instant::now();
        while got.len() < 5 {
            let n = poll(b.cq, 3, wc.as_mut_ptr());
            assert!((0..=3).contains(&n), "at most the 3 asked for: {n}");
            assert_eq!(wc[3].wr_id, 0xdead, "nothing written past the 3 entries");
            got.extend_from_slice(&wc[..n as usize]);
            // (The sender's engine runs too: its Acks.)
            let mut w0: ibv_wc = std::mem::zeroed();
            ops(a.ctx).poll_cq.unwrap()(a.cq, 1, &mut w0);
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "only {} arrived",
                got.len()
            );
        }
        assert_eq!(got.len(), 5);
        for (i, w) in got.iter().enumerate() {
            assert_eq!(
                (w.status, w.opcode, w.wr_id, w.byte_len, w.qp_num),
                (
                    IBV_WC_SUCCESS,
                    IBV_WC_RECV,
                    100 + i as u64,
                    8 + i as u32,
                    (*b.qp).qp_num
                )
            );
        }
        assert_eq!(poll(b.cq, 16, wc.as_mut_ptr()), 0, "nothing more");
        // Moved to the Error state, the QP flushes its posted receives: several at once,
        // each with its status.
        for i in 0..3u64 {
            let mut rl = [sge(&b, 0, 64)];
            let mut r: ibv_recv_wr = std::mem::zeroed();
            r.wr_id = 200 + i;
            r.sg_list = rl.as_mut_ptr();
            r.num_sge = 1;
            let mut bad = ptr::null_mut();
            assert_eq!(post_recv(b.qp, &mut r, &mut bad), 0);
        }
        let mut attr: ibv_qp_attr = std::mem::zeroed();
        attr.qp_state = IBV_QPS_ERR;
        assert_eq!(ibv_modify_qp(b.qp, &mut attr, IBV_QP_STATE as c_int), 0);
        let mut flushed = vec![];
        let t = Instant::now();
        while flushed.len() < 3 {
            let n = poll(b.cq, 16, wc.as_mut_ptr());
            flushed.extend(wc[..n as usize].iter().map(|w| (w.wr_id, w.status)));
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "flushed only {flushed:?}"
            );
        }
        assert_eq!(flushed, [200, 201, 202].map(|id| (id, IBV_WC_WR_FLUSH_ERR)));
    }
}

/// Immediate data is `__be32` in verbs: the 4 bytes the program stores (`htonl(x)`) are the
/// bytes on the wire, as a NIC sends them, and come back unchanged in the receiver's
/// `ibv_wc` — through `ibv_post_send` and through `ibv_wr_send_imm`. (The Rust API's
/// immediate is the host-order value, the same wire bytes.) An invalidated R_Key is host
/// order, as verbs has it.
#[test]
fn immediate_data_travels_in_network_order() {
    let access = (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) as c_int;
    let a = side(access, false);
    let b = side(access, false);
    connect(&a, &b);
    let pcap = std::env::temp_dir().join(format!("shmhca-imm-{}.pcap", std::process::id()));
    // SAFETY: our context.
    unsafe { ctx_of(a.ctx).unwrap() }
        .ctx
        .trace_to(&pcap)
        .unwrap();
    let post_send = ops(a.ctx).post_send.unwrap();
    let post_recv = ops(b.ctx).post_recv.unwrap();
    // SAFETY: our objects, and requests whose lists live across the calls.
    unsafe {
        for i in 0..2u64 {
            let mut rl = [sge(&b, 0, 64)];
            let mut r: ibv_recv_wr = std::mem::zeroed();
            r.wr_id = i;
            r.sg_list = rl.as_mut_ptr();
            r.num_sge = 1;
            let mut bad = ptr::null_mut();
            assert_eq!(post_recv(b.qp, &mut r, &mut bad), 0);
        }
        // ibv_post_send, then the qp_ex path.
        let mut sl = [sge(&a, 0, 4)];
        let mut w = send_wr(&mut sl, IBV_WR_SEND_WITH_IMM, IBV_SEND_SIGNALED);
        w.__bindgen_anon_1.imm_data = 0x1234_5678u32.to_be();
        let mut bad = ptr::null_mut();
        assert_eq!(post_send(a.qp, &mut w, &mut bad), 0);
        let qx = ibv_qp_to_qp_ex(a.qp);
        let x = &mut *qx;
        (x.wr_start.unwrap())(qx);
        x.wr_id = 8;
        x.wr_flags = IBV_SEND_SIGNALED;
        (x.wr_send_imm.unwrap())(qx, 0x9abc_def0u32.to_be());
        (x.wr_set_sge.unwrap())(qx, (*a.mr).lkey, a.buf.as_ptr() as u64, 4);
        assert_eq!((x.wr_complete.unwrap())(qx), 0);
        for want in [0x1234_5678u32, 0x9abc_def0] {
            let wb = poll(&b);
            assert_eq!((wb.status, wb.opcode), (IBV_WC_SUCCESS, IBV_WC_RECV));
            assert!(wb.wc_flags & IBV_WC_WITH_IMM != 0);
            assert_eq!(u32::from_be(wb.__bindgen_anon_1.imm_data), want);
        }
        poll(&a);
        poll(&a);
    }
    // SAFETY: our context.
    unsafe { ctx_of(a.ctx).unwrap() }.ctx.stop_trace();
    let bytes = std::fs::read(&pcap).unwrap();
    let _ = std::fs::remove_file(&pcap);
    let has = |v: [u8; 4]| bytes.windows(4).any(|w| w == v);
    assert!(
        has([0x12, 0x34, 0x56, 0x78]) && has([0x9a, 0xbc, 0xde, 0xf0]),
        "the immediates' bytes on the wire are the program's"
    );
    assert!(!has([0x78, 0x56, 0x34, 0x12]) && !has([0xf0, 0xde, 0xbc, 0x9a]));
}

#[test]
fn null_and_foreign_pointers_are_refused() {
    // SAFETY: null pointers, which every entry point checks.
    unsafe {
        assert!(ibv_alloc_pd(ptr::null_mut()).is_null());
        assert!(ibv_reg_mr(ptr::null_mut(), ptr::null_mut(), 0, 0).is_null());
        assert_eq!(ibv_dealloc_pd(ptr::null_mut()), libc::EINVAL);
        assert_eq!(ibv_destroy_qp(ptr::null_mut()), libc::EINVAL);
        assert!(ibv_open_device(ptr::null_mut()).is_null());
        assert_eq!(
            ibv_query_device(ptr::null_mut(), ptr::null_mut()),
            libc::EINVAL
        );
    }
}

#[test]
fn a_completion_channel_reports_solicited_events() {
    let access = (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) as c_int;
    let a = side(access, false);
    let b = side(access, true);
    connect(&a, &b);
    let post_send = ops(a.ctx).post_send.unwrap();
    let post_recv = ops(b.ctx).post_recv.unwrap();
    let notify = ops(b.ctx).req_notify_cq.unwrap();
    // SAFETY: our objects, and requests whose lists live across the calls.
    unsafe {
        let mut rl = [sge(&b, 0, 64)];
        let mut r: ibv_recv_wr = std::mem::zeroed();
        r.sg_list = rl.as_mut_ptr();
        r.num_sge = 1;
        let mut bad_r = ptr::null_mut();
        for _ in 0..2 {
            assert_eq!(post_recv(b.qp, &mut r, &mut bad_r), 0);
        }
        // Armed for solicited events only: an unsolicited Send raises none, a solicited one does.
        assert_eq!(notify(b.cq, 1), 0);
        let mut sl = [sge(&a, 0, 8)];
        let mut bad = ptr::null_mut();
        let mut w = send_wr(&mut sl, IBV_WR_SEND, IBV_SEND_SIGNALED);
        assert_eq!(post_send(a.qp, &mut w, &mut bad), 0);
        poll(&a);
        poll(&b);
        let mut pfd = libc::pollfd {
            fd: (*b.ch).fd,
            events: libc::POLLIN,
            revents: 0,
        };
        assert_eq!(
            libc::poll(&mut pfd, 1, 200),
            0,
            "an unsolicited Send raised an event"
        );
        let mut w = send_wr(&mut sl, IBV_WR_SEND, IBV_SEND_SIGNALED | IBV_SEND_SOLICITED);
        assert_eq!(post_send(a.qp, &mut w, &mut bad), 0);
        poll(&a);
        assert_eq!(
            libc::poll(&mut pfd, 1, 60_000),
            1,
            "no event for the solicited Send"
        );
        let mut cq = ptr::null_mut();
        let mut cq_ctx = ptr::null_mut();
        assert_eq!(ibv_get_cq_event(b.ch, &mut cq, &mut cq_ctx), 0);
        assert_eq!((cq, cq_ctx as usize), (b.cq, 0x5eed));
        ibv_ack_cq_events(cq, 1);
        assert_eq!(poll(&b).status, IBV_WC_SUCCESS);
        assert_eq!(
            ibv_destroy_comp_channel(b.ch),
            libc::EBUSY,
            "its CQ still uses it"
        );
        for s in [&a, &b] {
            assert_eq!(ibv_destroy_qp(s.qp), 0);
            assert_eq!(ibv_dereg_mr(s.mr), 0);
            assert_eq!(ibv_destroy_cq(s.cq), 0);
            assert_eq!(ibv_dealloc_pd(s.pd), 0);
        }
        assert_eq!(ibv_destroy_comp_channel(b.ch), 0);
        for s in [&a, &b] {
            assert_eq!(ibv_close_device(s.ctx), 0);
        }
    }
}

/// Connects `a` and `b` the verbs way: INIT, then RTR naming the peer's LID (or its GID
/// with `by_gid`) and QPN, then RTS, all through `ibv_modify_qp`.
fn connect_by_address(a: &Side, b: &Side, by_gid: bool) {
    // SAFETY: our contexts and QPs.
    unsafe {
        for (s, peer) in [(a, b), (b, a)] {
            let mut pa: ibv_port_attr = std::mem::zeroed();
            let q = shmhca_verbs_core::context::ctx_of(peer.ctx)
                .unwrap()
                .vctx
                .query_port
                .unwrap();
            assert_eq!(
                q(peer.ctx, 1, &mut pa, std::mem::size_of::<ibv_port_attr>()),
                0
            );
            let mut gid: ibv_gid = std::mem::zeroed();
            assert_eq!(ibv_query_gid(peer.ctx, 1, 0, &mut gid), 0);
            let mut attr: ibv_qp_attr = std::mem::zeroed();
            attr.qp_state = IBV_QPS_INIT;
            attr.port_num = 1;
            attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
            let m = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
            assert_eq!(ibv_modify_qp(s.qp, &mut attr, m as c_int), 0);
            let mut attr: ibv_qp_attr = std::mem::zeroed();
            attr.qp_state = IBV_QPS_RTR;
            attr.path_mtu = IBV_MTU_4096;
            attr.dest_qp_num = (*peer.qp).qp_num;
            attr.max_dest_rd_atomic = 1;
            attr.min_rnr_timer = 12;
            attr.ah_attr.port_num = 1;
            if by_gid {
                attr.ah_attr.is_global = 1;
                attr.ah_attr.grh.dgid = gid;
                attr.ah_attr.grh.hop_limit = 1;
            } else {
                attr.ah_attr.dlid = pa.lid;
            }
            let m = IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER;
            assert_eq!(ibv_modify_qp(s.qp, &mut attr, m as c_int), 0);
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
            assert_eq!(ibv_modify_qp(s.qp, &mut attr, m as c_int), 0);
        }
    }
}

fn ping_pong(by_gid: bool) {
    let access = (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) as c_int;
    let a = side(access, false);
    let b = side(access, false);
    // SAFETY: our contexts.
    let (la, lb) = unsafe { (ctx_of(a.ctx).unwrap().lid, ctx_of(b.ctx).unwrap().lid) };
    assert_ne!(la, lb, "each context has its own LID");
    connect_by_address(&a, &b, by_gid);
    // SAFETY: our objects, and requests whose lists live across the calls.
    unsafe {
        for i in 0..20u64 {
            for (from, to) in [(&a, &b), (&b, &a)] {
                let mut rl = [sge(to, 0, 64)];
                let mut r: ibv_recv_wr = std::mem::zeroed();
                r.wr_id = i;
                r.sg_list = rl.as_mut_ptr();
                r.num_sge = 1;
                let mut bad_r = ptr::null_mut();
                assert_eq!(
                    (ops(to.ctx).post_recv.unwrap())(to.qp, &mut r, &mut bad_r),
                    0
                );
                let mut sl = [sge(from, 0, 8)];
                let mut w = send_wr(&mut sl, IBV_WR_SEND, IBV_SEND_SIGNALED);
                let mut bad = ptr::null_mut();
                assert_eq!(
                    (ops(from.ctx).post_send.unwrap())(from.qp, &mut w, &mut bad),
                    0
                );
                assert_eq!(poll(to).status, IBV_WC_SUCCESS);
                assert_eq!(poll(from).status, IBV_WC_SUCCESS);
            }
        }
    }
    // SAFETY: our objects.
    unsafe {
        for s in [&a, &b] {
            assert_eq!(ibv_destroy_qp(s.qp), 0);
            assert_eq!(ibv_dereg_mr(s.mr), 0);
            assert_eq!(ibv_destroy_cq(s.cq), 0);
            assert_eq!(ibv_dealloc_pd(s.pd), 0);
            assert_eq!(ibv_close_device(s.ctx), 0);
        }
    }
}

#[test]
fn two_contexts_connect_by_lid() {
    ping_pong(false);
}

#[test]
fn two_contexts_connect_by_gid() {
    ping_pong(true);
}

/// The exported `ibv_query_port` (rdma-core's IBVERBS_1.1 entry, what a program reaches when
/// it calls the symbol rather than verbs.h's inline) fills the old layout of the port
/// attributes: up to `flags`, with the port's LID and state, and nothing past it. (It once
/// copied `size_of::<_compat_ibv_port_attr>()` bytes: 0, bindgen's size of the opaque
/// type, so callers got their struct back untouched.)
#[test]
fn the_exported_query_port_fills_the_compat_layout() {
    // SAFETY: the exported functions with the arguments verbs.h documents.
    unsafe {
        let mut n = 0;
        let list = ibv_get_device_list(&mut n);
        let ctx = ibv_open_device(*list);
        ibv_free_device_list(list);
        assert!(!ctx.is_null());
        let mut attr: ibv_port_attr = std::mem::zeroed();
        attr.port_cap_flags2 = 0xBEEF;
        let rc = ibv_query_port(ctx, 1, (&raw mut attr).cast());
        assert_eq!(rc, 0);
        assert_eq!(attr.state, IBV_PORT_ACTIVE);
        assert_ne!(attr.lid, 0, "the port's LID");
        assert_eq!(
            attr.port_cap_flags2, 0xBEEF,
            "nothing past the old layout is written"
        );
        assert_eq!(ibv_close_device(ctx), 0);
    }
}

/// A QP of `s`'s context taking its receives from `srq`, on `s`'s CQ.
fn qp_on_srq(s: &Side, srq: *mut ibv_srq) -> *mut ibv_qp {
    // SAFETY: the exported functions with the arguments verbs.h documents.
    unsafe {
        let mut attr: ibv_qp_init_attr_ex = std::mem::zeroed();
        attr.send_cq = s.cq;
        attr.recv_cq = s.cq;
        attr.srq = srq;
        attr.cap = ibv_qp_cap {
            max_send_wr: 8,
            max_recv_wr: 0,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        attr.qp_type = IBV_QPT_RC;
        attr.comp_mask = IBV_QP_INIT_ATTR_PD;
        attr.pd = s.pd;
        let create = ctx_of(s.ctx).unwrap().vctx.create_qp_ex.unwrap();
        let qp = create(s.ctx, &mut attr);
        assert!(!qp.is_null());
        qp
    }
}

/// Takes `qp` to INIT then RTR towards `peer` over `link`, and to RTS with `rts`.
fn bring_up(qp: *mut ibv_qp, link: shmhca::LinkId, peer: *mut ibv_qp, credits: bool, rts: bool) {
    // SAFETY: our QPs.
    unsafe {
        let mut attr: ibv_qp_attr = std::mem::zeroed();
        attr.qp_state = IBV_QPS_INIT;
        attr.port_num = 1;
        let m = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
        assert_eq!(ibv_modify_qp(qp, &mut attr, m as c_int), 0);
        let q = &mut *qp.cast::<QpObj>();
        let dest = shmhca::Destination {
            link,
            qpn: shmhca::Qpn::new((*peer).qp_num),
        };
        q.rust
            .modify(
                &shmhca::QpAttr::new(shmhca::QpState::Rtr)
                    .path_mtu(shmhca::Mtu::Mtu4096)
                    .dest(dest)
                    .rq_psn(0)
                    .max_dest_rd_atomic(1)
                    .min_rnr_timer(1)
                    .remote_credits(credits),
            )
            .unwrap();
        if rts {
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
            assert_eq!(ibv_modify_qp(qp, &mut attr, m as c_int), 0);
        }
    }
}

/// The next async event of `ctx` on its (non-blocking) async_fd, waiting up to 20 s.
fn next_async_event(ctx: *mut ibv_context) -> ibv_async_event {
    let t = Instant::now();
    loop {
        // SAFETY: plain data; our context.
        unsafe {
            let mut ev: ibv_async_event = std::mem::zeroed();
            if ibv_get_async_event(ctx, &mut ev) == 0 {
                return ev;
            }
            assert_eq!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::EAGAIN)
            );
        }
        assert!(t.elapsed() < Duration::from_secs(20), "no async event");
        std::thread::yield_now();
    }
}

#[test]
fn async_events_come_through_the_c_abi_with_their_objects() {
    let access = (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) as c_int;
    let a = side(access, false);
    let b = side(access, false);
    // SAFETY: our objects, and requests whose lists live across the calls.
    unsafe {
        let fd = (*b.ctx).async_fd;
        let flags = libc::fcntl(fd, libc::F_GETFL);
        assert_eq!(flags & libc::O_NONBLOCK, 0, "blocking, as rdma-core's");
        assert_eq!(libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK), 0);
        let mut ev: ibv_async_event = std::mem::zeroed();
        assert_eq!(ibv_get_async_event(b.ctx, &mut ev), -1);
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EAGAIN),
            "non-blocking and empty: EAGAIN"
        );
        let mut init: ibv_srq_init_attr = std::mem::zeroed();
        init.attr.max_wr = 16;
        init.attr.max_sge = 1;
        let srq = ibv_create_srq(b.pd, &mut init);
        assert!(!srq.is_null());
        let qb = qp_on_srq(&b, srq);
        let (la, lb) = ctx_of(a.ctx)
            .unwrap()
            .ctx
            .link_with(&ctx_of(b.ctx).unwrap().ctx)
            .unwrap();
        bring_up(a.qp, la, qb, false, true);
        // B stays at RTR: its first request raises COMM_EST.
        bring_up(qb, lb, a.qp, true, false);
        for i in 0..4u64 {
            let mut rl = [sge(&b, i as usize * 64, 64)];
            let mut r: ibv_recv_wr = std::mem::zeroed();
            r.wr_id = i;
            r.sg_list = rl.as_mut_ptr();
            r.num_sge = 1;
            let mut bad = ptr::null_mut();
            assert_eq!(
                (ops(b.ctx).post_srq_recv.unwrap())(srq, &mut r, &mut bad),
                0
            );
        }
        let mut sa: ibv_srq_attr = std::mem::zeroed();
        sa.srq_limit = 3;
        assert_eq!(ibv_modify_srq(srq, &mut sa, IBV_SRQ_LIMIT as c_int), 0);
        for _ in 0..2 {
            let mut sl = [sge(&a, 0, 8)];
            let mut w = send_wr(&mut sl, IBV_WR_SEND, IBV_SEND_SIGNALED);
            let mut bad = ptr::null_mut();
            assert_eq!((ops(a.ctx).post_send.unwrap())(a.qp, &mut w, &mut bad), 0);
            assert_eq!(poll(&b).status, IBV_WC_SUCCESS);
            assert_eq!(poll(&a).status, IBV_WC_SUCCESS);
        }
        let mut ev = next_async_event(b.ctx);
        assert_eq!(ev.event_type, IBV_EVENT_COMM_EST);
        assert_eq!(ev.element.qp, qb);
        ibv_ack_async_event(&mut ev);
        assert_eq!((*qb).events_completed, 1);
        // 2 left < 3.
        let mut ev = next_async_event(b.ctx);
        assert_eq!(ev.event_type, IBV_EVENT_SRQ_LIMIT_REACHED);
        assert_eq!(ev.element.srq, srq);
        ibv_ack_async_event(&mut ev);
        assert_eq!((*srq).events_completed, 1);
        assert_eq!(ibv_get_async_event(b.ctx, &mut ev), -1);
        // Blocking again: the QP on the SRQ entering Error raises LAST_WQE_REACHED.
        assert_eq!(libc::fcntl(fd, libc::F_SETFL, flags), 0);
        let mut attr: ibv_qp_attr = std::mem::zeroed();
        attr.qp_state = IBV_QPS_ERR;
        assert_eq!(ibv_modify_qp(qb, &mut attr, IBV_QP_STATE as c_int), 0);
        let mut ev: ibv_async_event = std::mem::zeroed();
        assert_eq!(ibv_get_async_event(b.ctx, &mut ev), 0);
        assert_eq!(ev.event_type, IBV_EVENT_QP_LAST_WQE_REACHED);
        assert_eq!(ev.element.qp, qb);
        ibv_ack_async_event(&mut ev);
        assert_eq!((*qb).events_completed, 2);
        // Two more entries into Error, two more events: the first taken and not yet
        // acknowledged, the second left queued. The destroy waits for the acknowledgement
        // (the program may still use the event's pointer), as rdma-core's does; the event
        // left queued is skipped once the QP is gone.
        let mut reset: ibv_qp_attr = std::mem::zeroed();
        reset.qp_state = IBV_QPS_RESET;
        for _ in 0..2 {
            assert_eq!(ibv_modify_qp(qb, &mut reset, IBV_QP_STATE as c_int), 0);
            assert_eq!(ibv_modify_qp(qb, &mut attr, IBV_QP_STATE as c_int), 0);
        }
        let mut taken: ibv_async_event = std::mem::zeroed();
        assert_eq!(ibv_get_async_event(b.ctx, &mut taken), 0);
        assert_eq!(taken.element.qp, qb);
        assert!(
            libc::poll(
                &mut libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0
                },
                1,
                0
            ) == 1
        );
        let q = qb as usize;
        let destroy = std::thread::spawn(move || ibv_destroy_qp(q as *mut ibv_qp));
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !destroy.is_finished(),
            "the destroy waits for the acknowledgement"
        );
        ibv_ack_async_event(&mut taken);
        assert_eq!(destroy.join().unwrap(), 0);
        assert_eq!(ibv_destroy_srq(srq), 0);
        assert_eq!(libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK), 0);
        assert_eq!(ibv_get_async_event(b.ctx, &mut ev), -1);
        for s in [&a, &b] {
            assert_eq!(ibv_destroy_qp(s.qp), 0);
            assert_eq!(ibv_dereg_mr(s.mr), 0);
            assert_eq!(ibv_destroy_cq(s.cq), 0);
            assert_eq!(ibv_dealloc_pd(s.pd), 0);
            assert_eq!(ibv_close_device(s.ctx), 0);
        }
    }
}

/// The line of `/proc/self/maps` of the mapping holding `addr`.
fn mapping_of(addr: usize) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .find(|l| {
            let range = l.split_whitespace().next().unwrap();
            let (lo, hi) = range.split_once('-').unwrap();
            let lo = usize::from_str_radix(lo, 16).unwrap();
            let hi = usize::from_str_radix(hi, 16).unwrap();
            (lo..hi).contains(&addr)
        })
        .unwrap_or_else(|| panic!("no mapping holds {addr:#x}"))
        .to_owned()
}

/// The child's half of [`zero_copy_registration_moves_whole_pages_onto_the_arena`]: does
/// nothing unless started by it (the library reads `SHMHCA_VERBS_ZERO_COPY` once per
/// process, so the opt-in is tested in a process of its own).
#[test]
fn zero_copy_child() {
    if std::env::var_os("SHMHCA_TEST_ZERO_COPY_CHILD").is_none() {
        return;
    }
    const LEN: usize = 4 * 4096;
    let access =
        (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ) as c_int;
    let a = side(access, false);
    let mut b = side(access, false);
    connect(&a, &b);
    // SAFETY: our objects; `buf` is a private anonymous mapping of LEN bytes this test owns
    // and touches only through raw pointers; requests' lists live across the calls.
    unsafe {
        let buf = libc::mmap(
            ptr::null_mut(),
            LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
        .cast::<u8>();
        assert_ne!(buf, libc::MAP_FAILED.cast());
        for i in 0..LEN {
            *buf.add(i) = (i % 251) as u8;
        }
        let mr = ibv_reg_mr(a.pd, buf.cast(), LEN, access);
        assert!(!mr.is_null());
        assert_eq!((*mr).addr, buf.cast());
        let map = mapping_of(buf as usize);
        assert!(
            map.contains("shmhca-arena"),
            "not moved onto the arena: {map}"
        );
        for i in 0..LEN {
            assert_eq!(*buf.add(i), (i % 251) as u8, "byte {i} after registration");
        }
        // A buffer that is not whole pages falls back to a registered buffer with a shadow.
        let odd = ibv_reg_mr(a.pd, buf.add(64).cast(), 100, access);
        assert!(!odd.is_null());

        // Send from the moved pages, and RDMA Read of bytes the program wrote since.
        let post_send_a = ops(a.ctx).post_send.unwrap();
        let post_send_b = ops(b.ctx).post_send.unwrap();
        let post_recv = ops(b.ctx).post_recv.unwrap();
        let mut rl = [sge(&b, 0, 4096)];
        let mut r: ibv_recv_wr = std::mem::zeroed();
        r.wr_id = 1;
        r.sg_list = rl.as_mut_ptr();
        r.num_sge = 1;
        let mut bad_r = ptr::null_mut();
        assert_eq!(post_recv(b.qp, &mut r, &mut bad_r), 0);
        let mut sl = [ibv_sge {
            addr: buf as u64 + 4096,
            length: 4096,
            lkey: (*mr).lkey,
        }];
        let mut w = send_wr(&mut sl, IBV_WR_SEND, IBV_SEND_SIGNALED);
        let mut bad = ptr::null_mut();
        assert_eq!(post_send_a(a.qp, &mut w, &mut bad), 0);
        assert_eq!(poll(&a).status, IBV_WC_SUCCESS);
        assert_eq!(poll(&b).status, IBV_WC_SUCCESS);
        for i in 0..4096 {
            assert_eq!(b.buf[i], ((4096 + i) % 251) as u8, "sent byte {i}");
        }
        std::ptr::copy_nonoverlapping(b"fresh bytes".as_ptr(), buf.add(8192), 11);
        let mut sl = [sge(&b, 100, 11)];
        let mut w = send_wr(&mut sl, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED);
        w.wr.rdma.remote_addr = buf as u64 + 8192;
        w.wr.rdma.rkey = (*mr).rkey;
        assert_eq!(post_send_b(b.qp, &mut w, &mut bad), 0);
        assert_eq!(poll(&b).status, IBV_WC_SUCCESS);
        assert_eq!(&b.buf[100..111], b"fresh bytes");
        b.buf[200..205].copy_from_slice(b"write");
        let mut sl = [sge(&b, 200, 5)];
        let mut w = send_wr(&mut sl, IBV_WR_RDMA_WRITE, IBV_SEND_SIGNALED);
        w.wr.rdma.remote_addr = buf as u64 + 12288;
        w.wr.rdma.rkey = (*mr).rkey;
        assert_eq!(post_send_b(b.qp, &mut w, &mut bad), 0);
        assert_eq!(poll(&b).status, IBV_WC_SUCCESS);
        assert_eq!(std::slice::from_raw_parts(buf.add(12288), 5), b"write");

        // Deregistering gives private memory back, with its bytes.
        assert_eq!(ibv_dereg_mr(odd), 0);
        assert_eq!(ibv_dereg_mr(mr), 0);
        let map = mapping_of(buf as usize);
        assert!(!map.contains("shmhca-arena"), "still the arena's: {map}");
        assert_eq!(
            std::slice::from_raw_parts(buf.add(8192), 11),
            b"fresh bytes"
        );
        assert_eq!(std::slice::from_raw_parts(buf.add(12288), 5), b"write");
        *buf = 0xAB;
        assert_eq!(*buf, 0xAB);
        assert_eq!(libc::munmap(buf.cast(), LEN), 0);
    }
    println!("zero copy child done");
}

/// `SHMHCA_VERBS_ZERO_COPY=1`: `ibv_reg_mr` of page-aligned whole pages moves them onto
/// the protection domain's arena in place (Send, RDMA Read and Write work on them; the
/// program's later writes are what the peer reads), other buffers fall back silently, and
/// `ibv_dereg_mr` gives private memory back with the bytes. Run in a child process.
#[test]
fn zero_copy_registration_moves_whole_pages_onto_the_arena() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "zero_copy_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SHMHCA_TEST_ZERO_COPY_CHILD", "1")
        .env("SHMHCA_VERBS_ZERO_COPY", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("zero copy child done"),
        "child failed:\n{stdout}\n{stderr}"
    );
}

extern "C" fn on_sigusr1(_: c_int) {}

/// A signal interrupts a blocking `ibv_get_async_event`: -1 with `EINTR`, as rdma-core's
/// `read()` of the async fd gives (a thread woken to stop must not wait for ever).
#[test]
fn a_signal_ends_a_blocking_async_event_wait_with_eintr() {
    // SAFETY: the exported functions with the arguments verbs.h documents; a handler that
    // does nothing, installed without SA_RESTART; the waiting thread's id from pthread_self.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigusr1 as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, ptr::null_mut()), 0);
        let mut n = 0;
        let list = ibv_get_device_list(&mut n);
        let ctx = ibv_open_device(*list);
        ibv_free_device_list(list);
        assert!(!ctx.is_null());
        let c = ctx as usize;
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            tx.send(libc::pthread_self() as usize).unwrap();
            let mut ev: ibv_async_event = std::mem::zeroed();
            let rc = ibv_get_async_event(c as *mut ibv_context, &mut ev);
            (rc, std::io::Error::last_os_error().raw_os_error())
        });
        let tid = rx.recv().unwrap() as libc::pthread_t;
        // Keep signalling until the wait ends (the first signal may come before it starts).
        let start = Instant::now();
        while !waiter.is_finished() {
            libc::pthread_kill(tid, libc::SIGUSR1);
            std::thread::sleep(Duration::from_millis(20));
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the wait never ended"
            );
        }
        assert_eq!(waiter.join().unwrap(), (-1, Some(libc::EINTR)));
        assert_eq!(ibv_close_device(ctx), 0);
    }
}
