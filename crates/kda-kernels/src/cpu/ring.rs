//! The replay ring's data: reading an entry back as one value head's token, folding the
//! pending entries onto a state, and, once a call's heads are done, appending the new tokens'
//! raw inputs and writing the new bookkeeping. Which entries are folded, appended or dropped is
//! decided by [`super::validate`]'s plan.

use state_pool::{PoolGeometry, RingMeta};

use super::exec::Inputs;
use super::step::{HeadActivation, TokenBuffers};
use super::tensor::load_row;
use super::validate::CallPlan;
use crate::rounding::Element;

/// Offset (in elements) of entry `e` of `slot` in the ring plane.
#[inline]
fn entry_base(g: &PoolGeometry, slot: u32, e: usize) -> usize {
    (slot as usize * g.ring_len + e) * g.ring_entry_elems()
}

/// Loads the raw inputs of q/k head `h` and value head `hv` from entry `e` of `slot` into
/// `tb` (no query: ring entries hold none).
#[inline]
fn load_entry<R: Element>(
    ring: &[R],
    g: &PoolGeometry,
    slot: u32,
    e: usize,
    h: usize,
    hv: usize,
    tb: &mut TokenBuffers,
) {
    let base = entry_base(g, slot, e);
    let [ok, ov, og, ob] = g.ring_entry_offsets();
    let (kd, vd) = (g.k, g.v);
    load_row(&ring[base + ok + h * kd..][..kd], &mut tb.k);
    load_row(&ring[base + ov + hv * vd..][..vd], &mut tb.v);
    load_row(&ring[base + og + hv * kd..][..kd], &mut tb.g);
    tb.beta = ring[base + ob + hv].load();
}

/// Replays entries `0..count` of `slot` onto the logical f32 `state` of value head `hv`
/// (q/k head `h`), with the same token step as eager decode.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fold_pending<R: Element>(
    ring: &[R],
    g: &PoolGeometry,
    slot: u32,
    count: usize,
    h: usize,
    hv: usize,
    act: &HeadActivation<'_>,
    tb: &mut TokenBuffers,
    state: &mut [f32],
) {
    for e in 0..count {
        load_entry(ring, g, slot, e, h, hv, tb);
        tb.activate(act, false);
        tb.step(state, None);
    }
}

/// Appends the new tokens' raw inputs where the plan says and writes every sequence's new
/// ring bookkeeping. `ring` and `meta` are the layer's whole planes.
pub(crate) fn apply_updates<I: Element>(
    plan: &CallPlan,
    g: &PoolGeometry,
    inputs: Option<&Inputs<'_, I>>,
    ring: &mut [I],
    meta: &mut [RingMeta],
) {
    let [ok, ov, og, ob] = g.ring_entry_offsets();
    let (hk, hvv, hvk, hv) = (g.h * g.k, g.hv * g.v, g.hv * g.k, g.hv);
    for sp in &plan.seqs {
        let Some(update) = sp.ring else { continue };
        if let (Some(at), Some(inp)) = (update.append_at, inputs) {
            for (j, t) in sp.tokens.clone().enumerate() {
                let entry = &mut ring[entry_base(g, sp.slot, at + j)..][..g.ring_entry_elems()];
                entry[ok..ok + hk].copy_from_slice(&inp.k[t * hk..(t + 1) * hk]);
                entry[ov..ov + hvv].copy_from_slice(&inp.v[t * hvv..(t + 1) * hvv]);
                entry[og..og + hvk].copy_from_slice(&inp.g[t * hvk..(t + 1) * hvk]);
                entry[ob..ob + hv].copy_from_slice(&inp.beta[t * hv..(t + 1) * hv]);
            }
        }
        meta[sp.slot as usize] = update.meta;
    }
}
