//! `kda-pool simulate`: drive the pool and the kernels as a serving engine does (admission,
//! chunked prefill, decode or speculative verify over the replay ring, prefix checkpoints and
//! restores, release), then check every request against an fp32 recomputation of it alone.
//!
//! The default model is a small one that runs in seconds on two cores
//! (`configs/sim-small.json`: 2 KDA layers, H = 4, HV = 8, K = V = 32, conv kernel 4);
//! `--model` or `--hf-config` load another shape (large shapes are slow on the CPU).
//!
//! Exit codes: 0 when every request is right and no slot leaked; 1 when a request is wrong,
//! a slot leaked or a kernel failed; 2 for bad input (one line on stderr).

use std::path::PathBuf;

use kda_kernels::Backend;
use state_pool::{sizing, Dtype, DtypeInput, ModelConfig, PoolConfig, PoolGeometry};

use super::CliError;
use crate::backends::{BackendKind, PrefillKernelArg};
use crate::simulate::engine::EngineConfig;
use crate::simulate::summary::{ModelSummary, Summary};
use crate::simulate::workload::WorkloadSpec;
use crate::simulate::{self, checker, layer_options, SimConfig, SimError};

/// The default model of the simulation.
const DEFAULT_MODEL: &str = include_str!("../../configs/sim-small.json");
/// How the embedded default is named in messages.
const DEFAULT_MODEL_SOURCE: &str = "configs/sim-small.json (embedded)";

/// Arguments of `kda-pool simulate`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Backend to run on (the checker recomputes each request on the CPU either way).
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    pub backend: BackendKind,
    /// Model in the project's JSON schema (default: the embedded small model).
    #[arg(long, value_name = "FILE", conflicts_with = "hf_config")]
    pub model: Option<PathBuf>,
    /// A Hugging Face config.json with a `linear_attn_config`.
    #[arg(long, value_name = "FILE")]
    pub hf_config: Option<PathBuf>,
    /// SSM state dtype: fp32, fp16 or bf16 (default: KDA_SSM_DTYPE, ATOM_KDA_SSM_DTYPE, the
    /// model file's state_dtype, fp32).
    #[arg(long, value_name = "D")]
    pub dtype: Option<String>,
    /// Dtype of the token inputs, the outputs and the ring. The values are bf16 either way;
    /// fp32 tensors keep the outputs unrounded, so the errors are the pool's alone.
    #[arg(long, value_name = "D", default_value = "fp32")]
    pub io_dtype: String,
    /// Requests of the workload.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub requests: usize,
    /// Request slots of the pool: the most requests running at once (the rest wait).
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub max_running: usize,
    /// Memory budget of the pool (e.g. 2MiB, SI or IEC suffix): admission checks that the
    /// request and checkpoint slots fit it, as an engine sizes its pool at start-up.
    #[arg(long, value_name = "BYTES")]
    pub budget: Option<String>,
    /// Checkpoint slots for shared prefixes.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub checkpoint_slots: usize,
    /// Longest prompt in tokens (prompts are uniform in 1..=N, or as long as their prefix).
    #[arg(long, value_name = "N", default_value_t = 96)]
    pub max_prompt: usize,
    /// Most tokens generated per request (uniform in 1..=N).
    #[arg(long, value_name = "N", default_value_t = 24)]
    pub max_new: usize,
    /// Prompt tokens one request prefills per step at most (chunked prefill).
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub chunk: usize,
    /// Draft tokens per speculative verify (0: plain decode). A verify step has N + 1 tokens.
    #[arg(long, value_name = "T", default_value_t = 0)]
    pub spec_tokens: usize,
    /// Replay-ring length in tokens (default: 2 x (T + 1) with --spec-tokens T > 0, else 0).
    #[arg(long, value_name = "L")]
    pub ring_len: Option<usize>,
    /// Probability that a draft is accepted, given that the drafts before it were.
    #[arg(long, value_name = "P", default_value_t = 0.7)]
    pub accept_rate: f64,
    /// Fraction of requests that share a prefix with an earlier request.
    #[arg(long, value_name = "P", default_value_t = 0.25)]
    pub prefix_share: f64,
    /// Seed of the workload, the inputs and the accepted counts.
    #[arg(long, value_name = "S", default_value_t = 1)]
    pub seed: u64,
    /// Fault injection: put a NaN in the inputs of request ID (at its middle token). That
    /// request is reported poisoned and wrong, the others must still be right.
    #[arg(long, value_name = "ID")]
    pub inject_nan: Option<usize>,
    /// Run decode and verify steps of at most N sequences of one length through one padded
    /// batch per length (prepare_padded, update_batch), as an engine that replays CUDA graphs
    /// of a fixed size does; N at most the pool's request and checkpoint slots.
    #[arg(long, value_name = "N")]
    pub pad_to: Option<usize>,
    /// The CUDA backend's prefill kernel: steps (token by token), chunked, or by-shape (chunked
    /// where the call's shape is expected to run faster so; its default) (--backend cuda
    /// only).
    #[arg(long, value_enum, value_name = "K")]
    pub prefill_kernel: Option<PrefillKernelArg>,
    /// Print one JSON object instead of the text summary.
    #[arg(long)]
    pub json: bool,
}

fn usage(msg: String) -> CliError {
    CliError::Usage(msg)
}

/// Checks the numbers before anything runs, so bad input stops with one line.
fn check_args(args: &Args) -> Result<(), CliError> {
    for (name, value) in [
        ("--requests", args.requests),
        ("--max-running", args.max_running),
        ("--max-prompt", args.max_prompt),
        ("--max-new", args.max_new),
        ("--chunk", args.chunk),
    ] {
        if value == 0 {
            return Err(usage(format!("{name} 0: expected a positive integer")));
        }
    }
    if let (Some(k), BackendKind::Cpu) = (args.prefill_kernel, args.backend) {
        return Err(usage(format!(
            "--prefill-kernel {}: chooses the CUDA backend's prefill (the CPU backend's is \
             always chunked); use it with --backend cuda",
            clap::ValueEnum::to_possible_value(&k)
                .map_or(String::new(), |v| v.get_name().to_string())
        )));
    }
    if let Some(n) = args.pad_to {
        let slots = args.max_running + args.checkpoint_slots;
        if n == 0 || n > slots {
            return Err(usage(format!(
                "--pad-to {n}: expected 1..={slots} (a padded batch's sequences hold distinct \
                 slots of the pool: --max-running + --checkpoint-slots)"
            )));
        }
    }
    for (name, value) in [
        ("--accept-rate", args.accept_rate),
        ("--prefix-share", args.prefix_share),
    ] {
        if !(0.0..=1.0).contains(&value) {
            return Err(usage(format!(
                "{name} {value}: expected a probability in [0, 1]"
            )));
        }
    }
    if let Some(id) = args.inject_nan {
        if id >= args.requests {
            return Err(usage(format!(
                "--inject-nan {id}: expected a request id in 0..{}",
                args.requests
            )));
        }
    }
    if args.spec_tokens > 0 {
        let need = args.spec_tokens + 1;
        if let Some(l) = args.ring_len {
            if l < need {
                return Err(usage(format!(
                    "--ring-len {l}: a verify step of --spec-tokens {} has {need} tokens and the ring must hold them; expected at least {need}",
                    args.spec_tokens
                )));
            }
        }
    }
    Ok(())
}

fn load_model(args: &Args) -> Result<ModelConfig, CliError> {
    Ok(match (&args.model, &args.hf_config) {
        (Some(path), _) => ModelConfig::load(path)?,
        (None, Some(path)) => ModelConfig::load_hf(path)?,
        (None, None) => ModelConfig::from_json_str(DEFAULT_MODEL, DEFAULT_MODEL_SOURCE)?,
    })
}

/// Runs `kda-pool simulate`.
pub fn run(args: Args) -> Result<(), CliError> {
    check_args(&args)?;
    // the backend first: where CUDA is not available that is the one line printed
    match args.backend {
        BackendKind::Cpu => run_on(&kda_kernels::cpu::CpuBackend::new(), args),
        BackendKind::Cuda => {
            let be = crate::backends::cuda_backend()?;
            be.set_prefill_kernel(args.prefill_kernel.map(Into::into))
                .map_err(|e| CliError::Failed(format!("--prefill-kernel: {e}")))?;
            run_on(&be, args)
        }
    }
}

/// [`run`] on `backend`.
fn run_on<B: Backend>(backend: &B, args: Args) -> Result<(), CliError>
where
    B::Memory: Clone,
{
    let io_dtype = Dtype::parse_from(&args.io_dtype, "--io-dtype")?;
    let model = load_model(&args)?;
    let ring_len = args
        .ring_len
        .unwrap_or_else(|| sizing::default_ring_len(Some(args.spec_tokens)));
    let pool_config = PoolConfig {
        ring_len,
        ring_dtype: io_dtype,
        slots: args.max_running,
        checkpoint_slots: args.checkpoint_slots,
        ..PoolConfig::default()
    };
    // The shape and counts are checked with an fp32 state (the largest) before the dtype
    // decision, which logs it.
    PoolGeometry::new(&model.shape, &pool_config)?;
    let budget = args
        .budget
        .as_deref()
        .map(|b| sizing::parse_bytes(b, "--budget"))
        .transpose()?;
    // The one dtype decision; everything below takes its result.
    let explicit = args.dtype.as_deref().map(|d| DtypeInput::new(d, "--dtype"));
    // Decided quietly and logged once every check has passed, so bad input stays one line.
    let (state_dtype, dtype_source) =
        tracing::subscriber::with_default(tracing::subscriber::NoSubscriber::default(), || {
            state_pool::resolve_state_dtype_env(explicit, model.state_dtype_input())
        })?;
    let geometry = PoolGeometry::new(
        &model.shape,
        &PoolConfig {
            state_dtype,
            ..pool_config
        },
    )?;
    if let Some(budget) = budget {
        sizing::admit(&geometry, budget)?;
    }
    tracing::info!("SSM state dtype {state_dtype} (from {dtype_source})");
    let poison = args.inject_nan.map(|id| {
        let requests = simulate::workload::draw_requests(&workload_spec(&args));
        (id, requests[id].total_len() / 2)
    });
    let config = SimConfig {
        geometry: geometry.clone(),
        engine: EngineConfig {
            chunk: args.chunk,
            spec_tokens: args.spec_tokens,
            accept_rate: args.accept_rate,
            io_dtype,
            opts: layer_options(),
            seed: args.seed,
            pad_to: args.pad_to,
        },
        workload: workload_spec(&args),
        poison,
    };
    let (out_thr, state_thr) = checker::thresholds(state_dtype);
    let summary = Summary {
        backend: backend.name().into(),
        model: ModelSummary {
            name: model.shape.name.clone(),
            source: model.source.clone(),
            layers: geometry.layers,
            h: geometry.h,
            hv: geometry.hv,
            k: geometry.k,
            v: geometry.v,
            layout: geometry.layout.name(),
        },
        state_dtype,
        dtype_source: dtype_source.to_string(),
        io_dtype,
        spec_tokens: args.spec_tokens,
        ring_len,
        accept_rate: args.accept_rate,
        prefix_share: args.prefix_share,
        seed: args.seed,
        pad_to: args.pad_to,
        thresholds: [out_thr, state_thr],
        ..Summary::default()
    };
    let summary = simulate::run(backend, &config, summary).map_err(|e| match e {
        SimError::Engine(e) => CliError::Failed(format!("simulate: {e}")),
        SimError::Checker(e) => CliError::Failed(format!("simulate: {e}")),
    })?;
    if args.json {
        let text = serde_json::to_string_pretty(&summary)
            .map_err(|e| CliError::Failed(format!("cannot render the summary as JSON: {e}")))?;
        println!("{text}");
    } else {
        print!("{}", summary.render_text());
    }
    match summary.failure() {
        None => Ok(()),
        Some(why) => Err(CliError::Failed(why)),
    }
}

fn workload_spec(args: &Args) -> WorkloadSpec {
    WorkloadSpec {
        requests: args.requests,
        max_prompt: args.max_prompt,
        max_new: args.max_new,
        prefix_share: args.prefix_share,
        seed: args.seed,
    }
}
