//! This host's RoCEv2 GID table: one entry per IP address of its interfaces, read afresh
//! at each call (so it is never stale: an address added or removed shows at the next
//! look), and the active MTU of the interface behind an address.

use std::net::IpAddr;

use crate::error::Result;
use crate::qp::Mtu;
use shmhca_proto::roce::{Gid, IpVersion, active_mtu};

use super::socket;

/// One entry of this host's RoCEv2 GID table ([`gid_table`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    /// Its index (what `ibv_query_gid`'s index and perftest's `-x` name).
    pub index: u32,
    /// The GID: an IPv6 address, or an IPv4 address as `::ffff:a.b.c.d`.
    pub gid: Gid,
    /// The interface that has the address.
    pub interface: String,
    /// The interface is up and running.
    pub up: bool,
    /// The interface's MTU, if it could be read.
    pub interface_mtu: Option<u32>,
    /// The largest IBA path MTU whose packets fit that interface's MTU as RoCEv2
    /// datagrams (1500 gives 1024, 9000 gives 4096).
    pub active_mtu: Option<Mtu>,
}

/// This host's RoCEv2 GID table, as the network namespace of the calling thread sees it
/// now: every IPv4 and IPv6 address of every interface, in the order the kernel lists
/// them, each of type RoCEv2.
///
/// ```
/// let table = shmhca::gid_table()?;
/// // Loopback is always there: 127.0.0.1 as ::ffff:127.0.0.1.
/// assert!(table.iter().any(|e| e.gid.to_string() == "::ffff:127.0.0.1"));
/// # Ok::<(), shmhca::Error>(())
/// ```
///
/// # Errors
/// The addresses could not be listed (`getifaddrs` failed).
pub fn gid_table() -> Result<Vec<GidEntry>> {
    let addrs = socket::host_addrs()?;
    Ok(addrs
        .into_iter()
        .enumerate()
        .map(|(i, a)| {
            let interface_mtu = socket::interface_mtu(&a.interface);
            GidEntry {
                index: i as u32,
                gid: Gid::from(a.ip),
                active_mtu: interface_mtu.and_then(|m| active_mtu(m, ip_version(a.ip))),
                interface: a.interface,
                up: a.up,
                interface_mtu,
            }
        })
        .collect())
}

fn ip_version(ip: IpAddr) -> IpVersion {
    match ip {
        IpAddr::V4(_) => IpVersion::V4,
        IpAddr::V6(_) => IpVersion::V6,
    }
}

/// The active MTU of the interface that has `ip` (`None` when no interface of this
/// namespace has it, or its MTU cannot be read).
pub(crate) fn active_mtu_of(ip: IpAddr) -> Option<Mtu> {
    let a = socket::host_addrs()
        .ok()?
        .into_iter()
        .find(|a| a.ip == ip)?;
    active_mtu(socket::interface_mtu(&a.interface)?, ip_version(ip))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_in_the_table_with_its_mtu() {
        let table = gid_table().unwrap();
        let lo = table
            .iter()
            .find(|e| e.gid.ip() == IpAddr::from([127, 0, 0, 1]))
            .expect("127.0.0.1 in the table");
        assert_eq!(lo.interface, "lo");
        assert!(lo.up);
        // Loopback's MTU is 65536 on Linux: the largest path MTU fits.
        assert_eq!(lo.interface_mtu, Some(65536));
        assert_eq!(lo.active_mtu, Some(Mtu::Mtu4096));
        assert_eq!(
            active_mtu_of(IpAddr::from([127, 0, 0, 1])),
            Some(Mtu::Mtu4096)
        );
        // Indexes are the positions.
        for (i, e) in table.iter().enumerate() {
            assert_eq!(e.index as usize, i);
        }
        assert_eq!(socket::interface_mtu("no-such-if0"), None);
        assert_eq!(socket::interface_mtu(""), None);
        assert_eq!(socket::interface_mtu("a-name-longer-than-ifnamsiz"), None);
    }

    /// An interface of MTU 1500 gives active MTU 1024; one of 9000, 4096 (in a namespace of
    /// the test's own, as root).
    #[test]
    fn an_interfaces_mtu_sets_the_active_mtu_and_caps_the_path_mtu() {
        use super::socket::netns::{Netns, available, ip};
        if !available("an_interfaces_mtu_sets_the_active_mtu_and_caps_the_path_mtu") {
            return;
        }
        let ns = Netns::new(&format!("shmhca-gid-{}", std::process::id() % 100_000)).unwrap();
        // (A veth pair with both ends here: this kernel has no dummy interfaces.)
        ip(&[
            "-n", &ns.0, "link", "add", "shgid0", "type", "veth", "peer", "name", "shgid1",
        ])
        .unwrap();
        ip(&["-n", &ns.0, "link", "set", "shgid0", "mtu", "1500", "up"]).unwrap();
        ip(&["-n", &ns.0, "addr", "add", "198.18.7.1/30", "dev", "shgid0"]).unwrap();
        let a: IpAddr = "198.18.7.1".parse().unwrap();
        let got = ns.run(|| active_mtu_of(a)).unwrap();
        assert_eq!(got, Some(Mtu::Mtu1024));
        // A port on that address caps its QPs' path MTU at 1024, with a message that says
        // why; a destination can be named by GID.
        let ctx = crate::raw_peer::inline_context();
        let port = ns
            .run(|| super::super::UdpPort::bind(&ctx, a))
            .unwrap()
            .unwrap();
        assert_eq!(port.active_mtu(), Some(Mtu::Mtu1024));
        assert_eq!(port.gid().to_string(), "::ffff:198.18.7.1");
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4).unwrap();
        let mut qp = ctx
            .create_qp(&pd, &cq, &cq, crate::QpCaps::default())
            .unwrap();
        let peer = Gid::from("198.18.7.2".parse::<IpAddr>().unwrap());
        let dest = port
            .destination_gid(&qp, peer, crate::Qpn::new(0x22))
            .unwrap();
        use crate::{AccessFlags, QpAttr, QpState};
        qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::NONE))
            .unwrap();
        let rtr = |mtu| {
            QpAttr::new(QpState::Rtr)
                .path_mtu(mtu)
                .dest(dest)
                .rq_psn(0)
                .max_dest_rd_atomic(1)
                .min_rnr_timer(1)
        };
        let err = qp.modify(&rtr(Mtu::Mtu2048)).unwrap_err().to_string();
        assert!(
            err.contains("path_mtu") && err.contains("2048") && err.contains("active MTU"),
            "{err}"
        );
        assert_eq!(
            qp.state(),
            QpState::Init,
            "a refused modify changes nothing"
        );
        qp.modify(&rtr(Mtu::Mtu1024)).unwrap();
        drop((qp, cq, pd, port));
        ip(&["-n", &ns.0, "link", "set", "shgid0", "mtu", "9000"]).unwrap();
        let (got, table) = ns.run(|| (active_mtu_of(a), gid_table().unwrap())).unwrap();
        assert_eq!(got, Some(Mtu::Mtu4096));
        let e = table.iter().find(|e| e.gid.ip() == a).unwrap();
        assert_eq!(e.gid.to_string(), "::ffff:198.18.7.1");
        assert_eq!(
            (e.interface.as_str(), e.interface_mtu),
            ("shgid0", Some(9000))
        );
    }
}
