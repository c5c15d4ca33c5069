//! What a hostile TCP peer of `shmhca rc-pingpong`'s server can do (hostile review L1, L5):
//! the server reads the client's 52-byte address message and refuses what it must —
//! a GID that is not 32 ASCII hex digits (not a panic), a GID that names another address
//! than the client's TCP connection (datagrams go only there unless `--trust-peer-gid`),
//! and an address that is not one unicast address (even with the option).

use std::io::Write;
use std::net::TcpStream;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The GID table's index of 127.0.0.1.
fn loopback_index() -> String {
    let table = shmhca::gid_table().expect("GID table");
    table
        .iter()
        .position(|e| e.gid.to_string() == "::ffff:127.0.0.1")
        .expect("127.0.0.1 in the GID table")
        .to_string()
}

/// The servers bind UDP 4791 on 127.0.0.1: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs the server with `extra` flags, connects to it from 127.0.0.1 and sends `msg`; the
/// server's output (it is killed if it runs past 20 s).
fn serve_one(extra: &[&str], msg: &[u8], tcp_port: u16) -> (Output, Duration) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let port = tcp_port.to_string();
    let lo = loopback_index();
    let mut args = vec!["rc-pingpong", "-g", &lo, "-p", &port];
    args.extend_from_slice(extra);
    let mut server = Command::new(env!("CARGO_BIN_EXE_shmhca"))
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run shmhca rc-pingpong");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut s = loop {
        match TcpStream::connect(("127.0.0.1", tcp_port)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline && server.try_wait().unwrap().is_none() => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => {
                let _ = server.kill();
                let out = server.wait_with_output().unwrap();
                panic!(
                    "server not listening: {e}\n{}",
                    String::from_utf8_lossy(&out.stderr)
                )
            }
        }
    };
    let sent = Instant::now();
    s.write_all(msg).unwrap();
    while server.try_wait().unwrap().is_none() {
        if sent.elapsed() > Duration::from_secs(20) {
            let _ = server.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (server.wait_with_output().unwrap(), sent.elapsed())
}

/// A 52-byte address message: `LID:QPN:PSN:` then `gid` (32 bytes) and a NUL.
fn message(gid: &[u8]) -> Vec<u8> {
    let mut msg = b"0000:000011:000000:".to_vec();
    msg.extend_from_slice(gid);
    msg.push(0);
    assert_eq!(msg.len(), 52);
    msg
}

fn port_for(k: u16) -> u16 {
    20000 + (std::process::id() % 10000) as u16 * 3 + k
}

/// Hostile review L1 (its test): a GID field of 32 bytes that are not 32 ASCII characters
/// (a 3-byte '€' first) is refused, not a slice through a character (a panic).
#[test]
fn a_non_ascii_gid_is_refused_not_a_panic() {
    let mut gid = "€".as_bytes().to_vec();
    gid.extend_from_slice(&[b'0'; 29]);
    let (out, _) = serve_one(&[], &message(&gid), port_for(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("panicked"),
        "the server panicked on a peer's message (exit {:?}):\n{err}",
        out.status.code()
    );
    assert!(!out.status.success());
}

/// Hostile review L5: a client whose GID names 127.0.0.2 while its TCP connection comes
/// from 127.0.0.1 is refused at once, in words that name both addresses and the option:
/// the server sends its datagrams only to the address the connection comes from. (Before,
/// it connected its QP to whatever the GID named and sent there.)
#[test]
fn a_gid_other_than_the_tcp_peers_address_is_refused() {
    let (out, took) = serve_one(
        &[],
        &message(b"00000000000000000000ffff7f000002"),
        port_for(1),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(took < Duration::from_secs(10), "{took:?}: {err}");
    for says in ["127.0.0.2", "127.0.0.1", "--trust-peer-gid"] {
        assert!(err.contains(says), "{says:?}: {err}");
    }
}

/// With `--trust-peer-gid` the GID is taken, but never a broadcast address.
#[test]
fn a_broadcast_gid_is_refused_even_when_trusted() {
    let (out, took) = serve_one(
        &["--trust-peer-gid"],
        &message(b"00000000000000000000ffffffffffff"),
        port_for(2),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(took < Duration::from_secs(10), "{took:?}: {err}");
    assert!(err.contains("not one unicast address"), "{err}");
}
