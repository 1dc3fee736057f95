//! `kda-pool report` (not implemented yet).

use super::CliError;

/// Arguments of `kda-pool report`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `kda-pool report`.
pub fn run(_args: Args) -> Result<(), CliError> {
    Err(CliError::Usage("report is not implemented yet".into()))
}
