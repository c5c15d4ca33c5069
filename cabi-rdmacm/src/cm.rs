//! Event channels, ids and their events: the connection manager itself.
//!
//! An `Id` is a `#[repr(C)]` Rust struct whose first field is the `rdma_cm_id` programs
//! see; a `Channel` likewise starts with its `rdma_event_channel`, whose `fd` is a
//! semaphore eventfd counting the queued events (programs may poll it; `rdma_get_cm_event`
//! blocks on it unless the program made it non-blocking). As with rdma-core's, a thread
//! still blocked in `rdma_get_cm_event` when the channel is destroyed stays blocked (it is
//! not woken with an error the program would report). Events are boxed with their
//! private data, which stays valid until `rdma_ack_cm_event`.
//!
//! A listening id has a thread accepting connections on its rendezvous socket; a
//! connection's id has a thread reading its peer's messages (REP/REJ, RTU, DREQ/DREP). Both
//! stop within 200 ms of `rdma_destroy_id`, which joins them before freeing the id.

use std::collections::VecDeque;
use std::hash::{BuildHasher, RandomState};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::addr::{check_local, from_c, to_storage};
use crate::dev::{self, Connect};
use crate::ffi::*;
use crate::util::{err, guard, say_once, set_errno};
use crate::wire::{self, Frame, Got, Kind, MAX_PRIVATE};

/// IB CM's reject reason for a consumer's `rdma_reject`.
const REJ_CONSUMER: i32 = 28;
/// IB CM's reject reason when nobody listens on the service (port).
const REJ_INVALID_SERVICE: i32 = 8;
/// How often the CM's threads look at their stop flag.
const TICK_MS: i32 = 200;

/// An event channel.
#[repr(C)]
pub(crate) struct Channel {
    c: rdma_event_channel,
    fd: OwnedFd,
    queue: Mutex<VecDeque<usize>>,
}

/// An event with room for its private data.
#[repr(C)]
struct EventBox {
    ev: rdma_cm_event,
    private: [u8; MAX_PRIVATE],
}

/// Where a connection stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Conn {
    /// No connection.
    Idle,
    /// Server side: a REQ waits for accept or reject.
    Requested,
    /// Client side: REQ sent, waiting for the answer.
    Connecting,
    /// Accepted (server: waiting for RTU) or established.
    Up,
    /// Rejected, failed or disconnected.
    Down,
}

/// What an id's threads share with the calls on it.
struct State {
    bound: Option<SocketAddr>,
    peer: Option<SocketAddr>,
    route_resolved: bool,
    listener: Option<(PathBuf, wire::SockIdent)>,
    stream: Option<Arc<UnixStream>>,
    /// The REQ (server side) being answered.
    req: Option<Frame>,
    conn: Conn,
    /// DISCONNECTED was queued.
    disconnected: bool,
    /// DREQ was sent.
    dreq_sent: bool,
}

/// An `rdma_cm_id`.
#[repr(C)]
pub(crate) struct Id {
    c: rdma_cm_id,
    st: Mutex<State>,
    stop: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// A pointer handed to the CM's threads (joined before what it points at is freed).
#[derive(Clone, Copy)]
struct P<T>(*mut T);
// SAFETY: the pointee is Sync (Mutex/atomic state) and outlives the threads (joined first).
unsafe impl<T> Send for P<T> {}

impl Id {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn channel(&self) -> *mut Channel {
        self.c.channel.cast()
    }

    fn spawn(&self, name: &str, f: impl FnOnce() + Send + 'static) -> Result<(), i32> {
        let h = std::thread::Builder::new()
            .name(name.into())
            .spawn(f)
            .map_err(|_| libc::ENOMEM)?;
        self.threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(h);
        Ok(())
    }
}

/// The id behind a C pointer.
///
/// # Safety
/// `id` is null or an id of ours not destroyed.
unsafe fn id_ref<'a>(id: *mut rdma_cm_id) -> Option<&'a Id> {
    if !id.cast::<Id>().is_aligned() {
        say_once(format!(
            "rdma_cm: {id:p} is not an rdma_cm_id (misaligned): EINVAL"
        ));
        return None;
    }
    // SAFETY: the caller's promise; `c` is the first field.
    unsafe { id.cast::<Id>().as_ref() }
}

fn random_psn() -> u32 {
    (RandomState::new().hash_one(std::process::id()) as u32) & 0xFF_FFFF
}

/// Queues an event for `id` on its channel.
fn push(
    id: &Id,
    listen: *mut rdma_cm_id,
    kind: rdma_cm_event_type,
    status: i32,
    frame: Option<&Frame>,
) {
    let chan = id.channel();
    if chan.is_null() {
        return;
    }
    // SAFETY: all-zero is a valid event.
    let mut b: Box<EventBox> = Box::new(unsafe { std::mem::zeroed() });
    b.ev.id = ptr::from_ref(&id.c).cast_mut();
    b.ev.listen_id = listen;
    b.ev.event = kind;
    b.ev.status = status;
    if let Some(f) = frame {
        let n = f.private.len().min(MAX_PRIVATE);
        b.private[..n].copy_from_slice(&f.private[..n]);
        let pd = b.private.as_ptr().cast::<libc::c_void>();
        // SAFETY: writing the `conn` member of the union.
        let c = unsafe { &mut b.ev.param.conn };
        c.private_data = if n > 0 { pd } else { ptr::null() };
        c.private_data_len = n as u8;
        // The peer's resources, from this side's point of view.
        c.responder_resources = f.initiator_depth;
        c.initiator_depth = f.responder_resources;
        c.flow_control = 1;
        c.retry_count = 7;
        c.rnr_retry_count = 7;
        c.qp_num = f.qpn;
    }
    let raw = Box::into_raw(b) as usize;
    // SAFETY: the id's channel outlives it (rdma_cm's contract).
    let ch = unsafe { &*chan };
    ch.queue
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push_back(raw);
    let one = 1u64;
    // SAFETY: adding 1 to our eventfd's counter (8 bytes).
    let _ = unsafe { libc::write(ch.fd.as_raw_fd(), ptr::from_ref(&one).cast(), 8) };
}

fn set_src(id: *mut Id, a: SocketAddr) {
    let st = to_storage(a);
    // SAFETY: the id is ours; the union's storage member is a sockaddr_storage's size.
    unsafe {
        ptr::copy_nonoverlapping(
            ptr::from_ref(&st).cast::<u8>(),
            ptr::addr_of_mut!((*id).c.route.addr.__bindgen_anon_1).cast::<u8>(),
            size_of::<libc::sockaddr_storage>(),
        );
    }
}

fn set_dst(id: *mut Id, a: SocketAddr) {
    let st = to_storage(a);
    // SAFETY: as in set_src.
    unsafe {
        ptr::copy_nonoverlapping(
            ptr::from_ref(&st).cast::<u8>(),
            ptr::addr_of_mut!((*id).c.route.addr.__bindgen_anon_2).cast::<u8>(),
            size_of::<libc::sockaddr_storage>(),
        );
    }
}

/// A fresh id on `channel`.
fn new_id(channel: *mut rdma_event_channel, context: *mut libc::c_void) -> *mut Id {
    // SAFETY: all-zero is a valid rdma_cm_id.
    let mut c: rdma_cm_id = unsafe { std::mem::zeroed() };
    c.channel = channel;
    c.context = context;
    c.ps = RDMA_PS_TCP;
    c.qp_type = IBV_QPT_RC;
    Box::into_raw(Box::new(Id {
        c,
        st: Mutex::new(State {
            bound: None,
            peer: None,
            route_resolved: false,
            listener: None,
            stream: None,
            req: None,
            conn: Conn::Idle,
            disconnected: false,
            dreq_sent: false,
        }),
        stop: AtomicBool::new(false),
        threads: Mutex::new(Vec::new()),
    }))
}

/// Attaches the device to an id (`verbs`, port 1).
fn attach_dev(id: *mut Id) -> Result<(), i32> {
    let d = dev::dev()?;
    // SAFETY: the id is ours.
    unsafe {
        (*id).c.verbs = d.ctx;
        (*id).c.port_num = 1;
    }
    Ok(())
}

static NEXT_PORT: AtomicU16 = AtomicU16::new(0);

/// An ephemeral port (the kernel's range), different for each call of this process.
fn ephemeral() -> u16 {
    let start = (RandomState::new().hash_one(std::process::id()) % 28_000) as u16;
    let n = NEXT_PORT.fetch_add(1, Ordering::Relaxed);
    32_768 + (start.wrapping_add(n) % 28_000)
}

// ---------------------------------------------------------------- event channels

/// `rdma_create_event_channel`.
#[unsafe(export_name = "__shmhca_rdma_create_event_channel")]
pub extern "C" fn rdma_create_event_channel() -> *mut rdma_event_channel {
    guard("rdma_create_event_channel", ptr::null_mut(), || {
        // The device is opened here, as rdma-core's librdmacm initialises itself at the
        // first channel: a server's later rdma_listen is then quick (perftest -R connects
        // right after its own handshake; opening shmhca's device takes a while in a debug
        // build). A failure is reported again where the device is needed.
        let _ = dev::dev();
        // SAFETY: plain eventfd(2) call.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
        if raw < 0 {
            return ptr::null_mut();
        }
        // SAFETY: the fd eventfd just made, owned from here.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Box::into_raw(Box::new(Channel {
            c: rdma_event_channel { fd: raw },
            fd,
            queue: Mutex::new(VecDeque::new()),
        }))
        .cast()
    })
}

/// `rdma_destroy_event_channel`: frees the channel and any events still queued.
#[unsafe(export_name = "__shmhca_rdma_destroy_event_channel")]
pub unsafe extern "C" fn rdma_destroy_event_channel(channel: *mut rdma_event_channel) {
    guard("rdma_destroy_event_channel", (), || {
        if channel.is_null() {
            return;
        }
        // SAFETY: a channel of ours (the caller's promise), freed once.
        let ch = unsafe { Box::from_raw(channel.cast::<Channel>()) };
        for e in ch.queue.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            // SAFETY: an event pushed and never handed out.
            drop(unsafe { Box::from_raw(e as *mut EventBox) });
        }
    })
}

/// `rdma_get_cm_event`: the next event (blocks unless the channel's fd is non-blocking:
/// then EAGAIN).
#[unsafe(export_name = "__shmhca_rdma_get_cm_event")]
pub unsafe extern "C" fn rdma_get_cm_event(
    channel: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
) -> libc::c_int {
    guard("rdma_get_cm_event", -1, || {
        if channel.is_null() || event.is_null() {
            return err(libc::EINVAL);
        }
        // SAFETY: a channel of ours.
        let ch = unsafe { &*channel.cast::<Channel>() };
        loop {
            let mut b = 0u64;
            // SAFETY: reading the eventfd's 8 bytes into `b` (a semaphore: takes 1).
            let n = unsafe { libc::read(ch.fd.as_raw_fd(), ptr::from_mut(&mut b).cast(), 8) };
            if n != 8 {
                return -1; // errno from read (EAGAIN, EINTR)
            }
            let e = ch
                .queue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front();
            if let Some(e) = e {
                // SAFETY: the caller's out pointer.
                unsafe { *event = e as *mut rdma_cm_event };
                return 0;
            }
        }
    })
}

/// `rdma_ack_cm_event`: frees an event.
#[unsafe(export_name = "__shmhca_rdma_ack_cm_event")]
pub unsafe extern "C" fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> libc::c_int {
    guard("rdma_ack_cm_event", -1, || {
        if event.is_null() {
            return err(libc::EINVAL);
        }
        // SAFETY: an event rdma_get_cm_event handed out, acked once.
        drop(unsafe { Box::from_raw(event.cast::<EventBox>()) });
        0
    })
}

/// `rdma_event_str`.
#[unsafe(export_name = "__shmhca_rdma_event_str")]
pub extern "C" fn rdma_event_str(event: rdma_cm_event_type) -> *const libc::c_char {
    let s: &'static [u8] = match event {
        RDMA_CM_EVENT_ADDR_RESOLVED => b"RDMA_CM_EVENT_ADDR_RESOLVED\0",
        RDMA_CM_EVENT_ADDR_ERROR => b"RDMA_CM_EVENT_ADDR_ERROR\0",
        RDMA_CM_EVENT_ROUTE_RESOLVED => b"RDMA_CM_EVENT_ROUTE_RESOLVED\0",
        RDMA_CM_EVENT_ROUTE_ERROR => b"RDMA_CM_EVENT_ROUTE_ERROR\0",
        RDMA_CM_EVENT_CONNECT_REQUEST => b"RDMA_CM_EVENT_CONNECT_REQUEST\0",
        RDMA_CM_EVENT_CONNECT_RESPONSE => b"RDMA_CM_EVENT_CONNECT_RESPONSE\0",
        RDMA_CM_EVENT_CONNECT_ERROR => b"RDMA_CM_EVENT_CONNECT_ERROR\0",
        RDMA_CM_EVENT_UNREACHABLE => b"RDMA_CM_EVENT_UNREACHABLE\0",
        RDMA_CM_EVENT_REJECTED => b"RDMA_CM_EVENT_REJECTED\0",
        RDMA_CM_EVENT_ESTABLISHED => b"RDMA_CM_EVENT_ESTABLISHED\0",
        RDMA_CM_EVENT_DISCONNECTED => b"RDMA_CM_EVENT_DISCONNECTED\0",
        RDMA_CM_EVENT_DEVICE_REMOVAL => b"RDMA_CM_EVENT_DEVICE_REMOVAL\0",
        RDMA_CM_EVENT_MULTICAST_JOIN => b"RDMA_CM_EVENT_MULTICAST_JOIN\0",
        RDMA_CM_EVENT_MULTICAST_ERROR => b"RDMA_CM_EVENT_MULTICAST_ERROR\0",
        RDMA_CM_EVENT_ADDR_CHANGE => b"RDMA_CM_EVENT_ADDR_CHANGE\0",
        RDMA_CM_EVENT_TIMEWAIT_EXIT => b"RDMA_CM_EVENT_TIMEWAIT_EXIT\0",
        _ => b"UNKNOWN EVENT\0",
    };
    s.as_ptr().cast()
}

// ---------------------------------------------------------------- ids

/// `rdma_create_id` (RDMA_PS_TCP only: RC connections).
#[unsafe(export_name = "__shmhca_rdma_create_id")]
pub unsafe extern "C" fn rdma_create_id(
    channel: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut libc::c_void,
    ps: rdma_port_space,
) -> libc::c_int {
    guard("rdma_create_id", -1, || {
        if id.is_null() {
            return err(libc::EINVAL);
        }
        if ps != RDMA_PS_TCP {
            say_once(format!(
                "rdma_create_id: port space {ps:#x} is not supported by shmhca (RDMA_PS_TCP only)"
            ));
            return err(libc::ENOSYS);
        }
        if channel.is_null() {
            say_once(
                "rdma_create_id: synchronous ids (no event channel) are not supported by shmhca"
                    .into(),
            );
            return err(libc::ENOSYS);
        }
        // SAFETY: the caller's out pointer.
        unsafe { *id = new_id(channel, context).cast() };
        0
    })
}

/// `rdma_destroy_id`: stops the id's threads (sending DREQ if still connected), removes its
/// rendezvous socket and frees it.
#[unsafe(export_name = "__shmhca_rdma_destroy_id")]
pub unsafe extern "C" fn rdma_destroy_id(id: *mut rdma_cm_id) -> libc::c_int {
    guard("rdma_destroy_id", -1, || {
        // SAFETY: an id of ours or null.
        let Some(i) = (unsafe { id_ref(id) }) else {
            return err(libc::EINVAL);
        };
        i.stop.store(true, Ordering::Release);
        let hs: Vec<_> = i
            .threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        for h in hs {
            let _ = h.join();
        }
        {
            let mut st = i.lock();
            if let Some(s) = st.stream.take() {
                if st.conn == Conn::Up && !st.disconnected && !st.dreq_sent {
                    let _ = wire::send(&s, &Frame::bare(Kind::Dreq));
                }
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            if let Some((p, own)) = st.listener.take() {
                wire::remove_own(&p, own);
            }
        }
        // SAFETY: the id, made by new_id, freed once; its threads are joined.
        drop(unsafe { Box::from_raw(id.cast::<Id>()) });
        0
    })
}

/// `rdma_bind_addr`: a local address (this machine's, or the wildcard) and port.
#[unsafe(export_name = "__shmhca_rdma_bind_addr")]
pub unsafe extern "C" fn rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut sockaddr) -> libc::c_int {
    guard("rdma_bind_addr", -1, || {
        // SAFETY: an id of ours or null.
        let Some(i) = (unsafe { id_ref(id) }) else {
            return err(libc::EINVAL);
        };
        // SAFETY: the caller's sockaddr.
        let a = match unsafe { from_c(addr) } {
            Ok(a) => a,
            Err(e) => return err(e),
        };
        if let Err(e) = check_local("rdma_bind_addr", a, true) {
            return err(e);
        }
        let mut st = i.lock();
        if st.bound.is_some() {
            return err(libc::EINVAL);
        }
        if let Err(e) = attach_dev(id.cast()) {
            return err(e);
        }
        st.bound = Some(a);
        set_src(id.cast(), a);
        0
    })
}

/// `rdma_resolve_addr`: the destination must be an address of this machine.
#[unsafe(export_name = "__shmhca_rdma_resolve_addr")]
pub unsafe extern "C" fn rdma_resolve_addr(
    id: *mut rdma_cm_id,
    src: *mut sockaddr,
    dst: *mut sockaddr,
    _timeout_ms: libc::c_int,
) -> libc::c_int {
    guard("rdma_resolve_addr", -1, || {
        // SAFETY: an id of ours or null.
        let Some(i) = (unsafe { id_ref(id) }) else {
            return err(libc::EINVAL);
        };
        // SAFETY: the caller's sockaddr.
        let d = match unsafe { from_c(dst) } {
            Ok(a) => a,
            Err(e) => return err(e),
        };
        if let Err(e) = check_local("rdma_resolve_addr", d, false) {
            return err(e);
        }
        let src = if src.is_null() {
            None
        } else {
            // SAFETY: the caller's sockaddr.
            match unsafe { from_c(src) } {
                Ok(a) => Some(a),
                Err(e) => return err(e),
            }
        };
        if let Some(s) = src {
            if let Err(e) = check_local("rdma_resolve_addr", s, true) {
                return err(e);
            }
        }
        if let Err(e) = attach_dev(id.cast()) {
            return err(e);
        }
        let mut st = i.lock();
        let mut b = st.bound.or(src).unwrap_or(SocketAddr::new(d.ip(), 0));
        if b.ip().is_unspecified() {
            b.set_ip(d.ip());
        }
        if b.port() == 0 {
            b.set_port(ephemeral());
        }
        st.bound = Some(b);
        st.peer = Some(d);
        set_src(id.cast(), b);
        set_dst(id.cast(), d);
        drop(st);
        push(i, ptr::null_mut(), RDMA_CM_EVENT_ADDR_RESOLVED, 0, None);
        0
    })
}

/// `rdma_resolve_route`: on one machine, the route is the fabric (nothing to look up).
#[unsafe(export_name = "__shmhca_rdma_resolve_route")]
pub unsafe extern "C" fn rdma_resolve_route(
    id: *mut rdma_cm_id,
    _timeout_ms: libc::c_int,
) -> libc::c_int {
    guard("rdma_resolve_route", -1, || {
        // SAFETY: an id of ours or null.
        let Some(i) = (unsafe { id_ref(id) }) else {
            return err(libc::EINVAL);
        };
        let mut st = i.lock();
        if st.peer.is_none() {
            return err(libc::EINVAL);
        }
        st.route_resolved = true;
        drop(st);
        push(i, ptr::null_mut(), RDMA_CM_EVENT_ROUTE_RESOLVED, 0, None);
        0
    })
}

/// `rdma_listen`: the rendezvous socket `rdmacm-PORT.sock` in the fabric directory, and a
/// thread turning each connection's REQ into a CONNECT_REQUEST event with a new id.
#[unsafe(export_name = "__shmhca_rdma_listen")]
pub unsafe extern "C" fn rdma_listen(id: *mut rdma_cm_id, _backlog: libc::c_int) -> libc::c_int {
    guard("rdma_listen", -1, || {
        // SAFETY: an id of ours or null.
        let Some(i) = (unsafe { id_ref(id) }) else {
            return err(libc::EINVAL);
        };
        let dir = match wire::fabric_dir() {
            Ok(d) => d,
            Err(e) => return err(e),
        };
        if i.c.verbs.is_null() {
            if let Err(e) = attach_dev(id.cast()) {
                return err(e);
            }
        }
        let mut st = i.lock();
        if st.listener.is_some() || st.conn != Conn::Idle {
            return err(libc::EINVAL);
        }
        let mut a = st
            .bound
            .unwrap_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0));
        let fixed = a.port() != 0;
        let mut listener = None;
        for _ in 0..64 {
            if !fixed {
                a.set_port(ephemeral());
            }
            match wire::bind_port(&dir, a.port()) {
                Ok(bound) => {
                    listener = Some(bound);
                    break;
                }
                Err(e) if e.raw_os_error() == Some(libc::EADDRINUSE) => {
                    if fixed {
                        return err(libc::EADDRINUSE);
                    }
                }
                Err(e) => return err(e.raw_os_error().unwrap_or(libc::EIO)),
            }
        }
        let Some((l, path, own)) = listener else {
            return err(libc::EADDRINUSE);
        };
        if l.set_nonblocking(true).is_err() {
            wire::remove_own(&path, own);
            return err(libc::EIO);
        }
        st.bound = Some(a);
        st.listener = Some((path.clone(), own));
        set_src(id.cast(), a);
        drop(st);
        let me = P(id.cast::<Id>());
        if let Err(e) = i.spawn("shmhca-cm-listen", move || listen_loop(me, l, a)) {
            wire::remove_own(&path, own);
            i.lock().listener = None;
            return err(e);
        }
        0
    })
}

fn listen_loop(me: P<Id>, l: UnixListener, bound: SocketAddr) {
    // SAFETY: the listening id outlives this thread (rdma_destroy_id joins it).
    let i = unsafe { &*me.0 };
    while !i.stop.load(Ordering::Acquire) {
        if !wire::readable(&l, TICK_MS) {
            continue;
        }
        let Ok((s, _)) = l.accept() else { continue };
        if s.set_nonblocking(false).is_err()
            || s.set_read_timeout(Some(Duration::from_secs(10))).is_err()
        {
            continue;
        }
        if !wire::same_user(&s) {
            say_once("rdma_cm: a connection from another user's process was refused".into());
            continue;
        }
        let f = match wire::recv(&s) {
            Got::Frame(f) if f.kind == Kind::Req => f,
            Got::Closed => continue,
            Got::Bad(why) => {
                say_once(format!(
                    "rdma_cm: a malformed connection request was dropped ({why})"
                ));
                continue;
            }
            Got::Frame(f) => {
                say_once(format!(
                    "rdma_cm: a {:?} instead of a connection request was dropped",
                    f.kind
                ));
                continue;
            }
        };
        if s.set_read_timeout(None).is_err() {
            continue;
        }
        let child = new_id(i.c.channel, i.c.context);
        let mut src = bound;
        if src.ip().is_unspecified() {
            src.set_ip(match f.addr.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            });
        }
        // SAFETY: the child was just made; nothing else sees it yet.
        let c = unsafe { &mut *child };
        c.c.verbs = i.c.verbs;
        c.c.port_num = 1;
        set_src(child, src);
        set_dst(child, f.addr);
        {
            let mut st = c.lock();
            st.bound = Some(src);
            st.peer = Some(f.addr);
            st.route_resolved = true;
            st.stream = Some(Arc::new(s));
            st.conn = Conn::Requested;
            st.req = Some(f.clone());
        }
        push(
            c,
            ptr::from_ref(&i.c).cast_mut(),
            RDMA_CM_EVENT_CONNECT_REQUEST,
            0,
            Some(&f),
        );
    }
}

/// The connection parameters a program passed (zeros for none).
fn params(p: *mut rdma_conn_param) -> Result<(rdma_conn_param, Vec<u8>), i32> {
    // SAFETY: null or the caller's parameters.
    let Some(p) = (unsafe { p.as_ref() }) else {
        // SAFETY: all-zero is valid.
        return Ok((unsafe { std::mem::zeroed() }, Vec::new()));
    };
    let n = usize::from(p.private_data_len);
    let pd = if n == 0 || p.private_data.is_null() {
        Vec::new()
    } else {
        // SAFETY: the caller's private data of the length it gives.
        unsafe { std::slice::from_raw_parts(p.private_data.cast::<u8>(), n) }.to_vec()
    };
    Ok((*p, pd))
}

/// Our REQ/REP: LID, GID, the QP's number (or the program's `qp_num` without one).
fn my_frame(
    kind: Kind,
    i: &Id,
    p: &rdma_conn_param,
    private: Vec<u8>,
    psn: u32,
) -> Result<Frame, i32> {
    let d = dev::dev()?;
    let mut f = Frame::bare(kind);
    f.lid = d.lid;
    f.gid = d.gid;
    f.qpn = if i.c.qp.is_null() {
        p.qp_num & 0xFF_FFFF
    } else {
        // SAFETY: the program's QP (made by rdma_create_qp).
        unsafe { (*i.c.qp).qp_num }
    };
    f.psn = psn;
    f.responder_resources = p.responder_resources;
    f.initiator_depth = p.initiator_depth;
    f.addr = i.lock().bound.unwrap_or(f.addr);
    f.private = private;
    Ok(f)
}

fn connect_qp(i: &Id, peer: &Frame, p: &rdma_conn_param, psn: u32) -> Result<(), i32> {
    if i.c.qp.is_null() {
        return Ok(());
    }
    let d = dev::dev()?;
    dev::to_rts(
        d,
        i.c.qp,
        &Connect {
            lid: peer.lid,
            gid: peer.gid,
            qpn: peer.qpn,
            peer_psn: peer.psn,
            my_psn: psn,
            responder_resources: p.responder_resources.max(peer.initiator_depth),
            initiator_depth: p.initiator_depth.max(peer.responder_resources),
            retry_count: if p.retry_count == 0 { 7 } else { p.retry_count },
            rnr_retry: if p.rnr_retry_count == 0 {
                7
            } else {
                p.rnr_retry_count
            },
        },
    )
}

/// `rdma_connect`: REQ to the listener of the destination port; the answer comes as an
/// ESTABLISHED (QP moved to RTS first) or REJECTED event.
#[unsafe(export_name = "__shmhca_rdma_connect")]
pub unsafe extern "C" fn rdma_connect(
    id: *mut rdma_cm_id,
    conn_param: *mut rdma_conn_param,
) -> libc::c_int {
    guard("rdma_connect", -1, || {
        // SAFETY: an id of ours or null.
        let Some(i) = (unsafe { id_ref(id) }) else {
            return err(libc::EINVAL);
        };
        let (p, private) = match params(conn_param) {
            Ok(x) => x,
            Err(e) => return err(e),
        };
        if private.len() > 56 {
            return err(libc::EINVAL);
        }
        let dir = match wire::fabric_dir() {
            Ok(d) => d,
            Err(e) => return err(e),
        };
        let st = i.lock();
        let Some(peer) = st.peer.filter(|_| st.route_resolved) else {
            return err(libc::EINVAL);
        };
        if st.conn != Conn::Idle {
            return err(libc::EINVAL);
        }
        drop(st);
        let psn = random_psn();
        let f = match my_frame(Kind::Req, i, &p, private, psn) {
            Ok(f) => f,
            Err(e) => return err(e),
        };
        let path = wire::sock_path(&dir, peer.port());
        i.lock().conn = Conn::Connecting;
        let me = P(id.cast::<Id>());
        let mut p = p;
        p.private_data = ptr::null();
        let p = Params(p);
        if let Err(e) = i.spawn("shmhca-cm-conn", move || {
            let p = p;
            connect_loop(me, path, f, p.0, psn)
        }) {
            i.lock().conn = Conn::Idle;
            return err(e);
        }
        0
    })
}

/// How long a REQ waits for a listener on its port before REJECTED (reason 8): IB CM
/// answers a REQ to an unknown service at once, but programs such as perftest `-R`
/// connect right after a handshake that precedes the server's `rdma_listen`, relying on
/// the network's delay (their retry path after a reject reads freed memory).
const LISTEN_WAIT: Duration = Duration::from_secs(2);

/// The client's side: connect to the listener's socket (waiting for it up to
/// [`LISTEN_WAIT`]), REQ, then the answer ([`client_loop`]).
fn connect_loop(me: P<Id>, path: PathBuf, f: Frame, p: rdma_conn_param, psn: u32) {
    // SAFETY: the id outlives this thread (rdma_destroy_id joins it).
    let i = unsafe { &*me.0 };
    let t0 = std::time::Instant::now();
    let s = loop {
        match UnixStream::connect(&path) {
            Ok(s) => break Some(s),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENOENT) | Some(libc::ECONNREFUSED)
                ) && t0.elapsed() < LISTEN_WAIT
                    && !i.stop.load(Ordering::Acquire) =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(_) => break None,
        }
    };
    if i.stop.load(Ordering::Acquire) {
        return;
    }
    let Some(s) = s else {
        i.lock().conn = Conn::Down;
        push(
            i,
            ptr::null_mut(),
            RDMA_CM_EVENT_REJECTED,
            REJ_INVALID_SERVICE,
            None,
        );
        return;
    };
    if !wire::same_user(&s) {
        say_once(format!(
            "rdma_connect: {} belongs to another user's process: refused",
            path.display()
        ));
        i.lock().conn = Conn::Down;
        push(
            i,
            ptr::null_mut(),
            RDMA_CM_EVENT_REJECTED,
            REJ_INVALID_SERVICE,
            None,
        );
        return;
    }
    if wire::send(&s, &f).is_err() {
        i.lock().conn = Conn::Down;
        push(
            i,
            ptr::null_mut(),
            RDMA_CM_EVENT_UNREACHABLE,
            -libc::ECONNRESET,
            None,
        );
        return;
    }
    let s = Arc::new(s);
    i.lock().stream = Some(s.clone());
    client_loop(me, s, p, psn);
}

/// Connection parameters without their private data, for the connecting thread.
struct Params(rdma_conn_param);
// SAFETY: its only pointer (the private data) is null.
unsafe impl Send for Params {}

/// Waits (checking the stop flag) for one frame.
fn next_frame(i: &Id, s: &UnixStream) -> Option<Got> {
    loop {
        if i.stop.load(Ordering::Acquire) {
            return None;
        }
        if wire::readable(s, TICK_MS) {
            return Some(wire::recv(s));
        }
    }
}

fn client_loop(me: P<Id>, s: Arc<UnixStream>, p: rdma_conn_param, psn: u32) {
    // SAFETY: the id outlives this thread (rdma_destroy_id joins it).
    let i = unsafe { &*me.0 };
    let Some(got) = next_frame(i, &s) else { return };
    match got {
        Got::Frame(f) if f.kind == Kind::Rep => {
            if connect_qp(i, &f, &p, psn).is_err() {
                i.lock().conn = Conn::Down;
                let _ = wire::send(&s, &Frame::bare(Kind::Rej));
                push(
                    i,
                    ptr::null_mut(),
                    RDMA_CM_EVENT_CONNECT_ERROR,
                    -libc::EINVAL,
                    None,
                );
                return;
            }
            {
                let mut st = i.lock();
                if wire::send(&s, &Frame::bare(Kind::Rtu)).is_err() {
                    st.conn = Conn::Down;
                    drop(st);
                    push(
                        i,
                        ptr::null_mut(),
                        RDMA_CM_EVENT_CONNECT_ERROR,
                        -libc::ECONNRESET,
                        None,
                    );
                    return;
                }
                st.conn = Conn::Up;
            }
            push(i, ptr::null_mut(), RDMA_CM_EVENT_ESTABLISHED, 0, Some(&f));
            up_loop(i, &s);
        }
        Got::Frame(f) if f.kind == Kind::Rej => {
            i.lock().conn = Conn::Down;
            push(
                i,
                ptr::null_mut(),
                RDMA_CM_EVENT_REJECTED,
                REJ_CONSUMER,
                Some(&f),
            );
        }
        Got::Closed => {
            i.lock().conn = Conn::Down;
            push(
                i,
                ptr::null_mut(),
                RDMA_CM_EVENT_UNREACHABLE,
                -libc::ECONNRESET,
                None,
            );
        }
        Got::Frame(_) | Got::Bad(_) => {
            say_once(
                "rdma_connect: a malformed answer from the listener: connection dropped".into(),
            );
            i.lock().conn = Conn::Down;
            push(
                i,
                ptr::null_mut(),
                RDMA_CM_EVENT_CONNECT_ERROR,
                -libc::EPROTO,
                None,
            );
        }
    }
}

/// Queues DISCONNECTED once.
fn disconnected(i: &Id) {
    let first = {
        let mut st = i.lock();
        let first = !st.disconnected;
        st.disconnected = true;
        st.conn = Conn::Down;
        first
    };
    if first {
        push(i, ptr::null_mut(), RDMA_CM_EVENT_DISCONNECTED, 0, None);
    }
}

/// An established connection: DREQ (answered with DREP), DREP or the peer gone end it.
fn up_loop(i: &Id, s: &UnixStream) {
    loop {
        let Some(got) = next_frame(i, s) else { return };
        match got {
            Got::Frame(f) if f.kind == Kind::Dreq => {
                {
                    let _st = i.lock();
                    let _ = wire::send(s, &Frame::bare(Kind::Drep));
                }
                disconnected(i);
            }
            Got::Frame(f) if f.kind == Kind::Drep => {
                disconnected(i);
                return;
            }
            Got::Closed => {
                disconnected(i);
                return;
            }
            Got::Frame(_) | Got::Bad(_) => {
                say_once("rdma_cm: a malformed message from the peer: connection dropped".into());
                disconnected(i);
                return;
            }
        }
    }
}

fn server_loop(me: P<Id>, s: Arc<UnixStream>) {
    // SAFETY: the id outlives this thread (rdma_destroy_id joins it).
    let i = unsafe { &*me.0 };
    let Some(got) = next_frame(i, &s) else { return };
    match got {
        Got::Frame(f) if f.kind == Kind::Rtu => {
            i.lock().conn = Conn::Up;
            push(i, ptr::null_mut(), RDMA_CM_EVENT_ESTABLISHED, 0, None);
            up_loop(i, &s);
        }
        Got::Frame(f) if f.kind == Kind::Rej => {
            i.lock().conn = Conn::Down;
            push(
                i,
                ptr::null_mut(),
                RDMA_CM_EVENT_CONNECT_ERROR,
                -libc::ECONNREFUSED,
                None,
            );
        }
        Got::Closed => {
            i.lock().conn = Conn::Down;
            push(
                i,
                ptr::null_mut(),
                RDMA_CM_EVENT_CONNECT_ERROR,
                -libc::ECONNRESET,
                None,
            );
        }
        Got::Frame(_) | Got::Bad(_) => {
            say_once("rdma_accept: a malformed message from the client: connection dropped".into());
            i.lock().conn = Conn::Down;
            push(
                i,
                ptr::null_mut(),
                RDMA_CM_EVENT_CONNECT_ERROR,
                -libc::EPROTO,
                None,
            );
        }
    }
}

/// `rdma_accept`: the QP to RTS towards the requester, REP with our private data;
/// ESTABLISHED follows when the client's RTU arrives.
#[unsafe(export_name = "__shmhca_rdma_accept")]
pub unsafe extern "C" fn rdma_accept(
    id: *mut rdma_cm_id,
    conn_param: *mut rdma_conn_param,
) -> libc::c_int {
    guard("rdma_accept", -1, || {
        // SAFETY: an id of ours or null.
        let Some(i) = (unsafe { id_ref(id) }) else {
            return err(libc::EINVAL);
        };
        let (p, private) = match params(conn_param) {
            Ok(x) => x,
            Err(e) => return err(e),
        };
        if private.len() > 196 {
            return err(libc::EINVAL);
        }
        let (req, s) = {
            let st = i.lock();
            match (st.conn, st.req.clone(), st.stream.clone()) {
                (Conn::Requested, Some(r), Some(s)) => (r, s),
                _ => return err(libc::EINVAL),
            }
        };
        let psn = random_psn();
        let f = match my_frame(Kind::Rep, i, &p, private, psn) {
            Ok(f) => f,
            Err(e) => return err(e),
        };
        if let Err(e) = connect_qp(i, &req, &p, psn) {
            return err(e);
        }
        {
            let mut st = i.lock();
            if let Err(e) = wire::send(&s, &f) {
                st.conn = Conn::Down;
                return err(e);
            }
            st.conn = Conn::Up;
        }
        let me = P(id.cast::<Id>());
        if let Err(e) = i.spawn("shmhca-cm-conn", move || server_loop(me, s)) {
            return err(e);
        }
        0
    })
}

/// `rdma_reject`: REJ with the private data.
#[unsafe(export_name = "__shmhca_rdma_reject")]
pub unsafe extern "C" fn rdma_reject(
    id: *mut rdma_cm_id,
    private_data: *const libc::c_void,
    private_data_len: u8,
) -> libc::c_int {
    guard("rdma_reject", -1, || {
        // SAFETY: an id of ours or null.
        let Some(i) = (unsafe { id_ref(id) }) else {
            return err(libc::EINVAL);
        };
        let n = usize::from(private_data_len);
        if n > 148 {
            return err(libc::EINVAL);
        }
        let mut f = Frame::bare(Kind::Rej);
        if n > 0 && !private_data.is_null() {
            // SAFETY: the caller's private data of the length it gives.
            f.private =
                unsafe { std::slice::from_raw_parts(private_data.cast::<u8>(), n) }.to_vec();
        }
        let mut st = i.lock();
        if st.conn != Conn::Requested {
            return err(libc::EINVAL);
        }
        st.conn = Conn::Down;
        let Some(s) = st.stream.take() else {
            return err(libc::EINVAL);
        };
        let r = wire::send(&s, &f);
        let _ = s.shutdown(std::net::Shutdown::Both);
        match r {
            Ok(()) => 0,
            Err(e) => err(e),
        }
    })
}

/// `rdma_disconnect`: the QP to ERR, DREQ to the peer; DISCONNECTED follows.
#[unsafe(export_name = "__shmhca_rdma_disconnect")]
pub unsafe extern "C" fn rdma_disconnect(id: *mut rdma_cm_id) -> libc::c_int {
    guard("rdma_disconnect", -1, || {
        // SAFETY: an id of ours or null.
        let Some(i) = (unsafe { id_ref(id) }) else {
            return err(libc::EINVAL);
        };
        dev::to_err(i.c.qp);
        let mut st = i.lock();
        if st.disconnected {
            return 0;
        }
        if st.conn != Conn::Up || st.dreq_sent {
            return err(libc::EINVAL);
        }
        let Some(s) = st.stream.clone() else {
            return err(libc::EINVAL);
        };
        st.dreq_sent = true;
        match wire::send(&s, &Frame::bare(Kind::Dreq)) {
            Ok(()) => 0,
            Err(e) => {
                drop(st);
                disconnected(i);
                err(e)
            }
        }
    })
}

// ---------------------------------------------------------------- QPs

fn qp_checks(
    i: &Id,
    attr_qp_type: ibv_qp_type,
    send_cq: *mut ibv_cq,
    recv_cq: *mut ibv_cq,
) -> Result<(), i32> {
    if i.c.verbs.is_null() {
        return Err(libc::EINVAL);
    }
    if !i.c.qp.is_null() {
        return Err(libc::EEXIST);
    }
    if attr_qp_type != IBV_QPT_RC {
        say_once("rdma_create_qp: only RC QPs are supported by shmhca's rdma_cm".into());
        return Err(libc::ENOSYS);
    }
    if send_cq.is_null() || recv_cq.is_null() {
        say_once(
            "rdma_create_qp: shmhca's rdma_cm needs the program's send and receive CQs".into(),
        );
        return Err(libc::EINVAL);
    }
    Ok(())
}

fn adopt_qp(id: *mut rdma_cm_id, qp: *mut ibv_qp, pd: *mut ibv_pd) -> libc::c_int {
    if qp.is_null() {
        return -1; // errno from verbs
    }
    if let Err(e) = dev::to_init(qp) {
        // SAFETY: the QP just made.
        unsafe { ibv_destroy_qp(qp) };
        return err(e);
    }
    // SAFETY: the id is ours; the QP and its CQs are the program's.
    unsafe {
        (*id).qp = qp;
        (*id).pd = pd;
        (*id).send_cq = (*qp).send_cq;
        (*id).recv_cq = (*qp).recv_cq;
        (*id).srq = (*qp).srq;
        (*id).qp_type = IBV_QPT_RC;
    }
    0
}

/// `rdma_create_qp`: an RC QP on `pd` (or a default one) at INIT, the id's QP.
#[unsafe(export_name = "__shmhca_rdma_create_qp")]
pub unsafe extern "C" fn rdma_create_qp(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> libc::c_int {
    guard("rdma_create_qp", -1, || {
        // SAFETY: an id of ours or null.
        let Some(i) = (unsafe { id_ref(id) }) else {
            return err(libc::EINVAL);
        };
        // SAFETY: null or the caller's attributes.
        let Some(a) = (unsafe { qp_init_attr.as_ref() }) else {
            return err(libc::EINVAL);
        };
        if let Err(e) = qp_checks(i, a.qp_type, a.send_cq, a.recv_cq) {
            return err(e);
        }
        let pd = if pd.is_null() {
            match dev::dev().and_then(|d| d.default_pd()) {
                Ok(p) => p,
                Err(e) => return err(e),
            }
        } else {
            pd
        };
        // SAFETY: the program's PD and attributes.
        let qp = unsafe { ibv_create_qp(pd, qp_init_attr) };
        adopt_qp(id, qp, pd)
    })
}

/// `rdma_create_qp_ex`: as `rdma_create_qp`, through the context's `create_qp_ex`.
#[unsafe(export_name = "__shmhca_rdma_create_qp_ex")]
pub unsafe extern "C" fn rdma_create_qp_ex(
    id: *mut rdma_cm_id,
    attr: *mut ibv_qp_init_attr_ex,
) -> libc::c_int {
    guard("rdma_create_qp_ex", -1, || {
        // SAFETY: an id of ours or null.
        let Some(i) = (unsafe { id_ref(id) }) else {
            return err(libc::EINVAL);
        };
        // SAFETY: null or the caller's attributes.
        let Some(a) = (unsafe { attr.as_mut() }) else {
            return err(libc::EINVAL);
        };
        if let Err(e) = qp_checks(i, a.qp_type, a.send_cq, a.recv_cq) {
            return err(e);
        }
        if a.comp_mask & IBV_QP_INIT_ATTR_PD == 0 || a.pd.is_null() {
            match dev::dev().and_then(|d| d.default_pd()) {
                Ok(p) => a.pd = p,
                Err(e) => return err(e),
            }
            a.comp_mask |= IBV_QP_INIT_ATTR_PD;
        }
        let qp = dev::create_qp_ex(i.c.verbs, attr);
        if qp.is_null() && crate::util::errno() == 0 {
            set_errno(libc::ENOSYS);
        }
        adopt_qp(id, qp, a.pd)
    })
}

/// `rdma_destroy_qp`.
#[unsafe(export_name = "__shmhca_rdma_destroy_qp")]
pub unsafe extern "C" fn rdma_destroy_qp(id: *mut rdma_cm_id) {
    guard("rdma_destroy_qp", (), || {
        if id.is_null() {
            return;
        }
        // SAFETY: an id of ours; its QP made by rdma_create_qp.
        unsafe {
            if !(*id).qp.is_null() {
                ibv_destroy_qp((*id).qp);
                (*id).qp = ptr::null_mut();
            }
        }
    })
}

// ---------------------------------------------------------------- small queries

fn port_of(a: *const sockaddr) -> u16 {
    // SAFETY: the id's own address storage.
    match unsafe { from_c(a) } {
        Ok(a) => a.port().to_be(),
        Err(_) => 0,
    }
}

/// `rdma_get_src_port` (network byte order).
#[unsafe(export_name = "__shmhca_rdma_get_src_port")]
pub unsafe extern "C" fn rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    guard("rdma_get_src_port", 0, || {
        if id.is_null() {
            return 0;
        }
        // SAFETY: an id of ours: the union's storage holds a sockaddr (or family 0).
        port_of(unsafe { ptr::addr_of!((*id).route.addr.__bindgen_anon_1).cast() })
    })
}

/// `rdma_get_dst_port` (network byte order).
#[unsafe(export_name = "__shmhca_rdma_get_dst_port")]
pub unsafe extern "C" fn rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    guard("rdma_get_dst_port", 0, || {
        if id.is_null() {
            return 0;
        }
        // SAFETY: as above.
        port_of(unsafe { ptr::addr_of!((*id).route.addr.__bindgen_anon_2).cast() })
    })
}

/// `rdma_set_option`: the `RDMA_OPTION_ID` options (TOS, REUSEADDR, AFONLY, ACK_TIMEOUT)
/// are accepted after their size is checked: they tune an IP or IB network shmhca does not
/// have. `RDMA_OPTION_IB_PATH` (a path record to use) likewise. Anything else: ENOSYS.
#[unsafe(export_name = "__shmhca_rdma_set_option")]
pub unsafe extern "C" fn rdma_set_option(
    id: *mut rdma_cm_id,
    level: libc::c_int,
    optname: libc::c_int,
    optval: *mut libc::c_void,
    optlen: usize,
) -> libc::c_int {
    guard("rdma_set_option", -1, || {
        if id.is_null() || optval.is_null() {
            return err(libc::EINVAL);
        }
        let (level, optname) = (level as u32, optname as u32);
        let size = match (level, optname) {
            (RDMA_OPTION_ID, RDMA_OPTION_ID_TOS) => 1,
            (RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR | RDMA_OPTION_ID_AFONLY) => 4,
            (RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT) => 1,
            (RDMA_OPTION_IB, RDMA_OPTION_IB_PATH) => {
                if optlen == 0 {
                    return err(libc::EINVAL);
                }
                return 0;
            }
            _ => {
                say_once(format!(
                    "rdma_set_option: option {level}/{optname} is not supported by shmhca"
                ));
                return err(libc::ENOSYS);
            }
        };
        if optlen != size {
            return err(libc::EINVAL);
        }
        0
    })
}
