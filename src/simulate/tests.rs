//! End-to-end tests of the simulation: correct runs in every mode pass the checker, and
//! backends that break the ring contract in small ways are caught by it.

use kda_kernels::api::Buf;
use kda_kernels::cpu::CpuBackend;
use kda_kernels::{
    Backend, BatchPlan, IndexView, KdaOptions, StepInputs, TensorView, TensorViewMut,
};
use state_pool::{DeviceMemory, Dtype, LayerMut, PoolGeometry, StateLayout};

use super::engine::EngineConfig;
use super::summary::Summary;
use super::workload::WorkloadSpec;
use super::{layer_options, run, SimConfig};

fn config(state: Dtype, spec_tokens: usize, ring_len: usize, layout: StateLayout) -> SimConfig {
    let io = Dtype::Fp32;
    SimConfig {
        geometry: PoolGeometry {
            layers: 2,
            h: 2,
            hv: 4,
            k: 16,
            v: 8,
            conv_rows: 3,
            conv_channels: 2 * 2 * 16 + 4 * 8,
            conv_dtype: Dtype::Bf16,
            state_dtype: state,
            layout,
            ring_len,
            ring_dtype: io,
            ring_deltas: false,
            slots: 3,
            checkpoint_slots: 2,
            rounding: Default::default(),
        },
        engine: EngineConfig {
            chunk: 16,
            spec_tokens,
            accept_rate: 0.6,
            io_dtype: io,
            opts: layer_options(),
            seed: 5,
            pad_to: None,
        },
        workload: WorkloadSpec {
            requests: 12,
            max_prompt: 40,
            max_new: 12,
            prefix_share: 0.5,
            seed: 5,
        },
        poison: None,
    }
}

fn summary_for(c: &SimConfig) -> Summary {
    let (o, s) = super::checker::thresholds(c.geometry.state_dtype);
    Summary {
        thresholds: [o, s],
        ..Summary::default()
    }
}

fn simulate<B: Backend>(be: &B, c: &SimConfig) -> Summary
where
    B::Memory: Clone,
{
    run(be, c, summary_for(c)).unwrap()
}

#[test]
fn every_mode_serves_every_request_right_within_the_slots() {
    for (state, spec, ring, layout) in [
        (Dtype::Fp32, 0, 0, StateLayout::KFirst),
        (Dtype::Fp16, 0, 4, StateLayout::VFirst),
        (Dtype::Bf16, 2, 6, StateLayout::KFirst),
        (Dtype::Fp32, 3, 4, StateLayout::VFirst),
    ] {
        let c = config(state, spec, ring, layout);
        let s = simulate(&CpuBackend::new(), &c);
        let what = format!("{state} spec {spec} ring {ring} {layout:?}");
        assert!(s.ok, "{what}: {:?}", s.failure());
        assert_eq!((s.finished, s.violations), (12, 0), "{what}");
        assert_eq!(s.slots.high_water, 3, "{what}: 12 requests fill 3 slots");
        assert_eq!((s.slots.leaked, s.checkpoints.leaked), (0, 0), "{what}");
        assert!(
            s.checkpoints.hits > 0 && s.tokens.restored > 0,
            "{what}: {:?}",
            s.checkpoints
        );
        if spec > 0 {
            assert!(
                s.tokens.verify > s.tokens.accepted && s.tokens.accepted > 0,
                "{what}"
            );
            assert_eq!(s.tokens.decode, 0);
        } else {
            assert!(s.tokens.decode > 0 && s.tokens.verify == 0, "{what}");
        }
        assert!(s.max_output_error > 0.0 || state == Dtype::Fp32, "{what}");
    }
}

#[test]
fn padded_batches_serve_every_request_with_the_bits_of_a_batch_per_step() {
    // An engine replaying graphs of 4 sequences (pool: 3 request and 2 checkpoint slots): the
    // same workload computes the same values, so the errors against the recomputation are
    // identical, while the padding (NaN inputs) is never read and its outputs never written.
    for (state, spec, ring, layout) in [
        (Dtype::Fp32, 0, 0, StateLayout::KFirst),
        (Dtype::Fp16, 0, 4, StateLayout::VFirst),
        (Dtype::Bf16, 2, 6, StateLayout::KFirst),
    ] {
        let what = format!("{state} spec {spec} ring {ring} {layout:?}");
        let plain = simulate(&CpuBackend::new(), &config(state, spec, ring, layout));
        let mut c = config(state, spec, ring, layout);
        c.engine.pad_to = Some(4);
        let padded = simulate(&CpuBackend::new(), &c);
        assert!(plain.ok && padded.ok, "{what}: {:?}", padded.failure());
        assert_eq!((plain.padded_steps, padded.violations), (0, 0), "{what}");
        assert!(padded.padded_steps > 0, "{what}: no step was padded");
        assert_eq!(plain.max_output_error, padded.max_output_error, "{what}");
        assert_eq!(plain.max_state_error, padded.max_state_error, "{what}");
        assert_eq!(plain.tokens.computed, padded.tokens.computed, "{what}");
    }
}

#[test]
fn a_fp32_ring_is_bit_exact_with_eager_decode() {
    // Same workload, eager and through a ring: an fp32 ring replays exactly what eager decode
    // computes, so the errors against the recomputation are identical.
    let eager = simulate(
        &CpuBackend::new(),
        &config(Dtype::Fp32, 0, 0, StateLayout::KFirst),
    );
    let ring = simulate(
        &CpuBackend::new(),
        &config(Dtype::Fp32, 0, 5, StateLayout::KFirst),
    );
    assert!(eager.ok && ring.ok);
    assert_eq!(eager.max_output_error, ring.max_output_error);
    assert_eq!(eager.max_state_error, ring.max_state_error);
}

#[test]
fn a_poisoned_request_is_reported_and_the_others_stay_right() {
    let mut c = config(Dtype::Fp16, 2, 6, StateLayout::KFirst);
    c.workload.prefix_share = 0.0;
    c.poison = Some((4, 3));
    let s = simulate(&CpuBackend::new(), &c);
    assert!(!s.ok);
    assert_eq!(s.poisoned_requests, vec![4]);
    assert_eq!(
        s.wrong_requests,
        vec![4],
        "only the poisoned request is wrong"
    );
    assert_eq!((s.finished, s.slots.leaked), (12, 0));
    let why = s.failure().unwrap();
    assert!(why.contains("poisoned: 4"), "{why}");
}

/// A backend that breaks the ring contract in one way, to show that the checker notices.
struct Broken {
    inner: CpuBackend,
    /// `spec_verify` gives the kernels 0 accepted drafts instead of the engine's counts.
    drop_accepted: bool,
    /// `replay` does nothing.
    skip_replay: bool,
}

impl Backend for Broken {
    type Memory = <CpuBackend as Backend>::Memory;
    type Batch = <CpuBackend as Backend>::Batch;

    fn name(&self) -> &'static str {
        "broken"
    }
    fn memory(&self) -> &Self::Memory {
        self.inner.memory()
    }
    fn prepare(&self, plan: BatchPlan) -> kda_kernels::Result<Self::Batch> {
        self.inner.prepare(plan)
    }
    fn prepare_padded(&self, plan: BatchPlan, bound: usize) -> kda_kernels::Result<Self::Batch> {
        self.inner.prepare_padded(plan, bound)
    }
    fn update_batch(&self, batch: &mut Self::Batch, slots: &[u32]) -> kda_kernels::Result<()> {
        self.inner.update_batch(batch, slots)
    }
    fn prefill(
        &self,
        batch: &Self::Batch,
        inputs: &StepInputs<'_, Buf<Self>>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf<Self>>,
        out: &mut TensorViewMut<'_, Buf<Self>>,
    ) -> kda_kernels::Result<()> {
        self.inner.prefill(batch, inputs, opts, layer, out)
    }
    fn decode(
        &self,
        batch: &Self::Batch,
        inputs: &StepInputs<'_, Buf<Self>>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf<Self>>,
        out: &mut TensorViewMut<'_, Buf<Self>>,
    ) -> kda_kernels::Result<()> {
        self.inner.decode(batch, inputs, opts, layer, out)
    }
    fn spec_verify(
        &self,
        batch: &Self::Batch,
        accepted: &IndexView<'_, Buf<Self>>,
        inputs: &StepInputs<'_, Buf<Self>>,
        opts: &KdaOptions,
        layer: &mut LayerMut<'_, Buf<Self>>,
        out: &mut TensorViewMut<'_, Buf<Self>>,
    ) -> kda_kernels::Result<()> {
        if self.drop_accepted {
            let zeros = self.memory().alloc_zeroed(accepted.len * 4)?;
            let none = IndexView {
                buf: &zeros,
                len: accepted.len,
            };
            return self
                .inner
                .spec_verify(batch, &none, inputs, opts, layer, out);
        }
        self.inner
            .spec_verify(batch, accepted, inputs, opts, layer, out)
    }
    fn replay(
        &self,
        batch: &Self::Batch,
        accepted: Option<&IndexView<'_, Buf<Self>>>,
        opts: &KdaOptions,
        a_log: Option<&TensorView<'_, Buf<Self>>>,
        dt_bias: Option<&TensorView<'_, Buf<Self>>>,
        layer: &mut LayerMut<'_, Buf<Self>>,
    ) -> kda_kernels::Result<()> {
        if self.skip_replay {
            return Ok(());
        }
        self.inner
            .replay(batch, accepted, opts, a_log, dt_bias, layer)
    }
}

#[test]
fn the_checker_catches_accepted_drafts_that_were_dropped() {
    let be = Broken {
        inner: CpuBackend::new(),
        drop_accepted: true,
        skip_replay: false,
    };
    let s = simulate(&be, &config(Dtype::Fp32, 2, 6, StateLayout::KFirst));
    assert!(!s.ok);
    assert!(s.wrong_requests.len() > 6, "{:?}", s.wrong_requests);
    assert!(s.max_output_error > 1e-2, "{}", s.max_output_error);
}

#[test]
fn the_checker_catches_a_flush_that_folds_nothing() {
    let be = Broken {
        inner: CpuBackend::new(),
        drop_accepted: false,
        skip_replay: true,
    };
    // Eager decode needs no flush: a no-op replay is harmless there.
    let eager = simulate(&be, &config(Dtype::Fp32, 0, 0, StateLayout::KFirst));
    assert!(eager.ok, "{:?}", eager.failure());
    // Through a ring, the final state lacks the pending tokens: every state is wrong, and a
    // slot released unflushed is refused by the next checkpoint or reused dirty.
    let c = config(Dtype::Fp32, 0, 4, StateLayout::KFirst);
    match run(&be, &c, summary_for(&c)) {
        Ok(s) => {
            assert!(!s.ok);
            assert!(s.max_state_error > 1e-2, "{}", s.max_state_error);
        }
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains("flushed"), "{e}");
        }
    }
}
