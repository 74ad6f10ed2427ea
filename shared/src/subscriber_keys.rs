//! Per-subscriber trust (decision record 0028): a subscriber's consumer accepts only deliveries meant for it and
//! signed by this relay, and what a callback says about a subscriber's copy is believed only with that
//! subscriber's signature.
//!
//! QStash's signing keys are per account: every consumer that verifies `Upstash-Signature` holds them, and with
//! them it can sign a request that any other consumer, and the failure callback, accepts. With fan-out, consumers
//! belong to different services (teams), so each subscriber gets a key of its own:
//!
//! | who | holds | does |
//! |---|---|---|
//! | the relay | every subscriber's keys (`SUBSCRIBER_SIGNING_KEYS`) | signs each message with its subscriber's first key: the destination gets `&sig=` [`sign`] of the body |
//! | a subscriber's consumer | its own key (`SUBSCRIBER_CURRENT_SIGNING_KEY`, and `SUBSCRIBER_NEXT_SIGNING_KEY` while the relay switches) | refuses a delivery without `sig` (489: it can never gain one) or with one that none of its keys made (401, like a bad QStash signature) |
//! | the failure callback (and the reconciler, for QStash's DLQ) | every subscriber's keys | believes a callback about a copy only when the original URL's `sig` is the copy's subscriber's, over the original body, and the copies it names are that subscriber's |
//!
//! A consumer holding its own key can sign only what its own consumer would accept; it cannot make another
//! subscriber's consumer apply (or dedupe away) an event, nor have another subscriber's copy recorded as failed or
//! delivered. The signature travels in the destination URL, which QStash signs as the token's `sub` and repeats in
//! every callback (`url`): nothing depends on QStash forwarding a header. A subscriber without a key (none
//! configured anywhere) works as before: a single-subscriber deployment needs nothing new.
//!
//! `SUBSCRIBER_SIGNING_KEYS` is `name:key[ key…],name:key…` (`default` for the default subscriber); the first key of
//! a name signs, every key of it is accepted (rotation: give the consumer the new key as its next key, then the
//! relay the new key first, then the consumer the new key as its current one). A key is at least
//! [`MIN_KEY_CHARS`] characters without spaces or commas (e.g. `openssl rand -base64 32`).

use std::collections::HashMap;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use secrecy::{ExposeSecret, SecretString};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// The destination query parameter that carries the subscriber signature (covered by the token's `sub`).
pub(crate) const SIGNATURE_PARAM: &str = "sig";
/// The fewest characters a subscriber key may have.
pub(crate) const MIN_KEY_CHARS: usize = 32;
/// Bound into every signature, so a subscriber key signs nothing else by accident.
const CONTEXT: &[u8] = b"outbox-subscriber-signature-v1\n";
/// How the default subscriber is named in `SUBSCRIBER_SIGNING_KEYS`.
const DEFAULT_NAME: &str = "default";

/// A malformed `SUBSCRIBER_SIGNING_KEYS`, `SUBSCRIBER_CURRENT_SIGNING_KEY` or `SUBSCRIBER_NEXT_SIGNING_KEY` (the message never
/// contains a key).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyConfigError {
    /// An entry is not `name:key…`.
    #[error(
        "entry {position} is not `name:key` (subscriber name, a colon, one or more keys separated by spaces)"
    )]
    Entry {
        /// 1-based.
        position: usize,
    },
    /// A name that cannot be a subscriber's.
    #[error("entry {position} names {name:?}, which is not a subscriber name (or `default`)")]
    Name {
        /// 1-based.
        position: usize,
        /// As given (names are not secret).
        name: String,
    },
    /// A name given twice.
    #[error("subscriber {0:?} is given twice")]
    Twice(String),
    /// A key too short.
    #[error(
        "a key of {which} has {chars} characters; a subscriber key has at least {MIN_KEY_CHARS}"
    )]
    Short {
        /// Whose key.
        which: String,
        /// Its length.
        chars: usize,
    },
}

/// Why a subscriber signature was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SignatureProblem {
    /// The URL carries none although a key is configured for the subscriber.
    #[error("the delivery carries no subscriber signature")]
    Missing,
    /// It carries one that none of the subscriber's keys made.
    #[error("the subscriber signature was not made with this subscriber's key")]
    Mismatch,
}

/// The subscriber signature of a message body with `key`: base64url (no padding) of HMAC-SHA256 over a fixed
/// context string and the body.
pub fn sign(key: &SecretString, body: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(tag(key, body))
}

fn tag(key: &SecretString, body: &[u8]) -> [u8; 32] {
    // An HMAC takes a key of any length.
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(key.expose_secret().as_bytes()) else {
        return [0; 32];
    };
    mac.update(CONTEXT);
    mac.update(body);
    mac.finalize().into_bytes().into()
}

/// Whether `sig` is one of `keys`' signatures of `body` (constant time per key).
fn made_by(keys: &[SecretString], body: &[u8], sig: Option<&str>) -> Result<(), SignatureProblem> {
    let sig = sig.ok_or(SignatureProblem::Missing)?;
    let Ok(given) = URL_SAFE_NO_PAD.decode(sig.trim_end_matches('=')) else {
        return Err(SignatureProblem::Mismatch);
    };
    let mut ok = false;
    for k in keys {
        ok |= bool::from(tag(k, body).as_slice().ct_eq(&given));
    }
    if ok {
        Ok(())
    } else {
        Err(SignatureProblem::Mismatch)
    }
}

fn check_key(which: &str, key: &str) -> Result<(), KeyConfigError> {
    let chars = key.chars().count();
    if chars < MIN_KEY_CHARS {
        return Err(KeyConfigError::Short {
            which: which.to_owned(),
            chars,
        });
    }
    Ok(())
}

/// Every subscriber's keys, by subscriber name (`''` for the default subscriber): what the relay signs with and the
/// failure callback checks with. `Debug` shows the names only.
#[derive(Clone, Default)]
pub struct SubscriberKeys {
    by_name: HashMap<String, Vec<SecretString>>,
}

impl std::fmt::Debug for SubscriberKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
        names.sort_unstable();
        f.debug_struct("SubscriberKeys")
            .field("subscribers", &names)
            .finish()
    }
}

impl SubscriberKeys {
    /// None: no subscriber signs or checks anything.
    pub fn none() -> Self {
        SubscriberKeys::default()
    }

    /// Parses `SUBSCRIBER_SIGNING_KEYS` (see the module docs).
    pub fn parse(text: &str) -> Result<Self, KeyConfigError> {
        let mut by_name: HashMap<String, Vec<SecretString>> = HashMap::new();
        for (i, entry) in text.split(',').map(str::trim).enumerate() {
            if entry.is_empty() {
                continue;
            }
            let position = i + 1;
            let (name, keys) = entry
                .split_once(':')
                .ok_or(KeyConfigError::Entry { position })?;
            let name = name.trim();
            let stored = match name {
                DEFAULT_NAME => String::new(),
                n if crate::ids::is_subscriber_name(n) => n.to_owned(),
                n => {
                    return Err(KeyConfigError::Name {
                        position,
                        name: n.chars().take(64).collect(),
                    });
                }
            };
            let keys: Vec<&str> = keys.split_whitespace().collect();
            if keys.is_empty() {
                return Err(KeyConfigError::Entry { position });
            }
            for k in &keys {
                check_key(name, k)?;
            }
            if by_name.contains_key(&stored) {
                return Err(KeyConfigError::Twice(name.to_owned()));
            }
            by_name.insert(
                stored,
                keys.iter()
                    .map(|k| SecretString::from((*k).to_owned()))
                    .collect(),
            );
        }
        Ok(SubscriberKeys { by_name })
    }

    /// With `keys` for subscriber `name` (`''`: the default one); tests and the local pipeline.
    pub fn with(mut self, name: &str, keys: &[&str]) -> Self {
        self.by_name.insert(
            name.to_owned(),
            keys.iter()
                .map(|k| SecretString::from((*k).to_owned()))
                .collect(),
        );
        self
    }

    /// Whether no subscriber has a key.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// Whether subscriber `name` has a key.
    pub fn has(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// The signature of `body` for subscriber `name` with its first key; `None` when it has no key.
    pub fn sign(&self, name: &str, body: &[u8]) -> Option<String> {
        let key = self.by_name.get(name)?.first()?;
        Some(sign(key, body))
    }

    /// Whether `sig` is subscriber `name`'s signature of `body`; `Ok` also when `name` has no key (nothing to check).
    pub fn check(
        &self,
        name: &str,
        body: &[u8],
        sig: Option<&str>,
    ) -> Result<(), SignatureProblem> {
        match self.by_name.get(name) {
            None => Ok(()),
            Some(keys) => made_by(keys, body, sig),
        }
    }
}

/// A consumer's own subscriber keys (current, and next during a switch): it accepts only deliveries signed with one
/// of them. `Debug` is redacted.
#[derive(Clone)]
pub struct OwnKey {
    keys: Vec<SecretString>,
}

impl std::fmt::Debug for OwnKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnKey")
            .field("keys", &self.keys.len())
            .finish()
    }
}

impl OwnKey {
    /// The current key and, optionally, the next one.
    pub fn new(current: SecretString, next: Option<SecretString>) -> Result<Self, KeyConfigError> {
        check_key("SUBSCRIBER_CURRENT_SIGNING_KEY", current.expose_secret())?;
        if let Some(n) = &next {
            check_key("SUBSCRIBER_NEXT_SIGNING_KEY", n.expose_secret())?;
        }
        Ok(OwnKey {
            keys: std::iter::once(current).chain(next).collect(),
        })
    }

    /// Whether `sig` (the destination's `sig` parameter) was made with one of these keys over `body`.
    pub fn check(&self, body: &[u8], sig: Option<&str>) -> Result<(), SignatureProblem> {
        made_by(&self.keys, body, sig)
    }
}

/// How a stored subscriber name is shown: `default` for the default subscriber (`''`).
pub(crate) fn display_name(name: &str) -> &str {
    if name.is_empty() { DEFAULT_NAME } else { name }
}

/// The `sig` parameter of a destination's raw query, if any. `Err` when it is given twice.
pub(crate) fn signature_of_query(query: Option<&str>) -> Result<Option<&str>, String> {
    let mut found = None;
    for pair in query.unwrap_or("").split('&') {
        if let Some(v) = pair
            .strip_prefix(SIGNATURE_PARAM)
            .and_then(|r| r.strip_prefix('='))
        {
            if found.is_some() {
                return Err("the URL carries the subscriber signature twice".into());
            }
            found = Some(v);
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    const K1: &str = "billing-key-0123456789abcdefghijklmnop";
    const K2: &str = "shipping-key-0123456789abcdefghijklmno";
    const K3: &str = "billing-next-0123456789abcdefghijklmno";

    #[test]
    fn a_subscribers_signature_is_accepted_by_its_keys_only() {
        let keys = SubscriberKeys::parse(&format!("billing:{K1} {K3}, shipping:{K2}")).unwrap();
        let body = br#"{"contract":2}"#;
        let sig = keys.sign("billing", body).unwrap();
        assert_eq!(keys.check("billing", body, Some(&sig)), Ok(()));
        assert_eq!(
            keys.check("shipping", body, Some(&sig)),
            Err(SignatureProblem::Mismatch)
        );
        assert_eq!(
            keys.check("billing", b"{}", Some(&sig)),
            Err(SignatureProblem::Mismatch)
        );
        assert_eq!(
            keys.check("billing", body, None),
            Err(SignatureProblem::Missing)
        );
        assert_eq!(
            keys.check("search", body, None),
            Ok(()),
            "no key: nothing to check"
        );
        // The consumer's own keys: current and next.
        let own = OwnKey::new(K3.to_owned().into(), Some(K1.to_owned().into())).unwrap();
        assert_eq!(own.check(body, Some(&sig)), Ok(()));
        let shipping = OwnKey::new(K2.to_owned().into(), None).unwrap();
        assert_eq!(
            shipping.check(body, Some(&sig)),
            Err(SignatureProblem::Mismatch)
        );
        assert_eq!(
            shipping.check(body, Some("%%")),
            Err(SignatureProblem::Mismatch)
        );
    }

    #[test]
    fn bad_key_lists_are_refused_without_showing_a_key() {
        assert!(SubscriberKeys::parse("").unwrap().is_empty());
        assert!(
            SubscriberKeys::parse(&format!("default:{K1}"))
                .unwrap()
                .has("")
        );
        for (text, want) in [
            (format!("billing {K1}"), "entry 1 is not `name:key`"),
            (format!("Billing:{K1}"), "not a subscriber name"),
            ("billing:short".to_owned(), "has 5 characters"),
            (format!("billing:{K1},billing:{K2}"), "given twice"),
            ("billing:".to_owned(), "entry 1"),
        ] {
            let e = SubscriberKeys::parse(&text).unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
            assert!(!e.contains(K1) && !e.contains("short"), "{e}");
        }
        assert!(OwnKey::new("short".to_owned().into(), None).is_err());
        assert!(
            !format!(
                "{:?}",
                SubscriberKeys::parse(&format!("billing:{K1}")).unwrap()
            )
            .contains(K1)
        );
    }

    #[test]
    fn the_signature_is_read_from_the_query() {
        assert_eq!(
            signature_of_query(Some("contract=2&sig=abc")),
            Ok(Some("abc"))
        );
        assert_eq!(signature_of_query(Some("contract=2")), Ok(None));
        assert_eq!(signature_of_query(None), Ok(None));
        assert_eq!(signature_of_query(Some("signal=1")), Ok(None));
        assert!(signature_of_query(Some("sig=a&sig=b")).is_err());
    }
}
