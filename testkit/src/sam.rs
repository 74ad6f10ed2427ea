//! `template.yaml` as the tests see it: the CloudFormation the SAM transform generates from it (through
//! `scripts/sam-translate`, offline), the Python tools in `./.venv`, the alarms that read the functions' EMF
//! metrics, and the dashboard that shows them; their Metrics Insights queries are read by [`insights`].

pub mod insights;
mod metric;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;

use crate::repo::repo_root;

pub use metric::{FunctionDimension, MetricId, dimension_value, ref_placeholder};

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
/// The transform is a Python run of seconds, and every test runs in a process of its own under `cargo nextest`:
/// translated once per process, and kept on disk (`target/sam-translate/<sha256>.json`) under a digest of the
/// template, the translating script and the pinned tool versions, so a change to any of them translates anew.
pub fn translated_template() -> Value {
    static TRANSLATED: OnceLock<Result<Value, String>> = OnceLock::new();
    TRANSLATED
        .get_or_init(cached_translation)
        .clone()
        .unwrap_or_else(|e| panic!("the SAM transform rejected template.yaml:\n{e}"))
}

fn cached_translation() -> Result<Value, String> {
    use sha2::{Digest, Sha256};
    let root = repo_root();
    let mut digest = Sha256::new();
    for input in [
        "template.yaml",
        "scripts/sam-translate",
        "scripts/requirements-test.txt",
    ] {
        let bytes =
            std::fs::read(root.join(input)).unwrap_or_else(|e| panic!("cannot read {input}: {e}"));
        digest.update((bytes.len() as u64).to_le_bytes());
        digest.update(&bytes);
    }
    let hex: String = digest
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("sam-translate");
    let file = dir.join(format!("{hex}.json"));
    if let Some(value) = std::fs::read(&file)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
    {
        return Ok(value);
    }
    let value = translate(Path::new("template.yaml"))?;
    // Written whole, then renamed: a test reading at the same moment sees the old state or the new file.
    let tmp = dir.join(format!("{hex}.{}.tmp", std::process::id()));
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&tmp, value.to_string()))
        .and_then(|()| std::fs::rename(&tmp, &file));
    if let Err(e) = written {
        // Only a cache: the next test translates again.
        eprintln!(
            "note: cannot keep the translation in {}: {e}",
            file.display()
        );
    }
    Ok(value)
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
    template_dimension_value(&d["Value"])
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

/// The value of a dimension in the template: a literal or `!Ref <logical id>`.
fn template_dimension_value(v: &Value) -> Option<FunctionDimension> {
    match v {
        Value::String(s) => Some(FunctionDimension::Literal(s.clone())),
        v => v["Ref"]
            .as_str()
            .map(|r| FunctionDimension::FunctionRef(r.to_owned())),
    }
}

/// The metrics one EMF line defines, read the way CloudWatch reads it: every directive of
/// `_aws.CloudWatchMetrics`, every dimension set of a directive, each dimension's value from the line's root.
/// Empty for a line that is not EMF.
pub fn emf_metrics(line: &Value) -> Vec<MetricId> {
    let mut out = Vec::new();
    for directive in line["_aws"]["CloudWatchMetrics"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let namespace = directive["Namespace"].as_str().unwrap_or_default();
        let sets: Vec<Vec<&str>> = match directive["Dimensions"].as_array() {
            Some(sets) if !sets.is_empty() => sets
                .iter()
                .map(|set| {
                    set.as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(Value::as_str)
                        .collect()
                })
                .collect(),
            _ => vec![Vec::new()],
        };
        for set in sets {
            let dimensions: BTreeMap<String, FunctionDimension> = set
                .iter()
                .map(|d| {
                    let value = line[*d].as_str().unwrap_or_default();
                    ((*d).to_owned(), dimension_value(value))
                })
                .collect();
            for m in directive["Metrics"].as_array().into_iter().flatten() {
                out.push(MetricId {
                    namespace: namespace.to_owned(),
                    name: m["Name"].as_str().unwrap_or_default().to_owned(),
                    dimensions: dimensions.clone(),
                });
            }
        }
    }
    out
}

/// A metric drawn (or read) with a statistic over a period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlottedMetric {
    pub metric: MetricId,
    /// `Sum`, `Maximum`, `p99`, ...
    pub stat: String,
    /// Seconds.
    pub period: u64,
    /// Its id in the widget (metric math refers to it), if any.
    pub id: Option<String>,
}

/// A Metrics Insights query drawn by a widget (or read by an alarm) over a period.
#[derive(Debug, Clone)]
pub struct PlottedQuery {
    /// The query as written (after substitution).
    pub text: String,
    /// The parsed query, or why it does not parse.
    pub query: Result<insights::InsightsQuery, String>,
    /// Seconds.
    pub period: u64,
    /// Its id in the widget or alarm, if any.
    pub id: Option<String>,
}

impl PlottedQuery {
    fn new(text: &str, period: u64, id: Option<String>) -> Self {
        PlottedQuery {
            text: text.to_owned(),
            query: insights::parse(text),
            period,
            id,
        }
    }

    /// Whether `other` is the same query (read the same way, however spelt) over the same period.
    pub fn same_as(&self, other: &PlottedQuery) -> bool {
        self.period == other.period
            && matches!((&self.query, &other.query), (Ok(a), Ok(b)) if a == b)
    }
}

/// The text of a `!Sub` string (or of a plain string) with its variables replaced as [`dashboard_body`] replaces
/// them, parameters by `parameter(name)`; `what` names the text in errors.
fn substitute(
    cfn: &Value,
    what: &str,
    text: &str,
    mut parameter: impl FnMut(&str) -> String,
) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..]
            .find('}')
            .ok_or_else(|| format!("{what}: unterminated ${{"))?;
        let name = &rest[start + 2..start + end];
        rest = &rest[start + end + 1..];
        if let Some(literal) = name.strip_prefix('!') {
            out.push_str(&format!("${{{literal}}}"));
        } else if name.starts_with("AWS::") {
            out.push_str(&format!("@{name}@"));
        } else if let Some((resource, _)) = name.split_once('.') {
            if cfn["Resources"].get(resource).is_none() {
                return Err(format!("{what}: ${{{name}}} names no resource"));
            }
            out.push_str(&format!("@{name}@"));
        } else if cfn["Parameters"].get(name).is_some() {
            out.push_str(&parameter(name));
        } else if cfn["Resources"].get(name).is_some() {
            out.push_str(&ref_placeholder(name));
        } else {
            return Err(format!(
                "{what}: ${{{name}}} is no parameter, resource or pseudo parameter"
            ));
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// A string property of the generated template as text: a plain string, or `!Sub` of one with its variables
/// replaced (resources by [`ref_placeholder`], parameters by `@param:<Name>@`).
pub fn sub_text(cfn: &Value, what: &str, v: &Value) -> Result<String, String> {
    match (v, &v["Fn::Sub"]) {
        (Value::String(s), _) => Ok(s.clone()),
        (_, Value::String(s)) => substitute(cfn, what, s, |p| format!("@param:{p}@")),
        _ => Err(format!("{what}: neither a string nor !Sub of one: {v}")),
    }
}

/// The `DashboardBody` of a dashboard, its `Fn::Sub` resolved into parseable JSON: a pseudo parameter
/// `${AWS::X}` becomes the text `@AWS::X@`, a resource `${Id}` becomes [`ref_placeholder`], an attribute
/// `${Id.Attr}` becomes `@Id.Attr@`, and a parameter `${Name}` a number of its own (it may stand where JSON
/// expects a number, such as an annotation's value), which [`DashboardBody::parameter`] maps back.
#[derive(Debug, Clone)]
pub struct DashboardBody {
    /// The parsed body.
    pub json: Value,
    parameters: BTreeMap<String, String>,
}

impl DashboardBody {
    /// The parameter a substituted value stands for.
    pub fn parameter(&self, value: &Value) -> Option<&str> {
        self.parameters.get(&value.to_string()).map(String::as_str)
    }
}

/// The body of the dashboard resource `id` of the generated template `cfn`.
pub fn dashboard_body(cfn: &Value, id: &str) -> Result<DashboardBody, String> {
    let body = &cfn["Resources"][id]["Properties"]["DashboardBody"];
    let text = match (&body["Fn::Sub"], body) {
        (Value::String(s), _) => s.as_str(),
        (_, Value::String(s)) => s.as_str(),
        _ => {
            return Err(format!(
                "{id}: DashboardBody is neither a string nor !Sub of one: {body}"
            ));
        }
    };
    let mut parameters = BTreeMap::new();
    let out = substitute(cfn, id, text, |name| {
        let stand_in = (900_000_001 + parameters.len()).to_string();
        parameters.insert(stand_in.clone(), name.to_owned());
        stand_in
    })?;
    let json = serde_json::from_str(&out)
        .map_err(|e| format!("{id}: DashboardBody is not JSON after substitution: {e}\n{out}"))?;
    Ok(DashboardBody { json, parameters })
}

/// One widget of a dashboard, as far as the tests look at it.
#[derive(Debug, Clone)]
pub struct Widget {
    /// `metric`, `alarm`, `text`, ...
    pub kind: String,
    /// Its title (or its index when it has none).
    pub title: String,
    /// The widget as written (after substitution).
    pub raw: Value,
    /// A metric widget's metrics (rows with a namespace).
    pub metrics: Vec<PlottedMetric>,
    /// A metric widget's math expressions: (id, expression).
    pub expressions: Vec<(Option<String>, String)>,
    /// A metric widget's Metrics Insights queries (expressions that start with `SELECT`).
    pub queries: Vec<PlottedQuery>,
    /// The values of its horizontal annotations.
    pub thresholds: Vec<Value>,
    /// The alarms it shows (an alarm widget's list, or a metric widget's alarm annotations): their logical ids,
    /// or the text as written when it is not `${Id.Arn}`.
    pub alarms: Vec<String>,
}

/// The widgets of a dashboard body. A metric row is `[namespace, name, dim, value, ..., {options}]` where `"."`
/// repeats the previous row's entry at that place; a row of only `{options}` is an expression: a Metrics
/// Insights query when it starts with `SELECT`, metric math otherwise. The widget's `stat` and `period` apply
/// unless the row's options override them (CloudWatch's defaults: Average, 300 s).
pub fn dashboard_widgets(body: &DashboardBody) -> Result<Vec<Widget>, String> {
    let mut out = Vec::new();
    let widgets = body.json["widgets"]
        .as_array()
        .ok_or("the body has no widgets array")?;
    for (i, w) in widgets.iter().enumerate() {
        let p = &w["properties"];
        let title = p["title"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| format!("widget #{i}"));
        let mut widget = Widget {
            kind: w["type"].as_str().unwrap_or_default().to_owned(),
            title: title.clone(),
            raw: w.clone(),
            metrics: Vec::new(),
            expressions: Vec::new(),
            queries: Vec::new(),
            thresholds: Vec::new(),
            alarms: Vec::new(),
        };
        let stat = p["stat"].as_str().unwrap_or("Average");
        let period = p["period"].as_u64().unwrap_or(300);
        let mut previous: Vec<Value> = Vec::new();
        for row in p["metrics"].as_array().into_iter().flatten() {
            let row = row
                .as_array()
                .ok_or_else(|| format!("{title}: a metrics row is not an array: {row}"))?;
            let (fields, options) = match row.last() {
                Some(Value::Object(o)) => (&row[..row.len() - 1], Some(o)),
                _ => (&row[..], None),
            };
            let option = |k: &str| options.and_then(|o| o.get(k));
            let id = option("id").and_then(Value::as_str).map(str::to_owned);
            if fields.is_empty() {
                let expression = option("expression")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        format!("{title}: a row without metric or expression: {row:?}")
                    })?;
                if insights::is_query(expression) {
                    let period = option("period").and_then(Value::as_u64).unwrap_or(period);
                    widget
                        .queries
                        .push(PlottedQuery::new(expression, period, id));
                } else {
                    widget.expressions.push((id, expression.to_owned()));
                }
                continue;
            }
            let fields: Vec<Value> = fields
                .iter()
                .enumerate()
                .map(|(k, f)| match (f.as_str(), previous.get(k)) {
                    (Some("."), Some(prev)) => Ok(prev.clone()),
                    (Some("."), None) => Err(format!("{title}: \".\" with nothing above it")),
                    _ => Ok(f.clone()),
                })
                .collect::<Result<_, _>>()?;
            previous = fields.clone();
            let text: Vec<&str> = fields
                .iter()
                .map(|f| {
                    f.as_str()
                        .ok_or_else(|| format!("{title}: {f} is not a string"))
                })
                .collect::<Result<_, _>>()?;
            if text.len() < 2 || !text.len().is_multiple_of(2) {
                return Err(format!(
                    "{title}: a metric row needs namespace, name and dimension pairs: {row:?}"
                ));
            }
            let dimensions = text[2..]
                .chunks(2)
                .map(|pair| (pair[0].to_owned(), dimension_value(pair[1])))
                .collect();
            widget.metrics.push(PlottedMetric {
                metric: MetricId {
                    namespace: text[0].to_owned(),
                    name: text[1].to_owned(),
                    dimensions,
                },
                stat: option("stat")
                    .and_then(Value::as_str)
                    .unwrap_or(stat)
                    .to_owned(),
                period: option("period").and_then(Value::as_u64).unwrap_or(period),
                id,
            });
        }
        widget.thresholds = p["annotations"]["horizontal"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|a| a["value"].clone())
            .collect();
        let alarm_list = if widget.kind == "alarm" {
            &p["alarms"]
        } else {
            &p["annotations"]["alarms"]
        };
        widget.alarms = alarm_list
            .as_array()
            .into_iter()
            .flatten()
            .map(|a| {
                let text = a.as_str().unwrap_or_default();
                text.strip_prefix('@')
                    .and_then(|t| t.strip_suffix(".Arn@"))
                    .unwrap_or(text)
                    .to_owned()
            })
            .collect();
        out.push(widget);
    }
    Ok(out)
}

/// What an alarm evaluates: its metrics with their statistic and period (several for metric math) or its Metrics
/// Insights query, its threshold (a number or `{"Ref": parameter}`).
#[derive(Debug, Clone)]
pub struct AlarmReads {
    /// The alarm's logical id.
    pub alarm: String,
    /// The metrics it reads.
    pub metrics: Vec<PlottedMetric>,
    /// Its Metrics Insights queries (an `Expression` of `Metrics` that starts with `SELECT`; a `!Sub` has its
    /// variables replaced as by [`sub_text`]).
    pub queries: Vec<PlottedQuery>,
    pub threshold: Value,
}

fn template_dimensions(dims: &Value) -> BTreeMap<String, FunctionDimension> {
    dims.as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            let name = d["Name"].as_str().unwrap_or_default().to_owned();
            let value = template_dimension_value(&d["Value"])
                .unwrap_or_else(|| panic!("dimension {name}: unsupported value {}", d["Value"]));
            (name, value)
        })
        .collect()
}

/// What every alarm of `cfn` reads (plain, metric-math and Metrics Insights alarms).
pub fn alarm_reads(cfn: &Value) -> Vec<AlarmReads> {
    let mut out = Vec::new();
    for (id, r) in cfn["Resources"].as_object().expect("Resources") {
        if r["Type"] != "AWS::CloudWatch::Alarm" {
            continue;
        }
        let p = &r["Properties"];
        let mut metrics = Vec::new();
        let mut queries = Vec::new();
        if let Some(name) = p["MetricName"].as_str() {
            metrics.push(PlottedMetric {
                metric: MetricId {
                    namespace: p["Namespace"].as_str().unwrap_or_default().to_owned(),
                    name: name.to_owned(),
                    dimensions: template_dimensions(&p["Dimensions"]),
                },
                stat: p["Statistic"]
                    .as_str()
                    .or(p["ExtendedStatistic"].as_str())
                    .unwrap_or_default()
                    .to_owned(),
                period: p["Period"].as_u64().unwrap_or_default(),
                id: None,
            });
        }
        for m in p["Metrics"].as_array().into_iter().flatten() {
            let stat = &m["MetricStat"];
            if stat.is_null() {
                let id_text = m["Id"].as_str().map(str::to_owned);
                let text = match sub_text(cfn, id, &m["Expression"]) {
                    Ok(text) => text,
                    Err(e) => panic!("alarm {id}: {e}"),
                };
                if insights::is_query(&text) {
                    queries.push(PlottedQuery::new(
                        &text,
                        m["Period"].as_u64().unwrap_or_default(),
                        id_text,
                    ));
                }
                continue;
            }
            metrics.push(PlottedMetric {
                metric: MetricId {
                    namespace: stat["Metric"]["Namespace"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    name: stat["Metric"]["MetricName"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    dimensions: template_dimensions(&stat["Metric"]["Dimensions"]),
                },
                stat: stat["Stat"].as_str().unwrap_or_default().to_owned(),
                period: stat["Period"].as_u64().unwrap_or_default(),
                id: m["Id"].as_str().map(str::to_owned),
            });
        }
        out.push(AlarmReads {
            alarm: id.clone(),
            metrics,
            queries,
            threshold: p["Threshold"].clone(),
        });
    }
    out
}

/// The logical ids of the alarms `widgets` show.
pub fn dashboard_alarms(widgets: &[Widget]) -> BTreeSet<String> {
    widgets
        .iter()
        .flat_map(|w| w.alarms.iter().cloned())
        .collect()
}
