//! The layering of issue 10, checked on the source: the protocol core (SQ Logic, RQ Logic,
//! completer, send window) imports neither the rings nor the verbs layer, and the wire
//! codec imports nothing of the protocol (only the leaf vocabulary `psn`).

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
        "src/responder/error.rs",
        "src/responder/owed.rs",
        "src/completer.rs",
        "src/send_window.rs",
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

#[test]
fn the_wire_codec_imports_nothing_of_the_protocol() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/wire");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let rel = format!("src/wire/{}", path.file_name().unwrap().to_string_lossy());
        for line in code(&source(&rel)) {
            let mut rest = line.as_str();
            while let Some(at) = rest.find("crate::") {
                let after = &rest[at + "crate::".len()..];
                assert!(
                    after.starts_with("wire") || after.starts_with("psn"),
                    "{rel} reaches outside the wire codec: {line}"
                );
                rest = after;
            }
        }
        checked += 1;
    }
    assert!(checked >= 5, "the wire modules were found");
}

#[test]
fn the_leaf_vocabulary_imports_nothing_of_the_crate_but_wire_identifiers() {
    for line in code(&source("src/psn.rs")) {
        assert!(!line.contains("crate::"), "psn.rs is a leaf: {line}");
    }
    for line in code(&source("src/completion.rs")) {
        if line.contains("crate::") {
            assert!(
                line.trim() == "use crate::wire::Qpn;",
                "completion.rs is a leaf: {line}"
            );
        }
    }
}
