//! The latency loops, perftest's way: Send and RDMA Write as ping-pongs (one-way latency is
//! half of each round trip), RDMA Read and Atomics as timed round trips.
//!
//! Inside a loop nothing allocates, locks or makes a system call: the completion array,
//! the inline payload, the histogram and the `-H` sample list are made before it, and time
//! comes from `Instant::now()` (the vDSO clock). One timestamp per iteration: each sample
//! is the time between two consecutive iterations' ends, which covers the whole exchange
//! including the repost of the receive buffer, as perftest measures it.

use std::time::{Duration, Instant};

use shmhca::{
    CompChannel, Data, Mr, Qp, QpState, RecvWr, SendFlags, SendOp, SendWr, WcOpcode, WcStatus,
    WorkCompletion,
};

use crate::perf::check::{IterCheck, static_byte};
use crate::perf::error::PerfError;
use crate::perf::opts::{AtomicType, Options, TestKind};
use crate::perf::setup::Side;
use crate::perf::stats::LatRecorder;

/// Empty polls between two checks that the QP is still connected.
const LIVENESS_EVERY: u32 = 1 << 16;

/// Counts a loop's empty polls and, every [`LIVENESS_EVERY`] of them, checks that the
/// peer's process is there (`--roce`'s [pulse](crate::perf::pulse)), that its QPs are still
/// connected (a peer that died leaves them in the Error state) and that the loop
/// has not been idle for longer than `--idle-timeout` (a stopped or hung peer).
#[derive(Debug, Default)]
pub(crate) struct Liveness {
    polls: u32,
    /// When the current idle stretch was first noticed (cleared by [`Liveness::busy`]).
    since: Option<Instant>,
}

impl Liveness {
    /// One more empty poll.
    ///
    /// # Errors
    /// [`PerfError::PeerGone`] if the peer's process ended or a QP has left RTS,
    /// [`PerfError::PeerIdle`] once the
    /// loop has been idle for longer than `--idle-timeout`.
    #[inline]
    pub(crate) fn idle<'q>(
        &mut self,
        qps: impl IntoIterator<Item = &'q Qp>,
    ) -> Result<(), PerfError> {
        self.polls = self.polls.wrapping_add(1);
        if self.polls % LIVENESS_EVERY == 0 {
            crate::perf::pulse::check()?;
            for qp in qps {
                check_alive(qp)?;
            }
            if let Some(limit) = crate::perf::idle::timeout() {
                let now = Instant::now();
                let since = *self.since.get_or_insert(now);
                if now - since > limit {
                    return Err(crate::perf::idle::idle_error(
                        now - since,
                        "waiting for its answer",
                    ));
                }
            }
        }
        Ok(())
    }

    /// The loop made progress: the idle stretch (if any) is over.
    #[inline]
    pub(crate) fn busy(&mut self) {
        self.since = None;
    }
}

/// A progress line on stderr for runs longer than `--progress-after` seconds (default 2),
/// at most once a second.
#[derive(Debug)]
pub struct Progress {
    label: String,
    total: u64,
    next: Instant,
    start: Instant,
    shown: bool,
    enabled: bool,
}

impl Progress {
    /// Progress of `total` iterations labelled `label`, shown from `after` seconds on;
    /// silent unless `enabled`.
    pub fn new(label: String, total: u64, after: u64, enabled: bool) -> Progress {
        let now = Instant::now();
        Progress {
            label,
            total,
            next: now + std::time::Duration::from_secs(after),
            start: now,
            shown: false,
            enabled,
        }
    }

    /// Whether a line is due at `now`.
    #[inline]
    pub fn due(&self, now: Instant) -> bool {
        self.enabled && now >= self.next
    }

    /// Prints the line for `done` iterations.
    #[cold]
    pub fn show(&mut self, now: Instant, done: u64) {
        let pct = done as f64 * 100.0 / self.total.max(1) as f64;
        eprintln!(
            "shmhca-perf: {}: {pct:.0}% ({done} of {} iterations, {:.1} s)",
            self.label,
            self.total,
            (now - self.start).as_secs_f64()
        );
        self.shown = true;
        self.next = now + std::time::Duration::from_secs(1);
    }

    /// Whether any line was printed.
    pub fn shown(&self) -> bool {
        self.shown
    }
}

/// Maps a failed completion to an error.
#[cold]
pub(crate) fn completion_error(what: &'static str, status: WcStatus) -> PerfError {
    if status == WcStatus::WrFlushErr {
        PerfError::PeerGone(format!(
            "{what} was flushed: the peer process exited or closed its connection"
        ))
    } else {
        PerfError::Completion { what, status }
    }
}

#[cold]
fn check_alive(qp: &Qp) -> Result<(), PerfError> {
    match qp.state() {
        QpState::Rts => Ok(()),
        s => Err(PerfError::PeerGone(format!(
            "the QP left RTS (now {s:?}): the peer process exited or closed its connection"
        ))),
    }
}

/// Posts `wr`, polling `cq` while the send queue is full.
#[inline]
fn post(
    qp: &mut Qp,
    cq: &mut shmhca::Cq,
    wcs: &mut [WorkCompletion],
    wr: &SendWr<'_>,
) -> Result<(), PerfError> {
    loop {
        match qp.post_send(wr) {
            Ok(()) => return Ok(()),
            Err(shmhca::Error::QueueFull { .. }) => {
                let n = cq.poll(wcs);
                for wc in &wcs[..n] {
                    if wc.status != WcStatus::Success {
                        return Err(completion_error("a send", wc.status));
                    }
                }
            }
            Err(e) => return Err(PerfError::engine("posting a send")(e)),
        }
    }
}

/// The bytes inline sends carry: the send buffer's first `size` bytes, which the peer
/// checks, or nothing when messages are not sent inline. Made before a loop, reused by it.
pub(crate) fn inline_payload(buf: &Mr, size: u64, inline: bool) -> Result<Vec<u8>, PerfError> {
    let mut payload = vec![0u8; if inline { size as usize } else { 0 }];
    buf.read_at(0, &mut payload)
        .map_err(PerfError::engine("the send buffer"))?;
    Ok(payload)
}

/// perftest's CQ moderation: request `i` (0-based) is signaled if it is the `sig`-th.
#[inline]
fn signaled_every(sig: u64, i: u64) -> SendFlags {
    if (i + 1) % sig == 0 {
        SendFlags::SIGNALED
    } else {
        SendFlags::NONE
    }
}

/// The little-endian iteration marker written into the last `k` bytes of a Write.
#[inline]
fn marker(i: u64, k: usize) -> [u8; 8] {
    let mut m = [0u8; 8];
    m[..k].copy_from_slice(&(i + 1).to_le_bytes()[..k]);
    m
}

/// Runs `n` iterations (numbered from `first`) of a latency test on QP 0 as the client
/// (the side that starts each exchange and measures), recording into `rec` when given
/// (warm-up passes `None`).
///
/// # Errors
/// A post fails, a completion reports an error, or the peer goes away.
pub fn client(
    side: &mut Side,
    opts: &Options,
    size: u64,
    first: u64,
    n: u64,
    mut rec: Option<&mut LatRecorder>,
    prog: &mut Progress,
) -> Result<(), PerfError> {
    let Side { res, qps, peer, .. } = side;
    let qp: &mut Qp = &mut qps[0];
    let cq = &mut res.cq;
    let channel = &mut res.channel;
    let buf = &res.buf;
    let len = size as u32;
    let half = res.half;
    let inline = size <= u64::from(opts.inline);
    let mut payload = inline_payload(buf, size, inline)?;
    let mut wcs = [WorkCompletion::default(); 16];
    let send_sge = [buf
        .sge(0, len)
        .map_err(PerfError::engine("the send buffer"))?];
    let recv_sge = [buf
        .sge(half, len.max(1))
        .map_err(PerfError::engine("the receive buffer"))?];
    let full_recv = [buf
        .sge(half, half as u32)
        .map_err(PerfError::engine("the receive buffer"))?];
    let atomic_sge = [buf
        .sge(half, 8)
        .map_err(PerfError::engine("the atomic result buffer"))?];
    let sig = u64::from(opts.cq_mod);
    let one_way = matches!(opts.test, TestKind::SendLat | TestKind::WriteLat);
    let remote_recv = peer.buf.offset(half);
    let remote_send = peer.buf;
    let k = (size as usize).min(8);
    let mut seen = [0u8; 8];
    let mut chk = IterCheck::new(opts, size, true);
    let mut t_prev = Instant::now();
    for i in first..first + n {
        let flags = signaled_every(sig, i);
        match opts.test {
            TestKind::SendLat => {
                if let Some(c) = chk.as_mut() {
                    if inline {
                        c.fill(i, &mut payload);
                    } else {
                        c.write(buf, 0, size, i)?;
                    }
                }
                let data = if inline {
                    Data::Inline(&payload)
                } else {
                    Data::Sgl(&send_sge)
                };
                let wr = SendWr {
                    wr_id: i,
                    op: SendOp::Send,
                    data,
                    flags,
                };
                post(qp, cq, &mut wcs, &wr)?;
                wait_recv(qp, cq, channel, &mut wcs, len)?;
                if let Some(c) = chk.as_mut() {
                    c.verify(buf, half, size, i, "the server's answer", None)?;
                }
                qp.post_recv(&RecvWr::new(i, &full_recv))
                    .map_err(PerfError::engine("reposting a receive"))?;
            }
            TestKind::WriteLat => {
                let m = marker(i, k);
                if let Some(c) = chk.as_mut() {
                    if inline {
                        c.fill(i, &mut payload);
                    } else {
                        c.write(buf, 0, size, i)?;
                    }
                }
                let data = if inline {
                    payload[size as usize - k..].copy_from_slice(&m[..k]);
                    Data::Inline(&payload)
                } else {
                    buf.write_at(size - k as u64, &m[..k])
                        .map_err(PerfError::engine("writing the marker"))?;
                    Data::Sgl(&send_sge)
                };
                let wr = SendWr {
                    wr_id: i,
                    op: SendOp::RdmaWrite(remote_recv),
                    data,
                    flags,
                };
                post(qp, cq, &mut wcs, &wr)?;
                let mut live = Liveness::default();
                loop {
                    let c = cq.poll(&mut wcs);
                    for wc in &wcs[..c] {
                        if wc.status != WcStatus::Success {
                            return Err(completion_error("an RDMA Write", wc.status));
                        }
                    }
                    buf.read_at(half + size - k as u64, &mut seen[..k])
                        .map_err(PerfError::engine("reading the marker"))?;
                    if seen[..k] == m[..k] {
                        break;
                    }
                    live.idle([&*qp])?;
                    std::hint::spin_loop();
                }
                if let Some(c) = chk.as_mut() {
                    c.verify(
                        buf,
                        half,
                        size - k as u64,
                        i,
                        "the server's RDMA Write",
                        None,
                    )?;
                }
            }
            TestKind::ReadLat => {
                if let Some(c) = chk.as_mut() {
                    // A Read that leaves bytes unwritten must not pass on the last one's.
                    c.clear(buf, half, size)?;
                }
                let wr = SendWr::new(i, SendOp::RdmaRead(remote_send), &recv_sge);
                post(qp, cq, &mut wcs, &wr)?;
                let id = wait_send(qp, cq, channel, &mut wcs, "an RDMA Read")?;
                if let Some(c) = chk.as_mut() {
                    c.order(i, id, "the RDMA Read")?;
                    let si = c.expect_index();
                    c.verify(
                        buf,
                        half,
                        size,
                        i,
                        "RDMA Read data",
                        Some(&|j| static_byte(si, j)),
                    )?;
                }
            }
            TestKind::AtomicLat => {
                let op = match opts.atomic {
                    AtomicType::FetchAndAdd => SendOp::FetchAdd {
                        remote: remote_recv,
                        add: 1,
                    },
                    AtomicType::CmpAndSwap => SendOp::CompareSwap {
                        remote: remote_recv,
                        compare: i,
                        swap: i + 1,
                    },
                };
                post(qp, cq, &mut wcs, &SendWr::new(i, op, &atomic_sge))?;
                let id = wait_send(qp, cq, channel, &mut wcs, "an Atomic")?;
                if let Some(c) = chk.as_mut() {
                    c.order(i, id, "the Atomic")?;
                    // The counter starts at 0 each size and moves by one per iteration:
                    // the original value of iteration i is i.
                    let want = i + (c.expect_index() - c.size_index()) as u64;
                    let got = buf
                        .load_u64(half)
                        .map_err(PerfError::engine("reading the atomic result"))?;
                    if got != want {
                        return Err(PerfError::Check(format!(
                            "{}: iteration {i}: the Atomic returned {got}, expected {want}",
                            opts.test.name()
                        )));
                    }
                }
            }
            _ => unreachable!("latency loops run latency tests only"),
        }
        let now = Instant::now();
        if let Some(r) = rec.as_deref_mut() {
            let ns = (now - t_prev).as_nanos() as u64;
            r.record(if one_way { ns / 2 } else { ns });
            r.tick(now);
        }
        t_prev = now;
        if prog.due(now) {
            prog.show(now, i + 1 - first);
        }
    }
    Ok(())
}

/// The longest sleep on the completion channel before the loop looks at its QPs' liveness.
const EVENT_WAIT: Duration = Duration::from_millis(100);

/// With `-e` (`channel` given), after a poll found nothing: arms the CQ, polls once more
/// (completions that came before the arm raise no event), and if still nothing sleeps until
/// the CQ's event (or [`EVENT_WAIT`]). Returns the completions the polls found. Without
/// `-e`: nothing (the caller polls again).
///
/// # Errors
/// The engine refuses the arm or the wait; [`PerfError::PeerGone`] when a sleep brought
/// nothing and `--roce`'s [pulse](crate::perf::pulse) says the peer's process ended.
#[inline]
pub(crate) fn sleep_for_completions(
    channel: &mut Option<CompChannel>,
    cq: &mut shmhca::Cq,
    wcs: &mut [WorkCompletion],
) -> Result<usize, PerfError> {
    let Some(ch) = channel else {
        return Ok(0);
    };
    cq.req_notify(false)
        .map_err(PerfError::engine("arming the completion queue"))?;
    let c = cq.poll(wcs);
    if c > 0 {
        return Ok(c);
    }
    ch.get_event(Some(EVENT_WAIT))
        .map_err(PerfError::engine("waiting on the completion channel"))?;
    let c = cq.poll(wcs);
    if c == 0 {
        // A sleep that brought nothing: the loop is idle, and its liveness check comes
        // only every so many of these — a look at `--roce`'s pulse now.
        crate::perf::pulse::check()?;
    }
    Ok(c)
}

/// Polls until a receive completes (sends' completions are retired on the way); with `-e`
/// sleeps on the channel instead of polling again.
#[inline]
fn wait_recv(
    qp: &Qp,
    cq: &mut shmhca::Cq,
    channel: &mut Option<CompChannel>,
    wcs: &mut [WorkCompletion],
    len: u32,
) -> Result<(), PerfError> {
    let mut live = Liveness::default();
    loop {
        let mut c = cq.poll(wcs);
        if c == 0 {
            c = sleep_for_completions(channel, cq, wcs)?;
        }
        let mut got = false;
        for wc in &wcs[..c] {
            if wc.status != WcStatus::Success {
                return Err(completion_error("a Send or Receive", wc.status));
            }
            if wc.opcode == WcOpcode::Recv {
                if wc.byte_len != len {
                    return Err(PerfError::Check(format!(
                        "received {} bytes, expected {len}",
                        wc.byte_len
                    )));
                }
                got = true;
            }
        }
        if got {
            return Ok(());
        }
        live.idle([qp])?;
    }
}

/// Polls until the (signaled) request completes, with `-e` sleeping on the channel
/// instead of polling again; returns the `wr_id` of the last completion.
#[inline]
fn wait_send(
    qp: &Qp,
    cq: &mut shmhca::Cq,
    channel: &mut Option<CompChannel>,
    wcs: &mut [WorkCompletion],
    what: &'static str,
) -> Result<u64, PerfError> {
    let mut live = Liveness::default();
    loop {
        let mut c = cq.poll(wcs);
        if c == 0 {
            c = sleep_for_completions(channel, cq, wcs)?;
        }
        for wc in &wcs[..c] {
            if wc.status != WcStatus::Success {
                return Err(completion_error(what, wc.status));
            }
        }
        // Every Read and Atomic is signaled and one is outstanding: any completion is it.
        if c > 0 {
            return Ok(wcs[c - 1].wr_id);
        }
        live.idle([qp])?;
    }
}

/// The server's half of Send and Write ping-pongs: waits for the client's message, answers
/// it. Read and Atomic tests need no server loop (its engine answers while it waits at the
/// next barrier).
///
/// # Errors
/// A post fails, a completion reports an error, or the peer goes away.
pub fn server(
    side: &mut Side,
    opts: &Options,
    size: u64,
    first: u64,
    n: u64,
) -> Result<(), PerfError> {
    let Side { res, qps, peer, .. } = side;
    let qp: &mut Qp = &mut qps[0];
    let cq = &mut res.cq;
    let channel = &mut res.channel;
    let buf = &res.buf;
    let len = size as u32;
    let half = res.half;
    let inline = size <= u64::from(opts.inline);
    let mut payload = inline_payload(buf, size, inline)?;
    let mut wcs = [WorkCompletion::default(); 16];
    let send_sge = [buf
        .sge(0, len)
        .map_err(PerfError::engine("the send buffer"))?];
    let full_recv = [buf
        .sge(half, half as u32)
        .map_err(PerfError::engine("the receive buffer"))?];
    let sig = u64::from(opts.cq_mod);
    let remote_recv = peer.buf.offset(half);
    let k = (size as usize).min(8);
    let mut seen = [0u8; 8];
    let mut chk = IterCheck::new(opts, size, false);
    for i in first..first + n {
        let flags = signaled_every(sig, i);
        match opts.test {
            TestKind::SendLat => {
                wait_recv(qp, cq, channel, &mut wcs, len)?;
                if let Some(c) = chk.as_mut() {
                    c.verify(buf, half, size, i, "the client's Send", None)?;
                    if inline {
                        c.fill(i, &mut payload);
                    } else {
                        c.write(buf, 0, size, i)?;
                    }
                }
                qp.post_recv(&RecvWr::new(i, &full_recv))
                    .map_err(PerfError::engine("reposting a receive"))?;
                let data = if inline {
                    Data::Inline(&payload)
                } else {
                    Data::Sgl(&send_sge)
                };
                post(
                    qp,
                    cq,
                    &mut wcs,
                    &SendWr {
                        wr_id: i,
                        op: SendOp::Send,
                        data,
                        flags,
                    },
                )?;
            }
            TestKind::WriteLat => {
                let m = marker(i, k);
                let mut live = Liveness::default();
                loop {
                    buf.read_at(half + size - k as u64, &mut seen[..k])
                        .map_err(PerfError::engine("reading the marker"))?;
                    if seen[..k] == m[..k] {
                        break;
                    }
                    let c = cq.poll(&mut wcs);
                    for wc in &wcs[..c] {
                        if wc.status != WcStatus::Success {
                            return Err(completion_error("an RDMA Write", wc.status));
                        }
                    }
                    live.idle([&*qp])?;
                    std::hint::spin_loop();
                }
                if let Some(c) = chk.as_mut() {
                    c.verify(
                        buf,
                        half,
                        size - k as u64,
                        i,
                        "the client's RDMA Write",
                        None,
                    )?;
                    if inline {
                        c.fill(i, &mut payload);
                    } else {
                        c.write(buf, 0, size, i)?;
                    }
                }
                let data = if inline {
                    payload[size as usize - k..].copy_from_slice(&m[..k]);
                    Data::Inline(&payload)
                } else {
                    buf.write_at(size - k as u64, &m[..k])
                        .map_err(PerfError::engine("writing the marker"))?;
                    Data::Sgl(&send_sge)
                };
                post(
                    qp,
                    cq,
                    &mut wcs,
                    &SendWr {
                        wr_id: i,
                        op: SendOp::RdmaWrite(remote_recv),
                        data,
                        flags,
                    },
                )?;
            }
            _ => return Ok(()),
        }
    }
    Ok(())
}
