//! The data checks: the pattern each size's buffers are filled with, the server's verdict
//! on what arrived and the client's checks of that verdict (and of what Reads brought).

use crate::perf::error::PerfError;
use crate::perf::opts::{AtomicType, Options, TestKind, Verb};
use crate::perf::setup::Side;

/// A deterministic byte of the data pattern of size index `si`.
#[inline]
fn pattern_byte(si: usize, i: u64) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 9) ^ (si as u64 * 29 + 7)) as u8
}

pub(crate) fn fill_pattern(side: &Side, off: u64, len: u64, si: usize) -> Result<(), PerfError> {
    let mut chunk = vec![0u8; len.min(1 << 16) as usize];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(chunk.len() as u64);
        for (j, b) in chunk[..n as usize].iter_mut().enumerate() {
            *b = pattern_byte(si, done + j as u64);
        }
        side.res
            .buf
            .write_at(off + done, &chunk[..n as usize])
            .map_err(PerfError::engine("filling the buffer"))?;
        // Keep answering the peer meanwhile (inline mode).
        side.res.ctx.progress();
        done += n;
    }
    Ok(())
}

/// The first offset in `[0, len)` of the region at `off` that differs from the pattern.
pub(crate) fn check_pattern(
    side: &Side,
    off: u64,
    len: u64,
    si: usize,
) -> Result<Option<u64>, PerfError> {
    let mut chunk = vec![0u8; len.min(1 << 16) as usize];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(chunk.len() as u64);
        side.res
            .buf
            .read_at(off + done, &mut chunk[..n as usize])
            .map_err(PerfError::engine("reading the buffer"))?;
        if let Some(j) = chunk[..n as usize]
            .iter()
            .enumerate()
            .position(|(j, b)| *b != pattern_byte(si, done + j as u64))
        {
            return Ok(Some(done + j as u64));
        }
        side.res.ctx.progress();
        done += n;
    }
    Ok(None)
}

/// Bytes at the start of a message the data check covers (Write ping-pongs overwrite the
/// last bytes with their iteration marker).
pub(crate) fn checked_len(opts: &Options, size: u64) -> u64 {
    if opts.test == TestKind::WriteLat {
        size - size.min(8)
    } else {
        size
    }
}

/// The server's verdict on what arrived this size, sent to the client: for Atomics the
/// counter(s) (which the client compares with the number of operations), else 0 or
/// 1 + the first offset whose byte differs from the client's pattern.
pub(crate) fn server_check(
    opts: &Options,
    side: &Side,
    size: u64,
    si: usize,
) -> Result<u64, PerfError> {
    let verb = opts.test.verb();
    let qps = if opts.test.is_lat() {
        1
    } else {
        side.qps.len() as u64
    };
    let mut sum = 0u64;
    for qi in 0..qps {
        let at = qi * side.res.stride + side.res.half;
        match verb {
            Verb::Atomic => {
                sum += side
                    .res
                    .buf
                    .load_u64(at)
                    .map_err(PerfError::engine("reading the atomic counter"))?;
            }
            Verb::Send | Verb::Write => {
                if let Some(off) = check_pattern(side, at, checked_len(opts, size), si)? {
                    return Ok(1 + off);
                }
            }
            // -b: the server's own Reads of the client's pattern.
            Verb::Read if opts.bidirectional => {
                if let Some(off) = check_pattern(side, at, size, si)? {
                    return Ok(1 + off);
                }
            }
            Verb::Read => {}
        }
    }
    Ok(sum)
}

/// The client's checks: the server's verdict (for Atomics against `ops`, the operations
/// run on all QPs), and for Reads what landed here.
pub(crate) fn client_check(
    opts: &Options,
    side: &Side,
    size: u64,
    si: usize,
    peer_status: u64,
    ops: u64,
) -> Result<(), PerfError> {
    match opts.test.verb() {
        Verb::Atomic => {
            let expect = ops;
            if peer_status != expect {
                return Err(PerfError::Check(format!(
                    "after {expect} {} operations the server's counters add up to {peer_status}",
                    match opts.atomic {
                        AtomicType::FetchAndAdd => "Fetch and Add",
                        AtomicType::CmpAndSwap => "Compare and Swap",
                    }
                )));
            }
        }
        Verb::Send | Verb::Write => {
            if peer_status != 0 {
                return Err(PerfError::Check(format!(
                    "the server received different bytes than were sent, first at offset {} of {size}",
                    peer_status - 1
                )));
            }
        }
        Verb::Read => {
            let qps = if opts.test.is_lat() {
                1
            } else {
                side.qps.len() as u64
            };
            for qi in 0..qps {
                let at = qi * side.res.stride + side.res.half;
                if let Some(off) = check_pattern(side, at, size, si)? {
                    return Err(PerfError::Check(format!(
                        "RDMA Read on QP {qi} brought different bytes than the server holds, first at offset {off} of {size}"
                    )));
                }
            }
        }
    }
    Ok(())
}

/// With `-b`, the client's check of what the server's requests brought into this side's
/// receive halves (Writes from the server, or Reads of the server's send halves): the
/// first offset that differs from the size's pattern.
pub(crate) fn check_own_half(
    opts: &Options,
    side: &Side,
    size: u64,
    si: usize,
) -> Result<Option<u64>, PerfError> {
    if opts.test.verb() == Verb::Read {
        // A Read test's receive half holds what this side read (checked already).
        return Ok(None);
    }
    for qi in 0..side.qps.len() as u64 {
        let at = qi * side.res.stride + side.res.half;
        if let Some(off) = check_pattern(side, at, checked_len(opts, size), si)? {
            return Ok(Some(off));
        }
    }
    Ok(None)
}
