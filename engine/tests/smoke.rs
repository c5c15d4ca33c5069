//! First end-to-end checks: one message of each kind between two in-process contexts.
mod common;

use common::*;
use shmhca::*;

#[test]
fn send_of_8_bytes_arrives() {
    let mut p = pair(&Params::default());
    let src = p.a.pd.alloc_mr(64, AccessFlags::NONE).unwrap();
    let dst = p.b.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, b"shmhca!!").unwrap();
    p.b.qp
        .post_recv(&RecvWr::new(7, &[dst.sge(0, 64).unwrap()]))
        .unwrap();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.sge(0, 8).unwrap()]))
        .unwrap();
    let rc = wait_b(&mut p, 1);
    assert_eq!(rc[0].status, WcStatus::Success, "{rc:?}");
    assert_eq!(rc[0].wr_id, 7);
    assert_eq!(rc[0].byte_len, 8);
    assert_eq!(rc[0].opcode, WcOpcode::Recv);
    let sc = wait_a(&mut p, 1);
    assert_eq!(sc[0].status, WcStatus::Success, "{sc:?}");
    assert_eq!(sc[0].wr_id, 1);
    let mut got = [0u8; 8];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"shmhca!!");
}

/// Each message finds exactly one receive, posted just before it, while the sender's last
/// credit report said 0: the Send is credit-limited (spec/02), sends its first packet with
/// AckReq, and must go on once that packet is acknowledged.
#[test]
fn a_credit_limited_send_goes_on_once_its_first_packet_is_acked() {
    let mut p = pair(&Params::default());
    for (i, len) in [0usize, 1, 1023, 1024, 1025, 10257, 65536]
        .into_iter()
        .enumerate()
    {
        for imm in [None, Some(5u32)] {
            let src =
                p.a.pd
                    .alloc_mr(len.max(1) as u64, AccessFlags::NONE)
                    .unwrap();
            let dst =
                p.b.pd
                    .alloc_mr(len as u64 + 128, AccessFlags::LOCAL_WRITE)
                    .unwrap();
            p.b.qp
                .post_recv(&RecvWr::new(i as u64, &[dst.sge(64, len as u32).unwrap()]))
                .unwrap();
            let op = imm.map_or(SendOp::Send, SendOp::SendWithImm);
            p.a.qp
                .post_send(&SendWr::new(
                    i as u64,
                    op,
                    &[src.sge(0, len as u32).unwrap()],
                ))
                .unwrap();
            let rc = wait_b(&mut p, 1)[0];
            assert_eq!(
                (rc.status, rc.byte_len, rc.imm_data),
                (WcStatus::Success, len as u32, imm)
            );
            assert_eq!(wait_a(&mut p, 1)[0].status, WcStatus::Success);
        }
    }
    assert_eq!(p.a.ctx.stats().rnr_naks_received, 0);
}
