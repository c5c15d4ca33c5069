//! `shmhca`: the command-line companion of the shmhca software HCA.
//!
//! * `shmhca doctor [--json]`: what this machine offers shmhca (huge pages, memfd and
//!   MFD_HUGETLB, transparent huge pages, CPUs and pinning) and the advice that follows.
//! * `shmhca devinfo [--json]`: the device's limits, page size, huge pages and the arena.
//! * `shmhca stat [--json] [--watch SECS]`: every running shmhca context of this user: its
//!   process, mode, links and peers, QPs with state and PSNs, and counters.
#![forbid(unsafe_code)]

mod devinfo;
mod doctor;
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
    /// List every running shmhca context of this user: PID, mode, links and peers, QPs
    /// with state and PSNs, counters. Read from the stats area each engine publishes.
    Stat {
        /// Print JSON (one array per refresh).
        #[arg(long)]
        json: bool,
        /// Refresh every SECS seconds (like `watch`) until interrupted.
        #[arg(short = 'w', long = "watch", value_name = "SECS")]
        watch: Option<f64>,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Devinfo { json } => {
            let v = devinfo::json();
            if json {
                println!("{v:#}");
            } else {
                print!("{}", devinfo::text(&v));
            }
        }
        Command::Stat { json, watch } => {
            if let Some(secs) = watch {
                if !(0.1..=3600.0).contains(&secs) {
                    eprintln!("shmhca stat: --watch {secs}: give 0.1 to 3600 seconds");
                    return std::process::ExitCode::from(2);
                }
            }
            loop {
                let mut notes = Vec::new();
                let found = stat::scan(&mut notes);
                if watch.is_some() && !json {
                    // Like watch(1): home the cursor and clear the screen.
                    print!("\x1b[H\x1b[2J");
                }
                if json {
                    println!("{:#}", stat::json(&found));
                } else {
                    print!("{}", stat::text(&found));
                }
                for n in &notes {
                    eprintln!("shmhca stat: note: {n}");
                }
                let Some(secs) = watch else { break };
                let _ = std::io::Write::flush(&mut std::io::stdout());
                std::thread::sleep(std::time::Duration::from_secs_f64(secs));
            }
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
