//! What the console's tests share: a console on a free port against a test database, an HTTP client that
//! keeps the session cookie like a browser, reading forms out of pages, the hostile-text corpus stored in every
//! field, and a WebDriver client for the browser tests.

#![allow(dead_code)]

pub mod webdriver;

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

use outbox_cli::console::{Console, ConsoleArgs};
use outbox_cli::util::DbArgs;
use outbox_testkit::db::{dead_letter, event, key_state, url_of};
use reqwest::StatusCode;
use reqwest::header::{COOKIE, HeaderMap, SET_COOKIE};
use sqlx::PgPool;

/// Text an attacker could store in a topic, key, payload, header, error or response body: markup that would run
/// script if it reached the page raw (a `<script>` that sets the title, an `onerror` that adds an element), a
/// quote-breaking attribute injection, a bidi override (reorders the rest of the line), terminal escapes and
/// other control characters.
pub const HOSTILE: &str = "<script>document.title='pwned'</script>\"><img src=x onerror=\"document.body.appendChild(document.createElement('blink'))\">'><svg onload=document.title='pwned'>\u{202e}gnp.exe\u{1b}[31m\u{7}\u{8}end";

/// `HOSTILE` with a marker of where it was stored (so each field's rendering can be told apart).
pub fn hostile(field: &str) -> String {
    format!("{field}-{HOSTILE}")
}

/// What must never appear in a page built from [`HOSTILE`] text: the tags it carries, raw, and the characters
/// that reorder or hide text.
pub fn assert_no_raw_hostile_text(page: &str, what: &str) {
    let lower = page.to_ascii_lowercase();
    for raw in ["<script", "<img", "<svg onload", "'><svg", "\"><img"] {
        assert!(
            !lower.contains(raw),
            "{what}: {raw:?} reached the page unescaped"
        );
    }
    for c in ['\u{202e}', '\u{1b}', '\u{7}', '\u{8}'] {
        assert!(
            !page.contains(c),
            "{what}: U+{:04X} reached the page raw",
            u32::from(c)
        );
    }
}

/// Stores [`HOSTILE`] text in every field the console shows: an ordered event's topic, key, payload, headers and
/// last error, its key's blocked reason, its dead letter's error, response body, raw callback and parse error; and
/// a flapping pending event of the same key. Returns (event, dead letter, topic, key).
pub async fn seed_hostile(pool: &PgPool) -> (i64, i64, String, String) {
    let topic = hostile("topic");
    let key = hostile("key");
    let head: i64 = sqlx::query_scalar(
        "INSERT INTO outbox (topic, partition_key, seq, payload, headers, dead_lettered_at, attempts, last_error) \
         VALUES ($1, $2, 1, jsonb_build_object('note', $3::text), jsonb_build_object('user', jsonb_build_object('x', $4::text)), \
                 now(), 4, $5) RETURNING id",
    )
    .bind(&topic)
    .bind(&key)
    .bind(hostile("payload"))
    .bind(hostile("header"))
    .bind(hostile("last-error"))
    .fetch_one(pool)
    .await
    .unwrap();
    key_state(
        pool,
        &topic,
        &key,
        1,
        0,
        "blocked_at = now(), blocked_reason = 'x'",
    )
    .await;
    sqlx::query("UPDATE outbox_keys SET blocked_id = $1, blocked_reason = $2")
        .bind(head)
        .bind(hostile("reason"))
        .execute(pool)
        .await
        .unwrap();
    let dl = dead_letter(pool, "qstash", Some(head), "").await;
    sqlx::query("UPDATE dead_letters SET error = $2, response_body = $3, raw_callback = $4, parse_error = $5 WHERE id = $1")
        .bind(dl)
        .bind(hostile("error"))
        .bind(hostile("response"))
        .bind(hostile("raw").into_bytes())
        .bind(hostile("parse"))
        .execute(pool)
        .await
        .unwrap();
    // Pending and flapping, so the overview lists it too.
    event(pool, &topic, &key, None, "attempts = 9, last_error = 'x'").await;

    (head, dl, topic, key)
}

/// The arguments of a loopback console on a free port against `pool`'s database.
pub fn args(pool: &PgPool) -> ConsoleArgs {
    ConsoleArgs {
        db: DbArgs {
            database_url: url_of(pool),
        },
        port: 0,
        bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
        read_only: false,
        token_file: None,
        allow_host: Vec::new(),
        consumers: vec!["consumer".into()],
        refresh_secs: 5,
        statement_timeout_secs: outbox_cli::console::DEFAULT_STATEMENT_TIMEOUT_SECS,
    }
}

/// A token file with `lines`, kept for the test's life.
pub fn token_file(lines: &str) -> (tempdir::Dir, PathBuf) {
    let dir = tempdir::Dir::new();
    let path = dir.path().join("tokens");
    std::fs::write(&path, lines).unwrap();
    (dir, path)
}

/// A scratch directory removed on drop (no extra crate for one file).
pub mod tempdir {
    use std::path::{Path, PathBuf};

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new() -> Dir {
            use std::sync::atomic::{AtomicU64, Ordering};
            static N: AtomicU64 = AtomicU64::new(0);
            let p = std::env::temp_dir().join(format!(
                "outbox-console-test-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// An HTTP client that behaves like a browser tab: it keeps the console's session cookie and does not follow
/// redirects (the tests look at them).
pub struct Tab {
    pub base: String,
    client: reqwest::Client,
    pub cookie: Option<String>,
    /// Extra headers on every request (Host, Origin).
    pub headers: HeaderMap,
}

/// A response: status, `Location`, body.
#[derive(Debug)]
pub struct Page {
    pub status: StatusCode,
    pub location: Option<String>,
    pub body: String,
}

impl Tab {
    pub fn new(console: &Console) -> Tab {
        outbox::install_crypto_provider();
        Tab {
            base: console.url(),
            client: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
            cookie: None,
            headers: HeaderMap::new(),
        }
    }

    async fn send(&mut self, req: reqwest::RequestBuilder) -> Page {
        let mut req = req.headers(self.headers.clone());
        if let Some(c) = &self.cookie {
            req = req.header(COOKIE, c);
        }
        let r = req.send().await.unwrap();
        for v in r.headers().get_all(SET_COOKIE) {
            let v = v.to_str().unwrap();
            let pair = v.split(';').next().unwrap().to_owned();
            if pair.ends_with('=') {
                self.cookie = None;
            } else {
                self.cookie = Some(pair);
            }
        }
        Page {
            status: r.status(),
            location: r
                .headers()
                .get(reqwest::header::LOCATION)
                .map(|v| v.to_str().unwrap().to_owned()),
            body: r.text().await.unwrap(),
        }
    }

    pub async fn get(&mut self, path: &str) -> Page {
        let req = self.client.get(format!("{}{path}", self.base));
        self.send(req).await
    }

    /// A form post (`application/x-www-form-urlencoded`).
    pub async fn post(&mut self, path: &str, form: &[(String, String)]) -> Page {
        let body = url_encoded(form);
        let req = self
            .client
            .post(format!("{}{path}", self.base))
            .header(
                reqwest::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .body(body);
        self.send(req).await
    }
}

fn url_encoded(form: &[(String, String)]) -> String {
    let enc = |s: &str| {
        s.bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect::<String>()
    };
    form.iter()
        .map(|(k, v)| format!("{}={}", enc(k), enc(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// HTML entities back to text (the five the console writes).
pub fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

/// The hidden fields of the form with `id` in `page` (name, value), in order.
pub fn hidden_fields(page: &str, id: &str) -> Vec<(String, String)> {
    let start = page
        .find(&format!("<form id=\"{id}\""))
        .unwrap_or_else(|| panic!("no form {id:?} in the page:\n{page}"));
    let form = &page[start..start + page[start..].find("</form>").unwrap()];
    let mut out = Vec::new();
    for part in form.split("<input type=\"hidden\" ").skip(1) {
        let attr = |name: &str| -> String {
            let key = format!("{name}=\"");
            let s = &part[part.find(&key).unwrap() + key.len()..];
            unescape(&s[..s.find('"').unwrap()])
        };
        out.push((attr("name"), attr("value")));
    }
    out
}

/// The session's CSRF token, as the page states it (`<meta name="csrf-token">`, what its forms carry).
pub fn csrf(page: &str) -> String {
    let key = "<meta name=\"csrf-token\" content=\"";
    let s = &page[page.find(key).expect("no CSRF field in the page") + key.len()..];
    s[..s.find('"').unwrap()].to_owned()
}

/// The text of the element with `id` (`<x id="…">text</x>`, no nested markup).
pub fn by_id(page: &str, id: &str) -> String {
    let key = format!("id=\"{id}\">");
    let s = &page[page
        .find(&key)
        .unwrap_or_else(|| panic!("no #{id} in the page:\n{page}"))
        + key.len()..];
    unescape(&s[..s.find('<').unwrap()])
}

/// A bulk action's selection field as the confirmation page writes it (base64url of the filter's JSON).
pub fn selection(filter: serde_json::Value) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(filter.to_string())
}

/// [`selection`] back.
pub fn selected(field: &str) -> serde_json::Value {
    use base64::Engine;
    serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(field)
            .unwrap(),
    )
    .unwrap()
}

/// The value of the hidden field `name` of form `id`.
pub fn field(page: &str, id: &str, name: &str) -> String {
    hidden_fields(page, id)
        .into_iter()
        .find(|(k, _)| k == name)
        .unwrap_or_else(|| panic!("no field {name} in form {id}"))
        .1
}

/// `(name, value)` pairs from string literals.
pub fn form(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}
