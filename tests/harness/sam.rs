//! `template.yaml` as the tests see it: the CloudFormation the SAM transform generates from it (through
//! `scripts/sam-translate`, offline), the Python tools in `./.venv`, and the alarms that read the functions' EMF
//! metrics.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A tool installed into `./.venv/bin` by `scripts/test-deps`; panics with that hint when it is missing.
pub fn venv_tool(name: &str) -> PathBuf {
    let path = repo_root().join(".venv/bin").join(name);
    assert!(
        path.exists(),
        "{} is missing: run scripts/test-deps (it installs cfn-lint, aws-sam-translator, cargo-lambda and zig \
         into ./.venv from scripts/requirements-test.txt)",
        path.display()
    );
    path
}

/// Runs the SAM transform on `template` (absolute, or relative to the repository root) and returns the generated
/// CloudFormation template, or the transform's messages.
pub fn translate(template: &Path) -> Result<Value, String> {
    let out = Command::new(venv_tool("python"))
        .arg(repo_root().join("scripts/sam-translate"))
        .arg(repo_root().join(template))
        .output()
        .expect("cannot run scripts/sam-translate");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(serde_json::from_slice(&out.stdout).expect("scripts/sam-translate printed invalid JSON"))
}

/// The generated CloudFormation of the repository's `template.yaml` (panics with the transform's messages).
pub fn translated_template() -> Value {
    translate(Path::new("template.yaml"))
        .unwrap_or_else(|e| panic!("the SAM transform rejected template.yaml:\n{e}"))
}

/// Which function an alarm's `Function` dimension names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FunctionDimension {
    /// `!Ref <LogicalId>` of a function: its deployed name (what the relay reports, from
    /// `AWS_LAMBDA_FUNCTION_NAME`).
    FunctionRef(String),
    /// A literal value (the receivers report fixed names).
    Literal(String),
}

/// One metric an alarm reads in the `Outbox` namespace (the functions' EMF lines).
#[derive(Debug, Clone)]
pub struct OutboxAlarmMetric {
    /// The alarm's logical id.
    pub alarm: String,
    /// The metric name.
    pub metric: String,
    /// The `Function` dimension.
    pub function: FunctionDimension,
}

fn dimension(dims: &Value) -> Option<FunctionDimension> {
    let d = dims.as_array()?.iter().find(|d| d["Name"] == "Function")?;
    match &d["Value"] {
        Value::String(s) => Some(FunctionDimension::Literal(s.clone())),
        v => v["Ref"]
            .as_str()
            .map(|r| FunctionDimension::FunctionRef(r.to_owned())),
    }
}

/// Every `Outbox`-namespace metric read by an alarm of `cfn` (plain alarms and metric-math alarms alike).
pub fn outbox_alarm_metrics(cfn: &Value) -> Vec<OutboxAlarmMetric> {
    let mut out = Vec::new();
    let resources = cfn["Resources"].as_object().expect("Resources");
    for (id, r) in resources {
        if r["Type"] != "AWS::CloudWatch::Alarm" {
            continue;
        }
        let p = &r["Properties"];
        let mut push = |namespace: &Value, metric: &Value, dims: &Value| {
            if namespace == "Outbox" {
                out.push(OutboxAlarmMetric {
                    alarm: id.clone(),
                    metric: metric.as_str().expect("MetricName").to_owned(),
                    function: dimension(dims)
                        .unwrap_or_else(|| panic!("alarm {id} has no Function dimension")),
                });
            }
        };
        push(&p["Namespace"], &p["MetricName"], &p["Dimensions"]);
        for m in p["Metrics"].as_array().into_iter().flatten() {
            let metric = &m["MetricStat"]["Metric"];
            push(
                &metric["Namespace"],
                &metric["MetricName"],
                &metric["Dimensions"],
            );
        }
    }
    out
}
