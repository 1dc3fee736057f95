//! Proptest strategies for the property tests: random shapes (H != HV, K != V, odd sizes),
//! batches (several sequences, lengths 0 and 1 included, slots scattered in a larger pool),
//! pool settings and options.

#![allow(dead_code)]

use kda_kernels::testing::Case;
use kda_kernels::{BetaMode, GateMode, KdaOptions};
use proptest::prelude::*;
use state_pool::{Dtype, Rounding, StateLayout};

/// Any pool or input element type.
pub fn dtype() -> impl Strategy<Value = Dtype> {
    prop_oneof![Just(Dtype::Fp32), Just(Dtype::Fp16), Just(Dtype::Bf16)]
}

/// A 2-byte element type.
pub fn two_byte_dtype() -> impl Strategy<Value = Dtype> {
    prop_oneof![Just(Dtype::Fp16), Just(Dtype::Bf16)]
}

/// Either layout.
pub fn layout() -> impl Strategy<Value = StateLayout> {
    prop_oneof![Just(StateLayout::KFirst), Just(StateLayout::VFirst)]
}

/// Nearest or stochastic rounding with a random seed.
pub fn rounding() -> impl Strategy<Value = Rounding> {
    prop_oneof![
        Just(Rounding::Nearest),
        any::<u64>().prop_map(|seed| Rounding::Stochastic { seed })
    ]
}

/// Any combination of the options.
pub fn options() -> impl Strategy<Value = KdaOptions> {
    let gate = prop_oneof![
        Just(GateMode::Activated),
        Just(GateMode::Softplus),
        (-8.0f32..-0.5).prop_map(GateMode::LowerBound)
    ];
    let beta = prop_oneof![Just(BetaMode::Activated), Just(BetaMode::Sigmoid)];
    let scale = prop_oneof![Just(None), (0.2f32..1.5).prop_map(Some)];
    (gate, beta, any::<bool>(), any::<bool>(), scale).prop_map(
        |(gate, beta, allow_neg_eigval, l2norm_qk, scale)| KdaOptions {
            scale,
            l2norm_qk,
            gate,
            beta,
            allow_neg_eigval,
        },
    )
}

/// Distinct slots for `n` sequences in a pool of `n + extra` slots, in a shuffled order.
fn scatter(n: usize, extra: usize, mut seed: u64) -> (Vec<u32>, usize) {
    let total = n + extra;
    let mut all: Vec<u32> = (0..total as u32).collect();
    for i in (1..total).rev() {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let j = (seed >> 33) as usize % (i + 1);
        all.swap(i, j);
    }
    all.truncate(n);
    (all, total)
}

/// Random small shapes and batches: H in 1..=3, HV = H x 1..=3, K and V in 1..=9 (so K != V
/// mostly, odd sizes), 1..=3 sequences of 0..=max_len tokens, two spare slots; the pool
/// and input settings and the options from the given strategies.
pub fn case_with(
    max_len: usize,
    state: impl Strategy<Value = Dtype>,
    input: impl Strategy<Value = Dtype>,
    ring_len: impl Strategy<Value = usize>,
    opts: impl Strategy<Value = KdaOptions>,
) -> impl Strategy<Value = Case> {
    let shape = (1..=3usize, 1..=3usize, 1..=9usize, 1..=9usize);
    let batch = (
        prop::collection::vec(0..=max_len, 1..=3),
        0..=2usize,
        any::<u64>(),
    );
    let pool = (state, input, layout(), ring_len, rounding());
    (shape, batch, pool, opts).prop_map(
        |((h, group, k, v), (lens, extra, seed), (sd, id, lay, ring, rnd), opts)| {
            let (slots, total) = scatter(lens.len(), extra, seed);
            Case {
                h,
                hv: h * group,
                k,
                v,
                seq_lens: lens,
                slots,
                total_slots: total,
                state_dtype: sd,
                input_dtype: id,
                layout: lay,
                ring_len: ring,
                // the CPU backend leaves a delta plane alone; its size is checked
                ring_deltas: seed % 2 == 1,
                rounding: rnd,
                opts,
            }
        },
    )
}

/// An fp32 pool with fp32 inputs, any shape, layout and options.
pub fn fp32_case(
    max_len: usize,
    ring_len: impl Strategy<Value = usize>,
) -> impl Strategy<Value = Case> {
    case_with(
        max_len,
        Just(Dtype::Fp32),
        Just(Dtype::Fp32),
        ring_len,
        options(),
    )
}

/// Everything random.
pub fn any_case(
    max_len: usize,
    ring_len: impl Strategy<Value = usize>,
) -> impl Strategy<Value = Case> {
    case_with(max_len, dtype(), dtype(), ring_len, options())
}
