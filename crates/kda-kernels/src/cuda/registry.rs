//! The lazy kernel registry: the kernel sources of `kernels/` (embedded with `include_str!`)
//! are specialised by prepending `#define`s, compiled with NVRTC for the device's compute
//! capability (to machine code by default, PTX with `KDA_CUDA_CODE=ptx`: [`super::nvrtc`]) on
//! first use (or ahead of it, several in parallel: [`warm_up`]), loaded, and
//! cached for the rest of the process, one module per (device, state dtype, input dtype,
//! layout, K, V, batch kind), plus one for the fill and copy kernels. A module's compile holds
//! only that module's slot, so different modules compile at the same time.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use rayon::prelude::*;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use state_pool::{Dtype, PoolGeometry, StateLayout};

use super::cubin_cache::CubinCache;
use super::kernel::Kernel;
use super::nvrtc::{compile_cubin, nvrtc_version, CodeKind};
use crate::api::BatchKind;
use crate::choice::RingKernel;
use crate::error::{KernelError, Result};
use crate::precompile::{GpuArch, PrecompiledModule};

const COMPAT: &str = include_str!("../../../../kernels/kda_compat.cuh");
const COMMON: &str = include_str!("../../../../kernels/kda_common.cuh");
const DECODE: &str = include_str!("../../../../kernels/kda_decode.cu");
const RING: &str = include_str!("../../../../kernels/kda_ring.cu");
const RING_MMA: &str = include_str!("../../../../kernels/kda_ring_mma.cu");
const RING_DELTA: &str = include_str!("../../../../kernels/kda_ring_delta.cu");
const CHUNK: &str = include_str!("../../../../kernels/kda_chunk.cu");
const FILL: &str = include_str!("../../../../kernels/kda_fill.cu");

/// What a `kda_step` module is specialised on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct StepKey {
    pub state: Dtype,
    pub input: Dtype,
    pub layout: StateLayout,
    pub k: usize,
    pub v: usize,
    /// The batches it serves (padded ones: compiled with `KDA_PADDED`, its kernels read the
    /// live count).
    pub kind: BatchKind,
}

impl StepKey {
    /// The module of calls on a layer of geometry `g` with inputs of dtype `input`, on
    /// batches of `kind`.
    pub fn of(g: &PoolGeometry, input: Dtype, kind: BatchKind) -> Self {
        StepKey {
            state: g.state_dtype,
            input,
            layout: g.layout,
            k: g.k,
            v: g.v,
            kind,
        }
    }

    /// The modules of calls on layers of `geometries`, with inputs in each geometry's
    /// `ring_dtype` (the dtype of the kernels' inputs), on batches of each of `kinds`.
    pub fn of_pools(geometries: &[PoolGeometry], kinds: &[BatchKind]) -> Vec<Self> {
        kinds
            .iter()
            .flat_map(|&kind| {
                geometries
                    .iter()
                    .map(move |g| Self::of(g, g.ring_dtype, kind))
            })
            .collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    Step(StepKey),
    Eager(StepKey),
    EagerStage(StepKey),
    EagerTile(StepKey),
    EagerTileStaged(StepKey),
    EagerTileBulk(StepKey),
    EagerTileBulkIn(StepKey),
    EagerTileStream(StepKey),
    EagerTileRegs(StepKey),
    EagerBulkPipe(StepKey),
    Ring(StepKey),
    RingTile(StepKey),
    RingMma(StepKey),
    RingDelta(StepKey),
    RingDeltaStaged(StepKey),
    ChunkPrep(StepKey),
    ChunkState(StepKey),
    ChunkStateNarrow(StepKey),
    ChunkOut(StepKey),
    ChunkRingReset(StepKey),
    Fill,
    Copy,
}

impl Key {
    /// The kernel's entry point in its module.
    fn entry(self) -> &'static str {
        match self {
            Key::Step(_) => "kda_step",
            Key::Eager(_) => "kda_eager",
            Key::EagerStage(_) => "kda_eager_stage",
            Key::EagerTile(_) => "kda_eager_tile",
            Key::EagerTileStaged(_) => "kda_eager_tile_staged",
            Key::EagerTileBulk(_) => "kda_eager_tile_bulk",
            Key::EagerTileBulkIn(_) => "kda_eager_tile_bulk_in",
            Key::EagerTileStream(_) => "kda_eager_tile_stream",
            Key::EagerTileRegs(_) => "kda_eager_regs",
            Key::EagerBulkPipe(_) => "kda_eager_bulk_pipe",
            Key::Ring(_) => "kda_ring",
            Key::RingTile(_) => "kda_ring_tile",
            Key::RingMma(_) => "kda_ring_mma",
            Key::RingDelta(_) => "kda_ring_delta",
            Key::RingDeltaStaged(_) => "kda_ring_delta_staged",
            Key::ChunkPrep(_) => "kda_chunk_prep",
            Key::ChunkState(_) => "kda_chunk_state",
            Key::ChunkStateNarrow(_) => "kda_chunk_state_narrow",
            Key::ChunkOut(_) => "kda_chunk_out",
            Key::ChunkRingReset(_) => "kda_chunk_ring_reset",
            Key::Fill => "kda_fill",
            Key::Copy => "kda_copy",
        }
    }

    /// The module that holds the kernel.
    fn module(self) -> ModuleKey {
        match self {
            Key::Step(k)
            | Key::Eager(k)
            | Key::EagerStage(k)
            | Key::EagerTile(k)
            | Key::EagerTileStaged(k)
            | Key::EagerTileBulk(k)
            | Key::EagerTileBulkIn(k)
            | Key::EagerTileStream(k)
            | Key::EagerTileRegs(k)
            | Key::EagerBulkPipe(k)
            | Key::Ring(k)
            | Key::RingTile(k)
            | Key::RingMma(k)
            | Key::RingDelta(k)
            | Key::RingDeltaStaged(k)
            | Key::ChunkPrep(k)
            | Key::ChunkState(k)
            | Key::ChunkStateNarrow(k)
            | Key::ChunkOut(k)
            | Key::ChunkRingReset(k) => ModuleKey::Step(k),
            Key::Fill | Key::Copy => ModuleKey::Fill,
        }
    }
}

/// What one module is compiled from: a `kda_step` specialisation (eighteen kernels) or the fill
/// source (two).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum ModuleKey {
    Step(StepKey),
    Fill,
}

/// The kernels one `kda_step` module holds (all compiled together).
fn step_module(k: StepKey) -> [Key; 20] {
    [
        Key::Step(k),
        Key::Eager(k),
        Key::EagerStage(k),
        Key::EagerTile(k),
        Key::EagerTileStaged(k),
        Key::EagerTileBulk(k),
        Key::EagerTileBulkIn(k),
        Key::EagerTileStream(k),
        Key::EagerTileRegs(k),
        Key::EagerBulkPipe(k),
        Key::Ring(k),
        Key::RingTile(k),
        Key::RingMma(k),
        Key::RingDelta(k),
        Key::RingDeltaStaged(k),
        Key::ChunkPrep(k),
        Key::ChunkState(k),
        Key::ChunkStateNarrow(k),
        Key::ChunkOut(k),
        Key::ChunkRingReset(k),
    ]
}

/// A loaded module's kernels.
type Functions = Arc<Vec<(Key, Kernel)>>;
/// One module's place in the cache: empty until it has compiled and loaded.
type Slot = Arc<Mutex<Option<Functions>>>;
type Cache = Mutex<HashMap<(usize, ModuleKey), Slot>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn c_type(d: Dtype) -> &'static str {
    match d {
        Dtype::Fp32 => "float",
        Dtype::Fp16 => "kda_half",
        Dtype::Bf16 => "kda_bf16",
    }
}

/// One translation unit: the headers inlined (NVRTC gets no include files of ours), then the
/// specialisation `#define`s, then the kernel source.
fn source(defines: &str, body: &str) -> String {
    let strip = |s: &str| {
        s.lines()
            .filter(|l| !l.trim_start().starts_with("#include \"kda_"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    format!(
        "{}\n{}\n{defines}\n{}\n",
        COMPAT,
        strip(COMMON),
        strip(body)
    )
}

/// The full source of a `kda_step` module (also used by tests that compile it offline).
pub(crate) fn step_source(key: &StepKey) -> String {
    let defines = format!(
        "#define KDA_ST {}\n#define KDA_ST_BYTES {}\n#define KDA_IT {}\n#define KDA_K {}\n#define KDA_V {}\n#define KDA_VFIRST {}\n#define KDA_PADDED {}\n",
        c_type(key.state),
        key.state.size(),
        c_type(key.input),
        key.k,
        key.v,
        u8::from(key.layout == StateLayout::VFirst),
        u8::from(key.kind == BatchKind::Padded)
    );
    source(
        &defines,
        &format!("{DECODE}\n{RING}\n{RING_MMA}\n{RING_DELTA}\n{CHUNK}"),
    )
}

fn unavailable(reason: String) -> KernelError {
    KernelError::Unavailable {
        backend: "cuda",
        reason,
    }
}

/// Compiles `src` to a CUBIN with NVRTC `options` (or takes it from the `KDA_KERNEL_CACHE`
/// directory, keyed by the source, the options and NVRTC's version) and loads it. A cached
/// CUBIN the driver refuses is compiled again and replaced.
fn load_cubin(
    ctx: &Arc<CudaContext>,
    src: &str,
    name: &str,
    options: &[String],
) -> Result<Arc<CudaModule>> {
    let compile_now = || {
        compile_cubin(src, name, options)
            .map_err(|e| unavailable(format!("NVRTC failed to compile {name}: {e}")))
    };
    let load = |cubin: Vec<u8>| ctx.load_module(Ptx::from_binary(cubin));
    let load_err = |e| unavailable(format!("loading module {name}: {e}"));
    let Some(cache) = CubinCache::from_env() else {
        return load(compile_now()?).map_err(load_err);
    };
    let version = nvrtc_version().map_err(unavailable)?;
    let key = cache_key(src, options, &version);
    if let Some(cubin) = cache.get(&key) {
        match load(cubin) {
            Ok(m) => return Ok(m),
            Err(e) => {
                tracing::warn!("{name}: the cached module was refused ({e}); compiling it again")
            }
        }
    }
    let cubin = compile_now()?;
    cache.put(&key, &cubin);
    load(cubin).map_err(load_err)
}

/// The key of a module's CUBIN in the module cache: everything that decides its bytes (the
/// source, NVRTC's options, NVRTC's version).
fn cache_key(src: &str, options: &[String], version: &str) -> String {
    CubinCache::key(&[
        src.as_bytes(),
        options.join("\n").as_bytes(),
        version.as_bytes(),
    ])
}

/// NVRTC's options for a module of a device of compute capability `major.minor`: the CUDA
/// headers (cuda_fp16.h ...) where this machine's toolkit has them (`CUDA_PATH`, `CUDA_HOME`,
/// /usr/local/cuda), the architecture, C++17. One option list for both kinds of code
/// (CompileOptions would spell the same flags).
fn nvrtc_options(major: u32, minor: u32) -> Vec<String> {
    let mut options: Vec<String> = [
        std::env::var("CUDA_PATH").ok(),
        std::env::var("CUDA_HOME").ok(),
        Some("/usr/local/cuda".to_string()),
    ]
    .into_iter()
    .flatten()
    .map(|dir| std::path::Path::new(&dir).join("include"))
    .find(|inc| inc.join("cuda_fp16.h").exists())
    .map(|inc| format!("--include-path={}", inc.to_string_lossy()))
    .into_iter()
    .collect();
    options.extend([
        format!("--gpu-architecture=sm_{major}{minor}"),
        "--std=c++17".to_string(),
    ]);
    options
}

/// The architecture of `ctx`'s device (its compute capability), which its modules compile for.
pub(crate) fn device_arch(ctx: &CudaContext) -> Result<GpuArch> {
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| unavailable(format!("compute capability: {e}")))?;
    match (u32::try_from(major), u32::try_from(minor)) {
        (Ok(major), Ok(minor)) => Ok(GpuArch { major, minor }),
        _ => Err(unavailable(format!("compute capability {major}.{minor}"))),
    }
}

/// Compiles one module and loads the named functions from it.
fn compile(
    ctx: &Arc<CudaContext>,
    src: &str,
    name: &str,
    funcs: &[&str],
) -> Result<Vec<CudaFunction>> {
    let arch = device_arch(ctx)?;
    let options = nvrtc_options(arch.major, arch.minor);
    let module = match CodeKind::from_env().map_err(unavailable)? {
        CodeKind::Cubin => load_cubin(ctx, src, name, &options)?,
        CodeKind::Ptx => {
            let opts = CompileOptions {
                name: Some(name.to_string()),
                options,
                ..Default::default()
            };
            let ptx = compile_ptx_with_opts(src, opts).map_err(|e| match e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => unavailable(format!(
                    "NVRTC failed to compile {name}: {}",
                    log.to_string_lossy()
                )),
                other => unavailable(format!("NVRTC failed on {name}: {other}")),
            })?;
            ctx.load_module(ptx)
                .map_err(|e| unavailable(format!("loading module {name}: {e}")))?
        }
    };
    funcs
        .iter()
        .map(|func| {
            module
                .load_function(func)
                .map_err(|e| unavailable(format!("function {func} in {name}: {e}")))
        })
        .collect()
}

/// The kernels of module `mk`, its program name and its source.
fn module_source(mk: ModuleKey) -> (Vec<Key>, String, String) {
    match mk {
        ModuleKey::Step(k) => (
            step_module(k).to_vec(),
            format!(
                "kda_decode_{}_{}_{}_k{}_v{}{}.cu",
                k.state.name(),
                k.input.name(),
                k.layout.name(),
                k.k,
                k.v,
                if k.kind == BatchKind::Padded {
                    "_padded"
                } else {
                    ""
                }
            ),
            step_source(&k),
        ),
        ModuleKey::Fill => (
            vec![Key::Fill, Key::Copy],
            "kda_fill.cu".to_string(),
            source("", FILL),
        ),
    }
}

/// The kernels of module `mk`, compiled and loaded on first use. The cache's lock is held only
/// to find the module's slot; the compile holds that slot alone, so a caller waits only for the
/// module it needs.
fn module(ctx: &Arc<CudaContext>, mk: ModuleKey) -> Result<Functions> {
    let slot = cache()
        .lock()
        .entry((ctx.ordinal(), mk))
        .or_default()
        .clone();
    let mut loaded = slot.lock();
    if let Some(fs) = loaded.as_ref() {
        return Ok(fs.clone());
    }
    let (keys, name, src) = module_source(mk);
    let entries: Vec<&str> = keys.iter().map(|k| k.entry()).collect();
    let fs: Functions = Arc::new(
        keys.into_iter()
            .zip(compile(ctx, &src, &name, &entries)?)
            .map(|(key, f)| (key, Kernel::new(f, key.entry())))
            .collect(),
    );
    for (key, k) in fs.iter() {
        // kda_eager_tile_stream is built for as many CTAs per SM as their bulk tiles fit, and
        // kda_eager_bulk_pipe for as many buffers: all of the SM's shared memory, not the L1
        // the driver might keep (set once, at load)
        if let Key::EagerTileStream(_) | Key::EagerBulkPipe(_) = key {
            k.func().set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )
            .map_err(|e| unavailable(format!("{} shared memory carveout: {e}", key.entry())))?;
        }
    }
    *loaded = Some(fs.clone());
    Ok(fs)
}

fn get(ctx: &Arc<CudaContext>, key: Key) -> Result<Kernel> {
    module(ctx, key.module())?
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, f)| f.clone())
        .ok_or_else(|| unavailable(format!("no kernel for {key:?} in its module")))
}

/// Compiles the `kda_step` modules of `keys` (each once) and the fill module for `arch` into
/// the module cache at `dir`, under the keys `load_cubin` looks up (`crate::precompile`); a
/// module whose file is there already is kept. NVRTC only: no context.
pub(crate) fn precompile(
    dir: &Path,
    arch: GpuArch,
    keys: &[StepKey],
) -> Result<Vec<PrecompiledModule>> {
    // SAFETY: only tries to open the shared library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(unavailable(
            "no NVRTC library (libnvrtc) on the loader's path".to_string(),
        ));
    }
    let version = nvrtc_version().map_err(unavailable)?;
    let options = nvrtc_options(arch.major, arch.minor);
    let cache = CubinCache::at(dir.to_path_buf());
    let mut modules: Vec<ModuleKey> = Vec::new();
    for m in keys
        .iter()
        .map(|&k| ModuleKey::Step(k))
        .chain([ModuleKey::Fill])
    {
        if !modules.contains(&m) {
            modules.push(m);
        }
    }
    modules
        .par_iter()
        .map(|&mk| {
            let (_, name, src) = module_source(mk);
            let key = cache_key(&src, &options, &version);
            let (cached, bytes) = match cache.get(&key) {
                Some(cubin) => (true, cubin.len()),
                None => {
                    let cubin = compile_cubin(&src, &name, &options).map_err(|e| {
                        unavailable(format!("NVRTC failed to compile {name} for {arch}: {e}"))
                    })?;
                    cache.store(&key, &cubin).map_err(|e| {
                        KernelError::arg(
                            "dir",
                            format!("cannot store {name} in {}: {e}", dir.display()),
                        )
                    })?;
                    (false, cubin.len())
                }
            };
            Ok(PrecompiledModule {
                name,
                path: cache.path(&key),
                cached,
                bytes,
            })
        })
        .collect()
}

/// Compiles and loads the `kda_step` modules of `keys` that are not loaded yet, in parallel
/// (NVRTC and the driver's load run on rayon's threads, the context bound on each), so later
/// calls find them ready. The first error, if any.
pub(crate) fn warm_up(ctx: &Arc<CudaContext>, keys: &[StepKey]) -> Result<()> {
    keys.par_iter()
        .try_for_each(|&k| module(ctx, ModuleKey::Step(k)).map(drop))
}

/// The `kda_step` kernel specialised on `key`, compiled on first use.
pub(crate) fn step_kernel(ctx: &Arc<CudaContext>, key: StepKey) -> Result<Kernel> {
    get(ctx, Key::Step(key))
}

/// The chunked prefill's kernels specialised on `key`, compiled on first use (same module as
/// `kda_step`).
pub(crate) struct ChunkKernels {
    /// `kda_chunk_prep`.
    pub prep: Kernel,
    /// `kda_chunk_state`.
    pub state: Kernel,
    /// `kda_chunk_state_narrow`.
    pub state_narrow: Kernel,
    /// `kda_chunk_out`.
    pub out: Kernel,
    /// `kda_chunk_ring_reset`.
    pub ring_reset: Kernel,
}

/// The chunked prefill's kernels specialised on `key` ([`ChunkKernels`]).
pub(crate) fn chunk_kernels(ctx: &Arc<CudaContext>, key: StepKey) -> Result<ChunkKernels> {
    Ok(ChunkKernels {
        prep: get(ctx, Key::ChunkPrep(key))?,
        state: get(ctx, Key::ChunkState(key))?,
        state_narrow: get(ctx, Key::ChunkStateNarrow(key))?,
        out: get(ctx, Key::ChunkOut(key))?,
        ring_reset: get(ctx, Key::ChunkRingReset(key))?,
    })
}

/// The pipelined eager-decode kernel specialised on `key` (same module as `kda_step`),
/// compiled on first use: `kda_eager_stage` (the tile stored through its stage) where
/// `stage_store`, else `kda_eager`.
pub(crate) fn eager_kernel(
    ctx: &Arc<CudaContext>,
    key: StepKey,
    stage_store: bool,
) -> Result<Kernel> {
    let key = if stage_store {
        Key::EagerStage(key)
    } else {
        Key::Eager(key)
    };
    get(ctx, key)
}

/// How a one-item-per-CTA eager kernel moves its state tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TileMove {
    /// Between global memory and registers (`kda_eager_tile`).
    Direct,
    /// In through shared memory, out from registers (`kda_eager_tile_staged`).
    Staged,
    /// In and out through shared memory by bulk copies (`kda_eager_tile_bulk`).
    Bulk,
    /// In through shared memory by bulk copies, out from registers (`kda_eager_tile_bulk_in`).
    BulkIn,
    /// As `Bulk`, the token step streamed from shared memory (`kda_eager_tile_stream`).
    Stream,
    /// A whole head between global memory and registers, a whole row per warp access
    /// (`kda_eager_regs`; K-first, K = V = 128).
    Regs,
    /// Persistent CTAs whose warps load, step and store heads through a ring of bulk
    /// buffers (`kda_eager_bulk_pipe`; not one item per CTA).
    Pipe,
}

/// The one-item-per-CTA eager-decode kernel that moves its tile as `mv`, specialised on
/// `key` (same module as `kda_step`), compiled on first use.
pub(crate) fn eager_tile_kernel(
    ctx: &Arc<CudaContext>,
    key: StepKey,
    mv: TileMove,
) -> Result<Kernel> {
    let key = match mv {
        TileMove::Direct => Key::EagerTile(key),
        TileMove::Staged => Key::EagerTileStaged(key),
        TileMove::Bulk => Key::EagerTileBulk(key),
        TileMove::BulkIn => Key::EagerTileBulkIn(key),
        TileMove::Stream => Key::EagerTileStream(key),
        TileMove::Regs => Key::EagerTileRegs(key),
        TileMove::Pipe => Key::EagerBulkPipe(key),
    };
    get(ctx, key)
}

/// The pipelined ring kernel `kda_ring` specialised on `key` (same module as
/// `kda_step`), compiled on first use.
pub(crate) fn ring_kernel(ctx: &Arc<CudaContext>, key: StepKey) -> Result<Kernel> {
    get(ctx, Key::Ring(key))
}

/// A one-item-per-CTA ring kernel specialised on `key` (same module as `kda_step`), compiled on
/// first use: `kda_ring_mma` for [`RingKernel::Mma`], `kda_ring_delta` for
/// [`RingKernel::Delta`], `kda_ring_delta_staged` for [`RingKernel::DeltaStaged`], else
/// `kda_ring_tile`.
pub(crate) fn ring_tile_kernel(
    ctx: &Arc<CudaContext>,
    key: StepKey,
    kernel: RingKernel,
) -> Result<Kernel> {
    let k = match kernel {
        RingKernel::Mma => Key::RingMma(key),
        RingKernel::DeltaStaged => Key::RingDeltaStaged(key),
        RingKernel::Delta => Key::RingDelta(key),
        _ => Key::RingTile(key),
    };
    get(ctx, k)
}

/// The `kda_fill` kernel.
pub(crate) fn fill_kernel(ctx: &Arc<CudaContext>) -> Result<Kernel> {
    get(ctx, Key::Fill)
}

/// The `kda_copy` kernel (the copy ceiling).
pub(crate) fn copy_kernel(ctx: &Arc<CudaContext>) -> Result<Kernel> {
    get(ctx, Key::Copy)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::chunk_plan;

    /// Compiles a source for sm_90 with NVRTC to a CUBIN (as `compile` does by default);
    /// `None` when no NVRTC library is present.
    fn try_compile(src: &str, name: &str) -> Option<std::result::Result<Vec<u8>, String>> {
        // SAFETY: only tries to open the shared library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return None;
        }
        let options = [
            "--gpu-architecture=sm_90".to_string(),
            "--std=c++17".to_string(),
        ];
        Some(compile_cubin(src, name, &options))
    }

    /// The five words between `kda_chunk_smem_bytes`' markers in a CUBIN's initialised data.
    fn chunk_smem_words(cubin: &[u8]) -> Option<[u32; 5]> {
        let word = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("four bytes"));
        cubin.windows(28).find_map(|w| {
            (word(&w[..4]) == 0x4b44_4153 && word(&w[24..]) == 0x534d_454d)
                .then(|| [1, 2, 3, 4, 5].map(|i| word(&w[4 * i..4 * i + 4])))
        })
    }

    /// Whether the CUBIN's string table names a symbol `name` (an entry point that
    /// `load_function` looks up is one of its symbols).
    fn has_entry(cubin: &[u8], name: &str) -> bool {
        let sym = [b"\0", name.as_bytes(), b"\0"].concat();
        cubin.windows(sym.len()).any(|w| w == sym.as_slice())
    }

    #[test]
    fn each_kernel_is_looked_up_in_the_module_that_compiles_it() {
        let k = StepKey {
            state: Dtype::Bf16,
            input: Dtype::Fp16,
            layout: StateLayout::VFirst,
            k: 64,
            v: 32,
            kind: BatchKind::Plain,
        };
        for key in step_module(k) {
            assert_eq!(key.module(), ModuleKey::Step(k), "{key:?}");
        }
        for key in [Key::Fill, Key::Copy] {
            assert_eq!(key.module(), ModuleKey::Fill, "{key:?}");
        }
        let names: Vec<&str> = step_module(k).iter().map(|key| key.entry()).collect();
        assert_eq!(
            names,
            [
                "kda_step",
                "kda_eager",
                "kda_eager_stage",
                "kda_eager_tile",
                "kda_eager_tile_staged",
                "kda_eager_tile_bulk",
                "kda_eager_tile_bulk_in",
                "kda_eager_tile_stream",
                "kda_eager_regs",
                "kda_eager_bulk_pipe",
                "kda_ring",
                "kda_ring_tile",
                "kda_ring_mma",
                "kda_ring_delta",
                "kda_ring_delta_staged",
                "kda_chunk_prep",
                "kda_chunk_state",
                "kda_chunk_state_narrow",
                "kda_chunk_out",
                "kda_chunk_ring_reset"
            ]
        );
    }

    /// Whether the NVRTC library opens here; if not, says the test is skipped.
    fn nvrtc_here() -> bool {
        // SAFETY: only tries to open the shared library.
        let here = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        if !here {
            eprintln!("skipped: no NVRTC library on this machine");
        }
        here
    }

    /// A fresh, empty directory path for one test.
    fn fresh_dir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("kda-precompile-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn precompile_stores_each_module_once_under_the_key_the_registry_looks_up() {
        if !nvrtc_here() {
            return;
        }
        let dir = fresh_dir("keys");
        let arch = GpuArch { major: 9, minor: 0 };
        let key = StepKey {
            state: Dtype::Fp16,
            input: Dtype::Bf16,
            layout: StateLayout::KFirst,
            k: 32,
            v: 48,
            kind: BatchKind::Plain,
        };
        let padded = StepKey {
            kind: BatchKind::Padded,
            ..key
        };
        // the same module twice: compiled once
        let first = precompile(&dir, arch, &[key, padded, key]).expect("precompiles");
        let names: Vec<&str> = first.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "kda_decode_fp16_bf16_kfirst_k32_v48.cu",
                "kda_decode_fp16_bf16_kfirst_k32_v48_padded.cu",
                "kda_fill.cu"
            ]
        );
        let version = nvrtc_version().unwrap();
        let modules = [
            ModuleKey::Step(key),
            ModuleKey::Step(padded),
            ModuleKey::Fill,
        ];
        for (m, mk) in first.iter().zip(modules) {
            assert!(!m.cached, "{}: nothing was there", m.name);
            // the file `load_cubin` looks for on an sm_90 device with this machine's NVRTC
            let (_, _, src) = module_source(mk);
            let want = cache_key(&src, &nvrtc_options(9, 0), &version);
            assert_eq!(m.path, dir.join(format!("{want}.cubin")), "{}", m.name);
            let bytes = std::fs::read(&m.path).expect("the module's file");
            assert!(
                bytes.starts_with(b"\x7fELF") && bytes.len() == m.bytes,
                "{}",
                m.name
            );
        }
        // a second run finds every module and compiles none
        let second = precompile(&dir, arch, &[key, padded]).expect("precompiles");
        assert!(second.iter().all(|m| m.cached), "{second:?}");
        let strip = |v: &[PrecompiledModule]| {
            v.iter()
                .map(|m| (m.name.clone(), m.path.clone(), m.bytes))
                .collect::<Vec<_>>()
        };
        assert_eq!(strip(&second), strip(&first));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn precompile_into_a_directory_that_cannot_be_written_names_the_directory() {
        if !nvrtc_here() {
            return;
        }
        // a file where the directory should be (only the fill module: no step keys)
        let blocker = fresh_dir("blocked");
        std::fs::write(&blocker, b"not a directory").unwrap();
        let dir = blocker.join("cache");
        let e = precompile(&dir, GpuArch { major: 9, minor: 0 }, &[]).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, KernelError::InvalidArgument { arg: "dir", .. })
                && msg.contains("kda_fill.cu")
                && msg.contains(&dir.display().to_string()),
            "{msg}"
        );
        let _ = std::fs::remove_file(&blocker);
    }

    #[test]
    fn every_kernel_variant_compiles_with_nvrtc_and_defines_the_loaded_entry_points() {
        let mut keys = Vec::new();
        for state in Dtype::ALL {
            for input in Dtype::ALL {
                for layout in [StateLayout::KFirst, StateLayout::VFirst] {
                    keys.push(StepKey {
                        state,
                        input,
                        layout,
                        k: 128,
                        v: 128,
                        kind: BatchKind::Plain,
                    });
                }
            }
            // the padded batches' modules, as the bench runs them
            keys.push(StepKey {
                state,
                input: Dtype::Bf16,
                layout: StateLayout::KFirst,
                k: 128,
                v: 128,
                kind: BatchKind::Padded,
            });
        }
        for (k, v, input) in [
            (3, 5, Dtype::Bf16),
            (5, 7, Dtype::Fp32),
            (40, 24, Dtype::Fp16),
            (256, 64, Dtype::Bf16),
        ] {
            keys.push(StepKey {
                state: Dtype::Fp16,
                input,
                layout: StateLayout::VFirst,
                k,
                v,
                kind: BatchKind::Plain,
            });
        }
        // compiled several at a time, as `warm_up` does (NVRTC compiles programs concurrently)
        let results: Vec<_> = keys
            .par_iter()
            .map(|key| (key, try_compile(&step_source(key), "kda_decode.cu")))
            .collect();
        for (key, r) in results {
            let Some(r) = r else {
                eprintln!("skipped: no NVRTC library on this machine");
                return;
            };
            let cubin = r.unwrap_or_else(|e| panic!("{key:?}: {e}"));
            for f in step_module(*key).map(Key::entry) {
                assert!(
                    has_entry(&cubin, f),
                    "{key:?}: no entry point {f} in the CUBIN"
                );
            }
            assert!(
                !has_entry(&cubin, "kda_eage"),
                "has_entry matches whole names only"
            );
            // the chunked kernels' shared memory as the kernel source carves it up, and
            // whether its preparation stages its items (`kda_chunk_smem_bytes`, between its
            // marker words), is what the host gives them and expects
            let words = chunk_smem_words(&cubin)
                .unwrap_or_else(|| panic!("{key:?}: no kda_chunk_smem_bytes in the CUBIN"));
            assert_eq!(
                words,
                [
                    chunk_plan::prep_smem(key.k, key.v) as u32,
                    chunk_plan::state_smem(key.k, chunk_plan::BV) as u32,
                    chunk_plan::state_smem(key.k, chunk_plan::BV_NARROW) as u32,
                    chunk_plan::out_smem(key.k) as u32,
                    chunk_plan::prep_staged(key.input.size(), key.k, key.v) as u32,
                ],
                "{key:?}: kda_chunk.cu's shared memory and staging against chunk_plan.rs's"
            );
        }
        if let Some(r) = try_compile(&source("", FILL), "kda_fill.cu") {
            let cubin = r.unwrap();
            for f in [Key::Fill, Key::Copy].map(Key::entry) {
                assert!(has_entry(&cubin, f), "kda_fill.cu: no entry point {f}");
            }
        }
    }
}
