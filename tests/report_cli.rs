//! `kda-pool report` driven through the built binary: the seed numbers, the JSON fields, the
//! dtype decision from flags and environment, and every bad-input path (exit code 2, one line
//! on stderr, no panic).

mod cli_kit;

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

use cli_kit::assert_usage_error;

const BIN: &str = env!("CARGO_BIN_EXE_kda-pool");

/// The binary with a clean environment for the dtype decision and logging.
fn kda_pool(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.arg("report")
        .args(args)
        .env_remove("KDA_SSM_DTYPE")
        .env_remove("ATOM_KDA_SSM_DTYPE")
        .env_remove("RUST_LOG")
        .env("RUST_BACKTRACE", "1")
        .env("NO_COLOR", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the kda-pool binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok_json(args: &[&str], env: &[(&str, &str)]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let o = kda_pool(&all, env);
    assert!(o.status.success(), "{args:?} failed: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).expect("--json prints one JSON object")
}

fn repo_file(rel: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(rel)
        .display()
        .to_string()
}

/// A file in the test's scratch directory.
fn scratch(name: &str, text: &str) -> String {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn default_report_is_k3_tp8_in_fp32() {
    let o = kda_pool(&[], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("kimi-k3-tp8"), "{text}");
    assert!(text.contains("state dtype  fp32 (from default)"), "{text}");
    assert!(text.contains("56.17 MB"), "{text}");
    assert!(text.contains("3.35 GiB"), "{text}");
    assert!(
        text.contains("54.26 MB") && text.contains("1.91 MB"),
        "{text}"
    );
    // The decision is logged at info level on stderr.
    assert!(stderr(&o).contains("SSM state dtype fp32 (from default)"));
}

#[test]
fn fp16_report_reproduces_the_seed_numbers() {
    let o = kda_pool(&["--dtype", "fp16"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    for needle in ["29.04 MB", "56.17 MB", "1.73 GiB", "3.35 GiB", "27.13 MB"] {
        assert!(text.contains(needle), "{needle} missing in\n{text}");
    }

    let j = ok_json(&["--dtype", "fp16"], &[]);
    assert_eq!(j["dtype"], "fp16");
    assert_eq!(j["dtype_source"], "--dtype");
    assert_eq!(j["slots"], 64);
    assert_eq!(j["checkpoint_slots"], 0);
    assert_eq!(j["ring_len"], 0);
    assert_eq!(j["per_slot_bytes"]["ssm"], 27_131_904);
    assert_eq!(j["per_slot_bytes"]["conv"], 1_907_712);
    assert_eq!(j["per_slot_bytes"]["ring"], 0);
    assert_eq!(j["per_slot_bytes"]["total"], 29_039_616);
    assert_eq!(j["pool_bytes"], 64 * 29_039_616u64);
    assert_eq!(j["baseline"]["dtype"], "fp32");
    assert_eq!(j["baseline"]["per_slot_bytes"]["ssm"], 54_263_808);
    assert_eq!(j["baseline"]["per_slot_bytes"]["total"], 56_171_520);
    assert_eq!(j["baseline"]["pool_bytes"], 64 * 56_171_520u64);
    assert_eq!(
        j["layout_id"],
        "kda-state-v1:layers=69:h=12:hv=12:k=128:v=128:ssm=fp16:conv=bf16:convw=3:convc=4608:ring=0:bf16:kfirst"
    );
    assert!(j["kv"].is_null());
    assert_eq!(j["model"]["tp"], 8);
    assert_eq!(j["model"]["conv_channels"], 4608);
}

#[test]
fn dtype_comes_from_the_environment_in_order() {
    let j = ok_json(&[], &[("KDA_SSM_DTYPE", "Float16")]);
    assert_eq!(
        (j["dtype"].as_str(), j["dtype_source"].as_str()),
        (Some("fp16"), Some("env KDA_SSM_DTYPE"))
    );
    assert_eq!(j["per_slot_bytes"]["total"], 29_039_616);

    let j = ok_json(&[], &[("ATOM_KDA_SSM_DTYPE", "bf16")]);
    assert_eq!(j["dtype"], "bf16");
    assert_eq!(j["dtype_source"], "env ATOM_KDA_SSM_DTYPE");

    let j = ok_json(
        &[],
        &[("KDA_SSM_DTYPE", "bf16"), ("ATOM_KDA_SSM_DTYPE", " BF16 ")],
    );
    assert_eq!(j["dtype"], "bf16");

    let j = ok_json(&["--dtype", "fp32"], &[("KDA_SSM_DTYPE", "fp16")]);
    assert_eq!(j["dtype"], "fp32");
    assert_eq!(j["dtype_source"], "--dtype");

    let model = scratch(
        "with-state-dtype.json",
        r#"{"kda_layers": 2, "num_heads": 4, "head_k_dim": 16, "head_v_dim": 16,
            "conv_kernel": 4, "state_dtype": "half"}"#,
    );
    let j = ok_json(&["--model", &model], &[]);
    assert_eq!(j["dtype"], "fp16");
    assert!(j["dtype_source"]
        .as_str()
        .unwrap()
        .contains("(state_dtype)"));
    let j = ok_json(&["--model", &model], &[("ATOM_KDA_SSM_DTYPE", "fp32")]);
    assert_eq!(j["dtype"], "fp32");
}

#[test]
fn hf_config_and_project_file_give_the_same_kimi_linear_report() {
    let hf = ok_json(
        &[
            "--hf-config",
            &repo_file("configs/hf/kimi-linear-48b-a3b-config.json"),
            "--dtype",
            "fp16",
        ],
        &[],
    );
    let own = ok_json(
        &[
            "--model",
            &repo_file("configs/kimi-linear-48b-a3b.json"),
            "--dtype",
            "fp16",
        ],
        &[],
    );
    for key in ["per_slot_bytes", "pool_bytes", "baseline", "layout_id"] {
        assert_eq!(hf[key], own[key], "{key}");
    }
    // 20 layers x 32 x 128 x 128 x 2 B, and 20 x 3 x 12288 x 2 B of conv.
    assert_eq!(hf["per_slot_bytes"]["ssm"], 20 * 32 * 128 * 128 * 2);
    assert_eq!(hf["per_slot_bytes"]["conv"], 20 * 3 * 12_288 * 2);
}

#[test]
fn budget_reports_the_kv_blocks_handed_over() {
    let j = ok_json(
        &[
            "--hf-config",
            &repo_file("configs/hf/kimi-linear-48b-a3b-config.json"),
            "--dtype",
            "fp16",
            "--budget",
            "57.8GiB",
            "--block-size",
            "64",
        ],
        &[],
    );
    let kv = &j["kv"];
    let budget = kv["budget_bytes"].as_u64().unwrap();
    assert_eq!(budget, 62_062_277_427);
    assert_eq!(kv["kv_bytes_per_token"], 8064, "7 MLA layers x 576 x 2 B");
    let block = 8064 * 64u64;
    let pool = j["pool_bytes"].as_u64().unwrap();
    let base_pool = j["baseline"]["pool_bytes"].as_u64().unwrap();
    assert_eq!(kv["bytes"].as_u64().unwrap(), budget - pool);
    assert_eq!(kv["blocks"].as_u64().unwrap(), (budget - pool) / block);
    assert_eq!(
        kv["baseline_blocks"].as_u64().unwrap(),
        (budget - base_pool) / block
    );
    let delta = kv["delta_blocks"].as_i64().unwrap();
    assert_eq!(
        delta,
        kv["blocks"].as_i64().unwrap() - kv["baseline_blocks"].as_i64().unwrap()
    );
    assert!(delta > 0);

    let o = kda_pool(
        &[
            "--dtype",
            "bf16",
            "--budget",
            "80 GB",
            "--kv-bytes-per-token",
            "1000",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("KV blocks"), "{}", stdout(&o));
}

#[test]
fn spec_tokens_size_a_ring() {
    let j = ok_json(
        &[
            "--spec-tokens",
            "3",
            "--dtype",
            "fp16",
            "--checkpoint-slots",
            "2",
        ],
        &[],
    );
    assert_eq!(j["ring_len"], 8);
    // Per layer: 8 entries of (3 x 12 x 128 + 12) bf16 elements, plus 16 B of meta.
    assert_eq!(
        j["per_slot_bytes"]["ring"],
        69 * (8 * (3 * 12 * 128 + 12) * 2 + 16)
    );
    let total = j["per_slot_bytes"]["total"].as_u64().unwrap();
    assert_eq!(j["pool_bytes"].as_u64().unwrap(), 66 * total);
    // with a delta plane, each entry's f32 delta vectors (12 x 128) too
    let d = ok_json(
        &["--spec-tokens", "3", "--dtype", "fp16", "--ring-deltas"],
        &[],
    );
    assert_eq!(
        (&j["ring_deltas"], &d["ring_deltas"]),
        (&false.into(), &true.into())
    );
    assert_eq!(
        d["per_slot_bytes"]["ring"],
        69 * (8 * (3 * 12 * 128 + 12) * 2 + 16 + 8 * 12 * 128 * 4)
    );
    let j = ok_json(&["--spec-tokens", "3", "--ring-len", "0"], &[]);
    assert_eq!(j["ring_len"], 0);
}

#[test]
fn admission_failure_says_how_many_slots_fit() {
    let o = kda_pool(&["--budget", "1GiB", "--kv-bytes-per-token", "8064"], &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    // 1 GiB / 56,171,520 B = 19.1 slots.
    let last = err.trim_end().lines().last().unwrap();
    assert!(
        last.starts_with("error") && last.contains("at most 19 request slots fit"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// Arguments, environment, and a word the error line must contain.
type BadCase<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);

#[test]
fn bad_inputs_exit_2_with_one_line() {
    let missing = repo_file("configs/does-not-exist.json");
    let malformed = scratch("malformed.json", "{\"kda_layers\": 69,");
    let bad_layout = scratch(
        "bad-layout.json",
        r#"{"kda_layers": 2, "num_heads": 4, "head_k_dim": 16, "head_v_dim": 16,
            "conv_kernel": 4, "state_layout": "diagonal"}"#,
    );
    let hf_missing = scratch(
        "hf-missing.json",
        r#"{"linear_attn_config": {"kda_layers": [1, 2], "head_dim": 128, "short_conv_kernel_size": 4}}"#,
    );
    let cases: Vec<BadCase> = vec![
        (vec!["--dtype", "fp8"], vec![], "fp8"),
        (vec![], vec![("KDA_SSM_DTYPE", "int4")], "KDA_SSM_DTYPE"),
        (
            vec![],
            vec![("ATOM_KDA_SSM_DTYPE", "double")],
            "ATOM_KDA_SSM_DTYPE",
        ),
        (
            vec![],
            vec![("KDA_SSM_DTYPE", "fp16"), ("ATOM_KDA_SSM_DTYPE", "bf16")],
            "ATOM_KDA_SSM_DTYPE is bf16",
        ),
        (vec!["--slots", "0"], vec![], "--slots"),
        (vec!["--slots", "many"], vec![], "--slots"),
        (vec!["--tp", "5"], vec![], "--tp"),
        (vec!["--tp", "0"], vec![], "--tp"),
        (vec!["--model", &missing], vec![], "does-not-exist.json"),
        (vec!["--model", &malformed], vec![], "malformed.json"),
        (vec!["--model", &bad_layout], vec![], "diagonal"),
        (
            vec!["--hf-config", &hf_missing],
            vec![],
            "linear_attn_config.num_heads",
        ),
        (vec!["--budget", "12 parsecs"], vec![], "--budget"),
        (vec!["--budget", "80GB"], vec![], "--kv-bytes-per-token"),
        (
            vec!["--budget", "80GB", "--kv-bytes-per-token", "0"],
            vec![],
            "--kv-bytes-per-token",
        ),
        (
            vec![
                "--budget",
                "80GB",
                "--kv-bytes-per-token",
                "9",
                "--block-size",
                "0",
            ],
            vec![],
            "--block-size",
        ),
        (vec!["--kv-bytes-per-token", "10"], vec![], "--budget"),
        (
            vec!["--model", &missing, "--hf-config", &missing],
            vec![],
            "--hf-config",
        ),
        (vec!["--colour"], vec![], "--colour"),
    ];
    for (args, env, needle) in cases {
        let o = kda_pool(&args, &env);
        eprintln!("{args:?} {env:?} -> {}", stderr(&o).trim_end());
        assert_usage_error(&o, needle);
    }
}
