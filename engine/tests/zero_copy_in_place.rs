//! `Pd::reg_mr_in_place`: a page-aligned buffer of whole pages moved onto the domain's
//! arena in place (its pages become the arena block's, at the same address), so Sends,
//! RDMA Writes and a peer's RDMA Reads take its bytes with no shadow copy; dropping the
//! region gives the program private memory back, with the bytes it held.
mod common;

use common::*;
use memmap2::MmapMut;
use shmhca::*;

const PAGE: usize = 4096;
const LEN: usize = 4 * PAGE;

/// The line of `/proc/self/maps` of the mapping holding `addr`.
fn mapping_of(addr: usize) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .find(|l| {
            let range = l.split_whitespace().next().unwrap();
            let (lo, hi) = range.split_once('-').unwrap();
            let lo = usize::from_str_radix(lo, 16).unwrap();
            let hi = usize::from_str_radix(hi, 16).unwrap();
            (lo..hi).contains(&addr)
        })
        .unwrap_or_else(|| panic!("no mapping holds {addr:#x}"))
        .to_owned()
}

fn params() -> Params {
    Params {
        arena: 4 << 20,
        mtu: Mtu::Mtu1024,
        ..Params::default()
    }
}

/// Writes `data` at `off` of the program's buffer through its own pointer (as a C program
/// would, after registration).
fn poke(base: *mut u8, off: usize, data: &[u8]) {
    assert!(off + data.len() <= LEN);
    // SAFETY: inside the test's mapping of LEN bytes, which it owns.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), base.wrapping_add(off), data.len()) };
}

fn peek(base: *const u8, off: usize, len: usize) -> Vec<u8> {
    assert!(off + len <= LEN);
    let mut v = vec![0u8; len];
    // SAFETY: as in `poke`.
    unsafe { std::ptr::copy_nonoverlapping(base.wrapping_add(off), v.as_mut_ptr(), len) };
    v
}

#[test]
fn send_write_and_read_take_the_programs_pages_with_no_shadow() {
    let mut p = pair(&params());
    let mut buf = MmapMut::map_anon(LEN).unwrap();
    let base = buf.as_mut_ptr();
    let before = pattern(LEN, 3);
    poke(base, 0, &before);
    assert!(!mapping_of(base as usize).contains("shmhca-arena"));

    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    // SAFETY: the test owns the mapping, keeps it mapped past the region, and touches it
    // only through `poke`/`peek` on this thread.
    let mr = unsafe { p.a.pd.reg_mr_in_place(base, LEN as u64, access) }.unwrap();
    assert_eq!(
        mr.addr(),
        base as u64,
        "the region keeps the program's address"
    );
    assert_eq!(mr.len(), LEN as u64);
    // The bytes moved with the pages, and the pages are now the arena's.
    assert_eq!(peek(base, 0, LEN), before);
    let map = mapping_of(base as usize);
    assert!(map.contains("shmhca-arena"), "not the arena's pages: {map}");

    let dst =
        p.b.pd
            .alloc_mr(
                LEN as u64,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            )
            .unwrap();
    let back =
        p.b.pd
            .alloc_mr(LEN as u64, AccessFlags::LOCAL_WRITE)
            .unwrap();

    // Send from the program's buffer.
    p.b.qp
        .post_recv(&RecvWr::new(1, &[dst.as_sge().unwrap()]))
        .unwrap();
    p.a.qp
        .post_send(&SendWr::new(
            1,
            SendOp::Send,
            &[mr.sge(0, LEN as u32).unwrap()],
        ))
        .unwrap();
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    let wc = wait_b(&mut p, 1);
    assert_eq!(wc[0].status, WcStatus::Success);
    let mut got = vec![0u8; LEN];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, before, "Send");

    // RDMA Write of bytes the program wrote after registration.
    let fresh = pattern(PAGE, 77);
    poke(base, PAGE, &fresh);
    p.a.qp
        .post_send(&SendWr::new(
            2,
            SendOp::RdmaWrite(dst.remote(0)),
            &[mr.sge(PAGE as u64, PAGE as u32).unwrap()],
        ))
        .unwrap();
    assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
    let mut got = vec![0u8; PAGE];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, fresh, "RDMA Write");

    // The peer reads the program's buffer; then the program writes, and the peer's next
    // Read sees the new bytes.
    for round in 0..2u8 {
        let now = pattern(LEN, 100 + round);
        poke(base, 0, &now);
        p.b.qp
            .post_send(&SendWr::new(
                10 + u64::from(round),
                SendOp::RdmaRead(mr.remote(0)),
                &[back.as_sge().unwrap()],
            ))
            .unwrap();
        assert_eq!(wait_b(&mut p, 1)[0].status, WcStatus::Success);
        let mut got = vec![0u8; LEN];
        back.read_at(0, &mut got).unwrap();
        assert_eq!(got, now, "RDMA Read, round {round}");
    }

    // The peer writes into the program's buffer: the program sees it through its pointer.
    let theirs = pattern(PAGE, 200);
    dst.write_at(0, &theirs).unwrap();
    p.b.qp
        .post_send(&SendWr::new(
            20,
            SendOp::RdmaWrite(mr.remote(2 * PAGE as u64)),
            &[dst.sge(0, PAGE as u32).unwrap()],
        ))
        .unwrap();
    assert_eq!(wait_b(&mut p, 1)[0].status, WcStatus::Success);
    assert_eq!(peek(base, 2 * PAGE, PAGE), theirs);

    // Dropping the region gives private memory back, with its bytes, still writable.
    let last = peek(base, 0, LEN);
    let free = p.a.pd.arena_free();
    mr.deregister().unwrap();
    assert!(
        p.a.pd.arena_free() > free,
        "the block went back to the arena"
    );
    let map = mapping_of(base as usize);
    assert!(
        !map.contains("shmhca-arena"),
        "still the arena's pages: {map}"
    );
    assert_eq!(peek(base, 0, LEN), last, "the bytes stayed");
    poke(base, 5, b"still mine");
    assert_eq!(&buf[5..15], b"still mine");
}

#[test]
fn dropping_restores_private_memory_and_the_arena_forgets_the_bytes() {
    let p = pair(&params());
    let mut buf = MmapMut::map_anon(LEN).unwrap();
    let base = buf.as_mut_ptr();
    let data = pattern(LEN, 9);
    poke(base, 0, &data);
    let free = p.a.pd.arena_free();
    // SAFETY: as in the test above.
    let mr = unsafe {
        p.a.pd
            .reg_mr_in_place(base, LEN as u64, AccessFlags::LOCAL_WRITE)
    }
    .unwrap();
    assert_eq!(p.a.pd.arena_free(), free - LEN as u64);
    poke(base, 100, b"after");
    let mut seen = [0u8; 5];
    mr.read_at(100, &mut seen).unwrap();
    assert_eq!(&seen, b"after", "the region's bytes are the program's");
    drop(mr);
    assert_eq!(p.a.pd.arena_free(), free);
    let mut want = data.clone();
    want[100..105].copy_from_slice(b"after");
    assert_eq!(&buf[..], &want[..]);
    // Private again: a write does not reach the arena (a new region there is zeroed and
    // the old bytes are not in it).
    buf[0] = 0xEE;
    let again =
        p.a.pd
            .alloc_mr(LEN as u64, AccessFlags::LOCAL_WRITE)
            .unwrap();
    let mut got = vec![1u8; LEN];
    again.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0));
    assert!(!mapping_of(base as usize).contains("shmhca-arena"));
}

#[test]
fn misaligned_or_partial_pages_are_refused_and_leave_the_buffer_alone() {
    let p = pair(&params());
    let mut buf = MmapMut::map_anon(LEN).unwrap();
    let base = buf.as_mut_ptr();
    poke(base, 0, &pattern(LEN, 1));
    let free = p.a.pd.arena_free();
    let cases: [(usize, u64, &str); 4] = [
        (64, PAGE as u64, "address"),
        (0, PAGE as u64 + 64, "length"),
        (0, 100, "length"),
        (0, 0, "length"),
    ];
    for (off, len, what) in cases {
        // SAFETY: inside the test's mapping; refused before anything is touched.
        let r = unsafe {
            p.a.pd
                .reg_mr_in_place(base.wrapping_add(off), len, AccessFlags::LOCAL_WRITE)
        };
        let err = r.unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, Error::InvalidArgument { .. }),
            "{off} {len}: {err:?}"
        );
        assert!(
            msg.contains(what) && (len == 0 || msg.contains("page")),
            "{off} {len}: {msg}"
        );
    }
    assert_eq!(p.a.pd.arena_free(), free);
    assert_eq!(&buf[..], &pattern(LEN, 1)[..]);
    assert!(!mapping_of(base as usize).contains("shmhca-arena"));
}

#[test]
fn an_arena_without_room_is_refused_and_the_buffer_stays_private() {
    let p = pair(&Params {
        arena: 64 << 10,
        ..params()
    });
    let len = 256 << 10;
    let mut buf = MmapMut::map_anon(len).unwrap();
    let base = buf.as_mut_ptr();
    buf[7] = 7;
    // SAFETY: the test's mapping of `len` bytes.
    let err = unsafe {
        p.a.pd
            .reg_mr_in_place(base, len as u64, AccessFlags::LOCAL_WRITE)
    }
    .unwrap_err();
    assert!(matches!(err, Error::ArenaExhausted { .. }), "{err:?}");
    assert_eq!(buf[7], 7);
    assert!(!mapping_of(base as usize).contains("shmhca-arena"));
}

#[test]
fn a_huge_page_arena_is_refused_by_name() {
    let ctx = Context::builder()
        .arena_size(4 << 20)
        .huge_pages(shmhca_rings::HugePages::Require)
        .mode(EngineMode::Inline)
        .progress(Progress::Manual)
        .build();
    let Ok(ctx) = ctx else {
        eprintln!("skipped: no huge pages on this machine");
        return;
    };
    // The arena is made with the first protection domain: only then does the kernel say
    // whether it has huge pages (none reserved: `echo 64 > /proc/sys/vm/nr_hugepages`).
    let pd = match ctx.alloc_pd() {
        Ok(pd) => pd,
        Err(Error::SegmentCreate(shmhca_rings::segment::CreateError::HugePagesUnavailable {
            ..
        })) => {
            eprintln!("skipped: no huge pages on this machine");
            return;
        }
        Err(e) => panic!("{e:?}"),
    };
    let mut buf = MmapMut::map_anon(LEN).unwrap();
    buf[1] = 1;
    // SAFETY: the test's mapping, refused before anything is touched.
    let err = unsafe { pd.reg_mr_in_place(buf.as_mut_ptr(), LEN as u64, AccessFlags::LOCAL_WRITE) }
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert!(err.to_string().contains("Huge2M pages"), "{err}");
    assert_eq!(buf[1], 1);
}

#[test]
fn pages_already_moved_are_refused_until_their_region_is_gone() {
    let p = pair(&params());
    let mut buf = MmapMut::map_anon(LEN).unwrap();
    let base = buf.as_mut_ptr();
    poke(base, 0, &pattern(LEN, 5));
    // SAFETY: the test's mapping, as above.
    let first = unsafe {
        p.a.pd
            .reg_mr_in_place(base, 2 * PAGE as u64, AccessFlags::LOCAL_WRITE)
    }
    .unwrap();
    for (off, len) in [(0, PAGE), (PAGE, 2 * PAGE), (0, LEN)] {
        // SAFETY: as above; refused before anything is touched.
        let err = unsafe {
            p.b.pd
                .reg_mr_in_place(base.wrapping_add(off), len as u64, AccessFlags::LOCAL_WRITE)
        }
        .unwrap_err();
        assert!(err.to_string().contains("overlap"), "{err}");
    }
    // The pages next to it are free to move.
    // SAFETY: as above.
    let second = unsafe {
        p.a.pd.reg_mr_in_place(
            base.wrapping_add(2 * PAGE),
            2 * PAGE as u64,
            AccessFlags::LOCAL_WRITE,
        )
    }
    .unwrap();
    drop(first);
    drop(second);
    // SAFETY: as above.
    let again = unsafe {
        p.a.pd
            .reg_mr_in_place(base, LEN as u64, AccessFlags::LOCAL_WRITE)
    }
    .unwrap();
    drop(again);
    assert_eq!(&buf[..], &pattern(LEN, 5)[..]);
}

unsafe extern "C" {
    fn fork() -> i32;
    fn _exit(code: i32) -> !;
}

/// A child made by `fork` gets its own copy of in-place registered memory, as of every
/// other page: its writes do not reach the parent's buffer (the region's pages, which a
/// peer reads), and the parent's later writes do not reach it. Without the fork handler
/// the moved range is a shared mapping in both.
#[test]
fn a_forked_child_writes_its_own_copy_of_in_place_memory() {
    let ctx = Context::builder()
        .mode(EngineMode::Inline)
        .arena_size(1 << 20)
        .huge_pages(shmhca_rings::HugePages::Never)
        .build()
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mut buf = MmapMut::map_anon(LEN).unwrap();
    let base = buf.as_mut_ptr();
    poke(base, 0, &[42; 8]);
    // SAFETY: the test owns the mapping, keeps it mapped past the region, and touches it
    // only through `poke`/`peek` and the child's plain writes.
    let mr = unsafe { pd.reg_mr_in_place(base, LEN as u64, AccessFlags::LOCAL_WRITE) }.unwrap();
    // SAFETY: the child runs only async-signal-safe code (plain memory accesses and
    // `_exit`) before it exits: no allocation, no lock, no unwinding.
    let pid = unsafe { fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // The child: write its copy, give the parent time to write its own, then check
        // that the parent's write did not arrive.
        // SAFETY: `base` is mapped in the child too (private now), LEN bytes.
        unsafe { std::ptr::write_volatile(base, 0xEE) };
        for _ in 0..200 {
            // SAFETY: as above.
            if unsafe { std::ptr::read_volatile(base.wrapping_add(1)) } != 42 {
                // SAFETY: exits the child without running the test harness's code.
                unsafe { _exit(1) };
            }
            // (nanosleep: async-signal-safe.)
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // SAFETY: as above.
        unsafe { _exit(0) };
    }
    // The parent: its own write, which the child must not see (it gives up after a while
    // and exits 0; 1 if the write reached it).
    std::thread::sleep(std::time::Duration::from_millis(50));
    poke(base, 1, &[7]);
    let status = rustix::process::waitpid(
        Some(rustix::process::Pid::from_raw(pid).unwrap()),
        rustix::process::WaitOptions::empty(),
    )
    .unwrap()
    .unwrap()
    .1;
    assert_eq!(
        status.exit_status(),
        Some(0),
        "the parent's write reached the child"
    );
    assert_eq!(
        peek(base, 0, 1),
        [42],
        "the child's write reached the parent"
    );
    assert_eq!(mr.load_u64(0).unwrap() & 0xff, 42);
    drop(mr);
    assert_eq!(peek(base, 0, 2), [42, 7]);
}
