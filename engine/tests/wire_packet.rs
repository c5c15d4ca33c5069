//! Whole-packet tests of the wire format: every RC opcode round-trips through
//! `PacketRepr::emit` / `PacketRepr::parse`, malformed input is rejected with the right
//! error, and (property tests) arbitrary bytes never make the parser panic.

use proptest::prelude::*;
use shmhca::psn::Psn;
use shmhca::wire::opcode::{Headers, Opcode};
use shmhca::wire::packet::{MAX_HEADER_LEN, PacketRepr};
use shmhca::wire::{
    AethRepr, AtomicAckEthRepr, AtomicEthRepr, BthRepr, Error, IethRepr, ImmDtRepr, Msn, NakCode,
    Qpn, RethRepr, Syndrome,
};

/// A repr for `op` with every header its table row lists, filled with distinctive values.
fn full_repr(op: Opcode) -> PacketRepr {
    let info = op.info().unwrap();
    let mut bth = BthRepr::new(op, Qpn::new(0xAB_CDEF), Psn::new(0xFF_FFFF));
    bth.solicited = info.request;
    bth.ack_req = true;
    bth.pkey = 0x8001;
    bth.pad_count = if info.payload { 3 } else { 0 };
    let mut r = PacketRepr::new(bth);
    let h = info.headers;
    if h.contains(Headers::RETH) {
        r.reth = Some(RethRepr {
            va: 0x1122_3344_5566_7788,
            rkey: 0x99AA_BBCC,
            dma_len: 0x8000_0000,
        });
    }
    if h.contains(Headers::ATOMIC_ETH) {
        r.atomic_eth = Some(AtomicEthRepr {
            va: 0x0000_7FFF_0000_0008,
            rkey: 7,
            swap_add: u64::MAX,
            compare: 1,
        });
    }
    if h.contains(Headers::AETH) {
        r.aeth = Some(AethRepr {
            syndrome: Syndrome::Nak(NakCode::RemoteOperationalError),
            msn: Msn::new(0xFF_FFFF),
        });
    }
    if h.contains(Headers::ATOMIC_ACK_ETH) {
        r.atomic_ack_eth = Some(AtomicAckEthRepr {
            orig: 0xDEAD_BEEF_0000_0001,
        });
    }
    if h.contains(Headers::IMMDT) {
        r.immdt = Some(ImmDtRepr { imm: 0x0102_0304 });
    }
    if h.contains(Headers::IETH) {
        r.ieth = Some(IethRepr { rkey: 0xFFFF_FFFF });
    }
    r
}

#[test]
fn every_opcode_round_trips() {
    for op in Opcode::ALL {
        let repr = full_repr(op);
        let info = op.info().unwrap();
        assert_eq!(repr.header_len(), info.header_len(), "{op:?}");
        let mut buf = [0u8; MAX_HEADER_LEN + 8];
        let n = repr.emit(&mut buf).unwrap();
        assert_eq!(n, repr.header_len());
        assert_eq!(buf[0], op.code());
        assert_eq!(PacketRepr::parse(&buf[..n]), Ok((repr, n)), "{op:?}");
        // Trailing payload bytes do not change the parse.
        assert_eq!(PacketRepr::parse(&buf), Ok((repr, n)), "{op:?}");
    }
}

#[test]
fn write_only_with_immediate_is_bit_exact() {
    // BTH: 0x0B, SE|PadCnt=1, P_Key 0xFFFF, DestQP 0x000011, AckReq, PSN 258.
    // RETH: VA 0x1000, R_Key 0x42, length 3. ImmDt 0xAABBCCDD.
    let bytes: [u8; 32] = [
        0x0B, 0x90, 0xFF, 0xFF, 0x00, 0x00, 0x00, 0x11, 0x80, 0x00, 0x01, 0x02, // BTH
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x42, 0x00, 0x00, 0x00,
        0x03, // RETH
        0xAA, 0xBB, 0xCC, 0xDD, // ImmDt
    ];
    let mut bth = BthRepr::new(
        Opcode::RdmaWriteOnlyWithImmediate,
        Qpn::new(0x11),
        Psn::new(258),
    );
    bth.solicited = true;
    bth.pad_count = 1;
    bth.ack_req = true;
    let repr = PacketRepr {
        reth: Some(RethRepr {
            va: 0x1000,
            rkey: 0x42,
            dma_len: 3,
        }),
        immdt: Some(ImmDtRepr { imm: 0xAABB_CCDD }),
        ..PacketRepr::new(bth)
    };
    assert_eq!(PacketRepr::parse(&bytes), Ok((repr, 32)));
    let mut out = [0u8; 32];
    assert_eq!(repr.emit(&mut out), Ok(32));
    assert_eq!(out, bytes);
}

#[test]
fn truncation_at_every_boundary_is_rejected() {
    for op in Opcode::ALL {
        let repr = full_repr(op);
        let mut buf = [0u8; MAX_HEADER_LEN];
        let n = repr.emit(&mut buf).unwrap();
        for len in 0..n {
            assert_eq!(
                PacketRepr::parse(&buf[..len]),
                Err(Error::Truncated),
                "{op:?} at {len}"
            );
            assert_eq!(
                repr.emit(&mut [0u8; MAX_HEADER_LEN][..len]),
                Err(Error::Truncated)
            );
        }
    }
}

#[test]
fn unknown_and_non_rc_opcodes_are_rejected() {
    let mut bytes = [0u8; MAX_HEADER_LEN];
    for code in (0..=u8::MAX).filter(|c| !matches!(c, 0x00..=0x14 | 0x16 | 0x17)) {
        bytes[0] = code;
        assert_eq!(PacketRepr::parse(&bytes), Err(Error::UnknownOpcode(code)));
    }
}

#[test]
fn pad_count_without_payload_is_rejected() {
    for op in Opcode::ALL
        .into_iter()
        .filter(|op| !op.info().unwrap().payload)
    {
        let mut buf = [0u8; MAX_HEADER_LEN];
        let n = full_repr(op).emit(&mut buf).unwrap();
        for pad in 1..=3u8 {
            buf[1] = (buf[1] & !0x30) | (pad << 4);
            assert_eq!(
                PacketRepr::parse(&buf[..n]),
                Err(Error::PadWithoutPayload {
                    opcode: op,
                    pad_count: pad
                })
            );
        }
    }
}

#[test]
fn nonzero_transport_version_is_rejected() {
    let mut buf = [0u8; MAX_HEADER_LEN];
    let n = full_repr(Opcode::SendOnly).emit(&mut buf).unwrap();
    for tver in 1..16u8 {
        buf[1] = (buf[1] & 0xF0) | tver;
        assert_eq!(
            PacketRepr::parse(&buf[..n]),
            Err(Error::UnsupportedVersion(tver))
        );
    }
    let mut repr = full_repr(Opcode::SendOnly);
    repr.bth.tver = 2;
    assert_eq!(repr.emit(&mut buf), Err(Error::UnsupportedVersion(2)));
}

#[test]
fn emit_rejects_headers_the_opcode_does_not_list() {
    let mut repr = full_repr(Opcode::SendFirst);
    repr.immdt = Some(ImmDtRepr { imm: 1 });
    let mut buf = [0u8; MAX_HEADER_LEN];
    assert_eq!(
        repr.emit(&mut buf),
        Err(Error::HeadersMismatch {
            opcode: Opcode::SendFirst,
            expected: Headers::NONE,
            found: Headers::IMMDT
        })
    );
    let mut repr = full_repr(Opcode::SendFirst);
    repr.bth.pad_count = 4;
    assert!(matches!(repr.emit(&mut buf), Err(Error::Malformed(_))));
}

fn arb_syndrome() -> impl Strategy<Value = Syndrome> {
    any::<u8>().prop_map(Syndrome::from_u8)
}

prop_compose! {
    fn arb_repr()(
        op in proptest::sample::select(Opcode::ALL.to_vec()),
        solicited in any::<bool>(), mig_req in any::<bool>(), pad in 0u8..=3,
        pkey in any::<u16>(), qpn in any::<u32>(), ack_req in any::<bool>(), psn in any::<u32>(),
        reth in any::<(u64, u32, u32)>(),
        atomic in any::<(u64, u32, u64, u64)>(),
        syndrome in arb_syndrome(), msn in any::<u32>(),
        orig in any::<u64>(), imm in any::<u32>(), inv in any::<u32>(),
    ) -> PacketRepr {
        let info = op.info().unwrap();
        let h = info.headers;
        PacketRepr {
            bth: BthRepr {
                opcode: op, solicited, mig_req,
                pad_count: if info.payload { pad } else { 0 },
                tver: 0, pkey, dest_qp: Qpn::new(qpn), ack_req, psn: Psn::new(psn),
            },
            reth: h.contains(Headers::RETH)
                .then_some(RethRepr { va: reth.0, rkey: reth.1, dma_len: reth.2 }),
            atomic_eth: h.contains(Headers::ATOMIC_ETH).then_some(AtomicEthRepr {
                va: atomic.0, rkey: atomic.1, swap_add: atomic.2, compare: atomic.3,
            }),
            aeth: h.contains(Headers::AETH).then_some(AethRepr { syndrome, msn: Msn::new(msn) }),
            atomic_ack_eth: h.contains(Headers::ATOMIC_ACK_ETH)
                .then_some(AtomicAckEthRepr { orig }),
            immdt: h.contains(Headers::IMMDT).then_some(ImmDtRepr { imm }),
            ieth: h.contains(Headers::IETH).then_some(IethRepr { rkey: inv }),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        if let Ok((repr, len)) = PacketRepr::parse(&bytes) {
            prop_assert!(len <= bytes.len());
            prop_assert_eq!(len, repr.header_len());
            let mut out = [0u8; MAX_HEADER_LEN];
            prop_assert_eq!(repr.emit(&mut out), Ok(len));
            prop_assert_eq!(PacketRepr::parse(&out[..len]), Ok((repr, len)));
        }
    }

    /// Arbitrary bytes behind a valid opcode byte reach the extended-header parsers.
    #[test]
    fn parse_never_panics_on_rc_opcodes(
        op in proptest::sample::select(Opcode::ALL.to_vec()),
        mut bytes in proptest::collection::vec(any::<u8>(), 1..48),
    ) {
        bytes[0] = op.code();
        match PacketRepr::parse(&bytes) {
            Ok((repr, len)) => {
                prop_assert_eq!(repr.bth.opcode, op);
                prop_assert_eq!(len, op.info().unwrap().header_len());
            }
            Err(e) => {
                let expected = matches!(
                    e,
                    Error::Truncated
                        | Error::UnsupportedVersion(_)
                        | Error::PadWithoutPayload { .. }
                );
                prop_assert!(expected, "unexpected error {:?}", e);
            }
        }
    }

    #[test]
    fn emit_then_parse_is_identity(repr in arb_repr(), slack in 0usize..8) {
        let mut buf = vec![0u8; repr.header_len() + slack];
        let n = repr.emit(&mut buf).unwrap();
        prop_assert_eq!(n, repr.header_len());
        prop_assert_eq!(PacketRepr::parse(&buf), Ok((repr, n)));
    }
}
