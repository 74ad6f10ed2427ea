//! The event the relay's schedule sends, as the Lambda runtime hands it to the handler: a scheduled-event payload
//! and a context whose deadline is the invocation's timeout from now.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lambda_runtime::{Context, LambdaEvent};
use serde_json::{Value, json};

/// Invocation `n` of a schedule from `source`, due to end `invocation` from now.
pub fn scheduled(n: u64, source: &str, invocation: Duration) -> LambdaEvent<Value> {
    let mut ctx = Context::default();
    ctx.request_id = format!("local-{n}");
    ctx.deadline = (SystemTime::now() + invocation)
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    LambdaEvent::new(
        json!({"source": source, "detail-type": "Scheduled Event"}),
        ctx,
    )
}
