//! One capture file per process (issue 24, item 11): `SHMHCA_PCAP` is inherited by the
//! processes a program starts, and two processes writing one file interleave their
//! records into a file no reader can parse. A capture file another live process writes is
//! refused when named explicitly (`ContextBuilder::pcap`); named by `SHMHCA_PCAP`, this
//! process writes `NAME.PID.EXT` instead. Each file is a valid capture of its own process.
//!
//! Each test plays both parts: run normally it is the parent, which holds a capture and
//! starts this test binary again as a second process (with [`ROLE`] set) that tries the
//! same file.
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use shmhca::*;

/// Names the role of the re-executed second process.
const ROLE: &str = "SHMHCA_CAPTURE_TEST_ROLE";
/// The capture path the second process is given.
const PATH: &str = "SHMHCA_CAPTURE_TEST_PATH";

fn builder() -> ContextBuilder {
    Context::builder()
        .arena_size(4 << 20)
        .huge_pages(shmhca_rings::HugePages::Never)
        .mode(EngineMode::Poll { cpu: None })
}

/// Two contexts of this process tracing to `pcap` (one file, shared), linked, with one
/// Send and its Ack between them; `b` gives the builder its capture.
fn exchange(a: ContextBuilder, b: ContextBuilder) -> (End, End) {
    let (ca, cb) = (a.build().unwrap(), b.build().unwrap());
    let (la, lb) = ca.link_with(&cb).unwrap();
    let p = Params::default();
    let mut a = end(ca, la, &p);
    let mut b = end(cb, lb, &p);
    let (qa, qb) = (a.qp.qpn(), b.qp.qpn());
    connect(&mut a.qp, la, qb, 1, 2, &p);
    connect(&mut b.qp, lb, qa, 2, 1, &p);
    let sa = a.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let sb = b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    b.qp.post_recv(&RecvWr::new(1, &[sb.sge(0, 64).unwrap()]))
        .unwrap();
    a.qp.post_send(&SendWr::new(1, SendOp::Send, &[sa.sge(0, 8).unwrap()]))
        .unwrap();
    for (cq, what) in [(&mut b.cq, "receive"), (&mut a.cq, "send")] {
        let mut wc = [WorkCompletion::default()];
        assert_eq!(
            cq.poll_until(&mut wc, Duration::from_secs(20)),
            1,
            "no {what} completion in 20 s"
        );
        assert_eq!(wc[0].status, WcStatus::Success, "{what}: {:?}", wc[0]);
    }
    (a, b)
}

/// The frames of a classic pcap file with Ethernet framing, read here without the
/// encoder's help; fails on anything that does not parse to the last byte.
fn pcap_frames(path: &Path) -> Vec<Vec<u8>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(bytes.len() >= 24, "{}: no pcap header", path.display());
    let magic = u32::from_le_bytes(bytes[0..4].try_into().unwrap());
    assert!(
        magic == 0xA1B2_C3D4 || magic == 0xA1B2_3C4D,
        "{}: magic {magic:#x}",
        path.display()
    );
    assert_eq!(u32::from_le_bytes(bytes[20..24].try_into().unwrap()), 1);
    let mut frames = Vec::new();
    let mut at = 24;
    while at < bytes.len() {
        assert!(at + 16 <= bytes.len(), "{}: a torn record", path.display());
        let incl = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()) as usize;
        let orig = u32::from_le_bytes(bytes[at + 12..at + 16].try_into().unwrap()) as usize;
        assert_eq!(incl, orig, "{}: record at {at}", path.display());
        assert!(
            at + 16 + incl <= bytes.len(),
            "{}: a torn record",
            path.display()
        );
        let frame = &bytes[at + 16..at + 16 + incl];
        // Ethernet / IPv4 / UDP to 4791 (RoCEv2).
        assert_eq!(
            &frame[12..14],
            &[0x08, 0x00],
            "{}: EtherType",
            path.display()
        );
        assert_eq!(
            u16::from_be_bytes([frame[36], frame[37]]),
            4791,
            "{}: UDP port",
            path.display()
        );
        frames.push(frame.to_vec());
        at += 16 + incl;
    }
    frames
}

/// A private directory, removed at the end.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("shmhca-cap-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs this test binary's test `test` again as a second process in `role`, given `path`
/// (and with `SHMHCA_PCAP=path` if `env`); asserts it succeeded; its pid.
fn second_process(test: &str, role: &str, path: &Path, env: bool) -> u32 {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(PATH, path)
        .env_remove("SHMHCA_PCAP")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if env {
        cmd.env("SHMHCA_PCAP", path);
    }
    let mut child = cmd.spawn().unwrap();
    let pid = child.id();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the second process ({role}) failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    pid
}

/// In the second process: its role and the capture path, if it is one.
fn role() -> Option<(String, PathBuf)> {
    let role = std::env::var(ROLE).ok()?;
    Some((role, PathBuf::from(std::env::var_os(PATH)?)))
}

#[test]
fn a_capture_file_another_process_writes_is_refused_and_left_alone() {
    if let Some((role, path)) = role() {
        assert_eq!(role, "explicit");
        let err = builder().pcap(&path).build().unwrap_err().to_string();
        assert!(
            err.contains(&path.display().to_string()) && err.contains("another process"),
            "the refusal should name the file and why: {err}"
        );
        // `trace_to` on a running context: the same.
        let ctx = builder().build().unwrap();
        let err = ctx.trace_to(&path).unwrap_err().to_string();
        assert!(err.contains("another process"), "{err}");
        return;
    }
    let s = Scratch::new("explicit");
    let path = s.0.join("held.pcap");
    let (a, b) = exchange(builder().pcap(&path), builder().pcap(&path));
    second_process(
        "a_capture_file_another_process_writes_is_refused_and_left_alone",
        "explicit",
        &path,
        false,
    );
    // The refused process neither truncated nor wrote the file: it still holds this
    // process's capture, whole.
    drop((a, b));
    let frames = pcap_frames(&path);
    assert!(frames.len() >= 2, "the Send and its Ack: {}", frames.len());
}

#[test]
fn an_inherited_shmhca_pcap_taken_by_another_process_becomes_name_pid_ext() {
    if let Some((role, path)) = role() {
        assert_eq!(role, "inherited");
        // Both contexts of this process take the default, SHMHCA_PCAP, and share the
        // per-process file.
        let (a, b) = exchange(builder(), builder());
        drop((a, b));
        let mine = path.with_file_name(format!("held.{}.pcap", std::process::id()));
        assert!(mine.exists(), "{} was not written", mine.display());
        return;
    }
    let s = Scratch::new("inherited");
    let path = s.0.join("held.pcap");
    let (a, b) = exchange(builder().pcap(&path), builder().pcap(&path));
    let pid = second_process(
        "an_inherited_shmhca_pcap_taken_by_another_process_becomes_name_pid_ext",
        "inherited",
        &path,
        true,
    );
    drop((a, b));
    let theirs = s.0.join(format!("held.{pid}.pcap"));
    for file in [&path, &theirs] {
        let frames = pcap_frames(file);
        assert!(
            frames.len() >= 2,
            "{}: the Send and its Ack: {}",
            file.display(),
            frames.len()
        );
    }
    // Nothing else was written.
    let mut names: Vec<String> = std::fs::read_dir(&s.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut want = vec!["held.pcap".to_string(), format!("held.{pid}.pcap")];
    want.sort();
    assert_eq!(names, want);
}
