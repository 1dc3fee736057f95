//! The backend-agnostic API: batch description, input tensors, options and the [`Backend`]
//! trait.
//!
//! Shapes (token axis flattened, `T` tokens over `N` sequences):
//! `q`, `k`: `[T, H, K]`; `v`: `[T, HV, V]`; `g`: `[T, HV, K]`; `beta`: `[T, HV]`;
//! `A_log`: `[HV]` f32; `dt_bias`: `[HV * K]` f32; output `o`: `[T, HV, V]` in v's dtype.
//! H, HV, K, V come from the pool layer's geometry.

use state_pool::{DeviceMemory, Dtype, LayerMut, PoolGeometry, StateLayout};

use crate::error::{KernelError, Result};

/// Sequence boundaries as the caller has them.
#[derive(Debug, Clone, Copy)]
pub enum CuSeqlens<'a> {
    /// int32 offsets, length N + 1.
    I32(&'a [i32]),
    /// int64 offsets, length N + 1.
    I64(&'a [i64]),
}

/// A validated batch: sequence boundaries and one pool slot per sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPlan {
    /// Token offsets of the sequences, length N + 1, non-decreasing, starting at 0.
    pub bounds: Vec<usize>,
    /// The pool slot of each sequence; no slot appears twice.
    pub slots: Vec<u32>,
}

impl BatchPlan {
    /// Validates `cu_seqlens` against `num_tokens` and `slots` (one per sequence, distinct).
    pub fn new(cu_seqlens: CuSeqlens<'_>, slots: &[u32], num_tokens: usize) -> Result<Self> {
        let raw: Vec<i64> = match cu_seqlens {
            CuSeqlens::I32(s) => s.iter().map(|&x| x as i64).collect(),
            CuSeqlens::I64(s) => s.to_vec(),
        };
        if raw.is_empty() {
            return Err(KernelError::arg(
                "cu_seqlens",
                "is empty; expected N + 1 offsets starting at 0",
            ));
        }
        if raw[0] != 0 {
            return Err(KernelError::arg(
                "cu_seqlens",
                format!("starts at {}; expected 0", raw[0]),
            ));
        }
        if let Some(i) = raw.windows(2).position(|w| w[1] < w[0]) {
            return Err(KernelError::arg(
                "cu_seqlens",
                format!(
                    "decreases at index {}: {} -> {}; expected non-decreasing offsets",
                    i + 1,
                    raw[i],
                    raw[i + 1]
                ),
            ));
        }
        let last = *raw.last().unwrap_or(&0);
        if last != num_tokens as i64 {
            return Err(KernelError::arg(
                "cu_seqlens",
                format!("ends at {last}; expected the token count {num_tokens}"),
            ));
        }
        let n = raw.len() - 1;
        if slots.len() != n {
            return Err(KernelError::arg(
                "slots",
                format!(
                    "has {} entries; expected one per sequence ({n})",
                    slots.len()
                ),
            ));
        }
        let mut seen = std::collections::HashSet::with_capacity(n);
        for &s in slots {
            if !seen.insert(s) {
                return Err(KernelError::arg(
                    "slots",
                    format!("slot {s} appears twice; each sequence needs its own slot"),
                ));
            }
        }
        Ok(Self {
            bounds: raw.into_iter().map(|x| x as usize).collect(),
            slots: slots.to_vec(),
        })
    }

    /// Number of sequences N.
    pub fn num_seqs(&self) -> usize {
        self.slots.len()
    }
    /// Total tokens T.
    pub fn num_tokens(&self) -> usize {
        *self.bounds.last().unwrap_or(&0)
    }
    /// Token range of sequence `i`.
    pub fn range(&self, i: usize) -> std::ops::Range<usize> {
        self.bounds[i]..self.bounds[i + 1]
    }
    /// Length of sequence `i`.
    pub fn len_of(&self, i: usize) -> usize {
        self.bounds[i + 1] - self.bounds[i]
    }
    /// The plan of this batch's first `slots.len()` sequences, with `slots` as their slots:
    /// what a batch padded to a fixed number of sequences (a captured CUDA graph's) computes in
    /// a step where only those sequences run, its tail being padding. Every slot must lie
    /// below `slot_bound` and appear once; at most [`BatchPlan::num_seqs`] slots.
    pub fn with_live_slots(&self, slots: &[u32], slot_bound: usize) -> Result<Self> {
        let n = self.num_seqs();
        if slots.len() > n {
            return Err(KernelError::arg(
                "slots",
                format!(
                    "has {} entries; this batch holds at most {n} sequences",
                    slots.len()
                ),
            ));
        }
        let cu: Vec<i64> = self.bounds[..=slots.len()]
            .iter()
            .map(|&b| b as i64)
            .collect();
        let live = Self::new(CuSeqlens::I64(&cu), slots, self.bounds[slots.len()])?;
        live.check_slots(slot_bound)?;
        Ok(live)
    }

    /// Checks every slot against the number of slots of a pool.
    pub fn check_slots(&self, total_slots: usize) -> Result<()> {
        match self.slots.iter().find(|&&s| s as usize >= total_slots) {
            Some(s) => Err(KernelError::arg(
                "slots",
                format!("slot {s} is out of range; the pool has slots 0..{total_slots}"),
            )),
            None => Ok(()),
        }
    }
}

impl AsRef<BatchPlan> for BatchPlan {
    fn as_ref(&self) -> &BatchPlan {
        self
    }
}

/// A read-only tensor in backend memory: a buffer, its element type and element count.
#[derive(Debug)]
pub struct TensorView<'a, B> {
    /// The buffer (the tensor starts at its first byte).
    pub buf: &'a B,
    /// Element type.
    pub dtype: Dtype,
    /// Number of elements.
    pub len: usize,
}

impl<B> Clone for TensorView<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for TensorView<'_, B> {}

/// A writable tensor in backend memory.
#[derive(Debug)]
pub struct TensorViewMut<'a, B> {
    /// The buffer (the tensor starts at its first byte).
    pub buf: &'a mut B,
    /// Element type.
    pub dtype: Dtype,
    /// Number of elements.
    pub len: usize,
}

/// A read-only `u32` vector in backend memory (accepted counts).
#[derive(Debug)]
pub struct IndexView<'a, B> {
    /// The buffer.
    pub buf: &'a B,
    /// Number of entries.
    pub len: usize,
}

/// The per-token inputs of one call.
#[derive(Debug)]
pub struct StepInputs<'a, B> {
    /// `[T, H, K]`.
    pub q: TensorView<'a, B>,
    /// `[T, H, K]`.
    pub k: TensorView<'a, B>,
    /// `[T, HV, V]`.
    pub v: TensorView<'a, B>,
    /// `[T, HV, K]`: the raw gate ([`GateMode::Softplus`], [`GateMode::LowerBound`]) or the
    /// activated log-decay ([`GateMode::Activated`]).
    pub g: TensorView<'a, B>,
    /// `[T, HV]`: raw ([`BetaMode::Sigmoid`]) or activated ([`BetaMode::Activated`]).
    pub beta: TensorView<'a, B>,
    /// `[HV]` f32, needed when the gate is activated in the kernel.
    pub a_log: Option<TensorView<'a, B>>,
    /// `[HV * K]` f32, needed when the gate is activated in the kernel.
    pub dt_bias: Option<TensorView<'a, B>>,
}

/// How the gate input is turned into the log-decay `g <= 0`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum GateMode {
    /// `g` is already the log-decay.
    #[default]
    Activated,
    /// `g = -exp(A_log) * softplus(x + dt_bias)`.
    Softplus,
    /// `g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias))` (`lower_bound < 0`).
    LowerBound(f32),
}

/// How the beta input is turned into beta.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BetaMode {
    /// beta is already activated.
    #[default]
    Activated,
    /// `beta = sigmoid(b)`.
    Sigmoid,
}

/// Options of a KDA call. They are a property of the layer: a slot's ring replays its
/// entries with the options of the call that replays them, so keep them fixed per layer.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KdaOptions {
    /// Read-out scale; `None` is `K^-0.5`.
    pub scale: Option<f32>,
    /// l2-normalise q and k in the kernel (eps 1e-6 inside the square root).
    pub l2norm_qk: bool,
    /// Gate activation.
    pub gate: GateMode,
    /// Beta activation.
    pub beta: BetaMode,
    /// Multiply beta by 2 (eigenvalues of the transition in (-1, 1)).
    pub allow_neg_eigval: bool,
}

impl KdaOptions {
    /// The scale in effect for key dim `k`.
    pub fn scale_for(&self, k: usize) -> f32 {
        self.scale.unwrap_or(1.0 / (k as f32).sqrt())
    }
    /// Whether `A_log` and `dt_bias` are needed.
    pub fn needs_gate_params(&self) -> bool {
        !matches!(self.gate, GateMode::Activated)
    }
}

/// The buffer type of a backend.
pub type Buf<B> = <<B as Backend>::Memory as DeviceMemory>::Buffer;

/// The kind of prepared batch a call runs on: [`Backend::prepare`]'s or
/// [`Backend::prepare_padded`]'s. A GPU backend compiles its kernels apart for each (a plain
/// batch's kernels do not test for padding), so ahead-of-time compiles and warm-ups name the
/// kinds an engine uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchKind {
    /// A batch of [`Backend::prepare`]: every sequence computed.
    Plain,
    /// A batch of [`Backend::prepare_padded`]: its live sequences computed.
    Padded,
}

impl BatchKind {
    /// Both kinds.
    pub const ALL: [BatchKind; 2] = [BatchKind::Plain, BatchKind::Padded];

    /// `plain` or `padded`.
    pub fn name(self) -> &'static str {
        match self {
            BatchKind::Plain => "plain",
            BatchKind::Padded => "padded",
        }
    }

    /// `plain` or `padded` ([`BatchKind::name`]), else `None`.
    pub fn parse(s: &str) -> Option<Self> {
        BatchKind::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// A KDA backend: one method per operation, `Result` everywhere. Every method validates its
/// arguments before touching the pool; on an argument error nothing has changed.
pub trait Backend: Send + Sync {
    /// The memory the backend's pools and tensors live in.
    type Memory: DeviceMemory;
    /// A batch prepared for this backend (validated; on a GPU, also uploaded).
    type Batch: AsRef<BatchPlan>;

    /// Backend name (`cpu`, `cuda`).
    fn name(&self) -> &'static str;
    /// The backend's memory, to build pools and tensors.
    fn memory(&self) -> &Self::Memory;
    /// Prepares a validated batch for repeated use.
    fn prepare(&self, plan: BatchPlan) -> Result<Self::Batch>;

    /// Prepares a batch padded to `plan`'s sequences, all live at first. A call with it
    /// computes only its live sequences (the first ones), reading and writing none of the
    /// others' slots, states, rings and outputs and using none of their inputs, while its
    /// tensors keep the padded shape (`plan`'s tokens); [`Backend::update_batch`] changes the
    /// live sequences and their slots in place. For CUDA graphs, whose launches and buffers are fixed: an
    /// engine pads each step to a graph's size, its requests first. Every slot, now and in
    /// updates, must lie below `slot_bound` (the pool's `total_slots()`; a call on a pool with
    /// fewer slots is refused). An empty plan or a slot out of range is an argument error.
    fn prepare_padded(&self, plan: BatchPlan, slot_bound: usize) -> Result<Self::Batch>;

    /// Makes the first `slots.len()` sequences of a batch of [`Backend::prepare_padded`] its
    /// live ones, with these slots (distinct, below its slot bound; may be empty, and a call
    /// then computes nothing). On a GPU the update is ordered with the calls before and after
    /// it, without waiting for them. With stochastic rounding the batch's calls round at the
    /// layer's epoch plus its updates so far times
    /// [`crate::cpu::validate::PADDED_EPOCH_STEP`] (mod 2^32), on every backend, so the
    /// replays of one captured graph draw fresh bits. A batch of [`Backend::prepare`], too many
    /// slots, a slot out of range or twice is an argument error and changes nothing.
    fn update_batch(&self, batch: &mut Self::Batch, slots: &[u32]) -> Result<()>;

    /// Varlen prefill (the chunked form on the CPU; on the CUDA backend token by token, or
    /// chunked where `CudaBackend::set_prefill_kernel` asks for it): each
    /// sequence starts from its slot's true state (pending ring entries are folded first,
    /// drafts dropped), its final state is stored back once and its ring is left empty.
    fn prefill(
        &self,
        batch: &Self::Batch,
        inputs: &StepInputs<'_, Buf<Self>>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf<Self>>,
        out: &mut TensorViewMut<'_, Buf<Self>>,
    ) -> Result<()>;

    /// One accepted token per sequence (every sequence has length 1). Outstanding drafts of a
    /// previous verify must have been resolved (see [`Backend::spec_verify`]).
    fn decode(
        &self,
        batch: &Self::Batch,
        inputs: &StepInputs<'_, Buf<Self>>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf<Self>>,
        out: &mut TensorViewMut<'_, Buf<Self>>,
    ) -> Result<()>;

    /// Speculative verify: per sequence, `accepted[i]` of the previous verify's drafts become
    /// pending (the rest are dropped), then the sequence's tokens (1..=ring_len) are computed as
    /// new drafts.
    fn spec_verify(
        &self,
        batch: &Self::Batch,
        accepted: &IndexView<'_, Buf<Self>>,
        inputs: &StepInputs<'_, Buf<Self>>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf<Self>>,
        out: &mut TensorViewMut<'_, Buf<Self>>,
    ) -> Result<()>;

    /// Folds the pending entries of the batch's slots into their committed states, stores
    /// them and clears the rings (drafts are dropped). The batch's sequences have length 0;
    /// `accepted`, if given, first turns that many drafts of each slot into pending entries.
    fn replay(
        &self,
        batch: &Self::Batch,
        accepted: Option<&IndexView<'_, Buf<Self>>>,
        opts: &KdaOptions,
        a_log: Option<&TensorView<'_, Buf<Self>>>,
        dt_bias: Option<&TensorView<'_, Buf<Self>>>,
        layer: &mut LayerMut<'_, Buf<Self>>,
    ) -> Result<()>;
}

/// The layer facts a call is validated against.
pub fn layer_dims(geometry: &PoolGeometry) -> (usize, usize, usize, usize, StateLayout) {
    (
        geometry.h,
        geometry.hv,
        geometry.k,
        geometry.v,
        geometry.layout,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn padded(n: usize) -> BatchPlan {
        let cu: Vec<i32> = (0..=n as i32).collect();
        let slots: Vec<u32> = (0..n as u32).map(|i| 2 * i).collect();
        BatchPlan::new(CuSeqlens::I32(&cu), &slots, n).unwrap()
    }

    fn refused(r: Result<BatchPlan>, what: &str) {
        match r {
            Err(KernelError::InvalidArgument { arg, msg }) => {
                assert_eq!(arg, "slots");
                assert!(msg.contains(what), "{msg:?} lacks {what:?}");
            }
            other => panic!("expected an argument error about {what}, got {other:?}"),
        }
    }

    #[test]
    fn live_slots_give_the_plan_of_the_batchs_first_sequences() {
        let spec = BatchPlan::new(CuSeqlens::I64(&[0, 3, 5, 9]), &[4, 7, 1], 9).unwrap();
        let live = spec.with_live_slots(&[11, 2], 12).unwrap();
        assert_eq!(live.bounds, [0, 3, 5]);
        assert_eq!(live.slots, [11, 2]);
        let all = spec.with_live_slots(&[0, 1, 2], 3).unwrap();
        assert_eq!(all.bounds, spec.bounds);
        let none = spec.with_live_slots(&[], 3).unwrap();
        assert_eq!((none.num_seqs(), none.num_tokens()), (0, 0));
    }

    #[test]
    fn live_slots_are_refused_past_the_batch_the_bound_or_twice() {
        let plan = padded(4);
        refused(
            plan.with_live_slots(&[0, 1, 2, 3, 5], 8),
            "at most 4 sequences",
        );
        refused(plan.with_live_slots(&[0, 8], 8), "slot 8 is out of range");
        refused(plan.with_live_slots(&[3, 1, 3], 8), "slot 3 appears twice");
    }
}
