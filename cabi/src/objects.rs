//! Protection domains, memory regions and windows, completion queues and channels, shared
//! receive queues: each a `#[repr(C)]` Rust struct whose first field is the C struct, so the
//! C pointer handed out is the object's address.

use std::ffi::{c_int, c_void};
use std::os::fd::AsRawFd;
use std::ptr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use shmhca::{AccessFlags, CompChannel, Cq, Mr, Mw, MwType, Pd, RawBuffer, Srq, UserMr};

use crate::context::{CtxObj, ctx_of};
use crate::ffi::*;
use crate::util::{fail, guard, set_errno, unsupported};

/// A protection domain.
#[repr(C)]
pub struct PdObj {
    /// What C sees.
    pub pd: ibv_pd,
    /// The Rust domain.
    pub rust: Pd,
}

/// # Safety
/// `p` is null or a live object of this library whose first field is `C`.
#[inline(always)]
pub(crate) unsafe fn obj<'a, C, T>(p: *mut C) -> Option<&'a mut T> {
    // SAFETY: the caller's promise; the C struct is the first field of the `repr(C)` T.
    unsafe { p.cast::<T>().as_mut() }
}

/// The context an object's `context` field names.
///
/// # Safety
/// `c` as in [`ctx_of`].
pub(crate) unsafe fn ctx<'a>(c: *mut ibv_context) -> Option<&'a CtxObj> {
    // SAFETY: forwarded.
    unsafe { ctx_of(c) }
}

fn boxed<T>(v: T) -> *mut T {
    Box::into_raw(Box::new(v))
}

/// `ibv_alloc_pd`.
#[unsafe(export_name = "__shmhca_ibv_alloc_pd")]
pub unsafe extern "C" fn ibv_alloc_pd(context: *mut ibv_context) -> *mut ibv_pd {
    guard("ibv_alloc_pd", ptr::null_mut(), || {
        // SAFETY: a context of ours or null.
        let Some(c) = (unsafe { ctx(context) }) else {
            set_errno(libc::EINVAL);
            return ptr::null_mut();
        };
        match c.ctx.alloc_pd() {
            Ok(rust) => boxed(PdObj {
                pd: ibv_pd { context, handle: 0 },
                rust,
            })
            .cast(),
            Err(e) => {
                set_errno(fail("ibv_alloc_pd", &e));
                ptr::null_mut()
            }
        }
    })
}

/// `ibv_dealloc_pd`.
#[unsafe(export_name = "__shmhca_ibv_dealloc_pd")]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    guard("ibv_dealloc_pd", libc::EIO, || {
        if pd.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: a PdObj of ours, given up by the caller.
        drop(unsafe { Box::from_raw(pd.cast::<PdObj>()) });
        0
    })
}

/// A memory region over the program's own memory.
#[repr(C)]
pub struct MrObj {
    /// What C sees.
    pub mr: ibv_mr,
    /// The Rust region.
    pub rust: MrRegion,
    /// `&*rust`, resolved once at registration for the post path (which would otherwise
    /// look at the kind of region on every element): it points into this object, which
    /// stays at its address while registered.
    region: *const Mr,
}

impl MrObj {
    /// The Rust region, as [`MrObj::rust`] derefs to it.
    #[inline(always)]
    pub fn region(&self) -> &Mr {
        debug_assert!(std::ptr::eq(self.region, &*self.rust));
        // SAFETY: `region` was set to `&*self.rust` once the object was at its final
        // address (`reg`), and `rust` is not replaced while the object lives (`ibv_dereg_mr`
        // that fails writes the same value back at the same address).
        unsafe { &*self.region }
    }
}

/// How the program's memory behind an `ibv_mr` is registered.
pub enum MrRegion {
    /// As a registered buffer ([`shmhca::Pd::reg_mr`]): written in place, and what peers
    /// read (Send and RDMA Write sources, RDMA Read responses) copied to a shadow in the
    /// arena first.
    Shadowed(UserMr<RawBuffer>),
    /// Its whole pages moved onto the protection domain's arena in place
    /// ([`shmhca::Pd::reg_mr_in_place`], with `SHMHCA_VERBS_ZERO_COPY=1`): no copy at all.
    Moved(Mr),
}

impl std::ops::Deref for MrRegion {
    type Target = Mr;
    #[inline]
    fn deref(&self) -> &Mr {
        match self {
            MrRegion::Shadowed(u) => u,
            MrRegion::Moved(m) => m,
        }
    }
}

/// With `SHMHCA_VERBS_ZERO_COPY=1`, moves the program's page-aligned whole pages onto the
/// domain's arena; `None` (the reason on stderr with `SHMHCA_VERBS_DEBUG`) when it does not
/// apply or the engine refuses, for the caller to register a shadowed buffer instead.
///
/// # Safety
/// `addr..addr + len` is the program's memory, mapped read/write, which verbs' contract
/// keeps mapped until `ibv_dereg_mr` and which the program does not use during
/// `ibv_reg_mr`.
unsafe fn reg_moved(pd: &Pd, addr: *mut c_void, len: usize, access: AccessFlags) -> Option<Mr> {
    const PAGE: usize = 4096;
    if !crate::progress::zero_copy() || addr as usize % PAGE != 0 || len % PAGE != 0 {
        return None;
    }
    let debug = std::env::var_os("SHMHCA_VERBS_DEBUG").is_some();
    // SAFETY: the caller's contract, which is `reg_mr_in_place`'s.
    match unsafe { pd.reg_mr_in_place(addr.cast(), len as u64, access) } {
        Ok(mr) => {
            if debug {
                eprintln!(
                    "shmhca: ibv_reg_mr: {len} bytes at {addr:p} moved onto the arena in place \
                     (zero copy)"
                );
            }
            Some(mr)
        }
        Err(e) => {
            if debug {
                eprintln!(
                    "shmhca: ibv_reg_mr: {len} bytes at {addr:p} registered with a shadow, not \
                     in place: {e}"
                );
            }
            None
        }
    }
}

/// The access flags verbs defines that shmhca has; `None` (and one stderr line) for those it
/// does not (on-demand paging, zero-based regions). Flags in verbs' optional range
/// (relaxed ordering) may be ignored, as verbs allows.
pub(crate) fn access_of(bits: c_int, what: &'static str) -> Result<AccessFlags, c_int> {
    let bits = bits as u32;
    // verbs.h: IBV_ACCESS_OPTIONAL_RANGE, bits 20..29 (a macro bindgen cannot see).
    let optional: u32 = ((1u32 << 30) - 1) & !(IBV_ACCESS_OPTIONAL_FIRST - 1);
    let known = IBV_ACCESS_LOCAL_WRITE
        | IBV_ACCESS_REMOTE_WRITE
        | IBV_ACCESS_REMOTE_READ
        | IBV_ACCESS_REMOTE_ATOMIC
        | IBV_ACCESS_MW_BIND;
    if bits & IBV_ACCESS_ON_DEMAND != 0 {
        return Err(unsupported(
            "on-demand paging (IBV_ACCESS_ON_DEMAND)",
            what,
            libc::EOPNOTSUPP,
        ));
    }
    if bits & IBV_ACCESS_ZERO_BASED != 0 {
        return Err(unsupported(
            "zero-based regions (IBV_ACCESS_ZERO_BASED)",
            what,
            libc::EOPNOTSUPP,
        ));
    }
    let rest = bits & !known & !optional & !IBV_ACCESS_HUGETLB;
    if rest != 0 {
        return Err(libc::EINVAL);
    }
    AccessFlags::from_bits((bits & known) as u8).ok_or(libc::EINVAL)
}

unsafe fn reg(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    guard("ibv_reg_mr", ptr::null_mut(), || {
        // SAFETY: a PdObj of ours or null.
        let Some(p) = (unsafe { obj::<_, PdObj>(pd) }) else {
            set_errno(libc::EINVAL);
            return ptr::null_mut();
        };
        // SAFETY: the pd's context is ours.
        let Some(c) = (unsafe { ctx(p.pd.context) }) else {
            set_errno(libc::EINVAL);
            return ptr::null_mut();
        };
        if addr.is_null() || len == 0 {
            set_errno(libc::EINVAL);
            return ptr::null_mut();
        }
        if iova != addr as u64 {
            unsupported(
                "a memory region whose IOVA differs from its address",
                "ibv_reg_mr_iova",
                libc::EOPNOTSUPP,
            );
            return ptr::null_mut();
        }
        let access = match access_of(access, "ibv_reg_mr") {
            Ok(a) => a,
            Err(e) => {
                set_errno(e);
                return ptr::null_mut();
            }
        };
        // SAFETY: verbs' contract: the program keeps the memory mapped while it is
        // registered, and does not use it while registering it.
        let rust = match unsafe { reg_moved(&p.rust, addr, len, access) } {
            Some(mr) => Ok(MrRegion::Moved(mr)),
            None => {
                // SAFETY: verbs' contract: the program keeps the memory mapped while it is
                // registered (until ibv_dereg_mr, which hands it back through into_inner).
                let buf = unsafe { RawBuffer::new(addr.cast(), len) };
                p.rust.reg_mr(buf, access).map(MrRegion::Shadowed)
            }
        };
        match rust {
            Ok(rust) => {
                let (lkey, rkey) = (rust.lkey(), rust.rkey());
                let m = boxed(MrObj {
                    mr: ibv_mr {
                        context: p.pd.context,
                        pd,
                        addr,
                        length: len,
                        handle: 0,
                        lkey,
                        rkey,
                    },
                    rust,
                    region: ptr::null(),
                });
                // SAFETY: `m` was just allocated and is not shared yet; `rust` is at its
                // final address.
                unsafe { (*m).region = &*(*m).rust };
                c.mrs.insert(lkey, m);
                m.cast()
            }
            Err(refused) => {
                set_errno(fail("ibv_reg_mr", refused.error()));
                ptr::null_mut()
            }
        }
    })
}

/// `ibv_reg_mr` (the exported symbol of older headers; newer ones inline to
/// `ibv_reg_mr_iova2`).
#[unsafe(export_name = "__shmhca_ibv_reg_mr")]
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded.
    unsafe { reg(pd, addr, len, addr as u64, access) }
}

/// `ibv_reg_mr_iova` (IOVA must equal the address).
#[unsafe(export_name = "__shmhca_ibv_reg_mr_iova")]
pub unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded.
    unsafe { reg(pd, addr, len, iova, access) }
}

/// `ibv_reg_mr_iova2` (IOVA must equal the address).
#[unsafe(export_name = "__shmhca_ibv_reg_mr_iova2")]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: u32,
) -> *mut ibv_mr {
    // SAFETY: forwarded.
    unsafe { reg(pd, addr, len, iova, access as c_int) }
}

/// `ibv_dereg_mr`: EBUSY while posted work requests still use the region.
#[unsafe(export_name = "__shmhca_ibv_dereg_mr")]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    guard("ibv_dereg_mr", libc::EIO, || {
        if mr.is_null() {
            return libc::EINVAL;
        }
        let p = mr.cast::<MrObj>();
        // SAFETY: an MrObj of ours, given up by the caller: moved out here, and either its
        // memory freed below or the object written back to the same place.
        let m = unsafe { ptr::read(p) };
        // SAFETY: the region's context is ours.
        let c = unsafe { ctx(m.mr.context) };
        let key = m.mr.lkey;
        if let Some(c) = c {
            c.mrs.remove(key);
        }
        let MrObj {
            mr: cmr,
            rust,
            region,
        } = m;
        // A moved region gives the program private pages back (with their bytes) as it
        // goes; a shadowed one hands back the buffer, which is the program's.
        let done = match rust {
            MrRegion::Shadowed(u) => u.into_inner().map(drop).map_err(|r| {
                let e = fail("ibv_dereg_mr", r.error());
                (e, MrRegion::Shadowed(r.into_value()))
            }),
            MrRegion::Moved(m) => m.deregister().map_err(|r| {
                let e = fail("ibv_dereg_mr", r.error());
                (e, MrRegion::Moved(r.into_value()))
            }),
        };
        match done {
            Ok(()) => {
                // SAFETY: the allocation Box::into_raw made; its value was moved out above.
                drop(unsafe { Box::from_raw(p.cast::<std::mem::MaybeUninit<MrObj>>()) });
                0 // the memory is the program's: nothing else to free
            }
            Err((e, rust)) => {
                // Still in use (EBUSY): the region stays registered, at the same address.
                // SAFETY: the place the object was read from, still allocated.
                unsafe {
                    p.write(MrObj {
                        mr: cmr,
                        rust,
                        region,
                    })
                };
                if let Some(c) = c {
                    c.mrs.insert(key, p);
                }
                e
            }
        }
    })
}

/// A completion channel.
#[repr(C)]
pub struct ChanObj {
    /// What C sees.
    pub ch: ibv_comp_channel,
    /// The Rust channel.
    pub rust: Mutex<CompChannel>,
    /// Its completion queues by number.
    pub cqs: Mutex<Vec<(u32, *mut CqObj)>>,
}

/// `ibv_create_comp_channel`.
#[unsafe(export_name = "__shmhca_ibv_create_comp_channel")]
pub unsafe extern "C" fn ibv_create_comp_channel(
    context: *mut ibv_context,
) -> *mut ibv_comp_channel {
    guard("ibv_create_comp_channel", ptr::null_mut(), || {
        // SAFETY: a context of ours or null.
        let Some(c) = (unsafe { ctx(context) }) else {
            set_errno(libc::EINVAL);
            return ptr::null_mut();
        };
        match c.ctx.create_comp_channel() {
            Ok(rust) => {
                let fd = rust.as_raw_fd();
                boxed(ChanObj {
                    ch: ibv_comp_channel {
                        context,
                        fd,
                        refcnt: 0,
                    },
                    rust: Mutex::new(rust),
                    cqs: Mutex::new(Vec::new()),
                })
                .cast()
            }
            Err(e) => {
                set_errno(fail("ibv_create_comp_channel", &e));
                ptr::null_mut()
            }
        }
    })
}

/// `ibv_destroy_comp_channel`: EBUSY while completion queues use it.
#[unsafe(export_name = "__shmhca_ibv_destroy_comp_channel")]
pub unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    guard("ibv_destroy_comp_channel", libc::EIO, || {
        // SAFETY: a ChanObj of ours or null.
        let Some(chan) = (unsafe { obj::<_, ChanObj>(ch) }) else {
            return libc::EINVAL;
        };
        if !chan
            .cqs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
        {
            return libc::EBUSY;
        }
        // SAFETY: allocated by ibv_create_comp_channel; the caller gives it up.
        drop(unsafe { Box::from_raw(ch.cast::<ChanObj>()) });
        0
    })
}

/// A completion queue.
#[repr(C)]
pub struct CqObj {
    /// What C sees.
    pub cq: ibv_cq,
    /// The Rust queue.
    pub rust: Cq,
    /// Its channel, or null.
    pub chan: *mut ChanObj,
    /// Events acknowledged (`ibv_ack_cq_events`).
    pub acked: AtomicU32,
}

/// `ibv_create_cq`.
#[unsafe(export_name = "__shmhca_ibv_create_cq")]
pub unsafe extern "C" fn ibv_create_cq(
    context: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    _comp_vector: c_int,
) -> *mut ibv_cq {
    guard("ibv_create_cq", ptr::null_mut(), || {
        // SAFETY: a context of ours or null.
        let Some(c) = (unsafe { ctx(context) }) else {
            set_errno(libc::EINVAL);
            return ptr::null_mut();
        };
        if cqe <= 0 {
            set_errno(libc::EINVAL);
            return ptr::null_mut();
        }
        // SAFETY: a channel of ours or null.
        let chan = unsafe { obj::<_, ChanObj>(channel) };
        let made = match &chan {
            Some(ch) => {
                let r = ch.rust.lock().unwrap_or_else(|e| e.into_inner());
                c.ctx.create_cq_with_channel(cqe as u32, &r)
            }
            None => c.ctx.create_cq(cqe as u32),
        };
        let rust = match made {
            Ok(r) => r,
            Err(e) => {
                set_errno(fail("ibv_create_cq", &e));
                return ptr::null_mut();
            }
        };
        // SAFETY: plain data (pthread objects zeroed are their static initializers).
        let mut cq: ibv_cq = unsafe { std::mem::zeroed() };
        cq.context = context;
        cq.channel = channel;
        cq.cq_context = cq_context;
        cq.cqe = c_int::try_from(rust.capacity()).unwrap_or(c_int::MAX);
        let number = rust.number();
        let chan_ptr = chan.map_or(ptr::null_mut(), |c| c as *mut ChanObj);
        let o = boxed(CqObj {
            cq,
            rust,
            chan: chan_ptr,
            acked: AtomicU32::new(0),
        });
        if !chan_ptr.is_null() {
            // SAFETY: the channel is live (checked above).
            unsafe {
                (*chan_ptr)
                    .cqs
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((number, o))
            };
        }
        o.cast()
    })
}

/// `ibv_destroy_cq`.
#[unsafe(export_name = "__shmhca_ibv_destroy_cq")]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    guard("ibv_destroy_cq", libc::EIO, || {
        if cq.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: a CqObj of ours, given up by the caller.
        let o = unsafe { Box::from_raw(cq.cast::<CqObj>()) };
        if !o.chan.is_null() {
            let me = cq.cast::<CqObj>();
            // SAFETY: a channel outlives its queues (destroy_comp_channel refuses otherwise).
            unsafe {
                (*o.chan)
                    .cqs
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retain(|&(_, p)| p != me)
            };
        }
        drop(o);
        0
    })
}

/// `ibv_resize_cq`: not supported (the queue keeps its size).
#[unsafe(export_name = "__shmhca_ibv_resize_cq")]
pub unsafe extern "C" fn ibv_resize_cq(_cq: *mut ibv_cq, _cqe: c_int) -> c_int {
    unsupported(
        "ibv_resize_cq",
        "a completion queue keeps the size it was created with",
        libc::EOPNOTSUPP,
    )
}

/// `ibv_get_cq_event`: waits for the next event of the channel's queues.
#[unsafe(export_name = "__shmhca_ibv_get_cq_event")]
pub unsafe extern "C" fn ibv_get_cq_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    guard("ibv_get_cq_event", -1, || {
        // SAFETY: a channel of ours or null.
        let Some(chan) = (unsafe { obj::<_, ChanObj>(channel) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if cq.is_null() || cq_context.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        // The channel's fd is shmhca's eventfd, non-blocking from birth, so the program's
        // O_NONBLOCK cannot be told from it: this always waits for an event. Programs
        // that use a non-blocking channel poll the fd first and call this once it is
        // readable, when it returns at once.
        let got = chan
            .rust
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_event(None);
        let number = match got {
            Ok(Some(n)) => n,
            Ok(None) => {
                set_errno(libc::EIO);
                return -1;
            }
            Err(e) => {
                set_errno(fail("ibv_get_cq_event", &e));
                return -1;
            }
        };
        let found = chan
            .cqs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|&&(n, _)| n == number)
            .map(|&(_, p)| p);
        let Some(o) = found else {
            if std::env::var_os("SHMHCA_VERBS_DEBUG").is_some() {
                eprintln!(
                    "shmhca: ibv_get_cq_event: an event for CQ {number}, which is not one of this channel's"
                );
            }
            set_errno(libc::EIO);
            return -1;
        };
        // SAFETY: a live queue of the channel; the caller's out pointers.
        unsafe {
            cq.write(o.cast());
            cq_context.write((*o).cq.cq_context);
        }
        0
    })
}

/// `ibv_ack_cq_events`.
#[unsafe(export_name = "__shmhca_ibv_ack_cq_events")]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: u32) {
    guard("ibv_ack_cq_events", (), || {
        // SAFETY: a CqObj of ours or null.
        if let Some(o) = unsafe { obj::<_, CqObj>(cq) } {
            o.acked.fetch_add(nevents, Ordering::Relaxed);
            o.cq.comp_events_completed = o.cq.comp_events_completed.wrapping_add(nevents);
        }
    })
}

/// A shared receive queue.
#[repr(C)]
pub struct SrqObj {
    /// What C sees.
    pub srq: ibv_srq,
    /// The Rust queue.
    pub rust: Srq,
    /// The limit armed by `ibv_modify_srq`.
    pub limit: u32,
    /// Elements per receive.
    pub max_sge: u32,
}

/// `ibv_create_srq`.
#[unsafe(export_name = "__shmhca_ibv_create_srq")]
pub unsafe extern "C" fn ibv_create_srq(
    pd: *mut ibv_pd,
    attr: *mut ibv_srq_init_attr,
) -> *mut ibv_srq {
    guard("ibv_create_srq", ptr::null_mut(), || {
        // SAFETY: a PdObj of ours or null; the caller's attributes.
        let (Some(p), Some(a)) = (unsafe { obj::<_, PdObj>(pd) }, unsafe { attr.as_mut() }) else {
            set_errno(libc::EINVAL);
            return ptr::null_mut();
        };
        let max_sge = a.attr.max_sge.max(1);
        match p.rust.create_srq(a.attr.max_wr.max(1), max_sge) {
            Ok(rust) => {
                a.attr.max_wr = rust.depth();
                if a.attr.srq_limit > 0 {
                    rust.arm_limit(a.attr.srq_limit);
                }
                // SAFETY: plain data.
                let mut srq: ibv_srq = unsafe { std::mem::zeroed() };
                srq.context = p.pd.context;
                srq.srq_context = a.srq_context;
                srq.pd = pd;
                let limit = a.attr.srq_limit;
                let number = rust.number();
                let o = boxed(SrqObj {
                    srq,
                    rust,
                    limit,
                    max_sge,
                });
                // SAFETY: the PD's context is ours.
                if let Some(c) = unsafe { crate::context::ctx_of(p.pd.context) } {
                    c.srqs
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((number, o as usize, 0));
                }
                o.cast()
            }
            Err(e) => {
                set_errno(fail("ibv_create_srq", &e));
                ptr::null_mut()
            }
        }
    })
}

/// `ibv_modify_srq`: arms the limit (`IBV_SRQ_LIMIT`); resizing is not supported.
#[unsafe(export_name = "__shmhca_ibv_modify_srq")]
pub unsafe extern "C" fn ibv_modify_srq(
    srq: *mut ibv_srq,
    attr: *mut ibv_srq_attr,
    mask: c_int,
) -> c_int {
    guard("ibv_modify_srq", libc::EIO, || {
        // SAFETY: ours or null; the caller's attributes.
        let (Some(s), Some(a)) = (unsafe { obj::<_, SrqObj>(srq) }, unsafe { attr.as_ref() })
        else {
            return libc::EINVAL;
        };
        let mask = mask as u32;
        if mask & IBV_SRQ_MAX_WR != 0 {
            return unsupported(
                "resizing a shared receive queue",
                "ibv_modify_srq",
                libc::EOPNOTSUPP,
            );
        }
        if mask & IBV_SRQ_LIMIT != 0 {
            s.rust.arm_limit(a.srq_limit);
            s.limit = a.srq_limit;
        }
        0
    })
}

/// `ibv_query_srq`.
#[unsafe(export_name = "__shmhca_ibv_query_srq")]
pub unsafe extern "C" fn ibv_query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    guard("ibv_query_srq", libc::EIO, || {
        // SAFETY: ours or null; the caller's attributes.
        let (Some(s), Some(a)) = (unsafe { obj::<_, SrqObj>(srq) }, unsafe { attr.as_mut() })
        else {
            return libc::EINVAL;
        };
        a.max_wr = s.rust.depth();
        a.max_sge = s.max_sge;
        a.srq_limit = if s.rust.limit_reached() { 0 } else { s.limit };
        0
    })
}

/// `ibv_destroy_srq`: EBUSY while QPs use it.
#[unsafe(export_name = "__shmhca_ibv_destroy_srq")]
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    guard("ibv_destroy_srq", libc::EIO, || {
        if srq.is_null() {
            return libc::EINVAL;
        }
        let p = srq.cast::<SrqObj>();
        // SAFETY: an SrqObj of ours, given up by the caller: moved out here, and either its
        // memory freed below or the object written back to the same place.
        let o = unsafe { ptr::read(p) };
        let SrqObj {
            srq: c,
            rust,
            limit,
            max_sge,
        } = o;
        let context = c.context;
        match rust.destroy() {
            Ok(()) => {
                // SAFETY: the SRQ's context is ours and outlives it.
                let reported = unsafe { crate::context::ctx_of(context) }
                    .map_or(0, |ctx| crate::context::unlink(&ctx.srqs, p as usize));
                // SAFETY: the SRQ's C part is still in place (only its Rust queue was moved
                // out): its mutex, condition and count are live until freed below.
                unsafe {
                    crate::context::wait_for_acks(
                        (&raw mut (*srq).mutex).cast(),
                        (&raw mut (*srq).cond).cast(),
                        &raw const (*srq).events_completed,
                        reported,
                    );
                }
                // SAFETY: the allocation Box::into_raw made; its value was moved out above.
                drop(unsafe { Box::from_raw(p.cast::<std::mem::MaybeUninit<SrqObj>>()) });
                0
            }
            Err(refused) => {
                let e = fail("ibv_destroy_srq", refused.error());
                // Still in use: the object stays where it was for the program to retry.
                // SAFETY: the place the object was read from, still allocated.
                unsafe {
                    p.write(SrqObj {
                        srq: c,
                        rust: refused.into_value(),
                        limit,
                        max_sge,
                    })
                };
                e
            }
        }
    })
}

/// A memory window.
#[repr(C)]
pub struct MwObj {
    /// What C sees.
    pub mw: ibv_mw,
    /// The Rust window.
    pub rust: Mw,
}

/// `ibv_alloc_mw` (through `ibv_context_ops`): types 1 and 2.
pub unsafe extern "C" fn alloc_mw(pd: *mut ibv_pd, ty: ibv_mw_type) -> *mut ibv_mw {
    guard("ibv_alloc_mw", ptr::null_mut(), || {
        // SAFETY: a PdObj of ours or null.
        let Some(p) = (unsafe { obj::<_, PdObj>(pd) }) else {
            set_errno(libc::EINVAL);
            return ptr::null_mut();
        };
        let kind = match ty {
            IBV_MW_TYPE_1 => MwType::One,
            IBV_MW_TYPE_2 => MwType::Two,
            _ => {
                set_errno(libc::EINVAL);
                return ptr::null_mut();
            }
        };
        match p.rust.alloc_mw(kind) {
            Ok(rust) => boxed(MwObj {
                mw: ibv_mw {
                    context: p.pd.context,
                    pd,
                    rkey: rust.rkey(),
                    handle: 0,
                    type_: ty,
                },
                rust,
            })
            .cast(),
            Err(e) => {
                set_errno(fail("ibv_alloc_mw", &e));
                ptr::null_mut()
            }
        }
    })
}

/// `ibv_dealloc_mw` (through `ibv_context_ops`).
pub unsafe extern "C" fn dealloc_mw(mw: *mut ibv_mw) -> c_int {
    guard("ibv_dealloc_mw", libc::EIO, || {
        if mw.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: an MwObj of ours, given up by the caller.
        drop(unsafe { Box::from_raw(mw.cast::<MwObj>()) });
        0
    })
}
