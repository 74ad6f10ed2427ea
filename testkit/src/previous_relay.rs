//! What the relay of the previous version (before the signed wire contract, decision record 0025) left behind at
//! an upgrade: outbox rows marked dispatched, and their messages still inside QStash in the old format — the
//! raw payload as the body, the event's identity in forwarded `X-Outbox-*` headers, the outbox id forwarded to
//! the callbacks, the destination `{CONSUMER_URL}/events/{topic}` without a contract version.
//!
//! The upgrade tests publish such messages straight to the dev server, header for header as that relay did
//! (`Relay::message_for` at commit 6a2d738 and the option → header mapping of `outbox::internals::qstash`).

use anyhow::{Context, bail};
use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::Value;
use sqlx::{PgPool, Row};

/// An outbox row as the previous relay read it to publish it.
#[derive(Debug, Clone)]
pub struct OldEvent {
    /// Outbox id.
    pub id: i64,
    pub topic: String,
    /// Partition key.
    pub key: String,
    /// Per-key sequence (ordered topics).
    pub seq: Option<i64>,
    /// The payload as Postgres renders the `jsonb` column (the previous relay's body, byte for byte).
    pub payload: String,
    /// When the producer wrote it.
    pub created_at: DateTime<Utc>,
    pub traceparent: Option<String>,
    /// `x-correlation-id` header.
    pub correlation_id: Option<String>,
    /// `x-schema-version` header.
    pub schema_version: Option<u32>,
}

impl OldEvent {
    /// Reads the row (before it is pruned, for a test that prunes it).
    pub async fn load(pool: &PgPool, id: i64) -> anyhow::Result<OldEvent> {
        let row = sqlx::query(
            "SELECT id, topic, partition_key, seq, payload::text AS payload, created_at, headers \
             FROM outbox WHERE id = $1",
        )
        .bind(id)
        .fetch_one(pool)
        .await
        .with_context(|| format!("outbox row {id}"))?;
        let headers: Value = row.try_get("headers")?;
        let text = |name: &str| headers[name].as_str().map(str::to_owned);
        Ok(OldEvent {
            id: row.try_get("id")?,
            topic: row.try_get("topic")?,
            key: row.try_get("partition_key")?,
            seq: row.try_get("seq")?,
            payload: row.try_get("payload")?,
            created_at: row.try_get("created_at")?,
            traceparent: text("traceparent"),
            correlation_id: text("correlation_id"),
            schema_version: headers["schema_version"].as_u64().map(|v| v as u32),
        })
    }

    /// The request headers of the previous relay's message for this event (`Upstash-*` options and forwarded
    /// headers, as `outbox::internals::qstash` mapped them).
    pub fn publish_headers(
        &self,
        callback_url: &str,
        evidence_by_consumer: bool,
        retries: u32,
    ) -> Vec<(String, String)> {
        let id = self.id.to_string();
        let mut h: Vec<(String, String)> = Vec::new();
        let mut put = |k: &str, v: String| h.push((k.to_owned(), v));
        put("Content-Type", "application/json".into());
        put("Upstash-Deduplication-Id", format!("outbox-{id}"));
        put("Upstash-Retries", retries.to_string());
        put(
            "Upstash-Failure-Callback",
            format!("{callback_url}/failure"),
        );
        put("Upstash-Failure-Callback-Forward-X-Outbox-Id", id.clone());
        let ordered = self.seq.is_some();
        if ordered && !evidence_by_consumer {
            put("Upstash-Callback", format!("{callback_url}/delivered"));
            put("Upstash-Callback-Forward-X-Outbox-Id", id.clone());
        }
        put("Upstash-Forward-X-Outbox-Id", id);
        put("Upstash-Forward-X-Outbox-Topic", self.topic.clone());
        put(
            "Upstash-Forward-X-Outbox-Key",
            outbox::internals::contract::encode_key(&self.key),
        );
        put(
            "Upstash-Forward-X-Outbox-Created-At",
            self.created_at.to_rfc3339_opts(SecondsFormat::Micros, true),
        );
        if let Some(seq) = self.seq {
            put("Upstash-Forward-X-Outbox-Seq", seq.to_string());
        }
        if let Some(tp) = &self.traceparent {
            put("Upstash-Forward-Traceparent", tp.clone());
        }
        if let Some(c) = &self.correlation_id {
            put("Upstash-Forward-X-Correlation-Id", c.clone());
        }
        if let Some(v) = self.schema_version {
            put("Upstash-Forward-X-Schema-Version", v.to_string());
        }
        if ordered && evidence_by_consumer {
            put("Upstash-Forward-X-Outbox-Evidence", "consumer".into());
        }
        put(
            "Upstash-Flow-Control-Key",
            outbox::internals::qstash::flow_control_key(&format!("{}.{}", self.topic, self.key)),
        );
        put("Upstash-Flow-Control-Value", "parallelism=10".into());
        put("Upstash-Label", self.topic.clone());
        h
    }

    /// Publishes the message as the previous relay did: `POST {qstash}/v2/publish/{consumer_url}/events/{topic}`.
    /// Returns QStash's message id.
    #[allow(clippy::too_many_arguments)]
    pub async fn publish(
        &self,
        qstash_url: &str,
        token: &str,
        consumer_url: &str,
        callback_url: &str,
        evidence_by_consumer: bool,
        retries: u32,
    ) -> anyhow::Result<String> {
        let url = format!(
            "{}/v2/publish/{}/events/{}",
            qstash_url.trim_end_matches('/'),
            consumer_url.trim_end_matches('/'),
            self.topic
        );
        let mut req = reqwest::Client::new()
            .post(&url)
            .bearer_auth(token)
            .body(self.payload.clone());
        for (k, v) in self.publish_headers(callback_url, evidence_by_consumer, retries) {
            req = req.header(k, v);
        }
        let resp = req.send().await.with_context(|| format!("POST {url}"))?;
        let status = resp.status();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            bail!("QStash answered {status} to the previous relay's publish: {body}");
        }
        body["messageId"]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("no messageId in {body}"))
    }
}

/// Marks an event dispatched the way the previous relay settled a published event: accepted by QStash (one
/// attempt); for an ordered head, its key waits for the delivery evidence (`inflight_id`, the key not due again
/// before `evidence_timeout_secs`). Done before the new relay starts, so that it never claims the event (its
/// message is the one [`OldEvent::publish`] puts inside QStash).
pub async fn mark_dispatched(
    pool: &PgPool,
    id: i64,
    evidence_timeout_secs: f64,
) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    let seq: Option<i64> = sqlx::query_scalar(
        "UPDATE outbox SET attempts = attempts + 1, dispatched_at = now(), locked_until = NULL, \
         lease_token = NULL WHERE id = $1 RETURNING seq",
    )
    .bind(id)
    .fetch_one(&mut *tx)
    .await?;
    if seq.is_some() {
        let n = sqlx::query(
            "UPDATE outbox_keys k SET inflight_id = o.id, inflight_since = now(), \
             available_at = now() + make_interval(secs => $2), lease_token = NULL, locked_until = NULL \
             FROM outbox o WHERE o.id = $1 AND k.topic = o.topic AND k.partition_key = o.partition_key \
             AND k.done_seq = o.seq - 1",
        )
        .bind(id)
        .bind(evidence_timeout_secs)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if n != 1 {
            bail!("event {id} is not the head of its key");
        }
    }
    tx.commit().await?;
    Ok(())
}
