#![no_main]
//! See `outbox_fuzz::checks::envelope`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| outbox_fuzz::checks::envelope(data));
