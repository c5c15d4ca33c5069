//! Runs `shmhca devinfo` and checks its RoCEv2 GID table against what the machine says.

use std::process::Command;

fn devinfo(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_shmhca"))
        .arg("devinfo")
        .args(args)
        .output()
        .expect("run shmhca");
    assert!(out.status.success(), "shmhca devinfo exits 0: {out:?}");
    String::from_utf8(out.stdout).expect("utf-8")
}

/// Loopback is in every network namespace: 127.0.0.1 is a RoCEv2 GID of interface `lo`,
/// ACTIVE, with loopback's MTU (65536) and the largest active MTU.
#[test]
fn the_gid_table_lists_loopback_with_its_mtu_and_state() {
    let text = devinfo(&[]);
    assert!(text.contains("RoCEv2 GID table"), "{text}");
    let lo = text
        .lines()
        .find(|l| l.contains("::ffff:127.0.0.1,"))
        .unwrap_or_else(|| panic!("no loopback GID in\n{text}"));
    for want in [
        "GID[",
        "RoCE v2",
        "(lo, ACTIVE",
        "interface MTU 65536",
        "active_mtu 4096",
    ] {
        assert!(lo.contains(want), "{want:?} in {lo:?}");
    }
    let json: serde_json::Value = serde_json::from_str(&devinfo(&["--json"])).expect("JSON");
    let gids = json["roce"]["gids"].as_array().expect("a GID list");
    let e = gids
        .iter()
        .find(|g| g["gid"] == "::ffff:127.0.0.1")
        .expect("loopback in the JSON");
    assert_eq!(e["interface"], "lo");
    assert_eq!(e["state"], "ACTIVE");
    assert_eq!(e["active_mtu"], 4096);
    for (i, g) in gids.iter().enumerate() {
        assert_eq!(g["index"], i, "indexes are positions");
    }
}
