//! The IBA transport headers of the Reliable Connected service, bit-exact and big-endian.
//!
//! Layout (DESIGN.md "Wire constants", spec 01 Figures 17-4 to 17-11): a packet is the
//! Base Transport Header ([`bth`], 12 bytes), then the extended headers its opcode calls for,
//! in this order: [`reth`] (16), [`atomic_eth`] (28), [`aeth`] (4), [`atomic_ack_eth`] (8),
//! [`immdt`] (4), [`ieth`] (4); then the payload. Which headers follow, and whether a
//! payload does, is in the table of [`opcode`]; [`packet::PacketRepr`] parses and emits
//! a whole header stack by that table.
//!
//! Each header has its own module, in the manner of smoltcp's `wire`:
//!
//! * `Packet<T: AsRef<[u8]>>`: a zero-copy view over a byte buffer, with getters and
//!   (for `T: AsMut<[u8]>`) setters named after the spec's fields;
//! * `…Repr`: the header's decoded, owned form, with `parse`, `emit` and `buffer_len`;
//! * `HEADER_LEN`, and a private `mod field` of byte ranges.
//!
//! # The contract
//!
//! Everything read off a link was written by a peer that may be buggy or hostile, so the
//! parsing side never trusts a length:
//!
//! * `Packet::new_unchecked` wraps any buffer; accessors on it may panic if it is short.
//! * `Packet::new_checked` (or `check_len`) verifies the buffer holds the whole header and
//!   returns [`Error::Truncated`] otherwise. **After `new_checked` succeeds, no accessor or
//!   setter panics.**
//! * `Repr::parse` never panics, on any input; it returns an [`Error`] naming the problem.
//! * `Repr::emit` never panics on a buffer of at least `Repr::buffer_len()` bytes.
//! * Reserved fields are written as zero and ignored when read.
//!
//! Arbitrary bytes are fed to [`packet::PacketRepr::parse`] by a fuzz target
//! (`engine/fuzz`) and by a property test.
#![forbid(unsafe_code)]

use core::fmt;

/// Defines a header's zero-copy view, `Packet<T>`, with the constructors and the length
/// check every header shares (the smoltcp contract: after `new_checked`, no accessor
/// panics). Each header file adds its own accessors. The file must define `HEADER_LEN`.
macro_rules! header_view {
    ($what:literal) => {
        #[doc = concat!("A read/write view of ", $what, " at the start of a buffer.")]
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct Packet<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> Packet<T> {
            /// Wraps a buffer without checking its length; accessors panic if it is shorter
            /// than [`HEADER_LEN`]. Use [`Packet::new_checked`] on anything received.
            pub const fn new_unchecked(buffer: T) -> Packet<T> {
                Packet { buffer }
            }

            #[doc = concat!("Wraps a buffer after checking it holds a whole ", $what, ".")]
            ///
            /// # Errors
            ///
            /// [`Error::Truncated`](crate::wire::Error::Truncated) if the buffer is shorter
            /// than [`HEADER_LEN`].
            pub fn new_checked(buffer: T) -> crate::wire::Result<Packet<T>> {
                let packet = Packet::new_unchecked(buffer);
                packet.check_len()?;
                Ok(packet)
            }

            #[doc = concat!("Checks the buffer holds a whole ", $what, ".")]
            ///
            /// # Errors
            ///
            /// [`Error::Truncated`](crate::wire::Error::Truncated) if the buffer is shorter
            /// than [`HEADER_LEN`].
            pub fn check_len(&self) -> crate::wire::Result<()> {
                if self.buffer.as_ref().len() < HEADER_LEN {
                    Err(crate::wire::Error::Truncated)
                } else {
                    Ok(())
                }
            }

            /// Returns the underlying buffer.
            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}
use header_view;

pub mod aeth;
pub mod atomic_ack_eth;
pub mod atomic_eth;
pub mod bth;
pub mod ieth;
pub mod immdt;
pub mod opcode;
pub mod packet;
pub mod reth;

pub use aeth::{AethRepr, CreditCode, NakCode, RnrTimer, Syndrome};
pub use atomic_ack_eth::AtomicAckEthRepr;
pub use atomic_eth::AtomicEthRepr;
pub use bth::BthRepr;
pub use ieth::IethRepr;
pub use immdt::ImmDtRepr;
pub use opcode::{Headers, OpClass, Opcode, OpcodeInfo, Position};
pub use packet::{MAX_HEADER_LEN, PacketRepr};
pub use reth::RethRepr;

/// Why bytes could not be parsed as (or a repr could not be emitted into) IBA headers.
///
/// Every variant means the packet is to be dropped (and, for a request, handled as the
/// spec says for a malformed packet); none is a reason to stop the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Error {
    /// The buffer is shorter than the headers it must hold (the BTH, or the extended
    /// headers its opcode calls for, or the space `emit` was given).
    Truncated,
    /// The BTH opcode is not one of the RC opcodes this HCA implements (DESIGN.md
    /// "Wire constants").
    UnknownOpcode(u8),
    /// The BTH transport header version (TVer) is not 0, the only version defined.
    UnsupportedVersion(u8),
    /// The BTH pad count is non-zero on an opcode that carries no payload.
    PadWithoutPayload {
        /// The packet's opcode.
        opcode: Opcode,
        /// The pad count it carried.
        pad_count: u8,
    },
    /// The extended headers present in a [`PacketRepr`] are not the ones its opcode calls
    /// for (emit side: a programming error in the caller).
    HeadersMismatch {
        /// The packet's opcode.
        opcode: Opcode,
        /// The headers the opcode table requires.
        expected: Headers,
        /// The headers that were present.
        found: Headers,
    },
    /// A field holds a value the spec does not allow; the text names the field.
    Malformed(&'static str),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Truncated => f.write_str(
                "packet truncated: the buffer is shorter than the transport headers it must \
                 hold; drop the packet (or give emit a buffer of header_len() bytes)",
            ),
            Error::UnknownOpcode(op) => write!(
                f,
                "unknown or non-RC BTH opcode {op:#04x}: only the Reliable Connected opcodes \
                 are implemented; drop the packet"
            ),
            Error::UnsupportedVersion(v) => write!(
                f,
                "BTH transport header version {v} is not supported (only 0 is defined); \
                 drop the packet"
            ),
            Error::PadWithoutPayload { opcode, pad_count } => write!(
                f,
                "BTH pad count {pad_count} on {opcode:?}, an opcode that carries no payload; \
                 drop the packet"
            ),
            Error::HeadersMismatch {
                opcode,
                expected,
                found,
            } => write!(
                f,
                "{opcode:?} requires extended headers {expected:?} but {found:?} were given; \
                 build the PacketRepr from the opcode table"
            ),
            Error::Malformed(what) => write!(f, "malformed transport header: {what}"),
        }
    }
}

impl core::error::Error for Error {}

/// The result of parsing or emitting wire headers.
pub type Result<T> = core::result::Result<T, Error>;

/// A 24-bit Queue Pair Number (BTH:DestQP).
///
/// ```
/// use shmhca_proto::wire::Qpn;
/// assert_eq!(Qpn::new(0x1AB_CDEF).get(), 0xAB_CDEF);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Qpn(u32);

impl Qpn {
    /// The 24 bits a QPN occupies.
    pub const MASK: u32 = 0xFF_FFFF;

    /// Makes a QPN from the low 24 bits of `v` (the upper 8 bits are discarded).
    #[inline]
    pub const fn new(v: u32) -> Qpn {
        Qpn(v & Self::MASK)
    }

    /// The QPN as a number in `0..=0xFF_FFFF`.
    #[inline]
    pub const fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Display for Qpn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#08x}", self.0)
    }
}

/// A 24-bit Message Sequence Number (AETH:MSN, spec 02 "MSN Indicates Last Message
/// Completed by RQ Logic"). Wraps modulo 2^24.
///
/// ```
/// use shmhca_proto::wire::Msn;
/// assert_eq!(Msn::new(0xFF_FFFF).wrapping_add(1), Msn::new(0));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Msn(u32);

impl Msn {
    /// The 24 bits an MSN occupies.
    pub const MASK: u32 = 0xFF_FFFF;

    /// Makes an MSN from the low 24 bits of `v` (the upper 8 bits are discarded).
    #[inline]
    pub const fn new(v: u32) -> Msn {
        Msn(v & Self::MASK)
    }

    /// The MSN as a number in `0..=0xFF_FFFF`.
    #[inline]
    pub const fn get(self) -> u32 {
        self.0
    }

    /// `self + n` modulo 2^24.
    #[inline]
    pub const fn wrapping_add(self, n: u32) -> Msn {
        Msn::new(self.0.wrapping_add(n))
    }
}

/// Reads a big-endian 24-bit number from the three bytes of `b`.
#[inline]
fn read_u24(b: &[u8]) -> u32 {
    u32::from_be_bytes([0, b[0], b[1], b[2]])
}

/// Writes the low 24 bits of `v` big-endian into the three bytes of `b`.
#[inline]
fn write_u24(b: &mut [u8], v: u32) {
    let [_, x, y, z] = v.to_be_bytes();
    b[0] = x;
    b[1] = y;
    b[2] = z;
}

/// Reads a big-endian u32 from the four bytes of `b`.
#[inline]
fn read_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// Reads a big-endian u64 from the eight bytes of `b`.
#[inline]
fn read_u64(b: &[u8]) -> u64 {
    u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// A byte range of a header.
type Field = core::ops::Range<usize>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qpn_and_msn_mask_and_wrap() {
        assert_eq!(Qpn::new(0xFFFF_FFFF), Qpn::new(0xFF_FFFF));
        assert_eq!(Qpn::new(0x0100_0001).get(), 1);
        assert_eq!(Msn::new(0xFF_FFFE).wrapping_add(3).get(), 1);
        assert_eq!(Msn::new(0x0100_0000).get(), 0);
        assert_eq!(Qpn::new(0x12).to_string(), "0x000012");
    }

    #[test]
    fn u24_helpers_are_big_endian() {
        let mut b = [0u8; 3];
        write_u24(&mut b, 0xAB_CDEF);
        assert_eq!(b, [0xAB, 0xCD, 0xEF]);
        assert_eq!(read_u24(&b), 0xAB_CDEF);
        write_u24(&mut b, 0xFF12_3456);
        assert_eq!(b, [0x12, 0x34, 0x56]);
    }

    #[test]
    fn errors_name_the_problem() {
        assert!(Error::Truncated.to_string().contains("truncated"));
        assert!(Error::UnknownOpcode(0x64).to_string().contains("0x64"));
        let e = Error::PadWithoutPayload {
            opcode: Opcode::Acknowledge,
            pad_count: 2,
        };
        assert!(e.to_string().contains("Acknowledge"));
    }
}
