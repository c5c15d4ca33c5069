//! The empty poll's shortcut ([`Engine::idle_now`](super::Engine::idle_now)) never hides
//! work: an engine that looks idle still takes, at its next poll, a frame its peer
//! published, a doorbell rung, a timer that is due, an Ack it owes and a link gone down.
//! Each test first brings the engine to the state where the shortcut answers (asserted),
//! then makes the work appear without running the engine, then polls once or a few times.

use crate::psn::Psn;
use crate::wire::aeth::{CreditCode, Syndrome};
use crate::wire::opcode::Opcode;
use crate::wire::slot::{KIND_INLINE, PacketSlot};
use crate::wire::{BthRepr, PacketRepr};
use crate::{
    AccessFlags, Context, Cq, Mr, Pd, Qp, QpCaps, QpState, RecvWr, SendOp, SendWr, WcStatus,
    WorkCompletion,
};

const PEER: u32 = 9;

struct Rig {
    ctx: Context,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
    peer: crate::raw_peer::RawEnds,
    link: crate::LinkId,
    _arena: crate::mem::Mem,
}

/// A QP in RTS towards a raw peer (transport timer about 1 ms, no end-to-end credits).
fn rig() -> Rig {
    let ctx = crate::raw_peer::inline_context();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let mut qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
    let (link, peer, arena) = crate::raw_peer::raw_peer_link(&ctx, 64, PEER, 4096);
    crate::raw_peer::connect_to_raw_peer_with_timeout(&mut qp, link, PEER, 0, false, 8);
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    Rig {
        ctx,
        _pd: pd,
        cq,
        qp,
        mr,
        peer,
        link,
        _arena: arena,
    }
}

impl Rig {
    /// Whether the shortcut answers now (it counts one iteration when it does).
    fn idle_now(&self) -> bool {
        let shared = &self.ctx.shared;
        shared.engine.with(|e| e.idle_now(&shared.doorbell))
    }

    /// Polls until the shortcut answers (the set-up's work done, its QPs out of every set).
    fn settle(&self) {
        for _ in 0..10_000 {
            if self.idle_now() {
                return;
            }
            self.ctx.progress();
        }
        panic!("the engine never became idle");
    }

    fn received(&self) -> u64 {
        self.ctx.stats().packets_received
    }

    /// The packets the engine sent to the peer since the last call: (opcode, PSN).
    fn sent(&mut self) -> Vec<(Opcode, u32)> {
        let mut buf = [PacketSlot::default(); 16];
        let mut out = vec![];
        loop {
            let n = self.peer.rx.pop_burst(&mut buf).unwrap();
            if n == 0 {
                return out;
            }
            for s in &buf[..n] {
                let (repr, _) = PacketRepr::parse(&s.data[..usize::from(s.hdr_len)]).unwrap();
                out.push((repr.bth.opcode, repr.bth.psn.get()));
            }
        }
    }

    /// The requests among [`Rig::sent`] (not the QP's Acks: its first is its unsolicited
    /// report of no receive WQEs, spec/02).
    fn requests(&mut self) -> Vec<(Opcode, u32)> {
        let mut sent = self.sent();
        sent.retain(|&(op, _)| op != Opcode::Acknowledge);
        sent
    }

    /// The peer sends a Send Only of 8 bytes at `psn`.
    fn send_from_peer(&mut self, psn: u32) {
        let mut repr =
            PacketRepr::new(BthRepr::new(Opcode::SendOnly, self.qp.qpn(), Psn::new(psn)));
        repr.bth.ack_req = true;
        let mut s = PacketSlot::default();
        s.hdr_len = repr.emit(&mut s.data).unwrap() as u8;
        s.kind = KIND_INLINE;
        s.payload_len = 8;
        let at = usize::from(s.hdr_len);
        s.data[at..at + 8].copy_from_slice(b"8 bytes!");
        assert_eq!(self.peer.tx.push_burst(&[s]).unwrap(), 1);
    }
}

#[test]
fn a_frame_the_peer_publishes_while_the_engine_is_idle_is_taken_at_the_next_poll() {
    let mut r = rig();
    r.settle();
    let before = r.received();
    // An Ack of nothing outstanding: any frame will do, the engine has no other work.
    let ack = Syndrome::Ack {
        credits: CreditCode::NONE,
    };
    let line = crate::raw_peer::ack_line_to(r.qp.qpn(), 0, ack, 0);
    assert_eq!(r.peer.tx.push_burst(&[line]).unwrap(), 1);
    assert!(!r.idle_now(), "a frame waits on the link");
    r.ctx.progress();
    assert_eq!(r.received(), before + 1, "the next poll took the frame");
    r.settle();
}

#[test]
fn a_doorbell_rung_while_the_engine_is_idle_is_answered_at_the_next_poll() {
    let mut r = rig();
    r.settle();
    // Posted while this thread holds the engine: the post rings the doorbell instead of
    // sending (as a post from another thread does while the engine runs).
    let sge = [r.mr.sge(0, 8).unwrap()];
    let wr = SendWr::new(1, SendOp::Send, &sge);
    r.ctx.shared.engine.with(|_| r.qp.post_send(&wr).unwrap());
    assert!(r.ctx.shared.doorbell.rung());
    assert!(!r.idle_now(), "a doorbell rang");
    r.ctx.progress();
    assert_eq!(r.requests(), [(Opcode::SendOnly, 0)]);
}

#[test]
fn a_timer_that_falls_due_while_the_engine_looks_idle_fires() {
    let mut r = rig();
    r.qp.post_send(&SendWr::new(1, SendOp::Send, &[r.mr.sge(0, 8).unwrap()]))
        .unwrap();
    r.ctx.progress();
    assert_eq!(r.requests(), [(Opcode::SendOnly, 0)]);
    // Nothing arrives: the QP waits for its Ack under the transport timer (about 1 ms).
    for _ in 0..100 {
        assert!(!r.idle_now(), "a QP waits for a timer");
        r.ctx.progress();
    }
    let start = std::time::Instant::now();
    while r.ctx.stats().timeouts == 0 {
        assert!(start.elapsed().as_secs() < 20, "the timer never fired");
        r.ctx.progress();
    }
    assert_eq!(r.requests(), [(Opcode::SendOnly, 0)], "sent again");
}

#[test]
fn an_owed_ack_held_back_leaves_though_nothing_else_happens() {
    let mut r = rig();
    // Acks held back one iteration (as with the progress helper) for a QP that replies.
    r.ctx.shared.engine.with(|e| e.hold_acks = true);
    r.qp.post_send(&SendWr::new(1, SendOp::Send, &[r.mr.sge(0, 8).unwrap()]))
        .unwrap();
    r.ctx.progress();
    assert_eq!(r.requests(), [(Opcode::SendOnly, 0)]);
    r.qp.post_recv(&RecvWr::new(2, &[r.mr.sge(8, 8).unwrap()]))
        .unwrap();
    r.ctx.progress();
    r.send_from_peer(0);
    r.ctx.progress();
    let mut wc = [WorkCompletion::default(); 2];
    assert_eq!(r.cq.poll(&mut wc), 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (2, WcStatus::Success));
    // The QP replies (it sent a request): its Ack was held back for a reply to carry.
    // None comes; with nothing else to do, the engine sends the Ack all the same.
    for _ in 0..4 {
        r.ctx.progress();
    }
    let sent = r.sent();
    assert!(
        sent.iter()
            .any(|&(op, psn)| op == Opcode::Acknowledge && psn == 0),
        "the owed Ack left: {sent:?}"
    );
}

#[test]
fn a_link_gone_down_while_the_engine_is_idle_fails_its_qps_at_the_next_poll() {
    let r = rig();
    r.settle();
    let link = r.link;
    r.ctx
        .shared
        .engine
        .with(|e| e.link_down(link, "the test took it down".into()));
    assert!(!r.idle_now(), "its QPs have to learn it");
    r.ctx.progress();
    assert_eq!(r.qp.state(), QpState::Error);
}

#[test]
fn a_receive_posted_while_the_engine_is_idle_is_announced_at_the_next_poll() {
    let mut r = rig();
    r.settle();
    // Its first report (no receive WQE) has left: the requester knows of none.
    let acks = r.sent();
    assert_eq!(acks, [(Opcode::Acknowledge, 0xFF_FFFF)]);
    // Posted under the engine token (inline mode): the QP joins the active set, and the
    // engine no longer looks idle.
    r.qp.post_recv(&RecvWr::new(2, &[r.mr.sge(8, 8).unwrap()]))
        .unwrap();
    assert!(!r.idle_now(), "a receive is to be announced");
    r.ctx.progress();
    assert_eq!(
        r.sent(),
        [(Opcode::Acknowledge, 0xFF_FFFF)],
        "the unsolicited credit update (spec/02)"
    );
    r.settle();
}

#[test]
fn an_idle_engine_still_publishes_its_stats_every_publish_every_polls() {
    // The shortcut counts its polls towards the stats publication (which also looks at the
    // peers' may-sleep words): an idle engine publishes at the same pace as a busy one.
    let r = rig();
    r.settle();
    let published = || r.ctx.shared.engine.with(|e| e.stats_publications);
    let first = published();
    let mut polls = 0;
    while published() == first {
        r.ctx.progress();
        polls += 1;
        assert!(
            polls <= crate::stats_area::PUBLISH_EVERY,
            "no publication in a whole period"
        );
    }
    // From one publication to the next: exactly PUBLISH_EVERY polls, shortcuts included.
    // The publication's iteration is a full one; the next poll finds the engine idle again,
    // and from there the next publication comes after exactly PUBLISH_EVERY - 1 polls.
    r.ctx.progress();
    assert!(r.idle_now(), "idle again right after the publication");
    let second = published();
    for _ in 0..crate::stats_area::PUBLISH_EVERY - 3 {
        r.ctx.progress();
    }
    assert_eq!(published(), second, "published early");
    r.ctx.progress();
    assert_eq!(published(), second + 1, "published late");
}

#[test]
fn a_peer_gets_the_whole_ring_back_once_the_engine_is_idle() {
    // The shortcut never publishes the ring's head: it relies on the full iteration that
    // found the engine idle having published it (`Engine::quiet`). A peer that needs the
    // whole ring must see all of it free once the engine looks idle, also when the engine
    // received less than a quarter of the ring since it last published its head by itself.
    let mut r = rig();
    r.settle();
    let ack = Syndrome::Ack {
        credits: CreditCode::NONE,
    };
    let line = crate::raw_peer::ack_line_to(r.qp.qpn(), 0, ack, 0);
    for round in 0..3 {
        assert_eq!(r.peer.tx.push_burst(&[line; 5]).unwrap(), 5);
        r.settle();
        assert_eq!(
            r.peer.tx.0.free_lines().unwrap(),
            64,
            "round {round}: every line given back"
        );
    }
    // And a frame published now is still seen.
    assert_eq!(r.peer.tx.push_burst(&[line]).unwrap(), 1);
    assert!(!r.idle_now(), "a frame waits on the link");
}
