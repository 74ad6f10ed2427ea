//! The attempt log: one record per delivery attempt, in a ring buffer capped by `attempt_log_capacity`.

use std::collections::VecDeque;
use std::time::Duration;

use http::HeaderMap;

use crate::types::DeliveryAttempt;

pub(super) struct AttemptLog {
    pub(super) buf: VecDeque<AttemptRec>,
    pub(super) seq: u64,
}

/// One logged attempt, kept cheap: the message data is shared, strings are made only when read.
pub(crate) struct AttemptRec {
    pub seq: u64,
    pub data: std::sync::Arc<crate::core::MsgData>,
    pub at_unix_ms: u64,
    pub offset: Duration,
    pub retried: u32,
    pub status: Option<u16>,
    pub error: Option<String>,
    pub headers: HeaderMap,
    pub duration: Duration,
    pub planned_delay: Duration,
    pub duplicate: bool,
}

impl AttemptRec {
    pub fn view(&self) -> DeliveryAttempt {
        let d = &self.data;
        DeliveryAttempt {
            seq: self.seq,
            at_unix_ms: self.at_unix_ms,
            offset: self.offset,
            message_id: d.id.to_string(),
            kind: d.kind,
            url: d.url.clone(),
            method: d.method.to_string(),
            retried: self.retried,
            status: self.status,
            error: self.error.clone(),
            request_headers: header_pairs(&self.headers),
            duration: self.duration,
            planned_delay: self.planned_delay,
            duplicate: self.duplicate,
            flow_control_key: d.flow.as_ref().map(|f| f.key.clone()),
            queue_name: d.queue.clone(),
            body_len: d.body.len(),
        }
    }
}

pub(crate) fn header_pairs(h: &HeaderMap) -> Vec<(String, String)> {
    h.iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}
