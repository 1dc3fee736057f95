//! Runs a validated [`CallPlan`] on host memory: one rayon task per (sequence, value head)
//! loads the slot's head state into a logical `[K][V]` f32 array, folds the pending ring
//! entries, stores where the plan says, and computes the new tokens (token steps for decode
//! and spec_verify, the chunked form for prefill). Heads of different slots write disjoint
//! chunks of the ssm plane; outputs and ring updates are written after the tasks join.

use rayon::prelude::*;
use state_pool::{HostBuffer, LayerMut, PoolGeometry, RingMeta};

use super::chunk::{chunked_prefill, ChunkScratch};
use super::ring::{apply_updates, push_pending};
use super::step::{HeadActivation, RawToken, TokenRun};
use super::tensor::{elems, elems_mut, load_head, store_head, Bulk};
use super::validate::{CallPlan, Op, SeqPlan, StorePoint};
use crate::api::{KdaOptions, StepInputs, TensorView};
use crate::error::Result;
use crate::rounding::StoreMode;

/// The token inputs of a call as typed slices (`[T, H, K]`, `[T, HV, V]`, ...).
pub(crate) struct Inputs<'a, I> {
    pub q: &'a [I],
    pub k: &'a [I],
    pub v: &'a [I],
    pub g: &'a [I],
    pub beta: &'a [I],
}

/// Everything one call hands to [`run`], before the element types are known.
pub(crate) struct Exec<'a> {
    pub plan: &'a CallPlan,
    pub opts: &'a KdaOptions,
    pub inputs: Option<&'a StepInputs<'a, HostBuffer>>,
    pub a_log: Option<&'a TensorView<'a, HostBuffer>>,
    pub dt_bias: Option<&'a TensorView<'a, HostBuffer>>,
    pub layer: LayerMut<'a, HostBuffer>,
    /// The output buffer and its element count.
    pub out: Option<(&'a mut HostBuffer, usize)>,
    /// Added to the layer's epoch (as `u32`) for stochastic rounding: a padded batch's
    /// ([`super::validate::PaddedShape::epoch_offset`]), else 0.
    pub epoch_offset: u32,
}

/// A shorter-lived view of the same layer.
pub(crate) fn reborrow<'a>(layer: &'a mut LayerMut<'_, HostBuffer>) -> LayerMut<'a, HostBuffer> {
    LayerMut {
        layer: layer.layer,
        geometry: layer.geometry,
        ssm: &mut *layer.ssm,
        ring: &mut *layer.ring,
        meta: &mut *layer.meta,
        delta: &mut *layer.delta,
        epoch: &mut *layer.epoch,
    }
}

/// The f32 values of a gate parameter when the gate is activated in the kernel.
fn gate_values<'a>(t: Option<&'a TensorView<'a, HostBuffer>>, needed: bool) -> &'a [f32] {
    match t {
        Some(t) if needed => elems(t.buf, t.len),
        _ => &[],
    }
}

/// The read-only facts every task shares.
struct Ctx<'a> {
    op: Op,
    g: &'a PoolGeometry,
    opts: &'a KdaOptions,
    a_log: &'a [f32],
    dt_bias: &'a [f32],
    layer: usize,
    epoch: u64,
}

/// Runs the call with input (and ring) element `I` and state element `S`.
pub(crate) fn run<I: Bulk, S: Bulk>(ex: Exec<'_>) -> Result<()> {
    let plan = ex.plan;
    let g = ex.layer.geometry;
    let on = ex.opts.needs_gate_params();
    let (a_log, dt_bias) = match ex.inputs {
        Some(inp) => (
            gate_values(inp.a_log.as_ref(), on),
            gate_values(inp.dt_bias.as_ref(), on),
        ),
        None => (gate_values(ex.a_log, on), gate_values(ex.dt_bias, on)),
    };
    let inputs = ex.inputs.map(|inp| Inputs::<I> {
        q: elems(inp.q.buf, inp.q.len),
        k: elems(inp.k.buf, inp.k.len),
        v: elems(inp.v.buf, inp.v.len),
        g: elems(inp.g.buf, inp.g.len),
        beta: elems(inp.beta.buf, inp.beta.len),
    });

    if plan.stores {
        *ex.layer.epoch += 1;
    }
    let ctx = Ctx {
        op: plan.op,
        g,
        opts: ex.opts,
        a_log,
        dt_bias,
        layer: ex.layer.layer,
        epoch: u64::from((*ex.layer.epoch as u32).wrapping_add(ex.epoch_offset)),
    };

    let total = g.total_slots();
    let ssm: &mut [S] = elems_mut(ex.layer.ssm, total * g.ssm_slot_elems());
    let ring: &[I] = elems(ex.layer.ring, total * g.ring_slot_elems());
    let mut slot_states: Vec<Option<&mut [S]>> =
        ssm.chunks_mut(g.ssm_slot_elems()).map(Some).collect();
    let mut jobs = Vec::new();
    for sp in plan.seqs.iter().filter(|s| s.needs_state()) {
        let Some(state) = slot_states[sp.slot as usize].take() else {
            unreachable!("validated: slots are distinct and in range")
        };
        for (hv, head) in state.chunks_mut(g.head_elems()).enumerate() {
            jobs.push((sp, hv, head));
        }
    }
    let results: Vec<(usize, usize, Vec<f32>)> = jobs
        .into_par_iter()
        .map(|(sp, hv, head)| {
            let o = head_job(&ctx, sp, hv, head, ring, inputs.as_ref());
            (sp.tokens.start, hv, o)
        })
        .collect();

    if let Some((buf, len)) = ex.out {
        let o: &mut [I] = elems_mut(buf, len);
        let vd = g.v;
        for (start, hv, vals) in results {
            for (j, row) in vals.chunks_exact(vd).enumerate() {
                let at = ((start + j) * g.hv + hv) * vd;
                I::store_slice(row, &mut o[at..at + vd]);
            }
        }
    }
    if g.ring_len > 0 {
        let ring: &mut [I] = elems_mut(ex.layer.ring, total * g.ring_slot_elems());
        let meta: &mut [RingMeta] = elems_mut(ex.layer.meta, total);
        apply_updates(plan, g, inputs.as_ref(), ring, meta);
    }
    Ok(())
}

/// One (sequence, value head): fold, store, compute the tokens; returns the outputs `[n][V]`.
fn head_job<I: Bulk, S: Bulk>(
    ctx: &Ctx<'_>,
    sp: &SeqPlan,
    hv: usize,
    stored: &mut [S],
    ring: &[I],
    inputs: Option<&Inputs<'_, I>>,
) -> Vec<f32> {
    let g = ctx.g;
    let (kd, vd) = (g.k, g.v);
    let h = hv / g.group();
    let act = HeadActivation::new(ctx.opts, kd, hv, ctx.a_log, ctx.dt_bias);
    let mode = StoreMode::for_slot(g.rounding, ctx.layer, sp.slot, ctx.epoch);
    let store = |state: &[f32], stored: &mut [S]| {
        store_head(state, g.layout, kd, vd, mode, hv * kd * vd, stored)
    };

    let mut state = vec![0.0f32; kd * vd];
    load_head(stored, g.layout, kd, vd, &mut state);
    let mut run = TokenRun::new(kd, vd);
    run.clear(false);
    push_pending(ring, g, sp.slot, sp.fold, h, hv, &act, &mut run);
    run.run(&mut state, None);
    if sp.store == StorePoint::AfterFold {
        store(&state, stored);
    }

    let n = sp.tokens.len();
    let mut out = vec![0.0f32; n * vd];
    if let (Some(inp), true) = (inputs, n > 0) {
        let at = TokenAt { g, h, hv };
        match ctx.op {
            Op::Prefill => prefill_tokens(inp, at, sp, &act, &mut state, &mut out),
            _ => {
                run.clear(true);
                for t in sp.tokens.clone() {
                    run.push(&act, |raw| at.load(inp, t, raw));
                }
                run.run(&mut state, Some(&mut out));
            }
        }
    }
    if sp.store == StorePoint::AtEnd {
        store(&state, stored);
    }
    out
}

/// Where one value head's rows of a token live in the input tensors.
#[derive(Clone, Copy)]
struct TokenAt<'a> {
    g: &'a PoolGeometry,
    h: usize,
    hv: usize,
}

impl TokenAt<'_> {
    /// Loads token `t`'s raw q (when `raw` has room for it), k, g, v, beta of this head.
    #[inline]
    fn load<I: Bulk>(&self, inp: &Inputs<'_, I>, t: usize, raw: RawToken<'_>) {
        let (g, kd, vd) = (self.g, self.g.k, self.g.v);
        let qk = (t * g.h + self.h) * kd;
        let vk = (t * g.hv + self.hv) * kd;
        let vv = (t * g.hv + self.hv) * vd;
        if !raw.q.is_empty() {
            I::load_slice(&inp.q[qk..qk + kd], &mut raw.q[..kd]);
        }
        I::load_slice(&inp.k[qk..qk + kd], &mut raw.k[..kd]);
        I::load_slice(&inp.g[vk..vk + kd], &mut raw.g[..kd]);
        I::load_slice(&inp.v[vv..vv + vd], &mut raw.v[..vd]);
        *raw.beta = inp.beta[t * g.hv + self.hv].load();
    }
}

/// The chunked form over a sequence's tokens: activate every token, then run the chunks.
fn prefill_tokens<I: Bulk>(
    inp: &Inputs<'_, I>,
    at: TokenAt<'_>,
    sp: &SeqPlan,
    act: &HeadActivation<'_>,
    state: &mut [f32],
    out: &mut [f32],
) {
    let (kd, vd) = (at.g.k, at.g.v);
    let n = sp.tokens.len();
    let (mut q, mut k, mut gl) = (vec![0.0; n * kd], vec![0.0; n * kd], vec![0.0; n * kd]);
    let (mut v, mut beta) = (vec![0.0; n * vd], vec![0.0; n]);
    for (j, t) in sp.tokens.clone().enumerate() {
        let (kr, vr) = (j * kd..(j + 1) * kd, j * vd..(j + 1) * vd);
        at.load(
            inp,
            t,
            RawToken {
                q: &mut q[kr.clone()],
                k: &mut k[kr.clone()],
                g: &mut gl[kr.clone()],
                v: &mut v[vr],
                beta: &mut beta[j],
            },
        );
        act.query(&mut q[kr.clone()]);
        act.key(&mut k[kr.clone()]);
        act.log_decay(&mut gl[kr]);
        beta[j] = act.beta(beta[j]);
    }
    let mut scratch = ChunkScratch::new(kd, vd);
    chunked_prefill(&mut scratch, state, &q, &k, &gl, &beta, &v, out);
}
