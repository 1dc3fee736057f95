//! The CPU reference backend (rayon over sequences and heads). Filled in by issue 3.

/// The CPU backend: the oracle of every GPU backend.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;
