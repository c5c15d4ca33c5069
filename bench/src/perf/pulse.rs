//! `--roce`'s pulse: the exchange's TCP connection, kept open through the run, says
//! whether the peer's process is still there.
//!
//! Once the parameters are exchanged nothing more goes over that connection until a side
//! ends its run cleanly and writes `bye`. The kernel closes the sockets of a process that
//! ends however it ends (`kill -9` included), so a connection that closes (EOF or reset)
//! without that `bye` means the peer's process ended. Every wait on the control channel
//! ([`IdleWatch`](crate::perf::idle::IdleWatch)) and every measurement loop
//! (`lat`'s `Liveness`) looks at the pulse at the points where it
//! already looks at its QPs and at `--idle-timeout` — only while it finds nothing to do,
//! every so many empty polls, and here at most every [`EVERY`]: one non-blocking `recv`,
//! nothing per message. A peer that died thus ends this side within milliseconds with
//! [`PerfError::PeerGone`] ("the server's process ended …") instead of at its transport
//! retries' end (about 9 s at the default `-u`) or `--idle-timeout`. (A peer host that
//! vanishes from the network closes nothing: the QPs' retries and the idle timeout still
//! catch that.)
//!
//! The clean end: the client sends its goodbye on the control channel, waits for it to be
//! acknowledged, then writes `bye` and exits; the server, having received the goodbye,
//! writes `bye` and exits. A side that has read `bye` takes the close that follows as the
//! clean end it is (the server may still be reading the goodbye off its queue when the
//! client has already gone), and a side that has written `bye` waits for nothing more. A
//! side that fails writes no `bye`: its peer sees its process end (and, if it came, reads
//! its abort message on the control channel, which says why).
//!
//! One `--roce` side runs per process, so the pulse is the process's: [`arm`] registers
//! the connection and the [`Pulse`] it returns unregisters (and closes) it when dropped;
//! without one (shared memory, `--in-process`) [`check`] is a relaxed atomic load.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::perf::error::PerfError;

/// What a side writes at its clean end.
pub const BYE: &[u8] = b"bye\n";
/// The shortest time between two looks at the connection.
pub const EVERY: Duration = Duration::from_millis(10);

/// Whether a connection is registered (read without the lock).
static ARMED: AtomicBool = AtomicBool::new(false);
/// The registered connection.
static WATCHED: Mutex<Option<Watched>> = Mutex::new(None);
/// Numbers the pulses, so that an old one's drop leaves a newer one alone.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// What the pulse says.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// The connection is open and quiet.
    Alive,
    /// The peer wrote `bye`, or this side did: a close is the clean end.
    Done,
    /// The connection closed or failed without a `bye`: why.
    Lost(String),
}

struct Watched {
    generation: u64,
    tcp: TcpStream,
    /// "server" or "client".
    peer: &'static str,
    /// The peer's TCP address, for the message.
    from: String,
    state: State,
    /// The last bytes the peer wrote (to find `bye` however it is cut).
    heard: Vec<u8>,
    next: Instant,
}

impl Watched {
    /// Reads what the connection holds, without blocking, and updates the state.
    fn look(&mut self) {
        let mut b = [0u8; 64];
        while self.state == State::Alive {
            match self.tcp.read(&mut b) {
                Ok(0) => {
                    self.state = State::Lost(format!(
                        "the {}'s process ended (the exchange's TCP connection with {} closed before the end of the run)",
                        self.peer, self.from
                    ));
                }
                Ok(n) => self.heard(&b[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.state = State::Lost(format!(
                        "the {}'s process ended (the exchange's TCP connection with {} failed before the end of the run: {e})",
                        self.peer, self.from
                    ));
                }
            }
        }
    }

    fn heard(&mut self, bytes: &[u8]) {
        self.heard.extend_from_slice(bytes);
        if self.heard.windows(BYE.len()).any(|w| w == BYE) {
            self.state = State::Done;
        }
        // Anything else is not this version's: ignored (the tail is kept for a cut `bye`).
        let keep = self.heard.len().saturating_sub(BYE.len() - 1);
        self.heard.drain(..keep);
    }
}

/// This side's hold on the pulse: dropping it closes the connection.
#[derive(Debug)]
pub struct Pulse {
    generation: u64,
}

/// Watches `tcp`, the exchange's connection with the `peer` ("server" or "client");
/// `early` is what was read from it past the exchange already.
///
/// # Errors
/// The connection cannot be made non-blocking or its address read.
pub fn arm(tcp: TcpStream, peer: &'static str, early: &[u8]) -> Result<Pulse, PerfError> {
    tcp.set_nonblocking(true)
        .map_err(PerfError::io("watching the exchange's TCP connection"))?;
    let from = tcp.peer_addr().map_or_else(
        |_| "the peer".to_string(),
        |a| std::net::SocketAddr::new(a.ip().to_canonical(), a.port()).to_string(),
    );
    let generation = GENERATION.fetch_add(1, Ordering::Relaxed) + 1;
    let mut w = Watched {
        generation,
        tcp,
        peer,
        from,
        state: State::Alive,
        heard: Vec::with_capacity(64),
        next: Instant::now(),
    };
    w.heard(early);
    *lock() = Some(w);
    ARMED.store(true, Ordering::Release);
    Ok(Pulse { generation })
}

impl Pulse {
    /// This side's clean end: writes `bye` (best effort: a peer that has gone reads
    /// nothing) and takes the connection's close as the end from now on.
    pub fn bye(&self) {
        let mut g = lock();
        if let Some(w) = g.as_mut().filter(|w| w.generation == self.generation) {
            // Four bytes into an idle connection's empty buffer: non-blocking is enough.
            let _ = w.tcp.write_all(BYE);
            w.state = State::Done;
        }
    }
}

impl Drop for Pulse {
    fn drop(&mut self) {
        let mut g = lock();
        if g.as_ref().is_some_and(|w| w.generation == self.generation) {
            ARMED.store(false, Ordering::Release);
            *g = None;
        }
    }
}

fn lock() -> std::sync::MutexGuard<'static, Option<Watched>> {
    WATCHED.lock().unwrap_or_else(|e| e.into_inner())
}

/// A look at the pulse, at most every [`EVERY`] (for the waits' and loops' idle checks).
///
/// # Errors
/// [`PerfError::PeerGone`] once the connection has closed without a `bye`.
#[inline]
pub fn check() -> Result<(), PerfError> {
    if !ARMED.load(Ordering::Relaxed) {
        return Ok(());
    }
    check_armed()
}

#[cold]
fn check_armed() -> Result<(), PerfError> {
    let mut g = lock();
    let Some(w) = g.as_mut() else {
        return Ok(());
    };
    if w.state == State::Alive {
        let now = Instant::now();
        if now < w.next {
            return Ok(());
        }
        w.next = now + EVERY;
        w.look();
    }
    match &w.state {
        State::Lost(why) => Err(PerfError::PeerGone(why.clone())),
        _ => Ok(()),
    }
}

/// Why the peer is known to have ended, if it is: a look at the connection now.
pub fn lost() -> Option<String> {
    if !ARMED.load(Ordering::Acquire) {
        return None;
    }
    let mut g = lock();
    let w = g.as_mut()?;
    w.look();
    match &w.state {
        State::Lost(why) => Some(why.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A watch of one end of a fresh connection (not registered: the pulse is the
    /// process's, and other tests run in this one), and the other end.
    fn watched(early: &[u8]) -> (Watched, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut w = Watched {
            generation: 0,
            tcp: a,
            peer: "server",
            from: "127.0.0.1:1".into(),
            state: State::Alive,
            heard: Vec::new(),
            next: Instant::now(),
        };
        w.heard(early);
        (w, b)
    }

    /// Looks until the state is not `Alive` (at most 10 s: the close travels).
    fn settled(w: &mut Watched) -> State {
        let t = Instant::now();
        w.look();
        while w.state == State::Alive && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
            w.look();
        }
        w.state.clone()
    }

    #[test]
    fn a_close_without_bye_is_the_peers_end_and_a_close_after_bye_is_not() {
        // Quiet: alive.
        let (mut w, peer) = watched(b"");
        w.look();
        assert_eq!(w.state, State::Alive);
        // Closed without a word (or after other bytes): the peer's process ended.
        let mut peer = peer;
        peer.write_all(b"hello\n").unwrap();
        drop(peer);
        match settled(&mut w) {
            State::Lost(why) => assert!(why.contains("the server's process ended"), "{why}"),
            other => panic!("{other:?}"),
        }
        // `bye`, cut in two across the exchange's end, then the close: the clean end.
        let (mut w, mut peer) = watched(b"by");
        peer.write_all(b"e\n").unwrap();
        drop(peer);
        assert_eq!(settled(&mut w), State::Done);
        // `bye` after other bytes.
        let (mut w, mut peer) = watched(b"");
        peer.write_all(b"xyz").unwrap();
        peer.write_all(b"bye\n").unwrap();
        drop(peer);
        assert_eq!(settled(&mut w), State::Done);
    }

    /// Unarmed (no `--roce` side in this process): nothing to say, nothing looked at.
    #[test]
    fn an_unarmed_pulse_says_nothing() {
        if !ARMED.load(Ordering::Relaxed) {
            assert!(check().is_ok());
            assert!(lost().is_none());
        }
    }
}
