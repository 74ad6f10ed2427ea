//! The schedules kept in the repository: seeds whose runs found a defect (they pass once it is fixed) or that
//! cover a combination on purpose. `devtools/tests/explore.rs` runs them; `docs/reliability.md` has the table.

/// A kept schedule: `outbox-dev soak --schedule random --seed {seed} --minutes {minutes}`.
#[derive(Debug, Clone, Copy)]
pub struct Kept {
    pub name: &'static str,
    pub seed: u64,
    pub minutes: f64,
    /// What it covers (checked against the drawn schedule by the tests).
    pub covers: &'static str,
    /// What it found on the code it was first run on, if anything.
    pub found: Option<&'static str>,
}

/// The kept schedules.
pub const KEPT: &[Kept] = &[];
