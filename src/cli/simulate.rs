//! `kda-pool simulate` (not implemented yet).

use super::CliError;

/// Arguments of `kda-pool simulate`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `kda-pool simulate`.
pub fn run(_args: Args) -> Result<(), CliError> {
    Err(CliError::Usage("simulate is not implemented yet".into()))
}
