//! The accuracy experiments of `kda-pool accuracy`: 2-byte state pools (fp16, bf16; nearest
//! and stochastic rounding; eager decode and replay rings) against an fp32 pool, on any
//! backend.
//!
//! - [`table`]: the seed's setting (two sequences of 1024 tokens, 12 heads, K = V = 128)
//!   through prefill and through decode;
//! - [`sweep`]: the errors against decode length;
//! - [`plot`]: the sweep as a log-log PNG.

pub mod plot;
pub mod sweep;
pub mod table;

use kda_kernels::{Backend, BatchPlan, BetaMode, CuSeqlens, GateMode, KdaOptions, Result};
use state_pool::{Dtype, PoolGeometry, Rounding, StateLayout};

use crate::harness::{DeviceInputs, DeviceLayer, DeviceParams, DeviceTensor};
use crate::inputs::Dims;

/// How a pool rounds its 2-byte stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RoundingKind {
    /// Round to nearest even.
    Nearest,
    /// Stochastic rounding keyed by the run's seed.
    Stochastic,
}

impl RoundingKind {
    /// Both kinds.
    pub const ALL: [RoundingKind; 2] = [RoundingKind::Nearest, RoundingKind::Stochastic];

    /// The pool setting for a run with `seed`.
    pub fn rounding(self, seed: u64) -> Rounding {
        match self {
            Self::Nearest => Rounding::Nearest,
            Self::Stochastic => Rounding::Stochastic { seed },
        }
    }

    /// `nearest` or `stochastic`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Nearest => "nearest",
            Self::Stochastic => "stochastic",
        }
    }
}

/// One pool configuration under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Variant {
    /// The pool's state dtype.
    pub state_dtype: Dtype,
    /// Its rounding of 2-byte stores.
    pub rounding: RoundingKind,
    /// Its replay ring (0: eager decode).
    pub ring_len: usize,
}

impl Variant {
    /// The fp32 reference pool (eager).
    pub const FP32: Variant = Variant {
        state_dtype: Dtype::Fp32,
        rounding: RoundingKind::Nearest,
        ring_len: 0,
    };

    /// The 2-byte variants: fp16 and bf16, nearest then stochastic, for each ring in `rings`.
    pub fn two_byte(rings: &[usize]) -> Vec<Variant> {
        let mut out = Vec::new();
        for state_dtype in [Dtype::Fp16, Dtype::Bf16] {
            for rounding in RoundingKind::ALL {
                for &ring_len in rings {
                    out.push(Variant {
                        state_dtype,
                        rounding,
                        ring_len,
                    });
                }
            }
        }
        out
    }

    /// A short label: `fp16 nearest ring 8`.
    pub fn label(&self) -> String {
        format!(
            "{} {} ring {}",
            self.state_dtype,
            self.rounding.name(),
            self.ring_len
        )
    }
}

/// The layer options of every accuracy run: q and k l2-normalised, the softplus gate and the
/// beta sigmoid in the kernel, default scale.
pub fn kernel_options() -> KdaOptions {
    KdaOptions {
        scale: None,
        l2norm_qk: true,
        gate: GateMode::Softplus,
        beta: BetaMode::Sigmoid,
        allow_neg_eigval: false,
    }
}

/// The geometry of a one-layer pool of `slots` slots for `variant` (no conv plane, K-first).
pub fn geometry(
    dims: Dims,
    slots: usize,
    variant: Variant,
    io_dtype: Dtype,
    seed: u64,
) -> PoolGeometry {
    PoolGeometry {
        layers: 1,
        h: dims.h,
        hv: dims.hv,
        k: dims.k,
        v: dims.v,
        conv_rows: 0,
        conv_channels: 0,
        conv_dtype: Dtype::Bf16,
        state_dtype: variant.state_dtype,
        layout: StateLayout::KFirst,
        ring_len: variant.ring_len,
        ring_dtype: io_dtype,
        ring_deltas: false,
        slots,
        checkpoint_slots: 0,
        rounding: variant.rounding.rounding(seed),
    }
}

/// A prepared batch of `n` sequences in slots `0..n`, with the given lengths.
pub fn batch<B: Backend>(be: &B, lens: &[usize]) -> Result<B::Batch> {
    let mut bounds = vec![0i64];
    for &l in lens {
        bounds.push(bounds[bounds.len() - 1] + l as i64);
    }
    let slots: Vec<u32> = (0..lens.len() as u32).collect();
    let total = *bounds.last().unwrap_or(&0) as usize;
    be.prepare(BatchPlan::new(CuSeqlens::I64(&bounds), &slots, total)?)
}

/// Several pools stepped in lockstep through the same decode tokens: `n` sequences of one
/// token per step, each pool in its own [`Variant`].
pub struct DecodeBank<B: Backend> {
    runs: Vec<(Variant, DeviceLayer<B>, DeviceTensor<B>)>,
    step_batch: B::Batch,
    flush_batch: B::Batch,
    params: DeviceParams<B>,
    opts: KdaOptions,
    /// NaNs in the output dtype, written over each output buffer before a step.
    poison: Vec<u8>,
}

impl<B: Backend> DecodeBank<B> {
    /// One pool per variant, `n` slots each, holding `initial` (`[n, HV, K, V]`, rounded to
    /// nearest in each pool's dtype).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        be: &B,
        dims: Dims,
        variants: &[Variant],
        n: usize,
        initial: &[f32],
        params: DeviceParams<B>,
        io_dtype: Dtype,
        seed: u64,
    ) -> Result<Self> {
        let mut runs = Vec::with_capacity(variants.len());
        for &variant in variants {
            let mut layer = DeviceLayer::new(be, geometry(dims, n, variant, io_dtype, seed))?;
            for (slot, state) in initial.chunks_exact(dims.state_elems()).enumerate() {
                layer.write_state(be, slot, state)?;
            }
            let out = DeviceTensor::poisoned(be, io_dtype, n * dims.hv * dims.v)?;
            runs.push((variant, layer, out));
        }
        Ok(Self {
            runs,
            step_batch: batch(be, &vec![1; n])?,
            flush_batch: batch(be, &vec![0; n])?,
            params,
            opts: kernel_options(),
            poison: io_dtype.encode_f32(&vec![f32::NAN; n * dims.hv * dims.v]),
        })
    }

    /// One decode step of every pool on `inputs` (one token per sequence, `[n, ...]`); returns
    /// each pool's outputs `[n, HV, V]` as f32.
    pub fn step(&mut self, be: &B, inputs: &DeviceInputs<B>) -> Result<Vec<Vec<f32>>> {
        let mut outs = Vec::with_capacity(self.runs.len());
        for (_, layer, out) in &mut self.runs {
            out.overwrite(be, &self.poison)?;
            layer.decode(be, &self.step_batch, inputs, &self.params, &self.opts, out)?;
            outs.push(out.to_f32(be)?);
        }
        Ok(outs)
    }

    /// Every pool's true states `[n, HV, K, V]`: a pool with a ring is flushed first. With
    /// `keep_going`, each pool is put back as it was before the flush, so the measurement
    /// does not change the rest of the run (no extra rounding, same stochastic stream).
    pub fn states(&mut self, be: &B, keep_going: bool) -> Result<Vec<Vec<f32>>> {
        let mut all = Vec::with_capacity(self.runs.len());
        let n = self.flush_batch.as_ref().num_seqs();
        for (variant, layer, _) in &mut self.runs {
            let snapshot = if keep_going && variant.ring_len > 0 {
                Some(layer.snapshot(be)?)
            } else {
                None
            };
            if variant.ring_len > 0 {
                layer.replay(be, &self.flush_batch, &self.params, &self.opts)?;
            }
            let mut states = Vec::new();
            for slot in 0..n {
                states.extend(layer.read_state(be, slot)?);
            }
            if let Some(snap) = snapshot {
                layer.restore(be, &snap)?;
            }
            all.push(states);
        }
        Ok(all)
    }
}
