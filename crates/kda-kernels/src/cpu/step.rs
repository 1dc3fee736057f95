//! The f32 token step of spec section 2, and the input activations (l2norm, scale, gate,
//! beta). Eager decode, the replay of ring entries and the new tokens of decode and
//! spec_verify all go through [`token_steps`], so an fp32 pool gives the same bits whichever
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

/// Runs `n` activated tokens of one value head over a logical `[K][V]` f32 state, token after
/// token exactly as spec section 2 says: `S *= exp(g)` by rows, `u = beta * (v - k S)`,
/// `S += k u^T`, and with `readout = (q, o)` the output `o = q S` from the updated state.
///
/// Rows `[n][K]` of `k` (activated) and `decay` (`exp(g)`), `beta` `[n]`, `v` `[n][V]`; with a
/// read-out, `q` `[n][K]` (activated) and `o` `[n][V]`. `pred` and `u` are V values of scratch.
///
/// The update of token `t` and the decay and prediction of token `t + 1` share one pass over
/// the state, so `n` tokens cost `n + 1` passes. Every element goes through the same
/// operations in the same order as with one token per call, so the result is the same bits
/// however a run of tokens is split into calls: eager decode, the replay of ring entries and
/// the new tokens of a step agree bit for bit.
///
/// On x86-64 CPUs with AVX2 the same code runs compiled for AVX2 (wider vectors, the same
/// operations element by element, so the same bits).
#[allow(clippy::too_many_arguments)]
pub fn token_steps(
    state: &mut [f32],
    k: &[f32],
    decay: &[f32],
    beta: &[f32],
    v: &[f32],
    readout: Option<(&[f32], &mut [f32])>,
    pred: &mut [f32],
    u: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above; the function is otherwise safe.
        unsafe { token_steps_avx2(state, k, decay, beta, v, readout, pred, u) };
        return;
    }
    token_steps_body(state, k, decay, beta, v, readout, pred, u);
}

/// [`token_steps_body`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn token_steps_avx2(
    state: &mut [f32],
    k: &[f32],
    decay: &[f32],
    beta: &[f32],
    v: &[f32],
    readout: Option<(&[f32], &mut [f32])>,
    pred: &mut [f32],
    u: &mut [f32],
) {
    token_steps_body(state, k, decay, beta, v, readout, pred, u);
}

/// The body of [`token_steps`], inlined into each instruction-set variant.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn token_steps_body(
    state: &mut [f32],
    k: &[f32],
    decay: &[f32],
    beta: &[f32],
    v: &[f32],
    mut readout: Option<(&[f32], &mut [f32])>,
    pred: &mut [f32],
    u: &mut [f32],
) {
    let n = beta.len();
    if n == 0 {
        return;
    }
    let vd = pred.len();
    let kd = k.len() / n;
    // Token 0: decay and predict.
    pred.fill(0.0);
    for ((row, &kk), &d) in state.chunks_exact_mut(vd).zip(&k[..kd]).zip(&decay[..kd]) {
        for (s, p) in row.iter_mut().zip(pred.iter_mut()) {
            *s *= d;
            *p += kk * *s;
        }
    }
    for t in 0..n {
        for ((du, &p), &x) in u.iter_mut().zip(pred.iter()).zip(&v[t * vd..(t + 1) * vd]) {
            *du = beta[t] * (x - p);
        }
        let kt = &k[t * kd..(t + 1) * kd];
        let next = (t + 1 < n).then(|| {
            (
                &k[(t + 1) * kd..(t + 2) * kd],
                &decay[(t + 1) * kd..(t + 2) * kd],
            )
        });
        if next.is_some() {
            pred.fill(0.0);
        }
        let u: &[f32] = u;
        match (readout.as_mut(), next) {
            (Some((q, o)), Some((k1, d1))) => {
                let (qt, ot) = (&q[t * kd..(t + 1) * kd], &mut o[t * vd..(t + 1) * vd]);
                ot.fill(0.0);
                for (kx, row) in state.chunks_exact_mut(vd).enumerate() {
                    let (a, b, c, d) = (kt[kx], qt[kx], k1[kx], d1[kx]);
                    for (((s, &du), acc), p) in row
                        .iter_mut()
                        .zip(u)
                        .zip(ot.iter_mut())
                        .zip(pred.iter_mut())
                    {
                        let x = *s + a * du;
                        *acc += b * x;
                        let y = x * d;
                        *p += c * y;
                        *s = y;
                    }
                }
            }
            (Some((q, o)), None) => {
                let (qt, ot) = (&q[t * kd..(t + 1) * kd], &mut o[t * vd..(t + 1) * vd]);
                ot.fill(0.0);
                for (kx, row) in state.chunks_exact_mut(vd).enumerate() {
                    let (a, b) = (kt[kx], qt[kx]);
                    for ((s, &du), acc) in row.iter_mut().zip(u).zip(ot.iter_mut()) {
                        let x = *s + a * du;
                        *acc += b * x;
                        *s = x;
                    }
                }
            }
            (None, Some((k1, d1))) => {
                for (kx, row) in state.chunks_exact_mut(vd).enumerate() {
                    let (a, c, d) = (kt[kx], k1[kx], d1[kx]);
                    for ((s, &du), p) in row.iter_mut().zip(u).zip(pred.iter_mut()) {
                        let y = (*s + a * du) * d;
                        *p += c * y;
                        *s = y;
                    }
                }
            }
            (None, None) => {
                for (kx, row) in state.chunks_exact_mut(vd).enumerate() {
                    let a = kt[kx];
                    for (s, &du) in row.iter_mut().zip(u) {
                        *s += a * du;
                    }
                }
            }
        }
    }
}

/// One token: [`token_steps`] with `n = 1` (`u` is V values of scratch).
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
    let mut pred = vec![0.0; v.len()];
    token_steps(state, k, decay, &[beta], v, readout, &mut pred, u);
}

/// The raw rows of one token being appended to a [`TokenRun`]: fill them, the run activates
/// them.
pub struct RawToken<'a> {
    /// Query, K values (only when the run has read-outs).
    pub q: &'a mut [f32],
    /// Key, K values.
    pub k: &'a mut [f32],
    /// Gate input, K values.
    pub g: &'a mut [f32],
    /// Value, V values.
    pub v: &'a mut [f32],
    /// beta input.
    pub beta: &'a mut f32,
}

/// The activated rows of a run of tokens of one value head, and the scratch to step them
/// with [`token_steps`]; reused across runs.
#[derive(Debug, Clone)]
pub struct TokenRun {
    kd: usize,
    vd: usize,
    with_query: bool,
    k: Vec<f32>,
    decay: Vec<f32>,
    beta: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    pred: Vec<f32>,
    u: Vec<f32>,
}

impl TokenRun {
    /// An empty run for key dim `kd` and value dim `vd`.
    pub fn new(kd: usize, vd: usize) -> Self {
        Self {
            kd,
            vd,
            with_query: false,
            k: Vec::new(),
            decay: Vec::new(),
            beta: Vec::new(),
            v: Vec::new(),
            q: Vec::new(),
            pred: vec![0.0; vd],
            u: vec![0.0; vd],
        }
    }

    /// Empties the run; its tokens will carry a query (and produce outputs) when `with_query`.
    pub fn clear(&mut self, with_query: bool) {
        self.with_query = with_query;
        for x in [
            &mut self.k,
            &mut self.decay,
            &mut self.beta,
            &mut self.v,
            &mut self.q,
        ] {
            x.clear();
        }
    }

    /// Tokens in the run.
    pub fn len(&self) -> usize {
        self.beta.len()
    }

    /// Whether the run is empty.
    pub fn is_empty(&self) -> bool {
        self.beta.is_empty()
    }

    /// Appends a token: `fill` writes its raw rows, then they are activated with `act`.
    #[inline]
    pub fn push(&mut self, act: &HeadActivation<'_>, fill: impl FnOnce(RawToken<'_>)) {
        let (kd, vd) = (self.kd, self.vd);
        let t = self.beta.len();
        self.k.resize((t + 1) * kd, 0.0);
        self.decay.resize((t + 1) * kd, 0.0);
        self.v.resize((t + 1) * vd, 0.0);
        self.beta.push(0.0);
        let mut no_query = [0.0f32; 0];
        if self.with_query {
            self.q.resize((t + 1) * kd, 0.0);
        }
        let q: &mut [f32] = if self.with_query {
            &mut self.q[t * kd..]
        } else {
            &mut no_query
        };
        fill(RawToken {
            q,
            k: &mut self.k[t * kd..],
            g: &mut self.decay[t * kd..],
            v: &mut self.v[t * vd..],
            beta: &mut self.beta[t],
        });
        act.key(&mut self.k[t * kd..]);
        act.decay(&mut self.decay[t * kd..]);
        self.beta[t] = act.beta(self.beta[t]);
        if self.with_query {
            act.query(&mut self.q[t * kd..]);
        }
    }

    /// Steps `state` through the run; `out` (`[n][V]`) receives the outputs of a run with
    /// queries.
    pub fn run(&mut self, state: &mut [f32], out: Option<&mut [f32]>) {
        let readout = match (self.with_query, out) {
            (true, Some(o)) => Some((self.q.as_slice(), o)),
            _ => None,
        };
        token_steps(
            state,
            &self.k,
            &self.decay,
            &self.beta,
            &self.v,
            readout,
            &mut self.pred,
            &mut self.u,
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
    fn a_run_of_tokens_gives_the_bits_of_one_token_per_call() {
        let (kd, vd, n) = (5, 7, 6);
        let mut x = 7u32;
        let mut next = |scale: f32| {
            x = crate::rounding::mix32(x);
            (x as f32 / u32::MAX as f32 - 0.5) * scale
        };
        let k: Vec<f32> = (0..n * kd).map(|_| next(1.0)).collect();
        let q: Vec<f32> = (0..n * kd).map(|_| next(1.0)).collect();
        let decay: Vec<f32> = (0..n * kd).map(|_| 0.9 + next(0.2)).collect();
        let beta: Vec<f32> = (0..n).map(|_| 0.5 + next(0.5)).collect();
        let v: Vec<f32> = (0..n * vd).map(|_| next(2.0)).collect();
        let s0: Vec<f32> = (0..kd * vd).map(|_| next(1.0)).collect();
        let (mut pred, mut u) = (vec![0.0; vd], vec![0.0; vd]);
        for readout in [false, true] {
            let mut fused = s0.clone();
            let mut o_fused = vec![0.0; n * vd];
            let r = readout.then_some((q.as_slice(), o_fused.as_mut_slice()));
            token_steps(&mut fused, &k, &decay, &beta, &v, r, &mut pred, &mut u);
            let mut single = s0.clone();
            let mut o_single = vec![0.0; n * vd];
            for (t, &b) in beta.iter().enumerate() {
                let (kr, vr) = (t * kd..(t + 1) * kd, t * vd..(t + 1) * vd);
                let r = readout.then_some((&q[kr.clone()], &mut o_single[vr.clone()]));
                token_step(
                    &mut single,
                    &k[kr.clone()],
                    &decay[kr],
                    b,
                    &v[vr],
                    &mut u,
                    r,
                );
            }
            let bits = |x: &[f32]| x.iter().map(|a| a.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fused), bits(&single), "state, readout {readout}");
            assert_eq!(
                bits(&o_fused),
                bits(&o_single),
                "outputs, readout {readout}"
            );
        }
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
