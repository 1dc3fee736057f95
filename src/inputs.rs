//! Realistic KDA inputs for accuracy runs, drawn the way a trained layer's inputs look:
//! `A_log = ln U(1, 16)`, `dt_bias` as fla initialises it, raw gate and raw beta N(0, 1),
//! q, k, v N(0, 1) rounded to bf16 (the kernel l2-normalises q and k), and a random f32
//! initial state N(0, 1) (as fla's tests draw `h0`).

use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr::StandardNormal;

use state_pool::Dtype;

pub use kda_kernels::cpu::reference::Dims;

/// Independent random streams of one run, so that e.g. a longer sweep does not change the
/// parameters or the initial state.
#[derive(Debug, Clone, Copy)]
pub enum Stream {
    /// `A_log` and `dt_bias`.
    GateParams = 1,
    /// The initial state.
    InitialState = 2,
    /// The tokens.
    Tokens = 3,
}

/// The generator of `stream` for `seed`.
pub fn rng(seed: u64, stream: Stream) -> StdRng {
    StdRng::seed_from_u64(seed ^ (stream as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// The per-layer gate parameters in f32: `A_log` `[HV]` and `dt_bias` `[HV * K]`.
#[derive(Debug, Clone)]
pub struct GateParams {
    /// `ln U(1, 16)` per value head.
    pub a_log: Vec<f32>,
    /// fla's initialisation: `dt = exp(U(0,1) * (ln 0.1 - ln 0.001) + ln 0.001)` clamped at
    /// `>= 1e-4`, then the inverse softplus `dt + ln(-expm1(-dt))`.
    pub dt_bias: Vec<f32>,
}

impl GateParams {
    /// Draws the parameters of a layer of `dims`.
    pub fn draw(rng: &mut impl Rng, dims: Dims) -> Self {
        let a_log = (0..dims.hv)
            .map(|_| rng.random_range(1.0f64..16.0).ln() as f32)
            .collect();
        let (lo, hi) = (0.001f64.ln(), 0.1f64.ln());
        let dt_bias = (0..dims.hv * dims.k)
            .map(|_| {
                let u: f64 = rng.random();
                let dt = (u * (hi - lo) + lo).exp().max(1e-4);
                (dt + (-(-dt).exp_m1()).ln()) as f32
            })
            .collect();
        Self { a_log, dt_bias }
    }
}

/// The per-token inputs of `len` tokens, token-major (`q[t][h][k]` etc.), every value
/// representable in bf16: raw gate and raw beta (activated in the kernel), q and k before
/// l2norm.
#[derive(Debug, Clone)]
pub struct Tokens {
    /// The head shape.
    pub dims: Dims,
    /// Number of tokens.
    pub len: usize,
    /// `[len, H, K]`.
    pub q: Vec<f32>,
    /// `[len, H, K]`.
    pub k: Vec<f32>,
    /// `[len, HV, V]`.
    pub v: Vec<f32>,
    /// Raw gate `[len, HV, K]`.
    pub g: Vec<f32>,
    /// Raw beta `[len, HV]`.
    pub beta: Vec<f32>,
}

fn normal_bf16(rng: &mut impl Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| Dtype::Bf16.round_f32(rng.sample::<f32, _>(StandardNormal)))
        .collect()
}

impl Tokens {
    /// Draws `len` tokens. Token `t` depends only on the generator's position, so drawing in
    /// pieces gives the same tokens as drawing at once.
    pub fn draw(rng: &mut impl Rng, dims: Dims, len: usize) -> Self {
        let mut out = Self::empty(dims);
        for _ in 0..len {
            out.q.extend(normal_bf16(rng, dims.h * dims.k));
            out.k.extend(normal_bf16(rng, dims.h * dims.k));
            out.v.extend(normal_bf16(rng, dims.hv * dims.v));
            out.g.extend(normal_bf16(rng, dims.hv * dims.k));
            out.beta.extend(normal_bf16(rng, dims.hv));
            out.len += 1;
        }
        out
    }

    /// No tokens.
    pub fn empty(dims: Dims) -> Self {
        Self {
            dims,
            len: 0,
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            g: Vec::new(),
            beta: Vec::new(),
        }
    }

    /// The tokens at `indices`, in that order.
    pub fn gather(&self, indices: &[usize]) -> Self {
        let d = self.dims;
        let mut out = Self::empty(d);
        for &t in indices {
            let qk = d.h * d.k;
            out.q.extend_from_slice(&self.q[t * qk..(t + 1) * qk]);
            out.k.extend_from_slice(&self.k[t * qk..(t + 1) * qk]);
            let vv = d.hv * d.v;
            out.v.extend_from_slice(&self.v[t * vv..(t + 1) * vv]);
            let gk = d.hv * d.k;
            out.g.extend_from_slice(&self.g[t * gk..(t + 1) * gk]);
            out.beta
                .extend_from_slice(&self.beta[t * d.hv..(t + 1) * d.hv]);
            out.len += 1;
        }
        out
    }
}

/// A random f32 initial state N(0, 1) for `n` sequences: `[n, HV, K, V]`.
pub fn initial_state(rng: &mut impl Rng, dims: Dims, n: usize) -> Vec<f32> {
    (0..n * dims.state_elems())
        .map(|_| rng.sample::<f32, _>(StandardNormal))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIMS: Dims = Dims {
        h: 2,
        hv: 4,
        k: 8,
        v: 6,
    };

    #[test]
    fn gate_params_follow_fla_initialisation() {
        let p = GateParams::draw(&mut rng(3, Stream::GateParams), DIMS);
        assert_eq!(p.a_log.len(), 4);
        assert_eq!(p.dt_bias.len(), 32);
        for &a in &p.a_log {
            assert!((0.0..16f32.ln()).contains(&a), "A_log {a}");
        }
        for &b in &p.dt_bias {
            // softplus(dt_bias) is dt in [1e-3, 1e-1].
            let dt = (b as f64).exp().ln_1p();
            assert!((0.000_999..0.100_01).contains(&dt), "softplus({b}) = {dt}");
        }
    }

    #[test]
    fn tokens_are_bf16_values_and_drawing_in_pieces_matches() {
        let all = Tokens::draw(&mut rng(5, Stream::Tokens), DIMS, 6);
        let mut r = rng(5, Stream::Tokens);
        let first = Tokens::draw(&mut r, DIMS, 4);
        let rest = Tokens::draw(&mut r, DIMS, 2);
        assert_eq!(all.gather(&[0, 1, 2, 3]).v, first.v);
        assert_eq!(all.gather(&[4, 5]).g, rest.g);
        assert_eq!(all.q.len(), 6 * 16);
        assert_eq!(all.beta.len(), 6 * 4);
        assert!(all.k.iter().all(|&x| Dtype::Bf16.round_f32(x) == x));
        assert!(all.k.iter().any(|&x| x != 0.0));
    }
}
