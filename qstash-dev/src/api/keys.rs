//! Signing keys: read and rotate (`/v2/keys`).

use axum::extract::State;
use axum::response::Response;
use serde_json::json;

use super::request::S;
use super::response::ok_json;

pub(super) async fn get_keys(State(s): S) -> Response {
    let k = s.signing_keys();
    ok_json(json!({"current": k.current, "next": k.next}))
}

pub(super) async fn rotate_keys(State(s): S) -> Response {
    let k = s.rotate_keys();
    ok_json(json!({"current": k.current, "next": k.next}))
}
