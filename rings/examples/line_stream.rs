//! The line ring's streaming rate between two threads: a producer sends one-line frames as
//! fast as the ring takes them, a consumer receives them, and the run prints frames per
//! second. It bounds what cache-line traffic alone allows a stream of one-line packets
//! (the README's message-rate section compares `send_bw -s 8` with it). Argument: frames
//! (default 20,000,000). Pin it to two cores to measure between them:
//!
//! ```sh
//! cargo build --release -p shmhca-rings --example line_stream
//! taskset -c 0,1 target/release/examples/line_stream 20000000
//! ```

use std::sync::Arc;

use shmhca_rings::lines::{self, Line, MAX_FRAME_LINES};
use shmhca_rings::segment::{HugePages, Segment};

/// Lines in the ring (a link's default).
const CAPACITY: usize = 1024;

fn main() {
    let frames: u64 = match std::env::args().nth(1).map(|a| a.parse()) {
        None => 20_000_000,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            eprintln!("line_stream: the argument is the number of frames");
            std::process::exit(2);
        }
    };
    let bytes = lines::shm_lines_bytes(CAPACITY).expect("a valid capacity");
    let seg = match Segment::builder(0x4c53_5452, bytes)
        .huge_pages(HugePages::Auto)
        .create()
    {
        Ok(seg) => Arc::new(seg),
        Err(e) => {
            eprintln!("line_stream: cannot create the shared segment: {e}");
            std::process::exit(1);
        }
    };
    lines::init_shm_lines(&seg, 0, CAPACITY).expect("a fresh segment");
    let mut tx = lines::shm_lines_producer(Arc::clone(&seg), 0).expect("initialised");
    let mut rx = lines::shm_lines_consumer(seg, 0).expect("initialised");
    let consumer = std::thread::spawn(move || {
        let mut out = [Line::ZERO; MAX_FRAME_LINES];
        let mut got = 0u64;
        while got < frames {
            match rx.recv(&mut out) {
                Ok(Some(_)) => got += 1,
                Ok(None) => std::hint::spin_loop(),
                Err(e) => panic!("the ring broke: {e}"),
            }
        }
    });
    let line = Line::ZERO;
    let start = std::time::Instant::now();
    let mut sent = 0u64;
    while sent < frames {
        match tx.reserve(1) {
            Ok(Some(mut frame)) => {
                frame
                    .write_line(0, &line)
                    .expect("line 0 of a 1-line frame");
                frame.commit();
                sent += 1;
            }
            Ok(None) => std::hint::spin_loop(),
            Err(e) => panic!("the ring broke: {e}"),
        }
    }
    consumer.join().expect("the consumer finished");
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{frames} one-line frames in {secs:.3} s: {:.1} M frames/s",
        frames as f64 / secs / 1e6
    );
}
