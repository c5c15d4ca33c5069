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
        }
    }

    /// Starts the clock.
    pub fn start(&mut self) {
        self.start = std::time::Instant::now();
        self.from = None;
        self.to = None;
        self.last = (0, 0);
    }

    /// Notes that `done` messages have completed (in all, since the start).
    #[inline]
    pub fn completed(&mut self, done: u64) -> Tick {
        let ns = self.start.elapsed().as_nanos() as u64;
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
