//! Roles and the run itself: the self-spawned peer (temp dir, socket, pinned child process,
//! readiness, reaping), `--server` / `--client`, `--in-process`; the per-size sequence of
//! barriers, warm-up and measurement; printing, `--json` and `--hgrm`; clean-up on every
//! path, Ctrl-C included.

use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::perf::bw;
use crate::perf::error::PerfError;
use crate::perf::lat::{self, Progress};
use crate::perf::opts::{AtomicType, ModeArg, Options, Role, TestKind, Verb};
use crate::perf::report::{self, HeaderInfo};
use crate::perf::setup::{self, Resources, Side};
use crate::perf::stats::{BwClock, BwStats, LatRecorder, LatStats, rss_kib};

/// The line a spawned server prints on stdout once it listens.
pub const READY_LINE: &str = "shmhca-perf server ready";

/// What a signal must clean up: files (sockets), directories, the child process.
#[derive(Debug, Default)]
struct CleanupList {
    files: Vec<PathBuf>,
    dirs: Vec<PathBuf>,
    child: Option<u32>,
}

static CLEANUP: Mutex<CleanupList> = Mutex::new(CleanupList {
    files: Vec::new(),
    dirs: Vec::new(),
    child: None,
});

fn cleanup_list() -> std::sync::MutexGuard<'static, CleanupList> {
    CLEANUP.lock().unwrap_or_else(|e| e.into_inner())
}

/// Kills the child and removes every registered file and directory.
fn cleanup_now() {
    let mut c = cleanup_list();
    if let Some(pid) = c.child.take() {
        if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
    for f in c.files.drain(..) {
        let _ = std::fs::remove_file(f);
    }
    for d in c.dirs.drain(..) {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Ctrl-C, SIGTERM, SIGHUP: clean up, say so, exit 130-ish. Runs on its own thread.
fn install_signal_handler() -> Result<(), PerfError> {
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

/// The program: parses the command line, runs, prints errors; exit code 0 or 1.
pub fn main() -> ExitCode {
    let opts = match Options::parse_from(std::env::args_os()) {
        Ok(o) => o,
        Err(PerfError::Clap(e)) => {
            let code = if e.use_stderr() { 1 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
        Err(e) => {
            eprintln!("shmhca-perf: error: {e}");
            return ExitCode::from(1);
        }
    };
    let result = install_signal_handler().and_then(|()| run(&opts));
    cleanup_now();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shmhca-perf: error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Runs the role `opts` asks for.
///
/// # Errors
/// Whatever stops the run; the caller prints it.
pub fn run(opts: &Options) -> Result<(), PerfError> {
    let cores: Vec<usize> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .collect();
    if cores.len() < 2 && opts.cpus.len() < 2 {
        eprintln!(
            "shmhca-perf: warning: this process may run on {} CPU(s) only (its affinity \
             mask): client and server share a core and wait for each other's time slices; \
             give two cores (taskset, or --cpu)",
            cores.len()
        );
    }
    let core = |i: usize| opts.cpus.get(i).copied().or_else(|| cores.get(i).copied());
    let engine_core = |i: usize| opts.engine_cpus.get(i).copied();
    match &opts.role {
        Role::InProcess => {
            let (mut client, mut server) =
                setup::in_process_pair(opts, (engine_core(0), engine_core(1)))?;
            let o = opts.clone();
            let server_core = core(1);
            let t = std::thread::Builder::new()
                .name("shmhca-perf-server".into())
                .spawn(move || {
                    pin(server_core);
                    if let Err(e) = run_sizes(&o, &mut server, false, None) {
                        eprintln!("shmhca-perf: error (server thread): {e}");
                        std::process::exit(1);
                    }
                })
                .map_err(PerfError::io("starting the server thread"))?;
            // The client runs on a thread of its own too, so that pinning it leaves the
            // caller's affinity as it was (a library caller may run several tests).
            let client_core = core(0);
            let o = opts.clone();
            let c = std::thread::Builder::new()
                .name("shmhca-perf-client".into())
                .spawn(move || {
                    pin(client_core);
                    let mut out = Output::new(&o);
                    run_sizes(&o, &mut client, true, Some(&mut out))
                        .and_then(|()| out.finish(&o, &client))
                })
                .map_err(PerfError::io("starting the client thread"))?;
            // A client that failed leaves a server waiting for it: report the failure now
            // rather than join a thread that may never end (it dies with the process).
            match c.join() {
                Ok(r) => r?,
                Err(_) => return Err(PerfError::Peer("the client thread panicked".into())),
            }
            if t.join().is_err() {
                return Err(PerfError::Peer("the server thread panicked".into()));
            }
            Ok(())
        }
        Role::Server(path) => {
            if opts.spawned {
                exit_with_parent()?;
                // The client's private directory holds only this socket: if the client is
                // killed outright, this process removes it on its way out.
                if let Some(dir) = path.parent().filter(|d| {
                    d.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("shmhca-perf-"))
                }) {
                    cleanup_list().dirs.push(dir.to_path_buf());
                }
            }
            pin(if opts.spawned {
                core(1)
            } else {
                opts.cpus.first().copied()
            });
            let res = Resources::new(opts, engine_core(usize::from(opts.spawned)))?;
            cleanup_list().files.push(path.clone());
            let listener = res
                .ctx
                .listen(path)
                .map_err(PerfError::engine("listening"))?;
            if opts.spawned {
                println!("{READY_LINE}");
                let _ = std::io::stdout().flush();
            } else {
                eprintln!(
                    "shmhca-perf: {} server listening on {}",
                    opts.test.name(),
                    path.display()
                );
            }
            let first = opts
                .spawned
                .then(|| Duration::from_secs(opts.connect_timeout));
            let mut side = setup::cm_server(opts, res, &listener, first)?;
            drop(listener);
            if !opts.spawned && opts.output.is_none() {
                print!("{}", header_text(opts, &side));
                let _ = std::io::stdout().flush();
            }
            run_sizes(opts, &mut side, false, None)
        }
        Role::Client(path) => {
            pin(opts.cpus.first().copied());
            let res = Resources::new(opts, engine_core(0))?;
            let mut side = setup::cm_client(opts, res, path)?;
            let mut out = Output::new(opts);
            run_sizes(opts, &mut side, true, Some(&mut out))?;
            out.finish(opts, &side)
        }
        Role::SelfSpawn => self_spawn(opts, core(0), engine_core(0)),
    }
}

/// A spawned server ends with the client that started it, whatever kills the client: it
/// gets SIGTERM, which the signal thread turns into a clean-up and an exit.
fn exit_with_parent() -> Result<(), PerfError> {
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
fn pin(core: Option<usize>) {
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

fn self_spawn(
    opts: &Options,
    core: Option<usize>,
    engine_core: Option<usize>,
) -> Result<(), PerfError> {
    if opts.mode == ModeArg::Poll
        && opts.engine_cpus.is_empty()
        && std::thread::available_parallelism().map_or(1, |n| n.get()) < 4
    {
        eprintln!(
            "shmhca-perf: note: --mode poll runs 4 busy threads (2 per process) on fewer than 4 cores; expect much higher latency than --mode inline"
        );
    }
    let dir = make_temp_dir()?;
    let sock = dir.join("perf.sock");
    let mut child = spawn_server(&sock)?;
    let result = (|| {
        wait_ready(&mut child, Duration::from_secs(opts.connect_timeout))?;
        pin(core);
        let res = Resources::new(opts, engine_core)?;
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

/// What a side's header says.
fn header_info(opts: &Options, side: &Side) -> HeaderInfo {
    let (local, remote) = side.addr_lines(opts.test, opts.outs);
    HeaderInfo {
        mode: match opts.mode {
            ModeArg::Inline => "inline".into(),
            ModeArg::Poll => "poll".into(),
        },
        huge_pages: side.res.ctx.page_size() == shmhca_rings::PageSize::Huge2M,
        exchange: side.exchange,
        local,
        remote,
    }
}

fn header_text(opts: &Options, side: &Side) -> String {
    report::header(opts, &header_info(opts, side))
}

/// A deterministic byte of the data pattern of size index `si`.
#[inline]
fn pattern_byte(si: usize, i: u64) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 9) ^ (si as u64 * 29 + 7)) as u8
}

fn fill_pattern(side: &Side, off: u64, len: u64, si: usize) -> Result<(), PerfError> {
    let mut chunk = vec![0u8; len.min(1 << 16) as usize];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(chunk.len() as u64);
        for (j, b) in chunk[..n as usize].iter_mut().enumerate() {
            *b = pattern_byte(si, done + j as u64);
        }
        side.res
            .buf
            .write_at(off + done, &chunk[..n as usize])
            .map_err(PerfError::engine("filling the buffer"))?;
        // Keep answering the peer meanwhile (inline mode).
        side.res.ctx.progress();
        done += n;
    }
    Ok(())
}

/// The first offset in `[0, len)` of the region at `off` that differs from the pattern.
fn check_pattern(side: &Side, off: u64, len: u64, si: usize) -> Result<Option<u64>, PerfError> {
    let mut chunk = vec![0u8; len.min(1 << 16) as usize];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(chunk.len() as u64);
        side.res
            .buf
            .read_at(off + done, &mut chunk[..n as usize])
            .map_err(PerfError::engine("reading the buffer"))?;
        if let Some(j) = chunk[..n as usize]
            .iter()
            .enumerate()
            .position(|(j, b)| *b != pattern_byte(si, done + j as u64))
        {
            return Ok(Some(done + j as u64));
        }
        side.res.ctx.progress();
        done += n;
    }
    Ok(None)
}

/// Bytes at the start of a message the data check covers (Write ping-pongs overwrite the
/// last bytes with their iteration marker).
fn checked_len(opts: &Options, size: u64) -> u64 {
    if opts.test == TestKind::WriteLat {
        size - size.min(8)
    } else {
        size
    }
}

/// The sequence both sides run: for each size, a start barrier, the warm-up, the
/// measurement (client) or the answers (server), and an end barrier carrying the server's
/// check of what arrived.
fn run_sizes(
    opts: &Options,
    side: &mut Side,
    client: bool,
    mut out: Option<&mut Output>,
) -> Result<(), PerfError> {
    let verb = opts.test.verb();
    let lat = opts.test.is_lat();
    if verb == Verb::Send && (lat || !client) {
        let count = if lat {
            opts.rx_depth.min(64)
        } else {
            opts.rx_depth
        };
        bw::prepost_receives(side, count)?;
    }
    if let Some(o) = out.as_deref_mut() {
        o.start(opts, side);
    }
    let qps = side.qps.len() as u64;
    for (si, &size) in opts.sizes.iter().enumerate() {
        let tag = 2 * si as u32;
        // Prepare this size's memory before the start barrier: the peer touches nothing
        // of ours until then.
        for qi in 0..qps {
            let base = qi * side.res.stride;
            let half = side.res.half;
            let clear = vec![0u8; 8];
            side.res
                .buf
                .write_at(base + half, &clear)
                .map_err(PerfError::engine("clearing the buffer"))?;
            if size >= 8 {
                side.res
                    .buf
                    .write_at(base + half + size - 8, &clear)
                    .map_err(PerfError::engine("clearing the buffer"))?;
            }
            if verb != Verb::Atomic && (client || verb == Verb::Read || lat) {
                fill_pattern(side, base, size, si)?;
            }
        }
        side.ctl.barrier(tag, 0, || Ok(()))?;
        if client {
            let o = out.as_deref_mut().expect("the client side has an output");
            if lat {
                lat::client(side, opts, size, 0, opts.warmup, None, &mut o.quiet)?;
                o.rec.reset();
                o.note_measure_start();
                let mut prog = Progress::new(
                    format!("{} {} B", opts.test.name(), size),
                    opts.iters,
                    opts.progress_after,
                    true,
                );
                lat::client(
                    side,
                    opts,
                    size,
                    opts.warmup,
                    opts.iters,
                    Some(&mut o.rec),
                    &mut prog,
                )?;
            } else {
                if opts.warmup > 0 {
                    bw::client(side, opts, size, 0, opts.warmup, None, &mut o.quiet)?;
                }
                o.note_measure_start();
                let total = opts.iters * qps;
                let mut clock = BwClock::new(total, bw::checkpoint_every(total, opts));
                let mut prog = Progress::new(
                    format!("{} {} B", opts.test.name(), size),
                    opts.iters,
                    opts.progress_after,
                    true,
                );
                bw::client(
                    side,
                    opts,
                    size,
                    opts.warmup,
                    opts.iters,
                    Some(&mut clock),
                    &mut prog,
                )?;
                o.bw = clock.stats(size, opts.iters, qps as u32);
            }
        } else if lat {
            lat::server(side, opts, size, 0, opts.warmup + opts.iters)?;
        } else if verb == Verb::Send {
            bw::send_server(side, size, opts.warmup + opts.iters)?;
        }
        // End of the size: the client says it is done; only then does the server look at
        // what arrived, and it answers with its verdict.
        if !client {
            side.ctl.wait(tag + 1, || Ok(()))?;
            let status = server_check(opts, side, size, si)?;
            side.ctl.send(tag + 1, status)?;
        } else {
            let peer_status = side.ctl.barrier(tag + 1, 0, || Ok(()))?;
            client_check(opts, side, size, si, peer_status)?;
            if let Some(o) = out.as_deref_mut() {
                o.row(opts, size);
            }
        }
    }
    // Goodbye: the server waits for it, so neither side closes its connections while the
    // other still expects a message.
    let fin = 2 * opts.sizes.len() as u32;
    if client {
        side.ctl.send(fin, 0)?;
        side.ctl.settle(Duration::from_secs(2));
    } else {
        side.ctl.wait(fin, || Ok(()))?;
        side.ctl.settle(Duration::from_millis(100));
    }
    Ok(())
}

/// The server's verdict on what arrived this size, sent to the client: for Atomics the
/// counter(s) (which the client compares with the number of operations), else 0 or
/// 1 + the first offset whose byte differs from the client's pattern.
fn server_check(opts: &Options, side: &Side, size: u64, si: usize) -> Result<u64, PerfError> {
    let verb = opts.test.verb();
    let qps = if opts.test.is_lat() {
        1
    } else {
        side.qps.len() as u64
    };
    let mut sum = 0u64;
    for qi in 0..qps {
        let at = qi * side.res.stride + side.res.half;
        match verb {
            Verb::Atomic => {
                sum += side
                    .res
                    .buf
                    .load_u64(at)
                    .map_err(PerfError::engine("reading the atomic counter"))?;
            }
            Verb::Send | Verb::Write => {
                if let Some(off) = check_pattern(side, at, checked_len(opts, size), si)? {
                    return Ok(1 + off);
                }
            }
            Verb::Read => {}
        }
    }
    Ok(sum)
}

/// The client's checks: the server's verdict, and for Reads what landed here.
fn client_check(
    opts: &Options,
    side: &Side,
    size: u64,
    si: usize,
    peer_status: u64,
) -> Result<(), PerfError> {
    let per_qp = opts.warmup + opts.iters;
    match opts.test.verb() {
        Verb::Atomic => {
            let qps = if opts.test.is_lat() {
                1
            } else {
                side.qps.len() as u64
            };
            let expect = per_qp * qps;
            if peer_status != expect {
                return Err(PerfError::Check(format!(
                    "after {expect} {} operations the server's counters add up to {peer_status}",
                    match opts.atomic {
                        AtomicType::FetchAndAdd => "Fetch and Add",
                        AtomicType::CmpAndSwap => "Compare and Swap",
                    }
                )));
            }
        }
        Verb::Send | Verb::Write => {
            if peer_status != 0 {
                return Err(PerfError::Check(format!(
                    "the server received different bytes than were sent, first at offset {} of {size}",
                    peer_status - 1
                )));
            }
        }
        Verb::Read => {
            let qps = if opts.test.is_lat() {
                1
            } else {
                side.qps.len() as u64
            };
            for qi in 0..qps {
                let at = qi * side.res.stride + side.res.half;
                if let Some(off) = check_pattern(side, at, size, si)? {
                    return Err(PerfError::Check(format!(
                        "RDMA Read on QP {qi} brought different bytes than the server holds, first at offset {off} of {size}"
                    )));
                }
            }
        }
    }
    Ok(())
}

/// The client's output: the table as it fills, `-H`, `--output`, `--json`, `--hgrm`.
#[derive(Debug)]
pub struct Output {
    rec: LatRecorder,
    bw: BwStats,
    quiet: Progress,
    rows: Vec<Value>,
    samples: Vec<(u64, Vec<u64>)>,
    hgrms: Vec<(u64, String)>,
    stdout: std::io::Stdout,
    rss_after_kib: u64,
    rss_measure_start_kib: Option<u64>,
}

impl Output {
    fn new(opts: &Options) -> Output {
        Output {
            rec: LatRecorder::new(opts.histogram.then_some(opts.iters as usize)),
            bw: BwStats::default(),
            quiet: Progress::new(String::new(), 1, 0, false),
            rows: Vec::new(),
            samples: Vec::new(),
            hgrms: Vec::new(),
            stdout: std::io::stdout(),
            rss_after_kib: 0,
            rss_measure_start_kib: None,
        }
    }

    /// Notes the RSS when the first measurement starts (after its warm-up).
    fn note_measure_start(&mut self) {
        if self.rss_measure_start_kib.is_none() {
            self.rss_measure_start_kib = Some(rss_kib());
        }
    }

    fn start(&mut self, opts: &Options, side: &Side) {
        self.rss_after_kib = side.rss_after_kib;
        if opts.output.is_none() {
            let mut o = self.stdout.lock();
            let _ = write!(o, "{}", header_text(opts, side));
            let _ = writeln!(o, "{}", report::table_head(opts));
            let _ = o.flush();
        }
    }

    fn row(&mut self, opts: &Options, size: u64) {
        let mut o = self.stdout.lock();
        if opts.test.is_lat() {
            let s: LatStats = self.rec.stats();
            match opts.output {
                Some(_) => {
                    let _ = writeln!(o, "{}", report::output_lat(&s));
                }
                None => {
                    let _ = writeln!(o, "{}", report::lat_row(size, &s));
                }
            }
            self.rows.push(report::lat_json(size, &s));
            if opts.histogram {
                self.samples.push((size, self.rec.samples().to_vec()));
            }
            if opts.hgrm.is_some() {
                self.hgrms.push((size, report::hgrm(self.rec.histogram())));
            }
        } else {
            match opts.output {
                Some(w) => {
                    let _ = writeln!(o, "{}", report::output_bw(&self.bw, w, opts.gbits));
                }
                None => {
                    let _ = writeln!(o, "{}", report::bw_row(&self.bw, opts.gbits));
                }
            }
            self.rows.push(report::bw_json(&self.bw));
        }
        let _ = o.flush();
    }

    fn finish(&mut self, opts: &Options, side: &Side) -> Result<(), PerfError> {
        self.finish_with(opts, side, rss_kib())
    }

    fn finish_with(
        &mut self,
        opts: &Options,
        side: &Side,
        rss_end_kib: u64,
    ) -> Result<(), PerfError> {
        {
            let mut o = self.stdout.lock();
            if opts.output.is_none() {
                let _ = writeln!(o, "{}", report::RESULT_LINE);
            }
            for (size, samples) in &self.samples {
                if self.samples.len() > 1 {
                    let _ = writeln!(o, "# {size} bytes");
                }
                let _ = write!(o, "{}", report::samples_text(samples));
            }
            let _ = o.flush();
        }
        if let Some(path) = &opts.hgrm {
            let mut text = String::new();
            for (size, h) in &self.hgrms {
                if self.hgrms.len() > 1 {
                    text.push_str(&format!("#[Size = {size} bytes]\n"));
                }
                text.push_str(h);
            }
            std::fs::write(path, text)
                .map_err(PerfError::io(format!("writing {}", path.display())))?;
        }
        if let Some(path) = &opts.json {
            let info = header_info(opts, side);
            let st = side.res.ctx.stats();
            let engine_stats = json!({
                "packets_sent": st.packets_sent,
                "packets_received": st.packets_received,
                "payload_bytes_copied": st.payload_bytes_copied,
                "inline_bytes_sent": st.inline_bytes_sent,
                "acks_sent": st.acks_sent,
                "naks_sent": st.naks_sent,
                "retransmitted": st.retransmitted,
                "timeouts": st.timeouts,
                "rnr_naks_received": st.rnr_naks_received,
                "dropped": st.dropped,
            });
            let doc = json!({
                "tool": "shmhca-perf",
                "test": opts.test.name(),
                "kind": if opts.test.is_lat() { "latency" } else { "bandwidth" },
                "latency_is": match opts.test {
                    TestKind::SendLat | TestKind::WriteLat => "one-way (round trip / 2)",
                    TestKind::ReadLat | TestKind::AtomicLat => "round trip",
                    _ => "n/a",
                },
                "bw_unit": if opts.gbits { "Gb/sec" } else { "MiB/sec" },
                "params": report::params_json(opts),
                "engine": {
                    "mode": info.mode,
                    "huge_pages": info.huge_pages,
                    "exchange": info.exchange,
                    "arena_bytes": crate::perf::opts::arena_bytes(opts.max_size(), opts.qps, opts.tx_depth, opts.inline),
                    "qps": side.qps.iter().map(|q| {
                        let c = q.config();
                        json!({"qpn": q.qpn().get(), "psn": c.sq_psn.get(),
                               "peer_qpn": c.dest.map_or(0, |d| d.qpn.get()),
                               "mtu": c.path_mtu.bytes(), "max_rd_atomic": c.max_rd_atomic,
                               "memory_bytes": q.memory_bytes()})
                    }).collect::<Vec<_>>(),
                },
                "engine_stats": engine_stats,
                "machine": report::machine_json(),
                "versions": report::versions_json(),
                "rss_kib": {
                    "before_setup": side.res.rss_before_kib,
                    "after_setup": self.rss_after_kib,
                    "measure_start": self.rss_measure_start_kib,
                    "end": rss_end_kib,
                    "setup_delta": self.rss_after_kib.saturating_sub(side.res.rss_before_kib),
                },
                "results": self.rows,
            });
            let text = serde_json::to_string_pretty(&doc)
                .map_err(|e| PerfError::Peer(format!("encoding the JSON report: {e}")))?;
            std::fs::write(path, text + "\n")
                .map_err(PerfError::io(format!("writing {}", path.display())))?;
        }
        Ok(())
    }
}
