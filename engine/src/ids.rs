//! Identifiers the layers of the engine pass each other: leaf vocabulary, importing nothing,
//! so that a module naming a link (a QP's destination, a trace record) does not depend on
//! the link's implementation.

/// Identifies a link of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LinkId(pub(crate) u32);

impl LinkId {
    /// The link's index in its engine.
    pub fn index(self) -> u32 {
        self.0
    }
}
