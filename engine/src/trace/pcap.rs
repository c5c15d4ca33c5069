//! A pcap writer that frames each IBA transport packet as RoCEv2, so Wireshark and tshark
//! decode captures as InfiniBand.
//!
//! The classic libpcap format: a 24-byte global header (link type Ethernet), then per
//! packet a 16-byte record header and the frame (Ethernet / IPv4 / UDP 4791 / transport
//! packet / ICRC; see [`super::roce`]). Timestamps are passed in, never read here.
//!
//! ```
//! use std::time::Duration;
//! use shmhca::trace::pcap::{Endpoint, PcapWriter};
//! use shmhca::psn::Psn;
//! use shmhca::wire::{BthRepr, PacketRepr, Qpn, opcode::Opcode};
//!
//! let mut pcap = PcapWriter::new(Vec::new()).unwrap();
//! let repr = PacketRepr::new(BthRepr::new(Opcode::SendOnly, Qpn::new(0x11), Psn::new(201)));
//! let mut headers = [0u8; 12];
//! repr.emit(&mut headers).unwrap();
//! pcap.write_packet(
//!     Duration::from_secs(1_700_000_000),
//!     Endpoint::engine(1),
//!     Endpoint::engine(2),
//!     &[&headers, b"hello world!"],
//! )
//! .unwrap();
//! let bytes = pcap.into_inner();
//! assert_eq!(bytes.len(), 24 + 16 + 14 + 20 + 8 + 12 + 12 + 4);
//! ```

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::time::Duration;

use super::roce::{self, HEADERS_LEN, ICRC_LEN, IPV4_HEADER_LEN, UDP_HEADER_LEN};
pub use super::roce::{Endpoint, FrameError};
use crate::wire::bth;

/// LINKTYPE_ETHERNET.
const LINKTYPE_ETHERNET: u32 = 1;
/// The snapshot length written in the global header (no frame is ever truncated).
const SNAPLEN: u32 = 262_144;

/// The resolution of the timestamps in a capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TimestampPrecision {
    /// Microseconds (magic `0xA1B2C3D4`, readable by every pcap tool).
    #[default]
    Micro,
    /// Nanoseconds (magic `0xA1B23C4D`).
    Nano,
}

impl TimestampPrecision {
    const fn magic(self) -> u32 {
        match self {
            TimestampPrecision::Micro => 0xA1B2_C3D4,
            TimestampPrecision::Nano => 0xA1B2_3C4D,
        }
    }
}

/// Writes RoCEv2-framed transport packets to a pcap stream.
///
/// Wrap files in a [`BufWriter`] (as [`PcapWriter::create`] does): each packet is
/// written as several small pieces.
#[derive(Debug)]
pub struct PcapWriter<W: Write> {
    out: W,
    precision: TimestampPrecision,
    ip_id: u16,
    /// Set when a write failed part-way through a record: the stream no longer parses.
    broken: bool,
}

impl PcapWriter<BufWriter<File>> {
    /// Creates (or truncates) the file at `path` and writes the global header, with
    /// microsecond timestamps.
    ///
    /// # Errors
    ///
    /// Any error creating or writing the file.
    pub fn create(path: impl AsRef<Path>) -> io::Result<Self> {
        PcapWriter::new(BufWriter::new(File::create(path)?))
    }
}

impl<W: Write> PcapWriter<W> {
    /// Writes the pcap global header (microsecond timestamps) to `out`.
    ///
    /// # Errors
    ///
    /// Any error writing to `out`.
    pub fn new(out: W) -> io::Result<Self> {
        Self::with_precision(out, TimestampPrecision::Micro)
    }

    /// Writes the pcap global header with the given timestamp precision to `out`.
    ///
    /// # Errors
    ///
    /// Any error writing to `out`.
    pub fn with_precision(mut out: W, precision: TimestampPrecision) -> io::Result<Self> {
        let mut h = [0u8; 24];
        h[0..4].copy_from_slice(&precision.magic().to_le_bytes());
        h[4..6].copy_from_slice(&2u16.to_le_bytes()); // version 2.4
        h[6..8].copy_from_slice(&4u16.to_le_bytes());
        // thiszone (8..12) and sigfigs (12..16) are 0.
        h[16..20].copy_from_slice(&SNAPLEN.to_le_bytes());
        h[20..24].copy_from_slice(&LINKTYPE_ETHERNET.to_le_bytes());
        out.write_all(&h)?;
        Ok(PcapWriter {
            out,
            precision,
            ip_id: 0,
            broken: false,
        })
    }

    /// Writes one packet: `transport` is the IBA transport packet in pieces, in order (the
    /// BTH and extended headers, then the payload pieces, then any pad bytes), as sent
    /// from `src` to `dst` at `ts` (time since the UNIX epoch). The frame gets Ethernet,
    /// IPv4 (correct header checksum, a fresh identification), UDP to port 4791 (source
    /// port from the BTH DestQP) and the ICRC.
    ///
    /// # Errors
    ///
    /// * [`io::ErrorKind::InvalidInput`] (wrapping a [`FrameError`]) if the transport
    ///   packet is shorter than a BTH or too long for an IPv4 datagram, or if `ts` does
    ///   not fit the pcap format (after the year 2106); nothing is written then.
    /// * Any error from the underlying writer. A failure part-way through a record leaves
    ///   the stream unparseable after that point, so every later call fails too.
    pub fn write_packet(
        &mut self,
        ts: Duration,
        src: Endpoint,
        dst: Endpoint,
        transport: &[&[u8]],
    ) -> io::Result<()> {
        self.write_packet_with_icrc_error(ts, src, dst, transport, 0)
    }

    /// [`write_packet`](Self::write_packet) with a wrong ICRC: the correct one XOR
    /// `icrc_error` (a packet corrupted on its way, recorded as the receiver sees it).
    ///
    /// # Errors
    ///
    /// As [`write_packet`](Self::write_packet).
    pub fn write_packet_with_icrc_error(
        &mut self,
        ts: Duration,
        src: Endpoint,
        dst: Endpoint,
        transport: &[&[u8]],
        icrc_error: u32,
    ) -> io::Result<()> {
        if self.broken {
            return Err(io::Error::other(
                "an earlier write failed part-way through a packet record: the capture is \
                 truncated there; start a new capture file",
            ));
        }
        let transport_len: usize = transport.iter().map(|p| p.len()).sum();
        let dest_qp = dest_qp_of(transport);
        let headers = roce::frame_headers(src, dst, self.ip_id, dest_qp, transport_len)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let secs = u32::try_from(ts.as_secs()).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "timestamp is past 2106-02-07, beyond the 32-bit seconds of the pcap format",
            )
        })?;
        let frac = match self.precision {
            TimestampPrecision::Micro => ts.subsec_micros(),
            TimestampPrecision::Nano => ts.subsec_nanos(),
        };

        let ip: &[u8; IPV4_HEADER_LEN] = headers[14..34].try_into().expect("fixed layout");
        let udp: &[u8; UDP_HEADER_LEN] = headers[34..HEADERS_LEN].try_into().expect("fixed layout");
        let icrc = roce::icrc(ip, udp, transport) ^ icrc_error;

        // Fits: frame_headers bounds the transport to an IPv4 datagram.
        let frame_len = (HEADERS_LEN + transport_len + ICRC_LEN) as u32;
        let mut record = [0u8; 16];
        record[0..4].copy_from_slice(&secs.to_le_bytes());
        record[4..8].copy_from_slice(&frac.to_le_bytes());
        record[8..12].copy_from_slice(&frame_len.to_le_bytes());
        record[12..16].copy_from_slice(&frame_len.to_le_bytes());

        self.ip_id = self.ip_id.wrapping_add(1);
        self.broken = true;
        self.out.write_all(&record)?;
        self.out.write_all(&headers)?;
        for piece in transport {
            self.out.write_all(piece)?;
        }
        self.out.write_all(&icrc.to_le_bytes())?;
        self.broken = false;
        Ok(())
    }

    /// Flushes the underlying writer.
    ///
    /// # Errors
    ///
    /// Any error from the underlying writer.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// The underlying writer.
    pub fn get_ref(&self) -> &W {
        &self.out
    }

    /// Returns the underlying writer (not flushed: call [`flush`](Self::flush) first for a
    /// buffered one, or drop it, which flushes a `BufWriter`).
    pub fn into_inner(self) -> W {
        self.out
    }
}

/// The BTH DestQP of a transport packet given in pieces (0 if it is too short to hold it;
/// such a packet is rejected by `frame_headers` anyway).
fn dest_qp_of(transport: &[&[u8]]) -> u32 {
    let mut bth_bytes = [0u8; bth::HEADER_LEN];
    let mut filled = 0;
    for piece in transport {
        let take = piece.len().min(bth::HEADER_LEN - filled);
        bth_bytes[filled..filled + take].copy_from_slice(&piece[..take]);
        filled += take;
        if filled == bth::HEADER_LEN {
            return bth::Packet::new_unchecked(&bth_bytes[..]).dest_qp().get();
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bth(dest_qp: u32) -> [u8; 12] {
        let [_, a, b, c] = dest_qp.to_be_bytes();
        [0x04, 0, 0xFF, 0xFF, 0, a, b, c, 0, 0, 0, 1]
    }

    #[test]
    fn global_header_micro_and_nano() {
        let w = PcapWriter::new(Vec::new()).unwrap().into_inner();
        assert_eq!(
            w,
            [
                0xD4, 0xC3, 0xB2, 0xA1, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 1, 0, 0, 0
            ]
        );
        let w = PcapWriter::with_precision(Vec::new(), TimestampPrecision::Nano)
            .unwrap()
            .into_inner();
        assert_eq!(w[0..4], [0x4D, 0x3C, 0xB2, 0xA1]);
    }

    #[test]
    fn record_layout_and_trailer() {
        let mut w = PcapWriter::new(Vec::new()).unwrap();
        let ts = Duration::new(1_700_000_000, 123_456_789);
        let b = bth(0x12_3456);
        w.write_packet(
            ts,
            Endpoint::engine(3),
            Endpoint::engine(4),
            &[&b[..5], &b[5..], b"abcd"],
        )
        .unwrap();
        let out = w.into_inner();
        let rec = &out[24..];
        assert_eq!(
            u32::from_le_bytes(rec[0..4].try_into().unwrap()),
            1_700_000_000
        );
        assert_eq!(u32::from_le_bytes(rec[4..8].try_into().unwrap()), 123_456);
        let len = 14 + 20 + 8 + 12 + 4 + 4;
        assert_eq!(u32::from_le_bytes(rec[8..12].try_into().unwrap()), len);
        assert_eq!(u32::from_le_bytes(rec[12..16].try_into().unwrap()), len);
        let frame = &rec[16..];
        assert_eq!(frame.len(), len as usize);
        assert_eq!(frame[42..54], b);
        assert_eq!(&frame[54..58], b"abcd");
        // UDP source port from the DestQP even though the BTH came in two pieces.
        assert_eq!(
            u16::from_be_bytes([frame[34], frame[35]]),
            0xC000 | 0x3456 & 0x3FFF
        );
        let ip: [u8; 20] = frame[14..34].try_into().unwrap();
        let udp: [u8; 8] = frame[34..42].try_into().unwrap();
        assert_eq!(
            frame[58..62],
            roce::icrc(&ip, &udp, &[&frame[42..58]]).to_le_bytes()
        );
    }

    #[test]
    fn nanosecond_records_and_ip_ids() {
        let mut w = PcapWriter::with_precision(Vec::new(), TimestampPrecision::Nano).unwrap();
        let b = bth(1);
        for _ in 0..2 {
            w.write_packet(
                Duration::new(5, 999_999_999),
                Endpoint::engine(1),
                Endpoint::engine(2),
                &[&b],
            )
            .unwrap();
        }
        let out = w.into_inner();
        let rec_len = 16 + 14 + 20 + 8 + 12 + 4;
        let (r1, r2) = (&out[24..24 + rec_len], &out[24 + rec_len..]);
        assert_eq!(
            u32::from_le_bytes(r1[4..8].try_into().unwrap()),
            999_999_999
        );
        // IPv4 identification increments per packet.
        assert_eq!(r1[16 + 18..16 + 20], [0, 0]);
        assert_eq!(r2[16 + 18..16 + 20], [0, 1]);
    }

    #[test]
    fn invalid_input_writes_nothing() {
        let mut w = PcapWriter::new(Vec::new()).unwrap();
        let e = w
            .write_packet(
                Duration::ZERO,
                Endpoint::engine(1),
                Endpoint::engine(2),
                &[&[0u8; 11]],
            )
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("shorter than a BTH"));
        let e = w
            .write_packet(
                Duration::from_secs(1 << 33),
                Endpoint::engine(1),
                Endpoint::engine(2),
                &[&bth(1)],
            )
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(w.get_ref().len(), 24);
        // The writer is still usable.
        w.write_packet(
            Duration::ZERO,
            Endpoint::engine(1),
            Endpoint::engine(2),
            &[&bth(1)],
        )
        .unwrap();
        assert_eq!(w.get_ref().len(), 24 + 16 + 14 + 20 + 8 + 12 + 4);
    }

    /// A writer that fails after accepting a fixed number of bytes.
    struct FailAfter(usize);
    impl Write for FailAfter {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if self.0 == 0 {
                return Err(io::Error::other("disk full"));
            }
            let n = buf.len().min(self.0);
            self.0 -= n;
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_failed_record_poisons_the_writer() {
        let mut w = PcapWriter::new(FailAfter(24 + 20)).unwrap();
        let (a, b) = (Endpoint::engine(1), Endpoint::engine(2));
        assert!(w.write_packet(Duration::ZERO, a, b, &[&bth(1)]).is_err());
        w.out.0 = 1 << 20;
        let e = w
            .write_packet(Duration::ZERO, a, b, &[&bth(1)])
            .unwrap_err();
        assert!(e.to_string().contains("start a new capture"));
    }
}
