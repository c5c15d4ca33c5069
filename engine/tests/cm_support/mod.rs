//! Helpers of the connection-manager tests: re-executing the test binary as a peer process,
//! a private socket directory, and polling with a deadline.
//!
//! A two-process test is one `#[test]` function that plays both parts: run normally, it is
//! the parent and spawns `current_exe() <its own name> --exact` with [`ROLE_ENV`] set; in
//! that child the same function sees the variable and plays the peer. So `cargo test` runs
//! them with no extra setup, and no test is a no-op.
#![allow(dead_code, missing_docs, unreachable_pub)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use shmhca::{Context, Cq, EngineMode, WorkCompletion};

/// Names the role of a re-executed peer.
pub const ROLE_ENV: &str = "SHMHCA_CM_TEST_ROLE";
/// The peer's argument (usually a socket path).
pub const ARG_ENV: &str = "SHMHCA_CM_TEST_ARG";

/// How long any single wait in these tests may take before it is a failure. Generous: the
/// machine is small and noisy; nothing here measures speed.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Two-process tests of one binary run one at a time: each process spins on its CQ, and
/// the machine has two cores.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// In a re-executed peer: its role and argument.
pub fn role() -> Option<(String, String)> {
    let role = std::env::var(ROLE_ENV).ok()?;
    Some((role, std::env::var(ARG_ENV).unwrap_or_default()))
}

/// A peer process: this test binary running one test in a role.
pub struct Peer {
    child: Option<Child>,
    what: String,
    out: Option<std::thread::JoinHandle<String>>,
    err: Option<std::thread::JoinHandle<String>>,
}

fn drain(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = r.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    })
}

/// Starts this test binary again, running only `test` as `role` with `arg`.
pub fn spawn_peer(test: &str, role: &str, arg: &str) -> Peer {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut child = Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, role)
        .env(ARG_ENV, arg)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning the peer process");
    let out = drain(child.stdout.take().expect("piped"));
    let err = drain(child.stderr.take().expect("piped"));
    Peer {
        child: Some(child),
        what: format!("peer `{test}` as {role}"),
        out: Some(out),
        err: Some(err),
    }
}

impl Peer {
    /// The peer's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    fn output(&mut self) -> String {
        let out = self
            .out
            .take()
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        let err = self
            .err
            .take()
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        format!("--- stdout ---\n{out}\n--- stderr ---\n{err}")
    }

    /// Waits for the peer to exit and asserts it succeeded, showing its output if not.
    pub fn expect_success(mut self) {
        let mut child = self.child.take().expect("running");
        let start = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().expect("waiting for the peer") {
                break s;
            }
            if start.elapsed() > DEADLINE {
                let _ = child.kill();
                let _ = child.wait();
                let output = self.output();
                panic!("{} did not finish in {DEADLINE:?}\n{output}", self.what);
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let output = self.output();
        assert!(
            status.success(),
            "{} failed ({status})\n{output}",
            self.what
        );
    }

    /// Kills the peer with SIGKILL and reaps it.
    pub fn kill(mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().expect("SIGKILL");
        child.wait().expect("reaping the peer");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Never leave a peer behind when a test fails half-way; show what it said.
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
            let output = self.output();
            eprintln!("{} (killed by the failing test)\n{output}", self.what);
        }
    }
}

/// A fresh private directory for socket files, removed (and checked empty) by
/// [`SockDir::assert_empty_and_remove`].
pub struct SockDir {
    pub path: PathBuf,
}

impl SockDir {
    pub fn new(tag: &str) -> SockDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "shmhca-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("creating the socket directory");
        SockDir { path }
    }

    pub fn sock(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// Asserts nothing is left in the directory, then removes it.
    pub fn assert_empty_and_remove(self) {
        let left: Vec<_> = std::fs::read_dir(&self.path)
            .expect("listing the socket directory")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert!(
            left.is_empty(),
            "left behind in {}: {left:?}",
            self.path.display()
        );
        std::fs::remove_dir(&self.path).expect("removing the socket directory");
    }
}

/// Entries of /dev/shm whose name mentions shmhca (memfds never appear there; a file would
/// be a leak).
pub fn dev_shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains("shmhca"))
                .collect()
        })
        .unwrap_or_default()
}

/// An inline-mode context without huge pages (the tests drive the engine by polling).
pub fn context(arena: u64) -> Context {
    Context::builder()
        .arena_size(arena)
        .huge_pages(shmhca_rings::HugePages::Never)
        .mode(EngineMode::Inline)
        .build()
        .expect("context")
}

/// Polls `cq` until `n` completions arrived; panics (showing what came) after [`DEADLINE`].
pub fn wait(cq: &mut Cq, n: usize) -> Vec<WorkCompletion> {
    let mut out = vec![WorkCompletion::default(); n];
    let mut got = 0;
    let start = Instant::now();
    while got < n {
        let k = cq.poll(&mut out[got..]);
        got += k;
        if k == 0 {
            assert!(
                start.elapsed() < DEADLINE,
                "only {got} of {n} completions arrived: {:?}",
                &out[..got]
            );
            std::thread::yield_now();
        }
    }
    out
}

/// Polls `cq` for `d`, returning whatever arrived.
pub fn drain_for(cq: &mut Cq, d: Duration) -> Vec<WorkCompletion> {
    let mut all = Vec::new();
    let mut buf = [WorkCompletion::default(); 64];
    let start = Instant::now();
    while start.elapsed() < d {
        let n = cq.poll(&mut buf);
        all.extend_from_slice(&buf[..n]);
        if n == 0 {
            std::thread::yield_now();
        }
    }
    all
}

/// Repeats `check` until it holds; panics with `what` after [`DEADLINE`].
pub fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < DEADLINE, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A deterministic byte pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// Whether `path` exists (socket files included).
pub fn exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}
