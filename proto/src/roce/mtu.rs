//! A RoCEv2 port's active MTU: the largest InfiniBand MTU whose packets fit the
//! interface's IP MTU.
//!
//! A packet of a full path MTU of payload carries, inside the IP MTU: the IP header, the
//! UDP header, the BTH, its extended headers and the ICRC. The extended headers are
//! counted at the largest any RC packet carries, the AtomicETH's 28 bytes (a packet with a
//! payload carries at most 20: RETH and ImmDt), as Linux does (`iboe_get_mtu`, and
//! soft-RoCE's 80-byte allowance for IPv4). An Ethernet MTU of 1500 gives 1024, 9000 gives
//! 4096 for either family.

use crate::qp::Mtu;

use super::{ICRC_LEN, IPV4_HEADER_LEN, IPV6_HEADER_LEN, UDP_HEADER_LEN};
use crate::wire::{atomic_eth, bth};

/// The IP version a RoCEv2 packet travels over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IpVersion {
    /// IPv4: a 20-byte IP header.
    V4,
    /// IPv6: a 40-byte IP header.
    V6,
}

/// The bytes of the IP MTU a RoCEv2 packet spends outside its payload, at most: IP and UDP
/// headers, BTH, the largest extended headers (the AtomicETH) and the ICRC. 72 for IPv4,
/// 92 for IPv6.
pub const fn overhead(ip: IpVersion) -> u32 {
    let ip_header = match ip {
        IpVersion::V4 => IPV4_HEADER_LEN,
        IpVersion::V6 => IPV6_HEADER_LEN,
    };
    (ip_header + UDP_HEADER_LEN + bth::HEADER_LEN + atomic_eth::HEADER_LEN + ICRC_LEN) as u32
}

/// The active MTU of a RoCEv2 port on an interface of IP MTU `interface_mtu` (bytes, as
/// `ip link` shows it): the largest of 256 … 4096 that leaves room for
/// [`overhead`]`(ip)`; `None` if even 256 does not fit.
///
/// ```
/// use shmhca_proto::qp::Mtu;
/// use shmhca_proto::roce::{active_mtu, IpVersion};
///
/// assert_eq!(active_mtu(1500, IpVersion::V4), Some(Mtu::Mtu1024));
/// assert_eq!(active_mtu(9000, IpVersion::V6), Some(Mtu::Mtu4096));
/// assert_eq!(active_mtu(65536, IpVersion::V4), Some(Mtu::Mtu4096), "loopback");
/// ```
pub const fn active_mtu(interface_mtu: u32, ip: IpVersion) -> Option<Mtu> {
    let Some(payload) = interface_mtu.checked_sub(overhead(ip)) else {
        return None;
    };
    Some(match payload {
        4096.. => Mtu::Mtu4096,
        2048.. => Mtu::Mtu2048,
        1024.. => Mtu::Mtu1024,
        512.. => Mtu::Mtu512,
        256.. => Mtu::Mtu256,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overheads() {
        assert_eq!(overhead(IpVersion::V4), 20 + 8 + 12 + 28 + 4);
        assert_eq!(overhead(IpVersion::V6), 40 + 8 + 12 + 28 + 4);
    }

    #[test]
    fn the_mtu_table() {
        use IpVersion::{V4, V6};
        let table: &[(u32, IpVersion, Option<Mtu>)] = &[
            (1500, V4, Some(Mtu::Mtu1024)),
            (1500, V6, Some(Mtu::Mtu1024)),
            (9000, V4, Some(Mtu::Mtu4096)),
            (9000, V6, Some(Mtu::Mtu4096)),
            (65536, V4, Some(Mtu::Mtu4096)),
            (u32::MAX, V6, Some(Mtu::Mtu4096)),
            (4096 + 72, V4, Some(Mtu::Mtu4096)),
            (4096 + 71, V4, Some(Mtu::Mtu2048)),
            (4096 + 92, V6, Some(Mtu::Mtu4096)),
            (4096 + 91, V6, Some(Mtu::Mtu2048)),
            (2048 + 72, V4, Some(Mtu::Mtu2048)),
            (2048 + 71, V4, Some(Mtu::Mtu1024)),
            (1024 + 92, V6, Some(Mtu::Mtu1024)),
            (1024 + 91, V6, Some(Mtu::Mtu512)),
            (1280, V6, Some(Mtu::Mtu1024)), // the IPv6 minimum MTU
            (576, V4, Some(Mtu::Mtu256)),
            (512 + 72, V4, Some(Mtu::Mtu512)),
            (256 + 72, V4, Some(Mtu::Mtu256)),
            (256 + 71, V4, None),
            (256 + 92, V6, Some(Mtu::Mtu256)),
            (256 + 91, V6, None),
            (68, V4, None), // the IPv4 minimum MTU
            (0, V4, None),
            (0, V6, None),
        ];
        for &(mtu, ip, want) in table {
            assert_eq!(active_mtu(mtu, ip), want, "{mtu} {ip:?}");
        }
    }
}
