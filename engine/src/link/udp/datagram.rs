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
//! makes its ICRC right ([`shmhca_proto::roce::solve_ipv4_id`]) and that ID is believable
//! for its peer QP ([`super::ip_ids`]: what that QP's peer is known to send). The CRC is the protocol
//! crate's codec, [`shmhca_proto::roce::Icrc`], the capture's too.
#![forbid(unsafe_code)]

use std::net::{SocketAddr, SocketAddrV6};

use super::ip_ids::{IpIds, Seen};
use crate::mem::Mem;
use crate::psn::Psn;
use crate::wire::slot::{
    ACK_FLAG, KIND_DIRECT, KIND_GATHER, KIND_INLINE, KIND_NONE, PacketSlot, SLOT_DATA,
    gather_entry, riding_ack,
};
use crate::wire::{Qpn, bth};
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
    decode_from(bytes, src, dst, payload_base, None, |_, _, _| true)
}

/// [`decode`], where the IPv4 ID the ICRC holds with must be believable to `ids` (the
/// link's [`IpIds`], which `is_new` — whether the destination QP would take the packet's
/// PSN as new — teaches; `None`: any ID the ICRC can be solved for is taken).
pub(crate) fn decode_from(
    bytes: &[u8],
    src: SocketAddr,
    dst: SocketAddr,
    payload_base: u64,
    ids: Option<&mut IpIds>,
    is_new: impl Fn(Qpn, bool, Psn) -> bool,
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
    // makes the ICRC right (the CRC is affine in the ID's 16 bits), if there is one, and
    // ask `ids` whether that ID is believable (see `super::ip_ids`).
    let id = if with_id_zero == carried {
        Some(0)
    } else if src.is_ipv4() {
        shmhca_proto::roce::solve_ipv4_id(with_id_zero, carried, body)
    } else {
        None
    };
    let believable = match (id, ids) {
        (None, _) => false,
        (Some(_), None) => true,
        (Some(id), Some(ids)) => {
            let seen = Seen {
                qpn: Qpn::new(u32::from_be_bytes([0, bytes[5], bytes[6], bytes[7]])),
                id,
                request: info.request,
                psn: Psn::new(u32::from_be_bytes([0, bytes[9], bytes[10], bytes[11]])),
                digest: with_id_zero,
            };
            ids.believe(seen, is_new)
        }
    };
    if !believable {
        return Err(DecodeError::Icrc);
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

    /// A Send Only to `qpn` at `psn` with `payload`, its ICRC for IPv4 ID `id`.
    fn send_only(
        s: SocketAddr,
        d: SocketAddr,
        id: u16,
        qpn: u32,
        psn: u32,
        payload: &[u8],
    ) -> Vec<u8> {
        let mut p = send_headers(0).to_vec();
        p[5..8].copy_from_slice(&qpn.to_be_bytes()[1..]);
        p[9..12].copy_from_slice(&psn.to_be_bytes()[1..]);
        p.extend_from_slice(payload);
        let crc = icrc_with_id(s, d, id, &[&p]).unwrap();
        p.extend_from_slice(&crc.to_le_bytes());
        p
    }

    /// Hostile review M1 (its test, with the engine's word on each PSN): a peer that counts
    /// its IDs up is not cut off by forged datagrams that know its address and the QPN but
    /// not the PSN — eight of them whose IDs step by AHEAD move nothing.
    #[test]
    fn review_forged_datagrams_cannot_poison_a_peers_ip_id_track() {
        let (peer, me) = (v4("198.18.0.1:49200"), v4("198.18.0.2:4791"));
        let qpn = 0x12;
        let mut ids = IpIds::default();
        ids.watch(Qpn::new(qpn));
        let epsn = std::cell::Cell::new(0u32);
        let ok = |b: &[u8], ids: &mut IpIds| {
            let e = epsn.get();
            let r = decode_from(b, peer, me, 0, Some(ids), |_, _, p: Psn| p.get() == e);
            if r.is_ok() && u32::from(b[11]) == e {
                epsn.set(e + 1); // the engine takes it
            }
            r
        };
        let mut genuine_id = 0x1000u16;
        for psn in 0..4 {
            genuine_id = genuine_id.wrapping_add(1);
            assert!(
                ok(
                    &send_only(peer, me, genuine_id, qpn, psn, b"real"),
                    &mut ids
                )
                .is_ok()
            );
        }
        let mut forged_id = genuine_id;
        for _ in 0..8 {
            forged_id = forged_id.wrapping_add(4096);
            let _ = ok(
                &send_only(peer, me, forged_id, qpn, 0x00dead, b"junk"),
                &mut ids,
            );
        }
        genuine_id = genuine_id.wrapping_add(1);
        let r = ok(&send_only(peer, me, genuine_id, qpn, 4, b"real"), &mut ids);
        assert!(
            r.is_ok(),
            "a genuine datagram (ID {genuine_id:#x}) refused as {:?}",
            r.err()
        );
    }

    /// Hostile review L2 (its test): a peer QP that sends ID 0 has its ICRC checked with all
    /// 32 bits — no ID is solved for it beyond a GSO segment's — even when every corrupt
    /// datagram carries a PSN the QP would take as new (corruption leaves the PSN whole).
    #[test]
    fn review_a_linux_peers_corruption_is_caught_with_the_full_32_bit_icrc() {
        let (peer, me) = (v4("198.18.0.1:4791"), v4("198.18.0.2:4791"));
        let mut ids = IpIds::default();
        ids.watch(Qpn::new(0x12));
        let new = |_: Qpn, _: bool, _: Psn| true;
        let good = send_only(peer, me, 0, 0x12, 7, b"payload!");
        assert!(decode_from(&good, peer, me, 0, Some(&mut ids), new).is_ok());
        let (mut solvable, mut accepted) = (0, 0);
        for x in 1..=300_000u32 {
            let mut bad = good.clone();
            bad[12..16]
                .iter_mut()
                .zip(x.to_le_bytes())
                .for_each(|(b, v)| *b ^= v);
            let body = bad.len() - ICRC_LEN;
            let carried = u32::from_le_bytes(bad[body..].try_into().unwrap());
            let zero = icrc(peer, me, &[&bad[..body]]).unwrap();
            solvable +=
                usize::from(shmhca_proto::roce::solve_ipv4_id(zero, carried, body).is_some());
            if decode_from(&bad, peer, me, 0, Some(&mut ids), new).is_ok() {
                accepted += 1;
            }
        }
        assert!(
            solvable > 0,
            "the test corrupts some datagrams that solve for an ID"
        );
        assert_eq!(
            accepted, 0,
            "corrupted datagrams from an ID-0 peer accepted"
        );
    }

    /// What a link believes of solved IDs, through `decode_from`: a counting peer QP's
    /// first packet with a new PSN teaches its ID, the next ones follow on, a far one is
    /// refused; a QP no route made is told nothing (its ID 0 passes, a solved one does not).
    #[test]
    fn solved_ids_must_follow_on_per_destination_qp() {
        let (s, d) = (v4("198.18.0.1:49200"), v4("198.18.0.2:4791"));
        let mut ids = IpIds::default();
        ids.watch(Qpn::new(0x12));
        let new = |_: Qpn, _: bool, _: Psn| true;
        let ok = |id: u16, qp: u32, ids: &mut IpIds| {
            decode_from(
                &send_only(s, d, id, qp, 1, b"hello!\0\0"),
                s,
                d,
                0,
                Some(ids),
                new,
            )
            .is_ok()
        };
        assert!(ok(0x1234, 0x12, &mut ids), "the first learns");
        assert!(ok(0x1235, 0x12, &mut ids));
        assert!(ok(0x1300, 0x12, &mut ids), "within AHEAD");
        assert!(ok(0x12f0, 0x12, &mut ids), "within BEHIND");
        assert!(!ok(0x9000, 0x12, &mut ids), "far off");
        assert!(ok(0, 0x12, &mut ids), "ID 0: the ICRC holds as it is");
        assert!(
            !ok(0x9000, 0x13, &mut ids),
            "no route: nothing to follow on from"
        );
        assert!(ok(0, 0x13, &mut ids));
        // The permissive form takes any solvable ID.
        assert!(decode(&send_only(s, d, 0x9000, 0x12, 1, b"hello!\0\0"), s, d, 0).is_ok());
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
