//! The serving loop: what an engine does with the pool and the kernels, step by step.
//!
//! Each step:
//! 1. **Admission.** Waiting requests take slots in arrival order until the pool is full
//!    ([`PoolError::Exhausted`]: the rest keep waiting). A request whose shared prefix has a
//!    checkpoint restores it into its fresh slot instead of prefilling the prefix (a hit).
//! 2. **Chunked prefill.** Every request still in its prompt prefills its next chunk (at most
//!    `chunk` tokens; a request that will checkpoint its prefix stops its chunk at the prefix
//!    boundary), all of them in one varlen batch per layer. A request that reaches its prefix
//!    boundary and finds no checkpoint flushes its slot (replay) and checkpoints it.
//! 3. **Decode or verify.** Every request past its prompt (and not prefilled in this step)
//!    runs one decode token, or with speculative decoding one verify of up to `spec_tokens + 1`
//!    tokens, giving the kernels the accepted count of its previous verify.
//! 4. **Completion.** Finished requests are flushed (replay with their last accepted count),
//!    scanned for non-finite values, their final states read, and their slots released.
//!
//! Every output the kernels write lands in the request's [`Record`], for the checker.

use std::collections::{HashMap, VecDeque};

use kda_kernels::api::Buf;
use kda_kernels::{Backend, BatchPlan, CuSeqlens, IndexView, KdaOptions, KernelError};
use state_pool::{
    AllocStats, DeviceMemory, Dtype, NonFinite, Plane, PoolError, PoolGeometry, SlotHandle,
    StatePool,
};

use super::workload::{accepted_count, append, InputSource, Request};
use crate::harness::{DeviceInputs, DeviceParams, DeviceTensor};
use crate::inputs::Tokens;

/// A failure of the loop: which step and operation, and the error.
#[derive(Debug, thiserror::Error)]
#[error("step {step}: {what}: {msg}")]
pub struct EngineError {
    /// The step it happened in.
    pub step: usize,
    /// The operation (e.g. `prefill of layer 1`).
    pub what: String,
    /// The underlying error.
    pub msg: String,
}

/// The engine's settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Prompt tokens one request prefills per step at most.
    pub chunk: usize,
    /// Draft tokens per verify (0: plain decode).
    pub spec_tokens: usize,
    /// Probability that a draft is accepted, given that the drafts before it were.
    pub accept_rate: f64,
    /// Element type of the token inputs and outputs (and of the ring).
    pub io_dtype: Dtype,
    /// The layer options (gate and beta activated in the kernel, q/k l2norm).
    pub opts: KdaOptions,
    /// Seed of the accepted counts.
    pub seed: u64,
    /// Decode and verify steps of at most this many sequences, all of one length, run through
    /// one padded batch per length ([`Backend::prepare_padded`], updated with the step's
    /// slots), as an engine that replays CUDA graphs of fixed sizes does: the tensors at the
    /// padded size, the padding's inputs NaN. `None`: a batch prepared per step.
    pub pad_to: Option<usize>,
}

/// Everything the engine observed about one finished request.
#[derive(Debug, Clone)]
pub struct Record {
    /// The request.
    pub request: Request,
    /// Per layer, the outputs `[total_len, HV, V]` as f32; NaN where none was produced
    /// (positions restored from a checkpoint, drafts that were rejected).
    pub outputs: Vec<Vec<f32>>,
    /// Per position, whether its output was produced.
    pub produced: Vec<bool>,
    /// Per layer, the final state after the flush, as f32 in the pool's layout.
    pub final_state: Vec<Vec<f32>>,
    /// The first non-finite value of the slot after the flush, if any.
    pub poisoned: Option<NonFinite>,
    /// Prompt tokens restored from a checkpoint instead of prefilled.
    pub restored: usize,
}

/// Counters of a run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct EngineStats {
    /// Engine steps.
    pub steps: usize,
    /// Prompt tokens prefilled.
    pub prefill_tokens: usize,
    /// Prefill chunks (sequences of prefill batches).
    pub prefill_chunks: usize,
    /// Decode tokens.
    pub decode_tokens: usize,
    /// Tokens sent to verify (accepted or not).
    pub verify_tokens: usize,
    /// Verify tokens accepted.
    pub accepted_tokens: usize,
    /// Verify calls' sequences (verify rounds).
    pub verify_rounds: usize,
    /// Checkpoints taken at prefix boundaries.
    pub checkpoints_taken: usize,
    /// Admissions that restored a prefix checkpoint.
    pub checkpoint_hits: usize,
    /// Admissions of a request with a shared prefix that found no checkpoint.
    pub checkpoint_misses: usize,
    /// Checkpoints dropped to make room for a new one.
    pub checkpoint_evictions: usize,
    /// Prompt tokens not prefilled thanks to restores.
    pub restored_tokens: usize,
    /// The most requests running at once.
    pub max_running: usize,
    /// The most requests waiting at once.
    pub max_waiting: usize,
    /// Steps at which a request waited because every slot was in use.
    pub steps_pool_full: usize,
    /// Broken admission invariants (more running requests than slots, or allocator counts
    /// that disagree with the running requests); each is described in `violation_notes`.
    pub violations: usize,
    /// Descriptions of the first violations.
    pub violation_notes: Vec<String>,
    /// Decode and verify steps run through a padded batch ([`EngineConfig::pad_to`]).
    pub padded_steps: usize,
}

struct Running {
    /// Index into the requests.
    req: usize,
    slot: SlotHandle,
    /// Tokens in the sequence so far (prompt prefilled or restored, then accepted tokens).
    committed: usize,
    /// Verify rounds so far.
    round: usize,
    /// The accepted count of the previous verify, given to the next call.
    pending_accept: u32,
    /// Prompt tokens restored from a checkpoint.
    restored: usize,
    outputs: Vec<Vec<f32>>,
    produced: Vec<bool>,
}

struct Checkpoint {
    handle: SlotHandle,
    last_used: usize,
}

/// The engine: a pool, a backend, the workload and the queues.
pub struct Engine<'a, B: Backend> {
    backend: &'a B,
    pool: StatePool<B::Memory>,
    config: EngineConfig,
    inputs: InputSource,
    requests: &'a [Request],
    params: Vec<DeviceParams<B>>,
    waiting: VecDeque<usize>,
    running: Vec<Running>,
    /// Prefix checkpoints by the prefix owner's request id.
    checkpoints: HashMap<usize, Checkpoint>,
    finished: Vec<Record>,
    stats: EngineStats,
    step: usize,
    /// The padded batches of [`EngineConfig::pad_to`], by tokens per sequence.
    padded: HashMap<usize, B::Batch>,
}

impl<'a, B: Backend> Engine<'a, B>
where
    B::Memory: Clone,
{
    /// A pool of `geometry` in the backend's memory and every request waiting.
    pub fn new(
        backend: &'a B,
        geometry: PoolGeometry,
        config: EngineConfig,
        inputs: InputSource,
        requests: &'a [Request],
    ) -> Result<Self, EngineError> {
        let fail = |what: &str, msg: String| EngineError {
            step: 0,
            what: what.to_string(),
            msg,
        };
        let pool = StatePool::new(backend.memory().clone(), geometry.clone())
            .map_err(|e| fail("pool allocation", e.to_string()))?;
        let params = (0..geometry.layers)
            .map(|l| DeviceParams::upload(backend, &inputs.gate_params(l)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| fail("gate parameter upload", e.to_string()))?;
        Ok(Self {
            backend,
            pool,
            config,
            inputs,
            requests,
            params,
            waiting: (0..requests.len()).collect(),
            running: Vec::new(),
            checkpoints: HashMap::new(),
            finished: Vec::new(),
            stats: EngineStats::default(),
            step: 0,
            padded: HashMap::new(),
        })
    }

    /// Whether every request has finished.
    pub fn done(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Requests finished so far.
    pub fn finished(&self) -> usize {
        self.finished.len()
    }

    /// Runs one step; returns the number of requests that finished in it.
    pub fn step(&mut self) -> Result<usize, EngineError> {
        self.step += 1;
        self.stats.steps = self.step;
        let admitted = self.admit()?;
        let prefilled = self.prefill()?;
        let generated = if self.config.spec_tokens > 0 {
            self.verify(&prefilled)?
        } else {
            self.decode(&prefilled)?
        };
        let finished = self.complete()?;
        if admitted == 0 && prefilled.is_empty() && generated == 0 && finished == 0 {
            return Err(self.err("scheduling", "no request could make progress".into()));
        }
        Ok(finished)
    }

    /// Drops the prefix checkpoints and returns the records, the counters and the allocator
    /// counts of request and checkpoint slots after everything was released.
    pub fn finish(mut self) -> (Vec<Record>, EngineStats, AllocStats, AllocStats) {
        self.checkpoints.clear();
        let slots = self.pool.stats();
        let ckpts = self.pool.checkpoint_allocator().stats();
        (self.finished, self.stats, slots, ckpts)
    }

    fn err(&self, what: impl Into<String>, msg: String) -> EngineError {
        EngineError {
            step: self.step,
            what: what.into(),
            msg,
        }
    }

    fn violation(&mut self, note: String) {
        self.stats.violations += 1;
        if self.stats.violation_notes.len() < 8 {
            self.stats.violation_notes.push(note);
        }
    }

    fn admit(&mut self) -> Result<usize, EngineError> {
        let mut admitted = 0;
        while let Some(&next) = self.waiting.front() {
            let slot = match self.pool.allocate() {
                Ok(h) => h,
                Err(PoolError::Exhausted { .. }) => {
                    self.stats.steps_pool_full += 1;
                    break;
                }
                Err(e) => return Err(self.err("slot allocation", e.to_string())),
            };
            self.waiting.pop_front();
            admitted += 1;
            let req = &self.requests[next];
            let layers = self.pool.geometry().layers;
            let per_token = self.pool.geometry().hv * self.pool.geometry().v;
            let mut run = Running {
                req: next,
                slot,
                committed: 0,
                round: 0,
                pending_accept: 0,
                restored: 0,
                outputs: vec![vec![f32::NAN; req.total_len() * per_token]; layers],
                produced: vec![false; req.total_len()],
            };
            if let Some(p) = req.prefix {
                if let Some(ck) = self.checkpoints.get_mut(&p.owner) {
                    ck.last_used = self.step;
                    let index = run.slot.index();
                    self.pool
                        .restore(&ck.handle, index)
                        .map_err(|e| EngineError {
                            step: self.step,
                            what: format!("restore of prefix {} into slot {index}", p.owner),
                            msg: e.to_string(),
                        })?;
                    run.committed = p.len;
                    run.restored = p.len;
                    self.stats.checkpoint_hits += 1;
                    self.stats.restored_tokens += p.len;
                } else if p.owner != req.id {
                    self.stats.checkpoint_misses += 1;
                }
            }
            self.running.push(run);
        }
        // The admission invariants: never more running requests than slots, and the
        // allocator agrees with the running requests.
        let slots = self.pool.geometry().slots;
        let in_use = self.pool.stats().in_use;
        if self.running.len() > slots || in_use != self.running.len() {
            let note = format!(
                "step {}: {} running requests, {in_use} slots in use of {slots}",
                self.step,
                self.running.len()
            );
            self.violation(note);
        }
        self.stats.max_running = self.stats.max_running.max(self.running.len());
        self.stats.max_waiting = self.stats.max_waiting.max(self.waiting.len());
        Ok(admitted)
    }

    /// Uploads `tokens`, runs `op` on every layer into a NaN-poisoned output and returns the
    /// outputs per layer.
    fn run_layers(
        &mut self,
        what: &str,
        plan: BatchPlan,
        tokens: &[Tokens],
        accepted: Option<&[u32]>,
        op: Op,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let be = self.backend;
        let g = self.pool.geometry().clone();
        let t = plan.num_tokens();
        let n = plan.num_seqs();
        // the padded batch of this shape (its length per sequence and its size), if it has one
        let pad = match (self.config.pad_to, op) {
            (Some(cap), Op::Decode | Op::Verify) if n > 0 && n <= cap => {
                let len = plan.len_of(0);
                (0..n).all(|i| plan.len_of(i) == len).then_some((len, cap))
            }
            _ => None,
        };
        let batch = match pad {
            Some((len, cap)) => self
                .padded_batch(len, cap, &plan.slots)
                .map_err(|e| self.err(format!("{what}: padded batch"), e.to_string()))?,
            None => be
                .prepare(plan)
                .map_err(|e| self.err(format!("{what}: batch"), e.to_string()))?,
        };
        // the tensors' tokens and sequences: the padded size's, or the plan's
        let (tt, nt) = pad.map_or((t, n), |(len, cap)| (len * cap, cap));
        let accepted_buf = match accepted {
            Some(a) => {
                let mut counts = a.to_vec();
                counts.resize(nt, 0);
                Some(
                    upload_counts(be, &counts)
                        .map_err(|e| self.err(format!("{what}: counts"), e.to_string()))?,
                )
            }
            None => None,
        };
        let step = self.step;
        let mut outs = Vec::with_capacity(g.layers);
        for (layer, tokens) in tokens.iter().enumerate() {
            let ctx = |e: KernelError| EngineError {
                step,
                what: format!("{what} of layer {layer}"),
                msg: e.to_string(),
            };
            let inputs = DeviceInputs::upload(be, &nan_padded(tokens, tt), self.config.io_dtype)
                .map_err(ctx)?;
            let mut out = DeviceTensor::<B>::poisoned(be, self.config.io_dtype, tt * g.hv * g.v)
                .map_err(ctx)?;
            let params = &self.params[layer];
            let mut view = self.pool.layer_mut(layer).map_err(|e| ctx(e.into()))?;
            let step_inputs = inputs.view(params);
            let opts = &self.config.opts;
            match op {
                Op::Prefill => {
                    be.prefill(&batch, &step_inputs, opts, &mut view, &mut out.view_mut())
                }
                Op::Decode => be.decode(&batch, &step_inputs, opts, &mut view, &mut out.view_mut()),
                Op::Verify => {
                    let (buf, len) = accepted_buf.as_ref().expect("verify has counts");
                    let acc = IndexView { buf, len: *len };
                    be.spec_verify(
                        &batch,
                        &acc,
                        &step_inputs,
                        opts,
                        &mut view,
                        &mut out.view_mut(),
                    )
                }
            }
            .map_err(ctx)?;
            let mut o = out.to_f32(be).map_err(ctx)?;
            // the padding's outputs stay the poison
            let live = t * g.hv * g.v;
            if let Some(i) = o[live..].iter().position(|x| !x.is_nan()) {
                let note = format!(
                    "step {step}: {what} of layer {layer} wrote output {} of the padding",
                    live + i
                );
                self.violation(note);
            }
            o.truncate(live);
            outs.push(o);
        }
        if let Some((len, _)) = pad {
            self.padded.insert(len, batch);
            self.stats.padded_steps += 1;
        }
        Ok(outs)
    }

    /// The padded batch of `cap` sequences of `len` tokens (made on first use, as an engine
    /// captures a graph once), updated so that `slots` are its live sequences.
    fn padded_batch(
        &mut self,
        len: usize,
        cap: usize,
        slots: &[u32],
    ) -> Result<B::Batch, KernelError> {
        let be = self.backend;
        let mut batch = match self.padded.remove(&len) {
            Some(b) => b,
            None => {
                let bounds: Vec<usize> = (0..=cap).map(|i| i * len).collect();
                let first: Vec<u32> = (0..cap as u32).collect();
                let plan = plan_of(&bounds, &first)?;
                be.prepare_padded(plan, self.pool.geometry().total_slots())?
            }
        };
        be.update_batch(&mut batch, slots)?;
        Ok(batch)
    }

    /// Flushes the rings of the running requests at `which` (indices into `running`), with
    /// their pending accepted counts when speculative decoding is on.
    fn flush(&mut self, which: &[usize], why: &str) -> Result<(), EngineError> {
        if which.is_empty() {
            return Ok(());
        }
        let be = self.backend;
        let slots: Vec<u32> = which
            .iter()
            .map(|&i| self.running[i].slot.index_u32())
            .collect();
        let counts: Vec<u32> = which
            .iter()
            .map(|&i| self.running[i].pending_accept)
            .collect();
        let bounds = vec![0i64; which.len() + 1];
        let what = format!("replay before {why}");
        let plan = BatchPlan::new(CuSeqlens::I64(&bounds), &slots, 0)
            .map_err(|e| self.err(&what, e.to_string()))?;
        let batch = be
            .prepare(plan)
            .map_err(|e| self.err(&what, e.to_string()))?;
        let spec = self.config.spec_tokens > 0;
        let counts_buf = if spec {
            Some(upload_counts(be, &counts).map_err(|e| self.err(&what, e.to_string()))?)
        } else {
            None
        };
        let step = self.step;
        for layer in 0..self.pool.geometry().layers {
            let params = &self.params[layer];
            let a_log = params.a_log.as_ref().map(DeviceTensor::view);
            let dt_bias = params.dt_bias.as_ref().map(DeviceTensor::view);
            let acc = counts_buf
                .as_ref()
                .map(|(buf, len)| IndexView { buf, len: *len });
            let ctx = |e: KernelError| EngineError {
                step,
                what: format!("{what} of layer {layer}"),
                msg: e.to_string(),
            };
            let mut view = self.pool.layer_mut(layer).map_err(|e| ctx(e.into()))?;
            be.replay(
                &batch,
                acc.as_ref(),
                &self.config.opts,
                a_log.as_ref(),
                dt_bias.as_ref(),
                &mut view,
            )
            .map_err(ctx)?;
        }
        for &i in which {
            self.running[i].pending_accept = 0;
        }
        Ok(())
    }

    /// Stores the outputs of `positions` of running request `i` (rows `row..` of the call).
    fn record(
        &mut self,
        i: usize,
        outs: &[Vec<f32>],
        row: usize,
        positions: std::ops::Range<usize>,
    ) {
        let per = self.pool.geometry().hv * self.pool.geometry().v;
        let run = &mut self.running[i];
        for (layer, out) in outs.iter().enumerate() {
            let src = &out[row * per..(row + positions.len()) * per];
            run.outputs[layer][positions.start * per..positions.end * per].copy_from_slice(src);
        }
        for p in positions {
            run.produced[p] = true;
        }
    }

    /// One chunk of prefill for every request still in its prompt; returns their indices.
    fn prefill(&mut self) -> Result<Vec<usize>, EngineError> {
        let layers = self.pool.geometry().layers;
        let can_checkpoint = self.pool.geometry().checkpoint_slots > 0;
        // (running index, first position, length)
        let mut seqs: Vec<(usize, usize, usize)> = Vec::new();
        for (i, run) in self.running.iter().enumerate() {
            let req = &self.requests[run.req];
            if run.committed >= req.prompt_len {
                continue;
            }
            let mut len = self.config.chunk.min(req.prompt_len - run.committed);
            if let Some(p) = req.prefix {
                if can_checkpoint
                    && run.committed < p.len
                    && !self.checkpoints.contains_key(&p.owner)
                {
                    len = len.min(p.len - run.committed);
                }
            }
            seqs.push((i, run.committed, len));
        }
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let mut bounds = vec![0usize];
        let mut tokens: Vec<Tokens> = (0..layers)
            .map(|_| Tokens::empty(self.inputs.dims))
            .collect();
        for &(i, start, len) in &seqs {
            let req = &self.requests[self.running[i].req];
            for (layer, all) in tokens.iter_mut().enumerate() {
                for p in start..start + len {
                    append(all, &self.inputs.token(req, p, layer));
                }
            }
            bounds.push(bounds.last().copied().unwrap_or(0) + len);
        }
        let slots: Vec<u32> = seqs
            .iter()
            .map(|&(i, ..)| self.running[i].slot.index_u32())
            .collect();
        let plan =
            plan_of(&bounds, &slots).map_err(|e| self.err("prefill batch", e.to_string()))?;
        let outs = self.run_layers("prefill", plan, &tokens, None, Op::Prefill)?;
        let mut to_checkpoint = Vec::new();
        for (n, &(i, start, len)) in seqs.iter().enumerate() {
            self.record(i, &outs, bounds[n], start..start + len);
            self.running[i].committed += len;
            self.stats.prefill_tokens += len;
            self.stats.prefill_chunks += 1;
            let req = &self.requests[self.running[i].req];
            if let Some(p) = req.prefix {
                let owner_free = !self.checkpoints.contains_key(&p.owner)
                    && !to_checkpoint.iter().any(|&(_, o)| o == p.owner);
                if can_checkpoint && self.running[i].committed == p.len && owner_free {
                    to_checkpoint.push((i, p.owner));
                }
            }
        }
        if !to_checkpoint.is_empty() {
            let which: Vec<usize> = to_checkpoint.iter().map(|&(i, _)| i).collect();
            // A prefill leaves the ring empty, but the contract is: flush before a checkpoint.
            self.flush(&which, "a prefix checkpoint")?;
            for (i, owner) in to_checkpoint {
                self.checkpoint(i, owner)?;
            }
        }
        Ok(seqs.iter().map(|&(i, ..)| i).collect())
    }

    /// Checkpoints running request `i`'s slot as the prefix of `owner`, evicting the least
    /// recently used checkpoint when every checkpoint slot is taken.
    fn checkpoint(&mut self, i: usize, owner: usize) -> Result<(), EngineError> {
        let slot = self.running[i].slot.index();
        if let Some(nf) = self
            .pool
            .find_nonfinite(slot)
            .map_err(|e| self.err("scan", e.to_string()))?
        {
            // A poisoned prefix is not shared.
            tracing::warn!("slot {slot} is poisoned ({nf}); its prefix is not checkpointed");
            return Ok(());
        }
        let handle = match self.pool.checkpoint(slot) {
            Ok(h) => h,
            Err(PoolError::CheckpointsExhausted { .. }) => {
                let lru = self
                    .checkpoints
                    .iter()
                    .min_by_key(|(o, c)| (c.last_used, **o))
                    .map(|(&o, _)| o);
                if let Some(o) = lru {
                    self.checkpoints.remove(&o);
                    self.stats.checkpoint_evictions += 1;
                }
                self.pool
                    .checkpoint(slot)
                    .map_err(|e| self.err(format!("checkpoint of slot {slot}"), e.to_string()))?
            }
            Err(e) => return Err(self.err(format!("checkpoint of slot {slot}"), e.to_string())),
        };
        self.checkpoints.insert(
            owner,
            Checkpoint {
                handle,
                last_used: self.step,
            },
        );
        self.stats.checkpoints_taken += 1;
        Ok(())
    }

    /// Running requests past their prompt that were not prefilled in this step.
    fn generating(&self, prefilled: &[usize]) -> Vec<usize> {
        (0..self.running.len())
            .filter(|i| !prefilled.contains(i))
            .filter(|&i| {
                let run = &self.running[i];
                let req = &self.requests[run.req];
                run.committed >= req.prompt_len && run.committed < req.total_len()
            })
            .collect()
    }

    /// One decode token for every generating request; returns the tokens decoded.
    fn decode(&mut self, prefilled: &[usize]) -> Result<usize, EngineError> {
        let which = self.generating(prefilled);
        if which.is_empty() {
            return Ok(0);
        }
        let layers = self.pool.geometry().layers;
        let tokens: Vec<Tokens> = (0..layers)
            .map(|layer| {
                let mut all = Tokens::empty(self.inputs.dims);
                for &i in &which {
                    let run = &self.running[i];
                    append(
                        &mut all,
                        &self
                            .inputs
                            .token(&self.requests[run.req], run.committed, layer),
                    );
                }
                all
            })
            .collect();
        let bounds: Vec<usize> = (0..=which.len()).collect();
        let slots: Vec<u32> = which
            .iter()
            .map(|&i| self.running[i].slot.index_u32())
            .collect();
        let plan = plan_of(&bounds, &slots).map_err(|e| self.err("decode batch", e.to_string()))?;
        let outs = self.run_layers("decode", plan, &tokens, None, Op::Decode)?;
        for (n, &i) in which.iter().enumerate() {
            let p = self.running[i].committed;
            self.record(i, &outs, n, p..p + 1);
            self.running[i].committed += 1;
        }
        self.stats.decode_tokens += which.len();
        Ok(which.len())
    }

    /// One speculative verify for every generating request: up to `spec_tokens + 1` tokens,
    /// of which a random prefix (at least the first) is accepted; returns the tokens verified.
    fn verify(&mut self, prefilled: &[usize]) -> Result<usize, EngineError> {
        let which = self.generating(prefilled);
        if which.is_empty() {
            return Ok(0);
        }
        let layers = self.pool.geometry().layers;
        let cfg = &self.config;
        // (running index, first position, tokens, accepted)
        let rounds: Vec<(usize, usize, usize, usize)> = which
            .iter()
            .map(|&i| {
                let run = &self.running[i];
                let req = &self.requests[run.req];
                let len = (cfg.spec_tokens + 1).min(req.total_len() - run.committed);
                let a = accepted_count(cfg.seed, req.id, run.round, len, cfg.accept_rate);
                (i, run.committed, len, a)
            })
            .collect();
        let tokens: Vec<Tokens> = (0..layers)
            .map(|layer| {
                let mut all = Tokens::empty(self.inputs.dims);
                for &(i, start, len, a) in &rounds {
                    let run = &self.running[i];
                    let req = &self.requests[run.req];
                    for p in start..start + len {
                        let t = if p < start + a {
                            self.inputs.token(req, p, layer)
                        } else {
                            self.inputs.rejected_draft(req, p, run.round, layer)
                        };
                        append(&mut all, &t);
                    }
                }
                all
            })
            .collect();
        let mut bounds = vec![0usize];
        for &(_, _, len, _) in &rounds {
            bounds.push(bounds.last().copied().unwrap_or(0) + len);
        }
        let slots: Vec<u32> = rounds
            .iter()
            .map(|&(i, ..)| self.running[i].slot.index_u32())
            .collect();
        let accepted: Vec<u32> = rounds
            .iter()
            .map(|&(i, ..)| self.running[i].pending_accept)
            .collect();
        let plan = plan_of(&bounds, &slots).map_err(|e| self.err("verify batch", e.to_string()))?;
        let outs = self.run_layers("spec_verify", plan, &tokens, Some(&accepted), Op::Verify)?;
        let mut total = 0;
        for (n, &(i, start, len, a)) in rounds.iter().enumerate() {
            self.record(i, &outs, bounds[n], start..start + a);
            let run = &mut self.running[i];
            run.committed += a;
            run.pending_accept = a as u32;
            run.round += 1;
            self.stats.verify_tokens += len;
            self.stats.accepted_tokens += a;
            self.stats.verify_rounds += 1;
            total += len;
        }
        Ok(total)
    }

    /// Flushes, scans and releases the finished requests; returns how many finished.
    fn complete(&mut self) -> Result<usize, EngineError> {
        let done: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                let run = &self.running[i];
                run.committed == self.requests[run.req].total_len()
            })
            .collect();
        if done.is_empty() {
            return Ok(0);
        }
        self.flush(&done, "release")?;
        let g = self.pool.geometry().clone();
        for &i in done.iter().rev() {
            let run = self.running.swap_remove(i);
            let slot = run.slot.index();
            let read = |e: PoolError| EngineError {
                step: self.step,
                what: format!("reading slot {slot}"),
                msg: e.to_string(),
            };
            let poisoned = self.pool.find_nonfinite(slot).map_err(read)?;
            let final_state = (0..g.layers)
                .map(|l| {
                    let bytes = self.pool.read_slot_plane(l, Plane::Ssm, slot)?;
                    Ok(g.state_dtype.decode_f32(&bytes))
                })
                .collect::<Result<Vec<_>, PoolError>>()
                .map_err(read)?;
            if !self.pool.allocator().is_held(slot) {
                self.violation(format!("step {}: slot {slot} released twice", self.step));
            }
            run.slot.release();
            self.finished.push(Record {
                request: self.requests[run.req].clone(),
                outputs: run.outputs,
                produced: run.produced,
                final_state,
                poisoned,
                restored: run.restored,
            });
        }
        Ok(done.len())
    }
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Prefill,
    Decode,
    Verify,
}

fn plan_of(bounds: &[usize], slots: &[u32]) -> kda_kernels::Result<BatchPlan> {
    let cu: Vec<i64> = bounds.iter().map(|&b| b as i64).collect();
    BatchPlan::new(
        CuSeqlens::I64(&cu),
        slots,
        bounds.last().copied().unwrap_or(0),
    )
}

/// `tokens` followed by NaN inputs up to `len` tokens: the padding of a padded batch, which no
/// kernel may read.
fn nan_padded(tokens: &Tokens, len: usize) -> Tokens {
    let d = tokens.dims;
    let extra = len - tokens.len;
    let grow = |x: &[f32], row: usize| {
        let mut v = x.to_vec();
        v.resize(x.len() + extra * row, f32::NAN);
        v
    };
    Tokens {
        dims: d,
        len,
        q: grow(&tokens.q, d.h * d.k),
        k: grow(&tokens.k, d.h * d.k),
        v: grow(&tokens.v, d.hv * d.v),
        g: grow(&tokens.g, d.hv * d.k),
        beta: grow(&tokens.beta, d.hv),
    }
}

/// Uploads `u32` counts; returns the buffer and the count.
fn upload_counts<B: Backend>(be: &B, counts: &[u32]) -> Result<(Buf<B>, usize), PoolError> {
    let bytes: Vec<u8> = counts.iter().flat_map(|c| c.to_le_bytes()).collect();
    let mem = be.memory();
    let mut buf = mem.alloc_zeroed(bytes.len())?;
    mem.write(&mut buf, 0, &bytes)?;
    Ok((buf, counts.len()))
}
