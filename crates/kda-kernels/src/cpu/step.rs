//! The f32 token step of spec section 2, and the input activations (l2norm, scale, gate,
//! beta). Eager decode, the replay of ring entries and the new tokens of decode and
//! spec_verify all go through [`token_step`], so an fp32 pool gives the same bits whichever
//! path a token takes. The chunked prefill shares the activations.

use crate::api::{BetaMode, GateMode, KdaOptions};

/// `ln(1 + exp(z))`, and `z` itself when `z > 20`.
#[inline]
pub fn softplus(z: f32) -> f32 {
    if z > 20.0 {
        z
    } else {
        z.exp().ln_1p()
    }
}

/// `1 / (1 + exp(-x))`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Divides `x` by `sqrt(sum(x^2) + 1e-6)` in place.
#[inline]
pub fn l2_normalize(x: &mut [f32]) {
    let sum: f32 = x.iter().map(|&a| a * a).sum();
    let norm = (sum + 1e-6).sqrt();
    for a in x.iter_mut() {
        *a /= norm;
    }
}

/// How one value head's raw inputs become the quantities of the recurrence.
#[derive(Debug, Clone, Copy)]
pub struct HeadActivation<'a> {
    /// l2-normalise q and k.
    pub l2norm: bool,
    /// Read-out scale, applied to q after normalisation.
    pub scale: f32,
    /// Gate activation.
    pub gate: GateMode,
    /// `exp(A_log[hv])` (unused for [`GateMode::Activated`]).
    pub a: f32,
    /// `dt_bias[hv]`, K values (empty for [`GateMode::Activated`]).
    pub dt_bias: &'a [f32],
    /// Beta activation.
    pub beta: BetaMode,
    /// 2 with `allow_neg_eigval`, else 1.
    pub beta_factor: f32,
}

impl<'a> HeadActivation<'a> {
    /// The activation of value head `hv`; `a_log` (`[HV]`) and `dt_bias` (`[HV * K]`) are
    /// read only when the gate is activated in the kernel.
    pub fn new(opts: &KdaOptions, kd: usize, hv: usize, a_log: &[f32], dt_bias: &'a [f32]) -> Self {
        let (a, bias): (f32, &'a [f32]) = if opts.needs_gate_params() {
            (a_log[hv].exp(), &dt_bias[hv * kd..(hv + 1) * kd])
        } else {
            (0.0, &[])
        };
        Self {
            l2norm: opts.l2norm_qk,
            scale: opts.scale_for(kd),
            gate: opts.gate,
            a,
            dt_bias: bias,
            beta: opts.beta,
            beta_factor: if opts.allow_neg_eigval { 2.0 } else { 1.0 },
        }
    }

    /// The key in place: l2-normalised when asked.
    #[inline]
    pub fn key(&self, k: &mut [f32]) {
        if self.l2norm {
            l2_normalize(k);
        }
    }

    /// The query in place: l2-normalised when asked, then scaled.
    #[inline]
    pub fn query(&self, q: &mut [f32]) {
        if self.l2norm {
            l2_normalize(q);
        }
        for x in q.iter_mut() {
            *x *= self.scale;
        }
    }

    /// The log-decay `g <= 0` in place from the gate input.
    #[inline]
    pub fn log_decay(&self, g: &mut [f32]) {
        match self.gate {
            GateMode::Activated => {}
            GateMode::Softplus => {
                for (x, &b) in g.iter_mut().zip(self.dt_bias) {
                    *x = -self.a * softplus(*x + b);
                }
            }
            GateMode::LowerBound(lower) => {
                for (x, &b) in g.iter_mut().zip(self.dt_bias) {
                    *x = lower * sigmoid(self.a * (*x + b));
                }
            }
        }
    }

    /// The decay factor `exp(g)` in place from the gate input.
    #[inline]
    pub fn decay(&self, g: &mut [f32]) {
        self.log_decay(g);
        for x in g.iter_mut() {
            *x = x.exp();
        }
    }

    /// beta from its input.
    #[inline]
    pub fn beta(&self, b: f32) -> f32 {
        let beta = match self.beta {
            BetaMode::Activated => b,
            BetaMode::Sigmoid => sigmoid(b),
        };
        beta * self.beta_factor
    }
}

/// One token of one value head on a logical `[K][V]` f32 state (spec section 2):
/// `S *= exp(g)` by rows, `u = beta * (v - k S)`, `S += k u^T`, and with `readout = (q, o)`
/// `o = q S` from the updated state. `k` is the activated key, `decay` is `exp(g)` (K values),
/// `u` is V values of scratch.
#[inline]
pub fn token_step(
    state: &mut [f32],
    k: &[f32],
    decay: &[f32],
    beta: f32,
    v: &[f32],
    u: &mut [f32],
    readout: Option<(&[f32], &mut [f32])>,
) {
    let vd = v.len();
    u.fill(0.0);
    for ((row, &kk), &d) in state.chunks_exact_mut(vd).zip(k).zip(decay) {
        for (s, acc) in row.iter_mut().zip(u.iter_mut()) {
            *s *= d;
            *acc += kk * *s;
        }
    }
    for (acc, &x) in u.iter_mut().zip(v) {
        *acc = beta * (x - *acc);
    }
    match readout {
        Some((q, o)) => {
            o.fill(0.0);
            for ((row, &kk), &qq) in state.chunks_exact_mut(vd).zip(k).zip(q) {
                for ((s, &du), acc) in row.iter_mut().zip(u.iter()).zip(o.iter_mut()) {
                    *s += kk * du;
                    *acc += qq * *s;
                }
            }
        }
        None => {
            for (row, &kk) in state.chunks_exact_mut(vd).zip(k) {
                for (s, &du) in row.iter_mut().zip(u.iter()) {
                    *s += kk * du;
                }
            }
        }
    }
}

/// The f32 buffers of one token of one value head, reused across tokens.
#[derive(Debug, Clone)]
pub struct TokenBuffers {
    /// Query, K values (raw, then activated by [`TokenBuffers::activate`]).
    pub q: Vec<f32>,
    /// Key, K values.
    pub k: Vec<f32>,
    /// Gate input, K values; `exp(g)` after activation.
    pub g: Vec<f32>,
    /// Value, V values.
    pub v: Vec<f32>,
    /// beta input; activated beta after activation.
    pub beta: f32,
    /// Scratch of the step, V values.
    pub u: Vec<f32>,
}

impl TokenBuffers {
    /// Buffers for key dim `kd` and value dim `vd`.
    pub fn new(kd: usize, vd: usize) -> Self {
        Self {
            q: vec![0.0; kd],
            k: vec![0.0; kd],
            g: vec![0.0; kd],
            v: vec![0.0; vd],
            beta: 0.0,
            u: vec![0.0; vd],
        }
    }

    /// Activates the raw inputs held in the buffers (q only when `with_query`).
    #[inline]
    pub fn activate(&mut self, act: &HeadActivation<'_>, with_query: bool) {
        act.key(&mut self.k);
        act.decay(&mut self.g);
        self.beta = act.beta(self.beta);
        if with_query {
            act.query(&mut self.q);
        }
    }

    /// Steps `state` with the activated token; writes the read-out into `out` when given.
    #[inline]
    pub fn step(&mut self, state: &mut [f32], out: Option<&mut [f32]>) {
        let readout = out.map(|o| (self.q.as_slice(), o));
        token_step(
            state,
            &self.k,
            &self.g,
            self.beta,
            &self.v,
            &mut self.u,
            readout,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softplus_is_the_identity_above_twenty_and_smooth_below() {
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert!((softplus(-30.0) - (-30.0f32).exp()).abs() < 1e-18);
    }

    #[test]
    fn token_step_matches_the_written_out_recurrence() {
        // K = 2, V = 3, by hand.
        let mut s = vec![1.0, 2.0, 3.0, -1.0, 0.5, 0.0];
        let k = [0.6, 0.8];
        let decay = [0.5, 0.25];
        let v = [1.0, -1.0, 2.0];
        let q = [1.0, -2.0];
        let beta = 0.5;
        let (mut u, mut o) = (vec![0.0; 3], vec![0.0; 3]);
        token_step(&mut s, &k, &decay, beta, &v, &mut u, Some((&q, &mut o)));
        let ds = [0.5, 1.0, 1.5, -0.25, 0.125, 0.0];
        let ks = [
            0.6 * ds[0] + 0.8 * ds[3],
            0.6 * ds[1] + 0.8 * ds[4],
            0.6 * ds[2] + 0.8 * ds[5],
        ];
        let uu: Vec<f32> = (0..3).map(|j| beta * (v[j] - ks[j])).collect();
        for r in 0..2 {
            for c in 0..3 {
                let want = ds[r * 3 + c] + k[r] * uu[c];
                assert!((s[r * 3 + c] - want).abs() < 1e-6);
            }
        }
        for c in 0..3 {
            let want = q[0] * s[c] + q[1] * s[3 + c];
            assert!((o[c] - want).abs() < 1e-6);
        }
    }
}
