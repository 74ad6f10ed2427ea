//! Subscriber names: the default subscriber's, names as given on the command line and as stored, the default
//! subscriber's dedupe namespace, and the URLs a subscriber may have.

use crate::db::Db;

use super::error::SubscriberError;

/// The default subscriber's stored name: the relay's `CONSUMER_URL` and `CONSUMER_NAME`.
pub const DEFAULT: &str = "";

/// How the default subscriber is shown and named on the command line.
pub const DEFAULT_LABEL: &str = "default";

/// The name as shown to people: `default` for the default subscriber.
pub fn label(name: &str) -> &str {
    if name.is_empty() { DEFAULT_LABEL } else { name }
}

/// Checks and normalises a subscriber name as given on the command line: `default` is [`DEFAULT`].
pub fn parse_name(raw: &str) -> Result<String, SubscriberError> {
    if raw == DEFAULT_LABEL {
        return Ok(DEFAULT.to_owned());
    }
    if crate::ids::is_subscriber_name(raw) {
        Ok(raw.to_owned())
    } else {
        Err(SubscriberError::InvalidName(raw.to_owned()))
    }
}

/// Records the default subscriber's dedupe namespace, the relay's `CONSUMER_NAME` (the relay does at its first
/// invocation): refused while a live named subscriber has that name.
pub async fn record_default_consumer(db: &Db, consumer_name: &str) -> Result<(), SubscriberError> {
    let mut tx = db.pool().begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('outbox_subscribers:default-consumer'))")
        .execute(&mut *tx)
        .await?;
    let topics: Vec<String> = sqlx::query_scalar(crate::schema::q(
        "SELECT topic FROM {schema}.outbox_subscribers WHERE name = $1 AND removed_at IS NULL ORDER BY topic",
    ))
    .bind(consumer_name)
    .fetch_all(&mut *tx)
    .await?;
    if !topics.is_empty() {
        return Err(SubscriberError::NamespaceTaken {
            name: consumer_name.to_owned(),
            topics,
        });
    }
    sqlx::query(crate::schema::q(
        "INSERT INTO {schema}.outbox_default_consumer (consumer_name) VALUES ($1) \
         ON CONFLICT (only_row) DO UPDATE SET consumer_name = excluded.consumer_name, recorded_at = now() \
         WHERE {schema}.outbox_default_consumer.consumer_name IS DISTINCT FROM excluded.consumer_name",
    ))
    .bind(consumer_name)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Refuses a named subscriber called like the default subscriber's `CONSUMER_NAME` (as the relay recorded it).
pub(super) async fn check_namespace(
    conn: &mut sqlx::PgConnection,
    name: &str,
) -> Result<(), SubscriberError> {
    if name == DEFAULT {
        return Ok(());
    }
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('outbox_subscribers:default-consumer'))")
        .execute(&mut *conn)
        .await?;
    let taken: bool = sqlx::query_scalar(crate::schema::q(
        "SELECT EXISTS (SELECT 1 FROM {schema}.outbox_default_consumer WHERE consumer_name = $1)",
    ))
    .bind(name)
    .fetch_one(&mut *conn)
    .await?;
    if taken {
        return Err(SubscriberError::DefaultNamespace {
            name: name.to_owned(),
        });
    }
    Ok(())
}

/// Checks a stored name: `''` (the default subscriber) or a name [`parse_name`] accepts other than `default`.
pub(super) fn check_stored_name(name: &str) -> Result<(), SubscriberError> {
    if name == DEFAULT || (name != DEFAULT_LABEL && parse_name(name).is_ok()) {
        Ok(())
    } else {
        Err(SubscriberError::InvalidName(name.to_owned()))
    }
}

pub(super) fn check_url(name: &str, raw: &str) -> Result<String, SubscriberError> {
    let bad = |why: String| SubscriberError::InvalidUrl {
        name: name.to_owned(),
        url: raw.to_owned(),
        why,
    };
    let url = url::Url::parse(raw).map_err(|e| bad(e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad(format!(
            "scheme {:?} is not http or https",
            url.scheme()
        )));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(bad("a base URL has no query or fragment".into()));
    }
    // QStash calls a public URL; plain http would send the events (and the signatures) in clear. Only a consumer on
    // this machine (a local pipeline) may be called over http.
    if url.scheme() == "http" && !is_loopback(&url) {
        return Err(bad(
            "http is accepted only for a consumer on this machine (localhost, 127.0.0.1, ::1); QStash calls a public \
             URL, use https"
                .into(),
        ));
    }
    Ok(raw.trim_end_matches('/').to_owned())
}

fn is_loopback(url: &url::Url) -> bool {
    match url.host() {
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        Some(url::Host::Domain(d)) => d == "localhost" || d.ends_with(".localhost"),
        None => false,
    }
}
