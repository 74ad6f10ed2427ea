//! Scenario "Fairness between tenants" (issue 39, decision record 0076): tenant A imports a flood of events while
//! ten other tenants write 10 events/s each, on an unordered topic with batched deliveries, through the relay (in
//! this process, built from the Lambda's configuration), the delivering dev server and the real consumer.
//!
//! Five runs, each on a fresh database: the others alone (their baseline), A alone (its baseline), the flood with
//! fair claims, the flood with `RELAY_FAIR_CLAIMS=false` (the claim before fairness keys), and the flood with every
//! tenant limited at QStash (`RELAY_TENANT_LIMITS`). Per run: the others' commit → applied p50/p99 while A had
//! events waiting, and A's drain rate (its events over first commit → last applied).

mod report;
mod run;

pub use report::write;
pub use run::{FairnessArgs, run};
