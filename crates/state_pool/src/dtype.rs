//! Element types of the pool's planes and the one place where the state dtype is decided.

use serde::{Deserialize, Serialize};

use crate::error::{PoolError, Result};

/// A floating-point element type: of the SSM state (the [`StateDtype`] decision), of the conv
/// state, of the replay ring and of kernel inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Dtype {
    /// IEEE binary32.
    #[default]
    #[serde(rename = "fp32")]
    Fp32,
    /// IEEE binary16.
    #[serde(rename = "fp16")]
    Fp16,
    /// bfloat16.
    #[serde(rename = "bf16")]
    Bf16,
}

/// The element type of the recurrent (SSM) state in the pool.
pub type StateDtype = Dtype;

/// The names accepted by [`Dtype::parse`], for error messages.
pub const ACCEPTED_DTYPES: &str = "fp32|float32, fp16|float16|half, bf16|bfloat16";

impl Dtype {
    /// All element types.
    pub const ALL: [Dtype; 3] = [Dtype::Fp32, Dtype::Fp16, Dtype::Bf16];

    /// Bytes per element.
    #[inline]
    pub const fn size(self) -> usize {
        match self {
            Self::Fp32 => 4,
            Self::Fp16 | Self::Bf16 => 2,
        }
    }

    /// The canonical name: `fp32`, `fp16` or `bf16`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Fp32 => "fp32",
            Self::Fp16 => "fp16",
            Self::Bf16 => "bf16",
        }
    }

    /// Parses a canonical name or an alias (float32, float16, half, bfloat16),
    /// case-insensitive, surrounding whitespace ignored. `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fp32" | "float32" | "f32" => Some(Self::Fp32),
            "fp16" | "float16" | "half" | "f16" => Some(Self::Fp16),
            "bf16" | "bfloat16" => Some(Self::Bf16),
            _ => None,
        }
    }
}

impl Dtype {
    /// The little-endian bytes of `values` in this type, rounded to nearest even for the
    /// 2-byte types.
    pub fn encode_f32(self, values: &[f32]) -> Vec<u8> {
        match self {
            Self::Fp32 => bytemuck::cast_slice(values).to_vec(),
            Self::Fp16 => values
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
            Self::Bf16 => values
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        }
    }

    /// The values held by little-endian `bytes` of this type, up-cast exactly to f32 (a
    /// trailing partial element is ignored).
    pub fn decode_f32(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            Self::Fp32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Self::Fp16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Self::Bf16 => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    }

    /// `x` rounded to nearest even in this type and widened back: the value a kernel sees
    /// after up-casting a stored `x`.
    pub fn round_f32(self, x: f32) -> f32 {
        match self {
            Self::Fp32 => x,
            Self::Fp16 => half::f16::from_f32(x).to_f32(),
            Self::Bf16 => half::bf16::from_f32(x).to_f32(),
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Dtype {
    /// Parses `value` like [`Dtype::parse`]; an error names `source` (a variable, flag or file),
    /// the value and the accepted names.
    pub fn parse_from(value: &str, source: &str) -> Result<Self> {
        Self::parse(value).ok_or_else(|| PoolError::InvalidValue {
            what: "dtype",
            value: value.to_string(),
            source_name: source.to_string(),
            expected: ACCEPTED_DTYPES.to_string(),
        })
    }
}

impl std::str::FromStr for Dtype {
    type Err = PoolError;

    fn from_str(s: &str) -> Result<Self> {
        Self::parse_from(s, "value")
    }
}

/// The environment variable that sets the SSM state dtype.
pub const ENV_KDA_SSM_DTYPE: &str = "KDA_SSM_DTYPE";
/// ATOM's variable, accepted for drop-in use beside ATOM (ranks below [`ENV_KDA_SSM_DTYPE`]).
pub const ENV_ATOM_KDA_SSM_DTYPE: &str = "ATOM_KDA_SSM_DTYPE";

/// A dtype as given by one source, not yet parsed: the value and where it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DtypeInput<'a> {
    /// The value as given (parsed by [`Dtype::parse`]).
    pub value: &'a str,
    /// Where it came from, for the log and for errors (`--dtype`, `configs/x.json (state_dtype)`).
    pub source: &'a str,
}

impl<'a> DtypeInput<'a> {
    /// A value and its source.
    pub fn new(value: &'a str, source: &'a str) -> Self {
        Self { value, source }
    }
}

/// Where the resolved state dtype came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DtypeSource {
    /// An explicit value (API argument or CLI flag), with its name.
    Explicit(String),
    /// An environment variable, with its name.
    Env(&'static str),
    /// A configuration file's field, named with the file.
    Config(String),
    /// Nothing was set: fp32.
    Default,
}

impl std::fmt::Display for DtypeSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Explicit(name) => write!(f, "{name}"),
            Self::Env(var) => write!(f, "env {var}"),
            Self::Config(name) => write!(f, "{name}"),
            Self::Default => f.write_str("default"),
        }
    }
}

impl Serialize for DtypeSource {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Decides the SSM state dtype: the only place where it is decided.
///
/// Precedence: `explicit` (API argument or CLI flag) > env [`ENV_KDA_SSM_DTYPE`] > env
/// [`ENV_ATOM_KDA_SSM_DTYPE`] > `config` (a configuration file's field) > fp32. A source below
/// the first one that is set is not read. The two variables both set to different dtypes is an
/// error; a variable set to the empty string counts as unset. The environment is read through
/// `env` (a lookup by name) so callers and tests choose what it sees; [`resolve_state_dtype_env`]
/// passes the process environment. The decision and its source are logged at info level.
pub fn resolve_state_dtype(
    explicit: Option<DtypeInput<'_>>,
    env: impl Fn(&str) -> Option<String>,
    config: Option<DtypeInput<'_>>,
) -> Result<(StateDtype, DtypeSource)> {
    let (dtype, source) = decide(explicit, env, config)?;
    tracing::info!("SSM state dtype {dtype} (from {source})");
    Ok((dtype, source))
}

fn decide(
    explicit: Option<DtypeInput<'_>>,
    env: impl Fn(&str) -> Option<String>,
    config: Option<DtypeInput<'_>>,
) -> Result<(StateDtype, DtypeSource)> {
    if let Some(input) = explicit {
        let d = Dtype::parse_from(input.value, input.source)?;
        return Ok((d, DtypeSource::Explicit(input.source.to_string())));
    }
    let read = |var: &'static str| -> Result<Option<Dtype>> {
        match env(var) {
            Some(v) if !v.trim().is_empty() => Dtype::parse_from(&v, var).map(Some),
            _ => Ok(None),
        }
    };
    match (read(ENV_KDA_SSM_DTYPE)?, read(ENV_ATOM_KDA_SSM_DTYPE)?) {
        (Some(a), Some(b)) if a != b => Err(PoolError::InvalidValue {
            what: "dtype",
            value: a.to_string(),
            source_name: format!("{ENV_KDA_SSM_DTYPE} ({ENV_ATOM_KDA_SSM_DTYPE} is {b})"),
            expected: "the same dtype in both variables, or only one of them set".to_string(),
        }),
        (Some(a), _) => Ok((a, DtypeSource::Env(ENV_KDA_SSM_DTYPE))),
        (None, Some(b)) => Ok((b, DtypeSource::Env(ENV_ATOM_KDA_SSM_DTYPE))),
        (None, None) => match config {
            Some(input) => {
                let d = Dtype::parse_from(input.value, input.source)?;
                Ok((d, DtypeSource::Config(input.source.to_string())))
            }
            None => Ok((Dtype::Fp32, DtypeSource::Default)),
        },
    }
}

/// [`resolve_state_dtype`] with the process environment.
pub fn resolve_state_dtype_env(
    explicit: Option<DtypeInput<'_>>,
    config: Option<DtypeInput<'_>>,
) -> Result<(StateDtype, DtypeSource)> {
    resolve_state_dtype(
        explicit,
        |name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()),
        config,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn encode_then_decode_round_trips_representable_values() {
        let values = [1.5f32, -0.25, 3.0e-3, 1024.0, -7.75];
        for dtype in Dtype::ALL {
            let back = dtype.decode_f32(&dtype.encode_f32(&values));
            assert_eq!(back.len(), values.len());
            for (b, v) in back.iter().zip(values) {
                let tol = match dtype {
                    Dtype::Fp32 => 0.0,
                    Dtype::Fp16 => v.abs() * 2f32.powi(-11),
                    Dtype::Bf16 => v.abs() * 2f32.powi(-8),
                };
                assert!((b - v).abs() <= tol, "{dtype}: {v} came back as {b}");
            }
        }
    }

    #[test]
    fn encode_rounds_to_nearest_even() {
        // 1 + 2^-9 lies halfway between two bf16 neighbours of 1; ties go to the even one (1).
        let x = 1.0f32 + 2f32.powi(-9);
        assert_eq!(
            Dtype::Bf16.decode_f32(&Dtype::Bf16.encode_f32(&[x])),
            vec![1.0]
        );
        let y = 1.0f32 + 3.0 * 2f32.powi(-9);
        assert_eq!(
            Dtype::Bf16.decode_f32(&Dtype::Bf16.encode_f32(&[y])),
            vec![1.0 + 2f32.powi(-7)]
        );
    }

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn parse_accepts_names_and_aliases_in_any_case() {
        for (s, d) in [
            ("fp32", Dtype::Fp32),
            (" Float32 ", Dtype::Fp32),
            ("FP16", Dtype::Fp16),
            ("float16", Dtype::Fp16),
            ("\thalf\n", Dtype::Fp16),
            ("bf16", Dtype::Bf16),
            ("BFloat16", Dtype::Bf16),
        ] {
            assert_eq!(Dtype::parse(s), Some(d), "{s:?}");
        }
    }

    #[test]
    fn parse_error_names_source_value_and_accepted_names() {
        let e = Dtype::parse_from("fp8", "KDA_SSM_DTYPE")
            .unwrap_err()
            .to_string();
        assert!(e.contains("KDA_SSM_DTYPE"), "{e}");
        assert!(e.contains("fp8"), "{e}");
        assert!(e.contains(ACCEPTED_DTYPES), "{e}");
    }

    #[test]
    fn serde_uses_the_canonical_names() {
        for d in Dtype::ALL {
            let s = serde_json::to_string(&d).unwrap();
            assert_eq!(s, format!("\"{}\"", d.name()));
            assert_eq!(serde_json::from_str::<Dtype>(&s).unwrap(), d);
        }
    }

    #[test]
    fn default_is_fp32_when_nothing_is_set() {
        let r = resolve_state_dtype(None, env_of(&[]), None).unwrap();
        assert_eq!(r, (Dtype::Fp32, DtypeSource::Default));
    }

    #[test]
    fn explicit_value_wins_over_env_and_config() {
        let env = env_of(&[("KDA_SSM_DTYPE", "bf16"), ("ATOM_KDA_SSM_DTYPE", "fp32")]);
        let r = resolve_state_dtype(
            Some(DtypeInput::new("half", "--dtype")),
            env,
            Some(DtypeInput::new("bf16", "cfg")),
        )
        .unwrap();
        assert_eq!(r, (Dtype::Fp16, DtypeSource::Explicit("--dtype".into())));
    }

    #[test]
    fn kda_variable_wins_over_atom_variable_and_config() {
        let env = env_of(&[("KDA_SSM_DTYPE", "fp16"), ("ATOM_KDA_SSM_DTYPE", "float16")]);
        let r = resolve_state_dtype(None, env, Some(DtypeInput::new("bf16", "cfg"))).unwrap();
        assert_eq!(r, (Dtype::Fp16, DtypeSource::Env(ENV_KDA_SSM_DTYPE)));
    }

    #[test]
    fn atom_variable_is_accepted_alone() {
        let env = env_of(&[("ATOM_KDA_SSM_DTYPE", "bfloat16")]);
        let r = resolve_state_dtype(None, env, Some(DtypeInput::new("fp16", "cfg"))).unwrap();
        assert_eq!(r, (Dtype::Bf16, DtypeSource::Env(ENV_ATOM_KDA_SSM_DTYPE)));
    }

    #[test]
    fn both_variables_set_differently_is_an_error() {
        let env = env_of(&[("KDA_SSM_DTYPE", "fp16"), ("ATOM_KDA_SSM_DTYPE", "bf16")]);
        let e = resolve_state_dtype(None, env, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"fp16\" from KDA_SSM_DTYPE"), "{e}");
        assert!(e.contains("ATOM_KDA_SSM_DTYPE is bf16"), "{e}");
    }

    #[test]
    fn config_field_is_used_when_env_is_unset_or_empty() {
        let env = env_of(&[("KDA_SSM_DTYPE", "  ")]);
        let r = resolve_state_dtype(None, env, Some(DtypeInput::new("bf16", "m.json"))).unwrap();
        assert_eq!(r, (Dtype::Bf16, DtypeSource::Config("m.json".into())));
    }

    #[test]
    fn unknown_env_value_is_an_error_naming_the_variable() {
        let env = env_of(&[("ATOM_KDA_SSM_DTYPE", "int8")]);
        let e = resolve_state_dtype(None, env, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ATOM_KDA_SSM_DTYPE") && e.contains("int8"),
            "{e}"
        );
    }

    #[test]
    fn unknown_config_value_is_an_error_naming_the_file() {
        let e = resolve_state_dtype(None, env_of(&[]), Some(DtypeInput::new("x", "m.json")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("m.json") && e.contains("\"x\""), "{e}");
    }

    fn spelling() -> impl Strategy<Value = (Dtype, String)> {
        let names = prop_oneof![
            Just((Dtype::Fp32, "fp32")),
            Just((Dtype::Fp32, "float32")),
            Just((Dtype::Fp16, "fp16")),
            Just((Dtype::Fp16, "float16")),
            Just((Dtype::Fp16, "half")),
            Just((Dtype::Bf16, "bf16")),
            Just((Dtype::Bf16, "bfloat16")),
        ];
        (names, any::<u32>(), "[ \t]{0,2}", "[ \t\n]{0,2}").prop_map(|((d, n), mask, l, r)| {
            let cased: String = n
                .chars()
                .enumerate()
                .map(|(i, c)| {
                    if mask >> (i % 32) & 1 == 1 {
                        c.to_ascii_uppercase()
                    } else {
                        c
                    }
                })
                .collect();
            (d, format!("{l}{cased}{r}"))
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn parse_and_print_round_trip((d, s) in spelling()) {
            let parsed = Dtype::parse(&s);
            prop_assert_eq!(parsed, Some(d));
            prop_assert_eq!(Dtype::parse(&d.to_string()), Some(d));
            prop_assert_eq!(d.to_string(), d.name());
        }
    }
}
