//! RoCEv2: the IBA transport packet carried in UDP (port 4791) over IPv4 or IPv6, with an
//! Invariant CRC. Sans I/O: what a UDP link needs to put shmhca's packets on a network
//! and to check what arrives, and what a packet capture needs to frame them.
//!
//! ```text
//!  IPv4 (20) or IPv6 (40) │ UDP (8): sport 0xC000.., dport 4791 │ BTH … payload, pad │ ICRC (4)
//!                                                                 └─ the UDP payload: a datagram ─┘
//! ```
//!
//! * [`icrc`]: the ICRC (what the IP and UDP headers contribute, which fields are masked),
//!   computed whole ([`icrc_v4`], [`icrc_v6`]) or in pieces ([`Icrc`]), appended to a
//!   datagram ([`append_icrc_v4`], [`append_icrc_v6`]) and checked on one
//!   ([`check_v4`], [`check_v6`]); and, for a receiver on a plain UDP socket that cannot
//!   see the IPv4 identification the ICRC covers, [`check_v4_unknown_id`], which solves for
//!   it ([`solve_ipv4_id`]).
//! * [`udp`]: the destination port and the per-connection source port, Linux's convention
//!   ([`source_port`]).
//! * [`mtu`]: the active MTU of an interface ([`active_mtu`]).
//! * [`gid`]: GIDs as RoCEv2 uses them, IPv4-mapped or IPv6 ([`Gid`]).
//!
//! A receiver on a socket sees addresses as the socket reports them: a dual-stack IPv6
//! socket reports an IPv4 peer as `::ffff:a.b.c.d`; such a datagram travelled over IPv4,
//! so check it with the IPv4 functions (`IpAddr::to_canonical` tells).
//!
//! ```
//! use core::net::{Ipv4Addr, SocketAddrV4};
//! use shmhca_proto::psn::Psn;
//! use shmhca_proto::roce::{self, Gid};
//! use shmhca_proto::wire::{bth, BthRepr, Opcode, Qpn};
//!
//! // The sender: a BTH into a datagram buffer, then the ICRC after it.
//! let (local_qpn, remote_qpn) = (Qpn::new(0x11), Qpn::new(0x12));
//! let peer = Gid::from(Ipv4Addr::new(198, 18, 0, 2));
//! let me = SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 1), roce::source_port(0, local_qpn, remote_qpn));
//! let to = SocketAddrV4::new(peer.to_ipv4().unwrap(), roce::UDP_PORT);
//! let mut datagram = [0u8; 64];
//! let bth_repr = BthRepr::new(Opcode::SendOnly, remote_qpn, Psn::new(7));
//! bth_repr.emit(&mut bth::Packet::new_checked(&mut datagram[..bth::HEADER_LEN]).unwrap());
//! let len = roce::append_icrc_v4(me, to, 0, &mut datagram, bth::HEADER_LEN)?;
//!
//! // The receiver, on a UDP socket: the ICRC checked, the IPv4 ID found.
//! assert_eq!(roce::check_v4_unknown_id(me, to, &datagram[..len]), Ok(0));
//! # Ok::<(), roce::IcrcError>(())
//! ```

pub mod gid;
pub mod icrc;
pub mod mtu;
pub mod udp;

mod crc32;

pub use gid::Gid;
pub use icrc::{
    ICRC_LEN, IPV4_FLAGS_DF, IPV4_HEADER_LEN, IPV6_HEADER_LEN, Icrc, IcrcError,
    MAX_TRANSPORT_LEN_V4, MAX_TRANSPORT_LEN_V6, UDP_HEADER_LEN, append_icrc_v4, append_icrc_v6,
    check_v4, check_v4_unknown_id, check_v6, icrc_v4, icrc_v6, ipv4_id_delta, solve_ipv4_id,
};
pub use mtu::{IpVersion, active_mtu, overhead};
pub use udp::{
    FLOW_LABEL_MASK, SOURCE_PORT_MIN, UDP_PORT, flow_label_of_qpns, source_port,
    source_port_of_flow_label,
};
