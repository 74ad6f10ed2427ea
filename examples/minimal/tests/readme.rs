//! The README's "Using it from your code" shows this example's code verbatim: the test fails when either changes
//! without the other.

use outbox_testkit::repo_root;

#[test]
fn the_readme_shows_the_minimal_example_verbatim() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let section = readme
        .split("\n## Using it from your code\n")
        .nth(1)
        .expect("README has a section \"Using it from your code\"");
    let section = section.split("\n## ").next().unwrap();
    let code = std::fs::read_to_string(repo_root().join("examples/minimal/src/lib.rs")).unwrap();
    assert!(
        section.contains(&format!("```rust\n{code}```\n")),
        "README's \"Using it from your code\" must show examples/minimal/src/lib.rs verbatim, in one rust block"
    );
    assert!(section.contains("examples/minimal/src/lib.rs"));
}
