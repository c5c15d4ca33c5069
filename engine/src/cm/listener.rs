//! The server's side: a listening socket ([`Listener`]) and the handshakes in progress on
//! it.
//!
//! Accepting never blocks on a client. Each client accepted gets a [`ServerHandshake`] in
//! the listener's table; every accept call takes every client the socket has pending,
//! advances every handshake whose socket has something to read, and waits (in `poll(2)`)
//! for the next event only up to the caller's deadline. A client that stalls half-way costs
//! the others nothing: it stays in the table until its own handshake timeout, and the
//! accept call that finds it expired reports it. In inline mode the engine keeps running
//! while an accept call waits, so the context's other connections keep making progress.
//!
//! # Half-open connections
//!
//! A process may connect and never say a word, a thousand times over. The table is bounded
//! ([`MAX_HANDSHAKES_PER_PEER`] handshakes per client process, [`MAX_HANDSHAKES`] in all),
//! and the socket is always accepted from, so that a new client never waits behind silent
//! ones in the kernel's backlog: when a new client would go over a bound, a handshake is
//! evicted to make room —
//!
//! - over its process's bound: the oldest handshake of that same process;
//! - over the bound in all: the oldest handshake of the process holding the most (ties: the
//!   one whose handshake is oldest), so that a flood from one process never evicts another
//!   process's client while the flood holds more;
//!
//! and within the process chosen, a handshake still waiting for its REQ (it cost a socket,
//! no QP) goes before one that got as far as the REP. The client is a process: the process
//! id from `SO_PEERCRED`, read when its socket is accepted (processes of one user are
//! different peers: the [`PeerPolicy`] decides which users are admitted at all). The
//! evicted client gets a REJ (`NoResources`) saying why, on a best-effort non-blocking
//! send, and its socket is closed at once (nothing of it is kept); the accept call does not
//! report the eviction as an error. The newest handshake of a process is never evicted to
//! make room for that process, so a well-behaved client connects even while its own
//! process, or another, floods the listener — unless [`MAX_HANDSHAKES_PER_PEER`] newer
//! connections of its process arrive before its REQ does.
//!
//! An accept call takes at most [`MAX_HANDSHAKES`] clients off the socket before it
//! advances the handshakes it has and looks again, so a process connecting without pause
//! delays the others' handshakes by one such round at most; each wake-up of the call is
//! work a client caused (a connection, bytes, a hang-up) or a deadline, never a spin.

use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::channel::{Chan, Fail, INLINE_WAIT};
use super::connection::{Connection, establish, reject};
use super::handshake::{Established, QpSpec, ServerHandshake};
use super::params::{ConnectParams, PeerPolicy};
use super::random_u64;
use crate::EngineMode;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::verbs::{Context, Cq, Pd, Srq};

/// The most handshakes one accept call keeps in progress, for all clients together: a new
/// client beyond it evicts the oldest handshake of the process that holds the most (see
/// the module's "Half-open connections").
pub const MAX_HANDSHAKES: usize = 256;

/// The most handshakes one accept call keeps in progress for the clients of one process
/// (by the process id `SO_PEERCRED` gives): a new client beyond it evicts the oldest
/// handshake of its own process (see the module's "Half-open connections").
pub const MAX_HANDSHAKES_PER_PEER: usize = 64;

/// Binds and listens on `path`. The socket is made under a temporary name in the same
/// directory and hard-linked into place once it listens, so the path never exists without
/// accepting connections (a client that sees it is not refused), and `link(2)` never replaces
/// a file that appeared meanwhile. Falls back to binding `path` itself where that is not
/// possible (a temporary name too long for a socket address, a file system without links).
///
/// Returns the listener and the device and inode of its socket file, taken from the
/// temporary name before it is linked into place (so it is this listener's file for sure).
fn bind_in_place(path: &Path) -> Result<(UnixListener, (u64, u64))> {
    let p = path.display();
    // Clients connect by this path, so it must fit a socket address itself.
    if let Err(e) = std::os::unix::net::SocketAddr::from_pathname(path) {
        return Err(Error::Connect(format!(
            "{p}: not usable as a Unix socket path ({e}); it must be shorter than 108 bytes"
        )));
    }
    let tmp = path.with_file_name(format!(".shmhca-{:016x}.sock", random_u64()));
    if let Ok(listener) = UnixListener::bind(&tmp) {
        let ino = std::fs::symlink_metadata(&tmp).map(|m| (m.dev(), m.ino()));
        let linked = ino.and_then(|ino| std::fs::hard_link(&tmp, path).map(|()| ino));
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(ino) => return Ok((listener, ino)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(Error::Connect(format!(
                    "{p}: another listener bound it just now ({e})"
                )));
            }
            Err(_) => {} // no hard links here: bind the path itself
        }
    }
    let listener = UnixListener::bind(path).map_err(|e| {
        Error::Connect(match e.kind() {
            io::ErrorKind::NotFound => format!("{p}: the directory does not exist ({e})"),
            io::ErrorKind::InvalidInput => format!(
                "{p}: not usable as a Unix socket path ({e}); it must be shorter than 108 bytes"
            ),
            io::ErrorKind::AddrInUse => format!("{p}: another listener bound it just now ({e})"),
            _ => format!("{p}: cannot listen ({e})"),
        })
    })?;
    let m = std::fs::symlink_metadata(path)
        .map_err(|e| Error::io(format!("examining the new socket {p}"), e))?;
    Ok((listener, (m.dev(), m.ino())))
}

/// Whether a listener is alive on the socket file at `path`: a non-blocking `connect(2)`
/// that is refused means nobody listens there (a stale file left by a process that died);
/// one that succeeds or finds the backlog full (`EAGAIN`) means somebody does. Never
/// blocks, whatever the listener does.
fn listener_alive(path: &Path) -> io::Result<bool> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )?;
    match rustix::net::connect(&fd, &SocketAddrUnix::new(path)?) {
        Ok(()) | Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INPROGRESS) => Ok(true),
        Err(rustix::io::Errno::CONNREFUSED) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// A listening socket: [`Listener::accept`] turns each client into a [`Connection`]. The
/// socket path is removed when the listener is dropped, if it is still the socket this
/// listener made.
///
/// Handshakes are advanced by the accept calls, never by a thread of their own: a client
/// that has connected but not finished is served by the next accept call (of any thread).
/// Dropping the listener abandons the handshakes in progress. At most
/// [`MAX_HANDSHAKES`] are in progress per accept call, [`MAX_HANDSHAKES_PER_PEER`] of one
/// client process; a new client beyond a bound evicts the oldest stalled handshake (of its
/// own process, or of the process holding the most), so silent connections cannot lock new
/// clients out (the module's "Half-open connections" has the policy).
///
/// An event loop accepts between its other work with [`Listener::try_accept`] (here the
/// client is a thread of this process; it would be another process):
///
/// ```
/// use std::time::Duration;
/// use shmhca::{Context, cm::ConnectParams};
///
/// let path = std::env::temp_dir().join(format!("shmhca-doc-listener-{}.sock", std::process::id()));
/// let ctx = Context::builder().arena_size(1 << 20).build()?;
/// let (pd, cq) = (ctx.alloc_pd()?, ctx.create_cq(64)?);
/// let listener = ctx.listen(&path)?;
/// let offer = ConnectParams::default().private_data(b"server v1".to_vec());
/// // Nobody has connected: a zero timeout takes only what has already arrived.
/// assert!(listener.try_accept(Duration::ZERO, &pd, &cq, &cq, &offer)?.is_none());
///
/// let socket = path.clone();
/// let client = std::thread::spawn(move || -> shmhca::Result<Vec<u8>> {
///     let ctx = Context::builder().arena_size(1 << 20).build()?;
///     let (pd, cq) = (ctx.alloc_pd()?, ctx.create_cq(16)?);
///     let params = ConnectParams::default().private_data(b"client 1".to_vec());
///     let conn = ctx.connect(&socket, &pd, &cq, &cq, &params)?;
///     Ok(conn.peer_private_data().to_vec())
/// });
///
/// let mut conns = Vec::new();
/// for _ in 0..600 {
///     if let Some(conn) = listener.try_accept(Duration::from_millis(100), &pd, &cq, &cq, &offer)? {
///         conns.push(conn); // its QP is in RTS
///         break;
///     }
///     // ... the loop's other work ...
/// }
/// assert_eq!(conns[0].peer_private_data(), b"client 1");
/// assert_eq!(client.join().unwrap()?, b"server v1");
/// drop(listener); // removes the socket file it made
/// assert!(!path.exists());
/// # Ok::<(), shmhca::Error>(())
/// ```
pub struct Listener {
    shared: Arc<Device>,
    listener: UnixListener,
    path: PathBuf,
    /// Device and inode of the socket file this listener created.
    ino: (u64, u64),
    policy: PeerPolicy,
    /// Handshakes in progress that no accept call is advancing right now.
    pending: Mutex<Vec<ServerHandshake>>,
}

impl Listener {
    /// Listens on `path` (same as [`Context::listen`]).
    ///
    /// Removes only what it created. An existing socket file is probed with a non-blocking
    /// `connect(2)`: refused means stale (its listener died without removing it), and only
    /// then is it replaced, if it is still the same file; accepted, or a full backlog,
    /// means a live listener, whose socket is left alone. Anything else at `path` (a regular
    /// file, a directory, a symbolic link) is never touched. The device and inode of the
    /// socket this listener creates are recorded, and dropping the listener removes `path`
    /// only if it still is that socket.
    ///
    /// # Errors
    /// [`Error::Connect`] if a live listener owns `path`, if `path` exists and is not a
    /// socket (it is never removed), if it is too long for a Unix socket (108 bytes) or its
    /// directory does not exist; [`Error::Io`] for other system errors.
    pub fn bind(ctx: &Context, path: impl AsRef<Path>) -> Result<Listener> {
        let path = path.as_ref().to_path_buf();
        let p = path.display();
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_socket() => match listener_alive(&path) {
                Ok(true) => {
                    return Err(Error::Connect(format!(
                        "{p}: a live listener already owns this socket: use another path or stop that process"
                    )));
                }
                Ok(false) => {
                    // Stale: its listener is gone. Remove it only if it is still the file
                    // probed (not one another listener put there meanwhile).
                    let now = std::fs::symlink_metadata(&path);
                    if !now.is_ok_and(|n| (n.dev(), n.ino()) == (m.dev(), m.ino())) {
                        return Err(Error::Connect(format!(
                            "{p}: the stale socket was replaced while this side probed it: another process is binding the same path"
                        )));
                    }
                    std::fs::remove_file(&path)
                        .map_err(|e| Error::io(format!("removing the stale socket {p}"), e))?;
                }
                Err(e) => return Err(Error::io(format!("probing the existing socket {p}"), e)),
            },
            Ok(_) => {
                return Err(Error::Connect(format!(
                    "{p} exists and is not a socket: refusing to replace it; choose another path"
                )));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("examining {p}"), e)),
        }
        let (listener, ino) = bind_in_place(&path)?;
        // Accept calls take every pending client without blocking.
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io(format!("making the socket {p} non-blocking"), e))?;
        Ok(Listener {
            shared: ctx.shared.clone(),
            listener,
            path,
            ino,
            policy: PeerPolicy::SameUser,
            pending: Mutex::new(Vec::new()),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whom [`Listener::accept`] admits (default: the same user).
    pub fn peer_policy(&self) -> PeerPolicy {
        self.policy
    }

    /// Sets whom [`Listener::accept`] admits.
    pub fn set_peer_policy(&mut self, policy: PeerPolicy) {
        self.policy = policy;
    }

    /// Clients that connected and whose handshake is not finished yet (not counting those
    /// an accept call running on another thread is advancing).
    pub fn handshakes_in_progress(&self) -> usize {
        self.lock_pending().len()
    }

    /// Waits for a client to complete a handshake and returns its connection: its QP (in
    /// `pd`, completing on `send_cq` / `recv_cq`, set up with `params`) is in RTS. Clients
    /// that connect and close without a word (such as [`Listener::bind`] probing whether a
    /// listener is alive) are skipped. Handshakes run side by side: a slow client does not
    /// delay another. A client's QP is made by the accept call that receives its REQ, with
    /// that call's `pd`, CQs and `params`; its handshake timeout is that of the call that
    /// accepted its socket.
    ///
    /// In inline mode the engine keeps running while this waits.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for parameters out of range; [`Error::Connect`] naming
    /// the problem when a client is refused, speaks garbage, offers invalid or incompatible
    /// parameters, or stops half-way (after its handshake timeout): that client is
    /// dropped, the listener stays usable for the next one. Nothing is left behind on
    /// error.
    pub fn accept(
        &self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        params: &ConnectParams,
    ) -> Result<Connection> {
        let spec = QpSpec {
            pd,
            send_cq,
            recv_cq,
            srq: None,
        };
        self.accept_spec(spec, params)
    }

    /// [`Listener::accept`] with the client's QP on the shared receive queue `srq` (of
    /// `pd`): it takes its receives from the SRQ, which any number of connections (and
    /// hand-made QPs) may share — `rdma_create_qp` with `qp_init_attr.srq` set. The
    /// handshake tells the client that this QP reports no end-to-end credits (spec/02; see
    /// [`Srq`]), so the client's QP sends without waiting for them, relying on RNR Naks
    /// when the SRQ runs dry; and its receive depth ([`Connection::peer_caps`]) is the
    /// SRQ's.
    ///
    /// # Errors
    /// As [`Listener::accept`]; [`Error::ForeignObject`] / [`Error::InvalidArgument`] for
    /// an SRQ of another context or protection domain (before any client is served).
    pub fn accept_with_srq(
        &self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: &Srq,
        params: &ConnectParams,
    ) -> Result<Connection> {
        let spec = QpSpec {
            pd,
            send_cq,
            recv_cq,
            srq: Some(srq),
        };
        self.accept_spec(spec, params)
    }

    /// [`Listener::try_accept`] with the client's QP on the shared receive queue `srq` (see
    /// [`Listener::accept_with_srq`]).
    ///
    /// # Errors
    /// As [`Listener::accept_with_srq`].
    pub fn try_accept_with_srq(
        &self,
        timeout: Duration,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: &Srq,
        params: &ConnectParams,
    ) -> Result<Option<Connection>> {
        let spec = QpSpec {
            pd,
            send_cq,
            recv_cq,
            srq: Some(srq),
        };
        self.accept_until(Some(Instant::now() + timeout), spec, params)
    }

    fn accept_spec(&self, spec: QpSpec<'_>, params: &ConnectParams) -> Result<Connection> {
        loop {
            // Without a deadline the call returns only with a connection or an error.
            if let Some(c) = self.accept_until(None, spec, params)? {
                return Ok(c);
            }
        }
    }

    /// [`Listener::accept`], giving up when no handshake has completed within `timeout`:
    /// it returns by then, however far the clients in progress have got (they stay in the
    /// listener for the next call).
    ///
    /// # Errors
    /// As [`Listener::accept`], and [`Error::Connect`] saying no client completed in time
    /// ([`Listener::try_accept`] returns `None` instead).
    pub fn accept_timeout(
        &self,
        timeout: Duration,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        params: &ConnectParams,
    ) -> Result<Connection> {
        self.try_accept(timeout, pd, send_cq, recv_cq, params)?
            .ok_or_else(|| {
                Error::Connect(format!(
                    "{}: no client connected in time ({} handshakes in progress)",
                    self.path.display(),
                    self.handshakes_in_progress()
                ))
            })
    }

    /// [`Listener::accept`] for at most `timeout`: `Ok(None)` when no handshake completed
    /// by then (a zero `timeout` only takes what has already arrived). An event loop calls
    /// this with a short timeout between its other work.
    ///
    /// # Errors
    /// As [`Listener::accept`].
    pub fn try_accept(
        &self,
        timeout: Duration,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        params: &ConnectParams,
    ) -> Result<Option<Connection>> {
        let spec = QpSpec {
            pd,
            send_cq,
            recv_cq,
            srq: None,
        };
        self.accept_until(Some(Instant::now() + timeout), spec, params)
    }

    fn lock_pending(&self) -> MutexGuard<'_, Vec<ServerHandshake>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn accept_until(
        &self,
        deadline: Option<Instant>,
        spec: QpSpec<'_>,
        params: &ConnectParams,
    ) -> Result<Option<Connection>> {
        params.validate()?;
        spec.check(&self.shared)?;
        let watcher = crate::cm::CmState::of(&self.shared).watcher(&self.shared)?;
        // This call advances the handshakes it takes; another thread's accept call takes
        // the rest (or those that arrive meanwhile). What is left goes back at the end.
        let mut mine = std::mem::take(&mut *self.lock_pending());
        let result = self.accept_loop(&mut mine, deadline, spec, params);
        self.lock_pending().append(&mut mine);
        Ok(result?
            .map(|(hs, est)| establish(&hs.chan(&self.path), &hs.stream, watcher, est, params)))
    }

    /// Accepts and advances handshakes until one completes (`Some`), one fails (`Err`), or
    /// the deadline passes (`None`).
    fn accept_loop(
        &self,
        mine: &mut Vec<ServerHandshake>,
        deadline: Option<Instant>,
        spec: QpSpec<'_>,
        params: &ConnectParams,
    ) -> Result<Option<(ServerHandshake, Established)>> {
        use rustix::event::{PollFd, PollFlags};
        let inline = self.shared.mode == EngineMode::Inline;
        // Handshakes with something to read (all of them at first: a message may have
        // arrived while no accept call was running).
        let mut ready: Vec<bool> = vec![true; mine.len()];
        let mut listener_ready = true;
        loop {
            if listener_ready {
                self.take_new_clients(mine, &mut ready, params)?;
            }
            let mut i = 0;
            while i < mine.len() {
                let expired = Instant::now() >= mine[i].deadline();
                if !ready[i] && !expired {
                    i += 1;
                    continue;
                }
                ready[i] = false;
                let step = mine[i].advance(&self.shared, &self.path, spec, params);
                match step {
                    Ok(None) => i += 1,
                    Ok(Some(est)) => {
                        ready.swap_remove(i);
                        return Ok(Some((mine.swap_remove(i), est)));
                    }
                    Err(f) => {
                        ready.swap_remove(i);
                        let hs = mine.swap_remove(i);
                        if let Some(e) = failed(&hs.chan(&self.path), f) {
                            return Err(e);
                        }
                    }
                }
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(None);
            }
            if inline {
                // The application's thread is here, not polling its CQs: run the engine
                // for the context's other connections.
                self.shared.progress();
            }
            // Sleep until a socket has something, a handshake expires, the caller's
            // deadline passes, or (inline mode) it is time to run the engine again.
            let mut wake = mine.iter().map(ServerHandshake::deadline).min();
            if let Some(d) = deadline {
                wake = Some(wake.map_or(d, |w| w.min(d)));
            }
            let mut left = wake.map(|w| w.saturating_duration_since(now));
            if inline {
                left = Some(left.map_or(INLINE_WAIT, |l| l.min(INLINE_WAIT)));
            }
            let ts = left.map(|l| rustix::time::Timespec {
                tv_sec: l.as_secs() as i64,
                tv_nsec: i64::from(l.subsec_nanos()),
            });
            let mut fds = Vec::with_capacity(mine.len() + 1);
            // Always: a new client is taken even at the bounds (evicting a stalled one), so
            // it never waits in the kernel's backlog behind silent clients.
            fds.push(PollFd::new(&self.listener, PollFlags::IN));
            for hs in mine.iter() {
                fds.push(PollFd::from_borrowed_fd(
                    hs.stream.as_fd(),
                    PollFlags::IN | PollFlags::RDHUP,
                ));
            }
            match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(Error::io("waiting for clients", e.into())),
            }
            listener_ready = !fds[0].revents().is_empty();
            for (r, f) in ready.iter_mut().zip(&fds[1..]) {
                *r = !f.revents().is_empty();
            }
        }
    }

    /// Accepts the clients the socket has pending (at most [`MAX_HANDSHAKES`]: the caller
    /// advances the handshakes and comes back, the socket still readable) and starts their
    /// handshakes, evicting a stalled one when a new client would go over a bound
    /// ([`make_room`]). A client refused at once is reported like any failed handshake.
    fn take_new_clients(
        &self,
        mine: &mut Vec<ServerHandshake>,
        ready: &mut Vec<bool>,
        params: &ConnectParams,
    ) -> Result<()> {
        for _ in 0..MAX_HANDSHAKES {
            let stream = match self.listener.accept() {
                Ok((s, _)) => Arc::new(s),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => {
                    return Err(Error::io(
                        format!("accepting a client on {}", self.path.display()),
                        e,
                    ));
                }
            };
            match ServerHandshake::start(
                &self.shared,
                stream.clone(),
                &self.path,
                self.policy,
                params.handshake_timeout,
            ) {
                Ok(hs) => {
                    make_room(mine, ready, hs.peer_pid(), &self.path);
                    mine.push(hs);
                    ready.push(true);
                }
                Err(f) => {
                    let chan = Chan {
                        stream: &stream,
                        path: &self.path,
                        peer: "client",
                        deadline: Instant::now() + params.handshake_timeout,
                        timeout: params.handshake_timeout,
                        drive: None,
                    };
                    if let Some(e) = failed(&chan, f) {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Makes room in `mine` (its `ready` flags alongside) for one more handshake of process
/// `pid`, evicting handshakes while that would go over [`MAX_HANDSHAKES_PER_PEER`] for
/// `pid` or [`MAX_HANDSHAKES`] in all ([`victim`] chooses; the policy is the module's
/// "Half-open connections"). Each evicted client gets a best-effort REJ and its socket is
/// closed.
fn make_room(mine: &mut Vec<ServerHandshake>, ready: &mut Vec<bool>, pid: u32, path: &Path) {
    loop {
        let held: Vec<Held> = mine
            .iter()
            .map(|h| Held {
                pid: h.peer_pid(),
                awaits_req: h.awaits_req(),
                started: h.started(),
            })
            .collect();
        let Some(i) = victim(&held, pid) else {
            return;
        };
        let of_victim = held.iter().filter(|h| h.pid == held[i].pid).count();
        ready.swap_remove(i);
        let hs = mine.swap_remove(i);
        hs.chan(path).send_reject(
            super::msg::RejectReason::NoResources,
            format!(
                "the listener dropped this handshake to make room for a new client: process \
                 {} had {of_victim} handshakes in progress (at most \
                 {MAX_HANDSHAKES_PER_PEER} per process, {MAX_HANDSHAKES} in all) and this \
                 was its oldest unfinished; finish a handshake before opening many more, \
                 then connect again",
                held[i].pid
            ),
        );
        // Dropping it closes the socket (the table held its only reference) and releases
        // whatever the handshake had made.
        drop(hs);
    }
}

/// What the eviction policy looks at in a handshake in progress.
#[derive(Debug, Clone, Copy)]
struct Held {
    /// The client's process.
    pid: u32,
    /// It has not sent its REQ (no QP made for it yet).
    awaits_req: bool,
    /// When its socket was accepted.
    started: Instant,
}

/// Which of the handshakes `held` to evict before one more of process `pid` joins them;
/// `None` if it fits within [`MAX_HANDSHAKES_PER_PEER`] and [`MAX_HANDSHAKES`]. Over its
/// process's bound, one of `pid`'s own; over the bound in all, one of the process holding
/// the most (ties: the one holding the oldest handshake). Within that process, one waiting
/// for its REQ before one past it, the oldest first.
fn victim(held: &[Held], pid: u32) -> Option<usize> {
    let of_pid = held.iter().filter(|h| h.pid == pid).count();
    let who = if of_pid >= MAX_HANDSHAKES_PER_PEER {
        pid
    } else if held.len() >= MAX_HANDSHAKES {
        largest_holder(held)?
    } else {
        return None;
    };
    (0..held.len())
        .filter(|&i| held[i].pid == who)
        .min_by_key(|&i| (!held[i].awaits_req, held[i].started))
}

/// The process holding the most of `held` (ties: the one holding the oldest); `None` if
/// `held` is empty.
fn largest_holder(held: &[Held]) -> Option<u32> {
    let mut by_pid: std::collections::HashMap<u32, (usize, Instant)> =
        std::collections::HashMap::new();
    for h in held {
        let e = by_pid.entry(h.pid).or_insert((0, h.started));
        e.0 += 1;
        e.1 = e.1.min(h.started);
    }
    by_pid
        .into_iter()
        .max_by_key(|&(_, (n, oldest))| (n, std::cmp::Reverse(oldest)))
        .map(|(pid, _)| pid)
}

/// Ends a failed server handshake: sends the REJ it calls for and returns the error; `None`
/// for a client that closed before sending a byte (a probe, not an error).
fn failed(chan: &Chan<'_>, f: Fail) -> Option<Error> {
    (!f.closed_before_start).then(|| reject(chan, f))
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Remove the path only if it is still the socket this listener made.
        if let Ok(m) = std::fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == self.ino {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("path", &self.path)
            .field("policy", &self.policy)
            .field("handshakes", &self.lock_pending().len())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` handshakes of process `pid`, waiting for their REQ or not, started `from`
    /// milliseconds after `t0` and a millisecond apart.
    fn of(pid: u32, n: usize, awaits_req: bool, t0: Instant, from: u64) -> Vec<Held> {
        (0..n as u64)
            .map(|i| Held {
                pid,
                awaits_req,
                started: t0 + Duration::from_millis(from + i),
            })
            .collect()
    }

    #[test]
    fn within_both_bounds_nothing_is_evicted() {
        let t0 = Instant::now();
        assert_eq!(victim(&[], 1), None);
        let held = of(1, MAX_HANDSHAKES_PER_PEER - 1, true, t0, 0);
        assert_eq!(victim(&held, 1), None, "one below its process's bound");
        let mut held = Vec::new();
        for pid in 0..(MAX_HANDSHAKES / MAX_HANDSHAKES_PER_PEER) as u32 {
            held.extend(of(pid, MAX_HANDSHAKES_PER_PEER - 1, true, t0, 0));
        }
        assert!(held.len() < MAX_HANDSHAKES);
        assert_eq!(victim(&held, 99), None, "below the bound in all");
    }

    #[test]
    fn over_its_process_bound_a_client_evicts_its_own_processs_oldest_stalled_one() {
        let t0 = Instant::now();
        // Process 7: the oldest got as far as the REP; then the ones still waiting for
        // their REQ, the first of them older than the second.
        let mut held = of(7, 1, false, t0, 0);
        held.extend(of(7, MAX_HANDSHAKES_PER_PEER - 1, true, t0, 10));
        // Another process's older handshakes are not touched.
        held.extend(of(8, 3, true, t0, 0));
        held.rotate_left(5);
        let i = victim(&held, 7).expect("at its bound");
        assert_eq!(held[i].pid, 7);
        assert!(held[i].awaits_req, "a stalled one before one past its REQ");
        assert_eq!(
            held[i].started,
            t0 + Duration::from_millis(10),
            "the oldest"
        );
        // When none of them waits for its REQ any more, the oldest goes.
        for h in &mut held {
            h.awaits_req = false;
        }
        let i = victim(&held, 7).unwrap();
        assert_eq!((held[i].pid, held[i].started), (7, t0));
    }

    #[test]
    fn over_the_bound_in_all_the_process_holding_the_most_loses_its_oldest() {
        let t0 = Instant::now();
        // Processes 1..=5 hold one each (the oldest of all); process 20 holds the most.
        let mut held = Vec::new();
        for pid in 1..=5 {
            held.extend(of(pid, 1, true, t0, 0));
        }
        let big = MAX_HANDSHAKES_PER_PEER - 1;
        let mut pid = 20;
        while held.len() + big <= MAX_HANDSHAKES {
            held.extend(of(pid, big, true, t0, 100 + u64::from(pid)));
            pid += 1;
        }
        held.extend(of(pid, MAX_HANDSHAKES - held.len(), true, t0, 50));
        assert_eq!(held.len(), MAX_HANDSHAKES);
        // A client of a process with none, or of one of the small ones: one of the largest
        // processes' (the one holding the oldest of them: 20), never a small one's.
        for newcomer in [99, 1] {
            let i = victim(&held, newcomer).expect("at the bound in all");
            assert_eq!(held[i].pid, 20, "newcomer {newcomer}");
            assert_eq!(held[i].started, t0 + Duration::from_millis(120));
        }
        // With every process holding one, the oldest of all goes.
        let held: Vec<Held> = (0..MAX_HANDSHAKES as u32)
            .map(|p| of(1000 + p, 1, true, t0, 300 - u64::from(p)).remove(0))
            .collect();
        let i = victim(&held, 5000).unwrap();
        assert_eq!(held[i].pid, 1000 + MAX_HANDSHAKES as u32 - 1);
    }
}
