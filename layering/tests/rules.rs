//! Each rule of the checker on a small crate made for it: the arrow it must see, and the problem it must report.

use crate::common::krate;
use outbox_layering::check;

const ORDERED_LIB: &str = "//! A crate.\n//!\n//! # Layout\n//!\n//! - `low`: the bottom.\n//! - `high`: the top.\n\n\
                           pub mod high;\npub mod low;\n";

fn problems(files: &[(&str, &str)]) -> Vec<String> {
    check(&krate(files).0).expect("the crate reads").problems
}

#[test]
fn a_layered_crate_passes_and_a_re_export_leads_to_the_file_that_defines() {
    let c = krate(&[
        ("src/lib.rs", ORDERED_LIB),
        ("src/low.rs", "pub struct L;\n"),
        (
            "src/high/mod.rs",
            "mod a;\nmod b;\npub use a::A;\npub use b::B;\n",
        ),
        ("src/high/a.rs", "pub struct A(pub crate::low::L);\n"),
        (
            "src/high/b.rs",
            "use super::A;\n/// Not `crate::high::B`: a comment.\npub struct B(A);\nconst S: &str = \"super::*\";\n\
             #[cfg(test)]\nmod tests { use super::*; use super::super::A; }\n",
        ),
    ]);
    let report = check(&c.0).expect("the crate reads");
    assert_eq!(report.problems, Vec::<String>::new());
    assert!(
        report.uses("src/high/b.rs", "src/high/a.rs"),
        "{:?}",
        report.arrows
    );
    assert!(report.uses("src/high/a.rs", "src/low.rs"));
    assert!(!report.uses("src/high/b.rs", "src/high/mod.rs"));
}

#[test]
fn a_low_module_that_uses_a_high_one_is_reported() {
    let found = problems(&[
        ("src/lib.rs", ORDERED_LIB),
        ("src/low.rs", "pub fn f() { crate::high::g() }\n"),
        ("src/high.rs", "pub fn g() {}\n"),
    ]);
    assert!(
        found
            .iter()
            .any(|p| p.starts_with("`low` uses `high`") && p.contains("src/low.rs:1")),
        "{found:#?}"
    );
}

#[test]
fn a_child_that_uses_what_its_mod_rs_defines_is_reported_by_path_and_by_glob() {
    for child in [
        "use super::Shared;\n",
        "use super::*;\n",
        "fn f() { let _ = crate::high::Shared; }\n",
    ] {
        let found = problems(&[
            ("src/lib.rs", ORDERED_LIB),
            ("src/low.rs", ""),
            ("src/high/mod.rs", "mod a;\npub struct Shared;\n"),
            ("src/high/a.rs", child),
        ]);
        assert!(
            found
                .iter()
                .any(|p| p.starts_with("src/high/a.rs uses what src/high/mod.rs defines")),
            "{child}: {found:#?}"
        );
    }
}

#[test]
fn an_item_of_the_crate_root_used_by_a_module_is_reported() {
    let lib = format!("{ORDERED_LIB}pub fn root_item() {{}}\n");
    let found = problems(&[
        ("src/lib.rs", &lib),
        ("src/low.rs", "fn f() { crate::root_item() }\n"),
        ("src/high.rs", ""),
    ]);
    assert!(
        found
            .iter()
            .any(|p| p.starts_with("src/low.rs uses what src/lib.rs defines")),
        "{found:#?}"
    );
}

#[test]
fn files_of_a_module_in_a_circle_are_reported() {
    let found = problems(&[
        ("src/lib.rs", ORDERED_LIB),
        ("src/low.rs", ""),
        ("src/high/mod.rs", "mod a;\nmod b;\nmod c;\n"),
        ("src/high/a.rs", "use super::b::B;\npub struct A;\n"),
        ("src/high/b.rs", "pub struct B;\nfn f() { super::c::g() }\n"),
        (
            "src/high/c.rs",
            "pub fn g() { let _ = crate::high::a::A; }\n",
        ),
    ]);
    assert!(
        found.contains(
            &"files form a circle: src/high/a.rs → src/high/b.rs → src/high/c.rs → src/high/a.rs"
                .into()
        ),
        "{found:#?}"
    );
}

#[test]
fn an_explicit_layout_is_held_and_its_own_circle_reported() {
    let lib = "//! # Layout\n//!\n//! - `server`: wires. Uses `api`.\n//! - `api`: routes. Uses `server`.\n\
               //! - `core`: state.\n\nmod api;\nmod core;\nmod server;\n";
    let found = problems(&[
        ("src/lib.rs", lib),
        ("src/server.rs", "use crate::api::route;\n"),
        ("src/api.rs", "pub fn route() {}\nuse crate::core::State;\n"),
        ("src/core.rs", "pub struct State;\n"),
    ]);
    assert!(
        found.iter().any(|p| p.starts_with("`api` uses `core`")),
        "{found:#?}"
    );
    assert!(
        found
            .iter()
            .any(|p| p.starts_with("the Layout's stated uses form a circle: api → server → api")),
        "{found:#?}"
    );
}

#[test]
fn a_module_missing_from_the_layout_or_listed_but_not_declared_is_reported() {
    let found = problems(&[
        (
            "src/lib.rs",
            &format!("{ORDERED_LIB}mod extra;\n").replace("pub mod high;\n", ""),
        ),
        ("src/low.rs", ""),
        ("src/extra.rs", ""),
    ]);
    assert!(
        found.contains(&"`extra` is declared in lib.rs but has no Layout entry".into()),
        "{found:#?}"
    );
    assert!(
        found.contains(&"the Layout lists `high`, which lib.rs does not declare".into()),
        "{found:#?}"
    );
}
