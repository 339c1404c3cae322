//! Reductions with a fixed evaluation order (docs/kernels.md section 8).
//!
//! Floating-point sums depend on their order; fixing the order here (eight strided accumulators,
//! a fixed combining tree, no fused multiply-add) is what lets a SIMD or WGSL path reproduce the
//! scalar reference bit for bit.

/// Number of interleaved accumulators; matches one AVX2 register of f32 or two of f64.
pub const LANES: usize = 8;

#[inline]
pub(crate) fn combine_f32(acc: &[f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

#[inline]
pub(crate) fn combine_f64(acc: &[f64; LANES]) -> f64 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// Dot product of two equal-length float32 slices in the fixed order.
///
/// Equivalent to `sum(a * b)` up to rounding; accumulator `j` sums `a[i] * b[i]` for
/// `i = j (mod 8)`.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        acc[i % LANES] += x * y;
    }
    combine_f32(&acc)
}

/// Euclidean norm of a float32 slice, accumulated in float64 (never overflows for finite f32
/// input), returned in float64.
#[inline]
pub fn norm_f64(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; LANES];
    for (i, &v) in x.iter().enumerate() {
        let v = f64::from(v);
        acc[i % LANES] += v * v;
    }
    combine_f64(&acc).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_exact_small_integers() {
        let a: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..37).map(|i| (i % 5) as f32 - 2.0).collect();
        let exact: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| f64::from(*x) * f64::from(*y))
            .sum();
        assert_eq!(f64::from(dot(&a, &b)), exact);
    }

    #[test]
    fn norm_does_not_overflow_for_large_values() {
        let x = vec![1e30f32; 16];
        let n = norm_f64(&x);
        assert!((n / (4.0 * 1e30) - 1.0).abs() < 1e-6);
    }
}
