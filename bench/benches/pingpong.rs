//! Two-process ping-pong over a shared segment: one-way latency of
//!
//! * `bare line`: a bare cache-line ping-pong (one word each way, each on its own line);
//! * `ring NB`: the shmhca ring, one slot each way, for 16-, 64-, 128- and 256-byte slots;
//! * `lines 64B`: the stamped line ring (`shmhca_rings::lines`), a one-line frame each way:
//!   no tail index, the receiver learns of the frame and reads it in the same line;
//! * two references that bracket what any "index line + data line" design can reach:
//!   `2-line` (the sender writes a 64-byte data line, then a flag on another line; the
//!   receiver spins on the flag, then reads the data) and `2-line+pf` (the same, with the
//!   receiver prefetching the data line while it spins, as the ring's consumer does);
//!
//! as HdrHistogram percentiles, with the ratio to the bare line in the same run.
//!
//! The parent creates the segment and re-executes this binary as the child
//! (`SHMHCA_PINGPONG_ROLE=child`), passes the memfd over an abstract Unix socket with
//! SCM_RIGHTS, and pins itself and the child to different cores. Runs are interleaved
//! (bare, rings, references, then again, round after round) so that machine noise hits
//! every variant alike; round 0 is a warm-up and is not recorded. One-way latency = round
//! trip / 2, timed with the TSC (calibrated against the monotonic clock), one reading per
//! round trip. Both ends poll a ring the way the engine does: `pop_burst` into 32 slots.
//!
//! ```text
//! cargo bench -p shmhca-bench --bench pingpong
//! PINGPONG_ROUNDS=100 PINGPONG_ITERS=50000 cargo bench -p shmhca-bench --bench pingpong
//! ```

// Atomics placed in the shared segment (bare and reference ping-pongs, control words), and
// the TSC and prefetch intrinsics.
#![allow(unsafe_code)]

use std::io::{BufRead, BufReader};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use shmhca_rings::Pod;
use shmhca_rings::fdpass::{recv_with_fds, send_with_fds};
use shmhca_rings::lines::{self, Line, LinesConsumer, LinesProducer, MAX_FRAME_LINES, ShmLines};
use shmhca_rings::ring::{self, Consumer, Producer, ShmStorage};
use shmhca_rings::segment::{Access, HugePages, Segment};

const KIND: u32 = 0x9179_9019;
const ROLE_ENV: &str = "SHMHCA_PINGPONG_ROLE";
const SOCKET_ENV: &str = "SHMHCA_PINGPONG_SOCKET";
const CAPACITY: usize = 64;
const STOP: u64 = u64::MAX;

/// What is measured, in the order the runs are interleaved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    Bare,
    Ring16,
    Ring64,
    Ring128,
    Ring256,
    Lines64,
    TwoLine,
    TwoLinePrefetch,
}

const VARIANTS: [Variant; 8] = [
    Variant::Bare,
    Variant::Ring16,
    Variant::Ring64,
    Variant::Ring128,
    Variant::Ring256,
    Variant::Lines64,
    Variant::TwoLine,
    Variant::TwoLinePrefetch,
];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Bare => "bare line",
            Variant::Ring16 => "ring 16B",
            Variant::Ring64 => "ring 64B",
            Variant::Ring128 => "ring 128B",
            Variant::Ring256 => "ring 256B",
            Variant::Lines64 => "lines 64B",
            Variant::TwoLine => "2-line",
            Variant::TwoLinePrefetch => "2-line+pf",
        }
    }

    fn index(self) -> usize {
        VARIANTS.iter().position(|&v| v == self).unwrap_or(0)
    }
}

/// Offsets in the data area; every word below is alone on a 128-byte line pair.
mod layout {
    /// Command word (parent → child) and its acknowledgement.
    pub(crate) const CMD: usize = 0;
    pub(crate) const ACK: usize = 128;
    /// Bare ping-pong words.
    pub(crate) const PING: usize = 256;
    pub(crate) const PONG: usize = 384;
    /// Two-line reference: data and flag for each direction.
    pub(crate) const DATA_AB: usize = 512;
    pub(crate) const FLAG_AB: usize = 640;
    pub(crate) const DATA_BA: usize = 768;
    pub(crate) const FLAG_BA: usize = 896;
    /// The rings: two (one per direction) for each slot size.
    pub(crate) const RINGS: usize = 1024;
}

/// Offset of ring `n` (0..8: slot size index * 2 + direction; 8, 9: the line rings, by
/// direction; 10: the end).
fn ring_offset(n: usize) -> usize {
    let per_ring = ring::shm_ring_bytes::<[u64; 32]>(CAPACITY)
        .unwrap()
        .max(lines::shm_lines_bytes(CAPACITY).unwrap())
        .next_multiple_of(lines::LINES_ALIGN.max(128));
    (layout::RINGS + n * per_ring).next_multiple_of(lines::LINES_ALIGN)
}

/// An atomic word at `offset` in the segment's data area.
fn word(seg: &Segment, offset: usize) -> &AtomicU64 {
    assert!(offset + 8 <= seg.data_len() && offset % 8 == 0);
    // SAFETY: in bounds and 8-aligned (checked above; the data area is page-aligned), in a
    // read-write mapping that lives as long as the borrow of `seg`; AtomicU64 is valid for
    // any bits and is the way to share a word with the other process.
    unsafe {
        &*seg
            .data_ptr()
            .as_ptr()
            .wrapping_add(offset)
            .cast::<AtomicU64>()
    }
}

/// Busy-wait step that checks now and then that the peer process is still alive.
struct Spinner<F: FnMut() -> bool> {
    n: u32,
    alive: F,
}

impl<F: FnMut() -> bool> Spinner<F> {
    fn spin(&mut self) {
        self.n = self.n.wrapping_add(1);
        if self.n % (1 << 22) == 0 && !(self.alive)() {
            eprintln!("pingpong: the other process is gone");
            std::process::exit(2);
        }
        std::hint::spin_loop();
    }
}

fn tsc() -> u64 {
    // SAFETY: rdtsc has no preconditions on x86_64.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// TSC ticks per nanosecond, measured against the monotonic clock.
fn tsc_per_ns() -> f64 {
    let (t0, c0) = (Instant::now(), tsc());
    std::thread::sleep(Duration::from_millis(200));
    let (t1, c1) = (Instant::now(), tsc());
    (c1 - c0) as f64 / (t1 - t0).as_nanos() as f64
}

fn pin(index: usize) -> String {
    match core_affinity::get_core_ids() {
        Some(ids) if ids.len() > index => {
            if core_affinity::set_for_current(ids[index]) {
                format!("pinned to core {}", ids[index].id)
            } else {
                "pinning failed".into()
            }
        }
        _ => "not pinned (not enough cores)".into(),
    }
}

// ---- the two-line reference -------------------------------------------------------------

fn two_line_send(seg: &Segment, i: u64, data: usize, flag: usize) {
    for k in 0..8 {
        word(seg, data + 8 * k).store(i, Ordering::Relaxed);
    }
    word(seg, flag).store(i, Ordering::Release);
}

fn two_line_wait<F: FnMut() -> bool>(
    seg: &Segment,
    i: u64,
    data: usize,
    flag: usize,
    prefetch: bool,
    spinner: &mut Spinner<F>,
) {
    let flag = word(seg, flag);
    while flag.load(Ordering::Acquire) != i {
        if prefetch {
            let line = word(seg, data) as *const AtomicU64;
            // SAFETY: prefetch never faults; the address is inside the mapping.
            unsafe {
                core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(line.cast())
            };
        }
        spinner.spin();
    }
    assert_eq!(
        word(seg, data).load(Ordering::Relaxed),
        i,
        "data line before its flag"
    );
}

fn reset_two_line(seg: &Segment) {
    for offset in (layout::DATA_AB..layout::RINGS).step_by(8) {
        word(seg, offset).store(0, Ordering::Relaxed);
    }
}

// ---- rings ------------------------------------------------------------------------------

type Ends<T> = (Producer<T, ShmStorage<T>>, Consumer<T, ShmStorage<T>>);

/// The four ring pairs and the line ring pair of one process.
struct Rings {
    r16: Ends<[u64; 2]>,
    r64: Ends<[u64; 8]>,
    r128: Ends<[u64; 16]>,
    r256: Ends<[u64; 32]>,
    lines: (LinesProducer<ShmLines>, LinesConsumer<ShmLines>),
}

fn ends<T: Pod>(seg: &Arc<Segment>, size_index: usize, parent: bool) -> Ends<T> {
    let (out_ring, in_ring) = if parent { (0, 1) } else { (1, 0) };
    (
        ring::shm_producer::<T>(Arc::clone(seg), ring_offset(size_index * 2 + out_ring)).unwrap(),
        ring::shm_consumer::<T>(Arc::clone(seg), ring_offset(size_index * 2 + in_ring)).unwrap(),
    )
}

impl Rings {
    fn init(seg: &Segment) {
        for dir in 0..2 {
            ring::init_shm_ring::<[u64; 2]>(seg, ring_offset(dir), CAPACITY).unwrap();
            ring::init_shm_ring::<[u64; 8]>(seg, ring_offset(2 + dir), CAPACITY).unwrap();
            ring::init_shm_ring::<[u64; 16]>(seg, ring_offset(4 + dir), CAPACITY).unwrap();
            ring::init_shm_ring::<[u64; 32]>(seg, ring_offset(6 + dir), CAPACITY).unwrap();
            lines::init_shm_lines(seg, ring_offset(8 + dir), CAPACITY).unwrap();
        }
    }

    fn attach(seg: &Arc<Segment>, parent: bool) -> Self {
        let (out_ring, in_ring) = if parent { (8, 9) } else { (9, 8) };
        Rings {
            r16: ends(seg, 0, parent),
            r64: ends(seg, 1, parent),
            r128: ends(seg, 2, parent),
            r256: ends(seg, 3, parent),
            lines: (
                lines::shm_lines_producer(Arc::clone(seg), ring_offset(out_ring)).unwrap(),
                lines::shm_lines_consumer(Arc::clone(seg), ring_offset(in_ring)).unwrap(),
            ),
        }
    }
}

/// Sends `line` as a one-line frame (the user bytes 5..64; the ring owns 0..5).
fn lines_send(tx: &mut LinesProducer<ShmLines>, line: &Line) {
    let mut frame = tx
        .reserve(1)
        .unwrap()
        .expect("one message in flight: room for it");
    frame.write_line(0, line).unwrap();
    frame.commit();
}

/// Child side of the line-ring run: receive each frame and send it back.
fn lines_echo<F: FnMut() -> bool>(
    ends: &mut (LinesProducer<ShmLines>, LinesConsumer<ShmLines>),
    iters: u64,
    spinner: &mut Spinner<F>,
) {
    let (tx, rx) = ends;
    let mut buf = [Line::ZERO; MAX_FRAME_LINES];
    let mut done = 0;
    while done < iters {
        match rx.recv(&mut buf).unwrap() {
            Some(1) => {
                lines_send(tx, &buf[0]);
                done += 1;
            }
            Some(n) => panic!("a {n}-line frame: the parent sends one line"),
            None => spinner.spin(),
        }
    }
}

/// Parent side of the line-ring run: send a one-line frame, wait for it to come back.
fn lines_round_trips<F: FnMut() -> bool>(
    ends: &mut (LinesProducer<ShmLines>, LinesConsumer<ShmLines>),
    iters: u64,
    clock: &mut Clock<'_>,
    spinner: &mut Spinner<F>,
) {
    let (tx, rx) = ends;
    let mut buf = [Line::ZERO; MAX_FRAME_LINES];
    clock.start();
    for i in 1..=iters {
        let mut line = Line::ZERO;
        line.0[8..16].copy_from_slice(&i.to_ne_bytes());
        lines_send(tx, &line);
        let n = loop {
            if let Some(n) = rx.recv(&mut buf).unwrap() {
                break n;
            }
            spinner.spin();
        };
        clock.lap();
        assert_eq!(
            (n, u64::from_ne_bytes(buf[0].0[8..16].try_into().unwrap())),
            (1, i),
            "the echo carries the same message back"
        );
    }
}

fn seq_of<T: Pod>(v: &T) -> u64 {
    u64::from_ne_bytes(bytemuck::bytes_of(v)[..8].try_into().unwrap())
}

/// Child side of a ring run: pop what arrives (engine shape: up to 32) and push it back.
fn echo<T: Pod, F: FnMut() -> bool>(ends: &mut Ends<T>, iters: u64, spinner: &mut Spinner<F>) {
    let (tx, rx) = ends;
    let mut buf = [T::zeroed(); 32];
    let mut done = 0;
    while done < iters {
        let n = rx.pop_burst(&mut buf).unwrap();
        if n == 0 {
            spinner.spin();
            continue;
        }
        assert_eq!(
            tx.push_burst(&buf[..n]).unwrap(),
            n,
            "one message in flight: room to echo"
        );
        done += n as u64;
    }
}

/// Parent side of a ring run: push one slot, wait for it to come back, record rtt / 2.
fn ring_round_trips<T: Pod, F: FnMut() -> bool>(
    ends: &mut Ends<T>,
    iters: u64,
    clock: &mut Clock<'_>,
    spinner: &mut Spinner<F>,
) {
    let (tx, rx) = ends;
    let mut buf = [T::zeroed(); 32];
    clock.start();
    for i in 1..=iters {
        let mut message = T::zeroed();
        bytemuck::bytes_of_mut(&mut message)[..8].copy_from_slice(&i.to_ne_bytes());
        tx.push(message).unwrap();
        let n = loop {
            let n = rx.pop_burst(&mut buf).unwrap();
            if n > 0 {
                break n;
            }
            spinner.spin();
        };
        clock.lap();
        assert_eq!(
            (n, seq_of(&buf[0])),
            (1, i),
            "the echo carries the same message back"
        );
    }
}

/// Records one-way latency (half of each round trip) into a histogram.
struct Clock<'a> {
    hist: &'a mut Histogram<u64>,
    ticks_per_ns: f64,
    last: u64,
}

impl Clock<'_> {
    fn start(&mut self) {
        self.last = tsc();
    }

    fn lap(&mut self) {
        let now = tsc();
        let one_way_ns = ((now - self.last) as f64 / self.ticks_per_ns / 2.0).round() as u64;
        self.hist.saturating_record(one_way_ns.max(1));
        self.last = now;
    }
}

// ---- child ------------------------------------------------------------------------------

fn child() {
    let name = std::env::var(SOCKET_ENV).expect("socket name from the parent");
    let stream =
        UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
            .unwrap();
    let mut buf = [0u8; 1];
    let (_, mut fds) = recv_with_fds(&stream, &mut buf, 1).unwrap();
    let seg = Arc::new(Segment::open(fds.remove(0), KIND, Access::ReadWrite, usize::MAX).unwrap());
    println!("child {}", pin(1));
    let parent = rustix::process::getppid();
    let mut spinner = Spinner {
        n: 0,
        alive: move || rustix::process::getppid() == parent,
    };
    let mut rings = Rings::attach(&seg, false);
    let (cmd, ack) = (word(&seg, layout::CMD), word(&seg, layout::ACK));
    let (ping, pong) = (word(&seg, layout::PING), word(&seg, layout::PONG));
    let mut last = 0;
    loop {
        // Command: sequence << 32 | variant << 24 | iterations.
        let c = loop {
            let c = cmd.load(Ordering::Acquire);
            if c != last {
                break c;
            }
            spinner.spin();
        };
        last = c;
        if c == STOP {
            return;
        }
        let variant = VARIANTS[((c >> 24) & 0xff) as usize];
        let iters = c & 0xff_ffff;
        ack.store(c, Ordering::Release);
        match variant {
            Variant::Bare => {
                for i in 1..=iters {
                    while ping.load(Ordering::Acquire) != i {
                        spinner.spin();
                    }
                    pong.store(i, Ordering::Release);
                }
            }
            Variant::TwoLine | Variant::TwoLinePrefetch => {
                let prefetch = variant == Variant::TwoLinePrefetch;
                for i in 1..=iters {
                    two_line_wait(
                        &seg,
                        i,
                        layout::DATA_AB,
                        layout::FLAG_AB,
                        prefetch,
                        &mut spinner,
                    );
                    two_line_send(&seg, i, layout::DATA_BA, layout::FLAG_BA);
                }
            }
            Variant::Ring16 => echo(&mut rings.r16, iters, &mut spinner),
            Variant::Ring64 => echo(&mut rings.r64, iters, &mut spinner),
            Variant::Ring128 => echo(&mut rings.r128, iters, &mut spinner),
            Variant::Ring256 => echo(&mut rings.r256, iters, &mut spinner),
            Variant::Lines64 => lines_echo(&mut rings.lines, iters, &mut spinner),
        }
    }
}

// ---- parent -----------------------------------------------------------------------------

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn parent(smoke: bool) {
    // Without `--bench` (`cargo test --benches`), a short smoke run checks that it works.
    let (default_rounds, default_iters) = if smoke { (1, 200) } else { (30, 20_000) };
    let rounds = env_u64("PINGPONG_ROUNDS", default_rounds);
    let iters = env_u64("PINGPONG_ITERS", default_iters).clamp(1, 0xff_ffff);
    let seg = Arc::new(
        Segment::builder(KIND, ring_offset(10))
            .name("shmhca-pingpong")
            .huge_pages(HugePages::Auto)
            .create()
            .unwrap(),
    );
    Rings::init(&seg);

    let socket = format!("shmhca-pingpong-{}", std::process::id());
    let listener =
        UnixListener::bind_addr(&SocketAddr::from_abstract_name(socket.as_bytes()).unwrap())
            .unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(ROLE_ENV, "child")
        .env(SOCKET_ENV, &socket)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (stream, _) = listener.accept().unwrap();
    send_with_fds(&stream, b"S", &[seg.as_fd()]).unwrap();
    let mut child_pin = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut child_pin)
        .unwrap();

    let parent_pin = pin(0);
    let ticks_per_ns = tsc_per_ns();
    println!(
        "pingpong: {rounds} rounds x {iters} round trips per variant, interleaved; {}; parent {parent_pin}, {}; TSC {ticks_per_ns:.3} GHz",
        seg.page_size(),
        child_pin.trim(),
    );

    let mut rings = Rings::attach(&seg, true);
    let (cmd, ack) = (word(&seg, layout::CMD), word(&seg, layout::ACK));
    let (ping, pong) = (word(&seg, layout::PING), word(&seg, layout::PONG));
    let child_pid = child.id();
    let mut spinner = Spinner {
        n: 0,
        alive: move || std::path::Path::new(&format!("/proc/{child_pid}")).exists(),
    };
    let new_hist = || Histogram::<u64>::new_with_bounds(1, 10_000_000, 3).unwrap();
    let mut hists: Vec<Histogram<u64>> = VARIANTS.iter().map(|_| new_hist()).collect();
    let mut seq = 0u64;
    for round in 0..=rounds {
        for variant in VARIANTS {
            seq += 1;
            let c = (seq << 32) | ((variant.index() as u64) << 24) | iters;
            cmd.store(c, Ordering::Release);
            while ack.load(Ordering::Acquire) != c {
                spinner.spin();
            }
            let mut warm_up = new_hist();
            let hist = if round == 0 {
                &mut warm_up
            } else {
                &mut hists[variant.index()]
            };
            let mut clock = Clock {
                hist,
                ticks_per_ns,
                last: 0,
            };
            match variant {
                Variant::Bare => {
                    clock.start();
                    for i in 1..=iters {
                        ping.store(i, Ordering::Release);
                        while pong.load(Ordering::Acquire) != i {
                            spinner.spin();
                        }
                        clock.lap();
                    }
                    // The child has stored its last pong; both words restart from 0.
                    ping.store(0, Ordering::Relaxed);
                    pong.store(0, Ordering::Relaxed);
                }
                Variant::TwoLine | Variant::TwoLinePrefetch => {
                    let prefetch = variant == Variant::TwoLinePrefetch;
                    clock.start();
                    for i in 1..=iters {
                        two_line_send(&seg, i, layout::DATA_AB, layout::FLAG_AB);
                        two_line_wait(
                            &seg,
                            i,
                            layout::DATA_BA,
                            layout::FLAG_BA,
                            prefetch,
                            &mut spinner,
                        );
                        clock.lap();
                    }
                    reset_two_line(&seg);
                }
                Variant::Ring16 => {
                    ring_round_trips(&mut rings.r16, iters, &mut clock, &mut spinner)
                }
                Variant::Ring64 => {
                    ring_round_trips(&mut rings.r64, iters, &mut clock, &mut spinner)
                }
                Variant::Ring128 => {
                    ring_round_trips(&mut rings.r128, iters, &mut clock, &mut spinner)
                }
                Variant::Ring256 => {
                    ring_round_trips(&mut rings.r256, iters, &mut clock, &mut spinner)
                }
                Variant::Lines64 => {
                    lines_round_trips(&mut rings.lines, iters, &mut clock, &mut spinner)
                }
            }
        }
    }
    cmd.store(STOP, Ordering::Release);
    drop(stream);
    let status = child.wait().unwrap();
    assert!(status.success(), "child failed: {status}");

    let bare = &hists[0];
    println!();
    println!(
        "{:<12} {:>7} {:>7} {:>7} {:>9} {:>7}   {:>8} {:>8} {:>8}",
        "one-way ns", "p50", "p99", "p99.9", "max", "mean", "p50/bare", "p99/bare", "p999/bare"
    );
    for (variant, h) in VARIANTS.iter().zip(&hists) {
        let ratio = |q: f64| h.value_at_quantile(q) as f64 / bare.value_at_quantile(q) as f64;
        println!(
            "{:<12} {:>7} {:>7} {:>7} {:>9} {:>7.1}   {:>8.2} {:>8.2} {:>8.2}",
            variant.name(),
            h.value_at_quantile(0.50),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            h.max(),
            h.mean(),
            ratio(0.50),
            ratio(0.99),
            ratio(0.999),
        );
    }
}

fn main() {
    if std::env::var(ROLE_ENV).as_deref() == Ok("child") {
        child();
    } else if std::env::args().any(|a| a == "--list") {
        // `cargo bench -- --list`: nothing to list.
    } else {
        parent(!std::env::args().any(|a| a == "--bench"));
    }
}
