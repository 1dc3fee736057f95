//! `kda-pool bench` driven through the built binary: bad arguments are exit code 2 with one
//! line on stderr that names the argument, before any device is opened (so this runs without a
//! GPU).

mod cli_kit;

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_kda-pool");

fn kda_pool_bench(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("bench")
        .args(args)
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1")
        .output()
        .expect("the kda-pool binary runs")
}

/// `bench` with `args` is a usage error naming `needle` (`cli_kit`).
fn assert_usage_error(args: &[&str], needle: &str) {
    cli_kit::assert_usage_error(&kda_pool_bench(args), needle);
}

#[test]
fn bad_arguments_are_one_line_and_exit_code_2_before_the_device_is_opened() {
    assert_usage_error(&["--backend", "cpu"], "--backend: 'cpu'");
    assert_usage_error(&["--op", "chunk"], "--op: 'chunk'");
    assert_usage_error(
        &["--op", "chunk"],
        "expected decode, spec, replay, all or prefill",
    );
    assert_usage_error(
        &["--dependent-launch", "some"],
        "--dependent-launch: 'some'",
    );
    assert_usage_error(
        &["--dependent-launch", "decode"],
        "expected default, all or none",
    );
    assert_usage_error(&["--replays", "0"], "--replays");
    assert_usage_error(&["--ring", "0"], "--ring");
    assert_usage_error(&["--drafts", "2,0"], "--drafts: '0'");
    assert_usage_error(&["--spec-seqs", "x"], "--spec-seqs: 'x'");
    assert_usage_error(&["--prefill-lens", "8x0"], "--prefill-lens: '8x0'");
    assert_usage_error(&["--prefill-lens", "2048"], "e.g. 8x4096");
    assert_usage_error(&["--warps", "9"], "1..=8");
    assert_usage_error(&["--stages", "4"], "2 or 3");
    assert_usage_error(&["--chunk-columns", "16,24"], "--chunk-columns: '24'");
    assert_usage_error(&["--chunk-columns", "8"], "16 or 32");
    assert_usage_error(&["--forced", "bulk,fast"], "--forced: 'fast'");
    assert_usage_error(
        &["--forced", "some"],
        "expected all, none or a list of piped, tile, staged, bulk, bulkin, stream, regs, pipe, blocked, mma, delta, delta-staged, step",
    );
}

/// A `KDA_CUDA_CODE` the CUDA backend does not know is refused when the backend is created, with
/// or without a GPU (it is checked before the driver is).
#[cfg(feature = "cuda")]
#[test]
fn an_unknown_kda_cuda_code_is_one_line_and_exit_code_2() {
    let o = Command::new(BIN)
        .args(["bench", "--op", "decode", "--heads", "12", "--seqs", "1"])
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1")
        .env("KDA_CUDA_CODE", "sass")
        .output()
        .expect("the kda-pool binary runs");
    cli_kit::assert_usage_error(&o, "KDA_CUDA_CODE=\"sass\" is not accepted");
    cli_kit::assert_usage_error(&o, "\"cubin\" (the default) or \"ptx\"");
}
