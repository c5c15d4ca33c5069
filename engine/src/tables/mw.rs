//! The engine's table of memory windows: binding, invalidation, and remote access through
//! a window.
//!
//! A memory window is a second R_Key over (part of) a memory region, with its own range and
//! remote rights, that the application can bind, move and invalidate cheaply while the
//! region stays registered. A window's key is `MW_KEY_BIT | index << 8 | tag`: the high bit
//! tells a window's key from a region's (region indexes stay below 2^23), the index names
//! the entry, and the low 8 bits are a tag: for a type 1 window the verbs layer picks a new
//! one at every bind; for a type 2 window the consumer picks it in the bind work request
//! (as with `ibv_inc_rkey`). Only the key currently bound works: a previous key, or any key
//! of an unbound or invalidated window, is refused.
//!
//! Everything here is private engine memory, touched under the engine token. A peer's
//! R_Key is only a number looked up in this table and checked against the entry.

use crate::qp::AccessFlags;
use crate::slots::SlotTable;
use crate::tables::mr::{AccessDenied, MrTable};
use crate::wire::Qpn;

/// The bit of an R_Key that marks a memory window's key.
pub(crate) const MW_KEY_BIT: u32 = 1 << 31;
/// The most windows one context can hold.
pub(crate) const MAX_MWS: u32 = crate::limits::MAX_MWS;

/// The two kinds of memory window (IBA 10.6.7; `ibv_mw_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MwType {
    /// Type 1: bound with the Bind Memory Window verb ([`crate::Qp::bind_mw`]), usable
    /// through any QP of its protection domain; invalidated only by binding it again (a
    /// zero-length bind unbinds it) or deallocating it.
    One,
    /// Type 2: bound with a bind work request ([`crate::SendOp::BindMw`]) to the QP it was
    /// posted on, usable only through that QP (by its connected peer); invalidated by a
    /// Local Invalidate or a peer's Send with Invalidate, or by deallocation.
    Two,
}

/// What a window is bound to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Binding {
    /// The key of the region it lies in (checked live at every access).
    pub(crate) mr_key: u32,
    /// Start (an address of the region) and length.
    pub(crate) va: u64,
    pub(crate) len: u64,
    /// Remote rights.
    pub(crate) access: AccessFlags,
    /// The QP a type 2 window is bound to.
    pub(crate) qpn: Option<Qpn>,
}

/// One window.
#[derive(Debug)]
pub(crate) struct MwEntry {
    /// The key it answers to now.
    pub(crate) key: u32,
    pub(crate) pd: u32,
    pub(crate) kind: MwType,
    /// `None` while unbound or invalidated.
    pub(crate) binding: Option<Binding>,
}

/// A bind request, as the engine executes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BindRequest {
    /// The window's key after the bind (its index names the window).
    pub(crate) new_key: u32,
    /// Which verb asked: the Bind MW verb (type 1) or a bind work request (type 2).
    pub(crate) kind: MwType,
    pub(crate) mr_key: u32,
    pub(crate) va: u64,
    pub(crate) len: u64,
    pub(crate) access: AccessFlags,
}

/// Why a bind failed (the work request completes with a bind error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BindError {
    /// No such window, or of the other type than the verb used.
    NoWindow,
    /// The window or the region belongs to another protection domain than the QP.
    WrongPd,
    /// A type 2 window is still bound: invalidate it first.
    AlreadyBound,
    /// The region's key is not live.
    NoRegion,
    /// The region was not registered with `MW_BIND`.
    NoBindRight,
    /// Remote write or atomic rights on a region without `LOCAL_WRITE`, or rights that are
    /// not remote rights.
    RightsBeyondRegion,
    /// The window does not lie inside the region (or a type 2 window of zero length).
    OutOfRegion,
}

/// Why an invalidation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InvalidateError {
    /// The key names no bound type 2 window (unknown, stale, unbound, or type 1).
    NotBoundType2,
    /// The window belongs to another protection domain.
    WrongPd,
    /// The window is bound to another QP (Send with Invalidate only).
    WrongQp,
}

/// The table.
#[derive(Debug)]
pub(crate) struct MwTable {
    entries: SlotTable<MwEntry>,
}

impl Default for MwTable {
    fn default() -> MwTable {
        MwTable {
            entries: SlotTable::new(MAX_MWS, 8),
        }
    }
}

fn index_of(key: u32) -> u32 {
    (key & !MW_KEY_BIT) >> 8
}

/// Whether `key` names a memory window rather than a region.
pub(crate) fn is_window_key(key: u32) -> bool {
    key & MW_KEY_BIT != 0
}

impl MwTable {
    /// Allocates an unbound window of `kind` in `pd`; returns its index and initial key.
    pub(crate) fn alloc(&mut self, pd: u32, kind: MwType) -> Option<(u32, u32)> {
        self.entries
            .insert_with(|index, tag| MwEntry {
                key: MW_KEY_BIT | index << 8 | tag,
                pd,
                kind,
                binding: None,
            })
            .map(|(index, tag)| (index, MW_KEY_BIT | index << 8 | tag))
    }

    /// Deallocates window `index` (its key dies with it).
    pub(crate) fn dealloc(&mut self, index: u32) {
        self.entries.remove_at(index);
    }

    /// Windows bound into the region of key `mr_key`.
    pub(crate) fn bound_to_region(&self, mr_key: u32) -> u32 {
        self.entries
            .iter()
            .filter(|(_, e)| e.binding.is_some_and(|b| b.mr_key == mr_key))
            .count() as u32
    }

    /// Unbinds every window bound into the region of key `mr_key`, whose key dies now (its
    /// handle was dropped). The window must not outlive the region's key: the 8-bit
    /// generation of region keys wraps, and a later region given the same key (often at the
    /// same address) would otherwise be reachable through the window.
    pub(crate) fn unbind_region(&mut self, mr_key: u32) {
        for (_, e) in self.entries.iter_mut() {
            if e.binding.is_some_and(|b| b.mr_key == mr_key) {
                e.binding = None;
            }
        }
    }

    /// Invalidates every type 2 window bound to QP `qpn`, which is being destroyed: the
    /// generation in a QPN wraps, and a later QP given the same number (perhaps connected
    /// to another peer) would otherwise reach memory through the window.
    pub(crate) fn unbind_qp(&mut self, qpn: Qpn) {
        for (_, e) in self.entries.iter_mut() {
            if e.binding.is_some_and(|b| b.qpn == Some(qpn)) {
                e.binding = None;
            }
        }
    }

    /// Executes a bind posted on QP `qpn` of protection domain `pd`.
    pub(crate) fn bind(
        &mut self,
        mrs: &MrTable,
        pd: u32,
        qpn: Qpn,
        r: &BindRequest,
    ) -> Result<(), BindError> {
        let e = self
            .entries
            .at_mut(index_of(r.new_key))
            .filter(|e| e.kind == r.kind && is_window_key(r.new_key))
            .ok_or(BindError::NoWindow)?;
        if e.pd != pd {
            return Err(BindError::WrongPd);
        }
        if e.kind == MwType::Two && e.binding.is_some() {
            return Err(BindError::AlreadyBound);
        }
        if e.kind == MwType::One && r.len == 0 {
            // A zero-length bind of a type 1 window unbinds it (and retires the old key).
            e.binding = None;
            e.key = r.new_key;
            return Ok(());
        }
        let mr = mrs.by_key(r.mr_key).map_err(|_| BindError::NoRegion)?;
        if mr.pd != pd {
            return Err(BindError::WrongPd);
        }
        if !mr.access.contains(AccessFlags::MW_BIND) {
            return Err(BindError::NoBindRight);
        }
        let remote =
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
        if !remote.contains(r.access)
            || (r.access.remote_writable() && !mr.access.contains(AccessFlags::LOCAL_WRITE))
        {
            return Err(BindError::RightsBeyondRegion);
        }
        let start = r.va.checked_sub(mr.va).ok_or(BindError::OutOfRegion)?;
        let end = start.checked_add(r.len).ok_or(BindError::OutOfRegion)?;
        if end > mr.len || r.len == 0 {
            return Err(BindError::OutOfRegion);
        }
        e.key = r.new_key;
        e.binding = Some(Binding {
            mr_key: r.mr_key,
            va: r.va,
            len: r.len,
            access: r.access,
            qpn: (e.kind == MwType::Two).then_some(qpn),
        });
        Ok(())
    }

    /// Invalidates the type 2 window bound with `key`: by a Local Invalidate posted on a QP
    /// of `pd` (`via_qp` `None`), or by a Send with Invalidate arriving at QP `via_qp`.
    pub(crate) fn invalidate(
        &mut self,
        key: u32,
        pd: u32,
        via_qp: Option<Qpn>,
    ) -> Result<(), InvalidateError> {
        let e = self
            .entries
            .at_mut(index_of(key))
            .filter(|e| {
                is_window_key(key) && e.key == key && e.kind == MwType::Two && e.binding.is_some()
            })
            .ok_or(InvalidateError::NotBoundType2)?;
        if e.pd != pd {
            return Err(InvalidateError::WrongPd);
        }
        if via_qp.is_some() && e.binding.and_then(|b| b.qpn) != via_qp {
            return Err(InvalidateError::WrongQp);
        }
        e.binding = None;
        Ok(())
    }

    /// Checks a remote access of `len` bytes at `va` through window key `rkey`, arriving at
    /// QP `qpn` of protection domain `pd`; returns the arena offset of `va`. The window's
    /// range and rights decide, not the region's; the region must still be registered.
    pub(crate) fn check_remote(
        &self,
        mrs: &MrTable,
        rkey: u32,
        (pd, qpn): (u32, Qpn),
        need: AccessFlags,
        va: u64,
        len: u64,
    ) -> Result<u64, AccessDenied> {
        let e = self
            .entries
            .at(index_of(rkey))
            .ok_or(AccessDenied::UnknownKey)?;
        let b = match e.binding {
            Some(b) if e.key == rkey => b,
            _ => return Err(AccessDenied::StaleKey),
        };
        if e.pd != pd {
            return Err(AccessDenied::WrongPd);
        }
        if b.qpn.is_some_and(|q| q != qpn) {
            return Err(AccessDenied::WrongQp);
        }
        if !b.access.contains(need) {
            return Err(AccessDenied::NoRights);
        }
        let start = va.checked_sub(b.va).ok_or(AccessDenied::OutOfBounds)?;
        let end = start.checked_add(len).ok_or(AccessDenied::OutOfBounds)?;
        if end > b.len {
            return Err(AccessDenied::OutOfBounds);
        }
        let mr = mrs.by_key(b.mr_key).map_err(|_| AccessDenied::StaleKey)?;
        // The window lay inside the region when bound, and a region never changes size.
        let in_mr = va.checked_sub(mr.va).ok_or(AccessDenied::OutOfBounds)?;
        if in_mr.checked_add(len).is_none_or(|e| e > mr.len) {
            return Err(AccessDenied::OutOfBounds);
        }
        Ok(mr.local_off(in_mr))
    }
}
