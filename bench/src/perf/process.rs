//! The process lifecycle: what a signal or an error must clean up (sockets, directories,
//! the child), the signal thread, pinning, and the self-spawned peer (private directory,
//! socket, pinned child process, readiness, reaping).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::perf::error::PerfError;
use crate::perf::opts::Options;
use crate::perf::output::Output;
use crate::perf::sequence::run_sizes;
use crate::perf::setup::{self, Resources};
use crate::perf::stats::rss_kib;

/// The line a spawned server prints on stdout once it listens.
pub const READY_LINE: &str = "shmhca-perf server ready";

/// What a signal must clean up: the sockets this process created (path, device and
/// inode), directories, the child process.
#[derive(Debug, Default)]
pub(crate) struct CleanupList {
    sockets: Vec<(PathBuf, (u64, u64))>,
    pub(crate) dirs: Vec<PathBuf>,
    child: Option<u32>,
}

static CLEANUP: Mutex<CleanupList> = Mutex::new(CleanupList {
    sockets: Vec::new(),
    dirs: Vec::new(),
    child: None,
});

pub(crate) fn cleanup_list() -> std::sync::MutexGuard<'static, CleanupList> {
    CLEANUP.lock().unwrap_or_else(|e| e.into_inner())
}

/// The device and inode of the file at `path` (not following a symlink).
fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// Registers the socket a listener of this process has just created at `path`, for
/// removal if a signal ends the process. Only that file is ever removed: if something
/// else has replaced it by then, it stays.
pub(crate) fn register_socket(path: &Path) {
    if let Some(id) = file_id(path) {
        cleanup_list().sockets.push((path.to_path_buf(), id));
    }
}

/// Kills the child and removes every registered socket (if it is still the one this
/// process created) and directory.
pub(crate) fn cleanup_now() {
    let mut c = cleanup_list();
    if let Some(pid) = c.child.take() {
        if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
    for (f, id) in c.sockets.drain(..) {
        if file_id(&f) == Some(id) {
            let _ = std::fs::remove_file(f);
        }
    }
    for d in c.dirs.drain(..) {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Ctrl-C, SIGTERM, SIGHUP: clean up, say so, exit 130-ish. Runs on its own thread.
pub(crate) fn install_signal_handler() -> Result<(), PerfError> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .map_err(PerfError::io("installing the signal handler"))?;
    std::thread::Builder::new()
        .name("shmhca-perf-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                cleanup_now();
                eprintln!("shmhca-perf: interrupted (signal {sig}); peer stopped, files removed");
                std::process::exit(128 + sig);
            }
        })
        .map_err(PerfError::io("starting the signal thread"))?;
    Ok(())
}

/// A spawned server ends with the client that started it, whatever kills the client: it
/// gets SIGTERM, which the signal thread turns into a clean-up and an exit.
pub(crate) fn exit_with_parent() -> Result<(), PerfError> {
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))
        .map_err(|e| PerfError::io("asking to end with the parent process")(e.into()))?;
    // The parent may have died before the request: then this process was re-parented.
    match rustix::process::getppid() {
        Some(p) if p.as_raw_nonzero().get() != 1 => Ok(()),
        _ => Err(PerfError::Peer(
            "the client that started this server is gone".into(),
        )),
    }
}

/// Pins this thread to `core` (best effort: a failure leaves it unpinned).
pub(crate) fn pin(core: Option<usize>) {
    if let Some(id) = core {
        if !core_affinity::set_for_current(core_affinity::CoreId { id }) {
            eprintln!("shmhca-perf: warning: could not pin to core {id}");
        }
    }
}

/// A private directory for the socket, removed on every path.
fn make_temp_dir() -> Result<PathBuf, PerfError> {
    use std::os::unix::fs::DirBuilderExt;
    // The socket path inside must stay under the 108 bytes of a Unix socket address.
    let base = Some(std::env::temp_dir())
        .filter(|b| b.as_os_str().len() < 60)
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    for attempt in 0..16u32 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = base.join(format!(
            "shmhca-perf-{}-{:08x}",
            std::process::id(),
            nanos ^ attempt
        ));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {
                cleanup_list().dirs.push(dir.clone());
                return Ok(dir);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(PerfError::Io {
                    what: format!("creating a private directory in {}", base.display()),
                    source: e,
                });
            }
        }
    }
    Err(PerfError::Peer(format!(
        "could not create a fresh directory in {}",
        base.display()
    )))
}

/// The child: this executable as the server, with the same flags.
fn spawn_server(sock: &Path) -> Result<Child, PerfError> {
    let exe = std::env::current_exe().map_err(PerfError::io("finding this executable"))?;
    let mut cmd = Command::new(exe);
    cmd.args(std::env::args_os().skip(1))
        .arg("--server")
        .arg(sock)
        .arg("--spawned")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let child = cmd
        .spawn()
        .map_err(PerfError::io("starting the server process"))?;
    cleanup_list().child = Some(child.id());
    Ok(child)
}

/// Waits until the spawned server says it listens.
fn wait_ready(child: &mut Child, timeout: Duration) -> Result<(), PerfError> {
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| PerfError::Peer("the server process has no stdout pipe".into()))?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("shmhca-perf-ready".into())
        .spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let ok = matches!(lines.next(), Some(Ok(l)) if l == READY_LINE);
            let _ = tx.send(ok);
            // Keep reading (and discarding) so the child never blocks on a full pipe.
            for _ in lines {}
        })
        .map_err(PerfError::io("starting the readiness thread"))?;
    match rx.recv_timeout(timeout) {
        Ok(true) => Ok(()),
        Ok(false) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            let status = child
                .wait()
                .map_or_else(|e| e.to_string(), |s| s.to_string());
            Err(PerfError::Peer(format!(
                "the server process stopped before listening ({status}); its error is above"
            )))
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(PerfError::Peer(format!(
            "the server process did not listen within {} s",
            timeout.as_secs()
        ))),
    }
}

/// Waits for the child to exit (it does right after the last barrier), killing it after
/// `grace`.
fn reap(child: &mut Child, grace: Duration) -> Result<std::process::ExitStatus, PerfError> {
    let deadline = Instant::now() + grace;
    loop {
        if let Some(s) = child
            .try_wait()
            .map_err(PerfError::io("waiting for the server process"))?
        {
            cleanup_list().child = None;
            return Ok(s);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let s = child
                .wait()
                .map_err(PerfError::io("waiting for the server process"))?;
            cleanup_list().child = None;
            return Ok(s);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub(crate) fn self_spawn(
    opts: &Options,
    core: Option<usize>,
    engine_core: Option<usize>,
) -> Result<(), PerfError> {
    let dir = make_temp_dir()?;
    let sock = dir.join("perf.sock");
    let mut child = spawn_server(&sock)?;
    let result = (|| {
        wait_ready(&mut child, Duration::from_secs(opts.connect_timeout))?;
        // The context (and a poll-mode engine thread) before the pin, which a thread
        // inherits from the thread that creates it.
        let res = Resources::new(opts, engine_core)?;
        pin(core);
        let mut side = setup::cm_client(opts, res, &sock)?;
        let mut out = Output::new(opts);
        run_sizes(opts, &mut side, true, Some(&mut out))?;
        // Close the connections before reaping: the server has finished its last barrier.
        let rss_end = rss_kib();
        let r = out.finish_with(opts, &side, rss_end);
        drop(side);
        r
    })();
    let status = reap(&mut child, Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(&dir);
    cleanup_list().dirs.retain(|d| d != &dir);
    result?;
    let status = status?;
    if !status.success() {
        return Err(PerfError::Peer(format!(
            "the server process exited with {status}"
        )));
    }
    Ok(())
}
