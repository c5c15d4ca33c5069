//! `shmhca`: the command-line companion of the shmhca software HCA.
//!
//! * `shmhca doctor [--json]`: what this machine offers shmhca (huge pages, memfd and
//!   MFD_HUGETLB, transparent huge pages, CPUs and pinning) and the advice that follows.
//! * `shmhca devinfo [--json]`: the device's limits, page size, huge pages, the arena, and the
//!   RoCEv2 GID table (one entry per address of this host, with its interface's state and MTU).
//! * `shmhca rc-pingpong [-g N] [HOST]`: rdma-core's ibv_rc_pingpong over RoCEv2, speaking
//!   its TCP exchange, so it pairs with `ibv_rc_pingpong -g N` on any RoCE device.
//! * `shmhca plot FILE.hgrm|FILE.json [...] -o OUT.svg`: latency percentile distributions
//!   and latency/bandwidth against message size, several runs on one chart.
//! * `shmhca stat [--json] [--watch SECS [--count N]]`: every running shmhca context of this user: its
//!   process, mode, links and peers, QPs with state and PSNs, and counters.
//! * `shmhca exec -- CMD ARGS...`: runs an unmodified verbs program (perftest,
//!   `ibv_rc_pingpong`) over shmhca, with shmhca's `libibverbs.so.1` first on its path.
#![forbid(unsafe_code)]

mod devinfo;
mod doctor;
mod exec;
mod rc_pingpong;
mod stat;

use clap::{Parser, Subcommand};

/// The shmhca command.
#[derive(Debug, Parser)]
#[command(
    name = "shmhca",
    version,
    about = "The shmhca software HCA: machine checks and tools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Report what this machine offers shmhca: huge pages (and how to reserve them), memfd
    /// and MFD_HUGETLB support, CPUs and whether threads can be pinned.
    Doctor {
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show the device's limits and what its memory gets here: page size, huge pages, the
    /// arena of a default context.
    Devinfo {
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Draw runs as an SVG chart: HdrHistogram's latency percentile distribution (from
    /// .hgrm files or shmhca-perf --json), and latency/bandwidth against message size for
    /// runs over many sizes (-a). Several files: one line each, on the same charts.
    Plot {
        /// The runs: .hgrm (HdrHistogram percentile distribution) or .json (shmhca-perf --json).
        #[arg(required = true, value_name = "FILE")]
        files: Vec<std::path::PathBuf>,
        /// The SVG to write (refused if it exists, unless --force).
        #[arg(short = 'o', long = "output", value_name = "OUT.svg")]
        output: std::path::PathBuf,
        /// The chart's title.
        #[arg(long)]
        title: Option<String>,
        /// Overwrite OUT.svg if it exists.
        #[arg(long)]
        force: bool,
    },
    /// List every running shmhca context of this user: PID, mode, links and peers, QPs
    /// with state and PSNs, counters. Read from the stats area each engine publishes.
    Stat {
        /// Print JSON (one array per refresh).
        #[arg(long)]
        json: bool,
        /// Refresh every SECS seconds (like `watch`) until interrupted. On a terminal the
        /// screen is cleared before each refresh; otherwise (a pipe, a file) refreshes are
        /// written one after the other with no escape codes, and with --json one JSON
        /// document per line (NDJSON).
        #[arg(short = 'w', long = "watch", value_name = "SECS")]
        watch: Option<f64>,
        /// With --watch: stop after N refreshes (as `vmstat`/`iostat` take a count).
        #[arg(short = 'c', long = "count", value_name = "N", requires = "watch")]
        count: Option<u64>,
    },
    /// rdma-core's ibv_rc_pingpong over shmhca's RoCEv2 port, speaking its TCP exchange
    /// (LID:QPN:PSN:GID on port 18515): pairs with `ibv_rc_pingpong -g N` on any RoCE
    /// device. Server: `shmhca rc-pingpong -g N`; client: `shmhca rc-pingpong -g N HOST`.
    RcPingpong(rc_pingpong::Opts),
    /// Run an unmodified verbs program (perftest, ibv_rc_pingpong, ibv_devinfo) over
    /// shmhca: shmhca's libibverbs.so.1 (found next to this binary, or in
    /// $SHMHCA_VERBS_LIB_DIR) goes first on its library path. Example:
    /// `shmhca exec -- ib_send_lat -F`. With --roce, port 1 is a RoCEv2 (Ethernet) port
    /// whose GIDs are this host's IP addresses: `shmhca exec --roce -- ibv_rc_pingpong -g 1`.
    Exec {
        /// Make port 1 of shmhca0 a RoCEv2 port: link layer Ethernet, the host's addresses
        /// as GIDs, QPs connected over UDP 4791 to the GID their GRH names (sets
        /// SHMHCA_VERBS_LINK=roce).
        #[arg(long)]
        roce: bool,
        /// The command and its arguments.
        #[arg(
            required = true,
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "CMD"
        )]
        command: Vec<std::ffi::OsString>,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Exec { roce, command } => {
            let why = exec::run(&command, roce);
            eprintln!("shmhca exec: error: {why}");
            return std::process::ExitCode::from(127);
        }
        Command::Plot {
            files,
            output,
            title,
            force,
        } => {
            if let Err(e) = plot(&files, &output, title.as_deref(), force) {
                eprintln!("shmhca plot: error: {e}");
                return std::process::ExitCode::from(1);
            }
        }
        Command::RcPingpong(o) => match rc_pingpong::run(&o) {
            Ok(report) => println!("{report}"),
            Err(e) => {
                eprintln!("shmhca rc-pingpong: error: {e}");
                return std::process::ExitCode::from(1);
            }
        },
        Command::Devinfo { json } => {
            let v = devinfo::json();
            if json {
                println!("{v:#}");
            } else {
                print!("{}", devinfo::text(&v));
            }
        }
        Command::Stat { json, watch, count } => {
            if let Some(secs) = watch {
                if !(0.1..=3600.0).contains(&secs) {
                    eprintln!("shmhca stat: --watch {secs}: give 0.1 to 3600 seconds");
                    return std::process::ExitCode::from(2);
                }
            }
            if count == Some(0) {
                eprintln!("shmhca stat: --count 0: give at least 1 refresh");
                return std::process::ExitCode::from(2);
            }
            return stat_loop(json, watch, count);
        }
        Command::Doctor { json } => {
            let report = doctor::examine();
            if json {
                println!("{:#}", report.json());
            } else {
                print!("{}", report.text());
            }
        }
    }
    std::process::ExitCode::SUCCESS
}

/// `shmhca stat`, once or every `watch` seconds (`count` times, or until interrupted).
/// Stops quietly when stdout is closed (e.g. piped into `head`).
fn stat_loop(json: bool, watch: Option<f64>, count: Option<u64>) -> std::process::ExitCode {
    use std::io::{IsTerminal as _, Write as _};
    let clear = watch.is_some() && !json && std::io::stdout().is_terminal();
    let mut done = 0u64;
    loop {
        let mut notes = Vec::new();
        let found = stat::scan(&mut notes);
        let mut out = String::new();
        if clear {
            // Like watch(1): home the cursor and clear the screen (terminals only).
            out.push_str("\x1b[H\x1b[2J");
        } else if watch.is_some() && !json && done > 0 {
            out.push('\n');
        }
        if json && watch.is_some() {
            // NDJSON: one compact document per refresh, one per line.
            out.push_str(&stat::json(&found).to_string());
            out.push('\n');
        } else if json {
            out.push_str(&format!("{:#}\n", stat::json(&found)));
        } else {
            out.push_str(&stat::text(&found));
        }
        let mut stdout = std::io::stdout().lock();
        if stdout
            .write_all(out.as_bytes())
            .and_then(|()| stdout.flush())
            .is_err()
        {
            return std::process::ExitCode::SUCCESS;
        }
        drop(stdout);
        for n in &notes {
            eprintln!("shmhca stat: note: {n}");
        }
        done += 1;
        let Some(secs) = watch else { break };
        if count.is_some_and(|c| done >= c) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_secs_f64(secs));
    }
    std::process::ExitCode::SUCCESS
}

/// `shmhca plot`: reads each file as a run (by its extension), draws them, writes `out`.
fn plot(
    files: &[std::path::PathBuf],
    out: &std::path::Path,
    title: Option<&str>,
    force: bool,
) -> Result<(), String> {
    use shmhca_bench::plot::Run;
    if !force && std::fs::symlink_metadata(out).is_ok() {
        return Err(format!(
            "{}: the file exists; shmhca plot does not overwrite files: remove it, pick another name, or give --force",
            out.display()
        ));
    }
    let mut runs = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        let label = f.file_stem().map_or_else(
            || f.display().to_string(),
            |s| s.to_string_lossy().into_owned(),
        );
        let run = match f.extension().and_then(|e| e.to_str()) {
            Some("json") => serde_json::from_str(&text)
                .map_err(|e| format!("not JSON: {e}"))
                .and_then(|doc| Run::from_json(&label, &doc)),
            Some("hgrm") => Run::from_hgrm(&label, &text),
            _ => Err("give .hgrm (HdrHistogram percentile distribution) or .json (shmhca-perf --json) files".into()),
        }
        .map_err(|e| format!("{}: {e}", f.display()))?;
        runs.push(run);
    }
    let svg = shmhca_bench::plot::render(title.unwrap_or("shmhca"), &runs)?;
    let mut o = std::fs::OpenOptions::new();
    o.write(true);
    if force {
        o.create(true).truncate(true);
    } else {
        o.create_new(true);
    }
    let mut file = o.open(out).map_err(|e| format!("{}: {e}", out.display()))?;
    std::io::Write::write_all(&mut file, svg.as_bytes())
        .map_err(|e| format!("{}: {e}", out.display()))
}
