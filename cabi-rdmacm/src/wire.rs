//! The CM's protocol between two processes of one user, over a Unix stream socket: a
//! listening id on port P is the socket `rdmacm-P.sock` in the per-user fabric directory
//! (the engine's rule, [`shmhca::fabric::default_dir`], mode 0700 and this user's, checked).
//! The peer's user is checked with `SO_PEERCRED`.
//!
//! Every message is one fixed-size `Frame`, strictly validated (a hostile process of the
//! same user may write anything): magic, version, kind, lengths, 24-bit QPN and PSN, a
//! unicast LID. The exchange is InfiniBand CM's: REQ (client: its LID/GID, QPN, PSN,
//! responder resources, initiator depth, private data, source address), REP or REJ
//! (server), RTU (client, once its QP is RTS), then DREQ/DREP to disconnect.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

/// The frame's magic ("SHCM").
const MAGIC: u32 = 0x5348_434d;
/// The protocol's version.
const VERSION: u16 = 1;
/// The largest private data of any message (a REP's, 196 bytes in IB CM).
pub(crate) const MAX_PRIVATE: usize = 196;
/// Bytes of a frame on the wire.
pub(crate) const FRAME_LEN: usize = 48 + 18 + MAX_PRIVATE;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Connection request (client to server).
    Req = 1,
    /// Accept (server to client).
    Rep = 2,
    /// Reject (server to client).
    Rej = 3,
    /// Ready to use: the client's QP is RTS (client to server).
    Rtu = 4,
    /// Disconnect request.
    Dreq = 5,
    /// Disconnect reply.
    Drep = 6,
}

impl Kind {
    fn from_u8(k: u8) -> Option<Kind> {
        Some(match k {
            1 => Kind::Req,
            2 => Kind::Rep,
            3 => Kind::Rej,
            4 => Kind::Rtu,
            5 => Kind::Dreq,
            6 => Kind::Drep,
            _ => return None,
        })
    }

    /// The most private data IB CM carries in this message.
    fn max_private(self) -> usize {
        match self {
            Kind::Req => 56,
            Kind::Rep => 196,
            Kind::Rej => 148,
            Kind::Rtu => 224.min(MAX_PRIVATE),
            Kind::Dreq | Kind::Drep => 0,
        }
    }
}

/// One message.
#[derive(Clone, Debug)]
pub(crate) struct Frame {
    /// What it is.
    pub(crate) kind: Kind,
    /// The sender's LID.
    pub(crate) lid: u16,
    /// The sender's GID.
    pub(crate) gid: [u8; 16],
    /// The sender's QP number (24 bits).
    pub(crate) qpn: u32,
    /// The sender's first send PSN (24 bits).
    pub(crate) psn: u32,
    /// The sender's responder resources.
    pub(crate) responder_resources: u8,
    /// The sender's initiator depth.
    pub(crate) initiator_depth: u8,
    /// The sender's address (REQ: the client's source address).
    pub(crate) addr: SocketAddr,
    /// Private data.
    pub(crate) private: Vec<u8>,
}

impl Frame {
    /// A frame of `kind` with nothing else.
    pub(crate) fn bare(kind: Kind) -> Frame {
        Frame {
            kind,
            lid: 0,
            gid: [0; 16],
            qpn: 0,
            psn: 0,
            responder_resources: 0,
            initiator_depth: 0,
            addr: SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
            private: Vec::new(),
        }
    }

    /// Its bytes. Private data longer than the kind carries is an error (EINVAL).
    pub(crate) fn encode(&self) -> Result<[u8; FRAME_LEN], i32> {
        if self.private.len() > self.kind.max_private() {
            return Err(libc::EINVAL);
        }
        let mut b = [0u8; FRAME_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6] = self.kind as u8;
        b[7] = self.private.len() as u8;
        b[8..10].copy_from_slice(&self.lid.to_le_bytes());
        b[10] = self.responder_resources;
        b[11] = self.initiator_depth;
        b[12..16].copy_from_slice(&self.qpn.to_le_bytes());
        b[16..20].copy_from_slice(&self.psn.to_le_bytes());
        b[20..36].copy_from_slice(&self.gid);
        let ip = match self.addr.ip() {
            IpAddr::V4(v) => v.to_ipv6_mapped(),
            IpAddr::V6(v) => v,
        };
        b[36..52].copy_from_slice(&ip.octets());
        b[52..54].copy_from_slice(&self.addr.port().to_le_bytes());
        b[54] = u8::from(self.addr.is_ipv4());
        let p = 48 + 18;
        b[p..p + self.private.len()].copy_from_slice(&self.private);
        Ok(b)
    }

    /// Parses and validates a frame; what is wrong with a malformed one.
    pub(crate) fn decode(b: &[u8; FRAME_LEN]) -> Result<Frame, &'static str> {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        if u32_at(0) != MAGIC || u16_at(4) != VERSION {
            return Err("not a shmhca CM message of this version");
        }
        let kind = Kind::from_u8(b[6]).ok_or("an unknown message kind")?;
        let len = usize::from(b[7]);
        if len > kind.max_private() {
            return Err("more private data than the message carries");
        }
        let lid = u16_at(8);
        let qpn = u32_at(12);
        let psn = u32_at(16);
        if qpn > 0xFF_FFFF || psn > 0xFF_FFFF {
            return Err("a QPN or PSN wider than 24 bits");
        }
        if b[55..66].iter().any(|&x| x != 0) {
            return Err("non-zero padding");
        }
        if matches!(kind, Kind::Req | Kind::Rep) && (lid == 0 || lid > shmhca::fabric::MAX_LID) {
            return Err("a LID that is not unicast");
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[20..36]);
        let mut ip = [0u8; 16];
        ip.copy_from_slice(&b[36..52]);
        let ip = Ipv6Addr::from(ip);
        let ip = match b[54] {
            1 => IpAddr::V4(ip.to_ipv4_mapped().ok_or("a bad IPv4 address")?),
            0 => IpAddr::V6(ip),
            _ => return Err("a bad address family"),
        };
        let p = 48 + 18;
        if b[p + len..].iter().any(|&x| x != 0) {
            return Err("bytes after the private data");
        }
        Ok(Frame {
            kind,
            lid,
            gid,
            qpn,
            psn,
            responder_resources: b[10],
            initiator_depth: b[11],
            addr: SocketAddr::new(ip, u16_at(52)),
            private: b[p..p + len].to_vec(),
        })
    }
}

/// Sends `f` on `s`.
pub(crate) fn send(mut s: &UnixStream, f: &Frame) -> Result<(), i32> {
    let b = f.encode()?;
    s.write_all(&b)
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))
}

/// What reading a frame gave.
pub(crate) enum Got {
    /// A valid frame.
    Frame(Frame),
    /// The peer closed the connection (or it failed).
    Closed,
    /// Something malformed (what): the connection is to be dropped.
    Bad(&'static str),
}

/// Reads one frame from `s` (blocking, or until its read timeout).
pub(crate) fn recv(mut s: &UnixStream) -> Got {
    let mut b = [0u8; FRAME_LEN];
    match s.read_exact(&mut b) {
        Ok(()) => Frame::decode(&b).map_or_else(Got::Bad, Got::Frame),
        Err(_) => Got::Closed,
    }
}

/// Whether `s` has something to read within `ms` milliseconds (or its peer hung up).
pub(crate) fn readable(s: &impl AsRawFd, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    n > 0
}

/// Whether the process at the other end of `s` is this user's (`SO_PEERCRED`).
pub(crate) fn same_user(s: &UnixStream) -> bool {
    // SAFETY: all-zero is a valid ucred.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::from_mut(&mut cred).cast(),
            &mut len,
        )
    };
    // SAFETY: getuid cannot fail.
    rc == 0 && cred.uid == unsafe { libc::getuid() }
}

/// The fabric directory, created (0700) if needed and checked to be this user's and closed
/// to others, as the engine does.
pub(crate) fn fabric_dir() -> Result<PathBuf, i32> {
    let dir = shmhca::fabric::default_dir();
    if let Err(e) = std::fs::DirBuilder::new()
        .mode_0700()
        .create(&dir)
        .or_else(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                Ok(())
            } else {
                Err(e)
            }
        })
    {
        crate::util::say_once(format!(
            "rdma_cm: cannot create the fabric directory {}: {e}",
            dir.display()
        ));
        return Err(e.raw_os_error().unwrap_or(libc::EIO));
    }
    let m = std::fs::symlink_metadata(&dir).map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    if !m.is_dir() || m.uid() != uid || m.mode() & 0o077 != 0 {
        crate::util::say_once(format!(
            "rdma_cm: the fabric directory {} is refused (not a directory of this user with \
             mode 0700)",
            dir.display()
        ));
        return Err(libc::EACCES);
    }
    Ok(dir)
}

/// `DirBuilder::mode(0o700)` under a name that reads.
trait Mode0700 {
    fn mode_0700(&mut self) -> &mut Self;
}

impl Mode0700 for std::fs::DirBuilder {
    fn mode_0700(&mut self) -> &mut Self {
        use std::os::unix::fs::DirBuilderExt;
        self.mode(0o700)
    }
}

/// The rendezvous socket of port `port`.
pub(crate) fn sock_path(dir: &std::path::Path, port: u16) -> PathBuf {
    dir.join(format!("rdmacm-{port}.sock"))
}

/// Whether `path` is a socket nobody listens on any more (its process died): connecting
/// is refused.
pub(crate) fn is_stale(path: &std::path::Path) -> bool {
    let is_sock = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
    is_sock
        && matches!(UnixStream::connect(path), Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED))
}

/// Which file a listener's socket is (device and inode), so that it removes its own
/// socket and never one another process made at the same path since.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SockIdent(u64, u64);

impl SockIdent {
    fn of(path: &std::path::Path) -> Option<SockIdent> {
        let m = std::fs::symlink_metadata(path).ok()?;
        m.file_type()
            .is_socket()
            .then(|| SockIdent(m.dev(), m.ino()))
    }
}

/// Holds the fabric directory's rendezvous lock (`flock` on `rdmacm.lock` in it) while
/// alive: the processes of this user that bind a rendezvous socket (and replace a stale
/// one) or remove their own take it, so that two of them never both find one socket stale
/// and each remove what the other bound (check-then-remove is one step under it), and none
/// takes a socket bound but not yet listening for a dead one.
struct DirLock {
    _file: std::fs::File,
}

impl DirLock {
    fn take(dir: &std::path::Path) -> io::Result<DirLock> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(dir.join("rdmacm.lock"))?;
        loop {
            // SAFETY: `f` is an open file this function owns; flock only locks it.
            let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
            if r == 0 {
                return Ok(DirLock { _file: f });
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// Binds the rendezvous socket of port `port` in `dir`. A socket left there by a process
/// that died is replaced; a live one is `EADDRINUSE`. Returns the listener, its path and
/// which file it is (for [`remove_own`]).
pub(crate) fn bind_port(
    dir: &std::path::Path,
    port: u16,
) -> io::Result<(std::os::unix::net::UnixListener, PathBuf, SockIdent)> {
    use std::os::unix::net::UnixListener;
    let path = sock_path(dir, port);
    let bound = |l: UnixListener, path: PathBuf| {
        let id = SockIdent::of(&path).ok_or_else(|| io::Error::from_raw_os_error(libc::EIO))?;
        Ok((l, path, id))
    };
    // Under the lock from the bind on: a socket is bound to its path a moment before it
    // listens, and a connection attempt in between is refused as if it were stale.
    let _lock = DirLock::take(dir)?;
    match UnixListener::bind(&path) {
        Ok(l) => return bound(l, path),
        Err(e) if e.raw_os_error() == Some(libc::EADDRINUSE) => {}
        Err(e) => return Err(e),
    }
    if !is_stale(&path) {
        return Err(io::Error::from_raw_os_error(libc::EADDRINUSE));
    }
    // A socket of a process that died: ours to replace (under the lock, so that nobody
    // else found it stale too and removes what this binds).
    std::fs::remove_file(&path)?;
    let l = UnixListener::bind(&path)?;
    bound(l, path)
}

/// Removes the socket at `path` if it is still the one `id` names (a listener closing);
/// one another process bound there since is left alone.
pub(crate) fn remove_own(path: &std::path::Path, id: SockIdent) {
    let Some(dir) = path.parent() else { return };
    let Ok(_lock) = DirLock::take(dir) else {
        return;
    };
    if SockIdent::of(path) == Some(id) {
        let _ = std::fs::remove_file(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_garbage_is_refused() {
        let mut f = Frame::bare(Kind::Req);
        f.lid = 7;
        f.qpn = 0x12_3456;
        f.psn = 0xAB_CDEF;
        f.addr = "127.0.0.1:4242".parse().unwrap();
        f.private = vec![1, 2, 3];
        let b = f.encode().unwrap();
        let g = Frame::decode(&b).unwrap();
        assert_eq!(
            (g.kind, g.lid, g.qpn, g.psn),
            (Kind::Req, 7, 0x12_3456, 0xAB_CDEF)
        );
        assert_eq!(g.addr, f.addr);
        assert_eq!(g.private, vec![1, 2, 3]);
        for (i, v) in [
            (0, 0u8),
            (6, 9),
            (7, 57),
            (8, 0),
            (9, 0xC0),
            (15, 1),
            (60, 1),
            (200, 1),
        ] {
            let mut bad = b;
            bad[i] = v;
            if i == 8 {
                bad[9] = 0;
            }
            assert!(Frame::decode(&bad).is_err(), "byte {i} = {v} accepted");
        }
        f.private = vec![0; 57];
        assert_eq!(f.encode().unwrap_err(), libc::EINVAL);
    }

    /// A socket file left by a process that died, and many listeners at once: exactly one
    /// replaces it (check-then-remove under the directory lock), the others are told the
    /// port is in use, and the socket at the path is the winner's.
    #[test]
    fn one_of_many_replaces_a_stale_socket() {
        let dir = std::env::temp_dir().join(format!("shmhca-rdmacm-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        for round in 0..20u16 {
            let port = 5000 + round;
            drop(std::os::unix::net::UnixListener::bind(sock_path(&dir, port)).unwrap());
            assert!(is_stale(&sock_path(&dir, port)));
            let go = std::sync::Arc::new(std::sync::Barrier::new(6));
            let threads: Vec<_> = (0..6)
                .map(|_| {
                    let (dir, go) = (dir.clone(), go.clone());
                    std::thread::spawn(move || {
                        go.wait();
                        bind_port(&dir, port)
                    })
                })
                .collect();
            let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
            let won: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
            assert_eq!(won.len(), 1, "round {round}: one listener");
            for r in &results {
                if let Err(e) = r {
                    assert_eq!(e.raw_os_error(), Some(libc::EADDRINUSE), "{e}");
                }
            }
            let (_, path, id) = won[0];
            assert_eq!(
                SockIdent::of(path),
                Some(*id),
                "the path is the winner's socket"
            );
            assert!(!is_stale(path));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A listener closing removes its own socket, never one bound at its path since.
    #[test]
    fn a_listener_removes_only_its_own_socket() {
        let dir = std::env::temp_dir().join(format!("shmhca-rdmacm-own-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let (l, path, id) = bind_port(&dir, 7000).unwrap();
        remove_own(&path, id);
        assert!(
            std::fs::symlink_metadata(&path).is_err(),
            "its own: removed"
        );
        drop(l);
        let (_l, path, id) = bind_port(&dir, 7001).unwrap();
        // Someone else's socket now stands at the path.
        std::fs::remove_file(&path).unwrap();
        let _other = std::os::unix::net::UnixListener::bind(&path).unwrap();
        remove_own(&path, id);
        assert!(
            std::fs::symlink_metadata(&path).is_ok(),
            "another's socket is left alone"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
