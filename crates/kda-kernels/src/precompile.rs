//! Kernel modules compiled ahead of time: [`precompile`] fills the CUDA backend's module
//! cache (the directory `KDA_KERNEL_CACHE` names at run time) for a GPU architecture on a
//! machine with NVRTC but no GPU or driver (a container image's build, a CI job), so a serving
//! process loads each module at its first call instead of compiling it (seconds per module).

use std::path::{Path, PathBuf};

use serde::Serialize;
use state_pool::PoolGeometry;

use crate::api::BatchKind;
use crate::error::{KernelError, Result};

/// A real GPU architecture, `sm_XY` (compute capability X.Y), as NVRTC compiles for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuArch {
    /// Compute capability, major (9 for sm_90).
    pub major: u32,
    /// Compute capability, minor (0 for sm_90).
    pub minor: u32,
}

impl std::str::FromStr for GpuArch {
    type Err = KernelError;

    /// `sm_` and the compute capability's digits, the last one the minor (`sm_90`, `sm_100`).
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            KernelError::arg(
                "arch",
                format!("'{s}' is not accepted; expected sm_XY, e.g. sm_90 (H100, H200)"),
            )
        };
        let digits = s.strip_prefix("sm_").ok_or_else(bad)?;
        if !(2..=3).contains(&digits.len()) || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        match (major.parse(), minor.parse()) {
            (Ok(major), Ok(minor)) if major > 0 => Ok(GpuArch { major, minor }),
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for GpuArch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// One module in the cache after [`precompile`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PrecompiledModule {
    /// The module's program name (`kda_decode_<state>_<input>_<layout>_k<K>_v<V>.cu`, with
    /// `_padded` before `.cu` for padded batches' modules, or `kda_fill.cu`).
    pub name: String,
    /// The CUBIN's file in the cache.
    pub path: PathBuf,
    /// Whether the file was there already (nothing compiled).
    pub cached: bool,
    /// The CUBIN's size in bytes.
    pub bytes: usize,
}

/// Compiles, for GPUs of architecture `arch`, every kernel module that calls on layers of
/// `geometries` with batches of `kinds` load (one per state dtype, input dtype (the geometry's
/// `ring_dtype`, as `CudaBackend::warm_up` takes it), layout, K, V and batch kind) and the fill
/// module, into the module cache at `dir` (created if missing); modules already there are kept.
/// Several compile at once. Needs the NVRTC library, no GPU or driver.
///
/// A module's file is named by a hash of its source, NVRTC's options and NVRTC's version, and
/// the options name the CUDA include directory found here (`CUDA_PATH`, `CUDA_HOME`,
/// /usr/local/cuda): a serving machine finds the files where its NVRTC version and that
/// directory are the same (the same container image); elsewhere it compiles as before.
///
/// Errors: the backend unavailable (built without the `cuda` feature, no NVRTC library, a
/// module NVRTC refuses), or [`KernelError::InvalidArgument`] for a directory that cannot be
/// written.
pub fn precompile(
    dir: &Path,
    arch: GpuArch,
    geometries: &[PoolGeometry],
    kinds: &[BatchKind],
) -> Result<Vec<PrecompiledModule>> {
    crate::cuda::precompile_modules(dir, arch, geometries, kinds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_parses_sm_names_and_names_what_it_accepts() {
        let ok = |s: &str| s.parse::<GpuArch>().unwrap();
        assert_eq!(ok("sm_90"), GpuArch { major: 9, minor: 0 });
        assert_eq!(ok("sm_89"), GpuArch { major: 8, minor: 9 });
        assert_eq!(
            ok("sm_100"),
            GpuArch {
                major: 10,
                minor: 0
            }
        );
        assert_eq!(ok("sm_120").to_string(), "sm_120");
        for bad in [
            "90",
            "sm90",
            "sm_9",
            "sm_",
            "sm_1000",
            "sm_9a",
            "compute_90",
            "sm_05",
        ] {
            let e = bad.parse::<GpuArch>().unwrap_err().to_string();
            assert!(
                e.contains("arch") && e.contains(&format!("'{bad}'")) && e.contains("sm_90"),
                "{bad}: {e}"
            );
        }
    }
}
