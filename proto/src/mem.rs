//! What the protocol core needs of memory: reading bytes at an offset, bounds-checked.
//!
//! The core never maps, pins or shares memory; whoever drives it (the engine) owns that and
//! lends the core a [`Memory`]: a QP's private table memory (its multi-element scatter/gather
//! lists), an arena, a received datagram's bytes. A plain byte slice is one too.
//!
//! ```
//! use shmhca_proto::mem::{Memory, OutOfRange};
//!
//! let bytes = [1u8, 2, 3, 4];
//! let mut two = [0u8; 2];
//! bytes[..].read(2, &mut two)?;
//! assert_eq!(two, [3, 4]);
//! assert_eq!(bytes[..].read(3, &mut two), Err(OutOfRange));
//! # Ok::<(), OutOfRange>(())
//! ```

/// An access fell outside the memory, or wrote to a read-only view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfRange;

/// Memory the protocol core reads through. Implementations check every access: an offset
/// or length from a peer or a table may be anything.
pub trait Memory {
    /// Copies `dst.len()` bytes at `off` into `dst`; [`OutOfRange`] (and `dst` unspecified)
    /// if any of them lies outside.
    fn read(&self, off: u64, dst: &mut [u8]) -> Result<(), OutOfRange>;
}

impl Memory for [u8] {
    fn read(&self, off: u64, dst: &mut [u8]) -> Result<(), OutOfRange> {
        let start = usize::try_from(off).map_err(|_| OutOfRange)?;
        let end = start.checked_add(dst.len()).ok_or(OutOfRange)?;
        dst.copy_from_slice(self.get(start..end).ok_or(OutOfRange)?);
        Ok(())
    }
}
