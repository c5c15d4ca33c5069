//! The rendezvous directory: where the engines of one user find each other by LID.
//!
//! One directory per user: `$SHMHCA_FABRIC_DIR` if set, else `$XDG_RUNTIME_DIR/shmhca` when
//! `XDG_RUNTIME_DIR` names a directory of this user, else `/dev/shm/shmhca-$UID`. It is
//! created with mode 0700 and refused if it exists with another owner, looser permissions,
//! or is not a directory (a symbolic link included): another user must not be able to plant
//! entries in it.
//!
//! A context that joins the fabric holds LID `N` by an exclusive `flock(2)` on
//! `lid-N.lock` in that directory and listens on the Unix socket `lid-N.sock`. The lock
//! dies with its process, so a lock file nobody holds is free: the stale entries of dead
//! processes are reclaimed by the next context that tries that LID. A lock is only trusted
//! once the path still names the locked file (a departing owner unlinks it), so two
//! contexts never hold one LID.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::FlockOperation;

use crate::error::{Error, Result};

/// Names the rendezvous directory, overriding the default (tests give each their own).
pub const DIR_ENV: &str = "SHMHCA_FABRIC_DIR";

/// The lowest unicast LID.
pub const MIN_LID: u16 = 1;
/// The highest unicast LID (0xC000 and above are multicast, 0xFFFF the permissive LID).
pub const MAX_LID: u16 = 0xBFFF;

/// The rendezvous directory this process uses by default (see the module docs). Not
/// created here.
pub fn default_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let uid = rustix::process::getuid().as_raw();
    if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        let x = PathBuf::from(x);
        let usable = std::fs::metadata(&x).is_ok_and(|m| m.is_dir() && m.uid() == uid);
        if usable {
            return x.join("shmhca");
        }
    }
    PathBuf::from(format!("/dev/shm/shmhca-{uid}"))
}

/// Creates `dir` (mode 0700) if it does not exist, and checks that it is a directory of this
/// user that nobody else may enter.
///
/// # Errors
/// [`Error::Io`] naming the directory and what is wrong with it (another owner, a mode
/// other users can use, not a directory), or why it cannot be created.
pub fn prepare(dir: &Path) -> Result<()> {
    let d = dir.display();
    match DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(Error::io(
                format!("creating the fabric rendezvous directory {d}"),
                e,
            ));
        }
    }
    let m = std::fs::symlink_metadata(dir)
        .map_err(|e| Error::io(format!("inspecting the fabric rendezvous directory {d}"), e))?;
    let refuse = |why: String| {
        Error::io(
            format!("the fabric rendezvous directory {d} is refused"),
            io::Error::new(io::ErrorKind::PermissionDenied, why),
        )
    };
    if !m.is_dir() {
        return Err(refuse(
            "it is not a directory (a symbolic link or a file): remove it, or set SHMHCA_FABRIC_DIR to a directory of yours".into(),
        ));
    }
    let uid = rustix::process::getuid().as_raw();
    if m.uid() != uid {
        return Err(refuse(format!(
            "it belongs to uid {}, not to this user (uid {uid}): another user could plant entries in it; set SHMHCA_FABRIC_DIR to a directory of yours",
            m.uid()
        )));
    }
    if m.mode() & 0o077 != 0 {
        return Err(refuse(format!(
            "its mode is {:o}: other users may enter it; `chmod 700 {d}`",
            m.mode() & 0o7777
        )));
    }
    Ok(())
}

/// The lock file of LID `lid` in `dir`.
pub fn lock_path(dir: &Path, lid: u16) -> PathBuf {
    dir.join(format!("lid-{lid}.lock"))
}

/// The listening socket of LID `lid` in `dir`.
pub fn sock_path(dir: &Path, lid: u16) -> PathBuf {
    dir.join(format!("lid-{lid}.sock"))
}

/// A LID held by this process: the locked file. Dropping it removes the socket and the lock
/// file, then releases the lock.
#[derive(Debug)]
pub(crate) struct LidLock {
    pub(crate) lid: u16,
    file: Option<File>,
    dir: PathBuf,
}

impl Drop for LidLock {
    fn drop(&mut self) {
        // The socket first: a peer that finds no socket treats the LID as absent.
        let _ = std::fs::remove_file(sock_path(&self.dir, self.lid));
        // Unlinked while still locked: a context that opened it before and locks it after
        // sees that the path no longer names it and moves on (see `try_lid`).
        let _ = std::fs::remove_file(lock_path(&self.dir, self.lid));
        drop(self.file.take());
    }
}

/// Tries to hold LID `lid` in `dir`: `Ok(None)` if a live process holds it.
pub(crate) fn try_lid(dir: &Path, lid: u16) -> Result<Option<LidLock>> {
    let path = lock_path(dir, lid);
    let io = |what: &str, e: io::Error| Error::io(format!("{what} {}", path.display()), e);
    for _ in 0..8 {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(&path)
            .map_err(|e| io("opening the LID lock file", e))?;
        match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => return Ok(None),
            Err(e) => return Err(io("locking", e.into())),
        }
        // Held: but is it still the file the path names? Its last owner may have unlinked
        // it between our open and our lock.
        let held = file
            .metadata()
            .map_err(|e| io("inspecting the LID lock file", e))?;
        match std::fs::symlink_metadata(&path) {
            Ok(now) if now.dev() == held.dev() && now.ino() == held.ino() => {
                return Ok(Some(LidLock {
                    lid,
                    file: Some(file),
                    dir: dir.to_path_buf(),
                }));
            }
            _ => continue,
        }
    }
    Ok(None)
}

/// Holds a free LID in `dir`, starting the search at a point drawn from `seed` (so that
/// contexts starting together rarely try the same LIDs).
///
/// # Errors
/// The lock files cannot be opened, or every unicast LID is held.
pub(crate) fn claim_lid(dir: &Path, seed: u64) -> Result<LidLock> {
    let span = u64::from(MAX_LID - MIN_LID) + 1;
    let start = seed % span;
    for i in 0..span {
        let lid = MIN_LID + ((start + i) % span) as u16;
        if let Some(l) = try_lid(dir, lid)? {
            return Ok(l);
        }
    }
    Err(Error::LimitReached {
        what: "LIDs (contexts on the fabric) in one rendezvous directory",
        limit: u32::from(MAX_LID),
    })
}

/// Whether a live context holds LID `lid` in `dir` (a lock file nobody holds is a dead
/// process's: free).
pub fn lid_held(dir: &Path, lid: u16) -> bool {
    let Ok(file) = File::open(lock_path(dir, lid)) else {
        return false;
    };
    match rustix::fs::flock(&file, FlockOperation::NonBlockingLockShared) {
        Ok(()) => false,
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn tmp(tag: &str) -> PathBuf {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        std::env::temp_dir().join(format!(
            "shmhca-fabric-dir-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ))
    }

    #[test]
    fn a_new_directory_is_private() {
        let d = tmp("new");
        prepare(&d).unwrap();
        let m = std::fs::metadata(&d).unwrap();
        assert_eq!(m.mode() & 0o777, 0o700);
        prepare(&d).unwrap();
        std::fs::remove_dir(&d).unwrap();
    }

    #[test]
    fn a_directory_others_may_enter_is_refused() {
        let d = tmp("loose");
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        let why = prepare(&d).unwrap_err().to_string();
        assert!(why.contains("chmod 700") && why.contains("755"), "{why}");
        std::fs::remove_dir(&d).unwrap();
    }

    #[test]
    fn a_symbolic_link_is_refused() {
        let d = tmp("real");
        let l = tmp("link");
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(&d, &l).unwrap();
        let why = prepare(&l).unwrap_err().to_string();
        assert!(why.contains("not a directory"), "{why}");
        std::fs::remove_file(&l).unwrap();
        std::fs::remove_dir(&d).unwrap();
    }

    #[test]
    fn a_lid_is_held_once_and_a_stale_lock_file_is_reclaimed() {
        let d = tmp("lids");
        prepare(&d).unwrap();
        let a = try_lid(&d, 7).unwrap().expect("free");
        assert!(try_lid(&d, 7).unwrap().is_none(), "held by `a`");
        assert!(lid_held(&d, 7));
        drop(a);
        assert!(!lock_path(&d, 7).exists(), "removed by its owner");
        // A lock file left by a dead process: nobody holds it, so it is free.
        std::fs::write(lock_path(&d, 7), b"").unwrap();
        assert!(!lid_held(&d, 7));
        let b = try_lid(&d, 7)
            .unwrap()
            .expect("a stale lock file is reclaimed");
        assert_eq!(b.lid, 7);
        let c = claim_lid(&d, 6).unwrap();
        assert_eq!(c.lid, 8, "7 is held: the next one");
        drop((b, c));
        std::fs::remove_dir(&d).unwrap();
    }
}
