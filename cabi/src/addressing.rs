//! From an RTR address vector (the peer's LID, or its GID) and QPN to a shmhca
//! [`Destination`]: the peer engine is found through the fabric's rendezvous directory.

use std::ffi::c_int;

use shmhca::Destination;

use crate::context::CtxObj;
use crate::ffi::*;
use crate::util::unsupported;

/// The destination of a QP whose RTR names `ah` and `dest_qpn`.
pub fn destination(_c: &CtxObj, _ah: &ibv_ah_attr, _dest_qpn: u32) -> Result<Destination, c_int> {
    Err(unsupported(
        "connecting a QP by LID/GID",
        "this build of shmhca has no fabric addressing yet",
        libc::EOPNOTSUPP,
    ))
}
