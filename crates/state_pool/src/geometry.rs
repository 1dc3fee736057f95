//! The geometry of a pool's planes (pure arithmetic, no allocation) and the per-layer view the
//! kernels operate on.
//!
//! Per KDA layer the pool owns five buffers, each indexed by slot (request slots first, then
//! checkpoint slots):
//! - **ssm**: `[slot][HV][K][V]` (or `[slot][HV][V][K]` for V-first) elements of the state dtype;
//! - **conv**: `[slot][conv_kernel - 1][conv_channels]` elements of the conv dtype (the kernels
//!   never touch it; it is sized, zeroed, checkpointed and exported with the slot);
//! - **ring**: `[slot][ring_len][entry]` elements of the ring (input) dtype, where one entry is a
//!   token's raw inputs `k [H*K] | v [HV*V] | g [HV*K] | beta [HV]`, in that order;
//! - **meta**: `[slot]` x [`RingMeta`] (16 bytes), only when `ring_len > 0`;
//! - **delta**: `[slot][ring_len][HV][V]` f32, only with a ring and `ring_deltas`: the delta vector
//!   `u = beta (v - k S)` of each ring entry, where a GPU ring kernel stored it (the first
//!   [`RingMeta::cached`] entries), so it need not replay the pending entries (scratch: never
//!   checkpointed, exported or compared; the CPU backend does not use it).

use crate::{dtype::Dtype, layout::StateLayout, rounding::Rounding};

/// Bytes of one slot's [`RingMeta`] in the meta plane.
pub const RING_META_BYTES: usize = 16;

/// The replay-ring bookkeeping of one (layer, slot), stored as four little-endian `u32`s.
/// Ring entries `0..pending` are accepted tokens not yet folded into the committed state;
/// entries `pending..len` are the drafts of the previous speculative verify.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RingMeta {
    /// Entries in use (pending + drafts).
    pub len: u32,
    /// Accepted entries not yet folded into the committed state.
    pub pending: u32,
    /// Scratch for GPU kernels (an arrival counter); always 0 between calls.
    pub arrive: u32,
    /// Ring entries `0..cached` whose delta vectors the delta plane holds (written by the GPU
    /// kernel `kda_ring_delta`; 0 from every other writer).
    pub cached: u32,
}

impl RingMeta {
    /// Drafts of the previous verify still waiting for their accepted count.
    pub fn drafts(&self) -> u32 {
        self.len - self.pending
    }
}

/// Every fact about the layout of a pool's planes. Built from a model shape and the pool's
/// configuration; everything downstream (sizing, allocation, kernels, layout id) reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolGeometry {
    /// KDA layers.
    pub layers: usize,
    /// q/k heads of this rank.
    pub h: usize,
    /// value heads of this rank (a multiple of `h`).
    pub hv: usize,
    /// key head dim.
    pub k: usize,
    /// value head dim.
    pub v: usize,
    /// Rows of conv state per slot and layer (`conv_kernel - 1`).
    pub conv_rows: usize,
    /// Channels of conv state (q, k and v channels of this rank).
    pub conv_channels: usize,
    /// Element type of the conv state.
    pub conv_dtype: Dtype,
    /// Element type of the SSM state.
    pub state_dtype: Dtype,
    /// Storage layout of each head's state.
    pub layout: StateLayout,
    /// Tokens of raw inputs the replay ring holds (0: eager, no ring).
    pub ring_len: usize,
    /// Element type of the ring (the kernels' input dtype).
    pub ring_dtype: Dtype,
    /// Whether the pool has a delta plane (with a ring): f32 delta vectors of the ring entries
    /// that let the GPU's ring decode and spec_verify skip the replay of pending entries, at
    /// [`PoolGeometry::delta_slot_bytes`] more per slot and layer.
    pub ring_deltas: bool,
    /// Request slots.
    pub slots: usize,
    /// Checkpoint slots (indices `slots..slots + checkpoint_slots`).
    pub checkpoint_slots: usize,
    /// Rounding of 2-byte state stores.
    pub rounding: Rounding,
}

impl PoolGeometry {
    /// All slots of a plane: request plus checkpoint slots.
    pub fn total_slots(&self) -> usize {
        self.slots + self.checkpoint_slots
    }
    /// Elements of one head's state (K * V).
    pub fn head_elems(&self) -> usize {
        self.k * self.v
    }
    /// Elements of one slot's state in one layer (HV * K * V): the slot stride of the ssm plane.
    pub fn ssm_slot_elems(&self) -> usize {
        self.hv * self.head_elems()
    }
    /// Bytes of one slot's state in one layer.
    pub fn ssm_slot_bytes(&self) -> usize {
        self.ssm_slot_elems() * self.state_dtype.size()
    }
    /// Elements of one slot's conv state in one layer.
    pub fn conv_slot_elems(&self) -> usize {
        self.conv_rows * self.conv_channels
    }
    /// Bytes of one slot's conv state in one layer.
    pub fn conv_slot_bytes(&self) -> usize {
        self.conv_slot_elems() * self.conv_dtype.size()
    }
    /// Elements of one ring entry (one token): `k | v | g | beta`.
    pub fn ring_entry_elems(&self) -> usize {
        self.h * self.k + self.hv * self.v + self.hv * self.k + self.hv
    }
    /// Offsets of `k`, `v`, `g`, `beta` inside one ring entry, in elements.
    pub fn ring_entry_offsets(&self) -> [usize; 4] {
        let k = 0;
        let v = k + self.h * self.k;
        let g = v + self.hv * self.v;
        let beta = g + self.hv * self.k;
        [k, v, g, beta]
    }
    /// Elements of one slot's ring data in one layer.
    pub fn ring_slot_elems(&self) -> usize {
        self.ring_len * self.ring_entry_elems()
    }
    /// Bytes of one slot's ring data in one layer.
    pub fn ring_slot_bytes(&self) -> usize {
        self.ring_slot_elems() * self.ring_dtype.size()
    }
    /// Bytes of one slot's ring bookkeeping in one layer (0 without a ring).
    pub fn meta_slot_bytes(&self) -> usize {
        if self.ring_len > 0 {
            RING_META_BYTES
        } else {
            0
        }
    }
    /// Bytes of one slot's delta vectors in one layer: f32 `[ring_len][HV][V]` with
    /// `ring_deltas`, else 0.
    pub fn delta_slot_bytes(&self) -> usize {
        if self.ring_deltas {
            self.ring_len * self.hv * self.v * 4
        } else {
            0
        }
    }
    /// The ring plane per slot and layer as sized: ring data, bookkeeping and delta vectors.
    pub fn ring_plane_slot_bytes(&self) -> usize {
        self.ring_slot_bytes() + self.meta_slot_bytes() + self.delta_slot_bytes()
    }
    /// Value heads per q/k head (GVA group size).
    pub fn group(&self) -> usize {
        self.hv / self.h
    }
}

/// A mutable view of one layer of a pool: what a kernel reads and writes. `B` is the backend's
/// buffer type ([`crate::HostBuffer`] for the CPU backend).
pub struct LayerMut<'a, B> {
    /// Index of the layer in the pool (keys the stochastic-rounding RNG).
    pub layer: usize,
    /// The pool's geometry.
    pub geometry: &'a PoolGeometry,
    /// The ssm plane of this layer.
    pub ssm: &'a mut B,
    /// The ring data plane of this layer (0 bytes without a ring).
    pub ring: &'a mut B,
    /// The ring bookkeeping plane of this layer (0 bytes without a ring).
    pub meta: &'a mut B,
    /// The delta plane of this layer (0 bytes without a ring).
    pub delta: &'a mut B,
    /// Store epoch of this layer: bumped by every state-writing call; keys the stochastic RNG.
    pub epoch: &'a mut u64,
}

/// The five buffers of one layer, owned. [`crate::StatePool`] holds one per layer; tests and
/// tools that need a single layer can own one directly.
pub struct LayerPlanes<B> {
    /// Index of the layer in its pool.
    pub layer: usize,
    /// The ssm plane: `total_slots * ssm_slot_bytes` bytes.
    pub ssm: B,
    /// The conv plane: `total_slots * conv_slot_bytes` bytes.
    pub conv: B,
    /// The ring data plane: `total_slots * ring_slot_bytes` bytes.
    pub ring: B,
    /// The ring bookkeeping plane: `total_slots * meta_slot_bytes` bytes.
    pub meta: B,
    /// The delta plane: `total_slots * delta_slot_bytes` bytes.
    pub delta: B,
    /// Store epoch (see [`LayerMut::epoch`]).
    pub epoch: u64,
}

impl<B> LayerPlanes<B> {
    /// Allocates the zeroed planes of layer `layer` of `geometry` through `mem`.
    pub fn new<M: crate::DeviceMemory<Buffer = B>>(
        mem: &M,
        geometry: &PoolGeometry,
        layer: usize,
    ) -> crate::Result<Self> {
        let n = geometry.total_slots();
        Ok(Self {
            layer,
            ssm: mem.alloc_zeroed(n * geometry.ssm_slot_bytes())?,
            conv: mem.alloc_zeroed(n * geometry.conv_slot_bytes())?,
            ring: mem.alloc_zeroed(n * geometry.ring_slot_bytes())?,
            meta: mem.alloc_zeroed(n * geometry.meta_slot_bytes())?,
            delta: mem.alloc_zeroed(n * geometry.delta_slot_bytes())?,
            epoch: 0,
        })
    }

    /// The kernels' view of this layer.
    pub fn view<'a>(&'a mut self, geometry: &'a PoolGeometry) -> LayerMut<'a, B> {
        LayerMut {
            layer: self.layer,
            geometry,
            ssm: &mut self.ssm,
            ring: &mut self.ring,
            meta: &mut self.meta,
            delta: &mut self.delta,
            epoch: &mut self.epoch,
        }
    }
}

/// The pool's own settings, beside the model shape: what [`PoolGeometry::new`] combines with a
/// [`crate::KdaShape`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Element type of the SSM state (the resolved [`crate::StateDtype`]).
    pub state_dtype: Dtype,
    /// Tokens of raw inputs the replay ring holds (0: eager commit, no ring).
    pub ring_len: usize,
    /// Element type of the ring (the kernels' input dtype).
    pub ring_dtype: Dtype,
    /// Whether the pool keeps the ring entries' delta vectors ([`PoolGeometry::ring_deltas`]).
    pub ring_deltas: bool,
    /// Request slots (at least 1).
    pub slots: usize,
    /// Checkpoint slots.
    pub checkpoint_slots: usize,
    /// Rounding of 2-byte state stores.
    pub rounding: Rounding,
}

impl Default for PoolConfig {
    /// fp32 state, no ring (bf16 ring dtype, no delta plane), one slot, no checkpoint slots,
    /// nearest-even.
    fn default() -> Self {
        Self {
            state_dtype: Dtype::Fp32,
            ring_len: 0,
            ring_dtype: Dtype::Bf16,
            ring_deltas: false,
            slots: 1,
            checkpoint_slots: 0,
            rounding: Rounding::Nearest,
        }
    }
}

impl PoolGeometry {
    /// The geometry of one rank's pool for `shape` (per-rank heads from its TP size) and
    /// `config`. Checked with [`PoolGeometry::validate`].
    pub fn new(shape: &crate::KdaShape, config: &PoolConfig) -> crate::Result<Self> {
        shape.validate()?;
        let (h, hv) = shape.heads_per_rank()?;
        let geometry = Self {
            layers: shape.kda_layers,
            h,
            hv,
            k: shape.head_k_dim,
            v: shape.head_v_dim,
            conv_rows: shape.conv_rows(),
            conv_channels: shape.conv_channels_per_rank()?,
            conv_dtype: shape.conv_dtype,
            state_dtype: config.state_dtype,
            layout: shape.layout,
            ring_len: config.ring_len,
            ring_dtype: config.ring_dtype,
            ring_deltas: config.ring_deltas,
            slots: config.slots,
            checkpoint_slots: config.checkpoint_slots,
            rounding: config.rounding,
        };
        geometry.validate()?;
        Ok(geometry)
    }

    /// Checks the geometry: positive layers, heads and dims, `hv` a multiple of `h`, at least
    /// one request slot, slot indices that fit in `u32`, and plane sizes that fit in memory
    /// arithmetic (`usize`) without overflow.
    pub fn validate(&self) -> crate::Result<()> {
        use crate::PoolError;
        for (arg, value) in [
            ("layers", self.layers),
            ("h", self.h),
            ("hv", self.hv),
            ("k", self.k),
            ("v", self.v),
        ] {
            if value == 0 {
                return Err(PoolError::arg(arg, "is 0; expected a positive integer"));
            }
        }
        if !self.hv.is_multiple_of(self.h) {
            return Err(PoolError::arg(
                "hv",
                format!("{} is not a multiple of h {}", self.hv, self.h),
            ));
        }
        if self.slots == 0 {
            return Err(PoolError::arg(
                "slots",
                "is 0; a pool needs at least one request slot",
            ));
        }
        let too_big = |what: &str| {
            PoolError::arg(
                "slots",
                format!(
                    "{} request + {} checkpoint slots with ring_len {}: {what} overflows",
                    self.slots, self.checkpoint_slots, self.ring_len
                ),
            )
        };
        let total = self
            .slots
            .checked_add(self.checkpoint_slots)
            .filter(|&n| u32::try_from(n).is_ok())
            .ok_or_else(|| too_big("the slot count (at most 2^32 - 1 slots)"))?;
        let per_layer = [
            self.hv
                .checked_mul(self.k)
                .and_then(|x| x.checked_mul(self.v))
                .and_then(|x| x.checked_mul(self.state_dtype.size())),
            self.conv_rows
                .checked_mul(self.conv_channels)
                .and_then(|x| x.checked_mul(self.conv_dtype.size())),
            self.h
                .checked_mul(self.k)
                .and_then(|x| x.checked_add(self.hv.checked_mul(self.v)?))
                .and_then(|x| x.checked_add(self.hv.checked_mul(self.k)?))
                .and_then(|x| x.checked_add(self.hv))
                .and_then(|x| x.checked_mul(self.ring_len))
                .and_then(|x| x.checked_mul(self.ring_dtype.size()))
                .and_then(|x| x.checked_add(RING_META_BYTES)),
            // the delta plane's f32 vectors, where the pool has one
            self.hv
                .checked_mul(self.v)
                .and_then(|x| x.checked_mul(self.ring_len))
                .and_then(|x| x.checked_mul(4))
                .map(|x| if self.ring_deltas { x } else { 0 }),
        ];
        let mut slot_bytes = 0usize;
        for plane in per_layer {
            slot_bytes = plane
                .and_then(|p| slot_bytes.checked_add(p))
                .ok_or_else(|| too_big("the bytes of one slot"))?;
        }
        slot_bytes
            .checked_mul(self.layers)
            .and_then(|b| b.checked_mul(total))
            .filter(|&b| u64::try_from(b).is_ok())
            .ok_or_else(|| too_big("the pool's bytes"))?;
        Ok(())
    }

    /// The layout id of this geometry (see [`crate::checkpoint::LayoutId`]).
    pub fn layout_id(&self) -> String {
        crate::checkpoint::LayoutId::of(self).to_string()
    }

    /// The same geometry with another state dtype (for the fp32 baseline of a report).
    pub fn with_state_dtype(&self, dtype: Dtype) -> Self {
        Self {
            state_dtype: dtype,
            ..self.clone()
        }
    }
}
