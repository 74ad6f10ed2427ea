//! The frame every page shares (head, navigation, the read-only banner), the style sheet, and small formatting
//! helpers (times, ages, optional values) that write into an [`Html`].

use chrono::{DateTime, Utc};
use outbox::OutboxId;

use super::context::Ctx;
use super::html::Html;

/// The style sheet, served as `/console.css` (the Content-Security-Policy allows styles from this origin only,
/// and no script at all).
pub const CSS: &str = r#"
:root { --fg: #1d2127; --muted: #5f6b7a; --line: #d8dde3; --bg: #f6f7f9; --warn: #a33b00; --bad: #b3001e; --ok: #1a7f37; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg); background: var(--bg); }
header { background: #20252c; color: #fff; padding: 8px 16px; display: flex; gap: 18px; align-items: center; flex-wrap: wrap; }
header a { color: #dfe6ee; text-decoration: none; }
header a:hover { color: #fff; text-decoration: underline; }
header .brand { font-weight: 600; color: #fff; }
header .who { margin-left: auto; color: #aeb8c4; }
header form { display: inline; }
main { padding: 16px; max-width: 1400px; }
h1 { font-size: 20px; margin: 4px 0 12px; }
h2 { font-size: 16px; margin: 20px 0 8px; }
table { border-collapse: collapse; background: #fff; border: 1px solid var(--line); }
th, td { padding: 4px 8px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top; }
th { background: #eef1f4; font-weight: 600; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
td.wrap { max-width: 520px; overflow-wrap: anywhere; }
pre { background: #fff; border: 1px solid var(--line); padding: 8px; overflow: auto; max-height: 480px; white-space: pre-wrap; overflow-wrap: anywhere; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; }
.card { background: #fff; border: 1px solid var(--line); padding: 8px 12px; min-width: 150px; }
.card .v { font-size: 22px; font-weight: 600; font-variant-numeric: tabular-nums; }
.card .l { color: var(--muted); font-size: 12px; }
.warn { color: var(--warn); }
.bad { color: var(--bad); }
.ok { color: var(--ok); }
.muted { color: var(--muted); }
.banner { background: #fff3cd; border: 1px solid #e5c66a; padding: 6px 10px; margin-bottom: 12px; }
.report { background: #e8f5ec; border: 1px solid #9fd3ad; padding: 8px 12px; margin-bottom: 12px; }
.refused { background: #fdecee; border: 1px solid #e8a3ad; padding: 8px 12px; margin-bottom: 12px; }
form.filters { display: flex; flex-wrap: wrap; gap: 8px; align-items: end; margin-bottom: 12px; }
form.filters label { display: flex; flex-direction: column; font-size: 12px; color: var(--muted); }
input, select, button { font: inherit; padding: 3px 6px; }
button.danger { background: var(--bad); color: #fff; border: 1px solid var(--bad); }
button.primary { background: #1f6feb; color: #fff; border: 1px solid #1f6feb; }
ol.timeline { list-style: none; padding: 0; border-left: 2px solid var(--line); margin-left: 8px; }
ol.timeline li { padding: 4px 0 4px 14px; position: relative; }
ol.timeline li::before { content: ""; position: absolute; left: -6px; top: 10px; width: 10px; height: 10px; border-radius: 5px; background: #8a96a3; }
ol.timeline li.bad::before { background: var(--bad); }
ol.timeline li.ok::before { background: var(--ok); }
ol.timeline .t { color: var(--muted); font-variant-numeric: tabular-nums; margin-right: 8px; }
svg.chart { background: #fff; border: 1px solid var(--line); }
.pager { margin: 10px 0; }
"#;

/// A whole page: the frame around `body`. `refresh`: reload every that many seconds (the overview).
pub fn page(ctx: &Ctx, title: &str, refresh: Option<u32>, body: &Html) -> Html {
    let mut h = Html::new();
    h.lit("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">");
    if let Some(secs) = refresh {
        h.lit("<meta http-equiv=\"refresh\" content=\"")
            .text(secs)
            .lit("\">");
    }
    // The session's CSRF token, also on pages without a form (the same value every form carries).
    h.lit("<meta name=\"csrf-token\" content=\"")
        .text(&ctx.csrf)
        .lit("\">");
    h.lit("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">")
        .lit("<link rel=\"stylesheet\" href=\"/console.css\"><title>")
        .text(title)
        .lit(" · outbox console</title></head><body><header><a class=\"brand\" href=\"/\">outbox console</a>")
        .lit("<a href=\"/\">Overview</a><a href=\"/topics\">Topics</a><a href=\"/keys\">Keys</a>")
        .lit("<a href=\"/subscribers\">Subscribers</a>")
        .lit("<a href=\"/dead-letters\">Dead letters</a><a href=\"/actions\">Actions</a>")
        .lit("<form method=\"get\" action=\"/events\"><input name=\"id\" size=\"10\" placeholder=\"event id\" aria-label=\"event id\"></form>")
        .lit("<span class=\"who\">")
        .text(&ctx.session.actor);
    if ctx.read_only {
        h.lit(" · read-only");
    }
    h.lit("</span>");
    if ctx.logged_in {
        h.lit("<form method=\"post\" action=\"/logout\">");
        csrf_field(&mut h, ctx);
        h.lit("<button>Log out</button></form>");
    }
    h.lit("</header><main>");
    if ctx.read_only {
        h.lit("<div class=\"banner\" id=\"read-only\">Read-only console: redrive, purge and pausing or resuming a tenant are disabled.</div>");
    }
    h.push(body).lit("</main></body></html>");
    h
}

/// The hidden CSRF field every form carries.
pub fn csrf_field(h: &mut Html, ctx: &Ctx) {
    h.lit("<input type=\"hidden\" name=\"csrf\" value=\"")
        .text(&ctx.csrf)
        .lit("\">");
}

/// `2026-03-01 12:00:00`.
pub fn time(h: &mut Html, t: DateTime<Utc>) {
    h.text(t.format("%Y-%m-%d %H:%M:%S"));
}

/// A time, or `-`.
pub fn opt_time(h: &mut Html, t: Option<DateTime<Utc>>) {
    match t {
        Some(t) => time(h, t),
        None => {
            h.lit("-");
        }
    }
}

/// `3m 12s` (the CLI's format).
pub fn age(h: &mut Html, secs: f64) {
    h.text(crate::status::age(secs.max(0.0)));
}

/// How long before `now` `t` was: `3m 12s ago`, or `in 5s` for a time ahead.
pub fn ago(h: &mut Html, now: DateTime<Utc>, t: DateTime<Utc>) {
    let secs = (now - t).as_seconds_f64();
    if secs >= 0.0 {
        age(h, secs);
        h.lit(" ago");
    } else {
        h.lit("in ");
        age(h, -secs);
    }
}

/// A value, or `-`.
pub fn opt<T: std::fmt::Display>(h: &mut Html, v: Option<T>) {
    match v {
        Some(v) => {
            h.text(v);
        }
        None => {
            h.lit("-");
        }
    }
}

/// A link to an event's page.
pub fn event_link(h: &mut Html, id: OutboxId) {
    h.lit("<a href=\"")
        .path_id("/events/", id.get())
        .lit("\">#")
        .text(id)
        .lit("</a>");
}

/// A link to a dead letter's page.
pub fn dead_letter_link(h: &mut Html, id: impl Into<outbox::DeadLetterId>) {
    let id = id.into();
    h.lit("<a href=\"")
        .path_id("/dead-letters/", id)
        .lit("\">#")
        .text(id)
        .lit("</a>");
}

/// A link to a key on the keys page.
pub fn key_link(h: &mut Html, topic: &str, key: &str) {
    h.lit("<a href=\"")
        .href("/keys", &[("topic", topic), ("key", key)])
        .lit("\">")
        .text(key)
        .lit("</a>");
}

/// Text cut to `max` characters (escapes never cut in half), with the whole of it in a tooltip.
pub fn cut(h: &mut Html, s: &str, max: usize) {
    h.lit("<span title=\"")
        .text(s)
        .lit("\">")
        .text(crate::util::one_line(s, max))
        .lit("</span>");
}
