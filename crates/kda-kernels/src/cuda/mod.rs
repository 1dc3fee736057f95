//! The CUDA backend (feature `cuda`): cudarc for the driver, NVRTC for the kernels of the
//! top-level `kernels/` directory. Layers:
//! - [`memory`]: [`CudaMemory`], the pool's device memory ([`state_pool::DeviceMemory`]);
//! - `registry`: the lazy NVRTC kernel registry (compiled once per process and device, or
//!   ahead of time into the module cache: [`crate::precompile()`]);
//! - `kernel`: a loaded kernel with the driver's launch answers about it, asked once;
//! - `params`: the kernel parameter block;
//! - `lanes`, `eager_plan`, `ring_plan`, `chunk_plan`: the kernels' lane geometry and the launch
//!   plans (pure functions of a call's shape: which kernel, how many warps, how much shared
//!   memory, the chunked prefill's windows);
//! - [`backend`]: [`CudaBackend`], the [`crate::Backend`] (prefill token by token or chunked,
//!   decode, spec_verify, replay) and its synchronisation-free `enqueue_*` variants;
//! - [`timing`]: CUDA graphs, events and the copy bandwidth for benchmarks.

pub mod backend;
mod chunk_plan;
mod cubin_cache;
mod eager_plan;
mod kernel;
mod lanes;
pub mod memory;
mod nvrtc;
mod params;
mod registry;
mod ring_plan;
pub mod timing;

pub use backend::{CudaBackend, CudaBatch, RawStream};
pub use memory::{CudaBuffer, CudaMemory, BORROW_ALIGN};
pub use timing::CapturedGraph;

/// [`crate::precompile`] on this backend: the modules of `geometries` (input dtype: each
/// geometry's `ring_dtype`, as [`CudaBackend::warm_up`]) for batches of `kinds`, and the fill
/// module.
pub(crate) fn precompile_modules(
    dir: &std::path::Path,
    arch: crate::precompile::GpuArch,
    geometries: &[state_pool::PoolGeometry],
    kinds: &[crate::BatchKind],
) -> crate::Result<Vec<crate::precompile::PrecompiledModule>> {
    registry::precompile(dir, arch, &registry::StepKey::of_pools(geometries, kinds))
}
