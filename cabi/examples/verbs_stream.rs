//! A stream of 8-byte Sends through the verbs ABI, the way perftest's `ib_send_bw` runs
//! them: the sender keeps a window of `WINDOW` Sends outstanding, posting one at a time
//! (a one-entry gather list over a buffer registered with `ibv_reg_mr`), a completion asked
//! for every 100th (perftest's default `cq_mod`); both sides poll up to 16 completions at
//! a time (perftest's `CTX_POLL_BATCH`), the receiver until its CQ is empty, reposting
//! each receive as it completes. Two contexts of this process, both engines inline and
//! driven from this one thread: under callgrind it counts the instructions per message of
//! the C layer and the message-rate path together, beside the Rust API's `inline_stream`
//! (see `bench/scripts/instructions.sh`). Arguments: messages (default 1,000,000) and message
//! size in bytes (default 8, at most 2,048).
//!
//! ```sh
//! cargo run --release -p shmhca-verbs-core --example verbs_stream -- 1000000 8
//! ```

// An FFI example: the C ABI driven as a C program would; one SAFETY comment per block.
#![allow(clippy::multiple_unsafe_ops_per_block)]

mod common;

use common::*;
use shmhca_verbs_core::ffi::*;

/// Sends outstanding at most (perftest's default `-t` for bandwidth tests).
const WINDOW: u64 = 128;
/// Completions taken per poll (perftest's `CTX_POLL_BATCH`).
const POLL_BATCH: usize = 16;

/// Polls up to `POLL_BATCH` completions of `s` (which runs its engine, inline mode) into
/// `wc`; returns how many.
fn poll_batch(s: &Side, wc: &mut [ibv_wc; POLL_BATCH]) -> usize {
    let poll = s.ops.poll_cq.unwrap_or_else(|| die("no poll_cq op"));
    // SAFETY: our CQ, room for POLL_BATCH completions.
    let n = unsafe { poll(s.cq, POLL_BATCH as i32, wc.as_mut_ptr()) };
    let Ok(n) = usize::try_from(n) else {
        die("ibv_poll_cq failed")
    };
    for w in &wc[..n] {
        if w.status != IBV_WC_SUCCESS {
            die(&format!("completion status {}", w.status));
        }
    }
    n
}

fn main() {
    let n: u64 = match std::env::args().nth(1).map(|a| a.parse()) {
        None => 1_000_000,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => die("the first argument is the number of messages (a positive integer)"),
    };
    let size: u32 = match std::env::args().nth(2).map(|a| a.parse()) {
        None => 8,
        Some(Ok(s)) if (1..=RECV_AT as u32).contains(&s) => s,
        Some(_) => die("the second argument is the message size: 1 to 2048 bytes"),
    };
    if let Some(extra) = std::env::args().nth(3) {
        die(&format!(
            "unexpected argument {extra}: give messages and message size"
        ));
    }
    inline_mode();
    let mut a = side(size);
    let mut b = side(size);
    connect(&a, &b);
    connect(&b, &a);
    for i in 0..MAX_RECV_WR {
        post_recv(&mut b, i);
    }
    // SAFETY: plain data.
    let mut wc: [ibv_wc; POLL_BATCH] = unsafe { std::mem::zeroed() };
    let (mut done, mut received) = (0u64, 0u64);
    let mut spins = 0u64;
    while done < n || received < n {
        while a.sent < n && a.sent - done < WINDOW {
            post_send(&mut a);
        }
        // The receiver: its engine, its completions, a receive reposted for each, until
        // its CQ is empty (a server polls in a loop of its own: its receive queue does not
        // run dry waiting for this thread to come back).
        let mut got = 0;
        loop {
            let k = poll_batch(&b, &mut wc);
            for _ in 0..k {
                received += 1;
                post_recv(&mut b, received);
            }
            got += k;
            if k < POLL_BATCH {
                break;
            }
        }
        // The sender: its completions, each covering the Sends up to it.
        let sent = poll_batch(&a, &mut wc);
        if let Some(w) = wc[..sent].last() {
            done = w.wr_id;
        }
        if a.sent == n && received == n {
            // The last Sends are unsignaled unless the count ends on one: done with them.
            done = n;
        }
        spins = if got + sent == 0 { spins + 1 } else { 0 };
        if spins > 10_000_000 {
            die("the stream stalled");
        }
    }
    teardown(a);
    teardown(b);
    println!("{n} messages");
}
