//! Whole-system test harness: helpers shared by the tests in `tests/`.

pub mod db;
pub mod sam;
