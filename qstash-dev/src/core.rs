//! The message state machine: publish, dedup, delay, queues, flow control, retries, callbacks, DLQ.
//!
//! Everything here runs under one mutex and never awaits. Operations report follow-up work in [`Effects`]
//! (deliveries to start, whether the timer task must re-check its deadline); the caller applies them after
//! releasing the lock. Pending messages cost only their record: waits are entries in one timer heap, and HTTP
//! requests are made by a fixed pool of workers (see `deliver.rs`).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::config::{Config, TimestampFormat, WaitlistOrder};
use crate::expr::RetryDelayExpr;
use crate::options::{CallbackSpec, FlowSpec, PublishOptions};
use crate::types::{AttemptKind, DlqEntryInfo};

/// Longest wait we schedule (keeps `Instant` arithmetic far from overflow).
const MAX_WAIT: Duration = Duration::from_secs(400 * 86_400);
/// Retry-After values above this are ignored (documented: more than one day).
pub(crate) const RETRY_AFTER_MAX: Duration = Duration::from_secs(86_400);
/// Cap for the default backoff and for Retry-Delay expressions.
const MAX_BACKOFF: Duration = Duration::from_secs(86_400);

pub(crate) fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

pub(crate) fn now_ms() -> u64 {
    unix_ms(SystemTime::now())
}

/// Counters shared between the core and the HTTP layer.
#[derive(Default)]
pub(crate) struct Counters {
    pub publish_requests: AtomicU64,
    pub accepted: AtomicU64,
    pub deduplicated: AtomicU64,
    pub rejected: AtomicU64,
    pub delivered: AtomicU64,
    pub failed_to_dlq: AtomicU64,
    pub attempts: AtomicU64,
    pub callbacks_created: AtomicU64,
    pub cancelled: AtomicU64,
    pub duplicate_deliveries: AtomicU64,
    pub injected_publish_errors: AtomicU64,
    pub injected_dropped_responses: AtomicU64,
}

impl Counters {
    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
    pub fn reset(&self) {
        for c in [
            &self.publish_requests,
            &self.accepted,
            &self.deduplicated,
            &self.rejected,
            &self.delivered,
            &self.failed_to_dlq,
            &self.attempts,
            &self.callbacks_created,
            &self.cancelled,
            &self.duplicate_deliveries,
            &self.injected_publish_errors,
            &self.injected_dropped_responses,
        ] {
            c.store(0, Ordering::Relaxed);
        }
    }
}

/// Immutable part of a message.
#[derive(Debug)]
pub(crate) struct MsgData {
    pub id: Arc<str>,
    pub kind: AttemptKind,
    pub url: String,
    pub method: Method,
    pub body: Bytes,
    pub content_type: Option<HeaderValue>,
    pub forward: Vec<(HeaderName, HeaderValue)>,
    pub max_retries: u32,
    pub retry_delay: Option<Arc<RetryDelayExpr>>,
    pub timeout: Option<Duration>,
    pub created_at_ms: u64,
    pub not_before_ms: u64,
    pub callback: Option<CallbackSpec>,
    pub failure_callback: Option<CallbackSpec>,
    pub flow: Option<FlowSpec>,
    pub queue: Option<String>,
    pub labels: Vec<String>,
    pub redact: Option<String>,
    pub caller_ip: Arc<str>,
    pub source_message_id: Option<Arc<str>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MsgState {
    /// Waiting for a timer (delay, not-before or retry backoff).
    Scheduled,
    /// In a queue's FIFO, waiting for a slot.
    WaitingQueue,
    /// In a flow-control key's waitlist.
    WaitingFlow,
    /// Handed to the worker pool.
    Ready,
}

pub(crate) struct Msg {
    pub data: Arc<MsgData>,
    pub retried: u32,
    pub extra_budget: u32,
    pub state: MsgState,
    pub hold: Option<u64>,
    pub planned_delay: Duration,
    pub cancel: Arc<AtomicBool>,
}

/// One delivery for the worker pool.
pub(crate) struct Job {
    pub data: Arc<MsgData>,
    pub retried: u32,
    pub planned_delay: Duration,
    pub duplicate: bool,
    pub cancel: Arc<AtomicBool>,
}

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

/// Follow-up work produced under the lock.
#[derive(Default)]
pub(crate) struct Effects {
    pub jobs: Vec<Job>,
    pub wake_timer: bool,
}

pub(crate) struct Queue {
    pub name: String,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    pub parallelism: u32,
    pub paused: bool,
    pub waitlist: VecDeque<Arc<str>>,
    pub active: u32,
}

pub(crate) struct Flow {
    pub key: String,
    par_counts: BTreeMap<u32, usize>,
    rate_counts: BTreeMap<(u32, u64), usize>,
    pub members: usize,
    pub active: u32,
    pub waitlist: VecDeque<Arc<str>>,
    pub window_start: Option<Instant>,
    pub window_start_ms: u64,
    pub window_count: u32,
    window_armed: bool,
    pub paused: bool,
    pub pinned_parallelism: Option<u32>,
    pub pinned_rate: Option<(u32, Duration)>,
    /// The config of the last message that joined, reported once the key has drained.
    last: Option<FlowSpec>,
}

impl Flow {
    pub fn new(key: &str) -> Flow {
        Flow {
            key: key.to_string(),
            par_counts: BTreeMap::new(),
            rate_counts: BTreeMap::new(),
            members: 0,
            active: 0,
            waitlist: VecDeque::new(),
            window_start: None,
            window_start_ms: 0,
            window_count: 0,
            window_armed: false,
            paused: false,
            pinned_parallelism: None,
            pinned_rate: None,
            last: None,
        }
    }

    fn rate_key(spec: &FlowSpec) -> (u32, u64) {
        match spec.rate {
            Some(r) => (
                r,
                u64::try_from(spec.period.as_millis()).unwrap_or(u64::MAX),
            ),
            None => (u32::MAX, 1),
        }
    }

    fn join(&mut self, spec: &FlowSpec) {
        self.members += 1;
        if self.last.as_ref() != Some(spec) {
            self.last = Some(spec.clone());
        }
        *self
            .par_counts
            .entry(spec.parallelism.unwrap_or(u32::MAX))
            .or_default() += 1;
        *self.rate_counts.entry(Self::rate_key(spec)).or_default() += 1;
    }

    fn leave(&mut self, spec: &FlowSpec) {
        self.members = self.members.saturating_sub(1);
        let p = spec.parallelism.unwrap_or(u32::MAX);
        if let Some(c) = self.par_counts.get_mut(&p) {
            *c -= 1;
            if *c == 0 {
                self.par_counts.remove(&p);
            }
        }
        let r = Self::rate_key(spec);
        if let Some(c) = self.rate_counts.get_mut(&r) {
            *c -= 1;
            if *c == 0 {
                self.rate_counts.remove(&r);
            }
        }
    }

    /// Highest parallelism among the key's live messages (`None` = unlimited), unless pinned.
    pub fn effective_parallelism(&self) -> Option<u32> {
        if let Some(p) = self.pinned_parallelism {
            return Some(p);
        }
        if self.par_counts.is_empty() {
            return self.last.as_ref().and_then(|l| l.parallelism);
        }
        self.par_counts
            .keys()
            .next_back()
            .copied()
            .filter(|p| *p != u32::MAX)
    }

    /// Highest rate (by calls per second) among the key's live messages (`None` = unlimited), unless pinned.
    pub fn effective_rate(&self) -> Option<(u32, Duration)> {
        if let Some(r) = self.pinned_rate {
            return Some(r);
        }
        if self.rate_counts.is_empty() {
            return self
                .last
                .as_ref()
                .and_then(|l| l.rate.map(|r| (r, l.period)));
        }
        let mut best: Option<(u32, u64)> = None;
        for &(rate, period_ms) in self.rate_counts.keys() {
            if rate == u32::MAX {
                return None;
            }
            let better = match best {
                None => true,
                Some((br, bp)) => (rate as f64 / period_ms as f64) > (br as f64 / bp as f64),
            };
            if better {
                best = Some((rate, period_ms));
            }
        }
        best.map(|(r, p)| (r, Duration::from_millis(p)))
    }
}

struct Hold {
    queue: String,
    count: u32,
}

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

#[derive(Debug)]
enum TimerKind {
    Due(Arc<str>),
    FlowWindow(String),
}

struct TimerEntry {
    at: Instant,
    seq: u64,
    kind: TimerKind,
}

impl PartialEq for TimerEntry {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for TimerEntry {}
impl PartialOrd for TimerEntry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for TimerEntry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// Remembers deduplication ids for the window, as 128-bit hashes.
struct Dedup {
    map: HashMap<u128, (Arc<str>, Instant)>,
    order: VecDeque<(Instant, u128)>,
    hashers: (RandomState, RandomState),
}

impl Dedup {
    fn new() -> Dedup {
        Dedup {
            map: HashMap::new(),
            order: VecDeque::new(),
            hashers: (RandomState::new(), RandomState::new()),
        }
    }

    fn key(&self, prefix: &[u8], bytes: &[u8]) -> u128 {
        let mut a = self.hashers.0.build_hasher();
        a.write(prefix);
        a.write(bytes);
        let mut b = self.hashers.1.build_hasher();
        b.write(prefix);
        b.write(bytes);
        (u128::from(a.finish()) << 64) | u128::from(b.finish())
    }

    fn purge(&mut self, now: Instant) {
        while let Some(&(exp, k)) = self.order.front() {
            if exp > now {
                break;
            }
            self.order.pop_front();
            if matches!(self.map.get(&k), Some((_, e)) if *e <= now) {
                self.map.remove(&k);
            }
        }
    }

    fn lookup(&self, k: u128, now: Instant) -> Option<Arc<str>> {
        match self.map.get(&k) {
            Some((id, exp)) if *exp > now => Some(id.clone()),
            _ => None,
        }
    }

    fn insert(&mut self, k: u128, id: Arc<str>, exp: Instant) {
        self.map.insert(k, (id, exp));
        self.order.push_back((exp, k));
    }
}

/// Unique, random-looking message ids: `msg_` + 22 base-62 characters.
struct IdGen {
    prefix: String,
    counter: u64,
    salt: u64,
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn base62_11_into(mut x: u64, buf: &mut [u8]) {
    const A: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    for slot in buf.iter_mut().rev() {
        *slot = A[(x % 62) as usize];
        x /= 62;
    }
}

fn base62_11(x: u64, out: &mut String) {
    let mut buf = [b'0'; 11];
    base62_11_into(x, &mut buf);
    out.extend(buf.iter().map(|&b| b as char));
}

impl IdGen {
    fn new() -> IdGen {
        let mut rng = rand::rng();
        let mut prefix = String::with_capacity(11);
        base62_11(rng.random(), &mut prefix);
        IdGen {
            prefix,
            counter: 0,
            salt: rng.random(),
        }
    }

    fn next(&mut self) -> Arc<str> {
        self.counter += 1;
        let mut buf = [0u8; 26];
        buf[..4].copy_from_slice(b"msg_");
        buf[4..15].copy_from_slice(self.prefix.as_bytes());
        // splitmix64 is a bijection, so distinct counters give distinct ids.
        base62_11_into(splitmix64(self.counter ^ self.salt), &mut buf[15..]);
        Arc::from(std::str::from_utf8(&buf).unwrap_or("msg_invalid"))
    }
}

/// Settings the core reads (copied from [`Config`]).
pub(crate) struct Settings {
    pub time_scale: f64,
    pub default_retries: u32,
    pub max_retries: u32,
    pub waitlist_order: WaitlistOrder,
    pub deliver: bool,
    pub retry_after_consumes_retry: bool,
    pub callback_timestamps: TimestampFormat,
    pub dlq_retention: Duration,
    pub dedup_window: Duration,
}

impl Settings {
    pub fn from_config(c: &Config) -> Settings {
        Settings {
            time_scale: c.time_scale,
            default_retries: c.default_retries,
            max_retries: c.max_retries,
            waitlist_order: c.waitlist_order,
            deliver: c.deliver,
            retry_after_consumes_retry: c.retry_after_consumes_retry,
            callback_timestamps: c.callback_timestamps,
            dlq_retention: c.dlq_retention,
            dedup_window: c.dedup_window,
        }
    }

    pub fn scaled(&self, d: Duration) -> Duration {
        let d = d.min(MAX_WAIT);
        Duration::try_from_secs_f64(d.as_secs_f64() * self.time_scale)
            .unwrap_or(MAX_WAIT)
            .min(MAX_WAIT)
    }
}

/// A message to publish (validated).
pub(crate) struct NewMessage {
    pub url: String,
    pub body: Bytes,
    pub opts: PublishOptions,
    pub queue: Option<String>,
    pub caller_ip: Arc<str>,
}

/// Result of one publish.
pub(crate) struct Accepted {
    pub message_id: Arc<str>,
    pub deduplicated: bool,
}

pub(crate) struct Core {
    pub settings: Settings,
    pub counters: Arc<Counters>,
    pub msgs: HashMap<Arc<str>, Msg>,
    dedup: Dedup,
    pub dlq: BTreeMap<(u64, u64), DlqEntry>,
    dlq_last: (u64, u64),
    pub queues: BTreeMap<String, Queue>,
    pub flows: BTreeMap<String, Flow>,
    timers: BinaryHeap<Reverse<TimerEntry>>,
    timer_seq: u64,
    holds: HashMap<u64, Hold>,
    hold_seq: u64,
    rng: StdRng,
    ids: IdGen,
}

/// Go-style canonical header name (`content-type` → `Content-Type`).
pub(crate) fn canonical_header(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut upper = true;
    for c in name.chars() {
        if upper {
            out.extend(c.to_uppercase());
        } else {
            out.extend(c.to_lowercase());
        }
        upper = c == '-';
    }
    out
}

/// [`header_multimap`] of a `HeaderMap` (non-UTF-8 values decoded lossily).
pub(crate) fn headermap_multimap(h: &http::HeaderMap) -> Value {
    let owned: Vec<(&str, String)> = h
        .iter()
        .map(|(k, v)| {
            (
                k.as_str(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    header_multimap(owned.iter().map(|(k, v)| (*k, v.as_str())))
}

/// `{name: [values...]}` with canonical names, values grouped in order.
pub(crate) fn header_multimap<'a>(pairs: impl Iterator<Item = (&'a str, &'a str)>) -> Value {
    let mut map: Map<String, Value> = Map::new();
    for (k, v) in pairs {
        let entry = map
            .entry(canonical_header(k))
            .or_insert_with(|| Value::Array(Vec::new()));
        if let Value::Array(a) = entry {
            a.push(Value::String(v.to_string()));
        }
    }
    Value::Object(map)
}

impl MsgData {
    /// The headers the destination receives from the publisher: Content-Type and the forwarded ones.
    pub fn source_header_pairs(&self) -> Vec<(&str, &str)> {
        let mut v = Vec::with_capacity(self.forward.len() + 1);
        if let Some(ct) = &self.content_type {
            v.push(("content-type", ct.to_str().unwrap_or("")));
        }
        for (k, val) in &self.forward {
            v.push((k.as_str(), val.to_str().unwrap_or("")));
        }
        v
    }
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
    }

    pub fn new_id(&mut self) -> Arc<str> {
        self.ids.next()
    }

    fn add_timer(&mut self, at: Instant, kind: TimerKind, fx: &mut Effects) {
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

    /// Content-based deduplication id: SHA-256 over destination, body, Content-Type and forwarded headers.
    fn content_dedup_key(url: &str, body: &[u8], opts: &PublishOptions) -> Vec<u8> {
        let mut h = Sha256::new();
        h.update(url.as_bytes());
        h.update([0]);
        h.update(body);
        h.update([0]);
        if let Some(ct) = &opts.content_type {
            h.update(ct.as_bytes());
        }
        for (k, v) in &opts.forward {
            h.update([0]);
            h.update(k.as_str().as_bytes());
            h.update([b':']);
            h.update(v.as_bytes());
        }
        h.finalize().to_vec()
    }

    /// Publishes one validated message (dedup, store, schedule).
    pub fn publish(&mut self, item: NewMessage, fx: &mut Effects) -> Accepted {
        let now = Instant::now();
        let dedup_key = if let Some(id) = &item.opts.dedup_id {
            Some(self.dedup.key(b"id\0", id.as_bytes()))
        } else if item.opts.content_based_dedup {
            let digest = Self::content_dedup_key(&item.url, &item.body, &item.opts);
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
        } = item;
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
        });
        self.insert_and_schedule(data, wait, None, fx);
    }

    fn insert_and_schedule(
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

    fn make_due(&mut self, id: &Arc<str>, fx: &mut Effects) {
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

    fn after_queue(&mut self, id: &Arc<str>, fx: &mut Effects) {
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
            fx.jobs.push(Job {
                data: msg.data.clone(),
                retried: msg.retried,
                planned_delay: msg.planned_delay,
                duplicate: false,
                cancel: msg.cancel.clone(),
            });
        }
    }

    pub fn pump_queue(&mut self, name: &str, fx: &mut Effects) {
        loop {
            let Some(q) = self.queues.get_mut(name) else {
                return;
            };
            if q.paused || q.active >= q.parallelism {
                return;
            }
            let Some(id) = q.waitlist.pop_front() else {
                return;
            };
            let Some(msg) = self.msgs.get_mut(&id) else {
                continue;
            };
            q.active += 1;
            self.hold_seq += 1;
            let h = self.hold_seq;
            self.holds.insert(
                h,
                Hold {
                    queue: name.to_string(),
                    count: 1,
                },
            );
            msg.hold = Some(h);
            self.after_queue(&id, fx);
        }
    }

    pub fn pump_flow(&mut self, key: &str, fx: &mut Effects) {
        let order = self.settings.waitlist_order;
        loop {
            let Some(flow) = self.flows.get_mut(key) else {
                return;
            };
            if flow.paused || flow.waitlist.is_empty() {
                return;
            }
            if let Some(p) = flow.effective_parallelism()
                && flow.active >= p
            {
                return;
            }
            let rate = flow.effective_rate();
            if let Some((limit, period)) = rate {
                let period = self.settings.scaled(period);
                let now = Instant::now();
                let expired = match flow.window_start {
                    None => true,
                    Some(start) => now >= start + period,
                };
                if expired {
                    flow.window_start = Some(now);
                    flow.window_start_ms = now_ms();
                    flow.window_count = 0;
                }
                if flow.window_count >= limit {
                    if !flow.window_armed {
                        flow.window_armed = true;
                        let at = flow.window_start.unwrap_or(now) + period;
                        let k = key.to_string();
                        self.add_timer(at, TimerKind::FlowWindow(k), fx);
                    }
                    return;
                }
            }
            let Some(flow) = self.flows.get_mut(key) else {
                return;
            };
            let idx = match order {
                WaitlistOrder::Fifo => 0,
                WaitlistOrder::Shuffled => self.rng.random_range(0..flow.waitlist.len()),
            };
            let Some(id) = flow.waitlist.remove(idx) else {
                return;
            };
            let Some(msg) = self.msgs.get_mut(&id) else {
                continue;
            };
            flow.active += 1;
            if rate.is_some() {
                flow.window_count += 1;
            }
            msg.state = MsgState::Ready;
            fx.jobs.push(Job {
                data: msg.data.clone(),
                retried: msg.retried,
                planned_delay: msg.planned_delay,
                duplicate: false,
                cancel: msg.cancel.clone(),
            });
        }
    }

    fn release_hold(&mut self, h: u64, fx: &mut Effects) {
        let Some(hold) = self.holds.get_mut(&h) else {
            return;
        };
        hold.count = hold.count.saturating_sub(1);
        if hold.count > 0 {
            return;
        }
        let queue = hold.queue.clone();
        self.holds.remove(&h);
        if let Some(q) = self.queues.get_mut(&queue) {
            q.active = q.active.saturating_sub(1);
        }
        self.pump_queue(&queue, fx);
    }

    /// Bookkeeping once a message has left `msgs` for good.
    fn finalize(&mut self, data: &MsgData, hold: Option<u64>, fx: &mut Effects) {
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

    fn backoff(&self, next_retried: u32, expr: Option<&RetryDelayExpr>) -> Duration {
        match expr {
            Some(e) => {
                let ms = e.eval(f64::from(next_retried.saturating_sub(1)));
                let ms = if ms.is_nan() || ms < 0.0 { 0.0 } else { ms };
                Duration::try_from_secs_f64(ms / 1000.0)
                    .unwrap_or(MAX_BACKOFF)
                    .min(MAX_BACKOFF)
            }
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

    fn move_to_dlq(&mut self, id: &Arc<str>, out: &Outcome, fx: &mut Effects) {
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

    fn ts(&self, ms: u64) -> Value {
        match self.settings.callback_timestamps {
            TimestampFormat::Number => json!(ms),
            TimestampFormat::String => json!(ms.to_string()),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn spawn_callback(
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
        });
        if let Some(h) = hold
            && let Some(hold) = self.holds.get_mut(&h)
        {
            hold.count += 1;
        }
        Counters::inc(&self.counters.callbacks_created);
        self.insert_and_schedule(data, delay, hold, fx);
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
        });
        if self.settings.deliver {
            self.insert_and_schedule(data, wait, None, fx);
        }
        Some(id)
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

    pub fn dlq_infos(&self) -> Vec<DlqEntryInfo> {
        self.dlq.values().map(DlqEntry::info).collect()
    }
}

/// Parses a DLQ id `"<ms>-<n>"` into its ordering key.
pub(crate) fn parse_dlq_id(s: &str) -> Option<(u64, u64)> {
    let (a, b) = s.split_once('-')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_shaped() {
        let mut g = IdGen::new();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10_000 {
            let id = g.next();
            assert!(id.starts_with("msg_"));
            assert_eq!(id.len(), 26);
            assert!(seen.insert(id));
        }
    }

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

    #[test]
    fn canonical_names() {
        assert_eq!(canonical_header("content-type"), "Content-Type");
        assert_eq!(canonical_header("x-outbox-id"), "X-Outbox-Id");
    }

    #[test]
    fn flow_effective_limits_take_the_highest() {
        let mut f = Flow::new("k");
        let a = FlowSpec {
            key: "k".into(),
            parallelism: Some(1),
            rate: Some(5),
            period: Duration::from_secs(60),
        };
        let b = FlowSpec {
            key: "k".into(),
            parallelism: Some(3),
            rate: Some(2),
            period: Duration::from_secs(1),
        };
        f.join(&a);
        assert_eq!(f.effective_parallelism(), Some(1));
        f.join(&b);
        assert_eq!(f.effective_parallelism(), Some(3));
        assert_eq!(f.effective_rate(), Some((2, Duration::from_secs(1))));
        f.leave(&b);
        assert_eq!(f.effective_parallelism(), Some(1));
        assert_eq!(f.effective_rate(), Some((5, Duration::from_secs(60))));
    }
}
