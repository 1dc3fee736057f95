//! The serving simulation behind `kda-pool simulate`: a workload of requests ([`workload`])
//! driven through a state pool and a KDA backend as a serving engine does ([`engine`]), then
//! every finished request checked against an independent recomputation ([`checker`]), and a
//! summary ([`summary`]).

pub mod checker;
pub mod engine;
pub mod summary;
pub mod workload;

#[cfg(test)]
mod tests;

use std::io::IsTerminal;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use kda_kernels::{Backend, KdaOptions};
use state_pool::{sizing, PoolGeometry};

use checker::Checker;
use engine::{Engine, EngineConfig};
use summary::{RunOutcome, Summary};
use workload::{draw_requests, InputSource, WorkloadSpec};

/// Everything a simulation needs besides the backend.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The pool: dims, state dtype, ring, request slots (the most requests running at once)
    /// and checkpoint slots.
    pub geometry: PoolGeometry,
    /// The engine's settings.
    pub engine: EngineConfig,
    /// The workload.
    pub workload: WorkloadSpec,
    /// Fault injection: a request whose inputs carry a NaN at a position.
    pub poison: Option<(usize, usize)>,
}

/// The options of every layer: q/k l2norm, gate and beta activated in the kernel (the
/// serving configuration of Kimi's KDA layers).
pub fn layer_options() -> KdaOptions {
    KdaOptions {
        scale: None,
        l2norm_qk: true,
        gate: kda_kernels::GateMode::Softplus,
        beta: kda_kernels::BetaMode::Sigmoid,
        allow_neg_eigval: false,
    }
}

/// A simulation that could not run to its end (a kernel or pool failure).
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The serving loop failed.
    #[error(transparent)]
    Engine(#[from] engine::EngineError),
    /// The recomputation failed.
    #[error("{0}")]
    Checker(String),
}

/// Runs the workload on `backend`, checks every request and returns the summary with the
/// counts, errors and verdict filled in. `summary` carries the descriptive fields (model,
/// dtypes, settings); a progress bar shows on stderr when it is a terminal.
pub fn run<B: Backend>(
    backend: &B,
    config: &SimConfig,
    mut summary: Summary,
) -> Result<Summary, SimError>
where
    B::Memory: Clone,
{
    let g = &config.geometry;
    let dims = crate::inputs::Dims {
        h: g.h,
        hv: g.hv,
        k: g.k,
        v: g.v,
    };
    let inputs = InputSource {
        dims,
        seed: config.workload.seed,
        poison: config.poison,
    };
    let requests = draw_requests(&config.workload);
    summary.pool_bytes = sizing::pool_bytes(g);
    summary.requests = requests.len();

    let bar = if std::io::stderr().is_terminal() {
        ProgressBar::new(requests.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    if let Ok(style) =
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} requests ({elapsed})")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message("serving");

    let start = Instant::now();
    let mut engine = Engine::new(backend, g.clone(), config.engine.clone(), inputs, &requests)?;
    while !engine.done() {
        engine.step()?;
        bar.set_position(engine.finished() as u64);
    }
    let seconds = start.elapsed().as_secs_f64();
    let (records, stats, slots, checkpoints) = engine.finish();

    bar.set_message("checking");
    let checker = Checker {
        geometry: g.clone(),
        opts: config.engine.opts,
        inputs,
        io_dtype: config.engine.io_dtype,
    };
    let verdicts = checker.check_all(&records).map_err(SimError::Checker)?;
    bar.finish_and_clear();

    summary::fill(
        &mut summary,
        &RunOutcome {
            stats: &stats,
            slots,
            checkpoints,
            verdicts: &verdicts,
            seconds,
        },
    );
    Ok(summary)
}
