//! Links: the packet paths between engines.
//!
//! One kind today, [`shm`]: two line rings in a shared segment, between processes of one
//! machine. The protocol stages send through the `LinkTx` trait (see `context.rs`) and the
//! engine's receive loop takes packets from each link, so a second kind of link (RoCEv2
//! datagrams) is a sibling module here, not a change to the protocol core.

pub mod shm;
pub(crate) mod udp;

pub use crate::ids::LinkId;
pub(crate) use shm::*;
