//! `kda-pool accuracy` (not implemented yet).

use super::CliError;

/// Arguments of `kda-pool accuracy`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `kda-pool accuracy`.
pub fn run(_args: Args) -> Result<(), CliError> {
    Err(CliError::Usage("accuracy is not implemented yet".into()))
}
