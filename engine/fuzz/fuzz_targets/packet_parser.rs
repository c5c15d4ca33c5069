//! Feeds arbitrary bytes to the RC transport header parser.
//!
//! Checks, for every input: nothing panics; a successful `PacketRepr::parse` reports a
//! header length inside the input that matches the opcode table; emitting the parsed repr
//! writes exactly that many bytes and parsing them gives the same repr back; each header
//! view's accessors can be called after `new_checked` succeeds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shmhca::wire::packet::{MAX_HEADER_LEN, PacketRepr};
use shmhca::wire::{aeth, atomic_ack_eth, atomic_eth, bth, ieth, immdt, reth};

fuzz_target!(|data: &[u8]| {
    if let Ok((repr, len)) = PacketRepr::parse(data) {
        assert!(len <= data.len());
        assert!(len <= MAX_HEADER_LEN);
        assert_eq!(len, repr.header_len());
        let info = repr.info().expect("a parsed packet has an RC opcode");
        assert_eq!(len, info.header_len());
        assert_eq!(repr.headers(), info.headers);

        let mut out = [0u8; MAX_HEADER_LEN];
        assert_eq!(repr.emit(&mut out), Ok(len));
        assert_eq!(PacketRepr::parse(&out[..len]), Ok((repr, len)));
        // Emitting zeroes the reserved bits: the output equals the input but for those.
        assert_eq!(out[..4], data[..4]);
        assert_eq!(out[5..8], data[5..8]);
        assert_eq!(out[8], data[8] & 0x80);
        assert_eq!(out[9..len], data[9..len]);
        let _ = repr.data_len(data.len() - len);
    }

    // The header views: after new_checked, no accessor panics.
    if let Ok(p) = bth::Packet::new_checked(data) {
        let _ = (
            p.opcode(),
            p.solicited(),
            p.mig_req(),
            p.pad_count(),
            p.tver(),
        );
        let _ = (
            p.pkey(),
            p.resv8a(),
            p.dest_qp(),
            p.ack_req(),
            p.psn(),
            p.payload(),
        );
    }
    if let Ok(p) = reth::Packet::new_checked(data) {
        let _ = (p.va(), p.rkey(), p.dma_len());
    }
    if let Ok(p) = aeth::Packet::new_checked(data) {
        let s = p.syndrome();
        assert_eq!(s.to_u8(), data[0]);
        let _ = p.msn();
    }
    if let Ok(p) = atomic_eth::Packet::new_checked(data) {
        let _ = (p.va(), p.rkey(), p.swap_add(), p.compare());
    }
    if let Ok(p) = atomic_ack_eth::Packet::new_checked(data) {
        let _ = p.orig();
    }
    if let Ok(p) = immdt::Packet::new_checked(data) {
        let _ = p.imm();
    }
    if let Ok(p) = ieth::Packet::new_checked(data) {
        let _ = p.rkey();
    }
});
