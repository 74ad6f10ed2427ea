//! Where configuration values come from ([`EnvSource`]: the process environment, a map in tests), how they are
//! read and checked ([`Vars`]), and what a bad one is reported as ([`ConfigError`]).

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Where configuration values come from: the process environment in Lambda, a map in tests.
pub trait EnvSource: Send + Sync {
    /// The value of `key`, if set. Empty strings count as unset.
    fn var(&self, key: &str) -> Option<String>;
}

/// The real process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn var(&self, key: &str) -> Option<String> {
        std::env::var(key).ok().filter(|v| !v.trim().is_empty())
    }
}

impl EnvSource for HashMap<String, String> {
    fn var(&self, key: &str) -> Option<String> {
        self.get(key).filter(|v| !v.trim().is_empty()).cloned()
    }
}

impl EnvSource for HashMap<&'static str, &'static str> {
    fn var(&self, key: &str) -> Option<String> {
        self.get(key)
            .filter(|v| !v.trim().is_empty())
            .map(|v| (*v).to_owned())
    }
}

/// A configuration problem found at startup. Messages name the variable or secret field; secret values are
/// never included.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A required environment variable is not set.
    #[error("environment variable {name} is required ({hint})")]
    MissingVar {
        /// The variable.
        name: &'static str,
        /// What it is for.
        hint: &'static str,
    },
    /// A variable is set but its value does not parse.
    #[error("environment variable {name}={value:?} is invalid: {reason}")]
    InvalidVar {
        /// The variable.
        name: &'static str,
        /// The value as given (never used for secret variables).
        value: String,
        /// Why it was rejected.
        reason: String,
    },
    /// The Secrets Manager call failed.
    #[error("could not read secret {secret_id:?} from AWS Secrets Manager: {reason}")]
    SecretFetch {
        /// The secret id or ARN.
        secret_id: String,
        /// The SDK error with its cause chain.
        reason: String,
    },
    /// The secret exists but is not usable JSON.
    #[error("secret {origin} is malformed: {reason}")]
    MalformedSecret {
        /// Secret id, or "environment".
        origin: String,
        /// What is wrong (never the content).
        reason: String,
    },
    /// A field the function needs is missing from the secret (or from the environment fallback).
    #[error("secret {origin} has no field {field} (a non-empty string is required)")]
    MissingSecretField {
        /// Secret id, or "environment".
        origin: String,
        /// The JSON field / environment variable name.
        field: &'static str,
    },
    /// The relay's invocation budget cannot hold one lease plus the deadline margin: it would never claim.
    #[error(
        "{what} of {budget_secs} s cannot fit one RELAY_LEASE_SECS lease of {lease_secs} s plus the \
         RELAY_DEADLINE_MARGIN_MS margin of {margin_ms} ms: the relay would never claim an event. Raise {what} or \
         lower RELAY_LEASE_SECS"
    )]
    InvocationTooShort {
        /// Where the budget came from (`--invocation-secs`, the Lambda timeout).
        what: &'static str,
        /// The budget.
        budget_secs: f64,
        /// `RELAY_LEASE_SECS`.
        lease_secs: f64,
        /// `RELAY_DEADLINE_MARGIN_MS`.
        margin_ms: u64,
    },
    /// The reconciler's settings let it act on an event after the consumer's dedupe rows may be gone
    /// ([`crate::config::AccountingConfig::check_dedupe_lifetime`]).
    #[error("the reconciler's settings could outlive the consumer's dedupe rows: {reason}")]
    ReconcilerOutlivesDedupe {
        /// Which settings, their values, and what to change.
        reason: String,
    },
    /// A secret field holds one of the QStash dev server's public values (`crate::secrets::refuse_dev_values`).
    #[error(
        "{field} in secret {origin} is the QStash dev server's public value ({risk}): set the one from the \
         Upstash console, or set OUTBOX_ALLOW_DEV_KEYS=true for a local run against the dev server (never in a \
         deployment)"
    )]
    DevCredential {
        /// Secret id, or "environment".
        origin: String,
        /// The JSON field / environment variable name.
        field: &'static str,
        /// What anyone could do with it.
        risk: &'static str,
    },
    /// The database URL does not parse (the URL itself is not echoed: it holds a password).
    #[error("DATABASE_URL is not a valid Postgres URL: {reason}")]
    InvalidDatabaseUrl {
        /// Parser message with the URL removed.
        reason: String,
    },
}

/// Reads typed values from an [`EnvSource`].
pub struct Vars<'a> {
    env: &'a dyn EnvSource,
}

impl<'a> Vars<'a> {
    /// Wraps an environment source.
    pub fn new(env: &'a dyn EnvSource) -> Self {
        Self { env }
    }

    /// The raw value, if set.
    pub fn raw(&self, name: &str) -> Option<String> {
        self.env.var(name)
    }

    /// A required string.
    pub fn required(&self, name: &'static str, hint: &'static str) -> Result<String, ConfigError> {
        self.env
            .var(name)
            .map(|v| v.trim().to_owned())
            .ok_or(ConfigError::MissingVar { name, hint })
    }

    /// An optional value parsed with `FromStr`, or `default`.
    pub fn parse_or<T>(&self, name: &'static str, default: T) -> Result<T, ConfigError>
    where
        T: FromStr,
        T::Err: fmt::Display,
    {
        match self.env.var(name) {
            None => Ok(default),
            Some(v) => v
                .trim()
                .parse()
                .map_err(|e: T::Err| ConfigError::InvalidVar {
                    name,
                    value: v.clone(),
                    reason: e.to_string(),
                }),
        }
    }

    /// A boolean (`true/false/1/0/yes/no/on/off`), or `default`.
    pub fn bool_or(&self, name: &'static str, default: bool) -> Result<bool, ConfigError> {
        match self.env.var(name) {
            None => Ok(default),
            Some(v) => match v.trim().to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" | "on" => Ok(true),
                "false" | "0" | "no" | "off" => Ok(false),
                _ => Err(ConfigError::InvalidVar {
                    name,
                    value: v,
                    reason: "expected true or false".into(),
                }),
            },
        }
    }

    /// A duration given in the unit named by the variable (`…_MS` or `…_SECS`), or `default`.
    pub fn duration_or(
        &self,
        name: &'static str,
        default: Duration,
    ) -> Result<Duration, ConfigError> {
        let millis = name.ends_with("_MS");
        match self.env.var(name) {
            None => Ok(default),
            Some(v) => {
                let n: f64 = v.trim().parse().map_err(|_| ConfigError::InvalidVar {
                    name,
                    value: v.clone(),
                    reason: "expected a number".into(),
                })?;
                if !n.is_finite() || n < 0.0 {
                    return Err(ConfigError::InvalidVar {
                        name,
                        value: v,
                        reason: "expected a non-negative number".into(),
                    });
                }
                // `try_`: a number too large for a Duration is an error, not a panic at start.
                Duration::try_from_secs_f64(if millis { n / 1000.0 } else { n }).map_err(|_| {
                    ConfigError::InvalidVar {
                        name,
                        value: v,
                        reason: "too large".into(),
                    }
                })
            }
        }
    }

    /// [`Vars::duration_or`] within `[min, max]` (inclusive). A value outside is an error that names the variable,
    /// the value and the bound it crosses, followed by `why` (what the bound protects).
    pub fn duration_within(
        &self,
        name: &'static str,
        default: Duration,
        min: Duration,
        max: Duration,
        why: &str,
    ) -> Result<Duration, ConfigError> {
        let d = self.duration_or(name, default)?;
        let unit = |d: Duration| {
            if name.ends_with("_MS") {
                format!("{} ms", d.as_millis())
            } else {
                format!("{} seconds", d.as_secs_f64())
            }
        };
        let bound = if d < min {
            format!("must be at least {}", unit(min))
        } else if d > max {
            format!("must be at most {}", unit(max))
        } else {
            return Ok(d);
        };
        Err(ConfigError::InvalidVar {
            name,
            value: self.raw(name).unwrap_or_default().trim().to_owned(),
            reason: if why.is_empty() {
                bound
            } else {
                format!("{bound} ({why})")
            },
        })
    }

    /// An `http(s)` URL (trailing `/` removed), if set.
    pub fn url(&self, name: &'static str) -> Result<Option<String>, ConfigError> {
        match self.env.var(name) {
            None => Ok(None),
            Some(v) => {
                let v = v.trim();
                match url::Url::parse(v) {
                    Ok(u) if u.scheme() == "http" || u.scheme() == "https" => {
                        Ok(Some(v.trim_end_matches('/').to_owned()))
                    }
                    Ok(_) => Err(ConfigError::InvalidVar {
                        name,
                        value: v.to_owned(),
                        reason: "expected an http:// or https:// URL".into(),
                    }),
                    Err(e) => Err(ConfigError::InvalidVar {
                        name,
                        value: v.to_owned(),
                        reason: e.to_string(),
                    }),
                }
            }
        }
    }

    /// A comma-separated list (empty items dropped).
    pub fn list(&self, name: &'static str) -> Vec<String> {
        self.env
            .var(name)
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// A number within `[min, max]`, or `default`.
    pub fn ranged_or<T>(
        &self,
        name: &'static str,
        default: T,
        min: T,
        max: T,
    ) -> Result<T, ConfigError>
    where
        T: FromStr + PartialOrd + fmt::Display + Copy,
        T::Err: fmt::Display,
    {
        let v = self.parse_or(name, default)?;
        if v < min || v > max {
            return Err(ConfigError::InvalidVar {
                name,
                value: v.to_string(),
                reason: format!("must be between {min} and {max}"),
            });
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&'static str, &'static str)]) -> HashMap<&'static str, &'static str> {
        pairs.iter().copied().collect()
    }

    #[test]
    fn durations_follow_the_unit_in_the_name() {
        let e = env(&[("A_MS", "1500"), ("B_SECS", "2.5")]);
        let v = Vars::new(&e);
        assert_eq!(
            v.duration_or("A_MS", Duration::ZERO).unwrap(),
            Duration::from_millis(1500)
        );
        assert_eq!(
            v.duration_or("B_SECS", Duration::ZERO).unwrap(),
            Duration::from_millis(2500)
        );
        assert_eq!(
            v.duration_or("C_SECS", Duration::from_secs(7)).unwrap(),
            Duration::from_secs(7)
        );
    }

    #[test]
    fn invalid_values_name_the_variable() {
        let e = env(&[("N", "lots"), ("B", "maybe"), ("U", "ftp://x"), ("R", "0")]);
        let v = Vars::new(&e);
        let err = v.parse_or::<u32>("N", 1).unwrap_err().to_string();
        assert!(err.contains("N=\"lots\""), "{err}");
        assert!(
            v.bool_or("B", false)
                .unwrap_err()
                .to_string()
                .contains("true or false")
        );
        assert!(v.url("U").unwrap_err().to_string().contains("http"));
        assert!(
            v.ranged_or::<u32>("R", 5, 1, 10)
                .unwrap_err()
                .to_string()
                .contains("between 1 and 10")
        );
        let missing = v.required("NOPE", "the thing").unwrap_err().to_string();
        assert_eq!(missing, "environment variable NOPE is required (the thing)");
    }

    #[test]
    fn bounded_durations_name_the_variable_the_value_and_the_bound() {
        let e = env(&[
            ("LOW_SECS", "29.5"),
            ("HIGH_MS", "1001"),
            ("HUGE_SECS", "1e30"),
        ]);
        let v = Vars::new(&e);
        let (one, two) = (Duration::from_secs(1), Duration::from_secs(2));
        let err = v
            .duration_within("LOW_SECS", two, Duration::from_secs(30), two * 60, "why")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "environment variable LOW_SECS=\"29.5\" is invalid: must be at least 30 seconds (why)"
        );
        let err = v
            .duration_within("HIGH_MS", one, Duration::ZERO, one, "")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "environment variable HIGH_MS=\"1001\" is invalid: must be at most 1000 ms"
        );
        // Unset: the default.
        assert_eq!(
            v.duration_within("UNSET_SECS", two, one, two, "").unwrap(),
            two
        );
        // Too large for a Duration: an error, not a panic.
        let err = v.duration_or("HUGE_SECS", one).unwrap_err().to_string();
        assert!(
            err.contains("HUGE_SECS") && err.contains("too large"),
            "{err}"
        );
    }

    #[test]
    fn empty_values_count_as_unset() {
        let e = env(&[("E", "  ")]);
        let v = Vars::new(&e);
        assert_eq!(v.parse_or::<u32>("E", 3).unwrap(), 3);
        assert!(v.list("E").is_empty());
    }
}
