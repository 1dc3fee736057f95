//! Validation shared by every operation, and the per-sequence plan it produces: how many ring
//! entries to fold, which tokens to compute, where the one state store of the call happens and
//! how the ring changes (architecture.md, "The replay ring"). Nothing here touches the pool,
//! so an error leaves it unchanged.
//!
//! The checks are generic over the memory (they only need buffer lengths); the ring
//! bookkeeping and the accepted counts are passed as host values, so a GPU backend can reuse
//! [`validate_call`] with copies it already holds.

use std::ops::Range;

use state_pool::{DeviceMemory, Dtype, PoolGeometry, RingMeta};

use crate::api::{BatchPlan, CuSeqlens, GateMode, IndexView, KdaOptions, StepInputs, TensorView};
use crate::error::{KernelError, Result};

/// The operation being validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Varlen chunked prefill.
    Prefill,
    /// One accepted token per sequence.
    Decode,
    /// Draft tokens per sequence, after the previous verify's accepted counts.
    SpecVerify,
    /// Flush of the pending entries.
    Replay,
}

impl Op {
    /// The operation's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Op::Prefill => "prefill",
            Op::Decode => "decode",
            Op::SpecVerify => "spec_verify",
            Op::Replay => "replay",
        }
    }
}

/// Where a sequence's single state store of the call happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorePoint {
    /// No store: the state stays as committed.
    None,
    /// After folding the pending entries, before the new tokens (a ring commit, a flush).
    AfterFold,
    /// After the new tokens (prefill, eager decode).
    AtEnd,
}

/// How a sequence's ring changes at the end of the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingUpdate {
    /// The new bookkeeping.
    pub meta: RingMeta,
    /// The new tokens' raw inputs are written at entries `at..at + T` when `Some(at)`.
    pub append_at: Option<usize>,
}

/// What one sequence of a call does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqPlan {
    /// Index of the sequence in the batch.
    pub seq: usize,
    /// Its pool slot.
    pub slot: u32,
    /// Its tokens in the input tensors.
    pub tokens: Range<usize>,
    /// Ring entries `0..fold` are replayed onto the committed state first.
    pub fold: usize,
    /// Where the state is stored.
    pub store: StorePoint,
    /// The ring's change (`None` without a ring).
    pub ring: Option<RingUpdate>,
}

impl SeqPlan {
    /// Whether the state of this sequence has to be loaded at all.
    pub fn needs_state(&self) -> bool {
        self.fold > 0 || !self.tokens.is_empty() || self.store != StorePoint::None
    }
}

/// A validated call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallPlan {
    /// The operation.
    pub op: Op,
    /// One entry per sequence, in batch order.
    pub seqs: Vec<SeqPlan>,
    /// Whether any state is stored (the layer's epoch is bumped once first).
    pub stores: bool,
    /// Element type of q, k, v, g, beta and the output (`None` for replay).
    pub input_dtype: Option<Dtype>,
}

/// Everything a call brings, for [`validate_call`].
pub struct CallArgs<'a, B> {
    /// The operation.
    pub op: Op,
    /// The batch.
    pub plan: &'a BatchPlan,
    /// The token inputs (all ops but replay).
    pub inputs: Option<&'a StepInputs<'a, B>>,
    /// `A_log` for replay (the other ops take it from `inputs`).
    pub a_log: Option<&'a TensorView<'a, B>>,
    /// `dt_bias` for replay (the other ops take it from `inputs`).
    pub dt_bias: Option<&'a TensorView<'a, B>>,
    /// The options.
    pub opts: &'a KdaOptions,
    /// The output tensor's element type and length (all ops but replay).
    pub out: Option<(Dtype, usize)>,
    /// The accepted counts (spec_verify, optionally replay), one per sequence.
    pub accepted: Option<&'a [u32]>,
    /// The ring bookkeeping of each sequence's slot, in batch order (default without a ring).
    pub metas: &'a [RingMeta],
    /// The tokens the per-token tensors (inputs and output) hold where that is more than
    /// the plan's: a batch padded to a fixed size ([`crate::Backend::prepare_padded`])
    /// whose plan is its live prefix; `None`: the plan's tokens.
    pub tensor_tokens: Option<usize>,
}

/// Checks the layer's buffers against its geometry (`layer` argument).
pub fn check_layer<M: DeviceMemory>(
    mem: &M,
    geometry: &PoolGeometry,
    ssm: &M::Buffer,
    ring: &M::Buffer,
    meta: &M::Buffer,
    delta: &M::Buffer,
) -> Result<()> {
    let g = geometry;
    if g.h == 0 || g.hv == 0 || g.k == 0 || g.v == 0 || !g.hv.is_multiple_of(g.h) {
        return Err(KernelError::arg(
            "layer",
            format!(
                "geometry has H = {}, HV = {}, K = {}, V = {}; expected positive dims with HV a multiple of H",
                g.h, g.hv, g.k, g.v
            ),
        ));
    }
    let n = g.total_slots();
    for (name, buf, want) in [
        ("ssm plane", ssm, n * g.ssm_slot_bytes()),
        ("ring plane", ring, n * g.ring_slot_bytes()),
        ("meta plane", meta, n * g.meta_slot_bytes()),
        ("delta plane", delta, n * g.delta_slot_bytes()),
    ] {
        let got = mem.len(buf);
        if got != want {
            return Err(KernelError::arg(
                "layer",
                format!("{name} has {got} bytes; the geometry needs {want}"),
            ));
        }
    }
    Ok(())
}

/// Checks a tensor's dtype and length, and that its buffer holds it.
fn check_tensor<M: DeviceMemory>(
    mem: &M,
    arg: &'static str,
    t: &TensorView<'_, M::Buffer>,
    dtype: Dtype,
    len: usize,
    shape: &str,
) -> Result<()> {
    if t.dtype != dtype {
        return Err(KernelError::arg(
            arg,
            format!("has dtype {}; expected {dtype}", t.dtype),
        ));
    }
    if t.len != len {
        return Err(KernelError::arg(
            arg,
            format!("has {} elements; expected {len} ({shape})", t.len),
        ));
    }
    let bytes = mem.len(t.buf);
    if bytes < len * dtype.size() {
        return Err(KernelError::arg(
            arg,
            format!(
                "buffer has {bytes} bytes; {len} elements of {dtype} need {}",
                len * dtype.size()
            ),
        ));
    }
    Ok(())
}

/// Checks the gate parameters: needed (and f32 `[HV]`, `[HV * K]`) when the gate is activated
/// in the kernel, ignored otherwise.
fn check_gate_params<M: DeviceMemory>(
    mem: &M,
    geometry: &PoolGeometry,
    opts: &KdaOptions,
    a_log: Option<&TensorView<'_, M::Buffer>>,
    dt_bias: Option<&TensorView<'_, M::Buffer>>,
) -> Result<()> {
    if let GateMode::LowerBound(lb) = opts.gate {
        if !(lb.is_finite() && lb < 0.0) {
            return Err(KernelError::arg(
                "opts.gate",
                format!("lower_bound is {lb}; expected a finite negative number"),
            ));
        }
    }
    if !opts.needs_gate_params() {
        return Ok(());
    }
    let (hv, k) = (geometry.hv, geometry.k);
    match a_log {
        None => {
            return Err(KernelError::arg(
                "a_log",
                format!(
                    "is missing; gate {:?} needs A_log [HV = {hv}] in fp32",
                    opts.gate
                ),
            ))
        }
        Some(t) => check_tensor(mem, "a_log", t, Dtype::Fp32, hv, "[HV]")?,
    }
    match dt_bias {
        None => Err(KernelError::arg(
            "dt_bias",
            format!(
                "is missing; gate {:?} needs dt_bias [HV * K = {}] in fp32",
                opts.gate,
                hv * k
            ),
        )),
        Some(t) => check_tensor(mem, "dt_bias", t, Dtype::Fp32, hv * k, "[HV * K]"),
    }
}

/// Checks a view of accepted counts: one `u32` per sequence, in a buffer that holds them.
pub fn check_accepted<M: DeviceMemory>(
    mem: &M,
    acc: &IndexView<'_, M::Buffer>,
    n: usize,
) -> Result<()> {
    if acc.len != n {
        return Err(KernelError::arg(
            "accepted",
            format!("has {} entries; expected one per sequence ({n})", acc.len),
        ));
    }
    let bytes = mem.len(acc.buf);
    if bytes < n * 4 {
        return Err(KernelError::arg(
            "accepted",
            format!("buffer has {bytes} bytes; {n} u32 counts need {}", n * 4),
        ));
    }
    Ok(())
}

/// Re-checks a batch's invariants ([`BatchPlan`]'s fields are public, so a batch may not have
/// come from [`BatchPlan::new`]).
pub fn check_plan(plan: &BatchPlan) -> Result<()> {
    if plan.bounds.len() != plan.slots.len() + 1 {
        return Err(KernelError::arg(
            "cu_seqlens",
            format!(
                "has {} offsets for {} slots; expected N + 1 offsets for N sequences",
                plan.bounds.len(),
                plan.slots.len()
            ),
        ));
    }
    let cu: Vec<i64> = plan.bounds.iter().map(|&b| b as i64).collect();
    BatchPlan::new(CuSeqlens::I64(&cu), &plan.slots, plan.num_tokens()).map(|_| ())
}

/// The padded shape of a batch of [`crate::Backend::prepare_padded`]: its calls launch for
/// (and their tensors hold) every sequence of `full`; its live plan says which are computed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaddedShape {
    /// The batch as prepared (its slots are only those it was prepared with).
    pub full: BatchPlan,
    /// Every slot an update gives lies below this; a call's pool must have at least as many.
    pub slot_bound: usize,
    /// The updates so far.
    pub updates: u32,
}

/// What each update of a padded batch adds to the epoch its calls round with (stochastic
/// rounding), mod 2^32: odd, so distinct update counts (mod 2^32) give distinct offsets.
pub const PADDED_EPOCH_STEP: u32 = 0x9e37_79b9;

impl PaddedShape {
    /// Checks a plan to pad: at least one sequence, every slot below `slot_bound`.
    pub fn new(plan: BatchPlan, slot_bound: usize) -> Result<Self> {
        check_plan(&plan)?;
        if plan.num_seqs() == 0 {
            return Err(KernelError::arg(
                "slots",
                "is empty; a padded batch holds at least one sequence",
            ));
        }
        plan.check_slots(slot_bound)?;
        Ok(Self {
            full: plan,
            slot_bound,
            updates: 0,
        })
    }

    /// An update: the live plan of `slots` ([`BatchPlan::with_live_slots`]), counted once it
    /// is valid (an invalid one changes nothing).
    pub fn update(&mut self, slots: &[u32]) -> Result<BatchPlan> {
        let live = self.full.with_live_slots(slots, self.slot_bound)?;
        self.updates = self.updates.wrapping_add(1);
        Ok(live)
    }

    /// What the batch's calls add to the layer's epoch for stochastic rounding: the updates so
    /// far times [`PADDED_EPOCH_STEP`] (mod 2^32), so the replays of one captured graph, one
    /// per update, round with fresh bits though the graph keeps the epoch it was captured with.
    pub fn epoch_offset(&self) -> u32 {
        self.updates.wrapping_mul(PADDED_EPOCH_STEP)
    }

    /// Checks a call of `op` with the batch on a layer of `geometry`: the pool has the
    /// batch's slots, and every sequence of the padded size fits the operation (a later
    /// update may make any of them live, and a captured graph replays without these checks).
    pub fn check_call(&self, op: Op, geometry: &PoolGeometry) -> Result<()> {
        if self.slot_bound > geometry.total_slots() {
            return Err(KernelError::arg(
                "batch",
                format!(
                    "was prepared for slots below {}; this layer's pool has {}",
                    self.slot_bound,
                    geometry.total_slots()
                ),
            ));
        }
        check_seq_lengths(op, &self.full, geometry.ring_len)
    }
}

/// A prepared batch's plans, as every backend keeps them (the CPU backend's batch itself, part
/// of the CUDA backend's): the plan a call computes, which for a batch of
/// [`crate::Backend::prepare_padded`] is its live sequences, and a padded batch's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedPlan {
    plan: BatchPlan,
    padded: Option<PaddedShape>,
}

impl PreparedPlan {
    /// A plain batch of a checked `plan` ([`crate::Backend::prepare`]).
    pub fn plain(plan: BatchPlan) -> Result<Self> {
        check_plan(&plan)?;
        Ok(Self { plan, padded: None })
    }

    /// A padded batch of `plan`, every sequence live ([`crate::Backend::prepare_padded`]).
    pub fn padded(plan: BatchPlan, slot_bound: usize) -> Result<Self> {
        let shape = PaddedShape::new(plan, slot_bound)?;
        Ok(Self {
            plan: shape.full.clone(),
            padded: Some(shape),
        })
    }

    /// The padded shape, if the batch is padded.
    pub fn padded_shape(&self) -> Option<&PaddedShape> {
        self.padded.as_ref()
    }

    /// The plan the kernels launch for and the tensors are shaped by: the plan, or a padded
    /// batch's whole size.
    pub fn launch_plan(&self) -> &BatchPlan {
        self.padded.as_ref().map_or(&self.plan, |p| &p.full)
    }

    /// The sequences the tensors hold (one accepted count each): [`Self::launch_plan`]'s.
    pub fn capacity(&self) -> usize {
        self.launch_plan().num_seqs()
    }

    /// The tokens the tensors hold where they are more than the plan's (a padded batch):
    /// [`CallArgs::tensor_tokens`].
    pub fn tensor_tokens(&self) -> Option<usize> {
        self.padded.as_ref().map(|p| p.full.num_tokens())
    }

    /// What a call adds to the layer's epoch: a padded batch's
    /// [`PaddedShape::epoch_offset`], else 0.
    pub fn epoch_offset(&self) -> u32 {
        self.padded.as_ref().map_or(0, PaddedShape::epoch_offset)
    }

    /// The padded shape's checks of a call of `op` on a layer of `geometry` (none unpadded).
    pub fn check_call(&self, op: Op, geometry: &PoolGeometry) -> Result<()> {
        self.padded
            .as_ref()
            .map_or(Ok(()), |p| p.check_call(op, geometry))
    }

    /// [`crate::Backend::update_batch`]: makes `slots` the live sequences of a padded batch;
    /// an argument error (a plain batch, bad slots) changes nothing.
    pub fn update(&mut self, slots: &[u32]) -> Result<()> {
        let shape = self.padded.as_mut().ok_or_else(|| {
            KernelError::arg(
                "batch",
                "was made by prepare; only a batch of prepare_padded takes new slots",
            )
        })?;
        self.plan = shape.update(slots)?;
        Ok(())
    }
}

impl AsRef<BatchPlan> for PreparedPlan {
    fn as_ref(&self) -> &BatchPlan {
        &self.plan
    }
}

/// Checks each sequence's token count against the operation: decode 1, spec_verify at most
/// the ring length, replay 0 (prefill any).
pub fn check_seq_lengths(op: Op, plan: &BatchPlan, ring_len: usize) -> Result<()> {
    match op {
        Op::Decode => {
            if let Some(i) = (0..plan.num_seqs()).find(|&i| plan.len_of(i) != 1) {
                return Err(KernelError::arg(
                    "cu_seqlens",
                    format!(
                        "sequence {i} has {} tokens; decode takes exactly 1 token per sequence",
                        plan.len_of(i)
                    ),
                ));
            }
        }
        Op::Replay => {
            if plan.num_tokens() != 0 {
                return Err(KernelError::arg(
                    "cu_seqlens",
                    format!(
                        "covers {} tokens; replay takes sequences of length 0",
                        plan.num_tokens()
                    ),
                ));
            }
        }
        Op::SpecVerify => {
            if let Some(i) = (0..plan.num_seqs()).find(|&i| plan.len_of(i) > ring_len) {
                return Err(KernelError::arg(
                    "cu_seqlens",
                    format!(
                        "sequence {i} has {} draft tokens; spec_verify takes 0..={ring_len} (the ring length)",
                        plan.len_of(i)
                    ),
                ));
            }
        }
        Op::Prefill => {}
    }
    Ok(())
}

/// Validates a call against the layer's `geometry` and plans it.
pub fn validate_call<M: DeviceMemory>(
    mem: &M,
    geometry: &PoolGeometry,
    args: &CallArgs<'_, M::Buffer>,
) -> Result<CallPlan> {
    let g = geometry;
    let plan = args.plan;
    check_plan(plan)?;
    let n = plan.num_seqs();
    let t = plan.num_tokens();
    let ring_len = g.ring_len;
    plan.check_slots(g.total_slots())?;
    // the tokens the tensors hold: the plan's, or a padded batch's (its tail is not computed)
    let t = match args.tensor_tokens {
        Some(padded) if padded >= t => padded,
        Some(padded) => {
            return Err(KernelError::arg(
                "cu_seqlens",
                format!("covers {t} tokens; the padded batch holds only {padded}"),
            ))
        }
        None => t,
    };
    if let Some(inp) = args.inputs {
        let row = g.h * g.k;
        if inp.q.len % row == 0 && inp.q.len / row != t {
            return Err(KernelError::arg(
                "cu_seqlens",
                format!(
                    "ends at {t}; the inputs hold {} tokens (q has {} elements of [T, H = {}, K = {}])",
                    inp.q.len / row,
                    inp.q.len,
                    g.h,
                    g.k
                ),
            ));
        }
    }

    check_seq_lengths(args.op, plan, ring_len)?;
    if let Some(s) = args.opts.scale {
        if !s.is_finite() {
            return Err(KernelError::arg(
                "opts.scale",
                format!("is {s}; expected a finite number"),
            ));
        }
    }

    let input_dtype = match args.inputs {
        Some(inp) => {
            let d = inp.q.dtype;
            let (h, hv, k, v) = (g.h, g.hv, g.k, g.v);
            check_tensor(mem, "q", &inp.q, d, t * h * k, "[T, H, K]")?;
            check_tensor(mem, "k", &inp.k, d, t * h * k, "[T, H, K]")?;
            check_tensor(mem, "v", &inp.v, d, t * hv * v, "[T, HV, V]")?;
            check_tensor(mem, "g", &inp.g, d, t * hv * k, "[T, HV, K]")?;
            check_tensor(mem, "beta", &inp.beta, d, t * hv, "[T, HV]")?;
            if ring_len > 0 && d != g.ring_dtype {
                return Err(KernelError::arg(
                    "q",
                    format!(
                        "inputs have dtype {d}; this pool's ring holds {} inputs, so q, k, v, g, beta must be {}",
                        g.ring_dtype, g.ring_dtype
                    ),
                ));
            }
            check_gate_params(mem, g, args.opts, inp.a_log.as_ref(), inp.dt_bias.as_ref())?;
            let (od, ol) = args.out.unwrap_or((d, 0));
            if od != d {
                return Err(KernelError::arg(
                    "out",
                    format!("has dtype {od}; expected v's dtype {d}"),
                ));
            }
            if ol != t * hv * v {
                return Err(KernelError::arg(
                    "out",
                    format!("has {ol} elements; expected {} ([T, HV, V])", t * hv * v),
                ));
            }
            Some(d)
        }
        None => {
            check_gate_params(mem, g, args.opts, args.a_log, args.dt_bias)?;
            None
        }
    };

    if args.metas.len() != n {
        return Err(KernelError::arg(
            "layer",
            format!("{} ring records for {n} sequences", args.metas.len()),
        ));
    }
    for (i, m) in args.metas.iter().enumerate() {
        if m.len as usize > ring_len || m.pending > m.len {
            return Err(KernelError::arg(
                "layer",
                format!(
                    "slot {} has a corrupt ring record (len {}, pending {}, ring_len {ring_len})",
                    plan.slots[i], m.len, m.pending
                ),
            ));
        }
    }
    if let Some(acc) = args.accepted {
        if acc.len() != n {
            return Err(KernelError::arg(
                "accepted",
                format!("has {} entries; expected one per sequence ({n})", acc.len()),
            ));
        }
        for (i, (&a, m)) in acc.iter().zip(args.metas).enumerate() {
            if a > m.drafts() {
                return Err(KernelError::arg(
                    "accepted",
                    format!(
                        "is {a} for sequence {i} (slot {}); its previous verify left {} drafts",
                        plan.slots[i],
                        m.drafts()
                    ),
                ));
            }
        }
    }
    if args.op == Op::Decode {
        if let Some(i) = (0..n).find(|&i| args.metas[i].drafts() > 0) {
            return Err(KernelError::arg(
                "slots",
                format!(
                    "slot {} has {} drafts of a previous spec_verify; resolve them with spec_verify or replay (accepted counts) before decode",
                    plan.slots[i],
                    args.metas[i].drafts()
                ),
            ));
        }
    }

    let seqs: Vec<SeqPlan> = (0..n)
        .map(|i| {
            let accepted = args.accepted.map_or(0, |a| a[i]);
            plan_seq(args.op, ring_len, i, plan, args.metas[i], accepted)
        })
        .collect();
    let stores = seqs.iter().any(|s| s.store != StorePoint::None);
    Ok(CallPlan {
        op: args.op,
        seqs,
        stores,
        input_dtype,
    })
}

/// The ring contract for one sequence (architecture.md, "The replay ring").
fn plan_seq(
    op: Op,
    ring_len: usize,
    seq: usize,
    plan: &BatchPlan,
    meta: RingMeta,
    accepted: u32,
) -> SeqPlan {
    let tokens = plan.range(seq);
    let nt = tokens.len();
    let pending = (meta.pending + accepted) as usize;
    let cleared = RingMeta::default();
    let with = |len: usize, pending: usize| RingMeta {
        len: len as u32,
        pending: pending as u32,
        ..RingMeta::default()
    };
    let ring = |u: RingUpdate| (ring_len > 0).then_some(u);
    let (fold, store, update) = match op {
        Op::Prefill => {
            let store = if nt > 0 || pending > 0 {
                StorePoint::AtEnd
            } else {
                StorePoint::None
            };
            (
                pending,
                store,
                RingUpdate {
                    meta: cleared,
                    append_at: None,
                },
            )
        }
        Op::Replay => {
            let store = if pending > 0 {
                StorePoint::AfterFold
            } else {
                StorePoint::None
            };
            (
                pending,
                store,
                RingUpdate {
                    meta: cleared,
                    append_at: None,
                },
            )
        }
        Op::Decode if ring_len == 0 => (
            0,
            StorePoint::AtEnd,
            RingUpdate {
                meta: cleared,
                append_at: None,
            },
        ),
        Op::Decode if pending < ring_len => (
            pending,
            StorePoint::None,
            RingUpdate {
                meta: with(pending + 1, pending + 1),
                append_at: Some(pending),
            },
        ),
        Op::Decode => (
            pending,
            StorePoint::AfterFold,
            RingUpdate {
                meta: with(1, 1),
                append_at: Some(0),
            },
        ),
        Op::SpecVerify if pending + nt <= ring_len => (
            pending,
            StorePoint::None,
            RingUpdate {
                meta: with(pending + nt, pending),
                append_at: Some(pending),
            },
        ),
        Op::SpecVerify => (
            pending,
            StorePoint::AfterFold,
            RingUpdate {
                meta: with(nt, 0),
                append_at: Some(0),
            },
        ),
    };
    SeqPlan {
        seq,
        slot: plan.slots[seq],
        tokens,
        fold,
        store,
        ring: ring(update),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(len: u32, pending: u32) -> RingMeta {
        RingMeta {
            len,
            pending,
            ..RingMeta::default()
        }
    }

    fn one_seq(n: usize) -> BatchPlan {
        BatchPlan {
            bounds: vec![0, n],
            slots: vec![3],
        }
    }

    #[test]
    fn a_padded_batch_checks_its_tensors_against_the_padded_tokens_and_its_live_sequences_alone() {
        use crate::api::{StepInputs, TensorView};
        use state_pool::{HostMemory, PoolGeometry};
        let mem = HostMemory;
        let g = PoolGeometry {
            layers: 1,
            h: 1,
            hv: 2,
            k: 4,
            v: 3,
            conv_rows: 0,
            conv_channels: 0,
            conv_dtype: Dtype::Fp32,
            state_dtype: Dtype::Fp32,
            layout: state_pool::StateLayout::KFirst,
            ring_len: 0,
            ring_dtype: Dtype::Fp32,
            ring_deltas: false,
            slots: 8,
            checkpoint_slots: 0,
            rounding: state_pool::Rounding::Nearest,
        };
        let opts = KdaOptions::default();
        // tensors for 6 tokens, a live plan of 2 of them
        let t = 6;
        let rows = [g.h * g.k, g.h * g.k, g.hv * g.v, g.hv * g.k, g.hv];
        let bufs: Vec<_> = rows
            .iter()
            .map(|row| mem.alloc_zeroed(t * row * 4).unwrap())
            .collect();
        let view = |i: usize| TensorView {
            buf: &bufs[i],
            dtype: Dtype::Fp32,
            len: t * rows[i],
        };
        let inputs = StepInputs {
            q: view(0),
            k: view(1),
            v: view(2),
            g: view(3),
            beta: view(4),
            a_log: None,
            dt_bias: None,
        };
        let live = BatchPlan {
            bounds: vec![0, 1, 2],
            slots: vec![5, 1],
        };
        let metas = [RingMeta::default(); 2];
        let call = |tensor_tokens| {
            validate_call(
                &mem,
                &g,
                &CallArgs {
                    op: Op::Decode,
                    plan: &live,
                    inputs: Some(&inputs),
                    a_log: None,
                    dt_bias: None,
                    opts: &opts,
                    out: Some((Dtype::Fp32, t * g.hv * g.v)),
                    accepted: None,
                    metas: &metas,
                    tensor_tokens,
                },
            )
        };
        let plan = call(Some(t)).expect("the padded tensors fit");
        assert_eq!(plan.seqs.len(), 2, "only the live sequences are planned");
        for (tokens, why) in [
            (None, "the live plan's 2 tokens"),
            (Some(5), "5 padded tokens"),
        ] {
            match call(tokens) {
                Err(KernelError::InvalidArgument { arg, .. }) => assert_eq!(arg, "cu_seqlens"),
                other => panic!("tensors of 6 tokens against {why}: {other:?}"),
            }
        }
        match call(Some(1)) {
            Err(KernelError::InvalidArgument { arg, msg }) => {
                assert_eq!(arg, "cu_seqlens");
                assert!(msg.contains("holds only 1"), "{msg}");
            }
            other => panic!("a padded batch smaller than its live plan: {other:?}"),
        }
    }

    #[test]
    fn decode_appends_until_the_ring_is_full_then_commits_the_pending_entries() {
        let p = plan_seq(Op::Decode, 4, 0, &one_seq(1), meta(2, 2), 0);
        assert_eq!((p.fold, p.store), (2, StorePoint::None));
        assert_eq!(p.ring.unwrap().meta, meta(3, 3));
        assert_eq!(p.ring.unwrap().append_at, Some(2));
        let p = plan_seq(Op::Decode, 4, 0, &one_seq(1), meta(4, 4), 0);
        assert_eq!((p.fold, p.store), (4, StorePoint::AfterFold));
        assert_eq!(p.ring.unwrap().meta, meta(1, 1));
        assert_eq!(p.ring.unwrap().append_at, Some(0));
    }

    #[test]
    fn spec_verify_accepts_drafts_then_appends_or_commits() {
        // 1 pending, 3 drafts, 2 accepted -> 3 pending; 1 new draft fits in 4.
        let p = plan_seq(Op::SpecVerify, 4, 0, &one_seq(1), meta(4, 1), 2);
        assert_eq!((p.fold, p.store), (3, StorePoint::None));
        assert_eq!(p.ring.unwrap().meta, meta(4, 3));
        // 2 new drafts do not fit: commit the 3 pending, the drafts restart the ring.
        let p = plan_seq(Op::SpecVerify, 4, 0, &one_seq(2), meta(4, 1), 2);
        assert_eq!((p.fold, p.store), (3, StorePoint::AfterFold));
        assert_eq!(p.ring.unwrap().meta, meta(2, 0));
    }

    #[test]
    fn eager_decode_stores_every_token_and_replay_without_pending_stores_nothing() {
        let p = plan_seq(Op::Decode, 0, 0, &one_seq(1), RingMeta::default(), 0);
        assert_eq!((p.fold, p.store, p.ring), (0, StorePoint::AtEnd, None));
        let p = plan_seq(Op::Replay, 4, 0, &one_seq(0), meta(2, 0), 0);
        assert_eq!((p.fold, p.store), (0, StorePoint::None));
        assert_eq!(p.ring.unwrap().meta, RingMeta::default());
    }
}
