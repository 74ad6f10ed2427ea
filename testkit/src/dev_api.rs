//! The dev server's QStash API read as any QStash client reads it (bearer token, JSON): what the tests check
//! QStash's own view against (flow-control keys, their limits and pauses).

use serde_json::Value;

/// `GET {dev}{path}` with the dev server's token, as JSON; panics on a transport error or a body that is not JSON.
pub async fn get(dev: &qstash_dev::DevServer, path: &str) -> Value {
    reqwest::Client::new()
        .get(format!("{}{path}", dev.url()))
        .bearer_auth(dev.token())
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
        .json()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: not JSON: {e}"))
}
