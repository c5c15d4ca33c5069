//! `shmhca stat`: every running shmhca context of this user, read from the stats area each
//! engine publishes (see `shmhca::stats_area`).
//!
//! Finding them: each engine keeps a memfd named `shmhca-stats` open, which shows in
//! `/proc/PID/fd/` as a link to `/memfd:shmhca-stats (deleted)`. For every process of this
//! user, the links are read and each such descriptor is opened read-only through
//! `/proc/PID/fd/N` and validated (it is input from another process: magic, version,
//! kind and sizes are checked before anything is read). A process that exits, even by
//! `SIGKILL`, takes its memfd with it: there is nothing to find and nothing to clean up.
//!
//! # Bounded work, whatever the processes hold
//!
//! Everything found is input from processes of this user, any of which may be careless or
//! hostile, so the work is bounded by what is listed, not by what they hold:
//!
//! * an area is read once, however many descriptors of it there are, in however many
//!   processes: areas are told apart by the memfd's inode (`st_dev`, `st_ino` of the
//!   descriptor's target, taken with `stat`, which costs no read of the area);
//! * at most [`MAX_AREAS_PER_PROCESS`] distinct areas are read per process and
//!   [`MAX_AREAS`] in all; what was skipped is said in one note per process;
//! * at most [`MAX_NOTES_PER_PROCESS`] notes about invalid areas per process, then one
//!   line counting the rest;
//! * only regular files are opened (never a FIFO or device that could block or have side
//!   effects), with `O_NONBLOCK`, and the opened file must be the inode that was counted.
//!
//! # Whose area it is
//!
//! The pid shown is that of a process found holding the area in `/proc/PID/fd`, never the
//! pid written in the area (the writer's own word, which may be a lie). If the area's
//! pid is one of the processes holding it, that process is shown (after `fork` both
//! parent and child hold the engine's area); if it is none of them, the first holder is
//! shown and the mismatch is said (`claimed_pid` in JSON, a line in text).

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use serde_json::{Value, json};
use shmhca::stats_area::{self, COUNTER_NAMES, Snapshot};

/// The most distinct areas read from one process.
pub(crate) const MAX_AREAS_PER_PROCESS: usize = 64;
/// The most areas read in all.
pub(crate) const MAX_AREAS: usize = 512;
/// The most notes about invalid areas of one process.
pub(crate) const MAX_NOTES_PER_PROCESS: usize = 4;
/// The most other holders listed for one area.
pub(crate) const MAX_HOLDERS_LISTED: usize = 16;

/// One context found.
#[derive(Debug)]
pub(crate) struct Found {
    /// The process shown as holding it (found in `/proc/PID/fd`, not read from the area).
    pub(crate) pid: u32,
    /// That process's command name.
    pub(crate) comm: String,
    /// The lowest descriptor number of the area in that process.
    pub(crate) fd: u32,
    /// How many descriptors of the area that process holds.
    pub(crate) fds: u32,
    /// Other processes found holding it (at most [`MAX_HOLDERS_LISTED`]).
    pub(crate) also_held_by: Vec<u32>,
    /// What its engine published (its `pid` is the area's claim, not shown as the pid).
    pub(crate) snap: Snapshot,
}

impl Found {
    /// The pid written in the area, when it is not the process shown.
    pub(crate) fn claimed_pid_mismatch(&self) -> Option<u32> {
        (self.snap.pid != self.pid).then_some(self.snap.pid)
    }
}

/// One holder of an area: (pid, comm, lowest fd, descriptors).
struct Holder {
    pid: u32,
    comm: String,
    fd: u32,
    fds: u32,
}

/// An area read (or refused), by inode.
struct Area {
    snap: Snapshot,
    holders: Vec<Holder>,
}

/// Every context of processes of this user, each listed once. Processes that exit while
/// being looked at are skipped; invalid areas and what the caps left out are said in
/// `notes` (a bounded number of lines).
pub(crate) fn scan(notes: &mut Vec<String>) -> Vec<Found> {
    let uid = rustix::process::getuid().as_raw();
    let me = std::process::id();
    let Ok(procs) = fs::read_dir("/proc") else {
        notes.push("cannot read /proc".into());
        return Vec::new();
    };
    let mut pids: Vec<u32> = procs
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    // Areas by inode, in the order found; inodes found invalid are remembered too, so
    // that no inode is opened twice.
    let mut areas: Vec<Area> = Vec::new();
    let mut by_inode: HashMap<(u64, u64), Option<usize>> = HashMap::new();
    let mut read_in_all = 0usize;
    for pid in pids {
        if pid == me {
            continue;
        }
        let dir = Path::new("/proc").join(pid.to_string());
        if fs::metadata(&dir).map(|m| m.uid()).ok() != Some(uid) {
            continue;
        }
        let Ok(entries) = fs::read_dir(dir.join("fd")) else {
            continue;
        };
        let mut fds: Vec<u32> = entries
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        fds.sort_unstable();
        let mut comm: Option<String> = None;
        let (mut read_here, mut skipped_here, mut bad_here) = (0usize, 0usize, 0usize);
        let mut skipped = std::collections::HashSet::new();
        // This process's descriptors of each inode: index in `areas` -> (lowest fd, count).
        let mut held: HashMap<usize, (u32, u32)> = HashMap::new();
        for fd in fds {
            let path = dir.join("fd").join(fd.to_string());
            let Ok(target) = fs::read_link(&path) else {
                continue;
            };
            let t = target.to_string_lossy();
            if !t.starts_with(&format!("/memfd:{} ", stats_area::MEMFD_NAME)) {
                continue;
            }
            // The target's inode, without opening it.
            let Ok(meta) = fs::metadata(&path) else {
                continue;
            };
            if !meta.file_type().is_file() {
                continue;
            }
            let key = (meta.dev(), meta.ino());
            let idx = match by_inode.get(&key) {
                Some(Some(i)) => *i,
                Some(None) => continue, // found invalid before
                None => {
                    if read_here == MAX_AREAS_PER_PROCESS || read_in_all == MAX_AREAS {
                        // Counted once per inode; not marked, so that another process
                        // holding it (its engine's, passed to this one) still gets it read.
                        if skipped.insert(key) {
                            skipped_here += 1;
                        }
                        continue;
                    }
                    read_here += 1;
                    read_in_all += 1;
                    match read_area(&path, key) {
                        Ok(snap) => {
                            areas.push(Area {
                                snap,
                                holders: Vec::new(),
                            });
                            by_inode.insert(key, Some(areas.len() - 1));
                            areas.len() - 1
                        }
                        Err(err) => {
                            by_inode.insert(key, None);
                            bad_here += 1;
                            if bad_here <= MAX_NOTES_PER_PROCESS {
                                notes.push(format!("pid {pid} fd {fd}: {err}"));
                            }
                            continue;
                        }
                    }
                }
            };
            let h = held.entry(idx).or_insert((fd, 0));
            h.1 = h.1.saturating_add(1);
            if comm.is_none() {
                comm = Some(
                    fs::read_to_string(dir.join("comm"))
                        .map(|s| s.trim().to_string())
                        .unwrap_or_default(),
                );
            }
        }
        if bad_here > MAX_NOTES_PER_PROCESS {
            notes.push(format!(
                "pid {pid}: {} more invalid stats areas not described",
                bad_here - MAX_NOTES_PER_PROCESS
            ));
        }
        if skipped_here > 0 {
            notes.push(if read_in_all == MAX_AREAS {
                format!(
                    "pid {pid}: {skipped_here} stats area(s) not read: {MAX_AREAS} areas were read in all, the most one run reads"
                )
            } else {
                format!(
                    "pid {pid}: {skipped_here} stats area(s) not read: it holds more than {MAX_AREAS_PER_PROCESS} distinct areas, the most read per process"
                )
            });
        }
        let mut held: Vec<(usize, (u32, u32))> = held.into_iter().collect();
        held.sort_unstable_by_key(|(_, (fd, _))| *fd);
        for (idx, (fd, n)) in held {
            let holders = &mut areas[idx].holders;
            if holders.len() <= MAX_HOLDERS_LISTED {
                holders.push(Holder {
                    pid,
                    comm: comm.clone().unwrap_or_default(),
                    fd,
                    fds: n,
                });
            }
        }
    }
    areas
        .into_iter()
        .filter(|a| !a.holders.is_empty())
        .map(|a| {
            // The area's own word picks among the real holders only.
            let shown = a
                .holders
                .iter()
                .position(|h| h.pid == a.snap.pid)
                .unwrap_or(0);
            let h = &a.holders[shown];
            Found {
                pid: h.pid,
                comm: h.comm.clone(),
                fd: h.fd,
                fds: h.fds,
                also_held_by: a
                    .holders
                    .iter()
                    .filter(|o| o.pid != h.pid)
                    .map(|o| o.pid)
                    .take(MAX_HOLDERS_LISTED)
                    .collect(),
                snap: a.snap,
            }
        })
        .collect()
}

/// Opens `path` (a `/proc/PID/fd/N` link) read-only and non-blocking, checks that it is
/// still the regular file `key` counted, and reads the area.
fn read_area(path: &Path, key: (u64, u64)) -> Result<Snapshot, String> {
    use rustix::fs::{Mode, OFlags};
    // Read-only: this side never writes the area.
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("cannot open: {e}"))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| format!("cannot stat: {e}"))?;
    if (st.st_dev as u64, st.st_ino as u64) != key {
        return Err("the descriptor changed while being read; run again".into());
    }
    stats_area::read(fd).map_err(|e| e.to_string())
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
                    "pid": f.pid,
                    "claimed_pid": s.pid,
                    "comm": f.comm,
                    "fd": f.fd,
                    "fds": f.fds,
                    "also_held_by": f.also_held_by,
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
            "pid {} ({}) engine {} mode {}  [fd {}{}, {} updates]",
            f.pid,
            f.comm,
            n.engine_id,
            if n.poll_mode { "poll" } else { "inline" },
            f.fd,
            if f.fds > 1 {
                format!(" and {} more", f.fds - 1)
            } else {
                String::new()
            },
            n.publishes
        );
        if let Some(claimed) = f.claimed_pid_mismatch() {
            let _ = writeln!(
                s,
                "  (the area says pid {claimed}, which does not hold it: shown is the process that does)"
            );
        }
        if !f.also_held_by.is_empty() {
            let others: Vec<String> = f.also_held_by.iter().map(u32::to_string).collect();
            let _ = writeln!(s, "  also held by pid {}", others.join(", "));
        }
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
        // RoCEv2 (UDP ports): only for an engine that has had one.
        if c[19] + c[20] > 0 {
            let _ = writeln!(
                s,
                "  roce datagrams sent {:>10}  received {:>10}  ce-marked {:>6}  cnps sent {:>6}  received {:>6}  dropped: icrc {}, malformed {}, strangers {}, refused {}, unencodable {}",
                c[19], c[20], c[27], c[28], c[23], c[21], c[22], c[24], c[25], c[26]
            );
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

#[cfg(test)]
mod text_tests {
    use super::{Found, text};
    use shmhca::stats_area::{COUNTER_NAMES, COUNTERS, Snapshot};

    /// A context whose counter `name` is `value` for each of `set` (others 0).
    fn found(set: &[(&str, u64)]) -> Found {
        let mut counters = [0u64; COUNTERS];
        for (name, v) in set {
            let i = COUNTER_NAMES.iter().position(|n| n == name).unwrap();
            counters[i] = *v;
        }
        Found {
            pid: 42,
            comm: "test".to_string(),
            fd: 3,
            fds: 1,
            also_held_by: Vec::new(),
            snap: Snapshot {
                pid: 42,
                engine_id: 1,
                poll_mode: false,
                publishes: 1,
                counters,
                links: Vec::new(),
                qps: Vec::new(),
                total_qps: 0,
            },
        }
    }

    /// The roce line reads each figure from the counter of its name: the datagrams, the
    /// CE-marked packets, the CNPs sent and received, the drops.
    #[test]
    fn the_roce_line_shows_each_counter_under_its_name() {
        let f = found(&[
            ("datagrams_sent", 101),
            ("datagrams_received", 102),
            ("ce_marked_received", 103),
            ("cnps_sent", 104),
            ("cnps_received", 105),
            ("icrc_dropped", 106),
            ("malformed_dropped", 107),
            ("unknown_source_dropped", 108),
            ("send_dropped", 109),
            ("encode_dropped", 110),
        ]);
        let t = text(&[f]);
        let line = t.lines().find(|l| l.contains("roce")).expect(&t);
        let words: Vec<&str> = line.split_whitespace().collect();
        let after = |w: &str| {
            let i = words.iter().position(|x| *x == w).expect(w);
            words[i + 1].trim_end_matches(',')
        };
        assert_eq!(after("sent"), "101", "{line}");
        assert_eq!(after("ce-marked"), "103", "{line}");
        let cnps = line.split("cnps").nth(1).expect(line);
        let cw: Vec<&str> = cnps.split_whitespace().collect();
        assert_eq!(&cw[..4], ["sent", "104", "received", "105"], "{line}");
        for (what, v) in [
            ("icrc", "106"),
            ("malformed", "107"),
            ("strangers", "108"),
            ("refused", "109"),
            ("unencodable", "110"),
        ] {
            assert_eq!(after(what), v, "{line}");
        }
        assert!(line.contains("received        102"), "{line}");
        // No UDP port: no roce line.
        assert!(!text(&[found(&[])]).contains("roce"));
    }
}
