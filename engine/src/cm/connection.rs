//! A set-up connection ([`Connection`]): the QP in RTS, the socket that keeps it, what the
//! peer sent; and the client's side of making one ([`connect`]).

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::channel::{Chan, Fail, PeerCred};
use super::handshake::{Established, QpSpec, client_handshake};
use super::links::LinkRef;
use super::msg::Offer;
use super::params::ConnectParams;
use super::watch::{ConnStatus, Watched, Watcher};
use crate::error::{Error, Result};
use crate::link::LinkId;
use crate::qp::QpCaps;
use crate::verbs::{Context, Cq, Pd, Qp, Srq};
use crate::wire::Qpn;

/// Ends a failed handshake: tells the peer why (when it should be told) and returns the
/// error.
pub(super) fn reject(chan: &Chan<'_>, f: Fail) -> Error {
    if let Some(reason) = f.reject {
        // The peer adds its own context; tell it just what went wrong.
        let text = f.error.to_string();
        let prefix = format!("connection setup: {}: ", chan.path.display());
        let text = text.strip_prefix(&prefix).unwrap_or(&text).to_string();
        chan.send_reject(reason, text);
    }
    f.error
}

/// Ends a successful handshake: watches the connection for the peer's hang-up and silence
/// (with `params`' silence limit).
pub(super) fn establish(
    chan: &Chan<'_>,
    stream: &Arc<UnixStream>,
    watcher: Arc<Watcher>,
    est: Established,
    params: &ConnectParams,
) -> Connection {
    let status = Arc::new(ConnStatus::new(est.link.live.clone()));
    let key = watcher.add(Watched {
        stream: stream.clone(),
        qpn: est.qp.qpn(),
        link: est.link.id,
        status: status.clone(),
        silence_limit: params.silence_limit,
    });
    Connection {
        qp: Some(est.qp),
        stream: stream.clone(),
        watcher,
        key,
        status,
        link: est.link,
        path: chan.path.to_path_buf(),
        cred: est.cred,
        peer_identity: est.peer_identity,
        peer: est.peer,
        peer_private_data: est.peer_private_data,
    }
}

/// Connects to the listener at `path` and returns a connection whose QP (in `pd`,
/// completing on `send_cq` / `recv_cq`) is in RTS. Same as [`Context::connect`].
///
/// # Errors
/// [`Error::InvalidArgument`] for parameters out of range (before anything is sent);
/// [`Error::Connect`] naming the problem for a wrong path, no listener, a peer that is not
/// shmhca, a refused peer (either way), incompatible or invalid parameters, a peer that
/// stops half-way (after the handshake timeout) or closes the socket;
/// [`Error::SegmentOpen`]/[`Error::SegmentCreate`] when a segment cannot be made or the
/// server's arena is unusable. Nothing is left behind on error.
pub fn connect(
    ctx: &Context,
    path: impl AsRef<Path>,
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
    connect_spec(ctx, path.as_ref(), spec, params)
}

/// [`connect`] with the QP on the shared receive queue `srq` (in `pd`). Same as
/// [`Context::connect_with_srq`].
///
/// # Errors
/// As [`connect`], and [`Error::ForeignObject`] / [`Error::InvalidArgument`] for an SRQ of
/// another context or protection domain (before anything is sent).
pub fn connect_with_srq(
    ctx: &Context,
    path: impl AsRef<Path>,
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
    connect_spec(ctx, path.as_ref(), spec, params)
}

fn connect_spec(
    ctx: &Context,
    path: &Path,
    spec: QpSpec<'_>,
    params: &ConnectParams,
) -> Result<Connection> {
    params.validate()?;
    spec.check(&ctx.shared)?;
    let shared = &ctx.shared;
    let watcher = crate::cm::CmState::of(shared).watcher(shared)?;
    let stream = Arc::new(UnixStream::connect(path).map_err(|e| connect_error(path, &e))?);
    let chan = Chan {
        stream: &stream,
        path,
        peer: "server",
        deadline: Instant::now() + params.handshake_timeout,
        timeout: params.handshake_timeout,
        drive: (shared.mode == crate::EngineMode::Inline).then_some(&**shared),
    };
    match client_handshake(shared, &chan, spec, params) {
        Ok(est) => Ok(establish(&chan, &stream, watcher, est, params)),
        Err(f) => Err(reject(&chan, f)),
    }
}

/// The error of connecting to a socket path.
fn connect_error(path: &Path, e: &io::Error) -> Error {
    let p = path.display();
    Error::Connect(match e.kind() {
        io::ErrorKind::NotFound => {
            format!("{p}: no such socket ({e}): start the listener first, or check the path")
        }
        io::ErrorKind::ConnectionRefused
            if std::fs::symlink_metadata(path).is_ok_and(|m| !m.file_type().is_socket()) =>
        {
            format!("{p}: not a socket ({e}): pass the path a shmhca Listener is bound to")
        }
        io::ErrorKind::ConnectionRefused => format!(
            "{p}: nobody listens on this socket ({e}): the listener has exited; start it again"
        ),
        io::ErrorKind::PermissionDenied => {
            format!("{p}: permission denied ({e}): the socket belongs to another user")
        }
        _ => match e.raw_os_error() {
            Some(code) if code == rustix::io::Errno::NOTSOCK.raw_os_error() => {
                format!("{p}: not a socket ({e}): pass the path a shmhca Listener is bound to")
            }
            _ => format!("{p}: cannot connect ({e})"),
        },
    })
}

/// A connected QP and the socket that keeps the connection: the [`Qp`] is in RTS (it
/// derefs to it), the socket tells each side when the other goes away. Dropping it
/// destroys the QP and closes the socket; the peer's QP then goes to the Error state.
///
/// The [`cm` module's example](crate::cm#example) sets one up from both ends and sends a
/// message. When the peer closes its end (or its process dies), the QP goes to the Error
/// state and its posted work requests complete with a flush error:
///
/// ```
/// use std::sync::mpsc;
/// use std::time::Duration;
/// use shmhca::{AccessFlags, Context, QpState, RecvWr, WcStatus, WorkCompletion, cm::ConnectParams};
///
/// let path = std::env::temp_dir().join(format!("shmhca-doc-conn-{}.sock", std::process::id()));
/// let ctx = Context::builder().arena_size(1 << 20).build()?;
/// let listener = ctx.listen(&path)?;
/// let (hang_up, hung_up) = mpsc::channel::<()>();
/// let socket = path.clone();
/// let client = std::thread::spawn(move || -> shmhca::Result<()> {
///     let ctx = Context::builder().arena_size(1 << 20).build()?;
///     let (pd, cq) = (ctx.alloc_pd()?, ctx.create_cq(16)?);
///     let conn = ctx.connect(&socket, &pd, &cq, &cq, &ConnectParams::default())?;
///     let _ = hung_up.recv(); // then drop the connection: the peer sees the hang-up
///     drop(conn);
///     Ok(())
/// });
///
/// let (pd, mut cq) = (ctx.alloc_pd()?, ctx.create_cq(16)?);
/// let buf = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
/// let mut conn = listener.accept(&pd, &cq, &cq, &ConnectParams::default())?;
/// assert_eq!(conn.peer_pid(), std::process::id()); // SO_PEERCRED: here, this process
/// assert_eq!(conn.state(), QpState::Rts);
/// conn.post_recv(&RecvWr::new(1, &[buf.sge(0, 64)?]))?; // `conn` derefs to its Qp
///
/// hang_up.send(()).unwrap();
/// client.join().unwrap()?;
/// let mut wc = [WorkCompletion::default(); 1];
/// assert_eq!(cq.poll_until(&mut wc, Duration::from_secs(30)), 1);
/// assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::WrFlushErr));
/// assert!(!conn.is_peer_connected());
/// assert_eq!(conn.state(), QpState::Error);
/// println!("{}", conn.peer_gone_reason().unwrap_or_default());
/// # Ok::<(), shmhca::Error>(())
/// ```
pub struct Connection {
    /// Present until drop.
    qp: Option<Qp>,
    pub(super) stream: Arc<UnixStream>,
    pub(super) watcher: Arc<Watcher>,
    pub(super) key: u64,
    status: Arc<ConnStatus>,
    /// Dropped after the QP (fields drop after `Drop::drop`).
    link: LinkRef,
    path: PathBuf,
    cred: PeerCred,
    peer_identity: u64,
    peer: Offer,
    peer_private_data: Vec<u8>,
}

impl Connection {
    /// The QP.
    pub fn qp(&self) -> &Qp {
        self.qp
            .as_ref()
            .expect("the QP lives until the connection is dropped")
    }

    /// The QP, to post work requests or modify it.
    pub fn qp_mut(&mut self) -> &mut Qp {
        self.qp
            .as_mut()
            .expect("the QP lives until the connection is dropped")
    }

    /// The private data the peer sent (empty if none).
    pub fn peer_private_data(&self) -> &[u8] {
        &self.peer_private_data
    }

    /// The peer's process id (from `SO_PEERCRED`).
    pub fn peer_pid(&self) -> u32 {
        self.cred.pid
    }

    /// The peer's user id (from `SO_PEERCRED`).
    pub fn peer_uid(&self) -> u32 {
        self.cred.uid
    }

    /// The peer QP's number.
    pub fn peer_qpn(&self) -> Qpn {
        Qpn::new(self.peer.qpn)
    }

    /// The peer QP's queue capabilities (e.g. how many receives it can have posted).
    pub fn peer_caps(&self) -> QpCaps {
        self.peer.caps()
    }

    /// The peer engine's identity ([`Context::engine_identity`] over there).
    pub fn peer_engine(&self) -> u64 {
        self.peer_identity
    }

    /// The link the QP talks over (shared by every connection with the same peer engine).
    pub fn link(&self) -> LinkId {
        self.link.id
    }

    /// The socket path of the connection's listener.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the peer is still connected (false once it closed the connection or died;
    /// the QP is then in the Error state).
    pub fn is_peer_connected(&self) -> bool {
        if self.status.live.load(Ordering::Acquire) {
            return true;
        }
        // The watcher clears the flag while it holds the engine and moves the QP to Error;
        // taking the engine once waits for it to finish, so the QP's state agrees.
        self.link.shared.engine.with(|_| ());
        false
    }

    /// Why the peer is gone, once it is.
    pub fn peer_gone_reason(&self) -> Option<String> {
        self.status.gone_reason()
    }

    /// How long since the peer was last heard from on the connection socket: since its last
    /// keepalive, or since setup. A live peer's watcher sends one every
    /// [`KEEPALIVE_INTERVAL`](super::KEEPALIVE_INTERVAL) whether or not the application
    /// sends anything, so a value of many intervals means the peer process is stopped,
    /// hung or starved of CPU, even though its socket is open and
    /// [`Connection::is_peer_connected`] still says true. A receive-only application checks
    /// this (or sets [`ConnectParams::peer_silence_limit`]) to notice such a peer. Keeps
    /// growing once the peer is gone. Costs a lock, no system call.
    pub fn peer_silent_for(&self) -> Duration {
        self.status.silent_for()
    }
}

impl std::ops::Deref for Connection {
    type Target = Qp;
    fn deref(&self) -> &Qp {
        self.qp()
    }
}

impl std::ops::DerefMut for Connection {
    fn deref_mut(&mut self) -> &mut Qp {
        self.qp_mut()
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Take in what the peer already put on the link and let the Acks for it leave (in
        // inline mode nobody else would run the engine): the peer then sees its last
        // messages acknowledged before it sees the connection close. A few bursts at most:
        // a peer that keeps sending cannot hold the drop up.
        let shared = &self.link.shared;
        for _ in 0..4 {
            if shared.engine.with(|e| e.poll(&shared.doorbell)) == 0 {
                break;
            }
        }
        drop(self.qp.take());
        self.watcher.remove(self.key);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        // `self.link` drops next: the link is torn down or removed if this was its last.
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("qp", &self.qp)
            .field("peer_pid", &self.cred.pid)
            .field("peer_qpn", &self.peer_qpn())
            .field("link", &self.link.id)
            .field("peer_connected", &self.is_peer_connected())
            .finish_non_exhaustive()
    }
}

/// A link of this context to a peer engine, as the connection manager counts it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LinkInfo {
    /// The link.
    pub id: LinkId,
    /// The peer engine's identity.
    pub peer_engine: u64,
    /// The peer's process id.
    pub peer_pid: u32,
    /// Connections over it not yet dropped.
    pub connections: u32,
    /// Connections over it whose peer is still there.
    pub live_connections: u32,
    /// False once torn down (its last live connection lost its peer); such a link is never
    /// reused and goes away when its last connection is dropped.
    pub up: bool,
}
