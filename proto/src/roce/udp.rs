//! The UDP ports of a RoCEv2 packet.
//!
//! The destination port is always [`UDP_PORT`] (4791). The source port carries flow
//! entropy for ECMP: one per QP connection, so a connection's packets stay on one path
//! and in order while different connections spread. Linux derives it the same way for
//! soft-RoCE and hardware drivers: from the address vector's 20-bit flow label if it is
//! not zero, else from a flow label computed from both QP numbers, folded into the 14 bits
//! under `0xC000`. Both ends compute the same port for a connection (the computation is
//! symmetric in the QPNs), so each direction of it takes the same path.

use crate::wire::Qpn;

/// The UDP destination port IANA assigned to RoCEv2.
pub const UDP_PORT: u16 = 4791;

/// The lowest RoCEv2 UDP source port: source ports are in `0xC000..=0xFFFF` (the
/// dynamic range), the low 14 bits carrying the flow's entropy.
pub const SOURCE_PORT_MIN: u16 = 0xC000;

/// The 20 bits of an IPv6 flow label (`ibv_ah_attr.grh.flow_label`).
pub const FLOW_LABEL_MASK: u32 = 0xF_FFFF;

/// The flow label of the connection between QPs `local` and `remote` when the address
/// vector gives none: the 48-bit product of the QPNs, folded to 20 bits. Symmetric:
/// `flow_label_of_qpns(a, b) == flow_label_of_qpns(b, a)`.
pub const fn flow_label_of_qpns(local: Qpn, remote: Qpn) -> u32 {
    let v = local.get() as u64 * remote.get() as u64;
    // Linux folds twice, `v ^= v >> 20; v ^= v >> 40`; the second fold adds `v >> 40` and
    // `v >> 60`, which is 0 for a product of two 24-bit numbers.
    ((v ^ (v >> 20) ^ (v >> 40)) as u32) & FLOW_LABEL_MASK
}

/// The UDP source port of flow label `flow_label` (its low 20 bits): the low 14 bits XOR
/// the high 6, above [`SOURCE_PORT_MIN`].
pub const fn source_port_of_flow_label(flow_label: u32) -> u16 {
    let low = flow_label & 0x3FFF;
    let high = (flow_label & 0xF_C000) >> 14;
    SOURCE_PORT_MIN + (low ^ high) as u16
}

/// The UDP source port a QP sends from: from the address vector's `flow_label` if it is
/// not zero, else from both QP numbers, as Linux RoCE drivers do. Always in
/// `0xC000..=0xFFFF`.
///
/// ```
/// use shmhca_proto::roce::source_port;
/// use shmhca_proto::wire::Qpn;
///
/// let (a, b) = (Qpn::new(0x11), Qpn::new(0x12));
/// let port = source_port(0, a, b);
/// assert_eq!(port, source_port(0, b, a), "both ends use the same port");
/// assert!(port >= 0xC000);
/// assert_eq!(source_port(0x1_2345, a, b), 0xC000 | (0x2345 ^ 0x4));
/// ```
pub const fn source_port(flow_label: u32, local: Qpn, remote: Qpn) -> u16 {
    let flow_label = if flow_label != 0 {
        flow_label
    } else {
        flow_label_of_qpns(local, remote)
    };
    source_port_of_flow_label(flow_label)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_label_of_qpns_by_hand() {
        // 0x11 · 0x12 = 0x132: nothing above bit 20 to fold.
        assert_eq!(flow_label_of_qpns(Qpn::new(0x11), Qpn::new(0x12)), 0x132);
        // 0xAB_CDEF · 0x12_3456 = 0xC37_9A59_BA4A. v ^= v >> 20: low 20 bits
        // 0x9BA4A ^ 0x379A5 = 0xAC3EF; v ^= v >> 40 (0xC): 0xAC3E3.
        assert_eq!(0xAB_CDEFu64 * 0x12_3456, 0xC37_9A59_BA4A);
        assert_eq!(
            flow_label_of_qpns(Qpn::new(0xAB_CDEF), Qpn::new(0x12_3456)),
            0xA_C3E3
        );
        // The largest QPNs: 0xFFFF_FE00_0001; the >> 20 fold gives low bits
        // 0x00001 ^ 0xFFFE0 = 0xFFFE1, the >> 40 fold (0xFF) 0xFFF1E.
        assert_eq!(
            flow_label_of_qpns(Qpn::new(0xFF_FFFF), Qpn::new(0xFF_FFFF)),
            0xF_FF1E
        );
        assert_eq!(flow_label_of_qpns(Qpn::new(0), Qpn::new(0x12_3456)), 0);
    }

    #[test]
    fn source_port_of_flow_label_by_hand() {
        assert_eq!(source_port_of_flow_label(0), 0xC000);
        assert_eq!(source_port_of_flow_label(0x3FFF), 0xFFFF);
        assert_eq!(source_port_of_flow_label(0x4000), 0xC001); // bit 14 folds onto bit 0
        assert_eq!(source_port_of_flow_label(0x8_0000), 0xC020); // bit 19 onto bit 5
        assert_eq!(
            source_port_of_flow_label(0xF_FFFF),
            0xC000 | (0x3FFF ^ 0x3F)
        );
        // Bits above the 20 of a flow label are ignored.
        assert_eq!(source_port_of_flow_label(0xFFF0_0123), 0xC123);
    }

    #[test]
    fn source_port_is_symmetric_in_range_and_prefers_the_flow_label() {
        let mut seed = 0x2545_F491u32;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        let mut ports = std::collections::HashSet::new();
        for _ in 0..10_000 {
            let (a, b) = (Qpn::new(next()), Qpn::new(next()));
            let p = source_port(0, a, b);
            assert!(p >= SOURCE_PORT_MIN, "{p:#x}");
            assert_eq!(p, source_port(0, b, a));
            assert_eq!(p, source_port_of_flow_label(flow_label_of_qpns(a, b)));
            let fl = next() & FLOW_LABEL_MASK;
            if fl != 0 {
                assert_eq!(source_port(fl, a, b), source_port_of_flow_label(fl));
            }
            ports.insert(p);
        }
        // The ports spread over the 16384 available.
        assert!(ports.len() > 7_000, "{} distinct ports", ports.len());
        let (a, b) = (Qpn::new(0x11), Qpn::new(0x12));
        assert_eq!(source_port(0, a, b), 0xC132);
        assert_eq!(
            source_port(0, Qpn::new(0xAB_CDEF), Qpn::new(0x12_3456)),
            0xC3C8
        );
        // As in Linux, any nonzero value counts as given, even with only bits above the
        // 20 of a flow label set (which then fold to nothing).
        assert_eq!(source_port(0x10_0000, a, b), 0xC000);
    }
}
