//! The socket layer of the UDP link: one unconnected UDP socket bound to (address, 4791),
//! sending bursts with `sendmmsg` and receiving bursts with `recvmmsg` into a ring of
//! pre-allocated datagram buffers. The one module of the UDP link with `unsafe` (the two
//! system calls and the option calls around them); everything above it is safe code.
//!
//! # The socket
//!
//! * **Unconnected**: one socket per local address serves every peer of that address;
//!   each datagram names its destination (`msg_name`), each received one its source.
//! * **Don't Fragment**: `IP_MTU_DISCOVER = IP_PMTUDISC_DO` (IPv4) or
//!   `IPV6_MTU_DISCOVER = IPV6_PMTUDISC_DO` (IPv6). A RoCEv2 packet is never fragmented:
//!   a datagram larger than the path MTU fails with `EMSGSIZE` and is dropped (counted),
//!   which the transport recovers from like any loss.
//! * **Non-blocking** (`SOCK_NONBLOCK`): the engine polls, as it polls its rings.
//! * **IPv6 only** on an IPv6 address (`IPV6_V6ONLY`), so `::` never takes 4791 on IPv4
//!   addresses too.
//! * **The ECN bits of what it receives**: `IP_RECVTOS` (IPv4) or `IPV6_RECVTCLASS` (IPv6),
//!   so each received datagram comes with its IP TOS or traffic class as a control message
//!   ([`RxRing::tos`]): the link is a RoCEv2 congestion *notification point* (see
//!   `super::pump`). A missing, truncated or odd control message reads as TOS 0 (not
//!   marked): [`received_tos`] validates every length against the buffer the kernel wrote.
//!
//! # The IP ID of what it sends, verified on the wire
//!
//! The RoCEv2 ICRC covers the IPv4 Identification field, so the sender must know it and the
//! receiver must know it without seeing the IP header (a UDP socket does not show it).
//! Linux (`ip_select_ident_segs`) sends **ID 0 for a DF datagram from an unconnected
//! socket** (a connected one would count per socket). Verified on kernel 6.18 by capturing
//! with an `AF_PACKET` socket on the receiving end of a veth pair between two network
//! namespaces (198.18.0.1 → 198.18.0.2, port 4791) and on loopback: every datagram had
//! ID 0 and flags 0x4000 (DF). The test `the_kernel_sends_ip_id_zero_for_df_datagrams`
//! checks it again on loopback in a namespace of its own (root only). So the UDP link
//! computes and checks every ICRC with IP ID 0; a peer that sends another ID (a NIC, or
//! a kernel that changed this) fails the check and is counted as an ICRC drop.
//!
//! # Buffers and allocation
//!
//! Nothing is allocated per packet. A [`TxBurst`] holds [`BURST`] datagram buffers of
//! [`DGRAM_BYTES`] each, filled in place and sent by one `sendmmsg`; the `mmsghdr`, `iovec`
//! and address arrays are built on the stack for the call. An [`RxRing`] is one [`Mem`]
//! of `count` buffers of [`DGRAM_BYTES`] (and [`BURST`] control-message buffers, made with
//! it), which `recvmmsg` writes into directly: the
//! engine then reads a payload straight out of that memory (it is the "peer arena" of the
//! link's QPs), so a received payload is copied once, into the application's buffer.
//!
//! # UDP GRO
//!
//! A port's socket has `UDP_GRO` on ([`UdpSocket::enable_gro`]): a GSO send (an Ack and
//! the reply it rides with, a message's packets) that a veth pair or loopback carried
//! whole reaches it as one message, with its segment size as a control message, and the
//! port's ring has buffers of [`GRO_BUFFER_BYTES`] for it; the pump cuts it into its
//! datagrams. Without it, the receiving socket cut each GSO send into a socket buffer per
//! datagram, which cost about what the datagram's whole trip did: on the development VM
//! a bare ping-pong of an Ack-sized datagram and an 8-byte message as one GSO send took
//! 7.6 µs a round trip cut by the kernel, 5.7 µs received whole (4.4 µs for the message
//! alone; `udp_bare_pingpong --gso` and `--gro`).
#![allow(unsafe_code)]

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::error::{Error, Result};
use crate::mem::Mem;

/// The UDP port IANA assigned to RoCEv2.
pub const ROCEV2_PORT: u16 = 4791;

/// Datagrams one `sendmmsg` or `recvmmsg` call moves at most.
pub(crate) const BURST: usize = 32;

/// Bytes of one datagram buffer: room for the largest RoCEv2 transport packet shmhca sends
/// or accepts — headers (at most 40 bytes), a 4096-byte payload (the largest path MTU),
/// pad (up to 3) and ICRC (4) — rounded up to whole cache lines. A longer datagram is
/// truncated by the kernel and dropped by the receiver.
pub(crate) const DGRAM_BYTES: usize = 4160;
const _: () = assert!(DGRAM_BYTES >= 40 + 4096 + 3 + 4 && DGRAM_BYTES.is_multiple_of(64));

/// Bytes of socket buffer asked for each way: a few hundred full-size datagrams, so that
/// a burst or two in flight is not lost to a full receive queue.
const SOCKET_BUFFER: i32 = 4 << 20;

/// A bound, unconnected, non-blocking UDP socket with Don't Fragment set.
#[derive(Debug)]
pub(crate) struct UdpSocket {
    fd: OwnedFd,
    local: SocketAddr,
}

/// A socket address as the kernel takes it.
fn to_raw(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: `sockaddr_storage` is plain old data; all zeroes is a valid (unspecified)
    // address.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: `sockaddr_storage` is larger than and aligned for `sockaddr_in`.
            unsafe { std::ptr::write((&raw mut ss).cast::<libc::sockaddr_in>(), sin) };
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: `sockaddr_storage` is larger than and aligned for `sockaddr_in6`.
            unsafe { std::ptr::write((&raw mut ss).cast::<libc::sockaddr_in6>(), sin6) };
            size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// The socket address the kernel wrote, if it is one of the two families.
fn from_raw(ss: &libc::sockaddr_storage, len: libc::socklen_t) -> Option<SocketAddr> {
    let len = len as usize;
    match i32::from(ss.ss_family) {
        libc::AF_INET if len >= size_of::<libc::sockaddr_in>() => {
            // SAFETY: the family says the storage holds a `sockaddr_in` (and `len` that it
            // was written whole); the storage is aligned for it.
            let sin = unsafe { &*(std::ptr::from_ref(ss).cast::<libc::sockaddr_in>()) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 if len >= size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for `sockaddr_in6`.
            let sin6 = unsafe { &*(std::ptr::from_ref(ss).cast::<libc::sockaddr_in6>()) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// One address of a network interface of this host (what `getifaddrs(3)` lists).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostAddr {
    /// The interface's name.
    pub(crate) interface: String,
    /// The address.
    pub(crate) ip: std::net::IpAddr,
    /// The interface is up and running (`IFF_UP | IFF_RUNNING`).
    pub(crate) up: bool,
}

/// This host's interface addresses, IPv4 and IPv6, as the network namespace of the
/// calling thread sees them now, in the order the kernel lists them.
///
/// # Errors
/// `getifaddrs` failed.
pub(crate) fn host_addrs() -> Result<Vec<HostAddr>> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `list` is a live out-pointer; on success the kernel's list is freed below.
    if unsafe { libc::getifaddrs(&raw mut list) } != 0 {
        return Err(Error::io(
            "listing this host's addresses (getifaddrs)",
            io::Error::last_os_error(),
        ));
    }
    let mut out = Vec::new();
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not freed yet.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a non-null `ifa_addr` points at a sockaddr whose family says its type.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        let ip = match family {
            libc::AF_INET => {
                // SAFETY: the family is AF_INET, so the address is a whole `sockaddr_in`.
                let sin = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
                std::net::IpAddr::V4(Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()))
            }
            libc::AF_INET6 => {
                // SAFETY: as above, for AF_INET6 and `sockaddr_in6`.
                let sin6 = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in6>() };
                std::net::IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        // SAFETY: a non-null `ifa_name` is a NUL-terminated string of the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        let flags = ifa.ifa_flags;
        let up_running = (libc::IFF_UP | libc::IFF_RUNNING) as u32;
        out.push(HostAddr {
            interface: name.to_string_lossy().into_owned(),
            ip,
            up: flags & up_running == up_running,
        });
    }
    // SAFETY: the list came from getifaddrs and is freed once; nothing refers to it now.
    unsafe { libc::freeifaddrs(list) };
    Ok(out)
}

/// The MTU of interface `name` (`SIOCGIFMTU`), in the network namespace of the calling
/// thread; `None` if there is no such interface (or the name is too long for one).
pub(crate) fn interface_mtu(name: &str) -> Option<u32> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return None;
    }
    // SAFETY: a plain system call; the fd it returns is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain old data, all zeroes valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: `req` is a live, NUL-terminated `ifreq` the kernel fills in (its MTU field).
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFMTU, &raw mut req) };
    if r != 0 {
        return None;
    }
    // SAFETY: SIOCGIFMTU succeeded: the union holds the MTU.
    let mtu = unsafe { req.ifr_ifru.ifru_mtu };
    u32::try_from(mtu).ok()
}

/// Sets an integer socket option.
fn set_int(fd: &OwnedFd, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: `value` is a live i32 and its size is passed; the fd is open.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&raw const value).cast(),
            size_of::<i32>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reads an integer socket option.
#[cfg(test)]
fn get_int(fd: &OwnedFd, level: i32, name: i32) -> io::Result<i32> {
    let mut value = 0i32;
    let mut len = size_of::<i32>() as libc::socklen_t;
    // SAFETY: `value` and `len` are live and `len` is its size; the fd is open.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&raw mut value).cast(),
            &raw mut len,
        )
    };
    if r == 0 {
        Ok(value)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Who is likely to hold UDP 4791 on this host, in words, for the error of a bind that
/// found it taken: Linux soft-RoCE (the `rdma_rxe` module, or an rxe device that `rdma
/// link` lists), else nothing more than the generic explanation.
pub(crate) fn port_holder_hint() -> String {
    let rxe_module = std::path::Path::new("/sys/module/rdma_rxe").exists();
    let rxe_link = || {
        std::process::Command::new("rdma")
            .arg("link")
            .stderr(std::process::Stdio::null())
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("rxe"))
    };
    if rxe_module || rxe_link() {
        "rdma_rxe owns UDP 4791 on this host (Linux soft-RoCE: remove its devices with \
         `rdma link delete rxe…` or unload the module, or bind another address)"
            .to_string()
    } else {
        "another process (or a kernel RoCE driver) has UDP port 4791 bound on this address: \
         only one RoCEv2 endpoint per address (see `ss -ulpn 'sport = :4791'`)"
            .to_string()
    }
}

impl UdpSocket {
    /// Binds an unconnected, non-blocking UDP socket with Don't Fragment set to `addr`
    /// (normally port [`ROCEV2_PORT`]; tests may bind port 0).
    ///
    /// # Errors
    /// [`Error::Io`]: the socket cannot be made or configured, or the address is taken —
    /// then the message names the likely holder ([`port_holder_hint`]).
    pub(crate) fn bind(addr: SocketAddr) -> Result<UdpSocket> {
        let family = match addr {
            SocketAddr::V4(_) => libc::AF_INET,
            SocketAddr::V6(_) => libc::AF_INET6,
        };
        // SAFETY: a plain system call; the result is checked.
        let raw = unsafe {
            libc::socket(
                family,
                libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        };
        if raw < 0 {
            return Err(Error::io(
                format!("creating a UDP socket for {addr}"),
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: `raw` is a new descriptor this function owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let opt = |what: &str, r: io::Result<()>| {
            r.map_err(|e| Error::io(format!("setting {what} on the UDP socket for {addr}"), e))
        };
        match addr {
            SocketAddr::V4(_) => opt(
                "IP_MTU_DISCOVER (Don't Fragment)",
                set_int(
                    &fd,
                    libc::IPPROTO_IP,
                    libc::IP_MTU_DISCOVER,
                    libc::IP_PMTUDISC_DO,
                ),
            )?,
            SocketAddr::V6(_) => {
                opt(
                    "IPV6_V6ONLY",
                    set_int(&fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1),
                )?;
                opt(
                    "IPV6_MTU_DISCOVER (Don't Fragment)",
                    set_int(
                        &fd,
                        libc::IPPROTO_IPV6,
                        libc::IPV6_MTU_DISCOVER,
                        libc::IPV6_PMTUDISC_DO,
                    ),
                )?
            }
        }
        // Every datagram read comes with its TOS / traffic class (its ECN bits).
        match addr {
            SocketAddr::V4(_) => opt(
                "IP_RECVTOS",
                set_int(&fd, libc::IPPROTO_IP, libc::IP_RECVTOS, 1),
            )?,
            SocketAddr::V6(_) => opt(
                "IPV6_RECVTCLASS",
                set_int(&fd, libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS, 1),
            )?,
        }
        // Room for bursts in flight: ask for SOCKET_BUFFER bytes each way (root may go past
        // the `rmem_max`/`wmem_max` caps; others get what the caps allow). Best effort.
        for (force, plain) in [
            (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
            (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
        ] {
            if set_int(&fd, libc::SOL_SOCKET, force, SOCKET_BUFFER).is_err() {
                let _ = set_int(&fd, libc::SOL_SOCKET, plain, SOCKET_BUFFER);
            }
        }
        let (ss, len) = to_raw(&addr);
        // SAFETY: `ss` holds an address of `len` bytes; the fd is open.
        let r = unsafe { libc::bind(fd.as_raw_fd(), (&raw const ss).cast(), len) };
        if r != 0 {
            let e = io::Error::last_os_error();
            let context = if e.raw_os_error() == Some(libc::EADDRINUSE) {
                format!("binding UDP {addr}: {}", port_holder_hint())
            } else {
                format!("binding UDP {addr}")
            };
            return Err(Error::io(context, e));
        }
        let mut ss_out: libc::sockaddr_storage =
            // SAFETY: plain old data, all zeroes valid.
            unsafe { std::mem::zeroed() };
        let mut len_out = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: `ss_out` has room for `len_out` bytes; the fd is open.
        let r = unsafe {
            libc::getsockname(fd.as_raw_fd(), (&raw mut ss_out).cast(), &raw mut len_out)
        };
        let local = if r == 0 {
            from_raw(&ss_out, len_out).unwrap_or(addr)
        } else {
            addr
        };
        Ok(UdpSocket { fd, local })
    }

    /// The address the socket is bound to (with the port the kernel chose for port 0).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Whether the TOS (IPv4) or traffic class (IPv6) of received datagrams is asked for
    /// (`IP_RECVTOS` / `IPV6_RECVTCLASS`).
    #[cfg(test)]
    pub(crate) fn receives_tos(&self) -> bool {
        match self.local {
            SocketAddr::V4(_) => {
                get_int(&self.fd, libc::IPPROTO_IP, libc::IP_RECVTOS).is_ok_and(|v| v == 1)
            }
            SocketAddr::V6(_) => {
                get_int(&self.fd, libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS).is_ok_and(|v| v == 1)
            }
        }
    }

    /// Whether Don't Fragment is set (the path-MTU-discovery mode is "do").
    #[cfg(test)]
    pub(crate) fn dont_fragment(&self) -> bool {
        match self.local {
            SocketAddr::V4(_) => get_int(&self.fd, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER)
                .is_ok_and(|v| v == libc::IP_PMTUDISC_DO),
            SocketAddr::V6(_) => get_int(&self.fd, libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER)
                .is_ok_and(|v| v == libc::IPV6_PMTUDISC_DO),
        }
    }

    /// Binds a socket that only sends, from `addr` (a QP's own source port): as
    /// [`UdpSocket::bind`], with the smallest receive buffer (nothing is read from it;
    /// RoCEv2 peers send to port 4791).
    ///
    /// # Errors
    /// As [`UdpSocket::bind`] (e.g. the port is taken on that address).
    pub(crate) fn bind_sender(addr: SocketAddr) -> Result<UdpSocket> {
        let s = UdpSocket::bind(addr)?;
        // A failure only leaves the default buffer: nothing to report.
        let _ = set_int(&s.fd, libc::SOL_SOCKET, libc::SO_RCVBUF, 1);
        Ok(s)
    }

    /// Asks the kernel to hand this socket a UDP GSO send whole (`UDP_GRO`): the datagrams
    /// of one GSO send — from a veth or loopback peer, which carry it uncut, or those a
    /// NIC's GRO merged — arrive as one message with their segment size
    /// ([`RxRing::segment`]) instead of being cut into one socket buffer each by the
    /// receiving socket, which cost about as much as a datagram's whole trip here. Needs a
    /// ring of [`GRO_BUFFER_BYTES`] buffers. Whether the kernel took it (Linux 5.0 on).
    pub(crate) fn enable_gro(&self) -> bool {
        set_int(&self.fd, libc::SOL_UDP, UDP_GRO, 1).is_ok()
    }

    /// Sends `bytes` to `to` as one GSO send of `segment`-byte datagrams (the last maybe
    /// shorter), from a buffer of any length (tests: a hostile peer's GSO sends).
    #[cfg(test)]
    pub(crate) fn send_segmented(
        &self,
        bytes: &[u8],
        segment: u16,
        to: SocketAddr,
    ) -> io::Result<usize> {
        set_int(&self.fd, libc::SOL_UDP, UDP_SEGMENT, i32::from(segment))?;
        let (ss, len) = to_raw(&to);
        // SAFETY: `bytes` and `ss` are live for the call, of the lengths given.
        let r = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                0,
                (&raw const ss).cast(),
                len,
            )
        };
        set_int(&self.fd, libc::SOL_UDP, UDP_SEGMENT, 0)?;
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as usize)
        }
    }

    /// Waits up to `timeout_ms` for a datagram to read; whether one is there.
    pub(crate) fn wait_readable(&self, timeout_ms: i32) -> bool {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd; a plain system call.
        let r = unsafe { libc::poll(&raw mut p, 1, timeout_ms) };
        r > 0 && p.revents & libc::POLLIN != 0
    }
}

/// What one [`TxBurst::send`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SendReport {
    /// Datagrams the kernel took.
    pub(crate) sent: usize,
    /// Of the messages that went, GSO sends of two datagrams or more.
    pub(crate) gso_sends: usize,
    /// Datagrams dropped because the kernel refused them for good (`EMSGSIZE`: larger than
    /// the path MTU with DF set; `EHOSTUNREACH`, `ENETUNREACH`, `EINVAL`…): lost, as on a
    /// wire; the transport retransmits.
    pub(crate) dropped: usize,
}

/// Datagrams staged for one `sendmmsg`: up to [`BURST`] buffers of [`DGRAM_BYTES`], each
/// with its length and destination.
pub(crate) struct TxBurst {
    bufs: Box<[u8]>,
    lens: [usize; BURST],
    dests: [SocketAddr; BURST],
    opts: [IpOpts; BURST],
    /// Which socket sends each datagram (0: the port's; `k`: the `k`th source-port socket).
    via: [u16; BURST],
    len: usize,
    /// Whether runs of datagrams go as one UDP GSO send each ([`TxBurst::send_via`]);
    /// turned off for good when the kernel or the device refuses it.
    gso: bool,
    /// The `sendmmsg` arrays, made with the burst: a send clears no 9 KB of them.
    msgs: Box<MsgArrays<CTRL_WORDS>>,
}

/// Most datagrams one GSO send carries (the kernel takes up to 64 or 128, by version).
const GSO_MAX_SEGS: usize = 64;
// A burst's run is never cut by the count of segments.
const _: () = assert!(GSO_MAX_SEGS >= BURST);
/// Most payload bytes one GSO send carries: under the 65,507 of one UDP datagram over
/// IPv4, whose length field the unsegmented send still has.
const GSO_MAX_BYTES: usize = 65_000;
/// `SOL_UDP`'s option and control message for UDP GSO (the segment size, a `u16`).
const UDP_SEGMENT: libc::c_int = 103;
/// `SOL_UDP`'s option for UDP GRO, and the control message that gives a merged message's
/// segment size (an `int`).
const UDP_GRO: libc::c_int = 104;

/// Bytes of one receive buffer of a socket with `UDP_GRO` on ([`UdpSocket::enable_gro`]):
/// room for the largest message the kernel hands it, a GSO send or a GRO merge of at
/// most 64 KiB with its headers.
pub(crate) const GRO_BUFFER_BYTES: usize = 65_536;
/// The most datagrams one message of a `UDP_GRO` socket carries (the kernel's
/// `UDP_GRO_CNT_MAX`; a GSO send of shmhca's carries at most [`BURST`]).
pub(crate) const GRO_MAX_SEGS: usize = 64;

/// The IP header fields a datagram is sent with: its TTL (IPv4) or hop limit (IPv6), and
/// its TOS (IPv4) or traffic class (IPv6) — the QP's `hop_limit` and `traffic_class`, as
/// `ibv_ah_attr.grh` gives them. 0 leaves the socket's default (TTL 64, TOS 0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct IpOpts {
    /// TTL or hop limit (0: the default).
    pub(crate) hop_limit: u8,
    /// TOS or traffic class (0: the default, 0).
    pub(crate) traffic_class: u8,
}

/// Control-message room for one message: two `int` options and a `u16` one, each taking
/// `CMSG_SPACE(4)` = the header and 8 bytes of aligned data (24 bytes on 64-bit Linux), in
/// 8-byte words for the alignment of `cmsghdr`. (A message with all three that had no room
/// for the last would leave without `UDP_SEGMENT`: its datagrams fused into one.)
const CTRL_WORDS: usize = 3 * (size_of::<libc::cmsghdr>() + 8).div_ceil(8);

impl Default for TxBurst {
    fn default() -> TxBurst {
        TxBurst::new()
    }
}

impl TxBurst {
    /// An empty burst (allocates its buffers once).
    pub(crate) fn new() -> TxBurst {
        TxBurst {
            bufs: vec![0u8; BURST * DGRAM_BYTES].into_boxed_slice(),
            lens: [0; BURST],
            dests: [SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)); BURST],
            opts: [IpOpts::default(); BURST],
            via: [0; BURST],
            len: 0,
            gso: true,
            msgs: MsgArrays::new(),
        }
    }

    /// Whether runs of datagrams go as GSO sends (see [`TxBurst::send_via`]).
    pub(crate) fn gso(&self) -> bool {
        self.gso
    }

    /// Turns GSO sends on or off.
    pub(crate) fn set_gso(&mut self, on: bool) {
        self.gso = on;
    }

    /// Whether a datagram staged goes by socket `via`.
    pub(crate) fn stages_via(&self, via: u16) -> bool {
        self.via[..self.len].contains(&via)
    }

    /// How many datagrams are staged.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether none is staged.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the burst is full.
    pub(crate) fn is_full(&self) -> bool {
        self.len == BURST
    }

    /// The next datagram's buffer ([`DGRAM_BYTES`] long), or `None` if the burst is full.
    /// [`TxBurst::commit`] stages what was written.
    pub(crate) fn next_buf(&mut self) -> Option<&mut [u8]> {
        if self.is_full() {
            return None;
        }
        let at = self.len * DGRAM_BYTES;
        Some(&mut self.bufs[at..at + DGRAM_BYTES])
    }

    /// Stages the first `len` bytes of the buffer [`TxBurst::next_buf`] returned, for
    /// `dest`. Ignored if the burst is full or `len` exceeds a buffer.
    #[cfg(test)]
    pub(crate) fn commit(&mut self, len: usize, dest: SocketAddr) {
        self.commit_with(len, dest, IpOpts::default(), 0);
    }

    /// [`TxBurst::commit`], sent with the IP header fields `opts` through socket `via` (see
    /// [`TxBurst::send_via`]).
    pub(crate) fn commit_with(&mut self, len: usize, dest: SocketAddr, opts: IpOpts, via: u16) {
        if self.is_full() || len > DGRAM_BYTES {
            debug_assert!(false, "commit without room");
            return;
        }
        self.lens[self.len] = len;
        self.dests[self.len] = dest;
        self.opts[self.len] = opts;
        self.via[self.len] = via;
        self.len += 1;
    }

    /// Sends the staged datagrams with `sendmmsg`, as many as the socket takes now; those
    /// it cannot take now (`EAGAIN`) stay staged, in order. A datagram the kernel refuses
    /// for good is dropped and counted.
    ///
    /// # UDP GSO
    ///
    /// A run of datagrams to one destination with the same IP options, all of one size but
    /// the last (which may be shorter), goes as one message of the `sendmmsg` with a
    /// `UDP_SEGMENT` control message: the kernel sends them as separate datagrams (a device
    /// that offloads UDP segmentation cuts them; veth and loopback carry them to the
    /// receiving socket whole and cut them there), but each passes the send path once. An
    /// Ack and the request behind it, or a message's packets, cost about one datagram's
    /// kernel work instead of one each: an 8-byte RC round trip over a veth pair went
    /// from 4 datagrams' cost to about 2.
    ///
    /// Linux numbers the segments of a DF send from an unconnected socket with the IPv4
    /// IDs 0, 1, 2, …, which the ICRC covers: segment `k`'s ICRC (computed with ID 0 by
    /// the encoder) is made the one with ID `k` before the send
    /// ([`shmhca_proto::roce::ipv4_id_delta`]), and back if it does not go that way. A
    /// GSO send the kernel refuses (`EIO`: the device cannot checksum it; `EINVAL`: a
    /// segment over the path MTU) is sent again datagram by datagram; `EIO` and
    /// `ENOPROTOOPT` turn GSO off for this burst for good. `SHMHCA_UDP_GSO=0` in the
    /// environment turns it off from the start (for a NIC whose segmentation offload would
    /// number the IDs otherwise).
    #[cfg(test)]
    pub(crate) fn send(&mut self, sock: &UdpSocket) -> SendReport {
        self.send_via(|_| sock)
    }

    /// [`TxBurst::send`] where each datagram leaves by the socket `sock(via)` of its
    /// `commit_with` (one `sendmmsg` per run of datagrams with the same socket).
    pub(crate) fn send_via<'s>(&mut self, sock: impl Fn(u16) -> &'s UdpSocket) -> SendReport {
        let mut report = SendReport::default();
        let mut at = 0;
        // Datagrams before this one go singly (their GSO send was refused).
        let mut single_until = 0;
        while at < self.len {
            let via = self.via[at];
            let sock = sock(via);
            let n = self.via[at..self.len]
                .iter()
                .take_while(|v| **v == via)
                .count();
            // The messages: runs of datagrams (GSO) or single ones, `segs[m]` each.
            let mut segs = [0usize; BURST];
            let mut msgs = 0;
            let mut d = 0;
            while d < n {
                let g = if at + d < single_until {
                    1
                } else {
                    self.gso_run(at + d, at + n)
                };
                segs[msgs] = g;
                msgs += 1;
                d += g;
            }
            self.toggle_segment_ids(at, &segs[..msgs]);
            let MsgArrays {
                hdrs,
                iovs,
                names,
                ctrl,
            } = &mut *self.msgs;
            let mut d = 0;
            for (m, &g) in segs[..msgs].iter().enumerate() {
                let i = at + d;
                let (ss, slen) = to_raw(&self.dests[i]);
                names[m] = ss;
                for (j, iov) in iovs[d..d + g].iter_mut().enumerate() {
                    let x = at + d + j;
                    *iov = libc::iovec {
                        iov_base: self.bufs[x * DGRAM_BYTES..].as_mut_ptr().cast(),
                        iov_len: self.lens[x],
                    };
                }
                hdrs[m].msg_hdr.msg_name = (&raw mut names[m]).cast();
                hdrs[m].msg_hdr.msg_namelen = slen;
                hdrs[m].msg_hdr.msg_iov = &raw mut iovs[d];
                hdrs[m].msg_hdr.msg_iovlen = g as _;
                let o = self.opts[i];
                let seg = if g > 1 { self.lens[i] as u16 } else { 0 };
                // (Sets or clears the message's control data: the arrays are reused.)
                write_ip_opts(&mut hdrs[m].msg_hdr, &mut ctrl[m], self.dests[i], o, seg);
                d += g;
            }
            // SAFETY: `hdrs[..msgs]` each point at a live address and at their `iovlen`
            // iovecs (consecutive, inside `iovs`) over live buffers of this burst of the
            // lengths given; the arrays outlive the call.
            let r = unsafe {
                libc::sendmmsg(
                    sock.fd.as_raw_fd(),
                    hdrs.as_mut_ptr(),
                    msgs as libc::c_uint,
                    libc::MSG_DONTWAIT,
                )
            };
            let done = if r > 0 { r as usize } else { 0 };
            let went: usize = segs[..done].iter().sum();
            report.gso_sends += segs[..done].iter().filter(|&&g| g > 1).count();
            // What did not go may go another way (or again): back to the ICRCs of ID 0.
            self.toggle_segment_ids(at + went, &segs[done..msgs]);
            if r > 0 {
                at += went;
                report.sent += went;
                continue;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) => break,
                Some(libc::EINTR) => continue,
                Some(errno) if segs[0] > 1 => {
                    // The GSO send was refused: its datagrams go one by one.
                    single_until = at + segs[0];
                    if matches!(errno, libc::EIO | libc::ENOPROTOOPT | libc::EOPNOTSUPP) {
                        self.gso = false;
                    }
                }
                _ => {
                    // The first datagram failed for good: drop it, go on with the rest.
                    at += 1;
                    report.dropped += 1;
                }
            }
        }
        // Keep what did not go, in order.
        if at < self.len {
            self.bufs
                .copy_within(at * DGRAM_BYTES..self.len * DGRAM_BYTES, 0);
            self.lens.copy_within(at..self.len, 0);
            self.dests.copy_within(at..self.len, 0);
            self.opts.copy_within(at..self.len, 0);
            self.via.copy_within(at..self.len, 0);
        }
        self.len -= at;
        report
    }
}

impl TxBurst {
    /// How many datagrams from `i` (before `end`, all of one socket) can go as one GSO
    /// send: those to the same destination with the same options, each as long as the
    /// first but the last, which may be shorter; 1 when GSO is off.
    fn gso_run(&self, i: usize, end: usize) -> usize {
        let size = self.lens[i];
        if !self.gso || size == 0 || size > usize::from(u16::MAX) {
            return 1;
        }
        let mut total = size;
        let mut j = i + 1;
        while j < end
            && j - i < GSO_MAX_SEGS
            && self.lens[j - 1] == size
            && self.lens[j] <= size
            && self.lens[j] > 0
            && total + self.lens[j] <= GSO_MAX_BYTES
            && self.dests[j] == self.dests[i]
            && self.opts[j] == self.opts[i]
        {
            total += self.lens[j];
            j += 1;
        }
        j - i
    }

    /// XORs into each IPv4 datagram of the GSO sends `segs` (from datagram `at` on) the
    /// difference between its ICRC with ID 0 and with the ID its segment gets, `k` for
    /// the `k`th: once to set them, once more to clear them.
    fn toggle_segment_ids(&mut self, at: usize, segs: &[usize]) {
        let mut d = at;
        for &g in segs {
            if g > 1 && self.dests[d].is_ipv4() {
                for k in 1..g {
                    let i = d + k;
                    let len = self.lens[i];
                    if len < 4 {
                        continue;
                    }
                    let delta = shmhca_proto::roce::ipv4_id_delta(k as u16, len - 4);
                    let icrc = &mut self.bufs[i * DGRAM_BYTES + len - 4..i * DGRAM_BYTES + len];
                    for (b, x) in icrc.iter_mut().zip(delta.to_le_bytes()) {
                        *b ^= x;
                    }
                }
            }
            d += g;
        }
    }
}

/// Points `msg`'s control data at `ctrl` and writes there the control messages that set
/// `opts` for a datagram to `dest`: `IP_TTL`/`IP_TOS` for IPv4, `IPV6_HOPLIMIT`/
/// `IPV6_TCLASS` for IPv6, each an `int`, only those that are not 0; and with `segment`
/// not 0, `UDP_SEGMENT` (a GSO send of datagrams of that size).
fn write_ip_opts(
    msg: &mut libc::msghdr,
    ctrl: &mut [u64; CTRL_WORDS],
    dest: SocketAddr,
    o: IpOpts,
    segment: u16,
) {
    let (level, ttl, tos) = match dest {
        SocketAddr::V4(_) => (libc::IPPROTO_IP, libc::IP_TTL, libc::IP_TOS),
        SocketAddr::V6(_) => (libc::IPPROTO_IPV6, libc::IPV6_HOPLIMIT, libc::IPV6_TCLASS),
    };
    // (level, name, value, whether the value is a `u16` rather than an `int`)
    let opts = [
        (level, ttl, u16::from(o.hop_limit), false),
        (level, tos, u16::from(o.traffic_class), false),
        (libc::SOL_UDP, UDP_SEGMENT, segment, true),
    ];
    msg.msg_control = ctrl.as_mut_ptr().cast();
    msg.msg_controllen = size_of::<[u64; CTRL_WORDS]>() as _;
    // SAFETY: pure arithmetic on a constant (the macro is `unsafe` only by declaration).
    let space = unsafe { libc::CMSG_SPACE(size_of::<i32>() as u32) };
    let mut used = 0usize;
    // SAFETY: `msg_control` points at `ctrl`, 8-byte aligned and `msg_controllen` long.
    let mut c = unsafe { libc::CMSG_FIRSTHDR(msg) };
    for (level, name, v, short) in opts {
        if v == 0 {
            continue;
        }
        if c.is_null() || used + space as usize > size_of::<[u64; CTRL_WORDS]>() {
            break;
        }
        let size = if short {
            size_of::<u16>()
        } else {
            size_of::<i32>()
        };
        // SAFETY: pure arithmetic (as above).
        let len = unsafe { libc::CMSG_LEN(size as u32) };
        // SAFETY: a non-null header from CMSG_FIRSTHDR/CMSG_NXTHDR lies inside `ctrl` with
        // room for CMSG_SPACE(4) bytes (checked just above; CMSG_SPACE(2) is no more);
        // nothing else refers to it.
        let h = unsafe { &mut *c };
        h.cmsg_level = level;
        h.cmsg_type = name;
        h.cmsg_len = len as _;
        // SAFETY: the data of that header, inside `ctrl`, `size` bytes long (`cmsg_len`).
        let data = unsafe { libc::CMSG_DATA(c) };
        if short {
            // SAFETY: `data` is valid for 2 bytes (above); unaligned write.
            unsafe { std::ptr::write_unaligned(data.cast::<u16>(), v) };
        } else {
            // SAFETY: `data` is valid for 4 bytes (above); unaligned write.
            unsafe { std::ptr::write_unaligned(data.cast::<i32>(), i32::from(v)) };
        }
        used += space as usize;
        // SAFETY: `c` is a header of `msg`'s control data with its length set.
        c = unsafe { libc::CMSG_NXTHDR(msg, c) };
    }
    msg.msg_controllen = used as _;
    if used == 0 {
        msg.msg_control = std::ptr::null_mut();
    }
}

/// Control-message room for one received datagram, in 8-byte words (for the alignment of
/// `cmsghdr`): the one message asked for (`IP_TOS`, 1 byte, or `IPV6_TCLASS`, an `int`:
/// `CMSG_SPACE` of 16 bytes either way) with room to spare. A longer control message
/// list is cut by the kernel (`MSG_CTRUNC`), and what is cut is not read.
const RX_CTRL_WORDS: usize = 8;

/// The ECN field of an IP TOS or traffic class byte (its two low bits; RFC 3168).
pub(crate) const ECN_MASK: u8 = 0b11;
/// The ECN codepoint "Congestion Experienced": a router on the way marked the datagram.
pub(crate) const ECN_CE: u8 = 0b11;

/// Whether a datagram with TOS / traffic class `tos` was marked Congestion Experienced.
pub(crate) fn is_ce(tos: u8) -> bool {
    tos & ECN_MASK == ECN_CE
}

/// The TOS (IPv4, `IP_TOS`) or traffic class (IPv6, `IPV6_TCLASS`) in the control data
/// `ctrl` the kernel wrote for a received datagram (exactly the `msg_controllen` bytes it
/// reported), if there is such a message, whole and of a valid length: `IP_TOS` carries
/// one byte (Linux) or an `int` (other systems), `IPV6_TCLASS` an `int`; an `int` outside
/// 0..=255 is refused. Every header is checked against the buffer before it is read, so
/// any bytes give an answer, never an out-of-bounds read: a missing or odd message is
/// `None` (then the datagram counts as not marked).
pub(crate) fn received_tos(ctrl: &[u8]) -> Option<u8> {
    let int_byte = |d: &[u8]| -> Option<u8> {
        let v = i32::from_ne_bytes(d.try_into().ok()?);
        u8::try_from(v).ok()
    };
    let (kind, data) = control_message(ctrl, |kind| {
        matches!(
            kind,
            (libc::IPPROTO_IP, libc::IP_TOS) | (libc::IPPROTO_IPV6, libc::IPV6_TCLASS)
        )
    })?;
    match (kind, data.len()) {
        ((libc::IPPROTO_IP, _), 1) => Some(data[0]),
        (_, 4) => int_byte(data),
        _ => None,
    }
}

/// The segment size of a message the kernel merged (`UDP_GRO`'s control message, an
/// `int`) in the control data `ctrl` it wrote for it (exactly the `msg_controllen` bytes
/// it reported), if there is one, whole, of a valid length and from 1 to 65,535; checked
/// as [`received_tos`] checks. `None`: the message is one datagram.
pub(crate) fn received_segment(ctrl: &[u8]) -> Option<u16> {
    let (_, data) = control_message(ctrl, |kind| kind == (libc::SOL_UDP, UDP_GRO))?;
    let v = i32::from_ne_bytes(data.try_into().ok()?);
    u16::try_from(v).ok().filter(|&v| v > 0)
}

/// The first control message in `ctrl` (exactly the `msg_controllen` bytes the kernel
/// reported) whose level and type `wanted` accepts: those and its data. Every header is
/// checked against the buffer before it is read, so any bytes give an answer, never an
/// out-of-bounds read; a header whose length does not fit ends the walk with `None`.
fn control_message(
    ctrl: &[u8],
    wanted: impl Fn((libc::c_int, libc::c_int)) -> bool,
) -> Option<((libc::c_int, libc::c_int), &[u8])> {
    const HDR: usize = size_of::<libc::cmsghdr>();
    // CMSG_ALIGN: the kernel aligns each message (and its data) to a `size_t`.
    let align = |n: usize| n.checked_next_multiple_of(size_of::<usize>());
    let data_at = align(HDR)?;
    let mut at = 0usize;
    while let Some(h) = ctrl.get(at..at.checked_add(HDR)?) {
        // SAFETY: `h` is `HDR` initialized bytes, the size of a `cmsghdr`, whose fields
        // are all integers (any bits are a valid value); the read is unaligned.
        let hdr: libc::cmsghdr = unsafe { std::ptr::read_unaligned(h.as_ptr().cast()) };
        #[allow(clippy::unnecessary_cast)] // `size_t` on glibc, `socklen_t` on musl
        let len = hdr.cmsg_len as usize;
        // The message's length covers its header and lies inside what the kernel wrote.
        if len < data_at || len > ctrl.len() - at {
            return None;
        }
        let kind = (hdr.cmsg_level, hdr.cmsg_type);
        if wanted(kind) {
            return Some((kind, &ctrl[at + data_at..at + len]));
        }
        at = at.checked_add(align(len)?)?;
    }
    None
}

/// A ring of receive buffers in one [`Mem`]: `count` buffers of [`DGRAM_BYTES`] (or of
/// [`GRO_BUFFER_BYTES`], for a socket with `UDP_GRO` on), filled in order by
/// [`RxRing::recv`], one datagram — or one message the kernel merged — each. The caller
/// decides when a buffer may be filled again (it passes how many are free); buffer `i` is
/// at offset `i` times the buffer size of [`RxRing::mem`].
pub(crate) struct RxRing {
    mem: Mem,
    count: usize,
    /// Bytes of each buffer ([`DGRAM_BYTES`], or [`GRO_BUFFER_BYTES`] for a socket with
    /// `UDP_GRO` on).
    bytes: usize,
    /// The next buffer to fill (a count that only grows; the index is `next % count`).
    next: u64,
    /// Per buffer: the datagram's length (0: truncated, or not a datagram) and source.
    lens: Box<[u32]>,
    srcs: Box<[Option<SocketAddr>]>,
    /// Per buffer: the datagram's IP TOS / traffic class (0 if the kernel gave none).
    tos: Box<[u8]>,
    /// Per buffer: the segment size of a message the kernel merged (`UDP_GRO`), 0 for
    /// one datagram.
    segs: Box<[u16]>,
    /// The `recvmmsg` arrays (a control buffer per datagram among them), made with the
    /// ring: an empty poll clears no 8 KB of them.
    msgs: Box<MsgArrays<RX_CTRL_WORDS>>,
    /// `(next, n)` when the first `n` entries of `msgs` are set up for filling the buffers
    /// from `next` on and no call has changed them since: a `recvmmsg` that found nothing
    /// writes none of them back, so the next empty poll sets up nothing.
    prepared: Option<(u64, usize)>,
}

/// The message headers, iovecs, address buffers and control buffers (`W` words each) of
/// one `sendmmsg` or `recvmmsg` of up to [`BURST`] messages, made once with their
/// [`TxBurst`] or [`RxRing`]: each call sets the fields it needs of the entries it passes,
/// so a call clears no kilobytes of arrays first.
struct MsgArrays<const W: usize> {
    hdrs: [libc::mmsghdr; BURST],
    iovs: [libc::iovec; BURST],
    names: [libc::sockaddr_storage; BURST],
    ctrl: [[u64; W]; BURST],
}

// SAFETY: the raw pointers in `hdrs` and `iovs` point into the arrays' own box or into
// their owner's buffers (set by `TxBurst::send_via` before each call, by `RxRing::new` and
// `RxRing::recv`), and only the kernel follows them, within a call made by their owner;
// between calls no one reads them. Moving the arrays to another thread with their owner
// is sound.
unsafe impl<const W: usize> Send for MsgArrays<W> {}

impl<const W: usize> MsgArrays<W> {
    fn new() -> Box<MsgArrays<W>> {
        // SAFETY: plain old data (integers and raw pointers), all zeroes valid.
        Box::new(unsafe { std::mem::zeroed() })
    }
}

impl RxRing {
    /// A ring of `count` buffers (at least [`BURST`]) of [`DGRAM_BYTES`].
    pub(crate) fn new(count: usize) -> RxRing {
        RxRing::with_buffers(count, DGRAM_BYTES)
    }

    /// A ring of `count` buffers (at least [`BURST`]) of `bytes` each (a multiple of 64:
    /// [`GRO_BUFFER_BYTES`] for a socket with `UDP_GRO` on).
    pub(crate) fn with_buffers(count: usize, bytes: usize) -> RxRing {
        let count = count.max(BURST);
        let bytes = bytes.next_multiple_of(64);
        let mut msgs = MsgArrays::<RX_CTRL_WORDS>::new();
        // What does not change between calls: each entry's address buffer, its one iovec
        // of a buffer's length, its control buffer. (The arrays are boxed: these pointers
        // stay valid wherever the ring moves.)
        let MsgArrays {
            hdrs,
            iovs,
            names,
            ctrl,
        } = &mut *msgs;
        for (k, ctrl) in ctrl.iter_mut().enumerate() {
            iovs[k].iov_len = bytes;
            let h = &mut hdrs[k].msg_hdr;
            h.msg_name = (&raw mut names[k]).cast();
            h.msg_iov = &raw mut iovs[k];
            h.msg_iovlen = 1;
            h.msg_control = ctrl.as_mut_ptr().cast();
        }
        RxRing {
            mem: Mem::private(count * bytes),
            count,
            bytes,
            next: 0,
            lens: vec![0; count].into_boxed_slice(),
            srcs: vec![None; count].into_boxed_slice(),
            tos: vec![0; count].into_boxed_slice(),
            segs: vec![0; count].into_boxed_slice(),
            msgs,
            prepared: None,
        }
    }

    /// The buffers' memory (shared with the engine, which reads payloads from it).
    pub(crate) fn mem(&self) -> &Mem {
        &self.mem
    }

    /// Bytes of each buffer.
    pub(crate) fn buffer_bytes(&self) -> usize {
        self.bytes
    }

    /// How many buffers the ring has.
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// The number of the next buffer to fill (a count that only grows).
    pub(crate) fn next(&self) -> u64 {
        self.next
    }

    /// Receives up to `max` (and at most [`BURST`]) datagrams into the next buffers with
    /// one `recvmmsg`; returns how many (0 when none is waiting). Datagram number `n`
    /// (counted as [`RxRing::next`] counts) is then at [`RxRing::datagram`]`(n)`.
    ///
    /// # Errors
    /// The socket failed otherwise than with nothing to read.
    pub(crate) fn recv(&mut self, sock: &UdpSocket, max: usize) -> io::Result<usize> {
        let n = max.min(BURST).min(self.count);
        if n == 0 {
            return Ok(0);
        }
        // The ring's buffers, checked once: buffer `i` is `bytes` at `i * bytes`.
        let Ok(ring) = self.mem.writable_range(0, (self.count * self.bytes) as u64) else {
            return Ok(0); // cannot be: the memory holds `count` buffers
        };
        let first = (self.next % self.count as u64) as usize;
        let MsgArrays {
            hdrs,
            iovs,
            names,
            ctrl,
        } = &mut *self.msgs;
        let ready = self
            .prepared
            .is_some_and(|(next, m)| next == self.next && m >= n);
        let todo = if ready { 0 } else { n };
        for (k, h) in hdrs.iter_mut().enumerate().take(todo) {
            let i = (first + k) % self.count;
            // In the range checked above (`i < count`).
            iovs[k].iov_base = ring.wrapping_add(i * self.bytes).cast();
            // The fields the kernel writes back (the pointers were set by `new`; `msg_len`
            // it only writes).
            let h = &mut h.msg_hdr;
            h.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            h.msg_controllen = size_of::<[u64; RX_CTRL_WORDS]>() as _;
            h.msg_flags = 0;
        }
        if !ready {
            self.prepared = Some((self.next, n));
        }
        let r = loop {
            // SAFETY: `hdrs[..n]` each point at a live address buffer, one iovec over a
            // checked, writable range of the ring's memory (alive while `self.mem` is),
            // which the kernel fills with plain bytes, and a control buffer of the ring's
            // (8-byte aligned, of the length given): `new` pointed them into the boxed
            // arrays, which have not moved, and the loop above or an earlier call that
            // changed nothing (`prepared`) set the rest; the arrays outlive the call.
            let r = unsafe {
                libc::recvmmsg(
                    sock.fd.as_raw_fd(),
                    hdrs.as_mut_ptr(),
                    n as libc::c_uint,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            };
            if r >= 0 {
                // The kernel wrote back the entries it filled (lengths, flags): set up
                // again next time.
                self.prepared = None;
                break r as usize;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) => return Ok(0),
                _ => {
                    self.prepared = None;
                    return Err(e);
                }
            }
        };
        for (k, h) in hdrs.iter().enumerate().take(r) {
            let i = (first + k) % self.count;
            let truncated = h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0;
            self.lens[i] = if truncated {
                0
            } else {
                h.msg_len.min(self.bytes as u32)
            };
            self.srcs[i] = from_raw(&names[k], h.msg_hdr.msg_namelen);
            // What the kernel says it wrote, never more than the buffer.
            let ctrl: &[u8] = bytemuck::cast_slice(&ctrl[k][..]);
            #[allow(clippy::unnecessary_cast)] // `size_t` on glibc, `socklen_t` on musl
            let clen = (h.msg_hdr.msg_controllen as usize).min(ctrl.len());
            self.tos[i] = received_tos(&ctrl[..clen]).unwrap_or(0);
            self.segs[i] = received_segment(&ctrl[..clen]).unwrap_or(0);
        }
        self.next += r as u64;
        Ok(r)
    }

    /// The IP TOS (IPv4) or traffic class (IPv6) datagram number `n` arrived with (0 if
    /// the kernel gave none, or an odd one); its two low bits are the ECN field.
    pub(crate) fn tos(&self, n: u64) -> u8 {
        self.tos[(n % self.count as u64) as usize]
    }

    /// The segment size of datagram number `n` if it is a message the kernel merged
    /// (`UDP_GRO`: datagrams of that size but the last, back to back), else 0.
    pub(crate) fn segment(&self, n: u64) -> usize {
        usize::from(self.segs[(n % self.count as u64) as usize])
    }

    /// Where datagram number `n` is: its offset in [`RxRing::mem`], its length (0 if it
    /// was truncated) and its source.
    pub(crate) fn datagram(&self, n: u64) -> (u64, usize, Option<SocketAddr>) {
        let i = (n % self.count as u64) as usize;
        ((i * self.bytes) as u64, self.lens[i] as usize, self.srcs[i])
    }
}

/// Test helpers that need a network namespace (root): a named namespace made and removed
/// by the test, a thread run inside one, and an `AF_PACKET` capture that reads IPv4
/// headers off an interface. Kept in this module because they need `unsafe` (`setns`, a
/// packet socket).
#[cfg(test)]
pub(crate) mod netns {
    use super::*;
    use std::time::{Duration, Instant};

    /// Whether network namespaces can be made here (root, and `ip` present); prints one
    /// line naming the test when not, or fails it when `SHMHCA_REQUIRE_NETNS=1` (set by
    /// `.ci/run`).
    pub(crate) fn available(test: &str) -> bool {
        // SAFETY: a plain system call.
        let root = unsafe { libc::geteuid() } == 0;
        let ip = std::process::Command::new("ip").arg("-V").output().is_ok();
        if std::env::var_os("SHMHCA_REQUIRE_NETNS").is_some_and(|v| v == "1") && !(root && ip) {
            panic!(
                "{test}: needs root and the `ip` command for network namespaces, and SHMHCA_REQUIRE_NETNS=1 requires them"
            );
        }
        if !(root && ip) {
            eprintln!("{test}: skipped (needs root and the `ip` command for network namespaces)");
        }
        root && ip
    }

    /// Runs `ip ARGS`; an error with its output if it fails.
    pub(crate) fn ip(args: &[&str]) -> std::result::Result<(), String> {
        let out = std::process::Command::new("ip")
            .args(args)
            .output()
            .map_err(|e| format!("ip {args:?}: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "ip {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// A named network namespace, deleted on drop (with the interfaces in it).
    pub(crate) struct Netns(pub(crate) String);

    impl Netns {
        /// Makes namespace `name` (deleting a stale one of that name first) with its
        /// loopback up.
        pub(crate) fn new(name: &str) -> std::result::Result<Netns, String> {
            let _ = ip(&["netns", "del", name]);
            ip(&["netns", "add", name])?;
            let ns = Netns(name.to_string());
            ip(&["-n", name, "link", "set", "lo", "up"])?;
            Ok(ns)
        }

        /// Runs `f` on a thread that has entered this namespace; its result.
        pub(crate) fn run<T: Send>(
            &self,
            f: impl FnOnce() -> T + Send,
        ) -> std::result::Result<T, String> {
            let path = format!("/run/netns/{}", self.0);
            std::thread::scope(|s| {
                s.spawn(|| {
                    enter(&path)?;
                    Ok(f())
                })
                .join()
                .map_err(|_| "the thread in the namespace panicked".to_string())?
            })
        }
    }

    impl Drop for Netns {
        fn drop(&mut self) {
            let _ = ip(&["netns", "del", &self.0]);
        }
    }

    /// Moves the calling thread into the network namespace at `path`.
    fn enter(path: &str) -> std::result::Result<(), String> {
        let f = std::fs::File::open(path).map_err(|e| format!("{path}: {e}"))?;
        // SAFETY: a plain system call on a live descriptor; it changes only this thread's
        // network namespace.
        let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        if r == 0 {
            Ok(())
        } else {
            Err(format!("setns {path}: {}", io::Error::last_os_error()))
        }
    }

    /// Runs `f` in a fresh namespace called `name` (made and removed here).
    pub(crate) fn in_fresh_netns<T: Send>(
        name: &str,
        f: impl FnOnce() -> T + Send,
    ) -> std::result::Result<T, String> {
        let ns = Netns::new(&format!("{name}-{}", std::process::id()))?;
        ns.run(f)
    }

    /// An `AF_PACKET` socket reading the IPv4 packets of one interface (network layer up).
    pub(crate) struct PacketCapture(OwnedFd);

    impl PacketCapture {
        /// Opens a capture of the IPv4 packets on interface `ifname` (of the calling
        /// thread's namespace).
        pub(crate) fn open(ifname: &str) -> io::Result<PacketCapture> {
            let name = std::ffi::CString::new(ifname).map_err(io::Error::other)?;
            // SAFETY: a NUL-terminated name; a plain system call.
            let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
            if index == 0 {
                return Err(io::Error::last_os_error());
            }
            let proto = (libc::ETH_P_IP as u16).to_be();
            // SAFETY: a plain system call; the result is checked.
            let raw = unsafe {
                libc::socket(
                    libc::AF_PACKET,
                    libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                    i32::from(proto),
                )
            };
            if raw < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: a new descriptor owned here.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            // SAFETY: plain old data, all zeroes valid.
            let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = proto;
            sll.sll_ifindex = index as i32;
            // SAFETY: a live `sockaddr_ll` of the size given.
            let r = unsafe {
                libc::bind(
                    fd.as_raw_fd(),
                    (&raw const sll).cast(),
                    size_of::<libc::sockaddr_ll>() as libc::socklen_t,
                )
            };
            if r != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(PacketCapture(fd))
        }

        /// The first `want` IPv4 UDP packets to destination port `port` captured (from
        /// their IP header on), within `within`.
        pub(crate) fn ipv4_udp_packets(
            &self,
            port: u16,
            want: usize,
            within: Duration,
        ) -> Vec<Vec<u8>> {
            let mut out = Vec::new();
            let mut buf = [0u8; 2048];
            let end = Instant::now() + within;
            while out.len() < want && Instant::now() < end {
                // SAFETY: a live buffer of the length given.
                let r = unsafe {
                    libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0)
                };
                if r < 0 {
                    let mut p = libc::pollfd {
                        fd: self.0.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: one live pollfd.
                    unsafe { libc::poll(&raw mut p, 1, 10) };
                    continue;
                }
                let p = &buf[..r as usize];
                if p.len() >= 28 && p[0] >> 4 == 4 && p[9] == 17 {
                    let ihl = usize::from(p[0] & 15) * 4;
                    if p.len() >= ihl + 8 && u16::from_be_bytes([p[ihl + 2], p[ihl + 3]]) == port {
                        out.push(p.to_vec());
                    }
                }
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(ip: &str) -> UdpSocket {
        UdpSocket::bind(SocketAddr::new(ip.parse().unwrap(), 0)).unwrap()
    }

    /// Sends `count` datagrams of `size` bytes (byte `j` of datagram `i` is `i + j`) from
    /// `a` to `b` in bursts, receives them into a ring of `ring` buffers, checks each.
    fn round_trip(a: &UdpSocket, b: &UdpSocket, count: usize, size: usize, ring: usize) {
        let mut tx = TxBurst::new();
        // Arbitrary bytes, not RoCEv2 datagrams: no GSO, whose segments' ICRCs it adjusts.
        tx.gso = false;
        let mut rx = RxRing::new(ring);
        let mut sent = 0;
        let mut got = 0;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while got < count {
            assert!(
                std::time::Instant::now() < deadline,
                "{got}/{count} received"
            );
            // At most one half-burst ahead of the receiver: without root, the socket
            // buffer stays at the system's cap, and a full one drops (as a wire would).
            while sent < count && sent < got + BURST / 2 && !tx.is_full() {
                let buf = tx.next_buf().unwrap();
                for (j, byte) in buf[..size].iter_mut().enumerate() {
                    *byte = (sent + j) as u8;
                }
                tx.commit(size, b.local_addr());
                sent += 1;
            }
            let r = tx.send(a);
            assert_eq!(r.dropped, 0);
            // Receive what is free in the ring (everything, as it is read at once).
            let first = rx.next();
            let n = rx.recv(b, rx.count()).unwrap();
            for d in first..first + n as u64 {
                let (off, len, src) = rx.datagram(d);
                assert_eq!(len, size);
                assert_eq!(src, Some(a.local_addr()));
                let mut bytes = vec![0u8; len];
                rx.mem().read(off, &mut bytes).unwrap();
                for (j, byte) in bytes.iter().enumerate() {
                    assert_eq!(*byte, (got + j) as u8, "datagram {got} byte {j}");
                }
                got += 1;
            }
            if n == 0 {
                b.wait_readable(10);
            }
        }
    }

    #[test]
    fn a_socket_is_nonblocking_with_dont_fragment_set_ipv4_and_ipv6() {
        for ip in ["127.0.0.1", "::1"] {
            let s = bound(ip);
            assert!(s.dont_fragment(), "{ip}");
            assert_ne!(s.local_addr().port(), 0);
            // Nothing to read: returns at once.
            let mut rx = RxRing::new(BURST);
            assert_eq!(rx.recv(&s, BURST).unwrap(), 0);
            assert_eq!(s.local_addr().is_ipv4(), ip.contains('.'));
        }
    }

    #[test]
    fn bursts_cross_loopback_whole_and_in_order_ipv4_and_ipv6() {
        for (x, y) in [("127.0.0.1", "127.0.0.2"), ("::1", "::1")] {
            let (a, b) = (bound(x), bound(y));
            // Across the ring's wrap several times, sizes from empty to a full buffer.
            for size in [0, 1, 13, 1500, DGRAM_BYTES] {
                round_trip(&a, &b, 200, size, BURST * 2);
            }
        }
    }

    #[test]
    fn a_datagram_longer_than_a_buffer_is_reported_truncated() {
        let (a, b) = (bound("127.0.0.1"), bound("127.0.0.1"));
        let big = vec![7u8; DGRAM_BYTES + 100];
        // A plain std socket sends the oversized datagram (loopback's MTU is 64 KiB).
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        s.send_to(&big, b.local_addr()).unwrap();
        let mut tx = TxBurst::new();
        tx.next_buf().unwrap()[..4].copy_from_slice(b"good");
        tx.commit(4, b.local_addr());
        assert_eq!(tx.send(&a).sent, 1);
        let mut rx = RxRing::new(BURST);
        let mut lens = Vec::new();
        for _ in 0..100 {
            let first = rx.next();
            let n = rx.recv(&b, BURST).unwrap();
            lens.extend((first..first + n as u64).map(|d| rx.datagram(d).1));
            if lens.len() == 2 {
                break;
            }
            b.wait_readable(10);
        }
        assert_eq!(lens, [0, 4], "the oversized one reads as length 0");
    }

    /// With DF set, a datagram over the interface MTU is refused (`EMSGSIZE`), counted as
    /// dropped, and the datagrams behind it still go: loopback's MTU lowered to 1280 in a
    /// namespace of the test's own (root only).
    #[test]
    fn a_datagram_over_the_path_mtu_is_dropped_not_fragmented() {
        if !super::netns::available("a_datagram_over_the_path_mtu_is_dropped_not_fragmented") {
            return;
        }
        let ns = super::netns::Netns::new(&format!("shmhca-mtu-{}", std::process::id())).unwrap();
        super::netns::ip(&["-n", &ns.0, "link", "set", "lo", "mtu", "1280"]).unwrap();
        let (report, lens) = ns
            .run(|| {
                let (a, b) = (bound("127.0.0.1"), bound("127.0.0.1"));
                let mut tx = TxBurst::new();
                for len in [100, 4000, 200] {
                    tx.next_buf().unwrap();
                    tx.commit(len, b.local_addr());
                }
                let report = tx.send(&a);
                let mut rx = RxRing::new(BURST);
                let mut lens = Vec::new();
                for _ in 0..100 {
                    let first = rx.next();
                    let n = rx.recv(&b, BURST).unwrap();
                    lens.extend((first..first + n as u64).map(|d| rx.datagram(d).1));
                    if lens.len() >= 2 {
                        break;
                    }
                    b.wait_readable(10);
                }
                (report, lens)
            })
            .unwrap();
        assert_eq!(
            report,
            SendReport {
                sent: 2,
                gso_sends: 0,
                dropped: 1
            },
            "the GSO send of 4000 and 200 bytes was refused and sent again singly"
        );
        assert_eq!(lens, [100, 200]);
    }

    #[test]
    fn binding_a_taken_address_names_the_holder() {
        let a = UdpSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let err = UdpSocket::bind(a.local_addr()).unwrap_err().to_string();
        assert!(
            err.contains("rdma_rxe owns UDP 4791") || err.contains("another process"),
            "{err}"
        );
        assert!(err.contains(&a.local_addr().to_string()), "{err}");
    }

    /// The IP ID Linux puts on a DF datagram from an unconnected socket, read off the wire
    /// with an `AF_PACKET` socket, in a network namespace of the test's own (root only):
    /// 0 for a datagram sent alone; 0, 1, 2, … for the segments of one GSO send. The
    /// capture sees the segments because loopback's `gso_max_segs` is 1 there (the kernel
    /// cuts a GSO send before the device, as for a NIC without UDP segmentation offload),
    /// and each segment's ICRC holds with the ID it got.
    #[test]
    fn the_kernel_sends_ip_id_zero_for_df_datagrams_and_counts_gso_segments() {
        let name = "the_kernel_sends_ip_id_zero_for_df_datagrams_and_counts_gso_segments";
        if !super::netns::available(name) {
            return;
        }
        let ns = super::netns::Netns::new(&format!("shmhca-ipid-{}", std::process::id())).unwrap();
        super::netns::ip(&["-n", &ns.0, "link", "set", "lo", "gso_max_segs", "1"]).unwrap();
        let (src, dst): (SocketAddr, SocketAddr) = (
            "127.0.0.1:4791".parse().unwrap(),
            "127.0.0.2:4791".parse().unwrap(),
        );
        let (singly, gso) = ns
            .run(|| {
                let a = UdpSocket::bind(src).unwrap();
                let _b = UdpSocket::bind(dst).unwrap();
                let cap = super::netns::PacketCapture::open("lo").unwrap();
                let mut sent = Vec::new();
                for gso in [false, true] {
                    let mut tx = TxBurst::new();
                    tx.gso = gso;
                    for i in 0..8u8 {
                        let len = roce_datagram(tx.next_buf().unwrap(), i, 20, src, dst);
                        tx.commit(len, dst);
                    }
                    assert_eq!(tx.send(&a).sent, 8, "gso {gso}");
                    sent.push(cap.ipv4_udp_packets(4791, 8, std::time::Duration::from_secs(5)));
                }
                (sent.remove(0), sent.remove(0))
            })
            .unwrap();
        let (SocketAddr::V4(s4), SocketAddr::V4(d4)) = (src, dst) else {
            unreachable!()
        };
        for (packets, ids) in [(singly, [0u16; 8]), (gso, [0, 1, 2, 3, 4, 5, 6, 7])] {
            let got: Vec<(u16, u16)> = packets
                .iter()
                .map(|p| {
                    let id = u16::from_be_bytes([p[4], p[5]]);
                    let flags = u16::from_be_bytes([p[6], p[7]]) & 0x4000;
                    // The ICRC holds with the ID on the wire.
                    assert!(
                        shmhca_proto::roce::check_v4(s4, d4, id, &p[28..]).is_ok(),
                        "ICRC of the segment with ID {id}"
                    );
                    (id, flags)
                })
                .collect();
            let want: Vec<(u16, u16)> = ids.iter().map(|&i| (i, 0x4000)).collect();
            assert_eq!(got, want, "(IP ID, DF) of each datagram");
        }
    }

    /// A RoCEv2 datagram from `src` to `dst` in `buf`: a Send Only of `payload` bytes of
    /// `tag` and its ICRC with IP ID 0 (as the encoder writes them); returns its length.
    fn roce_datagram(
        buf: &mut [u8],
        tag: u8,
        payload: usize,
        src: SocketAddr,
        dst: SocketAddr,
    ) -> usize {
        let transport = 12 + payload;
        buf[..transport].fill(tag);
        buf[0] = 0x04; // Send Only
        buf[1] = 0; // no pad
        match (src, dst) {
            (SocketAddr::V4(s), SocketAddr::V4(d)) => {
                shmhca_proto::roce::append_icrc_v4(s, d, 0, buf, transport).unwrap()
            }
            (SocketAddr::V6(s), SocketAddr::V6(d)) => {
                shmhca_proto::roce::append_icrc_v6(s, d, buf, transport).unwrap()
            }
            _ => unreachable!("one family"),
        }
    }

    /// Datagrams of one size (the last shorter) to one destination go as one GSO send and
    /// arrive as separate datagrams, in order, each with an ICRC that holds with the IPv4
    /// ID its segment got (here the receiving socket cuts the send; the receiver solves
    /// for the ID, as shmhca's does, and finds 0, 1, 2, …); IPv6 has no ID.
    #[test]
    fn a_run_of_datagrams_goes_as_one_gso_send_with_each_icrc_right() {
        for (x, y) in [("127.0.0.1", "127.0.0.2"), ("::1", "::1")] {
            let (a, b) = (bound(x), bound(y));
            let (src, dst) = (a.local_addr(), b.local_addr());
            let mut tx = TxBurst::new();
            let sizes = [40, 40, 40, 40, 24];
            // With a TTL and a TOS too: three control messages.
            let opts = IpOpts {
                hop_limit: 17,
                traffic_class: 0x68,
            };
            for (i, &p) in sizes.iter().enumerate() {
                let len = roce_datagram(tx.next_buf().unwrap(), i as u8, p, src, dst);
                tx.commit_with(len, dst, opts, 0);
            }
            assert_eq!(tx.gso_run(0, sizes.len()), sizes.len(), "one run");
            assert_eq!(tx.send(&a).sent, sizes.len());
            let mut rx = RxRing::new(BURST);
            let mut got = Vec::new();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while got.len() < sizes.len() {
                assert!(std::time::Instant::now() < deadline, "received {got:?}");
                let first = rx.next();
                let n = rx.recv(&b, BURST).unwrap();
                for d in first..first + n as u64 {
                    let (off, len, from) = rx.datagram(d);
                    assert_eq!(from, Some(src));
                    let mut bytes = vec![0u8; len];
                    rx.mem().read(off, &mut bytes).unwrap();
                    let id = match (src, dst) {
                        (SocketAddr::V4(s), SocketAddr::V4(d)) => {
                            shmhca_proto::roce::check_v4_unknown_id(s, d, &bytes).unwrap()
                        }
                        (SocketAddr::V6(s), SocketAddr::V6(d)) => {
                            shmhca_proto::roce::check_v6(s, d, &bytes).unwrap();
                            0
                        }
                        _ => unreachable!(),
                    };
                    got.push((bytes[2], len, id));
                }
                if n == 0 {
                    b.wait_readable(10);
                }
            }
            let v4 = src.is_ipv4();
            let want: Vec<(u8, usize, u16)> = sizes
                .iter()
                .enumerate()
                .map(|(i, &p)| (i as u8, 12 + p + 4, if v4 { i as u16 } else { 0 }))
                .collect();
            assert_eq!(got, want, "(tag, length, IPv4 ID) in order, {x}");
        }
    }

    /// With `UDP_GRO` on, the receiving socket takes a GSO send whole: one message in one
    /// buffer of a ring of [`GRO_BUFFER_BYTES`], its segment size given, whose segments are
    /// the datagrams sent, in order, each with an ICRC that holds with the IPv4 ID its
    /// segment got; a datagram sent alone still arrives alone (segment size 0).
    #[test]
    fn a_gso_send_arrives_whole_at_a_gro_socket() {
        for (x, y) in [("127.0.0.1", "127.0.0.2"), ("::1", "::1")] {
            let (a, b) = (bound(x), bound(y));
            assert!(b.enable_gro(), "UDP_GRO (Linux 5.0 on)");
            let (src, dst) = (a.local_addr(), b.local_addr());
            let mut tx = TxBurst::new();
            let sizes = [1024, 1024, 1024, 1024, 24];
            for (i, &p) in sizes.iter().enumerate() {
                let len = roce_datagram(tx.next_buf().unwrap(), i as u8, p, src, dst);
                tx.commit(len, dst);
            }
            assert_eq!(tx.send(&a).sent, sizes.len());
            let alone = roce_datagram(tx.next_buf().unwrap(), 9, 8, src, dst);
            tx.commit(alone, dst);
            assert_eq!(tx.send(&a).sent, 1);
            let mut rx = RxRing::with_buffers(BURST, GRO_BUFFER_BYTES);
            let mut got = Vec::new();
            let mut messages = Vec::new();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while got.len() < sizes.len() + 1 {
                assert!(std::time::Instant::now() < deadline, "received {got:?}");
                let first = rx.next();
                let n = rx.recv(&b, BURST).unwrap();
                for d in first..first + n as u64 {
                    let (off, len, from) = rx.datagram(d);
                    assert_eq!(from, Some(src));
                    let seg = rx.segment(d);
                    messages.push((len, seg));
                    let mut bytes = vec![0u8; len];
                    rx.mem().read(off, &mut bytes).unwrap();
                    for one in bytes.chunks(if seg == 0 { len } else { seg }) {
                        let id = match (src, dst) {
                            (SocketAddr::V4(s), SocketAddr::V4(d)) => {
                                shmhca_proto::roce::check_v4_unknown_id(s, d, one).unwrap()
                            }
                            (SocketAddr::V6(s), SocketAddr::V6(d)) => {
                                shmhca_proto::roce::check_v6(s, d, one).unwrap();
                                0
                            }
                            _ => unreachable!(),
                        };
                        got.push((one[2], one.len(), id));
                    }
                }
                if n == 0 {
                    b.wait_readable(10);
                }
            }
            let v4 = src.is_ipv4();
            let mut want: Vec<(u8, usize, u16)> = sizes
                .iter()
                .enumerate()
                .map(|(i, &p)| (i as u8, 12 + p + 4, if v4 { i as u16 } else { 0 }))
                .collect();
            want.push((9, alone, 0));
            assert_eq!(got, want, "(tag, length, IPv4 ID) in order, {x}");
            let whole: usize = sizes.iter().map(|p| 12 + p + 4).sum();
            assert_eq!(
                messages,
                [(whole, 12 + 1024 + 4), (alone, 0)],
                "one message for the GSO send, {x}"
            );
        }
    }

    /// `UDP_GRO`'s control message is read only whole and of an `int`'s length, and only
    /// a segment size of 1 to 65,535 is taken; anything else is no segment size (the
    /// message is one datagram), and odd bytes never read out of bounds.
    #[test]
    fn the_gro_control_message_is_parsed_and_checked() {
        let int = |v: i32| v.to_ne_bytes().to_vec();
        assert_eq!(
            received_segment(&cmsg(libc::SOL_UDP, UDP_GRO, &int(1040), None)),
            Some(1040)
        );
        // After another message (the kernel puts IP_TOS after it; either order is read).
        let mut two = cmsg(libc::IPPROTO_IP, libc::IP_TOS, &[0x02], None);
        two.extend(cmsg(libc::SOL_UDP, UDP_GRO, &int(64), None));
        assert_eq!(received_segment(&two), Some(64));
        for bad in [
            cmsg(libc::SOL_UDP, UDP_GRO, &int(0), None),
            cmsg(libc::SOL_UDP, UDP_GRO, &int(-1), None),
            cmsg(libc::SOL_UDP, UDP_GRO, &int(65_536), None),
            cmsg(libc::SOL_UDP, UDP_GRO, &[1, 2], None),
            cmsg(libc::SOL_UDP, UDP_SEGMENT, &int(1040), None),
            cmsg(libc::SOL_UDP, UDP_GRO, &int(1040), Some(1000)),
            cmsg(libc::SOL_UDP, UDP_GRO, &int(1040), Some(3)),
        ] {
            assert_eq!(received_segment(&bad), None, "{bad:?}");
        }
        let whole = cmsg(libc::SOL_UDP, UDP_GRO, &int(1040), None);
        // (Its last bytes are padding: cut there, it is whole.)
        for cut in 0..size_of::<libc::cmsghdr>() + 4 {
            assert_eq!(received_segment(&whole[..cut]), None, "cut at {cut}");
        }
    }

    /// What makes a GSO run: one destination, one set of IP options, one size but the last,
    /// at most `GSO_MAX_SEGS` datagrams and `GSO_MAX_BYTES` bytes; and nothing with GSO off.
    #[test]
    fn gso_runs_end_where_the_kernel_needs_them_to() {
        let d1: SocketAddr = "127.0.0.1:4791".parse().unwrap();
        let d2: SocketAddr = "127.0.0.2:4791".parse().unwrap();
        let stage = |spec: &[(usize, SocketAddr, u8)]| {
            let mut tx = TxBurst::new();
            for &(len, d, tos) in spec {
                tx.next_buf().unwrap();
                let o = IpOpts {
                    hop_limit: 0,
                    traffic_class: tos,
                };
                tx.commit_with(len, d, o, 0);
            }
            tx
        };
        let runs = |tx: &TxBurst| {
            let mut v = Vec::new();
            let mut i = 0;
            while i < tx.len {
                let g = tx.gso_run(i, tx.len);
                v.push(g);
                i += g;
            }
            v
        };
        let t = stage(&[(100, d1, 0), (100, d1, 0), (60, d1, 0), (60, d1, 0)]);
        assert_eq!(runs(&t), [3, 1], "a shorter datagram ends its run");
        let t = stage(&[(60, d1, 0), (100, d1, 0)]);
        assert_eq!(runs(&t), [1, 1], "a longer one starts a new run");
        let t = stage(&[(100, d1, 0), (100, d2, 0), (100, d2, 4)]);
        assert_eq!(runs(&t), [1, 1, 1], "another destination or TOS");
        let t = stage(&[(0, d1, 0), (0, d1, 0)]);
        assert_eq!(runs(&t), [1, 1], "empty datagrams go alone");
        let t = stage(&[(4160, d1, 0); 20]);
        assert_eq!(runs(&t), [15, 5], "at most GSO_MAX_BYTES");
        let mut t = stage(&[(100, d1, 0); 3]);
        t.gso = false;
        assert_eq!(runs(&t), [1, 1, 1], "GSO off");
    }

    /// One control message as the kernel lays it out: header, data, padding to the next
    /// `size_t`, with `cmsg_len` given (`None`: header and data).
    fn cmsg(level: i32, kind: i32, data: &[u8], cmsg_len: Option<usize>) -> Vec<u8> {
        const HDR: usize = size_of::<libc::cmsghdr>();
        // SAFETY: plain old data, all zeroes valid.
        let mut h: libc::cmsghdr = unsafe { std::mem::zeroed() };
        h.cmsg_len = cmsg_len.unwrap_or(HDR + data.len()) as _;
        h.cmsg_level = level;
        h.cmsg_type = kind;
        let mut v = vec![0u8; HDR];
        // SAFETY: `v` holds `HDR` bytes, the size of `h`; unaligned write.
        unsafe { std::ptr::write_unaligned(v.as_mut_ptr().cast(), h) };
        v.extend_from_slice(data);
        v.resize(v.len().next_multiple_of(size_of::<usize>()), 0);
        v
    }

    /// The TOS / traffic class control message is found and checked: IPv4's one byte
    /// (Linux) or `int`, IPv6's `int`, after other messages; a missing, short, overlong,
    /// truncated or out-of-range one, and arbitrary bytes, read as `None`, never a panic.
    #[test]
    fn the_tos_and_traffic_class_control_messages_are_parsed_and_checked() {
        let (ip, v6) = (libc::IPPROTO_IP, libc::IPPROTO_IPV6);
        let int = |v: i32| v.to_ne_bytes();
        let tos = cmsg(ip, libc::IP_TOS, &[0x03], None);
        assert_eq!(received_tos(&tos), Some(0x03));
        assert_eq!(
            received_tos(&cmsg(ip, libc::IP_TOS, &int(0xb9), None)),
            Some(0xb9)
        );
        assert_eq!(
            received_tos(&cmsg(v6, libc::IPV6_TCLASS, &int(0x02), None)),
            Some(0x02)
        );
        assert_eq!(
            received_tos(&cmsg(v6, libc::IPV6_TCLASS, &int(0xff), None)),
            Some(0xff)
        );
        // After a message of another kind (a TTL here).
        let two = [cmsg(ip, libc::IP_TTL, &int(64), None), tos.clone()].concat();
        assert_eq!(received_tos(&two), Some(0x03));
        // None at all, another kind only, a same-numbered option of the other level.
        assert_eq!(received_tos(&[]), None);
        assert_eq!(received_tos(&cmsg(ip, libc::IP_TTL, &int(64), None)), None);
        assert_eq!(received_tos(&cmsg(v6, libc::IP_TOS, &[3], None)), None);
        // Odd lengths and values.
        for bad in [
            cmsg(ip, libc::IP_TOS, &[], None),
            cmsg(ip, libc::IP_TOS, &[3, 0], None),
            cmsg(ip, libc::IP_TOS, &int(256), None),
            cmsg(ip, libc::IP_TOS, &int(-1), None),
            cmsg(v6, libc::IPV6_TCLASS, &[3], None),
            cmsg(v6, libc::IPV6_TCLASS, &[3, 0, 0, 0, 0, 0, 0, 0], None),
            cmsg(v6, libc::IPV6_TCLASS, &int(-1), None),
            // A length shorter than the header, or past the buffer.
            cmsg(ip, libc::IP_TOS, &[3], Some(4)),
            cmsg(ip, libc::IP_TOS, &[3], Some(4096)),
            cmsg(ip, libc::IP_TOS, &[3], Some(usize::MAX)),
        ] {
            assert_eq!(received_tos(&bad), None, "{bad:?}");
        }
        // Cut anywhere (MSG_CTRUNC): whole or nothing.
        for cut in 0..two.len() {
            let got = received_tos(&two[..cut]);
            assert!(got.is_none() || cut >= two.len() - 7, "cut {cut}: {got:?}");
        }
        // A first message whose length would step past the end: the walk stops there.
        let mut skip = cmsg(ip, libc::IP_TTL, &int(64), Some(usize::MAX - 3));
        skip.extend_from_slice(&tos);
        assert_eq!(received_tos(&skip), None);
        // Arbitrary bytes: an answer, never a panic.
        let mut x = 0x2545_F491u32;
        for n in 0..400 {
            let b: Vec<u8> = (0..n % 80)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    x as u8
                })
                .collect();
            let _ = received_tos(&b);
        }
    }

    /// The ring reports each datagram's TOS / traffic class as it crossed loopback: what
    /// the sender set per datagram (ECN bits included, CE too), 0 where it set none.
    #[test]
    fn a_received_datagram_comes_with_its_tos_ipv4_and_ipv6() {
        for (x, y) in [("127.0.0.1", "127.0.0.2"), ("::1", "::1")] {
            let (a, b) = (bound(x), bound(y));
            assert!(a.receives_tos() && b.receives_tos(), "{x}");
            let classes = [0u8, 0x03, 0x02, 0x01, 0xb8, 0xbb, 0x68];
            let mut tx = TxBurst::new();
            for (i, tc) in classes.iter().enumerate() {
                tx.next_buf().unwrap()[0] = i as u8;
                let o = IpOpts {
                    hop_limit: 0,
                    traffic_class: *tc,
                };
                tx.commit_with(8, b.local_addr(), o, 0);
            }
            assert_eq!(tx.send(&a).sent, classes.len(), "{x}");
            let mut rx = RxRing::new(BURST);
            let mut got = Vec::new();
            for _ in 0..100 {
                let first = rx.next();
                let n = rx.recv(&b, BURST).unwrap();
                for d in first..first + n as u64 {
                    let mut byte = [0u8];
                    rx.mem().read(rx.datagram(d).0, &mut byte).unwrap();
                    got.push((byte[0], rx.tos(d)));
                }
                if got.len() == classes.len() {
                    break;
                }
                b.wait_readable(10);
            }
            let want: Vec<(u8, u8)> = classes
                .iter()
                .enumerate()
                .map(|(i, c)| (i as u8, *c))
                .collect();
            assert_eq!(got, want, "{x}: (datagram, TOS)");
            assert!(is_ce(got[1].1) && !is_ce(got[2].1) && !is_ce(got[0].1));
        }
    }

    /// A datagram's TTL and TOS are what its QP says (`IpOpts`), per datagram, and the
    /// socket's defaults (64, 0) where it says nothing.
    #[test]
    fn each_datagram_goes_with_its_ttl_and_tos() {
        if !super::netns::available("each_datagram_goes_with_its_ttl_and_tos") {
            return;
        }
        let got = super::netns::in_fresh_netns("shmhca-ttl", || {
            let a = UdpSocket::bind("127.0.0.1:4791".parse().unwrap()).unwrap();
            let b = UdpSocket::bind("127.0.0.2:4791".parse().unwrap()).unwrap();
            let cap = super::netns::PacketCapture::open("lo").unwrap();
            let mut tx = TxBurst::new();
            let opts = [
                IpOpts::default(),
                IpOpts {
                    hop_limit: 7,
                    traffic_class: 0x68,
                },
                IpOpts {
                    hop_limit: 200,
                    traffic_class: 0,
                },
                IpOpts {
                    hop_limit: 0,
                    traffic_class: 0xb8,
                },
            ];
            for (i, o) in opts.iter().enumerate() {
                tx.next_buf().unwrap()[0] = i as u8;
                tx.commit_with(16, b.local_addr(), *o, 0);
            }
            assert_eq!(tx.send(&a).sent, 4);
            cap.ipv4_udp_packets(4791, 4, std::time::Duration::from_secs(5))
        })
        .unwrap();
        let seen: Vec<(u8, u8)> = got.iter().map(|p| (p[8], p[1])).collect();
        assert_eq!(
            seen,
            [(64, 0), (7, 0x68), (200, 0), (64, 0xb8)],
            "(TTL, TOS)"
        );
    }
}
