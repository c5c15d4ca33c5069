//! Debian's `rping` (rdmacm-utils) over shmhca's librdmacm and libibverbs, started with
//! `shmhca exec` (or the library path set by hand when the `shmhca` binary is not built),
//! each test in its own fabric directory; and a non-local address refused.
//!
//! Needs `target/<profile>/libibverbs.so.1` and `librdmacm.so.1`: build with
//! `cargo build -p shmhca-verbs -p shmhca-rdmacm -p shmhca-tools` first.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One pair of programs at a time (2 cores).
static SERIAL: Mutex<()> = Mutex::new(());
/// How long one program may run in a debug build.
const DEADLINE: Duration = Duration::from_secs(120);

fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

/// The installed program `name`, or `None` (after one line saying so) to skip the test:
/// when it is not installed, or shmhca's libraries are not built next to this test
/// (`librdmacm.so.1` is a cdylib only: `cargo test` does not build it, `cargo build` does).
fn tool(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|f| f.is_file())
    });
    let dir = target_dir();
    let missing = ["libibverbs.so.1", "librdmacm.so.1"]
        .into_iter()
        .find(|lib| !dir.join(lib).exists());
    let msg = match (&found, missing) {
        (None, _) => format!("{name} is not installed (apt-get install rdmacm-utils perftest)"),
        (Some(_), Some(lib)) => format!(
            "{lib} is not built in {} (cargo build -p shmhca-verbs -p shmhca-rdmacm -p shmhca-tools)",
            dir.display()
        ),
        (Some(_), None) => return found,
    };
    if std::env::var_os("SHMHCA_REQUIRE_VERBS_TOOLS").is_some_and(|v| v == "1") {
        panic!("{msg}, and SHMHCA_REQUIRE_VERBS_TOOLS=1 requires it");
    }
    eprintln!("skipped: {msg}");
    None
}

/// A temporary fabric directory (0700), removed when dropped.
struct FabricDir(PathBuf);

impl FabricDir {
    fn new(tag: &str) -> FabricDir {
        use std::os::unix::fs::DirBuilderExt;
        let base = std::env::temp_dir();
        for n in 0..1000u32 {
            let p = base.join(format!("shmhca-rdmacm-{tag}-{}-{n}", std::process::id()));
            if std::fs::DirBuilder::new().mode(0o700).create(&p).is_ok() {
                return FabricDir(p);
            }
        }
        panic!("cannot make a temporary fabric directory");
    }
}

impl Drop for FabricDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child killed (and reaped) when dropped.
struct Proc {
    child: Option<Child>,
    what: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[derive(Debug)]
struct Outcome {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\n--- stdout:\n{}\n--- stderr:\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

fn start(fabric: &FabricDir, prog: &Path, args: &[&str]) -> Proc {
    let dir = target_dir();
    for lib in ["libibverbs.so.1", "librdmacm.so.1"] {
        assert!(
            dir.join(lib).exists(),
            "no {lib} in {} (cargo build -p shmhca-verbs -p shmhca-rdmacm -p shmhca-tools)",
            dir.display()
        );
    }
    let shmhca = dir.join("shmhca");
    let mut cmd = if shmhca.is_file() {
        let mut c = Command::new(&shmhca);
        c.arg("exec").arg("--").arg(prog).args(args);
        c
    } else {
        let mut c = Command::new(prog);
        c.args(args).env("LD_LIBRARY_PATH", &dir);
        c
    };
    cmd.env("SHMHCA_FABRIC_DIR", &fabric.0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let what = format!("{} {}", prog.display(), args.join(" "));
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    Proc {
        child: Some(child),
        what,
    }
}

impl Proc {
    fn wait(mut self, limit: Duration) -> Outcome {
        let mut child = self.child.take().expect("not waited yet");
        let t0 = Instant::now();
        let code = loop {
            match child.try_wait() {
                Ok(Some(st)) => break st.code(),
                Ok(None) if t0.elapsed() < limit => std::thread::sleep(Duration::from_millis(20)),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let (o, e) = drain(&mut child);
                    panic!(
                        "{} did not finish within {limit:?}\n--- stdout:\n{o}\n--- stderr:\n{e}",
                        self.what
                    );
                }
            }
        };
        let (stdout, stderr) = drain(&mut child);
        Outcome {
            code,
            stdout,
            stderr,
        }
    }
}

fn drain(c: &mut Child) -> (String, String) {
    let mut o = String::new();
    let mut e = String::new();
    if let Some(mut s) = c.stdout.take() {
        let _ = s.read_to_string(&mut o);
    }
    if let Some(mut s) = c.stderr.take() {
        let _ = s.read_to_string(&mut e);
    }
    (o, e)
}

/// A port number for this test (the rendezvous is per fabric directory, so any will do).
fn port() -> String {
    (20_000 + std::process::id() % 20_000).to_string()
}

/// Waits until the server's rendezvous socket for `port` exists (it listens).
fn wait_listening(fabric: &FabricDir, port: &str, server: Proc) -> Proc {
    let sock = fabric.0.join(format!("rdmacm-{port}.sock"));
    let t0 = Instant::now();
    while !sock.exists() {
        if t0.elapsed() > Duration::from_secs(60) {
            let out = server.wait(Duration::from_secs(1));
            panic!(
                "the server never listened ({} missing): {out}",
                sock.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    server
}

#[test]
fn rping_ten_verified_pings() {
    let Some(rping) = tool("rping") else { return };
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let fabric = FabricDir::new("rping");
    let p = port();
    let server = start(
        &fabric,
        &rping,
        &["-s", "-a", "127.0.0.1", "-p", &p, "-V", "-C", "10", "-v"],
    );
    let server = wait_listening(&fabric, &p, server);
    let client = start(
        &fabric,
        &rping,
        &["-c", "-a", "127.0.0.1", "-p", &p, "-C", "10", "-V", "-v"],
    );
    let c = client.wait(DEADLINE);
    let s = server.wait(if c.code == Some(0) {
        DEADLINE
    } else {
        Duration::from_secs(10)
    });
    assert_eq!(c.code, Some(0), "client:\n{c}\nserver:\n{s}");
    assert_eq!(s.code, Some(0), "server:\n{s}\nclient:\n{c}");
    let pings = c
        .stdout
        .lines()
        .filter(|l| l.starts_with("ping data: rdma-ping-"))
        .count();
    assert_eq!(pings, 10, "client:\n{c}");
    let served = s
        .stdout
        .lines()
        .filter(|l| l.starts_with("server ping data: rdma-ping-"))
        .count();
    assert_eq!(served, 10, "server:\n{s}");
}

#[test]
fn rping_to_a_port_nobody_listens_on_is_rejected() {
    let Some(rping) = tool("rping") else { return };
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let fabric = FabricDir::new("nolisten");
    let p = port();
    let c = start(
        &fabric,
        &rping,
        &["-c", "-a", "127.0.0.1", "-p", &p, "-C", "1"],
    )
    .wait(DEADLINE);
    assert_ne!(c.code, Some(0), "{c}");
    assert!(
        c.stdout.contains("RDMA_CM_EVENT_REJECTED") || c.stderr.contains("RDMA_CM_EVENT_REJECTED"),
        "{c}"
    );
}

#[test]
fn rping_to_another_machine_is_refused() {
    let Some(rping) = tool("rping") else { return };
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let fabric = FabricDir::new("remote");
    // TEST-NET-1 (RFC 5737): never an address of this machine.
    let c = start(
        &fabric,
        &rping,
        &["-c", "-a", "192.0.2.1", "-p", "7471", "-C", "1"],
    )
    .wait(DEADLINE);
    assert_ne!(c.code, Some(0), "{c}");
    assert!(
        c.stderr
            .contains("192.0.2.1 is not an address of this machine"),
        "{c}"
    );
    assert!(c.stderr.contains("Cannot assign requested address"), "{c}");
}

/// Runs perftest's `prog -R args…` server and `localhost` client in one fabric directory.
fn perftest_pair(prog: &str, args: &[&str]) -> Option<(Outcome, Outcome)> {
    let prog = tool(prog)?;
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let fabric = FabricDir::new("perftest");
    let p = port();
    let mut s_args = vec!["-R", "-p", p.as_str()];
    s_args.extend_from_slice(args);
    let server = start(&fabric, &prog, &s_args);
    // perftest -R exchanges its parameters over a first rdma_cm connection.
    let server = wait_listening(&fabric, &p, server);
    let mut c_args = s_args.clone();
    c_args.push("localhost");
    let c = start(&fabric, &prog, &c_args).wait(DEADLINE);
    let s = server.wait(if c.code == Some(0) {
        DEADLINE
    } else {
        Duration::from_secs(10)
    });
    Some((s, c))
}

#[test]
fn ib_send_lat_over_rdma_cm() {
    let Some((s, c)) = perftest_pair("ib_send_lat", &["-n", "20"]) else {
        return;
    };
    assert_eq!(c.code, Some(0), "client:\n{c}\nserver:\n{s}");
    assert_eq!(s.code, Some(0), "server:\n{s}\nclient:\n{c}");
    assert!(c.stdout.contains("Data ex. method : rdma_cm"), "{c}");
    assert!(
        c.stdout
            .lines()
            .any(|l| l.split_whitespace().take(2).eq(["2", "20"])),
        "no result line for 2 bytes × 20 iterations:\n{c}"
    );
}

#[test]
fn ib_write_bw_over_rdma_cm() {
    let Some((s, c)) = perftest_pair("ib_write_bw", &["-n", "50"]) else {
        return;
    };
    assert_eq!(c.code, Some(0), "client:\n{c}\nserver:\n{s}");
    assert_eq!(s.code, Some(0), "server:\n{s}\nclient:\n{c}");
    assert!(
        c.stdout
            .lines()
            .any(|l| l.split_whitespace().take(2).eq(["65536", "50"])),
        "no result line for 65536 bytes × 50 iterations:\n{c}"
    );
}
