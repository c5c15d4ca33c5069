//! The RoCEv2 port's queries and RTR checks through the C ABI, in one process, as a C
//! caller makes them: `SHMHCA_VERBS_LINK=roce` is read once per process, so the test runs
//! itself again as a child with the variable set.

// A test of an FFI: each block drives the C ABI as a C program would, with the pointers it
// made; one SAFETY comment per block says so.
#![allow(clippy::multiple_unsafe_ops_per_block)]

use std::ffi::c_int;
use std::ptr;

use shmhca_verbs_core::context::*;
use shmhca_verbs_core::ffi::*;
use shmhca_verbs_core::objects::*;
use shmhca_verbs_core::qp::*;

const NAME: &str = "roce_port_queries_and_rtr_checks";

#[test]
fn roce_port_queries_and_rtr_checks() {
    if std::env::var("SHMHCA_VERBS_LINK").as_deref() != Ok("roce") {
        // The child binds UDP 4791 on this host's addresses.
        let _port = shmhca::testing::udp_4791_lock();
        let exe = std::env::current_exe().expect("this test binary");
        let out = std::process::Command::new(exe)
            .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env("SHMHCA_VERBS_LINK", "roce")
            .output()
            .expect("run this test again");
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
        return;
    }
    checks();
}

fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn checks() {
    let table = shmhca::gid_table().expect("the host's GID table");
    let lo = table
        .iter()
        .position(|e| e.gid.to_string() == "::ffff:127.0.0.1")
        .expect("127.0.0.1 in the table");
    let v6 = table.iter().position(|e| !e.gid.is_ipv4_mapped());
    // SAFETY: the exported functions with the arguments verbs.h documents.
    unsafe {
        let mut n = 0;
        let list = ibv_get_device_list(&mut n);
        let ctx = ibv_open_device(*list);
        ibv_free_device_list(list);
        assert!(!ctx.is_null());

        // The port: Ethernet, no LID, the host's GIDs.
        let mut pa: ibv_port_attr = std::mem::zeroed();
        let q = ctx_of(ctx).unwrap().vctx.query_port.unwrap();
        assert_eq!(q(ctx, 1, &mut pa, std::mem::size_of::<ibv_port_attr>()), 0);
        assert_eq!(u32::from(pa.link_layer), IBV_LINK_LAYER_ETHERNET);
        assert_eq!(pa.state, IBV_PORT_ACTIVE);
        assert_eq!(pa.lid, 0);
        assert_eq!(pa.gid_tbl_len as usize, table.len());
        assert!((IBV_MTU_256..=IBV_MTU_4096).contains(&pa.active_mtu));
        for (i, e) in table.iter().enumerate() {
            let mut gid: ibv_gid = std::mem::zeroed();
            assert_eq!(ibv_query_gid(ctx, 1, i as c_int, &mut gid), 0);
            assert_eq!(gid.raw, e.gid.octets(), "GID {i}");
            let mut entry: ibv_gid_entry = std::mem::zeroed();
            let size = std::mem::size_of::<ibv_gid_entry>();
            assert_eq!(_ibv_query_gid_ex(ctx, 1, i as u32, &mut entry, 0, size), 0);
            assert_eq!(entry.gid_type, IBV_GID_TYPE_ROCE_V2);
            assert_eq!(entry.gid.raw, e.gid.octets());
            assert_eq!(entry.gid_index, i as u32);
            let mut ty = -1;
            assert_eq!(ibv_query_gid_type(ctx, 1, i as u32, &mut ty), 0);
            assert_eq!(ty, 1, "IBV_GID_TYPE_SYSFS_ROCE_V2");
        }
        let len = table.len() as c_int;
        let mut gid: ibv_gid = std::mem::zeroed();
        assert_eq!(ibv_query_gid(ctx, 1, len, &mut gid), -1);
        assert_eq!(errno(), libc::EINVAL);
        assert_eq!(ibv_query_gid(ctx, 1, -1, &mut gid), -1);
        assert_eq!(ibv_query_gid(ctx, 2, 0, &mut gid), -1);
        let mut entry: ibv_gid_entry = std::mem::zeroed();
        let size = std::mem::size_of::<ibv_gid_entry>();
        assert_eq!(
            _ibv_query_gid_ex(ctx, 1, len as u32, &mut entry, 0, size),
            libc::EINVAL
        );
        let mut all: Vec<ibv_gid_entry> = vec![std::mem::zeroed(); table.len()];
        assert_eq!(
            _ibv_query_gid_table(ctx, all.as_mut_ptr(), all.len(), 0, size),
            table.len() as isize
        );
        assert_eq!(all[lo].gid.raw, table[lo].gid.octets());
        assert!(_ibv_query_gid_table(ctx, all.as_mut_ptr(), all.len() - 1, 0, size) < 0);
        // Entries 4 bytes longer than the struct (a later libibverbs' larger entry): each
        // written whole at its odd stride (4 mod 8 for every other one), none past it.
        let odd = size + 4;
        let mut buf = vec![0xA5u8; table.len() * odd + 8];
        let at = buf.as_mut_ptr().add(8 - buf.as_ptr() as usize % 8); // 8-aligned start
        assert_eq!(
            _ibv_query_gid_table(ctx, at.cast(), table.len(), 0, odd),
            table.len() as isize
        );
        for (i, t) in table.iter().enumerate() {
            let e = at.add(i * odd).cast::<ibv_gid_entry>().read_unaligned();
            assert_eq!(e.gid.raw, t.gid.octets(), "entry {i}");
            assert_eq!(
                *at.add(i * odd + size),
                0xA5,
                "entry {i}'s padding untouched"
            );
        }

        // A QP at INIT, and RTR attempts.
        let pd = ibv_alloc_pd(ctx);
        let cq = ibv_create_cq(ctx, 16, ptr::null_mut(), ptr::null_mut(), 0);
        let mut init: ibv_qp_init_attr = std::mem::zeroed();
        init.send_cq = cq;
        init.recv_cq = cq;
        init.cap.max_send_wr = 4;
        init.cap.max_recv_wr = 4;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.qp_type = IBV_QPT_RC;
        let qp = ibv_create_qp(pd, &mut init);
        assert!(!qp.is_null());
        let mut attr: ibv_qp_attr = std::mem::zeroed();
        attr.qp_state = IBV_QPS_INIT;
        attr.port_num = 1;
        let m = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
        assert_eq!(ibv_modify_qp(qp, &mut attr, m as c_int), 0);
        let rtr = |is_global: u8, sgid: u8, dgid: [u8; 16], qpn: u32| {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = IBV_QPS_RTR;
            a.path_mtu = IBV_MTU_1024;
            a.dest_qp_num = qpn;
            a.max_dest_rd_atomic = 1;
            a.min_rnr_timer = 12;
            a.ah_attr.port_num = 1;
            a.ah_attr.is_global = is_global;
            a.ah_attr.dlid = 7;
            a.ah_attr.grh.sgid_index = sgid;
            a.ah_attr.grh.dgid.raw = dgid;
            a.ah_attr.grh.hop_limit = 64;
            a.ah_attr.grh.traffic_class = 3;
            let m = IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER;
            ibv_modify_qp(qp, &mut a, m as c_int)
        };
        let me = (*qp).qp_num;
        let lo_gid = table[lo].gid.octets();
        let v4 = |a: [u8; 4]| shmhca::roce::Gid::from(std::net::Ipv4Addr::from(a)).octets();
        let lo_index = u8::try_from(lo).unwrap();
        // No GRH (a LID only), an sgid_index out of the table, no unicast dgid, a QPN over
        // 24 bits, IPv4 to IPv6: EINVAL, and the QP stays at INIT.
        assert_eq!(rtr(0, lo_index, lo_gid, me), libc::EINVAL);
        let out = u8::try_from(table.len()).unwrap_or(u8::MAX);
        assert_eq!(rtr(1, out, lo_gid, me), libc::EINVAL);
        assert_eq!(rtr(1, u8::MAX, lo_gid, me), libc::EINVAL);
        assert_eq!(rtr(1, lo_index, [0; 16], me), libc::EINVAL);
        assert_eq!(rtr(1, lo_index, v4([224, 0, 0, 1]), me), libc::EINVAL);
        assert_eq!(rtr(1, lo_index, v4([255, 255, 255, 255]), me), libc::EINVAL);
        let mut ff02 = [0u8; 16];
        ff02[0] = 0xff;
        ff02[1] = 0x02;
        ff02[15] = 1;
        assert_eq!(rtr(1, lo_index, ff02, me), libc::EINVAL);
        assert_eq!(rtr(1, lo_index, lo_gid, 1 << 24), libc::EINVAL);
        if let Some(v6) = v6 {
            assert_eq!(rtr(1, lo_index, table[v6].gid.octets(), me), libc::EINVAL);
        }
        assert_eq!((*qp).state, IBV_QPS_INIT);
        // To itself over 127.0.0.1: binds UDP 4791 there, unless another process has it.
        match rtr(1, lo_index, lo_gid, me) {
            0 => assert_eq!((*qp).state, IBV_QPS_RTR),
            e if e == libc::EADDRINUSE => {
                eprintln!("{NAME}: the RTR to 127.0.0.1 skipped (UDP 127.0.0.1:4791 is taken)")
            }
            e => panic!("RTR to ::ffff:127.0.0.1 failed: errno {e}"),
        }
        assert_eq!(ibv_destroy_qp(qp), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_dealloc_pd(pd), 0);
        assert_eq!(ibv_close_device(ctx), 0);
    }
}
