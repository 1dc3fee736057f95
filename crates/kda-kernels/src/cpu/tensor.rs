//! Typed access to host buffers: element slices, up-casting loads into f32 rows, rounding
//! stores, and one head's state moved between the pool's layout and a logical `[K][V]` f32
//! array.

use state_pool::{HostBuffer, StateLayout};

use crate::rounding::{Element, StoreMode};

/// The first `len` elements of `buf` as `T` (the caller has validated the length).
pub(crate) fn elems<T: bytemuck::Pod>(buf: &HostBuffer, len: usize) -> &[T] {
    bytemuck::cast_slice(&buf.bytes()[..len * std::mem::size_of::<T>()])
}

/// The first `len` elements of `buf` as `T`, mutable (the caller has validated the length).
pub(crate) fn elems_mut<T: bytemuck::Pod>(buf: &mut HostBuffer, len: usize) -> &mut [T] {
    bytemuck::cast_slice_mut(&mut buf.bytes_mut()[..len * std::mem::size_of::<T>()])
}

/// Up-casts `src` into `dst` (same length).
#[inline]
pub(crate) fn load_row<E: Element>(src: &[E], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s.load();
    }
}

/// Rounds `src` to nearest into `dst` (same length): outputs are never stochastic.
#[inline]
pub(crate) fn store_row<E: Element>(src: &[f32], dst: &mut [E]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = E::store(s);
    }
}

/// Loads one head's stored state (`kd * vd` elements in `layout`) into a logical `[K][V]`
/// f32 array.
pub(crate) fn load_head<S: Element>(
    src: &[S],
    layout: StateLayout,
    kd: usize,
    vd: usize,
    dst: &mut [f32],
) {
    match layout {
        StateLayout::KFirst => load_row(src, dst),
        StateLayout::VFirst => {
            for (v, col) in src.chunks_exact(kd).enumerate() {
                for (k, &x) in col.iter().enumerate() {
                    dst[k * vd + v] = x.load();
                }
            }
        }
    }
}

/// Stores a logical `[K][V]` f32 array into one head's state in `layout`, rounding each
/// element with `mode`; `elem_base` is the head's offset inside the slot's ssm plane
/// (`hv * K * V`), so the stochastic stream sees the element's offset in the slot.
pub(crate) fn store_head<S: Element>(
    src: &[f32],
    layout: StateLayout,
    kd: usize,
    vd: usize,
    mode: StoreMode,
    elem_base: usize,
    dst: &mut [S],
) {
    match (layout, mode) {
        (StateLayout::KFirst, StoreMode::Nearest) => store_row(src, dst),
        (StateLayout::KFirst, mode) => {
            for (i, (d, &x)) in dst.iter_mut().zip(src).enumerate() {
                *d = mode.round(x, elem_base + i);
            }
        }
        (StateLayout::VFirst, mode) => {
            for (v, col) in dst.chunks_exact_mut(kd).enumerate() {
                for (k, d) in col.iter_mut().enumerate() {
                    *d = mode.round(src[k * vd + v], elem_base + v * kd + k);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn v_first_head_round_trips_through_the_logical_layout() {
        let (kd, vd) = (3, 5);
        let logical: Vec<f32> = (0..kd * vd).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut stored = vec![bf16::ZERO; kd * vd];
        store_head(
            &logical,
            StateLayout::VFirst,
            kd,
            vd,
            StoreMode::Nearest,
            0,
            &mut stored,
        );
        // element (k, v) lives at v * K + k
        assert_eq!(stored[4 * kd + 2].to_f32(), logical[2 * vd + 4]);
        let mut back = vec![0.0; kd * vd];
        load_head(&stored, StateLayout::VFirst, kd, vd, &mut back);
        assert_eq!(back, logical);
    }
}
