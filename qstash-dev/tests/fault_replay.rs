//! Reproducible fault injection (decision record 0114): a seed replays the same faults per message, whatever
//! the concurrency and timing of the run, and another seed draws other faults.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use qstash_dev::{AttemptKind, Faults};
use serde_json::{Value, json};
use tokio::sync::Semaphore;

/// Single publishes `m-00` … and batches of two `b-00`, `b-01` …: every message has a deduplication id.
const SINGLES: usize = 24;
const BATCHES: usize = 8;

/// What happened to one message: the answers to its publish requests (for a batch item, the batch's), and its
/// delivery attempts by `Upstash-Retried` (`d` marks an injected duplicate) and outcome.
#[derive(Debug, Default, PartialEq, Eq)]
struct Fate {
    publish: Vec<&'static str>,
    deliveries: Vec<String>,
}

/// One publish-type request of the workload.
struct Request {
    /// The deduplication ids of its messages (one, or a batch's).
    names: Vec<String>,
    path: String,
    headers: Vec<(String, String)>,
    body: String,
}

#[derive(Clone, Copy)]
enum Schedule {
    /// One request at a time, in order; the destination answers at once.
    Sequential,
    /// Eight requests at a time, in reverse order; the destination answers after a few milliseconds that vary
    /// by message, so deliveries and publishes interleave differently.
    Concurrent,
}

/// Sends one publish-type request until it is answered 2xx, recording each answer. Returns the 2xx body.
async fn until_accepted(
    api: &Api,
    path: &str,
    headers: &[(&str, &str)],
    body: String,
    answers: &mut Vec<&'static str>,
) -> Value {
    for _ in 0..200 {
        let mut r = api.req(reqwest::Method::POST, path).body(body.clone());
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        match r.send().await {
            Err(_) => answers.push("dropped"),
            Ok(resp) if resp.status() == 500 => answers.push("5xx"),
            Ok(resp) => {
                let status = resp.status().as_u16();
                assert!(status == 200 || status == 202, "publish answered {status}");
                answers.push("accepted");
                return resp.json().await.expect("JSON answer");
            }
        }
    }
    panic!("{path}: not accepted after 200 tries: {answers:?}");
}

async fn run(seed: u64, schedule: Schedule) -> BTreeMap<String, Fate> {
    let sink = match schedule {
        Schedule::Sequential => Sink::start().await,
        Schedule::Concurrent => {
            Sink::with(|r, _| {
                let ms = r.body.iter().map(|b| u64::from(*b)).sum::<u64>() % 7;
                Reply::ok().delay(Duration::from_millis(ms))
            })
            .await
        }
    };
    let server = server(0.001, |c| {
        c.seed = seed;
        c.faults = Faults {
            publish_5xx_rate: 0.3,
            publish_drop_response_rate: 0.2,
            duplicate_delivery_rate: 0.3,
            delivery_network_error_rate: 0.2,
            delivery_lost_response_rate: 0.2,
            ..Default::default()
        };
    })
    .await;
    let api = Arc::new(Api::new(&server));
    let dest = sink.url("/replay");

    let mut jobs: Vec<Request> = Vec::new();
    for i in 0..SINGLES {
        let name = format!("m-{i:02}");
        jobs.push(Request {
            names: vec![name.clone()],
            path: format!("/v2/publish/{dest}"),
            headers: vec![
                ("Upstash-Deduplication-Id".into(), name.clone()),
                ("Upstash-Retries".into(), "3".into()),
                ("Upstash-Retry-Delay".into(), "0".into()),
            ],
            body: name,
        });
    }
    for b in 0..BATCHES {
        let names: Vec<String> = (0..2).map(|k| format!("b-{:02}", 2 * b + k)).collect();
        let items: Vec<Value> = names
            .iter()
            .map(|n| {
                json!({
                    "destination": dest,
                    "headers": {
                        "Upstash-Deduplication-Id": n,
                        "Upstash-Retries": "3",
                        "Upstash-Retry-Delay": "0",
                    },
                    "body": n,
                })
            })
            .collect();
        jobs.push(Request {
            names,
            path: "/v2/batch".into(),
            headers: vec![("Content-Type".into(), "application/json".into())],
            body: Value::Array(items).to_string(),
        });
    }
    let concurrency = match schedule {
        Schedule::Sequential => 1,
        Schedule::Concurrent => {
            jobs.reverse();
            8
        }
    };

    let gate = Arc::new(Semaphore::new(concurrency));
    let mut tasks = Vec::new();
    for Request {
        names,
        path,
        headers,
        body,
    } in jobs
    {
        let permit = gate.clone().acquire_owned().await.unwrap();
        let api = api.clone();
        tasks.push(tokio::spawn(async move {
            let headers: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let mut answers = Vec::new();
            let v = until_accepted(&api, &path, &headers, body, &mut answers).await;
            drop(permit);
            let ids: Vec<String> = match v {
                Value::Array(items) => items
                    .iter()
                    .map(|i| i["messageId"].as_str().unwrap().to_string())
                    .collect(),
                v => vec![v["messageId"].as_str().unwrap().to_string()],
            };
            assert_eq!(ids.len(), names.len());
            (names, ids, answers)
        }));
    }

    let mut fates: BTreeMap<String, Fate> = BTreeMap::new();
    let mut name_of: BTreeMap<String, String> = BTreeMap::new();
    for t in tasks {
        let (names, ids, answers) = t.await.unwrap();
        for (name, id) in names.into_iter().zip(ids) {
            name_of.insert(id, name.clone());
            fates.entry(name).or_default().publish = answers.clone();
        }
    }
    server.handle().wait_idle(WAIT).await.unwrap();
    for a in server.handle().attempts() {
        assert_eq!(a.kind, AttemptKind::Destination);
        let name = &name_of[&a.message_id];
        let outcome = match (&a.error, a.status) {
            (Some(e), _) if e.contains("network error") => "net".to_string(),
            (Some(e), _) if e.contains("response lost") => "lost".to_string(),
            (Some(e), _) => panic!("unexpected delivery error: {e}"),
            (None, Some(s)) => s.to_string(),
            (None, None) => panic!("an attempt with neither status nor error"),
        };
        let dup = if a.duplicate { "d" } else { "" };
        fates
            .get_mut(name)
            .unwrap()
            .deliveries
            .push(format!("{}{dup}:{outcome}", a.retried));
    }
    for f in fates.values_mut() {
        f.deliveries.sort();
    }
    server.shutdown().await;
    fates
}

fn count(fates: &BTreeMap<String, Fate>, what: &str) -> usize {
    fates
        .values()
        .map(|f| {
            f.publish.iter().filter(|p| **p == what).count()
                + f.deliveries.iter().filter(|d| d.contains(what)).count()
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_replays_the_same_faults_per_message_under_any_schedule() {
    let seed = 42;
    let one = run(seed, Schedule::Sequential).await;
    assert_eq!(one.len(), SINGLES + 2 * BATCHES);
    // The workload is rich enough that every kind of fault hit some message.
    for what in ["5xx", "dropped", "net", "lost", "d:"] {
        assert!(count(&one, what) > 0, "no {what:?} in {one:#?}");
    }
    let other = run(seed, Schedule::Concurrent).await;
    let differ: Vec<&String> = one
        .keys()
        .filter(|k| one.get(*k) != other.get(*k))
        .collect();
    assert!(
        differ.is_empty(),
        "seed {seed}: messages {differ:?} saw other faults under another schedule:\n{:#?}\nvs\n{:#?}",
        differ.iter().map(|k| &one[*k]).collect::<Vec<_>>(),
        differ.iter().map(|k| &other[*k]).collect::<Vec<_>>(),
    );
    let reseeded = run(seed + 1, Schedule::Sequential).await;
    assert_ne!(one, reseeded, "another seed must draw other faults");
}
