//! The peer watcher: how an engine learns, within milliseconds, that a peer went away, and
//! how long a peer has been silent.
//!
//! Every connection keeps its Unix socket open for its life. One background thread per
//! context, started with its first connection, blocks in `poll(2)` on all of them plus an
//! eventfd that wakes it when the set changes. A hang-up (the peer closed the connection,
//! or its process died and the kernel closed the socket) or any byte arriving after setup
//! other than a KEEPALIVE (a protocol error) turns into: the engine processes what the peer
//! already published on the link (so the Ack of the last message it received is not lost),
//! then the connection's QP goes to the Error state, so its work requests complete with
//! flush errors, and when it was the last live connection over its link, the link is torn
//! down.
//!
//! A peer that stops without closing anything (SIGSTOP, a debugger, a hang) keeps its socket
//! open. So the thread also sends a KEEPALIVE ([`Message::Keepalive`], 16 bytes) on every
//! socket every [`KEEPALIVE_INTERVAL`], whatever the traffic, and notes when each peer's
//! last arrived ([`Connection::peer_silent_for`](super::Connection::peer_silent_for)). A
//! connection with a silence limit
//! ([`ConnectParams::peer_silence_limit`](super::ConnectParams::peer_silence_limit)) whose
//! peer stays silent longer ends as if the peer had hung up. A send that would block (a
//! stopped peer's socket buffer is full) is skipped: the peer is silent anyway.
//!
//! This is control path: system calls are fine here, and never happen in the poll loop.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use rustix::event::{EventfdFlags, PollFd, PollFlags};
use rustix::io::Errno;
use rustix::net::{RecvFlags, SendFlags};

use super::msg::{HEADER_LEN, Message};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::link::LinkId;
use crate::wire::Qpn;

/// Engine iterations run to drain a link before a hang-up is acted on (a full default ring
/// of 1024 slots takes 32).
const MAX_DRAIN_POLLS: usize = 256;

/// How often each side's watcher sends a KEEPALIVE on every connection socket.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_millis(100);

/// What a connection and the watcher share.
#[derive(Debug)]
pub(crate) struct ConnStatus {
    /// Whether the peer is still connected; cleared once, by whoever sees the end first.
    pub(crate) live: Arc<AtomicBool>,
    /// Why the peer is gone.
    pub(crate) why: Mutex<Option<String>>,
    /// When the peer was last heard from (set up, or its last KEEPALIVE).
    pub(crate) heard: Mutex<Instant>,
}

impl ConnStatus {
    /// A connection just set up.
    pub(crate) fn new(live: Arc<AtomicBool>) -> ConnStatus {
        ConnStatus {
            live,
            why: Mutex::new(None),
            heard: Mutex::new(Instant::now()),
        }
    }

    /// How long since the peer was last heard from.
    pub(crate) fn silent_for(&self) -> Duration {
        self.heard
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed()
    }

    fn heard_now(&self) {
        *self.heard.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    pub(crate) fn gone_reason(&self) -> Option<String> {
        self.why.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set_gone(&self, why: &str) {
        self.why
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(|| why.to_string());
    }
}

/// A watched connection.
pub(crate) struct Watched {
    pub(crate) stream: Arc<UnixStream>,
    pub(crate) qpn: Qpn,
    pub(crate) link: LinkId,
    pub(crate) status: Arc<ConnStatus>,
    /// The peer is gone once silent this long.
    pub(crate) silence_limit: Option<Duration>,
}

struct List {
    entries: Vec<(u64, Watched)>,
    next_key: u64,
    stop: bool,
}

/// The watched sockets of one context and the eventfd that wakes their thread.
pub(crate) struct Watcher {
    wake: OwnedFd,
    list: Mutex<List>,
}

impl Watcher {
    fn lock(&self) -> MutexGuard<'_, List> {
        self.list.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the watcher thread of a context.
    pub(crate) fn start(shared: &Arc<Device>) -> Result<Arc<Watcher>> {
        let wake = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(|e| Error::io("creating the peer watcher's eventfd", e.into()))?;
        let w = Arc::new(Watcher {
            wake,
            list: Mutex::new(List {
                entries: Vec::new(),
                next_key: 1,
                stop: false,
            }),
        });
        let (thread_w, weak) = (w.clone(), Arc::downgrade(shared));
        std::thread::Builder::new()
            .name("shmhca-cm-watch".into())
            .spawn(move || run(&thread_w, &weak))
            .map_err(|e| Error::io("spawning the peer watcher thread", e))?;
        Ok(w)
    }

    /// Watches a connection; returns its key for [`Watcher::remove`].
    pub(crate) fn add(&self, entry: Watched) -> u64 {
        let key = {
            let mut l = self.lock();
            let key = l.next_key;
            l.next_key += 1;
            l.entries.push((key, entry));
            key
        };
        self.wake();
        key
    }

    /// Stops watching a connection (it is being closed).
    pub(crate) fn remove(&self, key: u64) {
        {
            let mut l = self.lock();
            if let Some(i) = l.entries.iter().position(|(k, _)| *k == key) {
                l.entries.swap_remove(i);
            }
        }
        self.wake();
    }

    /// Ends the thread (its context is gone).
    pub(crate) fn stop(&self) {
        self.lock().stop = true;
        self.wake();
    }

    fn wake(&self) {
        // A full counter (2^64 - 2 wake-ups pending) already wakes the thread; nothing to do
        // about an error here.
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }
}

/// Takes in what a connection socket with events holds. Only KEEPALIVEs may arrive after
/// setup; `pos` is how far into one the previous bytes got (they may come split). Returns
/// why the connection is finished, if it is; records the peer heard from otherwise.
fn take_in(
    stream: &UnixStream,
    revents: PollFlags,
    keepalive: &[u8; HEADER_LEN],
    pos: &mut usize,
    status: &ConnStatus,
) -> Option<String> {
    const CLOSED: &str = "the peer closed the connection or its process ended";
    if revents.intersects(PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR | PollFlags::NVAL) {
        return Some(CLOSED.into());
    }
    // Bounded: a peer flooding keepalives gets a few reads per wake-up, no more.
    for _ in 0..4 {
        let mut b = [0u8; 4 * HEADER_LEN];
        match rustix::net::recv(stream, &mut b[..], RecvFlags::DONTWAIT) {
            Ok((0, _)) => return Some(CLOSED.into()),
            Ok((n, _)) => {
                let mut heard = false;
                for &byte in &b[..n] {
                    if byte != keepalive[*pos] {
                        return Some(
                            "the peer sent data other than keepalives on the connection socket after setup (a protocol error); the connection was closed"
                                .into(),
                        );
                    }
                    *pos = (*pos + 1) % HEADER_LEN;
                    heard |= *pos == 0;
                }
                if heard {
                    status.heard_now();
                }
                if n < b.len() {
                    return None;
                }
            }
            Err(Errno::AGAIN | Errno::INTR) => return None,
            Err(e) => return Some(format!("the connection socket failed: {e}")),
        }
    }
    None
}

/// Sends a KEEPALIVE on `stream`, never blocking. A full socket buffer (a stopped peer) or
/// a failure (a peer gone, which `poll` reports next) is no error here.
fn send_keepalive(stream: &UnixStream, keepalive: &[u8; HEADER_LEN]) {
    let _ = rustix::net::send(stream, keepalive, SendFlags::DONTWAIT | SendFlags::NOSIGNAL);
}

fn run(w: &Arc<Watcher>, shared: &Weak<Device>) {
    let keepalive: [u8; HEADER_LEN] = Message::Keepalive
        .encode()
        .try_into()
        .expect("a KEEPALIVE is a header alone");
    // Per connection (by key): how far into a KEEPALIVE its bytes have got.
    let mut partial: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    let mut next_send = Instant::now();
    loop {
        #[allow(clippy::type_complexity)]
        let watched: Vec<(u64, Arc<UnixStream>, Arc<ConnStatus>, Option<Duration>)> = {
            let l = w.lock();
            if l.stop {
                return;
            }
            l.entries
                .iter()
                .map(|(k, e)| (*k, e.stream.clone(), e.status.clone(), e.silence_limit))
                .collect()
        };
        partial.retain(|k, _| watched.iter().any(|(key, ..)| key == k));
        let now = Instant::now();
        if now >= next_send {
            for (_, s, _, _) in &watched {
                send_keepalive(s, &keepalive);
            }
            next_send = now + KEEPALIVE_INTERVAL;
        }
        let mut gone: Vec<(u64, String)> = watched
            .iter()
            .filter_map(|(k, _, status, limit)| {
                let limit = (*limit)?;
                let silent = status.silent_for();
                (silent > limit).then(|| {
                    (
                        *k,
                        format!(
                            "the peer sent no keepalive for {silent:.1?} (its watcher sends one every {KEEPALIVE_INTERVAL:?}): its process is stopped, hung or starved (ConnectParams::peer_silence_limit is {limit:?})"
                        ),
                    )
                })
            })
            .collect();
        if gone.is_empty() {
            let mut fds = Vec::with_capacity(watched.len() + 1);
            fds.push(PollFd::new(&w.wake, PollFlags::IN));
            for (_, s, _, _) in &watched {
                fds.push(PollFd::from_borrowed_fd(
                    s.as_fd(),
                    PollFlags::IN | PollFlags::RDHUP,
                ));
            }
            let timeout = (!watched.is_empty()).then(|| {
                let left = next_send.saturating_duration_since(Instant::now());
                rustix::time::Timespec {
                    tv_sec: left.as_secs() as i64,
                    tv_nsec: i64::from(left.subsec_nanos()),
                }
            });
            match rustix::event::poll(&mut fds, timeout.as_ref()) {
                Ok(_) | Err(Errno::INTR) => {}
                Err(_) => {
                    // Cannot happen with valid descriptors; do not spin if it does.
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    continue;
                }
            }
            let woken = !fds[0].revents().is_empty();
            gone = watched
                .iter()
                .zip(&fds[1..])
                .filter(|(_, f)| !f.revents().is_empty())
                .filter_map(|((k, s, status, _), f)| {
                    let pos = partial.entry(*k).or_insert(0);
                    take_in(s, f.revents(), &keepalive, pos, status).map(|why| (*k, why))
                })
                .collect();
            drop(fds);
            if woken {
                let mut b = [0u8; 8];
                let _ = rustix::io::read(&w.wake, &mut b);
            }
        }
        for (key, why) in gone {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let entry = {
                let mut l = w.lock();
                match l.entries.iter().position(|(k, _)| *k == key) {
                    Some(i) => l.entries.swap_remove(i).1,
                    None => continue, // closed by its owner meanwhile
                }
            };
            peer_gone(&shared, &entry, &why);
        }
    }
}

/// The peer of `entry` is gone: error its QP, close the socket, update the link.
fn peer_gone(shared: &Arc<Device>, entry: &Watched, why: &str) {
    entry.status.set_gone(why);
    crate::cm::CmState::of(shared)
        .links
        .hang_up(&shared.engine, entry.link, why, |e| {
            // Hear the peer's last words first: what it published on the link before its socket
            // closed (the Ack of the last message it received, say) is processed before the QP
            // goes to the Error state. Bounded, in case the peer engine is still sending over
            // other connections.
            for _ in 0..MAX_DRAIN_POLLS {
                if e.poll(&shared.doorbell) == 0 {
                    break;
                }
            }
            // Cleared while holding the engine, before any flushed completion exists: whoever
            // sees a flush sees the connection gone, and `Connection::is_peer_connected`, by
            // taking the engine once when it finds the flag clear, sees the QP in Error.
            let was_live = entry.status.live.swap(false, Ordering::AcqRel);
            e.peer_gone(entry.qpn);
            was_live
        });
    let _ = entry.stream.shutdown(std::net::Shutdown::Both);
}
