//! The engine's "DMA": moving payload between a packet and scatter/gather lists.
//!
//! Receiving: [`copy_payload`] copies a packet's payload — inline in the slot, or straight
//! out of the peer's read-only arena — into a [`Cursor`] over a scatter list in this
//! process's arena or in a buffer the application registered (see [`Local`]). Each payload byte is copied exactly once, as a DMA engine would.
//!
//! Sending: [`Cursor`] also walks a gather list, and [`describe`] turns "the next `len`
//! bytes" into what a [`PacketSlot`] carries: the bytes themselves when they fit in the
//! slot, otherwise a reference into this process's arena (one range, or a gather list
//! written into the continuation slots that travel behind the packet).
//!
//! A list ([`Sgl`]) is a [`DataLoc`] plus the QP's private table memory its multi-element
//! lists are written in; the offsets in its entries are offsets in the QP's arena.

use crate::mem::Mem;
use crate::user_mem::Local;
use crate::wire::slot::{
    KIND_DIRECT, KIND_GATHER, KIND_INLINE, PacketSlot, Payload, RxPacket, set_gather_entry,
};
use crate::wqe::{DataLoc, SgeEntry};

/// A scatter/gather list: where it is, and the private memory its table (if any) is in.
#[derive(Clone, Copy)]
pub(crate) struct Sgl<'a> {
    pub(crate) loc: &'a DataLoc,
    pub(crate) tables: &'a Mem,
}

impl<'a> Sgl<'a> {
    /// The list `loc`, whose table (if any) is in `tables`.
    pub(crate) fn new(loc: &'a DataLoc, tables: &'a Mem) -> Sgl<'a> {
        Sgl { loc, tables }
    }

    /// Entry `i`.
    #[inline]
    fn entry(&self, i: u32) -> Option<SgeEntry> {
        self.loc.entry(self.tables, i)
    }
}

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
    /// The peer named memory outside its arena, or a malformed gather list.
    BadSource,
    /// A local table or range is unreadable (cannot happen for lists this process wrote).
    BadDestination,
}

impl Cursor {
    /// Moves forward `n` bytes through `sgl`. Returns false if the list ends first.
    pub(crate) fn advance(&mut self, sgl: Sgl<'_>, mut n: u64) -> bool {
        while n > 0 {
            let Some(e) = sgl.entry(self.idx) else {
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

    /// The cursor `pos` bytes into `sgl`.
    pub(crate) fn at(sgl: Sgl<'_>, pos: u64) -> Option<Cursor> {
        let mut c = Cursor::default();
        c.advance(sgl, pos).then_some(c)
    }

    /// The next contiguous piece of at most `max` bytes at the cursor, without moving.
    fn piece(&self, sgl: Sgl<'_>, max: u64) -> Option<(u64, u64)> {
        let mut c = *self;
        loop {
            let e = sgl.entry(c.idx)?;
            let len = u64::from(e.len);
            if c.skip < len {
                return Some((e.off.checked_add(c.skip)?, (len - c.skip).min(max)));
            }
            c.idx += 1;
            c.skip = 0;
        }
    }
}

/// Copies the payload of `pkt` into the scatter list `dst` (in `local`, this process's
/// arena), starting at `cursor`, which advances. `peer` is the arena the sender's payload
/// references point into.
///
/// Returns the bytes copied. On [`CopyError::DestinationFull`] the bytes that fit have been
/// written — never a byte outside the list.
#[inline(always)]
pub(crate) fn copy_payload(
    pkt: &RxPacket<'_>,
    peer: &Mem,
    local: &Local<'_>,
    dst: Sgl<'_>,
    cursor: &mut Cursor,
) -> Result<u64, CopyError> {
    let payload = pkt.payload;
    // The common case: a payload that fits in the rest of a single destination range.
    if let DataLoc::Single(e) = *dst.loc {
        let n = u64::from(payload.len());
        if cursor.idx == 0 && cursor.skip + n <= u64::from(e.len) {
            let at = e.off + cursor.skip;
            match payload {
                Payload::None => return Ok(0),
                Payload::Inline { start, len } => {
                    let bytes = pkt
                        .slot()
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
                    local
                        .copy_from(peer, off, at, u64::from(len))
                        .map_err(|_| CopyError::BadDestination)?;
                }
                Payload::Gather { .. } => {
                    return copy_general(pkt, peer, local, dst, cursor);
                }
            }
            cursor.skip += n;
            return Ok(n);
        }
    }
    copy_general(pkt, peer, local, dst, cursor)
}

#[inline(never)]
fn copy_general(
    pkt: &RxPacket<'_>,
    peer: &Mem,
    local: &Local<'_>,
    dst: Sgl<'_>,
    cursor: &mut Cursor,
) -> Result<u64, CopyError> {
    match pkt.payload {
        Payload::None => Ok(0),
        Payload::Inline { start, len } => {
            let bytes = pkt
                .slot()
                .data
                .get(start..start + len)
                .ok_or(CopyError::BadSource)?;
            write_bytes(bytes, local, dst, cursor)
        }
        Payload::Direct { off, len } => copy_range(peer, off, u64::from(len), local, dst, cursor),
        Payload::Gather { .. } => {
            let (pieces, n) = gather_pieces(pkt, peer)?;
            let mut copied = 0;
            for &(off, take) in &pieces[..n] {
                copied += copy_range(peer, off, take, local, dst, cursor)?;
            }
            Ok(copied)
        }
    }
}

/// The ranges of the peer's arena a gather payload names, each checked, before anything
/// is copied (so a bad entry copies nothing); and how many there are.
#[allow(clippy::type_complexity)]
fn gather_pieces(
    pkt: &RxPacket<'_>,
    peer: &Mem,
) -> Result<([(u64, u64); crate::wire::slot::MAX_GATHER], usize), CopyError> {
    let Payload::Gather { count, skip, len } = pkt.payload else {
        return Err(CopyError::BadSource);
    };
    let mut left = u64::from(len);
    let mut skip = u64::from(skip);
    let mut pieces = [(0u64, 0u64); crate::wire::slot::MAX_GATHER];
    let mut n = 0;
    for i in 0..usize::from(count) {
        if left == 0 {
            break;
        }
        let (off, elen) = pkt.gather_entry(i).ok_or(CopyError::BadSource)?;
        let avail = u64::from(elen)
            .checked_sub(skip)
            .ok_or(CopyError::BadSource)?;
        let off = off.checked_add(skip).ok_or(CopyError::BadSource)?;
        skip = 0;
        let take = avail.min(left);
        peer.check(off, take).map_err(|_| CopyError::BadSource)?;
        *pieces.get_mut(n).ok_or(CopyError::BadSource)? = (off, take);
        n += 1;
        left -= take;
    }
    if left != 0 {
        return Err(CopyError::BadSource);
    }
    Ok((pieces, n))
}

/// Bytes at the end of an RDMA Write's last packet stored after the rest of it
/// ([`copy_write_payload`]).
pub(crate) const LAST_BYTES: u64 = 8;

/// Puts `len` bytes as the calls `put(pos, n)`, in order: all but the last [`LAST_BYTES`],
/// then `fence()`, then those (a payload of at most `LAST_BYTES` is all "last").
#[inline(always)]
fn last_bytes_last<E>(
    len: u64,
    mut put: impl FnMut(u64, u64) -> Result<(), E>,
    fence: impl FnOnce(),
) -> Result<(), E> {
    let body = len.saturating_sub(LAST_BYTES);
    if body > 0 {
        put(0, body)?;
    }
    fence();
    if len > body {
        put(body, len - body)?;
    }
    Ok(())
}

/// Copies the payload of an RDMA Write packet `pkt` to the contiguous local range at `at`
/// (checked against the R_Key for the payload's length), the last [`LAST_BYTES`] bytes
/// after all the others, behind a release fence: a program that polls the last byte of its
/// buffer for a Write's arrival (perftest's `ib_write_lat`, FaRM-style code) and sees it
/// sees the whole message. Called for every packet of a Write: the earlier packets were
/// copied by earlier calls, before the last one's fence. Returns the bytes copied.
pub(crate) fn copy_write_payload(
    pkt: &RxPacket<'_>,
    peer: &Mem,
    local: &Local<'_>,
    at: u64,
) -> Result<u64, CopyError> {
    // SYNC POINT: the release fence orders every store of the message before the stores
    // of its last bytes, which a poller reads to learn that the message is there.
    let fence = || std::sync::atomic::fence(crate::sync::Ordering::Release);
    let bad_dst = |_| CopyError::BadDestination;
    match pkt.payload {
        Payload::None => Ok(0),
        Payload::Inline { start, len } => {
            let bytes = pkt
                .slot()
                .data
                .get(start..start + len)
                .ok_or(CopyError::BadSource)?;
            last_bytes_last(
                len as u64,
                |pos, n| {
                    let b = &bytes[pos as usize..(pos + n) as usize];
                    local.write(at + pos, b).map_err(bad_dst)
                },
                fence,
            )?;
            Ok(len as u64)
        }
        Payload::Direct { off, len } => {
            let len = u64::from(len);
            peer.check(off, len).map_err(|_| CopyError::BadSource)?;
            last_bytes_last(
                len,
                |pos, n| {
                    local
                        .copy_from(peer, off + pos, at + pos, n)
                        .map_err(bad_dst)
                },
                fence,
            )?;
            Ok(len)
        }
        Payload::Gather { len, .. } => {
            let (pieces, count) = gather_pieces(pkt, peer)?;
            let pieces = &pieces[..count];
            last_bytes_last(
                u64::from(len),
                |pos, n| copy_span(peer, pieces, pos, n, local, at),
                fence,
            )?;
            Ok(u64::from(len))
        }
    }
}

/// Copies bytes `pos..pos + n` of the message the source `pieces` make up to `at + pos`
/// onwards.
fn copy_span(
    peer: &Mem,
    pieces: &[(u64, u64)],
    pos: u64,
    n: u64,
    local: &Local<'_>,
    at: u64,
) -> Result<(), CopyError> {
    let (from, to) = (pos, pos + n);
    let mut start = 0;
    for &(off, len) in pieces {
        let end = start + len;
        let (a, b) = (from.max(start), to.min(end));
        if a < b {
            local
                .copy_from(peer, off + (a - start), at + a, b - a)
                .map_err(|_| CopyError::BadDestination)?;
        }
        start = end;
    }
    Ok(())
}

fn write_bytes(
    mut bytes: &[u8],
    local: &Local<'_>,
    dst: Sgl<'_>,
    cursor: &mut Cursor,
) -> Result<u64, CopyError> {
    let total = bytes.len() as u64;
    while !bytes.is_empty() {
        let (off, n) = cursor
            .piece(dst, bytes.len() as u64)
            .ok_or(CopyError::DestinationFull)?;
        local
            .write(off, &bytes[..n as usize])
            .map_err(|_| CopyError::BadDestination)?;
        bytes = &bytes[n as usize..];
        cursor.advance(dst, n);
    }
    Ok(total)
}

fn copy_range(
    src: &Mem,
    mut off: u64,
    mut len: u64,
    local: &Local<'_>,
    dst: Sgl<'_>,
    cursor: &mut Cursor,
) -> Result<u64, CopyError> {
    // Check the whole source range first, so a bad offset copies nothing.
    src.check(off, len).map_err(|_| CopyError::BadSource)?;
    let total = len;
    while len > 0 {
        let (d, n) = cursor.piece(dst, len).ok_or(CopyError::DestinationFull)?;
        local
            .copy_from(src, off, d, n)
            .map_err(|_| CopyError::BadDestination)?;
        off += n;
        len -= n;
        cursor.advance(dst, n);
    }
    Ok(total)
}

/// Fills the payload part of `slot` (whose `hdr_len` is set) with `len` bytes of the list
/// `src` at `cursor` in this process's arena `local`: inline when they fit behind the
/// headers, else by reference — one range in the slot, or several in a gather list written
/// into `cont`, the continuation slots behind it (the slot's `sge_count` says how many;
/// `TxBatch::commit` queues them with it). Returns the bytes copied into the slot (0 for
/// references), or `None` if the list is shorter than `len`, unreadable, or longer than
/// `cont` holds (a local error: the WQE completes with an error).
pub(crate) fn describe(
    slot: &mut PacketSlot,
    cont: &mut [PacketSlot],
    local: &Mem,
    src: Sgl<'_>,
    cursor: Cursor,
    len: u32,
) -> Option<u64> {
    slot.payload_len = len;
    if len == 0 {
        return Some(0);
    }
    let hdr = slot.hdr_len as usize;
    let inline = len as usize <= PacketSlot::inline_room(hdr);
    if let DataLoc::Single(e) = *src.loc {
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
            let (off, n) = c.piece(src, (end - at) as u64)?;
            local.read(off, &mut slot.data[at..at + n as usize]).ok()?;
            at += n as usize;
            c.advance(src, n);
        }
        return Some(u64::from(len));
    }
    let (off, n) = cursor.piece(src, u64::from(len))?;
    if n == u64::from(len) {
        slot.kind = KIND_DIRECT;
        slot.payload_off = off;
        return Some(0);
    }
    // Several ranges: the list from the cursor's entry on, the first one entered `skip`
    // bytes in, covering at least `len` bytes.
    if hdr + 4 > slot.data.len() {
        return None;
    }
    let mut left = u64::from(len) + cursor.skip;
    let mut n = 0;
    while left > 0 {
        let e = src.entry(cursor.idx + n as u32)?;
        if n >= crate::wire::slot::MAX_GATHER || !set_gather_entry(cont, n, e.off, e.len) {
            return None;
        }
        left = left.saturating_sub(u64::from(e.len));
        n += 1;
    }
    slot.kind = KIND_GATHER;
    slot.payload_off = 0;
    slot.sge_count = n as u8;
    slot.data[hdr..hdr + 4].copy_from_slice(&(cursor.skip as u32).to_le_bytes());
    Some(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::psn::Psn;
    use crate::wire::bth::BthRepr;
    use crate::wire::opcode::Opcode;
    use crate::wire::slot::{GatherList, continuation_slots};
    use crate::wire::{PacketRepr, Qpn};
    use crate::wqe::{NO_MR, SGE_ENTRY_LEN};

    /// A private table of `entries` at offset `at` of `tables`.
    fn table(tables: &Mem, at: u64, entries: &[(u64, u32)]) -> DataLoc {
        for (i, &(off, len)) in entries.iter().enumerate() {
            let e = SgeEntry {
                off,
                len,
                mr: NO_MR,
            };
            tables
                .write(at + i as u64 * SGE_ENTRY_LEN, &e.to_bytes())
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

    /// A Send Only slot with a 12-byte BTH.
    fn send_slot() -> PacketSlot {
        let mut s = PacketSlot::default();
        let repr = PacketRepr::new(BthRepr::new(Opcode::SendOnly, Qpn::new(7), Psn::new(1)));
        s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
        s
    }

    /// The slots of a packet: the slot, then its continuation slots holding `gather`.
    fn packet_slots(mut slot: PacketSlot, gather: &GatherList) -> Vec<PacketSlot> {
        slot.sge_count = gather.entries().len() as u8;
        let n = continuation_slots(&slot);
        let mut v = vec![slot];
        v.extend(std::iter::repeat_n(PacketSlot::default(), n));
        crate::wire::slot::write_gather_for_tests(gather, &mut v[1..]);
        v
    }

    #[test]
    fn the_last_bytes_of_a_write_are_stored_after_a_fence() {
        #[derive(Debug, PartialEq)]
        enum Step {
            Put(u64, u64),
            Fence,
        }
        for (len, expect) in [
            (0, vec![Step::Fence]),
            (3, vec![Step::Fence, Step::Put(0, 3)]),
            (8, vec![Step::Fence, Step::Put(0, 8)]),
            (9, vec![Step::Put(0, 1), Step::Fence, Step::Put(1, 8)]),
            (
                4096,
                vec![Step::Put(0, 4088), Step::Fence, Step::Put(4088, 8)],
            ),
        ] {
            let steps = std::cell::RefCell::new(Vec::new());
            last_bytes_last::<()>(
                len,
                |pos, n| {
                    steps.borrow_mut().push(Step::Put(pos, n));
                    Ok(())
                },
                || steps.borrow_mut().push(Step::Fence),
            )
            .unwrap();
            assert_eq!(steps.into_inner(), expect, "{len} bytes");
        }
    }

    #[test]
    fn write_payloads_of_every_kind_land_whole_and_alone() {
        let peer = Mem::private(8192);
        let local = Mem::private(8192);
        let check = |slots: &[PacketSlot], expect: &[u8], what: &str| {
            local.zero(0, 8192).unwrap();
            local.write(999, &[0xee]).unwrap();
            local.write(1000 + expect.len() as u64, &[0xee]).unwrap();
            let pkt = RxPacket::parse(&slots[0], &slots[1..]).unwrap();
            assert_eq!(
                copy_write_payload(&pkt, &peer, &Local::arena_only(&local), 1000),
                Ok(expect.len() as u64),
                "{what}"
            );
            let mut got = vec![0u8; expect.len() + 2];
            local.read(999, &mut got).unwrap();
            assert_eq!(got[0], 0xee, "{what}: nothing before");
            assert_eq!(&got[1..=expect.len()], expect, "{what}");
            assert_eq!(got[expect.len() + 1], 0xee, "{what}: nothing after");
        };
        // Inline: 20 bytes in the slot.
        let tables = Mem::private(256);
        let v = fill(&peer, 100, 20, 1);
        let src = table(&tables, 0, &[(100, 20)]);
        let mut slot = send_slot();
        describe(
            &mut slot,
            &mut [],
            &peer,
            Sgl::new(&src, &tables),
            Cursor::default(),
            20,
        )
        .unwrap();
        assert_eq!(slot.kind, KIND_INLINE);
        check(&[slot], &v, "inline");
        // Direct: one range.
        let v = fill(&peer, 2000, 300, 2);
        check(&[direct(2000, 300)], &v, "direct");
        // Gather: the last 8 bytes span the last two pieces (3 and 5 bytes).
        let a = fill(&peer, 3000, 100, 3);
        let b = fill(&peer, 4000, 3, 4);
        let c = fill(&peer, 5000, 5, 5);
        let mut list = GatherList::default();
        for (off, len) in [(3000, 100), (4000, 3), (5000, 5)] {
            assert!(list.push(off, len));
        }
        let mut first = direct(0, 108);
        first.kind = KIND_GATHER;
        let slots = packet_slots(first, &list);
        check(&slots, &[a, b, c].concat(), "gather");
        // A source outside the peer's arena copies nothing.
        local.zero(0, 8192).unwrap();
        let pkt_slot = direct(8100, 200);
        let pkt = RxPacket::parse(&pkt_slot, &[]).unwrap();
        assert_eq!(
            copy_write_payload(&pkt, &peer, &Local::arena_only(&local), 0),
            Err(CopyError::BadSource)
        );
    }

    #[test]
    fn cursor_walks_entries_and_skips_empty_ones() {
        let tables = Mem::private(4096);
        let loc = table(&tables, 0, &[(1000, 10), (2000, 0), (3000, 5)]);
        let sgl = Sgl::new(&loc, &tables);
        let c = Cursor::at(sgl, 12).unwrap();
        assert_eq!(c.piece(sgl, 100), Some((3002, 3)));
        assert!(Cursor::at(sgl, 15).is_some());
        assert!(Cursor::at(sgl, 16).is_none());
    }

    #[test]
    fn gathered_payload_lands_across_scattered_buffers() {
        // Sender arena: 3 gather pieces; receiver: 2 scatter pieces of other sizes.
        let peer = Mem::private(8192);
        let local = Mem::private(8192);
        let (peer_tables, local_tables) = (Mem::private(1024), Mem::private(1024));
        let a = fill(&peer, 1000, 100, 1);
        let b = fill(&peer, 3000, 50, 2);
        let c = fill(&peer, 5000, 200, 3);
        let src = table(&peer_tables, 0, &[(1000, 100), (3000, 50), (5000, 200)]);
        let dst = table(&local_tables, 0, &[(4000, 120), (6000, 230)]);
        let (src, dst) = (Sgl::new(&src, &peer_tables), Sgl::new(&dst, &local_tables));
        let expect: Vec<u8> = [a, b, c].concat();

        // The sender describes the payload in two packets of 150 and 200 bytes.
        let mut sc = Cursor::default();
        let mut rc = Cursor::default();
        let mut kinds = vec![];
        for len in [150u32, 200] {
            let mut slots = vec![send_slot(); 1 + crate::wire::slot::MAX_CONTINUATION];
            let (slot, cont) = slots.split_first_mut().unwrap();
            let copied = describe(slot, cont, &peer, src, sc, len).unwrap();
            assert_eq!(copied, 0, "large payloads go by reference");
            kinds.push(slot.kind);
            slots.truncate(1 + continuation_slots(&slots[0]));
            let pkt = RxPacket::parse(&slots[0], &slots[1..]).unwrap();
            assert_eq!(
                copy_payload(&pkt, &peer, &Local::arena_only(&local), dst, &mut rc),
                Ok(u64::from(len))
            );
            sc.advance(src, u64::from(len));
        }
        assert_eq!(
            kinds,
            [KIND_GATHER, KIND_DIRECT],
            "the first spans two ranges, the second lies in one"
        );
        let mut got = vec![0u8; 350];
        local.read(4000, &mut got[..120]).unwrap();
        local.read(6000, &mut got[120..]).unwrap();
        assert_eq!(got, expect);
        // The gather lists travelled in the packets: the sender's private tables were
        // never read by the receiving side (it had no access to them at all).
    }

    #[test]
    fn small_payloads_are_copied_into_the_slot() {
        // The slot's 40 bytes of data hold the 12-byte BTH and up to 28 bytes of payload;
        // one byte more goes by reference.
        let local = Mem::private(4096);
        let tables = Mem::private(256);
        let v = fill(&local, 100, 29, 9);
        let src = table(&tables, 0, &[(100, 20), (120, 9)]);
        let mut slot = send_slot();
        assert_eq!(
            describe(
                &mut slot,
                &mut [],
                &local,
                Sgl::new(&src, &tables),
                Cursor::default(),
                28,
            ),
            Some(28)
        );
        assert_eq!(slot.kind, KIND_INLINE);
        assert_eq!(&slot.data[12..40], &v[..28]);
        let mut slots = [send_slot(); 2];
        let (slot, cont) = slots.split_first_mut().unwrap();
        assert_eq!(
            describe(
                slot,
                cont,
                &local,
                Sgl::new(&src, &tables),
                Cursor::default(),
                29,
            ),
            Some(0)
        );
        assert_eq!((slot.kind, slot.sge_count), (KIND_GATHER, 2));
    }

    fn direct(off: u64, len: u32) -> PacketSlot {
        let mut s = send_slot();
        s.kind = KIND_DIRECT;
        s.payload_off = off;
        s.payload_len = len;
        s
    }

    #[test]
    fn overflow_stops_at_the_end_of_the_receive_buffer() {
        let peer = Mem::private(4096);
        let local = Mem::private(4096);
        let tables = Mem::private(0);
        fill(&peer, 0, 300, 5);
        local.write(600, &[0xEE; 8]).unwrap();
        let dst = DataLoc::Single(SgeEntry {
            off: 500,
            len: 100,
            mr: NO_MR,
        });
        let mut c = Cursor::default();
        let slot = direct(0, 300);
        let pkt = RxPacket::parse(&slot, &[]).unwrap();
        let r = copy_payload(
            &pkt,
            &peer,
            &Local::arena_only(&local),
            Sgl::new(&dst, &tables),
            &mut c,
        );
        assert_eq!(r, Err(CopyError::DestinationFull));
        let mut after = [0u8; 8];
        local.read(600, &mut after).unwrap();
        assert_eq!(after, [0xEE; 8], "nothing written past the buffer");
    }

    #[test]
    fn hostile_sources_are_refused_without_copying() {
        let peer = Mem::private(1024);
        let local = Mem::private(1024);
        let tables = Mem::private(0);
        let dst = DataLoc::Single(SgeEntry {
            off: 0,
            len: 1024,
            mr: NO_MR,
        });
        let dst = Sgl::new(&dst, &tables);
        let check = |slots: &[PacketSlot], what: &str| {
            let pkt = RxPacket::parse(&slots[0], &slots[1..]).unwrap();
            let mut c = Cursor::default();
            assert_eq!(
                copy_payload(&pkt, &peer, &Local::arena_only(&local), dst, &mut c),
                Err(CopyError::BadSource),
                "{what}"
            );
            assert_eq!(c, Cursor::default(), "{what}: nothing copied");
            let mut untouched = [0u8; 1024];
            local.read(0, &mut untouched).unwrap();
            assert!(untouched.iter().all(|&b| b == 0), "{what}: nothing copied");
        };
        check(&[direct(1000, 100)], "range past the end");
        check(&[direct(u64::MAX - 10, 100)], "range wrapping around");
        let gather = |entries: &[(u64, u32)], len: u32| {
            let mut g = GatherList::default();
            for &(o, l) in entries {
                g.push(o, l);
            }
            let mut s = send_slot();
            s.kind = KIND_GATHER;
            s.payload_len = len;
            packet_slots(s, &g)
        };
        check(
            &gather(&[(900, 200)], 200),
            "a gather range outside the arena",
        );
        check(
            &gather(&[(0, 100), (900, 200)], 300),
            "a good range, then one outside: the first is not copied either",
        );
        check(&gather(&[(100, 10)], 20), "a list shorter than the length");
        check(
            &gather(&[(u64::MAX - 4, 10), (0, 10)], 20),
            "an offset that wraps",
        );
    }
}
