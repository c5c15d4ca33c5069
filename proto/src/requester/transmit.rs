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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::LinkId;
    use crate::mem::Memory;
    use crate::psn::Psn;
    use crate::qp::{Destination, Mtu};
    use crate::requester::LinkWait;
    use crate::wqe::{NO_MR, SGE_ENTRY_LEN, SgeEntry, Sgl};
    use alloc::vec::Vec;
    use core::time::Duration;

    /// A packet as the test driver received it: headers, and the payload's bytes read from
    /// the memory through the cursor.
    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Sent {
        opcode: Opcode,
        psn: u32,
        ack_req: bool,
        solicited: bool,
        pad: u8,
        reth: Option<RethRepr>,
        atomic: Option<AtomicEthRepr>,
        imm: Option<u32>,
        ieth: Option<u32>,
        payload: Vec<u8>,
    }

    /// A driver whose link is a vector with room for `room` packets, whose memory is a byte
    /// vector (the arena, and scatter/gather tables at [`TABLES`]).
    struct VecDriver {
        req: Requester,
        mem: Vec<u8>,
        room: usize,
        mark: u64,
        sent: Vec<Sent>,
        locals: Vec<SqWqe>,
        local_status: WcStatus,
    }

    /// Where the test memory keeps scatter/gather tables.
    const TABLES: u64 = 4096;

    impl SqDriver for VecDriver {
        fn req(&mut self) -> &mut Requester {
            &mut self.req
        }
        fn has_room(&mut self, _: &DataLoc) -> bool {
            self.sent.len() < self.room
        }
        fn send(&mut self, p: &RequestPacket<'_>) -> Result<u64, SendError> {
            if self.sent.len() >= self.room {
                return Err(SendError::NoRoom);
            }
            let sgl = Sgl::new(p.data, &self.mem[..]);
            let mut payload = Vec::new();
            let mut c = p.cursor;
            while payload.len() < p.payload_len as usize {
                let want = p.payload_len as u64 - payload.len() as u64;
                let (off, n) = c.piece(sgl, want).ok_or(SendError::BadData)?;
                let mut buf = alloc::vec![0; n as usize];
                self.mem[..]
                    .read(off, &mut buf)
                    .map_err(|_| SendError::BadData)?;
                payload.extend_from_slice(&buf);
                c.advance(sgl, n);
            }
            self.sent.push(Sent {
                opcode: p.bth.opcode,
                psn: p.bth.psn.get(),
                ack_req: p.bth.ack_req,
                solicited: p.bth.solicited,
                pad: p.bth.pad_count,
                reth: p.reth,
                atomic: p.atomic_eth,
                imm: p.imm,
                ieth: p.ieth,
                payload,
            });
            // This link copies payloads of up to 16 bytes into its packets.
            Ok(if p.payload_len <= 16 {
                u64::from(p.payload_len)
            } else {
                0
            })
        }
        fn peer_mark(&mut self) -> u64 {
            self.mark
        }
        fn cursor_at(&self, data: &DataLoc, off: u64) -> Option<Cursor> {
            Cursor::at(Sgl::new(data, &self.mem[..]), off)
        }
        fn advance(&self, data: &DataLoc, mut c: Cursor, n: u64) -> Cursor {
            c.advance(Sgl::new(data, &self.mem[..]), n);
            c
        }
        fn execute_local(&mut self, w: &SqWqe) -> WcStatus {
            self.locals.push(*w);
            self.local_status
        }
    }

    fn cfg() -> QpConfig {
        QpConfig {
            sq_psn: Psn::new(0xFF_FFFE),
            path_mtu: Mtu::Mtu256,
            dest: Some(Destination {
                link: LinkId::new(0),
                qpn: Qpn::new(0x42),
            }),
            max_rd_atomic: 2,
            remote_credits: false,
            retry_cnt: 3,
            timeout: 14,
            ..QpConfig::default()
        }
    }

    fn driver(room: usize) -> VecDriver {
        let mut req = Requester::new(16);
        req.start(&cfg(), Duration::from_nanos(1));
        let mut mem = alloc::vec![0u8; 8192];
        for (i, b) in mem.iter_mut().enumerate().take(TABLES as usize) {
            *b = (i + i / 251) as u8; // no period of 256: packets differ
        }
        VecDriver {
            req,
            mem,
            room,
            mark: 0,
            sent: Vec::new(),
            locals: Vec::new(),
            local_status: WcStatus::Success,
        }
    }

    fn wqe(op: WqeOp, len: u32, data: DataLoc) -> SqWqe {
        SqWqe {
            wr_id: 1,
            op,
            flags: WqeFlags(WqeFlags::SIGNALED | WqeFlags::SOLICITED),
            imm: 0xABCD,
            len,
            remote_addr: 0x1_0000,
            rkey: 0x77,
            compare_add: 5,
            swap: 9,
            data,
        }
    }

    fn single(off: u64, len: u32) -> DataLoc {
        DataLoc::Single(SgeEntry {
            off,
            len,
            mr: NO_MR,
        })
    }

    fn post(d: &mut VecDriver, w: SqWqe) {
        d.req.accept(w, cfg().path_mtu.bytes());
    }

    fn run(d: &mut VecDriver, budget: usize) -> Transmitted {
        transmit(d, QpState::Rts, &cfg(), budget)
    }

    /// spec/01: a message is segmented by the PMTU into First, Middle…, Last packets with
    /// consecutive PSNs (wrapping at 2^24), AckReq and SE on the last; an RDMA Write's RETH
    /// on its first packet, immediate data on its last; every byte in order.
    #[test]
    fn messages_are_segmented_by_the_pmtu() {
        let mut d = driver(16);
        post(&mut d, wqe(WqeOp::SendImm, 600, single(100, 600)));
        post(&mut d, wqe(WqeOp::Write, 300, single(1000, 300)));
        let t = run(&mut d, 16);
        assert_eq!(t.sent, 5);
        assert!(!t.local_error);
        let ops: Vec<_> = d
            .sent
            .iter()
            .map(|s| (s.opcode, s.psn, s.ack_req))
            .collect();
        assert_eq!(
            ops,
            [
                (Opcode::SendFirst, 0xFF_FFFE, false),
                (Opcode::SendMiddle, 0xFF_FFFF, false),
                (Opcode::SendLastWithImmediate, 0, true),
                (Opcode::RdmaWriteFirst, 1, false),
                (Opcode::RdmaWriteLast, 2, true),
            ]
        );
        assert_eq!(
            d.sent.iter().map(|s| s.solicited).collect::<Vec<_>>(),
            [false, false, true, false, true]
        );
        assert_eq!(d.sent[2].imm, Some(0xABCD));
        assert_eq!((d.sent[2].payload.len(), d.sent[2].pad), (88, 0));
        assert_eq!((d.sent[4].payload.len(), d.sent[4].pad), (44, 0));
        let send: Vec<u8> = d.sent[..3].iter().flat_map(|s| s.payload.clone()).collect();
        assert_eq!(send, d.mem[100..700]);
        assert_eq!(
            d.sent[3].reth,
            Some(RethRepr {
                va: 0x1_0000,
                rkey: 0x77,
                dma_len: 300
            })
        );
        assert_eq!(d.sent[4].reth, None);
        assert_eq!(d.req.window().npsn(), Psn::new(3));
        assert!(d.req.timer().armed(), "the transport timer runs");
    }

    /// A payload over a multi-element list crosses its elements; odd lengths are padded.
    #[test]
    fn a_gather_list_is_read_across_its_elements() {
        let mut d = driver(16);
        let es = [(200u64, 100u32), (2000, 57), (3000, 200)];
        for (i, &(off, len)) in es.iter().enumerate() {
            let row = SgeEntry { off, len, mr: 1 }.to_bytes();
            let at = (TABLES + i as u64 * SGE_ENTRY_LEN) as usize;
            d.mem[at..at + row.len()].copy_from_slice(&row);
        }
        let data = DataLoc::Table {
            table: TABLES,
            n: 3,
        };
        post(&mut d, wqe(WqeOp::Send, 357, data));
        assert_eq!(run(&mut d, 16).sent, 2);
        let got: Vec<u8> = d.sent.iter().flat_map(|s| s.payload.clone()).collect();
        let want: Vec<u8> = [&d.mem[200..300], &d.mem[2000..2057], &d.mem[3000..3200]].concat();
        assert_eq!(got, want);
        assert_eq!((d.sent[1].payload.len(), d.sent[1].pad), (101, 3));
    }

    /// A Read is one request whose PSNs cover its responses; an Atomic one request with its
    /// AtomicETH; both carry AckReq. After a go-back-N rewind into the Read, the request
    /// asks for the rest only (spec/01: "the RDMA Read request is re-issued for the
    /// remaining data").
    #[test]
    fn reads_and_atomics_and_a_rewind_into_a_read() {
        let mut d = driver(16);
        post(&mut d, wqe(WqeOp::Read, 700, single(0, 700)));
        post(&mut d, wqe(WqeOp::CompareSwap, 8, single(800, 8)));
        assert_eq!(run(&mut d, 16).sent, 2);
        assert_eq!(d.sent[0].opcode, Opcode::RdmaReadRequest);
        assert_eq!(d.sent[1].opcode, Opcode::CompareSwap);
        assert!(d.sent.iter().all(|s| s.ack_req && s.payload.is_empty()));
        assert_eq!(d.sent[1].psn, 1, "the Read took 3 PSNs");
        assert_eq!(
            d.sent[1].atomic,
            Some(AtomicEthRepr {
                va: 0x1_0000,
                rkey: 0x77,
                swap_add: 9,
                compare: 5
            })
        );
        // The first response arrived; the rest were lost: resend from the second.
        assert!(d.req.resend_from(Psn::new(0xFF_FFFF)));
        let t = run(&mut d, 16);
        assert_eq!((t.sent, t.retransmitted), (2, 2));
        assert_eq!(d.sent[2].psn, 0xFF_FFFF);
        assert_eq!(
            d.sent[2].reth,
            Some(RethRepr {
                va: 0x1_0000 + 256,
                rkey: 0x77,
                dma_len: 700 - 256
            })
        );
        assert_eq!(d.sent[3], d.sent[1], "the Atomic again, the same bytes");
    }

    /// A full link stops the transmit point where it is and reports the peer's mark; the
    /// budget bounds one call; what is left goes on the next.
    #[test]
    fn a_full_link_and_the_budget_stop_transmission() {
        let mut d = driver(1);
        d.mark = 7;
        post(&mut d, wqe(WqeOp::Send, 600, single(0, 600)));
        assert_eq!(run(&mut d, 16).sent, 1);
        assert_eq!(d.req.link_wait(), LinkWait::Waiting);
        d.room = 16;
        assert_eq!(run(&mut d, 1).sent, 1, "the budget");
        assert_eq!(d.req.link_wait(), LinkWait::No);
        assert_eq!(run(&mut d, 16).sent, 1);
        assert_eq!(
            d.sent.iter().map(|s| s.opcode).collect::<Vec<_>>(),
            [Opcode::SendFirst, Opcode::SendMiddle, Opcode::SendLast]
        );
        assert_eq!(run(&mut d, 16), Transmitted::default(), "nothing left");
    }

    /// Memory window operations take no PSN and run in posted order as the transmit point
    /// passes them — once: a rewind back over one does not run it again. One that fails
    /// completes in error and stops transmission (the driver fails the QP).
    #[test]
    fn memory_window_operations_run_once_in_order() {
        let mut d = driver(16);
        post(&mut d, wqe(WqeOp::Send, 8, single(0, 8)));
        post(&mut d, wqe(WqeOp::BindMw, 0, DataLoc::Empty));
        post(&mut d, wqe(WqeOp::Send, 8, single(0, 8)));
        let t = run(&mut d, 16);
        assert_eq!((t.sent, t.local, t.local_error), (2, 1, false));
        assert_eq!(t.inline_bytes, 16, "two 8-byte payloads copied");
        assert_eq!(d.sent[0].opcode, Opcode::SendOnly);
        assert_eq!(d.locals.len(), 1);
        assert_eq!(d.sent[1].psn, 0xFF_FFFF, "the bind took no PSN");
        assert!(d.req.resend_from(Psn::new(0xFF_FFFE)));
        let t = run(&mut d, 16);
        assert_eq!((t.sent, t.local, t.retransmitted), (2, 0, 2));
        assert_eq!(d.locals.len(), 1, "not run twice");
        d.local_status = WcStatus::MwBindErr;
        post(&mut d, wqe(WqeOp::LocalInv, 0, DataLoc::Empty));
        post(&mut d, wqe(WqeOp::Send, 8, single(0, 8)));
        let t = run(&mut d, 16);
        assert_eq!((t.sent, t.local, t.local_error), (0, 0, true));
        assert_eq!(d.req.wqe(3).done, Some(WcStatus::MwBindErr));
    }

    /// A bind alone sends nothing: the transport timer, which detects responses that
    /// stop coming, does not start.
    #[test]
    fn a_transmission_that_sends_nothing_starts_no_timer() {
        let mut d = driver(16);
        post(&mut d, wqe(WqeOp::BindMw, 0, DataLoc::Empty));
        let t = run(&mut d, 16);
        assert_eq!((t.sent, t.local), (0, 1));
        assert!(!d.req.timer().armed());
    }

    /// A Nak in the middle of a message: the packets from the one it names are built again
    /// from their place in the data (spec/01 go-back-N), the same bytes.
    #[test]
    fn a_rewind_into_a_message_resends_from_that_packet() {
        let mut d = driver(16);
        post(&mut d, wqe(WqeOp::Send, 700, single(100, 700)));
        assert_eq!(run(&mut d, 16).sent, 3);
        assert!(d.req.resend_from(Psn::new(0xFF_FFFF)));
        let t = run(&mut d, 16);
        assert_eq!((t.sent, t.retransmitted), (2, 2));
        assert_eq!(d.sent[3], d.sent[1]);
        assert_eq!(d.sent[4], d.sent[2]);
        assert_eq!(d.sent[3].payload, d.mem[356..612]);
    }

    /// Data that does not cover its message fails the WQE locally, never a panic.
    #[test]
    fn data_that_does_not_cover_the_message_is_a_local_error() {
        let mut d = driver(16);
        post(&mut d, wqe(WqeOp::Send, 100, single(8190, 100)));
        let t = run(&mut d, 16);
        assert_eq!((t.sent, t.local_error), (0, true));
        assert_eq!(d.req.wqe(0).done, Some(WcStatus::LocQpOpErr));
    }
}
