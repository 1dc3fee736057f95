//! `kda-pool accuracy`: the error of fp16 and bf16 state pools (nearest and stochastic
//! rounding, eager decode and replay rings) against an fp32 pool: the seed's table, then a
//! sweep of decode lengths.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use kda_kernels::Backend;
use state_pool::Dtype;

use super::CliError;
use crate::accuracy::plot::{self, PlotText};
use crate::accuracy::sweep::{self, SweepResult, SweepSpec};
use crate::accuracy::table::{self, Path, TableResult, TableSpec};
use crate::backends::{dispatch, BackendKind, BackendTask};
use crate::inputs::Dims;

/// What the seed measured (prefill, T = 2048 in two sequences, H = 12, K = V = 128): output
/// and final-state relative error of fp16 and bf16 pools against fp32.
pub const SEED_FP16: (f64, f64) = (1.27e-4, 2.08e-4);
/// See [`SEED_FP16`].
pub const SEED_BF16: (f64, f64) = (1.41e-4, 1.66e-3);

/// Arguments of `kda-pool accuracy`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Backend to run on (cuda needs a build with `--features cuda` and a GPU).
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    pub backend: BackendKind,
    /// Longest decode length of the sweep, in tokens; lengths double from 1024 up to it.
    #[arg(long, value_name = "N", default_value_t = 65536, value_parser = positive)]
    pub max_len: usize,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Draw the sweep (error against length, log-log) to this PNG file.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// Seed of the inputs and of stochastic rounding.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Heads of the table's run (H = HV).
    #[arg(long, value_name = "N", default_value_t = 12, value_parser = positive)]
    pub heads: usize,
    /// Tokens of each of the table's two sequences.
    #[arg(long, value_name = "N", default_value_t = 1024, value_parser = positive)]
    pub seq_len: usize,
    /// Heads of the sweep (H = HV; fewer than the table's to stay fast).
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = positive)]
    pub sweep_heads: usize,
    /// Replay ring measured in the sweep besides eager decode (0: eager only).
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub sweep_ring: usize,
    /// Skip the length sweep (the table only).
    #[arg(long, conflicts_with = "plot")]
    pub no_sweep: bool,
    /// Dtype of the input and output tensors. The values are bf16 either way; fp32 tensors
    /// keep the outputs unrounded, so the errors are the pool's alone.
    #[arg(long, value_name = "DTYPE", default_value = "fp32", value_parser = parse_dtype)]
    pub io_dtype: Dtype,
}

fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("expected a positive integer, got {s:?}")),
    }
}

fn parse_dtype(s: &str) -> Result<Dtype, String> {
    Dtype::parse(s).ok_or_else(|| {
        format!(
            "expected one of {}, got {s:?}",
            state_pool::dtype::ACCEPTED_DTYPES
        )
    })
}

/// Everything `kda-pool accuracy` measured (the `--json` object).
#[derive(Debug, serde::Serialize)]
pub struct Report {
    /// The backend that ran.
    pub backend: &'static str,
    /// The seed.
    pub seed: u64,
    /// The table.
    pub table: TableResult,
    /// The sweep (absent with `--no-sweep`).
    pub sweep: Option<SweepResult>,
    /// The seed's numbers, for comparison.
    pub seed_reference: serde_json::Value,
    /// The plot written, if any.
    pub plot: Option<String>,
    /// Whether the plot has its text (false where no font could be loaded).
    pub plot_text: Option<bool>,
    /// Wall time of the measurements in seconds.
    pub elapsed_s: f64,
}

struct Task<'a> {
    args: &'a Args,
}

impl BackendTask for Task<'_> {
    type Output = Report;

    fn run<B: Backend>(self, be: &B) -> Result<Report, CliError> {
        let a = self.args;
        let table_spec = TableSpec {
            dims: square_dims(a.heads),
            seqs: 2,
            seq_len: a.seq_len,
            rings: vec![4, 8, 16],
            io_dtype: a.io_dtype,
            seed: a.seed,
        };
        let sweep_spec = (!a.no_sweep).then(|| SweepSpec {
            dims: square_dims(a.sweep_heads),
            seqs: 1,
            lengths: sweep::lengths(a.max_len),
            rings: if a.sweep_ring > 0 {
                vec![0, a.sweep_ring]
            } else {
                vec![0]
            },
            io_dtype: a.io_dtype,
            seed: a.seed,
        });
        let sweep_steps = sweep_spec.as_ref().and_then(|s| s.lengths.last().copied());
        let steps = a.seq_len + sweep_steps.unwrap_or(0);
        let progress = progress_bar(steps as u64);
        let start = Instant::now();
        progress.set_message("table (decode)");
        let table = table::run(be, &table_spec, &progress).map_err(failed)?;
        let sweep = match &sweep_spec {
            Some(spec) => {
                progress.set_message("length sweep");
                Some(sweep::run(be, spec, &progress).map_err(failed)?)
            }
            None => None,
        };
        progress.finish_and_clear();
        let elapsed_s = start.elapsed().as_secs_f64();
        let mut plot_text = None;
        if let (Some(path), Some(sweep)) = (&a.plot, &sweep) {
            let title = format!(
                "KDA state pools vs fp32: decode error against length ({} backend, H = HV = {}, K = V = {}, seed {})",
                be.name(),
                sweep.spec.dims.hv,
                sweep.spec.dims.k,
                a.seed
            );
            let text = plot::draw(path, sweep, &title).map_err(CliError::Failed)?;
            plot_text = Some(text == PlotText::Drawn);
        }
        Ok(Report {
            backend: be.name(),
            seed: a.seed,
            table,
            sweep,
            seed_reference: serde_json::json!({
                "setting": "prefill, T = 2048 in two sequences of 1024, H = 12, K = V = 128",
                "fp16": {"output_rel_err": SEED_FP16.0, "state_rel_err": SEED_FP16.1},
                "bf16": {"output_rel_err": SEED_BF16.0, "state_rel_err": SEED_BF16.1},
            }),
            plot: a.plot.as_ref().map(|p| p.display().to_string()),
            plot_text,
            elapsed_s,
        })
    }
}

/// A backend failure in the middle of a measurement is a failure of the run (exit code 1),
/// except a backend that is not available (exit code 2: the user asked for it).
fn failed(e: kda_kernels::KernelError) -> CliError {
    match e {
        kda_kernels::KernelError::Unavailable { .. } => CliError::Usage(e.to_string()),
        other => CliError::Failed(other.to_string()),
    }
}

fn square_dims(heads: usize) -> Dims {
    Dims {
        h: heads,
        hv: heads,
        k: 128,
        v: 128,
    }
}

fn progress_bar(len: u64) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template(
        "{msg:>16} [{elapsed_precise}] {wide_bar} {pos}/{len} steps (eta {eta})",
    ) {
        bar.set_style(style);
    }
    bar
}

/// Runs `kda-pool accuracy`.
pub fn run(args: Args) -> Result<(), CliError> {
    if let Some(path) = &args.plot {
        check_plot_path(path)?;
    }
    let report = dispatch(args.backend, Task { args: &args })?;
    if args.json {
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| CliError::Failed(format!("cannot encode the report as JSON: {e}")))?;
        println!("{text}");
    } else {
        print!("{}", render_text(&report));
    }
    Ok(())
}

fn check_plot_path(path: &std::path::Path) -> Result<(), CliError> {
    let is_png = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    if !is_png {
        return Err(CliError::Usage(format!(
            "--plot {}: expected a file name ending in .png",
            path.display()
        )));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    if !dir.is_dir() {
        return Err(CliError::Usage(format!(
            "--plot {}: the directory {} does not exist",
            path.display(),
            dir.display()
        )));
    }
    Ok(())
}

fn err(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else {
        format!("{x:.2e}")
    }
}

fn short_len(l: usize) -> String {
    if l.is_multiple_of(1024) {
        format!("{}K", l / 1024)
    } else {
        l.to_string()
    }
}

/// The report as text tables.
pub fn render_text(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let t = &r.table;
    let d = t.spec.dims;
    let _ = writeln!(
        s,
        "kda-pool accuracy: 2-byte state pools against an fp32 pool (backend {}, seed {})\n",
        r.backend, r.seed
    );
    let _ = writeln!(
        s,
        "Table: {} sequences x {} tokens (one varlen prefill; {} decode steps), H = HV = {}, K = {}, V = {}",
        t.spec.seqs, t.spec.seq_len, t.spec.seq_len, d.hv, d.k, d.v
    );
    let _ = writeln!(
        s,
        "inputs: q, k, v, raw gate, raw beta N(0,1) as bf16 values in {} tensors; A_log = ln U(1,16); fla's dt_bias;\n\
         q/k l2norm, softplus gate and beta sigmoid in the kernel; initial state N(0,1) f32, rounded to nearest into each pool.\n\
         Errors: relative Frobenius norm against the fp32 pool on the same path (decode with a ring is flushed before the state is read).\n",
        t.spec.io_dtype
    );
    let _ = writeln!(
        s,
        "{:<6} {:<11} {:<8} {:>5} {:>12} {:>12}",
        "state", "rounding", "path", "ring", "output err", "state err"
    );
    for row in &t.rows {
        let (path, ring) = match row.path {
            Path::Prefill => ("prefill", "-".to_string()),
            Path::Decode => ("decode", row.ring_len.to_string()),
        };
        let _ = writeln!(
            s,
            "{:<6} {:<11} {:<8} {:>5} {:>12} {:>12}",
            row.state_dtype.name(),
            row.rounding.name(),
            path,
            ring,
            err(row.output_rel_err),
            err(row.state_rel_err)
        );
    }
    let c = &t.fp32_checks;
    let largest = t.spec.rings.iter().max().copied().unwrap_or(0);
    let _ = writeln!(
        s,
        "\nfp32 pools: decode ring {largest} vs eager decode: output {}, state {} (the ring is bit-exact for fp32: expected 0)",
        err(c.ring_vs_eager_output),
        err(c.ring_vs_eager_state)
    );
    if let (Some(o), Some(st)) = (c.decode_vs_prefill_output, c.decode_vs_prefill_state) {
        let _ = writeln!(
            s,
            "fp32 pools: eager decode vs chunked prefill: output {}, state {} (the f32 arithmetic floor{})",
            err(o),
            err(st),
            if t.spec.io_dtype == Dtype::Fp32 {
                ""
            } else {
                ", plus the rounding of the outputs to their dtype"
            }
        );
    }
    if let Some(why) = &t.prefill_skipped {
        let _ = writeln!(s, "prefill rows omitted: {why}");
    }
    let prefill_nearest = |dtype: Dtype| {
        t.rows.iter().find(|r| {
            r.state_dtype == dtype
                && r.path == Path::Prefill
                && r.rounding == crate::accuracy::RoundingKind::Nearest
        })
    };
    let _ = writeln!(
        s,
        "seed (prefill): fp16 {} / {}, bf16 {} / {} (output / state)",
        err(SEED_FP16.0),
        err(SEED_FP16.1),
        err(SEED_BF16.0),
        err(SEED_BF16.1)
    );
    if let (Some(f), Some(b)) = (prefill_nearest(Dtype::Fp16), prefill_nearest(Dtype::Bf16)) {
        let _ = writeln!(
            s,
            "here (prefill, nearest): fp16 {} / {}, bf16 {} / {}",
            err(f.output_rel_err),
            err(f.state_rel_err),
            err(b.output_rel_err),
            err(b.state_rel_err)
        );
    }
    if let Some(sw) = &r.sweep {
        let d = sw.spec.dims;
        let _ = writeln!(
            s,
            "\nLength sweep: {} sequence(s) of decode steps, H = HV = {} (fewer heads than the table, to stay fast), K = {}, V = {}",
            sw.spec.seqs, d.hv, d.k, d.v
        );
        let labels: Vec<String> = sw
            .series
            .iter()
            .map(|x| {
                format!(
                    "{} {} r{}",
                    x.variant.state_dtype.name(),
                    &x.variant.rounding.name()[..4],
                    x.variant.ring_len
                )
            })
            .collect();
        for (title, pick) in [
            (
                "output error (outputs of the steps since the previous length)",
                0usize,
            ),
            ("state error (after that many steps)", 1),
        ] {
            let _ = writeln!(s, "\n{title}");
            let _ = write!(s, "{:>7}", "length");
            for l in &labels {
                let _ = write!(s, " {l:>14}");
            }
            let _ = writeln!(s);
            for (i, &len) in sw.spec.lengths.iter().enumerate() {
                let _ = write!(s, "{:>7}", short_len(len));
                for x in &sw.series {
                    let v = if pick == 0 {
                        x.output_rel_err[i]
                    } else {
                        x.state_rel_err[i]
                    };
                    let _ = write!(s, " {:>14}", err(v));
                }
                let _ = writeln!(s);
            }
        }
    }
    if let Some(p) = &r.plot {
        let note = if r.plot_text == Some(false) {
            " (without text: no usable font)"
        } else {
            ""
        };
        let _ = writeln!(s, "\nplot: {p}{note}");
    }
    let _ = writeln!(s, "\nmeasured in {:.1} s", r.elapsed_s);
    s
}
