//! The model shape the pool is sized for ([`KdaShape`]) and its two loaders: the project's own
//! JSON schema (the files in `configs/`) and a Hugging Face `config.json` with a
//! `linear_attn_config` (Kimi-Linear style).
//!
//! The project schema (one object; unknown fields are refused):
//!
//! | field | meaning | default |
//! |---|---|---|
//! | `name` | a short name | the file's stem |
//! | `description` | free text | |
//! | `kda_layers` | number of KDA layers | required |
//! | `num_heads` | q/k heads of the model (all ranks) | required |
//! | `num_v_heads` | value heads of the model, a multiple of `num_heads` | `num_heads` |
//! | `head_k_dim`, `head_v_dim` | K and V | required |
//! | `conv_kernel` | short-conv kernel width (state keeps `conv_kernel - 1` rows) | required |
//! | `conv_dtype` | element type of the conv state | `bf16` |
//! | `state_layout` | `kfirst` or `vfirst` | `kfirst` |
//! | `tp` | tensor-parallel ranks the heads are split over | 1 |
//! | `state_dtype` | the config-file level of the state dtype decision | unset |
//! | `kv_bytes_per_token` | KV-cache bytes per token over all full-attention layers | unset |
//!
//! From an HF config, the KV bytes per token of MLA are
//! `len(full_attn_layers) x (kv_lora_rank + qk_rope_head_dim) x 2` (the compressed latent and
//! the rope key, bf16). MLA caches the latent once per token and layer, not per head, so the
//! figure is the same on every tensor-parallel rank.

use std::path::Path;

use serde_json::{Map, Value};

use crate::dtype::{Dtype, DtypeInput};
use crate::error::{PoolError, Result};
use crate::layout::StateLayout;

/// The KDA part of a model: layer count, heads of the whole model, head dims, conv kernel, conv
/// dtype, state layout, and the TP size that splits the heads over ranks.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct KdaShape {
    /// A short name (for reports).
    pub name: String,
    /// KDA layers.
    pub kda_layers: usize,
    /// q/k heads of the model, all ranks together.
    pub num_heads: usize,
    /// Value heads of the model, all ranks together (a multiple of `num_heads`).
    pub num_v_heads: usize,
    /// Key head dim K.
    pub head_k_dim: usize,
    /// Value head dim V.
    pub head_v_dim: usize,
    /// Short-conv kernel width; the conv state keeps `conv_kernel - 1` rows.
    pub conv_kernel: usize,
    /// Element type of the conv state (its own setting, bf16 by default).
    pub conv_dtype: Dtype,
    /// Storage layout of each head's state.
    pub layout: StateLayout,
    /// Tensor-parallel ranks the heads are split over.
    pub tp: usize,
}

impl KdaShape {
    /// Checks every field: positive sizes, `num_v_heads` a multiple of `num_heads`, and `tp`
    /// dividing both head counts.
    pub fn validate(&self) -> Result<()> {
        for (arg, value) in [
            ("kda_layers", self.kda_layers),
            ("num_heads", self.num_heads),
            ("num_v_heads", self.num_v_heads),
            ("head_k_dim", self.head_k_dim),
            ("head_v_dim", self.head_v_dim),
            ("conv_kernel", self.conv_kernel),
        ] {
            if value == 0 {
                return Err(PoolError::arg(arg, "is 0; expected a positive integer"));
            }
        }
        if !self.num_v_heads.is_multiple_of(self.num_heads) {
            return Err(PoolError::arg(
                "num_v_heads",
                format!(
                    "{} is not a multiple of num_heads {}",
                    self.num_v_heads, self.num_heads
                ),
            ));
        }
        self.heads_per_rank().map(|_| ())
    }

    /// q/k and value heads of one rank: `(num_heads / tp, num_v_heads / tp)`. An error unless
    /// `tp` divides both.
    pub fn heads_per_rank(&self) -> Result<(usize, usize)> {
        let tp = self.tp;
        if tp == 0 || !self.num_heads.is_multiple_of(tp) || !self.num_v_heads.is_multiple_of(tp) {
            let divisors = common_divisors(self.num_heads, self.num_v_heads);
            let problem = if tp == 0 {
                "0 is not a number of ranks".to_string()
            } else {
                format!("{tp} does not divide the heads")
            };
            return Err(PoolError::arg(
                "tp",
                format!(
                    "{problem}; accepted: a divisor of the {} q/k heads and {} value heads of {}: {}",
                    self.num_heads,
                    self.num_v_heads,
                    self.name,
                    divisors
                ),
            ));
        }
        Ok((self.num_heads / tp, self.num_v_heads / tp))
    }

    /// The same model at another TP size (an error unless `tp` divides the heads).
    pub fn with_tp(&self, tp: usize) -> Result<Self> {
        let shape = Self { tp, ..self.clone() };
        shape.heads_per_rank()?;
        Ok(shape)
    }

    /// Rows of conv state per slot and layer: `conv_kernel - 1`.
    pub fn conv_rows(&self) -> usize {
        self.conv_kernel.saturating_sub(1)
    }

    /// Conv-state channels of one rank: q and k (`H * K` each) and v (`HV * V`).
    pub fn conv_channels_per_rank(&self) -> Result<usize> {
        let (h, hv) = self.heads_per_rank()?;
        h.checked_mul(self.head_k_dim)
            .and_then(|qk| qk.checked_mul(2))
            .and_then(|qk| qk.checked_add(hv.checked_mul(self.head_v_dim)?))
            .ok_or_else(|| {
                PoolError::arg(
                    "head_k_dim",
                    format!(
                        "the conv channels 2 x {h} x {} + {hv} x {} overflow",
                        self.head_k_dim, self.head_v_dim
                    ),
                )
            })
    }
}

/// The common divisors of `a` and `b` for an error message (only the count's size when it is
/// too large to list).
fn common_divisors(a: usize, b: usize) -> String {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    if x > 1 << 20 {
        return format!("a divisor of {x}");
    }
    let list: Vec<String> = (1..=x)
        .filter(|&d| x.is_multiple_of(d))
        .map(|d| d.to_string())
        .collect();
    list.join(", ")
}

/// MLA KV-cache bytes per token over all full-attention layers:
/// `full_attn_layers x (kv_lora_rank + qk_rope_head_dim) x 2` (bf16). The same on every rank.
/// `None` when it overflows `u64`.
pub fn mla_kv_bytes_per_token(
    full_attn_layers: usize,
    kv_lora_rank: usize,
    qk_rope_head_dim: usize,
) -> Option<u64> {
    (kv_lora_rank as u64)
        .checked_add(qk_rope_head_dim as u64)?
        .checked_mul(full_attn_layers as u64)?
        .checked_mul(2)
}

/// A loaded model configuration: the shape plus the optional settings a file may carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    /// The KDA shape.
    pub shape: KdaShape,
    /// The file's `state_dtype` field, as written (already checked to parse).
    pub state_dtype: Option<String>,
    /// KV-cache bytes per token over all full-attention layers, when the file gives them.
    pub kv_bytes_per_token: Option<u64>,
    /// Where it was loaded from (a path, or a name for an embedded preset).
    pub source: String,
    state_dtype_source: String,
}

/// Fields of the project schema, for the unknown-field error.
const PROJECT_FIELDS: [&str; 13] = [
    "name",
    "description",
    "kda_layers",
    "num_heads",
    "num_v_heads",
    "head_k_dim",
    "head_v_dim",
    "conv_kernel",
    "conv_dtype",
    "state_layout",
    "tp",
    "state_dtype",
    "kv_bytes_per_token",
];

impl ModelConfig {
    /// Loads a file of the project's schema.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        Self::from_json_str(&read_file(path)?, &path.display().to_string())
    }

    /// Loads a Hugging Face `config.json` with a `linear_attn_config`.
    pub fn load_hf(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        Self::from_hf_str(&read_file(path)?, &path.display().to_string())
    }

    /// Parses the project's schema; `source` names the file in errors.
    pub fn from_json_str(text: &str, source: &str) -> Result<Self> {
        let root = parse_object(text, source)?;
        let f = Fields::new(&root, source, "");
        if let Some(unknown) = root.keys().find(|k| !PROJECT_FIELDS.contains(&k.as_str())) {
            return Err(f.err(format!(
                "unknown field `{unknown}`; accepted fields: {}",
                PROJECT_FIELDS.join(", ")
            )));
        }
        let kda_layers = f.req_usize("kda_layers")?;
        let num_heads = f.req_usize("num_heads")?;
        let conv_dtype = match f.opt_str("conv_dtype")? {
            Some(s) => parse_dtype_field(&f, "conv_dtype", s)?,
            None => Dtype::Bf16,
        };
        let layout = match f.opt_str("state_layout")? {
            Some(s) => StateLayout::parse(s).ok_or_else(|| {
                f.err(format!(
                    "field `state_layout`: unknown value {s:?}; accepted: kfirst, vfirst"
                ))
            })?,
            None => StateLayout::KFirst,
        };
        let state_dtype = match f.opt_str("state_dtype")? {
            Some(s) => {
                parse_dtype_field(&f, "state_dtype", s)?;
                Some(s.to_string())
            }
            None => None,
        };
        let shape = KdaShape {
            name: match f.opt_str("name")? {
                Some(n) => n.to_string(),
                None => stem(source),
            },
            kda_layers,
            num_heads,
            num_v_heads: f.opt_usize("num_v_heads")?.unwrap_or(num_heads),
            head_k_dim: f.req_usize("head_k_dim")?,
            head_v_dim: f.req_usize("head_v_dim")?,
            conv_kernel: f.req_usize("conv_kernel")?,
            conv_dtype,
            layout,
            tp: f.opt_usize("tp")?.unwrap_or(1),
        };
        let _ = f.opt_str("description")?;
        let kv_bytes_per_token = f.opt_usize("kv_bytes_per_token")?.map(|b| b as u64);
        Self::finish(shape, state_dtype, kv_bytes_per_token, source)
    }

    /// Parses a Hugging Face `config.json` (Kimi-Linear style): `linear_attn_config.kda_layers`
    /// (a 1-indexed list, unless `kda_layer_index_base` says 0), `num_heads`, `head_dim` (K = V),
    /// `short_conv_kernel_size`; optionally `full_attn_layers` with the top-level MLA fields
    /// `kv_lora_rank` and `qk_rope_head_dim` for the KV bytes per token. A multimodal config's
    /// `text_config` is searched when the top level has no `linear_attn_config`. The conv dtype
    /// is bf16, the layout K-first and TP 1.
    pub fn from_hf_str(text: &str, source: &str) -> Result<Self> {
        let root = parse_object(text, source)?;
        let (top, top_prefix) =
            if !root.contains_key("linear_attn_config") && root.contains_key("text_config") {
                let f = Fields::new(&root, source, "");
                (f.req_object("text_config")?, "text_config.")
            } else {
                (&root, "")
            };
        let f = Fields::new(top, source, top_prefix);
        let lin_prefix = format!("{top_prefix}linear_attn_config.");
        let lin = Fields::new(f.req_object("linear_attn_config")?, source, &lin_prefix);

        let total_layers = f.opt_usize("num_hidden_layers")?;
        let base = match lin.opt_index("kda_layer_index_base")? {
            None | Some(1) => 1,
            Some(0) => 0,
            Some(b) => {
                return Err(lin.err(format!(
                "field `{lin_prefix}kda_layer_index_base`: {b} is not accepted; expected 0 or 1"
            )))
            }
        };
        let kda = lin.req_index_list("kda_layers", base, total_layers)?;
        let full = lin.opt_index_list("full_attn_layers", base, total_layers)?;
        if let Some(full) = &full {
            if let Some(l) = kda.iter().find(|l| full.contains(l)) {
                return Err(lin.err(format!(
                    "layer {} is listed in both `{lin_prefix}kda_layers` and `{lin_prefix}full_attn_layers`",
                    l + base
                )));
            }
        }
        let heads = lin.req_usize("num_heads")?;
        let head_dim = lin.req_usize("head_dim")?;
        let kernel = lin.req_usize("short_conv_kernel_size")?;

        let lora = f.opt_usize("kv_lora_rank")?;
        let rope = f.opt_usize("qk_rope_head_dim")?;
        let kv_bytes_per_token = match (&full, lora, rope) {
            (None, None, None) => None,
            (Some(full), Some(lora), Some(rope)) => Some(
                mla_kv_bytes_per_token(full.len(), lora, rope).ok_or_else(|| {
                    f.err(format!(
                        "fields `{top_prefix}kv_lora_rank` {lora} and `{top_prefix}qk_rope_head_dim` {rope}: the KV bytes per token overflow"
                    ))
                })?,
            ),
            _ => {
                let missing = if full.is_none() {
                    format!("{lin_prefix}full_attn_layers")
                } else if lora.is_none() {
                    format!("{top_prefix}kv_lora_rank")
                } else {
                    format!("{top_prefix}qk_rope_head_dim")
                };
                return Err(f.err(format!(
                    "missing field `{missing}` (the KV bytes per token need full_attn_layers, \
                     kv_lora_rank and qk_rope_head_dim together)"
                )));
            }
        };
        let shape = KdaShape {
            name: stem(source),
            kda_layers: kda.len(),
            num_heads: heads,
            num_v_heads: heads,
            head_k_dim: head_dim,
            head_v_dim: head_dim,
            conv_kernel: kernel,
            conv_dtype: Dtype::Bf16,
            layout: StateLayout::KFirst,
            tp: 1,
        };
        Self::finish(shape, None, kv_bytes_per_token, source)
    }

    fn finish(
        shape: KdaShape,
        state_dtype: Option<String>,
        kv_bytes_per_token: Option<u64>,
        source: &str,
    ) -> Result<Self> {
        shape.validate().map_err(|e| match e {
            PoolError::InvalidArgument { arg, msg } => PoolError::Config {
                path: source.to_string(),
                msg: format!("field `{arg}`: {msg}"),
            },
            other => other,
        })?;
        Ok(Self {
            shape,
            state_dtype,
            kv_bytes_per_token,
            source: source.to_string(),
            state_dtype_source: format!("{source} (state_dtype)"),
        })
    }

    /// The file's `state_dtype`, ready for [`crate::dtype::resolve_state_dtype`]'s config level.
    pub fn state_dtype_input(&self) -> Option<DtypeInput<'_>> {
        self.state_dtype
            .as_deref()
            .map(|v| DtypeInput::new(v, &self.state_dtype_source))
    }
}

fn read_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| PoolError::Config {
        path: path.display().to_string(),
        msg: format!("cannot read: {e}"),
    })
}

fn parse_object(text: &str, source: &str) -> Result<Map<String, Value>> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(PoolError::Config {
            path: source.to_string(),
            msg: format!("expected a JSON object, found {}", kind(&other)),
        }),
        Err(e) => Err(PoolError::Config {
            path: source.to_string(),
            msg: format!("not valid JSON: {e}"),
        }),
    }
}

/// A model name from a file name: its stem, or for a file named `config.json` (a Hugging Face
/// snapshot) the directory's name.
fn stem(source: &str) -> String {
    let path = Path::new(source);
    let name = |p: Option<&std::ffi::OsStr>| p.map(|s| s.to_string_lossy().into_owned());
    let stem = name(path.file_stem());
    if stem.as_deref() == Some("config") {
        if let Some(dir) = name(path.parent().and_then(|p| p.file_name())) {
            return dir;
        }
    }
    stem.unwrap_or_else(|| source.to_string())
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn parse_dtype_field(f: &Fields<'_>, name: &str, value: &str) -> Result<Dtype> {
    Dtype::parse(value).ok_or_else(|| {
        f.err(format!(
            "field `{}{name}`: unknown dtype {value:?}; accepted: {}",
            f.prefix,
            crate::dtype::ACCEPTED_DTYPES
        ))
    })
}

/// Reads typed fields of one JSON object, with errors that name the field and the file.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    file: &'a str,
    prefix: &'a str,
}

impl<'a> Fields<'a> {
    fn new(obj: &'a Map<String, Value>, file: &'a str, prefix: &'a str) -> Self {
        Self { obj, file, prefix }
    }

    fn err(&self, msg: String) -> PoolError {
        PoolError::Config {
            path: self.file.to_string(),
            msg,
        }
    }

    fn missing(&self, name: &str, expected: &str) -> PoolError {
        self.err(format!(
            "missing field `{}{name}` (expected {expected})",
            self.prefix
        ))
    }

    fn malformed(&self, name: &str, expected: &str, got: &Value) -> PoolError {
        self.err(format!(
            "field `{}{name}`: expected {expected}, got {got}",
            self.prefix
        ))
    }

    fn present(&self, name: &str) -> Option<&'a Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    fn opt_usize(&self, name: &str) -> Result<Option<usize>> {
        const EXPECTED: &str = "a positive integer";
        match self.present(name) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 && usize::try_from(n).is_ok() => Ok(Some(n as usize)),
                _ => Err(self.malformed(name, EXPECTED, v)),
            },
        }
    }

    /// A non-negative integer (0 allowed).
    fn opt_index(&self, name: &str) -> Result<Option<usize>> {
        match self.present(name) {
            None => Ok(None),
            Some(v) => match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
                Some(n) => Ok(Some(n)),
                None => Err(self.malformed(name, "a non-negative integer", v)),
            },
        }
    }

    fn req_usize(&self, name: &str) -> Result<usize> {
        self.opt_usize(name)?
            .ok_or_else(|| self.missing(name, "a positive integer"))
    }

    fn opt_str(&self, name: &str) -> Result<Option<&'a str>> {
        match self.present(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.malformed(name, "a string", v)),
        }
    }

    fn req_object(&self, name: &str) -> Result<&'a Map<String, Value>> {
        match self.present(name) {
            None => Err(self.missing(name, "an object")),
            Some(Value::Object(m)) => Ok(m),
            Some(v) => Err(self.malformed(name, "an object", v)),
        }
    }

    /// A list of distinct layer indices (`base`-indexed, below `base + total` when known),
    /// returned 0-indexed.
    fn opt_index_list(
        &self,
        name: &str,
        base: usize,
        total: Option<usize>,
    ) -> Result<Option<Vec<usize>>> {
        let expected = format!("a list of distinct {base}-indexed layer numbers");
        let Some(v) = self.present(name) else {
            return Ok(None);
        };
        let Value::Array(items) = v else {
            return Err(self.malformed(name, &expected, v));
        };
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            let idx = item
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|&n| n >= base)
                .ok_or_else(|| self.malformed(name, &expected, item))?;
            let idx = idx - base;
            if let Some(total) = total {
                if idx >= total {
                    return Err(self.err(format!(
                        "field `{}{name}`: layer {} is beyond num_hidden_layers {total}",
                        self.prefix,
                        idx + base
                    )));
                }
            }
            if out.contains(&idx) {
                return Err(self.err(format!(
                    "field `{}{name}`: layer {} is listed twice",
                    self.prefix,
                    idx + base
                )));
            }
            out.push(idx);
        }
        Ok(Some(out))
    }

    fn req_index_list(&self, name: &str, base: usize, total: Option<usize>) -> Result<Vec<usize>> {
        match self.opt_index_list(name, base, total)? {
            Some(list) if !list.is_empty() => Ok(list),
            Some(_) => Err(self.err(format!(
                "field `{}{name}`: the list is empty; expected at least one KDA layer",
                self.prefix
            ))),
            None => Err(self.missing(name, "a list of layer numbers")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K3: &str = include_str!("../../../configs/kimi-k3-tp8.json");
    const LINEAR: &str = include_str!("../../../configs/kimi-linear-48b-a3b.json");
    const LINEAR_HF: &str = include_str!("../../../configs/hf/kimi-linear-48b-a3b-config.json");

    #[test]
    fn k3_preset_is_twelve_heads_per_rank_at_tp8() {
        let m = ModelConfig::from_json_str(K3, "kimi-k3-tp8.json").unwrap();
        let s = &m.shape;
        assert_eq!(s.kda_layers, 69);
        assert_eq!(s.heads_per_rank().unwrap(), (12, 12));
        assert_eq!((s.head_k_dim, s.head_v_dim), (128, 128));
        assert_eq!(s.conv_rows(), 3);
        assert_eq!(s.conv_channels_per_rank().unwrap(), 4608);
        assert_eq!(s.conv_dtype, Dtype::Bf16);
        assert_eq!(s.layout, StateLayout::KFirst);
    }

    #[test]
    fn hf_config_and_project_file_agree_on_kimi_linear() {
        let hf = ModelConfig::from_hf_str(LINEAR_HF, "kimi-linear-48b-a3b.json").unwrap();
        let own = ModelConfig::from_json_str(LINEAR, "kimi-linear-48b-a3b.json").unwrap();
        assert_eq!(hf.shape, own.shape);
        assert_eq!(hf.shape.kda_layers, 20);
        assert_eq!(hf.shape.num_heads, 32);
        assert_eq!(hf.shape.conv_kernel, 4);
        // 7 MLA layers x (512 + 64) x 2 bytes.
        assert_eq!(hf.kv_bytes_per_token, Some(8064));
        assert_eq!(own.kv_bytes_per_token, Some(8064));
    }

    #[test]
    fn hf_snapshot_config_is_named_after_its_directory() {
        assert_eq!(
            stem("/hub/Kimi-Linear-48B-A3B-Instruct/config.json"),
            "Kimi-Linear-48B-A3B-Instruct"
        );
        assert_eq!(stem("configs/kimi-k3-tp8.json"), "kimi-k3-tp8");
    }

    #[test]
    fn hf_zero_based_layer_lists_are_accepted_when_declared() {
        let text = r#"{"linear_attn_config": {"kda_layer_index_base": 0, "kda_layers": [0, 1],
            "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4}}"#;
        assert_eq!(
            ModelConfig::from_hf_str(text, "c.json")
                .unwrap()
                .shape
                .kda_layers,
            2
        );
        let e = hf_err(
            r#"{"linear_attn_config": {"kda_layer_index_base": 2, "kda_layers": [2],
            "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4}}"#,
        );
        assert!(e.contains("kda_layer_index_base"), "{e}");
    }

    #[test]
    fn huge_sizes_are_errors_not_overflows() {
        let e = hf_err(
            r#"{"kv_lora_rank": 18446744073709551615, "qk_rope_head_dim": 8,
            "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 4,
            "head_dim": 16, "short_conv_kernel_size": 4}}"#,
        );
        assert!(e.contains("overflow"), "{e}");
        let m = ModelConfig::from_json_str(
            r#"{"kda_layers": 2, "num_heads": 4294967296, "head_k_dim": 4294967296,
            "head_v_dim": 8, "conv_kernel": 4}"#,
            "m.json",
        )
        .unwrap();
        assert!(m.shape.conv_channels_per_rank().is_err());
        let start = std::time::Instant::now();
        let e = own_err(
            r#"{"kda_layers": 2, "num_heads": 18446744073709551615, "head_k_dim": 16,
            "head_v_dim": 8, "conv_kernel": 4, "tp": 2}"#,
        );
        assert!(e.contains("a divisor of 18446744073709551615"), "{e}");
        assert!(start.elapsed() < std::time::Duration::from_secs(1));
    }

    #[test]
    fn hf_config_without_mla_fields_has_no_kv_geometry() {
        let text = r#"{"linear_attn_config": {"kda_layers": [1, 2], "num_heads": 4,
            "head_dim": 16, "short_conv_kernel_size": 4}}"#;
        let m = ModelConfig::from_hf_str(text, "c.json").unwrap();
        assert_eq!(m.kv_bytes_per_token, None);
        assert_eq!(m.shape.kda_layers, 2);
    }

    #[test]
    fn hf_config_in_text_config_is_found() {
        let text = r#"{"text_config": {"linear_attn_config": {"kda_layers": [1, 3],
            "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 3}}}"#;
        let m = ModelConfig::from_hf_str(text, "c.json").unwrap();
        assert_eq!((m.shape.kda_layers, m.shape.conv_rows()), (2, 2));
    }

    fn hf_err(text: &str) -> String {
        ModelConfig::from_hf_str(text, "c.json")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn hf_missing_field_names_the_field_and_file() {
        let e = hf_err(
            r#"{"linear_attn_config": {"kda_layers": [1], "head_dim": 16, "short_conv_kernel_size": 4}}"#,
        );
        assert!(
            e.contains("c.json") && e.contains("linear_attn_config.num_heads"),
            "{e}"
        );
        let e = hf_err(r#"{"model_type": "x"}"#);
        assert!(e.contains("missing field `linear_attn_config`"), "{e}");
    }

    #[test]
    fn hf_partial_mla_fields_are_an_error() {
        let e = hf_err(
            r#"{"kv_lora_rank": 512, "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2],
            "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4}}"#,
        );
        assert!(e.contains("qk_rope_head_dim"), "{e}");
    }

    #[test]
    fn hf_zero_index_in_one_indexed_list_is_malformed() {
        let e = hf_err(
            r#"{"linear_attn_config": {"kda_layers": [0, 1], "num_heads": 4, "head_dim": 16,
            "short_conv_kernel_size": 4}}"#,
        );
        assert!(e.contains("linear_attn_config.kda_layers"), "{e}");
    }

    #[test]
    fn hf_layer_in_both_lists_is_an_error() {
        let e = hf_err(
            r#"{"kv_lora_rank": 8, "qk_rope_head_dim": 8, "linear_attn_config": {"kda_layers": [1, 2],
            "full_attn_layers": [2], "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4}}"#,
        );
        assert!(e.contains("layer 2"), "{e}");
    }

    fn own_err(text: &str) -> String {
        ModelConfig::from_json_str(text, "m.json")
            .unwrap_err()
            .to_string()
    }

    const MINIMAL: &str =
        r#""kda_layers": 2, "num_heads": 4, "head_k_dim": 16, "head_v_dim": 8, "conv_kernel": 4"#;

    #[test]
    fn project_schema_defaults() {
        let m = ModelConfig::from_json_str(&format!("{{{MINIMAL}}}"), "dir/m.json").unwrap();
        assert_eq!(m.shape.name, "m");
        assert_eq!(m.shape.num_v_heads, 4);
        assert_eq!(m.shape.tp, 1);
        assert_eq!(m.shape.conv_dtype, Dtype::Bf16);
        assert_eq!(m.state_dtype_input(), None);
        assert_eq!(
            m.shape.conv_channels_per_rank().unwrap(),
            2 * 4 * 16 + 4 * 8
        );
    }

    #[test]
    fn project_schema_state_dtype_is_a_config_level_input() {
        let m = ModelConfig::from_json_str(
            &format!("{{{MINIMAL}, \"state_dtype\": \"half\"}}"),
            "m.json",
        )
        .unwrap();
        let input = m.state_dtype_input().unwrap();
        assert_eq!(input.value, "half");
        assert_eq!(input.source, "m.json (state_dtype)");
    }

    #[test]
    fn project_schema_refuses_bad_fields() {
        let e = own_err(&format!("{{{MINIMAL}, \"colour\": 1}}"));
        assert!(e.contains("unknown field `colour`"), "{e}");
        let e = own_err(&format!("{{{MINIMAL}, \"state_layout\": \"diagonal\"}}"));
        assert!(e.contains("state_layout") && e.contains("diagonal"), "{e}");
        let e = own_err(&format!("{{{MINIMAL}, \"state_dtype\": \"fp8\"}}"));
        assert!(e.contains("state_dtype") && e.contains("fp8"), "{e}");
        let e = own_err(&format!("{{{MINIMAL}, \"tp\": 3}}"));
        assert!(
            e.contains("m.json") && e.contains("tp") && e.contains("1, 2, 4"),
            "{e}"
        );
        let e = own_err(r#"{"kda_layers": "69"}"#);
        assert!(e.contains("`kda_layers`") && e.contains("\"69\""), "{e}");
        let e = own_err(r#"{"kda_layers": 2}"#);
        assert!(e.contains("missing field `num_heads`"), "{e}");
        let e = own_err("{not json");
        assert!(e.contains("m.json") && e.contains("not valid JSON"), "{e}");
        let e = own_err("[1]");
        assert!(e.contains("expected a JSON object"), "{e}");
    }

    #[test]
    fn missing_file_is_an_error_naming_it() {
        let e = ModelConfig::load("/nonexistent/x.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/nonexistent/x.json") && e.contains("cannot read"),
            "{e}"
        );
    }

    #[test]
    fn tp_must_divide_the_heads() {
        let m = ModelConfig::from_json_str(K3, "k3").unwrap();
        assert_eq!(
            m.shape.with_tp(4).unwrap().heads_per_rank().unwrap(),
            (24, 24)
        );
        let e = m.shape.with_tp(5).unwrap_err().to_string();
        assert!(
            e.contains("tp") && e.contains('5') && e.contains("96"),
            "{e}"
        );
        assert!(m.shape.with_tp(0).is_err());
    }
}
