//! `kda-pool bench`: decode, spec_verify and replay on the GPU, against the device's own
//! copy bandwidth measured in the same run; prefill (`--op prefill`) in tokens per second.
//!
//! Method: each case allocates a pool of `R` disjoint slot sets of `N` slots (slots shuffled,
//! `R * N * state bytes` well above the L2 size where memory allows), fills the state and the
//! inputs with random values on the device, runs one warm-up call per set (which also compiles
//! the kernel), then captures one call per set into a CUDA graph and times graph replays with
//! CUDA events. The ring's bookkeeping evolves on the device across replays, so ring decode and
//! spec_verify are measured in their steady state. Bytes counted: the state read and written,
//! plus the ring entries read and written (averaged over the ring's cycle, simulated on the
//! host for the accepted counts used).
//!
//! References, same run: the copy ceiling (the best launch shape of the `kda_copy` kernel over
//! 1 GiB, each shape printed); per case a same-size copy (`copy_same_us`: `kda_copy` reading
//! half the case's counted bytes and writing as many, one copy per slot set in one graph over
//! disjoint buffers, timed like the case, best shape; timed once per size); and once a launch
//! floor (the same method with copies of 16 bytes: the fixed cost of a launch in a graph).

use std::collections::HashMap;
use std::io::Write;

use kda_kernels::cuda::{CudaBackend, CudaBatch, CudaBuffer};
use kda_kernels::{
    Backend, BatchKind, BatchPlan, BetaMode, EagerKernel, GateMode, IndexView, KdaOptions,
    PrefillKernel, RingKernel, StepInputs,
};
use kda_kernels::{TensorView, TensorViewMut};
use state_pool::{DeviceMemory, Dtype, LayerPlanes, PoolGeometry, Rounding, StateLayout};

use super::{list, CliError};

/// The ring kernels each ring case is also timed with, forced, and their rows' suffixes
/// (`decode-piped`, `spec-tile`, `replay-step`, ...).
const RING_ROWS: [(&str, RingKernel); 6] = [
    ("piped", RingKernel::Pipelined),
    ("tile", RingKernel::Tile),
    ("mma", RingKernel::Mma),
    ("delta", RingKernel::Delta),
    ("delta-staged", RingKernel::DeltaStaged),
    ("step", RingKernel::Step),
];

/// The eager kernels each eager decode case is also timed with, forced, and their rows'
/// suffixes (`decode-piped`, ...).
const EAGER_ROWS: [(&str, EagerKernel); 9] = [
    ("piped", EagerKernel::Pipelined),
    ("tile", EagerKernel::Tile),
    ("staged", EagerKernel::StagedTile),
    ("bulk", EagerKernel::BulkTile),
    ("bulkin", EagerKernel::BulkInTile),
    ("stream", EagerKernel::StreamTile),
    ("regs", EagerKernel::RegsTile),
    ("pipe", EagerKernel::BulkPipe),
    ("blocked", EagerKernel::Step),
];

/// Which forced-kernel rows `--forced` asks for (by row suffix); `None`: all of them.
struct Forced(Option<Vec<String>>);

impl Forced {
    fn parse(s: &str) -> Result<Self, CliError> {
        let mut known: Vec<&str> = EAGER_ROWS.iter().map(|r| r.0).collect();
        for (suffix, _) in RING_ROWS {
            if !known.contains(&suffix) {
                known.push(suffix);
            }
        }
        match s {
            "all" => Ok(Self(None)),
            "none" => Ok(Self(Some(Vec::new()))),
            _ => list(
                "forced",
                s,
                |x| known.contains(&x).then(|| x.to_string()),
                &format!("all, none or a list of {}", known.join(", ")),
            )
            .map(|v| Self(Some(v))),
        }
    }

    fn wants(&self, suffix: &str) -> bool {
        self.0
            .as_ref()
            .is_none_or(|v| v.iter().any(|x| x == suffix))
    }
}

/// Arguments of `kda-pool bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Which operations: decode, spec, replay, all (those three) or prefill.
    #[arg(long, default_value = "all")]
    pub op: String,
    /// Write the rows as a JSON array to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Backend (only `cuda` benchmarks).
    #[arg(long, default_value = "cuda")]
    pub backend: String,
    /// q/k heads (= value heads), comma-separated.
    #[arg(long, default_value = "12,32")]
    pub heads: String,
    /// Sequences per decode call, comma-separated.
    #[arg(long, default_value = "1,64,256")]
    pub seqs: String,
    /// Pool dtypes, comma-separated.
    #[arg(long, default_value = "fp32,fp16,bf16")]
    pub states: String,
    /// State layouts, comma-separated (kfirst, vfirst).
    #[arg(long, default_value = "kfirst")]
    pub layouts: String,
    /// Drafts per sequence of the spec_verify cases (T; ring 2 x (T + 1)), comma-separated.
    #[arg(long, default_value = "2,4")]
    pub drafts: String,
    /// Sequences per spec_verify call, comma-separated.
    #[arg(long, default_value = "64")]
    pub spec_seqs: String,
    /// Prefill cases (`--op prefill`): sequences x tokens of each, comma-separated (the
    /// shapes of fla's prefill rows in ../shared/anchors.md).
    #[arg(long, default_value = "1x2048,8x4096")]
    pub prefill_lens: String,
    /// Ring length of the ring-decode cases.
    #[arg(long, default_value_t = 8)]
    pub ring: usize,
    /// Timed graph replays per case (32: four cycles of a ring of 8).
    #[arg(long, default_value_t = 32)]
    pub replays: usize,
    /// Also time eager decode with these warps per CTA, with the default kernel choice and with
    /// the staged tile kernel, and prefill (`prefill-wN` rows) (comma-separated, 1..=8; tuning).
    #[arg(long)]
    pub warps: Option<String>,
    /// Also time eager decode with these pipeline stages of the pipelined kernel, for each of
    /// the --warps (comma-separated, 2 or 3; tuning).
    #[arg(long)]
    pub stages: Option<String>,
    /// Also time the chunked prefill with its state pass in these value columns per CTA
    /// (`prefill-chunked-cN` rows; comma-separated, 16 or 32; by default each window's shape
    /// chooses; tuning).
    #[arg(long)]
    pub chunk_columns: Option<String>,
    /// Which operations launch as programmatic dependent launches: default (the backend's
    /// choice: decode and small spec_verify calls), all or none (A/B in one binary).
    #[arg(long, default_value = "default")]
    pub dependent_launch: String,
    /// Also time eager decode issued call by call outside a graph (the slot sets in turn), this
    /// many calls, wall clock to the stream's end: the row `decode-issue`, the host's cost per
    /// call where it exceeds the kernel's (0: no such row).
    #[arg(long, default_value_t = 0)]
    pub issue_calls: usize,
    /// Also time decode and spec_verify through padded batches (`prepare_padded`, every
    /// sequence live), as an engine's CUDA graphs call them: the rows `decode-padded`,
    /// `spec-padded`.
    #[arg(long)]
    pub padded: bool,
    /// Which forced-kernel rows to time besides each case's default row: all, none, or row
    /// suffixes, comma-separated (eager decode: piped, tile, staged, bulk, bulkin, stream,
    /// regs, pipe, blocked; with a ring: piped, tile, mma, delta, delta-staged, step).
    #[arg(long, default_value = "all")]
    pub forced: String,
}

fn usage(msg: impl Into<String>) -> CliError {
    CliError::Usage(msg.into())
}

fn positive(x: &str) -> Option<usize> {
    x.parse::<usize>().ok().filter(|&v| v > 0)
}

/// One measured case.
#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    op: String,
    #[serde(rename = "H")]
    h: usize,
    #[serde(rename = "N")]
    n: usize,
    #[serde(rename = "T")]
    t: usize,
    ring_len: usize,
    state: String,
    layout: String,
    us: f64,
    state_bytes: f64,
    pct_of_copy: f64,
    /// Device time of a `kda_copy` of the same bytes (half read, half written), timed the same
    /// way (a graph of one copy per slot set over disjoint buffers).
    copy_same_us: f64,
    /// That copy's time as a percentage of ours (our share of the same-size copy's bandwidth).
    pct_of_same_copy: f64,
}

const KD: usize = 128;
const IN: Dtype = Dtype::Bf16;

fn opts() -> KdaOptions {
    KdaOptions {
        scale: None,
        l2norm_qk: true,
        gate: GateMode::Softplus,
        beta: BetaMode::Sigmoid,
        allow_neg_eigval: false,
    }
}

fn kerr(e: kda_kernels::KernelError) -> CliError {
    CliError::from(e)
}

fn perr(e: state_pool::PoolError) -> CliError {
    CliError::Failed(e.to_string())
}

/// The token inputs of one case (bf16, random) and the gate parameters (f32).
struct Inputs {
    q: CudaBuffer,
    k: CudaBuffer,
    v: CudaBuffer,
    g: CudaBuffer,
    beta: CudaBuffer,
    a_log: CudaBuffer,
    dt_bias: CudaBuffer,
    tokens: usize,
    h: usize,
}

impl Inputs {
    fn view(&self) -> StepInputs<'_, CudaBuffer> {
        let (t, h) = (self.tokens, self.h);
        fn tv(buf: &CudaBuffer, len: usize) -> TensorView<'_, CudaBuffer> {
            TensorView {
                buf,
                dtype: IN,
                len,
            }
        }
        StepInputs {
            q: tv(&self.q, t * h * KD),
            k: tv(&self.k, t * h * KD),
            v: tv(&self.v, t * h * KD),
            g: tv(&self.g, t * h * KD),
            beta: tv(&self.beta, t * h),
            a_log: Some(self.a_log_view()),
            dt_bias: Some(self.dt_bias_view()),
        }
    }
    fn a_log_view(&self) -> TensorView<'_, CudaBuffer> {
        TensorView {
            buf: &self.a_log,
            dtype: Dtype::Fp32,
            len: self.h,
        }
    }
    fn dt_bias_view(&self) -> TensorView<'_, CudaBuffer> {
        TensorView {
            buf: &self.dt_bias,
            dtype: Dtype::Fp32,
            len: self.h * KD,
        }
    }
}

/// The device buffers of one case.
struct Setup {
    geometry: PoolGeometry,
    planes: LayerPlanes<CudaBuffer>,
    batches: Vec<CudaBatch>,
    inputs: Inputs,
    out: CudaBuffer,
}

/// Sets of a pool: enough that the sets' state exceeds ~4x a 60 MB L2, 8..=64 sets.
fn num_sets(set_bytes: usize) -> usize {
    (256usize << 20).div_ceil(set_bytes.max(1)).clamp(8, 64)
}

/// The pool geometry of the bench's cases: one layer, HV = H, K = V = 128, inputs and ring in
/// bf16, nearest rounding.
fn bench_geometry(
    h: usize,
    slots: usize,
    ring_len: usize,
    state: Dtype,
    layout: StateLayout,
) -> PoolGeometry {
    PoolGeometry {
        layers: 1,
        h,
        hv: h,
        k: KD,
        v: KD,
        conv_rows: 0,
        conv_channels: 0,
        conv_dtype: Dtype::Bf16,
        state_dtype: state,
        layout,
        ring_len,
        ring_dtype: IN,
        // ring decode runs kda_ring_delta by default where the pool has a delta plane
        ring_deltas: ring_len > 0,
        slots,
        checkpoint_slots: 0,
        rounding: Rounding::Nearest,
    }
}

/// A case's pool of slot sets and its inputs: `sets` disjoint sets of `n` slots (`None`:
/// enough that their states are not served from L2, [`num_sets`]), each sequence `t` tokens.
#[allow(clippy::too_many_arguments)]
fn setup(
    be: &CudaBackend,
    h: usize,
    n: usize,
    t: usize,
    ring_len: usize,
    state: Dtype,
    layout: StateLayout,
    sets: Option<usize>,
) -> Result<Setup, CliError> {
    let r = sets.unwrap_or_else(|| num_sets(n * h * KD * KD * state.size()));
    let mem = be.memory();
    let geometry = bench_geometry(h, r * n, ring_len, state, layout);
    let mut planes = LayerPlanes::new(mem, &geometry, 0).map_err(perr)?;
    be.fill_random(&mut planes.ssm, state, 1, 0.1)
        .map_err(kerr)?;
    be.fill_random(&mut planes.ring, IN, 2, 1.0).map_err(kerr)?;
    // a deterministic shuffle of the slots, cut into R disjoint sets
    let mut slots: Vec<u32> = (0..(r * n) as u32).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..slots.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        slots.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let bounds: Vec<usize> = (0..=n).map(|i| i * t).collect();
    let batches = slots
        .chunks(n)
        .map(|s| {
            be.prepare(BatchPlan {
                bounds: bounds.clone(),
                slots: s.to_vec(),
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(kerr)?;
    let tokens = n * t;
    let rnd = |len: usize, dtype: Dtype, seed: u32, scale: f32| -> Result<CudaBuffer, CliError> {
        let mut b = mem.alloc_zeroed(len * dtype.size()).map_err(perr)?;
        be.fill_random(&mut b, dtype, seed, scale).map_err(kerr)?;
        Ok(b)
    };
    Ok(Setup {
        inputs: Inputs {
            q: rnd(tokens * h * KD, IN, 3, 1.0)?,
            k: rnd(tokens * h * KD, IN, 4, 1.0)?,
            v: rnd(tokens * h * KD, IN, 5, 1.0)?,
            g: rnd(tokens * h * KD, IN, 6, 1.0)?,
            beta: rnd(tokens * h, IN, 7, 1.0)?,
            a_log: rnd(h, Dtype::Fp32, 8, 1.0)?,
            dt_bias: rnd(h * KD, Dtype::Fp32, 9, 0.1)?,
            tokens,
            h,
        },
        out: rnd(tokens * h * KD, IN, 10, 1.0)?,
        geometry,
        planes,
        batches,
    })
}

impl Setup {
    fn n(&self) -> usize {
        self.batches[0].as_ref().num_seqs()
    }
    /// Makes every slot set's batch a padded one of the same plan, every sequence live
    /// ([`CudaBackend::prepare_padded`]), as a graph of an engine's padded steps calls it.
    fn pad(&mut self, be: &CudaBackend) -> Result<(), CliError> {
        let bound = self.geometry.total_slots();
        self.batches = self
            .batches
            .iter()
            .map(|b| be.prepare_padded(b.as_ref().clone(), bound))
            .collect::<Result<_, _>>()
            .map_err(kerr)?;
        Ok(())
    }
    /// Bytes of the state of one slot set.
    fn state_bytes(&self) -> f64 {
        (self.n() * self.geometry.ssm_slot_bytes()) as f64
    }
    /// Bytes of one ring entry of every sequence of a set.
    fn entry_bytes(&self) -> f64 {
        (self.n() * self.geometry.ring_entry_elems() * IN.size()) as f64
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Decode,
    Spec,
    Replay,
    Prefill,
}

/// Enqueues one call of `kind` on slot set `set` (accepted counts from `acc`).
fn enqueue(
    be: &CudaBackend,
    s: &mut Setup,
    kind: Kind,
    set: usize,
    acc: Option<&CudaBuffer>,
) -> Result<(), kda_kernels::KernelError> {
    let out_len = s.inputs.tokens * s.geometry.hv * KD;
    let o = opts();
    let Setup {
        geometry,
        planes,
        batches,
        inputs,
        out,
    } = s;
    let n = batches[set].as_ref().num_seqs();
    let mut layer = planes.view(geometry);
    let batch = &batches[set];
    let accepted = acc.map(|buf| IndexView { buf, len: n });
    match kind {
        Kind::Decode | Kind::Spec | Kind::Prefill => {
            let mut out = TensorViewMut {
                buf: out,
                dtype: IN,
                len: out_len,
            };
            let inp = inputs.view();
            match (kind, &accepted) {
                (Kind::Spec, Some(a)) => {
                    be.enqueue_spec_verify(batch, a, &inp, &o, &mut layer, &mut out)
                }
                (Kind::Prefill, _) => be.enqueue_prefill(batch, &inp, &o, &mut layer, &mut out),
                _ => be.enqueue_decode(batch, &inp, &o, &mut layer, &mut out),
            }
        }
        Kind::Replay => be.enqueue_replay(
            batch,
            accepted.as_ref(),
            &o,
            Some(&inputs.a_log_view()),
            Some(&inputs.dt_bias_view()),
            &mut layer,
        ),
    }
}

/// The ring's steady state over `calls` spec_verify calls of `t` drafts with accepted counts
/// `acc` (one per sequence) on a ring of `ring_len`: mean fraction of sequences that store the
/// state, and mean pending entries folded per sequence.
fn simulate_spec(acc: &[u32], t: usize, ring_len: usize, calls: usize) -> (f64, f64) {
    let (mut stores, mut folded) = (0usize, 0usize);
    let mut metas = vec![(0usize, 0usize); acc.len()]; // (len, pending)
    let warm = 4 * (ring_len + 1);
    for c in 0..warm + calls {
        for (i, m) in metas.iter_mut().enumerate() {
            let drafts = m.0 - m.1;
            let a = if c == 0 {
                0
            } else {
                (acc[i] as usize).min(drafts)
            };
            let pend = m.1 + a;
            let commit = pend + t > ring_len;
            if c >= warm {
                folded += pend;
                stores += usize::from(commit);
            }
            *m = if commit { (t, 0) } else { (pend + t, pend) };
        }
    }
    let total = (calls * acc.len()) as f64;
    (stores as f64 / total, folded as f64 / total)
}

struct Bench<'a> {
    be: &'a CudaBackend,
    copy_bw: f64,
    replays: usize,
    rows: Vec<Row>,
    /// Same-size copy references already timed: (bytes read per copy, copies) -> us per copy.
    copy_same: HashMap<(usize, usize), f64>,
}

impl Bench<'_> {
    /// Times one call per slot set, captured in one graph; returns microseconds per call.
    fn time(&self, s: &mut Setup, kind: Kind, acc: Option<&CudaBuffer>) -> Result<f64, CliError> {
        let be = self.be;
        let sets = s.batches.len();
        let graph = be
            .capture(|| {
                for set in 0..sets {
                    enqueue(be, s, kind, set, acc)?;
                }
                Ok(())
            })
            .map_err(kerr)?;
        let us = be.time_graph(&graph, 3, self.replays).map_err(kerr)?;
        be.check_device_errors().map_err(kerr)?;
        Ok(us / sets as f64)
    }

    /// Microseconds per call of `calls` calls enqueued one by one outside a graph (the slot
    /// sets in turn), wall clock from the first enqueue to the end of the stream's work, after
    /// a quarter as many warm-up calls: what a caller without CUDA graphs waits per call, the
    /// host's issue cost where that exceeds the kernel's time.
    fn time_issue(
        &self,
        s: &mut Setup,
        kind: Kind,
        acc: Option<&CudaBuffer>,
        calls: usize,
    ) -> Result<f64, CliError> {
        let be = self.be;
        let sets = s.batches.len();
        let run = |s: &mut Setup, n: usize| -> Result<(), CliError> {
            for i in 0..n {
                enqueue(be, s, kind, i % sets, acc).map_err(kerr)?;
            }
            be.synchronize().map_err(kerr)
        };
        run(s, calls.div_ceil(4))?;
        let start = std::time::Instant::now();
        run(s, calls)?;
        let us = start.elapsed().as_secs_f64() * 1e6 / calls as f64;
        be.check_device_errors().map_err(kerr)?;
        Ok(us)
    }

    /// Microseconds per copy of the best `kda_copy` launch shape that reads `read` bytes and
    /// writes as many, timed like a case of `sets` slot sets (a graph of `sets` copies over
    /// disjoint buffers, 3 warm-up replays, `replays` timed); timed once per run per size.
    fn copy_same(&mut self, read: usize, sets: usize) -> Result<f64, CliError> {
        if let Some(&us) = self.copy_same.get(&(read, sets)) {
            return Ok(us);
        }
        let times = self
            .be
            .time_copies(read, sets, 3, self.replays)
            .map_err(kerr)?;
        let us = times.iter().map(|t| t.us).fold(f64::INFINITY, f64::min);
        self.copy_same.insert((read, sets), us);
        Ok(us)
    }

    /// Prints and records the launch floor: a graph of 64 copies of 16 bytes.
    fn launch_floor(&mut self) -> Result<(), CliError> {
        const COPIES: usize = 64;
        let us = self.copy_same(16, COPIES)?;
        let bytes = 32.0;
        println!(
            "launch floor: {us:.2} us per call (graph of {COPIES} kda_copy launches of 16 bytes, best shape)"
        );
        self.rows.push(Row {
            op: "launch-floor".into(),
            h: 0,
            n: 0,
            t: 0,
            ring_len: 0,
            state: "-".into(),
            layout: "-".into(),
            us,
            state_bytes: bytes,
            pct_of_copy: 100.0 * bytes / (us * 1e-6) / self.copy_bw,
            copy_same_us: us,
            pct_of_same_copy: 100.0,
        });
        Ok(())
    }

    /// Prints and records one case of `sets` slot sets that moved `bytes` bytes in `us`
    /// microseconds per call, against the copy ceiling and a same-size copy.
    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        op: &str,
        h: usize,
        n: usize,
        t: usize,
        ring: usize,
        state: Dtype,
        layout: StateLayout,
        sets: usize,
        us: f64,
        bytes: f64,
    ) -> Result<(), CliError> {
        let pct = 100.0 * bytes / (us * 1e-6) / self.copy_bw;
        let copy_us = self.copy_same((bytes / 2.0).round() as usize, sets)?;
        let pct_same = 100.0 * copy_us / us;
        println!(
            "{op:<8} H={h:<3} N={n:<4} T={t} ring={ring:<2} {:<5} {:<6} {us:>9.2} us {:>8.1} MB {:>7.2} TB/s {pct:>6.1}% of copy | copy_same {copy_us:>8.2} us {pct_same:>6.1}% of same",
            state.name(),
            layout.name(),
            bytes / 1e6,
            bytes / (us * 1e-6) / 1e12,
        );
        let _ = std::io::stdout().flush();
        self.rows.push(Row {
            op: op.into(),
            h,
            n,
            t,
            ring_len: ring,
            state: state.name().into(),
            layout: layout.name().into(),
            us,
            state_bytes: bytes,
            pct_of_copy: pct,
            copy_same_us: copy_us,
            pct_of_same_copy: pct_same,
        });
        Ok(())
    }
}

/// Runs `kda-pool bench`.
pub fn run(args: Args) -> Result<(), CliError> {
    if args.backend != "cuda" {
        return Err(usage(format!(
            "--backend: '{}' is not accepted; bench measures the GPU: expected cuda",
            args.backend
        )));
    }
    let ops: Vec<Kind> = match args.op.as_str() {
        "decode" => vec![Kind::Decode],
        "spec" => vec![Kind::Spec],
        "replay" => vec![Kind::Replay],
        "all" => vec![Kind::Decode, Kind::Spec, Kind::Replay],
        "prefill" => vec![Kind::Prefill],
        other => {
            return Err(usage(format!(
                "--op: '{other}' is not accepted; expected decode, spec, replay, all or prefill"
            )))
        }
    };
    let heads = list("heads", &args.heads, positive, "positive integers")?;
    let seqs = list("seqs", &args.seqs, positive, "positive integers")?;
    let drafts = list("drafts", &args.drafts, positive, "positive integers")?;
    let spec_seqs = list("spec-seqs", &args.spec_seqs, positive, "positive integers")?;
    let prefill_lens = list(
        "prefill-lens",
        &args.prefill_lens,
        |x| {
            let (n, l) = x.split_once('x')?;
            Some((positive(n)?, positive(l)?))
        },
        "NxL with positive N (sequences) and L (tokens each), e.g. 8x4096",
    )?;
    let states = list("states", &args.states, Dtype::parse, "fp32, fp16, bf16")?;
    let layouts = list(
        "layouts",
        &args.layouts,
        StateLayout::parse,
        "kfirst, vfirst",
    )?;
    let warps = match &args.warps {
        Some(w) => list(
            "warps",
            w,
            |x| x.parse::<u32>().ok().filter(|v| (1..=8).contains(v)),
            "1..=8",
        )?,
        None => vec![],
    };
    let stages = match &args.stages {
        Some(st) => list(
            "stages",
            st,
            |x| x.parse::<u32>().ok().filter(|v| (2..=3).contains(v)),
            "2 or 3",
        )?,
        None => vec![],
    };
    let chunk_columns = match &args.chunk_columns {
        Some(c) => list(
            "chunk-columns",
            c,
            |x| x.parse::<usize>().ok().filter(|v| [16, 32].contains(v)),
            "16 or 32",
        )?,
        None => vec![],
    };
    let dependent_launch = match args.dependent_launch.as_str() {
        "default" => None,
        "all" => Some(true),
        "none" => Some(false),
        other => {
            return Err(usage(format!(
                "--dependent-launch: '{other}' is not accepted; expected default, all or none"
            )))
        }
    };
    let forced = Forced::parse(&args.forced)?;
    let ring_rows: Vec<(&str, RingKernel)> = RING_ROWS
        .into_iter()
        .filter(|r| forced.wants(r.0))
        .collect();
    if args.replays == 0 {
        return Err(usage("--replays: 0 is not accepted; expected at least 1"));
    }
    if args.ring == 0 {
        return Err(usage(
            "--ring: 0 is not accepted; expected a ring length of at least 1",
        ));
    }
    let be = CudaBackend::new().map_err(kerr)?;
    println!("device: {}", be.device_name());
    be.set_dependent_launch(dependent_launch).map_err(kerr)?;
    println!("dependent launches: {}", args.dependent_launch);
    // every kernel module of the run, compiled in parallel before anything is timed
    let geometries: Vec<PoolGeometry> = states
        .iter()
        .flat_map(|&state| {
            layouts
                .iter()
                .map(move |&layout| bench_geometry(1, 1, 1, state, layout))
        })
        .collect();
    let kinds: &[BatchKind] = if args.padded {
        &BatchKind::ALL
    } else {
        &[BatchKind::Plain]
    };
    be.warm_up(&geometries, kinds).map_err(kerr)?;
    // warm the clocks up, then measure the copy ceiling: the best of the copy kernel's shapes
    const CEILING: usize = 1 << 30;
    be.time_copies(CEILING, 1, 50, 50).map_err(kerr)?;
    let shapes = be.time_copies(CEILING, 1, 50, 50).map_err(kerr)?;
    let mut copy_bw = 0.0f64;
    for t in &shapes {
        let bw = 2.0 * CEILING as f64 / (t.us * 1e-6);
        println!(
            "copy kernel ({}): {:.3} TB/s ({:.1} us)",
            t.shape,
            bw / 1e12,
            t.us
        );
        copy_bw = copy_bw.max(bw);
    }
    let dma_bw = be.memcpy_bandwidth(CEILING).map_err(kerr)?;
    println!(
        "device-to-device copy: {:.3} TB/s (best shape; read + write, 1 GiB, 16-byte copy kernel, graph replays); memcpy node: {:.3} TB/s",
        copy_bw / 1e12,
        dma_bw / 1e12
    );
    let mut b = Bench {
        be: &be,
        copy_bw,
        replays: args.replays,
        rows: Vec::new(),
        copy_same: HashMap::new(),
    };
    b.launch_floor()?;

    for &kind in &ops {
        for &layout in &layouts {
            for &h in &heads {
                for &state in &states {
                    match kind {
                        Kind::Decode => {
                            for &n in &seqs {
                                // eager
                                let mut s = setup(&be, h, n, 1, 0, state, layout, None)?;
                                for set in 0..s.batches.len() {
                                    enqueue(&be, &mut s, kind, set, None).map_err(kerr)?;
                                }
                                let (sb, sets) = (s.state_bytes(), s.batches.len());
                                // one row of this eager case (state read and written once)
                                let row = |b: &mut Bench, op: &str, us: f64| {
                                    b.record(op, h, n, 1, 0, state, layout, sets, us, 2.0 * sb)
                                };
                                let us = b.time(&mut s, kind, None)?;
                                row(&mut b, "decode", us)?;
                                if args.issue_calls > 0 {
                                    let us = b.time_issue(&mut s, kind, None, args.issue_calls)?;
                                    row(&mut b, "decode-issue", us)?;
                                }
                                // each eager kernel, same run (before/after)
                                for (op, k) in EAGER_ROWS.into_iter().filter(|r| forced.wants(r.0))
                                {
                                    be.set_eager_kernel(Some(k)).map_err(kerr)?;
                                    let us = b.time(&mut s, kind, None)?;
                                    row(&mut b, &format!("decode-{op}"), us)?;
                                }
                                be.set_eager_kernel(None).map_err(kerr)?;
                                for &w in &warps {
                                    be.set_eager_warps(Some(w)).map_err(kerr)?;
                                    let us = b.time(&mut s, kind, None)?;
                                    row(&mut b, &format!("decode-w{w}"), us)?;
                                    for (op, k) in [
                                        ("staged", EagerKernel::StagedTile),
                                        ("bulk", EagerKernel::BulkTile),
                                        ("bulkin", EagerKernel::BulkInTile),
                                    ] {
                                        be.set_eager_kernel(Some(k)).map_err(kerr)?;
                                        let us = b.time(&mut s, kind, None)?;
                                        row(&mut b, &format!("decode-{op}-w{w}"), us)?;
                                    }
                                    be.set_eager_kernel(None).map_err(kerr)?;
                                }
                                be.set_eager_warps(None).map_err(kerr)?;
                                for &st in &stages {
                                    be.set_eager_stages(Some(st)).map_err(kerr)?;
                                    for &w in &warps {
                                        be.set_eager_warps(Some(w)).map_err(kerr)?;
                                        let us = b.time(&mut s, kind, None)?;
                                        row(&mut b, &format!("decode-s{st}w{w}"), us)?;
                                    }
                                    be.set_eager_warps(None).map_err(kerr)?;
                                }
                                be.set_eager_stages(None).map_err(kerr)?;
                                if args.padded {
                                    s.pad(&be)?;
                                    let us = b.time(&mut s, kind, None)?;
                                    row(&mut b, "decode-padded", us)?;
                                }
                                drop(s);
                                // with a ring
                                let l = args.ring;
                                let mut s = setup(&be, h, n, 1, l, state, layout, None)?;
                                for set in 0..s.batches.len() {
                                    enqueue(&be, &mut s, kind, set, None).map_err(kerr)?;
                                }
                                let (sb, eb) = (s.state_bytes(), s.entry_bytes());
                                let sets = s.batches.len();
                                let us = b.time(&mut s, kind, None)?;
                                let bytes = sb + sb / l as f64 + eb * ((l + 1) as f64 / 2.0 + 1.0);
                                b.record("decode", h, n, 1, l, state, layout, sets, us, bytes)?;
                                // each ring kernel, same run: kda_ring, kda_ring_tile, kda_step
                                for &(op, k) in &ring_rows {
                                    be.set_ring_kernel(Some(k)).map_err(kerr)?;
                                    let us = b.time(&mut s, kind, None)?;
                                    let op = format!("decode-{op}");
                                    b.record(&op, h, n, 1, l, state, layout, sets, us, bytes)?;
                                }
                                be.set_ring_kernel(None).map_err(kerr)?;
                                if args.padded {
                                    s.pad(&be)?;
                                    let us = b.time(&mut s, kind, None)?;
                                    let op = "decode-padded";
                                    b.record(op, h, n, 1, l, state, layout, sets, us, bytes)?;
                                }
                            }
                        }
                        Kind::Prefill => {
                            for &(n, l) in &prefill_lens {
                                // the inputs, not the states, are a prefill's bytes: two slot
                                // sets alternate (their states are read and written once a call)
                                let mut s = setup(&be, h, n, l, 0, state, layout, Some(2))?;
                                for set in 0..s.batches.len() {
                                    enqueue(&be, &mut s, kind, set, None).map_err(kerr)?;
                                }
                                let (sb, sets) = (s.state_bytes(), s.batches.len());
                                // the default (the choice by the call's shape), the token
                                // loop, each of --warps (warps per CTA) token by token, then
                                // the chunked kernels, and with each of --chunk-columns
                                let steps = Some(PrefillKernel::Steps);
                                let mut rows = vec![
                                    ("prefill".to_string(), None, None, None),
                                    ("prefill-steps".to_string(), None, steps, None),
                                ];
                                rows.extend(
                                    warps
                                        .iter()
                                        .map(|&w| (format!("prefill-w{w}"), Some(w), steps, None)),
                                );
                                let chunked = Some(PrefillKernel::Chunked);
                                rows.push(("prefill-chunked".to_string(), None, chunked, None));
                                rows.extend(chunk_columns.iter().map(|&c| {
                                    (format!("prefill-chunked-c{c}"), None, chunked, Some(c))
                                }));
                                for (op, w, pk, cols) in rows {
                                    be.set_eager_warps(w).map_err(kerr)?;
                                    be.set_prefill_kernel(pk).map_err(kerr)?;
                                    be.set_chunk_state_columns(cols).map_err(kerr)?;
                                    // the chunked kernels' tables and scratch made before the
                                    // graph's capture (where the row's choice takes them)
                                    for set in 0..s.batches.len() {
                                        enqueue(&be, &mut s, kind, set, None).map_err(kerr)?;
                                    }
                                    let us = b.time(&mut s, kind, None)?;
                                    b.record(&op, h, n, l, 0, state, layout, sets, us, 2.0 * sb)?;
                                    println!(
                                        "{op:<8} H={h:<3} {n} x {l} tokens: {:.2} Mtok/s",
                                        (n * l) as f64 / us
                                    );
                                }
                                be.set_eager_warps(None).map_err(kerr)?;
                                be.set_prefill_kernel(None).map_err(kerr)?;
                                be.set_chunk_state_columns(None).map_err(kerr)?;
                            }
                        }
                        Kind::Spec => {
                            for (&t, &n) in drafts
                                .iter()
                                .flat_map(|t| spec_seqs.iter().map(move |n| (t, n)))
                            {
                                let l = 2 * (t + 1);
                                let mut s = setup(&be, h, n, t, l, state, layout, None)?;
                                let zeros =
                                    be.memory().upload_slice(&vec![0u32; n]).map_err(perr)?;
                                // accepted counts 1..=T, fixed (the drafts of the previous verify)
                                let acc: Vec<u32> =
                                    (0..n).map(|i| 1 + (i * 7 % t) as u32).collect();
                                let acc_buf = be.memory().upload_slice(&acc).map_err(perr)?;
                                for set in 0..s.batches.len() {
                                    enqueue(&be, &mut s, kind, set, Some(&zeros)).map_err(kerr)?;
                                }
                                be.check_device_errors().map_err(kerr)?;
                                let (store_frac, folded) = simulate_spec(&acc, t, l, 64);
                                let (sb, eb) = (s.state_bytes(), s.entry_bytes());
                                let sets = s.batches.len();
                                let bytes = sb * (1.0 + store_frac) + eb * (folded + t as f64);
                                // the default kernel, then each ring kernel forced
                                let us = b.time(&mut s, kind, Some(&acc_buf))?;
                                b.record("spec", h, n, t, l, state, layout, sets, us, bytes)?;
                                for &(op, k) in &ring_rows {
                                    be.set_ring_kernel(Some(k)).map_err(kerr)?;
                                    let us = b.time(&mut s, kind, Some(&acc_buf))?;
                                    let op = format!("spec-{op}");
                                    b.record(&op, h, n, t, l, state, layout, sets, us, bytes)?;
                                }
                                be.set_ring_kernel(None).map_err(kerr)?;
                                if args.padded {
                                    s.pad(&be)?;
                                    let us = b.time(&mut s, kind, Some(&acc_buf))?;
                                    let op = "spec-padded";
                                    b.record(op, h, n, t, l, state, layout, sets, us, bytes)?;
                                }
                            }
                        }
                        Kind::Replay => {
                            for &n in seqs.iter().filter(|&&n| n > 1) {
                                let l = args.ring;
                                let mut s = setup(&be, h, n, 0, l, state, layout, None)?;
                                // every slot's ring full of pending entries before each flush:
                                // a graph of (reset the records, replay) minus (reset alone)
                                let full: Vec<u32> = (0..s.geometry.total_slots())
                                    .flat_map(|_| [l as u32, l as u32, 0, 0])
                                    .collect();
                                let template = be.memory().upload_slice(&full).map_err(perr)?;
                                let bytes_meta = full.len() * 4;
                                let reset =
                                    |s: &mut Setup| -> Result<(), kda_kernels::KernelError> {
                                        be.copy_device(&template, &mut s.planes.meta, bytes_meta)
                                    };
                                reset(&mut s).map_err(kerr)?;
                                for set in 0..s.batches.len() {
                                    enqueue(&be, &mut s, kind, set, None).map_err(kerr)?;
                                }
                                let sets = s.batches.len();
                                let (sb, eb) = (s.state_bytes(), s.entry_bytes());
                                // the resets alone, subtracted from each kernel's graph
                                let g_reset = be
                                    .capture(|| {
                                        for _ in 0..sets {
                                            reset(&mut s)?;
                                        }
                                        Ok(())
                                    })
                                    .map_err(kerr)?;
                                let only = be.time_graph(&g_reset, 3, b.replays).map_err(kerr)?;
                                // the default kernel, then each ring kernel (kda_ring,
                                // kda_ring_tile, kda_step), same run; a graph keeps the kernel
                                // chosen at its capture
                                let rows = std::iter::once(("replay".to_string(), None)).chain(
                                    ring_rows
                                        .iter()
                                        .map(|&(op, k)| (format!("replay-{op}"), Some(k))),
                                );
                                for (op, k) in rows {
                                    be.set_ring_kernel(k).map_err(kerr)?;
                                    let g_both = be
                                        .capture(|| {
                                            for set in 0..sets {
                                                reset(&mut s)?;
                                                enqueue(&be, &mut s, kind, set, None)?;
                                            }
                                            Ok(())
                                        })
                                        .map_err(kerr)?;
                                    let both =
                                        be.time_graph(&g_both, 3, b.replays).map_err(kerr)?;
                                    be.check_device_errors().map_err(kerr)?;
                                    let us = (both - only) / sets as f64;
                                    b.record(
                                        &op,
                                        h,
                                        n,
                                        0,
                                        l,
                                        state,
                                        layout,
                                        sets,
                                        us,
                                        2.0 * sb + eb * l as f64,
                                    )?;
                                }
                                be.set_ring_kernel(None).map_err(kerr)?;
                            }
                        }
                    }
                }
            }
        }
    }

    if let Some(path) = &args.json {
        let text =
            serde_json::to_string_pretty(&b.rows).map_err(|e| CliError::Failed(e.to_string()))?;
        std::fs::write(path, text + "\n")
            .map_err(|e| usage(format!("--json: cannot write {}: {e}", path.display())))?;
        println!("wrote {} rows to {}", b.rows.len(), path.display());
    }
    Ok(())
}
