//! The fields `<infiniband/verbs.h>`'s static inline functions reach (the `ibv_context_ops`
//! slots, the `verbs_context` tail, `ibv_qp_ex`'s function table, `ibv_cq` and
//! `ibv_comp_channel`…) lie where the Rust layout this library fills puts them: the system's
//! C compiler's `offsetof`/`sizeof` (tests/c/layout.c, built by build.rs) against
//! `offset_of!`/`size_of` of the bindgen types.

#[cfg(shmhca_c_layout)]
#[test]
fn every_field_the_inlines_touch_matches_the_c_compiler() {
    let c = shmhca_verbs_core::layout::c_layout();
    let rust = shmhca_verbs_core::layout::rust_layout();
    assert!(c.len() > 150, "the C table has {} entries", c.len());
    let mut bad = Vec::new();
    for (name, value) in &c {
        match rust.iter().find(|(n, _)| n == name) {
            Some((_, v)) if v == value => {}
            Some((_, v)) => bad.push(format!("{name}: C {value}, Rust {v}")),
            None => bad.push(format!("{name}: not in the Rust table")),
        }
    }
    assert_eq!(c.len(), rust.len(), "the tables list different fields");
    assert!(bad.is_empty(), "layout differences:\n{}", bad.join("\n"));
}

#[cfg(not(shmhca_c_layout))]
#[test]
fn every_field_the_inlines_touch_matches_the_c_compiler() {
    if std::env::var_os("SHMHCA_REQUIRE_VERBS_TOOLS").is_some_and(|v| v == "1") {
        panic!(
            "<infiniband/verbs.h> is not installed (libibverbs-dev), and SHMHCA_REQUIRE_VERBS_TOOLS=1 requires it"
        );
    }
    eprintln!("skipped: <infiniband/verbs.h> is not installed (apt-get install libibverbs-dev)");
}
