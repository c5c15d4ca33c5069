//! 24-bit Packet Sequence Numbers and the windows built on them.
//!
//! Every request packet carries a PSN in its BTH (spec 01, "Remote RQ Start ePSN = Local SQ
//! Start PSN"); PSNs count modulo 2^24 and are compared within a window of 2^23 (8M) PSNs
//! (spec 01, "Maximum Number of UnAck'd Request Packets"). This module owns that
//! arithmetic so that nothing else in the crate does modular comparisons by hand:
//!
//! * [`Psn`]: the newtype, masked to 24 bits, with wrapping `add`/`sub` and a signed
//!   distance ([`Psn::diff`]) from which [`Psn::before`] / [`Psn::after`] follow;
//! * [`classify`]: the RQ Logic's view of an incoming request PSN against its ePSN
//!   (spec 01, Figure 17-3): valid, duplicate or invalid;
//! * [`read_response_packets`], [`packets_for`]: the packet counts behind the nPSN rules
//!   of spec 01 "Some Definitions" (the SQ Logic's `next_psn`).
//!
//! Leaf vocabulary: this module imports nothing of the crate, so the wire codec, the
//! protocol core and the verbs layer can all use it.
//!
//! All functions are total: none panics, whatever the arguments.
#![forbid(unsafe_code)]

use core::fmt;
use core::ops::{Add, Sub};

/// A 24-bit Packet Sequence Number (BTH:PSN, spec 01 Figure 17-4).
///
/// Arithmetic wraps modulo 2^24 (`0xFF_FFFF + 1 == 0`). Ordering is only meaningful within
/// half the sequence space, so `Psn` deliberately does not implement `Ord`: use
/// [`Psn::diff`], [`Psn::before`] or [`Psn::after`].
///
/// ```
/// use shmhca_proto::psn::Psn;
/// let last = Psn::new(0xFF_FFFF);
/// assert_eq!(last + 1, Psn::new(0));
/// assert_eq!(Psn::new(0).diff(last), 1);
/// assert!(last.before(Psn::new(0)));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Psn(u32);

impl Psn {
    /// The 24 bits a PSN occupies.
    pub const MASK: u32 = 0xFF_FFFF;
    /// Half the PSN space (2^23 = 8M): the largest distance at which two PSNs still compare.
    pub const WINDOW: u32 = 1 << 23;

    /// Makes a PSN from the low 24 bits of `v` (the upper 8 bits are discarded).
    #[inline]
    pub const fn new(v: u32) -> Psn {
        Psn(v & Self::MASK)
    }

    /// The PSN as a number in `0..=0xFF_FFFF`.
    #[inline]
    pub const fn get(self) -> u32 {
        self.0
    }

    /// `self + n` modulo 2^24.
    #[inline]
    #[allow(clippy::should_implement_trait)] // the trait is implemented too; this one is const
    pub const fn add(self, n: u32) -> Psn {
        Psn::new(self.0.wrapping_add(n))
    }

    /// `self - n` modulo 2^24.
    #[inline]
    #[allow(clippy::should_implement_trait)] // the trait is implemented too; this one is const
    pub const fn sub(self, n: u32) -> Psn {
        Psn::new(self.0.wrapping_sub(n))
    }

    /// The signed distance `self - other`, as a 24-bit two's-complement number in
    /// `[-2^23, 2^23)` (the `psn_compare` idea of rxe).
    ///
    /// Positive means `self` comes after `other` within the window.
    #[inline]
    pub const fn diff(self, other: Psn) -> i32 {
        // Shift the 24-bit difference into the top of an i32 and back: sign extension.
        ((self.0.wrapping_sub(other.0) << 8) as i32) >> 8
    }

    /// Whether `self` precedes `other` in the 8M window (`self.diff(other) < 0`).
    ///
    /// Exactly one of `a.before(b)`, `a == b`, `a.after(b)` holds for any pair; the pair at
    /// distance exactly 2^23 counts as `before` (the distance is `-2^23`).
    #[inline]
    pub const fn before(self, other: Psn) -> bool {
        self.diff(other) < 0
    }

    /// Whether `self` follows `other` in the 8M window (`self.diff(other) > 0`).
    #[inline]
    pub const fn after(self, other: Psn) -> bool {
        self.diff(other) > 0
    }
}

impl fmt::Debug for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Psn({})", self.0)
    }
}

impl fmt::Display for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl Add<u32> for Psn {
    type Output = Psn;
    #[inline]
    fn add(self, n: u32) -> Psn {
        Psn::add(self, n)
    }
}

impl Sub<u32> for Psn {
    type Output = Psn;
    #[inline]
    fn sub(self, n: u32) -> Psn {
        Psn::sub(self, n)
    }
}

impl From<Psn> for u32 {
    #[inline]
    fn from(psn: Psn) -> u32 {
        psn.0
    }
}

/// Where a request PSN falls relative to the RQ Logic's ePSN (spec 01, Figure 17-3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PsnRegion {
    /// The PSN equals ePSN: the next request, to be executed.
    Valid,
    /// One of the 2^23 PSNs before ePSN: a request already seen, to be re-acknowledged
    /// (or, for an RDMA Read or Atomic, re-answered) without executing it again.
    Duplicate,
    /// Any of the other 2^23 - 1 PSNs ("ahead" of ePSN): a sequence error, answered with
    /// a PSN Sequence Error Nak.
    Invalid,
}

/// Classifies a request `psn` against the RQ Logic's expected PSN `epsn` (spec 01 Figure
/// 17-3): [`Valid`](PsnRegion::Valid) if equal, [`Duplicate`](PsnRegion::Duplicate) for
/// the 2^23 PSNs `epsn - 2^23 ..= epsn - 1`, [`Invalid`](PsnRegion::Invalid) for the
/// remaining 2^23 - 1 PSNs `epsn + 1 ..= epsn + 2^23 - 1`.
///
/// ```
/// use shmhca_proto::psn::{classify, Psn, PsnRegion};
/// let epsn = Psn::new(0);
/// assert_eq!(classify(Psn::new(0), epsn), PsnRegion::Valid);
/// assert_eq!(classify(Psn::new(0xFF_FFFF), epsn), PsnRegion::Duplicate);
/// assert_eq!(classify(Psn::new(1), epsn), PsnRegion::Invalid);
/// ```
#[inline]
pub const fn classify(psn: Psn, epsn: Psn) -> PsnRegion {
    // How far behind ePSN the PSN is, in 0..2^24.
    let behind = epsn.0.wrapping_sub(psn.0) & Psn::MASK;
    if behind == 0 {
        PsnRegion::Valid
    } else if behind <= Psn::WINDOW {
        PsnRegion::Duplicate
    } else {
        PsnRegion::Invalid
    }
}

/// The number of RDMA Read response packets a read of `dma_len` bytes produces at path MTU
/// `pmtu`: `max(1, ceil(dma_len / pmtu))` (a zero-length read still gets one response).
///
/// A `pmtu` of 0 is a caller bug (PMTUs are 256..=4096 and are checked when the QP is set
/// up); it is treated as 1 rather than dividing by zero.
#[inline]
pub const fn read_response_packets(dma_len: u32, pmtu: u32) -> u32 {
    let pmtu = if pmtu == 0 { 1 } else { pmtu };
    if dma_len == 0 {
        1
    } else if pmtu.is_power_of_two() {
        // Every PMTU is a power of two: a shift, not a division.
        let shift = pmtu.trailing_zeros();
        (dma_len >> shift) + ((dma_len & (pmtu - 1)) != 0) as u32
    } else {
        dma_len.div_ceil(pmtu)
    }
}

/// The number of request packets a Send or RDMA Write of `len` bytes takes at path MTU
/// `pmtu`: `max(1, ceil(len / pmtu))` (a zero-length message is one packet).
///
/// Saturates at `u32::MAX` (unreachable for IBA messages, which are at most 2^31 bytes).
/// A `pmtu` of 0 is treated as 1, as in [`read_response_packets`].
#[inline]
pub const fn packets_for(len: u64, pmtu: u32) -> u32 {
    let pmtu = if pmtu == 0 { 1 } else { pmtu as u64 };
    if len == 0 {
        return 1;
    }
    let n = if pmtu.is_power_of_two() {
        let shift = pmtu.trailing_zeros();
        (len >> shift) + ((len & (pmtu - 1)) != 0) as u64
    } else {
        len.div_ceil(pmtu)
    };
    if n > u32::MAX as u64 {
        u32::MAX
    } else {
        n as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_masks_to_24_bits() {
        assert_eq!(Psn::new(0x1FF_FFFF).get(), 0xFF_FFFF);
        assert_eq!(Psn::new(0x100_0000).get(), 0);
        assert_eq!(u32::from(Psn::new(0xAB_CDEF)), 0xAB_CDEF);
    }

    #[test]
    fn diff_at_the_edges_of_the_window() {
        let zero = Psn::new(0);
        assert_eq!(
            Psn::new(Psn::WINDOW - 1).diff(zero),
            (Psn::WINDOW - 1) as i32
        );
        assert_eq!(Psn::new(Psn::WINDOW).diff(zero), -(Psn::WINDOW as i32));
        assert_eq!(zero.diff(Psn::new(Psn::WINDOW)), -(Psn::WINDOW as i32));
        assert_eq!(Psn::new(0xFF_FFFF).diff(zero), -1);
        assert!(Psn::new(Psn::WINDOW).before(zero));
        assert!(!zero.before(zero) && !zero.after(zero));
    }

    #[test]
    fn debug_and_display_are_decimal() {
        assert_eq!(format!("{:?}", Psn::new(0x10)), "Psn(16)");
        assert_eq!(Psn::new(0xFF_FFFF).to_string(), "16777215");
    }

    #[test]
    fn response_and_request_packet_counts() {
        assert_eq!(read_response_packets(0, 1024), 1);
        assert_eq!(read_response_packets(1, 1024), 1);
        assert_eq!(read_response_packets(1024, 1024), 1);
        assert_eq!(read_response_packets(1025, 1024), 2);
        assert_eq!(read_response_packets(u32::MAX, 256), 16_777_216);
        assert_eq!(read_response_packets(10, 0), 10);
        assert_eq!(packets_for(0, 4096), 1);
        assert_eq!(packets_for(4096, 4096), 1);
        assert_eq!(packets_for(4097, 4096), 2);
        assert_eq!(packets_for(1 << 31, 256), 1 << 23);
        assert_eq!(packets_for(u64::MAX, 1), u32::MAX);
    }
}
