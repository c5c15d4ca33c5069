//! Passing file descriptors between processes over a Unix-domain stream socket
//! (`SCM_RIGHTS`), the way a segment's memfd reaches the peer.
//!
//! Descriptors travel with the first byte of `bytes`; receiving them marks them
//! close-on-exec (`MSG_CMSG_CLOEXEC`). A message that brings more descriptors than the
//! receiver expects, or whose control data was truncated, is an error, and every
//! descriptor that did arrive with it is closed before returning: none is ever leaked.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// The most descriptors one message may carry (the kernel's `SCM_MAX_FD`).
pub const MAX_FDS: usize = 253;

/// Sends all of `bytes` on `stream`, with `fds` attached to the first byte.
///
/// `bytes` must not be empty when `fds` is not: descriptors need a byte to ride on.
/// The peer keeps its own copies of the descriptors; the caller's stay open.
///
/// # Errors
///
/// `InvalidInput` for descriptors without bytes or more than [`MAX_FDS`] descriptors;
/// otherwise the system error from `sendmsg` (e.g. `EPIPE` when the peer has gone).
pub fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if bytes.is_empty() && !fds.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "file descriptors need at least one byte of data to travel with",
        ));
    }
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} file descriptors in one message; the kernel allows at most {MAX_FDS}",
                fds.len()
            ),
        ));
    }
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other(
            "control buffer too small for the descriptors",
        ));
    }
    let mut sent = 0;
    while sent < bytes.len() {
        let iov = [IoSlice::new(&bytes[sent..])];
        let result = if sent == 0 {
            rustix::net::sendmsg(stream, &iov, &mut control, SendFlags::NOSIGNAL)
        } else {
            rustix::net::sendmsg(
                stream,
                &iov,
                &mut SendAncillaryBuffer::default(),
                SendFlags::NOSIGNAL,
            )
        };
        match result {
            Ok(n) => sent += n,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes from `stream` and the descriptors that came with them.
///
/// Returns the number of bytes received (0 at end of stream) and the descriptors, each
/// close-on-exec. Like any stream read it may return fewer bytes than the sender sent;
/// frame your messages.
///
/// # Errors
///
/// * `InvalidData` if the message carried more than `max_fds` descriptors or its control
///   data was truncated; the descriptors that arrived are closed.
/// * `InvalidInput` if `buf` is empty or `max_fds` exceeds [`MAX_FDS`].
/// * The system error from `recvmsg` otherwise.
pub fn recv_with_fds(
    stream: &UnixStream,
    buf: &mut [u8],
    max_fds: usize,
) -> io::Result<(usize, Vec<OwnedFd>)> {
    if buf.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "receive buffer is empty",
        ));
    }
    if max_fds > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("max_fds {max_fds} exceeds the kernel's limit of {MAX_FDS}"),
        ));
    }
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(max_fds))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = loop {
        let mut iov = [IoSliceMut::new(buf)];
        match rustix::net::recvmsg(stream, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC) {
            Ok(msg) => break msg,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    // Take ownership of every descriptor that arrived before deciding anything, so that an
    // early return closes them (OwnedFd's drop) instead of leaking them.
    let mut fds = Vec::new();
    let mut foreign_messages = 0usize;
    for message in control.drain() {
        match message {
            RecvAncillaryMessage::ScmRights(received) => fds.extend(received),
            _ => foreign_messages += 1,
        }
    }
    if msg.flags.contains(ReturnFlags::CTRUNC) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the peer sent more file descriptors than the {max_fds} expected (control data \
                 truncated); the {} that arrived were closed",
                fds.len()
            ),
        ));
    }
    if fds.len() > max_fds {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the peer sent {} file descriptors but at most {max_fds} were expected; they were closed",
                fds.len()
            ),
        ));
    }
    if foreign_messages > 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the peer sent control messages other than SCM_RIGHTS; any descriptors were closed",
        ));
    }
    Ok((msg.bytes, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;

    /// Receives a message carrying copies of a pipe's read end that the receiver must refuse,
    /// then proves no copy survived: with every read end closed, writing gives `EPIPE`.
    fn refused_and_closed(copies: usize, max_fds: usize) {
        let (a, b) = UnixStream::pair().unwrap();
        let (r, mut w) = std::io::pipe().unwrap();
        let fds = vec![r.as_fd(); copies];
        send_with_fds(&a, b"m", &fds).unwrap();
        let mut buf = [0u8; 4];
        let err = recv_with_fds(&b, &mut buf, max_fds).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        drop(r);
        let write = w.write(b"x").unwrap_err();
        assert_eq!(
            write.kind(),
            io::ErrorKind::BrokenPipe,
            "a received copy of the read end leaked ({copies} sent, {max_fds} allowed)"
        );
    }

    #[test]
    fn passes_descriptors_that_refer_to_the_same_file() {
        let (a, b) = UnixStream::pair().unwrap();
        let (r, mut w) = std::io::pipe().unwrap();
        send_with_fds(&a, b"hello", &[r.as_fd()]).unwrap();
        let mut buf = [0u8; 16];
        let (n, fds) = recv_with_fds(&b, &mut buf, 1).unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(fds.len(), 1);
        let flags = rustix::io::fcntl_getfd(&fds[0]).unwrap();
        assert!(
            flags.contains(rustix::io::FdFlags::CLOEXEC),
            "received fds must be CLOEXEC"
        );
        // Writing into the pipe is readable through the received descriptor.
        w.write_all(b"x").unwrap();
        let mut one = [0u8; 1];
        assert_eq!(rustix::io::read(&fds[0], &mut one).unwrap(), 1);
        assert_eq!(&one, b"x");
    }

    #[test]
    fn plain_bytes_without_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        send_with_fds(&a, b"abc", &[]).unwrap();
        let mut buf = [0u8; 8];
        let (n, fds) = recv_with_fds(&b, &mut buf, 2).unwrap();
        assert_eq!((&buf[..n], fds.len()), (&b"abc"[..], 0));
        drop(a);
        assert_eq!(
            recv_with_fds(&b, &mut buf, 2).unwrap().0,
            0,
            "end of stream"
        );
    }

    #[test]
    fn too_many_descriptors_is_an_error_and_leaks_nothing() {
        // cmsg_space(1) has room for two descriptors, so (2, 1) exercises our own count
        // check and (3, 1) / (1, 0) the kernel's truncation (MSG_CTRUNC).
        refused_and_closed(2, 1);
        refused_and_closed(3, 1);
        refused_and_closed(1, 0);
        refused_and_closed(5, 2);
    }

    #[test]
    fn descriptors_without_bytes_are_refused() {
        let (a, _b) = UnixStream::pair().unwrap();
        let (r, _w) = std::io::pipe().unwrap();
        let err = send_with_fds(&a, b"", &[r.as_fd()]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn sending_to_a_closed_peer_is_an_error_not_a_signal() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(b);
        let err = send_with_fds(&a, b"x", &[]).unwrap_err();
        assert_eq!(
            err.raw_os_error(),
            Some(rustix::io::Errno::PIPE.raw_os_error())
        );
    }
}
