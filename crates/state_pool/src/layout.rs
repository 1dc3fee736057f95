//! The storage layout of one value head's K x V state.

use serde::{Deserialize, Serialize};

/// How one value head's state `S` (K x V) is laid out in memory. For K = V both layouts have
/// the same shape, so the layout is always carried explicitly, never inferred.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum StateLayout {
    /// `[K][V]`, row-major: element (k, v) at `k * V + v` (fla default, vLLM).
    #[default]
    KFirst,
    /// `[V][K]`: element (k, v) at `v * K + k` (fla's layer `state_v_first`, FlashKDA).
    VFirst,
}

impl StateLayout {
    /// Offset of logical element (k, v) inside one head's state of dims `kd` x `vd`.
    #[inline]
    pub fn offset(self, k: usize, v: usize, kd: usize, vd: usize) -> usize {
        match self {
            Self::KFirst => k * vd + v,
            Self::VFirst => v * kd + k,
        }
    }

    /// The short name used in layout ids and CLI flags: `kfirst` or `vfirst`.
    pub fn name(self) -> &'static str {
        match self {
            Self::KFirst => "kfirst",
            Self::VFirst => "vfirst",
        }
    }

    /// Parses `kfirst` / `vfirst` (case-insensitive, also `k-first`, `v-first`).
    pub fn parse(s: &str) -> Option<Self> {
        match s
            .trim()
            .to_ascii_lowercase()
            .replace(['-', '_'], "")
            .as_str()
        {
            "kfirst" => Some(Self::KFirst),
            "vfirst" => Some(Self::VFirst),
            _ => None,
        }
    }
}
