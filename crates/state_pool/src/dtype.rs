//! Element types of the pool's planes and the one place where the state dtype is decided.

use serde::{Deserialize, Serialize};

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

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
