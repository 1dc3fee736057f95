//! The workload: requests with mixed prompt and generation lengths, shared prefixes, and the
//! inputs of every token, a pure function of (seed, layer, request, position) so that a
//! request can be recomputed alone.
//!
//! A token's inputs come from a generator seeded by a hash of its key:
//! - an accepted token at position `p` of request `r`: the key `(prefix owner, p)` when `p`
//!   lies inside a shared prefix, else `(r, p)`;
//! - a draft that the verify will reject: `(r, p, round)`, so a rejected draft differs from the
//!   token that is finally accepted at that position (a ring that kept a rejected draft would
//!   show in the outputs).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::inputs::{Dims, GateParams, Tokens};

/// A shared prefix: the first `len` tokens of request `owner`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefix {
    /// The request the prefix is taken from (its tokens key the prefix's inputs).
    pub owner: usize,
    /// Prefix length in tokens (the checkpoint boundary).
    pub len: usize,
}

/// One request of the workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Its index in arrival order.
    pub id: usize,
    /// Prompt tokens (prefilled in chunks).
    pub prompt_len: usize,
    /// Tokens generated after the prompt (decode steps or accepted verify tokens).
    pub gen_len: usize,
    /// The prefix it shares with an earlier request (its owner included), if any.
    pub prefix: Option<Prefix>,
}

impl Request {
    /// All tokens of the request: prompt then generated.
    pub fn total_len(&self) -> usize {
        self.prompt_len + self.gen_len
    }
}

/// How the workload is drawn.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadSpec {
    /// Number of requests.
    pub requests: usize,
    /// Longest prompt (prompts are uniform in `1..=max_prompt`).
    pub max_prompt: usize,
    /// Longest generation (uniform in `1..=max_new`).
    pub max_new: usize,
    /// Fraction of requests that share a prefix with an earlier request.
    pub prefix_share: f64,
    /// Seed of the lengths, the prefixes and every token's inputs.
    pub seed: u64,
}

/// Independent random streams, mixed into every key.
#[derive(Debug, Clone, Copy)]
enum Stream {
    Lengths = 1,
    Accepted = 2,
    GateParams = 3,
    Token = 4,
    Draft = 5,
}

/// SplitMix64's finaliser: a bijective mix of 64 bits.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A generator keyed by the seed, a stream and up to four numbers.
fn keyed_rng(seed: u64, stream: Stream, key: [u64; 4]) -> StdRng {
    let mut h = mix(seed ^ mix(stream as u64));
    for k in key {
        h = mix(h ^ k.wrapping_add(0x9e37_79b9_7f4a_7c15));
    }
    StdRng::seed_from_u64(h)
}

/// Draws the requests: lengths, then with probability `prefix_share` a prefix shared with a
/// random earlier request (joining its prefix if it already has one, else a new prefix of a
/// random length inside its prompt). A request that shares a prefix has a prompt at least
/// as long as the prefix.
pub fn draw_requests(spec: &WorkloadSpec) -> Vec<Request> {
    let mut rng = keyed_rng(spec.seed, Stream::Lengths, [0; 4]);
    let mut out: Vec<Request> = Vec::with_capacity(spec.requests);
    for id in 0..spec.requests {
        let mut prompt_len = rng.random_range(1..=spec.max_prompt);
        let gen_len = rng.random_range(1..=spec.max_new);
        let mut prefix = None;
        if id > 0 && rng.random_bool(spec.prefix_share) {
            let earlier = rng.random_range(0..id);
            let p = match out[earlier].prefix {
                Some(p) => p,
                None => {
                    let len = rng.random_range(1..=out[earlier].prompt_len);
                    let p = Prefix {
                        owner: earlier,
                        len,
                    };
                    out[earlier].prefix = Some(p);
                    p
                }
            };
            prompt_len = prompt_len.max(p.len);
            prefix = Some(p);
        }
        out.push(Request {
            id,
            prompt_len,
            gen_len,
            prefix,
        });
    }
    out
}

/// The token inputs of the workload (pure functions of the seed and the keys).
#[derive(Debug, Clone, Copy)]
pub struct InputSource {
    /// The head shape.
    pub dims: Dims,
    /// The seed.
    pub seed: u64,
    /// A request whose inputs carry a NaN (fault injection), and at which position.
    pub poison: Option<(usize, usize)>,
}

impl InputSource {
    /// The gate parameters of layer `layer`.
    pub fn gate_params(&self, layer: usize) -> GateParams {
        GateParams::draw(
            &mut keyed_rng(self.seed, Stream::GateParams, [layer as u64, 0, 0, 0]),
            self.dims,
        )
    }

    /// The inputs of the accepted token at `position` of `req` in `layer`.
    pub fn token(&self, req: &Request, position: usize, layer: usize) -> Tokens {
        let source = match req.prefix {
            Some(p) if position < p.len => p.owner,
            _ => req.id,
        };
        let key = [layer as u64, source as u64, position as u64, 0];
        let mut t = Tokens::draw(&mut keyed_rng(self.seed, Stream::Token, key), self.dims, 1);
        if self.poison == Some((req.id, position)) {
            t.v[0] = f32::NAN;
        }
        t
    }

    /// The inputs of a draft at `position` of `req` that verify round `round` rejects.
    pub fn rejected_draft(
        &self,
        req: &Request,
        position: usize,
        round: usize,
        layer: usize,
    ) -> Tokens {
        let key = [
            layer as u64,
            req.id as u64,
            position as u64,
            round as u64 + 1,
        ];
        Tokens::draw(&mut keyed_rng(self.seed, Stream::Draft, key), self.dims, 1)
    }
}

/// The accepted count of verify round `round` of request `req` with `len` tokens: the first
/// token (the one the target model sampled) is always accepted, each following draft with
/// probability `rate` while all before it were.
pub fn accepted_count(seed: u64, req: usize, round: usize, len: usize, rate: f64) -> usize {
    let mut rng = keyed_rng(seed, Stream::Accepted, [req as u64, round as u64, 0, 0]);
    let mut a = 1;
    while a < len && rng.random_bool(rate) {
        a += 1;
    }
    a.min(len)
}

/// Appends the tokens of `more` to `all`.
pub fn append(all: &mut Tokens, more: &Tokens) {
    all.q.extend_from_slice(&more.q);
    all.k.extend_from_slice(&more.k);
    all.v.extend_from_slice(&more.v);
    all.g.extend_from_slice(&more.g);
    all.beta.extend_from_slice(&more.beta);
    all.len += more.len;
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIMS: Dims = Dims {
        h: 2,
        hv: 4,
        k: 8,
        v: 8,
    };

    fn spec(prefix_share: f64) -> WorkloadSpec {
        WorkloadSpec {
            requests: 200,
            max_prompt: 40,
            max_new: 10,
            prefix_share,
            seed: 9,
        }
    }

    #[test]
    fn requests_are_deterministic_and_within_bounds() {
        let a = draw_requests(&spec(0.3));
        assert_eq!(a, draw_requests(&spec(0.3)));
        assert_ne!(
            a,
            draw_requests(&WorkloadSpec {
                seed: 10,
                ..spec(0.3)
            })
        );
        for r in &a {
            assert!((1..=10).contains(&r.gen_len), "{r:?}");
            if let Some(p) = r.prefix {
                assert!(p.len >= 1 && r.prompt_len >= p.len, "{r:?}");
                assert!(p.owner <= r.id);
                assert_eq!(a[p.owner].prefix, Some(p), "the owner carries its prefix");
            } else {
                assert!((1..=40).contains(&r.prompt_len), "{r:?}");
            }
        }
        let sharing = a
            .iter()
            .filter(|r| r.prefix.is_some_and(|p| p.owner != r.id))
            .count();
        assert!(
            (35..=85).contains(&sharing),
            "{sharing} of 200 share at 0.3"
        );
        assert!(draw_requests(&spec(0.0)).iter().all(|r| r.prefix.is_none()));
    }

    #[test]
    fn token_inputs_depend_on_their_key_only() {
        let src = InputSource {
            dims: DIMS,
            seed: 4,
            poison: None,
        };
        let reqs = draw_requests(&spec(0.5));
        let joiner = reqs
            .iter()
            .find(|r| r.prefix.is_some_and(|p| p.owner != r.id && p.len >= 2))
            .unwrap();
        let p = joiner.prefix.unwrap();
        let owner = &reqs[p.owner];
        // Inside the prefix: the owner's tokens; after it: the request's own.
        assert_eq!(
            src.token(joiner, p.len - 1, 1).k,
            src.token(owner, p.len - 1, 1).k
        );
        assert_ne!(src.token(joiner, p.len, 1).k, src.token(owner, p.len, 1).k);
        assert_ne!(
            src.token(joiner, 0, 0).v,
            src.token(joiner, 0, 1).v,
            "layers differ"
        );
        assert_eq!(src.token(joiner, 3, 0).g, src.token(joiner, 3, 0).g);
        let draft = src.rejected_draft(joiner, 3, 0, 0);
        assert_ne!(draft.k, src.token(joiner, 3, 0).k);
        assert_ne!(draft.k, src.rejected_draft(joiner, 3, 1, 0).k);
        let t = src.token(joiner, 0, 0);
        assert_eq!((t.len, t.q.len(), t.v.len(), t.beta.len()), (1, 16, 32, 4));
        let poisoned = InputSource {
            poison: Some((joiner.id, 5)),
            ..src
        };
        assert!(poisoned.token(joiner, 5, 1).v[0].is_nan());
        assert_eq!(poisoned.token(joiner, 4, 1).v, src.token(joiner, 4, 1).v);
    }

    #[test]
    fn accepted_counts_follow_the_rate() {
        let mean = |rate| {
            (0..2000)
                .map(|r| accepted_count(1, r, 0, 5, rate) as f64)
                .sum::<f64>()
                / 2000.0
        };
        assert_eq!(mean(0.0), 1.0);
        assert_eq!(mean(1.0), 5.0);
        // 1 + p + p^2 + p^3 + p^4 at p = 0.5 is 1.9375.
        assert!((mean(0.5) - 1.9375).abs() < 0.1, "{}", mean(0.5));
        assert_eq!(accepted_count(1, 0, 0, 1, 1.0), 1);
    }
}
