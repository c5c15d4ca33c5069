//! perftest's output, byte for byte where perftest has it: the test header, the latency and
//! bandwidth tables, `-H`'s sample list; plus `--json` and `--hgrm`.

use std::fmt::Write as _;

use hdrhistogram::Histogram;
use serde_json::{Value, json};

use crate::perf::opts::{Options, TestKind, Verb};
use crate::perf::stats::{BwStats, LatStats, bw_unit};

/// perftest's separator line (87 dashes).
pub const RESULT_LINE: &str =
    "---------------------------------------------------------------------------------------";

/// perftest's latency table head (with its trailing space).
pub const LAT_HEAD: &str = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ";

/// perftest's bandwidth table head in MiB/s.
pub const BW_HEAD_MIB: &str =
    " #bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]";

/// perftest's bandwidth table head with `--report_gbits`.
pub const BW_HEAD_GBITS: &str =
    " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]";

/// One QP's line in the header's address block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddrLine {
    /// QP number.
    pub qpn: u32,
    /// Start PSN.
    pub psn: u32,
    /// Outstanding Reads/Atomics (read and atomic tests).
    pub outs: Option<u8>,
    /// Buffer R_Key and address (RDMA tests).
    pub rkey_vaddr: Option<(u32, u64)>,
}

impl AddrLine {
    fn render(&self, out: &mut String, who: &str) {
        let _ = write!(
            out,
            " {who} address: LID 0000 QPN {:#06x} PSN {:#08x}",
            self.qpn, self.psn
        );
        if let Some(o) = self.outs {
            let _ = write!(out, " OUT {o:#04x}");
        }
        if let Some((rkey, vaddr)) = self.rkey_vaddr {
            let _ = write!(out, " RKey {rkey:#08x} VAddr {vaddr:#016x}");
        }
        out.push('\n');
    }
}

/// What the header shows beyond the options.
#[derive(Debug, Clone)]
pub struct HeaderInfo {
    /// `inline` or `poll`.
    pub mode: String,
    /// What the QPs run over: `shm (huge pages)`, `shm (4 KiB pages)`, or
    /// `Ethernet (RoCEv2, UDP 4791 on ADDRESS)`.
    pub link: String,
    /// The QPs' path MTU in bytes (`-m`, or less where the interface's MTU caps it).
    pub mtu: u32,
    /// How the sides connected.
    pub exchange: &'static str,
    /// This side's QPs.
    pub local: Vec<AddrLine>,
    /// The peer's QPs.
    pub remote: Vec<AddrLine>,
}

/// perftest's name of the test's operation.
pub fn verb_title(verb: Verb) -> &'static str {
    match verb {
        Verb::Send => "Send",
        Verb::Write => "RDMA_Write",
        Verb::Read => "RDMA_Read",
        Verb::Atomic => "Atomic",
    }
}

/// The header both sides print before the table.
pub fn header(opts: &Options, info: &HeaderInfo) -> String {
    let t = opts.test;
    let mut s = String::new();
    if opts.timed.is_some() && !t.is_lat() {
        // perftest's words: a timed run reports no peak.
        s.push_str(" WARNING: BW peak won't be measured in this run.\n");
    }
    s.push_str(RESULT_LINE);
    s.push('\n');
    let kind = match (t.is_lat(), opts.bidirectional) {
        (true, _) => "Latency",
        (false, true) => "Bidirectional BW",
        (false, false) => "BW",
    };
    let _ = writeln!(
        s,
        "                    {} {kind} Test",
        verb_title(t.verb())
    );
    let _ = writeln!(s, " Dual-port       : OFF\t\tDevice         : shmhca");
    let _ = writeln!(s, " Number of qps   : {}\t\tTransport type : IB", opts.qps);
    let _ = writeln!(s, " Connection type : RC\t\tUsing SRQ      : OFF");
    let _ = writeln!(s, " TX depth        : {}", opts.tx_depth);
    if !t.is_lat() {
        let _ = writeln!(s, " CQ Moderation   : {}", opts.cq_mod);
    }
    if t == TestKind::SendBw {
        let _ = writeln!(s, " RX depth        : {}", opts.rx_depth);
    }
    let _ = writeln!(s, " Mtu             : {}[B]", info.mtu);
    let _ = writeln!(s, " Link type       : {}", info.link);
    match t.verb() {
        Verb::Read | Verb::Atomic => {
            let _ = writeln!(s, " Outstand reads  : {}", opts.outs);
        }
        Verb::Send | Verb::Write => {
            let _ = writeln!(s, " Max inline data : {}[B]", opts.inline);
        }
    }
    if t.verb() == Verb::Atomic {
        let _ = writeln!(s, " Atomic type     : {}", opts.atomic.name());
    }
    let _ = writeln!(s, " Engine mode     : {}", info.mode);
    let _ = writeln!(s, " Data ex. method : {}", info.exchange);
    if !opts.ignored.is_empty() {
        let _ = writeln!(
            s,
            " Ignored flags   : {} (no meaning here)",
            opts.ignored.join(" ")
        );
    }
    s.push_str(RESULT_LINE);
    s.push('\n');
    for (l, r) in info.local.iter().zip(&info.remote) {
        l.render(&mut s, "local");
        r.render(&mut s, "remote");
    }
    s.push_str(RESULT_LINE);
    s.push('\n');
    s
}

/// The table head for the test.
pub fn table_head(opts: &Options) -> &'static str {
    if opts.test.is_lat() {
        LAT_HEAD
    } else if opts.gbits {
        BW_HEAD_GBITS
    } else {
        BW_HEAD_MIB
    }
}

fn us(ns: f64) -> f64 {
    ns / 1000.0
}

/// Left-aligns `v` with two decimals in at least 7 columns (C's `%-7.2f`).
fn f2(v: f64) -> String {
    format!("{:<7}", format!("{v:.2}"))
}

/// One latency row, as perftest's `REPORT_FMT_LAT` prints it.
pub fn lat_row(size: u64, s: &LatStats) -> String {
    format!(
        " {:<7} {}          {}        {}      {}  \t       {}     \t{}\t\t{} \t\t{}",
        size,
        s.iters,
        f2(us(s.min_ns as f64)),
        f2(us(s.max_ns as f64)),
        f2(us(s.median_ns as f64)),
        f2(us(s.mean_ns)),
        f2(us(s.stdev_ns)),
        f2(us(s.p99_ns as f64)),
        f2(us(s.p999_ns as f64)),
    )
}

/// One bandwidth row, as perftest's `REPORT_FMT` prints it.
pub fn bw_row(s: &BwStats, gbits: bool) -> String {
    format!(
        " {:<7}    {:<10}       {}            {}\t\t     {:<7}",
        s.size,
        s.iters,
        f2(bw_unit(s.peak_bytes_per_sec, gbits)),
        f2(bw_unit(s.avg_bytes_per_sec, gbits)),
        format!("{:.6}", s.msg_rate_mpps),
    )
}

/// `-H`: every sample in µs, one per line, perftest's `#, usec` list.
pub fn samples_text(samples: &[u64]) -> String {
    let mut s = String::with_capacity(samples.len() * 16 + 16);
    s.push_str("#, usec\n");
    for (i, ns) in samples.iter().enumerate() {
        let _ = writeln!(s, "{}, {:.3}", i + 1, *ns as f64 / 1000.0);
    }
    s
}

/// HdrHistogram's classic percentile distribution (`.hgrm`), values in µs.
pub fn hgrm(h: &Histogram<u64>) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>12} {:>14} {:>10} {:>14}\n",
        "Value", "Percentile", "TotalCount", "1/(1-Percentile)"
    );
    let mut total = 0u64;
    for v in h.iter_quantiles(5) {
        total += v.count_since_last_iteration();
        let value = v.value_iterated_to() as f64 / 1000.0;
        let q = v.quantile_iterated_to();
        if q < 1.0 {
            let _ = writeln!(
                s,
                "{value:12.3} {q:2.12} {total:10} {:14.2}",
                1.0 / (1.0 - q)
            );
        } else {
            let _ = writeln!(s, "{value:12.3} {q:2.12} {total:10}");
        }
    }
    let sub_buckets = (2 * 10u64.pow(u32::from(h.sigfig()))).next_power_of_two();
    let _ = writeln!(
        s,
        "#[Mean    = {:12.3}, StdDeviation   = {:12.3}]",
        h.mean() / 1000.0,
        h.stdev() / 1000.0
    );
    let _ = writeln!(
        s,
        "#[Max     = {:12.3}, Total count    = {:12}]",
        h.max() as f64 / 1000.0,
        h.len()
    );
    let _ = writeln!(
        s,
        "#[Buckets = {:12}, SubBuckets     = {:12}]",
        h.buckets(),
        sub_buckets
    );
    s
}

/// The `--output` figure of a latency row (t_typical in µs).
pub fn output_lat(s: &LatStats) -> String {
    format!("{:.2}", us(s.median_ns as f64))
}

/// The `--output` figure of a bandwidth row.
pub fn output_bw(s: &BwStats, which: crate::perf::opts::OutputOnly, gbits: bool) -> String {
    match which {
        crate::perf::opts::OutputOnly::MessageRate => format!("{:.6}", s.msg_rate_mpps),
        _ => format!("{:.2}", bw_unit(s.avg_bytes_per_sec, gbits)),
    }
}

/// A latency row as JSON (µs, as printed, plus the exact ns).
pub fn lat_json(size: u64, s: &LatStats) -> Value {
    json!({
        "bytes": size,
        "iterations": s.iters,
        "t_min_usec": us(s.min_ns as f64),
        "t_max_usec": us(s.max_ns as f64),
        "t_typical_usec": us(s.median_ns as f64),
        "t_avg_usec": us(s.mean_ns),
        "t_stdev_usec": us(s.stdev_ns),
        "p99_usec": us(s.p99_ns as f64),
        "p99_9_usec": us(s.p999_ns as f64),
        "ns": {
            "min": s.min_ns, "max": s.max_ns, "median": s.median_ns, "mean": s.mean_ns,
            "stdev": s.stdev_ns, "p99": s.p99_ns, "p99_9": s.p999_ns,
        },
    })
}

/// A bandwidth row as JSON.
pub fn bw_json(s: &BwStats) -> Value {
    json!({
        "bytes": s.size,
        "iterations": s.iters,
        "qps": s.qps,
        "messages": s.messages,
        "elapsed_ns": s.elapsed_ns,
        "bw_peak_mib_sec": bw_unit(s.peak_bytes_per_sec, false),
        "bw_average_mib_sec": bw_unit(s.avg_bytes_per_sec, false),
        "bw_peak_gbit_sec": bw_unit(s.peak_bytes_per_sec, true),
        "bw_average_gbit_sec": bw_unit(s.avg_bytes_per_sec, true),
        "msg_rate_mpps": s.msg_rate_mpps,
    })
}

/// perftest's `--out_json` document: `test_info` with perftest's keys, `results` with
/// perftest's keys for the last size (perftest rewrites the file per size), and, for `-a`,
/// `results_all` with every size's (shmhca-perf's addition).
pub fn perftest_json(opts: &Options, exchange: &str, rows: &[Value]) -> Value {
    let t = opts.test;
    let lat = t.is_lat();
    let mut name = format!("{}_", verb_title(t.verb()));
    if t.verb() == Verb::Atomic {
        name.push_str(opts.atomic.name());
        name.push('_');
    }
    if !lat && opts.bidirectional {
        name.push_str("Bidirectional_");
    }
    if !lat && opts.post_list > 1 {
        name.push_str("Post_List_");
    }
    name.push_str(if lat { "Latency_Test" } else { "BW_Test" });
    let mut info = serde_json::Map::new();
    let mut put = |k: &str, v: Value| {
        info.insert(k.to_string(), v);
    };
    put("test", json!(name));
    put("Dual_port", json!("OFF"));
    put("Device", json!("shmhca"));
    put("Number_of_qps", json!(opts.qps));
    put("Transport_type", json!("IB"));
    put("Connection_type", json!("RC"));
    put("Using_SRQ", json!("OFF"));
    put("PCIe_relax_order", json!("Unsupported"));
    put("ibv_wr_API", json!("ON"));
    put("TX_depth", json!(opts.tx_depth));
    if !lat && opts.post_list > 1 {
        put("Post_List", json!(opts.post_list));
    }
    if !lat {
        put("CQ_Moderation", json!(opts.cq_mod));
    }
    put("Mtu", json!(opts.mtu));
    put("Link_type", json!("shm"));
    match t.verb() {
        Verb::Read | Verb::Atomic => put("Outstand_reads", json!(opts.outs)),
        Verb::Send | Verb::Write => put("Max_inline_data", json!(opts.inline)),
    }
    put("rdma_cm_QPs", json!("OFF"));
    put("Use_ROCm_memory", json!("OFF"));
    put("Use_MUSA_memory", json!("OFF"));
    put("Data_ex_method", json!(exchange));
    let results: Vec<Value> = rows.iter().map(|r| perftest_result(opts, r)).collect();
    let mut doc = json!({
        "test_info": Value::Object(info),
        "results": results.last().cloned().unwrap_or(Value::Null),
    });
    if results.len() > 1 {
        doc["results_all"] = Value::Array(results);
    }
    doc
}

/// One size's `results` in perftest's keys, from this tool's JSON row.
fn perftest_result(opts: &Options, r: &Value) -> Value {
    use crate::perf::opts::OutputOnly;
    let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
    if opts.test.is_lat() {
        if opts.output.is_some() {
            return json!({ "avg_lat": f("t_avg_usec") });
        }
        json!({
            "MsgSize": r["bytes"],
            "n_iterations": r["iterations"],
            "t_min": f("t_min_usec"),
            "t_max": f("t_max_usec"),
            "t_typical": f("t_typical_usec"),
            "t_avg": f("t_avg_usec"),
            "t_stdev": f("t_stdev_usec"),
            "percentile_99": f("p99_usec"),
            "percentile_99.9": f("p99_9_usec"),
        })
    } else {
        let (peak, avg) = if opts.gbits {
            (f("bw_peak_gbit_sec"), f("bw_average_gbit_sec"))
        } else {
            (f("bw_peak_mib_sec"), f("bw_average_mib_sec"))
        };
        match opts.output {
            Some(OutputOnly::Bandwidth) => json!({ "bw_avg": avg }),
            Some(OutputOnly::MessageRate) => json!({ "msgRate_avg": f("msg_rate_mpps") }),
            _ => json!({
                "MsgSize": r["bytes"],
                "n_iterations": r["iterations"],
                "BW_peak": peak,
                "BW_average": avg,
                "MsgRate": f("msg_rate_mpps"),
            }),
        }
    }
}

/// The run's parameters as JSON.
pub fn params_json(opts: &Options) -> Value {
    json!({
        "test": opts.test.name(),
        "sizes": opts.sizes,
        "all": opts.all,
        "iterations": opts.iters,
        "warmup": opts.warmup,
        "inline": opts.inline,
        "tx_depth": opts.tx_depth,
        "rx_depth": opts.rx_depth,
        "qps": opts.qps,
        "mtu": opts.mtu,
        "atomic_type": opts.atomic.name(),
        "cq_mod": opts.cq_mod,
        "post_list": opts.post_list,
        "duration": opts.timed.map(|t| match t {
            crate::perf::opts::Timed::Duration { secs, margin } => json!({"seconds": secs, "margin": margin}),
            crate::perf::opts::Timed::Forever { every } => json!({"forever_report_every": every}),
        }),
        "no_peak": opts.no_peak,
        "bidirectional": opts.bidirectional,
        "qp_timeout": opts.qp_timeout,
        "retry_count": opts.retry_count,
        "ignored_flags": opts.ignored,
        "outstanding_reads": opts.outs,
        "mode": match opts.mode { crate::perf::opts::ModeArg::Inline => "inline", crate::perf::opts::ModeArg::Poll => "poll" },
        "cpus": opts.cpus,
        "engine_cpus": opts.engine_cpus,
        "one_way": matches!(opts.test, TestKind::SendLat | TestKind::WriteLat),
    })
}

/// The machine the run was on.
pub fn machine_json() -> Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let uname = rustix::system::uname();
    json!({
        "hostname": uname.nodename().to_string_lossy(),
        "kernel": format!("{} {}", uname.sysname().to_string_lossy(), uname.release().to_string_lossy()),
        "arch": std::env::consts::ARCH,
        "cpu_model": model,
        "cpus": cpuinfo.lines().filter(|l| l.starts_with("processor")).count(),
        "cpus_this_thread_may_use": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "hugepages_total": read("/proc/sys/vm/nr_hugepages").trim().parse::<u64>().unwrap_or(0),
    })
}

/// Versions of the tool and the library.
pub fn versions_json() -> Value {
    json!({
        "shmhca_perf": env!("CARGO_PKG_VERSION"),
        "shmhca": env!("CARGO_PKG_VERSION"),
        "param_protocol": crate::perf::params::VERSION,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_row_has_perftests_spacing() {
        let s = LatStats {
            iters: 1000,
            min_ns: 1240,
            max_ns: 5190,
            median_ns: 1270,
            mean_ns: 1270.0,
            stdev_ns: 0.0,
            p99_ns: 1370,
            p999_ns: 5190,
        };
        assert_eq!(
            lat_row(2, &s),
            " 2       1000          1.24           5.19         1.27     \t       1.27        \t0.00   \t\t1.37    \t\t5.19   "
        );
    }

    #[test]
    fn bandwidth_row_has_perftests_spacing() {
        let s = BwStats {
            size: 65536,
            iters: 1000,
            qps: 1,
            messages: 1000,
            elapsed_ns: 1,
            peak_bytes_per_sec: 46567.34 * 1_048_576.0,
            avg_bytes_per_sec: 46557.03 * 1_048_576.0,
            msg_rate_mpps: 0.744912,
        };
        assert_eq!(
            bw_row(&s, false),
            " 65536      1000             46567.34            46557.03\t\t     0.744912"
        );
    }

    #[test]
    fn hgrm_ends_at_the_maximum_with_the_total() {
        let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3).unwrap();
        for v in 1..=1000u64 {
            h.record(v * 1000).unwrap();
        }
        let text = hgrm(&h);
        assert!(text.starts_with("       Value     Percentile TotalCount 1/(1-Percentile)\n\n"));
        let last_row = text
            .lines()
            .rfind(|l| !l.starts_with('#') && !l.trim().is_empty())
            .unwrap();
        let cols: Vec<&str> = last_row.split_whitespace().collect();
        assert_eq!(cols.len(), 3, "{last_row}");
        let top = h.highest_equivalent(1_000_000) as f64 / 1000.0;
        assert_eq!(cols[0], format!("{top:.3}"));
        assert_eq!(cols[1], "1.000000000000");
        assert_eq!(cols[2], "1000");
        assert!(text.contains("Total count    =         1000]"));
    }

    #[test]
    fn samples_are_listed_in_microseconds() {
        assert_eq!(samples_text(&[1500, 2]), "#, usec\n1, 1.500\n2, 0.002\n");
    }
}
