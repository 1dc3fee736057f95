//! The serving guide, `docs/serving.md`, included here so that its example compiles and runs
//! as a doc test of this crate.
#![doc = include_str!("../../../docs/serving.md")]
