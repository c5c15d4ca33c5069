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
