//! `template.yaml`: cfn-lint accepts it (and the CloudFormation the SAM transform generates from it), and the
//! generated stack is what the design promises: three arm64 `provided.al2023` functions built with cargo-lambda,
//! least-privilege roles, two secrets (the relay's with the QStash token, the receivers' without it) each read by
//! its own functions only, a once-a-minute schedule with a fixed input and no retries, public function URLs for
//! the two receivers only, capped by a reserved concurrency, log groups with retention, alarms on the metrics the
//! code emits, and parameters whose defaults equal the code's defaults and whose bounds are the code's. Needs
//! `./.venv` (`scripts/test-deps`); no network, no AWS account.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use outbox::config::{
    ConfigError, ConsumerConfig, MAX_CLOCK_TOLERANCE, MIN_SECRET_REFRESH_INTERVAL, QstashConfig,
    RelayConfig, Vars,
};
use outbox::db::DbConfig;
use outbox::receiver::RECEIVER_SECRETS;
use outbox::relay::handler::{InvocationSummary, emf};
use outbox::secrets::{SECRET_ID_VAR, SecretField};
use outbox_system::sam::{
    FunctionDimension, outbox_alarm_metrics, repo_root, translate, translated_template, venv_tool,
};
use serde_json::{Value, json};

/// The three functions: logical id, binary (= cargo-lambda function name), source directory.
const FUNCTIONS: [(&str, &str, &str); 3] = [
    ("RelayFunction", "relay", "functions/relay"),
    ("ConsumerFunction", "consumer", "functions/consumer"),
    (
        "FailureCallbackFunction",
        "failure-callback",
        "functions/failure-callback",
    ),
];

/// The two receivers: public function URLs, the receiver secret.
const RECEIVERS: [&str; 2] = ["ConsumerFunction", "FailureCallbackFunction"];

/// The fields the relay loads (`shared/src/relay/handler.rs`): the database and the publishing token.
const RELAY_SECRETS: [SecretField; 2] = [SecretField::DatabaseUrl, SecretField::QstashToken];

/// `!If [Create<X>Secret, !Ref <X>Secret, !Ref Existing<X>SecretArn]`: the secret a function or role uses.
fn secret_ref(which: &str) -> Value {
    json!({"Fn::If": [
        format!("Create{which}Secret"),
        {"Ref": format!("{which}Secret")},
        {"Ref": format!("Existing{which}SecretArn")}
    ]})
}

/// The secret (`Relay` or `Receiver`) of a function.
fn secret_of(function: &str) -> &'static str {
    if function == "RelayFunction" {
        "Relay"
    } else {
        "Receiver"
    }
}

/// Variables whose template default deliberately differs from the code's default.
/// `RELAY_ORDERED_EVIDENCE`: `consumer` in this stack, whose consumer shares the outbox's database
/// (docs/decisions/0007); the code defaults to `callback`, which works with any consumer.
const DELIBERATE: &[&str] = &["RELAY_ORDERED_EVIDENCE"];

fn resources(cfn: &Value) -> &serde_json::Map<String, Value> {
    cfn["Resources"].as_object().expect("Resources")
}

fn of_type<'a>(cfn: &'a Value, ty: &str) -> Vec<(&'a String, &'a Value)> {
    resources(cfn)
        .iter()
        .filter(|(_, r)| r["Type"] == ty)
        .collect()
}

fn param_default(cfn: &Value, name: &str) -> Value {
    cfn["Parameters"][name]["Default"].clone()
}

/// A scratch directory outside the workspace.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("outbox-template-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn cfn_lint(path: &Path) -> (bool, String) {
    let out = Command::new(venv_tool("cfn-lint"))
        .arg(path)
        .current_dir(repo_root())
        .output()
        .expect("cannot run cfn-lint");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn cfn_lint_accepts_the_template_and_the_generated_cloudformation() {
    let (ok, text) = cfn_lint(Path::new("template.yaml"));
    assert!(ok, "cfn-lint template.yaml reported problems:\n{text}");

    // cfn-lint 1.5x checks SAM resources against SAM's schema without running the transform; the generated
    // CloudFormation is linted as well (it catches what only exists after the transform).
    let dir = scratch("lint");
    let generated = dir.join("template.cfn.json");
    std::fs::write(&generated, translated_template().to_string()).unwrap();
    let (ok, text) = cfn_lint(&generated);
    assert!(
        ok,
        "cfn-lint on the transformed template reported problems:\n{text}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_checks_catch_a_broken_template() {
    let original = std::fs::read_to_string(repo_root().join("template.yaml")).unwrap();
    let dir = scratch("broken");

    // The transform refuses an invalid function URL auth type (cfn-lint alone does not).
    let bad_auth = original.replace("AuthType: NONE", "AuthType: PUBLIC");
    assert_ne!(bad_auth, original);
    let path = dir.join("bad-auth.yaml");
    std::fs::write(&path, bad_auth).unwrap();
    let err = translate(&path).expect_err("the transform accepted AuthType: PUBLIC");
    assert!(err.contains("AuthType"), "{err}");

    // cfn-lint refuses a mistyped property.
    let bad_prop = original.replace(
        "Timeout: !Ref RelayTimeoutSeconds",
        "Timeoutt: !Ref RelayTimeoutSeconds",
    );
    assert_ne!(bad_prop, original);
    let path = dir.join("bad-prop.yaml");
    std::fs::write(&path, bad_prop).unwrap();
    let (ok, text) = cfn_lint(&path);
    assert!(!ok && text.contains("Timeoutt"), "{text}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn three_arm64_functions_built_by_cargo_lambda() {
    let cfn = translated_template();
    let functions = of_type(&cfn, "AWS::Lambda::Function");
    assert_eq!(functions.len(), 3, "{functions:?}");
    for (id, bin, dir) in FUNCTIONS {
        let f = &cfn["Resources"][id];
        assert_eq!(f["Type"], "AWS::Lambda::Function", "{id}");
        let p = &f["Properties"];
        assert_eq!(p["Runtime"], "provided.al2023", "{id}");
        assert_eq!(p["Architectures"], json!(["arm64"]), "{id}");
        assert_eq!(p["Handler"], "bootstrap", "{id}");
        assert_eq!(f["Metadata"]["BuildMethod"], "rust-cargolambda", "{id}");
        assert_eq!(f["Metadata"]["BuildProperties"]["Binary"], bin, "{id}");
        // The binary exists under that name in that package.
        let manifest = std::fs::read_to_string(repo_root().join(dir).join("Cargo.toml")).unwrap();
        assert!(
            manifest.contains(&format!("name = \"{bin}\"")),
            "{dir}/Cargo.toml has no bin {bin}"
        );
        // Its own log group, JSON logs, never filtered above INFO (EMF lines carry no level: Lambda files them
        // as INFO, so a WARN filter would silence the alarms).
        let log = &p["LoggingConfig"];
        assert_eq!(log["LogFormat"], "JSON", "{id}");
        assert_eq!(
            log["ApplicationLogLevel"],
            json!({"Ref": "LogLevel"}),
            "{id}"
        );
        let group = log["LogGroup"]["Ref"].as_str().expect("LogGroup ref");
        assert_eq!(
            cfn["Resources"][group]["Properties"]["RetentionInDays"],
            json!({"Ref": "LogRetentionDays"}),
            "{id}"
        );
    }
    let levels = &cfn["Parameters"]["LogLevel"]["AllowedValues"];
    for level in ["WARN", "ERROR", "FATAL"] {
        assert!(
            !levels.as_array().unwrap().contains(&json!(level)),
            "{levels}"
        );
    }
    let original = std::fs::read_to_string(repo_root().join("template.yaml")).unwrap();
    for (_, _, dir) in FUNCTIONS {
        assert!(
            original.contains(&format!("CodeUri: ./{dir}\n")),
            "CodeUri of {dir}"
        );
    }
}

/// Every permission a role grants, as (role, action, resource, condition-free).
fn statements(cfn: &Value) -> Vec<(String, String, Value)> {
    let mut out = Vec::new();
    for (id, role) in of_type(cfn, "AWS::IAM::Role") {
        for policy in role["Properties"]["Policies"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let mut stmts: Vec<&Value> = Vec::new();
            for s in policy["PolicyDocument"]["Statement"].as_array().unwrap() {
                // `!If [HasKmsKey, {statement}, !Ref AWS::NoValue]`
                match s.get("Fn::If") {
                    Some(branches) => stmts.push(&branches[1]),
                    None => stmts.push(s),
                }
            }
            for s in stmts {
                assert_eq!(s["Effect"], "Allow", "{id}: {s}");
                let actions: Vec<String> = match &s["Action"] {
                    Value::String(a) => vec![a.clone()],
                    Value::Array(a) => a.iter().map(|a| a.as_str().unwrap().to_owned()).collect(),
                    other => panic!("{id}: action {other}"),
                };
                for a in actions {
                    out.push((id.clone(), a, s["Resource"].clone()));
                }
            }
        }
    }
    out
}

#[test]
fn roles_are_least_privilege() {
    let cfn = translated_template();
    let secrets = [secret_ref("Relay"), secret_ref("Receiver")];
    let all = statements(&cfn);
    assert!(!all.is_empty());
    for (role, action, resource) in &all {
        assert!(
            !action.contains('*'),
            "{role} grants a wildcard action {action}"
        );
        assert_ne!(
            resource,
            &json!("*"),
            "{role} grants {action} on every resource"
        );
        match action.as_str() {
            "secretsmanager:GetSecretValue" => assert!(secrets.contains(resource), "{role}"),
            "kms:Decrypt" => assert_eq!(resource, &json!({"Ref": "SecretKmsKeyArn"}), "{role}"),
            "logs:CreateLogStream" | "logs:PutLogEvents" => {
                assert!(
                    resource["Fn::GetAtt"][0]
                        .as_str()
                        .unwrap()
                        .ends_with("LogGroup"),
                    "{role}"
                )
            }
            // The scheduler's role may start the relay, nothing else.
            "lambda:InvokeFunction" => {
                assert_eq!(
                    resource,
                    &json!({"Fn::GetAtt": ["RelayFunction", "Arn"]}),
                    "{role}"
                )
            }
            other => panic!("{role} grants {other}, which no function needs"),
        }
    }
    // Each function has its own role, which reads its own secret (the relay's or the receivers', never both) and
    // writes its own log group only.
    let mut roles = BTreeSet::new();
    for (id, _, _) in FUNCTIONS {
        let p = &cfn["Resources"][id]["Properties"];
        let role = p["Role"]["Fn::GetAtt"][0]
            .as_str()
            .expect("explicit role")
            .to_owned();
        let own_group = p["LoggingConfig"]["LogGroup"]["Ref"].as_str().unwrap();
        let mine: Vec<_> = all.iter().filter(|(r, _, _)| *r == role).collect();
        let readable: Vec<&Value> = mine
            .iter()
            .filter(|(_, a, _)| a.starts_with("secretsmanager:"))
            .map(|(_, _, res)| res)
            .collect();
        assert_eq!(readable, [&secret_ref(secret_of(id))], "{role}");
        assert_eq!(
            p["Environment"]["Variables"][SECRET_ID_VAR],
            secret_ref(secret_of(id)),
            "{id} reads another secret than its role may"
        );
        for (_, a, res) in &mine {
            if a.starts_with("logs:") {
                assert_eq!(res, &json!({"Fn::GetAtt": [own_group, "Arn"]}), "{role}");
            }
        }
        // Managed policies: only VPC networking, and only when subnets are given.
        let managed = &cfn["Resources"][&role]["Properties"]["ManagedPolicyArns"];
        for m in managed.as_array().into_iter().flatten() {
            assert_eq!(m["Fn::If"][0], "HasVpc", "{role}: {m}");
            assert!(
                m["Fn::If"][1]["Fn::Sub"]
                    .as_str()
                    .unwrap()
                    .ends_with("AWSLambdaVPCAccessExecutionRole"),
                "{role}: {m}"
            );
        }
        assert!(roles.insert(role), "{id} shares its role");
    }
}

#[test]
fn two_secrets_each_with_exactly_the_fields_its_functions_read() {
    let cfn = translated_template();
    let names = |fields: &[SecretField]| -> BTreeSet<String> {
        fields.iter().map(|f| f.name().to_owned()).collect()
    };
    let mut all = BTreeSet::new();
    for (which, wanted) in [
        ("Relay", &RELAY_SECRETS[..]),
        ("Receiver", &RECEIVER_SECRETS[..]),
    ] {
        let id = format!("{which}Secret");
        let secret = &cfn["Resources"][&id];
        assert_eq!(secret["Type"], "AWS::SecretsManager::Secret", "{id}");
        // Created only when no existing secret is given; kept when the stack goes (it holds credentials).
        assert_eq!(secret["Condition"], format!("Create{which}Secret"), "{id}");
        assert_eq!(
            cfn["Conditions"][format!("Create{which}Secret")],
            json!({"Fn::Equals": [{"Ref": format!("Existing{which}SecretArn")}, ""]}),
            "{id}"
        );
        assert_eq!(
            param_default(&cfn, &format!("Existing{which}SecretArn")),
            "",
            "{id}"
        );
        assert_eq!(secret["DeletionPolicy"], "Retain", "{id}");
        // Created with exactly its functions' fields, empty.
        let fields: Value =
            serde_json::from_str(secret["Properties"]["SecretString"].as_str().unwrap()).unwrap();
        let fields = fields.as_object().unwrap();
        assert!(fields.values().all(|v| v == ""), "{id}: {fields:?}");
        let got: BTreeSet<String> = fields.keys().cloned().collect();
        assert_eq!(got, names(wanted), "{id}");
        all.extend(got);
        // Its description names the same fields.
        let description = secret["Properties"]["Description"]["Fn::Sub"]
            .as_str()
            .unwrap();
        for f in SecretField::ALL {
            assert_eq!(
                description.contains(f.name()),
                wanted.contains(&f),
                "{id}: {description}"
            );
        }
    }
    // Between them, every field; the token only in the relay's (the receivers must not be able to publish).
    assert_eq!(all, names(&SecretField::ALL));
    assert!(!RECEIVER_SECRETS.contains(&SecretField::QstashToken));
    // The functions: each its own secret, none from Globals.
    for (id, _, _) in FUNCTIONS {
        assert_eq!(
            cfn["Resources"][id]["Properties"]["Environment"]["Variables"][SECRET_ID_VAR],
            secret_ref(secret_of(id)),
            "{id}"
        );
    }
    let original = std::fs::read_to_string(repo_root().join("template.yaml")).unwrap();
    let globals =
        &original[original.find("\nGlobals:").unwrap()..original.find("\nResources:").unwrap()];
    assert!(!globals.contains(&format!("{SECRET_ID_VAR}:")), "{globals}");
    // The old single secret is gone, parameter and all.
    for old in ["OutboxSecret", "ExistingSecretArn", "CreateSecret"] {
        assert!(
            !cfn.to_string().contains(&format!("\"{old}\"")),
            "{old} is still referenced"
        );
    }
    // A deploy that gives the receivers the relay's secret is refused.
    let rule = &cfn["Rules"]["SeparateSecrets"];
    assert_eq!(
        rule["RuleCondition"],
        json!({"Fn::Not": [{"Fn::Equals": [{"Ref": "ExistingReceiverSecretArn"}, ""]}]})
    );
    assert_eq!(
        rule["Assertions"][0]["Assert"],
        json!({"Fn::Not": [{"Fn::Equals": [
            {"Ref": "ExistingReceiverSecretArn"},
            {"Ref": "ExistingRelaySecretArn"}
        ]}]})
    );
    // KMS: one optional key, decrypt through Secrets Manager only (checked per role above).
    assert_eq!(param_default(&cfn, "SecretKmsKeyArn"), "");
}

#[test]
fn the_public_receivers_have_a_reserved_concurrency_by_default() {
    let cfn = translated_template();
    for (id, param, condition, default) in [
        (
            "ConsumerFunction",
            "ConsumerReservedConcurrency",
            "ReserveConsumer",
            20,
        ),
        (
            "FailureCallbackFunction",
            "CallbackReservedConcurrency",
            "ReserveCallback",
            10,
        ),
        (
            "RelayFunction",
            "RelayReservedConcurrency",
            "ReserveRelay",
            2,
        ),
    ] {
        assert_eq!(param_default(&cfn, param), default, "{param}");
        let p = &cfn["Parameters"][param];
        // 0 = do not reserve (accounts whose quota cannot leave 100 unreserved executions).
        assert_eq!(p["MinValue"], 0, "{param}");
        assert!(p["MaxValue"].as_u64().unwrap() >= default, "{param}");
        assert_eq!(
            cfn["Resources"][id]["Properties"]["ReservedConcurrentExecutions"],
            json!({"Fn::If": [condition, {"Ref": param}, {"Ref": "AWS::NoValue"}]}),
            "{id}"
        );
        assert_eq!(
            cfn["Conditions"][condition],
            json!({"Fn::Not": [{"Fn::Equals": [{"Ref": param}, 0]}]}),
            "{condition}"
        );
        let description = p["Description"].as_str().unwrap();
        if RECEIVERS.contains(&id) {
            // The description says what the cap is for and what throttling does.
            for what in ["flood", "DbMaxConnections", "429", "0 = do not reserve"] {
                assert!(description.contains(what), "{param}: {description}");
            }
        }
    }
    // The receivers' caps bound their Postgres connections by default to a few dozen.
    let connections = |param: &str| {
        param_default(&cfn, param).as_u64().unwrap()
            * param_default(&cfn, "DbMaxConnections").as_u64().unwrap()
    };
    assert_eq!(
        connections("ConsumerReservedConcurrency") + connections("CallbackReservedConcurrency"),
        60
    );
}

#[test]
fn the_receivers_get_the_new_settings_and_the_codes_bounds() {
    let cfn = translated_template();
    let env = |id: &str| cfn["Resources"][id]["Properties"]["Environment"]["Variables"].clone();
    // TRUST_FORWARDED_HEADERS: both receivers, off by default.
    let p = &cfn["Parameters"]["TrustForwardedHeaders"];
    assert_eq!(p["Default"], "false");
    assert_eq!(p["AllowedValues"], json!(["true", "false"]));
    for id in RECEIVERS {
        assert_eq!(
            env(id)["TRUST_FORWARDED_HEADERS"],
            json!({"Ref": "TrustForwardedHeaders"}),
            "{id}"
        );
    }
    // LEGACY_DELIVERIES: the consumer (the only one that applies events), verify by default.
    let p = &cfn["Parameters"]["LegacyDeliveries"];
    assert_eq!(p["Default"], "verify");
    assert_eq!(p["AllowedValues"], json!(["verify", "refuse"]));
    assert_eq!(
        env("ConsumerFunction")["LEGACY_DELIVERIES"],
        json!({"Ref": "LegacyDeliveries"})
    );
    // Neither reaches the relay.
    for var in ["TRUST_FORWARDED_HEADERS", "LEGACY_DELIVERIES"] {
        assert!(env("RelayFunction").get(var).is_none(), "{var}");
    }

    // The template's bounds are the code's: the bound itself is accepted, one beyond is refused by both.
    let bounded = [
        (
            "SIGNATURE_CLOCK_TOLERANCE_SECS",
            "SignatureClockToleranceSecs",
            "MaxValue",
            MAX_CLOCK_TOLERANCE.as_secs(),
        ),
        (
            "SECRET_REFRESH_INTERVAL_SECS",
            "SecretRefreshIntervalSecs",
            "MinValue",
            MIN_SECRET_REFRESH_INTERVAL.as_secs(),
        ),
    ];
    for (var, param, which, bound) in bounded {
        assert_eq!(cfn["Parameters"][param][which], bound, "{param}.{which}");
        for id in RECEIVERS {
            assert_eq!(env(id)[var], json!({"Ref": param}), "{id}");
        }
        let consumer = |value: u64| {
            let e: HashMap<String, String> = HashMap::from([(var.to_owned(), value.to_string())]);
            ConsumerConfig::from_vars(&Vars::new(&e))
        };
        consumer(bound).unwrap_or_else(|e| panic!("{var}={bound}: {e}"));
        let beyond = if which == "MaxValue" {
            bound + 1
        } else {
            bound - 1
        };
        match consumer(beyond) {
            Err(ConfigError::InvalidVar { name, .. }) => assert_eq!(name, var),
            other => panic!("{var}={beyond} was not refused: {other:?}"),
        }
    }
}

#[test]
fn the_relay_runs_every_minute_with_a_fixed_input_and_no_retries() {
    let cfn = translated_template();
    let schedules = of_type(&cfn, "AWS::Scheduler::Schedule");
    assert_eq!(schedules.len(), 1);
    let p = &schedules[0].1["Properties"];
    assert_eq!(p["ScheduleExpression"], json!({"Ref": "RelaySchedule"}));
    assert_eq!(param_default(&cfn, "RelaySchedule"), "rate(1 minute)");
    assert_eq!(p["FlexibleTimeWindow"]["Mode"], "OFF");
    assert_eq!(
        p["Target"]["Arn"],
        json!({"Fn::GetAtt": ["RelayFunction", "Arn"]})
    );
    assert_eq!(p["Target"]["RetryPolicy"]["MaximumRetryAttempts"], 0);
    let input: Value = serde_json::from_str(p["Target"]["Input"].as_str().unwrap()).unwrap();
    assert_eq!(input, json!({"trigger": "schedule"}));
    // The fixture of that payload is the file the tests and `cargo lambda invoke` use.
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("events/schedule-v2-input.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(input, fixture);

    let invoke = of_type(&cfn, "AWS::Lambda::EventInvokeConfig");
    assert_eq!(invoke.len(), 1);
    assert_eq!(invoke[0].1["Properties"]["MaximumRetryAttempts"], 0);

    // The relay claims while more than a lease is left before its deadline minus the margin: the defaults keep
    // it draining for most of each minute.
    let n = |name: &str| param_default(&cfn, name).as_f64().unwrap();
    let draining =
        n("RelayTimeoutSeconds") - n("RelayDeadlineMarginMs") / 1000.0 - n("RelayLeaseSecs");
    assert!((45.0..=60.0).contains(&draining), "{draining}");
    assert_eq!(
        cfn["Resources"]["RelayFunction"]["Properties"]["Timeout"],
        json!({"Ref": "RelayTimeoutSeconds"})
    );
}

#[test]
fn only_the_receivers_have_public_urls_and_the_relay_knows_them() {
    let cfn = translated_template();
    let urls = of_type(&cfn, "AWS::Lambda::Url");
    let targets: BTreeSet<String> = urls
        .iter()
        .map(|(_, u)| {
            assert_eq!(u["Properties"]["AuthType"], "NONE");
            u["Properties"]["TargetFunctionArn"]["Ref"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(
        targets,
        BTreeSet::from([
            "ConsumerFunction".to_owned(),
            "FailureCallbackFunction".to_owned()
        ])
    );
    // Public function URLs need both permissions.
    for f in ["ConsumerFunction", "FailureCallbackFunction"] {
        for suffix in ["UrlPublicPermissions", "URLInvokeAllowPublicAccess"] {
            assert_eq!(
                cfn["Resources"][format!("{f}{suffix}")]["Type"],
                "AWS::Lambda::Permission",
                "{f}{suffix}"
            );
        }
    }
    let env = |id: &str| cfn["Resources"][id]["Properties"]["Environment"]["Variables"].clone();
    let relay = env("RelayFunction");
    assert_eq!(
        relay["CONSUMER_URL"]["Fn::If"][2],
        json!({"Fn::GetAtt": ["ConsumerFunctionUrl", "FunctionUrl"]})
    );
    assert_eq!(
        relay["CALLBACK_URL"]["Fn::If"][2],
        json!({"Fn::GetAtt": ["FailureCallbackFunctionUrl", "FunctionUrl"]})
    );
    // A receiver never references its own URL (that would be a circular dependency): it verifies against the
    // request's host, or PUBLIC_BASE_URL.
    for id in ["ConsumerFunction", "FailureCallbackFunction"] {
        let text = env(id).to_string();
        assert!(!text.contains("FunctionUrl"), "{id}: {text}");
    }
}

#[test]
fn every_environment_variable_is_read_by_the_code_and_defaults_match() {
    let cfn = translated_template();
    // A complete, valid base environment: the configs parse the same as in a deployment.
    let base: HashMap<String, String> = [
        ("CONSUMER_URL", "https://consumer.example"),
        ("CALLBACK_URL", "https://callback.example"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let configs = |env: &HashMap<String, String>| -> Result<String, ConfigError> {
        let v = Vars::new(env);
        let q = QstashConfig::from_vars(&v)?;
        let r = RelayConfig::from_vars(&v, q.retries)?;
        let c = ConsumerConfig::from_vars(&v)?;
        let d = DbConfig::from_vars(&v, "t")?;
        Ok(format!("{q:?}\n{r:?}\n{c:?}\n{d:?}"))
    };
    let snapshot = |env: &HashMap<String, String>| -> String {
        configs(env).unwrap_or_else(|e| panic!("{e}"))
    };
    let reference = snapshot(&base);
    let mut checked = BTreeMap::new();
    for (id, _, _) in FUNCTIONS {
        let vars = cfn["Resources"][id]["Properties"]["Environment"]["Variables"]
            .as_object()
            .unwrap();
        for (name, value) in vars {
            if name == SECRET_ID_VAR {
                continue; // read by outbox::secrets (checked above)
            }
            // The template's default gives the code's default...
            let default = match value.get("Ref").and_then(Value::as_str) {
                Some(param) => match param_default(&cfn, param) {
                    Value::String(s) => Some(s),
                    Value::Number(n) => Some(n.to_string()),
                    other => panic!("{param} default {other}"),
                },
                None => None, // an !If of URLs
            };
            if let Some(d) = &default {
                let mut env = base.clone();
                env.insert(name.clone(), d.clone());
                if DELIBERATE.contains(&name.as_str()) {
                    assert_ne!(
                        snapshot(&env),
                        reference,
                        "{id}: {name}={d:?} is meant to differ from the code's default but changes nothing"
                    );
                    checked.insert(name.clone(), id);
                    continue;
                }
                assert_eq!(
                    snapshot(&env),
                    reference,
                    "{id}: {name}={d:?} (the template's default) differs from the code's default"
                );
            }
            // ... and another value changes something, so the code reads the variable (no typo).
            let allowed = value["Ref"]
                .as_str()
                .and_then(|p| cfn["Parameters"][p]["AllowedValues"].as_array())
                .and_then(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .find(|v| Some(*v) != default.as_deref())
                });
            let other = match default.as_deref() {
                _ if allowed.is_some() => allowed.unwrap().to_owned(),
                Some("true") => "false".to_owned(),
                Some("false") => "true".to_owned(),
                Some(d) if d.parse::<u64>().is_ok() => (d.parse::<u64>().unwrap() + 1).to_string(),
                _ if name.ends_with("_URL") => "https://changed.example".to_owned(),
                Some("")
                    if cfn["Parameters"][value["Ref"].as_str().unwrap()]["AllowedPattern"]
                        .as_str()
                        .is_some_and(|p| p.contains("[0-9]")) =>
                {
                    "7".to_owned()
                }
                _ => "changed".to_owned(),
            };
            let mut env = base.clone();
            env.insert(name.clone(), other.clone());
            assert_ne!(
                snapshot(&env),
                reference,
                "{id}: {name}={other:?} changes no configuration: is the variable name right?"
            );
            // Every value the template lets through, the code accepts: its MinValue and MaxValue (and every
            // AllowedValue) parse.
            if let Some(param) = value["Ref"].as_str() {
                let p = &cfn["Parameters"][param];
                let mut edges: Vec<String> = ["MinValue", "MaxValue"]
                    .iter()
                    .filter_map(|k| p[*k].as_u64().map(|n| n.to_string()))
                    .collect();
                edges.extend(
                    p["AllowedValues"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|v| v.as_str().map(str::to_owned)),
                );
                for edge in edges {
                    let mut env = base.clone();
                    env.insert(name.clone(), edge.clone());
                    if let Err(e) = configs(&env) {
                        panic!(
                            "{id}: {name}={edge} passes {param}'s constraints but the code refuses it: {e}"
                        );
                    }
                }
            }
            checked.insert(name.clone(), id);
        }
    }
    // Every tunable reaches at least one function.
    for must in [
        "QSTASH_URL",
        "CONSUMER_URL",
        "CALLBACK_URL",
        "RELAY_BATCH_SIZE",
        "RELAY_LEASE_SECS",
        "RELAY_MAX_ATTEMPTS",
        "QSTASH_RETRIES",
        "PUBLIC_BASE_URL",
        "DB_MAX_CONNECTIONS",
        "SECRET_REFRESH_INTERVAL_SECS",
        "SIGNATURE_CLOCK_TOLERANCE_SECS",
        "TRUST_FORWARDED_HEADERS",
        "LEGACY_DELIVERIES",
    ] {
        assert!(
            checked.contains_key(must),
            "{must} is not set on any function"
        );
    }
}

#[test]
fn alarms_read_metrics_the_code_emits_and_notify_one_topic() {
    let cfn = translated_template();
    let alarms = of_type(&cfn, "AWS::CloudWatch::Alarm");
    for (id, a) in &alarms {
        assert_eq!(
            a["Properties"]["AlarmActions"],
            json!([{"Ref": "AlarmTopic"}]),
            "{id}"
        );
    }
    let metrics = outbox_alarm_metrics(&cfn);
    let find = |metric: &str| {
        metrics
            .iter()
            .find(|m| m.metric == metric)
            .unwrap_or_else(|| panic!("no alarm on {metric}"))
    };
    let relay = FunctionDimension::FunctionRef("RelayFunction".into());
    for m in [
        "OldestPendingAge",
        "DeadLettered",
        "BlockedKeys",
        "ConfigProblems",
    ] {
        assert_eq!(find(m).function, relay, "{m}");
    }
    assert_eq!(
        find("DeadLettersRecorded").function,
        FunctionDimension::Literal("failure-callback".into())
    );

    // The relay's metrics are the ones its EMF line carries (the receivers' are checked from their real output
    // in tests/lambda_runtime.rs).
    let summary = InvocationSummary {
        request_id: "r".into(),
        trigger: "t".into(),
        drain: Default::default(),
        housekeeping: Default::default(),
        backlog: Default::default(),
        duration_ms: 0,
    };
    let line: Value = serde_json::from_str(&emf("relay", &summary).to_json()).unwrap();
    let emitted: BTreeSet<&str> = line["_aws"]["CloudWatchMetrics"][0]["Metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["Name"].as_str().unwrap())
        .collect();
    assert_eq!(line["_aws"]["CloudWatchMetrics"][0]["Namespace"], "Outbox");
    for m in metrics.iter().filter(|m| m.function == relay) {
        assert!(
            emitted.contains(m.metric.as_str()),
            "{} reads {}, which the relay does not emit",
            m.alarm,
            m.metric
        );
    }

    // Oldest pending age: a relay that stops reporting is the failure this alarm exists for.
    let age = &cfn["Resources"][&find("OldestPendingAge").alarm]["Properties"];
    assert_eq!(age["Statistic"], "Maximum");
    assert_eq!(age["TreatMissingData"], "breaching");
    // Dead letters: any arrival, no data = none arrived.
    for m in ["DeadLettered", "DeadLettersRecorded"] {
        let p = &cfn["Resources"][&find(m).alarm]["Properties"];
        assert_eq!(p["Statistic"], "Sum", "{m}");
        assert_eq!(
            p["ComparisonOperator"], "GreaterThanOrEqualToThreshold",
            "{m}"
        );
        assert_eq!(p["Threshold"], json!({"Ref": "DeadLetterThreshold"}), "{m}");
        assert_eq!(p["TreatMissingData"], "notBreaching", "{m}");
    }
    assert_eq!(param_default(&cfn, "DeadLetterThreshold"), 1);
    // Lambda errors of each function.
    for (id, _, _) in FUNCTIONS {
        assert!(
            alarms.iter().any(|(_, a)| {
                let p = &a["Properties"];
                p["Namespace"] == "AWS/Lambda"
                    && p["MetricName"] == "Errors"
                    && p["Dimensions"][0]["Value"] == json!({"Ref": id})
            }),
            "no Errors alarm for {id}"
        );
    }
    // Optional e-mail subscription.
    assert_eq!(
        cfn["Resources"]["AlarmEmailSubscription"]["Condition"],
        "HasAlarmEmail"
    );
}

#[test]
fn outputs_give_the_urls_for_qstash() {
    let cfn = translated_template();
    let outputs = cfn["Outputs"].as_object().unwrap();
    for o in [
        "ConsumerUrl",
        "FailureCallbackUrl",
        "EventsDestination",
        "FailureCallbackEndpoint",
        "DeliveryCallbackEndpoint",
        "RelaySecretArn",
        "ReceiverSecretArn",
        "AlarmTopicArn",
    ] {
        assert!(outputs.contains_key(o), "missing output {o}");
    }
    assert!(
        !outputs.contains_key("SecretArn"),
        "the single secret's output"
    );
    for which in ["Relay", "Receiver"] {
        assert_eq!(
            cfn["Outputs"][format!("{which}SecretArn")]["Value"],
            secret_ref(which),
            "{which}"
        );
    }
    let text = cfn["Outputs"]["FailureCallbackEndpoint"].to_string();
    assert!(
        text.contains(outbox::contract::FAILURE_PATH.trim_start_matches('/')),
        "{text}"
    );
    let text = cfn["Outputs"]["DeliveryCallbackEndpoint"].to_string();
    assert!(
        text.contains(outbox::contract::DELIVERED_PATH.trim_start_matches('/')),
        "{text}"
    );
    let text = cfn["Outputs"]["EventsDestination"].to_string();
    assert!(
        text.contains(outbox::contract::EVENTS_PATH.trim_matches('/')),
        "{text}"
    );
}
