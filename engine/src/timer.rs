//! The transport timer and deadlines (spec/01 "SQ Logic's Transport Timer",
//! spec/04, DESIGN.md's timer table).
//!
//! Protocol logic never reads the clock: the engine passes `now` in, so scenario tests drive
//! time by hand.

use std::time::{Duration, Instant};

/// An RNR Retry Count of 7 means retry forever.
pub const RNR_RETRY_FOREVER: u8 = 7;

/// The transport timer's period Ttr = 4.096 µs × 2^timeout, or `None` when the Local Ack
/// Timeout is 0 (timer disabled).
pub fn transport_timeout(local_ack_timeout: u8) -> Option<Duration> {
    if local_ack_timeout == 0 {
        return None;
    }
    let exp = u32::from(local_ack_timeout.min(31));
    Some(Duration::from_nanos(4096u64 << exp))
}

/// A one-shot deadline.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Deadline(Option<Instant>);

impl Deadline {
    /// Arms the deadline at `now + after`.
    pub fn arm(&mut self, now: Instant, after: Duration) {
        self.0 = Some(now + after);
    }

    /// Disarms it.
    pub fn disarm(&mut self) {
        self.0 = None;
    }

    /// Whether it is armed.
    pub fn armed(&self) -> bool {
        self.0.is_some()
    }

    /// Whether it is armed and has passed at `now`.
    pub fn expired(&self, now: Instant) -> bool {
        self.0.is_some_and(|d| now >= d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::aeth::RnrTimer;

    #[test]
    fn rnr_codes_match_the_design_table() {
        let rnr_delay = |c| RnrTimer::new(c).duration();
        assert_eq!(rnr_delay(0), Duration::from_micros(655_360));
        assert_eq!(rnr_delay(1), Duration::from_micros(10));
        assert_eq!(rnr_delay(5), Duration::from_micros(60));
        assert_eq!(rnr_delay(12), Duration::from_micros(640));
        assert_eq!(rnr_delay(14), Duration::from_micros(1280));
        assert_eq!(rnr_delay(31), Duration::from_micros(491_520));
        // Monotonic after code 0.
        for c in 1..31u8 {
            assert!(rnr_delay(c) < rnr_delay(c + 1));
        }
    }

    #[test]
    fn transport_timer_formula() {
        assert_eq!(transport_timeout(0), None);
        assert_eq!(transport_timeout(1), Some(Duration::from_nanos(8192)));
        // 4.096 µs × 2^14 = 67.108864 ms
        assert_eq!(
            transport_timeout(14),
            Some(Duration::from_nanos(67_108_864))
        );
    }

    #[test]
    fn deadlines() {
        let t0 = Instant::now();
        let mut d = Deadline::default();
        assert!(!d.expired(t0));
        d.arm(t0, Duration::from_micros(10));
        assert!(d.armed());
        assert!(!d.expired(t0 + Duration::from_micros(9)));
        assert!(d.expired(t0 + Duration::from_micros(10)));
        d.disarm();
        assert!(!d.expired(t0 + Duration::from_secs(1)));
    }
}
