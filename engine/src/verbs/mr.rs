//! Protection domains, memory regions and scatter/gather elements.

use std::sync::Arc;

use crate::device::Device;
use crate::error::{Error, Refused, Result};
use crate::mem::{Mem, UserOwner};
use crate::qp::{AccessFlags, MAX_MESSAGE};
use crate::tables::mr::MrShared;
use crate::user_buffer::UserBuffer;
#[cfg(doc)]
use crate::user_mem::Memfd;

/// Refuses the access rights verbs refuses for a memory region: remote write or remote
/// atomic access without local write (`ibv_reg_mr` fails with `EINVAL`; IBA 10.6.3.1: a
/// region a peer may write must be one the local HCA may write).
fn check_access(access: AccessFlags) -> Result<()> {
    let remote = access.bits() & (AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC).bits();
    if remote != 0 && !access.contains(AccessFlags::LOCAL_WRITE) {
        return Err(Error::invalid(
            "memory region access",
            "REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE as well (verbs refuses remote \
             write or atomic access to a region the local HCA may not write): add \
             AccessFlags::LOCAL_WRITE",
        ));
    }
    Ok(())
}

/// A protection domain: memory regions and QPs of one domain only work together (a
/// remote access through a QP of another domain is refused).
///
/// Each protection domain has its own arena of shared memory (`ContextBuilder::arena_size`
/// bytes, committed as regions are allocated), from which its regions and its QPs' inline
/// staging are carved. A peer can read a domain's arena only once a QP of that domain is
/// connected to it, and can never write it: see the security model in the
/// [`verbs`](crate::verbs) docs.
///
/// ```
/// use shmhca::{AccessFlags, Context, EngineMode};
///
/// let ctx = Context::builder().mode(EngineMode::Inline).arena_size(1 << 20).build()?;
/// let pd = ctx.alloc_pd()?;
/// let free = pd.arena_free();
/// let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
/// assert!(pd.arena_free() < free);
/// mr.deregister()?; // or drop it
/// # Ok::<(), shmhca::Error>(())
/// ```
pub struct Pd {
    pub(crate) shared: Arc<Device>,
    pub(crate) pdn: u32,
    /// The application's view of the domain's arena (shared with its regions).
    pub(crate) mem: Arc<Mem>,
}

impl Pd {
    /// Allocates and registers a memory region of `len` bytes from the arena, zero-filled,
    /// cache-line aligned, with the given access rights.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a length of 0 or above 2 GiB, or remote write or atomic
    /// access without `LOCAL_WRITE` (as `ibv_reg_mr` refuses it),
    /// [`Error::ArenaExhausted`] when the domain's arena has no room,
    /// [`Error::LimitReached`] past 2^23 regions.
    pub fn alloc_mr(&self, len: u64, access: AccessFlags) -> Result<Mr> {
        if len == 0 || len > MAX_MESSAGE {
            return Err(Error::invalid(
                "memory region length",
                format!("{len}; a region holds 1 byte to 2 GiB"),
            ));
        }
        check_access(access)?;
        let shared_mr = Arc::new(MrShared::default());
        let sm = shared_mr.clone();
        let pdn = self.pdn;
        let base = self.mem.base_addr();
        let (index, key, off) = self.shared.engine.with(|e| {
            let pds = &mut e.res.pds;
            let arena = pds.get_mut(pdn).ok_or(Error::ForeignObject {
                what: "the protection domain",
            })?;
            let block = arena.alloc(len, 64)?;
            match e
                .res
                .mrs
                .insert(pdn, access, block, len, base + block.off, sm)
            {
                Some((i, k)) => {
                    pds.hold(pdn);
                    Ok((i, k, block.off))
                }
                None => {
                    arena.free(block);
                    Err(Error::LimitReached {
                        what: "memory regions in one context",
                        limit: crate::tables::mr::MAX_MRS,
                    })
                }
            }
        })?;
        Ok(Mr {
            shared: self.shared.clone(),
            mem: self.mem.clone(),
            index,
            key,
            off,
            len,
            access,
            pdn,
            inflight: shared_mr,
            user: None,
            in_place: false,
        })
    }

    /// Registers memory the application already has — a `Vec<u8>`, a `Box<[u8]>`, a
    /// [`memmap2::MmapMut`] (anonymous or of a file) or a [`Memfd`] (plain or hugetlbfs) —
    /// taking it for the region's lifetime; [`UserMr::into_inner`] gives it back.
    ///
    /// The region works in every operation and as the target of every remote access its
    /// `access` allows, like one from [`Pd::alloc_mr`]. Peers never map the buffer: received
    /// data, RDMA Read results, Atomic results and a peer's RDMA Writes and Atomics are
    /// written into it directly by this process's engine (no extra copy), while what a peer
    /// must read (the payload of a Send or RDMA Write, a peer's RDMA Read) is first copied
    /// into the region's *shadow*, a block of the same length in the domain's arena (one
    /// copy). So registering takes `len` bytes of arena besides the buffer. The costs are
    /// measured in the README, "Registering your own memory".
    ///
    /// # Errors
    /// Gives the buffer back (a [`Refused`], which `?` turns into [`Error`]) with
    /// [`Error::InvalidArgument`] for an empty buffer or one above 2 GiB, or remote write or
    /// atomic access without `LOCAL_WRITE`, [`Error::ArenaExhausted`] when the arena has no room for the shadow, and
    /// [`Error::LimitReached`] past 2^24 regions.
    ///
    /// ```
    /// use shmhca::{AccessFlags, Context, EngineMode};
    ///
    /// let ctx = Context::builder().mode(EngineMode::Inline).arena_size(1 << 20).build()?;
    /// let pd = ctx.alloc_pd()?;
    /// let mr = pd.reg_mr(vec![0u8; 4096], AccessFlags::LOCAL_WRITE)?; // `?` works
    /// let buf: Vec<u8> = mr.into_inner()?;
    ///
    /// // A refusal hands the buffer back, unchanged, with the reason.
    /// let refused = pd.reg_mr(buf, AccessFlags::REMOTE_WRITE).unwrap_err();
    /// assert!(refused.to_string().contains("LOCAL_WRITE"), "{refused}");
    /// let buf: Vec<u8> = refused.into_value();
    /// assert_eq!(buf.len(), 4096);
    /// # Ok::<(), shmhca::Error>(())
    /// ```
    pub fn reg_mr<B: UserBuffer>(
        &self,
        buf: B,
        access: AccessFlags,
    ) -> std::result::Result<UserMr<B>, Refused<B>> {
        let len = buf.byte_len() as u64;
        if len == 0 || len > MAX_MESSAGE {
            return Err(Refused::new(
                buf,
                Error::invalid(
                    "memory region length",
                    format!("{len}; a registered buffer holds 1 byte to 2 GiB"),
                ),
            ));
        }
        if let Err(e) = check_access(access) {
            return Err(Refused::new(buf, e));
        }
        let exclusive = buf.exclusive();
        let (view, owner) = Mem::over_user(buf);
        let shared_mr = Arc::new(MrShared::default());
        let sm = shared_mr.clone();
        let pdn = self.pdn;
        let va = view.base_addr();
        let engine_view = view.share();
        let done = self.shared.engine.with(|e| {
            let pds = &mut e.res.pds;
            let arena = pds.get_mut(pdn).ok_or(Error::ForeignObject {
                what: "the protection domain",
            })?;
            let shadow = arena.alloc(len, 64)?;
            match e
                .res
                .mrs
                .insert_user(pdn, access, shadow, len, va, sm, engine_view)
            {
                Some((i, k)) => {
                    pds.hold(pdn);
                    Ok((i, k, shadow.off))
                }
                None => {
                    arena.free(shadow);
                    Err(Error::LimitReached {
                        what: "memory regions in one context",
                        limit: crate::tables::mr::MAX_MRS,
                    })
                }
            }
        });
        let (index, key, off) = match done {
            Ok(v) => v,
            Err(err) => {
                drop(view);
                return match Arc::try_unwrap(owner) {
                    Ok(o) => Err(Refused::new(o.into_inner(), err)),
                    Err(_) => unreachable!("no view of the buffer is left"),
                };
            }
        };
        Ok(UserMr {
            mr: Mr {
                shared: self.shared.clone(),
                mem: self.mem.clone(),
                index,
                key,
                off,
                len,
                access,
                pdn,
                inflight: shared_mr,
                user: Some(Box::new(Outside::Buffer(UserView {
                    mem: view,
                    exclusive,
                }))),
                in_place: false,
            },
            owner,
        })
    }

    /// Registers bytes `offset..offset + len` of the application's memfd that is this
    /// domain's arena ([`Context::alloc_pd_over`](crate::Context::alloc_pd_over)) as a
    /// memory region, in place: no copy at registration or ever after. A Send or RDMA Write
    /// gathering from it, and a peer's RDMA Read of it, reference the memfd's bytes
    /// directly; received data, RDMA Write and Atomic targets are written straight into it.
    /// Deregistering leaves the bytes as they are. Ranges may overlap.
    ///
    /// The application keeps writing the bytes through its own mapping. As with a real
    /// HCA, bytes it changes while a work request that reads them is in flight are sent
    /// as they are when the engine copies them into a packet (the last packet may carry
    /// newer bytes than the first); change them only after the work request's completion.
    /// [`Mr::as_mut_slice`] is refused for such a region (the application's mapping writes
    /// the same bytes): use its mapping, or [`Mr::read_at`]/[`Mr::write_at`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for remote write or atomic access without `LOCAL_WRITE`, if
    /// the domain's arena is not an application's memfd, or
    /// the range is empty, above 2 GiB or not inside the application's part of it (the
    /// first `len - staging` bytes); [`Error::LimitReached`] past 2^24 regions.
    pub fn reg_mr_at(&self, offset: u64, len: u64, access: AccessFlags) -> Result<Mr> {
        if len == 0 || len > MAX_MESSAGE {
            return Err(Error::invalid(
                "memory region length",
                format!("{len}; a region holds 1 byte to 2 GiB"),
            ));
        }
        check_access(access)?;
        let shared_mr = Arc::new(MrShared::default());
        let sm = shared_mr.clone();
        let pdn = self.pdn;
        let base = self.mem.base_addr();
        let index_key = self.shared.engine.with(|e| {
            let pds = &mut e.res.pds;
            let arena = pds.get_mut(pdn).ok_or(Error::ForeignObject {
                what: "the protection domain",
            })?;
            let user_len = arena.user_len();
            if user_len == 0 {
                return Err(Error::invalid(
                    "reg_mr_at",
                    "this protection domain's arena is shmhca's, not your memfd: create the \
                     domain with Context::alloc_pd_over(memfd, staging), or use alloc_mr/reg_mr",
                ));
            }
            match offset.checked_add(len) {
                Some(end) if end <= user_len => {}
                _ => {
                    return Err(Error::invalid(
                        "reg_mr_at",
                        format!(
                            "bytes {offset}..{offset}+{len} are not inside the first {user_len} \
                             bytes of the memfd (its length minus the staging given to \
                             alloc_pd_over), which are yours"
                        ),
                    ));
                }
            }
            let block = crate::arena::Block { off: offset, len };
            match e.res.mrs.insert(pdn, access, block, len, base + offset, sm) {
                Some(ik) => {
                    pds.hold(pdn);
                    Ok(ik)
                }
                None => Err(Error::LimitReached {
                    what: "memory regions in one context",
                    limit: crate::tables::mr::MAX_MRS,
                }),
            }
        })?;
        let (index, key) = index_key;
        Ok(Mr {
            shared: self.shared.clone(),
            mem: self.mem.clone(),
            index,
            key,
            off: offset,
            len,
            access,
            pdn,
            inflight: shared_mr,
            user: None,
            in_place: true,
        })
    }

    /// Registers the application's own memory `addr..addr + len` with zero copy, by
    /// moving its pages onto the domain's arena *in place*: the bytes are copied once into
    /// a page-aligned arena block, and the range at `addr` then becomes a second mapping of
    /// that block, so the application keeps using the same addresses and the same bytes,
    /// which are now arena memory. The region then works exactly like one from
    /// [`Pd::alloc_mr`] (Sends, RDMA Writes and a peer's RDMA Reads take the bytes with no
    /// shadow copy) and its address ([`Mr::addr`]) is `addr`.
    ///
    /// What this exposes: like every arena region, the bytes become readable (never
    /// writable) by the processes of peers connected to a QP of this domain, whatever the
    /// region's access rights.
    ///
    /// Dropping or deregistering the region gives the application private memory back at
    /// `addr` (fresh anonymous pages, read/write) holding the region's current bytes, and
    /// frees the block. A remote write that lands after that is lost, as with any
    /// deregistered region.
    ///
    /// # Safety
    /// `addr..addr + len` is memory the caller owns, mapped read/write, that nothing else
    /// uses during this call (no other thread, no Rust reference, no I/O in progress), and
    /// that the caller does not unmap, remap or free while the region lives. Its pages are
    /// replaced twice (here and when the region is dropped): a mapping with special
    /// properties there (a file mapping, locked or shared memory) loses them and ends up
    /// private anonymous memory.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `addr` or `len` is not a multiple of the 4 KiB page
    /// size (or `len` is 0 or above 2 GiB), the system or the domain's arena does not use
    /// 4 KiB pages (a huge-page arena), remote write or atomic access lacks `LOCAL_WRITE`,
    /// or the kernel refuses the remapping; [`Error::ArenaExhausted`] when the arena has
    /// no room for `len` bytes; [`Error::LimitReached`] past 2^24 regions. On every error
    /// the memory at `addr` holds its bytes as before (private memory).
    ///
    /// ```
    /// use shmhca::{AccessFlags, Context, EngineMode};
    ///
    /// let ctx = Context::builder()
    ///     .mode(EngineMode::Inline)
    ///     .arena_size(1 << 20)
    ///     .huge_pages(shmhca_rings::HugePages::Never) // a huge-page arena is refused
    ///     .build()?;
    /// let pd = ctx.alloc_pd()?;
    /// let mut buf = memmap2::MmapMut::map_anon(8192).expect("mmap");
    /// buf[0] = 42;
    /// // SAFETY: the mapping is ours, untouched during the call, and outlives the region.
    /// let mr = unsafe { pd.reg_mr_in_place(buf.as_mut_ptr(), 8192, AccessFlags::LOCAL_WRITE)? };
    /// assert_eq!(mr.addr(), buf.as_ptr() as u64);
    /// assert_eq!(mr.load_u64(0)? & 0xff, 42);
    /// drop(mr); // private memory again, with its bytes
    /// assert_eq!(buf[0], 42);
    /// # Ok::<(), shmhca::Error>(())
    /// ```
    #[allow(unsafe_code)]
    pub unsafe fn reg_mr_in_place(
        &self,
        addr: *mut u8,
        len: u64,
        access: AccessFlags,
    ) -> Result<Mr> {
        const PAGE: u64 = 4096;
        let what = "reg_mr_in_place";
        if len == 0 || len > MAX_MESSAGE {
            return Err(Error::invalid(
                what,
                format!("length {len}; a region holds 1 byte to 2 GiB"),
            ));
        }
        if addr as u64 % PAGE != 0 {
            return Err(Error::invalid(
                what,
                format!(
                    "address {addr:p} is not page-aligned: only whole 4 KiB pages can be moved \
                     onto the arena (use reg_mr for other memory)"
                ),
            ));
        }
        if len % PAGE != 0 {
            return Err(Error::invalid(
                what,
                format!(
                    "length {len} is not a multiple of the 4 KiB page size: only whole pages \
                     can be moved onto the arena (use reg_mr for other memory)"
                ),
            ));
        }
        let system_page = rustix::param::page_size() as u64;
        if system_page != PAGE {
            return Err(Error::invalid(
                what,
                format!("the system page size is {system_page} bytes, not 4 KiB"),
            ));
        }
        check_access(access)?;
        if !super::remap::claim(addr as usize, len as usize) {
            return Err(Error::invalid(
                what,
                format!(
                    "bytes {addr:p}+{len} overlap pages another region already moved onto an \
                     arena (register them once, or use reg_mr)"
                ),
            ));
        }
        // SAFETY: forwarded: the caller's contract.
        let r = unsafe { self.move_in_place(addr, len, access) };
        if r.is_err() {
            super::remap::unclaim(addr as usize);
        }
        r
    }

    /// [`Pd::reg_mr_in_place`] once the range is checked and claimed.
    ///
    /// # Safety
    /// As [`Pd::reg_mr_in_place`].
    #[allow(unsafe_code)]
    unsafe fn move_in_place(&self, addr: *mut u8, len: u64, access: AccessFlags) -> Result<Mr> {
        const PAGE: u64 = 4096;
        let what = "reg_mr_in_place";
        let shared_mr = Arc::new(MrShared::default());
        let pdn = self.pdn;
        let base = self.mem.base_addr();
        // A page-aligned block, whose offset in the memfd is page-aligned too.
        let block = self.shared.engine.with(|e| {
            let arena = e.res.pds.get_mut(pdn).ok_or(Error::ForeignObject {
                what: "the protection domain",
            })?;
            let seg = arena.segment();
            if seg.page_size() != shmhca_rings::segment::PageSize::Base4K {
                return Err(Error::invalid(
                    what,
                    format!(
                        "the protection domain's arena uses {:?} pages: its pages cannot \
                         stand in for the program's 4 KiB pages (use reg_mr, or an arena \
                         without huge pages)",
                        seg.page_size()
                    ),
                ));
            }
            let data_off = if seg.has_header() {
                shmhca_rings::segment::HEADER_LEN as u64
            } else {
                0
            };
            let block = arena.alloc(len, PAGE)?;
            let file_off = data_off + block.off;
            if file_off % PAGE != 0 || (base + block.off) % PAGE != 0 {
                arena.free(block);
                return Err(Error::invalid(
                    what,
                    format!("the arena block at memfd offset {file_off} is not page-aligned"),
                ));
            }
            Ok(block)
        })?;
        let block_ptr = (base + block.off) as *mut u8;
        let free = |b: crate::arena::Block| {
            self.shared.engine.with(|e| {
                if let Some(arena) = e.res.pds.get_mut(pdn) {
                    arena.free(b);
                }
            });
        };
        // SAFETY: the block is ours (just allocated, not registered: nothing reads or
        // writes it) and lies in the arena's writable shared mapping, which `self` keeps
        // alive; `addr..addr + len` is the caller's, as its contract says; both are
        // page-aligned (checked above) and `len` is a multiple of the page size.
        let moved = unsafe { super::remap::move_onto_arena(block_ptr, addr, len as usize) };
        if let Err(err) = moved {
            free(block);
            return Err(Error::invalid(
                what,
                format!("the kernel refused to remap the pages at {addr:p}: {err}"),
            ));
        }
        let sm = shared_mr.clone();
        let va = addr as u64;
        let done = self.shared.engine.with(|e| {
            let crate::context::Resources { mrs, pds, .. } = &mut e.res;
            let ik = mrs.insert(pdn, access, block, len, va, sm);
            if ik.is_some() {
                pds.hold(pdn);
            }
            ik
        });
        let Some((index, key)) = done else {
            // SAFETY: as above; the block holds the bytes and nothing else knows it.
            let back = unsafe { super::remap::move_back(block_ptr, addr, len as usize) };
            if back.is_ok() {
                free(block);
            }
            return Err(Error::LimitReached {
                what: "memory regions in one context",
                limit: crate::tables::mr::MAX_MRS,
            });
        };
        Ok(Mr {
            shared: self.shared.clone(),
            mem: self.mem.clone(),
            index,
            key,
            off: block.off,
            len,
            access,
            pdn,
            inflight: shared_mr,
            user: Some(Box::new(Outside::Moved(addr as usize))),
            in_place: false,
        })
    }

    pub(crate) fn same_context(&self, shared: &Arc<Device>) -> bool {
        Arc::ptr_eq(&self.shared, shared)
    }

    /// Bytes still free in the domain's arena.
    pub fn arena_free(&self) -> u64 {
        let pdn = self.pdn;
        self.shared
            .engine
            .with(|e| e.res.pds.get(pdn).map_or(0, |a| a.free_bytes()))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // The arena lives on while regions or QPs of the domain do.
        let pdn = self.pdn;
        self.shared.engine.with(|e| e.res.pds.unhold(pdn));
    }
}

impl std::fmt::Debug for Pd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pd").field("pdn", &self.pdn).finish()
    }
}

/// A registered memory region in this process's arena.
///
/// Its bytes are shared with the engine (which scatters received data into it) and, by
/// design, readable by connected peers' engines. See the [module docs](crate::verbs) for
/// how posting keeps buffers safe.
///
/// ```
/// use shmhca::{AccessFlags, Context, EngineMode};
///
/// let ctx = Context::builder().mode(EngineMode::Inline).build()?;
/// let pd = ctx.alloc_pd()?;
/// // A region only this process writes can be borrowed as a slice...
/// let mut mine = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
/// mine.as_mut_slice()?[..5].copy_from_slice(b"hello");
/// let sge = mine.sge(0, 5)?; // what a work request gathers from or scatters into
/// assert_eq!(sge.len(), 5);
/// // ...one a peer may write is only ever copied, like memory a NIC may DMA into.
/// let mut shared = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
/// assert!(shared.as_mut_slice().is_err());
/// shared.write_at(8, &7u64.to_le_bytes())?;
/// assert_eq!(shared.load_u64(8)?, 7);
/// let grant = shared.remote(0); // address and R_Key to hand the peer
/// # let _ = grant;
/// # Ok::<(), shmhca::Error>(())
/// ```
pub struct Mr {
    pub(crate) shared: Arc<Device>,
    /// The application's view of the region's arena (its protection domain's).
    pub(crate) mem: Arc<Mem>,
    pub(crate) index: u32,
    key: u32,
    /// Offset in the arena.
    pub(crate) off: u64,
    len: u64,
    access: AccessFlags,
    pub(crate) pdn: u32,
    pub(crate) inflight: Arc<MrShared>,
    /// The application's memory behind the region, if it is not only an arena block.
    user: Option<Box<Outside>>,
    /// Registered in place over the application's memfd ([`Pd::reg_mr_at`]).
    in_place: bool,
}

/// The application's memory behind a region (boxed: regions of `alloc_mr` carry none).
enum Outside {
    /// A registered application buffer ([`Pd::reg_mr`]); the region's `off` is its
    /// shadow's.
    Buffer(UserView),
    /// The address of the application's pages moved onto the region's arena block
    /// ([`Pd::reg_mr_in_place`]): a mapping of the block until the region is dropped.
    Moved(usize),
}

/// The application's view of a registered buffer.
struct UserView {
    mem: Mem,
    /// Whether only this process can write it (see [`UserBuffer`]).
    exclusive: bool,
}

impl Mr {
    /// The registered application buffer ([`Pd::reg_mr`]), if it is one.
    #[inline]
    fn buffer(&self) -> Option<&UserView> {
        match self.user.as_deref() {
            Some(Outside::Buffer(u)) => Some(u),
            _ => None,
        }
    }

    /// The bytes of a registered buffer ([`Pd::reg_mr`]): the application's private memory.
    #[inline(always)]
    pub(crate) fn private_bytes(&self) -> Option<&Mem> {
        self.buffer().map(|u| &u.mem)
    }

    /// The application's address of pages moved onto the arena ([`Pd::reg_mr_in_place`]).
    #[inline]
    fn moved(&self) -> Option<usize> {
        match self.user.as_deref() {
            Some(Outside::Moved(addr)) => Some(*addr),
            _ => None,
        }
    }

    /// The memory and offset of the region's byte 0: its buffer, or its arena block.
    #[inline]
    fn bytes(&self) -> (&Mem, u64) {
        match self.buffer() {
            Some(u) => (&u.mem, 0),
            None => (&self.mem, self.off),
        }
    }

    /// The local offset the engine writes byte `offset` of the region at.
    #[inline]
    pub(crate) fn dst_off(&self, offset: u64) -> u64 {
        // An arena region (`alloc_mr`) has no outside memory: tested on the box pointer
        // alone, which the post path loads anyway (no look at its kind).
        if self.user.is_none() {
            return self.off + offset;
        }
        self.dst_off_outside(offset)
    }

    /// [`Mr::dst_off`] with a region with outside memory handled here, not out of line (the
    /// verbs C ABI's receive path, whose regions are nearly all registered buffers).
    #[inline(always)]
    pub(crate) fn dst_off_inlined(&self, offset: u64) -> u64 {
        if self.user.is_none() {
            return self.off + offset;
        }
        self.dst_off_outside_inlined(offset)
    }

    /// [`Mr::dst_off`] of a region with outside memory: a registered buffer's user offset,
    /// or (pages moved onto the arena) its arena block's.
    #[inline(never)]
    fn dst_off_outside(&self, offset: u64) -> u64 {
        self.dst_off_outside_inlined(offset)
    }

    #[inline(always)]
    fn dst_off_outside_inlined(&self, offset: u64) -> u64 {
        match self.buffer() {
            Some(_) => crate::tables::mr::user_off(self.index, offset),
            None => self.off + offset,
        }
    }

    /// The arena offset a peer reads byte `offset` of the region at, `len` bytes of which
    /// are copied into the shadow now for a registered buffer.
    #[inline(always)]
    pub(crate) fn src_off(&self, offset: u64, len: u64) -> Result<u64> {
        // As in `dst_off`: only a region with outside memory looks at its kind.
        if self.user.is_some() {
            self.fill_shadow(offset, len)?;
        }
        Ok(self.off + offset)
    }

    /// Copies `len` bytes at `offset` of a registered buffer into its shadow (nothing for
    /// pages moved onto the arena: they are the block). From a page up, only the pages
    /// whose bytes changed since the last post are written ([`Mem::refresh`]): the peer's
    /// engine reads a program's resent unchanged bytes from its own cache.
    #[inline(never)]
    fn fill_shadow(&self, offset: u64, len: u64) -> Result<()> {
        match self.buffer() {
            Some(u) => Mem::refresh(&u.mem, offset, &self.mem, self.off + offset, len)
                .map_err(|_| self.oob(offset, len)),
            None => Ok(()),
        }
    }

    /// The L_Key, named by local scatter/gather elements.
    pub fn lkey(&self) -> u32 {
        self.key
    }

    /// The R_Key, which a peer puts in RDMA and Atomic requests (valid remotely only for
    /// the access rights the region was registered with).
    pub fn rkey(&self) -> u32 {
        self.key
    }

    /// The region's start address in this process, which peers use as the base of their
    /// remote addresses.
    #[inline]
    pub fn addr(&self) -> u64 {
        match self.user.as_deref() {
            None => self.mem.base_addr() + self.off,
            Some(Outside::Buffer(u)) => u.mem.base_addr(),
            Some(Outside::Moved(m)) => *m as u64,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty (never: regions hold at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Access rights.
    pub fn access(&self) -> AccessFlags {
        self.access
    }

    /// Where a peer reaches byte `offset` of this region.
    pub fn remote(&self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr() + offset,
            rkey: self.key,
        }
    }

    /// Scatter/gather elements of posted work requests still pointing into the region.
    pub fn in_flight(&self) -> u32 {
        // SYNC: Acquire (in `MrShared::in_flight`) pairs with the engine's Release store in
        // `MrTable::release`.
        self.inflight.in_flight()
    }

    #[inline]
    fn check(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                key: self.key,
                offset,
                len,
                mr_len: self.len,
            }),
        }
    }

    /// A scatter/gather element: `len` bytes at `offset` of this region.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] if the range is not inside the region.
    #[inline]
    pub fn sge(&self, offset: u64, len: u32) -> Result<Sge<'_>> {
        self.check(offset, u64::from(len))?;
        Ok(Sge {
            mr: self,
            offset,
            len,
        })
    }

    /// The whole region as one scatter/gather element (regions above 4 GiB − 1 cannot be).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the region is longer than `u32::MAX`.
    pub fn as_sge(&self) -> Result<Sge<'_>> {
        let len = u32::try_from(self.len)
            .map_err(|_| Error::invalid("sge", "a region above 4 GiB needs several elements"))?;
        self.sge(0, len)
    }

    /// Copies `buf.len()` bytes at `offset` out of the region.
    ///
    /// Always allowed: like a CPU load from memory a NIC may be writing, it can see an
    /// update in progress (bytes of two values), never anything worse.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len() as u64)?;
        let (mem, off) = self.bytes();
        mem.read(off + offset, buf)
            .map_err(|_| self.oob(offset, buf.len() as u64))
    }

    /// Copies `data` into the region at `offset`.
    ///
    /// Always allowed, like a CPU store to memory a NIC may be reading: a Send posted from
    /// these bytes and not yet completed may carry either version.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check(offset, data.len() as u64)?;
        let (mem, off) = self.bytes();
        mem.write(off + offset, data)
            .map_err(|_| self.oob(offset, data.len() as u64))
    }

    /// Atomically loads the 8-byte aligned word at `offset` (e.g. the target of a peer's
    /// Atomic), in host byte order.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], or [`Error::InvalidArgument`] if `offset` is not a multiple of 8.
    pub fn load_u64(&self, offset: u64) -> Result<u64> {
        self.check(offset, 8)?;
        if (self.addr() + offset) % 8 != 0 {
            return Err(Error::invalid(
                "offset",
                format!("{offset} is not 8-byte aligned"),
            ));
        }
        let (mem, off) = self.bytes();
        mem.load_u64(off + offset).map_err(|_| self.oob(offset, 8))
    }

    fn oob(&self, offset: u64, len: u64) -> Error {
        Error::OutOfBounds {
            key: self.key,
            offset,
            len,
            mr_len: self.len,
        }
    }

    /// The region as a mutable slice, for zero-copy access by the application.
    ///
    /// # Errors
    /// [`Error::MrRemoteWritable`] if peers may write it (they could change it while the
    /// slice lives), itself or through a memory window (`MW_BIND` with `LOCAL_WRITE`), and [`Error::MrBusy`] while posted work requests use it. For a
    /// registered buffer ([`Pd::reg_mr`]) also [`Error::InvalidArgument`] if peers may read
    /// it, itself or through a window (`REMOTE_READ` or `MW_BIND`: this engine copies it to the shadow at any time) or if it is a memfd or a
    /// memory map (another writer of the file could change it): use `read_at`/`write_at`.
    #[allow(unsafe_code)]
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        // A region that may have windows bound (MW_BIND) gets remote write or atomic rights
        // through a window whenever one is bound with them — which needs only LOCAL_WRITE,
        // and can happen while the slice lives (binding does not borrow the region).
        let via_window = self
            .access
            .contains(AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE);
        if self.access.remote_writable() || via_window {
            return Err(Error::MrRemoteWritable { key: self.key });
        }
        if self.moved().is_some() {
            return Err(Error::invalid(
                "as_mut_slice",
                "this region is the application's own memory moved onto the arena \
                 (reg_mr_in_place), which its own pointers write: use them, or \
                 read_at/write_at",
            ));
        }
        if self.in_place {
            return Err(Error::invalid(
                "as_mut_slice",
                "this region lies in your memfd, which your own mapping writes (and other \
                 regions may overlap): use your mapping, or read_at/write_at",
            ));
        }
        if let Some(u) = self.buffer() {
            let remote_read = self.access.contains(AccessFlags::REMOTE_READ)
                || self.access.contains(AccessFlags::MW_BIND);
            if !u.exclusive || remote_read {
                return Err(Error::invalid(
                    "as_mut_slice",
                    "this registered buffer may be read by the engine at any time (REMOTE_READ, or MW_BIND: a window may grant it) or written by another holder of its file (a memfd or memory map): use read_at/write_at",
                ));
            }
        }
        let in_flight = self.in_flight();
        if in_flight != 0 {
            return Err(Error::MrBusy {
                key: self.key,
                in_flight,
            });
        }
        let len = self.len;
        let (mem, off) = self.bytes();
        // SAFETY: `slice_mut` needs the bytes to be untouched by anything else while the
        // slice lives. `&mut self` excludes every other access through this handle and any
        // post from it for the slice's lifetime; the in-flight count is zero (Acquire: the
        // engine's last copy into the region happened before), so no posted work request —
        // hence no engine copy — targets the region; the engine refuses remote writes and
        // atomics because the region has no such rights, itself or through a window (no
        // MW_BIND with LOCAL_WRITE, checked above); and the arena allocator never gives two
        // regions overlapping bytes. A registered buffer is owned by the region
        // (moved in, never handed out while registered), only this process can write it
        // (`exclusive`), and no peer's RDMA Read stages it (no REMOTE_READ, and no MW_BIND
        // for a window to grant it).
        let slice = unsafe { mem.slice_mut(off, len) };
        slice.map_err(|_| self.oob(0, len))
    }

    /// Deregisters the region now.
    ///
    /// # Errors
    /// Gives the region back (a [`Refused`]; `?` turns it into [`Error`]) with [`Error::MrBusy`] while posted work requests use it, and
    /// with [`Error::MrHasWindows`] while memory windows are bound to it.
    pub fn deregister(self) -> std::result::Result<(), Refused<Mr>> {
        let in_flight = self.in_flight();
        if in_flight != 0 {
            let key = self.key;
            return Err(Refused::new(self, Error::MrBusy { key, in_flight }));
        }
        let key = self.key;
        let windows = self.shared.engine.with(|e| e.res.mws.bound_to_region(key));
        if windows != 0 {
            return Err(Refused::new(self, Error::MrHasWindows { key, windows }));
        }
        drop(self);
        Ok(())
    }
}

impl Drop for Mr {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        let (index, key) = (self.index, self.key);
        // Pages moved onto the arena go back to the application first, as private memory
        // with the block's bytes; should the kernel refuse, the block stays allocated
        // (the application's range still maps it) and only the key dies.
        let mut keep_block = false;
        if let Some(m) = self.moved() {
            let block = (self.mem.base_addr() + self.off) as *const u8;
            // SAFETY: the block is this region's, still allocated (freed below); `m`
            // is the application's range that `reg_mr_in_place`'s caller vouched for
            // until the region is gone, which is now.
            let back = unsafe { super::remap::move_back(block, m as *mut u8, self.len as usize) };
            keep_block = back.is_err();
            if !keep_block {
                super::remap::unclaim(m);
            }
        }
        self.shared.engine.with(|e| {
            let crate::context::Resources { mrs, pds, mws, .. } = &mut e.res;
            mws.unbind_region(key);
            if keep_block {
                mrs.keep_block(index);
            }
            mrs.remove(index, pds);
        });
    }
}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mr")
            .field("key", &format_args!("{:#x}", self.key))
            .field("len", &self.len)
            .field("access", &self.access)
            .finish()
    }
}

/// A memory region over a buffer the application registered with [`Pd::reg_mr`]: a
/// [`Mr`] (it dereferences to one, for `sge`, `read_at`, keys…) that owns the buffer until
/// [`UserMr::into_inner`] gives it back.
///
/// Dropping it deregisters the region; if posted work requests still use it, the buffer is
/// freed only after their completions (the engine keeps it alive), never under them.
///
/// A message received straight into the application's own `Vec` (the receiving engine
/// copies it there from the sender's memory, once):
///
/// ```
/// use shmhca::{AccessFlags, Loopback, RecvWr, SendOp, SendWr, WcStatus};
///
/// let mut lo = Loopback::new()?;
/// let src = lo.a.pd.alloc_mr(64, AccessFlags::NONE)?;
/// src.write_at(0, b"into my Vec")?;
/// let mine = lo.b.pd.reg_mr(vec![0u8; 64], AccessFlags::LOCAL_WRITE)?;
/// lo.b.qp.post_recv(&RecvWr::new(1, &[mine.sge(0, 64)?]))?;
/// lo.a.qp.post_send(&SendWr::new(2, SendOp::Send, &[src.sge(0, 11)?]))?;
/// assert_eq!(lo.wait_b()?.status, WcStatus::Success);
/// let buf: Vec<u8> = mine.into_inner()?; // deregistered; the Vec is back
/// assert_eq!(&buf[..11], b"into my Vec");
/// # Ok::<(), shmhca::Error>(())
/// ```
pub struct UserMr<B: UserBuffer> {
    mr: Mr,
    owner: Arc<UserOwner<B>>,
}

impl<B: UserBuffer> UserMr<B> {
    /// Deregisters the region and gives the buffer back.
    ///
    /// # Errors
    /// Gives the region back (a [`Refused`]; `?` turns it into [`Error`]) with [`Error::MrBusy`] while posted work requests use it.
    pub fn into_inner(self) -> std::result::Result<B, Refused<UserMr<B>>> {
        let in_flight = self.mr.in_flight();
        if in_flight != 0 {
            let key = self.mr.key;
            return Err(Refused::new(self, Error::MrBusy { key, in_flight }));
        }
        let UserMr { mr, owner } = self;
        // Nothing is in flight and nothing can be posted (the region is ours), so the
        // engine frees the entry now, dropping its view of the buffer.
        drop(mr);
        match Arc::try_unwrap(owner) {
            Ok(o) => Ok(o.into_inner()),
            Err(_) => unreachable!("the engine dropped its view of an idle region"),
        }
    }
}

impl<B: UserBuffer> std::ops::Deref for UserMr<B> {
    type Target = Mr;
    fn deref(&self) -> &Mr {
        &self.mr
    }
}

impl<B: UserBuffer> std::ops::DerefMut for UserMr<B> {
    fn deref_mut(&mut self) -> &mut Mr {
        &mut self.mr
    }
}

impl<B: UserBuffer> std::fmt::Debug for UserMr<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("UserMr").field(&self.mr).finish()
    }
}

/// A scatter/gather element: a range of a memory region, checked when made.
#[derive(Debug, Clone, Copy)]
pub struct Sge<'a> {
    pub(crate) mr: &'a Mr,
    pub(crate) offset: u64,
    pub(crate) len: u32,
}

impl Sge<'_> {
    /// Its length in bytes.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A remote memory location: an address in the peer's memory region and its R_Key
/// (obtained from the peer, e.g. [`crate::Mr::remote`] sent over a Send).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RemoteAddr {
    /// Virtual address in the remote process (the region's [`crate::Mr::addr`] plus an offset).
    pub addr: u64,
    /// The remote region's R_Key.
    pub rkey: u32,
}

impl RemoteAddr {
    /// The location `bytes` further on.
    pub fn offset(self, bytes: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr.wrapping_add(bytes),
            rkey: self.rkey,
        }
    }

    /// Encodes it in 12 bytes (to send to a peer).
    pub fn to_bytes(self) -> [u8; 12] {
        let mut b = [0u8; 12];
        b[..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..].copy_from_slice(&self.rkey.to_le_bytes());
        b
    }

    /// Decodes [`RemoteAddr::to_bytes`].
    pub fn from_bytes(b: [u8; 12]) -> RemoteAddr {
        RemoteAddr {
            addr: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            rkey: u32::from_le_bytes(b[8..].try_into().expect("4 bytes")),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(unsafe_code)]

    use crate::mem::REFRESH_CHUNK;
    use crate::{AccessFlags, Context, EngineMode};
    use shmhca_rings::HugePages;

    /// Sets the whole pages of `start..start + len` to `prot`.
    fn protect_inner_pages(start: u64, len: usize, prot: libc::c_int) {
        let page = REFRESH_CHUNK as u64;
        let (from, to) = (
            start.next_multiple_of(page),
            (start + len as u64) / page * page,
        );
        assert!(to > from, "no whole page inside");
        // SAFETY: whole pages of the test's own arena mapping, given back their read/write
        // access before the mapping is used again; nothing else touches them meanwhile.
        let r = unsafe { libc::mprotect(from as *mut libc::c_void, (to - from) as usize, prot) };
        assert_eq!(r, 0, "mprotect: {}", std::io::Error::last_os_error());
    }

    /// A post of a registered buffer's unchanged pages writes none of its shadow (which a
    /// peer's engine then keeps reading from its own cache), and a post after one byte
    /// changed writes that page only, with the new byte. Before (`Mem::copy` on every
    /// post), the second post wrote the read-only pages: SIGSEGV.
    #[test]
    fn a_post_of_unchanged_pages_writes_none_of_the_shadow() {
        let ctx = Context::builder()
            .mode(EngineMode::Inline)
            .huge_pages(HugePages::Never)
            .build()
            .unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let len = 6 * REFRESH_CHUNK;
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        let mr = pd.reg_mr(bytes.clone(), AccessFlags::LOCAL_WRITE).unwrap();
        let shadow = mr.mem.base_addr() + mr.off;
        let posted = (REFRESH_CHUNK as u64, 4 * REFRESH_CHUNK as u64);
        assert_eq!(mr.src_off(posted.0, posted.1).unwrap(), mr.off + posted.0);
        let shadow_bytes = |mr: &crate::Mr| {
            let mut b = vec![0u8; len];
            mr.mem.read(mr.off, &mut b).unwrap();
            b
        };
        let (a, b) = (posted.0 as usize, (posted.0 + posted.1) as usize);
        assert_eq!(shadow_bytes(&mr)[a..b], bytes[a..b]);

        protect_inner_pages(shadow, len, libc::PROT_READ);
        mr.src_off(posted.0, posted.1).unwrap();
        protect_inner_pages(shadow, len, libc::PROT_READ | libc::PROT_WRITE);

        let at = 2 * REFRESH_CHUNK + 100;
        mr.write_at(at as u64, &[!bytes[at]]).unwrap();
        let page = shadow + 2 * REFRESH_CHUNK as u64;
        protect_inner_pages(shadow, 2 * REFRESH_CHUNK, libc::PROT_READ);
        protect_inner_pages(
            page + REFRESH_CHUNK as u64,
            3 * REFRESH_CHUNK,
            libc::PROT_READ,
        );
        mr.src_off(posted.0, posted.1).unwrap();
        protect_inner_pages(shadow, len, libc::PROT_READ | libc::PROT_WRITE);
        let mut want = bytes;
        want[at] = !want[at];
        assert_eq!(shadow_bytes(&mr)[a..b], want[a..b]);
    }
}
