//! The SQ Logic's transmit path: from the send window to request packets (spec/01).
//!
//! Each message is segmented by the PMTU into First/Middle/Last (or Only) packets carrying
//! consecutive PSNs; an RDMA Write's RETH rides on its first packet, immediate data (or the
//! key to invalidate) on its last; an RDMA Read is one request that advances nPSN by its
//! number of response packets; an Atomic is one request. A go-back-N rewind moves the
//! transmit point back and the same packets are rebuilt from the WQEs, with the same PSNs.
//!
//! [`transmit`] decides what goes and in which order; it builds each packet as a
//! [`RequestPacket`] — headers, and where its payload is in the WQE's data — and hands it to
//! the driver's [`SqDriver::send`]. The driver's link decides how the payload travels (by
//! reference into the sender's memory, copied into the packet, or into a datagram) and
//! whether there is room; the driver also executes memory window operations, which take no
//! PSN.

use crate::completion::WcStatus;
use crate::qp::{QpConfig, QpState};
use crate::send_window::SendWqe;
use crate::wire::opcode::{OpClass, Opcode, Position};
use crate::wire::{AtomicEthRepr, BthRepr, Qpn, RethRepr};
use crate::wqe::{Cursor, DataLoc, SqWqe, WqeFlags, WqeOp};

use super::{DEFAULT_PKEY, Requester, Step};

/// A request packet as the SQ Logic builds it: its headers in wire order, and its payload
/// as a range of the WQE's data (`payload_len` bytes from `cursor`).
#[derive(Debug, Clone, Copy)]
pub struct RequestPacket<'w> {
    /// The BTH.
    pub bth: BthRepr,
    /// The RETH (the first packet of an RDMA Write, an RDMA Read request).
    pub reth: Option<RethRepr>,
    /// The AtomicETH (an Atomic request).
    pub atomic_eth: Option<AtomicEthRepr>,
    /// Immediate data (the last packet of a Send or RDMA Write with Immediate).
    pub imm: Option<u32>,
    /// The R_Key to invalidate (the last packet of a Send with Invalidate).
    pub ieth: Option<u32>,
    /// The WQE's data, where the payload comes from.
    pub data: &'w DataLoc,
    /// Where in `data` the payload starts.
    pub cursor: Cursor,
    /// Bytes of payload.
    pub payload_len: u32,
}

/// Why a request packet was not sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendError {
    /// The link has no room for it now.
    NoRoom,
    /// The WQE's data does not cover the payload (a local error: a list `post_send`
    /// checked never gets here).
    BadData,
}

/// What the SQ Logic's [`transmit`] needs of whoever drives it: the QP's requester, a link
/// to send on, cursor arithmetic over the QP's scatter/gather lists (which live in the
/// driver's memory), and the memory window table. Implementations are generic parameters:
/// every call is direct.
pub trait SqDriver {
    /// The QP's SQ Logic.
    fn req(&mut self) -> &mut Requester;

    /// Whether the link has room for one more packet whose payload comes from `data`.
    fn has_room(&mut self, data: &DataLoc) -> bool;

    /// Builds `p` into the link's next packet and queues it; returns how many of its
    /// payload bytes were copied into the packet (the rest travel by reference).
    fn send(&mut self, p: &RequestPacket<'_>) -> Result<u64, SendError>;

    /// How far the peer has read the link (a count that only grows), looked up afresh
    /// (see [`Requester::after_transmit`]).
    fn peer_mark(&mut self) -> u64;

    /// The position `off` bytes into `data` (`None` past its end).
    fn cursor_at(&self, data: &DataLoc, off: u64) -> Option<Cursor>;

    /// `cursor` moved `n` bytes on in `data`.
    fn advance(&self, data: &DataLoc, cursor: Cursor, n: u64) -> Cursor;

    /// Executes memory window operation `w` (a Bind or a Local Invalidate); its status.
    fn execute_local(&mut self, w: &SqWqe) -> WcStatus;
}

/// What one [`transmit`] did: the driver counts it and acts on a local error.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Transmitted {
    /// Request packets queued.
    pub sent: usize,
    /// Of which sent before (go-back-N retransmissions).
    pub retransmitted: u64,
    /// Payload bytes copied into the packets.
    pub inline_bytes: u64,
    /// Memory window operations executed successfully.
    pub local: usize,
    /// A WQE failed locally (a memory window operation, or data that does not cover its
    /// message): it is completed in error, and the QP must go to the Error state.
    pub local_error: bool,
}

/// Sends up to `budget` request packets of a QP in `state` with context `cfg` through
/// `d`: the transmit point's packets in order, as the gates allow (see
/// [`Requester::next_step`]); memory window operations are executed as the transmit point
/// passes them. The QP must be in RTS or SQD, with no RNR wait standing
/// ([`Requester::rnr_waiting`]).
pub fn transmit<D: SqDriver>(
    d: &mut D,
    state: QpState,
    cfg: &QpConfig,
    budget: usize,
) -> Transmitted {
    let pmtu = cfg.path_mtu.bytes();
    let dest = cfg.dest.map(|x| x.qpn);
    let mut t = Transmitted::default();
    let mut link_full = false;
    while t.sent < budget {
        let (seq, new_wqe, point) = match d.req().next_step(state, cfg.max_rd_atomic) {
            Step::Stop => break,
            Step::Local { seq, new_wqe } => {
                let Some(w) = d.req().run_local(new_wqe) else {
                    continue;
                };
                let status = d.execute_local(&w);
                d.req().complete(seq, status);
                if status != WcStatus::Success {
                    t.local_error = true;
                    break;
                }
                t.local += 1;
                continue;
            }
            Step::Packet {
                seq,
                new_wqe,
                point,
            } => (seq, new_wqe, point),
        };
        let data = d.req().wqe(seq).wqe.data;
        if !d.has_room(&data) {
            link_full = true;
            break;
        }
        let req = d.req();
        if new_wqe {
            req.begin_wqe();
        }
        let w = *req.wqe(seq);
        let k = point.pkt;
        if req.note_sent(&w, w.first_psn.add(k)) {
            t.retransmitted += 1;
        }
        let ack_req = req.ack_req(seq, &w, k);
        let cursor = match point.cursor {
            Some(c) => c,
            None => d
                .cursor_at(&data, u64::from(k) * u64::from(pmtu))
                .unwrap_or_default(),
        };
        let p = request_packet(&w, k, pmtu, dest, ack_req, &data, cursor);
        match d.send(&p) {
            Ok(inline) => t.inline_bytes += inline,
            Err(SendError::NoRoom) => {
                link_full = true;
                break;
            }
            Err(SendError::BadData) => {
                d.req().complete(seq, WcStatus::LocQpOpErr);
                t.local_error = true;
                break;
            }
        }
        t.sent += 1;
        let next = if Requester::ends_wqe(&w, k) {
            None
        } else {
            Some(d.advance(&data, cursor, u64::from(p.payload_len)))
        };
        d.req().packet_sent(next);
    }
    let mark = if link_full { Some(d.peer_mark()) } else { None };
    d.req().after_transmit(t.sent > 0, mark);
    t
}

/// Request packet `k` of WQE `w` (PMTU `pmtu`, to QP `dest`), its payload `data` from
/// `cursor`: the opcode by the packet's position in its message, AckReq as `ack_req` says
/// (every Read and Atomic request carries it), SE on the last packet of a solicited
/// message, the pad to a multiple of four bytes, and the extended headers the opcode calls
/// for. A Read request asks for the responses from packet `k` on (after a rewind into a
/// Read, the rest of it). `w` is not a memory window operation (those take no packet).
pub fn request_packet<'w>(
    w: &SendWqe,
    k: u32,
    pmtu: u32,
    dest: Option<Qpn>,
    ack_req: bool,
    data: &'w DataLoc,
    cursor: Cursor,
) -> RequestPacket<'w> {
    let op = w.wqe.op;
    let mut p = RequestPacket {
        bth: BthRepr {
            opcode: Opcode::RdmaReadRequest,
            solicited: false,
            mig_req: false,
            pad_count: 0,
            tver: 0,
            pkey: DEFAULT_PKEY,
            dest_qp: dest.unwrap_or(Qpn::new(0)),
            ack_req: true,
            psn: w.first_psn.add(k),
        },
        reth: None,
        atomic_eth: None,
        imm: None,
        ieth: None,
        data,
        cursor,
        payload_len: 0,
    };
    match op {
        WqeOp::Read => {
            let off = u64::from(k) * u64::from(pmtu);
            p.reth = Some(RethRepr {
                va: w.wqe.remote_addr.wrapping_add(off),
                rkey: w.wqe.rkey,
                dma_len: w.wqe.len.saturating_sub(off as u32),
            });
        }
        WqeOp::CompareSwap | WqeOp::FetchAdd => {
            let cas = op == WqeOp::CompareSwap;
            p.bth.opcode = if cas {
                Opcode::CompareSwap
            } else {
                Opcode::FetchAdd
            };
            p.atomic_eth = Some(AtomicEthRepr {
                va: w.wqe.remote_addr,
                rkey: w.wqe.rkey,
                swap_add: if cas { w.wqe.swap } else { w.wqe.compare_add },
                compare: if cas { w.wqe.compare_add } else { 0 },
            });
        }
        // (Memory window operations take no packet; the transmit path never builds one.)
        WqeOp::BindMw | WqeOp::LocalInv => {}
        WqeOp::Send | WqeOp::SendImm | WqeOp::SendInv | WqeOp::Write | WqeOp::WriteImm => {
            let n = w.span;
            let position = match (n, k) {
                (1, _) => Position::Only,
                (_, 0) => Position::First,
                (n, k) if k == n - 1 => Position::Last,
                _ => Position::Middle,
            };
            let last = matches!(position, Position::Last | Position::Only);
            p.payload_len = if k + 1 < n {
                pmtu
            } else {
                w.wqe.len - pmtu * (n - 1)
            };
            let imm = last && matches!(op, WqeOp::SendImm | WqeOp::WriteImm);
            let inv = last && op == WqeOp::SendInv;
            let class = if matches!(op, WqeOp::Send | WqeOp::SendImm | WqeOp::SendInv) {
                OpClass::Send
            } else {
                OpClass::RdmaWrite
            };
            p.bth.opcode = Opcode::find(class, position, imm, inv)
                .expect("every Send/Write position has an opcode");
            p.bth.ack_req = ack_req;
            p.bth.solicited = last && w.wqe.flags.has(WqeFlags::SOLICITED);
            p.bth.pad_count = ((4 - p.payload_len % 4) % 4) as u8;
            if class == OpClass::RdmaWrite && matches!(position, Position::First | Position::Only) {
                p.reth = Some(RethRepr {
                    va: w.wqe.remote_addr,
                    rkey: w.wqe.rkey,
                    dma_len: w.wqe.len,
                });
            }
            if imm {
                p.imm = Some(w.wqe.imm);
            }
            if inv {
                p.ieth = Some(w.wqe.rkey);
            }
        }
    }
    p
}
