//! `kda-pool precompile` driven through the built binary: bad input (exit code 2, one line
//! naming the argument, nothing written), and where the binary has the `cuda` feature and
//! NVRTC is on the loader's path (CI fetches it) the modules compiled into the cache once and
//! found there by a second run.

mod cli_kit;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use cli_kit::assert_usage_error;

const BIN: &str = env!("CARGO_BIN_EXE_kda-pool");

fn kda_pool(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("precompile")
        .args(args)
        .env_remove("KDA_KERNEL_CACHE")
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1")
        .output()
        .expect("the kda-pool binary runs")
}

/// A fresh path in the test's scratch directory (nothing there yet).
fn fresh(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("precompile-{name}"));
    let _ = std::fs::remove_dir_all(&p);
    let _ = std::fs::remove_file(&p);
    p
}

fn repo_file(rel: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(rel)
        .display()
        .to_string()
}

#[test]
fn bad_arguments_are_one_line_usage_errors_and_write_nothing() {
    let dir = fresh("bad");
    let d = dir.to_str().unwrap();
    let missing = repo_file("configs/no-such-model.json");
    for (args, needle) in [
        (vec!["--arch", "90", "--cache", d], "--arch: '90'"),
        (vec!["--arch", "sm_9a", "--cache", d], "sm_90"),
        (vec!["--arch", "sm_90"], "--cache"),
        (vec!["--cache", d], "--arch"),
        (
            vec!["--arch", "sm_90", "--cache", d, "--states", "fp16,fp64"],
            "--states: 'fp64'",
        ),
        (
            vec!["--arch", "sm_90", "--cache", d, "--inputs", "int8"],
            "--inputs: 'int8'",
        ),
        (
            vec!["--arch", "sm_90", "--cache", d, "--layouts", "rows"],
            "--layouts: 'rows'",
        ),
        (
            vec!["--arch", "sm_90", "--cache", d, "--batches", "plain,graph"],
            "--batches: 'graph'",
        ),
        (
            vec!["--arch", "sm_90", "--cache", d, "--model", &missing],
            "no-such-model.json",
        ),
    ] {
        assert_usage_error(&kda_pool(&args), needle);
    }
    assert!(!dir.exists(), "a refused call wrote {}", dir.display());
}

/// The run's JSON, or `None` (printed as skipped) where this binary cannot compile kernels.
fn precompile_json(dir: &Path) -> Option<Value> {
    let model = repo_file("configs/sim-small.json");
    let o = kda_pool(&[
        "--arch",
        "sm_90",
        "--cache",
        dir.to_str().unwrap(),
        "--model",
        &model,
        "--states",
        "fp16",
        "--json",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    if err.contains("cuda backend unavailable") {
        eprintln!("skipped: {}", err.trim());
        return None;
    }
    assert!(o.status.success(), "{err}");
    Some(serde_json::from_slice(&o.stdout).expect("--json prints one JSON object"))
}

#[test]
fn modules_compile_once_into_the_cache_and_a_second_run_finds_them() {
    let dir = fresh("cache");
    let Some(first) = precompile_json(&dir) else {
        return;
    };
    assert_eq!(first["arch"], "sm_90");
    let modules = first["modules"].as_array().expect("modules");
    let names: Vec<&str> = modules
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    // sim-small: K = V = 32, K-first; bf16 inputs, plain and padded batches by default
    assert_eq!(
        names,
        [
            "kda_decode_fp16_bf16_kfirst_k32_v32.cu",
            "kda_decode_fp16_bf16_kfirst_k32_v32_padded.cu",
            "kda_fill.cu"
        ]
    );
    for m in modules {
        assert_eq!(m["cached"], false, "{m}");
        let path = PathBuf::from(m["path"].as_str().unwrap());
        assert_eq!(path.parent(), Some(dir.as_path()), "{m}");
        let bytes = std::fs::read(&path).expect("the module's file");
        assert!(bytes.starts_with(b"\x7fELF"), "{m}: not a CUBIN");
        assert_eq!(m["bytes"].as_u64(), Some(bytes.len() as u64), "{m}");
    }
    let second = precompile_json(&dir).expect("compiled once, so it runs again");
    for (a, b) in modules.iter().zip(second["modules"].as_array().unwrap()) {
        assert_eq!(b["cached"], true, "{b}");
        assert_eq!((&a["name"], &a["path"]), (&b["name"], &b["path"]));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
