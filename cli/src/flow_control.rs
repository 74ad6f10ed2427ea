//! QStash's flow control for one tenant: its flow-control keys (the relay names a tenant's lane
//! `{topic}{@subscriber}.tenant-{key}`, sanitised like every flow-control key), paused or resumed there
//! (`POST /v2/flowControl/{key}/pause|resume`). Pausing a tenant in the outbox holds what is not published yet;
//! this holds what QStash already has.

use anyhow::{Context, bail};
use clap::Args;

/// `--qstash`: also act on QStash's flow-control keys (`QSTASH_URL`, `QSTASH_TOKEN` from the environment).
#[derive(Args, Debug, Clone, Default)]
pub struct QstashArgs {
    /// Also pause (resume) the tenant's flow-control keys at QStash: QSTASH_URL and QSTASH_TOKEN from the
    /// environment (the relay's).
    #[arg(long)]
    pub qstash: bool,
}

impl QstashArgs {
    /// The client `--qstash` asks for (`None` without it); an error when QSTASH_URL or QSTASH_TOKEN is not set.
    pub fn client(&self) -> anyhow::Result<Option<FlowControl>> {
        if !self.qstash {
            return Ok(None);
        }
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let (Some(url), Some(token)) = (var("QSTASH_URL"), var("QSTASH_TOKEN")) else {
            bail!(
                "--qstash needs QSTASH_URL and QSTASH_TOKEN in the environment (the relay's); nothing was changed"
            );
        };
        Ok(Some(FlowControl::new(&url, &token)?))
    }
}

/// Pause or resume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowAction {
    Pause,
    Resume,
}

impl FlowAction {
    /// `pause`, `resume` (QStash's path segment).
    pub fn verb(self) -> &'static str {
        match self {
            FlowAction::Pause => "pause",
            FlowAction::Resume => "resume",
        }
    }

    /// `paused`, `resumed`.
    pub fn past(self) -> &'static str {
        match self {
            FlowAction::Pause => "paused",
            FlowAction::Resume => "resumed",
        }
    }
}

/// A tenant key as it appears inside a flow-control key: what QStash does not allow becomes `_` (as the
/// relay's `flow_control_key` does; such a key is then hashed, see [`belongs_to`]).
fn sanitised(key: &str) -> String {
    key.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Whether the flow-control key `flow` is a tenant lane of `tenant`: `….tenant-{tenant}`, or, where the relay
/// had to sanitise the name (a subscriber's `@`, a `:` in the key), `….tenant-{sanitised}-{16 hex digits}`.
pub fn belongs_to(flow: &str, tenant: &str) -> bool {
    if !tenant.contains(':') && flow.ends_with(&format!(".tenant-{tenant}")) {
        return true;
    }
    let Some((head, hash)) = flow.rsplit_once('-') else {
        return false;
    };
    hash.len() == 16
        && hash.bytes().all(|b| b.is_ascii_hexdigit())
        && head.ends_with(&format!(".tenant-{}", sanitised(tenant)))
}

/// QStash's flow-control API.
pub struct FlowControl {
    base: String,
    token: String,
    http: reqwest::Client,
}

impl FlowControl {
    /// A client of QStash at `base` (`https://qstash.upstash.io`).
    pub fn new(base: &str, token: &str) -> anyhow::Result<FlowControl> {
        outbox::install_crypto_provider();
        Ok(FlowControl {
            base: base.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
            http: reqwest::Client::builder()
                .timeout(std::time::Duration::from_secs(15))
                .build()
                .context("building the QStash client")?,
        })
    }

    /// The flow-control keys of `tenant`'s lanes that QStash knows.
    pub async fn keys_of(&self, tenant: &str) -> anyhow::Result<Vec<String>> {
        // The sanitised key holds only A-Z a-z 0-9 . _ -: nothing to encode.
        let url = format!(
            "{}/v2/flowControl?search=tenant-{}",
            self.base,
            sanitised(tenant)
        );
        let r = self
            .http
            .get(&url)
            .bearer_auth(&self.token)
            .send()
            .await
            .with_context(|| format!("listing QStash's flow-control keys ({url})"))?;
        let status = r.status();
        if !status.is_success() {
            bail!(
                "QStash answered {status} to the list of flow-control keys: {}",
                crate::util::one_line(&r.text().await.unwrap_or_default(), 200)
            );
        }
        let list: Vec<serde_json::Value> = r
            .json()
            .await
            .context("QStash's list of flow-control keys is not a JSON array")?;
        let mut keys: Vec<String> = list
            .iter()
            .filter_map(|f| f.get("flowControlKey")?.as_str())
            .filter(|k| belongs_to(k, tenant))
            .map(str::to_owned)
            .collect();
        keys.sort();
        Ok(keys)
    }

    /// Pauses or resumes each of `keys` (from [`FlowControl::keys_of`]).
    pub async fn apply(&self, keys: &[String], action: FlowAction) -> anyhow::Result<()> {
        for (done, key) in keys.iter().enumerate() {
            let url = format!("{}/v2/flowControl/{key}/{}", self.base, action.verb());
            let r = self
                .http
                .post(&url)
                .bearer_auth(&self.token)
                .send()
                .await
                .with_context(|| {
                    format!(
                        "{} QStash's flow-control key {key} ({done} of {} done)",
                        action.verb(),
                        keys.len()
                    )
                })?;
            let status = r.status();
            if !status.is_success() {
                bail!(
                    "QStash answered {status} to {} flow-control key {key} ({done} of {} done): {}",
                    action.verb(),
                    keys.len(),
                    crate::util::one_line(&r.text().await.unwrap_or_default(), 200)
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenants_lanes_are_told_from_other_keys() {
        assert!(belongs_to("audit.tenant-acme", "acme"));
        assert!(belongs_to(
            "audit_billing.tenant-acme-0123456789abcdef",
            "acme"
        ));
        assert!(belongs_to("audit.tenant-a_b-0123456789abcdef", "a:b"));
        assert!(!belongs_to("audit.tenant-acme2", "acme"));
        assert!(!belongs_to("audit.tenant-xacme", "acme"));
        assert!(!belongs_to("audit.tenant-a_b", "a:b"));
        assert!(!belongs_to("audit", "acme"));
    }
}
