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

/// One EMF record: a set of metrics under one dimension set: `Function`, then any [`EmfRecord::dimension`]s
/// added, in that order (e.g. `[Function, Topic, Subscriber]`). CloudWatch treats each dimension set as its own
/// metric: a name printed with `[Function, Topic, Subscriber]` is another metric than the same name with
/// `[Function]` alone.
#[derive(Debug, Clone)]
pub struct EmfRecord {
    function: String,
    dimensions: Vec<(String, String)>,
    metrics: Vec<(String, Unit, f64)>,
    properties: Map<String, Value>,
}

impl EmfRecord {
    /// A record for the named function (the `Function` dimension).
    pub fn new(function: &str) -> Self {
        EmfRecord {
            function: function.to_owned(),
            dimensions: Vec::new(),
            metrics: Vec::new(),
            properties: Map::new(),
        }
    }

    /// Adds a dimension after `Function` (and after those added before): its name joins the record's one
    /// dimension set and its value is written at the root of the line, as EMF requires. Adding a name again
    /// replaces its value. The name must differ from `Function` and from the record's metric and property
    /// names (they share the root of the line); CloudWatch refuses an empty value, so `value` must not be empty.
    pub fn dimension(mut self, name: &str, value: &str) -> Self {
        debug_assert!(
            name != "Function",
            "Function is every record's first dimension"
        );
        match self.dimensions.iter_mut().find(|(n, _)| n == name) {
            Some((_, v)) => *v = value.to_owned(),
            None => self.dimensions.push((name.to_owned(), value.to_owned())),
        }
        self
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
        self.to_json_at(ts)
    }

    /// The JSON line with `ts` (epoch ms) as its timestamp.
    fn to_json_at(&self, ts: u64) -> String {
        let mut root = self.properties.clone();
        let defs: Vec<Value> = self
            .metrics
            .iter()
            .map(|(n, u, _)| json!({"Name": n, "Unit": u.as_str()}))
            .collect();
        let dimension_set: Vec<&str> = std::iter::once("Function")
            .chain(self.dimensions.iter().map(|(n, _)| n.as_str()))
            .collect();
        root.insert(
            "_aws".into(),
            json!({
                "Timestamp": ts,
                "CloudWatchMetrics": [{
                    "Namespace": NAMESPACE,
                    "Dimensions": [dimension_set],
                    "Metrics": defs,
                }]
            }),
        );
        root.insert("Function".into(), Value::String(self.function.clone()));
        for (n, v) in &self.dimensions {
            root.insert(n.clone(), Value::String(v.clone()));
        }
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

    /// A record without extra dimensions prints exactly the line it printed before dimensions existed.
    #[test]
    fn a_record_without_dimensions_is_unchanged() {
        let line = EmfRecord::new("relay")
            .metric("Dispatched", Unit::Count, 3.0)
            .metric("OldestPendingAge", Unit::Seconds, 1.5)
            .property("requestId", "abc")
            .to_json_at(1_700_000_000_000);
        assert_eq!(
            line,
            r#"{"Dispatched":3.0,"Function":"relay","OldestPendingAge":1.5,"_aws":{"CloudWatchMetrics":[{"Dimensions":[["Function"]],"Metrics":[{"Name":"Dispatched","Unit":"Count"},{"Name":"OldestPendingAge","Unit":"Seconds"}],"Namespace":"Outbox"}],"Timestamp":1700000000000},"requestId":"abc"}"#
        );
    }

    /// Extra dimensions join `Function` in one dimension set, in the order added, their values at the root.
    #[test]
    fn dimensions_form_one_set_with_function() {
        let line = EmfRecord::new("relay")
            .dimension("Topic", "orders")
            .dimension("Subscriber", "billing")
            .dimension("Subscriber", "default")
            .metric("SubscriberPending", Unit::Count, 7.0)
            .to_json();
        let v: Value = serde_json::from_str(&line).unwrap();
        let directive = &v["_aws"]["CloudWatchMetrics"][0];
        assert_eq!(
            directive["Dimensions"],
            json!([["Function", "Topic", "Subscriber"]])
        );
        assert_eq!(directive["Namespace"], "Outbox");
        assert_eq!(directive["Metrics"][0]["Name"], "SubscriberPending");
        assert_eq!(v["Function"], "relay");
        assert_eq!(v["Topic"], "orders");
        assert_eq!(v["Subscriber"], "default");
        assert_eq!(v["SubscriberPending"], 7.0);
    }
}
