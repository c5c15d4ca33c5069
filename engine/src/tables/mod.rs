//! The engine's tables of what the application created: memory regions ([`mr`]), memory
//! windows ([`mw`]), shared receive queues ([`srq`]) and completion queues with their
//! notification state ([`cq`]). Private to the engine: the verbs layer's handles name
//! entries by number (with a generation tag, so a stale number finds nothing), and the
//! protocol stages reach them through the `Env` the engine lends them.

pub(crate) mod cq;
pub(crate) mod mr;
pub(crate) mod mw;
pub(crate) mod srq;
