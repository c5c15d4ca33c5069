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
            // With --check, latency tests checked every iteration's own pattern already
            // (the buffers hold the last iteration's, not the size's).
            Verb::Send | Verb::Write if opts.check && opts.test.is_lat() => {}
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
    // (Testing only: expect another size's pattern, to show that the check fails.)
    let si = si + usize::from(opts.check_expect_wrong);
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

/// `--check`: the byte at offset `j` of iteration `i`'s payload of size index `si` (each
/// iteration's bytes differ, so a message delivered twice, late or out of order is caught).
#[inline]
pub(crate) fn iter_byte(si: usize, i: u64, j: u64) -> u8 {
    pattern_byte(si, j) ^ (i as u8).wrapping_mul(0x9D) ^ (i >> 8) as u8 ^ 0x5A
}

/// `--check`: per-iteration payloads and their checks, with a scratch buffer made before
/// the loop.
pub(crate) struct IterCheck {
    /// The test's name, for messages.
    test: &'static str,
    si: usize,
    /// The size index the checks expect (differs from `si` under `--check-expect-wrong`).
    expect_si: usize,
    scratch: Vec<u8>,
}

impl IterCheck {
    /// Checks for size `size` of `opts`; `None` without `--check`. `client` says whether
    /// this is the side `--check-expect-wrong` misleads.
    pub(crate) fn new(opts: &Options, size: u64, client: bool) -> Option<IterCheck> {
        if !opts.check {
            return None;
        }
        let si = opts.sizes.iter().position(|&s| s == size).unwrap_or(0);
        Some(IterCheck {
            test: opts.test.name(),
            si,
            expect_si: if client && opts.check_expect_wrong {
                si + 1
            } else {
                si
            },
            scratch: vec![0u8; size as usize],
        })
    }

    /// Iteration `i`'s payload, `len` bytes, into `dst`.
    pub(crate) fn fill(&self, i: u64, dst: &mut [u8]) {
        for (j, b) in dst.iter_mut().enumerate() {
            *b = iter_byte(self.si, i, j as u64);
        }
    }

    /// Writes iteration `i`'s payload (`len` bytes) at `off` of `buf`.
    pub(crate) fn write(
        &mut self,
        buf: &shmhca::Mr,
        off: u64,
        len: u64,
        i: u64,
    ) -> Result<(), PerfError> {
        let mut s = std::mem::take(&mut self.scratch);
        self.fill(i, &mut s[..len as usize]);
        let r = buf
            .write_at(off, &s[..len as usize])
            .map_err(PerfError::engine("writing the --check payload"));
        self.scratch = s;
        r
    }

    /// Checks that `len` bytes at `off` of `buf` are iteration `i`'s payload (`what` says
    /// which; `expect(j)`, when given, overrides the expected byte at offset `j`).
    pub(crate) fn verify(
        &mut self,
        buf: &shmhca::Mr,
        off: u64,
        len: u64,
        i: u64,
        what: &str,
        expect: Option<&dyn Fn(u64) -> u8>,
    ) -> Result<(), PerfError> {
        let got = &mut self.scratch[..len as usize];
        buf.read_at(off, got)
            .map_err(PerfError::engine("reading the --check payload"))?;
        let si = self.expect_si;
        let want = |j: u64| expect.map_or_else(|| iter_byte(si, i, j), |f| f(j));
        if let Some((j, b)) = got.iter().enumerate().find(|(j, b)| **b != want(*j as u64)) {
            return Err(PerfError::Check(format!(
                "{}: iteration {i}: {what}: byte at offset {j} of {len} is {b:#04x}, expected {:#04x}",
                self.test,
                want(j as u64)
            )));
        }
        Ok(())
    }

    /// Zeroes `len` bytes at `off` of `buf`.
    pub(crate) fn clear(&mut self, buf: &shmhca::Mr, off: u64, len: u64) -> Result<(), PerfError> {
        self.scratch[..len as usize].fill(0);
        buf.write_at(off, &self.scratch[..len as usize])
            .map_err(PerfError::engine("clearing the --check buffer"))
    }

    /// Checks that a completion is the one expected next.
    pub(crate) fn order(&self, i: u64, got: u64, what: &str) -> Result<(), PerfError> {
        if got == i {
            return Ok(());
        }
        Err(PerfError::Check(format!(
            "{}: iteration {i}: {what} completed with wr_id {got}, expected {i} (completions out of order, lost or repeated)",
            self.test
        )))
    }

    /// The size index payloads are made from.
    pub(crate) fn size_index(&self) -> usize {
        self.si
    }

    /// The size index the checks expect.
    pub(crate) fn expect_index(&self) -> usize {
        self.expect_si
    }
}

/// The byte at offset `j` of the pattern of size index `si` (what [`fill_pattern`] writes).
pub(crate) fn static_byte(si: usize, j: u64) -> u8 {
    pattern_byte(si, j)
}
