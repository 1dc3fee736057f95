//! A captured KDA call read from a safetensors file (the input of `kda-pool run-op`), checked
//! tensor by tensor, and the output file it produces.
//!
//! Input tensors (token axis flattened, B = 1): `q`, `k` `[T, H, K]`, `v` `[T, HV, V]`,
//! `g` `[T, HV, K]`, `beta` `[T, HV]`, `A_log` `[HV]`, `dt_bias` `[HV*K]` (or `[HV, K]`),
//! `cu_seqlens` `[N+1]` int32/int64, optional `initial_state` `[N, HV, K, V]` (`[N, HV, V, K]`
//! when `state_layout` is `vfirst`). Float tensors are f32, f16 or bf16. Metadata strings:
//! `scale`, `use_qk_l2norm`, `use_gate_in_kernel`, `use_beta_sigmoid`, `allow_neg_eigval`
//! (`true`|`false`), `lower_bound` (the bounded gate form), `state_layout` (`kfirst`|`vfirst`).

use std::collections::HashMap;

use kda_kernels::{BetaMode, GateMode, KdaOptions};
use safetensors::{tensor::TensorView as StView, Dtype as StDtype, SafeTensors};
use state_pool::{Dtype, StateLayout};

use crate::inputs::Dims;

/// A float tensor as read: its element type and raw little-endian bytes.
#[derive(Debug, Clone)]
pub struct RawTensor {
    /// Element type.
    pub dtype: Dtype,
    /// The bytes.
    pub bytes: Vec<u8>,
    /// Number of elements.
    pub len: usize,
}

impl RawTensor {
    /// The values up-cast to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        self.dtype.decode_f32(&self.bytes)
    }
}

/// Sequence boundaries as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Offsets {
    /// int32.
    I32(Vec<i32>),
    /// int64.
    I64(Vec<i64>),
}

impl Offsets {
    /// The offsets as i64.
    pub fn to_i64(&self) -> Vec<i64> {
        match self {
            Self::I32(v) => v.iter().map(|&x| x as i64).collect(),
            Self::I64(v) => v.clone(),
        }
    }
    /// Number of sequences N.
    pub fn num_seqs(&self) -> usize {
        match self {
            Self::I32(v) => v.len().saturating_sub(1),
            Self::I64(v) => v.len().saturating_sub(1),
        }
    }
}

/// A captured call, every tensor present with the shape the others imply.
#[derive(Debug, Clone)]
pub struct CapturedCall {
    /// Tokens T.
    pub tokens: usize,
    /// Heads and head dims, inferred from `q` and `v`.
    pub dims: Dims,
    /// `[T, H, K]`.
    pub q: RawTensor,
    /// `[T, H, K]`.
    pub k: RawTensor,
    /// `[T, HV, V]`.
    pub v: RawTensor,
    /// `[T, HV, K]`.
    pub g: RawTensor,
    /// `[T, HV]`.
    pub beta: RawTensor,
    /// `[HV]` as f32, present with the gate in the kernel.
    pub a_log: Option<Vec<f32>>,
    /// `[HV * K]` as f32, present with the gate in the kernel.
    pub dt_bias: Option<Vec<f32>>,
    /// `[N + 1]`.
    pub cu_seqlens: Offsets,
    /// `[N, HV, K, V]` (or V-first) as f32.
    pub initial_state: Option<Vec<f32>>,
    /// The kernel options from the metadata.
    pub opts: KdaOptions,
    /// The state layout from the metadata.
    pub layout: StateLayout,
}

/// A problem with the input file: always the user's (exit code 2).
pub type ParseResult<T> = Result<T, String>;

fn float_dtype(name: &str, d: StDtype) -> ParseResult<Dtype> {
    match d {
        StDtype::F32 => Ok(Dtype::Fp32),
        StDtype::F16 => Ok(Dtype::Fp16),
        StDtype::BF16 => Ok(Dtype::Bf16),
        other => Err(format!(
            "tensor {name} has dtype {other:?}; expected F32, F16 or BF16"
        )),
    }
}

fn fmt_shape(s: &[usize]) -> String {
    format!(
        "[{}]",
        s.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

struct Reader<'a> {
    file: SafeTensors<'a>,
    meta: HashMap<String, String>,
}

impl<'a> Reader<'a> {
    fn tensor(&self, name: &str, expected: &str) -> ParseResult<StView<'a>> {
        self.file
            .tensor(name)
            .map_err(|_| format!("missing tensor {name}: expected {expected} (f32, f16 or bf16)"))
    }

    /// A float tensor of exactly `shape` (`what` spells the expected shape symbolically).
    fn float(&self, name: &str, shape: &[usize], what: &str) -> ParseResult<RawTensor> {
        let t = self.tensor(name, what)?;
        if t.shape() != shape {
            return Err(format!(
                "tensor {name} has shape {}; expected {what} = {}",
                fmt_shape(t.shape()),
                fmt_shape(shape)
            ));
        }
        self.raw(name, &t)
    }

    fn raw(&self, name: &str, t: &StView<'a>) -> ParseResult<RawTensor> {
        let dtype = float_dtype(name, t.dtype())?;
        Ok(RawTensor {
            dtype,
            bytes: t.data().to_vec(),
            len: t.shape().iter().product(),
        })
    }

    fn flag(&self, key: &str) -> ParseResult<bool> {
        match self.meta.get(key).map(|s| s.trim().to_ascii_lowercase()) {
            None => Ok(false),
            Some(v) if v == "true" => Ok(true),
            Some(v) if v == "false" => Ok(false),
            Some(_) => Err(format!(
                "metadata {key} is {:?}; expected \"true\" or \"false\"",
                self.meta[key]
            )),
        }
    }

    fn number(&self, key: &str) -> ParseResult<Option<f32>> {
        match self.meta.get(key) {
            None => Ok(None),
            Some(v) => match v.trim().parse::<f32>() {
                Ok(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(format!("metadata {key} is {v:?}; expected a finite number")),
            },
        }
    }
}

/// Parses and checks a captured call from the bytes of a safetensors file.
pub fn parse(bytes: &[u8]) -> ParseResult<CapturedCall> {
    let file = SafeTensors::deserialize(bytes)
        .map_err(|e| format!("not a readable safetensors file: {e}"))?;
    let (_, header) = SafeTensors::read_metadata(bytes)
        .map_err(|e| format!("not a readable safetensors file: {e}"))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let r = Reader { file, meta };

    let layout = match r.meta.get("state_layout") {
        None => StateLayout::KFirst,
        Some(s) => StateLayout::parse(s).ok_or_else(|| {
            format!("metadata state_layout is {s:?}; expected \"kfirst\" or \"vfirst\"")
        })?,
    };
    let l2norm_qk = r.flag("use_qk_l2norm")?;
    let gate_in_kernel = r.flag("use_gate_in_kernel")?;
    let beta_sigmoid = r.flag("use_beta_sigmoid")?;
    let allow_neg_eigval = r.flag("allow_neg_eigval")?;
    let scale = r.number("scale")?;
    let lower_bound = r.number("lower_bound")?;
    if let Some(lb) = lower_bound {
        if lb >= 0.0 || !gate_in_kernel {
            return Err(format!(
                "metadata lower_bound is {lb}; expected a negative number, with use_gate_in_kernel \"true\""
            ));
        }
    }

    let q = r.tensor("q", "[T, H, K]")?;
    if q.shape().len() != 3 || q.shape()[1] == 0 || q.shape()[2] == 0 {
        return Err(format!(
            "tensor q has shape {}; expected [T, H, K] with H, K > 0",
            fmt_shape(q.shape())
        ));
    }
    let (t, h, kd) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    let v_view = r.tensor("v", "[T, HV, V]")?;
    let vs = v_view.shape();
    if vs.len() != 3 || vs[0] != t || vs[1] == 0 || vs[2] == 0 || vs[1] % h != 0 {
        return Err(format!(
            "tensor v has shape {}; expected [T, HV, V] with T = {t} (from q) and HV a positive multiple of H = {h}",
            fmt_shape(vs)
        ));
    }
    let (hv, vd) = (vs[1], vs[2]);
    let dims = Dims {
        h,
        hv,
        k: kd,
        v: vd,
    };
    let q = r.raw("q", &q)?;
    let v = r.raw("v", &v_view)?;
    let k = r.float("k", &[t, h, kd], "[T, H, K]")?;
    let g = r.float("g", &[t, hv, kd], "[T, HV, K]")?;
    let beta = r.float("beta", &[t, hv], "[T, HV]")?;
    for (name, x) in [("k", &k), ("v", &v), ("g", &g), ("beta", &beta)] {
        if x.dtype != q.dtype {
            return Err(format!(
                "tensor {name} has dtype {}; expected q's dtype {} (q, k, v, g and beta share one dtype)",
                x.dtype, q.dtype
            ));
        }
    }

    let (a_log, dt_bias) = if gate_in_kernel {
        let a = r.float("A_log", &[hv], "[HV]")?.to_f32();
        let dt = r.tensor("dt_bias", "[HV*K]")?;
        if dt.shape() != [hv * kd] && dt.shape() != [hv, kd] {
            return Err(format!(
                "tensor dt_bias has shape {}; expected [HV*K] = [{}]",
                fmt_shape(dt.shape()),
                hv * kd
            ));
        }
        (Some(a), Some(r.raw("dt_bias", &dt)?.to_f32()))
    } else {
        (None, None)
    };

    let cu = r
        .file
        .tensor("cu_seqlens")
        .map_err(|_| "missing tensor cu_seqlens: expected [N+1] (int32 or int64)".to_string())?;
    if cu.shape().len() != 1 || cu.shape()[0] < 2 {
        return Err(format!(
            "tensor cu_seqlens has shape {}; expected [N+1] with N >= 1 sequences",
            fmt_shape(cu.shape())
        ));
    }
    let cu_seqlens = match cu.dtype() {
        StDtype::I32 => Offsets::I32(
            cu.data()
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        StDtype::I64 => Offsets::I64(
            cu.data()
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect(),
        ),
        other => {
            return Err(format!(
                "tensor cu_seqlens has dtype {other:?}; expected I32 or I64"
            ))
        }
    };
    let n = cu_seqlens.num_seqs();

    let initial_state = match r.file.tensor("initial_state") {
        Err(_) => None,
        Ok(s) => {
            let (shape, what) = match layout {
                StateLayout::KFirst => ([n, hv, kd, vd], "[N, HV, K, V]"),
                StateLayout::VFirst => ([n, hv, vd, kd], "[N, HV, V, K] (state_layout vfirst)"),
            };
            if s.shape() != shape {
                return Err(format!(
                    "tensor initial_state has shape {}; expected {what} = {}",
                    fmt_shape(s.shape()),
                    fmt_shape(&shape)
                ));
            }
            Some(r.raw("initial_state", &s)?.to_f32())
        }
    };

    let opts = KdaOptions {
        scale,
        l2norm_qk,
        gate: match (gate_in_kernel, lower_bound) {
            (false, _) => GateMode::Activated,
            (true, None) => GateMode::Softplus,
            (true, Some(lb)) => GateMode::LowerBound(lb),
        },
        beta: if beta_sigmoid {
            BetaMode::Sigmoid
        } else {
            BetaMode::Activated
        },
        allow_neg_eigval,
    };
    Ok(CapturedCall {
        tokens: t,
        dims,
        q,
        k,
        v,
        g,
        beta,
        a_log,
        dt_bias,
        cu_seqlens,
        initial_state,
        opts,
        layout,
    })
}

fn st_dtype(d: Dtype) -> StDtype {
    match d {
        Dtype::Fp32 => StDtype::F32,
        Dtype::Fp16 => StDtype::F16,
        Dtype::Bf16 => StDtype::BF16,
    }
}

/// The output file: `o` (`o_shape`, in `o_dtype`) and `final_state` (f32), with `metadata`.
pub fn serialize_outputs(
    o: &[u8],
    o_dtype: Dtype,
    o_shape: Vec<usize>,
    final_state: &[f32],
    state_shape: Vec<usize>,
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>, String> {
    let state_bytes: Vec<u8> = final_state.iter().flat_map(|x| x.to_le_bytes()).collect();
    let o_view = StView::new(st_dtype(o_dtype), o_shape, o).map_err(|e| e.to_string())?;
    let s_view = StView::new(StDtype::F32, state_shape, &state_bytes).map_err(|e| e.to_string())?;
    safetensors::serialize([("o", o_view), ("final_state", s_view)], Some(metadata))
        .map_err(|e| e.to_string())
}
