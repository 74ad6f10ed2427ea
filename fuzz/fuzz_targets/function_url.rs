#![no_main]
//! See `outbox_fuzz::checks::function_url`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| outbox_fuzz::checks::function_url(data));
