//! Completion queues.

use std::sync::Arc;
use std::time::{Duration, Instant};

use shmhca_rings::ring::{Consumer, HeapStorage, heap_ring};

use crate::error::{Error, Result};
use crate::verbs::Shared;
use crate::verbs::wr::WorkCompletion;

/// The deepest completion queue.
pub(crate) const MAX_CQ_DEPTH: u32 = crate::limits::MAX_CQ_DEPTH;

/// A completion queue: work completions of the QPs created with it, oldest first.
///
/// A full CQ never loses a completion: the engine holds the work request back (and
/// answers incoming Sends with RNR Naks) until the application polls.
pub struct Cq {
    shared: Arc<Shared>,
    pub(crate) cqn: u32,
    consumer: Consumer<WorkCompletion, HeapStorage<WorkCompletion>>,
}

impl Cq {
    pub(crate) fn create(shared: &Arc<Shared>, depth: u32) -> Result<Cq> {
        if depth == 0 || depth > MAX_CQ_DEPTH {
            return Err(Error::invalid(
                "completion queue depth",
                format!("{depth}; a CQ holds 1 to {MAX_CQ_DEPTH} completions"),
            ));
        }
        let (producer, consumer) = heap_ring(depth.next_power_of_two() as usize)
            .map_err(|e| Error::invalid("completion queue depth", e.to_string()))?;
        let cqn =
            shared
                .engine
                .with(|e| e.res.cqs.insert(producer))
                .ok_or(Error::LimitReached {
                    what: "completion queues in one context",
                    limit: crate::context::MAX_CQS,
                })?;
        Ok(Cq {
            shared: shared.clone(),
            cqn,
            consumer,
        })
    }

    /// Moves up to `out.len()` completions into `out`; returns how many. In inline mode it
    /// first runs the engine once.
    pub fn poll(&mut self, out: &mut [WorkCompletion]) -> usize {
        self.shared.progress_inline();
        // A heap ring of this process cannot be broken by a peer.
        self.consumer.pop_burst(out).unwrap_or(0)
    }

    /// One completion, if there is one (runs the engine once in inline mode).
    pub fn poll_one(&mut self) -> Option<WorkCompletion> {
        self.shared.progress_inline();
        self.consumer.pop().ok().flatten()
    }

    /// Polls until `out` is full or `timeout` passes; returns how many completions arrived.
    /// Busy-polls (it is meant for tests and simple programs, not a blocking wait).
    pub fn poll_until(&mut self, out: &mut [WorkCompletion], timeout: Duration) -> usize {
        let start = Instant::now();
        let mut n = 0;
        while n < out.len() {
            n += self.poll(&mut out[n..]);
            if n < out.len() && start.elapsed() >= timeout {
                break;
            }
        }
        n
    }

    /// Capacity in completions.
    pub fn capacity(&self) -> usize {
        self.consumer.capacity()
    }

    pub(crate) fn same_context(&self, shared: &Arc<Shared>) -> bool {
        Arc::ptr_eq(&self.shared, shared)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        let cqn = self.cqn;
        self.shared.engine.with(|e| e.res.cqs.remove(cqn));
    }
}

impl std::fmt::Debug for Cq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cq")
            .field("cqn", &self.cqn)
            .finish_non_exhaustive()
    }
}
