//! Shared pieces of the fault tests: a small two-layer pool on the CPU backend, fresh random
//! inputs, the four operations over every layer, and byte snapshots of slots.

#![allow(dead_code)]

use kda_kernels::cpu::CpuBackend;
use kda_kernels::{
    Backend, BatchPlan, BetaMode, CuSeqlens, GateMode, IndexView, KdaOptions, StepInputs,
    TensorView, TensorViewMut,
};
use rand::rngs::StdRng;
use rand::Rng;
use rand_distr::StandardNormal;
use state_pool::{Dtype, HostBuffer, HostMemory, Plane, PoolGeometry, StateLayout, StatePool};

/// Two layers, H 2, HV 4, K 16, V 8, fp32 inputs and ring.
pub fn geometry(state: Dtype, ring_len: usize, slots: usize) -> PoolGeometry {
    PoolGeometry {
        layers: 2,
        h: 2,
        hv: 4,
        k: 16,
        v: 8,
        conv_rows: 3,
        conv_channels: 2 * 2 * 16 + 4 * 8,
        conv_dtype: Dtype::Bf16,
        state_dtype: state,
        layout: StateLayout::KFirst,
        ring_len,
        ring_dtype: Dtype::Fp32,
        ring_deltas: false,
        slots,
        checkpoint_slots: 2,
        rounding: Default::default(),
    }
}

/// The options of every call: q/k l2norm, gate and beta activated in the kernel.
pub fn opts() -> KdaOptions {
    KdaOptions {
        scale: None,
        l2norm_qk: true,
        gate: GateMode::Softplus,
        beta: BetaMode::Sigmoid,
        allow_neg_eigval: false,
    }
}

/// Tokens of inputs, token-major, f32.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub g: Vec<f32>,
    pub beta: Vec<f32>,
    pub len: usize,
}

fn normal(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.sample(StandardNormal)).collect()
}

impl Tokens {
    /// `len` tokens of fresh N(0, 1) inputs for `g`'s dims.
    pub fn random(rng: &mut StdRng, g: &PoolGeometry, len: usize) -> Self {
        Self {
            q: normal(rng, len * g.h * g.k),
            k: normal(rng, len * g.h * g.k),
            v: normal(rng, len * g.hv * g.v),
            g: normal(rng, len * g.hv * g.k),
            beta: normal(rng, len * g.hv),
            len,
        }
    }

    /// The tokens of several sequences, one after the other.
    pub fn concat(parts: &[&Tokens]) -> Self {
        let mut out = Tokens::default();
        for p in parts {
            out.q.extend_from_slice(&p.q);
            out.k.extend_from_slice(&p.k);
            out.v.extend_from_slice(&p.v);
            out.g.extend_from_slice(&p.g);
            out.beta.extend_from_slice(&p.beta);
            out.len += p.len;
        }
        out
    }
}

/// A pool on the CPU backend with per-layer gate parameters.
pub struct Rig {
    pub be: CpuBackend,
    pub pool: StatePool<HostMemory>,
    pub a_log: Vec<HostBuffer>,
    pub dt_bias: Vec<HostBuffer>,
}

impl Rig {
    pub fn new(g: PoolGeometry, rng: &mut StdRng) -> Self {
        let a_log = (0..g.layers)
            .map(|_| {
                let v: Vec<f32> = (0..g.hv)
                    .map(|_| rng.random_range(1.0f32..16.0).ln())
                    .collect();
                HostBuffer::from_slice(&v)
            })
            .collect();
        let dt_bias = (0..g.layers)
            .map(|_| {
                let v: Vec<f32> = (0..g.hv * g.k)
                    .map(|_| rng.random_range(-6.0f32..-2.0))
                    .collect();
                HostBuffer::from_slice(&v)
            })
            .collect();
        Self {
            be: CpuBackend::new(),
            pool: StatePool::new(HostMemory, g).unwrap(),
            a_log,
            dt_bias,
        }
    }
}

/// Which token-carrying operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Prefill,
    Decode,
    Verify,
}

pub fn plan(lens: &[usize], slots: &[u32]) -> BatchPlan {
    let mut cu = vec![0i64];
    for &l in lens {
        cu.push(cu.last().unwrap() + l as i64);
    }
    BatchPlan::new(CuSeqlens::I64(&cu), slots, *cu.last().unwrap() as usize).unwrap()
}

/// Runs `op` on `layer` of `pool` with backend `be` (any backend over host memory); the
/// output is poisoned with NaN first and returned.
#[allow(clippy::too_many_arguments)]
pub fn run_op<B: Backend<Memory = HostMemory>>(
    be: &B,
    pool: &mut StatePool<HostMemory>,
    a_log: &HostBuffer,
    dt_bias: &HostBuffer,
    layer: usize,
    op: Op,
    plan: &BatchPlan,
    t: &Tokens,
    accepted: &[u32],
) -> kda_kernels::Result<Vec<f32>> {
    let g = pool.geometry().clone();
    let bufs = [&t.q, &t.k, &t.v, &t.g, &t.beta].map(|x| HostBuffer::from_slice(x));
    let view = |i: usize, len: usize| TensorView {
        buf: &bufs[i],
        dtype: Dtype::Fp32,
        len,
    };
    let inputs = StepInputs {
        q: view(0, t.q.len()),
        k: view(1, t.k.len()),
        v: view(2, t.v.len()),
        g: view(3, t.g.len()),
        beta: view(4, t.beta.len()),
        a_log: Some(TensorView {
            buf: a_log,
            dtype: Dtype::Fp32,
            len: g.hv,
        }),
        dt_bias: Some(TensorView {
            buf: dt_bias,
            dtype: Dtype::Fp32,
            len: g.hv * g.k,
        }),
    };
    let n_out = t.len * g.hv * g.v;
    let mut out_buf = HostBuffer::from_slice(&vec![f32::NAN; n_out]);
    let mut out = TensorViewMut {
        buf: &mut out_buf,
        dtype: Dtype::Fp32,
        len: n_out,
    };
    let counts: Vec<u8> = accepted.iter().flat_map(|c| c.to_le_bytes()).collect();
    let counts = HostBuffer::from_bytes(&counts);
    let mut lv = pool.layer_mut(layer)?;
    let plan = &be.prepare(plan.clone())?;
    match op {
        Op::Prefill => be.prefill(plan, &inputs, &opts(), &mut lv, &mut out)?,
        Op::Decode => be.decode(plan, &inputs, &opts(), &mut lv, &mut out)?,
        Op::Verify => {
            let acc = IndexView {
                buf: &counts,
                len: accepted.len(),
            };
            be.spec_verify(plan, &acc, &inputs, &opts(), &mut lv, &mut out)?
        }
    }
    Ok(out_buf.typed::<f32>().to_vec())
}

impl Rig {
    /// `op` on every layer with the same tokens; the outputs of each layer.
    pub fn run(
        &mut self,
        op: Op,
        plan: &BatchPlan,
        t: &Tokens,
        accepted: &[u32],
    ) -> kda_kernels::Result<Vec<Vec<f32>>> {
        (0..self.pool.geometry().layers)
            .map(|l| {
                run_op(
                    &self.be,
                    &mut self.pool,
                    &self.a_log[l],
                    &self.dt_bias[l],
                    l,
                    op,
                    plan,
                    t,
                    accepted,
                )
            })
            .collect()
    }

    /// Flushes the rings of `slots` in every layer (accepted counts when given).
    pub fn replay(&mut self, slots: &[u32], accepted: Option<&[u32]>) -> kda_kernels::Result<()> {
        let p = self.be.prepare(plan(&vec![0; slots.len()], slots))?;
        let counts: Vec<u8> = accepted
            .unwrap_or(&[])
            .iter()
            .flat_map(|c| c.to_le_bytes())
            .collect();
        let counts = HostBuffer::from_bytes(&counts);
        let g = self.pool.geometry().clone();
        for l in 0..g.layers {
            let acc = accepted.map(|a| IndexView {
                buf: &counts,
                len: a.len(),
            });
            let a_log = TensorView {
                buf: &self.a_log[l],
                dtype: Dtype::Fp32,
                len: g.hv,
            };
            let dt_bias = TensorView {
                buf: &self.dt_bias[l],
                dtype: Dtype::Fp32,
                len: g.hv * g.k,
            };
            let mut lv = self.pool.layer_mut(l)?;
            self.be.replay(
                &p,
                acc.as_ref(),
                &opts(),
                Some(&a_log),
                Some(&dt_bias),
                &mut lv,
            )?;
        }
        Ok(())
    }
}

/// Every byte of `slot` in every plane of every layer.
pub fn slot_bytes(pool: &StatePool<HostMemory>, slot: usize) -> Vec<u8> {
    let g = pool.geometry();
    let mut all = Vec::new();
    for layer in 0..g.layers {
        for plane in Plane::ALL {
            all.extend(pool.read_slot_plane(layer, plane, slot).unwrap());
        }
    }
    all
}
