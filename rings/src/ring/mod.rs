//! A single-producer single-consumer ring of fixed-size slots, usable in one process
//! ([`heap_ring`]) or between two processes through a [`Segment`] ([`init_shm_ring`],
//! [`shm_producer`], [`shm_consumer`]). One implementation serves both storages.
//!
//! # Indices
//!
//! The producer index (*tail*) and the consumer index (*head*) are free-running `u64`
//! counters, compared with wrapping arithmetic (at 10⁹ slots a second they wrap after
//! 584 years, but the arithmetic would still be right). A slot is `index & (capacity - 1)`.
//! Each index sits alone on a 128-byte line pair. Each end keeps its own index privately
//! (the copy in memory is only published, never read back) and caches the other end's
//! index, reloading it only when the cached value says the ring is full (producer) or
//! empty (consumer): the technique of the `rtrb` crate. Bursts publish the index once.
//!
//! # Trust
//!
//! Everything in shared memory may have been written by a buggy or hostile peer. Each end
//! keeps private copies of capacity and mask, masks every index before using it, copies
//! each slot out before the caller sees it (so a later rewrite by the peer cannot change
//! a value already validated) and checks every index it loads:
//!
//! * the consumer requires `0 ≤ tail - head ≤ capacity` and that tail never goes back;
//! * the producer requires that head only moves forward and never passes tail.
//!
//! A violation is reported as [`LinkBroken`] and the ring stays broken: every later call
//! on that end returns the same error. Nothing from the peer can make this code panic,
//! read or write out of bounds, or loop.
//!
//! # Examples
//!
//! ```
//! let (mut tx, mut rx) = shmhca_rings::ring::heap_ring::<u32>(4).unwrap();
//! assert_eq!(tx.push_burst(&[1, 2, 3]).unwrap(), 3);
//! let mut out = [0; 8];
//! assert_eq!(rx.pop_burst(&mut out).unwrap(), 3);
//! assert_eq!(&out[..3], &[1, 2, 3]);
//! assert_eq!(rx.pop().unwrap(), None);
//! ```

// Calls into the storage's unsafe slot accessors under the SPSC protocol; each unsafe
// block says which part of the protocol makes it sound.
#![allow(unsafe_code)]

mod storage;

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;

use crate::segment::{Access, Segment};
use crate::sync::Ordering;
use storage::{End, RawStorage, RingMeta};
pub use storage::{
    HeapStorage, ShmStorage, StampedConsumer, StampedProducer, StampedReservation, Storage,
};

/// The largest capacity a ring accepts (2³¹ slots).
pub const MAX_CAPACITY: usize = 1 << 31;
/// Magic number at the start of a shared ring ("SHMRING\0" in little-endian bytes).
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"SHMRING\0");
/// Layout version of a shared ring.
pub const RING_VERSION: u32 = 1;
/// Required alignment of a shared ring's offset inside a segment's data area.
pub const RING_ALIGN: usize = storage::RING_ALIGN;

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

/// A ring capacity that cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CapacityError {
    /// Capacity 0.
    #[error("ring capacity is 0: use a power of two of at least 1")]
    Zero,
    /// Not a power of two (slots are addressed with a mask).
    #[error(
        "ring capacity {capacity} is not a power of two: slots are addressed with a mask, use e.g. 64 or 1024"
    )]
    NotPowerOfTwo {
        /// The capacity asked for.
        capacity: usize,
    },
    /// More than [`MAX_CAPACITY`] slots, or more bytes than the address space holds.
    #[error(
        "ring capacity {capacity} is too large: at most {MAX_CAPACITY} slots that fit in memory"
    )]
    TooLarge {
        /// The capacity asked for.
        capacity: usize,
    },
}

/// Checks a consumer index loaded from shared memory against the producer's own view: the
/// consumer may only have released entries that were produced, so head moves forward from
/// the head seen before (`previous`) by at most `tail - previous` (wrapping arithmetic).
/// Shared by both kinds of ring.
#[inline]
pub(crate) fn check_head(head: u64, previous: u64, tail: u64) -> Result<(), LinkBroken> {
    if head.wrapping_sub(previous) > tail.wrapping_sub(previous) {
        return Err(LinkBroken {
            violation: Violation::HeadOutOfRange {
                head,
                previous,
                tail,
            },
        });
    }
    Ok(())
}

pub(crate) fn check_capacity(capacity: usize) -> Result<(), CapacityError> {
    if capacity == 0 {
        Err(CapacityError::Zero)
    } else if !capacity.is_power_of_two() {
        Err(CapacityError::NotPowerOfTwo { capacity })
    } else if capacity > MAX_CAPACITY {
        Err(CapacityError::TooLarge { capacity })
    } else {
        Ok(())
    }
}

/// What was impossible about an index read from the peer; see [`LinkBroken`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Violation {
    /// The producer index is more than `capacity` slots ahead of the consumer index.
    TailTooFarAhead {
        /// The producer index read.
        tail: u64,
        /// The consumer's own index.
        head: u64,
        /// The ring's capacity.
        capacity: u64,
    },
    /// The producer index is behind the consumer index.
    TailBehindHead {
        /// The producer index read.
        tail: u64,
        /// The consumer's own index.
        head: u64,
    },
    /// The producer index went backwards.
    TailWentBack {
        /// The producer index read earlier.
        previous: u64,
        /// The producer index read now.
        tail: u64,
    },
    /// The consumer index went backwards or passed the producer index.
    HeadOutOfRange {
        /// The consumer index read.
        head: u64,
        /// The consumer index read earlier.
        previous: u64,
        /// The producer's own index.
        tail: u64,
    },
    /// A line ring ([`crate::lines`]): the stamp of the line where the consumer expects the
    /// next frame is neither the stamp of this lap (a frame) nor of the previous one (not
    /// yet written).
    StampOutOfRange {
        /// The line index the consumer expected a frame at.
        index: u64,
        /// The stamp found.
        found: u32,
        /// The stamp of this lap.
        expected: u32,
    },
    /// A line ring: a frame's first line gives a line count of 0 or above
    /// [`MAX_FRAME_LINES`](crate::lines::MAX_FRAME_LINES).
    BadLineCount {
        /// The line index of the frame.
        index: u64,
        /// The count byte found.
        count: u8,
    },
    /// A line ring: a frame runs past the end of the ring (frames never wrap), or a padding
    /// frame starts a lap (padding only fills a lap's end).
    FrameOverrunsRing {
        /// The line index of the frame.
        index: u64,
        /// Its line count (0 for padding at a lap's start).
        lines: u8,
        /// The ring's capacity in lines.
        capacity: u64,
    },
    /// A line ring: a continuation line of an accepted frame does not carry this lap's
    /// stamp and a zero count byte.
    BadContinuationLine {
        /// The continuation line's index.
        index: u64,
        /// The stamp found.
        found: u32,
        /// The count byte found (must be 0).
        count: u8,
        /// The stamp of this lap.
        expected: u32,
    },
}

/// The peer broke the ring's invariants: an index it wrote is impossible. The link must be
/// torn down; the ring reports this error from every later call on this end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkBroken {
    violation: Violation,
}

impl LinkBroken {
    /// The error for `violation` (for the other ring kinds of this crate).
    pub(crate) fn new(violation: Violation) -> Self {
        LinkBroken { violation }
    }

    /// What exactly was impossible.
    pub fn violation(&self) -> Violation {
        self.violation
    }
}

impl fmt::Display for LinkBroken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ring link broken: ")?;
        match self.violation {
            Violation::TailTooFarAhead {
                tail,
                head,
                capacity,
            } => write!(
                f,
                "producer index {tail} is {} slots ahead of consumer index {head} but capacity is {capacity}",
                tail.wrapping_sub(head)
            ),
            Violation::TailBehindHead { tail, head } => write!(
                f,
                "producer index {tail} is {} slots behind consumer index {head}",
                head.wrapping_sub(tail)
            ),
            Violation::TailWentBack { previous, tail } => {
                write!(f, "producer index went back from {previous} to {tail}")
            }
            Violation::HeadOutOfRange {
                head,
                previous,
                tail,
            } => write!(
                f,
                "consumer index {head} is outside {previous}..={tail} (it went back or passed the producer index)"
            ),
            Violation::StampOutOfRange {
                index,
                found,
                expected,
            } => write!(
                f,
                "line {index} carries stamp {found}, but only {expected} (a frame) or {} (not yet written) are possible",
                expected.wrapping_sub(1)
            ),
            Violation::BadLineCount { index, count } => write!(
                f,
                "the frame at line {index} says it has {count} lines (must be 1..={})",
                crate::lines::MAX_FRAME_LINES
            ),
            Violation::FrameOverrunsRing {
                index,
                lines: 0,
                capacity,
            } => write!(
                f,
                "a padding frame starts a lap at line {index} (capacity {capacity}): padding only fills a lap's end"
            ),
            Violation::FrameOverrunsRing {
                index,
                lines,
                capacity,
            } => write!(
                f,
                "the {lines}-line frame at line {index} runs past the end of a {capacity}-line ring (frames never wrap)"
            ),
            Violation::BadContinuationLine {
                index,
                found,
                count,
                expected,
            } => write!(
                f,
                "continuation line {index} carries stamp {found} and count {count}, expected stamp {expected} and count 0"
            ),
        }?;
        f.write_str("; the peer is buggy or hostile: tear the link down")
    }
}

impl std::error::Error for LinkBroken {}

/// Why [`Producer::push`] did not push.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum PushError<T> {
    /// The ring is full; here is the value back.
    Full(T),
    /// The ring is broken.
    Broken(LinkBroken),
}

impl<T> fmt::Debug for PushError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PushError::Full(_) => f.write_str("Full(..)"),
            PushError::Broken(b) => f.debug_tuple("Broken").field(b).finish(),
        }
    }
}

impl<T> fmt::Display for PushError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PushError::Full(_) => f.write_str("ring is full: retry after the consumer catches up"),
            PushError::Broken(b) => b.fmt(f),
        }
    }
}

impl<T> std::error::Error for PushError<T> {}

/// Why a chunk could not be had or committed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    /// Fewer slots (free for writing, or available for reading) than requested.
    #[error("{requested} slots requested but only {available} are available")]
    TooFewSlots {
        /// Slots requested.
        requested: usize,
        /// Slots there are.
        available: usize,
    },
    /// [`WriteChunk::write`] skipped a slot: slots must be written in order (rewriting one
    /// already written is fine), so that a commit never publishes an unwritten slot.
    #[error(
        "write at chunk index {index} skips slots: {written} of {len} are written, write index {written} next"
    )]
    OutOfOrder {
        /// The index given.
        index: usize,
        /// Slots written so far.
        written: usize,
        /// The chunk's length.
        len: usize,
    },
    /// A commit of more slots than were written (write chunk) or than the chunk holds
    /// (read chunk).
    #[error("commit of {requested} slots but only {limit} can be committed")]
    CommitTooMany {
        /// Slots the commit asked for.
        requested: usize,
        /// Slots that can be committed.
        limit: usize,
    },
    /// The ring is broken.
    #[error(transparent)]
    Broken(#[from] LinkBroken),
}

/// Why a shared ring could not be initialised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RingInitError {
    /// The capacity is unusable.
    #[error(transparent)]
    Capacity(#[from] CapacityError),
    /// The segment is mapped read-only.
    #[error("the segment is mapped read-only: initialise rings in a segment mapped read-write")]
    SegmentReadOnly,
    /// The offset is not a multiple of [`RING_ALIGN`].
    #[error("ring offset {offset} is not a multiple of {RING_ALIGN}")]
    Misaligned {
        /// The offset given.
        offset: usize,
    },
    /// The ring does not fit at that offset.
    #[error(
        "a ring needs {needed} bytes at offset {offset} but the segment has {data_len} data bytes"
    )]
    DoesNotFit {
        /// Bytes the ring needs.
        needed: usize,
        /// The offset given.
        offset: usize,
        /// The segment's data length.
        data_len: usize,
    },
    /// The slot type cannot live in a shared ring (zero-sized, or aligned to more than
    /// [`RING_ALIGN`]).
    #[error(
        "slot type of size {size} and alignment {align} cannot be shared: need size > 0 and alignment <= {RING_ALIGN}"
    )]
    UnsupportedSlot {
        /// `size_of::<T>()`.
        size: usize,
        /// `align_of::<T>()`.
        align: usize,
    },
}

/// Why an end of a shared ring could not be attached. Each variant says what is wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RingOpenError {
    /// The segment is mapped read-only; both ends write their index.
    #[error(
        "the segment is mapped read-only: both ends of a ring write their index, map it read-write"
    )]
    SegmentReadOnly,
    /// The offset is not a multiple of [`RING_ALIGN`].
    #[error("ring offset {offset} is not a multiple of {RING_ALIGN}")]
    Misaligned {
        /// The offset given.
        offset: usize,
    },
    /// There is no room for a ring header at that offset.
    #[error("no ring header fits at offset {offset} in a segment of {data_len} data bytes")]
    HeaderOutOfBounds {
        /// The offset given.
        offset: usize,
        /// The segment's data length.
        data_len: usize,
    },
    /// No ring was initialised there.
    #[error(
        "no ring at this offset (magic {found:#018x}, expected {RING_MAGIC:#018x}): was init_shm_ring called?"
    )]
    BadMagic {
        /// The magic found.
        found: u64,
    },
    /// No line ring ([`crate::lines`]) was initialised there.
    #[error(
        "no line ring at this offset (magic {found:#018x}, expected {:#018x}): was init_shm_lines called?",
        crate::lines::LINES_MAGIC
    )]
    BadLinesMagic {
        /// The magic found.
        found: u64,
    },
    /// The ring was written by a build with another ring layout.
    #[error(
        "ring layout version {found}, this build understands {expected}: run the same shmhca version on both sides"
    )]
    VersionMismatch {
        /// Version found.
        found: u32,
        /// Version expected.
        expected: u32,
    },
    /// The ring's slots are of another size than `T`.
    #[error(
        "the ring's slots are {found} bytes but this end uses {expected}-byte slots: both ends must use the same slot type"
    )]
    SlotSizeMismatch {
        /// `size_of::<T>()` here.
        expected: usize,
        /// Slot size in the ring header.
        found: u32,
    },
    /// The slot type cannot live in a shared ring.
    #[error(
        "slot type of size {size} and alignment {align} cannot be shared: need size > 0 and alignment <= {RING_ALIGN}"
    )]
    UnsupportedSlot {
        /// `size_of::<T>()`.
        size: usize,
        /// `align_of::<T>()`.
        align: usize,
    },
    /// The capacity in the header is zero, not a power of two or too large.
    #[error(
        "the ring header's capacity {found} is invalid (must be a power of two between 1 and {MAX_CAPACITY}): the header is corrupt"
    )]
    BadCapacity {
        /// Capacity found.
        found: u64,
    },
    /// The ring's slots would extend past the segment.
    #[error(
        "the ring needs {needed} bytes at offset {offset} but the segment has {data_len} data bytes"
    )]
    DoesNotFit {
        /// Bytes the ring needs.
        needed: u64,
        /// The offset given.
        offset: usize,
        /// The segment's data length.
        data_len: usize,
    },
    /// Another producer (or consumer) is attached: a ring has exactly one of each.
    #[error(
        "another {end} is already attached to this ring: a ring has exactly one producer and one consumer"
    )]
    AlreadyAttached {
        /// "producer" or "consumer".
        end: &'static str,
    },
    /// The indices in the ring are already inconsistent.
    #[error(transparent)]
    Broken(#[from] LinkBroken),
}

// ---------------------------------------------------------------------------------------
// Mutations (loom builds only): deliberately weakened orderings that the loom models must
// catch, to prove the models can fail.
// ---------------------------------------------------------------------------------------

/// A deliberately wrong memory ordering, compiled only under `--cfg shmhca_loom`, so the
/// loom models can show that they detect the bug it causes.
#[cfg(shmhca_loom)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mutation {
    /// The correct orderings.
    #[default]
    None,
    /// The producer publishes tail with Relaxed instead of Release.
    ProducerPublishRelaxed,
    /// The producer reloads head with Relaxed instead of Acquire.
    ProducerAcquireRelaxed,
    /// The consumer reloads tail with Relaxed instead of Acquire.
    ConsumerAcquireRelaxed,
    /// The consumer publishes head with Relaxed instead of Release.
    ConsumerPublishRelaxed,
}

/// A heap ring whose ends use the weakened ordering `mutation` (loom builds only).
///
/// # Errors
///
/// As [`heap_ring`].
#[cfg(shmhca_loom)]
#[allow(clippy::type_complexity)]
pub fn heap_ring_mutated<T: Copy + Send>(
    capacity: usize,
    mutation: Mutation,
) -> Result<(Producer<T, HeapStorage<T>>, Consumer<T, HeapStorage<T>>), CapacityError> {
    let (mut p, mut c) = heap_ring(capacity)?;
    p.mutation = mutation;
    c.mutation = mutation;
    Ok((p, c))
}

// ---------------------------------------------------------------------------------------
// Construction
// ---------------------------------------------------------------------------------------

/// A ring of `capacity` slots on the heap, for use inside one process.
///
/// # Errors
///
/// [`CapacityError`] if `capacity` is 0, not a power of two or above [`MAX_CAPACITY`].
#[allow(clippy::type_complexity)]
pub fn heap_ring<T: Copy + Send>(
    capacity: usize,
) -> Result<(Producer<T, HeapStorage<T>>, Consumer<T, HeapStorage<T>>), CapacityError> {
    check_capacity(capacity)?;
    if size_of::<T>()
        .checked_mul(capacity)
        .is_none_or(|n| isize::try_from(n).is_err())
    {
        return Err(CapacityError::TooLarge { capacity });
    }
    let (ps, cs) = HeapStorage::new_pair(capacity);
    Ok((Producer::new(ps, 0, 0), Consumer::new(cs, 0, 0)))
}

/// A stamped ring of `capacity` slots on the heap, for use inside one process (a
/// completion queue: the engine's thread writes, the application's reads).
///
/// Each slot carries, beside its value, the stamp of the index it holds (`index + 1`): the
/// consumer knows the next value is there from that slot alone — one load of the line it
/// reads anyway, no producer index to load first (mlx5's CQE owner bit, with a lap stamp)
/// — and the producer stores no index after it. The consumer publishes its index once per
/// [`StampedConsumer::pop_each`]; the producer reloads it only when its cached copy says
/// the ring is full. Slot `i`'s stamp is `i + 1` (written this lap), `i + 1 - capacity`
/// (the previous lap: not written yet) or 0 (never written): one comparison tells.
///
/// # Errors
///
/// [`CapacityError`] if `capacity` is 0, not a power of two or above [`MAX_CAPACITY`].
///
/// ```
/// let (mut tx, mut rx) = shmhca_rings::ring::stamped_ring::<u32>(2).unwrap();
/// assert!(rx.looks_empty());
/// tx.push(1).unwrap();
/// tx.push(2).unwrap();
/// assert_eq!(tx.push(3), Err(3), "full");
/// assert_eq!(rx.pop(), Some(1));
/// tx.push(3).unwrap();
/// let mut out = [0; 4];
/// assert_eq!(rx.pop_burst(&mut out), 2);
/// assert_eq!(&out[..2], &[2, 3]);
/// assert_eq!(rx.pop(), None);
/// ```
pub fn stamped_ring<T: Copy + Send>(
    capacity: usize,
) -> Result<(StampedProducer<T>, StampedConsumer<T>), CapacityError> {
    check_capacity(capacity)?;
    if size_of::<T>()
        .checked_add(8)
        .and_then(|n| n.checked_mul(capacity))
        .is_none_or(|n| isize::try_from(n).is_err())
    {
        return Err(CapacityError::TooLarge { capacity });
    }
    Ok(storage::stamped_pair(capacity))
}

/// Bytes a shared ring of `capacity` slots of `T` occupies (header and slots).
///
/// # Errors
///
/// [`CapacityError`] if `capacity` is unusable or the size overflows.
pub fn shm_ring_bytes<T: Pod>(capacity: usize) -> Result<usize, CapacityError> {
    check_capacity(capacity)?;
    let bytes = size_of::<T>()
        .checked_mul(capacity)
        .and_then(|n| n.checked_add(storage::SLOTS_OFFSET));
    // Under loom, room for the slots' loom cells after them (see `storage`).
    #[cfg(shmhca_loom)]
    let bytes = bytes.map(|n| n + storage::loom_extra_bytes(n, capacity));
    bytes
        .filter(|&n| isize::try_from(n).is_ok())
        .ok_or(CapacityError::TooLarge { capacity })
}

fn slot_supported<T>() -> bool {
    size_of::<T>() > 0 && align_of::<T>() <= RING_ALIGN && u32::try_from(size_of::<T>()).is_ok()
}

/// Initialises a shared ring of `capacity` slots of `T` at `offset` in `seg`'s data area:
/// writes its header and zeroes both indices and attach flags. Call it before handing the
/// segment to the peer, and never while either end is attached.
///
/// # Errors
///
/// [`RingInitError`] says why: bad capacity, read-only segment, misaligned offset, ring
/// does not fit, or a slot type that cannot be shared.
pub fn init_shm_ring<T: Pod>(
    seg: &Segment,
    offset: usize,
    capacity: usize,
) -> Result<(), RingInitError> {
    if !slot_supported::<T>() {
        return Err(RingInitError::UnsupportedSlot {
            size: size_of::<T>(),
            align: align_of::<T>(),
        });
    }
    let needed = shm_ring_bytes::<T>(capacity)?;
    if seg.access() != Access::ReadWrite {
        return Err(RingInitError::SegmentReadOnly);
    }
    if !offset.is_multiple_of(RING_ALIGN) {
        return Err(RingInitError::Misaligned { offset });
    }
    if offset
        .checked_add(needed)
        .is_none_or(|end| end > seg.data_len())
    {
        return Err(RingInitError::DoesNotFit {
            needed,
            offset,
            data_len: seg.data_len(),
        });
    }
    let meta = RingMeta {
        magic: RING_MAGIC,
        version: RING_VERSION,
        slot_size: size_of::<T>() as u32,
        capacity: capacity as u64,
    };
    let written = seg
        .write_at(offset, &[0u8; storage::SLOTS_OFFSET])
        .and_then(|()| seg.write_at(offset, bytemuck::bytes_of(&meta)));
    if written.is_err() {
        // Unreachable after the checks above; report rather than panic.
        return Err(RingInitError::DoesNotFit {
            needed,
            offset,
            data_len: seg.data_len(),
        });
    }
    #[cfg(shmhca_loom)]
    ShmStorage::<T>::loom_init(seg, offset, capacity);
    ShmStorage::<T>::reset_claims(seg, offset);
    Ok(())
}

/// Validates the shared ring header at `offset` for slots of `T`; returns the capacity.
fn validate_shm_ring<T: Pod>(seg: &Segment, offset: usize) -> Result<usize, RingOpenError> {
    if !slot_supported::<T>() {
        return Err(RingOpenError::UnsupportedSlot {
            size: size_of::<T>(),
            align: align_of::<T>(),
        });
    }
    if seg.access() != Access::ReadWrite {
        return Err(RingOpenError::SegmentReadOnly);
    }
    if !offset.is_multiple_of(RING_ALIGN) {
        return Err(RingOpenError::Misaligned { offset });
    }
    let data_len = seg.data_len();
    if offset
        .checked_add(storage::SLOTS_OFFSET)
        .is_none_or(|end| end > data_len)
    {
        return Err(RingOpenError::HeaderOutOfBounds { offset, data_len });
    }
    // Copy the header out once; everything below judges the private copy.
    let mut raw = [0u8; size_of::<RingMeta>()];
    seg.read_at(offset, &mut raw)
        .map_err(|_| RingOpenError::HeaderOutOfBounds { offset, data_len })?;
    let meta: RingMeta = bytemuck::pod_read_unaligned(&raw);
    if meta.magic != RING_MAGIC {
        return Err(RingOpenError::BadMagic { found: meta.magic });
    }
    if meta.version != RING_VERSION {
        return Err(RingOpenError::VersionMismatch {
            found: meta.version,
            expected: RING_VERSION,
        });
    }
    if meta.slot_size as usize != size_of::<T>() {
        return Err(RingOpenError::SlotSizeMismatch {
            expected: size_of::<T>(),
            found: meta.slot_size,
        });
    }
    let capacity = usize::try_from(meta.capacity)
        .ok()
        .filter(|&c| check_capacity(c).is_ok())
        .ok_or(RingOpenError::BadCapacity {
            found: meta.capacity,
        })?;
    let needed = (capacity as u64) * (size_of::<T>() as u64) + storage::SLOTS_OFFSET as u64;
    // Under loom, the slots' loom cells must fit too (see `storage`).
    #[cfg(shmhca_loom)]
    let needed = needed + storage::loom_extra_bytes(needed as usize, capacity) as u64;
    if offset as u64 + needed > data_len as u64 {
        return Err(RingOpenError::DoesNotFit {
            needed,
            offset,
            data_len,
        });
    }
    Ok(capacity)
}

/// Attaches the producer end of the shared ring at `offset` in `seg`.
///
/// Each end is claimed with a flag in the ring header, released when the returned
/// [`Producer`] is dropped; a process that dies holding it leaves the end claimed, so a
/// ring is not reattached after a crash (a new link gets new rings).
///
/// # Errors
///
/// [`RingOpenError`] if the segment is read-only, no valid ring for `T` is there, another
/// producer is attached, or the indices are already inconsistent.
pub fn shm_producer<T: Pod>(
    seg: Arc<Segment>,
    offset: usize,
) -> Result<Producer<T, ShmStorage<T>>, RingOpenError> {
    let capacity = validate_shm_ring::<T>(&seg, offset)?;
    let storage = ShmStorage::new(seg, offset, capacity, End::Producer);
    if !storage.claim() {
        return Err(RingOpenError::AlreadyAttached { end: "producer" });
    }
    // Our own index: nobody else may write it, so this is its true value (or the peer
    // scribbled on it, which the check below or the consumer will catch).
    let tail = storage.load_tail(Ordering::Relaxed);
    // SYNC: Acquire pairs with the Release store of head in Consumer::publish_head.
    let head = storage.load_head(Ordering::Acquire);
    let mut producer = Producer::new(storage, tail, tail.wrapping_sub(capacity as u64));
    producer.accept_head(head)?;
    Ok(producer)
}

/// Attaches the consumer end of the shared ring at `offset` in `seg`. Claimed like the
/// producer end (see [`shm_producer`]).
///
/// # Errors
///
/// [`RingOpenError`] if the segment is read-only, no valid ring for `T` is there, another
/// consumer is attached, or the indices are already inconsistent.
pub fn shm_consumer<T: Pod>(
    seg: Arc<Segment>,
    offset: usize,
) -> Result<Consumer<T, ShmStorage<T>>, RingOpenError> {
    let capacity = validate_shm_ring::<T>(&seg, offset)?;
    let storage = ShmStorage::new(seg, offset, capacity, End::Consumer);
    if !storage.claim() {
        return Err(RingOpenError::AlreadyAttached { end: "consumer" });
    }
    let head = storage.load_head(Ordering::Relaxed);
    let mut consumer = Consumer::new(storage, head, head);
    consumer.refresh_tail()?;
    Ok(consumer)
}

// ---------------------------------------------------------------------------------------
// Producer
// ---------------------------------------------------------------------------------------

/// The writing end of a ring. `Send`; one per ring.
pub struct Producer<T, S> {
    storage: S,
    /// Our index; authoritative (the shared copy is only published).
    tail: u64,
    /// The consumer's index as last loaded and validated.
    cached_head: u64,
    capacity: usize,
    broken: Option<LinkBroken>,
    #[cfg(shmhca_loom)]
    mutation: Mutation,
    _slot: PhantomData<fn(T) -> T>,
}

impl<T, S: fmt::Debug> fmt::Debug for Producer<T, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer")
            .field("tail", &self.tail)
            .field("cached_head", &self.cached_head)
            .field("capacity", &self.capacity)
            .field("broken", &self.broken)
            .field("storage", &self.storage)
            .finish()
    }
}

impl<T: Copy, S: Storage<T>> Producer<T, S> {
    fn new(storage: S, tail: u64, cached_head: u64) -> Self {
        let capacity = storage.capacity();
        Producer {
            storage,
            tail,
            cached_head,
            capacity,
            broken: None,
            #[cfg(shmhca_loom)]
            mutation: Mutation::None,
            _slot: PhantomData,
        }
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    #[inline(always)]
    fn cached_free(&self) -> usize {
        // tail - cached_head ≤ capacity is an invariant (checked on every head load).
        self.capacity - self.tail.wrapping_sub(self.cached_head) as usize
    }

    #[inline(always)]
    fn acquire_order(&self) -> Ordering {
        #[cfg(shmhca_loom)]
        if self.mutation == Mutation::ProducerAcquireRelaxed {
            return Ordering::Relaxed;
        }
        Ordering::Acquire
    }

    #[inline(always)]
    fn release_order(&self) -> Ordering {
        #[cfg(shmhca_loom)]
        if self.mutation == Mutation::ProducerPublishRelaxed {
            return Ordering::Relaxed;
        }
        Ordering::Release
    }

    /// Validates a head value loaded from the consumer and caches it.
    fn accept_head(&mut self, head: u64) -> Result<usize, LinkBroken> {
        if let Err(broken) = check_head(head, self.cached_head, self.tail) {
            self.broken = Some(broken);
            return Err(broken);
        }
        self.cached_head = head;
        Ok(self.cached_free())
    }

    #[cold]
    #[inline(never)]
    fn refresh_head(&mut self) -> Result<usize, LinkBroken> {
        // SYNC: Acquire pairs with the Release store of head in Consumer::publish_head: the
        // consumer's copies out of the slots it released happen before we overwrite them.
        let head = self.storage.load_head(self.acquire_order());
        self.accept_head(head)
    }

    /// Free slots, reloading the consumer's index only if fewer than `wanted` are known.
    #[inline(always)]
    fn free_for(&mut self, wanted: usize) -> Result<usize, LinkBroken> {
        if let Some(broken) = self.broken {
            return Err(broken);
        }
        let free = self.cached_free();
        if free >= wanted {
            Ok(free)
        } else {
            self.refresh_head()
        }
    }

    #[inline(always)]
    fn publish(&mut self, new_tail: u64) {
        self.tail = new_tail;
        // SYNC: Release pairs with the Acquire load of tail in Consumer::refresh_tail: the
        // slot writes before this store are visible to a consumer that sees the new tail.
        self.storage.store_tail(new_tail, self.release_order());
    }

    /// Slots free for writing now. Reloads the consumer's index unless the cached one
    /// already shows the ring empty.
    ///
    /// # Errors
    ///
    /// [`LinkBroken`] if the consumer's index is impossible (now or earlier).
    pub fn free_slots(&mut self) -> Result<usize, LinkBroken> {
        self.free_for(self.capacity)
    }

    /// Pushes one value and publishes it.
    ///
    /// # Errors
    ///
    /// [`PushError::Full`] with the value if there is no free slot;
    /// [`PushError::Broken`] if the ring is broken.
    // (Always in line: a few instructions around the slot's copy, with the rare reload of
    // the consumer's index out of line; a call would cost as much as the push.)
    #[inline(always)]
    pub fn push(&mut self, value: T) -> Result<(), PushError<T>> {
        match self.free_for(1) {
            Err(broken) => Err(PushError::Broken(broken)),
            Ok(0) => Err(PushError::Full(value)),
            Ok(_) => {
                // SAFETY: at least one slot is free from `tail`, and this end is the only
                // producer (`&mut self`).
                unsafe { self.storage.write_slot(self.tail, value) };
                self.publish(self.tail.wrapping_add(1));
                Ok(())
            }
        }
    }

    /// Pushes as many of `values` as fit and publishes them with one index store.
    /// Returns how many were pushed (0 when the ring is full).
    ///
    /// # Errors
    ///
    /// [`LinkBroken`] if the ring is broken.
    #[inline]
    pub fn push_burst(&mut self, values: &[T]) -> Result<usize, LinkBroken> {
        let n = values.len().min(self.free_for(values.len())?);
        if n > 0 {
            // SAFETY: n slots are free from `tail`; we are the only producer.
            unsafe { self.storage.write_slots(self.tail, &values[..n]) };
            self.publish(self.tail.wrapping_add(n as u64));
        }
        Ok(n)
    }

    /// Reserves exactly `n` free slots to fill and then publish with one index store.
    ///
    /// # Errors
    ///
    /// [`ChunkError::TooFewSlots`] if fewer than `n` slots are free;
    /// [`ChunkError::Broken`] if the ring is broken.
    pub fn write_chunk(&mut self, n: usize) -> Result<WriteChunk<'_, T, S>, ChunkError> {
        let free = self.free_for(n)?;
        if n > free {
            return Err(ChunkError::TooFewSlots {
                requested: n,
                available: free,
            });
        }
        Ok(WriteChunk {
            producer: self,
            len: n,
            written: 0,
        })
    }
}

/// `n` reserved slots of a [`Producer`]; nothing is visible to the consumer until a commit.
/// Slots are written in order ([`push`](WriteChunk::push), [`fill`](WriteChunk::fill), or
/// [`write`](WriteChunk::write) at the next or an already written index), so a commit can
/// never publish a slot that was not written. Dropping the chunk publishes nothing.
pub struct WriteChunk<'a, T: Copy, S: Storage<T>> {
    producer: &'a mut Producer<T, S>,
    len: usize,
    written: usize,
}

impl<T: Copy, S: Storage<T>> WriteChunk<'_, T, S> {
    /// Slots reserved.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if no slot was reserved.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Slots written so far.
    pub fn written(&self) -> usize {
        self.written
    }

    fn store(&mut self, index: usize, value: T) {
        let at = self.producer.tail.wrapping_add(index as u64);
        // SAFETY: index < len, and len slots from tail were free when the chunk was made;
        // the chunk borrows the only producer mutably.
        unsafe { self.producer.storage.write_slot(at, value) };
    }

    /// Writes `value` at chunk index `index`, which must be the next unwritten index or
    /// one already written (to overwrite it).
    ///
    /// # Errors
    ///
    /// [`ChunkError::OutOfOrder`] if `index` skips unwritten slots or is past the chunk.
    pub fn write(&mut self, index: usize, value: T) -> Result<(), ChunkError> {
        if index > self.written || index >= self.len {
            return Err(ChunkError::OutOfOrder {
                index,
                written: self.written,
                len: self.len,
            });
        }
        self.store(index, value);
        if index == self.written {
            self.written += 1;
        }
        Ok(())
    }

    /// Writes `value` into the next unwritten slot.
    ///
    /// # Errors
    ///
    /// Gives `value` back if every slot of the chunk is written.
    pub fn push(&mut self, value: T) -> Result<(), T> {
        if self.written == self.len {
            return Err(value);
        }
        self.store(self.written, value);
        self.written += 1;
        Ok(())
    }

    /// Writes values from `iter` into the unwritten slots until the chunk is full or the
    /// iterator ends; returns how many were written by this call.
    pub fn fill(&mut self, iter: impl IntoIterator<Item = T>) -> usize {
        let start = self.written;
        for value in iter.into_iter().take(self.len - self.written) {
            self.store(self.written, value);
            self.written += 1;
        }
        self.written - start
    }

    /// Publishes the first `k` slots with one index store.
    ///
    /// # Errors
    ///
    /// [`ChunkError::CommitTooMany`] if fewer than `k` slots were written (nothing is
    /// published then).
    pub fn commit(self, k: usize) -> Result<(), ChunkError> {
        if k > self.written {
            return Err(ChunkError::CommitTooMany {
                requested: k,
                limit: self.written,
            });
        }
        if k > 0 {
            let tail = self.producer.tail.wrapping_add(k as u64);
            self.producer.publish(tail);
        }
        Ok(())
    }

    /// Publishes every written slot with one index store; returns how many.
    pub fn commit_all(self) -> usize {
        let k = self.written;
        if k > 0 {
            let tail = self.producer.tail.wrapping_add(k as u64);
            self.producer.publish(tail);
        }
        k
    }
}

// ---------------------------------------------------------------------------------------
// Consumer
// ---------------------------------------------------------------------------------------

/// The reading end of a ring. `Send`; one per ring.
pub struct Consumer<T, S> {
    storage: S,
    /// Our index; authoritative (the shared copy is only published).
    head: u64,
    /// The producer's index as last loaded and validated.
    cached_tail: u64,
    capacity: usize,
    broken: Option<LinkBroken>,
    #[cfg(shmhca_loom)]
    mutation: Mutation,
    _slot: PhantomData<fn(T) -> T>,
}

impl<T, S: fmt::Debug> fmt::Debug for Consumer<T, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("head", &self.head)
            .field("cached_tail", &self.cached_tail)
            .field("capacity", &self.capacity)
            .field("broken", &self.broken)
            .field("storage", &self.storage)
            .finish()
    }
}

impl<T: Copy, S: Storage<T>> Consumer<T, S> {
    fn new(storage: S, head: u64, cached_tail: u64) -> Self {
        let capacity = storage.capacity();
        Consumer {
            storage,
            head,
            cached_tail,
            capacity,
            broken: None,
            #[cfg(shmhca_loom)]
            mutation: Mutation::None,
            _slot: PhantomData,
        }
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    #[inline(always)]
    fn cached_available(&self) -> usize {
        // cached_tail - head ≤ capacity is an invariant (checked on every tail load).
        self.cached_tail.wrapping_sub(self.head) as usize
    }

    #[inline(always)]
    fn acquire_order(&self) -> Ordering {
        #[cfg(shmhca_loom)]
        if self.mutation == Mutation::ConsumerAcquireRelaxed {
            return Ordering::Relaxed;
        }
        Ordering::Acquire
    }

    #[inline(always)]
    fn release_order(&self) -> Ordering {
        #[cfg(shmhca_loom)]
        if self.mutation == Mutation::ConsumerPublishRelaxed {
            return Ordering::Relaxed;
        }
        Ordering::Release
    }

    #[inline]
    fn refresh_tail(&mut self) -> Result<usize, LinkBroken> {
        // SYNC: Acquire pairs with the Release store of tail in Producer::publish: the
        // producer's slot writes before it are visible to our copies after it.
        let tail = self.storage.load_tail(self.acquire_order());
        let available = tail.wrapping_sub(self.head);
        if available > self.capacity as u64 || available < self.cached_available() as u64 {
            return Err(self.break_on_tail(tail));
        }
        self.cached_tail = tail;
        Ok(available as usize)
    }

    #[cold]
    #[inline(never)]
    fn break_on_tail(&mut self, tail: u64) -> LinkBroken {
        let head = self.head;
        let ahead = tail.wrapping_sub(head);
        let violation = if ahead > u64::MAX / 2 {
            Violation::TailBehindHead { tail, head }
        } else if ahead > self.capacity as u64 {
            Violation::TailTooFarAhead {
                tail,
                head,
                capacity: self.capacity as u64,
            }
        } else {
            Violation::TailWentBack {
                previous: self.cached_tail,
                tail,
            }
        };
        let broken = LinkBroken { violation };
        self.broken = Some(broken);
        broken
    }

    /// Available slots, reloading the producer's index only if fewer than `wanted` are
    /// known. When none are, prefetches the next slot, so that the load that finally finds
    /// it overlaps with the load of the index (one cache miss instead of two in a row).
    #[inline(always)]
    fn available_for(&mut self, wanted: usize) -> Result<usize, LinkBroken> {
        if let Some(broken) = self.broken {
            return Err(broken);
        }
        let known = self.cached_available();
        if known >= wanted {
            return Ok(known);
        }
        let available = self.refresh_tail()?;
        if available == 0 {
            self.storage.prefetch(self.head);
        }
        Ok(available)
    }

    #[inline(always)]
    fn publish_head(&mut self, new_head: u64) {
        self.head = new_head;
        // SYNC: Release pairs with the Acquire load of head in Producer::refresh_head: our
        // copies out of the released slots happen before the producer overwrites them.
        self.storage.store_head(new_head, self.release_order());
    }

    /// Slots available for reading now. Reloads the producer's index unless the cached
    /// one already shows the ring full.
    ///
    /// # Errors
    ///
    /// [`LinkBroken`] if the producer's index is impossible (now or earlier).
    pub fn available(&mut self) -> Result<usize, LinkBroken> {
        self.available_for(self.capacity)
    }

    /// How many slots the producer's index says wait now, unchecked and not recorded: a
    /// number only to compare with a count [`Consumer::available`] returned before (equal:
    /// that count holds now), never to read slots by. `None` once the ring is broken. One
    /// load of the index, for a caller that keeps something computed from the count.
    ///
    /// ```
    /// let (mut tx, mut rx) = shmhca_rings::ring::heap_ring::<u32>(8).unwrap();
    /// tx.push(7).unwrap();
    /// assert_eq!(rx.peek_available(), Some(1));
    /// assert_eq!(rx.available(), Ok(1));
    /// ```
    #[inline(always)]
    pub fn peek_available(&self) -> Option<u64> {
        if self.broken.is_some() {
            return None;
        }
        // SYNC: none needed: the count is compared, never used to read a slot; a pop
        // reloads the index with Acquire (refresh_tail) before it reads one.
        Some(
            self.storage
                .load_tail(Ordering::Relaxed)
                .wrapping_sub(self.head),
        )
    }

    /// Whether the ring is empty now: one load of the producer's index when no value is
    /// known to wait, nothing changed (not even the cached index). A broken ring may read
    /// as empty or not; the pops report it. For a poll's empty case, before a pop.
    ///
    /// ```
    /// let (mut tx, mut rx) = shmhca_rings::ring::heap_ring::<u32>(8).unwrap();
    /// assert!(rx.looks_empty());
    /// tx.push(7).unwrap();
    /// assert!(!rx.looks_empty());
    /// ```
    #[inline(always)]
    pub fn looks_empty(&self) -> bool {
        // SYNC: none needed: an index seen stale means only "look again later"; a pop that
        // follows reloads it with Acquire (refresh_tail) before it reads a slot.
        self.cached_tail == self.head && self.storage.load_tail(Ordering::Relaxed) == self.head
    }

    /// Pops one value (a private copy), or `None` if the ring is empty.
    ///
    /// # Errors
    ///
    /// [`LinkBroken`] if the ring is broken.
    // (Always in line: the engine pops a receive WQE in two receive fast paths, and a
    // call of its own cost each ~20 instructions a message.)
    #[inline(always)]
    pub fn pop(&mut self) -> Result<Option<T>, LinkBroken> {
        if self.available_for(1)? == 0 {
            return Ok(None);
        }
        // SAFETY: one slot is published at `head` and we are the only consumer.
        let value = unsafe { self.storage.read_slot(self.head) };
        self.publish_head(self.head.wrapping_add(1));
        Ok(Some(value))
    }

    /// Copies up to `out.len()` values out of the ring into `out` and releases their slots
    /// with one index store. Returns how many (0 when the ring is empty).
    ///
    /// # Errors
    ///
    /// [`LinkBroken`] if the ring is broken.
    #[inline(always)]
    pub fn pop_burst(&mut self, out: &mut [T]) -> Result<usize, LinkBroken> {
        let n = out.len().min(self.available_for(out.len())?);
        if n > 0 {
            // SAFETY: n slots are published from `head`; we are the only consumer.
            unsafe { self.storage.read_slots(self.head, &mut out[..n]) };
            self.publish_head(self.head.wrapping_add(n as u64));
        }
        Ok(n)
    }

    /// Hands up to `max` values, oldest first, to `f` (each a private copy, read in place:
    /// no buffer of the caller's to fill first) and releases their slots with one index
    /// store. Returns how many (0 when the ring is empty). If `f` panics, the values it
    /// returned from are released as it unwinds, and the one it panicked on is handed out
    /// again by the next pop.
    ///
    /// # Errors
    ///
    /// [`LinkBroken`] if the ring is broken.
    ///
    /// # Example
    ///
    /// ```
    /// let (mut tx, mut rx) = shmhca_rings::ring::heap_ring::<u32>(8).unwrap();
    /// for v in 1..=3 {
    ///     tx.push(v).unwrap();
    /// }
    /// let mut seen = Vec::new();
    /// assert_eq!(rx.pop_each(2, |v| seen.push(v)).unwrap(), 2);
    /// assert_eq!(seen, [1, 2]);
    /// assert_eq!(rx.pop().unwrap(), Some(3));
    /// ```
    #[inline(always)]
    pub fn pop_each(&mut self, max: usize, mut f: impl FnMut(T)) -> Result<usize, LinkBroken> {
        /// Releases the values handed over so far when dropped: at the end, or as `f`
        /// unwinds.
        struct Release<'c, T: Copy, S: Storage<T>> {
            consumer: &'c mut Consumer<T, S>,
            done: u64,
        }
        impl<T: Copy, S: Storage<T>> Drop for Release<'_, T, S> {
            fn drop(&mut self) {
                if self.done > 0 {
                    let head = self.consumer.head.wrapping_add(self.done);
                    self.consumer.publish_head(head);
                }
            }
        }
        let n = max.min(self.available_for(max)?);
        let mut release = Release {
            consumer: self,
            done: 0,
        };
        while release.done < n as u64 {
            let at = release.consumer.head.wrapping_add(release.done);
            // SAFETY: n slots are published from `head`; we are the only consumer, and
            // release none of them before it has been read and handed over.
            f(unsafe { release.consumer.storage.read_slot(at) });
            release.done += 1;
        }
        Ok(n)
    }

    /// Borrows exactly `n` available slots to read and then release with one index store.
    ///
    /// # Errors
    ///
    /// [`ChunkError::TooFewSlots`] if fewer than `n` slots are available;
    /// [`ChunkError::Broken`] if the ring is broken.
    pub fn read_chunk(&mut self, n: usize) -> Result<ReadChunk<'_, T, S>, ChunkError> {
        let available = self.available_for(n)?;
        if n > available {
            return Err(ChunkError::TooFewSlots {
                requested: n,
                available,
            });
        }
        Ok(ReadChunk {
            consumer: self,
            len: n,
        })
    }
}

/// `n` available slots of a [`Consumer`]. Each read is a private copy of the slot. Nothing
/// is released to the producer until a commit; dropping the chunk releases nothing.
pub struct ReadChunk<'a, T: Copy, S: Storage<T>> {
    consumer: &'a mut Consumer<T, S>,
    len: usize,
}

impl<T: Copy, S: Storage<T>> ReadChunk<'_, T, S> {
    /// Slots in the chunk.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if the chunk is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A copy of the value at chunk index `index`, or `None` past the chunk.
    pub fn get(&self, index: usize) -> Option<T> {
        if index >= self.len {
            return None;
        }
        let at = self.consumer.head.wrapping_add(index as u64);
        // SAFETY: index < len, and len slots from head were published when the chunk was
        // made; the producer cannot reuse them before we release them.
        Some(unsafe { self.consumer.storage.read_slot(at) })
    }

    /// Copies of the chunk's values, in order.
    pub fn iter(&self) -> impl Iterator<Item = T> + '_ {
        (0..self.len).filter_map(|i| self.get(i))
    }

    /// Releases the first `k` slots to the producer with one index store.
    ///
    /// # Errors
    ///
    /// [`ChunkError::CommitTooMany`] if `k` exceeds the chunk (nothing is released then).
    pub fn commit(self, k: usize) -> Result<(), ChunkError> {
        if k > self.len {
            return Err(ChunkError::CommitTooMany {
                requested: k,
                limit: self.len,
            });
        }
        if k > 0 {
            let head = self.consumer.head.wrapping_add(k as u64);
            self.consumer.publish_head(head);
        }
        Ok(())
    }

    /// Releases every slot of the chunk with one index store; returns how many.
    pub fn commit_all(self) -> usize {
        let k = self.len;
        if k > 0 {
            let head = self.consumer.head.wrapping_add(k as u64);
            self.consumer.publish_head(head);
        }
        k
    }
}
