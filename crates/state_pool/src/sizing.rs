//! Pool sizing: pure functions of a [`PoolGeometry`], no allocation.
//!
//! Per slot, summed over the KDA layers: the ssm plane (`HV x K x V` in the state dtype), the
//! conv plane (`(conv_kernel - 1) x conv_channels` in the conv dtype) and the replay ring
//! (`ring_len` entries of raw inputs in the ring dtype, plus 16 bytes of bookkeeping when
//! `ring_len > 0`, plus the entries' f32 delta vectors with a delta plane). A pool holds request plus checkpoint slots. Given a cache budget (KV and
//! state together) and the KV geometry, the KV cache gets what the pool leaves; comparing with an
//! fp32 pool gives the blocks a narrower state dtype hands to the KV cache.

use serde::Serialize;

use crate::dtype::Dtype;
use crate::error::{PoolError, Result};
use crate::geometry::PoolGeometry;

/// Bytes of one slot, by plane, summed over all layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PlaneBytes {
    /// The recurrent state.
    pub ssm: u64,
    /// The short-conv state.
    pub conv: u64,
    /// The replay ring: entries plus bookkeeping (0 without a ring).
    pub ring: u64,
    /// `ssm + conv + ring`.
    pub total: u64,
}

/// Bytes of one slot by plane, over all layers.
pub fn slot_bytes(g: &PoolGeometry) -> PlaneBytes {
    let layers = g.layers as u64;
    let ssm = layers.saturating_mul(g.ssm_slot_bytes() as u64);
    let conv = layers.saturating_mul(g.conv_slot_bytes() as u64);
    let ring = layers.saturating_mul(g.ring_plane_slot_bytes() as u64);
    PlaneBytes {
        ssm,
        conv,
        ring,
        total: ssm.saturating_add(conv).saturating_add(ring),
    }
}

/// Bytes of the whole pool: (request + checkpoint slots) x the bytes of one slot.
pub fn pool_bytes(g: &PoolGeometry) -> u64 {
    slot_bytes(g).total.saturating_mul(g.total_slots() as u64)
}

/// The ring length by ATOM's rule: 0 (eager commit) without speculative decoding
/// (`spec_tokens` unset or 0), `2 x (spec_tokens + 1)` with it.
pub fn default_ring_len(spec_tokens: Option<usize>) -> usize {
    match spec_tokens {
        None | Some(0) => 0,
        Some(n) => 2 * (n + 1),
    }
}

/// What [`parse_bytes`] accepts, for error messages.
pub const ACCEPTED_BYTE_SIZES: &str =
    "a number of bytes with an optional SI (B, kB, MB, GB, TB, PB) or IEC (KiB, MiB, GiB, TiB, PiB) suffix, e.g. 57.8GiB";

/// Parses a byte size such as `1024`, `57.8GiB`, `80 GB` or `1.5 TiB`: a decimal number and an
/// optional suffix, SI (powers of 1000) or IEC (powers of 1024), case-insensitive, rounded to the
/// nearest byte. `source` names the argument in the error.
pub fn parse_bytes(text: &str, source: &str) -> Result<u64> {
    let bad = || PoolError::InvalidValue {
        what: "byte size",
        value: text.to_string(),
        source_name: source.to_string(),
        expected: ACCEPTED_BYTE_SIZES.to_string(),
    };
    let s = text.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(split);
    let multiplier: u128 = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "pib" => 1 << 50,
        _ => return Err(bad()),
    };
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') || frac.len() > 18 {
        return Err(bad());
    }
    let digits = |d: &str| -> Option<u128> {
        if d.is_empty() {
            Some(0)
        } else {
            d.parse::<u128>().ok()
        }
    };
    let (int, frac_value) = (digits(int).ok_or_else(bad)?, digits(frac).ok_or_else(bad)?);
    let scale = 10u128.pow(frac.len() as u32);
    let exact = int
        .checked_mul(scale)
        .and_then(|x| x.checked_add(frac_value))
        .and_then(|x| x.checked_mul(multiplier))
        .ok_or_else(bad)?;
    let rounded = (exact + scale / 2) / scale;
    u64::try_from(rounded).map_err(|_| bad())
}

/// Decimal megabytes with two decimals: `56.17 MB`.
pub fn format_mb(bytes: u64) -> String {
    format!("{:.2} MB", bytes as f64 / 1e6)
}

/// Binary gigabytes with two decimals: `3.35 GiB`.
pub fn format_gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// The request slots of `g`'s shape that fit in `budget` bytes beside its checkpoint slots.
pub fn max_slots_within(g: &PoolGeometry, budget: u64) -> u64 {
    let per_slot = slot_bytes(g).total.max(1);
    (budget / per_slot).saturating_sub(g.checkpoint_slots as u64)
}

/// Admission: the pool must fit in `budget` bytes; otherwise an error that says how many
/// request slots fit.
pub fn admit(g: &PoolGeometry, budget: u64) -> Result<()> {
    let need = pool_bytes(g);
    if need <= budget {
        return Ok(());
    }
    Err(PoolError::arg(
        "slots",
        format!(
            "{} request + {} checkpoint slots of {} ({} state) need {}, more than the budget of {}; at most {} request slots fit",
            g.slots,
            g.checkpoint_slots,
            format_mb(slot_bytes(g).total),
            g.state_dtype,
            format_gib(need),
            format_gib(budget),
            max_slots_within(g, budget)
        ),
    ))
}

/// The KV cache's geometry: bytes per token over all full-attention layers and tokens per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KvGeometry {
    /// KV-cache bytes of one token over all full-attention layers (of this rank).
    pub bytes_per_token: u64,
    /// Tokens per KV block.
    pub block_size: u64,
}

/// How a cache budget splits between the state pool and the KV cache, for the chosen dtype and
/// for the fp32 baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KvHandoff {
    /// The cache budget: KV and state together.
    pub budget_bytes: u64,
    /// KV-cache bytes of one token.
    pub kv_bytes_per_token: u64,
    /// Tokens per block.
    pub block_size: u64,
    /// Bytes of one block.
    pub block_bytes: u64,
    /// Bytes left to the KV cache beside the pool of the chosen dtype.
    pub bytes: u64,
    /// Whole KV blocks in `bytes`.
    pub blocks: u64,
    /// Bytes left to the KV cache beside an fp32 pool (0 when it does not fit).
    pub baseline_bytes: u64,
    /// Whole KV blocks in `baseline_bytes`.
    pub baseline_blocks: u64,
    /// Whether the fp32 pool fits the budget at all.
    pub baseline_fits: bool,
    /// `blocks - baseline_blocks`: the blocks the chosen dtype hands to the KV cache.
    pub delta_blocks: i64,
}

/// Splits `budget` between the pool `g` and the KV cache, and compares with an fp32 pool.
/// Admission first: a pool that does not fit is an error (see [`admit`]).
pub fn kv_handoff(g: &PoolGeometry, budget: u64, kv: KvGeometry) -> Result<KvHandoff> {
    if kv.bytes_per_token == 0 {
        return Err(PoolError::arg(
            "kv_bytes_per_token",
            "is 0; expected a positive number of bytes",
        ));
    }
    if kv.block_size == 0 {
        return Err(PoolError::arg(
            "block_size",
            "is 0; expected a positive number of tokens",
        ));
    }
    let block_bytes = kv
        .bytes_per_token
        .checked_mul(kv.block_size)
        .ok_or_else(|| {
            PoolError::arg(
                "block_size",
                format!(
                    "{} tokens of {} bytes overflow",
                    kv.block_size, kv.bytes_per_token
                ),
            )
        })?;
    admit(g, budget)?;
    let bytes = budget - pool_bytes(g);
    let baseline_pool = pool_bytes(&g.with_state_dtype(Dtype::Fp32));
    let baseline_bytes = budget.saturating_sub(baseline_pool);
    let blocks = bytes / block_bytes;
    let baseline_blocks = baseline_bytes / block_bytes;
    Ok(KvHandoff {
        budget_bytes: budget,
        kv_bytes_per_token: kv.bytes_per_token,
        block_size: kv.block_size,
        block_bytes,
        bytes,
        blocks,
        baseline_bytes,
        baseline_blocks,
        baseline_fits: baseline_pool <= budget,
        delta_blocks: blocks as i64 - baseline_blocks as i64,
    })
}

/// The pool of the fp32 baseline, beside the chosen dtype's in a [`SizingReport`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Baseline {
    /// Always fp32.
    pub dtype: Dtype,
    /// Bytes of one slot by plane.
    pub per_slot_bytes: PlaneBytes,
    /// Bytes of the pool.
    pub pool_bytes: u64,
}

/// Everything the sizing report shows, with stable field names (the CLI's `--json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SizingReport {
    /// The state dtype.
    pub dtype: Dtype,
    /// The pool's layout id.
    pub layout_id: String,
    /// Request slots.
    pub slots: usize,
    /// Checkpoint slots.
    pub checkpoint_slots: usize,
    /// Ring length in tokens.
    pub ring_len: usize,
    /// Whether the pool has a delta plane (counted in the ring bytes).
    pub ring_deltas: bool,
    /// Bytes of one slot by plane.
    pub per_slot_bytes: PlaneBytes,
    /// Bytes of the pool (request + checkpoint slots).
    pub pool_bytes: u64,
    /// The same pool with an fp32 state.
    pub baseline: Baseline,
    /// The KV handoff, when a budget is given.
    pub kv: Option<KvHandoff>,
}

impl SizingReport {
    /// Sizes the pool `g` against the fp32 baseline; with a budget and KV geometry, also the KV
    /// handoff (and admission).
    pub fn new(g: &PoolGeometry, budget: Option<(u64, KvGeometry)>) -> Result<Self> {
        let kv = match budget {
            Some((bytes, kv)) => Some(kv_handoff(g, bytes, kv)?),
            None => None,
        };
        let base = g.with_state_dtype(Dtype::Fp32);
        Ok(Self {
            dtype: g.state_dtype,
            layout_id: g.layout_id(),
            slots: g.slots,
            checkpoint_slots: g.checkpoint_slots,
            ring_len: g.ring_len,
            ring_deltas: g.ring_deltas && g.ring_len > 0,
            per_slot_bytes: slot_bytes(g),
            pool_bytes: pool_bytes(g),
            baseline: Baseline {
                dtype: Dtype::Fp32,
                per_slot_bytes: slot_bytes(&base),
                pool_bytes: pool_bytes(&base),
            },
            kv,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::PoolConfig;
    use crate::layout::StateLayout;
    use crate::shape::KdaShape;
    use proptest::prelude::*;

    fn k3(dtype: Dtype, slots: usize) -> PoolGeometry {
        let shape = KdaShape {
            name: "k3".into(),
            kda_layers: 69,
            num_heads: 96,
            num_v_heads: 96,
            head_k_dim: 128,
            head_v_dim: 128,
            conv_kernel: 4,
            conv_dtype: Dtype::Bf16,
            layout: StateLayout::KFirst,
            tp: 8,
        };
        let config = PoolConfig {
            state_dtype: dtype,
            slots,
            ..PoolConfig::default()
        };
        PoolGeometry::new(&shape, &config).unwrap()
    }

    #[test]
    fn k3_tp8_reproduces_the_seed_numbers() {
        let fp32 = slot_bytes(&k3(Dtype::Fp32, 64));
        assert_eq!(fp32.ssm, 54_263_808);
        assert_eq!(fp32.conv, 1_907_712);
        assert_eq!(fp32.ring, 0);
        assert_eq!(fp32.total, 56_171_520);
        for d in [Dtype::Fp16, Dtype::Bf16] {
            assert_eq!(slot_bytes(&k3(d, 64)).total, 29_039_616);
        }
        assert_eq!(format_mb(fp32.total), "56.17 MB");
        assert_eq!(format_mb(29_039_616), "29.04 MB");
        assert_eq!(format_gib(pool_bytes(&k3(Dtype::Fp32, 64))), "3.35 GiB");
        assert_eq!(format_gib(pool_bytes(&k3(Dtype::Fp16, 64))), "1.73 GiB");
    }

    #[test]
    fn ring_len_follows_atoms_rule() {
        assert_eq!(default_ring_len(None), 0);
        assert_eq!(default_ring_len(Some(0)), 0);
        assert_eq!(default_ring_len(Some(3)), 8);
    }

    #[test]
    fn ring_plane_counts_entries_bookkeeping_and_delta_vectors() {
        let mut g = k3(Dtype::Fp16, 4);
        g.ring_len = 8;
        // entry = k 12*128 + v 12*128 + g 12*128 + beta 12, bf16; 16 B of meta; with a delta
        // plane per entry an f32 delta vector of 12*128.
        let entry = 3 * 12 * 128 + 12;
        assert_eq!(slot_bytes(&g).ring, 69 * (8 * entry * 2 + 16) as u64);
        g.ring_deltas = true;
        let delta = 12 * 128 * 4;
        assert_eq!(
            slot_bytes(&g).ring,
            69 * (8 * entry * 2 + 16 + 8 * delta) as u64
        );
    }

    #[test]
    fn parse_bytes_accepts_si_and_iec_suffixes() {
        for (s, v) in [
            ("1024", 1024u64),
            ("0", 0),
            ("12B", 12),
            ("1kB", 1000),
            ("1 KiB", 1024),
            ("2MB", 2_000_000),
            ("2mib", 2 << 20),
            ("80 GB", 80_000_000_000),
            ("57.8GiB", 62_062_277_427),
            (" 1.5 TiB ", 1_649_267_441_664),
            ("1TB", 1_000_000_000_000),
            ("0.5PB", 500_000_000_000_000),
            (".5KiB", 512),
            ("3.", 3),
        ] {
            assert_eq!(parse_bytes(s, "--budget").unwrap(), v, "{s:?}");
        }
    }

    #[test]
    fn parse_bytes_refuses_junk_naming_the_argument() {
        for s in [
            "",
            "GiB",
            "1.2.3GB",
            "-5GB",
            "1e9",
            "12 parsecs",
            "1G",
            "1 0 GB",
            ".",
        ] {
            let e = parse_bytes(s, "--budget").unwrap_err().to_string();
            assert!(e.contains("--budget") && e.contains("GiB"), "{s:?}: {e}");
        }
        assert!(parse_bytes("99999999999 PiB", "--budget").is_err());
    }

    #[test]
    fn admission_says_how_many_slots_fit() {
        let g = k3(Dtype::Fp32, 64);
        let budget = 20 * 56_171_520 + 5;
        let e = admit(&g, budget).unwrap_err().to_string();
        assert!(e.contains("at most 20 request slots fit"), "{e}");
        assert_eq!(max_slots_within(&g, budget), 20);
        assert!(admit(&g, pool_bytes(&g)).is_ok());
    }

    #[test]
    fn kv_handoff_gives_fp16_blocks_to_the_kv_cache() {
        let g = k3(Dtype::Fp16, 64);
        let kv = KvGeometry {
            bytes_per_token: 8064,
            block_size: 16,
        };
        let budget = parse_bytes("57.8GiB", "b").unwrap();
        let h = kv_handoff(&g, budget, kv).unwrap();
        let block = 8064 * 16;
        assert_eq!(h.block_bytes, block);
        assert_eq!(h.bytes, budget - 64 * 29_039_616);
        assert_eq!(h.blocks, h.bytes / block);
        assert_eq!(h.baseline_bytes, budget - 64 * 56_171_520);
        assert_eq!(h.baseline_blocks, h.baseline_bytes / block);
        assert_eq!(h.delta_blocks, (h.blocks - h.baseline_blocks) as i64);
        // 64 x 27,131,904 B freed is 13,458.3 blocks of 129,024 B (+1 with the remainders).
        assert!((13_458..=13_459).contains(&h.delta_blocks), "{h:?}");
        assert!(h.baseline_fits);
    }

    #[test]
    fn kv_handoff_when_only_the_narrow_pool_fits() {
        let g = k3(Dtype::Fp16, 64);
        let budget = 64 * 29_039_616 + 10 * 1024;
        let kv = KvGeometry {
            bytes_per_token: 64,
            block_size: 16,
        };
        let h = kv_handoff(&g, budget, kv).unwrap();
        assert!(!h.baseline_fits);
        assert_eq!((h.baseline_bytes, h.baseline_blocks), (0, 0));
        assert_eq!(h.blocks, 10);
        assert_eq!(h.delta_blocks, 10);
    }

    #[test]
    fn kv_handoff_refuses_zero_geometry() {
        let g = k3(Dtype::Fp16, 1);
        let zero_tok = KvGeometry {
            bytes_per_token: 0,
            block_size: 16,
        };
        assert!(kv_handoff(&g, u64::MAX, zero_tok).is_err());
        let zero_block = KvGeometry {
            bytes_per_token: 1,
            block_size: 0,
        };
        assert!(kv_handoff(&g, u64::MAX, zero_block).is_err());
    }

    fn small_geometry() -> impl Strategy<Value = PoolGeometry> {
        (
            1usize..8,
            1usize..5,
            1usize..4,
            1usize..65,
            1usize..65,
            0usize..4,
            0usize..9,
            1usize..100,
            0usize..10,
            prop::sample::select(Dtype::ALL.to_vec()),
            prop::sample::select(Dtype::ALL.to_vec()),
            prop::sample::select(Dtype::ALL.to_vec()),
        )
            .prop_map(
                |(layers, h, group, k, v, conv_rows, ring_len, slots, ckpt, state, conv, ring)| {
                    PoolGeometry {
                        layers,
                        h,
                        hv: h * group,
                        k,
                        v,
                        conv_rows,
                        conv_channels: 2 * h * k + h * group * v,
                        conv_dtype: conv,
                        state_dtype: state,
                        layout: StateLayout::KFirst,
                        ring_len,
                        ring_dtype: ring,
                        ring_deltas: false,
                        slots,
                        checkpoint_slots: ckpt,
                        rounding: Default::default(),
                    }
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn pool_total_is_sum_of_planes_times_slots(g in small_geometry()) {
            let s = slot_bytes(&g);
            prop_assert_eq!(s.total, s.ssm + s.conv + s.ring);
            prop_assert_eq!(pool_bytes(&g), s.total * (g.slots + g.checkpoint_slots) as u64);
            let l = g.layers as u64;
            prop_assert_eq!(s.ssm, l * (g.hv * g.k * g.v * g.state_dtype.size()) as u64);
            prop_assert_eq!(s.conv, l * (g.conv_rows * g.conv_channels * g.conv_dtype.size()) as u64);
        }

        #[test]
        fn fp16_ssm_plane_is_exactly_half_of_fp32(g in small_geometry()) {
            let f32s = slot_bytes(&g.with_state_dtype(Dtype::Fp32));
            let f16s = slot_bytes(&g.with_state_dtype(Dtype::Fp16));
            let b16s = slot_bytes(&g.with_state_dtype(Dtype::Bf16));
            prop_assert_eq!(f16s.ssm * 2, f32s.ssm);
            prop_assert_eq!(b16s.ssm, f16s.ssm);
            prop_assert_eq!(f16s.conv, f32s.conv);
            prop_assert_eq!(f16s.ring, f32s.ring);
        }

        #[test]
        fn max_slots_within_is_the_admission_boundary(g in small_geometry(), extra in 0u64..1000) {
            let per = slot_bytes(&g).total;
            let n = g.slots as u64;
            let budget = (n + g.checkpoint_slots as u64) * per + extra;
            prop_assert!(admit(&g, budget).is_ok());
            prop_assert!(max_slots_within(&g, budget) >= n);
            let mut bigger = g.clone();
            bigger.slots = max_slots_within(&g, budget) as usize + 1;
            prop_assert!(admit(&bigger, budget).is_err());
        }
    }
}
