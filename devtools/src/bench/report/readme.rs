//! The figures README.md quotes, written from `figures.json` between two markers so the page never quotes
//! numbers the report does not hold: `outbox-dev bench report` rewrites the block after each run, `outbox-dev
//! bench readme` rewrites it from a committed `figures.json`, and a test fails when the two disagree.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Args;
use serde_json::Value;

use super::markdown::{k, pct};
use crate::bench::cost::report as cost_report;
use crate::bench::support::with_block_between;

/// Where the block starts (an HTML comment: invisible on the rendered page).
pub const BEGIN: &str = "<!-- figures:begin -->";
/// Where the block ends.
pub const END: &str = "<!-- figures:end -->";

/// Arguments of `outbox-dev bench readme`.
#[derive(Args, Debug, Clone)]
pub struct ReadmeArgs {
    /// The report's figures.
    #[arg(long, default_value = "docs/benchmarks/figures.json")]
    pub figures: PathBuf,
    /// The page whose block is rewritten.
    #[arg(long, default_value = "README.md")]
    pub readme: PathBuf,
}

/// The unordered relay points of both sweeps (by claim size, by concurrency).
fn unordered_points(s: &Value) -> Vec<&Value> {
    ["relay_unordered_by_batch", "relay_unordered_by_concurrency"]
        .iter()
        .filter_map(|key| s[*key]["points"].as_array())
        .flatten()
        .collect()
}

/// The block's text: the relay beside the SQL-only cycle over every unordered point, and the point both sweeps
/// share (the report's base settings). Fails when the figures lack what it quotes.
pub fn block(figures: &Value) -> anyhow::Result<String> {
    let s = &figures["scenarios"];
    let points = unordered_points(s);
    let ratios: Vec<f64> = points
        .iter()
        .filter_map(|p| p["relay_vs_sql_only"].as_f64())
        .collect();
    if ratios.is_empty() {
        bail!("the figures hold no unordered relay point");
    }
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    // The point both sweeps share: the by-batch sweep's concurrency, the by-concurrency sweep's batch.
    let (batch, concurrency) = (
        s["relay_unordered_by_concurrency"]["batch"].as_u64(),
        s["relay_unordered_by_batch"]["concurrency"].as_u64(),
    );
    let base = points
        .iter()
        .find(|p| p["batch"].as_u64() == batch && p["concurrency"].as_u64() == concurrency)
        .context("the figures hold no point shared by both unordered sweeps")?;
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let b = &s["batched_deliveries"];
    let at = |scenario: &str, n: u64| {
        b[scenario]["points"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["n"].as_u64() == Some(n)))
    };
    let n = u64::from(outbox::config::DEFAULT_DELIVERY_BATCH);
    let ordered = match (at("ordered", 1), at("ordered", n), at("hot_key", n)) {
        (Some(o1), Some(on), Some(hn)) if on["relay_vs_sql_only"].is_number() => format!(
            "; ordered over {} keys × {} at {n} events per message: {} events/s, {:.1}× one event per message and \
             {} of the SQL-only ordered protocol's {}; one hot key {:.0}× faster at {n}",
            b["ordered"]["keys"],
            b["ordered"]["events_per_key"],
            k(f(&on["events_per_sec_median"])),
            f(&on["events_per_sec_median"]) / f(&o1["events_per_sec_median"]),
            pct(f(&on["relay_vs_sql_only"])),
            k(f(&on["sql_only_median"])),
            f(&hn["vs_first"]),
        ),
        _ => String::new(),
    };
    Ok(format!(
        "relay beside the SQL-only cycle (here {}–{} of it over claim sizes and concurrencies; {} events/s \
         unordered at {} rows per claim and {} cycles in flight, {} of the SQL-only cycle's {}{ordered}, on {} \
         shared cores)",
        pct(lo).trim_end_matches(" %"),
        pct(hi),
        k(f(&base["relay_median"])),
        base["batch"],
        base["concurrency"],
        pct(f(&base["relay_vs_sql_only"])),
        k(f(&base["sql_only_median"])),
        figures["machine"]["cpus"],
    ))
}

/// `text` with what lies between [`BEGIN`] and [`END`] replaced by `block`; `None` when it has no such block.
pub fn with_block(text: &str, block: &str) -> anyhow::Result<Option<String>> {
    with_block_between(text, [BEGIN, END], block)
}

/// Rewrites the blocks of the page at `readme` from `figures`: the figures block, and the cost block
/// ([`cost_report::readme_block`]) when the page has one. Returns whether the page has a figures block (a page
/// without one is left alone).
pub fn update(readme: &Path, figures: &Value) -> anyhow::Result<bool> {
    let text =
        std::fs::read_to_string(readme).with_context(|| format!("reading {}", readme.display()))?;
    let Some(mut new) = with_block(&text, &block(figures)?)? else {
        return Ok(false);
    };
    let cost = [cost_report::README_BEGIN, cost_report::README_END];
    if new.contains(cost[0])
        && let Some(with_cost) =
            with_block_between(&new, cost, &cost_report::readme_block(figures)?)?
    {
        new = with_cost;
    }
    if new != text {
        std::fs::write(readme, new).with_context(|| format!("writing {}", readme.display()))?;
    }
    Ok(true)
}

/// `outbox-dev bench readme`: the block rewritten from a `figures.json` (no benchmark run).
pub fn run(args: ReadmeArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.figures)
        .with_context(|| format!("reading {}", args.figures.display()))?;
    let figures: Value = serde_json::from_str(&text)
        .with_context(|| format!("parsing {}", args.figures.display()))?;
    if !update(&args.readme, &figures)? {
        bail!("{} has no {BEGIN} … {END} block", args.readme.display());
    }
    println!(
        "wrote the figures block of {} from {}",
        args.readme.display(),
        args.figures.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_block_changes_and_a_page_without_one_is_left_alone() {
        let page = format!("a | {BEGIN}old{END} | b\n");
        assert_eq!(
            with_block(&page, "new").unwrap().unwrap(),
            format!("a | {BEGIN}new{END} | b\n")
        );
        assert!(with_block("no block here", "new").unwrap().is_none());
        assert!(with_block(&format!("{BEGIN} unterminated"), "new").is_err());
        assert!(with_block(&format!("{BEGIN}{END}{BEGIN}{END}"), "new").is_err());
    }
}
