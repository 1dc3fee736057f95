//! The CPU backend: the oracle of every GPU backend. f32 arithmetic with f32 accumulation,
//! rayon over (sequence, value head), state loads up-cast from the pool's element type and
//! stores rounded through it (nearest even or stochastic, [`crate::rounding`]).
//!
//! - [`step`]: the token step of spec section 2, shared by eager decode, the ring replay and
//!   the new tokens of decode and spec_verify;
//! - [`chunk`]: the chunked form of spec section 3 (prefill, `BT = 64`);
//! - [`validate`]: the checks every operation runs before touching the pool, and the ring
//!   contract as a per-sequence plan;
//! - `ring`, `exec`, `tensor`: the ring's data, the execution of a plan, typed buffer access;
//! - [`reference`](mod@reference): a plain f64 implementation of section 2, token by token, for
//!   tests and the accuracy report.

pub mod chunk;
mod exec;
pub mod reference;
mod ring;
pub mod step;
mod tensor;
pub mod validate;

use half::{bf16, f16};
use state_pool::{Dtype, HostBuffer, HostMemory, LayerMut, RingMeta};

use crate::api::{
    Backend, BatchPlan, IndexView, KdaOptions, StepInputs, TensorView, TensorViewMut,
};
use crate::error::{KernelError, Result};
use exec::Exec;
use validate::{check_layer, validate_call, CallArgs, Op};

/// The CPU backend: the oracle of every GPU backend.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

/// A batch prepared for the CPU backend: its plans ([`validate::PreparedPlan`]).
pub type CpuBatch = validate::PreparedPlan;

/// The host memory every CPU pool and tensor lives in.
static HOST: HostMemory = HostMemory;

impl CpuBackend {
    /// A CPU backend (rayon's global thread pool does the work).
    pub fn new() -> Self {
        Self
    }
}

/// Reads the first `live` accepted counts after checking the view's length (one per
/// sequence of the batch, `capacity`) and buffer.
fn accepted_counts<'a>(
    acc: &IndexView<'a, HostBuffer>,
    capacity: usize,
    live: usize,
) -> Result<&'a [u32]> {
    validate::check_accepted(&HOST, acc, capacity)?;
    Ok(tensor::elems(acc.buf, live))
}

/// The ring bookkeeping of the batch's slots (validated in range), default without a ring.
fn batch_metas(layer: &LayerMut<'_, HostBuffer>, plan: &BatchPlan) -> Result<Vec<RingMeta>> {
    let g = layer.geometry;
    validate::check_plan(plan)?;
    plan.check_slots(g.total_slots())?;
    if g.ring_len == 0 {
        return Ok(vec![RingMeta::default(); plan.num_seqs()]);
    }
    let metas: &[RingMeta] = tensor::elems(layer.meta, g.total_slots());
    Ok(plan.slots.iter().map(|&s| metas[s as usize]).collect())
}

/// Calls `exec::run::<I, S>` for the runtime element types.
fn dispatch(input: Dtype, state: Dtype, ex: Exec<'_>) -> Result<()> {
    use Dtype::{Bf16, Fp16, Fp32};
    match (input, state) {
        (Fp32, Fp32) => exec::run::<f32, f32>(ex),
        (Fp32, Fp16) => exec::run::<f32, f16>(ex),
        (Fp32, Bf16) => exec::run::<f32, bf16>(ex),
        (Fp16, Fp32) => exec::run::<f16, f32>(ex),
        (Fp16, Fp16) => exec::run::<f16, f16>(ex),
        (Fp16, Bf16) => exec::run::<f16, bf16>(ex),
        (Bf16, Fp32) => exec::run::<bf16, f32>(ex),
        (Bf16, Fp16) => exec::run::<bf16, f16>(ex),
        (Bf16, Bf16) => exec::run::<bf16, bf16>(ex),
    }
}

impl CpuBackend {
    /// Validates and runs one token-carrying operation (prefill, decode, spec_verify).
    #[allow(clippy::too_many_arguments)]
    fn run_tokens(
        &self,
        op: Op,
        batch: &CpuBatch,
        accepted: Option<&IndexView<'_, HostBuffer>>,
        inputs: &StepInputs<'_, HostBuffer>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, HostBuffer>,
        out: &mut TensorViewMut<'_, HostBuffer>,
    ) -> Result<()> {
        let g = layer.geometry;
        let plan = batch.as_ref();
        check_layer(&HOST, g, layer.ssm, layer.ring, layer.meta, layer.delta)?;
        batch.check_call(op, g)?;
        let metas = batch_metas(layer, plan)?;
        let accepted = accepted
            .map(|a| accepted_counts(a, batch.capacity(), plan.num_seqs()))
            .transpose()?;
        if out.buf.len() < out.len * out.dtype.size() {
            return Err(KernelError::arg(
                "out",
                format!(
                    "buffer has {} bytes; {} elements of {} need {}",
                    out.buf.len(),
                    out.len,
                    out.dtype,
                    out.len * out.dtype.size()
                ),
            ));
        }
        let call = validate_call(
            &HOST,
            g,
            &CallArgs {
                op,
                plan,
                inputs: Some(inputs),
                a_log: None,
                dt_bias: None,
                opts,
                out: Some((out.dtype, out.len)),
                accepted,
                metas: &metas,
                tensor_tokens: batch.tensor_tokens(),
            },
        )?;
        let input = call.input_dtype.unwrap_or(inputs.q.dtype);
        dispatch(
            input,
            g.state_dtype,
            Exec {
                plan: &call,
                opts,
                inputs: Some(inputs),
                a_log: None,
                dt_bias: None,
                layer: exec::reborrow(layer),
                out: Some((&mut *out.buf, out.len)),
                epoch_offset: batch.epoch_offset(),
            },
        )
    }
}

impl Backend for CpuBackend {
    type Memory = HostMemory;
    type Batch = CpuBatch;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn memory(&self) -> &HostMemory {
        &HOST
    }

    fn prepare(&self, plan: BatchPlan) -> Result<CpuBatch> {
        CpuBatch::plain(plan)
    }

    fn prepare_padded(&self, plan: BatchPlan, slot_bound: usize) -> Result<CpuBatch> {
        CpuBatch::padded(plan, slot_bound)
    }

    fn update_batch(&self, batch: &mut CpuBatch, slots: &[u32]) -> Result<()> {
        batch.update(slots)
    }

    fn prefill(
        &self,
        batch: &CpuBatch,
        inputs: &StepInputs<'_, HostBuffer>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, HostBuffer>,
        out: &mut TensorViewMut<'_, HostBuffer>,
    ) -> Result<()> {
        self.run_tokens(Op::Prefill, batch, None, inputs, opts, layer, out)
    }

    fn decode(
        &self,
        batch: &CpuBatch,
        inputs: &StepInputs<'_, HostBuffer>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, HostBuffer>,
        out: &mut TensorViewMut<'_, HostBuffer>,
    ) -> Result<()> {
        self.run_tokens(Op::Decode, batch, None, inputs, opts, layer, out)
    }

    fn spec_verify(
        &self,
        batch: &CpuBatch,
        accepted: &IndexView<'_, HostBuffer>,
        inputs: &StepInputs<'_, HostBuffer>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, HostBuffer>,
        out: &mut TensorViewMut<'_, HostBuffer>,
    ) -> Result<()> {
        self.run_tokens(
            Op::SpecVerify,
            batch,
            Some(accepted),
            inputs,
            opts,
            layer,
            out,
        )
    }

    fn replay(
        &self,
        batch: &CpuBatch,
        accepted: Option<&IndexView<'_, HostBuffer>>,
        opts: &KdaOptions,
        a_log: Option<&TensorView<'_, HostBuffer>>,
        dt_bias: Option<&TensorView<'_, HostBuffer>>,
        layer: &mut LayerMut<'_, HostBuffer>,
    ) -> Result<()> {
        let g = layer.geometry;
        let plan = batch.as_ref();
        check_layer(&HOST, g, layer.ssm, layer.ring, layer.meta, layer.delta)?;
        batch.check_call(Op::Replay, g)?;
        let metas = batch_metas(layer, plan)?;
        let accepted = accepted
            .map(|a| accepted_counts(a, batch.capacity(), plan.num_seqs()))
            .transpose()?;
        let call = validate_call(
            &HOST,
            g,
            &CallArgs {
                op: Op::Replay,
                plan,
                inputs: None,
                a_log,
                dt_bias,
                opts,
                out: None,
                accepted,
                metas: &metas,
                tensor_tokens: batch.tensor_tokens(),
            },
        )?;
        if g.ring_len == 0 {
            return Ok(());
        }
        dispatch(
            g.ring_dtype,
            g.state_dtype,
            Exec {
                plan: &call,
                opts,
                inputs: None,
                a_log,
                dt_bias,
                layer: exec::reborrow(layer),
                out: None,
                epoch_offset: batch.epoch_offset(),
            },
        )
    }
}
