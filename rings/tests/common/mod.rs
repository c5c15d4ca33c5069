//! Helpers shared by the integration tests: running a helper "test" of this same binary in
//! a child process, and rendezvous over an abstract Unix socket (no file left behind).

#![allow(dead_code, unreachable_pub)]

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::process::{Child, Command, Stdio};

/// Environment variable that carries the rendezvous name to a child.
pub const SOCKET_ENV: &str = "SHMHCA_TEST_SOCKET";

/// Starts this test binary in a child process running only the ignored helper test `name`.
pub fn spawn_helper(name: &str, envs: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.args([
        "--exact",
        name,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn helper process")
}

/// A unique abstract socket name for this process and `tag`.
pub fn socket_name(tag: &str) -> String {
    format!("shmhca-test-{tag}-{}", std::process::id())
}

/// Listens on the abstract socket `name`.
pub fn listen(name: &str) -> UnixListener {
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).expect("abstract address");
    UnixListener::bind_addr(&addr).expect("bind abstract socket")
}

/// Connects to the abstract socket `name`.
pub fn connect(name: &str) -> UnixStream {
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).expect("abstract address");
    UnixStream::connect_addr(&addr).expect("connect abstract socket")
}

/// Names of the entries of `/dev/shm` (empty if it does not exist).
pub fn dev_shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|dir| {
            dir.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect()
        })
        .unwrap_or_default()
}

/// Tries `mmap(PROT_READ|PROT_WRITE, MAP_SHARED)` of the whole file behind `fd`.
pub fn map_writable(fd: &std::os::fd::OwnedFd, len: usize) -> rustix::io::Result<()> {
    use rustix::mm::{MapFlags, ProtFlags, mmap, munmap};
    // SAFETY: a fresh mapping at an address the kernel chooses; it is unmapped right away
    // and never dereferenced.
    let p = unsafe {
        mmap(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
            fd,
            0,
        )
    }?;
    // SAFETY: `p` is the mapping just made, of `len` bytes.
    unsafe { munmap(p, len) }.expect("munmap");
    Ok(())
}

/// Maps `fd` read-only and tries to `mprotect` the mapping writable.
pub fn upgrade_to_writable(fd: &std::os::fd::OwnedFd, len: usize) -> rustix::io::Result<()> {
    use rustix::mm::{MapFlags, MprotectFlags, ProtFlags, mmap, mprotect, munmap};
    // SAFETY: a fresh read-only mapping at an address the kernel chooses, never
    // dereferenced, unmapped below.
    let p = unsafe {
        mmap(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ,
            MapFlags::SHARED,
            fd,
            0,
        )
    }
    .expect("a read-only mapping is allowed");
    // SAFETY: `p..p+len` is the mapping just made; changing its protection touches no
    // Rust object.
    let r = unsafe { mprotect(p, len, MprotectFlags::READ | MprotectFlags::WRITE) };
    // SAFETY: as above.
    unsafe { munmap(p, len) }.expect("munmap");
    r
}

/// Resident bytes of the mapping that starts at `addr`, from /proc/self/smaps.
pub fn rss_of_mapping(addr: usize) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((lo, hi)) = range.split_once('-') {
                if let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                {
                    inside = (lo..hi).contains(&addr);
                    continue;
                }
            }
        }
        if inside {
            if let Some(kb) = line.strip_prefix("Rss:") {
                return kb
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap()
                    * 1024;
            }
        }
    }
    panic!("no mapping at {addr:#x}");
}
