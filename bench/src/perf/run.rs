//! The program and role dispatch: `--server` / `--client`, `--in-process` and the
//! self-spawned peer (in [`process`](crate::perf::process)); each role sets up its side and
//! runs the [`sequence`](crate::perf::sequence).

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use crate::perf::error::PerfError;
use crate::perf::opts::{ModeArg, Options, Role};
use crate::perf::output::{Output, header_text};
use crate::perf::placement;
use crate::perf::process::{
    READY_LINE, cleanup_list, cleanup_now, exit_with_parent, install_signal_handler, pin,
    register_socket, self_spawn,
};
use crate::perf::sequence::run_sizes;
use crate::perf::setup::{self, Resources};

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
    if !opts.pin_cores.is_empty() {
        let mut set = rustix::thread::CpuSet::new();
        for &c in &opts.pin_cores {
            set.set(c);
        }
        rustix::thread::sched_setaffinity(None, &set).map_err(|e| {
            PerfError::Usage(format!(
                "--pin_cores: this process may not run on cores {:?} ({e})",
                opts.pin_cores
            ))
        })?;
    }
    let cores: Vec<usize> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .collect();
    let core = |i: usize| opts.cpus.get(i).copied().or_else(|| cores.get(i).copied());
    // This program places both sides (its own peer process, or two threads): the engine
    // threads go to the next two free cores, if there are any (see `placement`).
    let places_both = matches!(opts.role, Role::InProcess | Role::SelfSpawn) || opts.spawned;
    let default_engine = if places_both && opts.mode == ModeArg::Poll {
        placement::default_engine_cores(&cores, [core(0), core(1)])
    } else {
        [None, None]
    };
    let engine_core = |i: usize| {
        opts.engine_cpus
            .get(i)
            .copied()
            .or(default_engine.get(i).copied().flatten())
    };
    if !opts.spawned {
        // One entry per spinning thread: the application threads, then the engine
        // threads; the peer of a two-terminal role is placed by its own command line.
        let (app, engine) = if places_both {
            ([core(0), core(1)], [engine_core(0), engine_core(1)])
        } else {
            ([opts.cpus.first().copied(), None], [engine_core(0), None])
        };
        let spinning = placement::spinning_threads(opts.mode, opts.events);
        let pins: Vec<Option<usize>> = match opts.mode {
            ModeArg::Poll => app.into_iter().chain(engine).collect(),
            ModeArg::Inline => app.to_vec(),
        };
        let usable = placement::usable_cores(cores.len(), &pins);
        if let Some(w) = placement::oversubscription(opts.mode, spinning, usable) {
            eprintln!("{w}");
        }
    }
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
            // The context (and a poll-mode engine thread) first: a thread inherits the
            // affinity of the thread that creates it.
            let res = Resources::new(opts, engine_core(usize::from(opts.spawned)))?;
            pin(if opts.spawned {
                core(1)
            } else {
                opts.cpus.first().copied()
            });
            // Only once the listener has created the socket is it this process's to
            // remove: a path `listen` refuses (a file that is not a socket, a live
            // server's socket) stays as it was.
            let listener = res
                .ctx
                .listen(path)
                .map_err(PerfError::engine("listening"))?;
            register_socket(path);
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
            let res = Resources::new(opts, engine_core(0))?;
            pin(opts.cpus.first().copied());
            let mut side = setup::cm_client(opts, res, path)?;
            let mut out = Output::new(opts);
            run_sizes(opts, &mut side, true, Some(&mut out))?;
            out.finish(opts, &side)
        }
        Role::SelfSpawn => self_spawn(opts, core(0), engine_core(0)),
        Role::RoceServer { .. } => {
            let res = Resources::new(opts, engine_core(0))?;
            pin(opts.cpus.first().copied());
            let mut side = crate::perf::roce::side(opts, res)?;
            if opts.output.is_none() {
                print!("{}", header_text(opts, &side));
                let _ = std::io::stdout().flush();
            }
            run_sizes(opts, &mut side, false, None)
        }
        Role::RoceClient { .. } => {
            let res = Resources::new(opts, engine_core(0))?;
            pin(opts.cpus.first().copied());
            let mut side = crate::perf::roce::side(opts, res)?;
            let mut out = Output::new(opts);
            run_sizes(opts, &mut side, true, Some(&mut out))?;
            out.finish(opts, &side)
        }
    }
}
