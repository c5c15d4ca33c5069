//! `shmhca exec -- CMD ARGS…`: runs an unmodified verbs program over shmhca, with shmhca's
//! `libibverbs.so.1` (the `shmhca-verbs` crate) first on its library path. Builds nothing:
//! the library is looked for in `$SHMHCA_VERBS_LIB_DIR`, then next to this binary (where
//! `cargo build` puts both, e.g. `target/debug`). `shmhca exec --roce -- …` makes port 1
//! a RoCEv2 port (`SHMHCA_VERBS_LINK=roce`, read by the library).

use std::ffi::OsString;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};

/// The library's file name, as programs ask for it.
const LIB: &str = "libibverbs.so.1";

/// The directory holding shmhca's `libibverbs.so.1`.
pub(crate) fn lib_dir() -> Result<PathBuf, String> {
    if let Some(d) = std::env::var_os("SHMHCA_VERBS_LIB_DIR") {
        let d = PathBuf::from(d);
        return if d.join(LIB).exists() {
            Ok(d)
        } else {
            Err(format!(
                "SHMHCA_VERBS_LIB_DIR={} holds no {LIB}",
                d.display()
            ))
        };
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    if dir.join(LIB).exists() {
        return Ok(dir.to_path_buf());
    }
    Err(format!(
        "no {LIB} next to {} (build it with `cargo build -p shmhca-verbs`, with the same profile \
         as this binary), and SHMHCA_VERBS_LIB_DIR is not set",
        exe.display()
    ))
}

/// Replaces this process with `cmd`, shmhca's library first on its path (and with `roce`,
/// `SHMHCA_VERBS_LINK=roce`: port 1 is a RoCEv2 port); returns only on failure, with the
/// reason.
pub(crate) fn run(cmd: &[OsString], roce: bool) -> String {
    let Some((prog, args)) = cmd.split_first() else {
        return "give the command to run: shmhca exec -- CMD ARGS...".into();
    };
    let dir = match lib_dir() {
        Ok(d) => d,
        Err(e) => return e,
    };
    let mut path = OsString::from(dir.as_os_str());
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|o| !o.is_empty()) {
        path.push(":");
        path.push(old);
    }
    eprintln!(
        "shmhca: running {} over shmhca0{} (libibverbs from {})",
        prog.to_string_lossy(),
        if roce { ", port 1 RoCEv2" } else { "" },
        dir.display()
    );
    let mut c = std::process::Command::new(prog);
    c.args(args).env("LD_LIBRARY_PATH", path);
    if roce {
        c.env("SHMHCA_VERBS_LINK", "roce");
    }
    let err = c.exec();
    format!("cannot run {}: {err}", prog.to_string_lossy())
}
