//! What a CloudWatch metric is, as the tests compare them: its identity (namespace, name, dimensions) and a
//! dimension's value, a literal or `!Ref` of a function, written as text by [`ref_placeholder`].

use std::collections::BTreeMap;
use std::fmt;

/// Which function an alarm's `Function` dimension names (or, generally, the value of a metric's dimension).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum FunctionDimension {
    /// `!Ref <LogicalId>` of a function: its deployed name (what the relay reports, from
    /// `AWS_LAMBDA_FUNCTION_NAME`).
    FunctionRef(String),
    /// A literal value (the receivers report fixed names).
    Literal(String),
}

/// How `!Ref <logical id>` is written where a test must put it into text: an EMF line's dimension value (the relay
/// reports `AWS_LAMBDA_FUNCTION_NAME`, which is what `!Ref RelayFunction` returns) or a substituted `Fn::Sub`.
pub fn ref_placeholder(id: &str) -> String {
    format!("@ref:{id}@")
}

/// A dimension value written as text: [`ref_placeholder`] text is the reference, anything else a literal.
pub fn dimension_value(text: &str) -> FunctionDimension {
    match text.strip_prefix("@ref:").and_then(|s| s.strip_suffix('@')) {
        Some(id) => FunctionDimension::FunctionRef(id.to_owned()),
        None => FunctionDimension::Literal(text.to_owned()),
    }
}

/// One CloudWatch metric: namespace, name and its whole dimension set. CloudWatch treats two metrics as the same
/// only when all three are equal: `Pending` with the dimension `Function` is not `Pending` without it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct MetricId {
    pub namespace: String,
    /// The metric name.
    pub name: String,
    /// Every dimension, name → value.
    pub dimensions: BTreeMap<String, FunctionDimension>,
}

impl fmt::Display for MetricId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{} {{", self.namespace, self.name)?;
        for (i, (k, v)) in self.dimensions.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            match v {
                FunctionDimension::FunctionRef(id) => write!(f, "{sep}{k}=!Ref {id}")?,
                FunctionDimension::Literal(s) => write!(f, "{sep}{k}={s:?}")?,
            }
        }
        write!(f, "}}")
    }
}
