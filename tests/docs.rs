//! The documentation keeps up with the code: the README stays short enough to read (detail lives in `docs/`), and
//! `docs/configuration.md` names every environment variable the library and the three functions read.

use std::collections::BTreeSet;
use std::path::Path;

use outbox_testkit::repo_root;

/// The README's size limit, in characters: its first screen says what the project is and the two commands;
/// everything else is a link into `docs/`.
const README_MAX_CHARS: usize = 12_000;

#[test]
fn the_readme_stays_under_its_size_limit() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let chars = readme.chars().count();
    assert!(
        chars <= README_MAX_CHARS,
        "README.md has {chars} characters, over {README_MAX_CHARS}: move detail into docs/ and link it"
    );
}

/// The environment variables read by the non-test code under `dirs`: every upper-case string literal with an
/// underscore (`"DB_MAX_CONNECTIONS"`), outside `#[cfg(test)]` modules and compile-time `env!` reads. Reads go
/// through `config::Vars`, `std::env::var` or a named constant, and all of them spell the name as such a literal.
fn variables_read(dirs: &[&Path]) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for dir in dirs {
        for file in rust_files(dir) {
            let source = std::fs::read_to_string(&file).unwrap();
            names.extend(upper_case_literals(without_test_module(&source)));
        }
    }
    names
}

/// `source` up to its inline `#[cfg(test)] mod … {`: test modules are the last thing in their files (a file-level
/// `#[cfg(test)] mod x;` stays: its file is test code, whose names come only from `env!`).
fn without_test_module(source: &str) -> &str {
    let mut from = 0;
    while let Some(at) = source[from..].find("#[cfg(test)]\nmod ") {
        let start = from + at;
        let rest = &source[start..];
        let brace = rest.find('{').unwrap_or(usize::MAX);
        let semicolon = rest.find(';').unwrap_or(usize::MAX);
        if brace < semicolon {
            return &source[..start];
        }
        from = start + 1;
    }
    source
}

fn rust_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// `"NAME_LIKE_THIS"` string literals in `code`, except inside `env!(…)` (a compile-time read of cargo's
/// variables). A small lexer: comments, char literals (`'"'`), escapes and raw strings do not throw the quotes out
/// of step.
fn upper_case_literals(code: &str) -> Vec<String> {
    let c: Vec<char> = code.chars().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < c.len() {
        match c[i] {
            '/' if c.get(i + 1) == Some(&'/') => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
            }
            // A char literal ('x', '\'', '\u{…}'); otherwise a lifetime.
            '\'' if c.get(i + 1) == Some(&'\\') => {
                i += 3;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            }
            '\'' if c.get(i + 2) == Some(&'\'') => i += 3,
            'r' if (c.get(i + 1) == Some(&'"') || c.get(i + 1) == Some(&'#'))
                && !(i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_')) =>
            {
                let hashes = c[i + 1..].iter().take_while(|&&h| h == '#').count();
                let open = i + 1 + hashes;
                if c.get(open) != Some(&'"') {
                    i += 1;
                    continue;
                }
                let close: String = std::iter::once('"')
                    .chain(std::iter::repeat_n('#', hashes))
                    .collect();
                let body: String = c[open + 1..].iter().collect();
                let len = body
                    .find(&close)
                    .map_or(body.len(), |e| body[..e].chars().count());
                i = open + 1 + len + 1 + hashes;
            }
            '"' => {
                let mut j = i + 1;
                let mut literal = String::new();
                while j < c.len() && c[j] != '"' {
                    if c[j] == '\\' {
                        j += 1;
                    }
                    if let Some(&ch) = c.get(j) {
                        literal.push(ch);
                    }
                    j += 1;
                }
                let before: String = c[i.saturating_sub(5)..i].iter().collect();
                let name_like = literal.contains('_')
                    && literal.starts_with(|ch: char| ch.is_ascii_uppercase())
                    && literal
                        .chars()
                        .all(|ch| ch.is_ascii_uppercase() || ch.is_ascii_digit() || ch == '_');
                if name_like && before != "env!(" {
                    found.push(literal);
                }
                i = j + 1;
            }
            _ => i += 1,
        }
    }
    found
}

/// The names `page` mentions as code (`` `NAME` ``, also `` `NAME=value` ``).
fn documented(page: &str) -> BTreeSet<String> {
    page.split('`')
        .skip(1)
        .step_by(2)
        .map(|code| code.split('=').next().unwrap_or(code).trim().to_owned())
        .collect()
}

#[test]
fn every_variable_the_functions_read_is_in_the_configuration_page() {
    let root = repo_root();
    let read = variables_read(&[&root.join("shared/src"), &root.join("functions")]);
    // The scan itself works: it finds variables of each kind of read (Vars, std::env::var, a named constant).
    for known in [
        "DB_APPLICATION_NAME",
        "RUST_LOG",
        "OUTBOX_SCHEMA",
        "CONSUMER_URL",
    ] {
        assert!(read.contains(known), "the scan missed {known}: {read:?}");
    }
    let page = std::fs::read_to_string(root.join("docs/configuration.md")).unwrap();
    let documented = documented(&page);
    let missing: Vec<&String> = read.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "read by the library or the functions but not in docs/configuration.md (add a row: default, meaning): \
         {missing:?}"
    );
}

#[test]
fn the_variable_scan_skips_tests_compile_time_reads_and_other_literals() {
    let code = r##"v.raw("DB_X_MS"); env!("CARGO_PKG_VERSION"); "lower_case"; "Mixed_Case"; "NOUNDERSCORE";
        s.find('"'); // a "quote" in a comment
        let q = '\''; fn f<'a>(x: &'a str) {} r#"RAW_SKIPPED " "#; "esc\"aped";
        const NAME: &str = "OUTBOX_Y";"##;
    assert_eq!(upper_case_literals(code), ["DB_X_MS", "OUTBOX_Y"]);
    let file = "a(\"A_B\");\n#[cfg(test)]\nmod layering;\nb(\"C_D\");\n#[cfg(test)]\nmod tests {\n t(\"E_F\");\n}\n";
    assert_eq!(
        upper_case_literals(without_test_module(file)),
        ["A_B", "C_D"]
    );
    assert_eq!(
        documented("| `A_B` | x |\nset `LOG_FORMAT=pretty`, and `C_D`"),
        ["A_B", "C_D", "LOG_FORMAT"]
            .into_iter()
            .map(str::to_owned)
            .collect::<BTreeSet<_>>()
    );
}
