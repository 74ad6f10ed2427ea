//! CloudWatch Embedded Metric Format (EMF): one JSON line on stdout becomes CloudWatch metrics with no API
//! call and no extra IAM permission. The alarms in `template.yaml` read these metrics.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};

/// The CloudWatch namespace of every metric this crate emits.
pub const NAMESPACE: &str = "Outbox";

/// Units used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Count,
    Seconds,
    Milliseconds,
    /// CloudWatch's `Percent` (0 to 100).
    Percent,
    Bytes,
}

impl Unit {
    fn as_str(self) -> &'static str {
        match self {
            Unit::Count => "Count",
            Unit::Seconds => "Seconds",
            Unit::Milliseconds => "Milliseconds",
            Unit::Percent => "Percent",
            Unit::Bytes => "Bytes",
        }
    }
}

/// One EMF record: a set of metrics under one dimension (`Function`).
#[derive(Debug, Clone)]
pub struct EmfRecord {
    function: String,
    metrics: Vec<(String, Unit, f64)>,
    properties: Map<String, Value>,
}

impl EmfRecord {
    /// A record for the named function (the `Function` dimension).
    pub fn new(function: &str) -> Self {
        EmfRecord {
            function: function.to_owned(),
            metrics: Vec::new(),
            properties: Map::new(),
        }
    }

    /// Adds a metric value.
    pub fn metric(mut self, name: &str, unit: Unit, value: f64) -> Self {
        self.metrics.push((name.to_owned(), unit, value));
        self
    }

    /// Adds a property (searchable in CloudWatch Logs, not a metric).
    pub fn property(mut self, name: &str, value: impl Into<Value>) -> Self {
        self.properties.insert(name.to_owned(), value.into());
        self
    }

    /// The JSON line.
    pub fn to_json(&self) -> String {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let mut root = self.properties.clone();
        let defs: Vec<Value> = self
            .metrics
            .iter()
            .map(|(n, u, _)| json!({"Name": n, "Unit": u.as_str()}))
            .collect();
        root.insert(
            "_aws".into(),
            json!({
                "Timestamp": ts,
                "CloudWatchMetrics": [{
                    "Namespace": NAMESPACE,
                    "Dimensions": [["Function"]],
                    "Metrics": defs,
                }]
            }),
        );
        root.insert("Function".into(), Value::String(self.function.clone()));
        for (n, _, v) in &self.metrics {
            root.insert(n.clone(), json!(v));
        }
        Value::Object(root).to_string()
    }

    /// Prints the line to stdout, where the Lambda log agent picks it up.
    pub fn emit(&self) {
        println!("{}", self.to_json());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emf_shape() {
        let line = EmfRecord::new("relay")
            .metric("Dispatched", Unit::Count, 3.0)
            .metric("OldestPendingAge", Unit::Seconds, 1.5)
            .property("requestId", "abc")
            .to_json();
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["Function"], "relay");
        assert_eq!(v["Dispatched"], 3.0);
        assert_eq!(v["requestId"], "abc");
        assert_eq!(v["_aws"]["CloudWatchMetrics"][0]["Namespace"], "Outbox");
        assert_eq!(
            v["_aws"]["CloudWatchMetrics"][0]["Metrics"][1]["Name"],
            "OldestPendingAge"
        );
        assert_eq!(
            v["_aws"]["CloudWatchMetrics"][0]["Dimensions"][0][0],
            "Function"
        );
    }
}
