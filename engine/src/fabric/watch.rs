//! The fabric thread of a context: accepts link requests on the LID's socket (each served
//! by a short-lived handler thread, at most [`MAX_HANDLERS`] at once) and watches the
//! sockets that keep the links, tearing a link down when its peer hangs up. Control path:
//! system calls are fine here, and never happen in the poll loop.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::io::Errno;
use rustix::net::RecvFlags;

use super::Fabric;
use super::setup::{serve, tear_down};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::link::LinkId;

/// Link requests served at once; more wait in the socket's backlog.
pub(crate) const MAX_HANDLERS: u32 = 16;
/// How often the thread looks for torn-down links no QP uses any more.
const SWEEP_EVERY: Duration = Duration::from_millis(500);

/// Starts the fabric thread of `fabric`, which ends when the context is dropped.
pub(crate) fn start(fabric: &Arc<Fabric>, shared: &Arc<Device>) -> Result<()> {
    let (f, weak) = (fabric.clone(), Arc::downgrade(shared));
    std::thread::Builder::new()
        .name("shmhca-fabric".into())
        .spawn(move || run(&f, &weak))
        .map_err(|e| Error::io("spawning the fabric thread", e))?;
    Ok(())
}

fn run(f: &Arc<Fabric>, shared: &Weak<Device>) {
    let mut next_sweep = Instant::now() + SWEEP_EVERY;
    loop {
        if f.stop.load(Ordering::Acquire) || shared.strong_count() == 0 {
            return;
        }
        let socks: Vec<(LinkId, Arc<UnixStream>)> = f
            .lock()
            .peers
            .iter()
            .filter(|p| p.up)
            .filter_map(|p| Some((p.id, p.socket.clone()?)))
            .collect();
        let mut fds = Vec::with_capacity(socks.len() + 2);
        fds.push(PollFd::new(&f.wake, PollFlags::IN));
        fds.push(PollFd::new(&f.listener, PollFlags::IN));
        for (_, s) in &socks {
            fds.push(PollFd::from_borrowed_fd(
                s.as_fd(),
                PollFlags::IN | PollFlags::RDHUP,
            ));
        }
        let timeout = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 200_000_000,
        };
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            Ok(_) | Err(Errno::INTR) => {}
            Err(_) => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        }
        let woken = !fds[0].revents().is_empty();
        let incoming = !fds[1].revents().is_empty();
        let gone: Vec<(LinkId, String)> = socks
            .iter()
            .zip(&fds[2..])
            .filter(|(_, p)| !p.revents().is_empty())
            .filter_map(|((id, s), p)| hung_up(s, p.revents()).map(|why| (*id, why)))
            .collect();
        drop(fds);
        if woken {
            let mut b = [0u8; 8];
            let _ = rustix::io::read(&f.wake, &mut b);
        }
        let Some(sh) = shared.upgrade() else { return };
        if incoming {
            accept_all(f, &sh);
        }
        for (id, why) in gone {
            let mut t = f.lock();
            // Still the link's socket (not replaced meanwhile)?
            if t.peers.iter().any(|p| p.id == id && p.up) {
                tear_down(&sh, &mut t, id, &why);
            }
        }
        fail_after_grace(f, &sh);
        if Instant::now() >= next_sweep {
            sweep(f, &sh);
            next_sweep = Instant::now() + SWEEP_EVERY;
        }
    }
}

/// Why a link socket with events is finished, if it is: a hang-up, or any byte (nothing
/// is sent on it after setup).
fn hung_up(s: &UnixStream, revents: PollFlags) -> Option<String> {
    const CLOSED: &str = "the peer process ended or dropped its context (its fabric socket closed)";
    if revents.intersects(PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR | PollFlags::NVAL) {
        return Some(CLOSED.into());
    }
    let mut b = [0u8; 16];
    match rustix::net::recv(s, &mut b[..], RecvFlags::DONTWAIT) {
        Ok((0, _)) => Some(CLOSED.into()),
        Ok(_) => Some(
            "the peer sent data on the fabric link's socket after setup (a protocol error); the link was torn down"
                .into(),
        ),
        Err(Errno::AGAIN | Errno::INTR) => None,
        Err(e) => Some(format!("the fabric link's socket failed: {e}")),
    }
}

/// Takes every pending connection: a peer of this user gets a handler thread.
fn accept_all(f: &Arc<Fabric>, shared: &Arc<Device>) {
    // Bounded: the rest stay in the backlog for the next round.
    for _ in 0..64 {
        let stream = match f.listener.accept() {
            Ok((s, _)) => s,
            Err(_) => return,
        };
        let same_user =
            rustix::net::sockopt::socket_peercred(&stream).is_ok_and(|c| c.uid.as_raw() == f.uid);
        if !same_user || stream.set_nonblocking(false).is_err() {
            continue; // closed: another user's process is not served
        }
        if f.handlers.fetch_add(1, Ordering::AcqRel) >= MAX_HANDLERS {
            f.handlers.fetch_sub(1, Ordering::AcqRel);
            continue; // closed: the client retries
        }
        let (f2, s2) = (f.clone(), Arc::downgrade(shared));
        let spawned = std::thread::Builder::new()
            .name("shmhca-fabric-req".into())
            .spawn(move || {
                // Errors end the exchange; the client reports them (it sees the close).
                let _ = serve(&s2, &f2, stream);
                f2.handlers.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            f.handlers.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Moves to the Error state the QPs still facing links torn down longer than the
/// context's peer-loss grace ago (those with a request outstanding failed at once,
/// `requester::on_peer_lost`): their receives complete with `WrFlushErr`, and
/// `Qp::last_error` says the peer is gone. Each link once; nothing without a grace.
fn fail_after_grace(f: &Fabric, shared: &Device) {
    let Some(grace) = shared.peer_loss_grace else {
        return;
    };
    let due: Vec<(LinkId, String)> = {
        let mut t = f.lock();
        t.peers
            .iter_mut()
            .filter(|p| {
                p.down_at
                    .as_ref()
                    .is_some_and(|(at, _)| at.elapsed() >= grace)
            })
            .filter_map(|p| p.down_at.take().map(|(_, why)| (p.id, why)))
            .collect()
    };
    if due.is_empty() {
        return;
    }
    for (id, why) in due {
        shared.engine.with(|e| e.fail_link_qps(id, &why));
    }
    // A sleeping engine thread finishes what the Error state left (completions waiting
    // for room in a full CQ).
    shared.kick();
}

/// Removes torn-down links no QP faces any more; first tears down (here too) the links
/// the engine took down by itself (a ring the peer broke), so that their idle QPs get the
/// same grace as those of a peer that hung up.
fn sweep(f: &Fabric, shared: &Device) {
    let up: Vec<LinkId> = f
        .lock()
        .peers
        .iter()
        .filter(|p| p.up)
        .map(|p| p.id)
        .collect();
    if !up.is_empty() {
        let broken: Vec<(LinkId, String)> = shared.engine.with(|e| {
            up.iter()
                .filter_map(|&id| Some((id, e.link_mut(id)?.down.clone()?)))
                .collect()
        });
        for (id, why) in broken {
            let mut t = f.lock();
            if t.peers.iter().any(|p| p.id == id && p.up) {
                tear_down(shared, &mut t, id, &why);
            }
        }
    }
    let mut t = f.lock();
    let down: Vec<LinkId> = t.peers.iter().filter(|p| !p.up).map(|p| p.id).collect();
    if down.is_empty() {
        return;
    }
    let unused: Vec<LinkId> = shared.engine.with(|e| {
        let unused: Vec<LinkId> = down
            .into_iter()
            .filter(|id| {
                !e.qps()
                    .any(|q| q.proto.cfg.dest.is_some_and(|d| d.link == *id))
            })
            .collect();
        for id in &unused {
            e.remove_link(*id);
        }
        unused
    });
    t.peers.retain(|p| !unused.contains(&p.id));
}
