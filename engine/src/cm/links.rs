//! The links a context shares with peer engines, counted by the connections that use them.
//!
//! One link joins a pair of engines, whatever the number of QPs between them: the poll loop
//! visits every link on every iteration, so links must not multiply with connections. Each
//! entry counts the [`Connection`](super::Connection)s holding it (`refs`) and those whose
//! peer is still there (`live`). When `live` drops to zero the link is torn down
//! ([`Engine::link_down`]); when `refs` drops to zero it is removed from the engine
//! ([`Engine::remove_link`]) and its segment and the peer's arena are unmapped.
//!
//! Lock order: this table's mutex, then the engine token — never the reverse.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use crate::device::Device;
use crate::engine::Engine;
use crate::engine::cell::EngineCell;
use crate::link::{LinkId, Side};

/// One link as the connection manager tracks it.
#[derive(Debug, Clone)]
pub(crate) struct LinkEntry {
    pub(crate) id: LinkId,
    /// The peer engine's identity.
    pub(crate) peer: u64,
    /// The token its creator chose.
    pub(crate) token: u64,
    /// Which end of the segment this side holds.
    pub(crate) side: Side,
    /// The peer process, from SO_PEERCRED.
    pub(crate) peer_pid: u32,
    /// Connections holding the link.
    pub(crate) refs: u32,
    /// Connections whose peer has not hung up.
    pub(crate) live: u32,
    /// Cleared when the link is torn down; a torn-down link is never reused.
    pub(crate) up: bool,
}

#[derive(Default)]
struct Table {
    entries: Vec<LinkEntry>,
    /// Peers this context is creating a link to right now (one waits for the other).
    creating: Vec<u64>,
}

/// What a new client connection should do about its link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Use this link (already counted for the new connection).
    Reuse { id: LinkId, token: u64, side: Side },
    /// Create a new link; call [`Links::created`] or [`Links::creation_failed`] after.
    Create,
}

/// The link table of one context.
#[derive(Default)]
pub(crate) struct Links {
    table: Mutex<Table>,
    changed: Condvar,
}

impl Links {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Decides the link of a new connection to engine `peer`: an up link to it if there is
    /// one (counted at once, so it cannot go away), else a new one. While another thread
    /// of this context creates a link to the same peer, waits for it (until `deadline`,
    /// then creates another rather than fail).
    pub(crate) fn plan(
        &self,
        engine: &EngineCell<Engine>,
        peer: u64,
        deadline: Instant,
        force_new: bool,
    ) -> Plan {
        let mut t = self.lock();
        loop {
            if !force_new {
                forget_broken(&mut t, engine);
                if let Some(e) = t.entries.iter_mut().find(|e| e.peer == peer && e.up) {
                    e.refs += 1;
                    e.live += 1;
                    return Plan::Reuse {
                        id: e.id,
                        token: e.token,
                        side: e.side,
                    };
                }
            }
            let now = Instant::now();
            if force_new || !t.creating.contains(&peer) || now >= deadline {
                t.creating.push(peer);
                return Plan::Create;
            }
            t = self
                .changed
                .wait_timeout(t, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Records a link created after [`Plan::Create`], counted once for its connection.
    pub(crate) fn created(&self, entry: LinkEntry) {
        let mut t = self.lock();
        if let Some(i) = t.creating.iter().position(|&p| p == entry.peer) {
            t.creating.swap_remove(i);
        }
        t.entries.push(entry);
        self.changed.notify_all();
    }

    /// Ends a [`Plan::Create`] that made no link.
    pub(crate) fn creation_failed(&self, peer: u64) {
        let mut t = self.lock();
        if let Some(i) = t.creating.iter().position(|&p| p == peer) {
            t.creating.swap_remove(i);
        }
        self.changed.notify_all();
    }

    /// Records a link opened from a peer's REQ, counted once for its connection.
    pub(crate) fn opened(&self, entry: LinkEntry) {
        self.lock().entries.push(entry);
    }

    /// Counts one more connection on the up link to `peer` with `token` whose segment end
    /// is `side`; `None` if there is no such link (any more).
    pub(crate) fn reserve(
        &self,
        engine: &EngineCell<Engine>,
        peer: u64,
        token: u64,
        side: Side,
    ) -> Option<LinkId> {
        let mut t = self.lock();
        forget_broken(&mut t, engine);
        let e = t
            .entries
            .iter_mut()
            .find(|e| e.peer == peer && e.token == token && e.side == side && e.up)?;
        e.refs += 1;
        e.live += 1;
        Some(e.id)
    }

    /// A connection on link `id` whose peer is still there ended or failed: its count goes,
    /// and the link is torn down or removed if that was the last.
    pub(crate) fn release(&self, engine: &EngineCell<Engine>, id: LinkId, was_live: bool) {
        let mut t = self.lock();
        let Some(i) = t.entries.iter().position(|e| e.id == id) else {
            return;
        };
        let e = &mut t.entries[i];
        e.refs = e.refs.saturating_sub(1);
        if was_live {
            e.live = e.live.saturating_sub(1);
        }
        if e.refs == 0 {
            t.entries.swap_remove(i);
            engine.with(|en| en.remove_link(id));
            self.changed.notify_all();
        } else if e.live == 0 && e.up {
            e.up = false;
            engine.with(|en| {
                en.link_down(id, "the peer closed every connection over this link".into());
            });
        }
    }

    /// The peer of one connection on link `id` hung up. Runs `f` on the engine (it moves the
    /// connection's QP to the Error state and says whether the connection was still counted
    /// live); if it was, the live count drops and, when it was the last, the link is torn
    /// down — all in one engine access with the table locked, so anyone who sees the QP's
    /// flushed completions then sees the link's new state.
    pub(crate) fn hang_up(
        &self,
        engine: &EngineCell<Engine>,
        id: LinkId,
        why: &str,
        f: impl FnOnce(&mut Engine) -> bool,
    ) {
        let mut t = self.lock();
        engine.with(|en| {
            if !f(en) {
                return;
            }
            let Some(e) = t.entries.iter_mut().find(|e| e.id == id) else {
                return;
            };
            e.live = e.live.saturating_sub(1);
            if e.live == 0 && e.up {
                e.up = false;
                en.link_down(id, why.to_string());
            }
        });
    }

    /// A copy of every entry.
    pub(crate) fn snapshot(&self) -> Vec<LinkEntry> {
        self.lock().entries.clone()
    }
}

/// Marks links the engine tore down by itself (a peer broke a ring) as down, so that no new
/// connection picks them.
fn forget_broken(t: &mut Table, engine: &EngineCell<Engine>) {
    if t.entries.iter().all(|e| !e.up) {
        return;
    }
    engine.with(|en| {
        for e in t.entries.iter_mut().filter(|e| e.up) {
            if en.link_mut(e.id).is_none_or(|l| l.down.is_some()) {
                e.up = false;
            }
        }
    });
}

/// One connection's hold on its link: released (and the link torn down or removed when it
/// was the last) when dropped. `live` is shared with the peer watcher; whoever clears it
/// first takes the connection out of the link's live count.
pub(crate) struct LinkRef {
    pub(crate) shared: Arc<Device>,
    pub(crate) id: LinkId,
    pub(crate) live: Arc<AtomicBool>,
}

impl LinkRef {
    /// A hold already counted in the table (by [`Links::plan`], [`Links::reserve`],
    /// [`Links::created`] or [`Links::opened`]).
    pub(crate) fn counted(shared: &Arc<Device>, id: LinkId) -> LinkRef {
        LinkRef {
            shared: shared.clone(),
            id,
            live: Arc::new(AtomicBool::new(true)),
        }
    }
}

impl Drop for LinkRef {
    fn drop(&mut self) {
        let was_live = self.live.swap(false, Ordering::AcqRel);
        crate::cm::CmState::of(&self.shared)
            .links
            .release(&self.shared.engine, self.id, was_live);
    }
}
