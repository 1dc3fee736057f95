//! The state pool: per KDA layer, the ssm, conv, ring, meta and delta planes of every slot (request
//! slots, then checkpoint slots), owned through a [`DeviceMemory`], and the slot allocators.
//!
//! **A fresh slot is zero.** [`StatePool::allocate`] zeroes the slot's ssm, conv, ring, meta and
//! delta planes in every layer before handing it out, so no kernel needs a has-initial-state flag
//! (the decision recorded in `docs/architecture.md`).

use crate::alloc::{AllocStats, SlotAllocator, SlotHandle, SlotKind};
use crate::error::{PoolError, Result};
use crate::geometry::{LayerMut, LayerPlanes, PoolGeometry, RingMeta, RING_META_BYTES};
use crate::memory::DeviceMemory;

/// One of a layer's five planes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Plane {
    /// The recurrent state, `[slot][HV][K][V]` (or V-first) in the state dtype.
    Ssm,
    /// The short-conv state, `[slot][conv_rows][conv_channels]` in the conv dtype.
    Conv,
    /// The replay ring's entries, `[slot][ring_len][entry]` in the ring dtype.
    Ring,
    /// The replay ring's bookkeeping, `[slot]` x [`RingMeta`] (empty without a ring).
    Meta,
    /// The ring entries' delta vectors, `[slot][ring_len][HV][V]` f32 (empty without a ring;
    /// GPU kernel scratch described by [`RingMeta::cached`]).
    Delta,
}

impl Plane {
    /// All planes.
    pub const ALL: [Plane; 5] = [
        Plane::Ssm,
        Plane::Conv,
        Plane::Ring,
        Plane::Meta,
        Plane::Delta,
    ];

    /// Bytes of one slot of this plane in one layer (the plane's slot stride).
    pub fn slot_bytes(self, g: &PoolGeometry) -> usize {
        match self {
            Self::Ssm => g.ssm_slot_bytes(),
            Self::Conv => g.conv_slot_bytes(),
            Self::Ring => g.ring_slot_bytes(),
            Self::Meta => g.meta_slot_bytes(),
            Self::Delta => g.delta_slot_bytes(),
        }
    }

    /// A short name: `ssm`, `conv`, `ring`, `meta`, `delta`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ssm => "ssm",
            Self::Conv => "conv",
            Self::Ring => "ring",
            Self::Meta => "meta",
            Self::Delta => "delta",
        }
    }
}

/// A pool of KDA recurrent states in the memory `M`: one [`LayerPlanes`] per KDA layer, an
/// allocator of request slots (`0..slots`) and one of checkpoint slots
/// (`slots..slots + checkpoint_slots`).
pub struct StatePool<M: DeviceMemory> {
    pub(crate) mem: M,
    pub(crate) geometry: PoolGeometry,
    pub(crate) layers: Vec<LayerPlanes<M::Buffer>>,
    pub(crate) slots: SlotAllocator,
    pub(crate) checkpoints: SlotAllocator,
}

impl<M: DeviceMemory> std::fmt::Debug for StatePool<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatePool")
            .field("memory", &self.mem.name())
            .field("layout_id", &self.geometry.layout_id())
            .field("slots", &self.slots.stats())
            .field("checkpoints", &self.checkpoints.stats())
            .finish()
    }
}

impl<M: DeviceMemory> StatePool<M> {
    /// Allocates every layer's zeroed planes for `geometry` (checked first) in `mem`.
    pub fn new(mem: M, geometry: PoolGeometry) -> Result<Self> {
        geometry.validate()?;
        let slots = SlotAllocator::new(geometry.slots)?;
        let checkpoints = SlotAllocator::with_base(
            geometry.slots,
            geometry.checkpoint_slots,
            SlotKind::Checkpoint,
        )?;
        let layers = (0..geometry.layers)
            .map(|l| LayerPlanes::new(&mem, &geometry, l))
            .collect::<Result<Vec<_>>>()?;
        tracing::debug!(
            "state pool in {} memory: {} bytes, layout {}",
            mem.name(),
            crate::sizing::pool_bytes(&geometry),
            geometry.layout_id()
        );
        Ok(Self {
            mem,
            geometry,
            layers,
            slots,
            checkpoints,
        })
    }

    /// The pool's geometry.
    pub fn geometry(&self) -> &PoolGeometry {
        &self.geometry
    }

    /// The memory the planes live in.
    pub fn memory(&self) -> &M {
        &self.mem
    }

    /// The pool's layout id (see [`crate::checkpoint::LayoutId`]).
    pub fn layout_id(&self) -> String {
        self.geometry.layout_id()
    }

    /// The request-slot allocator. It is thread-safe and cheap to clone; slots taken from it
    /// directly are not zeroed (see [`StatePool::zero_slot`]).
    pub fn allocator(&self) -> &SlotAllocator {
        &self.slots
    }

    /// The checkpoint-slot allocator.
    pub fn checkpoint_allocator(&self) -> &SlotAllocator {
        &self.checkpoints
    }

    /// Request-slot counts.
    pub fn stats(&self) -> AllocStats {
        self.slots.stats()
    }

    /// Takes a free request slot and zeroes its ssm, conv, ring and meta planes in every layer.
    /// Exhaustion is [`PoolError::Exhausted`].
    pub fn allocate(&mut self) -> Result<SlotHandle> {
        let handle = self.slots.allocate()?;
        // On failure the handle drops and the slot goes back to the free list.
        self.zero_slot(handle.index())?;
        Ok(handle)
    }

    /// Zeroes all five planes of `slot` in every layer.
    pub fn zero_slot(&mut self, slot: usize) -> Result<()> {
        self.check_slot(slot)?;
        let g = &self.geometry;
        for planes in &mut self.layers {
            for plane in Plane::ALL {
                let n = plane.slot_bytes(g);
                self.mem.zero(buffer_mut(planes, plane), slot * n, n)?;
            }
        }
        Ok(())
    }

    /// The kernels' view of layer `layer`.
    pub fn layer_mut(&mut self, layer: usize) -> Result<LayerMut<'_, M::Buffer>> {
        self.check_layer(layer)?;
        Ok(self.layers[layer].view(&self.geometry))
    }

    /// The kernels' views of all layers at once.
    pub fn layers_mut(&mut self) -> Vec<LayerMut<'_, M::Buffer>> {
        let g = &self.geometry;
        self.layers.iter_mut().map(|p| p.view(g)).collect()
    }

    /// The layers' planes, read-only.
    pub fn layers(&self) -> &[LayerPlanes<M::Buffer>] {
        &self.layers
    }

    /// A copy of one slot's bytes of one plane in one layer.
    pub fn read_slot_plane(&self, layer: usize, plane: Plane, slot: usize) -> Result<Vec<u8>> {
        self.check_layer(layer)?;
        self.check_slot(slot)?;
        let n = plane.slot_bytes(&self.geometry);
        let mut out = vec![0u8; n];
        self.mem
            .read(buffer(&self.layers[layer], plane), slot * n, &mut out)?;
        Ok(out)
    }

    /// Overwrites one slot's bytes of one plane in one layer; `bytes` must be exactly the
    /// plane's slot size.
    pub fn write_slot_plane(
        &mut self,
        layer: usize,
        plane: Plane,
        slot: usize,
        bytes: &[u8],
    ) -> Result<()> {
        self.check_layer(layer)?;
        self.check_slot(slot)?;
        let n = plane.slot_bytes(&self.geometry);
        if bytes.len() != n {
            return Err(PoolError::arg(
                "bytes",
                format!(
                    "{} bytes for the {} plane; one slot of it is {n} bytes",
                    bytes.len(),
                    plane.name()
                ),
            ));
        }
        self.mem
            .write(buffer_mut(&mut self.layers[layer], plane), slot * n, bytes)
    }

    /// The ring bookkeeping of (`layer`, `slot`); all zero without a ring.
    pub fn ring_meta(&self, layer: usize, slot: usize) -> Result<RingMeta> {
        if self.geometry.ring_len == 0 {
            self.check_layer(layer)?;
            self.check_slot(slot)?;
            return Ok(RingMeta::default());
        }
        let bytes = self.read_slot_plane(layer, Plane::Meta, slot)?;
        let mut meta = [0u8; RING_META_BYTES];
        meta.copy_from_slice(&bytes);
        Ok(bytemuck::cast(meta))
    }

    /// Checks that `slot`'s ring is empty (`len == 0`) in every layer, so its ssm plane is its
    /// true state; otherwise an error saying the slot must be flushed (replayed) first.
    pub fn require_flushed(&self, slot: usize, action: &str) -> Result<()> {
        self.check_slot(slot)?;
        if self.geometry.ring_len == 0 {
            return Ok(());
        }
        for layer in 0..self.geometry.layers {
            let m = self.ring_meta(layer, slot)?;
            if m.len != 0 {
                return Err(PoolError::Checkpoint(format!(
                    "slot {slot} must be flushed (replayed) before {action}: layer {layer} holds {} ring entries ({} pending)",
                    m.len, m.pending
                )));
            }
        }
        Ok(())
    }

    pub(crate) fn check_layer(&self, layer: usize) -> Result<()> {
        if layer < self.geometry.layers {
            Ok(())
        } else {
            Err(PoolError::arg(
                "layer",
                format!(
                    "{layer} is out of range; the pool has layers 0..{}",
                    self.geometry.layers
                ),
            ))
        }
    }

    pub(crate) fn check_slot(&self, slot: usize) -> Result<()> {
        let n = self.geometry.total_slots();
        if slot < n {
            Ok(())
        } else {
            Err(PoolError::arg(
                "slot",
                format!("{slot} is out of range; the pool has slots 0..{n}"),
            ))
        }
    }
}

pub(crate) fn buffer<B>(planes: &LayerPlanes<B>, plane: Plane) -> &B {
    match plane {
        Plane::Ssm => &planes.ssm,
        Plane::Conv => &planes.conv,
        Plane::Ring => &planes.ring,
        Plane::Meta => &planes.meta,
        Plane::Delta => &planes.delta,
    }
}

pub(crate) fn buffer_mut<B>(planes: &mut LayerPlanes<B>, plane: Plane) -> &mut B {
    match plane {
        Plane::Ssm => &mut planes.ssm,
        Plane::Conv => &mut planes.conv,
        Plane::Ring => &mut planes.ring,
        Plane::Meta => &mut planes.meta,
        Plane::Delta => &mut planes.delta,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::dtype::Dtype;
    use crate::layout::StateLayout;
    use crate::memory::HostMemory;
    use rand::{Rng, SeedableRng};

    /// A small geometry with a ring: 2 layers, H 2, HV 4, K 8, V 4.
    pub(crate) fn small(state: Dtype, ring_len: usize) -> PoolGeometry {
        PoolGeometry {
            layers: 2,
            h: 2,
            hv: 4,
            k: 8,
            v: 4,
            conv_rows: 3,
            conv_channels: 2 * 2 * 8 + 4 * 4,
            conv_dtype: Dtype::Bf16,
            state_dtype: state,
            layout: StateLayout::KFirst,
            ring_len,
            ring_dtype: Dtype::Bf16,
            ring_deltas: false,
            slots: 3,
            checkpoint_slots: 2,
            rounding: Default::default(),
        }
    }

    /// Fills every plane of `slot` with random bytes (meta excepted, which stays a valid,
    /// empty ring unless `ring_entries > 0`).
    pub(crate) fn scribble(
        pool: &mut StatePool<HostMemory>,
        slot: usize,
        rng: &mut impl Rng,
        ring_entries: u32,
    ) {
        for layer in 0..pool.geometry().layers {
            for plane in [Plane::Ssm, Plane::Conv, Plane::Ring] {
                let mut bytes = vec![0u8; plane.slot_bytes(pool.geometry())];
                rng.fill(&mut bytes[..]);
                pool.write_slot_plane(layer, plane, slot, &bytes).unwrap();
            }
            if pool.geometry().ring_len > 0 {
                let meta = RingMeta {
                    len: ring_entries,
                    pending: ring_entries,
                    ..Default::default()
                };
                pool.write_slot_plane(layer, Plane::Meta, slot, bytemuck::bytes_of(&meta))
                    .unwrap();
            }
        }
    }

    #[test]
    fn planes_have_the_geometry_sizes() {
        let g = small(Dtype::Fp16, 4);
        let pool = StatePool::new(HostMemory, g.clone()).unwrap();
        let p = &pool.layers()[1];
        assert_eq!(p.layer, 1);
        assert_eq!(p.ssm.len(), 5 * 4 * 8 * 4 * 2);
        assert_eq!(p.conv.len(), 5 * 3 * 48 * 2);
        assert_eq!(p.ring.len(), 5 * 4 * g.ring_entry_elems() * 2);
        assert_eq!(p.meta.len(), 5 * 16);
    }

    #[test]
    fn allocate_hands_out_a_zeroed_slot() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut pool = StatePool::new(HostMemory, small(Dtype::Fp32, 4)).unwrap();
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        scribble(&mut pool, a.index(), &mut rng, 3);
        scribble(&mut pool, b.index(), &mut rng, 2);
        let index = a.index();
        a.release();
        let again = pool.allocate().unwrap();
        assert_eq!(again.index(), index, "the free list is LIFO");
        for layer in 0..2 {
            for plane in Plane::ALL {
                let bytes = pool.read_slot_plane(layer, plane, index).unwrap();
                assert!(bytes.iter().all(|&x| x == 0), "{plane:?} of layer {layer}");
            }
            // The neighbour keeps its bytes.
            let other = pool.read_slot_plane(layer, Plane::Ssm, b.index()).unwrap();
            assert!(other.iter().any(|&x| x != 0));
            assert_eq!(pool.ring_meta(layer, b.index()).unwrap().len, 2);
        }
    }

    #[test]
    fn pool_exhaustion_is_an_error_and_changes_nothing() {
        let mut pool = StatePool::new(HostMemory, small(Dtype::Fp16, 0)).unwrap();
        let held: Vec<_> = (0..3).map(|_| pool.allocate().unwrap()).collect();
        let e = pool.allocate().unwrap_err();
        assert!(matches!(e, PoolError::Exhausted { capacity: 3 }), "{e}");
        let s = pool.stats();
        assert_eq!((s.in_use, s.free, s.high_water), (3, 0, 3));
        drop(held);
        assert_eq!(pool.stats().free, 3);
    }

    #[test]
    fn layer_views_point_at_the_layers_planes() {
        let mut pool = StatePool::new(HostMemory, small(Dtype::Bf16, 2)).unwrap();
        {
            let view = pool.layer_mut(1).unwrap();
            assert_eq!(view.layer, 1);
            view.ssm.bytes_mut()[0] = 0xAB;
            *view.epoch += 1;
        }
        assert_eq!(pool.read_slot_plane(1, Plane::Ssm, 0).unwrap()[0], 0xAB);
        assert_eq!(pool.layers()[1].epoch, 1);
        let views = pool.layers_mut();
        assert_eq!(views.len(), 2);
        assert_eq!(views[0].geometry.ring_len, 2);
        drop(views);
        let Err(e) = pool.layer_mut(2) else {
            panic!("layer 2 of 2 accepted")
        };
        let e = e.to_string();
        assert!(e.contains("layer") && e.contains("0..2"), "{e}");
    }

    #[test]
    fn plane_access_refuses_bad_slots_and_sizes() {
        let mut pool = StatePool::new(HostMemory, small(Dtype::Fp16, 0)).unwrap();
        let e = pool
            .read_slot_plane(0, Plane::Ssm, 5)
            .unwrap_err()
            .to_string();
        assert!(e.contains("slot") && e.contains("0..5"), "{e}");
        let e = pool
            .write_slot_plane(0, Plane::Conv, 0, &[1, 2, 3])
            .unwrap_err()
            .to_string();
        assert!(e.contains("conv") && e.contains("3 bytes"), "{e}");
    }

    #[test]
    fn a_pool_needs_a_slot() {
        let mut g = small(Dtype::Fp16, 0);
        g.slots = 0;
        let e = StatePool::new(HostMemory, g).unwrap_err().to_string();
        assert!(e.contains("slots"), "{e}");
    }
}
