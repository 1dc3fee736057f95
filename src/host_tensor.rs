//! Host-side conversions between f32 values and the bytes of an element type
//! (little-endian, round to nearest even on the way down, exact on the way up).

use half::{bf16, f16};
use state_pool::Dtype;

/// The bytes of `values` in `dtype`, rounded to nearest even for the 2-byte types.
pub fn encode(values: &[f32], dtype: Dtype) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    match dtype {
        Dtype::Fp32 => values
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        Dtype::Fp16 => values
            .iter()
            .for_each(|&x| out.extend_from_slice(&f16::from_f32(x).to_bits().to_le_bytes())),
        Dtype::Bf16 => values
            .iter()
            .for_each(|&x| out.extend_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes())),
    }
    out
}

/// The values held by `bytes` of `dtype`, up-cast exactly to f32 (`bytes.len()` must be a
/// multiple of the element size; a trailing partial element is ignored).
pub fn decode(bytes: &[u8], dtype: Dtype) -> Vec<f32> {
    match dtype {
        Dtype::Fp32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::Fp16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
    }
}

/// `x` rounded to the nearest bf16 and widened back (the value a bf16 tensor would hold).
pub fn round_to_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Relative Frobenius error `||got - want|| / ||want||`, accumulated in f64. Empty or zero
/// references give the absolute norm of the difference.
pub fn rel_frobenius(got: &[f32], want: &[f32]) -> f64 {
    let mut acc = ErrorAccumulator::default();
    acc.add(got, want);
    acc.relative()
}

/// Running sums for a relative Frobenius error over many pieces.
#[derive(Debug, Clone, Copy, Default)]
pub struct ErrorAccumulator {
    diff_sq: f64,
    ref_sq: f64,
}

impl ErrorAccumulator {
    /// Adds one piece (`got` and `want` of equal length).
    pub fn add(&mut self, got: &[f32], want: &[f32]) {
        debug_assert_eq!(got.len(), want.len());
        for (&g, &w) in got.iter().zip(want) {
            let d = g as f64 - w as f64;
            self.diff_sq += d * d;
            self.ref_sq += w as f64 * w as f64;
        }
    }

    /// `sqrt(sum diff^2 / sum ref^2)`; NaN anywhere gives NaN.
    pub fn relative(&self) -> f64 {
        if self.ref_sq > 0.0 {
            (self.diff_sq / self.ref_sq).sqrt()
        } else {
            self.diff_sq.sqrt()
        }
    }

    /// Starts over.
    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_then_decode_round_trips_representable_values() {
        let values = [1.5f32, -0.25, 3.0e-3, 1024.0, -7.75];
        for dtype in Dtype::ALL {
            let back = decode(&encode(&values, dtype), dtype);
            assert_eq!(back.len(), values.len());
            for (b, v) in back.iter().zip(values) {
                let tol = match dtype {
                    Dtype::Fp32 => 0.0,
                    Dtype::Fp16 => v.abs() * 2f32.powi(-11),
                    Dtype::Bf16 => v.abs() * 2f32.powi(-8),
                };
                assert!((b - v).abs() <= tol, "{dtype}: {v} came back as {b}");
            }
        }
    }

    #[test]
    fn encode_rounds_to_nearest_even() {
        // 1 + 2^-9 lies halfway between two bf16 neighbours of 1; ties go to the even one (1).
        let x = 1.0f32 + 2f32.powi(-9);
        assert_eq!(decode(&encode(&[x], Dtype::Bf16), Dtype::Bf16), vec![1.0]);
        let y = 1.0f32 + 3.0 * 2f32.powi(-9);
        assert_eq!(
            decode(&encode(&[y], Dtype::Bf16), Dtype::Bf16),
            vec![1.0 + 2f32.powi(-7)]
        );
    }

    #[test]
    fn relative_error_is_scale_free() {
        let want = [3.0f32, 4.0];
        let got = [3.0f32, 4.5];
        assert!((rel_frobenius(&got, &want) - 0.1).abs() < 1e-12);
        let want10: Vec<f32> = want.iter().map(|x| x * 10.0).collect();
        let got10: Vec<f32> = got.iter().map(|x| x * 10.0).collect();
        assert!((rel_frobenius(&got10, &want10) - 0.1).abs() < 1e-12);
    }
}
