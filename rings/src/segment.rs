//! Shared segments: a memfd-backed mapping that can be handed to another process as a
//! file descriptor, and the mapping of such a descriptor received from a peer.
//!
//! # Layout
//!
//! ```text
//! offset 0      header page (4096 bytes): SegmentHeader, then zeroes
//! offset 4096   data: data_len() bytes, zero-filled at creation, page- and cache-aligned
//! ```
//!
//! The header is written once by the creator and never trusted by an opener: [`Segment::open`]
//! copies it out of the file with `pread`, checks magic, layout version, kind, header
//! length and sizes against the file's real length, and keeps private copies of what it
//! validated. The memfd is sealed (`F_SEAL_SHRINK | F_SEAL_GROW`) right after it is sized,
//! and `open` refuses a memfd that could still shrink: a peer that could truncate the file
//! under our mapping could make us fault with `SIGBUS`.
//!
//! # Who may write: [`Sharing`]
//!
//! A segment made with [`Sharing::CreatorWrites`] (an arena: memory only its owner writes)
//! is sealed with `F_SEAL_FUTURE_WRITE` once the creator has mapped it: from then on the
//! kernel refuses every new writable mapping, `write(2)` and hole punching, whoever asks and
//! however they obtained a descriptor (even by reopening `/proc/PID/fd/N`), and a read-only
//! mapping cannot be `mprotect`ed to writable. [`Segment::share_fd`] hands out a read-only
//! reopen of the memfd on top of that. A [`Sharing::ReadWrite`] segment (a link's rings,
//! which both ends write) is sealed with `F_SEAL_SEAL` only.
//!
//! # What an opener commits
//!
//! [`Segment::open`] takes the largest data length the caller accepts and refuses a bigger
//! segment before mapping anything, and it never populates the mapping: pages a peer's
//! segment declares cost this process nothing until they are read. The creator's own
//! mapping is populated at creation ([`SegmentBuilder::populate`]).
//!
//! # What a peer can commit, and what it cannot change
//!
//! A peer holds a descriptor of my arena (and my engine page) and maps it; it must not make
//! me commit memory I did not commit, nor change my seals. What the kernel allows (Linux
//! 6.x, checked by `rings/tests/peer_commit.rs`):
//!
//! - `fallocate`, adding seals and writing all need a descriptor open for writing: on the
//!   `O_RDONLY` descriptor [`Segment::share_fd`] hands out they fail (`EBADF` / `EPERM`).
//! - A read-write reopen of that descriptor through `/proc/self/fd/N` is checked against
//!   the inode's mode, which `memfd_create` makes 0777. A [`Sharing::CreatorWrites`]
//!   segment (and an adopted memfd) is made mode 0400 before it is shared, so the reopen
//!   fails with `EACCES` for a peer of another user (one the connection manager admits
//!   with `PeerPolicy::Uid` or `PeerPolicy::AnyUser`).
//! - Whoever gets a read-write descriptor still meets the seals: `F_SEAL_GROW` refuses a
//!   `fallocate` or `ftruncate` past the size, `F_SEAL_SHRINK` any truncation,
//!   `F_SEAL_FUTURE_WRITE` writes, writable mappings and hole punching, and `F_SEAL_SEAL`
//!   (on every segment, and added after shmhca's own seals on an adopted memfd) any new
//!   seal.
//!
//! What is left, and why it is bounded: a peer running as root, or as the file's owner
//! (the same user, the default policy — it may `fchmod` the inode back), can reopen the file
//! read-write and `fallocate` holes *inside* its size; and any peer commits a hole of a
//! 4 KiB-page segment just by reading it through its read-only mapping (shmem allocates a
//! page on a read fault: reading 256 MiB of a sparse memfd through a read-only mapping
//! added 256 MiB to `Shmem` in `/proc/meminfo`). Neither can exceed the segment's size, which
//! the creator chose, and the kernel charges such pages to the memory cgroup of the process
//! that faulted or allocated them, the peer. A huge-page segment is reserved whole when
//! the creator maps it (a shared hugetlb mapping without `MAP_NORESERVE`), so a peer's
//! faults only use pages already set aside for it and can never make the pool run dry
//! under this process. To bound what a peer can make resident, keep arenas (and memfds
//! given to `alloc_pd_over`) no larger than needed, or use huge pages.
//!
//! memfds have no name in any file system, so nothing is ever left behind in `/dev/shm` or
//! elsewhere: the memory is freed when the last descriptor and mapping go away, including
//! when a process is killed with `SIGKILL`.
//!
//! # Huge pages
//!
//! With [`HugePages::Auto`] (the default) a segment is backed by 2 MiB pages
//! (`MFD_HUGETLB | MFD_HUGE_2MB`) when the kernel has some reserved, and otherwise by
//! ordinary pages, with one warning per process on standard error that says how to
//! reserve huge pages. [`Segment::page_size`] says what the segment really got.
//!
//! The creator's mapping is shared and made without `MAP_NORESERVE`, so the kernel reserves
//! every huge page of the file when it is mapped, populated or not: a pool too small is an
//! error at creation (or the fallback above), never a `SIGBUS` when a page is first
//! touched, by this process or by a peer (whose mappings use the same reservation).

// This module maps memory and hands out raw pointers into it; each unsafe block says why
// it is sound.
#![allow(unsafe_code)]

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Once;

use bytemuck::{Pod, Zeroable};
use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{MemfdFlags, SealFlags};

/// Bytes reserved for the header at the start of every segment; data starts here.
pub const HEADER_LEN: usize = 4096;
/// The magic number at offset 0 of every segment ("SHMHCAsg" in little-endian bytes).
pub const SEGMENT_MAGIC: u64 = u64::from_le_bytes(*b"SHMHCAsg");
/// The header layout version this build writes and understands.
pub const LAYOUT_VERSION: u32 = 1;
/// Size of a huge page as used by shmhca (`MFD_HUGE_2MB`).
pub const HUGE_PAGE_LEN: usize = 2 << 20;
/// Longest memfd name Linux accepts (249 bytes, without the NUL).
pub const MAX_NAME_LEN: usize = 249;

const BASE_PAGE_LEN: usize = 4096;
const HUGETLBFS_MAGIC: u64 = 0x9584_58f6;

/// The page size backing a segment: what the kernel really gave, not what was asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PageSize {
    /// 2 MiB hugetlb pages.
    Huge2M,
    /// Ordinary 4 KiB pages.
    Base4K,
}

impl PageSize {
    /// The page size in bytes.
    pub const fn bytes(self) -> usize {
        match self {
            PageSize::Huge2M => HUGE_PAGE_LEN,
            PageSize::Base4K => BASE_PAGE_LEN,
        }
    }
}

impl fmt::Display for PageSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PageSize::Huge2M => "2 MiB huge pages",
            PageSize::Base4K => "4 KiB pages",
        })
    }
}

/// Whether a new segment should use huge pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HugePages {
    /// Use 2 MiB huge pages if the kernel has them; otherwise fall back to ordinary
    /// pages and print one warning per process saying how to reserve huge pages.
    #[default]
    Auto,
    /// Use 2 MiB huge pages or fail with [`CreateError::HugePagesUnavailable`].
    Require,
    /// Use ordinary pages.
    Never,
}

/// The kernel's pool of 2 MiB huge pages, from `/proc/meminfo` (for diagnostics: the
/// fallback warning and `shmhca doctor`). A field is `None` when the kernel does not
/// report it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HugePagePool {
    /// `HugePages_Total`: pages in the pool.
    pub total: Option<u64>,
    /// `HugePages_Free`: pages not in use.
    pub free: Option<u64>,
    /// `HugePages_Rsvd`: pages promised to mappings but not yet faulted in.
    pub reserved: Option<u64>,
    /// `Hugepagesize`, in KiB.
    pub size_kib: Option<u64>,
}

impl HugePagePool {
    /// Reads `/proc/meminfo` (all fields `None` if it cannot be read).
    pub fn read() -> HugePagePool {
        HugePagePool::parse(&std::fs::read_to_string("/proc/meminfo").unwrap_or_default())
    }

    /// Parses the text of `/proc/meminfo`.
    pub fn parse(meminfo: &str) -> HugePagePool {
        let field = |name: &str| {
            meminfo.lines().find_map(|line| {
                let rest = line.strip_prefix(name)?.strip_prefix(':')?;
                rest.split_whitespace().next()?.parse().ok()
            })
        };
        HugePagePool {
            total: field("HugePages_Total"),
            free: field("HugePages_Free"),
            reserved: field("HugePages_Rsvd"),
            size_kib: field("Hugepagesize"),
        }
    }
}

/// How a segment is mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// Readable and writable (`PROT_READ | PROT_WRITE`).
    ReadWrite,
    /// Readable only (`PROT_READ`): writes through the mapping are impossible. A peer
    /// maps my arena like this: it may read my memory, never write it.
    ReadOnly,
}

/// Who may write a segment once its descriptor has been handed to another process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Sharing {
    /// Everyone who maps it may write it (a link segment: both ends write their rings).
    #[default]
    ReadWrite,
    /// Only the creator's own mapping is writable. The kernel enforces it with
    /// `F_SEAL_FUTURE_WRITE`: no process (the creator included) can make a new writable
    /// mapping, `write(2)` to it or punch holes in it, and descriptors from
    /// [`Segment::share_fd`] are read-only reopens; the file is mode 0400, so a peer of
    /// another user cannot reopen one read-write. For memory peers read and never write.
    CreatorWrites,
}

/// The header at offset 0 of every segment, in native byte order (both ends run on the
/// same machine). Written by the creator; copied out and validated by every opener.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable, PartialEq, Eq)]
struct SegmentHeader {
    magic: u64,
    version: u32,
    kind: u32,
    header_len: u64,
    data_len: u64,
    total_len: u64,
    page_len: u64,
}

/// Why a segment could not be created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CreateError {
    /// A segment must hold at least one byte of data.
    #[error("segment data length is 0: ask for at least one byte")]
    ZeroLength,
    /// The requested length overflows when the header is added and it is rounded up to
    /// whole pages.
    #[error("segment data length {data_len} is too large to round up to whole pages")]
    TooLarge {
        /// The requested data length.
        data_len: usize,
    },
    /// The memfd name is too long or contains a NUL byte.
    #[error("memfd name {name:?} is invalid: use at most {MAX_NAME_LEN} bytes and no NUL")]
    InvalidName {
        /// The name that was given.
        name: String,
    },
    /// [`HugePages::Require`] was asked but the kernel could not provide huge pages.
    #[error(
        "huge pages were required but are unavailable ({source}): reserve some with \
         `echo 64 > /proc/sys/vm/nr_hugepages` (or `sysctl vm.nr_hugepages=64`), \
         or create the segment with HugePages::Auto"
    )]
    HugePagesUnavailable {
        /// The error from the huge-page attempt.
        source: io::Error,
    },
    /// `memfd_create` failed.
    #[error("memfd_create failed ({source}): is this Linux 3.17 or later with memfd support?")]
    Memfd {
        /// The system error.
        source: io::Error,
    },
    /// Sizing the memfd with `ftruncate` failed.
    #[error(
        "sizing the memfd to {len} bytes failed ({source}): check free memory and RLIMIT_FSIZE"
    )]
    Resize {
        /// The length asked for.
        len: usize,
        /// The system error.
        source: io::Error,
    },
    /// Sealing the memfd failed.
    #[error("sealing the memfd failed ({source}): the kernel must support memfd seals")]
    Seal {
        /// The system error.
        source: io::Error,
    },
    /// Mapping the memfd failed.
    #[error(
        "mapping {len} bytes of shared memory failed ({source}): check free memory and `ulimit -v`"
    )]
    Map {
        /// The length of the mapping.
        len: usize,
        /// The system error.
        source: io::Error,
    },
}

/// Why a received file descriptor could not be opened as a segment. Each variant names
/// what is wrong; none of them is a panic, and no memory is mapped before the checks pass.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The descriptor does not support seals, so it is not a memfd (a socket, a pipe, a
    /// file on disk...).
    #[error(
        "the descriptor is not a memfd ({source}): pass a descriptor obtained from \
         Segment::try_clone_fd of a segment made with Segment::builder"
    )]
    NotAMemfd {
        /// The error from `fcntl(F_GET_SEALS)`.
        source: io::Error,
    },
    /// The memfd is not sealed against shrinking: its owner could truncate it under our
    /// mapping and make us fault.
    #[error(
        "the memfd is not sealed against shrinking (seals: {seals:?}): a peer could truncate it \
         under the mapping; only open segments made by Segment::builder, which seals them"
    )]
    NotSealed {
        /// The seals the memfd has.
        seals: SealFlags,
    },
    /// `fstat` or `fstatfs` on the descriptor failed.
    #[error("querying the memfd failed ({source})")]
    Stat {
        /// The system error.
        source: io::Error,
    },
    /// The memfd is longer than the caller agreed to map.
    #[error(
        "the memfd is {len} bytes, more than the {max_data_len} data bytes (plus header and \
         page rounding) agreed for it: the peer offered a larger segment than negotiated"
    )]
    TooLarge {
        /// The memfd's length.
        len: u64,
        /// The largest data length the caller accepts.
        max_data_len: usize,
    },
    /// The memfd is shorter than a segment header.
    #[error(
        "the memfd is {len} bytes, shorter than the {HEADER_LEN}-byte segment header: \
         it is not a segment, or it was created empty"
    )]
    TooSmall {
        /// The memfd's length.
        len: u64,
    },
    /// A segment without a header ([`Segment::open_raw`]) is empty.
    #[error("the memfd is empty: the peer offered a segment with no bytes")]
    Empty,
    /// Reading the header with `pread` failed.
    #[error("reading the segment header failed ({source})")]
    ReadHeader {
        /// The system error.
        source: io::Error,
    },
    /// The first bytes are not a segment header.
    #[error(
        "the memfd holds no segment header (magic {found:#018x}, expected {SEGMENT_MAGIC:#018x}): \
         it is not a shmhca segment"
    )]
    NotASegment {
        /// The magic number found.
        found: u64,
    },
    /// The segment was written by a build with another header layout.
    #[error(
        "segment layout version {found}, but this build understands version {expected}: \
         run the same shmhca version in both processes"
    )]
    VersionMismatch {
        /// The version found in the header.
        found: u32,
        /// The version this build understands.
        expected: u32,
    },
    /// The segment is of another kind than the caller expects (e.g. an arena where a link
    /// was expected).
    #[error("segment kind {found:#x}, expected {expected:#x}: the peer sent the wrong segment")]
    WrongKind {
        /// The kind the caller expects.
        expected: u32,
        /// The kind in the header.
        found: u32,
    },
    /// The header length field is not [`HEADER_LEN`].
    #[error("segment header length {found}, expected {HEADER_LEN}: the header is corrupt")]
    BadHeaderLen {
        /// The header length found.
        found: u64,
    },
    /// The header's total length disagrees with the memfd's real length.
    #[error(
        "the header says the segment is {header_total} bytes but the memfd is {file_len} bytes: \
         it was truncated or its header is corrupt"
    )]
    SizeMismatch {
        /// The total length the header claims.
        header_total: u64,
        /// The memfd's real length.
        file_len: u64,
    },
    /// The header's data length does not fit in the segment.
    #[error(
        "the header says {data_len} data bytes, which do not fit after the {HEADER_LEN}-byte \
         header in a {total_len}-byte segment: the header is corrupt"
    )]
    DataLenTooLarge {
        /// The data length the header claims.
        data_len: u64,
        /// The total length of the segment.
        total_len: u64,
    },
    /// The memfd lives on hugetlbfs with pages of a size shmhca does not use.
    #[error("the memfd uses {bytes}-byte huge pages; shmhca segments use 2 MiB or 4 KiB pages")]
    UnsupportedPageSize {
        /// The page size reported by the file system.
        bytes: u64,
    },
    /// Mapping the memfd failed.
    #[error("mapping the segment ({len} bytes) failed ({source})")]
    Map {
        /// The length of the mapping.
        len: usize,
        /// The system error.
        source: io::Error,
    },
}

/// Why [`Segment::adopt`] refused an application's memfd. Each variant names the problem
/// and what to do; a refused memfd is left unsealed and unmapped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdoptError {
    /// The descriptor does not support seals.
    #[error(
        "the descriptor does not support seals ({source}): pass a memfd created with \
         memfd_create(name, MFD_ALLOW_SEALING) (add MFD_HUGETLB for huge pages)"
    )]
    NotAMemfd {
        /// The error from `fcntl(F_GET_SEALS)`.
        source: io::Error,
    },
    /// `F_SEAL_SEAL` is set, so the seals shmhca needs cannot be added.
    #[error(
        "the memfd's seals are locked (seals: {seals:?}; F_SEAL_SEAL is set, which is also \
         what memfd_create does without MFD_ALLOW_SEALING): create it with MFD_ALLOW_SEALING \
         and do not add F_SEAL_SEAL; shmhca adds F_SEAL_SHRINK | F_SEAL_GROW | \
         F_SEAL_FUTURE_WRITE itself, then F_SEAL_SEAL"
    )]
    SealsLocked {
        /// The seals the memfd has.
        seals: SealFlags,
    },
    /// The memfd is already sealed against writes, so it cannot be mapped writable here.
    #[error(
        "the memfd is already sealed against writes (seals: {seals:?}): pass it before \
         adding F_SEAL_WRITE or F_SEAL_FUTURE_WRITE (shmhca adds F_SEAL_FUTURE_WRITE once \
         it has mapped it)"
    )]
    WriteSealed {
        /// The seals the memfd has.
        seals: SealFlags,
    },
    /// The descriptor is not open read-write (adding seals and mapping need it).
    #[error(
        "the descriptor is not open read-write: pass the descriptor memfd_create returned, \
         not a read-only reopen"
    )]
    NotWritable,
    /// The memfd has no bytes.
    #[error("the memfd is empty: set its size with ftruncate before passing it")]
    Empty,
    /// The memfd is larger than accepted.
    #[error("the memfd is {len} bytes, more than the {max_len} accepted")]
    TooLarge {
        /// Its length.
        len: u64,
        /// The most accepted.
        max_len: usize,
    },
    /// Its size changed while it was being sealed.
    #[error(
        "the memfd changed size from {before} to {after} bytes while it was being sealed: \
         stop resizing it (another holder of the file did) and pass it again"
    )]
    Resized {
        /// The size before sealing.
        before: u64,
        /// The size after sealing.
        after: u64,
    },
    /// The memfd lives on hugetlbfs with pages of a size shmhca does not use.
    #[error(
        "the memfd uses {bytes}-byte huge pages; shmhca supports 2 MiB (MFD_HUGE_2MB) or \
         4 KiB pages"
    )]
    UnsupportedPageSize {
        /// The page size reported by the file system.
        bytes: u64,
    },
    /// `fstat`, `fstatfs` or `F_GETFL` failed.
    #[error("querying the memfd failed ({source})")]
    Stat {
        /// The system error.
        source: io::Error,
    },
    /// Mapping it read-write failed.
    #[error(
        "mapping the memfd read-write ({len} bytes) failed ({source}); a hugetlbfs memfd is \
         reserved whole when mapped, so the free huge pages must cover all of it (reserve \
         more with `echo N > /proc/sys/vm/nr_hugepages`, or make it smaller)"
    )]
    Map {
        /// The length of the mapping.
        len: usize,
        /// The system error.
        source: io::Error,
    },
    /// Adding the seals failed.
    #[error("sealing the memfd failed ({source})")]
    Seal {
        /// The system error.
        source: io::Error,
    },
    /// Making the file readable by its owner only failed (the process does not own it).
    #[error(
        "making the memfd read-only to other openers (fchmod 0400) failed ({source}): pass a \
         memfd this process's user created"
    )]
    Chmod {
        /// The system error.
        source: io::Error,
    },
}

/// A bounds or permission error from [`Segment::read_at`] / [`Segment::write_at`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// The range does not lie inside the data area.
    #[error("range {offset}..{offset}+{len} is outside the segment's {data_len} data bytes")]
    OutOfBounds {
        /// Start of the range, from the start of the data area.
        offset: usize,
        /// Length of the range.
        len: usize,
        /// The segment's data length.
        data_len: usize,
    },
    /// A write was attempted on a read-only mapping.
    #[error("the segment is mapped read-only: it cannot be written through this mapping")]
    ReadOnly,
}

/// Builder for a new [`Segment`]; see [`Segment::builder`].
#[derive(Clone, Debug)]
pub struct SegmentBuilder {
    kind: u32,
    data_len: usize,
    name: String,
    huge_pages: HugePages,
    sharing: Sharing,
    populate: bool,
}

/// A shared-memory segment: a sealed memfd, mapped, with a validated header page.
///
/// The mapping is unmapped and the descriptor closed on drop. `Segment` is `Send + Sync`:
/// the memory behind [`data_ptr`](Segment::data_ptr) is shared with other processes, so
/// all access to it goes through raw pointers (never references), atomics, or the copying
/// helpers [`read_at`](Segment::read_at) / [`write_at`](Segment::write_at).
pub struct Segment {
    map: MmapRaw,
    fd: OwnedFd,
    kind: u32,
    page_size: PageSize,
    access: Access,
    sharing: Sharing,
    /// Where the data area starts in the mapping: [`HEADER_LEN`], or 0 for a segment
    /// without a header (an application's memfd: [`Segment::adopt`], [`Segment::open_raw`]).
    data_off: usize,
    data_len: usize,
}

impl fmt::Debug for Segment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Segment")
            .field("kind", &self.kind)
            .field("page_size", &self.page_size)
            .field("access", &self.access)
            .field("data_len", &self.data_len)
            .field("addr", &self.map.as_ptr())
            .finish()
    }
}

static FALLBACK_WARNING: Once = Once::new();

impl SegmentBuilder {
    /// The memfd's name, visible in `/proc/<pid>/fd` as `memfd:<name>` (default `shmhca`).
    /// It names no file anywhere: nothing is created in `/dev/shm`.
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_owned();
        self
    }

    /// Whether to use huge pages (default [`HugePages::Auto`]).
    pub fn huge_pages(mut self, huge_pages: HugePages) -> Self {
        self.huge_pages = huge_pages;
        self
    }

    /// Who may write the segment once it is shared (default [`Sharing::ReadWrite`]).
    pub fn sharing(mut self, sharing: Sharing) -> Self {
        self.sharing = sharing;
        self
    }

    /// Whether to fault every page in at creation (default `true`): the hot path then never
    /// takes a page fault, and a huge-page shortfall is an error here rather than a
    /// `SIGBUS` later. Without it, pages are committed as they are first touched.
    pub fn populate(mut self, populate: bool) -> Self {
        self.populate = populate;
        self
    }

    /// Creates, sizes, seals and maps the memfd, writes the header and returns the segment
    /// mapped read-write. The data area is zero-filled.
    ///
    /// # Errors
    ///
    /// [`CreateError`] says which step failed and what to do. With [`HugePages::Auto`] a
    /// failure to get huge pages is not an error: the segment falls back to ordinary pages.
    pub fn create(self) -> Result<Segment, CreateError> {
        if self.data_len == 0 {
            return Err(CreateError::ZeroLength);
        }
        if self.name.len() > MAX_NAME_LEN || self.name.contains('\0') {
            return Err(CreateError::InvalidName { name: self.name });
        }
        match self.huge_pages {
            HugePages::Never => self.create_with(PageSize::Base4K),
            HugePages::Require => self.create_with(PageSize::Huge2M).map_err(|e| match e {
                CreateError::Memfd { source }
                | CreateError::Resize { source, .. }
                | CreateError::Seal { source }
                | CreateError::Map { source, .. } => CreateError::HugePagesUnavailable { source },
                other => other,
            }),
            HugePages::Auto => match self.create_with(PageSize::Huge2M) {
                Ok(segment) => Ok(segment),
                Err(CreateError::TooLarge { data_len }) => Err(CreateError::TooLarge { data_len }),
                Err(huge_error) => {
                    FALLBACK_WARNING.call_once(|| {
                        let pool = HugePagePool::read();
                        let needed = (HEADER_LEN + self.data_len).div_ceil(HUGE_PAGE_LEN);
                        let why = match (pool.free, pool.total) {
                            (Some(0), Some(0)) => "none are reserved".to_owned(),
                            (Some(free), Some(total)) if (free as usize) < needed => format!(
                                "{free} of {total} are free and this segment needs {needed}"
                            ),
                            _ => huge_error.to_string(),
                        };
                        eprintln!(
                            "shmhca: warning: huge pages are unavailable ({why}); using \
                             4 KiB pages, which costs TLB misses. Reserve huge pages with \
                             `echo 64 > /proc/sys/vm/nr_hugepages` (or `sysctl vm.nr_hugepages=64`). \
                             This warning is printed once per process."
                        );
                    });
                    self.create_with(PageSize::Base4K)
                }
            },
        }
    }

    fn create_with(&self, page_size: PageSize) -> Result<Segment, CreateError> {
        let page = page_size.bytes();
        let total_len = HEADER_LEN
            .checked_add(self.data_len)
            .and_then(|n| n.checked_next_multiple_of(page))
            .filter(|&n| isize::try_from(n).is_ok())
            .ok_or(CreateError::TooLarge {
                data_len: self.data_len,
            })?;
        // (cargo mutants: `|` → `^` between these flags, and between the seal flags below,
        // is equivalent: each names a different bit, so or and xor agree.)
        let mut flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        if page_size == PageSize::Huge2M {
            flags |= MemfdFlags::HUGETLB | MemfdFlags::HUGE_2MB;
        }
        let fd = rustix::fs::memfd_create(self.name.as_str(), flags)
            .map_err(|e| CreateError::Memfd { source: e.into() })?;
        rustix::fs::ftruncate(&fd, total_len as u64).map_err(|e| CreateError::Resize {
            len: total_len,
            source: e.into(),
        })?;
        let seal = |seals| {
            rustix::fs::fcntl_add_seals(&fd, seals)
                .map_err(|e| CreateError::Seal { source: e.into() })
        };
        seal(SealFlags::SHRINK | SealFlags::GROW)?;
        // populate(): fault every page in now, so that (a) the hot path never takes a page
        // fault and (b) a hugetlb shortfall shows up here as an error, not later as SIGBUS.
        let mut options = MmapOptions::new();
        options.len(total_len);
        if self.populate {
            options.populate();
        }
        let map = options.map_raw(&fd).map_err(|source| CreateError::Map {
            len: total_len,
            source,
        })?;
        // The creator's writable mapping exists; from here on nobody gets another one.
        seal(match self.sharing {
            Sharing::ReadWrite => SealFlags::SEAL,
            Sharing::CreatorWrites => SealFlags::FUTURE_WRITE | SealFlags::SEAL,
        })?;
        if self.sharing == Sharing::CreatorWrites {
            read_only_mode(&fd).map_err(|source| CreateError::Seal { source })?;
        }
        // (cargo mutants: the mutants of this condition only change whether the hint is
        // given; its result is ignored and nothing else depends on it, so no test can tell
        // but the VmFlags of /proc/self/smaps. Left untested on purpose.)
        if page_size == PageSize::Base4K && self.data_len >= HUGE_PAGE_LEN {
            // Transparent huge pages for shmem, where the admin enabled them
            // (shmem_enabled = advise/within_size/always). Purely a hint: with THP off
            // the kernel ignores it, so the result does not matter.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        let header = SegmentHeader {
            magic: SEGMENT_MAGIC,
            version: LAYOUT_VERSION,
            kind: self.kind,
            header_len: HEADER_LEN as u64,
            data_len: (total_len - HEADER_LEN) as u64,
            total_len: total_len as u64,
            page_len: page as u64,
        };
        // SAFETY: the mapping is `total_len >= HEADER_LEN` bytes, readable and writable, and
        // not yet shared with anyone (the fd has not left this function); an unaligned write
        // of a Pod value into it is sound.
        unsafe {
            map.as_mut_ptr()
                .cast::<SegmentHeader>()
                .write_unaligned(header)
        };
        Ok(Segment {
            map,
            fd,
            kind: self.kind,
            page_size,
            access: Access::ReadWrite,
            sharing: self.sharing,
            data_off: HEADER_LEN,
            data_len: total_len - HEADER_LEN,
        })
    }
}

impl Segment {
    /// Starts building a segment of at least `data_len` usable bytes (rounded up to whole
    /// pages), tagged with `kind`, a number the creator chooses so that an opener can check
    /// it got the segment it expects (link, arena, test, ...).
    pub fn builder(kind: u32, data_len: usize) -> SegmentBuilder {
        SegmentBuilder {
            kind,
            data_len,
            name: String::from("shmhca"),
            huge_pages: HugePages::Auto,
            sharing: Sharing::ReadWrite,
            populate: true,
        }
    }

    /// Maps a segment received from a peer (or a dup of one's own), after validating it.
    ///
    /// Checks, in order, before anything is mapped: the descriptor is a memfd, sealed
    /// against shrinking; it is at least a header long and at most a header plus
    /// `max_data_len` (rounded up to a huge page) long — the caller's cap, so that a peer
    /// cannot make this process map more than it agreed to; the header (copied out with
    /// `pread`) has the right magic, layout version, kind and header length; the total
    /// length in the header equals the memfd's real length; the data length fits. The
    /// validated values are kept privately: later writes to the header by the peer change
    /// nothing here.
    ///
    /// The mapping is not populated: its pages cost nothing until they are touched, so a
    /// peer's sparse segment commits no memory here.
    ///
    /// # Errors
    ///
    /// One [`OpenError`] variant per failed check, saying what is wrong.
    pub fn open(
        fd: OwnedFd,
        expected_kind: u32,
        access: Access,
        max_data_len: usize,
    ) -> Result<Segment, OpenError> {
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|e| OpenError::NotAMemfd { source: e.into() })?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(OpenError::NotSealed { seals });
        }
        // The memfd cannot shrink from here on, so the length we read stays a lower bound.
        let stat = rustix::fs::fstat(&fd).map_err(|e| OpenError::Stat { source: e.into() })?;
        let file_len = u64::try_from(stat.st_size).unwrap_or(0);
        if file_len < HEADER_LEN as u64 {
            return Err(OpenError::TooSmall { len: file_len });
        }
        let mut raw = [0u8; size_of::<SegmentHeader>()];
        let mut filled = 0;
        while filled < raw.len() {
            match rustix::io::pread(&fd, &mut raw[filled..], filled as u64) {
                Ok(0) => return Err(OpenError::TooSmall { len: file_len }),
                Ok(n) => filled += n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(OpenError::ReadHeader { source: e.into() }),
            }
        }
        let header: SegmentHeader = bytemuck::pod_read_unaligned(&raw);
        if header.magic != SEGMENT_MAGIC {
            return Err(OpenError::NotASegment {
                found: header.magic,
            });
        }
        if header.version != LAYOUT_VERSION {
            return Err(OpenError::VersionMismatch {
                found: header.version,
                expected: LAYOUT_VERSION,
            });
        }
        if header.kind != expected_kind {
            return Err(OpenError::WrongKind {
                expected: expected_kind,
                found: header.kind,
            });
        }
        if header.header_len != HEADER_LEN as u64 {
            return Err(OpenError::BadHeaderLen {
                found: header.header_len,
            });
        }
        if header.total_len != file_len {
            return Err(OpenError::SizeMismatch {
                header_total: header.total_len,
                file_len,
            });
        }
        let total_len = usize::try_from(file_len)
            .ok()
            .filter(|&n| isize::try_from(n).is_ok())
            .ok_or(OpenError::SizeMismatch {
                header_total: header.total_len,
                file_len,
            })?;
        if header.data_len > file_len - HEADER_LEN as u64 {
            return Err(OpenError::DataLenTooLarge {
                data_len: header.data_len,
                total_len: file_len,
            });
        }
        let data_len = header.data_len as usize;
        let page_size = page_size_of(&fd)?;
        // The creator rounds header plus data up to whole pages; nothing more is accepted.
        let cap = (HEADER_LEN as u64)
            .saturating_add(max_data_len as u64)
            .checked_next_multiple_of(page_size.bytes() as u64)
            .unwrap_or(u64::MAX);
        if file_len > cap {
            return Err(OpenError::TooLarge {
                len: file_len,
                max_data_len,
            });
        }
        let mut options = MmapOptions::new();
        options.len(total_len);
        let map = match access {
            Access::ReadWrite => options.map_raw(&fd),
            Access::ReadOnly => options.map_raw_read_only(&fd),
        }
        .map_err(|source| OpenError::Map {
            len: total_len,
            source,
        })?;
        Ok(Segment {
            map,
            fd,
            kind: header.kind,
            page_size,
            access,
            sharing: if seals.contains(SealFlags::FUTURE_WRITE) {
                Sharing::CreatorWrites
            } else {
                Sharing::ReadWrite
            },
            data_off: HEADER_LEN,
            data_len,
        })
    }

    /// Takes over a memfd the application created and filled (plain or `MFD_HUGETLB`,
    /// made with `MFD_ALLOW_SEALING`), as a segment with **no header**: its data area is
    /// the whole file, from byte 0, and nothing in it is ever written here.
    ///
    /// The memfd is mapped read-write (never populated), then sealed with
    /// `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE` in one call, so that its size is
    /// fixed for good (a peer's mapping can never fault with `SIGBUS`) and from then on
    /// nobody can make a new writable mapping of it, `write(2)` it or punch holes in it.
    /// Writable mappings made before (the application's own) keep working: the application
    /// writes its data through them. The segment is [`Sharing::CreatorWrites`], so
    /// [`Segment::share_fd`] hands out an `O_RDONLY` reopen; a peer maps that with
    /// [`Segment::open_raw`]. `max_len` caps the size accepted.
    ///
    /// Then `F_SEAL_SEAL` is added, so that nobody (a peer that reopened the file, or the
    /// application) can add seals any more: the only seal left, `F_SEAL_WRITE`, is impossible
    /// anyway while the application's writable mapping exists. And the file is made mode
    /// 0400 (owner read only), so that a peer of another user cannot reopen its descriptor
    /// read-write through `/proc` (see the module docs, "What a peer can commit"); the
    /// application's own open descriptors keep their access.
    ///
    /// The seals cannot be removed: the file stays fixed in size and closed to new writable
    /// mappings after the segment is dropped. A refused memfd is left as it was.
    ///
    /// # Errors
    ///
    /// One [`AdoptError`] variant per refusal, naming the problem and what to do.
    pub fn adopt(fd: OwnedFd, kind: u32, max_len: usize) -> Result<Segment, AdoptError> {
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|e| AdoptError::NotAMemfd { source: e.into() })?;
        if seals.contains(SealFlags::WRITE) || seals.contains(SealFlags::FUTURE_WRITE) {
            return Err(AdoptError::WriteSealed { seals });
        }
        // (cargo mutants: `|` → `^` here is equivalent: three different bits.)
        let needed = SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE;
        if seals.contains(SealFlags::SEAL) {
            return Err(AdoptError::SealsLocked { seals });
        }
        let mode =
            rustix::fs::fcntl_getfl(&fd).map_err(|e| AdoptError::Stat { source: e.into() })?;
        if mode & rustix::fs::OFlags::RWMODE != rustix::fs::OFlags::RDWR {
            return Err(AdoptError::NotWritable);
        }
        let len = file_len(&fd).map_err(|source| AdoptError::Stat { source })?;
        if len == 0 {
            return Err(AdoptError::Empty);
        }
        let map_len = usize::try_from(len)
            .ok()
            .filter(|&n| n <= max_len && isize::try_from(n).is_ok())
            .ok_or(AdoptError::TooLarge { len, max_len })?;
        let page_size = page_size_of(&fd).map_err(|e| match e {
            OpenError::UnsupportedPageSize { bytes } => AdoptError::UnsupportedPageSize { bytes },
            OpenError::Stat { source } => AdoptError::Stat { source },
            other => AdoptError::Stat {
                source: io::Error::other(other.to_string()),
            },
        })?;
        let map = MmapOptions::new()
            .len(map_len)
            .map_raw(&fd)
            .map_err(|source| AdoptError::Map {
                len: map_len,
                source,
            })?;
        rustix::fs::fcntl_add_seals(&fd, needed)
            .map_err(|e| AdoptError::Seal { source: e.into() })?;
        // Our seals are in place; F_SEAL_SEAL keeps anyone else (a peer that reopened the
        // file read-write) from adding any: F_SEAL_WRITE is impossible anyway while the
        // application's writable mapping exists.
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SEAL)
            .map_err(|e| AdoptError::Seal { source: e.into() })?;
        read_only_mode(&fd).map_err(|source| AdoptError::Chmod { source })?;
        // The size was read before the seals: someone holding the file may have changed it
        // in between. It is fixed now, so one more look settles it.
        let sealed_len = file_len(&fd).map_err(|source| AdoptError::Stat { source })?;
        if sealed_len != len {
            return Err(AdoptError::Resized {
                before: len,
                after: sealed_len,
            });
        }
        Ok(Segment {
            map,
            fd,
            kind,
            page_size,
            access: Access::ReadWrite,
            sharing: Sharing::CreatorWrites,
            data_off: 0,
            data_len: map_len,
        })
    }

    /// Maps a segment without a header received from a peer (one the peer made with
    /// [`Segment::adopt`]): its data area is the whole file. Like [`Segment::open`], every
    /// check runs before anything is mapped: the descriptor is a memfd sealed against
    /// shrinking (so the mapping can never fault with `SIGBUS`, whatever the peer does),
    /// it is not empty and at most `max_len` bytes long; the mapping is never populated.
    /// With no header there is no kind to check: the caller tags it `kind`.
    ///
    /// # Errors
    ///
    /// [`OpenError::NotAMemfd`], [`OpenError::NotSealed`], [`OpenError::Stat`],
    /// [`OpenError::Empty`], [`OpenError::TooLarge`], [`OpenError::UnsupportedPageSize`],
    /// [`OpenError::Map`].
    pub fn open_raw(
        fd: OwnedFd,
        kind: u32,
        access: Access,
        max_len: usize,
    ) -> Result<Segment, OpenError> {
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|e| OpenError::NotAMemfd { source: e.into() })?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(OpenError::NotSealed { seals });
        }
        let len = file_len(&fd).map_err(|source| OpenError::Stat { source })?;
        if len == 0 {
            return Err(OpenError::Empty);
        }
        let map_len = usize::try_from(len)
            .ok()
            .filter(|&n| n <= max_len && isize::try_from(n).is_ok())
            .ok_or(OpenError::TooLarge {
                len,
                max_data_len: max_len,
            })?;
        let page_size = page_size_of(&fd)?;
        let mut options = MmapOptions::new();
        options.len(map_len);
        let map = match access {
            Access::ReadWrite => options.map_raw(&fd),
            Access::ReadOnly => options.map_raw_read_only(&fd),
        }
        .map_err(|source| OpenError::Map {
            len: map_len,
            source,
        })?;
        Ok(Segment {
            map,
            fd,
            kind,
            page_size,
            access,
            sharing: if seals.contains(SealFlags::FUTURE_WRITE) {
                Sharing::CreatorWrites
            } else {
                Sharing::ReadWrite
            },
            data_off: 0,
            data_len: map_len,
        })
    }

    /// Whether the segment has a header page (false for [`Segment::adopt`] and
    /// [`Segment::open_raw`]: the data area is then the whole file).
    pub fn has_header(&self) -> bool {
        self.data_off != 0
    }

    /// The segment's memfd. To hand the segment to a peer use [`Segment::share_fd`], which
    /// gives a read-only descriptor for [`Sharing::CreatorWrites`] segments.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The memfd's identity (device and inode numbers): two descriptors of the same memfd
    /// have the same identity, so a process can tell a segment it mapped already.
    ///
    /// # Errors
    ///
    /// The system error of `fstat`.
    pub fn identity(fd: BorrowedFd<'_>) -> io::Result<(u64, u64)> {
        let st = rustix::fs::fstat(fd)?;
        Ok((st.st_dev as u64, st.st_ino as u64))
    }

    /// Who may write the segment (for an opened one: what its seals say).
    pub fn sharing(&self) -> Sharing {
        self.sharing
    }

    /// A descriptor to hand to a peer ([`crate::fdpass::send_with_fds`]).
    ///
    /// For a [`Sharing::CreatorWrites`] segment it is a read-only reopen of the memfd
    /// (`/proc/self/fd/N` opened `O_RDONLY`), so the peer cannot even ask for a writable
    /// mapping; where `/proc` is not mounted it is a duplicate, and the
    /// `F_SEAL_FUTURE_WRITE` seal alone still refuses every writable mapping. For a
    /// [`Sharing::ReadWrite`] segment it is a duplicate.
    ///
    /// # Errors
    ///
    /// The system error if the process is out of descriptors.
    pub fn share_fd(&self) -> io::Result<OwnedFd> {
        if self.sharing == Sharing::CreatorWrites {
            let path = format!("/proc/self/fd/{}", self.fd.as_raw_fd());
            if let Ok(fd) = rustix::fs::open(
                path.as_str(),
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            ) {
                return Ok(fd);
            }
        }
        self.try_clone_fd()
    }

    /// A new descriptor for the same memfd (`F_DUPFD_CLOEXEC`), for sending to a peer or for
    /// mapping the segment again, e.g. read-only.
    ///
    /// # Errors
    ///
    /// The system error if the process is out of descriptors.
    pub fn try_clone_fd(&self) -> io::Result<OwnedFd> {
        Ok(rustix::io::fcntl_dupfd_cloexec(&self.fd, 0)?)
    }

    /// The kind tag the creator chose (validated against the expected kind on open).
    pub fn kind(&self) -> u32 {
        self.kind
    }

    /// The page size backing the segment, as the kernel really provided it.
    pub fn page_size(&self) -> PageSize {
        self.page_size
    }

    /// How this process mapped the segment.
    pub fn access(&self) -> Access {
        self.access
    }

    /// Usable bytes after the header page.
    pub fn data_len(&self) -> usize {
        self.data_len
    }

    /// The start of the data area: [`HEADER_LEN`] bytes into the mapping (the mapping's
    /// start for a segment without a header), so page- and cache-line-aligned. Valid for `data_len()` bytes for as long as `self` lives.
    /// Writes through it are only allowed (and only possible) when
    /// [`access`](Segment::access) is [`Access::ReadWrite`]; on a read-only mapping the
    /// page protection turns a write into `SIGSEGV`. The memory may be changed at any time
    /// by a peer: access it only through raw pointers, atomics or copies, never through
    /// references that assume nobody else writes.
    pub fn data_ptr(&self) -> NonNull<u8> {
        // SAFETY: the mapping is data_off + data_len bytes long (data_off is HEADER_LEN or
        // 0), so data_off is in bounds (or one past the end when data_len is 0, which every
        // constructor rules out anyway).
        let ptr = unsafe { self.map.as_mut_ptr().add(self.data_off) };
        // `add` of a non-null mapping address stays non-null.
        NonNull::new(ptr).unwrap_or(NonNull::dangling())
    }

    /// Copies `buf.len()` bytes starting `offset` bytes into the data area into `buf`.
    ///
    /// # Errors
    ///
    /// [`AccessError::OutOfBounds`] if the range is not inside the data area.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<(), AccessError> {
        self.check_range(offset, buf.len())?;
        // SAFETY: the range was checked to lie inside the mapping, which is readable under
        // either access, and `buf` is valid for writes of its length; `ptr::copy` tolerates
        // overlap. The source is only accessed through a raw pointer (a peer may write it
        // concurrently; the result is then whatever bytes were there, all valid `u8`s).
        unsafe {
            std::ptr::copy(
                self.data_ptr().as_ptr().wrapping_add(offset),
                buf.as_mut_ptr(),
                buf.len(),
            );
        }
        Ok(())
    }

    /// Copies `data` into the data area starting `offset` bytes in.
    ///
    /// # Errors
    ///
    /// [`AccessError::ReadOnly`] on a read-only mapping, [`AccessError::OutOfBounds`] if
    /// the range is not inside the data area.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<(), AccessError> {
        if self.access == Access::ReadOnly {
            return Err(AccessError::ReadOnly);
        }
        self.check_range(offset, data.len())?;
        // SAFETY: the range lies inside the mapping, which is writable (checked above), and
        // `data` is valid for reads of its length; `ptr::copy` tolerates overlap.
        unsafe {
            std::ptr::copy(
                data.as_ptr(),
                self.data_ptr().as_ptr().wrapping_add(offset),
                data.len(),
            );
        }
        Ok(())
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<(), AccessError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.data_len => Ok(()),
            _ => Err(AccessError::OutOfBounds {
                offset,
                len,
                data_len: self.data_len,
            }),
        }
    }
}

/// Makes the memfd's inode readable by its owner only (mode 0400) before it is shared: a
/// peer that reopens its read-only descriptor through `/proc/self/fd/N` asking for write
/// access (to `fallocate` the file, commit its holes, or add seals) is then refused with
/// `EACCES` unless it runs as root or as the file's owner, who may `fchmod` it back (see
/// the module docs, "What a peer can commit"). Our own descriptors keep their access: modes
/// are checked when a file is opened, and [`Segment::share_fd`]'s read-only reopen is
/// allowed to the owner.
fn read_only_mode(fd: &OwnedFd) -> io::Result<()> {
    Ok(rustix::fs::fchmod(fd, rustix::fs::Mode::RUSR)?)
}

/// The length of the file behind `fd`.
fn file_len(fd: &OwnedFd) -> io::Result<u64> {
    let stat = rustix::fs::fstat(fd)?;
    Ok(u64::try_from(stat.st_size).unwrap_or(0))
}

/// The page size of the file behind `fd` (hugetlbfs or not).
fn page_size_of(fd: &OwnedFd) -> Result<PageSize, OpenError> {
    let stat = rustix::fs::fstat(fd).map_err(|e| OpenError::Stat { source: e.into() })?;
    let statfs = rustix::fs::fstatfs(fd).map_err(|e| OpenError::Stat { source: e.into() })?;
    if statfs.f_type as u64 == HUGETLBFS_MAGIC {
        match u64::try_from(stat.st_blksize).unwrap_or(0) {
            b if b == HUGE_PAGE_LEN as u64 => Ok(PageSize::Huge2M),
            bytes => Err(OpenError::UnsupportedPageSize { bytes }),
        }
    } else {
        Ok(PageSize::Base4K)
    }
}

impl AsFd for Segment {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
