//! The CUDA backend against the CPU backend (the oracle) and against itself: eager decode, the
//! replay ring, speculative verify, stochastic rounding, slot isolation, poisoned outputs and
//! refused input. Every test prints a skip reason and returns when no CUDA device, driver or
//! NVRTC is present (or the crate was built without the `cuda` feature), so CI without a GPU
//! passes.
//!
//! Accuracy achieved (see docs/performance.md): fp32 pools within 1e-5 relative of the CPU
//! backend; 2-byte pools within one rounding step of the CPU's stored state, element by
//! element (bit-exact wherever both round the same f32 value; the f32 arithmetic itself
//! differs in the order of the K reductions and in FMA contraction, so not every element is).
//!
//! Built only with the `cuda` feature (the test command of the README and CI enables it); without
//! it the stub backend is uninhabited and there is nothing to run.
#![cfg(feature = "cuda")]

use kda_kernels::cpu::validate::PADDED_EPOCH_STEP;
use kda_kernels::cuda::CudaBackend;
use kda_kernels::testing::{
    assert_bits_eq, assert_layers_agree, assert_refused, bad_input_case, batch_plan,
    check_decode_matches_prefill, check_padded_batch_matches_plain_batches,
    check_prefill_folds_the_ring_first_within, check_prefill_in_two_pieces_matches_one,
    check_prefill_matches_reference, check_rejects_bad_input, check_ring_decode_matches_eager,
    check_ring_rounds_once_per_commit, check_spec_verify_matches_eager, download, initial_states,
    layer_with_states, live_output, random_slots, rel_frobenius_f32, run_replay, run_tokens,
    twin_layers, upload, upload_bytes, Case, DeviceInputs, HostInputs, PaddedOp, TestLayer,
    TokenOp,
};
use kda_kernels::{
    Backend, BatchKind, CpuBackend, EagerKernel, GateMode, IndexView, KernelError, PrefillKernel,
    RingKernel, TensorViewMut,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use state_pool::{DeviceMemory, Dtype, PoolGeometry, RingMeta, Rounding, StateLayout};
use std::sync::Once;

/// The CUDA backend, or `None` after printing why the test is skipped. The first call compiles
/// the kernel modules of the suite's shapes at once ([`suite_geometries`]): one after another,
/// on first use, NVRTC alone takes about 2 s per module (measured on a build machine), for
/// 28 modules against a suite of 130-220 s on the H200.
fn cuda() -> Option<CudaBackend> {
    static WARM: Once = Once::new();
    match CudaBackend::new() {
        Ok(be) => {
            WARM.call_once(|| {
                be.warm_up(&suite_geometries(), &[BatchKind::Plain])
                    .expect("the suite's kernels compile")
            });
            Some(be)
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// A pool of each (state dtype, input dtype, layout, K, V) the tests below use; only those
/// decide the kernel module. A shape missing here compiles on its first use.
fn suite_geometries() -> Vec<PoolGeometry> {
    use StateLayout::{KFirst, VFirst};
    let mut shapes = Vec::new();
    for state in Dtype::ALL {
        for layout in [KFirst, VFirst] {
            shapes.push((state, Dtype::Fp32, layout, 32, 48));
            shapes.push((state, Dtype::Bf16, layout, 128, 128));
        }
        shapes.push((state, Dtype::Fp32, VFirst, 128, 128));
        shapes.push((state, Dtype::Fp16, KFirst, 32, 96));
        shapes.push((state, Dtype::Fp16, KFirst, 128, 128));
        shapes.push((state, Dtype::Bf16, KFirst, 128, 256));
    }
    for layout in [KFirst, VFirst] {
        shapes.push((Dtype::Fp16, Dtype::Fp16, layout, 5, 7));
    }
    shapes.push((Dtype::Fp32, Dtype::Fp32, KFirst, 16, 16));
    let mut geometries: Vec<PoolGeometry> = shapes
        .into_iter()
        .map(|(state, input, layout, k, v)| case(1, 1, k, v, state, input, layout, 1).geometry())
        .collect();
    geometries.push(bad_input_case().geometry());
    geometries
}

/// A case with the given shape and pool, sequences in scattered slots of a larger pool.
#[allow(clippy::too_many_arguments)]
fn case(
    h: usize,
    hv: usize,
    k: usize,
    v: usize,
    state: Dtype,
    input: Dtype,
    layout: StateLayout,
    ring_len: usize,
) -> Case {
    let n = 5;
    let slots: Vec<u32> = (0..n as u32).map(|i| 2 * i + 1).collect();
    Case {
        state_dtype: state,
        input_dtype: input,
        layout,
        ring_len,
        ..Case::new(h, hv, k, v).with_seqs(&vec![1; n], &slots)
    }
}

/// One ulp of `dtype` at magnitude `x` (normal range; the subnormal spacing below it).
fn ulp(x: f32, dtype: Dtype) -> f32 {
    let (mant, min_exp) = match dtype {
        Dtype::Fp16 => (10, -14),
        Dtype::Bf16 => (7, -126),
        Dtype::Fp32 => (23, -126),
    };
    let e = if x == 0.0 {
        min_exp
    } else {
        (x.abs().log2().floor() as i32).max(min_exp)
    };
    2f32.powi(e - mant)
}

/// Whether the GPU's stored value `a` is within one rounding step of the CPU's `b`, allowing
/// for the f32 arithmetic's own difference (`noise`, absolute): different K-reduction order and
/// FMA contraction move the value being rounded by a few f32 ulps of the state's scale.
fn within_one_step(a: f32, b: f32, dtype: Dtype, noise: f32) -> bool {
    (a - b).abs() <= ulp(a.abs().max(b.abs()), dtype) + noise
}

/// Runs the same sequence of calls (eager or ring decode steps, a spec_verify with random
/// accepted counts where there is a ring, a flush) on the CPU and the CUDA backend from the
/// same states and inputs; compares outputs and states. Returns the worst relative output
/// difference and the fraction of bit-exact state elements after the first store.
fn compare_with_cpu(cu: &CudaBackend, case: &Case, steps: usize, seed: u64) -> (f64, f64) {
    compare_with_cpu_every(cu, case, steps, seed, Calls::mixed(case.ring_len))
}

/// The calls of `compare_with_cpu_every`.
struct Calls<'a> {
    /// A verify every `spec_every` calls (0: decode only; 1 with `chain`: verifies only).
    spec_every: usize,
    /// Each verify has 0..=`max_drafts` drafts per sequence.
    max_drafts: usize,
    /// A verify's drafts are resolved by the next verify's random accepted counts, not by a
    /// flush right after it.
    chain: bool,
    /// Runs before each CUDA call, with the call's number (to switch kernels between calls).
    before: &'a dyn Fn(usize),
}

impl Calls<'_> {
    /// Decodes, and a verify of up to `max_drafts` drafts and a flush every third call.
    fn mixed(max_drafts: usize) -> Self {
        Calls {
            spec_every: 3,
            max_drafts,
            chain: false,
            before: &|_| {},
        }
    }
}

/// `compare_with_cpu` with the given mix of calls.
fn compare_with_cpu_every(
    cu: &CudaBackend,
    case: &Case,
    steps: usize,
    seed: u64,
    calls: Calls,
) -> (f64, f64) {
    let Calls {
        spec_every,
        max_drafts,
        chain,
        before,
    } = calls;
    let mut rng = StdRng::seed_from_u64(seed);
    let init = initial_states(case, &mut rng);
    let mut cpu_layer: TestLayer<_> = layer_with_states(
        &CpuBackend,
        case,
        &init,
        &mut StdRng::seed_from_u64(seed ^ 1),
    );
    let mut gpu_layer = layer_with_states(cu, case, &init, &mut StdRng::seed_from_u64(seed ^ 2));
    let n = case.slots.len();
    let dims = case.dims();
    let params = HostInputs::random(&mut rng, dims, 0, &case.opts, case.input_dtype);
    let bounds1: Vec<usize> = (0..=n).collect();
    let mut worst = 0.0f64;
    let mut exact = None;
    let out_tol = if case.state_dtype == Dtype::Fp32 && case.input_dtype == Dtype::Fp32 {
        1e-5
    } else {
        2e-2
    };
    // with `chain`: the drafts of the last verify, per sequence
    let mut drafts = vec![0usize; n];
    for step in 0..steps {
        let use_spec = case.ring_len > 0 && spec_every > 0 && step % spec_every == spec_every - 1;
        let (bounds, acc): (Vec<usize>, Vec<u32>) = if use_spec {
            let lens: Vec<usize> = (0..n).map(|_| rng.random_range(0..=max_drafts)).collect();
            let mut b = vec![0];
            for l in &lens {
                b.push(b.last().unwrap() + l);
            }
            let acc = drafts
                .iter()
                .map(|&d| rng.random_range(0..=d as u32))
                .collect();
            if chain {
                drafts = lens;
            }
            (b, acc)
        } else {
            (bounds1.clone(), vec![])
        };
        let tokens = *bounds.last().unwrap();
        let inputs = HostInputs::random(&mut rng, dims, tokens, &case.opts, case.input_dtype)
            .with_gate_params(&params.a_log, &params.dt_bias);
        let op = if use_spec {
            TokenOp::SpecVerify(&acc)
        } else {
            TokenOp::Decode
        };
        let want = run_tokens(
            &CpuBackend,
            &mut cpu_layer,
            op,
            &bounds,
            &case.slots,
            &inputs,
            &case.opts,
        )
        .expect("cpu call");
        before(step);
        let got = run_tokens(
            cu,
            &mut gpu_layer,
            op,
            &bounds,
            &case.slots,
            &inputs,
            &case.opts,
        )
        .expect("cuda call");
        let d = rel_frobenius_f32(&got, &want);
        assert!(
            d <= out_tol,
            "step {step}: outputs differ by {d:.3e} (tolerance {out_tol:.1e})"
        );
        worst = worst.max(d);
        if use_spec && !chain {
            // resolve the drafts: accept a random number of them, then flush
            let acc: Vec<u32> = (0..n)
                .map(|i| rng.random_range(0..=(bounds[i + 1] - bounds[i]) as u32))
                .collect();
            run_replay(
                &CpuBackend,
                &mut cpu_layer,
                &case.slots,
                Some(&acc),
                &case.opts,
                &params.a_log,
                &params.dt_bias,
            )
            .expect("cpu flush");
            run_replay(
                cu,
                &mut gpu_layer,
                &case.slots,
                Some(&acc),
                &case.opts,
                &params.a_log,
                &params.dt_bias,
            )
            .expect("cuda flush");
        }
        let a = gpu_layer
            .read_states(cu.memory(), &case.slots)
            .expect("read");
        let b = cpu_layer
            .read_states(CpuBackend.memory(), &case.slots)
            .expect("read");
        if case.state_dtype == Dtype::Fp32 {
            let d = rel_frobenius_f32(&a, &b);
            assert!(d <= 1e-5, "step {step}: fp32 states differ by {d:.3e}");
        } else if case.ring_len == 0 && step == 0 {
            // one store from the same initial state: within one rounding step, element by element
            // the first store: every element within one rounding step of the CPU's
            let rms = (b.iter().map(|x| x * x).sum::<f32>() / b.len() as f32).sqrt();
            let noise = 1e-5 * rms;
            let bad = a
                .iter()
                .zip(&b)
                .position(|(&x, &y)| !within_one_step(x, y, case.state_dtype, noise));
            if let Some(i) = bad {
                panic!("step {step}: state element {i} is {} on the GPU, {} on the CPU: more than one rounding step", a[i], b[i]);
            }
            let same = a
                .iter()
                .zip(&b)
                .filter(|(x, y)| x.to_bits() == y.to_bits())
                .count();
            exact = Some(same as f64 / a.len() as f64);
        } else {
            let d = rel_frobenius_f32(&a, &b);
            assert!(d <= 2e-2, "step {step}: states differ by {d:.3e}");
        }
        assert_eq!(
            gpu_layer.epoch(),
            cpu_layer.epoch(),
            "step {step}: the layer epochs differ"
        );
        assert_same_ring_records(
            step,
            &case.slots,
            |s| gpu_layer.meta(cu.memory(), s).unwrap(),
            |s| cpu_layer.meta(CpuBackend.memory(), s).unwrap(),
        );
    }
    (worst, exact.unwrap_or(1.0))
}

#[test]
fn cuda_decode_matches_the_cpu_backend_for_every_pool_dtype_and_layout() {
    let Some(cu) = cuda() else { return };
    for state in Dtype::ALL {
        for layout in [StateLayout::KFirst, StateLayout::VFirst] {
            // GVA, K != V, fp32 inputs, eager
            let c = case(2, 4, 32, 48, state, Dtype::Fp32, layout, 0);
            let (d, exact) = compare_with_cpu(&cu, &c, 4, 11);
            eprintln!(
                "{state} {layout:?} GVA eager: outputs {d:.2e}, bit-exact state elements {:.1}%",
                exact * 100.0
            );
            // the production head size, bf16 inputs, eager (the pipelined kernel)
            let c = Case {
                h: 3,
                hv: 3,
                ..case(3, 3, 128, 128, state, Dtype::Bf16, layout, 0)
            };
            let (d, exact) = compare_with_cpu(&cu, &c, 4, 13);
            eprintln!("{state} {layout:?} K=V=128 eager: outputs {d:.2e}, bit-exact state elements {:.1}%", exact * 100.0);
            // the production head size, bf16 inputs, with a ring
            let c = Case {
                h: 3,
                hv: 3,
                ..case(3, 3, 128, 128, state, Dtype::Bf16, layout, 4)
            };
            let (d, exact) = compare_with_cpu(&cu, &c, 7, 12);
            eprintln!("{state} {layout:?} K=V=128 ring 4: outputs {d:.2e}, bit-exact state elements {:.1}%", exact * 100.0);
        }
    }
}

/// Every eager kernel but the general one: the pipelined kernel, the tile kernels
/// (`kda_eager_tile`, `kda_eager_tile_staged`, `kda_eager_tile_bulk`, `kda_eager_tile_bulk_in`,
/// `kda_eager_tile_stream`, `kda_eager_regs`) and the bulk pipe (`kda_eager_bulk_pipe`).
const FAST_EAGER_KERNELS: [EagerKernel; 8] = [
    EagerKernel::Pipelined,
    EagerKernel::Tile,
    EagerKernel::StagedTile,
    EagerKernel::BulkTile,
    EagerKernel::BulkInTile,
    EagerKernel::StreamTile,
    EagerKernel::RegsTile,
    EagerKernel::BulkPipe,
];

/// Runs `steps` eager decode steps of `case` with each of `kernels` on one layer and the general
/// kernel (`kda_step`) on its twin, from the same states and inputs; asserts equal bits of
/// outputs and states after every step.
fn check_fast_eager_kernels_match_the_general_one(
    cu: &CudaBackend,
    case: &Case,
    steps: usize,
    seed: u64,
    kernels: &[EagerKernel],
) {
    for &kernel in kernels {
        let mut rng = StdRng::seed_from_u64(seed);
        let (mut fast, mut general) = twin_layers(cu, case, case, &mut rng);
        let n = case.slots.len();
        let dims = case.dims();
        let params = HostInputs::random(&mut rng, dims, 0, &case.opts, case.input_dtype);
        let bounds: Vec<usize> = (0..=n).collect();
        for step in 0..steps {
            let inputs = HostInputs::random(&mut rng, dims, n, &case.opts, case.input_dtype)
                .with_gate_params(&params.a_log, &params.dt_bias);
            let run = |layer: &mut TestLayer<_>, k: EagerKernel| {
                cu.set_eager_kernel(Some(k)).expect("kernel choice");
                run_tokens(
                    cu,
                    layer,
                    TokenOp::Decode,
                    &bounds,
                    &case.slots,
                    &inputs,
                    &case.opts,
                )
                .expect("cuda decode")
            };
            let o_fast = run(&mut fast, kernel);
            let o_general = run(&mut general, EagerKernel::Step);
            let what = format!("{kernel:?} step {step}");
            assert_bits_eq(&o_fast, &o_general, &format!("{what} outputs"));
            let a = fast.read_states(cu.memory(), &case.slots).expect("read");
            let b = general.read_states(cu.memory(), &case.slots).expect("read");
            assert_bits_eq(&a, &b, &format!("{what} states"));
        }
    }
    cu.set_eager_kernel(None).expect("kernel choice");
}

/// An eager decode case of the production head size (4 q/k heads, 8 value heads, K = V = 128,
/// bf16 inputs), one token for each of `slots`.
fn eager_case(state: Dtype, layout: StateLayout, rounding: Rounding, slots: &[u32]) -> Case {
    Case {
        state_dtype: state,
        input_dtype: Dtype::Bf16,
        layout,
        rounding,
        ..Case::new(4, 8, 128, 128).with_seqs(&vec![1; slots.len()], slots)
    }
}

#[test]
fn cuda_fast_eager_kernels_equal_the_general_kernel_bit_for_bit() {
    let Some(cu) = cuda() else { return };
    // 48 sequences x 8 value heads: more items than pipelined CTAs, so each of them loops and
    // prefetches; in a dependent launch the tile kernels of 2-byte K-first pools (384 heads)
    // and fp32 K-first bulk tiles read their slot again after the wait, the others use the one
    // read before it (slot_once)
    let n = 48;
    let slots: Vec<u32> = (0..n as u32).map(|i| 3 * i + 2).collect();
    for state in Dtype::ALL {
        for layout in [StateLayout::KFirst, StateLayout::VFirst] {
            let rounding = if state == Dtype::Fp32 || layout == StateLayout::KFirst {
                Rounding::Nearest
            } else {
                Rounding::Stochastic {
                    seed: 0x5eed_0000_0000_0007,
                }
            };
            let c = eager_case(state, layout, rounding, &slots);
            check_fast_eager_kernels_match_the_general_one(&cu, &c, 3, 61, &FAST_EAGER_KERNELS);
        }
    }
    // stochastic rounding of a K-first 2-byte pool, whole heads (8 warps: the tile goes back
    // out through the stage) and 4 warps (from registers)
    for warps in [8, 4] {
        cu.set_eager_warps(Some(warps)).expect("warps");
        let rounding = Rounding::Stochastic {
            seed: 0x5eed_0000_0000_0011,
        };
        let c = eager_case(Dtype::Bf16, StateLayout::KFirst, rounding, &slots);
        check_fast_eager_kernels_match_the_general_one(
            &cu,
            &c,
            3,
            60 + u64::from(warps),
            &FAST_EAGER_KERNELS,
        );
    }
    cu.set_eager_warps(None).expect("warps");
    // narrower CTAs (more column blocks per head, more CTAs per SM), 2 and 3 stages; V-first
    // pools with 3 stages (the default of big fp32 and 2-byte V-first calls)
    let kf = StateLayout::KFirst;
    for (warps, stages, state, layout) in [
        (1, 2, Dtype::Fp32, kf),
        (2, 3, Dtype::Bf16, kf),
        (4, 2, Dtype::Fp16, kf),
        (4, 3, Dtype::Fp32, kf),
        (8, 3, Dtype::Fp32, kf),
        // whole heads of a 2-byte pool (the default for big calls)
        (8, 3, Dtype::Fp16, kf),
        // 3 warps: rows of 6 chunks (no swizzle), a partial last column block
        (3, 2, Dtype::Bf16, kf),
        (4, 3, Dtype::Fp32, StateLayout::VFirst),
        (4, 3, Dtype::Fp16, StateLayout::VFirst),
    ] {
        cu.set_eager_warps(Some(warps)).expect("warps");
        cu.set_eager_stages(Some(stages)).expect("stages");
        let c = Case {
            state_dtype: state,
            input_dtype: Dtype::Bf16,
            layout,
            ..Case::new(4, 8, 128, 128).with_seqs(&vec![1; n], &slots)
        };
        check_fast_eager_kernels_match_the_general_one(
            &cu,
            &c,
            2,
            63 + u64::from(warps) + u64::from(stages),
            &FAST_EAGER_KERNELS,
        );
    }
    cu.set_eager_warps(None).expect("warps");
    cu.set_eager_stages(None).expect("stages");
    // GVA, K != V, a partial last column block, fp32 inputs, lower-bound gate
    let mut c = case(
        2,
        4,
        32,
        48,
        Dtype::Fp16,
        Dtype::Fp32,
        StateLayout::KFirst,
        0,
    );
    c.opts.gate = GateMode::LowerBound(-3.0);
    check_fast_eager_kernels_match_the_general_one(&cu, &c, 3, 62, &FAST_EAGER_KERNELS);
}

#[test]
fn cuda_register_head_kernel_equals_the_general_kernel_bit_for_bit() {
    let Some(cu) = cuda() else { return };
    // kda_eager_regs alone (the fast-eager test runs it among the others): K-first pools,
    // nearest and stochastic rounding, 64 sequences x 8 value heads in slots spread over the
    // pool
    let slots: Vec<u32> = (0..64u32).map(|i| 5 * i + 3).collect();
    for (state, rounding) in [
        (Dtype::Fp32, Rounding::Nearest),
        (Dtype::Fp16, Rounding::Nearest),
        (Dtype::Bf16, Rounding::Nearest),
        (
            Dtype::Fp16,
            Rounding::Stochastic {
                seed: 0x5eed_0000_0000_0047,
            },
        ),
        (
            Dtype::Bf16,
            Rounding::Stochastic {
                seed: 0x5eed_0000_0000_0048,
            },
        ),
    ] {
        let c = eager_case(state, StateLayout::KFirst, rounding, &slots);
        check_fast_eager_kernels_match_the_general_one(&cu, &c, 3, 47, &[EagerKernel::RegsTile]);
    }
}

#[test]
fn cuda_kernels_keep_their_shared_memory_when_calls_alternate_tile_sizes() {
    let Some(cu) = cuda() else { return };
    // fp32 K-first tiles: a whole head (8 warps) needs more than the 48 KB a kernel has without
    // opting in, half a head (4 warps) less; the driver's answers are kept per kernel, so the
    // third call must find the first call's opt-in still there (a second backend shares them)
    let slots: Vec<u32> = (0..24).map(|i| 2 * i + 1).collect();
    let c = eager_case(Dtype::Fp32, StateLayout::KFirst, Rounding::Nearest, &slots);
    let kernels = [
        EagerKernel::StagedTile,
        EagerKernel::BulkTile,
        EagerKernel::StreamTile,
    ];
    let other = cuda().expect("a second backend on the same device");
    for (i, warps) in [8, 4, 8].into_iter().enumerate() {
        let backend = if i == 1 { &other } else { &cu };
        backend.set_eager_warps(Some(warps)).expect("warps");
        check_fast_eager_kernels_match_the_general_one(backend, &c, 2, 70 + i as u64, &kernels);
    }
    cu.set_eager_warps(None).expect("warps");
    other.set_eager_warps(None).expect("warps");
}

#[test]
fn cuda_bulk_pipe_reuses_its_buffers_and_equals_the_general_kernel_bit_for_bit() {
    let Some(cu) = cuda() else { return };
    // 200 sequences x 8 value heads: several items per persistent CTA, so each CTA goes round
    // its ring of buffers more than once (its loader waiting for the storer)
    let n = 200;
    let slots: Vec<u32> = (0..n as u32).rev().map(|i| 2 * i + 1).collect();
    for state in Dtype::ALL {
        for layout in [StateLayout::KFirst, StateLayout::VFirst] {
            let rounding = if state == Dtype::Fp16 && layout == StateLayout::KFirst {
                Rounding::Stochastic {
                    seed: 0x5eed_0000_0000_0013,
                }
            } else {
                Rounding::Nearest
            };
            let c = eager_case(state, layout, rounding, &slots);
            check_fast_eager_kernels_match_the_general_one(
                &cu,
                &c,
                3,
                64,
                &[EagerKernel::BulkPipe],
            );
        }
    }
}

#[test]
fn cuda_odd_head_dims_use_the_scalar_path_and_match_the_cpu() {
    let Some(cu) = cuda() else { return };
    for layout in [StateLayout::KFirst, StateLayout::VFirst] {
        let mut c = case(1, 3, 5, 7, Dtype::Fp16, Dtype::Fp16, layout, 3);
        c.opts.gate = GateMode::LowerBound(-3.0);
        c.opts.allow_neg_eigval = true;
        compare_with_cpu(&cu, &c, 6, 21);
    }
}

#[test]
fn cuda_ring_decode_is_bit_exact_with_cuda_eager_decode_for_an_fp32_pool() {
    let Some(cu) = cuda() else { return };
    for (ring_len, layout) in [
        (1, StateLayout::KFirst),
        (3, StateLayout::VFirst),
        (8, StateLayout::KFirst),
    ] {
        let c = case(2, 4, 32, 48, Dtype::Fp32, Dtype::Fp32, layout, ring_len);
        check_ring_decode_matches_eager(&cu, &c, 20, 31 + ring_len as u64);
    }
    let c = case(
        3,
        3,
        128,
        128,
        Dtype::Fp32,
        Dtype::Bf16,
        StateLayout::KFirst,
        4,
    );
    check_ring_decode_matches_eager(&cu, &c, 10, 37);
}

#[test]
fn cuda_long_spec_sequence_equals_eager_decode_of_the_accepted_tokens() {
    let Some(cu) = cuda() else { return };
    for (ring_len, layout) in [
        (2, StateLayout::KFirst),
        (5, StateLayout::VFirst),
        (10, StateLayout::KFirst),
    ] {
        let c = case(2, 4, 32, 48, Dtype::Fp32, Dtype::Fp32, layout, ring_len);
        check_spec_verify_matches_eager(&cu, &c, ring_len + 2 + 30, 41 + ring_len as u64);
    }
    let c = case(
        3,
        3,
        128,
        128,
        Dtype::Fp32,
        Dtype::Bf16,
        StateLayout::VFirst,
        6,
    );
    check_spec_verify_matches_eager(&cu, &c, 16, 47);
}

#[test]
fn cuda_two_byte_ring_rounds_once_per_commit_nearest_and_stochastic_bit_for_bit() {
    let Some(cu) = cuda() else { return };
    for state in [Dtype::Fp16, Dtype::Bf16] {
        for (ring_len, rounding) in [
            (0, Rounding::Nearest),
            (4, Rounding::Nearest),
            (
                0,
                Rounding::Stochastic {
                    seed: 0x1234_5678_9abc,
                },
            ),
            (3, Rounding::Stochastic { seed: 77 }),
        ] {
            let c = Case {
                rounding,
                ..case(
                    2,
                    4,
                    32,
                    48,
                    state,
                    Dtype::Fp32,
                    StateLayout::KFirst,
                    ring_len,
                )
            };
            let commits = check_ring_rounds_once_per_commit(&cu, &c, 12, 53);
            eprintln!("{state} ring {ring_len} {rounding:?}: {commits} commits");
        }
    }
}

/// Asserts after step `step` that every slot of `slots` has the same ring record in `got` as in
/// `want` (length and pending entries), with its arrival counter back at 0 in `got`.
fn assert_same_ring_records(
    step: usize,
    slots: &[u32],
    got: impl Fn(u32) -> RingMeta,
    want: impl Fn(u32) -> RingMeta,
) {
    for &s in slots {
        let (a, b) = (got(s), want(s));
        assert_eq!(
            (a.len, a.pending, a.arrive),
            (b.len, b.pending, 0),
            "step {step}: ring record of slot {s}"
        );
    }
}

/// The ring data of `slots` in a layer: entries `0..len` of each slot's ring, as bytes.
fn ring_bytes(
    cu: &CudaBackend,
    layer: &TestLayer<kda_kernels::cuda::CudaBuffer>,
    slots: &[u32],
) -> Vec<u8> {
    let g = &layer.geometry;
    let all = cu
        .memory()
        .download(&layer.planes.ring)
        .expect("ring plane");
    let entry = g.ring_entry_elems() * g.ring_dtype.size();
    let mut out = Vec::new();
    for &s in slots {
        let len = layer.meta(cu.memory(), s).expect("meta").len as usize;
        let base = s as usize * g.ring_len * entry;
        out.extend_from_slice(&all[base..base + len * entry]);
    }
    out
}

/// Asserts that twin layers agree on `slots` after `step`: ring records, ring entries and the
/// bits of the states.
fn assert_twins_agree(
    cu: &CudaBackend,
    step: usize,
    slots: &[u32],
    a: &TestLayer<kda_kernels::cuda::CudaBuffer>,
    b: &TestLayer<kda_kernels::cuda::CudaBuffer>,
) {
    let mem = cu.memory();
    assert_same_ring_records(
        step,
        slots,
        |s| a.meta(mem, s).unwrap(),
        |s| b.meta(mem, s).unwrap(),
    );
    assert!(
        ring_bytes(cu, a, slots) == ring_bytes(cu, b, slots),
        "step {step}: the ring entries differ"
    );
    let sa = a.read_states(mem, slots).expect("read");
    let sb = b.read_states(mem, slots).expect("read");
    assert_bits_eq(&sa, &sb, &format!("step {step} states"));
}

/// A backend choice that two twin layers run with: `Some(true)` for the first, `Some(false)`
/// for the second, `None` (the default) restored at the end.
type Choice = fn(&CudaBackend, Option<bool>) -> kda_kernels::Result<()>;

/// Runs the same random sequence of decode steps, speculative verifies (random draft and
/// accepted counts) and flushes on two layers with the same initial states, one with `choice`
/// on and one with it off (e.g. the pipelined ring kernel `kda_ring` against the
/// one-unit-per-CTA kernel `kda_step`); after every call asserts equal bits of the outputs and
/// the states, equal ring records and equal ring bytes. Returns the number of calls that stored
/// a state.
fn check_choice_agrees(
    cu: &CudaBackend,
    case: &Case,
    steps: usize,
    seed: u64,
    choice: Choice,
) -> usize {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut chosen, mut other) = twin_layers(cu, case, case, &mut rng);
    let n = case.slots.len();
    let dims = case.dims();
    let params = HostInputs::random(&mut rng, dims, 0, &case.opts, case.input_dtype);
    let max_t = case.ring_len.min(16 - case.ring_len).clamp(1, 4);
    let mut drafts = vec![0usize; n];
    let mut stores = 0;
    for step in 0..steps {
        let any_drafts = drafts.iter().any(|&d| d > 0);
        let roll = rng.random_range(0..10);
        let epoch = chosen.epoch();
        if any_drafts && roll < 3 {
            // resolve the drafts: accept some, flush every slot
            let acc: Vec<u32> = drafts
                .iter()
                .map(|&d| rng.random_range(0..=d) as u32)
                .collect();
            for (layer, on) in [(&mut chosen, Some(true)), (&mut other, Some(false))] {
                choice(cu, on).expect("backend choice");
                run_replay(
                    cu,
                    layer,
                    &case.slots,
                    Some(&acc),
                    &case.opts,
                    &params.a_log,
                    &params.dt_bias,
                )
                .expect("flush");
            }
            drafts = vec![0; n];
        } else {
            let spec = any_drafts || roll < 6;
            let lens: Vec<usize> = if spec {
                (0..n).map(|_| rng.random_range(0..=max_t)).collect()
            } else {
                vec![1; n]
            };
            let acc: Vec<u32> = drafts
                .iter()
                .map(|&d| rng.random_range(0..=d) as u32)
                .collect();
            let mut bounds = vec![0];
            for l in &lens {
                bounds.push(bounds.last().unwrap() + l);
            }
            let inputs = HostInputs::random(
                &mut rng,
                dims,
                *bounds.last().unwrap(),
                &case.opts,
                case.input_dtype,
            )
            .with_gate_params(&params.a_log, &params.dt_bias);
            let op = if spec {
                TokenOp::SpecVerify(&acc)
            } else {
                TokenOp::Decode
            };
            let mut outs = Vec::new();
            for (layer, on) in [(&mut chosen, Some(true)), (&mut other, Some(false))] {
                choice(cu, on).expect("backend choice");
                outs.push(
                    run_tokens(cu, layer, op, &bounds, &case.slots, &inputs, &case.opts)
                        .expect("ring call"),
                );
            }
            assert_bits_eq(&outs[0], &outs[1], &format!("step {step} outputs"));
            if spec {
                drafts = lens;
            }
        }
        assert_twins_agree(cu, step, &case.slots, &chosen, &other);
        assert_eq!(chosen.epoch(), other.epoch(), "step {step}: layer epochs");
        stores += usize::from(chosen.epoch() != epoch);
    }
    choice(cu, None).expect("backend choice");
    stores
}

/// A ring kernel (`kda_ring_tile` where TILE, else `kda_ring`) against `kda_step` (a
/// [`Choice`]).
fn ring_or_step<const TILE: bool>(cu: &CudaBackend, on: Option<bool>) -> kda_kernels::Result<()> {
    let kernel = if TILE {
        RingKernel::Tile
    } else {
        RingKernel::Pipelined
    };
    cu.set_ring_kernel(on.map(|k| if k { kernel } else { RingKernel::Step }))
}

#[test]
fn cuda_pipelined_and_tile_ring_kernels_equal_the_one_unit_per_cta_kernel_bit_for_bit() {
    let Some(cu) = cuda() else { return };
    for (kernel, choice) in [
        ("kda_ring", ring_or_step::<false> as Choice),
        ("kda_ring_tile", ring_or_step::<true>),
    ] {
        for state in Dtype::ALL {
            for (h, hv, k, v, input, ring_len, layout) in [
                (2, 4, 128, 128, Dtype::Bf16, 8, StateLayout::KFirst),
                (2, 4, 128, 128, Dtype::Fp32, 4, StateLayout::VFirst),
                (2, 6, 32, 96, Dtype::Fp16, 1, StateLayout::KFirst),
                (4, 4, 128, 128, Dtype::Fp16, 12, StateLayout::KFirst),
                // two column blocks per value head; 4-byte ring rows
                (2, 2, 128, 256, Dtype::Bf16, 4, StateLayout::KFirst),
            ] {
                let mut c = case(h, hv, k, v, state, input, layout, ring_len);
                if ring_len == 1 {
                    c.opts.gate = GateMode::LowerBound(-4.0);
                    c.opts.allow_neg_eigval = true;
                }
                let stores = check_choice_agrees(&cu, &c, 24, 71 + ring_len as u64, choice);
                eprintln!(
                    "{kernel}: {state} {layout:?} H={h} HV={hv} K={k} V={v} {input} inputs ring {ring_len}: equal bits, {stores} calls stored"
                );
            }
        }
    }
}

/// Two q/k heads, four value heads, K = V = 128, bf16 inputs, K-first: the dependent-launch
/// tests' shape.
fn gva_case(state: Dtype, ring_len: usize) -> Case {
    case(
        2,
        4,
        128,
        128,
        state,
        Dtype::Bf16,
        StateLayout::KFirst,
        ring_len,
    )
}

/// `kda_ring_mma` computes the chunk in another order (tensor cores, 3xTF32), so it is checked
/// against the CPU backend with the tolerances of the issue rather than for kda_step's bits: ring
/// decode steps, spec_verify calls of 0..=ring_len drafts with random accepted counts and
/// flushes (every sequence, one or two 16-row mma tiles of tokens), every pool dtype, both
/// layouts, GVA, bf16 and fp32 inputs. fp32 states within 1e-5 relative after every call
/// (`compare_with_cpu`); the gates as fla initialises them (log-decays down to about -25 per
/// token at the tails).
#[test]
fn cuda_tensor_core_ring_kernel_matches_the_cpu_backend() {
    let Some(cu) = cuda() else { return };
    cu.set_ring_kernel(Some(RingKernel::Mma))
        .expect("ring kernel");
    for state in Dtype::ALL {
        for layout in [StateLayout::KFirst, StateLayout::VFirst] {
            for (h, hv, ring_len, input, seed) in [
                (3, 3, 4, Dtype::Bf16, 61),
                (2, 4, 8, Dtype::Fp32, 62),
                (1, 2, 6, Dtype::Bf16, 63),
            ] {
                let c = case(h, hv, 128, 128, state, input, layout, ring_len);
                let (d, _) = compare_with_cpu(&cu, &c, 12, seed);
                eprintln!(
                    "{state} {layout:?} H={h} HV={hv} {input} inputs ring {ring_len}: outputs within {d:.2e} of the CPU's"
                );
            }
        }
    }
    cu.set_ring_kernel(None).expect("ring kernel");
}

/// `kda_ring_delta` reads stored delta vectors instead of replaying the pending entries, so it
/// is checked against the CPU backend with the tolerances, as `kda_ring_mma`: first 20
/// ring decodes (commits every `ring_len` tokens from stored vectors), then 12 verifies of
/// 0..=ring_len drafts, each accepting a random number of the drafts before it, then
/// `compare_with_cpu`'s mix of decodes, verifies and flushes with every fourth call on
/// `kda_step`, which stores no vectors, so the next call replays (the long path); every pool
/// dtype, both layouts, GVA, bf16 inputs (fp32 ones with an fp32 pool), and a head of 96
/// columns (a partial item; fp32 and fp16 pools).
#[test]
fn cuda_delta_ring_kernel_matches_the_cpu_backend() {
    let Some(cu) = cuda() else { return };
    cu.set_ring_kernel(Some(RingKernel::Delta))
        .expect("ring kernel");
    for state in Dtype::ALL {
        for layout in [StateLayout::KFirst, StateLayout::VFirst] {
            // (fp32 inputs and the partial item with fewer pool dtypes: each shape and dtype
            // pair is a module to compile)
            let cases = [
                (3, 3, 128, 128, 4, Dtype::Bf16, 71),
                (2, 4, 128, 128, 8, Dtype::Fp32, 72),
                (1, 2, 128, 128, 6, Dtype::Bf16, 73),
                (2, 2, 64, 96, 5, Dtype::Bf16, 74),
            ];
            for (h, hv, k, v, ring_len, input, seed) in cases.into_iter().filter(|c| {
                (c.5 == Dtype::Bf16 || state == Dtype::Fp32) && (c.2 == 128 || state != Dtype::Bf16)
            }) {
                let c = Case {
                    ring_deltas: true,
                    ..case(h, hv, k, v, state, input, layout, ring_len)
                };
                let decodes = Calls {
                    spec_every: 0,
                    ..Calls::mixed(0)
                };
                let (d, _) = compare_with_cpu_every(&cu, &c, 20, seed, decodes);
                let verifies = Calls {
                    spec_every: 1,
                    chain: true,
                    ..Calls::mixed(ring_len)
                };
                let (e, _) = compare_with_cpu_every(&cu, &c, 12, seed + 50, verifies);
                let step_every_fourth = |call: usize| {
                    let kernel = if call % 4 == 1 {
                        RingKernel::Step
                    } else {
                        RingKernel::Delta
                    };
                    cu.set_ring_kernel(Some(kernel)).expect("ring kernel");
                };
                let mixed = Calls {
                    before: &step_every_fourth,
                    ..Calls::mixed(ring_len)
                };
                let (f, _) = compare_with_cpu_every(&cu, &c, 16, seed + 100, mixed);
                cu.set_ring_kernel(Some(RingKernel::Delta))
                    .expect("ring kernel");
                eprintln!(
                    "{state} {layout:?} H={h} HV={hv} K={k} V={v} {input} inputs ring {ring_len}: outputs within {:.2e} of the CPU's",
                    d.max(e).max(f)
                );
            }
        }
    }
    cu.set_ring_kernel(None).expect("ring kernel");
}

/// `kda_ring_delta_staged` (the tile in shared memory) against `kda_ring_delta` (in
/// registers), twin layers with the same states: ring decodes over three commits, one of them on
/// `kda_step` (which stores no delta vectors, so the next call hands over to the general item),
/// then equal bits of the outputs, the states, the ring records and entries after every call;
/// fp16 and bf16 pools, rings of 4 and 8, GVA.
#[test]
fn cuda_staged_delta_kernel_equals_the_delta_kernel_bit_for_bit() {
    let Some(cu) = cuda() else { return };
    for state in [Dtype::Fp16, Dtype::Bf16] {
        for ring_len in [4, 8] {
            let c = Case {
                ring_deltas: true,
                ..gva_case(state, ring_len)
            };
            let mut rng = StdRng::seed_from_u64(131 + ring_len as u64);
            let (mut staged, mut delta) = twin_layers(&cu, &c, &c, &mut rng);
            let dims = c.dims();
            let n = c.slots.len();
            let params = HostInputs::random(&mut rng, dims, 0, &c.opts, c.input_dtype);
            let bounds: Vec<usize> = (0..=n).collect();
            for step in 0..3 * ring_len + 2 {
                let inputs = HostInputs::random(&mut rng, dims, n, &c.opts, c.input_dtype)
                    .with_gate_params(&params.a_log, &params.dt_bias);
                let on_step = step == ring_len + 1;
                let mut outs = Vec::new();
                for (layer, kernel) in [
                    (&mut staged, RingKernel::DeltaStaged),
                    (&mut delta, RingKernel::Delta),
                ] {
                    let kernel = if on_step { RingKernel::Step } else { kernel };
                    cu.set_ring_kernel(Some(kernel)).expect("ring kernel");
                    outs.push(
                        run_tokens(
                            &cu,
                            layer,
                            TokenOp::Decode,
                            &bounds,
                            &c.slots,
                            &inputs,
                            &c.opts,
                        )
                        .expect("decode"),
                    );
                }
                assert_bits_eq(&outs[0], &outs[1], &format!("step {step} outputs"));
                assert_twins_agree(&cu, step, &c.slots, &staged, &delta);
            }
            eprintln!(
                "{state} ring {ring_len}: {} decodes, equal bits",
                3 * ring_len + 2
            );
        }
    }
    cu.set_ring_kernel(None).expect("ring kernel");
}

#[test]
fn cuda_dependent_launches_give_the_bits_of_plain_launches_for_every_operation() {
    // every operation, each call reading what the one before it wrote (host copies run between
    // the calls; the kernels right after one another are in the back-to-back test below)
    let Some(cu) = cuda() else { return };
    // (eager decode, the default's dependent launch, runs in every other test)
    for (state, ring_len) in [(Dtype::Fp16, 8), (Dtype::Fp32, 4), (Dtype::Bf16, 6)] {
        let c = gva_case(state, ring_len);
        let stores = check_choice_agrees(
            &cu,
            &c,
            16,
            81 + ring_len as u64,
            CudaBackend::set_dependent_launch,
        );
        eprintln!("{state} ring {ring_len}: equal bits, {stores} calls stored");
    }
}

/// Enqueues `steps` calls of `case` on the same slots back to back, decode (`drafts` = 0) or
/// spec_verify with `drafts` new tokens per sequence and random accepted counts, every input
/// and output buffer made beforehand so that nothing runs on the stream between the kernels,
/// and asserts the bits of the same calls run one at a time (host copies between them) on a
/// twin layer: outputs, states, ring records and ring entries.
fn check_back_to_back(cu: &CudaBackend, case: &Case, steps: usize, drafts: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut queued, mut single) = twin_layers(cu, case, case, &mut rng);
    let mem = cu.memory();
    let n = case.slots.len();
    let dims = case.dims();
    let per_seq = drafts.max(1);
    let params = HostInputs::random(&mut rng, dims, 0, &case.opts, case.input_dtype);
    let bounds: Vec<usize> = (0..=n).map(|i| i * per_seq).collect();
    let inputs: Vec<HostInputs> = (0..steps)
        .map(|_| {
            HostInputs::random(&mut rng, dims, n * per_seq, &case.opts, case.input_dtype)
                .with_gate_params(&params.a_log, &params.dt_bias)
        })
        .collect();
    // the first verify has no drafts before it to accept
    let accepted: Vec<Vec<u32>> = (0..steps)
        .map(|step| {
            (0..n)
                .map(|_| match step {
                    0 => 0,
                    _ => rng.random_range(0..=drafts as u32),
                })
                .collect()
        })
        .collect();
    let want: Vec<Vec<f32>> = inputs
        .iter()
        .zip(&accepted)
        .map(|(inp, acc)| {
            let op = match drafts {
                0 => TokenOp::Decode,
                _ => TokenOp::SpecVerify(acc),
            };
            run_tokens(cu, &mut single, op, &bounds, &case.slots, inp, &case.opts).expect("call")
        })
        .collect();
    let batch = cu
        .prepare(batch_plan(&bounds, &case.slots).expect("plan"))
        .expect("prepare");
    let dev: Vec<_> = inputs
        .iter()
        .map(|inp| DeviceInputs::upload(mem, inp, &case.opts).expect("upload"))
        .collect();
    let acc_bufs: Vec<_> = accepted
        .iter()
        .map(|acc| upload_bytes(mem, bytemuck::cast_slice(acc)).expect("accepted counts"))
        .collect();
    let (dtype, len) = (case.input_dtype, n * per_seq * case.hv * case.v);
    let mut outs: Vec<_> = (0..steps)
        .map(|_| upload(mem, &vec![f32::NAN; len], dtype).expect("poisoned output"))
        .collect();
    for ((d, o), acc) in dev.iter().zip(outs.iter_mut()).zip(&acc_bufs) {
        let mut out = TensorViewMut { buf: o, dtype, len };
        let accepted = IndexView { buf: acc, len: n };
        match drafts {
            0 => cu.enqueue_decode(&batch, &d.view(), &case.opts, &mut queued.view(), &mut out),
            _ => cu.enqueue_spec_verify(
                &batch,
                &accepted,
                &d.view(),
                &case.opts,
                &mut queued.view(),
                &mut out,
            ),
        }
        .expect("enqueue");
    }
    cu.check_device_errors().expect("no device error");
    for (step, (o, w)) in outs.iter().zip(&want).enumerate() {
        let got = download(mem, o, dtype, len).expect("download");
        assert_bits_eq(&got, w, &format!("step {step} outputs"));
    }
    assert_twins_agree(cu, steps, &case.slots, &queued, &single);
}

#[test]
fn cuda_back_to_back_decodes_of_the_same_slots_give_the_bits_of_one_call_at_a_time() {
    // decode launches as a dependent launch (sm_90): its CTAs may start while the decode
    // before it, which writes the same states and rings, still runs; before their wait they
    // only read the slots and prefetch into L2, so the bits must not change (kernels built
    // without the wait fail here at step 1 on the H200)
    let Some(cu) = cuda() else { return };
    for (state, ring_len) in [
        (Dtype::Fp32, 0),
        (Dtype::Fp16, 0),
        (Dtype::Bf16, 8),
        (Dtype::Fp32, 5),
    ] {
        let c = gva_case(state, ring_len);
        check_back_to_back(&cu, &c, 12, 0, 91 + ring_len as u64);
        eprintln!("{state} ring {ring_len}: 12 back-to-back decodes, equal bits");
    }
    // kda_ring_delta: each decode reads the delta vectors the one before it stored
    cu.set_ring_kernel(Some(RingKernel::Delta))
        .expect("ring kernel");
    let c = Case {
        ring_deltas: true,
        ..gva_case(Dtype::Fp16, 4)
    };
    check_back_to_back(&cu, &c, 12, 0, 99);
    eprintln!("fp16 ring 4, kda_ring_delta: 12 back-to-back decodes, equal bits");
    cu.set_ring_kernel(None).expect("ring kernel");
}

#[test]
fn cuda_back_to_back_spec_verifies_of_the_same_slots_give_the_bits_of_one_call_at_a_time() {
    // small spec_verify calls launch as dependent launches by default (sm_90), with the ring
    // rows of every entry prefetched before the wait: each verify may start while the one
    // before it still writes the same states, ring entries and records
    let Some(cu) = cuda() else { return };
    for (state, drafts, kernel) in [
        (Dtype::Fp32, 2, None),
        (Dtype::Fp16, 3, Some(RingKernel::Pipelined)),
        (Dtype::Bf16, 4, Some(RingKernel::Tile)),
        (Dtype::Fp16, 4, Some(RingKernel::Mma)),
        (Dtype::Bf16, 1, Some(RingKernel::Delta)),
        (Dtype::Fp32, 3, Some(RingKernel::Delta)),
    ] {
        cu.set_ring_kernel(kernel).expect("ring kernel");
        let c = Case {
            ring_deltas: kernel == Some(RingKernel::Delta),
            ..gva_case(state, 2 * (drafts + 1))
        };
        check_back_to_back(&cu, &c, 10, drafts, 95 + drafts as u64);
        eprintln!("{state}, {drafts} drafts, {kernel:?}: 10 back-to-back verifies, equal bits");
    }
    cu.set_ring_kernel(None).expect("ring kernel");
}

#[test]
fn cuda_refuses_bad_input_and_leaves_the_pool_unchanged() {
    let Some(cu) = cuda() else { return };
    check_rejects_bad_input(&cu, 61);
}

/// The prefill kernels every GPU prefill test runs with.
const PREFILL_KERNELS: [PrefillKernel; 2] = [PrefillKernel::Steps, PrefillKernel::Chunked];

/// Runs `body` with each of [`PREFILL_KERNELS`] set on `cu` (named first, so that a failure's
/// output says which).
fn each_prefill_kernel(cu: &CudaBackend, mut body: impl FnMut(PrefillKernel)) {
    for pk in PREFILL_KERNELS {
        eprintln!("prefill kernel {pk:?}");
        cu.set_prefill_kernel(Some(pk)).expect("prefill kernel");
        body(pk);
    }
}

/// A prefill case: `lens` tokens in scattered slots of a larger pool.
fn prefill_case(c: Case, lens: &[usize]) -> Case {
    let slots: Vec<u32> = (0..lens.len() as u32).map(|i| 2 * i + 1).collect();
    c.with_seqs(lens, &slots)
}

#[test]
fn cuda_prefill_matches_the_f64_recurrence_for_every_pool_dtype_layout_and_ring() {
    let Some(cu) = cuda() else { return };
    each_prefill_kernel(&cu, |_| {
        let mut seed = 300;
        for state in Dtype::ALL {
            for layout in [StateLayout::KFirst, StateLayout::VFirst] {
                for ring_len in [0, 4] {
                    seed += 1;
                    // GVA, K != V, fp32 inputs; sequences longer than a prepass chunk, of one token
                    // and of none
                    let c = prefill_case(
                        case(2, 4, 32, 48, state, Dtype::Fp32, layout, ring_len),
                        &[150, 1, 0, 37, 9],
                    );
                    let (eo, es) = check_prefill_matches_reference(&cu, &c, seed);
                    if state == Dtype::Fp32 {
                        assert!(
                            eo <= 1e-5 && es <= 1e-5,
                            "{state} {layout:?} ring {ring_len}: errors {eo:.2e} {es:.2e}"
                        );
                    }
                    // the production head size, bf16 inputs
                    let c = prefill_case(
                        case(2, 2, 128, 128, state, Dtype::Bf16, layout, ring_len),
                        &[300, 0, 5],
                    );
                    check_prefill_matches_reference(&cu, &c, seed + 1000);
                }
            }
        }
        for state in [Dtype::Fp16, Dtype::Bf16] {
            let c = Case {
                rounding: Rounding::Stochastic { seed: 77 },
                ..prefill_case(
                    case(1, 3, 32, 48, state, Dtype::Fp32, StateLayout::KFirst, 0),
                    &[65, 0, 3],
                )
            };
            check_prefill_matches_reference(&cu, &c, 399);
        }
    });
}

#[test]
fn cuda_prefill_folds_the_ring_first_as_eager_decode_then_prefill() {
    let Some(cu) = cuda() else { return };
    each_prefill_kernel(&cu, |pk| {
        for (ring_len, layout) in [
            (1, StateLayout::KFirst),
            (3, StateLayout::VFirst),
            (5, StateLayout::KFirst),
        ] {
            let c = prefill_case(
                case(2, 4, 32, 48, Dtype::Fp32, Dtype::Fp32, layout, ring_len),
                &[40, 0, 9, 1],
            );
            // the chunked kernels fold the pending entries with arithmetic of their own
            let tol = if pk == PrefillKernel::Chunked {
                1e-5
            } else {
                0.0
            };
            check_prefill_folds_the_ring_first_within(&cu, &c, 310 + ring_len as u64, tol);
        }
    });
}

#[test]
fn cuda_prefill_after_delta_ring_decodes_matches_the_cpu_backend() {
    let Some(cu) = cuda() else { return };
    each_prefill_kernel(&cu, |_| {
        for state in Dtype::ALL {
            let c = Case {
                ring_deltas: true,
                ..prefill_case(
                    case(3, 3, 128, 128, state, Dtype::Bf16, StateLayout::KFirst, 8),
                    &[70, 0, 2],
                )
            };
            check_prefill_after_ring_decodes(&cu, &c, 320);
        }
    });
}

/// Ring decodes (on the GPU `kda_ring_delta` where the pool has a delta plane), a verify whose
/// drafts are dropped, then a prefill, on both backends from the same states: outputs and
/// states agree within the f32 arithmetic's and one rounding's difference, and the prefill
/// leaves every ring empty (its record and its count of stored delta vectors).
fn check_prefill_after_ring_decodes(cu: &CudaBackend, c: &Case, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let init = initial_states(c, &mut rng);
    let mut cpu_layer: TestLayer<_> =
        layer_with_states(&CpuBackend, c, &init, &mut StdRng::seed_from_u64(seed ^ 1));
    let mut gpu_layer = layer_with_states(cu, c, &init, &mut StdRng::seed_from_u64(seed ^ 2));
    let n = c.slots.len();
    let params = HostInputs::random(&mut rng, c.dims(), 0, &c.opts, c.input_dtype);
    let fresh = |rng: &mut StdRng, t: usize| {
        HostInputs::random(rng, c.dims(), t, &c.opts, c.input_dtype)
            .with_gate_params(&params.a_log, &params.dt_bias)
    };
    // (as compare_with_cpu: outputs rounded to 2-byte inputs may differ by one rounding step)
    let out_tol = if c.state_dtype == Dtype::Fp32 && c.input_dtype == Dtype::Fp32 {
        1e-5
    } else {
        2e-2
    };
    let state_tol = if c.state_dtype == Dtype::Fp32 {
        1e-4
    } else {
        2e-2
    };
    let ones: Vec<usize> = (0..=n).collect();
    let mut calls: Vec<(TokenOp, Vec<usize>, HostInputs)> = Vec::new();
    for _ in 0..c.ring_len + 3 {
        calls.push((TokenOp::Decode, ones.clone(), fresh(&mut rng, n)));
    }
    let drops = vec![0u32; n];
    calls.push((
        TokenOp::SpecVerify(&drops),
        ones.clone(),
        fresh(&mut rng, n),
    ));
    calls.push((
        TokenOp::Prefill,
        c.bounds(),
        fresh(&mut rng, c.num_tokens()),
    ));
    for (i, (op, bounds, inputs)) in calls.iter().enumerate() {
        let what = format!("{} call {i} ({op:?})", c.state_dtype);
        let want = run_tokens(
            &CpuBackend,
            &mut cpu_layer,
            *op,
            bounds,
            &c.slots,
            inputs,
            &c.opts,
        )
        .unwrap_or_else(|e| panic!("{what}: cpu: {e}"));
        let got = run_tokens(cu, &mut gpu_layer, *op, bounds, &c.slots, inputs, &c.opts)
            .unwrap_or_else(|e| panic!("{what}: cuda: {e}"));
        let d = rel_frobenius_f32(&got, &want);
        assert!(
            d <= out_tol,
            "{what}: outputs differ by {d:.3e} (tolerance {out_tol:.0e})"
        );
    }
    let a = gpu_layer.read_states(cu.memory(), &c.slots).expect("read");
    let b = cpu_layer
        .read_states(CpuBackend.memory(), &c.slots)
        .expect("read");
    let d = rel_frobenius_f32(&a, &b);
    assert!(
        d <= state_tol,
        "{}: states differ by {d:.3e} (tolerance {state_tol:.0e})",
        c.state_dtype
    );
    for &s in &c.slots {
        let m = gpu_layer.meta(cu.memory(), s).expect("meta");
        assert_eq!(
            (m.len, m.pending, m.cached),
            (0, 0, 0),
            "the prefill leaves slot {s}'s ring empty"
        );
    }
}

#[test]
fn cuda_enqueued_prefills_give_the_bits_of_synchronous_prefills() {
    // three prefills of the same slots enqueued back to back (no host read between them),
    // against the same prefills through `Backend::prefill` on a twin layer, with a ring (its
    // pending entries folded by the first) and without
    let Some(cu) = cuda() else { return };
    each_prefill_kernel(&cu, |_| {
        for (state, ring_len) in [(Dtype::Fp32, 0), (Dtype::Bf16, 3)] {
            let c = case(
                2,
                4,
                32,
                48,
                state,
                Dtype::Fp32,
                StateLayout::KFirst,
                ring_len,
            );
            let mut rng = StdRng::seed_from_u64(340 + ring_len as u64);
            let (mut queued, mut single) = twin_layers(&cu, &c, &c, &mut rng);
            let mem = cu.memory();
            let n = c.slots.len();
            let params = HostInputs::random(&mut rng, c.dims(), 0, &c.opts, c.input_dtype);
            let fresh = |rng: &mut StdRng, t: usize| {
                HostInputs::random(rng, c.dims(), t, &c.opts, c.input_dtype)
                    .with_gate_params(&params.a_log, &params.dt_bias)
            };
            // pending ring entries on both twins first
            let ones: Vec<usize> = (0..=n).collect();
            for _ in 0..ring_len.min(2) {
                let inp = fresh(&mut rng, n);
                for layer in [&mut queued, &mut single] {
                    run_tokens(&cu, layer, TokenOp::Decode, &ones, &c.slots, &inp, &c.opts)
                        .expect("ring decode");
                }
            }
            let calls: Vec<(Vec<usize>, HostInputs)> = (0..3)
                .map(|_| {
                    let lens: Vec<usize> = (0..n).map(|_| rng.random_range(0..=20)).collect();
                    let t = lens.iter().sum();
                    (kda_kernels::testing::bounds_of(&lens), fresh(&mut rng, t))
                })
                .collect();
            let want: Vec<Vec<f32>> = calls
                .iter()
                .map(|(b, inp)| {
                    run_tokens(
                        &cu,
                        &mut single,
                        TokenOp::Prefill,
                        b,
                        &c.slots,
                        inp,
                        &c.opts,
                    )
                    .expect("prefill")
                })
                .collect();
            let dtype = c.input_dtype;
            let mut outs = Vec::new();
            let mut keep = Vec::new();
            for (b, inp) in &calls {
                let batch = cu
                    .prepare(batch_plan(b, &c.slots).expect("plan"))
                    .expect("prepare");
                let dev = DeviceInputs::upload(mem, inp, &c.opts).expect("upload");
                let len = inp.tokens * c.hv * c.v;
                let mut o = upload(mem, &vec![f32::NAN; len], dtype).expect("poisoned output");
                let mut out = TensorViewMut {
                    buf: &mut o,
                    dtype,
                    len,
                };
                cu.enqueue_prefill(&batch, &dev.view(), &c.opts, &mut queued.view(), &mut out)
                    .expect("enqueue");
                outs.push((o, len));
                keep.push((batch, dev));
            }
            cu.check_device_errors().expect("no device error");
            for (i, ((o, len), w)) in outs.iter().zip(&want).enumerate() {
                let got = download(mem, o, dtype, *len).expect("download");
                assert_bits_eq(&got, w, &format!("{state}: prefill {i} outputs"));
            }
            assert_twins_agree(&cu, 3, &c.slots, &queued, &single);
        }
    });
}

#[test]
fn cuda_prefill_after_pending_ring_entries_rounds_a_two_byte_state_once() {
    // Two decode steps append pending entries (a ring of 4: no commit), then a prefill folds
    // them and runs its tokens: against the f64 recurrence of the decode tokens and the prompt
    // from the initial states, at the tolerance of one rounding of the stored state (a fold
    // that stored the state in between would round it twice: about 4e-5 for fp16, 5e-4 for
    // bf16 on the outputs of fp32 inputs, where the bound is 1e-5).
    let Some(cu) = cuda() else { return };
    each_prefill_kernel(&cu, |pk| {
        for state in [Dtype::Fp16, Dtype::Bf16] {
            let c = prefill_case(
                case(2, 4, 32, 48, state, Dtype::Fp32, StateLayout::KFirst, 4),
                &[70, 0, 9],
            );
            let mut rng = StdRng::seed_from_u64(360);
            let init = initial_states(&c, &mut rng);
            let mut layer = layer_with_states(&cu, &c, &init, &mut rng);
            let n = c.slots.len();
            let lens: Vec<usize> = c.seq_lens.iter().map(|l| l + 2).collect();
            let all_bounds = kda_kernels::testing::bounds_of(&lens);
            let all = HostInputs::random(&mut rng, c.dims(), all_bounds[n], &c.opts, c.input_dtype);
            // sequence i's tokens: its two decode tokens, then its prompt
            let ones: Vec<usize> = (0..=n).collect();
            for step in 0..2 {
                let idx: Vec<usize> = (0..n).map(|i| all_bounds[i] + step).collect();
                run_tokens(
                    &cu,
                    &mut layer,
                    TokenOp::Decode,
                    &ones,
                    &c.slots,
                    &all.gather(&idx),
                    &c.opts,
                )
                .expect("ring decode");
            }
            let prompt: Vec<usize> = (0..n)
                .flat_map(|i| all_bounds[i] + 2..all_bounds[i + 1])
                .collect();
            let out = run_tokens(
                &cu,
                &mut layer,
                TokenOp::Prefill,
                &c.bounds(),
                &c.slots,
                &all.gather(&prompt),
                &c.opts,
            )
            .expect("prefill");
            let (ref_all, ref_state) = kda_kernels::cpu::reference::reference_run(
                c.dims(),
                &all.as_ref_inputs(),
                &c.opts,
                &all_bounds,
                kda_kernels::testing::to_f64(&init),
            )
            .expect("reference");
            let row = c.hv * c.v;
            let ref_out: Vec<f64> = prompt
                .iter()
                .flat_map(|&t| ref_all[t * row..(t + 1) * row].iter().copied())
                .collect();
            let states = layer.read_states(cu.memory(), &c.slots).expect("read");
            let (eo, es) = (
                kda_kernels::testing::rel_frobenius(&out, &ref_out),
                kda_kernels::testing::rel_frobenius(&states, &ref_state),
            );
            let (to, ts) = (
                kda_kernels::testing::output_tolerance(&c),
                kda_kernels::testing::state_tolerance(&c),
            );
            assert!(eo <= to, "{pk:?} {state}: outputs {eo:.3e} > {to:.3e}");
            assert!(es <= ts, "{pk:?} {state}: states {es:.3e} > {ts:.3e}");
        }
    });
}

#[test]
fn cuda_chunked_prefill_in_windows_of_one_chunk_or_16_columns_gives_the_bits_of_one_window() {
    // A scratch budget of one chunk per window: every sequence longer than a chunk goes from
    // window to window through the f32 carry, which must change no bit of the outputs and
    // states (ring pools: their pending entries folded first). Nor may the state pass in 16
    // value columns per CTA (`kda_chunk_state_narrow`) instead of 32: each element's sums run
    // in the same order (V = 40: a last block of 8 columns in both). Nor may `kda_chunk_prep`'s
    // persistent CTAs: with 2-byte inputs of the production head size one window's 248 (chunk,
    // value head) items run on one CTA per SM, several each, each item's raw rows copied during
    // the previous one's solve, and windows of one chunk one item per CTA.
    let Some(cu) = cuda() else { return };
    cu.set_prefill_kernel(Some(PrefillKernel::Chunked))
        .expect("prefill kernel");
    let e = cu
        .set_chunk_state_columns(Some(24))
        .expect_err("24 columns");
    assert!(
        matches!(e, KernelError::InvalidArgument { arg: "columns", .. })
            && e.to_string().contains("24"),
        "{e}"
    );
    let mem = cu.memory();
    // (state, ring_len, layout, V) at K = 32, f32 inputs; (state, ring_len, inputs) at the
    // production head size
    let small = [
        (Dtype::Fp32, 0, StateLayout::KFirst, 48),
        (Dtype::Bf16, 3, StateLayout::VFirst, 48),
        (Dtype::Fp16, 0, StateLayout::KFirst, 48),
        (Dtype::Fp32, 2, StateLayout::KFirst, 40),
    ]
    .map(|(s, r, l, v)| {
        (
            s,
            r,
            l,
            (2, 4, 32, v),
            Dtype::Fp32,
            &[150, 0, 37, 64, 1][..],
        )
    });
    let production =
        [(Dtype::Fp32, 0, Dtype::Bf16), (Dtype::Bf16, 2, Dtype::Fp16)].map(|(s, r, i)| {
            (
                s,
                r,
                StateLayout::KFirst,
                (4, 8, 128, 128),
                i,
                &[1200, 77, 0, 640][..],
            )
        });
    for (state, ring_len, layout, (h, hv, k, v), input, lens) in small.into_iter().chain(production)
    {
        let c = prefill_case(case(h, hv, k, v, state, input, layout, ring_len), lens);
        let mut rng = StdRng::seed_from_u64(350 + ring_len as u64 + v as u64 + k as u64);
        let init = initial_states(&c, &mut rng);
        // one window in 32 columns, windows of one chunk, one window in 16 columns
        let mut layers: Vec<_> = (0..3)
            .map(|_| layer_with_states(&cu, &c, &init, &mut rng))
            .collect();
        let n = c.slots.len();
        let params = HostInputs::random(&mut rng, c.dims(), 0, &c.opts, c.input_dtype);
        let ones: Vec<usize> = (0..=n).collect();
        for _ in 0..ring_len.min(2) {
            let inp = HostInputs::random(&mut rng, c.dims(), n, &c.opts, c.input_dtype)
                .with_gate_params(&params.a_log, &params.dt_bias);
            for layer in &mut layers {
                run_tokens(&cu, layer, TokenOp::Decode, &ones, &c.slots, &inp, &c.opts)
                    .expect("ring decode");
            }
        }
        let inputs = HostInputs::random(&mut rng, c.dims(), c.num_tokens(), &c.opts, c.input_dtype)
            .with_gate_params(&params.a_log, &params.dt_bias);
        let bounds = c.bounds();
        let mut outs = Vec::new();
        for ((budget, columns), layer) in [(512 << 20, 32), (1, 32), (512 << 20, 16)]
            .into_iter()
            .zip(&mut layers)
        {
            cu.set_prefill_scratch_bytes(budget).expect("budget");
            cu.set_chunk_state_columns(Some(columns)).expect("columns");
            outs.push(
                run_tokens(
                    &cu,
                    layer,
                    TokenOp::Prefill,
                    &bounds,
                    &c.slots,
                    &inputs,
                    &c.opts,
                )
                .expect("prefill"),
            );
        }
        cu.set_chunk_state_columns(None).expect("columns");
        let states: Vec<_> = layers
            .iter()
            .map(|l| l.read_states(mem, &c.slots).expect("read"))
            .collect();
        for (i, how) in [(1, "windows of one chunk"), (2, "16 columns")] {
            let what =
                format!("{state} {layout:?} ring {ring_len} K {k} V {v} {input} inputs, {how}");
            assert_bits_eq(&outs[i], &outs[0], &format!("{what}: outputs"));
            assert_bits_eq(&states[i], &states[0], &format!("{what}: states"));
        }
    }
}

#[test]
fn cuda_prefill_equals_decode_token_by_token_and_prefill_in_two_pieces() {
    let Some(cu) = cuda() else { return };
    each_prefill_kernel(&cu, |_| {
        for (state, ring_len) in [(Dtype::Fp32, 0), (Dtype::Fp16, 0), (Dtype::Bf16, 4)] {
            let c = prefill_case(
                case(
                    2,
                    4,
                    32,
                    48,
                    state,
                    Dtype::Fp32,
                    StateLayout::KFirst,
                    ring_len,
                ),
                &[20, 0, 7],
            );
            check_decode_matches_prefill(&cu, &c, 330);
            check_prefill_in_two_pieces_matches_one(&cu, &c, &[9, 0, 7], 331);
        }
    });
}

#[test]
fn cuda_enqueued_verify_clamps_an_accepted_count_above_the_drafts_and_reports_it() {
    let Some(cu) = cuda() else { return };
    let c = case(
        1,
        2,
        16,
        16,
        Dtype::Fp32,
        Dtype::Fp32,
        StateLayout::KFirst,
        4,
    );
    let mut rng = StdRng::seed_from_u64(81);
    let init = initial_states(&c, &mut rng);
    let mut layer = layer_with_states(&cu, &c, &init, &mut rng);
    let mem = cu.memory();
    let n = c.slots.len();
    // every slot has 0 drafts; sequence 2 claims 3 accepted
    let mut acc = vec![0u32; n];
    acc[2] = 3;
    let inputs = HostInputs::random(&mut rng, c.dims(), n, &c.opts, c.input_dtype);
    let dev = DeviceInputs::upload(mem, &inputs, &c.opts).unwrap();
    let acc_buf = upload_bytes(mem, bytemuck::cast_slice(&acc)).unwrap();
    let batch = cu
        .prepare(batch_plan(&(0..=n).collect::<Vec<_>>(), &c.slots).unwrap())
        .unwrap();
    let len = n * c.hv * c.v;
    let mut out_buf = upload(mem, &vec![f32::NAN; len], Dtype::Fp32).unwrap();
    let mut out = TensorViewMut {
        buf: &mut out_buf,
        dtype: Dtype::Fp32,
        len,
    };
    let accepted = IndexView {
        buf: &acc_buf,
        len: n,
    };
    // the synchronous path refuses it before touching the pool
    assert_refused(
        cu.spec_verify(
            &batch,
            &accepted,
            &dev.view(),
            &c.opts,
            &mut layer.view(),
            &mut out,
        ),
        "accepted",
        "above the drafts",
    );
    cu.check_device_errors()
        .expect("nothing recorded by a refused call");
    // the enqueue path clamps on the device and records it
    cu.enqueue_spec_verify(
        &batch,
        &accepted,
        &dev.view(),
        &c.opts,
        &mut layer.view(),
        &mut out,
    )
    .expect("enqueue");
    match cu.check_device_errors() {
        Err(KernelError::InvalidArgument {
            arg: "accepted",
            msg,
        }) => {
            assert!(msg.contains(&format!("slot {}", c.slots[2])), "{msg}");
        }
        other => panic!("expected the clamped accepted count to be reported, got {other:?}"),
    }
    cu.check_device_errors()
        .expect("the report clears the error word");
    let m = layer.meta(mem, c.slots[2]).unwrap();
    assert_eq!(
        (m.len, m.pending, m.arrive),
        (1, 0, 0),
        "clamped to 0 accepted, one new draft"
    );
}

#[test]
fn cuda_precompiled_modules_load_on_the_device_with_their_kernels() {
    let Some(cu) = cuda() else { return };
    // a module of the suite's (compiled again here, for the device's architecture) and the
    // fill module, into a fresh cache directory
    let dir = std::env::temp_dir().join(format!("kda-precompile-gpu-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let g = case(
        1,
        1,
        128,
        128,
        Dtype::Fp16,
        Dtype::Bf16,
        StateLayout::KFirst,
        1,
    )
    .geometry();
    let modules = kda_kernels::precompile(&dir, cu.arch(), &[g], &BatchKind::ALL)
        .expect("NVRTC compiles them");
    assert_eq!(modules.len(), 3, "{modules:?}");
    // the driver loads each CUBIN and finds the kernels the registry looks up in it
    let ctx = cudarc::driver::CudaContext::new(0).expect("device 0");
    for m in &modules {
        assert!(!m.cached, "{m:?}");
        let bytes = std::fs::read(&m.path).expect("the module's file");
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(bytes))
            .unwrap_or_else(|e| panic!("{}: the driver refused it: {e}", m.name));
        let entries: &[&str] = if m.name == "kda_fill.cu" {
            &["kda_fill", "kda_copy"]
        } else {
            &["kda_step", "kda_eager_regs", "kda_ring_delta"]
        };
        for f in entries {
            module
                .load_function(f)
                .unwrap_or_else(|e| panic!("{}: no {f}: {e}", m.name));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cuda_decode_on_an_engine_stream_through_borrowed_buffers_gives_the_bits_of_the_owned_path() {
    let Some(cu) = cuda() else { return };
    use cudarc::driver::{CudaSlice, DevicePtr};
    use kda_kernels::cuda::CudaBuffer;
    use kda_kernels::{StepInputs, TensorView};
    // the "engine": a stream of its own on device 0's primary context and its own allocations
    let ectx = cudarc::driver::CudaContext::new(0).expect("device 0");
    let es = ectx.new_stream().expect("the engine's stream");
    // SAFETY: `es` is a live stream of device 0's primary context; it is declared before `eng`,
    // so it outlives the backend, and the stream is synchronised before anything is dropped.
    let eng = unsafe { CudaBackend::on_stream(0, es.cu_stream().cast()) }.expect("on_stream");
    assert_eq!(eng.raw_stream(), es.cu_stream().cast::<std::ffi::c_void>());
    // 2-byte K-first eager decode of 16 sequences x 8 value heads, fresh random inputs
    let slots: Vec<u32> = (0..16u32).map(|i| 3 * i + 1).collect();
    let c = eager_case(Dtype::Fp16, StateLayout::KFirst, Rounding::Nearest, &slots);
    let mut rng = StdRng::seed_from_u64(0x5eed_0000_0000_0050);
    let init = initial_states(&c, &mut rng);
    let mut owned = layer_with_states(&cu, &c, &init, &mut rng.clone());
    let mut engine_layer = layer_with_states(&eng, &c, &init, &mut rng.clone());
    let bounds: Vec<usize> = (0..=slots.len()).collect();
    let host = HostInputs::random(&mut rng, c.dims(), slots.len(), &c.opts, c.input_dtype);
    // the owned path, the suite's usual one (the backend's own stream and buffers)
    let want = run_tokens(
        &cu,
        &mut owned,
        TokenOp::Decode,
        &bounds,
        &slots,
        &host,
        &c.opts,
    )
    .expect("owned call");
    let want_states = owned.read_states(cu.memory(), &slots).expect("read");
    // the engine's tensors: each input staged in an engine allocation, then copied on the
    // engine's stream into the tensor the call borrows, with no host synchronisation before
    // the call (only the shared stream orders the copies before the kernel)
    let d = c.input_dtype;
    let tensor = |values: &[f32], dtype: Dtype| -> (CudaSlice<u8>, CudaSlice<u8>, usize) {
        let bytes = dtype.encode_f32(values);
        let staged = es.clone_htod(&bytes).expect("stage");
        let t = es.alloc_zeros::<u8>(bytes.len()).expect("alloc");
        (staged, t, values.len())
    };
    let mut ts = vec![
        tensor(&host.q, d),
        tensor(&host.k, d),
        tensor(&host.v, d),
        tensor(&host.g, d),
        tensor(&host.beta, d),
        tensor(&host.a_log, Dtype::Fp32),
        tensor(&host.dt_bias, Dtype::Fp32),
    ];
    let out_len = slots.len() * c.hv * c.v;
    let out_t = es
        .clone_htod(&vec![0xffu8; out_len * d.size()])
        .expect("poisoned output");
    let borrow = |t: &CudaSlice<u8>| -> CudaBuffer {
        let (ptr, _) = t.device_ptr(&es);
        // SAFETY: the engine's allocation, alive until the end of the test, after the stream
        // is synchronised; every use of it is on the engine's stream.
        unsafe { eng.memory().borrow(ptr, t.len()) }.expect("an aligned allocation")
    };
    for (staged, t, _) in &mut ts {
        es.memcpy_dtod(&*staged, t).expect("the engine's copy");
    }
    let bufs: Vec<CudaBuffer> = ts.iter().map(|(_, t, _)| borrow(t)).collect();
    let mut out_buf = borrow(&out_t);
    assert!(bufs.iter().all(CudaBuffer::is_borrowed) && out_buf.is_borrowed());
    let view = |i: usize, dtype: Dtype| TensorView {
        buf: &bufs[i],
        dtype,
        len: ts[i].2,
    };
    let gate = c.opts.needs_gate_params();
    let inputs = StepInputs {
        q: view(0, d),
        k: view(1, d),
        v: view(2, d),
        g: view(3, d),
        beta: view(4, d),
        a_log: gate.then(|| view(5, Dtype::Fp32)),
        dt_bias: gate.then(|| view(6, Dtype::Fp32)),
    };
    let batch = eng
        .prepare(batch_plan(&bounds, &slots).unwrap())
        .expect("batch");
    let mut out = TensorViewMut {
        buf: &mut out_buf,
        dtype: d,
        len: out_len,
    };
    eng.enqueue_decode(&batch, &inputs, &c.opts, &mut engine_layer.view(), &mut out)
        .expect("engine call");
    // the engine's next work on its stream sees the outputs: a copy of them, then one wait
    let mut copied = es.alloc_zeros::<u8>(out_t.len()).expect("alloc");
    es.memcpy_dtod(&out_t, &mut copied)
        .expect("the engine's copy");
    es.synchronize().expect("the engine's stream");
    eng.check_device_errors().expect("no device error");
    let got = d.decode_f32(&es.clone_dtoh(&copied).expect("download"));
    assert_bits_eq(
        &got,
        &want,
        "outputs through borrowed buffers on the engine's stream",
    );
    let got_states = engine_layer
        .read_states(eng.memory(), &slots)
        .expect("read");
    assert_bits_eq(&got_states, &want_states, "states");
    // the memory's own copies on a borrowed buffer: write, read back, zero
    let probe: Vec<u8> = (0..out_t.len()).map(|i| (i * 7 + 3) as u8).collect();
    eng.memory().write(&mut out_buf, 0, &probe).expect("write");
    let mut back = vec![0u8; probe.len()];
    eng.memory().read(&out_buf, 0, &mut back).expect("read");
    assert_eq!(back, probe);
    eng.memory().zero(&mut out_buf, 8, 16).expect("zero");
    eng.memory().read(&out_buf, 0, &mut back).expect("read");
    assert!(
        back[8..24].iter().all(|&b| b == 0) && back[..8] == probe[..8] && back[24..] == probe[24..]
    );
    es.synchronize().expect("the engine's stream");
}

#[test]
fn cuda_borrowing_refuses_a_misaligned_or_null_address() {
    let Some(cu) = cuda() else { return };
    for (ptr, len) in [(0u64, 64usize), (0x1000 + 8, 64)] {
        // SAFETY: refused before anything could use the address.
        let e = unsafe { cu.memory().borrow(ptr, len) }.unwrap_err();
        assert!(
            matches!(e, KernelError::InvalidArgument { arg: "ptr", .. })
                && e.to_string().contains(&format!("{ptr:#x}")),
            "{e}"
        );
    }
    // SAFETY: an empty buffer touches no memory.
    let empty = unsafe { cu.memory().borrow(0, 0) }.expect("empty");
    assert!(empty.is_empty());
}

#[test]
fn cuda_memory_round_trips_and_allows_empty_buffers() {
    let Some(cu) = cuda() else { return };
    let mem = cu.memory();
    let mut empty = mem.alloc_zeroed(0).expect("0 bytes");
    assert_eq!(mem.len(&empty), 0);
    mem.write(&mut empty, 0, &[]).unwrap();
    let mut rng = StdRng::seed_from_u64(91);
    let bytes: Vec<u8> = (0..1000).map(|_| rng.random()).collect();
    let mut b = mem.alloc_zeroed(3000).unwrap();
    mem.write(&mut b, 500, &bytes).unwrap();
    mem.copy_within(&mut b, 500, 1700, 1000).unwrap();
    let mut back = vec![0u8; 3000];
    mem.read(&b, 0, &mut back).unwrap();
    assert!(back[..500].iter().all(|&x| x == 0));
    assert_eq!(&back[500..1500], &bytes[..]);
    assert_eq!(&back[1700..2700], &bytes[..]);
    mem.zero(&mut b, 600, 100).unwrap();
    mem.read(&b, 0, &mut back).unwrap();
    assert!(back[600..700].iter().all(|&x| x == 0));
    assert!(
        mem.copy_within(&mut b, 0, 10, 100).is_err(),
        "overlapping copy refused"
    );
    assert!(
        mem.write(&mut b, 2500, &bytes).is_err(),
        "write past the end refused"
    );
}

/// Writes fresh token inputs (the gate parameters kept) into a call's input buffers.
fn rewrite_inputs(
    cu: &CudaBackend,
    dev: &mut DeviceInputs<kda_kernels::cuda::CudaBuffer>,
    host: &HostInputs,
) {
    let mem = cu.memory();
    let d = host.dtype;
    for (buf, values) in [
        (&mut dev.q, &host.q),
        (&mut dev.k, &host.k),
        (&mut dev.v, &host.v),
        (&mut dev.g, &host.g),
        (&mut dev.beta, &host.beta),
    ] {
        mem.write(buf, 0, &d.encode_f32(values)).expect("inputs");
    }
}

/// The live counts of the padded-batch tests' steps: full, one, none, then others.
const LIVE_STEPS: [usize; 6] = [8, 1, 0, 5, 3, 8];

#[test]
fn cuda_a_graph_of_a_padded_batch_decodes_each_steps_live_sequences_as_plain_calls_do() {
    let Some(cu) = cuda() else { return };
    const CAP: usize = 8;
    const POOL: usize = 24;
    let every: Vec<u32> = (0..POOL as u32).collect();
    let eager = |state| eager_case(state, StateLayout::KFirst, Rounding::Nearest, &every);
    let stochastic = Rounding::Stochastic {
        seed: 0x5eed_0000_0051,
    };
    let cases = [
        eager(Dtype::Fp32),
        eager(Dtype::Bf16),
        eager_case(Dtype::Fp16, StateLayout::KFirst, stochastic, &every),
        Case {
            ring_len: 8,
            ..eager(Dtype::Fp16)
        },
    ];
    for (ci, c) in cases.iter().enumerate() {
        let what = format!("{} pool, ring {}", c.state_dtype, c.ring_len);
        let mem = cu.memory();
        let mut rng = StdRng::seed_from_u64(0x5eed_0000_0000_0051 + ci as u64);
        // twins: one stepped by a graph captured once, one by a prepared call per step
        let (mut graphed, mut plain) = twin_layers(&cu, c, c, &mut rng);
        let first = HostInputs::random(&mut rng, c.dims(), CAP, &c.opts, c.input_dtype);
        let mut dev = DeviceInputs::upload(mem, &first, &c.opts).expect("inputs");
        let out_len = CAP * c.hv * c.v;
        let out_bytes = out_len * c.input_dtype.size();
        let mut out_buf = upload_bytes(mem, &vec![0xff; out_bytes]).expect("output");
        let bounds: Vec<usize> = (0..=CAP).collect();
        let mut batch = cu
            .prepare_padded(batch_plan(&bounds, &every[..CAP]).unwrap(), POOL)
            .expect("padded batch");
        assert_eq!((batch.capacity(), batch.is_padded()), (CAP, true));
        // the kernel compiled and loaded outside the capture, on a layer of its own
        let mut scratch = layer_with_states(&cu, c, &initial_states(c, &mut rng), &mut rng);
        let enqueue = |layer: &mut TestLayer<_>, out_buf: &mut _| {
            let mut out = TensorViewMut {
                buf: out_buf,
                dtype: c.input_dtype,
                len: out_len,
            };
            cu.enqueue_decode(&batch, &dev.view(), &c.opts, &mut layer.view(), &mut out)
        };
        enqueue(&mut scratch, &mut out_buf).expect("warm-up call");
        let graph = cu
            .capture(|| enqueue(&mut graphed, &mut out_buf))
            .expect("capture");
        let captured = graphed.epoch() as u32;
        for (step, &live) in LIVE_STEPS.iter().enumerate() {
            let slots = random_slots(&mut rng, POOL, live);
            let host = HostInputs::random(&mut rng, c.dims(), CAP, &c.opts, c.input_dtype)
                .with_gate_params(&first.a_log, &first.dt_bias);
            rewrite_inputs(&cu, &mut dev, &host);
            mem.write(&mut out_buf, 0, &vec![0xff; out_bytes])
                .expect("poison");
            cu.update_batch(&mut batch, &slots).expect("update");
            assert_eq!(batch.as_ref().slots, slots);
            graph.launch().expect("replay");
            cu.synchronize().expect("sync");
            cu.check_device_errors().expect("no device error");
            let at = format!("{what}, step {step}, {live} live");
            let got = live_output(mem, &out_buf, c.input_dtype, live * c.hv * c.v, &at);
            if live > 0 {
                if c.rounding != Rounding::Nearest {
                    // the epoch the replay rounded with (the captured one plus the updates so
                    // far times the odd constant): the plain call's after its bump (eager
                    // decode stores every call)
                    let offset = (step as u32 + 1).wrapping_mul(PADDED_EPOCH_STEP);
                    let epoch = captured.wrapping_add(offset);
                    *plain.view().epoch = (1u64 << 32) + u64::from(epoch) - 1;
                }
                let live_bounds: Vec<usize> = (0..=live).collect();
                let tokens: Vec<usize> = (0..live).collect();
                let want = run_tokens(
                    &cu,
                    &mut plain,
                    TokenOp::Decode,
                    &live_bounds,
                    &slots,
                    &host.gather(&tokens),
                    &c.opts,
                )
                .expect("plain call");
                assert_bits_eq(&got, &want, &format!("{at}: outputs"));
            }
            // every slot, the live ones and the untouched rest
            assert_layers_agree(&cu, &graphed, &plain, &at);
        }
    }
}

#[test]
fn cuda_a_padded_batch_computes_its_live_sequences_as_plain_batches_do() {
    let Some(cu) = cuda() else { return };
    let every: Vec<u32> = (0..20).collect();
    let stochastic = Rounding::Stochastic {
        seed: 0x5eed_0000_0052,
    };
    // (state, rounding, ring, tokens per sequence, operation)
    let shapes = [
        (Dtype::Fp32, Rounding::Nearest, 0, 1, PaddedOp::Decode),
        (Dtype::Bf16, Rounding::Nearest, 0, 1, PaddedOp::Decode),
        (Dtype::Fp16, stochastic, 0, 1, PaddedOp::Decode),
        (Dtype::Fp16, Rounding::Nearest, 8, 1, PaddedOp::Decode),
        (Dtype::Fp16, Rounding::Nearest, 6, 2, PaddedOp::SpecVerify),
        (Dtype::Fp32, Rounding::Nearest, 6, 2, PaddedOp::SpecVerify),
        (Dtype::Bf16, stochastic, 0, 9, PaddedOp::Prefill),
        (Dtype::Fp32, Rounding::Nearest, 4, 5, PaddedOp::Prefill),
    ];
    for (i, (state, rounding, ring_len, t, op)) in shapes.into_iter().enumerate() {
        let c = Case {
            ring_len,
            ..eager_case(state, StateLayout::KFirst, rounding, &every)
        };
        check_padded_batch_matches_plain_batches(
            &cu,
            &c,
            8,
            t,
            op,
            &LIVE_STEPS,
            0x5eed_0000_0000_0052 + i as u64,
        );
    }
}
