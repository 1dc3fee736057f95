//! Benchmark support on the CUDA backend: CUDA-graph capture of enqueued calls, timing with
//! CUDA events, the device-to-device copy bandwidth, and device-side random fills (so nothing
//! is timed on zeros and no host has to generate gigabytes).

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, LaunchConfig, PushKernelArg};
use state_pool::{DeviceMemory, Dtype};

use super::backend::{device_err, CudaBackend};
use super::memory::CudaBuffer;
use super::params::FillParams;
use super::registry::{copy_kernel, fill_kernel};
use crate::api::Backend;
use crate::error::{KernelError, Result};

/// A launch shape of `kda_copy`: a grid that covers the words, `words` 16-byte words per
/// thread (1: one word per thread, no loop; `KDA_COPY_UNROLL` = 4: one tile of 4 words per
/// thread a block, all loads before the stores).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyShape {
    /// Threads per block.
    pub threads: u32,
    /// 16-byte words per thread: 1 or 4 (`KDA_COPY_UNROLL` in `kernels/kda_fill.cu`).
    pub words: u32,
}

/// The launch shapes [`CudaBackend::time_copies`] tries. On the H200 (1 GiB, read + write),
/// one word per thread in blocks of 256 read 4.31 TB/s and of 128 4.30; 4 words per thread
/// 4.10-4.15 (slightly ahead at ~12 MB copies); a grid-stride loop over 8-16 blocks per SM
/// (the earlier kernel) 3.85-3.94.
pub const COPY_SHAPES: [CopyShape; 3] = [
    CopyShape {
        threads: 256,
        words: 1,
    },
    CopyShape {
        threads: 128,
        words: 1,
    },
    CopyShape {
        threads: 512,
        words: 4,
    },
];

impl CopyShape {
    /// Blocks of a launch over `n16` words: enough for `words` words per thread (the kernel
    /// loops over tiles past the grid limit).
    fn grid(self, n16: usize) -> u32 {
        let per_block = self.threads as usize * self.words as usize;
        n16.div_ceil(per_block).clamp(1, i32::MAX as usize) as u32
    }
}

impl std::fmt::Display for CopyShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let w = if self.words == 1 { "word" } else { "words" };
        write!(
            f,
            "{} threads/block, {} {w}/thread",
            self.threads, self.words
        )
    }
}

/// The device time of one copy in one launch shape ([`CudaBackend::time_copies`]).
#[derive(Debug, Clone, PartialEq)]
pub struct CopyTime {
    /// The launch shape, in words (`256 threads, 8/SM grid-stride`).
    pub shape: String,
    /// Mean device time of one copy in microseconds.
    pub us: f64,
}

/// A captured sequence of enqueued calls, replayable as one CUDA graph.
pub struct CapturedGraph {
    graph: CudaGraph,
}

impl std::fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CapturedGraph")
    }
}

impl CapturedGraph {
    /// Enqueues one replay of the graph.
    pub fn launch(&self) -> Result<()> {
        self.graph
            .launch()
            .map_err(|e| device_err("graph launch", e))
    }
}

impl CudaBackend {
    /// Captures everything `f` enqueues on the backend's stream into a graph. Call every
    /// operation once before capturing it, so its kernel is compiled and loaded outside the
    /// capture.
    pub fn capture(&self, f: impl FnOnce() -> Result<()>) -> Result<CapturedGraph> {
        let s = self.stream();
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| device_err("begin capture", e))?;
        let body = f();
        let graph = s.end_capture(CUgraphInstantiate_flags(0));
        body?;
        let graph = graph
            .map_err(|e| device_err("end capture", e))?
            .ok_or_else(|| device_err("end capture", "nothing was captured"))?;
        graph.upload().map_err(|e| device_err("graph upload", e))?;
        Ok(CapturedGraph { graph })
    }

    /// Mean device time of one replay of `graph` in microseconds: `warmup` replays, then
    /// `replays` timed between two CUDA events.
    pub fn time_graph(&self, graph: &CapturedGraph, warmup: usize, replays: usize) -> Result<f64> {
        if replays == 0 {
            return Err(KernelError::arg("replays", "is 0; expected at least 1"));
        }
        for _ in 0..warmup {
            graph.launch()?;
        }
        let ctx = self.context();
        let s = self.stream();
        let ev = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| device_err("event", e))
        };
        let (start, end) = (ev()?, ev()?);
        start.record(s).map_err(|e| device_err("event record", e))?;
        for _ in 0..replays {
            graph.launch()?;
        }
        end.record(s).map_err(|e| device_err("event record", e))?;
        end.synchronize().map_err(|e| device_err("event sync", e))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| device_err("event elapsed", e))?;
        Ok(ms as f64 * 1e3 / replays as f64)
    }

    /// Device-to-device copy bandwidth in bytes per second, counting bytes read plus bytes
    /// written: the best launch shape of [`CudaBackend::time_copies`] for one copy of `bytes`
    /// bytes (the ceiling of a bandwidth-bound kernel), warmed up over 50 replays, then timed
    /// over 50.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64> {
        let times = self.time_copies(bytes, 1, 50, 50)?;
        let us = times.iter().map(|t| t.us).fold(f64::INFINITY, f64::min);
        Ok(2.0 * (bytes / 16 * 16).max(16) as f64 / (us * 1e-6))
    }

    /// Times the `kda_copy` kernel (16-byte words) in each of [`COPY_SHAPES`] the way the
    /// benchmarks time a call: a graph of `copies` copies of `bytes` bytes each (rounded up to
    /// 16 bytes) over `copies` disjoint source/destination pairs of random data, `warmup`
    /// replays, then `replays` replays between two CUDA events. Returns, for each launch shape
    /// tried ([`COPY_SHAPES`]), the mean device time of one copy in microseconds (graph time /
    /// `copies`); the caller takes the best.
    pub fn time_copies(
        &self,
        bytes: usize,
        copies: usize,
        warmup: usize,
        replays: usize,
    ) -> Result<Vec<CopyTime>> {
        if copies == 0 {
            return Err(KernelError::arg("copies", "is 0; expected at least 1"));
        }
        let n16 = bytes.div_ceil(16).max(1);
        // each copy starts 256-byte aligned
        let stride = n16.next_multiple_of(16);
        let total = stride.checked_mul(16 * copies).ok_or_else(|| {
            KernelError::arg("bytes", format!("is {bytes}; {copies} copies overflow"))
        })?;
        let mem = self.memory();
        let mut src = mem.alloc_zeroed(total)?;
        let dst = mem.alloc_zeroed(total)?;
        self.fill_random(&mut src, Dtype::Fp32, 7, 1.0)?;
        let f = copy_kernel(self.context())?;
        let s = self.stream();
        let (sp, dp, n) = (src.device_ptr(s), dst.device_ptr(s), n16 as u64);
        let mut out = Vec::with_capacity(COPY_SHAPES.len());
        for shape in COPY_SHAPES {
            let cfg = LaunchConfig {
                grid_dim: (shape.grid(n16), 1, 1),
                block_dim: (shape.threads, 1, 1),
                shared_mem_bytes: 0,
            };
            let graph = self.capture(|| {
                for c in 0..copies {
                    let off = (c * stride * 16) as u64;
                    let (a, b) = (sp + off, dp + off);
                    let mut l = s.launch_builder(f.func());
                    l.arg(&a).arg(&b).arg(&n);
                    // SAFETY: `kda_copy(const uint4*, uint4*, u64)`: copy `c` reads and writes
                    // words [c * stride, c * stride + n16) of two distinct allocations of
                    // `copies * stride` words; ordered on the stream that owns them.
                    unsafe { l.launch(cfg) }.map_err(|e| device_err("kda_copy launch", e))?;
                }
                Ok(())
            })?;
            let us = self.time_graph(&graph, warmup, replays)? / copies as f64;
            out.push(CopyTime {
                shape: shape.to_string(),
                us,
            });
        }
        self.synchronize()?;
        Ok(out)
    }

    /// The same copy through a graph memcpy node (the driver's copy path), bytes per second.
    pub fn memcpy_bandwidth(&self, bytes: usize) -> Result<f64> {
        let mem = self.memory();
        let mut src = mem.alloc_zeroed(bytes)?;
        let dst = mem.alloc_zeroed(bytes)?;
        self.fill_random(&mut src, Dtype::Fp32, 7, 1.0)?;
        let s = self.stream();
        let (sp, dp) = (src.device_ptr(s), dst.device_ptr(s));
        let graph = self.capture(|| {
            // SAFETY: both allocations hold `bytes` bytes and are distinct; the copy is
            // ordered on the stream that owns them.
            unsafe { cudarc::driver::result::memcpy_dtod_async(dp, sp, bytes, s.cu_stream()) }
                .map_err(|e| device_err("copy", e))
        })?;
        let us = self.time_graph(&graph, 20, 30)?;
        self.synchronize()?;
        Ok(2.0 * bytes as f64 / (us * 1e-6))
    }

    /// Enqueues a copy of the first `bytes` bytes of `src` into `dst` (no synchronisation,
    /// so it can be captured in a graph).
    pub fn copy_device(&self, src: &CudaBuffer, dst: &mut CudaBuffer, bytes: usize) -> Result<()> {
        if bytes > src.len() || bytes > dst.len() {
            return Err(KernelError::arg(
                "bytes",
                format!(
                    "is {bytes}; the buffers hold {} and {} bytes",
                    src.len(),
                    dst.len()
                ),
            ));
        }
        if bytes == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (sp, dp) = (src.device_ptr(s), dst.device_ptr(s));
        // SAFETY: both ranges lie inside live allocations (checked above), which are distinct
        // (`dst` is borrowed mutably); the copy is ordered on the stream that owns them.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dp, sp, bytes, s.cu_stream()) }
            .map_err(|e| device_err("copy", e))
    }

    /// Fills `buf` with reproducible pseudo-random values of `dtype`, uniform in
    /// `[-scale, scale)` (the whole buffer; its length must be a multiple of the size).
    pub fn fill_random(
        &self,
        buf: &mut CudaBuffer,
        dtype: Dtype,
        seed: u32,
        scale: f32,
    ) -> Result<()> {
        let len = buf.len() / dtype.size();
        if len == 0 {
            return Ok(());
        }
        let f = fill_kernel(self.context())?;
        let s = self.stream();
        let p = FillParams {
            ptr: buf.device_ptr(s),
            len: len as u64,
            dtype: match dtype {
                Dtype::Fp32 => 0,
                Dtype::Fp16 => 1,
                Dtype::Bf16 => 2,
            },
            seed,
            scale,
            pad: 0,
        };
        let blocks = len.div_ceil(256).min(65536) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = s.launch_builder(f.func());
        b.arg(&p);
        // SAFETY: `p` matches `struct KdaFill`; the kernel writes `len` elements of `dtype`
        // inside `buf`, which is live and used only on this stream.
        unsafe { b.launch(cfg) }.map_err(|e| device_err("kda_fill launch", e))?;
        Ok(())
    }
}
