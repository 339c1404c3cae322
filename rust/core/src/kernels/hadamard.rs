//! Randomized Walsh-Hadamard rotation `R = H diag(s) / sqrt(d')` with zero padding to the next
//! power of two (docs/kernels.md section 3).

use std::sync::Arc;

use super::{check_finite, check_head_dim, check_len, rows_of};
use crate::alloc::output_vec;
use crate::error::{KvqError, Result};
use crate::memo::Memo;
use crate::par;
use crate::rng::rotation_signs;
use crate::simd::{ops, Isa, IsaChoice};

/// The padded dimension `d'`: the next power of two >= `head_dim`.
pub fn padded_dim(head_dim: usize) -> usize {
    head_dim.next_power_of_two()
}

/// In-place unnormalised Sylvester fast Walsh-Hadamard transform; `x.len()` must be a power of
/// two. Butterflies `(a, b) -> (a + b, a - b)` over strides 1, 2, 4, ...
pub fn fwht_inplace(x: &mut [f32]) {
    crate::simd::scalar::fwht(x);
}

/// A rotation for one head_dim and seed (`seed = None`: the plain orthonormal transform).
#[derive(Debug, Clone)]
pub struct Rotation {
    head_dim: usize,
    padded: usize,
    signs: Option<Vec<f32>>,
    scale: f32,
    /// `sign_i * scale` (the factor of coordinate i in the forward pass), for the SIMD paths.
    mult: Vec<f32>,
    /// `scale` repeated, the factor of the inverse pass.
    inv_mult: Vec<f32>,
    /// The sign bit of `sign_i` (0 or 0x8000_0000): multiplying by -1 is flipping that bit.
    sign_bits: Vec<u32>,
    isa: IsaChoice,
}

impl Rotation {
    /// Builds the rotation; errors if `head_dim < 2`.
    pub fn new(head_dim: usize, seed: Option<u64>) -> Result<Self> {
        check_head_dim("head_dim", head_dim)?;
        let padded = padded_dim(head_dim);
        let signs = seed.map(|s| rotation_signs(s, padded));
        let scale = 1.0 / (padded as f32).sqrt();
        let (mult, sign_bits) = match &signs {
            Some(s) => (
                s.iter().map(|s| s * scale).collect(),
                s.iter().map(|s| s.to_bits() & 0x8000_0000).collect(),
            ),
            None => (vec![scale; padded], vec![0; padded]),
        };
        Ok(Self {
            head_dim,
            padded,
            signs,
            scale,
            mult,
            inv_mult: vec![scale; padded],
            sign_bits,
            isa: IsaChoice::default(),
        })
    }

    /// A shared rotation for (head_dim, seed), built once (its signs are a keyed random
    /// stream): decode attention builds one per call. The cache holds at most 256.
    pub fn cached(head_dim: usize, seed: u64) -> Result<Arc<Self>> {
        static CACHE: Memo<(usize, u64), Rotation> = Memo::new(256);
        CACHE.get_or_try((head_dim, seed), || Self::new(head_dim, Some(seed)))
    }

    /// Pins the instruction set (tests, benches); errors if this CPU lacks it.
    pub fn with_isa(mut self, isa: Isa) -> Result<Self> {
        self.isa = IsaChoice::pinned(isa)?;
        Ok(self)
    }

    /// The instruction set calls use now.
    pub fn isa(&self) -> Isa {
        self.isa.get()
    }

    /// The input dimension `d`.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The rotated (padded) dimension `d'`.
    pub fn padded_dim(&self) -> usize {
        self.padded
    }

    /// `sign_i * scale`, the forward factors (for fused encoders).
    pub(crate) fn mult(&self) -> &[f32] {
        &self.mult
    }

    /// The inverse's sign bits (for fused decoders).
    pub(crate) fn sign_bits(&self) -> &[u32] {
        &self.sign_bits
    }

    /// The `1/sqrt(d')` factor.
    pub(crate) fn scale(&self) -> f32 {
        self.scale
    }

    /// `out = R [x, 0]` for one row (`x.len() == d`, `out.len() == d'`).
    /// The 1/sqrt(d') scaling comes first so that no butterfly stage can exceed the row norm
    /// (a finite input with a finite norm never overflows).
    pub fn forward_row(&self, x: &[f32], out: &mut [f32]) {
        self.forward_row_isa(self.isa(), x, out);
    }

    pub(crate) fn forward_row_isa(&self, isa: Isa, x: &[f32], out: &mut [f32]) {
        out[..self.head_dim].copy_from_slice(x);
        out[self.head_dim..].fill(0.0);
        if isa != Isa::Scalar {
            // `mult_i = sign_i * scale` is the same float32 product the reference forms.
            return ops::fwht(isa, out, Some(&self.mult));
        }
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
        self.inverse_row_isa(self.isa(), y, out);
    }

    pub(crate) fn inverse_row_isa(&self, isa: Isa, y: &mut [f32], out: &mut [f32]) {
        if isa != Isa::Scalar {
            ops::fwht(isa, y, Some(&self.inv_mult));
            // `v * sign` is exactly `v` with its sign bit flipped where sign = -1.
            return ops::finish(isa, y, &self.sign_bits, 1.0, out);
        }
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
        let mut out = output_vec(rows * self.padded);
        self.forward_into(x, &mut out)?;
        Ok(out)
    }

    /// [`Rotation::forward`] into a caller's buffer of `rows * d'` values (reused across calls,
    /// it saves the page faults of a fresh output).
    pub fn forward_into(&self, x: &[f32], out: &mut [f32]) -> Result<()> {
        let isa = self.isa();
        let (d, n) = (self.head_dim, self.padded);
        let rows = rows_of("x", x.len(), d)?;
        check_len("out", out.len(), rows * n, "rows x padded dim")?;
        // A non-finite input makes every output of its row non-finite, so checking the outputs
        // (in cache) covers the inputs; the full input scan runs only to name an error.
        let done = par::rows1(
            rows,
            n,
            (x, d),
            (out, n),
            || (),
            |_, first, xs, os| {
                for (k, (src, dst)) in xs.chunks_exact(d).zip(os.chunks_exact_mut(n)).enumerate() {
                    self.forward_row_isa(isa, src, dst);
                    if !ops::all_finite(isa, dst) {
                        return Err(first + k);
                    }
                }
                Ok(())
            },
        );
        if let Err(row) = done {
            check_finite("x", x, d)?;
            return Err(KvqError::NormOverflow { arg: "x", row });
        }
        Ok(())
    }

    /// Un-rotates rows of `d'` values into rows of `d` values.
    pub fn inverse(&self, y: &[f32]) -> Result<Vec<f32>> {
        let isa = self.isa();
        let (d, n) = (self.head_dim, self.padded);
        let rows = rows_of("y", y.len(), n)?;
        let mut out = output_vec(rows * d);
        let done = par::rows1(
            rows,
            n,
            (y, n),
            (&mut out, d),
            || vec![0.0f32; n],
            |scratch, first, ys, os| {
                for (k, (src, dst)) in ys.chunks_exact(n).zip(os.chunks_exact_mut(d)).enumerate() {
                    scratch.copy_from_slice(src);
                    self.inverse_row_isa(isa, scratch, dst);
                    // Every output depends on every input, so the kept outputs cover the row.
                    if !ops::all_finite(isa, dst) {
                        return Err(first + k);
                    }
                }
                Ok(())
            },
        );
        if let Err(row) = done {
            check_finite("y", y, n)?;
            return Err(KvqError::NormOverflow { arg: "y", row });
        }
        Ok(out)
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
    fn a_cached_rotation_is_shared_and_equals_a_new_one() {
        let x: Vec<f32> = (0..96).map(|i| (i as f32 - 40.0) / 7.0).collect();
        let (a, b) = (
            Rotation::cached(96, 5).unwrap(),
            Rotation::cached(96, 5).unwrap(),
        );
        assert!(Arc::ptr_eq(&a, &b));
        let want = Rotation::new(96, Some(5)).unwrap().forward(&x).unwrap();
        assert_eq!(a.forward(&x).unwrap(), want);
        assert!(!Arc::ptr_eq(&a, &Rotation::cached(96, 6).unwrap()));
        assert!(Rotation::cached(1, 5).is_err());
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
