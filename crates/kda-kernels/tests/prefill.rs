//! Prefill on the CPU backend: the chunked form against the f64 token recurrence, prefill in
//! pieces, and prefill after a ring.

mod common;

use common::{any_case, fp32_case, options};
use kda_kernels::testing::{
    check_prefill_folds_the_ring_first, check_prefill_in_two_pieces_matches_one,
    check_prefill_matches_reference, Case,
};
use kda_kernels::{BetaMode, CpuBackend, GateMode, KdaOptions};
use proptest::prelude::*;
use state_pool::{Dtype, StateLayout};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn chunked_prefill_matches_the_f64_recurrence_within_1e5_for_an_fp32_pool(
        case in fp32_case(150, Just(0usize)), seed in any::<u64>()
    ) {
        let (eo, es) = check_prefill_matches_reference(&CpuBackend, &case, seed);
        prop_assert!(eo <= 1e-5 && es <= 1e-5, "errors {eo:.2e} {es:.2e}");
    }

    #[test]
    fn prefill_matches_the_f64_recurrence_within_one_rounding_for_every_dtype(
        case in any_case(100, 0usize..=4), seed in any::<u64>()
    ) {
        check_prefill_matches_reference(&CpuBackend, &case, seed);
    }

    #[test]
    fn prefill_in_two_arbitrary_pieces_equals_prefill_in_one_piece(
        case in any_case(140, Just(0usize)),
        cuts in prop::collection::vec(0.0f64..=1.0, 3),
        seed in any::<u64>(),
    ) {
        let splits: Vec<usize> = case
            .seq_lens
            .iter()
            .zip(&cuts)
            .map(|(&l, &c)| ((l as f64 * c).round() as usize).min(l))
            .collect();
        check_prefill_in_two_pieces_matches_one(&CpuBackend, &case, &splits, seed);
    }

    #[test]
    fn prefill_folds_pending_ring_entries_and_drops_drafts_first(
        case in fp32_case(80, 1usize..=5), seed in any::<u64>()
    ) {
        check_prefill_folds_the_ring_first(&CpuBackend, &case, seed);
    }
}

#[test]
fn prefill_at_the_production_head_size_matches_the_f64_recurrence() {
    // K = V = 128 with GVA and three chunks in one sequence.
    for layout in [StateLayout::KFirst, StateLayout::VFirst] {
        let case = Case {
            layout,
            ..Case::new(2, 4, 128, 128).with_seqs(&[150, 1, 0], &[3, 0, 1])
        };
        let (eo, es) = check_prefill_matches_reference(&CpuBackend, &case, 128);
        assert!(
            eo <= 1e-5 && es <= 1e-5,
            "{layout:?}: errors {eo:.2e} {es:.2e}"
        );
    }
}

#[test]
fn prefill_matches_the_f64_recurrence_for_every_option_combination() {
    let gates = [
        GateMode::Activated,
        GateMode::Softplus,
        GateMode::LowerBound(-5.0),
    ];
    let betas = [BetaMode::Activated, BetaMode::Sigmoid];
    let mut seed = 0;
    for gate in gates {
        for beta in betas {
            for allow_neg_eigval in [false, true] {
                for l2norm_qk in [false, true] {
                    for layout in [StateLayout::KFirst, StateLayout::VFirst] {
                        for state_dtype in Dtype::ALL {
                            for input_dtype in Dtype::ALL {
                                seed += 1;
                                let case = Case {
                                    layout,
                                    state_dtype,
                                    input_dtype,
                                    opts: KdaOptions {
                                        scale: None,
                                        l2norm_qk,
                                        gate,
                                        beta,
                                        allow_neg_eigval,
                                    },
                                    ..Case::new(2, 4, 6, 5).with_seqs(&[70, 3], &[2, 0])
                                };
                                check_prefill_matches_reference(&CpuBackend, &case, seed);
                            }
                        }
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    #[test]
    fn prefill_with_stochastic_rounding_stays_within_one_ulp_of_the_recurrence(
        opts in options(), seed in any::<u64>(), sr in any::<u64>()
    ) {
        for state_dtype in [Dtype::Fp16, Dtype::Bf16] {
            let case = Case {
                state_dtype,
                rounding: state_pool::Rounding::Stochastic { seed: sr },
                opts,
                ..Case::new(1, 3, 7, 4).with_seqs(&[65, 0], &[0, 2])
            };
            check_prefill_matches_reference(&CpuBackend, &case, seed);
        }
    }
}
