//! The CUDA backend's stand-in when the crate is built without the `cuda` feature: the same
//! names and signatures, so callers need no `cfg`; [`CudaBackend::new`] reports
//! [`KernelError::Unavailable`] and no value of these types can exist.

use state_pool::{DeviceMemory, Dtype, LayerMut, PoolGeometry};

use crate::api::{
    Backend, BatchPlan, IndexView, KdaOptions, StepInputs, TensorView, TensorViewMut,
};
use crate::choice::{EagerKernel, PrefillKernel, RingKernel};
use crate::error::{KernelError, Result};

/// Stand-in for the CUDA backend (uninhabited: [`CudaBackend::new`] always fails).
#[derive(Debug)]
pub enum CudaBackend {}

/// Stand-in for a prepared CUDA batch (uninhabited).
#[derive(Debug)]
pub enum CudaBatch {}

/// Stand-in for a device buffer (uninhabited).
#[derive(Debug)]
pub enum CudaBuffer {}

/// Stand-in for the CUDA device memory (uninhabited).
#[derive(Debug, Clone)]
pub enum CudaMemory {}

/// Stand-in for a captured CUDA graph (uninhabited).
#[derive(Debug)]
pub enum CapturedGraph {}

/// The device time of one copy in one launch shape (as the CUDA backend's `CopyTime`).
#[derive(Debug, Clone, PartialEq)]
pub struct CopyTime {
    /// The launch shape, in words.
    pub shape: String,
    /// Mean device time of one copy in microseconds.
    pub us: f64,
}

fn not_built() -> KernelError {
    KernelError::Unavailable {
        backend: "cuda",
        reason: "built without the cuda feature".into(),
    }
}

/// [`crate::precompile`] without the `cuda` feature: always [`KernelError::Unavailable`].
pub(crate) fn precompile_modules(
    _dir: &std::path::Path,
    _arch: crate::precompile::GpuArch,
    _geometries: &[PoolGeometry],
    _kinds: &[crate::BatchKind],
) -> Result<Vec<crate::precompile::PrecompiledModule>> {
    Err(not_built())
}

impl AsRef<BatchPlan> for CudaBatch {
    fn as_ref(&self) -> &BatchPlan {
        match *self {}
    }
}

impl CudaBatch {
    /// The sequences the kernels are launched for.
    pub fn capacity(&self) -> usize {
        match *self {}
    }
    /// Whether the batch was prepared by `prepare_padded`.
    pub fn is_padded(&self) -> bool {
        match *self {}
    }
    /// The kind of the batch, which picks its kernels' modules.
    pub fn kind(&self) -> crate::BatchKind {
        match *self {}
    }
}

impl CudaBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match *self {}
    }
    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        match *self {}
    }
    /// Whether the buffer is borrowed device memory.
    pub fn is_borrowed(&self) -> bool {
        match *self {}
    }
}

/// A raw CUDA stream handle (`CUstream`, `cudaStream_t`).
pub type RawStream = *mut std::ffi::c_void;

/// The alignment of borrowed device memory (as the CUDA backend's).
pub const BORROW_ALIGN: u64 = 16;

impl CapturedGraph {
    /// Enqueues one replay of the graph.
    pub fn launch(&self) -> Result<()> {
        match *self {}
    }
}

impl CudaMemory {
    /// A buffer over device memory another library owns.
    ///
    /// # Safety
    ///
    /// As the CUDA backend's (no value of this type exists).
    pub unsafe fn borrow(&self, _ptr: u64, _len: usize) -> Result<CudaBuffer> {
        match *self {}
    }
    /// A buffer holding a copy of `bytes`.
    pub fn upload(&self, _bytes: &[u8]) -> state_pool::Result<CudaBuffer> {
        match *self {}
    }
    /// A buffer holding a copy of `values`.
    pub fn upload_slice<T: bytemuck::Pod>(&self, _values: &[T]) -> state_pool::Result<CudaBuffer> {
        match *self {}
    }
    /// The whole buffer copied to the host.
    pub fn download(&self, _buf: &CudaBuffer) -> state_pool::Result<Vec<u8>> {
        match *self {}
    }
}

impl DeviceMemory for CudaMemory {
    type Buffer = CudaBuffer;
    fn name(&self) -> &'static str {
        match *self {}
    }
    fn alloc_zeroed(&self, _bytes: usize) -> state_pool::Result<CudaBuffer> {
        match *self {}
    }
    fn len(&self, _buf: &CudaBuffer) -> usize {
        match *self {}
    }
    fn write(&self, _dst: &mut CudaBuffer, _offset: usize, _src: &[u8]) -> state_pool::Result<()> {
        match *self {}
    }
    fn read(&self, _src: &CudaBuffer, _offset: usize, _dst: &mut [u8]) -> state_pool::Result<()> {
        match *self {}
    }
    fn zero(&self, _buf: &mut CudaBuffer, _offset: usize, _len: usize) -> state_pool::Result<()> {
        match *self {}
    }
    fn copy_within(
        &self,
        _buf: &mut CudaBuffer,
        _src_offset: usize,
        _dst_offset: usize,
        _len: usize,
    ) -> state_pool::Result<()> {
        match *self {}
    }
}

type Buf = CudaBuffer;

impl CudaBackend {
    /// Always [`KernelError::Unavailable`]: built without the `cuda` feature.
    pub fn new() -> Result<Self> {
        Err(not_built())
    }
    /// Always [`KernelError::Unavailable`]: built without the `cuda` feature.
    pub fn on_device(_ordinal: usize) -> Result<Self> {
        Err(not_built())
    }
    /// Always [`KernelError::Unavailable`]: built without the `cuda` feature.
    ///
    /// # Safety
    ///
    /// None needed here; the CUDA backend's asks for a live stream of the device.
    pub unsafe fn on_stream(_ordinal: usize, _stream: RawStream) -> Result<Self> {
        Err(not_built())
    }
    /// The stream the backend runs on.
    pub fn raw_stream(&self) -> RawStream {
        match *self {}
    }
    /// The device's description.
    pub fn device_name(&self) -> &str {
        match *self {}
    }
    /// The device's architecture.
    pub fn arch(&self) -> crate::precompile::GpuArch {
        match *self {}
    }
    /// Compiles and loads the kernels of these geometries ahead of their first use.
    pub fn warm_up(&self, _geometries: &[PoolGeometry], _kinds: &[crate::BatchKind]) -> Result<()> {
        match *self {}
    }
    /// Fixes the warps per CTA of eager decode and of prefill on eager pools.
    pub fn set_eager_warps(&self, _warps: Option<u32>) -> Result<()> {
        match *self {}
    }
    /// Chooses the eager-decode kernel (`None`: per call, from its shape).
    pub fn set_eager_kernel(&self, _kernel: Option<EagerKernel>) -> Result<()> {
        match *self {}
    }
    /// Chooses the kernel of calls with a ring (`None`: per call, from its shape).
    pub fn set_ring_kernel(&self, _kernel: Option<RingKernel>) -> Result<()> {
        match *self {}
    }
    /// Chooses the prefill kernel (`None`: token by token).
    pub fn set_prefill_kernel(&self, _kernel: Option<PrefillKernel>) -> Result<()> {
        match *self {}
    }
    /// Fixes the chunked prefill's state-pass value columns per CTA (16 or 32).
    pub fn set_chunk_state_columns(&self, _columns: Option<usize>) -> Result<()> {
        match *self {}
    }
    /// Bounds the chunked prefill's scratch, bytes.
    pub fn set_prefill_scratch_bytes(&self, _bytes: usize) -> Result<()> {
        match *self {}
    }
    /// Chooses whether the kernels launch as programmatic dependent launches.
    pub fn set_dependent_launch(&self, _on: Option<bool>) -> Result<()> {
        match *self {}
    }
    /// Fixes the pipeline stages of the pipelined eager kernel.
    pub fn set_eager_stages(&self, _stages: Option<u32>) -> Result<()> {
        match *self {}
    }
    /// Waits for all enqueued work.
    pub fn synchronize(&self) -> Result<()> {
        match *self {}
    }
    /// Reports the violations the kernels recorded.
    pub fn check_device_errors(&self) -> Result<()> {
        match *self {}
    }
    /// Decode without host synchronisation.
    pub fn enqueue_decode(
        &self,
        _batch: &CudaBatch,
        _inputs: &StepInputs<'_, Buf>,
        _opts: &KdaOptions,
        _layer: &mut LayerMut<'_, Buf>,
        _out: &mut TensorViewMut<'_, Buf>,
    ) -> Result<()> {
        match *self {}
    }
    /// Prefill without host synchronisation.
    pub fn enqueue_prefill(
        &self,
        _batch: &CudaBatch,
        _inputs: &StepInputs<'_, Buf>,
        _opts: &KdaOptions,
        _layer: &mut LayerMut<'_, Buf>,
        _out: &mut TensorViewMut<'_, Buf>,
    ) -> Result<()> {
        match *self {}
    }
    /// Speculative verify without host synchronisation.
    pub fn enqueue_spec_verify(
        &self,
        _batch: &CudaBatch,
        _accepted: &IndexView<'_, Buf>,
        _inputs: &StepInputs<'_, Buf>,
        _opts: &KdaOptions,
        _layer: &mut LayerMut<'_, Buf>,
        _out: &mut TensorViewMut<'_, Buf>,
    ) -> Result<()> {
        match *self {}
    }
    /// Replay without host synchronisation.
    pub fn enqueue_replay(
        &self,
        _batch: &CudaBatch,
        _accepted: Option<&IndexView<'_, Buf>>,
        _opts: &KdaOptions,
        _a_log: Option<&TensorView<'_, Buf>>,
        _dt_bias: Option<&TensorView<'_, Buf>>,
        _layer: &mut LayerMut<'_, Buf>,
    ) -> Result<()> {
        match *self {}
    }
    /// Captures the enqueued calls of `f` into a graph.
    pub fn capture(&self, _f: impl FnOnce() -> Result<()>) -> Result<CapturedGraph> {
        match *self {}
    }
    /// Mean device time of one graph replay in microseconds.
    pub fn time_graph(
        &self,
        _graph: &CapturedGraph,
        _warmup: usize,
        _replays: usize,
    ) -> Result<f64> {
        match *self {}
    }
    /// Device-to-device copy bandwidth in bytes per second (read plus write).
    pub fn copy_bandwidth(&self, _bytes: usize) -> Result<f64> {
        match *self {}
    }
    /// Device time of one copy of `bytes` bytes in a graph of `copies` copies, per launch
    /// shape of the copy kernel.
    pub fn time_copies(
        &self,
        _bytes: usize,
        _copies: usize,
        _warmup: usize,
        _replays: usize,
    ) -> Result<Vec<CopyTime>> {
        match *self {}
    }
    /// The same copy through a graph memcpy node, bytes per second.
    pub fn memcpy_bandwidth(&self, _bytes: usize) -> Result<f64> {
        match *self {}
    }
    /// Enqueues a device-to-device copy of `bytes` bytes.
    pub fn copy_device(
        &self,
        _src: &CudaBuffer,
        _dst: &mut CudaBuffer,
        _bytes: usize,
    ) -> Result<()> {
        match *self {}
    }
    /// Fills `buf` with pseudo-random values of `dtype`.
    pub fn fill_random(
        &self,
        _buf: &mut CudaBuffer,
        _dtype: Dtype,
        _seed: u32,
        _scale: f32,
    ) -> Result<()> {
        match *self {}
    }
}

impl Backend for CudaBackend {
    type Memory = CudaMemory;
    type Batch = CudaBatch;
    fn name(&self) -> &'static str {
        match *self {}
    }
    fn memory(&self) -> &CudaMemory {
        match *self {}
    }
    fn prepare(&self, _plan: BatchPlan) -> Result<CudaBatch> {
        match *self {}
    }
    fn prepare_padded(&self, _plan: BatchPlan, _slot_bound: usize) -> Result<CudaBatch> {
        match *self {}
    }
    fn update_batch(&self, _batch: &mut CudaBatch, _slots: &[u32]) -> Result<()> {
        match *self {}
    }
    fn prefill(
        &self,
        _batch: &CudaBatch,
        _inputs: &StepInputs<'_, Buf>,
        _opts: &KdaOptions,
        _layer: &mut LayerMut<'_, Buf>,
        _out: &mut TensorViewMut<'_, Buf>,
    ) -> Result<()> {
        match *self {}
    }
    fn decode(
        &self,
        _batch: &CudaBatch,
        _inputs: &StepInputs<'_, Buf>,
        _opts: &KdaOptions,
        _layer: &mut LayerMut<'_, Buf>,
        _out: &mut TensorViewMut<'_, Buf>,
    ) -> Result<()> {
        match *self {}
    }
    fn spec_verify(
        &self,
        _batch: &CudaBatch,
        _accepted: &IndexView<'_, Buf>,
        _inputs: &StepInputs<'_, Buf>,
        _opts: &KdaOptions,
        _layer: &mut LayerMut<'_, Buf>,
        _out: &mut TensorViewMut<'_, Buf>,
    ) -> Result<()> {
        match *self {}
    }
    fn replay(
        &self,
        _batch: &CudaBatch,
        _accepted: Option<&IndexView<'_, Buf>>,
        _opts: &KdaOptions,
        _a_log: Option<&TensorView<'_, Buf>>,
        _dt_bias: Option<&TensorView<'_, Buf>>,
        _layer: &mut LayerMut<'_, Buf>,
    ) -> Result<()> {
        match *self {}
    }
}
