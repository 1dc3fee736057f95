//! Typed access to host buffers: element slices, up-casting loads into f32 rows, rounding
//! stores, and one head's state moved between the pool's layout and a logical `[K][V]` f32
//! array.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use state_pool::{HostBuffer, StateLayout};

use crate::rounding::{Element, StoreMode};

/// Round to nearest even f32 -> bf16, bit for bit `bf16::from_f32` (NaN stays a quiet NaN),
/// written without branches so that a loop of it vectorises.
#[inline]
pub(crate) fn bf16_bits_nearest(x: f32) -> u16 {
    let b = x.to_bits();
    let nan = ((b >> 16) | 0x0040) as u16;
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    if b & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }
}

/// Whole-row conversions of an element type: exact up-casts and nearest-even stores, the same
/// values as [`Element::load`] and [`Element::store`] element by element, in a form that
/// vectorises (the hot loops never dispatch on a dtype).
pub(crate) trait Bulk: Element {
    /// Up-casts `src` into `dst` (same length).
    fn load_slice(src: &[Self], dst: &mut [f32]);
    /// Rounds `src` to nearest even into `dst` (same length).
    fn store_slice(src: &[f32], dst: &mut [Self]);
}

impl Bulk for f32 {
    #[inline]
    fn load_slice(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline]
    fn store_slice(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Bulk for f16 {
    #[inline]
    fn load_slice(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    #[inline]
    fn store_slice(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Bulk for bf16 {
    #[inline]
    fn load_slice(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
    #[inline]
    fn store_slice(src: &[f32], dst: &mut [bf16]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = bf16::from_bits(bf16_bits_nearest(s));
        }
    }
}

/// The first `len` elements of `buf` as `T` (the caller has validated the length).
pub(crate) fn elems<T: bytemuck::Pod>(buf: &HostBuffer, len: usize) -> &[T] {
    bytemuck::cast_slice(&buf.bytes()[..len * std::mem::size_of::<T>()])
}

/// The first `len` elements of `buf` as `T`, mutable (the caller has validated the length).
pub(crate) fn elems_mut<T: bytemuck::Pod>(buf: &mut HostBuffer, len: usize) -> &mut [T] {
    bytemuck::cast_slice_mut(&mut buf.bytes_mut()[..len * std::mem::size_of::<T>()])
}

/// Loads one head's stored state (`kd * vd` elements in `layout`) into a logical `[K][V]`
/// f32 array.
pub(crate) fn load_head<S: Bulk>(
    src: &[S],
    layout: StateLayout,
    kd: usize,
    vd: usize,
    dst: &mut [f32],
) {
    match layout {
        StateLayout::KFirst => S::load_slice(src, dst),
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
pub(crate) fn store_head<S: Bulk>(
    src: &[f32],
    layout: StateLayout,
    kd: usize,
    vd: usize,
    mode: StoreMode,
    elem_base: usize,
    dst: &mut [S],
) {
    match (layout, mode) {
        (StateLayout::KFirst, StoreMode::Nearest) => S::store_slice(src, dst),
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

    /// Edge values and a sweep of bit patterns, including NaNs, infinities, subnormals and
    /// exact ties.
    fn probe_values() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-40,
            65504.0,
            65519.0,
            65520.0,
            6.0e-8,
            3.0e-8,
            2.98e-8,
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xffc0_1234),
            f32::from_bits(0x7f7f_ffff),
        ];
        let mut x = 0x9e37_79b9u32;
        for i in 0..200_000u32 {
            x = crate::rounding::mix32(x ^ i);
            v.push(f32::from_bits(x));
            v.push(f32::from_bits((x & 0xffff_0000) | 0x8000)); // bf16 ties
            v.push(f32::from_bits((x & 0xffff_e000) | 0x1000)); // fp16 ties (normal range)
        }
        v
    }

    #[test]
    fn bulk_conversions_give_the_bits_of_the_element_conversions() {
        let src = probe_values();
        let mut b = vec![bf16::ZERO; src.len()];
        bf16::store_slice(&src, &mut b);
        let mut h = vec![f16::ZERO; src.len()];
        f16::store_slice(&src, &mut h);
        for (i, &x) in src.iter().enumerate() {
            assert_eq!(
                b[i].to_bits(),
                bf16::from_f32(x).to_bits(),
                "bf16 store of {x:e} ({:#x})",
                x.to_bits()
            );
            let want = f16::from_f32(x);
            if want.is_nan() {
                assert!(h[i].is_nan(), "f16 store of a NaN");
            } else {
                assert_eq!(
                    h[i].to_bits(),
                    want.to_bits(),
                    "f16 store of {x:e} ({:#x})",
                    x.to_bits()
                );
            }
        }
        let mut back = vec![0.0f32; src.len()];
        bf16::load_slice(&b, &mut back);
        for (i, &y) in back.iter().enumerate() {
            assert_eq!(y.to_bits(), b[i].to_f32().to_bits(), "bf16 load");
        }
        f16::load_slice(&h, &mut back);
        for (i, &y) in back.iter().enumerate() {
            let want = h[i].to_f32();
            assert!(
                y.to_bits() == want.to_bits() || (y.is_nan() && want.is_nan()),
                "f16 load"
            );
        }
    }

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
