//! Completion events between processes: this process sleeps — in
//! `CompChannel::get_event`, in `poll(2)` on the channel's fd, in `Cq::wait` — and is woken
//! by a Send from a peer process; a waiter that asked for solicited events only is not
//! woken by an unsolicited Send and is by a solicited one. The waiter's engine runs inline
//! (driven by the waiting call or the progress helper) or in poll mode with a sleeping
//! engine thread.
mod cm_support;

use std::os::fd::AsFd;
use std::time::Duration;

use cm_support::*;
use shmhca::*;

const INLINE: &str = "a_peer_process_wakes_a_sleeping_waiter_inline";
const POLL: &str = "a_peer_process_wakes_a_sleeping_waiter_poll";

/// What the waiter asks the peer to do (the immediate of its command Send).
const SEND: u32 = 1;
const SEND_SOLICITED: u32 = 2;
const SEND_ON_SECOND: u32 = 3;
const QUIT: u32 = 99;
/// How long the peer sleeps before sending, so that the waiter is asleep by then.
const DELAY: Duration = Duration::from_millis(50);
const MSG: u64 = 512;

/// The bytes of the peer's `n`-th message.
fn message(n: u32) -> Vec<u8> {
    let mut m = pattern(100 + n as usize * 37, n as u8 ^ 0x5c);
    m[..4].copy_from_slice(&n.to_le_bytes());
    m
}

fn backoff() -> IdlePolicy {
    IdlePolicy::Backoff {
        spins: 100,
        max_sleep: Duration::from_millis(100),
    }
}

/// The waiter's side of one connection pair.
struct Waiter {
    channel: CompChannel,
    /// Receives of the first connection: on the channel.
    cq: Cq,
    /// Receives of the second connection: no channel (for `Cq::wait`).
    wcq: Cq,
    /// Every send completion (the commands).
    scq: Cq,
    c1: Connection,
    c2: Connection,
    rx: Mr,
    tx: Mr,
    posted: u32,
    received: u32,
}

impl Waiter {
    /// Asks the peer to do `cmd` (it sends after `DELAY`).
    fn command(&mut self, cmd: u32) {
        let sge = [self.tx.sge(0, 0).unwrap()];
        self.c1
            .post_send(&SendWr::new(u64::from(cmd), SendOp::SendWithImm(cmd), &sge))
            .unwrap();
        let wc = wait(&mut self.scq, 1)[0];
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    }

    /// Posts a receive for the next message on connection 1 (or 2).
    fn post(&mut self, second: bool) {
        let slot = u64::from(self.posted % 8) * MSG;
        self.posted += 1;
        let sge = [self.rx.sge(slot, MSG as u32).unwrap()];
        let c = if second { &mut self.c2 } else { &mut self.c1 };
        c.post_recv(&RecvWr::new(slot, &sge)).unwrap();
    }

    /// Checks the message of completion `wc` (the peer's next one); returns whether it
    /// was solicited.
    fn check(&mut self, wc: WorkCompletion) -> bool {
        assert_eq!(
            (wc.status, wc.opcode),
            (WcStatus::Success, WcOpcode::Recv),
            "{wc:?}"
        );
        let want = message(self.received);
        assert_eq!(wc.byte_len as usize, want.len());
        let mut got = vec![0; want.len()];
        self.rx.read_at(wc.wr_id, &mut got).unwrap();
        assert!(got == want, "message {} is corrupt", self.received);
        self.received += 1;
        wc.solicited
    }
}

/// Waits on the fd as an async runtime would, and takes the event it announces. The fd may
/// be readable once without an event (the engine raised the previous event while the
/// application was collecting it: its eventfd write landed after the read): like any
/// readiness, it is a hint, so a `None` means "wait again", up to the deadline.
fn event_on_fd(ch: &mut CompChannel) -> Option<u32> {
    let until = std::time::Instant::now() + DEADLINE;
    while std::time::Instant::now() < until {
        assert!(poll_fd_readable(ch), "the fd became readable");
        if let Some(cq) = ch.try_get_event().unwrap() {
            return Some(cq);
        }
    }
    None
}

fn poll_fd_readable(ch: &CompChannel) -> bool {
    let fd = ch.as_fd();
    let mut fds = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    let ts = rustix::event::Timespec {
        tv_sec: DEADLINE.as_secs() as _,
        tv_nsec: 0,
    };
    rustix::event::poll(&mut fds, Some(&ts)).unwrap() == 1
}

fn waiter(test: &str, builder: ContextBuilder) {
    let _serial = serial();
    let dir = SockDir::new("events");
    let path = dir.sock("waiter.sock");
    let ctx = builder
        .arena_size(8 << 20)
        .huge_pages(shmhca_rings::HugePages::Never)
        .build()
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let channel = ctx.create_comp_channel().unwrap();
    let cq = ctx.create_cq_with_channel(64, &channel).unwrap();
    let wcq = ctx.create_cq(64).unwrap();
    let scq = ctx.create_cq(64).unwrap();
    let rx = pd.alloc_mr(8 * MSG, AccessFlags::LOCAL_WRITE).unwrap();
    let tx = pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    let listener = ctx.listen(&path).unwrap();
    let peer = spawn_peer(test, "sender", path.to_str().unwrap());
    let p = ConnectParams::default();
    let mut c1 = listener
        .accept_timeout(DEADLINE, &pd, &scq, &cq, &p)
        .unwrap();
    let mut c2 = listener
        .accept_timeout(DEADLINE, &pd, &scq, &wcq, &p)
        .unwrap();
    if c1.peer_private_data() != [1] {
        std::mem::swap(&mut c1, &mut c2);
    }
    assert_eq!(
        (c1.peer_private_data(), c2.peer_private_data()),
        (&[1][..], &[2][..])
    );
    let mut w = Waiter {
        channel,
        cq,
        wcq,
        scq,
        c1,
        c2,
        rx,
        tx,
        posted: 0,
        received: 0,
    };
    let number = w.cq.number();

    // 1. Blocked in get_event, woken by the peer's Send.
    w.post(false);
    w.cq.req_notify(false).unwrap();
    w.command(SEND);
    assert_eq!(w.channel.get_event(Some(DEADLINE)).unwrap(), Some(number));
    let wc = wait(&mut w.cq, 1)[0];
    assert!(!w.check(wc));

    // 2. Blocked in poll(2) on the fd, touching nothing of shmhca: the engine thread (poll
    // mode) or the progress helper (inline) runs the engine and raises the event.
    w.post(false);
    w.cq.req_notify(false).unwrap();
    w.command(SEND);
    assert_eq!(event_on_fd(&mut w.channel), Some(number));
    assert_eq!(w.channel.try_get_event().unwrap(), None, "one event");
    let wc = wait(&mut w.cq, 1)[0];
    assert!(!w.check(wc));

    // 3. Solicited only: an unsolicited Send arrives (its completion is in the queue) and
    // raises no event...
    w.post(false);
    w.post(false);
    w.cq.req_notify(true).unwrap();
    w.command(SEND);
    assert_eq!(
        w.channel.get_event(Some(DELAY * 4)).unwrap(),
        None,
        "an unsolicited Send woke a solicited-only waiter"
    );
    let wc = wait(&mut w.cq, 1)[0];
    assert!(!w.check(wc), "sent unsolicited");
    assert_eq!(
        w.channel.try_get_event().unwrap(),
        None,
        "the unsolicited completion (now in the queue) raised no event"
    );
    // ...while a solicited one wakes the waiter (the arm is still there).
    w.command(SEND_SOLICITED);
    assert_eq!(w.channel.get_event(Some(DEADLINE)).unwrap(), Some(number));
    let wc = wait(&mut w.cq, 1)[0];
    assert!(w.check(wc), "sent solicited");

    // 4. Solicited only, waiting in poll(2) on the fd.
    w.post(false);
    w.cq.req_notify(true).unwrap();
    w.command(SEND_SOLICITED);
    assert_eq!(event_on_fd(&mut w.channel), Some(number));
    let wc = wait(&mut w.cq, 1)[0];
    assert!(w.check(wc));

    // 5. Cq::wait on a queue without a channel.
    w.post(true);
    assert!(
        !w.wcq.wait(Duration::from_millis(20)).unwrap(),
        "nothing yet"
    );
    w.command(SEND_ON_SECOND);
    assert!(
        w.wcq.wait(DEADLINE).unwrap(),
        "Cq::wait returned with nothing"
    );
    let wc = w
        .wcq
        .poll_one()
        .expect("Cq::wait said a completion is there");
    assert!(!w.check(wc));

    w.command(QUIT);
    peer.expect_success();
    assert_eq!(
        w.channel.try_get_event().unwrap(),
        None,
        "nothing left over"
    );
    drop(w);
    drop(listener);
    dir.assert_empty_and_remove();
}

/// The peer: two connections to the waiter; each command it receives on the first is
/// carried out `DELAY` later.
fn sender(path: &str) {
    let ctx = context(8 << 20);
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(64).unwrap();
    let rx = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let tx = pd.alloc_mr(8 * MSG, AccessFlags::NONE).unwrap();
    let p = |i: u8| ConnectParams::default().private_data(vec![i]);
    let mut c1 = ctx.connect(path, &pd, &cq, &cq, &p(1)).unwrap();
    let mut c2 = ctx.connect(path, &pd, &cq, &cq, &p(2)).unwrap();
    let mut n = 0u32;
    loop {
        c1.post_recv(&RecvWr::new(0, &[rx.sge(0, 64).unwrap()]))
            .unwrap();
        let wc = wait(&mut cq, 1)[0];
        assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Recv));
        let cmd = wc.imm_data.expect("a command");
        if cmd == QUIT {
            return;
        }
        std::thread::sleep(DELAY);
        let m = message(n);
        let at = u64::from(n % 8) * MSG;
        tx.write_at(at, &m).unwrap();
        let sge = [tx.sge(at, m.len() as u32).unwrap()];
        let (c, flags) = match cmd {
            SEND => (&mut c1, SendFlags::SIGNALED),
            SEND_SOLICITED => (&mut c1, SendFlags::SIGNALED | SendFlags::SOLICITED),
            SEND_ON_SECOND => (&mut c2, SendFlags::SIGNALED),
            other => panic!("unknown command {other}"),
        };
        c.post_send(&SendWr::new(u64::from(n), SendOp::Send, &sge).flags(flags))
            .unwrap();
        let wc = wait(&mut cq, 1)[0];
        assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Send));
        n += 1;
    }
}

#[test]
fn a_peer_process_wakes_a_sleeping_waiter_inline() {
    if let Some((_, arg)) = role() {
        return sender(&arg);
    }
    waiter(
        INLINE,
        Context::builder().mode(EngineMode::Inline).idle(backoff()),
    );
}

#[test]
fn a_peer_process_wakes_a_sleeping_waiter_poll() {
    if let Some((_, arg)) = role() {
        return sender(&arg);
    }
    waiter(
        POLL,
        Context::builder()
            .mode(EngineMode::Poll { cpu: None })
            .idle(backoff()),
    );
}
