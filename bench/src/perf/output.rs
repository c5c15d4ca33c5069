//! What the client prints and writes: the header, the table as it fills, `-H`,
//! `--output`, `--json` and `--hgrm`.

use std::io::Write as _;

use serde_json::{Value, json};

use crate::perf::error::PerfError;
use crate::perf::lat::Progress;
use crate::perf::opts::{ModeArg, Options, TestKind, hgrm_paths};
use crate::perf::report::{self, HeaderInfo};
use crate::perf::setup::Side;
use crate::perf::stats::{BwStats, LatRecorder, LatStats, rss_kib};

/// What a side's header says.
fn header_info(opts: &Options, side: &Side) -> HeaderInfo {
    let (local, remote) = side.addr_lines(opts.test, opts.outs);
    HeaderInfo {
        mode: match opts.mode {
            ModeArg::Inline => "inline".into(),
            ModeArg::Poll => "poll".into(),
        },
        link: match &side.udp {
            Some(port) => format!("Ethernet (RoCEv2, UDP 4791 on {})", port.local_addr().ip()),
            None if side.res.ctx.page_size() == shmhca_rings::PageSize::Huge2M => {
                "shm (huge pages)".into()
            }
            None => "shm (4 KiB pages)".into(),
        },
        mtu: match &side.udp {
            Some(port) => crate::perf::roce::path_mtu(opts.mtu, port),
            None => opts.mtu,
        },
        exchange: side.exchange,
        local,
        remote,
    }
}

/// The header a side prints.
pub(crate) fn header_text(opts: &Options, side: &Side) -> String {
    report::header(opts, &header_info(opts, side))
}

/// The client's output: the table as it fills, `-H`, `--output`, `--json`, `--hgrm`.
#[derive(Debug)]
pub struct Output {
    pub(crate) rec: LatRecorder,
    pub(crate) bw: BwStats,
    pub(crate) quiet: Progress,
    rows: Vec<Value>,
    samples: Vec<(u64, Vec<u64>)>,
    hgrms: Vec<(u64, String)>,
    stdout: std::io::Stdout,
    rss_after_kib: u64,
    rss_measure_start_kib: Option<u64>,
    /// When the run started (the interval log's StartTime).
    hlog_start: std::time::SystemTime,
}

impl Output {
    pub(crate) fn new(opts: &Options) -> Output {
        let mut rec = LatRecorder::new(opts.histogram.then_some(opts.iters as usize));
        if opts.hlog.is_some() {
            rec.log_intervals(std::time::Duration::from_secs(1));
        }
        Output {
            hlog_start: std::time::SystemTime::now(),
            rec,
            bw: BwStats::default(),
            quiet: Progress::new(String::new(), 1, 0, false),
            rows: Vec::new(),
            samples: Vec::new(),
            hgrms: Vec::new(),
            stdout: std::io::stdout(),
            rss_after_kib: 0,
            rss_measure_start_kib: None,
        }
    }

    /// Notes the RSS when the first measurement starts (after its warm-up).
    pub(crate) fn note_measure_start(&mut self) {
        if self.rss_measure_start_kib.is_none() {
            self.rss_measure_start_kib = Some(rss_kib());
        }
    }

    pub(crate) fn start(&mut self, opts: &Options, side: &Side) {
        self.rss_after_kib = side.rss_after_kib;
        if opts.output.is_none() {
            let mut o = self.stdout.lock();
            let _ = write!(o, "{}", header_text(opts, side));
            let _ = writeln!(o, "{}", report::table_head(opts));
            let _ = o.flush();
        }
    }

    pub(crate) fn row(&mut self, opts: &Options, size: u64) {
        let mut o = self.stdout.lock();
        if opts.test.is_lat() {
            let s: LatStats = self.rec.stats();
            match opts.output {
                Some(_) => {
                    let _ = writeln!(o, "{}", report::output_lat(&s));
                }
                None => {
                    let _ = writeln!(o, "{}", report::lat_row(size, &s));
                }
            }
            let mut row = report::lat_json(size, &s);
            // The distribution, for --svg and `shmhca plot` (percentile, µs).
            row["percentiles"] = Value::Array(
                self.rec
                    .histogram()
                    .iter_quantiles(5)
                    .filter(|v| v.quantile_iterated_to() < 1.0)
                    .map(|v| {
                        json!([
                            v.quantile_iterated_to(),
                            v.value_iterated_to() as f64 / 1000.0
                        ])
                    })
                    .collect(),
            );
            self.rows.push(row);
            if opts.histogram {
                let mut v = self.rec.samples().to_vec();
                // perftest's -H lists the samples sorted; -U in the order measured.
                if !opts.unsorted {
                    v.sort_unstable();
                }
                self.samples.push((size, v));
            }
            if opts.hgrm.is_some() {
                self.hgrms.push((size, report::hgrm(self.rec.histogram())));
            }
        } else {
            match opts.output {
                Some(w) => {
                    let _ = writeln!(o, "{}", report::output_bw(&self.bw, w, opts.gbits));
                }
                None => {
                    let _ = writeln!(o, "{}", report::bw_row(&self.bw, opts.gbits));
                }
            }
            self.rows.push(report::bw_json(&self.bw));
        }
        let _ = o.flush();
    }

    pub(crate) fn finish(&mut self, opts: &Options, side: &Side) -> Result<(), PerfError> {
        self.finish_with(opts, side, rss_kib())
    }

    pub(crate) fn finish_with(
        &mut self,
        opts: &Options,
        side: &Side,
        rss_end_kib: u64,
    ) -> Result<(), PerfError> {
        {
            let mut o = self.stdout.lock();
            if opts.output.is_none() {
                let _ = writeln!(o, "{}", report::RESULT_LINE);
                if !opts.faults.is_none() {
                    let _ = writeln!(o, "{}", faults_line(side));
                }
            }
            for (size, samples) in &self.samples {
                if self.samples.len() > 1 {
                    let _ = writeln!(o, "# {size} bytes");
                }
                let _ = write!(o, "{}", report::samples_text(samples));
            }
            let _ = o.flush();
        }
        if let Some(path) = &opts.hgrm {
            // One file per size.
            for ((_, path), (_, text)) in hgrm_paths(path, &opts.sizes).iter().zip(&self.hgrms) {
                write_new(path, text.as_bytes(), opts.force)?;
            }
        }
        if let Some(path) = &opts.hlog {
            write_new(path, &self.hlog_text(opts)?, opts.force)?;
        }
        if let Some(path) = &opts.svg {
            let doc = json!({ "results": self.rows });
            let run =
                crate::plot::Run::from_json(opts.test.name(), &doc).map_err(PerfError::Peer)?;
            let title = format!(
                "shmhca-perf {} ({} mode{})",
                opts.test.name(),
                header_info(opts, side).mode,
                if opts.test.is_lat() && matches!(opts.test, TestKind::SendLat | TestKind::WriteLat)
                {
                    ", one-way latency"
                } else {
                    ""
                }
            );
            let svg = crate::plot::render(&title, &[run]).map_err(PerfError::Peer)?;
            write_new(path, svg.as_bytes(), opts.force)?;
        }
        if let Some(path) = &opts.out_json {
            let doc = report::perftest_json(opts, header_info(opts, side).exchange, &self.rows);
            let text = serde_json::to_string_pretty(&doc)
                .map_err(|e| PerfError::Peer(format!("encoding the JSON report: {e}")))?;
            let bytes = (text + "\n").into_bytes();
            if !opts.force && crate::perf::opts::is_earlier_report(path) {
                replace_report(path, &bytes)?;
            } else {
                write_new(path, &bytes, opts.force)?;
            }
        }
        if let Some(path) = &opts.json {
            let info = header_info(opts, side);
            let st = side.res.ctx.stats();
            let engine_stats = json!({
                "packets_sent": st.packets_sent,
                "packets_received": st.packets_received,
                "payload_bytes_copied": st.payload_bytes_copied,
                "inline_bytes_sent": st.inline_bytes_sent,
                "acks_sent": st.acks_sent,
                "acks_riding": st.acks_riding,
                "naks_sent": st.naks_sent,
                "retransmitted": st.retransmitted,
                "timeouts": st.timeouts,
                "rnr_naks_received": st.rnr_naks_received,
                "dropped": st.dropped,
                "faults": fault_json(side.res.ctx.fault_stats()),
            });
            let doc = json!({
                "tool": "shmhca-perf",
                "test": opts.test.name(),
                "kind": if opts.test.is_lat() { "latency" } else { "bandwidth" },
                "latency_is": match opts.test {
                    TestKind::SendLat | TestKind::WriteLat => "one-way (round trip / 2)",
                    TestKind::ReadLat | TestKind::AtomicLat => "round trip",
                    _ => "n/a",
                },
                "bw_unit": if opts.gbits { "Gb/sec" } else { "MiB/sec" },
                "params": report::params_json(opts),
                "engine": {
                    "mode": info.mode,
                    "huge_pages": side.res.ctx.page_size() == shmhca_rings::PageSize::Huge2M,
                    "link": info.link,
                    "path_mtu": info.mtu,
                    "exchange": info.exchange,
                    "arena_bytes": crate::perf::opts::arena_bytes(opts.max_size(), opts.qps, opts.tx_depth, opts.inline),
                    "qps": side.qps.iter().map(|q| {
                        let c = q.config();
                        json!({"qpn": q.qpn().get(), "psn": c.sq_psn.get(),
                               "peer_qpn": c.dest.map_or(0, |d| d.qpn.get()),
                               "mtu": c.path_mtu.bytes(), "max_rd_atomic": c.max_rd_atomic,
                               "memory_bytes": q.memory_bytes()})
                    }).collect::<Vec<_>>(),
                },
                "engine_stats": engine_stats,
                "machine": report::machine_json(),
                "versions": report::versions_json(),
                "rss_kib": {
                    "before_setup": side.res.rss_before_kib,
                    "after_setup": self.rss_after_kib,
                    "measure_start": self.rss_measure_start_kib,
                    "end": rss_end_kib,
                    "setup_delta": self.rss_after_kib.saturating_sub(side.res.rss_before_kib),
                },
                "results": self.rows,
            });
            let text = serde_json::to_string_pretty(&doc)
                .map_err(|e| PerfError::Peer(format!("encoding the JSON report: {e}")))?;
            write_new(path, (text + "\n").as_bytes(), opts.force)?;
        }
        Ok(())
    }
}

impl Output {
    /// `--hlog`: HdrHistogram's interval log (V2 compressed histograms, values in ns, the
    /// interval maxima in µs), one interval per second of measurement, tagged `size-N`.
    fn hlog_text(&self, opts: &Options) -> Result<Vec<u8>, PerfError> {
        use hdrhistogram::serialization::V2DeflateSerializer;
        use hdrhistogram::serialization::interval_log::{IntervalLogWriterBuilder, Tag};
        let mut buf = Vec::new();
        let mut ser = V2DeflateSerializer::new();
        let fail = |e: String| PerfError::Peer(format!("encoding the interval log: {e}"));
        let mut w = IntervalLogWriterBuilder::new()
            .add_comment(&format!(
                "shmhca-perf {} interval log: latencies in ns ({}), one interval per second",
                opts.test.name(),
                match opts.test {
                    TestKind::SendLat | TestKind::WriteLat => "one-way: round trip / 2",
                    _ => "round trip",
                }
            ))
            .with_start_time(self.hlog_start)
            .with_base_time(self.hlog_start)
            .with_max_value_divisor(1000.0)
            .begin_log_with(&mut buf, &mut ser)
            .map_err(|e| fail(e.to_string()))?;
        for (size, start, len, h) in self.rec.intervals() {
            let tag = format!("size-{size}");
            w.write_histogram(h, *start, *len, Tag::new(&tag))
                .map_err(|e| fail(e.to_string()))?;
        }
        drop(w);
        Ok(buf)
    }
}

/// Writes `bytes` to a new file at `path`. shmhca-perf never overwrites a file it did not
/// create: an existing `path` is an error unless `force` (the user's `--force`).
///
/// # Errors
/// [`PerfError::Usage`] if `path` exists (without `force`), [`PerfError::Io`] if it cannot
/// be written.
pub fn write_new(path: &std::path::Path, bytes: &[u8], force: bool) -> Result<(), PerfError> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true);
    if force {
        o.create(true).truncate(true);
    } else {
        o.create_new(true);
    }
    let mut f = o.open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            PerfError::Usage(format!(
                "{}: the file exists (it appeared during the run); shmhca-perf does not overwrite files: remove it, pick another name, or give --force",
                path.display()
            ))
        } else {
            PerfError::Io {
                what: format!("creating {}", path.display()),
                source: e,
            }
        }
    })?;
    f.write_all(bytes)
        .map_err(PerfError::io(format!("writing {}", path.display())))
}

/// Replaces an earlier `--out_json` report at `path` with `bytes`, as perftest rewrites its
/// file on every run: written to a new file beside it, then renamed over it, so that the
/// old report is replaced whole or not at all (never left half written).
fn replace_report(path: &std::path::Path, bytes: &[u8]) -> Result<(), PerfError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.shmhca-perf-{}.tmp", std::process::id()));
    write_new(&tmp, bytes, false)?;
    std::fs::rename(&tmp, path).map_err(|e| {
        // The temporary file is this run's own: removing it deletes nothing of anyone else.
        let _ = std::fs::remove_file(&tmp);
        PerfError::Io {
            what: format!("replacing the earlier report {}", path.display()),
            source: e,
        }
    })
}

/// The report line of a run with injected faults: what this process's fault stage did
/// and how its engine recovered.
pub(crate) fn faults_line(side: &Side) -> String {
    let f = side.res.ctx.fault_stats();
    let st = side.res.ctx.stats();
    format!(
        " faults (this side): {} packets sent, {} dropped, {} duplicated, {} reordered, {} delayed, {} corrupted; {} received packets failed the ICRC check; {} retransmitted, {} timeouts, {} Naks received, {} sequence-error Naks sent",
        f.packets,
        f.dropped,
        f.duplicated,
        f.reordered,
        f.delayed,
        f.corrupted,
        f.icrc_dropped,
        st.retransmitted,
        st.timeouts,
        st.naks_received,
        st.seq_err_naks_sent
    )
}

fn fault_json(f: shmhca::fault::FaultStats) -> serde_json::Value {
    json!({
        "packets": f.packets,
        "dropped": f.dropped,
        "duplicated": f.duplicated,
        "reordered": f.reordered,
        "delayed": f.delayed,
        "corrupted": f.corrupted,
        "icrc_dropped": f.icrc_dropped,
    })
}
