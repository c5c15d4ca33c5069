//! RoCEv2 GIDs: an IP address written as a 16-byte GID.
//!
//! A RoCEv2 port's GID table holds one entry per IP address of its interface: an IPv6
//! address as it is, an IPv4 address `a.b.c.d` as the IPv4-mapped IPv6 address
//! `::ffff:a.b.c.d` (the form `ibv_query_gid` and the kernel's `gid_attrs` show). A
//! destination named by GID is reached at that IP address, UDP port 4791.

use core::fmt;
use core::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::UDP_PORT;

/// A 128-bit Global Identifier as RoCEv2 uses it: an IPv6 address, or an IPv4 address
/// mapped into IPv6 (`::ffff:a.b.c.d`). Ordered and hashed by its 16 bytes.
///
/// ```
/// use core::net::{IpAddr, Ipv4Addr};
/// use shmhca_proto::roce::Gid;
///
/// let gid = Gid::from(Ipv4Addr::new(198, 18, 0, 1));
/// assert_eq!(gid.octets()[10..], [0xff, 0xff, 198, 18, 0, 1]);
/// assert_eq!(gid.to_string(), "::ffff:198.18.0.1");
/// assert_eq!(gid.ip(), IpAddr::V4(Ipv4Addr::new(198, 18, 0, 1)));
/// assert_eq!(gid.socket_addr().port(), 4791);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Gid([u8; 16]);

impl Gid {
    /// The all-zero GID (an empty GID table entry).
    pub const ZERO: Gid = Gid([0; 16]);

    /// The GID of these 16 bytes, in wire (network) order.
    pub const fn from_octets(octets: [u8; 16]) -> Gid {
        Gid(octets)
    }

    /// The GID's 16 bytes, in wire order (`ibv_gid.raw`).
    pub const fn octets(&self) -> [u8; 16] {
        self.0
    }

    /// The GID of an IPv4 address: `::ffff:a.b.c.d`.
    pub const fn from_ipv4(ip: Ipv4Addr) -> Gid {
        Gid(ip.to_ipv6_mapped().octets())
    }

    /// The GID of an IPv6 address: its 16 bytes. An IPv4-mapped IPv6 address makes the
    /// same GID as the IPv4 address.
    pub const fn from_ipv6(ip: Ipv6Addr) -> Gid {
        Gid(ip.octets())
    }

    /// The IPv4 address of an IPv4-mapped GID, `None` for any other.
    pub const fn to_ipv4(&self) -> Option<Ipv4Addr> {
        self.to_ipv6().to_ipv4_mapped()
    }

    /// The GID as an IPv6 address (IPv4-mapped for an IPv4 GID).
    pub const fn to_ipv6(&self) -> Ipv6Addr {
        Ipv6Addr::from_bits(u128::from_be_bytes(self.0))
    }

    /// Whether the GID is an IPv4 address mapped into IPv6: RoCEv2 over IPv4.
    pub const fn is_ipv4_mapped(&self) -> bool {
        self.to_ipv4().is_some()
    }

    /// The IP address packets to this GID go to: IPv4 for an IPv4-mapped GID, IPv6
    /// otherwise.
    pub const fn ip(&self) -> IpAddr {
        match self.to_ipv4() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(self.to_ipv6()),
        }
    }

    /// The RoCEv2 endpoint of this GID: its [`ip`](Gid::ip), UDP port 4791.
    pub const fn socket_addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip(), UDP_PORT)
    }

    /// The upper 64 bits, the subnet prefix (`ibv_gid.global.subnet_prefix`, in host
    /// order).
    pub const fn subnet_prefix(&self) -> u64 {
        (u128::from_be_bytes(self.0) >> 64) as u64
    }

    /// The lower 64 bits, the interface identifier (`ibv_gid.global.interface_id`, in
    /// host order).
    pub const fn interface_id(&self) -> u64 {
        u128::from_be_bytes(self.0) as u64
    }
}

impl From<[u8; 16]> for Gid {
    fn from(octets: [u8; 16]) -> Gid {
        Gid::from_octets(octets)
    }
}

impl From<Gid> for [u8; 16] {
    fn from(gid: Gid) -> [u8; 16] {
        gid.octets()
    }
}

impl From<Ipv4Addr> for Gid {
    fn from(ip: Ipv4Addr) -> Gid {
        Gid::from_ipv4(ip)
    }
}

impl From<Ipv6Addr> for Gid {
    fn from(ip: Ipv6Addr) -> Gid {
        Gid::from_ipv6(ip)
    }
}

impl From<IpAddr> for Gid {
    fn from(ip: IpAddr) -> Gid {
        match ip {
            IpAddr::V4(v4) => Gid::from_ipv4(v4),
            IpAddr::V6(v6) => Gid::from_ipv6(v6),
        }
    }
}

impl From<Gid> for IpAddr {
    fn from(gid: Gid) -> IpAddr {
        gid.ip()
    }
}

impl From<Gid> for Ipv6Addr {
    fn from(gid: Gid) -> Ipv6Addr {
        gid.to_ipv6()
    }
}

/// As an IPv6 address: `::ffff:198.18.0.1`, `fd00::1`.
impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.to_ipv6(), f)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_gids_are_mapped_and_convert_back() {
        let ip = Ipv4Addr::new(198, 18, 0, 7);
        let gid = Gid::from(ip);
        assert_eq!(
            gid.octets(),
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 198, 18, 0, 7]
        );
        assert!(gid.is_ipv4_mapped());
        assert_eq!(gid.to_ipv4(), Some(ip));
        assert_eq!(gid.ip(), IpAddr::V4(ip));
        assert_eq!(IpAddr::from(gid), IpAddr::V4(ip));
        assert_eq!(Gid::from(IpAddr::V4(ip)), gid);
        assert_eq!(
            Gid::from(gid.to_ipv6()),
            gid,
            "a mapped IPv6 address is the same GID"
        );
        assert_eq!(gid.socket_addr(), SocketAddr::new(IpAddr::V4(ip), UDP_PORT));
        assert_eq!(gid.subnet_prefix(), 0);
        assert_eq!(gid.interface_id(), 0x0000_ffff_c612_0007);
        assert_eq!(format!("{gid}"), "::ffff:198.18.0.7");
        assert_eq!(format!("{gid:?}"), "Gid(::ffff:198.18.0.7)");
    }

    #[test]
    fn ipv6_gids_are_the_address() {
        let ip: Ipv6Addr = "fd00:5348:4d::2".parse().unwrap();
        let gid = Gid::from(IpAddr::V6(ip));
        assert_eq!(gid.octets(), ip.octets());
        assert_eq!(<[u8; 16]>::from(gid), ip.octets());
        assert_eq!(Gid::from(ip.octets()), gid);
        assert!(!gid.is_ipv4_mapped());
        assert_eq!(gid.to_ipv4(), None);
        assert_eq!(gid.ip(), IpAddr::V6(ip));
        assert_eq!(Ipv6Addr::from(gid), ip);
        assert_eq!(gid.socket_addr(), SocketAddr::new(IpAddr::V6(ip), 4791));
        assert_eq!(gid.subnet_prefix(), 0xfd00_5348_004d_0000);
        assert_eq!(gid.interface_id(), 2);
        assert_eq!(gid.to_string(), "fd00:5348:4d::2");
        // IPv4-compatible (::a.b.c.d, deprecated) is not IPv4-mapped: an IPv6 GID.
        let compat = Gid::from_octets([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10, 0, 0, 1]);
        assert!(!compat.is_ipv4_mapped());
        assert!(compat.ip().is_ipv6());
        assert_eq!(Gid::default(), Gid::ZERO);
        assert!(Gid::ZERO.ip().is_ipv6());
    }

    #[test]
    fn gids_order_by_their_bytes() {
        let a = Gid::from(Ipv4Addr::new(10, 0, 0, 1));
        let b = Gid::from(Ipv4Addr::new(10, 0, 0, 2));
        let v6 = Gid::from("fe80::1".parse::<Ipv6Addr>().unwrap());
        assert!(a < b && b < v6);
    }
}
