//! An 8-byte Send ping-pong through the verbs ABI, the way perftest's `ib_send_lat` drives
//! it: two contexts of this process (two engines, connected by LID with `ibv_modify_qp`),
//! buffers of the program registered with `ibv_reg_mr`, and every post and poll through
//! `ibv_context.ops` as verbs.h's static inlines call them. Both engines run inline
//! (`SHMHCA_VERBS_MODE=inline`, set here unless the environment sets it) and are driven
//! from this one thread, so under callgrind it counts the instructions of the C layer and
//! the packet path together (see `bench/scripts/instructions.sh`, its "verbs ABI" figure,
//! beside the Rust API's `inline_pingpong`).
//!
//! Each one-way message is what perftest does per iteration: the receiver polls its
//! receive completion, reposts the receive, then posts its own Send (a one-entry gather
//! list, signaled every 100th as perftest's default `cq_mod`; perftest posts without
//! `IBV_SEND_INLINE` on a device it does not know). Arguments: round trips (default
//! 100,000) and message size in bytes (default 8, at most 2,048).
//!
//! ```sh
//! cargo run --release -p shmhca-verbs --example verbs_pingpong -- 100000 8
//! ```

// An FFI example: each block drives the C ABI as a C program would, with the pointers it
// made; one SAFETY comment per block says so.
#![allow(clippy::multiple_unsafe_ops_per_block)]

use std::ffi::c_int;
use std::ptr;

use ibverbs::context::*;
use ibverbs::ffi::*;
use ibverbs::objects::*;
use ibverbs::qp::*;

/// Receives each side keeps posted (perftest's `rx_depth` is larger; any depth above one
/// round trip's needs gives the same per-message figure).
const RX_DEPTH: u64 = 8;
/// Every how many Sends one is signaled (perftest's default `cq_mod`).
const CQ_MOD: u64 = 100;
/// Where receives land in each side's buffer (Sends go from offset 0).
const RECV_AT: u64 = 2048;

/// One context with its objects.
struct Side {
    ctx: *mut ibv_context,
    ops: ibv_context_ops,
    pd: *mut ibv_pd,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    /// The program's buffer: the Send's bytes at 0, receives at `RECV_AT`.
    buf: Vec<u8>,
    /// The message size.
    size: u32,
    mr: *mut ibv_mr,
    /// Sends posted.
    sent: u64,
    /// Signaled Sends whose completion was not yet polled.
    unpolled: u64,
}

/// Exits with `msg` and status 1 (an example, not a library: nothing to recover).
fn die(msg: &str) -> ! {
    eprintln!("verbs_pingpong: {msg}");
    std::process::exit(1);
}

fn side(size: u32) -> Side {
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
        let cq = ibv_create_cq(ctx, 256, ptr::null_mut(), ptr::null_mut(), 0);
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
            max_recv_wr: 64,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        attr.qp_type = IBV_QPT_RC;
        let qp = ibv_create_qp(pd, &mut attr);
        if qp.is_null() {
            die("ibv_create_qp failed");
        }
        Side {
            ctx,
            ops: (*ctx).ops,
            pd,
            cq,
            qp,
            buf,
            size,
            mr,
            sent: 0,
            unpolled: 0,
        }
    }
}

/// Moves `s`'s QP to RTS towards `peer`'s, addressed by the peer context's LID.
fn connect(s: &Side, peer: &Side) {
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

/// Posts one receive of the message size at `RECV_AT` in `s`'s buffer.
fn post_recv(s: &mut Side, id: u64) {
    let mut sge = ibv_sge {
        addr: s.buf.as_ptr() as u64 + RECV_AT,
        length: s.size,
        // SAFETY: our region.
        lkey: unsafe { (*s.mr).lkey },
    };
    // SAFETY: plain data.
    let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = id;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    let mut bad = ptr::null_mut();
    let post = s.ops.post_recv.unwrap_or_else(|| die("no post_recv op"));
    // SAFETY: our QP, a request whose list lives across the call.
    if unsafe { post(s.qp, &mut wr, &mut bad) } != 0 {
        die("ibv_post_recv failed");
    }
}

/// Posts one Send of the message size from offset 0 of `s`'s buffer, signaled every
/// `CQ_MOD`th.
fn post_send(s: &mut Side) {
    s.sent += 1;
    let mut sge = ibv_sge {
        addr: s.buf.as_ptr() as u64,
        length: s.size,
        // SAFETY: our region.
        lkey: unsafe { (*s.mr).lkey },
    };
    // SAFETY: plain data.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = s.sent;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    if s.sent % CQ_MOD == 0 {
        wr.send_flags = IBV_SEND_SIGNALED;
        s.unpolled += 1;
    }
    let mut bad = ptr::null_mut();
    let post = s.ops.post_send.unwrap_or_else(|| die("no post_send op"));
    // SAFETY: our QP, a request whose list lives across the call.
    if unsafe { post(s.qp, &mut wr, &mut bad) } != 0 {
        die("ibv_post_send failed");
    }
}

/// Polls `s`'s CQ once (which runs its engine, inline mode); true if it held a receive.
/// Send completions are counted off as they come.
fn poll_once(s: &mut Side) -> bool {
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

/// One way: `to` polls (its engine and, alternately, `from`'s run: two processes) until the
/// message arrives, reposts the receive, and answers with its own Send.
fn one_way(from: &mut Side, to: &mut Side, id: u64) {
    for spins in 0u64.. {
        if poll_once(to) {
            break;
        }
        // The sender's engine runs too (its Acks, its retransmission timer).
        poll_once(from);
        if spins > 10_000_000 {
            die("no message arrived");
        }
    }
    post_recv(to, id);
}

fn main() {
    let iters: u64 = match std::env::args().nth(1).map(|a| a.parse()) {
        None => 100_000,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => die("the first argument is the number of round trips (a positive integer)"),
    };
    let size: u32 = match std::env::args().nth(2).map(|a| a.parse()) {
        None => 8,
        Some(Ok(n)) if (1..=RECV_AT as u32).contains(&n) => n,
        Some(_) => die("the second argument is the message size: 1 to 2048 bytes"),
    };
    if let Some(extra) = std::env::args().nth(3) {
        die(&format!("unexpected argument {extra}: give round trips and message size"));
    }
    // Both engines are driven by this thread's calls (set before the first context).
    if std::env::var_os("SHMHCA_VERBS_MODE").is_none() {
        // SAFETY: no other thread runs yet.
        unsafe { std::env::set_var("SHMHCA_VERBS_MODE", "inline") };
    }
    let mut a = side(size);
    let mut b = side(size);
    connect(&a, &b);
    connect(&b, &a);
    for i in 0..RX_DEPTH {
        post_recv(&mut a, i);
        post_recv(&mut b, i);
    }
    for i in 0..iters {
        post_send(&mut a);
        one_way(&mut a, &mut b, i);
        post_send(&mut b);
        one_way(&mut b, &mut a, i);
    }
    // The last signaled Sends' Acks.
    for _ in 0..1_000_000 {
        if a.unpolled == 0 && b.unpolled == 0 {
            break;
        }
        poll_once(&mut a);
        poll_once(&mut b);
    }
    if a.unpolled != 0 || b.unpolled != 0 {
        die("signaled Sends never completed");
    }
    // SAFETY: our objects, destroyed in verbs' order.
    unsafe {
        for s in [&a, &b] {
            let ok = ibv_destroy_qp(s.qp) == 0
                && ibv_dereg_mr(s.mr) == 0
                && ibv_destroy_cq(s.cq) == 0
                && ibv_dealloc_pd(s.pd) == 0
                && ibv_close_device(s.ctx) == 0;
            if !ok {
                die("tearing down failed");
            }
        }
    }
    println!("{iters} round trips");
}
