//! [`Core`], the state machine's state, and its main path: publish (dedup, store), schedule, due, through the
//! queue and flow-control waitlists to a worker; cancel; the timer heap. The other operations are in files of
//! their own (`waitlists.rs`, `outcome.rs`, `callbacks.rs`, `dlq.rs`).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http::Method;
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::time::Instant;

use super::clock::{MAX_WAIT, now_ms};
use super::counters::Counters;
use super::dedup::{Dedup, content_dedup_key};
use super::dlq_entry::DlqEntry;
use super::flow::Flow;
use super::ids::IdGen;
use super::message::{Accepted, Effects, Msg, MsgData, MsgState, NewMessage};
use super::queue::{Hold, Queue};
use super::settings::Settings;
use super::timers::{TimerEntry, TimerKind};
use crate::config::Config;
use crate::draw::{Fingerprint, Occurrences};
use crate::types::AttemptKind;

/// Message identities whose count [`Core`] keeps for fault ids (see [`Occurrences`]).
const IDENTITIES_KEPT: usize = 1 << 18;

pub(crate) struct Core {
    pub settings: Settings,
    pub counters: Arc<Counters>,
    pub msgs: HashMap<Arc<str>, Msg>,
    dedup: Dedup,
    pub dlq: BTreeMap<(u64, u64), DlqEntry>,
    pub(super) dlq_last: (u64, u64),
    pub queues: BTreeMap<String, Queue>,
    pub flows: BTreeMap<String, Flow>,
    timers: BinaryHeap<Reverse<TimerEntry>>,
    timer_seq: u64,
    pub(super) holds: HashMap<u64, Hold>,
    pub(super) hold_seq: u64,
    pub(super) rng: StdRng,
    ids: IdGen,
    /// How many messages with each identity were published (the `n` of their fault ids).
    identities: Occurrences,
}

impl Core {
    pub fn new(cfg: &Config, counters: Arc<Counters>) -> Core {
        Core {
            settings: Settings::from_config(cfg),
            counters,
            msgs: HashMap::new(),
            dedup: Dedup::new(),
            dlq: BTreeMap::new(),
            dlq_last: (0, 0),
            queues: BTreeMap::new(),
            flows: BTreeMap::new(),
            timers: BinaryHeap::new(),
            timer_seq: 0,
            holds: HashMap::new(),
            hold_seq: 0,
            rng: StdRng::seed_from_u64(cfg.seed),
            ids: IdGen::new(),
            identities: Occurrences::new(IDENTITIES_KEPT),
        }
    }

    /// Forgets everything (messages, DLQ, queues, flow keys, dedup ids). In-flight requests finish but
    /// their results are ignored.
    pub fn reset(&mut self, seed: u64) {
        for m in self.msgs.values() {
            m.cancel.store(true, Ordering::Relaxed);
        }
        self.msgs.clear();
        self.dedup = Dedup::new();
        self.dlq.clear();
        self.queues.clear();
        self.flows.clear();
        self.timers.clear();
        self.holds.clear();
        self.rng = StdRng::seed_from_u64(seed);
        self.identities.clear();
    }

    pub fn new_id(&mut self) -> Arc<str> {
        self.ids.next()
    }

    /// Publishes one validated message (dedup, store, schedule).
    pub fn publish(&mut self, item: NewMessage, fx: &mut Effects) -> Accepted {
        let now = Instant::now();
        let dedup_key = if let Some(id) = &item.opts.dedup_id {
            Some(self.dedup.key(b"id\0", id.as_bytes()))
        } else if item.opts.content_based_dedup {
            let digest = content_dedup_key(&item.url, &item.body, &item.opts);
            Some(self.dedup.key(b"content\0", &digest))
        } else {
            None
        };
        if let Some(k) = dedup_key {
            self.dedup.purge(now);
            if let Some(existing) = self.dedup.lookup(k, now) {
                Counters::inc(&self.counters.deduplicated);
                return Accepted {
                    message_id: existing,
                    deduplicated: true,
                };
            }
        }
        let id = self.new_id();
        Counters::inc(&self.counters.accepted);
        if let Some(k) = dedup_key {
            self.dedup
                .insert(k, id.clone(), now + self.settings.dedup_window);
        }
        if self.settings.deliver {
            self.insert_published(id.clone(), item, fx);
        }
        Accepted {
            message_id: id,
            deduplicated: false,
        }
    }

    fn insert_published(&mut self, id: Arc<str>, item: NewMessage, fx: &mut Effects) {
        let created = now_ms();
        let NewMessage {
            url,
            body,
            opts,
            queue,
            caller_ip,
            identity,
        } = item;
        let n = self.identities.next(identity);
        let fault_id = Fingerprint::new(b"message")
            .u64(identity)
            .u64(u64::from(n))
            .finish();
        let (wait, not_before_ms) = if let Some(nb) = opts.not_before {
            let nb_ms = u64::try_from(nb.saturating_mul(1000)).unwrap_or(0);
            (Duration::from_millis(nb_ms.saturating_sub(created)), nb_ms)
        } else if let Some(d) = opts.delay {
            let d = d.min(MAX_WAIT);
            (d, created + u64::try_from(d.as_millis()).unwrap_or(0))
        } else {
            (Duration::ZERO, created)
        };
        let max_retries = opts
            .retries
            .unwrap_or(self.settings.default_retries)
            .min(self.settings.max_retries);
        let data = Arc::new(MsgData {
            id: id.clone(),
            kind: AttemptKind::Destination,
            url,
            method: opts.method.unwrap_or(Method::POST),
            body,
            content_type: opts.content_type,
            forward: opts.forward,
            max_retries,
            retry_delay: opts.retry_delay,
            timeout: opts.timeout,
            created_at_ms: created,
            not_before_ms,
            callback: opts.callback,
            failure_callback: opts.failure_callback,
            flow: opts.flow,
            queue,
            labels: opts.labels,
            redact: opts.redact,
            caller_ip,
            source_message_id: None,
            fault_id,
        });
        self.insert_and_schedule(data, wait, None, fx);
    }

    pub(super) fn insert_and_schedule(
        &mut self,
        data: Arc<MsgData>,
        wait: Duration,
        hold: Option<u64>,
        fx: &mut Effects,
    ) {
        let id = data.id.clone();
        if let Some(spec) = &data.flow {
            self.flows
                .entry(spec.key.clone())
                .or_insert_with(|| Flow::new(&spec.key))
                .join(spec);
        }
        if let Some(q) = &data.queue
            && !self.queues.contains_key(q)
        {
            let now = now_ms();
            self.queues.insert(
                q.clone(),
                Queue {
                    name: q.clone(),
                    created_at_ms: now,
                    updated_at_ms: now,
                    parallelism: 1,
                    paused: false,
                    waitlist: VecDeque::new(),
                    active: 0,
                },
            );
        }
        self.msgs.insert(
            id.clone(),
            Msg {
                data,
                retried: 0,
                extra_budget: 0,
                state: MsgState::Scheduled,
                hold,
                planned_delay: wait,
                cancel: Arc::new(AtomicBool::new(false)),
            },
        );
        let scaled = self.settings.scaled(wait);
        if scaled.is_zero() {
            self.make_due(&id, fx);
        } else {
            self.add_timer(Instant::now() + scaled, TimerKind::Due(id), fx);
        }
    }

    pub(super) fn make_due(&mut self, id: &Arc<str>, fx: &mut Effects) {
        let Some(msg) = self.msgs.get_mut(id) else {
            return;
        };
        if let (Some(q), None) = (&msg.data.queue, msg.hold) {
            let q = q.clone();
            msg.state = MsgState::WaitingQueue;
            if let Some(queue) = self.queues.get_mut(&q) {
                queue.waitlist.push_back(id.clone());
            }
            self.pump_queue(&q, fx);
            return;
        }
        self.after_queue(id, fx);
    }

    pub(super) fn after_queue(&mut self, id: &Arc<str>, fx: &mut Effects) {
        let Some(msg) = self.msgs.get_mut(id) else {
            return;
        };
        if let Some(spec) = &msg.data.flow {
            let key = spec.key.clone();
            msg.state = MsgState::WaitingFlow;
            self.flows
                .entry(key.clone())
                .or_insert_with(|| Flow::new(&key))
                .waitlist
                .push_back(id.clone());
            self.pump_flow(&key, fx);
        } else {
            msg.state = MsgState::Ready;
            fx.jobs.push(msg.job());
        }
    }

    /// Bookkeeping once a message has left `msgs` for good.
    pub(super) fn finalize(&mut self, data: &MsgData, hold: Option<u64>, fx: &mut Effects) {
        if let Some(spec) = &data.flow
            && let Some(f) = self.flows.get_mut(&spec.key)
        {
            f.leave(spec);
        }
        if let Some(h) = hold {
            self.release_hold(h, fx);
        }
    }

    /// Cancels a live message. Returns whether it existed.
    pub fn cancel(&mut self, id: &str, fx: &mut Effects) -> bool {
        let Some(msg) = self.msgs.get(id) else {
            return false;
        };
        Counters::inc(&self.counters.cancelled);
        if msg.state == MsgState::Ready {
            // A worker has it (queued or in flight): it finalizes when the attempt returns.
            msg.cancel.store(true, Ordering::Relaxed);
            return true;
        }
        if let Some(msg) = self.msgs.remove(id) {
            msg.cancel.store(true, Ordering::Relaxed);
            self.finalize(&msg.data, msg.hold, fx);
        }
        true
    }

    /// Live message ids matching `pred`.
    pub fn find_messages(&self, pred: impl Fn(&MsgData) -> bool) -> Vec<Arc<str>> {
        self.msgs
            .iter()
            .filter(|(_, m)| pred(&m.data))
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Live messages: (total, not yet handed to a worker).
    pub fn counts(&self) -> (usize, usize) {
        let waiting = self
            .msgs
            .values()
            .filter(|m| m.state != MsgState::Ready)
            .count();
        (self.msgs.len(), waiting)
    }

    pub(super) fn add_timer(&mut self, at: Instant, kind: TimerKind, fx: &mut Effects) {
        if self.timers.peek().is_none_or(|Reverse(t)| at < t.at) {
            fx.wake_timer = true;
        }
        self.timer_seq += 1;
        self.timers.push(Reverse(TimerEntry {
            at,
            seq: self.timer_seq,
            kind,
        }));
    }

    /// Runs due timers; returns the next deadline.
    pub fn fire_timers(&mut self, now: Instant, fx: &mut Effects) -> Option<Instant> {
        while let Some(Reverse(top)) = self.timers.peek() {
            if top.at > now {
                break;
            }
            let Some(Reverse(entry)) = self.timers.pop() else {
                break;
            };
            match entry.kind {
                TimerKind::Due(id) => {
                    if matches!(self.msgs.get(&id), Some(m) if m.state == MsgState::Scheduled) {
                        self.make_due(&id, fx);
                    }
                }
                TimerKind::FlowWindow(key) => {
                    if let Some(f) = self.flows.get_mut(&key) {
                        f.window_armed = false;
                    }
                    self.pump_flow(&key, fx);
                }
            }
        }
        self.timers.peek().map(|Reverse(t)| t.at)
    }
}
