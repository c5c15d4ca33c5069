//! A completion is the application's signal that the work request's resources are free
//! again: its queue slot can take a new request, its memory regions can be deregistered.
//!
//! Each side keeps its queue filled to capacity and, on every completion, checks that the
//! completed request's region can be deregistered (deregistering it now and then) and posts
//! a new request in its place — while another thread runs the engine (the engine thread in
//! poll mode, a progress thread in inline mode). The re-post never meets a full queue, the
//! region is never busy.
//!
//! Found by the trust review (issue 8, item 6): completions were pushed before the queue
//! slot and the regions' in-flight counts were released.
mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use shmhca::*;

/// Messages per run; override with `SHMHCA_REPOST_MESSAGES` (a million, say, in release).
/// The default runs in a few seconds in a debug build, enough for the completions of the
/// old code to overtake their releases many times over.
const DEFAULT_MESSAGES: u64 = 1_000_000;

/// One completed request in this many has its region deregistered (and a new one
/// registered, which waits for the engine); the others have their region checked as
/// `Mr::deregister` checks it, and reused.
const DEREGISTER_EVERY: u64 = 8;

/// Queue depth on both sides. Every queue is kept full; a deep send queue lets one Ack
/// retire many sends at once.
const DEPTH: u32 = 64;

/// The longest a side may go without a completion before the run is declared stalled (a
/// liveness guard only).
const STALL: Duration = Duration::from_secs(30);

fn messages() -> u64 {
    std::env::var("SHMHCA_REPOST_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_MESSAGES)
}

fn ctx(mode: EngineMode) -> Context {
    Context::builder()
        .arena_size(16 << 20)
        .huge_pages(shmhca_rings::HugePages::Never)
        .mode(mode)
        // The engine thread yields when idle: the test's threads may outnumber the cores.
        .idle(IdlePolicy::Backoff {
            spins: 16,
            max_sleep: Duration::from_micros(50),
        })
        .build()
        .unwrap()
}

/// What one side saw go wrong.
#[derive(Debug, Default, PartialEq, Eq)]
struct Misses {
    queue_full: u64,
    mr_busy: u64,
}

/// Deregisters `mr`, counting the refusals, until it succeeds.
fn deregister(mut mr: Mr, misses: &mut Misses) {
    loop {
        match mr.deregister() {
            Ok(()) => return,
            Err(r) if matches!(r.error(), Error::MrBusy { .. }) => {
                misses.mr_busy += 1;
                mr = r.into_value();
                std::thread::yield_now();
            }
            Err(r) => panic!("deregister: {r}"),
        }
    }
}

/// Runs `post` until it succeeds, counting the queue-full refusals.
fn post_counting(misses: &mut Misses, mut post: impl FnMut() -> Result<()>) {
    loop {
        match post() {
            Ok(()) => return,
            Err(Error::QueueFull { .. }) => {
                misses.queue_full += 1;
                std::thread::yield_now();
            }
            Err(e) => panic!("post: {e}"),
        }
    }
}

/// One side's application: keeps `DEPTH` requests posted, each with a region of its own,
/// for `n` messages. On each completion it checks that the completed request's region
/// could be deregistered (and, one in [`DEREGISTER_EVERY`], deregisters it), then posts the
/// next request with a region registered beforehand — right after the completion is seen,
/// while another thread may still be running the engine.
struct Side<'a> {
    pd: Pd,
    cq: Cq,
    qp: Qp,
    /// The region of each posted request, by `wr_id % DEPTH`.
    bufs: Vec<Option<Mr>>,
    /// Regions allocated for the next posts.
    spare: Vec<Mr>,
    access: AccessFlags,
    /// Posts request `seq` with region `mr`.
    post: &'a dyn Fn(&mut Qp, u64, &Mr) -> Result<()>,
    /// Checks completion `wc` of request `seq`, whose region is `mr`.
    check: &'a dyn Fn(&WorkCompletion, u64, &Mr),
    misses: Misses,
}

impl<'a> Side<'a> {
    fn new(
        (pd, cq, qp): (Pd, Cq, Qp),
        access: AccessFlags,
        post: &'a dyn Fn(&mut Qp, u64, &Mr) -> Result<()>,
        check: &'a dyn Fn(&WorkCompletion, u64, &Mr),
    ) -> Side<'a> {
        Side {
            pd,
            cq,
            qp,
            bufs: (0..DEPTH).map(|_| None).collect(),
            spare: Vec::new(),
            access,
            post,
            check,
            misses: Misses::default(),
        }
    }

    fn run(mut self, n: u64) -> Misses {
        let depth = u64::from(DEPTH);
        self.refill_spares();
        let mut next = 0;
        while next < n.min(depth) {
            self.post(next);
            next += 1;
        }
        self.refill_spares();
        let (mut done, mut last) = (0, Instant::now());
        let mut wcs = [WorkCompletion::default(); DEPTH as usize];
        while done < n {
            let got = self.cq.poll(&mut wcs);
            if got == 0 {
                // The test's threads may outnumber the cores: let the others run.
                std::thread::yield_now();
                assert!(last.elapsed() < STALL, "stalled at {done} of {n}");
                continue;
            }
            last = Instant::now();
            for wc in &wcs[..got] {
                let mr = self.bufs[(wc.wr_id % depth) as usize]
                    .take()
                    .expect("a region per posted request");
                (self.check)(wc, done, &mr);
                // The region first: its release is the narrower race.
                if done % DEREGISTER_EVERY == 0 {
                    deregister(mr, &mut self.misses);
                } else {
                    // What `deregister` checks, without the cost of registering anew.
                    while mr.in_flight() != 0 {
                        self.misses.mr_busy += 1;
                        std::thread::yield_now();
                    }
                    self.spare.push(mr);
                }
                done += 1;
                if next < n {
                    self.post(next);
                    next += 1;
                }
            }
            self.refill_spares();
        }
        self.misses
    }

    fn post(&mut self, seq: u64) {
        let mr = self.spare.pop().expect("a spare region per free slot");
        let (qp, misses, post) = (&mut self.qp, &mut self.misses, self.post);
        post_counting(misses, || post(qp, seq, &mr));
        self.bufs[(seq % u64::from(DEPTH)) as usize] = Some(mr);
    }

    fn refill_spares(&mut self) {
        while self.spare.len() < DEPTH as usize {
            self.spare.push(self.pd.alloc_mr(8, self.access).unwrap());
        }
    }
}

/// Runs `messages()` Sends from A to B with both queues kept full; in inline mode a
/// progress thread runs both engines alongside the applications' threads.
fn run(mode: EngineMode) {
    let n = messages();
    let (ca, cb) = (ctx(mode), ctx(mode));
    let (la, lb) = ca.link_with(&cb).unwrap();
    let p = Params {
        caps: QpCaps {
            max_send_wr: DEPTH,
            max_recv_wr: DEPTH,
            ..QpCaps::default()
        },
        ..Params::default()
    };
    let End {
        ctx: ca,
        pd: pa,
        cq: qa_cq,
        qp: mut qa,
        ..
    } = end(ca, la, &p);
    let End {
        ctx: cb,
        pd: pb,
        cq: qb_cq,
        qp: mut qb,
        ..
    } = end(cb, lb, &p);
    let (na, nb) = (qa.qpn(), qb.qpn());
    connect(&mut qa, la, nb, p.psn_a, p.psn_b, &p);
    connect(&mut qb, lb, na, p.psn_b, p.psn_a, &p);
    let stop = AtomicBool::new(false);
    let (sent, received) = std::thread::scope(|s| {
        if mode == EngineMode::Inline {
            // One thread runs both engines besides the applications' own polls (which run
            // their engine whenever this thread does not).
            let (ca, cb, stop) = (&ca, &cb, &stop);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if ca.progress() + cb.progress() == 0 {
                        std::thread::yield_now();
                    }
                }
            });
        }
        let rx = s.spawn(move || {
            Side::new(
                (pb, qb_cq, qb),
                AccessFlags::LOCAL_WRITE,
                &|qp, seq, mr| qp.post_recv(&RecvWr::new(seq, &[mr.sge(0, 8)?])),
                &|wc, seq, mr| {
                    assert_eq!(
                        (wc.wr_id, wc.status, wc.byte_len),
                        (seq, WcStatus::Success, 8),
                        "{wc:?}"
                    );
                    let mut got = [0u8; 8];
                    mr.read_at(0, &mut got).unwrap();
                    assert_eq!(u64::from_le_bytes(got), seq, "messages arrive in order");
                },
            )
            .run(n)
        });
        let tx = s.spawn(move || {
            Side::new(
                (pa, qa_cq, qa),
                AccessFlags::NONE,
                &|qp, seq, mr| {
                    mr.write_at(0, &seq.to_le_bytes())?;
                    qp.post_send(&SendWr::new(seq, SendOp::Send, &[mr.sge(0, 8)?]))
                },
                &|wc, seq, _| {
                    assert_eq!((wc.wr_id, wc.status), (seq, WcStatus::Success), "{wc:?}");
                },
            )
            .run(n)
        });
        let (tx, rx) = (tx.join(), rx.join());
        stop.store(true, Ordering::Relaxed);
        (tx.unwrap(), rx.unwrap())
    });
    assert_eq!(
        (sent, received),
        (Misses::default(), Misses::default()),
        "after {n} messages: (sender, receiver)"
    );
}

#[test]
fn reposting_on_every_completion_never_finds_the_queue_full_or_the_region_busy_poll_mode() {
    run(EngineMode::Poll { cpu: None });
}

#[test]
fn reposting_on_every_completion_never_finds_the_queue_full_or_the_region_busy_inline_mode() {
    run(EngineMode::Inline);
}
