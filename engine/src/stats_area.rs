//! The stats area: a small shared-memory page each engine publishes its counters, links
//! and QPs into, for `shmhca stat` to read from outside the process.
//!
//! # Where it lives, and why nothing is left behind
//!
//! The area is a sealed memfd named [`MEMFD_NAME`] (a [`Segment`] of kind [`STATS_KIND`])
//! that the engine keeps open and mapped for its whole life. It has no name in any file
//! system: a reader finds it as the link `/memfd:shmhca-stats (deleted)` in
//! `/proc/PID/fd/`, opens that read-only and validates it ([`read`]). When the process
//! exits — even by `SIGKILL` — its descriptors close and the memory is freed; nothing can
//! be left over to clean up, and a dead process simply has no area to find.
//!
//! # Publishing: no locks, no system calls
//!
//! The engine counts its iterations and, every [`PUBLISH_EVERY`] of them, copies its
//! counters, links and QPs into the area under a seqlock: the generation word becomes odd,
//! the bytes are copied with plain stores, and the generation becomes even again (a
//! Release store). A reader copies the bytes between two loads of the generation and
//! keeps the copy only if both loads saw the same even value. The engine never waits for
//! a reader, allocates nothing (the copy is assembled in a buffer made at creation) and
//! makes no system call; on other iterations the cost is one decrement.
//!
//! # Layout of the data area (little-endian)
//!
//! ```text
//!    0  u32 generation (seqlock: odd while the engine writes)
//!    4  u32 layout version (LAYOUT)
//!    8  u32 pid              12  u32 engine id (per-process counter)
//!   16  u32 mode (0 inline, 1 poll)
//!   20  u32 QPs listed       24  u32 QPs in all      28  u32 links listed
//!   32  u64 publishes
//!   40  u64 x COUNTERS counters, in the order of [`COUNTER_NAMES`] (room up to 512)
//!  512  links: MAX_LINKS x 16 bytes: id, up (0/1), peer pid (0 unknown), QPs on it
//! 1024  QPs: MAX_QPS x 32 bytes: qpn, state, link (u32::MAX: none), dest qpn,
//!       next PSN to send, last acknowledged PSN, expected PSN, reserved
//! ```
//!
//! The peer pid of a link comes from the peer's engine page (at byte 128), which every
//! engine writes its pid into when it starts; it is shown, never trusted.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};

use shmhca_rings::segment::{Access, HugePages, OpenError, Segment, Sharing};

use crate::context::Stats;
use crate::mem::Mem;
use crate::qp::QpState;

/// The memfd name of every stats area.
pub const MEMFD_NAME: &str = "shmhca-stats";
/// The segment kind of a stats area ("STAT").
pub const STATS_KIND: u32 = 0x5441_5453;
/// The data layout version (5: the counters of a RoCEv2 notification point, and the
/// links moved to byte 512 to make room for them and for more).
pub const LAYOUT: u32 = 5;
/// Engine iterations between two publications.
pub const PUBLISH_EVERY: u32 = 1 << 12;
/// The most links listed.
pub const MAX_LINKS: usize = 32;
/// The most QPs listed (a context with more says how many it has in all).
pub const MAX_QPS: usize = 128;
/// The most QPs one context can have (a device limit, for `shmhca devinfo`).
pub const MAX_QPS_PER_CONTEXT: usize = crate::engine::doorbell::MAX_QPS;
/// The counters, in their order in the area (the fields of [`Stats`]).
pub const COUNTER_NAMES: [&str; COUNTERS] = [
    "packets_sent",
    "packets_received",
    "payload_bytes_copied",
    "inline_bytes_sent",
    "acks_sent",
    "naks_sent",
    "retransmitted",
    "timeouts",
    "rnr_naks_received",
    "dropped",
    "sleeps",
    "rnr_naks_sent",
    "seq_err_naks_sent",
    "inv_req_naks_sent",
    "rem_access_naks_sent",
    "rem_op_naks_sent",
    "naks_received",
    "flushed",
    "acks_riding",
    "datagrams_sent",
    "datagrams_received",
    "icrc_dropped",
    "malformed_dropped",
    "cnps_received",
    "unknown_source_dropped",
    "send_dropped",
    "encode_dropped",
    "ce_marked_received",
    "cnps_sent",
];

/// How many counters the area holds.
pub const COUNTERS: usize = 29;

const OFF_LAYOUT: usize = 4;
const OFF_COUNTERS: usize = 40;
const OFF_LINKS: usize = 512;
const _: () = assert!(OFF_COUNTERS + 8 * COUNTERS <= OFF_LINKS);
const LINK_LEN: usize = 16;
const OFF_QPS: usize = OFF_LINKS + MAX_LINKS * LINK_LEN;
const QP_LEN: usize = 32;
/// Bytes of the data area in use.
const USED: usize = OFF_QPS + MAX_QPS * QP_LEN;
/// The data area's length (a whole page).
const DATA_LEN: usize = USED.next_multiple_of(4096);

/// The engine's side: the mapped area (the engine counts the iterations between two
/// publications itself).
pub(crate) struct StatsArea {
    mem: Mem,
    /// Keeps the memfd open (and so findable) for the engine's life.
    _segment: Arc<Segment>,
    /// The image assembled before each copy (made once).
    image: Box<[u8]>,
    publishes: u64,
}

impl StatsArea {
    /// Creates the area for an engine of this process. `None` if the memfd cannot be made
    /// (the engine runs without one: observability is not worth failing for).
    pub(crate) fn create(engine_id: u32, poll_mode: bool) -> Option<StatsArea> {
        // Only this engine writes it: readers (`shmhca stat`, which reopens it through
        // /proc) cannot map it writable.
        let segment = Segment::builder(STATS_KIND, DATA_LEN)
            .name(MEMFD_NAME)
            .huge_pages(HugePages::Never)
            .sharing(Sharing::CreatorWrites)
            .create()
            .ok()?;
        let segment = Arc::new(segment);
        let mut image = vec![0u8; USED].into_boxed_slice();
        put_u32(&mut image, OFF_LAYOUT, LAYOUT);
        put_u32(&mut image, 8, std::process::id());
        put_u32(&mut image, 12, engine_id);
        put_u32(&mut image, 16, u32::from(poll_mode));
        let area = StatsArea {
            mem: Mem::from_segment(segment.clone()),
            _segment: segment,
            image,
            publishes: 0,
        };
        // Readable (empty) from the start.
        area.mem
            .write(OFF_LAYOUT as u64, &area.image[OFF_LAYOUT..])
            .ok()?;
        Some(area)
    }

    /// Copies an engine's counters, links and QPs into the area: at most [`MAX_LINKS`]
    /// links and [`MAX_QPS`] QPs are listed, and `qps` is counted to the end.
    pub(crate) fn publish(
        &mut self,
        stats: &Stats,
        links: impl Iterator<Item = LinkRow>,
        qps: impl Iterator<Item = QpRow>,
    ) {
        self.publishes += 1;
        let img = &mut self.image;
        put_u64(img, 32, self.publishes);
        for (i, v) in counters(stats).iter().enumerate() {
            put_u64(img, OFF_COUNTERS + 8 * i, *v);
        }
        let mut nl = 0;
        for link in links.take(MAX_LINKS) {
            let at = OFF_LINKS + nl * LINK_LEN;
            put_u32(img, at, link.id);
            put_u32(img, at + 4, u32::from(link.up));
            put_u32(img, at + 8, link.peer_pid);
            put_u32(img, at + 12, link.qps);
            nl += 1;
        }
        let (mut nq, mut total) = (0, 0u32);
        for q in qps {
            total += 1;
            if nq == MAX_QPS {
                continue;
            }
            let at = OFF_QPS + nq * QP_LEN;
            put_u32(img, at, q.qpn);
            put_u32(img, at + 4, q.state as u32);
            put_u32(img, at + 8, q.dest.map_or(u32::MAX, |d| d.0));
            put_u32(img, at + 12, q.dest.map_or(0, |d| d.1));
            put_u32(img, at + 16, q.npsn);
            put_u32(img, at + 20, q.acked);
            put_u32(img, at + 24, q.epsn);
            nq += 1;
        }
        put_u32(img, 20, nq as u32);
        put_u32(img, 24, total);
        put_u32(img, 28, nl as u32);
        let Ok(gen_word) = self.mem.atomic_u32(0) else {
            return;
        };
        // SYNC: seqlock writer. The odd generation is stored before the bytes (the
        // Release fence orders it before them); the even one is a Release store after
        // them. Pairs with the reader's Acquire load and fence in `read`.
        let g = gen_word.load(Ordering::Relaxed);
        gen_word.store(g.wrapping_add(1) | 1, Ordering::Relaxed);
        fence(Ordering::Release);
        let _ = self.mem.write(OFF_LAYOUT as u64, &img[OFF_LAYOUT..]);
        gen_word.store((g.wrapping_add(1) | 1).wrapping_add(1), Ordering::Release);
    }
}

/// One link as the area lists it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LinkRow {
    /// The link's index in its engine.
    pub(crate) id: u32,
    /// Whether it is up.
    pub(crate) up: bool,
    /// The peer process (0 if unknown).
    pub(crate) peer_pid: u32,
    /// QPs whose destination is over it.
    pub(crate) qps: u32,
}

/// One QP as the area lists it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QpRow {
    pub(crate) qpn: u32,
    pub(crate) state: QpState,
    /// The link and remote QPN of its destination, once it has one.
    pub(crate) dest: Option<(u32, u32)>,
    /// The SQ Logic's next PSN and the last PSN the peer acknowledged.
    pub(crate) npsn: u32,
    pub(crate) acked: u32,
    /// The RQ Logic's expected PSN.
    pub(crate) epsn: u32,
}

fn counters(st: &Stats) -> [u64; COUNTERS] {
    [
        st.packets_sent,
        st.packets_received,
        st.payload_bytes_copied,
        st.inline_bytes_sent,
        st.acks_sent,
        st.naks_sent,
        st.retransmitted,
        st.timeouts,
        st.rnr_naks_received,
        st.dropped,
        st.sleeps,
        st.rnr_naks_sent,
        st.seq_err_naks_sent,
        st.inv_req_naks_sent,
        st.rem_access_naks_sent,
        st.rem_op_naks_sent,
        st.naks_received,
        st.flushed,
        st.acks_riding,
        st.datagrams_sent,
        st.datagrams_received,
        st.icrc_dropped,
        st.malformed_dropped,
        st.cnps_received,
        st.unknown_source_dropped,
        st.send_dropped,
        st.encode_dropped,
        st.ce_marked_received,
        st.cnps_sent,
    ]
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// What one engine published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The pid the area's writer put in it: its own word, not a fact. A reader that found
    /// the area in `/proc/PID/fd` knows a process that holds it; show that one (`shmhca
    /// stat` does) and this only when they differ.
    pub pid: u32,
    /// The engine's number within its process.
    pub engine_id: u32,
    /// Whether the engine runs on its own thread (else inline).
    pub poll_mode: bool,
    /// Publications so far (0: the engine has not run an iteration yet).
    pub publishes: u64,
    /// The counters, named by [`COUNTER_NAMES`].
    pub counters: [u64; COUNTERS],
    /// Its links.
    pub links: Vec<LinkSnapshot>,
    /// Its QPs (at most [`MAX_QPS`]).
    pub qps: Vec<QpSnapshot>,
    /// How many QPs it has in all.
    pub total_qps: u32,
}

/// One link of a [`Snapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkSnapshot {
    /// Its number in the engine.
    pub id: u32,
    /// Whether it is up.
    pub up: bool,
    /// The peer process (0: unknown).
    pub peer_pid: u32,
    /// QPs connected over it.
    pub qps: u32,
}

/// One QP of a [`Snapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpSnapshot {
    /// Its number.
    pub qpn: u32,
    /// Its state (`None` for a value this build does not know).
    pub state: Option<QpState>,
    /// The link it is connected over, if any.
    pub link: Option<u32>,
    /// The peer QP's number.
    pub dest_qpn: u32,
    /// The next PSN it sends.
    pub next_psn: u32,
    /// The last PSN acknowledged (everything up to it is).
    pub acked_psn: u32,
    /// The PSN its responder expects next.
    pub expected_psn: u32,
}

/// Why an area could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The descriptor is not a valid stats area (the segment checks failed).
    #[error("not a shmhca stats area: {0}")]
    Segment(#[from] OpenError),
    /// The area is too short or of another layout version.
    #[error("unsupported stats area: {0}")]
    Layout(String),
    /// The engine was writing on every attempt.
    #[error("the engine kept rewriting the area; try again")]
    Busy,
}

/// Reads an engine's area from a descriptor of its memfd (e.g. opened read-only from
/// `/proc/PID/fd/N`). Everything in it is treated as untrusted input: the segment header
/// is validated by [`Segment::open`] (sealed, sized, of this kind), the layout version,
/// counts and flags are checked against what an engine writes (an area that breaks them
/// is refused with [`ReadError::Layout`] naming the field), unknown states are `None`.
/// The pid in it is the writer's claim ([`Snapshot::pid`]).
///
/// # Errors
/// [`ReadError`] saying what is wrong.
pub fn read(fd: OwnedFd) -> Result<Snapshot, ReadError> {
    let segment = Arc::new(Segment::open(fd, STATS_KIND, Access::ReadOnly, DATA_LEN)?);
    if segment.data_len() < USED {
        return Err(ReadError::Layout(format!(
            "data area of {} bytes, {USED} expected",
            segment.data_len()
        )));
    }
    let mem = Mem::from_segment(segment);
    let gen_word = mem
        .atomic_u32(0)
        .map_err(|_| ReadError::Layout("no generation word".into()))?;
    let mut img = vec![0u8; USED];
    for _ in 0..1000 {
        // SYNC: seqlock reader; pairs with the writer's fence and Release store in
        // `StatsArea::publish`.
        let g1 = gen_word.load(Ordering::Acquire);
        if g1 & 1 == 1 {
            std::hint::spin_loop();
            continue;
        }
        if mem.read(0, &mut img).is_err() {
            return Err(ReadError::Layout("unreadable".into()));
        }
        fence(Ordering::Acquire);
        if gen_word.load(Ordering::Relaxed) == g1 {
            return parse(&img);
        }
    }
    Err(ReadError::Busy)
}

fn parse(img: &[u8]) -> Result<Snapshot, ReadError> {
    let layout = u32_at(img, OFF_LAYOUT);
    if layout != LAYOUT {
        return Err(ReadError::Layout(format!(
            "layout version {layout}, this build reads {LAYOUT}"
        )));
    }
    // Every count and flag is checked against what an engine writes: an area that says
    // otherwise was not written by one and is refused, naming the field.
    let (nq, total, nl) = (u32_at(img, 20), u32_at(img, 24), u32_at(img, 28));
    if nq as usize > MAX_QPS || nq > total {
        return Err(ReadError::Layout(format!(
            "{nq} QPs listed of {total} (at most {MAX_QPS} listed, never more than there are)"
        )));
    }
    if nl as usize > MAX_LINKS {
        return Err(ReadError::Layout(format!(
            "{nl} links listed (at most {MAX_LINKS})"
        )));
    }
    let mode = u32_at(img, 16);
    if mode > 1 {
        return Err(ReadError::Layout(format!("engine mode {mode} (0 or 1)")));
    }
    let (nq, nl) = (nq as usize, nl as usize);
    if let Some(i) = (0..nl).find(|i| u32_at(img, OFF_LINKS + i * LINK_LEN + 4) > 1) {
        return Err(ReadError::Layout(format!(
            "link {i}: up flag {} (0 or 1)",
            u32_at(img, OFF_LINKS + i * LINK_LEN + 4)
        )));
    }
    let mut counters = [0u64; COUNTERS];
    for (i, c) in counters.iter_mut().enumerate() {
        *c = u64_at(img, OFF_COUNTERS + 8 * i);
    }
    let links = (0..nl)
        .map(|i| {
            let at = OFF_LINKS + i * LINK_LEN;
            LinkSnapshot {
                id: u32_at(img, at),
                up: u32_at(img, at + 4) != 0,
                peer_pid: u32_at(img, at + 8),
                qps: u32_at(img, at + 12),
            }
        })
        .collect();
    let qps = (0..nq)
        .map(|i| {
            let at = OFF_QPS + i * QP_LEN;
            let link = u32_at(img, at + 8);
            QpSnapshot {
                qpn: u32_at(img, at),
                state: state_from(u32_at(img, at + 4)),
                link: (link != u32::MAX).then_some(link),
                dest_qpn: u32_at(img, at + 12),
                next_psn: u32_at(img, at + 16),
                acked_psn: u32_at(img, at + 20),
                expected_psn: u32_at(img, at + 24),
            }
        })
        .collect();
    Ok(Snapshot {
        pid: u32_at(img, 8),
        engine_id: u32_at(img, 12),
        poll_mode: mode == 1,
        publishes: u64_at(img, 32),
        counters,
        links,
        qps,
        total_qps: total,
    })
}

fn state_from(v: u32) -> Option<QpState> {
    [
        QpState::Reset,
        QpState::Init,
        QpState::Rtr,
        QpState::Rts,
        QpState::Sqd,
        QpState::Sqe,
        QpState::Error,
    ]
    .into_iter()
    .find(|s| *s as u32 == v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_area_reads_back_what_was_published() {
        let ctx = crate::ContextBuilder::default()
            .mode(crate::EngineMode::Inline)
            .huge_pages(HugePages::Never)
            .arena_size(1 << 20)
            .build()
            .unwrap();
        for _ in 0..2 * PUBLISH_EVERY {
            ctx.progress();
        }
        let fd = ctx
            .shared
            .engine
            .with(|e| e.stats_area.as_ref().map(|a| a._segment.try_clone_fd()))
            .expect("the engine has a stats area")
            .unwrap();
        let s = read(fd).unwrap();
        assert_eq!(s.pid, std::process::id());
        assert!(!s.poll_mode);
        assert!(s.publishes >= 1);
        assert!(s.qps.is_empty() && s.links.is_empty());
    }

    /// An image as an engine writes it, with `edit` applied, parsed.
    fn parse_edited(edit: impl FnOnce(&mut [u8])) -> Result<Snapshot, ReadError> {
        let mut img = vec![0u8; USED];
        put_u32(&mut img, OFF_LAYOUT, LAYOUT);
        put_u32(&mut img, 20, 1);
        put_u32(&mut img, 24, 3);
        put_u32(&mut img, 28, 1);
        put_u32(&mut img, OFF_LINKS + 4, 1);
        edit(&mut img);
        parse(&img)
    }

    #[test]
    fn counts_and_flags_beyond_what_an_engine_writes_are_refused() {
        let s = parse_edited(|_| {}).unwrap();
        assert_eq!((s.qps.len(), s.total_qps, s.links.len()), (1, 3, 1));
        assert!(s.links[0].up && !s.poll_mode);
        // At the edges: accepted.
        let s = parse_edited(|b| {
            put_u32(b, 20, MAX_QPS as u32);
            put_u32(b, 24, MAX_QPS as u32);
            put_u32(b, 28, MAX_LINKS as u32);
            put_u32(b, 16, 1);
        })
        .unwrap();
        assert_eq!(
            (s.qps.len(), s.links.len(), s.poll_mode),
            (MAX_QPS, MAX_LINKS, true)
        );
        // A second link's flags are checked too; beyond the listed ones nothing is.
        let s = parse_edited(|b| put_u32(b, OFF_LINKS + LINK_LEN + 4, 2)).unwrap();
        assert_eq!(s.links.len(), 1);
        for (what, edit) in [
            (
                "QPs listed",
                (|b: &mut [u8]| put_u32(b, 20, 4)) as fn(&mut [u8]),
            ),
            ("QPs listed", |b| {
                put_u32(b, 20, MAX_QPS as u32 + 1);
                put_u32(b, 24, u32::MAX);
            }),
            ("links listed", |b| put_u32(b, 28, MAX_LINKS as u32 + 1)),
            ("engine mode", |b| put_u32(b, 16, 2)),
            ("up flag", |b| put_u32(b, OFF_LINKS + 4, 2)),
            ("link 1: up flag", |b| {
                put_u32(b, 28, 2);
                put_u32(b, OFF_LINKS + LINK_LEN + 4, 2);
            }),
        ] {
            match parse_edited(edit) {
                Err(ReadError::Layout(m)) => assert!(m.contains(what), "{m}"),
                other => panic!("{what}: {other:?}"),
            }
        }
    }

    /// Each counter is published at the place its name has in [`COUNTER_NAMES`] (the
    /// last ones, the notification point's, included), and the area keeps its size.
    #[test]
    fn the_counters_are_in_the_order_of_their_names() {
        let s = Stats {
            packets_sent: 1,
            acks_riding: 19,
            cnps_received: 24,
            encode_dropped: 27,
            ce_marked_received: 28,
            cnps_sent: 29,
            ..Stats::default()
        };
        let c = counters(&s);
        let at = |name: &str| COUNTER_NAMES.iter().position(|n| *n == name).unwrap();
        for (name, v) in [
            ("packets_sent", 1),
            ("acks_riding", 19),
            ("cnps_received", 24),
            ("encode_dropped", 27),
            ("ce_marked_received", 28),
            ("cnps_sent", 29),
        ] {
            assert_eq!(c[at(name)], v, "{name}");
        }
        assert_eq!(c.iter().filter(|v| **v != 0).count(), 6);
        assert_eq!((LAYOUT, OFF_LINKS, DATA_LEN), (5, 512, 8192));
        // Published and read back through the image.
        let mut img = vec![0u8; USED];
        put_u32(&mut img, OFF_LAYOUT, LAYOUT);
        for (i, v) in c.iter().enumerate() {
            put_u64(&mut img, OFF_COUNTERS + 8 * i, *v);
        }
        assert_eq!(parse(&img).unwrap().counters, c);
        // An area of the layout before is refused, naming both versions.
        put_u32(&mut img, OFF_LAYOUT, 4);
        match parse(&img) {
            Err(ReadError::Layout(m)) => assert!(m.contains("layout version 4"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn other_segments_are_refused() {
        let seg = Segment::builder(0x1234, 4096)
            .huge_pages(HugePages::Never)
            .create()
            .unwrap();
        assert!(matches!(
            read(seg.try_clone_fd().unwrap()),
            Err(ReadError::Segment(OpenError::WrongKind { .. }))
        ));
    }
}
