//! The engine's "DMA": moving payload between a packet and scatter/gather lists.
//!
//! Receiving: [`copy_payload`] copies a packet's payload — inline in the slot, or straight
//! out of the peer's read-only arena — into a [`Cursor`] over a scatter list in this
//! process's arena. Each payload byte is copied exactly once, as a DMA engine would.
//!
//! Sending: [`Cursor`] also walks a gather list, and [`describe`] turns "the next `len`
//! bytes" into what a [`PacketSlot`] carries: the bytes themselves when they fit in the
//! slot, otherwise a reference into this process's arena (one range, or a gather table).

use crate::link::{KIND_DIRECT, KIND_GATHER, KIND_INLINE, PacketSlot, Payload};
use crate::mem::Mem;
use crate::wqe::{DataLoc, SGE_ENTRY_LEN, SgeEntry};

/// A position in a scatter/gather list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Cursor {
    /// Entry index.
    pub(crate) idx: u32,
    /// Bytes already consumed of that entry.
    pub(crate) skip: u64,
}

/// Why a copy stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyError {
    /// The destination list is shorter than the payload: a local length error.
    DestinationFull,
    /// The peer named memory outside its arena, or a malformed gather table.
    BadSource,
    /// A local table or range is unreadable (cannot happen for lists this process wrote).
    BadDestination,
}

impl Cursor {
    /// Moves forward `n` bytes through `loc` (entries read from `mem`). Returns false if the
    /// list ends first.
    pub(crate) fn advance(&mut self, loc: &DataLoc, mem: &Mem, mut n: u64) -> bool {
        while n > 0 {
            let Some(e) = loc.entry(mem, self.idx) else {
                return false;
            };
            let left = u64::from(e.len) - self.skip.min(u64::from(e.len));
            if n < left {
                self.skip += n;
                return true;
            }
            n -= left;
            self.idx += 1;
            self.skip = 0;
        }
        true
    }

    /// The cursor `pos` bytes into `loc`.
    pub(crate) fn at(loc: &DataLoc, mem: &Mem, pos: u64) -> Option<Cursor> {
        let mut c = Cursor::default();
        c.advance(loc, mem, pos).then_some(c)
    }

    /// The next contiguous piece of at most `max` bytes at the cursor, without moving.
    fn piece(&self, loc: &DataLoc, mem: &Mem, max: u64) -> Option<(u64, u64)> {
        let mut c = *self;
        loop {
            let e = loc.entry(mem, c.idx)?;
            let len = u64::from(e.len);
            if c.skip < len {
                return Some((e.off.checked_add(c.skip)?, (len - c.skip).min(max)));
            }
            c.idx += 1;
            c.skip = 0;
        }
    }
}

/// Copies `payload` of the packet in `slot` into the scatter list `dst` of `local`, starting
/// at `cursor`, which advances. `peer` is the sender's arena.
///
/// Returns the bytes copied. On [`CopyError::DestinationFull`] the bytes that fit have been
/// written — never a byte outside the list.
pub(crate) fn copy_payload(
    slot: &PacketSlot,
    payload: &Payload,
    peer: &Mem,
    local: &Mem,
    dst: &DataLoc,
    cursor: &mut Cursor,
) -> Result<u64, CopyError> {
    // The common case: a payload that fits in the rest of a single destination range.
    if let DataLoc::Single(e) = *dst {
        let n = u64::from(payload.len());
        if cursor.idx == 0 && cursor.skip + n <= u64::from(e.len) {
            let at = e.off + cursor.skip;
            match *payload {
                Payload::None => return Ok(0),
                Payload::Inline { start, len } => {
                    let bytes = slot
                        .data
                        .get(start..start + len)
                        .ok_or(CopyError::BadSource)?;
                    local
                        .write(at, bytes)
                        .map_err(|_| CopyError::BadDestination)?;
                }
                Payload::Direct { off, len } => {
                    peer.check(off, u64::from(len))
                        .map_err(|_| CopyError::BadSource)?;
                    Mem::copy(peer, off, local, at, u64::from(len))
                        .map_err(|_| CopyError::BadDestination)?;
                }
                Payload::Gather { .. } => {
                    return copy_general(slot, payload, peer, local, dst, cursor);
                }
            }
            cursor.skip += n;
            return Ok(n);
        }
    }
    copy_general(slot, payload, peer, local, dst, cursor)
}

fn copy_general(
    slot: &PacketSlot,
    payload: &Payload,
    peer: &Mem,
    local: &Mem,
    dst: &DataLoc,
    cursor: &mut Cursor,
) -> Result<u64, CopyError> {
    match *payload {
        Payload::None => Ok(0),
        Payload::Inline { start, len } => {
            let bytes = slot
                .data
                .get(start..start + len)
                .ok_or(CopyError::BadSource)?;
            write_bytes(bytes, local, dst, cursor)
        }
        Payload::Direct { off, len } => copy_range(peer, off, u64::from(len), local, dst, cursor),
        Payload::Gather {
            table,
            count,
            skip,
            len,
        } => {
            let mut left = u64::from(len);
            let mut skip = u64::from(skip);
            let mut copied = 0;
            for i in 0..u32::from(count) {
                if left == 0 {
                    break;
                }
                let e = SgeEntry::read(peer, table, i).ok_or(CopyError::BadSource)?;
                let avail = u64::from(e.len)
                    .checked_sub(skip)
                    .ok_or(CopyError::BadSource)?;
                let off = e.off.checked_add(skip).ok_or(CopyError::BadSource)?;
                skip = 0;
                let n = avail.min(left);
                copied += copy_range(peer, off, n, local, dst, cursor)?;
                left -= n;
            }
            if left != 0 {
                return Err(CopyError::BadSource);
            }
            Ok(copied)
        }
    }
}

fn write_bytes(
    mut bytes: &[u8],
    local: &Mem,
    dst: &DataLoc,
    cursor: &mut Cursor,
) -> Result<u64, CopyError> {
    let total = bytes.len() as u64;
    while !bytes.is_empty() {
        let (off, n) = cursor
            .piece(dst, local, bytes.len() as u64)
            .ok_or(CopyError::DestinationFull)?;
        local
            .write(off, &bytes[..n as usize])
            .map_err(|_| CopyError::BadDestination)?;
        bytes = &bytes[n as usize..];
        cursor.advance(dst, local, n);
    }
    Ok(total)
}

fn copy_range(
    src: &Mem,
    mut off: u64,
    mut len: u64,
    local: &Mem,
    dst: &DataLoc,
    cursor: &mut Cursor,
) -> Result<u64, CopyError> {
    // Check the whole source range first, so a bad offset copies nothing.
    src.check(off, len).map_err(|_| CopyError::BadSource)?;
    let total = len;
    while len > 0 {
        let (d, n) = cursor
            .piece(dst, local, len)
            .ok_or(CopyError::DestinationFull)?;
        Mem::copy(src, off, local, d, n).map_err(|_| CopyError::BadDestination)?;
        off += n;
        len -= n;
        cursor.advance(dst, local, n);
    }
    Ok(total)
}

/// Fills the payload part of `slot` (whose `hdr_len` is set) with `len` bytes of the list
/// `loc` at `cursor` in this process's arena `local`: inline when they fit behind the
/// headers, else by reference. Returns the bytes copied into the slot (0 for references),
/// or `None` if the list is shorter than `len` (cannot happen for a validated WQE).
pub(crate) fn describe(
    slot: &mut PacketSlot,
    local: &Mem,
    loc: &DataLoc,
    cursor: Cursor,
    len: u32,
) -> Option<u64> {
    slot.payload_len = len;
    if len == 0 {
        return Some(0);
    }
    let hdr = slot.hdr_len as usize;
    let inline = len as usize <= PacketSlot::inline_room(hdr);
    if let DataLoc::Single(e) = *loc {
        // One contiguous range (one SGE or inline staging): the common case.
        if cursor.idx != 0 || cursor.skip + u64::from(len) > u64::from(e.len) {
            return None;
        }
        let off = e.off + cursor.skip;
        if inline {
            slot.kind = KIND_INLINE;
            local
                .read(off, &mut slot.data[hdr..hdr + len as usize])
                .ok()?;
            return Some(u64::from(len));
        }
        slot.kind = KIND_DIRECT;
        slot.payload_off = off;
        return Some(0);
    }
    if inline {
        slot.kind = KIND_INLINE;
        let mut c = cursor;
        let mut at = hdr;
        let end = hdr + len as usize;
        while at < end {
            let (off, n) = c.piece(loc, local, (end - at) as u64)?;
            local.read(off, &mut slot.data[at..at + n as usize]).ok()?;
            at += n as usize;
            c.advance(loc, local, n);
        }
        return Some(u64::from(len));
    }
    let (off, n) = cursor.piece(loc, local, u64::from(len))?;
    if n == u64::from(len) {
        slot.kind = KIND_DIRECT;
        slot.payload_off = off;
        return Some(0);
    }
    let DataLoc::Table { table, n: entries } = *loc else {
        return None;
    };
    slot.kind = KIND_GATHER;
    slot.payload_off = table + u64::from(cursor.idx) * SGE_ENTRY_LEN;
    slot.sge_count = u8::try_from(entries - cursor.idx).ok()?;
    slot.data[hdr..hdr + 4].copy_from_slice(&(cursor.skip as u32).to_le_bytes());
    Some(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wqe::NO_MR;

    fn table(mem: &Mem, at: u64, entries: &[(u64, u32)]) -> DataLoc {
        for (i, &(off, len)) in entries.iter().enumerate() {
            let e = SgeEntry {
                off,
                len,
                mr: NO_MR,
            };
            mem.write(at + i as u64 * SGE_ENTRY_LEN, &e.to_bytes())
                .unwrap();
        }
        DataLoc::Table {
            table: at,
            n: entries.len() as u32,
        }
    }

    fn fill(mem: &Mem, off: u64, len: usize, seed: u8) -> Vec<u8> {
        let v: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect();
        mem.write(off, &v).unwrap();
        v
    }

    #[test]
    fn cursor_walks_entries_and_skips_empty_ones() {
        let mem = Mem::heap(4096);
        let loc = table(&mem, 0, &[(1000, 10), (2000, 0), (3000, 5)]);
        let c = Cursor::at(&loc, &mem, 12).unwrap();
        assert_eq!(c.piece(&loc, &mem, 100), Some((3002, 3)));
        assert!(Cursor::at(&loc, &mem, 15).is_some());
        assert!(Cursor::at(&loc, &mem, 16).is_none());
    }

    #[test]
    fn gathered_payload_lands_across_scattered_buffers() {
        // Sender arena: 3 gather pieces; receiver: 2 scatter pieces of other sizes.
        let peer = Mem::heap(8192);
        let local = Mem::heap(8192);
        let a = fill(&peer, 1000, 100, 1);
        let b = fill(&peer, 3000, 50, 2);
        let c = fill(&peer, 5000, 200, 3);
        let src = table(&peer, 0, &[(1000, 100), (3000, 50), (5000, 200)]);
        let dst = table(&local, 0, &[(4000, 120), (6000, 230)]);
        let expect: Vec<u8> = [a, b, c].concat();

        // The sender describes the payload in two packets of 150 and 200 bytes.
        let mut slot = PacketSlot {
            hdr_len: 12,
            ..PacketSlot::default()
        };
        let mut sc = Cursor::default();
        let mut rc = Cursor::default();
        for len in [150u32, 200] {
            let copied = describe(&mut slot, &peer, &src, sc, len).unwrap();
            assert_eq!(copied, 0, "large payloads go by reference");
            let p = match slot.kind {
                KIND_DIRECT => Payload::Direct {
                    off: slot.payload_off,
                    len,
                },
                KIND_GATHER => Payload::Gather {
                    table: slot.payload_off,
                    count: slot.sge_count,
                    skip: u32::from_le_bytes(slot.data[12..16].try_into().unwrap()),
                    len,
                },
                k => panic!("kind {k}"),
            };
            assert_eq!(
                copy_payload(&slot, &p, &peer, &local, &dst, &mut rc),
                Ok(u64::from(len))
            );
            sc.advance(&src, &peer, u64::from(len));
        }
        let mut got = vec![0u8; 350];
        local.read(4000, &mut got[..120]).unwrap();
        local.read(6000, &mut got[120..]).unwrap();
        assert_eq!(got, expect);
    }

    #[test]
    fn small_payloads_are_copied_into_the_slot() {
        let local = Mem::heap(4096);
        let v = fill(&local, 100, 40, 9);
        let src = table(&local, 0, &[(100, 30), (130, 10)]);
        let mut slot = PacketSlot {
            hdr_len: 12,
            ..PacketSlot::default()
        };
        assert_eq!(
            describe(&mut slot, &local, &src, Cursor::default(), 40),
            Some(40)
        );
        assert_eq!(slot.kind, KIND_INLINE);
        assert_eq!(&slot.data[12..52], &v[..]);
    }

    #[test]
    fn overflow_stops_at_the_end_of_the_receive_buffer() {
        let peer = Mem::heap(4096);
        let local = Mem::heap(4096);
        fill(&peer, 0, 300, 5);
        local.write(600, &[0xEE; 8]).unwrap();
        let dst = DataLoc::Single(SgeEntry {
            off: 500,
            len: 100,
            mr: NO_MR,
        });
        let mut c = Cursor::default();
        let r = copy_payload(
            &PacketSlot::default(),
            &Payload::Direct { off: 0, len: 300 },
            &peer,
            &local,
            &dst,
            &mut c,
        );
        assert_eq!(r, Err(CopyError::DestinationFull));
        let mut after = [0u8; 8];
        local.read(600, &mut after).unwrap();
        assert_eq!(after, [0xEE; 8], "nothing written past the buffer");
    }

    #[test]
    fn hostile_sources_are_refused_without_copying() {
        let peer = Mem::heap(1024);
        let local = Mem::heap(1024);
        let dst = DataLoc::Single(SgeEntry {
            off: 0,
            len: 1024,
            mr: NO_MR,
        });
        let slot = PacketSlot::default();
        for p in [
            Payload::Direct {
                off: 1000,
                len: 100,
            },
            Payload::Direct {
                off: u64::MAX - 10,
                len: 100,
            },
            Payload::Gather {
                table: 2000,
                count: 1,
                skip: 0,
                len: 10,
            },
        ] {
            let mut c = Cursor::default();
            assert_eq!(
                copy_payload(&slot, &p, &peer, &local, &dst, &mut c),
                Err(CopyError::BadSource),
                "{p:?}"
            );
            assert_eq!(c, Cursor::default());
        }
        // A gather table whose entries point outside the arena.
        let src = table(&peer, 0, &[(900, 200)]);
        let DataLoc::Table { table: t, .. } = src else {
            unreachable!()
        };
        let mut c = Cursor::default();
        assert_eq!(
            copy_payload(
                &slot,
                &Payload::Gather {
                    table: t,
                    count: 1,
                    skip: 0,
                    len: 200
                },
                &peer,
                &local,
                &dst,
                &mut c
            ),
            Err(CopyError::BadSource)
        );
        // A gather table shorter than the claimed length.
        let src = table(&peer, 0, &[(100, 10)]);
        let DataLoc::Table { table: t, .. } = src else {
            unreachable!()
        };
        assert_eq!(
            copy_payload(
                &slot,
                &Payload::Gather {
                    table: t,
                    count: 1,
                    skip: 0,
                    len: 20
                },
                &peer,
                &local,
                &dst,
                &mut Cursor::default()
            ),
            Err(CopyError::BadSource)
        );
    }
}
