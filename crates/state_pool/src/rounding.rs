//! How a pool rounds f32 values when it stores them in a 2-byte dtype.

use serde::{Deserialize, Serialize};

/// Rounding of state stores into the pool's element type (f32 stores are exact).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase", tag = "mode")]
pub enum Rounding {
    /// Round to nearest, ties to even.
    #[default]
    Nearest,
    /// Stochastic rounding with a counter-based RNG keyed by (seed, layer, slot, store epoch,
    /// element), so a run is reproducible and every backend draws the same bits.
    Stochastic {
        /// The run's seed.
        seed: u64,
    },
}
