//! Isolation and bad input on the CPU backend: calls leave the slots they do not name alone and
//! write every output; every argument error names the argument and leaves the pool
//! byte-identical; the guards of the test kit catch a backend that breaks its promises.

use kda_kernels::api::{Buf, IndexView, StepInputs, TensorView, TensorViewMut};
use kda_kernels::cpu::CpuBatch;
use kda_kernels::testing::{
    assert_refused, check_rejects_bad_input, initial_states, layer_with_states, run_replay,
    run_tokens, Case, HostInputs, TokenOp,
};
use kda_kernels::{Backend, BatchPlan, CpuBackend, KdaOptions, Result};
use rand::rngs::StdRng;
use rand::SeedableRng;
use state_pool::{HostBuffer, HostMemory, LayerMut};

#[test]
fn bad_input_is_an_error_naming_the_argument_and_leaves_the_pool_unchanged() {
    check_rejects_bad_input(&CpuBackend, 1);
    check_rejects_bad_input(&CpuBackend, 2);
}

#[test]
fn every_operation_leaves_unnamed_slots_untouched_and_writes_every_output() {
    // The runners poison the output and every slot not in the call, and compare bytes after
    // each call (see `kda_kernels::testing::guarded`); here every operation goes through them
    // on a pool where most slots are poisoned, across both layouts and 2-byte rounding.
    let be = CpuBackend;
    for (i, layout) in [
        state_pool::StateLayout::KFirst,
        state_pool::StateLayout::VFirst,
    ]
    .into_iter()
    .enumerate()
    {
        let case = Case {
            layout,
            ring_len: 3,
            state_dtype: state_pool::Dtype::Bf16,
            total_slots: 7,
            ..Case::new(2, 4, 5, 3).with_seqs(&[4, 0, 2], &[5, 1, 3])
        };
        let mut rng = StdRng::seed_from_u64(i as u64);
        let init = initial_states(&case, &mut rng);
        let mut layer = layer_with_states(&be, &case, &init, &mut rng);
        let opts = case.opts;
        let inputs = HostInputs::random(
            &mut rng,
            case.dims(),
            case.num_tokens(),
            &opts,
            case.input_dtype,
        );
        let ones = [0, 1, 2, 3];
        let params = (&inputs.a_log, &inputs.dt_bias);
        run_tokens(
            &be,
            &mut layer,
            TokenOp::Prefill,
            &case.bounds(),
            &case.slots,
            &inputs,
            &opts,
        )
        .expect("prefill");
        run_tokens(
            &be,
            &mut layer,
            TokenOp::Decode,
            &ones,
            &case.slots,
            &inputs.gather(&[0, 1, 2]),
            &opts,
        )
        .expect("decode");
        run_tokens(
            &be,
            &mut layer,
            TokenOp::SpecVerify(&[0, 0]),
            &[0, 3, 5],
            &case.slots[..2],
            &inputs.gather(&[0, 1, 2, 3, 4]),
            &opts,
        )
        .expect("spec_verify");
        run_replay(
            &be,
            &mut layer,
            &case.slots[1..],
            Some(&[2, 0]),
            &opts,
            params.0,
            params.1,
        )
        .expect("replay");
    }
}

#[test]
fn hand_built_plans_are_refused_by_prepare_and_prepare_padded() {
    // BatchPlan's fields are public; a batch of the CPU backend is only made from a checked
    // plan (and its operations check the plan again).
    let be = CpuBackend;
    for (bounds, slots, arg) in [
        (vec![0, 1, 2], vec![3, 3], "slots"),
        (vec![0, 2, 1], vec![0, 3], "cu_seqlens"),
        (vec![1, 1, 2], vec![0, 3], "cu_seqlens"),
        (vec![0, 1, 2, 2], vec![0, 3], "cu_seqlens"),
    ] {
        let plan = BatchPlan { bounds, slots };
        assert_refused(be.prepare(plan.clone()), arg, &format!("prepare {plan:?}"));
        assert_refused(
            be.prepare_padded(plan.clone(), 8),
            arg,
            &format!("prepare_padded {plan:?}"),
        );
    }
}

/// A backend that runs the CPU backend and then breaks one promise.
struct Broken {
    touch_slot: Option<u32>,
    skip_last_output: bool,
}

impl Broken {
    fn after(
        &self,
        layer: &mut LayerMut<'_, HostBuffer>,
        out: Option<&mut TensorViewMut<'_, HostBuffer>>,
    ) {
        if let Some(s) = self.touch_slot {
            let at = s as usize * layer.geometry.ssm_slot_bytes();
            layer.ssm.bytes_mut()[at] ^= 1;
        }
        if let (true, Some(out)) = (self.skip_last_output, out) {
            let n = out.len * out.dtype.size();
            out.buf.bytes_mut()[n - out.dtype.size()..n].fill(0xff);
        }
    }
}

impl Backend for Broken {
    type Memory = HostMemory;
    type Batch = CpuBatch;
    fn name(&self) -> &'static str {
        "broken"
    }
    fn memory(&self) -> &HostMemory {
        CpuBackend.memory()
    }
    fn prepare(&self, plan: BatchPlan) -> Result<CpuBatch> {
        CpuBackend.prepare(plan)
    }
    fn prepare_padded(&self, plan: BatchPlan, slot_bound: usize) -> Result<CpuBatch> {
        CpuBackend.prepare_padded(plan, slot_bound)
    }
    fn update_batch(&self, batch: &mut CpuBatch, slots: &[u32]) -> Result<()> {
        CpuBackend.update_batch(batch, slots)
    }
    fn prefill(
        &self,
        b: &CpuBatch,
        i: &StepInputs<'_, Buf<Self>>,
        o: &KdaOptions,
        l: &mut LayerMut<'_, HostBuffer>,
        out: &mut TensorViewMut<'_, HostBuffer>,
    ) -> Result<()> {
        CpuBackend.prefill(b, i, o, l, out)?;
        self.after(l, Some(out));
        Ok(())
    }
    fn decode(
        &self,
        b: &CpuBatch,
        i: &StepInputs<'_, Buf<Self>>,
        o: &KdaOptions,
        l: &mut LayerMut<'_, HostBuffer>,
        out: &mut TensorViewMut<'_, HostBuffer>,
    ) -> Result<()> {
        CpuBackend.decode(b, i, o, l, out)?;
        self.after(l, Some(out));
        Ok(())
    }
    fn spec_verify(
        &self,
        b: &CpuBatch,
        a: &IndexView<'_, HostBuffer>,
        i: &StepInputs<'_, Buf<Self>>,
        o: &KdaOptions,
        l: &mut LayerMut<'_, HostBuffer>,
        out: &mut TensorViewMut<'_, HostBuffer>,
    ) -> Result<()> {
        CpuBackend.spec_verify(b, a, i, o, l, out)?;
        self.after(l, Some(out));
        Ok(())
    }
    fn replay(
        &self,
        b: &CpuBatch,
        a: Option<&IndexView<'_, HostBuffer>>,
        o: &KdaOptions,
        al: Option<&TensorView<'_, HostBuffer>>,
        dt: Option<&TensorView<'_, HostBuffer>>,
        l: &mut LayerMut<'_, HostBuffer>,
    ) -> Result<()> {
        CpuBackend.replay(b, a, o, al, dt, l)?;
        self.after(l, None);
        Ok(())
    }
}

fn decode_once(be: &Broken) {
    let case = Case::new(1, 2, 4, 3).with_seqs(&[1], &[1]);
    let mut rng = StdRng::seed_from_u64(3);
    let init = initial_states(&case, &mut rng);
    let mut layer = layer_with_states(be, &case, &init, &mut rng);
    let inputs = HostInputs::random(&mut rng, case.dims(), 1, &case.opts, case.input_dtype);
    run_tokens(
        be,
        &mut layer,
        TokenOp::Decode,
        &[0, 1],
        &case.slots,
        &inputs,
        &case.opts,
    )
    .expect("decode");
}

#[test]
fn the_wrapper_without_faults_passes_the_guards() {
    decode_once(&Broken {
        touch_slot: None,
        skip_last_output: false,
    });
}

#[test]
#[should_panic(expected = "a slot not in the call")]
fn the_guard_catches_a_write_to_a_slot_not_in_the_call() {
    decode_once(&Broken {
        touch_slot: Some(2),
        skip_last_output: false,
    });
}

#[test]
#[should_panic(expected = "was not written")]
fn the_guard_catches_an_output_element_left_unwritten() {
    decode_once(&Broken {
        touch_slot: None,
        skip_last_output: true,
    });
}
