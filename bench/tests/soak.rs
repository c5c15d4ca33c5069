//! The soak in `cargo test`: mixed operations on several QPs with PMTUs 256 to 4096, sizes
//! 0 to 64 KiB, under 1% drop, 0.1% duplicate, 0.1% reorder and 0.01% corruption on both
//! ends; every byte and completion is checked (see `shmhca_bench::soak`).

use shmhca::fault::FaultConfig;
use shmhca_bench::soak::{SoakConfig, run_in_process};

fn faults(seed: u64) -> FaultConfig {
    FaultConfig {
        drop: 0.01,
        duplicate: 0.001,
        reorder: 0.001,
        delay: 0.0,
        corrupt: 0.0001,
        seed,
    }
}

fn messages() -> u64 {
    std::env::var("SHMHCA_SOAK_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

#[test]
fn soak_in_process_under_faults() {
    let cfg = SoakConfig {
        messages: messages(),
        qps: 5,
        seed: 42,
        faults: faults(7),
        ..SoakConfig::default()
    };
    let r = run_in_process(&cfg).unwrap_or_else(|e| panic!("soak failed: {e}"));
    println!("{r}");
    assert_eq!(r.messages, cfg.messages);
    let f = r.faults_req;
    assert!(f.dropped > 0 && f.duplicated > 0 && f.reordered > 0, "{r}");
}

#[test]
fn soak_in_process_without_faults() {
    let cfg = SoakConfig {
        messages: messages() / 10,
        qps: 3,
        seed: 5,
        ..SoakConfig::default()
    };
    let r = run_in_process(&cfg).unwrap_or_else(|e| panic!("soak failed: {e}"));
    assert_eq!(r.messages, cfg.messages);
    assert_eq!(
        r.stats_req.retransmitted + r.stats_resp.retransmitted,
        0,
        "{r}"
    );
}
