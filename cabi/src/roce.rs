//! The RoCEv2 port: with `SHMHCA_VERBS_LINK=roce` (what `shmhca exec --roce` sets), port 1
//! of `shmhca0` is an Ethernet port whose GID table is this host's IP addresses
//! ([`shmhca::gid_table`]), and a QP connects over UDP 4791 ([`shmhca::UdpPort`]) to the
//! peer its RTR address vector's `grh.dgid` names: `ibv_rc_pingpong -g N` and perftest's
//! `-x N` work unmodified across machines.
//!
//! * The GID table is read once, at `ibv_open_device`, so that `ibv_query_gid`'s index and
//!   `ibv_modify_qp`'s `grh.sgid_index` name the same address for the context's life.
//! * The port's `active_mtu` is the *smallest* active MTU of the interfaces that are up
//!   (each entry's [`GidEntry::active_mtu`]): a port has one active MTU but this one spans
//!   every interface, and programs (perftest) use it as every QP's path MTU, so it must fit
//!   whichever address the program picks. A QP may still ask for a larger path MTU if its
//!   source address's interface takes it; the engine refuses one larger than that
//!   interface's ([`shmhca::UdpPort::active_mtu`]).
//! * `ibv_modify_qp` to RTR needs `ah_attr.is_global` (without: EINVAL and a `shmhca:`
//!   line saying so): `grh.sgid_index` picks the local address, for which the context
//!   binds one [`shmhca::UdpPort`] (kept until it closes; UDP 4791 taken there: the
//!   bind's errno and a `shmhca:` line naming the likely holder), `grh.dgid` is the
//!   peer's address (IPv4-mapped or IPv6), `dest_qp_num` its QPN. `grh.hop_limit` and
//!   `grh.traffic_class` are the TTL (hop limit) and TOS (traffic class) of the QP's
//!   datagrams (0: the host's default); `flow_label` is accepted and ignored (each QP's
//!   UDP source port comes from both QPNs, as Linux derives it without a flow label).
//! * An IPv6 link-local GID (`fe80::…`) cannot be a source: the bind carries no scope
//!   (interface) id.

use std::ffi::c_int;
use std::net::IpAddr;
use std::sync::Mutex;

use shmhca::roce::Gid;
use shmhca::{Destination, GidEntry, Mtu, Qp, Qpn, UdpPort};

use crate::ffi::*;

/// The environment variable that selects the port's link layer (`roce`, or `ib`: the
/// default).
pub const LINK_ENV: &str = "SHMHCA_VERBS_LINK";

/// Whether this process's port is a RoCEv2 one (`SHMHCA_VERBS_LINK=roce`). Another value
/// than `roce` or `ib` is reported once on stderr and means InfiniBand.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| match std::env::var(LINK_ENV) {
        Ok(v) if v.eq_ignore_ascii_case("roce") => true,
        Ok(v) if v.is_empty() || v.eq_ignore_ascii_case("ib") => false,
        Err(std::env::VarError::NotPresent) => false,
        Ok(v) => {
            eprintln!("shmhca: {LINK_ENV}={v:?} is neither `roce` nor `ib`: using InfiniBand");
            false
        }
        Err(_) => {
            eprintln!("shmhca: {LINK_ENV} is not valid UTF-8: using InfiniBand");
            false
        }
    })
}

/// A context's RoCEv2 port: the GID table it was opened with, and the UDP ports bound so
/// far (one per local address used as a source GID).
pub struct RocePort {
    /// This host's GID table at `ibv_open_device`.
    pub table: Vec<GidEntry>,
    /// The UDP ports bound so far, by local address.
    ports: Mutex<Vec<(IpAddr, UdpPort)>>,
}

impl RocePort {
    /// The port of a context opened now: reads the host's GID table.
    ///
    /// # Errors
    /// The table cannot be read (`getifaddrs` failed).
    pub fn new() -> shmhca::Result<RocePort> {
        Ok(RocePort {
            table: shmhca::gid_table()?,
            ports: Mutex::new(Vec::new()),
        })
    }

    /// The port's active MTU: the smallest of the up interfaces' (see the module
    /// documentation), 1024 when none is known.
    pub fn active_mtu(&self) -> Mtu {
        self.table
            .iter()
            .filter(|e| e.up)
            .filter_map(|e| e.active_mtu)
            .min_by_key(|m| m.bytes())
            .unwrap_or(Mtu::Mtu1024)
    }

    /// The C entry of GID `index` (`None`: out of the table).
    pub fn entry(&self, index: u32) -> Option<ibv_gid_entry> {
        let e = self.table.get(usize::try_from(index).ok()?)?;
        // SAFETY: plain data, all zeroes valid.
        let mut c: ibv_gid_entry = unsafe { std::mem::zeroed() };
        c.gid.raw = e.gid.octets();
        c.gid_index = e.index;
        c.port_num = 1;
        c.gid_type = IBV_GID_TYPE_ROCE_V2;
        c.ndev_ifindex = std::ffi::CString::new(e.interface.as_str()).map_or(0, |name| {
            // SAFETY: a NUL-terminated name of ours, for the call.
            unsafe { libc::if_nametoindex(name.as_ptr()) }
        });
        Some(c)
    }

    /// The destination of `qp` towards QP `dest_qpn` at the RoCEv2 endpoint `ah` names:
    /// `grh.sgid_index` the local address, `grh.dgid` the peer. The UDP port of the local
    /// address is bound on first use. Errors are errnos, each with a `shmhca:` line (a
    /// refused bind always; the others with `SHMHCA_VERBS_DEBUG`).
    pub fn destination(
        &self,
        ctx: &shmhca::Context,
        qp: &Qp,
        ah: &ibv_ah_attr,
        dest_qpn: u32,
    ) -> Result<Destination, c_int> {
        if ah.is_global == 0 {
            // Said always: the program's own message ("Failed to modify QP to RTR") does
            // not tell the user which option is missing.
            eprintln!(
                "shmhca: ibv_modify_qp: RoCE needs a GRH: ah_attr.is_global = 1 with the peer's \
                 GID in grh.dgid (give the GID index: ibv_rc_pingpong -g N, perftest -x N; \
                 `ibv_devinfo -v` lists the GIDs)"
            );
            return Err(libc::EINVAL);
        }
        let g = &ah.grh;
        let Some(local) = self.table.get(usize::from(g.sgid_index)) else {
            return Err(refuse(&format!(
                "grh.sgid_index {} is out of the GID table ({} entries; ibv_devinfo -v lists them)",
                g.sgid_index,
                self.table.len()
            )));
        };
        // SAFETY: both union members are 16 plain bytes.
        let dgid = Gid::from_octets(unsafe { g.dgid.raw });
        let peer = dgid.ip();
        if let Some(why) = bad_peer(peer) {
            return Err(refuse(&format!(
                "grh.dgid {dgid} is not a peer's address: {why}"
            )));
        }
        let ip = local.gid.ip();
        if ip.is_ipv4() != peer.is_ipv4() {
            return Err(refuse(&format!(
                "grh.sgid_index {} is {} but grh.dgid is {dgid}: RoCEv2 needs both IPv4 or both IPv6",
                g.sgid_index, local.gid
            )));
        }
        let mut ports = self.ports.lock().unwrap_or_else(|e| e.into_inner());
        let at = match ports.iter().position(|(a, _)| *a == ip) {
            Some(i) => i,
            None => {
                let port = UdpPort::bind(ctx, ip).map_err(|e| {
                    eprintln!(
                        "shmhca: ibv_modify_qp: cannot use GID index {} ({}): {e}",
                        g.sgid_index, local.gid
                    );
                    crate::util::errno_of(&e)
                })?;
                ports.push((ip, port));
                ports.len() - 1
            }
        };
        ports[at]
            .1
            .destination_gid(qp, dgid, Qpn::new(dest_qpn))
            .map_err(|e| crate::util::fail("ibv_modify_qp", &e))
    }
}

/// Why `ip` cannot be a unicast peer (`None`: it can).
fn bad_peer(ip: IpAddr) -> Option<&'static str> {
    if ip.is_unspecified() {
        Some("it is all zeroes")
    } else if ip.is_multicast() {
        Some("it is a multicast address")
    } else if matches!(ip, IpAddr::V4(v4) if v4.is_broadcast()) {
        Some("it is the broadcast address")
    } else {
        None
    }
}

/// With `SHMHCA_VERBS_DEBUG`, prints why `ibv_modify_qp` refused the address vector;
/// returns EINVAL.
fn refuse(why: &str) -> c_int {
    if std::env::var_os("SHMHCA_VERBS_DEBUG").is_some() {
        eprintln!("shmhca: ibv_modify_qp: {why}");
    }
    libc::EINVAL
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_that_are_no_unicast_address_are_refused() {
        assert!(bad_peer("0.0.0.0".parse().unwrap()).is_some());
        assert!(bad_peer("::".parse().unwrap()).is_some());
        assert!(bad_peer("224.0.0.1".parse().unwrap()).is_some());
        assert!(bad_peer("ff02::1".parse().unwrap()).is_some());
        assert!(bad_peer("255.255.255.255".parse().unwrap()).is_some());
        assert!(bad_peer("198.18.0.2".parse().unwrap()).is_none());
        assert!(bad_peer("fe80::1".parse().unwrap()).is_none());
    }

    #[test]
    fn the_active_mtu_is_the_smallest_of_the_up_interfaces() {
        let e = |up, mtu| GidEntry {
            index: 0,
            gid: Gid::ZERO,
            interface: "x".into(),
            up,
            interface_mtu: None,
            active_mtu: mtu,
        };
        let port = |table| RocePort {
            table,
            ports: Mutex::new(Vec::new()),
        };
        let p = port(vec![
            e(true, Some(Mtu::Mtu4096)),
            e(true, Some(Mtu::Mtu1024)),
            e(false, Some(Mtu::Mtu256)),
            e(true, None),
        ]);
        assert_eq!(p.active_mtu(), Mtu::Mtu1024);
        assert_eq!(port(vec![]).active_mtu(), Mtu::Mtu1024);
        assert_eq!(
            port(vec![e(true, Some(Mtu::Mtu4096))]).active_mtu(),
            Mtu::Mtu4096
        );
    }
}
