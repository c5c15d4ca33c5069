//! What a packet costs through the line ring and through the slot ring.
//!
//! **Instructions** (for callgrind: a deterministic figure that the host's noise cannot
//! move). One thread sends a packet and receives it, `N` times, over shared-memory rings of
//! 1024 entries:
//!
//! * `lines1`: a 1-line frame (64 bytes) through `shmhca_rings::lines`;
//! * `lines4`: a 4-line frame (256 bytes);
//! * `slot64`, `slot128`, `slot256`: one slot of that many bytes through `shmhca_rings::ring`
//!   (`push` then `pop`; 128 bytes is the engine's `PacketSlot` today).
//!
//! Run it for two counts and divide the difference, so that set-up cost cancels out:
//!
//! ```text
//! cargo build --release -p shmhca-rings --example ring_costs
//! for v in lines1 slot64 slot128 lines4 slot256; do
//!   for n in 10000 110000; do
//!     valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.$v.$n \
//!       target/release/examples/ring_costs $v $n
//!   done
//!   a=$(awk '/^summary:/ {print $2}' /tmp/cg.$v.10000)
//!   b=$(awk '/^summary:/ {print $2}' /tmp/cg.$v.110000)
//!   echo "$v: $(( (b - a) / 100000 )) instructions per packet (send + receive)"
//! done
//! ```
//!
//! **Round trips between two threads** (`pingpong [rounds] [iters]`): one packet each way,
//! a 1-line frame through a pair of line rings against a 64- and a 128-byte slot through a
//! pair of slot rings, back to back in each round (threads not pinned: on a shared host a
//! pinned thread can land on a core another process holds), printing each round's mean
//! round trip and the slot/line ratio, so that machine noise hits both alike. Every wait
//! polls with a spin-loop hint (`pause`) between looks, as a poll loop that does other work
//! between looks would: a consumer hammering the line the producer is writing slows the
//! line ring down (it polls the data line itself), the slot ring much less (it polls the
//! tail index).
//!
//! ```text
//! target/release/examples/ring_costs pingpong 7 200000
//! ```

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use shmhca_rings::Pod;
use shmhca_rings::lines::{self, Line, MAX_FRAME_LINES};
use shmhca_rings::ring;
use shmhca_rings::segment::{HugePages, Segment};

const CAPACITY: usize = 1024;

fn segment(len: usize) -> Arc<Segment> {
    Arc::new(
        Segment::builder(0x1257, len)
            .huge_pages(HugePages::Never)
            .create()
            .expect("segment"),
    )
}

fn lines_run<const N: usize>(count: u64) -> u64 {
    let seg = segment(lines::shm_lines_bytes(CAPACITY).expect("capacity"));
    lines::init_shm_lines(&seg, 0, CAPACITY).expect("init");
    let mut p = lines::shm_lines_producer(Arc::clone(&seg), 0).expect("producer");
    let mut c = lines::shm_lines_consumer(seg, 0).expect("consumer");
    let frame = [Line([7; 64]); N];
    let mut out = [Line::ZERO; MAX_FRAME_LINES];
    let mut sum = 0u64;
    for _ in 0..count {
        let mut f = p.reserve(N).expect("not broken").expect("room");
        for (i, line) in black_box(&frame).iter().enumerate() {
            f.write_line(i, line).expect("in frame");
        }
        f.commit();
        let n = c
            .recv(black_box(&mut out))
            .expect("not broken")
            .expect("a frame");
        sum += n as u64 + u64::from(out[0].0[9]);
    }
    sum
}

fn slot_run<T: Pod>(count: u64) -> u64 {
    let seg = segment(ring::shm_ring_bytes::<T>(CAPACITY).expect("capacity"));
    ring::init_shm_ring::<T>(&seg, 0, CAPACITY).expect("init");
    let mut p = ring::shm_producer::<T>(Arc::clone(&seg), 0).expect("producer");
    let mut c = ring::shm_consumer::<T>(seg, 0).expect("consumer");
    let v = T::zeroed();
    let mut sum = 0u64;
    for _ in 0..count {
        p.push(black_box(v)).expect("room");
        let got = c.pop().expect("not broken").expect("a slot");
        sum += u64::from(bytemuck::bytes_of(black_box(&got))[9]) + 1;
    }
    sum
}

/// Runs `echo` on a second thread until `body` returns; `echo` polls the stop flag.
fn with_echo<R>(echo: impl FnOnce(&AtomicBool) + Send + 'static, body: impl FnOnce() -> R) -> R {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    let echo = std::thread::spawn(move || echo(&flag));
    let r = body();
    stop.store(true, Ordering::Relaxed);
    echo.join().expect("echo thread");
    r
}

/// Mean round trip of a 1-line frame through two line rings.
fn lines_rtt(iters: u64) -> Duration {
    let ring = || {
        let seg = segment(lines::shm_lines_bytes(CAPACITY).expect("capacity"));
        lines::init_shm_lines(&seg, 0, CAPACITY).expect("init");
        (
            lines::shm_lines_producer(Arc::clone(&seg), 0).expect("producer"),
            lines::shm_lines_consumer(seg, 0).expect("consumer"),
        )
    };
    let ((mut ping_tx, mut ping_rx), (mut pong_tx, mut pong_rx)) = (ring(), ring());
    with_echo(
        move |stop| {
            let mut out = [Line::ZERO; MAX_FRAME_LINES];
            while !stop.load(Ordering::Relaxed) {
                if ping_rx.recv(&mut out).expect("not broken").is_none() {
                    std::hint::spin_loop();
                } else {
                    let mut f = loop {
                        if let Some(f) = pong_tx.reserve(1).expect("not broken") {
                            break f;
                        }
                    };
                    f.write_line(0, &out[0]).expect("in frame");
                    f.commit();
                }
            }
        },
        || {
            let line = Line([7; 64]);
            let mut out = [Line::ZERO; MAX_FRAME_LINES];
            let start = Instant::now();
            for _ in 0..iters {
                let mut f = ping_tx.reserve(1).expect("not broken").expect("room");
                f.write_line(0, black_box(&line)).expect("in frame");
                f.commit();
                while pong_rx.recv(&mut out).expect("not broken").is_none() {
                    std::hint::spin_loop();
                }
            }
            start.elapsed() / iters as u32
        },
    )
}

/// Mean round trip of one slot of `T` through two slot rings.
fn slot_rtt<T: Pod + Send>(iters: u64) -> Duration {
    let ring = || {
        let seg = segment(ring::shm_ring_bytes::<T>(CAPACITY).expect("capacity"));
        ring::init_shm_ring::<T>(&seg, 0, CAPACITY).expect("init");
        (
            ring::shm_producer::<T>(Arc::clone(&seg), 0).expect("producer"),
            ring::shm_consumer::<T>(seg, 0).expect("consumer"),
        )
    };
    let ((mut ping_tx, mut ping_rx), (mut pong_tx, mut pong_rx)) = (ring(), ring());
    with_echo(
        move |stop| {
            while !stop.load(Ordering::Relaxed) {
                match ping_rx.pop().expect("not broken") {
                    Some(v) => while pong_tx.push(v).is_err() {},
                    None => std::hint::spin_loop(),
                }
            }
        },
        || {
            let v = T::zeroed();
            let start = Instant::now();
            for _ in 0..iters {
                ping_tx.push(black_box(v)).expect("room");
                while pong_rx.pop().expect("not broken").is_none() {
                    std::hint::spin_loop();
                }
            }
            start.elapsed() / iters as u32
        },
    )
}

fn pingpong(rounds: u64, iters: u64) {
    println!("round  lines1_rtt  slot64_rtt  slot128_rtt  slot64/lines1  slot128/lines1");
    for round in 0..rounds {
        let l = lines_rtt(iters);
        let s64 = slot_rtt::<[u64; 8]>(iters);
        let s128 = slot_rtt::<[u64; 16]>(iters);
        println!(
            "{round:>5}  {l:>10.0?}  {s64:>10.0?}  {s128:>11.0?}  {:>13.2}  {:>14.2}",
            s64.as_secs_f64() / l.as_secs_f64(),
            s128.as_secs_f64() / l.as_secs_f64()
        );
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let variant = args.next().unwrap_or_default();
    if variant == "pingpong" {
        let rounds = args.next().and_then(|n| n.parse().ok()).unwrap_or(7);
        let iters = args.next().and_then(|n| n.parse().ok()).unwrap_or(200_000);
        pingpong(rounds, iters);
        return;
    }
    let count: u64 = args.next().and_then(|n| n.parse().ok()).unwrap_or(100_000);
    let sum = match variant.as_str() {
        "lines1" => lines_run::<1>(count),
        "lines4" => lines_run::<4>(count),
        "slot64" => slot_run::<[u64; 8]>(count),
        "slot128" => slot_run::<[u64; 16]>(count),
        "slot256" => slot_run::<[u64; 32]>(count),
        _ => {
            eprintln!(
                "usage: ring_costs lines1|lines4|slot64|slot128|slot256 [count] | pingpong [rounds] [iters]"
            );
            std::process::exit(2);
        }
    };
    println!("{sum}");
}
