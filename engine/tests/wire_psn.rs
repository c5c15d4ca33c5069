//! PSN arithmetic: property tests across the 0xFFFFFF → 0 wrap, the exact partition of
//! the PSN space into valid / duplicate / invalid, and the spec 01 walkthrough numbers.

use proptest::prelude::*;
use shmhca::psn::{Psn, PsnRegion, classify, packets_for, read_response_packets};
use shmhca::requester::next_psn;
use shmhca::wire::opcode::Opcode;

/// PSNs near the wrap, where bugs live, plus anywhere else.
fn arb_psn() -> impl Strategy<Value = Psn> {
    prop_oneof![
        (0xFF_FF00u32..=0xFF_FFFF).prop_map(Psn::new),
        (0u32..0x100).prop_map(Psn::new),
        ((1u32 << 23) - 0x80..(1u32 << 23) + 0x80).prop_map(Psn::new),
        any::<u32>().prop_map(Psn::new),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10_000))]

    #[test]
    fn diff_is_antisymmetric(a in arb_psn(), b in arb_psn()) {
        let d = a.diff(b);
        prop_assert!((-(1 << 23)..(1 << 23)).contains(&d));
        if d != -(1 << 23) {
            prop_assert_eq!(b.diff(a), -d);
        } else {
            // The one distance with no positive counterpart: both sides see -2^23.
            prop_assert_eq!(b.diff(a), d);
        }
    }

    #[test]
    fn add_and_sub_are_inverse(a in arb_psn(), n in any::<u32>()) {
        prop_assert_eq!(a.add(n).sub(n), a);
        prop_assert_eq!(a.sub(n).add(n), a);
        prop_assert_eq!(a + n, a.add(n));
        prop_assert_eq!(a - n, a.sub(n));
        prop_assert!(a.add(n).get() <= Psn::MASK);
    }

    #[test]
    fn diff_measures_add(a in arb_psn(), n in 0u32..(1 << 23)) {
        prop_assert_eq!(a.add(n).diff(a), n as i32);
        prop_assert_eq!(a.sub(n).diff(a), -(n as i32));
        prop_assert_eq!(a.add(n).after(a), n > 0);
        prop_assert_eq!(a.before(a.add(n)), n > 0);
    }

    #[test]
    fn exactly_one_ordering_holds(a in arb_psn(), b in arb_psn()) {
        let count = [a.before(b), a == b, a.after(b)].iter().filter(|x| **x).count();
        prop_assert_eq!(count, 1);
        prop_assert_eq!(a.before(b), a.diff(b) < 0);
    }

    #[test]
    fn classify_follows_distance(epsn in arb_psn(), k in 0u32..(1 << 24)) {
        // k PSNs behind ePSN.
        let expected = match k {
            0 => PsnRegion::Valid,
            k if k <= 1 << 23 => PsnRegion::Duplicate,
            _ => PsnRegion::Invalid,
        };
        prop_assert_eq!(classify(epsn.sub(k), epsn), expected);
    }

    #[test]
    fn next_psn_follows_the_npsn_rules(
        cpsn in arb_psn(), code in 0u8..=0x17, len in any::<u32>(), pmtu_log in 8u32..=12,
    ) {
        let op = Opcode::from(code);
        let pmtu = 1 << pmtu_log;
        let next = next_psn(cpsn, op, len, pmtu);
        if op == Opcode::RdmaReadRequest {
            let packets = u64::from(len).div_ceil(u64::from(pmtu)).max(1) as u32;
            prop_assert_eq!(next, cpsn.add(packets));
            prop_assert_eq!(read_response_packets(len, pmtu), packets);
        } else {
            prop_assert_eq!(next, cpsn.add(1));
        }
    }
}

#[test]
fn classify_partitions_the_space_exactly() {
    for epsn in [
        Psn::new(0),
        Psn::new(201),
        Psn::new(0xFF_FFFF),
        Psn::new(1 << 23),
    ] {
        let (mut valid, mut dup, mut invalid) = (0u32, 0u32, 0u32);
        for p in 0..=Psn::MASK {
            match classify(Psn::new(p), epsn) {
                PsnRegion::Valid => {
                    assert_eq!(p, epsn.get());
                    valid += 1;
                }
                PsnRegion::Duplicate => dup += 1,
                PsnRegion::Invalid => invalid += 1,
            }
        }
        assert_eq!(
            (valid, dup, invalid),
            (1, 1 << 23, (1 << 23) - 1),
            "ePSN {epsn:?}"
        );
    }
}

#[test]
fn classify_around_the_wrap() {
    let epsn = Psn::new(2);
    assert_eq!(classify(Psn::new(2), epsn), PsnRegion::Valid);
    assert_eq!(classify(Psn::new(1), epsn), PsnRegion::Duplicate);
    assert_eq!(classify(Psn::new(0xFF_FFFF), epsn), PsnRegion::Duplicate);
    // The farthest duplicate is 2^23 behind ePSN; the farthest invalid PSN 2^23 - 1 ahead.
    assert_eq!(
        classify(Psn::new(2 + (1 << 23)), epsn),
        PsnRegion::Duplicate
    );
    assert_eq!(classify(Psn::new(1 + (1 << 23)), epsn), PsnRegion::Invalid);
    assert_eq!(classify(Psn::new(3), epsn), PsnRegion::Invalid);
    // spec 02: the initial unsolicited Ack for ePSN 0 carries PSN 0xFFFFFF, one behind.
    assert_eq!(Psn::new(0).sub(1), Psn::new(0xFF_FFFF));
}

/// The spec 01 "Message Transfer Overview Example": start PSN 201, PMTU 1024.
#[test]
fn spec_01_walkthrough() {
    const PMTU: u32 = 1024;
    let mut npsn = Psn::new(201);
    // Sends the packets of one message; returns the first and last PSN used.
    fn send(npsn: &mut Psn, opcodes: &[(Opcode, u32)]) -> (Psn, Psn) {
        let first = *npsn;
        let mut last = *npsn;
        for &(op, read_len) in opcodes {
            last = *npsn;
            *npsn = next_psn(*npsn, op, read_len, PMTU);
        }
        (first, last)
    }
    let message = |first: Opcode, middle: Opcode, last: Opcode, packets: u32| {
        let mut ops = vec![(first, 0)];
        ops.extend(std::iter::repeat_n((middle, 0), packets as usize - 2));
        ops.push((last, 0));
        ops
    };

    // WQE 0: a Send of 5 packets (4 full + a partial last one): PSNs 201..=205.
    let len0 = 4 * 1024 + 100;
    assert_eq!(packets_for(len0, PMTU), 5);
    let ops = message(Opcode::SendFirst, Opcode::SendMiddle, Opcode::SendLast, 5);
    assert_eq!(send(&mut npsn, &ops), (Psn::new(201), Psn::new(205)));

    // WQE 1: a Send of 52 packets: 206..=257.
    assert_eq!(packets_for(51 * 1024 + 1, PMTU), 52);
    let ops = message(Opcode::SendFirst, Opcode::SendMiddle, Opcode::SendLast, 52);
    assert_eq!(send(&mut npsn, &ops), (Psn::new(206), Psn::new(257)));

    // WQE 2: an RDMA Write of 9 packets: 258..=266.
    assert_eq!(packets_for(9 * 1024, PMTU), 9);
    let ops = message(
        Opcode::RdmaWriteFirst,
        Opcode::RdmaWriteMiddle,
        Opcode::RdmaWriteLast,
        9,
    );
    assert_eq!(send(&mut npsn, &ops), (Psn::new(258), Psn::new(266)));

    // WQE 3: an RDMA Read answered by 6 responses (267..=272): one request at 267, nPSN 273.
    let read_len = 5 * 1024 + 512;
    assert_eq!(read_response_packets(read_len, PMTU), 6);
    assert_eq!(
        send(&mut npsn, &[(Opcode::RdmaReadRequest, read_len)]),
        (Psn::new(267), Psn::new(267))
    );
    assert_eq!(npsn, Psn::new(273));

    // WQE 4: a Send Only at 273; WQE 5: a Compare & Swap at 274; nPSN then 275.
    assert_eq!(
        send(&mut npsn, &[(Opcode::SendOnly, 0)]),
        (Psn::new(273), Psn::new(273))
    );
    assert_eq!(
        send(&mut npsn, &[(Opcode::CompareSwap, 0)]),
        (Psn::new(274), Psn::new(274))
    );
    assert_eq!(npsn, Psn::new(275));
}

/// The same walkthrough shifted to straddle the wrap: every PSN is (spec value - 201 +
/// 0xFFFFFD) mod 2^24, so the 5-packet Send wraps from 0xFFFFFF to 0.
#[test]
fn walkthrough_across_the_wrap() {
    let start = Psn::new(0xFF_FFFD);
    let mut npsn = start;
    for _ in 0..5 {
        npsn = next_psn(npsn, Opcode::SendMiddle, 0, 1024);
    }
    assert_eq!(npsn, Psn::new(2));
    assert_eq!(npsn.diff(start), 5);
    npsn = next_psn(npsn, Opcode::RdmaReadRequest, 6 * 1024, 1024);
    assert_eq!(npsn, Psn::new(8));
    assert!(start.before(npsn));
}
