//! The peer watcher: how an engine learns, within milliseconds, that a peer went away.
//!
//! Every connection keeps its Unix socket open for its life. One background thread per
//! context, started with its first connection, blocks in `poll(2)` on all of them plus an
//! eventfd that wakes it when the set changes. A hang-up (the peer closed the connection,
//! or its process died and the kernel closed the socket) or any byte arriving after setup
//! (a protocol error) turns into: the engine processes what the peer already published on
//! the link (so the Ack of the last message it received is not lost), then the connection's
//! QP goes to the Error state, so its work requests complete with flush errors, and when it
//! was the last live connection over its link, the link is torn down.
//!
//! This is control path: system calls are fine here, and never happen in the poll loop.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use rustix::event::{EventfdFlags, PollFd, PollFlags};
use rustix::io::Errno;
use rustix::net::RecvFlags;

use crate::error::{Error, Result};
use crate::link::LinkId;
use crate::verbs::Shared;
use crate::wire::Qpn;

/// Engine iterations run to drain a link before a hang-up is acted on (a full default ring
/// of 1024 slots takes 32).
const MAX_DRAIN_POLLS: usize = 256;

/// What a connection and the watcher share.
#[derive(Debug)]
pub(crate) struct ConnStatus {
    /// Whether the peer is still connected; cleared once, by whoever sees the end first.
    pub(crate) live: Arc<AtomicBool>,
    /// Why the peer is gone.
    pub(crate) why: Mutex<Option<String>>,
}

impl ConnStatus {
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
    pub(crate) fn start(shared: &Arc<Shared>) -> Result<Arc<Watcher>> {
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

/// Why a socket with events is finished, or `None` if it is not.
fn finished(stream: &UnixStream, revents: PollFlags) -> Option<String> {
    if revents.intersects(PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR | PollFlags::NVAL) {
        return Some("the peer closed the connection or its process ended".into());
    }
    let mut b = [0u8; 1];
    match rustix::net::recv(stream, &mut b[..], RecvFlags::PEEK | RecvFlags::DONTWAIT) {
        Ok((0, _)) => Some("the peer closed the connection or its process ended".into()),
        Ok(_) => Some(
            "the peer sent data on the connection socket after setup (a protocol error); the connection was closed"
                .into(),
        ),
        Err(Errno::AGAIN | Errno::INTR) => None,
        Err(e) => Some(format!("the connection socket failed: {e}")),
    }
}

fn run(w: &Arc<Watcher>, shared: &Weak<Shared>) {
    loop {
        let streams: Vec<(u64, Arc<UnixStream>)> = {
            let l = w.lock();
            if l.stop {
                return;
            }
            l.entries
                .iter()
                .map(|(k, e)| (*k, e.stream.clone()))
                .collect()
        };
        let mut fds = Vec::with_capacity(streams.len() + 1);
        fds.push(PollFd::new(&w.wake, PollFlags::IN));
        for (_, s) in &streams {
            fds.push(PollFd::from_borrowed_fd(
                s.as_fd(),
                PollFlags::IN | PollFlags::RDHUP,
            ));
        }
        match rustix::event::poll(&mut fds, None) {
            Ok(_) | Err(Errno::INTR) => {}
            Err(_) => {
                // Cannot happen with valid descriptors; do not spin if it does.
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        }
        let woken = !fds[0].revents().is_empty();
        let gone: Vec<(u64, String)> = streams
            .iter()
            .zip(&fds[1..])
            .filter(|(_, f)| !f.revents().is_empty())
            .filter_map(|((k, s), f)| finished(s, f.revents()).map(|why| (*k, why)))
            .collect();
        drop(fds);
        if woken {
            let mut b = [0u8; 8];
            let _ = rustix::io::read(&w.wake, &mut b);
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
fn peer_gone(shared: &Arc<Shared>, entry: &Watched, why: &str) {
    entry.status.set_gone(why);
    shared
        .cm
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
