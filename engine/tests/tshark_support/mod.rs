//! Whether tshark is there, for the tests that decode captures with it
//! (`tests/trace_tshark.rs` and the `spec_walkthrough` example's test, which includes this
//! file by path).
//!
//! Without tshark those tests skip, each test binary printing one line that says what to
//! install; with `SHMHCA_REQUIRE_TSHARK=1` (as `.ci/run` sets) a missing tshark fails them.

use std::process::Command;

/// What to run to get tshark.
pub(crate) const INSTALL_HINT: &str = "DEBIAN_FRONTEND=noninteractive apt-get install -y tshark";

/// Whether tshark can be run. If not: with `SHMHCA_REQUIRE_TSHARK=1` this panics (the
/// test fails, naming what to install); otherwise the first caller in the process prints
/// one line saying that `what` is skipped and what to install (`what` names the binary and its tshark tests), and the caller returns early.
pub(crate) fn tshark_available(what: &str) -> bool {
    static SKIP_LINE: std::sync::Once = std::sync::Once::new();
    let found = match Command::new("tshark").arg("--version").output() {
        Ok(out) => out.status.success(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => panic!("could not run tshark: {e}"),
    };
    if found {
        return true;
    }
    if std::env::var_os("SHMHCA_REQUIRE_TSHARK").is_some_and(|v| v == "1") {
        panic!("tshark is not installed and SHMHCA_REQUIRE_TSHARK=1 requires it: {INSTALL_HINT}");
    }
    SKIP_LINE.call_once(|| {
        // Straight to the process's stderr, past the test harness's output capture.
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "{what} skipped: tshark is not installed (to run it: {INSTALL_HINT})"
        );
    });
    false
}
