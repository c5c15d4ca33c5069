//! The soak: a long run of mixed operations between two engines, under injected faults,
//! that checks every byte and every completion.
//!
//! Both ends derive the same message sequence from the seed: message `i` of QP `k` has an
//! operation (Send, Send with Immediate, RDMA Write, RDMA Write with Immediate, RDMA Read,
//! Compare and Swap, Fetch and Add), a size (0 to [`MAX_SIZE`] bytes) and a payload taken
//! from a shared pseudo-random pattern. Each QP has its own PMTU (256 to 4096).
//!
//! * The [`Requester`] posts them, at most [`WINDOW`] in flight per QP, and checks that
//!   every work request completes with Success, in the order posted; that every RDMA Read
//!   returns exactly what the Writes before it left in the peer's memory (a model of it is
//!   kept here); that every atomic returns the exact original value (each QP owns one
//!   word, so the values are predictable) and that each word's final value is exact.
//! * The [`Responder`] keeps receive buffers posted and checks that every message that
//!   consumes one (Send, Send with Immediate, Write with Immediate) arrives exactly once
//!   and in order: the expected operation, length, immediate data and bytes.
//!
//! A lost, duplicated, reordered or corrupted packet that RC failed to recover shows up as
//! a wrong byte, a missing, extra or out-of-order completion, an error status or a wrong
//! atomic value; each fails the run with a message naming the QP, the message and the
//! offset.

use std::time::{Duration, Instant};

use shmhca::fault::{FaultConfig, FaultStats};
use shmhca::{
    AccessFlags, Context, Cq, Mr, Mtu, Pd, Qp, RecvWr, RemoteAddr, SendOp, SendWr, Stats, WcOpcode,
    WcStatus, WorkCompletion,
};

/// A QP the soak drives: one of this process ([`LocalQp`]) or a CM connection
/// (`Box<Connection>`).
pub type QpBox = Box<dyn std::ops::DerefMut<Target = Qp>>;

/// A QP connected by hand (no CM connection), as a [`QpBox`].
pub struct LocalQp(pub Qp);

impl std::ops::Deref for LocalQp {
    type Target = Qp;
    fn deref(&self) -> &Qp {
        &self.0
    }
}

impl std::ops::DerefMut for LocalQp {
    fn deref_mut(&mut self) -> &mut Qp {
        &mut self.0
    }
}

/// The largest message.
pub const MAX_SIZE: u32 = 64 << 10;
/// Work requests in flight per QP.
pub const WINDOW: usize = 16;
/// Receive buffers posted per QP.
pub const RECVS: usize = 32;
/// Slots of the responder's write region, per QP (Writes and Reads go to slot `i % SLOTS`).
pub const SLOTS: usize = 4;
/// The PMTUs the QPs cycle through.
pub const MTUS: [Mtu; 5] = [
    Mtu::Mtu256,
    Mtu::Mtu512,
    Mtu::Mtu1024,
    Mtu::Mtu2048,
    Mtu::Mtu4096,
];
/// Bytes of the shared pattern payloads are cut from.
const PATTERN_LEN: usize = 1 << 20;

/// Bytes of the responder's memory region per QP: the write slots, then the atomic word.
pub const REGION_PER_QP: u64 = SLOTS as u64 * MAX_SIZE as u64 + 64;

/// The PMTU of QP `k`.
pub fn mtu_of(k: usize) -> Mtu {
    MTUS[k % MTUS.len()]
}

/// What a soak does.
#[derive(Debug, Clone, Copy)]
pub struct SoakConfig {
    /// Messages in all (spread over the QPs).
    pub messages: u64,
    /// Queue pairs.
    pub qps: usize,
    /// Seed of the message sequence.
    pub seed: u64,
    /// Largest message (at most [`MAX_SIZE`]).
    pub max_size: u32,
    /// Faults each end injects (each end gets its own seed derived from this one).
    pub faults: FaultConfig,
    /// Local Ack Timeout of the QPs, in one process or two (see
    /// [`TWO_PROCESS_ACK_TIMEOUT`]).
    pub ack_timeout: u8,
}

impl Default for SoakConfig {
    fn default() -> SoakConfig {
        SoakConfig {
            messages: 100_000,
            qps: 4,
            seed: 1,
            max_size: MAX_SIZE,
            faults: FaultConfig::default(),
            ack_timeout: TWO_PROCESS_ACK_TIMEOUT,
        }
    }
}

impl SoakConfig {
    /// Messages of QP `k`.
    pub fn messages_of(&self, k: usize) -> u64 {
        let q = self.qps as u64;
        self.messages / q + u64::from((k as u64) < self.messages % q)
    }

    /// The faults of end `end` (0 requester, 1 responder).
    pub fn faults_of(&self, end: u64) -> FaultConfig {
        FaultConfig {
            seed: self.faults.seed ^ (end + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            ..self.faults
        }
    }
}

/// What a soak did.
#[derive(Debug, Clone, Copy, Default)]
pub struct SoakReport {
    /// Messages completed.
    pub messages: u64,
    /// Payload bytes moved (both directions).
    pub bytes: u64,
    /// Messages per operation: Send, Send/Imm, Write, Write/Imm, Read, CmpSwap, FetchAdd.
    pub ops: [u64; 7],
    /// Wall time of the run.
    pub elapsed: Duration,
    /// The requester's fault stage.
    pub faults_req: FaultStats,
    /// The responder's fault stage (zero when it ran in another process).
    pub faults_resp: FaultStats,
    /// The requester's engine counters.
    pub stats_req: Stats,
    /// The responder's engine counters (zero when it ran in another process).
    pub stats_resp: Stats,
}

impl std::fmt::Display for SoakReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        let (a, b) = (self.faults_req, self.faults_resp);
        writeln!(
            f,
            "messages {} ({:.0} msg/s, {:.1} MB/s) in {:.2} s",
            self.messages,
            self.messages as f64 / secs,
            self.bytes as f64 / secs / 1e6,
            secs
        )?;
        writeln!(
            f,
            "ops: send {} send/imm {} write {} write/imm {} read {} cmpswap {} fetchadd {}",
            self.ops[0],
            self.ops[1],
            self.ops[2],
            self.ops[3],
            self.ops[4],
            self.ops[5],
            self.ops[6]
        )?;
        writeln!(
            f,
            "faults injected: packets {} dropped {} duplicated {} reordered {} delayed {} corrupted {}; icrc drops {}",
            a.packets + b.packets,
            a.dropped + b.dropped,
            a.duplicated + b.duplicated,
            a.reordered + b.reordered,
            a.delayed + b.delayed,
            a.corrupted + b.corrupted,
            a.icrc_dropped + b.icrc_dropped
        )?;
        let (s, r) = (self.stats_req, self.stats_resp);
        write!(
            f,
            "recovery: retransmitted {} timeouts {} naks sent {} (seq err {}) rnr naks {} dropped (dup/out of window) {}",
            s.retransmitted + r.retransmitted,
            s.timeouts + r.timeouts,
            s.naks_sent + r.naks_sent,
            s.seq_err_naks_sent + r.seq_err_naks_sent,
            s.rnr_naks_received + r.rnr_naks_received,
            s.dropped + r.dropped
        )
    }
}

/// One operation of the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Send.
    Send,
    /// Send with Immediate.
    SendImm,
    /// RDMA Write.
    Write,
    /// RDMA Write with Immediate.
    WriteImm,
    /// RDMA Read.
    Read,
    /// Atomic Compare and Swap.
    CmpSwap,
    /// Atomic Fetch and Add.
    FetchAdd,
}

impl Kind {
    fn index(self) -> usize {
        self as usize
    }

    /// Whether it consumes a receive buffer at the responder.
    pub fn consumes_recv(self) -> bool {
        matches!(self, Kind::Send | Kind::SendImm | Kind::WriteImm)
    }
}

/// Message `i` of QP `k`.
#[derive(Debug, Clone, Copy)]
pub struct Msg {
    /// The operation.
    pub kind: Kind,
    /// Payload bytes (8 for atomics).
    pub len: u32,
    /// Where its payload starts in the pattern.
    pub pat: usize,
    /// Its immediate data / atomic operand.
    pub value: u64,
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Message `i` of QP `k` under `cfg`.
pub fn message(cfg: &SoakConfig, k: usize, i: u64) -> Msg {
    let h = mix(cfg.seed ^ mix((k as u64) << 40 ^ i));
    let h2 = mix(h);
    let kind = match h % 100 {
        0..20 => Kind::Send,
        20..35 => Kind::SendImm,
        35..55 => Kind::Write,
        55..70 => Kind::WriteImm,
        70..90 => Kind::Read,
        90..95 => Kind::CmpSwap,
        _ => Kind::FetchAdd,
    };
    // Mostly small, some large: 0..=64, 65..=4096, up to 16 KiB, up to the maximum.
    let max = u64::from(cfg.max_size);
    let r = (h >> 8) % 100;
    let len = match r {
        0..40 => (h2 % 65).min(max),
        40..75 => (65 + h2 % 4032).min(max),
        75..92 => (h2 % 16385).min(max),
        _ => h2 % (max + 1),
    } as u32;
    let len = if matches!(kind, Kind::CmpSwap | Kind::FetchAdd) {
        8
    } else {
        len
    };
    Msg {
        kind,
        len,
        pat: (mix(h2) % (PATTERN_LEN - MAX_SIZE as usize) as u64) as usize,
        value: mix(h2 ^ 0x5555),
    }
}

/// The pattern payloads are cut from.
pub fn pattern(seed: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(PATTERN_LEN + 8);
    let mut s = seed;
    while v.len() < PATTERN_LEN {
        s = mix(s);
        v.extend_from_slice(&s.to_le_bytes());
    }
    v.truncate(PATTERN_LEN);
    v
}

/// Compares `got` with `want`, naming the first differing offset.
fn check_bytes(what: &str, k: usize, i: u64, got: &[u8], want: &[u8]) -> Result<(), String> {
    if got == want {
        return Ok(());
    }
    let at = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    Err(format!(
        "QP {k} message {i}: {what}: byte at offset {at} is {:?}, expected {:?} ({} bytes)",
        got.get(at),
        want.get(at),
        want.len()
    ))
}

/// A work request in flight at the requester.
struct InFlight {
    i: u64,
    msg: Msg,
    /// For Reads and atomics: the slot read, to release.
    read_slot: Option<usize>,
    /// What a Read must return, or an atomic's original value.
    expect: Vec<u8>,
}

/// One QP of the requester.
struct ReqQp {
    qp: QpBox,
    cq: Cq,
    buf: Mr,
    remote: RemoteAddr,
    next: u64,
    total: u64,
    /// In flight, oldest first; window slot = index % WINDOW.
    flight: std::collections::VecDeque<InFlight>,
    /// The responder's write slots as the Writes posted so far left them.
    model: Vec<u8>,
    reads_out: [u32; SLOTS],
    /// The atomic word's value after every atomic posted so far.
    word: u64,
    final_read: bool,
    done: bool,
}

/// The requester end: posts the sequence and checks its completions.
pub struct Requester {
    cfg: SoakConfig,
    pat: Vec<u8>,
    qps: Vec<ReqQp>,
    report: SoakReport,
    wcs: Vec<WorkCompletion>,
}

impl Requester {
    /// A requester over connected QPs `qps` (QP `k` with its CQ and the responder's region
    /// for it), allocating its buffers in `pd`.
    ///
    /// # Errors
    /// The buffers cannot be allocated.
    pub fn new(
        cfg: SoakConfig,
        pd: &Pd,
        qps: Vec<(QpBox, Cq, RemoteAddr)>,
    ) -> Result<Requester, String> {
        let mut out = Vec::new();
        for (k, (qp, cq, remote)) in qps.into_iter().enumerate() {
            let buf = pd
                .alloc_mr(WINDOW as u64 * MAX_SIZE as u64, AccessFlags::LOCAL_WRITE)
                .map_err(|e| e.to_string())?;
            out.push(ReqQp {
                qp,
                cq,
                buf,
                remote,
                next: 0,
                total: cfg.messages_of(k),
                flight: Default::default(),
                model: vec![0; SLOTS * MAX_SIZE as usize],
                reads_out: [0; SLOTS],
                word: 0,
                final_read: false,
                done: false,
            });
        }
        Ok(Requester {
            pat: pattern(cfg.seed),
            cfg,
            qps: out,
            report: SoakReport::default(),
            wcs: vec![WorkCompletion::default(); WINDOW],
        })
    }

    /// Whether every message completed and was checked.
    pub fn done(&self) -> bool {
        self.qps.iter().all(|q| q.done)
    }

    /// What it did so far.
    pub fn report(&self) -> SoakReport {
        self.report
    }

    /// Posts what the windows allow and checks the completions that arrived; returns
    /// whether anything happened.
    ///
    /// # Errors
    /// A check failed (the message says which QP, message and offset) or a post failed.
    pub fn step(&mut self) -> Result<bool, String> {
        let mut moved = false;
        for k in 0..self.qps.len() {
            moved |= self.complete(k)?;
            moved |= self.post(k)?;
        }
        Ok(moved)
    }

    fn post(&mut self, k: usize) -> Result<bool, String> {
        let pat = &self.pat;
        let q = &mut self.qps[k];
        let mut moved = false;
        while q.flight.len() < WINDOW && (q.next < q.total || !q.final_read) {
            let seq = q.next + u64::from(q.final_read);
            let wslot = (seq % WINDOW as u64) as usize;
            let local_off = wslot as u64 * u64::from(MAX_SIZE);
            let word_off = SLOTS as u64 * u64::from(MAX_SIZE);
            if q.next == q.total {
                // The final read of the atomic word.
                let sge = q.buf.sge(local_off, 8).map_err(|e| e.to_string())?;
                q.qp.post_send(&SendWr::new(
                    seq,
                    SendOp::RdmaRead(q.remote.offset(word_off)),
                    &[sge],
                ))
                .map_err(|e| format!("QP {k}: posting the final read: {e}"))?;
                q.flight.push_back(InFlight {
                    i: seq,
                    msg: Msg {
                        kind: Kind::Read,
                        len: 8,
                        pat: 0,
                        value: 0,
                    },
                    read_slot: None,
                    expect: q.word.to_le_bytes().to_vec(),
                });
                q.final_read = true;
                moved = true;
                continue;
            }
            let i = q.next;
            let m = message(&self.cfg, k, i);
            let slot = (i % SLOTS as u64) as usize;
            let slot_off = slot as u64 * u64::from(MAX_SIZE);
            let len = m.len as usize;
            if matches!(m.kind, Kind::Write | Kind::WriteImm) && q.reads_out[slot] > 0 {
                // A Write must not overtake a Read of the same bytes still in flight (a
                // retransmitted Read is executed again, and would see it).
                break;
            }
            let data = &pat[m.pat..m.pat + len];
            let sgl_buf;
            let sgl: &[shmhca::Sge<'_>] = if len == 0 {
                &[]
            } else {
                sgl_buf = [q.buf.sge(local_off, m.len).map_err(|e| e.to_string())?];
                &sgl_buf
            };
            let mut f = InFlight {
                i,
                msg: m,
                read_slot: None,
                expect: Vec::new(),
            };
            let remote = q.remote.offset(slot_off);
            let op = match m.kind {
                Kind::Send => SendOp::Send,
                Kind::SendImm => SendOp::SendWithImm(m.value as u32),
                Kind::Write => SendOp::RdmaWrite(remote),
                Kind::WriteImm => SendOp::RdmaWriteWithImm(remote, m.value as u32),
                Kind::Read => SendOp::RdmaRead(remote),
                Kind::CmpSwap => {
                    // Compare with the right value half the time.
                    let compare = if m.value & 1 == 0 { q.word } else { !q.word };
                    SendOp::CompareSwap {
                        remote: q.remote.offset(word_off),
                        compare,
                        swap: m.value,
                    }
                }
                Kind::FetchAdd => SendOp::FetchAdd {
                    remote: q.remote.offset(word_off),
                    add: m.value,
                },
            };
            match m.kind {
                Kind::Send | Kind::SendImm => {
                    q.buf.write_at(local_off, data).map_err(|e| e.to_string())?;
                }
                Kind::Write | Kind::WriteImm => {
                    q.buf.write_at(local_off, data).map_err(|e| e.to_string())?;
                    let at = slot * MAX_SIZE as usize;
                    q.model[at..at + len].copy_from_slice(data);
                }
                Kind::Read => {
                    let at = slot * MAX_SIZE as usize;
                    f.expect = q.model[at..at + len].to_vec();
                    f.read_slot = Some(slot);
                    q.reads_out[slot] += 1;
                }
                Kind::CmpSwap => {
                    f.expect = q.word.to_le_bytes().to_vec();
                    if m.value & 1 == 0 {
                        q.word = m.value;
                    }
                }
                Kind::FetchAdd => {
                    f.expect = q.word.to_le_bytes().to_vec();
                    q.word = q.word.wrapping_add(m.value);
                }
            }
            q.qp.post_send(&SendWr::new(i, op, sgl))
                .map_err(|e| format!("QP {k} message {i}: posting {:?}: {e}", m.kind))?;
            q.flight.push_back(f);
            q.next += 1;
            moved = true;
        }
        Ok(moved)
    }

    fn complete(&mut self, k: usize) -> Result<bool, String> {
        let q = &mut self.qps[k];
        let n = q.cq.poll(&mut self.wcs);
        for wc in &self.wcs[..n] {
            let Some(f) = q.flight.pop_front() else {
                return Err(format!(
                    "QP {k}: a completion nobody posted (wr_id {}, {:?}): a work request completed twice?",
                    wc.wr_id, wc.opcode
                ));
            };
            let i = f.i;
            if wc.wr_id != i {
                return Err(format!(
                    "QP {k}: completion out of order: got wr_id {} ({:?}), expected message {i}",
                    wc.wr_id, wc.opcode
                ));
            }
            if wc.status != WcStatus::Success {
                // A flush error follows the failure that put the QP in the Error state:
                // name that one too.
                let cause: Vec<String> = self.wcs[..n]
                    .iter()
                    .filter(|w| !matches!(w.status, WcStatus::Success | WcStatus::WrFlushErr))
                    .map(|w| format!("wr_id {} {:?} {:?}", w.wr_id, w.opcode, w.status))
                    .collect();
                return Err(format!(
                    "QP {k} message {i} ({:?}, {} bytes): completed with {:?} (errors in the same batch: {cause:?})",
                    f.msg.kind, f.msg.len, wc.status
                ));
            }
            let want_op = match f.msg.kind {
                Kind::Send | Kind::SendImm => WcOpcode::Send,
                Kind::Write | Kind::WriteImm => WcOpcode::RdmaWrite,
                Kind::Read => WcOpcode::RdmaRead,
                Kind::CmpSwap => WcOpcode::CompSwap,
                Kind::FetchAdd => WcOpcode::FetchAdd,
            };
            if wc.opcode != want_op {
                return Err(format!(
                    "QP {k} message {i}: completion opcode {:?}, expected {want_op:?}",
                    wc.opcode
                ));
            }
            let local_off = (i % WINDOW as u64) * u64::from(MAX_SIZE);
            if !f.expect.is_empty() {
                let mut got = vec![0u8; f.expect.len()];
                q.buf
                    .read_at(local_off, &mut got)
                    .map_err(|e| e.to_string())?;
                let what = match f.msg.kind {
                    Kind::Read if i == q.total => "final value of the atomic word",
                    Kind::Read => "RDMA Read data",
                    _ => "atomic original value",
                };
                check_bytes(what, k, i, &got, &f.expect)?;
            }
            if let Some(s) = f.read_slot {
                q.reads_out[s] -= 1;
            }
            if i < q.total {
                self.report.messages += 1;
                self.report.bytes += u64::from(f.msg.len);
                self.report.ops[f.msg.kind.index()] += 1;
            }
            if q.final_read && q.flight.is_empty() {
                q.done = true;
            }
        }
        Ok(n > 0)
    }
}

/// One QP of the responder.
struct RespQp {
    qp: QpBox,
    cq: Cq,
    buf: Mr,
    /// The next message of the sequence to look at.
    next: u64,
    total: u64,
    /// Receives completed (the next receive's wr_id).
    received: u64,
    /// Messages of the sequence that consume a receive.
    consumers: u64,
}

/// The responder end: keeps receives posted and checks what arrives in them.
pub struct Responder {
    cfg: SoakConfig,
    pat: Vec<u8>,
    qps: Vec<RespQp>,
    wcs: Vec<WorkCompletion>,
    scratch: Vec<u8>,
}

impl Responder {
    /// A responder over connected QPs (with their receive CQs); posts their receives.
    ///
    /// # Errors
    /// The buffers cannot be allocated or the receives posted.
    pub fn new(cfg: SoakConfig, pd: &Pd, qps: Vec<(QpBox, Cq)>) -> Result<Responder, String> {
        let mut out = Vec::new();
        for (k, (qp, cq)) in qps.into_iter().enumerate() {
            let buf = pd
                .alloc_mr(RECVS as u64 * MAX_SIZE as u64, AccessFlags::LOCAL_WRITE)
                .map_err(|e| e.to_string())?;
            let mut r = RespQp {
                qp,
                cq,
                buf,
                next: 0,
                total: cfg.messages_of(k),
                received: 0,
                consumers: (0..cfg.messages_of(k))
                    .filter(|&i| message(&cfg, k, i).kind.consumes_recv())
                    .count() as u64,
            };
            for n in 0..RECVS as u64 {
                post_recv(&mut r, n)?;
            }
            out.push(r);
        }
        Ok(Responder {
            pat: pattern(cfg.seed),
            cfg,
            qps: out,
            wcs: vec![WorkCompletion::default(); RECVS],
            scratch: vec![0; MAX_SIZE as usize],
        })
    }

    /// Whether every message that consumes a receive arrived and was checked.
    pub fn done(&self) -> bool {
        self.qps.iter().all(|q| q.received >= q.consumers)
    }

    /// Checks the receives that completed and posts them again; returns whether anything
    /// arrived.
    ///
    /// # Errors
    /// A check failed.
    pub fn step(&mut self) -> Result<bool, String> {
        let mut moved = false;
        for k in 0..self.qps.len() {
            let q = &mut self.qps[k];
            let n = q.cq.poll(&mut self.wcs);
            moved |= n > 0;
            for wc in &self.wcs[..n] {
                // Every message of this QP arrived and was checked: what completes now is
                // a spare receive flushed because the QP closed (the requester process
                // exits once its last Send is acknowledged, which may be before this
                // side polled its other QPs).
                if q.received >= q.consumers && wc.status == WcStatus::WrFlushErr {
                    continue;
                }
                // The next message of the sequence that consumes a receive.
                let (i, m) = loop {
                    if q.next >= q.total {
                        return Err(format!(
                            "QP {k}: a receive completed after the last message ({wc:?}): a message arrived twice?"
                        ));
                    }
                    let m = message(&self.cfg, k, q.next);
                    q.next += 1;
                    if m.kind.consumes_recv() {
                        break (q.next - 1, m);
                    }
                };
                if wc.wr_id != q.received {
                    return Err(format!(
                        "QP {k} message {i}: receive completion out of order: wr_id {}, expected {}",
                        wc.wr_id, q.received
                    ));
                }
                if wc.status != WcStatus::Success {
                    return Err(format!(
                        "QP {k} message {i} ({:?}, {} bytes): receive completed with {:?}",
                        m.kind, m.len, wc.status
                    ));
                }
                let (want_op, want_imm) = match m.kind {
                    Kind::Send => (WcOpcode::Recv, None),
                    Kind::SendImm => (WcOpcode::Recv, Some(m.value as u32)),
                    _ => (WcOpcode::RecvRdmaWithImm, Some(m.value as u32)),
                };
                if (wc.opcode, wc.imm_data, wc.byte_len) != (want_op, want_imm, m.len) {
                    return Err(format!(
                        "QP {k} message {i}: received {:?} imm {:?} of {} bytes, expected {:?} ({want_op:?}) imm {want_imm:?} of {} bytes",
                        wc.opcode, wc.imm_data, wc.byte_len, m.kind, m.len
                    ));
                }
                let off = (q.received % RECVS as u64) * u64::from(MAX_SIZE);
                if m.kind != Kind::WriteImm {
                    let got = &mut self.scratch[..m.len as usize];
                    q.buf.read_at(off, got).map_err(|e| e.to_string())?;
                    check_bytes(
                        "received data",
                        k,
                        i,
                        got,
                        &self.pat[m.pat..m.pat + m.len as usize],
                    )?;
                }
                let n = q.received + RECVS as u64;
                q.received += 1;
                post_recv(q, n)?;
            }
        }
        Ok(moved)
    }
}

fn post_recv(q: &mut RespQp, n: u64) -> Result<(), String> {
    let off = (n % RECVS as u64) * u64::from(MAX_SIZE);
    let sge = q.buf.sge(off, MAX_SIZE).map_err(|e| e.to_string())?;
    q.qp.post_recv(&RecvWr::new(n, &[sge]))
        .map_err(|e| format!("posting receive {n}: {e}"))
}

/// Drives `req` and `resp` (two ends in this thread) until the requester is done; fails
/// if nothing moves for `stall`.
///
/// # Errors
/// A check failed, or the run stalled.
pub fn drive(
    req: &mut Requester,
    resp: &mut Responder,
    ctxs: &[&Context],
    stall: Duration,
) -> Result<(), String> {
    let mut last = Instant::now();
    while !(req.done() && resp.done()) {
        for c in ctxs {
            c.progress();
        }
        let a = req.step()?;
        let b = resp.step()?;
        if a || b {
            last = Instant::now();
        } else if last.elapsed() > stall {
            return Err(format!(
                "no progress for {stall:?}: {} messages done",
                req.report().messages
            ));
        }
    }
    Ok(())
}

/// Runs a soak between two contexts of this process (inline engines driven from this
/// thread), each with the faults of `cfg`.
///
/// # Errors
/// A check failed, the run stalled, or the set-up failed.
pub fn run_in_process(cfg: &SoakConfig) -> Result<SoakReport, String> {
    let e = |e: shmhca::Error| e.to_string();
    let build = |end| {
        Context::builder()
            .arena_size(64 << 20)
            .huge_pages(shmhca_rings::HugePages::Never)
            .mode(shmhca::EngineMode::Inline)
            .faults(cfg.faults_of(end))
            .build()
    };
    let (ca, cb) = (build(0).map_err(e)?, build(1).map_err(e)?);
    let (la, lb) = ca.link_with(&cb).map_err(e)?;
    let (pa, pb) = (ca.alloc_pd().map_err(e)?, cb.alloc_pd().map_err(e)?);
    let region = pb
        .alloc_mr(
            REGION_PER_QP * cfg.qps as u64,
            AccessFlags::LOCAL_WRITE
                | AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_ATOMIC,
        )
        .map_err(e)?;
    let caps = shmhca::QpCaps {
        max_send_wr: WINDOW as u32 * 2,
        max_recv_wr: RECVS as u32 * 2,
        ..shmhca::QpCaps::default()
    };
    let mut reqs = Vec::new();
    let mut resps = Vec::new();
    for k in 0..cfg.qps {
        let cqa = ca.create_cq(256).map_err(e)?;
        let cqb = cb.create_cq(256).map_err(e)?;
        let mut qa = ca.create_qp(&pa, &cqa, &cqa, caps).map_err(e)?;
        let mut qb = cb.create_qp(&pb, &cqb, &cqb, caps).map_err(e)?;
        let (na, nb) = (qa.qpn(), qb.qpn());
        let (pa_psn, pb_psn) = (100 + k as u32, 9000 + k as u32);
        connect(
            &mut qa,
            la,
            nb,
            (pa_psn, pb_psn),
            mtu_of(k),
            cfg.ack_timeout,
        )
        .map_err(e)?;
        connect(
            &mut qb,
            lb,
            na,
            (pb_psn, pa_psn),
            mtu_of(k),
            cfg.ack_timeout,
        )
        .map_err(e)?;
        reqs.push((
            Box::new(LocalQp(qa)) as QpBox,
            cqa,
            region.remote(REGION_PER_QP * k as u64),
        ));
        resps.push((Box::new(LocalQp(qb)) as QpBox, cqb));
    }
    let mut req = Requester::new(*cfg, &pa, reqs)?;
    let mut resp = Responder::new(*cfg, &pb, resps)?;
    let start = Instant::now();
    drive(&mut req, &mut resp, &[&ca, &cb], Duration::from_secs(30)).map_err(|e| {
        format!(
            "{e}\nrequester: {:?}\n{:?}\nresponder: {:?}\n{:?}",
            ca.stats(),
            ca.fault_stats(),
            cb.stats(),
            cb.fault_stats()
        )
    })?;
    // The end of a two-process run: the requester process exits, the connection closes and
    // the responder's QPs go to Error, flushing the receives still posted. Those are not
    // messages.
    for q in &mut resp.qps {
        q.qp.modify(&shmhca::QpAttr::new(shmhca::QpState::Error))
            .map_err(e)?;
    }
    cb.progress();
    resp.step()?;
    let mut r = req.report();
    r.elapsed = start.elapsed();
    r.faults_req = ca.fault_stats();
    r.faults_resp = cb.fault_stats();
    r.stats_req = ca.stats();
    r.stats_resp = cb.stats();
    Ok(r)
}

/// The default transport timer of the soak's QPs, in one process or two: 4.096 µs × 2^14,
/// about 67 ms (7 retries, RNR retry forever). On a loaded machine an inline engine's
/// thread can go unscheduled for tens of milliseconds, and nothing acknowledges meanwhile:
/// with a 4 ms timer (2^10) 8 timeouts in a row ended runs with RetryExcErr although
/// nothing was lost — between two processes, and (issue 24) in one process whose single
/// thread drives both engines: a debug build on a loaded 2-core machine failed
/// `soak_100k_messages_in_process_under_faults` at message 24 after 39 timeouts and 795
/// retransmissions for 15 dropped packets.
pub const TWO_PROCESS_ACK_TIMEOUT: u8 = 14;

/// Connects an in-process QP; `ack_timeout` is its Local Ack Timeout.
fn connect(
    qp: &mut Qp,
    link: shmhca::LinkId,
    remote: shmhca::Qpn,
    (sq_psn, rq_psn): (u32, u32),
    mtu: Mtu,
    ack_timeout: u8,
) -> shmhca::Result<()> {
    use shmhca::{Destination, QpAttr, QpState};
    qp.modify(&QpAttr::new(QpState::Init).access(
        AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
    ))?;
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(mtu)
            .dest(Destination { link, qpn: remote })
            .rq_psn(rq_psn)
            .max_dest_rd_atomic(16)
            .min_rnr_timer(1),
    )?;
    qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(sq_psn)
            .timeout(ack_timeout)
            .retry_cnt(7)
            .rnr_retry(7)
            .max_rd_atomic(16),
    )
}

/// The access the responder's region grants.
fn region_access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC
}

/// Connection parameters of QP `k` (both ends).
fn connect_params(k: usize, ack_timeout: u8) -> shmhca::ConnectParams {
    shmhca::ConnectParams::default()
        .caps(shmhca::QpCaps {
            max_send_wr: WINDOW as u32 * 2,
            max_recv_wr: RECVS as u32 * 2,
            ..shmhca::QpCaps::default()
        })
        .mtu(mtu_of(k))
        .access(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC)
        .local_ack_timeout(ack_timeout)
        .retry_count(7)
        .rnr_retry_count(7)
        .min_rnr_timer(1)
        .responder_resources(16)
        .initiator_depth(16)
}

fn inline_context(faults: FaultConfig) -> Result<Context, String> {
    Context::builder()
        .arena_size(64 << 20)
        .mode(shmhca::EngineMode::Inline)
        .faults(faults)
        .build()
        .map_err(|e| e.to_string())
}

/// The line the responder process prints once it listens.
pub const READY: &str = "shmhca-soak responder ready";
/// The line the responder process prints once its receives are posted: the requester
/// starts then (an inline engine busy setting up acknowledges nothing, and the requester's
/// transport timer would run out).
pub const GO: &str = "shmhca-soak responder go";
/// The prefix of the line the responder process prints with its counters at the end.
pub const COUNTERS: &str = "shmhca-soak responder counters";

/// The responder end of a two-process soak: listens at `path`, accepts `cfg.qps`
/// connections, checks what arrives until every receiving message did, then serves the
/// requester until it hangs up. Prints [`READY`] when it listens and a [`COUNTERS`] line
/// at the end.
///
/// # Errors
/// A check failed, or the set-up failed.
pub fn run_responder_process(cfg: &SoakConfig, path: &std::path::Path) -> Result<(), String> {
    let e = |e: shmhca::Error| e.to_string();
    let ctx = inline_context(cfg.faults_of(1))?;
    let pd = ctx.alloc_pd().map_err(e)?;
    let listener = ctx.listen(path).map_err(e)?;
    println!("{READY}");
    let region = pd
        .alloc_mr(REGION_PER_QP * cfg.qps as u64, region_access())
        .map_err(e)?;
    let mut qps = Vec::new();
    for k in 0..cfg.qps {
        let cq = ctx.create_cq(256).map_err(e)?;
        let params = connect_params(k, cfg.ack_timeout)
            .private_data(region.remote(REGION_PER_QP * k as u64).to_bytes().to_vec());
        let conn = listener
            .accept_timeout(Duration::from_secs(30), &pd, &cq, &cq, &params)
            .map_err(e)?;
        qps.push((Box::new(conn) as QpBox, cq));
    }
    let mut resp = Responder::new(*cfg, &pd, qps)?;
    println!("{GO}");
    let mut last = Instant::now();
    while !resp.done() {
        ctx.progress();
        if resp.step()? {
            last = Instant::now();
        } else if last.elapsed() > Duration::from_secs(60) {
            return Err("the responder saw no message for 60 s".into());
        }
    }
    // Keep answering (Acks, Reads, Atomics) until the requester hangs up.
    let start = Instant::now();
    // (The hang-up puts the QPs in the Error state; their receives are flushed then.)
    while resp
        .qps
        .iter()
        .any(|q| q.qp.state() != shmhca::QpState::Error)
    {
        ctx.progress();
        if start.elapsed() > Duration::from_secs(600) {
            return Err("the requester never hung up".into());
        }
    }
    let (f, s) = (ctx.fault_stats(), ctx.stats());
    println!(
        "{COUNTERS} {} {} {} {} {} {} {} {} {} {} {} {}",
        f.packets,
        f.dropped,
        f.duplicated,
        f.reordered,
        f.delayed,
        f.corrupted,
        f.icrc_dropped,
        s.retransmitted,
        s.timeouts,
        s.naks_sent,
        s.seq_err_naks_sent,
        s.dropped
    );
    Ok(())
}

/// Parses a [`COUNTERS`] line into fault and engine counters.
pub fn parse_counters(line: &str) -> Option<(FaultStats, Stats)> {
    let rest = line.strip_prefix(COUNTERS)?;
    let v: Vec<u64> = rest
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let [
        packets,
        dropped,
        duplicated,
        reordered,
        delayed,
        corrupted,
        icrc_dropped,
        retransmitted,
        timeouts,
        naks_sent,
        seq_err_naks_sent,
        sdropped,
    ] = v[..]
    else {
        return None;
    };
    let f = FaultStats {
        packets,
        dropped,
        duplicated,
        reordered,
        delayed,
        corrupted,
        icrc_dropped,
    };
    let s = Stats {
        retransmitted,
        timeouts,
        naks_sent,
        seq_err_naks_sent,
        dropped: sdropped,
        ..Stats::default()
    };
    Some((f, s))
}

/// The requester end of a two-process soak: connects `cfg.qps` QPs to the responder at
/// `path` and runs the sequence.
///
/// # Errors
/// A check failed, the run stalled, or the set-up failed.
pub fn run_requester_process(
    cfg: &SoakConfig,
    path: &std::path::Path,
    wait_go: impl FnOnce() -> Result<(), String>,
) -> Result<SoakReport, String> {
    let e = |e: shmhca::Error| e.to_string();
    let ctx = inline_context(cfg.faults_of(0))?;
    let pd = ctx.alloc_pd().map_err(e)?;
    let mut qps = Vec::new();
    for k in 0..cfg.qps {
        let cq = ctx.create_cq(256).map_err(e)?;
        let conn = ctx
            .connect(path, &pd, &cq, &cq, &connect_params(k, cfg.ack_timeout))
            .map_err(e)?;
        let b: [u8; 12] = conn
            .peer_private_data()
            .get(..12)
            .and_then(|b| b.try_into().ok())
            .ok_or("the responder sent no region address")?;
        qps.push((Box::new(conn) as QpBox, cq, RemoteAddr::from_bytes(b)));
    }
    let mut req = Requester::new(*cfg, &pd, qps)?;
    wait_go()?;
    let start = Instant::now();
    let mut last = Instant::now();
    let counters =
        |e: String| format!("{e}\nrequester: {:?}\n{:?}", ctx.stats(), ctx.fault_stats());
    while !req.done() {
        ctx.progress();
        if req.step().map_err(counters)? {
            last = Instant::now();
        } else if last.elapsed() > Duration::from_secs(30) {
            return Err(format!(
                "no progress for 30 s: {} messages done",
                req.report().messages
            ));
        }
    }
    let mut r = req.report();
    r.elapsed = start.elapsed();
    r.faults_req = ctx.fault_stats();
    r.stats_req = ctx.stats();
    Ok(r)
}
