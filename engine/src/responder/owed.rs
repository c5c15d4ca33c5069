//! Acks off the critical path: the positive Ack a QP owes, and the engine's per-link lists
//! of the QPs that owe one.
//!
//! A request accepted by the RQ Logic does not send its Ack there and then: the QP records
//! the Ack it owes ([`OwedAck`](shmhca_proto::responder::OwedAck), the last PSN accepted and the MSN then; a later request
//! overwrites it, so one Ack covers every request before it — Ack coalescing, which spec/01
//! lists among the optimizations its error-free walk-through leaves out) and the engine
//! lists the QP on its link ([`OwedAcks`]). At the end of the iteration the engine sends
//! every owed Ack (one function, [`crate::engine`]'s `flush_owed_acks`), after the
//! iteration's requests and responses: an Ack leaves microseconds after its request, far
//! inside any transport timer, and after the receive completion it acknowledges.
//!
//! Responses that carry an AETH with a credit count (RDMA Read responses, Atomic
//! Acknowledges) acknowledge every request before them: queuing one drops the owed Ack.
//! Naks carry no credit count, so the owed Ack leaves right before them.

use crate::engine::doorbell::ActiveSet;

/// No QP: the end of a list (and an empty list's head).
const NONE: u32 = u32::MAX;
/// In `next`: the QP is on no list.
const UNLISTED: u32 = u32::MAX - 1;
/// In `first`: no entry waits to be listed (an entry's link half is the link plus one:
/// never zero, so that one OR with the links' summary tells whether any QP is listed).
const NO_FIRST: u64 = 0;

/// For each link, the QPs that may owe an Ack on it, as lists threaded through one array
/// indexed by QP. An entry is a hint, checked when the list is flushed: the QP may have
/// sent its Ack meanwhile (with a packet that left sooner), or been destroyed and its slot
/// reused. Each QP is on at most one list, so a list never loops; nothing is allocated
/// after construction.
///
/// The first entry pushed while every list is empty waits in one word (`first`) instead:
/// a ping-pong's responder owes one Ack at a time, which rides in the answer, so its entry
/// is written and forgotten there without a list or a link's bit touched. It is listed
/// for real ([`OwedAcks::settle`]) when a second entry comes and before the lists are
/// walked, so that every list holds, in the same order, what it would hold without it.
pub(crate) struct OwedAcks {
    /// The entry waiting to be listed ([`entry`]: the link plus one in the high half, the
    /// QP in the low one), or [`NO_FIRST`]; only while every list is empty.
    first: u64,
    /// Links whose list is not empty.
    links: ActiveSet,
    /// Per link: the first QP of its list, or [`NONE`].
    head: Box<[u32]>,
    /// Per QP: the next QP of its list, [`NONE`] for the last one, or [`UNLISTED`] when the
    /// QP is on no list (one array answers both "listed?" and "what next?", with a plain
    /// load and store each, where a set of listed QPs cost a bitmap's word and summary).
    next: Box<[u32]>,
}

impl OwedAcks {
    /// Lists for `links` links (at most 4096, an [`ActiveSet`]'s span) and `qps` QPs.
    pub(crate) fn new(links: usize, qps: usize) -> OwedAcks {
        // QP indexes stay below UNLISTED, so an index is never taken for a marker.
        debug_assert!(qps < UNLISTED as usize && links <= 4096);
        OwedAcks {
            first: NO_FIRST,
            links: ActiveSet::new(),
            head: vec![NONE; links].into_boxed_slice(),
            next: vec![UNLISTED; qps].into_boxed_slice(),
        }
    }

    /// Lists QP `qp` on link `link`, unless it is on a list already; whether it was not.
    /// With every list empty the entry waits in `first`. (In line in both receive steps,
    /// the general and the straight: called from two places, it was compiled out of line.)
    #[inline(always)]
    pub(crate) fn push(&mut self, link: u32, qp: u32) -> bool {
        #[cfg(test)]
        let fast = crate::probe::enabled();
        #[cfg(not(test))]
        let fast = true;
        if self.first == NO_FIRST && self.links.is_empty() && fast {
            #[cfg(test)]
            crate::probe::count(crate::probe::Path::OwedFirst);
            self.first = entry(link, qp);
            return true;
        }
        if self.first as u32 == qp && self.first != NO_FIRST {
            return false;
        }
        self.settle();
        self.relist(link, qp)
    }

    /// Lists the entry waiting in `first`, if any: after it, the lists hold what they
    /// would hold had it been listed when it was pushed.
    #[inline]
    pub(crate) fn settle(&mut self) {
        if self.first != NO_FIRST {
            let (link, qp) = (((self.first >> 32) - 1) as u32, self.first as u32);
            self.first = NO_FIRST;
            self.relist(link, qp);
        }
    }

    /// [`OwedAcks::push`] on the lists themselves, never into `first`: for a QP put back
    /// while the lists are walked, which must be on its link's list for the walk to see
    /// it (the link's bit may not have been visited yet).
    #[inline]
    pub(crate) fn relist(&mut self, link: u32, qp: u32) -> bool {
        // Only a walk relists, and a walk moves the first word's entry to its list first:
        // an entry listed beside one still in the word would leave out of order.
        debug_assert_eq!(
            self.first, NO_FIRST,
            "relist with an entry in the first word"
        );
        if self.next[qp as usize] != UNLISTED {
            return false;
        }
        self.next[qp as usize] = self.head[link as usize];
        self.head[link as usize] = qp;
        self.links.insert(link);
        true
    }

    /// Whether no QP is listed.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        (self.first | self.links.summary()) == 0
    }

    /// The summary word of the links with a list (as [`ActiveSet::summary`]), or'd with
    /// the entry waiting in `first`: zero exactly when no QP is listed, and the summary
    /// itself once [`OwedAcks::settle`]d.
    #[inline]
    pub(crate) fn link_summary(&self) -> u64 {
        self.links.summary() | self.first
    }

    /// Word `w` of the set of links with a list (as [`ActiveSet::word`]).
    #[inline]
    pub(crate) fn link_word(&self, w: u32) -> u64 {
        self.links.word(w)
    }

    /// Unlists QP `qp` if it heads link `link`'s list: its Ack has left with a request (it
    /// rode). The common case — a ping-pong's answer, posted right after the request came —
    /// so that the next iteration can be a quiet one; elsewhere in a list the entry stays,
    /// a hint the flush finds empty.
    #[inline(always)]
    pub(crate) fn forget_head(&mut self, link: u32, qp: u32) {
        // The entry in `first` is its link's only one: its head.
        if self.first == entry(link, qp) {
            self.first = NO_FIRST;
            return;
        }
        if self.head[link as usize] != qp {
            return;
        }
        self.head[link as usize] = std::mem::replace(&mut self.next[qp as usize], UNLISTED);
        if self.head[link as usize] == NONE {
            self.links.remove(link);
        }
    }

    /// Takes link `link`'s list: the QPs come out one by one from
    /// [`OwedAcks::pop`], unlisted (push back those whose Ack could not leave). Only once
    /// [`OwedAcks::settle`]d (the entry in `first` is on no list yet).
    #[inline]
    pub(crate) fn take(&mut self, link: u32) -> Taken {
        debug_assert_eq!(self.first, NO_FIRST, "settled before the lists are walked");
        let first = std::mem::replace(&mut self.head[link as usize], NONE);
        self.links.remove(link);
        Taken(first)
    }

    /// The next QP of a taken list, unlisted.
    #[inline]
    pub(crate) fn pop(&mut self, taken: &mut Taken) -> Option<u32> {
        let qp = taken.0;
        if qp == NONE {
            return None;
        }
        taken.0 = std::mem::replace(&mut self.next[qp as usize], UNLISTED);
        Some(qp)
    }
}

/// The entry of QP `qp` on link `link` in [`OwedAcks`]' `first`.
#[inline(always)]
fn entry(link: u32, qp: u32) -> u64 {
    ((u64::from(link) + 1) << 32) | u64::from(qp)
}

/// A list taken from [`OwedAcks`] (see [`OwedAcks::take`]).
pub(crate) struct Taken(u32);

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(o: &mut OwedAcks, link: u32) -> Vec<u32> {
        o.settle();
        let mut t = o.take(link);
        let mut out = vec![];
        while let Some(q) = o.pop(&mut t) {
            out.push(q);
        }
        out
    }

    #[test]
    fn each_qp_is_listed_once_on_its_link() {
        let mut o = OwedAcks::new(4096, 4096);
        assert!(o.is_empty());
        o.push(3, 10);
        o.push(3, 11);
        o.push(3, 10);
        o.push(4095, 4095);
        assert!(!o.is_empty());
        assert_eq!(drain(&mut o, 3), [11, 10]);
        assert_eq!(drain(&mut o, 3), [], "taken lists are empty");
        assert!(!o.is_empty());
        assert_eq!(drain(&mut o, 4095), [4095]);
        assert!(o.is_empty());
    }

    /// Only the head of the named link's list is forgotten; the list goes on from the next
    /// entry, the QP can be listed again, and a link whose list empties is no longer marked.
    #[test]
    fn forget_head_unlists_only_the_head() {
        let mut o = OwedAcks::new(8, 64);
        o.push(2, 5);
        o.push(2, 6);
        o.forget_head(2, 5); // not the head: stays
        o.forget_head(3, 6); // another link: nothing
        o.forget_head(2, 6);
        assert!(!o.is_empty());
        o.push(2, 6);
        assert_eq!(drain(&mut o, 2), [6, 5]);
        o.push(1, 9);
        o.forget_head(1, 9);
        assert!(o.is_empty(), "its only entry gone, the link is unmarked");
        o.push(1, 9);
        assert_eq!(drain(&mut o, 1), [9]);
    }

    /// A QP taken off a list may go back on one while the rest of the list is walked, and
    /// the walk still ends with the taken list's last entry.
    #[test]
    fn qps_pushed_back_during_a_walk_wait_for_the_next_one() {
        let mut o = OwedAcks::new(8, 64);
        for q in [1, 2, 3] {
            o.push(0, q);
        }
        o.settle();
        let mut t = o.take(0);
        let mut seen = vec![];
        while let Some(q) = o.pop(&mut t) {
            seen.push(q);
            o.relist(0, q);
        }
        assert_eq!(seen, [3, 2, 1]);
        assert_eq!(drain(&mut o, 0), [1, 2, 3]);
    }

    /// A QP listed on one link is not listed again on another until its entry is taken
    /// (a stale entry: the flush finds where the QP's Acks go now).
    #[test]
    fn a_listed_qp_stays_on_its_first_list() {
        let mut o = OwedAcks::new(8, 64);
        o.push(1, 5);
        o.push(2, 5);
        assert_eq!(drain(&mut o, 2), []);
        assert_eq!(drain(&mut o, 1), [5]);
        o.push(2, 5);
        assert_eq!(drain(&mut o, 2), [5]);
    }

    /// Review 4: the first word against the lists alone, over random sequences of what the
    /// engine does (push on a packet's link, forget_head after a ride, a flush walking
    /// every link with relists to the same or another link): the same answers, the same
    /// walk order, the same emptiness.
    #[test]
    fn review4_the_first_word_walks_as_the_lists_alone() {
        fn run(seed: u64, fast: bool) -> Vec<u64> {
            crate::probe::set_enabled(fast);
            let mut x = seed | 1;
            let mut rnd = move |n: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % n
            };
            let (links, qps) = (70u32, 8u32);
            let mut o = OwedAcks::new(links as usize, qps as usize);
            let mut out = vec![];
            for _ in 0..400 {
                let link = [0, 1, 2, 65, 69][rnd(5) as usize];
                let qp = rnd(u64::from(qps)) as u32;
                match rnd(10) {
                    0..=4 => out.push(u64::from(o.push(link, qp))),
                    5..=6 => o.forget_head(link, qp),
                    _ => {
                        o.settle();
                        let mut summary = o.link_summary();
                        while summary != 0 {
                            let w = summary.trailing_zeros();
                            summary &= summary - 1;
                            let mut bits = o.link_word(w);
                            while bits != 0 {
                                let l = w * 64 + bits.trailing_zeros();
                                bits &= bits - 1;
                                let mut t = o.take(l);
                                while let Some(q) = o.pop(&mut t) {
                                    out.push(1000 + u64::from(l) * 100 + u64::from(q));
                                    match rnd(4) {
                                        0 => out.push(u64::from(o.relist(l, q))),
                                        1 => out.push(u64::from(o.relist((l + 1) % links, q))),
                                        _ => {}
                                    }
                                }
                            }
                        }
                    }
                }
                out.push(u64::from(o.is_empty()));
            }
            crate::probe::set_enabled(true);
            out
        }
        for seed in 1..300 {
            assert_eq!(run(seed, false), run(seed, true), "seed {seed}");
        }
    }

    /// The first entry waits in one word — QP 0 on link 0 as well — where it counts as
    /// listed, is forgotten, or goes on its list, in order, when a second entry comes.
    #[test]
    fn the_first_entry_waits_in_a_word_until_a_second_comes() {
        let mut o = OwedAcks::new(8, 64);
        assert!(o.push(0, 0));
        assert!(!o.is_empty() && o.link_summary() != 0);
        assert!(!o.push(3, 0), "listed already (on link 0)");
        o.forget_head(3, 0); // not its link: stays
        o.forget_head(0, 0);
        assert!(o.is_empty() && o.link_summary() == 0);
        assert!(o.push(0, 0));
        assert!(o.push(0, 1));
        assert!(!o.push(0, 0));
        assert_eq!(o.link_summary(), 1, "settled: link 0's bit alone");
        assert_eq!(drain(&mut o, 0), [1, 0]);
        assert!(o.is_empty());
    }
}
