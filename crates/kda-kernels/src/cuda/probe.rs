//! PROBE (not for landing): times `kernels/kda_probe_move.cu`, ways of moving 2-byte heads in
//! place without arithmetic, against same-size copies.

use cudarc::driver::sys::{
    cuTensorMapEncodeTiled, CUfunction_attribute, CUtensorMap, CUtensorMapDataType,
    CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use state_pool::{DeviceMemory, Dtype};

use super::backend::{device_err, CudaBackend};
use crate::api::Backend;
use crate::error::Result;

const SRC: &str = include_str!("../../../../kernels/kda_probe_move.cu");

#[repr(C)]
#[derive(Clone, Copy)]
struct MoveP {
    base: u64,
    slots: u64,
    hv: u32,
    mode: u32,
    ops: u32,
    pad: u32,
}
// SAFETY: plain repr(C) struct matching the kernel's MoveP.
unsafe impl cudarc::driver::DeviceRepr for MoveP {}

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TMap([u64; 16]);
// SAFETY: 128 bytes, 64-aligned, the kernel's TMap (a CUtensorMap).
unsafe impl cudarc::driver::DeviceRepr for TMap {}

impl CudaBackend {
    /// PROBE: (us per launch, same-size copy us, CTAs per SM) of one move shape.
    #[allow(clippy::too_many_arguments)]
    pub fn probe_move(
        &self,
        hv: usize,
        n: usize,
        mode: u32,
        ops: u32,
        threads: u32,
        ctas: u32,
        replays: usize,
    ) -> Result<(f64, f64, u32)> {
        let ptx = compile_ptx_with_opts(
            SRC,
            CompileOptions {
                arch: Some("sm_90"),
                ..Default::default()
            },
        )
        .map_err(|e| device_err("probe compile", e))?;
        let m = self
            .context()
            .load_module(ptx)
            .map_err(|e| device_err("probe load", e))?;
        let f = m
            .load_function(&format!("kda_probe_move{mode}"))
            .map_err(|e| device_err("probe fn", e))?;
        let set_bytes = n * hv * 32768;
        let sets = (1usize << 30).div_ceil(set_bytes).max(2);
        let mem = self.memory();
        let mut plane = mem.alloc_zeroed(sets * set_bytes)?;
        self.fill_random(&mut plane, Dtype::Fp16, 3, 1.0)?;
        let slots: Vec<u32> = (0..(sets * n) as u32).collect();
        let sl = mem.upload_slice(&slots)?;
        let s = self.stream();
        let (bp, sp) = (plane.device_ptr(s), sl.device_ptr(s));
        let rows = (sets * n * hv * 128) as u64;
        let mut tm = TMap([0; 16]);
        let half = matches!(mode, 2 | 4 | 5);
        let gdim = [128u64, rows];
        let gstr = [256u64];
        let bdim = [if mode == 2 { 64u32 } else { 128 }, 128];
        let es = [1u32, 1];
        // SAFETY: out-pointer to 128 aligned bytes; arrays of the ranks' lengths.
        let r = unsafe {
            cuTensorMapEncodeTiled(
                &mut tm as *mut TMap as *mut CUtensorMap,
                CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
                2,
                bp as *mut std::ffi::c_void,
                gdim.as_ptr(),
                gstr.as_ptr(),
                bdim.as_ptr(),
                es.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        r.result().map_err(|e| device_err("tensor map", e))?;
        let tile = if half { 16384 } else { 32768 } + 128;
        let smem = if matches!(mode, 3 | 5) {
            (233472 / ctas as usize)
                .saturating_sub(1024 + 16)
                .min(227 * 1024)
        } else {
            ((233472 / ctas as usize).saturating_sub(1024 + 16)).max(tile)
        };
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(|e| device_err("probe attr", e))?;
        let fit = f
            .occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)
            .map_err(|e| device_err("occ", e))?;
        let items = (n * hv * if half { 2 } else { 1 }) as u32;
        let cfg = LaunchConfig {
            grid_dim: (items, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let graph = self.capture(|| {
            for set in 0..sets {
                let p = MoveP {
                    base: bp,
                    slots: sp + (set * n * 4) as u64,
                    hv: hv as u32,
                    mode,
                    ops,
                    pad: 0,
                };
                let mut l = s.launch_builder(&f);
                l.arg(&p).arg(&tm);
                // SAFETY: the kernel moves heads of slots set*n.. inside `plane` in place.
                unsafe { l.launch(cfg) }.map_err(|e| device_err("probe launch", e))?;
            }
            Ok(())
        })?;
        let us = self.time_graph(&graph, 3, replays)? / sets as f64;
        let copy = self
            .time_copies(set_bytes, sets, 3, replays)?
            .iter()
            .map(|t| t.us)
            .fold(f64::INFINITY, f64::min);
        self.synchronize()?;
        drop(plane);
        Ok((us, copy, fit))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_compiles() {
        let r = cudarc::nvrtc::compile_ptx_with_opts(
            super::SRC,
            cudarc::nvrtc::CompileOptions {
                arch: Some("sm_90"),
                ..Default::default()
            },
        );
        if let Err(e) = &r {
            panic!("{e:?}");
        }
        let ptx = r.unwrap().to_src();
        std::fs::write("/tmp/p/probe.ptx", ptx).unwrap();
    }
}
