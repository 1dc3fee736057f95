//! The chunked prefill's launch plan (`kernels/kda_chunk.cu`): which shapes it takes, the
//! scratch it needs, and the call's sequences cut into chunks of at most [`BT`] tokens and
//! packed, in order, into windows whose scratch fits a budget. Pure functions of the call's
//! shape; the backend uploads each window's tables and launches `kda_chunk_prep`,
//! `kda_chunk_state` and `kda_chunk_out` on it.

/// Tokens per chunk (`BT` of `kda_chunk.cu`).
pub(crate) const BT: usize = 64;
/// Value columns per `kda_chunk_state` CTA (`BV`).
pub(crate) const BV: usize = 32;
/// Value columns per `kda_chunk_state_narrow` CTA (`BVN`).
pub(crate) const BV_NARROW: usize = 16;
/// Value columns per `kda_chunk_out` CTA (`OBV`).
pub(crate) const OBV: usize = 64;
/// Threads of a `kda_chunk_prep` CTA (`PREP_THREADS`).
pub(crate) const PREP_THREADS: usize = 512;
/// Threads of a `kda_chunk_state` CTA (`STATE_THREADS`).
pub(crate) const STATE_THREADS: usize = 256;
/// Threads of a `kda_chunk_out` CTA (`OUT_THREADS`).
pub(crate) const OUT_THREADS: usize = 256;
/// `KDA_PIECE_FROM_SLOT`: the piece starts from the slot's state (else from the carry).
pub(crate) const FROM_SLOT: u32 = 1;
/// `KDA_PIECE_TO_SLOT`: the piece ends by storing the slot's state (else into the carry).
pub(crate) const TO_SLOT: u32 = 2;
/// The scratch budget by default: 768 MiB, about 3700 (chunk, value head) blocks at K = V =
/// 128, so a prefill of up to 300 chunks (19 k tokens) at 12 value heads runs in one window.
pub(crate) const DEFAULT_SCRATCH_BYTES: usize = 768 << 20;

/// `struct KdaChunkParams` of `kda_chunk.cu`, the second kernel parameter of its kernels.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ChunkParams {
    /// `u32 [n_chunks][2]`: first token, tokens.
    pub chunks: u64,
    /// `u32 [n_pieces][4]`: first chunk, chunks, sequence, flags.
    pub pieces: u64,
    pub w: u64,
    pub qg: u64,
    pub kg: u64,
    pub u: u64,
    pub aqk: u64,
    pub gl: u64,
    /// `f32 [chunk][HV][K][V]`: the state at each chunk's start.
    pub hs: u64,
    /// `f32 [HV][K][V]`: the state of the sequence a window leaves open.
    pub carry: u64,
    /// `kda_chunk_prep`'s (chunk, value head) items: the window's chunks times the value heads.
    pub prep_items: u64,
}

const _: () = assert!(std::mem::size_of::<ChunkParams>() == 11 * 8);

/// Whether the chunked kernels take heads of `k` x `v` (K in the tensor cores' tiles of 16
/// rows, eight output columns at a time) within `smem_optin` bytes of shared memory per CTA.
pub(crate) fn chunk_supported(k: usize, v: usize, smem_optin: usize) -> bool {
    k > 0
        && v > 0
        && k.is_multiple_of(16)
        && v.is_multiple_of(8)
        && prep_smem(k, v).max(state_smem(k, BV)).max(out_smem(k)) <= smem_optin
}

/// Tokens per sub-chunk of `kda_chunk_prep`'s factored `Akk` and `Aqk` (`BC`).
const BC: usize = 16;

/// Dynamic shared memory of `kda_chunk_prep`, bytes (its `sK` .. `sB` arrays and `sF`: the
/// diagonal blocks' factored columns, `BT / 2` rows of K, then the factored rows of one block
/// row, `BT + BC` rows of K, then the inverses of the diagonal blocks of `I + Akk`, `BT` rows
/// of `BC + 4`). `sQ` and `sV`, where the solve works in place, in rows of [`solve_stride`].
pub(crate) fn prep_smem(k: usize, v: usize) -> usize {
    let (ck, ca) = (ck(k), BT + 4);
    let f = ((BT + BC) * ck).max(BT * (BC + 4));
    let (cx, cvx) = (solve_stride(k, k, v), solve_stride(v, k, v));
    4 * (2 * BT * ck + BT * cx + BT * cvx + BT * ca + BT + f)
}

/// `CX` and `CVX` of `kda_chunk.cu`: the row stride, in floats, of `kda_chunk_prep`'s `sQ`
/// (`width` = `k`) and `sV` (`width` = `v`). Where `k` and `v` are multiples of 16 (`XSW`):
/// `width` rounded up to 32, plus 16 (16 mod 32, with the pieces of a row swapped in pairs as
/// `xsw` does: the solve's loads and stores conflict-free); else `width` rounded up to 4,
/// plus 4.
pub(crate) fn solve_stride(width: usize, k: usize, v: usize) -> usize {
    if k.is_multiple_of(16) && v.is_multiple_of(16) {
        width.next_multiple_of(32) + 16
    } else {
        width.next_multiple_of(4) + 4
    }
}

/// Whether `kda_chunk_prep` stages each item's raw rows in shared memory during the previous
/// item's solve (`PREP_STAGED` of `kda_chunk.cu`): inputs of `input_bytes` = 2 whose raw rows
/// (k, q in `sK`; g, v and the f32 `dt_bias` row in `sG`) fit there and are read in one pass
/// of 16 elements per thread and array.
pub(crate) fn prep_staged(input_bytes: usize, k: usize, v: usize) -> bool {
    let ck = ck(k);
    input_bytes == 2
        && BT * k <= 16 * PREP_THREADS
        && BT * v <= 16 * PREP_THREADS
        && 2 * BT * (k + v) + 4 * k <= 4 * BT * ck
        && k.is_multiple_of(8)
        && v.is_multiple_of(8)
}

/// `kda_chunk_prep`'s CTAs for `items` (chunk, value head) items on `sms` multiprocessors:
/// one per SM where the items are staged (persistent CTAs, each item's raw rows copied during
/// the previous one's solve; the shared memory holds one CTA per SM), else one per item. The
/// kernel computes the same bits on any grid (a `prep_staged` that disagreed with the kernel's
/// `PREP_STAGED` would cost speed only; the NVRTC test holds the two equal).
pub(crate) fn prep_ctas(items: usize, staged: bool, sms: usize) -> usize {
    if staged {
        items.min(sms.max(1))
    } else {
        items
    }
}

/// Dynamic shared memory of `kda_chunk_state` in `bv` value columns per CTA ([`BV`] or
/// [`BV_NARROW`]), bytes: its `sS` and `sN` arrays (rows of `bv + 8` floats) and one chunk's
/// scratch copied in (`tW`, `tK`: `BT` rows of [`sk`]; `tU`: `BT` rows of `bv`; `tG`: `k`).
pub(crate) fn state_smem(k: usize, bv: usize) -> usize {
    4 * ((k + BT) * (bv + 8) + 2 * BT * sk(k) + BT * bv + k)
}

/// Dynamic shared memory of `kda_chunk_out`, bytes: its `sS` and `sN` arrays (rows of `OBV +
/// 8` floats), `tQ` (`BT` rows of `k` rounded up to 4, plus 4) and `tA` (`BT` rows of `BT + 4`).
pub(crate) fn out_smem(k: usize) -> usize {
    let ck = ck(k);
    4 * ((k + BT) * (OBV + 8) + BT * ck + BT * (BT + 4))
}

/// `kda_chunk_state` CTAs per (piece, value head) in `bv` value columns each.
pub(crate) fn vblocks(v: usize, bv: usize) -> usize {
    v.div_ceil(bv)
}

/// The value columns per `kda_chunk_state` CTA for a window of `pieces` pieces of `hv` value
/// heads of width `v` on `sms` multiprocessors: [`BV_NARROW`] where the narrow CTAs number no
/// more than the multiprocessors, each then on one of its own; else [`BV`]. A chunk of the chain
/// takes about as long as its CTA's work on its multiprocessor (sixtieth session: not its
/// warps' latency), so halving each CTA's columns shortens the chain where multiprocessors
/// would otherwise idle: one sequence at 12 heads, 1.22-1.29x faster prefills on an H100. Where
/// two narrow CTAs share an SM (one sequence of 2048 tokens or more at 32 heads) they ran
/// 2.3-2.9% slower than one wide one, and where the wide ones fill the SMs 3-6% slower; at the
/// rule's edge (three or four sequences at 12 heads) the wide pass it takes ran up to 1.9%
/// slower (sixty-first session).
pub(crate) fn state_columns(pieces: usize, hv: usize, v: usize, sms: usize) -> usize {
    if pieces * hv * vblocks(v, BV_NARROW) <= sms {
        BV_NARROW
    } else {
        BV
    }
}

/// `kda_chunk_out` CTAs per (chunk, value head).
pub(crate) fn out_vblocks(v: usize) -> usize {
    v.div_ceil(OBV)
}

/// Scratch floats of one (chunk, value head) block: w and k exp(Gc_last - Gc) (BT rows of
/// [`sk`] each, as `kda_chunk_state` holds them in shared memory: one copy each), q exp(Gc)
/// (BT x K), u (BT x V; then v_new), Aqk (BT x BT), exp(Gc_last) (K), the state at the chunk's
/// start (K x V).
pub(crate) fn block_floats(k: usize, v: usize) -> usize {
    2 * BT * sk(k) + BT * k + BT * v + BT * BT + k + k * v
}

/// `CK` of `kda_chunk.cu`: the row stride, in floats, of K-wide rows in shared memory (16-byte
/// rows, row j at bank 4 j).
pub(crate) fn ck(k: usize) -> usize {
    k.next_multiple_of(4) + 4
}

/// `SK` of `kda_chunk.cu`: the row stride, in floats, of w and k exp(Gc_last - Gc) in the
/// scratch and in `kda_chunk_state`'s shared memory. `k` where `k % 32 == 0` (dense rows whose
/// 16-byte pieces the kernels permute, `swz`), else [`ck`].
pub(crate) fn sk(k: usize) -> usize {
    if k.is_multiple_of(32) {
        k
    } else {
        ck(k)
    }
}

/// The scratch of a window of `chunks` chunks: the element offset of each region in one f32
/// allocation (each a multiple of 4 floats for `k % 4 == 0`, `v % 8 == 0`), and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ScratchLayout {
    pub w: usize,
    pub qg: usize,
    pub kg: usize,
    pub u: usize,
    pub aqk: usize,
    pub gl: usize,
    pub hs: usize,
    pub carry: usize,
    /// Floats in all.
    pub floats: usize,
}

impl ScratchLayout {
    /// The regions for `chunks` chunks of `hv` value heads of `k` x `v`, and the carry.
    pub(crate) fn new(chunks: usize, hv: usize, k: usize, v: usize) -> Self {
        let blocks = chunks * hv;
        let w = 0;
        let qg = w + blocks * BT * sk(k);
        let kg = qg + blocks * BT * k;
        let u = kg + blocks * BT * sk(k);
        let aqk = u + blocks * BT * v;
        let gl = aqk + blocks * BT * BT;
        let hs = gl + blocks * k;
        let carry = hs + blocks * k * v;
        Self {
            w,
            qg,
            kg,
            u,
            aqk,
            gl,
            hs,
            carry,
            floats: carry + hv * k * v,
        }
    }
}

/// One window: its chunks (first token, tokens) and pieces (first chunk of the window,
/// chunks, sequence, flags), as the kernels read them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Window {
    pub chunks: Vec<[u32; 2]>,
    pub pieces: Vec<[u32; 4]>,
}

/// The call's sequences (token offsets `bounds`, N + 1 of them) cut into chunks of at most
/// [`BT`] tokens, packed in order into windows of at most `max_chunks` chunks (at least 1).
/// A sequence that does not end in a window continues in the next one, which then starts with
/// it: so at most one sequence is open across a window's end (the carry holds its state).
/// Sequences of no tokens have no piece (their state is left as it is), unless `keep_empty` (a
/// pool with a ring, where such a sequence's pending entries are still folded and its state
/// stored): then a piece of no chunks in the window that is open at that point.
pub(crate) fn windows(bounds: &[usize], max_chunks: usize, keep_empty: bool) -> Vec<Window> {
    let max_chunks = max_chunks.max(1);
    let mut out: Vec<Window> = Vec::new();
    let mut cur = Window::default();
    for (seq, b) in bounds.windows(2).enumerate() {
        let (start, end) = (b[0], b[1]);
        if start == end && keep_empty {
            cur.pieces
                .push([cur.chunks.len() as u32, 0, seq as u32, FROM_SLOT | TO_SLOT]);
        }
        let mut tok = start;
        while tok < end {
            if cur.chunks.len() == max_chunks {
                out.push(std::mem::take(&mut cur));
            }
            // a new piece where the window has none of this sequence yet
            let first_chunk = cur.chunks.len() as u32;
            let from_slot = if tok == start { FROM_SLOT } else { 0 };
            let mut n = 0u32;
            while tok < end && cur.chunks.len() < max_chunks {
                let len = (end - tok).min(BT);
                cur.chunks.push([tok as u32, len as u32]);
                tok += len;
                n += 1;
            }
            let to_slot = if tok == end { TO_SLOT } else { 0 };
            cur.pieces
                .push([first_chunk, n, seq as u32, from_slot | to_slot]);
        }
    }
    if !cur.pieces.is_empty() {
        out.push(cur);
    }
    out
}

/// Chunks per window for a scratch budget of `budget_bytes` (at least one).
pub(crate) fn max_chunks(budget_bytes: usize, hv: usize, k: usize, v: usize) -> usize {
    (budget_bytes / (4 * hv.max(1) * block_floats(k, v))).max(1)
}

/// Whether the chunked kernels are expected to prefill a call of `hv` value heads of width `v`
/// over the sequences of `bounds` faster than `kda_step`'s token loop on a device of `sms`
/// multiprocessors ([`crate::PrefillKernel::ByShape`], the default). A cost model fitted to
/// the sixty-first session's rows (its second call, an H100; docs/performance.md; K = V = 128):
/// the token loop costs its longest sequence's tokens times a step that grows with the
/// (sequence, head) pairs run side by side, one more step per wave of [`PAIRS_PER_WAVE`] pairs
/// (32 x 256 at 12 heads, 384 pairs, steps twice as long as 8 x 4096, 96 pairs: sixtieth
/// session); the chunked kernels cost a fixed part, the preparation and outputs of every
/// (chunk, head) block, and the state pass: the longer of its chain (the longest sequence's
/// chunks, one after another, each shorter where the pass runs narrow: [`state_columns`]) and
/// its throughput over every block. Within 6.5% of every chunked row, it picks chunked for
/// every row measured: one sequence of 256 tokens or more (3-15x faster), 32 x 256 and 8 x 4096
/// at 12 heads (1.3x and 2.3x) and at 32 heads (8 x 4096 1.07x; 32 x 256 a tie, 0.3%); the
/// token loop for sequences of a few tokens (a chunked call costs its three launches and a
/// chunk's preparation at least).
pub(crate) fn prefer_chunked(bounds: &[usize], hv: usize, v: usize, sms: usize) -> bool {
    /// The token loop: us per token step, plus per (sequence, head) pair of a wave, per wave.
    const STEP_US: f64 = 1.15;
    const STEP_US_PER_PAIR: f64 = 0.003;
    /// The chunked kernels: fixed us per call; us per (chunk, head) block of the preparation
    /// and outputs, and of the state pass; us per chunk of the state pass's chain, in 32 value
    /// columns per CTA and in 16 (ncu: 2.96 us per chunk at 1 x 2048, 12 heads).
    const CHUNK_FIXED_US: f64 = 24.0;
    const PREP_BLOCK_US: f64 = 0.293;
    const STATE_BLOCK_US: f64 = 0.158;
    const STATE_CHAIN_US: f64 = 5.0;
    const STATE_CHAIN_NARROW_US: f64 = 2.96;
    let lens = bounds.windows(2).map(|b| b[1] - b[0]);
    let (n, longest) = (
        bounds.len().saturating_sub(1),
        lens.clone().max().unwrap_or(0),
    );
    let pairs = n * hv;
    let blocks = (lens.map(|l| l.div_ceil(BT)).sum::<usize>() * hv) as f64;
    let step = STEP_US + STEP_US_PER_PAIR * pairs.min(PAIRS_PER_WAVE) as f64;
    let steps = longest as f64 * step * pairs.div_ceil(PAIRS_PER_WAVE).max(1) as f64;
    let per_chunk = if state_columns(n, hv, v, sms) == BV_NARROW {
        STATE_CHAIN_NARROW_US
    } else {
        STATE_CHAIN_US
    };
    let chain = longest.div_ceil(BT) as f64 * per_chunk;
    let chunked = CHUNK_FIXED_US + blocks * PREP_BLOCK_US + chain.max(blocks * STATE_BLOCK_US);
    chunked < steps
}

/// (sequence, head) pairs the token loop runs in one wave on a device of 132 SMs (its steps
/// are about twice as long from 264 to 528: the sixtieth session's rows).
pub(crate) const PAIRS_PER_WAVE: usize = 264;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn two_byte_inputs_of_the_production_heads_are_staged_on_one_cta_per_sm() {
        assert!(prep_staged(2, 128, 128));
        assert!(prep_staged(2, 64, 64));
        assert!(!prep_staged(4, 128, 128), "f32 rows do not fit sK and sG");
        assert!(
            !prep_staged(2, 256, 128),
            "more than 16 elements per thread and array"
        );
        assert!(
            !prep_staged(2, 32, 48),
            "v wider than k: g and v do not fit sG"
        );
        assert_eq!(prep_ctas(512 * 12, true, 132), 132);
        assert_eq!(prep_ctas(4 * 12, true, 132), 48, "no more CTAs than items");
        assert_eq!(prep_ctas(512 * 12, false, 132), 512 * 12);
    }

    #[test]
    fn the_production_heads_fit_and_odd_widths_fall_back() {
        let h200 = 232_448;
        assert!(chunk_supported(128, 128, h200));
        assert!(chunk_supported(32, 48, h200));
        assert_eq!(prep_smem(128, 128), 201_216);
        assert_eq!(solve_stride(128, 128, 128), 144);
        assert_eq!(solve_stride(48, 48, 48), 80);
        assert_eq!(solve_stride(40, 32, 40), 44, "V % 16 != 0: rows of V + 4");
        assert!(!chunk_supported(30, 48, h200), "K not a multiple of 16");
        assert!(!chunk_supported(32, 44, h200), "V not a multiple of 8");
        assert!(
            !chunk_supported(256, 256, 101_376),
            "too much shared memory"
        );
        assert_eq!(vblocks(128, BV), 4);
        assert_eq!(vblocks(48, BV), 2);
        assert_eq!(vblocks(48, BV_NARROW), 3);
        assert_eq!(vblocks(40, BV_NARROW), 3);
        assert_eq!(state_smem(128, BV), 104_960);
        assert_eq!(state_smem(128, BV_NARROW), 88_576);
        for bv in [BV, BV_NARROW] {
            assert!(
                2 * (state_smem(128, bv) + 2368 + 1024) <= 233_472,
                "two kda_chunk_state CTAs per SM of 228 KiB ({bv} columns, with the ring fold's \
                 static shared memory)"
            );
        }
        assert_eq!(
            state_smem(32, BV),
            4 * ((32 + BT) * (BV + 8) + 2 * BT * 32 + BT * BV + 32)
        );
        assert_eq!(
            state_smem(48, BV),
            4 * ((48 + BT) * (BV + 8) + 2 * BT * 52 + BT * BV + 48)
        );
        assert_eq!(out_smem(128), 106_496);
        assert_eq!(out_vblocks(128), 2);
        assert_eq!(out_vblocks(48), 1);
    }

    #[test]
    fn the_state_pass_narrows_only_where_wide_ctas_leave_multiprocessors_idle() {
        // one sequence on 132 SMs: 96 narrow CTAs at 12 heads, 256 at 32 heads
        assert_eq!(state_columns(1, 12, 128, 132), BV_NARROW);
        assert_eq!(state_columns(1, 32, 128, 132), BV);
        // many: 8 x 12 heads
        assert_eq!(state_columns(8, 12, 128, 132), BV);
        // the edge: 128 narrow CTAs, then 136
        assert_eq!(state_columns(17, 1, 128, 132), BV);
        assert_eq!(state_columns(16, 1, 128, 132), BV_NARROW);
        assert_eq!(state_columns(1, 1, 48, 2), BV);
    }

    #[test]
    fn scratch_regions_follow_one_another_aligned() {
        let l = ScratchLayout::new(3, 2, 32, 48);
        let blocks = 6;
        assert_eq!(l.qg, blocks * BT * 32);
        assert_eq!(l.kg - l.qg, blocks * BT * 32);
        assert_eq!(l.u - l.kg, blocks * BT * 32);
        assert_eq!(l.aqk - l.u, blocks * BT * 48);
        assert_eq!(l.gl - l.aqk, blocks * BT * BT);
        assert_eq!(l.hs - l.gl, blocks * 32);
        assert_eq!(l.carry - l.hs, blocks * 32 * 48);
        assert_eq!(l.floats - l.carry, 2 * 32 * 48);
        for off in [l.w, l.qg, l.kg, l.u, l.aqk, l.gl, l.hs, l.carry] {
            assert_eq!(off % 4, 0, "16-byte aligned region");
        }
        assert_eq!(
            block_floats(32, 48),
            3 * BT * 32 + BT * 48 + BT * BT + 32 + 32 * 48
        );
        // K % 32 != 0: w and k exp(Gc_last - Gc) in rows of CK
        let l = ScratchLayout::new(3, 2, 48, 48);
        assert_eq!(l.qg, blocks * BT * 52);
        assert_eq!(l.kg - l.qg, blocks * BT * 48);
        assert_eq!(l.u - l.kg, blocks * BT * 52);
        assert_eq!(
            block_floats(48, 48),
            2 * BT * 52 + BT * 48 + BT * 48 + BT * BT + 48 + 48 * 48
        );
    }

    #[test]
    fn one_long_sequence_prefills_chunked_and_many_short_ones_token_by_token() {
        let seqs = |n: usize, l: usize| (0..=n).map(|i| i * l).collect::<Vec<_>>();
        let chunked = |n: usize, l: usize, hv: usize| prefer_chunked(&seqs(n, l), hv, 128, 132);
        // the sixty-first session's rows: chunked 3-15x faster, or (8 x 4096 at 12 heads) 2.3x,
        // (32 x 256 at 12 heads) 1.3x, (8 x 4096 at 32 heads) 1.07x
        for (n, l, hv) in [
            (1, 256, 12),
            (1, 2048, 12),
            (1, 32768, 12),
            (8, 4096, 12),
            (32, 256, 12),
            (1, 256, 32),
            (1, 2048, 32),
            (1, 32768, 32),
            (8, 4096, 32),
        ] {
            assert!(chunked(n, l, hv), "{n} x {l} at {hv} heads");
        }
        // a few tokens: the token loop (a chunked call costs its three launches at least)
        assert!(!chunked(1, 16, 12));
        assert!(!chunked(256, 16, 12));
        assert!(!prefer_chunked(&[0, 0], 12, 128, 132), "no tokens");
        assert!(!prefer_chunked(&[0], 12, 128, 132), "no sequences");
    }

    #[test]
    fn the_default_budget_holds_a_19k_token_prefill_of_12_heads_in_one_window() {
        let m = max_chunks(DEFAULT_SCRATCH_BYTES, 12, 128, 128);
        assert!(m >= 300, "{m}");
        assert_eq!(max_chunks(0, 12, 128, 128), 1, "at least one chunk");
    }

    #[test]
    fn a_long_sequence_continues_through_the_carry() {
        let w = windows(&[0, 200, 200, 210], 2, false);
        // 200 tokens: chunks of 64, 64, 64, 8; then 10 tokens
        assert_eq!(w.len(), 3);
        assert_eq!(w[0].chunks, vec![[0, 64], [64, 64]]);
        assert_eq!(w[0].pieces, vec![[0, 2, 0, FROM_SLOT]]);
        assert_eq!(w[1].chunks, vec![[128, 64], [192, 8]]);
        assert_eq!(w[1].pieces, vec![[0, 2, 0, TO_SLOT]]);
        // the empty sequence 1 has no piece
        assert_eq!(w[2].chunks, vec![[200, 10]]);
        assert_eq!(w[2].pieces, vec![[0, 1, 2, FROM_SLOT | TO_SLOT]]);
        // with a ring it has one of no chunks (its pending entries folded, its state stored),
        // in the window open when it comes (here the full second one)
        let w = windows(&[0, 200, 200, 210], 2, true);
        assert_eq!(
            w[1].pieces,
            vec![[0, 2, 0, TO_SLOT], [2, 0, 1, FROM_SLOT | TO_SLOT]]
        );
        assert_eq!(w[2].pieces, vec![[0, 1, 2, FROM_SLOT | TO_SLOT]]);
        // a call of empty sequences only: one window of pieces and no chunks
        let w = windows(&[0, 0, 0], 4, true);
        assert_eq!(w.len(), 1);
        assert!(w[0].chunks.is_empty());
        assert_eq!(w[0].pieces.len(), 2);
        assert!(windows(&[0, 0, 0], 4, false).is_empty());
    }

    proptest! {
        /// Every token lies in exactly one chunk, in order; chunks hold 1..=BT tokens of one
        /// sequence; a window has at most `max` chunks; each sequence's pieces cover its chunks
        /// in order, the first from the slot, the last to it, the others through the carry;
        /// only a window's first piece may start from the carry and only its last may end in
        /// it.
        #[test]
        fn windows_cover_every_token_once_in_order(
            lens in proptest::collection::vec(0usize..300, 0..8),
            max in 1usize..12,
            keep_empty in proptest::bool::ANY,
        ) {
            let mut bounds = vec![0usize];
            for l in &lens {
                bounds.push(bounds.last().unwrap() + l);
            }
            let ws = windows(&bounds, max, keep_empty);
            let mut next_tok = 0usize;
            let mut open: Option<u32> = None;
            let mut seen = vec![0usize; lens.len()];
            let mut empties = 0;
            for w in &ws {
                prop_assert!(!w.pieces.is_empty() && w.chunks.len() <= max);
                let mut covered = 0u32;
                for (pi, p) in w.pieces.iter().enumerate() {
                    let [c0, n, seq, flags] = *p;
                    prop_assert_eq!(c0, covered, "pieces tile the window's chunks");
                    if n == 0 {
                        // an empty sequence of a pool with a ring: from and to its slot
                        prop_assert!(keep_empty && lens[seq as usize] == 0);
                        prop_assert_eq!(flags, FROM_SLOT | TO_SLOT);
                        empties += 1;
                        continue;
                    }
                    covered += n;
                    let s = seq as usize;
                    prop_assert_eq!(flags & FROM_SLOT == 0, open == Some(seq));
                    if flags & FROM_SLOT == 0 {
                        prop_assert_eq!(pi, 0, "only the first piece starts from the carry");
                    }
                    for c in &w.chunks[c0 as usize..(c0 + n) as usize] {
                        let [t0, len] = *c;
                        // skip empty sequences in the running token count
                        prop_assert_eq!(t0 as usize, next_tok.max(bounds[s]));
                        prop_assert!(len >= 1 && len as usize <= BT);
                        prop_assert!(t0 as usize >= bounds[s] && (t0 + len) as usize <= bounds[s + 1]);
                        next_tok = (t0 + len) as usize;
                        seen[s] += len as usize;
                    }
                    if flags & TO_SLOT != 0 {
                        prop_assert_eq!(next_tok, bounds[s + 1]);
                        open = None;
                    } else {
                        prop_assert_eq!(pi, w.pieces.len() - 1, "only the last piece stays open");
                        open = Some(seq);
                    }
                }
                prop_assert_eq!(covered as usize, w.chunks.len());
            }
            prop_assert_eq!(open, None);
            prop_assert_eq!(empties, if keep_empty { lens.iter().filter(|&&l| l == 0).count() } else { 0 });
            prop_assert_eq!(seen, lens);
        }
    }
}
