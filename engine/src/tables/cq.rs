//! The completion queues of an engine: each queue's producer end, its room, and its
//! notification state (what it is armed for and the channel [`Signal`] it raises), private to
//! the engine. The verbs layer's `Cq` and `CompChannel` hold the other ends.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use shmhca_rings::doorbell::Doorbell;
use shmhca_rings::ring::StampedProducer;

use crate::completion::{WcStatus, WorkCompletion};
use crate::slots::SlotTable;
use shmhca_proto::ids::CqId;

/// What a queue is armed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub(crate) enum Arm {
    /// Not armed: completions raise no event.
    #[default]
    Off,
    /// The next completion raises an event.
    Next,
    /// The next solicited receive completion, or the next completion in error.
    Solicited,
}

/// The engine's end of a channel: the eventfd and which queues fired.
pub(crate) struct Signal {
    pub(crate) fd: OwnedFd,
    /// Bit `slot` set: the queue attached at `slot` has an event.
    pub(crate) fired: Doorbell,
    /// The CQ number attached at each slot (0: none).
    pub(crate) cqns: Box<[AtomicU32]>,
    /// When each slot last fired, on the channel's own count ([`Signal::raise`]): the
    /// channel hands out the events it collects in the order they were raised, as an
    /// event queue would, not by slot.
    pub(crate) stamps: Box<[AtomicU64]>,
    /// The count the next event takes (only the engine token's holder raises events, so
    /// a plain load and store, no read-modify-write).
    pub(crate) next_stamp: AtomicU64,
    /// Free slots (control path only).
    pub(crate) free: Mutex<Vec<u32>>,
    /// The application took the fd ([`AsFd`], [`AsRawFd`]): it may wait on it without
    /// calling shmhca, so arming must get the progress helper ready (inline mode).
    pub(crate) fd_taken: AtomicBool,
}

impl Signal {
    /// Raises the event of the queue at `slot`: marks it, then makes the fd readable.
    #[cold]
    fn raise(&self, slot: u32) {
        let stamp = self.next_stamp.load(Ordering::Relaxed);
        self.next_stamp.store(stamp + 1, Ordering::Relaxed);
        // SYNC: ordered before the fired bit by its Release (the collector's Acquire).
        self.stamps[slot as usize].store(stamp, Ordering::Relaxed);
        self.fired.ring(slot);
        // An eventfd write fails only when the counter would overflow (it holds far more
        // than the events a reader can leave pending); the fd is readable then anyway.
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }
}

/// A completion queue's notification state, private to the engine (in its CQ table).
#[derive(Default)]
pub(crate) struct Notify {
    arm: Arm,
    target: Option<(Arc<Signal>, u32)>,
}

impl Notify {
    /// Called for each completion pushed to the queue: raises the event if the queue is
    /// armed for it. Returns whether it was (then the arm is spent).
    #[inline(always)]
    pub(crate) fn on_push(&mut self, wc: &WorkCompletion) -> bool {
        // A plain load of private memory: the whole cost when nobody armed the queue.
        if self.arm == Arm::Off {
            return false;
        }
        self.fire(wc)
    }

    #[cold]
    fn fire(&mut self, wc: &WorkCompletion) -> bool {
        let wanted = self.arm == Arm::Next || wc.solicited || wc.status != WcStatus::Success;
        if !wanted {
            return false;
        }
        self.arm = Arm::Off;
        if let Some((signal, slot)) = &self.target {
            signal.raise(*slot);
        }
        true
    }

    /// Arms the queue (one-shot). Returns whether it was off before.
    pub(crate) fn arm(&mut self, arm: Arm) -> bool {
        let was_off = self.arm == Arm::Off;
        // Asking for "next" after "solicited" widens the arm (ibverbs does the same).
        if self.arm != Arm::Next {
            self.arm = arm;
        }
        was_off
    }

    /// Whether the queue is armed.
    pub(crate) fn armed(&self) -> bool {
        self.arm != Arm::Off
    }

    /// Attaches the queue to a channel at `slot`.
    pub(crate) fn attach(&mut self, signal: Arc<Signal>, slot: u32) {
        self.target = Some((signal, slot));
    }
}

/// The engine's end of a completion queue: a stamped ring (issue 27, item 8), whose
/// reader, the application, knows a completion is there from its slot's stamp.
pub(crate) type CqProducer = StampedProducer<WorkCompletion>;

/// The completion queues of an engine, as producers.
///
/// A CQ's number carries a generation tag above its index, so a QP that outlives its CQ
/// can never complete into a newer CQ that reused the slot.
pub(crate) struct CqTable {
    cqs: SlotTable<CqSlot>,
    /// Queues armed for a notification (see `verbs::channel`), mirrored for the progress
    /// helper in `armed_mirror` (written only by the token holder).
    armed: u32,
    armed_mirror: Arc<std::sync::atomic::AtomicU32>,
}

/// One completion queue: its ring and its notification state (private to the engine).
struct CqSlot {
    /// The ring's writer. It keeps the application's index as last loaded, so that a check
    /// for room reloads that index once per queue-full of completions, not on every one.
    producer: CqProducer,
    notify: Notify,
}

/// Bits of a CQ number that index the table; the rest is the generation.
const CQ_INDEX_BITS: u32 = crate::limits::MAX_CQS.trailing_zeros();
/// The most completion queues one context can hold.
pub(crate) const MAX_CQS: u32 = 1 << CQ_INDEX_BITS;

impl Default for CqTable {
    fn default() -> CqTable {
        CqTable {
            cqs: SlotTable::new(MAX_CQS, 32 - CQ_INDEX_BITS),
            armed: 0,
            armed_mirror: Arc::default(),
        }
    }
}

impl CqTable {
    /// Adds a completion queue; returns its number, or `None` when the context has
    /// [`MAX_CQS`].
    pub(crate) fn insert(&mut self, producer: CqProducer) -> Option<CqId> {
        let (index, generation) = self.cqs.insert_with(|_, _| CqSlot {
            producer,
            notify: Default::default(),
        })?;
        Some(CqId::new(generation << CQ_INDEX_BITS | index))
    }

    #[inline]
    fn get(&mut self, cq: CqId) -> Option<&mut CqSlot> {
        let cq = cq.get();
        self.cqs.get_mut(cq & (MAX_CQS - 1), cq >> CQ_INDEX_BITS)
    }

    /// Removes completion queue `cq`.
    pub(crate) fn remove(&mut self, cq: CqId) {
        if let Some(s) = self.get(cq) {
            if s.notify.armed() {
                self.set_armed(self.armed - 1);
            }
            self.cqs.remove_at(cq.get() & (MAX_CQS - 1));
        }
    }

    /// Whether `cq` can take one more completion (a destroyed CQ takes everything: its
    /// completions have nowhere to go). (In line in both receive steps' fast paths:
    /// called from two places, it was compiled out of line.)
    #[inline(always)]
    pub(crate) fn has_room(&mut self, cq: CqId) -> bool {
        self.get(cq).is_none_or(|s| s.producer.has_room())
    }

    /// Pushes a completion; false if the queue is full (nothing is lost: the caller keeps
    /// the work request and tries again later). Raises the queue's event if it is armed
    /// for this completion.
    #[inline(always)]
    pub(crate) fn push(&mut self, cq: CqId, wc: WorkCompletion) -> bool {
        match self.get(cq) {
            Some(s) => {
                // (The callers asked `has_room` first; the ring's push checks it again,
                // from its cached copy of the application's index.)
                let pushed = s.producer.push(wc).is_ok();
                if pushed && s.notify.on_push(&wc) {
                    self.set_armed(self.armed - 1);
                }
                pushed
            }
            None => true,
        }
    }

    /// Pushes the completion `make` returns if `cq` has room for one more, looking the
    /// queue up once: `make` runs only then, and does what must come before the push (a
    /// send WQE's release and the publication of its slot). False, with `make` not run,
    /// if the queue is full (the caller keeps the work request and tries again later). A
    /// destroyed queue takes everything (`make` runs; its completion goes nowhere). Raises
    /// the queue's event if it is armed for this completion.
    #[inline(always)]
    pub(crate) fn push_with(&mut self, cq: CqId, make: impl FnOnce() -> WorkCompletion) -> bool {
        let Some(CqSlot { producer, notify }) = self.get(cq) else {
            make();
            return true;
        };
        // The room checked once, the slot's address and index kept across `make`.
        let Some(slot) = producer.reserve() else {
            return false;
        };
        let wc = make();
        slot.write(wc);
        if notify.on_push(&wc) {
            self.set_armed(self.armed - 1);
        }
        true
    }

    /// Whether `cq` is armed for a notification. (In line: see [`CqTable::has_room`].)
    #[inline(always)]
    pub(crate) fn armed(&mut self, cq: CqId) -> bool {
        self.armed > 0 && self.get(cq).is_some_and(|s| s.notify.armed())
    }

    /// The notification state of `cq`.
    pub(crate) fn notify(&mut self, cq: CqId) -> Option<&mut Notify> {
        self.get(cq).map(|s| &mut s.notify)
    }

    /// Arms `cq` (see [`Notify::arm`]); false if there is no such
    /// queue.
    pub(crate) fn arm(&mut self, cq: CqId, arm: Arm) -> bool {
        let Some(s) = self.get(cq) else {
            return false;
        };
        if s.notify.arm(arm) {
            self.set_armed(self.armed + 1);
        }
        true
    }

    fn set_armed(&mut self, n: u32) {
        self.armed = n;
        self.armed_mirror
            .store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// The count of armed queues, as the progress helper reads it.
    pub(crate) fn armed_mirror(&self) -> Arc<std::sync::atomic::AtomicU32> {
        self.armed_mirror.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wc(solicited: bool, status: WcStatus) -> WorkCompletion {
        WorkCompletion {
            solicited,
            status,
            ..WorkCompletion::default()
        }
    }

    #[test]
    fn an_arm_fires_once_for_what_it_asked() {
        let ok = wc(false, WcStatus::Success);
        let solicited = wc(true, WcStatus::Success);
        let failed = wc(false, WcStatus::RemAccessErr);
        let mut n = Notify::default();
        assert!(!n.on_push(&ok), "not armed");
        assert!(n.arm(Arm::Next));
        assert!(n.on_push(&ok) && !n.armed());
        assert!(!n.on_push(&ok), "one-shot");
        n.arm(Arm::Solicited);
        assert!(!n.on_push(&ok) && n.armed(), "unsolicited: no event");
        assert!(n.on_push(&solicited) && !n.armed());
        n.arm(Arm::Solicited);
        assert!(n.on_push(&failed), "errors always notify");
        // "Next" after "solicited" widens the arm; the reverse does not narrow it.
        n.arm(Arm::Solicited);
        assert!(!n.arm(Arm::Next));
        assert!(n.on_push(&ok));
        n.arm(Arm::Next);
        n.arm(Arm::Solicited);
        assert!(n.on_push(&ok));
    }

    /// The CQ table's room answers what the ring says, although it reloads the
    /// application's index only when its count of known free slots runs out: full after
    /// `depth` pushes, room again as soon as the application polls, and never a completion
    /// refused while a slot is free.
    #[test]
    fn the_cq_table_room_follows_the_applications_polls() {
        let (producer, mut consumer) =
            shmhca_rings::ring::stamped_ring::<WorkCompletion>(4).unwrap();
        let mut cqs = CqTable::default();
        let cq = cqs.insert(producer).unwrap();
        let wc = |wr_id| WorkCompletion {
            wr_id,
            ..WorkCompletion::default()
        };
        let mut pushed = 0;
        let mut polled = 0;
        for round in 0..5 {
            // Fill the queue: exactly as many pushes as slots are free.
            while cqs.has_room(cq) {
                assert!(cqs.push(cq, wc(pushed)), "room was reported");
                pushed += 1;
            }
            assert_eq!(
                pushed - polled,
                4,
                "round {round}: full only when every slot is taken"
            );
            assert!(!cqs.push(cq, wc(99)), "a full queue refuses the completion");
            // The application takes `round % 4 + 1` of them: that much room again.
            for _ in 0..round % 4 + 1 {
                assert_eq!(consumer.pop().unwrap().wr_id, polled);
                polled += 1;
            }
            assert!(cqs.has_room(cq), "round {round}: a poll makes room");
        }
        // Nothing was lost or duplicated: the rest come out in order.
        while let Some(w) = consumer.pop() {
            assert_eq!(w.wr_id, polled);
            polled += 1;
        }
        assert_eq!(polled, pushed);
        // A destroyed queue takes everything.
        cqs.remove(cq);
        assert!(cqs.has_room(cq) && cqs.push(cq, wc(0)));
    }

    /// `push_with` (the retire fast path's push): what comes before a completion (`make`)
    /// runs only when the queue has room for it; a full queue refuses with `make` not run,
    /// until the application polls; a destroyed queue runs `make` and takes the completion.
    /// A completion pushed through `push_with` into an armed queue raises the event the
    /// arm asked for and spends it; the armed count follows.
    #[test]
    fn push_with_raises_the_armed_event_once() {
        let (producer, mut consumer) =
            shmhca_rings::ring::stamped_ring::<WorkCompletion>(4).unwrap();
        let mut cqs = CqTable::default();
        let cq = cqs.insert(producer).unwrap();
        assert!(cqs.arm(cq, Arm::Next));
        assert!(cqs.armed(cq) && cqs.armed == 1);
        assert!(cqs.push_with(cq, || wc(false, WcStatus::Success)));
        assert!(!cqs.armed(cq) && cqs.armed == 0, "spent by the push");
        assert!(cqs.arm(cq, Arm::Solicited));
        assert!(cqs.push_with(cq, || wc(false, WcStatus::Success)));
        assert!(
            cqs.armed(cq),
            "an unsolicited success does not fire a solicited arm"
        );
        assert!(cqs.push_with(cq, || wc(false, WcStatus::RemAccessErr)));
        assert!(!cqs.armed(cq) && cqs.armed == 0, "an error does");
        let got: Vec<_> = std::iter::from_fn(|| consumer.pop().map(|w| w.status)).collect();
        assert_eq!(
            got,
            [WcStatus::Success, WcStatus::Success, WcStatus::RemAccessErr]
        );
    }

    #[test]
    fn push_with_makes_the_completion_only_when_there_is_room() {
        let (producer, mut consumer) =
            shmhca_rings::ring::stamped_ring::<WorkCompletion>(2).unwrap();
        let mut cqs = CqTable::default();
        let cq = cqs.insert(producer).unwrap();
        let mut made = 0;
        let mut make = |wr_id| {
            made += 1;
            WorkCompletion {
                wr_id,
                ..WorkCompletion::default()
            }
        };
        assert!(cqs.push_with(cq, || make(1)));
        assert!(cqs.push_with(cq, || make(2)));
        assert!(!cqs.push_with(cq, || make(3)), "full");
        assert!(!cqs.has_room(cq));
        assert_eq!(consumer.pop().unwrap().wr_id, 1);
        assert!(cqs.push_with(cq, || make(4)), "a poll made room");
        let ids: Vec<_> = std::iter::from_fn(|| consumer.pop().map(|w| w.wr_id)).collect();
        assert_eq!(ids, [2, 4]);
        cqs.remove(cq);
        assert!(cqs.push_with(cq, || make(5)), "a destroyed queue takes it");
        assert_eq!(made, 4, "the refused one was never made");
    }
}
