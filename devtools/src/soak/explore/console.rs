//! The operator at the console: a bulk redrive or purge the way a person does it in a browser — the dead-letter
//! list filtered by the selection, its "redrive the matching…" or "purge the matching…" link, the confirmation
//! page, its form posted back with the session's cookie — over HTTP to a console the explorer serves from its own
//! database (`outbox console`'s own code, on a free port). Every other bulk action goes through the library calls
//! (see the operator), so both edges are explored.
//!
//! | Rule | Why |
//! |---|---|
//! | The actions follow the pages' own links and forms, never build the confirmation's URL or the form's fields | A page that drops part of the filter (a link, a form, the confirmation) makes the action touch dead letters outside the selection, which the operator's before/after check reports |
//! | The HTML is read with a few string searches for the console's own ids (`bulk`, `confirm`, `report`) | The explorer stays independent of the console's code: it reads what a browser would get |
//! | The confirmation must word every part of the selection (as the operator reads it before clicking), and must not refuse it; otherwise the action is not confirmed and the run has a violation | A page that loses part of the filter is found whether or not the dead letters of the moment make the loss touch anything |
//! | A database error page (5xx) is transient, any other refusal is the action refused | As for the library calls: the operator tries again while Postgres is away |

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use outbox_cli::console::{Console, ConsoleArgs, DEFAULT_STATEMENT_TIMEOUT_SECS};
use reqwest::header;

use super::history::History;
use super::retry::Failure;
use super::schedule::{Selection, TOPICS, label};

/// Which bulk action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bulk {
    Redrive,
    /// A purge of the matching dead letters, handled or not (the list with "include handled").
    Purge,
}

impl std::fmt::Display for Bulk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Bulk::Redrive => "redrive",
            Bulk::Purge => "purge",
        })
    }
}

/// A console serving the explorer's database, and a browser's worth of HTTP client.
pub struct ConsoleDriver {
    console: Console,
    client: reqwest::Client,
    history: Arc<Mutex<History>>,
}

impl ConsoleDriver {
    /// Serves the console on a free loopback port (no tokens: a loopback console's visitors are `local`).
    pub async fn start(
        database_url: &str,
        history: Arc<Mutex<History>>,
    ) -> anyhow::Result<ConsoleDriver> {
        let args = ConsoleArgs {
            db: outbox_cli::util::DbArgs {
                database_url: database_url.to_owned(),
            },
            port: 0,
            bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            read_only: false,
            token_file: None,
            allow_host: Vec::new(),
            consumers: Vec::new(),
            refresh_secs: 0,
            statement_timeout_secs: DEFAULT_STATEMENT_TIMEOUT_SECS,
        };
        let console = Console::start(&args)
            .await
            .context("starting the console")?;
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(std::time::Duration::from_secs(120))
            .build()?;
        Ok(ConsoleDriver {
            console,
            client,
            history,
        })
    }

    /// Records a console page that lost part of an action's selection (a violation: the action would act outside
    /// it, or was refused for want of the filter it was given).
    fn lost(&self, what: String) {
        self.history
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .outside_selection
            .push(what);
    }

    /// Stops the console.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.console.stop().await
    }

    /// Runs `action` on the dead letters `sel` selects, from the list page through the confirmation; what the
    /// report page says it did.
    pub async fn bulk(&self, action: Bulk, sel: &Selection) -> Result<String, Failure> {
        let base = self.console.url();
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some(t) = sel.topic {
            query.push(("topic", TOPICS[t].name().to_owned()));
        }
        if let Some(s) = sel.subscriber {
            query.push(("subscriber", label(s).to_owned()));
        }
        if let Some(k) = sel.key {
            query.push(("key", format!("k{k}")));
        }
        if sel.poison {
            query.push(("error", "poison".to_owned()));
        }
        if action == Bulk::Purge {
            query.push(("all", "1".to_owned()));
        }
        let query = url::form_urlencoded::Serializer::new(String::new())
            .extend_pairs(&query)
            .finish();
        let list = self
            .client
            .get(format!("{base}/dead-letters?{query}"))
            .send()
            .await
            .map_err(transient)?;
        let cookie = list
            .headers()
            .get(header::SET_COOKIE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(str::to_owned)
            .ok_or_else(|| Failure::Refused("the console set no session cookie".into()))?;
        let list = page(list).await?;
        let link_text = match action {
            Bulk::Redrive => "redrive the matching",
            Bulk::Purge => "purge the matching",
        };
        let href = link_before(&list, link_text).ok_or_else(|| {
            Failure::Refused(format!("the list page has no \"{link_text}\" link"))
        })?;
        let confirm = self
            .client
            .get(format!("{base}{href}"))
            .header(header::COOKIE, &cookie)
            .send()
            .await
            .map_err(transient)?;
        let confirm = match page(confirm).await {
            Err(Failure::Refused(why)) => {
                self.lost(format!(
                    "dead-letters {action} {sel} at the console: the confirmation refused the selection the list \
                     page linked to ({why})"
                ));
                return Err(Failure::Refused(why));
            }
            other => other?,
        };
        // What the operator reads before clicking: every part of the selection, as the page words it.
        let shown = between(&confirm, "Selection: ", "</p>").unwrap_or_default();
        let parts: Vec<&str> = shown.trim_end_matches('.').split(", ").collect();
        let missing: Vec<String> = expected_words(sel)
            .into_iter()
            .filter(|w| !parts.contains(&w.as_str()))
            .collect();
        if !missing.is_empty() {
            self.lost(format!(
                "dead-letters {action} {sel} at the console: the confirmation's selection \"{shown}\" lacks \
                 {missing:?}"
            ));
            return Err(Failure::Refused(
                "the confirmation lost part of the selection: not confirmed".into(),
            ));
        }
        let Some(fields) = form_fields(&confirm, "confirm") else {
            return Ok("console: nothing to do".into());
        };
        let form = url::form_urlencoded::Serializer::new(String::new())
            .extend_pairs(&fields)
            .finish();
        let report = self
            .client
            .post(format!("{base}/dead-letters/bulk"))
            .header(header::COOKIE, &cookie)
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(form)
            .send()
            .await
            .map_err(transient)?;
        let report = page(report).await?;
        Ok(format!(
            "console: {}",
            text_of(&report, "report").unwrap_or_else(|| "no report".into())
        ))
    }
}

/// The selection's parts as the console's pages word them.
fn expected_words(sel: &Selection) -> Vec<String> {
    let mut w = Vec::new();
    if let Some(t) = sel.topic {
        w.push(format!("topic {}", TOPICS[t].name()));
    }
    if let Some(s) = sel.subscriber {
        w.push(format!("subscriber {}", label(s)));
    }
    if let Some(k) = sel.key {
        w.push(format!("key k{k}"));
    }
    if sel.poison {
        w.push("error contains poison".to_owned());
    }
    w
}

/// The text (tags stripped) between the first `start` and the `end` after it.
fn between(html: &str, start: &str, end: &str) -> Option<String> {
    let from = html.find(start)? + start.len();
    let to = from + html[from..].find(end)?;
    Some(strip_tags(&html[from..to]))
}

fn transient(e: reqwest::Error) -> Failure {
    Failure::Transient(format!("console: {e}"))
}

/// The page's body when it answered 200; a 5xx (the database away) is transient, anything else a refusal.
async fn page(r: reqwest::Response) -> Result<String, Failure> {
    let status = r.status();
    let body = r.text().await.map_err(transient)?;
    if status.is_success() {
        Ok(body)
    } else {
        let why = format!(
            "console {status}: {}",
            strip_tags(&body).chars().take(300).collect::<String>()
        );
        Err(if status.is_server_error() {
            Failure::Transient(why)
        } else {
            Failure::Refused(why)
        })
    }
}

/// The `href` of the link whose text starts with `text`.
fn link_before(html: &str, text: &str) -> Option<String> {
    let at = html.find(&format!("\">{text}"))?;
    let start = html[..at].rfind("href=\"")? + "href=\"".len();
    Some(unescape(&html[start..at]))
}

/// The hidden fields of form `id` (`None`: the page has no such form, e.g. nothing to do).
fn form_fields(html: &str, id: &str) -> Option<Vec<(String, String)>> {
    let start = html.find(&format!("<form id=\"{id}\""))?;
    let end = start + html[start..].find("</form>")?;
    let form = &html[start..end];
    let mut fields = Vec::new();
    for input in form.split("<input ").skip(1) {
        let tag = &input[..input.find('>').unwrap_or(input.len())];
        if !tag.contains("type=\"hidden\"") {
            continue;
        }
        if let (Some(name), Some(value)) = (attribute(tag, "name"), attribute(tag, "value")) {
            fields.push((name, value));
        }
    }
    Some(fields)
}

fn attribute(tag: &str, name: &str) -> Option<String> {
    let key = format!("{name}=\"");
    let start = tag.find(&key)? + key.len();
    let len = tag[start..].find('"')?;
    Some(unescape(&tag[start..start + len]))
}

/// The text of the element with id `id`, tags stripped.
fn text_of(html: &str, id: &str) -> Option<String> {
    let at = html.find(&format!("id=\"{id}\""))?;
    let open_end = at + html[at..].find('>')? + 1;
    let close = open_end + html[open_end..].find("</div>")?;
    Some(strip_tags(&html[open_end..close]))
}

fn strip_tags(html: &str) -> String {
    let mut out = String::new();
    let mut in_tag = false;
    for c in html.chars() {
        match c {
            '<' => in_tag = true,
            '>' => in_tag = false,
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    unescape(out.split_whitespace().collect::<Vec<_>>().join(" ").trim())
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&#x27;", "'")
        .replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pages_links_forms_and_reports_are_read_as_a_browser_would() {
        let list = "<p id=\"bulk\">Bulk: <a href=\"/dead-letters/confirm?topic=x&amp;action=redrive\">redrive the \
                    matching…</a> · <a href=\"/dead-letters/confirm?topic=x&amp;action=purge&amp;scope=any\">purge \
                    the matching…</a></p>";
        assert_eq!(
            link_before(list, "redrive the matching").as_deref(),
            Some("/dead-letters/confirm?topic=x&action=redrive")
        );
        assert_eq!(
            link_before(list, "purge the matching").as_deref(),
            Some("/dead-letters/confirm?topic=x&action=purge&scope=any")
        );
        let confirm = "<form id=\"confirm\" method=\"post\" action=\"/dead-letters/bulk\"><input type=\"hidden\" \
                       name=\"csrf\" value=\"abc\"><input type=\"hidden\" name=\"selection\" value=\"e&amp;1\">\
                       <label><input type=\"checkbox\" name=\"out_of_order\" value=\"1\"> out of order</label>\
                       <button>redrive</button></form>";
        assert_eq!(
            form_fields(confirm, "confirm"),
            Some(vec![
                ("csrf".into(), "abc".into()),
                ("selection".into(), "e&1".into())
            ])
        );
        assert_eq!(form_fields("<p>Nothing to do.</p>", "confirm"), None);
        let confirm = "<h1>Confirm</h1><p>Selection: topic <code>x.ordered</code>, subscriber <code>s2</code>, id up \
                       to <code>9</code>.</p>";
        assert_eq!(
            between(confirm, "Selection: ", "</p>").as_deref(),
            Some("topic x.ordered, subscriber s2, id up to 9.")
        );
        let report = "<div class=\"report\" id=\"report\">Redriven <strong id=\"done\">3</strong>, skipped 0, \
                      failed 0 (of 3 counted).</div>";
        assert_eq!(
            text_of(report, "report").as_deref(),
            Some("Redriven 3, skipped 0, failed 0 (of 3 counted).")
        );
    }
}
