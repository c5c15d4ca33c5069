//! The device (`shmhca0`), contexts, and the queries (`ibv_query_device`, `_port`, `_gid`,
//! `_pkey`).

use std::ffi::{c_char, c_int};
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr;
use std::sync::OnceLock;

use crate::ffi::*;
use crate::mrkeys::MrKeys;
use crate::util::{errno_of, guard, set_errno};

/// The device's name.
pub const DEVICE_NAME: &str = "shmhca0";
/// Vendor id of the device (none is registered: 0).
const VENDOR_ID: u32 = 0;

/// The one device, made on first use and never freed (as libibverbs' device list).
#[repr(C)]
pub struct DevObj {
    /// What C sees.
    pub dev: ibv_device,
}

// SAFETY: the device is written once, before it is shared, and only read afterwards.
unsafe impl Sync for DevObj {}
// SAFETY: as above.
unsafe impl Send for DevObj {}

fn fill_name(dst: &mut [c_char], s: &str) {
    for (d, b) in dst.iter_mut().zip(s.bytes().chain(std::iter::once(0))) {
        *d = b as c_char;
    }
}

/// The device.
pub fn device() -> &'static DevObj {
    static DEV: OnceLock<Box<DevObj>> = OnceLock::new();
    DEV.get_or_init(|| {
        // SAFETY: ibv_device is plain data (integers, arrays, optional function pointers):
        // all zeroes is a valid value.
        let mut dev: ibv_device = unsafe { std::mem::zeroed() };
        dev.node_type = IBV_NODE_CA;
        dev.transport_type = IBV_TRANSPORT_IB;
        fill_name(&mut dev.name, DEVICE_NAME);
        fill_name(&mut dev.dev_name, "uverbs-shmhca0");
        fill_name(&mut dev.dev_path, "/dev/shm");
        fill_name(&mut dev.ibdev_path, "/dev/shm");
        Box::new(DevObj { dev })
    })
}

fn device_ptr() -> *mut ibv_device {
    (&device().dev as *const ibv_device).cast_mut()
}

/// A device context: C's `ibv_context` (inside the `verbs_context`, the first field), then
/// the Rust context and what the verbs need at hand.
#[repr(C)]
pub struct CtxObj {
    /// What C sees; `&vctx.context` is the `ibv_context *` handed out.
    pub vctx: verbs_context,
    /// The engine.
    pub ctx: shmhca::Context,
    /// L_Key -> region, for the hot path.
    pub mrs: MrKeys,
    /// The async event fd (`ibv_context.async_fd`): a duplicate of the engine's async
    /// eventfd (`Context::async_event_fd`), readable exactly while async events are
    /// queued; made blocking, as rdma-core's is, until the program sets `O_NONBLOCK`.
    async_fd: OwnedFd,
    /// The QPs of this context by QPN (for messages and async events; not the hot path).
    pub qps: std::sync::Mutex<Vec<(u32, usize, u32)>>,
    /// The SRQs of this context by number (`Srq::number`; for async events).
    pub srqs: std::sync::Mutex<Vec<(u32, usize, u32)>>,
    /// The port's LID.
    pub lid: u16,
    /// The port's GID (InfiniBand port).
    pub gid: [u8; 16],
    /// The RoCEv2 port, when `SHMHCA_VERBS_LINK=roce` made port 1 an Ethernet one
    /// ([`crate::roce`]); `None`: the InfiniBand port.
    pub roce: Option<crate::roce::RocePort>,
}

/// The `CtxObj` of an `ibv_context *` this library handed out, or `None` for null.
///
/// # Safety
/// `c` is null or a context from `ibv_open_device`, not closed.
#[inline(always)]
pub unsafe fn ctx_of<'a>(c: *mut ibv_context) -> Option<&'a CtxObj> {
    if c.is_null() {
        return None;
    }
    let off = std::mem::offset_of!(CtxObj, vctx) + std::mem::offset_of!(verbs_context, context);
    // SAFETY: the caller's promise: `c` is the `vctx.context` of a live CtxObj.
    Some(unsafe { &*crate::util::container::<_, CtxObj>(c, off) })
}

/// The node GUID of a port with GID `gid`: the GID's interface ID.
fn guid_of(gid: &[u8; 16]) -> u64 {
    u64::from_be_bytes(gid[8..].try_into().unwrap_or([0; 8]))
}

fn build_context() -> Result<Box<CtxObj>, i32> {
    let ctx = shmhca::Context::builder()
        .mode(crate::progress::engine_mode())
        .idle(crate::progress::idle_policy())
        .huge_pages(crate::progress::huge_pages())
        .build()
        .map_err(|e| crate::util::fail("ibv_open_device", &e))?;
    let async_fd: OwnedFd = ctx
        .async_event_fd()
        .try_clone_to_owned()
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
    // rdma-core's async_fd blocks until the program sets O_NONBLOCK, which
    // `ibv_get_async_event` checks. (The flag is the open file's, shared with the engine's
    // fd: the engine reads it only while an event is queued, so never blocks.)
    let fd = async_fd.as_raw_fd();
    // SAFETY: fcntl(2) on an fd we own.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    let set = unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) };
    if flags < 0 || set < 0 {
        return Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO));
    }
    let addr = ctx
        .join_fabric()
        .map_err(|e| crate::util::fail("ibv_open_device (joining the fabric)", &e))?;
    let (lid, gid) = (addr.lid, addr.gid);
    let roce = if crate::roce::enabled() {
        Some(
            crate::roce::RocePort::new()
                .map_err(|e| crate::util::fail("ibv_open_device (reading the GID table)", &e))?,
        )
    } else {
        None
    };
    // SAFETY: verbs_context is plain data (integers, pointers, optional function
    // pointers, a pthread mutex whose all-zero value is PTHREAD_MUTEX_INITIALIZER on glibc).
    let vctx: verbs_context = unsafe { std::mem::zeroed() };
    let mut obj = Box::new(CtxObj {
        vctx,
        ctx,
        mrs: MrKeys::new(),
        qps: std::sync::Mutex::new(Vec::new()),
        srqs: std::sync::Mutex::new(Vec::new()),
        async_fd,
        lid,
        gid,
        roce,
    });
    let v = &mut obj.vctx;
    v.sz = std::mem::size_of::<verbs_context>();
    v.query_port = Some(crate::context::query_port_ex);
    v.create_qp_ex = Some(crate::qp::create_qp_ex);
    v.create_cq_ex = None;
    v.query_device_ex = Some(crate::context::query_device_ex);
    v.context.device = device_ptr();
    v.context.cmd_fd = -1;
    v.context.async_fd = obj.async_fd.as_raw_fd();
    v.context.num_comp_vectors = 1;
    v.context.abi_compat = VERBS_ABI_IS_EXTENDED;
    let ops = &mut v.context.ops;
    ops.post_send = Some(crate::post::post_send);
    ops.post_recv = Some(crate::post::post_recv);
    ops.poll_cq = Some(crate::post::poll_cq);
    ops.req_notify_cq = Some(crate::post::req_notify_cq);
    ops.post_srq_recv = Some(crate::post::post_srq_recv);
    ops.alloc_mw = Some(crate::objects::alloc_mw);
    ops.dealloc_mw = Some(crate::objects::dealloc_mw);
    ops.bind_mw = Some(crate::post::bind_mw);
    Ok(obj)
}

/// `ibv_get_device_list`: one device, `shmhca0`.
#[unsafe(export_name = "__shmhca_ibv_get_device_list")]
pub unsafe extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    guard("ibv_get_device_list", ptr::null_mut(), || {
        // SAFETY: malloc of two pointers; checked for null below.
        let list = unsafe { libc::malloc(2 * std::mem::size_of::<*mut ibv_device>()) }
            .cast::<*mut ibv_device>();
        if list.is_null() {
            set_errno(libc::ENOMEM);
            return ptr::null_mut();
        }
        // SAFETY: `list` holds two pointers.
        unsafe {
            list.write(device_ptr());
            list.add(1).write(ptr::null_mut());
        }
        if !num.is_null() {
            // SAFETY: the caller passes a valid int pointer or null.
            unsafe { num.write(1) };
        }
        list
    })
}

/// `ibv_free_device_list`.
#[unsafe(export_name = "__shmhca_ibv_free_device_list")]
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    guard("ibv_free_device_list", (), || {
        // SAFETY: `list` came from ibv_get_device_list's malloc (or is null).
        unsafe { libc::free(list.cast()) }
    })
}

/// `ibv_get_device_name`.
#[unsafe(export_name = "__shmhca_ibv_get_device_name")]
pub unsafe extern "C" fn ibv_get_device_name(dev: *mut ibv_device) -> *const c_char {
    guard("ibv_get_device_name", ptr::null(), || {
        if dev.is_null() {
            set_errno(libc::EINVAL);
            return ptr::null();
        }
        // SAFETY: a device pointer from our list; its name is NUL-terminated.
        unsafe { (*dev).name.as_ptr() }
    })
}

/// `ibv_get_device_guid` (network byte order).
#[unsafe(export_name = "__shmhca_ibv_get_device_guid")]
pub unsafe extern "C" fn ibv_get_device_guid(_dev: *mut ibv_device) -> u64 {
    // The device is one for all contexts; each context's port has its own GID (and node
    // GUID, in ibv_query_device): the device's GUID is the fabric's GID prefix's tag.
    guard("ibv_get_device_guid", 0, || {
        guid_of(&shmhca::fabric::gid_of_lid(0)).to_be()
    })
}

/// `ibv_get_device_index`: 0.
#[unsafe(export_name = "__shmhca_ibv_get_device_index")]
pub unsafe extern "C" fn ibv_get_device_index(dev: *mut ibv_device) -> c_int {
    if dev.is_null() { -1 } else { 0 }
}

/// `ibv_open_device`: a new engine (context) over shmhca.
#[unsafe(export_name = "__shmhca_ibv_open_device")]
pub unsafe extern "C" fn ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context {
    guard("ibv_open_device", ptr::null_mut(), || {
        if dev != device_ptr() {
            set_errno(libc::ENODEV);
            return ptr::null_mut();
        }
        match build_context() {
            Ok(obj) => {
                let obj = Box::into_raw(obj);
                // SAFETY: just allocated; the context is handed out by its address.
                unsafe { &raw mut (*obj).vctx.context }
            }
            Err(e) => {
                set_errno(e);
                ptr::null_mut()
            }
        }
    })
}

/// `ibv_close_device`.
#[unsafe(export_name = "__shmhca_ibv_close_device")]
pub unsafe extern "C" fn ibv_close_device(context: *mut ibv_context) -> c_int {
    guard("ibv_close_device", -1, || {
        // SAFETY: a context of ours (or null).
        let Some(c) = (unsafe { ctx_of(context) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        // SAFETY: the CtxObj was Box::into_raw'd by ibv_open_device; the caller gives it up.
        drop(unsafe { Box::from_raw((c as *const CtxObj).cast_mut()) });
        0
    })
}

fn fill_device_attr(c: &CtxObj, a: &mut ibv_device_attr) {
    let d = c.ctx.query_device();
    // SAFETY: plain data; all zeroes is valid.
    *a = unsafe { std::mem::zeroed() };
    fill_name(&mut a.fw_ver, env!("CARGO_PKG_VERSION"));
    a.node_guid = guid_of(&c.gid).to_be();
    a.sys_image_guid = a.node_guid;
    a.max_mr_size = d.max_mr_size;
    a.page_size_cap = 4096;
    a.vendor_id = VENDOR_ID;
    a.vendor_part_id = 0;
    a.hw_ver = 0;
    let int = |v: u64| c_int::try_from(v).unwrap_or(c_int::MAX);
    a.max_qp = int(d.max_qp.into());
    a.max_qp_wr = int(d.max_qp_wr.into());
    a.device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN
        | IBV_DEVICE_PORT_ACTIVE_EVENT
        | IBV_DEVICE_MEM_WINDOW
        | IBV_DEVICE_MEM_WINDOW_TYPE_2B;
    a.max_sge = int(d.max_sge.into());
    a.max_sge_rd = int(d.max_sge.into());
    a.max_cq = int(d.max_cq.into());
    a.max_cqe = int(d.max_cqe.into());
    a.max_mr = int(d.max_mr.into());
    a.max_pd = int(d.max_pd.into());
    a.max_qp_rd_atom = d.max_qp_rd_atom.into();
    a.max_res_rd_atom = c_int::from(d.max_qp_rd_atom) * a.max_qp;
    a.max_qp_init_rd_atom = d.max_qp_init_rd_atom.into();
    a.atomic_cap = IBV_ATOMIC_GLOB;
    a.max_mw = int(d.max_mw.into());
    a.max_srq = int(d.max_srq.into());
    a.max_srq_wr = int(d.max_qp_wr.into());
    a.max_srq_sge = int(d.max_sge.into());
    a.max_pkeys = 1;
    a.local_ca_ack_delay = 0;
    a.phys_port_cnt = 1;
}

/// `ibv_query_device`: the engine's limits ([`shmhca::Context::query_device`]).
#[unsafe(export_name = "__shmhca_ibv_query_device")]
pub unsafe extern "C" fn ibv_query_device(
    context: *mut ibv_context,
    attr: *mut ibv_device_attr,
) -> c_int {
    guard("ibv_query_device", libc::EIO, || {
        // SAFETY: a context of ours (or null).
        let Some(c) = (unsafe { ctx_of(context) }) else {
            return libc::EINVAL;
        };
        if attr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: the caller's attribute struct.
        fill_device_attr(c, unsafe { &mut *attr });
        0
    })
}

/// `verbs_context.query_device_ex`: the same limits in the extended struct (its extended
/// fields zero: no ODP, TSO, RSS, tag matching or timestamps).
pub unsafe extern "C" fn query_device_ex(
    context: *mut ibv_context,
    _input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    size: usize,
) -> c_int {
    guard("ibv_query_device_ex", libc::EIO, || {
        // SAFETY: a context of ours (or null).
        let Some(c) = (unsafe { ctx_of(context) }) else {
            return libc::EINVAL;
        };
        if attr.is_null() || size < std::mem::size_of::<ibv_device_attr>() {
            return libc::EINVAL;
        }
        // SAFETY: plain data, all zeroes valid.
        let mut ex: ibv_device_attr_ex = unsafe { std::mem::zeroed() };
        fill_device_attr(c, &mut ex.orig_attr);
        let n = size.min(std::mem::size_of::<ibv_device_attr_ex>());
        // SAFETY: the caller's struct holds `size` bytes; we copy at most that many.
        unsafe { ptr::copy_nonoverlapping((&raw const ex).cast::<u8>(), attr.cast::<u8>(), n) };
        0
    })
}

fn port_attr(c: &CtxObj) -> ibv_port_attr {
    // SAFETY: plain data, all zeroes valid.
    let mut p: ibv_port_attr = unsafe { std::mem::zeroed() };
    p.state = IBV_PORT_ACTIVE;
    p.max_mtu = IBV_MTU_4096;
    p.active_mtu = IBV_MTU_4096;
    p.gid_tbl_len = 1;
    p.port_cap_flags = 0;
    p.max_msg_sz = u32::try_from(shmhca::qp::MAX_MESSAGE).unwrap_or(u32::MAX);
    p.pkey_tbl_len = 1;
    p.lid = c.lid;
    p.sm_lid = shmhca::fabric::MIN_LID;
    p.lmc = 0;
    p.max_vl_num = 1;
    p.active_width = 2; // 4X
    p.active_speed = 32; // EDR
    p.phys_state = 5; // LinkUp
    p.link_layer = IBV_LINK_LAYER_INFINIBAND as u8;
    if let Some(roce) = &c.roce {
        // An Ethernet port: no LID, no subnet manager; its GIDs are the host's addresses.
        p.link_layer = IBV_LINK_LAYER_ETHERNET as u8;
        p.lid = 0;
        p.sm_lid = 0;
        p.active_mtu = crate::qp::mtu_to_c(roce.active_mtu());
        p.gid_tbl_len = c_int::try_from(roce.table.len()).unwrap_or(c_int::MAX);
        p.port_cap_flags = IBV_PORT_IP_BASED_GIDS;
    }
    p
}

/// `ibv_query_port` (the compatibility entry point; verbs.h's inline calls
/// [`query_port_ex`] through the `verbs_context`).
#[unsafe(export_name = "__shmhca_ibv_query_port")]
pub unsafe extern "C" fn ibv_query_port(
    context: *mut ibv_context,
    port_num: u8,
    attr: *mut _compat_ibv_port_attr,
) -> c_int {
    // rdma-core's `_compat_ibv_port_attr` is `ibv_port_attr` as it was before
    // `port_cap_flags2` was added (verbs.h declares it opaque, so bindgen gives it size 0):
    // the fields up to and including `flags`. Writing only those fits a caller of any age.
    const COMPAT_LEN: usize = std::mem::offset_of!(ibv_port_attr, port_cap_flags2);
    // SAFETY: forwarded as is; the compat struct is a prefix of ibv_port_attr, COMPAT_LEN
    // bytes long.
    unsafe { query_port_ex(context, port_num, attr.cast(), COMPAT_LEN) }
}

/// `verbs_context.query_port`: port 1, ACTIVE; InfiniBand, MTU 4096, or with
/// `SHMHCA_VERBS_LINK=roce` Ethernet, the host's GIDs (see [`crate::roce`]).
pub unsafe extern "C" fn query_port_ex(
    context: *mut ibv_context,
    port_num: u8,
    attr: *mut ibv_port_attr,
    size: usize,
) -> c_int {
    guard("ibv_query_port", libc::EIO, || {
        // SAFETY: a context of ours (or null).
        let Some(c) = (unsafe { ctx_of(context) }) else {
            return libc::EINVAL;
        };
        if attr.is_null() || port_num != 1 {
            return libc::EINVAL;
        }
        let p = port_attr(c);
        let n = size.min(std::mem::size_of::<ibv_port_attr>());
        // SAFETY: the caller's struct holds `size` bytes; we copy at most that many.
        unsafe { ptr::copy_nonoverlapping((&raw const p).cast::<u8>(), attr.cast::<u8>(), n) };
        0
    })
}

/// `ibv_query_gid`: index 0 only (InfiniBand), or the host's GID table (RoCEv2).
#[unsafe(export_name = "__shmhca_ibv_query_gid")]
pub unsafe extern "C" fn ibv_query_gid(
    context: *mut ibv_context,
    port_num: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    guard("ibv_query_gid", -1, || {
        // SAFETY: a context of ours (or null).
        let Some(c) = (unsafe { ctx_of(context) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if gid.is_null() || port_num != 1 {
            set_errno(libc::EINVAL);
            return -1;
        }
        let raw = match &c.roce {
            Some(roce) => match usize::try_from(index).ok().and_then(|i| roce.table.get(i)) {
                Some(e) => e.gid.octets(),
                None => {
                    set_errno(libc::EINVAL);
                    return -1;
                }
            },
            None if index == 0 => c.gid,
            None => {
                set_errno(libc::EINVAL);
                return -1;
            }
        };
        // SAFETY: the caller's gid.
        unsafe { (*gid).raw = raw };
        0
    })
}

/// `_ibv_query_gid_ex` (behind verbs.h's `ibv_query_gid_ex`).
#[unsafe(export_name = "__shmhca__ibv_query_gid_ex")]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    context: *mut ibv_context,
    port_num: u32,
    gid_index: u32,
    entry: *mut ibv_gid_entry,
    _flags: u32,
    entry_size: usize,
) -> c_int {
    guard("ibv_query_gid_ex", libc::EIO, || {
        // SAFETY: a context of ours (or null).
        let Some(c) = (unsafe { ctx_of(context) }) else {
            return libc::EINVAL;
        };
        if entry.is_null() || port_num != 1 || entry_size < std::mem::size_of::<ibv_gid_entry>() {
            return libc::EINVAL;
        }
        let e = match &c.roce {
            Some(roce) => match roce.entry(gid_index) {
                Some(e) => e,
                None => return libc::EINVAL,
            },
            None => {
                if gid_index != 0 {
                    return libc::ENODATA;
                }
                // SAFETY: plain data.
                let mut e: ibv_gid_entry = unsafe { std::mem::zeroed() };
                e.gid.raw = c.gid;
                e.gid_index = 0;
                e.port_num = 1;
                e.gid_type = IBV_GID_TYPE_IB;
                e.ndev_ifindex = 0;
                e
            }
        };
        // SAFETY: the caller's entry, `entry_size` (at least an entry) bytes; unaligned: a
        // C caller's array of `entry_size` bytes apart (libibverbs copies each entry with
        // memcpy) need not keep the 8-byte alignment of `union ibv_gid` past its first.
        unsafe { entry.write_unaligned(e) };
        0
    })
}

/// `_ibv_query_gid_table`: the one GID (InfiniBand), or the host's GID table (RoCEv2),
/// `entry_size` bytes apart; the number of entries written, or minus an errno.
#[unsafe(export_name = "__shmhca__ibv_query_gid_table")]
pub unsafe extern "C" fn _ibv_query_gid_table(
    context: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    guard("ibv_query_gid_table", -(libc::EIO as isize), || {
        // SAFETY: a context of ours (or null).
        let Some(c) = (unsafe { ctx_of(context) }) else {
            return -(libc::EINVAL as isize);
        };
        if max_entries == 0
            || entries.is_null()
            || entry_size < std::mem::size_of::<ibv_gid_entry>()
            || max_entries
                .checked_mul(entry_size)
                .is_none_or(|n| n > isize::MAX as usize)
        {
            return -(libc::EINVAL as isize);
        }
        let len = c.roce.as_ref().map_or(1, |r| r.table.len());
        if len > max_entries {
            return -(libc::EINVAL as isize);
        }
        for i in 0..len {
            // SAFETY: the caller's array holds `max_entries` entries of `entry_size` bytes
            // (at least an `ibv_gid_entry` each, and their total fits an isize: checked
            // above), and `i < len <= max_entries`.
            let at = unsafe { entries.cast::<u8>().add(i * entry_size) }.cast::<ibv_gid_entry>();
            // SAFETY: forwarded; `at` is one of the caller's entries.
            let r = unsafe { _ibv_query_gid_ex(context, 1, i as u32, at, flags, entry_size) };
            if r != 0 {
                return -(r as isize);
            }
        }
        len as isize
    })
}

/// `ibv_query_gid_type` (private ABI; ibv_devinfo uses it): InfiniBand's GID type
/// (`IBV_GID_TYPE_SYSFS_IB_ROCE_V1`, 0), or on the RoCEv2 port RoCE v2's
/// (`IBV_GID_TYPE_SYSFS_ROCE_V2`, 1).
#[unsafe(export_name = "__shmhca_ibv_query_gid_type")]
pub unsafe extern "C" fn ibv_query_gid_type(
    context: *mut ibv_context,
    port_num: u8,
    index: u32,
    ty: *mut c_int,
) -> c_int {
    guard("ibv_query_gid_type", -1, || {
        // SAFETY: a context of ours (or null).
        let Some(c) = (unsafe { ctx_of(context) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        let len = c.roce.as_ref().map_or(1, |r| r.table.len());
        if ty.is_null() || port_num != 1 || index as usize >= len {
            set_errno(libc::EINVAL);
            return -1;
        }
        let sysfs_type = c_int::from(c.roce.is_some());
        // SAFETY: the caller's int.
        unsafe { ty.write(sysfs_type) };
        0
    })
}

/// `ibv_query_pkey`: the default P_Key at index 0.
#[unsafe(export_name = "__shmhca_ibv_query_pkey")]
pub unsafe extern "C" fn ibv_query_pkey(
    context: *mut ibv_context,
    port_num: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    // SAFETY: a context of ours (or null).
    if unsafe { ctx_of(context) }.is_none() || pkey.is_null() || port_num != 1 || index != 0 {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller's u16.
    unsafe { pkey.write(0xffffu16.to_be()) };
    0
}

/// `ibv_get_pkey_index`.
#[unsafe(export_name = "__shmhca_ibv_get_pkey_index")]
pub unsafe extern "C" fn ibv_get_pkey_index(
    context: *mut ibv_context,
    port_num: u8,
    pkey: u16,
) -> c_int {
    // SAFETY: a context of ours (or null).
    if unsafe { ctx_of(context) }.is_none()
        || port_num != 1
        || u16::from_be(pkey) & 0x7fff != 0x7fff
    {
        set_errno(libc::EINVAL);
        return -1;
    }
    0
}

/// `ibv_get_async_event`: the next async event of the context (QP fatal, communication
/// established, SRQ limit reached, last WQE reached), its element the QP or SRQ object.
/// Blocks until one is queued, unless the program set `O_NONBLOCK` on `async_fd`: then -1
/// with errno `EAGAIN` when none is, as rdma-core's `read()` gives; a signal that
/// interrupts the wait (poll mode) gives -1 with `EINTR`. An event of an object destroyed
/// since is skipped.
#[unsafe(export_name = "__shmhca_ibv_get_async_event")]
pub unsafe extern "C" fn ibv_get_async_event(
    context: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    guard("ibv_get_async_event", -1, || {
        // SAFETY: a context of ours (or null).
        let Some(c) = (unsafe { ctx_of(context) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if event.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: fcntl(2) on the context's own fd.
        let flags = unsafe { libc::fcntl(c.async_fd.as_raw_fd(), libc::F_GETFL) };
        let nonblock = flags >= 0 && flags & libc::O_NONBLOCK != 0;
        loop {
            let ev = if nonblock {
                c.ctx.try_get_async_event()
            } else if c.ctx.mode() != shmhca::EngineMode::Inline {
                // The engine thread raises the events: wait on the fd itself, as rdma-core's
                // read() does, so that a signal ends the wait with EINTR.
                match c.ctx.try_get_async_event() {
                    Some(ev) => Some(ev),
                    None => {
                        let mut p = libc::pollfd {
                            fd: c.async_fd.as_raw_fd(),
                            events: libc::POLLIN,
                            revents: 0,
                        };
                        // SAFETY: one pollfd of ours, for the call.
                        if unsafe { libc::poll(&mut p, 1, -1) } < 0 {
                            let e = std::io::Error::last_os_error().raw_os_error();
                            if e == Some(libc::EINTR) {
                                set_errno(libc::EINTR);
                                return -1;
                            }
                        }
                        continue;
                    }
                }
            } else {
                match c.ctx.get_async_event(None) {
                    Ok(ev) => ev,
                    Err(e) => {
                        set_errno(crate::util::fail("ibv_get_async_event", &e));
                        return -1;
                    }
                }
            };
            let Some(ev) = ev else {
                if nonblock {
                    set_errno(libc::EAGAIN);
                    return -1;
                }
                continue;
            };
            let Some(filled) = c_event(c, ev) else {
                continue; // its object is gone
            };
            // SAFETY: the caller's event structure (checked non-null).
            unsafe { event.write(filled) };
            return 0;
        }
    })
}

/// The C form of `ev`, or `None` if its QP or SRQ was destroyed (or the event has no C
/// form).
fn c_event(c: &CtxObj, ev: shmhca::AsyncEvent) -> Option<ibv_async_event> {
    use shmhca::AsyncEvent as E;
    // Counted as reported under the list's lock: a destroy, which unlinks the object
    // under the same lock, then waits until the program has acknowledged as many.
    let find = |list: &std::sync::Mutex<Vec<(u32, usize, u32)>>, n: u32| {
        list.lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter_mut()
            .find(|e| e.0 == n)
            .map(|e| {
                e.2 += 1;
                e.1
            })
    };
    let (event_type, element) = match ev {
        E::QpFatal { qpn } => (IBV_EVENT_QP_FATAL, qpn),
        E::CommEstablished { qpn } => (IBV_EVENT_COMM_EST, qpn),
        E::QpLastWqeReached { qpn } => (IBV_EVENT_QP_LAST_WQE_REACHED, qpn),
        E::SrqLimitReached { srq } => {
            let p = find(&c.srqs, srq)?;
            return Some(ibv_async_event {
                element: ibv_async_event__bindgen_ty_1 {
                    // An SrqObj starts with its ibv_srq.
                    srq: p as *mut ibv_srq,
                },
                event_type: IBV_EVENT_SRQ_LIMIT_REACHED,
            });
        }
        _ => return None,
    };
    let p = find(&c.qps, element.get())?;
    Some(ibv_async_event {
        element: ibv_async_event__bindgen_ty_1 {
            // A QpObj starts with its ibv_qp.
            qp: p as *mut ibv_qp,
        },
        event_type,
    })
}

/// `ibv_ack_async_event`: counts the event in its QP's or SRQ's `events_completed` and
/// signals its `cond`, under its `mutex`, as rdma-core does.
#[unsafe(export_name = "__shmhca_ibv_ack_async_event")]
pub unsafe extern "C" fn ibv_ack_async_event(event: *mut ibv_async_event) {
    guard("ibv_ack_async_event", (), || {
        // SAFETY: the caller's event (or null), filled by ibv_get_async_event.
        let Some(e) = (unsafe { event.as_ref() }) else {
            return;
        };
        // SAFETY: the union's member for the event's type, written by ibv_get_async_event:
        // a pointer to a live object of ours (the program acks before destroying it).
        let (mutex, cond, count) = unsafe {
            match e.event_type {
                IBV_EVENT_QP_FATAL | IBV_EVENT_COMM_EST | IBV_EVENT_QP_LAST_WQE_REACHED => {
                    let qp = e.element.qp;
                    if qp.is_null() {
                        return;
                    }
                    (
                        &raw mut (*qp).mutex,
                        &raw mut (*qp).cond,
                        &raw mut (*qp).events_completed,
                    )
                }
                IBV_EVENT_SRQ_LIMIT_REACHED => {
                    let srq = e.element.srq;
                    if srq.is_null() {
                        return;
                    }
                    (
                        &raw mut (*srq).mutex,
                        &raw mut (*srq).cond,
                        &raw mut (*srq).events_completed,
                    )
                }
                _ => return,
            }
        };
        // SAFETY: the object's pthread mutex and condition (zeroed at creation: their
        // static initializers on glibc); the count is written under the mutex.
        unsafe {
            libc::pthread_mutex_lock(mutex.cast::<libc::pthread_mutex_t>());
            *count = (*count).wrapping_add(1);
            libc::pthread_cond_signal(cond.cast::<libc::pthread_cond_t>());
            libc::pthread_mutex_unlock(mutex.cast::<libc::pthread_mutex_t>());
        }
    })
}

/// Takes the object at `p` out of a context's list (QPs or SRQs); the async events
/// reported for it (0 if it was not listed).
pub(crate) fn unlink(list: &std::sync::Mutex<Vec<(u32, usize, u32)>>, p: usize) -> u32 {
    let mut l = list.lock().unwrap_or_else(|e| e.into_inner());
    let i = l.iter().position(|e| e.1 == p);
    i.map_or(0, |i| l.swap_remove(i).2)
}

/// Waits until the program has acknowledged `reported` async events of an object being
/// destroyed (`completed`, its `events_completed`, counted by [`ibv_ack_async_event`] under
/// the object's `mutex`), as rdma-core's destroy calls do: the program may still hold the
/// object's pointer from an event it has not acknowledged.
///
/// # Safety
/// The pointers are the object's pthread mutex, condition and count, alive during the call.
pub(crate) unsafe fn wait_for_acks(
    mutex: *mut libc::pthread_mutex_t,
    cond: *mut libc::pthread_cond_t,
    completed: *const u32,
    reported: u32,
) {
    if reported == 0 {
        return;
    }
    // SAFETY: the caller's live object; the count is read under its mutex.
    unsafe {
        libc::pthread_mutex_lock(mutex);
        while completed.read() < reported {
            libc::pthread_cond_wait(cond, mutex);
        }
        libc::pthread_mutex_unlock(mutex);
    }
}

/// The errno of an error, for callers that return it.
pub fn errno(e: &shmhca::Error) -> c_int {
    errno_of(e)
}
