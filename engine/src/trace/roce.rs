//! RoCEv2 framing for packet capture: Ethernet / IPv4 / UDP (port 4791) around the IBA
//! transport packet, followed by its Invariant CRC (ICRC).
//!
//! shmhca's shared-memory links never put these headers on the wire (engines exchange bare
//! transport headers); they exist so that a capture looks like a RoCEv2 trace that
//! Wireshark and tshark decode as InfiniBand. The ICRC, the lengths and the UDP port are
//! the RoCEv2 codec's, [`crate::roce`] (`shmhca_proto::roce`): what it covers and masks is
//! documented there, and checked there against a packet captured from real RoCE hardware,
//! the Linux soft-RoCE driver's formulation and scapy.

use std::fmt;
use std::net::Ipv4Addr;

use crate::roce::Icrc;
use crate::wire::bth;

pub use crate::roce::{ICRC_LEN, IPV4_HEADER_LEN, UDP_HEADER_LEN};

/// The UDP destination port IANA assigned to RoCEv2.
pub const ROCEV2_UDP_PORT: u16 = crate::roce::UDP_PORT;
/// The length of an Ethernet II header.
pub const ETHERNET_HEADER_LEN: usize = 14;
/// The length of Ethernet + IPv4 + UDP: the bytes before the transport packet.
pub const HEADERS_LEN: usize = ETHERNET_HEADER_LEN + IPV4_HEADER_LEN + UDP_HEADER_LEN;
/// The largest transport packet (BTH … payload) that fits an IPv4 datagram with its ICRC.
pub const MAX_TRANSPORT_LEN: usize = crate::roce::MAX_TRANSPORT_LEN_V4;

const ETHERTYPE_IPV4: u16 = 0x0800;
const IP_PROTO_UDP: u8 = 17;
const DEFAULT_TTL: u8 = 64;
/// IPv4 flags: Don't Fragment.
const IP_FLAG_DF: u16 = crate::roce::IPV4_FLAGS_DF;

/// One end of a traced link, as it appears in the capture: a MAC and an IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// The Ethernet address.
    pub mac: [u8; 6],
    /// The IPv4 address.
    pub ip: Ipv4Addr,
}

impl Endpoint {
    /// An endpoint with the given addresses.
    pub const fn new(mac: [u8; 6], ip: Ipv4Addr) -> Endpoint {
        Endpoint { mac, ip }
    }

    /// The conventional endpoint for engine number `n`: MAC `02:00:00:00:00:nn` (locally
    /// administered) and IPv4 `10.0.0.n`.
    pub const fn engine(n: u8) -> Endpoint {
        Endpoint {
            mac: [0x02, 0, 0, 0, 0, n],
            ip: Ipv4Addr::new(10, 0, 0, n),
        }
    }
}

/// Why a transport packet cannot be framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameError {
    /// The transport packet is shorter than a BTH (the ICRC needs one).
    TooShort(usize),
    /// The transport packet does not fit an IPv4 datagram ([`MAX_TRANSPORT_LEN`]).
    TooLong(usize),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::TooShort(n) => write!(
                f,
                "transport packet of {n} bytes is shorter than a BTH ({} bytes); pass the \
                 BTH, extended headers and payload",
                bth::HEADER_LEN
            ),
            FrameError::TooLong(n) => write!(
                f,
                "transport packet of {n} bytes exceeds the {MAX_TRANSPORT_LEN} bytes an IPv4 \
                 datagram can carry; capture packets no larger than the path MTU"
            ),
        }
    }
}

impl std::error::Error for FrameError {}

/// The UDP source port used for a packet to `dest_qp`: RoCEv2 uses the source port for
/// flow entropy; like the Linux soft-RoCE driver, keep it in `0xC000..=0xFFFF` and derive
/// it from the QP so each QP's packets form one flow.
pub const fn udp_source_port(dest_qp: u32) -> u16 {
    0xC000 | (dest_qp & 0x3FFF) as u16
}

/// The Internet checksum (RFC 1071) of an IPv4 header whose checksum field is zero.
pub fn ipv4_checksum(header: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut chunks = header.chunks_exact(2);
    for c in &mut chunks {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    !(sum as u16)
}

/// Builds the Ethernet, IPv4 and UDP headers for a transport packet of `transport_len`
/// bytes (BTH through payload and pad, ICRC excluded) sent to QP `dest_qp`.
///
/// The IPv4 header has DSCP/ECN 0, the given identification, Don't Fragment, TTL 64 and
/// a correct header checksum; the UDP checksum is 0 (allowed for RoCEv2, whose ICRC
/// covers the payload).
///
/// # Errors
///
/// [`FrameError`] if `transport_len` is shorter than a BTH or longer than
/// [`MAX_TRANSPORT_LEN`].
pub fn frame_headers(
    src: Endpoint,
    dst: Endpoint,
    ip_id: u16,
    dest_qp: u32,
    transport_len: usize,
) -> Result<[u8; HEADERS_LEN], FrameError> {
    if transport_len < bth::HEADER_LEN {
        return Err(FrameError::TooShort(transport_len));
    }
    if transport_len > MAX_TRANSPORT_LEN {
        return Err(FrameError::TooLong(transport_len));
    }
    // Both fit a u16: checked against MAX_TRANSPORT_LEN above.
    let udp_len = (UDP_HEADER_LEN + transport_len + ICRC_LEN) as u16;
    let ip_len = IPV4_HEADER_LEN as u16 + udp_len;

    let mut h = [0u8; HEADERS_LEN];
    // Ethernet II.
    h[0..6].copy_from_slice(&dst.mac);
    h[6..12].copy_from_slice(&src.mac);
    h[12..14].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
    // IPv4.
    let ip = &mut h[ETHERNET_HEADER_LEN..ETHERNET_HEADER_LEN + IPV4_HEADER_LEN];
    ip[0] = 0x45; // version 4, IHL 5
    ip[1] = 0; // DSCP 0, ECN not ECT
    ip[2..4].copy_from_slice(&ip_len.to_be_bytes());
    ip[4..6].copy_from_slice(&ip_id.to_be_bytes());
    ip[6..8].copy_from_slice(&IP_FLAG_DF.to_be_bytes());
    ip[8] = DEFAULT_TTL;
    ip[9] = IP_PROTO_UDP;
    ip[12..16].copy_from_slice(&src.ip.octets());
    ip[16..20].copy_from_slice(&dst.ip.octets());
    let checksum = ipv4_checksum(ip);
    ip[10..12].copy_from_slice(&checksum.to_be_bytes());
    // UDP.
    let udp = &mut h[ETHERNET_HEADER_LEN + IPV4_HEADER_LEN..];
    udp[0..2].copy_from_slice(&udp_source_port(dest_qp).to_be_bytes());
    udp[2..4].copy_from_slice(&ROCEV2_UDP_PORT.to_be_bytes());
    udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
    udp[6..8].copy_from_slice(&[0, 0]);
    Ok(h)
}

/// Computes the RoCEv2 ICRC of a packet from its IPv4 header (20 bytes, no options), its
/// UDP header and its transport packet given in pieces (BTH, extended headers, payload,
/// pad, in order; the BTH may itself be split across pieces): [`Icrc`] over the headers as
/// they are, fed the pieces through this module's `crc32` (SIMD where the CPU has it).
///
/// Write the result with `to_le_bytes()` after the transport packet.
pub fn icrc(
    ipv4_header: &[u8; IPV4_HEADER_LEN],
    udp_header: &[u8; UDP_HEADER_LEN],
    transport: &[&[u8]],
) -> u32 {
    let mut icrc = Icrc::from_ipv4_headers(ipv4_header, udp_header);
    for piece in transport {
        icrc_update(&mut icrc, piece);
    }
    icrc.finish()
}

/// Feeds `bytes` into the ICRC `icrc`: a short piece (headers, a small payload) through the
/// protocol crate's portable CRC, which starts at once, a long one through [`crc32`]'s
/// carry-less multiplication, whose set-up (the CPU feature check, the hasher) costs more
/// than the portable CRC of a few dozen bytes (callgrind: a 20-byte piece took 76
/// instructions through `crc32fast`).
pub(crate) fn icrc_update(icrc: &mut Icrc, bytes: &[u8]) {
    if bytes.len() < CARRY_LESS_FROM {
        icrc.update(bytes);
    } else {
        icrc.update_with(bytes, crc32);
    }
}

/// The piece length from which [`icrc_update`] takes the carry-less CRC.
const CARRY_LESS_FROM: usize = 128;

/// CRC-32 in the zlib convention (the CRC-32 of the bytes so far, and more bytes, in; the
/// CRC-32 of them all out), with carry-less multiplication where the CPU has it: what the
/// engine passes to [`Icrc::update_with`] for payloads, about 15 times the speed of the
/// protocol crate's portable CRC on 4 KiB.
pub(crate) fn crc32(crc: u32, bytes: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new_with_initial(crc);
    hasher.update(bytes);
    hasher.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A RoCEv2 CNP (opcode 0x81) captured on a Mellanox ConnectX-4 Lx, as published with
    /// scapy's RoCE tests: Ethernet, IPv4 (TOS 0xC2, TTL 64), UDP 0 → 4791 with checksum 0,
    /// BTH (BECN set in resv8a, DestQP 0x118), 16 bytes of zero padding, ICRC 82 FD 00 2A.
    const CONNECTX4_CNP: [u8; 74] = [
        0xe4, 0x1d, 0x2d, 0xab, 0x2b, 0xc2, 0x7c, 0xfe, 0x90, 0x64, 0x3b, 0x32, 0x08,
        0x00, // eth
        0x45, 0xc2, 0x00, 0x3c, 0x71, 0x8c, 0x40, 0x00, 0x40, 0x11, 0x91, 0x61, 0x0a, 0x00, 0x11,
        0x01, 0x0a, 0x00, 0x12, 0x01, // ipv4
        0x00, 0x00, 0x12, 0xb7, 0x00, 0x28, 0x00, 0x00, // udp
        0x81, 0x00, 0xff, 0xff, 0x40, 0x00, 0x01, 0x18, 0x00, 0x00, 0x00, 0x00, // bth
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // cnp padding
        0x82, 0xfd, 0x00, 0x2a, // icrc
    ];

    fn split(frame: &[u8]) -> ([u8; 20], [u8; 8], &[u8], [u8; 4]) {
        let ip: [u8; 20] = frame[14..34].try_into().unwrap();
        let udp: [u8; 8] = frame[34..42].try_into().unwrap();
        let n = frame.len();
        (
            ip,
            udp,
            &frame[42..n - 4],
            frame[n - 4..].try_into().unwrap(),
        )
    }

    #[test]
    fn icrc_matches_a_hardware_capture() {
        let (ip, udp, transport, trailer) = split(&CONNECTX4_CNP);
        assert_eq!(icrc(&ip, &udp, &[transport]).to_le_bytes(), trailer);
        // However the transport packet is cut into pieces, even through the BTH.
        for cut in 0..transport.len() {
            let (a, b) = transport.split_at(cut);
            assert_eq!(
                icrc(&ip, &udp, &[a, b]).to_le_bytes(),
                trailer,
                "cut at {cut}"
            );
        }
        assert_eq!(
            icrc(
                &ip,
                &udp,
                &[&transport[..4], &[], &transport[4..5], &transport[5..]]
            )
            .to_le_bytes(),
            trailer
        );
    }

    #[test]
    fn icrc_ignores_the_variant_fields_only() {
        let (mut ip, mut udp, transport, trailer) = split(&CONNECTX4_CNP);
        let mut t = transport.to_vec();
        ip[1] = 0x00; // TOS
        ip[8] = 1; // TTL
        ip[10] = 0x12; // checksum
        udp[6] = 0x34; // UDP checksum
        t[4] = 0x00; // resv8a: clear BECN
        assert_eq!(icrc(&ip, &udp, &[&t]).to_le_bytes(), trailer);
        // Any invariant bit changes it: the PSN, the payload, the addresses.
        for (i, byte) in t.clone().iter().enumerate().filter(|(i, _)| *i != 4) {
            let mut t2 = t.clone();
            t2[i] = byte ^ 0x01;
            assert_ne!(icrc(&ip, &udp, &[&t2]).to_le_bytes(), trailer, "byte {i}");
        }
        ip[19] ^= 1;
        assert_ne!(icrc(&ip, &udp, &[&t]).to_le_bytes(), trailer);
    }

    /// A captured frame carries the ICRC a RoCEv2 receiver checks: the framing writes
    /// the covered fields (lengths, DF, protocol, ports) as the codec assumes them, so a
    /// capture shows what a UDP link would put on the wire.
    #[test]
    fn a_framed_packet_passes_the_receivers_check() {
        use std::net::SocketAddrV4;
        let (src, dst) = (Endpoint::engine(1), Endpoint::engine(2));
        let transport: Vec<u8> = (0..60u8).collect();
        for ip_id in [0, 7, 0xFFFF] {
            let h = frame_headers(src, dst, ip_id, 0x11, transport.len()).unwrap();
            let mut frame = h.to_vec();
            frame.extend_from_slice(&transport);
            let (ip, udp, _, _) = split(&[&frame[..], &[0; 4]].concat());
            frame.extend_from_slice(&icrc(&ip, &udp, &[&transport]).to_le_bytes());

            let from = SocketAddrV4::new(src.ip, udp_source_port(0x11));
            let to = SocketAddrV4::new(dst.ip, ROCEV2_UDP_PORT);
            let datagram = &frame[HEADERS_LEN..];
            assert_eq!(
                crate::roce::check_v4(from, to, ip_id, datagram),
                Ok(&transport[..])
            );
            assert_eq!(
                crate::roce::check_v4_unknown_id(from, to, datagram),
                Ok(ip_id)
            );
        }
    }

    #[test]
    fn the_fast_crc32_is_crc32_in_the_zlib_convention() {
        assert_eq!(crc32(0, b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(crc32(0, b"1234"), b"56789"), 0xCBF4_3926);
        assert_eq!(crc32(0x1234_5678, b""), 0x1234_5678);
    }

    #[test]
    fn ipv4_checksum_matches_the_capture() {
        let mut ip: [u8; 20] = CONNECTX4_CNP[14..34].try_into().unwrap();
        assert_eq!(ipv4_checksum(&ip), 0); // a correct header sums to 0xFFFF
        let stored = u16::from_be_bytes([ip[10], ip[11]]);
        ip[10] = 0;
        ip[11] = 0;
        assert_eq!(ipv4_checksum(&ip), stored);
        assert_eq!(stored, 0x9161);
    }

    #[test]
    fn frame_headers_layout() {
        let h = frame_headers(
            Endpoint::engine(1),
            Endpoint::engine(2),
            0x1234,
            0xAB_CDEF,
            28,
        )
        .unwrap();
        assert_eq!(h[0..6], [2, 0, 0, 0, 0, 2]);
        assert_eq!(h[6..12], [2, 0, 0, 0, 0, 1]);
        assert_eq!(h[12..14], [0x08, 0x00]);
        assert_eq!(h[14], 0x45);
        assert_eq!(u16::from_be_bytes([h[16], h[17]]), 20 + 8 + 28 + 4);
        assert_eq!(h[18..20], [0x12, 0x34]);
        assert_eq!(h[20..22], [0x40, 0x00]);
        assert_eq!((h[22], h[23]), (64, 17));
        assert_eq!(ipv4_checksum(&h[14..34]), 0);
        assert_eq!(h[26..30], [10, 0, 0, 1]);
        assert_eq!(h[30..34], [10, 0, 0, 2]);
        assert_eq!(u16::from_be_bytes([h[34], h[35]]), 0xC000 | 0x0DEF);
        assert_eq!(u16::from_be_bytes([h[36], h[37]]), 4791);
        assert_eq!(u16::from_be_bytes([h[38], h[39]]), 8 + 28 + 4);
        assert_eq!(h[40..42], [0, 0]);
    }

    #[test]
    fn frame_headers_rejects_bad_lengths() {
        let (a, b) = (Endpoint::engine(1), Endpoint::engine(2));
        assert_eq!(frame_headers(a, b, 0, 0, 11), Err(FrameError::TooShort(11)));
        assert!(frame_headers(a, b, 0, 0, MAX_TRANSPORT_LEN).is_ok());
        assert_eq!(
            frame_headers(a, b, 0, 0, MAX_TRANSPORT_LEN + 1),
            Err(FrameError::TooLong(MAX_TRANSPORT_LEN + 1))
        );
        let h = frame_headers(a, b, 0, 0, MAX_TRANSPORT_LEN).unwrap();
        assert_eq!(u16::from_be_bytes([h[16], h[17]]), u16::MAX);
    }
}
