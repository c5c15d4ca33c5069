//! Links: the packet paths between engines.
//!
//! Two kinds: [`shm`], two line rings in a shared segment, between processes of one
//! machine; and [`udp`], RoCEv2 datagrams between machines — a shared-memory link whose
//! far end is a datagram pump (see its module docs for why). The protocol stages send through the `LinkTx` trait (see `context.rs`) and the
//! engine's receive loop takes packets from each link, so a second kind of link (RoCEv2
//! datagrams) is a sibling module here, not a change to the protocol core.

pub mod shm;
pub mod udp;

pub use crate::ids::LinkId;
pub(crate) use shm::*;
