//! Flow control: per-key parallelism and rate limits, with a waitlist of messages waiting for a slot. Moving
//! messages through the waitlist is [`Core`](super::machine::Core)'s (`waitlists.rs`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::options::FlowSpec;

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
    pub(super) window_armed: bool,
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

    pub(super) fn join(&mut self, spec: &FlowSpec) {
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

    pub(super) fn leave(&mut self, spec: &FlowSpec) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
