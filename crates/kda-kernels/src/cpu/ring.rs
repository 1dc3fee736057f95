//! The replay ring's data: reading the pending entries back as one value head's tokens, and,
//! once a call's heads are done, appending the new tokens' raw inputs and writing the new
//! bookkeeping. Which entries are folded, appended or dropped is decided by
//! [`super::validate`]'s plan.

use state_pool::{PoolGeometry, RingMeta};

use super::exec::Inputs;
use super::step::{HeadActivation, TokenRun};
use super::tensor::Bulk;
use super::validate::CallPlan;
use crate::rounding::Element;

/// Offset (in elements) of entry `e` of `slot` in the ring plane.
#[inline]
fn entry_base(g: &PoolGeometry, slot: u32, e: usize) -> usize {
    (slot as usize * g.ring_len + e) * g.ring_entry_elems()
}

/// Appends entries `0..count` of `slot`, as tokens of q/k head `h` and value head `hv`, to
/// `run` (ring entries hold no query).
#[allow(clippy::too_many_arguments)]
pub(crate) fn push_pending<R: Bulk>(
    ring: &[R],
    g: &PoolGeometry,
    slot: u32,
    count: usize,
    h: usize,
    hv: usize,
    act: &HeadActivation<'_>,
    run: &mut TokenRun,
) {
    let [ok, ov, og, ob] = g.ring_entry_offsets();
    let (kd, vd) = (g.k, g.v);
    for e in 0..count {
        let base = entry_base(g, slot, e);
        run.push(act, |raw| {
            R::load_slice(&ring[base + ok + h * kd..][..kd], raw.k);
            R::load_slice(&ring[base + ov + hv * vd..][..vd], raw.v);
            R::load_slice(&ring[base + og + hv * kd..][..kd], raw.g);
            *raw.beta = ring[base + ob + hv].load();
        });
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
