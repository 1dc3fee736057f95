//! Element types and rounding of state stores, bit-for-bit what the GPU kernels do
//! (`kernels/kda_common.cuh` mirrors every function here).
//!
//! Loads up-cast exactly to f32. Stores round to nearest even, or stochastically with a
//! counter-based RNG: [`sr_base`] hashes (seed, layer, slot, epoch) once per slot and store,
//! [`sr_bits`] hashes that with the element's offset inside the slot's ssm plane.

use half::{bf16, f16};
use state_pool::{Dtype, Rounding};

/// lowbias32: a bijective 32-bit integer hash (Wellons), cheap on a GPU.
#[inline]
pub fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x
}

/// The per-(seed, layer, slot, epoch) base of the stochastic-rounding stream.
#[inline]
pub fn sr_base(seed: u64, layer: u32, slot: u32, epoch: u32) -> u32 {
    let s = mix32(seed as u32 ^ mix32((seed >> 32) as u32 ^ 0x9e37_79b9));
    mix32(mix32(mix32(s ^ layer) ^ slot) ^ epoch)
}

/// The random bits for element `elem` (its offset in the slot's ssm plane) of a stream.
#[inline]
pub fn sr_bits(base: u32, elem: u32) -> u32 {
    mix32(base ^ elem.wrapping_mul(0x9e37_79b9))
}

/// Stochastic rounding of `x` to bf16 with random bits `r`: rounds away from zero with
/// probability equal to the discarded fraction of an ulp.
#[inline]
pub fn sr_bf16(x: f32, r: u32) -> bf16 {
    if !x.is_finite() {
        return bf16::from_f32(x);
    }
    let bits = x.to_bits().wrapping_add(r & 0xffff) & 0xffff_0000;
    bf16::from_bits((bits >> 16) as u16)
}

/// Stochastic rounding of `x` to fp16 with random bits `r` (subnormals included; values that
/// round to nearest to infinity give infinity, others saturate at the largest finite value).
#[inline]
pub fn sr_f16(x: f32, r: u32) -> f16 {
    if !x.is_finite() {
        return f16::from_f32(x);
    }
    let m = x.abs();
    if m >= 65520.0 {
        return f16::from_f32(x);
    }
    // Exponent of m, clamped at fp16's smallest normal exponent; the fp16 ulp is 2^(e-10).
    let e = if m >= 6.103_515_6e-5 {
        ((m.to_bits() >> 23) as i32) - 127
    } else {
        -14
    };
    let ulp = f32::from_bits(((e - 10 + 127) as u32) << 23);
    let inv_ulp = f32::from_bits(((127 - (e - 10)) as u32) << 23);
    let lo = (m * inv_ulp).floor() * ulp;
    let frac = (m - lo) * inv_ulp;
    let u = (r >> 8) as f32 * (1.0 / 16_777_216.0);
    let y = if u < frac { lo + ulp } else { lo };
    f16::from_f32(y.min(65504.0).copysign(x))
}

/// An element type of the pool or of kernel inputs.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The matching [`Dtype`].
    const DTYPE: Dtype;
    /// Exact up-cast.
    fn load(self) -> f32;
    /// Round to nearest even.
    fn store(x: f32) -> Self;
    /// Stochastic rounding with random bits `r` (exact for f32).
    fn store_sr(x: f32, r: u32) -> Self;
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::Fp32;
    #[inline]
    fn load(self) -> f32 {
        self
    }
    #[inline]
    fn store(x: f32) -> Self {
        x
    }
    #[inline]
    fn store_sr(x: f32, _r: u32) -> Self {
        x
    }
}

impl Element for f16 {
    const DTYPE: Dtype = Dtype::Fp16;
    #[inline]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline]
    fn store(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline]
    fn store_sr(x: f32, r: u32) -> Self {
        sr_f16(x, r)
    }
}

impl Element for bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    #[inline]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline]
    fn store(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline]
    fn store_sr(x: f32, r: u32) -> Self {
        sr_bf16(x, r)
    }
}

/// How one slot's state is stored in one call: nearest, or stochastic with a stream base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreMode {
    /// Round to nearest even.
    Nearest,
    /// Stochastic with the stream base from [`sr_base`].
    Stochastic(u32),
}

impl StoreMode {
    /// The store mode of `slot` in `layer` at `epoch` under the pool's rounding.
    pub fn for_slot(rounding: Rounding, layer: usize, slot: u32, epoch: u64) -> Self {
        match rounding {
            Rounding::Nearest => Self::Nearest,
            Rounding::Stochastic { seed } => {
                Self::Stochastic(sr_base(seed, layer as u32, slot, epoch as u32))
            }
        }
    }

    /// Rounds `x`, the element at offset `elem` of the slot's ssm plane.
    #[inline]
    pub fn round<E: Element>(self, x: f32, elem: usize) -> E {
        match self {
            Self::Nearest => E::store(x),
            Self::Stochastic(base) => E::store_sr(x, sr_bits(base, elem as u32)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stochastic_bf16_brackets_and_is_unbiased() {
        let x = 1.0f32 + 0.3 * 2f32.powi(-7); // 30% of the way to the next bf16
        let lo = bf16::from_f32(1.0);
        let hi = bf16::from_bits(lo.to_bits() + 1);
        let mut up = 0;
        for i in 0..20000u32 {
            let y = sr_bf16(x, sr_bits(sr_base(7, 1, 2, 3), i));
            assert!(y == lo || y == hi, "{y} not a neighbour of {x}");
            up += (y == hi) as u32;
        }
        let p = up as f64 / 20000.0;
        assert!((p - 0.3).abs() < 0.02, "rounded up with p={p}");
    }

    #[test]
    fn stochastic_f16_brackets_and_is_unbiased_in_normal_and_subnormal_range() {
        for &(base, frac) in &[(1.5f32, 0.7f32), (-3.0e-6, 0.25), (1000.0, 0.5)] {
            let lo = f16::from_f32(base);
            let hi = f16::from_bits(lo.to_bits() + 1);
            let x = lo.to_f32() + frac * (hi.to_f32() - lo.to_f32());
            let mut up = 0;
            for i in 0..20000u32 {
                let y = sr_f16(x, sr_bits(sr_base(11, 0, 5, 9), i));
                assert!(y == lo || y == hi, "{y} not a neighbour of {x}");
                up += (y == hi) as u32;
            }
            let p = up as f64 / 20000.0;
            assert!(
                (p - frac as f64).abs() < 0.02,
                "x={x}: rounded up with p={p}"
            );
        }
    }

    #[test]
    fn stochastic_rounding_keeps_representable_values_exact() {
        for v in [0.0f32, -2.0, 0.5, 65504.0, 6.0e-8] {
            for r in [0u32, 0xffff_ffff, 0x1234_5678] {
                let h = f16::from_f32(v);
                assert_eq!(sr_f16(h.to_f32(), r), h);
                assert_eq!(sr_bf16(bf16::from_f32(v).to_f32(), r), bf16::from_f32(v));
            }
        }
    }
}
