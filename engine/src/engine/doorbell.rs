//! Doorbells and the active set: how the engine finds the QPs with work without looking
//! at the others.
//!
//! Posting to a QP rings its doorbell: one bit in a two-level atomic bitmap (a summary word
//! over 64 words of 64 bits). The engine takes the summary, then each word it names, with
//! one swap each, so a poll iteration costs O(QPs with new work), not O(QPs). The engine's
//! own [`ActiveSet`] — QPs with packets to send, responses queued or timers armed — is the
//! same two-level shape, private to the engine.

use std::sync::atomic::{AtomicU64, Ordering};

/// The most QPs one engine serves (64 × 64).
pub(crate) const MAX_QPS: usize = 64 * 64;

/// QPs with newly posted work (written by application threads, taken by the engine).
pub(crate) struct Doorbell {
    summary: AtomicU64,
    words: Box<[AtomicU64]>,
}

impl Doorbell {
    pub(crate) fn new() -> Doorbell {
        Doorbell {
            summary: AtomicU64::new(0),
            words: (0..64).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Marks QP `index` as having new work. Called after the work was pushed on its ring.
    #[inline]
    pub(crate) fn ring(&self, index: u32) {
        let (w, b) = ((index / 64) as usize, index % 64);
        // SYNC: Release pairs with the Acquire swaps in `take`: the WQE pushed before the
        // ring is visible to the engine that sees the bit.
        let prev = self.words[w].fetch_or(1 << b, Ordering::Release);
        if prev == 0 {
            // The word was empty: the engine may have taken the summary already; name the
            // word again. (If the word was not empty, its summary bit is set or the engine
            // is about to take the word and will see this bit.)
            self.summary.fetch_or(1 << w, Ordering::Release);
        }
    }

    /// Calls `f` for every QP rung since the last call.
    #[inline]
    pub(crate) fn take(&self, mut f: impl FnMut(u32)) {
        // Cheap check first: a relaxed load does not take the line away from posters.
        if self.summary.load(Ordering::Relaxed) == 0 {
            return;
        }
        // SYNC: Acquire pairs with the Release `fetch_or`s in `ring`.
        let mut s = self.summary.swap(0, Ordering::Acquire);
        while s != 0 {
            let w = s.trailing_zeros();
            s &= s - 1;
            let mut bits = self.words[w as usize].swap(0, Ordering::Acquire);
            while bits != 0 {
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                f(w * 64 + b);
            }
        }
    }
}

/// A two-level bit set of QP indices, private to the engine.
pub(crate) struct ActiveSet {
    summary: u64,
    words: [u64; 64],
}

impl ActiveSet {
    pub(crate) fn new() -> ActiveSet {
        ActiveSet {
            summary: 0,
            words: [0; 64],
        }
    }

    #[inline]
    pub(crate) fn insert(&mut self, index: u32) {
        let (w, b) = ((index / 64) as usize, index % 64);
        self.words[w] |= 1 << b;
        self.summary |= 1 << w;
    }

    #[inline]
    pub(crate) fn remove(&mut self, index: u32) {
        let (w, b) = ((index / 64) as usize, index % 64);
        self.words[w] &= !(1 << b);
        if self.words[w] == 0 {
            self.summary &= !(1 << w);
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.summary == 0
    }

    /// Whether `index` is a member.
    #[inline]
    pub(crate) fn contains(&self, index: u32) -> bool {
        self.words[(index / 64) as usize] & (1 << (index % 64)) != 0
    }

    /// The summary word: bit `w` is set if word `w` has members.
    #[inline]
    pub(crate) fn summary(&self) -> u64 {
        self.summary
    }

    /// Word `w` of the set (members `64 w .. 64 w + 63`).
    #[inline]
    pub(crate) fn word(&self, w: u32) -> u64 {
        self.words[w as usize]
    }

    /// Empties the set.
    #[inline]
    pub(crate) fn clear(&mut self) {
        let mut s = self.summary;
        while s != 0 {
            let w = s.trailing_zeros();
            s &= s - 1;
            self.words[w as usize] = 0;
        }
        self.summary = 0;
    }

    /// The members, smallest first (for tests).
    #[cfg(test)]
    pub(crate) fn members(&self) -> Vec<u32> {
        let mut out = vec![];
        let mut s = self.summary;
        while s != 0 {
            let w = s.trailing_zeros();
            s &= s - 1;
            let mut bits = self.words[w as usize];
            while bits != 0 {
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                out.push(w * 64 + b);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn rings_are_taken_once_each() {
        let d = Doorbell::new();
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
    fn no_ring_is_lost_under_concurrency() {
        // Three posters ring 1,000 distinct QPs each, once, while the engine takes
        // concurrently: every QP must be seen, because each is rung only once.
        let d = Arc::new(Doorbell::new());
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
    fn active_set_tracks_members() {
        let mut a = ActiveSet::new();
        a.insert(5);
        a.insert(700);
        a.insert(5);
        assert_eq!(a.members(), [5, 700]);
        assert!(a.contains(700) && !a.contains(6));
        a.remove(5);
        assert_eq!(a.members(), [700]);
        a.remove(700);
        assert!(a.is_empty());
        a.insert(4095);
        a.clear();
        assert!(a.is_empty() && !a.contains(4095));
    }
}
