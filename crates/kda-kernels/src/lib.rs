//! KDA kernels over a [`state_pool`] layer: prefill, decode, speculative verify and replay.
//!
//! One [`Backend`] trait with one method per operation; a CPU reference backend
//! ([`cpu::CpuBackend`]) that is the oracle for every GPU backend; a CUDA backend behind the
//! `cuda` feature (a stub that reports "not compiled" otherwise, so no caller needs `cfg`).
//! State is read and written through the pool's element type; all arithmetic is f32.

pub mod api;
pub mod choice;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
pub mod cuda;
pub mod error;
pub mod precompile;
pub mod rounding;
pub mod serving_doc;
#[cfg(feature = "testing")]
pub mod testing;

pub use api::{
    Backend, BatchKind, BatchPlan, BetaMode, CuSeqlens, GateMode, IndexView, KdaOptions,
    StepInputs, TensorView, TensorViewMut,
};
pub use choice::{EagerKernel, PrefillKernel, RingKernel};
pub use cpu::CpuBackend;
pub use error::{KernelError, Result};
pub use precompile::{precompile, GpuArch, PrecompiledModule};
