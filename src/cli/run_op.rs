//! `kda-pool run-op`: replays a captured prefill or decode call from a safetensors file on a
//! backend, through pool slots of the chosen state dtype, and writes the outputs and the final
//! states to another safetensors file.

use std::collections::HashMap;
use std::path::PathBuf;

use kda_kernels::{Backend, BatchPlan, CuSeqlens};
use state_pool::dtype::{resolve_state_dtype_env, DtypeInput};
use state_pool::{Dtype, PoolGeometry, Rounding, StateLayout};

use super::CliError;
use crate::backends::{dispatch, BackendKind, BackendTask};
use crate::captured::{self, CapturedCall, Offsets};
use crate::harness::{DeviceInputs, DeviceLayer, DeviceParams, DeviceTensor};

/// The operation to replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Op {
    /// Varlen chunked prefill.
    Prefill,
    /// One decode step (every sequence has length 1).
    Decode,
}

/// The input and output formats, shown by `kda-pool run-op --help`.
const FORMATS: &str = "\
Input file (safetensors, token axis flattened, B = 1):
  q, k           [T, H, K]
  v              [T, HV, V]
  g              [T, HV, K]   raw gate with use_gate_in_kernel, else the log-decay
  beta           [T, HV]      raw with use_beta_sigmoid, else in (0, 1)
  A_log          [HV]         with use_gate_in_kernel
  dt_bias        [HV*K]       with use_gate_in_kernel
  cu_seqlens     [N+1]        int32 or int64; for --op decode every sequence has length 1
  initial_state  [N, HV, K, V] optional ([N, HV, V, K] when state_layout is vfirst)
  q, k, v, g and beta share one dtype: f32, f16 or bf16.
Metadata (strings): scale (default K^-0.5); use_qk_l2norm, use_gate_in_kernel,
  use_beta_sigmoid, allow_neg_eigval (\"true\" | \"false\", default \"false\"); lower_bound (the
  bounded gate form); state_layout (\"kfirst\" | \"vfirst\", default \"kfirst\").
Output file: o [T, HV, V] in v's dtype, final_state [N, HV, K, V] (V-first likewise) in f32,
  read back from the pool.";

/// Arguments of `kda-pool run-op`: the operation, the files, the pool's state dtype and the
/// backend (the formats are in [`FORMATS`]).
#[derive(Debug, clap::Args)]
#[command(after_long_help = FORMATS)]
pub struct Args {
    /// The operation.
    #[arg(long, value_enum)]
    pub op: Op,
    /// The captured call (safetensors).
    #[arg(long, value_name = "IN.safetensors")]
    pub inputs: PathBuf,
    /// Where to write `o` and `final_state` (safetensors).
    #[arg(long, value_name = "OUT.safetensors")]
    pub out: PathBuf,
    /// State dtype of the pool slots (fp32, fp16, bf16). Without it: KDA_SSM_DTYPE, then
    /// ATOM_KDA_SSM_DTYPE, then fp32.
    #[arg(long, value_name = "D")]
    pub state_dtype: Option<String>,
    /// Backend to run on (cuda needs a build with `--features cuda` and a GPU).
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    pub backend: BackendKind,
}

/// What a replay produced, in host memory.
struct Outputs {
    o: Vec<u8>,
    o_dtype: Dtype,
    final_state: Vec<f32>,
    backend: &'static str,
}

struct Task<'a> {
    call: &'a CapturedCall,
    plan: BatchPlan,
    op: Op,
    state_dtype: Dtype,
}

impl BackendTask for Task<'_> {
    type Output = Outputs;

    fn run<B: Backend>(self, be: &B) -> Result<Outputs, CliError> {
        let c = self.call;
        let d = c.dims;
        let n = c.cu_seqlens.num_seqs();
        let geometry = PoolGeometry {
            layers: 1,
            h: d.h,
            hv: d.hv,
            k: d.k,
            v: d.v,
            conv_rows: 0,
            conv_channels: 0,
            conv_dtype: Dtype::Bf16,
            state_dtype: self.state_dtype,
            layout: c.layout,
            ring_len: 0,
            ring_dtype: c.v.dtype,
            ring_deltas: false,
            slots: n,
            checkpoint_slots: 0,
            rounding: Rounding::Nearest,
        };
        let batch = be.prepare(self.plan)?;
        let mut layer = DeviceLayer::new(be, geometry)?;
        if let Some(init) = &c.initial_state {
            for (slot, s) in init.chunks_exact(d.state_elems()).enumerate() {
                layer.write_state(be, slot, s)?;
            }
        }
        let upload =
            |t: &captured::RawTensor| DeviceTensor::from_bytes(be, &t.bytes, t.dtype, t.len);
        let inputs = DeviceInputs {
            q: upload(&c.q)?,
            k: upload(&c.k)?,
            v: upload(&c.v)?,
            g: upload(&c.g)?,
            beta: upload(&c.beta)?,
        };
        let f32_tensor = |x: &Option<Vec<f32>>| {
            x.as_ref()
                .map(|v| DeviceTensor::from_f32(be, v, Dtype::Fp32))
                .transpose()
        };
        let params = DeviceParams {
            a_log: f32_tensor(&c.a_log)?,
            dt_bias: f32_tensor(&c.dt_bias)?,
        };
        let mut out = DeviceTensor::poisoned(be, c.v.dtype, c.tokens * d.hv * d.v)?;
        match self.op {
            Op::Prefill => layer.prefill(be, &batch, &inputs, &params, &c.opts, &mut out)?,
            Op::Decode => layer.decode(be, &batch, &inputs, &params, &c.opts, &mut out)?,
        }
        let mut final_state = Vec::with_capacity(n * d.state_elems());
        for slot in 0..n {
            final_state.extend(layer.read_state(be, slot)?);
        }
        Ok(Outputs {
            o: out.to_bytes(be)?,
            o_dtype: c.v.dtype,
            final_state,
            backend: be.name(),
        })
    }
}

/// Runs `kda-pool run-op`.
pub fn run(args: Args) -> Result<(), CliError> {
    let bytes = std::fs::read(&args.inputs).map_err(|e| {
        CliError::Usage(format!(
            "--inputs {}: cannot read: {e}",
            args.inputs.display()
        ))
    })?;
    let call = captured::parse(&bytes)
        .map_err(|e| CliError::Usage(format!("--inputs {}: {e}", args.inputs.display())))?;
    if args.op == Op::Decode {
        let offsets = call.cu_seqlens.to_i64();
        if let Some(i) = offsets.windows(2).position(|w| w[1] - w[0] != 1) {
            return Err(CliError::Usage(format!(
                "--inputs {}: tensor cu_seqlens: --op decode needs every sequence of length 1; sequence {i} has {} tokens",
                args.inputs.display(),
                offsets[i + 1] - offsets[i]
            )));
        }
    }
    let slots: Vec<u32> = (0..call.cu_seqlens.num_seqs() as u32).collect();
    let plan = match &call.cu_seqlens {
        Offsets::I32(o) => BatchPlan::new(CuSeqlens::I32(o), &slots, call.tokens),
        Offsets::I64(o) => BatchPlan::new(CuSeqlens::I64(o), &slots, call.tokens),
    }
    .map_err(|e| CliError::Usage(format!("--inputs {}: {e}", args.inputs.display())))?;
    let state_dtype = resolve_state_dtype_env(
        args.state_dtype
            .as_deref()
            .map(|v| DtypeInput::new(v, "--state-dtype")),
        None,
    )?
    .0;
    let outputs = dispatch(
        args.backend,
        Task {
            call: &call,
            plan,
            op: args.op,
            state_dtype,
        },
    )?;
    let d = call.dims;
    let n = call.cu_seqlens.num_seqs();
    let state_shape = match call.layout {
        StateLayout::KFirst => vec![n, d.hv, d.k, d.v],
        StateLayout::VFirst => vec![n, d.hv, d.v, d.k],
    };
    let metadata = HashMap::from([
        ("op".to_string(), format!("{:?}", args.op).to_lowercase()),
        ("backend".to_string(), outputs.backend.to_string()),
        ("state_dtype".to_string(), state_dtype.name().to_string()),
        ("state_layout".to_string(), call.layout.name().to_string()),
    ]);
    let file = captured::serialize_outputs(
        &outputs.o,
        outputs.o_dtype,
        vec![call.tokens, d.hv, d.v],
        &outputs.final_state,
        state_shape,
        metadata,
    )
    .map_err(|e| CliError::Failed(format!("cannot encode the outputs: {e}")))?;
    std::fs::write(&args.out, file)
        .map_err(|e| CliError::Usage(format!("--out {}: cannot write: {e}", args.out.display())))?;
    tracing::info!(
        "{} {} tokens in {} sequences on {} ({} state) -> {}",
        format!("{:?}", args.op).to_lowercase(),
        call.tokens,
        n,
        outputs.backend,
        state_dtype,
        args.out.display()
    );
    Ok(())
}
