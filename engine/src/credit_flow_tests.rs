//! End-to-end credits (spec/02) checked by what goes on the link.
//!
//! The rig is the real engine of an inline-mode [`Context`] with one QP; its peer is this
//! test, holding the other end of a real link segment: it reads every packet the engine
//! sends and writes the Acks (or requests) it wants, with the PSN, MSN and credit count of
//! its choosing. So each rule of spec/02 is checked on the packets themselves — which
//! request packets leave, in what order, with which AckReq bits — rather than on
//! completions, which arrive in the end whatever the credits say.

use shmhca_rings::segment::HugePages;

use crate::mem::Mem;
use crate::psn::Psn;
use crate::wire::aeth::{AethRepr, CreditCode, NakCode, Syndrome};
use crate::wire::opcode::Opcode;
use crate::wire::slot::{KIND_INLINE, PacketSlot, continuation_slots};
use crate::wire::{BthRepr, Msn, PacketRepr};
use crate::{
    AccessFlags, Context, Cq, Destination, EngineMode, Mr, Pd, Qp, QpAttr, QpCaps, QpState, Qpn,
    RecvWr, RemoteAddr, SendOp, SendWr, WcStatus, WorkCompletion,
};

const PEER_QPN: u32 = 0x3003;
/// The PSN the QP's RQ Logic expects first from the peer.
const RQ_PSN: u32 = 0x40;
/// The PSN of the QP's first request: close to the end of the PSN space, so that the
/// requests of most tests wrap around it.
const SQ_PSN: u32 = 0xFF_FFFA;
/// Bytes of the region every request reads from and writes to.
const REGION: u64 = 64 << 10;

/// How the rig's QP is set up.
#[derive(Clone, Copy)]
struct Opts {
    /// Whether the peer reports credits.
    remote_credits: bool,
    /// The Local Ack Timeout code (0: no transport timer).
    timeout: u8,
    /// Stop in RTR (the test moves the QP to RTS itself).
    stop_at_rtr: bool,
}

impl Default for Opts {
    fn default() -> Opts {
        Opts {
            remote_credits: true,
            timeout: 0,
            stop_at_rtr: false,
        }
    }
}

/// A packet the engine sent (its headers).
#[derive(Debug, Clone, Copy)]
struct Sent {
    repr: PacketRepr,
}

impl Sent {
    fn op(&self) -> Opcode {
        self.repr.bth.opcode
    }
    /// Its PSN as an offset from [`SQ_PSN`] (requests) or [`RQ_PSN`] (responses).
    fn psn(&self, base: u32) -> u32 {
        Psn::new(self.repr.bth.psn.get()).diff(Psn::new(base)) as u32
    }
    fn ack_req(&self) -> bool {
        self.repr.bth.ack_req
    }
    /// The credit count and MSN of a positive Ack or response carrying an AETH.
    fn credits(&self) -> Option<(Option<u32>, u32)> {
        match self.repr.aeth {
            Some(AethRepr {
                syndrome: Syndrome::Ack { credits },
                msn,
            }) => Some((credits.credits(), msn.get())),
            _ => None,
        }
    }
}

/// A request packet, as the tests write the expected flow: (opcode, PSN offset from
/// [`SQ_PSN`], AckReq).
type Req = (Opcode, u32, bool);

struct Rig {
    ctx: Context,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    /// Source and target of every request, open to every access.
    mr: Mr,
    /// The peer's ends: ring 0 (the engine receives it) and ring 1.
    tx: crate::raw_peer::SlotTx,
    rx: crate::raw_peer::SlotRx,
    _peer_arena: Mem,
    opts: Opts,
    next_wr: u64,
    /// Packets the engine sent that are not requests (its RQ Logic's responses).
    responses: Vec<Sent>,
    /// Completions polled so far.
    wcs: Vec<WorkCompletion>,
    /// Continuation slots still to skip on the link.
    skip: usize,
    /// PSN offset (from [`RQ_PSN`]) of the next request the peer sends.
    peer_psn: u32,
}

/// The kinds of work request the tests post.
#[derive(Clone, Copy, Debug)]
enum K {
    Send,
    SendImm,
    Write,
    WriteImm,
    Read,
    FetchAdd,
}

fn rig(o: Opts) -> Rig {
    let ctx = Context::builder()
        .arena_size(1 << 20)
        .huge_pages(HugePages::Never)
        .mode(EngineMode::Inline)
        .build()
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let caps = QpCaps {
        max_send_wr: 32,
        max_recv_wr: 32,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline_data: 0,
    };
    let mut qp = ctx.create_qp(&pd, &cq, &cq, caps).unwrap();
    let (id, mine, peer_arena) = crate::raw_peer::raw_peer_link(&ctx, 256, PEER_QPN, 64 << 10);

    qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::ALL))
        .unwrap();
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(crate::Mtu::Mtu256)
            .dest(Destination {
                link: id,
                qpn: Qpn::new(PEER_QPN),
            })
            .rq_psn(RQ_PSN)
            .max_dest_rd_atomic(4)
            .min_rnr_timer(1)
            .remote_credits(o.remote_credits),
    )
    .unwrap();
    let mr = pd.alloc_mr(REGION, AccessFlags::ALL).unwrap();
    let mut r = Rig {
        ctx,
        _pd: pd,
        cq,
        qp,
        mr,
        tx: mine.tx,
        rx: mine.rx,
        _peer_arena: peer_arena,
        opts: o,
        next_wr: 0,
        responses: Vec::new(),
        wcs: Vec::new(),
        skip: 0,
        peer_psn: 0,
    };
    if !o.stop_at_rtr {
        r.enter_rts();
    }
    r
}

impl Rig {
    fn enter_rts(&mut self) {
        self.qp
            .modify(
                &QpAttr::new(QpState::Rts)
                    .sq_psn(SQ_PSN)
                    .max_rd_atomic(4)
                    .timeout(self.opts.timeout)
                    .retry_cnt(7)
                    .rnr_retry(7),
            )
            .unwrap();
    }

    /// Posts a work request of `len` bytes (signaled); returns its id.
    fn post(&mut self, k: K, len: u32) -> u64 {
        let id = self.next_wr;
        self.next_wr += 1;
        // The peer never looks at remote addresses: any will do.
        let remote = RemoteAddr {
            addr: 0x10_0000,
            rkey: 0x1234,
        };
        let op = match k {
            K::Send => SendOp::Send,
            K::SendImm => SendOp::SendWithImm(7),
            K::Write => SendOp::RdmaWrite(remote),
            K::WriteImm => SendOp::RdmaWriteWithImm(remote, 9),
            K::Read => SendOp::RdmaRead(remote),
            K::FetchAdd => SendOp::FetchAdd { remote, add: 1 },
        };
        let sge = [self.mr.sge(0, len).unwrap()];
        self.qp.post_send(&SendWr::new(id, op, &sge)).unwrap();
        id
    }

    /// Runs the engine until the link has been quiet for a while; returns the request
    /// packets it sent (its responses go to `self.responses`).
    fn run(&mut self) -> Vec<Sent> {
        let mut got = Vec::new();
        let mut quiet = 0;
        let mut rounds = 0;
        while quiet < 8 {
            rounds += 1;
            assert!(
                rounds < 1000,
                "the engine keeps sending: {:?}",
                self.responses.last()
            );
            self.ctx.progress();
            let n = got.len() + self.responses.len();
            self.take_sent(&mut got);
            if got.len() + self.responses.len() == n {
                quiet += 1;
            } else {
                quiet = 0;
            }
            let mut wc = [WorkCompletion::default(); 16];
            let k = self.cq.poll(&mut wc);
            self.wcs.extend_from_slice(&wc[..k]);
        }
        got
    }

    fn take_sent(&mut self, requests: &mut Vec<Sent>) {
        let mut buf = [PacketSlot::default(); 64];
        loop {
            let n = self.rx.pop_burst(&mut buf).unwrap();
            if n == 0 {
                return;
            }
            for s in &buf[..n] {
                if self.skip > 0 {
                    self.skip -= 1;
                    continue;
                }
                self.skip = continuation_slots(s);
                let (repr, _) = PacketRepr::parse(&s.data[..usize::from(s.hdr_len)]).unwrap();
                let sent = Sent { repr };
                if repr.bth.opcode.info().unwrap().request {
                    requests.push(sent);
                } else {
                    self.responses.push(sent);
                }
            }
        }
    }

    /// Publishes one packet from the peer (payload inline, a multiple of 4 bytes).
    fn push(&mut self, repr: &PacketRepr, payload: &[u8]) {
        assert_eq!(payload.len() % 4, 0);
        let mut s = PacketSlot::default();
        s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
        if !payload.is_empty() {
            s.kind = KIND_INLINE;
            s.payload_len = payload.len() as u32;
            let at = usize::from(s.hdr_len);
            s.data[at..at + payload.len()].copy_from_slice(payload);
        }
        assert_eq!(self.tx.push_burst(&[s]).unwrap(), 1);
    }

    /// A response to this QP's requests: opcode and PSN offset from [`SQ_PSN`] (negative:
    /// before the first request, as an unsolicited Ack's may be).
    fn response(&self, op: Opcode, psn: i32) -> PacketRepr {
        PacketRepr::new(BthRepr::new(
            op,
            self.qp.qpn(),
            Psn::new(SQ_PSN.wrapping_add(psn as u32)),
        ))
    }

    /// The peer acknowledges PSN offset `psn` with `credits` receive WQEs (rounded down
    /// by Table 17-8) and MSN `msn`.
    fn ack(&mut self, psn: i32, credits: u32, msn: u32) {
        self.ack_code(psn, CreditCode::encode(credits), msn);
    }

    fn ack_code(&mut self, psn: i32, credits: CreditCode, msn: u32) {
        let mut r = self.response(Opcode::Acknowledge, psn);
        r.aeth = Some(AethRepr {
            syndrome: Syndrome::Ack { credits },
            msn: Msn::new(msn),
        });
        self.push(&r, &[]);
    }

    fn nak(&mut self, psn: i32, code: NakCode, msn: u32) {
        let mut r = self.response(Opcode::Acknowledge, psn);
        r.aeth = Some(AethRepr {
            syndrome: Syndrome::Nak(code),
            msn: Msn::new(msn),
        });
        self.push(&r, &[]);
    }

    /// The peer answers a one-packet RDMA Read at `psn` with 4 bytes.
    fn read_response(&mut self, psn: i32, credits: u32, msn: u32) {
        let mut r = self.response(Opcode::RdmaReadResponseOnly, psn);
        r.aeth = Some(AethRepr {
            syndrome: Syndrome::Ack {
                credits: CreditCode::encode(credits),
            },
            msn: Msn::new(msn),
        });
        self.push(&r, b"read");
    }

    fn atomic_ack(&mut self, psn: i32, credits: u32, msn: u32) {
        let mut r = self.response(Opcode::AtomicAcknowledge, psn);
        r.aeth = Some(AethRepr {
            syndrome: Syndrome::Ack {
                credits: CreditCode::encode(credits),
            },
            msn: Msn::new(msn),
        });
        r.atomic_ack_eth = Some(crate::wire::AtomicAckEthRepr { orig: 41 });
        self.push(&r, &[]);
    }

    /// Posts `n` receive WQEs of 64 bytes.
    fn post_recv(&mut self, n: u32) {
        for _ in 0..n {
            let id = self.next_wr;
            self.next_wr += 1;
            let sge = [self.mr.sge((id % 256) * 64, 64).unwrap()];
            self.qp.post_recv(&RecvWr::new(id, &sge)).unwrap();
        }
    }

    /// Whether posting told the engine about the QP: rang its doorbell (rung again so the
    /// engine still sees it), or, under the engine token (inline mode), put it in the
    /// engine's active set.
    fn doorbell_rung(&self) -> bool {
        let mut rung = Vec::new();
        self.ctx.shared.doorbell.take(|i| rung.push(i));
        for &i in &rung {
            self.ctx.shared.doorbell.ring(i);
        }
        let index = self.qp.index;
        !rung.is_empty() || self.ctx.shared.engine.with(|e| e.is_active(index))
    }

    /// The peer sends a request (AckReq set) with its next PSN; `f` adds the extended
    /// headers.
    fn request(&mut self, op: Opcode, f: impl FnOnce(&mut PacketRepr), payload: &[u8]) {
        let psn = Psn::new(RQ_PSN + self.peer_psn);
        let mut repr = PacketRepr::new(BthRepr::new(op, self.qp.qpn(), psn));
        repr.bth.ack_req = true;
        f(&mut repr);
        self.push(&repr, payload);
        self.peer_psn += 1;
    }

    /// The responses this QP's RQ Logic sent since the last call, as (opcode, PSN offset
    /// from [`RQ_PSN`], credit count, MSN).
    fn answers(&mut self) -> Vec<(Opcode, i32, Option<u32>, u32)> {
        self.run();
        self.responses
            .drain(..)
            .map(|s| {
                let (credits, msn) = s.credits().expect("a positive response");
                (s.op(), s.psn(RQ_PSN) as i32, credits, msn)
            })
            .collect()
    }

    /// Completions with `status`, by work request id.
    fn completed(&self, status: WcStatus) -> Vec<u64> {
        self.wcs
            .iter()
            .filter(|w| w.status == status)
            .map(|w| w.wr_id)
            .collect()
    }
}

/// The flow of request packets as (opcode, PSN offset, AckReq).
fn flow(sent: &[Sent]) -> Vec<Req> {
    sent.iter()
        .map(|s| (s.op(), s.psn(SQ_PSN), s.ack_req()))
        .collect()
}

use Opcode::{
    FetchAdd as Faa, RdmaReadRequest as RdReq, RdmaWriteFirst as WrF,
    RdmaWriteLastWithImmediate as WrLImm, RdmaWriteMiddle as WrM, RdmaWriteOnly as WrO,
    SendFirst as SF, SendLast as SL, SendMiddle as SM, SendOnly as SO,
};

/// Without credits (none reported yet), a Send sends its first packet only, with AckReq,
/// and nothing behind it starts; once the responder acknowledges that first packet (it
/// found a receive WQE for the message), the rest follows.
#[test]
fn without_credit_a_send_sends_its_first_packet_with_ack_req_and_waits() {
    let mut r = rig(Opts::default());
    r.post(K::Send, 600); // PSNs 0..=2
    r.post(K::Send, 100); // 3
    r.post(K::Send, 100); // 4
    assert_eq!(flow(&r.run()), [(SF, 0, true)]);
    assert_eq!(flow(&r.run()), [], "nothing more without an Ack");

    // The first packet is accepted (credits 0: the receive WQE it took was the last).
    r.ack(0, 0, 0);
    assert_eq!(
        flow(&r.run()),
        [(SM, 1, false), (SL, 2, true), (SO, 3, true)],
        "the rest of the Send, then the next Send limited in turn"
    );
    r.ack(3, 0, 2);
    assert_eq!(flow(&r.run()), [(SO, 4, true)]);
    r.ack(4, 0, 3);
    r.run();
    assert_eq!(r.completed(WcStatus::Success), [0, 1, 2]);
}

/// Credits in an unsolicited Ack (a duplicate of the last Ack, spec/02) let a limited Send
/// go on; an update that grants nothing does not.
#[test]
fn credits_in_an_unsolicited_ack_let_a_limited_send_go_on() {
    let mut r = rig(Opts::default());
    r.post(K::Send, 600);
    assert_eq!(flow(&r.run()), [(SF, 0, true)]);
    r.ack(-1, 0, 0);
    assert_eq!(flow(&r.run()), [], "0 credits grant nothing");
    r.ack(-1, 1, 0);
    assert_eq!(flow(&r.run()), [(SM, 1, false), (SL, 2, true)]);
}

/// The invalid credit code (11111b: a responder on a shared receive queue, or a peer that
/// counts no credits, as RoCE NICs and soft-RoCE send) lets a limited Send go on and lifts
/// the limit for good: later Sends go whole, none limited.
#[test]
fn the_invalid_credit_code_lifts_the_limit() {
    let mut r = rig(Opts::default());
    r.post(K::Send, 600);
    assert_eq!(flow(&r.run()), [(SF, 0, true)]);
    r.ack_code(-1, CreditCode::NONE, 0);
    assert_eq!(flow(&r.run()), [(SM, 1, false), (SL, 2, true)]);
    for _ in 0..3 {
        r.post(K::Send, 600);
    }
    assert_eq!(
        flow(&r.run()),
        [
            (SF, 3, false),
            (SM, 4, false),
            (SL, 5, true),
            (SF, 6, false),
            (SM, 7, false),
            (SL, 8, true),
            (SF, 9, false),
            (SM, 10, false),
            (SL, 11, true),
        ],
        "three Sends, none limited, though no count ever came"
    );
}

/// Figure 17-18: the LSN is the MSN plus the credit count. Each 2-packet Send within it
/// goes whole (AckReq on its last packet only); the first beyond it is limited.
#[test]
fn the_limit_is_the_msn_plus_the_credits() {
    let mut r = rig(Opts::default());
    r.ack(-1, 2, 0); // the initial credits: MSN 0, 2 receive WQEs
    assert_eq!(flow(&r.run()), []);
    for _ in 0..5 {
        r.post(K::Send, 300);
    }
    assert_eq!(
        flow(&r.run()),
        [
            (SF, 0, false),
            (SL, 1, true),
            (SF, 2, false),
            (SL, 3, true),
            (SF, 4, true),
        ]
    );
    // Message 1 done, 2 WQEs posted: LSN 3. The third Send is no longer limited, the
    // fourth is.
    r.ack(1, 2, 1);
    assert_eq!(flow(&r.run()), [(SL, 5, true), (SF, 6, true)]);
    // Message 2 done, 3 WQEs: LSN 5 covers the rest.
    r.ack(3, 3, 2);
    assert_eq!(
        flow(&r.run()),
        [(SL, 7, true), (SF, 8, false), (SL, 9, true)]
    );
    r.ack(9, 3, 5);
    r.run();
    assert_eq!(r.completed(WcStatus::Success), [0, 1, 2, 3, 4]);
}

/// An MSN far back (a message many WQEs ago) still maps to the right message: the LSN
/// counts from the consuming messages up to it, not from the newest.
#[test]
fn the_msn_names_a_message_by_its_send_sequence_number() {
    let mut r = rig(Opts::default());
    r.ack(-1, 24, 0);
    r.run();
    // 20 Sends and 5 Writes interleaved: messages 1..=25.
    for i in 0..25 {
        r.post(if i % 5 == 4 { K::Write } else { K::Send }, 4);
    }
    let sent = r.run();
    assert_eq!(sent.len(), 25);
    assert!(sent.iter().all(|s| s.ack_req()));
    // Messages 1..=7 done (6 Sends, 1 Write), 1 WQE left: LSN 6 + 1 = 7 consuming
    // messages — less than already granted, which stands.
    r.ack(6, 1, 7);
    r.run();
    // Four more Sends, consuming counts 21..=24: the last exactly at the limit.
    for _ in 0..4 {
        r.post(K::Send, 300);
    }
    assert_eq!(
        flow(&r.run()),
        [
            (SF, 25, false),
            (SL, 26, true),
            (SF, 27, false),
            (SL, 28, true),
            (SF, 29, false),
            (SL, 30, true),
            (SF, 31, false),
            (SL, 32, true),
        ],
        "within the 24 credits of the start"
    );
    // Message 12 (consuming count 10: two of the first 12 are Writes) done, 16 WQEs:
    // LSN 26.
    r.ack(11, 16, 12);
    r.run();
    for _ in 0..3 {
        r.post(K::Send, 300); // 25, 26 go whole, 27 is limited
    }
    assert_eq!(
        flow(&r.run()),
        [
            (SF, 33, false),
            (SL, 34, true),
            (SF, 35, false),
            (SL, 36, true),
            (SF, 37, true),
        ]
    );
}

/// spec/02 "LSN + 1 for Each SQ WQE That Doesn't Need RQ WQE": RDMA Writes, Reads and
/// Atomics go without credit and do not use any up; credits arriving on a Read response
/// or an Atomic Acknowledge count like those of an Ack.
#[test]
fn messages_that_need_no_receive_extend_the_limit() {
    let mut r = rig(Opts::default());
    r.ack(-1, 2, 0);
    r.run();
    r.post(K::Send, 300); // message 1, consuming count 1: PSNs 0, 1
    r.post(K::Write, 300); // 2: 2, 3
    r.post(K::Read, 4); // 3: 4
    r.post(K::Send, 300); // 4, count 2: 5, 6
    r.post(K::FetchAdd, 8); // 5: 7
    r.post(K::WriteImm, 600); // 6, count 3, limited: 8, 9, 10
    r.post(K::Send, 300); // 7, count 4: waits
    assert_eq!(
        flow(&r.run()),
        [
            (SF, 0, false),
            (SL, 1, true),
            (WrF, 2, false),
            (Opcode::RdmaWriteLast, 3, true),
            (RdReq, 4, true),
            (SF, 5, false),
            (SL, 6, true),
            (Faa, 7, true),
            (WrF, 8, false),
            (WrM, 9, false),
            (WrLImm, 10, true),
        ],
        "a limited Write with Immediate sends every packet, AckReq on the last"
    );
    // The Read's response says message 3 is done with 2 WQEs posted: LSN 1 + 2 = 3.
    // That covers the Write with Immediate, no longer limited, and the Send behind it
    // starts, limited in turn.
    r.read_response(4, 2, 3);
    assert_eq!(flow(&r.run()), [(SF, 11, true)]);
    // The Atomic's: message 5 done, 2 WQEs: LSN 2 + 2 = 4, the Send's count.
    r.atomic_ack(7, 2, 5);
    assert_eq!(flow(&r.run()), [(SL, 12, true)]);
    r.ack(12, 2, 7);
    r.run();
    assert_eq!(r.completed(WcStatus::Success), [0, 1, 2, 3, 4, 5, 6]);
}

/// A limited Write with Immediate needs its receive WQE only at its last packet, so an
/// Ack of an earlier packet does not lift the limit; an Ack of the last one does.
#[test]
fn a_limited_write_with_immediate_waits_for_its_last_packet_to_be_accepted() {
    let mut r = rig(Opts::default());
    r.post(K::WriteImm, 600);
    r.post(K::Send, 4);
    assert_eq!(
        flow(&r.run()),
        [(WrF, 0, false), (WrM, 1, false), (WrLImm, 2, true)]
    );
    r.ack(0, 0, 0);
    assert_eq!(
        flow(&r.run()),
        [],
        "its first packet accepted, not the message"
    );
    r.ack(2, 0, 1);
    assert_eq!(flow(&r.run()), [(SO, 3, true)]);
}

/// spec/02 "Obey the Ordering Rules": requests that need no receive WQE do not overtake a
/// limited one; and they do not become limited themselves.
#[test]
fn nothing_overtakes_a_limited_send_and_writes_reads_atomics_are_never_limited() {
    let mut r = rig(Opts::default());
    r.post(K::Send, 300);
    r.post(K::Write, 4);
    r.post(K::Read, 4);
    r.post(K::FetchAdd, 8);
    assert_eq!(flow(&r.run()), [(SF, 0, true)]);
    r.ack(0, 0, 0);
    assert_eq!(
        flow(&r.run()),
        [
            (SL, 1, true),
            (WrO, 2, true),
            (RdReq, 3, true),
            (Faa, 4, true)
        ]
    );

    // Without credit, Writes, Reads and Atomics go one after another, and a Send after
    // them is limited.
    let mut r = rig(Opts::default());
    r.post(K::Write, 300);
    r.post(K::Write, 4);
    r.post(K::Read, 600);
    r.post(K::FetchAdd, 8);
    r.post(K::Send, 300);
    assert_eq!(
        flow(&r.run()),
        [
            (WrF, 0, false),
            (Opcode::RdmaWriteLast, 1, true),
            (WrO, 2, true),
            (RdReq, 3, true),
            (Faa, 6, true),
            (SF, 7, true),
        ]
    );
}

/// An Ack of earlier messages without new credit leaves a limited Send limited: the Send
/// behind them neither finishes nor lets the next one start.
#[test]
fn a_limited_send_stays_limited_while_earlier_messages_complete() {
    let mut r = rig(Opts::default());
    r.ack(-1, 1, 0);
    r.run();
    r.post(K::Send, 300);
    r.post(K::Send, 300);
    r.post(K::Send, 4);
    assert_eq!(
        flow(&r.run()),
        [(SF, 0, false), (SL, 1, true), (SF, 2, true)]
    );
    r.ack(1, 0, 1); // message 1 done, no WQE left: LSN 1
    assert_eq!(flow(&r.run()), []);
    assert_eq!(r.completed(WcStatus::Success), [0]);
    r.ack(1, 2, 1); // two WQEs posted since: LSN 3
    assert_eq!(flow(&r.run()), [(SL, 3, true), (SO, 4, true)]);
}

/// Credits never shrink: an older or smaller report after a larger one takes nothing
/// back (a grant cannot be revoked, spec/02).
#[test]
fn credits_never_shrink() {
    let mut r = rig(Opts::default());
    r.ack(-1, 4, 0);
    r.ack(-1, 0, 0);
    r.run();
    for _ in 0..5 {
        r.post(K::Send, 300);
    }
    let sent = flow(&r.run());
    assert_eq!(
        sent.len(),
        9,
        "four Sends whole, the fifth limited: {sent:?}"
    );
    assert_eq!(sent[8], (SF, 8, true));
    // Message 1 done and no WQE left: LSN 1, below the 4 granted.
    r.ack(1, 0, 1);
    assert_eq!(flow(&r.run()), []);
    // Message 2 done and 3 WQEs: LSN 5.
    r.ack(3, 3, 2);
    assert_eq!(flow(&r.run()), [(SL, 9, true)]);
}

/// spec/02 "No Credit Check on Retry Due to Lost Packet": after a PSN Sequence Error Nak
/// every message from the Nak'd PSN on is sent again — also a limited Send's first
/// packet — without waiting for credit; the limited Send's rest still waits.
#[test]
fn go_back_n_resends_without_waiting_for_credit() {
    let mut r = rig(Opts::default());
    r.ack(-1, 2, 0);
    r.run();
    for _ in 0..3 {
        r.post(K::Send, 300);
    }
    let first = flow(&r.run());
    assert_eq!(first.len(), 5, "{first:?}");
    r.nak(0, NakCode::PsnSequenceError, 0);
    assert_eq!(flow(&r.run()), first, "everything again, the same packets");
    assert_eq!(r.ctx.stats().retransmitted, 5);
    r.nak(3, NakCode::PsnSequenceError, 1);
    assert_eq!(flow(&r.run()), first[3..], "from the Nak'd PSN on");
}

/// The transport timer resends a limited Send's first packet, lost with no credit ever
/// reported, and only that packet.
///
/// Timing-proof: the timer runs on the real clock, so a run of the engine may last past it
/// on a loaded machine (a test run in parallel with others, under a debugger) and see the
/// resend already; what must hold is that the first packet goes, a timeout resends it,
/// and nothing else ever goes (the second Send waits for credit).
#[test]
fn a_timeout_resends_a_limited_first_packet_without_credit() {
    // Local Ack Timeout 8 (about 1 ms): well past a run of the engine on an idle machine,
    // soon enough for the test.
    let mut r = rig(Opts {
        timeout: 8,
        ..Opts::default()
    });
    r.post(K::Send, 600);
    r.post(K::Send, 4);
    let mut sent = flow(&r.run());
    assert_eq!(
        sent.first(),
        Some(&(SF, 0, true)),
        "the first packet goes at once"
    );
    let start = std::time::Instant::now();
    while r.ctx.stats().timeouts == 0 || sent.len() < 2 {
        sent.extend(flow(&r.run()));
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "the transport timer never fired: {sent:?}"
        );
    }
    assert!(
        sent.iter().all(|p| *p == (SF, 0, true)),
        "only the limited first packet, again: {sent:?}"
    );
    assert_eq!(
        r.ctx.stats().retransmitted as usize,
        sent.len() - 1,
        "each packet after the first is a resend"
    );
}

/// A remote that reports no credits (CM-negotiated) leaves every message unlimited.
#[test]
fn without_credit_reporting_every_message_is_unlimited() {
    let mut r = rig(Opts {
        remote_credits: false,
        ..Opts::default()
    });
    r.post(K::Send, 300);
    r.post(K::SendImm, 300);
    r.post(K::WriteImm, 4);
    assert_eq!(
        flow(&r.run()),
        [
            (SF, 0, false),
            (SL, 1, true),
            (SF, 2, false),
            (Opcode::SendLastWithImmediate, 3, true),
            (Opcode::RdmaWriteOnlyWithImmediate, 4, true),
        ]
    );
}

/// Credits the peer announces while this QP is still in RTR (spec/02 "Providing Initial
/// Credits") count once it reaches RTS.
#[test]
fn initial_credits_announced_before_rts_are_kept() {
    let mut r = rig(Opts {
        stop_at_rtr: true,
        ..Opts::default()
    });
    r.ack(-1, 2, 0);
    r.run();
    r.enter_rts();
    for _ in 0..3 {
        r.post(K::SendImm, 300);
    }
    assert_eq!(
        flow(&r.run()),
        [
            (SF, 0, false),
            (Opcode::SendLastWithImmediate, 1, true),
            (SF, 2, false),
            (Opcode::SendLastWithImmediate, 3, true),
            (SF, 4, true),
        ]
    );
}

/// The RQ Logic reports in each positive response the receive WQEs posted (Table 17-8,
/// rounded down) and the MSN, which counts every message: Sends and Writes with
/// Immediate use a WQE up, Writes, Reads and Atomics do not.
#[test]
fn responses_report_the_receive_wqes_left_and_count_messages() {
    use crate::wire::{AtomicEthRepr, ImmDtRepr, RethRepr};
    let mut r = rig(Opts::default());
    assert_eq!(
        r.answers(),
        [(Opcode::Acknowledge, -1, Some(0), 0)],
        "the initial credits (spec/02): ePSN - 1, MSN 0"
    );
    r.post_recv(10);
    assert_eq!(r.answers(), [(Opcode::Acknowledge, -1, Some(8), 0)]);
    let target = r.mr.remote(32 << 10);
    let reth = move |len| RethRepr {
        va: target.addr,
        rkey: target.rkey,
        dma_len: len,
    };
    let send = |r: &mut Rig| r.request(SO, |_| {}, b"abcd");
    let mut got = Vec::new();
    send(&mut r);
    got.extend(r.answers());
    send(&mut r);
    got.extend(r.answers());
    r.request(WrO, |p| p.reth = Some(reth(4)), b"wxyz");
    got.extend(r.answers());
    r.request(
        Opcode::RdmaWriteOnlyWithImmediate,
        |p| {
            p.reth = Some(reth(4));
            p.immdt = Some(ImmDtRepr { imm: 5 });
        },
        b"wxyz",
    );
    got.extend(r.answers());
    r.request(RdReq, |p| p.reth = Some(reth(4)), &[]);
    got.extend(r.answers());
    r.request(
        Faa,
        |p| {
            p.atomic_eth = Some(AtomicEthRepr {
                va: target.addr + 8,
                rkey: target.rkey,
                swap_add: 1,
                compare: 0,
            })
        },
        &[],
    );
    got.extend(r.answers());
    for _ in 0..4 {
        send(&mut r);
        got.extend(r.answers());
    }
    use Opcode::{Acknowledge as Ack, AtomicAcknowledge as AAck, RdmaReadResponseOnly as RRO};
    assert_eq!(
        got,
        [
            (Ack, 0, Some(8), 1),
            (Ack, 1, Some(8), 2),
            (Ack, 2, Some(8), 3),
            (Ack, 3, Some(6), 4),
            (RRO, 4, Some(6), 5),
            (AAck, 5, Some(6), 6),
            (Ack, 6, Some(6), 7),
            (Ack, 7, Some(4), 8),
            (Ack, 8, Some(4), 9),
            (Ack, 9, Some(3), 10),
        ]
    );
    assert_eq!(r.answers(), [], "no update while nothing changes");
}

/// While the requester knows of fewer than 4 receive WQEs, a new receive rings the
/// engine's doorbell and the RQ Logic tells the requester in an unsolicited Ack (the
/// last Ack again, with the new count); once it knows of 4 or more, receives are posted
/// silently (no doorbell, no Ack).
#[test]
fn new_receives_are_announced_only_to_a_requester_that_knows_of_none() {
    let mut r = rig(Opts::default());
    assert_eq!(r.answers(), [(Opcode::Acknowledge, -1, Some(0), 0)]);
    let acks = |r: &Rig| r.ctx.stats().acks_sent;
    let before = acks(&r);
    r.post_recv(1);
    assert!(r.doorbell_rung());
    assert_eq!(r.answers(), [(Opcode::Acknowledge, -1, Some(1), 0)]);
    // A requester that knows of one receive WQE is not held back: it sends, and the Ack of
    // what it sends reports the receives posted meanwhile. More receives ring nothing.
    for _ in 0..8 {
        r.post_recv(1);
        assert!(!r.doorbell_rung(), "the requester knows of a receive WQE");
    }
    assert_eq!(r.answers(), []);
    assert_eq!(acks(&r), before + 1);

    // Sends use WQEs up: 9 posted, 8 Sends leave 1 (no watch), the 9th leaves none,
    // reported in its Ack; a receive posted then is announced at once.
    for _ in 0..8 {
        r.request(SO, |_| {}, b"abcd");
    }
    assert_eq!(
        r.answers().pop(),
        Some((Opcode::Acknowledge, 7, Some(1), 8))
    );
    r.post_recv(1);
    assert!(!r.doorbell_rung(), "the requester knows of one");
    r.request(SO, |_| {}, b"abcd");
    assert_eq!(
        r.answers().pop(),
        Some((Opcode::Acknowledge, 8, Some(1), 9))
    );
    r.request(SO, |_| {}, b"abcd");
    assert_eq!(
        r.answers().pop(),
        Some((Opcode::Acknowledge, 9, Some(0), 10))
    );
    r.post_recv(1);
    assert!(r.doorbell_rung());
    assert_eq!(r.answers(), [(Opcode::Acknowledge, 9, Some(1), 10)]);
}

/// A QP with no receives posted (a sender's) tells its requester once that it has none
/// (the initial unsolicited Ack, as before) and then looks for a credit update only when a
/// receive comes: its posts do not call the update for nothing (they did, each one). The
/// requester still learns of the first receive posted.
#[test]
fn a_qp_with_no_receives_posted_looks_for_no_credit_update_per_post() {
    let mut r = rig(Opts {
        remote_credits: false,
        ..Opts::default()
    });
    assert_eq!(r.answers(), [(Opcode::Acknowledge, -1, Some(0), 0)]);
    let before = crate::responder::credit_update_calls();
    for _ in 0..10 {
        r.post(K::Send, 8);
        r.run();
    }
    assert_eq!(
        crate::responder::credit_update_calls(),
        before,
        "no receive was posted: nothing to report"
    );
    assert_eq!(r.answers(), []);
    r.post_recv(1);
    r.run();
    assert_eq!(r.answers(), [(Opcode::Acknowledge, -1, Some(1), 0)]);
}
