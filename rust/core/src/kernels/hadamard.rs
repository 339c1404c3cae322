//! Randomized Walsh-Hadamard rotation `R = H diag(s) / sqrt(d')` with zero padding to the next
//! power of two (SPEC 2.2; docs/kernels.md section 3).

use super::{check_finite, check_head_dim, rows_of};
use crate::error::{KvqError, Result};
use crate::rng::rotation_signs;

/// The padded dimension `d'`: the next power of two >= `head_dim`.
pub fn padded_dim(head_dim: usize) -> usize {
    head_dim.next_power_of_two()
}

/// In-place unnormalised Sylvester fast Walsh-Hadamard transform; `x.len()` must be a power of
/// two. Butterflies `(a, b) -> (a + b, a - b)` over strides 1, 2, 4, ...
pub fn fwht_inplace(x: &mut [f32]) {
    debug_assert!(x.len().is_power_of_two());
    let n = x.len();
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = block.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (u, v) = (*a, *b);
                *a = u + v;
                *b = u - v;
            }
        }
        h *= 2;
    }
}

/// A rotation for one head_dim and seed (`seed = None`: the plain orthonormal transform).
#[derive(Debug, Clone)]
pub struct Rotation {
    head_dim: usize,
    padded: usize,
    signs: Option<Vec<f32>>,
    scale: f32,
}

impl Rotation {
    /// Builds the rotation; errors if `head_dim < 2`.
    pub fn new(head_dim: usize, seed: Option<u64>) -> Result<Self> {
        check_head_dim("head_dim", head_dim)?;
        let padded = padded_dim(head_dim);
        Ok(Self {
            head_dim,
            padded,
            signs: seed.map(|s| rotation_signs(s, padded)),
            scale: 1.0 / (padded as f32).sqrt(),
        })
    }

    /// The input dimension `d`.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The rotated (padded) dimension `d'`.
    pub fn padded_dim(&self) -> usize {
        self.padded
    }

    /// `out = R [x, 0]` for one row (`x.len() == d`, `out.len() == d'`).
    /// The 1/sqrt(d') scaling comes first so that no butterfly stage can exceed the row norm
    /// (a finite input with a finite norm never overflows).
    pub fn forward_row(&self, x: &[f32], out: &mut [f32]) {
        out[..self.head_dim].copy_from_slice(x);
        out[self.head_dim..].fill(0.0);
        match &self.signs {
            Some(s) => out
                .iter_mut()
                .zip(s)
                .for_each(|(v, s)| *v *= s * self.scale),
            None => out.iter_mut().for_each(|v| *v *= self.scale),
        }
        fwht_inplace(out);
    }

    /// `out = (R^T y)[..d]` for one row; `y` (length d') is used as scratch.
    pub fn inverse_row(&self, y: &mut [f32], out: &mut [f32]) {
        y.iter_mut().for_each(|v| *v *= self.scale);
        fwht_inplace(y);
        if let Some(s) = &self.signs {
            y.iter_mut().zip(s).for_each(|(v, s)| *v *= s);
        }
        out.copy_from_slice(&y[..self.head_dim]);
    }

    /// Rotates rows of `d` values into rows of `d'` values. Errors on a ragged buffer or
    /// non-finite input.
    pub fn forward(&self, x: &[f32]) -> Result<Vec<f32>> {
        let rows = rows_of("x", x.len(), self.head_dim)?;
        check_finite("x", x, self.head_dim)?;
        let mut out = vec![0.0f32; rows * self.padded];
        for (i, (src, dst)) in x
            .chunks_exact(self.head_dim)
            .zip(out.chunks_exact_mut(self.padded))
            .enumerate()
        {
            self.forward_row(src, dst);
            check_overflow("x", i, dst)?;
        }
        Ok(out)
    }

    /// Un-rotates rows of `d'` values into rows of `d` values.
    pub fn inverse(&self, y: &[f32]) -> Result<Vec<f32>> {
        let rows = rows_of("y", y.len(), self.padded)?;
        check_finite("y", y, self.padded)?;
        let mut out = vec![0.0f32; rows * self.head_dim];
        let mut scratch = vec![0.0f32; self.padded];
        for (i, (src, dst)) in y
            .chunks_exact(self.padded)
            .zip(out.chunks_exact_mut(self.head_dim))
            .enumerate()
        {
            scratch.copy_from_slice(src);
            self.inverse_row(&mut scratch, dst);
            check_overflow("y", i, dst)?;
        }
        Ok(out)
    }
}

/// Finite inputs near the float32 maximum can overflow in the butterflies: report, never
/// return infinities.
fn check_overflow(arg: &'static str, row: usize, out: &[f32]) -> Result<()> {
    if out.iter().all(|v| v.is_finite()) {
        Ok(())
    } else {
        Err(KvqError::NormOverflow { arg, row })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fwht_of_unit_vector_is_a_hadamard_row() {
        let mut x = vec![0.0f32; 8];
        x[0] = 1.0;
        fwht_inplace(&mut x);
        assert_eq!(x, vec![1.0; 8]);
    }

    #[test]
    fn inverse_undoes_forward_with_padding() {
        for d in [2usize, 3, 40, 64, 80, 96, 112, 160] {
            let rot = Rotation::new(d, Some(11)).unwrap();
            let x: Vec<f32> = (0..3 * d)
                .map(|i| ((i * 37 % 17) as f32 - 8.0) / 3.0)
                .collect();
            let y = rot.forward(&x).unwrap();
            assert_eq!(y.len(), 3 * rot.padded_dim());
            let back = rot.inverse(&y).unwrap();
            for (a, b) in x.iter().zip(&back) {
                assert!((a - b).abs() < 1e-5 * (1.0 + a.abs()), "d={d}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn overflow_is_an_error_not_infinity() {
        let rot = Rotation::new(2, None).unwrap();
        assert!(matches!(
            rot.forward(&[3e38, 3e38]),
            Err(KvqError::NormOverflow { row: 0, .. })
        ));
    }

    #[test]
    fn large_rows_with_a_finite_norm_do_not_overflow() {
        let rot = Rotation::new(128, Some(1)).unwrap();
        let y = rot.forward(&[1e37; 128]).unwrap();
        assert!(y.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn preserves_norm() {
        let rot = Rotation::new(100, Some(3)).unwrap();
        let x: Vec<f32> = (0..100).map(|i| (i as f32).sin()).collect();
        let y = rot.forward(&x).unwrap();
        let nx: f32 = x.iter().map(|v| v * v).sum();
        let ny: f32 = y.iter().map(|v| v * v).sum();
        assert!((nx - ny).abs() < 1e-4 * nx);
    }
}
