//! Fuzz target: `kda_pool_fuzz::image` (the checkpoint-image parser and import, and the
//! layout-id parser) on every input (see `fuzz/src/lib.rs`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kda_pool_fuzz::image(data));
