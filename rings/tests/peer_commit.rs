//! A peer must not make me commit memory I did not commit, nor change my seals (issue 24,
//! item 8). A peer holds the read-only descriptor `Segment::share_fd` gives of my arena
//! (one shmhca made, or the application's memfd it adopted); what it can do with it:
//!
//! - `fallocate` and adding seals on that descriptor fail (they need write access);
//! - reopening it read-write through `/proc/self/fd/N` fails for a peer of another user,
//!   because the inode is mode 0400 before it is shared (memfd_create makes it 0777);
//! - a peer that gets a read-write descriptor anyway (root, or the owner after an `fchmod`)
//!   cannot grow the file (`F_SEAL_GROW`) nor add a seal (`F_SEAL_SEAL`, now also on an
//!   adopted memfd).
//!
//! What stays possible for such a peer (`fallocate` inside the size, read faults of a
//! 4 KiB-page segment) is documented in `shmhca_rings::segment`, "What a peer can commit".

use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rustix::fs::{FallocateFlags, MemfdFlags, Mode, OFlags, SealFlags};
use rustix::io::Errno;
use shmhca_rings::fdpass::{recv_with_fds, send_with_fds};
use shmhca_rings::segment::{HugePages, Segment, Sharing};

const KIND: u32 = 0x7e59;
/// A sparse arena: big, never populated.
const ARENA_LEN: usize = 64 << 20;
const CHILD_ENV: &str = "SHMHCA_PEER_COMMIT_CHILD";
/// The uid and gid the "other user" peer runs as.
const NOBODY: u32 = 65534;

/// An arena as the engine makes one: creator writes, sparse.
fn arena() -> Segment {
    Segment::builder(KIND, ARENA_LEN)
        .huge_pages(HugePages::Never)
        .sharing(Sharing::CreatorWrites)
        .populate(false)
        .create()
        .unwrap()
}

/// An application's memfd taken over as an arena (`alloc_pd_over`).
fn adopted() -> Segment {
    let fd = rustix::fs::memfd_create(
        "shmhca-peer-commit",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .unwrap();
    rustix::fs::ftruncate(&fd, ARENA_LEN as u64).unwrap();
    Segment::adopt(fd, KIND, ARENA_LEN).unwrap()
}

fn mode_of(fd: impl AsFd) -> u32 {
    rustix::fs::fstat(fd).unwrap().st_mode & 0o7777
}

fn reopen(fd: &impl AsRawFd, flags: OFlags) -> rustix::io::Result<OwnedFd> {
    rustix::fs::open(
        format!("/proc/self/fd/{}", fd.as_raw_fd()).as_str(),
        flags | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

#[test]
fn shared_segments_are_readable_by_their_owner_only() {
    for (what, seg) in [("arena", arena()), ("adopted memfd", adopted())] {
        assert_eq!(mode_of(seg.as_fd()), 0o400, "{what}");
        // The creator still hands out its read-only reopen.
        let shared = seg.share_fd().unwrap();
        assert_eq!(
            rustix::fs::fcntl_getfl(&shared).unwrap() & OFlags::RWMODE,
            OFlags::RDONLY,
            "{what}"
        );
    }
}

#[test]
fn the_read_only_descriptor_can_neither_allocate_nor_seal() {
    for (what, seg) in [("arena", arena()), ("adopted memfd", adopted())] {
        let shared = seg.share_fd().unwrap();
        assert_eq!(
            rustix::fs::fallocate(&shared, FallocateFlags::empty(), 0, ARENA_LEN as u64),
            Err(Errno::BADF),
            "{what}"
        );
        assert!(
            rustix::fs::fcntl_add_seals(&shared, SealFlags::SEAL).is_err(),
            "{what}"
        );
    }
}

/// A peer that got a read-write descriptor all the same (root, or the file's owner after
/// `fchmod`ing it back) can neither grow the file nor lock or add seals.
#[test]
fn a_read_write_reopen_can_neither_grow_the_file_nor_add_seals() {
    for (what, seg) in [("arena", arena()), ("adopted memfd", adopted())] {
        let shared = seg.share_fd().unwrap();
        // What the owner may do to its own inode.
        rustix::fs::fchmod(&shared, Mode::RUSR | Mode::WUSR).unwrap();
        let rw = reopen(&shared, OFlags::RDWR).unwrap();
        let len = rustix::fs::fstat(&rw).unwrap().st_size as u64;
        assert_eq!(
            rustix::fs::fallocate(&rw, FallocateFlags::empty(), 0, len + 4096),
            Err(Errno::PERM),
            "{what}: fallocate past the size"
        );
        assert_eq!(
            rustix::fs::ftruncate(&rw, len + 4096),
            Err(Errno::PERM),
            "{what}: growing"
        );
        assert!(
            rustix::fs::fcntl_get_seals(&rw)
                .unwrap()
                .contains(SealFlags::SEAL),
            "{what}: seals locked"
        );
        assert_eq!(
            rustix::fs::fcntl_add_seals(&rw, SealFlags::SEAL),
            Err(Errno::PERM),
            "{what}: a peer locked the seals"
        );
    }
}

/// The child, running as another user: receives the two descriptors and tries to reopen
/// each read-write, then (if that worked) to commit the whole file with `fallocate`.
fn child(path: &str) {
    let stream = UnixStream::connect(path).unwrap();
    let mut buf = [0u8; 8];
    let (_, fds) = recv_with_fds(&stream, &mut buf, 2).unwrap();
    assert_eq!(fds.len(), 2);
    for (what, fd) in ["arena", "adopted"].iter().zip(&fds) {
        match reopen(fd, OFlags::RDWR) {
            Err(e) => println!("{what}: REOPEN-REFUSED {e:?}"),
            Ok(rw) => {
                let len = rustix::fs::fstat(&rw).unwrap().st_size as u64;
                let f = rustix::fs::fallocate(&rw, FallocateFlags::empty(), 0, len);
                println!("{what}: REOPEN-ALLOWED, fallocate of {len} bytes: {f:?}");
            }
        }
    }
}

#[test]
fn a_peer_of_another_user_cannot_reopen_a_shared_arena_read_write() {
    if let Ok(path) = std::env::var(CHILD_ENV) {
        child(&path);
        return;
    }
    if !rustix::process::geteuid().is_root() {
        eprintln!(
            "a_peer_of_another_user_cannot_reopen_a_shared_arena_read_write: skipped: needs \
             root to run the peer as another user"
        );
        return;
    }
    let dir = std::env::temp_dir().join(format!("shmhca-peer-commit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir(&dir).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let path = dir.join("sock");
    let listener = UnixListener::bind(&path).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (a, b) = (arena(), adopted());
    let peer = Command::new(std::env::current_exe().unwrap())
        .args([
            "a_peer_of_another_user_cannot_reopen_a_shared_arena_read_write",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &path)
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut peer = match peer {
        Ok(p) => p,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            eprintln!(
                "a_peer_of_another_user_cannot_reopen_a_shared_arena_read_write: skipped: uid \
                 {NOBODY} cannot run this test binary ({e})"
            );
            return;
        }
    };
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let stream = loop {
        match listener.accept() {
            Ok((s, _)) => break Some(s),
            Err(_) if Instant::now() < deadline => {
                if peer.try_wait().unwrap().is_some() {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(_) => break None,
        }
    };
    let Some(stream) = stream else {
        let _ = peer.kill();
        let out = peer.wait_with_output().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let text = String::from_utf8_lossy(&out.stderr).into_owned();
        if text.contains("Permission denied") {
            eprintln!(
                "a_peer_of_another_user_cannot_reopen_a_shared_arena_read_write: skipped: uid \
                 {NOBODY} cannot run this test binary or reach {}: {text}",
                path.display()
            );
            return;
        }
        panic!("the peer never connected: {text}");
    };
    stream.set_nonblocking(false).unwrap();
    let (fa, fb) = (a.share_fd().unwrap(), b.share_fd().unwrap());
    send_with_fds(&stream, b"fds", &[fa.as_fd(), fb.as_fd()]).unwrap();
    let mut out = String::new();
    peer.stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let status = peer.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "the peer failed: {out}");
    assert!(
        out.contains("arena: REOPEN-REFUSED") && out.contains("adopted: REOPEN-REFUSED"),
        "a peer of another user reopened a shared arena read-write: {out}"
    );
}
