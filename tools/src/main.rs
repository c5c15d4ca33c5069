//! `shmhca`: the command-line companion of the shmhca software HCA.
//!
//! * `shmhca doctor [--json]`: what this machine offers shmhca (huge pages, memfd and
//!   MFD_HUGETLB, transparent huge pages, CPUs and pinning) and the advice that follows.
#![forbid(unsafe_code)]

mod doctor;

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
}

fn main() {
    let cli = Cli::parse();
    match cli.command {
        Command::Doctor { json } => {
            let report = doctor::examine();
            if json {
                println!("{:#}", report.json());
            } else {
                print!("{}", report.text());
            }
        }
    }
}
