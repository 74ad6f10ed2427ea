//! What every handler gets: the shared state ([`App`]), the request's context ([`Ctx`]) and its parameters
//! ([`Params`]).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use sqlx::PgPool;

use super::auth::{HostCheck, Keys, Session, Token};

/// What every handler shares.
pub struct App {
    pub pool: PgPool,
    pub keys: Keys,
    /// Empty: a loopback console without tokens (everyone on this machine is `local`).
    pub tokens: Vec<Token>,
    pub hosts: HostCheck,
    pub read_only: bool,
    /// The reconciler's horizon (`outbox status` counts in-flight events older than it as unaccounted).
    pub horizon: Duration,
    /// Dedupe namespaces (`CONSUMER_NAME`s) the event page looks in.
    pub consumers: Vec<String>,
    /// The overview reloads itself this often (0: never).
    pub refresh_secs: u32,
}

/// Shared state.
pub type S = State<Arc<App>>;

/// The request's context: who, their CSRF token, whether actions are allowed.
#[derive(Debug, Clone)]
pub struct Ctx {
    pub session: Session,
    pub csrf: String,
    pub read_only: bool,
    /// Logged in with a token (a log-out button is shown).
    pub logged_in: bool,
}

/// Query or form parameters (`application/x-www-form-urlencoded`); the first of a repeated name counts.
#[derive(Debug, Clone, Default)]
pub struct Params(Vec<(String, String)>);

impl Params {
    /// Parses a query string or a form body.
    pub fn parse(raw: &[u8]) -> Params {
        Params(url::form_urlencoded::parse(raw).into_owned().collect())
    }

    /// A parameter's value, trimmed; `None` when missing or empty.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.trim())
            .filter(|v| !v.is_empty())
    }

    /// A parameter as a string.
    pub fn string(&self, name: &str) -> Option<String> {
        self.get(name).map(str::to_owned)
    }

    /// A checkbox or flag: present and not `0`/`false`.
    pub fn flag(&self, name: &str) -> bool {
        self.get(name).is_some_and(|v| v != "0" && v != "false")
    }
}

/// The query string of a request.
pub fn query(uri: &axum::http::Uri) -> Params {
    Params::parse(uri.query().unwrap_or("").as_bytes())
}
