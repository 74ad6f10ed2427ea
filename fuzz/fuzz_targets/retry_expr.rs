#![no_main]
//! See `outbox_fuzz::checks::retry_expr`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| outbox_fuzz::checks::retry_expr(data));
