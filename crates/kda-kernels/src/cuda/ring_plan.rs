//! The launch plan of calls with a replay ring ([`ring_choice`], [`ring_plan`]): which ring
//! kernel runs a call and its token rows, copy granularity and shared memory, a pure function
//! of the call's shape. Each default is a choice measured on the H200 (docs/performance.md
//! names the session).

use super::lanes::{tile_fits, warp_columns};
use crate::choice::RingKernel;
use crate::cpu::validate::Op;

/// What decides whether and how the pipelined ring kernel (`kda_ring`) runs.
pub(super) struct RingShape {
    pub(super) k: usize,
    pub(super) v: usize,
    pub(super) state_size: usize,
    pub(super) input_size: usize,
    pub(super) ring_len: usize,
    /// Bytes of one ring entry (`PoolGeometry::ring_entry_elems` in the input dtype).
    pub(super) entry_bytes: usize,
    /// Most new tokens of one sequence in the call.
    pub(super) max_new: usize,
    /// Value heads of the call (sequences x value heads).
    pub(super) heads: usize,
    /// Whether the pool rounds stochastically (`kda_ring` stores with nearest rounding only).
    pub(super) stochastic: bool,
    /// Whether the pool has a delta plane (`kda_ring_delta` needs one).
    pub(super) deltas: bool,
    /// Whether the state is stored V-first.
    pub(super) v_first: bool,
    /// Whether the call is a ring decode (one new token per sequence).
    pub(super) decode: bool,
    pub(super) smem_optin: usize,
}

/// A launch of `kda_ring`, `kda_ring_tile`, `kda_ring_mma` or `kda_ring_delta`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RingPlan {
    /// Which of them (never [`RingKernel::Step`]).
    pub(super) kernel: RingKernel,
    /// Token rows per stage (ring length + most new tokens).
    pub(super) mt: usize,
    /// Most new tokens of one sequence.
    pub(super) mq: usize,
    /// Bytes per asynchronous copy of a token row (4, 8 or 16).
    pub(super) gran: usize,
    /// Column blocks per value head.
    pub(super) vblocks: usize,
    /// Dynamic shared memory, bytes.
    pub(super) smem: usize,
}

/// Threads of a `kda_ring` CTA (`RT` in `kernels/kda_ring.cu`).
pub(super) const RING_THREADS: usize = 256;
/// Most tokens (pending entries and new tokens) of one `kda_ring` item (`MTC`).
const RING_MAX_TOKENS: usize = 16;
/// `kda_ring_mma`'s K and item columns (`MW` in `kernels/kda_ring_mma.cu`).
const MMA_ITEM: usize = 128;

/// Columns of one item of either ring kernel (`RCW`: eight warps' columns).
fn ring_item_columns(k: usize) -> usize {
    (RING_THREADS / 32) * warp_columns(k)
}

/// The launch of `kernel` (`kda_ring`, `kda_ring_tile`, `kda_ring_mma` or `kda_ring_delta`), or
/// `None` where the call does not fit it (stochastic rounding, tiles that are not whole 16-byte
/// copies, token rows that are not whole 4-byte copies, too many tokens per item, too much shared
/// memory; for `kda_ring_mma` also K other than 128 or value heads that are not whole 128-column
/// items; for `kda_ring_delta` a pool without a delta plane or V not a multiple of 4): then
/// `kda_step` runs. Mirrors `RingLayout`, `RingTileLayout`, `MmaLayout`, `DeltaLayout`,
/// `LeanLayout` and the constants of `kernels/kda_ring.cu`, `kernels/kda_ring_mma.cu` and
/// `kernels/kda_ring_delta.cu` (an item of each kernel is eight warps of `kda_step`'s lane
/// mapping).
fn ring_plan(s: &RingShape, kernel: RingKernel) -> Option<RingPlan> {
    let r16 = |x: usize| x.div_ceil(16) * 16;
    let cw = ring_item_columns(s.k);
    let (mt, mq) = (s.ring_len + s.max_new, s.max_new);
    // every pool dtype and operation: measured faster than kda_step for fp32 decode, spec_verify
    // (2-14%) and replay (19-22%) too (docs/performance.md, eleventh session)
    if kernel == RingKernel::Step
        || s.ring_len == 0
        || s.stochastic
        || !tile_fits(s.k, s.v, s.state_size)
        || mt > RING_MAX_TOKENS
        || (kernel == RingKernel::Mma
            && (s.k != MMA_ITEM || cw != MMA_ITEM || !s.v.is_multiple_of(MMA_ITEM)))
        || (matches!(kernel, RingKernel::Delta | RingKernel::DeltaStaged)
            && (!s.deltas || !s.v.is_multiple_of(4)))
        || (kernel == RingKernel::DeltaStaged && !staged_fits(s))
    {
        return None;
    }
    let isz = s.input_size;
    // the largest power of two <= 16 dividing every row size and offset
    let gran = [s.entry_bytes, s.k * isz, s.v * isz, cw * isz]
        .iter()
        .map(|q| 1usize << q.trailing_zeros().min(4))
        .min()
        .unwrap_or(16);
    if gran < 4 {
        return None;
    }
    let ks = s.k.next_multiple_of(4);
    let tokb = 2 * r16(s.k * isz) + r16(cw * isz);
    // token rows, raw queries, dt_bias: kda_ring has two stages of them, the others one
    let rows = mt * tokb + mq * r16(s.k * isz) + r16(s.k * 4);
    let smem = match kernel {
        RingKernel::Tile => rows + 4 * ((2 * mt + mq) * ks + mt * cw) + r16(4 * mt),
        RingKernel::Delta | RingKernel::DeltaStaged => {
            // Tile's, then the delta vectors by token, a block of R k rows per new token (one at
            // least: a commit's), P k and P q per new token, P, the pair sums and q . k
            let floats = mt * cw + mq.max(1) * mt * ks + 2 * mq * ks + ks + 2 * mq * mt;
            let general =
                rows + 4 * ((2 * mt + mq) * ks + mt * cw) + r16(4 * mt) + 4 * floats + r16(4 * mq);
            // its lean decode path (K = V = 128, `LeanLayout`): per ring entry the raw k and g
            // rows, the delta vector, the activated key and decay; two f32 rows per warp
            let lean = if s.k == 128 && s.v == 128 {
                s.ring_len * (2 * r16(s.k * isz) + 4 * s.v + 8 * s.k)
                    + (RING_THREADS / 32) * 2 * 4 * s.k
            } else {
                0
            };
            // kda_ring_delta_staged: the lean path's tile staged after it (8 bytes per lane
            // and row)
            let staged = if kernel == RingKernel::DeltaStaged {
                lean + RING_THREADS * 8 * (s.k / 8)
            } else {
                0
            };
            general.max(lean).max(staged)
        }
        RingKernel::Mma => {
            // keys and queries, decays (rows of K + 4 floats); the pair matrices, betas, P; the
            // tile (rows of 128 elements + 16 bytes)
            let (ap, pp) = (s.k + 4, RING_MAX_TOKENS + 1);
            let floats = (2 * mt + mq) * ap + 2 * RING_MAX_TOKENS * pp + RING_MAX_TOKENS;
            rows + 4 * floats + r16(4 * s.k) + MMA_ITEM * (MMA_ITEM * s.state_size + 16)
        }
        _ => {
            let floats = (2 * mt + mq) * ks + mt * cw + 3 * RING_MAX_TOKENS;
            r16(s.k * cw * s.state_size) + 2 * rows + 4 * floats + 16
        }
    };
    (smem <= s.smem_optin).then_some(RingPlan {
        kernel,
        mt,
        mq,
        gran,
        vblocks: s.v.div_ceil(cw),
        smem,
    })
}

/// Whether a call fits `kda_ring_delta_staged` ([`RingKernel::DeltaStaged`]): ring decode of a
/// 2-byte K-first pool with K = V = 128 (`STAGE_FITS` in `kernels/kda_ring_delta.cu`).
fn staged_fits(s: &RingShape) -> bool {
    s.decode && s.state_size == 2 && !s.v_first && s.k == 128 && s.v == 128
}

/// Most items (sequence, value head, column block) of a ring decode call that `kda_ring_tile`
/// runs: up to here it measured 8-11% faster than `kda_ring` for fp32 pools and level to 6%
/// faster for 2-byte ones; at 192-256 items level (+-2%), from 384 items 2-13% slower
/// (docs/performance.md, nineteenth session). A small call gives `kda_ring` one item per CTA
/// too, with nothing to pipeline.
const RING_TILE_DECODE_UPTO: usize = 128;
/// The same for a replay (flush) call: 3-6% faster up to 64 items, level to 24% slower from 96.
const RING_TILE_REPLAY_UPTO: usize = 64;

/// Most items of a spec_verify call (two or more drafts, any number) that `kda_ring_tile`
/// runs. Such a call launches as a dependent launch (`SPEC_DEPENDENT_UPTO`), and then
/// the tile kernel measured 1.7-14% faster than `kda_ring` at 128 items and level at 192-256
/// (H200, T = 2 and 4, fp32 and fp16 pools: docs/performance.md, twentieth session). As for ring
/// decode, a small call gives `kda_ring` one item per CTA and nothing to pipeline.
const RING_TILE_SPEC_UPTO: usize = 128;

/// The fewest items of a spec_verify call with `max_new` new tokens per sequence from which
/// `kda_ring_tile` runs it, or `None` for never (one new token: decode's shape). One item per
/// CTA pays where the items are many and long; a call of a few hundred items is better served by
/// `kda_ring`'s persistent pipeline. Measured on the H200 for T = 2, 3, 4 at 12-8192 items of
/// whole heads (docs/performance.md, nineteenth and twentieth sessions): the thresholds are the
/// item counts from which the tile kernel was level or faster for every larger call but one
/// (2-byte T = 2 at 2048 items: 1% slower).
fn ring_tile_from(state_size: usize, max_new: usize) -> Option<usize> {
    match (state_size, max_new) {
        (_, 0..=1) => None,
        (_, 4..) => Some(512),
        (2, 3) => Some(2048),
        _ => Some(1024),
    }
}

/// The fewest items of a spec_verify call on a 2-byte pool with at least
/// [`MMA_SPEC_MIN_NEW`] new tokens per sequence that `kda_ring_mma` runs by default: with three
/// CTAs per SM it measured 6-9% faster than the kernel chosen before at 768-4096 items and 15%
/// at 384 (H200, T = 4, fp16 and bf16; docs/performance.md, twenty-third session); smaller calls
/// were not measured. With three drafts it was mixed (3% slower at 768 items), with fp32 pools,
/// ring decode and replay slower.
const MMA_SPEC_FROM: usize = 384;
/// See [`MMA_SPEC_FROM`].
const MMA_SPEC_MIN_NEW: usize = 4;

/// Whether a call of `op` is one `kda_ring_delta` runs by default (where it fits): ring decode
/// and spec_verify on a pool with a delta plane. On the H200 ring decode measured 3-12% faster
/// than the kernel chosen before at 12-8192 items, every pool dtype, and spec_verify of one
/// draft 6-21% faster than `kda_ring` at 12-32 and 2048-8192 items, 1.5% (fp16) and 3.5% (fp32)
/// slower at 768 (docs/performance.md, twenty-fourth session). With two to four drafts it
/// measured 2-18% faster than the kernel chosen before at 192-8192 items, fp32 and fp16 pools,
/// `kda_ring_mma` included (twenty-fifth session). Replay keeps its kernels: from records
/// without stored vectors the delta kernel replays as `kda_ring_tile` does, and measured slower.
fn delta_default(s: &RingShape, op: Op) -> bool {
    s.deltas && matches!(op, Op::Decode | Op::SpecVerify)
}

/// The fewest items of a ring decode call that `kda_ring_delta_staged` runs by default (where
/// `kda_ring_delta` would, and the call fits it): with three CTAs per SM it measured faster than
/// `kda_ring_delta` at 2048 items (0.7% fp16, 2.2% bf16), 3072 (3.1%, 4.6%) and 8192 (5.7%,
/// 7.1%), slower at 768 (8.1%, 6.4%) and at 12-32 (7.5-9.5%), where a third CTA per SM has
/// little to run and the item's own latency counts (H200, ring 8; docs/performance.md,
/// thirty-sixth session).
const STAGED_DECODE_FROM: usize = 2048;

/// Whether a call of `op` of `items` items is one `kda_ring_mma` runs by default (where it fits).
fn mma_spec(s: &RingShape, op: Op, items: usize) -> bool {
    op == Op::SpecVerify
        && s.state_size == 2
        && s.max_new >= MMA_SPEC_MIN_NEW
        && items >= MMA_SPEC_FROM
}

/// The ring kernel of a call of `op`, or `None` for `kda_step`: `forced`
/// (`CudaBackend::set_ring_kernel`) where the call fits it, else `kda_ring_delta` for ring decode
/// and spec_verify on pools with a delta plane ([`delta_default`]), `kda_ring_mma` for big
/// spec_verify calls of four or more drafts on 2-byte pools ([`mma_spec`]), `kda_ring_tile` for
/// small ring decode and replay calls ([`RING_TILE_DECODE_UPTO`], [`RING_TILE_REPLAY_UPTO`] items) and
/// spec_verify calls of two or more drafts up to [`RING_TILE_SPEC_UPTO`] items or from
/// [`ring_tile_from`]'s item count, and `kda_ring` for the rest (ring
/// decode and replay measured 2-24% slower with the tile kernel at N >= 64: docs/performance.md,
/// eighteenth and nineteenth sessions).
pub(super) fn ring_choice(s: &RingShape, op: Op, forced: Option<RingKernel>) -> Option<RingPlan> {
    let items = s.heads * s.v.div_ceil(ring_item_columns(s.k));
    if forced.is_none() && delta_default(s, op) {
        // (ring_plan takes only decode calls: `RingShape::decode`)
        if items >= STAGED_DECODE_FROM {
            if let Some(p) = ring_plan(s, RingKernel::DeltaStaged) {
                return Some(p);
            }
        }
        if let Some(p) = ring_plan(s, RingKernel::Delta) {
            return Some(p);
        }
    }
    if forced.is_none() && mma_spec(s, op, items) {
        if let Some(p) = ring_plan(s, RingKernel::Mma) {
            return Some(p);
        }
    }
    let kernel = forced.unwrap_or_else(|| {
        let tile = match op {
            Op::Decode => items <= RING_TILE_DECODE_UPTO,
            Op::Replay => items <= RING_TILE_REPLAY_UPTO,
            Op::SpecVerify => ring_tile_from(s.state_size, s.max_new)
                .is_some_and(|from| items <= RING_TILE_SPEC_UPTO || items >= from),
            Op::Prefill => false,
        };
        if tile {
            RingKernel::Tile
        } else {
            RingKernel::Pipelined
        }
    });
    ring_plan(s, kernel)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring_shape(state_size: usize, ring_len: usize, max_new: usize) -> RingShape {
        RingShape {
            k: 128,
            v: 128,
            state_size,
            input_size: 2,
            ring_len,
            // 12 heads in bf16: 2 (3 x 12 x 128 + 12)
            entry_bytes: 9240,
            max_new,
            // 12 heads, 64 sequences
            heads: 768,
            stochastic: false,
            deltas: false,
            v_first: false,
            decode: false,
            smem_optin: 227 * 1024,
        }
    }

    #[test]
    fn ring_plan_fits_the_benchmarked_ring_and_spec_shapes() {
        // decode with ring 8: whole heads of 128 columns (eight warps), 8-byte copies of token
        // rows (a ring entry of 12 heads in bf16 is 9240 bytes)
        let p = ring_plan(&ring_shape(4, 8, 1), RingKernel::Pipelined).expect("fp32 ring 8");
        assert_eq!((p.mt, p.mq, p.gran, p.vblocks), (9, 1, 8, 1));
        let p = ring_plan(&ring_shape(2, 8, 1), RingKernel::Pipelined).expect("fp16 ring 8");
        assert_eq!((p.mt, p.vblocks), (9, 1));
        // two CTAs (16 warps) per SM, fp32 included: one tile buffer (228 KiB per SM, 1 KiB
        // reserved per CTA)
        let two_per_sm = |p: RingPlan| 2 * (p.smem + 1024) <= 228 * 1024;
        assert!(two_per_sm(p), "{} bytes", p.smem);
        let p = ring_plan(&ring_shape(4, 8, 1), RingKernel::Pipelined).unwrap();
        assert!(two_per_sm(p), "{} bytes", p.smem);
        // spec T = 4 with ring 10 (either layout: the plan does not depend on it)
        let p = ring_plan(&ring_shape(2, 10, 4), RingKernel::Pipelined).expect("spec T = 4");
        assert_eq!((p.mt, p.mq), (14, 4));
        let p = ring_plan(&ring_shape(4, 10, 4), RingKernel::Pipelined).unwrap();
        assert!(two_per_sm(p), "{} bytes", p.smem);
        // kda_ring_tile's CTAs, without a tile buffer or a second stage, take less
        for state_size in [4, 2] {
            for kernel in [RingKernel::Tile, RingKernel::Mma] {
                let p =
                    ring_plan(&ring_shape(state_size, 10, 4), kernel).expect("one item per CTA");
                assert!(
                    p.kernel == kernel && two_per_sm(p),
                    "{kernel:?}: {} bytes",
                    p.smem
                );
                assert_eq!((p.mt, p.mq, p.gran, p.vblocks), (14, 4, 8, 1));
            }
        }
        // kda_ring_mma with 16 tokens per item (two mma row tiles) still fits two fp32 CTAs per
        // SM, and three of a 2-byte pool (its register bound) at T = 4
        let p = ring_plan(&ring_shape(4, 11, 5), RingKernel::Mma).expect("kda_ring_mma, 16 tokens");
        assert!(two_per_sm(p), "{} bytes", p.smem);
        let p = ring_plan(&ring_shape(2, 10, 4), RingKernel::Mma).unwrap();
        assert!(3 * (p.smem + 1024) <= 228 * 1024, "{} bytes", p.smem);
    }

    #[test]
    fn ring_choice_takes_the_delta_kernel_for_decode_and_spec_on_pools_with_a_delta_plane() {
        for (op, max_new) in [
            (Op::Decode, 1),
            (Op::SpecVerify, 1),
            (Op::SpecVerify, 0),
            (Op::SpecVerify, 2),
            (Op::SpecVerify, 4),
        ] {
            for state_size in [4, 2] {
                let mut s = ring_shape(state_size, 8, max_new);
                let kernel = |s: &RingShape| ring_choice(s, op, None).map(|p| p.kernel);
                assert_ne!(kernel(&s), Some(RingKernel::Delta), "{op:?}: no plane");
                s.deltas = true;
                assert_eq!(kernel(&s), Some(RingKernel::Delta), "{op:?}, {state_size}");
                // small calls too
                s.heads = 12;
                assert_eq!(kernel(&s), Some(RingKernel::Delta), "{op:?}, 12 heads");
            }
        }
        // ahead of kda_ring_mma for big 2-byte calls of four drafts too
        let mut s = ring_shape(2, 10, 4);
        (s.deltas, s.heads) = (true, 8192);
        assert_eq!(
            ring_choice(&s, Op::SpecVerify, None).map(|p| p.kernel),
            Some(RingKernel::Delta)
        );
        s.deltas = false;
        assert_eq!(
            ring_choice(&s, Op::SpecVerify, None).map(|p| p.kernel),
            Some(RingKernel::Mma)
        );
        // not by default for replay, nor where it cannot run
        let mut s = ring_shape(2, 8, 0);
        s.deltas = true;
        assert_ne!(
            ring_choice(&s, Op::Replay, None).map(|p| p.kernel),
            Some(RingKernel::Delta)
        );
        for (stochastic, v) in [(true, 128), (false, 126)] {
            let mut s = ring_shape(2, 8, 1);
            (s.deltas, s.stochastic, s.v) = (true, stochastic, v);
            assert_eq!(
                ring_plan(&s, RingKernel::Delta),
                None,
                "{stochastic}, V = {v}"
            );
        }
        // two CTAs of kda_ring_delta per SM, fp32 included (its launch bounds)
        let mut s = ring_shape(4, 15, 1);
        s.deltas = true;
        let p = ring_plan(&s, RingKernel::Delta).expect("ring 15: 16 tokens");
        assert!(2 * (p.smem + 1024) <= 228 * 1024, "{} bytes", p.smem);
        // and for spec_verify of four drafts over a ring of 10
        let mut s = ring_shape(4, 10, 4);
        s.deltas = true;
        let p = ring_plan(&s, RingKernel::Delta).expect("spec T = 4");
        assert_eq!((p.mt, p.mq), (14, 4));
        assert!(2 * (p.smem + 1024) <= 228 * 1024, "{} bytes", p.smem);
    }

    #[test]
    fn delta_plan_holds_the_lean_decode_paths_shared_memory() {
        // `LeanLayout` of kernels/kda_ring_delta.cu at K = V = 128: per ring entry the raw k
        // and g rows (16-byte rounded), the delta vector, the activated key and decay (f32);
        // then two f32 rows per warp
        for input_size in [2, 4] {
            for ring_len in 1..=RING_MAX_TOKENS - 1 {
                let mut s = ring_shape(2, ring_len, 1);
                (s.deltas, s.input_size) = (true, input_size);
                let raw_row = (128 * input_size).next_multiple_of(16);
                let u = ring_len * 2 * raw_row;
                let ka = u + ring_len * 4 * 128;
                let da = ka + ring_len * 4 * 128;
                let pw = da + ring_len * 4 * 128;
                let end = pw + 8 * 2 * 4 * 128;
                let p = ring_plan(&s, RingKernel::Delta).expect("decode fits");
                assert!(
                    p.smem >= end,
                    "ring {ring_len}, {input_size}-byte inputs: {} < {end}",
                    p.smem
                );
                assert_eq!(
                    ring_plan(&s, RingKernel::DeltaStaged),
                    None,
                    "not a decode call"
                );
                // kda_ring_delta_staged: the tile after it, 8 bytes per lane and row of its 16
                s.decode = true;
                let p = ring_plan(&s, RingKernel::DeltaStaged).expect("decode fits");
                let staged_end = end + 256 * 16 * 8;
                assert!(
                    p.smem >= staged_end,
                    "ring {ring_len}: {} < {staged_end}",
                    p.smem
                );
            }
        }
    }

    #[test]
    fn staged_delta_kernel_fits_two_byte_k_first_decode_of_128_by_128_heads_only() {
        let fits = |state_size: usize, v_first: bool, decode: bool, k: usize| {
            let mut s = ring_shape(state_size, 8, 1);
            (s.deltas, s.v_first, s.decode, s.k) = (true, v_first, decode, k);
            ring_plan(&s, RingKernel::DeltaStaged).is_some()
        };
        assert!(fits(2, false, true, 128));
        assert!(!fits(2, true, true, 128), "V-first");
        assert!(!fits(4, false, true, 128), "fp32");
        assert!(!fits(2, false, false, 128), "spec_verify");
        assert!(!fits(2, false, true, 64), "K = 64");
        let mut s = ring_shape(2, 8, 1);
        (s.decode, s.deltas) = (true, false);
        assert_eq!(
            ring_plan(&s, RingKernel::DeltaStaged),
            None,
            "no delta plane"
        );
        // three CTAs per SM at ring 8 (the kernel's launch bounds): 228 KB per SM, 1 KB
        // reserved per CTA, 48 bytes of static shared memory
        s.deltas = true;
        let p = ring_plan(&s, RingKernel::DeltaStaged).expect("ring 8");
        assert!(3 * (p.smem + 1024 + 48) <= 228 * 1024, "{} bytes", p.smem);
    }

    #[test]
    fn ring_choice_takes_the_staged_delta_kernel_for_big_two_byte_ring_decode_calls() {
        let kernel = |state_size: usize, heads: usize, op: Op| {
            let mut s = ring_shape(state_size, 8, 1);
            (s.deltas, s.decode, s.heads) = (true, op == Op::Decode, heads);
            ring_choice(&s, op, None).map(|p| p.kernel)
        };
        let staged = Some(RingKernel::DeltaStaged);
        assert_eq!(kernel(2, STAGED_DECODE_FROM, Op::Decode), staged);
        assert_eq!(kernel(2, 8192, Op::Decode), staged);
        assert_eq!(
            kernel(2, STAGED_DECODE_FROM - 1, Op::Decode),
            Some(RingKernel::Delta)
        );
        assert_eq!(kernel(4, 8192, Op::Decode), Some(RingKernel::Delta), "fp32");
        assert_eq!(kernel(2, 8192, Op::SpecVerify), Some(RingKernel::Delta));
    }

    #[test]
    fn ring_choice_takes_the_tile_kernel_where_it_measured_faster() {
        // one item per CTA: kda_ring_tile, or kda_ring_mma where it measured faster still
        let tile = |state_size, max_new, heads, op| {
            let mut s = ring_shape(state_size, 2 * (max_new + 1), max_new);
            s.heads = heads;
            ring_choice(&s, op, None).map(|p| p.kernel != RingKernel::Pipelined)
        };
        // whole heads of 128 columns: one item per head. Up to 128 items with any number of
        // drafts; T = 4 from 512 items, T = 2 from 1024, fp32 T = 3 from 1024, 2-byte from 2048
        for (state_size, max_new, from) in [
            (4, 4, 512),
            (2, 4, 512),
            (4, 3, 1024),
            (4, 2, 1024),
            (2, 3, 2048),
            (2, 2, 1024),
        ] {
            let case = format!("{state_size}-byte pool, T = {max_new}");
            for heads in [1, 12, 128, from, 8192] {
                assert_eq!(
                    tile(state_size, max_new, heads, Op::SpecVerify),
                    Some(true),
                    "{case}, {heads}"
                );
            }
            // (kda_ring_mma takes 2-byte calls of four drafts from MMA_SPEC_FROM items)
            let mma =
                |heads| state_size == 2 && max_new >= MMA_SPEC_MIN_NEW && heads >= MMA_SPEC_FROM;
            for heads in [129, from / 2, from - 1].into_iter().filter(|&h| !mma(h)) {
                assert_eq!(
                    tile(state_size, max_new, heads, Op::SpecVerify),
                    Some(false),
                    "{case}, {heads}"
                );
            }
        }
        for state_size in [4, 2] {
            // one draft: kda_ring at any size
            for heads in [1, 768, 8192] {
                assert_eq!(tile(state_size, 1, heads, Op::SpecVerify), Some(false));
            }
            // decode up to 128 items, replay up to 64: the tile kernel; larger: kda_ring
            for (heads, decode, replay) in [
                (1, true, true),
                (64, true, true),
                (65, true, false),
                (128, true, false),
                (129, false, false),
                (8192, false, false),
            ] {
                assert_eq!(
                    tile(state_size, 1, heads, Op::Decode),
                    Some(decode),
                    "{heads}"
                );
                assert_eq!(
                    tile(state_size, 0, heads, Op::Replay),
                    Some(replay),
                    "{heads}"
                );
            }
        }
        // half-width heads (64 columns over 128-column items) count one item per head
        let mut half = ring_shape(4, 10, 4);
        (half.v, half.heads) = (64, 511);
        assert_eq!(
            ring_choice(&half, Op::SpecVerify, None).map(|p| p.kernel == RingKernel::Tile),
            Some(false)
        );
        half.heads = 512;
        assert_eq!(
            ring_choice(&half, Op::SpecVerify, None).map(|p| p.kernel == RingKernel::Tile),
            Some(true)
        );
        // a forced kernel wins; kda_step is no plan
        let s = ring_shape(2, 8, 1);
        for op in [Op::Decode, Op::SpecVerify, Op::Replay] {
            let forced = |k| ring_choice(&s, op, Some(k)).map(|p| p.kernel);
            for k in [RingKernel::Tile, RingKernel::Pipelined, RingKernel::Mma] {
                assert_eq!(forced(k), Some(k), "{op:?}");
            }
            assert_eq!(forced(RingKernel::Step), None, "{op:?}");
        }
        // where neither fits, kda_step runs whatever was asked
        let mut st = ring_shape(2, 8, 4);
        st.stochastic = true;
        assert_eq!(ring_choice(&st, Op::SpecVerify, None), None);
        assert_eq!(
            ring_choice(&st, Op::SpecVerify, Some(RingKernel::Tile)),
            None
        );
    }

    #[test]
    fn ring_choice_takes_the_mma_kernel_for_big_2_byte_spec_calls_of_four_drafts() {
        let kernel = |state_size, max_new, heads, op| {
            let mut s = ring_shape(state_size, 2 * (max_new + 1), max_new);
            s.heads = heads;
            ring_choice(&s, op, None).map(|p| p.kernel)
        };
        for heads in [MMA_SPEC_FROM, 768, 2048, 8192] {
            assert_eq!(
                kernel(2, 4, heads, Op::SpecVerify),
                Some(RingKernel::Mma),
                "{heads} items"
            );
        }
        assert_eq!(
            kernel(2, 4, MMA_SPEC_FROM - 1, Op::SpecVerify),
            Some(RingKernel::Pipelined)
        );
        // more drafts (six, with a ring of 8: 14 tokens per item) too
        let mut s = ring_shape(2, 8, 6);
        s.heads = 2048;
        assert_eq!(
            ring_choice(&s, Op::SpecVerify, None).map(|p| p.kernel),
            Some(RingKernel::Mma)
        );
        // fp32 pools, fewer drafts, ring decode and replay keep their kernels
        assert_eq!(kernel(4, 4, 2048, Op::SpecVerify), Some(RingKernel::Tile));
        assert_eq!(kernel(2, 3, 2048, Op::SpecVerify), Some(RingKernel::Tile));
        assert_eq!(kernel(2, 1, 8192, Op::Decode), Some(RingKernel::Pipelined));
        assert_eq!(kernel(2, 0, 8192, Op::Replay), Some(RingKernel::Pipelined));
        // where kda_ring_mma does not fit (K = 64 here), the tile kernel as before
        let mut s = ring_shape(2, 10, 4);
        (s.k, s.heads) = (64, 2048);
        assert_eq!(
            ring_choice(&s, Op::SpecVerify, None).map(|p| p.kernel),
            Some(RingKernel::Tile)
        );
        // and a forced kernel still wins
        s.k = 128;
        assert_eq!(
            ring_choice(&s, Op::SpecVerify, Some(RingKernel::Pipelined)).map(|p| p.kernel),
            Some(RingKernel::Pipelined)
        );
    }

    #[test]
    fn ring_plan_takes_every_pool_dtype_and_operation() {
        for kernel in [RingKernel::Pipelined, RingKernel::Tile, RingKernel::Mma] {
            for state_size in [4, 2] {
                for (max_new, op) in [(4, "spec_verify"), (0, "replay"), (1, "decode")] {
                    assert!(
                        ring_plan(&ring_shape(state_size, 8, max_new), kernel).is_some(),
                        "{state_size}-byte pool, {op}, {kernel:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn ring_plan_refuses_what_the_ring_kernels_cannot_take() {
        for kernel in [RingKernel::Pipelined, RingKernel::Tile, RingKernel::Mma] {
            assert_eq!(
                ring_plan(&ring_shape(2, 0, 1), kernel),
                None,
                "no ring: eager kernels"
            );
            let mut s = ring_shape(2, 4, 1);
            s.stochastic = true;
            assert_eq!(ring_plan(&s, kernel), None, "stochastic rounding: kda_step");
            assert_eq!(
                ring_plan(&ring_shape(2, 12, 5), kernel),
                None,
                "17 tokens per item"
            );
            let mut s = ring_shape(2, 4, 1);
            s.v = 20;
            assert_eq!(ring_plan(&s, kernel), None, "tile rows of 40 bytes");
            let mut s = ring_shape(2, 4, 1);
            s.k = 24;
            s.v = 8;
            // one head: a ring entry of 2 (24 + 8 + 24 + 1) = 114 bytes, 2-byte copies only
            s.entry_bytes = 114;
            assert_eq!(
                ring_plan(&s, kernel),
                None,
                "token rows without 4-byte copies"
            );
        }
        let mut s = ring_shape(4, 8, 1);
        s.smem_optin = 64 * 1024;
        assert_eq!(
            ring_plan(&s, RingKernel::Pipelined),
            None,
            "more shared memory than the device has"
        );
        s.smem_optin = 16 * 1024;
        assert_eq!(
            ring_plan(&s, RingKernel::Tile),
            None,
            "the tile kernel's rows too"
        );
        assert_eq!(ring_plan(&s, RingKernel::Step), None, "kda_step is no plan");
        // kda_ring_mma: K = 128 and whole 128-column items only
        for (k, v) in [(64, 128), (128, 64), (128, 192)] {
            let mut s = ring_shape(2, 8, 1);
            (s.k, s.v) = (k, v);
            assert_eq!(ring_plan(&s, RingKernel::Mma), None, "K = {k}, V = {v}");
            assert!(
                ring_plan(&s, RingKernel::Tile).is_some(),
                "K = {k}, V = {v}"
            );
        }
    }
}
