//! Fairness between tenants ([`crate::fairness`]): the fair claim's switch and the per-tenant limits at QStash.

use std::time::Duration;

use super::env::{ConfigError, Vars};

/// The relay's fairness settings; [`FairnessConfig::default`] is what no variable means: fair claims, no limits.
#[derive(Debug, Clone)]
pub struct FairnessConfig {
    /// `RELAY_FAIR_CLAIMS` (default true): share each unordered claim among the fairness keys with waiting events;
    /// `false`: oldest first, whoever wrote them (the behaviour before fairness keys).
    pub fair_claims: bool,
    /// `RELAY_TENANT_LIMITS`: per topic, the QStash flow-control limits each fairness key gets.
    pub limits: TenantLimits,
}

impl Default for FairnessConfig {
    fn default() -> Self {
        FairnessConfig {
            fair_claims: true,
            limits: TenantLimits::default(),
        }
    }
}

impl FairnessConfig {
    /// Reads `RELAY_FAIR_CLAIMS` and `RELAY_TENANT_LIMITS`.
    pub fn from_vars(v: &Vars<'_>) -> Result<Self, ConfigError> {
        Ok(FairnessConfig {
            fair_claims: v.bool_or("RELAY_FAIR_CLAIMS", true)?,
            limits: match v.raw("RELAY_TENANT_LIMITS") {
                Some(raw) => TenantLimits::parse(&raw)?,
                None => TenantLimits::default(),
            },
        })
    }
}

/// One topic's limits per fairness key, as QStash flow control applies them to a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TenantLimit {
    /// At most this many deliveries started per `period`.
    pub(crate) rate: Option<u32>,
    /// The rate's period (QStash's default: 1 s; at most a week).
    pub(crate) period: Option<Duration>,
    /// At most this many deliveries in flight.
    pub(crate) parallelism: Option<u32>,
}

/// `RELAY_TENANT_LIMITS`: `topic:limits;topic:limits`, each `limits` written as QStash's
/// `Upstash-Flow-Control-Value` is (`rate=10,period=1m,parallelism=2`; at least one of `rate` and `parallelism`;
/// `period` in `s`, `m`, `h` or `d`, at most `7d`). Each fairness key of such a topic gets a QStash flow-control
/// key of its own with these limits; events without a fairness key keep the topic's usual ones.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantLimits(Vec<(String, TenantLimit)>);

impl TenantLimits {
    /// The limits of a topic's fairness keys, if it has any.
    pub(crate) fn for_topic(&self, topic: &str) -> Option<TenantLimit> {
        self.0.iter().find(|(t, _)| t == topic).map(|(_, l)| *l)
    }

    /// Parses the variable's value.
    pub fn parse(raw: &str) -> Result<Self, ConfigError> {
        let mut out = Vec::new();
        for item in raw.split(';').map(str::trim).filter(|s| !s.is_empty()) {
            let bad = |reason: String| ConfigError::InvalidVar {
                name: "RELAY_TENANT_LIMITS",
                value: raw.to_owned(),
                reason: format!(
                    "{item:?}: {reason} (each item is topic:limits, e.g. orders:rate=50,period=1s,parallelism=5)"
                ),
            };
            let (topic, limits) = item
                .split_once(':')
                .ok_or_else(|| bad("no ':' after the topic".into()))?;
            let topic = topic.trim();
            if !crate::ids::is_topic_name(topic) {
                return Err(bad(
                    "the topic may only contain A-Z a-z 0-9 . _ - and be at most 100 characters"
                        .into(),
                ));
            }
            if out.iter().any(|(t, _)| t == topic) {
                return Err(bad("the topic is named twice".into()));
            }
            out.push((topic.to_owned(), parse_limit(limits).map_err(bad)?));
        }
        Ok(TenantLimits(out))
    }
}

fn parse_limit(s: &str) -> Result<TenantLimit, String> {
    let mut l = TenantLimit {
        rate: None,
        period: None,
        parallelism: None,
    };
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?} is not name=value"))?;
        let number = |v: &str| match v.trim().parse::<u32>() {
            Ok(n) if n >= 1 => Ok(n),
            _ => Err(format!("{k} must be a whole number ≥ 1, not {v:?}")),
        };
        match k.trim() {
            "rate" => l.rate = Some(number(v)?),
            "parallelism" => l.parallelism = Some(number(v)?),
            "period" => l.period = Some(parse_period(v.trim())?),
            other => {
                return Err(format!(
                    "unknown limit {other:?} (rate, period, parallelism)"
                ));
            }
        }
    }
    if l.rate.is_none() && l.parallelism.is_none() {
        return Err("give at least one of rate and parallelism".into());
    }
    if l.period.is_some() && l.rate.is_none() {
        return Err("period without rate".into());
    }
    Ok(l)
}

/// `30s`, `1m`, `2h`, `1d` (or plain seconds), from 1 s to a week, as QStash accepts a period.
fn parse_period(v: &str) -> Result<Duration, String> {
    let (digits, unit) = v.split_at(v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len()));
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("period {v:?} is not a number with s, m, h or d"))?;
    let secs = match unit {
        "" | "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        _ => return Err(format!("period {v:?}: the unit is s, m, h or d")),
    };
    if !(1..=7 * 86_400).contains(&secs) {
        return Err(format!("period {v:?} is outside 1s…7d"));
    }
    Ok(Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_read_as_qstash_writes_them_and_bad_ones_are_refused_with_the_reason() {
        let l =
            TenantLimits::parse("orders:rate=50, period=1m ,parallelism=5; imports:parallelism=1")
                .unwrap();
        assert_eq!(
            l.for_topic("orders"),
            Some(TenantLimit {
                rate: Some(50),
                period: Some(Duration::from_secs(60)),
                parallelism: Some(5)
            })
        );
        assert_eq!(l.for_topic("imports").unwrap().parallelism, Some(1));
        assert_eq!(l.for_topic("audit"), None);
        for (bad, says) in [
            ("orders", "no ':'"),
            ("orders:period=1s", "at least one"),
            ("orders:rate=0", "≥ 1"),
            ("orders:rate=5,period=8d", "outside"),
            ("orders:rate=5,period=1w", "unit"),
            ("orders:burst=5", "unknown limit"),
            ("a/b:rate=1", "topic"),
            ("orders:rate=1;orders:rate=2", "twice"),
        ] {
            let e = TenantLimits::parse(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
            assert!(e.contains("RELAY_TENANT_LIMITS"), "{e}");
        }
    }
}
