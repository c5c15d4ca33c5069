//! The receive path against a hostile peer, as a property: whatever bytes a peer publishes
//! on a link — frames of a slot and continuation lines — and whatever its arena holds, the engine
//! neither panics nor writes a byte of this process's memory that the packets were not
//! allowed to write.
//!
//! The rig is the real engine of an inline-mode [`Context`] with a QP in RTS. Its peer is
//! this test: it holds the other end of a real link segment (the rings the engine reads
//! and writes, in shared memory) and the peer arena the engine copies payloads from, and
//! publishes whatever proptest generates: random slots, and slots with a real opcode,
//! header length and destination QP so that they get past the first checks into the RQ
//! Logic and the completer, each followed in its frame by the continuation lines its
//! gather count calls for (or, in a quarter of the frames each, one line fewer or more). The engine also traces every packet to a capture file, so the packet tap
//! reads the same hostile slots. The QP has work outstanding (a Send, an RDMA Read, an
//! Atomic, receives spread over several scatter elements) so that responses have
//! something to match.

use proptest::prelude::*;
use shmhca_rings::segment::HugePages;

use crate::mem::Mem;
use crate::wire::opcode::Opcode;
use crate::wire::slot::{MAX_CONTINUATION, PacketSlot, continuation_slots};
use crate::{
    AccessFlags, Context, Cq, Destination, EngineMode, Mr, Pd, Qp, QpAttr, QpCaps, QpState, Qpn,
    RecvWr, RemoteAddr, SendOp, SendWr, WorkCompletion,
};

const PEER_QPN: u32 = 0x2002;
/// The PSN the QP's RQ Logic expects first from the peer.
const RQ_PSN: u32 = 100;
/// The PSN of the QP's first request.
const SQ_PSN: u32 = 500;
const PEER_ARENA: usize = 64 << 10;
const REGION: u64 = 32 << 10;

struct Rig {
    ctx: Context,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    /// Receive buffers and an RDMA target (every access).
    open: Mr,
    /// A region no packet may write (LOCAL_WRITE only, never posted), and its bytes.
    guarded: Mr,
    guarded_bytes: Vec<u8>,
    /// The peer's ends: ring 0 (the engine receives it) and ring 1.
    tx: crate::raw_peer::SlotTx,
    rx: crate::raw_peer::SlotRx,
    peer_arena: Mem,
    trace: std::path::PathBuf,
}

fn rig() -> Rig {
    let ctx = Context::builder()
        .arena_size(1 << 20)
        .huge_pages(HugePages::Never)
        .mode(EngineMode::Inline)
        .build()
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let caps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 64,
    };
    let mut qp = ctx.create_qp(&pd, &cq, &cq, caps).unwrap();
    let (id, mine, peer_arena) = crate::raw_peer::raw_peer_link(&ctx, 64, PEER_QPN, PEER_ARENA);
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let trace = std::env::temp_dir().join(format!(
        "shmhca-hostile-rx-{}-{}.pcap",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    ctx.trace_to(&trace).unwrap();

    qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::ALL))
        .unwrap();
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(crate::Mtu::Mtu1024)
            .dest(Destination {
                link: id,
                qpn: Qpn::new(PEER_QPN),
            })
            .rq_psn(RQ_PSN)
            .max_dest_rd_atomic(4)
            .min_rnr_timer(1),
    )
    .unwrap();
    qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(SQ_PSN)
            .max_rd_atomic(4)
            .timeout(14)
            .retry_cnt(7)
            .rnr_retry(7),
    )
    .unwrap();

    let open = pd.alloc_mr(REGION, AccessFlags::ALL).unwrap();
    let guarded = pd.alloc_mr(REGION, AccessFlags::LOCAL_WRITE).unwrap();
    let guarded_bytes: Vec<u8> = (0..REGION).map(|i| (i % 251) as u8).collect();
    guarded.write_at(0, &guarded_bytes).unwrap();
    // Receives over several scatter elements, and one request of each kind outstanding.
    for i in 0..4u64 {
        let sgl = [
            open.sge(i * 4096, 100).unwrap(),
            open.sge(i * 4096 + 200, 1000).unwrap(),
            open.sge(i * 4096 + 2000, 2000).unwrap(),
        ];
        qp.post_recv(&RecvWr::new(i, &sgl)).unwrap();
    }
    let remote = RemoteAddr {
        addr: 0x1000,
        rkey: 0x77,
    };
    let sge = [open.sge(16 << 10, 3000).unwrap()];
    qp.post_send(&SendWr::new(10, SendOp::Send, &sge)).unwrap();
    let sge = [open.sge(20 << 10, 5000).unwrap()];
    qp.post_send(&SendWr::new(11, SendOp::RdmaRead(remote), &sge))
        .unwrap();
    let sge = [open.sge(30 << 10, 8).unwrap()];
    qp.post_send(&SendWr::new(12, SendOp::FetchAdd { remote, add: 1 }, &sge))
        .unwrap();
    Rig {
        ctx,
        _pd: pd,
        cq,
        qp,
        open,
        guarded,
        guarded_bytes,
        tx: mine.tx,
        rx: mine.rx,
        peer_arena,
        trace,
    }
}

impl Rig {
    /// Runs the engine a few times, taking what it sends and its completions.
    fn pump(&mut self) {
        let mut out = [PacketSlot::default(); 64];
        let mut wc = [WorkCompletion::default(); 16];
        for _ in 0..4 {
            self.ctx.progress();
            while let Ok(1..) = self.rx.pop_burst(&mut out) {}
            while self.cq.poll(&mut wc) > 0 {}
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.ctx.stop_trace();
        let _ = std::fs::remove_file(&self.trace);
    }
}

/// One generated packet: raw slot bytes, whether to make it plausible, the opcode, payload
/// kind and PSN offset to use if so, raw bytes for its continuation lines, and how its
/// frame's line count relates to the one its packet calls for (0 or 1: the same; 2: one
/// line fewer; 3: one line more).
type Gen = (Vec<u8>, bool, usize, u8, u32, Vec<u8>, u8);

fn packet() -> impl Strategy<Value = Gen> {
    (
        proptest::collection::vec(any::<u8>(), size_of::<PacketSlot>()),
        any::<bool>(),
        0..Opcode::ALL.len(),
        0u8..5,
        0u32..8,
        proptest::collection::vec(
            any::<u8>(),
            (MAX_CONTINUATION + 1) * size_of::<PacketSlot>(),
        ),
        0u8..4,
    )
}

/// Turns a generated packet into the lines of its frame.
fn slots(g: &Gen, qpn: Qpn, out: &mut Vec<PacketSlot>) {
    let (raw, fix, op, kind, psn, cont, lines) = g;
    let mut s: PacketSlot = bytemuck::pod_read_unaligned(raw);
    if *fix {
        let op = Opcode::ALL[*op];
        let info = op.info().unwrap();
        s.data[0] = op.code();
        s.data[1] &= 0x30; // transport header version 0; keep the pad count
        s.data[5..8].copy_from_slice(&qpn.get().to_be_bytes()[1..]);
        // Near the PSN the RQ Logic expects, or the one the completer waits for.
        let base = if info.request { RQ_PSN } else { SQ_PSN };
        s.data[9..12].copy_from_slice(&(base + psn).to_be_bytes()[1..]);
        s.hdr_len = info.header_len() as u8;
        s.kind = *kind;
        // Small (inline up to past the slot's end), several packets' worth, or whatever
        // the bytes say (up to 4 GiB).
        match raw[0] & 3 {
            0 | 1 => s.payload_len %= 48,
            2 => s.payload_len %= 16 << 10,
            _ => {}
        }
        if raw[1] & 1 == 0 {
            s.payload_off %= PEER_ARENA as u64;
        }
        s.sge_count %= 18;
    }
    out.push(s);
    let n = match lines {
        2 => continuation_slots(&s).saturating_sub(1),
        3 => continuation_slots(&s) + 1,
        _ => continuation_slots(&s),
    };
    for i in 0..n {
        let mut c: PacketSlot = bytemuck::pod_read_unaligned(
            &cont[i * size_of::<PacketSlot>()..][..size_of::<PacketSlot>()],
        );
        if *fix {
            // Half the entries inside the arena.
            let b = &mut bytemuck::bytes_of_mut(&mut c)[crate::wire::slot::GATHER_START..];
            for e in b.chunks_mut(crate::wire::slot::GATHER_ENTRY_LEN).step_by(2) {
                let off = u64::from_le_bytes(e[..8].try_into().unwrap()) % PEER_ARENA as u64;
                e[..8].copy_from_slice(&off.to_le_bytes());
                let len = u32::from_le_bytes(e[8..12].try_into().unwrap()) % 8192;
                e[8..12].copy_from_slice(&len.to_le_bytes());
            }
        }
        out.push(c);
    }
}

/// The rig works: an honest Send Only from the peer lands in the first receive and is
/// acknowledged, so the packets of the property below reach the RQ Logic and the
/// completer, not just a closed door.
#[test]
fn the_rig_delivers_an_honest_send() {
    let mut rig = rig();
    let mut s = PacketSlot::default();
    let mut repr = crate::wire::PacketRepr::new(crate::wire::BthRepr::new(
        Opcode::SendOnly,
        rig.qp.qpn(),
        crate::psn::Psn::new(RQ_PSN),
    ));
    repr.bth.ack_req = true;
    s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
    s.kind = crate::wire::slot::KIND_INLINE;
    s.payload_len = 8;
    let at = s.hdr_len as usize;
    s.data[at..at + 8].copy_from_slice(b"honest!!");
    assert_eq!(rig.tx.push_burst(&[s]).unwrap(), 1);
    let mut wc = [WorkCompletion::default(); 4];
    let mut acked = false;
    let mut got = None;
    for _ in 0..100 {
        rig.ctx.progress();
        let mut out = [PacketSlot::default(); 16];
        let n = rig.rx.pop_burst(&mut out).unwrap();
        acked |= out[..n]
            .iter()
            .any(|p| p.data[0] == Opcode::Acknowledge.code());
        let k = rig.cq.poll(&mut wc);
        if let Some(c) = wc[..k].iter().find(|c| c.opcode == crate::WcOpcode::Recv) {
            got = Some(*c);
        }
        if acked && got.is_some() {
            break;
        }
    }
    let c = got.expect("the Send completes a receive");
    assert!(c.is_ok() && c.byte_len == 8, "{c:?}");
    assert!(acked, "the Send is acknowledged");
    let mut b = [0u8; 8];
    rig.open.read_at(0, &mut b).unwrap();
    assert_eq!(&b, b"honest!!");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Any slots, any continuation lines, frames of any line count, any peer-arena bytes:
    /// the engine never panics and never writes a region the packets could not write.
    #[test]
    fn arbitrary_slots_and_peer_arena_bytes_never_panic_the_engine(
        arena in proptest::collection::vec(any::<u8>(), 4096),
        packets in proptest::collection::vec(packet(), 1..48),
    ) {
        let mut rig = rig();
        let mut at = 0;
        while at < PEER_ARENA {
            let n = arena.len().min(PEER_ARENA - at);
            rig.peer_arena.write(at as u64, &arena[..n]).unwrap();
            at += n;
        }
        let qpn = rig.qp.qpn();
        let mut burst = Vec::new();
        'packets: for g in &packets {
            burst.clear();
            slots(g, qpn, &mut burst);
            // Published whole, as a sender must. The engine may have taken the link down
            // (it does for ring violations); then it reads no more, and the case ends.
            let mut tries = 0;
            while rig.tx.free_slots().unwrap() < burst.len() {
                rig.pump();
                tries += 1;
                if tries > 100 {
                    break 'packets;
                }
            }
            prop_assert!(rig.tx.push_frame(&burst).unwrap(), "room was checked");
            rig.pump();
        }
        rig.pump();
        let mut now = vec![0u8; REGION as usize];
        rig.guarded.read_at(0, &mut now).unwrap();
        prop_assert!(now == rig.guarded_bytes, "a packet wrote the guarded region");
    }
}

proptest! {
    /// The payload copy alone, many more cases: any slot and continuation bytes (half of
    /// them made to parse), any peer arena, any destination split — a refusal or a copy
    /// that stays inside the destination (`testing::receive_slot` checks every byte).
    #[test]
    fn a_received_payload_lands_inside_its_destination_or_nowhere(
        g in packet(),
        arena in proptest::collection::vec(any::<u8>(), 0..8192),
        split in proptest::collection::vec(any::<u16>(), 0..17),
    ) {
        let mut v = Vec::new();
        slots(&g, Qpn::new(7), &mut v);
        let mut bytes = Vec::new();
        for s in &v {
            bytes.extend_from_slice(bytemuck::bytes_of(s));
        }
        let _ = crate::testing::receive_slot(&bytes, &arena, &split);
    }
}

/// A request packet from the peer: `op` at `psn`, with `payload` inline.
fn request(qpn: Qpn, op: Opcode, psn: u32, payload: &[u8]) -> PacketSlot {
    let mut s = PacketSlot::default();
    let repr = crate::wire::PacketRepr::new(crate::wire::BthRepr::new(
        op,
        qpn,
        crate::psn::Psn::new(psn),
    ));
    s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
    s.kind = crate::wire::slot::KIND_INLINE;
    s.payload_len = payload.len() as u32;
    let at = s.hdr_len as usize;
    s.data[at..at + payload.len()].copy_from_slice(payload);
    s
}

/// A peer that stops reading its ring and sends the same Send again and again to a QP
/// without receives: each copy is a new RNR Nak (the PSN is ePSN again), which cannot
/// leave while the peer's ring is full. The responses waiting must stay bounded (no
/// panic on the queue's bound, no growth), and the QP must serve the peer again once it
/// reads its ring and behaves.
#[test]
fn repeated_rnr_naks_to_a_peer_that_does_not_read_stay_bounded() {
    let mut rig = rig();
    let qpn = rig.qp.qpn();
    // Use up the four receives.
    for i in 0..4 {
        let s = request(qpn, Opcode::SendOnly, RQ_PSN + i, b"x");
        assert_eq!(rig.tx.push_burst(&[s]).unwrap(), 1);
        rig.pump();
    }
    let s = request(qpn, Opcode::SendOnly, RQ_PSN + 4, b"again");
    for _ in 0..400 {
        let burst = [s; 16];
        let _ = rig.tx.push_burst(&burst).unwrap();
        rig.ctx.progress();
    }
    // The peer reads its ring again; a receive is posted; the Send goes through.
    rig.pump();
    rig.qp
        .post_recv(&RecvWr::new(9, &[rig.open.sge(0, 64).unwrap()]))
        .unwrap();
    let mut wc = [WorkCompletion::default(); 16];
    let mut got = None;
    for _ in 0..100 {
        while rig.tx.free_slots().unwrap() == 0 {
            rig.pump();
        }
        rig.tx.push_burst(&[s]).unwrap();
        rig.ctx.progress();
        let mut out = [PacketSlot::default(); 64];
        while let Ok(1..) = rig.rx.pop_burst(&mut out) {}
        let k = rig.cq.poll(&mut wc);
        if let Some(c) = wc[..k].iter().find(|c| c.wr_id == 9) {
            got = Some(*c);
            break;
        }
    }
    let c = got.expect("the QP serves the peer again");
    assert!(c.is_ok() && c.byte_len == 5, "{c:?}");
}
