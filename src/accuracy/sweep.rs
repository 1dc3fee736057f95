//! The length sweep: decode steps of fresh tokens through 2-byte pools and an fp32 pool in
//! lockstep, with the errors measured at doubling lengths. A measurement flushes each ring on
//! a copy of the pool's state (snapshot, flush, read, restore), so it does not change the run.

use indicatif::ProgressBar;
use kda_kernels::{Backend, Result};
use state_pool::Dtype;

use super::{DecodeBank, Variant};
use crate::harness::{DeviceInputs, DeviceParams};
use crate::host_tensor::{rel_frobenius, ErrorAccumulator};
use crate::inputs::{self, Dims, GateParams, Stream, Tokens};

/// The first length of the sweep, in decode steps.
pub const FIRST_LENGTH: usize = 1024;

/// What the sweep measures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SweepSpec {
    /// Head shape (the sweep may use fewer heads than the table to stay fast).
    pub dims: Dims,
    /// Sequences decoded side by side (one token each per step).
    pub seqs: usize,
    /// Lengths at which the errors are measured, ascending; the last is the run's length.
    pub lengths: Vec<usize>,
    /// Rings measured (0: eager decode).
    pub rings: Vec<usize>,
    /// Dtype of the input and output tensors (the values are bf16 either way).
    pub io_dtype: Dtype,
    /// Seed of the inputs and of stochastic rounding.
    pub seed: u64,
}

/// The errors of one 2-byte pool at each length.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SweepSeries {
    /// The pool's configuration.
    #[serde(flatten)]
    pub variant: Variant,
    /// Relative Frobenius error of the outputs of the steps since the previous length
    /// (`(lengths[i-1], lengths[i]]`).
    pub output_rel_err: Vec<f64>,
    /// Relative Frobenius error of the state after `lengths[i]` steps.
    pub state_rel_err: Vec<f64>,
}

/// The sweep's results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SweepResult {
    /// What was measured.
    pub spec: SweepSpec,
    /// One series per 2-byte pool.
    pub series: Vec<SweepSeries>,
}

/// The lengths of a sweep up to `max_len`: 1024, 2048, ... doubling while at most `max_len`,
/// then `max_len` itself if it is not already the last (just `max_len` below 1024).
pub fn lengths(max_len: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut l = FIRST_LENGTH;
    while l <= max_len {
        out.push(l);
        l *= 2;
    }
    if out.last() != Some(&max_len) && max_len > 0 {
        out.push(max_len);
    }
    out
}

/// Runs the sweep on `be`, advancing `progress` by one per decode step.
pub fn run<B: Backend>(be: &B, spec: &SweepSpec, progress: &ProgressBar) -> Result<SweepResult> {
    let dims: Dims = spec.dims;
    let params = GateParams::draw(&mut inputs::rng(spec.seed, Stream::GateParams), dims);
    let initial = inputs::initial_state(
        &mut inputs::rng(spec.seed, Stream::InitialState),
        dims,
        spec.seqs,
    );
    let mut token_rng = inputs::rng(spec.seed, Stream::Tokens);
    let variants: Vec<Variant> = std::iter::once(Variant::FP32)
        .chain(Variant::two_byte(&spec.rings))
        .collect();
    let mut bank = DecodeBank::new(
        be,
        dims,
        &variants,
        spec.seqs,
        &initial,
        DeviceParams::upload(be, &params)?,
        spec.io_dtype,
        spec.seed,
    )?;
    let mut series: Vec<SweepSeries> = variants[1..]
        .iter()
        .map(|&variant| SweepSeries {
            variant,
            output_rel_err: Vec::new(),
            state_rel_err: Vec::new(),
        })
        .collect();
    let mut window = vec![ErrorAccumulator::default(); series.len()];
    let mut step = 0;
    for &len in &spec.lengths {
        while step < len {
            let tokens = Tokens::draw(&mut token_rng, dims, spec.seqs);
            let outs = bank.step(be, &DeviceInputs::upload(be, &tokens, spec.io_dtype)?)?;
            for (acc, out) in window.iter_mut().zip(&outs[1..]) {
                acc.add(out, &outs[0]);
            }
            step += 1;
            progress.inc(1);
        }
        let states = bank.states(be, true)?;
        for ((s, acc), state) in series.iter_mut().zip(&mut window).zip(&states[1..]) {
            s.output_rel_err.push(acc.relative());
            s.state_rel_err.push(rel_frobenius(state, &states[0]));
            acc.reset();
        }
    }
    Ok(SweepResult {
        spec: spec.clone(),
        series,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_double_from_1024_and_end_at_max_len() {
        assert_eq!(lengths(65536).len(), 7);
        assert_eq!(lengths(65536)[0], 1024);
        assert_eq!(*lengths(65536).last().unwrap(), 65536);
        assert_eq!(lengths(3000), vec![1024, 2048, 3000]);
        assert_eq!(lengths(100), vec![100]);
        assert!(lengths(0).is_empty());
    }
}
