//! State rounding of 2-byte pools on the CPU backend: a ring rounds once per commit (and eager
//! decode once per token), bit for bit as an fp32 emulation predicts; stochastic rounding is
//! reproducible and unbiased.

mod common;

use common::{case_with, dtype, options, rounding, two_byte_dtype};
use kda_kernels::testing::{check_ring_rounds_once_per_commit, check_stochastic_rounding, Case};
use kda_kernels::CpuBackend;
use proptest::prelude::*;
use state_pool::{Dtype, Rounding, StateLayout};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn a_two_byte_ring_rounds_the_state_once_per_commit(
        case in case_with(1, two_byte_dtype(), dtype(), 0usize..=6, options()),
        steps in 1usize..=20,
        seed in any::<u64>(),
    ) {
        let commits = check_ring_rounds_once_per_commit(&CpuBackend, &case, steps, seed);
        let n = case.slots.len();
        // Eager decode stores every token; a ring stores every ring_len tokens, plus the flush.
        let most = steps.checked_div(case.ring_len).map_or(steps, |c| c + 1) * n;
        prop_assert!(commits <= most, "{commits} commits for {steps} steps");
    }
}

#[test]
fn a_ring_of_eight_stores_the_state_eight_times_less_often_than_eager_decode() {
    for (ring_len, want) in [(0, 24), (8, 2 + 1)] {
        let case = Case {
            state_dtype: Dtype::Bf16,
            ring_len,
            ..Case::new(1, 2, 16, 8).with_seqs(&[1], &[1])
        };
        // 24 tokens: eager stores 24 times; the ring commits at tokens 9 and 17, then flushes.
        let commits = check_ring_rounds_once_per_commit(&CpuBackend, &case, 24, 5);
        assert_eq!(commits, want, "ring_len {ring_len}");
    }
}

#[test]
fn stochastic_rounding_is_reproducible_and_unbiased() {
    for state_dtype in [Dtype::Fp16, Dtype::Bf16] {
        for layout in [StateLayout::KFirst, StateLayout::VFirst] {
            let case = Case {
                state_dtype,
                layout,
                rounding: Rounding::Stochastic { seed: 0xfeed },
                ..Case::new(2, 4, 16, 16).with_seqs(&[40, 9], &[0, 2])
            };
            let bias = check_stochastic_rounding(&CpuBackend, &case, 11);
            assert!(
                bias.abs() < 0.05,
                "{state_dtype} {layout:?}: mean error {bias} ulp"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    #[test]
    fn two_byte_rounding_matches_the_emulation_for_any_rounding_mode(
        case in case_with(1, two_byte_dtype(), dtype(), 0usize..=3, options()),
        rounding in rounding(),
        seed in any::<u64>(),
    ) {
        let case = Case { rounding, ..case };
        check_ring_rounds_once_per_commit(&CpuBackend, &case, 9, seed);
    }
}
