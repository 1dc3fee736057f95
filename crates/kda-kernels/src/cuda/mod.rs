//! The CUDA backend (feature `cuda`): cudarc for the driver, NVRTC for the kernels of the
//! top-level `kernels/` directory. Layers:
//! - [`memory`]: [`CudaMemory`], the pool's device memory ([`state_pool::DeviceMemory`]);
//! - `registry`: the lazy NVRTC kernel registry (compiled once per process and device);
//! - `params`: the kernel parameter block;
//! - [`backend`]: [`CudaBackend`], the [`crate::Backend`] (decode, spec_verify, replay; prefill
//!   is not supported yet) and its synchronisation-free `enqueue_*` variants;
//! - [`timing`]: CUDA graphs, events and the copy bandwidth for benchmarks.

pub mod backend;
mod cubin_cache;
pub mod memory;
mod nvrtc;
mod params;
mod registry;
pub mod timing;

pub use backend::{CudaBackend, CudaBatch};
pub use memory::{CudaBuffer, CudaMemory};
pub use timing::CapturedGraph;
