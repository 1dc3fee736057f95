//! `kda-pool run-op` end to end: captured calls written by `tests/scripts/make_run_op_case.py`
//! (with an independent float64 reference of the recurrence) replayed through the binary, and
//! bad input files refused with exit code 2 and one line naming the tensor.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use half::{bf16, f16};
use safetensors::{tensor::TensorView, Dtype, SafeTensors};

fn kda_pool() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kda-pool"));
    c.env_remove("KDA_SSM_DTYPE")
        .env_remove("ATOM_KDA_SSM_DTYPE")
        .env_remove("RUST_LOG");
    c
}

fn tmp(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("run_op_cli");
    std::fs::create_dir_all(&dir).expect("create the test directory");
    dir.join(name)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Whether python3 with numpy and safetensors is here; the reason when not.
fn python_ready() -> &'static Result<(), String> {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    READY.get_or_init(|| {
        match Command::new("python3")
            .args(["-c", "import numpy, safetensors"])
            .output()
        {
            Err(e) => Err(format!("python3 cannot be run ({e})")),
            Ok(o) if !o.status.success() => Err(format!(
                "python3 lacks numpy or safetensors: {}",
                stderr(&o).lines().last().unwrap_or("")
            )),
            Ok(_) => Ok(()),
        }
    })
}

/// Values of a float tensor (F64, F32, F16 or BF16) as f64.
fn values(t: &TensorView<'_>) -> Vec<f64> {
    let d = t.data();
    match t.dtype() {
        Dtype::F64 => d
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        Dtype::BF16 => d
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        other => panic!("unexpected dtype {other:?}"),
    }
}

fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let diff: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    (diff / norm).sqrt()
}

struct Case<'a> {
    name: &'a str,
    script: &'a [&'a str],
    state_dtype: &'a str,
    /// Dtype `o` must come back in (v's dtype).
    o_dtype: Dtype,
    tol_o: f64,
    tol_state: f64,
}

/// Writes the case with the script, replays it, and compares with the float64 reference.
fn check_case(case: &Case<'_>) {
    if let Err(reason) = python_ready() {
        eprintln!("skipping {}: {reason}", case.name);
        return;
    }
    let inputs = tmp(&format!("{}-in.safetensors", case.name));
    let reference = tmp(&format!("{}-ref.safetensors", case.name));
    let out = tmp(&format!("{}-out.safetensors", case.name));
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/scripts/make_run_op_case.py"
    );
    let made = Command::new("python3")
        .arg(script)
        .args(case.script)
        .arg("--inputs")
        .arg(&inputs)
        .arg("--reference")
        .arg(&reference)
        .output()
        .expect("run the case script");
    assert!(
        made.status.success(),
        "case script failed: {}",
        stderr(&made)
    );
    let op = case.script[1];
    let run = kda_pool()
        .args(["run-op", "--op", op, "--state-dtype", case.state_dtype])
        .arg("--inputs")
        .arg(&inputs)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run kda-pool");
    assert!(run.status.success(), "run-op failed: {}", stderr(&run));

    let got_bytes = std::fs::read(&out).expect("read the output");
    let want_bytes = std::fs::read(&reference).expect("read the reference");
    let got = SafeTensors::deserialize(&got_bytes).expect("output is safetensors");
    let want = SafeTensors::deserialize(&want_bytes).expect("reference is safetensors");
    for (name, tol) in [("o", case.tol_o), ("final_state", case.tol_state)] {
        let g = got.tensor(name).expect("output tensor present");
        let w = want.tensor(name).expect("reference tensor present");
        assert_eq!(g.shape(), w.shape(), "{}: shape of {name}", case.name);
        let expected_dtype = if name == "o" {
            case.o_dtype
        } else {
            Dtype::F32
        };
        assert_eq!(g.dtype(), expected_dtype, "{}: dtype of {name}", case.name);
        let (gv, wv) = (values(&g), values(&w));
        assert!(
            wv.iter().any(|&x| x != 0.0),
            "{}: reference {name} is all zero",
            case.name
        );
        let e = rel_err(&gv, &wv);
        assert!(
            e <= tol,
            "{}: {name} relative error {e:.3e} above {tol:.1e}",
            case.name
        );
    }
}

#[test]
fn prefill_matches_float64_reference_with_gva_k_ne_v_and_in_kernel_activations() {
    check_case(&Case {
        name: "prefill-inkernel",
        script: &[
            "--op",
            "prefill",
            "--seqlens",
            "5,70,0,129,1",
            "--h",
            "2",
            "--hv",
            "4",
            "--k",
            "16",
            "--v",
            "24",
            "--in-kernel",
            "--dtype",
            "f32",
            "--index-dtype",
            "i32",
            "--seed",
            "11",
        ],
        state_dtype: "fp32",
        o_dtype: Dtype::F32,
        tol_o: 2e-5,
        tol_state: 2e-5,
    });
}

#[test]
fn prefill_matches_reference_with_activated_inputs_bf16_vfirst_int64_and_scale() {
    check_case(&Case {
        name: "prefill-activated-vfirst",
        script: &[
            "--op",
            "prefill",
            "--seqlens",
            "33,64,7",
            "--h",
            "1",
            "--hv",
            "3",
            "--k",
            "24",
            "--v",
            "8",
            "--dtype",
            "bf16",
            "--index-dtype",
            "i64",
            "--layout",
            "vfirst",
            "--scale",
            "0.3",
            "--seed",
            "12",
        ],
        state_dtype: "fp32",
        o_dtype: Dtype::BF16,
        // o is rounded to bf16 (2^-9 relative per element).
        tol_o: 5e-3,
        tol_state: 2e-5,
    });
}

#[test]
fn prefill_into_an_fp16_pool_stays_within_fp16_rounding() {
    check_case(&Case {
        name: "prefill-fp16-pool",
        script: &[
            "--op",
            "prefill",
            "--seqlens",
            "40,90",
            "--h",
            "2",
            "--hv",
            "2",
            "--k",
            "32",
            "--v",
            "16",
            "--in-kernel",
            "--dtype",
            "f16",
            "--seed",
            "13",
        ],
        state_dtype: "fp16",
        o_dtype: Dtype::F16,
        // The initial and the final state are each rounded once to fp16 (~2e-4 relative).
        tol_o: 1e-3,
        tol_state: 1e-3,
    });
}

#[test]
fn decode_matches_float64_reference_for_several_sequences() {
    check_case(&Case {
        name: "decode-inkernel",
        script: &[
            "--op",
            "decode",
            "--seqs",
            "5",
            "--h",
            "2",
            "--hv",
            "6",
            "--k",
            "32",
            "--v",
            "16",
            "--in-kernel",
            "--dtype",
            "f32",
            "--seed",
            "14",
        ],
        state_dtype: "fp32",
        o_dtype: Dtype::F32,
        tol_o: 2e-5,
        tol_state: 2e-5,
    });
}

#[test]
fn decode_with_activated_inputs_matches_reference() {
    check_case(&Case {
        name: "decode-activated",
        script: &[
            "--op",
            "decode",
            "--seqs",
            "3",
            "--h",
            "3",
            "--hv",
            "3",
            "--k",
            "8",
            "--v",
            "20",
            "--dtype",
            "f32",
            "--index-dtype",
            "i64",
            "--seed",
            "15",
        ],
        state_dtype: "fp32",
        o_dtype: Dtype::F32,
        tol_o: 2e-5,
        tol_state: 2e-5,
    });
}

#[test]
fn decode_into_a_bf16_pool_stays_within_bf16_rounding() {
    check_case(&Case {
        name: "decode-bf16-pool",
        script: &[
            "--op",
            "decode",
            "--seqs",
            "4",
            "--h",
            "1",
            "--hv",
            "2",
            "--k",
            "16",
            "--v",
            "32",
            "--in-kernel",
            "--dtype",
            "bf16",
            "--seed",
            "16",
        ],
        state_dtype: "bf16",
        o_dtype: Dtype::BF16,
        // Two bf16 roundings of the state (initial and final, ~1.5e-3 each) and a bf16 output.
        tol_o: 8e-3,
        tol_state: 8e-3,
    });
}

#[test]
fn decode_from_fresh_slots_with_bounded_gate_and_negative_eigenvalues() {
    check_case(&Case {
        name: "decode-lower-bound",
        script: &[
            "--op",
            "decode",
            "--seqs",
            "2",
            "--h",
            "2",
            "--hv",
            "4",
            "--k",
            "16",
            "--v",
            "8",
            "--in-kernel",
            "--lower-bound",
            "-5.0",
            "--allow-neg-eigval",
            "--no-initial-state",
            "--dtype",
            "f32",
            "--seed",
            "17",
        ],
        state_dtype: "fp32",
        o_dtype: Dtype::F32,
        tol_o: 2e-5,
        tol_state: 2e-5,
    });
}

// ---- Files built here (no Python needed): the shapes of the output, and bad input. ----

const T: usize = 3;
const H: usize = 1;
const HV: usize = 2;
const K: usize = 4;
const V: usize = 5;

/// A tensor to write: dtype, shape, bytes.
type Spec = (Dtype, Vec<usize>, Vec<u8>);

fn f32_tensor(shape: &[usize], f: impl Fn(usize) -> f32) -> Spec {
    let n: usize = shape.iter().product();
    let bytes = (0..n).flat_map(|i| f(i).to_le_bytes()).collect();
    (Dtype::F32, shape.to_vec(), bytes)
}

/// A valid decode/prefill call: 2 sequences (1 and 2 tokens), activated gate and beta.
fn valid_call() -> (HashMap<String, Spec>, HashMap<String, String>) {
    let wave = |s: f32| move |i: usize| ((i as f32 + 1.0) * s).sin() * 0.4;
    let tensors = HashMap::from([
        ("q".to_string(), f32_tensor(&[T, H, K], wave(0.7))),
        ("k".to_string(), f32_tensor(&[T, H, K], wave(1.3))),
        ("v".to_string(), f32_tensor(&[T, HV, V], wave(0.9))),
        (
            "g".to_string(),
            f32_tensor(&[T, HV, K], |i| -0.05 - 0.01 * (i % 7) as f32),
        ),
        (
            "beta".to_string(),
            f32_tensor(&[T, HV], |i| 0.2 + 0.1 * i as f32),
        ),
        (
            "cu_seqlens".to_string(),
            (
                Dtype::I32,
                vec![3],
                [0i32, 1, 3].iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
        ),
        (
            "initial_state".to_string(),
            f32_tensor(&[2, HV, K, V], wave(0.31)),
        ),
    ]);
    (tensors, HashMap::new())
}

fn to_bf16(t: &Spec) -> Spec {
    let (_, shape, bytes) = t;
    let converted = bytes
        .chunks_exact(4)
        .flat_map(|c| bf16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes())
        .collect();
    (Dtype::BF16, shape.clone(), converted)
}

fn write(name: &str, tensors: &HashMap<String, Spec>, meta: &HashMap<String, String>) -> PathBuf {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let bytes = safetensors::serialize(views, Some(meta.clone())).unwrap();
    let path = tmp(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn run_op(op: &str, inputs: &Path, extra: &[&str]) -> Output {
    kda_pool()
        .args(["run-op", "--op", op, "--inputs"])
        .arg(inputs)
        .arg("--out")
        .arg(tmp("unused-out.safetensors"))
        .args(extra)
        .output()
        .expect("run kda-pool")
}

/// Exit code 2 and one line on stderr that contains every one of `needles`.
fn assert_usage_error(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
    for n in needles {
        assert!(err.contains(n), "{n:?} missing from: {err}");
    }
}

#[test]
fn run_op_writes_outputs_of_the_documented_shapes_and_dtypes() {
    let (mut tensors, meta) = valid_call();
    // bf16 token inputs: `o` comes back in bf16.
    for name in ["q", "k", "v", "g", "beta"] {
        tensors.insert(name.into(), to_bf16(&tensors[name]));
    }
    let inputs = write("shapes-in.safetensors", &tensors, &meta);
    let out = tmp("shapes-out.safetensors");
    let run = kda_pool()
        .args([
            "run-op",
            "--op",
            "prefill",
            "--state-dtype",
            "bf16",
            "--inputs",
        ])
        .arg(&inputs)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", stderr(&run));
    let bytes = std::fs::read(&out).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let o = file.tensor("o").unwrap();
    assert_eq!(o.shape(), [T, HV, V]);
    assert_eq!(o.dtype(), Dtype::BF16);
    let s = file.tensor("final_state").unwrap();
    assert_eq!(s.shape(), [2, HV, K, V]);
    assert_eq!(s.dtype(), Dtype::F32);
    let ov = values(&o);
    assert!(ov.iter().all(|x| x.is_finite()) && ov.iter().any(|&x| x != 0.0));
    // Read back from a bf16 pool: every state value is a bf16 value.
    assert!(values(&s).iter().all(|&x| bf16::from_f64(x).to_f64() == x));
}

#[test]
fn missing_tensor_is_refused_naming_it_and_its_shape() {
    let (mut tensors, meta) = valid_call();
    tensors.remove("v");
    let path = write("missing-v.safetensors", &tensors, &meta);
    assert_usage_error(
        &run_op("prefill", &path, &[]),
        &["missing tensor v", "[T, HV, V]"],
    );
}

#[test]
fn ill_shaped_beta_is_refused_with_the_expected_shape() {
    let (mut tensors, meta) = valid_call();
    tensors.insert("beta".into(), f32_tensor(&[T, HV + 1], |_| 0.5));
    let path = write("bad-beta.safetensors", &tensors, &meta);
    assert_usage_error(
        &run_op("prefill", &path, &[]),
        &["beta", "[3, 3]", "[T, HV] = [3, 2]"],
    );
}

#[test]
fn ill_shaped_initial_state_is_refused_with_the_layout_it_expects() {
    let (mut tensors, mut meta) = valid_call();
    meta.insert("state_layout".into(), "vfirst".into());
    tensors.insert(
        "initial_state".into(),
        f32_tensor(&[2, HV, K, V], |i| i as f32),
    );
    let path = write("bad-state.safetensors", &tensors, &meta);
    assert_usage_error(
        &run_op("prefill", &path, &[]),
        &["initial_state", "[N, HV, V, K]", "[2, 2, 5, 4]"],
    );
}

#[test]
fn gate_in_kernel_without_a_log_is_refused() {
    let (tensors, mut meta) = valid_call();
    meta.insert("use_gate_in_kernel".into(), "true".into());
    let path = write("no-alog.safetensors", &tensors, &meta);
    assert_usage_error(&run_op("prefill", &path, &[]), &["A_log", "[HV]"]);
}

#[test]
fn bad_metadata_flag_is_refused_naming_the_key() {
    let (tensors, mut meta) = valid_call();
    meta.insert("use_beta_sigmoid".into(), "yes".into());
    let path = write("bad-flag.safetensors", &tensors, &meta);
    assert_usage_error(
        &run_op("prefill", &path, &[]),
        &["use_beta_sigmoid", "\"yes\"", "\"true\" or \"false\""],
    );
}

#[test]
fn float64_q_is_refused_naming_the_accepted_dtypes() {
    let (mut tensors, meta) = valid_call();
    let bytes: Vec<u8> = (0..T * H * K)
        .flat_map(|i| (i as f64).to_le_bytes())
        .collect();
    tensors.insert("q".into(), (Dtype::F64, vec![T, H, K], bytes));
    let path = write("f64-q.safetensors", &tensors, &meta);
    assert_usage_error(
        &run_op("prefill", &path, &[]),
        &["q", "F64", "F32, F16 or BF16"],
    );
}

#[test]
fn token_inputs_of_mixed_dtypes_are_refused() {
    let (mut tensors, meta) = valid_call();
    tensors.insert("v".into(), to_bf16(&tensors["v"]));
    let path = write("mixed-dtypes.safetensors", &tensors, &meta);
    assert_usage_error(
        &run_op("prefill", &path, &[]),
        &["tensor v has dtype bf16", "expected q's dtype fp32"],
    );
}

#[test]
fn cu_seqlens_not_ending_at_the_token_count_is_refused() {
    let (mut tensors, meta) = valid_call();
    let bytes = [0i64, 1, 2].iter().flat_map(|x| x.to_le_bytes()).collect();
    tensors.insert("cu_seqlens".into(), (Dtype::I64, vec![3], bytes));
    let path = write("short-cu.safetensors", &tensors, &meta);
    assert_usage_error(
        &run_op("prefill", &path, &[]),
        &["cu_seqlens", "ends at 2", "3"],
    );
}

#[test]
fn decode_of_a_sequence_longer_than_one_token_is_refused() {
    let (tensors, meta) = valid_call();
    let path = write("decode-len2.safetensors", &tensors, &meta);
    assert_usage_error(
        &run_op("decode", &path, &[]),
        &["cu_seqlens", "length 1", "sequence 1 has 2 tokens"],
    );
}

#[test]
fn unknown_state_dtype_is_refused_naming_the_flag() {
    let (tensors, meta) = valid_call();
    let path = write("dtype-flag.safetensors", &tensors, &meta);
    assert_usage_error(
        &run_op("prefill", &path, &["--state-dtype", "fp8"]),
        &["--state-dtype", "fp8"],
    );
}

#[test]
fn unreadable_input_file_is_refused_naming_the_path() {
    let missing = tmp("does-not-exist.safetensors");
    assert_usage_error(
        &run_op("prefill", &missing, &[]),
        &["--inputs", "does-not-exist"],
    );
    let garbage = tmp("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file").unwrap();
    assert_usage_error(
        &run_op("prefill", &garbage, &[]),
        &["--inputs", "safetensors"],
    );
}

#[test]
fn cuda_backend_runs_on_cuda_or_is_refused_never_run_on_the_cpu() {
    let (tensors, meta) = valid_call();
    let path = write("cuda.safetensors", &tensors, &meta);
    let out_path = tmp("cuda-out.safetensors");
    let out = kda_pool()
        .args(["run-op", "--op", "prefill", "--backend", "cuda", "--inputs"])
        .arg(&path)
        .arg("--out")
        .arg(&out_path)
        .output()
        .expect("run kda-pool");
    if out.status.success() {
        let bytes = std::fs::read(&out_path).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let meta = header.metadata().clone().unwrap_or_default();
        assert_eq!(meta.get("backend").map(String::as_str), Some("cuda"));
    } else {
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        let last = err.trim_end().lines().last().unwrap_or("");
        assert!(last.contains("--backend cuda"), "{err}");
    }
}
