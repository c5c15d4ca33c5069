//! Runs `shmhca doctor` and checks its report against what the machine says.

use std::process::Command;

fn doctor(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_shmhca"))
        .arg("doctor")
        .args(args)
        .output()
        .expect("run shmhca");
    assert!(out.status.success(), "shmhca doctor exits 0: {out:?}");
    String::from_utf8(out.stdout).expect("utf-8")
}

fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines().find_map(|l| {
        l.strip_prefix(field)?
            .strip_prefix(':')?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

#[test]
fn text_report_has_every_field() {
    let text = doctor(&[]);
    for field in [
        "huge pages total:",
        "huge pages free:",
        "huge page size:",
        "vm.nr_hugepages:",
        "reserve huge pages:   echo 64 > /proc/sys/vm/nr_hugepages",
        "memfd:                yes",
        "memfd MFD_HUGETLB:",
        "THP for shmem:",
        "CPUs available:",
        "thread pinning:",
        "advice:",
    ] {
        assert!(text.contains(field), "missing {field:?} in:\n{text}");
    }
    let cpus = std::thread::available_parallelism().unwrap().get();
    assert!(
        text.contains(&format!("CPUs available:       {cpus}\n")),
        "{text}"
    );
}

#[test]
fn json_report_matches_the_machine() {
    let json: serde_json::Value = serde_json::from_str(&doctor(&["--json"])).expect("valid JSON");
    let huge = &json["huge_pages"];
    // The doctor's own probe uses (then frees) a huge page when some are free, so compare
    // the totals, which only an administrator changes.
    assert_eq!(huge["total"].as_u64(), meminfo("HugePages_Total"));
    assert_eq!(huge["size_kib"].as_u64(), meminfo("Hugepagesize"));
    let nr: Option<u64> = std::fs::read_to_string("/proc/sys/vm/nr_hugepages")
        .ok()
        .and_then(|s| s.trim().parse().ok());
    assert_eq!(huge["nr_hugepages"].as_u64(), nr);
    assert!(
        huge["how_to_reserve"]
            .as_str()
            .unwrap()
            .contains("nr_hugepages")
    );

    assert_eq!(
        json["memfd"]["ok"], true,
        "memfd works on any Linux shmhca supports: {json:#}"
    );
    let hugetlb_ok = json["memfd_hugetlb"]["ok"].as_bool().unwrap();
    if meminfo("HugePages_Total") == Some(0) {
        assert!(
            !hugetlb_ok,
            "no huge pages exist, so the probe cannot have succeeded"
        );
        let advice = json["advice"].as_array().unwrap();
        assert!(
            advice
                .iter()
                .any(|a| a.as_str().unwrap().contains("nr_hugepages")),
            "{advice:?}"
        );
    }

    let cpus = std::thread::available_parallelism().unwrap().get() as u64;
    assert_eq!(json["cpus"]["available_parallelism"].as_u64(), Some(cpus));
    assert!(json["cpus"]["core_ids"].as_u64().unwrap() >= 1);
    assert!(json["cpus"]["pinning"]["ok"].is_boolean());
    let inline = json["advice"]
        .as_array()
        .unwrap()
        .iter()
        .any(|a| a.as_str().unwrap().contains("engines will run inline"));
    assert_eq!(
        inline,
        cpus < 4,
        "inline-engine advice iff fewer than 4 cores"
    );
}
