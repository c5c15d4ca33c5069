//! Entry points for fuzz targets, which live outside the crate. Not part of the API: no
//! stability, no use outside tests.

use crate::dma::{self, Cursor, Sgl};
use crate::mem::Mem;
use crate::wire::slot::{PacketSlot, RxPacket};
use crate::wqe::{DataLoc, NO_MR, SGE_ENTRY_LEN, SgeEntry};

/// The byte the local buffer is filled with before a copy.
const CANARY: u8 = 0xA5;
/// Where the destination ranges start in the local buffer, and the gap between two.
const DST_START: u64 = 1024;
const GAP: u64 = 16;

/// Receives one packet the way the RQ Logic and the completer do: `bytes` is a frame a
/// peer published (its 64-byte lines: a slot, then whatever lines follow it; a partial
/// last line reads as zero-padded, and only the first 16 lines are a frame), parsed with
/// `RxPacket::parse` against the frame's line count and every extended-header accessor,
/// then its payload is copied with
/// `dma::copy_payload` out of a peer arena holding `peer_arena` into a local buffer, over
/// one destination range (`split` empty) or one per element of `split` (lengths modulo
/// 1024, at most 16, with gaps between them).
///
/// Returns the bytes copied, or `None` if the packet or its payload was refused.
///
/// # Panics
/// Only if the receive path is wrong: a byte of the local buffer outside the destination
/// ranges changed, or more bytes were reported copied than the ranges hold.
pub fn receive_slot(bytes: &[u8], peer_arena: &[u8], split: &[u16]) -> Option<u64> {
    let slot_len = size_of::<PacketSlot>();
    let lines = bytes
        .len()
        .div_ceil(slot_len)
        .clamp(1, shmhca_rings::lines::MAX_FRAME_LINES);
    let mut frame = vec![PacketSlot::default(); lines];
    for (i, line) in frame.iter_mut().enumerate() {
        let from = bytes.get(i * slot_len..).unwrap_or(&[]);
        let n = from.len().min(slot_len);
        bytemuck::bytes_of_mut(line)[..n].copy_from_slice(&from[..n]);
    }
    let pkt = RxPacket::parse(&frame[0], &frame[1..]).ok()?;
    let _ = (
        pkt.reth(),
        pkt.aeth(),
        pkt.atomic_eth(),
        pkt.atomic_orig(),
        pkt.imm(),
    );
    for i in 0..crate::wire::slot::MAX_GATHER {
        let _ = pkt.gather_entry(i);
    }

    let peer = Mem::private(peer_arena.len());
    peer.write(0, peer_arena).ok()?;
    let local = Mem::private(64 << 10);
    local.write(0, &vec![CANARY; local.len()]).ok()?;
    let tables = Mem::private(4096);
    let mut ranges = Vec::new();
    let mut at = DST_START;
    let loc = if split.is_empty() {
        ranges.push((at, 16 << 10));
        DataLoc::Single(SgeEntry {
            off: at,
            len: 16 << 10,
            mr: NO_MR,
        })
    } else {
        for (i, &l) in split.iter().take(16).enumerate() {
            let e = SgeEntry {
                off: at,
                len: u32::from(l % 1024),
                mr: NO_MR,
            };
            tables.write(i as u64 * SGE_ENTRY_LEN, &e.to_bytes()).ok()?;
            ranges.push((e.off, u64::from(e.len)));
            at += u64::from(e.len) + GAP;
        }
        DataLoc::Table {
            table: 0,
            n: ranges.len() as u32,
        }
    };
    let mut cursor = Cursor::default();
    let r = dma::copy_payload(
        &pkt,
        &peer,
        &crate::user_mem::Local::arena_only(&local),
        Sgl::new(&loc, &tables),
        &mut cursor,
    );

    let mut after = vec![0u8; local.len()];
    local.read(0, &mut after).ok()?;
    let mut inside = vec![false; after.len()];
    for &(off, len) in &ranges {
        inside[off as usize..(off + len) as usize].fill(true);
    }
    for (i, (&b, &dst)) in after.iter().zip(&inside).enumerate() {
        assert!(
            dst || b == CANARY,
            "byte {i} outside the destination was written"
        );
    }
    let room: u64 = ranges.iter().map(|r| r.1).sum();
    if let Ok(n) = r {
        assert!(
            n <= room,
            "{n} bytes copied into {room} bytes of destination"
        );
    }
    r.ok()
}

/// The engine token over a loom-checked counter, for `loom-tests/tests/token.rs`.
#[cfg(shmhca_loom)]
pub use crate::engine::cell::LoomToken;

/// Held while a test binds UDP port 4791 (RoCEv2's) on this host's own addresses outside a
/// network namespace of its own: one such test at a time on the machine, across test
/// binaries and across concurrent `cargo test` runs of different checkouts, which would
/// otherwise fail on each other's port ("address in use"). A test that makes its own
/// namespaces needs none. Released when dropped (or when the process dies: the kernel
/// drops an `flock`).
#[derive(Debug)]
pub struct PortLock {
    _file: Option<std::fs::File>,
}

/// Waits for [`PortLock`]: an exclusive `flock(2)` on `shmhca-tests-udp-4791.lock` in the
/// temporary directory, created if missing (never truncated or removed). If the file
/// cannot be opened (another user's, say), or another process holds the lock for more
/// than [`PORT_LOCK_WAIT`] (a hung run), the test goes on without it, saying so in one
/// line.
pub fn udp_4791_lock() -> PortLock {
    let path = std::env::temp_dir().join("shmhca-tests-udp-4791.lock");
    lock_file(&path, PORT_LOCK_WAIT)
}

/// [`udp_4791_lock`] on the file at `path`, waiting at most `wait`.
fn lock_file(path: &std::path::Path, wait: std::time::Duration) -> PortLock {
    let Ok(file) = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
    else {
        return PortLock { _file: None };
    };
    let deadline = std::time::Instant::now() + wait;
    loop {
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return PortLock { _file: Some(file) },
            Err(rustix::io::Errno::WOULDBLOCK | rustix::io::Errno::INTR)
                if std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => {
                eprintln!(
                    "shmhca tests: going on without {} ({e}): another run may hold UDP 4791",
                    path.display()
                );
                return PortLock { _file: None };
            }
        }
    }
}

/// How long [`udp_4791_lock`] waits for another process's test to release the lock.
pub const PORT_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// The lock excludes another holder (another open of the file: another process, or this
    /// one), a waiter gives up after its wait with no lock, and a drop releases it.
    #[test]
    fn the_port_lock_excludes_times_out_and_is_released() {
        let path =
            std::env::temp_dir().join(format!("shmhca-port-lock-test-{}", std::process::id()));
        let first = lock_file(&path, Duration::from_secs(5));
        assert!(first._file.is_some());
        let t = Instant::now();
        let second = lock_file(&path, Duration::from_millis(100));
        assert!(second._file.is_none(), "held twice");
        assert!(t.elapsed() >= Duration::from_millis(100), "it waited");
        drop(first);
        assert!(lock_file(&path, Duration::from_secs(5))._file.is_some());
        let _ = std::fs::remove_file(&path); // this test's own file
    }
}
