//! A backend-generic test kit, so that one test body runs against every compiled backend
//! (the CPU backend's tests use it, and so can a GPU backend's, with the CPU backend or the
//! f64 reference as the oracle).
//!
//! - [`data`]: test cases ([`Case`]), fresh random inputs ([`HostInputs`]: q, k, v, raw gate
//!   and raw beta N(0, 1), `A_log = ln U(1, 16)`, `dt_bias` as fla initialises it), element
//!   encoding and relative Frobenius errors;
//! - [`layer`]: a one-layer pool in any backend's memory ([`TestLayer`]) with states read and
//!   written as logical f32, and guarded runners of the operations that poison the output,
//!   assert every element written, the other slots untouched, and a refused call harmless;
//! - [`checks`]: the properties of issue 3 as generic functions
//!   (`check_prefill_matches_reference(&backend, &case, seed)`, ...).
//!
//! Compiled with the `testing` feature, which brings in `rand` and `rand_distr`; the crate's
//! own tests enable it through a dev-dependency on the crate itself, so the library proper
//! does not depend on `rand`.

pub mod bad_input;
pub mod checks;
pub mod data;
pub mod layer;
pub mod padded;

pub use bad_input::{assert_refused, bad_input_case, check_rejects_bad_input};
pub use checks::*;
pub use data::{
    batch_plan, bounds_of, fla_dt_bias, random_a_log, random_states, rel_frobenius,
    rel_frobenius_f32, to_f64, unit_roundoff, Case, HostInputs,
};
pub use layer::{
    download, guarded, poisoned_output, run_replay, run_tokens, upload, upload_bytes, DeviceInputs,
    Snapshot, TestLayer, TokenOp,
};
pub use padded::{
    assert_layers_agree, check_padded_batch_matches_plain_batches, live_output, random_slots,
    PaddedOp,
};
