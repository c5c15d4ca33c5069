//! Typed numbers of what a QP refers to in its engine: its protection domain, completion
//! queues and shared receive queue. Each is a plain `u32` underneath (with a generation tag
//! in its high bits, so a stale number finds nothing), but the type says which table it
//! indexes: a CQ number cannot be passed where a PD is wanted.
//!
//! ```
//! use shmhca_proto::ids::{CqId, PdId};
//!
//! let (pd, cq) = (PdId::new(3), CqId::new(3));
//! assert_eq!(pd.get(), cq.get()); // the same number, two different things
//! ```

macro_rules! id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
        pub struct $name(u32);

        impl $name {
            /// The id of number `n`.
            #[inline]
            pub const fn new(n: u32) -> $name {
                $name(n)
            }

            /// Its number.
            #[inline]
            pub const fn get(self) -> u32 {
                self.0
            }
        }
    };
}

id!(
    /// A protection domain's number in its engine.
    PdId
);
id!(
    /// A completion queue's number in its engine.
    CqId
);
id!(
    /// A shared receive queue's number in its engine.
    SrqId
);

/// The link a QP talks over, as its engine numbers them (an index in the engine's link
/// table). Only the engine that made it gives it meaning: the engine checks every link id a
/// caller passes in, so a made-up or stale one is refused, never followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LinkId(u32);

impl LinkId {
    /// The link at index `index` of its engine's table.
    #[inline]
    pub const fn new(index: u32) -> LinkId {
        LinkId(index)
    }

    /// The link's index in its engine.
    #[inline]
    pub const fn index(self) -> u32 {
        self.0
    }
}
