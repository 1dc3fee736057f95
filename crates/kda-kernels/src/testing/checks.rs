//! Backend-generic checks: one body per property, run against every compiled backend. Each
//! check draws fresh random inputs from its seed, runs the operations through the guarded
//! runners of [`super::layer`] (poisoned outputs, untouched slots) and asserts; it returns the
//! errors it measured where that is informative.

use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use state_pool::{Dtype, Rounding};

use super::data::{
    bounds_of, random_states, rel_frobenius, rel_frobenius_f32, to_f64, unit_roundoff, Case,
    HostInputs,
};
use super::layer::{run_replay, run_tokens, TestLayer, TokenOp};
use crate::api::{Backend, Buf};
use crate::cpu::reference::reference_run;
use crate::rounding::StoreMode;

/// Relative Frobenius tolerance of outputs against the f64 reference: f32 arithmetic plus
/// one nearest rounding to the output (= input) dtype.
pub fn output_tolerance(case: &Case) -> f64 {
    1e-5 + 1.01 * unit_roundoff(case.input_dtype)
}

/// The Frobenius norm of states read back from a pool.
fn frobenius(x: &[f32]) -> f64 {
    x.iter().map(|&a| (a as f64).powi(2)).sum::<f64>().sqrt()
}

/// `||got - want||_F / scale` (the absolute norm when `scale` is 0), where `scale` is the
/// largest norm the state had along the sequence: f32 rounding errors scale with the terms a
/// state is made of, so a state that ends near zero by cancellation is compared against them.
fn state_difference(got: &[f32], want: &[f32], scale: f64) -> f64 {
    let d: Vec<f32> = got.iter().zip(want).map(|(a, b)| a - b).collect();
    let scale = scale.max(frobenius(want));
    if scale > 0.0 {
        frobenius(&d) / scale
    } else {
        frobenius(&d)
    }
}

/// Relative Frobenius tolerance of a state stored once: f32 arithmetic plus one rounding to
/// the state dtype (up to one ulp, two unit roundoffs, when stochastic).
pub fn state_tolerance(case: &Case) -> f64 {
    let per_store = match case.rounding {
        Rounding::Nearest => 1.01,
        Rounding::Stochastic { .. } => 2.02,
    };
    1e-5 + per_store * unit_roundoff(case.state_dtype)
}

/// A fresh layer for `case` with the given initial states (logical, representable in the
/// state dtype) in its slots and every other slot poisoned.
pub fn layer_with_states<B: Backend>(
    be: &B,
    case: &Case,
    init: &[f32],
    rng: &mut StdRng,
) -> TestLayer<Buf<B>> {
    let mem = be.memory();
    let mut layer = TestLayer::new(mem, case.geometry()).expect("allocate the test layer");
    layer.poison(mem, &case.slots, rng).expect("poison");
    layer
        .write_states(mem, &case.slots, init)
        .expect("write initial states");
    layer
}

/// Random initial states for `case`'s slots.
pub fn initial_states(case: &Case, rng: &mut StdRng) -> Vec<f32> {
    random_states(rng, case.dims(), case.slots.len(), case.state_dtype)
}

/// Two fresh layers, of `a` and of `b` (the same slots and dims, pools that may differ), holding
/// the same random initial states of `a`'s state dtype: the two sides of a comparison.
pub fn twin_layers<B: Backend>(
    be: &B,
    a: &Case,
    b: &Case,
    rng: &mut StdRng,
) -> (TestLayer<Buf<B>>, TestLayer<Buf<B>>) {
    let init = initial_states(a, rng);
    let la = layer_with_states(be, a, &init, rng);
    let lb = layer_with_states(be, b, &init, rng);
    (la, lb)
}

/// Asserts that two f32 tensors have the same bits.
pub fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    if let Some(i) = got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        panic!(
            "{what}: element {i} differs: {} vs {} (and maybe more)",
            got[i], want[i]
        );
    }
}

/// Chunked prefill against the f64 token recurrence from random initial states; returns the
/// relative errors of the outputs and of the stored final states.
pub fn check_prefill_matches_reference<B: Backend>(be: &B, case: &Case, seed: u64) -> (f64, f64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mem = be.memory();
    let init = initial_states(case, &mut rng);
    let mut layer = layer_with_states(be, case, &init, &mut rng);
    let inputs = HostInputs::random(
        &mut rng,
        case.dims(),
        case.num_tokens(),
        &case.opts,
        case.input_dtype,
    );
    let bounds = case.bounds();
    let out = run_tokens(
        be,
        &mut layer,
        TokenOp::Prefill,
        &bounds,
        &case.slots,
        &inputs,
        &case.opts,
    )
    .expect("prefill");
    let (ref_out, ref_state) = reference_run(
        case.dims(),
        &inputs.as_ref_inputs(),
        &case.opts,
        &bounds,
        to_f64(&init),
    )
    .expect("reference");
    let state = layer.read_states(mem, &case.slots).expect("read states");
    let (eo, es) = (
        rel_frobenius(&out, &ref_out),
        rel_frobenius(&state, &ref_state),
    );
    assert!(
        eo <= output_tolerance(case),
        "prefill outputs: relative error {eo:.3e} > {:.3e} ({case:?})",
        output_tolerance(case)
    );
    assert!(
        es <= state_tolerance(case),
        "prefill state: relative error {es:.3e} > {:.3e} ({case:?})",
        state_tolerance(case)
    );
    for &s in &case.slots {
        let m = layer.meta(mem, s).expect("meta");
        assert_eq!(
            (m.len, m.pending),
            (0, 0),
            "prefill leaves slot {s}'s ring empty"
        );
    }
    (eo, es)
}

/// Prefill of every sequence in two pieces (the first `splits[i]` tokens, then the rest)
/// against prefill in one piece; returns the relative differences of outputs and of states (the
/// states' difference against their largest norm along the sequence).
pub fn check_prefill_in_two_pieces_matches_one<B: Backend>(
    be: &B,
    case: &Case,
    splits: &[usize],
    seed: u64,
) -> (f64, f64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mem = be.memory();
    let (mut whole, mut pieces) = twin_layers(be, case, case, &mut rng);
    let t = case.num_tokens();
    let inputs = HostInputs::random(&mut rng, case.dims(), t, &case.opts, case.input_dtype);
    let bounds = case.bounds();
    let out_whole = run_tokens(
        be,
        &mut whole,
        TokenOp::Prefill,
        &bounds,
        &case.slots,
        &inputs,
        &case.opts,
    )
    .expect("prefill in one piece");

    // the state's largest norm along the sequence: initial, at the split (see state_difference)
    let mut scale = frobenius(&pieces.read_states(mem, &case.slots).expect("read"));
    let (mut first, mut second) = (Vec::new(), Vec::new());
    for (i, &s) in splits.iter().enumerate() {
        first.extend(bounds[i]..bounds[i] + s);
        second.extend(bounds[i] + s..bounds[i + 1]);
    }
    let rest: Vec<usize> = case
        .seq_lens
        .iter()
        .zip(splits)
        .map(|(l, s)| l - s)
        .collect();
    let o1 = run_tokens(
        be,
        &mut pieces,
        TokenOp::Prefill,
        &bounds_of(splits),
        &case.slots,
        &inputs.gather(&first),
        &case.opts,
    )
    .expect("first piece");
    scale = scale.max(frobenius(
        &pieces.read_states(mem, &case.slots).expect("read"),
    ));
    let o2 = run_tokens(
        be,
        &mut pieces,
        TokenOp::Prefill,
        &bounds_of(&rest),
        &case.slots,
        &inputs.gather(&second),
        &case.opts,
    )
    .expect("second piece");
    let row = case.hv * case.v;
    let mut out_pieces = vec![0.0; t * row];
    for (o, idx) in [(&o1, &first), (&o2, &second)] {
        for (j, &tok) in idx.iter().enumerate() {
            out_pieces[tok * row..(tok + 1) * row].copy_from_slice(&o[j * row..(j + 1) * row]);
        }
    }
    let s_whole = whole.read_states(mem, &case.slots).expect("read");
    let s_pieces = pieces.read_states(mem, &case.slots).expect("read");
    let eo = rel_frobenius_f32(&out_pieces, &out_whole);
    let es = state_difference(&s_pieces, &s_whole, scale);
    // The pieces store (and round) the state once more, at the split.
    let tol_o = output_tolerance(case) + 2.0 * state_tolerance(case);
    let tol_s = 3.0 * state_tolerance(case);
    assert!(
        eo <= tol_o,
        "outputs in two pieces differ by {eo:.3e} > {tol_o:.3e} ({case:?}, splits {splits:?})"
    );
    assert!(
        es <= tol_s,
        "states in two pieces differ by {es:.3e} of their largest norm > {tol_s:.3e} ({case:?}, splits {splits:?})"
    );
    (eo, es)
}

/// Token-by-token decode (the case's `ring_len`, flushed at the end) against a prefill of the
/// same tokens; returns the relative differences of outputs and of states (the states'
/// difference against their largest norm along the sequence).
pub fn check_decode_matches_prefill<B: Backend>(be: &B, case: &Case, seed: u64) -> (f64, f64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mem = be.memory();
    let (mut pre, mut dec) = twin_layers(be, case, case, &mut rng);
    let t = case.num_tokens();
    let inputs = HostInputs::random(&mut rng, case.dims(), t, &case.opts, case.input_dtype);
    let bounds = case.bounds();
    let out_pre = run_tokens(
        be,
        &mut pre,
        TokenOp::Prefill,
        &bounds,
        &case.slots,
        &inputs,
        &case.opts,
    )
    .expect("prefill");

    let row = case.hv * case.v;
    let mut out_dec = vec![0.0; t * row];
    let longest = case.seq_lens.iter().copied().max().unwrap_or(0);
    // the state's largest norm along the sequence: the initial states, the stored states after
    // each decode step (see state_difference)
    let mut scale = frobenius(&dec.read_states(mem, &case.slots).expect("read"));
    for j in 0..longest {
        let active: Vec<usize> = (0..case.slots.len())
            .filter(|&i| case.seq_lens[i] > j)
            .collect();
        let toks: Vec<usize> = active.iter().map(|&i| bounds[i] + j).collect();
        let slots: Vec<u32> = active.iter().map(|&i| case.slots[i]).collect();
        let o = run_tokens(
            be,
            &mut dec,
            TokenOp::Decode,
            &bounds_of(&vec![1; active.len()]),
            &slots,
            &inputs.gather(&toks),
            &case.opts,
        )
        .expect("decode");
        for (m, &tok) in toks.iter().enumerate() {
            out_dec[tok * row..(tok + 1) * row].copy_from_slice(&o[m * row..(m + 1) * row]);
        }
        scale = scale.max(frobenius(&dec.read_states(mem, &case.slots).expect("read")));
    }
    run_replay(
        be,
        &mut dec,
        &case.slots,
        None,
        &case.opts,
        &inputs.a_log,
        &inputs.dt_bias,
    )
    .expect("flush");
    let s_pre = pre.read_states(mem, &case.slots).expect("read");
    let s_dec = dec.read_states(mem, &case.slots).expect("read");
    let eo = rel_frobenius_f32(&out_dec, &out_pre);
    let es = state_difference(&s_dec, &s_pre, scale);
    // Eager decode of a 2-byte pool rounds the state at every token.
    let stores = longest
        .checked_div(case.ring_len)
        .map_or(longest + 1, |c| c + 2) as f64;
    let tol_o = output_tolerance(case) * 2.0 + stores * state_tolerance(case);
    let tol_s = (stores + 1.0) * state_tolerance(case);
    assert!(
        eo <= tol_o,
        "decode outputs differ from prefill by {eo:.3e} > {tol_o:.3e} ({case:?})"
    );
    assert!(
        es <= tol_s,
        "decode state differs from prefill by {es:.3e} of its largest norm > {tol_s:.3e} ({case:?})"
    );
    (eo, es)
}

/// For the bit-exactness checks: asserts an fp32 pool with a ring, then two layers holding the
/// same random initial states, one with the case's ring and one eager (`ring_len` 0).
fn ring_and_eager_layers<B: Backend>(
    be: &B,
    case: &Case,
    rng: &mut StdRng,
) -> (TestLayer<Buf<B>>, TestLayer<Buf<B>>) {
    assert_eq!(
        case.state_dtype,
        Dtype::Fp32,
        "bit-exactness is a property of fp32 pools"
    );
    assert!(case.ring_len > 0, "the case needs a ring");
    let eager_case = Case {
        ring_len: 0,
        ..case.clone()
    };
    twin_layers(be, case, &eager_case, rng)
}

/// For an fp32 pool: decode through the case's ring (`ring_len > 0`) equals eager decode bit
/// for bit, token for token, and so does the state after every flush (random flushes of some
/// slots along the way, all slots at the end).
pub fn check_ring_decode_matches_eager<B: Backend>(be: &B, case: &Case, steps: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mem = be.memory();
    let (mut ring, mut eager) = ring_and_eager_layers(be, case, &mut rng);
    let n = case.slots.len();
    let params = HostInputs::random(&mut rng, case.dims(), 0, &case.opts, case.input_dtype);
    let ones = bounds_of(&vec![1; n]);
    for step in 0..steps {
        let inputs = HostInputs::random(&mut rng, case.dims(), n, &case.opts, case.input_dtype)
            .with_gate_params(&params.a_log, &params.dt_bias);
        let o_ring = run_tokens(
            be,
            &mut ring,
            TokenOp::Decode,
            &ones,
            &case.slots,
            &inputs,
            &case.opts,
        )
        .expect("ring decode");
        let o_eager = run_tokens(
            be,
            &mut eager,
            TokenOp::Decode,
            &ones,
            &case.slots,
            &inputs,
            &case.opts,
        )
        .expect("eager decode");
        assert_bits_eq(&o_ring, &o_eager, &format!("decode step {step} outputs"));
        let last = step + 1 == steps;
        if last || rng.random_ratio(1, 4) {
            let flush: Vec<u32> = if last {
                case.slots.clone()
            } else {
                case.slots
                    .iter()
                    .copied()
                    .filter(|_| rng.random_bool(0.5))
                    .collect()
            };
            run_replay(
                be,
                &mut ring,
                &flush,
                None,
                &case.opts,
                &params.a_log,
                &params.dt_bias,
            )
            .expect("flush");
            let a = ring.read_states(mem, &flush).expect("read");
            let b = eager.read_states(mem, &flush).expect("read");
            assert_bits_eq(&a, &b, &format!("state after the flush at step {step}"));
            for &s in &flush {
                let m = ring.meta(mem, s).expect("meta");
                assert_eq!(
                    (m.len, m.pending),
                    (0, 0),
                    "a flush empties slot {s}'s ring"
                );
            }
        }
    }
}

/// For an fp32 pool: a run of spec_verify steps with random draft counts (0..=ring_len) and
/// accepted counts, then a flush, equals eager decode of only the accepted tokens, bit for
/// bit: the outputs of every accepted draft and the final state. The first steps cycle the
/// accepted count through every value 0..=ring_len of a full verify.
pub fn check_spec_verify_matches_eager<B: Backend>(be: &B, case: &Case, steps: usize, seed: u64) {
    let r = case.ring_len;
    let mut rng = StdRng::seed_from_u64(seed);
    let mem = be.memory();
    let (mut ring, mut eager) = ring_and_eager_layers(be, case, &mut rng);
    let n = case.slots.len();
    let row = case.hv * case.v;
    let params = HostInputs::random(&mut rng, case.dims(), 0, &case.opts, case.input_dtype);
    // Per sequence: the previous verify's drafts and their outputs.
    let mut drafts: Vec<HostInputs> = (0..n)
        .map(|_| HostInputs::random(&mut rng, case.dims(), 0, &case.opts, case.input_dtype))
        .collect();
    let mut draft_out: Vec<Vec<f32>> = vec![Vec::new(); n];

    let accept = |rng: &mut StdRng,
                  step: usize,
                  drafts: &[HostInputs],
                  ring: &TestLayer<Buf<B>>|
     -> Vec<u32> {
        (0..n)
            .map(|i| {
                let have = drafts[i].tokens;
                let m = ring.meta(mem, case.slots[i]).expect("meta");
                assert_eq!(
                    m.drafts() as usize,
                    have,
                    "slot {} holds its drafts",
                    case.slots[i]
                );
                let a = if step <= r + 1 && step >= 1 {
                    (step - 1).min(have)
                } else {
                    rng.random_range(0..=have)
                };
                a as u32
            })
            .collect()
    };
    // Eager decode of the accepted drafts; their outputs must equal the verify's.
    let eager_accepted = |eager: &mut TestLayer<Buf<B>>,
                          acc: &[u32],
                          drafts: &[HostInputs],
                          draft_out: &[Vec<f32>],
                          step: usize| {
        let most = acc.iter().copied().max().unwrap_or(0) as usize;
        for m in 0..most {
            let active: Vec<usize> = (0..n).filter(|&i| acc[i] as usize > m).collect();
            let slots: Vec<u32> = active.iter().map(|&i| case.slots[i]).collect();
            let mut tok = drafts[active[0]].gather(&[m]);
            for &i in &active[1..] {
                let more = drafts[i].gather(&[m]);
                tok.q.extend(more.q);
                tok.k.extend(more.k);
                tok.v.extend(more.v);
                tok.g.extend(more.g);
                tok.beta.extend(more.beta);
                tok.tokens += 1;
            }
            let o = run_tokens(
                be,
                eager,
                TokenOp::Decode,
                &bounds_of(&vec![1; active.len()]),
                &slots,
                &tok,
                &case.opts,
            )
            .expect("eager decode");
            for (j, &i) in active.iter().enumerate() {
                assert_bits_eq(
                    &o[j * row..(j + 1) * row],
                    &draft_out[i][m * row..(m + 1) * row],
                    &format!("step {step}: output of accepted draft {m} of sequence {i}"),
                );
            }
        }
    };

    for step in 0..steps {
        let acc = accept(&mut rng, step, &drafts, &ring);
        eager_accepted(&mut eager, &acc, &drafts, &draft_out, step);
        let lens: Vec<usize> = (0..n)
            .map(|_| {
                if step <= r + 1 {
                    r
                } else {
                    rng.random_range(0..=r)
                }
            })
            .collect();
        let inputs = HostInputs::random(
            &mut rng,
            case.dims(),
            lens.iter().sum(),
            &case.opts,
            case.input_dtype,
        )
        .with_gate_params(&params.a_log, &params.dt_bias);
        let bounds = bounds_of(&lens);
        let o = run_tokens(
            be,
            &mut ring,
            TokenOp::SpecVerify(&acc),
            &bounds,
            &case.slots,
            &inputs,
            &case.opts,
        )
        .expect("spec_verify");
        for i in 0..n {
            let idx: Vec<usize> = (bounds[i]..bounds[i + 1]).collect();
            drafts[i] = inputs.gather(&idx);
            draft_out[i] = o[bounds[i] * row..bounds[i + 1] * row].to_vec();
        }
    }
    let acc = accept(&mut rng, steps + r + 2, &drafts, &ring);
    eager_accepted(&mut eager, &acc, &drafts, &draft_out, steps);
    run_replay(
        be,
        &mut ring,
        &case.slots,
        Some(&acc),
        &case.opts,
        &params.a_log,
        &params.dt_bias,
    )
    .expect("flush");
    let a = ring.read_states(mem, &case.slots).expect("read");
    let b = eager.read_states(mem, &case.slots).expect("read");
    assert_bits_eq(&a, &b, "state after the final flush");
}

/// Rounds one slot's f32 values (storage order) the way a store into `dtype` with `mode`
/// does, and up-casts them back.
pub fn round_like_store(values: &[f32], dtype: Dtype, mode: StoreMode) -> Vec<f32> {
    values
        .iter()
        .enumerate()
        .map(|(i, &x)| match dtype {
            Dtype::Fp32 => x,
            Dtype::Fp16 => mode.round::<f16>(x, i).to_f32(),
            Dtype::Bf16 => mode.round::<bf16>(x, i).to_f32(),
        })
        .collect()
}

/// For a 2-byte pool: decode through the case's ring (any `ring_len`, 0 is eager) rounds the
/// state exactly once per commit. An fp32 emulation decodes the same tokens eagerly and
/// rounds its state (with the same stochastic stream: the pool's epoch, the element's offset)
/// only where the ring commits; the 2-byte pool must hold exactly those bits after every step
/// and the outputs must agree bit for bit. Also: the state bytes and the epoch change only at
/// commits. Returns the number of commits seen.
pub fn check_ring_rounds_once_per_commit<B: Backend>(
    be: &B,
    case: &Case,
    steps: usize,
    seed: u64,
) -> usize {
    assert_ne!(
        case.state_dtype,
        Dtype::Fp32,
        "the case needs a 2-byte pool"
    );
    let r = case.ring_len;
    let mut rng = StdRng::seed_from_u64(seed);
    let mem = be.memory();
    let emu_case = Case {
        ring_len: 0,
        state_dtype: Dtype::Fp32,
        rounding: Rounding::Nearest,
        ..case.clone()
    };
    let (mut pool, mut emu) = twin_layers(be, case, &emu_case, &mut rng);
    let n = case.slots.len();
    let ones = bounds_of(&vec![1; n]);
    let params = HostInputs::random(&mut rng, case.dims(), 0, &case.opts, case.input_dtype);
    let round_slot = |emu: &TestLayer<Buf<B>>, slot: u32, epoch: u64| -> Vec<f32> {
        let exact = emu.read_slot_elems(mem, slot).expect("read");
        let mode = StoreMode::for_slot(case.rounding, 0, slot, epoch);
        round_like_store(&exact, case.state_dtype, mode)
    };
    let mut commits = 0;
    for step in 0..=steps {
        let last = step == steps;
        let pending: Vec<u32> = case
            .slots
            .iter()
            .map(|&s| pool.meta(mem, s).expect("meta").pending)
            .collect();
        let committing: Vec<usize> = (0..n)
            .filter(|&i| {
                if last {
                    pending[i] > 0
                } else {
                    r == 0 || pending[i] as usize == r
                }
            })
            .collect();
        let epoch_before = pool.epoch();
        let before: Vec<Vec<f32>> = case
            .slots
            .iter()
            .map(|&s| pool.read_slot_elems(mem, s).expect("read"))
            .collect();
        if last {
            run_replay(
                be,
                &mut pool,
                &case.slots,
                None,
                &case.opts,
                &params.a_log,
                &params.dt_bias,
            )
            .expect("flush");
        } else {
            let inputs = HostInputs::random(&mut rng, case.dims(), n, &case.opts, case.input_dtype)
                .with_gate_params(&params.a_log, &params.dt_bias);
            // The emulation rounds before the token for a ring commit, after it when eager.
            let rounded_before: Vec<(usize, Vec<f32>)> = if r > 0 {
                committing
                    .iter()
                    .map(|&i| (i, round_slot(&emu, case.slots[i], epoch_before + 1)))
                    .collect()
            } else {
                Vec::new()
            };
            let o_pool = run_tokens(
                be,
                &mut pool,
                TokenOp::Decode,
                &ones,
                &case.slots,
                &inputs,
                &case.opts,
            )
            .expect("decode");
            let o_emu = run_tokens(
                be,
                &mut emu,
                TokenOp::Decode,
                &ones,
                &case.slots,
                &inputs,
                &case.opts,
            )
            .expect("emulated decode");
            assert_bits_eq(&o_pool, &o_emu, &format!("step {step} outputs"));
            if !rounded_before.is_empty() {
                // Redo the committing slots' token from the rounded state.
                let slots: Vec<u32> = rounded_before.iter().map(|(i, _)| case.slots[*i]).collect();
                for (i, vals) in &rounded_before {
                    emu.write_slot_elems(mem, case.slots[*i], vals)
                        .expect("write");
                }
                let idx: Vec<usize> = rounded_before.iter().map(|(i, _)| *i).collect();
                run_tokens(
                    be,
                    &mut emu,
                    TokenOp::Decode,
                    &bounds_of(&vec![1; idx.len()]),
                    &slots,
                    &inputs.gather(&idx),
                    &case.opts,
                )
                .expect("emulated decode from the rounded state");
                for (i, vals) in &rounded_before {
                    let got = pool.read_slot_elems(mem, case.slots[*i]).expect("read");
                    assert_bits_eq(
                        &got,
                        vals,
                        &format!("step {step}: state committed by slot {}", case.slots[*i]),
                    );
                }
            }
        }
        let stored = !committing.is_empty();
        assert_eq!(
            pool.epoch(),
            epoch_before + stored as u64,
            "step {step}: the epoch moves once per storing call"
        );
        for (i, (&slot, before)) in case.slots.iter().zip(&before).enumerate() {
            let now = pool.read_slot_elems(mem, slot).expect("read");
            if !committing.contains(&i) {
                assert_bits_eq(
                    &now,
                    before,
                    &format!("step {step}: slot {slot} stored no state"),
                );
            } else if r == 0 || last {
                let want = round_slot(&emu, slot, pool.epoch());
                assert_bits_eq(
                    &now,
                    &want,
                    &format!("step {step}: state stored by slot {slot}"),
                );
                emu.write_slot_elems(mem, slot, &want).expect("write");
            }
        }
        commits += committing.len();
    }
    commits
}

/// Stochastic rounding of a 2-byte pool (the case's `rounding` must be stochastic): the same
/// seed gives the same bits, another seed other bits, every stored value is one of the two
/// neighbours of the exact f32 result, and the rounding is unbiased (the mean signed error in
/// ulps is near 0). Returns that mean.
pub fn check_stochastic_rounding<B: Backend>(be: &B, case: &Case, seed: u64) -> f64 {
    let Rounding::Stochastic { seed: sr_seed } = case.rounding else {
        panic!("the case needs stochastic rounding")
    };
    assert_ne!(
        case.state_dtype,
        Dtype::Fp32,
        "the case needs a 2-byte pool"
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let mem = be.memory();
    let init = initial_states(case, &mut rng);
    let inputs = HostInputs::random(
        &mut rng,
        case.dims(),
        case.num_tokens(),
        &case.opts,
        case.input_dtype,
    );
    let bounds = case.bounds();
    let run = |c: &Case, rng: &mut StdRng| -> Vec<f32> {
        let mut layer = layer_with_states(be, c, &init, rng);
        run_tokens(
            be,
            &mut layer,
            TokenOp::Prefill,
            &bounds,
            &c.slots,
            &inputs,
            &c.opts,
        )
        .expect("prefill");
        c.slots
            .iter()
            .flat_map(|&s| layer.read_slot_elems(mem, s).expect("read"))
            .collect()
    };
    let a = run(case, &mut rng);
    let b = run(case, &mut rng);
    assert_bits_eq(&a, &b, "two runs with the same seed");
    let other = Case {
        rounding: Rounding::Stochastic {
            seed: sr_seed ^ 0x5eed,
        },
        ..case.clone()
    };
    let c = run(&other, &mut rng);
    assert!(
        a.iter().zip(&c).any(|(x, y)| x.to_bits() != y.to_bits()),
        "another seed gave the same bits"
    );
    let exact = run(
        &Case {
            state_dtype: Dtype::Fp32,
            rounding: Rounding::Nearest,
            ..case.clone()
        },
        &mut rng,
    );

    let (mut sum, mut count, mut off_nearest) = (0.0f64, 0usize, 0usize);
    for (&got, &x) in a.iter().zip(&exact) {
        let (lo, hi) = neighbours(x, case.state_dtype);
        assert!(
            got == lo || got == hi,
            "{got} is not a neighbour of the exact {x} ({lo}, {hi})"
        );
        if lo != hi {
            sum += (got as f64 - x as f64) / (hi as f64 - lo as f64);
            count += 1;
            off_nearest +=
                (got != round_like_store(&[x], case.state_dtype, StoreMode::Nearest)[0]) as usize;
        }
    }
    let mean = sum / count.max(1) as f64;
    let bound = 5.0 * 0.5 / (count.max(1) as f64).sqrt();
    assert!(
        count >= 100,
        "too few inexact elements ({count}) to judge the bias"
    );
    assert!(
        mean.abs() <= bound,
        "mean signed rounding error {mean:.4} ulp exceeds {bound:.4}"
    );
    assert!(
        off_nearest * 20 >= count,
        "stochastic rounding agreed with nearest almost everywhere ({off_nearest} of {count})"
    );
    mean
}

/// The two `dtype` values around `x` (equal when `x` is representable).
fn neighbours(x: f32, dtype: Dtype) -> (f32, f32) {
    // (nearest value, its bits) and the value of given bits.
    let (n, bits, from): (f32, u16, fn(u16) -> f32) = match dtype {
        Dtype::Fp32 => return (x, x),
        Dtype::Fp16 => {
            let h = f16::from_f32(x);
            (h.to_f32(), h.to_bits(), |b| f16::from_bits(b).to_f32())
        }
        Dtype::Bf16 => {
            let h = bf16::from_f32(x);
            (h.to_f32(), h.to_bits(), |b| bf16::from_bits(b).to_f32())
        }
    };
    if n == x {
        return (x, x);
    }
    // Sign-magnitude: one more in the low bits is one step away from zero. Step away from
    // zero when nearest is below |x|, towards zero otherwise.
    let other = from(if n.abs() < x.abs() {
        bits + 1
    } else {
        bits - 1
    });
    (n.min(other), n.max(other))
}

/// For an fp32 pool: prefill starts from the true state of a slot with a ring, folding its
/// pending entries and dropping its drafts. A few ring decode steps, a verify whose drafts are
/// never accepted, then a prefill, equal eager decode of the same tokens then the same
/// prefill, bit for bit (outputs and state). The prefill leaves the ring empty.
pub fn check_prefill_folds_the_ring_first<B: Backend>(be: &B, case: &Case, seed: u64) {
    check_prefill_folds_the_ring_first_within(be, case, seed, 0.0);
}

/// [`check_prefill_folds_the_ring_first`] with outputs and states equal within `tol`
/// (relative Frobenius; 0: bit for bit), for a prefill that folds the pending entries with
/// arithmetic of its own (the CUDA backend's chunked prefill).
pub fn check_prefill_folds_the_ring_first_within<B: Backend>(
    be: &B,
    case: &Case,
    seed: u64,
    tol: f64,
) {
    let same = |a: &[f32], b: &[f32], what: &str| {
        if tol == 0.0 {
            assert_bits_eq(a, b, what);
        } else {
            let d = rel_frobenius_f32(a, b);
            assert!(d <= tol, "{what}: differ by {d:.3e} > {tol:.0e}");
        }
    };
    let r = case.ring_len;
    let mut rng = StdRng::seed_from_u64(seed);
    let mem = be.memory();
    let (mut ring, mut eager) = ring_and_eager_layers(be, case, &mut rng);
    let n = case.slots.len();
    let ones = bounds_of(&vec![1; n]);
    let params = HostInputs::random(&mut rng, case.dims(), 0, &case.opts, case.input_dtype);
    let fresh = |rng: &mut StdRng, t: usize| {
        HostInputs::random(rng, case.dims(), t, &case.opts, case.input_dtype)
            .with_gate_params(&params.a_log, &params.dt_bias)
    };
    for _ in 0..rng.random_range(0..=2 * r) {
        let inputs = fresh(&mut rng, n);
        let a = run_tokens(
            be,
            &mut ring,
            TokenOp::Decode,
            &ones,
            &case.slots,
            &inputs,
            &case.opts,
        )
        .expect("ring decode");
        let b = run_tokens(
            be,
            &mut eager,
            TokenOp::Decode,
            &ones,
            &case.slots,
            &inputs,
            &case.opts,
        )
        .expect("eager decode");
        assert_bits_eq(&a, &b, "decode outputs");
    }
    let lens: Vec<usize> = (0..n).map(|_| rng.random_range(0..=r)).collect();
    let drafts = fresh(&mut rng, lens.iter().sum());
    run_tokens(
        be,
        &mut ring,
        TokenOp::SpecVerify(&vec![0; n]),
        &bounds_of(&lens),
        &case.slots,
        &drafts,
        &case.opts,
    )
    .expect("a verify whose drafts are dropped");
    let inputs = fresh(&mut rng, case.num_tokens());
    let bounds = case.bounds();
    let a = run_tokens(
        be,
        &mut ring,
        TokenOp::Prefill,
        &bounds,
        &case.slots,
        &inputs,
        &case.opts,
    )
    .expect("prefill after the ring");
    let b = run_tokens(
        be,
        &mut eager,
        TokenOp::Prefill,
        &bounds,
        &case.slots,
        &inputs,
        &case.opts,
    )
    .expect("prefill after eager decode");
    same(&a, &b, "prefill outputs");
    for (i, &s) in case.slots.iter().enumerate() {
        let m = ring.meta(mem, s).expect("meta");
        // A zero-length sequence with nothing pending keeps its state, and loses its drafts.
        assert_eq!(
            (m.len, m.pending),
            (0, 0),
            "prefill leaves slot {s}'s ring empty (sequence {i})"
        );
    }
    let sa = ring.read_states(mem, &case.slots).expect("read");
    let sb = eager.read_states(mem, &case.slots).expect("read");
    same(&sa, &sb, "state after the prefill");
}
