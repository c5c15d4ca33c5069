//! Doorbells: how a poll loop finds the queues with new work without looking at the others.
//!
//! Posting to queue `i` rings its doorbell: one bit in a two-level atomic bitmap (a summary
//! word over up to 64 words of 64 bits). The poll loop takes the summary, then each word it
//! names, with one swap each, so taking costs O(queues rung), not O(queues).
//!
//! The protocol, for one queue: the poster publishes its work (e.g. pushes a WQE on the
//! queue's ring), then rings. `ring` sets the queue's bit with a Release read-modify-write,
//! and if the word was empty before, sets the word's summary bit too. `take` swaps the
//! summary to 0 with Acquire, then swaps every word it names to 0 with Acquire, and reports
//! each bit. Two properties follow, and `shmhca-loom-tests` checks both under loom:
//!
//! * **No ring is lost.** A bit set in a word that was empty is named in the summary after
//!   it is set; a bit set in a word that was not empty joins a word whose summary bit is
//!   set, or about to be, or whose swap by `take` is still to come. A ring may be reported
//!   one `take` later than it happened, never not at all.
//! * **The work is visible.** A `take` that reports bit `i` read it with an Acquire swap
//!   from the Release RMW of a `ring(i)` (or a later RMW of the same word, which continues
//!   the release sequence), so everything the poster did before ringing happens-before
//!   what the taker does after.
//!
//! A queue rung twice before a `take` is reported once; the taker must drain all the work
//! it finds, not one item per report.
//!
//! # Watched queues: no ring at all while the taker polls the queue itself
//!
//! A busy queue would cost its poster a locked read-modify-write per post, and the taker
//! two swaps per take. Instead the taker may *watch* a queue it expects more work on
//! ([`Doorbell::watch`]): it then looks at the queue itself every iteration, and
//! [`Doorbell::ring_unless_watched`] skips the ring (one load of the watch word, no locked
//! instruction). The taker stops watching with the asymmetric Dekker of biased locking:
//!
//! * poster: publish the work, a compiler fence, load the watch bit — ring if it is clear;
//! * taker: [`Doorbell::unwatch`] (a plain store), then a *process-wide* barrier
//!   (`membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`: every running thread executes a
//!   full fence), then one last look at the queue.
//!
//! Either the poster's load comes after the barrier and sees the bit clear (it rings), or
//! its work was published before the barrier and the taker's last look finds it. The
//! taker alone writes the watch words (plain stores); a taker without such a barrier must
//! never watch. Under loom the barrier and the poster's fence are SeqCst fences
//! (`shmhca-loom-tests`, `tests/hand_offs.rs`).

use crate::sync::{AtomicU64, Ordering};

/// The most queues one doorbell serves (64 words of 64 bits).
pub const MAX_QUEUES: usize = 64 * 64;

/// A deliberately wrong doorbell, compiled only under `--cfg shmhca_loom`, so the loom
/// models can show that they detect the bug it causes.
#[cfg(shmhca_loom)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mutation {
    /// The correct doorbell.
    #[default]
    None,
    /// `ring` sets the queue's bit with Relaxed instead of Release.
    RingRelaxed,
    /// `take` swaps the words with Relaxed instead of Acquire.
    TakeRelaxed,
    /// `ring` never names the word in the summary.
    NoSummary,
    /// `ring_unless_watched` leaves out its fence.
    WatchNoFence,
}

/// A two-level bitmap of queues with new work: rung by any number of posting threads,
/// taken by one poll loop.
#[derive(Debug)]
pub struct Doorbell {
    summary: AtomicU64,
    words: Box<[AtomicU64]>,
    /// Queues the taker looks at itself (written by the taker only).
    watched: Box<[AtomicU64]>,
    #[cfg(shmhca_loom)]
    mutation: Mutation,
}

impl Doorbell {
    /// A doorbell for queues `0..capacity` (rounded up to a multiple of 64).
    ///
    /// # Panics
    ///
    /// If `capacity` is 0 or above [`MAX_QUEUES`] (a programming error: the caller sizes
    /// it once, from a constant).
    pub fn new(capacity: usize) -> Doorbell {
        assert!(
            (1..=MAX_QUEUES).contains(&capacity),
            "a doorbell serves 1 to {MAX_QUEUES} queues, not {capacity}"
        );
        Doorbell {
            summary: AtomicU64::new(0),
            words: (0..capacity.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            watched: (0..capacity.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            #[cfg(shmhca_loom)]
            mutation: Mutation::None,
        }
    }

    /// A doorbell with the deliberate bug `mutation` (loom builds only).
    #[cfg(shmhca_loom)]
    pub fn mutated(capacity: usize, mutation: Mutation) -> Doorbell {
        Doorbell {
            mutation,
            ..Doorbell::new(capacity)
        }
    }

    /// How many queues it serves.
    pub fn capacity(&self) -> usize {
        self.words.len() * 64
    }

    #[inline(always)]
    fn ring_order(&self) -> Ordering {
        #[cfg(shmhca_loom)]
        if self.mutation == Mutation::RingRelaxed {
            return Ordering::Relaxed;
        }
        Ordering::Release
    }

    #[inline(always)]
    fn take_order(&self) -> Ordering {
        #[cfg(shmhca_loom)]
        if self.mutation == Mutation::TakeRelaxed {
            return Ordering::Relaxed;
        }
        Ordering::Acquire
    }

    #[inline(always)]
    fn names_words(&self) -> bool {
        #[cfg(shmhca_loom)]
        if self.mutation == Mutation::NoSummary {
            return false;
        }
        true
    }

    /// Marks queue `index` as having new work. Call it after the work is published.
    ///
    /// # Panics
    ///
    /// If `index` is not below [`Doorbell::capacity`].
    #[inline]
    pub fn ring(&self, index: u32) {
        let (w, b) = ((index / 64) as usize, index % 64);
        // SYNC: Release pairs with the Acquire swap of this word in `take`: the work
        // published before the ring is visible to the taker that sees the bit.
        let prev = self.words[w].fetch_or(1 << b, self.ring_order());
        if prev == 0 && self.names_words() {
            // The word was empty: the taker may have taken the summary already; name the
            // word again. (If the word was not empty, its summary bit is set or the taker
            // has yet to swap the word, and will see this bit.)
            // SYNC: Release pairs with the Acquire swap of the summary in `take` (only
            // to order this after the word's update; the work itself travels with the
            // word).
            self.summary.fetch_or(1 << w, Ordering::Release);
        }
    }

    /// Tells the taker about new work on queue `index`, unless the taker watches the queue
    /// (see the module docs): then it finds the work itself, and this costs one load and no
    /// locked instruction. Call it after the work is published. Returns whether it rang.
    ///
    /// # Panics
    ///
    /// If `index` is not below [`Doorbell::capacity`].
    #[inline]
    pub fn ring_unless_watched(&self, index: u32) -> bool {
        let (w, b) = ((index / 64) as usize, index % 64);
        // SYNC: the poster's half of the asymmetric fence: the work published before this
        // is ordered before the load below by the taker's process-wide barrier in
        // `unwatch`'s protocol (a compiler fence keeps the compiler from reordering).
        light_fence(self);
        if self.watched[w].load(Ordering::Relaxed) & (1 << b) != 0 {
            return false;
        }
        self.ring(index);
        true
    }

    /// The taker watches queue `index`: posts to it stop ringing. Taker only.
    #[inline]
    pub fn watch(&self, index: u32) {
        let (w, b) = ((index / 64) as usize, index % 64);
        let word = &self.watched[w];
        word.store(word.load(Ordering::Relaxed) | 1 << b, Ordering::Relaxed);
    }

    /// The taker stops watching queue `index`. Taker only; before it stops looking at the
    /// queue it must run a process-wide barrier and then look once more (module docs).
    #[inline]
    pub fn unwatch(&self, index: u32) {
        let (w, b) = ((index / 64) as usize, index % 64);
        let word = &self.watched[w];
        word.store(word.load(Ordering::Relaxed) & !(1 << b), Ordering::Relaxed);
    }

    /// Whether some queue may have been rung since the last [`Doorbell::take`]: one relaxed
    /// load of the summary word (a ring that is not visible yet is seen by a later call).
    #[inline]
    pub fn rung(&self) -> bool {
        self.summary.load(Ordering::Relaxed) != 0
    }

    /// Calls `f` for every queue rung since the last call (by this or another thread).
    #[inline]
    pub fn take(&self, mut f: impl FnMut(u32)) {
        // Cheap check first: a relaxed load does not take the line away from posters.
        if self.summary.load(Ordering::Relaxed) == 0 {
            return;
        }
        // SYNC: Acquire pairs with the Release `fetch_or` of the summary in `ring`.
        let mut s = self.summary.swap(0, Ordering::Acquire);
        while s != 0 {
            let w = s.trailing_zeros();
            s &= s - 1;
            let Some(word) = self.words.get(w as usize) else {
                continue;
            };
            // SYNC: Acquire pairs with the Release `fetch_or` of this word in `ring`.
            let mut bits = word.swap(0, self.take_order());
            while bits != 0 {
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                f(w * 64 + b);
            }
        }
    }
}

/// The poster's half of the watch protocol's fence: a compiler fence (the taker's
/// process-wide barrier supplies the processor's), a SeqCst fence under loom.
#[inline(always)]
fn light_fence(_d: &Doorbell) {
    #[cfg(not(shmhca_loom))]
    core::sync::atomic::compiler_fence(Ordering::SeqCst);
    #[cfg(shmhca_loom)]
    if _d.mutation != Mutation::WatchNoFence {
        loom::sync::atomic::fence(Ordering::SeqCst);
    }
}

#[cfg(all(test, not(shmhca_loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn rings_are_taken_once_each() {
        let d = Doorbell::new(MAX_QUEUES);
        assert_eq!(d.capacity(), MAX_QUEUES);
        for i in [0, 1, 63, 64, 4095, 1] {
            d.ring(i);
        }
        let mut got = vec![];
        d.take(|i| got.push(i));
        assert_eq!(got, [0, 1, 63, 64, 4095]);
        got.clear();
        d.take(|i| got.push(i));
        assert!(got.is_empty());
    }

    #[test]
    fn capacity_rounds_up_to_whole_words() {
        assert_eq!(Doorbell::new(1).capacity(), 64);
        assert_eq!(Doorbell::new(65).capacity(), 128);
    }

    #[test]
    #[should_panic(expected = "a doorbell serves 1 to 4096 queues, not 0")]
    fn zero_capacity_is_refused() {
        let _ = Doorbell::new(0);
    }

    #[test]
    fn no_ring_is_lost_under_concurrency() {
        // Three posters ring 1,000 distinct queues each, once, while the taker takes
        // concurrently: every queue must be seen, because each is rung only once.
        let d = Arc::new(Doorbell::new(MAX_QUEUES));
        let posters: Vec<_> = (0..3u32)
            .map(|t| {
                let d = d.clone();
                std::thread::spawn(move || {
                    for k in 0..1000 {
                        d.ring(t * 1000 + k);
                    }
                })
            })
            .collect();
        let mut seen = std::collections::HashSet::new();
        while !posters.iter().all(|p| p.is_finished()) {
            d.take(|i| assert!(seen.insert(i), "{i} taken twice"));
        }
        for p in posters {
            p.join().unwrap();
        }
        d.take(|i| assert!(seen.insert(i), "{i} taken twice"));
        assert_eq!(seen.len(), 3000);
        let mut after = 0;
        d.take(|_| after += 1);
        assert_eq!(after, 0);
    }

    #[test]
    fn a_watched_queue_is_not_rung_until_unwatched() {
        let d = Doorbell::new(128);
        d.watch(70);
        assert!(!d.ring_unless_watched(70), "watched: no ring");
        assert!(!d.rung());
        assert!(d.ring_unless_watched(71), "its neighbour is not watched");
        d.unwatch(70);
        assert!(d.ring_unless_watched(70));
        let mut got = vec![];
        d.take(|i| got.push(i));
        assert_eq!(got, [70, 71]);
    }
}
