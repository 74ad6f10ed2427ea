//! [`SigningKeys`]: the current and next QStash signing keys, compared in constant time and never printed.

use secrecy::{ExposeSecret, SecretString};
use subtle::ConstantTimeEq;

use crate::config::ConfigError;
use crate::secrets::{SecretField, Secrets};

/// The current and next signing keys. `Debug` is redacted.
#[derive(Clone)]
pub struct SigningKeys {
    pub(super) current: SecretString,
    pub(super) next: Option<SecretString>,
}

impl std::fmt::Debug for SigningKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKeys")
            .field("current", &"[redacted]")
            .field("next", &self.next.as_ref().map(|_| "[redacted]"))
            .finish()
    }
}

impl SigningKeys {
    /// Keys from explicit values.
    pub fn new(current: impl Into<String>, next: Option<String>) -> Self {
        SigningKeys {
            current: SecretString::from(current.into()),
            next: next.filter(|n| !n.is_empty()).map(SecretString::from),
        }
    }

    /// The keys from loaded secrets (`QSTASH_CURRENT_SIGNING_KEY` required, `QSTASH_NEXT_SIGNING_KEY` optional
    /// here; the functions require both at startup).
    pub fn from_secrets(secrets: &Secrets) -> Result<Self, ConfigError> {
        Ok(SigningKeys {
            current: secrets.get(SecretField::CurrentSigningKey)?.clone(),
            next: secrets.get(SecretField::NextSigningKey).ok().cloned(),
        })
    }

    /// Whether either key is one of the QStash dev server's public keys ([`crate::secrets::DEV_CURRENT_SIGNING_KEY`],
    /// [`crate::secrets::DEV_NEXT_SIGNING_KEY`]): with them anyone can sign deliveries the receiver accepts.
    pub fn holds_dev_key(&self) -> bool {
        let public = [
            crate::secrets::DEV_CURRENT_SIGNING_KEY,
            crate::secrets::DEV_NEXT_SIGNING_KEY,
        ];
        std::iter::once(&self.current)
            .chain(&self.next)
            .any(|k| public.contains(&k.expose_secret().trim()))
    }

    pub(super) fn same_as(&self, other: &SigningKeys) -> bool {
        let eq = |a: &SecretString, b: &SecretString| -> bool {
            bool::from(
                a.expose_secret()
                    .as_bytes()
                    .ct_eq(b.expose_secret().as_bytes()),
            )
        };
        eq(&self.current, &other.current)
            && match (&self.next, &other.next) {
                (Some(a), Some(b)) => eq(a, b),
                (None, None) => true,
                _ => false,
            }
    }
}
