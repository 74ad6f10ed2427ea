//! Callbacks and failure callbacks: new messages carrying the outcome of their parent's delivery.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use http::HeaderValue;
use serde_json::{Map, Value, json};

use super::clock::{MAX_WAIT, now_ms};
use super::counters::Counters;
use super::headers::{header_multimap, headermap_multimap};
use super::machine::Core;
use super::message::{Effects, MsgData};
use super::outcome::Outcome;
use crate::config::TimestampFormat;
use crate::draw::Fingerprint;
use crate::options::CallbackSpec;
use crate::types::AttemptKind;

impl Core {
    fn ts(&self, ms: u64) -> Value {
        match self.settings.callback_timestamps {
            TimestampFormat::Number => json!(ms),
            TimestampFormat::String => json!(ms.to_string()),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn spawn_callback(
        &mut self,
        parent: &Arc<MsgData>,
        spec: &CallbackSpec,
        kind: AttemptKind,
        out: &Outcome,
        retried: u32,
        max_retries: u32,
        dlq_id: Option<&str>,
        hold: Option<u64>,
        fx: &mut Effects,
    ) {
        let mut body = Map::new();
        body.insert("status".into(), json!(out.status.unwrap_or(0)));
        body.insert("header".into(), headermap_multimap(&out.headers));
        body.insert("body".into(), json!(STANDARD.encode(&out.body)));
        body.insert("retried".into(), json!(retried));
        body.insert("maxRetries".into(), json!(max_retries));
        if let Some(d) = dlq_id {
            body.insert("dlqId".into(), json!(d));
        }
        body.insert("sourceMessageId".into(), json!(parent.id.as_ref()));
        body.insert("url".into(), json!(parent.url));
        body.insert("method".into(), json!(parent.method.as_str()));
        body.insert(
            "sourceHeader".into(),
            header_multimap(parent.source_header_pairs().into_iter()),
        );
        body.insert("sourceBody".into(), json!(STANDARD.encode(&parent.body)));
        body.insert("notBefore".into(), self.ts(parent.not_before_ms));
        body.insert("createdAt".into(), self.ts(parent.created_at_ms));
        body.insert("callerIP".into(), json!(parent.caller_ip.as_ref()));
        if let Some(q) = &parent.queue {
            body.insert("queueName".into(), json!(q));
        }
        if let Some(e) = &out.error {
            body.insert("error".into(), json!(e));
        }
        let body = Bytes::from(Value::Object(body).to_string());

        let id = self.new_id();
        let created = now_ms();
        let delay = spec.delay.unwrap_or(Duration::ZERO).min(MAX_WAIT);
        let data = Arc::new(MsgData {
            id,
            kind,
            url: spec.url.clone(),
            method: spec.method.clone(),
            body,
            content_type: Some(HeaderValue::from_static("application/json")),
            forward: spec.forward.clone(),
            max_retries: spec
                .retries
                .unwrap_or(parent.max_retries)
                .min(self.settings.max_retries),
            retry_delay: spec.retry_delay.clone(),
            timeout: spec.timeout,
            created_at_ms: created,
            not_before_ms: created + u64::try_from(delay.as_millis()).unwrap_or(0),
            callback: None,
            failure_callback: None,
            flow: None,
            queue: None,
            labels: parent.labels.clone(),
            redact: None,
            caller_ip: parent.caller_ip.clone(),
            source_message_id: Some(parent.id.clone()),
            // One callback per attempt of the parent, one failure callback per parent.
            fault_id: Fingerprint::new(match kind {
                AttemptKind::Callback => b"callback".as_slice(),
                AttemptKind::FailureCallback => b"failure-callback",
                AttemptKind::Destination => b"destination",
            })
            .u64(parent.fault_id)
            .u64(u64::from(retried))
            .finish(),
        });
        if let Some(h) = hold
            && let Some(hold) = self.holds.get_mut(&h)
        {
            hold.count += 1;
        }
        Counters::inc(&self.counters.callbacks_created);
        self.insert_and_schedule(data, delay, hold, fx);
    }
}
