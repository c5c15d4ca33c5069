//! Segment behaviour: creation with and without huge pages, rounding, zero fill, read-only
//! mappings, every OpenError, and no files left behind (even after SIGKILL).

mod common;

use std::io::{BufRead, BufReader};
use std::os::fd::{AsFd, OwnedFd};

use common::{map_writable, rss_of_mapping, upgrade_to_writable};
use rustix::fs::{MemfdFlags, SealFlags};
use shmhca_rings::segment::{
    Access, AccessError, CreateError, HEADER_LEN, HUGE_PAGE_LEN, HugePages, LAYOUT_VERSION,
    OpenError, PageSize, SEGMENT_MAGIC, Segment, Sharing,
};

const KIND: u32 = 0x7e57;

fn base(data_len: usize) -> Segment {
    Segment::builder(KIND, data_len)
        .name("shmhca-test")
        .huge_pages(HugePages::Never)
        .create()
        .expect("create a 4 KiB-page segment")
}

fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines().find_map(|l| {
        l.strip_prefix(field)?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// The permission string /proc/self/maps shows for the mapping that contains `addr`.
fn maps_perms(addr: usize) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for line in maps.lines() {
        let mut parts = line.split_whitespace();
        let range = parts.next().unwrap();
        let perms = parts.next().unwrap();
        let (lo, hi) = range.split_once('-').unwrap();
        let (lo, hi) = (
            usize::from_str_radix(lo, 16).unwrap(),
            usize::from_str_radix(hi, 16).unwrap(),
        );
        if (lo..hi).contains(&addr) {
            return perms.to_owned();
        }
    }
    panic!("address {addr:#x} is not mapped");
}

#[test]
fn base_pages_round_up_and_are_zero_filled() {
    let seg = base(10_000);
    assert_eq!(seg.page_size(), PageSize::Base4K);
    assert_eq!(seg.kind(), KIND);
    assert_eq!(seg.access(), Access::ReadWrite);
    // 4096 header + 10000 data rounded to 4 KiB pages = 16384 in all.
    assert_eq!(seg.data_len(), 16384 - HEADER_LEN);
    assert_eq!(
        seg.data_ptr().as_ptr() as usize % 4096,
        0,
        "data is page-aligned"
    );
    let mut all = vec![0xAAu8; seg.data_len()];
    seg.read_at(0, &mut all).unwrap();
    assert!(all.iter().all(|&b| b == 0), "a new segment is zero-filled");
}

#[test]
fn exact_page_multiple_is_not_rounded_further() {
    let seg = base(4096 * 3);
    assert_eq!(seg.data_len(), 4096 * 3);
}

#[test]
fn bad_create_arguments_are_typed_errors() {
    assert!(matches!(
        Segment::builder(KIND, 0).create(),
        Err(CreateError::ZeroLength)
    ));
    let long = "x".repeat(300);
    assert!(matches!(
        Segment::builder(KIND, 1).name(&long).create(),
        Err(CreateError::InvalidName { .. })
    ));
    assert!(matches!(
        Segment::builder(KIND, 1).name("a\0b").create(),
        Err(CreateError::InvalidName { .. })
    ));
    assert!(matches!(
        Segment::builder(KIND, usize::MAX - 10)
            .huge_pages(HugePages::Never)
            .create(),
        Err(CreateError::TooLarge { .. })
    ));
}

/// Passes with or without reserved huge pages; run once with
/// `echo 64 > /proc/sys/vm/nr_hugepages` to exercise the hugetlb path.
#[test]
fn huge_pages_when_reserved_else_a_clear_error() {
    let free_before = meminfo("HugePages_Free:").unwrap_or(0);
    match Segment::builder(KIND, 100)
        .huge_pages(HugePages::Require)
        .create()
    {
        Ok(seg) => {
            assert_eq!(seg.page_size(), PageSize::Huge2M);
            assert_eq!(
                seg.data_len(),
                HUGE_PAGE_LEN - HEADER_LEN,
                "rounded to one 2 MiB page"
            );
            let mut all = vec![1u8; seg.data_len()];
            seg.read_at(0, &mut all).unwrap();
            assert!(all.iter().all(|&b| b == 0), "huge pages are zero-filled");
            seg.write_at(123, b"huge").unwrap();
            // The opener sees hugetlbfs too, and the same bytes.
            let peer = Segment::open(
                seg.try_clone_fd().unwrap(),
                KIND,
                Access::ReadOnly,
                usize::MAX,
            )
            .unwrap();
            assert_eq!(peer.page_size(), PageSize::Huge2M);
            let mut four = [0u8; 4];
            peer.read_at(123, &mut four).unwrap();
            assert_eq!(&four, b"huge");
            eprintln!("hugetlb path exercised ({free_before} huge pages were free)");
        }
        Err(err @ CreateError::HugePagesUnavailable { .. }) => {
            let text = err.to_string();
            assert!(
                text.contains("nr_hugepages"),
                "the error says how to reserve huge pages: {text}"
            );
            eprintln!("no huge pages ({free_before} free): {text}");
        }
        Err(other) => panic!("unexpected error: {other}"),
    }
}

#[test]
fn auto_falls_back_and_reports_what_it_got() {
    let seg = Segment::builder(KIND, 5000)
        .create()
        .expect("Auto never fails for lack of huge pages");
    let page = seg.page_size().bytes();
    assert_eq!((seg.data_len() + HEADER_LEN) % page, 0);
    assert!(seg.data_len() >= 5000);
    if meminfo("HugePages_Total:") == Some(0) {
        assert_eq!(
            seg.page_size(),
            PageSize::Base4K,
            "no huge pages exist, so none were used"
        );
    }
    let never = Segment::builder(KIND, 5000)
        .huge_pages(HugePages::Never)
        .create()
        .unwrap();
    assert_eq!(never.page_size(), PageSize::Base4K);
}

#[test]
fn read_only_peer_reads_what_the_owner_wrote_and_cannot_write() {
    let owner = base(8192);
    owner.write_at(100, b"hello, peer").unwrap();
    let peer = Segment::open(
        owner.try_clone_fd().unwrap(),
        KIND,
        Access::ReadOnly,
        usize::MAX,
    )
    .unwrap();
    assert_eq!(peer.access(), Access::ReadOnly);
    assert_eq!(peer.data_len(), owner.data_len());
    assert_eq!(peer.kind(), KIND);
    let mut buf = [0u8; 11];
    peer.read_at(100, &mut buf).unwrap();
    assert_eq!(&buf, b"hello, peer");
    // Later writes by the owner are visible through the peer's mapping (same pages).
    owner.write_at(100, b"HELLO").unwrap();
    peer.read_at(100, &mut buf).unwrap();
    assert_eq!(&buf, b"HELLO, peer");
    // The API refuses writes, and the pages really are mapped without write permission.
    assert_eq!(peer.write_at(0, b"x"), Err(AccessError::ReadOnly));
    let peer_perms = maps_perms(peer.data_ptr().as_ptr() as usize);
    assert_eq!(peer_perms, "r--s", "read-only mapping must lack PROT_WRITE");
    let owner_perms = maps_perms(owner.data_ptr().as_ptr() as usize);
    assert_eq!(owner_perms, "rw-s");
}

#[test]
fn read_write_reopen_shares_memory() {
    let owner = base(4096);
    let other = Segment::open(
        owner.try_clone_fd().unwrap(),
        KIND,
        Access::ReadWrite,
        usize::MAX,
    )
    .unwrap();
    other.write_at(4090, b"from the other mapping").unwrap_err(); // past the end
    other.write_at(4000, b"from other").unwrap();
    drop(owner); // the other mapping stays valid on its own
    let mut buf = [0u8; 10];
    other.read_at(4000, &mut buf).unwrap();
    assert_eq!(&buf, b"from other");
}

#[test]
fn out_of_bounds_access_is_an_error() {
    let seg = base(4096);
    let mut buf = [0u8; 8];
    assert!(matches!(
        seg.read_at(4090, &mut buf),
        Err(AccessError::OutOfBounds { .. })
    ));
    assert!(matches!(
        seg.read_at(usize::MAX, &mut buf),
        Err(AccessError::OutOfBounds { .. })
    ));
    assert!(matches!(
        seg.write_at(4096, b"x"),
        Err(AccessError::OutOfBounds { .. })
    ));
    seg.read_at(4088, &mut buf).unwrap();
}

// ---- crafted descriptors, one per OpenError -------------------------------------------

struct Header {
    magic: u64,
    version: u32,
    kind: u32,
    header_len: u64,
    data_len: u64,
    total_len: u64,
}

impl Header {
    fn valid(total_len: u64) -> Self {
        Header {
            magic: SEGMENT_MAGIC,
            version: LAYOUT_VERSION,
            kind: KIND,
            header_len: HEADER_LEN as u64,
            data_len: total_len - HEADER_LEN as u64,
            total_len,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&self.magic.to_ne_bytes());
        b.extend_from_slice(&self.version.to_ne_bytes());
        b.extend_from_slice(&self.kind.to_ne_bytes());
        b.extend_from_slice(&self.header_len.to_ne_bytes());
        b.extend_from_slice(&self.data_len.to_ne_bytes());
        b.extend_from_slice(&self.total_len.to_ne_bytes());
        b.extend_from_slice(&4096u64.to_ne_bytes());
        b
    }
}

/// A memfd of `len` bytes holding `header`, sealed against shrinking if `seal`.
fn crafted(len: u64, header: Option<Header>, sealing: bool, seal: bool) -> OwnedFd {
    let mut flags = MemfdFlags::CLOEXEC;
    if sealing {
        flags |= MemfdFlags::ALLOW_SEALING;
    }
    let fd = rustix::fs::memfd_create("shmhca-crafted", flags).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    if let Some(h) = header {
        let bytes = h.bytes();
        assert_eq!(rustix::io::pwrite(&fd, &bytes, 0).unwrap(), bytes.len());
    }
    if seal {
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .unwrap();
    }
    fd
}

fn open_err(fd: OwnedFd) -> OpenError {
    match Segment::open(fd, KIND, Access::ReadWrite, usize::MAX) {
        Ok(seg) => panic!("crafted descriptor was accepted: {seg:?}"),
        Err(e) => {
            // Every error explains itself.
            assert!(e.to_string().len() > 20, "{e}");
            e
        }
    }
}

#[test]
fn a_well_crafted_memfd_opens() {
    // The control for every case below: the same construction with nothing wrong opens.
    let seg = Segment::open(
        crafted(8192, Some(Header::valid(8192)), true, true),
        KIND,
        Access::ReadWrite,
        usize::MAX,
    )
    .expect("a valid crafted segment opens");
    assert_eq!(seg.data_len(), 4096);
}

#[test]
fn not_a_memfd() {
    let (r, _w) = std::io::pipe().unwrap();
    assert!(matches!(open_err(r.into()), OpenError::NotAMemfd { .. }));
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    assert!(matches!(open_err(a.into()), OpenError::NotAMemfd { .. }));
}

#[test]
fn unsealed_memfds_are_refused() {
    // Created without MFD_ALLOW_SEALING, and with it but never sealed.
    let e = open_err(crafted(8192, Some(Header::valid(8192)), false, false));
    assert!(matches!(e, OpenError::NotSealed { .. }), "{e}");
    let e = open_err(crafted(8192, Some(Header::valid(8192)), true, false));
    assert!(matches!(e, OpenError::NotSealed { .. }), "{e}");
}

#[test]
fn too_small_for_a_header() {
    let e = open_err(crafted(100, None, true, true));
    assert!(matches!(e, OpenError::TooSmall { len: 100 }), "{e}");
    let e = open_err(crafted(0, None, true, true));
    assert!(matches!(e, OpenError::TooSmall { len: 0 }), "{e}");
}

#[test]
fn not_a_segment() {
    let e = open_err(crafted(8192, None, true, true));
    assert!(matches!(e, OpenError::NotASegment { found: 0 }), "{e}");
}

#[test]
fn wrong_version() {
    let mut h = Header::valid(8192);
    h.version = LAYOUT_VERSION + 1;
    let e = open_err(crafted(8192, Some(h), true, true));
    assert!(
        matches!(e, OpenError::VersionMismatch { found, expected } if found == LAYOUT_VERSION + 1 && expected == LAYOUT_VERSION),
        "{e}"
    );
}

#[test]
fn wrong_kind() {
    let seg = base(4096);
    let e = Segment::open(
        seg.try_clone_fd().unwrap(),
        KIND + 1,
        Access::ReadOnly,
        usize::MAX,
    )
    .unwrap_err();
    assert!(
        matches!(e, OpenError::WrongKind { expected, found } if expected == KIND + 1 && found == KIND),
        "{e}"
    );
}

#[test]
fn bad_header_len() {
    let mut h = Header::valid(8192);
    h.header_len = 64;
    assert!(matches!(
        open_err(crafted(8192, Some(h), true, true)),
        OpenError::BadHeaderLen { found: 64 }
    ));
}

#[test]
fn truncated_or_wrong_size() {
    // The header claims 16 KiB, the memfd holds 8 KiB (truncated before it was sealed).
    let e = open_err(crafted(8192, Some(Header::valid(16384)), true, true));
    assert!(
        matches!(
            e,
            OpenError::SizeMismatch {
                header_total: 16384,
                file_len: 8192
            }
        ),
        "{e}"
    );
    // And larger than the header says.
    let e = open_err(crafted(16384, Some(Header::valid(8192)), true, true));
    assert!(
        matches!(
            e,
            OpenError::SizeMismatch {
                header_total: 8192,
                file_len: 16384
            }
        ),
        "{e}"
    );
}

#[test]
fn data_len_past_the_end() {
    let mut h = Header::valid(8192);
    h.data_len = 8192;
    let e = open_err(crafted(8192, Some(h), true, true));
    assert!(
        matches!(
            e,
            OpenError::DataLenTooLarge {
                data_len: 8192,
                total_len: 8192
            }
        ),
        "{e}"
    );
    let mut h = Header::valid(8192);
    h.data_len = u64::MAX;
    assert!(matches!(
        open_err(crafted(8192, Some(h), true, true)),
        OpenError::DataLenTooLarge { .. }
    ));
}

#[test]
fn segments_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Segment>();
    let seg = std::sync::Arc::new(base(4096));
    let s2 = std::sync::Arc::clone(&seg);
    std::thread::spawn(move || s2.write_at(0, b"t").unwrap())
        .join()
        .unwrap();
    let mut b = [0u8; 1];
    seg.read_at(0, &mut b).unwrap();
    assert_eq!(&b, b"t");
    assert!(seg.as_fd().try_clone_to_owned().is_ok());
}

// ---- nothing left behind ----------------------------------------------------------------

const LEAK_NAME_ENV: &str = "SHMHCA_TEST_LEAK_NAME";

#[test]
#[ignore = "helper: run in a child process by no_files_left_behind_even_after_sigkill"]
fn helper_create_segments_then_wait() {
    let name = std::env::var(LEAK_NAME_ENV).expect("run by the parent test");
    let segs: Vec<Segment> = (0..4)
        .map(|i| {
            Segment::builder(KIND, 4096 << i)
                .name(&name)
                .huge_pages(if i % 2 == 0 {
                    HugePages::Auto
                } else {
                    HugePages::Never
                })
                .create()
                .unwrap()
        })
        .collect();
    println!("\nSHMHCA-READY {}", segs.len());
    std::thread::sleep(std::time::Duration::from_secs(60));
    unreachable!("the parent kills this process");
}

#[test]
fn no_files_left_behind_even_after_sigkill() {
    let name = format!("shmhca-leak-{}", std::process::id());
    let leaked = |entries: Vec<String>| {
        entries
            .into_iter()
            .filter(|e| e.contains(&name))
            .collect::<Vec<_>>()
    };

    // In this process.
    let segs: Vec<Segment> = (0..3)
        .map(|_| Segment::builder(KIND, 4096).name(&name).create().unwrap())
        .collect();
    assert_eq!(leaked(common::dev_shm_entries()), Vec::<String>::new());
    drop(segs);

    // In a child that is killed with SIGKILL while it holds segments.
    let mut child = common::spawn_helper(
        "helper_create_segments_then_wait",
        &[(LEAK_NAME_ENV, name.clone())],
    );
    let mut line = String::new();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    while !line.contains("SHMHCA-READY") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "helper ended before creating its segments"
        );
    }
    // The child really holds memfds by that name...
    let fds: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", child.id()))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.to_string_lossy().into_owned())
        .filter(|p| p.contains(&name))
        .collect();
    assert_eq!(fds.len(), 4, "the child holds its four memfds: {fds:?}");
    assert!(fds.iter().all(|p| p.starts_with("/memfd:")), "{fds:?}");
    assert_eq!(leaked(common::dev_shm_entries()), Vec::<String>::new());
    // ...and after SIGKILL nothing of them remains anywhere we can see.
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success());
    assert_eq!(leaked(common::dev_shm_entries()), Vec::<String>::new());
    let tmp: Vec<String> = std::fs::read_dir(std::env::temp_dir())
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(leaked(tmp), Vec::<String>::new());
}

// ---- What a peer can do with a CreatorWrites segment's descriptor ----

fn creator_writes(data_len: usize, huge: HugePages) -> Segment {
    Segment::builder(KIND, data_len)
        .name("shmhca-test-ro")
        .huge_pages(huge)
        .sharing(Sharing::CreatorWrites)
        .create()
        .expect("create a creator-writes segment")
}

fn assert_peer_cannot_write(owner: &Segment) {
    let len = owner.data_len() + HEADER_LEN;
    let fd = owner.share_fd().expect("share_fd");
    assert!(
        map_writable(&fd, len).is_err(),
        "a peer mapped the shared descriptor writable"
    );
    assert!(
        upgrade_to_writable(&fd, len).is_err(),
        "a peer upgraded a read-only mapping to writable"
    );
    assert!(
        rustix::io::pwrite(&fd, b"x", HEADER_LEN as u64).is_err(),
        "write(2) through the shared descriptor"
    );
    // The same user can reopen any descriptor it holds through /proc with more rights;
    // the seal still refuses every writable use of the memfd.
    let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd));
    if let Ok(rw) = rustix::fs::open(
        path.as_str(),
        rustix::fs::OFlags::RDWR,
        rustix::fs::Mode::empty(),
    ) {
        assert!(
            map_writable(&rw, len).is_err(),
            "writable mapping after a /proc reopen"
        );
        assert!(
            upgrade_to_writable(&rw, len).is_err(),
            "mprotect after a /proc reopen"
        );
        assert!(
            rustix::io::pwrite(&rw, b"x", HEADER_LEN as u64).is_err(),
            "write(2) after a /proc reopen"
        );
        assert!(
            rustix::fs::fallocate(
                &rw,
                rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
                HEADER_LEN as u64,
                4096,
            )
            .is_err(),
            "punching a hole (zeroing the owner's pages) after a /proc reopen"
        );
        assert!(
            rustix::fs::ftruncate(&rw, 0).is_err(),
            "truncating after a /proc reopen"
        );
    }
    // The opener's API maps it read-only; the owner's own mapping still writes, and the
    // peer sees it.
    let peer = Segment::open(fd, KIND, Access::ReadOnly, owner.data_len()).unwrap();
    assert_eq!(peer.sharing(), Sharing::CreatorWrites);
    owner.write_at(64, b"owner writes").unwrap();
    let mut got = [0u8; 12];
    peer.read_at(64, &mut got).unwrap();
    assert_eq!(&got, b"owner writes");
}

#[test]
fn a_peer_can_never_write_a_creator_writes_segment() {
    assert_peer_cannot_write(&creator_writes(1 << 20, HugePages::Never));
}

#[test]
fn a_peer_can_never_write_a_creator_writes_segment_on_huge_pages() {
    match Segment::builder(KIND, 100)
        .huge_pages(HugePages::Require)
        .sharing(Sharing::CreatorWrites)
        .create()
    {
        Ok(seg) => assert_peer_cannot_write(&seg),
        Err(CreateError::HugePagesUnavailable { .. }) => {
            eprintln!("skipped: no huge pages reserved (echo 64 > /proc/sys/vm/nr_hugepages)")
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn the_shared_descriptor_of_a_creator_writes_segment_is_read_only() {
    let owner = creator_writes(4096, HugePages::Never);
    let fd = owner.share_fd().unwrap();
    let flags = rustix::fs::fcntl_getfl(&fd).unwrap();
    assert_eq!(
        flags & rustix::fs::OFlags::RWMODE,
        rustix::fs::OFlags::RDONLY,
        "share_fd hands out an O_RDONLY reopen"
    );
    // A read-write segment (a link's rings) stays writable for the peer.
    let rw = base(4096);
    let fd = rw.share_fd().unwrap();
    map_writable(&fd, 8192).expect("a ReadWrite segment can be mapped writable");
}

#[test]
fn open_refuses_a_segment_larger_than_the_caller_accepts() {
    let seg = base(1 << 20);
    let e = Segment::open(seg.try_clone_fd().unwrap(), KIND, Access::ReadOnly, 4096).unwrap_err();
    assert!(matches!(e, OpenError::TooLarge { .. }), "{e}");
    assert!(e.to_string().contains("negotiated"), "{e}");
    Segment::open(seg.try_clone_fd().unwrap(), KIND, Access::ReadOnly, 1 << 20)
        .expect("the agreed size opens");
}

#[test]
fn opening_a_huge_sparse_segment_commits_nothing() {
    // A peer offers 4 GiB it never touched; opening it must not fault it in (the old
    // open populated it and the victim was OOM-killed).
    let sparse = Segment::builder(KIND, 4 << 30)
        .huge_pages(HugePages::Never)
        .populate(false)
        .create()
        .unwrap();
    let peer = Segment::open(
        sparse.try_clone_fd().unwrap(),
        KIND,
        Access::ReadOnly,
        4 << 30,
    )
    .unwrap();
    let addr = peer.data_ptr().as_ptr() as usize;
    assert!(
        rss_of_mapping(addr) < 1 << 20,
        "the opener's mapping is resident: {} bytes",
        rss_of_mapping(addr)
    );
}
