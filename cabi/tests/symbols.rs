//! The library exports every symbol of `symbols.txt` under its rdma-core version node (the
//! private one numbered as the installed providers want), and everything Debian's verbs
//! programs and the libraries they link (librdmacm, the mlx5 and efa providers) import from
//! libibverbs — else the loader refuses to start them (they are linked BIND_NOW).

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// `(version, name)` of the dynamic symbols `objdump -T` lists for `file`, defined or
/// (with `undefined`) imported, of libibverbs' nodes.
fn symbols(file: &Path, undefined: bool) -> Option<BTreeSet<(String, String)>> {
    let out = Command::new("objdump").arg("-T").arg(file).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    Some(
        text.lines()
            .filter(|l| l.contains("IBVERBS_") && (l.contains("*UND*") == undefined))
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let (ver, name) = (f.get(f.len().checked_sub(2)?)?, f.last()?);
                let ver = ver.trim_matches(|c| c == '(' || c == ')');
                (ver.starts_with("IBVERBS_") && !name.starts_with("IBVERBS_"))
                    .then(|| (ver.to_string(), name.to_string()))
            })
            .collect(),
    )
}

fn ours() -> Option<BTreeSet<(String, String)>> {
    let lib = common::target_dir().join("libibverbs.so.1");
    let s = symbols(&lib, false);
    if s.is_none() {
        if std::env::var_os("SHMHCA_REQUIRE_VERBS_TOOLS").is_some_and(|v| v == "1") {
            panic!("objdump (binutils) is missing, and SHMHCA_REQUIRE_VERBS_TOOLS=1 requires it");
        }
        eprintln!("skipped: objdump is not installed (apt-get install binutils)");
    }
    s
}

#[test]
fn every_listed_symbol_is_exported_with_its_version() {
    let Some(have) = ours() else { return };
    let private = shmhca_verbs_core::abi::PRIVATE_NODE;
    let n = private.trim_start_matches("IBVERBS_PRIVATE_");
    let list =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/symbols.txt")).unwrap();
    let mut missing = Vec::new();
    let mut count = 0;
    for l in list
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (node, name) = l.split_once(' ').unwrap();
        let node = if node == "IBVERBS_PRIVATE" {
            private
        } else {
            node
        };
        let name = if name == "verbs_register_driver_N" {
            format!("verbs_register_driver_{n}")
        } else {
            name.to_string()
        };
        count += 1;
        if !have.contains(&(node.to_string(), name.clone())) {
            missing.push(format!("{name}@@{node}"));
        }
    }
    assert!(count > 140, "symbols.txt lists {count}");
    assert!(missing.is_empty(), "not exported: {missing:?}");
    // Nothing else of ours leaks unversioned into the dynamic table.
    let lib = common::target_dir().join("libibverbs.so.1");
    let out = Command::new("objdump")
        .arg("-T")
        .arg(&lib)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let leaked: Vec<&str> = text.lines().filter(|l| l.contains("__shmhca_")).collect();
    assert!(leaked.is_empty(), "internal names exported: {leaked:?}");
}

#[test]
fn what_debians_programs_import_is_exported() {
    let Some(have) = ours() else { return };
    let mut files: Vec<std::path::PathBuf> = Vec::new();
    for prog in [
        "ib_send_lat",
        "ib_write_bw",
        "ibv_rc_pingpong",
        "ibv_devinfo",
        "ibv_srq_pingpong",
        "rping",
    ] {
        match common::tool(prog) {
            Some(p) => files.push(p),
            None => return,
        }
    }
    for lib in ["librdmacm.so.1", "libmlx5.so.1", "libefa.so.1"] {
        let p = Path::new("/usr/lib/x86_64-linux-gnu").join(lib);
        if p.exists() {
            files.push(p);
        }
    }
    let mut missing = BTreeSet::new();
    for f in &files {
        for s in symbols(f, true).unwrap_or_default() {
            if !have.contains(&s) {
                missing.insert(format!("{}@{} (imported by {})", s.1, s.0, f.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "imported but not exported: {missing:#?}"
    );
}
