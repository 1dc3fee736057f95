//! Padded batches on the CPU backend (`Backend::prepare_padded`, `update_batch`): a call
//! computes the batch's live sequences exactly as a plain batch of them does, and touches
//! nothing of the padding; bad updates and pools too small for the batch are refused. The GPU
//! tests run the same body on the CUDA backend.

use kda_kernels::testing::{check_padded_batch_matches_plain_batches, Case, PaddedOp};
use kda_kernels::CpuBackend;
use state_pool::{Dtype, Rounding};

/// Live sequences per step: all, one, none, then others.
const LIVES: [usize; 6] = [6, 1, 0, 4, 2, 6];

/// A case of small heads (GVA, 2 q/k heads and 4 value heads) over a pool of 12 slots, every one
/// of them holding a random state.
fn case(state: Dtype, input: Dtype, ring_len: usize, rounding: Rounding) -> Case {
    let every: Vec<u32> = (0..12).collect();
    Case {
        state_dtype: state,
        input_dtype: input,
        ring_len,
        rounding,
        ..Case::new(2, 4, 16, 8).with_seqs(&[1; 12], &every)
    }
}

#[test]
fn a_padded_decode_computes_its_live_sequences_as_a_plain_batch_does() {
    let stochastic = Rounding::Stochastic { seed: 51 };
    for (i, (state, ring_len, rounding)) in [
        (Dtype::Fp32, 0, Rounding::Nearest),
        (Dtype::Bf16, 0, Rounding::Nearest),
        (Dtype::Fp16, 0, stochastic),
        (Dtype::Fp16, 4, Rounding::Nearest),
    ]
    .into_iter()
    .enumerate()
    {
        let c = case(state, Dtype::Bf16, ring_len, rounding);
        check_padded_batch_matches_plain_batches(
            &CpuBackend,
            &c,
            6,
            1,
            PaddedOp::Decode,
            &LIVES,
            51 + i as u64,
        );
    }
}

#[test]
fn a_padded_spec_verify_computes_its_live_sequences_as_a_plain_batch_does() {
    for (i, state) in [Dtype::Fp32, Dtype::Fp16].into_iter().enumerate() {
        let c = case(state, Dtype::Fp32, 6, Rounding::Nearest);
        check_padded_batch_matches_plain_batches(
            &CpuBackend,
            &c,
            6,
            2,
            PaddedOp::SpecVerify,
            &LIVES,
            61 + i as u64,
        );
    }
}

#[test]
fn a_padded_prefill_computes_its_live_sequences_as_a_plain_batch_does() {
    let stochastic = Rounding::Stochastic { seed: 71 };
    for (i, (state, ring_len, rounding)) in [
        (Dtype::Fp32, 0, Rounding::Nearest),
        (Dtype::Bf16, 0, stochastic),
        (Dtype::Fp16, 4, Rounding::Nearest),
    ]
    .into_iter()
    .enumerate()
    {
        let c = case(state, Dtype::Bf16, ring_len, rounding);
        check_padded_batch_matches_plain_batches(
            &CpuBackend,
            &c,
            6,
            5,
            PaddedOp::Prefill,
            &LIVES,
            71 + i as u64,
        );
    }
}
