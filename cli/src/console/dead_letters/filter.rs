//! The filter of the dead-letter pages: parsed from parameters, carried field by field into every link, form and
//! description ([`parts`]), and a confirmed selection as one form field.

use axum::http::StatusCode;
use axum::response::Response;
use chrono::{DateTime, Utc};
use outbox::dead_letters::{Filter, PurgeScope, Source};

use crate::console::context::{Ctx, Params};
use crate::console::html::Html;
use crate::console::respond;

/// The filter the parameters describe (`max_id` too, when given), or what is wrong with them.
pub(super) fn filter_of(p: &Params) -> Result<Filter, String> {
    let time = |name: &str| -> Result<Option<DateTime<Utc>>, String> {
        p.get(name)
            .map(|v| crate::dead_letters::parse_time(v).map_err(|e| format!("{name}: {e}")))
            .transpose()
    };
    Ok(Filter {
        topic: p.string("topic").map(Into::into),
        source: p.get("source").map(str::parse::<Source>).transpose()?,
        key: p.string("key").map(Into::into),
        since: time("since")?,
        until: time("until")?,
        error: p.string("error"),
        error_group: p.string("group"),
        max_id: p
            .get("max_id")
            .map(|v| {
                v.parse::<outbox::DeadLetterId>()
                    .map_err(|_| "max_id: not a number".to_owned())
            })
            .transpose()?,
        subscriber: p
            .get("subscriber")
            .map(|v| outbox::subscribers::parse_name(v).map_err(|e| e.to_string()))
            .transpose()?,
    })
}

/// One field of a filter: its parameter, its name in words, and its value as a parameter and as shown (`None`:
/// not set).
pub(super) struct Part {
    param: &'static str,
    words: &'static str,
    value: Option<String>,
    shown: Option<String>,
}

impl Part {
    fn new(param: &'static str, words: &'static str, value: Option<String>) -> Part {
        Part {
            param,
            words,
            shown: value.clone(),
            value,
        }
    }
}

/// The filter's fields, the one list that links ([`params_of`]), the words of a selection ([`describe`]) and the
/// filter form ([`filter_form`]) are made from: every field by name, so a field added to [`Filter`] does not
/// compile here until it has its part, and then no link, form or confirmation can drop it. Times as RFC 3339 (a
/// confirmation carries exactly what was counted), the default subscriber as `default`.
pub(super) fn parts(f: &Filter) -> [Part; 9] {
    let Filter {
        topic,
        source,
        key,
        since,
        until,
        error,
        error_group,
        max_id,
        subscriber,
    } = f;
    let time = |param, words, t: &Option<DateTime<Utc>>| Part {
        param,
        words,
        value: t.map(|t| t.to_rfc3339()),
        shown: t.map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string()),
    };
    let subscriber = subscriber
        .as_deref()
        .map(|s| outbox::subscribers::label(s).to_owned());
    [
        Part::new("topic", "topic", topic.clone().map(String::from)),
        Part::new("subscriber", "subscriber", subscriber),
        Part::new("source", "source", source.map(|s| s.as_str().to_owned())),
        Part::new("key", "key", key.clone().map(String::from)),
        Part::new("error", "error contains", error.clone()),
        Part::new("group", "error group", error_group.clone()),
        time("since", "recorded since", since),
        time("until", "recorded before", until),
        Part::new("max_id", "id up to", max_id.map(|m| m.to_string())),
    ]
}

/// The filter as parameters: its set fields ([`parts`]).
pub(super) fn params_of(f: &Filter) -> Vec<(&'static str, String)> {
    parts(f)
        .into_iter()
        .filter_map(|p| Some((p.param, p.value?)))
        .collect()
}

pub(super) fn pairs<'a>(v: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    v.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// The filter in words: its set fields ([`parts`]), or `no filter`.
pub(super) fn describe(h: &mut Html, f: &Filter) {
    let mut first = true;
    for p in parts(f) {
        let Some(shown) = p.shown else { continue };
        if !first {
            h.lit(", ");
        }
        first = false;
        h.lit(p.words).lit(" <code>").text(shown).lit("</code>");
    }
    if first {
        h.lit("no filter");
    }
}

pub(super) fn bad_request(ctx: &Ctx, message: &str) -> Response {
    let mut h = Html::new();
    h.text(message);
    respond::error_page(ctx, StatusCode::BAD_REQUEST, &h)
}

/// The filter form: a field for every part of the filter ([`parts`]; the source a choice, `max_id`, which only a
/// confirmation sets, hidden), so that filtering again never drops part of the selection.
pub(super) fn filter_form(h: &mut Html, f: &Filter, include_handled: bool) {
    h.lit("<form class=\"filters\" method=\"get\" action=\"/dead-letters\">");
    for p in parts(f) {
        let value = p.value.as_deref().unwrap_or("");
        match p.param {
            "source" => source_choice(h, value),
            "max_id" if !value.is_empty() => {
                h.lit("<input type=\"hidden\" name=\"max_id\" value=\"")
                    .text(value)
                    .lit("\">");
            }
            "max_id" => {}
            param => {
                let size = match param {
                    "error" | "group" => "20",
                    "since" | "until" => "12",
                    _ => "14",
                };
                h.lit("<label>")
                    .lit(p.words)
                    .lit("<input name=\"")
                    .lit(param)
                    .lit("\" size=\"")
                    .lit(size)
                    .lit("\" value=\"")
                    .text(value)
                    .lit("\"");
                if param == "since" {
                    h.lit(" placeholder=\"30m, 2d, date\"");
                }
                h.lit("></label>");
            }
        }
    }
    h.lit("<label><span><input type=\"checkbox\" name=\"all\" value=\"1\"");
    if include_handled {
        h.lit(" checked");
    }
    h.lit("> include handled</span></label><button>Filter</button> <a href=\"/dead-letters\">clear</a></form>");
}

/// The source as a choice: any, relay or qstash.
pub(super) fn source_choice(h: &mut Html, selected: &str) {
    h.lit("<label>source<select name=\"source\"><option value=\"\">any</option>");
    for s in ["relay", "qstash"] {
        h.lit("<option");
        if selected == s {
            h.lit(" selected");
        }
        h.lit(">").lit(s).lit("</option>");
    }
    h.lit("</select></label>");
}

/// Which dead letters a purge takes (`scope`: `any`, the default, `handled` or `unhandled`; `handled_only=1` is
/// `handled`): the list's purge link says `unhandled` unless the list includes handled ones, so that the
/// confirmation counts what the list matched.
pub(super) fn scope_of(p: &Params) -> Result<PurgeScope, String> {
    match (p.get("scope"), p.flag("handled_only")) {
        (Some(s), _) => s.parse(),
        (None, true) => Ok(PurgeScope::Handled),
        (None, false) => Ok(PurgeScope::Any),
    }
}

/// A confirmed selection as a form field: base64url of the filter's JSON.
pub(super) fn encode_selection(f: &Filter) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(serde_json::to_vec(f).unwrap_or_default())
}

/// [`encode_selection`] back; `None` when it is not one.
pub(super) fn decode_selection(s: &str) -> Option<Filter> {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(s)
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

pub(super) fn refuse_unfiltered(ctx: &Ctx) -> Response {
    let mut h = Html::new();
    h.lit("<span id=\"refused\">A bulk action needs a filter</span> (topic, subscriber, source, key, error, error \
           group or a time range), so that it cannot touch every dead letter by accident. To select all of them on purpose, \
           give an explicit time range (since <code>1970-01-01</code>).");
    respond::error_page(ctx, StatusCode::BAD_REQUEST, &h)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of a filter survives the trip through a link or a form (what [`params_of`] writes,
    /// [`filter_of`] reads back), the default subscriber included: no link or form drops part of a selection.
    #[test]
    fn a_filter_with_every_field_set_round_trips_through_its_parameters() {
        let at = |s: &str| DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc);
        for subscriber in ["shipping", ""] {
            let f = Filter {
                topic: Some("orders".into()),
                source: Some(Source::Qstash),
                key: Some("customer 42&x=1".into()),
                since: Some(at("2026-03-01T12:00:00Z")),
                until: Some(at("2026-03-02T00:00:00Z")),
                error: Some("answered 489".into()),
                error_group: Some("consumer answered N".into()),
                max_id: Some(77.into()),
                subscriber: Some(subscriber.into()),
            };
            let query = url::form_urlencoded::Serializer::new(String::new())
                .extend_pairs(params_of(&f))
                .finish();
            assert_eq!(filter_of(&Params::parse(query.as_bytes())), Ok(f.clone()));
            let mut described = Html::new();
            describe(&mut described, &f);
            let described = described.into_string();
            assert!(
                described.contains(&format!(
                    "subscriber <code>{}</code>",
                    outbox::subscribers::label(subscriber)
                )),
                "{described}"
            );
            let mut form = Html::new();
            filter_form(&mut form, &f, false);
            let form = form.into_string();
            for name in [
                "topic",
                "subscriber",
                "source",
                "key",
                "error",
                "group",
                "since",
                "until",
                "max_id",
            ] {
                assert!(form.contains(&format!("name=\"{name}\"")), "{name}: {form}");
            }
        }
    }
}
