#![no_main]
//! See `outbox_fuzz::checks::callback`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| outbox_fuzz::checks::callback(data));
