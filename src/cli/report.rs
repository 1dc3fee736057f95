//! `kda-pool report`: pool sizing for a model, the chosen state dtype beside the fp32 baseline,
//! and with a cache budget the KV blocks the state dtype hands to the KV cache.

use std::path::PathBuf;

use serde::Serialize;
use state_pool::sizing::{self, format_gib, format_mb, KvGeometry, SizingReport};
use state_pool::{DtypeInput, DtypeSource, ModelConfig, PoolConfig, PoolGeometry};

use super::CliError;

/// The default model: Kimi-K3 at TP8.
const DEFAULT_MODEL: &str = include_str!("../../configs/kimi-k3-tp8.json");
/// How the embedded default is named in messages.
const DEFAULT_MODEL_SOURCE: &str = "configs/kimi-k3-tp8.json (embedded)";

/// Arguments of `kda-pool report`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model in the project's JSON schema (default: the embedded Kimi-K3 TP8 preset).
    #[arg(long, value_name = "FILE", conflicts_with = "hf_config")]
    pub model: Option<PathBuf>,
    /// A Hugging Face config.json with a `linear_attn_config` (Kimi-Linear style).
    #[arg(long, value_name = "FILE")]
    pub hf_config: Option<PathBuf>,
    /// Tensor-parallel ranks the heads are split over (default: the model file's).
    #[arg(long, value_name = "N")]
    pub tp: Option<usize>,
    /// Request slots (concurrent sequences).
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub slots: usize,
    /// Draft tokens per speculative step; sets the ring length to 2 x (N + 1).
    #[arg(long, value_name = "N")]
    pub spec_tokens: Option<usize>,
    /// Replay-ring length in tokens (overrides the one from --spec-tokens; default 0).
    #[arg(long, value_name = "N")]
    pub ring_len: Option<usize>,
    /// Give the pool a delta plane: f32 delta vectors of the ring entries (ring_len x HV x V x 4
    /// bytes more per slot and layer) that let the GPU's ring decode and spec_verify skip
    /// replaying the pending entries (`kda_ring_delta`).
    #[arg(long)]
    pub ring_deltas: bool,
    /// Checkpoint slots beside the request slots.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub checkpoint_slots: usize,
    /// SSM state dtype: fp32, fp16 or bf16 (default: KDA_SSM_DTYPE, ATOM_KDA_SSM_DTYPE, the
    /// model file's state_dtype, fp32).
    #[arg(long, value_name = "D")]
    pub dtype: Option<String>,
    /// Cache budget for KV and state together, e.g. 57.8GiB (SI or IEC suffix).
    #[arg(long, value_name = "BYTES")]
    pub budget: Option<String>,
    /// KV-cache bytes per token over all full-attention layers (default: from the HF config).
    #[arg(long, value_name = "N")]
    pub kv_bytes_per_token: Option<u64>,
    /// Tokens per KV block.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub block_size: u64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// The model part of the JSON report.
#[derive(Debug, Serialize)]
struct ModelSummary {
    name: String,
    source: String,
    tp: usize,
    kda_layers: usize,
    h: usize,
    hv: usize,
    k: usize,
    v: usize,
    conv_rows: usize,
    conv_channels: usize,
    conv_dtype: state_pool::Dtype,
    layout: &'static str,
}

/// The JSON report: the sizing report's fields plus the model and the dtype's source.
#[derive(Debug, Serialize)]
struct JsonReport<'a> {
    model: ModelSummary,
    dtype_source: &'a DtypeSource,
    #[serde(flatten)]
    sizing: &'a SizingReport,
}

/// Runs `kda-pool report`.
pub fn run(args: Args) -> Result<(), CliError> {
    let model = load_model(&args)?;
    let shape = match args.tp {
        Some(tp) => model.shape.with_tp(tp).map_err(usage)?,
        None => model.shape.clone(),
    };
    check_counts(&args)?;
    let budget = args
        .budget
        .as_deref()
        .map(|b| sizing::parse_bytes(b, "--budget"))
        .transpose()?;
    let kv = match budget {
        None => None,
        Some(bytes) => {
            let per_token = args.kv_bytes_per_token.or(model.kv_bytes_per_token).ok_or_else(|| {
                CliError::Usage(format!(
                    "--budget needs the KV bytes per token: pass --kv-bytes-per-token, or an --hf-config with full_attn_layers, kv_lora_rank and qk_rope_head_dim ({} has none)",
                    model.source
                ))
            })?;
            Some((
                bytes,
                KvGeometry {
                    bytes_per_token: per_token,
                    block_size: args.block_size,
                },
            ))
        }
    };
    let ring_len = args
        .ring_len
        .unwrap_or_else(|| sizing::default_ring_len(args.spec_tokens));

    // The one dtype decision; everything below takes its result.
    let explicit = args.dtype.as_deref().map(|d| DtypeInput::new(d, "--dtype"));
    let (dtype, source) = state_pool::resolve_state_dtype_env(explicit, model.state_dtype_input())?;

    let config = PoolConfig {
        state_dtype: dtype,
        ring_len,
        ring_deltas: args.ring_deltas,
        slots: args.slots,
        checkpoint_slots: args.checkpoint_slots,
        ..PoolConfig::default()
    };
    let geometry = PoolGeometry::new(&shape, &config)?;
    let report = SizingReport::new(&geometry, kv).map_err(usage)?;

    let summary = ModelSummary {
        name: shape.name.clone(),
        source: model.source.clone(),
        tp: shape.tp,
        kda_layers: geometry.layers,
        h: geometry.h,
        hv: geometry.hv,
        k: geometry.k,
        v: geometry.v,
        conv_rows: geometry.conv_rows,
        conv_channels: geometry.conv_channels,
        conv_dtype: geometry.conv_dtype,
        layout: geometry.layout.name(),
    };
    if args.json {
        let json = JsonReport {
            model: summary,
            dtype_source: &source,
            sizing: &report,
        };
        let text = serde_json::to_string_pretty(&json)
            .map_err(|e| CliError::Failed(format!("cannot render the report as JSON: {e}")))?;
        println!("{text}");
    } else {
        print!("{}", render_text(&summary, &source, &report));
    }
    Ok(())
}

fn load_model(args: &Args) -> Result<ModelConfig, CliError> {
    load_model_or_default(args.model.as_deref(), args.hf_config.as_deref())
}

/// The model of `--model FILE` (the project's schema) or else `--hf-config FILE`, or else the
/// embedded default (Kimi-K3 at TP8).
pub(super) fn load_model_or_default(
    model: Option<&std::path::Path>,
    hf_config: Option<&std::path::Path>,
) -> Result<ModelConfig, CliError> {
    let model = match (model, hf_config) {
        (Some(path), _) => ModelConfig::load(path)?,
        (None, Some(path)) => ModelConfig::load_hf(path)?,
        (None, None) => ModelConfig::from_json_str(DEFAULT_MODEL, DEFAULT_MODEL_SOURCE)?,
    };
    Ok(model)
}

/// Checks the counts before anything is decided, so bad input stops with one line.
fn check_counts(args: &Args) -> Result<(), CliError> {
    let positive = [
        ("--slots", Some(args.slots as u64)),
        ("--block-size", Some(args.block_size)),
        ("--kv-bytes-per-token", args.kv_bytes_per_token),
    ];
    for (flag, value) in positive {
        if value == Some(0) {
            return Err(CliError::Usage(format!(
                "invalid value 0 for {flag}: expected a positive integer"
            )));
        }
    }
    if args.kv_bytes_per_token.is_some() && args.budget.is_none() {
        return Err(CliError::Usage(
            "--kv-bytes-per-token needs --budget (the cache budget it is sized against)".into(),
        ));
    }
    Ok(())
}

/// A pool error, with an argument's name spelled as the CLI flag.
fn usage(e: state_pool::PoolError) -> CliError {
    match e {
        state_pool::PoolError::InvalidArgument { arg, msg } => CliError::Usage(format!(
            "invalid value for --{}: {msg}",
            arg.replace('_', "-")
        )),
        other => other.into(),
    }
}

fn render_text(m: &ModelSummary, source: &DtypeSource, r: &SizingReport) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let chosen = r.dtype.name();
    let base = &r.baseline;
    let _ = writeln!(
        out,
        "model        {} (TP {}): per rank {} KDA layers, H={} HV={} K={} V={}, conv {} x {} {}, {}",
        m.name, m.tp, m.kda_layers, m.h, m.hv, m.k, m.v, m.conv_rows, m.conv_channels, m.conv_dtype, m.layout
    );
    let _ = writeln!(out, "state dtype  {chosen} (from {source})");
    let _ = writeln!(out, "layout id    {}", r.layout_id);
    let _ = writeln!(
        out,
        "slots        {} request + {} checkpoint, ring {} tokens{}",
        r.slots,
        r.checkpoint_slots,
        r.ring_len,
        if r.ring_deltas {
            " (with a delta plane)"
        } else {
            ""
        }
    );
    let _ = writeln!(out);
    let _ = writeln!(out, "{:<22}{:>14}{:>14}", "", chosen, "fp32 (base)");
    let rows = [
        (
            "per slot  ssm",
            r.per_slot_bytes.ssm,
            base.per_slot_bytes.ssm,
        ),
        (
            "          conv",
            r.per_slot_bytes.conv,
            base.per_slot_bytes.conv,
        ),
        (
            "          ring",
            r.per_slot_bytes.ring,
            base.per_slot_bytes.ring,
        ),
        (
            "          total",
            r.per_slot_bytes.total,
            base.per_slot_bytes.total,
        ),
    ];
    for (label, a, b) in rows {
        let _ = writeln!(out, "{label:<22}{:>14}{:>14}", format_mb(a), format_mb(b));
    }
    let pool_label = format!("pool ({} slots)", r.slots + r.checkpoint_slots);
    let _ = writeln!(
        out,
        "{pool_label:<22}{:>14}{:>14}",
        format_gib(r.pool_bytes),
        format_gib(base.pool_bytes)
    );
    if let Some(kv) = &r.kv {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "KV cache     budget {} ({} B), {} B/token, {} tokens/block ({} B)",
            format_gib(kv.budget_bytes),
            kv.budget_bytes,
            kv.kv_bytes_per_token,
            kv.block_size,
            kv.block_bytes
        );
        let baseline_kv = if kv.baseline_fits {
            format_gib(kv.baseline_bytes)
        } else {
            "no fit".to_string()
        };
        let _ = writeln!(
            out,
            "{:<22}{:>14}{:>14}",
            "KV bytes",
            format_gib(kv.bytes),
            baseline_kv
        );
        let _ = writeln!(
            out,
            "{:<22}{:>14}{:>14}",
            "KV blocks", kv.blocks, kv.baseline_blocks
        );
        let _ = writeln!(
            out,
            "{:<22}{:>14}",
            format!("blocks handed by {chosen}"),
            format!("{:+}", kv.delta_blocks)
        );
    }
    out
}
