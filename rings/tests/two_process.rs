//! Two processes, one ring: the parent creates a segment, passes its memfd to a child over
//! a Unix socket (SCM_RIGHTS), and pushes 1,000,000 sequenced values through a shared ring;
//! the child checks that each arrives exactly once, in order, intact, and answers through a
//! second ring in the same segment.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use shmhca_rings::fdpass::{recv_with_fds, send_with_fds};
use shmhca_rings::ring;
use shmhca_rings::segment::{Access, Segment};
use shmhca_rings::{Pod, Zeroable};

const KIND: u32 = 0x2b2b;
const COUNT: u64 = 1_000_000;
const DATA_RING: usize = 0;
const DATA_CAPACITY: usize = 256;
const ACK_CAPACITY: usize = 4;
/// A deadline only so that a broken peer fails the test instead of hanging it.
const DEADLINE: Duration = Duration::from_secs(120);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
struct Msg {
    seq: u64,
    check: u64,
    fill: [u64; 6],
}

impl Msg {
    fn new(seq: u64) -> Self {
        let check = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5555;
        Msg {
            seq,
            check,
            fill: [check; 6],
        }
    }
}

/// What the child reports back: how many values arrived in order, and the first bad one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
struct Report {
    received: u64,
    first_bad: u64,
    bad_count: u64,
}

fn ack_ring_offset() -> usize {
    ring::shm_ring_bytes::<Msg>(DATA_CAPACITY)
        .unwrap()
        .next_multiple_of(ring::RING_ALIGN)
}

#[test]
#[ignore = "helper: run in a child process by a_million_values_cross_processes_exactly_once_in_order"]
fn helper_consumer_process() {
    let name = std::env::var(common::SOCKET_ENV).expect("run by the parent test");
    let stream = common::connect(&name);
    let mut buf = [0u8; 1];
    let (n, mut fds) = recv_with_fds(&stream, &mut buf, 1).unwrap();
    assert_eq!((n, fds.len()), (1, 1));
    let seg = Arc::new(Segment::open(fds.remove(0), KIND, Access::ReadWrite, usize::MAX).unwrap());
    let mut rx = ring::shm_consumer::<Msg>(Arc::clone(&seg), DATA_RING).unwrap();
    let mut ack = ring::shm_producer::<Report>(Arc::clone(&seg), ack_ring_offset()).unwrap();
    let mut report = Report {
        received: 0,
        first_bad: u64::MAX,
        bad_count: 0,
    };
    let mut out = [Msg::zeroed(); 32];
    let start = Instant::now();
    while report.received < COUNT {
        let n = rx.pop_burst(&mut out).unwrap();
        for m in &out[..n] {
            if *m != Msg::new(report.received) {
                report.bad_count += 1;
                report.first_bad = report.first_bad.min(report.received);
            }
            report.received += 1;
        }
        if n == 0 {
            assert!(start.elapsed() < DEADLINE, "parent stopped sending");
            std::hint::spin_loop();
        }
    }
    // Anything extra would be a duplicate.
    std::thread::sleep(Duration::from_millis(20));
    report.bad_count += rx.available().unwrap() as u64;
    while ack.push(report).is_err() {
        std::hint::spin_loop();
    }
    // Wait for the parent to hang up before unmapping.
    let _ = recv_with_fds(&stream, &mut buf, 0);
}

#[test]
fn a_million_values_cross_processes_exactly_once_in_order() {
    let bytes = ack_ring_offset() + ring::shm_ring_bytes::<Report>(ACK_CAPACITY).unwrap();
    let seg = Arc::new(
        Segment::builder(KIND, bytes)
            .name("shmhca-two-process")
            .create()
            .unwrap(),
    );
    ring::init_shm_ring::<Msg>(&seg, DATA_RING, DATA_CAPACITY).unwrap();
    ring::init_shm_ring::<Report>(&seg, ack_ring_offset(), ACK_CAPACITY).unwrap();
    let mut tx = ring::shm_producer::<Msg>(Arc::clone(&seg), DATA_RING).unwrap();
    let mut acks = ring::shm_consumer::<Report>(Arc::clone(&seg), ack_ring_offset()).unwrap();

    let name = common::socket_name("two-process");
    let listener = common::listen(&name);
    let mut child = common::spawn_helper("helper_consumer_process", &[(common::SOCKET_ENV, name)]);
    let (stream, _) = listener.accept().unwrap();
    send_with_fds(&stream, b"S", &[seg.as_fd()]).unwrap();

    let start = Instant::now();
    let mut next = 0u64;
    let mut batch = [Msg::zeroed(); 32];
    while next < COUNT {
        // Vary the burst size so that pushes straddle the wrap point in every way.
        let n = ((next % 29) + 1).min(COUNT - next) as usize;
        for (i, m) in batch[..n].iter_mut().enumerate() {
            *m = Msg::new(next + i as u64);
        }
        let pushed = tx.push_burst(&batch[..n]).unwrap();
        next += pushed as u64;
        if pushed == 0 {
            assert!(start.elapsed() < DEADLINE, "child stopped consuming");
            if let Some(status) = child.try_wait().unwrap() {
                panic!("child exited early: {status}");
            }
            std::hint::spin_loop();
        }
    }
    let report = loop {
        if let Some(r) = acks.pop().unwrap() {
            break r;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("child exited without reporting: {status}");
        }
        assert!(start.elapsed() < DEADLINE, "no report from the child");
        std::thread::yield_now();
    };
    drop(stream);
    assert!(child.wait().unwrap().success(), "child failed");
    assert_eq!(
        report,
        Report {
            received: COUNT,
            first_bad: u64::MAX,
            bad_count: 0
        },
        "every value once, in order, intact"
    );
}
