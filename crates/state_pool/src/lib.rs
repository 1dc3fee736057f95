//! The KDA recurrent-state pool.
//!
//! One [`StateDtype`] decision (see [`dtype::resolve_state_dtype`]), the model shape
//! ([`KdaShape`]), pure sizing functions ([`sizing`]), the pool itself ([`StatePool`]) with
//! its O(1) slot allocator, and checkpoints tagged with a layout id.
//!
//! Memory is reached through the small [`DeviceMemory`] trait: [`HostMemory`] here, the GPU
//! backends of `kda-kernels` provide their own.

pub mod dtype;
pub mod error;
pub mod geometry;
pub mod layout;
pub mod memory;
pub mod rounding;

pub use dtype::{Dtype, StateDtype};
pub use error::{PoolError, Result};
pub use geometry::{LayerMut, LayerPlanes, PoolGeometry, RingMeta, RING_META_BYTES};
pub use layout::StateLayout;
pub use memory::{DeviceMemory, HostBuffer, HostMemory};
pub use rounding::Rounding;
