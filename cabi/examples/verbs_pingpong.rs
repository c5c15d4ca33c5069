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
//! cargo run --release -p shmhca-verbs-core --example verbs_pingpong -- 100000 8
//! ```

// An FFI example: the C ABI driven as a C program would; one SAFETY comment per block.
#![allow(clippy::multiple_unsafe_ops_per_block)]

mod common;

use common::*;

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
        die(&format!(
            "unexpected argument {extra}: give round trips and message size"
        ));
    }
    inline_mode();
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
    teardown(a);
    teardown(b);
    println!("{iters} round trips");
}
