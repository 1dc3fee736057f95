//! `kda-pool bench` (not implemented yet).

use super::CliError;

/// Arguments of `kda-pool bench`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `kda-pool bench`.
pub fn run(_args: Args) -> Result<(), CliError> {
    Err(CliError::Usage("bench is not implemented yet".into()))
}
