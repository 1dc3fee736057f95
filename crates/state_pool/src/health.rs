//! Health checks of a slot: a scan of its state for non-finite values.
//!
//! A NaN or an infinity in one request's inputs poisons that request's state and nothing
//! else (every slot is computed on its own). An engine scans a slot it is about to checkpoint,
//! export or hand back, and reports the request as poisoned rather than letting the values
//! travel on.

use half::{bf16, f16};

use crate::dtype::Dtype;
use crate::error::Result;
use crate::memory::DeviceMemory;
use crate::pool::{Plane, StatePool};

/// The first non-finite element found in a slot.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NonFinite {
    /// The layer.
    pub layer: usize,
    /// The plane: [`Plane::Ssm`], [`Plane::Conv`] or [`Plane::Ring`] (entries in use only).
    pub plane: Plane,
    /// The element's index inside the slot's part of the plane in that layer.
    pub element: usize,
    /// Its value (NaN or an infinity).
    pub value: f32,
}

impl std::fmt::Display for NonFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} at element {} of the {} plane in layer {}",
            self.value,
            self.element,
            self.plane.name(),
            self.layer
        )
    }
}

/// The index and value of the first non-finite element of `bytes` (little-endian `dtype`).
pub fn first_nonfinite(bytes: &[u8], dtype: Dtype) -> Option<(usize, f32)> {
    let value = |c: &[u8]| match dtype {
        Dtype::Fp32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        Dtype::Fp16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
        Dtype::Bf16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
    };
    bytes
        .chunks_exact(dtype.size())
        .map(value)
        .enumerate()
        .find(|(_, x)| !x.is_finite())
}

impl<M: DeviceMemory> StatePool<M> {
    /// The first non-finite value of `slot`'s state, scanning every layer's ssm and conv
    /// planes and the ring entries in use (`0..len`, pending and drafts); `None` when all are
    /// finite. A slot is poisoned when this finds something.
    pub fn find_nonfinite(&self, slot: usize) -> Result<Option<NonFinite>> {
        let g = self.geometry();
        for layer in 0..g.layers {
            let ring_elems = self.ring_meta(layer, slot)?.len as usize * g.ring_entry_elems();
            for (plane, dtype, elems) in [
                (Plane::Ssm, g.state_dtype, usize::MAX),
                (Plane::Conv, g.conv_dtype, usize::MAX),
                (Plane::Ring, g.ring_dtype, ring_elems),
            ] {
                if elems == 0 {
                    continue;
                }
                let bytes = self.read_slot_plane(layer, plane, slot)?;
                let end = bytes.len().min(elems.saturating_mul(dtype.size()));
                if let Some((element, value)) = first_nonfinite(&bytes[..end], dtype) {
                    return Ok(Some(NonFinite {
                        layer,
                        plane,
                        element,
                        value,
                    }));
                }
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::RingMeta;
    use crate::memory::HostMemory;
    use crate::pool::tests::small;

    fn put(
        p: &mut StatePool<HostMemory>,
        layer: usize,
        plane: Plane,
        slot: usize,
        at: usize,
        x: f32,
    ) {
        let mut bytes = p.read_slot_plane(layer, plane, slot).unwrap();
        let dtype = match plane {
            Plane::Ssm => p.geometry().state_dtype,
            Plane::Conv => p.geometry().conv_dtype,
            _ => p.geometry().ring_dtype,
        };
        let enc: Vec<u8> = match dtype {
            Dtype::Fp32 => x.to_le_bytes().to_vec(),
            Dtype::Fp16 => f16::from_f32(x).to_le_bytes().to_vec(),
            Dtype::Bf16 => bf16::from_f32(x).to_le_bytes().to_vec(),
        };
        let n = dtype.size();
        bytes[at * n..(at + 1) * n].copy_from_slice(&enc);
        p.write_slot_plane(layer, plane, slot, &bytes).unwrap();
    }

    #[test]
    fn scan_finds_nan_and_inf_in_the_slot_it_is_in() {
        for dtype in Dtype::ALL {
            let mut p = StatePool::new(HostMemory, small(dtype, 4)).unwrap();
            for slot in 0..3 {
                put(&mut p, 0, Plane::Ssm, slot, 3, 1.5);
                assert_eq!(p.find_nonfinite(slot).unwrap(), None);
            }
            put(&mut p, 1, Plane::Ssm, 1, 17, f32::NAN);
            let found = p.find_nonfinite(1).unwrap().unwrap();
            assert_eq!(
                (found.layer, found.plane, found.element),
                (1, Plane::Ssm, 17)
            );
            assert!(found.value.is_nan());
            assert!(
                found.to_string().contains("ssm plane in layer 1"),
                "{found}"
            );
            put(&mut p, 0, Plane::Conv, 2, 5, f32::NEG_INFINITY);
            let found = p.find_nonfinite(2).unwrap().unwrap();
            assert_eq!((found.plane, found.value), (Plane::Conv, f32::NEG_INFINITY));
            assert_eq!(p.find_nonfinite(0).unwrap(), None, "{dtype}");
        }
    }

    #[test]
    fn scan_reads_ring_entries_in_use_only() {
        let mut p = StatePool::new(HostMemory, small(Dtype::Fp16, 4)).unwrap();
        let entry = p.geometry().ring_entry_elems();
        // An infinity in entry 2 of slot 0's ring: unused while len <= 2.
        put(&mut p, 0, Plane::Ring, 0, 2 * entry + 1, f32::INFINITY);
        assert_eq!(p.find_nonfinite(0).unwrap(), None);
        let meta = RingMeta {
            len: 3,
            pending: 1,
            ..Default::default()
        };
        p.write_slot_plane(0, Plane::Meta, 0, bytemuck::bytes_of(&meta))
            .unwrap();
        let found = p.find_nonfinite(0).unwrap().unwrap();
        assert_eq!((found.plane, found.element), (Plane::Ring, 2 * entry + 1));
    }

    #[test]
    fn scan_refuses_a_slot_out_of_range() {
        let p = StatePool::new(HostMemory, small(Dtype::Fp32, 0)).unwrap();
        let e = p.find_nonfinite(9).unwrap_err().to_string();
        assert!(e.contains("slot") && e.contains('9'), "{e}");
    }
}
