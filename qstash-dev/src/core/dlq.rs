//! The dead-letter queue: moving a message there (entries keyed by `(unix ms, n)`), retention, and retrying an
//! entry as a new message.

use std::sync::Arc;
use std::time::Duration;

use super::clock::now_ms;
use super::counters::Counters;
use super::dlq_entry::DlqEntry;
use super::machine::Core;
use super::message::{Effects, MsgData};
use super::outcome::Outcome;
use crate::draw::Fingerprint;
use crate::options::PublishOptions;
use crate::types::{AttemptKind, DlqEntryInfo};

impl Core {
    fn next_dlq_key(&mut self) -> (u64, u64) {
        let ms = now_ms();
        let key = if ms > self.dlq_last.0 {
            (ms, 0)
        } else {
            (self.dlq_last.0, self.dlq_last.1 + 1)
        };
        self.dlq_last = key;
        key
    }

    pub(super) fn move_to_dlq(&mut self, id: &Arc<str>, out: &Outcome, fx: &mut Effects) {
        let Some(msg) = self.msgs.remove(id) else {
            return;
        };
        let key = self.next_dlq_key();
        let dlq_id = format!("{}-{}", key.0, key.1);
        let budget = msg.data.max_retries.saturating_add(msg.extra_budget);
        if msg.data.kind == AttemptKind::Destination
            && let Some(fcb) = &msg.data.failure_callback
        {
            self.spawn_callback(
                &msg.data,
                fcb,
                AttemptKind::FailureCallback,
                out,
                msg.retried,
                budget,
                Some(&dlq_id),
                msg.hold,
                fx,
            );
        }
        self.purge_dlq();
        self.dlq.insert(
            key,
            DlqEntry {
                dlq_id,
                data: msg.data.clone(),
                retried: msg.retried,
                max_retries: budget,
                status: out.status,
                resp_headers: out.headers.clone(),
                resp_body: out.body.clone(),
                error: out.error.clone(),
                created_ms: key.0,
            },
        );
        Counters::inc(&self.counters.failed_to_dlq);
        self.finalize(&msg.data, msg.hold, fx);
    }

    /// Drops DLQ entries older than the retention.
    pub fn purge_dlq(&mut self) {
        let retention = u64::try_from(self.settings.dlq_retention.as_millis()).unwrap_or(u64::MAX);
        let cutoff = now_ms().saturating_sub(retention);
        while let Some((&k, _)) = self.dlq.first_key_value() {
            if k.0 >= cutoff {
                break;
            }
            self.dlq.remove(&k);
        }
    }

    /// Re-publishes a DLQ entry as a new message (with `opts` overriding the stored settings where set).
    pub fn retry_dlq(
        &mut self,
        key: (u64, u64),
        opts: &PublishOptions,
        fx: &mut Effects,
    ) -> Option<Arc<str>> {
        let entry = self.dlq.remove(&key)?;
        let old = entry.data;
        let id = self.new_id();
        Counters::inc(&self.counters.accepted);
        let created = now_ms();
        let (wait, not_before_ms) = if let Some(nb) = opts.not_before {
            let nb_ms = u64::try_from(nb.saturating_mul(1000)).unwrap_or(0);
            (Duration::from_millis(nb_ms.saturating_sub(created)), nb_ms)
        } else if let Some(d) = opts.delay {
            (d, created + u64::try_from(d.as_millis()).unwrap_or(0))
        } else {
            (Duration::ZERO, created)
        };
        let data = Arc::new(MsgData {
            id: id.clone(),
            kind: old.kind,
            url: old.url.clone(),
            method: opts.method.clone().unwrap_or_else(|| old.method.clone()),
            body: old.body.clone(),
            content_type: old.content_type.clone(),
            forward: old.forward.clone(),
            max_retries: opts
                .retries
                .map(|r| r.min(self.settings.max_retries))
                .unwrap_or(old.max_retries),
            retry_delay: opts.retry_delay.clone().or_else(|| old.retry_delay.clone()),
            timeout: opts.timeout.or(old.timeout),
            created_at_ms: created,
            not_before_ms,
            callback: opts.callback.clone().or_else(|| old.callback.clone()),
            failure_callback: opts
                .failure_callback
                .clone()
                .or_else(|| old.failure_callback.clone()),
            flow: opts.flow.clone().or_else(|| old.flow.clone()),
            queue: old.queue.clone(),
            labels: if opts.labels.is_empty() {
                old.labels.clone()
            } else {
                opts.labels.clone()
            },
            redact: old.redact.clone(),
            caller_ip: old.caller_ip.clone(),
            source_message_id: old.source_message_id.clone(),
            fault_id: Fingerprint::new(b"dlq-retry").u64(old.fault_id).finish(),
        });
        if self.settings.deliver {
            self.insert_and_schedule(data, wait, None, fx);
        }
        Some(id)
    }

    pub fn dlq_infos(&self) -> Vec<DlqEntryInfo> {
        self.dlq.values().map(DlqEntry::info).collect()
    }
}
