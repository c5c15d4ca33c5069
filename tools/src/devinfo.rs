//! `shmhca devinfo`: the device's limits and what its memory gets on this machine (page
//! size, huge pages, the arena), like `ibv_devinfo -v` for a hardware HCA. The arena is
//! found by opening a real context, not guessed. The RoCEv2 GID table lists every address
//! of this host as `UdpPort` would use it (`shmhca::gid_table`), with its interface's state
//! and MTU and the active MTU that follows.

use std::fmt::Write as _;

use serde_json::{Value, json};
use shmhca::qp::{MAX_INLINE_DATA, MAX_MESSAGE, MAX_QUEUE_DEPTH, MAX_RD_ATOMIC, MAX_SGE};
use shmhca::stats_area::MAX_QPS_PER_CONTEXT;
use shmhca_rings::segment::{HugePagePool, PageSize};

/// What `devinfo` reports.
pub(crate) fn json() -> Value {
    let pool = HugePagePool::read();
    let arena = match shmhca::Context::builder()
        .mode(shmhca::EngineMode::Inline)
        .build()
    {
        Ok(ctx) => json!({
            "ok": true,
            "page_size": match ctx.page_size() {
                PageSize::Huge2M => "2 MiB (huge pages)",
                PageSize::Base4K => "4 KiB",
            },
            "default_bytes_free": ctx.arena_free(),
        }),
        Err(e) => json!({ "ok": false, "error": e.to_string() }),
    };
    let roce = match shmhca::gid_table() {
        Ok(t) => json!({
            "ok": true,
            "gids": t.iter().map(|e| json!({
                "index": e.index,
                "gid": e.gid.to_string(),
                "type": "RoCE v2",
                "interface": e.interface,
                "state": if e.up { "ACTIVE" } else { "DOWN" },
                "interface_mtu": e.interface_mtu,
                "active_mtu": e.active_mtu.map(|m| m.bytes()),
            })).collect::<Vec<_>>(),
        }),
        Err(e) => json!({ "ok": false, "error": e.to_string() }),
    };
    json!({
        "device": "shmhca",
        "transport": "RC (InfiniBand Reliable Connected, between processes over shared memory)",
        "version": env!("CARGO_PKG_VERSION"),
        "limits": {
            "max_qps_per_context": MAX_QPS_PER_CONTEXT,
            "max_qp_wr": MAX_QUEUE_DEPTH,
            "max_sge": MAX_SGE,
            "max_inline_data": MAX_INLINE_DATA,
            "max_rd_atomic": MAX_RD_ATOMIC,
            "max_msg_size": MAX_MESSAGE,
            "mtus": [256, 512, 1024, 2048, 4096],
            "atomics": ["CMP_AND_SWAP", "FETCH_AND_ADD"],
        },
        "system_page_size": rustix::param::page_size(),
        "huge_pages": {
            "total": pool.total,
            "free": pool.free,
            "reserved": pool.reserved,
            "size_kib": pool.size_kib,
        },
        "arena": arena,
        "roce": roce,
    })
}

/// The report as text.
pub(crate) fn text(v: &Value) -> String {
    let mut s = String::new();
    let l = &v["limits"];
    let _ = writeln!(s, "hca_id:\t{}", v["device"].as_str().unwrap_or(""));
    let _ = writeln!(
        s,
        "\ttransport:\t\t{}",
        v["transport"].as_str().unwrap_or("")
    );
    let _ = writeln!(s, "\tversion:\t\t{}", v["version"].as_str().unwrap_or(""));
    for k in [
        "max_qps_per_context",
        "max_qp_wr",
        "max_sge",
        "max_inline_data",
        "max_rd_atomic",
        "max_msg_size",
    ] {
        let _ = writeln!(s, "\t{k}:{}{}", tabs(k), l[k]);
    }
    let _ = writeln!(s, "\tactive_mtu:\t\t4096 (256 to 4096 settable per QP)");
    let _ = writeln!(s, "\tsystem page size:\t{} bytes", v["system_page_size"]);
    let h = &v["huge_pages"];
    let _ = writeln!(
        s,
        "\thuge pages:\t\t{} free of {} ({} KiB each)",
        h["free"], h["total"], h["size_kib"]
    );
    let a = &v["arena"];
    if a["ok"] == true {
        let _ = writeln!(
            s,
            "\tarena:\t\t\t{} pages; {} bytes free in a default context",
            a["page_size"].as_str().unwrap_or(""),
            a["default_bytes_free"]
        );
    } else {
        let _ = writeln!(
            s,
            "\tarena:\t\t\tcannot be created: {}",
            a["error"].as_str().unwrap_or("")
        );
    }
    let r = &v["roce"];
    if r["ok"] == true {
        let _ = writeln!(
            s,
            "\tRoCEv2 GID table (UdpPort; UDP port 4791; one entry per address of this host):"
        );
        for g in r["gids"].as_array().into_iter().flatten() {
            let mtu = |k: &str| {
                g[k].as_u64()
                    .map_or("unknown".to_string(), |m| m.to_string())
            };
            let _ = writeln!(
                s,
                "\t\tGID[{:>3}]:\t{}, {} ({}, {}, interface MTU {}, active_mtu {})",
                g["index"].as_u64().unwrap_or(0),
                g["gid"].as_str().unwrap_or(""),
                g["type"].as_str().unwrap_or(""),
                g["interface"].as_str().unwrap_or(""),
                g["state"].as_str().unwrap_or(""),
                mtu("interface_mtu"),
                mtu("active_mtu"),
            );
        }
    } else {
        let _ = writeln!(
            s,
            "\tRoCEv2 GID table:\tcannot be read: {}",
            r["error"].as_str().unwrap_or("")
        );
    }
    s
}

fn tabs(k: &str) -> &'static str {
    if k.len() >= 15 {
        "\t"
    } else if k.len() >= 7 {
        "\t\t"
    } else {
        "\t\t\t"
    }
}
