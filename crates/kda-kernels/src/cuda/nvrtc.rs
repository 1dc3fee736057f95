//! NVRTC straight to machine code: a module compiled for the device's real architecture comes
//! back as a CUBIN, assembled by NVRTC's own ptxas, instead of PTX that the driver's JIT
//! assembles at load time. The code that runs is then the code `tools/offline/kernel_sass.sh`
//! shows (CUDA 13.0's ptxas) whatever the driver; the driver's JIT made different register
//! choices (forty-second session: a stack frame and spills in `kda_eager_tile_stream` that
//! NVRTC's ptxas does not make). `KDA_CUDA_CODE=ptx` hands the driver PTX instead (for a GPU
//! newer than the NVRTC library, whose JIT then assembles it).

use std::ffi::{CStr, CString};

use cudarc::nvrtc::{result, sys};

/// The environment variable that picks what NVRTC hands the driver.
pub(crate) const CODE_ENV: &str = "KDA_CUDA_CODE";

/// What NVRTC hands the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CodeKind {
    /// Machine code for the device's architecture (the default).
    Cubin,
    /// PTX, assembled by the driver's JIT when the module is loaded.
    Ptx,
}

impl CodeKind {
    /// The kind named by `value` (`KDA_CUDA_CODE`; unset: CUBIN), or an error naming the
    /// variable, the value and what is accepted.
    pub(crate) fn parse(value: Option<&str>) -> Result<Self, String> {
        match value.map(str::trim) {
            None | Some("") | Some("cubin") => Ok(CodeKind::Cubin),
            Some("ptx") => Ok(CodeKind::Ptx),
            Some(other) => Err(format!(
                "{CODE_ENV}={other:?} is not accepted: use \"cubin\" (the default) or \"ptx\""
            )),
        }
    }

    /// The kind `KDA_CUDA_CODE` names.
    pub(crate) fn from_env() -> Result<Self, String> {
        Self::parse(std::env::var(CODE_ENV).ok().as_deref())
    }
}

/// NVRTC's version ("13.0"), which decides a CUBIN's bytes along with the source and options.
pub(crate) fn nvrtc_version() -> Result<String, String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers; nvrtcVersion reads nothing else.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("NVRTC version: {e:?}"))?;
    Ok(format!("{major}.{minor}"))
}

/// An NVRTC program, destroyed when dropped.
struct Program {
    prog: sys::nvrtcProgram,
    // NVRTC may refer to the source and the name until the program is destroyed
    _src: CString,
    _name: CString,
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: `prog` was created by `create_program` and is destroyed here only, once.
        let _ = unsafe { result::destroy_program(self.prog) };
    }
}

/// Compiles `src` as the program `name` with NVRTC `options`, which must name a real
/// architecture (`--gpu-architecture=sm_XY`), and returns the CUBIN; the error (for the caller
/// to prefix with the program's name) is NVRTC's result and its log.
pub(crate) fn compile_cubin(src: &str, name: &str, options: &[String]) -> Result<Vec<u8>, String> {
    let src = CString::new(src).map_err(|_| "the source contains a NUL byte".to_string())?;
    let name_c = CString::new(name).map_err(|_| "the name contains a NUL byte".to_string())?;
    let prog = result::create_program(&src, Some(&name_c)).map_err(|e| format!("{e:?}"))?;
    let p = Program {
        prog,
        _src: src,
        _name: name_c,
    };
    // SAFETY: `p.prog` is a live program (destroyed only when `p` drops, after this call).
    if let Err(e) = unsafe { result::compile_program(p.prog, options) } {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(p.prog) }
            .map(|l| {
                // SAFETY: NVRTC writes the log with its terminating NUL (`l` holds it all).
                unsafe { CStr::from_ptr(l.as_ptr()) }
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_default();
        return Err(format!("{e:?}: {log}"));
    }
    let mut size = 0usize;
    // SAFETY: `p.prog` is live and compiled; `size` is a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(p.prog, &mut size) }
        .result()
        .map_err(|e| format!("no CUBIN ({e:?})"))?;
    if size == 0 {
        return Err("no CUBIN (is the architecture a real one, sm_XY?)".to_string());
    }
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has the `size` bytes NVRTC said it writes.
    unsafe { sys::nvrtcGetCUBIN(p.prog, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| format!("no CUBIN ({e:?})"))?;
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_kind_defaults_to_cubin_and_names_what_it_accepts() {
        assert_eq!(CodeKind::parse(None), Ok(CodeKind::Cubin));
        assert_eq!(CodeKind::parse(Some("cubin")), Ok(CodeKind::Cubin));
        assert_eq!(CodeKind::parse(Some(" ptx ")), Ok(CodeKind::Ptx));
        let e = CodeKind::parse(Some("sass")).unwrap_err();
        assert!(
            e.contains("KDA_CUDA_CODE") && e.contains("\"sass\"") && e.contains("\"ptx\""),
            "{e}"
        );
    }

    #[test]
    fn compile_cubin_returns_machine_code_or_nvrtcs_log() {
        // SAFETY: only tries to open the shared library.
        if !unsafe { sys::is_culib_present() } {
            eprintln!("skipped: no NVRTC library on this machine");
            return;
        }
        let opts = |arch: &str| [format!("--gpu-architecture={arch}")];
        let src = "extern \"C\" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }";
        let cubin = compile_cubin(src, "twice.cu", &opts("sm_90")).expect("compiles");
        assert_eq!(&cubin[..4], b"\x7fELF", "a CUBIN is an ELF image");
        // the same source and options give the same bytes (what the module cache relies on)
        assert_eq!(compile_cubin(src, "twice.cu", &opts("sm_90")), Ok(cubin));
        let v = nvrtc_version().expect("NVRTC's version");
        let (major, minor) = v.split_once('.').expect("major.minor");
        assert!(
            major.parse::<u32>().is_ok() && minor.parse::<u32>().is_ok(),
            "{v}"
        );
        let e =
            compile_cubin("__global__ void broken( {", "broken.cu", &opts("sm_90")).unwrap_err();
        assert!(
            e.contains("NVRTC_ERROR_COMPILATION") && e.contains("broken.cu"),
            "{e}"
        );
        // a virtual architecture gives PTX only
        let e = compile_cubin(src, "twice.cu", &opts("compute_90")).unwrap_err();
        assert!(e.contains("no CUBIN"), "{e}");
    }
}
