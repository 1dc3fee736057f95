//! The padded batch ([`Backend::prepare_padded`], [`Backend::update_batch`]) against plain
//! batches of its live sequences, one body for every backend.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use state_pool::{DeviceMemory, Dtype};

use super::checks::{assert_bits_eq, twin_layers};
use super::data::{batch_plan, Case, HostInputs};
use super::layer::{run_tokens, upload_bytes, DeviceInputs, TestLayer, TokenOp};
use crate::api::{Backend, Buf, IndexView, TensorViewMut};
use crate::cpu::validate::PADDED_EPOCH_STEP;

/// Random distinct slots of `0..pool`, `n` of them.
pub fn random_slots(rng: &mut StdRng, pool: usize, n: usize) -> Vec<u32> {
    let mut all: Vec<u32> = (0..pool as u32).collect();
    for i in 0..n {
        let j = rng.random_range(i..pool);
        all.swap(i, j);
    }
    all.truncate(n);
    all
}

/// Asserts that two layers agree on every slot: the bits of the states, the ring records and
/// the ring entries each record keeps.
pub fn assert_layers_agree<B: Backend>(
    be: &B,
    a: &TestLayer<Buf<B>>,
    b: &TestLayer<Buf<B>>,
    what: &str,
) {
    let mem = be.memory();
    let g = &a.geometry;
    let every: Vec<u32> = (0..g.total_slots() as u32).collect();
    let sa = a.read_states(mem, &every).expect("read");
    let sb = b.read_states(mem, &every).expect("read");
    assert_bits_eq(&sa, &sb, &format!("{what}: states"));
    let entry = g.ring_entry_elems() * g.ring_dtype.size();
    for &s in &every {
        let (ma, mb) = (a.meta(mem, s).expect("meta"), b.meta(mem, s).expect("meta"));
        assert_eq!(ma, mb, "{what}: ring record of slot {s}");
        let len = ma.len as usize * entry;
        let at = s as usize * g.ring_len * entry;
        let (mut ra, mut rb) = (vec![0u8; len], vec![0u8; len]);
        mem.read(&a.planes.ring, at, &mut ra).expect("ring");
        mem.read(&b.planes.ring, at, &mut rb).expect("ring");
        assert!(ra == rb, "{what}: ring entries of slot {s}");
    }
}

/// The operation [`check_padded_batch_matches_plain_batches`] runs through a padded batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PaddedOp {
    /// [`Backend::decode`] (one token per sequence).
    Decode,
    /// [`Backend::spec_verify`], the accepted drafts drawn per slot.
    SpecVerify,
    /// [`Backend::prefill`].
    Prefill,
}

/// A padded batch of `cap` sequences of `t` tokens against plain batches of its live
/// sequences, step by step on twin layers of `case`'s geometry (its pool's slots all hold
/// random states): each step draws the live count from `lives`, that many distinct random
/// slots and fresh inputs for the padded size, updates the batch, and runs `op` (decode: `t` =
/// 1; spec_verify: `t` tokens, accepted drafts drawn per slot; prefill: `t` tokens) through it
/// on one twin and through a plain batch of the live sequences and their tokens on the other.
/// Asserts the live outputs equal bit for bit, the padding's outputs untouched (still the
/// poison), and every slot's state, ring record and ring entries equal. With stochastic
/// rounding the plain call rounds at the epoch the padded one drew from (its layer's plus the
/// batch's offset, [`crate::cpu::validate::PaddedShape::epoch_offset`]). Also asserts the
/// refusals: an update of too many, out-of-range or repeated slots changes nothing; a batch
/// of `prepare` takes no update; a pool of fewer slots than the bound is refused.
pub fn check_padded_batch_matches_plain_batches<B: Backend>(
    be: &B,
    case: &Case,
    cap: usize,
    t: usize,
    op: PaddedOp,
    lives: &[usize],
    seed: u64,
) {
    let spec = op == PaddedOp::SpecVerify;
    let mem = be.memory();
    let g = case.geometry();
    let pool = g.total_slots();
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut padded, mut plain) = twin_layers(be, case, case, &mut rng);
    let bounds: Vec<usize> = (0..=cap).map(|i| i * t).collect();
    let first: Vec<u32> = (0..cap as u32).collect();
    let mut batch = be
        .prepare_padded(batch_plan(&bounds, &first).unwrap(), pool)
        .expect("padded batch");
    let params = HostInputs::random(&mut rng, case.dims(), 1, &case.opts, case.input_dtype);
    let out_len = cap * t * g.hv * g.v;
    let out_bytes = out_len * case.input_dtype.size();
    let mut out_buf = upload_bytes(mem, &vec![0xff; out_bytes]).expect("output");
    let mut acc_buf = upload_bytes(mem, &vec![0u8; cap * 4]).expect("accepted");
    for (step, &live) in lives.iter().enumerate() {
        let what = format!("{}: step {step}, {live} of {cap} live", be.name());
        let slots = random_slots(&mut rng, pool, live);
        let mut acc = vec![0u32; cap];
        if spec {
            for (a, &s) in acc.iter_mut().zip(&slots) {
                *a = rng.random_range(0..=padded.meta(mem, s).unwrap().drafts());
            }
        }
        mem.write(&mut acc_buf, 0, bytemuck::cast_slice(&acc))
            .expect("accepted");
        let host = HostInputs::random(&mut rng, case.dims(), cap * t, &case.opts, case.input_dtype)
            .with_gate_params(&params.a_log, &params.dt_bias);
        let dev = DeviceInputs::upload(mem, &host, &case.opts).expect("inputs");
        mem.write(&mut out_buf, 0, &vec![0xff; out_bytes])
            .expect("poison");
        be.update_batch(&mut batch, &slots).expect("update");
        assert_eq!(batch.as_ref().slots, slots, "{what}: the live plan");
        let mut out = TensorViewMut {
            buf: &mut out_buf,
            dtype: case.input_dtype,
            len: out_len,
        };
        let accepted = IndexView {
            buf: &acc_buf,
            len: cap,
        };
        let epoch_before = padded.epoch();
        let (inp, opts, layer) = (&dev.view(), &case.opts, &mut padded.view());
        let r = match op {
            PaddedOp::SpecVerify => be.spec_verify(&batch, &accepted, inp, opts, layer, &mut out),
            PaddedOp::Decode => be.decode(&batch, inp, opts, layer, &mut out),
            PaddedOp::Prefill => be.prefill(&batch, inp, opts, layer, &mut out),
        };
        r.unwrap_or_else(|e| panic!("{what}: the padded call: {e}"));
        let got = live_output(
            mem,
            &out_buf,
            case.input_dtype,
            live * t * g.hv * g.v,
            &what,
        );
        if live > 0 {
            // stochastic rounding: the padded call drew from its layer's epoch plus the batch's
            // offset after `step + 1` updates; the plain call draws from the same
            let offset = (step as u32 + 1).wrapping_mul(PADDED_EPOCH_STEP);
            *plain.view().epoch = u64::from((epoch_before as u32).wrapping_add(offset));
            let tokens: Vec<usize> = (0..live * t).collect();
            let op = match op {
                PaddedOp::SpecVerify => TokenOp::SpecVerify(&acc[..live]),
                PaddedOp::Decode => TokenOp::Decode,
                PaddedOp::Prefill => TokenOp::Prefill,
            };
            let want = run_tokens(
                be,
                &mut plain,
                op,
                &bounds[..=live],
                &slots,
                &host.gather(&tokens),
                &case.opts,
            )
            .unwrap_or_else(|e| panic!("{what}: the plain call: {e}"));
            assert_bits_eq(&got, &want, &format!("{what}: outputs"));
        }
        assert_layers_agree(be, &padded, &plain, &what);
    }
    check_padded_refusals(be, case, &mut batch, &mut padded, cap, t);
}

/// A padded call's output: asserts that every byte after its first `live` elements still holds
/// the poison (0xff: the padding's outputs are not written) and returns those elements.
pub fn live_output<M: DeviceMemory>(
    mem: &M,
    buf: &M::Buffer,
    dtype: Dtype,
    live: usize,
    what: &str,
) -> Vec<f32> {
    let mut bytes = vec![0u8; mem.len(buf)];
    mem.read(buf, 0, &mut bytes).expect("output");
    let split = live * dtype.size();
    assert!(
        bytes[split..].iter().all(|&b| b == 0xff),
        "{what}: an output of the padding was written"
    );
    dtype.decode_f32(&bytes[..split])
}

/// The refusals of padded batches (see [`check_padded_batch_matches_plain_batches`]).
fn check_padded_refusals<B: Backend>(
    be: &B,
    case: &Case,
    batch: &mut B::Batch,
    layer: &mut TestLayer<Buf<B>>,
    cap: usize,
    t: usize,
) {
    let pool = case.geometry().total_slots();
    let refused = |r: crate::Result<()>, arg: &str, needle: &str| match r {
        Err(crate::KernelError::InvalidArgument { arg: a, msg }) => {
            assert_eq!(a, arg, "refused, but naming {a} ({msg})");
            assert!(msg.contains(needle), "{msg:?} does not say {needle:?}");
        }
        other => panic!("expected an error naming {arg} ({needle}), got {other:?}"),
    };
    let before = batch.as_ref().clone();
    let too_many: Vec<u32> = (0..=cap as u32).collect();
    refused(be.update_batch(batch, &too_many), "slots", "at most");
    refused(
        be.update_batch(batch, &[pool as u32]),
        "slots",
        "out of range",
    );
    refused(be.update_batch(batch, &[1, 1]), "slots", "twice");
    assert_eq!(
        *batch.as_ref(),
        before,
        "a refused update changed the batch"
    );
    let bounds: Vec<usize> = (0..=cap).map(|i| i * t).collect();
    let first: Vec<u32> = (0..cap as u32).collect();
    let plan = batch_plan(&bounds, &first).unwrap();
    let mut fixed = be.prepare(plan.clone()).expect("batch");
    refused(be.update_batch(&mut fixed, &[0]), "batch", "prepare_padded");
    refused(
        be.prepare_padded(batch_plan(&[0], &[]).unwrap(), pool)
            .map(|_| ()),
        "slots",
        "at least one sequence",
    );
    refused(
        be.prepare_padded(plan.clone(), cap - 1).map(|_| ()),
        "slots",
        "out of range",
    );
    // a batch bound above the layer's pool
    let wide = be.prepare_padded(plan, pool + 1).expect("padded batch");
    let host = HostInputs::random(
        &mut StdRng::seed_from_u64(7),
        case.dims(),
        cap * t,
        &case.opts,
        case.input_dtype,
    );
    let dev = DeviceInputs::upload(be.memory(), &host, &case.opts).expect("inputs");
    let g = case.geometry();
    let len = cap * t * g.hv * g.v;
    let mut out_buf =
        upload_bytes(be.memory(), &vec![0xff; len * case.input_dtype.size()]).expect("output");
    let mut out = TensorViewMut {
        buf: &mut out_buf,
        dtype: case.input_dtype,
        len,
    };
    let snap = layer.snapshot(be.memory()).expect("snapshot");
    refused(
        be.decode(&wide, &dev.view(), &case.opts, &mut layer.view(), &mut out),
        "batch",
        "slots below",
    );
    assert!(
        snap == layer.snapshot(be.memory()).expect("snapshot"),
        "a refused call changed the pool"
    );
}
