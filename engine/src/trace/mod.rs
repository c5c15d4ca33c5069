//! Packet capture: every packet an engine sends and receives, written to a pcap file with
//! RoCEv2 framing so that Wireshark and tshark decode it as InfiniBand.
//!
//! [`pcap::PcapWriter`] writes the file; [`roce`] builds the Ethernet / IPv4 / UDP framing
//! and the ICRC around each transport packet.

#![forbid(unsafe_code)]

pub mod pcap;
pub mod roce;
pub(crate) mod tap;

/// Which way a traced packet went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Sent by this engine.
    Sent,
    /// Received by this engine.
    Received,
}

/// A packet seen by a packet observer ([`crate::Context::observe_packets`]).
#[derive(Debug, Clone, Copy)]
pub struct PacketEvent<'a> {
    /// Sent or received.
    pub direction: Direction,
    /// The link it went over.
    pub link: crate::LinkId,
    /// Its transport headers.
    pub headers: &'a crate::wire::PacketRepr,
    /// Its payload length in bytes.
    pub payload_len: u32,
}
