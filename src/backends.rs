//! Choosing a backend on the command line and running generic work on it.

use kda_kernels::Backend;

use crate::cli::CliError;

/// The `--backend` flag's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// The CPU reference backend (rayon, f32).
    #[default]
    Cpu,
    /// The CUDA backend (needs a build with `--features cuda` and an NVIDIA GPU).
    Cuda,
}

/// The `--prefill-kernel` flag's values (the CUDA backend's prefill kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PrefillKernelArg {
    /// `kda_step`, token by token.
    Steps,
    /// The chunked kernels (`kda_chunk_prep`, `kda_chunk_state`, `kda_chunk_out`).
    Chunked,
    /// The chunked kernels where the call's shape is expected to run faster chunked, else
    /// `kda_step` (the default).
    ByShape,
}

impl From<PrefillKernelArg> for kda_kernels::PrefillKernel {
    fn from(k: PrefillKernelArg) -> Self {
        match k {
            PrefillKernelArg::Steps => Self::Steps,
            PrefillKernelArg::Chunked => Self::Chunked,
            PrefillKernelArg::ByShape => Self::ByShape,
        }
    }
}

/// Work that runs on any backend: the CLI picks the backend, the task is generic over it.
pub trait BackendTask {
    /// What the task produces.
    type Output;
    /// Runs the task on `backend`.
    fn run<B: Backend>(self, backend: &B) -> Result<Self::Output, CliError>;
}

/// Runs `task` on the backend `kind`. The CPU backend is the default; asking for CUDA where it
/// is not available is an error (never a silent fall-back to the CPU).
pub fn dispatch<T: BackendTask>(kind: BackendKind, task: T) -> Result<T::Output, CliError> {
    match kind {
        BackendKind::Cpu => task.run(&kda_kernels::cpu::CpuBackend::new()),
        BackendKind::Cuda => task.run(&cuda_backend()?),
    }
}

/// The CUDA backend, or the error of `--backend cuda` where it is not available (a usage
/// error naming the reason: no driver, no GPU, no NVRTC, or a build without `cuda`).
pub fn cuda_backend() -> Result<kda_kernels::cuda::CudaBackend, CliError> {
    kda_kernels::cuda::CudaBackend::new().map_err(|e| match e {
        kda_kernels::KernelError::Unavailable { .. } => {
            CliError::Usage(format!("--backend cuda: {e}; use --backend cpu"))
        }
        other => CliError::Failed(format!("--backend cuda: {other}")),
    })
}
