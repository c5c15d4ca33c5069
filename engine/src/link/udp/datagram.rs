//! Packets into RoCEv2 datagrams and back: a packet as the engine stages it (a
//! [`PacketSlot`] and its continuation lines, its payload inline, or in the sending QP's
//! arena) becomes the UDP payload of a RoCEv2 packet — transport headers, payload, pad,
//! ICRC — and a received datagram becomes a one-line packet whose payload is the
//! datagram's own bytes (inline if it fits the line, else a reference into the receive
//! buffer, which is the link's "peer arena").
//!
//! Nothing received is trusted: [`decode`] checks the length against the opcode's headers,
//! the pad count and the largest payload, and the ICRC, before it builds a line; the engine
//! then parses the line as it parses every packet (`RxPacket::parse`).
//!
//! # The ICRC
//!
//! CRC-32 (Ethernet polynomial, reflected, all-ones initial value and final XOR) over 8
//! bytes of `0xFF` (the LRH RoCEv2 lacks), the IP header with its variant fields masked to
//! ones (IPv4: TOS, TTL, header checksum; IPv6: traffic class, flow label, hop limit), the
//! UDP header with its checksum masked, the BTH with its resv8a byte masked, and the rest
//! of the transport packet; appended least-significant byte first. The IP header is
//! rebuilt from what a UDP socket knows: the two addresses, the lengths, and — for IPv4 —
//! an IP ID of 0 and DF, what Linux sends for a DF datagram from an unconnected socket
//! (see [`super::socket`]); a received IPv4 packet with another ID is accepted if one ID
//! makes its ICRC right ([`shmhca_proto::roce::solve_ipv4_id`]). The CRC is the protocol
//! crate's codec, [`shmhca_proto::roce::Icrc`], the capture's too.
#![forbid(unsafe_code)]

use std::net::{SocketAddr, SocketAddrV6};

use crate::mem::Mem;
use crate::wire::bth;
use crate::wire::slot::{
    ACK_FLAG, KIND_DIRECT, KIND_GATHER, KIND_INLINE, KIND_NONE, PacketSlot, SLOT_DATA,
    gather_entry, riding_ack,
};
use shmhca_proto::wire::opcode::info_of_code;

/// Bytes of the ICRC trailer.
pub(crate) const ICRC_LEN: usize = shmhca_proto::roce::ICRC_LEN;
/// The largest payload of one packet (the largest path MTU).
pub(crate) const MAX_PAYLOAD: usize = 4096;
/// The fewest bytes of a RoCEv2 UDP payload: a BTH and the ICRC.
pub(crate) const MIN_DATAGRAM: usize = bth::HEADER_LEN + ICRC_LEN;

/// The ICRC of a RoCEv2 packet from `src` to `dst` whose UDP payload (ICRC excluded) is
/// `transport`, given in pieces (headers, payload, pad): the protocol crate's codec
/// ([`shmhca_proto::roce::Icrc`]) over the pseudo-header, its bulk through the engine's
/// fast CRC-32. For IPv4 the IP ID is `ip_id` and DF is set (see the module docs). Both
/// addresses must be of one family; a mixed pair (which no socket sends) is computed as
/// IPv6 with the IPv4 address mapped. `None` for a transport packet shorter than a BTH or
/// longer than an IP datagram holds.
pub(crate) fn icrc_with_id(
    src: SocketAddr,
    dst: SocketAddr,
    ip_id: u16,
    transport: &[&[u8]],
) -> Option<u32> {
    use shmhca_proto::roce::Icrc;
    let transport_len: usize = transport.iter().map(|p| p.len()).sum();
    let mut h = match (src, dst) {
        (SocketAddr::V4(s), SocketAddr::V4(d)) => Icrc::ipv4(s, d, ip_id, transport_len),
        (s, d) => {
            let v6 = |a: SocketAddr| match a {
                SocketAddr::V4(a) => SocketAddrV6::new(a.ip().to_ipv6_mapped(), a.port(), 0, 0),
                SocketAddr::V6(a) => a,
            };
            Icrc::ipv6(v6(s), v6(d), transport_len)
        }
    }
    .ok()?;
    for piece in transport {
        crate::trace::roce::icrc_update(&mut h, piece);
    }
    Some(h.finish())
}

/// [`icrc_with_id`] with IP ID 0, what this link sends (Linux's ID for a DF datagram from
/// an unconnected socket).
pub(crate) fn icrc(src: SocketAddr, dst: SocketAddr, transport: &[&[u8]]) -> Option<u32> {
    icrc_with_id(src, dst, 0, transport)
}

/// Why a staged packet could not be written as a datagram (the engine wrote it, so this
/// is a bug or a packet the fault stage mangled; it is dropped and counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EncodeError {
    /// The slot's header length, kind or payload length is out of range.
    Malformed,
    /// The payload lies outside the sending QP's arena (or no arena is known).
    Unreadable,
    /// The buffer is too small.
    NoRoom,
}

/// Writes the packet `slots` (a slot and its continuation lines) into `out` as a RoCEv2
/// UDP payload from `src` to `dst`: headers, payload (read from `arena` if it is sent by
/// reference), pad, ICRC. Returns the datagram's length. A riding Ack is not written
/// here: see [`riding_ack_datagram`].
pub(crate) fn encode(
    slots: &[PacketSlot],
    arena: Option<&Mem>,
    src: SocketAddr,
    dst: SocketAddr,
    out: &mut [u8],
) -> Result<usize, EncodeError> {
    let (slot, cont) = slots.split_first().ok_or(EncodeError::Malformed)?;
    let hdr_len = usize::from(slot.hdr_len);
    if !(bth::HEADER_LEN..=SLOT_DATA).contains(&hdr_len) {
        return Err(EncodeError::Malformed);
    }
    let len = slot.payload_len as usize;
    if len > MAX_PAYLOAD {
        return Err(EncodeError::Malformed);
    }
    let pad = usize::from((slot.data[1] >> 4) & 3);
    let total = hdr_len + len + pad + ICRC_LEN;
    if out.len() < total {
        return Err(EncodeError::NoRoom);
    }
    out[..hdr_len].copy_from_slice(&slot.data[..hdr_len]);
    let payload = &mut out[hdr_len..hdr_len + len];
    match slot.kind {
        KIND_NONE if len == 0 => {}
        KIND_INLINE => {
            let src = slot
                .data
                .get(hdr_len..hdr_len + len)
                .ok_or(EncodeError::Malformed)?;
            payload.copy_from_slice(src);
        }
        KIND_DIRECT => arena
            .ok_or(EncodeError::Unreadable)?
            .read(slot.payload_off, payload)
            .map_err(|_| EncodeError::Unreadable)?,
        KIND_GATHER => {
            let mem = arena.ok_or(EncodeError::Unreadable)?;
            let skip = slot
                .data
                .get(hdr_len..hdr_len + 4)
                .ok_or(EncodeError::Malformed)?;
            let mut skip = u64::from(u32::from_le_bytes([skip[0], skip[1], skip[2], skip[3]]));
            let mut got = 0usize;
            for i in 0..usize::from(slot.sge_count) {
                if got >= len {
                    break;
                }
                let (off, elen) = gather_entry(cont, i).ok_or(EncodeError::Malformed)?;
                let take = (u64::from(elen).saturating_sub(skip) as usize).min(len - got);
                let at = off.checked_add(skip).ok_or(EncodeError::Unreadable)?;
                mem.read(at, &mut payload[got..got + take])
                    .map_err(|_| EncodeError::Unreadable)?;
                got += take;
                skip = skip.saturating_sub(u64::from(elen));
            }
            if got != len {
                return Err(EncodeError::Malformed);
            }
        }
        _ => return Err(EncodeError::Malformed),
    }
    let body = hdr_len + len;
    out[body..body + pad].fill(0);
    let crc = icrc(src, dst, &[&out[..body + pad]]).ok_or(EncodeError::Malformed)?;
    out[body + pad..total].copy_from_slice(&crc.to_le_bytes());
    Ok(total)
}

/// Whether `slot` carries a riding Ack.
pub(crate) fn carries_ack(slot: &PacketSlot) -> bool {
    slot.reserved & ACK_FLAG != 0
}

/// The positive Ack riding in `slot` (`ACK_FLAG`), written into `out` as a datagram of its
/// own (on the wire an Ack always travels alone); `None` if `slot` carries none.
pub(crate) fn riding_ack_datagram(
    slot: &PacketSlot,
    src: SocketAddr,
    dst: SocketAddr,
    out: &mut [u8],
) -> Option<Result<usize, EncodeError>> {
    if !carries_ack(slot) {
        return None;
    }
    let ack = riding_ack(slot)?;
    Some(encode(std::slice::from_ref(&ack), None, src, dst, out))
}

/// Why a received datagram was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DecodeError {
    /// Shorter than its headers, pad and ICRC; longer than a packet can be; an opcode
    /// this HCA does not implement; a payload that does not fit a buffer; or truncated.
    Malformed,
    /// The ICRC does not match.
    Icrc,
    /// A Congestion Notification Packet (opcode 0x81, RoCEv2 annex A17.9): a peer's notice
    /// that this side's packets met congestion (ECN-marked on the way). Checked and counted;
    /// shmhca does not yet slow down for it (no reaction point), and it is never a protocol
    /// error.
    Cnp,
}

/// The CNP opcode (RoCEv2 annex: CNX transport, its one opcode).
pub(crate) const OPCODE_CNP: u8 = 0x81;
/// A CNP's transport packet: the BTH and 16 reserved bytes (then the ICRC).
const CNP_LEN: usize = bth::HEADER_LEN + 16;

/// BTH byte 4 of a CNP: BECN set (bit 6), as the ConnectX-4 CNP captured in
/// `crate::trace::roce` has it (the byte is resv8a to the ICRC: masked, not covered).
const CNP_BECN: u8 = 0x40;

/// Writes into `out` the Congestion Notification Packet (RoCEv2 annex A17.9) this side
/// sends, as a notification point, to remote QP `dest_qp` at `dst` from `src`: a BTH with
/// opcode 0x81, no flags, pad 0, TVer 0, the QPs' P_Key (shmhca has one partition:
/// [`crate::wire::BthRepr::DEFAULT_PKEY`]), BECN set, `dest_qp`, AckReq 0 and PSN 0; 16
/// reserved zero bytes; the ICRC. Returns its length (36), or
/// [`EncodeError::NoRoom`] if `out` is shorter.
pub(crate) fn encode_cnp(
    dest_qp: crate::Qpn,
    src: SocketAddr,
    dst: SocketAddr,
    out: &mut [u8],
) -> Result<usize, EncodeError> {
    let total = CNP_LEN + ICRC_LEN;
    let out = out.get_mut(..total).ok_or(EncodeError::NoRoom)?;
    out.fill(0);
    out[0] = OPCODE_CNP;
    out[2..4].copy_from_slice(&crate::wire::BthRepr::DEFAULT_PKEY.to_be_bytes());
    out[4] = CNP_BECN;
    out[5..8].copy_from_slice(&dest_qp.get().to_be_bytes()[1..]);
    let crc = icrc(src, dst, &[&out[..CNP_LEN]]).ok_or(EncodeError::Malformed)?;
    out[CNP_LEN..].copy_from_slice(&crc.to_le_bytes());
    Ok(total)
}

/// What a datagram with the CNP opcode is: [`DecodeError::Cnp`] if it has a CNP's length and
/// a good ICRC, else malformed or a bad ICRC like any other.
fn check_cnp(bytes: &[u8], src: SocketAddr, dst: SocketAddr) -> DecodeError {
    if bytes.len() != CNP_LEN + ICRC_LEN {
        return DecodeError::Malformed;
    }
    let carried = u32::from_le_bytes([
        bytes[CNP_LEN],
        bytes[CNP_LEN + 1],
        bytes[CNP_LEN + 2],
        bytes[CNP_LEN + 3],
    ]);
    match icrc(src, dst, &[&bytes[..CNP_LEN]]) {
        Some(c)
            if c == carried
                || (src.is_ipv4()
                    && shmhca_proto::roce::solve_ipv4_id(c, carried, CNP_LEN).is_some()) =>
        {
            DecodeError::Cnp
        }
        Some(_) => DecodeError::Icrc,
        None => DecodeError::Malformed,
    }
}

/// The IPv4 identifications a link's peer sends, learned per destination QP, so that
/// solving for the ID (which a UDP socket cannot see) does not weaken the ICRC: any
/// corruption is explained by *some* ID with probability 2^-16, but rarely by one close
/// after the ID the same peer QP sent last. A sender counts its IDs up (per packet or per
/// QP), or sends 0 (Linux with DF: never solved for), or numbers the segments of a GSO
/// send 0, 1, 2, … (Linux, and shmhca: IDs below 64 are taken as they are).
#[derive(Debug, Default)]
pub(crate) struct IpIds {
    /// (destination QPN, last ID accepted), most recent last; at most [`IpIds::TRACKED`].
    last: Vec<(u32, u16)>,
}

impl IpIds {
    /// Destination QPs whose peer's IDs are remembered (the oldest is forgotten first).
    const TRACKED: usize = 64;
    /// How far after the last ID a new one may be (packets to other QPs of the peer, or
    /// lost ones, in between).
    const AHEAD: u16 = 4096;
    /// How far before the last ID one may be (reordering).
    const BEHIND: u16 = 64;
    /// IDs below this are GSO segments' (their place in one send): taken as they are.
    const GSO_SEGMENTS: u16 = 64;

    /// Whether a packet to QP `qpn` whose ICRC holds with IPv4 ID `id` is believable —
    /// the first such packet to that QP, or an ID within [`IpIds::AHEAD`] after (or
    /// [`IpIds::BEHIND`] before) the last one accepted — and if so, remembers it.
    pub(crate) fn accept(&mut self, qpn: u32, id: u16) -> bool {
        // A segment of a GSO send (Linux numbers them 0, 1, 2, …; shmhca sends runs of at
        // most 64): believable from any peer, and never moves the track, so datagrams
        // forged to push the track away cannot make a GSO sender's segments unbelievable.
        if id < Self::GSO_SEGMENTS {
            return true;
        }
        let at = self.last.iter().position(|(q, _)| *q == qpn);
        if let Some(i) = at {
            let last = self.last[i].1;
            let near =
                id.wrapping_sub(last) <= Self::AHEAD || last.wrapping_sub(id) <= Self::BEHIND;
            if !near {
                return false;
            }
            self.last.remove(i);
        } else if self.last.len() == Self::TRACKED {
            self.last.remove(0);
        }
        self.last.push((qpn, id));
        true
    }
}

/// Checks the datagram `bytes` (a RoCEv2 UDP payload from `src` to `dst`) and builds the
/// packet line the engine receives: its headers, and its payload inline if it fits the
/// line, else a reference to `payload_base + (offset of the payload in bytes)` — where
/// the datagram lies in the memory the engine reads peer payloads from.
#[cfg(test)]
pub(crate) fn decode(
    bytes: &[u8],
    src: SocketAddr,
    dst: SocketAddr,
    payload_base: u64,
) -> Result<PacketSlot, DecodeError> {
    decode_from(bytes, src, dst, payload_base, None)
}

/// [`decode`], where an ICRC that holds only with a nonzero IPv4 ID must also pass `ids`
/// (the link's [`IpIds`]; `None`: any ID the ICRC can be solved for is taken).
pub(crate) fn decode_from(
    bytes: &[u8],
    src: SocketAddr,
    dst: SocketAddr,
    payload_base: u64,
    ids: Option<&mut IpIds>,
) -> Result<PacketSlot, DecodeError> {
    if bytes.len() < MIN_DATAGRAM {
        return Err(DecodeError::Malformed);
    }
    if bytes[0] == OPCODE_CNP {
        return Err(check_cnp(bytes, src, dst));
    }
    let info = info_of_code(bytes[0]).ok_or(DecodeError::Malformed)?;
    let hdr_len = info.header_len();
    let pad = usize::from((bytes[1] >> 4) & 3);
    let body = bytes.len() - ICRC_LEN;
    // Headers, payload and pad make whole 4-byte words in every IBA packet.
    if hdr_len > SLOT_DATA || hdr_len + pad > body || body % 4 != 0 {
        return Err(DecodeError::Malformed);
    }
    let len = body - hdr_len - pad;
    if len > MAX_PAYLOAD {
        return Err(DecodeError::Malformed);
    }
    let carried = u32::from_le_bytes([
        bytes[body],
        bytes[body + 1],
        bytes[body + 2],
        bytes[body + 3],
    ]);
    let with_id_zero = icrc(src, dst, &[&bytes[..body]]).ok_or(DecodeError::Malformed)?;
    // IP ID 0 is what Linux (and this link) sends with DF; a peer that sends another ID
    // covers it with its ICRC, which a UDP socket cannot see: solve for the one ID that
    // makes the ICRC right (the CRC is affine in the ID's 16 bits), if there is one.
    if with_id_zero != carried {
        let id = if src.is_ipv4() {
            shmhca_proto::roce::solve_ipv4_id(with_id_zero, carried, body)
        } else {
            None
        };
        let dest_qp = u32::from_be_bytes([0, bytes[5], bytes[6], bytes[7]]);
        let believable = match (id, ids) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(id), Some(ids)) => ids.accept(dest_qp, id),
        };
        if !believable {
            return Err(DecodeError::Icrc);
        }
    }
    let mut slot = PacketSlot {
        hdr_len: hdr_len as u8,
        payload_len: len as u32,
        ..PacketSlot::default()
    };
    slot.data[..hdr_len].copy_from_slice(&bytes[..hdr_len]);
    if len == 0 {
        slot.kind = KIND_NONE;
    } else if hdr_len + len <= SLOT_DATA {
        slot.kind = KIND_INLINE;
        slot.data[hdr_len..hdr_len + len].copy_from_slice(&bytes[hdr_len..hdr_len + len]);
    } else {
        slot.kind = KIND_DIRECT;
        slot.payload_off = payload_base + hdr_len as u64;
    }
    Ok(slot)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::slot::RxPacket;

    fn err(r: Result<PacketSlot, DecodeError>) -> Option<DecodeError> {
        r.err()
    }

    fn v4(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// A Send-only header stack to QP 0x12 at PSN 5 with pad count `pad`.
    fn send_headers(pad: u8) -> [u8; 12] {
        let mut h = [0u8; 12];
        h[0] = 0x04; // RC Send Only
        h[1] = pad << 4;
        h[2..4].copy_from_slice(&0xFFFFu16.to_be_bytes());
        h[5..8].copy_from_slice(&[0, 0, 0x12]);
        h[11] = 5;
        h
    }

    /// The ICRC agrees with the capture's (IPv4, checked there against hardware and rxe)
    /// for the same IP header.
    #[test]
    fn the_ipv4_icrc_is_the_captures() {
        let src = v4("10.0.0.1:49153");
        let dst = v4("10.0.0.2:4791");
        let mut t = send_headers(0).to_vec();
        t.extend_from_slice(b"payload!");
        let framing = crate::trace::roce::frame_headers(
            crate::trace::roce::Endpoint::engine(1),
            crate::trace::roce::Endpoint::engine(2),
            0,
            0x12 | 0x1000, // a QPN whose source port is 0xC000 | 0x1001 = 49153
            t.len(),
        )
        .unwrap();
        // The capture derives its source port from the QP: use the same one.
        let sport = u16::from_be_bytes([framing[34], framing[35]]);
        assert_eq!(sport, 0xD012);
        let ours = icrc(v4(&format!("10.0.0.1:{sport}")), dst, &[&t]).unwrap();
        let theirs = crate::trace::roce::icrc(
            framing[14..34].try_into().unwrap(),
            framing[34..42].try_into().unwrap(),
            &[&t],
        );
        assert_eq!(ours, theirs);
        // And the port is part of it.
        assert_ne!(icrc(src, dst, &[&t]).unwrap(), theirs);
    }

    #[test]
    fn a_split_bth_is_masked_the_same() {
        let (s, d) = (v4("198.18.0.1:4791"), "[fd00::2]:4791".parse().unwrap());
        let mut t = send_headers(1).to_vec();
        t.extend_from_slice(&[1, 2, 3, 0]);
        let whole = icrc(s, d, &[&t]).unwrap();
        for cut in 0..t.len() {
            assert_eq!(
                icrc(s, d, &[&t[..cut], &t[cut..]]).unwrap(),
                whole,
                "cut {cut}"
            );
        }
        // resv8a (byte 4) does not count, byte 3 does.
        let mut u = t.clone();
        u[4] ^= 0xC0;
        assert_eq!(icrc(s, d, &[&u]).unwrap(), whole);
        u[3] ^= 1;
        assert_ne!(icrc(s, d, &[&u]).unwrap(), whole);
    }

    /// A peer that sends an IPv4 ID other than 0 covers it with its ICRC, which the socket
    /// cannot see: the datagram is accepted (the one ID that fits is solved for), every
    /// single-bit error in it is still caught, and an IPv6 packet has no ID to solve for.
    /// A link takes a peer QP's nonzero IDs when they follow on from the last one (a
    /// counting sender), not a corrupt packet that happens to solve for a far one.
    #[test]
    fn solved_ids_must_follow_on_per_destination_qp() {
        let (s, d) = (v4("198.18.0.1:49200"), v4("198.18.0.2:4791"));
        let mut t = send_headers(2).to_vec();
        t.extend_from_slice(b"hello!\0\0");
        let with = |id: u16, qp: u8| {
            let mut p = t.clone();
            p[7] = qp;
            let crc = icrc_with_id(s, d, id, &[&p]).unwrap();
            p.extend_from_slice(&crc.to_le_bytes());
            p
        };
        let mut ids = IpIds::default();
        let ok = |p: &[u8], ids: &mut IpIds| decode_from(p, s, d, 0, Some(ids)).is_ok();
        assert!(ok(&with(0x1234, 0x12), &mut ids), "the first learns");
        assert!(ok(&with(0x1235, 0x12), &mut ids));
        assert!(ok(&with(0x1300, 0x12), &mut ids), "within AHEAD");
        assert!(ok(&with(0x12f0, 0x12), &mut ids), "within BEHIND");
        assert!(!ok(&with(0x9000, 0x12), &mut ids), "far off");
        assert!(
            ok(&with(0x9000, 0x13), &mut ids),
            "another QP learns its own"
        );
        assert!(ok(&with(0, 0x12), &mut ids), "ID 0 is never solved for");
        // The permissive form takes any solvable ID.
        assert!(decode(&with(0x9000, 0x12), s, d, 0).is_ok());
        // At most TRACKED QPs are remembered: the oldest is forgotten and learns again.
        for q in 0..=IpIds::TRACKED as u32 {
            assert!(ids.accept(1000 + q, 0x107));
        }
        assert!(ids.last.len() <= IpIds::TRACKED);
        assert!(ids.accept(1000, 0x8000), "forgotten, so learned again");
    }

    /// GSO segments' IDs (below 64) are taken from any peer QP and move no track: forged
    /// datagrams that push a QP's track far off (hostile review M1: eight of them, 4,096
    /// apart, each within AHEAD of the last) do not make the segments of a GSO sender —
    /// shmhca's, Linux's — unbelievable. (A peer that counts its IDs up, as a NIC does,
    /// can still be pushed off: the track moves before the engine checks the PSN.)
    #[test]
    fn gso_segment_ids_are_taken_and_move_no_track() {
        let mut ids = IpIds::default();
        assert!(ids.accept(7, 0x1000));
        for k in 1..=8u16 {
            assert!(ids.accept(7, 0x1000 + 0x1000 * k), "forged step {k}");
        }
        for seg in 1..64u16 {
            assert!(ids.accept(7, seg), "segment {seg}");
        }
        assert_eq!(ids.last, [(7, 0x9000)], "segments moved no track");
        assert!(ids.accept(8, 3), "an untracked QP's segment");
        assert!(
            ids.last.iter().all(|(q, _)| *q != 8),
            "and it is not tracked"
        );
    }

    #[test]
    fn a_nonzero_ipv4_id_is_solved_for_and_errors_are_still_caught() {
        let (s, d) = (v4("198.18.0.1:49200"), v4("198.18.0.2:4791"));
        let mut t = send_headers(2).to_vec();
        t.extend_from_slice(b"hello!\0\0");
        for id in [1u16, 0x1234, 0xFFFF] {
            let crc = icrc_with_id(s, d, id, &[&t]).unwrap();
            assert_ne!(Some(crc), icrc(s, d, &[&t]), "the ID is covered");
            let mut dgram = t.clone();
            dgram.extend_from_slice(&crc.to_le_bytes());
            let got = decode(&dgram, s, d, 0).unwrap();
            assert_eq!(&got.data[12..18], b"hello!");
            for byte in 0..dgram.len() {
                if byte == 4 {
                    continue; // resv8a: masked
                }
                for bit in 0..8 {
                    let mut bad = dgram.clone();
                    bad[byte] ^= 1 << bit;
                    assert!(
                        decode(&bad, s, d, 0).is_err(),
                        "id {id} byte {byte} bit {bit}"
                    );
                }
            }
        }
        let (s6, d6) = (
            "[fd00::1]:49200".parse().unwrap(),
            "[fd00::2]:4791".parse().unwrap(),
        );
        let crc = icrc_with_id(s, d, 0x1234, &[&t]).unwrap();
        let mut dgram = t.clone();
        dgram.extend_from_slice(&crc.to_le_bytes());
        assert_eq!(err(decode(&dgram, s6, d6, 0)), Some(DecodeError::Icrc));
    }

    #[test]
    fn packets_round_trip_inline_and_by_reference_and_every_flipped_byte_is_caught() {
        let (s, d) = (v4("127.0.0.1:4791"), v4("127.0.0.2:4791"));
        let arena = Mem::private(8192);
        let data: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
        arena.write(100, &data).unwrap();
        for (len, pad) in [(0usize, 0u8), (5, 3), (28, 0), (29, 3), (3000, 0)] {
            let mut slot = PacketSlot {
                hdr_len: 12,
                ..PacketSlot::default()
            };
            slot.data[..12].copy_from_slice(&send_headers(pad));
            slot.payload_len = len as u32;
            if len == 0 {
                slot.kind = KIND_NONE;
            } else if len <= 28 {
                slot.kind = KIND_INLINE;
                slot.data[12..12 + len].copy_from_slice(&data[..len]);
            } else {
                slot.kind = KIND_DIRECT;
                slot.payload_off = 100;
            }
            let mut buf = vec![0u8; 4160];
            let n = encode(&[slot], Some(&arena), s, d, &mut buf).unwrap();
            assert_eq!(n, 12 + len + usize::from(pad) + 4);
            let got = decode(&buf[..n], s, d, 1 << 20).unwrap();
            let pkt = RxPacket::parse(&got, &[]).unwrap();
            assert_eq!(pkt.bth().dest_qp.get(), 0x12);
            assert_eq!(got.payload_len as usize, len);
            match got.kind {
                KIND_INLINE => assert_eq!(&got.data[12..12 + len], &data[..len]),
                KIND_DIRECT => assert_eq!(got.payload_off, (1 << 20) + 12),
                k => assert_eq!((k, len), (KIND_NONE, 0)),
            }
            // Every single-bit flip is an ICRC failure or malformed, never a packet.
            for byte in 0..n {
                if byte == 4 {
                    continue; // resv8a: masked
                }
                let mut bad = buf[..n].to_vec();
                bad[byte] ^= 0x10;
                assert!(decode(&bad, s, d, 0).is_err(), "len {len} byte {byte}");
            }
            // The wrong source (address or port) fails too.
            assert_eq!(
                err(decode(&buf[..n], v4("127.0.0.3:4791"), d, 0)),
                Some(DecodeError::Icrc)
            );
        }
    }

    #[test]
    fn short_long_and_unknown_datagrams_are_malformed_never_a_panic() {
        let (s, d) = (v4("127.0.0.1:4791"), v4("127.0.0.2:4791"));
        for n in 0..MIN_DATAGRAM {
            assert_eq!(
                err(decode(&vec![0u8; n], s, d, 0)),
                Some(DecodeError::Malformed)
            );
        }
        // An RDMA Write First (BTH + RETH = 28) in 20 bytes; pad larger than the rest.
        let mut w = vec![0u8; 20];
        w[0] = 0x06;
        assert_eq!(err(decode(&w, s, d, 0)), Some(DecodeError::Malformed));
        let mut p = send_headers(3).to_vec();
        p.extend_from_slice(&[0, 0, 0, 0]);
        p.truncate(16);
        p[1] = 3 << 4;
        assert!(decode(&p, s, d, 0).is_err());
        // A Send Only of 5 payload bytes without pad (12 + 5 = 17: not whole words), its
        // ICRC right: malformed; with its 3 bytes of pad, accepted.
        let mut odd = send_headers(0).to_vec();
        odd.extend_from_slice(&[1, 2, 3, 4, 5]);
        let crc = icrc(s, d, &[&odd]).unwrap();
        let mut whole = odd.clone();
        odd.extend_from_slice(&crc.to_le_bytes());
        assert_eq!(err(decode(&odd, s, d, 0)), Some(DecodeError::Malformed));
        whole[1] |= 3 << 4;
        whole.extend_from_slice(&[0, 0, 0]);
        let crc = icrc(s, d, &[&whole]).unwrap();
        whole.extend_from_slice(&crc.to_le_bytes());
        assert!(decode(&whole, s, d, 0).is_ok());
        // A CNP: counted as one when it is one (length, ICRC), else malformed or a bad
        // ICRC like anything else.
        let mut cnp = vec![0u8; CNP_LEN];
        cnp[0] = OPCODE_CNP;
        cnp[5..8].copy_from_slice(&[0, 0, 0x12]);
        let crc = icrc(s, d, &[&cnp]).unwrap();
        cnp.extend_from_slice(&crc.to_le_bytes());
        assert_eq!(err(decode(&cnp, s, d, 0)), Some(DecodeError::Cnp));
        let mut bad = cnp.clone();
        bad[20] ^= 1;
        assert_eq!(err(decode(&bad, s, d, 0)), Some(DecodeError::Icrc));
        assert_eq!(
            err(decode(&cnp[..CNP_LEN], s, d, 0)),
            Some(DecodeError::Malformed),
            "too short for a CNP"
        );
        // Unknown opcodes.
        for op in [0x15u8, 0xFF] {
            let mut b = vec![0u8; 64];
            b[0] = op;
            assert_eq!(
                err(decode(&b, s, d, 0)),
                Some(DecodeError::Malformed),
                "{op:#x}"
            );
        }
        // A payload over 4096 bytes.
        let mut big = send_headers(0).to_vec();
        big.resize(12 + 4097 + 4, 0);
        assert_eq!(err(decode(&big, s, d, 0)), Some(DecodeError::Malformed));
        // Arbitrary bytes of every length up to a buffer: no panic.
        let mut x = 0x9E37_79B9u32;
        for n in 0..600 {
            let b: Vec<u8> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    x as u8
                })
                .collect();
            let _ = decode(&b, s, d, 0);
        }
    }

    /// The CNP this side sends is the annex's format, byte for byte the ConnectX-4
    /// capture's transport packet for the same QP (BECN, P_Key 0xFFFF, PSN 0, 16 zero
    /// bytes), and the receiving end's check takes it as a CNP, over IPv4 and IPv6; a
    /// short buffer is no room, never a panic.
    #[test]
    fn a_cnp_is_written_as_the_annex_and_hardware_have_it() {
        let capture: [u8; 28] = [
            0x81, 0x00, 0xff, 0xff, 0x40, 0x00, 0x01, 0x18, 0x00, 0x00, 0x00, 0x00, 0, 0, 0, 0, 0,
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ];
        let pairs: [(SocketAddr, SocketAddr); 2] = [
            (v4("10.0.17.1:49152"), v4("10.0.18.1:4791")),
            (
                "[fd00::1]:49152".parse().unwrap(),
                "[fd00::2]:4791".parse().unwrap(),
            ),
        ];
        for (s, d) in pairs {
            let mut buf = [0xAAu8; 64];
            let n = encode_cnp(crate::Qpn::new(0x118), s, d, &mut buf).unwrap();
            assert_eq!(n, CNP_LEN + ICRC_LEN);
            assert_eq!(buf[..CNP_LEN], capture);
            assert_eq!(
                buf[CNP_LEN..n],
                icrc(s, d, &[&capture]).unwrap().to_le_bytes()
            );
            assert_eq!(err(decode(&buf[..n], s, d, 0)), Some(DecodeError::Cnp));
            // From another source it fails its ICRC.
            let other = SocketAddr::new(d.ip(), 49153);
            assert_eq!(err(decode(&buf[..n], other, d, 0)), Some(DecodeError::Icrc));
            assert_eq!(
                encode_cnp(crate::Qpn::new(0x118), s, d, &mut buf[..n - 1]),
                Err(EncodeError::NoRoom)
            );
        }
    }

    /// A positive Ack riding in a request's line goes as a datagram of its own after the
    /// request, as an Acknowledge to the carrier's destination QP with the riding PSN and
    /// MSN; a line without one yields none.
    #[test]
    fn a_riding_ack_becomes_an_acknowledge_datagram() {
        use crate::wire::opcode::Opcode;
        use crate::wire::slot::{riding_word, set_riding_ack};
        let (s, d) = (v4("127.0.0.1:4791"), v4("127.0.0.2:4791"));
        let mut carrier = PacketSlot {
            hdr_len: 12,
            kind: KIND_INLINE,
            payload_len: 8,
            ..PacketSlot::default()
        };
        carrier.data[..12].copy_from_slice(&send_headers(0));
        carrier.data[12..20].copy_from_slice(b"8 bytes!");
        let mut buf = vec![0u8; 4160];
        assert!(riding_ack_datagram(&carrier, s, d, &mut buf).is_none());
        assert!(set_riding_ack(&mut carrier, riding_word(77, 0x1F, 9)));
        // The carrier goes as it is, without the Ack.
        let n = encode(&[carrier], None, s, d, &mut buf).unwrap();
        assert_eq!(n, 12 + 8 + 4);
        let req = decode(&buf[..n], s, d, 0).unwrap();
        assert_eq!(
            RxPacket::parse(&req, &[]).unwrap().bth().opcode,
            Opcode::SendOnly
        );
        let n = riding_ack_datagram(&carrier, s, d, &mut buf)
            .unwrap()
            .unwrap();
        assert_eq!(n, 12 + 4 + 4, "BTH, AETH, ICRC");
        let ack = decode(&buf[..n], s, d, 0).unwrap();
        let pkt = RxPacket::parse(&ack, &[]).unwrap();
        assert_eq!(pkt.bth().opcode, Opcode::Acknowledge);
        assert_eq!(pkt.bth().dest_qp.get(), 0x12);
        assert_eq!(pkt.psn().get(), 77);
        assert_eq!(pkt.aeth().unwrap().msn.get(), 9);
    }
}
