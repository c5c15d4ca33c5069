//! Feeds arbitrary bytes to the receive path: a frame of 64-byte lines (a packet slot and
//! whatever lines follow it) as a peer would publish it, parsed by `RxPacket::parse`
//! against the frame's line count, and a payload copied by `dma::copy_payload` out of an
//! arbitrary peer arena into a scatter list (through the `shmhca::testing::receive_slot`
//! entry point).
//!
//! Checks, for every input: nothing panics, and no byte of the local buffer outside the
//! scatter list's ranges changes (`receive_slot` asserts it).
//!
//! Input layout: byte 0 = number of scatter elements n (0 = one range; at most 16), byte 1
//! = the frame's lines (1 + byte % 8: a packet takes at most 7), then 2·n bytes of element
//! lengths, then 64 bytes per line of the frame (a short input makes a shorter frame; a
//! partial last line reads as zero-padded), then the peer arena.
#![no_main]

use libfuzzer_sys::fuzz_target;

const LINE: usize = 64;

fuzz_target!(|data: &[u8]| {
    let [n, lines, rest @ ..] = data else {
        return;
    };
    let n = usize::from(n % 17);
    let lines = 1 + usize::from(lines % 8);
    let (lens, rest) = rest.split_at((2 * n).min(rest.len()));
    let split: Vec<u16> = lens
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    let (frame, arena) = rest.split_at((lines * LINE).min(rest.len()));
    let _ = shmhca::testing::receive_slot(frame, arena, &split);
});
