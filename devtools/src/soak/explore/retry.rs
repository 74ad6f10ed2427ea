//! Trying again while Postgres is away: an action (or a read) that failed for want of Postgres is run again a second
//! later, a bounded number of times; one refused is not. The operator's library calls and its console both answer
//! with a [`Failure`].

use std::time::Duration;

use super::history::Outcome;

/// How many times an action that failed for want of Postgres is tried again (a second apart).
pub(super) const TRIES: u32 = 40;

/// Why an action did not succeed: Postgres away (tried again), or refused.
pub(super) enum Failure {
    Transient(String),
    Refused(String),
}

/// Runs an action until it succeeds or is refused, trying again a second later while it fails for want of
/// Postgres (at most [`TRIES`] times).
pub(super) async fn attempt<F, Fut>(mut f: F) -> Outcome
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<String, Failure>>,
{
    let mut tries = 0;
    loop {
        match f().await {
            Ok(done) => return Outcome::Done(done),
            Err(Failure::Transient(_)) if tries < TRIES => {
                tries += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(Failure::Transient(e)) => return Outcome::Failed(e),
            Err(Failure::Refused(e)) => return Outcome::Refused(e),
        }
    }
}

/// Tries `f` until it succeeds, a second apart, at most [`TRIES`] times (Postgres may be restarting).
pub(super) async fn retry<T, E, F, Fut>(mut f: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut tries = 0;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if tries >= TRIES => return Err(e),
            Err(_) => {
                tries += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
