//! `shmhca_proto::roce`'s ICRC checked against an independent implementation: scapy's
//! `scapy.contrib.roce`, which recomputes the ICRC of each packet from its wire bytes
//! (IPv4 and IPv6, random addresses, ports, IDs, variant fields, BTHs and payloads).
//!
//! Without python3 and scapy the test skips, printing one line that says what to install
//! (`pip install scapy`); with `SHMHCA_REQUIRE_SCAPY=1` a missing scapy fails it instead.

use std::io::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};
use std::process::{Command, Stdio};

use shmhca_proto::roce::{self, ICRC_LEN};

const INSTALL_HINT: &str = "pip install scapy";

/// Reads one packet per line (IP header onwards, in hex, ICRC included) and prints the
/// ICRC scapy computes for it, as the 4 wire bytes in hex.
const SCRIPT: &str = r#"
import sys
from scapy.layers.inet import IP
from scapy.layers.inet6 import IPv6
from scapy.contrib.roce import BTH
for line in sys.stdin:
    b = bytes.fromhex(line.strip())
    pkt = IP(b) if b[0] >> 4 == 4 else IPv6(b)
    print(pkt[BTH].compute_icrc(None).hex(), flush=True)
"#;

fn scapy_available() -> bool {
    let found = Command::new("python3")
        .args(["-c", "import scapy.contrib.roce"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if found {
        return true;
    }
    if std::env::var_os("SHMHCA_REQUIRE_SCAPY").is_some_and(|v| v == "1") {
        panic!(
            "python3 with scapy is not installed and SHMHCA_REQUIRE_SCAPY=1 requires it: {INSTALL_HINT}"
        );
    }
    let _ = writeln!(
        std::io::stderr(),
        "roce_scapy skipped: python3 with scapy is not installed (to run it: {INSTALL_HINT})"
    );
    false
}

struct Rng(u32);

impl Rng {
    fn next(&mut self) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 17;
        self.0 ^= self.0 << 5;
        self.0
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// A transport packet: a BTH of random fields whose opcode scapy reads as plain BTH +
/// payload (RC Send/Write/Read opcodes, not Acknowledge or CNP), and a payload.
fn transport(rng: &mut Rng) -> Vec<u8> {
    const OPCODES: [u8; 8] = [0x00, 0x02, 0x04, 0x05, 0x06, 0x0A, 0x0C, 0x10];
    let len = rng.next() as usize % 1100;
    let mut t = rng.bytes(12 + len);
    t[0] = OPCODES[rng.next() as usize % OPCODES.len()];
    t
}

/// One IPv4 packet with our ICRC, its variant fields random.
fn ipv4_packet(rng: &mut Rng) -> Vec<u8> {
    let t = transport(rng);
    let src = SocketAddrV4::new(Ipv4Addr::from(rng.next()), rng.next() as u16);
    let dst = SocketAddrV4::new(Ipv4Addr::from(rng.next()), roce::UDP_PORT);
    let id = if rng.next() % 4 == 0 {
        0
    } else {
        rng.next() as u16
    };
    let udp_len = (8 + t.len() + ICRC_LEN) as u16;
    let mut p = vec![0x45, rng.next() as u8];
    p.extend((20 + udp_len).to_be_bytes());
    p.extend(id.to_be_bytes());
    p.extend([0x40, 0, rng.next() as u8, 17]);
    p.extend(rng.bytes(2)); // header checksum: masked, and scapy does not check it
    p.extend(src.ip().octets());
    p.extend(dst.ip().octets());
    p.extend(src.port().to_be_bytes());
    p.extend(dst.port().to_be_bytes());
    p.extend(udp_len.to_be_bytes());
    p.extend(rng.bytes(2)); // UDP checksum: masked
    let at = p.len();
    p.extend(&t);
    p.extend([0; ICRC_LEN]);
    let n = roce::append_icrc_v4(src, dst, id, &mut p[at..], t.len()).unwrap();
    assert_eq!(at + n, p.len());
    p
}

/// One IPv6 packet with our ICRC, its variant fields random.
fn ipv6_packet(rng: &mut Rng) -> Vec<u8> {
    let t = transport(rng);
    let addr = |rng: &mut Rng| Ipv6Addr::from(<[u8; 16]>::try_from(rng.bytes(16)).unwrap());
    let src = SocketAddrV6::new(addr(rng), rng.next() as u16, 0, 0);
    let dst = SocketAddrV6::new(addr(rng), roce::UDP_PORT, 0, 0);
    let udp_len = (8 + t.len() + ICRC_LEN) as u16;
    // Version 6, then random traffic class and flow label.
    let mut p = (0x6000_0000 | (rng.next() & 0x0FFF_FFFF))
        .to_be_bytes()
        .to_vec();
    p.extend(udp_len.to_be_bytes());
    p.extend([17, rng.next() as u8]);
    p.extend(src.ip().octets());
    p.extend(dst.ip().octets());
    p.extend(src.port().to_be_bytes());
    p.extend(dst.port().to_be_bytes());
    p.extend(udp_len.to_be_bytes());
    p.extend(rng.bytes(2));
    let at = p.len();
    p.extend(&t);
    p.extend([0; ICRC_LEN]);
    roce::append_icrc_v6(src, dst, &mut p[at..], t.len()).unwrap();
    p
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn scapy_computes_the_same_icrc_for_ipv4_and_ipv6() {
    if !scapy_available() {
        return;
    }
    let mut rng = Rng(0x5CA9_F00D);
    let packets: Vec<Vec<u8>> = (0..400)
        .map(|i| {
            if i % 2 == 0 {
                ipv4_packet(&mut rng)
            } else {
                ipv6_packet(&mut rng)
            }
        })
        .collect();
    let mut child = Command::new("python3")
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        let mut stdin = child.stdin.take().unwrap();
        for p in &packets {
            writeln!(stdin, "{}", hex(p)).unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "scapy failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), packets.len(), "one ICRC per packet");
    for (i, (p, line)) in packets.iter().zip(&lines).enumerate() {
        assert_eq!(
            *line,
            hex(&p[p.len() - ICRC_LEN..]),
            "packet {i}: {}",
            hex(p)
        );
    }
}
