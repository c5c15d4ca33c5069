//! `shmhca stat`: every running shmhca context of this user, read from the stats area each
//! engine publishes (see `shmhca::stats_area`).
//!
//! Finding them: each engine keeps a memfd named `shmhca-stats` open, which shows in
//! `/proc/PID/fd/` as a link to `/memfd:shmhca-stats (deleted)`. For every process of this
//! user, the links are read and each such descriptor is opened read-only through
//! `/proc/PID/fd/N` and validated (it is input from another process: magic, version,
//! kind and sizes are checked before anything is read). A process that exits, even by
//! `SIGKILL`, takes its memfd with it: there is nothing to find and nothing to clean up.

use std::fs;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use serde_json::{Value, json};
use shmhca::stats_area::{self, COUNTER_NAMES, Snapshot};

/// One context found.
#[derive(Debug)]
pub(crate) struct Found {
    /// The process's command name.
    pub(crate) comm: String,
    /// The descriptor number in that process.
    pub(crate) fd: u32,
    /// What its engine published.
    pub(crate) snap: Snapshot,
}

/// Every context of processes of this user. Processes that exit while being looked at,
/// and descriptors that turn out not to be valid stats areas, are skipped (the latter
/// with a note in `notes`).
pub(crate) fn scan(notes: &mut Vec<String>) -> Vec<Found> {
    let uid = rustix::process::getuid().as_raw();
    let me = std::process::id();
    let mut out = Vec::new();
    let Ok(procs) = fs::read_dir("/proc") else {
        notes.push("cannot read /proc".into());
        return out;
    };
    let mut pids: Vec<u32> = procs
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    for pid in pids {
        if pid == me {
            continue;
        }
        let dir = Path::new("/proc").join(pid.to_string());
        if fs::metadata(&dir).map(|m| m.uid()).ok() != Some(uid) {
            continue;
        }
        let Ok(fds) = fs::read_dir(dir.join("fd")) else {
            continue;
        };
        for e in fds.flatten() {
            let Ok(target) = fs::read_link(e.path()) else {
                continue;
            };
            let t = target.to_string_lossy();
            if !t.starts_with(&format!("/memfd:{} ", stats_area::MEMFD_NAME)) {
                continue;
            }
            let Some(fd) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            // Read-only: this side never writes the area.
            let Ok(file) = fs::File::open(e.path()) else {
                continue;
            };
            match stats_area::read(OwnedFd::from(file)) {
                Ok(snap) => out.push(Found {
                    comm: fs::read_to_string(dir.join("comm"))
                        .map(|s| s.trim().to_string())
                        .unwrap_or_default(),
                    fd,
                    snap,
                }),
                Err(err) => notes.push(format!("pid {pid} fd {fd}: {err}")),
            }
        }
    }
    out
}

/// The contexts as JSON: an array, one object per context.
pub(crate) fn json(found: &[Found]) -> Value {
    Value::Array(
        found
            .iter()
            .map(|f| {
                let s = &f.snap;
                let counters: serde_json::Map<String, Value> = COUNTER_NAMES
                    .iter()
                    .zip(s.counters)
                    .map(|(k, v)| ((*k).to_string(), json!(v)))
                    .collect();
                json!({
                    "pid": s.pid,
                    "comm": f.comm,
                    "fd": f.fd,
                    "engine": s.engine_id,
                    "mode": if s.poll_mode { "poll" } else { "inline" },
                    "publishes": s.publishes,
                    "counters": counters,
                    "links": s.links.iter().map(|l| json!({
                        "id": l.id, "up": l.up, "peer_pid": l.peer_pid, "qps": l.qps,
                    })).collect::<Vec<_>>(),
                    "qps_total": s.total_qps,
                    "qps": s.qps.iter().map(|q| json!({
                        "qpn": q.qpn,
                        "state": q.state.map_or_else(|| "unknown".to_string(), |st| format!("{st:?}")),
                        "link": q.link,
                        "dest_qpn": q.dest_qpn,
                        "next_psn": q.next_psn,
                        "acked_psn": q.acked_psn,
                        "expected_psn": q.expected_psn,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}

/// The contexts as text, one block each.
pub(crate) fn text(found: &[Found]) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    if found.is_empty() {
        s.push_str("no running shmhca contexts of this user\n");
        return s;
    }
    for f in found {
        let n = &f.snap;
        let _ = writeln!(
            s,
            "pid {} ({}) engine {} mode {}  [fd {}, {} updates]",
            n.pid,
            f.comm,
            n.engine_id,
            if n.poll_mode { "poll" } else { "inline" },
            f.fd,
            n.publishes
        );
        let c = &n.counters;
        let _ = writeln!(
            s,
            "  packets  sent {:>12}  received {:>12}  dropped {:>8}",
            c[0], c[1], c[9]
        );
        let _ = writeln!(
            s,
            "  bytes    copied {:>14}  inline sent {:>12}",
            c[2], c[3]
        );
        let _ = writeln!(
            s,
            "  acks {:>10}  retransmitted {:>8}  timeouts {:>6}  flushed {:>8}  sleeps {:>8}",
            c[4], c[6], c[7], c[17], c[10]
        );
        let _ = writeln!(
            s,
            "  naks sent {:>8} (rnr {}, psn seq {}, inv req {}, rem access {}, rem op {})  received {:>8}  rnr received {:>8}",
            c[5], c[11], c[12], c[13], c[14], c[15], c[16], c[8]
        );
        if let Some(hint) = rnr_hint(c[11], c[8]) {
            let _ = writeln!(s, "  {hint}");
        }
        for l in &n.links {
            let _ = writeln!(
                s,
                "  link {:<3} {:<4}  peer pid {:<8} {} QP(s)",
                l.id,
                if l.up { "up" } else { "down" },
                if l.peer_pid == 0 {
                    "?".to_string()
                } else {
                    l.peer_pid.to_string()
                },
                l.qps
            );
        }
        if !n.qps.is_empty() {
            let _ = writeln!(
                s,
                "  {:>8} {:<6} {:>5} {:>9} {:>9} {:>9} {:>9}",
                "QPN", "state", "link", "peer QPN", "next PSN", "acked", "expected"
            );
        }
        for q in &n.qps {
            let _ = writeln!(
                s,
                "  {:>#8x} {:<6} {:>5} {:>#9x} {:>#9x} {:>#9x} {:>#9x}",
                q.qpn,
                q.state
                    .map_or_else(|| "?".to_string(), |st| format!("{st:?}")),
                q.link.map_or_else(|| "-".to_string(), |l| l.to_string()),
                q.dest_qpn,
                q.next_psn,
                q.acked_psn,
                q.expected_psn
            );
        }
        if n.total_qps as usize > n.qps.len() {
            let _ = writeln!(
                s,
                "  ... {} more QPs not listed",
                n.total_qps as usize - n.qps.len()
            );
        }
    }
    s
}

/// What a non-zero RNR Nak count means and what to do, or nothing when both are 0. Each RNR
/// Nak stalls the Send behind it for the receiver's `min_rnr_timer` (0.01 to 655 ms) and sends
/// it again: an echo server that re-posts its receive after answering pays one per message,
/// silently (2,000 echoes in 5 s instead of 18 ms).
fn rnr_hint(sent: u64, received: u64) -> Option<String> {
    match (sent, received) {
        (0, 0) => None,
        (sent, 0) => Some(format!(
            "note: {sent} RNR Naks sent: a Send found no receive posted here; each one stalls \
             the sender for this QP's min_rnr_timer: post receives before the messages they \
             take (or more of them), or lower min_rnr_timer"
        )),
        (_, received) => Some(format!(
            "note: {received} RNR Naks received{}: the peer had no receive posted; each one \
             stalls this Send for the peer's min_rnr_timer: the peer should post its receives \
             earlier (or more of them), or lower its min_rnr_timer",
            if sent == 0 {
                String::new()
            } else {
                format!(" ({sent} sent)")
            }
        )),
    }
}

#[cfg(test)]
mod rnr_hint_tests {
    use super::rnr_hint;

    #[test]
    fn rnr_naks_are_pointed_out_with_what_to_do() {
        assert_eq!(rnr_hint(0, 0), None);
        let sent = rnr_hint(2000, 0).unwrap();
        assert!(
            sent.contains("2000 RNR Naks sent") && sent.contains("post receives before"),
            "{sent}"
        );
        let got = rnr_hint(0, 7).unwrap();
        assert!(
            got.contains("7 RNR Naks received:") && got.contains("min_rnr_timer"),
            "{got}"
        );
        let both = rnr_hint(3, 7).unwrap();
        assert!(both.contains("7 RNR Naks received (3 sent)"), "{both}");
    }
}
