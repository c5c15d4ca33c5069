//! The IBA transport headers (re-exported from [`shmhca_proto::wire`]), and [`slot`]: how
//! the shared-memory link lays a packet out in its ring's cache lines.
//!
//! The header codec is the protocol core's; `slot` is this engine's link format and lives
//! here, beside the engine that owns the rings.

pub use shmhca_proto::wire::*;

pub mod slot;
