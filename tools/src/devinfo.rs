//! `shmhca devinfo`: the device's limits and what its memory gets on this machine (page
//! size, huge pages, the arena), like `ibv_devinfo -v` for a hardware HCA. The arena is
//! found by opening a real context, not guessed.

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
