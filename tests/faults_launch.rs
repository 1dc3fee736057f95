//! A failed kernel launch surfaces as an error and leaves the pool usable.
//!
//! The CPU backend cannot fail a launch, so a wrapper backend fails on demand: the N-th
//! operation returns [`KernelError::Device`], either before the wrapped backend runs (a
//! launch refused) or after it ran (a failure reported once the kernel had written: the
//! batch's slots then hold whatever the kernel left, as on a GPU after an asynchronous
//! error). Either way the caller sees the error, aborts the requests of the failed batch
//! (dropping their handles releases their slots), and the pool goes on: the other requests'
//! slots are untouched, the freed slots come back zeroed, and a retry of the aborted
//! requests from the start gives exactly the results of a run that never failed.

mod fault_kit;

use std::sync::atomic::{AtomicUsize, Ordering};

use fault_kit::{plan, run_op, slot_bytes, Op, Rig, Tokens};
use kda_kernels::api::Buf;
use kda_kernels::cpu::{CpuBackend, CpuBatch};
use kda_kernels::{
    Backend, BatchPlan, IndexView, KdaOptions, KernelError, StepInputs, TensorView, TensorViewMut,
};
use rand::rngs::StdRng;
use rand::SeedableRng;
use state_pool::{Dtype, HostMemory, LayerMut, SlotHandle};

/// When the failing call fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FailMode {
    /// Before the wrapped backend runs: nothing was written.
    BeforeLaunch,
    /// After the wrapped backend ran: the batch's slots were written.
    AfterLaunch,
}

/// The CPU backend, except that operation number `fail_at` (counting from 0, every
/// operation counts) fails with a device error.
struct Failing {
    inner: CpuBackend,
    calls: AtomicUsize,
    fail_at: usize,
    mode: FailMode,
}

impl Failing {
    fn new(fail_at: usize, mode: FailMode) -> Self {
        Self {
            inner: CpuBackend::new(),
            calls: AtomicUsize::new(0),
            fail_at,
            mode,
        }
    }

    fn call(
        &self,
        op: &str,
        run: impl FnOnce() -> kda_kernels::Result<()>,
    ) -> kda_kernels::Result<()> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        let fail = || KernelError::Device {
            backend: "failing",
            msg: format!("{op} launch {n} failed (injected)"),
        };
        match (n == self.fail_at, self.mode) {
            (false, _) => run(),
            (true, FailMode::BeforeLaunch) => Err(fail()),
            (true, FailMode::AfterLaunch) => {
                run()?;
                Err(fail())
            }
        }
    }
}

impl Backend for Failing {
    type Memory = HostMemory;
    type Batch = CpuBatch;

    fn name(&self) -> &'static str {
        "failing"
    }
    fn memory(&self) -> &HostMemory {
        self.inner.memory()
    }
    fn prepare(&self, plan: BatchPlan) -> kda_kernels::Result<CpuBatch> {
        self.inner.prepare(plan)
    }
    fn prepare_padded(&self, plan: BatchPlan, bound: usize) -> kda_kernels::Result<CpuBatch> {
        self.inner.prepare_padded(plan, bound)
    }
    fn update_batch(&self, batch: &mut CpuBatch, slots: &[u32]) -> kda_kernels::Result<()> {
        self.inner.update_batch(batch, slots)
    }
    fn prefill(
        &self,
        batch: &CpuBatch,
        inputs: &StepInputs<'_, Buf<Self>>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf<Self>>,
        out: &mut TensorViewMut<'_, Buf<Self>>,
    ) -> kda_kernels::Result<()> {
        self.call("prefill", || {
            self.inner.prefill(batch, inputs, opts, layer, out)
        })
    }
    fn decode(
        &self,
        batch: &CpuBatch,
        inputs: &StepInputs<'_, Buf<Self>>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf<Self>>,
        out: &mut TensorViewMut<'_, Buf<Self>>,
    ) -> kda_kernels::Result<()> {
        self.call("decode", || {
            self.inner.decode(batch, inputs, opts, layer, out)
        })
    }
    fn spec_verify(
        &self,
        batch: &CpuBatch,
        accepted: &IndexView<'_, Buf<Self>>,
        inputs: &StepInputs<'_, Buf<Self>>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf<Self>>,
        out: &mut TensorViewMut<'_, Buf<Self>>,
    ) -> kda_kernels::Result<()> {
        self.call("spec_verify", || {
            self.inner
                .spec_verify(batch, accepted, inputs, opts, layer, out)
        })
    }
    fn replay(
        &self,
        batch: &CpuBatch,
        accepted: Option<&IndexView<'_, Buf<Self>>>,
        opts: &KdaOptions,
        a_log: Option<&TensorView<'_, Buf<Self>>>,
        dt_bias: Option<&TensorView<'_, Buf<Self>>>,
        layer: &mut LayerMut<'_, Buf<Self>>,
    ) -> kda_kernels::Result<()> {
        self.call("replay", || {
            self.inner
                .replay(batch, accepted, opts, a_log, dt_bias, layer)
        })
    }
}

/// Three requests' tokens over a pool with a ring: a pair that prefills together and decodes
/// twice, and a lone request that prefills in its own slot.
struct Scenario {
    rig: Rig,
    toks: Vec<Tokens>,
}

const LAYERS: usize = 2;

impl Scenario {
    fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let g = fault_kit::geometry(Dtype::Fp16, 4, 4);
        let rig = Rig::new(g.clone(), &mut rng);
        let toks = (0..3).map(|_| Tokens::random(&mut rng, &g, 12)).collect();
        Self { rig, toks }
    }

    fn part(&self, r: usize, range: std::ops::Range<usize>) -> Tokens {
        let g = self.rig.pool.geometry();
        let t = &self.toks[r];
        let cut = |x: &[f32], per: usize| x[range.start * per..range.end * per].to_vec();
        Tokens {
            q: cut(&t.q, g.h * g.k),
            k: cut(&t.k, g.h * g.k),
            v: cut(&t.v, g.hv * g.v),
            g: cut(&t.g, g.hv * g.k),
            beta: cut(&t.beta, g.hv),
            len: range.len(),
        }
    }

    /// Runs `op` on every layer with `be`.
    fn op<B: Backend<Memory = HostMemory>>(
        &mut self,
        be: &B,
        op: Op,
        lens: &[usize],
        slots: &[u32],
        t: &Tokens,
    ) -> kda_kernels::Result<Vec<Vec<f32>>> {
        let p = plan(lens, slots);
        (0..LAYERS)
            .map(|l| {
                let rig = &mut self.rig;
                run_op(
                    be,
                    &mut rig.pool,
                    &rig.a_log[l],
                    &rig.dt_bias[l],
                    l,
                    op,
                    &p,
                    t,
                    &[],
                )
            })
            .collect()
    }

    /// Requests 0 and 1 in `slots`: a prefill of 10 tokens each, then 2 decodes.
    fn serve_pair<B: Backend<Memory = HostMemory>>(
        &mut self,
        be: &B,
        slots: [u32; 2],
    ) -> kda_kernels::Result<Vec<Vec<f32>>> {
        let mut outs = Vec::new();
        let pre = Tokens::concat(&[&self.part(0, 0..10), &self.part(1, 0..10)]);
        outs.extend(self.op(be, Op::Prefill, &[10, 10], &slots, &pre)?);
        for t in 10..12 {
            let dec = Tokens::concat(&[&self.part(0, t..t + 1), &self.part(1, t..t + 1)]);
            outs.extend(self.op(be, Op::Decode, &[1, 1], &slots, &dec)?);
        }
        Ok(outs)
    }

    /// Request 2 alone in `slot`: a prefill of 12 tokens.
    fn serve_lone<B: Backend<Memory = HostMemory>>(
        &mut self,
        be: &B,
        slot: u32,
    ) -> kda_kernels::Result<Vec<Vec<f32>>> {
        let t = self.part(2, 0..12);
        self.op(be, Op::Prefill, &[12], &[slot], &t)
    }
}

/// Every launch of the pair's work fails once, in turn, before or after running: the error
/// names the failure, the lone request's slot is untouched, the pair's slots come back
/// exactly once and zeroed, and a retry matches a run that never failed.
#[test]
fn a_failed_launch_is_an_error_and_the_pool_goes_on() {
    let seed = 31;
    // The run that never fails.
    let mut clean = Scenario::new(seed);
    let lone_slot;
    let (clean_pair, clean_lone, clean_lone_bytes) = {
        let a = clean.rig.pool.allocate().unwrap();
        let b = clean.rig.pool.allocate().unwrap();
        let c = clean.rig.pool.allocate().unwrap();
        lone_slot = c.index();
        let lone = clean.serve_lone(&CpuBackend::new(), c.index_u32()).unwrap();
        let pair = clean
            .serve_pair(&CpuBackend::new(), [a.index_u32(), b.index_u32()])
            .unwrap();
        let bytes = slot_bytes(&clean.rig.pool, c.index());
        (pair, lone, bytes)
    };
    // The pair's work is 3 operations x 2 layers.
    let launches = 3 * LAYERS;
    for mode in [FailMode::BeforeLaunch, FailMode::AfterLaunch] {
        for fail_at in 0..launches {
            let what = format!("{mode:?} at launch {fail_at}");
            let mut s = Scenario::new(seed);
            let a = s.rig.pool.allocate().unwrap();
            let b = s.rig.pool.allocate().unwrap();
            let c = s.rig.pool.allocate().unwrap();
            assert_eq!(c.index(), lone_slot);
            let lone = s.serve_lone(&CpuBackend::new(), c.index_u32()).unwrap();
            assert_eq!(lone, clean_lone);

            let failing = Failing::new(fail_at, mode);
            let e = s
                .serve_pair(&failing, [a.index_u32(), b.index_u32()])
                .unwrap_err();
            assert!(
                matches!(&e, KernelError::Device { backend: "failing", msg } if msg.contains("injected")),
                "{what}: {e}"
            );
            // The lone request's slot is exactly as before.
            assert!(
                slot_bytes(&s.rig.pool, c.index()) == clean_lone_bytes,
                "{what}: the lone request's slot changed"
            );
            // Abort the pair: their slots come back exactly once.
            let before = s.rig.pool.stats();
            let (ia, ib) = (a.index(), b.index());
            drop(a);
            b.release();
            let after = s.rig.pool.stats();
            assert_eq!(after.in_use, before.in_use - 2, "{what}");
            assert_eq!(after.in_use + after.free, after.capacity, "{what}");
            assert!(!s.rig.pool.allocator().is_held(ia) && !s.rig.pool.allocator().is_held(ib));
            // Retry from the start in fresh slots: zeroed, and the results of a clean run.
            let a2 = s.rig.pool.allocate().unwrap();
            let b2 = s.rig.pool.allocate().unwrap();
            let mut got = [a2.index(), b2.index()];
            got.sort_unstable();
            let mut want = [ia, ib];
            want.sort_unstable();
            assert_eq!(got, want, "{what}: the freed slots are handed out again");
            for h in [&a2, &b2] {
                assert!(
                    slot_bytes(&s.rig.pool, h.index()).iter().all(|&x| x == 0),
                    "{what}: slot {} not zeroed",
                    h.index()
                );
            }
            let pair = s
                .serve_pair(&CpuBackend::new(), [a2.index_u32(), b2.index_u32()])
                .unwrap();
            assert_eq!(
                pair, clean_pair,
                "{what}: the retry differs from a clean run"
            );
            // Nothing is held twice and nothing is lost.
            let extra: Vec<SlotHandle> =
                std::iter::from_fn(|| s.rig.pool.allocate().ok()).collect();
            assert_eq!(extra.len(), 1, "{what}: one slot of 4 is left");
            drop((a2, b2, c, extra));
            assert_eq!(s.rig.pool.stats().in_use, 0);
        }
    }
}

/// An argument error after part of a step ran (layer 0 done, layer 1 refused) is the same
/// situation without a wrapper: the error names the argument, the refused layer is unchanged,
/// and the pool serves on.
#[test]
fn an_argument_error_midway_through_a_step_leaves_the_pool_usable() {
    let mut s = Scenario::new(5);
    let a = s.rig.pool.allocate().unwrap();
    let pre = s.part(0, 0..10);
    let p = plan(&[10], &[a.index_u32()]);
    let be = CpuBackend::new();
    let rig = &mut s.rig;
    run_op(
        &be,
        &mut rig.pool,
        &rig.a_log[0],
        &rig.dt_bias[0],
        0,
        Op::Prefill,
        &p,
        &pre,
        &[],
    )
    .unwrap();
    let layer1 = rig
        .pool
        .read_slot_plane(1, state_pool::Plane::Ssm, a.index())
        .unwrap();
    // Layer 1 gets a truncated v: refused before anything is touched.
    let mut short = pre.clone();
    short.v.truncate(short.v.len() - 1);
    let e = run_op(
        &be,
        &mut rig.pool,
        &rig.a_log[1],
        &rig.dt_bias[1],
        1,
        Op::Prefill,
        &p,
        &short,
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains('v'), "{e}");
    assert_eq!(
        rig.pool
            .read_slot_plane(1, state_pool::Plane::Ssm, a.index())
            .unwrap(),
        layer1
    );
    // The request is aborted; its slot is reused for a fresh one that completes.
    let index = a.index();
    drop(a);
    let again = rig.pool.allocate().unwrap();
    assert_eq!(again.index(), index);
    let out = s
        .op(&be, Op::Prefill, &[10], &[again.index_u32()], &pre)
        .unwrap();
    assert!(out.iter().flatten().all(|x| x.is_finite()));
}
