//! Two processes, one line ring: the parent creates a segment, passes its memfd to a child
//! over a Unix socket (SCM_RIGHTS), and sends 300,000 sequenced frames of 1 to 16 lines
//! (padding at every lap's end, the lazy head) through a shared line ring; the child checks
//! that each arrives exactly once, in order, intact, and answers through a second line ring
//! in the same segment.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use shmhca_rings::fdpass::{recv_with_fds, send_with_fds};
use shmhca_rings::lines::{self, LINES_ALIGN, Line, MAX_FRAME_LINES};
use shmhca_rings::segment::{Access, Segment};

const KIND: u32 = 0x2b2c;
const COUNT: u64 = 300_000;
const DATA_RING: usize = 0;
const DATA_CAPACITY: usize = 256;
const REPORT_CAPACITY: usize = 4;
/// A deadline only so that a broken peer fails the test instead of hanging it.
const DEADLINE: Duration = Duration::from_secs(120);

fn report_ring_offset() -> usize {
    lines::shm_lines_bytes(DATA_CAPACITY)
        .unwrap()
        .next_multiple_of(LINES_ALIGN)
}

/// Frame `seq`'s line count: mostly one line, now and then up to 16.
fn frame_len(seq: u64) -> usize {
    let x = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 59;
    if x < 20 {
        1
    } else {
        (x as usize % MAX_FRAME_LINES) + 1
    }
}

/// Line `i` of frame `seq`: the sequence number and a check pattern in the user bytes.
fn line_of(seq: u64, i: usize) -> Line {
    let mut line = Line::ZERO;
    line.0[8..16].copy_from_slice(&seq.to_le_bytes());
    line.0[16] = i as u8;
    let check = seq.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ i as u64;
    for chunk in line.0[24..64].chunks_mut(8) {
        chunk.copy_from_slice(&check.to_le_bytes());
    }
    line.0[5..8].copy_from_slice(&check.to_le_bytes()[..3]);
    line
}

#[test]
#[ignore = "helper: run in a child process by frames_cross_processes_exactly_once_in_order"]
fn helper_lines_consumer_process() {
    let name = std::env::var(common::SOCKET_ENV).expect("run by the parent test");
    let stream = common::connect(&name);
    let mut buf = [0u8; 1];
    let (n, mut fds) = recv_with_fds(&stream, &mut buf, 1).unwrap();
    assert_eq!((n, fds.len()), (1, 1));
    let seg = Arc::new(Segment::open(fds.remove(0), KIND, Access::ReadWrite, usize::MAX).unwrap());
    let mut rx = lines::shm_lines_consumer(Arc::clone(&seg), DATA_RING).unwrap();
    let mut report = lines::shm_lines_producer(Arc::clone(&seg), report_ring_offset()).unwrap();
    let (mut received, mut bad, mut first_bad) = (0u64, 0u64, u64::MAX);
    let mut out = [Line::ZERO; MAX_FRAME_LINES];
    let start = Instant::now();
    while received < COUNT {
        match rx.recv(&mut out).unwrap() {
            Some(n) => {
                let ok = n == frame_len(received)
                    && out[..n]
                        .iter()
                        .enumerate()
                        .all(|(i, line)| line.0[5..] == line_of(received, i).0[5..]);
                if !ok {
                    bad += 1;
                    first_bad = first_bad.min(received);
                }
                received += 1;
            }
            None => {
                assert!(start.elapsed() < DEADLINE, "parent stopped sending");
                std::thread::yield_now();
            }
        }
    }
    // Anything extra would be a duplicate.
    std::thread::sleep(Duration::from_millis(20));
    if rx.has_frame().unwrap() {
        bad += 1;
    }
    let mut line = Line::ZERO;
    line.0[8..16].copy_from_slice(&received.to_le_bytes());
    line.0[16..24].copy_from_slice(&bad.to_le_bytes());
    line.0[24..32].copy_from_slice(&first_bad.to_le_bytes());
    let mut frame = loop {
        if let Some(f) = report.reserve(1).unwrap() {
            break f;
        }
        std::thread::yield_now();
    };
    frame.write_line(0, &line).unwrap();
    frame.commit();
    // Wait for the parent to hang up before unmapping.
    let _ = recv_with_fds(&stream, &mut buf, 0);
}

#[test]
fn frames_cross_processes_exactly_once_in_order() {
    let bytes = report_ring_offset() + lines::shm_lines_bytes(REPORT_CAPACITY).unwrap();
    let seg = Arc::new(
        Segment::builder(KIND, bytes)
            .name("shmhca-two-process-lines")
            .create()
            .unwrap(),
    );
    lines::init_shm_lines(&seg, DATA_RING, DATA_CAPACITY).unwrap();
    lines::init_shm_lines(&seg, report_ring_offset(), REPORT_CAPACITY).unwrap();
    let mut tx = lines::shm_lines_producer(Arc::clone(&seg), DATA_RING).unwrap();
    let mut reports = lines::shm_lines_consumer(Arc::clone(&seg), report_ring_offset()).unwrap();

    let name = common::socket_name("two-process-lines");
    let listener = common::listen(&name);
    let mut child = common::spawn_helper(
        "helper_lines_consumer_process",
        &[(common::SOCKET_ENV, name)],
    );
    let (stream, _) = listener.accept().unwrap();
    send_with_fds(&stream, b"S", &[seg.as_fd()]).unwrap();

    let start = Instant::now();
    for seq in 0..COUNT {
        let n = frame_len(seq);
        let mut frame = loop {
            if let Some(f) = tx.reserve(n).unwrap() {
                break f;
            }
            assert!(start.elapsed() < DEADLINE, "child stopped consuming");
            if let Some(status) = child.try_wait().unwrap() {
                panic!("child exited early: {status}");
            }
            std::thread::yield_now();
        };
        for i in 0..n {
            frame.write_line(i, &line_of(seq, i)).unwrap();
        }
        frame.commit();
    }
    let mut out = [Line::ZERO; MAX_FRAME_LINES];
    let report = loop {
        if reports.recv(&mut out).unwrap().is_some() {
            break out[0];
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("child exited without reporting: {status}");
        }
        assert!(start.elapsed() < DEADLINE, "no report from the child");
        std::thread::yield_now();
    };
    drop(stream);
    assert!(child.wait().unwrap().success(), "child failed");
    let word = |at: usize| u64::from_le_bytes(report.0[at..at + 8].try_into().unwrap());
    assert_eq!(
        (word(8), word(16)),
        (COUNT, 0),
        "frames lost, duplicated, torn or out of order (first bad: {})",
        word(24)
    );
}
