//! Links `libibverbs.so.1` (see `cabi/build.rs`, which writes the symbol versions):
//!
//! - the SONAME `libibverbs.so.1` and the version script of rdma-core's nodes, from
//!   `shmhca-verbs-core`'s build script (`DEP_SHMHCA_VERBS_ABI_MAP`);
//! - a link `libibverbs.so.1 -> libibverbs.so` next to the cdylib in `target/<profile>/`,
//!   which `shmhca exec` puts first on the library path.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    // (A new version script reruns this through the `links` dependency: Cargo reruns a
    // build script whose dependency's build script ran again.)
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let map = std::env::var("DEP_SHMHCA_VERBS_ABI_MAP")
        .expect("shmhca-verbs-core's build script names the version script (links metadata)");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={map}");
    link_so1(&out);
}

/// `target/<profile>/libibverbs.so.1 -> deps/libibverbs.so` (the cdylib is written after
/// this script runs; the link resolves once it is). It points into `deps/` because
/// `cargo test` writes the cdylib only there (`cargo build` also copies it up a level).
/// Made only where nothing else is in the way: an existing file that is not such a link is
/// left alone; a link of ours to the old target (`libibverbs.so`) is replaced.
fn link_so1(out: &Path) {
    let Some(dir) = out.ancestors().nth(3) else {
        return;
    };
    let link = dir.join("libibverbs.so.1");
    const TARGET: &str = "deps/libibverbs.so";
    match std::fs::read_link(&link) {
        Ok(t) if t == Path::new(TARGET) => {}
        Ok(t) if t == Path::new("libibverbs.so") => {
            // Ours, from before: point it at deps/.
            let _ = std::fs::remove_file(&link);
            if let Err(e) = std::os::unix::fs::symlink(TARGET, &link) {
                println!("cargo:warning=cannot link {}: {e}", link.display());
            }
        }
        Ok(_) | Err(_) if link.symlink_metadata().is_ok() => {
            println!(
                "cargo:warning={} exists and is not ours: left alone",
                link.display()
            );
        }
        _ => {
            if let Err(e) = std::os::unix::fs::symlink(TARGET, &link) {
                println!("cargo:warning=cannot link {}: {e}", link.display());
            }
        }
    }
}
