//! What the two sides of a run agree on, exchanged at connection time as the connection's
//! private data (REQ from the client, REP from the server).
//!
//! ```text
//!  0..8   magic "SHMPERF1"
//!  8..10  version (1)
//! 10      test code        11  atomic type (0 CMP_AND_SWAP, 1 FETCH_AND_ADD)
//! 12      -a (0/1)         13  outstanding Reads/Atomics (-o)
//! 14      timed run: 0 by iterations, 1 -D, 2 --run_infinitely
//! 15      -b (0/1)
//! 16..24  size (-s; the largest size with -a)
//! 24..32  iterations       32..40  warm-up iterations
//! 40..44  tx depth         44..48  rx depth
//! 48..52  PMTU             52..56  max inline
//! 56..60  QPs              60..64  CQ moderation
//! 64..72  buffer address   72..76  buffer R_Key
//! 76..80  -D seconds (0 when by iterations)
//!                          80..88  buffer stride (bytes per QP: send + receive halves)
//! ```
//!
//! Everything is little-endian. The peer's copy is decoded and checked field by field; a
//! peer that is not shmhca-perf (wrong length or magic) or runs other parameters is refused
//! with an error naming what differs.

use shmhca::RemoteAddr;

use crate::perf::error::PerfError;
use crate::perf::opts::{AtomicType, Options, TestKind, Timed};

/// The first eight bytes.
pub const MAGIC: [u8; 8] = *b"SHMPERF1";
/// The encoding's version.
pub const VERSION: u16 = 2;
/// Encoded length.
pub const LEN: usize = 88;

/// The run's parameters as exchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunParams {
    /// Test.
    pub test: TestKind,
    /// Atomic type.
    pub atomic: AtomicType,
    /// `-a`.
    pub all: bool,
    /// `-o`.
    pub outs: u8,
    /// `-s` (largest with `-a`).
    pub size: u64,
    /// `-n`.
    pub iters: u64,
    /// `--warmup`.
    pub warmup: u64,
    /// `-t`.
    pub tx_depth: u32,
    /// `-r`.
    pub rx_depth: u32,
    /// `-m`.
    pub mtu: u32,
    /// `-I`.
    pub inline: u32,
    /// `-q`.
    pub qps: u32,
    /// `-Q`.
    pub cq_mod: u32,
    /// The sender's data buffer (QP i's halves start at `i * stride`).
    pub buf: RemoteAddr,
    /// Bytes per QP in the buffer.
    pub stride: u64,
    /// `-D` / `--run_infinitely`: 0 by iterations, 1 timed, 2 forever.
    pub timed_kind: u8,
    /// `-D` seconds (the interval of `--run_infinitely`), 0 by iterations.
    pub timed_secs: u32,
    /// `-b`.
    pub bidirectional: bool,
}

impl RunParams {
    /// The parameters of `opts` with this side's buffer.
    pub fn new(opts: &Options, buf: RemoteAddr, stride: u64) -> RunParams {
        RunParams {
            test: opts.test,
            atomic: opts.atomic,
            all: opts.all,
            outs: opts.outs,
            size: opts.max_size(),
            iters: opts.iters,
            warmup: opts.warmup,
            tx_depth: opts.tx_depth,
            rx_depth: opts.rx_depth,
            mtu: opts.mtu,
            inline: opts.inline,
            qps: opts.qps,
            cq_mod: opts.cq_mod,
            buf,
            stride,
            timed_kind: match opts.timed {
                None => 0,
                Some(Timed::Duration { .. }) => 1,
                Some(Timed::Forever { .. }) => 2,
            },
            bidirectional: opts.bidirectional,
            timed_secs: match opts.timed {
                None => 0,
                Some(Timed::Duration { secs, .. }) => secs as u32,
                Some(Timed::Forever { every }) => every as u32,
            },
        }
    }

    /// The bytes sent to the peer.
    pub fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&VERSION.to_le_bytes());
        b[10] = self.test.code();
        b[11] = match self.atomic {
            AtomicType::CmpAndSwap => 0,
            AtomicType::FetchAndAdd => 1,
        };
        b[12] = u8::from(self.all);
        b[13] = self.outs;
        b[16..24].copy_from_slice(&self.size.to_le_bytes());
        b[24..32].copy_from_slice(&self.iters.to_le_bytes());
        b[32..40].copy_from_slice(&self.warmup.to_le_bytes());
        b[40..44].copy_from_slice(&self.tx_depth.to_le_bytes());
        b[44..48].copy_from_slice(&self.rx_depth.to_le_bytes());
        b[48..52].copy_from_slice(&self.mtu.to_le_bytes());
        b[52..56].copy_from_slice(&self.inline.to_le_bytes());
        b[56..60].copy_from_slice(&self.qps.to_le_bytes());
        b[60..64].copy_from_slice(&self.cq_mod.to_le_bytes());
        b[64..72].copy_from_slice(&self.buf.addr.to_le_bytes());
        b[72..76].copy_from_slice(&self.buf.rkey.to_le_bytes());
        b[80..88].copy_from_slice(&self.stride.to_le_bytes());
        b[14] = self.timed_kind;
        b[15] = u8::from(self.bidirectional);
        b[76..80].copy_from_slice(&self.timed_secs.to_le_bytes());
        b
    }

    /// Decodes a peer's private data. `who` names the peer in errors (e.g. "the server at
    /// /tmp/x.sock").
    ///
    /// # Errors
    /// [`PerfError::NotPerf`] for bytes that are not shmhca-perf's parameters (wrong
    /// length, magic, version or a field out of range).
    pub fn decode(b: &[u8], who: &str) -> Result<RunParams, PerfError> {
        let not_perf = |why: String| {
            PerfError::NotPerf(format!(
                "{who} is not a shmhca-perf peer ({why}); start `shmhca-perf TEST --server PATH` there"
            ))
        };
        if b.len() != LEN || b[0..8] != MAGIC {
            return Err(not_perf(format!(
                "its connection private data is {} bytes{}",
                b.len(),
                if b.len() >= 8 && b[0..8] != MAGIC {
                    ", not starting with SHMPERF1"
                } else {
                    ""
                }
            )));
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if version != VERSION {
            return Err(not_perf(format!(
                "it speaks parameter version {version}, this build speaks {VERSION}"
            )));
        }
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(x)
        };
        let test = TestKind::from_code(b[10])
            .ok_or_else(|| not_perf(format!("unknown test code {}", b[10])))?;
        let atomic = match b[11] {
            0 => AtomicType::CmpAndSwap,
            1 => AtomicType::FetchAndAdd,
            x => return Err(not_perf(format!("unknown atomic type {x}"))),
        };
        let all = match b[12] {
            0 => false,
            1 => true,
            x => return Err(not_perf(format!("-a flag byte {x}"))),
        };
        if b[15] > 1 {
            return Err(not_perf(format!("-b flag byte {}", b[15])));
        }
        if b[14] > 2 {
            return Err(not_perf(format!("timed-run byte {}", b[14])));
        }
        Ok(RunParams {
            test,
            atomic,
            all,
            outs: b[13],
            size: u64_at(16),
            iters: u64_at(24),
            warmup: u64_at(32),
            tx_depth: u32_at(40),
            rx_depth: u32_at(44),
            mtu: u32_at(48),
            inline: u32_at(52),
            qps: u32_at(56),
            cq_mod: u32_at(60),
            buf: RemoteAddr {
                addr: u64_at(64),
                rkey: u32_at(72),
            },
            stride: u64_at(80),
            timed_kind: b[14],
            bidirectional: b[15] == 1,
            timed_secs: u32_at(76),
        })
    }

    /// Checks that the peer's parameters match ours.
    ///
    /// # Errors
    /// [`PerfError::Mismatch`] listing every parameter that differs, with both values.
    pub fn check_peer(&self, peer: &RunParams) -> Result<(), PerfError> {
        let mut diffs: Vec<String> = Vec::new();
        let mut cmp = |name: &str, mine: String, theirs: String| {
            if mine != theirs {
                diffs.push(format!("{name} is {mine} here but {theirs} at the peer"));
            }
        };
        cmp("the test", self.test.name().into(), peer.test.name().into());
        if matches!(self.test.verb(), crate::perf::opts::Verb::Atomic) {
            cmp("-A", self.atomic.name().into(), peer.atomic.name().into());
        }
        cmp("-a", self.all.to_string(), peer.all.to_string());
        cmp("-s", self.size.to_string(), peer.size.to_string());
        cmp("-n", self.iters.to_string(), peer.iters.to_string());
        cmp("--warmup", self.warmup.to_string(), peer.warmup.to_string());
        cmp("-t", self.tx_depth.to_string(), peer.tx_depth.to_string());
        cmp("-r", self.rx_depth.to_string(), peer.rx_depth.to_string());
        cmp("-m", self.mtu.to_string(), peer.mtu.to_string());
        cmp("-I", self.inline.to_string(), peer.inline.to_string());
        cmp("-q", self.qps.to_string(), peer.qps.to_string());
        cmp("-Q", self.cq_mod.to_string(), peer.cq_mod.to_string());
        let timed = |k: u8, secs: u32| match k {
            0 => "off".to_string(),
            1 => format!("-D {secs}"),
            _ => format!("--run_infinitely (every {secs} s)"),
        };
        cmp(
            "-b",
            self.bidirectional.to_string(),
            peer.bidirectional.to_string(),
        );
        cmp(
            "the timed run",
            timed(self.timed_kind, self.timed_secs),
            timed(peer.timed_kind, peer.timed_secs),
        );
        cmp("-o", self.outs.to_string(), peer.outs.to_string());
        cmp(
            "the buffer stride",
            self.stride.to_string(),
            peer.stride.to_string(),
        );
        if diffs.is_empty() {
            Ok(())
        } else {
            Err(PerfError::Mismatch(diffs.join("; ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RunParams {
        let opts = Options::parse_from(["shmhca-perf", "write_bw", "-s", "4096", "-q", "3"])
            .expect("options");
        RunParams::new(
            &opts,
            RemoteAddr {
                addr: 0x7f00_1234_0000,
                rkey: 0x42,
            },
            8192,
        )
    }

    #[test]
    fn round_trip() {
        let p = sample();
        assert_eq!(RunParams::decode(&p.encode(), "peer").unwrap(), p);
    }

    #[test]
    fn foreign_bytes_are_not_perf() {
        let e = RunParams::decode(b"hello", "the server at /x").unwrap_err();
        assert!(e.to_string().contains("not a shmhca-perf peer"), "{e}");
        let mut b = sample().encode();
        b[0] = b'X';
        assert!(matches!(
            RunParams::decode(&b, "p"),
            Err(PerfError::NotPerf(_))
        ));
        let mut b = sample().encode();
        b[8] = 9;
        let e = RunParams::decode(&b, "p").unwrap_err().to_string();
        assert!(e.contains("version 9") && e.contains("speaks 2"), "{e}");
        let mut b = sample().encode();
        b[10] = 200;
        assert!(RunParams::decode(&b, "p").is_err());
        let mut b = sample().encode();
        b[15] = 2;
        assert!(RunParams::decode(&b, "p").is_err());
        let mut b = sample().encode();
        b[14] = 3;
        assert!(RunParams::decode(&b, "p").is_err());
    }

    #[test]
    fn mismatches_are_listed() {
        let a = sample();
        let mut b = a;
        b.size = 8;
        b.qps = 1;
        b.buf.addr = 0; // buffers differ by nature
        let e = a.check_peer(&b).unwrap_err().to_string();
        assert!(e.contains("-s is 4096 here but 8 at the peer"), "{e}");
        assert!(e.contains("-q is 3 here but 1 at the peer"), "{e}");
        assert!(
            a.check_peer(&{
                let mut c = a;
                c.buf.rkey = 7;
                c
            })
            .is_ok()
        );
    }
}
