//! Bad input: every kind of argument error is refused with an error naming the argument, and
//! (through [`guarded`]) leaves every byte of the pool and its epoch unchanged.

use rand::rngs::StdRng;
use rand::SeedableRng;
use state_pool::{Dtype, LayerMut, PoolGeometry, Rounding};

use super::checks::{initial_states, layer_with_states};
use super::data::{batch_plan, Case, HostInputs};
use super::layer::{
    guarded, poisoned_output, run_tokens, upload, upload_bytes, DeviceInputs, TestLayer, TokenOp,
};
use crate::api::{
    Backend, BatchPlan, Buf, GateMode, IndexView, KdaOptions, StepInputs, TensorView, TensorViewMut,
};
use crate::error::{KernelError, Result};

/// Asserts that `r` is an [`KernelError::InvalidArgument`] naming `arg`.
pub fn assert_refused<T: std::fmt::Debug>(r: Result<T>, arg: &str, what: &str) {
    match r {
        Err(KernelError::InvalidArgument { arg: a, msg }) => {
            assert_eq!(a, arg, "{what}: refused, but naming {a} ({msg})");
            assert!(!msg.is_empty(), "{what}: the message says nothing");
        }
        other => panic!("{what}: expected an error naming {arg}, got {other:?}"),
    }
}

/// The case the bad calls are made against: a bf16 ring of 2 over an fp16 pool, GVA, the
/// gate and beta activated in the kernel; slots 0 and 2 of 4 in use.
pub fn bad_input_case() -> Case {
    Case {
        seq_lens: vec![1, 1],
        slots: vec![0, 2],
        total_slots: 4,
        state_dtype: Dtype::Fp16,
        input_dtype: Dtype::Bf16,
        ring_len: 2,
        rounding: Rounding::Stochastic { seed: 9 },
        ..Case::new(2, 4, 3, 5)
    }
}

/// A call with explicit (possibly bad) arguments.
struct Call<'a, Bf> {
    batch: BatchPlan,
    inputs: StepInputs<'a, Bf>,
    out_dtype: Dtype,
    out_len: usize,
    accepted: Option<&'a [u32]>,
}

impl<'a, Bf> Call<'a, Bf> {
    /// A call of `batch` on `inputs`, with an output of the right size and dtype for `case`.
    fn new(batch: BatchPlan, inputs: StepInputs<'a, Bf>, case: &Case) -> Self {
        Self {
            batch,
            out_len: inputs.q.len / (case.h * case.k) * case.hv * case.v,
            inputs,
            out_dtype: case.input_dtype,
            accepted: None,
        }
    }
}

/// Which operation a [`Call`] makes.
#[derive(Clone, Copy)]
enum Which {
    Prefill,
    Decode,
    Spec,
}

/// Makes `call` through `op`, guarded.
fn make<B: Backend>(
    be: &B,
    layer: &mut TestLayer<Buf<B>>,
    op: Which,
    opts: &KdaOptions,
    call: Call<'_, Buf<B>>,
) -> Result<()> {
    let mem = be.memory();
    let mut out_buf = poisoned_output(mem, call.out_dtype, call.out_len)?;
    let acc_buf = upload_bytes(mem, bytemuck::cast_slice(call.accepted.unwrap_or(&[])))?;
    let named = call.batch.slots.clone();
    guarded(be, layer, &named, |view: &mut LayerMut<'_, Buf<B>>| {
        // A bad batch may be refused by `prepare` or by the operation: either is fine.
        let batch = be.prepare(call.batch.clone())?;
        let mut out = TensorViewMut {
            buf: &mut out_buf,
            dtype: call.out_dtype,
            len: call.out_len,
        };
        match op {
            Which::Prefill => be.prefill(&batch, &call.inputs, opts, view, &mut out),
            Which::Decode => be.decode(&batch, &call.inputs, opts, view, &mut out),
            Which::Spec => {
                let acc = IndexView {
                    buf: &acc_buf,
                    len: call.accepted.map_or(0, |a| a.len()),
                };
                be.spec_verify(&batch, &acc, &call.inputs, opts, view, &mut out)
            }
        }
    })
}

/// Every kind of bad argument, against `be`: each is refused naming the argument, and the
/// pool keeps every byte. Then a good call still works.
pub fn check_rejects_bad_input<B: Backend>(be: &B, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mem = be.memory();
    let case = bad_input_case();
    let opts = case.opts;
    let init = initial_states(&case, &mut rng);
    let mut layer = layer_with_states(be, &case, &init, &mut rng);
    let dims = case.dims();

    // Slot 2 gets 2 drafts of a verify; slot 0 one pending token.
    let two = HostInputs::random(&mut rng, dims, 2, &opts, case.input_dtype);
    run_tokens(
        be,
        &mut layer,
        TokenOp::SpecVerify(&[0]),
        &[0, 2],
        &[2],
        &two,
        &opts,
    )
    .expect("a verify that leaves drafts");
    let one = HostInputs::random(&mut rng, dims, 1, &opts, case.input_dtype)
        .with_gate_params(&two.a_log, &two.dt_bias);
    run_tokens(be, &mut layer, TokenOp::Decode, &[0, 1], &[0], &one, &opts).expect("decode");

    let good = DeviceInputs::upload(mem, &two, &opts).expect("upload");
    let as_f32 = DeviceInputs::upload(
        mem,
        &HostInputs {
            dtype: Dtype::Fp32,
            ..two.clone()
        },
        &opts,
    )
    .expect("upload");
    let plan = |bounds: &[usize], slots: &[u32]| BatchPlan {
        bounds: bounds.to_vec(),
        slots: slots.to_vec(),
    };
    let prefill_plan = plan(&[0, 1, 2], &[0, 1]);
    let decode_plan = plan(&[0, 1, 2], &[0, 3]);

    let mut expect = |op: Which, c: Call<'_, Buf<B>>, o: &KdaOptions, arg: &str, what: &str| {
        assert_refused(make(be, &mut layer, op, o, c), arg, what);
    };

    // Shapes.
    let mut v = good.view();
    v.q.len -= 1;
    expect(
        Which::Prefill,
        Call::new(prefill_plan.clone(), v, &case),
        &opts,
        "q",
        "q one element short",
    );
    let mut v = good.view();
    v.k.len += case.k;
    expect(
        Which::Decode,
        Call::new(decode_plan.clone(), v, &case),
        &opts,
        "k",
        "k one head row long",
    );
    let mut v = good.view();
    v.v.len -= 1;
    expect(
        Which::Decode,
        Call::new(decode_plan.clone(), v, &case),
        &opts,
        "v",
        "v one element short",
    );
    let mut v = good.view();
    v.g.len -= case.k;
    expect(
        Which::Decode,
        Call::new(decode_plan.clone(), v, &case),
        &opts,
        "g",
        "g one row short",
    );
    let mut v = good.view();
    v.beta.len += 1;
    expect(
        Which::Decode,
        Call::new(decode_plan.clone(), v, &case),
        &opts,
        "beta",
        "beta one element long",
    );
    let mut c = Call::new(decode_plan.clone(), good.view(), &case);
    c.out_len -= 1;
    expect(Which::Decode, c, &opts, "out", "output one element short");

    // Dtypes.
    let mut v = good.view();
    v.v = as_f32.view().v;
    expect(
        Which::Decode,
        Call::new(decode_plan.clone(), v, &case),
        &opts,
        "v",
        "v in fp32, the rest bf16",
    );
    expect(
        Which::Decode,
        Call::new(decode_plan.clone(), as_f32.view(), &case),
        &opts,
        "q",
        "fp32 inputs for a bf16 ring",
    );
    let mut c = Call::new(decode_plan.clone(), good.view(), &case);
    c.out_dtype = Dtype::Fp16;
    expect(
        Which::Decode,
        c,
        &opts,
        "out",
        "an fp16 output for bf16 inputs",
    );

    // Gate parameters.
    let mut v = good.view();
    v.a_log = None;
    expect(
        Which::Decode,
        Call::new(decode_plan.clone(), v, &case),
        &opts,
        "a_log",
        "A_log missing",
    );
    let mut v = good.view();
    v.dt_bias = None;
    expect(
        Which::Prefill,
        Call::new(prefill_plan.clone(), v, &case),
        &opts,
        "dt_bias",
        "dt_bias missing",
    );
    let bf16_params = upload(mem, &two.a_log, Dtype::Bf16).expect("upload");
    let mut v = good.view();
    v.a_log = Some(TensorView {
        buf: &bf16_params,
        dtype: Dtype::Bf16,
        len: case.hv,
    });
    expect(
        Which::Decode,
        Call::new(decode_plan.clone(), v, &case),
        &opts,
        "a_log",
        "A_log in bf16",
    );
    let mut v = good.view();
    if let Some(d) = v.dt_bias.as_mut() {
        d.len -= 1;
    }
    expect(
        Which::Decode,
        Call::new(decode_plan.clone(), v, &case),
        &opts,
        "dt_bias",
        "dt_bias one short",
    );
    let bad_gate = KdaOptions {
        gate: GateMode::LowerBound(1.0),
        ..opts
    };
    expect(
        Which::Decode,
        Call::new(decode_plan.clone(), good.view(), &case),
        &bad_gate,
        "opts.gate",
        "a positive lower bound",
    );

    // The batch.
    expect(
        Which::Decode,
        Call::new(plan(&[0, 1, 2], &[0, 9]), good.view(), &case),
        &opts,
        "slots",
        "slot 9 of 4",
    );
    expect(
        Which::Decode,
        Call::new(plan(&[0, 1, 2], &[3, 3]), good.view(), &case),
        &opts,
        "slots",
        "slot 3 twice",
    );
    expect(
        Which::Prefill,
        Call::new(plan(&[0, 2, 1], &[0, 3]), good.view(), &case),
        &opts,
        "cu_seqlens",
        "decreasing offsets",
    );
    expect(
        Which::Prefill,
        Call::new(plan(&[0, 1, 1], &[0, 3]), good.view(), &case),
        &opts,
        "cu_seqlens",
        "offsets ending before the tokens",
    );
    expect(
        Which::Prefill,
        Call::new(plan(&[0, 1], &[0, 3]), good.view(), &case),
        &opts,
        "cu_seqlens",
        "one offset too few",
    );
    expect(
        Which::Decode,
        Call::new(plan(&[0, 2], &[3]), good.view(), &case),
        &opts,
        "cu_seqlens",
        "decode of 2 tokens",
    );
    assert_refused(
        batch_plan(&[0, 1, 2], &[1, 1]),
        "slots",
        "BatchPlan::new with a slot twice",
    );

    // The ring.
    expect(
        Which::Decode,
        Call::new(plan(&[0, 1, 2], &[0, 2]), good.view(), &case),
        &opts,
        "slots",
        "decode of a slot with drafts",
    );
    let three = HostInputs::random(&mut rng, dims, 3, &opts, case.input_dtype)
        .with_gate_params(&two.a_log, &two.dt_bias);
    let three_dev = DeviceInputs::upload(mem, &three, &opts).expect("upload");
    let mut c = Call::new(plan(&[0, 3], &[3]), three_dev.view(), &case);
    c.accepted = Some(&[0]);
    expect(
        Which::Spec,
        c,
        &opts,
        "cu_seqlens",
        "3 drafts for a ring of 2",
    );
    let mut c = Call::new(plan(&[0, 1, 2], &[0, 2]), good.view(), &case);
    c.accepted = Some(&[0, 3]);
    expect(Which::Spec, c, &opts, "accepted", "3 accepted of 2 drafts");
    let mut c = Call::new(plan(&[0, 1, 2], &[0, 2]), good.view(), &case);
    c.accepted = Some(&[0]);
    expect(
        Which::Spec,
        c,
        &opts,
        "accepted",
        "one accepted count for two sequences",
    );

    // Replay and the layer itself.
    let replay = |layer: &mut TestLayer<Buf<B>>, bounds: &[usize], a_log: bool| -> Result<()> {
        let a = upload(mem, &two.a_log, Dtype::Fp32)?;
        let d = upload(mem, &two.dt_bias, Dtype::Fp32)?;
        let av = TensorView {
            buf: &a,
            dtype: Dtype::Fp32,
            len: case.hv,
        };
        let dv = TensorView {
            buf: &d,
            dtype: Dtype::Fp32,
            len: case.hv * case.k,
        };
        let batch = be.prepare(plan(bounds, &[0]))?;
        guarded(be, layer, &[0], |view| {
            be.replay(&batch, None, &opts, a_log.then_some(&av), Some(&dv), view)
        })
    };
    assert_refused(
        replay(&mut layer, &[0, 1], true),
        "cu_seqlens",
        "replay of a sequence with a token",
    );
    assert_refused(
        replay(&mut layer, &[0, 0], false),
        "a_log",
        "replay without A_log",
    );
    let other = PoolGeometry {
        k: case.k + 1,
        ..layer.geometry.clone()
    };
    {
        let before = layer.snapshot(mem).expect("snapshot");
        let r = {
            let planes = &mut layer.planes;
            let mut view = planes.view(&other);
            let batch = be.prepare(plan(&[0, 0], &[0])).expect("batch");
            be.replay(&batch, None, &KdaOptions::default(), None, None, &mut view)
        };
        assert_refused(r, "layer", "planes of another geometry");
        assert!(
            before == layer.snapshot(mem).expect("snapshot"),
            "a refused call changed the pool"
        );
    }

    // A good call still goes through.
    run_tokens(
        be,
        &mut layer,
        TokenOp::SpecVerify(&[0, 1]),
        &[0, 1, 2],
        &[0, 2],
        &two,
        &opts,
    )
    .expect("a good call after the refused ones");
}
