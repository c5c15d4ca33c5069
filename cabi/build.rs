//! Builds libibverbs.so.1's ABI around the Rust code:
//!
//! - the version nodes (`IBVERBS_1.0` … `IBVERBS_1.14`, `IBVERBS_PRIVATE_<N>`) in a version
//!   script, and one `.symver NAME, NAME@@NODE` per exported symbol of `symbols.txt`
//!   (`$OUT_DIR/symver.rs`, included by `src/abi.rs`). Rust's toolchain passes its own,
//!   anonymous version script for a cdylib, which wins over ours for any symbol it lists;
//!   naming each symbol's version in the object with `.symver` is what makes the linker
//!   (rust-lld, this toolchain's default) version it. `.symver` needs its symbol defined in
//!   the same object, so each exported `NAME` is a one-jump trampoline here to the Rust
//!   function `__shmhca_NAME` (kept out of the dynamic symbol table with `.hidden`).
//! - `N`, the private ABI's number, matches the installed providers (`libmlx5.so.1`,
//!   `libefa.so.1`, which perftest links and which import `IBVERBS_PRIVATE_<N>` symbols):
//!   read from them, else `SHMHCA_IBVERBS_PRIVATE`, else 34 (Debian 12's rdma-core 44).
//! - the version script's path for the cdylib's build script (`cabi/so/build.rs`, which
//!   links `libibverbs.so.1` with it), as the `links` metadata `DEP_SHMHCA_VERBS_ABI_MAP`.
//! - the C layout probe (`tests/c/layout.c`), compiled against the system's
//!   `<infiniband/verbs.h>` when it is installed (cfg `shmhca_c_layout`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

const DEFAULT_PRIVATE: u32 = 34;
/// The data symbols of `symbols.txt` (the rest are functions).
const DATA: [&str; 1] = ["verbs_allow_disassociate_destroy"];
const LIB_DIRS: [&str; 3] = ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"];

fn main() {
    println!("cargo::rustc-check-cfg=cfg(shmhca_c_layout)");
    println!("cargo:rerun-if-changed=symbols.txt");
    println!("cargo:rerun-if-changed=tests/c/layout.c");
    println!("cargo:rerun-if-env-changed=SHMHCA_IBVERBS_PRIVATE");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let private = private_abi();
    let private_node = format!("IBVERBS_PRIVATE_{private}");

    let symbols = std::fs::read_to_string("symbols.txt").expect("cabi/symbols.txt");
    let mut nodes: Vec<String> = Vec::new();
    let mut asm = String::new();
    for line in symbols
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
    {
        let (node, name) = line
            .split_once(' ')
            .expect("symbols.txt: NODE NAME per line");
        let node = if node == "IBVERBS_PRIVATE" {
            private_node.as_str()
        } else {
            node
        };
        let name = if name == "verbs_register_driver_N" {
            format!("verbs_register_driver_{private}")
        } else {
            name.to_string()
        };
        if nodes.last().map(String::as_str) != Some(node) {
            assert!(
                !nodes.iter().any(|n| n == node),
                "symbols.txt: {node} not contiguous"
            );
            nodes.push(node.to_string());
        }
        let local = format!("__shmhca_v_{name}");
        if DATA.contains(&name.as_str()) {
            // A data symbol (a bool providers read): one byte, 0, defined here.
            for l in [
                ".pushsection .data.shmhca_symver,\\\"aw\\\",@progbits".to_string(),
                format!(".globl {local}"),
                format!(".type {local},@object"),
                format!(".size {local},1"),
                format!("{local}:"),
                ".byte 0".to_string(),
                ".popsection".to_string(),
            ] {
                writeln!(asm, "    \"{l}\",").unwrap();
            }
        } else {
            // A trampoline to the Rust function `__shmhca_<name>` (hidden: not exported
            // unversioned), in this object so that `.symver` can name it.
            let target = if name.starts_with("verbs_register_driver_") {
                "__shmhca_verbs_register_driver".to_string()
            } else {
                format!("__shmhca_{name}")
            };
            for l in [
                ".pushsection .text.shmhca_symver,\\\"ax\\\",@progbits".to_string(),
                format!(".globl {local}"),
                format!(".type {local},@function"),
                format!("{local}:"),
                format!("jmp {target}"),
                format!(".hidden {target}"),
                ".popsection".to_string(),
            ] {
                writeln!(asm, "    \"{l}\",").unwrap();
            }
        }
        writeln!(asm, "    \".symver {local}, {name}@@{node}\",").unwrap();
    }
    // A symbol of this object for the cdylib (cabi/so) to refer to: a build without LTO
    // links an rlib's objects only as they are needed, and nothing calls the trampolines.
    for l in [
        ".pushsection .text.shmhca_symver,\\\"ax\\\",@progbits",
        ".globl __shmhca_verbs_abi_anchor",
        ".hidden __shmhca_verbs_abi_anchor",
        ".type __shmhca_verbs_abi_anchor,@function",
        "__shmhca_verbs_abi_anchor:",
        "ret",
        ".popsection",
    ] {
        writeln!(asm, "    \"{l}\",").unwrap();
    }
    // Public nodes inherit from the one before, as rdma-core's do; the private one stands alone.
    let mut script = String::new();
    let mut prev: Option<&str> = None;
    for n in &nodes {
        if n.starts_with("IBVERBS_PRIVATE") {
            writeln!(script, "{n} {{ }};").unwrap();
        } else {
            match prev {
                Some(p) => writeln!(script, "{n} {{ }} {p};").unwrap(),
                None => writeln!(script, "{n} {{ }};").unwrap(),
            }
            prev = Some(n);
        }
    }
    let map = out.join("libibverbs.map");
    std::fs::write(&map, script).unwrap();
    let rs = format!(
        "// Generated by build.rs from symbols.txt.\n\
         /// The private ABI's version node.\n\
         pub const PRIVATE_NODE: &str = \"{private_node}\";\n\
         core::arch::global_asm!(\n{asm});\n"
    );
    std::fs::write(out.join("symver.rs"), rs).unwrap();

    println!("cargo::metadata=map={}", map.display());
    c_layout_probe();
}

/// The `N` of `IBVERBS_PRIVATE_<N>` the installed providers import.
fn private_abi() -> u32 {
    if let Ok(v) = std::env::var("SHMHCA_IBVERBS_PRIVATE") {
        return v.parse().expect("SHMHCA_IBVERBS_PRIVATE: a number");
    }
    for dir in LIB_DIRS {
        for lib in ["libmlx5.so.1", "libefa.so.1", "libibverbs.so.1"] {
            let p = Path::new(dir).join(lib);
            println!("cargo:rerun-if-changed={}", p.display());
            if let Some(n) = std::fs::read(&p).ok().and_then(|b| find_private(&b)) {
                return n;
            }
        }
    }
    DEFAULT_PRIVATE
}

/// The number after the first `IBVERBS_PRIVATE_` in a library's bytes (its version names).
fn find_private(bytes: &[u8]) -> Option<u32> {
    let pat = b"IBVERBS_PRIVATE_";
    let at = bytes.windows(pat.len()).position(|w| w == pat)? + pat.len();
    let digits: String = bytes[at..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .map(|&b| b as char)
        .collect();
    digits.parse().ok()
}

/// Compiles the offsetof/sizeof probe against the system's verbs.h, if installed.
fn c_layout_probe() {
    if !Path::new("/usr/include/infiniband/verbs.h").exists() {
        return;
    }
    cc::Build::new()
        .file("tests/c/layout.c")
        .warnings(true)
        .compile("shmhca_verbs_layout");
    println!("cargo:rustc-cfg=shmhca_c_layout");
}
