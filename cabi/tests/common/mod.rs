//! What the tests of Debian's verbs programs over shmhca share: finding the programs (a
//! missing one skips its test with one line, unless `SHMHCA_REQUIRE_VERBS_TOOLS=1`),
//! starting them through `shmhca exec` (or with the library path set by hand when the
//! `shmhca` binary is not built), bounded waits, and killing every child on failure.

#![allow(dead_code)]

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One pair of programs at a time: two processes × (program + engine thread) on a 2-core
/// machine is what the defaults are measured for.
pub(crate) static SERIAL: Mutex<()> = Mutex::new(());

/// How long one program may run in a debug build.
pub(crate) const DEADLINE: Duration = Duration::from_secs(180);

/// `target/<profile>`, where the library and the `shmhca` binary are built.
pub(crate) fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

/// The installed program `name`, or `None` (after one line saying so) to skip the test:
/// when the program is not installed, or shmhca's `libibverbs.so.1` is not built next to
/// this test (`cargo test` builds it; a test binary run from elsewhere may not find it).
pub(crate) fn tool(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|f| f.is_file())
    });
    let lib = target_dir().join("libibverbs.so.1");
    let msg = if found.is_none() {
        format!("{name} is not installed (apt-get install perftest ibverbs-utils rdmacm-utils)")
    } else if !lib.exists() {
        format!(
            "{} is not built (cargo build -p shmhca-verbs -p shmhca-tools)",
            lib.display()
        )
    } else {
        return found;
    };
    if std::env::var_os("SHMHCA_REQUIRE_VERBS_TOOLS").is_some_and(|v| v == "1") {
        panic!("{msg}, and SHMHCA_REQUIRE_VERBS_TOOLS=1 requires it");
    }
    eprintln!("skipped: {msg}");
    None
}

/// A child process killed (and reaped) when dropped, so a failing test leaves none behind.
pub(crate) struct Proc {
    child: Option<Child>,
    /// Its command line, for messages.
    pub(crate) what: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What a finished program did.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// Its exit code (`None`: killed by a signal).
    pub(crate) code: Option<i32>,
    /// Standard output.
    pub(crate) stdout: String,
    /// Standard error.
    pub(crate) stderr: String,
}

impl Outcome {
    /// Whether it exited with 0.
    pub(crate) fn ok(&self) -> bool {
        self.code == Some(0)
    }
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

/// Starts `prog args…` over shmhca.
pub(crate) fn start(prog: &Path, args: &[&str]) -> Proc {
    start_env(prog, args, &[])
}

/// Starts `prog args…` over shmhca with the variables `env` added to its environment.
pub(crate) fn start_env(prog: &Path, args: &[&str], env: &[(&str, &str)]) -> Proc {
    start_how(prog, args, env, &How::default())
}

/// How a program is started, besides through `shmhca exec`.
#[derive(Debug, Clone, Default)]
pub(crate) struct How {
    /// `shmhca exec --roce`: port 1 is a RoCEv2 port.
    pub(crate) roce: bool,
    /// A command that runs the rest in another namespace and execs it (so the program
    /// keeps its process id), e.g. `ip netns exec NAME`; empty: none.
    pub(crate) wrap: Vec<String>,
}

/// [`start_env`], started as `how` says.
pub(crate) fn start_how(prog: &Path, args: &[&str], env: &[(&str, &str)], how: &How) -> Proc {
    let dir = target_dir();
    let shmhca = dir.join("shmhca");
    let mut argv: Vec<std::ffi::OsString> = how.wrap.iter().map(Into::into).collect();
    if shmhca.is_file() {
        argv.extend([shmhca.into_os_string(), "exec".into()]);
        if how.roce {
            argv.push("--roce".into());
        }
        argv.push("--".into());
    }
    argv.push(prog.into());
    argv.extend(args.iter().map(Into::into));
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..]);
    if !dir.join("shmhca").is_file() {
        cmd.env("LD_LIBRARY_PATH", &dir);
        if how.roce {
            cmd.env("SHMHCA_VERBS_LINK", "roce");
        }
    }
    assert!(
        dir.join("libibverbs.so.1").exists(),
        "no libibverbs.so.1 in {} (the build script links it)",
        dir.display()
    );
    cmd.envs(env.iter().copied());
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let what = argv
        .iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    Proc {
        child: Some(child),
        what,
    }
}

impl Proc {
    /// Waits (at most `limit`) for it to exit; kills it at the limit.
    pub(crate) fn wait(mut self, limit: Duration) -> Outcome {
        let mut child = self.child.take().expect("not waited yet");
        let start = Instant::now();
        let code = loop {
            match child.try_wait() {
                Ok(Some(st)) => break st.code(),
                Ok(None) if start.elapsed() < limit => {
                    std::thread::sleep(Duration::from_millis(20))
                }
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

    /// Its process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
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

/// A TCP port nobody listens on now.
pub(crate) fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    l.local_addr().expect("its address").port()
}

/// Whether some socket listens on TCP `port` (read from /proc/net/tcp{,6}, so that no probe
/// connection is made: the servers accept only one).
pub(crate) fn listening(port: u16) -> bool {
    listening_in("self", port)
}

/// [`listening`] in the network namespace of process `pid` (`self`: this one's), read from
/// /proc/PID/net/tcp{,6}.
pub(crate) fn listening_in(pid: &str, port: u16) -> bool {
    let want = format!(":{port:04X} ");
    ["tcp", "tcp6"].iter().any(|t| {
        let f = format!("/proc/{pid}/net/{t}");
        std::fs::read_to_string(f).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && format!("{} ", cols[1]).ends_with(&want) && cols[3] == "0A"
            })
        })
    })
}

/// Runs a server (`prog server_args… -p PORT`) and, once it listens, a client
/// (`prog client_args… -p PORT localhost`); returns both outcomes. Both are killed if either
/// fails to finish in time.
pub(crate) fn pair(prog: &Path, server_args: &[&str], client_args: &[&str]) -> (Outcome, Outcome) {
    pair_env(prog, server_args, client_args, &[])
}

/// [`pair`] with the variables `env` added to both programs' environment.
pub(crate) fn pair_env(
    prog: &Path,
    server_args: &[&str],
    client_args: &[&str],
    env: &[(&str, &str)],
) -> (Outcome, Outcome) {
    let how = How::default();
    pair_how(
        prog,
        (server_args, &how),
        (client_args, &how),
        env,
        "localhost",
    )
}

/// [`pair_env`] with each side started as its `How` says, the client given `server` as the
/// server's host name.
pub(crate) fn pair_how(
    prog: &Path,
    (server_args, server_how): (&[&str], &How),
    (client_args, client_how): (&[&str], &How),
    env: &[(&str, &str)],
    server_host: &str,
) -> (Outcome, Outcome) {
    pair_progs(
        (prog, server_args, server_how),
        (prog, client_args, client_how),
        env,
        server_host,
    )
}

/// [`pair_how`] with a program of its own on each side (two implementations of one
/// exchange, e.g. `ibv_rc_pingpong` and `shmhca rc-pingpong`).
#[allow(dead_code)] // (each test binary uses a part of this module)
pub(crate) fn pair_progs(
    (server_prog, server_args, server_how): (&Path, &[&str], &How),
    (client_prog, client_args, client_how): (&Path, &[&str], &How),
    env: &[(&str, &str)],
    server_host: &str,
) -> (Outcome, Outcome) {
    let prog = server_prog;
    let port = free_port().to_string();
    let mut s_args: Vec<&str> = server_args.to_vec();
    s_args.extend(["-p", &port]);
    let server = start_how(prog, &s_args, env, server_how);
    let pid = server.pid().to_string();
    let t0 = Instant::now();
    while !listening_in(&pid, port.parse().unwrap()) {
        if t0.elapsed() > Duration::from_secs(60) {
            let out = server.wait(Duration::from_secs(1));
            panic!("the server never listened on port {port}: {out}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c_args: Vec<&str> = client_args.to_vec();
    c_args.extend(["-p", &port, server_host]);
    let client = start_how(client_prog, &c_args, env, client_how);
    let c = client.wait(DEADLINE);
    let s = server.wait(if c.ok() {
        DEADLINE
    } else {
        Duration::from_secs(10)
    });
    (s, c)
}
