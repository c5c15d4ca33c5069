//! Memory windows (IBA 10.6.7, `ibv_mw`): further R_Keys over parts of a memory region.
//! See the docs of [`Mw`] for how they work.

use std::sync::Arc;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::tables::mw::{MAX_MWS, MW_KEY_BIT};
use crate::verbs::mr::{Mr, Pd};
use crate::verbs::wr::MwBind;

pub use crate::tables::mw::MwType;

/// A memory window of a protection domain (`ibv_mw`); dropping it deallocates it (its
/// key stops working at once).
///
/// Memory windows (IBA 10.6.7, `ibv_mw`): further R_Keys over parts of a memory region,
/// each with its own range and remote rights, bound and invalidated cheaply while the
/// region stays registered.
///
/// * A **type 1** window is bound with the Bind Memory Window verb ([`Qp::bind_mw`]),
///   which returns its new R_Key; it works through every QP of its protection domain and is
///   invalidated only by binding it again (a zero-length bind unbinds it) or by
///   deallocating it (dropping the [`Mw`]).
/// * A **type 2** window is bound by a work request ([`SendOp::BindMw`]) to the QP it is
///   posted on, with a key whose low 8 bits the consumer chooses ([`Mw::rkey_with_tag`]);
///   only that QP's peer can use it. It is invalidated by a Local Invalidate
///   ([`SendOp::LocalInv`]), by the peer's Send with Invalidate ([`SendOp::SendWithInv`]),
///   by deallocation, or by destroying (dropping) its QP; a bound type 2 window cannot be bound again before that.
///
/// Binding needs a region registered with [`AccessFlags::MW_BIND`]; a window with remote
/// write or atomic rights needs the region's `LOCAL_WRITE`. Remote operations through a
/// window's key are checked against the window — its range, its rights, its protection
/// domain and (type 2) its QP — not against the region's own rights; the region must still
/// be registered. A region cannot be deregistered ([`Mr::deregister`]) while windows are
/// bound to it; dropping it anyway unbinds those windows (their keys stop working).
///
/// [`Qp::bind_mw`]: crate::Qp::bind_mw
/// [`SendOp::BindMw`]: crate::SendOp::BindMw
/// [`SendOp::LocalInv`]: crate::SendOp::LocalInv
/// [`SendOp::SendWithInv`]: crate::SendOp::SendWithInv
/// [`AccessFlags::MW_BIND`]: crate::AccessFlags::MW_BIND
/// [`Mr::deregister`]: crate::Mr::deregister
///
/// ```
/// use shmhca::{AccessFlags, Context, EngineMode, MwType, SendOp};
///
/// let ctx = Context::builder().mode(EngineMode::Inline).build()?;
/// let pd = ctx.alloc_pd()?;
/// let mr = pd.alloc_mr(1 << 16, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?;
/// let mw = pd.alloc_mw(MwType::Two)?;
/// // Grant remote write to bytes 4096..12288 only, under a key of its own; post `bind` on
/// // the QP the peer uses, and hand it `key`.
/// let key = mw.rkey_with_tag(0x17);
/// let bind = SendOp::BindMw { rkey: key, bind: mr.mw_bind(4096, 8192, AccessFlags::REMOTE_WRITE) };
/// # let _ = bind;
/// # Ok::<(), shmhca::Error>(())
/// ```
pub struct Mw {
    pub(crate) shared: Arc<Device>,
    pub(crate) index: u32,
    /// The key the application knows: the last one `bind_mw` returned (type 1), the one it
    /// was allocated with (type 2).
    pub(crate) rkey: u32,
    pub(crate) kind: MwType,
    pub(crate) pdn: u32,
}

impl Pd {
    /// Allocates an unbound memory window of type `kind` in this domain (`ibv_alloc_mw`).
    ///
    /// # Errors
    /// [`Error::LimitReached`] past 2^20 windows in the context.
    pub fn alloc_mw(&self, kind: MwType) -> Result<Mw> {
        let pdn = self.pdn;
        let (index, rkey) = self
            .shared
            .engine
            .with(|e| e.res.mws.alloc(pdn, kind))
            .ok_or(Error::LimitReached {
                what: "memory windows in one context",
                limit: MAX_MWS,
            })?;
        Ok(Mw {
            shared: self.shared.clone(),
            index,
            rkey,
            kind,
            pdn,
        })
    }
}

impl Mw {
    /// Its type.
    pub fn kind(&self) -> MwType {
        self.kind
    }

    /// The R_Key: for a type 1 window the one the last [`Qp::bind_mw`](crate::Qp::bind_mw)
    /// returned; for a type 2 window the one it was allocated with (a type 2 window's key
    /// is the one its bind work request named, see [`Mw::rkey_with_tag`]).
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// This window's key with low 8 bits `tag` (the consumer-owned part of a type 2
    /// window's key, as `ibv_inc_rkey` changes it), for [`SendOp::BindMw`](crate::SendOp::BindMw).
    pub fn rkey_with_tag(&self, tag: u8) -> u32 {
        MW_KEY_BIT | self.index << 8 | u32::from(tag)
    }

    /// The key a type 1 bind gives the window next: same index, next tag.
    pub(crate) fn next_rkey(&self) -> u32 {
        let tag = (self.rkey as u8).wrapping_add(1).max(1);
        self.rkey_with_tag(tag)
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        let index = self.index;
        self.shared.engine.with(|e| e.res.mws.dealloc(index));
    }
}

impl std::fmt::Debug for Mw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mw")
            .field("kind", &self.kind)
            .field("rkey", &format_args!("{:#x}", self.rkey))
            .finish()
    }
}

impl Mr {
    /// Where a memory window over `len` bytes at `offset` of this region goes, with remote
    /// rights `access` — for [`Qp::bind_mw`](crate::Qp::bind_mw) and
    /// [`SendOp::BindMw`](crate::SendOp::BindMw). Checked when the bind executes.
    pub fn mw_bind(&self, offset: u64, len: u64, access: crate::AccessFlags) -> MwBind {
        MwBind {
            lkey: self.lkey(),
            addr: self.addr().wrapping_add(offset),
            len,
            access,
        }
    }
}
