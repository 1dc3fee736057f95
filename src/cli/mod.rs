//! Command-line parsing and dispatch. Each subcommand lives in its own module with an `Args`
//! struct and a `run` function.

pub mod accuracy;
pub mod bench;
pub mod precompile;
pub mod report;
pub mod run_op;
pub mod simulate;

use clap::{Parser, Subcommand};

/// The KDA state pool: sizing report, accuracy, benchmarks, captured-call replay, serving
/// simulation.
#[derive(Debug, Parser)]
#[command(name = "kda-pool", version, about)]
pub struct Cli {
    /// Log at debug level (info by default; `RUST_LOG` overrides).
    #[arg(long, short, global = true)]
    pub verbose: bool,
    /// The subcommand.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Pool sizing: bytes per slot by plane, pool total and KV blocks against the fp32 baseline.
    Report(report::Args),
    /// Accuracy of 2-byte state pools against an fp32 pool.
    Accuracy(accuracy::Args),
    /// Benchmark decode, spec-verify and replay on a GPU.
    Bench(bench::Args),
    /// Replay a captured call from a safetensors file.
    RunOp(run_op::Args),
    /// Drive the pool and kernels as a serving engine does, and check every request.
    Simulate(simulate::Args),
    /// Compile the CUDA kernel modules ahead of time into a module cache (no GPU needed).
    Precompile(precompile::Args),
}

/// A CLI failure: bad input (exit code 2) or a failure while running (exit code 1).
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The user's input is wrong: the message names the argument, the value and what is
    /// accepted.
    #[error("{0}")]
    Usage(String),
    /// Something failed while running.
    #[error("{0}")]
    Failed(String),
}

impl CliError {
    /// The process exit code.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Usage(_) => 2,
            Self::Failed(_) => 1,
        }
    }
}

impl From<state_pool::PoolError> for CliError {
    fn from(e: state_pool::PoolError) -> Self {
        use state_pool::PoolError as P;
        match e {
            P::Memory(_) => Self::Failed(e.to_string()),
            other => Self::Usage(other.to_string()),
        }
    }
}

impl From<kda_kernels::KernelError> for CliError {
    fn from(e: kda_kernels::KernelError) -> Self {
        use kda_kernels::KernelError as K;
        match e {
            K::InvalidArgument { .. } | K::Unsupported { .. } | K::Unavailable { .. } => {
                Self::Usage(e.to_string())
            }
            K::Pool(p) => p.into(),
            K::Device { .. } => Self::Failed(e.to_string()),
        }
    }
}

/// The items of `--arg`'s comma-separated value `s`, each parsed by `parse`; an item it
/// refuses is a usage error naming the argument, the item and what is `accepted`.
pub(crate) fn list<T>(
    arg: &str,
    s: &str,
    parse: impl Fn(&str) -> Option<T>,
    accepted: &str,
) -> Result<Vec<T>, CliError> {
    s.split(',')
        .map(|x| {
            parse(x.trim()).ok_or_else(|| {
                CliError::Usage(format!(
                    "--{arg}: '{x}' is not accepted; expected {accepted}"
                ))
            })
        })
        .collect()
}

/// Installs the tracing subscriber (stderr, `RUST_LOG` or info/debug).
pub fn init_tracing(verbose: bool) {
    let default = if verbose { "debug" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .try_init();
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Report(a) => report::run(a),
        Command::Accuracy(a) => accuracy::run(a),
        Command::Bench(a) => bench::run(a),
        Command::RunOp(a) => run_op::run(a),
        Command::Simulate(a) => simulate::run(a),
        Command::Precompile(a) => precompile::run(a),
    }
}
