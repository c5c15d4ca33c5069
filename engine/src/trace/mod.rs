//! Packet capture.

pub mod pcap;
