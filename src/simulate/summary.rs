//! The summary of a simulation: what ran, how fast, the pool's counts, the checker's verdicts,
//! as text or JSON (stable field names).

use serde::Serialize;
use state_pool::{AllocStats, Dtype};

use super::checker::Verdict;
use super::engine::EngineStats;

/// The model the simulation ran.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ModelSummary {
    /// Its name.
    pub name: String,
    /// Where it came from.
    pub source: String,
    /// KDA layers.
    pub layers: usize,
    /// q/k heads (per rank).
    pub h: usize,
    /// Value heads (per rank).
    pub hv: usize,
    /// Key head dim.
    pub k: usize,
    /// Value head dim.
    pub v: usize,
    /// State layout.
    pub layout: &'static str,
}

/// Token counts.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TokenCounts {
    /// Prompt tokens prefilled.
    pub prefill: usize,
    /// Prompt tokens restored from prefix checkpoints instead.
    pub restored: usize,
    /// Decode tokens.
    pub decode: usize,
    /// Tokens verified (accepted or not).
    pub verify: usize,
    /// Verify tokens accepted.
    pub accepted: usize,
    /// Tokens the kernels computed: prefill + decode + verify.
    pub computed: usize,
}

/// Slot counts at the end of the run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SlotCounts {
    /// Slots of the pool.
    pub capacity: usize,
    /// The most slots in use at once (the allocator's high-water mark).
    pub high_water: usize,
    /// Slots still in use after every request finished: leaked.
    pub leaked: usize,
}

/// Checkpoint counts.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CheckpointCounts {
    /// Checkpoint slots of the pool.
    pub capacity: usize,
    /// Checkpoints taken at prefix boundaries.
    pub taken: usize,
    /// Requests that restored a prefix instead of prefilling it.
    pub hits: usize,
    /// Requests with a shared prefix that found no checkpoint.
    pub misses: usize,
    /// Checkpoints dropped to make room.
    pub evictions: usize,
    /// Checkpoint slots still in use after the checkpoints were dropped: leaked.
    pub leaked: usize,
}

/// The whole summary (`--json` prints it as is).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    /// Backend name.
    pub backend: String,
    /// The model.
    pub model: ModelSummary,
    /// State dtype of the pool.
    pub state_dtype: Dtype,
    /// Where the state dtype came from.
    pub dtype_source: String,
    /// Element type of the token inputs and outputs (and the ring).
    pub io_dtype: Dtype,
    /// Draft tokens per verify (0: decode).
    pub spec_tokens: usize,
    /// Replay-ring length (0: eager).
    pub ring_len: usize,
    /// Probability of accepting a draft.
    pub accept_rate: f64,
    /// Fraction of requests sharing a prefix.
    pub prefix_share: f64,
    /// Seed.
    pub seed: u64,
    /// Decode and verify steps of at most this many sequences ran through padded batches.
    pub pad_to: Option<usize>,
    /// Steps that did.
    pub padded_steps: usize,
    /// Bytes of the pool (request and checkpoint slots).
    pub pool_bytes: u64,
    /// Requests of the workload.
    pub requests: usize,
    /// Requests that finished.
    pub finished: usize,
    /// Engine steps.
    pub steps: usize,
    /// Tokens.
    pub tokens: TokenCounts,
    /// Wall-clock seconds of the serving loop (not the check).
    pub seconds: f64,
    /// Computed tokens per second of the serving loop.
    pub tokens_per_second: f64,
    /// Request slots.
    pub slots: SlotCounts,
    /// Prefix checkpoints.
    pub checkpoints: CheckpointCounts,
    /// Largest relative error of a request's outputs against the recomputation.
    pub max_output_error: f64,
    /// Largest relative error of a request's final state against the recomputation.
    pub max_state_error: f64,
    /// The thresholds: outputs, final state.
    pub thresholds: [f64; 2],
    /// Requests over a threshold or poisoned.
    pub wrong_requests: Vec<usize>,
    /// Requests whose slot held a non-finite value.
    pub poisoned_requests: Vec<usize>,
    /// Broken admission invariants (see `violation_notes`).
    pub violations: usize,
    /// What they were.
    pub violation_notes: Vec<String>,
    /// Whether everything checked out: every request finished and right, no leak, no
    /// violation.
    pub ok: bool,
}

/// The parts of a summary that come from the run.
pub struct RunOutcome<'a> {
    /// Engine counters.
    pub stats: &'a EngineStats,
    /// Request-slot counts after the run.
    pub slots: AllocStats,
    /// Checkpoint-slot counts after the run.
    pub checkpoints: AllocStats,
    /// The checker's verdicts.
    pub verdicts: &'a [Verdict],
    /// Seconds of the loop.
    pub seconds: f64,
}

/// Fills the counts and verdicts of `summary` from `run`.
pub fn fill(summary: &mut Summary, run: &RunOutcome<'_>) {
    let s = run.stats;
    let computed = s.prefill_tokens + s.decode_tokens + s.verify_tokens;
    summary.finished = run.verdicts.len();
    summary.steps = s.steps;
    summary.padded_steps = s.padded_steps;
    summary.tokens = TokenCounts {
        prefill: s.prefill_tokens,
        restored: s.restored_tokens,
        decode: s.decode_tokens,
        verify: s.verify_tokens,
        accepted: s.accepted_tokens,
        computed,
    };
    summary.seconds = run.seconds;
    summary.tokens_per_second = computed as f64 / run.seconds.max(1e-9);
    summary.slots = SlotCounts {
        capacity: run.slots.capacity,
        high_water: run.slots.high_water,
        leaked: run.slots.in_use,
    };
    summary.checkpoints = CheckpointCounts {
        capacity: run.checkpoints.capacity,
        taken: s.checkpoints_taken,
        hits: s.checkpoint_hits,
        misses: s.checkpoint_misses,
        evictions: s.checkpoint_evictions,
        leaked: run.checkpoints.in_use,
    };
    // NaN errors (non-finite outputs) count as the largest.
    let worst = |f: fn(&Verdict) -> f64| {
        run.verdicts.iter().map(f).fold(0.0f64, |m, e| {
            if e.is_nan() || m.is_nan() {
                f64::NAN
            } else {
                m.max(e)
            }
        })
    };
    summary.max_output_error = worst(|v| v.output_error);
    summary.max_state_error = worst(|v| v.state_error);
    summary.wrong_requests = run
        .verdicts
        .iter()
        .filter(|v| !v.ok)
        .map(|v| v.id)
        .collect();
    summary.wrong_requests.sort_unstable();
    summary.poisoned_requests = run
        .verdicts
        .iter()
        .filter(|v| v.poisoned.is_some())
        .map(|v| v.id)
        .collect();
    summary.poisoned_requests.sort_unstable();
    summary.violations = s.violations;
    summary.violation_notes = s.violation_notes.clone();
    summary.ok = summary.finished == summary.requests
        && summary.wrong_requests.is_empty()
        && summary.slots.leaked == 0
        && summary.checkpoints.leaked == 0
        && summary.violations == 0;
}

impl Summary {
    /// The one-line reason a run failed, or `None` if it is ok.
    pub fn failure(&self) -> Option<String> {
        if self.ok {
            return None;
        }
        let mut why = Vec::new();
        if self.finished != self.requests {
            why.push(format!(
                "{} of {} requests finished",
                self.finished, self.requests
            ));
        }
        if !self.wrong_requests.is_empty() {
            why.push(format!(
                "{} of {} requests wrong (ids {}; largest relative error {:.3e} outputs, {:.3e} state; thresholds {:.0e}, {:.0e}{})",
                self.wrong_requests.len(),
                self.finished,
                list(&self.wrong_requests),
                self.max_output_error,
                self.max_state_error,
                self.thresholds[0],
                self.thresholds[1],
                if self.poisoned_requests.is_empty() {
                    String::new()
                } else {
                    format!("; poisoned: {}", list(&self.poisoned_requests))
                }
            ));
        }
        if self.slots.leaked > 0 || self.checkpoints.leaked > 0 {
            why.push(format!(
                "slots leaked: {} request, {} checkpoint",
                self.slots.leaked, self.checkpoints.leaked
            ));
        }
        if self.violations > 0 {
            why.push(format!(
                "{} admission violations ({})",
                self.violations,
                self.violation_notes.first().map_or("", String::as_str)
            ));
        }
        Some(format!("simulate failed: {}", why.join("; ")))
    }

    /// The text report.
    pub fn render_text(&self) -> String {
        let m = &self.model;
        let t = &self.tokens;
        let c = &self.checkpoints;
        let mode = if self.spec_tokens > 0 {
            format!(
                "speculative verify of {} + 1 tokens, accept rate {}",
                self.spec_tokens, self.accept_rate
            )
        } else {
            "decode".to_string()
        };
        let ring = if self.ring_len > 0 {
            format!("replay ring of {} tokens", self.ring_len)
        } else {
            "eager (no ring)".to_string()
        };
        let mut s = String::new();
        let mut line = |l: String| {
            s.push_str(&l);
            s.push('\n');
        };
        line(format!(
            "model        {} ({}): {} KDA layers, H={} HV={} K={} V={}, {}",
            m.name, m.source, m.layers, m.h, m.hv, m.k, m.v, m.layout
        ));
        line(format!(
            "pool         {} state ({}), {} inputs, {}, {}; {:.2} MB",
            self.state_dtype,
            self.dtype_source,
            self.io_dtype,
            ring,
            mode,
            self.pool_bytes as f64 / 1e6
        ));
        line(format!(
            "requests     {} finished of {} in {} steps (backend {}, seed {})",
            self.finished, self.requests, self.steps, self.backend, self.seed
        ));
        line(format!(
            "tokens       {} computed: {} prefill, {} decode, {} verify ({} accepted); {} restored from checkpoints",
            t.computed, t.prefill, t.decode, t.verify, t.accepted, t.restored
        ));
        if let Some(n) = self.pad_to {
            line(format!(
                "padded       {} decode or verify steps through padded batches of {n} sequences",
                self.padded_steps
            ));
        }
        line(format!(
            "throughput   {:.0} tokens/s ({:.3} s)",
            self.tokens_per_second, self.seconds
        ));
        line(format!(
            "slots        high water {} of {}, leaked {}",
            self.slots.high_water, self.slots.capacity, self.slots.leaked
        ));
        line(format!(
            "checkpoints  {} hits, {} misses, {} taken, {} evicted, {} slots, leaked {} (prefix share {})",
            c.hits, c.misses, c.taken, c.evictions, c.capacity, c.leaked, self.prefix_share
        ));
        line(format!(
            "max error    {:.3e} outputs, {:.3e} final state (relative, against an fp32 recomputation of each request alone; thresholds {:.0e}, {:.0e})",
            self.max_output_error, self.max_state_error, self.thresholds[0], self.thresholds[1]
        ));
        if !self.poisoned_requests.is_empty() {
            line(format!(
                "poisoned     requests {}",
                list(&self.poisoned_requests)
            ));
        }
        line(match self.failure() {
            None => "result       ok".to_string(),
            Some(why) => format!("result       {why}"),
        });
        s
    }
}

fn list(ids: &[usize]) -> String {
    let shown: Vec<String> = ids.iter().take(12).map(usize::to_string).collect();
    if ids.len() > 12 {
        format!("{}, ...", shown.join(", "))
    } else {
        shown.join(", ")
    }
}
