//! [`CudaBackend`]: the [`Backend`] of the CUDA device, one kernel launch per operation
//! (`kda_eager` or `kda_step` for eager decode, `kda_ring` or `kda_step` with a ring).
//!
//! Two ways in:
//! - the [`Backend`] methods validate everything on the host, exactly like the CPU backend:
//!   with a ring they first copy the batch's ring records and the accepted counts to the host
//!   (one small synchronous read), so an argument error leaves the pool unchanged and the
//!   layer's epoch is bumped only by calls that store;
//! - the `enqueue_*` methods run the checks that need no device data and launch without any
//!   synchronisation (for CUDA-graph capture and benchmarks). The kernel then clamps an
//!   accepted count above the slot's drafts, drops the drafts of a slot that decode finds with
//!   drafts, and records the violation in the backend's error word:
//!   [`CudaBackend::check_device_errors`] reports it (the pool has changed by then). The
//!   epoch is bumped by every enqueued call that may store.

use std::sync::Arc;

use parking_lot::Mutex;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig};
use state_pool::{DeviceMemory, Dtype, LayerMut, PoolGeometry, RingMeta, Rounding, StateLayout};

use super::memory::{CudaBuffer, CudaMemory};
use super::nvrtc::CodeKind;
use super::params::{
    FastDiv, KdaParams, OpCode, EARLY_PREFETCH, EARLY_SLOT_ONCE, ERR_ACCEPTED, ERR_DECODE_DRAFTS,
    ERR_META, NO_SLOT,
};
use super::registry::{
    eager_kernel, eager_tile_kernel, ring_kernel, ring_tile_kernel, step_kernel, warm_up, StepKey,
    TileMove,
};
use crate::api::{
    Backend, BatchPlan, BetaMode, GateMode, IndexView, KdaOptions, StepInputs, TensorView,
    TensorViewMut,
};
use crate::choice::{EagerKernel, RingKernel};
use crate::cpu::validate::{check_accepted, check_layer, validate_call, CallArgs, Op};
use crate::error::{KernelError, Result};

type Buf = CudaBuffer;

/// A batch prepared for the CUDA backend: the validated plan and device copies of the
/// sequence bounds and slots (`u32`).
pub struct CudaBatch {
    plan: BatchPlan,
    bounds: CudaBuffer,
    slots: CudaBuffer,
}

impl std::fmt::Debug for CudaBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBatch")
            .field("plan", &self.plan)
            .finish()
    }
}

impl AsRef<BatchPlan> for CudaBatch {
    fn as_ref(&self) -> &BatchPlan {
        &self.plan
    }
}

/// The CUDA backend: one device, one stream, kernels compiled with NVRTC on first use.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    mem: CudaMemory,
    /// `u32 [4]`: flags, first bad slot, any store, spare.
    err: Mutex<CudaBuffer>,
    /// Warps per CTA of eager decode (`None`: chosen per call).
    eager_warps: Mutex<Option<u32>>,
    /// The eager-decode kernel asked for (`None`: chosen per call).
    eager_kernel: Mutex<Option<EagerKernel>>,
    /// Pipeline stages of the pipelined eager kernel (`None`: the default).
    eager_stages: Mutex<Option<usize>>,
    /// The kernel of calls with a ring (`None`: per call, `ring_choice`).
    ring_kernel: Mutex<Option<RingKernel>>,
    /// Whether kernels launch as programmatic dependent launches (`None`: per call,
    /// `dependent_launch`).
    dependent_launch: Mutex<Option<bool>>,
    /// Whether the device has programmatic dependent launch (sm_90 and later; the kernels'
    /// wait is compiled only there).
    has_dependent_launch: bool,
    /// Whether the device has bulk copies (`cp.async.bulk`, sm_90 and later), which the eager
    /// plan's own choice takes only then (elsewhere the bulk kernels' stand-in copies are slow).
    has_bulk_copies: bool,
    num_sms: u32,
    /// Dynamic shared memory one CTA may opt in to, bytes.
    smem_optin: usize,
    device_name: String,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBackend({})", self.device_name)
    }
}

fn unavailable(reason: impl Into<String>) -> KernelError {
    KernelError::Unavailable {
        backend: "cuda",
        reason: reason.into(),
    }
}

pub(crate) fn device_err(what: &str, e: impl std::fmt::Display) -> KernelError {
    KernelError::Device {
        backend: "cuda",
        msg: format!("{what}: {e}"),
    }
}

/// The lane geometry of `kda_step` for key dim `k` (mirrors the kernel's constexprs): lanes
/// along K (`LK`, a power of two).
fn lanes_k(k: usize) -> usize {
    k.div_ceil(16).next_power_of_two().min(32)
}

/// The lane geometry of `kda_step` for key dim `k`: columns covered by one warp.
fn warp_columns(k: usize) -> usize {
    (32 / lanes_k(k)) * 4
}

/// Whether the pipelined kernels (`kda_eager`, `kda_ring`) can copy a state tile of key dim
/// `k`, value dim `v` and `state_size`-byte elements, and its dt_bias row, in whole 16-byte
/// chunks into shared memory and read it back with `kda_step`'s lane mapping (LK, RG, WC of
/// `kernels/kda_decode.cu`).
fn tile_fits(k: usize, v: usize, state_size: usize) -> bool {
    let lk = lanes_k(k);
    let sv = 16 / state_size;
    let rg = if k.is_multiple_of(sv) { sv } else { 1 };
    k.is_multiple_of(lk)
        && (k / lk).is_multiple_of(rg)
        && v.is_multiple_of(4)
        && [
            warp_columns(k) * state_size,
            v * state_size,
            k * state_size,
            k * 4,
        ]
        .iter()
        .all(|b| b.is_multiple_of(16))
}

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
struct EagerShape {
    k: usize,
    v: usize,
    state_size: usize,
    input_size: usize,
    smem_optin: usize,
    fixed_warps: Option<usize>,
    /// Pipeline stages asked for (2 or 3; `None`: the default).
    stages: Option<usize>,
    /// Value heads of the call (sequences x value heads).
    heads: usize,
    /// Whether the pool is V-first.
    v_first: bool,
    /// Multiprocessors of the device.
    num_sms: usize,
    /// The kernel asked for (`None`: the plan's choice).
    kernel: Option<EagerKernel>,
    /// Whether the device has bulk copies (`cp.async.bulk`, sm_90 and later), which the plan's
    /// own choice takes only then.
    bulk: bool,
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
struct EagerPlan {
    warps: usize,
    vblocks: usize,
    /// Pipeline stages (2 or 3); the bulk pipe's buffers per CTA.
    stages: usize,
    /// Dynamic shared memory, bytes: the pipelined kernel's stages, a staged or bulk tile
    /// kernel's tile (K x its columns; `bulk_tile_bytes`), none for `kda_eager_tile`, the bulk
    /// pipe's buffers (`pipe_buffer_bytes` each, and `PIPE_ALIGN`).
    smem: usize,
    /// Whether the updated tile goes back out through its stage (written there, then copied
    /// out in whole 16-byte chunks: `kda_eager_stage`) rather than from registers (`kda_eager`).
    stage_store: bool,
    /// `Some`: a tile kernel runs the items instead (one per CTA), moving its tile this way.
    tile: Option<TileMove>,
    /// Whether a tile kernel in a dependent launch loads its tile from the slot it read before
    /// its wait (for the L2 prefetch) instead of reading it again after the wait
    /// (`slot_once_for`).
    slot_once: bool,
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
/// with it at every size from N = 16. Below 2560 heads `kda_eager_bulk_pipe` runs instead
/// ([`PIPE_2_BYTE_K_FIRST`]).
const STREAM_2_BYTE_K_FIRST_FROM: usize = 2560;

/// CTAs of `kda_eager_tile_stream` per SM at most: where more would fit (2-byte K-first tiles
/// of K = V = 128 fit 6 times in the H200's 228 KB), the launch asks for more shared memory
/// than the tile needs. H200 (docs/performance.md, forty-third session): 5 CTAs 0.5-1.5%
/// faster than 6 at every 2-byte size measured from 2560 to 32768 heads (fp16 and bf16, H 12
/// and 32), 4 within 0.3% of 5 there and 6-7% slower at 768 heads, 3 CTAs 2.6-3.6% slower
/// than 6, 2 CTAs about 20%.
const STREAM_CTAS_PER_SM: u32 = 5;

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
const PIPE_THREADS: usize = (8 * PIPE_GROUPS + 2) * 32;

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
/// and is the faster of the two up to 2560 heads: 0.6-2.2% at 1920-2048 heads, 0.7-1.8% at 2304
/// (one case 0.4% slower), within 1% either way at 2556-2560, 0.9-1.7% slower at 3072.
const PIPE_2_BYTE_K_FIRST: std::ops::Range<usize> = 384..STREAM_2_BYTE_K_FIRST_FROM;

/// How the plan's own choice moves a tile kernel's tile by bulk copies at this shape, if it does.
fn default_bulk_move(e: &EagerShape) -> Option<TileMove> {
    if !e.bulk {
        return None;
    }
    if e.state_size == 2 && !e.v_first && e.heads >= STREAM_2_BYTE_K_FIRST_FROM {
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
fn eager_plan(e: &EagerShape) -> Option<EagerPlan> {
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
                Some(EagerKernel::BulkTile | EagerKernel::BulkInTile | EagerKernel::StreamTile)
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
                Some(TileMove::Direct) => 0,
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

/// What decides whether and how the pipelined ring kernel (`kda_ring`) runs.
struct RingShape {
    k: usize,
    v: usize,
    state_size: usize,
    input_size: usize,
    ring_len: usize,
    /// Bytes of one ring entry (`PoolGeometry::ring_entry_elems` in the input dtype).
    entry_bytes: usize,
    /// Most new tokens of one sequence in the call.
    max_new: usize,
    /// Value heads of the call (sequences x value heads).
    heads: usize,
    /// Whether the pool rounds stochastically (`kda_ring` stores with nearest rounding only).
    stochastic: bool,
    /// Whether the pool has a delta plane (`kda_ring_delta` needs one).
    deltas: bool,
    /// Whether the state is stored V-first.
    v_first: bool,
    /// Whether the call is a ring decode (one new token per sequence).
    decode: bool,
    smem_optin: usize,
}

/// A launch of `kda_ring`, `kda_ring_tile`, `kda_ring_mma` or `kda_ring_delta`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RingPlan {
    /// Which of them (never [`RingKernel::Step`]).
    kernel: RingKernel,
    /// Token rows per stage (ring length + most new tokens).
    mt: usize,
    /// Most new tokens of one sequence.
    mq: usize,
    /// Bytes per asynchronous copy of a token row (4, 8 or 16).
    gran: usize,
    /// Column blocks per value head.
    vblocks: usize,
    /// Dynamic shared memory, bytes.
    smem: usize,
}

/// Threads of a `kda_ring` CTA (`RT` in `kernels/kda_ring.cu`).
const RING_THREADS: usize = 256;
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
/// runs. Such a call launches as a dependent launch ([`SPEC_DEPENDENT_UPTO`]), and then
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
fn ring_choice(s: &RingShape, op: Op, forced: Option<RingKernel>) -> Option<RingPlan> {
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

impl CudaBackend {
    /// The backend on device 0.
    pub fn new() -> Result<Self> {
        Self::on_device(0)
    }

    /// The backend on device `ordinal`. No driver, no device, no NVRTC or a `KDA_CUDA_CODE`
    /// other than `cubin` or `ptx` is [`KernelError::Unavailable`].
    pub fn on_device(ordinal: usize) -> Result<Self> {
        // what NVRTC will hand the driver, checked before anything is loaded
        CodeKind::from_env().map_err(unavailable)?;
        // SAFETY: only tries to open the shared libraries; no CUDA call is made.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(unavailable("no CUDA driver library (libcuda) found"));
        }
        // SAFETY: as above, for the NVRTC library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(unavailable("no NVRTC library (libnvrtc) found"));
        }
        let ctx = std::panic::catch_unwind(|| -> Result<Arc<CudaContext>> {
            let count = CudaContext::device_count().map_err(|e| unavailable(format!("{e}")))?;
            if ordinal >= count.max(0) as usize {
                return Err(unavailable(format!(
                    "no CUDA device {ordinal} ({count} devices found)"
                )));
            }
            CudaContext::new(ordinal).map_err(|e| unavailable(format!("device {ordinal}: {e}")))
        })
        .map_err(|_| unavailable("the CUDA driver library lacks a needed function"))??;
        // One stream for everything: no cross-stream events needed (and none may be recorded
        // inside a graph capture).
        // SAFETY: every buffer of this backend is used on the single stream created below, so
        // no cross-stream synchronisation is needed.
        unsafe { ctx.disable_event_tracking() };
        let stream: Arc<CudaStream> = ctx
            .new_stream()
            .map_err(|e| unavailable(format!("stream: {e}")))?;
        let mem = CudaMemory::new(stream);
        let err = mem.upload_slice(&[0u32, NO_SLOT, 0, 0])?;
        let num_sms =
            ctx.attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| unavailable(format!("device attribute: {e}")))? as u32;
        let smem_optin = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| unavailable(format!("device attribute: {e}")))? as usize;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| unavailable(format!("compute capability: {e}")))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown".into());
        Ok(Self {
            ctx,
            mem,
            err: Mutex::new(err),
            eager_warps: Mutex::new(None),
            eager_kernel: Mutex::new(None),
            eager_stages: Mutex::new(None),
            ring_kernel: Mutex::new(None),
            dependent_launch: Mutex::new(None),
            has_dependent_launch: major >= 9,
            has_bulk_copies: major >= 9,
            num_sms,
            smem_optin,
            device_name: format!("{name} (sm_{major}{minor}, {num_sms} SMs)"),
        })
    }

    /// The device's name, compute capability and multiprocessor count.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Compiles and loads, several at a time, the kernels that calls on layers of these
    /// geometries use (inputs in each geometry's `ring_dtype`), so that no later call waits for
    /// NVRTC. Without it a kernel module compiles on its first use, taking seconds. An engine
    /// calls this once at startup with the geometries of its pools; modules already loaded are
    /// skipped. The first compile or load error, if any.
    pub fn warm_up(&self, geometries: &[PoolGeometry]) -> Result<()> {
        let keys: Vec<StepKey> = geometries
            .iter()
            .map(|g| StepKey::of(g, g.ring_dtype))
            .collect();
        warm_up(&self.ctx, &keys)
    }

    /// The stream all work runs on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        self.mem.stream()
    }

    /// The context.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Chooses the eager-decode kernel ([`EagerKernel`]); `None` (the default) picks per call,
    /// wherever the shape allows the pipelined kernel (else `kda_step`): `kda_eager_tile` for
    /// fp32 and 2-byte V-first pools and for small 2-byte K-first calls (the smallest with
    /// `kda_eager_tile_staged`), the pipelined kernel for mid-size 2-byte K-first calls, and on
    /// a device with bulk copies `kda_eager_tile_bulk` for big K-first and fp32 V-first calls
    /// and `kda_eager_tile_bulk_in` for mid-size V-first and 2-byte K-first ones, and
    /// `kda_eager_tile_stream` for the biggest 2-byte K-first calls (`eager_plan`).
    pub fn set_eager_kernel(&self, kernel: Option<EagerKernel>) -> Result<()> {
        *self.eager_kernel.lock() = kernel;
        Ok(())
    }

    /// Chooses the kernel of calls with a ring ([`RingKernel`]): `kda_ring`, `kda_ring_tile` or
    /// `kda_ring_mma` wherever the call fits them (nearest rounding, whole 16-byte tile rows,
    /// whole 4-byte token rows, at most 16 pending and new tokens per sequence; `kda_ring_mma`
    /// also K = 128 and whole 128-column items), else `kda_step`. `None` (the default) picks per
    /// call (`ring_choice`): `kda_ring_mma` for spec_verify calls with four or more drafts per
    /// sequence on 2-byte pools from 384 items (sequences x value heads at K = V = 128);
    /// `kda_ring_tile` for ring decode calls of at most 128 items, replay calls of at most 64,
    /// and the other spec_verify calls with two or more drafts of at most 128 items or at least
    /// `ring_tile_from`'s (512 with 4 or more drafts, 1024 with 2, 1024 or 2048 with 3);
    /// `kda_ring` for the rest. All but `kda_ring_mma` give the same bits.
    pub fn set_ring_kernel(&self, kernel: Option<RingKernel>) -> Result<()> {
        *self.ring_kernel.lock() = kernel;
        Ok(())
    }

    /// Chooses whether the KDA kernels launch as programmatic dependent launches (sm_90 and
    /// later): the kernel's CTAs may be scheduled while the previous kernel on the stream
    /// retires; until they have waited for it they only read the batch's slots and prefetch
    /// their first state tiles (and ring rows) into L2. `Some(true)` every operation,
    /// `Some(false)` none, `None` (the default) decode and spec_verify calls of at most 512 items
    /// (sequences x value heads at K = V = 128) by a ring kernel; never on devices before sm_90.
    /// On the H200 it made decode at N = 1 11-16% faster and N >= 64 up to 4% faster
    /// (docs/performance.md, eleventh and twelfth sessions), spec_verify calls of up to 512
    /// items 1-12% faster, larger ones up to 5% slower, and replay 1-9% slower (twentieth
    /// session).
    pub fn set_dependent_launch(&self, on: Option<bool>) -> Result<()> {
        *self.dependent_launch.lock() = on;
        Ok(())
    }

    /// Fixes the pipeline stages of the pipelined eager kernel (2 or 3; 3 falls back to 2 where
    /// it does not fit shared memory), or lets the backend choose (`None`).
    pub fn set_eager_stages(&self, stages: Option<u32>) -> Result<()> {
        if let Some(st) = stages {
            if !(2..=3).contains(&st) {
                return Err(KernelError::arg(
                    "stages",
                    format!("is {st}; expected 2 or 3"),
                ));
            }
        }
        *self.eager_stages.lock() = stages.map(|st| st as usize);
        Ok(())
    }

    /// Fixes the warps per CTA of eager decode (1..=8), or lets the backend choose (`None`).
    pub fn set_eager_warps(&self, warps: Option<u32>) -> Result<()> {
        if let Some(w) = warps {
            if !(1..=8).contains(&w) {
                return Err(KernelError::arg("warps", format!("is {w}; expected 1..=8")));
            }
        }
        *self.eager_warps.lock() = warps;
        Ok(())
    }

    /// Waits for all enqueued work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream()
            .synchronize()
            .map_err(|e| device_err("synchronize", e))
    }

    /// Reports (and clears) the violations the kernels recorded since the last check: an
    /// accepted count above a slot's drafts (clamped), decode on a slot with drafts (dropped),
    /// a corrupt ring record (clamped). Waits for all enqueued work.
    pub fn check_device_errors(&self) -> Result<()> {
        let mut err = self.err.lock();
        let mut words = [0u8; 16];
        self.mem.read(&err, 0, &mut words)?;
        let w: [u32; 4] = bytemuck::cast(words);
        if w[0] == 0 {
            return Ok(());
        }
        self.mem
            .write(&mut err, 0, bytemuck::cast_slice(&[0u32, NO_SLOT, 0, 0]))?;
        let slot = w[1];
        Err(if w[0] & ERR_ACCEPTED != 0 {
            KernelError::arg(
                "accepted",
                format!("exceeded the drafts of slot {slot}; the device clamped it (the pool has changed)"),
            )
        } else if w[0] & ERR_DECODE_DRAFTS != 0 {
            KernelError::arg(
                "slots",
                format!("slot {slot} had drafts at decode; the device dropped them (the pool has changed)"),
            )
        } else {
            debug_assert!(w[0] & ERR_META != 0);
            KernelError::arg(
                "layer",
                format!("slot {slot} has a corrupt ring record; the device clamped it"),
            )
        })
    }

    /// Decode without host synchronisation (see the module docs).
    pub fn enqueue_decode(
        &self,
        batch: &CudaBatch,
        inputs: &StepInputs<'_, Buf>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf>,
        out: &mut TensorViewMut<'_, Buf>,
    ) -> Result<()> {
        let call = Call::tokens(Op::Decode, batch, None, inputs, opts, &*out);
        self.run(call, layer, false)
    }

    /// Speculative verify without host synchronisation (see the module docs).
    pub fn enqueue_spec_verify(
        &self,
        batch: &CudaBatch,
        accepted: &IndexView<'_, Buf>,
        inputs: &StepInputs<'_, Buf>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf>,
        out: &mut TensorViewMut<'_, Buf>,
    ) -> Result<()> {
        let call = Call::tokens(Op::SpecVerify, batch, Some(accepted), inputs, opts, &*out);
        self.run(call, layer, false)
    }

    /// Replay (flush) without host synchronisation (see the module docs).
    pub fn enqueue_replay(
        &self,
        batch: &CudaBatch,
        accepted: Option<&IndexView<'_, Buf>>,
        opts: &KdaOptions,
        a_log: Option<&TensorView<'_, Buf>>,
        dt_bias: Option<&TensorView<'_, Buf>>,
        layer: &mut LayerMut<'_, Buf>,
    ) -> Result<()> {
        let call = Call::replay(batch, accepted, opts, a_log, dt_bias);
        self.run(call, layer, false)
    }

    /// The ring records of the batch's slots, read from the device (default without a ring).
    fn batch_metas(&self, layer: &LayerMut<'_, Buf>, plan: &BatchPlan) -> Result<Vec<RingMeta>> {
        let g = layer.geometry;
        plan.check_slots(g.total_slots())?;
        if g.ring_len == 0 {
            return Ok(vec![RingMeta::default(); plan.num_seqs()]);
        }
        let bytes = self.mem.download(layer.meta)?;
        let all: &[RingMeta] = bytemuck::cast_slice(&bytes);
        Ok(plan.slots.iter().map(|&s| all[s as usize]).collect())
    }

    /// Opts a kernel in to `smem` bytes of dynamic shared memory.
    fn opt_in_smem(f: &CudaFunction, name: &str, smem: usize) -> Result<()> {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(|e| device_err(&format!("{name} shared memory"), e))
    }

    /// The dynamic shared memory `kda_eager_tile_stream` asks for: its tile's `smem`, or where
    /// that lets more than [`STREAM_CTAS_PER_SM`] CTAs of `threads` threads share an SM, the
    /// most that many can each have (by the driver's occupancy arithmetic; asked only then, as
    /// the driver refuses the question for a count that the kernel's registers do not allow).
    fn stream_smem(f: &CudaFunction, name: &str, threads: usize, smem: usize) -> Result<usize> {
        let occupancy = |e| device_err(&format!("{name} occupancy"), e);
        let fit = f
            .occupancy_max_active_blocks_per_multiprocessor(threads as u32, smem, None)
            .map_err(occupancy)?;
        if fit <= STREAM_CTAS_PER_SM {
            return Ok(smem);
        }
        let share = f
            .occupancy_available_dynamic_smem_per_block(STREAM_CTAS_PER_SM, threads as u32)
            .map_err(occupancy)?;
        Ok(smem.max(share))
    }

    /// Opts a persistent kernel in to `smem` bytes of dynamic shared memory and returns its grid:
    /// the CTAs of `threads` threads that fit on all multiprocessors at once.
    fn persistent_grid(
        &self,
        f: &CudaFunction,
        name: &str,
        threads: usize,
        smem: usize,
    ) -> Result<usize> {
        Self::opt_in_smem(f, name, smem)?;
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(threads as u32, smem, None)
            .map_err(|e| device_err(&format!("{name} occupancy"), e))?
            .max(1) as usize;
        Ok(per_sm * self.num_sms as usize)
    }

    /// Validates, then launches one kernel. `exact`: read the ring records and accepted
    /// counts back and validate them on the host (the [`Backend`] methods).
    fn run(&self, call: Call<'_, '_>, layer: &mut LayerMut<'_, Buf>, exact: bool) -> Result<()> {
        let checked = self.validate(&call, layer, exact)?;
        self.launch(&call, checked.stores, layer, exact)
    }

    /// The host-side checks of a call (see [`CudaBackend::run`]).
    fn validate(
        &self,
        call: &Call<'_, '_>,
        layer: &LayerMut<'_, Buf>,
        exact: bool,
    ) -> Result<crate::cpu::validate::CallPlan> {
        let g = layer.geometry;
        let plan = &call.batch.plan;
        let n = plan.num_seqs();
        check_layer(&self.mem, g, layer.ssm, layer.ring, layer.meta, layer.delta)?;
        if let Some((dtype, len, buf)) = call.out_shape {
            if buf < len * dtype.size() {
                return Err(KernelError::arg(
                    "out",
                    format!(
                        "buffer has {buf} bytes; {len} elements of {dtype} need {}",
                        len * dtype.size()
                    ),
                ));
            }
        }
        if let Some(acc) = call.accepted {
            check_accepted(&self.mem, acc, n)?;
        }
        let (metas, accepted_host) = if exact {
            let metas = self.batch_metas(layer, plan)?;
            let acc = match call.accepted {
                Some(a) if n > 0 => {
                    let mut b = vec![0u8; n * 4];
                    self.mem.read(a.buf, 0, &mut b)?;
                    Some(bytemuck::cast_slice::<u8, u32>(&b).to_vec())
                }
                Some(_) => Some(Vec::new()),
                None => None,
            };
            (metas, acc)
        } else {
            plan.check_slots(g.total_slots())?;
            (vec![RingMeta::default(); n], None)
        };
        validate_call(
            &self.mem,
            g,
            &CallArgs {
                op: call.op,
                plan,
                inputs: call.inputs,
                a_log: call.a_log,
                dt_bias: call.dt_bias,
                opts: call.opts,
                out: call.out_shape.map(|(d, l, _)| (d, l)),
                accepted: accepted_host.as_deref(),
                metas: &metas,
            },
        )
    }

    /// Launches the one kernel of a validated call; `stores`: whether the host knows that
    /// the call stores (exact validation), else the epoch is bumped whenever it may store.
    fn launch(
        &self,
        call: &Call<'_, '_>,
        stores: bool,
        layer: &mut LayerMut<'_, Buf>,
        exact: bool,
    ) -> Result<()> {
        let g = layer.geometry;
        let n = call.batch.plan.num_seqs();
        if n == 0 || (g.ring_len == 0 && call.op != Op::Decode) {
            // Nothing can change: no sequences, or spec_verify / replay without a ring (every
            // sequence then has no tokens, no drafts and nothing pending).
            return Ok(());
        }
        let may_store = if exact {
            stores
        } else {
            g.ring_len > 0 || call.op == Op::Decode
        };
        // bumped once the kernel is launched: a call refused on its way there (a kernel that
        // does not compile, a driver query that fails) changes nothing
        let epoch = *layer.epoch + u64::from(may_store);
        let input = match call.inputs {
            Some(i) => i.q.dtype,
            None => g.ring_dtype,
        };
        let key = StepKey::of(g, input);
        let func = step_kernel(&self.ctx, key)?;

        let s = self.stream();
        let ptr = |b: &CudaBuffer| b.device_ptr(s);
        let opt_ptr = |t: Option<&TensorView<'_, Buf>>| t.map_or(0, |t| ptr(t.buf));
        let opts = call.opts;
        let (gate_mode, lower_bound) = match opts.gate {
            GateMode::Activated => (0, 0.0),
            GateMode::Softplus => (1, 0.0),
            GateMode::LowerBound(lb) => (2, lb),
        };
        let (sr, seed) = match g.rounding {
            Rounding::Nearest => (0, 0u64),
            Rounding::Stochastic { seed } => (1, seed),
        };
        let ring = g.ring_len > 0;
        let wc = warp_columns(g.k);
        let warps_per_head = g.v.div_ceil(wc);
        let fixed_warps = *self.eager_warps.lock();
        let eager_choice = *self.eager_kernel.lock();
        let pipe = if !ring && call.op == Op::Decode && eager_choice != Some(EagerKernel::Step) {
            eager_plan(&EagerShape {
                k: g.k,
                v: g.v,
                state_size: g.state_dtype.size(),
                input_size: input.size(),
                smem_optin: self.smem_optin,
                fixed_warps: fixed_warps.map(|w| w as usize),
                stages: *self.eager_stages.lock(),
                heads: n * g.hv,
                v_first: g.layout == StateLayout::VFirst,
                num_sms: self.num_sms as usize,
                kernel: eager_choice,
                bulk: self.has_bulk_copies,
            })
        } else {
            None
        };
        let ring_pipe = if ring {
            let plan = &call.batch.plan;
            let shape = RingShape {
                k: g.k,
                v: g.v,
                state_size: g.state_dtype.size(),
                input_size: input.size(),
                ring_len: g.ring_len,
                entry_bytes: g.ring_entry_elems() * input.size(),
                max_new: (0..n).map(|i| plan.len_of(i)).max().unwrap_or(0),
                heads: n * g.hv,
                stochastic: sr == 1,
                deltas: g.ring_deltas,
                v_first: g.layout == StateLayout::VFirst,
                decode: call.op == Op::Decode,
                smem_optin: self.smem_optin,
            };
            ring_choice(&shape, call.op, *self.ring_kernel.lock())
        } else {
            None
        };
        let (func, name, smem, grid_cap) = match (pipe, ring_pipe) {
            (
                Some(EagerPlan {
                    tile: Some(TileMove::Pipe),
                    smem,
                    ..
                }),
                _,
            ) => {
                let (f, name) = eager_tile_kernel(&self.ctx, key, TileMove::Pipe)?;
                let grid = self.persistent_grid(&f, name, PIPE_THREADS, smem)?;
                (f, name, smem, Some(grid))
            }
            (
                Some(EagerPlan {
                    tile: Some(mv),
                    smem,
                    warps,
                    ..
                }),
                _,
            ) => {
                let (f, name) = eager_tile_kernel(&self.ctx, key, mv)?;
                let smem = if mv == TileMove::Stream {
                    Self::stream_smem(&f, name, warps * 32, smem)?
                } else {
                    smem
                };
                // (no driver call for kda_eager_tile, which has no dynamic shared memory)
                if smem > 0 {
                    Self::opt_in_smem(&f, name, smem)?;
                }
                (f, name, smem, None)
            }
            (Some(pl), _) => {
                let (f, name) = eager_kernel(&self.ctx, key, pl.stage_store)?;
                let grid = self.persistent_grid(&f, name, pl.warps * 32, pl.smem)?;
                (f, name, pl.smem, Some(grid))
            }
            (None, Some(rp)) if rp.kernel != RingKernel::Pipelined => {
                let (f, name) = ring_tile_kernel(&self.ctx, key, rp.kernel)?;
                Self::opt_in_smem(&f, name, rp.smem)?;
                (f, name, rp.smem, None)
            }
            (None, Some(rp)) => {
                let f = ring_kernel(&self.ctx, key)?;
                let grid = self.persistent_grid(&f, "kda_ring", RING_THREADS, rp.smem)?;
                (f, "kda_ring", rp.smem, Some(grid))
            }
            (None, None) => (func, "kda_step", 0, None),
        };
        let (units, heads_per_cta, vblocks, warps) = if let Some(pl) = pipe {
            let warps = match pl.tile {
                Some(TileMove::Pipe) => PIPE_THREADS / 32,
                _ => pl.warps,
            };
            (g.hv, 1usize, pl.vblocks, warps)
        } else if let Some(rp) = ring_pipe {
            (g.hv, 1usize, rp.vblocks, RING_THREADS / 32)
        } else if ring {
            let w = warps_per_head.min(8);
            (g.h, g.group(), 1usize, w)
        } else {
            let w = match fixed_warps {
                Some(w) => w as usize,
                // 2 warps per CTA measured best on the H200 for N >= 64 (docs/performance.md);
                // 1 when that leaves fewer than two CTAs per SM.
                None => {
                    let w2 = warps_per_head.min(2);
                    let ctas = n * g.hv * warps_per_head.div_ceil(w2);
                    if ctas < 2 * self.num_sms as usize {
                        1
                    } else {
                        w2
                    }
                }
            };
            (g.hv, 1usize, warps_per_head.div_ceil(w), w)
        };
        let items = n * units * vblocks;
        let grid = grid_cap.map_or(items, |c| items.min(c));
        if grid > i32::MAX as usize {
            return Err(KernelError::arg(
                "slots",
                format!(
                    "{n} sequences need {grid} CTAs; at most {} fit one launch",
                    i32::MAX
                ),
            ));
        }
        let err = self.err.lock();
        let inputs = call.inputs;
        let (a_log, dt_bias) = match inputs {
            Some(i) => (opt_ptr(i.a_log.as_ref()), opt_ptr(i.dt_bias.as_ref())),
            None => (opt_ptr(call.a_log), opt_ptr(call.dt_bias)),
        };
        let dependent = dependent_launch(
            call.op,
            ring_pipe.map(|_| items),
            *self.dependent_launch.lock(),
            self.has_dependent_launch,
        );
        let params = KdaParams {
            q: inputs.map_or(0, |i| ptr(i.q.buf)),
            k: inputs.map_or(0, |i| ptr(i.k.buf)),
            v: inputs.map_or(0, |i| ptr(i.v.buf)),
            g: inputs.map_or(0, |i| ptr(i.g.buf)),
            beta: inputs.map_or(0, |i| ptr(i.beta.buf)),
            a_log: if opts.needs_gate_params() { a_log } else { 0 },
            dt_bias: if opts.needs_gate_params() { dt_bias } else { 0 },
            out: call.out_buf.map_or(0, ptr),
            ssm: ptr(layer.ssm),
            ring: ptr(layer.ring),
            meta: ptr(layer.meta),
            delta: ptr(layer.delta),
            bounds: ptr(&call.batch.bounds),
            slots: ptr(&call.batch.slots),
            accepted: call.accepted.map_or(0, |a| ptr(a.buf)),
            err: ptr(&err),
            n_seqs: n as u32,
            h: g.h as u32,
            hv: g.hv as u32,
            ring_len: g.ring_len as u32,
            op: call.code as u32,
            gate_mode,
            beta_sigmoid: u32::from(opts.beta == BetaMode::Sigmoid),
            l2norm: u32::from(opts.l2norm_qk),
            scale: opts.scale_for(g.k),
            lower_bound,
            beta_factor: if opts.allow_neg_eigval { 2.0 } else { 1.0 },
            sr,
            seed_lo: seed as u32,
            seed_hi: (seed >> 32) as u32,
            layer: layer.layer as u32,
            epoch: epoch as u32,
            heads_per_cta: heads_per_cta as u32,
            units: units as u32,
            vblocks: vblocks as u32,
            stages: pipe.map_or(2, |pl| pl.stages as u32),
            ring_mt: ring_pipe.map_or(0, |rp| rp.mt as u32),
            early: match (dependent, pipe.is_some_and(|pl| pl.slot_once)) {
                (false, _) => 0,
                (true, false) => EARLY_PREFETCH,
                (true, true) => EARLY_SLOT_ONCE,
            },
            ring_gran: ring_pipe.map_or(0, |rp| rp.gran as u32),
            ring_mq: ring_pipe.map_or(0, |rp| rp.mq as u32),
            div_seq: FastDiv::new((units * vblocks) as u32),
            div_vb: FastDiv::new(vblocks as u32),
            div_grp: FastDiv::new(g.group() as u32),
        };
        let cfg = LaunchConfig {
            grid_dim: (grid as u32, 1, 1),
            block_dim: (warps as u32 * 32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: `params` matches the kernel's `struct KdaParams` (size checked at compile
        // time); every pointer in it refers to a live allocation validated above against the
        // geometry and the batch (the caller's borrows outlive the enqueue, and frees are
        // ordered on this stream after the kernel); the grid and block fit the kernel's
        // launch bounds (<= 256 threads; PIPE_THREADS for kda_eager_bulk_pipe); the pipelined
        // kernels' dynamic shared memory was checked against the device's opt-in limit and
        // their copies against the shape (`eager_plan`, `ring_plan`); every KDA kernel runs
        // `KDA_DEPENDENT_LAUNCH()`, the wait that a dependent launch needs, before any access
        // that could see the previous grid's writes (before it: the host-written slots and
        // sequence bounds, and L2 prefetches with `early`).
        unsafe { launch_kda(s, &func, cfg, &params, dependent) }
            .map_err(|e| device_err(&format!("{name} launch"), e))?;
        *layer.epoch = epoch;
        Ok(())
    }
}

/// Most items of a spec_verify call by a ring kernel that launches as a dependent launch by
/// default: up to here it measured 1-12% faster than a plain launch on the H200 (T = 2 and 4,
/// fp32 and fp16 pools), at 768 items level to 4% faster, from 2048 items 1-5% slower
/// (docs/performance.md, twentieth session).
const SPEC_DEPENDENT_UPTO: usize = 512;

/// Whether a call of `op` launches as a programmatic dependent launch, given the backend's
/// choice (`CudaBackend::set_dependent_launch`; `None`: decode, and spec_verify calls of at
/// most [`SPEC_DEPENDENT_UPTO`] items by a ring kernel (`ring_items`), where it was measured
/// faster) and whether the device has it (`capable`: sm_90 and later).
fn dependent_launch(
    op: Op,
    ring_items: Option<usize>,
    choice: Option<bool>,
    capable: bool,
) -> bool {
    capable
        && choice.unwrap_or(match op {
            Op::Decode => true,
            Op::SpecVerify => ring_items.is_some_and(|items| items <= SPEC_DEPENDENT_UPTO),
            Op::Replay | Op::Prefill => false,
        })
}

/// Launches `func(params)` on `stream`; with `dependent`, as a programmatic dependent launch:
/// its CTAs may be scheduled while the previous kernel on the stream retires, and wait for it
/// (`KDA_DEPENDENT_LAUNCH` in `kernels/kda_compat.cuh`) before any access that could see its
/// writes.
///
/// # Safety
/// As for any kernel launch: `params` must match the kernel's parameter and every pointer in
/// it must stay valid until the kernel has run; with `dependent`, the kernel must run
/// `KDA_DEPENDENT_LAUNCH()` before any access that could see the previous kernel's writes.
unsafe fn launch_kda(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    params: &KdaParams,
    dependent: bool,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    stream.context().bind_to_thread()?;
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value: sys::CUlaunchAttributeValue {
            programmaticStreamSerializationAllowed: 1,
        },
    };
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(dependent),
    };
    let mut args = [params as *const KdaParams as *mut std::ffi::c_void];
    // SAFETY: the config, its one attribute and the argument array live across the call; the
    // caller vouches for the kernel and its parameter.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

/// One call's arguments, before validation.
struct Call<'a, 'b> {
    op: Op,
    code: OpCode,
    batch: &'a CudaBatch,
    accepted: Option<&'a IndexView<'b, Buf>>,
    inputs: Option<&'a StepInputs<'b, Buf>>,
    a_log: Option<&'a TensorView<'b, Buf>>,
    dt_bias: Option<&'a TensorView<'b, Buf>>,
    opts: &'a KdaOptions,
    /// Output dtype, elements, buffer bytes.
    out_shape: Option<(Dtype, usize, usize)>,
    out_buf: Option<&'a CudaBuffer>,
}

impl<'a, 'b> Call<'a, 'b> {
    fn tokens(
        op: Op,
        batch: &'a CudaBatch,
        accepted: Option<&'a IndexView<'b, Buf>>,
        inputs: &'a StepInputs<'b, Buf>,
        opts: &'a KdaOptions,
        out: &'a TensorViewMut<'_, Buf>,
    ) -> Self {
        Self {
            op,
            code: if op == Op::Decode {
                OpCode::Decode
            } else {
                OpCode::Spec
            },
            batch,
            accepted,
            inputs: Some(inputs),
            a_log: None,
            dt_bias: None,
            opts,
            out_shape: Some((out.dtype, out.len, out.buf.len())),
            out_buf: Some(&*out.buf),
        }
    }

    fn replay(
        batch: &'a CudaBatch,
        accepted: Option<&'a IndexView<'b, Buf>>,
        opts: &'a KdaOptions,
        a_log: Option<&'a TensorView<'b, Buf>>,
        dt_bias: Option<&'a TensorView<'b, Buf>>,
    ) -> Self {
        Self {
            op: Op::Replay,
            code: OpCode::Replay,
            batch,
            accepted,
            inputs: None,
            a_log,
            dt_bias,
            opts,
            out_shape: None,
            out_buf: None,
        }
    }
}

impl Backend for CudaBackend {
    type Memory = CudaMemory;
    type Batch = CudaBatch;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn memory(&self) -> &CudaMemory {
        &self.mem
    }

    fn prepare(&self, plan: BatchPlan) -> Result<CudaBatch> {
        let to_u32 = |x: usize, what: &'static str| {
            u32::try_from(x).map_err(|_| {
                KernelError::arg(
                    what,
                    format!("value {x} does not fit the device's u32 indices"),
                )
            })
        };
        let bounds = plan
            .bounds
            .iter()
            .map(|&b| to_u32(b, "cu_seqlens"))
            .collect::<Result<Vec<u32>>>()?;
        let bounds = self.mem.upload_slice(&bounds)?;
        let slots = self.mem.upload_slice(&plan.slots)?;
        Ok(CudaBatch {
            plan,
            bounds,
            slots,
        })
    }

    /// Validates the call like every operation (bad input is an argument error naming it),
    /// then reports that the CUDA prefill is not supported yet; the pool is left unchanged.
    fn prefill(
        &self,
        batch: &CudaBatch,
        inputs: &StepInputs<'_, Buf>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf>,
        out: &mut TensorViewMut<'_, Buf>,
    ) -> Result<()> {
        let call = Call::tokens(Op::Prefill, batch, None, inputs, opts, &*out);
        self.validate(&call, layer, true)?;
        Err(KernelError::Unsupported {
            backend: "cuda",
            op: "prefill",
        })
    }

    fn decode(
        &self,
        batch: &CudaBatch,
        inputs: &StepInputs<'_, Buf>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf>,
        out: &mut TensorViewMut<'_, Buf>,
    ) -> Result<()> {
        let call = Call::tokens(Op::Decode, batch, None, inputs, opts, &*out);
        self.run(call, layer, true)
    }

    fn spec_verify(
        &self,
        batch: &CudaBatch,
        accepted: &IndexView<'_, Buf>,
        inputs: &StepInputs<'_, Buf>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf>,
        out: &mut TensorViewMut<'_, Buf>,
    ) -> Result<()> {
        let call = Call::tokens(Op::SpecVerify, batch, Some(accepted), inputs, opts, &*out);
        self.run(call, layer, true)
    }

    fn replay(
        &self,
        batch: &CudaBatch,
        accepted: Option<&IndexView<'_, Buf>>,
        opts: &KdaOptions,
        a_log: Option<&TensorView<'_, Buf>>,
        dt_bias: Option<&TensorView<'_, Buf>>,
        layer: &mut LayerMut<'_, Buf>,
    ) -> Result<()> {
        let call = Call::replay(batch, accepted, opts, a_log, dt_bias);
        self.run(call, layer, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        // fp32 K-first pools from 512 heads: whole heads (8 warps), the rows of each lane group
        // shifted by a warp's columns in shared memory
        for heads in [512, 8192] {
            let p = eager_plan(&with_bulk(4, heads, false)).expect("plan");
            assert_eq!(p.tile, Some(TileMove::Bulk), "{heads} heads");
            assert_eq!((p.warps, p.vblocks), (8, 1));
            assert_eq!(p.smem, (128 * 128 + 8 * 16) * 4);
        }
        assert_ne!(mv(&with_bulk(4, 511, false)), Some(TileMove::Bulk));
        assert_ne!(mv(&with_bulk(4, 384, false)), Some(TileMove::BulkIn));
        // 2-byte K-first pools at 384-2559 heads: the bulk pipe, six buffers of whole heads
        for heads in [384, 768, 1920, 2559] {
            let p = eager_plan(&with_bulk(2, heads, false)).expect("plan");
            assert_eq!(
                (p.tile, p.warps, p.stages),
                (Some(TileMove::Pipe), 8, 6),
                "{heads} heads"
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
        assert!(!once(4, 8192, false));
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
        // by default: 2-byte K-first pools from 2560 heads on a device with bulk copies, whole
        // heads, the slot read once
        for heads in [2560, 3072, 8192] {
            let p = eager_plan(&with_bulk(2, heads, false)).expect("plan");
            assert_eq!(
                (p.tile, p.warps, p.vblocks, p.slot_once),
                (Some(TileMove::Stream), 8, 1, true),
                "{heads} heads"
            );
            assert_eq!(p.smem, (128 * 128 + 8 * 16) * 2);
        }
        // not below, not for fp32 or V-first pools, not without bulk copies, not where another
        // kernel or 4-warp items are asked for
        for (size, v_first) in [(2, false), (2, true), (4, false), (4, true)] {
            for heads in [12, 96, 384, 768, 1536, 2048, 2559, 3072, 8192] {
                if size == 2 && !v_first && heads >= 2560 {
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
    fn dependent_launch_is_for_decode_and_small_ring_spec_calls_on_sm90_unless_chosen() {
        for op in [Op::Decode, Op::SpecVerify, Op::Replay] {
            for ring_items in [None, Some(1), Some(SPEC_DEPENDENT_UPTO), Some(8192)] {
                let case = format!("{op:?}, {ring_items:?} ring items");
                let small_ring_spec =
                    op == Op::SpecVerify && ring_items.is_some_and(|i| i <= SPEC_DEPENDENT_UPTO);
                assert_eq!(
                    dependent_launch(op, ring_items, None, true),
                    op == Op::Decode || small_ring_spec,
                    "{case} by default"
                );
                assert!(
                    dependent_launch(op, ring_items, Some(true), true),
                    "{case} when asked for"
                );
                assert!(
                    !dependent_launch(op, ring_items, Some(false), true),
                    "{case} when turned off"
                );
                for choice in [None, Some(true)] {
                    assert!(
                        !dependent_launch(op, ring_items, choice, false),
                        "{case}: never before sm_90 (the kernels' wait is compiled out there)"
                    );
                }
            }
        }
        // a spec call of kda_step (no ring plan: stochastic rounding) launches plainly
        assert!(!dependent_launch(Op::SpecVerify, None, None, true));
        assert!(!dependent_launch(
            Op::SpecVerify,
            Some(SPEC_DEPENDENT_UPTO + 1),
            None,
            true
        ));
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

    #[test]
    fn eager_plan_refuses_shapes_without_whole_16_byte_copies() {
        let mut e = shape(4, 12, false);
        e.k = 5;
        e.v = 7;
        assert!(eager_plan(&e).is_none());
    }
}
