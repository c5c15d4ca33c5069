//! Packet capture: every packet an engine sends and receives, written to a pcap file with
//! RoCEv2 framing so that Wireshark and tshark decode it as InfiniBand.
//!
//! [`pcap::PcapWriter`] writes the file; [`roce`] builds the Ethernet / IPv4 / UDP framing
//! and the ICRC around each transport packet.

#![forbid(unsafe_code)]

pub mod pcap;
pub mod roce;
pub(crate) mod tap;
