//! From an RTR address vector (the peer's LID, or its GID when `is_global`) and QPN to the
//! Rust QP's destination. On the InfiniBand port (the default), shmhca's fabric
//! ([`shmhca::fabric`]) finds the peer engine through the per-user rendezvous directory
//! every context joins at `ibv_open_device`; on the RoCEv2 port (`SHMHCA_VERBS_LINK=roce`)
//! the GRH names the local and the peer's IP address ([`crate::roce`]).

use std::ffi::c_int;

use shmhca::{Qp, QpAttr, Qpn};

use crate::context::CtxObj;
use crate::ffi::*;

/// `attr` with the destination `ah` and `dest_qpn` name, for `qp`.
pub fn with_destination(
    c: &CtxObj,
    qp: &Qp,
    attr: QpAttr,
    ah: &ibv_ah_attr,
    dest_qpn: u32,
) -> Result<QpAttr, c_int> {
    if dest_qpn > 0xff_ffff || ah.port_num > 1 {
        return Err(libc::EINVAL);
    }
    let qpn = Qpn::new(dest_qpn);
    if let Some(roce) = &c.roce {
        // The GRH's hop limit and traffic class are the TTL and TOS of the QP's datagrams.
        let dest = roce.destination(&c.ctx, qp, ah, dest_qpn)?;
        return Ok(attr
            .dest(dest)
            .hop_limit(ah.grh.hop_limit)
            .traffic_class(ah.grh.traffic_class));
    }
    if ah.is_global != 0 {
        // SAFETY: both union members are 16 plain bytes.
        let gid = unsafe { ah.grh.dgid.raw };
        Ok(attr.dest_gid(gid, qpn))
    } else if ah.dlid != 0 {
        Ok(attr.dest_lid(ah.dlid, qpn))
    } else {
        Err(libc::EINVAL)
    }
}
