//! The bodies of the fuzz targets: feed bytes to an entry point of `state_pool` and check
//! that it either parses or returns an error, never panics or hangs, and that what it
//! accepts is usable downstream the way the CLI uses it.
//!
//! The cargo-fuzz targets in `fuzz_targets/` call these functions; the bounded proptest run
//! in `crates/state_pool/tests/fuzz_bounded.rs` includes this file (`#[path]`) and calls the
//! same functions, so `cargo test` exercises exactly what the fuzzer does.

use state_pool::checkpoint::{parse_image, LayoutId};
use state_pool::sizing::{self, KvGeometry};
use state_pool::{
    resolve_state_dtype, Dtype, HostMemory, ImportMode, ModelConfig, Plane, PoolConfig, PoolError,
    PoolGeometry, SizingReport, StateLayout, StatePool,
};

/// The file name the loaders see; every loader error must name it.
pub const SOURCE: &str = "fuzz-input.json";

/// The own-schema loader ([`ModelConfig::from_json_str`]) on arbitrary bytes.
pub fn own_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match ModelConfig::from_json_str(text, SOURCE) {
        Ok(m) => use_config(&m),
        Err(e) => check_loader_error(&e),
    }
}

/// The Hugging Face `config.json` loader ([`ModelConfig::from_hf_str`]) on arbitrary bytes.
pub fn hf_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match ModelConfig::from_hf_str(text, SOURCE) {
        Ok(m) => use_config(&m),
        Err(e) => check_loader_error(&e),
    }
}

/// A loader's error is a [`PoolError::Config`] naming the file and saying something.
fn check_loader_error(e: &PoolError) {
    let text = e.to_string();
    assert!(
        matches!(e, PoolError::Config { .. })
            && text.contains(SOURCE)
            && text.len() > SOURCE.len() + 4,
        "a loader error must be a config error naming the file: {e:?}"
    );
}

/// Uses an accepted configuration the way `kda-pool report` does: the state dtype decision,
/// the geometry of a pool and its sizing report.
fn use_config(m: &ModelConfig) {
    let s = &m.shape;
    s.validate()
        .expect("the loader returned a shape that does not validate");
    let (h, hv) = s
        .heads_per_rank()
        .expect("validated shapes have per-rank heads");
    assert!(h > 0 && hv > 0 && hv % h == 0, "{s:?}");
    if let Some(input) = m.state_dtype_input() {
        // The loader checked the field parses.
        resolve_state_dtype(None, |_| None, Some(input)).expect("a checked state_dtype");
    }
    for (state_dtype, ring_len) in [(Dtype::Fp32, 0), (Dtype::Fp16, 8), (Dtype::Bf16, 1 << 40)] {
        let config = PoolConfig {
            state_dtype,
            ring_len,
            slots: 64,
            checkpoint_slots: 2,
            ..PoolConfig::default()
        };
        let Ok(g) = PoolGeometry::new(s, &config) else {
            continue;
        };
        let per_slot = sizing::slot_bytes(&g);
        assert_eq!(per_slot.total, per_slot.ssm + per_slot.conv + per_slot.ring);
        let kv = m.kv_bytes_per_token.map(|b| KvGeometry {
            bytes_per_token: b,
            block_size: 16,
        });
        let budget = kv.map(|kv| (sizing::pool_bytes(&g).saturating_mul(2), kv));
        let _ = SizingReport::new(&g, budget);
        assert_eq!(LayoutId::parse(&g.layout_id()).ok(), Some(LayoutId::of(&g)));
    }
}

/// The pool an image is imported into: small, fp16, with a ring (images carry none).
pub fn image_pool() -> StatePool<HostMemory> {
    let g = PoolGeometry {
        layers: 2,
        h: 1,
        hv: 2,
        k: 4,
        v: 4,
        conv_rows: 2,
        conv_channels: 3,
        conv_dtype: Dtype::Bf16,
        state_dtype: Dtype::Fp16,
        layout: StateLayout::KFirst,
        ring_len: 2,
        ring_dtype: Dtype::Bf16,
        ring_deltas: false,
        slots: 2,
        checkpoint_slots: 0,
        rounding: Default::default(),
    };
    StatePool::new(HostMemory, g).expect("a valid geometry")
}

/// A valid image of [`image_pool`]'s layout, with `seed`-dependent contents.
pub fn valid_image(seed: u64) -> Vec<u8> {
    let mut pool = image_pool();
    let g = pool.geometry().clone();
    let mut x = seed | 1;
    for layer in 0..g.layers {
        for plane in [Plane::Conv, Plane::Ssm] {
            let bytes: Vec<u8> = (0..plane.slot_bytes(&g))
                .map(|_| {
                    // xorshift64: deterministic filler bytes.
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x >> 32) as u8
                })
                .collect();
            pool.write_slot_plane(layer, plane, 0, &bytes)
                .expect("slot 0 exists");
        }
    }
    pool.export_slot(0).expect("a fresh slot is flushed")
}

fn snapshot(pool: &StatePool<HostMemory>) -> Vec<u8> {
    let g = pool.geometry();
    let mut all = Vec::new();
    for layer in 0..g.layers {
        for plane in Plane::ALL {
            for slot in 0..g.total_slots() {
                all.extend(pool.read_slot_plane(layer, plane, slot).expect("in range"));
            }
        }
    }
    all
}

/// The checkpoint-image parser ([`parse_image`]) and import on arbitrary bytes: a parsed
/// header agrees with the bytes that follow it; an import either succeeds or changes nothing;
/// an exact import re-exports to the same bytes.
pub fn image(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        layout_id(text);
    }
    if let Ok((header, payload)) = parse_image(data) {
        assert_eq!(
            header.conv_bytes.checked_add(header.ssm_bytes),
            Some(payload.len() as u64),
            "a parsed header announces the bytes that follow it"
        );
    }
    let mut pool = image_pool();
    for mode in [ImportMode::Exact, ImportMode::ConvertDtype] {
        let before = snapshot(&pool);
        match pool.import_slot(1, data, mode) {
            Ok(()) => {
                if mode == ImportMode::Exact {
                    let again = pool.export_slot(1).expect("an imported slot is flushed");
                    assert!(
                        again == data,
                        "an exact import re-exports to the same bytes"
                    );
                }
            }
            Err(e) => {
                assert!(matches!(e, PoolError::Checkpoint(_)), "{e:?}");
                assert!(
                    snapshot(&pool) == before,
                    "a refused import changed the pool: {e}"
                );
            }
        }
    }
}

/// The layout-id parser ([`LayoutId::parse`]): what it accepts prints back to an id that
/// parses to the same facts.
pub fn layout_id(text: &str) {
    if let Ok(id) = LayoutId::parse(text) {
        let printed = id.to_string();
        assert_eq!(LayoutId::parse(&printed).ok(), Some(id), "{printed}");
    }
}
