//! Deduplication: explicit `Upstash-Deduplication-Id`s and content-based ids, remembered for the window.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::Arc;

use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::draw::Fingerprint;
use crate::options::PublishOptions;

/// Remembers deduplication ids for the window, as 128-bit hashes.
pub(super) struct Dedup {
    map: HashMap<u128, (Arc<str>, Instant)>,
    order: VecDeque<(Instant, u128)>,
    hashers: (RandomState, RandomState),
}

impl Dedup {
    pub(super) fn new() -> Dedup {
        Dedup {
            map: HashMap::new(),
            order: VecDeque::new(),
            hashers: (RandomState::new(), RandomState::new()),
        }
    }

    pub(super) fn key(&self, prefix: &[u8], bytes: &[u8]) -> u128 {
        let mut a = self.hashers.0.build_hasher();
        a.write(prefix);
        a.write(bytes);
        let mut b = self.hashers.1.build_hasher();
        b.write(prefix);
        b.write(bytes);
        (u128::from(a.finish()) << 64) | u128::from(b.finish())
    }

    pub(super) fn purge(&mut self, now: Instant) {
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

    pub(super) fn lookup(&self, k: u128, now: Instant) -> Option<Arc<str>> {
        match self.map.get(&k) {
            Some((id, exp)) if *exp > now => Some(id.clone()),
            _ => None,
        }
    }

    pub(super) fn insert(&mut self, k: u128, id: Arc<str>, exp: Instant) {
        self.map.insert(k, (id, exp));
        self.order.push_back((exp, k));
    }
}

/// Content-based deduplication id: SHA-256 over destination, body, Content-Type and forwarded headers.
pub(super) fn content_dedup_key(url: &str, body: &[u8], opts: &PublishOptions) -> Vec<u8> {
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

/// A published message's identity for fault draws (decision record 0114): its deduplication id if it has
/// one, else what content-based deduplication hashes (destination, body, Content-Type, forwarded headers).
/// Never the message id, which is random and assigned in arrival order.
pub(crate) fn message_identity(url: &str, body: &[u8], opts: &PublishOptions) -> u64 {
    if let Some(id) = &opts.dedup_id {
        return Fingerprint::new(b"dedup-id").bytes(id.as_bytes()).finish();
    }
    let mut f = Fingerprint::new(b"content")
        .bytes(url.as_bytes())
        .bytes(body)
        .bytes(
            opts.content_type
                .as_ref()
                .map_or(&b""[..], |c| c.as_bytes()),
        );
    for (k, v) in &opts.forward {
        f = f.bytes(k.as_str().as_bytes()).bytes(v.as_bytes());
    }
    f.finish()
}
