//! [`Kernel`]: a loaded kernel with the launch answers the driver gave for it. The answers (the
//! dynamic shared memory the function is opted in to, its occupancy at a launch shape) never
//! change for a loaded function, so each is asked once and kept with the function, which the
//! registry shares process-wide: every backend on the device sees the same opt-in, and a launch
//! asks the driver nothing it asked before.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::CudaFunction;
use parking_lot::Mutex;

use super::backend::device_err;
use crate::error::Result;

/// A loaded kernel: its function, its entry name and the driver's kept answers about it.
#[derive(Clone)]
pub(crate) struct Kernel {
    func: CudaFunction,
    name: &'static str,
    answers: Arc<Mutex<Answers>>,
}

/// What the driver has answered about one function.
#[derive(Debug, Default)]
struct Answers {
    /// The most dynamic shared memory the function is opted in to, bytes (0: none asked).
    opted_in: usize,
    /// CTAs of (threads, dynamic shared memory) that fit one multiprocessor.
    fit: HashMap<(u32, usize), u32>,
    /// Dynamic shared memory each of (CTAs, threads) may have on one multiprocessor, bytes.
    share: HashMap<(u32, u32), usize>,
}

impl Kernel {
    /// The function `func` of entry `name`, with no answers yet.
    pub(crate) fn new(func: CudaFunction, name: &'static str) -> Self {
        Self {
            func,
            name,
            answers: Arc::default(),
        }
    }

    /// The loaded function.
    pub(crate) fn func(&self) -> &CudaFunction {
        &self.func
    }

    /// The kernel's entry name.
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    /// Opts the function in to at least `smem` bytes of dynamic shared memory. The opt-in only
    /// grows, so no launch that relied on a larger one before finds it lowered.
    pub(crate) fn opt_in_smem(&self, smem: usize) -> Result<()> {
        let mut a = self.answers.lock();
        if smem <= a.opted_in {
            return Ok(());
        }
        let bytes = i32::try_from(smem).map_err(|e| device_err(self.name, e))?;
        self.func
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes,
            )
            .map_err(|e| device_err(&format!("{} shared memory", self.name), e))?;
        a.opted_in = smem;
        Ok(())
    }

    /// CTAs of `threads` threads with `smem` bytes of dynamic shared memory each that fit one
    /// multiprocessor (the driver's occupancy arithmetic).
    pub(crate) fn ctas_per_sm(&self, threads: u32, smem: usize) -> Result<u32> {
        let mut a = self.answers.lock();
        if let Some(&n) = a.fit.get(&(threads, smem)) {
            return Ok(n);
        }
        let n = self
            .func
            .occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)
            .map_err(|e| device_err(&format!("{} occupancy", self.name), e))?;
        a.fit.insert((threads, smem), n);
        Ok(n)
    }

    /// The most dynamic shared memory each of `ctas` CTAs of `threads` threads may have with all
    /// of them on one multiprocessor, bytes (an error where the function's registers or
    /// threads do not let that many share one).
    pub(crate) fn smem_per_cta(&self, ctas: u32, threads: u32) -> Result<usize> {
        let mut a = self.answers.lock();
        if let Some(&s) = a.share.get(&(ctas, threads)) {
            return Ok(s);
        }
        let s = self
            .func
            .occupancy_available_dynamic_smem_per_block(ctas, threads)
            .map_err(|e| device_err(&format!("{} occupancy", self.name), e))?;
        a.share.insert((ctas, threads), s);
        Ok(s)
    }
}
