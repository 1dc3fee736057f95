//! Fuzz target: `kda_pool_fuzz::own_config` on every input (see `fuzz/src/lib.rs`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kda_pool_fuzz::own_config(data));
