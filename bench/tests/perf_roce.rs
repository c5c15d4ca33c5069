//! `shmhca-perf TEST --roce` (server) and `shmhca-perf TEST --roce HOST` (client): the eight
//! tests with `--check` over RoCEv2 — between two loopback addresses (no root needed), and,
//! as root, between two network namespaces joined by a veth pair that the test makes
//! (198.18.0.1/30 and 198.18.0.2/30; it skips with one line otherwise) — and the errors a
//! user meets: no server, different parameters, a silent or foreign server; stray TCP
//! connections the server drops; and the pulse: either side killed mid-run ends the other
//! within seconds.

use std::io::{BufRead, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Each run keeps two processes busy: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

mod common;

use common::{EXE, FAULTS, TESTS, text};

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A TCP port nobody listens on now.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Waits for `child` at most `limit`, killing it after; its output.
fn finish(mut child: Child, limit: Duration) -> Output {
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// `wrap` (e.g. `ip netns exec NS`) then shmhca-perf with `args`.
fn start(wrap: &[&str], args: &[&str]) -> Child {
    let mut argv: Vec<&str> = wrap.to_vec();
    argv.push(EXE);
    argv.extend_from_slice(args);
    Command::new(argv[0])
        .args(&argv[1..])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// One test: the server (`server_wrap`, bound at `server_ip`) and the client
/// (`client_wrap`, bound at `client_ip`, connecting to `server_ip`); both outputs.
fn run(
    test: &[&str],
    (server_wrap, server_ip): (&[&str], &str),
    (client_wrap, client_ip): (&[&str], &str),
) -> (Output, Output) {
    run_with(
        test,
        &[],
        (server_wrap, server_ip),
        (client_wrap, client_ip),
    )
}

/// [`run`] with `extra` flags on both sides.
fn run_with(
    test: &[&str],
    extra: &[&str],
    (server_wrap, server_ip): (&[&str], &str),
    (client_wrap, client_ip): (&[&str], &str),
) -> (Output, Output) {
    let port = free_port().to_string();
    let mut common: Vec<&str> = test.to_vec();
    common.extend(["--roce", "--check", "-n", "200", "-p", &port]);
    common.extend_from_slice(extra);
    let mut s_args = common.clone();
    s_args.extend(["--bind", server_ip]);
    let server = start(server_wrap, &s_args);
    std::thread::sleep(Duration::from_millis(300));
    let mut c_args = common.clone();
    c_args.extend(["--bind", client_ip, server_ip]);
    let client = finish(start(client_wrap, &c_args), Duration::from_secs(120));
    let server = finish(
        server,
        Duration::from_secs(if client.status.success() { 60 } else { 5 }),
    );
    (server, client)
}

#[test]
fn the_eight_tests_check_every_byte_over_rocev2_on_loopback() {
    let _s = serial();
    for t in TESTS {
        let (s, c) = run(t, (&[], "127.0.62.1"), (&[], "127.0.62.2"));
        assert!(
            s.status.success() && c.status.success(),
            "{t:?}\nserver: {}\nclient: {}",
            text(&s),
            text(&c)
        );
        let out = String::from_utf8_lossy(&c.stdout);
        assert!(
            out.contains("RoCEv2 (UDP 4791; TCP exchange)"),
            "{t:?}: {out}"
        );
        assert!(out.contains("#bytes"), "{t:?}: {out}");
    }
}

/// The same with packets lost, duplicated, reordered, delayed and corrupted at both ends
/// (shmhca-perf's fault stage, before the datagrams: a corrupted packet leaves with the
/// ICRC of the intact one, and the receiver drops it): go-back-N over RoCEv2, every byte
/// still checked.
#[test]
fn the_eight_tests_check_every_byte_over_rocev2_through_faults() {
    let _s = serial();
    for t in TESTS {
        let (s, c) = run_with(t, FAULTS, (&[], "127.0.62.1"), (&[], "127.0.62.2"));
        assert!(
            s.status.success() && c.status.success(),
            "{t:?}\nserver: {}\nclient: {}",
            text(&s),
            text(&c)
        );
    }
}

/// A client with no server, and a client whose parameters differ from the server's:
/// each fails with a line that says what is wrong, in bounded time.
#[test]
fn no_server_and_different_parameters_are_clear_errors() {
    let _s = serial();
    let port = free_port().to_string();
    let t = Instant::now();
    let c = finish(
        start(
            &[],
            &[
                "send_lat",
                "--roce",
                "-p",
                &port,
                "--connect-timeout",
                "2",
                "--bind",
                "127.0.62.2",
                "127.0.62.1",
            ],
        ),
        Duration::from_secs(30),
    );
    assert!(!c.status.success(), "{}", text(&c));
    assert!(t.elapsed() < Duration::from_secs(25));
    let err = String::from_utf8_lossy(&c.stderr);
    assert!(err.contains("no shmhca-perf server answered"), "{err}");

    let port = free_port().to_string();
    let server = start(
        &[],
        &[
            "send_lat",
            "--roce",
            "-s",
            "8",
            "-p",
            &port,
            "--bind",
            "127.0.62.1",
        ],
    );
    std::thread::sleep(Duration::from_millis(300));
    let c = finish(
        start(
            &[],
            &[
                "send_lat",
                "--roce",
                "-s",
                "16",
                "-p",
                &port,
                "--bind",
                "127.0.62.2",
                "127.0.62.1",
            ],
        ),
        Duration::from_secs(30),
    );
    let s = finish(server, Duration::from_secs(10));
    for o in [&s, &c] {
        assert!(!o.status.success(), "{}", text(o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("-s is"), "{err}");
    }
}

/// As root: two namespaces joined by a veth pair, made and removed here.
#[test]
fn the_eight_tests_check_every_byte_over_rocev2_across_a_veth_pair() {
    let test = "the_eight_tests_check_every_byte_over_rocev2_across_a_veth_pair";
    // Root: the effective uid, from /proc.
    let root = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            == Some("0")
    });
    let ip_ok = Command::new("ip").arg("-V").output().is_ok();
    if std::env::var_os("SHMHCA_REQUIRE_NETNS").is_some_and(|v| v == "1") && !(root && ip_ok) {
        panic!("{test}: needs root and the ip command, and SHMHCA_REQUIRE_NETNS=1 requires them");
    }
    if !(root && ip_ok) {
        eprintln!("{test}: skipped (needs root and the ip command for network namespaces)");
        return;
    }
    let _s = serial();
    let tag = std::process::id() % 100_000;
    let (a, b) = (format!("shpr-a-{tag}"), format!("shpr-b-{tag}"));
    /// Deletes the namespaces (and the veth with them) however the test ends.
    struct Netns(Vec<String>);
    impl Drop for Netns {
        fn drop(&mut self) {
            for n in &self.0 {
                let _ = Command::new("ip").args(["netns", "del", n]).output();
            }
        }
    }
    let ip = |args: &[&str]| {
        let o = Command::new("ip").args(args).output().unwrap();
        assert!(
            o.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    ip(&["netns", "add", &a]);
    let _ns = Netns(vec![a.clone(), b.clone()]);
    ip(&["netns", "add", &b]);
    let (va, vb) = (format!("shpra{tag}"), format!("shprb{tag}"));
    ip(&[
        "link", "add", &va, "netns", &a, "type", "veth", "peer", "name", &vb, "netns", &b,
    ]);
    ip(&["-n", &a, "addr", "add", "198.18.0.1/30", "dev", &va]);
    ip(&["-n", &b, "addr", "add", "198.18.0.2/30", "dev", &vb]);
    for (n, v) in [(&a, &va), (&b, &vb)] {
        ip(&["-n", n, "link", "set", "lo", "up"]);
        ip(&["-n", n, "link", "set", v, "up"]);
    }
    let (wa, wb) = (["ip", "netns", "exec", &a], ["ip", "netns", "exec", &b]);
    for t in TESTS {
        let (s, c) = run(t, (&wa, "198.18.0.1"), (&wb, "198.18.0.2"));
        assert!(
            s.status.success() && c.status.success(),
            "{t:?}\nserver: {}\nclient: {}",
            text(&s),
            text(&c)
        );
        // The header says what the run went over: Ethernet, and the path MTU the QPs use
        // (the veth's 1500 bytes give 1024), not the shared-memory defaults.
        for out in [&s, &c] {
            let out = text(out);
            assert!(
                out.contains(" Link type       : Ethernet (RoCEv2, UDP 4791 on 198.18.0."),
                "{t:?}: {out}"
            );
            assert!(out.contains(" Mtu             : 1024[B]"), "{t:?}: {out}");
        }
    }
}

/// Connects to `port` on `ip`, retrying while the server starts (at most `limit`).
fn connect_when_listening(ip: &str, port: u16, limit: Duration) -> TcpStream {
    let t = Instant::now();
    loop {
        match TcpStream::connect((ip, port)) {
            Ok(s) => return s,
            Err(e) if t.elapsed() > limit => panic!("nobody listens on {ip}:{port}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Reads `s` until the server drops it (EOF or reset), at most `limit`; what it sent.
fn until_dropped(mut s: TcpStream, limit: Duration, what: &str) -> Vec<u8> {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut got = Vec::new();
    match s.read_to_end(&mut got) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the server kept {what} for {limit:?}: {e}"),
    }
    got
}

/// Connections that are not a client — one silent, one speaking another protocol (HTTP),
/// one sending bytes with no line and closing — are dropped, each with one line, and the
/// server then runs with the real client that comes after them.
#[test]
fn stray_tcp_connections_are_dropped_and_the_server_goes_on_waiting() {
    let _s = serial();
    let port = free_port();
    let ps = port.to_string();
    let server = start(
        &[],
        &[
            "send_lat",
            "--roce",
            "--check",
            "-n",
            "200",
            "-p",
            &ps,
            "--connect-timeout",
            "2",
            "--bind",
            "127.0.62.1",
        ],
    );
    let silent = connect_when_listening("127.0.62.1", port, Duration::from_secs(30));
    let mut http = TcpStream::connect(("127.0.62.1", port)).unwrap();
    http.write_all(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut garbage = TcpStream::connect(("127.0.62.1", port)).unwrap();
    garbage.write_all(&[0, 0xff, 0x13, b'x', b'y']).unwrap();
    garbage.shutdown(std::net::Shutdown::Write).unwrap();
    for (s, what) in [
        (silent, "a silent connection"),
        (http, "an HTTP request"),
        (garbage, "bytes with no line"),
    ] {
        let got = until_dropped(s, Duration::from_secs(30), what);
        assert!(got.is_empty(), "{what} was answered: {got:?}");
    }
    let client = finish(
        start(
            &[],
            &[
                "send_lat",
                "--roce",
                "--check",
                "-n",
                "200",
                "-p",
                &ps,
                "--bind",
                "127.0.62.2",
                "127.0.62.1",
            ],
        ),
        Duration::from_secs(120),
    );
    let server = finish(
        server,
        Duration::from_secs(if client.status.success() { 60 } else { 5 }),
    );
    assert!(
        server.status.success() && client.status.success(),
        "server: {}\nclient: {}",
        text(&server),
        text(&client)
    );
    let err = String::from_utf8_lossy(&server.stderr);
    let ignored = err.lines().filter(|l| l.contains("ignored")).count();
    assert_eq!(ignored, 3, "{err}");
}

/// A client whose server accepts the TCP connection but says nothing (or speaks another
/// protocol) fails within its --connect-timeout, saying so.
#[test]
fn a_client_of_a_silent_or_foreign_server_fails_in_bounded_time() {
    let _s = serial();
    for (answer, says) in [
        (&b""[..], "sent nothing"),
        (&b"SSH-2.0-OpenSSH_9.6\r\n"[..], "not shmhca-perf --roce"),
    ] {
        let l = std::net::TcpListener::bind("127.0.62.1:0").unwrap();
        let port = l.local_addr().unwrap().port().to_string();
        let fake = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(answer).unwrap();
            until_dropped(s, Duration::from_secs(60), "the client");
        });
        let t = Instant::now();
        let c = finish(
            start(
                &[],
                &[
                    "send_lat",
                    "--roce",
                    "-p",
                    &port,
                    "--connect-timeout",
                    "2",
                    "--bind",
                    "127.0.62.2",
                    "127.0.62.1",
                ],
            ),
            Duration::from_secs(60),
        );
        let took = t.elapsed();
        fake.join().unwrap();
        assert!(!c.status.success(), "{}", text(&c));
        assert!(took < Duration::from_secs(20), "{took:?}: {}", text(&c));
        let err = String::from_utf8_lossy(&c.stderr);
        assert!(err.contains(says), "{says:?}: {err}");
    }
}

/// One side killed (SIGKILL) during a run: the other learns it from the exchange's TCP
/// connection closing and exits with an error naming the peer's end, within seconds. The
/// old ways out are made long here: no --idle-timeout, and a 4.3 s transport timer
/// (`-u 20`: 8 tries, over 30 s) — a receive-only side would wait forever.
#[test]
fn a_side_killed_during_the_run_ends_the_other_within_seconds() {
    let _s = serial();
    // (-e: the loops sleep on the completion channel rather than poll.)
    for (test, events) in [("send_bw", false), ("write_lat", false), ("send_bw", true)] {
        for victim in ["server", "client"] {
            let port = free_port().to_string();
            let mut common = vec![
                test,
                "--roce",
                "-D",
                "300",
                "--idle-timeout",
                "0",
                "-u",
                "20",
                "-p",
                &port,
            ];
            if events {
                common.push("-e");
            }
            let test = if events { "send_bw -e" } else { test };
            let mut s_args = common.to_vec();
            s_args.extend(["--bind", "127.0.62.1"]);
            let mut server = start(&[], &s_args);
            std::thread::sleep(Duration::from_millis(300));
            let mut c_args = common.to_vec();
            c_args.extend(["--bind", "127.0.62.2", "127.0.62.1"]);
            let mut client = start(&[], &c_args);
            // Mid-run: the client has printed its table's head (the run started), and a
            // second more.
            let mut lines = std::io::BufReader::new(client.stdout.take().unwrap()).lines();
            let started = lines.any(|l| l.is_ok_and(|l| l.contains("#bytes")));
            std::thread::sleep(Duration::from_secs(1));
            let (victim_child, other) = if victim == "server" {
                (&mut server, client)
            } else {
                (&mut client, server)
            };
            if !started {
                let _ = victim_child.kill();
                let o = finish(other, Duration::from_secs(5));
                panic!("{test}: the run did not start: {}", text(&o));
            }
            victim_child.kill().unwrap();
            let _ = victim_child.wait();
            let t = Instant::now();
            let o = finish(other, Duration::from_secs(60));
            let took = t.elapsed();
            // (The other side's stdout may have been taken above.)
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(!o.status.success(), "{test}, {victim} killed: {err}");
            assert!(
                took < Duration::from_secs(20),
                "{test}, {victim} killed: the other took {took:?}: {err}"
            );
            assert!(
                err.contains(&format!("the {victim}'s process ended")),
                "{test}, {victim} killed: {err}"
            );
        }
    }
}

/// --help says what the exchange's TCP connection does during the run (the pulse) and
/// what becomes of a connection that is not a client.
#[test]
fn help_says_what_the_pulse_is_and_that_strays_are_dropped() {
    let o = Command::new(EXE).arg("--help").output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let help = String::from_utf8_lossy(&o.stdout);
    for says in [
        "stays open during the run as the peer's pulse",
        "the peer's process ended",
        "drops a connection that sends no line of the exchange",
    ] {
        assert!(help.contains(says), "{says:?}:\n{help}");
    }
}

/// A TCP proxy on `listen` towards `to`, its outgoing connection made from `from`: one
/// connection, bytes copied both ways until either end closes.
fn proxy(listen: &str, to: std::net::SocketAddr, from: &str) -> u16 {
    let l = std::net::TcpListener::bind(listen).unwrap();
    let port = l.local_addr().unwrap().port();
    let from: std::net::IpAddr = from.parse().unwrap();
    std::thread::spawn(move || {
        let Ok((a, _)) = l.accept() else { return };
        let Ok(b) = shmhca_bench::perf::roce::connect_from(Some(from), to, Duration::from_secs(10))
        else {
            return;
        };
        let copy = |mut r: TcpStream, mut w: TcpStream| {
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut r, &mut w);
                let _ = w.shutdown(std::net::Shutdown::Both);
            })
        };
        let (a2, b2) = (a.try_clone().unwrap(), b.try_clone().unwrap());
        let _ = (copy(a, b2), copy(b, a2));
    });
    port
}

/// Hostile review L5: a side sends its datagrams only to the address at the other end of
/// the exchange's TCP connection. A client behind a proxy (its line names 127.0.66.2, its
/// connection reaches the server from 127.0.66.4) is refused by the server, in words that
/// name both addresses and `--trust-peer-addr`, before any QP is connected; with the option on both
/// sides the run goes through the proxy.
#[test]
fn a_peer_that_names_another_address_than_its_tcp_ones_is_refused_unless_trusted() {
    let _s = serial();
    for trust in [false, true] {
        let port = free_port();
        let server_at: std::net::SocketAddr = format!("127.0.66.1:{port}").parse().unwrap();
        let mut s_args = vec!["send_lat", "--roce", "-n", "50", "--connect-timeout", "5"];
        let port_s = port.to_string();
        s_args.extend(["-p", &port_s, "--bind", "127.0.66.1"]);
        if trust {
            s_args.push("--trust-peer-addr");
        }
        let server = start(&[], &s_args);
        std::thread::sleep(Duration::from_millis(300));
        let via = proxy("127.0.66.3:0", server_at, "127.0.66.4").to_string();
        let mut c_args = vec!["send_lat", "--roce", "-n", "50", "--connect-timeout", "5"];
        c_args.extend(["-p", &via, "--bind", "127.0.66.2"]);
        if trust {
            c_args.push("--trust-peer-addr");
        }
        c_args.push("127.0.66.3");
        let client = finish(start(&[], &c_args), Duration::from_secs(60));
        let server = finish(server, Duration::from_secs(30));
        if trust {
            assert!(
                server.status.success() && client.status.success(),
                "server: {}\nclient: {}",
                text(&server),
                text(&client)
            );
            continue;
        }
        assert!(!server.status.success(), "server: {}", text(&server));
        let err = String::from_utf8_lossy(&server.stderr);
        for says in ["127.0.66.2", "127.0.66.4", "--trust-peer-addr"] {
            assert!(err.contains(says), "{says:?}: {err}");
        }
    }
}
