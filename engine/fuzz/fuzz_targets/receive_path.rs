//! Feeds arbitrary bytes to the receive path: a packet slot and its continuation slots as a
//! peer would publish them, parsed by `RxPacket::parse`, and a payload copied by
//! `dma::copy_payload` out of an arbitrary peer arena into a scatter list (through the
//! `shmhca::testing::receive_slot` entry point).
//!
//! Checks, for every input: nothing panics, and no byte of the local buffer outside the
//! scatter list's ranges changes (`receive_slot` asserts it).
//!
//! Input layout: byte 0 = number of scatter elements n (0 = one range; at most 16), then
//! 2·n bytes of element lengths, then 3 · 128 bytes of slot and continuation slots (missing
//! bytes read as zero), then the peer arena.
#![no_main]

use libfuzzer_sys::fuzz_target;

const SLOTS: usize = 3 * 128;

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n % 17);
    let (lens, rest) = rest.split_at((2 * n).min(rest.len()));
    let split: Vec<u16> = lens
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    let (slots, arena) = rest.split_at(SLOTS.min(rest.len()));
    let _ = shmhca::testing::receive_slot(slots, arena, &split);
});
