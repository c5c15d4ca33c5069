//! How a QP names its peer on the fabric: by LID or by GID (index 0 of the peer's port),
//! and the one mapping between the two. A leaf below the rest of the fabric: the QP
//! attributes name these types without depending on how a link is set up.

use crate::error::{Error, Result};
use crate::wire::Qpn;

use super::dir::{MAX_LID, MIN_LID};

/// The subnet prefix of every fabric GID (link-local, fe80::/64).
pub const SUBNET_PREFIX: [u8; 8] = [0xfe, 0x80, 0, 0, 0, 0, 0, 0];

/// The interface identifier of a fabric GID before its LID: a locally administered
/// EUI-64 ("SHM").
const INTERFACE_TAG: [u8; 6] = [0x02, b'S', b'H', b'M', 0, 0];

/// The GID of LID `lid`: [`SUBNET_PREFIX`], then `02 53 48 4d 00 00` and the LID
/// (big-endian), so `fe80::253:484d:0:LID`.
pub fn gid_of_lid(lid: u16) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[..8].copy_from_slice(&SUBNET_PREFIX);
    g[8..14].copy_from_slice(&INTERFACE_TAG);
    g[14..].copy_from_slice(&lid.to_be_bytes());
    g
}

/// The LID a fabric GID names; `None` for a GID no fabric context can have.
pub fn lid_of_gid(gid: &[u8; 16]) -> Option<u16> {
    if gid[..8] != SUBNET_PREFIX || gid[8..14] != INTERFACE_TAG {
        return None;
    }
    let lid = u16::from_be_bytes([gid[14], gid[15]]);
    (MIN_LID..=MAX_LID).contains(&lid).then_some(lid)
}

/// How an RTR names the peer's port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FabricPeer {
    /// By LID (`ibv_ah_attr.dlid`).
    Lid(u16),
    /// By GID (`ibv_ah_attr.grh.dgid`, with `is_global`).
    Gid([u8; 16]),
}

/// A destination on the fabric: the peer's port and QP number (`ibv_qp_attr.ah_attr` and
/// `dest_qp_num`). Set with [`QpAttr::dest_lid`](crate::QpAttr::dest_lid) or
/// [`QpAttr::dest_gid`](crate::QpAttr::dest_gid).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FabricDest {
    /// The peer's port.
    pub peer: FabricPeer,
    /// The peer's QP.
    pub qpn: Qpn,
}

impl FabricDest {
    /// The LID named, checked.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a LID outside the unicast range, or a GID that is
    /// not a fabric GID.
    pub fn lid(&self) -> Result<u16> {
        match self.peer {
            FabricPeer::Lid(l) if (MIN_LID..=MAX_LID).contains(&l) => Ok(l),
            FabricPeer::Lid(l) => Err(Error::invalid(
                "dest_lid",
                format!("LID {l:#x} is not a unicast LID ({MIN_LID:#x}..={MAX_LID:#x})"),
            )),
            FabricPeer::Gid(g) => lid_of_gid(&g).ok_or_else(|| {
                Error::invalid(
                    "dest_gid",
                    format!(
                        "{} is not a shmhca fabric GID (fe80::253:484d:0:LID, from ibv_query_gid index 0)",
                        std::net::Ipv6Addr::from(g)
                    ),
                )
            }),
        }
    }
}
