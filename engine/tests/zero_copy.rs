//! Zero-copy: a large transfer copies each payload byte exactly once, on the receiving side,
//! straight from the sender's memory into the target region.
mod common;

use common::*;
use shmhca::*;

const LEN: usize = 8 << 20;

#[test]
fn each_payload_byte_is_copied_exactly_once() {
    let mut p = pair(&Params {
        arena: 64 << 20,
        mtu: Mtu::Mtu4096,
        ..Params::default()
    });
    let data = pattern(LEN, 17);
    let src = p.a.pd.alloc_mr(LEN as u64, AccessFlags::NONE).unwrap();
    src.write_at(0, &data).unwrap();
    let dst =
        p.b.pd
            .alloc_mr(
                LEN as u64,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            )
            .unwrap();
    let back =
        p.a.pd
            .alloc_mr(LEN as u64, AccessFlags::LOCAL_WRITE)
            .unwrap();
    let (a0, b0) = (p.a.ctx.stats(), p.b.ctx.stats());

    // Send.
    p.b.qp
        .post_recv(&RecvWr::new(1, &[dst.as_sge().unwrap()]))
        .unwrap();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send, &[src.as_sge().unwrap()]))
        .unwrap();
    assert_eq!(wait_b(&mut p, 1)[0].byte_len as usize, LEN);
    wait_a(&mut p, 1);
    let (a1, b1) = (p.a.ctx.stats(), p.b.ctx.stats());
    assert_eq!(
        b1.payload_bytes_copied - b0.payload_bytes_copied,
        LEN as u64,
        "receiver copies each byte once"
    );
    assert_eq!(
        a1.payload_bytes_copied - a0.payload_bytes_copied,
        0,
        "the sender copies nothing"
    );
    assert_eq!(
        a1.inline_bytes_sent - a0.inline_bytes_sent,
        0,
        "full packets travel by reference"
    );

    // RDMA Write: the same, into the target region.
    p.a.qp
        .post_send(&SendWr::new(
            2,
            SendOp::RdmaWrite(dst.remote(0)),
            &[src.as_sge().unwrap()],
        ))
        .unwrap();
    wait_a(&mut p, 1);
    let (a2, b2) = (p.a.ctx.stats(), p.b.ctx.stats());
    assert_eq!(
        b2.payload_bytes_copied - b1.payload_bytes_copied,
        LEN as u64
    );
    assert_eq!(a2.inline_bytes_sent - a1.inline_bytes_sent, 0);

    // RDMA Read: the requester copies, straight out of the responder's region.
    p.a.qp
        .post_send(&SendWr::new(
            3,
            SendOp::RdmaRead(dst.remote(0)),
            &[back.as_sge().unwrap()],
        ))
        .unwrap();
    wait_a(&mut p, 1);
    let (a3, b3) = (p.a.ctx.stats(), p.b.ctx.stats());
    assert_eq!(
        a3.payload_bytes_copied - a2.payload_bytes_copied,
        LEN as u64
    );
    assert_eq!(b3.payload_bytes_copied - b2.payload_bytes_copied, 0);
    assert_eq!(b3.inline_bytes_sent - b2.inline_bytes_sent, 0);

    let mut got = vec![0u8; LEN];
    back.read_at(0, &mut got).unwrap();
    assert!(got == data, "the round trip changed the data");
}
