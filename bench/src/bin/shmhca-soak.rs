//! `shmhca-soak`: mixed operations between two processes under injected faults, every
//! byte and completion checked (see [`shmhca_bench::soak`]).
//!
//! ```text
//! cargo run --release -p shmhca-bench --bin shmhca-soak -- --messages 10000000
//! shmhca-soak --messages 100000 --drop 0 --dup 0 --reorder 0 --corrupt 0   # fault-free
//! shmhca-soak --in-process                                                  # one process
//! ```
#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};

use clap::Parser;
use shmhca::fault::FaultConfig;
use shmhca_bench::soak::{self, SoakConfig};

/// Mixed RC operations between two processes under injected faults; fails on the first
/// wrong byte, missing, extra or out-of-order completion, error status or atomic value.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Messages in all.
    #[arg(long, default_value_t = 1_000_000)]
    messages: u64,
    /// Queue pairs (PMTUs 256, 512, 1024, 2048, 4096 in turn).
    #[arg(long, default_value_t = 5)]
    qps: usize,
    /// Seed of the message sequence.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Largest message in bytes (at most 65536).
    #[arg(long, default_value_t = soak::MAX_SIZE)]
    max_size: u32,
    /// Drop rate per packet, on each end.
    #[arg(long, default_value_t = 0.01)]
    drop: f64,
    /// Duplicate rate.
    #[arg(long, default_value_t = 0.001)]
    dup: f64,
    /// Reorder rate.
    #[arg(long, default_value_t = 0.001)]
    reorder: f64,
    /// Delay rate.
    #[arg(long, default_value_t = 0.0)]
    delay: f64,
    /// Corruption rate.
    #[arg(long, default_value_t = 0.0001)]
    corrupt: f64,
    /// Seed of the faults.
    #[arg(long, default_value_t = 7)]
    fault_seed: u64,
    /// Local Ack Timeout of the QPs, in one process or two (4.096 µs × 2^N; a loaded
    /// machine that leaves an engine unscheduled for 8 timeouts in a row fails the run
    /// with RetryExcErr).
    #[arg(long, default_value_t = soak::TWO_PROCESS_ACK_TIMEOUT)]
    ack_timeout: u8,
    /// Both ends in this process (two inline engines driven from one thread).
    #[arg(long)]
    in_process: bool,
    /// Run as the responder listening at this socket (the requester spawns it).
    #[arg(long, hide = true)]
    responder: Option<PathBuf>,
}

fn main() -> ExitCode {
    let a = Args::parse();
    if a.max_size > soak::MAX_SIZE || a.qps == 0 {
        eprintln!(
            "shmhca-soak: --max-size is at most {} and --qps at least 1",
            soak::MAX_SIZE
        );
        return ExitCode::from(2);
    }
    let cfg = SoakConfig {
        messages: a.messages,
        qps: a.qps,
        seed: a.seed,
        max_size: a.max_size,
        faults: FaultConfig {
            drop: a.drop,
            duplicate: a.dup,
            reorder: a.reorder,
            delay: a.delay,
            corrupt: a.corrupt,
            seed: a.fault_seed,
        },
        ack_timeout: a.ack_timeout,
    };
    if let Err(e) = cfg.faults.validate() {
        eprintln!("shmhca-soak: {e}");
        return ExitCode::from(2);
    }
    let result = if let Some(path) = &a.responder {
        soak::run_responder_process(&cfg, path).map(|()| None)
    } else if a.in_process {
        soak::run_in_process(&cfg).map(Some)
    } else {
        two_process(&cfg).map(Some)
    };
    match result {
        Ok(Some(r)) => {
            println!("{r}");
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shmhca-soak: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Spawns the responder process, runs the requester here, and adds the responder's
/// counters to the report.
fn two_process(cfg: &SoakConfig) -> Result<soak::SoakReport, String> {
    let dir = std::env::temp_dir().join(format!("shmhca-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let sock = dir.join("soak.sock");
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(std::env::args_os().skip(1))
        .arg("--responder")
        .arg(&sock)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("starting the responder process: {e}"))?;
    let mut lines = BufReader::new(child.stdout.take().ok_or("no stdout pipe")?).lines();
    let ready = matches!(lines.next(), Some(Ok(l)) if l == soak::READY);
    let result = if ready {
        soak::run_requester_process(cfg, &sock, || {
            for l in lines.by_ref() {
                match l {
                    Ok(l) if l == soak::GO => return Ok(()),
                    Ok(_) => {}
                    Err(e) => return Err(format!("reading the responder's output: {e}")),
                }
            }
            Err("the responder process ended before it was ready".into())
        })
    } else {
        Err("the responder process did not start".into())
    };
    let result = result.map(|mut r| {
        // Hang up (the requester's context is gone), then collect the responder's counters.
        for l in lines.by_ref().map_while(Result::ok) {
            if let Some((f, s)) = soak::parse_counters(&l) {
                r.faults_resp = f;
                r.stats_resp = s;
            }
        }
        r
    });
    if result.is_err() {
        let _ = child.kill();
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(&dir);
    let r = result?;
    if !status.success() {
        return Err(format!("the responder process failed ({status})"));
    }
    Ok(r)
}
