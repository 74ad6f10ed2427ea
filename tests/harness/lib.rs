//! Whole-system test harness: helpers shared by the tests in `tests/`.

pub mod db;
pub mod previous_relay;
pub mod sam;
