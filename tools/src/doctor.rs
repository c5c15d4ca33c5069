//! `shmhca doctor`: what this machine offers shmhca, found by trying, not by guessing.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::{Value, json};
use shmhca_rings::segment::{
    HEADER_LEN, HUGE_PAGE_LEN, HugePagePool, HugePages, PageSize, Segment,
};

/// Cores below which shmhca's engines do not get a core of their own.
const CORES_FOR_DEDICATED_ENGINES: usize = 4;
const RESERVE_HINT: &str = "echo 64 > /proc/sys/vm/nr_hugepages   (or: sysctl vm.nr_hugepages=64)";

/// The outcome of one thing the doctor tried.
#[derive(Debug)]
struct Probe {
    ok: bool,
    detail: String,
}

impl Probe {
    fn json(&self) -> Value {
        json!({ "ok": self.ok, "detail": self.detail })
    }
}

/// Huge-page counters from /proc/meminfo and /proc/sys/vm.
#[derive(Debug, Default)]
struct HugePageCounts {
    pool: HugePagePool,
    nr_hugepages: Option<u64>,
}

/// Everything the doctor found.
#[derive(Debug)]
pub(crate) struct Report {
    huge: HugePageCounts,
    memfd: Probe,
    memfd_hugetlb: Probe,
    thp_shmem: Option<String>,
    cpus_available: usize,
    core_ids: usize,
    pinning: Probe,
    advice: Vec<String>,
}

fn read_trimmed(path: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

fn huge_page_counts() -> HugePageCounts {
    HugePageCounts {
        pool: HugePagePool::read(),
        nr_hugepages: read_trimmed("/proc/sys/vm/nr_hugepages").and_then(|s| s.parse().ok()),
    }
}

/// Creates and maps an ordinary memfd segment.
fn probe_memfd() -> Probe {
    match Segment::builder(0xd0c, 4096)
        .name("shmhca-doctor")
        .huge_pages(HugePages::Never)
        .create()
    {
        Ok(seg) => match seg.write_at(0, b"ok") {
            Ok(()) => Probe {
                ok: true,
                detail: "memfd_create, seal and map work".into(),
            },
            Err(e) => Probe {
                ok: false,
                detail: format!("mapped but not writable: {e}"),
            },
        },
        Err(e) => Probe {
            ok: false,
            detail: e.to_string(),
        },
    }
}

/// Creates, maps and touches one 2 MiB hugetlb memfd.
fn probe_memfd_hugetlb() -> Probe {
    let created = Segment::builder(0xd0c, HUGE_PAGE_LEN - HEADER_LEN)
        .name("shmhca-doctor-huge")
        .huge_pages(HugePages::Require)
        .create();
    match created {
        Ok(seg) if seg.page_size() == PageSize::Huge2M => {
            match seg.write_at(seg.data_len() - 2, b"ok") {
                Ok(()) => Probe {
                    ok: true,
                    detail: "a 2 MiB MFD_HUGETLB memfd was created, mapped and written".into(),
                },
                Err(e) => Probe {
                    ok: false,
                    detail: format!("mapped but not writable: {e}"),
                },
            }
        }
        Ok(seg) => Probe {
            ok: false,
            detail: format!("got {} instead of huge pages", seg.page_size()),
        },
        Err(e) => Probe {
            ok: false,
            detail: e.to_string(),
        },
    }
}

/// Pins a scoped thread to the last core and checks with sched_getaffinity that it stuck.
fn probe_pinning(core_ids: &[core_affinity::CoreId]) -> Probe {
    let Some(&core) = core_ids.last() else {
        return Probe {
            ok: false,
            detail: "core_affinity found no cores to pin to".into(),
        };
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            if !core_affinity::set_for_current(core) {
                return Probe {
                    ok: false,
                    detail: format!("sched_setaffinity to core {} failed", core.id),
                };
            }
            match rustix::thread::sched_getaffinity(None) {
                Ok(set) if set.count() == 1 && set.is_set(core.id) => Probe {
                    ok: true,
                    detail: format!(
                        "a thread was pinned to core {} and sched_getaffinity confirms it",
                        core.id
                    ),
                },
                Ok(set) => Probe {
                    ok: false,
                    detail: format!(
                        "pinned to core {} but the affinity mask has {} cores{}",
                        core.id,
                        set.count(),
                        if set.is_set(core.id) {
                            ""
                        } else {
                            " and not that one"
                        }
                    ),
                },
                Err(e) => Probe {
                    ok: false,
                    detail: format!("sched_getaffinity failed: {e}"),
                },
            }
        })
        .join()
        .unwrap_or_else(|_| Probe {
            ok: false,
            detail: "the pinning thread panicked".into(),
        })
    })
}

/// Runs every check.
pub(crate) fn examine() -> Report {
    let huge = huge_page_counts();
    let memfd = probe_memfd();
    let memfd_hugetlb = probe_memfd_hugetlb();
    let thp_shmem = read_trimmed("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
    let cpus_available = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let ids = core_affinity::get_core_ids().unwrap_or_default();
    let pinning = probe_pinning(&ids);

    let mut advice = Vec::new();
    if !memfd.ok {
        advice.push("memfd segments do not work here: shmhca cannot run (needs Linux memfd_create and seals)".into());
    }
    if !memfd_hugetlb.ok {
        let free = huge.pool.free.unwrap_or(0);
        advice.push(format!(
            "no usable huge pages ({free} free): segments will use 4 KiB pages (more TLB misses). Reserve some: {RESERVE_HINT}"
        ));
    }
    if let Some(setting) = &thp_shmem
        && selected(setting) == Some("never")
        && !memfd_hugetlb.ok
    {
        advice.push(
            "transparent huge pages for shmem are off too (echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled)"
                .into(),
        );
    }
    if cpus_available < CORES_FOR_DEDICATED_ENGINES {
        advice.push(format!(
            "fewer than {CORES_FOR_DEDICATED_ENGINES} cores ({cpus_available}): engines will run inline, driven by the application's polling"
        ));
    } else {
        advice.push(format!(
            "{cpus_available} cores: engines can run on dedicated pinned cores"
        ));
    }
    if !pinning.ok {
        advice.push("threads cannot be pinned: poll-mode engines will share cores with the scheduler's choice".into());
    }
    Report {
        huge,
        memfd,
        memfd_hugetlb,
        thp_shmem,
        cpus_available,
        core_ids: ids.len(),
        pinning,
        advice,
    }
}

/// The bracketed choice in a sysfs setting such as `always within_size advise [never] deny`.
fn selected(setting: &str) -> Option<&str> {
    setting
        .split_whitespace()
        .find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "unknown".to_owned(), |v| v.to_string())
}

impl Report {
    /// The report for people.
    pub(crate) fn text(&self) -> String {
        let yes_no = |p: &Probe| if p.ok { "yes" } else { "no" };
        let mut out = String::new();
        let (h, p) = (&self.huge, &self.huge.pool);
        let _ = writeln!(out, "shmhca doctor");
        let _ = writeln!(out, "huge pages total:     {}", opt(p.total));
        let _ = writeln!(out, "huge pages free:      {}", opt(p.free));
        let _ = writeln!(out, "huge pages reserved:  {}", opt(p.reserved));
        let _ = writeln!(out, "huge page size:       {} kB", opt(p.size_kib));
        let _ = writeln!(out, "vm.nr_hugepages:      {}", opt(h.nr_hugepages));
        let _ = writeln!(out, "reserve huge pages:   {RESERVE_HINT}");
        let _ = writeln!(
            out,
            "memfd:                {} ({})",
            yes_no(&self.memfd),
            self.memfd.detail
        );
        let _ = writeln!(
            out,
            "memfd MFD_HUGETLB:    {} ({})",
            yes_no(&self.memfd_hugetlb),
            self.memfd_hugetlb.detail
        );
        let _ = writeln!(
            out,
            "THP for shmem:        {}",
            self.thp_shmem
                .as_deref()
                .map_or("unknown".to_owned(), |s| selected(s)
                    .unwrap_or(s)
                    .to_owned())
        );
        let _ = writeln!(out, "CPUs available:       {}", self.cpus_available);
        let _ = writeln!(out, "cores to pin to:      {}", self.core_ids);
        let _ = writeln!(
            out,
            "thread pinning:       {} ({})",
            yes_no(&self.pinning),
            self.pinning.detail
        );
        for a in &self.advice {
            let _ = writeln!(out, "advice: {a}");
        }
        out
    }

    /// The report as JSON.
    pub(crate) fn json(&self) -> Value {
        let (h, p) = (&self.huge, &self.huge.pool);
        json!({
            "huge_pages": {
                "total": p.total,
                "free": p.free,
                "reserved": p.reserved,
                "size_kib": p.size_kib,
                "nr_hugepages": h.nr_hugepages,
                "how_to_reserve": RESERVE_HINT,
            },
            "memfd": self.memfd.json(),
            "memfd_hugetlb": self.memfd_hugetlb.json(),
            "thp_shmem": self.thp_shmem.as_deref().map(|s| selected(s).unwrap_or(s)),
            "cpus": {
                "available_parallelism": self.cpus_available,
                "core_ids": self.core_ids,
                "pinning": self.pinning.json(),
            },
            "advice": self.advice,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_meminfo_fields_exactly() {
        let text = "HugePages:      7\nHugePages_Total:      64\nHugePages_Free:       60\nHugepagesize:       2048 kB\n";
        let pool = HugePagePool::parse(text);
        assert_eq!(
            pool.total,
            Some(64),
            "a field is not matched by a prefix of its name"
        );
        assert_eq!(pool.free, Some(60));
        assert_eq!(pool.size_kib, Some(2048));
        assert_eq!(pool.reserved, None);
    }

    #[test]
    fn finds_the_selected_sysfs_choice() {
        assert_eq!(
            selected("always within_size advise [never] deny force"),
            Some("never")
        );
        assert_eq!(selected("[always] never"), Some("always"));
        assert_eq!(selected("always never"), None);
    }
}
