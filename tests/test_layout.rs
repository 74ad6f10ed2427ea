//! Every integration-test file of the workspace is compiled into a test binary. The packages turn cargo's
//! automatic discovery off (`autotests = false`) and list one binary `tests/it.rs` whose modules are the other
//! files (plus a `[[test]]` of its own for a file that needs process-global state of its own): a file added to a
//! `tests/` directory without its `mod` line would compile nowhere and its tests would silently never run.

use std::collections::BTreeSet;
use std::path::Path;

use outbox_testkit::repo_root;

/// The workspace's package directories: the root and the `members` of the root manifest.
fn packages(root: &Path) -> Vec<String> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let start = manifest.find("\nmembers = [").expect("a members list");
    let list = &manifest[start..][..manifest[start..].find(']').unwrap()];
    let mut dirs = vec![".".to_owned()];
    dirs.extend(list.split('"').skip(1).step_by(2).map(str::to_owned));
    dirs
}

/// The `.rs` files compiled by a package's test binaries: each `[[test]]`'s `path`, and the modules those files
/// declare (`mod x;` is `x.rs`, `#[path = "y.rs"] mod x;` is `y.rs`).
fn compiled(dir: &Path, manifest: &str) -> BTreeSet<String> {
    let mut files = BTreeSet::new();
    for test in manifest.split("[[test]]").skip(1) {
        let Some(path) = test
            .lines()
            .find_map(|l| l.trim().strip_prefix("path = \"")?.strip_suffix('"'))
        else {
            continue;
        };
        let Some(file) = path.strip_prefix("tests/") else {
            continue;
        };
        files.insert(file.to_owned());
        let source = std::fs::read_to_string(dir.join(path)).unwrap();
        let mut path_attr = None;
        for line in source.lines().map(str::trim) {
            if let Some(p) = line
                .strip_prefix("#[path = \"")
                .and_then(|l| l.strip_suffix("\"]"))
            {
                path_attr = Some(p.to_owned());
            } else if let Some(m) = line.strip_prefix("mod ").and_then(|l| l.strip_suffix(';')) {
                files.insert(path_attr.take().unwrap_or(format!("{m}.rs")));
            }
        }
    }
    files
}

#[test]
fn every_test_file_is_compiled_into_a_test_binary() {
    let root = repo_root();
    let mut checked = 0;
    for package in packages(&root) {
        let dir = root.join(&package);
        let Ok(entries) = std::fs::read_dir(dir.join("tests")) else {
            continue;
        };
        let shown = if package == "." {
            String::new()
        } else {
            format!("{package}/")
        };
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        assert!(
            manifest.contains("\nautotests = false"),
            "{shown}Cargo.toml: its tests are not one binary (autotests = false and a [[test]] for tests/it.rs)"
        );
        let compiled = compiled(&dir, &manifest);
        for entry in entries {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            if name.ends_with(".rs") {
                assert!(
                    compiled.contains(&name),
                    "{shown}tests/{name} is in no test binary: add `mod {};` to {shown}tests/it.rs (or a [[test]] of \
                     its own in {shown}Cargo.toml if it needs process-global state of its own)",
                    name.trim_end_matches(".rs")
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 40, "only {checked} test files found");
}

#[test]
fn the_layout_check_sees_a_file_without_its_mod_line() {
    let dir = std::env::temp_dir().join(format!("outbox-test-layout-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("tests")).unwrap();
    std::fs::write(
        dir.join("tests/it.rs"),
        "mod a;\n#[path = \"b.rs\"]\nmod b;\n",
    )
    .unwrap();
    std::fs::write(dir.join("tests/c.rs"), "").unwrap();
    let manifest = "[package]\nautotests = false\n\n[[test]]\nname = \"it\"\npath = \"tests/it.rs\"\n\n\
                    [[test]]\nname = \"c\"\npath = \"tests/c.rs\"\n";
    let files = compiled(&dir, manifest);
    let _ = std::fs::remove_dir_all(&dir);
    let want: BTreeSet<String> = ["it.rs", "a.rs", "b.rs", "c.rs"].map(str::to_owned).into();
    assert_eq!(files, want);
    assert!(!files.contains("d.rs"));
}
