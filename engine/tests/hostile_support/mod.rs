//! The pieces of the hostile-peer suite (`hostile_peer.rs`): a victim server, a
//! well-behaved client of it, and a fake peer that speaks the connection manager honestly
//! and then attacks.
//!
//! Everything that speaks the CM lives here, in one module, written against the public
//! message API of [`shmhca::cm::msg`] only: when the CM's protocol changes (new messages,
//! a version bump), this module is the one to adapt.
//!
//! * [`Victim`]: a server in this process. Its serving thread drives the engine (inline
//!   mode) and echoes, byte-checked, the messages of well-behaved clients; an acceptor
//!   thread accepts connections. Any panic of the engine lands in one of those threads and
//!   fails the test when [`Victim::stop`] joins them; an abort fails it anyway. The victim
//!   owns regions a peer must never write (and one in another protection domain it must
//!   never read) and checks, when stopped, that their bytes are intact.
//! * [`GoodClient`]: a well-behaved client in its own thread and context, exchanging
//!   verified messages with the victim until stopped; any error panics its thread.
//! * [`FakePeer`]: the hostile peer: a raw Unix socket, segments it makes itself, and the
//!   two rings of the link driven by hand.
#![allow(dead_code, missing_docs, unreachable_pub)]

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use shmhca::cm::msg::{
    ArenaLayout, HEADER_LEN, Header, Hello, LinkMode, Message, Offer, Rej, Rep, Req,
};
use shmhca::psn::Psn;
use shmhca::wire::slot::PacketSlot;
use shmhca::wire::{BthRepr, Opcode, PacketRepr};
use shmhca::*;
use shmhca_rings::fdpass::{recv_with_fds, send_with_fds};
use shmhca_rings::lines::{
    Line, LinesConsumer, LinesProducer, MAX_FRAME_LINES, ReserveError, ShmLines, init_shm_lines,
    shm_lines_bytes, shm_lines_consumer, shm_lines_producer,
};
use shmhca_rings::segment::Segment;

/// How long any wait may take before it is a failure: generous, nothing here measures speed.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Segment kinds and the link header magic, as `link.rs` and `arena.rs` write them.
pub const LINK_KIND: u32 = 0x4b4e_494c;
pub const ARENA_KIND: u32 = 0x4152_4e41;
pub const PAGE_KIND: u32 = 0x4547_4150;
pub const LINK_MAGIC: u64 = u64::from_le_bytes(*b"SHLINK\0\x03");
/// Lines per direction of the links the fake peer makes.
pub const LINK_SLOTS: usize = 64;

/// The private data a well-behaved client sends, so the victim knows whose messages to
/// check.
pub const GOOD: &[u8] = b"well-behaved client";
/// Bytes of the victim's regions.
pub const REGION: u64 = 64 << 10;
/// Receive buffers of the victim.
const RECV_BUF: u32 = 16 << 10;
const RECVS: u64 = 16;

/// All tests of the suite run one at a time: they share two cores.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Panics anywhere in this process so far (every thread: the engine also runs in the
/// connection manager's watcher thread, whose panics nobody would join). Counting starts
/// at the first call.
pub fn panics_so_far() -> usize {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            COUNT.fetch_add(1, Ordering::SeqCst);
            previous(info);
        }));
    });
    COUNT.load(Ordering::SeqCst) as usize
}

/// A deterministic byte pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// A small deterministic generator (xorshift), so every run attacks with the same bytes.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// This process's resident memory in bytes (`VmRSS`).
pub fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

// ------------------------------------------------------------------------------------
// The victim
// ------------------------------------------------------------------------------------

/// What the victim's regions hold, so that a test can look for them.
pub const PUBLIC_MARK: &[u8] = b"PUBLIC-REGION-granted-to-peers-of-this-pd-0123456789";
pub const SECRET_MARK: &[u8] = b"SECRET-REGION-of-another-pd-never-granted-9876543210";

/// What the victim saw, returned by [`Victim::stop`].
#[derive(Debug, Default)]
pub struct Report {
    /// Messages of well-behaved clients received, checked and echoed.
    pub good_messages: u64,
    /// Completions of other peers' connections (any status).
    pub other_completions: u64,
    /// Connections accepted.
    pub accepted: u64,
    /// Handshakes that failed, with the error the server got.
    pub refused: Vec<String>,
}

pub struct Victim {
    pub path: PathBuf,
    dir: PathBuf,
    stop: Arc<AtomicBool>,
    serving: Option<JoinHandle<Report>>,
    refused: Arc<Mutex<Vec<String>>>,
    accepted: Arc<AtomicU64>,
    good: Arc<AtomicU64>,
    /// Where the public region is (sent to every peer in the REP's private data too).
    pub public: RemoteAddr,
    /// Where the region of the other protection domain is (a key a peer could guess).
    pub secret: RemoteAddr,
}

/// Local Ack Timeout of the victim's and the well-behaved client's QPs: 4.096 µs × 2^20,
/// about 4 s per try. The attacks are not about timers; on two shared cores a thread can
/// be off the CPU for longer than the default's half-second retry budget, and a
/// well-behaved connection must not fail for that.
pub const PATIENT_ACK_TIMEOUT: u8 = 20;

/// The victim's connection parameters.
pub fn victim_params(private: Vec<u8>) -> ConnectParams {
    ConnectParams::default()
        .handshake_timeout(Duration::from_secs(1))
        .local_ack_timeout(PATIENT_ACK_TIMEOUT)
        .private_data(private)
        .caps(QpCaps {
            max_send_wr: 64,
            max_recv_wr: 64,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        })
}

impl Victim {
    /// Starts a victim listening at a fresh path, with `params` for every connection
    /// (private data is replaced by the two remote addresses).
    pub fn start(tag: &str) -> Victim {
        Victim::start_with(tag, |p| p)
    }

    pub fn start_with(
        tag: &str,
        tune: impl FnOnce(ConnectParams) -> ConnectParams + Send + 'static,
    ) -> Victim {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "shmhca-hostile-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("victim.sock");
        let stop = Arc::new(AtomicBool::new(false));
        let refused = Arc::new(Mutex::new(Vec::new()));
        let accepted = Arc::new(AtomicU64::new(0));
        let good = Arc::new(AtomicU64::new(0));
        let (ready_tx, ready_rx) = mpsc::channel();
        let serving = {
            let (path, stop, refused, accepted, good) = (
                path.clone(),
                stop.clone(),
                refused.clone(),
                accepted.clone(),
                good.clone(),
            );
            std::thread::spawn(move || {
                serve(&path, tune, &stop, &refused, &accepted, &good, ready_tx)
            })
        };
        let (public, secret) = ready_rx.recv_timeout(DEADLINE).expect("the victim starts");
        Victim {
            path,
            dir,
            stop,
            serving: Some(serving),
            refused,
            accepted,
            good,
            public,
            secret,
        }
    }

    /// Messages of well-behaved clients checked so far.
    pub fn good_messages(&self) -> u64 {
        self.good.load(Ordering::Relaxed)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Waits until the server refused `n` handshakes in all; returns their errors.
    pub fn wait_refused(&self, n: usize) -> Vec<String> {
        eventually(&format!("{n} refused handshakes"), || {
            self.refused.lock().unwrap().len() >= n
        });
        self.refused.lock().unwrap().clone()
    }

    /// Stops the victim and returns its report; panics if a thread of the server panicked
    /// (the engine runs in them) or a region a peer must not write changed.
    pub fn stop(mut self) -> Report {
        self.stop.store(true, Ordering::Relaxed);
        let report = match self.serving.take().expect("running").join() {
            Ok(r) => r,
            Err(e) => std::panic::resume_unwind(e),
        };
        let _ = std::fs::remove_dir_all(&self.dir);
        report
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.serving.take() {
            let _ = h.join();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A connection the victim serves.
struct Served {
    conn: Connection,
    scq: Cq,
    rcq: Cq,
    rbuf: Mr,
    sbuf: Mr,
    good: bool,
    sends_out: u32,
}

fn serve(
    path: &Path,
    tune: impl FnOnce(ConnectParams) -> ConnectParams + Send,
    stop: &AtomicBool,
    refused: &Mutex<Vec<String>>,
    accepted: &AtomicU64,
    good_count: &AtomicU64,
    ready: mpsc::Sender<(RemoteAddr, RemoteAddr)>,
) -> Report {
    let ctx = Context::builder()
        .arena_size(16 << 20)
        .huge_pages(shmhca_rings::HugePages::Never)
        .mode(EngineMode::Inline)
        .build()
        .expect("victim context");
    let pd = ctx.alloc_pd().unwrap();
    let other_pd = ctx.alloc_pd().unwrap();
    let fill = |mr: &Mr, mark: &[u8], seed: u8| {
        let mut b = pattern(REGION as usize, seed);
        b[..mark.len()].copy_from_slice(mark);
        mr.write_at(0, &b).unwrap();
        b
    };
    // Readable by peers of `pd` (so its bytes are in what they are granted), never
    // writable; a region no peer may touch at all; and the other PD's region.
    let public = pd.alloc_mr(REGION, AccessFlags::REMOTE_READ).unwrap();
    let public_bytes = fill(&public, PUBLIC_MARK, 1);
    let local = pd.alloc_mr(REGION, AccessFlags::LOCAL_WRITE).unwrap();
    let local_bytes = fill(&local, b"LOCAL", 2);
    let secret = other_pd.alloc_mr(REGION, AccessFlags::ALL).unwrap();
    let secret_bytes = fill(&secret, SECRET_MARK, 3);
    let mut private = public.remote(0).to_bytes().to_vec();
    private.extend_from_slice(&secret.remote(0).to_bytes());
    let params = tune(victim_params(private));
    let listener = ctx.listen(path).expect("victim listens");
    ready
        .send((public.remote(0), secret.remote(0)))
        .expect("test waiting");

    let mut served: Vec<Served> = Vec::new();
    let mut report = Report::default();
    std::thread::scope(|scope| {
        let (conn_tx, conn_rx) = mpsc::channel::<(Connection, Cq, Cq)>();
        let (ctx, pd, listener, params) = (&ctx, &pd, &listener, &params);
        // Accepting runs in its own thread: a handshake that stalls holds up this thread
        // only, never the engine's progress.
        //
        // A client's QP completes on the CQs of the accept call that received its REQ,
        // which under load is not always the call that returns its connection. So a pair
        // of CQs is kept from call to call until a connection is returned with it, and the
        // main loop finds each completion's connection by QP number, whatever CQ it came on.
        let acceptor = scope.spawn(move || {
            let mut pair: Option<(Cq, Cq)> = None;
            while !stop.load(Ordering::Relaxed) {
                let (scq, rcq) = pair
                    .take()
                    .unwrap_or_else(|| (ctx.create_cq(256).unwrap(), ctx.create_cq(256).unwrap()));
                match listener.accept_timeout(Duration::from_millis(20), pd, &scq, &rcq, params) {
                    Ok(c) => {
                        accepted.fetch_add(1, Ordering::Relaxed);
                        if conn_tx.send((c, scq, rcq)).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        pair = Some((scq, rcq));
                        let e = e.to_string();
                        if !e.contains("no client connected in time") {
                            refused.lock().unwrap().push(e);
                        }
                    }
                }
            }
        });
        let mut wc = [WorkCompletion::default(); 32];
        while !stop.load(Ordering::Relaxed) {
            while let Ok((conn, scq, rcq)) = conn_rx.try_recv() {
                let good = conn.peer_private_data() == GOOD;
                let mut s = Served {
                    rbuf: pd
                        .alloc_mr(u64::from(RECV_BUF) * RECVS, AccessFlags::LOCAL_WRITE)
                        .unwrap(),
                    sbuf: pd
                        .alloc_mr(u64::from(RECV_BUF) * RECVS, AccessFlags::NONE)
                        .unwrap(),
                    conn,
                    scq,
                    rcq,
                    good,
                    sends_out: 0,
                };
                for i in 0..RECVS {
                    post_recv(&mut s, i);
                }
                served.push(s);
            }
            let mut idle = true;
            for i in 0..served.len() {
                let n = served[i].scq.poll(&mut wc);
                for c in &wc[..n] {
                    idle = false;
                    let Some(s) = served.iter_mut().find(|s| s.conn.qpn() == c.qp_num) else {
                        report.other_completions += 1;
                        continue;
                    };
                    s.sends_out -= 1;
                    if s.good && !left(s, c) {
                        assert!(c.is_ok(), "the victim's echo failed: {c:?}");
                    } else {
                        report.other_completions += 1;
                    }
                }
                let n = served[i].rcq.poll(&mut wc);
                for c in &wc[..n] {
                    idle = false;
                    let Some(s) = served.iter_mut().find(|s| s.conn.qpn() == c.qp_num) else {
                        report.other_completions += 1;
                        continue;
                    };
                    if !s.good || left(s, c) {
                        report.other_completions += 1;
                        if c.is_ok() {
                            post_recv(s, c.wr_id);
                        }
                        continue;
                    }
                    assert!(c.is_ok(), "a well-behaved client's message failed: {c:?}");
                    let slot = c.wr_id;
                    let mut msg = vec![0u8; c.byte_len as usize];
                    s.rbuf
                        .read_at(slot * u64::from(RECV_BUF), &mut msg)
                        .unwrap();
                    check_message(&msg);
                    // Echo it from the same slot of the send buffer.
                    s.sbuf.write_at(slot * u64::from(RECV_BUF), &msg).unwrap();
                    let sge = [s.sbuf.sge(slot * u64::from(RECV_BUF), c.byte_len).unwrap()];
                    s.conn
                        .post_send(&SendWr::new(slot, SendOp::Send, &sge))
                        .expect("the victim echoes");
                    s.sends_out += 1;
                    post_recv(s, slot);
                    report.good_messages += 1;
                    good_count.fetch_add(1, Ordering::Relaxed);
                }
            }
            if idle {
                ctx.progress();
                std::thread::yield_now();
            }
        }
        acceptor.join().expect("the acceptor thread");
    });
    report.accepted = accepted.load(Ordering::Relaxed);
    report.refused = refused.lock().unwrap().clone();
    // The regions no peer may write are as they were.
    for (mr, want, what) in [
        (&public, &public_bytes, "the REMOTE_READ-only region"),
        (&local, &local_bytes, "the LOCAL_WRITE-only region"),
        (
            &secret,
            &secret_bytes,
            "the other protection domain's region",
        ),
    ] {
        let mut now = vec![0u8; REGION as usize];
        mr.read_at(0, &mut now).unwrap();
        assert!(now == *want, "a peer changed {what}");
    }
    drop(served);
    report
}

/// Whether `c` is a flush because the well-behaved client closed its connection (when a
/// test stops it): the only error a well-behaved connection may see.
fn left(s: &Served, c: &WorkCompletion) -> bool {
    c.status == WcStatus::WrFlushErr && !s.conn.is_peer_connected()
}

fn post_recv(s: &mut Served, slot: u64) {
    let sge = [s.rbuf.sge(slot * u64::from(RECV_BUF), RECV_BUF).unwrap()];
    // A connection broken by its peer refuses posts; that is its peer's loss only.
    let r = s.conn.post_recv(&RecvWr::new(slot, &sge));
    if s.good && s.conn.is_peer_connected() {
        r.expect("posting a receive for a well-behaved client");
    }
}

/// A message of a well-behaved client: its sequence number, then a pattern seeded by it.
pub fn message(seq: u64, len: usize) -> Vec<u8> {
    let len = len.max(8);
    let mut m = seq.to_le_bytes().to_vec();
    m.extend_from_slice(&pattern(len - 8, seq as u8));
    m
}

/// Panics unless `m` is a message [`message`] made.
pub fn check_message(m: &[u8]) {
    assert!(m.len() >= 8, "a message of {} bytes", m.len());
    let seq = u64::from_le_bytes(m[..8].try_into().unwrap());
    assert!(
        m == message(seq, m.len()).as_slice(),
        "message {seq} ({} bytes) arrived corrupted",
        m.len()
    );
}

// ------------------------------------------------------------------------------------
// The well-behaved client
// ------------------------------------------------------------------------------------

pub struct GoodClient {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    handle: Option<JoinHandle<u64>>,
}

/// Message sizes the client cycles through: inline, one reference, a gather list of two
/// ranges, several packets.
const SIZES: [usize; 6] = [8, 60, 700, 3000, 4100, 9000];

impl GoodClient {
    /// Connects to `victim` and starts exchanging messages.
    pub fn start(victim: &Victim) -> GoodClient {
        let path = victim.path.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let handle = {
            let (stop, done) = (stop.clone(), done.clone());
            std::thread::spawn(move || run_good_client(&path, &stop, &done))
        };
        let c = GoodClient {
            stop,
            done,
            handle: Some(handle),
        };
        c.wait_for(5);
        c
    }

    /// Messages verified (sent, echoed back intact).
    pub fn verified(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Waits until `more` further messages were verified.
    pub fn wait_for(&self, more: u64) {
        let target = self.verified() + more;
        let start = Instant::now();
        while self.verified() < target {
            if self.handle.as_ref().is_some_and(|h| h.is_finished()) {
                // Its panic message shows when it is joined.
                return;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "the well-behaved client verified only {} messages, wanted {target}",
                self.verified()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Stops the client; panics with its error if it failed.
    pub fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        match self.handle.take().expect("running").join() {
            Ok(n) => n,
            Err(e) => std::panic::resume_unwind(e),
        }
    }
}

impl Drop for GoodClient {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn run_good_client(path: &Path, stop: &AtomicBool, done: &AtomicU64) -> u64 {
    let ctx = Context::builder()
        .arena_size(8 << 20)
        .huge_pages(shmhca_rings::HugePages::Never)
        .mode(EngineMode::Inline)
        .build()
        .expect("client context");
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(64).unwrap();
    let params = ConnectParams::default()
        .local_ack_timeout(PATIENT_ACK_TIMEOUT)
        .private_data(GOOD.to_vec())
        .caps(QpCaps {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 2,
            max_recv_sge: 1,
            max_inline_data: 64,
        });
    let mut conn = ctx
        .connect(path, &pd, &cq, &cq, &params)
        .expect("the well-behaved client connects");
    let sbuf = pd.alloc_mr(64 << 10, AccessFlags::NONE).unwrap();
    let rbuf = pd.alloc_mr(16 << 10, AccessFlags::LOCAL_WRITE).unwrap();
    let mut seq = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let len = SIZES[(seq % SIZES.len() as u64) as usize];
        let m = message(seq, len);
        // Two gather ranges 20 KiB apart, so larger messages travel as gather lists.
        let head = len / 3;
        sbuf.write_at(0, &m[..head]).unwrap();
        sbuf.write_at(20 << 10, &m[head..]).unwrap();
        let mut sgl = Vec::new();
        if head > 0 {
            sgl.push(sbuf.sge(0, head as u32).unwrap());
        }
        sgl.push(sbuf.sge(20 << 10, (len - head) as u32).unwrap());
        let rsge = [rbuf.sge(0, 16 << 10).unwrap()];
        conn.post_recv(&RecvWr::new(seq, &rsge)).unwrap();
        conn.post_send(&SendWr::new(seq, SendOp::Send, &sgl))
            .unwrap();
        let mut got = [WorkCompletion::default(); 2];
        let mut n = 0;
        let start = Instant::now();
        while n < 2 {
            n += cq.poll(&mut got[n..]);
            assert!(
                start.elapsed() < DEADLINE,
                "message {seq}: only {n} of 2 completions: {:?}",
                &got[..n]
            );
        }
        for c in &got {
            assert!(c.is_ok(), "message {seq}: {c:?}");
        }
        let recv = got
            .iter()
            .find(|c| c.opcode == WcOpcode::Recv)
            .expect("echo");
        let mut back = vec![0u8; recv.byte_len as usize];
        rbuf.read_at(0, &mut back).unwrap();
        assert!(back == m, "message {seq} came back changed");
        seq += 1;
        done.store(seq, Ordering::Relaxed);
    }
    drop(conn);
    seq
}

/// Repeats `check` until it holds; panics with `what` after [`DEADLINE`].
pub fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < DEADLINE, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

// ------------------------------------------------------------------------------------
// The CM, spoken by hand
// ------------------------------------------------------------------------------------

/// Sends `m` with `fds` attached.
pub fn send_msg(s: &UnixStream, m: &Message, fds: &[BorrowedFd<'_>]) {
    send_with_fds(s, &m.encode(), fds).expect("sending a CM message");
}

/// Reads one message and the descriptors that came with it.
pub fn recv_msg(s: &UnixStream) -> std::io::Result<(Message, Vec<OwnedFd>)> {
    s.set_read_timeout(Some(DEADLINE))?;
    let mut h = [0u8; HEADER_LEN];
    let mut fds = Vec::new();
    let mut got = 0;
    while got < HEADER_LEN {
        let (n, more) = recv_with_fds(s, &mut h[got..], 8)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        fds.extend(more);
        got += n;
    }
    let h = Header::parse(&h).map_err(std::io::Error::other)?;
    let mut body = vec![0u8; h.body_len as usize];
    (&*s).read_exact(&mut body)?;
    let m = Message::decode(h.msg_type, &body).map_err(std::io::Error::other)?;
    Ok((m, fds))
}

/// A plausible offer from QP `qpn`.
pub fn offer(qpn: u32) -> Offer {
    Offer {
        qpn,
        start_psn: 77,
        pmtu: 4096,
        local_ack_timeout: 14,
        target_ack_delay: 0,
        retry_count: 7,
        rnr_retry_count: 7,
        min_rnr_timer: 12,
        credits: 1,
        responder_resources: 4,
        initiator_depth: 4,
        max_send_wr: 128,
        max_recv_wr: 128,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    }
}

/// A REQ for a new link from QP `qpn`.
pub fn new_link_req(qpn: u32) -> Req {
    Req {
        identity: 0x0bad_0000_0000_0000 | u64::from(qpn),
        trace_id: 7,
        link_mode: LinkMode::New,
        arena_layout: ArenaLayout::Segment,
        link_token: 0x7001,
        offer: offer(qpn),
        private_data: Vec::new(),
    }
}

/// Connects, reads the HELLO and sends `req` with `fds`; returns the socket and the
/// server's answer: the REP with its descriptors, or the REJ.
pub fn request(
    path: &Path,
    req: &Req,
    fds: &[BorrowedFd<'_>],
) -> (UnixStream, std::result::Result<(Rep, Vec<OwnedFd>), Rej>) {
    let s = UnixStream::connect(path).expect("connecting to the victim");
    match recv_msg(&s).expect("HELLO") {
        (Message::Hello(Hello { .. }), _) => {}
        (m, _) => panic!("expected HELLO, got {m:?}"),
    }
    send_msg(&s, &Message::Req(req.clone()), fds);
    let answer = match recv_msg(&s).expect("the victim answers the REQ") {
        (Message::Rep(r), fds) => Ok((r, fds)),
        (Message::Rej(r), _) => Err(r),
        (m, _) => panic!("expected REP or REJ, got {m:?}"),
    };
    (s, answer)
}

// ------------------------------------------------------------------------------------
// Segments the fake peer makes
// ------------------------------------------------------------------------------------

/// Bytes of one ring of `slots` lines, rounded up to pages.
pub fn ring_stride(slots: usize) -> usize {
    shm_lines_bytes(slots).unwrap().div_ceil(4096) * 4096
}

/// A link segment laid out as shmhca lays it out, its rings at `offs` (data offsets).
pub fn link_segment_at(slots: usize, offs: [u64; 2]) -> Arc<Segment> {
    let len = 4096 + 2 * ring_stride(slots);
    let seg = Segment::builder(LINK_KIND, len)
        .huge_pages(shmhca_rings::HugePages::Never)
        .create()
        .unwrap();
    for off in offs {
        init_shm_lines(&seg, off as usize, slots).unwrap();
    }
    let mut hdr = LINK_MAGIC.to_le_bytes().to_vec();
    hdr.extend_from_slice(&offs[0].to_le_bytes());
    hdr.extend_from_slice(&offs[1].to_le_bytes());
    seg.write_at(0, &hdr).unwrap();
    Arc::new(seg)
}

/// The ring offsets of an honest link of `slots` lines.
pub fn honest_ring_offsets(slots: usize) -> [u64; 2] {
    [4096, (4096 + ring_stride(slots)) as u64]
}

/// An engine page (all zero: this peer never sleeps).
pub fn page_segment() -> Segment {
    Segment::builder(PAGE_KIND, 4096)
        .huge_pages(shmhca_rings::HugePages::Never)
        .create()
        .unwrap()
}

/// An arena of `len` bytes, writable by the fake peer, pages committed only if touched.
pub fn arena_segment(len: usize) -> Segment {
    Segment::builder(ARENA_KIND, len)
        .huge_pages(shmhca_rings::HugePages::Never)
        .populate(false)
        .create()
        .unwrap()
}

// ------------------------------------------------------------------------------------
// The fake peer
// ------------------------------------------------------------------------------------

pub struct FakePeer {
    pub stream: UnixStream,
    pub link: Arc<Segment>,
    pub ring_off: [u64; 2],
    pub page: Segment,
    pub arena: Segment,
    pub rep: Rep,
    /// What the REP carried: the victim's engine page and arena.
    pub received: Vec<OwnedFd>,
    /// Our sending end (ring 0: the victim receives it).
    pub tx: LinesProducer<ShmLines>,
    /// Our receiving end (ring 1), kept drained so the victim never waits for room.
    pub rx: LinesConsumer<ShmLines>,
    pub qpn: u32,
    /// The next PSN the victim's RQ Logic expects from us.
    pub psn: u32,
    /// Slots the victim sent us so far.
    pub answers: usize,
}

/// The fake peer's QP number.
pub const FAKE_QPN: u32 = 0x1002;

impl FakePeer {
    /// Completes REQ/REP/RTU honestly for a new link.
    pub fn connect(path: &Path) -> FakePeer {
        let fake = FakePeer::connect_before_rtu(path);
        send_msg(&fake.stream, &Message::Rtu, &[]);
        fake
    }

    /// Completes REQ/REP for a new link; the RTU is the caller's to send (or not).
    pub fn connect_before_rtu(path: &Path) -> FakePeer {
        let ring_off = honest_ring_offsets(LINK_SLOTS);
        let link = link_segment_at(LINK_SLOTS, ring_off);
        let page = page_segment();
        let arena = arena_segment(1 << 20);
        let req = new_link_req(FAKE_QPN);
        let (stream, answer) = request(path, &req, &[link.as_fd(), page.as_fd(), arena.as_fd()]);
        let (rep, received) = answer.unwrap_or_else(|r| panic!("the victim refused: {r:?}"));
        assert_eq!(received.len(), 2, "a new link's REP carries page and arena");
        let tx = shm_lines_producer(link.clone(), ring_off[0] as usize).unwrap();
        let rx = shm_lines_consumer(link.clone(), ring_off[1] as usize).unwrap();
        FakePeer {
            stream,
            link,
            ring_off,
            page,
            arena,
            rep,
            received,
            tx,
            rx,
            qpn: FAKE_QPN,
            psn: req.offer.start_psn,
            answers: 0,
        }
    }

    /// The victim's QP.
    pub fn victim_qpn(&self) -> Qpn {
        Qpn::new(self.rep.offer.qpn)
    }

    /// The two remote addresses the victim put in its REP: its public region and the
    /// other protection domain's region.
    pub fn victim_regions(&self) -> (RemoteAddr, RemoteAddr) {
        let p = &self.rep.private_data;
        (
            RemoteAddr::from_bytes(p[..12].try_into().unwrap()),
            RemoteAddr::from_bytes(p[12..24].try_into().unwrap()),
        )
    }

    /// Headers of a packet to the victim's QP.
    pub fn packet(&self, op: Opcode, psn: u32) -> PacketRepr {
        PacketRepr::new(BthRepr::new(op, self.victim_qpn(), Psn::new(psn)))
    }

    /// Publishes `slots` as one burst, all at once, each packet as one frame: its slot and
    /// the continuation lines its gather count calls for, as far as `slots` has them (a
    /// packet cut short goes as a shorter frame). Drains what the victim sent meanwhile.
    /// Returns how many slots were published: all, or 0 if the victim stopped reading this
    /// link; None once the ring is broken.
    pub fn send(&mut self, slots: &[PacketSlot]) -> Option<usize> {
        let mut frames = Vec::new();
        let mut at = 0;
        while at < slots.len() {
            let end = (at + shmhca::wire::slot::frame_lines(&slots[at])).min(slots.len());
            frames.push(&slots[at..end]);
            at = end;
        }
        self.send_frames(&frames)
    }

    /// Publishes `frames` (each 1 to 16 lines of whatever bytes) as one burst, all at once,
    /// draining what the victim sent meanwhile. Returns how many lines were published (not
    /// counting padding): all, or 0 if the victim stopped reading this link; None once the
    /// ring is broken.
    pub fn send_frames(&mut self, frames: &[&[PacketSlot]]) -> Option<usize> {
        let lines: usize = frames.iter().map(|f| f.len()).sum();
        let start = Instant::now();
        loop {
            self.drain();
            // A burst that wraps around the ring's end gives up to a frame's lines to
            // padding.
            match self.tx.free_lines() {
                Ok(free) if free >= lines + MAX_FRAME_LINES - 1 => break,
                // Generous: a victim that keeps reading frees room in microseconds.
                Ok(_) if start.elapsed() > Duration::from_secs(20) => return Some(0),
                Ok(_) => std::thread::sleep(Duration::from_millis(1)),
                Err(_) => return None,
            }
        }
        for f in frames {
            match self.tx.reserve(f.len()) {
                Ok(Some(mut frame)) => {
                    frame
                        .write_lines(bytemuck::cast_slice::<PacketSlot, Line>(f))
                        .unwrap();
                    frame.commit();
                }
                Ok(None) => panic!("room was checked"),
                Err(ReserveError::Broken(_)) => return None,
                Err(e) => panic!("{e}"),
            }
        }
        Some(lines)
    }

    /// Takes whatever the victim sent; returns the lines (each packet's slot, then its
    /// continuation lines).
    pub fn drain(&mut self) -> Vec<PacketSlot> {
        let mut out = Vec::new();
        let mut buf = [Line::ZERO; MAX_FRAME_LINES];
        while let Ok(Some(n)) = self.rx.recv(&mut buf) {
            out.extend_from_slice(bytemuck::cast_slice::<Line, PacketSlot>(&buf[..n]));
        }
        self.answers += out.len();
        out
    }

    /// Collects what the victim sends for `d`.
    pub fn collect_for(&mut self, d: Duration) -> Vec<PacketSlot> {
        let start = Instant::now();
        let mut out = Vec::new();
        while start.elapsed() < d {
            out.extend(self.drain());
            std::thread::sleep(Duration::from_millis(1));
        }
        out
    }
}

/// A slot holding `repr`'s headers, and `kind`/`len`/`off` as given (no payload bytes).
pub fn slot(repr: &PacketRepr, kind: u8, len: u32, off: u64) -> PacketSlot {
    let mut s = PacketSlot::default();
    s.hdr_len = repr.emit(&mut s.data).expect("headers fit a slot") as u8;
    s.kind = kind;
    s.payload_len = len;
    s.payload_off = off;
    s
}

/// Writes a gather entry `i` (offset, length) into continuation lines.
pub fn set_gather_entry(cont: &mut [PacketSlot], i: usize, off: u64, len: u32) {
    use shmhca::wire::slot::{GATHER_ENTRY_LEN, GATHER_PER_SLOT, GATHER_START};
    let b = bytemuck::bytes_of_mut(&mut cont[i / GATHER_PER_SLOT]);
    let at = GATHER_START + (i % GATHER_PER_SLOT) * GATHER_ENTRY_LEN;
    b[at..at + 8].copy_from_slice(&off.to_le_bytes());
    b[at + 8..at + 12].copy_from_slice(&len.to_le_bytes());
}

/// A writer of raw bytes over a whole socket (for half messages).
pub fn write_raw(s: &mut UnixStream, b: &[u8]) {
    s.write_all(b).expect("writing to the victim");
}

// ------------------------------------------------------------------------------------
// A lying server
// ------------------------------------------------------------------------------------

/// Serves one client at `path` in a thread: HELLO, reads the REQ, answers with a REP
/// carrying `fds` (honest fields otherwise), then waits for the client to hang up.
pub fn lying_server(path: &Path, fds: Vec<OwnedFd>) -> JoinHandle<()> {
    let l = std::os::unix::net::UnixListener::bind(path).expect("binding the fake server");
    std::thread::spawn(move || {
        let (s, _) = l.accept().expect("a client");
        send_msg(
            &s,
            &Message::Hello(Hello {
                identity: 0x0bad_5e4e,
                trace_id: 9,
            }),
            &[],
        );
        let req = match recv_msg(&s).expect("the client's REQ") {
            (Message::Req(r), _) => r,
            (m, _) => panic!("expected a REQ, got {m:?}"),
        };
        let rep = Message::Rep(Rep {
            link_token: req.link_token,
            arena_layout: ArenaLayout::Segment,
            offer: offer(FAKE_QPN),
            private_data: Vec::new(),
        });
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        send_msg(&s, &rep, &borrowed);
        // The client refuses (REJ) or hangs up; either ends this.
        let _ = recv_msg(&s);
    })
}
