//! Test hooks of the fast paths (the receive fast path here, the completer's Ack fast
//! path): how many packets each took on this thread, and a switch that turns them all off, so that a test can run the
//! same scenario through the slow paths and compare. The engine of an inline context in
//! `Progress::Manual` runs only on the test's thread.
use std::cell::Cell;

/// A fast path.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Path {
    /// The receive fast path (`responder::receive_fast`).
    Receive = 0,
    /// The completer's Ack fast path.
    Ack = 1,
    /// The completer's fast path for a duplicate or unsolicited positive Ack (a
    /// credit update).
    Credits = 2,
    /// The completer's fast path for the RDMA Read Response Only of the oldest WQE.
    ReadResponse = 3,
    /// The completer's fast path for the Atomic Acknowledge of the oldest WQE.
    AtomicAck = 4,
    /// The receive fast path of an RDMA Read Request (`responder::read_fast`).
    Read = 5,
    /// The receive fast path of an Atomic (`responder::atomic_fast`).
    Atomic = 6,
    /// A post's packet written straight into the link's ring, not staged
    /// (`TxBatch::send_line`).
    DirectPost = 7,
    /// The completer's retire fast path (`completer::retire_ok_fast`): counted per run.
    Retire = 8,
    /// An owed Ack's QP listed in the owed lists' first word, no list touched
    /// (`OwedAcks::push`).
    OwedFirst = 9,
    /// An Ack's credit code kept from the last count (`responder::credit_code`).
    CreditCache = 10,
    /// The parse of a one-line Send Only with its payload inline
    /// (`RxPacket::parse_send_only`).
    SendOnlyParse = 11,
    /// The empty poll's shortcut (`Engine::idle_now`): a poll that found nothing to do
    /// without the full iteration.
    IdlePoll = 12,
    /// A send work request built and posted by `Qp::post_send`'s straight path, not its
    /// general one.
    StraightPost = 13,
    /// An iteration's receive step that took one lone Send Only line straight
    /// (`Iteration::straight` in the engine).
    StraightReceive = 14,
    /// A Send taken by the engine's straight post (`Engine::post_send_straight`), not
    /// handed on to `Engine::post_direct`.
    StraightSend = 15,
    /// An RDMA Write taken by the engine's straight post (`Engine::post_send_straight`),
    /// not handed on to `Engine::post_direct`.
    StraightWrite = 16,
    /// An iteration's receive step that took one lone RDMA Write Only line straight
    /// (`Iteration::straight` in the engine).
    StraightWriteReceive = 17,
    /// The straight receive step took a lone response line (an Acknowledge, a Read Response
    /// Only, an Atomic Acknowledge).
    StraightResponse = 18,
}

/// How many fast paths there are.
pub(crate) const PATHS: usize = 19;

thread_local! {
    static OFF: Cell<bool> = const { Cell::new(false) };
    static TAKEN: Cell<[u64; PATHS]> = const { Cell::new([0; PATHS]) };
}

/// Whether the fast paths may be taken on this thread.
pub(crate) fn enabled() -> bool {
    !OFF.with(Cell::get)
}

/// Turns the fast paths on or off on this thread.
pub(crate) fn set_enabled(on: bool) {
    OFF.with(|c| c.set(!on));
}

/// Counts one use of `path`.
pub(crate) fn count(path: Path) {
    TAKEN.with(|c| {
        let mut t = c.get();
        t[path as usize] += 1;
        c.set(t);
    });
}

/// How many times `path` was taken on this thread.
pub(crate) fn taken(path: Path) -> u64 {
    TAKEN.with(|c| c.get()[path as usize])
}

/// How many times each path was taken on this thread, in the order of [`Path`].
pub(crate) fn all_taken() -> [u64; PATHS] {
    TAKEN.with(Cell::get)
}
