//! The fabric: addressing peer engines by LID or GID, as verbs programs do.
//!
//! A verbs program reaches its peer the fabric way: each process opens the device, reads
//! its port's LID (or GID), swaps LID, QPN and PSN with the peer out of band (over TCP,
//! say), and moves its QP to RTR naming the peer's LID (or GID) and QPN. This module gives
//! shmhca that way, besides the connection manager ([`crate::cm`]):
//!
//! * [`Context::join_fabric`] gives the context a unique LID on this machine (per user) and
//!   a GID derived from it ([`FabricAddr`], [`Context::fabric_addr`]). The LID is held by
//!   a locked file in a per-user rendezvous directory, and the context listens on a Unix
//!   socket there for link requests ([`dir`] says where, and how stale entries of dead
//!   processes are reclaimed). A small thread per context accepts those requests, so a peer
//!   is served while the application sits in a blocking read, in either engine mode.
//! * [`QpAttr::dest_lid`](crate::QpAttr::dest_lid) or [`QpAttr::dest_gid`](crate::QpAttr::dest_gid) in the Init → RTR modify (instead of
//!   [`QpAttr::dest`](crate::QpAttr::dest)): [`Qp::modify`](crate::Qp::modify) finds the peer's engine through the
//!   directory, reuses the link to it or makes one (one link per pair of engines), hands
//!   the peer this QP's protection-domain arena (the peer reads payloads from it, read-only)
//!   and fetches the arena of the peer QP, all before RTR returns. Peers are checked with
//!   `SO_PEERCRED`: only processes of this user are served or contacted.
//!
//! # A peer that is not there (yet)
//!
//! As on a fabric, RTR to a LID no engine holds succeeds: the QP gets a link that no
//! engine reads yet, its packets wait there (and its transport timer retries them). If an
//! engine takes that LID and its QP goes to RTR towards this one, that engine is given
//! this very link and reads what waits on it: the QPs talk as if the peer had been there
//! all along. If no engine ever comes, the QP's retries run out and it ends in the Error
//! state with [`WcStatus::RetryExcErr`](crate::WcStatus::RetryExcErr), as on a fabric
//! (after `retry_cnt` retries of its Local Ack Timeout). A QPN the peer engine does not
//! have (yet) is the same: RTR succeeds and the peer QP's arena is taken when that QP goes
//! to RTR towards this one.
//!
//! # Peer death
//!
//! The Unix socket over which a link was set up stays open for the link's life. When the
//! peer process dies (or drops its context), the kernel closes it; this side's fabric thread
//! sees the hang-up within milliseconds, processes what the peer had already put on the
//! link, and tears the link down. The QPs whose destination is on it learn it as follows:
//! a request outstanding when the link went down, or posted after, completes at once with
//! [`WcStatus::RetryExcErr`](crate::WcStatus::RetryExcErr) (what its retries would end in)
//! and its QP goes to the Error state; a QP with nothing outstanding stays as it is for the
//! context's peer-loss grace ([`DEFAULT_PEER_LOSS_GRACE`], set with
//! [`ContextBuilder::peer_loss_grace`](crate::ContextBuilder::peer_loss_grace)), then goes
//! to the Error state, its receives completing with
//! [`WcStatus::WrFlushErr`](crate::WcStatus::WrFlushErr) and
//! [`Qp::last_error`](crate::Qp::last_error) saying the peer is gone. The grace keeps a
//! ping-pong whose peer exits right after the last message from seeing its spare receives
//! flushed in the same poll as its last completion; with no grace (`None`) the QP is left as
//! InfiniBand leaves it, where nothing tells an RC QP its peer vanished. (The connection
//! manager's links differ: a connection ends with its peer, and its QP goes to the Error
//! state at once.)
//!
//! # What a peer can get
//!
//! Any process of this user may ask a fabric context for the arena of one of its QPs by
//! QPN (as it would, on a fabric, send to any QP whose number it knows): the rule of
//! [`crate::verbs`]'s security model holds — a peer reads the arenas of protection domains
//! whose QPs it was told about, read-only, and writes nothing. Processes of other users are
//! refused; the directory is private to the user.
//!
//! # Example
//!
//! Two contexts (they would be two processes) join the fabric in a directory of their own,
//! swap LIDs and QPNs, and go to RTS by LID:
//!
//! ```
//! use shmhca::*;
//!
//! let dir = std::env::temp_dir().join(format!("shmhca-doc-fabric-{}", std::process::id()));
//! let (a, b) = (Context::builder().arena_size(1 << 20).build()?,
//!               Context::builder().arena_size(1 << 20).build()?);
//! let (addr_a, addr_b) = (a.join_fabric_in(&dir)?, b.join_fabric_in(&dir)?);
//! assert_ne!(addr_a.lid, addr_b.lid);
//! let (pd_a, pd_b) = (a.alloc_pd()?, b.alloc_pd()?);
//! let (cq_a, mut cq_b) = (a.create_cq(16)?, b.create_cq(16)?);
//! let mut qa = a.create_qp(&pd_a, &cq_a, &cq_a, QpCaps::default())?;
//! let mut qb = b.create_qp(&pd_b, &cq_b, &cq_b, QpCaps::default())?;
//! // What the two programs would swap over TCP: LID, QPN (and a start PSN, 0 here).
//! let (na, nb) = (qa.qpn(), qb.qpn());
//! for (qp, lid, qpn) in [(&mut qa, addr_b.lid, nb), (&mut qb, addr_a.lid, na)] {
//!     qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::REMOTE_WRITE))?;
//!     qp.modify(&QpAttr::new(QpState::Rtr).path_mtu(Mtu::Mtu4096)
//!         .dest_lid(lid, qpn).rq_psn(0).max_dest_rd_atomic(1).min_rnr_timer(1))?;
//!     qp.modify(&QpAttr::new(QpState::Rts).sq_psn(0).timeout(14)
//!         .retry_cnt(7).rnr_retry(7).max_rd_atomic(1))?;
//! }
//! let src = pd_a.alloc_mr(64, AccessFlags::NONE)?;
//! let dst = pd_b.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
//! src.write_at(0, b"over the fabric")?;
//! qb.post_recv(&RecvWr::new(1, &[dst.sge(0, 64)?]))?;
//! qa.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 15)?]))?;
//! let mut wc = [WorkCompletion::default(); 1];
//! assert_eq!(cq_b.poll_until(&mut wc, std::time::Duration::from_secs(30)), 1);
//! assert_eq!((wc[0].status, wc[0].byte_len), (WcStatus::Success, 15));
//! drop((qa, qb, a, b));
//! # let _ = std::fs::remove_dir(&dir);
//! # Ok::<(), shmhca::Error>(())
//! ```

pub(crate) mod addr;
pub mod dir;
pub(crate) mod msg;
mod setup;
mod watch;

use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use shmhca_rings::segment::Segment;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::link::LinkId;
use crate::verbs::Context;

pub use addr::{FabricDest, FabricPeer, SUBNET_PREFIX, gid_of_lid, lid_of_gid};
pub use dir::{DIR_ENV, MAX_LID, MIN_LID, default_dir};

/// A context's address on the fabric: its port's LID and GID (index 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FabricAddr {
    /// The port's LID: unique among the contexts of this user on this machine, from
    /// [`MIN_LID`] to [`MAX_LID`].
    pub lid: u16,
    /// The port's GID, derived from the LID ([`gid_of_lid`]).
    pub gid: [u8; 16],
}

/// A link of the fabric, from [`Context::fabric_links`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct FabricLink {
    /// The peer's LID.
    pub peer_lid: u16,
    /// The link (the `link` of the [`Destination`](crate::Destination)s facing it).
    pub link: LinkId,
    /// Whether a peer engine has attached (false while no engine held the LID).
    pub attached: bool,
    /// False once torn down (the peer hung up, or its engine was replaced).
    pub up: bool,
}

/// Bytes of a peer's arena this side maps at most (as the connection manager's default).
const MAX_PEER_ARENA: u64 = crate::cm::DEFAULT_MAX_PEER_ARENA;

/// How long the QPs facing a lost peer stay as they are, if they have nothing
/// outstanding, before they go to the Error state (the default of
/// [`ContextBuilder::peer_loss_grace`](crate::ContextBuilder::peer_loss_grace)).
pub const DEFAULT_PEER_LOSS_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// One link of the fabric to a peer LID.
#[derive(Debug)]
pub(crate) struct PeerLink {
    pub(crate) lid: u16,
    pub(crate) id: LinkId,
    /// The token its creator drew.
    pub(crate) token: u64,
    /// The peer engine's identity; `None` while no engine has attached (pending).
    pub(crate) identity: Option<u64>,
    /// The segment, kept while pending (to give to the engine that comes).
    pub(crate) segment: Option<Arc<Segment>>,
    /// The socket that keeps the link (its hang-up tells the peer is gone).
    pub(crate) socket: Option<Arc<UnixStream>>,
    /// Cleared when torn down: never used again, removed once no QP points at it.
    pub(crate) up: bool,
    /// When it was torn down, and why, until the QPs still facing it are moved to the
    /// Error state ([`Device::peer_loss_grace`](crate::device::Device) after it; then
    /// `None` again).
    pub(crate) down_at: Option<(std::time::Instant, String)>,
}

#[derive(Default)]
pub(crate) struct Table {
    pub(crate) peers: Vec<PeerLink>,
    /// LIDs a thread of this context is setting a link up with (may repeat).
    pub(crate) busy: Vec<u16>,
}

impl Table {
    /// The live entry for `lid`.
    pub(crate) fn live(&mut self, lid: u16) -> Option<&mut PeerLink> {
        self.peers.iter_mut().find(|p| p.lid == lid && p.up)
    }

    /// The live entry holding link `token`.
    pub(crate) fn by_token(&mut self, lid: u16, token: u64) -> Option<&mut PeerLink> {
        self.peers
            .iter_mut()
            .find(|p| p.lid == lid && p.token == token && p.up)
    }

    pub(crate) fn unbusy(&mut self, lid: u16) {
        if let Some(i) = self.busy.iter().position(|&l| l == lid) {
            self.busy.swap_remove(i);
        }
    }
}

/// A context's membership of the fabric.
pub(crate) struct Fabric {
    pub(crate) dir: PathBuf,
    pub(crate) lid: u16,
    /// Held for the context's life; dropped last (removes the socket and lock files).
    _lock: dir::LidLock,
    pub(crate) listener: UnixListener,
    /// Wakes the fabric thread (a socket to watch, or the end).
    pub(crate) wake: OwnedFd,
    pub(crate) table: Mutex<Table>,
    pub(crate) changed: Condvar,
    pub(crate) stop: AtomicBool,
    /// Link requests being served now.
    pub(crate) handlers: AtomicU32,
    /// This process's user: only its processes are served.
    pub(crate) uid: u32,
}

impl Fabric {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn wake(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    /// The address of this context.
    pub(crate) fn addr(&self) -> FabricAddr {
        FabricAddr {
            lid: self.lid,
            gid: gid_of_lid(self.lid),
        }
    }
}

/// A context's slot for its fabric membership (in its `Device`); stops the fabric thread when
/// the context goes.
#[derive(Default)]
pub(crate) struct FabricSlot(Mutex<Option<Arc<Fabric>>>);

impl FabricSlot {
    /// The fabric slot of `device`, created on first use. It is kept in the device (so it
    /// ends with it) but only this module knows its type.
    pub(crate) fn of(device: &Device) -> &FabricSlot {
        device
            .fabric
            .get_or_init(|| Box::<FabricSlot>::default())
            .downcast_ref()
            .expect("only the fabric stores state in `Device::fabric`")
    }

    pub(crate) fn get(&self) -> Option<Arc<Fabric>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Drop for FabricSlot {
    fn drop(&mut self) {
        if let Some(f) = self.0.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            f.stop.store(true, Ordering::Release);
            f.wake();
        }
    }
}

impl Context {
    /// Joins the fabric in the default rendezvous directory ([`default_dir`]:
    /// `$SHMHCA_FABRIC_DIR`, else `$XDG_RUNTIME_DIR/shmhca`, else `/dev/shm/shmhca-$UID`),
    /// as [`Context::join_fabric_in`].
    ///
    /// # Errors
    /// See [`Context::join_fabric_in`].
    pub fn join_fabric(&self) -> Result<FabricAddr> {
        self.join_fabric_in(default_dir())
    }

    /// Joins the fabric in rendezvous directory `dir`: takes a free LID there, listens for
    /// peers' link requests (a thread of its own, `shmhca-fabric`) and returns the address.
    /// Calling it again returns the same address. The LID stays this context's until the
    /// context is dropped (or its process ends). See the [module docs](crate::fabric).
    ///
    /// # Errors
    /// [`Error::Io`] when the directory is refused (another owner, a mode other users may
    /// enter, a symbolic link; the message says what to do) or cannot be created, or the
    /// socket cannot be bound; [`Error::LimitReached`] when every LID is taken;
    /// [`Error::InvalidArgument`] when the context joined in another directory already.
    pub fn join_fabric_in(&self, dir: impl AsRef<Path>) -> Result<FabricAddr> {
        self.join(dir.as_ref(), None)
    }

    /// Joins the fabric in `dir` with LID `lid`, if no live context holds it (a stale lock
    /// file of a dead process is reclaimed): for tests and fixed set-ups. Otherwise as
    /// [`Context::join_fabric_in`].
    ///
    /// # Errors
    /// As [`Context::join_fabric_in`]; [`Error::InvalidArgument`] for a LID outside
    /// [`MIN_LID`]`..=`[`MAX_LID`] or one a live context holds.
    pub fn join_fabric_as(&self, dir: impl AsRef<Path>, lid: u16) -> Result<FabricAddr> {
        if !(MIN_LID..=MAX_LID).contains(&lid) {
            return Err(Error::invalid(
                "lid",
                format!("{lid:#x} is not a unicast LID ({MIN_LID:#x}..={MAX_LID:#x})"),
            ));
        }
        self.join(dir.as_ref(), Some(lid))
    }

    fn join(&self, dir: &Path, lid: Option<u16>) -> Result<FabricAddr> {
        let mut slot = FabricSlot::of(&self.shared)
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(f) = slot.as_ref() {
            if f.dir == dir && lid.is_none_or(|l| l == f.lid) {
                return Ok(f.addr());
            }
            return Err(Error::invalid(
                "fabric directory",
                format!(
                    "this context joined the fabric in {} already (LID {:#x})",
                    f.dir.display(),
                    f.lid
                ),
            ));
        }
        dir::prepare(dir)?;
        let lock = match lid {
            None => dir::claim_lid(dir, crate::cm::random_u64())?,
            Some(l) => dir::try_lid(dir, l)?.ok_or_else(|| {
                Error::invalid(
                    "lid",
                    format!("LID {l:#x} is held by a live context in {}", dir.display()),
                )
            })?,
        };
        let lid = lock.lid;
        let path = dir::sock_path(dir, lid);
        // The LID is ours: a socket file there is a dead owner's.
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)
            .map_err(|e| Error::io(format!("listening on {}", path.display()), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("making the fabric socket non-blocking", e))?;
        let wake = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(|e| Error::io("creating the fabric thread's eventfd", e.into()))?;
        let fabric = Arc::new(Fabric {
            dir: dir.to_path_buf(),
            lid,
            _lock: lock,
            listener,
            wake,
            table: Mutex::default(),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            handlers: AtomicU32::new(0),
            uid: rustix::process::getuid().as_raw(),
        });
        watch::start(&fabric, &self.shared)?;
        *slot = Some(fabric.clone());
        // From now on the QPs of this context may go to RTR by LID or GID.
        let _ = self.shared.fabric_resolve.set(setup::resolve);
        Ok(fabric.addr())
    }

    /// This context's fabric address, once it joined ([`Context::join_fabric`]).
    pub fn fabric_addr(&self) -> Option<FabricAddr> {
        FabricSlot::of(&self.shared).get().map(|f| f.addr())
    }

    /// The rendezvous directory this context joined the fabric in.
    pub fn fabric_dir(&self) -> Option<PathBuf> {
        FabricSlot::of(&self.shared).get().map(|f| f.dir.clone())
    }

    /// The fabric's links of this context (one per peer LID it reached or was reached
    /// from; torn-down links stay listed until no QP faces them).
    pub fn fabric_links(&self) -> Vec<FabricLink> {
        FabricSlot::of(&self.shared)
            .get()
            .map_or_else(Vec::new, |f| {
                f.lock()
                    .peers
                    .iter()
                    .map(|p| FabricLink {
                        peer_lid: p.lid,
                        link: p.id,
                        attached: p.identity.is_some(),
                        up: p.up,
                    })
                    .collect()
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gid_names_its_lid_and_nothing_else() {
        for lid in [MIN_LID, 0x1234, MAX_LID] {
            assert_eq!(lid_of_gid(&gid_of_lid(lid)), Some(lid));
        }
        let g = gid_of_lid(0x1234);
        assert_eq!(
            std::net::Ipv6Addr::from(g).to_string(),
            "fe80::253:484d:0:1234"
        );
        assert_eq!(lid_of_gid(&gid_of_lid(0)), None);
        assert_eq!(lid_of_gid(&gid_of_lid(0xc000)), None);
        let mut other = g;
        other[0] = 0x20;
        assert_eq!(lid_of_gid(&other), None);
        let v4 = std::net::Ipv4Addr::new(127, 0, 0, 1).to_ipv6_mapped();
        assert_eq!(lid_of_gid(&v4.octets()), None);
    }
}
