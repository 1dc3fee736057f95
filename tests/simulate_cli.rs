//! `kda-pool simulate` driven through the built binary: a few configurations (state dtypes,
//! decode and speculative verify, rings, shared prefixes) succeed with every request right
//! and no slot leaked; an injected NaN fails the run naming the request; bad input is exit
//! code 2 with one line on stderr.

mod cli_kit;

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_kda-pool");

/// A small, fast workload; each case adds its own flags.
const SMALL: &[&str] = &[
    "--requests",
    "16",
    "--max-running",
    "4",
    "--max-prompt",
    "48",
    "--max-new",
    "12",
];

fn kda_pool(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.arg("simulate")
        .args(args)
        .env_remove("KDA_SSM_DTYPE")
        .env_remove("ATOM_KDA_SSM_DTYPE")
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the kda-pool binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn simulate_json(args: &[&str], env: &[(&str, &str)]) -> (Output, Value) {
    let mut all = SMALL.to_vec();
    all.extend_from_slice(args);
    all.push("--json");
    let o = kda_pool(&all, env);
    let json = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{args:?}: --json prints one object ({e}): {}", stderr(&o)));
    (o, json)
}

fn num(v: &Value, path: &[&str]) -> f64 {
    let mut x = v;
    for p in path {
        x = &x[*p];
    }
    x.as_f64()
        .unwrap_or_else(|| panic!("{path:?} is not a number: {x}"))
}

/// A successful run: every request finished and right, nothing leaked, errors under the
/// thresholds, never more than 4 requests running.
fn assert_served(args: &[&str], env: &[(&str, &str)]) -> Value {
    let (o, j) = simulate_json(args, env);
    assert!(o.status.success(), "{args:?}: {}\n{j:#}", stderr(&o));
    assert_eq!(j["ok"], Value::Bool(true), "{args:?}: {j:#}");
    assert_eq!(num(&j, &["requests"]), 16.0);
    assert_eq!(num(&j, &["finished"]), 16.0);
    assert_eq!(j["wrong_requests"], serde_json::json!([]));
    assert_eq!(num(&j, &["slots", "leaked"]), 0.0);
    assert_eq!(num(&j, &["checkpoints", "leaked"]), 0.0);
    assert_eq!(num(&j, &["slots", "capacity"]), 4.0);
    assert_eq!(
        num(&j, &["slots", "high_water"]),
        4.0,
        "16 requests fill 4 slots"
    );
    assert_eq!(num(&j, &["violations"]), 0.0);
    let (out, state) = (
        num(&j, &["max_output_error"]),
        num(&j, &["max_state_error"]),
    );
    let thr = &j["thresholds"];
    assert!(
        out <= thr[0].as_f64().unwrap(),
        "{args:?}: {out} over {thr}"
    );
    assert!(
        state <= thr[1].as_f64().unwrap(),
        "{args:?}: {state} over {thr}"
    );
    assert!(num(&j, &["tokens", "computed"]) > 0.0);
    assert!(num(&j, &["tokens_per_second"]) > 0.0);
    j
}

#[test]
fn fp32_decode_with_shared_prefixes_restores_checkpoints() {
    // The pool (4 + 4 slots of 71,680 B at fp32) fits the budget.
    let j = assert_served(
        &[
            "--dtype",
            "fp32",
            "--prefix-share",
            "0.5",
            "--budget",
            "1MiB",
        ],
        &[],
    );
    assert_eq!(j["state_dtype"], "fp32");
    assert_eq!(num(&j, &["ring_len"]), 0.0);
    assert!(num(&j, &["checkpoints", "hits"]) > 0.0, "{j:#}");
    assert!(num(&j, &["tokens", "restored"]) > 0.0);
    assert!(num(&j, &["max_output_error"]) < 1e-5);
}

#[test]
fn fp16_speculative_verify_over_the_default_ring() {
    let j = assert_served(
        &[
            "--dtype",
            "fp16",
            "--spec-tokens",
            "3",
            "--accept-rate",
            "0.6",
            "--prefix-share",
            "0.3",
        ],
        &[],
    );
    assert_eq!(num(&j, &["ring_len"]), 8.0, "2 x (3 + 1)");
    assert_eq!(num(&j, &["tokens", "decode"]), 0.0);
    let (verify, accepted) = (
        num(&j, &["tokens", "verify"]),
        num(&j, &["tokens", "accepted"]),
    );
    assert!(accepted > 0.0 && verify > accepted, "{verify} {accepted}");
    assert!(num(&j, &["checkpoints", "hits"]) > 0.0, "{j:#}");
    assert!(num(&j, &["max_output_error"]) > 0.0, "an fp16 pool rounds");
}

#[test]
fn bf16_from_the_environment_with_a_decode_ring_and_no_prefixes() {
    let j = assert_served(
        &[
            "--ring-len",
            "5",
            "--prefix-share",
            "0",
            "--io-dtype",
            "bf16",
        ],
        &[("KDA_SSM_DTYPE", "bf16")],
    );
    assert_eq!(j["state_dtype"], "bf16");
    assert_eq!(j["io_dtype"], "bf16");
    assert!(
        j["dtype_source"]
            .as_str()
            .unwrap()
            .contains("KDA_SSM_DTYPE"),
        "{j:#}"
    );
    assert_eq!(num(&j, &["checkpoints", "hits"]), 0.0);
    assert_eq!(num(&j, &["checkpoints", "taken"]), 0.0);
}

#[test]
fn padded_steps_serve_every_request_right_and_are_counted() {
    let (o, j) = simulate_json(&["--spec-tokens", "2", "--pad-to", "4"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(j["ok"], true, "{j:#}");
    assert_eq!(j["pad_to"], 4);
    assert!(num(&j, &["padded_steps"]) > 0.0, "{j:#}");
    assert_eq!(num(&j, &["violations"]), 0.0, "{j:#}");
}

#[test]
fn text_summary_names_the_numbers() {
    let mut args = SMALL.to_vec();
    args.extend_from_slice(&["--spec-tokens", "2"]);
    let o = kda_pool(&args, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    for word in [
        "requests     16 finished of 16",
        "tokens/s",
        "high water 4 of 4, leaked 0",
        "hits",
        "max error",
        "result       ok",
    ] {
        assert!(text.contains(word), "{word:?} not in:\n{text}");
    }
}

#[test]
fn an_injected_nan_fails_the_run_naming_the_request() {
    let (o, j) = simulate_json(
        &[
            "--dtype",
            "fp16",
            "--inject-nan",
            "3",
            "--prefix-share",
            "0",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(j["ok"], Value::Bool(false));
    assert_eq!(j["poisoned_requests"], serde_json::json!([3]));
    assert_eq!(
        j["wrong_requests"],
        serde_json::json!([3]),
        "the other requests stay right"
    );
    assert_eq!(num(&j, &["slots", "leaked"]), 0.0);
    let err = stderr(&o);
    let last = err.trim_end().lines().last().unwrap_or("");
    assert!(
        last.starts_with("error: simulate failed") && last.contains("poisoned: 3"),
        "{err}"
    );
}

/// `simulate` with `args` and `env` is a usage error naming `needle` (`cli_kit`).
fn assert_usage_error(args: &[&str], env: &[(&str, &str)], needle: &str) {
    cli_kit::assert_usage_error(&kda_pool(args, env), needle);
}

#[test]
fn bad_input_is_one_line_and_exit_code_2() {
    assert_usage_error(&["--requests", "0"], &[], "--requests 0");
    assert_usage_error(&["--accept-rate", "1.5"], &[], "[0, 1]");
    assert_usage_error(&["--prefix-share=-0.1"], &[], "--prefix-share");
    assert_usage_error(
        &["--spec-tokens", "3", "--ring-len", "2"],
        &[],
        "at least 4",
    );
    assert_usage_error(&["--pad-to", "0"], &[], "--pad-to 0: expected 1..=12");
    assert_usage_error(
        &[
            "--pad-to",
            "7",
            "--max-running",
            "4",
            "--checkpoint-slots",
            "2",
        ],
        &[],
        "--pad-to 7: expected 1..=6",
    );
    assert_usage_error(&["--dtype", "fp8"], &[], "fp8");
    assert_usage_error(&[], &[("KDA_SSM_DTYPE", "fp12")], "KDA_SSM_DTYPE");
    assert_usage_error(&["--io-dtype", "int8"], &[], "--io-dtype");
    assert_usage_error(&["--inject-nan", "40", "--requests", "8"], &[], "0..8");
    assert_usage_error(
        &["--model", "/nonexistent/model.json"],
        &[],
        "/nonexistent/model.json",
    );
    assert_usage_error(&["--requests", "many"], &[], "many");
    assert_usage_error(&["--budget", "lots"], &[], "--budget");
    assert_usage_error(
        &["--budget", "1MB", "--dtype", "fp32", "--max-running", "16"],
        &[],
        "at most 9 request slots fit",
    );
    let bad = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bad-gva.json");
    std::fs::write(
        &bad,
        r#"{"kda_layers": 1, "num_heads": 3, "num_v_heads": 4, "head_k_dim": 8, "head_v_dim": 8, "conv_kernel": 4}"#,
    )
    .unwrap();
    assert_usage_error(&["--model", bad.to_str().unwrap()], &[], "num_v_heads");
}

#[test]
fn cuda_backend_simulates_on_cuda_or_is_refused_never_run_on_the_cpu() {
    let mut args = SMALL.to_vec();
    args.extend_from_slice(&["--spec-tokens", "2", "--backend", "cuda", "--json"]);
    let o = kda_pool(&args, &[]);
    if o.status.success() {
        let j: Value = serde_json::from_slice(&o.stdout).expect("--json prints one object");
        assert_eq!(j["backend"], "cuda", "{j:#}");
        assert_eq!(j["ok"], Value::Bool(true), "{j:#}");
        assert_eq!(num(&j, &["requests"]), 16.0);
    } else {
        // no GPU, driver or NVRTC here (or a build without `cuda`): a usage error, one line
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
        assert!(err.contains("--backend cuda"), "{err}");
    }
}

#[test]
fn a_prefill_kernel_on_the_cpu_backend_is_one_usage_line() {
    for kernel in ["chunked", "by-shape"] {
        let mut args = SMALL.to_vec();
        args.extend_from_slice(&["--prefill-kernel", kernel]);
        let o = kda_pool(&args, &[]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
        assert!(
            err.contains(&format!("--prefill-kernel {kernel}:")) && err.contains("--backend cuda"),
            "{err}"
        );
    }
}

#[test]
fn chunked_prefill_simulates_on_cuda_or_is_refused() {
    let mut args = SMALL.to_vec();
    args.extend_from_slice(&["--backend", "cuda", "--prefill-kernel", "chunked", "--json"]);
    let o = kda_pool(&args, &[]);
    if o.status.success() {
        let j: Value = serde_json::from_slice(&o.stdout).expect("--json prints one object");
        assert_eq!(j["backend"], "cuda", "{j:#}");
        assert_eq!(j["ok"], Value::Bool(true), "{j:#}");
    } else {
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
        assert!(err.contains("--backend cuda"), "{err}");
    }
}
