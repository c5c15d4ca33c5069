//! The figures: latency samples into an HdrHistogram (plus exact min/max/mean/stdev), and
//! bandwidth from completion counts and timestamps.

use hdrhistogram::Histogram;

/// The longest latency sample recorded exactly (one hour, in ns); longer ones saturate.
const HIST_MAX_NS: u64 = 3_600_000_000_000;

/// Collects latency samples (nanoseconds) without allocating: the histogram and the
/// optional sample list (`-H`) are sized before the measurement starts.
#[derive(Debug)]
pub struct LatRecorder {
    interval: Option<Box<IntervalLog>>,
    hist: Histogram<u64>,
    samples: Option<Vec<u64>>,
    n: u64,
    sum: u128,
    sum_sq: u128,
    min: u64,
    max: u64,
}

/// One interval of `--hlog`: the message size, its start (since the first measurement)
/// and length, and the latencies recorded in it (ns).
pub type Interval = (
    u64,
    std::time::Duration,
    std::time::Duration,
    Histogram<u64>,
);

/// `--hlog`'s state: the current interval's histogram and the finished ones.
#[derive(Debug)]
struct IntervalLog {
    hist: Histogram<u64>,
    every: std::time::Duration,
    run_start: std::time::Instant,
    start: std::time::Instant,
    size: u64,
    done: Vec<Interval>,
}

impl IntervalLog {
    fn close(&mut self, now: std::time::Instant) {
        self.done.push((
            self.size,
            self.start.duration_since(self.run_start),
            now.duration_since(self.start),
            self.hist.clone(),
        ));
        self.hist.reset();
        self.start = now;
    }
}

impl LatRecorder {
    /// A recorder; with `keep_samples`, room for that many raw samples too.
    pub fn new(keep_samples: Option<usize>) -> LatRecorder {
        let mut hist = Histogram::new_with_bounds(1, HIST_MAX_NS, 3)
            .expect("1 ns .. 1 h with 3 significant digits is a valid histogram");
        // Touch every page now (reset writes every counter), so that recording never
        // page-faults inside a measurement.
        hist.reset();
        // Written once (not `vec![0; n]`, whose zero pages stay untouched) for the same
        // reason.
        #[allow(clippy::slow_vector_initialization)]
        let samples = keep_samples.map(|n| {
            let mut v = Vec::with_capacity(n);
            v.resize(n, 0u64);
            std::hint::black_box(&mut v);
            v.clear();
            v
        });
        LatRecorder {
            interval: None,
            hist,
            samples,
            n: 0,
            sum: 0,
            sum_sq: 0,
            min: u64::MAX,
            max: 0,
        }
    }

    /// Forgets every sample (keeps the memory).
    pub fn reset(&mut self) {
        self.hist.reset();
        if let Some(s) = self.samples.as_mut() {
            s.clear();
        }
        self.n = 0;
        self.sum = 0;
        self.sum_sq = 0;
        self.min = u64::MAX;
        self.max = 0;
    }

    /// Also keeps a histogram per `every` of measurement (`--hlog`).
    pub fn log_intervals(&mut self, every: std::time::Duration) {
        let mut hist = self.hist.clone();
        hist.reset();
        let now = std::time::Instant::now();
        self.interval = Some(Box::new(IntervalLog {
            hist,
            every,
            run_start: now,
            start: now,
            size: 0,
            done: Vec::new(),
        }));
    }

    /// Starts the interval clock of a new measurement (after its warm-up).
    pub fn start_intervals(&mut self, size: u64) {
        if let Some(l) = self.interval.as_mut() {
            l.hist.reset();
            l.start = std::time::Instant::now();
            l.size = size;
        }
    }

    /// Closes the current interval if `now` ends it (`--hlog`). The finished interval's
    /// histogram is copied out: one allocation per interval, only with `--hlog`.
    #[inline]
    pub fn tick(&mut self, now: std::time::Instant) {
        if let Some(l) = self.interval.as_mut() {
            if now.duration_since(l.start) >= l.every {
                l.close(now);
            }
        }
    }

    /// Closes the last, partial interval of a measurement.
    pub fn end_intervals(&mut self) {
        if let Some(l) = self.interval.as_mut() {
            if !l.hist.is_empty() {
                l.close(std::time::Instant::now());
            }
        }
    }

    /// The finished intervals: (size, start since the first measurement, length, histogram).
    pub fn intervals(&self) -> &[Interval] {
        self.interval.as_ref().map_or(&[], |l| &l.done)
    }

    /// Records one sample in nanoseconds.
    #[inline]
    pub fn record(&mut self, ns: u64) {
        if let Some(l) = self.interval.as_mut() {
            l.hist.saturating_record(ns.max(1));
        }
        self.hist.saturating_record(ns.max(1));
        if let Some(s) = self.samples.as_mut() {
            if s.len() < s.capacity() {
                s.push(ns);
            }
        }
        self.n += 1;
        self.sum += u128::from(ns);
        self.sum_sq += u128::from(ns) * u128::from(ns);
        self.min = self.min.min(ns);
        self.max = self.max.max(ns);
    }

    /// The raw samples kept for `-H`.
    pub fn samples(&self) -> &[u64] {
        self.samples.as_deref().unwrap_or(&[])
    }

    /// The histogram.
    pub fn histogram(&self) -> &Histogram<u64> {
        &self.hist
    }

    /// The figures of perftest's latency table.
    pub fn stats(&self) -> LatStats {
        if self.n == 0 {
            return LatStats::default();
        }
        let n = self.n as f64;
        let mean = self.sum as f64 / n;
        let var = (self.sum_sq as f64 / n - mean * mean).max(0.0);
        // Histogram buckets report their highest equivalent value; keep every percentile
        // within the exact extremes so the table stays ordered.
        let q = |quantile: f64| {
            self.hist
                .value_at_quantile(quantile)
                .clamp(self.min, self.max)
        };
        LatStats {
            iters: self.n,
            min_ns: self.min,
            max_ns: self.max,
            median_ns: q(0.5),
            mean_ns: mean,
            stdev_ns: var.sqrt(),
            p99_ns: q(0.99),
            p999_ns: q(0.999),
        }
    }
}

/// One row of a latency table, in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LatStats {
    /// Samples.
    pub iters: u64,
    /// Smallest.
    pub min_ns: u64,
    /// Largest.
    pub max_ns: u64,
    /// Median (perftest's t_typical).
    pub median_ns: u64,
    /// Mean.
    pub mean_ns: f64,
    /// Standard deviation.
    pub stdev_ns: f64,
    /// 99th percentile.
    pub p99_ns: u64,
    /// 99.9th percentile.
    pub p999_ns: u64,
}

/// Timestamps of a bandwidth run: the start, a checkpoint every `chunk` completed messages
/// (for the peak), and the end. Preallocated; recording does not allocate.
#[derive(Debug)]
pub struct BwClock {
    start: std::time::Instant,
    chunk: u64,
    next: u64,
    marks: Vec<(u64, u64)>,
    end_ns: u64,
    total: u64,
}

impl BwClock {
    /// A clock for `total` messages with a checkpoint every `chunk`.
    pub fn new(total: u64, chunk: u64) -> BwClock {
        let chunk = chunk.clamp(1, total.max(1));
        BwClock {
            start: std::time::Instant::now(),
            chunk,
            next: chunk,
            marks: Vec::with_capacity((total / chunk + 2) as usize),
            end_ns: 0,
            total,
        }
    }

    /// Starts the clock.
    pub fn start(&mut self) {
        self.marks.clear();
        self.marks.push((0, 0));
        self.next = self.chunk;
        self.start = std::time::Instant::now();
    }

    /// Notes that `done` messages have completed. Returns the nanoseconds since the start
    /// when a checkpoint was taken.
    #[inline]
    pub fn completed(&mut self, done: u64) -> Option<u64> {
        if done < self.next && done < self.total {
            return None;
        }
        let ns = self.start.elapsed().as_nanos() as u64;
        if self.marks.len() < self.marks.capacity() {
            self.marks.push((done, ns));
        }
        self.next = (done / self.chunk + 1) * self.chunk;
        if done >= self.total {
            self.end_ns = ns;
        }
        Some(ns)
    }

    /// The figures, for messages of `size` bytes.
    pub fn stats(&self, size: u64, iters: u64, qps: u32) -> BwStats {
        let secs = (self.end_ns.max(1)) as f64 / 1e9;
        let avg = (self.total as f64 * size as f64) / secs;
        let mut peak: f64 = avg;
        for w in self.marks.windows(2) {
            let (m0, t0) = w[0];
            let (m1, t1) = w[1];
            if t1 > t0 && m1 > m0 {
                let rate = (m1 - m0) as f64 * size as f64 / ((t1 - t0) as f64 / 1e9);
                peak = peak.max(rate);
            }
        }
        BwStats {
            size,
            iters,
            qps,
            messages: self.total,
            elapsed_ns: self.end_ns,
            peak_bytes_per_sec: peak,
            avg_bytes_per_sec: avg,
            msg_rate_mpps: self.total as f64 / secs / 1e6,
        }
    }
}

/// What a [`TimedClock`] says after a batch of completions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Tick {
    /// Keep going.
    Go,
    /// `--run_infinitely`: an interval ended; its figures (peak 0, as perftest's).
    Report(BwStats),
    /// The run's time is up: stop posting, finish what is outstanding.
    Stop,
    /// The measurement window closed with no completion in it: there is nothing to
    /// measure, and the run ends with an error.
    Empty,
}

/// The clock of a timed bandwidth run: `-D SECS` measures from `margin` to
/// `SECS - margin` seconds after the start and stops at `SECS` (perftest's duration mode,
/// which reports no peak); `--run_infinitely` reports every interval and never stops.
/// Reads the time once per batch of completions; allocates nothing.
#[derive(Debug)]
pub struct TimedClock {
    size: u64,
    qps: u32,
    start: std::time::Instant,
    /// Measurement window and stop, ns since the start (`u64::MAX`: never).
    from_ns: u64,
    to_ns: u64,
    stop_ns: u64,
    /// `(completed, ns)` at the window's edges.
    from: Option<(u64, u64)>,
    to: Option<(u64, u64)>,
    /// `--run_infinitely`: the interval, and the last report's `(completed, ns)`.
    every_ns: Option<u64>,
    last: (u64, u64),
    /// When the first completion came, ns since the start.
    first_ns: Option<u64>,
}

impl TimedClock {
    /// `-D secs` with margins `margin`, for `size`-byte messages on `qps` QPs.
    pub fn duration(secs: u64, margin: u64, size: u64, qps: u32) -> TimedClock {
        TimedClock::new(
            size,
            qps,
            margin * 1_000_000_000,
            (secs - margin) * 1_000_000_000,
            secs * 1_000_000_000,
            None,
        )
    }

    /// `--run_infinitely`, a report every `every` seconds.
    pub fn forever(every: u64, size: u64, qps: u32) -> TimedClock {
        TimedClock::new(
            size,
            qps,
            0,
            u64::MAX,
            u64::MAX,
            Some(every * 1_000_000_000),
        )
    }

    fn new(
        size: u64,
        qps: u32,
        from_ns: u64,
        to_ns: u64,
        stop_ns: u64,
        every_ns: Option<u64>,
    ) -> TimedClock {
        TimedClock {
            size,
            qps,
            start: std::time::Instant::now(),
            from_ns,
            to_ns,
            stop_ns,
            from: None,
            to: None,
            every_ns,
            last: (0, 0),
            first_ns: None,
        }
    }

    /// Starts the clock.
    pub fn start(&mut self) {
        self.start = std::time::Instant::now();
        self.from = None;
        self.to = None;
        self.last = (0, 0);
        self.first_ns = None;
    }

    /// Notes that `done` messages have completed (in all, since the start).
    #[inline]
    pub fn completed(&mut self, done: u64) -> Tick {
        let ns = self.start.elapsed().as_nanos() as u64;
        self.completed_at(done, ns)
    }

    /// [`TimedClock::completed`] at `ns` nanoseconds after the start.
    #[inline]
    fn completed_at(&mut self, done: u64, ns: u64) -> Tick {
        self.first_ns.get_or_insert(ns);
        if self.from.is_none() && ns >= self.to_ns {
            // No completion fell between the window's edges: whatever comes now is
            // after it, and the window would measure nothing.
            return Tick::Empty;
        }
        if self.from.is_none() && ns >= self.from_ns {
            self.from = Some((done, ns));
        }
        if self.to.is_none() && ns >= self.to_ns {
            self.to = Some((done, ns));
        }
        if let Some(every) = self.every_ns {
            if ns - self.last.1 >= every {
                let st = self.figures(self.last, (done, ns));
                self.last = (done, ns);
                return Tick::Report(st);
            }
        }
        if ns >= self.stop_ns {
            Tick::Stop
        } else {
            Tick::Go
        }
    }

    /// What the clock says while no completion comes: [`Tick::Empty`] once the
    /// measurement window has closed with none in it (the run can end now rather than wait
    /// for requests that can no longer be measured), else [`Tick::Go`]. Reads the time;
    /// for the idle path only.
    pub fn idle(&self) -> Tick {
        self.idle_at(self.start.elapsed().as_nanos() as u64)
    }

    fn idle_at(&self, ns: u64) -> Tick {
        if self.from.is_none() && ns >= self.to_ns {
            Tick::Empty
        } else {
            Tick::Go
        }
    }

    /// The measurement window, in seconds after the start.
    pub fn window_secs(&self) -> (f64, f64) {
        (self.from_ns as f64 / 1e9, self.to_ns as f64 / 1e9)
    }

    /// Seconds from the start to the first completion, if one came.
    pub fn first_completion_secs(&self) -> Option<f64> {
        self.first_ns.map(|ns| ns as f64 / 1e9)
    }

    /// Seconds since the start.
    pub fn elapsed_secs(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn figures(&self, (m0, t0): (u64, u64), (m1, t1): (u64, u64)) -> BwStats {
        let messages = m1.saturating_sub(m0);
        let secs = (t1.saturating_sub(t0)).max(1) as f64 / 1e9;
        BwStats {
            size: self.size,
            iters: messages,
            qps: self.qps,
            messages,
            elapsed_ns: t1.saturating_sub(t0),
            peak_bytes_per_sec: 0.0,
            avg_bytes_per_sec: messages as f64 * self.size as f64 / secs,
            msg_rate_mpps: messages as f64 / secs / 1e6,
        }
    }

    /// The figures of the measurement window (peak 0, as perftest's duration mode;
    /// `#iterations` is the messages completed in the window).
    pub fn stats(&self) -> BwStats {
        let from = self.from.unwrap_or((0, 0));
        let to = self.to.unwrap_or(self.last);
        self.figures(from, to)
    }
}

/// One row of a bandwidth table.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BwStats {
    /// Message size.
    pub size: u64,
    /// Iterations per QP.
    pub iters: u64,
    /// QPs.
    pub qps: u32,
    /// Messages in all.
    pub messages: u64,
    /// Nanoseconds from the first post to the last completion.
    pub elapsed_ns: u64,
    /// Best rate over one checkpoint interval, bytes/s.
    pub peak_bytes_per_sec: f64,
    /// Bytes over the whole run, bytes/s.
    pub avg_bytes_per_sec: f64,
    /// Millions of messages per second.
    pub msg_rate_mpps: f64,
}

/// Bytes/s in perftest's MiB/s (2^20 bytes) or Gbit/s (10^9 bits).
pub fn bw_unit(bytes_per_sec: f64, gbits: bool) -> f64 {
    if gbits {
        bytes_per_sec * 8.0 / 1e9
    } else {
        bytes_per_sec / 1_048_576.0
    }
}

/// This process's resident set in KiB (from /proc/self/statm), or 0 if unreadable.
pub fn rss_kib() -> u64 {
    let page = rustix::param::page_size() as u64;
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * page / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_figures_are_exact_and_ordered() {
        let mut r = LatRecorder::new(Some(4));
        for ns in [1000, 2000, 3000, 4000, 100_000] {
            r.record(ns);
        }
        let s = r.stats();
        // HdrHistogram reports a bucket's highest equivalent value (3 significant digits).
        let median = r.histogram().highest_equivalent(3000);
        assert!((3000..=3003).contains(&median));
        assert_eq!(
            (s.iters, s.min_ns, s.max_ns, s.median_ns),
            (5, 1000, 100_000, median)
        );
        assert!((s.mean_ns - 22_000.0).abs() < 1e-6);
        assert!((s.stdev_ns - 39_012.818_92).abs() < 0.01, "{}", s.stdev_ns);
        assert!(s.p99_ns <= s.max_ns && s.p999_ns <= s.max_ns && s.p99_ns >= s.median_ns);
        assert_eq!(r.samples(), &[1000, 2000, 3000, 4000]);
        r.reset();
        assert_eq!(r.stats(), LatStats::default());
        assert!(r.samples().is_empty());
    }

    #[test]
    fn percentiles_never_exceed_the_maximum() {
        let mut r = LatRecorder::new(None);
        r.record(123_457);
        let s = r.stats();
        assert_eq!(
            (s.median_ns, s.p99_ns, s.p999_ns),
            (123_457, 123_457, 123_457)
        );
    }

    #[test]
    fn bandwidth_average_and_peak() {
        let mut c = BwClock::new(100, 10);
        c.start();
        // Fake a run: 10 messages per checkpoint; the clock is real, so only check the
        // relations that hold whatever the timing.
        for done in (10..=100).step_by(10) {
            std::thread::sleep(std::time::Duration::from_millis(1));
            assert!(c.completed(done).is_some());
        }
        assert!(c.completed(100).is_some());
        let s = c.stats(1000, 100, 1);
        assert_eq!(s.messages, 100);
        assert!(s.elapsed_ns >= 10_000_000);
        assert!(s.peak_bytes_per_sec >= s.avg_bytes_per_sec);
        let expect_avg = 100.0 * 1000.0 / (s.elapsed_ns as f64 / 1e9);
        assert!((s.avg_bytes_per_sec - expect_avg).abs() < 1e-6 * expect_avg);
        assert!((s.msg_rate_mpps - 100.0 / (s.elapsed_ns as f64 / 1e9) / 1e6).abs() < 1e-9);
    }

    #[test]
    fn units() {
        assert_eq!(bw_unit(1_048_576.0, false), 1.0);
        assert_eq!(bw_unit(125_000_000.0, true), 1.0);
    }

    #[test]
    fn rss_is_readable() {
        assert!(rss_kib() > 0);
    }
}

/// The timed clock's measurement window when the machine is slow (issue 24: a debug build
/// printed "0 iterations, 0.00 MiB/s" after a 5 s run whose first completion came late).
#[cfg(test)]
mod timed_window_tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn a_first_completion_after_the_window_is_an_empty_window_not_a_stop() {
        // -D 5 (margin 1): the window is 1 s to 4 s; the first completion comes at 10 s.
        let mut c = TimedClock::duration(5, 1, 8_388_608, 3);
        assert_eq!(c.completed_at(300, 10 * S), Tick::Empty);
    }

    #[test]
    fn completions_in_the_window_are_measured_and_the_run_stops_at_its_duration() {
        let mut c = TimedClock::duration(5, 1, 8, 1);
        assert_eq!(c.completed_at(100, S / 2), Tick::Go);
        assert_eq!(c.completed_at(200, 3 * S / 2), Tick::Go);
        assert_eq!(c.completed_at(300, 42 * S / 10), Tick::Go);
        assert_eq!(c.completed_at(400, 51 * S / 10), Tick::Stop);
        let st = c.stats();
        assert_eq!((st.messages, st.elapsed_ns), (100, 27 * S / 10));
    }

    #[test]
    fn a_completion_exactly_at_the_end_of_the_window_leaves_it_empty() {
        let mut c = TimedClock::duration(5, 1, 8, 1);
        assert_eq!(c.completed_at(5, 4 * S - 1), Tick::Go);
        assert_eq!(c.completed_at(9, 5 * S), Tick::Stop);
        assert_eq!(c.stats().messages, 4);
        let mut c = TimedClock::duration(5, 1, 8, 1);
        assert_eq!(c.completed_at(5, 4 * S), Tick::Empty);
    }

    #[test]
    fn an_idle_clock_knows_the_window_is_empty_once_it_has_closed() {
        let c = TimedClock::duration(5, 1, 8, 1);
        assert_eq!(c.idle_at(4 * S - 1), Tick::Go);
        assert_eq!(c.idle_at(4 * S), Tick::Empty);
        // A completion inside the window: the next one closes it with a measurement.
        let mut c = TimedClock::duration(5, 1, 8, 1);
        assert_eq!(c.completed_at(10, 2 * S), Tick::Go);
        assert_eq!(c.idle_at(6 * S), Tick::Go);
        assert_eq!(c.first_completion_secs(), Some(2.0));
        assert_eq!(c.window_secs(), (1.0, 4.0));
        // --run_infinitely has no window to miss.
        let c = TimedClock::forever(1, 8, 1);
        assert_eq!(c.idle_at(u64::MAX / 2), Tick::Go);
    }

    /// cargo mutants: the interval test of --run_infinitely had no test of its own.
    #[test]
    fn run_infinitely_reports_each_interval_once_it_has_passed() {
        let mut c = TimedClock::forever(1, 8, 1);
        assert_eq!(c.completed_at(10, S / 2), Tick::Go);
        let Tick::Report(st) = c.completed_at(20, S) else {
            panic!("no report after one interval")
        };
        assert_eq!((st.messages, st.elapsed_ns), (20, S));
        assert_eq!(c.completed_at(25, 3 * S / 2), Tick::Go);
        let Tick::Report(st) = c.completed_at(40, 21 * S / 10) else {
            panic!("no report after the second interval")
        };
        assert_eq!((st.messages, st.elapsed_ns), (20, 11 * S / 10));
    }
}
