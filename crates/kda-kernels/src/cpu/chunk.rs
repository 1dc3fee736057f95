//! The chunked form of spec section 3 (prefill), one value head over one sequence, in chunks
//! of [`BT`] tokens. Decay factors are always exponentials of differences of chunk-local
//! cumulative log-decays that are `<= 0` (`exp(Gc_i - Gc_j)` for `j <= i`, `exp(Gc_i)`,
//! `exp(Gc_last - Gc_i)`), so nothing overflows and no small number is divided by another.

/// Tokens per chunk.
pub const BT: usize = 64;

/// Dot product with eight partial sums, so the compiler can vectorise it.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += a * x`.
#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yy, &xx) in y.iter_mut().zip(x) {
        *yy += a * xx;
    }
}

/// Scratch of the chunked form for dims `kd`, `vd`, reused across chunks and calls.
#[derive(Debug, Clone)]
pub struct ChunkScratch {
    kd: usize,
    vd: usize,
    /// Chunk-local inclusive cumulative log-decay, `[BT][K]`.
    gc: Vec<f32>,
    /// `exp(Gc_i - Gc_j)` for one pair, `[K]`.
    e: Vec<f32>,
    /// `Akk` strictly lower, `[BT][BT]`.
    akk: Vec<f32>,
    /// `Aqk` lower with diagonal, `[BT][BT]`.
    aqk: Vec<f32>,
    /// `w`, `[BT][K]`.
    w: Vec<f32>,
    /// `u`, then `v_new`, `[BT][V]`.
    u: Vec<f32>,
    /// One row of `K` values.
    row: Vec<f32>,
}

impl ChunkScratch {
    /// Scratch for key dim `kd` and value dim `vd`.
    pub fn new(kd: usize, vd: usize) -> Self {
        Self {
            kd,
            vd,
            gc: vec![0.0; BT * kd],
            e: vec![0.0; kd],
            akk: vec![0.0; BT * BT],
            aqk: vec![0.0; BT * BT],
            w: vec![0.0; BT * kd],
            u: vec![0.0; BT * vd],
            row: vec![0.0; kd],
        }
    }
}

/// Runs `n` activated tokens of one value head through the chunked form: `q` `[n][K]`
/// (normalised and scaled), `k` `[n][K]` (normalised), `g` `[n][K]` (log-decay), `beta`
/// `[n]`, `v` `[n][V]`. `state` is the logical `[K][V]` f32 state, advanced in place; `out`
/// `[n][V]` receives the outputs.
#[allow(clippy::too_many_arguments)]
pub fn chunked_prefill(
    scratch: &mut ChunkScratch,
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    g: &[f32],
    beta: &[f32],
    v: &[f32],
    out: &mut [f32],
) {
    let (kd, vd) = (scratch.kd, scratch.vd);
    let n = beta.len();
    let mut start = 0;
    while start < n {
        let c = BT.min(n - start);
        let kr = start * kd..(start + c) * kd;
        let vr = start * vd..(start + c) * vd;
        chunk(
            scratch,
            state,
            &q[kr.clone()],
            &k[kr.clone()],
            &g[kr],
            &beta[start..start + c],
            &v[vr.clone()],
            &mut out[vr],
        );
        start += c;
    }
}

/// One chunk of `c <= BT` tokens.
#[allow(clippy::too_many_arguments)]
fn chunk(
    sc: &mut ChunkScratch,
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    g: &[f32],
    beta: &[f32],
    v: &[f32],
    out: &mut [f32],
) {
    let (kd, vd) = (sc.kd, sc.vd);
    let c = beta.len();

    // Gc: inclusive cumulative log-decay inside the chunk.
    for i in 0..c {
        let (prev, cur) = sc.gc.split_at_mut(i * kd);
        let cur = &mut cur[..kd];
        cur.copy_from_slice(&g[i * kd..(i + 1) * kd]);
        if i > 0 {
            for (x, &p) in cur.iter_mut().zip(&prev[(i - 1) * kd..]) {
                *x += p;
            }
        }
    }

    // Akk (j < i) and Aqk (j <= i) share exp(Gc_i - Gc_j) <= 1.
    for i in 0..c {
        let gi = &sc.gc[i * kd..(i + 1) * kd];
        let ki = &k[i * kd..(i + 1) * kd];
        let qi = &q[i * kd..(i + 1) * kd];
        for j in 0..=i {
            let gj = &sc.gc[j * kd..(j + 1) * kd];
            let kj = &k[j * kd..(j + 1) * kd];
            for ((e, &a), &b) in sc.e.iter_mut().zip(gi).zip(gj) {
                *e = (a - b).exp();
            }
            for ((r, &x), &e) in sc.row.iter_mut().zip(kj).zip(&sc.e) {
                *r = x * e;
            }
            sc.aqk[i * BT + j] = dot(qi, &sc.row);
            sc.akk[i * BT + j] = if j < i {
                beta[i] * dot(ki, &sc.row)
            } else {
                0.0
            };
        }
    }

    // w = (I + Akk)^-1 (beta K exp(Gc)), u = (I + Akk)^-1 (beta V): forward substitution.
    for i in 0..c {
        let (done, rest) = sc.w.split_at_mut(i * kd);
        let wi = &mut rest[..kd];
        for ((w, &x), &gg) in wi
            .iter_mut()
            .zip(&k[i * kd..(i + 1) * kd])
            .zip(&sc.gc[i * kd..])
        {
            *w = beta[i] * x * gg.exp();
        }
        for j in 0..i {
            axpy(wi, -sc.akk[i * BT + j], &done[j * kd..(j + 1) * kd]);
        }
        let (done, rest) = sc.u.split_at_mut(i * vd);
        let ui = &mut rest[..vd];
        for (u, &x) in ui.iter_mut().zip(&v[i * vd..(i + 1) * vd]) {
            *u = beta[i] * x;
        }
        for j in 0..i {
            axpy(ui, -sc.akk[i * BT + j], &done[j * vd..(j + 1) * vd]);
        }
    }

    // v_new = u - w S (in place in u); O = (Q exp(Gc)) S + Aqk v_new.
    for i in 0..c {
        let oi = &mut out[i * vd..(i + 1) * vd];
        oi.fill(0.0);
        {
            let ui = &mut sc.u[i * vd..(i + 1) * vd];
            let wi = &sc.w[i * kd..(i + 1) * kd];
            let qi = &q[i * kd..(i + 1) * kd];
            let gi = &sc.gc[i * kd..(i + 1) * kd];
            for (((srow, &w), &qq), &gg) in state.chunks_exact(vd).zip(wi).zip(qi).zip(gi) {
                let qg = qq * gg.exp();
                for ((u, o), &s) in ui.iter_mut().zip(oi.iter_mut()).zip(srow) {
                    *u -= w * s;
                    *o += qg * s;
                }
            }
        }
        for j in 0..=i {
            axpy(oi, sc.aqk[i * BT + j], &sc.u[j * vd..(j + 1) * vd]);
        }
    }

    // S = exp(Gc_last) S + (K exp(Gc_last - Gc))^T v_new.
    let last = &sc.gc[(c - 1) * kd..c * kd];
    for (kk, srow) in state.chunks_exact_mut(vd).enumerate() {
        let gl = last[kk];
        let d = gl.exp();
        for s in srow.iter_mut() {
            *s *= d;
        }
        for i in 0..c {
            let coef = k[i * kd + kk] * (gl - sc.gc[i * kd + kk]).exp();
            axpy(srow, coef, &sc.u[i * vd..(i + 1) * vd]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::step::token_step;

    /// A small deterministic generator for the unit test (the property tests use rand).
    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn chunked_form_equals_token_steps_across_chunk_boundaries() {
        let (kd, vd, n) = (5, 3, 2 * BT + 7);
        let mut seed = 42u64;
        let mut gen = |len: usize, f: &dyn Fn(f32) -> f32| -> Vec<f32> {
            (0..len).map(|_| f(lcg(&mut seed))).collect()
        };
        let q = gen(n * kd, &|x| x);
        let k = gen(n * kd, &|x| x * 0.5);
        let g = gen(n * kd, &|x| -0.2 * (x + 1.0));
        let beta = gen(n, &|x| 0.5 + 0.4 * x);
        let v = gen(n * vd, &|x| x);
        let s0 = gen(kd * vd, &|x| x);

        let mut s_chunk = s0.clone();
        let mut o_chunk = vec![f32::NAN; n * vd];
        let mut sc = ChunkScratch::new(kd, vd);
        chunked_prefill(&mut sc, &mut s_chunk, &q, &k, &g, &beta, &v, &mut o_chunk);

        let mut s_step = s0;
        let mut o_step = vec![0.0; n * vd];
        let mut u = vec![0.0; vd];
        for t in 0..n {
            let decay: Vec<f32> = g[t * kd..(t + 1) * kd].iter().map(|x| x.exp()).collect();
            token_step(
                &mut s_step,
                &k[t * kd..(t + 1) * kd],
                &decay,
                beta[t],
                &v[t * vd..(t + 1) * vd],
                &mut u,
                Some((&q[t * kd..(t + 1) * kd], &mut o_step[t * vd..(t + 1) * vd])),
            );
        }
        for (a, b) in o_chunk
            .iter()
            .zip(&o_step)
            .chain(s_chunk.iter().zip(&s_step))
        {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}
