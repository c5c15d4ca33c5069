//! What Cargo cannot say yet: the protocol stages still in this crate (SQ Logic, RQ Logic,
//! completer) import neither the rings nor the verbs layer.
//!
//! The wire codec, PSNs, completions, credits, timers, WQEs, the send window, the QP
//! context and state vocabulary, the SQ Logic's state machine (`proto::requester`), the
//! completer (`proto::completer`: checks, actions, retiring) and the RQ Logic (`proto::responder`:
//! state, receive pipeline, refusal table) are the crate `shmhca-proto`, which is `no_std` with no dependencies:
//! there the compiler keeps them free of rings, clocks, threads and the engine, and no text
//! test is needed.

use std::path::Path;

fn source(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The `use` lines and inline paths of a file, comments dropped.
fn code(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split("//").next().unwrap_or("").to_string())
        .filter(|l| !l.trim().is_empty())
        .collect()
}

#[test]
fn the_protocol_core_uses_neither_rings_nor_verbs() {
    let core = [
        "src/requester.rs",
        "src/responder.rs",
        "src/responder/owed.rs",
        "src/completer.rs",
    ];
    for file in core {
        for line in code(&source(file)) {
            for banned in ["shmhca_rings", "crate::verbs", "TxBatch"] {
                assert!(
                    !line.contains(banned),
                    "{file} uses `{banned}` (the core talks through context::LinkTx, \
                     context::Posted and crate::completion): {line}"
                );
            }
        }
    }
}
