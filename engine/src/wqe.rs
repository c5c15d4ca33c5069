//! Work queue entries as they travel from the application to its engine.
//!
//! Posting copies a work request into a small fixed-size WQE and pushes it on the QP's send
//! or receive ring (in-process SPSC rings: the SQ and RQ of DESIGN.md). Scatter/gather lists
//! with more than one element are written into the QP's table memory — private heap memory
//! of this process, which no peer can map — one row per WQE position in its queue; the WQE
//! holds only where the row is. Inline data is staged in the QP's arena (it is user data a
//! peer reads when the message is too large for the packet slot).

use crate::mem::Mem;

/// Bytes of one scatter/gather entry in a QP's private table: arena offset (u64 LE), length
/// (u32 LE), memory-region index (u32 LE).
pub(crate) const SGE_ENTRY_LEN: u64 = 16;

/// "No memory region": inline staging areas belong to the QP, not to an MR.
pub(crate) const NO_MR: u32 = u32::MAX;

/// One scatter/gather element, resolved to the arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct SgeEntry {
    /// Offset in the QP's arena.
    pub(crate) off: u64,
    /// Length in bytes.
    pub(crate) len: u32,
    /// Index of the memory region in the MR table, or [`NO_MR`].
    pub(crate) mr: u32,
}

impl SgeEntry {
    pub(crate) fn to_bytes(self) -> [u8; SGE_ENTRY_LEN as usize] {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&self.off.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.mr.to_le_bytes());
        b
    }

    pub(crate) fn from_bytes(b: &[u8; SGE_ENTRY_LEN as usize]) -> SgeEntry {
        SgeEntry {
            off: u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
            len: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            mr: u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
        }
    }

    /// Reads entry `i` of the table at `table` in `mem`; `None` if it lies outside `mem`.
    pub(crate) fn read(mem: &Mem, table: u64, i: u32) -> Option<SgeEntry> {
        let mut b = [0u8; SGE_ENTRY_LEN as usize];
        let off = table.checked_add(u64::from(i) * SGE_ENTRY_LEN)?;
        mem.read(off, &mut b).ok()?;
        Some(SgeEntry::from_bytes(&b))
    }
}

/// Where a WQE's data lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DataLoc {
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
    pub(crate) fn entries(&self) -> u32 {
        match self {
            DataLoc::Empty => 0,
            DataLoc::Single(_) => 1,
            DataLoc::Table { n, .. } => *n,
        }
    }

    /// Entry `i`, read from `mem` for a table.
    pub(crate) fn entry(&self, mem: &Mem, i: u32) -> Option<SgeEntry> {
        match *self {
            DataLoc::Empty => None,
            DataLoc::Single(e) => (i == 0).then_some(e),
            DataLoc::Table { table, n } => (i < n).then(|| SgeEntry::read(mem, table, i))?,
        }
    }

    /// Calls `f` with the MR index of every entry (for in-flight accounting).
    pub(crate) fn for_each_mr(&self, mem: &Mem, mut f: impl FnMut(u32)) {
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
pub(crate) enum WqeOp {
    Send,
    SendImm,
    Write,
    WriteImm,
    Read,
    CompareSwap,
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
    pub(crate) fn consumes_rq_wqe(self) -> bool {
        matches!(
            self,
            WqeOp::Send | WqeOp::SendImm | WqeOp::SendInv | WqeOp::WriteImm
        )
    }

    /// Whether it is executed by this engine alone, without packets (memory window
    /// operations): it takes no PSN and completes at its turn in the send queue.
    pub(crate) fn is_local(self) -> bool {
        matches!(self, WqeOp::BindMw | WqeOp::LocalInv)
    }

    /// Whether it is an RDMA Read or an Atomic (bounded by the initiator depth, waited for
    /// by a fence).
    pub(crate) fn is_rd_atomic(self) -> bool {
        matches!(self, WqeOp::Read | WqeOp::CompareSwap | WqeOp::FetchAdd)
    }

    pub(crate) fn is_atomic(self) -> bool {
        matches!(self, WqeOp::CompareSwap | WqeOp::FetchAdd)
    }
}

/// Flags of a send WQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct WqeFlags(pub(crate) u8);

impl WqeFlags {
    pub(crate) const SIGNALED: u8 = 1;
    pub(crate) const FENCE: u8 = 2;
    pub(crate) const SOLICITED: u8 = 4;

    pub(crate) fn has(self, f: u8) -> bool {
        self.0 & f != 0
    }
}

/// A send WQE.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SqWqe {
    pub(crate) wr_id: u64,
    pub(crate) op: WqeOp,
    pub(crate) flags: WqeFlags,
    pub(crate) imm: u32,
    /// Message length in bytes (8 for Atomics).
    pub(crate) len: u32,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    /// Compare (CmpSwap) or add (FetchAdd) operand.
    pub(crate) compare_add: u64,
    /// Swap operand (CmpSwap).
    pub(crate) swap: u64,
    /// Gather list (Send/Write) or scatter list (Read, Atomic result).
    pub(crate) data: DataLoc,
}

/// A receive WQE.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RqWqe {
    pub(crate) wr_id: u64,
    pub(crate) data: DataLoc,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_through_a_table() {
        let mem = Mem::private(256);
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
            mem.write(64 + i as u64 * SGE_ENTRY_LEN, &e.to_bytes())
                .unwrap();
        }
        let loc = DataLoc::Table { table: 64, n: 2 };
        assert_eq!(loc.entry(&mem, 0), Some(es[0]));
        assert_eq!(loc.entry(&mem, 1), Some(es[1]));
        assert_eq!(loc.entry(&mem, 2), None);
        let mut mrs = vec![];
        loc.for_each_mr(&mem, |m| mrs.push(m));
        assert_eq!(mrs, [3]);
        // A table running off the end of the memory yields nothing, not a panic.
        let bad = DataLoc::Table { table: 250, n: 1 };
        assert_eq!(bad.entry(&mem, 0), None);
    }
}
