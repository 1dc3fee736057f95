//! `kda-pool accuracy` end to end on the CPU backend, on a small setting (2 heads, short
//! sequences, a sweep to 2K): the JSON report's structure, the properties its numbers must
//! have (the fp32 ring is bit-exact with eager decode, bf16 errs more than fp16, a ring errs
//! less than eager decode), the plot, the text tables, and refused arguments.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn kda_pool() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kda-pool"));
    c.env_remove("RUST_LOG");
    c
}

fn tmp(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("accuracy_cli");
    std::fs::create_dir_all(&dir).expect("create the test directory");
    dir.join(name)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The small setting every test here uses (a few seconds on 2 cores).
const SMALL: &[&str] = &[
    "accuracy",
    "--heads",
    "2",
    "--seq-len",
    "96",
    "--sweep-heads",
    "1",
    "--max-len",
    "2048",
    "--seed",
    "7",
];

fn row<'a>(rows: &'a [Value], dtype: &str, rounding: &str, path: &str, ring: u64) -> &'a Value {
    rows.iter()
        .find(|r| {
            r["state_dtype"] == dtype
                && r["rounding"] == rounding
                && r["path"] == path
                && r["ring_len"] == ring
        })
        .unwrap_or_else(|| panic!("no row {dtype} {rounding} {path} ring {ring}"))
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn json_report_measures_every_pool_and_writes_the_plot() {
    let plot = tmp("sweep.png");
    let _ = std::fs::remove_file(&plot);
    let out = kda_pool()
        .args(SMALL)
        .arg("--json")
        .arg("--plot")
        .arg(&plot)
        .output()
        .expect("run kda-pool");
    assert!(out.status.success(), "{}", stderr(&out));
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    assert_eq!(report["backend"], "cpu");
    assert_eq!(report["seed"], 7);

    let table = &report["table"];
    assert_eq!(table["spec"]["seq_len"], 96);
    assert_eq!(table["spec"]["dims"]["hv"], 2);
    let rows = table["rows"].as_array().expect("rows");
    // fp16 and bf16 x nearest and stochastic x (prefill + decode with ring 0, 4, 8, 16).
    assert_eq!(rows.len(), 20);
    for r in rows {
        for key in ["output_rel_err", "state_rel_err"] {
            let e = num(&r[key]);
            assert!(e.is_finite() && e > 0.0 && e < 0.1, "{key} = {e} in {r}");
        }
    }
    for rounding in ["nearest", "stochastic"] {
        for (path, ring) in [("prefill", 0), ("decode", 0), ("decode", 8)] {
            let f = num(&row(rows, "fp16", rounding, path, ring)["state_rel_err"]);
            let b = num(&row(rows, "bf16", rounding, path, ring)["state_rel_err"]);
            assert!(
                b > 4.0 * f,
                "{rounding} {path} ring {ring}: bf16 {b} vs fp16 {f}"
            );
        }
        for dtype in ["fp16", "bf16"] {
            let eager = num(&row(rows, dtype, rounding, "decode", 0)["state_rel_err"]);
            let ring16 = num(&row(rows, dtype, rounding, "decode", 16)["state_rel_err"]);
            assert!(
                ring16 < eager,
                "{dtype} {rounding}: ring 16 {ring16} vs eager {eager}"
            );
        }
    }
    // One fp16 rounding of the final state: about 2e-4.
    let fp16_prefill = num(&row(rows, "fp16", "nearest", "prefill", 0)["state_rel_err"]);
    assert!((5e-5..1e-3).contains(&fp16_prefill), "{fp16_prefill}");

    let checks = &table["fp32_checks"];
    assert_eq!(
        num(&checks["ring_vs_eager_output"]),
        0.0,
        "fp32 ring must be bit-exact"
    );
    assert_eq!(
        num(&checks["ring_vs_eager_state"]),
        0.0,
        "fp32 ring must be bit-exact"
    );
    assert!(num(&checks["decode_vs_prefill_output"]) < 1e-5);
    assert!(num(&checks["decode_vs_prefill_state"]) < 1e-5);

    let sweep = &report["sweep"];
    assert_eq!(sweep["spec"]["lengths"], serde_json::json!([1024, 2048]));
    assert_eq!(sweep["spec"]["dims"]["hv"], 1);
    let series = sweep["series"].as_array().expect("series");
    assert_eq!(series.len(), 8, "fp16/bf16 x nearest/stochastic x ring 0/8");
    for s in series {
        for key in ["output_rel_err", "state_rel_err"] {
            let values = s[key].as_array().expect("values per length");
            assert_eq!(values.len(), 2);
            assert!(values.iter().all(|v| num(v) > 0.0 && num(v) < 0.1), "{s}");
        }
    }

    let png = std::fs::read(&plot).expect("the plot was written");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(
        png.len() > 10_000,
        "suspiciously small PNG ({} bytes)",
        png.len()
    );
    assert_eq!(report["plot"], plot.display().to_string());
}

#[test]
fn text_report_prints_the_table_and_the_seed_comparison() {
    let out = kda_pool()
        .args(SMALL)
        .args(["--no-sweep", "--io-dtype", "bf16"])
        .output()
        .expect("run kda-pool");
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("output err") && text.contains("state err"),
        "{text}"
    );
    assert!(text.contains("bf16 tensors"), "{text}");
    let decode_rows = text
        .lines()
        .filter(|l| l.starts_with("fp16") || l.starts_with("bf16"))
        .count();
    assert_eq!(decode_rows, 20, "{text}");
    assert!(text.contains("seed (prefill): fp16 1.27e-4"), "{text}");
    assert!(
        !text.contains("Length sweep"),
        "--no-sweep still swept: {text}"
    );
}

/// Exit code 2 and one line on stderr containing `needle`.
fn assert_refused(args: &[&str], needle: &str) {
    let out = kda_pool().args(args).output().expect("run kda-pool");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{args:?}: not one line: {err}"
    );
    assert!(
        err.contains(needle),
        "{args:?}: {needle:?} missing from {err}"
    );
}

#[test]
fn bad_arguments_are_refused_with_one_line() {
    assert_refused(&["accuracy", "--max-len", "0"], "--max-len");
    assert_refused(&["accuracy", "--heads", "x"], "--heads");
    assert_refused(&["accuracy", "--io-dtype", "fp8"], "fp8");
    let jpg = tmp("plot.jpg");
    assert_refused(
        &["accuracy", "--plot", jpg.to_str().unwrap()],
        "expected a file name ending in .png",
    );
    let nowhere = tmp("no/such/dir/plot.png");
    assert_refused(
        &["accuracy", "--plot", nowhere.to_str().unwrap()],
        "does not exist",
    );
    assert_refused(&["accuracy", "--no-sweep", "--plot", "x.png"], "--no-sweep");
}

#[test]
fn cuda_backend_runs_on_cuda_or_is_refused_never_run_on_the_cpu() {
    let out = kda_pool()
        .args([
            "accuracy",
            "--backend",
            "cuda",
            "--no-sweep",
            "--heads",
            "1",
        ])
        .args(["--seq-len", "16", "--json"])
        .output()
        .expect("run kda-pool");
    if out.status.success() {
        let report: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(report["backend"], "cuda");
    } else {
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
        assert!(err.contains("--backend cuda"), "{err}");
    }
}
