//! The Postgres schema the outbox's own tables live in (`OUTBOX_SCHEMA`, default `public`), and the rendering of
//! the library's SQL with schema-qualified names.
//!
//! Why qualified names rather than a `search_path`: the consumer's handlers and the producer run the application's
//! own SQL in the same transaction as the library's statements, on the application's connection and with its
//! `search_path`. Changing that path would change what the application's unqualified names mean (its own
//! `dead_letters` table, say), so every library statement names the schema instead and the connection is left
//! alone. See `docs/decisions/0013-outbox-schema-handle.md`.
//!
//! The statements are written once as templates with a `{schema}` placeholder (`FROM {schema}.outbox`) and
//! rendered through the process's [`Schema`]: [`q`] for the `'static` statements (rendered once per process and
//! kept), [`Schema::sql`] for statements assembled at run time. A template that escaped rendering fails loudly
//! (`{schema}` is a syntax error in Postgres), never silently against `public`.
//!
//! One schema per process: it is fixed by the first of [`install`] (what the functions, the CLI and the dev
//! command do at start, from `OUTBOX_SCHEMA` as read by [`crate::db::DbConfig`]) or the first statement rendered
//! (which reads `OUTBOX_SCHEMA` from the environment, for an application that only uses the producer).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The placeholder the library's SQL templates use for the schema.
pub(crate) const PLACEHOLDER: &str = "{schema}";

/// The environment variable naming the schema.
pub(crate) const ENV_VAR: &str = "OUTBOX_SCHEMA";

/// A schema name that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid outbox schema name {name:?}: {reason} (use lower-case letters, digits and '_', starting with a \
     letter or '_', at most 63 characters, e.g. `outbox`)"
)]
pub struct InvalidSchema {
    /// The name as given.
    pub name: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// A second, different schema for a process whose schema is already fixed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the outbox schema of this process is already {current:?}; it cannot switch to {requested:?} (one outbox \
     schema per process: set OUTBOX_SCHEMA before start)"
)]
pub struct SchemaConflict {
    /// The schema in use.
    pub current: String,
    /// The one asked for.
    pub requested: String,
}

/// A validated schema name, with its quoted form for SQL. Cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schema {
    name: Arc<str>,
    quoted: Arc<str>,
}

impl Default for Schema {
    fn default() -> Self {
        Schema::public()
    }
}

impl std::fmt::Display for Schema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

impl Schema {
    /// `public`: where the outbox lived before the schema was configurable, so existing installations keep their
    /// tables and their migration history.
    pub fn public() -> Schema {
        Schema {
            name: Arc::from("public"),
            quoted: Arc::from("\"public\""),
        }
    }

    /// Validates `name` as a plain Postgres identifier. Only names that mean the same quoted and unquoted are
    /// accepted (lower case, no spaces or quotes), so `OUTBOX_SCHEMA=outbox` and a team's hand-written
    /// `outbox.dead_letters` name the same schema; `pg_*` is reserved by Postgres.
    pub fn new(name: &str) -> Result<Schema, InvalidSchema> {
        let bad = |reason| InvalidSchema {
            name: name.to_owned(),
            reason,
        };
        let mut chars = name.chars();
        match chars.next() {
            None => return Err(bad("it is empty")),
            Some(c) if !(c.is_ascii_lowercase() || c == '_') => {
                return Err(bad("it must start with a lower-case letter or '_'"));
            }
            Some(_) => {}
        }
        if !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
            return Err(bad(
                "it may contain only lower-case letters, digits and '_'",
            ));
        }
        if name.len() > 63 {
            return Err(bad("it is longer than Postgres' 63-byte identifier limit"));
        }
        if name.starts_with("pg_") {
            return Err(bad(
                "names starting with pg_ are reserved for Postgres' system schemas",
            ));
        }
        if name == "information_schema" {
            return Err(bad("it is Postgres' own catalog schema"));
        }
        Ok(Schema {
            name: Arc::from(name),
            quoted: Arc::from(format!("\"{name}\"")),
        })
    }

    /// The name as configured (`outbox`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name quoted for SQL (`"outbox"`).
    pub fn quoted(&self) -> &str {
        &self.quoted
    }

    /// Whether this is `public`.
    pub fn is_public(&self) -> bool {
        &*self.name == "public"
    }

    /// A table (or sequence) of the outbox, qualified: `"outbox".dead_letters`.
    pub fn table(&self, table: &str) -> String {
        format!("{}.{table}", self.quoted)
    }

    /// Renders a template: every `{schema}` becomes the quoted schema name.
    pub fn sql(&self, template: &str) -> String {
        template.replace(PLACEHOLDER, &self.quoted)
    }
}

static CURRENT: OnceLock<Schema> = OnceLock::new();

/// Fixes the process's schema. Idempotent for the same schema; a different one after the schema was fixed is a
/// [`SchemaConflict`] (statements already rendered name the first one).
pub fn install(schema: &Schema) -> Result<(), SchemaConflict> {
    let current = CURRENT.get_or_init(|| schema.clone());
    if current == schema {
        Ok(())
    } else {
        Err(SchemaConflict {
            current: current.name().to_owned(),
            requested: schema.name().to_owned(),
        })
    }
}

/// `OUTBOX_SCHEMA` from the process environment: `public` when unset or empty.
pub fn from_process_env() -> Result<Schema, InvalidSchema> {
    match std::env::var(ENV_VAR) {
        Ok(v) if !v.trim().is_empty() => Schema::new(v.trim()),
        _ => Ok(Schema::public()),
    }
}

/// The process's schema. When nothing was installed, `OUTBOX_SCHEMA` from the environment; an invalid value there
/// is logged and `public` used (the functions, the CLI and the dev command validate it at start and refuse to run
/// instead, so this fallback only concerns an application that never built a [`crate::db::DbConfig`]).
pub fn current() -> &'static Schema {
    CURRENT.get_or_init(|| {
        from_process_env().unwrap_or_else(|e| {
            tracing::error!(error = %e, "ignoring OUTBOX_SCHEMA; the outbox tables are looked up in public");
            Schema::public()
        })
    })
}

/// Renders a `'static` template for the process's schema, once: the result is kept for the life of the process
/// (one string per distinct template in the program, so the memory is bounded), and repeated calls return the
/// same `&'static str`, which is what sqlx's prepared-statement cache keys on.
pub fn q(template: &'static str) -> &'static str {
    static RENDERED: OnceLock<Mutex<HashMap<&'static str, &'static str>>> = OnceLock::new();
    let map = RENDERED.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = match map.lock() {
        Ok(m) => m,
        Err(poisoned) => poisoned.into_inner(),
    };
    map.entry(template)
        .or_insert_with(|| Box::leak(current().sql(template).into_boxed_str()))
}

/// Renders a statement built at run time for the process's schema.
pub fn sql(template: &str) -> String {
    current().sql(template)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_identifiers_and_rejects_the_rest() {
        for ok in ["public", "outbox", "_x", "outbox_v2", "a1"] {
            assert_eq!(Schema::new(ok).unwrap().name(), ok);
        }
        for bad in [
            "",
            "Outbox",
            "1x",
            "out box",
            "out\"box",
            "out;drop",
            "pg_temp",
            "information_schema",
            &"x".repeat(64),
        ] {
            let err = Schema::new(bad).unwrap_err();
            assert!(
                err.to_string().contains("invalid outbox schema name"),
                "{err}"
            );
        }
    }

    #[test]
    fn renders_every_placeholder() {
        let s = Schema::new("outbox").unwrap();
        assert_eq!(
            s.sql("SELECT 1 FROM {schema}.outbox o JOIN {schema}.outbox_keys k ON true"),
            "SELECT 1 FROM \"outbox\".outbox o JOIN \"outbox\".outbox_keys k ON true"
        );
        assert_eq!(s.table("dead_letters"), "\"outbox\".dead_letters");
    }
}
