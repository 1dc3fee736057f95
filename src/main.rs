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
            eprintln!("{}", one_line(&e.render().to_string()));
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

/// Clap's error as one line: its first line (the error itself) without the usage block, and
/// where that line ends in a colon (the missing arguments), the indented lines it introduces.
fn one_line(text: &str) -> String {
    let mut lines = text.lines();
    let first = lines
        .next()
        .unwrap_or("error: invalid arguments")
        .trim_end();
    if !first.ends_with(':') {
        return first.to_string();
    }
    let listed: Vec<&str> = lines
        .take_while(|l| l.starts_with(' '))
        .map(str::trim)
        .collect();
    format!("{first} {}", listed.join(", "))
}

#[cfg(test)]
mod tests {
    use super::one_line;

    #[test]
    fn clap_errors_become_one_line_that_names_the_missing_arguments() {
        let missing = "error: the following required arguments were not provided:\n  --op <OP>\n  --inputs <FILE>\n\nUsage: kda-pool run-op --op <OP>\n\nFor more information, try '--help'.\n";
        assert_eq!(
            one_line(missing),
            "error: the following required arguments were not provided: --op <OP>, --inputs <FILE>"
        );
        let bad = "error: invalid value 'x' for '--slots <N>': invalid digit\n\nFor more information, try '--help'.\n";
        assert_eq!(
            one_line(bad),
            "error: invalid value 'x' for '--slots <N>': invalid digit"
        );
        assert_eq!(one_line(""), "error: invalid arguments");
    }
}
