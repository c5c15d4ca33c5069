//! Identifiers the layers of the engine pass each other: leaf vocabulary, importing nothing,
//! so that a module naming a link (a QP's destination, a trace record) does not depend on
//! the link's implementation. The link's id is the protocol core's
//! ([`shmhca_proto::ids::LinkId`]): a QP's destination names it.

pub use shmhca_proto::ids::LinkId;
