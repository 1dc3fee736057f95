//! Test cases and host data: shapes and pool settings ([`Case`]), fresh random inputs
//! ([`HostInputs`]), element encoding, and error measures.

use rand::rngs::StdRng;
use rand::Rng;
use rand_distr::StandardNormal;
use state_pool::{Dtype, PoolGeometry, Rounding, StateLayout};

use crate::api::{BatchPlan, BetaMode, CuSeqlens, GateMode, KdaOptions};
use crate::cpu::reference::{Dims, RefInputs};
use crate::error::Result;

/// One test configuration: head dims, the batch, the pool's settings and the options.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    /// q/k heads.
    pub h: usize,
    /// Value heads (a multiple of `h`).
    pub hv: usize,
    /// Key head dim.
    pub k: usize,
    /// Value head dim.
    pub v: usize,
    /// Tokens of each sequence.
    pub seq_lens: Vec<usize>,
    /// The pool slot of each sequence (distinct, below `total_slots`).
    pub slots: Vec<u32>,
    /// Request slots of the pool (the slots not named are poisoned and must stay untouched).
    pub total_slots: usize,
    /// Element type of the state.
    pub state_dtype: Dtype,
    /// Element type of q, k, v, g, beta, the output and the ring.
    pub input_dtype: Dtype,
    /// State layout.
    pub layout: StateLayout,
    /// Replay-ring length (0: eager).
    pub ring_len: usize,
    /// Whether the pool has a delta plane (`PoolGeometry::ring_deltas`).
    pub ring_deltas: bool,
    /// Rounding of 2-byte state stores.
    pub rounding: Rounding,
    /// Options of every call.
    pub opts: KdaOptions,
}

impl Case {
    /// A case with dims `h, hv, k, v`, one sequence of 5 tokens in slot 1 of 3, an fp32 pool
    /// and fp32 inputs, K-first, no ring (and no delta plane), q/k l2norm and both activations
    /// in the kernel.
    pub fn new(h: usize, hv: usize, k: usize, v: usize) -> Self {
        Self {
            h,
            hv,
            k,
            v,
            seq_lens: vec![5],
            slots: vec![1],
            total_slots: 3,
            state_dtype: Dtype::Fp32,
            input_dtype: Dtype::Fp32,
            layout: StateLayout::KFirst,
            ring_len: 0,
            ring_deltas: false,
            rounding: Rounding::Nearest,
            opts: KdaOptions {
                scale: None,
                l2norm_qk: true,
                gate: GateMode::Softplus,
                beta: BetaMode::Sigmoid,
                allow_neg_eigval: false,
            },
        }
    }

    /// The same case with sequences of `lens` in slots `slots`.
    pub fn with_seqs(mut self, lens: &[usize], slots: &[u32]) -> Self {
        self.seq_lens = lens.to_vec();
        self.slots = slots.to_vec();
        self.total_slots = self
            .total_slots
            .max(slots.iter().map(|&s| s as usize + 1).max().unwrap_or(0));
        self
    }

    /// The head dims.
    pub fn dims(&self) -> Dims {
        Dims {
            h: self.h,
            hv: self.hv,
            k: self.k,
            v: self.v,
        }
    }

    /// Token offsets of the sequences, length N + 1.
    pub fn bounds(&self) -> Vec<usize> {
        bounds_of(&self.seq_lens)
    }

    /// Total tokens.
    pub fn num_tokens(&self) -> usize {
        self.seq_lens.iter().sum()
    }

    /// The pool geometry of the case: one layer, a small conv plane (never touched by the
    /// kernels), the ring in the input dtype.
    pub fn geometry(&self) -> PoolGeometry {
        PoolGeometry {
            layers: 1,
            h: self.h,
            hv: self.hv,
            k: self.k,
            v: self.v,
            conv_rows: 2,
            conv_channels: 3,
            conv_dtype: Dtype::Bf16,
            state_dtype: self.state_dtype,
            layout: self.layout,
            ring_len: self.ring_len,
            ring_dtype: self.input_dtype,
            ring_deltas: self.ring_deltas,
            slots: self.total_slots,
            checkpoint_slots: 0,
            rounding: self.rounding,
        }
    }
}

/// Token offsets `[0, l0, l0 + l1, ...]` of sequences of `lens` tokens.
pub fn bounds_of(lens: &[usize]) -> Vec<usize> {
    let mut b = Vec::with_capacity(lens.len() + 1);
    b.push(0);
    for &l in lens {
        b.push(b.last().copied().unwrap_or(0) + l);
    }
    b
}

/// A validated batch of sequences `bounds` in `slots`.
pub fn batch_plan(bounds: &[usize], slots: &[u32]) -> Result<BatchPlan> {
    let cu: Vec<i64> = bounds.iter().map(|&b| b as i64).collect();
    BatchPlan::new(
        CuSeqlens::I64(&cu),
        slots,
        bounds.last().copied().unwrap_or(0),
    )
}

/// A standard normal f32.
pub fn normal(rng: &mut StdRng) -> f32 {
    rng.sample(StandardNormal)
}

/// `A_log = ln U(1, 16)`, `[hv]`.
pub fn random_a_log(rng: &mut StdRng, hv: usize) -> Vec<f32> {
    (0..hv)
        .map(|_| rng.random_range(1.0f32..16.0).ln())
        .collect()
}

/// `dt_bias` as fla initialises it: `dt = exp(U(ln 1e-3, ln 0.1))` floored at 1e-4, then
/// the inverse softplus `dt + ln(-expm1(-dt))`; `n` values.
pub fn fla_dt_bias(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let (lo, hi) = (1e-3f64.ln(), 0.1f64.ln());
    (0..n)
        .map(|_| {
            let dt = rng.random_range(lo..hi).exp().max(1e-4);
            (dt + (-(-dt).exp_m1()).ln()) as f32
        })
        .collect()
}

/// Random states, `n` sequences of `[HV][K][V]` values N(0, 0.5^2), rounded to `dtype`.
pub fn random_states(rng: &mut StdRng, dims: Dims, n: usize, dtype: Dtype) -> Vec<f32> {
    (0..n * dims.state_elems())
        .map(|_| dtype.round_f32(0.5 * normal(rng)))
        .collect()
}

/// The inputs of one call as host f32 values, each exactly representable in `dtype`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostInputs {
    /// Head dims.
    pub dims: Dims,
    /// Element type the inputs are uploaded in.
    pub dtype: Dtype,
    /// Tokens.
    pub tokens: usize,
    /// `[T, H, K]`.
    pub q: Vec<f32>,
    /// `[T, H, K]`.
    pub k: Vec<f32>,
    /// `[T, HV, V]`.
    pub v: Vec<f32>,
    /// `[T, HV, K]`: raw gate, or the activated log-decay for [`GateMode::Activated`].
    pub g: Vec<f32>,
    /// `[T, HV]`: raw beta, or activated for [`BetaMode::Activated`].
    pub beta: Vec<f32>,
    /// `[HV]`.
    pub a_log: Vec<f32>,
    /// `[HV * K]`.
    pub dt_bias: Vec<f32>,
}

impl HostInputs {
    /// Fresh random inputs for `tokens` tokens: q, k, v, raw gate and raw beta N(0, 1),
    /// `A_log = ln U(1, 16)`, `dt_bias` as fla initialises it. Where the options leave an
    /// activation to the caller, it is applied here (in f64, then rounded); where q and k are
    /// not l2-normalised in the kernel, they are normalised here, so the recurrence stays
    /// stable.
    pub fn random(
        rng: &mut StdRng,
        dims: Dims,
        tokens: usize,
        opts: &KdaOptions,
        dtype: Dtype,
    ) -> Self {
        let Dims { h, hv, k, v } = dims;
        let a_log = random_a_log(rng, hv);
        let dt_bias = fla_dt_bias(rng, hv * k);
        let mut unit_rows = |rows: usize| -> Vec<f32> {
            let mut x: Vec<f32> = (0..rows * k).map(|_| normal(rng)).collect();
            if !opts.l2norm_qk {
                for r in x.chunks_exact_mut(k) {
                    let n = r.iter().map(|a| a * a).sum::<f32>().sqrt().max(1e-3);
                    r.iter_mut().for_each(|a| *a /= n);
                }
            }
            x
        };
        let q = unit_rows(tokens * h);
        let kk = unit_rows(tokens * h);
        let vv: Vec<f32> = (0..tokens * hv * v).map(|_| normal(rng)).collect();
        let mut g: Vec<f32> = (0..tokens * hv * k).map(|_| normal(rng)).collect();
        if opts.gate == GateMode::Activated {
            for (i, x) in g.iter_mut().enumerate() {
                let head = (i / k) % hv;
                let z = *x as f64 + dt_bias[head * k + i % k] as f64;
                let sp = if z > 20.0 { z } else { z.exp().ln_1p() };
                *x = (-(a_log[head] as f64).exp() * sp) as f32;
            }
        }
        let mut beta: Vec<f32> = (0..tokens * hv).map(|_| normal(rng)).collect();
        if opts.beta == BetaMode::Activated {
            for b in beta.iter_mut() {
                *b = (1.0 / (1.0 + (-*b as f64).exp())) as f32;
            }
        }
        let r = |x: Vec<f32>| x.into_iter().map(|a| dtype.round_f32(a)).collect();
        Self {
            dims,
            dtype,
            tokens,
            q: r(q),
            k: r(kk),
            v: r(vv),
            g: r(g),
            beta: r(beta),
            a_log,
            dt_bias,
        }
    }

    /// The tokens `idx`, in that order (the gate parameters are kept).
    pub fn gather(&self, idx: &[usize]) -> Self {
        let Dims { h, hv, k, v } = self.dims;
        let pick = |src: &[f32], row: usize| -> Vec<f32> {
            idx.iter()
                .flat_map(|&t| src[t * row..(t + 1) * row].iter().copied())
                .collect()
        };
        Self {
            dims: self.dims,
            dtype: self.dtype,
            tokens: idx.len(),
            q: pick(&self.q, h * k),
            k: pick(&self.k, h * k),
            v: pick(&self.v, hv * v),
            g: pick(&self.g, hv * k),
            beta: pick(&self.beta, hv),
            a_log: self.a_log.clone(),
            dt_bias: self.dt_bias.clone(),
        }
    }

    /// The same tokens under other gate parameters (so calls of one layer share them).
    pub fn with_gate_params(mut self, a_log: &[f32], dt_bias: &[f32]) -> Self {
        self.a_log = a_log.to_vec();
        self.dt_bias = dt_bias.to_vec();
        self
    }

    /// The f64 reference's view.
    pub fn as_ref_inputs(&self) -> RefInputs<'_> {
        RefInputs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: &self.g,
            beta: &self.beta,
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
        }
    }
}

/// `||got - want||_F / ||want||_F` (the absolute norm when `want` is zero).
pub fn rel_frobenius(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "compared tensors differ in length");
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(&a, &b)| (a as f64 - b).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| b * b).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// [`rel_frobenius`] of two f32 tensors.
pub fn rel_frobenius_f32(got: &[f32], want: &[f32]) -> f64 {
    rel_frobenius(got, &to_f64(want))
}

/// Widens to f64.
pub fn to_f64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&a| a as f64).collect()
}

/// The relative rounding error bound of nearest rounding to `dtype` (unit roundoff; 0 for
/// fp32).
pub fn unit_roundoff(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::Fp32 => 0.0,
        Dtype::Fp16 => 2f64.powi(-11),
        Dtype::Bf16 => 2f64.powi(-8),
    }
}
