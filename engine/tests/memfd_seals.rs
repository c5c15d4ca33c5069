//! A registered memfd keeps its size (issue 24, item 4): `Memfd::map` seals the file against
//! shrinking and growing, so another holder of it cannot truncate it under the region and
//! make the next write into it (a peer's RDMA Write, a receive) kill this process with
//! `SIGBUS`; a file that cannot take the seals is refused with a message saying what to do;
//! a hugetlbfs file larger than the free huge-page pool is refused at registration instead
//! of faulting later.
//!
//! The truncation test runs its dangerous part in a child process (this test binary again,
//! with [`CHILD_ENV`] set), so that on a build without the seal the `SIGBUS` kills the child
//! and the parent reports it, instead of killing the test harness.
mod common;

use std::os::fd::OwnedFd;
use std::process::{Command, Stdio};

use rustix::fs::{MemfdFlags, SealFlags};
use shmhca::*;

const CHILD_ENV: &str = "SHMHCA_MEMFD_SEALS_CHILD";
const LEN: usize = 64 << 10;

fn memfd(len: u64, flags: MemfdFlags) -> OwnedFd {
    let fd = rustix::fs::memfd_create("shmhca-seal-test", MemfdFlags::CLOEXEC | flags).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    fd
}

/// Runs this test binary's test `name` again as a child, with [`CHILD_ENV`] set; returns
/// whether it exited successfully and what it printed.
fn run_child(name: &str) -> (std::process::ExitStatus, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::null())
        .output()
        .expect("re-running the test binary");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, text)
}

/// In the child: registers a memfd, lets "another holder" (a second descriptor of the same
/// file) truncate it, then writes into the region as a peer's RDMA Write would. Before
/// registration sealed the file, the truncation succeeded and the write died of `SIGBUS`.
fn truncate_then_write() {
    let ctx = common::context(1 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let fd = memfd(LEN as u64, MemfdFlags::ALLOW_SEALING);
    let other_holder = fd.try_clone().unwrap();
    let mr = pd
        .reg_mr(Memfd::map(fd).unwrap(), AccessFlags::ALL)
        .unwrap();
    match rustix::fs::ftruncate(&other_holder, 0) {
        Err(e) => {
            assert_eq!(e, rustix::io::Errno::PERM, "truncation refused, but why?");
            println!("TRUNCATE-REFUSED");
        }
        Ok(()) => println!("TRUNCATE-ALLOWED"),
    }
    mr.write_at(LEN as u64 - 8, &[0xab; 8]).unwrap();
    let mut back = [0u8; 8];
    mr.read_at(LEN as u64 - 8, &mut back).unwrap();
    assert_eq!(back, [0xab; 8]);
    println!("WRITE-SURVIVED");
    // Growing is refused too (a grown file is harmless to this mapping, but the size a
    // registration saw is the size for good).
    assert_eq!(
        rustix::fs::ftruncate(&other_holder, 2 * LEN as u64),
        Err(rustix::io::Errno::PERM)
    );
}

#[test]
fn another_holder_cannot_truncate_a_registered_memfd() {
    if std::env::var_os(CHILD_ENV).is_some() {
        truncate_then_write();
        return;
    }
    let (status, out) = run_child("another_holder_cannot_truncate_a_registered_memfd");
    assert!(
        status.success() && out.contains("TRUNCATE-REFUSED") && out.contains("WRITE-SURVIVED"),
        "the child that truncated a registered memfd and wrote into it ended with {status} \
         (SIGBUS is signal 7): {out}"
    );
}

#[test]
fn a_memfd_that_cannot_be_sealed_is_refused_with_what_to_do() {
    // Created without MFD_ALLOW_SEALING: the kernel sets F_SEAL_SEAL.
    let err = Memfd::map(memfd(LEN as u64, MemfdFlags::empty())).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{msg}");
    assert!(msg.contains("MFD_ALLOW_SEALING"), "{msg}");
    assert!(msg.contains("descriptor"), "{msg}");
    // Not a memfd at all: a regular file takes no seals.
    let dir = std::env::temp_dir();
    let file = tempfile_in(&dir);
    let err = Memfd::map(file).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("not a memfd"), "{msg}");
    assert!(msg.contains("MFD_ALLOW_SEALING"), "{msg}");
    // Seals locked by the application after creation.
    let fd = memfd(LEN as u64, MemfdFlags::ALLOW_SEALING);
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SEAL).unwrap();
    let err = Memfd::map(fd).unwrap_err();
    assert!(err.to_string().contains("F_SEAL_SEAL"), "{err}");
    // A read-only reopen cannot be sealed (nor mapped read-write).
    let fd = memfd(LEN as u64, MemfdFlags::ALLOW_SEALING);
    let ro = rustix::fs::open(
        format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd)).as_str(),
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .unwrap();
    let err = Memfd::map(ro).unwrap_err();
    assert!(err.to_string().contains("read-write descriptor"), "{err}");
    // A memfd already sealed against shrinking and growing (by the application) is fine.
    let fd = memfd(LEN as u64, MemfdFlags::ALLOW_SEALING);
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
        .unwrap();
    assert_eq!(Memfd::map(fd).unwrap().len(), LEN);
}

/// A regular (unlinked) file in `dir`, 64 KiB long.
fn tempfile_in(dir: &std::path::Path) -> OwnedFd {
    let fd = rustix::fs::open(
        dir,
        rustix::fs::OFlags::TMPFILE | rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .or_else(|_| {
        let path = dir.join(format!("shmhca-seal-test-{}", std::process::id()));
        let f = std::fs::File::create(&path).map(OwnedFd::from);
        let _ = std::fs::remove_file(&path);
        f.map_err(|e| rustix::io::Errno::from_io_error(&e).unwrap_or(rustix::io::Errno::IO))
    })
    .unwrap();
    rustix::fs::ftruncate(&fd, LEN as u64).unwrap();
    fd
}

/// Free 2 MiB huge pages, or `None` (with one line saying why the test skips).
fn free_huge_pages(test: &str) -> Option<u64> {
    let pool = shmhca_rings::segment::HugePagePool::read();
    match pool.free {
        Some(free) if free > 0 && pool.size_kib == Some(2048) => Some(free),
        _ => {
            eprintln!(
                "{test}: skipped: no free 2 MiB huge pages (reserve some with \
                 `echo 64 > /proc/sys/vm/nr_hugepages`)"
            );
            None
        }
    }
}

#[test]
fn a_hugetlb_memfd_larger_than_the_free_pool_is_refused_at_registration() {
    let Some(free) =
        free_huge_pages("a_hugetlb_memfd_larger_than_the_free_pool_is_refused_at_registration")
    else {
        return;
    };
    let total = shmhca_rings::segment::HugePagePool::read()
        .total
        .unwrap_or(free);
    // One page more than the whole pool: no other process can make that fit.
    let len = (total + 1) * (2 << 20);
    let fd = memfd(len, MemfdFlags::ALLOW_SEALING | MemfdFlags::HUGETLB);
    let err = Memfd::map(fd).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("huge pages"), "{msg}");
    assert!(msg.contains("nr_hugepages"), "{msg}");
    // One page fits (if another process has not just taken the last one): registered,
    // reserved, and written to its last byte without a fault.
    let fd = memfd(2 << 20, MemfdFlags::ALLOW_SEALING | MemfdFlags::HUGETLB);
    match Memfd::map(fd) {
        Ok(m) => {
            let ctx = common::context(4 << 20);
            let pd = ctx.alloc_pd().unwrap();
            let mr = pd.reg_mr(m, AccessFlags::ALL).unwrap();
            mr.write_at((2 << 20) - 1, &[7]).unwrap();
        }
        Err(e) => eprintln!("one huge page was not free any more ({e}); the refusal was checked"),
    }
}

/// An application's hugetlbfs memfd given to `alloc_pd_over` is reserved whole when it is
/// adopted: one larger than the pool is refused there, saying so.
#[test]
fn a_hugetlb_memfd_domain_larger_than_the_pool_is_refused_at_adoption() {
    let Some(free) =
        free_huge_pages("a_hugetlb_memfd_domain_larger_than_the_pool_is_refused_at_adoption")
    else {
        return;
    };
    let total = shmhca_rings::segment::HugePagePool::read()
        .total
        .unwrap_or(free);
    let fd = memfd(
        (total + 1) * (2 << 20),
        MemfdFlags::ALLOW_SEALING | MemfdFlags::HUGETLB,
    );
    let ctx = common::context(1 << 20);
    let err = ctx
        .alloc_pd_over(fd, 1 << 20)
        .expect_err("larger than the pool");
    let msg = err.to_string();
    assert!(msg.contains("huge pages"), "{msg}");
    assert!(msg.contains("nr_hugepages"), "{msg}");
}

/// A huge-page arena reserves its pages when it is created (the creator's shared mapping,
/// no `MAP_NORESERVE`), even unpopulated: with `HugePages::Require` an arena larger than the
/// pool is an error at creation naming the pool, never a `SIGBUS` when a page is first used.
#[test]
fn a_huge_page_arena_larger_than_the_pool_is_refused_at_creation() {
    let Some(free) =
        free_huge_pages("a_huge_page_arena_larger_than_the_pool_is_refused_at_creation")
    else {
        return;
    };
    let total = shmhca_rings::segment::HugePagePool::read()
        .total
        .unwrap_or(free);
    let ctx = Context::builder()
        .arena_size((total + 1) * (2 << 20))
        .huge_pages(shmhca_rings::HugePages::Require)
        .mode(EngineMode::Inline)
        .progress(Progress::Manual)
        .build()
        .unwrap();
    let err = ctx
        .alloc_pd()
        .expect_err("an arena larger than the whole huge-page pool");
    let msg = err.to_string();
    assert!(msg.contains("nr_hugepages"), "{msg}");
}
