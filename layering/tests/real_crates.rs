//! The checker is red on each crate that uses it when a circle is put in on purpose: a copy of the crate's
//! `src/` passes, then the same copy with one line added fails, naming the circle.

use crate::common::copy_of;
use outbox_layering::check;

/// `src/a/b.rs` → `crate::a::b`, `src/a/mod.rs` → `crate::a`.
fn module_path(shown: &str) -> String {
    let path = shown
        .trim_start_matches("src/")
        .trim_end_matches(".rs")
        .trim_end_matches("/mod");
    format!("crate::{}", path.replace('/', "::"))
}

fn top(shown: &str) -> &str {
    shown
        .trim_start_matches("src/")
        .split(['/', '.'])
        .next()
        .unwrap_or_default()
}

/// Copies crate `name`, checks the copy passes, then makes a file that another module's file uses use that
/// file back, and checks the circle is reported.
fn red_on_a_circle_put_in(name: &str) {
    let copy = copy_of(name);
    let clean = check(&copy.0).expect("the copy reads");
    assert_eq!(clean.problems, Vec::<String>::new(), "{name} as it is");
    let ((from, to), _) = clean
        .arrows
        .iter()
        .find(|((f, t), _)| f != "src/lib.rs" && t != "src/lib.rs" && top(f) != top(t))
        .unwrap_or_else(|| {
            panic!(
                "{name}: no arrow between two modules: {:?}",
                clean.arrows.keys()
            )
        });
    let target = copy.0.join(to);
    let mut text = std::fs::read_to_string(&target).expect("reading the used file");
    text.push_str(&format!("\nuse {}::*;\n", module_path(from)));
    std::fs::write(&target, text).expect("writing the used file");
    let broken = check(&copy.0).expect("the copy reads");
    assert!(
        broken.problems.iter().any(|p| p.contains("form a circle")
            && p.contains(from.as_str())
            && p.contains(to.as_str())),
        "{name}: {to} now uses {from} back, and no circle is reported: {:#?}",
        broken.problems
    );
}

#[test]
fn the_library_is_red_on_a_circle_put_in() {
    red_on_a_circle_put_in("shared");
}

#[test]
fn the_cli_is_red_on_a_circle_put_in() {
    red_on_a_circle_put_in("cli");
}

#[test]
fn the_dev_server_is_red_on_a_circle_put_in() {
    red_on_a_circle_put_in("qstash-dev");
}
