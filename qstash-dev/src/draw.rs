//! Reproducible fault draws (decision record 0114). A fault decision is a pure function of the seed, the kind of
//! fault, whose decision it is (a message's identity or a publish request's content) and which try it is, hashed
//! with fixed constants. Nothing depends on the order in which concurrent requests and deliveries reach the
//! server, so the same seed replays the same faults per message however a run is scheduled.
//!
//! The constants below (the hash, the kind tags, the domain strings of [`Fingerprint::new`] callers) are part of
//! what a seed means: changing one changes every replay.

use std::collections::HashMap;

/// What a draw decides. Each kind draws independently of the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FaultKind {
    /// `Faults::publish_5xx_rate`.
    Publish5xx,
    /// `Faults::publish_drop_response_rate`.
    PublishDropResponse,
    /// `Faults::delivery_network_error_rate`.
    DeliveryNetworkError,
    /// `Faults::delivery_lost_response_rate`.
    DeliveryLostResponse,
    /// `Faults::duplicate_delivery_rate`.
    DuplicateDelivery,
    /// `Faults::message_loss_rate`.
    MessageLoss,
}

impl FaultKind {
    fn tag(self) -> u64 {
        match self {
            FaultKind::Publish5xx => 1,
            FaultKind::PublishDropResponse => 2,
            FaultKind::DeliveryNetworkError => 3,
            FaultKind::DeliveryLostResponse => 4,
            FaultKind::DuplicateDelivery => 5,
            FaultKind::MessageLoss => 6,
        }
    }
}

/// SplitMix64's finalizer (a bijection on `u64` with full avalanche).
pub(crate) fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A 64-bit fingerprint of a sequence of fields, with fixed constants: the same on every build, platform and
/// Rust version (unlike `RandomState`, or `DefaultHasher`, whose algorithm may change). Each field is
/// length-prefixed, so `("ab", "c")` and `("a", "bc")` differ. Not collision-resistant against an adversary;
/// it only has to spread honest inputs evenly.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fingerprint(u64);

impl Fingerprint {
    /// Starts a fingerprint in a domain (what is being identified: `b"message"`, `b"batch"`, ...).
    pub fn new(domain: &[u8]) -> Fingerprint {
        Fingerprint(0x0114_fa17_5eed_0000).bytes(domain)
    }

    /// Absorbs a number.
    pub fn u64(self, x: u64) -> Fingerprint {
        Fingerprint(splitmix64(self.0 ^ x))
    }

    /// Absorbs a byte string (its length, then 8 bytes at a time, little-endian, the last word zero-padded).
    pub fn bytes(self, b: &[u8]) -> Fingerprint {
        let mut h = self.u64(b.len() as u64).0;
        let mut chunks = b.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            h = splitmix64(h ^ u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            h = splitmix64(h ^ u64::from_le_bytes(w));
        }
        Fingerprint(h)
    }

    pub fn finish(self) -> u64 {
        self.0
    }
}

/// The draw: uniform in `[0, 1)` from (seed, kind, subject, n). `subject` is a message's fault id or a publish
/// request's key; `n` says which try (a message's attempt, the how-many-th request with that key).
pub(crate) fn uniform(seed: u64, kind: FaultKind, subject: u64, n: u64) -> f64 {
    let h = Fingerprint::new(b"draw")
        .u64(seed)
        .u64(kind.tag())
        .u64(subject)
        .u64(n)
        .finish();
    // The top 53 bits, as f64 has them: exactly representable, < 1.
    (h >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// How many times each key was seen before. Memory is bounded: once `capacity` keys are held, the older half
/// is forgotten (keys seen again start over at 0), which only matters for runs with more distinct keys than
/// that.
pub(crate) struct Occurrences {
    current: HashMap<u64, u32>,
    previous: HashMap<u64, u32>,
    capacity: usize,
}

impl Occurrences {
    /// Keeps at least `capacity / 2` and at most `capacity` keys.
    pub fn new(capacity: usize) -> Occurrences {
        Occurrences {
            current: HashMap::new(),
            previous: HashMap::new(),
            capacity: capacity.max(2),
        }
    }

    /// The number of earlier calls with `key` (0 the first time), and counts this one.
    pub fn next(&mut self, key: u64) -> u32 {
        if let Some(n) = self.current.get_mut(&key) {
            let seen = *n;
            *n = n.saturating_add(1);
            return seen;
        }
        let seen = self.previous.remove(&key).unwrap_or(0);
        if self.current.len() >= self.capacity / 2 {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(key, seen.saturating_add(1));
        seen
    }

    pub fn clear(&mut self) {
        self.current.clear();
        self.previous.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_pure_and_known() {
        // Pinned values: a change here changes what every seed replays (decision record 0114).
        assert_eq!(uniform(42, FaultKind::Publish5xx, 7, 0), 0.4504710499400687);
        assert_eq!(
            Fingerprint::new(b"message").bytes(b"outbox-1").finish(),
            0x64ce_6382_ad82_3cf8
        );
        let all = [
            uniform(42, FaultKind::Publish5xx, 7, 0),
            uniform(43, FaultKind::Publish5xx, 7, 0),
            uniform(42, FaultKind::PublishDropResponse, 7, 0),
            uniform(42, FaultKind::Publish5xx, 8, 0),
            uniform(42, FaultKind::Publish5xx, 7, 1),
        ];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b, "every input changes the draw");
            }
        }
    }

    #[test]
    fn fields_are_length_prefixed() {
        let a = Fingerprint::new(b"x").bytes(b"ab").bytes(b"c").finish();
        let b = Fingerprint::new(b"x").bytes(b"a").bytes(b"bc").finish();
        let c = Fingerprint::new(b"x").bytes(b"abc").finish();
        let d = Fingerprint::new(b"x").bytes(b"abc\0").finish();
        assert!(a != b && a != c && b != c && c != d);
    }

    #[test]
    fn draws_are_uniform_enough() {
        let n = 100_000u64;
        for p in [0.05, 0.3, 0.5] {
            let hits = (0..n)
                .filter(|i| uniform(1, FaultKind::DeliveryNetworkError, *i, 0) < p)
                .count() as f64;
            let share = hits / n as f64;
            assert!((share - p).abs() < 0.01, "p = {p}: {share}");
        }
        // Consecutive tries of one subject are independent too.
        let hits = (0..n)
            .filter(|i| uniform(1, FaultKind::Publish5xx, 99, *i) < 0.3)
            .count() as f64;
        assert!((hits / n as f64 - 0.3).abs() < 0.01);
    }

    #[test]
    fn occurrences_count_and_stay_bounded() {
        let mut o = Occurrences::new(4);
        assert_eq!((o.next(1), o.next(1), o.next(2), o.next(1)), (0, 1, 0, 2));
        for k in 10..100 {
            o.next(k);
            assert!(o.current.len() + o.previous.len() <= 4);
        }
        let mut o = Occurrences::new(100);
        for k in 0..40 {
            o.next(k);
        }
        for k in 0..40 {
            assert_eq!(o.next(k), 1, "a key within capacity is remembered");
        }
        o.clear();
        assert_eq!(o.next(3), 0);
    }
}
