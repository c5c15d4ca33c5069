//! The UDP link: RoCEv2 datagrams (the IBA transport packet in UDP, port 4791, with its
//! ICRC) between two engines on different machines.

#[allow(dead_code)]
pub(crate) mod datagram;
// Used by the link itself (next step).
#[allow(dead_code)]
pub(crate) mod socket;
