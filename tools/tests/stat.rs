//! `shmhca stat` against a real process: a child (this test executable, re-run as
//! `engine_child`) opens two linked contexts in one process, connects a QP pair and moves
//! Sends between them; `shmhca stat --json` must list both contexts with their counters,
//! links and QPs. After the child is SIGKILLed, `shmhca stat` must show nothing of it.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use shmhca::*;

const EXE: &str = env!("CARGO_BIN_EXE_shmhca");
const CHILD_ENV: &str = "SHMHCA_STAT_TEST_CHILD";

/// The child's body: runs only when started by `stat_shows_a_running_process...` (with
/// `SHMHCA_STAT_TEST_CHILD=1`); as part of a normal test run it returns at once.
#[test]
fn engine_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let a = Context::builder().mode(EngineMode::Inline).build().unwrap();
    let b = Context::builder().mode(EngineMode::Inline).build().unwrap();
    let (link_a, link_b) = a.link_with(&b).unwrap();
    let (pd_a, pd_b) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
    let (cq_a, mut cq_b) = (a.create_cq(64).unwrap(), b.create_cq(64).unwrap());
    let mut qa = a.create_qp(&pd_a, &cq_a, &cq_a, QpCaps::default()).unwrap();
    let mut qb = b.create_qp(&pd_b, &cq_b, &cq_b, QpCaps::default()).unwrap();
    let (na, nb) = (qa.qpn(), qb.qpn());
    for (qp, link, remote) in [(&mut qa, link_a, nb), (&mut qb, link_b, na)] {
        qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::NONE))
            .unwrap();
        qp.modify(
            &QpAttr::new(QpState::Rtr)
                .path_mtu(Mtu::Mtu4096)
                .dest(Destination { link, qpn: remote })
                .rq_psn(0)
                .max_dest_rd_atomic(1)
                .min_rnr_timer(1),
        )
        .unwrap();
        qp.modify(
            &QpAttr::new(QpState::Rts)
                .sq_psn(0)
                .timeout(14)
                .retry_cnt(7)
                .rnr_retry(7)
                .max_rd_atomic(1),
        )
        .unwrap();
    }
    // A RoCEv2 port on context a, and three datagrams from a stranger: its counters show.
    let _port = UdpPort::bind(&a, "127.0.63.1".parse().unwrap()).unwrap();
    let stranger = std::net::UdpSocket::bind("127.0.63.2:0").unwrap();
    for _ in 0..3 {
        stranger.send_to(b"not roce", "127.0.63.1:4791").unwrap();
    }
    let src = pd_a.alloc_mr(4096, AccessFlags::NONE).unwrap();
    let dst = pd_b.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let mut wc = [WorkCompletion::default(); 8];
    let mut announced = false;
    let mut cq_a = cq_a;
    for i in 0u64.. {
        qb.post_recv(&RecvWr::new(i, &[dst.sge(0, 4096).unwrap()]))
            .unwrap();
        qa.post_send(&SendWr::new(i, SendOp::Send, &[src.sge(0, 100).unwrap()]))
            .unwrap();
        while cq_b.poll(&mut wc) == 0 {
            a.progress();
        }
        while cq_a.poll(&mut wc) == 0 {
            b.progress();
        }
        if i == 200 && !announced {
            println!("ready");
            announced = true;
        }
    }
}

fn stat_json() -> Vec<Value> {
    let out = Command::new(EXE).args(["stat", "--json"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    match serde_json::from_slice(&out.stdout).unwrap() {
        Value::Array(v) => v,
        other => panic!("not an array: {other}"),
    }
}

#[test]
fn stat_shows_a_running_process_and_nothing_after_sigkill() {
    // The child binds UDP 4791 on 127.0.63.1.
    let _port = shmhca::testing::udp_4791_lock();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "engine_child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_ENV, "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines() {
            // libtest may have written "test engine_child ... " on the same line.
            if l.is_ok_and(|l| l.ends_with("ready")) {
                let _ = tx.send(());
            }
        }
    });
    if rx.recv_timeout(Duration::from_secs(120)).is_err() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the child engine never became ready");
    }
    // The stats area is published every `PUBLISH_EVERY` engine iterations: the stranger's
    // three datagrams, which the port may take in more than one receive (a receive after
    // empty polls asks for one datagram), show once one publication came after them all.
    let strangers_of = |mine: &[Value]| -> u64 {
        mine.iter()
            .map(|c| c["counters"]["unknown_source_dropped"].as_u64().unwrap())
            .sum()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mine: Vec<Value> = loop {
        let mine: Vec<Value> = stat_json()
            .into_iter()
            .filter(|c| c["pid"] == pid)
            .collect();
        if strangers_of(&mine) >= 3 || std::time::Instant::now() > deadline {
            break mine;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(mine.len(), 2, "two contexts of pid {pid}: {mine:#?}");
    let sent: u64 = mine
        .iter()
        .map(|c| c["counters"]["packets_sent"].as_u64().unwrap())
        .sum();
    assert!(sent > 0, "{mine:#?}");
    for c in &mine {
        assert_eq!(c["mode"], "inline");
        assert_eq!(c["links"][0]["up"], true, "{c:#}");
        assert_eq!(c["links"][0]["peer_pid"], pid, "{c:#}");
        assert_eq!(c["qps"][0]["state"], "Rts", "{c:#}");
    }
    // The UDP port's datagrams: in the JSON and the text.
    assert_eq!(strangers_of(&mine), 3, "{mine:#?}");
    let text = Command::new(EXE).arg("stat").output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.lines()
            .any(|l| l.contains("roce datagrams sent") && l.contains("strangers 3")),
        "{text}"
    );
    // The counters move while it runs.
    std::thread::sleep(Duration::from_millis(300));
    let later: u64 = stat_json()
        .into_iter()
        .filter(|c| c["pid"] == pid)
        .map(|c| c["counters"]["packets_sent"].as_u64().unwrap())
        .sum();
    assert!(later > sent, "{later} after {sent}");

    child.kill().unwrap(); // SIGKILL
    // A moment after it died (a zombie: dead, not yet reaped) and after reaping, nothing
    // of it is listed. Wait for the death itself without reaping (WNOWAIT).
    let p = rustix::process::Pid::from_raw(pid as i32).unwrap();
    rustix::process::waitid(
        rustix::process::WaitId::Pid(p),
        rustix::process::WaitIdOptions::EXITED | rustix::process::WaitIdOptions::NOWAIT,
    )
    .unwrap();
    let gone = stat_json().into_iter().filter(|c| c["pid"] == pid).count();
    child.wait().unwrap();
    let after = stat_json().into_iter().filter(|c| c["pid"] == pid).count();
    assert_eq!((gone, after), (0, 0));
    // And nothing of it is left: no memfd of that pid anywhere (its /proc entry is gone).
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
}

/// `shmhca plot` draws .hgrm files on one chart, names a bad file and line, and never
/// overwrites its output.
#[test]
fn plot_draws_hgrm_files_and_refuses_bad_input() {
    let dir = std::env::temp_dir().join(format!("shmhca-plot-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hgrm = "       Value     Percentile TotalCount 1/(1-Percentile)\n\n       1.000 0.000000000000          1           1.00\n       2.000 0.500000000000         50           2.00\n       9.000 0.990000000000         99         100.00\n      12.000 1.000000000000        100\n";
    let (a, b) = (dir.join("a.hgrm"), dir.join("b.hgrm"));
    std::fs::write(&a, hgrm).unwrap();
    std::fs::write(&b, hgrm.replace("9.000", "7.000")).unwrap();
    let out = dir.join("ab.svg");
    let run =
        |args: &[&std::path::Path]| Command::new(EXE).arg("plot").args(args).output().unwrap();
    let o = run(&[&a, &b, Path::new("-o"), &out]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("Latency by percentile"));
    // Exists now: refused, untouched.
    let o = run(&[&a, Path::new("-o"), &out]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("does not overwrite"));
    assert_eq!(std::fs::read_to_string(&out).unwrap(), svg);
    let bad = dir.join("bad.hgrm");
    std::fs::write(&bad, "Value Percentile\nnot numbers here\n").unwrap();
    let o = run(&[&bad, Path::new("-o"), &dir.join("x.svg")]);
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("bad.hgrm") && e.contains("line 2"), "{e}");
    assert!(!dir.join("x.svg").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
