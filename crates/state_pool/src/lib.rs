//! The KDA recurrent-state pool.
//!
//! One [`StateDtype`] decision (see [`dtype::resolve_state_dtype`]), the model shape
//! ([`KdaShape`]), pure sizing functions ([`sizing`]), the pool itself ([`StatePool`]) with
//! its O(1) slot allocator, and checkpoints tagged with a layout id.
//!
//! Memory is reached through the small [`DeviceMemory`] trait: [`HostMemory`] here, the GPU
//! backends of `kda-kernels` provide their own.

pub mod alloc;
pub mod checkpoint;
pub mod dtype;
pub mod error;
pub mod geometry;
pub mod health;
pub mod layout;
pub mod memory;
pub mod pool;
pub mod rounding;
pub mod shape;
pub mod sizing;

pub use alloc::{AllocStats, SlotAllocator, SlotHandle, SlotKind};
pub use checkpoint::{ImportMode, LayoutId};
pub use dtype::{
    resolve_state_dtype, resolve_state_dtype_env, Dtype, DtypeInput, DtypeSource, StateDtype,
};
pub use error::{PoolError, Result};
pub use geometry::{LayerMut, LayerPlanes, PoolConfig, PoolGeometry, RingMeta, RING_META_BYTES};
pub use health::NonFinite;
pub use layout::StateLayout;
pub use memory::{DeviceMemory, HostBuffer, HostMemory};
pub use pool::{Plane, StatePool};
pub use rounding::Rounding;
pub use shape::{KdaShape, ModelConfig};
pub use sizing::{KvGeometry, PlaneBytes, SizingReport};
