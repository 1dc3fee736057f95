//! The independent check of a finished request: its tokens recomputed alone, one token at a
//! time, in an fp32 pool on the CPU backend with eager decode (no ring, no checkpoint, no
//! chunked prefill, no batching), and compared with what the engine produced: every output
//! the engine produced, and the final state after the engine's flush.
//!
//! The errors are relative Frobenius errors over the whole request (all layers). Thresholds by
//! the engine's state dtype ([`thresholds`]):
//!
//! | state dtype | outputs | final state | why |
//! |---|---|---|---|
//! | fp32 | 1e-5 | 1e-5 | the same f32 arithmetic; only the chunked prefill sums in another order (~3e-7 measured) |
//! | fp16 | 4e-3 | 4e-3 | one fp16 rounding (2^-11) per state store, accumulated over the stores (~7e-4 measured) |
//! | bf16 | 3e-2 | 3e-2 | bf16 keeps 3 fewer mantissa bits: about 8x fp16 (~5e-3 measured) |
//!
//! The thresholds sit about 6x (30x for fp32) above the largest errors measured over many seeds with the
//! default workload, so a correct engine passes and a wrong one (a dropped token, a rejected
//! draft kept, a lost restore) fails by orders of magnitude.

use kda_kernels::cpu::CpuBackend;
use kda_kernels::{Backend, BatchPlan, CuSeqlens, KdaOptions};
use rayon::prelude::*;
use state_pool::{Dtype, HostMemory, Plane, PoolGeometry, StatePool};

use super::engine::Record;
use super::workload::InputSource;
use crate::harness::{DeviceInputs, DeviceParams, DeviceTensor};
use crate::host_tensor::ErrorAccumulator;

/// The largest relative errors a request may show against the recomputation, for a pool of
/// `state_dtype`: `(outputs, final state)`. See the module docs.
pub fn thresholds(state_dtype: Dtype) -> (f64, f64) {
    match state_dtype {
        Dtype::Fp32 => (1e-5, 1e-5),
        Dtype::Fp16 => (4e-3, 4e-3),
        Dtype::Bf16 => (3e-2, 3e-2),
    }
}

/// The verdict on one request.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Verdict {
    /// The request id.
    pub id: usize,
    /// Relative error of the produced outputs (NaN if any output is not finite).
    pub output_error: f64,
    /// Relative error of the final state (NaN if any element is not finite).
    pub state_error: f64,
    /// Outputs compared (tokens x layers).
    pub outputs_compared: usize,
    /// Positions past the restored prefix without an output, plus restored positions with
    /// one: the engine must produce exactly one output per token it computed and accepted.
    pub missing_outputs: usize,
    /// Whether both errors are within the thresholds.
    pub ok: bool,
    /// The engine found a non-finite value in the slot (a description), if so.
    pub poisoned: Option<String>,
}

/// The settings the recomputation shares with the engine: the model's dims and options, the
/// inputs and the input dtype. Nothing of the engine's pool (dtype, ring, slots) is used.
#[derive(Debug, Clone)]
pub struct Checker {
    /// The engine's pool geometry (dims, layers and layout are taken from it).
    pub geometry: PoolGeometry,
    /// Layer options.
    pub opts: KdaOptions,
    /// The token inputs.
    pub inputs: InputSource,
    /// Element type of the token inputs and outputs.
    pub io_dtype: Dtype,
}

impl Checker {
    /// The recomputation's pool: one fp32 slot per layer, no ring, no checkpoint slots.
    fn reference_geometry(&self) -> PoolGeometry {
        PoolGeometry {
            state_dtype: Dtype::Fp32,
            ring_len: 0,
            slots: 1,
            checkpoint_slots: 0,
            ..self.geometry.clone()
        }
    }

    /// Checks every record (in parallel).
    pub fn check_all(&self, records: &[Record]) -> Result<Vec<Verdict>, String> {
        let (out_thr, state_thr) = thresholds(self.geometry.state_dtype);
        records
            .par_iter()
            .map(|r| self.check(r, out_thr, state_thr))
            .collect()
    }

    fn check(&self, record: &Record, out_thr: f64, state_thr: f64) -> Result<Verdict, String> {
        let be = CpuBackend::new();
        let g = self.reference_geometry();
        let req = &record.request;
        let fail = |what: &str, e: String| format!("checker, request {}: {what}: {e}", req.id);
        let mut pool =
            StatePool::new(HostMemory, g.clone()).map_err(|e| fail("pool", e.to_string()))?;
        let slot = pool.allocate().map_err(|e| fail("slot", e.to_string()))?;
        let params = (0..g.layers)
            .map(|l| DeviceParams::upload(&be, &self.inputs.gate_params(l)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| fail("gate parameters", e.to_string()))?;
        let plan = BatchPlan::new(CuSeqlens::I32(&[0, 1]), &[slot.index_u32()], 1)
            .map_err(|e| fail("batch", e.to_string()))?;
        let batch = be.prepare(plan).map_err(|e| fail("batch", e.to_string()))?;
        let per = g.hv * g.v;
        let mut outputs = ErrorAccumulator::default();
        let mut compared = 0;
        let mut finite = true;
        for p in 0..req.total_len() {
            for (layer, params) in params.iter().enumerate() {
                let tokens = self.inputs.token(req, p, layer);
                let inputs = DeviceInputs::upload(&be, &tokens, self.io_dtype)
                    .map_err(|e| fail("upload", e.to_string()))?;
                let mut out = DeviceTensor::<CpuBackend>::poisoned(&be, self.io_dtype, per)
                    .map_err(|e| fail("output", e.to_string()))?;
                let mut view = pool
                    .layer_mut(layer)
                    .map_err(|e| fail("layer", e.to_string()))?;
                be.decode(
                    &batch,
                    &inputs.view(params),
                    &self.opts,
                    &mut view,
                    &mut out.view_mut(),
                )
                .map_err(|e| {
                    fail(
                        &format!("decode of position {p} in layer {layer}"),
                        e.to_string(),
                    )
                })?;
                if record.produced[p] {
                    let want = out.to_f32(&be).map_err(|e| fail("output", e.to_string()))?;
                    let got = &record.outputs[layer][p * per..(p + 1) * per];
                    finite &= got.iter().all(|x| x.is_finite());
                    outputs.add(got, &want);
                    compared += 1;
                }
            }
        }
        let mut state = ErrorAccumulator::default();
        for (layer, got) in record.final_state.iter().enumerate() {
            let bytes = pool
                .read_slot_plane(layer, Plane::Ssm, slot.index())
                .map_err(|e| fail("state", e.to_string()))?;
            finite &= got.iter().all(|x| x.is_finite());
            state.add(got, &Dtype::Fp32.decode_f32(&bytes));
        }
        let (output_error, state_error) = if finite {
            (outputs.relative(), state.relative())
        } else {
            (f64::NAN, f64::NAN)
        };
        let missing_outputs = record
            .produced
            .iter()
            .enumerate()
            .filter(|&(p, &made)| made != (p >= record.restored))
            .count();
        Ok(Verdict {
            id: req.id,
            output_error,
            state_error,
            outputs_compared: compared,
            missing_outputs,
            ok: output_error <= out_thr
                && state_error <= state_thr
                && missing_outputs == 0
                && record.poisoned.is_none(),
            poisoned: record.poisoned.map(|nf| nf.to_string()),
        })
    }
}
