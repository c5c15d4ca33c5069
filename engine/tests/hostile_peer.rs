//! The hostile-peer suite: a peer that completes REQ/REP/RTU honestly, then maps, writes
//! and lies, while a well-behaved client of the same server keeps exchanging messages.
//!
//! # Threat model
//!
//! The attacker is a process of the same user that speaks the connection manager (it may
//! also lie in it), holds every descriptor the victim hands it, and writes anything it can
//! reach: the link segment it shares with the victim (both rings, both directions, the
//! link header) and its own arena and engine page, which the victim maps read-only. The
//! victim's promise (DESIGN.md, "Trust boundary"): the peer cannot write the victim's
//! memory, cannot read what was not granted to it (the arena of the protection domain
//! its QP belongs to; never another domain's), cannot make the victim panic, hang, or
//! allocate, commit or map more than the limits agreed in the CM, and cannot disturb the
//! victim's other connections. At worst it breaks its own link.
//!
//! The same holds the other way round: a lying server cannot make a client map or commit
//! what its REP offers.
//!
//! Out of scope, as the security model states: a process of the same user can attach with
//! `ptrace` or read and write `/proc/PID/mem` of the victim; nothing in user space can stop
//! that (run peers as another user, or with `PR_SET_DUMPABLE` cleared, for that). Nothing
//! here tests it.
//!
//! # How it is checked
//!
//! The victim server ([`hostile_support::Victim`]) runs in this process: its engine runs in
//! the victim's threads, so a panic there fails the test when the victim is stopped, and an
//! abort or a fault (SIGSEGV, SIGBUS) kills the test binary. Its regions that no peer may
//! write (REMOTE_READ only, LOCAL_WRITE only, another protection domain's) are compared
//! byte for byte when it stops. A well-behaved client ([`hostile_support::GoodClient`],
//! its own context) exchanges messages of every size class (inline, by reference, gather
//! lists, several packets), each checked byte for byte by the victim and again when echoed
//! back, before, during and after every attack; any error fails the test.
mod hostile_support;

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Duration;

use hostile_support::*;
use shmhca::cm::msg::ArenaLayout;
use shmhca::wire::slot::{KIND_DIRECT, KIND_GATHER, KIND_INLINE, KIND_NONE, PacketSlot};
use shmhca::wire::{AethRepr, AtomicEthRepr, Msn, Opcode, RethRepr, Syndrome};
use shmhca::{ConnectParams, Context, EngineMode};
use shmhca_rings::segment::Segment;

/// Runs `attack` against a victim while a well-behaved client exchanges messages with it;
/// then checks the client went on, the victim did not panic and no protected byte changed.
fn under_attack(tag: &str, attack: impl FnOnce(&Victim)) -> Report {
    let _serial = serial();
    let panics = panics_so_far();
    let victim = Victim::start(tag);
    let good = GoodClient::start(&victim);
    attack(&victim);
    // The well-behaved client goes on after the attack.
    good.wait_for(30);
    let verified = good.stop();
    let report = victim.stop();
    assert_eq!(
        panics_so_far(),
        panics,
        "a thread panicked during the attack (see its message above)"
    );
    assert!(
        report.good_messages >= verified,
        "the victim checked {} messages, the client verified {verified}",
        report.good_messages
    );
    report
}

// ---------------------------------------------------------------------------------------
// (a) Mapping what was received writable
// ---------------------------------------------------------------------------------------

/// Every way to write through `fd` fails: a writable shared mapping, upgrading a read-only
/// one with `mprotect`, `pwrite`, punching a hole, truncating, and all of these again
/// through a reopen of `/proc/self/fd/N` asking for `O_RDWR`.
fn assert_unwritable(fd: &OwnedFd, what: &str) {
    use rustix::fs::{FallocateFlags, Mode, OFlags};
    use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};
    let len = rustix::fs::fstat(fd).unwrap().st_size as usize;
    assert!(len >= 4096, "{what}: {len} bytes");
    let try_all = |fd: &OwnedFd, how: &str| {
        // SAFETY: a fresh mapping at an address the kernel chooses; unmapped right away if
        // it (wrongly) succeeds, and never dereferenced.
        let rw = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        };
        if let Ok(p) = rw {
            // SAFETY: the mapping just made, `len` bytes.
            unsafe { rustix::mm::munmap(p, len).unwrap() };
            panic!("{what} ({how}): a writable shared mapping succeeded");
        }
        assert!(
            rustix::io::pwrite(fd, b"owned", 4096).is_err(),
            "{what} ({how}): pwrite succeeded"
        );
        assert!(
            rustix::fs::fallocate(
                fd,
                FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
                4096,
                4096
            )
            .is_err(),
            "{what} ({how}): punching a hole succeeded"
        );
        assert!(
            rustix::fs::ftruncate(fd, 0).is_err(),
            "{what} ({how}): truncating succeeded"
        );
    };
    try_all(fd, "received descriptor");
    // A read-only mapping cannot be upgraded.
    // SAFETY: a fresh read-only mapping at an address the kernel chooses, unmapped below
    // and never dereferenced.
    let ro = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ,
            MapFlags::SHARED,
            fd,
            0,
        )
    }
    .unwrap_or_else(|e| panic!("{what}: a read-only mapping must work: {e}"));
    // SAFETY: `ro` is the mapping of `len` bytes made above.
    let upgraded =
        unsafe { rustix::mm::mprotect(ro, len, MprotectFlags::READ | MprotectFlags::WRITE) };
    // SAFETY: as above.
    unsafe { rustix::mm::munmap(ro, len).unwrap() };
    assert!(
        upgraded.is_err(),
        "{what}: mprotect made the mapping writable"
    );
    // A reopen through /proc asking for write access: refused, or useless.
    let proc_path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    if let Ok(again) = rustix::fs::open(
        proc_path.as_str(),
        OFlags::RDWR | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        try_all(&again, "reopened O_RDWR through /proc/self/fd");
    }
}

#[test]
fn no_descriptor_a_peer_receives_can_be_mapped_or_made_writable() {
    under_attack("map", |victim| {
        let fake = FakePeer::connect(&victim.path);
        for (fd, what) in fake.received.iter().zip(["the engine page", "the arena"]) {
            assert_unwritable(fd, what);
        }
        // The link segment is the one segment both sides write by design; the victim's
        // side of it is written only through the checked rings (the flood tests below).
        drop(fake);
    });
}

/// The check above can fail: a descriptor handed out the way the old code did (a
/// duplicate of the owner's read-write memfd, sealed only against resizing) is caught.
#[test]
fn the_writability_check_catches_a_descriptor_shared_the_old_way() {
    // Serial: its deliberate panic must not count against an attack running meanwhile.
    let _serial = serial();
    let seg = Segment::builder(ARENA_KIND, 1 << 16)
        .huge_pages(shmhca_rings::HugePages::Never)
        .sharing(shmhca_rings::segment::Sharing::ReadWrite)
        .create()
        .unwrap();
    let old_way = seg.try_clone_fd().unwrap();
    let caught = std::panic::catch_unwind(|| assert_unwritable(&old_way, "an old-style arena"));
    let msg = caught.expect_err("a writable descriptor must fail the check");
    let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("writable shared mapping succeeded"), "{msg}");
}

// ---------------------------------------------------------------------------------------
// (b) Reading what was not granted
// ---------------------------------------------------------------------------------------

/// Maps all of `fd` read-only and reports whether `needle` occurs in it.
fn segment_contains(fd: &OwnedFd, needle: &[u8]) -> bool {
    let len = rustix::fs::fstat(fd).unwrap().st_size as usize;
    // SAFETY: a fresh read-only shared mapping of the whole file (its size cannot shrink:
    // every shmhca segment is sealed against it), unmapped before returning.
    let p = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ,
            rustix::mm::MapFlags::SHARED,
            fd,
            0,
        )
    }
    .expect("mapping a received segment read-only");
    // SAFETY: `p` is a readable mapping of `len` bytes, alive until the munmap below; the
    // victim writes some of those bytes concurrently, which a byte search tolerates.
    let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) };
    let found = bytes.windows(needle.len()).any(|w| w == needle);
    // SAFETY: the mapping made above; `bytes` is not used after this.
    unsafe { rustix::mm::munmap(p, len).unwrap() };
    found
}

#[test]
fn a_peer_receives_no_descriptor_that_maps_another_protection_domains_memory() {
    under_attack("grant", |victim| {
        let fake = FakePeer::connect(&victim.path);
        // What it was granted is there (the search works) ...
        assert!(
            fake.received
                .iter()
                .any(|fd| segment_contains(fd, PUBLIC_MARK)),
            "the arena of the PD the peer connected through must hold the public region"
        );
        // ... and the other domain's region is in nothing it received.
        for (i, fd) in fake.received.iter().enumerate() {
            assert!(
                !segment_contains(fd, SECRET_MARK),
                "descriptor {i} the peer received maps the other protection domain's region"
            );
        }
    });
}

#[test]
fn rdma_to_regions_without_the_right_access_or_of_another_pd_is_refused() {
    under_attack("rkeys", |victim| {
        let (public, secret) = (victim.public, victim.secret);
        // Each attack on a fresh connection: a fatal Nak ends the QP.
        let attacks: Vec<(&str, Opcode, RethRepr)> = vec![
            (
                "write a REMOTE_READ-only region",
                Opcode::RdmaWriteOnly,
                RethRepr {
                    va: public.addr,
                    rkey: public.rkey,
                    dma_len: 16,
                },
            ),
            (
                "write the other PD's region",
                Opcode::RdmaWriteOnly,
                RethRepr {
                    va: secret.addr,
                    rkey: secret.rkey,
                    dma_len: 16,
                },
            ),
            (
                "read the other PD's region",
                Opcode::RdmaReadRequest,
                RethRepr {
                    va: secret.addr,
                    rkey: secret.rkey,
                    dma_len: 64,
                },
            ),
            (
                "read past the end of the public region",
                Opcode::RdmaReadRequest,
                RethRepr {
                    va: public.addr,
                    rkey: public.rkey,
                    dma_len: u32::MAX,
                },
            ),
        ];
        for (what, op, reth) in attacks {
            let mut fake = FakePeer::connect(&victim.path);
            let mut repr = fake.packet(op, fake.psn);
            repr.reth = Some(reth);
            let s = if op == Opcode::RdmaWriteOnly {
                let mut s = slot(&repr, KIND_INLINE, 12, 0);
                let at = s.hdr_len as usize;
                s.data[at..at + 12].copy_from_slice(b"OVERWRITTEN!");
                s
            } else {
                slot(&repr, KIND_NONE, 0, 0)
            };
            assert_eq!(fake.send(&[s]), Some(1), "{what}");
            let answer = fake.collect_for(Duration::from_millis(200));
            assert!(
                answer
                    .iter()
                    .any(|a| a.data[0] == Opcode::Acknowledge.code() && a.data[12] & 0x60 == 0x60),
                "{what}: the victim answers with a Nak"
            );
            let attack_psn = fake.psn & 0xff_ffff;
            for a in &answer {
                let op = a.data[0];
                assert_eq!(
                    op,
                    Opcode::Acknowledge.code(),
                    "{what}: answered with opcode {op:#x}, not a Nak"
                );
                let syndrome = a.data[12];
                let psn = u32::from_be_bytes([0, a.data[9], a.data[10], a.data[11]]);
                // A positive Ack of what came before the attack is an unsolicited credit
                // update (the QP advertising its receive credits when it reaches RTS, which
                // can cross the attack): it acknowledges nothing the attacker sent.
                let credit_update = syndrome & 0x60 == 0 && psn != attack_psn;
                assert!(
                    syndrome & 0x60 == 0x60 || credit_update,
                    "{what}: syndrome {syndrome:#x} for PSN {psn:#x} (the attack's {attack_psn:#x}) is not a Nak"
                );
                assert!(
                    !bytemuck::bytes_of(a)
                        .windows(8)
                        .any(|w| w == &SECRET_MARK[..8]),
                    "{what}: secret bytes in the answer"
                );
            }
        }
        // Atomics need REMOTE_ATOMIC, which the public region lacks.
        for op in [Opcode::CompareSwap, Opcode::FetchAdd] {
            let mut fake = FakePeer::connect(&victim.path);
            let mut repr = fake.packet(op, fake.psn);
            repr.atomic_eth = Some(AtomicEthRepr {
                va: public.addr,
                rkey: public.rkey,
                swap_add: u64::MAX,
                compare: 0,
            });
            fake.send(&[slot(&repr, KIND_NONE, 0, 0)]);
            let answer = fake.collect_for(Duration::from_millis(200));
            assert!(
                answer
                    .iter()
                    .all(|a| a.data[0] == Opcode::Acknowledge.code()),
                "{op:?}: answered with something else than a Nak"
            );
        }
    });
}

// ---------------------------------------------------------------------------------------
// (c) Rewriting everything reachable in shared memory
// ---------------------------------------------------------------------------------------

#[test]
fn a_peer_scribbling_over_the_whole_link_segment_breaks_only_its_own_link() {
    under_attack("scribble", |victim| {
        let fake = FakePeer::connect(&victim.path);
        let mut rng = Rng::new(0x5c1b);
        let len = fake.link.data_len();
        let mut junk = vec![0u8; len];
        // Round after round while the victim runs: the link header, both rings' headers
        // and indices, every slot of both directions.
        for round in 0..200 {
            rng.fill(&mut junk);
            if round % 4 == 0 {
                // Keep the magic now and then, so the garbage looks like a link.
                junk[..8].copy_from_slice(&LINK_MAGIC.to_le_bytes());
            }
            fake.link.write_at(0, &junk).unwrap();
            // Its own arena too: the victim reads payloads from it.
            let mut a = vec![0u8; 64 << 10];
            rng.fill(&mut a);
            fake.arena
                .write_at(rng.below(15) as usize * (64 << 10), &a)
                .unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        // Its own engine page as well: the victim reads the wake word from it.
        fake.page.write_at(0, &[0xff; 4096]).unwrap();
    });
}

#[test]
fn bogus_ring_indices_break_only_that_link() {
    under_attack("indices", |victim| {
        // The stamp of the next line of the ring the victim reads (a line ring has no
        // producer index: the stamp is one): far ahead, then behind.
        for (stamp, index) in [(0x4000_0000u32, 1u64 << 40), (u32::MAX - 3, u64::MAX - 3)] {
            let fake = FakePeer::connect(&victim.path);
            fake.link
                .write_at(fake.ring_off[0] as usize + 256, &stamp.to_le_bytes())
                .unwrap();
            // The consumer index of the ring the victim writes.
            fake.link
                .write_at(fake.ring_off[1] as usize + 128, &index.to_le_bytes())
                .unwrap();
            std::thread::sleep(Duration::from_millis(50));
        }
    });
}

// ---------------------------------------------------------------------------------------
// (d) Huge, sparse, truncated and overlapping segments in the handshake
// ---------------------------------------------------------------------------------------

#[test]
fn a_huge_sparse_arena_is_refused_above_the_cap_and_mapped_without_committing_memory_below() {
    under_attack("sparse", |victim| {
        let rss = rss_bytes();
        // Above the default cap of 4 GiB: refused before anything is mapped.
        let link = link_segment_at(LINK_SLOTS, honest_ring_offsets(LINK_SLOTS));
        let page = page_segment();
        let huge = arena_segment(6 << 30);
        let (_s, answer) = request(
            &victim.path,
            &new_link_req(FAKE_QPN),
            &[link.as_fd(), page.as_fd(), huge.as_fd()],
        );
        let rej = answer.expect_err("a 6 GiB arena is refused");
        assert!(rej.text.contains("arena"), "{rej:?}");
        // Below the cap: accepted, and mapped without committing its pages.
        let link = link_segment_at(LINK_SLOTS, honest_ring_offsets(LINK_SLOTS));
        let big = arena_segment(3 << 30);
        let (s, answer) = request(
            &victim.path,
            &new_link_req(FAKE_QPN + 1),
            &[link.as_fd(), page.as_fd(), big.as_fd()],
        );
        let (_rep, _fds) = answer.expect("a 3 GiB sparse arena under the cap is accepted");
        send_msg(&s, &shmhca::cm::msg::Message::Rtu, &[]);
        eventually("the victim accepts", || victim.accepted() >= 2);
        let grew = rss_bytes().saturating_sub(rss);
        assert!(
            grew < 256 << 20,
            "accepting a sparse 3 GiB arena grew resident memory by {} MiB",
            grew >> 20
        );
        drop(s);
    });
}

#[test]
fn a_lying_server_cannot_make_a_client_map_or_commit_what_it_offers() {
    let _serial = serial();
    let panics = panics_so_far();
    let ctx = Context::builder()
        .arena_size(4 << 20)
        .huge_pages(shmhca_rings::HugePages::Never)
        .mode(EngineMode::Inline)
        .build()
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let dir = std::env::temp_dir().join(format!("shmhca-hostile-server-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let rss = rss_bytes();
    let dup = |s: &Segment| s.try_clone_fd().unwrap();
    let page = page_segment();
    let cases: Vec<(&str, Vec<OwnedFd>, &str)> = vec![
        (
            "a 6 GiB sparse arena",
            vec![dup(&page), dup(&arena_segment(6 << 30))],
            "arena is unusable: the memfd is 6442455040 bytes, more than",
        ),
        (
            "a 1 MiB engine page",
            vec![
                dup(&Segment::builder(PAGE_KIND, 1 << 20)
                    .huge_pages(shmhca_rings::HugePages::Never)
                    .populate(false)
                    .create()
                    .unwrap()),
                dup(&arena_segment(1 << 20)),
            ],
            "engine page is unusable: the memfd is 1052672 bytes, more than",
        ),
        (
            "an arena where the page belongs",
            vec![dup(&arena_segment(1 << 20)), dup(&arena_segment(1 << 20))],
            "segment kind",
        ),
        (
            "one descriptor",
            vec![dup(&page)],
            "carried 1 file descriptors instead of 2",
        ),
        (
            "an arena that could shrink",
            vec![dup(&page), raw_memfd(1 << 20, false)],
            "not sealed against shrinking",
        ),
    ];
    for (i, (what, fds, expect)) in cases.into_iter().enumerate() {
        let path = dir.join(format!("liar-{i}.sock"));
        let server = lying_server(&path, fds);
        let params = ConnectParams::default().handshake_timeout(Duration::from_secs(5));
        let e = ctx
            .connect(&path, &pd, &cq, &cq, &params)
            .expect_err(what)
            .to_string();
        assert!(e.contains(expect), "{what}: {e}");
        server.join().expect("the fake server");
        assert!(ctx.cm_links().is_empty(), "{what}: a link was left behind");
    }
    let grew = rss_bytes().saturating_sub(rss);
    assert!(
        grew < 256 << 20,
        "resident memory grew by {} MiB",
        grew >> 20
    );
    assert_eq!(panics_so_far(), panics, "a thread panicked");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A raw memfd of `len` bytes; sealed against shrinking if `sealed`.
fn raw_memfd(len: u64, sealed: bool) -> OwnedFd {
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd = rustix::fs::memfd_create("hostile", MemfdFlags::ALLOW_SEALING | MemfdFlags::CLOEXEC)
        .unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    if sealed {
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
    }
    fd
}

#[test]
fn lying_segments_and_descriptor_counts_in_a_req_are_refused() {
    under_attack("lies", |victim| {
        let honest = honest_ring_offsets(LINK_SLOTS);
        let ring = shmhca_rings::lines::shm_lines_bytes(LINK_SLOTS).unwrap() as u64;
        let page = page_segment();
        let arena = arena_segment(1 << 20);
        let dup = |fd: std::os::fd::BorrowedFd<'_>| fd.try_clone_to_owned().unwrap();
        let good_link = || link_segment_at(LINK_SLOTS, honest);
        let mut cases: Vec<(&str, Vec<OwnedFd>, &str)> = Vec::new();
        let l = link_segment_at(LINK_SLOTS, [honest[0], honest[0]]);
        cases.push((
            "both rings at one offset",
            vec![dup(l.as_fd()), dup(page.as_fd()), dup(arena.as_fd())],
            "same offset",
        ));
        let l = link_segment_at(LINK_SLOTS, [honest[0], honest[0] + ring - 128]);
        cases.push((
            "ring 1 inside ring 0",
            vec![dup(l.as_fd()), dup(page.as_fd()), dup(arena.as_fd())],
            "overlap",
        ));
        let l = link_segment_at(LINK_SLOTS, honest);
        l.write_at(16, &(1u64 << 40).to_le_bytes()).unwrap();
        cases.push((
            "a ring offset past the end",
            vec![dup(l.as_fd()), dup(page.as_fd()), dup(arena.as_fd())],
            "link segment",
        ));
        let l = good_link();
        l.write_at(0, b"NOTALINK").unwrap();
        cases.push((
            "a wrong link magic",
            vec![dup(l.as_fd()), dup(page.as_fd()), dup(arena.as_fd())],
            "magic",
        ));
        let huge_link = Segment::builder(LINK_KIND, 1 << 30)
            .huge_pages(shmhca_rings::HugePages::Never)
            .populate(false)
            .create()
            .unwrap();
        cases.push((
            "a 1 GiB link segment",
            vec![
                dup(huge_link.as_fd()),
                dup(page.as_fd()),
                dup(arena.as_fd()),
            ],
            "large",
        ));
        let big_page = arena_segment(1 << 20);
        let l = good_link();
        cases.push((
            "an arena where the engine page belongs",
            vec![dup(l.as_fd()), dup(big_page.as_fd()), dup(arena.as_fd())],
            "kind",
        ));
        let wide_page = Segment::builder(PAGE_KIND, 1 << 20)
            .huge_pages(shmhca_rings::HugePages::Never)
            .populate(false)
            .create()
            .unwrap();
        let l = good_link();
        cases.push((
            "a 1 MiB engine page",
            vec![dup(l.as_fd()), dup(wide_page.as_fd()), dup(arena.as_fd())],
            "large",
        ));
        let l = good_link();
        cases.push((
            "a page where the arena belongs",
            vec![dup(l.as_fd()), dup(page.as_fd()), dup(page.as_fd())],
            "kind",
        ));
        let l = good_link();
        cases.push((
            "a truncated arena (100 bytes)",
            vec![dup(l.as_fd()), dup(page.as_fd()), raw_memfd(100, true)],
            "arena",
        ));
        let l = good_link();
        cases.push((
            "an arena that could shrink",
            vec![dup(l.as_fd()), dup(page.as_fd()), raw_memfd(1 << 20, false)],
            "arena",
        ));
        let l = good_link();
        cases.push((
            "four descriptors",
            vec![
                dup(l.as_fd()),
                dup(page.as_fd()),
                dup(arena.as_fd()),
                dup(arena.as_fd()),
            ],
            "4 file descriptors",
        ));
        cases.push(("no descriptor", vec![], "0 file descriptors"));
        for (i, (what, fds, expect)) in cases.into_iter().enumerate() {
            let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
            let (_s, answer) = request(&victim.path, &new_link_req(FAKE_QPN + i as u32), &borrowed);
            let rej = answer.err().unwrap_or_else(|| panic!("{what}: accepted"));
            let refused = victim.wait_refused(i + 1);
            let e = &refused[i];
            assert!(
                e.contains(expect),
                "{what}: the victim's error should say `{expect}`: {e} (REJ: {rej:?})"
            );
        }
        // The same checks hold for an arena the REQ says is an application's memfd (no
        // header): it must be sealed against shrinking and fit under the cap.
        let base = victim.wait_refused(0).len();
        let memfd_cases: Vec<(&str, OwnedFd, &str)> = vec![
            (
                "a memfd arena that could shrink",
                raw_memfd(1 << 20, false),
                "not sealed against shrinking",
            ),
            ("an empty memfd arena", raw_memfd(0, true), "empty"),
            ("a page that is no memfd", socket_fd(), "not a memfd"),
        ];
        for (k, (what, arena_fd, expect)) in memfd_cases.into_iter().enumerate() {
            let l = good_link();
            let fds = [l.as_fd(), page.as_fd(), arena_fd.as_fd()];
            let mut req = new_link_req(FAKE_QPN + 100 + k as u32);
            req.arena_layout = ArenaLayout::Memfd;
            let (_s, answer) = request(&victim.path, &req, &fds);
            let rej = answer.err().unwrap_or_else(|| panic!("{what}: accepted"));
            let refused = victim.wait_refused(base + k + 1);
            let e = &refused[base + k];
            assert!(
                e.contains(expect),
                "{what}: the victim's error should say `{expect}`: {e} (REJ: {rej:?})"
            );
        }
        assert_eq!(victim.accepted(), 1, "only the well-behaved client got in");
    });
}

/// A descriptor that is not a memfd (one end of a socket pair).
fn socket_fd() -> OwnedFd {
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    a.into()
}

// ---------------------------------------------------------------------------------------
// (e) Stalled handshakes
// ---------------------------------------------------------------------------------------

#[test]
fn stalled_handshakes_cost_the_well_behaved_client_nothing_and_end_at_the_deadline() {
    use std::io::Read;
    use std::os::unix::net::UnixStream;
    let report = under_attack("stall", |victim| {
        // Half a REQ, then silence.
        let half = UnixStream::connect(&victim.path).unwrap();
        let _ = recv_msg(&half).expect("HELLO");
        let req = shmhca::cm::msg::Message::Req(new_link_req(FAKE_QPN)).encode();
        let mut w = &half;
        std::io::Write::write_all(&mut w, &req[..req.len() / 2]).unwrap();
        // A connection that never says anything.
        let mute = UnixStream::connect(&victim.path).unwrap();
        // A header promising a body that never comes.
        let liar = UnixStream::connect(&victim.path).unwrap();
        let mut w = &liar;
        std::io::Write::write_all(&mut w, &req[..shmhca::cm::msg::HEADER_LEN]).unwrap();
        // Each is hung up on by the victim after its handshake timeout (1 s): reading
        // reaches the end of the stream.
        for (s, what) in [
            (&half, "half a REQ"),
            (&mute, "silence"),
            (&liar, "a header only"),
        ] {
            s.set_read_timeout(Some(DEADLINE)).unwrap();
            let mut sink = Vec::new();
            let r = (&*s).read_to_end(&mut sink);
            assert!(r.is_ok(), "{what}: the victim never hung up: {r:?}");
        }
        // A new well-behaved client still gets in, and is served.
        let second = GoodClient::start(victim);
        second.wait_for(20);
        second.stop();
    });
    assert!(report.refused.len() >= 3, "{:?}", report.refused);
}

// ---------------------------------------------------------------------------------------
// (f) Floods of garbage slots, indices and malformed packets
// ---------------------------------------------------------------------------------------

#[test]
fn a_flood_of_random_slots_and_packets_is_dropped_without_harm() {
    under_attack("flood", |victim| {
        let before = victim.accepted();
        let mut fake = FakePeer::connect(&victim.path);
        // Flood a connection the victim has accepted: packets that arrive before the
        // victim read the RTU may put its QP in Error, and then it refuses the connection
        // (and stops reading the link) rather than keep it.
        eventually("the victim accepts the fake peer", || {
            victim.accepted() > before
        });
        let mut rng = Rng::new(0xf100d);
        let arena_len = fake.arena.data_len() as u64;
        let mut arena = vec![0u8; arena_len as usize];
        rng.fill(&mut arena);
        fake.arena.write_at(0, &arena).unwrap();
        let base = fake.psn;
        for burst in 0..400u32 {
            let mut slots = Vec::new();
            while slots.len() < 24 {
                let mut s = PacketSlot::default();
                rng.fill(bytemuck::bytes_of_mut(&mut s));
                if rng.below(8) != 0 {
                    // A real opcode to the victim's QP with the right header length, so it
                    // gets past the first checks into the RQ Logic or the completer.
                    let op = Opcode::ALL[rng.below(Opcode::ALL.len() as u64) as usize];
                    let psn = match rng.below(3) {
                        0 => base.wrapping_add(rng.below(64) as u32),
                        1 => rng.next() as u32,
                        _ => base.wrapping_add(burst),
                    } & 0xff_ffff;
                    let mut repr = fake.packet(op, psn);
                    let info = op.info().unwrap();
                    let mut scratch = PacketSlot::default();
                    let n = {
                        // Random extended headers: parse random bytes of the right length.
                        rng.fill(&mut scratch.data);
                        scratch.data[0] = op.code();
                        scratch.data[1] &= 0xc0 | 0x30; // tver 0, pad random
                        info.header_len()
                    };
                    if let Ok((r, _)) = shmhca::wire::PacketRepr::parse(&scratch.data[..n]) {
                        repr.reth = r.reth;
                        repr.aeth = r.aeth;
                        repr.atomic_eth = r.atomic_eth;
                        repr.atomic_ack_eth = r.atomic_ack_eth;
                        repr.immdt = r.immdt;
                        repr.ieth = r.ieth;
                    }
                    if let Some(r) = repr.reth.as_mut() {
                        if rng.below(2) == 0 {
                            // Aim at the victim's public region now and then.
                            r.va = victim.public.addr + rng.below(REGION);
                            r.rkey = victim.public.rkey;
                        }
                    }
                    let kind = rng.below(5) as u8;
                    let len = match rng.below(4) {
                        0 => rng.below(100) as u32,
                        1 => rng.below(64 << 10) as u32,
                        2 => rng.next() as u32,
                        _ => 4096,
                    };
                    let off = match rng.below(4) {
                        0 => rng.below(arena_len),
                        1 => arena_len - rng.below(64),
                        2 => u64::MAX - rng.below(4096),
                        _ => rng.next(),
                    };
                    if repr.emit(&mut s.data).is_ok() {
                        s.hdr_len = info.header_len() as u8;
                        s.kind = kind;
                        s.payload_len = len;
                        s.payload_off = off;
                        s.sge_count = rng.below(20) as u8;
                    }
                }
                let cont = shmhca::wire::slot::continuation_slots(&s);
                slots.push(s);
                // A gather packet's continuation slots travel with it (a packet cut short
                // is its own test): random entries, some aimed into the arena.
                for _ in 0..cont {
                    let mut c = PacketSlot::default();
                    rng.fill(bytemuck::bytes_of_mut(&mut c));
                    let mut one = [c];
                    for i in 0..shmhca::wire::slot::GATHER_PER_SLOT {
                        if rng.below(2) == 0 {
                            set_gather_entry(
                                &mut one,
                                i,
                                rng.below(arena_len),
                                rng.below(8192) as u32,
                            );
                        }
                    }
                    slots.push(one[0]);
                }
            }
            assert_eq!(
                fake.send(&slots),
                Some(slots.len()),
                "burst {burst}: the victim keeps reading a link carrying well-framed garbage"
            );
        }
        fake.collect_for(Duration::from_millis(50));
        assert!(
            fake.answers > 0,
            "the victim answered none of the packets: the flood never reached its QP"
        );
    });
}

#[test]
fn a_peer_that_breaks_its_qp_before_the_rtu_is_refused_and_harms_nobody_else() {
    under_attack("before-rtu", |victim| {
        let refused_before = victim.wait_refused(0).len();
        let mut fake = FakePeer::connect_before_rtu(&victim.path);
        // An RDMA Write with a key that names nothing: a Remote Access Error, fatal for the
        // victim's QP, sent while that QP is still in RTR waiting for our RTU.
        let mut s = PacketSlot::default();
        let mut repr = fake.packet(Opcode::RdmaWriteOnly, fake.psn);
        repr.reth = Some(shmhca::wire::reth::RethRepr {
            va: 0x1000,
            rkey: 0xdead_0001,
            dma_len: 8,
        });
        s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
        s.kind = shmhca::wire::slot::KIND_INLINE;
        s.payload_len = 8;
        assert_eq!(fake.send(&[s]), Some(1));
        // Once the victim answered (its Nak), the RTU comes too late.
        eventually("the victim's Nak", || {
            fake.collect_for(Duration::from_millis(10));
            fake.answers > 0
        });
        send_msg(&fake.stream, &shmhca::cm::msg::Message::Rtu, &[]);
        let refused = victim.wait_refused(refused_before + 1);
        let why = refused.last().unwrap();
        assert!(
            why.contains("first packets were refused before its RTU"),
            "{why}"
        );
    });
}

#[test]
fn malformed_packets_aimed_at_each_check_are_refused_one_by_one() {
    under_attack("malformed", |victim| {
        type Make = fn(&FakePeer) -> Vec<PacketSlot>;
        let attacks: Vec<(&str, Make)> = vec![
            ("a payload offset that wraps around", |f| {
                vec![slot(
                    &f.packet(Opcode::SendOnly, f.psn),
                    KIND_DIRECT,
                    100,
                    u64::MAX - 10,
                )]
            }),
            ("a payload past the end of the arena", |f| {
                let end = f.arena.data_len() as u64;
                vec![slot(
                    &f.packet(Opcode::SendOnly, f.psn),
                    KIND_DIRECT,
                    100,
                    end - 10,
                )]
            }),
            ("a payload longer than the receive buffer", |f| {
                vec![slot(
                    &f.packet(Opcode::SendOnly, f.psn),
                    KIND_DIRECT,
                    1 << 20,
                    0,
                )]
            }),
            ("an inline payload overrunning the slot", |f| {
                vec![slot(
                    &f.packet(Opcode::SendOnly, f.psn),
                    KIND_INLINE,
                    200,
                    0,
                )]
            }),
            ("a gather list of no entries", |f| {
                vec![slot(
                    &f.packet(Opcode::SendOnly, f.psn),
                    KIND_GATHER,
                    100,
                    0,
                )]
            }),
            ("a gather list of 255 entries", |f| {
                let mut s = slot(&f.packet(Opcode::SendOnly, f.psn), KIND_GATHER, 100, 0);
                s.sge_count = 255;
                vec![s]
            }),
            ("gather entries that wrap around", |f| {
                let mut s = slot(&f.packet(Opcode::SendOnly, f.psn), KIND_GATHER, 20, 0);
                s.sge_count = 2;
                let mut c = [PacketSlot::default()];
                set_gather_entry(&mut c, 0, u64::MAX - 4, 10);
                set_gather_entry(&mut c, 1, 0, 10);
                vec![s, c[0]]
            }),
            ("a gather skip beyond its first entry", |f| {
                let mut s = slot(&f.packet(Opcode::SendOnly, f.psn), KIND_GATHER, 20, 0);
                s.sge_count = 1;
                let at = s.hdr_len as usize;
                s.data[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
                let mut c = [PacketSlot::default()];
                set_gather_entry(&mut c, 0, 0, 10);
                vec![s, c[0]]
            }),
            ("gather entries shorter than the payload", |f| {
                let mut s = slot(&f.packet(Opcode::SendOnly, f.psn), KIND_GATHER, 4000, 0);
                s.sge_count = 16;
                let mut c = [PacketSlot::default(); 6];
                for i in 0..16 {
                    set_gather_entry(&mut c, i, i as u64 * 64, 10);
                }
                let mut v = vec![s];
                v.extend_from_slice(&c);
                v
            }),
            ("a PSN far out of the window", |f| {
                vec![slot(
                    &f.packet(Opcode::SendOnly, f.psn ^ 0x80_0000),
                    KIND_INLINE,
                    8,
                    0,
                )]
            }),
            ("a duplicate PSN before anything was received", |f| {
                vec![slot(
                    &f.packet(Opcode::SendOnly, f.psn.wrapping_sub(1) & 0xff_ffff),
                    KIND_INLINE,
                    8,
                    0,
                )]
            }),
            ("a middle packet with no first", |f| {
                vec![slot(
                    &f.packet(Opcode::SendMiddle, f.psn),
                    KIND_DIRECT,
                    4096,
                    0,
                )]
            }),
            ("an Ack for nothing", |f| {
                let mut r = f.packet(Opcode::Acknowledge, 0x12_3456);
                r.aeth = Some(AethRepr {
                    syndrome: Syndrome::from_u8(0x1f),
                    msn: Msn::new(0xff_ffff),
                });
                vec![slot(&r, KIND_NONE, 0, 0)]
            }),
            ("a Nak for nothing", |f| {
                let mut r = f.packet(Opcode::Acknowledge, 0);
                r.aeth = Some(AethRepr {
                    syndrome: Syndrome::from_u8(0x63),
                    msn: Msn::new(0),
                });
                vec![slot(&r, KIND_NONE, 0, 0)]
            }),
            ("an Atomic Ack nobody asked for", |f| {
                let mut r = f.packet(Opcode::AtomicAcknowledge, 5);
                r.aeth = Some(AethRepr {
                    syndrome: Syndrome::from_u8(0),
                    msn: Msn::new(1),
                });
                r.atomic_ack_eth = Some(shmhca::wire::AtomicAckEthRepr { orig: 42 });
                vec![slot(&r, KIND_NONE, 0, 0)]
            }),
            ("Read responses nobody asked for", |f| {
                let mut first = f.packet(Opcode::RdmaReadResponseFirst, 0);
                first.aeth = Some(AethRepr {
                    syndrome: Syndrome::from_u8(0),
                    msn: Msn::new(0),
                });
                let middle = f.packet(Opcode::RdmaReadResponseMiddle, 1);
                let mut only = f.packet(Opcode::RdmaReadResponseOnly, 2);
                only.aeth = first.aeth;
                vec![
                    slot(&first, KIND_DIRECT, 4096, 0),
                    slot(&middle, KIND_DIRECT, 4096, u64::MAX),
                    slot(&only, KIND_INLINE, 8, 0),
                ]
            }),
            ("an unknown opcode", |f| {
                let mut s = slot(&f.packet(Opcode::SendOnly, f.psn), KIND_NONE, 0, 0);
                s.data[0] = 0x1f;
                vec![s]
            }),
            ("a header length that lies", |f| {
                let mut s = slot(&f.packet(Opcode::SendOnly, f.psn), KIND_INLINE, 8, 0);
                s.hdr_len = 111;
                vec![s]
            }),
        ];
        for (what, make) in attacks {
            let mut fake = FakePeer::connect(&victim.path);
            let slots = make(&fake);
            assert_eq!(fake.send(&slots), Some(slots.len()), "{what}");
            // Then an honest Send: whatever the victim made of the lie, it must still be
            // standing (it may have moved this QP to Error, but must not have panicked).
            let honest = slot(&fake.packet(Opcode::SendOnly, fake.psn), KIND_INLINE, 8, 0);
            fake.send(&[honest]);
            fake.collect_for(Duration::from_millis(20));
        }
    });
}

/// A packet is a frame of exactly its slot and the continuation lines its gather list
/// calls for. A frame of any other line count, a gather count above 16 and an inline
/// payload past line 0 are each dropped as a malformed packet, and the link goes on: an
/// honest Send behind the lie is answered.
#[test]
fn frames_whose_line_count_lies_are_dropped_and_the_link_goes_on() {
    under_attack("frames", |victim| {
        type Make = fn(&FakePeer) -> Vec<PacketSlot>;
        let lies: Vec<(&str, Make)> = vec![
            ("a gather packet without its continuation lines", |f| {
                let mut s = slot(&f.packet(Opcode::SendOnly, f.psn), KIND_GATHER, 100, 0);
                s.sge_count = 9; // three continuation lines promised
                vec![s]
            }),
            ("a gather packet one continuation line short", |f| {
                let mut s = slot(&f.packet(Opcode::SendOnly, f.psn), KIND_GATHER, 100, 0);
                s.sge_count = 9;
                vec![s, PacketSlot::default(), PacketSlot::default()]
            }),
            ("a gather packet with a continuation line too many", |f| {
                let mut s = slot(&f.packet(Opcode::SendOnly, f.psn), KIND_GATHER, 20, 0);
                s.sge_count = 2;
                let mut c = [PacketSlot::default(); 2];
                set_gather_entry(&mut c, 0, 0, 10);
                set_gather_entry(&mut c, 1, 64, 10);
                vec![s, c[0], c[1]]
            }),
            ("an inline packet followed by a line in its frame", |f| {
                let mut s = slot(&f.packet(Opcode::SendOnly, f.psn), KIND_INLINE, 8, 0);
                s.data[12..20].copy_from_slice(b"smuggled");
                vec![s, PacketSlot::default()]
            }),
            ("a direct packet followed by lines in its frame", |f| {
                let s = slot(&f.packet(Opcode::SendOnly, f.psn), KIND_DIRECT, 8, 0);
                vec![s; 16]
            }),
            (
                "a gather count above 16, with six continuation lines",
                |f| {
                    let mut s = slot(&f.packet(Opcode::SendOnly, f.psn), KIND_GATHER, 100, 0);
                    s.sge_count = 17;
                    let mut c = [PacketSlot::default(); 6];
                    for i in 0..16 {
                        set_gather_entry(&mut c, i, 0, 10);
                    }
                    let mut v = vec![s];
                    v.extend_from_slice(&c);
                    v
                },
            ),
            (
                "an inline payload past line 0, its bytes in the next line",
                |f| {
                    // 12 bytes of BTH and 29 of payload: one byte past the slot.
                    let s = slot(&f.packet(Opcode::SendOnly, f.psn), KIND_INLINE, 29, 0);
                    vec![s, PacketSlot::default()]
                },
            ),
            ("an inline payload past line 0, alone", |f| {
                let s = slot(&f.packet(Opcode::SendOnly, f.psn), KIND_INLINE, 29, 0);
                vec![s]
            }),
        ];
        for (what, make) in lies {
            let before = victim.accepted();
            let mut fake = FakePeer::connect(&victim.path);
            eventually("the victim accepts the fake peer", || {
                victim.accepted() > before
            });
            let frame = make(&fake);
            assert_eq!(fake.send_frames(&[&frame]), Some(frame.len()), "{what}");
            let mut honest = fake.packet(Opcode::SendOnly, fake.psn);
            honest.bth.ack_req = true;
            let mut honest = slot(&honest, KIND_INLINE, 8, 0);
            honest.data[12..20].copy_from_slice(b"honest!!");
            assert_eq!(fake.send(&[honest]), Some(1), "{what}: the link is read");
            let psn = fake.psn;
            let mut acked = false;
            eventually(
                &format!("{what}: the honest Send behind it is answered"),
                || {
                    // An Ack, or an RNR Nak if the victim had not posted its receives yet:
                    // either way the link carried the Send to the QP.
                    acked |= fake.drain().iter().any(|s| {
                        s.data[0] == Opcode::Acknowledge.code()
                            && u32::from_be_bytes([0, s.data[9], s.data[10], s.data[11]]) == psn
                    });
                    acked
                },
            );
        }
    });
}
