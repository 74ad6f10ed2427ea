//! The prices `bench cost` applies to its counts, each with its source and the date it was read, and the
//! deployment's defaults it reads from `template.yaml` (memory, timeout, schedule). Prices change: edit this
//! table (and its date), then rerun `outbox-dev bench cost --report docs`. The measured counts never include a
//! price; the report shows both.

/// One price.
#[derive(Clone, Copy, Debug)]
pub struct Price {
    /// Key in the JSON.
    pub key: &'static str,
    /// What is billed.
    pub item: &'static str,
    /// US dollars per `per` units.
    pub usd: f64,
    pub per: f64,
    pub unit: &'static str,
    pub source: &'static str,
    /// When the source was read.
    pub read: &'static str,
    /// What the model does with it.
    pub note: &'static str,
}

impl Price {
    /// Dollars for `units`.
    pub fn of(&self, units: f64) -> f64 {
        units * self.usd / self.per
    }
}

const QSTASH: &str = "https://upstash.com/pricing/qstash (pay as you go)";
const LAMBDA: &str = "https://aws.amazon.com/lambda/pricing/ (Arm, US East (N. Virginia))";
const READ: &str = "2026-12-07";

/// Every price the model applies.
pub const PRICES: [Price; 6] = [
    Price {
        key: "qstash_message",
        item: "QStash message (a publish, a callback, a failure callback)",
        usd: 1.0,
        per: 100_000.0,
        unit: "messages",
        source: QSTASH,
        read: READ,
        note: "callbacks are billed as messages (https://upstash.com/docs/qstash/features/callbacks)",
    },
    Price {
        key: "qstash_retry",
        item: "QStash delivery retry",
        usd: 0.0,
        per: 1.0,
        unit: "retries",
        source: QSTASH,
        read: READ,
        note: "the pricing page: retries are free; the docs' pricing FAQ (https://upstash.com/docs/qstash/overall/pricing) counts each retry as a message; retries are counted apart either way",
    },
    Price {
        key: "qstash_api_request",
        item: "QStash API request (DLQ list, message lookup)",
        usd: 0.0,
        per: 1.0,
        unit: "requests",
        source: QSTASH,
        read: READ,
        note: "only messages are charged",
    },
    Price {
        key: "qstash_bandwidth",
        item: "QStash bandwidth",
        usd: 0.05,
        per: 1e9,
        unit: "bytes",
        source: QSTASH,
        read: READ,
        note: "free up to 50 GB a month, then $0.05/GB; the model charges every byte (no free allowance)",
    },
    Price {
        key: "lambda_request",
        item: "Lambda request (invocation)",
        usd: 0.20,
        per: 1e6,
        unit: "invocations",
        source: LAMBDA,
        read: READ,
        note: "free tier not applied",
    },
    Price {
        key: "lambda_gb_second",
        item: "Lambda duration (arm64, first 7.5 billion GB-s a month)",
        usd: 0.000_013_333_4,
        per: 1.0,
        unit: "GB-seconds",
        source: LAMBDA,
        read: READ,
        note: "configured memory × billed duration (each invocation rounded up to 1 ms); free tier not applied",
    },
];

/// The price under `key`.
pub fn price(key: &str) -> Price {
    PRICES
        .iter()
        .copied()
        .find(|p| p.key == key)
        .unwrap_or_else(|| panic!("no price {key}"))
}

/// The stack's template: its parameters' defaults are what a deployment runs unless told otherwise.
const TEMPLATE: &str = include_str!("../../../../template.yaml");

/// The `Default:` of parameter `name` in `template.yaml`.
pub fn template_default(name: &str) -> Option<String> {
    let at = TEMPLATE.find(&format!("\n  {name}:\n"))?;
    TEMPLATE[at + 1..]
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with("    "))
        .find_map(|l| l.trim().strip_prefix("Default:"))
        .map(|v| v.trim().to_owned())
}

/// The deployment's defaults the model bills with.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Deployment {
    pub relay_memory_mb: f64,
    pub consumer_memory_mb: f64,
    pub callback_memory_mb: f64,
    pub relay_timeout_secs: f64,
    /// `RelaySchedule`, e.g. `rate(1 minute)`.
    pub relay_schedule: String,
    /// Schedule invocations in a 30-day month.
    pub relay_invocations_per_month: f64,
}

/// Invocations in a 30-day month of an EventBridge `rate(N unit)` expression.
fn per_month(schedule: &str) -> Option<f64> {
    let inner = schedule.strip_prefix("rate(")?.strip_suffix(')')?;
    let (n, unit) = inner.split_once(' ')?;
    let n: f64 = n.parse().ok()?;
    let secs = match unit.trim_end_matches('s') {
        "minute" => 60.0,
        "hour" => 3600.0,
        "day" => 86_400.0,
        _ => return None,
    };
    Some(30.0 * 86_400.0 / (n * secs))
}

impl Deployment {
    pub fn from_template() -> anyhow::Result<Deployment> {
        let num = |name: &str| -> anyhow::Result<f64> {
            template_default(name)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| anyhow::anyhow!("template.yaml has no numeric default for {name}"))
        };
        let relay_schedule = template_default("RelaySchedule")
            .ok_or_else(|| anyhow::anyhow!("template.yaml has no default RelaySchedule"))?;
        Ok(Deployment {
            relay_memory_mb: num("RelayMemorySize")?,
            consumer_memory_mb: num("ConsumerMemorySize")?,
            callback_memory_mb: num("CallbackMemorySize")?,
            relay_timeout_secs: num("RelayTimeoutSeconds")?,
            relay_invocations_per_month: per_month(&relay_schedule).ok_or_else(|| {
                anyhow::anyhow!("RelaySchedule {relay_schedule:?} is not a rate() expression")
            })?,
            relay_schedule,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_defaults_are_read() {
        let d = Deployment::from_template().unwrap();
        assert!(d.relay_memory_mb >= 128.0, "{d:?}");
        assert!(d.relay_timeout_secs >= 40.0, "{d:?}");
        assert_eq!(per_month("rate(1 minute)"), Some(43_200.0));
        assert_eq!(per_month("rate(5 minutes)"), Some(8_640.0));
        assert_eq!(price("qstash_message").of(100_000.0), 1.0);
    }
}
