//! Segments without a header: an application's memfd taken over with `Segment::adopt`
//! (sealed, never written by shmhca) and mapped by a peer with `Segment::open_raw`. Every
//! refusal, what a peer can and cannot do with the shared descriptor, and that opening
//! commits nothing.

mod common;

use std::os::fd::{AsRawFd, OwnedFd};

use common::{map_writable, rss_of_mapping, upgrade_to_writable};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags, mmap, munmap};
use shmhca_rings::segment::{
    Access, AdoptError, HUGE_PAGE_LEN, OpenError, PageSize, Segment, Sharing,
};

const KIND: u32 = 0x7e58;

/// A memfd of `len` bytes (huge pages if `huge`), sealable if `sealing`.
fn memfd(len: u64, sealing: bool, huge: bool) -> rustix::io::Result<OwnedFd> {
    let mut flags = MemfdFlags::CLOEXEC;
    if sealing {
        flags |= MemfdFlags::ALLOW_SEALING;
    }
    if huge {
        flags |= MemfdFlags::HUGETLB | MemfdFlags::HUGE_2MB;
    }
    let fd = rustix::fs::memfd_create("shmhca-user", flags)?;
    rustix::fs::ftruncate(&fd, len)?;
    Ok(fd)
}

/// The application's own writable shared mapping of `fd`, made before handing it over.
struct UserMap {
    p: *mut std::ffi::c_void,
    len: usize,
}

impl UserMap {
    fn new(fd: &OwnedFd, len: usize) -> rustix::io::Result<UserMap> {
        // SAFETY: a fresh shared mapping at an address the kernel chooses; only reached
        // through `write`/`read` below, unmapped on drop.
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
        Ok(UserMap { p, len })
    }
    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: `off` is in bounds of the mapping (checked above).
        let dst = unsafe { self.p.cast::<u8>().add(off) };
        // SAFETY: `dst..dst + data.len()` lies in a writable mapping (checked above) that no
        // Rust reference covers.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) }
    }
}

impl Drop for UserMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { munmap(self.p, self.len) }.expect("munmap");
    }
}

/// Adopts a memfd the user filled through their own mapping, and checks: the bytes are at
/// offset 0 of the data area, shmhca wrote nothing, the user's mapping still writes, a
/// peer's `open_raw` of `share_fd` sees it all and can never write.
fn adopt_and_check(len: usize, huge: bool) {
    let fd = match memfd(len as u64, true, huge) {
        Ok(fd) => fd,
        Err(e) if huge => {
            eprintln!("skipped: no huge pages ({e}); echo 64 > /proc/sys/vm/nr_hugepages");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    // A hugetlb memfd is created without a page behind it; the first mapping is where the
    // kernel finds the pool empty (ENOMEM).
    let user = match UserMap::new(&fd, len) {
        Ok(user) => user,
        Err(e) if huge => {
            eprintln!("skipped: no free huge page ({e}); echo 64 > /proc/sys/vm/nr_hugepages");
            return;
        }
        Err(e) => panic!("map the memfd writable: {e}"),
    };
    user.write(0, b"user data at byte 0");
    let owner = Segment::adopt(fd, KIND, len).expect("adopt");
    assert!(!owner.has_header());
    assert_eq!(owner.data_len(), len);
    assert_eq!(owner.sharing(), Sharing::CreatorWrites);
    assert_eq!(
        owner.page_size(),
        if huge {
            PageSize::Huge2M
        } else {
            PageSize::Base4K
        }
    );
    let mut got = [0u8; 19];
    owner.read_at(0, &mut got).unwrap();
    assert_eq!(
        &got, b"user data at byte 0",
        "adopt wrote nothing over the data"
    );
    let seals = rustix::fs::fcntl_get_seals(owner.as_fd()).unwrap();
    assert!(
        seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE),
        "{seals:?}"
    );
    // The user's writable mapping, made before the seal, keeps working (on hugetlbfs too).
    user.write(4096, b"written after the seal");

    let fd = owner.share_fd().unwrap();
    assert_eq!(
        rustix::fs::fcntl_getfl(&fd).unwrap() & rustix::fs::OFlags::RWMODE,
        rustix::fs::OFlags::RDONLY
    );
    assert!(map_writable(&fd, len).is_err(), "peer mapped it writable");
    assert!(upgrade_to_writable(&fd, len).is_err(), "peer mprotected it");
    assert!(
        rustix::io::pwrite(&fd, b"x", 0).is_err(),
        "peer wrote(2) it"
    );
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    if let Ok(rw) = rustix::fs::open(
        path.as_str(),
        rustix::fs::OFlags::RDWR,
        rustix::fs::Mode::empty(),
    ) {
        assert!(
            map_writable(&rw, len).is_err(),
            "writable after a /proc reopen"
        );
        assert!(
            upgrade_to_writable(&rw, len).is_err(),
            "mprotect after reopen"
        );
        assert!(
            rustix::io::pwrite(&rw, b"x", 0).is_err(),
            "write(2) after reopen"
        );
        assert!(
            rustix::fs::ftruncate(&rw, 0).is_err(),
            "truncate after reopen"
        );
        assert!(
            rustix::fs::ftruncate(&rw, 2 * len as u64).is_err(),
            "grow after reopen"
        );
        assert!(
            rustix::fs::fallocate(
                &rw,
                rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
                0,
                len as u64,
            )
            .is_err(),
            "punch a hole after reopen"
        );
        assert!(
            rustix::fs::fcntl_add_seals(&rw, SealFlags::WRITE).is_err(),
            "F_SEAL_WRITE while shmhca's writable mapping exists"
        );
    }
    let peer = Segment::open_raw(fd, KIND, Access::ReadOnly, len).expect("open_raw");
    assert!(!peer.has_header());
    assert_eq!(peer.data_len(), len);
    assert_eq!(peer.sharing(), Sharing::CreatorWrites);
    let mut got = [0u8; 22];
    peer.read_at(4096, &mut got).unwrap();
    assert_eq!(&got, b"written after the seal");
    owner.write_at(100, b"owner").unwrap();
    let mut got = [0u8; 5];
    peer.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"owner");
}

#[test]
fn an_adopted_memfd_keeps_its_bytes_and_a_peer_can_never_write_it() {
    adopt_and_check(64 << 10, false);
}

#[test]
fn an_adopted_hugetlb_memfd_keeps_its_bytes_and_a_peer_can_never_write_it() {
    adopt_and_check(HUGE_PAGE_LEN, true);
}

fn adopt_err(fd: OwnedFd, max: usize) -> AdoptError {
    match Segment::adopt(fd, KIND, max) {
        Ok(s) => panic!("adopted: {s:?}"),
        Err(e) => {
            assert!(e.to_string().len() > 30, "{e}");
            e
        }
    }
}

#[test]
fn adopt_refuses_what_it_cannot_seal_and_leaves_it_as_it_was() {
    let sock = rustix::net::socket(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        None,
    )
    .unwrap();
    assert!(matches!(
        adopt_err(sock, 1 << 20),
        AdoptError::NotAMemfd { .. }
    ));

    let e = adopt_err(memfd(4096, false, false).unwrap(), 1 << 20);
    assert!(matches!(e, AdoptError::SealsLocked { .. }), "{e}");
    assert!(e.to_string().contains("MFD_ALLOW_SEALING"), "{e}");

    let fd = memfd(4096, true, false).unwrap();
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SEAL).unwrap();
    assert!(matches!(
        adopt_err(fd, 1 << 20),
        AdoptError::SealsLocked { .. }
    ));

    for seal in [SealFlags::WRITE, SealFlags::FUTURE_WRITE] {
        let fd = memfd(4096, true, false).unwrap();
        rustix::fs::fcntl_add_seals(&fd, seal).unwrap();
        assert!(matches!(
            adopt_err(fd, 1 << 20),
            AdoptError::WriteSealed { .. }
        ));
    }

    let fd = memfd(4096, true, false).unwrap();
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let ro = rustix::fs::open(
        path.as_str(),
        rustix::fs::OFlags::RDONLY,
        rustix::fs::Mode::empty(),
    )
    .unwrap();
    assert!(matches!(adopt_err(ro, 1 << 20), AdoptError::NotWritable));

    assert!(matches!(
        adopt_err(memfd(0, true, false).unwrap(), 1 << 20),
        AdoptError::Empty
    ));

    // Too large: refused before anything is mapped or sealed; the memfd stays resizable.
    let fd = memfd(1 << 20, true, false).unwrap();
    let dup = rustix::io::fcntl_dupfd_cloexec(&fd, 0).unwrap();
    assert!(matches!(
        adopt_err(fd, 4096),
        AdoptError::TooLarge { len, max_len: 4096 } if len == 1 << 20
    ));
    assert_eq!(
        rustix::fs::fcntl_get_seals(&dup).unwrap(),
        SealFlags::empty()
    );
    rustix::fs::ftruncate(&dup, 2 << 20).expect("a refused memfd can still be resized");
}

fn open_raw_err(fd: OwnedFd, max: usize) -> OpenError {
    match Segment::open_raw(fd, KIND, Access::ReadOnly, max) {
        Ok(s) => panic!("opened: {s:?}"),
        Err(e) => e,
    }
}

#[test]
fn open_raw_refuses_what_could_fault_or_is_larger_than_agreed() {
    let sock = rustix::net::socket(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        None,
    )
    .unwrap();
    assert!(matches!(
        open_raw_err(sock, 1 << 20),
        OpenError::NotAMemfd { .. }
    ));
    // A hostile owner that could truncate the file under the peer's mapping.
    let fd = memfd(4096, true, false).unwrap();
    let e = open_raw_err(fd, 1 << 20);
    assert!(matches!(e, OpenError::NotSealed { .. }), "{e}");
    let fd = memfd(4096, true, false).unwrap();
    rustix::fs::fcntl_add_seals(&fd, SealFlags::GROW).unwrap();
    assert!(matches!(
        open_raw_err(fd, 1 << 20),
        OpenError::NotSealed { .. }
    ));
    let fd = memfd(0, true, false).unwrap();
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK).unwrap();
    assert!(matches!(open_raw_err(fd, 1 << 20), OpenError::Empty));
    let fd = memfd(8192, true, false).unwrap();
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK).unwrap();
    let e = open_raw_err(fd, 4096);
    assert!(matches!(e, OpenError::TooLarge { len: 8192, .. }), "{e}");
    assert!(e.to_string().contains("negotiated"), "{e}");
}

#[test]
fn adopting_and_opening_a_large_sparse_memfd_commits_nothing() {
    let len = 1usize << 30;
    let owner = Segment::adopt(memfd(len as u64, true, false).unwrap(), KIND, len).unwrap();
    let peer = Segment::open_raw(owner.share_fd().unwrap(), KIND, Access::ReadOnly, len).unwrap();
    for seg in [&owner, &peer] {
        let addr = seg.data_ptr().as_ptr() as usize;
        assert!(rss_of_mapping(addr) < 1 << 20, "{seg:?} is resident");
    }
}
