//! Work queue entries as they travel from the application to its engine.
//!
//! Posting copies a work request into a small fixed-size WQE and pushes it on the QP's send
//! or receive ring (in-process SPSC rings: the SQ and RQ of DESIGN.md). Scatter/gather lists
//! with more than one element are written into the QP's table memory — private heap memory
//! of this process, which no peer can map — one row per WQE position in its queue; the WQE
//! holds only where the row is. Inline data is staged in the QP's arena (it is user data a
//! peer reads when the message is too large for the packet slot).
//!
//! A WQE holds plain offsets; where its multi-element list is read from is any
//! [`Memory`] (an [`Sgl`] pairs the two), and a [`Cursor`] walks the list.

use crate::mem::Memory;

/// Bytes of one scatter/gather entry in a QP's private table: arena offset (u64 LE), length
/// (u32 LE), memory-region index (u32 LE).
pub const SGE_ENTRY_LEN: u64 = 16;

/// "No memory region": inline staging areas belong to the QP, not to an MR.
pub const NO_MR: u32 = u32::MAX;

/// One scatter/gather element, resolved to the arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SgeEntry {
    /// Offset in the QP's arena.
    pub off: u64,
    /// Length in bytes.
    pub len: u32,
    /// Index of the memory region in the MR table, or [`NO_MR`].
    pub mr: u32,
}

impl SgeEntry {
    /// The entry as a table row stores it.
    pub fn to_bytes(self) -> [u8; SGE_ENTRY_LEN as usize] {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&self.off.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.mr.to_le_bytes());
        b
    }

    /// An entry from a table row.
    pub fn from_bytes(b: &[u8; SGE_ENTRY_LEN as usize]) -> SgeEntry {
        SgeEntry {
            off: u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
            len: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            mr: u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
        }
    }

    /// Reads entry `i` of the table at `table` in `mem`; `None` if it lies outside `mem`.
    pub fn read<M: Memory + ?Sized>(mem: &M, table: u64, i: u32) -> Option<SgeEntry> {
        let mut b = [0u8; SGE_ENTRY_LEN as usize];
        let off = table.checked_add(u64::from(i) * SGE_ENTRY_LEN)?;
        mem.read(off, &mut b).ok()?;
        Some(SgeEntry::from_bytes(&b))
    }
}

/// Where a WQE's data lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataLoc {
    /// No data (zero-length message, or an Atomic without result buffer).
    Empty,
    /// One contiguous range: a single SGE, or inline data in the staging area.
    Single(SgeEntry),
    /// `n` entries in the QP's private table memory at offset `table`.
    Table {
        /// Arena offset of entry 0.
        table: u64,
        /// Number of entries.
        n: u32,
    },
}

impl DataLoc {
    /// The number of entries.
    pub fn entries(&self) -> u32 {
        match self {
            DataLoc::Empty => 0,
            DataLoc::Single(_) => 1,
            DataLoc::Table { n, .. } => *n,
        }
    }

    /// Entry `i`, read from `mem` for a table.
    pub fn entry<M: Memory + ?Sized>(&self, mem: &M, i: u32) -> Option<SgeEntry> {
        match *self {
            DataLoc::Empty => None,
            DataLoc::Single(e) => (i == 0).then_some(e),
            DataLoc::Table { table, n } => (i < n).then(|| SgeEntry::read(mem, table, i))?,
        }
    }

    /// Calls `f` with the MR index of every entry (for in-flight accounting).
    pub fn for_each_mr<M: Memory + ?Sized>(&self, mem: &M, mut f: impl FnMut(u32)) {
        for i in 0..self.entries() {
            if let Some(e) = self.entry(mem, i) {
                if e.mr != NO_MR {
                    f(e.mr);
                }
            }
        }
    }
}

/// The operation of a send WQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WqeOp {
    /// Send.
    Send,
    /// Send with Immediate (`imm`).
    SendImm,
    /// RDMA Write to `remote_addr` / `rkey`.
    Write,
    /// RDMA Write with Immediate (`imm`).
    WriteImm,
    /// RDMA Read from `remote_addr` / `rkey` into `data`.
    Read,
    /// Atomic Compare and Swap (`compare_add`, `swap`); the original value lands in `data`.
    CompareSwap,
    /// Atomic Fetch and Add (`compare_add`); the original value lands in `data`.
    FetchAdd,
    /// Send with Invalidate: `rkey` is the key to invalidate (IETH of the last packet).
    SendInv,
    /// Bind a memory window (no packet): `rkey` is the window's new key, `remote_addr` and
    /// `compare_add` its start and length, `imm` the region's L_Key, `swap` the rights
    /// (low 8 bits) and the window type (bit 8: type 2).
    BindMw,
    /// Local Invalidate (no packet): `rkey` is the key to invalidate.
    LocalInv,
}

impl WqeOp {
    /// Whether the message consumes a receive WQE at the responder (spec/02).
    pub fn consumes_rq_wqe(self) -> bool {
        matches!(
            self,
            WqeOp::Send | WqeOp::SendImm | WqeOp::SendInv | WqeOp::WriteImm
        )
    }

    /// Whether it is executed by this engine alone, without packets (memory window
    /// operations): it takes no PSN and completes at its turn in the send queue.
    pub fn is_local(self) -> bool {
        matches!(self, WqeOp::BindMw | WqeOp::LocalInv)
    }

    /// Whether it is an RDMA Read or an Atomic (bounded by the initiator depth, waited for
    /// by a fence).
    pub fn is_rd_atomic(self) -> bool {
        matches!(self, WqeOp::Read | WqeOp::CompareSwap | WqeOp::FetchAdd)
    }

    /// Whether it is an Atomic.
    pub fn is_atomic(self) -> bool {
        matches!(self, WqeOp::CompareSwap | WqeOp::FetchAdd)
    }
}

/// Flags of a send WQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WqeFlags(pub u8);

impl WqeFlags {
    /// The work request asks for a completion.
    pub const SIGNALED: u8 = 1;
    /// It waits for the RDMA Reads and Atomics before it (`IBV_SEND_FENCE`).
    pub const FENCE: u8 = 2;
    /// Its last packet carries the Solicited Event bit.
    pub const SOLICITED: u8 = 4;

    /// Whether flag `f` is set.
    pub fn has(self, f: u8) -> bool {
        self.0 & f != 0
    }
}

/// A send WQE.
#[derive(Debug, Clone, Copy)]
pub struct SqWqe {
    /// The application's identifier, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: WqeOp,
    /// Signalled, fenced, solicited.
    pub flags: WqeFlags,
    /// Immediate data (or, for a memory window bind, the region's L_Key).
    pub imm: u32,
    /// Message length in bytes (8 for Atomics).
    pub len: u32,
    /// The remote address (RDMA and Atomics).
    pub remote_addr: u64,
    /// The remote key (RDMA and Atomics), or the key to invalidate.
    pub rkey: u32,
    /// Compare (CmpSwap) or add (FetchAdd) operand.
    pub compare_add: u64,
    /// Swap operand (CmpSwap).
    pub swap: u64,
    /// Gather list (Send/Write) or scatter list (Read, Atomic result).
    pub data: DataLoc,
}

impl SqWqe {
    /// A Send of one element `entry`, the whole message.
    #[inline(always)]
    pub fn send_of(wr_id: u64, flags: WqeFlags, entry: SgeEntry) -> SqWqe {
        SqWqe {
            wr_id,
            op: WqeOp::Send,
            flags,
            imm: 0,
            len: entry.len,
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
            data: DataLoc::Single(entry),
        }
    }

    /// An RDMA Write of one element `entry`, the whole message, to `remote_addr` under
    /// `rkey`.
    #[inline(always)]
    pub fn write_of(
        wr_id: u64,
        flags: WqeFlags,
        entry: SgeEntry,
        remote_addr: u64,
        rkey: u32,
    ) -> SqWqe {
        SqWqe {
            op: WqeOp::Write,
            remote_addr,
            rkey,
            ..SqWqe::send_of(wr_id, flags, entry)
        }
    }
}

/// A receive WQE.
#[derive(Debug, Clone, Copy)]
pub struct RqWqe {
    /// The application's identifier, returned in the completion.
    pub wr_id: u64,
    /// The scatter list.
    pub data: DataLoc,
}

/// A scatter/gather list: where it is, and the private memory its table (if any) is in.
#[derive(Debug)]
pub struct Sgl<'a, M: ?Sized> {
    /// Where the list is.
    pub loc: &'a DataLoc,
    /// The memory its table (if any) is in.
    pub tables: &'a M,
}

impl<'a, M: Memory + ?Sized> Sgl<'a, M> {
    /// The list `loc`, whose table (if any) is in `tables`.
    pub fn new(loc: &'a DataLoc, tables: &'a M) -> Sgl<'a, M> {
        Sgl { loc, tables }
    }

    /// Entry `i`.
    #[inline]
    pub fn entry(&self, i: u32) -> Option<SgeEntry> {
        self.loc.entry(self.tables, i)
    }
}

/// A position in a scatter/gather list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cursor {
    /// Entry index.
    pub idx: u32,
    /// Bytes already consumed of that entry.
    pub skip: u64,
}

impl<M: ?Sized> Clone for Sgl<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<M: ?Sized> Copy for Sgl<'_, M> {}

impl Cursor {
    /// Moves forward `n` bytes through `sgl`. Returns false if the list ends first.
    pub fn advance<M: Memory + ?Sized>(&mut self, sgl: Sgl<'_, M>, mut n: u64) -> bool {
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
    pub fn at<M: Memory + ?Sized>(sgl: Sgl<'_, M>, pos: u64) -> Option<Cursor> {
        let mut c = Cursor::default();
        c.advance(sgl, pos).then_some(c)
    }

    /// The next contiguous piece of at most `max` bytes at the cursor, without moving.
    pub fn piece<M: Memory + ?Sized>(&self, sgl: Sgl<'_, M>, max: u64) -> Option<(u64, u64)> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_through_a_table() {
        let mut mem = [0u8; 256];
        let es = [
            SgeEntry {
                off: 4096,
                len: 100,
                mr: 3,
            },
            SgeEntry {
                off: u64::MAX - 7,
                len: u32::MAX,
                mr: NO_MR,
            },
        ];
        for (i, e) in es.iter().enumerate() {
            let at = 64 + i * SGE_ENTRY_LEN as usize;
            mem[at..at + SGE_ENTRY_LEN as usize].copy_from_slice(&e.to_bytes());
        }
        let loc = DataLoc::Table { table: 64, n: 2 };
        assert_eq!(loc.entry(&mem[..], 0), Some(es[0]));
        assert_eq!(loc.entry(&mem[..], 1), Some(es[1]));
        assert_eq!(loc.entry(&mem[..], 2), None);
        let mut mrs = vec![];
        loc.for_each_mr(&mem[..], |m| mrs.push(m));
        assert_eq!(mrs, [3]);
        // A table running off the end of the memory yields nothing, not a panic.
        let bad = DataLoc::Table { table: 250, n: 1 };
        assert_eq!(bad.entry(&mem[..], 0), None);
    }
}
