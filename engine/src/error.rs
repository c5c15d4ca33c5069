//! The errors of the verbs API.
//!
//! One enum for the whole user-facing API, with variants precise enough that a caller can
//! tell what went wrong and what to do about it. Protocol errors seen on the wire never
//! surface here: they become work-completion statuses ([`crate::WcStatus`]), as on a real HCA.

use shmhca_proto::qp::QpState;

/// What a verbs call can fail with.
///
/// Each variant's message names the problem and what to do; match on the variant to act
/// on it:
///
/// ```
/// use shmhca::{AccessFlags, Context, EngineMode, Error};
///
/// let ctx = Context::builder().mode(EngineMode::Inline).arena_size(1 << 20).build()?;
/// let pd = ctx.alloc_pd()?;
/// match pd.alloc_mr(64 << 20, AccessFlags::LOCAL_WRITE) {
///     Err(Error::ArenaExhausted { requested, .. }) => assert_eq!(requested, 64 << 20),
///     other => panic!("expected ArenaExhausted, got {other:?}"),
/// }
/// let e = pd.alloc_mr(0, AccessFlags::NONE).unwrap_err();
/// assert!(matches!(e, Error::InvalidArgument { name: "memory region length", .. }));
/// println!("{e}"); // what is wrong, and what is allowed
/// # Ok::<(), shmhca::Error>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A queue has no free slot; nothing was posted.
    #[error(
        "the {queue} is full ({depth} work requests outstanding): poll the completion queue to retire some, or create the QP with a deeper queue"
    )]
    QueueFull {
        /// Which queue: "send queue" or "receive queue".
        queue: &'static str,
        /// Its depth.
        depth: u32,
    },
    /// The QP's state does not allow this operation.
    #[error("cannot {operation} while the QP is in the {state:?} state ({hint})")]
    InvalidState {
        /// What was attempted.
        operation: &'static str,
        /// The QP's state at the time.
        state: QpState,
        /// What would make it work.
        hint: &'static str,
    },
    /// A required attribute of a QP state transition is missing.
    #[error(
        "modify QP {from:?} -> {to:?}: the required attribute `{attribute}` is missing; the QP stays in {from:?}"
    )]
    MissingAttribute {
        /// The state before.
        from: QpState,
        /// The requested state.
        to: QpState,
        /// The attribute's name.
        attribute: &'static str,
    },
    /// An attribute or argument has a value outside its range.
    #[error("invalid {name}: {reason}")]
    InvalidArgument {
        /// The attribute or argument.
        name: &'static str,
        /// What is wrong with it and what is allowed.
        reason: String,
    },
    /// The state transition is not one the QP state machine allows.
    #[error("modify QP: there is no transition from {from:?} to {to:?}")]
    InvalidTransition {
        /// The state before.
        from: QpState,
        /// The requested state.
        to: QpState,
    },
    /// A memory region is in use by posted work requests.
    #[error(
        "memory region {key:#x} is in use by {in_flight} posted work request(s): wait for their completions"
    )]
    MrBusy {
        /// The region's L_Key.
        key: u32,
        /// How many scatter/gather elements of posted work requests point into it.
        in_flight: u32,
    },
    /// A shared receive queue is still used by QPs.
    #[error(
        "the shared receive queue is used by {qps} QP(s): destroy them first (or drop the SRQ: it then goes with its last QP)"
    )]
    SrqInUse {
        /// How many QPs use it.
        qps: u32,
    },
    /// A memory region still has memory windows bound to it.
    #[error(
        "memory region {key:#x} has {windows} memory window(s) bound to it: unbind or invalidate them (or drop them) first"
    )]
    MrHasWindows {
        /// The region's L_Key.
        key: u32,
        /// How many windows are bound to it.
        windows: u32,
    },
    /// Direct access to remotely writable memory was asked for.
    #[error(
        "memory region {key:#x} allows remote write or atomic access (itself, or through a memory window: MW_BIND with LOCAL_WRITE), so a peer may change it at any time: use read_at/write_at instead of a slice"
    )]
    MrRemoteWritable {
        /// The region's L_Key.
        key: u32,
    },
    /// A range does not fit inside a memory region.
    #[error("range {offset}..{offset}+{len} is outside memory region {key:#x} of {mr_len} bytes")]
    OutOfBounds {
        /// The region's L_Key.
        key: u32,
        /// Start of the range, relative to the region.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's length.
        mr_len: u64,
    },
    /// The arena cannot satisfy an allocation.
    #[error(
        "the arena has no free block of {requested} bytes ({free} bytes free in all, arena size {arena}): create the Context with a larger arena (ContextBuilder::arena_size)"
    )]
    ArenaExhausted {
        /// Bytes requested.
        requested: u64,
        /// Bytes free in all blocks.
        free: u64,
        /// Size of the arena.
        arena: u64,
    },
    /// An object of another context was passed.
    #[error("{what} belongs to another Context")]
    ForeignObject {
        /// What was passed.
        what: &'static str,
    },
    /// A fixed table is full.
    #[error("too many {what} (the limit is {limit})")]
    LimitReached {
        /// What kind of object.
        what: &'static str,
        /// The limit.
        limit: u32,
    },
    /// A shared-memory segment could not be created or mapped.
    #[error(transparent)]
    SegmentCreate(#[from] shmhca_rings::segment::CreateError),
    /// A segment received from a peer was rejected.
    #[error(transparent)]
    SegmentOpen(#[from] shmhca_rings::segment::OpenError),
    /// An application's memfd could not become a protection domain's arena
    /// ([`Context::alloc_pd_over`](crate::Context::alloc_pd_over)); the message says why
    /// and what to do.
    #[error("memfd for a protection domain refused: {0}")]
    MemfdAdopt(#[from] shmhca_rings::segment::AdoptError),
    /// A ring inside a segment was rejected.
    #[error(transparent)]
    RingOpen(#[from] shmhca_rings::ring::RingOpenError),
    /// Connection setup failed.
    #[error("connection setup: {0}")]
    Connect(String),
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl From<shmhca_proto::qp::InvalidMtu> for Error {
    fn from(e: shmhca_proto::qp::InvalidMtu) -> Error {
        Error::invalid("path MTU", e.to_string())
    }
}

impl Error {
    /// Builds an [`Error::InvalidArgument`].
    pub(crate) fn invalid(name: &'static str, reason: impl Into<String>) -> Error {
        Error::InvalidArgument {
            name,
            reason: reason.into(),
        }
    }

    /// Wraps an I/O error with what was being done.
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// The result type of the verbs API.
pub type Result<T> = std::result::Result<T, Error>;

/// A call that took ownership of something refused, and hands it back with the reason:
/// [`Pd::reg_mr`](crate::Pd::reg_mr) gives back the buffer, [`UserMr::into_inner`](crate::UserMr::into_inner)
/// the region, [`Mr::deregister`](crate::Mr::deregister) the region and
/// [`Srq::destroy`](crate::Srq::destroy) the SRQ.
///
/// It is an error type of its own (it implements [`std::error::Error`], and `Debug` whatever
/// the value is), and it converts into [`Error`] — dropping the value — so `?` works in a
/// function that returns [`Result`]. Match on the reason with [`Refused::error`], and take
/// the value back with [`Refused::into_value`] (or both with [`Refused::into_parts`]).
///
/// ```
/// use shmhca::{AccessFlags, Context};
///
/// fn register() -> shmhca::Result<()> {
///     let ctx = Context::builder().arena_size(1 << 20).build()?;
///     let pd = ctx.alloc_pd()?;
///     // `?` turns the refusal into shmhca::Error.
///     let mr = pd.reg_mr(vec![0u8; 4096], AccessFlags::LOCAL_WRITE)?;
///     let buf: Vec<u8> = mr.into_inner()?;
///     assert_eq!(buf.len(), 4096);
///
///     // Or keep the buffer when registration is refused: an empty one is.
///     let refused = pd.reg_mr(Vec::new(), AccessFlags::NONE).unwrap_err();
///     assert!(matches!(refused.error(), shmhca::Error::InvalidArgument { .. }));
///     let (buf, why) = refused.into_parts();
///     assert!(buf.is_empty());
///     println!("not registered: {why}");
///     Ok(())
/// }
/// register()?;
/// # Ok::<(), shmhca::Error>(())
/// ```
pub struct Refused<T> {
    value: T,
    error: Error,
}

impl<T> Refused<T> {
    /// `value` handed back because of `error`.
    pub(crate) fn new(value: T, error: Error) -> Refused<T> {
        Refused { value, error }
    }

    /// Why the call was refused.
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// What the call was handed, given back.
    pub fn into_value(self) -> T {
        self.value
    }

    /// The value and the reason.
    pub fn into_parts(self) -> (T, Error) {
        (self.value, self.error)
    }

    /// The reason, dropping the value (what `?` does).
    pub fn into_error(self) -> Error {
        self.error
    }
}

impl<T> std::fmt::Debug for Refused<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Refused")
            .field("value", &std::any::type_name::<T>())
            .field("error", &self.error)
            .finish()
    }
}

impl<T> std::fmt::Display for Refused<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.error, f)
    }
}

impl<T> std::error::Error for Refused<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.error)
    }
}

impl<T> From<Refused<T>> for Error {
    fn from(r: Refused<T>) -> Error {
        r.error
    }
}
