//! Doorbells and the active set: how the engine finds the QPs with work without looking
//! at the others.
//!
//! Posting to a QP rings its doorbell ([`Doorbell`], from `shmhca-rings`, where its loom
//! models live): one bit in a two-level atomic bitmap, so a poll iteration costs O(QPs
//! with new work), not O(QPs). The engine's own [`ActiveSet`] — QPs with packets to send,
//! responses queued or timers armed — is the same two-level shape, private to the engine.

pub(crate) use shmhca_rings::doorbell::Doorbell;

/// The most QPs one engine serves (64 × 64): one doorbell's worth.
pub(crate) const MAX_QPS: usize = crate::limits::MAX_QPS as usize;

// Every index below MAX_QPS has its own bit: 64 words of 64.
const _: () = assert!(MAX_QPS == 64 * 64);

/// The word and bit of QP index `index` (below [`MAX_QPS`]; the word is taken modulo 64,
/// so that indexing needs no bounds check).
#[inline]
fn split(index: u32) -> (usize, u32) {
    debug_assert!((index as usize) < MAX_QPS, "QP index {index} out of range");
    ((index / 64 % 64) as usize, index % 64)
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
        let (w, b) = split(index);
        self.words[w] |= 1 << b;
        self.summary |= 1 << w;
    }

    #[inline]
    pub(crate) fn remove(&mut self, index: u32) {
        let (w, b) = split(index);
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
        let (w, b) = split(index);
        self.words[w] & (1 << b) != 0
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

    /// Moves every member of `other` into this set, emptying `other`.
    #[inline]
    pub(crate) fn take_all(&mut self, other: &mut ActiveSet) {
        let mut s = other.summary;
        while s != 0 {
            let w = s.trailing_zeros() as usize;
            s &= s - 1;
            self.words[w] |= other.words[w];
            other.words[w] = 0;
        }
        self.summary |= other.summary;
        other.summary = 0;
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

        let mut b = ActiveSet::new();
        a.insert(3);
        b.insert(3);
        b.insert(64);
        b.insert(4000);
        a.take_all(&mut b);
        assert_eq!(a.members(), [3, 64, 4000]);
        assert!(b.is_empty() && b.members().is_empty());
        a.take_all(&mut b);
        assert_eq!(a.members(), [3, 64, 4000]);
    }
}
