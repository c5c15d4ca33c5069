//! Unmodified Debian 12 verbs programs over shmhca's RoCEv2 port (`shmhca exec --roce`):
//! port 1 of link layer Ethernet, the host's addresses as GIDs, QPs over UDP 4791 (issue
//! 28, item 6). A missing program skips its test with one line, unless
//! `SHMHCA_REQUIRE_VERBS_TOOLS=1`.
//!
//! Two processes of one namespace cannot both bind UDP 4791 on its only loopback address,
//! so the connecting tests run in network namespaces of their own, made and removed by
//! the test (root and the `ip` command; each skips with one line otherwise): two loopback
//! addresses in one namespace, and two namespaces joined by a veth pair (198.18.0.1/30,
//! 198.18.0.2/30), as two hosts would be.

mod common;

use common::{DEADLINE, How, Outcome, SERIAL, pair_how, pair_progs, start_how, target_dir, tool};

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn roce() -> How {
    How {
        roce: true,
        wrap: Vec::new(),
    }
}

/// `ibv_devinfo -v` over the RoCEv2 port (no root needed): an active Ethernet port, no
/// LID, the host's loopback address among its RoCE v2 GIDs, as many GIDs as the table says.
#[test]
fn roce_ibv_devinfo_shows_an_ethernet_port_with_the_host_gids() {
    let Some(p) = tool("ibv_devinfo") else { return };
    let _g = lock();
    let out = start_how(&p, &["-v"], &[], &roce()).wait(DEADLINE);
    assert!(out.ok(), "{out}");
    for want in [
        "hca_id:\tshmhca0",
        "PORT_ACTIVE (4)",
        "link_layer:\t\tEthernet",
        "port_lid:\t\t0\n",
        "::ffff:127.0.0.1, RoCE v2",
    ] {
        assert!(out.stdout.contains(want), "no {want:?} in\n{out}");
    }
    let gids = out.stdout.matches("GID[").count();
    assert!(
        out.stdout.contains(&format!("gid_tbl_len:\t\t{gids}\n")),
        "gid_tbl_len is not the {gids} GIDs listed:\n{out}"
    );
    if common::target_dir().join("shmhca").exists() {
        assert!(out.stderr.contains("port 1 RoCEv2"), "{out}");
    }
}

/// Without a GRH (`ibv_rc_pingpong` with no `-g`) the RTR transition fails with EINVAL and
/// a line saying RoCE needs one; nothing hangs (no root needed: nothing is bound).
#[test]
fn roce_without_a_grh_is_refused_with_a_message() {
    let Some(p) = tool("ibv_rc_pingpong") else {
        return;
    };
    let _g = lock();
    let how = roce();
    let (s, c) = pair_how(
        &p,
        (&["-n", "10"], &how),
        (&["-n", "10"], &how),
        &[],
        "localhost",
    );
    assert!(!s.ok() && !c.ok(), "server: {s}\nclient: {c}");
    assert!(
        s.stderr.contains("RoCE needs a GRH") || c.stderr.contains("RoCE needs a GRH"),
        "server: {s}\nclient: {c}"
    );
    assert!(s.stderr.contains("-g N"), "{s}");
}

/// Whether network namespaces can be made here (root, and `ip` present); prints one line
/// naming the test when not, or fails it when `SHMHCA_REQUIRE_NETNS=1` (set by `.ci/run`).
fn netns_available(test: &str) -> bool {
    // SAFETY: a plain system call.
    let root = unsafe { libc::geteuid() } == 0;
    let ip = std::process::Command::new("ip")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if std::env::var_os("SHMHCA_REQUIRE_NETNS").is_some_and(|v| v == "1") && !(root && ip) {
        panic!(
            "{test}: needs root and the `ip` command for network namespaces, and SHMHCA_REQUIRE_NETNS=1 requires them"
        );
    }
    if !(root && ip) {
        eprintln!("{test}: skipped (needs root and the ip command for network namespaces)");
    }
    root && ip
}

/// Runs `ip ARGS`; panics with its output if it fails.
fn ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("ip {args:?}: {e}"));
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// A named network namespace with its loopback up, deleted on drop (with its interfaces).
struct Netns(String);

impl Netns {
    fn new(name: String) -> Netns {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &name])
            .output();
        ip(&["netns", "add", &name]);
        let ns = Netns(name);
        ip(&["-n", &ns.0, "link", "set", "lo", "up"]);
        ns
    }

    /// Programs started in this namespace over the RoCEv2 port.
    fn how(&self) -> How {
        How {
            roce: true,
            wrap: ["ip", "netns", "exec", &self.0].map(String::from).to_vec(),
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.0])
            .output();
    }
}

/// A name unique to this test run and test.
fn unique(what: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "shr{what}{}x{}",
        std::process::id() % 100_000,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// The index of GID `gid` (e.g. `::ffff:198.18.0.1`) as `ibv_devinfo -v` over the RoCEv2
/// port lists it in namespace `how`.
fn gid_index(how: &How, gid: &str) -> String {
    let devinfo = tool("ibv_devinfo").expect("ibv_devinfo (checked by the caller)");
    let out = start_how(&devinfo, &["-v"], &[], how).wait(DEADLINE);
    assert!(out.ok(), "{out}");
    let want = format!("{gid}, RoCE v2");
    let line = out
        .stdout
        .lines()
        .find(|l| l.contains("GID[") && l.contains(&want))
        .unwrap_or_else(|| panic!("no GID {gid} in\n{out}"));
    let i = line.split('[').nth(1).and_then(|r| r.split(']').next());
    i.map(str::trim)
        .unwrap_or_else(|| panic!("no index in {line:?}"))
        .to_string()
}

/// Two namespaces joined by a veth pair: A has 198.18.0.1/30, B 198.18.0.2/30.
struct Veth {
    a: Netns,
    b: Netns,
}

impl Veth {
    fn new() -> Veth {
        let (a, b) = (Netns::new(unique("a")), Netns::new(unique("b")));
        let (va, vb) = (unique("va"), unique("vb"));
        ip(&[
            "link", "add", &va, "netns", &a.0, "type", "veth", "peer", "name", &vb, "netns", &b.0,
        ]);
        ip(&["-n", &a.0, "addr", "add", "198.18.0.1/30", "dev", &va]);
        ip(&["-n", &b.0, "addr", "add", "198.18.0.2/30", "dev", &vb]);
        ip(&["-n", &a.0, "link", "set", &va, "up"]);
        ip(&["-n", &b.0, "link", "set", &vb, "up"]);
        Veth { a, b }
    }

    /// Runs `prog`'s server in A and client in B, each with `args` and its 198.18 GID's
    /// index after `gid_option`; both outcomes.
    fn pair(&self, prog: &std::path::Path, gid_option: &str, args: &[&str]) -> (Outcome, Outcome) {
        let (ha, hb) = (self.a.how(), self.b.how());
        let ia = gid_index(&ha, "::ffff:198.18.0.1");
        let ib = gid_index(&hb, "::ffff:198.18.0.2");
        let mut sa = vec![gid_option, &ia];
        sa.extend_from_slice(args);
        let mut ca = vec![gid_option, &ib];
        ca.extend_from_slice(args);
        pair_how(prog, (&sa, &ha), (&ca, &hb), &[], "198.18.0.1")
    }
}

/// The programs a namespace test needs, and root: `None` (after one line) to skip.
fn namespace_test(test: &str, prog: &str) -> Option<std::path::PathBuf> {
    let p = tool(prog)?;
    tool("ibv_devinfo")?;
    netns_available(test).then_some(p)
}

/// `ibv_rc_pingpong -g N` between two loopback addresses of one namespace (127.0.0.1 and
/// 127.0.0.2, each process binding UDP 4791 on its own).
#[test]
fn roce_ibv_rc_pingpong_between_two_loopback_addresses() {
    let test = "roce_ibv_rc_pingpong_between_two_loopback_addresses";
    let Some(p) = namespace_test(test, "ibv_rc_pingpong") else {
        return;
    };
    let _g = lock();
    let ns = Netns::new(unique("l"));
    ip(&["-n", &ns.0, "addr", "add", "127.0.0.2/8", "dev", "lo"]);
    let how = ns.how();
    let i1 = gid_index(&how, "::ffff:127.0.0.1");
    let i2 = gid_index(&how, "::ffff:127.0.0.2");
    let common = ["-n", "100", "-s", "1024", "--chk"];
    let mut sa = vec!["-g", &i1];
    sa.extend(common);
    let mut ca = vec!["-g", &i2];
    ca.extend(common);
    let (s, c) = pair_how(&p, (&sa, &how), (&ca, &how), &[], "127.0.0.1");
    assert!(s.ok() && c.ok(), "server: {s}\nclient: {c}");
    assert!(s.stdout.contains("bytes in") && c.stdout.contains("bytes in"));
    assert!(c.stdout.contains("GID ::ffff:127.0.0.1"), "{c}");
}

/// `ibv_rc_pingpong -g N --chk -n 1000 -s 4096` across a veth pair, as between two hosts.
#[test]
fn roce_ibv_rc_pingpong_across_a_veth_pair() {
    let test = "roce_ibv_rc_pingpong_across_a_veth_pair";
    let Some(p) = namespace_test(test, "ibv_rc_pingpong") else {
        return;
    };
    let _g = lock();
    let veth = Veth::new();
    let (s, c) = veth.pair(&p, "-g", &["--chk", "-n", "1000", "-s", "4096"]);
    assert!(s.ok() && c.ok(), "server: {s}\nclient: {c}");
    assert!(s.stdout.contains("bytes in") && c.stdout.contains("bytes in"));
    assert!(c.stdout.contains("GID ::ffff:198.18.0.1"), "{c}");
}

/// `shmhca rc-pingpong` (the Rust API over a UdpPort, speaking ibv_rc_pingpong's TCP
/// exchange) pairs with unmodified `ibv_rc_pingpong --chk` across a veth pair, as server
/// and as client: one engine's RoCEv2 against another program's, through the exchange a
/// RoCE NIC's peer would use.
#[test]
fn roce_shmhca_rc_pingpong_pairs_with_ibv_rc_pingpong_both_ways() {
    let test = "roce_shmhca_rc_pingpong_pairs_with_ibv_rc_pingpong_both_ways";
    let Some(p) = namespace_test(test, "ibv_rc_pingpong") else {
        return;
    };
    let shmhca = target_dir().join("shmhca");
    assert!(
        shmhca.is_file(),
        "{} (cargo build -p shmhca-tools)",
        shmhca.display()
    );
    let _g = lock();
    let veth = Veth::new();
    let (ha, hb) = (veth.a.how(), veth.b.how());
    let ia = gid_index(&ha, "::ffff:198.18.0.1");
    let ib = gid_index(&hb, "::ffff:198.18.0.2");
    let rust = |i: &str| -> Vec<String> {
        ["rc-pingpong", "-g", i, "--chk", "-n", "300", "-s", "4096"]
            .map(String::from)
            .to_vec()
    };
    let verbs = |i: &str| -> Vec<String> {
        ["-g", i, "--chk", "-n", "300", "-s", "4096"]
            .map(String::from)
            .to_vec()
    };
    for rust_serves in [true, false] {
        let (sa, ca) = if rust_serves {
            (rust(&ia), verbs(&ib))
        } else {
            (verbs(&ia), rust(&ib))
        };
        let (sp, cp) = if rust_serves {
            (&shmhca, &p)
        } else {
            (&p, &shmhca)
        };
        let (sa, ca): (Vec<&str>, Vec<&str>) = (
            sa.iter().map(String::as_str).collect(),
            ca.iter().map(String::as_str).collect(),
        );
        let (s, c) = pair_progs((sp, &sa, &ha), (cp, &ca, &hb), &[], "198.18.0.1");
        assert!(
            s.ok() && c.ok(),
            "shmhca rc-pingpong serving: {rust_serves}\nserver: {s}\nclient: {c}"
        );
        for o in [&s, &c] {
            assert!(o.stdout.contains("300 iters in"), "{o}");
        }
    }
}

/// A path MTU over the interface's (4096 on a veth of MTU 1500) fails RTR with EINVAL and,
/// with `SHMHCA_VERBS_DEBUG`, a line saying why.
#[test]
fn roce_a_path_mtu_over_the_interfaces_is_refused() {
    let test = "roce_a_path_mtu_over_the_interfaces_is_refused";
    let Some(p) = namespace_test(test, "ibv_rc_pingpong") else {
        return;
    };
    let _g = lock();
    let veth = Veth::new();
    let (ha, hb) = (veth.a.how(), veth.b.how());
    let ia = gid_index(&ha, "::ffff:198.18.0.1");
    let ib = gid_index(&hb, "::ffff:198.18.0.2");
    let env = [("SHMHCA_VERBS_DEBUG", "1")];
    let (s, c) = pair_how(
        &p,
        (&["-g", &ia, "-m", "4096", "-n", "10"], &ha),
        (&["-g", &ib, "-m", "4096", "-n", "10"], &hb),
        &env,
        "198.18.0.1",
    );
    assert!(!s.ok() && !c.ok(), "server: {s}\nclient: {c}");
    assert!(
        s.stderr.contains("over the active MTU"),
        "server: {s}\nclient: {c}"
    );
}

/// perftest's `ib_send_lat -x N -F` across a veth pair.
#[test]
fn roce_ib_send_lat_across_a_veth_pair() {
    let Some(p) = namespace_test("roce_ib_send_lat_across_a_veth_pair", "ib_send_lat") else {
        return;
    };
    let _g = lock();
    let veth = Veth::new();
    let (s, c) = veth.pair(&p, "-x", &["-F", "-n", "1000"]);
    assert!(s.ok() && c.ok(), "server: {s}\nclient: {c}");
    assert!(c.stdout.contains("#bytes"), "no table: {c}");
}

/// perftest's `ib_write_bw -x N -F` across a veth pair.
#[test]
fn roce_ib_write_bw_across_a_veth_pair() {
    let Some(p) = namespace_test("roce_ib_write_bw_across_a_veth_pair", "ib_write_bw") else {
        return;
    };
    let _g = lock();
    let veth = Veth::new();
    let (s, c) = veth.pair(&p, "-x", &["-F", "-n", "500"]);
    assert!(s.ok() && c.ok(), "server: {s}\nclient: {c}");
    assert!(c.stdout.contains("#bytes"), "no table: {c}");
}
