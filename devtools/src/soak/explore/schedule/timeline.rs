//! The schedule itself: its steps in time order, each an operation at its offset from the start; printed one line
//! per step, and counted by kind.

use std::fmt;
use std::time::Duration;

use serde::Serialize;

use super::op::Op;

/// A seeded timeline of traffic, faults and operator actions.
#[derive(Debug, Clone, Serialize)]
pub struct Schedule {
    pub seed: u64,
    /// Its length; traffic stops at 85 % of it, faults and actions go on to the end.
    pub length: Duration,
    /// In time order.
    pub steps: Vec<Step>,
}

/// One operation at its offset from the start.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    #[serde(serialize_with = "secs")]
    pub at: Duration,
    pub op: Op,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "schedule: seed {}, {:.0} s, {} steps",
            self.seed,
            self.length.as_secs_f64(),
            self.steps.len()
        )?;
        for s in &self.steps {
            writeln!(f, "  {:>7.2}s  {}", s.at.as_secs_f64(), s.op)?;
        }
        Ok(())
    }
}

impl Schedule {
    /// How many steps of each kind.
    pub fn counts(&self) -> std::collections::BTreeMap<String, u64> {
        let mut m = std::collections::BTreeMap::new();
        for s in &self.steps {
            *m.entry(s.op.kind()).or_default() += 1;
        }
        m
    }
}
