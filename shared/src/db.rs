//! A Postgres pool suited to Lambda: few connections, lazy connect (no I/O at cold start), short timeouts,
//! a server-side `idle_in_transaction_session_timeout` so a frozen or killed invocation can never pin the xmin
//! horizon, and a switch for the prepared-statement cache (off behind RDS Proxy / PgBouncer in transaction
//! mode, where named statements break or pin sessions).
//!
//! The pool and that switch travel together as one handle, [`Db`]; code that runs in a caller's transaction
//! gets the switch alone, [`Statements`] (decision record 0016).

use std::ops::{Deref, DerefMut};
use std::str::FromStr;
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::query::{Query, QueryAs, QueryScalar};
use sqlx::{Connection, FromRow, PgConnection, PgPool, Postgres, SqlSafeStr, Transaction};

use crate::config::{ConfigError, Vars};
use crate::schema::Schema;

/// Pool settings, from `DB_*` environment variables.
#[derive(Debug, Clone)]
pub struct DbConfig {
    /// `DB_MAX_CONNECTIONS` (default 2): one Lambda environment serves one invocation at a time.
    pub max_connections: u32,
    /// `DB_ACQUIRE_TIMEOUT_MS` (default 5000).
    pub acquire_timeout: Duration,
    /// `DB_STATEMENT_TIMEOUT_MS` (default 30000; 0 disables).
    pub statement_timeout: Duration,
    /// `DB_IDLE_IN_TRANSACTION_TIMEOUT_MS` (default 10000).
    pub idle_in_transaction_timeout: Duration,
    /// `DB_PERSISTENT_STATEMENTS` (default true: [`Statements::Prepared`]). Set false behind RDS Proxy or
    /// PgBouncer (transaction mode): [`Statements::Unnamed`], every query then uses an unnamed statement.
    /// (sqlx 0.9's `statement_cache_capacity(0)` leaks named statements instead, so it is not used.)
    pub statements: Statements,
    /// `DB_ASYNC_COMMIT` (default false here; the relay and the callback function default to true for their own
    /// pools, see `docs/decisions/0006-relay-async-commit.md`).
    pub async_commit: bool,
    /// `DB_MAX_LIFETIME_SECS` (default 1800): keep below any proxy idle timeout.
    pub max_lifetime: Duration,
    /// `DB_IDLE_TIMEOUT_SECS` (default 300).
    pub idle_timeout: Duration,
    /// `application_name` shown in `pg_stat_activity`.
    pub application_name: String,
    /// `OUTBOX_SCHEMA` (default `public`): the schema of the outbox's own tables, named in every library
    /// statement (see [`crate::schema`]). Fixed for the process when the pool is built.
    pub schema: Schema,
}

impl DbConfig {
    /// Defaults for the named application.
    pub fn defaults(application_name: &str) -> Self {
        DbConfig {
            max_connections: 2,
            acquire_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(30),
            idle_in_transaction_timeout: Duration::from_secs(10),
            statements: Statements::Prepared,
            async_commit: false,
            max_lifetime: Duration::from_secs(1800),
            idle_timeout: Duration::from_secs(300),
            application_name: application_name.to_owned(),
            schema: crate::schema::current().clone(),
        }
    }

    /// Reads the `DB_*` variables over the defaults.
    pub fn from_vars(v: &Vars<'_>, application_name: &str) -> Result<Self, ConfigError> {
        Self::from_vars_over(v, Self::defaults(application_name))
    }

    /// Reads the `DB_*` variables over `d`: for a function whose defaults differ from [`DbConfig::defaults`]
    /// (the relay and the callback function commit asynchronously unless `DB_ASYNC_COMMIT` says otherwise).
    pub fn from_vars_over(v: &Vars<'_>, d: DbConfig) -> Result<Self, ConfigError> {
        Ok(DbConfig {
            max_connections: v.ranged_or("DB_MAX_CONNECTIONS", d.max_connections, 1, 100)?,
            acquire_timeout: v.duration_or("DB_ACQUIRE_TIMEOUT_MS", d.acquire_timeout)?,
            statement_timeout: v.duration_or("DB_STATEMENT_TIMEOUT_MS", d.statement_timeout)?,
            idle_in_transaction_timeout: v.duration_or(
                "DB_IDLE_IN_TRANSACTION_TIMEOUT_MS",
                d.idle_in_transaction_timeout,
            )?,
            statements: Statements::from_persistent(
                v.bool_or("DB_PERSISTENT_STATEMENTS", d.statements.is_prepared())?,
            ),
            async_commit: v.bool_or("DB_ASYNC_COMMIT", d.async_commit)?,
            max_lifetime: v.duration_or("DB_MAX_LIFETIME_SECS", d.max_lifetime)?,
            idle_timeout: v.duration_or("DB_IDLE_TIMEOUT_SECS", d.idle_timeout)?,
            application_name: v.raw("DB_APPLICATION_NAME").unwrap_or(d.application_name),
            schema: match v.raw(crate::schema::ENV_VAR) {
                Some(name) => Schema::new(name.trim()).map_err(|e| ConfigError::InvalidVar {
                    name: crate::schema::ENV_VAR,
                    value: name.clone(),
                    reason: e.to_string(),
                })?,
                None => d.schema,
            },
        })
    }

    /// Connect options from a URL plus these settings. Session settings go in the startup packet (no `SET`
    /// round trip, nothing for a proxy to pin on).
    pub fn connect_options(&self, url: &SecretString) -> Result<PgConnectOptions, ConfigError> {
        let opts = PgConnectOptions::from_str(url.expose_secret()).map_err(|e| {
            // sqlx's message may quote the URL; keep only the part before any quote.
            let msg = e.to_string();
            let reason = msg
                .split(['"', '\''])
                .next()
                .unwrap_or("unparseable")
                .trim()
                .to_owned();
            ConfigError::InvalidDatabaseUrl { reason }
        })?;
        let mut settings = vec![
            (
                "statement_timeout",
                self.statement_timeout.as_millis().to_string(),
            ),
            (
                "idle_in_transaction_session_timeout",
                self.idle_in_transaction_timeout.as_millis().to_string(),
            ),
        ];
        if self.async_commit {
            settings.push(("synchronous_commit", "off".to_owned()));
        }
        Ok(opts
            .application_name(&self.application_name)
            .options(settings))
    }

    /// The database handle: [`DbConfig::pool`] with [`DbConfig::statements`].
    pub fn handle(&self, url: &SecretString) -> Result<Db, ConfigError> {
        Ok(Db::new(self.pool(url)?, self.statements))
    }

    /// A lazily connecting pool: building it does no I/O, the first query connects. Fixes the process's outbox
    /// schema to [`DbConfig::schema`] ([`crate::schema::install`]); a different one already in use is an error.
    pub fn pool(&self, url: &SecretString) -> Result<PgPool, ConfigError> {
        crate::schema::install(&self.schema).map_err(|e| ConfigError::InvalidVar {
            name: crate::schema::ENV_VAR,
            value: self.schema.name().to_owned(),
            reason: e.to_string(),
        })?;
        let opts = self.connect_options(url)?;
        Ok(ping_when_idle(
            PgPoolOptions::new()
                .max_connections(self.max_connections)
                .min_connections(0)
                .acquire_timeout(self.acquire_timeout)
                .max_lifetime(self.max_lifetime)
                .idle_timeout(self.idle_timeout),
        )
        .connect_lazy_with(opts))
    }
}

/// A pooled connection idle for longer than this is pinged before it is handed out.
pub const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

/// The pools' liveness check: ping a connection before handing it out only when it sat idle for longer than
/// [`PING_IF_IDLE_FOR`]. A Lambda environment that was frozen between invocations (or a NAT or server that
/// dropped an idle connection) gets a ping and a fresh connection if the old one died; a connection reused
/// within a second under load skips the extra round trip (one of the consumer's five per event). A connection
/// that dies within that second fails its statement instead: the caller answers 5xx (consumer) or retries on
/// its next cycle (relay), like any database error.
pub(crate) fn ping_when_idle(options: PgPoolOptions) -> PgPoolOptions {
    options
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for > PING_IF_IDLE_FOR {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// How statements are sent: `DB_PERSISTENT_STATEMENTS` as a type. Every statement the library runs, and every
/// statement an application handler runs on the connection it is given, goes out in this mode: build it with
/// [`Statements::query`] (or [`Db::query`]) rather than `sqlx::query`, so nobody has to remember
/// `.persistent(..)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Statements {
    /// Named prepared statements, cached per connection (the default): Postgres directly, or a pooler that
    /// keeps a client on one server connection.
    #[default]
    Prepared,
    /// Unnamed statements, and each statement outside a transaction in a transaction of its own
    /// ([`Autocommit`]): behind RDS Proxy or PgBouncer in transaction mode, where a named statement is missing
    /// on the next server connection.
    Unnamed,
}

impl Statements {
    /// The mode `DB_PERSISTENT_STATEMENTS` names: `true` is [`Statements::Prepared`].
    pub fn from_persistent(persistent: bool) -> Self {
        if persistent {
            Statements::Prepared
        } else {
            Statements::Unnamed
        }
    }

    /// Whether statements are named and cached (the value sqlx's `.persistent(..)` takes).
    pub fn is_prepared(self) -> bool {
        self == Statements::Prepared
    }

    /// `sqlx::query(sql)` in this mode.
    pub fn query<'q>(self, sql: impl SqlSafeStr) -> Query<'q, Postgres, PgArguments> {
        sqlx::query(sql).persistent(self.is_prepared())
    }

    /// `sqlx::query_as(sql)` in this mode.
    pub fn query_as<'q, O>(self, sql: impl SqlSafeStr) -> QueryAs<'q, Postgres, O, PgArguments>
    where
        O: for<'r> FromRow<'r, PgRow>,
    {
        sqlx::query_as(sql).persistent(self.is_prepared())
    }

    /// `sqlx::query_scalar(sql)` in this mode.
    pub fn query_scalar<'q, O>(
        self,
        sql: impl SqlSafeStr,
    ) -> QueryScalar<'q, Postgres, O, PgArguments>
    where
        (O,): for<'r> FromRow<'r, PgRow>,
    {
        sqlx::query_scalar(sql).persistent(self.is_prepared())
    }

    /// Wraps `conn` for statements that would otherwise run in autocommit: as is when statements are prepared
    /// or `conn` is already in a transaction, in a transaction of its own otherwise (see [`Autocommit`]).
    pub async fn autocommit(self, conn: &mut PgConnection) -> Result<Autocommit<'_>, sqlx::Error> {
        if self.is_prepared() || conn.is_in_transaction() {
            Ok(Autocommit(Inner::Conn(conn)))
        } else {
            Ok(Autocommit(Inner::Tx(conn.begin().await?)))
        }
    }

    /// Runs `work` on `conn` wrapped by [`Statements::autocommit`], then finishes the wrapper (commits the
    /// transaction it began, if any).
    pub async fn run<T>(
        self,
        conn: &mut PgConnection,
        work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        self.autocommit(conn).await?.run(work).await
    }

    /// Executes one statement on `conn` as [`Statements::run`] does, in this mode; returns the rows affected.
    pub async fn execute(
        self,
        conn: &mut PgConnection,
        query: Query<'_, Postgres, PgArguments>,
    ) -> Result<u64, sqlx::Error> {
        self.run(conn, async |c| self.rows_affected(c, query).await)
            .await
    }

    async fn rows_affected(
        self,
        conn: &mut PgConnection,
        query: Query<'_, Postgres, PgArguments>,
    ) -> Result<u64, sqlx::Error> {
        Ok(query
            .persistent(self.is_prepared())
            .execute(conn)
            .await?
            .rows_affected())
    }
}

/// The database handle: the pool and the [`Statements`] mode its statements go out in. Built once per process
/// ([`DbConfig::handle`]); cheap to clone (the pool is reference-counted). Code that runs in a caller's
/// transaction takes the mode alone ([`Statements`]) with the connection.
#[derive(Debug, Clone)]
pub struct Db {
    pool: PgPool,
    statements: Statements,
}

impl Db {
    /// A handle on `pool` whose statements go out as `statements` says.
    pub fn new(pool: PgPool, statements: Statements) -> Self {
        Db { pool, statements }
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The statement mode.
    pub fn statements(&self) -> Statements {
        self.statements
    }

    /// [`Statements::query`] in this handle's mode.
    pub fn query<'q>(&self, sql: impl SqlSafeStr) -> Query<'q, Postgres, PgArguments> {
        self.statements.query(sql)
    }

    /// [`Statements::query_as`] in this handle's mode.
    pub fn query_as<'q, O>(&self, sql: impl SqlSafeStr) -> QueryAs<'q, Postgres, O, PgArguments>
    where
        O: for<'r> FromRow<'r, PgRow>,
    {
        self.statements.query_as(sql)
    }

    /// [`Statements::query_scalar`] in this handle's mode.
    pub fn query_scalar<'q, O>(
        &self,
        sql: impl SqlSafeStr,
    ) -> QueryScalar<'q, Postgres, O, PgArguments>
    where
        (O,): for<'r> FromRow<'r, PgRow>,
    {
        self.statements.query_scalar(sql)
    }

    /// A pooled connection for statements that would otherwise run in autocommit: a plain one when statements
    /// are prepared, one in a transaction of its own otherwise (see [`Autocommit`]).
    pub async fn autocommit(&self) -> Result<Autocommit<'static>, sqlx::Error> {
        if self.statements.is_prepared() {
            Ok(Autocommit(Inner::Pooled(self.pool.acquire().await?)))
        } else {
            Ok(Autocommit(Inner::Tx(self.pool.begin().await?)))
        }
    }

    /// Runs `work` on a connection from [`Db::autocommit`], then finishes it (commits the transaction it began,
    /// if any): for a statement, or a few, that need no transaction of their own.
    pub async fn run<T>(
        &self,
        work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        self.autocommit().await?.run(work).await
    }

    /// Executes one statement (a bounded `DELETE` or `UPDATE`) as [`Db::run`] does, in this handle's mode;
    /// returns the rows affected.
    pub async fn execute(
        &self,
        query: Query<'_, Postgres, PgArguments>,
    ) -> Result<u64, sqlx::Error> {
        let statements = self.statements;
        self.run(async |c| statements.rows_affected(c, query).await)
            .await
    }
}

/// Where a statement that would otherwise run in autocommit runs: on the connection as is when statements are
/// [`Statements::Prepared`] (or the connection is already in a transaction), inside an explicit transaction of
/// its own when they are [`Statements::Unnamed`]. Made by [`Db::autocommit`] and [`Statements::autocommit`];
/// [`Db::run`] and [`Statements::run`] wrap a piece of work in one.
///
/// sqlx sends an unnamed statement in two round trips, each ended by a Sync (Parse/Describe, then
/// Bind/Execute). A pooler in transaction mode (PgBouncer) hands the server connection back at the first Sync
/// outside a transaction, so the Bind reaches another server connection: `unnamed prepared statement does not
/// exist`. `BEGIN … COMMIT` keeps one server connection for both. With named statements nothing changes: no
/// extra round trip.
///
/// Derefs to [`PgConnection`]: run the statement on `&mut *guard`, then call [`Autocommit::finish`] (which
/// commits when it began a transaction). Dropped without `finish`, the transaction rolls back.
///
/// "Already in a transaction" is sqlx's own count ([`Connection::is_in_transaction`]): a transaction begun
/// with a raw `BEGIN` statement is not seen.
pub struct Autocommit<'c>(Inner<'c>);

enum Inner<'c> {
    Conn(&'c mut PgConnection),
    Pooled(PoolConnection<Postgres>),
    Tx(Transaction<'c, Postgres>),
}

impl Autocommit<'_> {
    /// Finishes: commits the transaction if one was begun; nothing otherwise.
    pub async fn finish(self) -> Result<(), sqlx::Error> {
        match self.0 {
            Inner::Tx(tx) => tx.commit().await,
            Inner::Conn(_) | Inner::Pooled(_) => Ok(()),
        }
    }

    /// Runs `work` on the connection, then [`Autocommit::finish`]es (a failed `work` rolls back).
    async fn run<T>(
        mut self,
        work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        let out = work(&mut self).await?;
        self.finish().await?;
        Ok(out)
    }
}

impl Deref for Autocommit<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match &self.0 {
            Inner::Conn(c) => c,
            Inner::Pooled(c) => c,
            Inner::Tx(t) => t,
        }
    }
}

impl DerefMut for Autocommit<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match &mut self.0 {
            Inner::Conn(c) => c,
            Inner::Pooled(c) => c,
            Inner::Tx(t) => t,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn reads_overrides_and_rejects_bad_values() {
        let env: HashMap<&'static str, &'static str> = [
            ("DB_MAX_CONNECTIONS", "1"),
            ("DB_PERSISTENT_STATEMENTS", "false"),
        ]
        .into();
        let c = DbConfig::from_vars(&Vars::new(&env), "relay").unwrap();
        assert_eq!(c.max_connections, 1);
        assert_eq!(c.statements, Statements::Unnamed);
        let env: HashMap<&'static str, &'static str> = [("DB_MAX_CONNECTIONS", "0")].into();
        assert!(DbConfig::from_vars(&Vars::new(&env), "relay").is_err());
        let env: HashMap<&'static str, &'static str> = [("OUTBOX_SCHEMA", "outbox")].into();
        let c = DbConfig::from_vars(&Vars::new(&env), "relay").unwrap();
        assert_eq!(c.schema.name(), "outbox");
        let env: HashMap<&'static str, &'static str> = [("OUTBOX_SCHEMA", "Out box")].into();
        let err = DbConfig::from_vars(&Vars::new(&env), "relay")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("OUTBOX_SCHEMA") && err.contains("lower-case"),
            "{err}"
        );
    }

    #[test]
    fn bad_url_error_hides_the_password() {
        let c = DbConfig::defaults("t");
        let err = c
            .connect_options(&SecretString::from(
                "postgres://u:hunter2@h:notaport/db".to_owned(),
            ))
            .unwrap_err()
            .to_string();
        assert!(!err.contains("hunter2"), "{err}");
    }
}
