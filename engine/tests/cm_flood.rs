//! Issue 24 item 6: clients that connect to a listener and never say a word (half-open
//! handshakes) must not lock a well-behaved client out. A thousand silent connections, held
//! by another process or by this one, and a new client still connects: the listener bounds
//! the handshakes in progress per peer process and in all, evicting the oldest stalled
//! one, and closes what it evicts.
mod cm_support;

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cm_support::*;
use shmhca::cm::{ConnectParams, Listener, MAX_HANDSHAKES_PER_PEER};
use shmhca::*;

/// Silent connections held open.
const FLOOD: usize = 1000;

/// Raises this process's soft limit on open descriptors to at least `n` (within the hard
/// limit; a test that needs more than the hard limit allows says so and fails).
fn raise_nofile(n: u64) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut lim = getrlimit(Resource::Nofile);
    if lim.current.is_some_and(|c| c >= n) || lim.current.is_none() {
        return;
    }
    assert!(
        lim.maximum.is_none_or(|m| m >= n),
        "this test needs {n} open descriptors, the hard limit is {:?}: raise it (ulimit -Hn)",
        lim.maximum
    );
    lim.current = Some(n);
    setrlimit(Resource::Nofile, lim).expect("raising RLIMIT_NOFILE");
}

/// Descriptors open in this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Opens `n` connections to `path`, blocking as long as the listener's backlog is full
/// (bounded by [`DEADLINE`]).
fn hold(path: &Path, n: usize) -> Vec<UnixStream> {
    let start = Instant::now();
    (0..n)
        .map(|i| {
            loop {
                match UnixStream::connect(path) {
                    Ok(s) => break s,
                    // A full backlog refuses with EAGAIN on some kernels: wait for room.
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        assert!(start.elapsed() < DEADLINE, "connection {i}: {e}");
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) => panic!("connection {i} of {n}: {e}"),
                }
            }
        })
        .collect()
}

/// The peer process: holds [`FLOOD`] silent connections to the listener at `dir/svc.sock`,
/// says so by creating `dir/held`, and keeps them until `dir/stop` appears.
fn flooder(dir: &Path) {
    raise_nofile(FLOOD as u64 + 64);
    let held = hold(&dir.join("svc.sock"), FLOOD);
    std::fs::write(dir.join("held"), held.len().to_string()).unwrap();
    let start = Instant::now();
    while !dir.join("stop").exists() {
        assert!(start.elapsed() < DEADLINE, "never told to stop");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(held);
}

/// A well-behaved client's thread: how its connect went (how long it took, its error),
/// the sender that tells it to leave, the thread.
type Client = (
    mpsc::Receiver<(Duration, std::result::Result<(), String>)>,
    mpsc::Sender<()>,
    std::thread::JoinHandle<()>,
);

/// A well-behaved client in a thread of its own (its own context): connects to `path`
/// with the default parameters and sends back how long that took and how it went, then
/// keeps its connection until `done` says so.
fn client(path: std::path::PathBuf) -> Client {
    let (tx, rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let h = std::thread::spawn(move || {
        let ctx = context(4 << 20);
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let start = Instant::now();
        let r = ctx.connect(&path, &pd, &cq, &cq, &ConnectParams::default());
        let took = start.elapsed();
        let _ = tx.send((took, r.as_ref().map(drop).map_err(|e| e.to_string())));
        let _ = done_rx.recv_timeout(DEADLINE);
        drop(r);
    });
    (rx, done_tx, h)
}

/// The listener's side of a flood: accepts (the silent clients' handshakes fail or are
/// evicted, which is not the test's business) until the well-behaved client has
/// connected (its QP in RTS); returns its connection, which the client has left since. `flood_held` tells when the flood is in place: only
/// then does the client start. Checks on the way that the listener holds no more
/// descriptors than its bounds allow.
fn serve_through_flood(
    ctx: &Context,
    l: &Listener,
    path: &Path,
    flood_held: impl Fn() -> bool,
    fds_before: usize,
) -> Connection {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let params = ConnectParams::default();
    let start = Instant::now();
    let try_accept = || {
        assert!(start.elapsed() < DEADLINE, "no connection in {DEADLINE:?}");
        match l.try_accept(Duration::from_millis(20), &pd, &cq, &cq, &params) {
            Ok(c) => c,
            Err(e) => {
                // A silent client's handshake that timed out: the listener goes on.
                assert!(e.to_string().contains("no REQ"), "{e}");
                None
            }
        }
    };
    while !flood_held() {
        assert!(try_accept().is_none(), "nobody else connects yet");
    }
    let (result, done, h) = client(path.to_path_buf());
    let conn = loop {
        if let Some(c) = try_accept() {
            break c;
        }
        if let Ok((_, Err(e))) = result.try_recv() {
            panic!("the well-behaved client failed during the flood: {e}");
        }
    };
    let (took, r) = result.recv_timeout(DEADLINE).expect("the client's answer");
    r.expect("the well-behaved client connects");
    eprintln!("a new client connected in {took:?} with {FLOOD} silent connections held");
    // Evicted handshakes are closed: this process holds at most the bounds' worth of the
    // flood's sockets (and the new connection's few descriptors).
    let held = open_fds().saturating_sub(fds_before);
    assert!(
        held <= MAX_HANDSHAKES_PER_PEER + 32,
        "{held} descriptors more than before the flood: evicted handshakes leak"
    );
    assert_eq!(conn.state(), QpState::Rts);
    done.send(()).unwrap();
    h.join().unwrap();
    conn
}

/// A thousand silent connections from another process, then a new client: it connects.
#[test]
fn a_flood_of_silent_connections_from_another_process_does_not_lock_a_client_out() {
    if let Some((role, arg)) = role() {
        if role == "flooder" {
            flooder(Path::new(&arg));
        }
        return;
    }
    let _serial = serial();
    let dir = SockDir::new("flood-other");
    let path = dir.sock("svc.sock");
    let ctx = context(4 << 20);
    let l = ctx.listen(&path).unwrap();
    // The first accept call starts the context's connection watcher: counted in before.
    let (pd, cq) = (ctx.alloc_pd().unwrap(), ctx.create_cq(16).unwrap());
    let params = ConnectParams::default();
    assert!(
        l.try_accept(Duration::ZERO, &pd, &cq, &cq, &params)
            .unwrap()
            .is_none()
    );
    let fds_before = open_fds();
    let peer = spawn_peer(
        "a_flood_of_silent_connections_from_another_process_does_not_lock_a_client_out",
        "flooder",
        dir.path.to_str().unwrap(),
    );
    let held = dir.sock("held");
    let conn = serve_through_flood(&ctx, &l, &path, || held.exists(), fds_before);
    assert_eq!(std::fs::read_to_string(&held).unwrap(), FLOOD.to_string());
    std::fs::write(dir.sock("stop"), b"").unwrap();
    peer.expect_success();
    // The flood is gone: the handshakes it still held end quietly (closed before a word),
    // and the listener holds none of their descriptors.
    drop(conn);
    let start = Instant::now();
    while l.handshakes_in_progress() != 0 {
        assert!(start.elapsed() < DEADLINE, "{}", l.handshakes_in_progress());
        let r = l.try_accept(Duration::from_millis(20), &pd, &cq, &cq, &params);
        assert!(r.unwrap().is_none());
    }
    let after = open_fds();
    assert!(
        after <= fds_before,
        "{after} descriptors open, {fds_before} before the flood"
    );
    drop(l);
    std::fs::remove_file(dir.sock("stop")).unwrap();
    std::fs::remove_file(held).unwrap();
    dir.assert_empty_and_remove();
}

/// The same flood from this very process (the client's own pid): the new client, the
/// newest handshake of its process, still connects.
#[test]
fn a_flood_of_silent_connections_from_the_clients_own_process_does_not_lock_it_out() {
    let _serial = serial();
    raise_nofile(2 * FLOOD as u64 + 256);
    let dir = SockDir::new("flood-same");
    let path = dir.sock("svc.sock");
    let ctx = context(4 << 20);
    let fds_before = open_fds();
    let l = ctx.listen(&path).unwrap();
    // The flood is opened by a thread while this one accepts (a full backlog would block
    // it otherwise); its sockets count in this process, as the allowance says.
    let (tx, rx) = mpsc::channel();
    let p = path.clone();
    let opener = std::thread::spawn(move || {
        let held = hold(&p, FLOOD);
        tx.send(()).unwrap();
        held
    });
    let ready = std::cell::Cell::new(false);
    let flood_held = || {
        if rx.try_recv().is_ok() {
            ready.set(true);
        }
        ready.get()
    };
    let conn = serve_through_flood(&ctx, &l, &path, flood_held, fds_before + FLOOD);
    let held = opener.join().unwrap();
    assert_eq!(held.len(), FLOOD);
    drop((held, conn, l));
    dir.assert_empty_and_remove();
}
