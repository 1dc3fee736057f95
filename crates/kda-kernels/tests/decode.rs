//! Decode and speculative verify on the CPU backend: decode equals prefill, the replay ring
//! is bit-exact with eager decode for an fp32 pool, and spec_verify with random accepted
//! counts equals eager decode of the accepted tokens.

mod common;

use common::{any_case, case_with, dtype, fp32_case, options};
use kda_kernels::testing::{
    check_decode_matches_prefill, check_ring_decode_matches_eager, check_spec_verify_matches_eager,
    Case,
};
use kda_kernels::CpuBackend;
use proptest::prelude::*;
use state_pool::{Dtype, StateLayout};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn t_decode_steps_equal_a_prefill_of_the_same_tokens_within_1e5_for_an_fp32_pool(
        case in fp32_case(20, 0usize..=6), seed in any::<u64>()
    ) {
        let (eo, es) = check_decode_matches_prefill(&CpuBackend, &case, seed);
        prop_assert!(eo <= 1e-5 && es <= 1e-5, "differences {eo:.2e} {es:.2e}");
    }

    #[test]
    fn decode_stays_close_to_prefill_for_every_dtype(
        case in any_case(12, 0usize..=4), seed in any::<u64>()
    ) {
        check_decode_matches_prefill(&CpuBackend, &case, seed);
    }

    #[test]
    fn decode_through_any_ring_is_bit_exact_with_eager_decode_for_an_fp32_pool(
        case in case_with(1, Just(Dtype::Fp32), dtype(), 1usize..=7, options()),
        steps in 1usize..=24,
        seed in any::<u64>(),
    ) {
        check_ring_decode_matches_eager(&CpuBackend, &case, steps, seed);
    }

    #[test]
    fn spec_verify_then_flush_equals_eager_decode_of_only_the_accepted_tokens(
        case in case_with(1, Just(Dtype::Fp32), dtype(), 1usize..=5, options()),
        extra_steps in 0usize..=12,
        seed in any::<u64>(),
    ) {
        // The first ring_len + 2 steps cycle the accepted count through 0..=ring_len.
        let steps = case.ring_len + 2 + extra_steps;
        check_spec_verify_matches_eager(&CpuBackend, &case, steps, seed);
    }
}

#[test]
fn ring_decode_at_the_production_head_size_is_bit_exact_with_eager_decode() {
    for layout in [StateLayout::KFirst, StateLayout::VFirst] {
        let case = Case {
            layout,
            ring_len: 4,
            input_dtype: Dtype::Bf16,
            ..Case::new(2, 4, 128, 128).with_seqs(&[1, 1], &[2, 0])
        };
        check_ring_decode_matches_eager(&CpuBackend, &case, 10, 7);
        check_spec_verify_matches_eager(&CpuBackend, &case, 8, 8);
    }
}

#[test]
fn decode_at_the_production_head_size_matches_prefill() {
    let case = Case::new(1, 2, 128, 128).with_seqs(&[9, 4], &[1, 0]);
    let (eo, es) = check_decode_matches_prefill(&CpuBackend, &case, 3);
    assert!(eo <= 1e-5 && es <= 1e-5, "differences {eo:.2e} {es:.2e}");
}
