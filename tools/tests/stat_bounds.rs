//! `shmhca stat` against processes that hold stats areas in ways no engine does: many
//! descriptors of one area, more areas than are read per process, an area that lies about
//! its pid; and `--watch` into a pipe (no escape codes; with `--json`, one document per
//! line). The areas are made here with the segment API, as a hostile process could.

use std::io::{BufRead, BufReader};
use std::os::fd::OwnedFd;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use shmhca::stats_area::{LAYOUT, MEMFD_NAME, STATS_KIND};
use shmhca_rings::segment::{HugePages, Segment, Sharing};

const EXE: &str = env!("CARGO_BIN_EXE_shmhca");
const CHILD_ENV: &str = "SHMHCA_STAT_BOUNDS_CHILD";
/// The data length an engine's area has (one 8 KiB data area: see `stats_area`).
const DATA_LEN: usize = 8192;
/// Descriptors of one area the child holds.
const DUPS: usize = 2000;
/// Distinct areas the child holds besides (more than `shmhca stat` reads per process).
const EXTRA_AREAS: u32 = 80;
/// What `shmhca stat` reads from one process (tools/src/stat.rs).
const MAX_AREAS_PER_PROCESS: usize = 64;
/// The pid the lying area claims.
const LIE: u32 = 1;

/// A stats area as an engine writes it, with `pid` as the pid it claims.
fn area(pid: u32, engine_id: u32) -> Segment {
    let seg = Segment::builder(STATS_KIND, DATA_LEN)
        .name(MEMFD_NAME)
        .huge_pages(HugePages::Never)
        .sharing(Sharing::CreatorWrites)
        .create()
        .unwrap();
    seg.write_at(4, &LAYOUT.to_le_bytes()).unwrap();
    seg.write_at(8, &pid.to_le_bytes()).unwrap();
    seg.write_at(12, &engine_id.to_le_bytes()).unwrap();
    seg
}

/// The child's body (runs only with `SHMHCA_STAT_BOUNDS_CHILD` set; returns at once in a
/// normal test run). `many`: one area (engine 7, its true pid) held `DUPS` times plus
/// `EXTRA_AREAS` more; `liar`: one area (engine 8) claiming pid `LIE`.
#[test]
fn areas_child() {
    let Some(mode) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let me = std::process::id();
    let mut keep: Vec<Segment> = Vec::new();
    let mut dups: Vec<OwnedFd> = Vec::new();
    if mode == "many" {
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let lim = getrlimit(Resource::Nofile);
        let want = (DUPS + EXTRA_AREAS as usize + 64) as u64;
        if lim.current.is_some_and(|c| c < want) {
            if lim.maximum.is_some_and(|m| m < want) {
                println!("skip: RLIMIT_NOFILE hard limit below {want}");
                return;
            }
            setrlimit(
                Resource::Nofile,
                Rlimit {
                    current: Some(want),
                    maximum: lim.maximum,
                },
            )
            .unwrap();
        }
        let one = area(me, 7);
        for _ in 0..DUPS {
            dups.push(one.try_clone_fd().unwrap());
        }
        keep.push(one);
        for i in 0..EXTRA_AREAS {
            keep.push(area(me, 100 + i));
        }
    } else {
        keep.push(area(LIE, 8));
    }
    println!("ready");
    // Killed by the test; bounded in case it is not.
    std::thread::sleep(Duration::from_secs(300));
    drop((keep, dups));
}

/// Starts the child in `mode` and waits for it to be ready. `None` (after one line) if
/// it cannot run here.
fn child(mode: &str) -> Option<Child> {
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "areas_child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_ENV, mode)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = c.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            if l.ends_with("ready") || l.contains("skip:") {
                let _ = tx.send(l);
            }
        }
    });
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(l) if l.ends_with("ready") => Some(c),
        Ok(l) => {
            eprintln!("{l}");
            let _ = c.kill();
            let _ = c.wait();
            None
        }
        Err(_) => {
            let _ = c.kill();
            let _ = c.wait();
            panic!("the child never became ready");
        }
    }
}

fn stop(mut c: Child) {
    let _ = c.kill();
    let _ = c.wait();
}

fn stat(args: &[&str]) -> std::process::Output {
    let out = Command::new(EXE).arg("stat").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn array(v: Value) -> Vec<Value> {
    match v {
        Value::Array(v) => v,
        other => panic!("not an array: {other}"),
    }
}

#[test]
fn many_descriptors_of_one_area_are_listed_once_and_areas_per_process_are_capped() {
    let Some(c) = child("many") else { return };
    let pid = c.id();
    let out = stat(&["--json"]);
    stop(c);
    let all = array(serde_json::from_slice(&out.stdout).unwrap());
    let mine: Vec<&Value> = all.iter().filter(|a| a["pid"] == pid).collect();
    let dup: Vec<&&Value> = mine.iter().filter(|a| a["engine"] == 7).collect();
    assert_eq!(
        dup.len(),
        1,
        "the area held {DUPS} + 1 times is listed once"
    );
    assert_eq!(dup[0]["fds"], DUPS as u64 + 1, "{:#}", dup[0]);
    assert_eq!(
        mine.len(),
        MAX_AREAS_PER_PROCESS,
        "at most this many per process"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let skipped = 1 + EXTRA_AREAS as usize - MAX_AREAS_PER_PROCESS;
    assert!(
        err.contains(&format!("pid {pid}: {skipped} stats area(s) not read")),
        "{err}"
    );
    // Bounded output: what is printed is what is listed (an area's document is a few KiB
    // at most; no line per descriptor).
    assert!(
        out.stdout.len() <= all.len() * 48 * 1024,
        "{} bytes for {} areas",
        out.stdout.len(),
        all.len()
    );
    assert!(err.lines().count() < 64, "{err}");
}

#[test]
fn the_pid_shown_is_the_holder_not_what_the_area_claims() {
    let Some(c) = child("liar") else { return };
    let pid = c.id();
    let json = stat(&["--json"]);
    let text = stat(&[]);
    stop(c);
    let all = array(serde_json::from_slice(&json.stdout).unwrap());
    // (Other tests' children may hold lying areas too: look at this child's.)
    let liar: Vec<&Value> = all.iter().filter(|a| a["pid"] == pid).collect();
    assert_eq!(liar.len(), 1, "{all:#?}");
    assert_eq!(liar[0]["claimed_pid"], LIE, "{:#}", liar[0]);
    assert!(
        all.iter().all(|a| a["pid"] != LIE),
        "no area shown as pid {LIE}"
    );
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains(&format!("pid {pid} (")), "{text}");
    assert!(
        text.contains(&format!("the area says pid {LIE}, which does not hold it")),
        "{text}"
    );
    assert!(!text.contains(&format!("pid {LIE} (")), "{text}");
}

#[test]
fn watch_into_a_pipe_writes_no_escape_codes_and_json_one_document_per_line() {
    let Some(c) = child("liar") else { return };
    let pid = c.id();
    let text = stat(&["-w", "0.1", "-c", "3"]);
    let json = stat(&["--json", "-w", "0.1", "--count", "3"]);
    stop(c);
    assert!(!text.stdout.contains(&0x1b), "an ESC byte went into a pipe");
    let text = String::from_utf8_lossy(&text.stdout);
    assert_eq!(text.matches(&format!("pid {pid} (")).count(), 3, "{text}");
    let json = String::from_utf8(json.stdout).unwrap();
    let lines: Vec<&str> = json.lines().collect();
    assert_eq!(lines.len(), 3, "{json}");
    for l in lines {
        let v = array(serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")));
        assert!(v.iter().any(|a| a["pid"] == pid), "{l}");
    }
    // A count without --watch is refused, as is a count of 0.
    for args in [&["-c", "3"][..], &["-w", "1", "-c", "0"]] {
        let o = Command::new(EXE).arg("stat").args(args).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}");
    }
}
