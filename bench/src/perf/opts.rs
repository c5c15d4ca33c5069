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
/// The default `-u`: 4.096 us * 2^18, 1.07 s. perftest's is 14 (67 ms), made for a wire
/// whose round trip is microseconds; here the wire is the peer process, and on a loaded
/// machine it stalls for longer: with 14, a debug build on a loaded 2-core machine (load
/// average 20) saw a transport timeout in a 10 s `send_lat`, and `write_bw -s 8388608 -b
/// -q 3 -D 5` (an 8 MiB message takes longer than 67 ms there) ended in RetryExcErr.
/// `-u 14` gives perftest's value.
pub const DEFAULT_QP_TIMEOUT: u8 = 18;
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
    /// An engine thread per side polls without pause (on --engine-cpu, or the next two
    /// free cores); with the application threads that is four spinning threads, which
    /// need four cores (a run on fewer warns).
    #[value(name = "poll")]
    Poll,
}

/// The help heading of perftest's flags that have no meaning here.
const IGNORED: &str =
    "perftest flags without meaning here (accepted, ignored; the header lists them)";
/// The help heading of perftest's flags shmhca-perf does not offer (yet).
const UNAVAILABLE: &str = "perftest flags not available in shmhca-perf (refused with the reason)";

/// The raw command line.
#[derive(Debug, Parser)]
#[command(
    name = "shmhca-perf",
    version,
    about = "perftest's latency and bandwidth tests over shmhca (RC between processes over shared memory)",
    after_help = "With no --server/--client, shmhca-perf starts its peer process itself (pinned to another core) and prints the result.\nFor two terminals: `shmhca-perf TEST --server PATH` then `shmhca-perf TEST --client PATH` with the same flags.\nSHMHCA_PCAP=FILE captures every packet for Wireshark: the client writes FILE, the server (its own peer process, or --server) FILE with .server before the extension (run.pcap, run.server.pcap); two processes never write one file."
)]
pub struct Cli {
    /// The test: send_lat, write_lat, read_lat, atomic_lat, send_bw, write_bw, read_bw or atomic_bw.
    #[arg(value_enum, value_name = "TEST")]
    pub test_pos: Option<TestKind>,
    /// perftest's server address, last on the line (`send_lat -s 8 HOST`): the peer of a
    /// shmhca-perf run is on this machine, so only this host is accepted (localhost,
    /// 127.x.y.z, ::1 or this machine's name); the run is the same as without it.
    #[arg(value_name = "HOST")]
    pub host: Option<String>,
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
    /// Send queue depth: requests kept outstanding by bandwidth tests (default 128; 1 for
    /// latency tests, as perftest).
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
    #[arg(short = 'H', long = "report-histogram", alias = "report-histogrm")]
    pub histogram: bool,
    /// With -H: print the samples in the order measured (default sorted).
    #[arg(short = 'U', long = "report-unsorted")]
    pub unsorted: bool,
    /// Do not compute the peak bandwidth (reported as 0, as perftest).
    #[arg(short = 'N', long = "noPeak")]
    pub no_peak: bool,
    /// Run for this many seconds instead of -n iterations (one size; latency tests measure
    /// the iterations between the -f margins).
    #[arg(short = 'D', long = "duration", value_name = "SECONDS")]
    pub duration: Option<u64>,
    /// With -D: measure only after the first and before the last SECONDS (default -D / 4).
    #[arg(short = 'f', long = "margin", value_name = "SECONDS")]
    pub margin: Option<u64>,
    /// Bandwidth tests: run until interrupted, printing a line every -D seconds (default 5).
    #[arg(long = "run_infinitely")]
    pub run_infinitely: bool,
    /// Bandwidth tests: warm up before measuring (perftest's --perform_warm_up).
    #[arg(long = "perform_warm_up")]
    pub perform_warm_up: bool,
    /// Connection type: RC (shmhca implements RC only).
    #[arg(short = 'c', long = "connection", value_name = "RC")]
    pub connection: Option<String>,
    /// Sleep on completion events instead of polling: the application waits on a completion
    /// channel and the engine sleeps when idle (latency tests but write_lat, and the
    /// bandwidth tests).
    #[arg(short = 'e', long = "events")]
    pub events: bool,
    /// Completion vector for -e (shmhca has one: not available).
    #[arg(short = 'X', long = "vector", value_name = "VECTOR")]
    pub vector: Option<String>,
    /// Transport timeout exponent: 4.096 us * 2^N (1 to 31; default 18, 1 s: perftest's 14,
    /// 67 ms, is shorter than a busy machine stalls a process).
    #[arg(short = 'u', long = "qp-timeout", value_name = "N")]
    pub qp_timeout: Option<u8>,
    /// Transport retries before a QP fails (0 to 7; default 7).
    #[arg(long = "retry_count", value_name = "N")]
    pub retry_count: Option<u8>,
    /// Write perftest's JSON report (its keys) to --out_json_file (default perftest_out.json).
    /// As perftest, a later run replaces the file when it holds an earlier run's report
    /// (shmhca-perf's or perftest's); any other existing file is refused (or --force).
    #[arg(long = "out_json")]
    pub out_json: bool,
    /// The file of --out_json.
    #[arg(long = "out_json_file", value_name = "FILE")]
    pub out_json_file: Option<PathBuf>,
    /// Overwrite existing output files (--json, --hgrm, --out_json, --svg, --hlog); without it
    /// shmhca-perf refuses to touch a file that exists (but --out_json replaces an earlier
    /// run's report, as perftest).
    #[arg(long = "force")]
    pub force: bool,
    /// Run on these cores only (perftest's --pin_cores, e.g. 0-3,8); the first two serve
    /// as this process's and the peer's cores unless --cpu says otherwise.
    #[arg(long = "pin_cores", value_name = "LIST")]
    pub pin_cores: Option<String>,
    /// (ignored: no NUMA placement here) perftest's NUMA node.
    #[arg(long = "numa_node", value_name = "NODE", help_heading = IGNORED)]
    pub numa_node: Option<String>,
    /// (ignored: no NUMA placement here) perftest's NUMA switch.
    #[arg(long = "disable_numa", help_heading = IGNORED)]
    pub disable_numa: bool,
    /// (ignored: the data is always validated) validation debugging.
    #[arg(long = "data_validation_debug", help_heading = IGNORED)]
    pub data_validation_debug: bool,
    /// Not available: GPU memory.
    #[arg(long = "use_cuda", value_name = "GPU", help_heading = UNAVAILABLE)]
    pub use_cuda: Option<String>,
    /// Not available: GPU memory.
    #[arg(long = "use_rocm", value_name = "GPU", help_heading = UNAVAILABLE)]
    pub use_rocm: Option<String>,
    /// (ignored: no devices here) perftest's IB device.
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV", help_heading = IGNORED)]
    pub ib_dev: Option<String>,
    /// (ignored: no ports here) perftest's IB port.
    #[arg(short = 'i', long = "ib-port", value_name = "PORT", help_heading = IGNORED)]
    pub ib_port: Option<String>,
    /// (ignored: no GIDs here) perftest's GID index.
    #[arg(short = 'x', long = "gid-index", value_name = "INDEX", help_heading = IGNORED)]
    pub gid_index: Option<String>,
    /// (ignored: time comes from the OS clock, not cpufreq) perftest's CPU-frequency check.
    #[arg(short = 'F', long = "CPU-freq", help_heading = IGNORED)]
    pub cpu_freq: bool,
    /// (ignored: shmhca's connection manager always connects the QPs) rdma_cm.
    #[arg(short = 'R', long = "rdma_cm", help_heading = IGNORED)]
    pub rdma_cm: bool,
    /// (ignored: the parameters travel as connection private data) rdma_cm exchange.
    #[arg(short = 'z', long = "comm_rdma_cm", help_heading = IGNORED)]
    pub comm_rdma_cm: bool,
    /// With --roce: the TCP port of the exchange (default 18515, as perftest's). Without:
    /// ignored (the sides meet at a socket path, --server/--client).
    #[arg(short = 'p', long = "port", value_name = "PORT")]
    pub port: Option<String>,
    /// Run between two hosts over RoCEv2 (UDP 4791): `shmhca-perf TEST --roce` on the
    /// server, `shmhca-perf TEST --roce HOST` on the client, as perftest is split. The sides
    /// exchange their parameters and QPs over TCP (`-p`), and each binds its UDP port on
    /// the address the TCP connection uses (or `--bind`). The TCP connection stays open
    /// during the run as the peer's pulse: if it closes before the end, the peer's process
    /// ended, and this side stops at once saying so (not after its transport retries or
    /// --idle-timeout). The server drops a connection that sends no line of the exchange
    /// within half --connect-timeout (a port scanner, another program), with one line, and
    /// goes on waiting for its client.
    #[arg(long = "roce")]
    pub roce: bool,
    /// With --roce: this side's address for RoCEv2 (default: the TCP connection's). The
    /// client connects from it too, so that the server sees the address it will send to.
    #[arg(long = "bind", value_name = "ADDR", requires = "roce")]
    pub bind: Option<std::net::IpAddr>,
    /// With --roce: send to the RoCEv2 address the peer's exchange line names even when its
    /// TCP connection comes from (or, for the server, goes to) another address — a host
    /// whose RoCE and TCP addresses differ, a proxy. Without it such a peer is refused:
    /// this side sends datagrams only to the address at the other end of the TCP
    /// connection, so that a client cannot point them at a third host.
    #[arg(long = "trust-peer-addr", requires = "roce")]
    pub trust_peer_addr: bool,
    /// (ignored: no fabric) service level.
    #[arg(short = 'S', long = "sl", value_name = "SL", help_heading = IGNORED)]
    pub sl: Option<String>,
    /// (ignored: no fabric) type of service.
    #[arg(short = 'T', long = "tos", value_name = "TOS", help_heading = IGNORED)]
    pub tos: Option<String>,
    /// (ignored: no fabric) hop limit.
    #[arg(short = 'L', long = "hop_limit", value_name = "N", help_heading = IGNORED)]
    pub hop_limit: Option<String>,
    /// (ignored: no hardware counters) counters to report.
    #[arg(short = 'W', long = "report-counters", value_name = "LIST", help_heading = IGNORED)]
    pub report_counters: Option<String>,
    /// (ignored: no partitions) P_Key index.
    #[arg(long = "pkey_index", value_name = "INDEX", help_heading = IGNORED)]
    pub pkey_index: Option<String>,
    /// (ignored: no fabric) traffic class.
    #[arg(long = "tclass", value_name = "N", help_heading = IGNORED)]
    pub tclass: Option<String>,
    /// (ignored: no fabric) flow label.
    #[arg(long = "flow_label", value_name = "N", help_heading = IGNORED)]
    pub flow_label: Option<String>,
    /// (ignored: one posting API) the old post_send API.
    #[arg(long = "use_old_post_send", help_heading = IGNORED)]
    pub use_old_post_send: bool,
    /// (ignored: the parameters are always compared) version exchange.
    #[arg(long = "dont_xchg_versions", help_heading = IGNORED)]
    pub dont_xchg_versions: bool,
    /// (ignored: the arena uses huge pages whenever the kernel has them) huge pages.
    #[arg(long = "use_hugepages", help_heading = IGNORED)]
    pub use_hugepages: bool,
    /// (ignored: the data is always validated) data validation.
    #[arg(long = "data_validation", help_heading = IGNORED)]
    pub data_validation: bool,
    /// (ignored: no link layer to force) link type.
    #[arg(long = "force-link", value_name = "LINK", help_heading = IGNORED)]
    pub force_link: Option<String>,
    /// (ignored: no IP here) IPv6.
    #[arg(long = "ipv6", help_heading = IGNORED)]
    pub ipv6: bool,
    /// (ignored: no locks to skip) no_lock.
    #[arg(long = "no_lock", help_heading = IGNORED)]
    pub no_lock: bool,
    /// Bidirectional bandwidth (write_bw, read_bw): both sides run the requests; the
    /// figures are the two directions added, as perftest's.
    #[arg(short = 'b', long = "bidirectional")]
    pub bidirectional: bool,
    /// Not available: report in CPU cycles.
    #[arg(short = 'C', long = "report-cycles", help_heading = UNAVAILABLE)]
    pub report_cycles: bool,
    /// Not available: dual port.
    #[arg(short = 'O', long = "dualport", help_heading = UNAVAILABLE)]
    pub dualport: bool,
    /// Not available: multicast (UD only).
    #[arg(short = 'g', long = "mcg", help_heading = UNAVAILABLE)]
    pub mcg: bool,
    /// Not available: multicast group (UD only).
    #[arg(short = 'M', long = "MGID", value_name = "GID", help_heading = UNAVAILABLE)]
    pub mgid: Option<String>,
    /// Not available: shared receive queue.
    #[arg(long = "use-srq", help_heading = UNAVAILABLE)]
    pub use_srq: bool,
    /// Not available: bandwidth limit check.
    #[arg(short = 'w', long = "limit_bw", value_name = "BW", help_heading = UNAVAILABLE)]
    pub limit_bw: Option<String>,
    /// Not available: message-rate limit check.
    #[arg(short = 'y', long = "limit_msgrate", value_name = "RATE", help_heading = UNAVAILABLE)]
    pub limit_msgrate: Option<String>,
    /// Not available: CPU utilisation.
    #[arg(long = "cpu_util", help_heading = UNAVAILABLE)]
    pub cpu_util: bool,
    /// Not available: RDMA Write with Immediate.
    #[arg(long = "write_with_imm", help_heading = UNAVAILABLE)]
    pub write_with_imm: bool,
    /// Not available: on-demand paging.
    #[arg(long = "odp", help_heading = UNAVAILABLE)]
    pub odp: bool,
    /// Not available: one MR per QP.
    #[arg(long = "mr_per_qp", help_heading = UNAVAILABLE)]
    pub mr_per_qp: bool,
    /// Not available: receive post lists.
    #[arg(long = "recv_post_list", value_name = "N", help_heading = UNAVAILABLE)]
    pub recv_post_list: Option<String>,
    /// Not available: a gap between latency iterations.
    #[arg(long = "latency_gap", value_name = "USEC", help_heading = UNAVAILABLE)]
    pub latency_gap: Option<String>,
    /// Not available: payload from a file.
    #[arg(long = "payload_file_path", value_name = "FILE", help_heading = UNAVAILABLE)]
    pub payload_file_path: Option<String>,
    /// Not available: report both sides.
    #[arg(long = "report-both", help_heading = UNAVAILABLE)]
    pub report_both: bool,
    /// Not available: reversed traffic.
    #[arg(long = "reversed", help_heading = UNAVAILABLE)]
    pub reversed: bool,
    /// Report bandwidth in Gbit/s instead of MiB/s.
    #[arg(long = "report_gbits")]
    pub report_gbits: bool,
    /// Print only this figure.
    #[arg(long = "output", value_enum)]
    pub output: Option<OutputOnly>,
    /// Request a completion every this many sends (perftest's CQ moderation; default 100).
    #[arg(short = 'Q', long = "cq-mod")]
    pub cq_mod: Option<u32>,
    /// Post this many work requests per doorbell in bandwidth tests (default 1, as perftest).
    #[arg(short = 'l', long = "post_list")]
    pub post_list: Option<u32>,
    /// Outstanding RDMA Reads/Atomics per QP (initiator depth, 1 to 16; default 16).
    #[arg(short = 'o', long = "outs")]
    pub outs: Option<u8>,
    /// Unmeasured iterations before each measurement (default 0, as perftest; --perform_warm_up: 10 send windows).
    #[arg(long = "warmup")]
    pub warmup: Option<u64>,
    /// Write every figure, the parameters, the machine and RSS to this JSON file.
    #[arg(long = "json", value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write HdrHistogram's percentile distribution (.hgrm text) of latency tests to FILE
    /// (with -a, one file per size: FILE's name with -SIZE before the extension).
    #[arg(long = "hgrm", value_name = "FILE")]
    pub hgrm: Option<PathBuf>,
    /// Write an HdrHistogram interval log (.hlog: one histogram per second of measurement,
    /// tagged size-N) of latency tests to FILE, for long runs.
    #[arg(long = "hlog", value_name = "FILE")]
    pub hlog: Option<PathBuf>,
    /// Draw the run as an SVG picture: the latency percentile distribution (latency
    /// tests), and with -a latency or bandwidth against message size.
    #[arg(long = "svg", value_name = "FILE")]
    pub svg: Option<PathBuf>,
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
    /// Cores for the poll-mode engine threads: `C[,D]` (this process's, the peer's). Default
    /// with no --server/--client: the first two cores the application threads do not use,
    /// if there are two; else the scheduler places them.
    #[arg(long = "engine-cpu", value_name = "C[,D]")]
    pub engine_cpu: Option<String>,
    /// Show progress on stderr once a measurement has run this many seconds (default 2).
    #[arg(long = "progress-after", value_name = "SECONDS")]
    pub progress_after: Option<u64>,
    /// Seconds to wait for the peer to connect (default 10); with --roce, for each step of
    /// the TCP exchange.
    #[arg(long = "connect-timeout", value_name = "SECONDS")]
    pub connect_timeout: Option<u64>,
    /// End with an error when the peer has sent nothing for this many seconds (it is
    /// stopped or hung); 0 waits forever. Default 10.
    #[arg(long = "idle-timeout", value_name = "SECONDS")]
    pub idle_timeout: Option<u64>,
    /// Internal: this process is the server started by a client (exits with its parent).
    #[arg(long = "spawned", hide = true)]
    pub spawned: bool,
    /// Fault injection: drop this fraction of the packets this process sends (both ends
    /// take the flags: a self-spawned peer gets them too; with --server/--client each end
    /// takes its own).
    #[arg(long = "drop", value_name = "RATE", help_heading = "Faults")]
    pub drop: Option<f64>,
    /// Fault injection: duplicate this fraction of the packets sent.
    #[arg(long = "dup", value_name = "RATE", help_heading = "Faults")]
    pub dup: Option<f64>,
    /// Fault injection: swap this fraction of the packets sent with the next one.
    #[arg(long = "reorder", value_name = "RATE", help_heading = "Faults")]
    pub reorder: Option<f64>,
    /// Fault injection: hold this fraction of the packets sent for a few engine iterations.
    #[arg(long = "delay", value_name = "RATE", help_heading = "Faults")]
    pub delay: Option<f64>,
    /// Fault injection: flip a bit in this fraction of the packets sent (the receiver's
    /// ICRC check drops them).
    #[arg(long = "corrupt", value_name = "RATE", help_heading = "Faults")]
    pub corrupt: Option<f64>,
    /// Seed of the injected faults (default 1).
    #[arg(long = "seed", value_name = "N", help_heading = "Faults")]
    pub seed: Option<u64>,
    /// Check every payload byte of every iteration and the order of every completion
    /// (latency tests carry a different pattern each iteration; bandwidth tests check
    /// each completion's order and every byte at the end of each size). Slows the run:
    /// figures measured with --check are not benchmarks.
    #[arg(long = "check")]
    pub check: bool,
    /// Testing only: the client expects a wrong pattern under --check (shows that a check
    /// fails).
    #[arg(long = "check-expect-wrong", hide = true)]
    pub check_expect_wrong: bool,
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
    /// The server side over RoCEv2: waits for a client on TCP `port`.
    RoceServer {
        /// The TCP port of the exchange.
        port: u16,
        /// This side's RoCEv2 address (`None`: the TCP connection's).
        bind: Option<std::net::IpAddr>,
        /// Send to the address the peer's line names even if it is not the TCP peer's
        /// (`--trust-peer-addr`).
        trust_peer_addr: bool,
    },
    /// The client side over RoCEv2: connects to `host` on TCP `port`.
    RoceClient {
        /// The server.
        host: String,
        /// The TCP port of the exchange.
        port: u16,
        /// This side's RoCEv2 address (`None`: the TCP connection's); the TCP connection
        /// is made from it too.
        bind: Option<std::net::IpAddr>,
        /// Send to the address the peer's line names even if it is not the TCP peer's
        /// (`--trust-peer-addr`).
        trust_peer_addr: bool,
    },
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
    /// `--svg`.
    pub svg: Option<PathBuf>,
    /// `--hlog`.
    pub hlog: Option<PathBuf>,
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
    /// How long each bandwidth measurement runs, if not by iterations.
    pub timed: Option<Timed>,
    /// `-N`.
    pub no_peak: bool,
    /// `-U`.
    pub unsorted: bool,
    /// `-u`: the transport timeout exponent.
    pub qp_timeout: u8,
    /// `-e`: sleep on completion events.
    pub events: bool,
    /// `--retry_count`.
    pub retry_count: u8,
    /// `--out_json` (the file).
    pub out_json: Option<PathBuf>,
    /// `--force`.
    pub force: bool,
    /// perftest flags given that have no meaning here, as given (for the header).
    pub ignored: Vec<String>,
    /// `-b`.
    pub bidirectional: bool,
    /// `--pin_cores`: the cores this process may run on (empty: as started).
    pub pin_cores: Vec<usize>,
    /// `--drop`, `--dup`, `--reorder`, `--delay`, `--corrupt`, `--seed`.
    pub faults: shmhca::fault::FaultConfig,
    /// `--check`.
    pub check: bool,
    /// `--check-expect-wrong` (testing only).
    pub check_expect_wrong: bool,
}

/// A run by time (`-D`; `--run_infinitely` for bandwidth tests) rather than by iterations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timed {
    /// `-D SECS`: run for `secs`, measuring between `margin` and `secs - margin`.
    Duration {
        /// `-D`.
        secs: u64,
        /// `-f` (default `secs / 4`).
        margin: u64,
    },
    /// `--run_infinitely`: until interrupted, a line every `every` seconds.
    Forever {
        /// `-D` (default 5).
        every: u64,
    },
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

    /// Checks the parsed command line, one concern after another (each in a function of
    /// its own, named below). The order of the steps is part of the behaviour: a command
    /// line with several faults gets the error of the first step that fails, so a step
    /// that depends on an earlier one's value comes after it, and the order of the
    /// independent ones is kept as it has always been.
    ///
    /// | step | flags |
    /// |---|---|
    /// | `refuse_unavailable`, `ignored_flags` | perftest's flags shmhca-perf lacks or ignores |
    /// | `select_test` | the test (positional or `--test`) |
    /// | `timed` | `-D`, `-f`, `--run_infinitely` |
    /// | `check_atomic_flags`, `sizes` | `-A`; `-s`, `-a` |
    /// | `iterations` | `-n` |
    /// | `Queues::from_cli` | `-t`, `-r`, `-q`, `-m`, `-I`, `-Q`, `-l`, `-o` |
    /// | `warmup` | `--perform_warm_up`, `--warmup` |
    /// | `check_arena` | `-s` with `-q` (and `-t`, `-I`): the arena's size |
    /// | `check_report_kind` | `--output`, `-H`, `--hgrm`, `--hlog`, `--report_gbits` |
    /// | `check_connection_flags` | `-c`, `-X`, `-e` |
    /// | `role` | `--server`, `--client`, `--in-process`, `--spawned` |
    /// | `Placement::from_cli` | `--cpu`, `--engine-cpu`, `--mode` |
    /// | `Timeouts::from_cli` | `--connect-timeout`, `--progress-after`, `--idle-timeout` |
    /// | `check_timed_run` | `-n` or `--warmup` with `-D`/`--run_infinitely` |
    /// | `check_sort_and_peak` | `-U`, `-N` |
    /// | `qp_timeout`, `retry_count` | `-u`, `--retry_count` |
    /// | `output_files` | `--out_json`, `--out_json_file`, `--svg`; no file overwritten (`--force`) |
    /// | `check_host` | HOST |
    /// | `parse_core_list` | `--pin_cores` |
    /// | `check_bidirectional` | `-b` |
    /// | `faults` | `--drop`, `--dup`, `--reorder`, `--delay`, `--corrupt`, `--seed` |
    ///
    /// # Errors
    /// [`PerfError::Usage`] naming the first bad flag.
    pub fn from_cli(cli: Cli) -> Result<Options, PerfError> {
        refuse_unavailable(&cli)?;
        let ignored = ignored_flags(&cli);
        let test = select_test(&cli)?;
        let timed = timed(&cli, test)?;
        check_atomic_flags(&cli, test)?;
        let sizes = sizes(&cli, test)?;
        let iters = iterations(&cli, test)?;
        let queues = Queues::from_cli(&cli, test)?;
        let warmup = warmup(&cli, test, queues.tx_depth)?;
        check_arena(&sizes, &queues)?;
        check_report_kind(&cli, test)?;
        check_connection_flags(&cli, test)?;
        let role = role(&cli)?;
        let placement = Placement::from_cli(&cli)?;
        let timeouts = Timeouts::from_cli(&cli)?;
        check_timed_run(&cli, timed)?;
        check_sort_and_peak(&cli, test)?;
        let qp_timeout = qp_timeout(&cli)?;
        let retry_count = retry_count(&cli)?;
        let out_json = output_files(&cli, test, &sizes)?;
        if let Some(h) = cli.host.as_deref().filter(|_| !cli.roce) {
            check_host(h)?;
        }
        let pin_cores = parse_core_list(cli.pin_cores.as_deref())?;
        check_bidirectional(&cli, test)?;
        let faults = faults(&cli)?;
        let Queues {
            tx_depth,
            rx_depth,
            qps,
            mtu,
            inline,
            cq_mod,
            post_list,
            outs,
        } = queues;
        Ok(Options {
            faults,
            check: cli.check,
            check_expect_wrong: cli.check_expect_wrong,
            bidirectional: cli.bidirectional,
            pin_cores,
            timed,
            no_peak: cli.no_peak || timed.is_some(),
            unsorted: cli.unsorted,
            qp_timeout,
            events: cli.events,
            retry_count,
            out_json,
            force: cli.force,
            ignored,
            idle_timeout: timeouts.idle,
            progress_after: timeouts.progress_after,
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
            svg: cli.svg,
            hlog: cli.hlog,
            role,
            mode: placement.mode,
            cpus: placement.cpus,
            engine_cpus: placement.engine_cpus,
            connect_timeout: timeouts.connect,
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

/// The `.hgrm` file of each size: `path` itself for one size, else `path` with `-SIZE`
/// before its extension (`lat.hgrm` gives `lat-2.hgrm`, `lat-4.hgrm`, ...).
pub fn hgrm_paths(path: &std::path::Path, sizes: &[u64]) -> Vec<(u64, PathBuf)> {
    if sizes.len() == 1 {
        return vec![(sizes[0], path.to_path_buf())];
    }
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ext = path
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    sizes
        .iter()
        .map(|&size| (size, path.with_file_name(format!("{stem}-{size}{ext}"))))
        .collect()
}

/// The most bytes of an existing `--out_json` file read to see whether it is an earlier
/// report (perftest's are a few KiB; `-a` adds one entry per size).
const MAX_REPORT_BYTES: u64 = 1 << 20;

/// Whether `path` is a regular file holding an earlier `--out_json` report (shmhca-perf's
/// or perftest's: a JSON object with a `test_info` object naming the `test`, and
/// `results`), which a new run may replace as perftest does. Anything else (another JSON
/// file, a symlink, a directory, text, a file too large to be a report) is not.
pub fn is_earlier_report(path: &std::path::Path) -> bool {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return false;
    };
    if !meta.is_file() || meta.len() > MAX_REPORT_BYTES {
        return false;
    }
    let Ok(text) = std::fs::read(path) else {
        return false;
    };
    let Ok(doc) = serde_json::from_slice::<serde_json::Value>(&text) else {
        return false;
    };
    doc.get("test_info")
        .and_then(|i| i.get("test"))
        .is_some_and(serde_json::Value::is_string)
        && doc.get("results").is_some()
}

/// The positional HOST (perftest's server address): shmhca's peer is a process of this
/// machine, so HOST must name this machine.
fn check_host(host: &str) -> Result<(), PerfError> {
    let h = host.trim_end_matches('.');
    let loopback_name = [
        "localhost",
        "localhost.localdomain",
        "ip6-localhost",
        "ip6-loopback",
    ]
    .iter()
    .any(|n| h.eq_ignore_ascii_case(n));
    let loopback_ip = h
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback());
    let own_name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .is_ok_and(|n| !n.trim().is_empty() && n.trim().eq_ignore_ascii_case(h));
    if loopback_name || loopback_ip || own_name {
        return Ok(());
    }
    Err(usage(format!(
        "HOST {host}: shmhca connects processes of one machine over shared memory, so the server is on this host: give localhost (or nothing: shmhca-perf starts its peer itself); for two terminals use --server PATH and --client PATH"
    )))
}

/// `-D`, `-f` and `--run_infinitely`, checked as perftest does.
fn timed(cli: &Cli, test: TestKind) -> Result<Option<Timed>, PerfError> {
    if cli.duration.is_none() && !cli.run_infinitely {
        if cli.margin.is_some() {
            return Err(usage("-f sets the margins of -D; give -D too"));
        }
        return Ok(None);
    }
    if test.is_lat() && cli.run_infinitely {
        return Err(usage(format!(
            "--run_infinitely: {} runs by iterations (-n) or for a time (-D); --run_infinitely is for the bandwidth tests",
            test.name()
        )));
    }
    if cli.all {
        return Err(usage(
            "-a with -D/--run_infinitely: a timed run takes one size (as perftest); give -s",
        ));
    }
    let secs = cli.duration.unwrap_or(5);
    if secs == 0 || secs > 86_400 {
        return Err(usage(format!("-D {secs}: give 1 to 86400 seconds")));
    }
    if cli.run_infinitely {
        if cli.margin.is_some() {
            return Err(usage(
                "-f with --run_infinitely: every interval is reported whole; leave -f out",
            ));
        }
        return Ok(Some(Timed::Forever { every: secs }));
    }
    let margin = cli.margin.unwrap_or(secs / 4);
    if secs <= 2 * margin {
        return Err(usage(format!(
            "-D {secs} -f {margin}: the duration must be longer than twice the margin (the measurement runs between them)"
        )));
    }
    Ok(Some(Timed::Duration { secs, margin }))
}

/// The test: the positional name or `--test` (both only if they agree).
fn select_test(cli: &Cli) -> Result<TestKind, PerfError> {
    match (cli.test_pos, cli.test) {
        (Some(a), Some(b)) if a != b => Err(usage(format!(
            "two different tests given: `{}` and `--test {}`; give one",
            a.name(),
            b.name()
        ))),
        (Some(t), _) | (None, Some(t)) => Ok(t),
        (None, None) => Err(usage(
            "no test given: name one of send_lat, write_lat, read_lat, atomic_lat, send_bw, write_bw, read_bw, atomic_bw (e.g. `shmhca-perf send_lat -s 8`)",
        )),
    }
}

/// `-s`, `-a` and `-A` against the test's verb: atomic tests move 8 bytes (no `-s` but 8,
/// no `-a`), and only they take `-A`.
fn check_atomic_flags(cli: &Cli, test: TestKind) -> Result<(), PerfError> {
    if test.verb() == Verb::Atomic {
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
    Ok(())
}

/// The message sizes, in run order: `-a` (2 to 2^23 bytes, as perftest), else `-s` (default
/// 8 for atomic tests, 2 for the other latency tests, 65536 for bandwidth tests).
fn sizes(cli: &Cli, test: TestKind) -> Result<Vec<u64>, PerfError> {
    if cli.all {
        return Ok((1..=23).map(|e| 1u64 << e).collect());
    }
    let default = match (test.verb(), test.is_lat()) {
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
    Ok(vec![s])
}

/// `-n`: measured iterations per size (default 5000 for write_bw, else 1000).
fn iterations(cli: &Cli, test: TestKind) -> Result<u64, PerfError> {
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
    Ok(iters)
}

/// The shape of each QP and of the work posted on it, checked.
struct Queues {
    /// `-t` (1 for latency tests, as perftest; else 128).
    tx_depth: u32,
    /// `-r` (default 512).
    rx_depth: u32,
    /// `-q` (default 1).
    qps: u32,
    /// `-m` (default 4096).
    mtu: u32,
    /// `-I` (default 236 for send_lat, 220 for write_lat, else 0).
    inline: u32,
    /// `-Q` (default 100), at most `tx_depth`.
    cq_mod: u32,
    /// `-l` (default 1), at most `tx_depth`.
    post_list: u32,
    /// `-o` (default 16).
    outs: u8,
}

impl Queues {
    /// `-t`, `-r`, `-q`, `-m`, `-I`, `-Q`, `-l` and `-o`, in this order.
    fn from_cli(cli: &Cli, test: TestKind) -> Result<Queues, PerfError> {
        let lat = test.is_lat();
        // As perftest: a latency test has one request in flight, and says so (TX depth 1).
        let tx_depth = queue_depth("-t", cli.tx_depth.unwrap_or(if lat { 1 } else { 128 }))?;
        let rx_depth = queue_depth("-r", cli.rx_depth.unwrap_or(512))?;
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
        let inline = inline_bytes(cli, test)?;
        let cq_mod = cli.cq_mod.unwrap_or(100);
        if cq_mod == 0 || cq_mod > 1024 {
            return Err(usage(format!(
                "-Q {cq_mod}: the CQ moderation must be 1 to 1024"
            )));
        }
        let post_list = cli.post_list.unwrap_or(1);
        if post_list == 0 || post_list > MAX_DEPTH {
            return Err(usage(format!(
                "-l {post_list}: the post list must be 1 to {MAX_DEPTH}"
            )));
        }
        let outs = cli.outs.unwrap_or(16);
        if outs == 0 || outs > shmhca::qp::MAX_RD_ATOMIC {
            return Err(usage(format!(
                "-o {outs}: outstanding Reads/Atomics must be 1 to {}",
                shmhca::qp::MAX_RD_ATOMIC
            )));
        }
        Ok(Queues {
            tx_depth,
            rx_depth,
            qps,
            mtu,
            inline,
            // As perftest: never wait for more completions than the queue holds.
            cq_mod: cq_mod.min(tx_depth),
            post_list: post_list.min(tx_depth),
            outs,
        })
    }
}

/// A queue depth given with `flag` (`-t` or `-r`): 1 to [`MAX_DEPTH`].
fn queue_depth(flag: &str, v: u32) -> Result<u32, PerfError> {
    if v == 0 || v > MAX_DEPTH {
        Err(usage(format!(
            "{flag} {v}: the queue depth must be 1 to {MAX_DEPTH}"
        )))
    } else {
        Ok(v)
    }
}

/// `-I`: the most bytes sent inline (at most [`MAX_INLINE`]; given for a Read or Atomic
/// test, an error).
fn inline_bytes(cli: &Cli, test: TestKind) -> Result<u32, PerfError> {
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
    if inline > 0 && matches!(test.verb(), Verb::Read | Verb::Atomic) && cli.inline.is_some() {
        return Err(usage(format!(
            "-I {inline}: RDMA Reads and Atomics carry no data to inline"
        )));
    }
    Ok(inline)
}

/// `--perform_warm_up` (bandwidth tests only: 10 send windows of `tx_depth`) and
/// `--warmup N`: the unmeasured iterations before each size (none unless asked for, as
/// perftest).
fn warmup(cli: &Cli, test: TestKind, tx_depth: u32) -> Result<u64, PerfError> {
    if cli.perform_warm_up && test.is_lat() {
        return Err(usage(format!(
            "--perform_warm_up applies to bandwidth tests, not {} (latency tests measure from the first iteration, as perftest; --warmup N adds unmeasured iterations)",
            test.name()
        )));
    }
    let warmup = cli.warmup.unwrap_or(if cli.perform_warm_up {
        10 * u64::from(tx_depth)
    } else {
        0
    });
    if warmup > MAX_ITERS {
        return Err(usage(format!(
            "--warmup {warmup}: at most {MAX_ITERS} iterations"
        )));
    }
    Ok(warmup)
}

/// The arena the largest size needs with these queues ([`arena_bytes`]): at most
/// [`MAX_ARENA`].
fn check_arena(sizes: &[u64], q: &Queues) -> Result<(), PerfError> {
    let max_size = *sizes.last().unwrap_or(&8);
    let arena = arena_bytes(max_size, q.qps, q.tx_depth, q.inline);
    if arena > MAX_ARENA {
        return Err(usage(format!(
            "-s {max_size} with -q {qps} needs {arena} bytes of arena (two buffers per QP), above the {MAX_ARENA} bytes shmhca-perf allocates at most: lower -s or -q",
            qps = q.qps
        )));
    }
    Ok(())
}

/// `--output`, `-H`, `--hgrm`, `--hlog` and `--report_gbits`: each reports a figure of
/// latency tests or of bandwidth tests, and only a test of that kind takes it.
fn check_report_kind(cli: &Cli, test: TestKind) -> Result<(), PerfError> {
    let lat = test.is_lat();
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
    if (cli.histogram || cli.hgrm.is_some() || cli.hlog.is_some()) && !lat {
        return Err(usage(format!(
            "-H, --hgrm and --hlog apply to latency tests, not {}",
            test.name()
        )));
    }
    if cli.report_gbits && lat {
        return Err(usage(format!(
            "--report_gbits applies to bandwidth tests, not {}",
            test.name()
        )));
    }
    Ok(())
}

/// `-c` (RC only), `-X` (refused: one completion vector) and `-e` (not with write_lat,
/// whose receiver completes nothing).
fn check_connection_flags(cli: &Cli, test: TestKind) -> Result<(), PerfError> {
    if let Some(c) = cli.connection.as_deref() {
        if !c.eq_ignore_ascii_case("RC") {
            return Err(usage(format!(
                "-c {c}: shmhca implements RC only; leave -c out or give -c RC"
            )));
        }
    }
    if cli.vector.is_some() {
        return Err(usage(
            "-X: shmhca has a single completion vector; leave -X out (-e works without it)",
        ));
    }
    if cli.events && test == TestKind::WriteLat {
        return Err(usage(
            "-e: write_lat completes nothing on the receiving side (it watches memory), so there is no event to sleep on; use -e with send_lat, read_lat, atomic_lat or a bandwidth test",
        ));
    }
    Ok(())
}

/// Which side this process runs: `--server`, `--client`, `--in-process` (at most one), or
/// none (it starts its peer); `--spawned` (internal) only with `--server`.
fn role(cli: &Cli) -> Result<Role, PerfError> {
    if cli.roce {
        if cli.server.is_some() || cli.client.is_some() || cli.in_process || cli.spawned {
            return Err(usage(
                "--roce runs between hosts: give HOST on the client and nothing on the server, not --server, --client or --in-process",
            ));
        }
        let port = match cli.port.as_deref() {
            None => 18515,
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| usage(format!("-p {p}: give a TCP port, 1 to 65535")))?,
        };
        return Ok(match &cli.host {
            Some(host) => Role::RoceClient {
                host: host.clone(),
                port,
                bind: cli.bind,
                trust_peer_addr: cli.trust_peer_addr,
            },
            None => Role::RoceServer {
                port,
                bind: cli.bind,
                trust_peer_addr: cli.trust_peer_addr,
            },
        });
    }
    let role = match (&cli.server, &cli.client, cli.in_process) {
        (Some(p), None, false) => Role::Server(p.clone()),
        (None, Some(p), false) => Role::Client(p.clone()),
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
    Ok(role)
}

/// Where the run's threads go, checked.
struct Placement {
    /// `--cpu`.
    cpus: Vec<usize>,
    /// `--engine-cpu`.
    engine_cpus: Vec<usize>,
    /// `--mode` (default: this machine's, [`shmhca::EngineMode::default_for_this_machine`]).
    mode: ModeArg,
}

impl Placement {
    /// `--cpu`, `--engine-cpu` (cores of this machine; poll mode only) and `--mode`.
    fn from_cli(cli: &Cli) -> Result<Placement, PerfError> {
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
        Ok(Placement {
            cpus,
            engine_cpus,
            mode,
        })
    }
}

/// How long the run waits for its peer, checked.
struct Timeouts {
    /// `--connect-timeout` (seconds, default 10).
    connect: u64,
    /// `--progress-after` (seconds, default 2).
    progress_after: u64,
    /// `--idle-timeout` (`None`: wait forever).
    idle: Option<std::time::Duration>,
}

impl Timeouts {
    /// `--connect-timeout` (1 to 3600 s), `--progress-after` (0 to 3600 s) and
    /// `--idle-timeout` (0, wait forever, to 86400 s).
    fn from_cli(cli: &Cli) -> Result<Timeouts, PerfError> {
        let connect = cli.connect_timeout.unwrap_or(10);
        if connect == 0 || connect > 3600 {
            return Err(usage(format!(
                "--connect-timeout {connect}: give 1 to 3600 seconds"
            )));
        }
        let progress_after = cli.progress_after.unwrap_or(2);
        if progress_after > 3600 {
            return Err(usage(format!(
                "--progress-after {progress_after}: give 0 to 3600 seconds"
            )));
        }
        let idle = cli
            .idle_timeout
            .unwrap_or(crate::perf::idle::DEFAULT_IDLE_TIMEOUT_SECS);
        if idle > 86_400 {
            return Err(usage(format!(
                "--idle-timeout {idle}: give 0 (wait forever) to 86400 seconds"
            )));
        }
        Ok(Timeouts {
            connect,
            progress_after,
            idle: (idle > 0).then(|| std::time::Duration::from_secs(idle)),
        })
    }
}

/// A run by time ([`timed`]) takes neither `-n` nor `--warmup` (it has no iteration count).
fn check_timed_run(cli: &Cli, timed: Option<Timed>) -> Result<(), PerfError> {
    if timed.is_some() && cli.iters.is_some() {
        return Err(usage(
            "-n and -D/--run_infinitely both given: a run goes by iterations or by time; give one",
        ));
    }
    if timed.is_some() && cli.warmup.is_some() {
        return Err(usage(
            "--warmup with -D/--run_infinitely: a timed run has no iteration count; use --perform_warm_up",
        ));
    }
    Ok(())
}

/// `-U` (orders `-H`'s samples: needs `-H`) and `-N` (bandwidth tests only).
fn check_sort_and_peak(cli: &Cli, test: TestKind) -> Result<(), PerfError> {
    if cli.unsorted && !cli.histogram {
        return Err(usage("-U orders -H's samples; give -H too"));
    }
    if cli.no_peak && test.is_lat() {
        return Err(usage(format!(
            "-N applies to bandwidth tests, not {}",
            test.name()
        )));
    }
    Ok(())
}

/// `-u`: the transport timeout exponent, 1 to 31 (default [`DEFAULT_QP_TIMEOUT`]).
fn qp_timeout(cli: &Cli) -> Result<u8, PerfError> {
    let qp_timeout = cli.qp_timeout.unwrap_or(DEFAULT_QP_TIMEOUT);
    if !(1..=31).contains(&qp_timeout) {
        return Err(usage(format!(
            "-u {qp_timeout}: the timeout exponent must be 1 to 31 (4.096 us * 2^N)"
        )));
    }
    Ok(qp_timeout)
}

/// `--retry_count`: 0 to 7 (default 7).
fn retry_count(cli: &Cli) -> Result<u8, PerfError> {
    let retry_count = cli.retry_count.unwrap_or(7);
    if retry_count > 7 {
        return Err(usage(format!("--retry_count {retry_count}: give 0 to 7")));
    }
    Ok(retry_count)
}

/// The files the run writes: `--out_json` (its file `--out_json_file`, default
/// `perftest_out.json`; returned), `--svg` (latency tests, or any test with `-a`), and
/// none of `--json`, `--out_json`, `--svg`, `--hlog` or the `--hgrm` files may exist
/// already (unless `--force`, or an earlier `--out_json` report, which perftest replaces
/// too; a spawned server writes none of them).
fn output_files(cli: &Cli, test: TestKind, sizes: &[u64]) -> Result<Option<PathBuf>, PerfError> {
    if cli.out_json_file.is_some() && !cli.out_json {
        return Err(usage(
            "--out_json_file names --out_json's file; give --out_json too",
        ));
    }
    let out_json = cli.out_json.then(|| {
        cli.out_json_file
            .clone()
            .unwrap_or_else(|| PathBuf::from("perftest_out.json"))
    });
    if cli.svg.is_some() && !test.is_lat() && !cli.all {
        return Err(usage(format!(
            "--svg draws latency tests, or bandwidth against message size with -a; {} of one size has nothing to draw (add -a)",
            test.name()
        )));
    }
    if !cli.spawned && !cli.force {
        refuse_overwrite(cli, sizes, out_json.as_ref())?;
    }
    Ok(out_json)
}

/// An error naming the first output file (`--json`, `--out_json`, `--svg`, `--hlog`, the
/// `--hgrm` files) that exists: shmhca-perf does not overwrite files, except an earlier
/// `--out_json` report.
fn refuse_overwrite(cli: &Cli, sizes: &[u64], out_json: Option<&PathBuf>) -> Result<(), PerfError> {
    let hgrms: Vec<PathBuf> = cli
        .hgrm
        .as_ref()
        .map(|p| hgrm_paths(p, sizes).into_iter().map(|(_, p)| p).collect())
        .unwrap_or_default();
    let outputs = [
        ("--json", cli.json.as_ref()),
        ("--out_json", out_json),
        ("--svg", cli.svg.as_ref()),
        ("--hlog", cli.hlog.as_ref()),
    ]
    .into_iter()
    .chain(hgrms.iter().map(|p| ("--hgrm", Some(p))));
    for (flag, path) in outputs {
        // --out_json replaces an earlier run's report, as perftest (looped scripts).
        let replaceable = |p: &PathBuf| flag == "--out_json" && is_earlier_report(p);
        if let Some(p) = path.filter(|p| std::fs::symlink_metadata(p).is_ok() && !replaceable(p)) {
            return Err(usage(format!(
                "{flag} {}: the file exists; shmhca-perf does not overwrite files: remove it, pick another name, or give --force",
                p.display()
            )));
        }
    }
    Ok(())
}

/// `-b`: write_bw and read_bw only.
fn check_bidirectional(cli: &Cli, test: TestKind) -> Result<(), PerfError> {
    if cli.bidirectional && !matches!(test, TestKind::WriteBw | TestKind::ReadBw) {
        return Err(usage(format!(
            "-b: shmhca-perf runs write_bw and read_bw bidirectionally, not {} (not yet for send_bw and atomic_bw; latency tests go both ways already)",
            test.name()
        )));
    }
    Ok(())
}

/// The fault stage: `--drop`, `--dup`, `--reorder`, `--delay`, `--corrupt` (rates, default
/// 0) and `--seed` (default 1), checked by [`shmhca::fault::FaultConfig::validate`].
fn faults(cli: &Cli) -> Result<shmhca::fault::FaultConfig, PerfError> {
    let faults = shmhca::fault::FaultConfig {
        drop: cli.drop.unwrap_or(0.0),
        duplicate: cli.dup.unwrap_or(0.0),
        reorder: cli.reorder.unwrap_or(0.0),
        delay: cli.delay.unwrap_or(0.0),
        corrupt: cli.corrupt.unwrap_or(0.0),
        seed: cli.seed.unwrap_or(1),
    };
    faults
        .validate()
        .map_err(|e| usage(format!("--drop/--dup/--reorder/--delay/--corrupt: {e}")))?;
    Ok(faults)
}

/// perftest's flags for what shmhca-perf does not offer: an error naming the flag and why.
fn refuse_unavailable(cli: &Cli) -> Result<(), PerfError> {
    let refusals: [(bool, &str, &str); 18] = [
        (
            cli.use_cuda.is_some(),
            "--use_cuda",
            "shmhca moves host memory only",
        ),
        (
            cli.use_rocm.is_some(),
            "--use_rocm",
            "shmhca moves host memory only",
        ),
        (
            cli.report_cycles,
            "-C",
            "times are reported in microseconds only (no reliable cycle counter frequency)",
        ),
        (cli.dualport, "-O", "a shmhca device has one port"),
        (
            cli.mcg,
            "-g",
            "multicast needs UD; shmhca implements RC only",
        ),
        (
            cli.mgid.is_some(),
            "-M",
            "multicast needs UD; shmhca implements RC only",
        ),
        (
            cli.use_srq,
            "--use-srq",
            "shmhca has shared receive queues (Context::create_srq), but shmhca-perf's Send tests post to each QP's own receive queue; leave --use-srq out",
        ),
        (
            cli.limit_bw.is_some(),
            "-w",
            "bandwidth limit checks are not available",
        ),
        (
            cli.limit_msgrate.is_some(),
            "-y",
            "message-rate limit checks are not available",
        ),
        (
            cli.cpu_util,
            "--cpu_util",
            "CPU utilisation is not measured",
        ),
        (
            cli.write_with_imm,
            "--write_with_imm",
            "shmhca has RDMA Write with Immediate (SendOp::RdmaWriteWithImm), but shmhca-perf's write_lat and write_bw post plain RDMA Writes; leave --write_with_imm out",
        ),
        (
            cli.odp,
            "--odp",
            "shmhca has no on-demand paging; memory is registered up front",
        ),
        (
            cli.mr_per_qp,
            "--mr_per_qp",
            "shmhca-perf registers one buffer for all QPs",
        ),
        (
            cli.recv_post_list.is_some(),
            "--recv_post_list",
            "receives are posted one at a time",
        ),
        (
            cli.latency_gap.is_some(),
            "--latency_gap",
            "latency iterations run back to back",
        ),
        (
            cli.payload_file_path.is_some(),
            "--payload_file_path",
            "the payload is shmhca-perf's own checked pattern",
        ),
        (cli.report_both, "--report-both", "the client reports"),
        (cli.reversed, "--reversed", "the client always initiates"),
    ];
    match refusals.iter().find(|(given, _, _)| *given) {
        Some((_, flag, why)) => Err(usage(format!(
            "{flag}: not available in shmhca-perf: {why}"
        ))),
        None => Ok(()),
    }
}

/// perftest's flags that have no meaning here and were given, as given (for the header).
fn ignored_flags(cli: &Cli) -> Vec<String> {
    let valued = [
        ("-d", &cli.ib_dev),
        ("-i", &cli.ib_port),
        ("-x", &cli.gid_index),
        ("-p", if cli.roce { &None } else { &cli.port }),
        ("-S", &cli.sl),
        ("-T", &cli.tos),
        ("-L", &cli.hop_limit),
        ("-W", &cli.report_counters),
        ("--pkey_index", &cli.pkey_index),
        ("--tclass", &cli.tclass),
        ("--flow_label", &cli.flow_label),
        ("--force-link", &cli.force_link),
        ("--numa_node", &cli.numa_node),
    ];
    let flags = [
        ("-F", cli.cpu_freq),
        ("-R", cli.rdma_cm),
        ("-z", cli.comm_rdma_cm),
        ("--use_old_post_send", cli.use_old_post_send),
        ("--dont_xchg_versions", cli.dont_xchg_versions),
        ("--use_hugepages", cli.use_hugepages),
        ("--data_validation", cli.data_validation),
        ("--ipv6", cli.ipv6),
        ("--no_lock", cli.no_lock),
        ("--disable_numa", cli.disable_numa),
        ("--data_validation_debug", cli.data_validation_debug),
    ];
    valued
        .iter()
        .filter_map(|(f, v)| v.as_ref().map(|v| format!("{f} {v}")))
        .chain(
            flags
                .iter()
                .filter(|(_, given)| *given)
                .map(|(f, _)| (*f).to_string()),
        )
        .collect()
}

/// `--pin_cores`: a list of cores and ranges (`0-3,8`), each of which must exist.
fn parse_core_list(list: Option<&str>) -> Result<Vec<usize>, PerfError> {
    let Some(list) = list else {
        return Ok(Vec::new());
    };
    let ncpu = std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| {
            let last = s.trim().rsplit(['-', ',']).next()?.parse::<usize>().ok()?;
            Some(last + 1)
        })
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let bad = |part: &str| {
        usage(format!(
            "--pin_cores {list}: `{part}` is not a core or a range; give e.g. --pin_cores 0-3,8"
        ))
    };
    let mut out = Vec::new();
    for part in list.split(',') {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let a: usize = a.trim().parse().map_err(|_| bad(part))?;
        let b: usize = b.trim().parse().map_err(|_| bad(part))?;
        if a > b {
            return Err(bad(part));
        }
        if b >= ncpu {
            return Err(usage(format!(
                "--pin_cores {list}: core {b} does not exist (this machine has cores 0 to {})",
                ncpu - 1
            )));
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
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
        assert_eq!((o.cq_mod, o.post_list), (16, 1));
        let o = parse(&["send_bw", "-t", "16", "-l", "64"]).unwrap();
        assert_eq!(o.post_list, 16);
    }

    #[test]
    fn host_must_be_this_machine() {
        for h in [
            "localhost",
            "LOCALHOST.",
            "localhost.localdomain",
            "ip6-localhost",
            "127.0.0.1",
            "127.3.2.1",
            "::1",
            "[::1]",
        ] {
            assert!(check_host(h).is_ok(), "{h}");
        }
        if let Ok(name) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
            assert!(check_host(name.trim()).is_ok(), "this machine's name");
        }
        for h in [
            "10.0.0.1",
            "192.0.2.7",
            "example.com",
            "128.0.0.1",
            "",
            "::2",
        ] {
            match check_host(h) {
                Err(PerfError::Usage(m)) => {
                    assert!(m.starts_with(&format!("HOST {h}:")), "{m}");
                    assert!(m.contains("localhost") && m.contains("--client"), "{m}");
                }
                other => panic!("HOST {h:?}: expected a usage error, got {other:?}"),
            }
        }
    }

    #[test]
    fn only_an_earlier_report_is_replaceable() {
        let dir = std::env::temp_dir().join(format!("shmhca-perf-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let at = |name: &str, content: &[u8]| {
            let p = dir.join(name);
            std::fs::write(&p, content).unwrap();
            p
        };
        let report = at(
            "r.json",
            br#"{"test_info": {"test": "Send_Latency_Test"}, "results": {}}"#,
        );
        assert!(is_earlier_report(&report));
        for (name, content) in [
            (
                "a.json",
                &br#"{"test_info": {"test": 1}, "results": {}}"#[..],
            ),
            ("b.json", br#"{"test_info": {"test": "x"}}"#),
            ("c.json", br#"{"results": {}, "test": "x"}"#),
            ("d.json", br#"[1, 2]"#),
            ("e.txt", b"my notes"),
        ] {
            assert!(!is_earlier_report(&at(name, content)), "{name}");
        }
        // A report of the bound's size is one; a byte more is not taken for one (nor read).
        let report_of = |len: usize| {
            let mut r = br#"{"test_info": {"test": "x"}, "results": {}, "pad": ""#.to_vec();
            r.resize(len - 2, b' ');
            r.extend_from_slice(br#""}"#);
            r
        };
        let max = MAX_REPORT_BYTES as usize;
        assert!(is_earlier_report(&at("max.json", &report_of(max))));
        assert!(!is_earlier_report(&at("big.json", &report_of(max + 1))));
        // A link to a report is not replaced (the rename would replace the link only).
        let link = dir.join("link.json");
        std::os::unix::fs::symlink(&report, &link).unwrap();
        assert!(!is_earlier_report(&link));
        assert!(!is_earlier_report(&dir.join("missing.json")));
        assert!(!is_earlier_report(&dir));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn latency_defaults_and_duration() {
        let o = parse(&["send_lat"]).unwrap();
        assert_eq!((o.tx_depth, o.qp_timeout), (1, DEFAULT_QP_TIMEOUT));
        assert_eq!(DEFAULT_QP_TIMEOUT, 18);
        let o = parse(&["send_bw"]).unwrap();
        assert_eq!(o.tx_depth, 128);
        let o = parse(&["read_lat", "-D", "8"]).unwrap();
        assert_eq!(o.timed, Some(Timed::Duration { secs: 8, margin: 2 }));
        assert!(usage_msg(&["send_lat", "--run_infinitely"]).contains("bandwidth tests"));
    }

    #[test]
    fn test_codes_round_trip() {
        for t in TestKind::ALL {
            assert_eq!(TestKind::from_code(t.code()), Some(t));
        }
        assert_eq!(TestKind::from_code(8), None);
    }
}
