//! `template.yaml`: cfn-lint accepts it (and the CloudFormation the SAM transform generates from it), and the
//! generated stack is what the design promises: three arm64 `provided.al2023` functions built with cargo-lambda,
//! least-privilege roles, two secrets (the relay's with the QStash token, the receivers' without it) each read by
//! its own functions only, a once-a-minute schedule with a fixed input and no retries, public function URLs for
//! the two receivers only, capped by a reserved concurrency, log groups with retention, alarms on the metrics the
//! code emits, a dashboard that shows every alarm and exactly the metrics the functions print, and parameters
//! whose defaults equal the code's defaults and whose bounds are the code's. Needs `./.venv` (`scripts/test-deps`);
//! no network, no AWS account, no database.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use outbox::ReceiverState;
use outbox::config::{
    ConfigError, ConsumerConfig, MAX_CLOCK_TOLERANCE, MIN_SECRET_REFRESH_INTERVAL, QstashConfig,
    RelayConfig, Vars,
};
use outbox::consumer::{ConsumerState, handle_event};
use outbox::db::{Db, DbConfig, Statements};
use outbox::internals::callbacks::handle_callback;
use outbox::internals::handler::{InvocationSummary, emf, subscriber_emf};
use outbox::internals::receiver::{DEV_SIGNING_KEYS, KeyRing, RECEIVER_SECRETS, SigningKeys};
use outbox::internals::secrets::{SECRET_ID_VAR, SecretField};
use outbox::ops::subscribers::SubscriberStatus;
use outbox_testkit::repo_root;
use outbox_testkit::sam::{
    FunctionDimension, MetricId, alarm_reads, dashboard_alarms, dashboard_body, dashboard_widgets,
    emf_metrics, insights, outbox_alarm_metrics, ref_placeholder, translate, translated_template,
    venv_tool,
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

/// The fields the relay loads (`shared/src/relay/handler.rs`): the database, the publishing token and every
/// subscriber's signing key.
const RELAY_SECRETS: [SecretField; 3] = [
    SecretField::DatabaseUrl,
    SecretField::QstashToken,
    SecretField::SubscriberKeys,
];

/// The fields the two receivers load, together: the consumer's and the failure callback's.
fn receiver_secrets() -> Vec<SecretField> {
    let mut fields = outbox::internals::receiver::Receiver::Consumer.secret_fields();
    for f in outbox::internals::receiver::Receiver::Callbacks.secret_fields() {
        if !fields.contains(&f) {
            fields.push(f);
        }
    }
    fields
}

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
/// `RELAY_UNORDERED_EVIDENCE`: `dedupe` for the same reason (docs/decisions/0015); the code's default follows
/// `RELAY_ORDERED_EVIDENCE`, so `callback` here.
const DELIBERATE: &[&str] = &["RELAY_ORDERED_EVIDENCE", "RELAY_UNORDERED_EVIDENCE"];

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

/// A deployment never opts into the QStash dev server's public keys and token: the template neither sets
/// `OUTBOX_ALLOW_DEV_KEYS` nor offers a parameter for it, and holds none of the public values.
#[test]
fn the_template_never_allows_the_dev_servers_public_keys() {
    let text = std::fs::read_to_string(repo_root().join("template.yaml")).unwrap();
    for needle in [
        outbox::internals::secrets::ALLOW_DEV_KEYS_VAR,
        outbox::internals::secrets::DEV_QSTASH_TOKEN,
        outbox::internals::secrets::DEV_CURRENT_SIGNING_KEY,
        outbox::internals::secrets::DEV_NEXT_SIGNING_KEY,
    ] {
        assert!(!text.contains(needle), "template.yaml contains {needle}");
    }
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
        // Managed policies: only VPC networking, and only when subnets are given; X-Ray writes only with trace
        // export on (the collector layer's pipeline; X-Ray's write actions take no resource).
        let managed = &cfn["Resources"][&role]["Properties"]["ManagedPolicyArns"];
        for m in managed.as_array().into_iter().flatten() {
            let policy = match m["Fn::If"][0].as_str() {
                Some("HasVpc") => "service-role/AWSLambdaVPCAccessExecutionRole",
                Some("TracingOn") => ":policy/AWSXRayDaemonWriteAccess",
                _ => panic!("{role}: {m}"),
            };
            assert!(
                m["Fn::If"][1]["Fn::Sub"]
                    .as_str()
                    .unwrap()
                    .ends_with(policy),
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
    let receivers = receiver_secrets();
    for (which, wanted) in [("Relay", &RELAY_SECRETS[..]), ("Receiver", &receivers[..])] {
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
    assert!(!receivers.contains(&SecretField::QstashToken));
    assert!(RECEIVER_SECRETS.iter().all(|f| receivers.contains(f)));
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
    // Every timeout the template accepts holds every lease plus every margin it accepts (the relay
    // refuses to run otherwise: RelayConfig::check_invocation_budget). CloudFormation cannot compare two
    // parameters, so the bounds do it.
    let bound = |name: &str, which: &str| {
        cfn["Parameters"][name][which]
            .as_f64()
            .unwrap_or_else(|| panic!("{name} has no {which}"))
    };
    let (min_timeout, max_lease, max_margin) = (
        bound("RelayTimeoutSeconds", "MinValue"),
        bound("RelayLeaseSecs", "MaxValue"),
        bound("RelayDeadlineMarginMs", "MaxValue") / 1000.0,
    );
    assert!(
        min_timeout >= max_lease + max_margin,
        "RelayTimeoutSeconds may be {min_timeout} s, but RelayLeaseSecs up to {max_lease} s plus \
         RelayDeadlineMarginMs up to {max_margin} s need more"
    );
    let relay = RelayConfig::from_vars(
        &Vars::new(&HashMap::from([
            ("RELAY_LEASE_SECS".to_owned(), max_lease.to_string()),
            (
                "RELAY_DEADLINE_MARGIN_MS".to_owned(),
                (max_margin * 1000.0).to_string(),
            ),
        ])),
        3,
    )
    .unwrap();
    relay
        .check_invocation_budget(Duration::from_secs_f64(min_timeout), "RelayTimeoutSeconds")
        .unwrap();
    assert!(
        relay
            .check_invocation_budget(
                Duration::from_secs_f64(min_timeout - 1.0),
                "RelayTimeoutSeconds"
            )
            .is_err(),
        "the check and the template's bounds agree to the second"
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
    // One variable changed alone may make the reconciler's settings outlive the dedupe rows (more QStash retries, a
    // later reconcile): the relay refuses that combination at start, with a message naming the fix. Such a refusal
    // is an outcome of its own (the code read the variable); any other error fails the test.
    let snapshot = |env: &HashMap<String, String>| -> String {
        match configs(env) {
            Ok(s) => s,
            Err(e @ ConfigError::ReconcilerOutlivesDedupe { .. }) => format!("refused: {e}"),
            Err(e) => panic!("{e}"),
        }
    };
    let reference = snapshot(&base);
    let mut checked = BTreeMap::new();
    for (id, _, _) in FUNCTIONS {
        let vars = cfn["Resources"][id]["Properties"]["Environment"]["Variables"]
            .as_object()
            .unwrap();
        for (name, value) in vars {
            if name == SECRET_ID_VAR {
                continue; // read by outbox::internals::secrets (checked above)
            }
            if name.starts_with("OTEL_") {
                continue; // trace export's standard variables, read by outbox::telemetry (tracing_is_off_by_default…)
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
                // A `topic:rate=n` list (RELAY_TENANT_LIMITS).
                Some("")
                    if cfn["Parameters"][value["Ref"].as_str().unwrap()]["AllowedPattern"]
                        .as_str()
                        .is_some_and(|p| p.contains("rate")) =>
                {
                    "changed:rate=1".to_owned()
                }
                // A `topic:name=url` list (OUTBOX_SUBSCRIBERS).
                Some("")
                    if cfn["Parameters"][value["Ref"].as_str().unwrap()]["AllowedPattern"]
                        .as_str()
                        .is_some_and(|p| p.contains(':') && p.contains('=')) =>
                {
                    "changed:sub=https://changed.example".to_owned()
                }
                // A `topic=n` list (RELAY_DELIVERY_BATCH_TOPICS).
                Some("")
                    if cfn["Parameters"][value["Ref"].as_str().unwrap()]["AllowedPattern"]
                        .as_str()
                        .is_some_and(|p| p.contains('=')) =>
                {
                    "changed=2".to_owned()
                }
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
                    let mut refused = configs(&env).err();
                    // The one refusal allowed: a combination the reconciler cannot keep safe (many QStash retries
                    // with the default dedupe-row lifetime). Accepted with the fixes its message names: republishing
                    // off, then the reconciler off.
                    for (fix, off) in [
                        ("RELAY_RECONCILE_MAX_REPUBLISH", "0"),
                        ("RELAY_RECONCILE_MAX_LOOKUPS", "0"),
                    ] {
                        if let Some(ConfigError::ReconcilerOutlivesDedupe { .. }) = refused {
                            env.insert(fix.to_owned(), off.to_owned());
                            refused = configs(&env).err();
                        }
                    }
                    if let Some(e) = refused {
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
        "QStashOutage",
    ] {
        assert_eq!(find(m).function, relay, "{m}");
    }
    // A QStash outage has its own alarm, not a dead-letter one: any minute with an outage recorded, five in a
    // row (the relay prints 1 every invocation while it waits).
    let outage = &cfn["Resources"][&find("QStashOutage").alarm]["Properties"];
    assert_eq!(outage["Statistic"], "Maximum");
    assert_eq!(outage["Threshold"], 1);
    assert_eq!(
        outage["ComparisonOperator"],
        "GreaterThanOrEqualToThreshold"
    );
    assert_eq!(
        find("DeadLettersRecorded").function,
        FunctionDimension::Literal("failure-callback".into())
    );

    // The relay's metrics are the ones its EMF line carries (the receivers' are checked from their real output
    // in tests/lambda_runtime.rs).
    let line = relay_emf_line("relay");
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

    // The Metrics Insights alarms read metrics the relay prints (the per-subscriber lines among them).
    let printed = printed_metrics();
    let problems = alarm_query_problems(&cfn, &printed);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // Per subscriber: the oldest pending age and blocked keys of each (topic, subscriber), one contributor each,
    // with the thresholds and windows of the relay-wide alarms. A removed subscriber stops reporting: not
    // breaching (OldestPendingAgeAlarm covers a relay that stops reporting).
    let relay_only = BTreeSet::from([insights::Filter {
        key: "Function".into(),
        equal: true,
        value: relay.clone(),
    }]);
    for (id, metric, period, threshold, operator, evaluation) in [
        (
            "SubscriberLagAlarm",
            "SubscriberOldestPendingAge",
            60,
            "OldestPendingAgeThresholdSecs",
            "GreaterThanThreshold",
            json!({"Ref": "OldestPendingAgeEvaluationMinutes"}),
        ),
        (
            "SubscriberBlockedKeysAlarm",
            "SubscriberBlockedKeys",
            300,
            "BlockedKeysThreshold",
            "GreaterThanOrEqualToThreshold",
            json!(1),
        ),
    ] {
        let reads = alarm_reads(&cfn)
            .into_iter()
            .find(|a| a.alarm == id)
            .unwrap_or_else(|| panic!("no alarm {id}"));
        assert!(reads.metrics.is_empty(), "{id}");
        assert_eq!(reads.queries.len(), 1, "{id}");
        let q = reads.queries[0].query.as_ref().unwrap();
        assert_eq!(
            (q.function.as_str(), q.metric.as_str()),
            ("MAX", metric),
            "{id}"
        );
        assert_eq!(q.filters, relay_only, "{id}");
        assert_eq!(q.group_by, ["Topic", "Subscriber"], "{id}");
        assert_eq!(q.order_by, Some(("MAX".to_owned(), true)), "{id}");
        assert_eq!(reads.queries[0].period, period, "{id}");
        let p = &cfn["Resources"][id]["Properties"];
        assert_eq!(p["Metrics"][0]["ReturnData"], true, "{id}");
        assert_eq!(p["Threshold"], json!({ "Ref": threshold }), "{id}");
        assert_eq!(p["ComparisonOperator"], operator, "{id}");
        assert_eq!(p["EvaluationPeriods"], evaluation, "{id}");
        assert_eq!(p["TreatMissingData"], "notBreaching", "{id}");
    }
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

/// Trace export (decision record 0074): one parameter, empty by default, adds the collector layer to every
/// function and sets the standard variables that turn export on; empty, neither is there.
#[test]
fn tracing_is_off_by_default_and_one_parameter_turns_it_on() {
    let cfn = translated_template();
    assert_eq!(param_default(&cfn, "TracingCollectorLayerArn"), json!(""));
    assert_eq!(
        cfn["Conditions"]["TracingOn"],
        json!({"Fn::Not": [{"Fn::Equals": [{"Ref": "TracingCollectorLayerArn"}, ""]}]})
    );
    let off = json!({"Ref": "AWS::NoValue"});
    for (id, _, _) in FUNCTIONS {
        let p = &cfn["Resources"][id]["Properties"];
        assert_eq!(
            p["Layers"],
            json!({"Fn::If": ["TracingOn", [{"Ref": "TracingCollectorLayerArn"}], off]}),
            "{id}"
        );
        let vars = &p["Environment"]["Variables"];
        assert_eq!(
            vars["OTEL_EXPORTER_OTLP_ENDPOINT"],
            json!({"Fn::If": ["TracingOn", "http://localhost:4318", off]}),
            "{id}"
        );
        assert_eq!(
            vars["OTEL_EXPORTER_OTLP_PROTOCOL"],
            json!({"Fn::If": ["TracingOn", "http/protobuf", off]}),
            "{id}"
        );
    }
    let otel: Vec<&String> = FUNCTIONS
        .iter()
        .flat_map(|(id, _, _)| {
            cfn["Resources"][id]["Properties"]["Environment"]["Variables"]
                .as_object()
                .unwrap()
                .keys()
        })
        .filter(|k| k.starts_with("OTEL_"))
        .collect();
    assert_eq!(otel.len(), 2 * FUNCTIONS.len(), "{otel:?}");
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
        text.contains(outbox::internals::contract::FAILURE_PATH.trim_start_matches('/')),
        "{text}"
    );
    let text = cfn["Outputs"]["DeliveryCallbackEndpoint"].to_string();
    assert!(
        text.contains(outbox::internals::contract::DELIVERED_PATH.trim_start_matches('/')),
        "{text}"
    );
    let text = cfn["Outputs"]["EventsDestination"].to_string();
    assert!(
        text.contains(outbox::internals::contract::EVENTS_PATH.trim_matches('/')),
        "{text}"
    );
}

/// The longest window a Metrics Insights alarm can evaluate: CloudWatch gives such an alarm the last 3 hours.
const INSIGHTS_ALARM_WINDOW_SECS: u64 = 3 * 3600;

/// What is wrong with the Metrics Insights alarms of `cfn`, given the metrics the functions print (empty:
/// nothing): a query that does not parse, reads no printed metric (a metric name, `SCHEMA` or `WHERE` value no
/// function prints) or has another [`insights::InsightsQuery::problems`]; a grouped query without `ORDER BY` (a
/// multi-time-series alarm needs one, to choose its 500 series); a window longer than 3 hours at the largest
/// `EvaluationPeriods` the template accepts.
fn alarm_query_problems(cfn: &Value, printed: &BTreeSet<MetricId>) -> Vec<String> {
    let mut problems = Vec::new();
    for alarm in alarm_reads(cfn) {
        let p = &cfn["Resources"][&alarm.alarm]["Properties"];
        for q in &alarm.queries {
            let query = match &q.query {
                Ok(query) => query,
                Err(e) => {
                    problems.push(format!("the alarm {}: {}: {e}", alarm.alarm, q.text));
                    continue;
                }
            };
            for problem in query.problems(printed) {
                problems.push(format!("the alarm {} reads {problem}", alarm.alarm));
            }
            if !query.group_by.is_empty() && query.order_by.is_none() {
                problems.push(format!(
                    "the alarm {}: {query} groups without ORDER BY",
                    alarm.alarm
                ));
            }
            let periods = match &p["EvaluationPeriods"] {
                Value::Number(n) => n.as_u64(),
                v => v["Ref"]
                    .as_str()
                    .and_then(|param| cfn["Parameters"][param]["MaxValue"].as_u64()),
            };
            match periods {
                Some(n) if n * q.period <= INSIGHTS_ALARM_WINDOW_SECS && q.period > 0 => {}
                _ => problems.push(format!(
                    "the alarm {}: {} periods of {} s may exceed the 3 hours a Metrics Insights alarm sees",
                    alarm.alarm, p["EvaluationPeriods"], q.period
                )),
            }
        }
    }
    problems
}

/// A sample end-of-run summary: every optional figure present, and a topic with two subscribers (the default one
/// and `billing`), so that the per-subscriber lines are printed too.
fn relay_summary() -> InvocationSummary {
    let subscriber = |name: &str| SubscriberStatus {
        topic: "orders".into(),
        subscriber: name.into(),
        pending: 3,
        oldest_pending_age_secs: 4.5,
        in_flight: 2,
        oldest_in_flight_age_secs: 1.0,
        blocked_keys: 0,
        dead_letters: 1,
        replaying: false,
        added_at: None,
    };
    InvocationSummary {
        request_id: "r".into(),
        trigger: "t".into(),
        database: Some(Default::default()),
        subscribers: vec![subscriber(""), subscriber("billing")],
        ..Default::default()
    }
}

/// The relay's EMF line, as its handler prints it at the end of a run (`emf` is what the handler calls) with
/// `function` as its name.
fn relay_emf_line(function: &str) -> Value {
    serde_json::from_str(&emf(function, &relay_summary()).to_json()).unwrap()
}

/// Every EMF line the relay prints at the end of a run with subscribers: [`relay_emf_line`], then one per
/// subscriber (`subscriber_emf`, which the handler calls beside `emf`).
fn relay_emf_lines(function: &str) -> Vec<Value> {
    let mut lines = vec![relay_emf_line(function)];
    lines.extend(
        subscriber_emf(function, &relay_summary())
            .iter()
            .map(|r| serde_json::from_str::<Value>(&r.to_json()).unwrap()),
    );
    assert_eq!(lines.len(), 3, "{lines:?}");
    lines
}

/// A function-URL fixture from `events/` without its `Upstash-Signature`: the receivers refuse it with 401 before
/// any database work, and still print their EMF line.
fn unsigned_request(file: &str) -> lambda_http::Request {
    let text = std::fs::read_to_string(repo_root().join("events").join(file)).unwrap();
    let mut event: Value = serde_json::from_str(&text).unwrap();
    event["headers"]
        .as_object_mut()
        .unwrap()
        .remove("upstash-signature")
        .unwrap_or_else(|| panic!("events/{file} is not signed"));
    lambda_http::request::from_str(&event.to_string()).unwrap()
}

/// The fixtures the child sends: (file, to the consumer rather than the callback function).
const RECEIVER_FIXTURES: [(&str, bool); 3] = [
    ("consumer-order-placed.json", true),
    ("failure-callback.json", false),
    ("delivery-callback.json", false),
];

/// The child of [`receivers_emf_lines`]: the consumer's and the callback function's real handlers, with metrics on
/// as in Lambda, answer unsigned requests; each prints its EMF line to stdout, which libtest does not capture here.
/// Their database pool never connects (nothing is read before the signature is verified).
#[tokio::test]
#[ignore = "run as a subprocess by receivers_emf_lines (the dashboard tests)"]
async fn child_prints_the_receivers_emf_lines() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy("postgres://nobody@127.0.0.1:9/never")
        .unwrap();
    let receiver = || {
        let keys = SigningKeys::new(DEV_SIGNING_KEYS.0, Some(DEV_SIGNING_KEYS.1.to_owned()));
        ReceiverState::new(
            ConsumerConfig::defaults(),
            Db::new(pool.clone(), Statements::Prepared),
            KeyRing::fixed(keys),
        )
    };
    let consumer = ConsumerState::new(receiver(), orders_example::registry());
    let callbacks = receiver();
    for (file, to_consumer) in RECEIVER_FIXTURES {
        let response = if to_consumer {
            handle_event(&consumer, unsigned_request(file)).await
        } else {
            handle_callback(&callbacks, unsigned_request(file)).await
        };
        assert_eq!(response.status(), 401, "{file}");
    }
}

/// The EMF lines the consumer and the callback function print (one per request), read from the stdout of this
/// test binary running [`child_prints_the_receivers_emf_lines`].
fn receivers_emf_lines() -> Vec<Value> {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            outbox_testkit::test_path(module_path!(), "child_prints_the_receivers_emf_lines")
                .as_str(),
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        // (libtest may print "test child_prints_the_receivers_emf_lines ... " in front of the first line)
        .filter_map(|l| serde_json::from_str::<Value>(&l[l.find('{')?..]).ok())
        .filter(|v| v.get("_aws").is_some())
        .collect();
    let functions: Vec<&str> = lines
        .iter()
        .filter_map(|l| l["Function"].as_str())
        .collect();
    assert_eq!(
        functions,
        ["consumer", "failure-callback", "failure-callback"],
        "{stdout}"
    );
    lines
}

/// Every metric the three functions print: the relay's line (named as Lambda names it: `AWS_LAMBDA_FUNCTION_NAME`,
/// which is `!Ref RelayFunction`) and the receivers' lines as their handlers print them.
fn printed_metrics() -> BTreeSet<MetricId> {
    let mut lines = relay_emf_lines(&ref_placeholder("RelayFunction"));
    lines.extend(receivers_emf_lines());
    let printed: BTreeSet<MetricId> = lines.iter().flat_map(emf_metrics).collect();
    assert!(printed.len() > 20, "{printed:?}");
    printed
}

/// Metric-math functions' keyword arguments (`FILL(m, REPEAT)`, `SORT(m, MAX, DESC)`, ...).
const METRIC_MATH_KEYWORDS: [&str; 9] = [
    "REPEAT", "LINEAR", "ASC", "DESC", "SUM", "AVG", "MAX", "MIN", "COUNT",
];

/// What is wrong with a metric-math `expression` of the widget `title`, whose ids are `ids`: every word must be
/// one of them, a number, a function call (an upper-case word followed by `(`) or a keyword argument. A Metrics
/// Insights query that does not start with `SELECT` (`SELEC ...`) fails here.
fn metric_math_problems(title: &str, expression: &str, ids: &BTreeSet<&str>) -> Vec<String> {
    let mut problems = Vec::new();
    let mut rest = expression;
    while let Some(start) = rest.find(|c: char| c.is_ascii_alphanumeric() || c == '_') {
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let token = &tail[..end];
        rest = &tail[end..];
        let call = rest.trim_start().starts_with('(');
        let fine = ids.contains(token)
            || token.chars().all(|c| c.is_ascii_digit() || c == '.')
            || (token.starts_with(|c: char| c.is_ascii_uppercase())
                && (call || METRIC_MATH_KEYWORDS.contains(&token)));
        if fine {
            continue;
        }
        problems.push(if token.starts_with(|c: char| c.is_ascii_lowercase()) {
            format!("{title:?}: {expression} uses {token}, no metric of the widget")
        } else {
            format!(
                "{title:?}: {expression} is neither metric math over the widget's ids nor a Metrics Insights \
                 query ({token} is no id, function or keyword)"
            )
        });
    }
    problems
}

/// What is wrong with the dashboard of `cfn`, given the metrics the functions print (empty: nothing).
///
/// * Every metric a widget draws in the `Outbox` namespace is one the functions print: same namespace, name and
///   dimension set (names and values); an `AWS/Lambda` metric has the one dimension `FunctionName` = one of the
///   template's functions. No search expressions (they would match anything). An expression is either metric
///   math over the widget's ids (every word an id, a function call or a math keyword) or a Metrics Insights query
///   ([`insights`]) that reads printed metrics: its `SCHEMA` is the whole dimension set of each metric it draws,
///   its `WHERE` holds of their values, its keys are quoted; at most one query per widget (CloudWatch runs one
///   per request).
/// * Every metric the functions print is on some widget (a query draws every printed metric it reads).
/// * Every alarm of the template is on the dashboard (an alarm widget or an alarm annotation), and is drawn on a
///   widget: its metrics at its statistic and period, or its Metrics Insights query (the same, however spelt) at
///   its period, with a horizontal line at its threshold (the same parameter, or the same number).
/// * Widgets fit the 24-column grid without overlapping; metric widgets show the stack's region.
fn dashboard_problems(cfn: &Value, printed: &BTreeSet<MetricId>) -> Vec<String> {
    let body = match dashboard_body(cfn, "Dashboard") {
        Ok(body) => body,
        Err(e) => return vec![e],
    };
    let widgets = match dashboard_widgets(&body) {
        Ok(w) => w,
        Err(e) => return vec![e],
    };
    let mut problems = Vec::new();
    let functions: BTreeSet<&str> = FUNCTIONS.iter().map(|(id, _, _)| *id).collect();
    let mut shown = BTreeSet::new();
    let mut cells = BTreeSet::new();
    for w in &widgets {
        let n = |k: &str| w.raw[k].as_u64().unwrap_or(u64::MAX / 4);
        let (x, y, width, height) = (n("x"), n("y"), n("width"), n("height"));
        if x + width > 24 {
            problems.push(format!("{:?} is wider than the grid", w.title));
        }
        for cell in
            (x..(x + width).min(24)).flat_map(|c| (y..y + height.min(100)).map(move |r| (c, r)))
        {
            if !cells.insert(cell) {
                problems.push(format!("{:?} overlaps another widget at {cell:?}", w.title));
                break;
            }
        }
        if w.kind == "metric" && w.raw["properties"]["region"] != "@AWS::Region@" {
            problems.push(format!("{:?} is not in the stack's region", w.title));
        }
        for m in &w.metrics {
            shown.insert(m.metric.clone());
            match m.metric.namespace.as_str() {
                outbox::internals::metrics::NAMESPACE => {
                    if !printed.contains(&m.metric) {
                        let same_name: Vec<String> = printed
                            .iter()
                            .filter(|p| p.name == m.metric.name)
                            .map(ToString::to_string)
                            .collect();
                        problems.push(format!(
                            "{:?} draws {}, which no function prints (printed under that name: {same_name:?})",
                            w.title, m.metric
                        ));
                    }
                }
                "AWS/Lambda" => {
                    let ours = m.metric.dimensions.len() == 1
                        && matches!(
                            m.metric.dimensions.get("FunctionName"),
                            Some(FunctionDimension::FunctionRef(id)) if functions.contains(id.as_str())
                        );
                    if !ours {
                        problems.push(format!(
                            "{:?} draws {}, which is not one of the template's functions",
                            w.title, m.metric
                        ));
                    }
                }
                _ => problems.push(format!(
                    "{:?} draws {}, from a namespace this stack does not write",
                    w.title, m.metric
                )),
            }
        }
        let ids: BTreeSet<&str> = w
            .metrics
            .iter()
            .filter_map(|m| m.id.as_deref())
            .chain(w.expressions.iter().filter_map(|(id, _)| id.as_deref()))
            .chain(w.queries.iter().filter_map(|q| q.id.as_deref()))
            .collect();
        for (_, expression) in &w.expressions {
            if expression.to_uppercase().contains("SEARCH") {
                problems.push(format!(
                    "{:?}: a search expression ({expression}) cannot be checked against the printed metrics",
                    w.title
                ));
                continue;
            }
            problems.extend(metric_math_problems(&w.title, expression, &ids));
        }
        for q in &w.queries {
            match &q.query {
                Ok(query) => {
                    shown.extend(query.reads(printed).into_iter().cloned());
                    for p in query.problems(printed) {
                        problems.push(format!("{:?} draws {p}", w.title));
                    }
                }
                Err(e) => problems.push(format!(
                    "{:?}: {} is neither metric math nor a Metrics Insights query: {e}",
                    w.title, q.text
                )),
            }
        }
        if w.queries.len() > 1 {
            problems.push(format!(
                "{:?} has {} Metrics Insights queries: a graph runs one",
                w.title,
                w.queries.len()
            ));
        }
    }
    for p in printed {
        if !shown.contains(p) {
            problems.push(format!("{p} is printed but no widget draws it"));
        }
    }

    let alarms: BTreeSet<String> = of_type(cfn, "AWS::CloudWatch::Alarm")
        .into_iter()
        .map(|(id, _)| id.clone())
        .collect();
    let on_dashboard = dashboard_alarms(&widgets);
    for a in alarms.difference(&on_dashboard) {
        problems.push(format!("the alarm {a} is not on the dashboard"));
    }
    for a in on_dashboard.difference(&alarms) {
        problems.push(format!(
            "the dashboard shows {a}, which is no alarm of the template"
        ));
    }
    for alarm in alarm_reads(cfn) {
        assert!(
            !alarm.metrics.is_empty() || !alarm.queries.is_empty(),
            "{}",
            alarm.alarm
        );
        let at_threshold = |v: &Value| match body.parameter(v) {
            Some(param) => alarm.threshold == json!({ "Ref": param }),
            None => alarm.threshold.is_number() && v.as_f64() == alarm.threshold.as_f64(),
        };
        let drawn = widgets.iter().any(|w| {
            alarm.metrics.iter().all(|a| {
                w.metrics
                    .iter()
                    .any(|m| m.metric == a.metric && m.stat == a.stat && m.period == a.period)
            }) && alarm
                .queries
                .iter()
                .all(|a| w.queries.iter().any(|q| q.same_as(a)))
                && w.thresholds.iter().any(at_threshold)
        });
        if !drawn {
            let reads: Vec<String> = alarm
                .metrics
                .iter()
                .map(|m| format!("{} ({} / {} s)", m.metric, m.stat, m.period))
                .chain(
                    alarm
                        .queries
                        .iter()
                        .map(|q| format!("{} ({} s)", q.text, q.period)),
                )
                .collect();
            problems.push(format!(
                "the alarm {} is on no widget: none draws {reads:?} with a line at its threshold {}",
                alarm.alarm, alarm.threshold
            ));
        }
    }
    problems
}

#[test]
fn the_dashboard_shows_every_alarm_and_what_the_functions_print() {
    let cfn = translated_template();
    let dashboards = of_type(&cfn, "AWS::CloudWatch::Dashboard");
    assert_eq!(dashboards.len(), 1);
    assert_eq!(dashboards[0].0, "Dashboard");
    // Named after the stack, and the region: dashboards are global to the account.
    assert_eq!(
        dashboards[0].1["Properties"]["DashboardName"],
        json!({"Fn::Sub": "${AWS::StackName}-${AWS::Region}"})
    );

    let printed = printed_metrics();
    let problems = dashboard_problems(&cfn, &printed);
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    let widgets = dashboard_widgets(&dashboard_body(&cfn, "Dashboard").unwrap()).unwrap();
    // One alarm widget with every alarm's state, at the top.
    let status: Vec<_> = widgets.iter().filter(|w| w.kind == "alarm").collect();
    assert_eq!(status.len(), 1);
    let all: BTreeSet<String> = of_type(&cfn, "AWS::CloudWatch::Alarm")
        .into_iter()
        .map(|(id, _)| id.clone())
        .collect();
    assert_eq!(
        status[0].alarms.iter().cloned().collect::<BTreeSet<_>>(),
        all
    );
    assert!(status[0].raw["y"].as_u64().unwrap() <= 2);
    // Lambda's own view of each function: errors, throttles, concurrency.
    let shown: BTreeSet<&MetricId> = widgets
        .iter()
        .flat_map(|w| w.metrics.iter().map(|m| &m.metric))
        .collect();
    for (id, _, _) in FUNCTIONS {
        for name in ["Errors", "Throttles", "ConcurrentExecutions"] {
            let metric = MetricId {
                namespace: "AWS/Lambda".into(),
                name: name.into(),
                dimensions: BTreeMap::from([(
                    "FunctionName".to_owned(),
                    FunctionDimension::FunctionRef(id.into()),
                )]),
            };
            assert!(shown.contains(&metric), "no widget draws {metric}");
        }
    }
    // Graph periods are the widgets' own (so a threshold line compares like with like).
    let body = dashboard_body(&cfn, "Dashboard").unwrap();
    assert_eq!(body.json["periodOverride"], "inherit");

    // The console link.
    let url = cfn["Outputs"]["DashboardUrl"]["Value"]["Fn::Sub"]
        .as_str()
        .expect("DashboardUrl output");
    assert_eq!(
        url,
        "https://${AWS::Region}.console.aws.amazon.com/cloudwatch/home?region=${AWS::Region}\
         #dashboards:name=${Dashboard}"
    );
}

#[test]
fn the_dashboard_check_catches_renamed_metrics_wrong_dimensions_and_missing_alarms() {
    let cfn = translated_template();
    let printed = printed_metrics();
    let body = cfn["Resources"]["Dashboard"]["Properties"]["DashboardBody"]["Fn::Sub"]
        .as_str()
        .unwrap()
        .to_owned();
    let with_body = |text: String| {
        let mut broken = cfn.clone();
        broken["Resources"]["Dashboard"]["Properties"]["DashboardBody"]["Fn::Sub"] = json!(text);
        broken
    };
    let relay =
        |name: &str| format!("\"Outbox\", \"{name}\", \"Function\", \"${{RelayFunction}}\"");
    // A subscriber widget's Metrics Insights query, as the body's JSON writes it.
    let query = |name: &str| {
        format!(
            concat!(
                r#"SELECT MAX({name}) FROM SCHEMA(\"Outbox\", \"Function\", \"Subscriber\", \"Topic\") "#,
                r#"WHERE \"Function\" = '${{RelayFunction}}' GROUP BY \"Topic\", \"Subscriber\" ORDER BY MAX() DESC"#
            ),
            name = name
        )
    };
    // The Lambda errors widget, from its title to its first metric (its period is the alarms').
    let start = body.find("Lambda: errors").unwrap();
    let errors_widget = body[start..start + body[start..].find("\"Errors\"").unwrap()].to_owned();
    assert!(errors_widget.contains("\"period\": 300"), "{errors_widget}");
    let cases: Vec<(String, String, Vec<&str>)> = vec![
        // A metric name the code does not print (and the one it prints is then missing).
        (
            relay("PublishLatencyP99"),
            relay("PublishLatencyP99Ms"),
            vec![
                "draws Outbox/PublishLatencyP99Ms {Function=!Ref RelayFunction}, which no function prints",
                "Outbox/PublishLatencyP99 {Function=!Ref RelayFunction} is printed but no widget draws it",
            ],
        ),
        // The right name without the dimension is another metric.
        (
            relay("Pending"),
            "\"Outbox\", \"Pending\"".into(),
            vec!["draws Outbox/Pending {}, which no function prints"],
        ),
        // The consumer reports a fixed name, not its function's.
        (
            "\"Outbox\", \"Applied\", \"Function\", \"consumer\"".into(),
            "\"Outbox\", \"Applied\", \"Function\", \"${ConsumerFunction}\"".into(),
            vec!["draws Outbox/Applied {Function=!Ref ConsumerFunction}, which no function prints"],
        ),
        // An alarm left off the alarm widget.
        (
            "\"${BlockedKeysAlarm.Arn}\",".into(),
            String::new(),
            vec!["the alarm BlockedKeysAlarm is not on the dashboard"],
        ),
        // A threshold line that is not the alarm's.
        (
            "(blocked keys)\", \"value\": ${BlockedKeysThreshold}".into(),
            "(blocked keys)\", \"value\": 2".into(),
            vec!["the alarm BlockedKeysAlarm is on no widget"],
        ),
        // A Metrics Insights query naming a metric no function prints (and the one it should draw is then on no
        // widget, nor is the alarm that reads it).
        (
            query("SubscriberOldestPendingAge"),
            query("SubscriberOldestPendingAge")
                .replace("MAX(SubscriberOldestPendingAge)", "MAX(SubscriberLagg)"),
            vec![
                "\"Subscribers: oldest pending copy age (s)\" draws SELECT MAX(\"SubscriberLagg\")",
                "reads no metric any function prints",
                "Outbox/SubscriberOldestPendingAge {Function=!Ref RelayFunction, Subscriber=\"billing\", \
                 Topic=\"orders\"} is printed but no widget draws it",
                "the alarm SubscriberLagAlarm is on no widget",
            ],
        ),
        // A SCHEMA without Topic is another dimension set (and groups by a key it lacks).
        (
            query("SubscriberPending"),
            query("SubscriberPending").replace(r#", \"Topic\")"#, ")"),
            vec![
                "reads no metric any function prints",
                "filters or groups by \"Topic\", which is not a key of its SCHEMA",
                "Outbox/SubscriberPending {Function=!Ref RelayFunction, Subscriber=\"billing\", \
                 Topic=\"orders\"} is printed but no widget draws it",
            ],
        ),
        // A WHERE on another function.
        (
            query("SubscriberInFlight"),
            query("SubscriberInFlight").replace("${RelayFunction}", "${ConsumerFunction}"),
            vec![
                "\"Subscribers: in flight (accepted by QStash, no outcome yet)\" draws SELECT",
                "reads no metric any function prints",
            ],
        ),
        // An unquoted key: FUNCTION is a Metrics Insights keyword.
        (
            query("SubscriberDeadLetters"),
            query("SubscriberDeadLetters").replace(r#"WHERE \"Function\""#, "WHERE Function"),
            vec!["the label keys {\"Function\"} are not in double quotes"],
        ),
        // Neither a query nor metric math.
        (
            query("SubscriberOldestInFlightAge"),
            query("SubscriberOldestInFlightAge").replace("SELECT", "SELEC"),
            vec!["is neither metric math over the widget's ids nor a Metrics Insights query"],
        ),
        // The alarm's query drawn at another period than the alarm evaluates.
        (
            format!(
                r#"{}", "id": "blocked", "period": 300"#,
                query("SubscriberBlockedKeys")
            ),
            format!(
                r#"{}", "id": "blocked", "period": 60"#,
                query("SubscriberBlockedKeys")
            ),
            vec!["the alarm SubscriberBlockedKeysAlarm is on no widget"],
        ),
        // The alarm's metric drawn at another period than the alarm evaluates.
        (
            errors_widget.clone(),
            errors_widget.replace("\"period\": 300", "\"period\": 60"),
            vec![
                "the alarm RelayErrorsAlarm is on no widget",
                "the alarm ConsumerErrorsAlarm is on no widget",
            ],
        ),
        // A search expression.
        (
            "\"expression\": \"FILL(consumer, 0) + FILL(callback, 0)\"".into(),
            "\"expression\": \"SEARCH('{Outbox,Function} RejectedSignatures', 'Sum', 300)\"".into(),
            vec!["a search expression"],
        ),
    ];
    for (from, to, expected) in cases {
        assert_eq!(body.matches(&from).count(), 1, "{from}");
        let problems = dashboard_problems(&with_body(body.replacen(&from, &to, 1)), &printed);
        for e in expected {
            assert!(
                problems.iter().any(|p| p.contains(e)),
                "{from} → {to}: no problem says {e:?}; problems:\n{}",
                problems.join("\n")
            );
        }
    }

    // A metric the code stops printing (renamed in shared/src) fails the same check.
    let renamed: BTreeSet<MetricId> = printed
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if m.name == "Dispatched" {
                m.name = "Published".into();
            }
            m
        })
        .collect();
    let problems = dashboard_problems(&cfn, &renamed);
    assert!(
        problems.iter().any(|p| p.contains(
            "draws Outbox/Dispatched {Function=!Ref RelayFunction}, which no function prints"
        )),
        "{}",
        problems.join("\n")
    );
}

/// The Metrics Insights alarms' check goes red on a query that reads no printed metric (a misspelt metric, a
/// SCHEMA missing a key, a WHERE on another function), on a grouped query without ORDER BY, on a window past 3
/// hours; and the dashboard check then finds the alarm on no widget.
#[test]
fn the_alarm_query_check_catches_wrong_metrics_schemas_and_functions() {
    let cfn = translated_template();
    let printed = printed_metrics();
    assert!(alarm_query_problems(&cfn, &printed).is_empty());
    let expression = |cfn: &Value| {
        cfn["Resources"]["SubscriberLagAlarm"]["Properties"]["Metrics"][0]["Expression"]["Fn::Sub"]
            .as_str()
            .expect("SubscriberLagAlarm's expression is a !Sub")
            .to_owned()
    };
    let original = expression(&cfn);
    let cases = [
        (
            "MAX(SubscriberOldestPendingAge)",
            "MAX(SubscriberLagg)",
            "reads SELECT MAX(\"SubscriberLagg\")",
        ),
        (
            r#""Subscriber", "Topic")"#,
            r#""Subscriber")"#,
            "reads no metric any function prints",
        ),
        (
            "${RelayFunction}",
            "${ConsumerFunction}",
            "reads no metric any function prints",
        ),
        (" ORDER BY MAX() DESC", "", "groups without ORDER BY"),
    ];
    for (from, to, says) in cases {
        assert_eq!(original.matches(from).count(), 1, "{from}");
        let mut broken = cfn.clone();
        broken["Resources"]["SubscriberLagAlarm"]["Properties"]["Metrics"][0]["Expression"]["Fn::Sub"] =
            json!(original.replacen(from, to, 1));
        let problems = alarm_query_problems(&broken, &printed);
        assert!(
            problems
                .iter()
                .any(|p| p.contains("the alarm SubscriberLagAlarm") && p.contains(says)),
            "{from} → {to}: no problem says {says:?}; problems:\n{}",
            problems.join("\n")
        );
        // Its query is no longer the one the dashboard draws.
        let problems = dashboard_problems(&broken, &printed);
        assert!(
            problems
                .iter()
                .any(|p| p.contains("the alarm SubscriberLagAlarm is on no widget")),
            "{from} → {to}:\n{}",
            problems.join("\n")
        );
    }
    // 60 one-minute periods fit the 3 hours; 200 five-minute ones would not.
    let mut broken = cfn.clone();
    broken["Resources"]["SubscriberBlockedKeysAlarm"]["Properties"]["EvaluationPeriods"] =
        json!(200);
    let problems = alarm_query_problems(&broken, &printed);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("SubscriberBlockedKeysAlarm") && p.contains("3 hours")),
        "{}",
        problems.join("\n")
    );
}
