//! The [`KeyRing`] a running function holds (its [`SigningKeys`], current and next, are in `signing_keys.rs`),
//! which re-reads the secret when a token matches neither key, so a key rotation needs no redeploy.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use super::signing_keys::SigningKeys;
use super::verify::{Claims, VerifyError, VerifyOptions, verify};
use crate::secrets::{SecretField, SecretSource};

/// The signing keys of a running function, re-read from the secret when a token matches neither key (QStash
/// rotated them), at most once per refresh interval, so a key rotation needs no redeploy.
pub struct KeyRing {
    keys: RwLock<Arc<SigningKeys>>,
    source: Option<SecretSource>,
    refresh_interval: Duration,
    last_refresh: tokio::sync::Mutex<Option<Instant>>,
    /// `OUTBOX_ALLOW_DEV_KEYS=true`: keys re-read from the secret may be the dev server's public ones (startup
    /// refuses them otherwise, [`crate::secrets::refuse_dev_values`], and so does a re-read).
    allow_dev_keys: bool,
}

impl std::fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyRing")
            .field("source", &self.source)
            .field("refresh_interval", &self.refresh_interval)
            .finish_non_exhaustive()
    }
}

/// The secret fields a receiver needs.
pub const RECEIVER_SECRETS: [SecretField; 3] = [
    SecretField::DatabaseUrl,
    SecretField::CurrentSigningKey,
    SecretField::NextSigningKey,
];

impl KeyRing {
    /// Fixed keys, never re-read.
    pub fn fixed(keys: SigningKeys) -> Self {
        KeyRing {
            keys: RwLock::new(Arc::new(keys)),
            source: None,
            refresh_interval: Duration::MAX,
            last_refresh: tokio::sync::Mutex::new(None),
            allow_dev_keys: false,
        }
    }

    /// Keys already read from `source` (at startup): that read counts as the last refresh, so the next one
    /// happens at the earliest `refresh_interval` later.
    pub fn loaded(keys: SigningKeys, source: SecretSource, refresh_interval: Duration) -> Self {
        KeyRing {
            keys: RwLock::new(Arc::new(keys)),
            source: Some(source),
            refresh_interval,
            last_refresh: tokio::sync::Mutex::new(Some(Instant::now())),
            allow_dev_keys: false,
        }
    }

    /// Keys from somewhere else, refreshable from `source` (the first refresh may happen at once).
    pub fn refreshable(
        keys: SigningKeys,
        source: SecretSource,
        refresh_interval: Duration,
    ) -> Self {
        KeyRing {
            keys: RwLock::new(Arc::new(keys)),
            source: Some(source),
            refresh_interval,
            last_refresh: tokio::sync::Mutex::new(None),
            allow_dev_keys: false,
        }
    }

    /// Accepts the dev server's public keys when the secret is re-read (`OUTBOX_ALLOW_DEV_KEYS=true`, as at
    /// startup); refused by default.
    pub fn allowing_dev_keys(mut self, allow: bool) -> Self {
        self.allow_dev_keys = allow;
        self
    }

    /// The keys in use.
    pub fn keys(&self) -> Arc<SigningKeys> {
        match self.keys.read() {
            Ok(k) => Arc::clone(&k),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// [`verify`] with these keys; when neither key matches, re-reads the secret (rate-limited) and retries once.
    pub async fn verify(
        &self,
        token: &str,
        body: &[u8],
        url: &str,
        opts: VerifyOptions,
    ) -> Result<Claims, VerifyError> {
        let keys = self.keys();
        match verify(token, body, url, &keys, opts) {
            Err(VerifyError::Signature) if self.source.is_some() => {
                match self.refresh_after_failure(&keys).await {
                    Some(fresh) => verify(token, body, url, &fresh, opts),
                    None => Err(VerifyError::Signature),
                }
            }
            other => other,
        }
    }

    /// Re-reads the keys unless that happened less than the refresh interval ago. Returns keys worth trying:
    /// new ones (from this call or a concurrent one), or `None`.
    async fn refresh_after_failure(&self, tried: &Arc<SigningKeys>) -> Option<Arc<SigningKeys>> {
        let source = self.source.as_ref()?;
        let mut last = self.last_refresh.lock().await;
        let current = self.keys();
        if !Arc::ptr_eq(&current, tried) {
            return Some(current); // another request refreshed while we waited
        }
        if last.is_some_and(|t| t.elapsed() < self.refresh_interval) {
            return None;
        }
        *last = Some(Instant::now());
        let fresh = match source.load(&[SecretField::CurrentSigningKey]).await {
            Ok(secrets) => match SigningKeys::from_secrets(&secrets) {
                Ok(k) => k,
                Err(e) => {
                    tracing::warn!(error = %e, "signing keys could not be re-read");
                    return None;
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "signing keys could not be re-read");
                return None;
            }
        };
        if fresh.holds_dev_key() && !self.allow_dev_keys {
            tracing::error!(
                "signing keys re-read after a signature mismatch: the secret now holds a QStash dev server key, which \
                 is public (anyone could sign deliveries with it): refused, the keys in use are kept \
                 (OUTBOX_ALLOW_DEV_KEYS=true allows them, never in a deployment)"
            );
            return None;
        }
        if fresh.same_as(&current) {
            tracing::info!("signing keys re-read after a signature mismatch: unchanged");
            return None;
        }
        tracing::info!("signing keys re-read after a signature mismatch: new keys in use");
        let fresh = Arc::new(fresh);
        match self.keys.write() {
            Ok(mut k) => *k = Arc::clone(&fresh),
            Err(poisoned) => *poisoned.into_inner() = Arc::clone(&fresh),
        }
        Some(fresh)
    }
}

#[cfg(test)]
mod tests {
    use secrecy::ExposeSecret;

    use super::RECEIVER_SECRETS;
    use crate::secrets::{SecretField, Secrets};

    #[test]
    fn a_receiver_loads_its_keys_and_withholds_the_qstash_token() {
        let full = r#"{"DATABASE_URL":"postgres://u:p@h/db","QSTASH_TOKEN":"tok-hunter2","QSTASH_CURRENT_SIGNING_KEY":"sig_a","QSTASH_NEXT_SIGNING_KEY":"sig_b"}"#;
        let s = Secrets::parse_json("receiver", full, &RECEIVER_SECRETS).unwrap();
        assert!(s.get(SecretField::QstashToken).is_err());
        assert_eq!(s.withheld(), &[SecretField::QstashToken]);
        assert_eq!(
            s.get(SecretField::CurrentSigningKey)
                .unwrap()
                .expose_secret(),
            "sig_a"
        );
        assert!(!format!("{s:?}").contains("hunter2"));
    }
}
