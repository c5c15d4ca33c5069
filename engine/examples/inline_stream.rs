//! A stream of 8-byte inline Sends between two inline-mode engines driven from one
//! thread, the way `shmhca-perf send_bw` runs them: the sender keeps a window of `WINDOW`
//! Sends outstanding, posting one at a time, with a completion asked for every `SIGNAL`th;
//! the receiver reposts each receive as it completes. No cross-core traffic: under
//! callgrind it counts the instructions per message of the message-rate path (sender and
//! receiver together; see `bench/scripts/instructions.sh`). Arguments: messages (default
//! 1,000,000) and message size in bytes (default 8, sent inline).
//!
//! ```sh
//! cargo run --release -p shmhca --example inline_stream -- 1000000 8
//! ```

mod common;

use shmhca::*;

/// Sends outstanding at most (shmhca-perf's default `-t`).
const WINDOW: u64 = 128;
/// A completion is asked for every this many Sends (shmhca-perf's default `-Q`).
const SIGNAL: u64 = 100;
/// Receives kept posted (shmhca-perf's default `-r`).
const RECEIVES: u64 = 512;

/// The command line: messages (default 1,000,000) and message size (default 8, at most
/// `QpCaps::default().max_inline_data`).
fn parse_args() -> std::result::Result<(u64, u32), String> {
    let mut args = std::env::args().skip(1);
    let n = match args.next() {
        None => 1_000_000,
        Some(a) => a
            .parse()
            .map_err(|_| format!("messages must be a number, not {a}"))?,
    };
    let max = QpCaps::default().max_inline_data;
    let size = match args.next() {
        None => 8,
        Some(a) => a
            .parse()
            .ok()
            .filter(|s| (1..=max).contains(s))
            .ok_or_else(|| format!("message size {a}: give 1 to {max} bytes (sent inline)"))?,
    };
    if let Some(extra) = args.next() {
        return Err(format!(
            "unexpected argument {extra}: give at most messages and message size"
        ));
    }
    Ok((n, size))
}

fn main() -> shmhca::Result<()> {
    let (n, size) = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("inline_stream: {e}");
            std::process::exit(2);
        }
    };
    let common::Pair {
        mut qa,
        mut qb,
        mut ca,
        mut cb,
        pa: _pa,
        pb,
        a: _a,
        b: _b,
    } = common::connected_pair(
        1024,
        QpCaps {
            max_send_wr: 256,
            max_recv_wr: 1024,
            ..QpCaps::default()
        },
    )?;
    let mb = pb.alloc_mr(u64::from(size), AccessFlags::LOCAL_WRITE)?;
    let recv = [mb.sge(0, size)?];
    for i in 0..RECEIVES {
        qb.post_recv(&RecvWr::new(i, &recv))?;
    }
    let payload = vec![7u8; size as usize];
    let mut wc = [WorkCompletion::default(); 64];
    let (mut posted, mut done, mut received) = (0u64, 0u64, 0u64);
    while done < n {
        while posted < n && posted - done < WINDOW {
            posted += 1;
            let flags = if posted % SIGNAL == 0 || posted == n {
                SendFlags::SIGNALED
            } else {
                SendFlags::NONE
            };
            qa.post_send(&SendWr::inline(posted, SendOp::Send, &payload).flags(flags))?;
        }
        // The receiver: its engine, its completions, a receive reposted for each.
        let got = cb.poll(&mut wc);
        for w in &wc[..got] {
            assert_eq!(w.status, WcStatus::Success, "{w:?}");
            received += 1;
            qb.post_recv(&RecvWr::new(received, &recv))?;
        }
        // The sender: its completions (each covers every Send up to it).
        let got = ca.poll(&mut wc);
        for w in &wc[..got] {
            assert_eq!(w.status, WcStatus::Success, "{w:?}");
            done = w.wr_id;
        }
    }
    while received < n {
        let got = cb.poll(&mut wc);
        received += got as u64;
        for _ in 0..got {
            qb.post_recv(&RecvWr::new(received, &recv))?;
        }
    }
    println!("{n} messages");
    Ok(())
}
