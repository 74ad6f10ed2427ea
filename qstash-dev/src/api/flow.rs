//! Flow control: list and inspect keys, pause, resume, pin and reset them (`/v2/flowControl`), and the global
//! parallelism.

use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::request::{S, query_pairs};
use super::response::{empty_ok, ok_json};
use crate::error::ApiError;

fn flow_json(f: &crate::core::Flow) -> Value {
    let rate = f.effective_rate();
    json!({
        "flowControlKey": f.key,
        "waitListSize": f.waitlist.len(),
        "parallelismMax": f.effective_parallelism().unwrap_or(0),
        "parallelismCount": f.active,
        "rateMax": rate.map(|r| r.0).unwrap_or(0),
        "rateCount": if rate.is_some() { f.window_count } else { 0 },
        "ratePeriod": rate.map(|r| r.1.as_secs()).unwrap_or(0),
        "ratePeriodStart": f.window_start_ms,
        "isPaused": f.paused,
        "isPinnedParallelism": f.pinned_parallelism.is_some(),
        "isPinnedRate": f.pinned_rate.is_some(),
    })
}

pub(super) async fn list_flows(State(s): S, req: Request) -> Response {
    let search = query_pairs(req.uri().query())
        .into_iter()
        .find(|(k, _)| k == "search")
        .map(|(_, v)| v);
    let core = s.core();
    let list: Vec<Value> = core
        .flows
        .values()
        .filter(|f| search.as_deref().is_none_or(|q| f.key.contains(q)))
        .map(flow_json)
        .collect();
    ok_json(Value::Array(list))
}

pub(super) async fn get_flow(State(s): S, Path(key): Path<String>) -> Response {
    let core = s.core();
    match core.flows.get(&key) {
        Some(f) => ok_json(flow_json(f)),
        None => ApiError::not_found(format!("flow control key {key} not found")).into_response(),
    }
}

pub(super) async fn flow_action(
    State(s): S,
    Path((key, action)): Path<(String, String)>,
    req: Request,
) -> Response {
    let params = query_pairs(req.uri().query());
    let param = |name: &str| {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let result = s.with_core(|core, fx| -> Result<(), ApiError> {
        let flow = core
            .flows
            .entry(key.clone())
            .or_insert_with(|| crate::core::Flow::new(&key));
        match action.as_str() {
            "pause" => flow.paused = true,
            "resume" => flow.paused = false,
            "resetRate" => {
                flow.window_start = None;
                flow.window_count = 0;
            }
            "pin" => {
                if let Some(p) = param("parallelism") {
                    let p: u32 = p.parse().map_err(|_| {
                        ApiError::bad_request(format!("invalid parallelism: {p:?}"))
                    })?;
                    flow.pinned_parallelism = Some(p.max(1));
                }
                if let Some(r) = param("rate") {
                    let r: u32 = r
                        .parse()
                        .map_err(|_| ApiError::bad_request(format!("invalid rate: {r:?}")))?;
                    let period = match param("period") {
                        Some(p) => {
                            crate::duration::parse_period(&p).map_err(ApiError::bad_request)?
                        }
                        None => Duration::from_secs(1),
                    };
                    flow.pinned_rate = Some((r.max(1), period));
                }
            }
            "unpin" => {
                if param("parallelism").as_deref() == Some("true") {
                    flow.pinned_parallelism = None;
                }
                if param("rate").as_deref() == Some("true") {
                    flow.pinned_rate = None;
                }
            }
            other => {
                return Err(ApiError::not_found(format!(
                    "unknown flow-control action {other:?}"
                )));
            }
        }
        core.pump_flow(&key, fx);
        Ok(())
    });
    match result {
        Ok(()) => empty_ok(),
        Err(e) => e.into_response(),
    }
}

pub(super) async fn global_parallelism(State(s): S) -> Response {
    let (_, in_flight) = s.jobs.load();
    ok_json(json!({"parallelismMax": s.cfg.max_concurrency, "parallelismCount": in_flight}))
}
