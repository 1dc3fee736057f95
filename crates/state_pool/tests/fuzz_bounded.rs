//! A bounded, proptest-driven run of the fuzz targets (`fuzz/`), part of the normal
//! `cargo test`: arbitrary bytes, JSON-like text, valid inputs with random byte mutations and
//! valid JSON objects with one field replaced by an arbitrary value, fed to the own-schema
//! config loader, the Hugging Face `config.json` loader, the layout-id parser and the
//! checkpoint-image parser and import. Each either parses (and what it accepts is usable
//! downstream) or returns an error; nothing panics. The target bodies are the same code the
//! cargo-fuzz targets run (`fuzz/src/lib.rs`, included below).
//!
//! The tests at the end reproduce the bugs this found in `state_pool` (fixed in 97a48fa).

#[allow(dead_code)]
#[path = "../../../fuzz/src/lib.rs"]
mod fuzz_checks;

use fuzz_checks::{hf_config, image, layout_id, own_config, valid_image};
use proptest::prelude::*;
use serde_json::{json, Value};

const K3: &str = include_str!("../../../configs/kimi-k3-tp8.json");
const LINEAR: &str = include_str!("../../../configs/kimi-linear-48b-a3b.json");
const LINEAR_HF: &str = include_str!("../../../configs/hf/kimi-linear-48b-a3b-config.json");

fn valid_configs() -> Vec<String> {
    let minimal_own = json!({"kda_layers": 2, "num_heads": 4, "num_v_heads": 8,
        "head_k_dim": 16, "head_v_dim": 8, "conv_kernel": 4, "tp": 2, "state_dtype": "fp16",
        "state_layout": "vfirst", "kv_bytes_per_token": 100});
    let minimal_hf = json!({"num_hidden_layers": 4, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
        "text_config": null, "linear_attn_config": {"kda_layers": [1, 2, 4],
        "full_attn_layers": [3], "num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 3}});
    vec![
        K3.to_string(),
        LINEAR.to_string(),
        LINEAR_HF.to_string(),
        minimal_own.to_string(),
        minimal_hf.to_string(),
    ]
}

/// One edit of a byte string; positions are taken modulo the length.
#[derive(Debug, Clone)]
enum Mutation {
    Xor(usize, u8),
    Insert(usize, u8),
    Delete(usize),
    Truncate(usize),
    Duplicate(usize, usize),
    /// Overwrite with the bytes of a "nasty" token (a number at a limit, a quote, a bracket).
    Splice(usize, &'static str),
}

const NASTY: &[&str] = &[
    "0",
    "-1",
    "1.5",
    "1e400",
    "18446744073709551615",
    "18446744073709551616",
    "4294967296",
    "9007199254740993",
    "\"",
    "{",
    "}",
    "[",
    "]",
    "null",
    "\"fp8\"",
    "\\u0000",
    ",",
    ":",
];

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1..=255u8).prop_map(|(i, x)| Mutation::Xor(i, x)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Delete),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), 1..64usize).prop_map(|(i, n)| Mutation::Duplicate(i, n)),
        (any::<usize>(), prop::sample::select(NASTY)).prop_map(|(i, s)| Mutation::Splice(i, s)),
    ]
}

fn apply(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        let n = bytes.len().max(1);
        match *m {
            Mutation::Xor(i, x) if !bytes.is_empty() => bytes[i % n] ^= x,
            Mutation::Insert(i, b) => bytes.insert(i % (bytes.len() + 1), b),
            Mutation::Delete(i) if !bytes.is_empty() => {
                bytes.remove(i % n);
            }
            Mutation::Truncate(i) => bytes.truncate(i % (bytes.len() + 1)),
            Mutation::Duplicate(i, len) if !bytes.is_empty() => {
                let start = i % n;
                let end = (start + len).min(bytes.len());
                let span = bytes[start..end].to_vec();
                bytes.splice(start..start, span);
            }
            Mutation::Splice(i, s) => {
                let at = i % (bytes.len() + 1);
                let end = (at + s.len()).min(bytes.len());
                bytes.splice(at..end, s.bytes());
            }
            _ => {}
        }
    }
    bytes
}

/// An arbitrary JSON value, shallow.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<u64>().prop_map(|n| json!(n)),
        (0u64..300).prop_map(|n| json!(n)),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|x| json!(x)),
        prop::sample::select(vec![
            "fp16", "bf16", "fp32", "half", "fp8", "kfirst", "vfirst", ""
        ])
        .prop_map(|s| json!(s)),
        "\\PC{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(2, 16, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

const OWN_FIELDS: &[&str] = &[
    "name",
    "description",
    "kda_layers",
    "num_heads",
    "num_v_heads",
    "head_k_dim",
    "head_v_dim",
    "conv_kernel",
    "conv_dtype",
    "state_layout",
    "tp",
    "state_dtype",
    "kv_bytes_per_token",
    "unknown_field",
];
const HF_TOP_FIELDS: &[&str] = &[
    "num_hidden_layers",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "text_config",
    "linear_attn_config",
];
const HF_LINEAR_FIELDS: &[&str] = &[
    "kda_layers",
    "full_attn_layers",
    "num_heads",
    "head_dim",
    "short_conv_kernel_size",
    "kda_layer_index_base",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..512)) {
        own_config(&data);
        hf_config(&data);
        image(&data);
    }

    #[test]
    fn json_like_text_never_panics(text in "[{}\\[\\]\":,0-9a-z_. -]{0,160}") {
        own_config(text.as_bytes());
        hf_config(text.as_bytes());
        layout_id(&text);
    }

    #[test]
    fn mutated_valid_configs_parse_or_fail_cleanly(
        which in 0usize..5,
        mutations in prop::collection::vec(mutation(), 1..6),
    ) {
        let data = apply(valid_configs()[which].clone().into_bytes(), &mutations);
        own_config(&data);
        hf_config(&data);
    }

    #[test]
    fn valid_configs_with_one_field_replaced_parse_or_fail_cleanly(
        field in 0usize..64,
        value in json_value(),
        nested in any::<bool>(),
    ) {
        let own = OWN_FIELDS[field % OWN_FIELDS.len()];
        for base in [K3, LINEAR] {
            let mut v: Value = serde_json::from_str(base).unwrap();
            v[own] = value.clone();
            own_config(v.to_string().as_bytes());
        }
        let mut hf: Value = serde_json::from_str(LINEAR_HF).unwrap();
        if nested {
            hf["linear_attn_config"][HF_LINEAR_FIELDS[field % HF_LINEAR_FIELDS.len()]] = value;
        } else {
            hf[HF_TOP_FIELDS[field % HF_TOP_FIELDS.len()]] = value;
        }
        hf_config(hf.to_string().as_bytes());
    }

    #[test]
    fn mutated_images_are_refused_or_imported_whole(
        seed in any::<u64>(),
        mutations in prop::collection::vec(mutation(), 0..4),
    ) {
        let data = apply(valid_image(seed), &mutations);
        image(&data);
    }

    #[test]
    fn mutated_layout_ids_parse_or_fail_cleanly(
        mutations in prop::collection::vec(mutation(), 0..4),
    ) {
        let id = fuzz_checks::image_pool().layout_id();
        let data = apply(id.into_bytes(), &mutations);
        layout_id(&String::from_utf8_lossy(&data));
    }
}

#[test]
fn valid_inputs_are_accepted_by_their_parsers() {
    use state_pool::checkpoint::parse_image;
    use state_pool::ModelConfig;
    for text in [K3, LINEAR] {
        ModelConfig::from_json_str(text, "x.json").unwrap();
    }
    ModelConfig::from_hf_str(LINEAR_HF, "x.json").unwrap();
    let img = valid_image(3);
    parse_image(&img).unwrap();
    fuzz_checks::image_pool()
        .import_slot(1, &img, state_pool::ImportMode::Exact)
        .unwrap();
}

// Regression tests of the bugs the fuzzing found in `state_pool`.

#[test]
fn huge_head_count_with_a_non_dividing_tp_fails_fast() {
    let text = r#"{"kda_layers": 2, "num_heads": 3000000001, "head_k_dim": 16,
        "head_v_dim": 8, "conv_kernel": 4, "tp": 2}"#;
    let start = std::time::Instant::now();
    assert!(state_pool::ModelConfig::from_json_str(text, "m.json").is_err());
    assert!(start.elapsed() < std::time::Duration::from_secs(1));
}

#[test]
fn huge_kv_lora_rank_is_an_error_not_a_panic() {
    let text = r#"{"kv_lora_rank": 18446744073709551615, "qk_rope_head_dim": 8,
        "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 4,
        "head_dim": 16, "short_conv_kernel_size": 4}}"#;
    let _ = state_pool::ModelConfig::from_hf_str(text, "c.json");
}

#[test]
fn huge_head_dims_are_an_error_not_a_panic() {
    let text = r#"{"kda_layers": 2, "num_heads": 4294967296, "head_k_dim": 4294967296,
        "head_v_dim": 8, "conv_kernel": 4}"#;
    let m = state_pool::ModelConfig::from_json_str(text, "m.json").unwrap();
    let _ = state_pool::PoolGeometry::new(&m.shape, &state_pool::PoolConfig::default());
}

#[test]
fn hf_layer_index_base_zero_is_accepted() {
    let text = r#"{"linear_attn_config": {"kda_layer_index_base": 0, "kda_layers": [0, 1],
        "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4}}"#;
    let m = state_pool::ModelConfig::from_hf_str(text, "c.json").unwrap();
    assert_eq!(m.shape.kda_layers, 2);
}
