//! Full-jitter exponential backoff: `rand(0, min(cap, base · 2^attempt))`, floored at 1 s.
//!
//! `attempt` is the number of publish attempts made so far (counted at claim), so the first retry waits up to
//! `2·base`. Full jitter spreads retries of a burst of failures over the whole window instead of synchronising
//! them (AWS Architecture Blog, "Exponential Backoff And Jitter").

use std::time::Duration;

use rand::Rng;

/// The backoff policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// `base` of the exponential.
    pub base: Duration,
    /// Upper bound of the window.
    pub cap: Duration,
}

/// The floor of every delay.
pub const MIN_DELAY: Duration = Duration::from_secs(1);

impl Backoff {
    /// The window's upper bound for `attempt`: `min(cap, base · 2^attempt)` (never below the floor).
    pub fn window(&self, attempt: u32) -> Duration {
        let factor = 2f64.powi(attempt.min(62) as i32);
        let secs = (self.base.as_secs_f64() * factor).min(self.cap.as_secs_f64());
        Duration::from_secs_f64(secs).max(MIN_DELAY)
    }

    /// A delay drawn uniformly from `[0, window(attempt)]`, floored at 1 s.
    pub fn delay(&self, attempt: u32, rng: &mut impl Rng) -> Duration {
        let w = self.window(attempt).as_secs_f64();
        Duration::from_secs_f64(rng.random_range(0.0..=w)).max(MIN_DELAY)
    }

    /// The delay before the next attempt, honouring a server's retry hint (never beyond `cap`).
    pub fn next_delay(
        &self,
        attempt: u32,
        retry_after: Option<Duration>,
        rng: &mut impl Rng,
    ) -> Duration {
        match retry_after {
            Some(hint) => hint.clamp(MIN_DELAY, self.cap.max(MIN_DELAY)),
            None => self.delay(attempt, rng),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    const SEED: Backoff = Backoff {
        base: Duration::from_secs(30),
        cap: Duration::from_secs(3600),
    };

    #[test]
    fn delays_stay_within_their_bounds() {
        let mut rng = StdRng::seed_from_u64(7);
        for attempt in 0..40 {
            let w = SEED.window(attempt);
            assert!(w <= SEED.cap && w >= MIN_DELAY);
            let mut lo = Duration::MAX;
            let mut hi = Duration::ZERO;
            for _ in 0..2000 {
                let d = SEED.delay(attempt, &mut rng);
                assert!(
                    d >= MIN_DELAY && d <= w,
                    "attempt {attempt}: {d:?} outside [1s, {w:?}]"
                );
                lo = lo.min(d);
                hi = hi.max(d);
            }
            // Full jitter really uses the window: near the floor and near the top both occur.
            assert!(
                lo < MIN_DELAY + w / 10 + Duration::from_millis(1),
                "attempt {attempt}: lowest {lo:?}"
            );
            assert!(
                hi > w.mul_f64(0.9),
                "attempt {attempt}: highest {hi:?} of {w:?}"
            );
        }
        assert_eq!(SEED.window(1), Duration::from_secs(60));
        assert_eq!(SEED.window(6), Duration::from_secs(1920));
        assert_eq!(SEED.window(7), Duration::from_secs(3600));
    }

    #[test]
    fn retry_after_is_honoured_within_the_cap() {
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(
            SEED.next_delay(3, Some(Duration::from_secs(20)), &mut rng),
            Duration::from_secs(20)
        );
        assert_eq!(
            SEED.next_delay(3, Some(Duration::from_secs(99_999)), &mut rng),
            SEED.cap
        );
        assert_eq!(
            SEED.next_delay(3, Some(Duration::ZERO), &mut rng),
            MIN_DELAY
        );
    }
}
