//! `SHMHCA_PCAP` with `shmhca-perf` (issue 24, item 11): the variable is inherited by the
//! peer process shmhca-perf starts, and both used to write one file, interleaving their
//! records. Now the client writes the file named and the server `NAME.server.EXT`; each is
//! a valid capture holding that process's packets, both directions.
//!
//! The files are read here with a pcap reader of the test's own; `tshark` also reads them
//! when it is installed (the check skips with one line when it is not).

mod common;
use common::{EXE, Scratch};

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs shmhca-perf in `scratch` with `SHMHCA_PCAP=pcap` (two minutes at most); asserts
/// success.
fn run(scratch: &Scratch, pcap: &str, args: &[&str]) -> Output {
    let mut child = Command::new(EXE)
        .args(args)
        .current_dir(&scratch.0)
        .env("TMPDIR", &scratch.0)
        .env("SHMHCA_PCAP", pcap)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("shmhca-perf {args:?} did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "shmhca-perf {args:?} failed ({})\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A captured packet: its IPv4 source and destination (the engines' capture addresses) and
/// its BTH opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Packet {
    src: [u8; 4],
    dst: [u8; 4],
    opcode: u8,
}

/// The packets of a classic pcap file of RoCEv2 frames; fails on anything that does not
/// parse to the last byte.
fn packets(path: &Path) -> Vec<Packet> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let what = path.display();
    assert!(bytes.len() >= 24, "{what}: no pcap header");
    let magic = u32::from_le_bytes(bytes[0..4].try_into().unwrap());
    assert!(
        magic == 0xA1B2_C3D4 || magic == 0xA1B2_3C4D,
        "{what}: magic {magic:#x}"
    );
    assert_eq!(
        u32::from_le_bytes(bytes[20..24].try_into().unwrap()),
        1,
        "{what}: linktype"
    );
    let mut out = Vec::new();
    let mut at = 24;
    while at < bytes.len() {
        assert!(
            at + 16 <= bytes.len(),
            "{what}: a torn record header at {at}"
        );
        let incl = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()) as usize;
        let orig = u32::from_le_bytes(bytes[at + 12..at + 16].try_into().unwrap()) as usize;
        assert_eq!(incl, orig, "{what}: record at {at}");
        assert!(
            at + 16 + incl <= bytes.len(),
            "{what}: a torn record at {at}"
        );
        let f = &bytes[at + 16..at + 16 + incl];
        // Ethernet (14) / IPv4 (20) / UDP (8) to 4791 / BTH (12) ... / ICRC (4).
        assert!(
            f.len() >= 14 + 20 + 8 + 12 + 4,
            "{what}: a short frame at {at}"
        );
        assert_eq!(&f[12..14], &[0x08, 0x00], "{what}: EtherType at {at}");
        let ip_len = u16::from_be_bytes([f[16], f[17]]) as usize;
        assert_eq!(ip_len, f.len() - 14, "{what}: IPv4 length at {at}");
        assert_eq!(u16::from_be_bytes([f[36], f[37]]), 4791, "{what}: UDP port");
        out.push(Packet {
            src: f[26..30].try_into().unwrap(),
            dst: f[30..34].try_into().unwrap(),
            opcode: f[42],
        });
        at += 16 + incl;
    }
    out
}

/// Whether tshark can be run; if not, says once that its check is skipped.
fn tshark() -> bool {
    match Command::new("tshark").arg("--version").output() {
        Ok(o) if o.status.success() => true,
        _ => {
            // Straight to the process's stderr, past the test harness's output capture.
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "perf_pcap: the tshark check is skipped: tshark is not installed (to run it: \
                 DEBIAN_FRONTEND=noninteractive apt-get install -y tshark)"
            );
            false
        }
    }
}

#[test]
fn the_client_and_its_spawned_server_each_write_a_capture_of_their_own() {
    let s = Scratch::new("two");
    let args = ["send_lat", "-s", "8", "-n", "50", "--warmup", "5"];
    run(&s, "run.pcap", &args);
    let client = s.0.join("run.pcap");
    let server = s.0.join("run.server.pcap");
    assert!(server.exists(), "the server wrote no run.server.pcap");
    let (c, v) = (packets(&client), packets(&server));
    // 55 Sends each way at least, seen by both: what each sent and what it received.
    for (name, p) in [("client", &c), ("server", &v)] {
        let sends = p.iter().filter(|p| p.opcode == 0x04).count();
        assert!(sends >= 110, "{name}: {sends} Sends captured");
        let sources: std::collections::BTreeSet<[u8; 4]> = p.iter().map(|p| p.src).collect();
        assert_eq!(sources.len(), 2, "{name}: both directions: {sources:?}");
    }
    // Nothing else was written next to them (no per-process fallback file).
    let mut names: Vec<String> = std::fs::read_dir(&s.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("pcap"))
        .collect();
    names.sort();
    assert_eq!(names, ["run.pcap", "run.server.pcap"]);
    if tshark() {
        for f in [&client, &server] {
            let out = Command::new("tshark")
                .arg("-r")
                .arg(f)
                .args([
                    "-Y",
                    "infiniband",
                    "-T",
                    "fields",
                    "-e",
                    "infiniband.bth.opcode",
                ])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "tshark -r {}: {}",
                f.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            let lines = String::from_utf8_lossy(&out.stdout).lines().count();
            assert!(
                lines >= 110,
                "tshark decodes {lines} InfiniBand packets in {}",
                f.display()
            );
        }
    }
}

#[test]
fn the_help_says_which_process_writes_which_capture() {
    let out = Command::new(EXE).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("SHMHCA_PCAP") && help.contains(".server"),
        "--help should say where each process captures:\n{help}"
    );
}

#[test]
fn the_server_capture_name_puts_server_before_the_extension() {
    use shmhca_bench::perf::setup::server_capture;
    assert_eq!(
        server_capture(Path::new("/tmp/run.pcap")),
        Path::new("/tmp/run.server.pcap")
    );
    assert_eq!(
        server_capture(Path::new("a.b.pcapng")),
        Path::new("a.b.server.pcapng")
    );
    assert_eq!(
        server_capture(Path::new("capture")),
        Path::new("capture.server")
    );
}
