//! `kda-pool precompile`: compiles the CUDA kernel modules of a model's pools ahead of time
//! into a module cache directory (what `KDA_KERNEL_CACHE` names at run time), on a machine
//! with NVRTC and no GPU: a serving image built this way loads its kernels instead of
//! compiling them when a rank starts.

use std::path::PathBuf;

use kda_kernels::{BatchKind, GpuArch, KernelError};
use serde::Serialize;
use state_pool::{Dtype, PoolConfig, PoolGeometry, StateLayout};

use super::{list, CliError};

/// Arguments of `kda-pool precompile`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// GPU architecture to compile for: sm_XY (e.g. sm_90 for H100 and H200).
    #[arg(long, value_name = "sm_XY")]
    pub arch: String,
    /// Module cache directory (created if missing; default: KDA_KERNEL_CACHE).
    #[arg(long, value_name = "DIR", env = "KDA_KERNEL_CACHE")]
    pub cache: PathBuf,
    /// Model in the project's JSON schema (default: the embedded Kimi-K3 TP8 preset); its K,
    /// V and state layout pick the modules.
    #[arg(long, value_name = "FILE", conflicts_with = "hf_config")]
    pub model: Option<PathBuf>,
    /// A Hugging Face config.json with a `linear_attn_config` (Kimi-Linear style).
    #[arg(long, value_name = "FILE")]
    pub hf_config: Option<PathBuf>,
    /// State dtypes of the pools, comma-separated.
    #[arg(long, value_name = "LIST", default_value = "fp32,fp16,bf16")]
    pub states: String,
    /// Dtypes of the kernels' inputs (q, k, v, g, beta: the pools' ring dtype),
    /// comma-separated.
    #[arg(long, value_name = "LIST", default_value = "bf16")]
    pub inputs: String,
    /// State layouts, comma-separated (default: the model's).
    #[arg(long, value_name = "LIST")]
    pub layouts: Option<String>,
    /// Kinds of prepared batches the engine calls with, comma-separated: plain (`prepare`),
    /// padded (`prepare_padded`, as CUDA graphs replay them); each has its own modules.
    #[arg(long, value_name = "LIST", default_value = "plain,padded")]
    pub batches: String,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// The JSON output.
#[derive(Debug, Serialize)]
struct JsonOut<'a> {
    arch: String,
    cache: &'a std::path::Path,
    modules: &'a [kda_kernels::PrecompiledModule],
}

/// Runs `kda-pool precompile`.
pub fn run(args: Args) -> Result<(), CliError> {
    let arch: GpuArch = args.arch.parse().map_err(|e: KernelError| match e {
        KernelError::InvalidArgument { msg, .. } => CliError::Usage(format!("--arch: {msg}")),
        other => other.into(),
    })?;
    let states = list("states", &args.states, Dtype::parse, "fp32, fp16, bf16")?;
    let inputs = list("inputs", &args.inputs, Dtype::parse, "fp32, fp16, bf16")?;
    let kinds = list("batches", &args.batches, BatchKind::parse, "plain, padded")?;
    let model =
        super::report::load_model_or_default(args.model.as_deref(), args.hf_config.as_deref())?;
    let layouts = match &args.layouts {
        Some(l) => list("layouts", l, StateLayout::parse, "kfirst, vfirst")?,
        None => vec![model.shape.layout],
    };
    // one geometry per (state, input, layout); the modules depend on these and K, V only
    let mut geometries = Vec::new();
    for &layout in &layouts {
        let shape = state_pool::KdaShape {
            layout,
            ..model.shape.clone()
        };
        for &state_dtype in &states {
            for &ring_dtype in &inputs {
                let config = PoolConfig {
                    state_dtype,
                    ring_dtype,
                    ..PoolConfig::default()
                };
                geometries.push(PoolGeometry::new(&shape, &config)?);
            }
        }
    }
    let modules =
        kda_kernels::precompile(&args.cache, arch, &geometries, &kinds).map_err(|e| match e {
            KernelError::InvalidArgument { arg: "dir", msg } => {
                CliError::Usage(format!("--cache: {msg}"))
            }
            other => other.into(),
        })?;
    if args.json {
        let out = JsonOut {
            arch: arch.to_string(),
            cache: &args.cache,
            modules: &modules,
        };
        let text = serde_json::to_string_pretty(&out)
            .map_err(|e| CliError::Failed(format!("cannot render the result as JSON: {e}")))?;
        println!("{text}");
    } else {
        print!("{}", render_text(arch, &args.cache, &modules));
    }
    Ok(())
}

/// The table: a module a line, then the counts.
fn render_text(
    arch: GpuArch,
    cache: &std::path::Path,
    modules: &[kda_kernels::PrecompiledModule],
) -> String {
    let mut s = format!("kernel modules for {arch} in {}\n", cache.display());
    for m in modules {
        let what = if m.cached { "cached" } else { "compiled" };
        let file = m
            .path
            .file_name()
            .map(|f| f.to_string_lossy())
            .unwrap_or_default();
        s.push_str(&format!(
            "  {what:<9} {:<44} {:>9.2} MB  {file}\n",
            m.name,
            m.bytes as f64 / 1e6
        ));
    }
    let compiled = modules.iter().filter(|m| !m.cached).count();
    s.push_str(&format!(
        "{compiled} compiled, {} already there\n",
        modules.len() - compiled
    ));
    s
}
