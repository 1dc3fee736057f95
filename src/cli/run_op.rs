//! `kda-pool run-op` (not implemented yet).

use super::CliError;

/// Arguments of `kda-pool run-op`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `kda-pool run-op`.
pub fn run(_args: Args) -> Result<(), CliError> {
    Err(CliError::Usage("run-op is not implemented yet".into()))
}
