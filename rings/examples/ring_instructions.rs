//! Instructions per packet through the line ring and the slot ring, for callgrind: a
//! deterministic figure that the host's noise cannot move. One thread sends a packet and
//! receives it, `N` times, over shared-memory rings of 1024 entries:
//!
//! * `lines1`: a 1-line frame (64 bytes) through `shmhca_rings::lines`;
//! * `lines4`: a 4-line frame (256 bytes);
//! * `slot64`, `slot128`, `slot256`: one slot of that many bytes through `shmhca_rings::ring`
//!   (`push` then `pop`; 128 bytes is the engine's `PacketSlot` today).
//!
//! Run it for two counts and divide the difference, so that set-up cost cancels out:
//!
//! ```text
//! cargo build --release -p shmhca-rings --example ring_instructions
//! for v in lines1 slot64 slot128 lines4 slot256; do
//!   for n in 10000 110000; do
//!     valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.$v.$n \
//!       target/release/examples/ring_instructions $v $n
//!   done
//!   a=$(awk '/^summary:/ {print $2}' /tmp/cg.$v.10000)
//!   b=$(awk '/^summary:/ {print $2}' /tmp/cg.$v.110000)
//!   echo "$v: $(( (b - a) / 100000 )) instructions per packet (send + receive)"
//! done
//! ```

use std::hint::black_box;
use std::sync::Arc;

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

fn main() {
    let mut args = std::env::args().skip(1);
    let variant = args.next().unwrap_or_default();
    let count: u64 = args.next().and_then(|n| n.parse().ok()).unwrap_or(100_000);
    let sum = match variant.as_str() {
        "lines1" => lines_run::<1>(count),
        "lines4" => lines_run::<4>(count),
        "slot64" => slot_run::<[u64; 8]>(count),
        "slot128" => slot_run::<[u64; 16]>(count),
        "slot256" => slot_run::<[u64; 32]>(count),
        _ => {
            eprintln!("usage: ring_instructions lines1|lines4|slot64|slot128|slot256 [count]");
            std::process::exit(2);
        }
    };
    println!("{sum}");
}
