//! The result of one attempt and what follows from it: success, a retry after a backoff, or the DLQ.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::counters::Counters;
use super::machine::Core;
use super::message::{Effects, Job, MsgState};
use super::timers::TimerKind;
use crate::expr::RetryDelayExpr;
use crate::types::AttemptKind;

/// Retry-After values above this are ignored (documented: more than one day).
pub(crate) const RETRY_AFTER_MAX: Duration = Duration::from_secs(86_400);
/// Cap for the default backoff and for Retry-Delay expressions.
const MAX_BACKOFF: Duration = Duration::from_secs(86_400);

/// What happened to one attempt.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    pub status: Option<u16>,
    pub headers: http::HeaderMap,
    pub body: Bytes,
    pub error: Option<String>,
    pub retry_after: Option<Duration>,
    pub non_retryable: bool,
    /// Cancelled before anything was sent.
    pub skipped: bool,
}

impl Outcome {
    pub fn success(&self) -> bool {
        self.error.is_none() && matches!(self.status, Some(s) if (200..300).contains(&s))
    }
}

impl Core {
    fn backoff(&self, next_retried: u32, expr: Option<&RetryDelayExpr>) -> Duration {
        match expr {
            Some(e) => e.delay(next_retried.saturating_sub(1), MAX_BACKOFF),
            None => {
                let secs = (2.5 * f64::from(next_retried)).exp().min(86_400.0);
                Duration::try_from_secs_f64(secs).unwrap_or(MAX_BACKOFF)
            }
        }
    }

    /// Applies the result of one attempt.
    pub fn on_done(&mut self, job: &Job, out: Outcome, duplicate: bool, fx: &mut Effects) {
        if let Some(spec) = &job.data.flow
            && let Some(f) = self.flows.get_mut(&spec.key)
        {
            f.active = f.active.saturating_sub(1);
        }
        self.apply_outcome(job, out, duplicate, fx);
        if let Some(spec) = &job.data.flow {
            self.pump_flow(&spec.key, fx);
        }
    }

    fn apply_outcome(&mut self, job: &Job, out: Outcome, duplicate: bool, fx: &mut Effects) {
        let id = &job.data.id;
        let Some(msg) = self.msgs.get_mut(id) else {
            return;
        };
        let data = msg.data.clone();
        let retried = msg.retried;
        let hold = msg.hold;
        let budget = data.max_retries.saturating_add(msg.extra_budget);
        let cancelled = msg.cancel.load(Ordering::Relaxed);
        msg.state = MsgState::Scheduled;

        if !out.skipped
            && data.kind == AttemptKind::Destination
            && let Some(cb) = &data.callback
        {
            self.spawn_callback(
                &data,
                cb,
                AttemptKind::Callback,
                &out,
                retried,
                budget,
                None,
                hold,
                fx,
            );
        }
        if out.success() {
            Counters::inc(&self.counters.delivered);
            if duplicate {
                Counters::inc(&self.counters.duplicate_deliveries);
                fx.jobs.push(Job {
                    data: data.clone(),
                    retried,
                    planned_delay: Duration::ZERO,
                    duplicate: true,
                    cancel: Arc::new(AtomicBool::new(false)),
                });
            }
            self.msgs.remove(id);
            self.finalize(&data, hold, fx);
            return;
        }
        if cancelled {
            self.msgs.remove(id);
            self.finalize(&data, hold, fx);
            return;
        }
        if out.non_retryable || retried >= budget {
            self.move_to_dlq(id, &out, fx);
            return;
        }
        let next = retried + 1;
        let (delay, via_retry_after) = match out.retry_after {
            Some(d) if d <= RETRY_AFTER_MAX => (d, true),
            _ => (self.backoff(next, data.retry_delay.as_deref()), false),
        };
        let consumes = self.settings.retry_after_consumes_retry;
        let scaled = self.settings.scaled(delay);
        if let Some(msg) = self.msgs.get_mut(id) {
            if via_retry_after && !consumes {
                msg.extra_budget += 1;
            }
            msg.retried = next;
            msg.planned_delay = delay;
            msg.state = MsgState::Scheduled;
        }
        if scaled.is_zero() {
            self.make_due(id, fx);
        } else {
            self.add_timer(Instant::now() + scaled, TimerKind::Due(id.clone()), fx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn default_backoff_shape() {
        let core = Core::new(&Config::default(), Arc::new(Counters::default()));
        let secs: Vec<u64> = (1..=6).map(|n| core.backoff(n, None).as_secs()).collect();
        assert_eq!(secs, vec![12, 148, 1808, 22026, 86400, 86400]);
        let e = RetryDelayExpr::parse("1000 * (1 + retried)").unwrap();
        assert_eq!(core.backoff(1, Some(&e)), Duration::from_secs(1));
        assert_eq!(core.backoff(3, Some(&e)), Duration::from_secs(3));
        let neg = RetryDelayExpr::parse("-5").unwrap();
        assert_eq!(core.backoff(1, Some(&neg)), Duration::ZERO);
    }
}
