//! What `outbox-dev dev` prints on stdout, in one of three styles:
//!
//! * [`Style::Live`] (stdout is a terminal): one table redrawn in place each second (ANSI cursor movement), with
//!   the dead letters counted by cause and the state of the run in its last line;
//! * [`Style::Lines`] (stdout is a file or a pipe, `TERM=dumb`, or `--verbose`): plain lines at a calm rate, no
//!   escape codes, each new dead letter on its own line;
//! * [`Style::Json`] (`--json`): one JSON object per progress line.
//!
//! Log lines never come here ([`super::logs`]). Whatever the style, the last line is the summary.

use std::io::Write;

use super::dead_letters::{CauseCount, DeadLetter};
use super::figures::{DevSummary, Progress};

/// How progress is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// A table redrawn in place (a terminal).
    Live,
    /// Plain lines (a file, a pipe, or logs interleaved on the terminal with `--verbose`).
    Lines,
    /// JSON lines.
    Json,
}

/// At most this many dead letters are printed one per line between two progress lines.
const DEAD_LINES_PER_REPORT: usize = 3;
/// At most this many causes in the live table.
const CAUSES_SHOWN: usize = 4;

/// One moment of the run, as the console shows it.
pub struct Frame<'a> {
    /// Seconds since start.
    pub t: f64,
    /// The figures now.
    pub now: Progress,
    /// The figures at the previous frame.
    pub before: Progress,
    /// Seconds since the previous frame.
    pub since: f64,
    /// Dead letters recorded since the previous frame.
    pub new_dead: &'a [DeadLetter],
    /// All dead letters so far, by cause.
    pub causes: &'a [CauseCount],
    /// What the run is doing (`running`, `stopping`, …).
    pub state: &'a str,
}

/// The stdout of a run.
pub struct Console {
    style: Style,
    /// Lines of the live table on screen (0: nothing to redraw over).
    drawn: usize,
    width: usize,
}

impl Console {
    /// A console in `style`.
    pub fn new(style: Style) -> Console {
        let width = std::env::var("COLUMNS")
            .ok()
            .and_then(|c| c.parse::<usize>().ok())
            .filter(|&w| w >= 40)
            .unwrap_or(80);
        Console {
            style,
            drawn: 0,
            width,
        }
    }

    /// The style.
    pub fn style(&self) -> Style {
        self.style
    }

    /// A line that stays (below the live table, which is then left as it is and drawn anew underneath).
    pub fn line(&mut self, text: &str) {
        self.drawn = 0;
        println!("{text}");
    }

    /// Shows a frame: redraws the table, or prints a progress line (and the new dead letters).
    pub fn frame(&mut self, f: &Frame<'_>) -> anyhow::Result<()> {
        match self.style {
            Style::Json => {
                println!("{}", serde_json::json!({"t": f.t, "progress": f.now}));
                Ok(())
            }
            Style::Lines => {
                println!("{}", progress_line(f));
                for d in f.new_dead.iter().take(DEAD_LINES_PER_REPORT) {
                    println!("  dead letter {}", d.line(160));
                }
                if f.new_dead.len() > DEAD_LINES_PER_REPORT {
                    let more = f.new_dead.len() - DEAD_LINES_PER_REPORT;
                    println!(
                        "  … and {more} more dead letter{} (outbox dead-letters list)",
                        if more == 1 { "" } else { "s" }
                    );
                }
                Ok(())
            }
            Style::Live => self.redraw(&table(f, self.width.saturating_sub(1))),
        }
    }

    fn redraw(&mut self, lines: &[String]) -> anyhow::Result<()> {
        let mut out = String::new();
        if self.drawn > 0 {
            // Back to the table's first line; each line is cleared before it is written, and whatever is left
            // below a shorter table is cleared at the end.
            out.push_str(&format!("\x1b[{}A", self.drawn));
        }
        for l in lines {
            out.push_str("\x1b[2K");
            out.push_str(l);
            out.push('\n');
        }
        out.push_str("\x1b[J");
        let mut stdout = std::io::stdout().lock();
        stdout.write_all(out.as_bytes())?;
        stdout.flush()?;
        self.drawn = lines.len();
        Ok(())
    }
}

fn progress_line(f: &Frame<'_>) -> String {
    let (p, b) = (&f.now, &f.before);
    format!(
        "t={:.0}s enqueued {} (+{}) dispatched {} (+{}) applied {} (+{}) dead-lettered {} (+{}) | pending {} \
         oldest {:.1}s awaiting-evidence {} blocked-keys {} relay-retries {}",
        f.t,
        p.enqueued,
        p.enqueued - b.enqueued,
        p.dispatched,
        p.dispatched - b.dispatched,
        p.applied,
        p.applied - b.applied,
        p.dead_lettered,
        p.dead_lettered - b.dead_lettered,
        p.pending,
        p.oldest_pending_secs,
        p.awaiting_evidence,
        p.blocked_keys,
        p.retried,
    )
}

fn table(f: &Frame<'_>, width: usize) -> Vec<String> {
    let (p, b) = (&f.now, &f.before);
    let per_s = |now: i64, before: i64| {
        if f.since > 0.0 {
            format!("{:.0}/s", (now - before) as f64 / f.since)
        } else {
            String::new()
        }
    };
    let mut lines = vec![
        format!(
            "  {:<16}{:>12} {:>9}",
            format!("t={:.0}s", f.t),
            "total",
            "rate"
        ),
        format!(
            "  enqueued        {:>12} {:>9}",
            p.enqueued,
            per_s(p.enqueued, b.enqueued)
        ),
        format!(
            "  dispatched      {:>12} {:>9}   accepted by QStash",
            p.dispatched,
            per_s(p.dispatched, b.dispatched)
        ),
        format!(
            "  applied         {:>12} {:>9}   by the consumer",
            p.applied,
            per_s(p.applied, b.applied)
        ),
        format!(
            "  dead-lettered   {:>12} {:>9}",
            p.dead_lettered,
            per_s(p.dead_lettered, b.dead_lettered)
        ),
        format!(
            "  pending         {:>12}   oldest {:.1} s",
            p.pending, p.oldest_pending_secs
        ),
        format!(
            "  ordered keys    {:>12}   awaiting evidence, {} blocked by a dead head",
            p.awaiting_evidence, p.blocked_keys
        ),
        format!(
            "  relay retries   {:>12}   QStash delivery attempts {}",
            p.retried, p.qstash_attempts
        ),
    ];
    if !f.causes.is_empty() {
        lines.push("  dead letters by cause".into());
        for c in f.causes.iter().take(CAUSES_SHOWN) {
            let poison = if c.demo_poison { "demo poison, " } else { "" };
            lines.push(format!("  {:>6}  {poison}{}", c.count, c.short));
        }
        if f.causes.len() > CAUSES_SHOWN {
            let rest: u64 = f.causes[CAUSES_SHOWN..].iter().map(|c| c.count).sum();
            lines.push(format!(
                "  {rest:>6}  under {} other causes (outbox status)",
                f.causes.len() - CAUSES_SHOWN
            ));
        }
    }
    if let Some(d) = f.new_dead.last() {
        lines.push(format!("  last dead letter {}", d.line_short()));
    }
    lines.push(format!("  {}", f.state));
    lines
        .into_iter()
        .map(|l| {
            if l.chars().count() > width {
                // Already printable (the stored parts went through `printable`): a plain cut.
                let mut cut: String = l.chars().take(width.saturating_sub(1)).collect();
                cut.push('…');
                cut
            } else {
                l
            }
        })
        .collect()
}

/// The summary line: events enqueued, applied, dead-lettered by cause (the demo's poison orders apart from any
/// other), what is left pending, and the demo producer's counts.
pub fn summary_line(s: &DevSummary) -> String {
    let p = &s.progress;
    let mut out = format!(
        "summary: {} events enqueued, {} applied, {} dead-lettered",
        p.enqueued, p.applied, p.dead_lettered
    );
    if !s.subscribers.is_empty() {
        let each: Vec<String> = s
            .subscribers
            .iter()
            .map(|x| {
                format!(
                    "{} {} enqueued / {} applied / {} dead-lettered",
                    x.subscriber, x.enqueued, x.applied, x.dead_lettered
                )
            })
            .collect();
        out.push_str(&format!(" [per subscriber: {}]", each.join("; ")));
    }
    let group = |poison: bool| {
        let causes: Vec<&CauseCount> = s
            .dead_letters_by_cause
            .iter()
            .filter(|c| c.demo_poison == poison)
            .collect();
        let n: u64 = causes.iter().map(|c| c.count).sum();
        let list: Vec<String> = causes
            .iter()
            .map(|c| format!("{} × {}", c.count, c.cause))
            .collect();
        if list.is_empty() {
            format!("{n}")
        } else {
            format!("{n}: {}", list.join(" | "))
        }
    };
    if s.demo || s.dead_letters_by_cause.iter().any(|c| c.demo_poison) {
        out.push_str(&format!(
            " (demo poison {}; other {})",
            group(true),
            group(false)
        ));
    } else if !s.dead_letters_by_cause.is_empty() {
        out.push_str(&format!(" ({})", group(false)));
    }
    out.push_str(&format!(", {} pending", p.pending));
    if p.awaiting_evidence > 0 {
        out.push_str(&format!(
            ", {} awaiting delivery evidence",
            p.awaiting_evidence
        ));
    }
    out.push_str(&format!(
        ", {} after {:.0} s",
        if s.drained { "drained" } else { "NOT drained" },
        s.seconds
    ));
    if s.demo {
        out.push_str(&format!(
            "; demo producer: {} orders ({} poison), {} cancellations, {} failed transactions",
            s.demo_orders, s.demo_poison, s.demo_cancellations, s.demo_failed
        ));
    }
    out
}
