//! The library's public API is the committed list `shared/public-api.txt` (drawn by the workspace's checker,
//! `outbox-layering`: every module reachable through `pub mod`, every item and re-export declared `pub` in them),
//! so a change of the API shows in review as a change of that file. The seam for the workspace's own benchmarks
//! and tests (`outbox::internals`, feature `internals`) is listed too, and not counted as API. The count is bounded:
//! under half of what it was before it was narrowed, plus what later features added, named below.

use std::collections::BTreeSet;
use std::path::Path;

/// What the library exported on 2026-12-07 before the API was narrowed (the same lister on that commit): the
/// API was brought under half of it (230 items).
const PUBLIC_ITEMS_BEFORE: usize = 475;

/// Items features added since, each counted here by name so that growth is a decision, not a drift: fairness
/// between tenants (decision record 0076) — the `fairness` module, `pause`, `resume`, `backlog`, `PauseOutcome`,
/// `PauseError`, `KeyBacklog`, and the relay's `FairnessConfig` and `TenantLimits`.
const ADDED_SINCE: usize = 9;

#[test]
fn the_public_api_is_the_committed_list() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let items = outbox_layering::public_api(dir).expect("the library's sources read");
    let now: Vec<String> = items.into_iter().map(|i| i.text).collect();
    let file = dir.join("public-api.txt");
    if std::env::var_os("UPDATE_PUBLIC_API").is_some() {
        let text: String = now.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(&file, text).expect("writing public-api.txt");
    }
    let committed: Vec<String> = std::fs::read_to_string(&file)
        .expect("reading shared/public-api.txt")
        .lines()
        .map(str::to_string)
        .collect();
    let (was, is): (BTreeSet<_>, BTreeSet<_>) = (committed.iter().collect(), now.iter().collect());
    let added: Vec<_> = is.difference(&was).collect();
    let removed: Vec<_> = was.difference(&is).collect();
    assert!(
        added.is_empty() && removed.is_empty(),
        "the public API changed; if that is meant, run `UPDATE_PUBLIC_API=1 scripts/test shared/tests/public_api.rs` \
         and commit shared/public-api.txt.\nadded: {added:#?}\nremoved: {removed:#?}"
    );
    let api = now
        .iter()
        .filter(|l| !l.contains("crate::internals"))
        .count();
    let bound = PUBLIC_ITEMS_BEFORE / 2 + ADDED_SINCE;
    assert!(
        api < bound,
        "{api} public items (the internals seam not counted): half of the {PUBLIC_ITEMS_BEFORE} before, plus the \
         {ADDED_SINCE} added since, is {bound}"
    );
}
