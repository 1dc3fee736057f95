//! Relative errors of host-side f32 results against a reference.

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
    fn relative_error_is_scale_free() {
        let want = [3.0f32, 4.0];
        let got = [3.0f32, 4.5];
        assert!((rel_frobenius(&got, &want) - 0.1).abs() < 1e-12);
        let want10: Vec<f32> = want.iter().map(|x| x * 10.0).collect();
        let got10: Vec<f32> = got.iter().map(|x| x * 10.0).collect();
        assert!((rel_frobenius(&got10, &want10) - 0.1).abs() < 1e-12);
    }
}
