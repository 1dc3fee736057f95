//! A plain f64 implementation of spec section 2, token by token: the yardstick of the tests
//! and of the accuracy report. Inputs are the f32 values the kernels see after up-casting;
//! states are logical `[HV][K][V]` per sequence (K-first, whatever the pool's layout).

use crate::api::{BetaMode, GateMode, KdaOptions};
use crate::error::{KernelError, Result};

/// The head dims of a problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Dims {
    /// q/k heads.
    pub h: usize,
    /// Value heads (a multiple of `h`).
    pub hv: usize,
    /// Key head dim.
    pub k: usize,
    /// Value head dim.
    pub v: usize,
}

impl Dims {
    /// Elements of one sequence's state (HV * K * V).
    pub fn state_elems(&self) -> usize {
        self.hv * self.k * self.v
    }
}

/// The token inputs of one call, flattened over tokens, as f32 values (see
/// [`crate::api`] for the shapes). `a_log` and `dt_bias` are read only when the gate is
/// activated in the kernel.
#[derive(Debug, Clone, Copy)]
pub struct RefInputs<'a> {
    /// `[T, H, K]`.
    pub q: &'a [f32],
    /// `[T, H, K]`.
    pub k: &'a [f32],
    /// `[T, HV, V]`.
    pub v: &'a [f32],
    /// `[T, HV, K]`, raw or activated as the options say.
    pub g: &'a [f32],
    /// `[T, HV]`, raw or activated as the options say.
    pub beta: &'a [f32],
    /// `[HV]`.
    pub a_log: &'a [f32],
    /// `[HV * K]`.
    pub dt_bias: &'a [f32],
}

fn softplus(z: f64) -> f64 {
    if z > 20.0 {
        z
    } else {
        z.exp().ln_1p()
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn l2norm(x: &mut [f64]) {
    let n = (x.iter().map(|a| a * a).sum::<f64>() + 1e-6).sqrt();
    x.iter_mut().for_each(|a| *a /= n);
}

/// The f64 states of a batch of sequences, advanced token by token.
#[derive(Debug, Clone)]
pub struct ReferenceState {
    dims: Dims,
    /// `[N][HV][K][V]`.
    states: Vec<f64>,
}

impl ReferenceState {
    /// Sequences starting from `initial` (`[N][HV][K][V]` logical K-first).
    pub fn new(dims: Dims, initial: Vec<f64>) -> Result<Self> {
        if dims.h == 0 || !dims.hv.is_multiple_of(dims.h) || dims.state_elems() == 0 {
            return Err(KernelError::arg(
                "dims",
                format!("{dims:?}: expected positive dims with HV a multiple of H"),
            ));
        }
        if !initial.len().is_multiple_of(dims.state_elems()) {
            return Err(KernelError::arg(
                "initial",
                format!(
                    "has {} values; expected a multiple of HV * K * V = {}",
                    initial.len(),
                    dims.state_elems()
                ),
            ));
        }
        Ok(Self {
            dims,
            states: initial,
        })
    }

    /// Number of sequences.
    pub fn num_seqs(&self) -> usize {
        self.states.len() / self.dims.state_elems()
    }

    /// The states, `[N][HV][K][V]`.
    pub fn states(&self) -> &[f64] {
        &self.states
    }

    /// Advances the sequences named by `seqs` (indices into this state set, one per batch
    /// sequence) over their tokens `bounds[i]..bounds[i + 1]`; returns the outputs
    /// `[T][HV][V]`.
    pub fn advance(
        &mut self,
        inputs: &RefInputs<'_>,
        opts: &KdaOptions,
        bounds: &[usize],
        seqs: &[usize],
    ) -> Result<Vec<f64>> {
        let d = self.dims;
        self.check(inputs, opts, bounds, seqs)?;
        let (kd, vd) = (d.k, d.v);
        let t_total = bounds.last().copied().unwrap_or(0);
        let mut out = vec![0.0; t_total * d.hv * vd];
        let scale = opts.scale_for(kd) as f64;
        let group = d.hv / d.h;
        let (mut q, mut k, mut gl, mut u) =
            (vec![0.0; kd], vec![0.0; kd], vec![0.0; kd], vec![0.0; vd]);
        for (i, &seq) in seqs.iter().enumerate() {
            for t in bounds[i]..bounds[i + 1] {
                for hv in 0..d.hv {
                    let h = hv / group;
                    let qk = (t * d.h + h) * kd;
                    let gk = (t * d.hv + hv) * kd;
                    for j in 0..kd {
                        q[j] = inputs.q[qk + j] as f64;
                        k[j] = inputs.k[qk + j] as f64;
                        gl[j] = inputs.g[gk + j] as f64;
                    }
                    if opts.l2norm_qk {
                        l2norm(&mut q);
                        l2norm(&mut k);
                    }
                    q.iter_mut().for_each(|x| *x *= scale);
                    let a = (inputs.a_log.get(hv).copied().unwrap_or(0.0) as f64).exp();
                    let bias = |j: usize| inputs.dt_bias[hv * kd + j] as f64;
                    match opts.gate {
                        GateMode::Activated => {}
                        GateMode::Softplus => {
                            for (j, x) in gl.iter_mut().enumerate() {
                                *x = -a * softplus(*x + bias(j));
                            }
                        }
                        GateMode::LowerBound(lb) => {
                            for (j, x) in gl.iter_mut().enumerate() {
                                *x = lb as f64 * sigmoid(a * (*x + bias(j)));
                            }
                        }
                    }
                    let b = inputs.beta[t * d.hv + hv] as f64;
                    let mut beta = match opts.beta {
                        BetaMode::Activated => b,
                        BetaMode::Sigmoid => sigmoid(b),
                    };
                    if opts.allow_neg_eigval {
                        beta *= 2.0;
                    }
                    let vrow = &inputs.v[(t * d.hv + hv) * vd..][..vd];
                    let s = &mut self.states[(seq * d.hv + hv) * kd * vd..][..kd * vd];
                    // 1) decay rows, 2) prediction error, 3) rank-1 update, 4) read-out.
                    for j in 0..kd {
                        let e = gl[j].exp();
                        s[j * vd..(j + 1) * vd].iter_mut().for_each(|x| *x *= e);
                    }
                    for c in 0..vd {
                        let ks: f64 = (0..kd).map(|j| k[j] * s[j * vd + c]).sum();
                        u[c] = beta * (vrow[c] as f64 - ks);
                    }
                    for j in 0..kd {
                        for c in 0..vd {
                            s[j * vd + c] += k[j] * u[c];
                        }
                    }
                    let o = &mut out[(t * d.hv + hv) * vd..][..vd];
                    for c in 0..vd {
                        o[c] = (0..kd).map(|j| q[j] * s[j * vd + c]).sum();
                    }
                }
            }
        }
        Ok(out)
    }

    /// Checks the shapes of an [`ReferenceState::advance`] call.
    fn check(
        &self,
        inputs: &RefInputs<'_>,
        opts: &KdaOptions,
        bounds: &[usize],
        seqs: &[usize],
    ) -> Result<()> {
        let d = self.dims;
        if bounds.len() != seqs.len() + 1 || bounds.windows(2).any(|w| w[1] < w[0]) {
            return Err(KernelError::arg(
                "bounds",
                format!(
                    "{bounds:?}: expected {} non-decreasing offsets",
                    seqs.len() + 1
                ),
            ));
        }
        if let Some(&s) = seqs.iter().find(|&&s| s >= self.num_seqs()) {
            return Err(KernelError::arg(
                "seqs",
                format!("sequence {s} is out of range 0..{}", self.num_seqs()),
            ));
        }
        let t = bounds.last().copied().unwrap_or(0);
        let need_gate = opts.needs_gate_params();
        for (name, got, want) in [
            ("q", inputs.q.len(), t * d.h * d.k),
            ("k", inputs.k.len(), t * d.h * d.k),
            ("v", inputs.v.len(), t * d.hv * d.v),
            ("g", inputs.g.len(), t * d.hv * d.k),
            ("beta", inputs.beta.len(), t * d.hv),
            (
                "a_log",
                inputs.a_log.len(),
                if need_gate { d.hv } else { inputs.a_log.len() },
            ),
            (
                "dt_bias",
                inputs.dt_bias.len(),
                if need_gate {
                    d.hv * d.k
                } else {
                    inputs.dt_bias.len()
                },
            ),
        ] {
            if got != want {
                return Err(KernelError::arg(
                    name,
                    format!("has {got} values; expected {want}"),
                ));
            }
        }
        Ok(())
    }
}

/// Runs a whole batch from `initial` (`[N][HV][K][V]`): returns the outputs `[T][HV][V]` and
/// the final states `[N][HV][K][V]`.
pub fn reference_run(
    dims: Dims,
    inputs: &RefInputs<'_>,
    opts: &KdaOptions,
    bounds: &[usize],
    initial: Vec<f64>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let n = bounds.len().saturating_sub(1);
    let mut st = ReferenceState::new(dims, initial)?;
    let seqs: Vec<usize> = (0..n).collect();
    let out = st.advance(inputs, opts, bounds, &seqs)?;
    Ok((out, st.states))
}
