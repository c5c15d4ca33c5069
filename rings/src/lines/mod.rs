//! A single-producer single-consumer ring of stamped 64-byte lines, with no tail index: a
//! packet (a *frame* of 1 to [`MAX_FRAME_LINES`] lines) announces itself with a sequence
//! stamp in its own first line, so a consumer learns that a small packet arrived, and reads
//! it, in one cache line. Usable in one process ([`heap_lines`]) or between two processes
//! through a [`Segment`] ([`init_shm_lines`], [`shm_lines_producer`], [`shm_lines_consumer`]).
//!
//! # A line
//!
//! ```text
//! bytes 0..4   stamp (u32 LE), owned by the ring: stamp(i) = lap(i) + 1, lap(i) = i / capacity
//! byte  4      first line of a frame: its line count, 1..=16; continuation line: 0;
//!              first line of a padding frame: PADDING (0xFF). Owned by the ring.
//! bytes 5..64  the user's
//! ```
//!
//! Line `i` (a free-running `u64` index) lives at position `i % capacity`. Zeroed memory
//! carries stamp 0, "not yet written in lap 0"; in general a line whose stamp is the
//! expected one minus 1 is stale (written one lap ago), anything else is impossible.
//! Every line is written exactly once per lap (by a frame or a padding frame), which is what
//! makes "expected or expected − 1" the whole truth.
//!
//! # Protocol
//!
//! * The producer reserves `n` contiguous lines ([`LinesProducer::reserve`]), writes the
//!   user bytes ([`Frame::write_line`]) and commits ([`Frame::commit`]): it stores the
//!   first 8 bytes of each continuation line (stamp, 0, user bytes 5..8), then the first 8
//!   bytes of the first line (stamp, `n`, user bytes 5..8) with one Release store, **last**.
//!   Frames never wrap: when `n` lines do not fit before the end of the ring, the producer
//!   first writes a *padding frame* over the rest of the lap (every line of it stamped, the
//!   first with count [`PADDING`]) and the frame goes at the start of the next lap.
//! * The consumer ([`LinesConsumer::recv`]) loads the first 8 bytes of the line at its
//!   index with Acquire. Stamp = expected: a frame; it copies the frame's lines into the
//!   caller's private array (the one copy), then checks every continuation line's stamp and
//!   count byte in that copy. Stamp = expected − 1: empty. A padding frame is skipped.
//! * There is no tail index. The consumer's index (*head*) is published lazily, with a
//!   Release store after the copy: whenever it has moved a quarter of the capacity past the
//!   last published value, and whenever the consumer finds the ring empty with unpublished
//!   progress (so a producer waiting for room always sees it eventually; a producer that
//!   needs more than three quarters of the ring would otherwise wait forever). The producer
//!   reloads head (Acquire) only when its cached copy says there is no room.
//!
//! # Trust
//!
//! Both ends keep capacity and their own index in private memory. The consumer trusts no
//! byte it reads from the ring: a first-line stamp that is neither expected nor stale, a
//! line count of 0 or above [`MAX_FRAME_LINES`], a frame running past the end of the ring,
//! padding at the start of a lap, or a continuation line without this lap's stamp and a
//! zero count is reported as [`LinkBroken`] naming the [`Violation`], and the ring stays
//! broken. The caller sees only its private copy, whose first 8 bytes are the validated
//! ones. The producer checks every head it loads: it only moves forward and never passes
//! what was produced. Nothing a peer writes can make this code panic, read or write out of
//! bounds, or loop (a receive looks at most at two first lines: a padding, then a frame).
//!
//! # Examples
//!
//! ```
//! use shmhca_rings::lines::{heap_lines, Line, MAX_FRAME_LINES};
//!
//! let (mut tx, mut rx) = heap_lines(64).unwrap();
//! let mut line = Line::ZERO;
//! line.0[8..13].copy_from_slice(b"hello");
//! let mut frame = tx.reserve(1).unwrap().expect("room");
//! frame.write_line(0, &line).unwrap();
//! frame.commit();
//!
//! let mut out = [Line::ZERO; MAX_FRAME_LINES];
//! assert_eq!(rx.recv(&mut out).unwrap(), Some(1));
//! assert_eq!(&out[0].0[8..13], b"hello");
//! assert_eq!(rx.recv(&mut out).unwrap(), None);
//! ```

// Calls into the storage's unsafe line accessors under the protocol above; each unsafe
// block says which part of it makes the access sound.
#![allow(unsafe_code)]

mod storage;

use std::fmt;
use std::sync::Arc;

use bytemuck::{Pod, Zeroable};

use crate::ring::{LinkBroken, RingInitError, RingOpenError, Violation, check_capacity};
use crate::segment::{Access, Segment};
use crate::sync::{self, Ordering};
use storage::{End, RawLines};
pub use storage::{HeapLines, LineStorage, ShmLines};

/// Bytes in a line (one cache line).
pub const LINE_BYTES: usize = 64;
/// The most lines one frame may span.
pub const MAX_FRAME_LINES: usize = 16;
/// The first byte of a line that belongs to the user (bytes 0..5 are the ring's).
pub const USER_START: usize = 5;
/// The count byte (byte 4) of a padding frame's first line.
pub const PADDING: u8 = 0xFF;
/// How many lines past a frame just committed the producer asks to own for writing
/// (`PREFETCHW` on x86-64; see [`Frame::commit`]).
///
/// The consumer has read the line the producer writes next (a lap ago) and holds a copy,
/// so the producer's first store to it must take the line from the consumer's core first:
/// a cross-core round trip. Without the hint these round trips start one at a time as the
/// stores reach them and the producer runs at their pace; with it, the line two frames
/// ahead is on its way while the producer builds the next packet. Measured with
/// `shmhca-perf send_bw -s 8` (2 vCPUs of an AMD EPYC under KVM, `--cpu 0,1`, paired
/// rounds): 6.4 → 19.0 Mpps where a line takes ~0.23 µs between the two cores (both with
/// post list 1 and 32), +8% with post list 1 (24.5 → 26.6) where it takes ~0.06 µs, and
/// `send_lat -s 8` unchanged. 1 line ahead gave 16.3, 3 gave 18.9, 4 gave 18.3 but cost
/// `send_lat` 0.15 → 0.17 µs on the fast pairing, 8 gave nothing (6.7).
pub const PREFETCH_AHEAD: usize = 2;
/// Magic number at the start of a shared line ring ("SHMLINES" in little-endian bytes).
pub const LINES_MAGIC: u64 = u64::from_le_bytes(*b"SHMLINES");
/// Layout version of a shared line ring.
pub const LINES_VERSION: u32 = 1;
/// Required alignment of a shared line ring's offset inside a segment's data area.
pub const LINES_ALIGN: usize = storage::LINES_ALIGN;

/// One 64-byte, 64-aligned line. In the ring, bytes 0..5 are the ring's (stamp and count
/// byte) and bytes 5..64 the user's; a [`Line`] the caller holds is private memory.
#[repr(C, align(64))]
#[derive(Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
pub struct Line(pub [u8; LINE_BYTES]);

impl Line {
    /// A line of zero bytes.
    pub const ZERO: Line = Line([0; LINE_BYTES]);

    /// The stamp (bytes 0..4, little-endian).
    pub fn stamp(&self) -> u32 {
        u32::from_le_bytes([self.0[0], self.0[1], self.0[2], self.0[3]])
    }

    /// The count byte (byte 4): a frame's line count in its first line, 0 in a
    /// continuation line.
    pub fn count(&self) -> u8 {
        self.0[4]
    }

    // In line across crates in a build without LTO (a program's own profile may run none):

    // this is called per message.
    #[inline]
    fn set_word(&mut self, word: u64) {
        self.0[..8].copy_from_slice(&word.to_le_bytes());
    }
}

impl Default for Line {
    fn default() -> Self {
        Line::ZERO
    }
}

impl fmt::Debug for Line {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Line")
            .field("stamp", &self.stamp())
            .field("count", &self.count())
            .field("user", &&self.0[USER_START..])
            .finish()
    }
}

/// Set in a consumer's expected and stale stamp keys once its ring is broken: no 32-bit
/// stamp equals either then.
const BROKEN_KEY: u64 = 1 << 32;

/// The first word of a line: stamp, count byte, and the user's bytes 5..8.
#[inline(always)]
fn word(stamp: u32, count: u8, user: [u8; 3]) -> u64 {
    u64::from(stamp)
        | u64::from(count) << 32
        | u64::from(user[0]) << 40
        | u64::from(user[1]) << 48
        | u64::from(user[2]) << 56
}

#[inline(always)]
fn word_stamp(word: u64) -> u32 {
    word as u32
}

#[inline(always)]
fn word_count(word: u64) -> u8 {
    (word >> 32) as u8
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

/// Why [`LinesProducer::reserve`] could not reserve.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReserveError {
    /// A frame of 0 lines, or of more than [`MAX_FRAME_LINES`] or the ring's capacity.
    #[error(
        "a frame of {lines} lines cannot be reserved: frames span 1..={max} lines on this ring"
    )]
    FrameSize {
        /// Lines asked for.
        lines: usize,
        /// The most a frame may span on this ring.
        max: usize,
    },
    /// The ring is broken.
    #[error(transparent)]
    Broken(#[from] LinkBroken),
}

/// [`Frame::write_line`] was given a line index outside the frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line} is outside this {lines}-line frame: reserve as many lines as you write")]
pub struct LineOutOfFrame {
    /// The line index given.
    pub line: usize,
    /// Lines in the frame.
    pub lines: usize,
}

// ---------------------------------------------------------------------------------------
// Construction
// ---------------------------------------------------------------------------------------

/// A line ring of `capacity` lines on the heap, for use inside one process (and for the
/// loom models).
///
/// # Errors
///
/// [`CapacityError`](crate::ring::CapacityError) if `capacity` is 0, not a power of two or
/// above [`MAX_CAPACITY`](crate::ring::MAX_CAPACITY).
pub fn heap_lines(
    capacity: usize,
) -> Result<(LinesProducer<HeapLines>, LinesConsumer<HeapLines>), crate::ring::CapacityError> {
    check_capacity(capacity)?;
    let (p, c) = HeapLines::new_pair(capacity);
    Ok((LinesProducer::new(p, 0, 0), LinesConsumer::new(c, 0)))
}

/// Bytes a shared line ring of `capacity` lines occupies (header and lines).
///
/// # Errors
///
/// [`CapacityError`](crate::ring::CapacityError) if `capacity` is unusable or the size
/// overflows.
pub fn shm_lines_bytes(capacity: usize) -> Result<usize, crate::ring::CapacityError> {
    check_capacity(capacity)?;
    capacity
        .checked_mul(LINE_BYTES)
        .and_then(|n| n.checked_add(storage::LINES_OFFSET))
        .filter(|&n| isize::try_from(n).is_ok())
        .ok_or(crate::ring::CapacityError::TooLarge { capacity })
}

/// Initialises a shared line ring of `capacity` lines at `offset` in `seg`'s data area:
/// writes its header, zeroes head, attach flags and every line. Call it before handing the
/// segment to the peer, and never while either end is attached.
///
/// # Errors
///
/// [`RingInitError`] says why: bad capacity, read-only segment, misaligned offset, or the
/// ring does not fit.
pub fn init_shm_lines(seg: &Segment, offset: usize, capacity: usize) -> Result<(), RingInitError> {
    let needed = shm_lines_bytes(capacity)?;
    if seg.access() != Access::ReadWrite {
        return Err(RingInitError::SegmentReadOnly);
    }
    if !offset.is_multiple_of(LINES_ALIGN) {
        return Err(RingInitError::Misaligned { offset });
    }
    let does_not_fit = RingInitError::DoesNotFit {
        needed,
        offset,
        data_len: seg.data_len(),
    };
    if offset
        .checked_add(needed)
        .is_none_or(|end| end > seg.data_len())
    {
        return Err(does_not_fit);
    }
    let zeros = [0u8; 4096];
    let mut at = offset;
    while at < offset + needed {
        let n = zeros.len().min(offset + needed - at);
        seg.write_at(at, &zeros[..n]).map_err(|_| does_not_fit)?;
        at += n;
    }
    let meta = storage::LinesMeta {
        magic: LINES_MAGIC,
        version: LINES_VERSION,
        line_size: LINE_BYTES as u32,
        capacity: capacity as u64,
    };
    seg.write_at(offset, bytemuck::bytes_of(&meta))
        .map_err(|_| does_not_fit)?;
    Ok(())
}

/// Validates the shared line ring header at `offset`; returns the capacity.
fn validate_shm_lines(seg: &Segment, offset: usize) -> Result<usize, RingOpenError> {
    if seg.access() != Access::ReadWrite {
        return Err(RingOpenError::SegmentReadOnly);
    }
    if !offset.is_multiple_of(LINES_ALIGN) {
        return Err(RingOpenError::Misaligned { offset });
    }
    let data_len = seg.data_len();
    if offset
        .checked_add(storage::LINES_OFFSET)
        .is_none_or(|end| end > data_len)
    {
        return Err(RingOpenError::HeaderOutOfBounds { offset, data_len });
    }
    // Copy the header out once; everything below judges the private copy.
    let mut raw = [0u8; size_of::<storage::LinesMeta>()];
    seg.read_at(offset, &mut raw)
        .map_err(|_| RingOpenError::HeaderOutOfBounds { offset, data_len })?;
    let meta: storage::LinesMeta = bytemuck::pod_read_unaligned(&raw);
    if meta.magic != LINES_MAGIC {
        return Err(RingOpenError::BadLinesMagic { found: meta.magic });
    }
    if meta.version != LINES_VERSION {
        return Err(RingOpenError::VersionMismatch {
            found: meta.version,
            expected: LINES_VERSION,
        });
    }
    if meta.line_size as usize != LINE_BYTES {
        return Err(RingOpenError::SlotSizeMismatch {
            expected: LINE_BYTES,
            found: meta.line_size,
        });
    }
    let capacity = usize::try_from(meta.capacity)
        .ok()
        .filter(|&c| check_capacity(c).is_ok())
        .ok_or(RingOpenError::BadCapacity {
            found: meta.capacity,
        })?;
    let needed = meta.capacity * LINE_BYTES as u64 + storage::LINES_OFFSET as u64;
    if offset as u64 + needed > data_len as u64 {
        return Err(RingOpenError::DoesNotFit {
            needed,
            offset,
            data_len,
        });
    }
    Ok(capacity)
}

/// Attaches the producer end of the shared line ring at `offset` in `seg`.
///
/// Each end is claimed with a flag in the header and released when the returned end is
/// dropped; a producer that is dropped leaves its index in the header for the next one
/// (the ring itself has no tail index). A process that dies holding an end leaves it
/// claimed, so a ring is not reattached after a crash (a new link gets new rings).
///
/// # Errors
///
/// [`RingOpenError`] if the segment is read-only, no valid line ring is there, another
/// producer is attached, or the indices are already inconsistent.
pub fn shm_lines_producer(
    seg: Arc<Segment>,
    offset: usize,
) -> Result<LinesProducer<ShmLines>, RingOpenError> {
    let capacity = validate_shm_lines(&seg, offset)?;
    let storage = ShmLines::new(seg, offset, capacity, End::Producer);
    if !storage.claim() {
        return Err(RingOpenError::AlreadyAttached { end: "producer" });
    }
    let tail = storage.parked_tail();
    // SYNC: Acquire pairs with the Release store of head in LinesConsumer::publish.
    let head = storage.load_head(Ordering::Acquire);
    let mut producer = LinesProducer::new(storage, tail, tail.wrapping_sub(capacity as u64));
    producer.accept_head(head)?;
    Ok(producer)
}

/// Attaches the consumer end of the shared line ring at `offset` in `seg`. Claimed like
/// the producer end (see [`shm_lines_producer`]); a consumer that is dropped publishes its
/// index first.
///
/// # Errors
///
/// [`RingOpenError`] if the segment is read-only, no valid line ring is there, or another
/// consumer is attached.
pub fn shm_lines_consumer(
    seg: Arc<Segment>,
    offset: usize,
) -> Result<LinesConsumer<ShmLines>, RingOpenError> {
    let capacity = validate_shm_lines(&seg, offset)?;
    let storage = ShmLines::new(seg, offset, capacity, End::Consumer);
    if !storage.claim() {
        return Err(RingOpenError::AlreadyAttached { end: "consumer" });
    }
    // Our own index: no one else may write it.
    let head = storage.load_head(Ordering::Relaxed);
    Ok(LinesConsumer::new(storage, head))
}

// ---------------------------------------------------------------------------------------
// Producer
// ---------------------------------------------------------------------------------------

/// The writing end of a line ring. `Send`; one per ring.
pub struct LinesProducer<S: LineStorage> {
    storage: S,
    /// The next line to write; authoritative (never published: stamps say it all).
    tail: u64,
    /// The consumer's index as last loaded and validated.
    cached_head: u64,
    capacity: usize,
    /// log2(capacity): lap(i) = i >> shift.
    shift: u32,
    broken: Option<LinkBroken>,
}

impl<S: LineStorage + fmt::Debug> fmt::Debug for LinesProducer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinesProducer")
            .field("tail", &self.tail)
            .field("cached_head", &self.cached_head)
            .field("capacity", &self.capacity)
            .field("broken", &self.broken)
            .field("storage", &self.storage)
            .finish()
    }
}

#[inline(always)]
fn stamp_of(index: u64, shift: u32) -> u32 {
    ((index >> shift) as u32).wrapping_add(1)
}

impl<S: LineStorage> LinesProducer<S> {
    fn new(storage: S, tail: u64, cached_head: u64) -> Self {
        let capacity = storage.capacity();
        LinesProducer {
            storage,
            tail,
            cached_head,
            capacity,
            shift: capacity.trailing_zeros(),
            broken: None,
        }
    }

    /// Lines in the ring.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The most lines one frame may span on this ring: [`MAX_FRAME_LINES`], or the
    /// capacity if it is smaller.
    pub fn max_frame_lines(&self) -> usize {
        MAX_FRAME_LINES.min(self.capacity)
    }

    /// The index of the next line to be written (lines produced so far, padding included).
    pub fn tail(&self) -> u64 {
        self.tail
    }

    #[inline(always)]
    fn pos(&self, index: u64) -> usize {
        (index as usize) & (self.capacity - 1)
    }

    #[inline(always)]
    fn cached_free(&self) -> usize {
        // tail - cached_head ≤ capacity is an invariant (checked on every head load).
        self.capacity - self.tail.wrapping_sub(self.cached_head) as usize
    }

    /// Validates a head loaded from the consumer and caches it.
    fn accept_head(&mut self, head: u64) -> Result<usize, LinkBroken> {
        if let Err(broken) = crate::ring::check_head(head, self.cached_head, self.tail) {
            self.broken = Some(broken);
            return Err(broken);
        }
        self.cached_head = head;
        Ok(self.cached_free())
    }

    #[cold]
    #[inline(never)]
    fn refresh_head(&mut self) -> Result<usize, LinkBroken> {
        // SYNC: Acquire pairs with the Release store of head in LinesConsumer::publish: the
        // consumer's copies out of the lines it released happen before we overwrite them.
        let head = self
            .storage
            .load_head(sync::weaken(Ordering::Acquire, "Lines::load_head"));
        self.accept_head(head)
    }

    /// True if `lines` lines are free from tail, reloading head only if the cached one
    /// says they are not.
    #[inline(always)]
    fn room_for(&mut self, lines: usize) -> Result<bool, LinkBroken> {
        if self.cached_free() >= lines {
            return Ok(true);
        }
        Ok(self.refresh_head()? >= lines)
    }

    /// Lines free for writing now (reloads the consumer's index).
    ///
    /// # Errors
    ///
    /// [`LinkBroken`] if the consumer's index is impossible (now or earlier).
    pub fn free_lines(&mut self) -> Result<usize, LinkBroken> {
        if let Some(broken) = self.broken {
            return Err(broken);
        }
        self.refresh_head()
    }

    /// Stores the first word of the frame at `pos` (stamp last, Release).
    #[inline(always)]
    fn store_first(&self, pos: usize, word: u64) {
        // SYNC: Release pairs with the Acquire load of the stamp in LinesConsumer::next_frame:
        // the frame's continuation words and every user byte written before this store are
        // visible to a consumer that sees the stamp. (On x86 this is a plain store.)
        self.storage.store_word(
            pos,
            word,
            sync::weaken(Ordering::Release, "Lines::store_stamp"),
        );
    }

    /// Fills the `pad` lines from `pos` to the end of the ring with a padding frame.
    #[cold]
    fn write_padding(&mut self, pos: usize, pad: usize) {
        let stamp = stamp_of(self.tail, self.shift);
        for i in 1..pad {
            // Every line is written once per lap, so that the consumer's "expected or
            // expected − 1" holds for lines a padding skipped (see the module).
            self.storage
                .store_word(pos + i, word(stamp, 0, [0; 3]), Ordering::Relaxed);
        }
        self.store_first(pos, word(stamp, PADDING, [0; 3]));
        self.tail = self.tail.wrapping_add(pad as u64);
    }

    /// Reserves a frame of `lines` contiguous lines, or `None` if there is no room now (the
    /// consumer has not released enough). When the frame does not fit before the end of the
    /// ring, the rest of the lap is given to a padding frame first (published at once, even
    /// if the frame itself must wait). Nothing of the frame is visible to the consumer until
    /// [`Frame::commit`]; dropping the frame publishes nothing.
    ///
    /// # Errors
    ///
    /// [`ReserveError::FrameSize`] for 0 lines or more than
    /// [`max_frame_lines`](Self::max_frame_lines); [`ReserveError::Broken`] if the ring is
    /// broken.
    #[inline(always)]
    pub fn reserve(&mut self, lines: usize) -> Result<Option<Frame<'_, S>>, ReserveError> {
        if let Some(broken) = self.broken {
            return Err(broken.into());
        }
        if lines == 0 || lines > self.max_frame_lines() {
            return Err(ReserveError::FrameSize {
                lines,
                max: self.max_frame_lines(),
            });
        }
        let pos = self.pos(self.tail);
        if pos + lines > self.capacity {
            let pad = self.capacity - pos;
            if !self.room_for(pad)? {
                return Ok(None);
            }
            self.write_padding(pos, pad);
        }
        if !self.room_for(lines)? {
            return Ok(None);
        }
        let pos = self.pos(self.tail);
        // (Mutation point of the loom models: the stamp published before the data.)
        if sync::mutated("Lines::stamp_before_data") {
            let stamp = stamp_of(self.tail, self.shift);
            self.store_first(pos, word(stamp, lines as u8, [0; 3]));
        }
        Ok(Some(Frame {
            producer: self,
            pos,
            lines,
            user: [[0; 3]; MAX_FRAME_LINES],
        }))
    }
}

impl<S: LineStorage> LinesProducer<S> {
    /// Publishes `line` as a one-line frame at once: what [`reserve`](Self::reserve)`(1)`,
    /// [`Frame::write_line`]`(0, line)` and [`Frame::commit`] do, in one step and without
    /// a [`Frame`] (a one-line frame never needs padding: it always fits before the ring's
    /// end). For a sender that built its packet in private memory and wants it out now;
    /// the stamp it stores last is the doorbell. Returns false, writing nothing, if there
    /// is no room now.
    ///
    /// # Errors
    ///
    /// [`LinkBroken`] if the ring is broken (nothing is written).
    #[inline(always)]
    pub fn push_line(&mut self, line: &Line) -> Result<bool, LinkBroken> {
        if self.broken.is_some() || self.cached_free() == 0 {
            // Out of line, so that the common case needs no stack frame.
            return self.push_line_slow(line);
        }
        self.write_one(line);
        Ok(true)
    }

    /// [`push_line`](Self::push_line) when the ring is broken or looks full.
    #[cold]
    #[inline(never)]
    fn push_line_slow(&mut self, line: &Line) -> Result<bool, LinkBroken> {
        if let Some(broken) = self.broken {
            return Err(broken);
        }
        if !self.room_for(1)? {
            return Ok(false);
        }
        self.write_one(line);
        Ok(true)
    }

    /// Writes `line` as a one-line frame at tail and publishes it; the line is free.
    #[inline(always)]
    fn write_one(&mut self, line: &Line) {
        debug_assert!(self.cached_free() >= 1);
        let pos = self.pos(self.tail);
        let stamp = stamp_of(self.tail, self.shift);
        // (Mutation point of the loom models: the stamp published before the data.)
        if sync::mutated("Lines::stamp_before_data") {
            self.store_first(pos, word(stamp, 1, [0; 3]));
        }
        // SAFETY: the line at `pos` is free (the callers' room check, against a head loaded
        // with Acquire: the consumer released it) and the consumer cannot read it before
        // its stamp is stored, below.
        unsafe { self.storage.write_body(pos, line) };
        // The first word: the stamp, a count of 1 and the line's user bytes 5..8 (its
        // bytes 0..5, the ring's, replaced), as `word` builds it.
        let head = u64::from_le_bytes([0, 0, 0, 0, 0, line.0[5], line.0[6], line.0[7]]);
        self.store_first(pos, head | word(stamp, 1, [0; 3]));
        self.storage.prefetch_for_write(pos + 1 + PREFETCH_AHEAD);
        self.tail = self.tail.wrapping_add(1);
    }
}

impl<S: LineStorage> Drop for LinesProducer<S> {
    fn drop(&mut self) {
        // A shared ring keeps our index for the next producer (no-op on the heap).
        self.storage.park_tail(self.tail);
    }
}

/// A reserved frame of a [`LinesProducer`]: write its lines' user bytes, then
/// [`commit`](Frame::commit). Lines not written keep whatever user bytes they held.
pub struct Frame<'a, S: LineStorage> {
    producer: &'a mut LinesProducer<S>,
    pos: usize,
    lines: usize,
    /// User bytes 5..8 of each line: they share the first word with the stamp, which is
    /// stored at commit.
    user: [[u8; 3]; MAX_FRAME_LINES],
}

impl<S: LineStorage> fmt::Debug for Frame<'_, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Frame")
            .field("index", &self.producer.tail)
            .field("lines", &self.lines)
            .finish_non_exhaustive()
    }
}

impl<S: LineStorage> Frame<'_, S> {
    /// Lines in the frame.
    pub fn lines(&self) -> usize {
        self.lines
    }

    /// Writes the user bytes (5..64) of `line` as line `index` of the frame; its bytes
    /// 0..5 are ignored (the ring's). Rewriting a line is fine.
    ///
    /// # Errors
    ///
    /// [`LineOutOfFrame`] if `index` is not below [`lines`](Self::lines).
    #[inline(always)]
    pub fn write_line(&mut self, index: usize, line: &Line) -> Result<(), LineOutOfFrame> {
        if index >= self.lines {
            return Err(LineOutOfFrame {
                line: index,
                lines: self.lines,
            });
        }
        self.user[index] = [line.0[5], line.0[6], line.0[7]];
        // SAFETY: the line is inside the reserved frame (index < lines and the frame does
        // not wrap), which the consumer released (room_for) and cannot read before commit.
        unsafe { self.producer.storage.write_body(self.pos + index, line) };
        Ok(())
    }

    /// Writes `lines` as the frame's first lines (see [`write_line`](Self::write_line)).
    ///
    /// # Errors
    ///
    /// [`LineOutOfFrame`] if there are more of them than the frame has (nothing is written
    /// then).
    pub fn write_lines(&mut self, lines: &[Line]) -> Result<(), LineOutOfFrame> {
        if lines.len() > self.lines {
            return Err(LineOutOfFrame {
                line: lines.len() - 1,
                lines: self.lines,
            });
        }
        for (i, line) in lines.iter().enumerate() {
            self.write_line(i, line)?;
        }
        Ok(())
    }

    /// Publishes the frame: continuation lines' stamps, then the first line's stamp and
    /// count with one Release store. Then asks for the line [`PREFETCH_AHEAD`] lines past
    /// the frame, owned for writing (a hint: no store, no effect on the consumer's view
    /// beyond taking that line's copy from its cache a little early).
    #[inline(always)]
    pub fn commit(self) {
        let p = self.producer;
        let stamp = stamp_of(p.tail, p.shift);
        for i in 1..self.lines {
            p.storage.store_word(
                self.pos + i,
                word(stamp, 0, self.user[i]),
                Ordering::Relaxed,
            );
        }
        p.store_first(self.pos, word(stamp, self.lines as u8, self.user[0]));
        p.storage
            .prefetch_for_write(self.pos + self.lines + PREFETCH_AHEAD);
        p.tail = p.tail.wrapping_add(self.lines as u64);
    }
}

// ---------------------------------------------------------------------------------------
// Consumer
// ---------------------------------------------------------------------------------------

/// The reading end of a line ring. `Send`; one per ring.
pub struct LinesConsumer<S: LineStorage> {
    storage: S,
    /// The next line to read; authoritative.
    head: u64,
    /// Where `head` is in the ring, and the stamp its line carries once written (in the
    /// low 32 bits; with [`BROKEN_KEY`] set once the ring is broken, so that no stamp read
    /// matches it and a look at a broken ring takes the slow path).
    head_pos: usize,
    head_stamp: u64,
    /// The stamp of head's line when it is stale (one lap old: the ring is empty there),
    /// with [`BROKEN_KEY`] set once the ring is broken.
    head_stale: u64,
    /// The value of head last stored for the producer.
    published: u64,
    capacity: usize,
    shift: u32,
    /// Publish head when it is this far past `published`: a quarter of the capacity.
    publish_every: u64,
    broken: Option<LinkBroken>,
    /// Where head was when [`LinesConsumer::look`] last found a frame of one line there
    /// (`u64::MAX`: none found): the only line [`LinesConsumer::release_lone`] may
    /// release, and only while head is still there (debug builds check it; the check in
    /// release builds cost the engine's straight receive 15 instructions a Send and its
    /// Read round trip 22).
    #[cfg(debug_assertions)]
    lone_at: u64,
}

impl<S: LineStorage + fmt::Debug> fmt::Debug for LinesConsumer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinesConsumer")
            .field("head", &self.head)
            .field("published", &self.published)
            .field("capacity", &self.capacity)
            .field("broken", &self.broken)
            .field("storage", &self.storage)
            .finish()
    }
}

impl<S: LineStorage> LinesConsumer<S> {
    fn new(storage: S, head: u64) -> Self {
        let capacity = storage.capacity();
        LinesConsumer {
            storage,
            head,
            head_pos: (head as usize) & (capacity - 1),
            head_stamp: u64::from(stamp_of(head, capacity.trailing_zeros())),
            head_stale: u64::from(stamp_of(head, capacity.trailing_zeros()).wrapping_sub(1)),
            published: head,
            capacity,
            shift: capacity.trailing_zeros(),
            publish_every: (capacity as u64 / 4).max(1),
            broken: None,
            #[cfg(debug_assertions)]
            lone_at: u64::MAX,
        }
    }

    /// Lines in the ring.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The index of the next line to be read (lines consumed so far, padding included).
    pub fn head(&self) -> u64 {
        self.head
    }

    #[inline(always)]
    fn pos(&self, index: u64) -> usize {
        (index as usize) & (self.capacity - 1)
    }

    #[cold]
    #[inline(never)]
    fn fail(&mut self, violation: Violation) -> LinkBroken {
        let broken = LinkBroken::new(violation);
        self.broken = Some(broken);
        self.head_stamp |= BROKEN_KEY;
        self.head_stale |= BROKEN_KEY;
        broken
    }

    /// Moves head to `head`.
    #[inline(always)]
    fn set_head(&mut self, head: u64) {
        self.head = head;
        self.head_pos = self.pos(head);
        let stamp = stamp_of(head, self.shift);
        self.head_stamp = u64::from(stamp);
        self.head_stale = u64::from(stamp.wrapping_sub(1));
    }

    /// Stores head for the producer.
    #[inline]
    fn publish(&mut self) {
        self.published = self.head;
        // SYNC: Release pairs with the Acquire load of head in LinesProducer::refresh_head:
        // our copies out of the released lines happen before the producer overwrites them.
        self.storage.store_head(
            self.head,
            sync::weaken(Ordering::Release, "Lines::store_head"),
        );
    }

    /// Publishes head now if it moved since it was last published (the consumer does so
    /// by itself every quarter of the ring and whenever it finds the ring empty).
    pub fn flush(&mut self) {
        if self.head != self.published {
            self.publish();
        }
    }

    /// The validated first word of the frame at head, skipping a padding frame; `None`
    /// when the ring is empty.
    #[inline(always)]
    fn next_frame(&mut self) -> Result<Option<u64>, LinkBroken> {
        // (A broken ring is answered below: no stamp matches its key.)
        // At most two turns: a padding frame (never at a lap's start) moves head to the
        // start of the next lap.
        loop {
            let pos = self.head_pos;
            let expected = self.head_stamp;
            // SYNC: Acquire pairs with the Release store of the first word in
            // LinesProducer::store_first: the frame's lines are complete once we see it.
            let word = self
                .storage
                .load_word(pos, sync::weaken(Ordering::Acquire, "Lines::load_stamp"));
            let stamp = word_stamp(word);
            if u64::from(stamp) != expected {
                if u64::from(stamp) == self.head_stale {
                    // Empty. Give back what we read, so a producer waiting for room
                    // sees it.
                    if self.head != self.published && !sync::mutated("Lines::no_head_when_empty") {
                        self.publish();
                    }
                    return Ok(None);
                }
                if let Some(broken) = self.broken {
                    return Err(broken);
                }
                return Err(self.fail(Violation::StampOutOfRange {
                    index: self.head,
                    found: stamp,
                    expected: expected as u32,
                }));
            }
            let count = word_count(word);
            if count == PADDING {
                if pos == 0 {
                    return Err(self.fail(Violation::FrameOverrunsRing {
                        index: self.head,
                        lines: 0,
                        capacity: self.capacity as u64,
                    }));
                }
                self.set_head(self.head.wrapping_add((self.capacity - pos) as u64));
                continue;
            }
            if count == 0 || usize::from(count) > MAX_FRAME_LINES {
                return Err(self.fail(Violation::BadLineCount {
                    index: self.head,
                    count,
                }));
            }
            if pos + usize::from(count) > self.capacity {
                return Err(self.fail(Violation::FrameOverrunsRing {
                    index: self.head,
                    lines: count,
                    capacity: self.capacity as u64,
                }));
            }
            return Ok(Some(word));
        }
    }

    /// Whether the line at head is still last lap's (nothing new there): one line load,
    /// nothing changed. False when a frame (or a padding frame) waits, or when the producer
    /// wrote something impossible or the ring is broken (the stamp matches neither the next
    /// lap's nor the last one's): [`has_frame`](Self::has_frame) or [`recv`](Self::recv)
    /// then does what is due. For a poll loop's empty case — which also needs head
    /// published ([`head_published`](Self::head_published)), as it is once `has_frame` or
    /// `recv` found the ring empty and nothing was received since.
    #[inline(always)]
    pub fn nothing_at_head(&self) -> bool {
        // SYNC: none needed: a stamp seen stale means only "look again later"; one seen
        // new sends the caller to `recv`, whose Acquire load pairs with the producer's
        // Release store of the stamp.
        let word = self.storage.load_word(self.head_pos, Ordering::Relaxed);
        u64::from(word_stamp(word)) == self.head_stale
    }

    /// Whether nothing waits at head, with head published if so: what
    /// [`has_frame`](Self::has_frame) answers for an empty ring, at the cost of one load
    /// and no validation. False whenever the line at head is not last lap's — a frame, a
    /// padding frame, a line the producer broke, a broken ring — all of which a poll loop
    /// then hands to [`recv`](Self::recv), whose answer is the full one.
    #[inline(always)]
    pub fn empty_at_head(&mut self) -> bool {
        if !self.nothing_at_head() {
            return false;
        }
        self.flush();
        true
    }

    /// One look at head, for a receive step that takes the common lone packet straight
    /// (with [`lone_behind`](Self::lone_behind) and [`release_lone`](Self::release_lone)):
    /// `Some(None)` when the ring is empty there (head then published, as
    /// [`empty_at_head`](Self::empty_at_head) leaves it); `Some(Some(word))` when a frame
    /// or a padding frame starts there — its first word, stamp checked, nothing else —,
    /// with its first line copied into `out` (the copy's first word that word, as `recv`
    /// gives it); `None` for anything else (a stamp out of range, a broken ring), which
    /// [`recv`](Self::recv) then answers. Head stays where it is: the caller decides from
    /// the copy whether it takes the line or leaves the frame to `recv`.
    #[inline(always)]
    pub fn look(&mut self, out: &mut Line) -> Option<Option<u64>> {
        // SYNC: Acquire pairs with the Release store of the first word in
        // LinesProducer::store_first: the line is complete once we see its stamp.
        let word = self.storage.load_word(
            self.head_pos,
            sync::weaken(Ordering::Acquire, "Lines::look"),
        );
        let stamp = u64::from(word_stamp(word));
        if stamp == self.head_stamp {
            // SAFETY: head's line is published (its stamp seen with Acquire just now) and
            // not released (head is where it was); one line at head_pos < capacity.
            unsafe {
                self.storage
                    .read_lines(self.head_pos, std::slice::from_mut(out))
            };
            // The copy's first word may differ if the peer rewrote it meanwhile: keep the
            // one checked.
            out.set_word(word);
            #[cfg(debug_assertions)]
            {
                self.lone_at = if word_count(word) == 1 {
                    self.head
                } else {
                    u64::MAX
                };
            }
            return Some(Some(word));
        }
        if stamp == self.head_stale {
            self.flush();
            return Some(None);
        }
        None
    }

    /// Whether the frame whose first word [`look`](Self::look) returned is a lone line: one
    /// line (not padding, not a longer frame) with nothing behind it yet (the next line
    /// still last lap's). One more load.
    #[inline(always)]
    pub fn lone_behind(&self, first: u64) -> bool {
        if word_count(first) != 1 {
            return false;
        }
        // The line behind it: still last lap's (its lap's stamp minus 1), at the start of
        // the next lap when this one is the lap's last. SYNC: none needed: a stale stamp
        // only means the next frame, if any, comes after this receive.
        let next = self.head_pos + 1;
        let (pos, stale) = if next == self.capacity {
            (0, self.head_stamp)
        } else {
            (next, self.head_stale)
        };
        let behind = self.storage.load_word(pos, Ordering::Relaxed);
        u64::from(word_stamp(behind)) == stale
    }

    /// [`look`](Self::look) and [`lone_behind`](Self::lone_behind) together: the first
    /// word of a lone line at head, or `None` (tests).
    #[cfg(test)]
    fn peek_lone(&mut self, out: &mut Line) -> Option<u64> {
        self.look(out)?.filter(|&w| self.lone_behind(w))
    }

    /// Takes the lone line found at head ([`look`](Self::look) copied it,
    /// [`lone_behind`](Self::lone_behind) found it lone): head moves past it and is
    /// published, as `recv` followed by the `recv` that finds the ring empty behind it
    /// leave it. Only then: unless the last look found a frame of one line where head
    /// still is, head would pass what the producer has not written (or stop in a frame's
    /// middle), and the producer's next frame would be lost without a trace (no undefined
    /// behaviour: the ring's memory is only read and written where it is). Debug builds
    /// panic on such a call.
    #[inline(always)]
    pub fn release_lone(&mut self) {
        #[cfg(debug_assertions)]
        assert_eq!(
            self.lone_at, self.head,
            "release_lone: the last look found no line of one line at head"
        );
        self.set_head(self.head.wrapping_add(1));
        self.publish();
    }

    /// Whether head, where it is now, has been stored for the producer (a producer waiting
    /// for room sees all the room the consumer made).
    pub fn head_published(&self) -> bool {
        self.head == self.published
    }

    /// True if a frame is waiting (skips a padding frame; publishes head when empty, as
    /// [`recv`](Self::recv) does). One line load when the ring is empty.
    ///
    /// # Errors
    ///
    /// [`LinkBroken`] if the producer wrote something impossible (now or earlier).
    pub fn has_frame(&mut self) -> Result<bool, LinkBroken> {
        Ok(self.next_frame()?.is_some())
    }

    /// Copies the next frame into `out` (a private copy: bytes 0..8 of `out[0]` are the
    /// validated stamp, count and user bytes) and returns its line count, or `None` if the
    /// ring is empty.
    ///
    /// # Errors
    ///
    /// [`LinkBroken`] naming the [`Violation`] if the producer wrote something impossible
    /// (now or earlier); the ring stays broken.
    #[inline(always)]
    pub fn recv(&mut self, out: &mut [Line; MAX_FRAME_LINES]) -> Result<Option<usize>, LinkBroken> {
        let Some(first) = self.next_frame()? else {
            return Ok(None);
        };
        let pos = self.head_pos;
        let lines = usize::from(word_count(first));
        let expected = self.head_stamp as u32;
        let next = self.head.wrapping_add(lines as u64);
        // (Mutation point of the loom models: head released before the copy.)
        if sync::mutated("Lines::head_before_copy") {
            self.storage.store_head(next, Ordering::Release);
        }
        if lines == 1 {
            // Most packets: one fixed-size copy, nothing more to check.
            // SAFETY: as below, for one line.
            unsafe { self.storage.read_lines(pos, &mut out[..1]) };
        } else {
            // SAFETY: next_frame checked 1 ≤ lines ≤ MAX_FRAME_LINES (so `out` holds them)
            // and pos + lines ≤ capacity; the frame is published (its stamp seen with
            // Acquire) and the producer will not write these lines again before we release
            // them.
            unsafe { self.storage.read_lines(pos, &mut out[..lines]) };
            for (i, line) in out[1..lines].iter().enumerate() {
                let (stamp, count) = (line.stamp(), line.count());
                if stamp != expected || count != 0 {
                    return Err(self.fail(Violation::BadContinuationLine {
                        index: self.head.wrapping_add(i as u64 + 1),
                        found: stamp,
                        count,
                        expected,
                    }));
                }
            }
        }
        // The copy's first word may differ if the peer rewrote it meanwhile: keep the one
        // we validated.
        out[0].set_word(first);
        self.set_head(next);
        if self.head.wrapping_sub(self.published) >= self.publish_every {
            self.publish();
        }
        Ok(Some(lines))
    }
}

impl<S: LineStorage> Drop for LinesConsumer<S> {
    fn drop(&mut self) {
        if self.broken.is_none() {
            self.flush();
        }
    }
}

#[cfg(all(test, not(shmhca_loom)))]
mod tests {
    use super::*;

    /// The empty look: nothing at head until a frame is committed, whatever head's
    /// publication; head published by the receive that found the ring empty, not by one
    /// that took a frame (short of a quarter of the ring); a padding frame and a broken
    /// ring are not nothing.
    #[test]
    fn nothing_at_head_and_head_published_tell_the_empty_ring_apart() {
        let (mut p, mut c) = heap_lines(64).unwrap();
        let mut out = [Line::ZERO; MAX_FRAME_LINES];
        assert!(c.nothing_at_head() && c.head_published());
        // 30 rounds of 5 one-line frames: over two laps.
        for round in 0..30 {
            for _ in 0..5 {
                p.reserve(1).unwrap().unwrap().commit();
                assert!(!c.nothing_at_head(), "round {round}: a frame waits");
                assert_eq!(c.recv(&mut out).unwrap(), Some(1));
                assert!(c.nothing_at_head(), "round {round}: taken");
            }
            // 5 lines taken since the last publication (every 16): not published.
            assert!(!c.head_published(), "round {round}");
            assert_eq!(c.recv(&mut out).unwrap(), None);
            assert!(
                c.nothing_at_head() && c.head_published(),
                "round {round}: found empty"
            );
        }
        // Head at 150 (position 22): a frame of 3 lines from position 62 pads the lap's
        // last two lines first.
        for _ in 0..40 {
            p.reserve(1).unwrap().unwrap().commit();
            assert_eq!(c.recv(&mut out).unwrap(), Some(1));
        }
        p.reserve(3).unwrap().unwrap().commit();
        assert!(!c.nothing_at_head(), "padding, then a frame");
        assert_eq!(c.recv(&mut out).unwrap(), Some(3));
        assert!(c.nothing_at_head());
        c.fail(Violation::BadLineCount { index: 0, count: 0 });
        assert!(!c.nothing_at_head(), "a broken ring is looked at by recv");
    }

    /// `empty_at_head` answers as `has_frame` does for an empty ring (true, head
    /// published) and says no to everything else — a frame, padding before a frame, a
    /// broken ring — leaving it to `recv`, lap after lap.
    #[test]
    fn empty_at_head_is_has_frames_empty_answer() {
        let (mut p, mut c) = heap_lines(64).unwrap();
        let mut out = [Line::ZERO; MAX_FRAME_LINES];
        assert!(c.empty_at_head() && c.head_published());
        for round in 0..30 {
            for _ in 0..5 {
                p.reserve(1).unwrap().unwrap().commit();
                assert!(!c.empty_at_head(), "round {round}: a frame waits");
                assert_eq!(c.recv(&mut out).unwrap(), Some(1));
            }
            assert!(!c.head_published(), "round {round}");
            assert!(c.empty_at_head(), "round {round}: taken");
            assert!(
                c.head_published(),
                "round {round}: published when found empty"
            );
            assert_eq!(c.has_frame(), Ok(false));
        }
        for _ in 0..40 {
            p.reserve(1).unwrap().unwrap().commit();
            assert_eq!(c.recv(&mut out).unwrap(), Some(1));
        }
        p.reserve(3).unwrap().unwrap().commit();
        assert!(!c.empty_at_head(), "padding, then a frame");
        assert_eq!(c.recv(&mut out).unwrap(), Some(3));
        assert!(c.empty_at_head());
        c.fail(Violation::BadLineCount { index: 0, count: 0 });
        assert!(!c.empty_at_head(), "a broken ring is looked at by recv");
    }

    /// `look` and `lone_behind` find a one-line frame with nothing behind it, lap after
    /// lap and at a lap's last line (the line behind it is the next lap's first); `look`
    /// copies what `recv` gives of it and `release_lone` leaves head moved past it and
    /// published. Anything else is not lone, and `recv` takes it as before: an empty ring,
    /// a frame behind (in this lap or the next), a frame of several lines, padding, a
    /// broken ring.
    #[test]
    fn look_and_lone_behind_find_a_lone_line_and_nothing_else() {
        let (mut p, mut c) = heap_lines(8).unwrap();
        let mut out = [Line::ZERO; MAX_FRAME_LINES];
        let mut line = Line::ZERO;
        let mut one = Line::ZERO;
        assert_eq!(c.look(&mut one), Some(None), "empty");
        for i in 0..40u8 {
            line.0[8] = i;
            line.0[USER_START] = i ^ 0x55;
            let mut f = p.reserve(1).unwrap().unwrap();
            f.write_line(0, &line).unwrap();
            f.commit();
            if i % 4 == 1 {
                // A second frame behind: not lone, wherever the first is.
                p.reserve(1).unwrap().unwrap().commit();
                assert_eq!(c.peek_lone(&mut one), None, "line {i}: a frame behind");
                assert_eq!(c.recv(&mut out).unwrap(), Some(1));
                assert_eq!(c.recv(&mut out).unwrap(), Some(1));
                // One more taken by `recv` (short of the ring's quarter since the last
                // publication: head is not published yet): a look that finds the ring
                // empty publishes it, as `recv` and `empty_at_head` do.
                p.reserve(1).unwrap().unwrap().commit();
                assert_eq!(c.recv(&mut out).unwrap(), Some(1));
                assert!(!c.head_published(), "line {i}");
                assert_eq!(c.look(&mut one), Some(None));
                assert!(c.head_published(), "line {i}: published when found empty");
                continue;
            }
            let pos = c.head_pos;
            one = Line::ZERO;
            let word = c
                .peek_lone(&mut one)
                .unwrap_or_else(|| panic!("line {i} at {pos}"));
            assert_eq!(one.0[..8], word.to_le_bytes());
            assert_eq!(one.0[8], i);
            assert_eq!(one.0[USER_START], i ^ 0x55);
            assert_eq!((one.stamp(), one.count()), (stamp_of(c.head, 3), 1));
            let head = c.head;
            c.release_lone();
            assert_eq!(c.head, head + 1);
            assert!(c.head_published() && c.nothing_at_head(), "line {i}");
            assert_eq!(c.recv(&mut out).unwrap(), None);
        }
        // Head at a lap's last line, a frame behind it in the next lap.
        while c.head_pos != 7 {
            p.reserve(1).unwrap().unwrap().commit();
            assert_eq!(c.recv(&mut out).unwrap(), Some(1));
        }
        p.reserve(1).unwrap().unwrap().commit();
        assert!(c.peek_lone(&mut one).is_some(), "lone at the lap's end");
        p.reserve(1).unwrap().unwrap().commit();
        assert_eq!(
            c.peek_lone(&mut one),
            None,
            "a frame behind, in the next lap"
        );
        assert_eq!(c.recv(&mut out).unwrap(), Some(1));
        assert!(c.peek_lone(&mut one).is_some());
        assert_eq!(c.recv(&mut out).unwrap(), Some(1));
        // A frame of three lines; then padding before one (head at 6 of 8).
        p.reserve(3).unwrap().unwrap().commit();
        assert_eq!(c.peek_lone(&mut one), None, "three lines");
        assert_eq!(c.recv(&mut out).unwrap(), Some(3));
        while c.head_pos != 6 {
            p.reserve(1).unwrap().unwrap().commit();
            assert_eq!(c.recv(&mut out).unwrap(), Some(1));
        }
        p.reserve(3).unwrap().unwrap().commit();
        assert_eq!(c.peek_lone(&mut one), None, "padding");
        assert_eq!(c.recv(&mut out).unwrap(), Some(3));
        // Padding over the lap's last line alone, the frame behind it reserved but not
        // committed: the line behind the padding still has this lap's stamp (stale for
        // the next lap), and the padding is not a lone line all the same.
        while c.head_pos != 7 {
            p.reserve(1).unwrap().unwrap().commit();
            assert_eq!(c.recv(&mut out).unwrap(), Some(1));
        }
        let f = p.reserve(2).unwrap().unwrap();
        assert!(matches!(c.look(&mut one), Some(Some(w)) if word_count(w) == PADDING));
        assert_eq!(
            c.peek_lone(&mut one),
            None,
            "padding alone at the lap's end"
        );
        f.commit();
        assert_eq!(c.recv(&mut out).unwrap(), Some(2));
        p.reserve(1).unwrap().unwrap().commit();
        assert!(c.peek_lone(&mut one).is_some());
        c.fail(Violation::BadLineCount { index: 0, count: 0 });
        assert_eq!(c.look(&mut one), None, "a broken ring");
    }

    /// Review 11: `release_lone` is safe and public; called where no lone line was found
    /// — on an empty ring, after a `recv` took the line a look found, or at a frame of
    /// several lines — it would move head past a line the producer has not written (or
    /// into a frame), and the next frame would be skipped without a trace. Debug builds
    /// (the tests') refuse each such call.
    #[test]
    #[cfg(debug_assertions)]
    fn release_lone_where_no_lone_line_was_found_panics_in_debug_builds() {
        let refused = |set_up: &dyn Fn(&mut LinesProducer<_>, &mut LinesConsumer<_>)| {
            let (mut p, mut c) = heap_lines(8).unwrap();
            set_up(&mut p, &mut c);
            let head = c.head;
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.release_lone()));
            r.is_err() && c.head == head
        };
        let mut one = Line::ZERO;
        let mut out = [Line::ZERO; MAX_FRAME_LINES];
        assert!(refused(&|_, c| assert_eq!(
            c.look(&mut Line::default()),
            Some(None)
        )));
        assert!(refused(&|p, c| {
            p.reserve(1).unwrap().unwrap().commit();
            assert!(c.look(&mut Line::default()).unwrap().is_some());
            assert_eq!(c.recv(&mut [Line::ZERO; MAX_FRAME_LINES]), Ok(Some(1)));
        }));
        assert!(refused(&|p, c| {
            p.reserve(2).unwrap().unwrap().commit();
            assert!(c.look(&mut Line::default()).unwrap().is_some());
        }));
        // And where a look found one: taken.
        let (mut p, mut c) = heap_lines(8).unwrap();
        p.reserve(1).unwrap().unwrap().commit();
        assert!(c.look(&mut one).unwrap().is_some());
        c.release_lone();
        assert_eq!(c.head, 1);
        assert_eq!(c.recv(&mut out), Ok(None));
    }

    /// Each commit asks for the line `PREFETCH_AHEAD` past its frame (wrapping around the
    /// ring), frames of one line and of several alike, and a frame that is not committed
    /// asks for nothing.
    #[test]
    fn a_commit_prefetches_the_line_prefetch_ahead_past_its_frame() {
        let (mut p, _c) = heap_lines(16).unwrap();
        let mut expect = Vec::new();
        let mut tail = 0usize;
        for lines in [1, 3, 1, 4, 1, 2, 3] {
            let f = p.reserve(lines).unwrap().unwrap();
            f.commit();
            expect.push((tail + lines + PREFETCH_AHEAD) % 16);
            tail += lines;
        }
        assert_eq!(p.storage.prefetched(), expect);
        assert_eq!(expect.last(), Some(&1), "the last one wrapped");
        let _uncommitted = p.reserve(1).unwrap().unwrap();
        assert_eq!(
            p.storage.prefetched(),
            expect,
            "a frame dropped uncommitted"
        );
    }

    /// `push_line` leaves the ring as `reserve(1)`, `write_line` and `commit` leave it —
    /// every byte of every line, lap after lap, between frames of several lines that pad
    /// the end of a lap — prefetches as a commit does, and says no when the ring is full.
    #[test]
    fn push_line_writes_what_a_one_line_frame_writes() {
        let (mut a, mut ca) = heap_lines(8).unwrap();
        let (mut b, mut cb) = heap_lines(8).unwrap();
        let mut out_a = [Line::ZERO; MAX_FRAME_LINES];
        let mut out_b = [Line::ZERO; MAX_FRAME_LINES];
        let mut line = Line::ZERO;
        for i in 0..40u8 {
            line.0
                .iter_mut()
                .enumerate()
                .for_each(|(j, x)| *x = i ^ j as u8);
            if i % 5 == 4 {
                // A frame of three lines on both: pads the end of a lap now and then.
                for p in [&mut a, &mut b] {
                    let mut f = p.reserve(3).unwrap().unwrap();
                    f.write_lines(&[line, line, line]).unwrap();
                    f.commit();
                }
            } else {
                assert_eq!(a.push_line(&line), Ok(true));
                let mut f = b.reserve(1).unwrap().unwrap();
                f.write_line(0, &line).unwrap();
                f.commit();
            }
            for pos in 0..8 {
                let (x, y) = (a.storage.line(pos), b.storage.line(pos));
                assert_eq!(x, y, "line {pos} after frame {i}");
            }
            assert_eq!(a.tail(), b.tail());
            let got = (ca.recv(&mut out_a).unwrap(), cb.recv(&mut out_b).unwrap());
            assert_eq!(got.0, got.1);
            assert_eq!(out_a, out_b);
        }
        assert_eq!(a.storage.prefetched(), b.storage.prefetched());
        // Full: no room, nothing written.
        let mut pushed = 0;
        while a.push_line(&line).unwrap() {
            pushed += 1;
            assert!(pushed <= 8, "room must run out");
        }
        assert_eq!(pushed, 8);
        let tail = a.tail();
        assert_eq!(a.push_line(&line), Ok(false));
        assert_eq!(a.tail(), tail);
        assert_eq!(ca.recv(&mut out_a).unwrap(), Some(1));
    }
}
