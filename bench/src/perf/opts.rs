//! The command line: perftest's flags where they apply to shmhca, and the checks that turn
//! a bad value into an error naming the flag, the value and what is allowed.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Parser, ValueEnum};

use crate::perf::error::PerfError;

/// perftest's largest `-a` size (2^23 bytes).
pub const MAX_ALL_SIZE: u64 = 1 << 23;
/// The largest `-s` shmhca-perf accepts (1 GiB; the arena holds two buffers per QP).
pub const MAX_SIZE: u64 = 1 << 30;
/// The most bytes of arena shmhca-perf asks for on one side.
pub const MAX_ARENA: u64 = 4 << 30;
/// perftest's iteration bounds.
pub const MIN_ITERS: u64 = 5;
/// perftest's iteration bounds.
pub const MAX_ITERS: u64 = 100_000_000;
/// The deepest send or receive queue (the engine's limit).
pub const MAX_DEPTH: u32 = shmhca::qp::MAX_QUEUE_DEPTH;
/// The most QPs of one run.
pub const MAX_QPS: u32 = 1024;
/// The most inline bytes (the engine's limit).
pub const MAX_INLINE: u32 = shmhca::qp::MAX_INLINE_DATA;

/// The eight tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum TestKind {
    /// Send/Receive ping-pong; one-way latency.
    #[value(name = "send_lat")]
    SendLat,
    /// RDMA Write ping-pong polling the buffer's last bytes; one-way latency.
    #[value(name = "write_lat")]
    WriteLat,
    /// RDMA Read round trips.
    #[value(name = "read_lat")]
    ReadLat,
    /// Atomic round trips.
    #[value(name = "atomic_lat")]
    AtomicLat,
    /// Send bandwidth.
    #[value(name = "send_bw")]
    SendBw,
    /// RDMA Write bandwidth.
    #[value(name = "write_bw")]
    WriteBw,
    /// RDMA Read bandwidth.
    #[value(name = "read_bw")]
    ReadBw,
    /// Atomic bandwidth.
    #[value(name = "atomic_bw")]
    AtomicBw,
}

/// The operation a test measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verb {
    /// Send.
    Send,
    /// RDMA Write.
    Write,
    /// RDMA Read.
    Read,
    /// Atomic.
    Atomic,
}

impl TestKind {
    /// Every test, in perftest's order.
    pub const ALL: [TestKind; 8] = [
        TestKind::SendLat,
        TestKind::WriteLat,
        TestKind::ReadLat,
        TestKind::AtomicLat,
        TestKind::SendBw,
        TestKind::WriteBw,
        TestKind::ReadBw,
        TestKind::AtomicBw,
    ];

    /// The test's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            TestKind::SendLat => "send_lat",
            TestKind::WriteLat => "write_lat",
            TestKind::ReadLat => "read_lat",
            TestKind::AtomicLat => "atomic_lat",
            TestKind::SendBw => "send_bw",
            TestKind::WriteBw => "write_bw",
            TestKind::ReadBw => "read_bw",
            TestKind::AtomicBw => "atomic_bw",
        }
    }

    /// A small number identifying the test in the parameter exchange.
    pub fn code(self) -> u8 {
        TestKind::ALL
            .iter()
            .position(|t| *t == self)
            .map_or(0xff, |i| i as u8)
    }

    /// The test of [`TestKind::code`].
    pub fn from_code(code: u8) -> Option<TestKind> {
        TestKind::ALL.get(usize::from(code)).copied()
    }

    /// Whether it is a latency test.
    pub fn is_lat(self) -> bool {
        matches!(
            self,
            TestKind::SendLat | TestKind::WriteLat | TestKind::ReadLat | TestKind::AtomicLat
        )
    }

    /// The operation it measures.
    pub fn verb(self) -> Verb {
        match self {
            TestKind::SendLat | TestKind::SendBw => Verb::Send,
            TestKind::WriteLat | TestKind::WriteBw => Verb::Write,
            TestKind::ReadLat | TestKind::ReadBw => Verb::Read,
            TestKind::AtomicLat | TestKind::AtomicBw => Verb::Atomic,
        }
    }
}

/// perftest's `-A`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Default)]
pub enum AtomicType {
    /// Compare and Swap.
    #[value(name = "CMP_AND_SWAP")]
    CmpAndSwap,
    /// Fetch and Add (perftest's default).
    #[default]
    #[value(name = "FETCH_AND_ADD")]
    FetchAndAdd,
}

impl AtomicType {
    /// perftest's spelling.
    pub fn name(self) -> &'static str {
        match self {
            AtomicType::CmpAndSwap => "CMP_AND_SWAP",
            AtomicType::FetchAndAdd => "FETCH_AND_ADD",
        }
    }
}

/// perftest's `--output`: print only one number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputOnly {
    /// Average bandwidth (bandwidth tests).
    #[value(name = "bandwidth")]
    Bandwidth,
    /// Message rate in Mpps (bandwidth tests).
    #[value(name = "message_rate")]
    MessageRate,
    /// Typical (median) latency in µs (latency tests).
    #[value(name = "latency", alias = "latency_typical")]
    Latency,
}

/// How the engine runs (`--mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// Each process drives its engine from its polling loop.
    #[value(name = "inline")]
    Inline,
    /// A pinned engine thread polls without pause.
    #[value(name = "poll")]
    Poll,
}

/// The raw command line.
#[derive(Debug, Parser)]
#[command(
    name = "shmhca-perf",
    version,
    about = "perftest's latency and bandwidth tests over shmhca (RC between processes over shared memory)",
    after_help = "With no --server/--client, shmhca-perf starts its peer process itself (pinned to another core) and prints the result.\nFor two terminals: `shmhca-perf TEST --server PATH` then `shmhca-perf TEST --client PATH` with the same flags."
)]
pub struct Cli {
    /// The test: send_lat, write_lat, read_lat, atomic_lat, send_bw, write_bw, read_bw or atomic_bw.
    #[arg(value_enum, value_name = "TEST")]
    pub test_pos: Option<TestKind>,
    /// The test, perftest-style (same as the positional argument).
    #[arg(long = "test", value_enum)]
    pub test: Option<TestKind>,
    /// Message size in bytes (default 2 for latency, 65536 for bandwidth, 8 for atomics).
    #[arg(short = 's', long = "size")]
    pub size: Option<u64>,
    /// Iterations (measured; per QP for bandwidth tests). Default 1000, 5000 for write_bw.
    #[arg(short = 'n', long = "iters")]
    pub iters: Option<u64>,
    /// Run every size from 2 to 2^23 bytes.
    #[arg(short = 'a', long = "all")]
    pub all: bool,
    /// Largest message sent inline (default 236 for send_lat, 220 for write_lat, 0 otherwise).
    #[arg(short = 'I', long = "inline_size")]
    pub inline: Option<u32>,
    /// Send queue depth: requests kept outstanding by bandwidth tests (default 128).
    #[arg(short = 't', long = "tx-depth")]
    pub tx_depth: Option<u32>,
    /// Receive queue depth of Send tests (default 512).
    #[arg(short = 'r', long = "rx-depth")]
    pub rx_depth: Option<u32>,
    /// Number of QPs (bandwidth tests round-robin over them; latency uses the first).
    #[arg(short = 'q', long = "qp")]
    pub qps: Option<u32>,
    /// Path MTU: 256, 512, 1024, 2048 or 4096 (default 4096).
    #[arg(short = 'm', long = "mtu")]
    pub mtu: Option<u32>,
    /// Atomic operation of atomic tests.
    #[arg(short = 'A', long = "atomic_type", value_enum)]
    pub atomic_type: Option<AtomicType>,
    /// Print every latency sample after the table.
    #[arg(short = 'H', long = "report-histogram")]
    pub histogram: bool,
    /// Report bandwidth in Gbit/s instead of MiB/s.
    #[arg(long = "report_gbits")]
    pub report_gbits: bool,
    /// Print only this figure.
    #[arg(long = "output", value_enum)]
    pub output: Option<OutputOnly>,
    /// Request a completion every this many sends (perftest's CQ moderation; default 100).
    #[arg(short = 'Q', long = "cq-mod")]
    pub cq_mod: Option<u32>,
    /// Post this many work requests per doorbell in bandwidth tests (default 32).
    #[arg(short = 'l', long = "post_list")]
    pub post_list: Option<u32>,
    /// Outstanding RDMA Reads/Atomics per QP (initiator depth, 1 to 16; default 16).
    #[arg(short = 'o', long = "outs")]
    pub outs: Option<u8>,
    /// Unmeasured iterations before each measurement (default 2000 for latency, 10 windows for bandwidth).
    #[arg(long = "warmup")]
    pub warmup: Option<u64>,
    /// Write every figure, the parameters, the machine and RSS to this JSON file.
    #[arg(long = "json", value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write HdrHistogram's percentile distribution (.hgrm text) of latency tests to FILE.
    #[arg(long = "hgrm", value_name = "FILE")]
    pub hgrm: Option<PathBuf>,
    /// Run the server side, listening on this Unix socket path.
    #[arg(long = "server", value_name = "PATH", conflicts_with = "client")]
    pub server: Option<PathBuf>,
    /// Run the client side, connecting to the server at this Unix socket path.
    #[arg(long = "client", value_name = "PATH")]
    pub client: Option<PathBuf>,
    /// Run both sides in this process on two threads, linked directly (no connection manager).
    #[arg(long = "in-process", conflicts_with_all = ["server", "client"])]
    pub in_process: bool,
    /// Engine mode (default: inline on machines with fewer than 4 cores, else poll).
    #[arg(long = "mode", value_enum)]
    pub mode: Option<ModeArg>,
    /// Cores for this process and its peer: `A[,B]` (with no role: A for the client, B for the server).
    #[arg(long = "cpu", value_name = "A[,B]")]
    pub cpu: Option<String>,
    /// Cores for the poll-mode engine threads: `C[,D]` (this process's, the peer's).
    #[arg(long = "engine-cpu", value_name = "C[,D]")]
    pub engine_cpu: Option<String>,
    /// Show progress on stderr once a measurement has run this many seconds (default 2).
    #[arg(long = "progress-after", value_name = "SECONDS")]
    pub progress_after: Option<u64>,
    /// Seconds to wait for the peer to connect (default 10).
    #[arg(long = "connect-timeout", value_name = "SECONDS")]
    pub connect_timeout: Option<u64>,
    /// End with an error when the peer has sent nothing for this many seconds (it is
    /// stopped or hung); 0 waits forever. Default 10.
    #[arg(long = "idle-timeout", value_name = "SECONDS")]
    pub idle_timeout: Option<u64>,
    /// Internal: this process is the server started by a client (exits with its parent).
    #[arg(long = "spawned", hide = true)]
    pub spawned: bool,
}

/// Which side this process runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Start the peer process and run the client side.
    SelfSpawn,
    /// Both sides in this process.
    InProcess,
    /// The server side, listening on a path.
    Server(PathBuf),
    /// The client side, connecting to a path.
    Client(PathBuf),
}

/// Validated options.
#[derive(Debug, Clone)]
pub struct Options {
    /// The test.
    pub test: TestKind,
    /// Message sizes, in run order.
    pub sizes: Vec<u64>,
    /// Whether `-a` was given.
    pub all: bool,
    /// Measured iterations per size (per QP for bandwidth).
    pub iters: u64,
    /// Unmeasured iterations before each size.
    pub warmup: u64,
    /// Max inline size.
    pub inline: u32,
    /// Send queue depth.
    pub tx_depth: u32,
    /// Receive queue depth.
    pub rx_depth: u32,
    /// QPs.
    pub qps: u32,
    /// Path MTU in bytes.
    pub mtu: u32,
    /// Atomic operation.
    pub atomic: AtomicType,
    /// Completion every this many sends.
    pub cq_mod: u32,
    /// Work requests per doorbell.
    pub post_list: u32,
    /// Initiator depth.
    pub outs: u8,
    /// `-H`.
    pub histogram: bool,
    /// `--report_gbits`.
    pub gbits: bool,
    /// `--output`.
    pub output: Option<OutputOnly>,
    /// `--json`.
    pub json: Option<PathBuf>,
    /// `--hgrm`.
    pub hgrm: Option<PathBuf>,
    /// The role.
    pub role: Role,
    /// Engine mode.
    pub mode: ModeArg,
    /// `--cpu` list.
    pub cpus: Vec<usize>,
    /// `--engine-cpu` list.
    pub engine_cpus: Vec<usize>,
    /// Seconds to wait for the peer.
    pub connect_timeout: u64,
    /// Seconds of a measurement before progress is shown.
    pub progress_after: u64,
    /// Started by a client.
    pub spawned: bool,
    /// `--idle-timeout` (`None`: wait forever).
    pub idle_timeout: Option<std::time::Duration>,
}

impl Options {
    /// Parses and checks a command line (`args` includes the program name).
    ///
    /// # Errors
    /// [`PerfError::Usage`] naming the flag and what is allowed; [`PerfError::Clap`] for
    /// what clap itself rejects (and for `--help`/`--version`, which the caller prints).
    pub fn parse_from<I, T>(args: I) -> Result<Options, PerfError>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let cli = Cli::try_parse_from(args).map_err(PerfError::Clap)?;
        Options::from_cli(cli)
    }

    /// Checks the parsed command line.
    ///
    /// # Errors
    /// [`PerfError::Usage`] naming the first bad flag.
    pub fn from_cli(cli: Cli) -> Result<Options, PerfError> {
        let test = match (cli.test_pos, cli.test) {
            (Some(a), Some(b)) if a != b => {
                return Err(usage(format!(
                    "two different tests given: `{}` and `--test {}`; give one",
                    a.name(),
                    b.name()
                )));
            }
            (Some(t), _) | (None, Some(t)) => t,
            (None, None) => {
                return Err(usage(
                    "no test given: name one of send_lat, write_lat, read_lat, atomic_lat, send_bw, write_bw, read_bw, atomic_bw (e.g. `shmhca-perf send_lat -s 8`)",
                ));
            }
        };
        let verb = test.verb();
        let lat = test.is_lat();
        if verb == Verb::Atomic {
            if let Some(s) = cli.size.filter(|s| *s != 8) {
                return Err(usage(format!(
                    "-s {s}: atomic tests always move 8 bytes; leave -s out"
                )));
            }
            if cli.all {
                return Err(usage("-a: atomic tests always move 8 bytes; leave -a out"));
            }
        } else if cli.atomic_type.is_some() {
            return Err(usage(format!(
                "-A applies to atomic_lat and atomic_bw, not {}",
                test.name()
            )));
        }
        let sizes = if cli.all {
            (1..=23).map(|e| 1u64 << e).collect()
        } else {
            let default = match (verb, lat) {
                (Verb::Atomic, _) => 8,
                (_, true) => 2,
                (_, false) => 65536,
            };
            let s = cli.size.unwrap_or(default);
            if s == 0 || s > MAX_SIZE {
                return Err(usage(format!(
                    "-s {s}: the message size must be 1 to {MAX_SIZE} bytes"
                )));
            }
            vec![s]
        };
        let iters = cli.iters.unwrap_or(if test == TestKind::WriteBw {
            5000
        } else {
            1000
        });
        if !(MIN_ITERS..=MAX_ITERS).contains(&iters) {
            return Err(usage(format!(
                "-n {iters}: iterations must be {MIN_ITERS} to {MAX_ITERS}"
            )));
        }
        let depth = |flag: &str, v: u32| -> Result<u32, PerfError> {
            if v == 0 || v > MAX_DEPTH {
                Err(usage(format!(
                    "{flag} {v}: the queue depth must be 1 to {MAX_DEPTH}"
                )))
            } else {
                Ok(v)
            }
        };
        let tx_depth = depth("-t", cli.tx_depth.unwrap_or(128))?;
        let rx_depth = depth("-r", cli.rx_depth.unwrap_or(512))?;
        let qps = cli.qps.unwrap_or(1);
        if qps == 0 || qps > MAX_QPS {
            return Err(usage(format!(
                "-q {qps}: the number of QPs must be 1 to {MAX_QPS}"
            )));
        }
        if lat && qps != 1 && !cli.spawned {
            eprintln!(
                "shmhca-perf: note: -q {qps}: latency tests measure on the first QP only (as perftest)"
            );
        }
        let mtu = cli.mtu.unwrap_or(4096);
        if shmhca::Mtu::from_bytes(mtu).is_err() {
            return Err(usage(format!(
                "-m {mtu}: not a PMTU; use 256, 512, 1024, 2048 or 4096"
            )));
        }
        let inline_default = match test {
            TestKind::SendLat => 236,
            TestKind::WriteLat => 220,
            _ => 0,
        };
        let inline = cli.inline.unwrap_or(inline_default);
        if inline > MAX_INLINE {
            return Err(usage(format!(
                "-I {inline}: at most {MAX_INLINE} bytes can be sent inline"
            )));
        }
        if inline > 0 && matches!(verb, Verb::Read | Verb::Atomic) && cli.inline.is_some() {
            return Err(usage(format!(
                "-I {inline}: RDMA Reads and Atomics carry no data to inline"
            )));
        }
        let cq_mod = cli.cq_mod.unwrap_or(100);
        if cq_mod == 0 || cq_mod > 1024 {
            return Err(usage(format!(
                "-Q {cq_mod}: the CQ moderation must be 1 to 1024"
            )));
        }
        // As perftest: never wait for more completions than the queue holds.
        let cq_mod = cq_mod.min(tx_depth);
        let post_list = cli.post_list.unwrap_or(32);
        if post_list == 0 || post_list > MAX_DEPTH {
            return Err(usage(format!(
                "-l {post_list}: the post list must be 1 to {MAX_DEPTH}"
            )));
        }
        let post_list = post_list.min(tx_depth);
        let outs = cli.outs.unwrap_or(16);
        if outs == 0 || outs > shmhca::qp::MAX_RD_ATOMIC {
            return Err(usage(format!(
                "-o {outs}: outstanding Reads/Atomics must be 1 to {}",
                shmhca::qp::MAX_RD_ATOMIC
            )));
        }
        let warmup = cli
            .warmup
            .unwrap_or(if lat { 2000 } else { 10 * u64::from(tx_depth) });
        if warmup > MAX_ITERS {
            return Err(usage(format!(
                "--warmup {warmup}: at most {MAX_ITERS} iterations"
            )));
        }
        let max_size = *sizes.last().unwrap_or(&8);
        let arena = arena_bytes(max_size, qps, tx_depth, inline);
        if arena > MAX_ARENA {
            return Err(usage(format!(
                "-s {max_size} with -q {qps} needs {arena} bytes of arena (two buffers per QP), above the {MAX_ARENA} bytes shmhca-perf allocates at most: lower -s or -q"
            )));
        }
        match cli.output {
            Some(OutputOnly::Latency) if !lat => {
                return Err(usage(format!(
                    "--output=latency applies to latency tests, not {}; use bandwidth or message_rate",
                    test.name()
                )));
            }
            Some(OutputOnly::Bandwidth | OutputOnly::MessageRate) if lat => {
                return Err(usage(format!(
                    "--output=bandwidth/message_rate apply to bandwidth tests, not {}; use latency",
                    test.name()
                )));
            }
            _ => {}
        }
        if (cli.histogram || cli.hgrm.is_some()) && !lat {
            return Err(usage(format!(
                "-H and --hgrm apply to latency tests, not {}",
                test.name()
            )));
        }
        if cli.report_gbits && lat {
            return Err(usage(format!(
                "--report_gbits applies to bandwidth tests, not {}",
                test.name()
            )));
        }
        let role = match (cli.server, cli.client, cli.in_process) {
            (Some(p), None, false) => Role::Server(p),
            (None, Some(p), false) => Role::Client(p),
            (None, None, true) => Role::InProcess,
            (None, None, false) => Role::SelfSpawn,
            _ => {
                return Err(usage(
                    "give at most one of --server, --client, --in-process",
                ));
            }
        };
        if cli.spawned && !matches!(role, Role::Server(_)) {
            return Err(usage("--spawned is internal and needs --server"));
        }
        let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpus = parse_cpus("--cpu", cli.cpu.as_deref(), ncpu)?;
        let engine_cpus = parse_cpus("--engine-cpu", cli.engine_cpu.as_deref(), ncpu)?;
        let mode = cli.mode.unwrap_or(
            if shmhca::EngineMode::default_for_this_machine() == shmhca::EngineMode::Inline {
                ModeArg::Inline
            } else {
                ModeArg::Poll
            },
        );
        if mode == ModeArg::Inline && !engine_cpus.is_empty() {
            return Err(usage(
                "--engine-cpu applies to --mode poll (inline mode has no engine thread)",
            ));
        }
        let connect_timeout = cli.connect_timeout.unwrap_or(10);
        if connect_timeout == 0 || connect_timeout > 3600 {
            return Err(usage(format!(
                "--connect-timeout {connect_timeout}: give 1 to 3600 seconds"
            )));
        }
        let progress_after = cli.progress_after.unwrap_or(2);
        if progress_after > 3600 {
            return Err(usage(format!(
                "--progress-after {progress_after}: give 0 to 3600 seconds"
            )));
        }
        let idle_timeout = cli
            .idle_timeout
            .unwrap_or(crate::perf::idle::DEFAULT_IDLE_TIMEOUT_SECS);
        if idle_timeout > 86_400 {
            return Err(usage(format!(
                "--idle-timeout {idle_timeout}: give 0 (wait forever) to 86400 seconds"
            )));
        }
        let idle_timeout = (idle_timeout > 0).then(|| std::time::Duration::from_secs(idle_timeout));
        Ok(Options {
            idle_timeout,
            progress_after,
            test,
            sizes,
            all: cli.all,
            iters,
            warmup,
            inline,
            tx_depth,
            rx_depth,
            qps,
            mtu,
            atomic: cli.atomic_type.unwrap_or_default(),
            cq_mod,
            post_list,
            outs,
            histogram: cli.histogram,
            gbits: cli.report_gbits,
            output: cli.output,
            json: cli.json,
            hgrm: cli.hgrm,
            role,
            mode,
            cpus,
            engine_cpus,
            connect_timeout,
            spawned: cli.spawned,
        })
    }

    /// The largest message of the run.
    pub fn max_size(&self) -> u64 {
        *self.sizes.last().unwrap_or(&8)
    }
}

/// Bytes of arena one side needs: a send and a receive buffer per QP, each rounded to a
/// cache line, each QP's inline staging (`tx_depth` rows of `inline` bytes rounded to a
/// cache line), the control channel, and 2 MiB of slack. Kept tight on purpose: the arena
/// is resident (the engine maps it populated, and the peer maps it too), so every byte
/// here shows in both processes' RSS.
pub fn arena_bytes(max_size: u64, qps: u32, tx_depth: u32, inline: u32) -> u64 {
    let buf = max_size.div_ceil(64) * 64;
    let staging = u64::from(tx_depth) * u64::from(inline).div_ceil(64) * 64 + 4096;
    (2 * buf + staging).saturating_mul(u64::from(qps)) + (2 << 20)
}

fn usage(msg: impl Into<String>) -> PerfError {
    PerfError::Usage(msg.into())
}

fn parse_cpus(flag: &str, list: Option<&str>, ncpu: usize) -> Result<Vec<usize>, PerfError> {
    let Some(list) = list else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for part in list.split(',') {
        let cpu: usize = part.trim().parse().map_err(|_| {
            usage(format!(
                "{flag} {list}: `{part}` is not a core number; give e.g. {flag} 0,1"
            ))
        })?;
        if cpu >= ncpu {
            return Err(usage(format!(
                "{flag} {list}: core {cpu} does not exist (this machine has cores 0 to {})",
                ncpu - 1
            )));
        }
        out.push(cpu);
    }
    if out.len() > 2 {
        return Err(usage(format!(
            "{flag} {list}: give at most two cores (this process's, then the peer's)"
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Options, PerfError> {
        Options::parse_from(std::iter::once("shmhca-perf").chain(args.iter().copied()))
    }

    fn usage_msg(args: &[&str]) -> String {
        match parse(args) {
            Err(PerfError::Usage(m)) => m,
            other => panic!("expected a usage error for {args:?}, got {other:?}"),
        }
    }

    #[test]
    fn defaults_follow_perftest() {
        let o = parse(&["send_lat"]).unwrap();
        assert_eq!(
            (o.sizes.as_slice(), o.iters, o.inline),
            (&[2][..], 1000, 236)
        );
        let o = parse(&["write_bw"]).unwrap();
        assert_eq!(
            (o.sizes.as_slice(), o.iters, o.inline),
            (&[65536][..], 5000, 0)
        );
        let o = parse(&["--test", "atomic_lat"]).unwrap();
        assert_eq!(o.sizes, vec![8]);
        assert_eq!(o.atomic, AtomicType::FetchAndAdd);
        assert_eq!(o.role, Role::SelfSpawn);
    }

    #[test]
    fn all_sizes_run_from_2_to_2_pow_23() {
        let o = parse(&["write_lat", "-a"]).unwrap();
        assert_eq!(o.sizes.len(), 23);
        assert_eq!((o.sizes[0], o.max_size()), (2, MAX_ALL_SIZE));
    }

    #[test]
    fn bad_values_name_the_flag() {
        assert!(usage_msg(&["send_lat", "-s", "0"]).starts_with("-s 0"));
        assert!(usage_msg(&["send_bw", "-m", "1000"]).contains("not a PMTU"));
        assert!(usage_msg(&["send_bw", "-t", "0"]).starts_with("-t 0"));
        assert!(usage_msg(&["send_bw", "-t", "100000"]).contains("queue depth"));
        assert!(usage_msg(&["send_bw", "-n", "2"]).starts_with("-n 2"));
        assert!(usage_msg(&["atomic_bw", "-s", "16"]).contains("8 bytes"));
        assert!(usage_msg(&["send_bw", "-A", "CMP_AND_SWAP"]).contains("-A"));
        assert!(usage_msg(&["send_lat", "--output", "bandwidth"]).contains("--output"));
        assert!(usage_msg(&["send_bw", "-H"]).contains("-H"));
        assert!(usage_msg(&["send_lat", "--cpu", "x"]).contains("not a core"));
        assert!(usage_msg(&["send_lat", "--cpu", "9999"]).contains("does not exist"));
        assert!(usage_msg(&[]).contains("no test given"));
        assert!(usage_msg(&["send_lat", "--test", "read_lat"]).contains("two different"));
        assert!(usage_msg(&["send_bw", "-s", "1073741824", "-q", "8"]).contains("arena"));
    }

    #[test]
    fn unknown_test_is_a_clap_error() {
        assert!(matches!(parse(&["ping_lat"]), Err(PerfError::Clap(_))));
    }

    #[test]
    fn cq_mod_is_capped_by_the_tx_depth() {
        let o = parse(&["send_bw", "-t", "16"]).unwrap();
        assert_eq!((o.cq_mod, o.post_list), (16, 16));
    }

    #[test]
    fn test_codes_round_trip() {
        for t in TestKind::ALL {
            assert_eq!(TestKind::from_code(t.code()), Some(t));
        }
        assert_eq!(TestKind::from_code(8), None);
    }
}
