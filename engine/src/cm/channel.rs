//! The socket during a handshake: one message at a time, each side's deadline kept, every
//! byte from the peer checked ([`msg`](super::msg) decodes nothing it has not bounded).
//!
//! The client reads with [`Chan::recv`], blocking up to its handshake deadline; the server
//! never blocks on a client: [`MsgReader`] takes whatever a non-blocking socket holds and
//! hands over a message once it is complete.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use shmhca_rings::fdpass::{recv_with_fds, send_with_fds};

use super::msg::{HEADER_LEN, Header, Message, MsgError, Rej, RejectReason};
use super::params::PeerPolicy;
use crate::device::Device;
use crate::error::Error;

/// How long a wait for the peer lasts between two runs of an inline-mode engine.
pub(super) const INLINE_WAIT: Duration = Duration::from_micros(200);

/// What went wrong in a handshake, and what to tell the peer.
pub(super) struct Fail {
    pub(super) error: Error,
    /// A REJ to send before closing.
    pub(super) reject: Option<RejectReason>,
    /// The peer closed the socket before sending a single byte (a probe, not a client).
    pub(super) closed_before_start: bool,
}

impl Fail {
    /// An error the peer is not told about (it broke the connection, or rejected us).
    pub(super) fn quiet(error: Error) -> Fail {
        Fail {
            error,
            reject: None,
            closed_before_start: false,
        }
    }

    /// An error answered with a REJ carrying the error's text.
    pub(super) fn reject(reason: RejectReason, error: Error) -> Fail {
        Fail {
            error,
            reject: Some(reason),
            closed_before_start: false,
        }
    }
}

/// The socket during a handshake, with a deadline for the whole exchange.
pub(super) struct Chan<'a> {
    pub(super) stream: &'a UnixStream,
    pub(super) path: &'a Path,
    /// "server" or "client": who is at the other end.
    pub(super) peer: &'static str,
    pub(super) deadline: Instant,
    pub(super) timeout: Duration,
    /// An inline-mode engine to run while [`Chan::recv`] waits (the application's thread is
    /// here, not polling its CQs, and the context's other connections need their Acks).
    pub(super) drive: Option<&'a Device>,
}

impl Chan<'_> {
    /// A connection-setup error about this socket path.
    pub(super) fn err(&self, what: impl std::fmt::Display) -> Error {
        Error::Connect(format!("{}: {what}", self.path.display()))
    }

    /// The error of a peer that did not finish in time.
    pub(super) fn late(&self, waiting_for: &str) -> Fail {
        Fail::quiet(self.err(format_args!(
            "no {waiting_for} from the {} within {:?}: the peer stopped half-way (ConnectParams::handshake_timeout sets the limit)",
            self.peer, self.timeout
        )))
    }

    fn remaining(&self, waiting_for: &str) -> std::result::Result<Duration, Fail> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.late(waiting_for));
        }
        Ok(left)
    }

    /// Sends one message (and descriptors). On a non-blocking socket a message that does
    /// not fit at once is an error: the peer does not read.
    pub(super) fn send(
        &self,
        m: &Message,
        fds: &[BorrowedFd<'_>],
    ) -> std::result::Result<(), Fail> {
        let left = self.remaining("room to send")?;
        let _ = self.stream.set_write_timeout(Some(left));
        send_with_fds(self.stream, &m.encode(), fds).map_err(|e| {
            Fail::quiet(self.err(format_args!(
                "sending {} to the {}: {e}",
                m.name(),
                self.peer
            )))
        })
    }

    /// Sends a REJ, ignoring errors (the connection is being abandoned anyway).
    pub(super) fn send_reject(&self, reason: RejectReason, text: String) {
        let _ = self.send(&Message::Rej(Rej { reason, text }), &[]);
    }

    /// Receives one message and at most `max_fds` descriptors with it, blocking until the
    /// deadline.
    pub(super) fn recv(
        &self,
        what: &str,
        max_fds: usize,
    ) -> std::result::Result<(Message, Vec<OwnedFd>), Fail> {
        let mut reader = MsgReader::new(true);
        loop {
            let left = self.remaining(what)?;
            let wait = match self.drive {
                Some(_) => left.min(INLINE_WAIT),
                None => left,
            };
            let _ = self.stream.set_read_timeout(Some(wait));
            if let Some(m) = reader.advance(self, what, max_fds)? {
                return Ok(m);
            }
            if let Some(shared) = self.drive {
                shared.progress();
            }
        }
    }

    /// The error for a message of the wrong type (a REJ is reported as the peer's
    /// rejection).
    pub(super) fn unexpected(&self, expected: &str, got: Message) -> Fail {
        match got {
            Message::Rej(r) => Fail::quiet(self.err(format_args!(
                "the {} rejected the connection ({}): {}",
                self.peer, r.reason, r.text
            ))),
            m => Fail::reject(
                RejectReason::ProtocolError,
                self.err(format_args!(
                    "the {} sent {} where {expected} belongs",
                    self.peer,
                    m.name()
                )),
            ),
        }
    }

    /// Checks the peer's credentials against `policy`.
    pub(super) fn check_peer(&self, policy: PeerPolicy) -> std::result::Result<PeerCred, Fail> {
        let cred = rustix::net::sockopt::socket_peercred(self.stream).map_err(|e| {
            Fail::quiet(self.err(format_args!(
                "reading the {}'s credentials (SO_PEERCRED): {e}",
                self.peer
            )))
        })?;
        let cred = PeerCred {
            pid: cred.pid.as_raw_pid() as u32,
            uid: cred.uid.as_raw(),
        };
        policy.admit(cred.uid).map_err(|why| {
            Fail::reject(
                RejectReason::PeerRefused,
                self.err(format_args!(
                    "refused the {} (pid {}): {why}",
                    self.peer, cred.pid
                )),
            )
        })?;
        Ok(cred)
    }
}

/// One message being received: its header, then its body, as the bytes arrive. Holds at
/// most a header and [`MAX_BODY`](super::msg::MAX_BODY) bytes, and the descriptors that
/// came with them (closed if the message is abandoned).
pub(super) struct MsgReader {
    buf: Vec<u8>,
    /// Bytes of `buf` received.
    got: usize,
    fds: Vec<OwnedFd>,
    /// Whether this is the first message on the socket (a peer closing before sending a
    /// byte of it is a probe, not a client).
    first: bool,
}

impl MsgReader {
    pub(super) fn new(first: bool) -> MsgReader {
        MsgReader {
            buf: vec![0; HEADER_LEN],
            got: 0,
            fds: Vec::new(),
            first,
        }
    }

    /// Reads what the socket holds (waiting no longer than its read timeout, or not at all
    /// if it is non-blocking); returns the message once complete, `None` while it is not.
    ///
    /// # Errors
    /// A [`Fail`] when the peer closed the socket, sent a malformed message or more than
    /// `max_fds` descriptors, or the socket failed.
    pub(super) fn advance(
        &mut self,
        chan: &Chan<'_>,
        what: &str,
        max_fds: usize,
    ) -> std::result::Result<Option<(Message, Vec<OwnedFd>)>, Fail> {
        let malformed = |e: MsgError| {
            let reason = match e {
                MsgError::Version { .. } => RejectReason::UnsupportedVersion,
                _ => RejectReason::ProtocolError,
            };
            Fail::reject(
                reason,
                chan.err(format_args!("malformed {what} from the {}: {e}", chan.peer)),
            )
        };
        loop {
            if self.got == self.buf.len() {
                if self.buf.len() == HEADER_LEN {
                    let mut hdr = [0u8; HEADER_LEN];
                    hdr.copy_from_slice(&self.buf);
                    let h = Header::parse(&hdr).map_err(malformed)?;
                    // Bounded by `Header::parse` (at most MAX_BODY).
                    self.buf.resize(HEADER_LEN + h.body_len as usize, 0);
                }
                if self.got == self.buf.len() {
                    let mut hdr = [0u8; HEADER_LEN];
                    hdr.copy_from_slice(&self.buf[..HEADER_LEN]);
                    let h = Header::parse(&hdr).map_err(malformed)?;
                    let m =
                        Message::decode(h.msg_type, &self.buf[HEADER_LEN..]).map_err(malformed)?;
                    let fds = std::mem::take(&mut self.fds);
                    *self = MsgReader::new(false);
                    return Ok(Some((m, fds)));
                }
            }
            let room = max_fds.saturating_sub(self.fds.len());
            let got = recv_with_fds(chan.stream, &mut self.buf[self.got..], room);
            // A peer that closed with our message unread resets the connection: the same as
            // closing it, for what this side learns.
            let got = match got {
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => Ok((0, Vec::new())),
                other => other,
            };
            match got {
                Ok((0, _)) => {
                    let mut f = Fail::quiet(chan.err(format_args!(
                        "the {} closed the connection while this side waited for {what}",
                        chan.peer
                    )));
                    f.closed_before_start = self.first && self.got == 0;
                    return Err(f);
                }
                Ok((n, more)) => {
                    self.got += n;
                    self.fds.extend(more);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(None);
                }
                Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                    return Err(Fail::reject(
                        RejectReason::ProtocolError,
                        chan.err(format_args!("the {} sent {what} with {e}", chan.peer)),
                    ));
                }
                Err(e) => {
                    return Err(Fail::quiet(
                        chan.err(format_args!("receiving {what} from the {}: {e}", chan.peer)),
                    ));
                }
            }
        }
    }
}

/// Who the peer is, from `SO_PEERCRED`.
#[derive(Debug, Clone, Copy)]
pub(super) struct PeerCred {
    pub(super) pid: u32,
    pub(super) uid: u32,
}
