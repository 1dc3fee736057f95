//! [`Kernel`]: a loaded kernel with the launch answers the driver gave for it. The answers (the
//! dynamic shared memory the function is opted in to, its occupancy at a launch shape) never
//! change for a loaded function, so each is asked once and kept with the function, which the
//! registry shares process-wide: every backend on the device sees the same opt-in, and a launch
//! asks the driver nothing it asked before.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::hash::Hash;
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
        kept(&mut a.fit, (threads, smem), || {
            self.func
                .occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)
                .map_err(|e| device_err(&format!("{} occupancy", self.name), e))
        })
    }

    /// The most dynamic shared memory each of `ctas` CTAs of `threads` threads may have with all
    /// of them on one multiprocessor, bytes (an error where the function's registers or
    /// threads do not let that many share one).
    pub(crate) fn smem_per_cta(&self, ctas: u32, threads: u32) -> Result<usize> {
        let mut a = self.answers.lock();
        kept(&mut a.share, (ctas, threads), || {
            self.func
                .occupancy_available_dynamic_smem_per_block(ctas, threads)
                .map_err(|e| device_err(&format!("{} occupancy", self.name), e))
        })
    }
}

/// The answer kept for `key`, or `ask`'s, kept if it is one (an error is not kept).
fn kept<K: Hash + Eq, V: Copy>(
    answers: &mut HashMap<K, V>,
    key: K,
    ask: impl FnOnce() -> Result<V>,
) -> Result<V> {
    match answers.entry(key) {
        Entry::Occupied(e) => Ok(*e.get()),
        Entry::Vacant(e) => Ok(*e.insert(ask()?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_asked_once_and_kept() {
        let mut answers = HashMap::new();
        let mut asked = 0;
        for _ in 0..3 {
            let got = kept(&mut answers, (256u32, 4096usize), || {
                asked += 1;
                Ok(5u32)
            });
            assert_eq!(got.expect("kept"), 5);
        }
        assert_eq!(asked, 1);
        // another key is asked for its own
        assert_eq!(kept(&mut answers, (128, 4096), || Ok(7)).expect("kept"), 7);
        assert_eq!(answers.len(), 2);
    }

    #[test]
    fn a_refused_question_is_asked_again() {
        let mut answers: HashMap<u32, usize> = HashMap::new();
        let refused = kept(&mut answers, 5, || {
            Err(device_err("kda_x occupancy", "refused"))
        });
        assert!(refused.is_err());
        assert!(answers.is_empty(), "an error is not kept");
        assert_eq!(kept(&mut answers, 5, || Ok(46_080)).expect("kept"), 46_080);
    }
}
