//! Addresses: which are local (shmhca connects processes of one machine), conversions
//! between C `sockaddr`s and [`SocketAddr`], and `rdma_getaddrinfo`.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ptr;

use crate::ffi::{rdma_addrinfo, sockaddr};
use crate::util::{err, guard, say_once};

/// Reads a C `sockaddr` (AF_INET or AF_INET6).
///
/// # Safety
/// `sa` is null or points at a `sockaddr` of its family's size.
pub(crate) unsafe fn from_c(sa: *const sockaddr) -> Result<SocketAddr, i32> {
    if sa.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: the caller's promise: a sockaddr, whose family says its size.
    let family = i32::from(unsafe { (*sa).sa_family });
    match family {
        libc::AF_INET => {
            // SAFETY: AF_INET: a sockaddr_in (read unaligned: C callers may pack it).
            let s = unsafe { ptr::read_unaligned(sa.cast::<libc::sockaddr_in>()) };
            Ok(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr)),
                u16::from_be(s.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: AF_INET6: a sockaddr_in6.
            let s = unsafe { ptr::read_unaligned(sa.cast::<libc::sockaddr_in6>()) };
            Ok(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(s.sin6_addr.s6_addr),
                u16::from_be(s.sin6_port),
                s.sin6_flowinfo,
                s.sin6_scope_id,
            )))
        }
        _ => {
            say_once(format!(
                "rdma_cm: address family {family} is not supported by shmhca (IPv4 and IPv6 only)"
            ));
            Err(libc::EAFNOSUPPORT)
        }
    }
}

/// Writes `a` as a C `sockaddr_storage`.
pub(crate) fn to_storage(a: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match a {
        SocketAddr::V4(v) => {
            let s = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: a sockaddr_in fits in a sockaddr_storage.
            unsafe { ptr::write(ptr::from_mut(&mut st).cast(), s) };
        }
        SocketAddr::V6(v) => {
            let s = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v.port().to_be(),
                sin6_flowinfo: v.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v.ip().octets(),
                },
                sin6_scope_id: v.scope_id(),
            };
            // SAFETY: a sockaddr_in6 fits in a sockaddr_storage.
            unsafe { ptr::write(ptr::from_mut(&mut st).cast(), s) };
        }
    }
    st
}

/// This host's own addresses (its interfaces'), read with `getifaddrs`.
fn host_addrs() -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut list: *mut libc::ifaddrs = ptr::null_mut();
    // SAFETY: getifaddrs fills `list` (freed below).
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return out;
    }
    let mut p = list;
    while !p.is_null() {
        // SAFETY: a node of getifaddrs' list.
        let ifa = unsafe { &*p };
        // SAFETY: a non-null address of getifaddrs: at least its family is readable.
        let inet = !ifa.ifa_addr.is_null()
            && matches!(
                i32::from(unsafe { (*ifa.ifa_addr).sa_family }),
                libc::AF_INET | libc::AF_INET6
            );
        if inet {
            // SAFETY: getifaddrs' addresses are sockaddrs of their family's size.
            if let Ok(a) = unsafe { from_c(ifa.ifa_addr.cast()) } {
                out.push(a.ip());
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: the list getifaddrs made.
    unsafe { libc::freeifaddrs(list) };
    out
}

/// Whether `ip` is an address of this machine (loopback or one of its interfaces'); the
/// wildcard counts when `wildcard_ok` (binding).
pub(crate) fn is_local(ip: IpAddr, wildcard_ok: bool) -> bool {
    if ip.is_unspecified() {
        return wildcard_ok;
    }
    if ip.is_loopback() {
        return true;
    }
    if let IpAddr::V6(v6) = ip {
        if let Some(v4) = v6.to_ipv4_mapped() {
            return is_local(IpAddr::V4(v4), wildcard_ok);
        }
    }
    host_addrs().contains(&ip)
}

/// Checks that `a` is local (see [`is_local`]); else one line saying why, and EADDRNOTAVAIL.
pub(crate) fn check_local(verb: &str, a: SocketAddr, wildcard_ok: bool) -> Result<(), i32> {
    if is_local(a.ip(), wildcard_ok) {
        Ok(())
    } else {
        say_once(format!(
            "{verb}: {} is not an address of this machine: shmhca connects processes of one \
             machine only (use 127.0.0.1 or one of this host's addresses)",
            a.ip()
        ));
        Err(libc::EADDRNOTAVAIL)
    }
}

/// Allocates a copy of `a` with `malloc` (freed by `rdma_freeaddrinfo`).
fn malloc_sockaddr(a: SocketAddr) -> (*mut sockaddr, u32) {
    let st = to_storage(a);
    let len = match a {
        SocketAddr::V4(_) => size_of::<libc::sockaddr_in>(),
        SocketAddr::V6(_) => size_of::<libc::sockaddr_in6>(),
    };
    // SAFETY: malloc of a nonzero size.
    let p = unsafe { libc::malloc(len) }.cast::<u8>();
    if !p.is_null() {
        // SAFETY: `len` bytes of `st` (a sockaddr_storage is larger) into the new block.
        unsafe { ptr::copy_nonoverlapping(ptr::from_ref(&st).cast::<u8>(), p, len) };
    }
    (p.cast(), len as u32)
}

/// `rdma_getaddrinfo`: `node`/`service` resolved with the system's `getaddrinfo` (IPv4 or
/// IPv6, as `hints` asks); the address is the source one with `RAI_PASSIVE`, else the
/// destination. The QP type is RC and the port space TCP.
#[unsafe(export_name = "__shmhca_rdma_getaddrinfo")]
pub unsafe extern "C" fn rdma_getaddrinfo(
    node: *const libc::c_char,
    service: *const libc::c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> libc::c_int {
    guard("rdma_getaddrinfo", -1, || {
        if res.is_null() || (node.is_null() && service.is_null()) {
            return err(libc::EINVAL);
        }
        // SAFETY: null or the caller's hints.
        let h = unsafe { hints.as_ref() };
        let flags = h.map_or(0, |h| h.ai_flags) as u32;
        let passive = flags & crate::ffi::RAI_PASSIVE != 0;
        // SAFETY: all-zero is a valid addrinfo hint.
        let mut ah: libc::addrinfo = unsafe { std::mem::zeroed() };
        ah.ai_family = h.map_or(libc::AF_UNSPEC, |h| h.ai_family);
        if ah.ai_family != libc::AF_INET && ah.ai_family != libc::AF_INET6 {
            ah.ai_family = libc::AF_UNSPEC;
        }
        ah.ai_socktype = libc::SOCK_STREAM;
        if passive {
            ah.ai_flags |= libc::AI_PASSIVE;
        }
        if flags & crate::ffi::RAI_NUMERICHOST != 0 {
            ah.ai_flags |= libc::AI_NUMERICHOST;
        }
        let mut list: *mut libc::addrinfo = ptr::null_mut();
        // SAFETY: C strings or null from the caller; `list` is freed below.
        let rc = unsafe { libc::getaddrinfo(node, service, &ah, &mut list) };
        if rc != 0 {
            // SAFETY: gai_strerror returns a static string.
            let why = unsafe { CStr::from_ptr(libc::gai_strerror(rc)) };
            if std::env::var_os("SHMHCA_VERBS_DEBUG").is_some() {
                eprintln!("shmhca: rdma_getaddrinfo: {}", why.to_string_lossy());
            }
            return err(if rc == libc::EAI_SYSTEM {
                crate::util::errno()
            } else {
                libc::EADDRNOTAVAIL
            });
        }
        // The first IPv4 or IPv6 answer.
        let mut found = None;
        let mut p = list;
        while !p.is_null() && found.is_none() {
            // SAFETY: a node of getaddrinfo's list.
            let a = unsafe { &*p };
            // SAFETY: getaddrinfo's address, of its family's size.
            found = unsafe { from_c(a.ai_addr.cast()) }.ok();
            p = a.ai_next;
        }
        // SAFETY: the list getaddrinfo made.
        unsafe { libc::freeaddrinfo(list) };
        let Some(a) = found else {
            return err(libc::EADDRNOTAVAIL);
        };
        // SAFETY: calloc of one rdma_addrinfo (freed by rdma_freeaddrinfo).
        let ai = unsafe { libc::calloc(1, size_of::<rdma_addrinfo>()) }.cast::<rdma_addrinfo>();
        if ai.is_null() {
            return err(libc::ENOMEM);
        }
        let (sa, len) = malloc_sockaddr(a);
        if sa.is_null() {
            // SAFETY: the block just allocated.
            unsafe { libc::free(ai.cast()) };
            return err(libc::ENOMEM);
        }
        // SAFETY: `ai` is a fresh zeroed rdma_addrinfo.
        let r = unsafe { &mut *ai };
        r.ai_flags = flags as i32;
        r.ai_family = if a.is_ipv4() {
            libc::AF_INET
        } else {
            libc::AF_INET6
        };
        r.ai_qp_type = crate::ffi::IBV_QPT_RC as i32;
        r.ai_port_space = crate::ffi::RDMA_PS_TCP as i32;
        if passive {
            r.ai_src_addr = sa;
            r.ai_src_len = len;
        } else {
            r.ai_dst_addr = sa;
            r.ai_dst_len = len;
        }
        // SAFETY: the caller's out pointer, checked non-null.
        unsafe { *res = ai };
        0
    })
}

/// `rdma_freeaddrinfo`: frees a list `rdma_getaddrinfo` made.
#[unsafe(export_name = "__shmhca_rdma_freeaddrinfo")]
pub unsafe extern "C" fn rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    guard("rdma_freeaddrinfo", (), || {
        let mut p = res;
        while !p.is_null() {
            // SAFETY: a node rdma_getaddrinfo allocated with calloc; its pointers with malloc.
            unsafe {
                let next = (*p).ai_next;
                libc::free((*p).ai_src_addr.cast());
                libc::free((*p).ai_dst_addr.cast());
                libc::free((*p).ai_src_canonname.cast());
                libc::free((*p).ai_dst_canonname.cast());
                libc::free((*p).ai_route);
                libc::free((*p).ai_connect);
                libc::free(p.cast());
                p = next;
            }
        }
    })
}
