//! A NaN or an infinity in one request's inputs: that request's slot is reported poisoned
//! (`StatePool::find_nonfinite`), and every other slot ends byte-identical to a run without
//! the fault, its outputs too.
//!
//! Three requests share each batch (prefill, decode through the replay ring, two speculative
//! verifies, the final flush); the middle one gets the bad value in one tensor at one token.

mod fault_kit;

use fault_kit::{plan, slot_bytes, Op, Rig, Tokens};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use state_pool::{Dtype, Plane};

/// Which input tensor gets the bad value.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Tensor {
    Q,
    K,
    V,
    G,
    Beta,
}

/// Where the bad value goes: the tensor, the value, and the token of request B (0..9 in the
/// prefill, 9..11 the decodes, 11..14 the first verify, 14..16 the second).
#[derive(Debug, Clone, Copy)]
struct Fault {
    tensor: Tensor,
    value: f32,
    token: usize,
}

const LENS: [usize; 3] = [7, 9, 5];
const SLOTS: [u32; 3] = [2, 0, 1];

/// Each request's tokens: prefill, 2 decodes, a verify of 3, a verify of 2.
fn request_tokens(rng: &mut StdRng, g: &state_pool::PoolGeometry) -> Vec<Tokens> {
    LENS.iter()
        .map(|&l| Tokens::random(rng, g, l + 2 + 3 + 2))
        .collect()
}

fn slice(t: &Tokens, range: std::ops::Range<usize>, g: &state_pool::PoolGeometry) -> Tokens {
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

/// Serves the three requests; returns each request's outputs over all calls and layers.
fn serve(seed: u64, fault: Option<Fault>) -> (Rig, Vec<Vec<f32>>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let g = fault_kit::geometry(Dtype::Fp16, 6, 3);
    let mut rig = Rig::new(g.clone(), &mut rng);
    let mut toks = request_tokens(&mut rng, &g);
    if let Some(f) = fault {
        let b = &mut toks[1];
        let (x, per) = match f.tensor {
            Tensor::Q => (&mut b.q, g.h * g.k),
            Tensor::K => (&mut b.k, g.h * g.k),
            Tensor::V => (&mut b.v, g.hv * g.v),
            Tensor::G => (&mut b.g, g.hv * g.k),
            Tensor::Beta => (&mut b.beta, g.hv),
        };
        x[f.token * per + rng.random_range(0..per)] = f.value;
    }
    let handles: Vec<_> = (0..3).map(|_| rig.pool.allocate().unwrap()).collect();
    assert_eq!(handles.len(), 3);
    let mut outs = vec![Vec::new(); 3];
    let mut at = [0usize; 3];
    // (op, tokens per request, accepted counts)
    let steps: [(Op, [usize; 3], [u32; 3]); 5] = [
        (Op::Prefill, LENS, [0; 3]),
        (Op::Decode, [1; 3], [0; 3]),
        (Op::Decode, [1; 3], [0; 3]),
        (Op::Verify, [3; 3], [0; 3]),
        (Op::Verify, [2; 3], [2, 3, 3]),
    ];
    for (op, lens, accepted) in steps {
        let parts: Vec<Tokens> = (0..3)
            .map(|r| slice(&toks[r], at[r]..at[r] + lens[r], &g))
            .collect();
        let all = Tokens::concat(&parts.iter().collect::<Vec<_>>());
        let p = plan(&lens, &SLOTS);
        let per_layer = rig.run(op, &p, &all, &accepted).unwrap();
        for layer_out in per_layer {
            let mut from = 0;
            for r in 0..3 {
                let n = lens[r] * g.hv * g.v;
                outs[r].extend_from_slice(&layer_out[from..from + n]);
                from += n;
            }
        }
        for r in 0..3 {
            at[r] += lens[r];
        }
    }
    // B accepts the first draft of the last verify and drops the second (token 15).
    rig.replay(&SLOTS, Some(&[1, 1, 0])).unwrap();
    // The handles stay with the rig's pool until the end of the test.
    std::mem::forget(handles);
    (rig, outs)
}

fn check(fault: Fault, poisons_state: bool) {
    let seed = 77;
    let (clean, clean_out) = serve(seed, None);
    let (bad, bad_out) = serve(seed, Some(fault));
    let what = format!("{fault:?}");
    for r in [0, 2] {
        let slot = SLOTS[r] as usize;
        assert_eq!(clean.pool.find_nonfinite(slot).unwrap(), None, "{what}");
        assert_eq!(
            bad.pool.find_nonfinite(slot).unwrap(),
            None,
            "{what}: request {r}"
        );
        assert!(
            slot_bytes(&bad.pool, slot) == slot_bytes(&clean.pool, slot),
            "{what}: request {r}'s slot changed"
        );
        assert!(
            bad_out[r]
                .iter()
                .zip(&clean_out[r])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: request {r}'s outputs changed"
        );
    }
    let b = SLOTS[1] as usize;
    assert_eq!(clean.pool.find_nonfinite(b).unwrap(), None);
    let found = bad.pool.find_nonfinite(b).unwrap();
    if poisons_state {
        let nf = found.unwrap_or_else(|| panic!("{what}: slot {b} not reported poisoned"));
        assert!(!nf.value.is_finite());
        assert!(matches!(nf.plane, Plane::Ssm | Plane::Ring), "{nf:?}");
    } else {
        assert_eq!(found, None, "{what}");
    }
    // Every output of B from the bad token on is affected; the ones before are not.
    let per = 4 * 8;
    let first_bad = bad_out[1]
        .chunks(per)
        .position(|o| o.iter().any(|x| !x.is_finite()));
    assert!(
        first_bad.is_some(),
        "{what}: no output of request B shows the fault"
    );
}

#[test]
fn nan_in_v_k_g_or_beta_poisons_only_that_slot_at_any_stage() {
    let cases = [
        (Tensor::V, 3), // prefill
        (Tensor::K, 8), // last prefill token
        (Tensor::G, 9), // first decode: lands in the ring, not the state
        (Tensor::Beta, 10),
        (Tensor::V, 12), // first verify (a draft accepted by the second)
        (Tensor::K, 14), // second verify, accepted by the flush
    ];
    for (tensor, token) in cases {
        check(
            Fault {
                tensor,
                value: f32::NAN,
                token,
            },
            true,
        );
    }
}

#[test]
fn infinity_in_v_poisons_only_that_slot() {
    for (value, token) in [
        (f32::INFINITY, 2),
        (f32::NEG_INFINITY, 9),
        (f32::INFINITY, 14),
    ] {
        check(
            Fault {
                tensor: Tensor::V,
                value,
                token,
            },
            true,
        );
    }
}

#[test]
fn nan_in_q_spoils_the_outputs_but_not_the_state() {
    // q only reads the state out: the outputs of that token are NaN, the state stays finite.
    check(
        Fault {
            tensor: Tensor::Q,
            value: f32::NAN,
            token: 4,
        },
        false,
    );
}

#[test]
fn nan_in_a_rejected_draft_is_dropped_with_it() {
    // Token 15 is the last verify's second draft, which the flush rejects: its outputs show
    // the NaN, the state never sees it.
    check(
        Fault {
            tensor: Tensor::V,
            value: f32::NAN,
            token: 15,
        },
        false,
    );
}
