//! Whole-system test harness.
