//! Small shared helpers: database arguments, migrations, and printing stored text safely
//! ([`printable`]: every table and line the CLI prints passes stored data through it).

use anyhow::Context;
use clap::Args;
use sqlx::PgPool;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Where the database is.
#[derive(Args, Debug, Clone)]
pub struct DbArgs {
    /// Postgres URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = outbox::config::LOCAL_DATABASE_URL
    )]
    pub database_url: String,
}

impl DbArgs {
    /// The outbox's schema: `OUTBOX_SCHEMA` from the environment (default `public`), as the functions read it,
    /// validated and fixed for this process (every library statement names it).
    pub fn schema(&self) -> anyhow::Result<outbox::schema::Schema> {
        let schema = outbox::schema::from_process_env().context("OUTBOX_SCHEMA")?;
        outbox::schema::install(&schema)?;
        Ok(schema)
    }

    /// [`DbArgs::schema`], then [`connect`].
    pub async fn connect(&self) -> anyhow::Result<PgPool> {
        self.schema()?;
        connect(&self.database_url).await
    }
}

/// A small pool for CLI work.
pub async fn connect(url: &str) -> anyhow::Result<PgPool> {
    connect_with(connect_options(url)?).await
}

/// The connection options a Postgres URL gives (to add to before [`connect_with`]).
pub fn connect_options(url: &str) -> anyhow::Result<PgConnectOptions> {
    url.parse()
        .context("DATABASE_URL is not a Postgres URL (postgres://user@host:port/database)")
}

/// [`connect`] with options of the caller's.
pub async fn connect_with(options: PgConnectOptions) -> anyhow::Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .connect_with(options)
        .await
        .with_context(|| {
            "cannot connect to Postgres (is it running, and is DATABASE_URL right?)".to_string()
        })
}

/// Arguments of `outbox migrate`.
#[derive(Args, Debug, Clone)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub db: DbArgs,
}

/// `outbox migrate`: the library's migrations (in the outbox's schema, see [`outbox::migrate`]), then the
/// applied list and the schema version.
pub async fn migrate(args: &MigrateArgs) -> anyhow::Result<()> {
    migrate_with(&args.db, &[]).await
}

/// The library's migrations (in the outbox's schema), then each application's in `apps` (named, in the
/// connection's own search path, `public` by default), then the applied list and the schema version. The
/// application migrators must set `ignore_missing`: they share the migrations table with the library's
/// (decision record 0010).
pub async fn migrate_with(db: &DbArgs, apps: &[(&str, &Migrator)]) -> anyhow::Result<()> {
    let schema = db.schema()?;
    let pool = connect(&db.database_url).await?;
    outbox::migrate(&pool, &schema)
        .await
        .with_context(|| format!("applying migrations in schema {schema}"))?;
    for (name, migrator) in apps {
        migrator
            .run(&pool)
            .await
            .with_context(|| format!("applying {name}'s migrations"))?;
    }
    let rows: Vec<(i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT version, description FROM {} WHERE success ORDER BY version",
        schema.table("_sqlx_migrations")
    )))
    .fetch_all(&pool)
    .await?;
    for (v, d) in &rows {
        println!("applied {v} {d}");
    }
    if let Some((v, _)) = rows.last() {
        println!("schema version {v} ({} migrations)", rows.len());
    }
    Ok(())
}

/// Characters that must not reach a terminal raw: C0 and C1 controls and DEL (they can move the cursor, rewrite
/// the line, change colours or send terminal queries: `\x1b[...`, `\r`, U+009B), bidirectional embeddings,
/// overrides, isolates and marks (they reorder what follows on the line: U+202A–U+202E, U+2066–U+2069, U+200E,
/// U+200F, U+061C), and the Unicode line and paragraph separators (U+2028, U+2029).
fn must_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{061c}'
                | '\u{2028}'
                | '\u{2029}'
        )
}

/// Appends `c` to `out`, escaped if it [must be](must_escape): `\n`, `\r`, `\t`, otherwise `\u{hex}` (ESC is
/// `\u{1b}`). With `multi_line`, `\n` and `\t` stay as they are. The one place the CLI escapes stored text.
fn push_printable(out: &mut String, c: char, multi_line: bool) {
    match c {
        '\n' | '\t' if multi_line => out.push(c),
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        c if must_escape(c) => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
        c => out.push(c),
    }
}

/// Stored text (topics, keys, errors, bodies, headers) safe to print on one line: every control character,
/// bidi control and line separator escaped (see `push_printable`). Backslashes are not doubled, so a stored
/// `\u{1b}` and an escaped ESC look alike; nothing raw gets through either way.
pub fn printable(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        push_printable(&mut out, c, false);
    }
    out
}

/// [`printable`] for multi-line fields (a pretty-printed payload): newlines and tabs stay, everything else that
/// must not reach a terminal is escaped.
pub fn printable_lines(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        push_printable(&mut out, c, true);
    }
    out
}

/// [`printable`] cut to `max` characters with an ellipsis (an escape is never cut in half): a table cell.
pub fn one_line(s: &str, max: usize) -> String {
    let flat = printable(s);
    if flat.chars().count() <= max {
        return flat;
    }
    let mut out = String::new();
    let mut piece = String::new();
    let mut n = 0;
    for c in s.chars() {
        piece.clear();
        push_printable(&mut piece, c, false);
        let len = piece.chars().count();
        if n + len > max.saturating_sub(1) {
            break;
        }
        out.push_str(&piece);
        n += len;
    }
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_escapes_controls_bidi_and_separators() {
        assert_eq!(
            printable("a\x1b[31mb\rc\nd\te\u{0}f\u{7f}\u{9b}g"),
            "a\\u{1b}[31mb\\rc\\nd\\te\\u{0}f\\u{7f}\\u{9b}g"
        );
        assert_eq!(
            printable("\u{202a}\u{202e}\u{2066}\u{2069}\u{200e}\u{200f}\u{61c}\u{2028}\u{2029}"),
            "\\u{202a}\\u{202e}\\u{2066}\\u{2069}\\u{200e}\\u{200f}\\u{61c}\\u{2028}\\u{2029}"
        );
        assert_eq!(
            printable("plain text, ünïcödé 🦀 \\ \""),
            "plain text, ünïcödé 🦀 \\ \""
        );
        assert_eq!(
            printable_lines("a\n\tb\r\x1bc\u{202e}"),
            "a\n\tb\\r\\u{1b}c\\u{202e}"
        );
    }

    #[test]
    fn one_line_cuts_between_escapes() {
        assert_eq!(one_line("abc", 3), "abc");
        assert_eq!(one_line("abcd", 3), "ab…");
        assert_eq!(one_line("a\x1bb", 10), "a\\u{1b}b");
        // "a\u{1b}" is 7 characters: with max 6 only "a" fits before the ellipsis.
        assert_eq!(one_line("a\x1bbcdef", 6), "a…");
        assert_eq!(one_line("\n\n", 4), "\\n\\n");
        assert_eq!(one_line("\n\n\n", 4), "\\n…");
    }
}
