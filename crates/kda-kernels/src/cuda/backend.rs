//! [`CudaBackend`]: the [`Backend`] of the CUDA device, one kernel launch per operation: an
//! eager kernel for eager decode, a ring kernel with a ring, `kda_step` where neither fits
//! (the launch plans of `eager_plan` and `ring_plan` choose) and for prefill, which it runs
//! token by token, or chunked ([`PrefillKernel::Chunked`]: three kernels per window of chunks,
//! then with a ring one that empties the rings).
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

use super::chunk_plan::{
    chunk_supported, max_chunks, out_smem, out_vblocks, prefer_chunked, prep_ctas, prep_smem,
    prep_staged, state_columns, state_smem, vblocks, windows, ChunkParams, ScratchLayout, BV,
    BV_NARROW, DEFAULT_SCRATCH_BYTES, OUT_THREADS, PREP_THREADS, STATE_THREADS,
};
use super::eager_plan::{eager_plan, EagerPlan, EagerShape, PIPE_THREADS, STREAM_CTAS_PER_SM};
use super::kernel::Kernel;
use super::lanes::warp_columns;
use super::memory::{CudaBuffer, CudaMemory};
use super::nvrtc::CodeKind;
use super::params::{
    FastDiv, KdaParams, OpCode, EARLY_PREFETCH, EARLY_SLOT_ONCE, ERR_ACCEPTED, ERR_DECODE_DRAFTS,
    ERR_META, NO_SLOT,
};
use super::registry::{
    chunk_kernels, device_arch, eager_kernel, eager_tile_kernel, ring_kernel, ring_tile_kernel,
    step_kernel, warm_up, StepKey, TileMove,
};
use super::ring_plan::{ring_choice, RingShape, RING_THREADS};
use crate::api::{
    Backend, BatchKind, BatchPlan, BetaMode, GateMode, IndexView, KdaOptions, StepInputs,
    TensorView, TensorViewMut,
};
use crate::choice::{EagerKernel, PrefillKernel, RingKernel};
use crate::cpu::validate::{
    check_accepted, check_layer, validate_call, CallArgs, Op, PreparedPlan,
};
use crate::error::{KernelError, Result};
use crate::precompile::GpuArch;

type Buf = CudaBuffer;

/// A batch prepared for the CUDA backend: the validated plan and device copies of the
/// sequence bounds and slots (`u32`). [`Backend::prepare`] makes one for its plan;
/// [`Backend::prepare_padded`] one padded to a fixed number of sequences, whose live sequences
/// and their slots [`Backend::update_batch`] changes in place (for CUDA graphs).
pub struct CudaBatch {
    /// The plans: what a call computes (a padded batch's live sequences), the padded shape.
    plans: PreparedPlan,
    bounds: CudaBuffer,
    slots: CudaBuffer,
    /// A padded batch's `u32 [2]` on the device: the live sequences (the kernels'
    /// `live_seqs`) and the epoch offset (`call_epoch`); `None` for [`Backend::prepare`]'s.
    live: Option<CudaBuffer>,
    /// The chunked prefill's tables of this batch, built on its first chunked prefill and kept
    /// (so later calls upload nothing and a CUDA graph can capture them).
    chunk_tables: Mutex<Option<ChunkTables>>,
}

/// A batch's chunked-prefill tables on the device, for windows of at most `max_chunks` chunks
/// (with pieces for empty sequences where `keep_empty`: pools with a ring).
struct ChunkTables {
    max_chunks: usize,
    keep_empty: bool,
    /// Per window: its chunks and pieces (`chunk_plan::Window`) and their counts.
    windows: Vec<(CudaBuffer, CudaBuffer, usize, usize)>,
    /// Chunks of the largest window.
    most: usize,
}

impl CudaBatch {
    /// The sequences the kernels are launched for: every one of the plan, or a padded batch's
    /// padded size (its tail is not computed).
    pub fn capacity(&self) -> usize {
        self.plans.capacity()
    }

    /// Whether the batch was prepared by [`Backend::prepare_padded`].
    pub fn is_padded(&self) -> bool {
        self.kind() == BatchKind::Padded
    }

    /// The kind of the batch, which picks its kernels' modules: padded where it has a live
    /// count for them to read.
    pub fn kind(&self) -> BatchKind {
        if self.live.is_some() {
            BatchKind::Padded
        } else {
            BatchKind::Plain
        }
    }
}

impl std::fmt::Debug for CudaBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBatch")
            .field("plans", &self.plans)
            .finish()
    }
}

impl AsRef<BatchPlan> for CudaBatch {
    fn as_ref(&self) -> &BatchPlan {
        self.plans.as_ref()
    }
}

/// A raw CUDA stream handle (`CUstream`, `cudaStream_t`), as [`CudaBackend::on_stream`] takes
/// and [`CudaBackend::raw_stream`] gives it.
pub type RawStream = *mut std::ffi::c_void;

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
    /// The prefill kernel asked for (`None`: `PrefillKernel::ByShape`).
    prefill_kernel: Mutex<Option<PrefillKernel>>,
    /// The chunked state pass's value columns per CTA asked for (`None`: by the window's shape,
    /// `chunk_plan::state_columns`).
    chunk_columns: Mutex<Option<usize>>,
    /// The chunked prefill's scratch (grown on demand, kept) and its budget, bytes.
    chunk_scratch: Mutex<(Option<CudaBuffer>, usize)>,
    /// Whether the device has programmatic dependent launch (sm_90 and later; the kernels'
    /// wait is compiled only there).
    has_dependent_launch: bool,
    /// Whether the device has bulk copies (`cp.async.bulk`, sm_90 and later), which the eager
    /// plan's own choice takes only then (elsewhere the bulk kernels' stand-in copies are slow).
    has_bulk_copies: bool,
    num_sms: u32,
    /// Dynamic shared memory one CTA may opt in to, bytes.
    smem_optin: usize,
    arch: GpuArch,
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

impl CudaBackend {
    /// The backend on device 0.
    pub fn new() -> Result<Self> {
        Self::on_device(0)
    }

    /// The backend on device `ordinal`, on a stream of its own. No driver, no device, no NVRTC
    /// or a `KDA_CUDA_CODE` other than `cubin` or `ptx` is [`KernelError::Unavailable`].
    pub fn on_device(ordinal: usize) -> Result<Self> {
        Self::open(ordinal, |ctx| {
            ctx.new_stream()
                .map_err(|e| unavailable(format!("stream: {e}")))
        })
    }

    /// The backend on device `ordinal`, running all its work (kernels, and the copies of its
    /// memory) on `stream`, a CUDA stream that another library owns: a serving engine's (for
    /// PyTorch, `torch.cuda.current_stream().cuda_stream`), so the KDA calls are ordered with
    /// the engine's kernels on that stream, with no host synchronisation and no events. Null is
    /// the legacy default stream. Errors as [`CudaBackend::on_device`].
    ///
    /// # Safety
    ///
    /// `stream` must be a live stream of device `ordinal`'s primary context (the context the
    /// CUDA runtime, and PyTorch, use) and stay alive until the backend, its memory and every
    /// buffer of that memory (a pool's planes too: they are freed on this stream) are dropped
    /// and the work queued on it has run.
    pub unsafe fn on_stream(ordinal: usize, stream: RawStream) -> Result<Self> {
        Self::open(ordinal, |ctx| {
            // SAFETY: the caller's promise above.
            Ok(unsafe { ctx.wrap_borrowed_stream(stream.cast()) })
        })
    }

    /// The stream the backend runs on (its own, or the one [`CudaBackend::on_stream`] took):
    /// an engine may enqueue its own work there, or record events on it, to order it with the
    /// KDA calls.
    pub fn raw_stream(&self) -> RawStream {
        self.stream().cu_stream().cast()
    }

    /// The backend on device `ordinal` with the stream `make_stream` gives for its context.
    fn open(
        ordinal: usize,
        make_stream: impl FnOnce(&Arc<CudaContext>) -> Result<Arc<CudaStream>>,
    ) -> Result<Self> {
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
        // SAFETY: every buffer of this backend is used on the single stream made below, so
        // no cross-stream synchronisation is needed (borrowed memory's other users are ordered
        // with it by the caller: `CudaMemory::borrow`).
        unsafe { ctx.disable_event_tracking() };
        let stream = make_stream(&ctx)?;
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
        let arch = device_arch(&ctx)?;
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
            prefill_kernel: Mutex::new(None),
            chunk_columns: Mutex::new(None),
            chunk_scratch: Mutex::new((None, DEFAULT_SCRATCH_BYTES)),
            has_dependent_launch: arch.major >= 9,
            has_bulk_copies: arch.major >= 9,
            num_sms,
            smem_optin,
            arch,
            device_name: format!("{name} ({arch}, {num_sms} SMs)"),
        })
    }

    /// The device's name, compute capability and multiprocessor count.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The device's architecture, the one its kernel modules compile for (and
    /// [`crate::precompile()`] may compile them for ahead of time).
    pub fn arch(&self) -> GpuArch {
        self.arch
    }

    /// Compiles and loads, several at a time, the kernels that calls on layers of these
    /// geometries use (inputs in each geometry's `ring_dtype`) on batches of `kinds` (each kind
    /// has its own modules: [`BatchKind`]), so that no later call waits for NVRTC. Without it a
    /// kernel module compiles on its first use, taking seconds (and a padded batch's first call
    /// is then better not inside a graph capture). An engine calls this once at startup with
    /// the geometries of its pools; modules already loaded are skipped. The first compile or
    /// load error, if any.
    pub fn warm_up(&self, geometries: &[PoolGeometry], kinds: &[BatchKind]) -> Result<()> {
        warm_up(&self.ctx, &StepKey::of_pools(geometries, kinds))
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
    /// `kda_eager_regs` for big K-first calls of K = V = 128 (1536-8192 value heads of 2-byte
    /// pools, 768-8192 of fp32 ones),
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

    /// Chooses the prefill kernel ([`PrefillKernel`]): `Steps` runs `kda_step` token by token;
    /// `Chunked` runs the chunked kernels where the call fits them (plain batches, `K % 16 ==
    /// 0`, `V % 8 == 0`, their shared memory within the device's), else `kda_step`; `None`
    /// (the default) and `ByShape` run them where they fit and a cost model of the call's shape
    /// expects them faster (a few long sequences; docs/performance.md, fifty-eighth session),
    /// else `kda_step`.
    pub fn set_prefill_kernel(&self, kernel: Option<PrefillKernel>) -> Result<()> {
        *self.prefill_kernel.lock() = kernel;
        Ok(())
    }

    /// Fixes the value columns per CTA of the chunked prefill's state pass (`kda_chunk_state`:
    /// 32; `kda_chunk_state_narrow`: 16), or lets each window's shape choose (`None`, the
    /// default: 16 where those CTAs fit the multiprocessors one each, as for one long sequence
    /// at 12 heads; `chunk_plan::state_columns`). Both give the same bits; a tuning and testing
    /// knob.
    pub fn set_chunk_state_columns(&self, columns: Option<usize>) -> Result<()> {
        if let Some(c) = columns {
            if c != BV && c != BV_NARROW {
                return Err(KernelError::arg(
                    "columns",
                    format!("is {c}; expected {} or {}", BV_NARROW, BV),
                ));
            }
        }
        *self.chunk_columns.lock() = columns;
        Ok(())
    }

    /// Bounds the chunked prefill's scratch (its f32 intermediates of each chunk and value
    /// head: about 213 KiB at K = V = 128; by default 768 MiB): a call whose chunks need more
    /// runs in windows of as many chunks as fit, one after another, each sequence's state
    /// carried in f32 from one to the next. The scratch is allocated on the first chunked
    /// prefill that needs it and kept (grown only); setting a budget frees it. At least one
    /// chunk per window, whatever the budget.
    pub fn set_prefill_scratch_bytes(&self, bytes: usize) -> Result<()> {
        *self.chunk_scratch.lock() = (None, bytes);
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

    /// Fixes the warps per CTA of eager decode and of prefill on eager pools (1..=8), or lets
    /// the backend choose (`None`).
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

    /// Device copies of a plan's bounds and slots, enqueued without waiting for the stream.
    fn upload_batch(&self, plan: &BatchPlan) -> Result<(CudaBuffer, CudaBuffer)> {
        let bounds = plan
            .bounds
            .iter()
            .map(|&b| {
                u32::try_from(b).map_err(|_| {
                    KernelError::arg(
                        "cu_seqlens",
                        format!("value {b} does not fit the device's u32 indices"),
                    )
                })
            })
            .collect::<Result<Vec<u32>>>()?;
        Ok((
            self.mem.upload_staged(&bounds)?,
            self.mem.upload_staged(&plan.slots)?,
        ))
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

    /// Prefill without host synchronisation (see the module docs).
    pub fn enqueue_prefill(
        &self,
        batch: &CudaBatch,
        inputs: &StepInputs<'_, Buf>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf>,
        out: &mut TensorViewMut<'_, Buf>,
    ) -> Result<()> {
        let call = Call::tokens(Op::Prefill, batch, None, inputs, opts, &*out);
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

    /// The dynamic shared memory `kda_eager_tile_stream` asks for: its tile's `smem`, or where
    /// that lets more than [`STREAM_CTAS_PER_SM`] CTAs of `threads` threads share an SM, the
    /// most that many can each have (by the driver's occupancy arithmetic; asked only then, as
    /// the driver refuses the question for a count that the kernel's registers do not allow).
    fn stream_smem(k: &Kernel, threads: usize, smem: usize) -> Result<usize> {
        if k.ctas_per_sm(threads as u32, smem)? <= STREAM_CTAS_PER_SM {
            return Ok(smem);
        }
        Ok(smem.max(k.smem_per_cta(STREAM_CTAS_PER_SM, threads as u32)?))
    }

    /// Opts a persistent kernel in to `smem` bytes of dynamic shared memory and returns its grid:
    /// the CTAs of `threads` threads that fit on all multiprocessors at once.
    fn persistent_grid(&self, k: &Kernel, threads: usize, smem: usize) -> Result<usize> {
        k.opt_in_smem(smem)?;
        let per_sm = k.ctas_per_sm(threads as u32, smem)?.max(1) as usize;
        Ok(per_sm * self.num_sms as usize)
    }

    /// Validates, then launches one kernel. `exact`: read the ring records and accepted
    /// counts back and validate them on the host (the [`Backend`] methods).
    fn run(&self, call: Call<'_, '_>, layer: &mut LayerMut<'_, Buf>, exact: bool) -> Result<()> {
        let checked = self.validate(&call, layer, exact)?;
        if self.chunked(&call, layer.geometry) {
            return self.launch_chunked(&call, layer);
        }
        self.launch(&call, checked.stores, layer, exact)
    }

    /// Whether a call runs the chunked prefill: a prefill of a plain batch, a head shape the
    /// kernels take on this device, and asked for ([`CudaBackend::set_prefill_kernel`]):
    /// `Chunked`, or `ByShape` (the default) where the call's shape is expected to run faster
    /// chunked ([`chunk_plan::prefer_chunked`]).
    fn chunked(&self, call: &Call<'_, '_>, g: &PoolGeometry) -> bool {
        call.op == Op::Prefill
            && call.batch.kind() == BatchKind::Plain
            && chunk_supported(g.k, g.v, self.smem_optin)
            && match *self.prefill_kernel.lock() {
                Some(PrefillKernel::Chunked) => true,
                Some(PrefillKernel::ByShape) | None => prefer_chunked(
                    &call.batch.plans.as_ref().bounds,
                    g.hv,
                    g.v,
                    self.num_sms as usize,
                ),
                Some(PrefillKernel::Steps) => false,
            }
    }

    /// The chunked prefill of a validated call: per window of chunks (`chunk_plan::windows`,
    /// within the scratch budget) `kda_chunk_prep` over every (chunk, value head),
    /// `kda_chunk_state` over every (piece, value head, block of columns), which folds a ring's
    /// pending entries into the state first (in f32, so a 2-byte pool rounds the state once),
    /// and `kda_chunk_out` over every (chunk, value head, block of columns); with a ring, then
    /// `kda_chunk_ring_reset` leaves every sequence's ring empty (its drafts dropped).
    fn launch_chunked(&self, call: &Call<'_, '_>, layer: &mut LayerMut<'_, Buf>) -> Result<()> {
        let g = layer.geometry;
        let plan = call.batch.plans.as_ref();
        let n = plan.num_seqs();
        if n == 0 {
            return Ok(());
        }
        let (k, v, hv) = (g.k, g.v, g.hv);
        let mut scratch = self.chunk_scratch.lock();
        let max = max_chunks(scratch.1, hv, k, v);
        let keep_empty = g.ring_len > 0;
        let mut tables = call.batch.chunk_tables.lock();
        if tables
            .as_ref()
            .is_none_or(|t| t.max_chunks != max || t.keep_empty != keep_empty)
        {
            *tables = Some(self.chunk_tables(&plan.bounds, max, keep_empty)?);
        }
        let t = tables.as_ref().expect("built above");
        if t.windows.is_empty() {
            return Ok(()); // no tokens and no ring: nothing to compute or store
        }
        let input = call.inputs.map_or(g.ring_dtype, |i| i.q.dtype);
        let kernels = chunk_kernels(&self.ctx, StepKey::of(g, input, BatchKind::Plain))?;
        let (prep_bytes, out_bytes) = (prep_smem(k, v), out_smem(k));
        let staged = prep_staged(input.size(), k, v);
        kernels.prep.opt_in_smem(prep_bytes)?;
        kernels.out.opt_in_smem(out_bytes)?;
        let columns = *self.chunk_columns.lock();
        let lay = ScratchLayout::new(t.most, hv, k, v);
        if scratch.0.as_ref().is_none_or(|b| b.len() < 4 * lay.floats) {
            scratch.0 = None; // freed (stream-ordered) before the larger one is allocated
            scratch.0 = Some(self.mem.alloc_zeroed(4 * lay.floats)?);
        }
        let buf = scratch.0.as_ref().expect("allocated above");
        let s = self.stream();
        let base = buf.device_ptr(s);
        let at = |floats: usize| base + 4 * floats as u64;
        let epoch = *layer.epoch + 1;
        let err = self.err.lock();
        let params = self.call_params(call, layer, n, epoch, &err);
        for (chunks, pieces, n_chunks, n_pieces) in &t.windows {
            let bv =
                columns.unwrap_or_else(|| state_columns(*n_pieces, hv, v, self.num_sms as usize));
            let (state, state_bytes) = if bv == BV {
                (&kernels.state, state_smem(k, BV))
            } else {
                (&kernels.state_narrow, state_smem(k, BV_NARROW))
            };
            state.opt_in_smem(state_bytes)?;
            let cp = ChunkParams {
                chunks: chunks.device_ptr(s),
                pieces: pieces.device_ptr(s),
                w: at(lay.w),
                qg: at(lay.qg),
                kg: at(lay.kg),
                u: at(lay.u),
                aqk: at(lay.aqk),
                gl: at(lay.gl),
                hs: at(lay.hs),
                carry: at(lay.carry),
                prep_items: (n_chunks * hv) as u64,
            };
            let prep = prep_ctas(n_chunks * hv, staged, self.num_sms as usize);
            for (kernel, ctas, threads, smem) in [
                (&kernels.prep, prep, PREP_THREADS, prep_bytes),
                (
                    state,
                    n_pieces * hv * vblocks(v, bv),
                    STATE_THREADS,
                    state_bytes,
                ),
                (
                    &kernels.out,
                    n_chunks * hv * out_vblocks(v),
                    OUT_THREADS,
                    out_bytes,
                ),
            ] {
                if ctas == 0 {
                    continue; // a window of empty sequences only: no chunk to prepare
                }
                let cfg = LaunchConfig {
                    grid_dim: (ctas as u32, 1, 1),
                    block_dim: (threads as u32, 1, 1),
                    shared_mem_bytes: smem as u32,
                };
                let mut args = [
                    &params as *const KdaParams as *mut std::ffi::c_void,
                    &cp as *const ChunkParams as *mut std::ffi::c_void,
                ];
                // SAFETY: the kernels take (KdaParams, KdaChunkParams), which `params` and `cp`
                // match (sizes checked at compile time); every pointer in them refers to a live
                // allocation validated against the geometry and the batch, the window's tables
                // (kept with the batch) and the scratch (sized by `ScratchLayout` for the
                // largest window's chunks, kept by the backend); the grid is at most the
                // window's chunks times the value heads (`prep_items`, which the preparation's
                // CTAs loop over), or pieces x blocks, or chunks x blocks times the value heads;
                // the block the kernels' launch bounds, the shared memory opted in above. Each
                // reads what the one before it wrote, ordered by the stream; none waits on a
                // previous grid by itself, so none launches as a dependent launch.
                unsafe { launch_args(s, kernel.func(), cfg, &mut args, false) }
                    .map_err(|e| device_err(&format!("{} launch", kernel.name()), e))?;
            }
        }
        if g.ring_len > 0 {
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(128) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let reset = &kernels.ring_reset;
            // SAFETY: `kda_chunk_ring_reset` takes the KdaParams `params` matches; it writes
            // the ring records (`meta`, validated with the layer) of the batch's `n` slots, one
            // thread each, ordered on the stream after the state kernels that read them.
            unsafe { launch_kda(s, reset.func(), cfg, &params, false) }
                .map_err(|e| device_err(&format!("{} launch", reset.name()), e))?;
        }
        *layer.epoch = epoch;
        Ok(())
    }

    /// A batch's chunked-prefill tables (sequence `bounds`) for windows of at most `max`
    /// chunks (`keep_empty`: pieces for empty sequences), uploaded without waiting for the
    /// stream.
    fn chunk_tables(&self, bounds: &[usize], max: usize, keep_empty: bool) -> Result<ChunkTables> {
        let wins = windows(bounds, max, keep_empty);
        let mut out = Vec::with_capacity(wins.len());
        for w in &wins {
            out.push((
                self.mem.upload_staged(w.chunks.as_flattened())?,
                self.mem.upload_staged(w.pieces.as_flattened())?,
                w.chunks.len(),
                w.pieces.len(),
            ));
        }
        Ok(ChunkTables {
            max_chunks: max,
            keep_empty,
            most: wins.iter().map(|w| w.chunks.len()).max().unwrap_or(0),
            windows: out,
        })
    }

    /// The host-side checks of a call (see [`CudaBackend::run`]).
    fn validate(
        &self,
        call: &Call<'_, '_>,
        layer: &LayerMut<'_, Buf>,
        exact: bool,
    ) -> Result<crate::cpu::validate::CallPlan> {
        let g = layer.geometry;
        let plan = call.batch.plans.as_ref();
        let n = plan.num_seqs();
        check_layer(&self.mem, g, layer.ssm, layer.ring, layer.meta, layer.delta)?;
        call.batch.plans.check_call(call.op, g)?;
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
            check_accepted(&self.mem, acc, call.batch.capacity())?;
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
                tensor_tokens: call.batch.plans.tensor_tokens(),
            },
        )
    }

    /// The fields of a call's parameter block that its launch plan does not decide (those are
    /// left 0): the tensors, the layer's planes, the batch, the options, the rounding, `n`
    /// sequences and the store `epoch`.
    fn call_params(
        &self,
        call: &Call<'_, '_>,
        layer: &LayerMut<'_, Buf>,
        n: usize,
        epoch: u64,
        err: &CudaBuffer,
    ) -> KdaParams {
        let g = layer.geometry;
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
        let inputs = call.inputs;
        let (a_log, dt_bias) = match inputs {
            Some(i) => (opt_ptr(i.a_log.as_ref()), opt_ptr(i.dt_bias.as_ref())),
            None => (opt_ptr(call.a_log), opt_ptr(call.dt_bias)),
        };
        KdaParams {
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
            err: ptr(err),
            live: call.batch.live.as_ref().map_or(0, ptr),
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
            ..KdaParams::default()
        }
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
        // a padded batch launches for its capacity, whatever its live count now (a graph
        // captured with it replays for every later one)
        let n = call.batch.capacity();
        let tokens = matches!(call.op, Op::Decode | Op::Prefill);
        if n == 0 || (g.ring_len == 0 && !tokens) {
            // Nothing can change: no sequences, or spec_verify / replay without a ring (every
            // sequence then has no tokens, no drafts and nothing pending).
            return Ok(());
        }
        let may_store = if exact {
            stores
        } else {
            g.ring_len > 0 || tokens
        };
        // bumped once the kernel is launched: a call refused on its way there (a kernel that
        // does not compile, a driver query that fails) changes nothing
        let epoch = *layer.epoch + u64::from(may_store);
        let input = match call.inputs {
            Some(i) => i.q.dtype,
            None => g.ring_dtype,
        };
        let key = StepKey::of(g, input, call.batch.kind());
        let s = self.stream();
        let sr = matches!(g.rounding, Rounding::Stochastic { .. });
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
        // a prefill runs kda_step (its token loop takes sequences of any length)
        let ring_pipe = if ring && call.op != Op::Prefill {
            let plan = call.batch.plans.launch_plan();
            let shape = RingShape {
                k: g.k,
                v: g.v,
                state_size: g.state_dtype.size(),
                input_size: input.size(),
                ring_len: g.ring_len,
                entry_bytes: g.ring_entry_elems() * input.size(),
                max_new: (0..n).map(|i| plan.len_of(i)).max().unwrap_or(0),
                heads: n * g.hv,
                stochastic: sr,
                deltas: g.ring_deltas,
                v_first: g.layout == StateLayout::VFirst,
                decode: call.op == Op::Decode,
                smem_optin: self.smem_optin,
            };
            ring_choice(&shape, call.op, *self.ring_kernel.lock())
        } else {
            None
        };
        let (kernel, smem, grid_cap) = match (pipe, ring_pipe) {
            (
                Some(EagerPlan {
                    tile: Some(TileMove::Pipe),
                    smem,
                    ..
                }),
                _,
            ) => {
                let k = eager_tile_kernel(&self.ctx, key, TileMove::Pipe)?;
                let grid = self.persistent_grid(&k, PIPE_THREADS, smem)?;
                (k, smem, Some(grid))
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
                let k = eager_tile_kernel(&self.ctx, key, mv)?;
                let smem = if mv == TileMove::Stream {
                    Self::stream_smem(&k, warps * 32, smem)?
                } else {
                    smem
                };
                // (none for kda_eager_tile, which has no dynamic shared memory)
                if smem > 0 {
                    k.opt_in_smem(smem)?;
                }
                (k, smem, None)
            }
            (Some(pl), _) => {
                let k = eager_kernel(&self.ctx, key, pl.stage_store)?;
                let grid = self.persistent_grid(&k, pl.warps * 32, pl.smem)?;
                (k, pl.smem, Some(grid))
            }
            (None, Some(rp)) if rp.kernel != RingKernel::Pipelined => {
                let k = ring_tile_kernel(&self.ctx, key, rp.kernel)?;
                k.opt_in_smem(rp.smem)?;
                (k, rp.smem, None)
            }
            (None, Some(rp)) => {
                let k = ring_kernel(&self.ctx, key)?;
                let grid = self.persistent_grid(&k, RING_THREADS, rp.smem)?;
                (k, rp.smem, Some(grid))
            }
            (None, None) => (step_kernel(&self.ctx, key)?, 0, None),
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
            let w = step_warps(
                call.op,
                warps_per_head,
                n * g.hv,
                self.num_sms as usize,
                fixed_warps,
            );
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
        let dependent = dependent_launch(
            call.op,
            ring_pipe.map(|_| items),
            *self.dependent_launch.lock(),
            self.has_dependent_launch,
        );
        let params = KdaParams {
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
            ..self.call_params(call, layer, n, epoch, &err)
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
        unsafe { launch_kda(s, kernel.func(), cfg, &params, dependent) }
            .map_err(|e| device_err(&format!("{} launch", kernel.name()), e))?;
        *layer.epoch = epoch;
        Ok(())
    }
}

/// Warps per CTA of `kda_step` on an eager pool (a value head's block of columns per CTA;
/// `warps_per_head` warps cover a head), unless fixed (`CudaBackend::set_eager_warps`). Decode:
/// 2, measured best on the H200 for N >= 64 (docs/performance.md), or 1 where that leaves
/// fewer than two CTAs per SM (`heads` value heads, `num_sms` SMs). Prefill: 4 (or fewer where
/// fewer cover the head). A prefill CTA steps token after token, each chunk's tokens activated
/// first by its warps, one token per warp at a time: one or two warps activate a chunk's eight
/// tokens one after another (and every column block repeats that), while eight warps on an SM
/// share its four schedulers, two warps to each, in the token steps, which issue about as many
/// instructions as they wait. Four is one warp per scheduler and two tokens per warp. Reasoned,
/// not measured yet (docs/performance.md, fifty-fourth session; `bench --op prefill --warps`
/// times the others).
fn step_warps(
    op: Op,
    warps_per_head: usize,
    heads: usize,
    num_sms: usize,
    fixed: Option<u32>,
) -> usize {
    if let Some(w) = fixed {
        return w as usize;
    }
    if op == Op::Prefill {
        return warps_per_head.min(4);
    }
    let w2 = warps_per_head.min(2);
    if heads * warps_per_head.div_ceil(w2) < 2 * num_sms {
        1
    } else {
        w2
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
    let mut args = [params as *const KdaParams as *mut std::ffi::c_void];
    // SAFETY: the caller's guarantees, for the one parameter.
    unsafe { launch_args(stream, func, cfg, &mut args, dependent) }
}

/// Launches `func` with the kernel parameters `args` (pointers to each) on `stream`, as
/// [`launch_kda`] does.
///
/// # Safety
/// As for [`launch_kda`], for every parameter of `args`, which must be the kernel's in order.
unsafe fn launch_args(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    args: &mut [*mut std::ffi::c_void],
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
    // SAFETY: the config, its one attribute and the argument array live across the call; the
    // caller vouches for the kernel and its parameters.
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
            code: match op {
                Op::Decode => OpCode::Decode,
                Op::Prefill => OpCode::Prefill,
                Op::SpecVerify => OpCode::Spec,
                Op::Replay => OpCode::Replay,
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

    /// Uploads the bounds and slots without waiting for the stream (the copies are ordered
    /// before every later call on it).
    fn prepare(&self, plan: BatchPlan) -> Result<CudaBatch> {
        let plans = PreparedPlan::plain(plan)?;
        let (bounds, slots) = self.upload_batch(plans.as_ref())?;
        Ok(CudaBatch {
            plans,
            bounds,
            slots,
            live: None,
            chunk_tables: Mutex::new(None),
        })
    }

    /// The kernels launch for the padded size and read a live count the update writes next to
    /// the slots (docs/architecture.md, "Padded batches").
    fn prepare_padded(&self, plan: BatchPlan, slot_bound: usize) -> Result<CudaBatch> {
        let plans = PreparedPlan::padded(plan, slot_bound)?;
        let (bounds, slots) = self.upload_batch(plans.as_ref())?;
        let live = self.mem.upload_staged(&[plans.capacity() as u32, 0])?;
        Ok(CudaBatch {
            plans,
            bounds,
            slots,
            live: Some(live),
            chunk_tables: Mutex::new(None),
        })
    }

    /// Two copies on the stream, without a wait: the slots, then the live count and the
    /// epoch offset ([`crate::cpu::validate::PaddedShape::epoch_offset`]), which the kernels add to the epoch a
    /// graph captured, so each step of a replayed graph rounds with fresh bits. (A failed
    /// copy, a device error, may leave the device's words behind the host's plan.)
    fn update_batch(&self, batch: &mut CudaBatch, slots: &[u32]) -> Result<()> {
        let Some(live) = batch.live.as_mut() else {
            // a plain batch: the plans' argument error
            return batch.plans.update(slots);
        };
        batch.plans.update(slots)?;
        let plan = batch.plans.as_ref();
        // from the plan's own copy: the caller's slice may be pinned memory
        self.mem
            .write_staged(&mut batch.slots, 0, bytemuck::cast_slice(&plan.slots))?;
        let words = [plan.num_seqs() as u32, batch.plans.epoch_offset()];
        self.mem
            .write_staged(live, 0, bytemuck::cast_slice(&words))?;
        Ok(())
    }

    /// Prefill token by token on `kda_step`, or in chunks (`kda_chunk_prep`, `kda_chunk_state`,
    /// `kda_chunk_out`) where [`CudaBackend::set_prefill_kernel`]'s choice takes them: the CPU
    /// backend's result up to the f32 arithmetic's order (docs/architecture.md).
    fn prefill(
        &self,
        batch: &CudaBatch,
        inputs: &StepInputs<'_, Buf>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf>,
        out: &mut TensorViewMut<'_, Buf>,
    ) -> Result<()> {
        let call = Call::tokens(Op::Prefill, batch, None, inputs, opts, &*out);
        self.run(call, layer, true)
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

    #[test]
    fn step_warps_are_four_for_prefill_and_one_or_two_for_decode() {
        // K = V = 128: eight warps of 16 columns cover a head; 132 SMs
        assert_eq!(step_warps(Op::Prefill, 8, 12, 132, None), 4);
        assert_eq!(step_warps(Op::Prefill, 8, 4096, 132, None), 4);
        assert_eq!(step_warps(Op::Prefill, 3, 12, 132, None), 3);
        // decode: 2 where that leaves two CTAs per SM (64 x 12 heads: 3072 CTAs), else 1
        assert_eq!(step_warps(Op::Decode, 8, 768, 132, None), 2);
        assert_eq!(step_warps(Op::Decode, 8, 12, 132, None), 1);
        assert_eq!(step_warps(Op::Decode, 1, 768, 132, None), 1);
        for op in [Op::Prefill, Op::Decode] {
            assert_eq!(step_warps(op, 8, 12, 132, Some(4)), 4, "{op:?}: fixed");
        }
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
}
