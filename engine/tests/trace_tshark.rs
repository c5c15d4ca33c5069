//! The pcap/RoCEv2 encoder, checked by an independent decoder: tshark (Wireshark) must
//! decode one packet of every RC opcode as InfiniBand, with the right opcode, PSN, QP and
//! extended-header fields, with no malformed-packet or warning-level expert info, and
//! with the Invariant CRC the packet should have.
//!
//! Wireshark 4.0 shows the Invariant CRC but does not verify it, so the CRC tshark reports
//! is compared with one computed here by a separate bitwise CRC-32 in the formulation of the
//! Linux soft-RoCE driver (the encoder's own CRC, the RoCEv2 codec's in `shmhca::roce`, is
//! also checked against a hardware capture and scapy in its unit tests). tshark is run with
//! IPv4 header checksum validation on. The codec's datagrams for the UDP link, over IPv4
//! and IPv6, are framed here by hand and checked the same way.
//!
//! Wireshark's RPC-over-RDMA heuristic guesses at every Send payload and reports the
//! made-up bytes below as a malformed RPC-over-RDMA message; that dissector is about the
//! application payload, not the framing, so it is switched off for these checks
//! (`--disable-heuristic rpcrdma_infiniband`).
//!
//! Without tshark the tests skip, printing one line that says what to install
//! (`DEBIAN_FRONTEND=noninteractive apt-get install -y tshark`); with
//! `SHMHCA_REQUIRE_TSHARK=1` (as `.ci/run` sets) a missing tshark fails them instead.

mod tshark_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use shmhca::psn::Psn;
use shmhca::trace::pcap::{Endpoint, PcapWriter, TimestampPrecision};
use shmhca::wire::opcode::{Headers, Opcode};
use shmhca::wire::packet::{MAX_HEADER_LEN, PacketRepr};
use shmhca::wire::{
    AethRepr, AtomicAckEthRepr, AtomicEthRepr, BthRepr, CreditCode, IethRepr, ImmDtRepr, Msn,
    Position, Qpn, RethRepr, Syndrome,
};

const FIRST_PSN: u32 = 0xFF_FFF0; // the capture's PSNs wrap through 0
const DEST_QP: u32 = 0x00_0123;

/// One packet per RC opcode, with a payload (and pad, to a multiple of 4) where the
/// opcode carries one.
fn packets() -> Vec<(PacketRepr, Vec<u8>)> {
    Opcode::ALL
        .iter()
        .enumerate()
        .map(|(i, &op)| {
            let info = op.info().unwrap();
            let h = info.headers;
            let payload: Vec<u8> = if info.payload {
                // Lengths 1..=23 exercise every pad count.
                let len = i + 1;
                let mut p: Vec<u8> = (0..len).map(|b| b"shmhca-payload"[b % 14]).collect();
                p.resize(len.next_multiple_of(4), 0);
                p
            } else {
                Vec::new()
            };
            let mut bth = BthRepr::new(op, Qpn::new(DEST_QP), Psn::new(FIRST_PSN).add(i as u32));
            bth.pad_count = if info.payload {
                ((i + 1).next_multiple_of(4) - (i + 1)) as u8
            } else {
                0
            };
            bth.ack_req = info.request && matches!(info.position, Position::Last | Position::Only);
            let repr = PacketRepr {
                reth: h.contains(Headers::RETH).then_some(RethRepr {
                    va: 0x0000_7F00_0000_1000 + i as u64,
                    rkey: 0x1234_0000 + i as u32,
                    dma_len: 4096,
                }),
                atomic_eth: h.contains(Headers::ATOMIC_ETH).then_some(AtomicEthRepr {
                    va: 0x0000_7F00_0000_2000,
                    rkey: 0x0BAD_CAFE,
                    swap_add: 42,
                    compare: 7,
                }),
                aeth: h.contains(Headers::AETH).then_some(AethRepr {
                    syndrome: Syndrome::Ack {
                        credits: CreditCode::new(5),
                    },
                    msn: Msn::new(1000 + i as u32),
                }),
                atomic_ack_eth: h
                    .contains(Headers::ATOMIC_ACK_ETH)
                    .then_some(AtomicAckEthRepr {
                        orig: 0x0123_4567_89AB_CDEF,
                    }),
                immdt: h.contains(Headers::IMMDT).then_some(ImmDtRepr {
                    imm: 0xCAFE_0000 + i as u32,
                }),
                ieth: h.contains(Headers::IETH).then_some(IethRepr {
                    rkey: 0x5EED_0000 + i as u32,
                }),
                ..PacketRepr::new(bth)
            };
            (repr, payload)
        })
        .collect()
}

fn capture_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("shmhca-{name}-{}.pcap", std::process::id()))
}

fn write_capture(path: &Path, precision: TimestampPrecision) -> Vec<(PacketRepr, Vec<u8>)> {
    let packets = packets();
    let file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut pcap = PcapWriter::with_precision(file, precision).unwrap();
    for (i, (repr, payload)) in packets.iter().enumerate() {
        let mut headers = [0u8; MAX_HEADER_LEN];
        let n = repr.emit(&mut headers).unwrap();
        let (src, dst) = if repr.info().unwrap().request {
            (Endpoint::engine(1), Endpoint::engine(2))
        } else {
            (Endpoint::engine(2), Endpoint::engine(1))
        };
        let ts = Duration::new(1_700_000_000, 1_000 * i as u32);
        // Payload in two pieces, as a scatter/gather list would give it.
        let (a, b) = payload.split_at(payload.len() / 2);
        pcap.write_packet(ts, src, dst, &[&headers[..n], a, b])
            .unwrap();
    }
    pcap.flush().unwrap();
    packets
}

/// The options every check runs tshark with (see the module docs).
const TSHARK_OPTS: [&str; 4] = [
    "-o",
    "ip.check_checksum:TRUE",
    "--disable-heuristic",
    "rpcrdma_infiniband",
];

/// Whether tshark is there (prints the skip line once if not).
fn tshark_available() -> bool {
    tshark_support::tshark_available("trace_tshark: the tshark tests")
}

fn tshark(file: &Path, args: &[&str]) -> String {
    let out = match Command::new("tshark")
        .arg("-r")
        .arg(file)
        .args(TSHARK_OPTS)
        .args(args)
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            panic!(
                "tshark is not installed; this test needs it: {}",
                tshark_support::INSTALL_HINT
            )
        }
        Err(e) => panic!("could not run tshark: {e}"),
    };
    assert!(
        out.status.success(),
        "tshark {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The frames of a classic pcap file, read here without the encoder's help.
fn pcap_frames(bytes: &[u8]) -> Vec<&[u8]> {
    let magic = u32::from_le_bytes(bytes[0..4].try_into().unwrap());
    assert!(
        magic == 0xA1B2_C3D4 || magic == 0xA1B2_3C4D,
        "magic {magic:#x}"
    );
    assert_eq!(
        u32::from_le_bytes(bytes[20..24].try_into().unwrap()),
        1,
        "linktype"
    );
    let mut frames = Vec::new();
    let mut at = 24;
    while at < bytes.len() {
        let incl = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()) as usize;
        let orig = u32::from_le_bytes(bytes[at + 12..at + 16].try_into().unwrap()) as usize;
        assert_eq!(incl, orig);
        frames.push(&bytes[at + 16..at + 16 + incl]);
        at += 16 + incl;
    }
    assert_eq!(at, bytes.len());
    frames
}

/// The ICRC of a RoCEv2 frame (IPv4 or IPv6), computed bit by bit the way the Linux
/// soft-RoCE driver does: raw CRC register seeded with 0xDEBB20E3 (eight 0xFF bytes already
/// absorbed), the masked IP and UDP headers and BTH, the rest, and a final inversion.
fn reference_icrc(frame: &[u8]) -> u32 {
    fn crc32_le_raw(mut crc: u32, data: &[u8]) -> u32 {
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
        }
        crc
    }
    let mut pseudo = frame[14..frame.len() - 4].to_vec();
    let ip_len = if pseudo[0] >> 4 == 6 {
        pseudo[0] |= 0x0F; // IPv6 traffic class, flow label, hop limit
        for i in [1, 2, 3, 7] {
            pseudo[i] = 0xFF;
        }
        40
    } else {
        for i in [1, 8, 10, 11] {
            pseudo[i] = 0xFF; // IPv4 TOS, TTL, header checksum
        }
        20
    };
    pseudo[ip_len + 6] = 0xFF; // UDP checksum
    pseudo[ip_len + 7] = 0xFF;
    pseudo[ip_len + 8 + 4] = 0xFF; // BTH resv8a
    !crc32_le_raw(0xDEBB_20E3, &pseudo)
}

#[test]
fn tshark_decodes_every_rc_opcode_as_infiniband() {
    if !tshark_available() {
        return;
    }
    let path = capture_path("opcodes");
    let packets = write_capture(&path, TimestampPrecision::Micro);
    let fields = [
        "frame.protocols",
        "_ws.col.Info",
        "infiniband.bth.opcode",
        "infiniband.bth.psn",
        "infiniband.bth.destqp",
        "infiniband.bth.padcnt",
        "infiniband.bth.a",
        "ip.checksum.status",
        "infiniband.reth.va",
        "infiniband.reth.r_key",
        "infiniband.reth.dmalen",
        "infiniband.aeth.syndrome",
        "infiniband.aeth.msn",
        "infiniband.atomiceth.swapdt",
        "infiniband.atomiceth.cmpdt",
        "infiniband.atomicacketh.origremdt",
        "infiniband.immdt",
        "infiniband.ieth",
        "data.len",
    ];
    let mut args = vec!["-T", "fields", "-E", "separator=|"];
    for f in &fields {
        args.extend(["-e", f]);
    }
    let out = tshark(&path, &args);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), packets.len(), "one line per packet:\n{out}");

    for (i, ((repr, payload), line)) in packets.iter().zip(&lines).enumerate() {
        let f: Vec<&str> = line.split('|').collect();
        assert_eq!(f.len(), fields.len(), "{line}");
        let info = repr.info().unwrap();
        let what = format!("packet {} ({:?}): {line}", i + 1, repr.bth.opcode);
        assert!(
            f[0].ends_with(":udp:infiniband") || f[0].ends_with(":udp:infiniband:data"),
            "{what}"
        );
        assert!(
            f[1].starts_with(&format!("{} QP=0x000123", info.name)),
            "{what}"
        );
        assert_eq!(f[2], repr.bth.opcode.code().to_string(), "{what}");
        assert_eq!(f[3], repr.bth.psn.get().to_string(), "{what}");
        assert_eq!(f[4], "0x000123", "{what}");
        assert_eq!(f[5], repr.bth.pad_count.to_string(), "{what}");
        assert_eq!(f[6], if repr.bth.ack_req { "1" } else { "0" }, "{what}");
        assert_eq!(
            f[7], "1",
            "IPv4 header checksum must verify as good: {what}"
        );
        // Wireshark shows the AtomicETH address and key under the RETH field names.
        let (va, rkey) = match (repr.reth, repr.atomic_eth) {
            (Some(r), _) => (format!("{:#018x}", r.va), format!("{:#010x}", r.rkey)),
            (None, Some(a)) => (format!("{:#018x}", a.va), format!("{:#010x}", a.rkey)),
            (None, None) => (String::new(), String::new()),
        };
        assert_eq!((f[8], f[9]), (va.as_str(), rkey.as_str()), "{what}");
        assert_eq!(
            f[10],
            repr.reth.map(|r| r.dma_len.to_string()).unwrap_or_default(),
            "{what}"
        );
        assert_eq!(
            f[11],
            repr.aeth
                .map(|a| a.syndrome.to_u8().to_string())
                .unwrap_or_default(),
            "{what}"
        );
        assert_eq!(
            f[12],
            repr.aeth
                .map(|a| a.msn.get().to_string())
                .unwrap_or_default(),
            "{what}"
        );
        assert_eq!(
            (f[13], f[14]),
            repr.atomic_eth
                .map(|a| (a.swap_add.to_string(), a.compare.to_string()))
                .as_ref()
                .map_or(("", ""), |(s, c)| (s.as_str(), c.as_str())),
            "{what}"
        );
        assert_eq!(
            f[15],
            repr.atomic_ack_eth
                .map(|a| a.orig.to_string())
                .unwrap_or_default(),
            "{what}"
        );
        // Wireshark lists the ImmDt and IETH bytes twice (header item and value item).
        let twice = |v: Option<u32>| v.map(|v| format!("{v:08x},{v:08x}")).unwrap_or_default();
        assert_eq!(f[16], twice(repr.immdt.map(|x| x.imm)), "{what}");
        assert_eq!(f[17], twice(repr.ieth.map(|x| x.rkey)), "{what}");
        // The payload tshark finds is exactly ours (pad included), ICRC excluded.
        let payload_len = if payload.is_empty() {
            String::new()
        } else {
            payload.len().to_string()
        };
        assert_eq!(f[18], payload_len, "{what}");
        assert_eq!(info.payload, !payload.is_empty(), "{what}");
    }
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn tshark_reports_the_icrc_a_reference_crc_expects() {
    if !tshark_available() {
        return;
    }
    for precision in [TimestampPrecision::Micro, TimestampPrecision::Nano] {
        let path = capture_path(&format!("icrc-{precision:?}"));
        let packets = write_capture(&path, precision);
        let bytes = std::fs::read(&path).unwrap();
        let frames = pcap_frames(&bytes);
        assert_eq!(frames.len(), packets.len());
        let out = tshark(
            &path,
            &[
                "-T",
                "fields",
                "-e",
                "infiniband.invariant.crc",
                "-e",
                "frame.time_epoch",
            ],
        );
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), frames.len());
        for (i, (frame, line)) in frames.iter().zip(&lines).enumerate() {
            let trailer: [u8; 4] = frame[frame.len() - 4..].try_into().unwrap();
            let expected = reference_icrc(frame);
            assert_eq!(trailer, expected.to_le_bytes(), "frame {}", i + 1);
            // tshark reads the trailer as a big-endian number.
            let (crc, time) = line.split_once('\t').unwrap();
            assert_eq!(
                crc,
                format!("{:#010x}", u32::from_be_bytes(trailer)),
                "frame {}",
                i + 1
            );
            let want_time = match precision {
                TimestampPrecision::Micro => format!("1700000000.{:06}", i),
                TimestampPrecision::Nano => format!("1700000000.{:09}", i * 1000),
            };
            assert!(
                time.starts_with(&want_time),
                "frame {}: time {time}, want {want_time}",
                i + 1
            );
        }
        std::fs::remove_file(&path).unwrap();
    }
}

const EXPERT_FILTER: &str = "_ws.malformed || _ws.expert.severity >= warning";

#[test]
fn tshark_finds_nothing_malformed_and_no_warnings() {
    if !tshark_available() {
        return;
    }
    let path = capture_path("expert");
    let packets = write_capture(&path, TimestampPrecision::Micro);
    let out = tshark(&path, &["-Y", EXPERT_FILTER]);
    assert_eq!(out, "", "tshark flagged packets:\n{out}");

    // The verbose decode shows every packet as InfiniBand with the headers it carries.
    let verbose = tshark(&path, &["-V"]);
    let decodes: Vec<&str> = verbose.split("\nFrame ").collect();
    assert_eq!(decodes.len(), packets.len());
    for ((repr, _), text) in packets.iter().zip(decodes) {
        let what = format!("{:?}", repr.bth.opcode);
        assert!(
            text.contains("\nInfiniBand\n    Base Transport Header\n"),
            "{what}:\n{text}"
        );
        let h = repr.headers();
        for (header, title) in [
            (Headers::RETH, "RDMA Extended Transport Header"),
            (Headers::AETH, "ACK Extended Transport Header"),
            (Headers::ATOMIC_ETH, "Atomic Extended Transport Header"),
            (
                Headers::ATOMIC_ACK_ETH,
                "Atomic ACK Extended Transport Header",
            ),
            (Headers::IMMDT, "Immediate Data"),
            (Headers::IETH, "RKey"),
        ] {
            assert_eq!(
                text.contains(title),
                h.contains(header),
                "{what}: {title}:\n{text}"
            );
        }
        assert!(text.contains("Invariant CRC: 0x"), "{what}:\n{text}");
    }
    std::fs::remove_file(&path).unwrap();
}

/// The expert check is live: a packet whose headers are cut short, and a frame whose IPv4
/// checksum is wrong, are both flagged.
#[test]
fn tshark_expert_check_catches_broken_packets() {
    if !tshark_available() {
        return;
    }
    let path = capture_path("broken");
    {
        let mut pcap = PcapWriter::create(&path).unwrap();
        // An Atomic Acknowledge without its AETH and AtomicAckETH (the encoder frames whatever
        // it is given).
        let mut bth = [0u8; 12];
        BthRepr::new(Opcode::AtomicAcknowledge, Qpn::new(DEST_QP), Psn::new(5))
            .emit(&mut shmhca::wire::bth::Packet::new_unchecked(&mut bth[..]));
        pcap.write_packet(
            Duration::from_secs(1),
            Endpoint::engine(2),
            Endpoint::engine(1),
            &[&bth],
        )
        .unwrap();
        // A good Send Only, whose IPv4 checksum is then corrupted below.
        let mut send = [0u8; 12];
        BthRepr::new(Opcode::SendOnly, Qpn::new(DEST_QP), Psn::new(6))
            .emit(&mut shmhca::wire::bth::Packet::new_unchecked(&mut send[..]));
        pcap.write_packet(
            Duration::from_secs(2),
            Endpoint::engine(1),
            Endpoint::engine(2),
            &[&send, b"data"],
        )
        .unwrap();
        pcap.flush().unwrap();
    }
    let mut bytes = std::fs::read(&path).unwrap();
    let second = 24 + 16 + (42 + 12 + 4) + 16;
    bytes[second + 14 + 10] ^= 0x55;
    std::fs::write(&path, &bytes).unwrap();

    let out = tshark(
        &path,
        &["-Y", EXPERT_FILTER, "-T", "fields", "-e", "frame.number"],
    );
    assert_eq!(out, "1\n2\n", "both broken frames must be flagged");
    std::fs::remove_file(&path).unwrap();
}

/// The RoCEv2 codec (`shmhca::roce`) frames datagrams for the UDP link over IPv4 and IPv6:
/// frames built around its datagrams decode as InfiniBand with nothing flagged, and carry
/// the ICRC the independent reference computes, whatever the variant fields hold.
#[test]
fn tshark_decodes_datagrams_the_roce_codec_seals_over_ipv4_and_ipv6() {
    use shmhca::roce;
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};

    if !tshark_available() {
        return;
    }
    let (qp_a, qp_b) = (Qpn::new(0x11), Qpn::new(DEST_QP));
    let sport = roce::source_port(0, qp_a, qp_b);
    let mut frames: Vec<(Vec<u8>, Opcode, u32)> = Vec::new();
    for (i, &(op, payload_len)) in [
        (Opcode::SendOnly, 20usize),
        (Opcode::RdmaWriteOnly, 64),
        (Opcode::SendOnly, 1024),
        (Opcode::Acknowledge, 0),
    ]
    .iter()
    .enumerate()
    {
        let psn = 0xFF_FFFE + i as u32;
        let mut repr = PacketRepr::new(BthRepr::new(op, qp_b, Psn::new(psn)));
        let info = op.info().unwrap();
        if info.headers.contains(Headers::RETH) {
            repr.reth = Some(RethRepr {
                va: 0x7F00_0000_1000,
                rkey: 0x1234,
                dma_len: payload_len as u32,
            });
        }
        if info.headers.contains(Headers::AETH) {
            repr.aeth = Some(AethRepr {
                syndrome: Syndrome::Ack {
                    credits: CreditCode::new(3),
                },
                msn: Msn::new(9),
            });
        }
        let mut datagram = vec![0u8; MAX_HEADER_LEN + payload_len + roce::ICRC_LEN];
        let n = repr.emit(&mut datagram).unwrap();
        for (k, b) in datagram[n..n + payload_len].iter_mut().enumerate() {
            *b = (k * 7 + i) as u8;
        }
        let transport_len = n + payload_len;
        let udp_len = (8 + transport_len + roce::ICRC_LEN) as u16;
        for v6 in [false, true] {
            let mut frame = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1];
            let mut d = datagram.clone();
            if v6 {
                let src: Ipv6Addr = "fd00:5348:4d::1".parse().unwrap();
                let dst: Ipv6Addr = "fd00:5348:4d::2".parse().unwrap();
                let len = roce::append_icrc_v6(
                    SocketAddrV6::new(src, sport, 0, 0),
                    SocketAddrV6::new(dst, roce::UDP_PORT, 0, 0),
                    &mut d,
                    transport_len,
                )
                .unwrap();
                d.truncate(len);
                frame.extend([0x86, 0xDD]);
                // Traffic class 0xB8 (EF), flow label 0x12345, hop limit 64: all masked.
                frame.extend([0x6B, 0x81, 0x23, 0x45]);
                frame.extend(udp_len.to_be_bytes());
                frame.extend([17, 64]);
                frame.extend(src.octets());
                frame.extend(dst.octets());
            } else {
                let (src, dst) = (Ipv4Addr::new(198, 18, 0, 1), Ipv4Addr::new(198, 18, 0, 2));
                let ip_id = 0x1234 * i as u16;
                let len = roce::append_icrc_v4(
                    SocketAddrV4::new(src, sport),
                    SocketAddrV4::new(dst, roce::UDP_PORT),
                    ip_id,
                    &mut d,
                    transport_len,
                )
                .unwrap();
                d.truncate(len);
                frame.extend([0x08, 0x00]);
                let mut ip = vec![0x45, 0x02]; // ECT(0): masked
                ip.extend((20 + udp_len).to_be_bytes());
                ip.extend(ip_id.to_be_bytes());
                ip.extend([0x40, 0, 63, 17, 0, 0]);
                ip.extend(src.octets());
                ip.extend(dst.octets());
                let sum = shmhca::trace::roce::ipv4_checksum(&ip);
                ip[10..12].copy_from_slice(&sum.to_be_bytes());
                frame.extend(ip);
            }
            let mut udp = sport.to_be_bytes().to_vec();
            udp.extend(roce::UDP_PORT.to_be_bytes());
            udp.extend(udp_len.to_be_bytes());
            udp.extend([0, 0]);
            udp.extend(&d);
            if v6 {
                // IPv6 forbids a zero UDP checksum (RFC 8200); the ICRC masks it anyway.
                let sum = udp6_checksum(&frame[22..38], &frame[38..54], &udp);
                udp[6..8].copy_from_slice(&sum.to_be_bytes());
            }
            frame.extend(udp);
            frames.push((frame, op, psn & 0xFF_FFFF));
        }
    }

    let path = capture_path("codec");
    let mut file = Vec::new();
    file.extend(0xA1B2_C3D4u32.to_le_bytes());
    file.extend(2u16.to_le_bytes());
    file.extend(4u16.to_le_bytes());
    file.extend([0; 8]);
    file.extend(65_535u32.to_le_bytes());
    file.extend(1u32.to_le_bytes()); // Ethernet
    for (i, (frame, _, _)) in frames.iter().enumerate() {
        file.extend((1_700_000_000 + i as u32).to_le_bytes());
        file.extend(0u32.to_le_bytes());
        file.extend((frame.len() as u32).to_le_bytes());
        file.extend((frame.len() as u32).to_le_bytes());
        file.extend(frame);
    }
    std::fs::write(&path, &file).unwrap();

    let out = tshark(
        &path,
        &["-o", "udp.check_checksum:TRUE", "-Y", EXPERT_FILTER],
    );
    assert_eq!(out, "", "tshark flagged packets:\n{out}");
    let out = tshark(
        &path,
        &[
            "-T",
            "fields",
            "-E",
            "separator=|",
            "-e",
            "frame.protocols",
            "-e",
            "infiniband.bth.opcode",
            "-e",
            "infiniband.bth.psn",
            "-e",
            "infiniband.bth.destqp",
            "-e",
            "udp.srcport",
            "-e",
            "infiniband.invariant.crc",
        ],
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), frames.len(), "{out}");
    for (i, ((frame, op, psn), line)) in frames.iter().zip(&lines).enumerate() {
        let f: Vec<&str> = line.split('|').collect();
        let what = format!("frame {}: {line}", i + 1);
        let ip = if i % 2 == 0 { ":ip:" } else { ":ipv6:" };
        assert!(f[0].contains(&format!("{ip}udp:infiniband")), "{what}");
        assert_eq!(f[1], op.code().to_string(), "{what}");
        assert_eq!(f[2], psn.to_string(), "{what}");
        assert_eq!(f[3], format!("{:#08x}", DEST_QP), "{what}");
        assert_eq!(f[4], sport.to_string(), "{what}");
        let trailer: [u8; 4] = frame[frame.len() - 4..].try_into().unwrap();
        assert_eq!(trailer, reference_icrc(frame).to_le_bytes(), "{what}");
        assert_eq!(
            f[5],
            format!("{:#010x}", u32::from_be_bytes(trailer)),
            "{what}"
        );
    }
    std::fs::remove_file(&path).unwrap();
}

/// The UDP checksum over IPv6 (RFC 8200 section 8.1): the one's complement sum of the
/// pseudo-header (addresses, upper-layer length, next header) and the UDP datagram.
fn udp6_checksum(src: &[u8], dst: &[u8], udp: &[u8]) -> u16 {
    let mut bytes = Vec::new();
    bytes.extend(src);
    bytes.extend(dst);
    bytes.extend((udp.len() as u32).to_be_bytes());
    bytes.extend([0, 0, 0, 17]);
    bytes.extend(udp);
    if bytes.len() % 2 == 1 {
        bytes.push(0);
    }
    let mut sum: u32 = bytes
        .chunks_exact(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum();
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    match !(sum as u16) {
        0 => 0xFFFF, // 0 means "no checksum"; its one's complement twin is sent instead
        c => c,
    }
}
