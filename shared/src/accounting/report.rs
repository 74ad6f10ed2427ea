//! [`AccountingReport`]: what one accounting pass did.

use serde::Serialize;

/// What one accounting pass did (one relay invocation).
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct AccountingReport {
    /// Events found applied by their dedupe row, now marked delivered: in flight, or dead-lettered by a relay that
    /// never saw its publish answered (their dead letters resolved "applied").
    pub swept_applied: u64,
    /// Dead letters recorded (or merged) from QStash's DLQ.
    pub recorded_from_dlq: u64,
    /// Of the DLQ entries found, those already recorded (the callback had come after all).
    pub already_recorded: u64,
    /// DLQ entries QStash answered about messages the reconciler did not ask about: logged, never recorded.
    pub unasked_dlq_entries: u64,
    /// Events unknown to QStash, published again.
    pub republished: u64,
    /// Messages QStash still holds (waiting or retrying).
    pub still_retrying: u64,
    /// Events dead-lettered because nothing could account for them (and events put back to be published again
    /// that no relay published before their deadline).
    pub unaccounted_dead: u64,
    /// Ordered events unknown to QStash, left to their key's evidence timeout.
    pub left_to_evidence_timeout: u64,
    /// Management API requests made.
    pub lookups: u64,
    /// Management API requests that failed (including a 429, which ends the pass).
    pub lookup_failures: u64,
}
