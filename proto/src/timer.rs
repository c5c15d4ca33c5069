//! The transport timer and deadlines (spec/01 "SQ Logic's Transport Timer",
//! spec/04, DESIGN.md's timer table).
//!
//! Protocol logic never reads the clock: the engine holds a [`Clock`] and passes the time
//! in, so tests drive time by hand with a [`ManualClock`], which jumps to the next deadline
//! instead of waiting for it.

use core::cell::Cell;
use core::time::Duration;

/// An RNR Retry Count of 7 means retry forever.
pub const RNR_RETRY_FOREVER: u8 = 7;

/// A point in time: nanoseconds since the origin of a [`Clock`] (the engine's is
/// `CLOCK_MONOTONIC`).
///
/// # The engine's clock and what it costs
///
/// Timers are precise to well under a microsecond of clock error: deadlines are started
/// and compared with [`Clock::now`], which in the engine reads `CLOCK_MONOTONIC` (through
/// the vDSO on Linux with the `tsc`, `kvm-clock` or `arch_sys_counter` clocksources: about
/// 20 ns and no system call). Most poll iterations read no clock at all: the engine looks at
/// its timers once every few iterations and only while some QP has one armed, and a check
/// of a deadline that is still far away reads only the coarse clock ([`Clock::coarse`],
/// about 1 ns; see [`Deadline::expired_by`]). So a timer of value `v` fires between `v`
/// and `v` plus one engine iteration batch (a microsecond or so) after it was started,
/// while the engine is driven.
///
/// Protocol code never reads the clock itself: it is given the time, so tests drive time
/// by hand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The timestamp `ns` nanoseconds after the clock's origin.
    pub const fn from_nanos(ns: u64) -> Timestamp {
        Timestamp(ns)
    }

    /// Nanoseconds since the clock's origin.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// `d` later (saturating).
    #[inline]
    pub fn after(self, d: Duration) -> Timestamp {
        Timestamp(
            self.0
                .saturating_add(d.as_nanos().min(u128::from(u64::MAX)) as u64),
        )
    }

    /// How long after `earlier` this is (zero if it is not after it): with
    /// [`Clock::now`], how long to sleep until a deadline.
    pub fn saturating_duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

/// Where the time comes from. The protocol never reads a clock of its own: whoever drives
/// it (the engine, a test) holds one of these and passes the time in, so a test replaces
/// the wall clock with a [`ManualClock`] and a timer of a minute takes no time at all.
///
/// Implementations are generic parameters, never trait objects: a clock read is a direct
/// call.
pub trait Clock {
    /// The precise time now.
    fn now(&self) -> Timestamp;

    /// The resolution of [`Clock::now`]: a deadline armed at a reading may expire up to
    /// this much early in true time, so [`Deadline::arm`] adds it.
    fn resolution(&self) -> Duration;

    /// A cheaper reading of the same time line: never ahead of [`Clock::now`] and behind it
    /// by less than [`Clock::coarse_lag`]. By default the precise time.
    fn coarse(&self) -> Timestamp {
        self.now()
    }

    /// How far [`Clock::coarse`] may be behind [`Clock::now`] (zero by default).
    fn coarse_lag(&self) -> Duration {
        Duration::ZERO
    }

    /// This clock as [`Timers`], read at each question.
    fn timers(&self) -> ClockTimers<'_, Self> {
        ClockTimers(self)
    }
}

/// The time as the protocol's timers see it while a driver runs them: what
/// [`Requester::handle_timeout`](crate::requester::Requester::handle_timeout) and the
/// transmit path's RNR check are passed. A driver implements it over its [`Clock`] and may
/// cache a reading for the length of one iteration (the engine reads the clock once, and
/// only when a deadline is near: see [`Deadline::expired_by`]); [`ClockTimers`] reads the
/// clock each time.
pub trait Timers {
    /// The time now.
    fn now(&mut self) -> Timestamp;

    /// Starts `d` if it was armed to start later ([`Deadline::arm_later`]).
    fn start(&mut self, d: &mut Deadline);

    /// Whether `d` is started and has passed.
    fn expired(&mut self, d: &Deadline) -> bool;
}

/// [`Timers`] over a [`Clock`], read afresh at each question (tests; a driver that reads
/// its clock once per iteration implements [`Timers`] itself).
#[derive(Debug)]
pub struct ClockTimers<'c, C: ?Sized>(pub &'c C);

impl<C: Clock + ?Sized> Timers for ClockTimers<'_, C> {
    fn now(&mut self) -> Timestamp {
        self.0.now()
    }

    fn start(&mut self, d: &mut Deadline) {
        d.start(self.0.now(), self.0.resolution());
    }

    fn expired(&mut self, d: &Deadline) -> bool {
        d.expired(self.0.now())
    }
}

/// A clock that moves only when told: for tests of timers, which jump to the next deadline
/// instead of waiting for it.
///
/// ```
/// use core::time::Duration;
/// use shmhca_proto::timer::{Clock, Deadline, ManualClock, Timestamp};
///
/// let clock = ManualClock::new(Timestamp::from_nanos(1_000));
/// let mut d = Deadline::default();
/// d.arm(clock.now(), Duration::from_secs(60), clock.resolution());
/// assert!(!d.expired(clock.now()));
/// // A minute passes in no time.
/// clock.advance_to(d.at().unwrap());
/// assert!(d.expired(clock.now()));
/// ```
#[derive(Debug, Default)]
pub struct ManualClock {
    now: Cell<u64>,
}

impl ManualClock {
    /// A clock standing at `t`.
    pub const fn new(t: Timestamp) -> ManualClock {
        ManualClock {
            now: Cell::new(t.0),
        }
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.now.set(Timestamp(self.now.get()).after(d).0);
    }

    /// Moves the clock to `t`, if `t` is ahead of it (a clock never goes back).
    pub fn advance_to(&self, t: Timestamp) {
        self.now.set(self.now.get().max(t.0));
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.now.get())
    }

    /// One nanosecond: a manual clock is exact.
    fn resolution(&self) -> Duration {
        Duration::from_nanos(1)
    }
}

/// The transport timer's period Ttr = 4.096 µs × 2^timeout (spec/01), or `None` when the
/// Local Ack Timeout is 0 (timer disabled).
///
/// A timeout must be detected between Ttr and 4·Ttr. With a clock of resolution `res` the
/// engine arms the timer for Ttr + `res` and sees it expire at most `res` late, so it
/// needs Ttr ≥ 2·`res`/3; smaller Local Ack Timeouts are raised to the smallest one that
/// satisfies this ("the CA may use its minimum", spec/01).
pub fn transport_timeout(local_ack_timeout: u8, res: Duration) -> Option<Duration> {
    if local_ack_timeout == 0 {
        return None;
    }
    let ttr = |t: u32| Duration::from_nanos(4096u64 << t.min(31));
    let mut t = u32::from(local_ack_timeout.min(31));
    while t < 31 && ttr(t) * 3 < res * 2 {
        t += 1;
    }
    Some(ttr(t))
}

/// A one-shot deadline.
///
/// Arming needs the time, and the packet path does not read the clock: a deadline can be
/// armed *to start later* ([`Deadline::arm_later`]), and the engine starts it at its next
/// look at the clock ([`Deadline::start`]) — so it expires no sooner than asked, measured
/// from a moment no earlier than the arming.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Deadline {
    /// Not armed.
    #[default]
    Off,
    /// Armed for this long, from the next time the clock is read.
    Starting(Duration),
    /// Expires at this time.
    At(Timestamp),
}

impl Deadline {
    /// Arms the deadline so that it expires no sooner than `after` from now, on a clock of
    /// resolution `res` (it adds `res`: `now` may be up to `res` behind the true time).
    pub fn arm(&mut self, now: Timestamp, after: Duration, res: Duration) {
        *self = Deadline::At(now.after(after + res));
    }

    /// Arms the deadline for `after`, counted from its [`start`](Deadline::start).
    pub fn arm_later(&mut self, after: Duration) {
        *self = Deadline::Starting(after);
    }

    /// Starts a deadline armed with [`arm_later`](Deadline::arm_later), at `now`.
    pub fn start(&mut self, now: Timestamp, res: Duration) {
        if let Deadline::Starting(after) = *self {
            self.arm(now, after, res);
        }
    }

    /// Disarms it.
    pub fn disarm(&mut self) {
        *self = Deadline::Off;
    }

    /// Whether it is armed (started or not).
    pub fn armed(&self) -> bool {
        *self != Deadline::Off
    }

    /// Whether it is started and has passed at `now`.
    pub fn expired(&self, now: Timestamp) -> bool {
        matches!(*self, Deadline::At(d) if now >= d)
    }

    /// When it expires, if it is started.
    pub fn at(&self) -> Option<Timestamp> {
        match *self {
            Deadline::At(t) => Some(t),
            _ => None,
        }
    }

    /// Whether it is started and has passed, reading the precise clock (`fine`) only when
    /// the coarse time `coarse` (behind the true time by less than `coarse_lag`) does not
    /// already tell that the deadline is still ahead. A deadline further away than that —
    /// most checks of a 67 ms transport timer — costs no precise clock read.
    pub fn expired_by(
        &self,
        coarse: Timestamp,
        coarse_lag: Duration,
        fine: impl FnOnce() -> Timestamp,
    ) -> bool {
        match *self {
            Deadline::At(d) => {
                // The true time is below coarse + coarse_lag: if that is still before d,
                // the deadline has not passed.
                coarse.after(coarse_lag) >= d && fine() >= d
            }
            _ => false,
        }
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
        for c in 1..31u8 {
            assert!(rnr_delay(c) < rnr_delay(c + 1));
        }
    }

    #[test]
    fn transport_timer_formula_and_minimum() {
        let fine = Duration::from_nanos(1);
        assert_eq!(transport_timeout(0, fine), None);
        assert_eq!(transport_timeout(1, fine), Some(Duration::from_nanos(8192)));
        // 4.096 µs × 2^14 = 67.108864 ms
        assert_eq!(
            transport_timeout(14, fine),
            Some(Duration::from_nanos(67_108_864))
        );
        // With a 4 ms clock, Ttr must be at least 2.67 ms: timeout 10 (4.19 ms) is the least.
        let coarse = Duration::from_millis(4);
        assert_eq!(transport_timeout(1, coarse), transport_timeout(10, fine));
        assert_eq!(transport_timeout(14, coarse), transport_timeout(14, fine));
        for t in 1..=31u8 {
            let ttr = transport_timeout(t, coarse).unwrap();
            // Armed for Ttr + res, seen at most res late: within [Ttr, 4 Ttr].
            assert!(ttr + 2 * coarse <= 4 * ttr, "timeout {t}");
        }
    }

    #[test]
    fn deadlines_expire_no_sooner_than_asked() {
        let res = Duration::from_millis(4);
        let t0 = Timestamp::from_nanos(1_000_000_000);
        let mut d = Deadline::default();
        assert!(!d.expired(t0));
        d.arm(t0, Duration::from_millis(10), res);
        assert!(d.armed());
        assert!(!d.expired(t0.after(Duration::from_millis(13))));
        assert!(d.expired(t0.after(Duration::from_millis(14))));
        d.disarm();
        assert!(!d.expired(t0.after(Duration::from_secs(1))));
        // Armed to start later: it never expires before it is started, and then runs its
        // full length from the start.
        d.arm_later(Duration::from_millis(10));
        assert!(d.armed());
        assert!(!d.expired(t0.after(Duration::from_secs(100))));
        let t1 = t0.after(Duration::from_secs(100));
        d.start(t1, res);
        assert!(!d.expired(t1.after(Duration::from_millis(13))));
        assert!(d.expired(t1.after(Duration::from_millis(14))));
        d.start(t1.after(Duration::from_secs(1)), res);
        assert!(
            d.expired(t1.after(Duration::from_millis(14))),
            "start only starts once"
        );
    }

    #[test]
    fn a_far_deadline_is_checked_without_the_precise_clock() {
        let lag = Duration::from_millis(4);
        let t0 = Timestamp::from_nanos(1_000_000_000);
        let mut d = Deadline::default();
        d.arm(t0, Duration::from_millis(67), Duration::from_nanos(1));
        let far = t0.after(Duration::from_millis(10));
        assert!(!d.expired_by(far, lag, || panic!("read the precise clock")));
        assert_eq!(d.at(), Some(t0.after(Duration::from_nanos(67_000_001))));
        // Within a lag of the deadline, the precise clock decides.
        let near = t0.after(Duration::from_millis(64));
        assert!(!d.expired_by(near, lag, || t0.after(Duration::from_millis(66))));
        assert!(d.expired_by(near, lag, || t0.after(Duration::from_millis(68))));
        // Not started, or off: never expired, no clock read.
        let mut s = Deadline::default();
        assert!(!s.expired_by(near, lag, || panic!("off")));
        s.arm_later(Duration::from_micros(10));
        assert!(!s.expired_by(near, lag, || panic!("not started")));
        assert_eq!(s.at(), None);
    }
}
