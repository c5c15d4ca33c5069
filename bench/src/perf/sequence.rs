//! The sequence both sides run for every size: start barrier, warm-up, measurement (or
//! the answers), end barrier carrying the server's verdict, and the goodbye.

use std::time::{Duration, Instant};

use crate::perf::bw;
use crate::perf::check::{client_check, fill_pattern, server_check};
use crate::perf::error::PerfError;
use crate::perf::idle::IdleWatch;
use crate::perf::lat::{self, Progress};
use crate::perf::opts::{Options, Timed, Verb};
use crate::perf::output::Output;
use crate::perf::setup::Side;
use crate::perf::stats::{BwClock, BwStats, TimedClock};

/// How long a side whose QPs failed with no reason but "the peer went away" (flushed, out
/// of RTS) waits for the peer's abort message saying why: a peer whose request this side's
/// responder refused learns the reason from its completion and sends it at once.
const PEER_REASON_WAIT: Duration = Duration::from_secs(2);

/// The same wait when the peer's process is known to have ended (`--roce`'s pulse): its
/// abort message, if any, is here already.
const LOST_REASON_WAIT: Duration = Duration::from_millis(100);

/// How long a failing side waits for the peer to acknowledge its abort message.
const ABORT_SETTLE: Duration = Duration::from_millis(500);

/// The sequence both sides run: for each size, a start barrier, the warm-up, the
/// measurement (client) or the answers (server), and an end barrier carrying the server's
/// check of what arrived.
///
/// A side that fails tells the peer why (an abort message on the control channel), so a
/// peer waiting on it ends at once with that reason ([`PerfError::PeerFailed`]) instead of
/// waiting out `--idle-timeout`; a side that only sees its QPs flushed or out of RTS looks
/// for that message first, so that both sides name the failing completion.
pub(crate) fn run_sizes(
    opts: &Options,
    side: &mut Side,
    client: bool,
    out: Option<&mut Output>,
) -> Result<(), PerfError> {
    sizes(opts, side, client, out).map_err(|e| after_failure(side, e))
}

/// What a failed side reports, having told the peer (see [`run_sizes`]). A data QP that
/// failed because this side's responder refused a peer's request says why
/// ([`shmhca::Qp::last_error`]: which R_Key check, key, range): that goes into the report.
fn after_failure(side: &mut Side, e: PerfError) -> PerfError {
    let local = side.qps.iter().find_map(|q| q.last_error());
    let with_local = |text: String| match &local {
        Some(l) => format!("{text}; on this side: {l}"),
        None => text,
    };
    // With --roce, a peer whose process ended is known at once (its pulse stopped): its
    // abort message, if it sent one, came before that, so a short look for it is enough;
    // nobody is left to tell; and whatever failed here failed because of it.
    let lost = crate::perf::pulse::lost();
    let (e, reason_wait) = match (e, &lost) {
        (e @ PerfError::PeerFailed(_), _) | (e, None) => (e, PEER_REASON_WAIT),
        (PerfError::PeerGone(seen), Some(why)) if seen == *why => {
            (PerfError::PeerGone(seen), LOST_REASON_WAIT)
        }
        (PerfError::PeerGone(seen), Some(why)) => (
            PerfError::PeerGone(format!("{why}; here: {seen}")),
            LOST_REASON_WAIT,
        ),
        (e, Some(why)) => (
            PerfError::PeerGone(format!("{why}; here: {e}")),
            LOST_REASON_WAIT,
        ),
    };
    match e {
        PerfError::PeerFailed(text) => PerfError::PeerFailed(with_local(text)),
        PerfError::PeerGone(seen) => match side.ctl.peer_abort(reason_wait) {
            Some(text) => PerfError::PeerFailed(with_local(text)),
            None => {
                let e = PerfError::PeerGone(with_local(seen));
                if lost.is_none() {
                    side.ctl.abort(&e.to_string(), ABORT_SETTLE);
                }
                e
            }
        },
        e => {
            side.ctl.abort(&e.to_string(), ABORT_SETTLE);
            e
        }
    }
}

fn sizes(
    opts: &Options,
    side: &mut Side,
    client: bool,
    mut out: Option<&mut Output>,
) -> Result<(), PerfError> {
    crate::perf::idle::set_timeout(opts.idle_timeout);
    let verb = opts.test.verb();
    let lat = opts.test.is_lat();
    if verb == Verb::Send && (lat || !client) {
        let count = if lat {
            opts.rx_depth.min(64)
        } else {
            opts.rx_depth
        };
        bw::prepost_receives(side, count)?;
    }
    if let Some(o) = out.as_deref_mut() {
        o.start(opts, side);
    }
    let qps = side.qps.len() as u64;
    for (si, &size) in opts.sizes.iter().enumerate() {
        let tag = 2 * si as u32;
        // --check: send_bw's server compares every message with the pattern as it arrives.
        let check = opts.check.then_some((opts.test.name(), si));
        // Requests the client ran this size on all QPs, warm-up included (latency tests:
        // on the first QP), and the messages a send_bw server received.
        let mut ops = (opts.warmup + opts.iters) * if lat { 1 } else { qps };
        let mut received = 0u64;
        let mut server_bw: Option<BwStats> = None;
        // Prepare this size's memory before the start barrier: the peer touches nothing
        // of ours until then.
        for qi in 0..qps {
            let base = qi * side.res.stride;
            let half = side.res.half;
            let clear = vec![0u8; 8];
            side.res
                .buf
                .write_at(base + half, &clear)
                .map_err(PerfError::engine("clearing the buffer"))?;
            if size >= 8 {
                side.res
                    .buf
                    .write_at(base + half + size - 8, &clear)
                    .map_err(PerfError::engine("clearing the buffer"))?;
            }
            if verb != Verb::Atomic && (client || verb == Verb::Read || lat || opts.bidirectional) {
                fill_pattern(side, base, size, si)?;
            }
        }
        let mut watch = IdleWatch::new(&side.res.ctx, "waiting for the start of a size");
        let ctx = &side.res.ctx;
        side.ctl.barrier(tag, 0, || watch.check(ctx))?;
        if client {
            let o = out.as_deref_mut().expect("the client side has an output");
            if let (true, Some(Timed::Duration { secs, margin })) = (lat, opts.timed) {
                ops = timed_lat_client(opts, side, size, tag, secs, margin, o)?;
            } else if lat {
                lat::client(side, opts, size, 0, opts.warmup, None, &mut o.quiet)?;
                o.rec.reset();
                o.rec.start_intervals(size);
                o.note_measure_start();
                let mut prog = Progress::new(
                    format!("{} {} B", opts.test.name(), size),
                    opts.iters,
                    opts.progress_after,
                    true,
                );
                lat::client(
                    side,
                    opts,
                    size,
                    opts.warmup,
                    opts.iters,
                    Some(&mut o.rec),
                    &mut prog,
                )?;
                o.rec.end_intervals();
            } else {
                let (st, n) = measure_bw(opts, side, size, &mut o.quiet, true)?;
                o.bw = st;
                ops = n;
                o.note_measure_start();
            }
        } else if lat && opts.timed.is_some() {
            timed_lat_server(opts, side, size, tag)?;
        } else if lat {
            lat::server(side, opts, size, 0, opts.warmup + opts.iters)?;
        } else if opts.bidirectional {
            // -b: the server runs the same requests towards the client.
            let mut quiet = Progress::new(String::new(), 1, 0, false);
            server_bw = Some(measure_bw(opts, side, size, &mut quiet, false)?.0);
        } else if verb == Verb::Send {
            let per_qp = opts.timed.is_none().then_some(opts.warmup + opts.iters);
            if opts.warmup > 0 && per_qp.is_none() {
                bw::send_server(side, size, Some(opts.warmup), check)?;
            }
            received = bw::send_server(side, size, per_qp, check)?;
        }
        // End of the size: the client says it is done; only then does the server look at
        // what arrived, and it answers with its verdict.
        if !client {
            let mut watch = IdleWatch::new(&side.res.ctx, "waiting for the client's measurement");
            let ctx = &side.res.ctx;
            let client_ops = side.ctl.wait(tag + 1, || watch.check(ctx))?;
            if verb == Verb::Send && opts.timed.is_some() && !lat {
                let sent = client_ops.saturating_sub(opts.warmup * qps);
                if received != sent {
                    return Err(PerfError::Check(format!(
                        "received {received} messages; the client completed {sent}"
                    )));
                }
            }
            let status = server_check(opts, side, size, si)?;
            side.ctl.send(tag + 1, status)?;
            if let Some(b) = server_bw {
                // -b: this side's figures, for the client to add to its own.
                side.ctl.send(tag + 1, b.avg_bytes_per_sec.to_bits())?;
                side.ctl.send(tag + 1, b.peak_bytes_per_sec.to_bits())?;
                side.ctl.send(tag + 1, b.messages)?;
            }
        } else {
            let mut watch = IdleWatch::new(&side.res.ctx, "waiting for the server's check");
            let ctx = &side.res.ctx;
            let peer_status = side.ctl.barrier(tag + 1, ops, || watch.check(ctx))?;
            client_check(opts, side, size, si, peer_status, ops)?;
            if opts.bidirectional {
                let mut peer = [0u64; 3];
                for v in &mut peer {
                    let mut watch =
                        IdleWatch::new(&side.res.ctx, "waiting for the server's figures");
                    let ctx = &side.res.ctx;
                    *v = side.ctl.wait(tag + 1, || watch.check(ctx))?;
                }
                // What the server's requests brought here must be its pattern too.
                if let Some(off) = crate::perf::check::check_own_half(opts, side, size, si)? {
                    return Err(PerfError::Check(format!(
                        "the server's {} brought different bytes than it holds, first at offset {off} of {size}",
                        if verb == Verb::Read {
                            "RDMA Reads (of this side)"
                        } else {
                            "RDMA Writes"
                        }
                    )));
                }
                if let Some(o) = out.as_deref_mut() {
                    // perftest adds the two sides' figures.
                    let secs = o.bw.elapsed_ns.max(1) as f64 / 1e9;
                    o.bw.avg_bytes_per_sec += f64::from_bits(peer[0]);
                    o.bw.peak_bytes_per_sec += f64::from_bits(peer[1]);
                    o.bw.messages += peer[2];
                    o.bw.msg_rate_mpps += peer[2] as f64 / secs / 1e6;
                }
            }
            if let Some(o) = out.as_deref_mut() {
                o.row(opts, size);
            }
        }
    }
    // Goodbye: the server waits for it, so neither side closes its connections while the
    // other still expects a message. With --roce each side then says `bye` on its pulse
    // (the client once its goodbye is acknowledged), so that closing it is no failure.
    let fin = 2 * opts.sizes.len() as u32;
    if client {
        side.ctl.send(fin, 0)?;
        side.ctl.settle(Duration::from_secs(2));
        if let Some(p) = &side.pulse {
            p.bye();
        }
    } else {
        let mut watch = IdleWatch::new(&side.res.ctx, "waiting for the client's goodbye");
        let ctx = &side.res.ctx;
        side.ctl.wait(fin, || watch.check(ctx))?;
        if let Some(p) = &side.pulse {
            p.bye();
        }
        side.ctl.settle(Duration::from_millis(100));
    }
    Ok(())
}

/// Iterations of one step of a timed latency run (`-D`): the client tells the server each
/// step's count on the control channel before it runs it, so that the server answers
/// exactly as many, and checks the clock between steps.
const LAT_STEP: u64 = 100;

/// What a timed latency run does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LatStep {
    /// A step outside the margins.
    Unmeasured,
    /// A measured step.
    Measured,
    /// The run is over.
    Stop,
}

/// The next step of a run of `-D secs -f margin` (`secs > 2 * margin`, as the options
/// check), `t` into it with `measured` iterations measured so far: measured between the
/// margins; past `secs`, the end — but never before one step was measured, however slow
/// the machine (a step that starts past the window then is measured).
fn lat_step(t: Duration, secs: u64, margin: u64, measured: u64) -> LatStep {
    let begin = Duration::from_secs(margin);
    let stop = Duration::from_secs(secs.saturating_sub(margin));
    if t >= Duration::from_secs(secs) && measured > 0 {
        LatStep::Stop
    } else if t >= begin && (t < stop || measured == 0) {
        LatStep::Measured
    } else {
        LatStep::Unmeasured
    }
}

/// The client of a timed latency run (`-D secs -f margin`, as perftest's duration mode):
/// steps of [`LAT_STEP`] iterations for `secs` seconds, measuring the steps that start
/// between `margin` and `secs - margin` (and at least one, however slow the machine).
/// Returns the iterations run.
fn timed_lat_client(
    opts: &Options,
    side: &mut Side,
    size: u64,
    tag: u32,
    secs: u64,
    margin: u64,
    o: &mut Output,
) -> Result<u64, PerfError> {
    let start = Instant::now();
    let mut done = 0u64;
    let mut measured = 0u64;
    let mut measuring = false;
    loop {
        let measure = match lat_step(start.elapsed(), secs, margin, measured) {
            LatStep::Stop => break,
            LatStep::Measured => true,
            LatStep::Unmeasured => false,
        };
        if measure && !measuring {
            o.rec.reset();
            o.rec.start_intervals(size);
            o.note_measure_start();
            measuring = true;
        } else if !measure && measuring {
            o.rec.end_intervals();
            measuring = false;
        }
        side.ctl.send(tag, LAT_STEP)?;
        let rec = if measure { Some(&mut o.rec) } else { None };
        lat::client(side, opts, size, done, LAT_STEP, rec, &mut o.quiet)?;
        done += LAT_STEP;
        if measure {
            measured += LAT_STEP;
        }
    }
    if measuring {
        o.rec.end_intervals();
    }
    side.ctl.send(tag, 0)?;
    Ok(done)
}

/// The server of a timed latency run: answers the steps the client announces until it
/// announces none (0). (Reads and Atomics need nothing of the server's application: their
/// steps are announced all the same, and `lat::server` returns at once for them.)
fn timed_lat_server(opts: &Options, side: &mut Side, size: u64, tag: u32) -> Result<(), PerfError> {
    let mut first = 0u64;
    loop {
        let mut watch = IdleWatch::new(&side.res.ctx, "waiting for the client's next iterations");
        let ctx = &side.res.ctx;
        let n = side.ctl.wait(tag, || watch.check(ctx))?;
        if n == 0 {
            return Ok(());
        }
        // The peer's word decides how long this side loops: take only what a step can be.
        if n > LAT_STEP {
            return Err(PerfError::NotPerf(format!(
                "the peer announced a step of {n} iterations (at most {LAT_STEP}); it is not shmhca-perf of this version"
            )));
        }
        lat::server(side, opts, size, first, n)?;
        first += n;
    }
}

/// One side's bandwidth measurement of a size (the client's, and with `-b` the server's
/// too): the warm-up, then the requests by count or by time. Returns the figures and the
/// requests run on all QPs, warm-up included.
fn measure_bw(
    opts: &Options,
    side: &mut Side,
    size: u64,
    quiet: &mut Progress,
    show_progress: bool,
) -> Result<(BwStats, u64), PerfError> {
    let qps = side.qps.len() as u64;
    if opts.warmup > 0 {
        let warm = bw::Run::Count {
            n: opts.warmup,
            clock: None,
        };
        bw::client(side, opts, size, 0, warm, quiet)?;
    }
    let mut prog = Progress::new(
        format!("{} {} B", opts.test.name(), size),
        opts.iters,
        opts.progress_after,
        show_progress && opts.timed.is_none(),
    );
    match opts.timed {
        None => {
            let total = opts.iters * qps;
            let mut clock = BwClock::new(total, bw::checkpoint_every(total, opts));
            let run = bw::Run::Count {
                n: opts.iters,
                clock: Some(&mut clock),
            };
            bw::client(side, opts, size, opts.warmup, run, &mut prog)?;
            let mut st = clock.stats(size, opts.iters, qps as u32);
            if opts.no_peak {
                st.peak_bytes_per_sec = 0.0;
            }
            Ok((st, (opts.warmup + opts.iters) * qps))
        }
        Some(t) => {
            let mut clock = match t {
                Timed::Duration { secs, margin } => {
                    TimedClock::duration(secs, margin, size, qps as u32)
                }
                Timed::Forever { every } => TimedClock::forever(every, size, qps as u32),
            };
            let run = bw::Run::Timed(&mut clock);
            let done = bw::client(side, opts, size, opts.warmup, run, &mut prog)?;
            Ok((clock.stats(), opts.warmup * qps + done))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::perf::setup::in_process_pair;

    /// The server of a timed latency run loops on the step counts its peer announces: a
    /// count above a step is refused before it answers anything, and 0 ends the size.
    #[test]
    fn a_timed_latency_run_measures_between_the_margins_and_at_least_once() {
        let ms = Duration::from_millis;
        let step = |t: u64, measured: u64| lat_step(ms(t), 8, 2, measured);
        assert_eq!(step(0, 0), LatStep::Unmeasured);
        assert_eq!(step(1999, 0), LatStep::Unmeasured);
        assert_eq!(step(2000, 0), LatStep::Measured);
        assert_eq!(step(5999, 100), LatStep::Measured);
        assert_eq!(step(6000, 100), LatStep::Unmeasured);
        assert_eq!(step(7999, 100), LatStep::Unmeasured);
        assert_eq!(step(8000, 100), LatStep::Stop);
        // A machine so slow that no step started inside the window: one is measured.
        assert_eq!(step(6000, 0), LatStep::Measured);
        assert_eq!(step(9000, 0), LatStep::Measured);
        assert_eq!(step(9000, 100), LatStep::Stop);
        // No margin: measured from the start to the end.
        assert_eq!(lat_step(ms(0), 2, 0, 0), LatStep::Measured);
        assert_eq!(lat_step(ms(1999), 2, 0, 100), LatStep::Measured);
        assert_eq!(lat_step(ms(2000), 2, 0, 100), LatStep::Stop);
    }

    #[test]
    fn a_timed_latency_server_takes_no_step_above_a_step() {
        let opts = Options::parse_from(["shmhca-perf", "send_lat", "-D", "2"]).unwrap();
        let (mut a, mut b) = in_process_pair(&opts, (None, None)).unwrap();
        a.ctl.send(0, 0).unwrap();
        timed_lat_server(&opts, &mut b, 2, 0).expect("0 ends the steps");
        a.ctl.send(0, LAT_STEP + 1).unwrap();
        match timed_lat_server(&opts, &mut b, 2, 0) {
            Err(PerfError::NotPerf(m)) => {
                assert!(m.contains(&format!("{} iterations", LAT_STEP + 1)), "{m}");
            }
            other => panic!("expected a refusal of the step, got {other:?}"),
        }
    }
}
