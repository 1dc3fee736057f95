//! The eager-decode launch plan ([`eager_plan`]): which eager kernel runs a call and with how
//! many warps, stages and bytes of shared memory, a pure function of the call's shape. Each
//! default is a choice measured on the H200 (docs/performance.md names the session).

use super::lanes::{lanes_k, tile_fits, warp_columns};
use super::registry::TileMove;
use crate::choice::EagerKernel;

/// Pipeline stages of the pipelined eager kernel unless set.
const DEFAULT_EAGER_STAGES: usize = 2;

/// Items per CTA from which fp32 and 2-byte V-first pools take three stages, although the
/// third stage costs them a CTA per SM (H200 sweep, docs/performance.md, twelfth session:
/// 1-4% faster from about 4 items per 3-stage CTA; from 1 to 3, quantised rounds make it up to
/// 14% slower or 11% faster).
const THREE_STAGES_FROM_ITEMS_PER_CTA: usize = 4;

/// Shared memory the driver reserves per CTA (sm_80 and later), bytes.
const SMEM_RESERVED_PER_CTA: usize = 1024;

/// What decides whether and how the pipelined eager kernel runs.
#[derive(Debug, Clone, Copy)]
pub(super) struct EagerShape {
    pub(super) k: usize,
    pub(super) v: usize,
    pub(super) state_size: usize,
    pub(super) input_size: usize,
    pub(super) smem_optin: usize,
    pub(super) fixed_warps: Option<usize>,
    /// Pipeline stages asked for (2 or 3; `None`: the default).
    pub(super) stages: Option<usize>,
    /// Value heads of the call (sequences x value heads).
    pub(super) heads: usize,
    /// Whether the pool is V-first.
    pub(super) v_first: bool,
    /// Multiprocessors of the device.
    pub(super) num_sms: usize,
    /// The kernel asked for (`None`: the plan's choice).
    pub(super) kernel: Option<EagerKernel>,
    /// Whether the device has bulk copies (`cp.async.bulk`, sm_90 and later), which the plan's
    /// own choice takes only then.
    pub(super) bulk: bool,
}

/// Value heads of a call from which a 2-byte K-first pool decodes a whole head per CTA
/// (8 warps at V = 128), so its tile is one contiguous block (H200 sweeps, docs/performance.md:
/// 5-12% faster from 1536 heads; 0.2-1% slower at 1280-1344, up to 5% below; fourteenth
/// session).
const WHOLE_HEAD_FROM: usize = 1536;

/// A launch of an eager kernel: the pipelined one, or a tile kernel (`tile`: `kda_eager_tile`,
/// `kda_eager_tile_staged`, `kda_eager_tile_bulk`, `kda_eager_tile_bulk_in` or
/// `kda_eager_tile_stream`), which runs the same items (warps, column blocks) one per CTA, or
/// the bulk pipe (`kda_eager_bulk_pipe`: whole heads, persistent CTAs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct EagerPlan {
    pub(super) warps: usize,
    pub(super) vblocks: usize,
    /// Pipeline stages (2 or 3); the bulk pipe's buffers per CTA.
    pub(super) stages: usize,
    /// Dynamic shared memory, bytes: the pipelined kernel's stages, a staged or bulk tile
    /// kernel's tile (K x its columns; `bulk_tile_bytes`), none for `kda_eager_tile`, the bulk
    /// pipe's buffers (`pipe_buffer_bytes` each, and `PIPE_ALIGN`).
    pub(super) smem: usize,
    /// Whether the updated tile goes back out through its stage (written there, then copied
    /// out in whole 16-byte chunks: `kda_eager_stage`) rather than from registers (`kda_eager`).
    pub(super) stage_store: bool,
    /// `Some`: a tile kernel runs the items instead (one per CTA), moving its tile this way.
    pub(super) tile: Option<TileMove>,
    /// Whether a tile kernel in a dependent launch loads its tile from the slot it read before
    /// its wait (for the L2 prefetch) instead of reading it again after the wait
    /// (`slot_once_for`).
    pub(super) slot_once: bool,
}

/// Value heads of a call for which a 2-byte K-first pool's tile kernel reads its slot again
/// after a dependent launch's wait (H200, docs/performance.md, seventeenth session: reading it
/// once was up to 4% slower at 192-1024 heads (11 of 12 rows), 1-5% faster below and from
/// 1536).
const SLOT_AGAIN_2_BYTE_K_FIRST: std::ops::Range<usize> = 192..WHOLE_HEAD_FROM;

/// Whether a tile kernel moving its tile by `tile` loads it from the slot read before a
/// dependent launch's wait. H200 (docs/performance.md, seventeenth session): the read after the
/// wait put an L2 round trip into every CTA's chain (ncu: 15-16% of the stall samples at 8192
/// heads); reading once was up to 6% faster on V-first pools (every size), fp32 K-first pools
/// without bulk copies and 2-byte K-first pools outside `SLOT_AGAIN_2_BYTE_K_FIRST`. fp32
/// K-first bulk tiles (whole heads, their bulk copies then right behind the L2 prefetch of the
/// same 64 KB) were 1-7% slower.
fn slot_once_for(e: &EagerShape, tile: Option<TileMove>) -> bool {
    let bulk = matches!(
        tile,
        Some(TileMove::Bulk | TileMove::BulkIn | TileMove::Stream)
    );
    e.v_first
        || match e.state_size {
            2 => !SLOT_AGAIN_2_BYTE_K_FIRST.contains(&e.heads),
            _ => !bulk,
        }
}

/// Items per SM up to which a 2-byte K-first pool decodes with `kda_eager_tile` (H200 sweep,
/// docs/performance.md, thirteenth session: up to 11% faster up to about 4 items per SM,
/// 1-14% slower from about 8).
const TILE_2_BYTE_K_FIRST_ITEMS_PER_SM: usize = 4;

/// Items per SM up to which a 2-byte K-first pool's `kda_eager_tile` copies its tile in
/// through shared memory (`kda_eager_tile_staged`; H200, docs/performance.md, fourteenth
/// session: 4-9% faster at 24 to 192 items, 5% slower at 512).
const STAGED_2_BYTE_K_FIRST_ITEMS_PER_SM: usize = 2;

/// Bytes of a tile row from which a 2-byte K-first pool writes its updated tile back through
/// the stage (8 warps at V = 128). H200 A/B (docs/performance.md, sixth session): 5-11% faster
/// with rows of 256 bytes, 6-9% slower with rows of 128 bytes (4 warps) and at N = 1.
const STAGE_STORE_ROW_BYTES: usize = 256;

/// Dynamic shared memory of `kda_eager_tile_bulk`'s tile of `cw` columns, bytes: V-first the
/// tile as in the pool; K-first its rows, each lane group's shifted by a warp's columns
/// (`bulk_row` in `kernels/kda_decode.cu`).
fn bulk_tile_bytes(k: usize, cw: usize, v_first: bool, state_size: usize) -> usize {
    let shifts = if v_first {
        0
    } else {
        lanes_k(k) * warp_columns(k)
    };
    (k * cw + shifts) * state_size
}

/// Value heads of a call from which eager decode moves its state tiles in and out by bulk copies
/// (`kda_eager_tile_bulk`) on a device that has them: K-first pools a whole head per CTA (8
/// warps at V = 128, the head's rows as one block per lane group), fp32 V-first pools 4-warp
/// tiles (one block each). H200 sweep (docs/performance.md, sixteenth session): 2-7% faster
/// from 512 heads (fp32 V-first 2-4%, fp32 K-first 3-5%, 2-byte K-first 4-7%); at 384 heads
/// fp32 K-first was 7% slower. 2-byte V-first pools keep `kda_eager_tile` from here (2-4%
/// faster than bulk copies).
const BULK_FROM: usize = 512;

/// Value heads of a call from which a V-first pool copies its tile in by bulk copies and stores
/// it from registers (`kda_eager_tile_bulk_in`), up to `BULK_FROM` (H200 sweep,
/// docs/performance.md, sixteenth session: 1-14% faster at 192-384 heads for fp32 and 2-byte
/// pools, mixed below).
const BULK_IN_V_FIRST_FROM: usize = 192;

/// Value heads of a call from which a 2-byte K-first pool keeps its whole-head bulk tiles in
/// shared memory through the token step (`kda_eager_tile_stream`: 40 registers, 5 CTAs per SM,
/// against `kda_eager_tile_bulk`'s 115 and 2). H200 sweep (docs/performance.md, twenty-second
/// session): 0.5-5% faster from 1920 heads (the more heads, the more), mostly slower at
/// 384-1536 (up to 18%) and 1.7x slower at N = 1. fp32 and V-first pools were 2-22% slower
/// with it at every size from N = 16. Below 2272 heads `kda_eager_bulk_pipe` runs instead
/// ([`PIPE_2_BYTE_K_FIRST`]); pools of K = V = 128 take `kda_eager_regs` up to 8192 heads
/// ([`REGS_2_BYTE_K_FIRST`]).
const STREAM_2_BYTE_K_FIRST_FROM: usize = 2272;

/// CTAs of `kda_eager_tile_stream` per SM at most: where more would fit (2-byte K-first tiles
/// of K = V = 128 fit 6 times in the H200's 228 KB), the launch asks for more shared memory
/// than the tile needs. H200 (docs/performance.md, forty-third session): 5 CTAs 0.5-1.5%
/// faster than 6 at every 2-byte size measured from 2560 to 32768 heads (fp16 and bf16, H 12
/// and 32), 4 within 0.3% of 5 there and 6-7% slower at 768 heads, 3 CTAs 2.6-3.6% slower
/// than 6, 2 CTAs about 20%.
pub(super) const STREAM_CTAS_PER_SM: u32 = 5;

/// Bytes of one buffer of `kda_eager_bulk_pipe` (`PipeBuffer` in `kernels/kda_decode.cu`): a
/// whole head's bulk tile, the key, query, gate and value rows, the gate biases and 16 bytes of
/// scalars, rounded up to 128.
fn pipe_buffer_bytes(e: &EagerShape) -> usize {
    let r16 = |x: usize| x.div_ceil(16) * 16;
    let tile = r16(bulk_tile_bytes(e.k, e.v, e.v_first, e.state_size));
    let rows = 3 * r16(e.k * e.input_size) + r16(e.v * e.input_size) + r16(e.k * 4) + 16;
    (tile + rows).div_ceil(128) * 128
}

/// Bytes `kda_eager_bulk_pipe` may skip to start its buffers on a 128-byte boundary (with
/// buffers only 16-byte aligned its bulk copies measured 10-20% slower on the H200,
/// docs/performance.md, thirty-first session).
const PIPE_ALIGN: usize = 128;

/// Step groups of 8 warps per `kda_eager_bulk_pipe` CTA (`PIPE_MAX_GROUPS` in
/// `kernels/kda_decode.cu`): with one the step was the bottleneck (H200: 3 us a 2-byte head),
/// three of them keep up with the loads (thirty-first session).
const PIPE_GROUPS: usize = 3;

/// Threads of a `kda_eager_bulk_pipe` CTA: the step groups, the loader warp and the storer warp.
pub(super) const PIPE_THREADS: usize = (8 * PIPE_GROUPS + 2) * 32;

/// Most buffers per `kda_eager_bulk_pipe` CTA (`PIPE_MAX_BUFFERS` in the kernel is 8): six of a
/// 2-byte head fill an H200 SM's shared memory.
const PIPE_BUFFERS: usize = 6;

/// Static shared memory of `kda_eager_bulk_pipe`, bytes: three barriers per buffer (up to 8
/// buffers) and each step group's activated key, decay, query (rows of `padded_k`), values and
/// beta.
fn pipe_static_smem(e: &EagerShape) -> usize {
    3 * 8 * 8 + PIPE_GROUPS * ((3 * padded_k(e.k, e.v_first) + e.v.next_multiple_of(4)) * 4 + 4)
}

/// Length of a row of per-row values (key, decay, query) that `kda_eager_bulk_pipe`'s step
/// reads (`KP` in `kernels/kda_decode.cu`): for K-first pools four words of padding after each
/// lane group's rows, so that the lane groups' 16-byte loads hit different banks.
fn padded_k(k: usize, v_first: bool) -> usize {
    if v_first {
        return k.next_multiple_of(4);
    }
    // the kernel's TK (rows per lane)
    let lk = lanes_k(k);
    let tk = k.div_ceil(lk);
    (lk * tk + 4 * lk).next_multiple_of(4)
}

/// Buffers of `kda_eager_bulk_pipe` at this shape: up to `PIPE_BUFFERS` of them that fit shared
/// memory, a multiple of `PIPE_GROUPS` (a step group's wait on a buffer's barrier must find the
/// buffer's previous phase completed, by its own earlier item there) and at least two; `None`
/// where that leaves none, or without bulk copies, or where one CTA's columns (`cw`) are not a
/// whole head.
fn pipe_buffers(e: &EagerShape, cw: usize) -> Option<usize> {
    if !e.bulk || cw != e.v {
        return None;
    }
    let fit = e
        .smem_optin
        .saturating_sub(pipe_static_smem(e) + PIPE_ALIGN)
        / pipe_buffer_bytes(e);
    let b = PIPE_BUFFERS.min(fit);
    Some(b - b % PIPE_GROUPS).filter(|&b| b >= 2)
}

/// Value heads of a call for which a 2-byte K-first pool decodes with `kda_eager_bulk_pipe`
/// (H200, docs/performance.md, thirty-first session: 1.6-11% faster at 384 to 1536 heads than
/// `kda_eager_tile_bulk_in` (384) and `kda_eager_tile_bulk` (512-1536), the sixteenth session's
/// choices there; level at 2048, 4-6% slower from 3072, where `kda_eager_tile_stream` stays).
/// With its step's rows padded against bank conflicts (forty-first session) it was 2-4% faster
/// and was the faster of the two up to 2560 heads. Against the stream kernel at 5 CTAs per SM
/// (forty-fourth session, H 32 at 1920-2560 heads in steps of 32, fp16 and bf16) it stays
/// 0.4-2.8% faster up to 2176 heads (within 0.2% at 2208, 0.7% at 2240) and is slower on
/// average at 2272-2528 (fp16 0.1%, bf16 0.8%; per size -0.5..+0.9% and -0.2..+2.1%), at H 12
/// from 2280 heads by 0.99% (fp16) and 0.68% (bf16). Pools of K = V = 128 take
/// `kda_eager_regs` from 1536 heads instead ([`REGS_2_BYTE_K_FIRST`]).
const PIPE_2_BYTE_K_FIRST: std::ops::Range<usize> = 384..STREAM_2_BYTE_K_FIRST_FROM;

/// Whether `kda_eager_regs` takes the shape: K-first pools with K = V = 128 (its lane mapping,
/// `REGS_OK` in `kernels/kda_decode.cu`), whole heads per CTA (8 warps).
fn regs_fits(e: &EagerShape) -> bool {
    !e.v_first && e.k == 128 && e.v == 128
}

/// Value heads of a call for which a 2-byte K-first pool of K = V = 128 decodes with
/// `kda_eager_regs` (a whole head per CTA in registers, 3 CTAs per SM) instead of the bulk
/// pipe or the stream kernel. H200 (docs/performance.md, forty-seventh session, fp16 and bf16,
/// best of two rounds): 2.1-5.2% faster than the default at 1536-4096 heads (H 12 N 256: 55.0
/// against 56.9 us), 0.1-2.0% at 4608-7680, level at 8192 (0.2% slower), 1-7% slower than the
/// bulk pipe at 768-1440 heads. With a whole row per warp access (forty-eighth session, call
/// 4, forced) fp16 pools 1.4-1.8% faster again at 1536-8192 heads (H 32 N 256: 137.4 against
/// 139.3 us), bf16 level; at 8192 fp16 1.2% faster than the stream kernel (call 5), so it
/// takes 8192 heads too. For bf16 pools it holds half of each thread's rows in shared memory
/// at 4 CTAs per SM (`RR`, `REGS_CTAS` in `kernels/kda_decode.cu`; fifty-third session: 1.3-2.0%
/// faster at 3072-8192 heads, 0.4% slower at 1536). (On devices with bulk copies only, where
/// it was measured.)
const REGS_2_BYTE_K_FIRST: std::ops::Range<usize> = 1536..8193;

/// Value heads of a call for which an fp32 K-first pool of K = V = 128 decodes with
/// `kda_eager_regs` (2 CTAs per SM, 104 registers) instead of `kda_eager_tile_bulk`. H200
/// (docs/performance.md, forty-eighth session, best of two rounds): 0.3-3.9% faster at every
/// size measured, 768-8192 heads (H 12 N 64: 28.8 against 30.0 us; H 32 N 256: 265.3 against
/// 266.1). (On devices with bulk copies only, where it was measured.)
const REGS_FP32_K_FIRST: std::ops::Range<usize> = 768..8193;

/// How the plan's own choice moves a tile kernel's tile by bulk copies (or, for
/// [`REGS_2_BYTE_K_FIRST`], in registers) at this shape, if it does.
fn default_bulk_move(e: &EagerShape) -> Option<TileMove> {
    if !e.bulk {
        return None;
    }
    let regs_heads = match e.state_size {
        2 => REGS_2_BYTE_K_FIRST,
        _ => REGS_FP32_K_FIRST,
    };
    if regs_fits(e) && regs_heads.contains(&e.heads) {
        Some(TileMove::Regs)
    } else if e.state_size == 2 && !e.v_first && e.heads >= STREAM_2_BYTE_K_FIRST_FROM {
        Some(TileMove::Stream)
    } else if e.state_size == 2 && !e.v_first && PIPE_2_BYTE_K_FIRST.contains(&e.heads) {
        Some(TileMove::Pipe)
    } else if e.heads >= BULK_FROM && (!e.v_first || e.state_size == 4) {
        Some(TileMove::Bulk)
    } else if e.v_first && (BULK_IN_V_FIRST_FROM..BULK_FROM).contains(&e.heads) {
        Some(TileMove::BulkIn)
    } else {
        None
    }
}

/// The launch of an eager kernel (the pipelined one or `kda_eager_tile`), or `None` where the
/// pipelined kernel's 16-byte copies or its lane mapping do not fit the shape (then `kda_step`
/// runs). Mirrors the constants of `kernels/kda_decode.cu` (LK, TK, RG, WC, `EagerStage`).
pub(super) fn eager_plan(e: &EagerShape) -> Option<EagerPlan> {
    let r16 = |x: usize| x.div_ceil(16) * 16;
    let wc = warp_columns(e.k);
    let inputs_whole = [e.k * e.input_size, wc * e.input_size, e.v * e.input_size]
        .iter()
        .all(|b| b.is_multiple_of(16));
    if !tile_fits(e.k, e.v, e.state_size) || !inputs_whole {
        return None;
    }
    let wph = e.v.div_ceil(wc);
    // 2-byte K-first tiles: 3 stages, and whole heads for big calls (the H200 sweep of
    // docs/performance.md); otherwise 4 warps and 2 stages (best or within 5% of best there)
    let two_byte_kf = e.state_size == 2 && !e.v_first;
    let few = e.heads * wph.div_ceil(4) < e.num_sms;
    // the pipelined kernel whatever the shape: asked for, or stages asked for
    let pipelined = e.kernel == Some(EagerKernel::Pipelined) || e.stages.is_some();
    let bulk = match e.kernel {
        None if !pipelined => default_bulk_move(e),
        _ => None,
    };
    let warps = match e.fixed_warps {
        Some(w) => w.min(wph),
        // K-first bulk copies, the plan's or asked for: whole heads (one block per lane group;
        // row by row only with fixed warps)
        None if (bulk.is_some()
            || matches!(
                e.kernel,
                Some(
                    EagerKernel::BulkTile
                        | EagerKernel::BulkInTile
                        | EagerKernel::StreamTile
                        | EagerKernel::RegsTile
                )
            ))
            && !e.v_first =>
        {
            wph.min(8)
        }
        // the bulk pipe takes whole heads in either layout
        None if e.kernel == Some(EagerKernel::BulkPipe) => wph.min(8),
        None if two_byte_kf && e.heads >= WHOLE_HEAD_FROM => wph.min(8),
        // the pipelined kernel on fp32 pools with fewer 4-warp CTAs than SMs (N = 1): 2 warps,
        // twice the CTAs (the H200 sweep: 4.05 against 4.33 us at H = 12, N = 1); 4 for
        // kda_eager_tile, whose inputs are loaded first only from 4 warps
        None if e.state_size == 4 && few && pipelined => wph.min(2),
        None => wph.min(4),
    };
    let cw = warps * wc;
    let static_smem = (3 * e.k.next_multiple_of(4) + e.v.next_multiple_of(4)) * 4 + 16 + 3 * 32;
    // K-first bulk copies only of whole heads (row by row they measured up to 2x slower), and
    // only where the tile fits shared memory
    let bulk = bulk.filter(|_| {
        (e.v_first || cw == e.v)
            && bulk_tile_bytes(e.k, cw, e.v_first, e.state_size) + static_smem <= e.smem_optin
    });
    let pipe_buffers = pipe_buffers(e, cw);
    // the plan's bulk pipe where its buffers do not fit: the bulk tile kernel of these sizes
    let bulk = bulk.map(|mv| match mv {
        TileMove::Pipe if pipe_buffers.is_none() => TileMove::Bulk,
        mv => mv,
    });
    let stage = r16(e.k * cw * e.state_size)
        + 3 * r16(e.k * e.input_size)
        + r16(cw * e.input_size)
        + r16(e.k * 4)
        + 16;
    // 2-byte K-first: 3 stages, except with fewer 4-warp items than SMs (N = 1), where no CTA
    // has a second item to pipeline: 2 stages measured 0.04-0.05 us faster at H = 12 and equal
    // at H = 32 (docs/performance.md, ninth session). The others: 3 stages from
    // THREE_STAGES_FROM_ITEMS_PER_CTA items per CTA of a 3-stage grid (its CTAs per SM bound
    // by shared memory, the opt-in limit standing for the SM's).
    let items = e.heads * wph.div_ceil(warps);
    let deep_ctas =
        e.num_sms * (e.smem_optin / (3 * stage + static_smem + SMEM_RESERVED_PER_CTA)).max(1);
    let deep = if two_byte_kf {
        !few
    } else {
        items >= THREE_STAGES_FROM_ITEMS_PER_CTA * deep_ctas
    };
    let stages = e
        .stages
        .unwrap_or(if deep { 3 } else { DEFAULT_EAGER_STAGES });
    // kda_eager_tile (one item per CTA, the tile straight into registers) where it measured
    // faster on the H200 (docs/performance.md, thirteenth session), with 4 warps or more (its
    // inputs loaded first) and no stages asked for: fp32 and 2-byte V-first pools (a warp's
    // load fetches 64-byte row or 128-byte column pieces); 2-byte K-first pools (32-byte row
    // pieces) only while a CTA of the pipelined kernel would have little to overlap.
    let tile = match e.kernel {
        Some(
            EagerKernel::Tile
            | EagerKernel::StagedTile
            | EagerKernel::BulkTile
            | EagerKernel::BulkInTile
            | EagerKernel::StreamTile
            | EagerKernel::RegsTile
            | EagerKernel::BulkPipe,
        ) => true,
        _ if bulk.is_some() => true,
        _ => {
            !pipelined
                && warps >= 4
                && (!two_byte_kf || items <= TILE_2_BYTE_K_FIRST_ITEMS_PER_SM * e.num_sms)
        }
    };
    // the tile in through shared memory (whole rows per warp copy): asked for, or small 2-byte
    // K-first calls by default, where it measured faster (docs/performance.md, fourteenth
    // session: 4-9% at 24-192 items, 5% slower at 512)
    let tile = tile.then(|| match (e.kernel, bulk) {
        (Some(EagerKernel::StagedTile), _) => TileMove::Staged,
        (Some(EagerKernel::BulkTile), _) => TileMove::Bulk,
        (Some(EagerKernel::BulkInTile), _) => TileMove::BulkIn,
        (Some(EagerKernel::StreamTile), _) => TileMove::Stream,
        (Some(EagerKernel::RegsTile), _) if regs_fits(e) && cw == e.v => TileMove::Regs,
        (Some(EagerKernel::RegsTile), _) => TileMove::Stream,
        (Some(EagerKernel::BulkPipe), _) if pipe_buffers.is_some() => TileMove::Pipe,
        (Some(EagerKernel::BulkPipe), _) => TileMove::Stream,
        (None, Some(mv)) => mv,
        (None, None) if two_byte_kf && items <= STAGED_2_BYTE_K_FIRST_ITEMS_PER_SM * e.num_sms => {
            TileMove::Staged
        }
        _ => TileMove::Direct,
    });
    [stages, 2]
        .into_iter()
        .find(|&st| st * stage + static_smem <= e.smem_optin)
        .map(|stages| EagerPlan {
            warps,
            vblocks: wph.div_ceil(warps),
            stages: match (tile, pipe_buffers) {
                (Some(TileMove::Pipe), Some(b)) => b,
                _ => stages,
            },
            smem: match tile {
                Some(TileMove::Pipe) => {
                    pipe_buffers.map_or(0, |b| b * pipe_buffer_bytes(e) + PIPE_ALIGN)
                }
                None => stages * stage,
                Some(TileMove::Direct | TileMove::Regs) => 0,
                Some(TileMove::Staged) => r16(e.k * cw * e.state_size),
                Some(TileMove::Bulk | TileMove::BulkIn | TileMove::Stream) => {
                    bulk_tile_bytes(e.k, cw, e.v_first, e.state_size)
                }
            },
            stage_store: two_byte_kf && cw * e.state_size >= STAGE_STORE_ROW_BYTES,
            tile,
            slot_once: tile.is_some() && slot_once_for(e, tile),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `e` with K = V = 64 and `e` with 4 warps asked for: shapes `kda_eager_regs` does not
    /// take (its lane mapping is for whole heads of K = V = 128).
    fn regs_misfits(e: EagerShape) -> [EagerShape; 2] {
        [
            EagerShape { k: 64, v: 64, ..e },
            EagerShape {
                fixed_warps: Some(4),
                ..e
            },
        ]
    }

    /// The H200's limits: 132 SMs, 227 KiB of opt-in shared memory per CTA.
    fn shape(state_size: usize, heads: usize, v_first: bool) -> EagerShape {
        EagerShape {
            k: 128,
            v: 128,
            state_size,
            input_size: 2,
            smem_optin: 232_448,
            fixed_warps: None,
            stages: None,
            heads,
            v_first,
            num_sms: 132,
            kernel: None,
            bulk: false,
        }
    }

    fn plan(e: &EagerShape) -> (usize, usize, usize) {
        let p = eager_plan(e).expect("K = V = 128 takes the pipelined kernel");
        (p.warps, p.vblocks, p.stages)
    }

    #[test]
    fn eager_plan_defaults_follow_the_measured_sweep() {
        // fp32, N = 1 at H = 12: 4 warps for kda_eager_tile; the pipelined kernel 2 warps (48
        // CTAs) rather than 4 (24 CTAs)
        assert_eq!(plan(&shape(4, 12, false)), (4, 2, 2));
        let mut e = shape(4, 12, false);
        e.kernel = Some(EagerKernel::Pipelined);
        assert_eq!(plan(&e), (2, 4, 2));
        // fp32: 4 warps; 3 stages (2 CTAs per SM, 264 CTAs) from 4 items per CTA (1056 items),
        // 2 below
        assert_eq!(plan(&shape(4, 768, false)), (4, 2, 3));
        assert_eq!(plan(&shape(4, 528, false)), (4, 2, 3));
        assert_eq!(plan(&shape(4, 527, false)), (4, 2, 2));
        assert_eq!(plan(&shape(4, 384, true)), (4, 2, 2));
        assert_eq!(plan(&shape(4, 2048, true)), (4, 2, 3));
        // 2-byte K-first: 3 stages; whole heads (8 warps) from 1536 heads
        assert_eq!(plan(&shape(2, 768, false)), (4, 2, 3));
        // 2-byte K-first with fewer 4-warp CTAs than SMs (N = 1): 2 stages
        assert_eq!(plan(&shape(2, 12, false)), (4, 2, 2));
        assert_eq!(plan(&shape(2, 2048, false)), (8, 1, 3));
        assert_eq!(plan(&shape(2, 1536, false)), (8, 1, 3));
        assert_eq!(plan(&shape(2, 1535, false)), (4, 2, 3));
        // 2-byte V-first: 4 warps; 3 stages (4 CTAs per SM, 528 CTAs) from 2112 items
        assert_eq!(plan(&shape(2, 768, true)), (4, 2, 2));
        assert_eq!(plan(&shape(2, 1056, true)), (4, 2, 3));
        assert_eq!(plan(&shape(2, 1055, true)), (4, 2, 2));
        assert_eq!(plan(&shape(2, 3072, true)), (4, 2, 3));
    }

    #[test]
    fn eager_plan_takes_the_tile_kernel_where_it_measured_faster() {
        let tile = |e: &EagerShape| eager_plan(e).expect("plan");
        // fp32 and 2-byte V-first pools at 4 warps and more, whatever the size
        for (size, heads, v_first) in [
            (4, 96, false),
            (4, 8192, false),
            (4, 96, true),
            (2, 12, true),
            (2, 8192, true),
        ] {
            let p = tile(&shape(size, heads, v_first));
            assert_eq!(
                p.tile,
                Some(TileMove::Direct),
                "{size}-byte, {heads} heads, V-first {v_first}"
            );
            assert_eq!(p.smem, 0, "no stages for the tile kernel");
        }
        // fp32 with fewer 4-warp CTAs than SMs (N = 1): 4 warps, the tile kernel
        assert!(tile(&shape(4, 12, false)).tile.is_some());
        // fewer than 4 warps asked for: the pipelined kernel
        let mut e = shape(4, 3072, false);
        e.fixed_warps = Some(2);
        assert!(tile(&e).tile.is_none());
        // 2-byte K-first: up to 4 items per SM (528 items of 2 column blocks: 264 heads), the
        // tile in through shared memory up to 2 per SM (132 heads)
        for (heads, mv) in [
            (12, TileMove::Staged),
            (132, TileMove::Staged),
            (133, TileMove::Direct),
            (264, TileMove::Direct),
        ] {
            let p = tile(&shape(2, heads, false));
            assert_eq!(p.tile, Some(mv), "{heads} heads");
            let smem = if mv == TileMove::Staged {
                128 * 64 * 2
            } else {
                0
            };
            assert_eq!(p.smem, smem, "{heads} heads");
        }
        let p = tile(&shape(2, 265, false));
        assert!(p.tile.is_none());
        assert!(p.smem > 0);
        assert!(tile(&shape(2, 8192, false)).tile.is_none());
        // stages asked for: the pipelined kernel; a kernel asked for: that one
        let mut e = shape(4, 3072, false);
        e.stages = Some(3);
        assert!(tile(&e).tile.is_none());
        e.stages = None;
        e.kernel = Some(EagerKernel::Pipelined);
        assert!(tile(&e).tile.is_none());
        let mut e = shape(4, 12, false);
        e.kernel = Some(EagerKernel::Tile);
        assert!(tile(&e).tile.is_some());
    }

    #[test]
    fn eager_plan_moves_tiles_by_bulk_copies_where_they_measured_faster() {
        let with_bulk = |size, heads, v_first| EagerShape {
            bulk: true,
            ..shape(size, heads, v_first)
        };
        let mv = |e: &EagerShape| eager_plan(e).expect("plan").tile;
        // fp32 K-first pools from 512 heads (K = V = 128: 512-767 and from 8193, the register
        // kernel between): whole heads (8 warps), the rows of each lane group shifted by a
        // warp's columns in shared memory
        for heads in [512, 767, 8193] {
            let p = eager_plan(&with_bulk(4, heads, false)).expect("plan");
            assert_eq!(p.tile, Some(TileMove::Bulk), "{heads} heads");
            assert_eq!((p.warps, p.vblocks), (8, 1));
            assert_eq!(p.smem, (128 * 128 + 8 * 16) * 4);
        }
        assert_ne!(mv(&with_bulk(4, 511, false)), Some(TileMove::Bulk));
        assert_ne!(mv(&with_bulk(4, 384, false)), Some(TileMove::BulkIn));
        // 2-byte K-first pools at 384-2271 heads (K = V = 128: 384-1535): the bulk pipe, six
        // buffers of whole heads
        let k64 = |heads| EagerShape {
            k: 64,
            v: 64,
            ..with_bulk(2, heads, false)
        };
        for e in [384, 768, 1535]
            .map(|h| with_bulk(2, h, false))
            .into_iter()
            .chain([k64(1920), k64(2271)])
        {
            let (heads, p) = (e.heads, eager_plan(&e).expect("plan"));
            assert_eq!(
                (p.tile, p.warps, p.stages),
                (Some(TileMove::Pipe), if e.k == 64 { 2 } else { 8 }, 6),
                "{heads} heads, K = {}",
                e.k
            );
        }
        assert_ne!(mv(&with_bulk(2, 383, false)), Some(TileMove::Pipe));
        // where its buffers do not fit: the bulk tile kernel
        let e = EagerShape {
            smem_optin: 90_000,
            ..with_bulk(2, 768, false)
        };
        let p = eager_plan(&e).expect("plan");
        assert_eq!(
            (p.tile, p.smem),
            (Some(TileMove::Bulk), (128 * 128 + 8 * 16) * 2)
        );
        // fp32 V-first pools from 512 heads: 4-warp tiles in and out; V-first pools from 192
        // heads up to there: in by bulk copies, out from registers
        let p = eager_plan(&with_bulk(4, 512, true)).expect("plan");
        assert_eq!(
            (p.tile, p.warps, p.smem),
            (Some(TileMove::Bulk), 4, 128 * 64 * 4)
        );
        for size in [4, 2] {
            for heads in [192, 511] {
                let p = eager_plan(&with_bulk(size, heads, true)).expect("plan");
                assert_eq!((p.tile, p.warps), (Some(TileMove::BulkIn), 4));
                assert_eq!(p.smem, 128 * 64 * size);
            }
            assert_eq!(mv(&with_bulk(size, 191, true)), Some(TileMove::Direct));
        }
        // 2-byte V-first pools from 512 heads: the tile straight into registers
        assert_eq!(mv(&with_bulk(2, 512, true)), Some(TileMove::Direct));
        assert_eq!(mv(&with_bulk(2, 8192, true)), Some(TileMove::Direct));
        // not without bulk copies, nor where the pipelined kernel or 4-warp K-first items (row
        // by row) are asked for
        assert_eq!(mv(&shape(4, 8192, false)), Some(TileMove::Direct));
        let mut e = with_bulk(4, 8192, false);
        e.kernel = Some(EagerKernel::Pipelined);
        assert_eq!(mv(&e), None);
        let mut e = with_bulk(4, 8192, false);
        e.fixed_warps = Some(4);
        assert_eq!(mv(&e), Some(TileMove::Direct));
    }

    #[test]
    fn eager_plan_reads_the_slot_once_where_it_measured_faster() {
        let once = |size, heads, v_first| {
            let e = EagerShape {
                bulk: true,
                ..shape(size, heads, v_first)
            };
            eager_plan(&e).expect("plan").slot_once
        };
        // V-first pools: every size and tile move
        for size in [4, 2] {
            for heads in [12, 192, 512, 768, 8192] {
                assert!(
                    once(size, heads, true),
                    "{size}-byte V-first, {heads} heads"
                );
            }
        }
        // fp32 K-first pools: not with bulk copies (whole heads from 512)
        for heads in [12, 192, 511] {
            assert!(once(4, heads, false), "fp32 K-first, {heads} heads");
        }
        assert!(!once(4, 512, false));
        assert!(!once(4, 8193, false));
        // (the register kernel's heads, 768-8192, from the slot read before the wait)
        assert!(once(4, 768, false));
        assert!(once(4, 8192, false));
        // 2-byte K-first pools: below 192 heads and from 1536
        for (heads, expected) in [
            (96, true),
            (191, true),
            (192, false),
            (384, false),
            (768, false),
            (1535, false),
            (1536, true),
            (8192, true),
        ] {
            assert_eq!(
                once(2, heads, false),
                expected,
                "2-byte K-first, {heads} heads"
            );
        }
        // the pipelined kernel has no such choice
        let mut e = shape(2, 768, true);
        e.kernel = Some(EagerKernel::Pipelined);
        assert!(!eager_plan(&e).expect("plan").slot_once);
    }

    #[test]
    fn the_streamed_tile_kernel_takes_whole_2_byte_k_first_heads_of_big_calls() {
        let with_bulk = |size, heads, v_first| EagerShape {
            bulk: true,
            ..shape(size, heads, v_first)
        };
        // by default: 2-byte K-first pools from 2272 heads on a device with bulk copies (K = V
        // = 128: above 8192, up to there the register kernel), whole heads, the slot read once
        let k64 = |heads| EagerShape {
            k: 64,
            v: 64,
            ..with_bulk(2, heads, false)
        };
        for e in [8193, 16384]
            .map(|h| with_bulk(2, h, false))
            .into_iter()
            .chain([k64(2272), k64(3072)])
        {
            let (heads, p) = (e.heads, eager_plan(&e).expect("plan"));
            assert_eq!(
                (p.tile, p.warps, p.vblocks, p.slot_once),
                (
                    Some(TileMove::Stream),
                    if e.k == 64 { 2 } else { 8 },
                    1,
                    true
                ),
                "{heads} heads, K = {}",
                e.k
            );
            assert_eq!(p.smem, bulk_tile_bytes(e.k, e.v, false, 2));
        }
        // not below, not for fp32 or V-first pools, not without bulk copies, not where another
        // kernel or 4-warp items are asked for
        for (size, v_first) in [(2, false), (2, true), (4, false), (4, true)] {
            for heads in [12, 96, 384, 768, 1536, 2048, 2271, 3072, 8192] {
                if size == 2 && !v_first && heads >= 8192 {
                    continue;
                }
                let p = eager_plan(&with_bulk(size, heads, v_first)).expect("plan");
                assert_ne!(p.tile, Some(TileMove::Stream), "{size}-byte, {heads} heads");
            }
        }
        assert_ne!(
            eager_plan(&shape(2, 8192, false)).expect("plan").tile,
            Some(TileMove::Stream)
        );
        for (kernel, warps) in [
            (Some(EagerKernel::BulkTile), None),
            (Some(EagerKernel::Pipelined), None),
            (None, Some(4)),
        ] {
            let mut e = with_bulk(2, 8192, false);
            e.kernel = kernel;
            e.fixed_warps = warps;
            let p = eager_plan(&e).expect("plan");
            assert_ne!(
                p.tile,
                Some(TileMove::Stream),
                "{kernel:?}, {warps:?} warps"
            );
        }
        // forced: whole heads for K-first pools (its bulk copies one block per lane group),
        // as the default bulk tiles, and, as theirs, an fp32 pool's slot read again after a
        // dependent launch's wait (SLOT_AGAIN in the kernel)
        for (size, heads, slot_once) in [
            (2, 12, true),
            (2, 768, false),
            (2, 8192, true),
            (4, 8192, false),
        ] {
            let mut e = with_bulk(size, heads, false);
            e.kernel = Some(EagerKernel::StreamTile);
            let p = eager_plan(&e).expect("plan");
            assert_eq!(
                (p.tile, p.warps),
                (Some(TileMove::Stream), 8),
                "{size}-byte, {heads} heads"
            );
            assert_eq!(p.smem, (128 * 128 + 8 * 16) * size);
            assert_eq!(p.slot_once, slot_once, "{size}-byte, {heads} heads");
        }
    }

    #[test]
    fn padded_rows_have_four_words_per_lane_group_for_k_first_pools() {
        // K = 128: 8 lane groups of 16 rows; 64: 4 of 16; 48: 4 of 12; 32: 2 of 16; 16: 1 of 16
        for (k, kp) in [(128, 160), (64, 80), (48, 64), (32, 40), (16, 20)] {
            assert_eq!(padded_k(k, false), kp, "K = {k}");
        }
        assert_eq!(padded_k(128, true), 128);
        assert_eq!(padded_k(30, true), 32);
    }

    #[test]
    fn the_bulk_pipe_runs_whole_heads_in_buffers_of_a_multiple_of_its_groups() {
        let pipe = |size, v_first| EagerShape {
            bulk: true,
            kernel: Some(EagerKernel::BulkPipe),
            ..shape(size, 768, v_first)
        };
        for (size, buffers) in [(2, 6), (4, 3)] {
            for v_first in [false, true] {
                let e = pipe(size, v_first);
                let p = eager_plan(&e).expect("plan");
                assert_eq!(p.tile, Some(TileMove::Pipe), "{size}-byte");
                assert_eq!((p.warps, p.vblocks), (8, 1), "whole heads");
                assert_eq!(p.stages, buffers, "{size}-byte buffers");
                assert_eq!(p.stages % PIPE_GROUPS, 0);
                assert_eq!(p.smem, buffers * pipe_buffer_bytes(&e) + PIPE_ALIGN);
                assert!(p.smem + pipe_static_smem(&e) <= e.smem_optin);
            }
        }
        // a 2-byte K-first buffer: the tile with its row shifts, four 256-byte input rows, the
        // gate biases and the scalars, rounded up to 128 bytes
        assert_eq!(pipe_buffer_bytes(&pipe(2, false)), 34_688);
        // no bulk copies, heads wider than one CTA, shared memory for two buffers (not a multiple
        // of three groups): StreamTile's plan
        let stream = |e: EagerShape| eager_plan(&e).expect("plan").tile;
        for e in [
            EagerShape {
                bulk: false,
                ..pipe(2, false)
            },
            EagerShape {
                fixed_warps: Some(4),
                ..pipe(2, false)
            },
            EagerShape {
                smem_optin: 90_000,
                ..pipe(2, false)
            },
        ] {
            assert_eq!(stream(e), Some(TileMove::Stream));
        }
    }

    #[test]
    fn the_register_head_kernel_is_the_default_for_k_first_heads_of_128_at_1536_or_768_to_8192() {
        let with_bulk = |size, heads, v_first| EagerShape {
            bulk: true,
            ..shape(size, heads, v_first)
        };
        for (size, heads) in [
            (2, 1536),
            (2, 2048),
            (2, 3072),
            (2, 8192),
            (4, 768),
            (4, 8192),
        ] {
            let p = eager_plan(&with_bulk(size, heads, false)).expect("plan");
            assert_eq!(
                (p.tile, p.warps, p.vblocks, p.smem, p.slot_once),
                (Some(TileMove::Regs), 8, 1, 0, true),
                "{size}-byte, {heads} heads"
            );
        }
        let mv = |e: EagerShape| eager_plan(&e).expect("plan").tile;
        assert_eq!(mv(with_bulk(2, 1535, false)), Some(TileMove::Pipe));
        assert_eq!(mv(with_bulk(2, 8193, false)), Some(TileMove::Stream));
        assert_eq!(mv(with_bulk(4, 767, false)), Some(TileMove::Bulk));
        assert_eq!(mv(with_bulk(4, 8193, false)), Some(TileMove::Bulk));
        // not without bulk copies (where it was not measured), not for V-first pools, other
        // head sizes, or where 4-warp items or another kernel are asked for
        for e in [
            shape(2, 3072, false),
            shape(4, 3072, false),
            with_bulk(4, 3072, true),
            with_bulk(2, 3072, true),
            EagerShape {
                kernel: Some(EagerKernel::StreamTile),
                ..with_bulk(2, 3072, false)
            },
        ]
        .into_iter()
        .chain(regs_misfits(with_bulk(2, 3072, false)))
        {
            assert_ne!(mv(e), Some(TileMove::Regs));
        }
    }

    #[test]
    fn the_register_head_kernel_takes_whole_k_first_heads_of_128_only() {
        let regs = |e: EagerShape| {
            eager_plan(&EagerShape {
                kernel: Some(EagerKernel::RegsTile),
                ..e
            })
            .expect("plan")
        };
        for (size, heads) in [(2, 12), (2, 768), (2, 3072), (4, 12), (4, 768)] {
            let p = regs(shape(size, heads, false));
            assert_eq!(p.tile, Some(TileMove::Regs), "{size}-byte, {heads} heads");
            assert_eq!((p.warps, p.vblocks, p.smem), (8, 1, 0), "{heads} heads");
        }
        // V-first pools, other head sizes or fewer warps: the stream kernel instead
        for e in [shape(4, 768, true), shape(2, 768, true)]
            .into_iter()
            .chain(regs_misfits(shape(2, 768, false)))
        {
            assert_eq!(regs(e).tile, Some(TileMove::Stream));
        }
    }

    #[test]
    fn eager_plan_moves_the_tile_of_big_calls_through_shared_memory_only_when_asked() {
        for (kernel, mv) in [
            (None, TileMove::Direct),
            (Some(EagerKernel::Tile), TileMove::Direct),
            (Some(EagerKernel::StagedTile), TileMove::Staged),
            (Some(EagerKernel::BulkTile), TileMove::Bulk),
            (Some(EagerKernel::BulkInTile), TileMove::BulkIn),
            (Some(EagerKernel::StreamTile), TileMove::Stream),
        ] {
            for (size, v_first) in [(2, false), (2, true), (4, false)] {
                let mut e = shape(size, 768, v_first);
                e.kernel = kernel;
                let p = eager_plan(&e).expect("plan");
                assert_eq!(p.tile.unwrap_or(TileMove::Direct), mv, "{kernel:?}");
                if kernel.is_some() {
                    assert_eq!(p.tile, Some(mv), "{kernel:?}");
                    // K-first bulk copies asked for: whole heads, as the plan's own; else the
                    // plan's 4 warps
                    let whole = !v_first
                        && matches!(mv, TileMove::Bulk | TileMove::BulkIn | TileMove::Stream);
                    assert_eq!(p.warps, if whole { 8 } else { 4 }, "{kernel:?} {size}-byte");
                    // a staged or bulk tile: K x the CTA's columns in dynamic shared memory,
                    // and a K-first bulk tile LK (8) x WC (16) elements of row shifts
                    let smem = match mv {
                        TileMove::Direct => 0,
                        TileMove::Staged => 128 * p.warps * 16 * size,
                        _ if v_first => 128 * p.warps * 16 * size,
                        _ => (128 * p.warps * 16 + 8 * 16) * size,
                    };
                    assert_eq!(p.smem, smem, "{kernel:?} {size}-byte");
                }
            }
        }
    }

    #[test]
    fn eager_plan_writes_whole_2_byte_k_first_heads_back_through_the_stage() {
        let stage_store = |e: &EagerShape| eager_plan(e).expect("plan").stage_store;
        // whole heads (rows of 256 bytes): through the stage
        assert!(stage_store(&shape(2, 2048, false)));
        // 4 warps (rows of 128 bytes), N = 1, V-first, fp32: from registers
        assert!(!stage_store(&shape(2, 768, false)));
        assert!(!stage_store(&shape(2, 12, false)));
        assert!(!stage_store(&shape(2, 3072, true)));
        assert!(!stage_store(&shape(4, 3072, false)));
        // whole heads asked for: through the stage
        let mut e = shape(2, 12, false);
        e.fixed_warps = Some(8);
        assert!(stage_store(&e));
    }

    #[test]
    fn eager_plan_honours_fixed_warps_and_stages_and_falls_back_to_two_stages() {
        let mut e = shape(4, 768, false);
        e.fixed_warps = Some(8);
        e.stages = Some(3);
        assert_eq!(plan(&e), (8, 1, 3));
        // a device with 150 KB per CTA: 3 stages of a whole fp32 head (3 x 65 KiB) do not
        // fit, 2 do
        e.smem_optin = 150_000;
        assert_eq!(plan(&e), (8, 1, 2));
        e.fixed_warps = Some(3);
        assert_eq!(plan(&e), (3, 3, 3));
    }

    #[test]
    fn eager_plan_refuses_shapes_without_whole_16_byte_copies() {
        let mut e = shape(4, 12, false);
        e.k = 5;
        e.v = 7;
        assert!(eager_plan(&e).is_none());
    }
}
