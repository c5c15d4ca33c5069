//! Memory the application registers itself: a `Vec<u8>`, a `Box<[u8]>`, an anonymous or
//! file mapping ([`memmap2::MmapMut`]), or a memfd ([`Memfd`], plain or hugetlbfs).
//!
//! # Where the bytes go
//!
//! Peers read only a protection domain's arena (see [`crate::arena`]); they can never map
//! process memory, and they never write any of my memory. So a registered buffer is used as
//! follows (the exact cost of each path is in the README, "Registering your own memory"):
//!
//! - **As a destination** (receive buffers, the local buffer of an RDMA Read or an Atomic
//!   result, the target of a peer's RDMA Write or Atomic) it costs nothing extra: my engine
//!   copies a packet's payload out of the peer's read-only arena straight into the buffer,
//!   exactly as it does into an arena region, and executes a peer's Atomic on the buffer's
//!   word itself.
//! - **As a source** (the gather list of a Send or RDMA Write, the region a peer's RDMA Read
//!   reads) its bytes must reach memory a peer can read. Each registered buffer has a
//!   *shadow*: a block of the same length in the domain's arena, allocated at registration.
//!   Posting a Send or Write copies the posted range into the shadow (one copy, by the
//!   posting thread, before the work request is queued), and the packets reference the
//!   shadow as they would an arena region (a Send of a few bytes through the verbs C ABI's
//!   path, [`Qp::post_send_single`](crate::Qp::post_send_single), is copied into the QP's
//!   inline staging instead, and holds no region). A peer's RDMA Read is staged the same way by my
//!   responder, one response packet at a time. Small messages that go inline in the packet
//!   are copied once either way.
//!
//! Page-aligned memory of whole pages can skip the shadow:
//! [`Pd::reg_mr_in_place`](crate::Pd::reg_mr_in_place) moves the pages themselves onto an
//! arena block (copied once, then the range is remapped onto the block, at the same
//! address), so the region is arena memory like one from `alloc_mr`, readable by connected
//! peers, until it is dropped and the application gets private pages back.
//!
//! Cross-memory attach (`process_vm_readv`, the peer's engine reading my process memory
//! directly) was rejected: it needs the peer to be allowed to ptrace me, which lets it read
//! (and write) all of my memory, breaking the security model's "a peer reads only the arenas
//! I connected to it and never writes my memory".
//!
//! # How the engine names a buffer
//!
//! The engine addresses local memory by offset in the domain's arena. A registered buffer
//! gets offsets in a separate range, [`USER_SPACE`](crate::tables::mr::USER_SPACE) with the region's table index in bits
//! 32..56 and the offset inside the buffer in the low 32 bits (a region holds at most
//! 2 GiB). [`Local`] resolves an offset to the arena or to the buffer's view; offsets of
//! this kind only ever describe destinations (sources are shadow offsets in the arena), so
//! they never reach a peer.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use crate::error::{Error, Result};
use crate::mem::{Mem, OutOfRange};
use crate::tables::mr::{MrTable, split_user_off};
use crate::user_buffer::sealed;
pub use crate::user_buffer::{RawBuffer, UserBuffer};

/// The memory a QP's local offsets name: its domain's arena, and the registered buffers of
/// the region table. What the engine writes received data and Atomic results through.
#[derive(Clone, Copy)]
pub(crate) struct Local<'a> {
    arena: &'a Mem,
    mrs: Option<&'a MrTable>,
}

impl<'a> Local<'a> {
    /// Local memory of a QP whose domain's arena is `arena`.
    pub(crate) fn new(arena: &'a Mem, mrs: &'a MrTable) -> Local<'a> {
        Local {
            arena,
            mrs: Some(mrs),
        }
    }

    /// Only an arena (no registered buffer resolves).
    pub(crate) fn arena_only(arena: &'a Mem) -> Local<'a> {
        Local { arena, mrs: None }
    }

    /// The memory and offset local offset `off` names. (In line: each receive step's fast
    /// path writes a payload through it, and from two places it was compiled out of line.)
    #[inline(always)]
    fn at(&self, off: u64) -> std::result::Result<(&'a Mem, u64), OutOfRange> {
        match split_user_off(off) {
            None => Ok((self.arena, off)),
            Some((index, at)) => {
                let mem = self.mrs.and_then(|t| t.user_mem(index)).ok_or(OutOfRange)?;
                Ok((mem, at))
            }
        }
    }

    /// Copies `src` to local offset `off`.
    #[inline]
    pub(crate) fn write(&self, off: u64, src: &[u8]) -> std::result::Result<(), OutOfRange> {
        let (mem, at) = self.at(off)?;
        mem.write(at, src)
    }

    /// Copies `len` bytes of `src` at `src_off` to local offset `off`.
    #[inline]
    pub(crate) fn copy_from(
        &self,
        src: &Mem,
        src_off: u64,
        off: u64,
        len: u64,
    ) -> std::result::Result<(), OutOfRange> {
        let (mem, at) = self.at(off)?;
        Mem::copy(src, src_off, mem, at, len)
    }

    /// Atomic Fetch and Add on the word at local offset `off`; returns the original value.
    pub(crate) fn fetch_add_u64(&self, off: u64, add: u64) -> std::result::Result<u64, OutOfRange> {
        let (mem, at) = self.at(off)?;
        mem.fetch_add_u64(at, add)
    }

    /// Atomic Compare and Swap on the word at local offset `off`; returns the original.
    pub(crate) fn compare_swap_u64(
        &self,
        off: u64,
        compare: u64,
        swap: u64,
    ) -> std::result::Result<u64, OutOfRange> {
        let (mem, at) = self.at(off)?;
        mem.compare_swap_u64(at, compare, swap)
    }
}

/// A memfd (or any shareable file, e.g. one on hugetlbfs) mapped read-write in this
/// process, to register with [`Pd::reg_mr`](crate::Pd::reg_mr).
///
/// The region is private to this process like any registered buffer: peers read it through
/// the shadow (see the README, "Registering your own memory"). Keep the descriptor with
/// [`Memfd::as_fd`]; get it back from [`Memfd::into_fd`].
///
/// ```
/// use rustix::fs::{MemfdFlags, ftruncate, memfd_create};
/// use shmhca::{AccessFlags, Context, EngineMode, Memfd};
///
/// let ctx = Context::builder().mode(EngineMode::Inline).arena_size(1 << 20).build()?;
/// let pd = ctx.alloc_pd()?;
/// // MFD_ALLOW_SEALING: registration seals the file against shrinking and growing.
/// let fd = memfd_create("my-buffer", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
/// ftruncate(&fd, 64 << 10)?;
/// let mr = pd.reg_mr(Memfd::map(fd)?, AccessFlags::LOCAL_WRITE)?;
/// let sge = mr.sge(0, 4096)?; // post it like any region's
/// # let _ = sge;
/// let memfd: Memfd = mr.into_inner()?;
/// assert_eq!(memfd.len(), 64 << 10);
/// // The seals stay: no holder of the file can truncate it under a region, ever.
/// assert!(ftruncate(memfd.into_fd(), 4096).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Memfd {
    map: memmap2::MmapMut,
    fd: OwnedFd,
}

impl Memfd {
    /// Seals `fd` against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW`) and maps
    /// all of it (its size once sealed) read-write and shared.
    ///
    /// The seals are what make registering a file safe: without them any other holder of
    /// the file could truncate it, and the next write into the region (a peer's RDMA Write,
    /// a receive) would kill this process with `SIGBUS`. So the file must take seals:
    /// create it with `memfd_create(name, MFD_ALLOW_SEALING)` (add `MFD_HUGETLB` for huge
    /// pages), and do not add `F_SEAL_SEAL` before registering it. The seals stay after the
    /// region is deregistered (seals cannot be removed): the file keeps its size for good.
    /// `F_SEAL_SEAL` is not added, so the application may still add seals of its own.
    ///
    /// A hugetlbfs file's huge pages are reserved when it is mapped here (a shared mapping
    /// without `MAP_NORESERVE`): if the pool cannot hold the whole file this fails now,
    /// instead of a fault killing the process later.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the file cannot take the seals (not a memfd, created
    /// without `MFD_ALLOW_SEALING`, seals locked with `F_SEAL_SEAL`), is open read-only, is
    /// empty, cannot be mapped read-write (sealed against writes; for hugetlbfs, too few
    /// free huge pages) or is larger than a region holds (2 GiB). A refused file may have
    /// been sealed already if the refusal came after the seals (empty, too large, mapping).
    pub fn map(fd: OwnedFd) -> Result<Memfd> {
        use rustix::fs::SealFlags;
        let fixed = SealFlags::SHRINK | SealFlags::GROW;
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| {
            Error::invalid(
                "memfd",
                format!(
                    "descriptor {} cannot take seals ({e}): it is not a memfd; create one \
                     with memfd_create(name, MFD_ALLOW_SEALING) so that registration can seal \
                     it against truncation",
                    fd.as_raw_fd()
                ),
            )
        })?;
        if !seals.contains(fixed) {
            if seals.contains(SealFlags::SEAL) {
                return Err(Error::invalid(
                    "memfd",
                    format!(
                        "descriptor {}'s seals are locked (seals: {seals:?}; F_SEAL_SEAL is \
                         set, as memfd_create does without MFD_ALLOW_SEALING), so it cannot be \
                         sealed against truncation, and another holder could truncate it under \
                         the region (SIGBUS): create it with MFD_ALLOW_SEALING",
                        fd.as_raw_fd()
                    ),
                ));
            }
            rustix::fs::fcntl_add_seals(&fd, fixed).map_err(|e| {
                Error::invalid(
                    "memfd",
                    format!(
                        "sealing descriptor {} against shrinking and growing failed ({e}): \
                         pass the read-write descriptor memfd_create returned (seals need \
                         write access)",
                        fd.as_raw_fd()
                    ),
                )
            })?;
        }
        let file = std::fs::File::from(fd);
        // Sealed: the size read now is the size for good.
        let len = file
            .metadata()
            .map_err(|e| Error::invalid("memfd", format!("cannot stat it: {e}")))?
            .len();
        if len == 0 || len > crate::qp::MAX_MESSAGE {
            return Err(Error::invalid(
                "memfd",
                format!(
                    "{len} bytes; set its size (ftruncate) to 1 byte .. 2 GiB before registering it"
                ),
            ));
        }
        let map = crate::mem::map_file_shared(&file, len as usize).map_err(|e| {
            let hint = if e.raw_os_error() == Some(rustix::io::Errno::NOMEM.raw_os_error()) {
                " (for a hugetlbfs file: too few free huge pages to reserve all of it; \
                 reserve more with `echo 64 > /proc/sys/vm/nr_hugepages` or make it smaller)"
            } else {
                ""
            };
            Error::invalid("memfd", format!("cannot map it read-write: {e}{hint}"))
        })?;
        Ok(Memfd {
            map,
            fd: OwnedFd::from(file),
        })
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether it is empty (never: `map` refuses empty files).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The descriptor, unmapping the file.
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }
}

impl AsFd for Memfd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl sealed::Sealed for Memfd {}
impl UserBuffer for Memfd {
    fn byte_len(&self) -> usize {
        self.map.len()
    }
    fn exclusive(&self) -> bool {
        false
    }
    fn raw_parts(&mut self) -> (*mut u8, usize) {
        (self.map.as_mut_ptr(), self.map.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tables::mr::user_off;

    #[test]
    fn user_offsets_round_trip_and_never_look_like_arena_offsets() {
        let off = user_off(0xab_cdef, 0x7fff_ffff);
        assert_eq!(split_user_off(off), Some((0xab_cdef, 0x7fff_ffff)));
        assert_eq!(split_user_off(1 << 40), None);
        let arena = Mem::private(64);
        let local = Local::arena_only(&arena);
        assert_eq!(local.write(user_off(0, 0), &[1]), Err(OutOfRange));
        local.write(8, &[1]).unwrap();
    }
}
