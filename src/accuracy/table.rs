//! The seed's accuracy table: `n` sequences of `seq_len` tokens in one varlen prefill, and the
//! same tokens through decode (eager and with replay rings), for fp16 and bf16 pools with
//! nearest and stochastic rounding, against an fp32 pool.

use indicatif::ProgressBar;
use kda_kernels::{Backend, KernelError, Result};
use state_pool::Dtype;

use super::{batch, geometry, kernel_options, DecodeBank, RoundingKind, Variant};
use crate::harness::{DeviceInputs, DeviceLayer, DeviceParams, DeviceTensor};
use crate::host_tensor::{rel_frobenius, ErrorAccumulator};
use crate::inputs::{self, Dims, GateParams, Stream, Tokens};

/// What the table measures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TableSpec {
    /// Head shape.
    pub dims: Dims,
    /// Sequences (each in its own slot).
    pub seqs: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Replay rings measured besides eager decode.
    pub rings: Vec<usize>,
    /// Dtype of the input and output tensors (the values are bf16 either way).
    pub io_dtype: Dtype,
    /// Seed of the inputs and of stochastic rounding.
    pub seed: u64,
}

/// How the tokens went through the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Path {
    /// One varlen chunked prefill.
    Prefill,
    /// Token by token decode (flushed before the state is read when there is a ring).
    Decode,
}

/// One row: a 2-byte pool against the fp32 pool on the same path.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TableRow {
    /// The pool's state dtype.
    pub state_dtype: Dtype,
    /// Its rounding.
    pub rounding: RoundingKind,
    /// Prefill or decode.
    pub path: Path,
    /// The replay ring (0 for prefill and eager decode).
    pub ring_len: usize,
    /// Relative Frobenius error of all outputs.
    pub output_rel_err: f64,
    /// Relative Frobenius error of the final states (all sequences).
    pub state_rel_err: f64,
}

/// Consistency checks of the fp32 pools, measured in the same run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Fp32Checks {
    /// fp32 decode with the largest ring against eager fp32 decode, outputs (expected 0).
    pub ring_vs_eager_output: f64,
    /// The same for the final state (expected 0: the ring is bit-exact for fp32).
    pub ring_vs_eager_state: f64,
    /// fp32 eager decode against fp32 chunked prefill, outputs: the f32 arithmetic floor
    /// (absent where the backend has no prefill).
    pub decode_vs_prefill_output: Option<f64>,
    /// The same for the final state.
    pub decode_vs_prefill_state: Option<f64>,
}

/// The table's results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TableResult {
    /// What was measured.
    pub spec: TableSpec,
    /// fp16 then bf16; nearest then stochastic; prefill, then decode ring 0 and each ring.
    pub rows: Vec<TableRow>,
    /// The fp32 pools' own consistency.
    pub fp32_checks: Fp32Checks,
    /// Why the prefill rows are missing, when the backend does not support prefill.
    pub prefill_skipped: Option<String>,
}

/// Per pool: its variant, its prefill outputs and its final states.
type PrefillRun = (Variant, Vec<f32>, Vec<f32>);

/// Prefill through each pool of `variants` (one varlen call each); `None` when the backend
/// does not support prefill.
#[allow(clippy::too_many_arguments)]
fn prefill_all<B: Backend>(
    be: &B,
    spec: &TableSpec,
    variants: &[Variant],
    tokens: &Tokens,
    initial: &[f32],
    params: &DeviceParams<B>,
) -> Result<Option<Vec<PrefillRun>>> {
    let dims = spec.dims;
    let prefill_batch = batch(be, &vec![spec.seq_len; spec.seqs])?;
    let prefill_inputs = DeviceInputs::upload(be, tokens, spec.io_dtype)?;
    let mut runs = Vec::new();
    for &variant in variants {
        let g = geometry(dims, spec.seqs, variant, spec.io_dtype, spec.seed);
        let mut layer = DeviceLayer::new(be, g)?;
        for (slot, s) in initial.chunks_exact(dims.state_elems()).enumerate() {
            layer.write_state(be, slot, s)?;
        }
        let mut out = DeviceTensor::poisoned(be, spec.io_dtype, tokens.len * dims.hv * dims.v)?;
        match layer.prefill(
            be,
            &prefill_batch,
            &prefill_inputs,
            params,
            &kernel_options(),
            &mut out,
        ) {
            Err(KernelError::Unsupported { .. }) => return Ok(None),
            other => other?,
        }
        let mut states = Vec::new();
        for slot in 0..spec.seqs {
            states.extend(layer.read_state(be, slot)?);
        }
        runs.push((variant, out.to_f32(be)?, states));
    }
    Ok(Some(runs))
}

/// Runs the table on `be`, advancing `progress` by one per decode step.
pub fn run<B: Backend>(be: &B, spec: &TableSpec, progress: &ProgressBar) -> Result<TableResult> {
    let dims = spec.dims;
    let params = GateParams::draw(&mut inputs::rng(spec.seed, Stream::GateParams), dims);
    let initial = inputs::initial_state(
        &mut inputs::rng(spec.seed, Stream::InitialState),
        dims,
        spec.seqs,
    );
    let tokens = Tokens::draw(
        &mut inputs::rng(spec.seed, Stream::Tokens),
        dims,
        spec.seqs * spec.seq_len,
    );
    let device_params = DeviceParams::upload(be, &params)?;

    // Prefill: one varlen call per pool.
    let prefill_variants: Vec<Variant> = std::iter::once(Variant::FP32)
        .chain(Variant::two_byte(&[0]))
        .collect();
    let prefill = prefill_all(
        be,
        spec,
        &prefill_variants,
        &tokens,
        &initial,
        &device_params,
    )?;

    // Decode: all pools in lockstep, one token of every sequence per step.
    let largest_ring = spec.rings.iter().copied().max().unwrap_or(0);
    let mut rings = vec![0];
    rings.extend(spec.rings.iter().copied().filter(|&r| r > 0));
    let mut decode_variants = vec![Variant::FP32];
    if largest_ring > 0 {
        decode_variants.push(Variant {
            ring_len: largest_ring,
            ..Variant::FP32
        });
    }
    decode_variants.extend(Variant::two_byte(&rings));
    let mut bank = DecodeBank::new(
        be,
        dims,
        &decode_variants,
        spec.seqs,
        &initial,
        device_params,
        spec.io_dtype,
        spec.seed,
    )?;
    let mut out_err = vec![ErrorAccumulator::default(); decode_variants.len()];
    let mut fp32_decode_out = vec![0f32; tokens.len * dims.hv * dims.v];
    let row = dims.hv * dims.v;
    for t in 0..spec.seq_len {
        let idx: Vec<usize> = (0..spec.seqs).map(|s| s * spec.seq_len + t).collect();
        let step_inputs = DeviceInputs::upload(be, &tokens.gather(&idx), spec.io_dtype)?;
        let outs = bank.step(be, &step_inputs)?;
        for (acc, out) in out_err.iter_mut().zip(&outs) {
            acc.add(out, &outs[0]);
        }
        for (s, &i) in idx.iter().enumerate() {
            fp32_decode_out[i * row..(i + 1) * row]
                .copy_from_slice(&outs[0][s * row..(s + 1) * row]);
        }
        progress.inc(1);
    }
    let decode_states = bank.states(be, false)?;

    let reference = prefill.as_ref().and_then(|runs| runs.first());
    let mut rows = Vec::new();
    for state_dtype in [Dtype::Fp16, Dtype::Bf16] {
        for rounding in RoundingKind::ALL {
            let found = prefill
                .iter()
                .flatten()
                .find(|(v, _, _)| v.state_dtype == state_dtype && v.rounding == rounding);
            if let (Some((_, out, state)), Some((_, ref_out, ref_state))) = (found, reference) {
                rows.push(TableRow {
                    state_dtype,
                    rounding,
                    path: Path::Prefill,
                    ring_len: 0,
                    output_rel_err: rel_frobenius(out, ref_out),
                    state_rel_err: rel_frobenius(state, ref_state),
                });
            }
            for (i, v) in decode_variants.iter().enumerate() {
                if v.state_dtype == state_dtype && v.rounding == rounding {
                    rows.push(TableRow {
                        state_dtype,
                        rounding,
                        path: Path::Decode,
                        ring_len: v.ring_len,
                        output_rel_err: out_err[i].relative(),
                        state_rel_err: rel_frobenius(&decode_states[i], &decode_states[0]),
                    });
                }
            }
        }
    }
    let ring_check = usize::from(largest_ring > 0);
    let fp32_checks = Fp32Checks {
        ring_vs_eager_output: out_err[ring_check].relative(),
        ring_vs_eager_state: rel_frobenius(&decode_states[ring_check], &decode_states[0]),
        decode_vs_prefill_output: reference.map(|(_, o, _)| rel_frobenius(&fp32_decode_out, o)),
        decode_vs_prefill_state: reference.map(|(_, _, s)| rel_frobenius(&decode_states[0], s)),
    };
    Ok(TableResult {
        spec: spec.clone(),
        rows,
        fp32_checks,
        prefill_skipped: prefill
            .is_none()
            .then(|| format!("the {} backend does not support prefill", be.name())),
    })
}
