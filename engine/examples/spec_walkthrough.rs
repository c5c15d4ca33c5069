//! spec/01's "Message Transfer Overview Example", run for real.
//!
//! Two connected QPs, SQ start PSN 201, PMTU 1024, execute the six WQEs of Figure 17-12 in
//! order — a 5-packet Send, a 52-packet Send, a 9-packet RDMA Write, an RDMA Read of 6
//! response packets, a Send Only and an Atomic Compare and Swap — then every byte is
//! checked. Each packet the requester sends or receives is printed with its direction,
//! opcode and PSN.
//!
//! ```text
//! cargo run -p shmhca --example spec_walkthrough
//! SHMHCA_PCAP=walkthrough.pcap cargo run -p shmhca --example spec_walkthrough
//! tshark -r walkthrough.pcap -T fields -e infiniband.bth.opcode -e infiniband.bth.psn
//! ```

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shmhca::trace::Direction;
use shmhca::{
    AccessFlags, Context, Cq, Destination, EngineMode, Mtu, QpAttr, QpCaps, QpState, RecvWr,
    SendOp, SendWr, WcStatus, WorkCompletion,
};

const PMTU: u64 = 1024;

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    for line in run(None)? {
        println!("{line}");
    }
    Ok(())
}

/// Runs the walkthrough (tracing to `pcap` if given, else to `$SHMHCA_PCAP` if set) and
/// returns the lines to print: one per packet, then one per check.
fn run(pcap: Option<&std::path::Path>) -> Result<Vec<String>, Error> {
    let builder = || {
        let b = Context::builder()
            .mode(EngineMode::Inline)
            .arena_size(8 << 20);
        match pcap {
            Some(p) => b.pcap(p),
            None => b,
        }
    };
    let requester = builder().build()?;
    let responder = builder().build()?;
    let (link_a, link_b) = requester.link_with(&responder)?;

    let log = Arc::new(Mutex::new(Vec::new()));
    let sink = log.clone();
    requester.observe_packets(move |p| {
        let arrow = match p.direction {
            Direction::Sent => "A -> B",
            Direction::Received => "A <- B",
        };
        let op = p.headers.bth.opcode;
        sink.lock().unwrap().push(format!(
            "{arrow}  {:<34} PSN {:>3}  payload {:>4}",
            op.to_string(),
            p.headers.bth.psn.get(),
            p.payload_len
        ));
    });

    let pd_a = requester.alloc_pd()?;
    let pd_b = responder.alloc_pd()?;
    let mut cq_a = requester.create_cq(64)?;
    let mut cq_b = responder.create_cq(64)?;
    let caps = QpCaps::default();
    let mut qa = requester.create_qp(&pd_a, &cq_a, &cq_a, caps)?;
    let mut qb = responder.create_qp(&pd_b, &cq_b, &cq_b, caps)?;
    let remote_access =
        AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
    let (qpn_a, qpn_b) = (qa.qpn(), qb.qpn());
    for (qp, link, remote, sq_psn, rq_psn) in [
        (&mut qa, link_a, qpn_b, 201, 1),
        (&mut qb, link_b, qpn_a, 1, 201),
    ] {
        qp.modify(&QpAttr::new(QpState::Init).access(remote_access))?;
        qp.modify(
            &QpAttr::new(QpState::Rtr)
                .path_mtu(Mtu::Mtu1024)
                .dest(Destination { link, qpn: remote })
                .rq_psn(rq_psn)
                .max_dest_rd_atomic(4)
                .min_rnr_timer(1),
        )?;
        qp.modify(
            &QpAttr::new(QpState::Rts)
                .sq_psn(sq_psn)
                .timeout(14)
                .retry_cnt(7)
                .rnr_retry(7)
                .max_rd_atomic(4),
        )?;
    }

    // The six messages (lengths chosen for the packet counts of spec/01).
    let send0 = 4 * PMTU + 500; // 5 packets
    let send1 = 51 * PMTU + 300; // 52 packets
    let write2 = 8 * PMTU + 100; // 9 packets
    let read3 = 5 * PMTU + 700; // 6 response packets
    let send4 = 200; // Send Only
    let pattern = |len: u64, seed: u8| -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
            .collect()
    };

    let src = pd_a.alloc_mr(send0 + send1 + write2 + send4, AccessFlags::NONE)?;
    let (o1, o2, o4) = (send0, send0 + send1, send0 + send1 + write2);
    src.write_at(0, &pattern(send0, 1))?;
    src.write_at(o1, &pattern(send1, 2))?;
    src.write_at(o2, &pattern(write2, 3))?;
    src.write_at(o4, &pattern(send4, 4))?;
    let read_into = pd_a.alloc_mr(read3 + 8, AccessFlags::LOCAL_WRITE)?;

    let recv = pd_b.alloc_mr(send0 + send1 + send4, AccessFlags::LOCAL_WRITE)?;
    let target = pd_b.alloc_mr(write2 + read3 + 8, remote_access | AccessFlags::LOCAL_WRITE)?;
    target.write_at(write2, &pattern(read3, 5))?;
    target.write_at(write2 + read3, &42u64.to_ne_bytes())?;

    qb.post_recv(&RecvWr::new(10, &[recv.sge(0, send0 as u32)?]))?;
    qb.post_recv(&RecvWr::new(11, &[recv.sge(send0, send1 as u32)?]))?;
    qb.post_recv(&RecvWr::new(14, &[recv.sge(send0 + send1, send4 as u32)?]))?;

    let s = |off: u64, len: u64| src.sge(off, len as u32);
    qa.post_send(&SendWr::new(0, SendOp::Send, &[s(0, send0)?]))?;
    qa.post_send(&SendWr::new(1, SendOp::Send, &[s(o1, send1)?]))?;
    qa.post_send(&SendWr::new(
        2,
        SendOp::RdmaWrite(target.remote(0)),
        &[s(o2, write2)?],
    ))?;
    qa.post_send(&SendWr::new(
        3,
        SendOp::RdmaRead(target.remote(write2)),
        &[read_into.sge(0, read3 as u32)?],
    ))?;
    qa.post_send(&SendWr::new(4, SendOp::Send, &[s(o4, send4)?]))?;
    qa.post_send(&SendWr::new(
        5,
        SendOp::CompareSwap {
            remote: target.remote(write2 + read3),
            compare: 42,
            swap: 4242,
        },
        &[read_into.sge(read3, 8)?],
    ))?;

    let sent = drive(&requester, &responder, &mut cq_a, 6)?;
    let received = drive(&requester, &responder, &mut cq_b, 3)?;

    let mut lines = log.lock().unwrap().clone();
    for wc in sent.iter().chain(&received) {
        if wc.status != WcStatus::Success {
            return Err(format!("work request {} failed: {:?}", wc.wr_id, wc.status).into());
        }
    }
    let ids: Vec<u64> = sent.iter().map(|w| w.wr_id).collect();
    if ids != [0, 1, 2, 3, 4, 5] {
        return Err(format!("send completions out of order: {ids:?}").into());
    }
    let read = |mr: &shmhca::Mr, off: u64, len: u64| -> Result<Vec<u8>, shmhca::Error> {
        let mut v = vec![0; len as usize];
        mr.read_at(off, &mut v)?;
        Ok(v)
    };
    let checks = [
        ("WQE 0 Send", read(&recv, 0, send0)? == pattern(send0, 1)),
        (
            "WQE 1 Send",
            read(&recv, send0, send1)? == pattern(send1, 2),
        ),
        (
            "WQE 2 RDMA Write",
            read(&target, 0, write2)? == pattern(write2, 3),
        ),
        (
            "WQE 3 RDMA Read",
            read(&read_into, 0, read3)? == pattern(read3, 5),
        ),
        (
            "WQE 4 Send",
            read(&recv, send0 + send1, send4)? == pattern(send4, 4),
        ),
        (
            "WQE 5 CmpSwap returned 42",
            read(&read_into, read3, 8)? == 42u64.to_ne_bytes(),
        ),
        (
            "WQE 5 CmpSwap swapped in 4242",
            target.load_u64(write2 + read3)? == 4242,
        ),
    ];
    lines.push(String::new());
    for (what, ok) in checks {
        lines.push(format!("{what:<32} {}", if ok { "ok" } else { "MISMATCH" }));
        if !ok {
            return Err(format!("{what}: the data did not land").into());
        }
    }
    requester.stop_trace();
    responder.stop_trace();
    Ok(lines)
}

/// Drives both engines until `n` completions arrive on `cq`.
fn drive(a: &Context, b: &Context, cq: &mut Cq, n: usize) -> Result<Vec<WorkCompletion>, Error> {
    let mut out = vec![WorkCompletion::default(); n];
    let mut got = 0;
    let start = Instant::now();
    while got < n {
        a.progress();
        b.progress();
        got += cq.poll(&mut out[got..]);
        if start.elapsed() > Duration::from_secs(10) {
            return Err(format!("only {got} of {n} completions after 10 s").into());
        }
    }
    Ok(out)
}

#[cfg(test)]
#[path = "../tests/tshark_support/mod.rs"]
mod tshark_support;

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// The walkthrough runs, every byte lands, and its capture decodes in tshark as
    /// InfiniBand with the PSNs of spec/01.
    #[test]
    fn walkthrough_capture_has_the_psns_of_spec_01() {
        let dir = std::env::temp_dir().join(format!("shmhca-walk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pcap = dir.join("walkthrough.pcap");
        let lines = run(Some(&pcap)).unwrap();
        assert!(
            lines.iter().any(|l| l.contains("RC Compare Swap")),
            "{lines:?}"
        );
        if !super::tshark_support::tshark_available(
            "spec_walkthrough: decoding the capture with tshark",
        ) {
            std::fs::remove_dir_all(&dir).unwrap();
            return;
        }
        let out = Command::new("tshark")
            .args(["-r"])
            .arg(&pcap)
            .args(["--disable-heuristic", "rpcrdma_infiniband", "-T", "fields"])
            .args([
                "-e",
                "ip.src",
                "-e",
                "infiniband.bth.opcode",
                "-e",
                "infiniband.bth.psn",
            ])
            .output()
            .expect("tshark runs (apt-get install -y tshark)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let rows: Vec<(String, u8, u32)> = text
            .lines()
            .map(|l| {
                let f: Vec<&str> = l.split('\t').collect();
                (
                    f[0].to_string(),
                    f[1].parse().unwrap(),
                    f[2].parse().unwrap(),
                )
            })
            .collect();
        // The requester's address is the one that sends Send First.
        let req_ip = rows.iter().find(|r| r.1 == 0x00).unwrap().0.clone();
        let requests: Vec<(u8, u32)> = rows
            .iter()
            .filter(|r| r.0 == req_ip && r.1 != 0x11)
            .map(|r| (r.1, r.2))
            .collect();
        let mut expect = vec![(0x00, 201)];
        expect.extend((202..=204).map(|p| (0x01, p)));
        expect.push((0x02, 205));
        expect.push((0x00, 206));
        expect.extend((207..=256).map(|p| (0x01, p)));
        expect.push((0x02, 257));
        expect.push((0x06, 258));
        expect.extend((259..=265).map(|p| (0x07, p)));
        expect.push((0x08, 266));
        expect.push((0x0C, 267));
        expect.push((0x04, 273));
        expect.push((0x13, 274));
        assert_eq!(requests, expect);
        let responses: Vec<(u8, u32)> = rows
            .iter()
            .filter(|r| r.0 != req_ip && (0x0D..=0x12).contains(&r.1) && r.1 != 0x11)
            .map(|r| (r.1, r.2))
            .collect();
        assert_eq!(
            responses,
            [
                (0x0D, 267),
                (0x0E, 268),
                (0x0E, 269),
                (0x0E, 270),
                (0x0E, 271),
                (0x0F, 272),
                (0x12, 274)
            ]
        );
        // Nothing malformed, no warnings.
        let check = Command::new("tshark")
            .arg("-r")
            .arg(&pcap)
            .args(["--disable-heuristic", "rpcrdma_infiniband"])
            .args(["-Y", "_ws.malformed || _ws.expert.severity >= warning"])
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&check.stdout).trim().is_empty(),
            "{}",
            String::from_utf8_lossy(&check.stdout)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
