//! `kda-pool`: the KDA state pool's command-line tool. It only parses and renders; the work is
//! in the `state_pool` and `kda-kernels` crates.

mod accuracy;
mod backends;
mod captured;
mod cli;
mod harness;
mod host_tensor;
mod inputs;
mod simulate;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let parsed = match cli::Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = e.print();
                return std::process::ExitCode::SUCCESS;
            }
            // One line: clap's first line (the error itself), no usage block.
            let text = e.render().to_string();
            eprintln!(
                "{}",
                text.lines().next().unwrap_or("error: invalid arguments")
            );
            return std::process::ExitCode::from(2);
        }
    };
    cli::init_tracing(parsed.verbose);
    match cli::run(parsed) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(e.exit_code())
        }
    }
}
