//! The IBA transport headers (re-exported from [`shmhca_proto::wire`]), and [`slot`]: how
//! the shared-memory link lays a packet out in its ring's cache lines.
//!
//! The header codec is the protocol core's; `slot` is the shared-memory link's format
//! ([`crate::link::shm::slot`]), re-exported here under its old path.

pub use shmhca_proto::wire::*;

pub use crate::link::shm::slot;
