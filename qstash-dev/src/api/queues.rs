//! Queues: create or update, list, get, delete, pause and resume (`/v2/queues`).

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Value, json};

use super::publish::valid_queue_name;
use super::request::S;
use super::response::{empty_ok, ok_json};
use crate::core::now_ms;
use crate::error::ApiError;
use crate::state::Shared;

fn queue_json(q: &crate::core::Queue) -> Value {
    json!({
        "name": q.name,
        "createdAt": q.created_at_ms,
        "updatedAt": q.updated_at_ms,
        "parallelism": q.parallelism,
        "paused": q.paused,
        "lag": q.waitlist.len(),
    })
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct UpsertQueue {
    queue_name: Option<String>,
    parallelism: Option<u32>,
    paused: Option<bool>,
}

pub(super) async fn upsert_queue(State(s): S, body: Bytes) -> Response {
    let req: UpsertQueue = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return ApiError::bad_request(format!("invalid body: {e}")).into_response(),
    };
    let Some(name) = req.queue_name.filter(|n| valid_queue_name(n)) else {
        return ApiError::bad_request(
            "invalid queueName: only alphanumerics, '-', '_' and '.' are allowed",
        )
        .into_response();
    };
    let parallelism = req.parallelism.unwrap_or(1).max(1);
    s.with_core(|core, fx| {
        let now = now_ms();
        let q = core
            .queues
            .entry(name.clone())
            .or_insert_with(|| crate::core::Queue {
                name: name.clone(),
                created_at_ms: now,
                updated_at_ms: now,
                parallelism,
                paused: false,
                waitlist: Default::default(),
                active: 0,
            });
        q.parallelism = parallelism;
        q.paused = req.paused.unwrap_or(false);
        q.updated_at_ms = now;
        core.pump_queue(&name, fx);
    });
    empty_ok()
}

pub(super) async fn list_queues(State(s): S) -> Response {
    let core = s.core();
    ok_json(Value::Array(core.queues.values().map(queue_json).collect()))
}

pub(super) async fn get_queue(State(s): S, Path(name): Path<String>) -> Response {
    let core = s.core();
    match core.queues.get(&name) {
        Some(q) => ok_json(queue_json(q)),
        None => ApiError::not_found(format!("queue {name} not found")).into_response(),
    }
}

pub(super) async fn delete_queue(State(s): S, Path(name): Path<String>) -> Response {
    let found = s.with_core(|core, fx| {
        let Some(q) = core.queues.remove(&name) else {
            return false;
        };
        for id in q.waitlist {
            core.cancel(&id, fx);
        }
        true
    });
    if found {
        empty_ok()
    } else {
        ApiError::not_found(format!("queue {name} not found")).into_response()
    }
}

fn set_queue_paused(s: &Shared, name: &str, paused: bool) -> Response {
    let found = s.with_core(|core, fx| {
        let Some(q) = core.queues.get_mut(name) else {
            return false;
        };
        q.paused = paused;
        q.updated_at_ms = now_ms();
        if !paused {
            core.pump_queue(name, fx);
        }
        true
    });
    if found {
        empty_ok()
    } else {
        ApiError::not_found(format!("queue {name} not found")).into_response()
    }
}

pub(super) async fn pause_queue(State(s): S, Path(name): Path<String>) -> Response {
    set_queue_paused(&s, &name, true)
}

pub(super) async fn resume_queue(State(s): S, Path(name): Path<String>) -> Response {
    set_queue_paused(&s, &name, false)
}
