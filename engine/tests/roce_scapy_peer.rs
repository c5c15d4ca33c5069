//! An independent RoCEv2 peer against shmhca's UDP port: `roce_peer/peer.py`, built on
//! scapy's RoCE layers (its own packet building and ICRC), plays the cases of
//! datenlord/roce-sim — Send, RDMA Write, RDMA Read and Compare and Swap both ways, a
//! duplicate, a PSN sequence error, an RNR Nak, ghost Acks, a lost Ack and the resend, a
//! remote access error both ways, and the retry count exceeded — and checks every packet
//! shmhca sends (opcode, PSN, destination QP, AckReq, payload, ICRC). This test drives
//! shmhca's side: it answers the script's commands (post, check a completion, read
//! memory).
//!
//! Without python3 and scapy the test skips with one line (`pip install scapy`);
//! `SHMHCA_REQUIRE_SCAPY=1` (set by `.ci/run`) makes a missing scapy fail it.

use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use shmhca::{
    AccessFlags, Context, Cq, EngineMode, Mr, Mtu, Qp, QpAttr, QpCaps, QpState, Qpn, RecvWr,
    RemoteAddr, SendOp, SendWr, UdpPort, WorkCompletion,
};

const SHM_IP: &str = "127.0.61.1";
const PEER_IP: &str = "127.0.61.2";
const PEER_QPN: u32 = 0x77;
const PEER_QPN_B: u32 = 0x78;
const PEER_QPN_C: u32 = 0x79;
/// Where receives land in the region; Writes go to 1024, the Atomic to 2048, Reads to 4096.
const RECV_AT: u64 = 8192;
const READ_AT: u64 = 4096;

fn scapy_available() -> bool {
    let found = Command::new("python3")
        .args(["-c", "import scapy.contrib.roce"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found && std::env::var_os("SHMHCA_REQUIRE_SCAPY").is_some_and(|v| v == "1") {
        panic!(
            "python3 with scapy is not installed and SHMHCA_REQUIRE_SCAPY=1 requires it: pip install scapy"
        );
    }
    if !found {
        eprintln!(
            "roce_scapy_peer skipped: python3 with scapy is not installed (pip install scapy)"
        );
    }
    found
}

fn rts(qp: &mut Qp, port: &UdpPort, peer: IpAddr, peer_qpn: u32, retry: u8) {
    let dest = port.destination(qp, peer, Qpn::new(peer_qpn)).unwrap();
    qp.modify(&QpAttr::new(QpState::Init).access(AccessFlags::ALL))
        .unwrap();
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(Mtu::Mtu1024)
            .dest(dest)
            .rq_psn(0x100)
            .max_dest_rd_atomic(4)
            .min_rnr_timer(1),
    )
    .unwrap();
    qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(0x200)
            // 4.096 µs * 2^12 = 17 ms: the lost-Ack case resends quickly.
            .timeout(12)
            .retry_cnt(retry)
            .rnr_retry(7)
            .max_rd_atomic(4),
    )
    .unwrap();
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect()
}

/// shmhca's side: the context, its QPs (A for every case, B for the peer that never
/// answers) and what completed so far.
struct Shm {
    ctx: Context,
    cq: Cq,
    qp: Qp,
    qp_b: Qp,
    mr: Mr,
    done: Vec<WorkCompletion>,
}

impl Shm {
    /// Runs the engine once and keeps what completed.
    fn drive(&mut self) {
        self.ctx.progress();
        let mut wc = [WorkCompletion::default(); 8];
        let n = self.cq.poll(&mut wc);
        self.done.extend_from_slice(&wc[..n]);
    }

    /// Answers one command of the script.
    fn answer(&mut self, line: &str) -> String {
        let w: Vec<&str> = line.split_whitespace().collect();
        let id = |i: usize| w.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        match w.first().copied() {
            Some("post_recv") => {
                let sge = self.mr.sge(RECV_AT, 1024).unwrap();
                self.qp.post_recv(&RecvWr::new(id(1), &[sge])).unwrap();
                "ok".into()
            }
            Some(op @ ("post_send" | "post_send_b")) => {
                let data = unhex(w.get(2).unwrap_or(&""));
                self.mr.write_at(0, &data).unwrap();
                let sge = self.mr.sge(0, data.len() as u32).unwrap();
                let qp = if op == "post_send" {
                    &mut self.qp
                } else {
                    &mut self.qp_b
                };
                qp.post_send(&SendWr::new(id(1), SendOp::Send, &[sge]))
                    .unwrap();
                "ok".into()
            }
            Some("post_read") => {
                let num = |i: usize| {
                    let v = w.get(i).unwrap_or(&"0");
                    u64::from_str_radix(v.trim_start_matches("0x"), 16).unwrap_or(0)
                };
                let (va, rkey, len) = (
                    num(2),
                    num(3) as u32,
                    w.get(4).and_then(|v| v.parse().ok()).unwrap_or(0u32),
                );
                let sge = [self.mr.sge(READ_AT, len).unwrap()];
                let wr = SendWr::new(id(1), SendOp::RdmaRead(RemoteAddr { addr: va, rkey }), &sge);
                self.qp.post_send(&wr).unwrap();
                "ok".into()
            }
            Some("expect_wc" | "expect_wc_b") => {
                let want = id(1);
                let deadline = Instant::now() + Duration::from_secs(10);
                loop {
                    if let Some(i) = self.done.iter().position(|c| c.wr_id == want) {
                        let wc = self.done.remove(i);
                        let status = format!("{:?}", wc.status);
                        if status != w.get(2).copied().unwrap_or("") {
                            return format!("fail completion {want}: {wc:?}");
                        }
                        if let Some(h) = w.get(3) {
                            let data = unhex(h);
                            let at = if wc.opcode == shmhca::WcOpcode::Recv {
                                RECV_AT
                            } else {
                                READ_AT
                            };
                            let mut got = vec![0u8; data.len()];
                            self.mr.read_at(at, &mut got).unwrap();
                            if got != data {
                                return format!("fail completion {want}: bytes {}", hex(&got));
                            }
                        }
                        return "ok".into();
                    }
                    if Instant::now() > deadline {
                        return format!("fail no completion {want} within 10 s: {:?}", self.done);
                    }
                    self.drive();
                }
            }
            Some("read_mem") => {
                let mut got = vec![0u8; id(2) as usize];
                self.mr.read_at(id(1), &mut got).unwrap();
                format!("ok {}", hex(&got))
            }
            _ => format!("fail unknown command {line:?}"),
        }
    }
}

#[test]
fn a_scapy_roce_peer_plays_roce_sims_cases() {
    if !scapy_available() {
        return;
    }
    let _port_lock = shmhca::testing::udp_4791_lock();
    let ctx = Context::builder().mode(EngineMode::Inline).build().unwrap();
    let port = UdpPort::bind(&ctx, SHM_IP.parse().unwrap()).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let mut qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
    let mut qp_b = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
    let mut qp_c = ctx.create_qp(&pd, &cq, &cq, QpCaps::default()).unwrap();
    let mr = pd
        .alloc_mr(16384, AccessFlags::ALL | AccessFlags::LOCAL_WRITE)
        .unwrap();
    let peer: IpAddr = PEER_IP.parse().unwrap();
    rts(&mut qp, &port, peer, PEER_QPN, 7);
    rts(&mut qp_b, &port, peer, PEER_QPN_B, 1);
    rts(&mut qp_c, &port, peer, PEER_QPN_C, 7);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/roce_peer/peer.py");
    let mut child = Command::new("python3")
        .arg(script)
        .args([SHM_IP, PEER_IP])
        .args(
            [
                u64::from(qp.qpn().get()),
                u64::from(qp_b.qpn().get()),
                u64::from(qp_c.qpn().get()),
                u64::from(PEER_QPN),
                u64::from(PEER_QPN_B),
                u64::from(PEER_QPN_C),
                u64::from(mr.rkey()),
                mr.addr(),
            ]
            .map(|v| format!("{v:#x}")),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3");
    let mut to_script = child.stdin.take().unwrap();
    let from_script = child.stdout.take().unwrap();
    let (lines_tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(from_script).lines().map_while(Result::ok) {
            if lines_tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut shm = Shm {
        ctx,
        cq,
        qp,
        qp_b,
        mr,
        done: Vec::new(),
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last = String::new();
    let finished = loop {
        match lines.try_recv() {
            Ok(l) if l == "done" => break true,
            Ok(l) if l.starts_with("FAIL") => {
                last = l;
                break false;
            }
            Ok(l) => {
                let a = shm.answer(&l);
                last = format!("{l} -> {a}");
                if writeln!(to_script, "{a}").is_err() {
                    break false;
                }
            }
            Err(mpsc::TryRecvError::Empty) => shm.drive(),
            Err(mpsc::TryRecvError::Disconnected) => break false,
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break false;
        }
    };
    let status = child.wait().unwrap();
    assert!(
        finished && status.success(),
        "the peer script stopped: {last} ({status})"
    );
    drop((qp_c, port));
}
