//! A dead-letter queue entry, and the DLQ id (`"<unix ms>-<n>"`) that names it.

use std::sync::Arc;

use bytes::Bytes;

use super::message::MsgData;
use crate::types::DlqEntryInfo;

pub(crate) struct DlqEntry {
    pub dlq_id: String,
    pub data: Arc<MsgData>,
    pub retried: u32,
    pub max_retries: u32,
    pub status: Option<u16>,
    pub resp_headers: http::HeaderMap,
    pub resp_body: Bytes,
    pub error: Option<String>,
    pub created_ms: u64,
}

impl DlqEntry {
    pub fn info(&self) -> DlqEntryInfo {
        DlqEntryInfo {
            dlq_id: self.dlq_id.clone(),
            message_id: self.data.id.to_string(),
            kind: self.data.kind,
            url: self.data.url.clone(),
            method: self.data.method.to_string(),
            body: self.data.body.to_vec(),
            retried: self.retried,
            max_retries: self.max_retries,
            response_status: self.status,
            response_body: self.resp_body.to_vec(),
            error: self.error.clone(),
            created_at_unix_ms: self.created_ms,
            queue_name: self.data.queue.clone(),
            flow_control_key: self.data.flow.as_ref().map(|f| f.key.clone()),
            labels: self.data.labels.clone(),
        }
    }
}

/// Parses a DLQ id `"<ms>-<n>"` into its ordering key.
pub(crate) fn parse_dlq_id(s: &str) -> Option<(u64, u64)> {
    let (a, b) = s.split_once('-')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}
